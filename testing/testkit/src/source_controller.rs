//! Flux's real source-controller, built by `make tools` from its published Go
//! module, running against the local control plane: it pulls charts from the
//! test world's OCI registry ([`crate::registry`]) for `OCIRepository`
//! objects and for the `HelmChart`s of OCI `HelmRepository` objects, keeps
//! them in its storage directory and serves them, on a loopback port, to
//! helm-controller, as a cluster's source-controller does.
//!
//! One source-controller per test process, started on first use and stopped
//! with it (see [`crate::process`]). It watches all namespaces.

use std::net::TcpStream;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use kube::api::ApiResource;
use kube::core::GroupVersionKind;
use serde_json::{Value, json};

use crate::control_plane::{control_plane, free_port};
use crate::flux_controller::{FluxController, pinned_version, scratch_dir};
use crate::registry::PushedChart;

/// Names the source-controller version to run (e.g. `v1.9.3`); unset, the
/// version pinned as `SOURCE_CONTROLLER_VERSION` in `hack/tools/versions.mk`.
pub const VERSION_ENV: &str = "FLUX_PLUNGER_SOURCE_CONTROLLER_VERSION";

/// The running source-controller of this test process.
pub struct SourceController {
    /// The version running, e.g. `v1.9.3`.
    pub version: String,
    /// Where it keeps the artifacts it serves.
    pub storage: PathBuf,
    /// Its artifact server, `http://127.0.0.1:PORT`: the base of every
    /// artifact URL it writes into a source's status.
    pub artifacts_url: String,
    /// The process, its log and readiness.
    pub controller: FluxController,
}

static SOURCE_CONTROLLER: OnceLock<Result<SourceController, String>> = OnceLock::new();

/// The source-controller of this test process, started on first use (with the
/// control plane, if that is not up yet).
pub fn source_controller() -> &'static SourceController {
    crate::started::once(
        &SOURCE_CONTROLLER,
        "source-controller",
        SourceController::start,
    )
}

/// How many times a start is tried. source-controller needs the port of its
/// artifact server in advance (it writes it into every artifact URL), so the
/// port is one found free a moment before; should another socket take it
/// first, or the health port [`FluxController::start`] picks the same way,
/// source-controller exits, and a start with new ports follows.
const START_ATTEMPTS: usize = 3;

impl SourceController {
    fn start() -> Result<Self> {
        crate::started::with_retries("source-controller", START_ATTEMPTS, Self::start_once)
    }

    fn start_once() -> Result<Self> {
        let version = pinned_version(VERSION_ENV, "SOURCE_CONTROLLER_VERSION")?;
        // The control plane first: the artifact port is picked right before
        // source-controller binds it, not a control plane's start earlier.
        let ca = control_plane().pki().ca_cert.clone();
        let dir = scratch_dir("flux-plunger-sc-")?;
        let storage = dir.join("storage");
        std::fs::create_dir_all(&storage)?;
        let artifacts = format!("127.0.0.1:{}", free_port()?);
        let args = vec![
            "--watch-all-namespaces=true".to_owned(),
            // No notification-controller: events go to the apiserver only.
            "--events-addr=".to_owned(),
            format!("--storage-path={}", storage.display()),
            format!("--storage-addr={artifacts}"),
            // The host of the artifact URLs it writes: helm-controller
            // downloads from there, on loopback like everything here.
            format!("--storage-adv-addr={artifacts}"),
            // A source waiting on another is looked at again soon, not after
            // the default 30 s.
            "--requeue-dependency=2s".to_owned(),
        ];
        // The registry's certificate chains to the control plane's CA. As the
        // system's only roots, it is trusted as a public registry's is: an
        // OCIRepository needs no `certSecretRef` and reads as a user's.
        let controller = FluxController::start(
            "source-controller",
            &version,
            &dir,
            args,
            &[("SSL_CERT_FILE", ca.as_path())],
        )?;
        // Ready may come before the artifact server listens, and a port taken
        // meanwhile shows only as source-controller exiting.
        let deadline = Instant::now() + crate::flux_controller::START_TIMEOUT;
        let mut log = String::new();
        while TcpStream::connect(&artifacts).is_err() {
            if !controller.is_running() {
                bail!(
                    "source-controller exited before its artifact server listened on {artifacts}; \
                     its log:\n{log}"
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "source-controller's artifact server does not listen on {artifacts}; its log:\n{}",
                    controller.log_tail(40)
                );
            }
            log = controller.log_tail(40);
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(Self {
            version,
            storage,
            artifacts_url: format!("http://{artifacts}"),
            controller,
        })
    }
}

/// Flux's OCIRepository (`source.toolkit.fluxcd.io/v1`).
pub fn ocirepository_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("source.toolkit.fluxcd.io", "v1", "OCIRepository"),
        "ocirepositories",
    )
}

/// The `OCIRepository` of a chart pushed to the registry, as the README's
/// install writes one: a tag, and the chart's layer copied as it is (the
/// `.tgz` helm-controller loads).
pub fn chart_source(namespace: &str, name: &str, chart: &PushedChart) -> Value {
    json!({
        "apiVersion": "source.toolkit.fluxcd.io/v1",
        "kind": "OCIRepository",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "interval": "1h",
            "url": chart.url,
            "ref": {"tag": chart.tag},
            "layerSelector": {
                "mediaType": HELM_CHART_LAYER,
                "operation": "copy",
            },
        },
    })
}

/// The media type of a Helm chart's content layer in an OCI artifact.
pub const HELM_CHART_LAYER: &str = "application/vnd.cncf.helm.chart.content.v1.tar+gzip";
