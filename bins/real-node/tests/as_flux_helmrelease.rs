//! The chart used as Flux users use it: a HelmRelease of the component,
//! installed, upgraded and deleted by the real helm-controller, its pods and
//! its pre-delete hook Job run by the node.
//!
//! A test binary of its own, run in a sandbox of its own (`make test-node`):
//! the real helm-controller reconciles every HelmRelease of its control
//! plane, so it must not meet the other node tests' hand-made releases.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use kube::Api;
use kube::api::{DynamicObject, Patch, PatchParams, PostParams};
use plunger::names;
use real_node::{OnNode, name_of};
use testkit::chart::ChartArchive;
use testkit::real_helm_controller::{helm_controller, serve_chart};

/// The HelmRelease's name; helm-controller names the Helm release after it,
/// and the chart its objects (the name already says flux-plunger).
const NAME: &str = "flux-plunger";

/// `spec.uninstall.timeout` of the HelmRelease, as the README recommends.
const UNINSTALL_TIMEOUT: &str = "5m";

/// The chart packaged by `helm package`, with its name and version.
fn packaged_chart(dir: &std::path::Path) -> Result<(String, ChartArchive)> {
    let output = chart_contract::helm()?
        .arg("package")
        .arg(chart_contract::chart_dir())
        .arg("--destination")
        .arg(dir)
        .output()?;
    chart_contract::install::succeeded(output.clone(), "helm package")?;
    let path = String::from_utf8_lossy(&output.stdout)
        .trim()
        .rsplit(": ")
        .next()
        .map(std::path::PathBuf::from)
        .context("helm package named no file")?;
    let version = path
        .file_stem()
        .and_then(|s| s.to_str())
        .and_then(|s| s.strip_prefix("flux-plunger-"))
        .context("an unexpected package name")?
        .to_owned();
    Ok((version, ChartArchive::from_bytes(std::fs::read(&path)?)))
}

/// How long helm-controller may take over an install or upgrade: its own
/// action timeout (five minutes by default) and a little more, so a slow node
/// fails helm-controller's action before it fails the test.
const ACTION_TIMEOUT: Duration = Duration::from_secs(330);

