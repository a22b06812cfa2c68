//! Crash at every step of the drain sidecar: SIGKILLed right before and
//! right after each of its per-release writes (a lift, a fence drop), then a
//! second drain, or the restarted controller, must settle everything: no
//! suspension or fence of ours on a live release, every deleted release
//! uninstalled and gone, nothing left Terminating.
//!
//! The drain runs one release at a time here (`--concurrent=1`), so the
//! release each point stops at, and what was done before it, is fixed: the
//! state at the kill is checked against the table.

use std::time::Duration;

use anyhow::{Context, Result};
use kube::api::DeleteParams;
use plunger::lease::{Attempt, LeaseLock};
use plunger::reconcile::Step;
use plunger::release::view::ReleaseView;
use serde_json::json;
use testkit::crash::{PauseGate, Settled, free_ports, kill9, release_words};
use testkit::guard::Guarded;
use testkit::process::LoggedProcess;
use testkit::{SimulatedHelmController, TestNamespace, control_plane};
use tokio::process::Command;

const POD: &str = "flux-plunger-7d9f-abcde";

/// Who settles what the killed drain left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Then {
    /// The sidecar again (a restarted container of the same pod).
    SecondDrain,
    /// The controller of the next pod.
    Controller,
}

/// What the drain finds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scenario {
    /// Three fenced releases: `bare-fence` (a fence drop), `deleted` (a lift
    /// keeping the fence, then, on a later pass once helm-controller has
    /// uninstalled, the second fence drop), `mid-recovery` (a lift of both).
    Fences,
    /// `stuck-deleted`: a stuck release deleted under flux-plunger's
    /// suspension, which helm-controller met suspended: its history handed
    /// over before the lift (SPEC §5a).
    StuckDeleted,
}

impl Scenario {
    fn releases(self) -> &'static [&'static str] {
        match self {
            Scenario::Fences => &["bare-fence", "deleted", "mid-recovery"],
            Scenario::StuckDeleted => &["stuck-deleted"],
        }
    }
}

struct Case {
    scenario: Scenario,
    /// The fail point as `FLUX_PLUNGER_TEST_PAUSE_AT` lists it.
    point: &'static str,
    then: Then,
    /// The releases while the drain waits at the point, in the words of
    /// [`observe`], in listing order.
    at_kill: &'static str,
}

macro_rules! crash_cases {
    ($($test:ident: $scenario:ident at $point:literal, then $then:ident, state $state:literal;)*) => {
        const CASES: &[Case] = &[$(Case { scenario: Scenario::$scenario, point: $point, then: Then::$then, at_kill: $state }),*];
        $(
            #[tokio::test]
            async fn $test() -> Result<()> {
                let case = Case { scenario: Scenario::$scenario, point: $point, then: Then::$then, at_kill: $state };
                crash_at(&case).await.with_context(|| {
                    format!("drain killed at {}, then {:?}", case.point, case.then)
                })
            }
        )*
    };
}

crash_cases! {
    before_drop_fence_then_drain: Fences at "before-drop-fence", then SecondDrain,
        state "bare-fence: live fenced; deleted: terminating suspended fenced; mid-recovery: live suspended fenced";
    after_drop_fence_then_drain: Fences at "after-drop-fence", then SecondDrain,
        state "bare-fence: live; deleted: terminating suspended fenced; mid-recovery: live suspended fenced";
    before_lift_then_drain: Fences at "before-lift", then SecondDrain,
        state "bare-fence: live; deleted: terminating suspended fenced; mid-recovery: live suspended fenced";
    after_lift_then_drain: Fences at "after-lift", then SecondDrain,
        state "bare-fence: live; deleted: terminating fenced; mid-recovery: live suspended fenced";
    before_the_uninstalled_release_s_drop_then_drain: Fences at "before-drop-fence@2", then SecondDrain,
        state "bare-fence: live; deleted: terminating fenced; mid-recovery: live";
    after_the_uninstalled_release_s_drop_then_drain: Fences at "after-drop-fence@2", then SecondDrain,
        state "bare-fence: live; deleted: gone; mid-recovery: live";
    before_drop_fence_then_controller: Fences at "before-drop-fence", then Controller,
        state "bare-fence: live fenced; deleted: terminating suspended fenced; mid-recovery: live suspended fenced";
    after_drop_fence_then_controller: Fences at "after-drop-fence", then Controller,
        state "bare-fence: live; deleted: terminating suspended fenced; mid-recovery: live suspended fenced";
    before_lift_then_controller: Fences at "before-lift", then Controller,
        state "bare-fence: live; deleted: terminating suspended fenced; mid-recovery: live suspended fenced";
    after_lift_then_controller: Fences at "after-lift", then Controller,
        state "bare-fence: live; deleted: terminating fenced; mid-recovery: live suspended fenced";
    before_the_uninstalled_release_s_drop_then_controller: Fences at "before-drop-fence@2", then Controller,
        state "bare-fence: live; deleted: terminating fenced; mid-recovery: live";
    after_the_uninstalled_release_s_drop_then_controller: Fences at "after-drop-fence@2", then Controller,
        state "bare-fence: live; deleted: gone; mid-recovery: live";

    before_history_write_then_drain: StuckDeleted at "before-history-write", then SecondDrain,
        state "stuck-deleted: terminating suspended fenced";
    after_history_write_then_drain: StuckDeleted at "after-history-write", then SecondDrain,
        state "stuck-deleted: terminating suspended fenced history";
    before_history_write_then_controller: StuckDeleted at "before-history-write", then Controller,
        state "stuck-deleted: terminating suspended fenced";
    after_history_write_then_controller: StuckDeleted at "after-history-write", then Controller,
        state "stuck-deleted: terminating suspended fenced history";
}

