//! End-to-end tests against Flux's real helm-controller (`make e2e`): the
//! tests live in `tests/`; this library holds what they share — a compact
//! view of the HelmRelease fields helm-controller writes, and the writes a
//! user, an operator or flux-plunger makes.
#![forbid(unsafe_code)]

use anyhow::{Context, Result};
use kube::api::{DeleteParams, DynamicObject, Patch, PatchParams};
use plunger::names;
use serde_json::{Value, json};
use testkit::TestNamespace;
use testkit::helm_storage::{revision_statuses, set_revision_status};
use testkit::real_helm_controller::{create_demo_release, wait_for};

/// The HelmRelease fields helm-controller reads and writes on its way
/// through install, upgrade, suspension and delete.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Observed {
    pub generation: i64,
    pub observed_generation: Option<i64>,
    pub finalizers: Vec<String>,
    pub deleting: bool,
    pub suspend: bool,
    /// `(status, reason, message)` of the `Ready` condition.
    pub ready: Option<(String, String, String)>,
    pub storage_namespace: Option<String>,
    pub history_len: usize,
}

impl Observed {
    pub fn of(obj: &DynamicObject) -> Self {
        let status = &obj.data["status"];
        let ready = status["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c["type"] == names::READY_CONDITION)
            .map(|c| {
                let field = |k: &str| c[k].as_str().unwrap_or_default().to_owned();
                (field("status"), field("reason"), field("message"))
            });
        Self {
            generation: obj.metadata.generation.unwrap_or_default(),
            observed_generation: status["observedGeneration"].as_i64(),
            finalizers: obj.metadata.finalizers.clone().unwrap_or_default(),
            deleting: obj.metadata.deletion_timestamp.is_some(),
            suspend: obj.data["spec"]["suspend"].as_bool().unwrap_or(false),
            ready,
            storage_namespace: status["storageNamespace"].as_str().map(str::to_owned),
            history_len: status["history"].as_array().map_or(0, Vec::len),
        }
    }

    /// helm-controller has handled the current generation.
    pub fn is_observed(&self) -> bool {
        self.observed_generation == Some(self.generation)
    }

    /// `Ready=True` for the current generation.
    pub fn is_ready(&self) -> bool {
        self.is_observed() && self.ready_status() == Some("True")
    }

    pub fn ready_status(&self) -> Option<&str> {
        self.ready.as_ref().map(|(s, _, _)| s.as_str())
    }

    pub fn ready_message(&self) -> Option<&str> {
        self.ready.as_ref().map(|(_, _, m)| m.as_str())
    }

    pub fn has_helm_controller_finalizer(&self) -> bool {
        self.finalizers
            .iter()
            .any(|f| f == names::HELM_CONTROLLER_FINALIZER)
    }
}

/// `(type, reason)` of the events flux-plunger recorded on release `name`,
/// each once, sorted.
pub async fn flux_plunger_events(ns: &TestNamespace, name: &str) -> Result<Vec<(String, String)>> {
    use plunger::notices::reasons;
    let ours = [
        reasons::SUSPENSION_NOT_OWNED,
        reasons::RECOVERY_DEFERRED,
        reasons::UNSUSPEND_FAILED,
        reasons::TERMINATING_WHILE_SUSPENDED,
        reasons::UNINSTALL_FENCE_HELD,
        reasons::RECOVERED,
        reasons::UNINSTALL_HANDED_OVER,
        reasons::RELEASED_WITHOUT_UNINSTALL,
    ];
    let mut seen: Vec<(String, String)> = ns
        .events_for(name)
        .await?
        .into_iter()
        .filter(|e| ours.contains(&e.reason.as_str()))
        .map(|e| (e.type_, e.reason))
        .collect();
    seen.sort();
    seen.dedup();
    Ok(seen)
}

/// The current state of release `name`, or `None` once it is gone.
pub async fn observe(ns: &TestNamespace, name: &str) -> Result<Option<Observed>> {
    Ok(ns.releases().get_opt(name).await?.map(|o| Observed::of(&o)))
}

/// Waits until release `name` satisfies `done`, and returns that state.
pub async fn wait_until(
    ns: &TestNamespace,
    name: &str,
    what: &str,
    done: impl Fn(&Observed) -> bool,
) -> Result<Observed> {
    let what = format!("HelmRelease {}/{name}: {what}", ns.name);
    let done = &done;
    wait_for(&what, || async move {
        let observed = observe(ns, name)
            .await?
            .context("the HelmRelease is gone")?;
        Ok(done(&observed).then_some(observed))
    })
    .await
}

/// Waits until release `name` is gone.
pub async fn wait_gone(ns: &TestNamespace, name: &str) -> Result<()> {
    let what = format!("HelmRelease {}/{name} to be gone", ns.name);
    wait_for(&what, || async move {
        Ok(observe(ns, name).await?.is_none().then_some(()))
    })
    .await
}

/// Creates the demo release with `greeting` and waits for the real
/// helm-controller to install it (`Ready=True` for its generation).
pub async fn install(ns: &TestNamespace, name: &str, greeting: &str) -> Result<Observed> {
    create_demo_release(ns, name, json!({ "greeting": greeting })).await?;
    wait_until(ns, name, "installed and Ready=True", Observed::is_ready).await
}

/// A merge patch of `spec`, as `kubectl patch --type=merge` or `flux
/// suspend`/`resume` write it.
pub async fn patch_spec(ns: &TestNamespace, name: &str, spec: Value) -> Result<Observed> {
    let patched = ns
        .releases()
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": spec })),
        )
        .await?;
    Ok(Observed::of(&patched))
}

