//! flux-plunger installed as the README installs it with Flux: the chart
//! `helm push`ed to the test world's OCI registry, the README's
//! `OCIRepository` pulled by the real source-controller and its HelmRelease
//! (`chartRef`) installed by the real helm-controller, the image pulled by the
//! node's containerd from the same registry by digest. The node tier's Flux
//! tests and `make demo` install it so.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use kube::Api;
use kube::api::{DynamicObject, PostParams};
use serde_json::Value;
use testkit::chart::ChartArchive;
use testkit::real_helm_controller::helm_controller;
use testkit::registry::{PushedChart, registry};
use testkit::source_controller::{ocirepository_resource, source_controller};

use crate::OnNode;

/// The HelmRelease's name; helm-controller names the Helm release after it,
/// and the chart its objects (the name already says flux-plunger).
pub const NAME: &str = "flux-plunger";

/// `spec.uninstall.timeout` of the HelmRelease, as the README recommends.
pub const UNINSTALL_TIMEOUT: &str = "5m";

/// The README's install with Flux: the file it shows verbatim (a test of
/// `tests/as_flux_helmrelease.rs` checks it does), applied as it is but for
/// what a user fills in.
pub const README_INSTALL: &str = include_str!("../../../docs/install-with-flux.yaml");

/// What a user replaces in [`README_INSTALL`]: the registry's host, the
/// namespace and the pushed image's digest.
pub const EXAMPLE_REGISTRY: &str = "registry.example.com";
pub const EXAMPLE_NAMESPACE: &str = "namespace: flux-system";
pub const EXAMPLE_DIGEST: &str = "digest: sha256:...";

/// The registry repository the README pushes the chart into
/// (`helm push … oci://registry.example.com/charts`).
pub const CHART_REPOSITORY: &str = "charts";

/// The chart packaged by `helm package` (at `version`, or the chart's own),
/// with its name and version.
pub fn packaged_chart(
    dir: &std::path::Path,
    version: Option<&str>,
) -> Result<(String, ChartArchive)> {
    let mut command = chart_contract::helm()?;
    command
        .arg("package")
        .arg(chart_contract::chart_dir())
        .arg("--destination")
        .arg(dir);
    if let Some(version) = version {
        command.arg("--version").arg(version);
    }
    let output = command.output()?;
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

/// The chart packaged (at `version`, or its own) and `helm push`ed to the
/// registry's `charts` repository, as the README publishes it.
pub fn pushed_chart(version: Option<&str>) -> Result<PushedChart> {
    let dir = tempfile::tempdir()?;
    let (version, archive) = packaged_chart(dir.path(), version)?;
    registry().push_chart(CHART_REPOSITORY, "flux-plunger", &version, &archive)
}

/// The README's `OCIRepository` and HelmRelease in the test's namespace,
/// the registry's host and the pushed image's digest filled in, with `values`
/// over the README's (a test's own, e.g. two replicas). Checks they name the
/// chart and image the test pushed.
pub fn readme_objects(
    on: &OnNode,
    chart: &PushedChart,
    values: Value,
) -> Result<(DynamicObject, DynamicObject)> {
    let text = README_INSTALL
        .replace(EXAMPLE_REGISTRY, &registry().host)
        .replace(EXAMPLE_NAMESPACE, &format!("namespace: {}", on.ns().name))
        .replace(EXAMPLE_DIGEST, &format!("digest: {}", on.node.image.digest));
    let objects = chart_contract::Manifests::parse(&text)?;
    let source = objects.one("OCIRepository", false)?.clone();
    let mut release = objects.one("HelmRelease", false)?.clone();
    ensure!(
        source["spec"]["url"] == chart.url.as_str()
            && source["spec"]["ref"]["tag"] == chart.tag.as_str(),
        "the README's OCIRepository does not name the chart as pushed ({chart:?}): {source:#}"
    );
    ensure!(
        release["spec"]["chartRef"]["name"] == source["metadata"]["name"]
            && release["metadata"]["name"] == NAME
            && release["spec"]["uninstall"]["timeout"] == UNINSTALL_TIMEOUT,
        "the README's HelmRelease: {release:#}"
    );
    ensure!(
        release["spec"]["values"]["image"]["repository"] == on.node.image.repository.as_str(),
        "the README's image is not where the node's was pushed ({:?}): {release:#}",
        on.node.image
    );
    testkit::merge(&mut release["spec"]["values"], values);
    Ok((
        serde_json::from_value(source)?,
        serde_json::from_value(release)?,
    ))
}

/// Creates the README's objects (see [`readme_objects`]).
pub async fn install_as_the_readme_says(
    on: &OnNode,
    chart: &PushedChart,
    values: Value,
) -> Result<()> {
    let (source, release) = readme_objects(on, chart, values)?;
    sources(on).create(&PostParams::default(), &source).await?;
    on.ns()
        .releases()
        .create(&PostParams::default(), &release)
        .await?;
    Ok(())
}

pub fn sources(on: &OnNode) -> Api<DynamicObject> {
    Api::namespaced_with(
        on.ns().client.clone(),
        &on.ns().name,
        &ocirepository_resource(),
    )
}

/// How long helm-controller may take over an install or upgrade: its own
/// action timeout (five minutes by default) and a little more, so a slow node
/// fails helm-controller's action before it fails the test.
pub const ACTION_TIMEOUT: Duration = Duration::from_secs(330);

/// Waits (at most `timeout`) until `check` holds of the component's
/// HelmRelease.
pub async fn wait_release(
    on: &OnNode,
    what: &str,
    timeout: Duration,
    check: impl Fn(Option<&DynamicObject>) -> bool,
) -> Result<()> {
    wait_named(on, NAME, what, timeout, check).await
}

/// Waits (at most `timeout`) until `check` holds of HelmRelease `name`.
pub async fn wait_named(
    on: &OnNode,
    name: &str,
    what: &str,
    timeout: Duration,
    check: impl Fn(Option<&DynamicObject>) -> bool,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let release = on.ns().releases().get_opt(name).await?;
        if check(release.as_ref()) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "timed out waiting for {what} of {name}: {:#?}\npods:\n{}\nhelm-controller log:\n{}\n\
                 source-controller log:\n{}\n{}",
                release.map(|r| r.data.get("status").cloned()),
                on.pods_summary().await,
                helm_controller().log_tail(40),
                source_controller().controller.log_tail(20),
                on.node.logs_for_failure()
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// `Ready=True` for the current generation.
pub fn ready_at_current_generation(release: Option<&DynamicObject>) -> bool {
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

/// The chart version of the newest release helm-controller recorded.
pub fn installed_chart_version(release: &DynamicObject) -> Option<&str> {
    release.data["status"]["history"][0]["chartVersion"].as_str()
}
