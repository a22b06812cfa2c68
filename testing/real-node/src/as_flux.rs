//! flux-plunger installed as the README installs it with Flux: the chart
//! `helm push`ed to the test world's OCI registry, the README's
//! `OCIRepository` pulled by the real source-controller and its HelmRelease
//! (`chartRef`) installed by the real helm-controller, the image pulled by the
//! node's containerd from the same registry by digest. The node tier's Flux
//! tests and `make demo` install it so.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::api::{DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use plunger::names::{FENCE_FINALIZER, HELM_CONTROLLER_FINALIZER};
use serde_json::Value;
use testkit::chart::ChartArchive;
use testkit::real_helm_controller::helm_controller;
use testkit::registry::{PushedChart, PushedImage, registry};
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

/// A namespace of its own on the node for flux-plunger's HelmRelease, named
/// [`NAME`] (so are the Helm release and the chart's objects), with the real
/// helm- and source-controller running.
pub async fn on_node(prefix: &str) -> Result<OnNode> {
    let mut on = OnNode::new(prefix).await?;
    on.release = NAME.to_owned();
    on.fullname = NAME.to_owned();
    helm_controller();
    source_controller();
    Ok(on)
}

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

/// The README's `OCIRepository` and HelmRelease as JSON, in the test's
/// namespace, the registry's host filled in.
fn readme_json(on: &OnNode, image: &PushedImage) -> Result<(Value, Value)> {
    let text = README_INSTALL
        .replace(EXAMPLE_REGISTRY, &registry().host)
        .replace(EXAMPLE_NAMESPACE, &format!("namespace: {}", on.ns().name))
        .replace(EXAMPLE_DIGEST, &format!("digest: {}", image.digest));
    let objects = chart_contract::Manifests::parse(&text)?;
    let source = objects.one("OCIRepository", false)?.clone();
    let release = objects.one("HelmRelease", false)?.clone();
    ensure!(
        release["spec"]["chartRef"]["name"] == source["metadata"]["name"]
            && release["metadata"]["name"] == NAME
            && release["spec"]["uninstall"]["timeout"] == UNINSTALL_TIMEOUT,
        "the README's HelmRelease: {release:#}"
    );
    Ok((source, release))
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
    let (source, mut release) = readme_json(on, &on.node.image)?;
    ensure!(
        source["spec"]["url"] == chart.url.as_str()
            && source["spec"]["ref"]["tag"] == chart.tag.as_str(),
        "the README's OCIRepository does not name the chart as pushed ({chart:?}): {source:#}"
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

/// The README's objects installing another chart and image than today's
/// (the first release's): its `OCIRepository` moved to `chart`, its values
/// naming `image`.
pub fn objects_installing(
    on: &OnNode,
    chart: &PushedChart,
    image: &PushedImage,
) -> Result<(DynamicObject, DynamicObject)> {
    let (mut source, mut release) = readme_json(on, image)?;
    source["spec"]["url"] = chart.url.as_str().into();
    source["spec"]["ref"]["tag"] = chart.tag.as_str().into();
    release["spec"]["values"]["image"]["repository"] = image.repository.as_str().into();
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

/// Releases deleted while flux-plunger held their suspension and uninstall
/// fence, whose Helm uninstall an admission policy refuses: fences a rollout
/// of flux-plunger must keep (the uninstall they wait for has not run) and
/// hand to the next leader, never drop.
pub struct HeldDeletes {
    pub names: Vec<String>,
    refusal: testkit::Refusal,
}

/// Who set the fences [`HeldDeletes`] start from.
#[derive(Clone, Copy, Debug)]
pub enum FencedBy {
    /// flux-plunger as it is: the fence with its label.
    Today,
    /// The first release, which set the fence without a label.
    FirstRelease,
}

impl HeldDeletes {
    /// `count` releases of the demo chart from the registry, installed by
    /// helm-controller; then each left as a flux-plunger that stopped in the
    /// middle of recovering it leaves it (its suspension and fence, one
    /// server-side apply by manager flux-plunger, as `fenced_by` wrote them),
    /// and deleted: helm-controller skips the uninstall of the suspended
    /// release and drops its finalizer. The delete of each one's ConfigMap
    /// is refused, so the uninstall that follows the lift fails until
    /// [`HeldDeletes::let_uninstall`]. Run before flux-plunger is installed:
    /// no flux-plunger may lift them meanwhile.
    pub async fn create(on: &OnNode, count: usize, fenced_by: FencedBy) -> Result<Self> {
        let ns = on.ns();
        let names: Vec<String> = (0..count).map(|i| format!("held-{i}")).collect();
        let chart = registry().push_chart(
            &ns.name,
            testkit::chart::CHART_NAME,
            testkit::chart::CHART_VERSION,
            &testkit::chart::demo_chart()?,
        )?;
        for name in &names {
            create_release_from(on, name, &chart).await?;
        }
        for name in &names {
            wait_named(
                on,
                name,
                "installed",
                ACTION_TIMEOUT,
                ready_at_current_generation,
            )
            .await?;
        }
        let configmaps: Vec<String> = names
            .iter()
            .map(|n| testkit::chart::configmap_name(n))
            .collect();
        let refusal = ns
            .refuse(
                "held-configmaps",
                serde_json::json!({"apiGroups": [""], "apiVersions": ["v1"], "operations": ["DELETE"], "resources": ["configmaps"]}),
                &format!("!(oldObject.metadata.name in {configmaps:?})"),
                "test: the held releases' ConfigMaps are not to be deleted",
            )
            .await?;
        let held = Self { names, refusal };
        held.wait_refused(on, &configmaps[0]).await?;
        for name in &held.names {
            match fenced_by {
                FencedBy::Today => ns.apply_as_flux_plunger(name, true).await?,
                FencedBy::FirstRelease => ns.apply_as_older_flux_plunger(name, true).await?,
            };
        }
        for name in &held.names {
            wait_named(on, name, "the suspension seen", ACTION_TIMEOUT, |r| {
                r.is_some_and(observed)
            })
            .await?;
            ns.releases().delete(name, &Default::default()).await?;
        }
        for name in &held.names {
            wait_named(
                on,
                name,
                "the suspended delete handled",
                ACTION_TIMEOUT,
                |r| r.is_some_and(|r| !has_finalizer(r, HELM_CONTROLLER_FINALIZER) && observed(r)),
            )
            .await?;
        }
        Ok(held)
    }

    /// Waits until the apiserver enforces the refusal: a dry-run delete of
    /// `configmap` is refused.
    async fn wait_refused(&self, on: &OnNode, configmap: &str) -> Result<()> {
        let configmaps: Api<ConfigMap> = Api::namespaced(on.ns().client.clone(), &on.ns().name);
        let dry_run = DeleteParams {
            dry_run: true,
            ..DeleteParams::default()
        };
        testkit::eventually(ACTION_TIMEOUT, "the delete refusal in force", || async {
            Ok(configmaps.delete(configmap, &dry_run).await.is_err())
        })
        .await
    }

    /// Waits until the running flux-plunger took each over: its suspension
    /// lifted, its fence kept, and helm-controller's uninstall of the
    /// unsuspended generation refused.
    pub async fn wait_held(&self, on: &OnNode) -> Result<()> {
        for name in &self.names {
            wait_named(
                on,
                name,
                "the lift, the fence kept, the uninstall refused",
                ACTION_TIMEOUT,
                |r| {
                    r.is_some_and(|r| {
                        !suspended(r)
                            && has_finalizer(r, FENCE_FINALIZER)
                            && uninstall_failed_at_current_generation(r)
                    })
                },
            )
            .await?;
        }
        self.check_still_held(on).await
    }

    /// Checks that each is still held: being deleted, its fence on, its
    /// ConfigMap there (nothing has uninstalled it).
    pub async fn check_still_held(&self, on: &OnNode) -> Result<()> {
        for name in &self.names {
            let release = on.ns().releases().get_opt(name).await?;
            let release = release.with_context(|| {
                format!("{name} is gone: its fence was let go before its uninstall")
            })?;
            ensure!(
                release.metadata.deletion_timestamp.is_some()
                    && has_finalizer(&release, FENCE_FINALIZER),
                "{name} is not held: {:?}",
                release.metadata
            );
            ensure!(
                testkit::real_helm_controller::demo_configmap(on.ns(), name)
                    .await?
                    .is_some(),
                "the ConfigMap of {name} is gone while its uninstall is refused"
            );
        }
        Ok(())
    }

    /// Lifts the refusal and asks helm-controller to reconcile each (as
    /// `flux reconcile` does: its retries of the refused uninstall are far
    /// apart by now), then waits until each is uninstalled — its ConfigMap
    /// gone — and gone itself, flux-plunger having dropped the fence.
    pub async fn let_uninstall(self, on: &OnNode) -> Result<()> {
        self.refusal.lift().await?;
        for name in &self.names {
            let requested = format!("{:?}", std::time::SystemTime::now());
            on.ns()
                .releases()
                .patch(
                    name,
                    &PatchParams::default(),
                    &Patch::Merge(serde_json::json!({"metadata": {"annotations": {
                        "reconcile.fluxcd.io/requestedAt": requested,
                    }}})),
                )
                .await?;
        }
        for name in &self.names {
            wait_named(on, name, "uninstalled and gone", ACTION_TIMEOUT, |r| {
                r.is_none()
            })
            .await?;
            ensure!(
                testkit::real_helm_controller::demo_configmap(on.ns(), name)
                    .await?
                    .is_none(),
                "{name} is gone but its ConfigMap is left: the fence was let go without the uninstall"
            );
        }
        Ok(())
    }
}

/// The reason helm-controller gives a failed uninstall.
const UNINSTALL_FAILED: &str = "UninstallFailed";

/// Creates HelmRelease `name` in the test's namespace from `chart`, named by
/// `chartRef` through an `OCIRepository` of its own.
async fn create_release_from(on: &OnNode, name: &str, chart: &PushedChart) -> Result<()> {
    let ns = on.ns();
    sources(on)
        .create(
            &PostParams::default(),
            &serde_json::from_value(testkit::source_controller::chart_source(
                &ns.name, name, chart,
            ))?,
        )
        .await?;
    let mut release = testkit::real_helm_controller::demo_release(
        &ns.name,
        name,
        serde_json::json!({"greeting": "hello"}),
    );
    if let Some(spec) = release["spec"].as_object_mut() {
        spec.remove("chart");
    }
    testkit::merge(
        &mut release["spec"],
        serde_json::json!({"chartRef": {"kind": "OCIRepository", "name": name}}),
    );
    ns.releases()
        .create(&PostParams::default(), &serde_json::from_value(release)?)
        .await?;
    Ok(())
}

fn has_finalizer(release: &DynamicObject, finalizer: &str) -> bool {
    release
        .metadata
        .finalizers
        .as_ref()
        .is_some_and(|f| f.iter().any(|f| f == finalizer))
}

fn suspended(release: &DynamicObject) -> bool {
    release.data["spec"]["suspend"].as_bool() == Some(true)
}

/// helm-controller has handled the current generation.
fn observed(release: &DynamicObject) -> bool {
    release.data["status"]["observedGeneration"].as_i64() == release.metadata.generation
}

/// helm-controller's uninstall of the current generation failed: it says
/// so on `Released` (and `Ready`) for that generation; the status's own
/// `observedGeneration` moves only once a pass succeeds.
fn uninstall_failed_at_current_generation(release: &DynamicObject) -> bool {
    release.data["status"]["conditions"]
        .as_array()
        .is_some_and(|c| {
            c.iter().any(|c| {
                c["type"] == "Released"
                    && c["reason"] == UNINSTALL_FAILED
                    && c["observedGeneration"].as_i64() == release.metadata.generation
            })
        })
}

/// The first release as `make first-release` rebuilt it from its commit,
/// pushed to the registry as a user of it would have: its chart and image.
pub struct FirstRelease {
    pub chart: PushedChart,
    pub image: PushedImage,
}

/// Where `make first-release` writes the first release.
fn first_release_dir() -> std::path::PathBuf {
    testkit::control_plane::out_dir().join("first-release")
}

/// Pushes the first release's chart (to `first-release/charts`) and image
/// (to `first-release/flux-plunger`), each at the first release's version.
pub fn pushed_first_release() -> Result<FirstRelease> {
    let dir = first_release_dir();
    let package = std::fs::read_dir(&dir)
        .with_context(|| format!("{}: run make first-release", dir.display()))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .find(|path| {
            path.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("flux-plunger-") && n.ends_with(".tgz"))
        })
        .with_context(|| {
            format!(
                "no packaged chart in {}: run make first-release",
                dir.display()
            )
        })?;
    let version = package
        .file_stem()
        .and_then(|s| s.to_str())
        .and_then(|s| s.strip_prefix("flux-plunger-"))
        .context("an unexpected package name")?
        .to_owned();
    let archive = ChartArchive::from_bytes(std::fs::read(&package)?);
    let chart =
        registry().push_chart("first-release/charts", "flux-plunger", &version, &archive)?;
    let image = registry().push_image(
        &dir.join("flux-plunger.oci.tar"),
        "first-release/flux-plunger",
        &version,
    )?;
    Ok(FirstRelease { chart, image })
}
