//! Flux's real helm-controller, built by `make tools` from its published Go
//! module, running against the local control plane.
//!
//! One helm-controller per test process, started on first use beside the
//! control plane and stopped with it (see [`crate::process`]). It watches all
//! namespaces, so tests keep apart by namespace as they do anyway.
//!
//! Its charts come the way a cluster's do: [`publish_chart`] `helm push`es a
//! chart to the test world's registry ([`crate::registry`]) and writes the OCI
//! `HelmRepository` a release's `spec.chart` names; the real source-controller
//! ([`crate::source_controller`]) builds the artifact of the `HelmChart`
//! helm-controller creates from `spec.chart`, and helm-controller downloads it
//! from there. Nothing writes a source's status by hand.

use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ApiResource, DynamicObject, PostParams};
use kube::core::GroupVersionKind;
use plunger::names;
use serde_json::{Value, json};

use crate::chart::{CHART_NAME, CHART_VERSION, ChartArchive, configmap_name, demo_chart};
use crate::fixtures::TestNamespace;
use crate::flux_controller::{FluxController, pinned_version, scratch_dir};
use crate::registry::{PushedChart, registry};
use crate::source_controller::source_controller;

/// Names the helm-controller version to run (e.g. `v1.6.0`); unset, the
/// version pinned as `HELM_CONTROLLER_VERSION` in `hack/tools/versions.mk`.
pub const VERSION_ENV: &str = "FLUX_PLUNGER_HELM_CONTROLLER_VERSION";

/// How long helm-controller may take to serve its readiness probe.
pub const START_TIMEOUT: Duration = crate::flux_controller::START_TIMEOUT;

/// How long a test waits for helm-controller to act on a change. Generous:
/// two cores run the apiserver, etcd, helm-controller and the tests.
pub const ACT_TIMEOUT: Duration = Duration::from_secs(90);

/// The running helm-controller of this test process.
pub struct HelmController {
    /// The version running, e.g. `v1.6.4`.
    pub version: String,
    /// Its log (console encoding).
    pub log: PathBuf,
    /// Its readiness endpoint, `http://127.0.0.1:PORT/readyz`.
    pub readyz: String,
    controller: FluxController,
}

static HELM_CONTROLLER: OnceLock<Result<HelmController, String>> = OnceLock::new();

/// The helm-controller of this test process, started on first use (with the
/// control plane, if that is not up yet).
pub fn helm_controller() -> &'static HelmController {
    crate::started::once(&HELM_CONTROLLER, "helm-controller", HelmController::start)
}

/// The helm-controller version this process runs: `$FLUX_PLUNGER_HELM_CONTROLLER_VERSION`,
/// else the pin in `hack/tools/versions.mk`.
pub fn selected_version() -> Result<String> {
    pinned_version(VERSION_ENV, "HELM_CONTROLLER_VERSION")
}

/// How many times a start is tried: the health port [`FluxController::start`]
/// gives helm-controller is one found free a moment before, and should another
/// socket take it first, helm-controller exits; a start with a new port
/// follows.
const START_ATTEMPTS: usize = 3;

impl HelmController {
    fn start() -> Result<Self> {
        crate::started::with_retries("helm-controller", START_ATTEMPTS, Self::start_once)
    }

    fn start_once() -> Result<Self> {
        let version = selected_version()?;
        let dir = scratch_dir("flux-plunger-hc-")?;
        let args = vec![
            "--watch-all-namespaces=true".to_owned(),
            // No notification-controller: events go to the apiserver only.
            "--events-addr=".to_owned(),
            // A source that is not ready yet is looked at again soon, not
            // after the default 30 s.
            "--requeue-dependency=2s".to_owned(),
            // Artifacts are served on loopback: a failed fetch is a bug,
            // retrying it nine times only hides it.
            "--http-retry=1".to_owned(),
            "--graceful-shutdown-timeout=5s".to_owned(),
        ];
        let controller = FluxController::start("helm-controller", &version, &dir, args, &[])?;
        Ok(Self {
            version,
            log: controller.log.clone(),
            readyz: controller.readyz.clone(),
            controller,
        })
    }

    /// The last `lines` lines of helm-controller's log, for failure messages.
    pub fn log_tail(&self, lines: usize) -> String {
        self.controller.log_tail(lines)
    }

    /// The lines of helm-controller's log that mention `needle`.
    pub fn log_lines_with(&self, needle: &str) -> Vec<String> {
        self.controller.log_lines_with(needle)
    }

    /// True while helm-controller runs.
    pub fn is_running(&self) -> bool {
        self.controller.is_running()
    }
}

