//! Issue 26: the stuck states helm-controller leaves, each made by its real
//! cause against the real helm-controller (never by rewriting a storage
//! Secret), what helm-controller reports then, and flux-plunger recovering
//! them once the cause is gone.
//!
//! The causes:
//! - a chart value that renders a ConfigMap the apiserver refuses (a data key
//!   it does not accept), so the install fails after the chart's other
//!   ConfigMap was created, and helm-controller remediates by uninstalling;
//! - that uninstall refused partway by an admission policy (A), or kept in the
//!   history (`spec.uninstall.keepHistory`, B and D), or cut by a SIGKILL of
//!   helm-controller while it waits for an object a finalizer holds (C).
//!
//! Each test runs a helm-controller of its own, watching only its namespace
//! (C kills it; the others would lose theirs), beside the source-controller
//! of the test process, which builds every test's chart from the registry,
//! and no flux-plunger until the stuck state has been seen: then the user
//! fixes the value, the state stays stuck, and flux-plunger is started to
//! recover it.
//!
//! What helm-controller v1.4.0, v1.6.1 and v1.6.4 report (`Ready=False`, for
//! release `<ns>/demo` and chart `demo@1.0.0`; storage and `status.history`):
//!
//! | state | reason | message ends | storage | history |
//! |---|---|---|---|---|
//! | A | `StateError` | `Could not determine release state: unable to determine state for release with status 'uninstalling'` | 1 `uninstalling` | 1 `uninstalling` |
//! | B, D | `InstallFailed` | v1.4.0 `cannot re-use a name that is still in use`; v1.6 `release name check failed: cannot reuse a name that is still in use` | 1 `uninstalled` | empty |
//! | C | `UpgradeFailed` | `"demo" has no deployed releases` | 1 `uninstalling` | empty |
//!
//! Each stays so after the value is fixed (a new generation), on every try;
//! D never stalls. Recovered, each is installed anew: `InstallSucceeded`,
//! storage and history 1 `deployed`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use e2e::{FluxPlunger, flux_plunger_events};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, Patch, PatchParams};
use serde_json::{Value, json};
use testkit::control_plane::{AuthInfo, tool};
use testkit::helm_storage::revision_statuses;
use testkit::process::Supervised;
use testkit::real_causes::{self, HOLD_FINALIZER, name_in_use};
use testkit::real_helm_controller::selected_version;
use testkit::source_controller::source_controller;
use testkit::{TestNamespace, control_plane};

/// The HelmRelease, and the Helm release it installs, of every test.
const RELEASE: &str = "demo";
/// The chart's ConfigMap every install creates (the demo chart's).
const KEPT_CONFIGMAP: &str = "demo-demo";
/// The chart's ConfigMap whose data key comes from a value.
const EXTRA_CONFIGMAP: &str = "demo-extra";
/// How long a test waits for helm-controller or flux-plunger to get
/// somewhere: helm-controller's retries back off exponentially (seen: 1 s
/// to 96 s apart within two minutes) and two shared cores run everything.
const WAIT: Duration = Duration::from_secs(240);

// ------------------------------------------------ a helm-controller per test

/// The real helm-controller (`_out/bin/helm-controller-<version>`), watching
/// only one namespace (`--watch-all-namespaces=false`, `RUNTIME_NAMESPACE`),
/// with the flags testkit's shared one runs with. A test can SIGKILL it and
/// start it again.
struct ScopedHelmController {
    namespace: String,
    version: String,
    server: Supervised,
    log: PathBuf,
    /// What the incarnations killed before this one logged.
    earlier_logs: String,
}

impl ScopedHelmController {
    async fn start(ns: &TestNamespace) -> Result<Self> {
        let version = selected_version()?;
        let (server, log) = Self::spawn(&ns.name, &version).await?;
        Ok(Self {
            namespace: ns.name.clone(),
            version,
            server,
            log,
            earlier_logs: String::new(),
        })
    }

