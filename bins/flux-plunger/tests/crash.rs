//! Crash at every step (issue #10, item 3): the controller is SIGKILLed right
//! before and right after each write of SPEC §4 and §5, restarted, and the
//! invariants are checked once things settle:
//!
//! - a release deleted without a foreign suspension got its uninstall;
//! - no suspension or fence of ours is left on a live, settled release;
//! - no storage Secret but the stuck (newest, reclaimable) revision is deleted;
//! - nothing is left Terminating once helm-controller has answered.
//!
//! Each case runs in a namespace of its own, with a controller scoped to it
//! and the simulated helm-controller answering throughout. At the kill the
//! test also checks the release is in the state the point claims (before the
//! write: not written yet; after: written), so a fail point that drifts away
//! from its write fails here.

use std::time::Duration;

use anyhow::{Context, Result};
use kube::api::{Patch, PatchParams};
use plunger::names::PROCESSED_VERSION_ANNOTATION;
use plunger::reconcile::Step;
use plunger::release::ReleaseView;
use serde_json::json;
use testkit::crash::{PauseGate, Settled, admin_kubeconfig, kill9};
use testkit::process::LoggedProcess;
use testkit::{Handled, SimulatedHelmController, TestNamespace, control_plane};
use tokio::process::Command;

const RELEASE: &str = "web";
/// The revision below the stuck one: reclaimable by its status, so only the
/// processed guard keeps it once the stuck one is gone.
const BELOW: &str = "sh.helm.release.v1.web.v1";
/// The stuck revision, the only one flux-plunger may delete.
const STUCK: &str = "sh.helm.release.v1.web.v2";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scenario {
    /// A stuck release recovered: the unforced acquire, the annotation, the
    /// Secret's delete, the lift.
    Recovery,
    /// The same where a backup controller owns `spec.suspend: false` through
    /// an Update, so the acquire is forced.
    ForcedRecovery,
    /// The release is deleted while the recovery holds it (at `annotated`):
    /// the abort's lift that keeps the fence, then the fence drop once
    /// helm-controller has uninstalled.
    DeleteDuringRecovery,
}

/// One crash: the scenario, the point, and the state the release is in
/// while the process waits there, in the words of [`observe`].
struct Case {
    scenario: Scenario,
    point: Step,
    at_kill: &'static str,
}

macro_rules! crash_cases {
    ($($test:ident: $scenario:ident at $point:ident, state $state:literal;)*) => {
        const CASES: &[Case] = &[$(Case {
            scenario: Scenario::$scenario,
            point: Step::$point,
            at_kill: $state,
        }),*];
        $(
            #[tokio::test]
            async fn $test() -> Result<()> {
                let case = CASES
                    .iter()
                    .find(|c| c.scenario == Scenario::$scenario && c.point == Step::$point)
                    .expect("listed");
                crash_at(case).await.with_context(|| {
                    format!("controller killed at {} ({:?})", case.point.name(), case.scenario)
                })
            }
        )*
    };
}

crash_cases! {
    recovery_before_acquire: Recovery at BeforeAcquire, state "live stuck-secret";
    recovery_acquired_before_annotate: Recovery at Acquired, state "live suspended fenced stuck-secret";
    recovery_annotated: Recovery at Annotated, state "live suspended fenced annotated stuck-secret";
    recovery_before_delete_storage: Recovery at BeforeDeleteStorage, state "live suspended fenced annotated stuck-secret";
    recovery_after_delete_storage: Recovery at AfterDeleteStorage, state "live suspended fenced annotated";
    recovery_before_lift: Recovery at BeforeLift, state "live suspended fenced annotated";
    recovery_after_lift: Recovery at AfterLift, state "live annotated";
    forced_before_forced_acquire: ForcedRecovery at BeforeForcedAcquire, state "live stuck-secret";
    forced_acquired: ForcedRecovery at Acquired, state "live suspended fenced stuck-secret";
    deleted_while_held_annotated: DeleteDuringRecovery at Annotated, state "terminating suspended fenced annotated stuck-secret";
    deleted_before_abort_lift: DeleteDuringRecovery at BeforeLift, state "terminating suspended fenced annotated stuck-secret";
    deleted_after_abort_lift: DeleteDuringRecovery at AfterLift, state "terminating fenced annotated stuck-secret";
    deleted_before_drop_fence: DeleteDuringRecovery at BeforeDropFence, state "terminating fenced annotated stuck-secret";
    deleted_after_drop_fence: DeleteDuringRecovery at AfterDropFence, state "gone stuck-secret";
}

#[test]
fn every_fail_point_of_a_recovery_is_crashed_at() {
    for step in Step::ALL {
        assert!(
            CASES.iter().any(|c| c.point == step),
            "no crash case at {}",
            step.name()
        );
    }
}