#[test]
fn every_write_of_the_drain_is_crashed_at_before_and_after() {
    for point in [
        Step::BeforeLift,
        Step::AfterLift,
        Step::BeforeDropFence,
        Step::AfterDropFence,
        Step::BeforeHistoryWrite,
        Step::AfterHistoryWrite,
    ] {
        for then in [Then::SecondDrain, Then::Controller] {
            assert!(
                CASES
                    .iter()
                    .any(|c| c.point.split('@').next() == Some(point.name()) && c.then == then),
                "no crash case at {} then {then:?}",
                point.name()
            );
        }
    }
}

async fn crash_at(case: &Case) -> Result<()> {
    // A drain acts on every namespace: one at a time.
    let _turn = testkit::cluster_wide_turn().await;
    let client = control_plane().client().await?;
    let ns = TestNamespace::create(&client, "drain-crash").await?;
    let hc = SimulatedHelmController::new(client.clone(), &ns.name);
    let deleted = match case.scenario {
        Scenario::Fences => {
            installed(&ns, &hc, "mid-recovery").await?;
            ns.apply_as_flux_plunger("mid-recovery", true).await?;
            installed(&ns, &hc, "bare-fence").await?;
            ns.apply_as_flux_plunger("bare-fence", false).await?;
            installed(&ns, &hc, "deleted").await?;
            ns.apply_as_flux_plunger("deleted", true).await?;
            "deleted"
        }
        Scenario::StuckDeleted => {
            installed(&ns, &hc, "stuck-deleted").await?;
            ns.create_storage_secret("stuck-deleted", 1, "uninstalling")
                .await?;
            ns.mark_stuck("stuck-deleted").await?;
            ns.apply_as_flux_plunger("stuck-deleted", true).await?;
            "stuck-deleted"
        }
    };
    ns.releases()
        .delete(deleted, &DeleteParams::default())
        .await?;
    // Deleted while suspended: helm-controller skips the uninstall and drops
    // its finalizer; only the fence holds the release.
    hc.handle(deleted).await?;
    lead(&ns).await?;
    let guarded = ns.guarded().await?;
    let (helm_controller, stop) = hc.clone().spawn(Duration::from_millis(200));

    let gate = PauseGate::new()?;
    let point = case.point;
    let mut first = start_drain(&ns, &guarded, &gate.env(&[point])).await?;
    first.process.sigterm()?;
    gate.wait_reached(point, &mut first.process.child).await?;
    let state = observe(&ns, case.scenario).await?;
    kill9(&mut first.process.child).await?;
    assert_eq!(
        state, case.at_kill,
        "the state at {point} is not what the point claims"
    );

    let settled = match case.scenario {
        Scenario::Fences => Settled {
            live: vec!["bare-fence".into(), "mid-recovery".into()],
            deleted: vec!["deleted".into()],
            ..Default::default()
        },
        Scenario::StuckDeleted => Settled {
            deleted: vec!["stuck-deleted".into()],
            ..Default::default()
        },
    };
    let outcome = match case.then {
        Then::SecondDrain => {
            let mut second = start_drain(&ns, &guarded, &[]).await?;
            let status = second.process.terminate(Duration::from_secs(150)).await?;
            let log = second.process.log();
            anyhow::ensure!(status.success(), "the second drain failed: {status}\n{log}");
            anyhow::ensure!(
                log.contains("drain complete: no fence left"),
                "the second drain did not report a complete drain:\n{log}"
            );
            settled.wait(&ns, &hc, None).await
        }
        Then::Controller => {
            let mut controller = start_controller(&ns, &guarded)?;
            settled
                .wait(&ns, &hc, Some(&mut controller.process.child))
                .await
        }
    };
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    helm_controller.await?;
    outcome
}