    async fn spawn(namespace: &str, version: &str) -> Result<(Supervised, PathBuf)> {
        let binary = tool(&format!("helm-controller-{version}"))?;
        // The supervisor removes the directory once this incarnation stopped.
        let dir = tempfile::Builder::new()
            .prefix("flux-plunger-hc-")
            .tempdir()?
            .keep();
        let kubeconfig = dir.join("kubeconfig");
        control_plane().write_kubeconfig(&kubeconfig, &AuthInfo::AdminCertificate)?;
        let log = dir.join("helm-controller.log");
        // Ports it binds itself and logs: a port found free here could be
        // taken by another socket before helm-controller binds it.
        let args = vec![
            "--watch-all-namespaces=false".to_owned(),
            "--metrics-addr=127.0.0.1:0".to_owned(),
            "--health-addr=127.0.0.1:0".to_owned(),
            "--enable-leader-election=false".to_owned(),
            "--events-addr=".to_owned(),
            "--log-encoding=console".to_owned(),
            "--log-level=info".to_owned(),
            "--requeue-dependency=2s".to_owned(),
            "--http-retry=1".to_owned(),
            "--graceful-shutdown-timeout=5s".to_owned(),
        ];
        let mut server = Supervised::spawn_with_env(
            &format!("helm-controller {version} of {namespace}"),
            &binary,
            &args,
            &[
                ("KUBECONFIG", kubeconfig.as_path()),
                ("RUNTIME_NAMESPACE", Path::new(namespace)),
            ],
            &log,
            Some(&dir),
        )?;
        let deadline = Instant::now() + WAIT;
        // Read before each check of the process: once it has exited, its log
        // went with its directory.
        let mut logged = String::new();
        loop {
            let ready = match health_port(&logged) {
                Some(port) => http_status(port, "/readyz").await == Some(200),
                None => false,
            };
            if ready {
                break;
            }
            if !server.is_running() || Instant::now() > deadline {
                let text: Vec<&str> = logged.lines().collect();
                bail!(
                    "helm-controller {version} did not get ready; its log:\n{}",
                    text[text.len().saturating_sub(40)..].join("\n")
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
            logged = std::fs::read_to_string(&log).unwrap_or_default();
        }
        Ok((server, log))
    }

    /// SIGKILL, as the OOM killer or a lost node ends it: no graceful
    /// shutdown, no last status patch.
    async fn kill(&mut self) -> Result<()> {
        self.earlier_logs.push_str(&self.current_log());
        self.server.signal("KILL")?;
        let deadline = Instant::now() + WAIT;
        while self.server.is_running() {
            anyhow::ensure!(
                Instant::now() < deadline,
                "helm-controller outlived SIGKILL"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.earlier_logs.push_str("---- SIGKILL ----\n");
        Ok(())
    }

    /// A new incarnation, as the Deployment's next pod.
    async fn start_again(&mut self) -> Result<()> {
        let (server, log) = Self::spawn(&self.namespace, &self.version).await?;
        self.server = server;
        self.log = log;
        Ok(())
    }

    fn current_log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// How many of its passes ended in an error whose text holds `text`.
    fn passes_failed_with(&self, text: &str) -> usize {
        format!("{}{}", self.earlier_logs, self.current_log())
            .lines()
            .filter(|l| l.contains("Reconciler error") && l.contains(text))
            .count()
    }

    /// The last lines it logged (the killed incarnations' before), for
    /// failure messages.
    fn log_tail(&self) -> String {
        let all = format!("{}{}", self.earlier_logs, self.current_log());
        let lines: Vec<&str> = all.lines().collect();
        lines[lines.len().saturating_sub(60)..].join("\n")
    }
}

/// The port helm-controller logged its health probe server started on
/// (controller-runtime's `starting server {"name": "health probe", "addr":
/// "127.0.0.1:PORT"}`).
fn health_port(log: &str) -> Option<u16> {
    let line = log.lines().find(|l| l.contains("\"health probe\""))?;
    let (_, after) = line.split_once("\"addr\": \"")?;
    let (address, _) = after.split_once('"')?;
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

// ------------------------------------------------------- what is reported

/// What helm-controller reports about the release, and what Helm stored.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Report {
    generation: i64,
    observed_generation: Option<i64>,
    /// `(status, reason, message)` of `Ready`.
    ready: Option<(String, String, String)>,
    /// The generation `Ready` was written for.
    ready_generation: Option<i64>,
    /// `(status, reason, message)` of `Stalled`, if any.
    stalled: Option<(String, String, String)>,
    /// `(version, status)` of each `status.history` snapshot, newest first.
    history: Vec<(i64, String)>,
    /// `(revision, status label)` of each storage Secret, oldest first.
    storage: Vec<(u64, String)>,
}

impl Report {
    fn condition(&self) -> (&str, &str, &str) {
        self.ready
            .as_ref()
            .map(|(s, r, m)| (s.as_str(), r.as_str(), m.as_str()))
            .unwrap_or_default()
    }

    /// A pass over the current generation reported `stuck`, and its status
    /// write is complete. helm-controller writes a pass's conditions and the
    /// rest of its status in two patches, so a read between them shows the
    /// new `Ready` beside the old history (seen on v1.6.4): the whole shape
    /// is waited for, never the message alone.
    fn shows(&self, stuck: &Stuck) -> bool {
        self.ready_generation == Some(self.generation)
            && self.condition() == ("False", stuck.reason, stuck.message.as_str())
            && self.storage == stuck.storage
            && self.history == stuck.history
    }

    /// Installed and `Ready=True` for the current generation, over a newest
    /// `deployed` revision.
    fn is_recovered(&self) -> bool {
        self.observed_generation == Some(self.generation)
            && self.condition().0 == "True"
            && self.storage.last().is_some_and(|(_, s)| s == "deployed")
    }
}

/// What helm-controller reports over a stuck release: `Ready=False` with
/// `reason` and `message`, Helm's storage and its own history.
#[derive(Debug)]
struct Stuck {
    reason: &'static str,
    message: String,
    /// `(revision, status label)`, oldest first.
    storage: Vec<(u64, String)>,
    /// `(version, status)` of `status.history`, newest first.
    history: Vec<(i64, String)>,
}

fn condition(status: &Value, kind: &str) -> Option<(Option<i64>, (String, String, String))> {
    let c = status["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == kind)?;
    let field = |k: &str| c[k].as_str().unwrap_or_default().to_owned();
    Some((
        c["observedGeneration"].as_i64(),
        (field("status"), field("reason"), field("message")),
    ))
}

async fn report(ns: &TestNamespace) -> Result<Report> {
    let release = ns.releases().get(RELEASE).await?;
    let status = &release.data["status"];
    let ready = condition(status, "Ready");
    Ok(Report {
        generation: release.metadata.generation.unwrap_or_default(),
        observed_generation: status["observedGeneration"].as_i64(),
        ready_generation: ready.as_ref().and_then(|(g, _)| *g),
        ready: ready.map(|(_, c)| c),
        stalled: condition(status, "Stalled").map(|(_, c)| c),
        history: status["history"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|h| {
                (
                    h["version"].as_i64().unwrap_or_default(),
                    h["status"].as_str().unwrap_or_default().to_owned(),
                )
            })
            .collect(),
        storage: revision_statuses(&ns.secrets(), RELEASE).await?,
    })
}

/// Polls `probe` until it yields `Some`, for at most [`WAIT`]; the error of a
/// timeout names `what` and carries the last error.
async fn wait_for<T, F, Fut>(what: &str, mut probe: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Option<T>>>,
{
    let deadline = Instant::now() + WAIT;
    let mut last_error = None;
    loop {
        match probe().await {
            Ok(Some(value)) => return Ok(value),
            Ok(None) => {}
            Err(e) => last_error = Some(format!("{e:#}")),
        }
        if Instant::now() > deadline {
            bail!(
                "timed out after {}s waiting for {what} (last error: {last_error:?})",
                WAIT.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// One test's world: its namespace and its helm-controller.
struct Case {
    name: &'static str,
    ns: TestNamespace,
    helm_controller: ScopedHelmController,
}

impl Case {
    async fn start(name: &'static str) -> Result<Self> {
        source_controller();
        let client = control_plane().client().await?;
        let ns = TestNamespace::create(&client, &format!("e2e-cause-{name}")).await?;
        let helm_controller = ScopedHelmController::start(&ns).await?;
        Ok(Self {
            name,
            ns,
            helm_controller,
        })
    }

    async fn create_failing_release(&self, spec: Value) -> Result<()> {
        real_causes::create_failing_release(&self.ns, RELEASE, spec).await
    }

    /// Waits until helm-controller's report satisfies `done`; a timeout
    /// carries the last report and helm-controller's log.
    async fn wait_report(&self, what: &str, done: impl Fn(&Report) -> bool) -> Result<Report> {
        let last = std::sync::Mutex::new(None);
        let (last, done) = (&last, &done);
        let found = wait_for(what, || async move {
            let now = report(&self.ns).await?;
            let matched = done(&now);
            *last.lock().unwrap() = Some(now.clone());
            Ok(matched.then_some(now))
        })
        .await;
        let found = found.with_context(|| {
            format!(
                "{}: last report {:?}\nhelm-controller's log:\n{}",
                self.name,
                last.lock().unwrap(),
                self.helm_controller.log_tail()
            )
        })?;
        eprintln!(
            "{} on helm-controller {}: {what}: {found:?}",
            self.name, self.helm_controller.version
        );
        Ok(found)
    }

    /// Waits until a pass over the current generation reported `stuck`
    /// (and, with `generation`, that this is that generation).
    async fn wait_stuck(
        &self,
        what: &str,
        stuck: &Stuck,
        generation: Option<i64>,
    ) -> Result<Report> {
        self.wait_report(&format!("{what}: {stuck:?}"), |r| {
            generation.is_none_or(|g| r.generation == g) && r.shows(stuck)
        })
        .await
    }

    async fn fix_the_values(&self) -> Result<i64> {
        real_causes::fix_the_values(&self.ns, RELEASE).await
    }

    /// Starts flux-plunger and waits until helm-controller has installed the
    /// release again: `Ready=True` at the chart's version for the current
    /// generation, a newest `deployed` revision, both ConfigMaps there with
    /// the fixed value.
    async fn recovered_by_flux_plunger(&self) -> Result<Report> {
        let flux_plunger = FluxPlunger::start(&self.ns).await?;
        let recovered = self
            .wait_report("recovered by flux-plunger", Report::is_recovered)
            .await
            .with_context(|| format!("flux-plunger's log:\n{}", flux_plunger.log_text()))?;
        // Nothing was left in the storage: helm-controller installed anew.
        assert_eq!(
            (&recovered.storage, &recovered.history),
            (&pairs(&[(1, "deployed")]), &pairs(&[(1, "deployed")])),
            "{}",
            self.name
        );
        assert_eq!(
            recovered.condition(),
            (
                "True",
                "InstallSucceeded",
                &*format!(
                    "Helm install succeeded for release {}/{RELEASE}.v1 with chart demo@1.0.0",
                    self.ns.name
                )
            ),
            "{}: {recovered:?}",
            self.name
        );
        assert_eq!(
            self.configmap(KEPT_CONFIGMAP).await?.and_then(|c| c.data),
            Some(BTreeMap::from([(
                "greeting".to_owned(),
                "hello".to_owned()
            )])),
            "{}",
            self.name
        );
        assert_eq!(
            self.configmap(EXTRA_CONFIGMAP).await?.and_then(|c| c.data),
            Some(BTreeMap::from([("setting".to_owned(), "on".to_owned())])),
            "{}",
            self.name
        );
        Ok(recovered)
    }

    fn configmaps(&self) -> Api<ConfigMap> {
        Api::namespaced(self.ns.client.clone(), &self.ns.name)
    }

    async fn configmap(&self, name: &str) -> Result<Option<ConfigMap>> {
        Ok(self.configmaps().get_opt(name).await?)
    }

    /// Whatever held the kept ConfigMap (its finalizer) lets it go.
    async fn let_go_of_the_kept_configmap(&self) -> Result<()> {
        self.configmaps()
            .patch(
                KEPT_CONFIGMAP,
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"finalizers": null}})),
            )
            .await?;
        Ok(())
    }

    /// Stuck as C leaves it once helm-controller restarted: its history
    /// cleared, the stored `uninstalling` revision called unmanaged, the
    /// upgrade refused.
    fn upgrade_failed_over_uninstalling(&self) -> Stuck {
        Stuck {
            reason: "UpgradeFailed",
            message: format!(
                "Helm upgrade failed for release {}/{RELEASE} with chart demo@1.0.0: \
                 \"{RELEASE}\" has no deployed releases",
                self.ns.name
            ),
            storage: pairs(&[(1, "uninstalling")]),
            history: pairs(&[]),
        }
    }
}

fn pairs<T: Copy>(items: &[(T, &str)]) -> Vec<(T, String)> {
    items.iter().map(|(n, s)| (*n, (*s).to_owned())).collect()
}

// ------------------------------------------------------------------ A

async fn refuse_deleting_the_kept_configmap(case: &Case) -> Result<testkit::Refusal> {
    real_causes::refuse_deleting_the_kept_configmap(&case.ns, RELEASE).await
}

/// A. The install fails (the apiserver refuses the extra ConfigMap after the
/// kept one was created); the uninstall remediation is refused partway (an
/// admission policy keeps the kept ConfigMap): Helm stored revision 1
/// `uninstalling` before it started deleting, and helm-controller's history
/// names that very revision (it observed the write), so its next pass cannot
/// tell the state of an `uninstalling` release and says so, on every pass.
#[tokio::test]
async fn a_failed_install_whose_uninstall_remediation_is_refused_partway() -> Result<()> {
    let case = Case::start("a").await?;
    let refusal = refuse_deleting_the_kept_configmap(&case).await?;
    case.create_failing_release(json!({})).await?;
    let stuck = Stuck {
        reason: "StateError",
        message: "Could not determine release state: \
                  unable to determine state for release with status 'uninstalling'"
            .to_owned(),
        storage: pairs(&[(1, "uninstalling")]),
        history: pairs(&[(1, "uninstalling")]),
    };
    case.wait_stuck("stuck over an uninstalling revision", &stuck, None)
        .await?;
    assert!(case.configmap(KEPT_CONFIGMAP).await?.is_some());
    assert!(case.configmap(EXTRA_CONFIGMAP).await?.is_none());

    // The causes go: the policy is lifted, the value fixed. helm-controller
    // stays stuck over the revision its own history names.
    refusal.lift().await?;
    let fixed = case.fix_the_values().await?;
    case.wait_stuck("still stuck once fixed", &stuck, Some(fixed))
        .await?;

    case.recovered_by_flux_plunger().await?;
    Ok(())
}

// ------------------------------------------------------------------ B, D

/// The install fails and the uninstall remediation keeps the history
/// (`spec.uninstall.keepHistory`): revision 1 `uninstalled`, which
/// helm-controller's history names. Its next pass takes the release for
/// absent and installs (clearing the history first, as before every
/// install), which Helm refuses: the name is still in use.
async fn stuck_after_a_remediation_that_kept_history(case: &Case) -> Result<Stuck> {
    case.create_failing_release(json!({ "uninstall": { "keepHistory": true } }))
        .await?;
    let stuck = Stuck {
        reason: "InstallFailed",
        message: format!(
            "Helm install failed for release {}/{RELEASE} with chart demo@1.0.0: {}",
            case.ns.name,
            name_in_use()
        ),
        storage: pairs(&[(1, "uninstalled")]),
        history: pairs(&[]),
    };
    case.wait_stuck("stuck: the name still in use", &stuck, None)
        .await?;
    assert!(case.configmap(KEPT_CONFIGMAP).await?.is_none());
    Ok(stuck)
}

/// B. The keep-history remediation, then the value fixed: helm-controller
/// retries the install at the new generation and Helm refuses it again.
#[tokio::test]
async fn a_failed_install_whose_uninstall_remediation_kept_the_history() -> Result<()> {
    let case = Case::start("b").await?;
    let stuck = stuck_after_a_remediation_that_kept_history(&case).await?;
    let fixed = case.fix_the_values().await?;
    case.wait_stuck("still stuck once fixed", &stuck, Some(fixed))
        .await?;

    case.recovered_by_flux_plunger().await?;
    Ok(())
}

/// D. State B, its value fixed, left alone with no flux-plunger running:
/// helm-controller never gives up on it (an install Helm refuses before
/// storing anything counts no failure towards the retries, so it never
/// stalls) but backs off, each try reporting the same. After three such
/// tries at the fixed generation flux-plunger starts, long after the first
/// report.
#[tokio::test]
async fn a_release_stuck_through_many_tries_before_flux_plunger_started() -> Result<()> {
    let case = Case::start("d").await?;
    let stuck = stuck_after_a_remediation_that_kept_history(&case).await?;
    let refusals_before = case.helm_controller.passes_failed_with("still in use");
    let fixed = case.fix_the_values().await?;
    let later = case
        .wait_report("three more tries refused", |r| {
            r.generation == fixed
                && r.shows(&stuck)
                && case.helm_controller.passes_failed_with("still in use") >= refusals_before + 3
        })
        .await?;
    assert_eq!(later.stalled, None, "{later:?}");

    case.recovered_by_flux_plunger().await?;
    Ok(())
}

// ------------------------------------------------------------------ C

/// C. The install fails; the uninstall remediation (waiting for deletes,
/// `spec.uninstall.disableWait: false`) stored revision 1 `uninstalling`,
/// deleted the kept ConfigMap and waits for it to go, which the finalizer the
/// chart put on it prevents. helm-controller is SIGKILLed there and started
/// again.
#[tokio::test]
async fn a_helm_controller_killed_in_the_middle_of_an_uninstall_remediation() -> Result<()> {
    let mut case = Case::start("c").await?;
    case.create_failing_release(json!({
        "values": { "holdDelete": true },
        "uninstall": { "disableWait": false, "timeout": "10m" },
    }))
    .await?;
    let uninstalling = case
        .wait_report("the uninstall remediation under way", |r| {
            r.storage == pairs(&[(1, "uninstalling")])
        })
        .await?;
    wait_for("the kept ConfigMap held by its finalizer", || async {
        Ok(case
            .configmap(KEPT_CONFIGMAP)
            .await?
            .is_some_and(|c| c.metadata.deletion_timestamp.is_some())
            .then_some(()))
    })
    .await?;
    case.helm_controller.kill().await?;
    // helm-controller patches the status before each action and after it:
    // killed in the remediation, its history still holds the failed install.
    let at_kill = report(&case.ns).await?;
    eprintln!("c: at the SIGKILL: {at_kill:?} (when uninstalling was seen: {uninstalling:?})");
    assert_eq!(at_kill.history, pairs(&[(1, "failed")]), "{at_kill:?}");
    case.helm_controller.start_again().await?;

    // The status as the pass before the kill left it names revision 1 as
    // failed: the stored `uninstalling` one no longer matches it, so
    // helm-controller calls it unmanaged, clears the history and upgrades.
    let stuck = case.upgrade_failed_over_uninstalling();
    case.wait_stuck("stuck after the restart", &stuck, None)
        .await?;

    // The causes go: whatever held the ConfigMap lets go, the value is fixed.
    case.let_go_of_the_kept_configmap().await?;
    let fixed = case.fix_the_values().await?;
    case.wait_stuck("still stuck once fixed", &stuck, Some(fixed))
        .await?;

    case.recovered_by_flux_plunger().await?;
    let kept = case
        .configmap(KEPT_CONFIGMAP)
        .await?
        .context("kept ConfigMap")?;
    assert!(
        !kept
            .metadata
            .finalizers
            .unwrap_or_default()
            .iter()
            .any(|f| f == HOLD_FINALIZER)
    );
    Ok(())
}

// ------------------------------- deleted while flux-plunger holds A, B or C

/// Who handles the delete that lands while flux-plunger holds the release.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum First {
    /// helm-controller handles the suspended delete (skips the uninstall,
    /// drops its finalizer), then flux-plunger goes on.
    HelmController,
    /// flux-plunger goes on and lifts its suspension before helm-controller
    /// can finish with the delete (an admission policy refuses its finalizer
    /// removal until then).
    FluxPlunger,
}

/// What a delete that landed while flux-plunger held the release left.
#[derive(Debug)]
struct AfterTheDelete {
    /// Storage as the delete met it: `(revision, status label)`, oldest first.
    storage_before: Vec<(u64, String)>,
    /// The chart's kept ConfigMap was there as the delete met the release.
    kept_configmap_before: bool,
    /// When helm-controller went first: it handled the suspended delete
    /// (dropped its finalizer) and the fence still held the release: its
    /// state then.
    held: Option<e2e::Observed>,
    /// helm-controller's deletion path ran on the unsuspended release (it
    /// deletes the HelmChart there, and skips it while suspended).
    helmchart_deleted: bool,
    /// Storage once the release was gone.
    storage: Vec<(u64, String)>,
    kept_configmap_left: bool,
    extra_configmap_left: bool,
    /// `(type, reason)` of flux-plunger's events on the release.
    events: Vec<(String, String)>,
}

impl Case {
    /// Over a stuck release whose cause is gone: starts a test build of
    /// flux-plunger that pauses right after it took its suspension and its
    /// fence (`FLUX_PLUNGER_TEST_PAUSE_AT=acquired`), deletes the
    /// HelmRelease in that window, waits until helm-controller handled the
    /// suspended delete (it skips the uninstall and drops its finalizer;
    /// the fence holds the release), lets flux-plunger go on, and waits
    /// until the release is gone.
    async fn delete_while_flux_plunger_holds_it(&self, first: First) -> Result<AfterTheDelete> {
        use e2e::observe;
        use plunger::names::FENCE_FINALIZER;
        let ns = &self.ns;
        let gate = tempfile::tempdir()?;
        let pause = gate.path().join("pause");
        let (reached, resume) = (
            pause.with_extension("reached"),
            pause.with_extension("release"),
        );
        let flux_plunger = FluxPlunger::start_with_env(
            ns,
            &[
                ("FLUX_PLUNGER_TEST_PAUSE_AT", Path::new("acquired")),
                ("FLUX_PLUNGER_TEST_PAUSE_FILE", pause.as_path()),
            ],
        )
        .await?;
        let logs = || {
            format!(
                "{}: flux-plunger's log:\n{}\nhelm-controller's log:\n{}",
                self.name,
                flux_plunger.log_text(),
                self.helm_controller.log_tail()
            )
        };
        wait_for(
            "flux-plunger paused after taking its suspension",
            || async { Ok(reached.exists().then_some(())) },
        )
        .await
        .with_context(logs)?;
        let last = std::sync::Mutex::new(None);
        let held = wait_for("the suspension and the fence observed", || async {
            let now = observe(ns, RELEASE)
                .await?
                .context("the HelmRelease is gone")?;
            let done = now.suspend
                && now.finalizers.iter().any(|f| f == FENCE_FINALIZER)
                && now.is_observed();
            *last.lock().unwrap() = Some(now.clone());
            Ok(done.then_some(now))
        })
        .await
        .with_context(|| format!("last seen {:?}", last.lock().unwrap()))
        .with_context(logs)?;
        eprintln!("{}: held by flux-plunger: {held:?}", self.name);
        let storage_before = revision_statuses(&ns.secrets(), RELEASE).await?;
        let kept_configmap_before = self.configmap(KEPT_CONFIGMAP).await?.is_some();

        const REFUSED: &str =
            "test: helm-controller's finalizer stays until flux-plunger has resumed";
        let refusal = match first {
            First::HelmController => None,
            First::FluxPlunger => {
                let refusal = ns
                    .refuse(
                        "keep-helm-controller-finalizer",
                        json!({"apiGroups": ["helm.toolkit.fluxcd.io"], "apiVersions": ["*"], "operations": ["UPDATE"], "resources": ["helmreleases"]}),
                        &format!(
                            "!has(oldObject.metadata.finalizers) || !('{f}' in oldObject.metadata.finalizers) \
                             || (has(object.metadata.finalizers) && '{f}' in object.metadata.finalizers)",
                            f = plunger::names::HELM_CONTROLLER_FINALIZER
                        ),
                        REFUSED,
                    )
                    .await?;
                let dry_run = PatchParams {
                    dry_run: true,
                    ..PatchParams::default()
                };
                let drop_finalizers = Patch::Merge(json!({"metadata": {"finalizers": []}}));
                wait_for("the finalizer refusal in force", || async {
                    Ok(ns
                        .releases()
                        .patch(RELEASE, &dry_run, &drop_finalizers)
                        .await
                        .is_err()
                        .then_some(()))
                })
                .await?;
                Some(refusal)
            }
        };

        e2e::delete(ns, RELEASE).await?;
        let held = if first == First::FluxPlunger {
            wait_for("helm-controller refused its finalizer removal", || async {
                Ok((self.helm_controller.log_tail().contains(REFUSED)
                    || self.helm_controller.passes_failed_with(REFUSED) > 0)
                    .then_some(()))
            })
            .await
            .with_context(logs)?;
            None
        } else {
            let held = wait_for("helm-controller's suspended delete", || async {
                let now = observe(ns, RELEASE).await?.context(
                    "the HelmRelease went at helm-controller's suspended delete: \
                 the fence did not hold it",
                )?;
                *last.lock().unwrap() = Some(now.clone());
                Ok((!now.has_helm_controller_finalizer()).then_some(now))
            })
            .await
            .with_context(|| format!("last seen {:?}", last.lock().unwrap()))
            .with_context(logs)?;
            eprintln!(
                "{}: after helm-controller's suspended delete: {held:?}",
                self.name
            );
            anyhow::ensure!(
                held.deleting && held.suspend && held.finalizers == [FENCE_FINALIZER],
                "{}: not held by the fence alone: {held:?}",
                self.name
            );
            Some(held)
        };

        std::fs::write(&resume, b"")?;
        if let Some(refusal) = refusal {
            wait_for("flux-plunger lifted its suspension", || async {
                let now = observe(ns, RELEASE)
                    .await?
                    .context("the HelmRelease is gone")?;
                Ok((!now.suspend).then_some(()))
            })
            .await
            .with_context(logs)?;
            refusal.lift().await?;
        }
        let gone = wait_for("the deleted HelmRelease to be gone", || async {
            let now = observe(ns, RELEASE).await?;
            let gone = now.is_none();
            *last.lock().unwrap() = now;
            Ok(gone.then_some(()))
        })
        .await
        .with_context(|| format!("last seen {:?}", last.lock().unwrap()))
        .with_context(logs);
        if let Err(e) = gone {
            let storage = revision_statuses(&ns.secrets(), RELEASE).await;
            return Err(e.context(format!("storage then: {storage:?}")));
        }
        let after = AfterTheDelete {
            storage_before,
            kept_configmap_before,
            held,
            helmchart_deleted: !testkit::real_helm_controller::helmchart_exists(ns, RELEASE)
                .await?,
            storage: revision_statuses(&ns.secrets(), RELEASE).await?,
            kept_configmap_left: self.configmap(KEPT_CONFIGMAP).await?.is_some(),
            extra_configmap_left: self.configmap(EXTRA_CONFIGMAP).await?.is_some(),
            events: flux_plunger_events(ns, RELEASE).await?,
        };
        eprintln!(
            "{} on helm-controller {}: after the delete: {after:?}\nflux-plunger's log:\n{}",
            self.name,
            self.helm_controller.version,
            flux_plunger.log_text()
        );
        Ok(after)
    }

    /// SPEC §5 where something may be installed: helm-controller ran the
    /// Helm uninstall, so the chart's objects and the release's storage are
    /// gone, and flux-plunger warned of nothing.
    fn assert_uninstalled(&self, after: &AfterTheDelete) {
        let case = format!("{}: {after:?}", self.name);
        assert!(
            after.held.as_ref().is_none_or(|h| h.deleting && h.suspend),
            "{case}"
        );
        assert!(after.helmchart_deleted, "{case}");
        assert_eq!(
            after.storage,
            pairs(&[]),
            "the release's storage Secrets: {case}"
        );
        assert!(!after.kept_configmap_left, "{case}");
        assert!(!after.extra_configmap_left, "{case}");
        assert!(after.events.iter().all(|(t, _)| t == "Normal"), "{case}");
    }
}

/// A deleted while flux-plunger holds it: the refused uninstall left the
/// chart's kept ConfigMap and revision 1 `uninstalling`, which
/// helm-controller's history names. Once the refusal is lifted, the delete
/// that lands while flux-plunger holds its suspension and fence is a real
/// uninstall (SPEC §5): the ConfigMap, the storage and the release go.
#[tokio::test]
async fn a_deleted_while_flux_plunger_holds_it_is_uninstalled() -> Result<()> {
    futures::future::try_join(
        a_deleted("a-deleted-hc", First::HelmController),
        a_deleted("a-deleted-fp", First::FluxPlunger),
    )
    .await?;
    Ok(())
}

async fn a_deleted(name: &'static str, first: First) -> Result<()> {
    let case = Case::start(name).await?;
    let refusal = refuse_deleting_the_kept_configmap(&case).await?;
    case.create_failing_release(json!({})).await?;
    let stuck = Stuck {
        reason: "StateError",
        message: "Could not determine release state: \
                  unable to determine state for release with status 'uninstalling'"
            .to_owned(),
        storage: pairs(&[(1, "uninstalling")]),
        history: pairs(&[(1, "uninstalling")]),
    };
    case.wait_stuck("stuck over an uninstalling revision", &stuck, None)
        .await?;
    assert!(case.configmap(KEPT_CONFIGMAP).await?.is_some());
    refusal.lift().await?;

    let after = case.delete_while_flux_plunger_holds_it(first).await?;
    assert_eq!(
        after.storage_before,
        pairs(&[(1, "uninstalling")]),
        "{after:?}"
    );
    // What the refused uninstall left was there for the delete to remove.
    assert!(after.kept_configmap_before, "{name}: {after:?}");
    case.assert_uninstalled(&after);
    Ok(())
}

/// B deleted while flux-plunger holds it: the newest revision is
/// `uninstalled` (Helm deleted the objects and kept the record), so nothing
/// is installed: nothing is handed over, the fence goes once helm-controller
/// has let the release go (SPEC §5a, §5d), and the `uninstalled` record Helm
/// kept stays.
#[tokio::test]
async fn b_deleted_while_flux_plunger_holds_it_is_let_go_without_a_hand_over() -> Result<()> {
    futures::future::try_join(
        b_deleted("b-deleted-hc", First::HelmController),
        b_deleted("b-deleted-fp", First::FluxPlunger),
    )
    .await?;
    Ok(())
}

async fn b_deleted(name: &'static str, first: First) -> Result<()> {
    use plunger::notices::reasons;
    let case = Case::start(name).await?;
    stuck_after_a_remediation_that_kept_history(&case).await?;

    let after = case.delete_while_flux_plunger_holds_it(first).await?;
    let case_text = format!("{name}: {after:?}");
    assert_eq!(
        after.storage_before,
        pairs(&[(1, "uninstalled")]),
        "{case_text}"
    );
    // The fence held the release past helm-controller's suspended delete,
    // and helm-controller's deletion path ran on the unsuspended release
    // before the fence went.
    assert!(
        after.held.as_ref().is_none_or(|h| h.deleting && h.suspend),
        "{case_text}"
    );
    assert!(after.helmchart_deleted, "{case_text}");
    assert_eq!(
        after.storage,
        pairs(&[(1, "uninstalled")]),
        "the record Helm kept: {case_text}"
    );
    assert!(!after.kept_configmap_left, "{case_text}");
    assert!(!after.extra_configmap_left, "{case_text}");
    assert!(
        !after.events.contains(&(
            "Normal".to_owned(),
            reasons::UNINSTALL_HANDED_OVER.to_owned()
        )),
        "{case_text}"
    );
    assert!(
        after.events.iter().all(|(t, _)| t == "Normal"),
        "{case_text}"
    );
    Ok(())
}

/// C deleted while flux-plunger holds it: helm-controller was killed in
/// its uninstall remediation, leaving revision 1 `uninstalling` and (after
/// the restart) an empty history. Once whatever held the chart's ConfigMap
/// lets go, the delete that lands while flux-plunger holds the release is a
/// real uninstall (SPEC §5a: the newest revision handed over): the storage
/// and the release go.
#[tokio::test]
async fn c_deleted_while_flux_plunger_holds_it_is_uninstalled() -> Result<()> {
    futures::future::try_join(
        c_deleted("c-deleted-hc", First::HelmController),
        c_deleted("c-deleted-fp", First::FluxPlunger),
    )
    .await?;
    Ok(())
}

async fn c_deleted(name: &'static str, first: First) -> Result<()> {
    use plunger::notices::reasons;
    let mut case = Case::start(name).await?;
    case.create_failing_release(json!({
        "values": { "holdDelete": true },
        "uninstall": { "disableWait": false, "timeout": "10m" },
    }))
    .await?;
    case.wait_report("the uninstall remediation under way", |r| {
        r.storage == pairs(&[(1, "uninstalling")])
    })
    .await?;
    wait_for("the kept ConfigMap held by its finalizer", || async {
        Ok(case
            .configmap(KEPT_CONFIGMAP)
            .await?
            .is_some_and(|c| c.metadata.deletion_timestamp.is_some())
            .then_some(()))
    })
    .await?;
    case.helm_controller.kill().await?;
    case.helm_controller.start_again().await?;
    let stuck = case.upgrade_failed_over_uninstalling();
    case.wait_stuck("stuck after the restart", &stuck, None)
        .await?;
    case.let_go_of_the_kept_configmap().await?;

    let after = case.delete_while_flux_plunger_holds_it(first).await?;
    assert_eq!(
        after.storage_before,
        pairs(&[(1, "uninstalling")]),
        "{after:?}"
    );
    case.assert_uninstalled(&after);
    let handed_over = wait_for("flux-plunger's UninstallHandedOver event", || async {
        let events = flux_plunger_events(&case.ns, RELEASE).await?;
        Ok(events
            .contains(&(
                "Normal".to_owned(),
                reasons::UNINSTALL_HANDED_OVER.to_owned(),
            ))
            .then_some(events))
    })
    .await?;
    eprintln!("{name}: flux-plunger's events {handed_over:?}");
    Ok(())
}