/// Flux's HelmChart (source-controller's API).
pub fn helmchart_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("source.toolkit.fluxcd.io", "v1", "HelmChart"),
        "helmcharts",
    )
}

/// Flux's HelmRepository (source-controller's API).
pub fn helmrepository_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("source.toolkit.fluxcd.io", "v1", "HelmRepository"),
        "helmrepositories",
    )
}

/// The name helm-controller gives the HelmChart of a release's `spec.chart`
/// template: `<namespace>-<name>`.
pub fn helmchart_name(namespace: &str, release: &str) -> String {
    format!("{namespace}-{release}")
}

/// The HelmRepository every [`demo_release`] takes its chart from, in the
/// release's namespace ([`publish_chart`] writes it).
pub const CHART_REPOSITORY: &str = "demo";

/// A HelmRelease of the demo chart as a user writes one (client-side create):
/// no readiness wait (nothing here ever becomes ready but a ConfigMap is ready
/// at once anyway), a long interval so only the test's changes trigger work.
pub fn demo_release(namespace: &str, name: &str, values: Value) -> Value {
    json!({
        "apiVersion": names::HELMRELEASE_API_VERSION,
        "kind": names::HELMRELEASE_KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "interval": "1h",
            "chart": {"spec": {
                "chart": CHART_NAME,
                "version": CHART_VERSION,
                "sourceRef": {"kind": "HelmRepository", "name": CHART_REPOSITORY},
                "interval": "1h",
            }},
            "install": {"disableWait": true},
            "upgrade": {"disableWait": true},
            "uninstall": {"disableWait": true},
            "values": values,
        },
    })
}

/// The OCI HelmRepository [`CHART_REPOSITORY`] of `namespace`, holding the
/// charts under `url` (`oci://HOST/REPOSITORY`), as a user writes one. No
/// `certSecretRef`: source-controller trusts the registry's CA as its system
/// roots (see [`crate::source_controller`]).
pub fn chart_repository(namespace: &str, url: &str) -> Value {
    json!({
        "apiVersion": "source.toolkit.fluxcd.io/v1",
        "kind": "HelmRepository",
        "metadata": {"name": CHART_REPOSITORY, "namespace": namespace},
        "spec": {"type": "oci", "url": url, "interval": "1h"},
    })
}

/// Publishes `archive` (the packaged chart `chart_name` at `chart_version`)
/// for the releases of `ns`, as a user publishes a chart: `helm push`ed to
/// the registry's repository named after `ns` (so tests keep apart), and the
/// OCI HelmRepository [`CHART_REPOSITORY`] naming that repository. The real
/// source-controller (started here on first use) pulls it from there for the
/// HelmChart of each release's `spec.chart`.
///
/// Call it before creating a release that needs it: a HelmChart whose
/// HelmRepository is missing fails, and source-controller looks at it again
/// only after its backoff (an OCI HelmRepository has no artifact whose change
/// would wake it). Publishing the same chart again is harmless: the push
/// writes the same manifest under the same tag, and an existing
/// HelmRepository is kept. One namespace holds one chart per name and
/// version: source-controller keeps the artifact it built for a version.
pub async fn publish_chart(
    ns: &TestNamespace,
    chart_name: &str,
    chart_version: &str,
    archive: ChartArchive,
) -> Result<PushedChart> {
    let (repository, name, version) = (
        ns.name.clone(),
        chart_name.to_owned(),
        chart_version.to_owned(),
    );
    // Starting the servers and `helm push` block: off the test's runtime, so
    // the other releases a test sets up at once go on meanwhile.
    let pushed = tokio::task::spawn_blocking(move || {
        source_controller();
        registry().push_chart(&repository, &name, &version, &archive)
    })
    .await
    .context("the chart push panicked")??;
    let repositories: Api<DynamicObject> =
        Api::namespaced_with(ns.client.clone(), &ns.name, &helmrepository_resource());
    let url = format!("oci://{}/{}", registry().host, ns.name);
    match repositories
        .create(
            &PostParams::default(),
            &serde_json::from_value(chart_repository(&ns.name, &url))?,
        )
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(status)) if status.code == 409 => {}
        Err(e) => return Err(e).context("creating the HelmRepository"),
    }
    Ok(pushed)
}

/// [`publish_chart`] of the demo chart.
pub async fn publish_demo_chart(ns: &TestNamespace) -> Result<PushedChart> {
    publish_chart(ns, CHART_NAME, CHART_VERSION, demo_chart()?).await
}