/// Each release as `name: words`, words as the controller's crash suite has
/// them: `live`/`terminating`/`gone`, `suspended` (by flux-plunger), `fenced`;
/// for a release still suspended by flux-plunger, `history` once its history
/// names a release (helm-controller changes it only once unsuspended).
async fn observe(ns: &TestNamespace, scenario: Scenario) -> Result<String> {
    let mut lines = Vec::new();
    for name in scenario.releases() {
        let view = ns
            .releases()
            .get_opt(name)
            .await?
            .map(|o| ReleaseView::from_object(&o));
        let mut words = release_words(view.as_ref());
        if view.as_ref().is_some_and(|v| {
            scenario == Scenario::StuckDeleted && v.suspended_by_us() && v.has_history
        }) {
            words.push("history");
        }
        lines.push(format!("{name}: {}", words.join(" ")));
    }
    Ok(lines.join("; "))
}

struct Running {
    process: LoggedProcess,
    _dir: tempfile::TempDir,
}

/// Starts the sidecar of pod [`POD`], one release at a time, as the chart
/// installed in `ns` runs it (`guarded`), and waits until it idles, its
/// signal handlers installed.
async fn start_drain(
    ns: &TestNamespace,
    guarded: &Guarded,
    env: &[(&str, String)],
) -> Result<Running> {
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    guarded.write_controller_kubeconfig(&kubeconfig)?;
    let mut command = Command::new(env!("CARGO_BIN_EXE_flux-plunger-drain"));
    command
        .arg(format!("--kubeconfig={}", kubeconfig.display()))
        .arg("--shutdown-grace-period-seconds=90")
        .arg("--concurrent=1")
        .arg("--log-encoding=console")
        .env("POD_NAME", POD)
        .env("POD_NAMESPACE", &ns.name)
        .env_remove("RUST_LOG")
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())));
    let process = LoggedProcess::spawn(command, "drain")?;
    process
        .wait_logged("idle until SIGTERM", Duration::from_secs(20))
        .await?;
    Ok(Running { process, _dir: dir })
}

/// The controller of the next pod, scoped to the test's namespace.
fn start_controller(ns: &TestNamespace, guarded: &Guarded) -> Result<Running> {
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    guarded.write_controller_kubeconfig(&kubeconfig)?;
    let binary = testkit::control_plane::workspace_binary("flux-plunger")?;
    let [metrics, health] = free_ports()?;
    let mut command = Command::new(binary);
    command
        .arg(format!("--kubeconfig={}", kubeconfig.display()))
        .arg("--leader-elect=false")
        .arg(format!("--watch-namespace={}", ns.name))
        .arg(format!("--metrics-addr=127.0.0.1:{metrics}"))
        .arg(format!("--health-addr=127.0.0.1:{health}"))
        .arg("--log-encoding=console")
        .env_remove("POD_NAME")
        // The same install as the drain's pod: the fences' label names it.
        .env("POD_NAMESPACE", &ns.name)
        .env_remove("RUST_LOG");
    Ok(Running {
        process: LoggedProcess::spawn(command, "flux-plunger")?,
        _dir: dir,
    })
}

/// Makes [`POD`] the holder of the namespace's Lease, as the controller left it.
async fn lead(ns: &TestNamespace) -> Result<()> {
    let mut lock = LeaseLock::new(
        ns.client.clone(),
        &ns.name,
        "flux-plunger",
        POD,
        Duration::from_secs(27),
    );
    anyhow::ensure!(lock.try_acquire_or_renew().await? == Attempt::Held);
    Ok(())
}

/// An installed release with helm-controller's finalizer.
async fn installed(ns: &TestNamespace, hc: &SimulatedHelmController, name: &str) -> Result<()> {
    ns.create_release(name, json!({})).await?;
    hc.install(name).await?;
    hc.handle(name).await?;
    Ok(())
}
