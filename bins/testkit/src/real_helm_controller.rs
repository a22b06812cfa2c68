//! Flux's real helm-controller, built by `make tools` from its published Go
//! module, running against the local control plane.
//!
//! One helm-controller per test process, started on first use beside the
//! control plane and stopped with it (see [`crate::process`]). It watches all
//! namespaces, so tests keep apart by namespace as they do anyway.
//!
//! helm-controller only reads a source's `status.artifact` and downloads
//! `artifact.url`, checking `artifact.digest`. A test binary either runs the
//! real source-controller ([`crate::source_controller`]) and pushes its chart
//! to the real registry ([`crate::registry`]), or plays source-controller with
//! [`serve_demo_chart`]: it writes that status on the HelmChart helm-controller
//! creates from `spec.chart`, pointing at the demo chart on the loopback
//! [`crate::artifact_server`]. Never both in one test binary: the real
//! source-controller would reconcile those HelmCharts too, and find no
//! HelmRepository behind them.

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::GroupVersionKind;
use plunger::names;
use serde_json::{Value, json};

use crate::artifact_server::artifact_server;
use crate::chart::{CHART_NAME, CHART_VERSION, ChartArchive, configmap_name, demo_chart};
use crate::fixtures::TestNamespace;
use crate::flux_controller::{FluxController, pinned_version, scratch_dir};

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
    let started = HELM_CONTROLLER.get_or_init(|| {
        std::thread::spawn(HelmController::start)
            .join()
            .map_err(|_| "the helm-controller start thread panicked".to_owned())?
            .map_err(|e| format!("{e:#}"))
    });
    match started {
        Ok(controller) => controller,
        Err(e) => panic!("helm-controller did not start: {e}"),
    }
}

/// The helm-controller version this process runs: `$FLUX_PLUNGER_HELM_CONTROLLER_VERSION`,
/// else the pin in `hack/tools/versions.mk`.
pub fn selected_version() -> Result<String> {
    pinned_version(VERSION_ENV, "HELM_CONTROLLER_VERSION")
}

impl HelmController {
    fn start() -> Result<Self> {
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

/// The name helm-controller gives the HelmChart of a release's `spec.chart`
/// template: `<namespace>-<name>`.
pub fn helmchart_name(namespace: &str, release: &str) -> String {
    format!("{namespace}-{release}")
}

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
                "sourceRef": {"kind": "HelmRepository", "name": "demo"},
                "interval": "1h",
            }},
            "install": {"disableWait": true},
            "upgrade": {"disableWait": true},
            "uninstall": {"disableWait": true},
            "values": values,
        },
    })
}

/// Creates the demo HelmRelease `name` in `ns`, then plays source-controller
/// for the HelmChart helm-controller creates from it.
pub async fn create_demo_release(
    ns: &TestNamespace,
    name: &str,
    values: Value,
) -> Result<DynamicObject> {
    let object: DynamicObject = serde_json::from_value(demo_release(&ns.name, name, values))?;
    let created = ns
        .releases()
        .create(&PostParams::default(), &object)
        .await?;
    serve_demo_chart(ns, name).await?;
    Ok(created)
}

/// Waits for helm-controller to create the HelmChart of release `name`, then
/// writes the status source-controller would: ready, with an artifact whose
/// URL serves the demo chart and whose digest matches it.
pub async fn serve_demo_chart(ns: &TestNamespace, name: &str) -> Result<DynamicObject> {
    serve_chart(ns, name, CHART_NAME, CHART_VERSION, demo_chart()?).await
}

/// As [`serve_demo_chart`], for any packaged chart: `chart_name` at
/// `chart_version` served from `archive`.
pub async fn serve_chart(
    ns: &TestNamespace,
    name: &str,
    chart_name_in_archive: &str,
    chart_version: &str,
    archive: ChartArchive,
) -> Result<DynamicObject> {
    let charts: Api<DynamicObject> =
        Api::namespaced_with(ns.client.clone(), &ns.name, &helmchart_resource());
    let chart_name = helmchart_name(&ns.name, name);
    let chart = wait_for(
        &format!(
            "helm-controller to create HelmChart {}/{chart_name}",
            ns.name
        ),
        || {
            let charts = charts.clone();
            let chart_name = chart_name.clone();
            async move { Ok(charts.get_opt(&chart_name).await?) }
        },
    )
    .await?;
    let path = format!(
        "helmchart/{}/{chart_name}/{chart_name_in_archive}-{chart_version}.tgz",
        ns.name
    );
    let size = archive.bytes.len();
    let url = artifact_server().publish(&path, archive.bytes);
    let generation = chart
        .metadata
        .generation
        .context("HelmChart without a generation")?;
    let now = "2026-01-01T00:00:00Z";
    let status = json!({"status": {
        "observedGeneration": generation,
        "observedChartName": chart_name_in_archive,
        "conditions": [{
            "type": "Ready", "status": "True", "reason": "ChartPullSucceeded",
            "message": format!("pulled '{chart_name_in_archive}' chart with version '{chart_version}'"),
            "lastTransitionTime": now, "observedGeneration": generation,
        }],
        "artifact": {
            "path": path, "url": url, "revision": chart_version,
            "digest": archive.digest, "lastUpdateTime": now, "size": size,
        },
    }});
    Ok(charts
        .patch_status(&chart_name, &PatchParams::default(), &Patch::Merge(&status))
        .await?)
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

/// True if the HelmChart helm-controller made for release `name` exists.
pub async fn helmchart_exists(ns: &TestNamespace, name: &str) -> Result<bool> {
    let charts: Api<DynamicObject> =
        Api::namespaced_with(ns.client.clone(), &ns.name, &helmchart_resource());
    Ok(charts
        .get_opt(&helmchart_name(&ns.name, name))
        .await?
        .is_some())
}