/// Sets `spec.values.greeting`, which makes helm-controller upgrade.
pub async fn set_greeting(ns: &TestNamespace, name: &str, greeting: &str) -> Result<Observed> {
    patch_spec(ns, name, json!({ "values": { "greeting": greeting } })).await
}

/// `flux suspend` / `flux resume`.
pub async fn set_suspend(ns: &TestNamespace, name: &str, suspend: bool) -> Result<Observed> {
    patch_spec(ns, name, json!({ "suspend": suspend })).await
}

/// Deletes release `name` and returns the state the delete left it in:
/// `None` if it went at once, else the terminating release as the apiserver
/// answered the delete (before any controller could act on it).
pub async fn delete(ns: &TestNamespace, name: &str) -> Result<Option<Observed>> {
    let deleted = ns.releases().delete(name, &DeleteParams::default()).await?;
    Ok(deleted.left().map(|obj| Observed::of(&obj)))
}

/// flux-plunger's one write (SPEC §3): a server-side apply by manager
/// `flux-plunger` holding only identity, preconditions, optionally the fence
/// and optionally `spec.suspend`.
pub async fn apply_as_flux_plunger(
    ns: &TestNamespace,
    name: &str,
    suspend: Option<bool>,
    fence: bool,
) -> Result<Observed> {
    // The apply is preconditioned on the resourceVersion it read, as
    // flux-plunger's are; the real helm-controller writes the status at any
    // moment, so a 409 means "read again", as it does for flux-plunger.
    const ATTEMPTS: u32 = 10;
    let mut attempt = 0;
    loop {
        attempt += 1;
        let current = ns.releases().get(name).await?;
        let mut body = json!({
            "apiVersion": names::HELMRELEASE_API_VERSION,
            "kind": names::HELMRELEASE_KIND,
            "metadata": {
                "name": name,
                "namespace": ns.name,
                "resourceVersion": current.metadata.resource_version,
                "uid": current.metadata.uid,
            },
        });
        if fence {
            body["metadata"]["finalizers"] = json!([names::FENCE_FINALIZER]);
        }
        if let Some(suspend) = suspend {
            body["spec"] = json!({ "suspend": suspend });
        }
        match ns
            .releases()
            .patch(
                name,
                &PatchParams::apply(names::FIELD_MANAGER),
                &Patch::Apply(body),
            )
            .await
        {
            Ok(applied) => return Ok(Observed::of(&applied)),
            Err(kube::Error::Api(status)) if status.code == 409 && attempt < ATTEMPTS => {}
            Err(err) => return Err(err.into()),
        }
    }
}

/// Removes finalizer `finalizer` from release `name` with a JSON patch
/// guarded by a `test` op, as the sweeper does.
pub async fn remove_finalizer(ns: &TestNamespace, name: &str, finalizer: &str) -> Result<()> {
    let current = ns.releases().get(name).await?;
    let index = current
        .metadata
        .finalizers
        .iter()
        .flatten()
        .position(|f| f == finalizer)
        .with_context(|| format!("{name} does not carry {finalizer}"))?;
    let patch: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": format!("/metadata/finalizers/{index}"), "value": finalizer},
        {"op": "remove", "path": format!("/metadata/finalizers/{index}")},
    ]))?;
    ns.releases()
        .patch(name, &PatchParams::default(), &Patch::Json::<()>(patch))
        .await?;
    Ok(())
}