/// Creates HelmRelease `release` (a manifest such as [`demo_release`] writes,
/// its chart published already) and waits until source-controller has made
/// its HelmChart ready ([`wait_for_chart`]).
pub async fn create_release(ns: &TestNamespace, release: Value) -> Result<DynamicObject> {
    let name = release["metadata"]["name"]
        .as_str()
        .context("a HelmRelease without a name")?
        .to_owned();
    let object: DynamicObject = serde_json::from_value(release)?;
    let created = ns
        .releases()
        .create(&PostParams::default(), &object)
        .await?;
    wait_for_chart(ns, &name).await?;
    Ok(created)
}

/// Publishes the demo chart in `ns` ([`publish_demo_chart`]), creates the
/// demo HelmRelease `name` there and waits until its HelmChart is ready.
pub async fn create_demo_release(
    ns: &TestNamespace,
    name: &str,
    values: Value,
) -> Result<DynamicObject> {
    publish_demo_chart(ns).await?;
    create_release(ns, demo_release(&ns.name, name, values)).await
}

/// Waits until the HelmChart helm-controller creates for release `name` is
/// ready as source-controller reports it: `Ready=True` for its generation,
/// with an artifact. On timeout the error carries the HelmChart's status and
/// source-controller's log tail.
pub async fn wait_for_chart(ns: &TestNamespace, name: &str) -> Result<DynamicObject> {
    let charts: Api<DynamicObject> =
        Api::namespaced_with(ns.client.clone(), &ns.name, &helmchart_resource());
    let chart_name = helmchart_name(&ns.name, name);
    let last_status = Mutex::new(Value::Null);
    let (charts, chart_name_ref, last) = (&charts, &chart_name, &last_status);
    wait_for(
        &format!(
            "source-controller to make HelmChart {}/{chart_name} ready",
            ns.name
        ),
        || async move {
            let Some(chart) = charts.get_opt(chart_name_ref).await? else {
                return Ok(None);
            };
            let status = &chart.data["status"];
            *last.lock().unwrap() = status.clone();
            let ready = status["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| {
                    c["type"] == "Ready"
                        && c["status"] == "True"
                        && c["observedGeneration"].as_i64() == chart.metadata.generation
                });
            Ok((ready && status["artifact"].is_object()).then_some(chart))
        },
    )
    .await
    .with_context(|| {
        let controller = &source_controller().controller;
        format!(
            "HelmChart {}/{chart_name} status: {:#}\nsource-controller (running: {}) log tail:\n{}",
            ns.name,
            last_status.lock().unwrap(),
            controller.is_running(),
            controller.log_tail(40)
        )
    })
}

/// Polls `probe` until it yields `Some`, for at most [`ACT_TIMEOUT`]. On
/// timeout the error names `what` and carries helm-controller's log tail.
pub async fn wait_for<T, F, Fut>(what: &str, mut probe: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Option<T>>>,
{
    let deadline = Instant::now() + ACT_TIMEOUT;
    let mut last_error = None;
    loop {
        match probe().await {
            Ok(Some(value)) => return Ok(value),
            Ok(None) => {}
            Err(e) => last_error = Some(e),
        }
        if Instant::now() > deadline {
            let log = HELM_CONTROLLER
                .get()
                .and_then(|c| c.as_ref().ok())
                .map(|c| c.log_tail(60))
                .unwrap_or_default();
            let error = last_error
                .map(|e| format!(" (last error: {e:#})"))
                .unwrap_or_default();
            bail!(
                "timed out after {}s waiting for {what}{error}\nhelm-controller log tail:\n{log}",
                ACT_TIMEOUT.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The demo chart's ConfigMap of `release`, if it exists.
pub async fn demo_configmap(ns: &TestNamespace, release: &str) -> Result<Option<ConfigMap>> {
    let configmaps: Api<ConfigMap> = Api::namespaced(ns.client.clone(), &ns.name);
    Ok(configmaps.get_opt(&configmap_name(release)).await?)
}

/// True if the HelmChart helm-controller made for release `name` exists. One
/// being deleted is waited out (source-controller's finalizer holds it until
/// source-controller has removed its artifact): it is gone.
pub async fn helmchart_exists(ns: &TestNamespace, name: &str) -> Result<bool> {
    let charts: Api<DynamicObject> =
        Api::namespaced_with(ns.client.clone(), &ns.name, &helmchart_resource());
    let chart_name = helmchart_name(&ns.name, name);
    let (charts, chart_name_ref) = (&charts, &chart_name);
    wait_for(
        &format!("HelmChart {}/{chart_name} deleted or not", ns.name),
        || async move {
            Ok(match charts.get_opt(chart_name_ref).await? {
                None => Some(false),
                Some(chart) if chart.metadata.deletion_timestamp.is_some() => None,
                Some(_) => Some(true),
            })
        },
    )
    .await
}