async fn crash_at(case: &Case) -> Result<()> {
    let client = control_plane().client().await?;
    let ns = TestNamespace::create(&client, "crash").await?;
    let hc = SimulatedHelmController::new(client.clone(), &ns.name);
    ns.create_release(RELEASE, json!({})).await?;
    hc.install(RELEASE).await?;
    assert_eq!(hc.handle(RELEASE).await?, Handled::AddedFinalizer);
    ns.create_storage_secret(RELEASE, 1, "failed").await?;
    ns.create_storage_secret(RELEASE, 2, "uninstalling").await?;
    if case.scenario == Scenario::ForcedRecovery {
        // An Update owning `false`: the unforced acquire conflicts.
        let params = PatchParams {
            field_manager: Some("velero".into()),
            ..Default::default()
        };
        ns.releases()
            .patch(
                RELEASE,
                &params,
                &Patch::Merge(json!({"spec": {"suspend": false}})),
            )
            .await?;
    }
    ns.mark_stuck(RELEASE).await?;
    let (helm_controller, stop) = hc.clone().spawn(Duration::from_millis(200));

    let gate = PauseGate::new()?;
    let point = case.point.name();
    let delete_at = Step::Annotated.name();
    let points: Vec<&str> = match case.scenario {
        Scenario::DeleteDuringRecovery if case.point != Step::Annotated => vec![delete_at, point],
        _ => vec![point],
    };
    let mut first = start(&ns, &gate.env(&points))?;
    if case.scenario == Scenario::DeleteDuringRecovery {
        gate.wait_reached(delete_at, &mut first.process.child)
            .await?;
        ns.releases().delete(RELEASE, &Default::default()).await?;
        // helm-controller handles the delete while the release is suspended:
        // it skips the uninstall and drops its finalizer; only the fence holds.
        hc.handle(RELEASE).await?;
        if case.point != Step::Annotated {
            gate.release()?;
        }
    }
    gate.wait_reached(point, &mut first.process.child).await?;
    let state = observe(&ns).await?;
    kill9(&mut first.process.child).await?;
    assert_eq!(
        state, case.at_kill,
        "the state at {point} is not what the point claims"
    );

    let _restarted = start(&ns, &[])?;
    let settled = match case.scenario {
        Scenario::Recovery | Scenario::ForcedRecovery => Settled {
            live: vec![RELEASE.into()],
            kept_secrets: vec![BELOW.into()],
            reclaimed_secrets: vec![STUCK.into()],
            ..Default::default()
        },
        Scenario::DeleteDuringRecovery => Settled {
            deleted: vec![RELEASE.into()],
            kept_secrets: vec![BELOW.into(), STUCK.into()],
            ..Default::default()
        },
    };
    let outcome = settled.wait(&ns, &hc).await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    helm_controller.await?;
    outcome?;
    if case.scenario != Scenario::DeleteDuringRecovery {
        let view = ReleaseView::from_object(&ns.releases().get(RELEASE).await?);
        assert_eq!(
            view.annotations
                .get(PROCESSED_VERSION_ANNOTATION)
                .map(String::as_str),
            Some("2"),
            "the recovery is recorded"
        );
    }
    Ok(())
}

/// The release as words: `live`/`terminating`/`gone`, then `suspended` (by
/// flux-plunger), `fenced`, `annotated`, `stuck-secret` (the stuck revision
/// still stored). Whether helm-controller has uninstalled yet is left out: it
/// answers on its own clock; the settled state checks the uninstall.
async fn observe(ns: &TestNamespace) -> Result<String> {
    let mut words = Vec::new();
    match ns.releases().get_opt(RELEASE).await? {
        None => words.push("gone"),
        Some(object) => {
            let view = ReleaseView::from_object(&object);
            words.push(if view.terminating {
                "terminating"
            } else {
                "live"
            });
            if view.suspended_by_us() {
                words.push("suspended");
            }
            if view.has_fence() {
                words.push("fenced");
            }
            if view.annotations.contains_key(PROCESSED_VERSION_ANNOTATION) {
                words.push("annotated");
            }
        }
    }
    if ns.secrets().get_opt(STUCK).await?.is_some() {
        words.push("stuck-secret");
    }
    Ok(words.join(" "))
}

/// Starts a controller scoped to `ns` (so cases run side by side), with
/// `env` added; its log is shown when the test fails.
fn start(ns: &TestNamespace, env: &[(&str, String)]) -> Result<Controller> {
    let dir = tempfile::tempdir()?;
    let kubeconfig = admin_kubeconfig(dir.path())?;
    let free_port = || testkit::control_plane::free_port();
    let mut command = Command::new(env!("CARGO_BIN_EXE_flux-plunger"));
    command
        .arg(format!("--kubeconfig={}", kubeconfig.display()))
        .arg("--leader-elect=false")
        .arg(format!("--watch-namespace={}", ns.name))
        .arg(format!("--metrics-addr=127.0.0.1:{}", free_port()?))
        .arg(format!("--health-addr=127.0.0.1:{}", free_port()?))
        .arg("--log-encoding=console")
        .env_remove("POD_NAME")
        .env_remove("POD_NAMESPACE")
        .env_remove("RUST_LOG")
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())));
    Ok(Controller {
        process: LoggedProcess::spawn(command, "flux-plunger")?,
        _dir: dir,
    })
}

struct Controller {
    process: LoggedProcess,
    _dir: tempfile::TempDir,
}