/// `Ready` carries the message of the stuck state.
pub fn is_stuck(o: &Observed) -> bool {
    o.ready_message()
        .is_some_and(|m| m.contains(plunger::names::STUCK_MESSAGES[0]))
}

/// Waits until a pass of helm-controller's over the current generation of
/// release `name` has found it stuck (a pass that fails records no
/// `observedGeneration`, only its `Ready` condition's).
pub async fn wait_stuck_at_this_generation(ns: &TestNamespace, name: &str) -> Result<()> {
    let what = format!(
        "HelmRelease {}/{name} met as stuck at its generation",
        ns.name
    );
    wait_for(&what, || async move {
        let object = ns.releases().get(name).await?;
        let ready_generation = object.data["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c["type"] == names::READY_CONDITION)
            .and_then(|c| c["observedGeneration"].as_i64());
        let stuck_now = is_stuck(&Observed::of(&object))
            && ready_generation.is_some()
            && ready_generation == object.metadata.generation;
        Ok(stuck_now.then_some(()))
    })
    .await
}

/// How long to wait for helm-controller to leave a release stuck by a real
/// cause:
/// a failed install, its remediation and the next try take several of its
/// backed-off retries (seen up to 96 s apart), on two shared cores.
pub const STUCK_WAIT: std::time::Duration = std::time::Duration::from_secs(240);

/// Waits until a pass of helm-controller's ended `Ready=False` with a message
/// containing `says`; with `at_this_generation`, a pass over the current
/// generation of release `name`.
pub async fn wait_stuck_saying(
    ns: &TestNamespace,
    name: &str,
    says: &str,
    at_this_generation: bool,
) -> Result<()> {
    let releases = ns.releases();
    testkit::eventually(
        STUCK_WAIT,
        &format!("HelmRelease {}/{name} stuck saying {says:?}", ns.name),
        || async {
            let object = releases.get(name).await?;
            let ready = object.data["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|c| c["type"] == plunger::names::READY_CONDITION);
            Ok(ready.is_some_and(|c| {
                c["status"] == "False"
                    && c["message"].as_str().is_some_and(|m| m.contains(says))
                    && (!at_this_generation
                        || c["observedGeneration"].as_i64() == object.metadata.generation)
            }))
        },
    )
    .await
}

/// `helm ARGS --namespace NS` as the cluster's admin: the Helm CLI an
/// operator runs against the storage helm-controller writes (the pinned
/// `_out/bin/helm`).
pub fn helm_cli(ns: &TestNamespace, args: &[&str]) -> Result<String> {
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    testkit::control_plane().write_kubeconfig(
        &kubeconfig,
        &testkit::control_plane::AuthInfo::AdminCertificate,
    )?;
    let output = std::process::Command::new(testkit::control_plane::tool("helm")?)
        .args(args)
        .arg("--namespace")
        .arg(&ns.name)
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .output()?;
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    anyhow::ensure!(
        output.status.success(),
        "helm {args:?} failed: {stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(stdout)
}

/// Where a release of the demo chart is installed and stored: by default
/// beside its HelmRelease under the HelmRelease's name; with
/// `spec.releaseName`, `spec.targetNamespace` and `spec.storageNamespace`,
/// anywhere.
pub struct Placement {
    /// The Helm release name (`spec.releaseName`).
    pub helm_name: String,
    /// Where its objects are (`spec.targetNamespace`).
    pub target: TestNamespace,
    /// Where its Helm storage is (`spec.storageNamespace`).
    pub storage: TestNamespace,
}

impl Placement {
    /// Beside the HelmRelease `name` in `ns`, as helm-controller places a
    /// release with none of the three fields.
    pub fn beside(ns: &TestNamespace, name: &str) -> Self {
        Self {
            helm_name: name.to_owned(),
            target: same(ns),
            storage: same(ns),
        }
    }

    /// The spec fields that place the release here (none when beside).
    pub fn spec(&self, ns: &TestNamespace, name: &str) -> Value {
        if self.helm_name == name && self.target.name == ns.name && self.storage.name == ns.name {
            return json!({});
        }
        json!({
            "releaseName": self.helm_name,
            "targetNamespace": self.target.name,
            "storageNamespace": self.storage.name,
        })
    }

    /// `(revision, status)` of each revision in the Helm storage.
    pub async fn storage_statuses(&self) -> Result<Vec<(u64, String)>> {
        revision_statuses(&self.storage.secrets(), &self.helm_name).await
    }

    /// The `data` of the demo chart's ConfigMap, if it exists.
    pub async fn configmap_data(
        &self,
    ) -> Result<Option<std::collections::BTreeMap<String, String>>> {
        Ok(
            testkit::real_helm_controller::demo_configmap(&self.target, &self.helm_name)
                .await?
                .map(|c| c.data.unwrap_or_default()),
        )
    }
}

fn same(ns: &TestNamespace) -> TestNamespace {
    TestNamespace {
        name: ns.name.clone(),
        client: ns.client.clone(),
    }
}

/// Installs the demo release, upgrades it once, then leaves revision 2 as an
/// interrupted uninstall leaves it and asks for another upgrade (see
/// [`make_stuck_as`]).
pub async fn make_stuck(ns: &TestNamespace, release: &str) -> Result<Observed> {
    make_stuck_as(ns, release, &Placement::beside(ns, release), "uninstalling").await
}

/// Installs the demo release where `placement` says, upgrades it once
/// (revision 1 `superseded`, revision 2 `deployed`), then leaves revision 2
/// in `status` and asks for another upgrade.
///
/// Why that gets stuck, in helm-controller v1.6's and Helm v4's code (v1.4
/// and Helm v3 decide the same way):
/// 1. rewriting revision 2 changes the release object, so its digest no longer
///    matches the snapshot in `status.history`: `DetermineReleaseState` calls
///    the release "Unmanaged", clears the history and runs a Helm upgrade;
/// 2. Helm's `Upgrade.prepareUpgrade` takes the newest revision (`Last`): not
///    `pending-*` (that would be "another operation is in progress"), not
///    `deployed`, so it asks storage for a deployed one (`Deployed`, a query on
///    the label `status=deployed`): none, and the newest is neither `failed`
///    nor `superseded` (the two it would upgrade from) — so it returns
///    `"<release>" has no deployed releases` before touching anything;
/// 3. the reconcile fails, helm-controller writes `Ready=False` with that
///    message and retries with backoff; every retry ends the same way.
///
/// `uninstalling`, `unknown` and `uninstalled` all do this (see the table
/// test), but for `uninstalled` on helm-controller v1.4; `failed`,
/// `superseded` and `pending-*` do not.
pub async fn make_stuck_as(
    ns: &TestNamespace,
    release: &str,
    placement: &Placement,
    status: &str,
) -> Result<Observed> {
    let mut spec = testkit::real_helm_controller::demo_release(
        &ns.name,
        release,
        json!({ "greeting": "hello" }),
    );
    testkit::merge(&mut spec["spec"], placement.spec(ns, release));
    testkit::real_helm_controller::publish_demo_chart(ns).await?;
    testkit::real_helm_controller::create_release(ns, spec).await?;
    wait_until(ns, release, "installed and Ready=True", Observed::is_ready).await?;
    set_greeting(ns, release, "v2").await?;
    wait_until(ns, release, "upgraded and Ready=True", Observed::is_ready).await?;
    let stored = placement.storage_statuses().await?;
    anyhow::ensure!(
        stored == [(1, "superseded".to_owned()), (2, "deployed".to_owned())],
        "after install and upgrade, storage holds {stored:?}"
    );
    set_revision_status(
        &placement.storage.secrets(),
        &placement.helm_name,
        2,
        status,
    )
    .await?;
    set_greeting(ns, release, "v3").await?;
    wait_until(ns, release, "stuck with has no deployed releases", is_stuck).await
}

/// flux-plunger's controller as a process, scoped to one test namespace (the
/// real helm-controller serves every namespace of the test process; the
/// stuck releases of other tests must stay stuck). It stops with the test
/// process, like the servers of the control plane.
pub struct FluxPlunger {
    /// Its log (console encoding).
    pub log: std::path::PathBuf,
    server: std::sync::Mutex<testkit::process::Supervised>,
}

impl FluxPlunger {
    /// Starts `target/<profile>/flux-plunger` (`make e2e` builds it) watching
    /// only `ns`, without leader election, as the chart's ServiceAccount under
    /// the chart's admission guard, and waits for its readiness probe.
    pub async fn start(ns: &TestNamespace) -> Result<Self> {
        Self::start_with(ns, &[], &[]).await
    }

    /// As [`FluxPlunger::start`], with `env` added (the test builds' pause
    /// points: `FLUX_PLUNGER_TEST_PAUSE_AT`, `FLUX_PLUNGER_TEST_PAUSE_FILE`).
    pub async fn start_with_env(
        ns: &TestNamespace,
        env: &[(&str, &std::path::Path)],
    ) -> Result<Self> {
        Self::start_with(ns, env, &[]).await
    }

    /// As [`FluxPlunger::start_with_env`], with `flags` added to its command
    /// line.
    pub async fn start_with(
        ns: &TestNamespace,
        env: &[(&str, &std::path::Path)],
        flags: &[&str],
    ) -> Result<Self> {
        use testkit::control_plane::workspace_binary;
        let binary = workspace_binary("flux-plunger")?;
        // The supervisor removes the directory once flux-plunger stopped.
        let dir = tempfile::Builder::new()
            .prefix("flux-plunger-e2e-")
            .tempdir()?
            .keep();
        // The chart's ServiceAccount, under the chart's admission guard;
        // unfenced, flux-plunger suspends without the fence, which the guard
        // refuses, so that one runs with the admin's rights.
        let kubeconfig = dir.join("kubeconfig");
        if env
            .iter()
            .any(|(key, _)| *key == "FLUX_PLUNGER_TEST_UNFENCED")
        {
            testkit::control_plane().write_kubeconfig(
                &kubeconfig,
                &testkit::control_plane::AuthInfo::AdminCertificate,
            )?;
        } else {
            testkit::guard::shared()?.write_controller_kubeconfig(&kubeconfig)?;
        }
        let log = dir.join("flux-plunger.log");
        // Ports the process binds itself and logs: a port found free here
        // could be taken by another connection before it binds it.
        let mut args = vec![
            format!("--kubeconfig={}", kubeconfig.display()),
            "--leader-elect=false".to_owned(),
            format!("--watch-namespace={}", ns.name),
            "--metrics-addr=127.0.0.1:0".to_owned(),
            "--health-addr=127.0.0.1:0".to_owned(),
            "--log-encoding=console".to_owned(),
            "--log-level=debug".to_owned(),
        ];
        args.extend(flags.iter().map(|f| (*f).to_owned()));
        let server = testkit::process::Supervised::spawn_with_env(
            "flux-plunger",
            &binary,
            &args,
            env,
            &log,
            Some(&dir),
        )?;
        let running = Self {
            log,
            server: std::sync::Mutex::new(server),
        };
        let ready = async {
            let health = wait_for("flux-plunger's health address in its log", || async {
                running.ensure_running()?;
                Ok(health_port(&running.log_text()))
            })
            .await?;
            wait_for("flux-plunger's /readyz", || async {
                running.ensure_running()?;
                Ok((http_status(health, "/readyz").await == Some(200)).then_some(()))
            })
            .await
        };
        ready
            .await
            .with_context(|| format!("flux-plunger's log:\n{}", running.log_text()))?;
        Ok(running)
    }

    /// An error once the process has exited (its log went with its
    /// directory).
    fn ensure_running(&self) -> Result<()> {
        anyhow::ensure!(
            self.server.lock().unwrap().is_running(),
            "flux-plunger exited during its start"
        );
        Ok(())
    }

    /// Everything flux-plunger logged so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// The health port flux-plunger logged at its start
/// (`flux-plunger starting metrics=… health=127.0.0.1:PORT …`).
fn health_port(log: &str) -> Option<u16> {
    let line = log.lines().find(|l| l.contains("flux-plunger starting"))?;
    let address = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("health="))?;
    address.rsplit_once(':')?.1.parse().ok()
}

async fn http_status(port: u16, path: &str) -> Option<u16> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await.ok()?;
    response.split_whitespace().nth(1)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::health_port;

    #[test]
    fn the_health_port_is_read_from_the_start_line() {
        let log = "2026-12-02T03:06:02.739070Z  INFO flux_plunger::run: flux-plunger starting \
                   metrics=127.0.0.1:37639 health=127.0.0.1:35177 identity=vm grace_period_seconds=90\n";
        assert_eq!(health_port(log), Some(35177));
        assert_eq!(
            health_port("flux-plunger starting metrics=127.0.0.1:1\n"),
            None
        );
        assert_eq!(health_port(""), None);
    }
}