/// Waits (at most `timeout`) until `check` holds of the HelmRelease.
async fn wait_release(
    on: &OnNode,
    what: &str,
    timeout: Duration,
    check: impl Fn(Option<&DynamicObject>) -> bool,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let release = on.ns().releases().get_opt(NAME).await?;
        if check(release.as_ref()) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "timed out waiting for {what}: {:#?}\npods:\n{}\nhelm-controller log:\n{}\n{}",
                release.map(|r| r.data.get("status").cloned()),
                on.pods_summary().await,
                helm_controller().log_tail(40),
                on.node.logs_for_failure()
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// `Ready=True` for the current generation.
fn ready_at_current_generation(release: Option<&DynamicObject>) -> bool {
    let Some(release) = release else { return false };
    let status = release.data.get("status");
    let observed = status
        .and_then(|s| s.get("observedGeneration"))
        .and_then(serde_json::Value::as_i64);
    let ready = status
        .and_then(|s| s.get("conditions"))
        .and_then(serde_json::Value::as_array)
        .is_some_and(|c| {
            c.iter()
                .any(|c| c["type"] == "Ready" && c["status"] == "True")
        });
    ready && observed == release.metadata.generation
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_as_a_flux_helmrelease_installs_upgrades_and_uninstalls_on_the_node() -> Result<()>
{
    let _turn = testkit::cluster_wide_turn().await;
    let mut on = OnNode::new("node-flux").await?;
    on.release = NAME.to_owned();
    on.fullname = NAME.to_owned();
    helm_controller();
    let outcome = install_upgrade_and_delete(&on).await;
    if outcome.is_err() {
        // A cluster-wide flux-plunger left running would act on the next
        // tests' fences: let helm-controller uninstall it before failing.
        let _ = on.ns().releases().delete(NAME, &Default::default()).await;
        let _ = wait_release(
            &on,
            "the release to go after a failure",
            ACTION_TIMEOUT,
            |r| r.is_none(),
        )
        .await;
    }
    outcome
}

async fn install_upgrade_and_delete(on: &OnNode) -> Result<()> {
    let ns = on.ns();
    let dir = tempfile::tempdir()?;
    let (version, archive) = packaged_chart(dir.path())?;
    let (repository, tag) = on.node.image.rsplit_once(':').context("image tag")?;
    let release: DynamicObject = serde_json::from_value(serde_json::json!({
        "apiVersion": names::HELMRELEASE_API_VERSION,
        "kind": names::HELMRELEASE_KIND,
        "metadata": {"name": NAME, "namespace": ns.name},
        "spec": {
            "interval": "1h",
            "chart": {"spec": {
                "chart": "flux-plunger", "version": version,
                "sourceRef": {"kind": "HelmRepository", "name": "flux-plunger"}, "interval": "1h",
            }},
            // As the README says to: above the hook's 240 s.
            "uninstall": {"timeout": UNINSTALL_TIMEOUT, "disableHooks": false},
            // helm-controller waits for the Deployment to be ready.
            "values": {
                "shutdownGracePeriodSeconds": 90,
                "image": {"repository": repository, "tag": tag},
            },
        },
    }))?;
    ns.releases()
        .create(&PostParams::default(), &release)
        .await?;
    serve_chart(ns, NAME, "flux-plunger", &version, archive).await?;
    wait_release(
        on,
        "the install",
        ACTION_TIMEOUT,
        ready_at_current_generation,
    )
    .await?;
    let first = on.ready_pod(None).await?;
    let grace = |pod: &k8s_openapi::api::core::v1::Pod| {
        pod.spec
            .as_ref()
            .and_then(|s| s.termination_grace_period_seconds)
    };
    ensure!(
        grace(&first) == Some(90),
        "the pod's grace period is {:?}",
        grace(&first)
    );

    // G 90 -> 120: a new pod template, rolled out by helm-controller's
    // upgrade (a server-side apply with Helm 4), the strategy kept.
    ns.releases()
        .patch(
            NAME,
            &PatchParams::default(),
            &Patch::Merge(
                serde_json::json!({"spec": {"values": {"shutdownGracePeriodSeconds": 120}}}),
            ),
        )
        .await?;
    wait_release(
        on,
        "the upgrade",
        ACTION_TIMEOUT,
        ready_at_current_generation,
    )
    .await?;
    let second = on.ready_pod(Some(&name_of(&first))).await?;
    ensure!(
        grace(&second) == Some(120),
        "after the upgrade the pod's grace period is {:?}",
        grace(&second)
    );
    on.wait_lease_held_by(&name_of(&second)).await?;
    let deployments: Api<Deployment> = Api::namespaced(ns.client.clone(), &ns.name);
    let deployment = deployments.get(NAME).await?;
    let strategy = deployment
        .spec
        .as_ref()
        .and_then(|s| s.strategy.as_ref())
        .context("strategy")?;
    let rolling = strategy.rolling_update.as_ref().context("rollingUpdate")?;
    ensure!(
        strategy.type_.as_deref() == Some("RollingUpdate")
            && rolling.max_surge
                == Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(0)),
        "the strategy after the upgrade: {strategy:?}"
    );

    // Delete: helm-controller uninstalls, the pre-delete hook Job first.
    ns.releases().delete(NAME, &Default::default()).await?;
    wait_release(on, "the release to go", real_node::POD_TIMEOUT * 2, |r| {
        r.is_none()
    })
    .await?;
    // The hook ran to completion inside helm-controller's uninstall timeout
    // (and its own deadline), and the uninstall went on after it.
    let hook = on.completed_hook_job().await?;
    let status = hook.status.as_ref().context("the hook's status")?;
    let (started, completed) = (
        status.start_time.as_ref().context("started")?.0,
        status.completion_time.as_ref().context("completed")?.0,
    );
    let took = std::time::Duration::try_from(completed - started)?;
    let deadline = hook
        .spec
        .as_ref()
        .and_then(|s| s.active_deadline_seconds)
        .context("the hook's deadline")?;
    ensure!(
        took.as_secs() < deadline as u64 && took < std::time::Duration::from_secs(300),
        "the hook took {took:?} (its deadline {deadline} s, the uninstall timeout {UNINSTALL_TIMEOUT})"
    );
    // The component goes cleanly: nothing of the chart but the hook's Job,
    // kept for its report until its TTL, and the hook's own objects.
    ensure!(
        deployments.get_opt(NAME).await?.is_none(),
        "the Deployment is left"
    );
    ensure!(on.lease().await?.is_none(), "the Lease is left");
    ensure!(
        on.pods()
            .list(&kube::api::ListParams::default().labels(&on.selector()))
            .await?
            .items
            .is_empty(),
        "controller pods are left"
    );
    let service_accounts: Api<k8s_openapi::api::core::v1::ServiceAccount> =
        Api::namespaced(ns.client.clone(), &ns.name);
    ensure!(
        service_accounts.get_opt(NAME).await?.is_none(),
        "the controller's ServiceAccount is left"
    );
    let cluster_roles: Api<k8s_openapi::api::rbac::v1::ClusterRole> = Api::all(ns.client.clone());
    ensure!(
        cluster_roles.get_opt(NAME).await?.is_none(),
        "the controller's ClusterRole is left"
    );
    let policies: Api<DynamicObject> = Api::all_with(
        ns.client.clone(),
        &kube::api::ApiResource {
            group: "admissionregistration.k8s.io".into(),
            version: "v1".into(),
            api_version: "admissionregistration.k8s.io/v1".into(),
            kind: "ValidatingAdmissionPolicy".into(),
            plural: "validatingadmissionpolicies".into(),
        },
    );
    ensure!(
        policies.get_opt(NAME).await?.is_none(),
        "the admission guard is left"
    );
    Ok(())
}
