//! A chart's way into a cluster as the README installs flux-plunger's:
//! `helm push` to an OCI registry, an `OCIRepository` that source-controller
//! pulls it through, and a HelmRelease whose `chartRef` names that source,
//! which helm-controller installs. All three are real here: testkit's registry
//! (HTTPS, trusted through the control plane's CA), Flux's source-controller
//! and helm-controller; nothing writes a source's status by hand.
//!
//! `make e2e` runs this file once per pinned helm-controller, each beside the
//! pinned source-controller.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use e2e::{Observed, wait_until};
use kube::api::{Api, DynamicObject, PostParams};
use plunger::names;
use serde_json::{Value, json};
use testkit::chart::{CHART_NAME, CHART_VERSION, demo_chart};
use testkit::real_helm_controller::{demo_configmap, helm_controller};
use testkit::registry::registry;
use testkit::source_controller::{chart_source, ocirepository_resource, source_controller};
use testkit::{TestNamespace, control_plane};

const RELEASE: &str = "demo";

/// How long source-controller may take to pull a pushed chart.
const PULL_TIMEOUT: Duration = Duration::from_secs(90);

#[tokio::test]
async fn a_chart_pushed_to_the_registry_is_installed_from_its_oci_repository() -> Result<()> {
    helm_controller();
    source_controller();
    let client = control_plane().client().await?;
    let ns = TestNamespace::create(&client, "oci-chart").await?;

    let pushed = registry().push_chart(&ns.name, CHART_NAME, CHART_VERSION, &demo_chart()?)?;
    let sources: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), &ns.name, &ocirepository_resource());
    sources
        .create(
            &PostParams::default(),
            &serde_json::from_value(chart_source(&ns.name, RELEASE, &pushed))?,
        )
        .await?;
    let release = json!({
        "apiVersion": names::HELMRELEASE_API_VERSION,
        "kind": names::HELMRELEASE_KIND,
        "metadata": {"name": RELEASE, "namespace": ns.name},
        "spec": {
            "interval": "1h",
            "chartRef": {"kind": "OCIRepository", "name": RELEASE},
            "values": {"greeting": "from the registry"},
        },
    });
    ns.releases()
        .create(&PostParams::default(), &serde_json::from_value(release)?)
        .await?;

    // source-controller pulled exactly what helm pushed: the revision of its
    // artifact is the tag at the manifest's digest.
    let artifact = wait_for_artifact(&sources, RELEASE).await?;
    assert_eq!(
        artifact["revision"],
        format!("{}@{}", pushed.tag, pushed.digest),
        "artifact: {artifact:#}"
    );

    wait_until(&ns, RELEASE, "Ready=True", Observed::is_ready).await?;
    let object = ns.releases().get(RELEASE).await?;
    let installed = &object.data["status"]["history"][0];
    assert_eq!(installed["chartName"], CHART_NAME, "history: {installed:#}");
    assert!(
        installed["chartVersion"]
            .as_str()
            .is_some_and(|v| v.starts_with(CHART_VERSION)),
        "history: {installed:#}"
    );
    let configmap = demo_configmap(&ns, RELEASE)
        .await?
        .context("the chart's ConfigMap is missing")?;
    assert_eq!(
        configmap
            .data
            .unwrap_or_default()
            .get("greeting")
            .map(String::as_str),
        Some("from the registry")
    );
    Ok(())
}

/// Waits until OCIRepository `name` is `Ready=True` with an artifact, and
/// returns that artifact; on timeout, the error carries source-controller's log.
async fn wait_for_artifact(sources: &Api<DynamicObject>, name: &str) -> Result<Value> {
    let deadline = Instant::now() + PULL_TIMEOUT;
    loop {
        let source = sources.get(name).await?;
        let status = &source.data["status"];
        let ready = status["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "Ready" && c["status"] == "True");
        if ready && status["artifact"].is_object() {
            return Ok(status["artifact"].clone());
        }
        if Instant::now() > deadline {
            bail!(
                "OCIRepository {name} has no ready artifact after {}s; its status: {status:#}\n\
                 source-controller log:\n{}",
                PULL_TIMEOUT.as_secs(),
                source_controller().controller.log_tail(40)
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
