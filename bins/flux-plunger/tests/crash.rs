//! Crash at every step: the controller is SIGKILLed right before and right
//! after each write of SPEC §4 and §5, restarted, and the invariants are
//! checked once things settle:
//!
//! - a release deleted without a foreign suspension got its uninstall;
//! - no suspension or fence of ours is left on a live, settled release;
//! - no storage Secret but the stuck (newest, reclaimable) revision is deleted
//!   from a live release (a deleted one's storage goes with its uninstall);
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
use plunger::names::{
    FENCE_FINALIZER, FIELD_MANAGER, HELM_CONTROLLER_FINALIZER, HELMRELEASE_API_VERSION,
    HELMRELEASE_KIND, PROCESSED_VERSION_ANNOTATION, RECONCILE_REQUEST_PREFIX,
    RECONCILE_REQUESTED_AT_ANNOTATION,
};
use plunger::reconcile::Step;
use plunger::release::view::ReleaseView;
use serde_json::json;
use testkit::crash::{PauseGate, Settled, free_ports, kill9, release_words};
use testkit::helm_controller::pass_due;
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
    /// The release is deleted while the recovery waits at this point, and
    /// helm-controller handles the delete at once (skipping the uninstall, as
    /// the release is suspended): the abort's lift that keeps the fence, then
    /// the fence drop once helm-controller has uninstalled.
    DeletedAt(&'static str),
    /// Our fence is left on a live release another manager suspended (SPEC
    /// §4.3): the fence drop.
    ForeignSuspension,
    /// The same release deleted (SPEC §5b): the fence drop, the uninstall
    /// skipped as that manager meant.
    ForeignSuspensionDeleted,
    /// A stuck release under our fence alone, deleted, which helm-controller
    /// let go unsuspended without an uninstall (its history was empty): the
    /// history handed over, the reconcile request, the fence drop.
    DeletedUnsuspended,
    /// Our fence on a live release, listed by another manager too (a hand
    /// edit): the fence drop gives up our claim, and the guarded patch
    /// removes the copy the other manager holds.
    ForeignFence,
}

/// One crash: the scenario, the point (as `FLUX_PLUNGER_TEST_PAUSE_AT` lists
/// it), and the state the release is in while the process waits there, in
/// the words of [`observe`].
struct Case {
    scenario: Scenario,
    point: &'static str,
    at_kill: &'static str,
}

macro_rules! crash_cases {
    ($($test:ident: $scenario:expr, at $point:literal, state $state:literal;)*) => {
        const CASES: &[Case] = &[$(Case { scenario: $scenario, point: $point, at_kill: $state }),*];
        $(
            #[tokio::test]
            async fn $test() -> Result<()> {
                let case = Case { scenario: $scenario, point: $point, at_kill: $state };
                crash_at(&case).await.with_context(|| {
                    format!("controller killed at {} ({:?})", case.point, case.scenario)
                })
            }
        )*
    };
}

use Scenario::*;

crash_cases! {
    recovery_planned: Recovery, at "planned", state "live stuck-secret";
    recovery_before_acquire: Recovery, at "before-acquire", state "live stuck-secret";
    recovery_acquired_before_annotate: Recovery, at "acquired", state "live suspended fenced stuck-secret";
    recovery_annotated: Recovery, at "annotated", state "live suspended fenced annotated stuck-secret";
    recovery_before_delete_storage: Recovery, at "before-delete-storage", state "live suspended fenced annotated stuck-secret";
    recovery_after_delete_storage: Recovery, at "after-delete-storage", state "live suspended fenced annotated";
    recovery_before_lift: Recovery, at "before-lift", state "live suspended fenced annotated";
    recovery_after_lift: Recovery, at "after-lift", state "live annotated";

    forced_before_forced_acquire: ForcedRecovery, at "before-forced-acquire", state "live stuck-secret";
    forced_acquired: ForcedRecovery, at "acquired", state "live suspended fenced stuck-secret";

    deleted_at_acquired_before_history_write: DeletedAt("acquired"), at "before-history-write", state "terminating suspended fenced stuck-secret";
    deleted_at_acquired_after_history_write: DeletedAt("acquired"), at "after-history-write", state "terminating suspended fenced history stuck-secret";
    deleted_at_acquired_before_undo_lift: DeletedAt("acquired"), at "before-lift", state "terminating suspended fenced history stuck-secret";
    deleted_at_acquired_after_undo_lift: DeletedAt("acquired"), at "after-lift", state "terminating fenced";
    deleted_at_annotated: DeletedAt("annotated"), at "before-delete-storage", state "terminating suspended fenced annotated stuck-secret";
    deleted_before_delete_storage_after_it: DeletedAt("before-delete-storage"), at "after-delete-storage", state "terminating suspended fenced annotated";
    deleted_before_delete_storage_before_final_lift: DeletedAt("before-delete-storage"), at "before-lift", state "terminating suspended fenced annotated";
    deleted_before_delete_storage_before_lift_keeping_fence: DeletedAt("before-delete-storage"), at "before-lift@2", state "terminating suspended fenced annotated history";
    deleted_before_delete_storage_after_lift_keeping_fence: DeletedAt("before-delete-storage"), at "after-lift", state "terminating fenced annotated";

    deleted_unsuspended_before_history_write: DeletedUnsuspended, at "before-history-write", state "terminating fenced stuck-secret";
    deleted_unsuspended_after_history_write: DeletedUnsuspended, at "after-history-write", state "terminating fenced history stuck-secret";
    deleted_unsuspended_before_reconcile_request: DeletedUnsuspended, at "before-reconcile-request", state "terminating fenced history stuck-secret";
    deleted_unsuspended_after_reconcile_request: DeletedUnsuspended, at "after-reconcile-request", state "terminating fenced requested";
    deleted_unsuspended_before_drop_fence: DeletedUnsuspended, at "before-drop-fence", state "terminating fenced requested";
    deleted_unsuspended_after_drop_fence: DeletedUnsuspended, at "after-drop-fence", state "gone";

    foreign_suspension_before_drop_fence: ForeignSuspension, at "before-drop-fence", state "live fenced history";
    foreign_suspension_after_drop_fence: ForeignSuspension, at "after-drop-fence", state "live history";
    foreign_suspension_deleted_before_drop_fence: ForeignSuspensionDeleted, at "before-drop-fence", state "terminating fenced history";
    foreign_suspension_deleted_after_drop_fence: ForeignSuspensionDeleted, at "after-drop-fence", state "gone";

    foreign_fence_before_guarded_patch: ForeignFence, at "before-guarded-patch", state "live fenced history";
    foreign_fence_after_guarded_patch: ForeignFence, at "after-guarded-patch", state "live history";
}

#[test]
fn every_fail_point_of_a_recovery_is_crashed_at() {
    for step in Step::ALL {
        assert!(
            CASES
                .iter()
                .any(|c| c.point.split('@').next() == Some(step.name())),
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
    match case.scenario {
        ForeignSuspension | ForeignSuspensionDeleted => {
            // A fence an earlier flux-plunger left, and a migration's suspension.
            let fence = json!({"apiVersion": HELMRELEASE_API_VERSION, "kind": HELMRELEASE_KIND,
                "metadata": {"name": RELEASE, "finalizers": [FENCE_FINALIZER]}});
            ns.releases()
                .patch(
                    RELEASE,
                    &PatchParams::apply(FIELD_MANAGER),
                    &Patch::Apply(fence),
                )
                .await?;
            ns.update_suspend_as(RELEASE, "migration", true).await?;
            if case.scenario == ForeignSuspensionDeleted {
                ns.releases().delete(RELEASE, &Default::default()).await?;
            }
        }
        ForeignFence => {
            // A hand edit lists the fence (`kubectl patch --type merge`),
            // and an earlier flux-plunger's claim on it is left.
            let params = PatchParams {
                field_manager: Some("kubectl-patch".into()),
                ..Default::default()
            };
            ns.releases()
                .patch(
                    RELEASE,
                    &params,
                    &Patch::Merge(json!({"metadata": {"finalizers": [HELM_CONTROLLER_FINALIZER, FENCE_FINALIZER]}})),
                )
                .await?;
            ns.apply_as_flux_plunger(RELEASE, false).await?;
        }
        Recovery | ForcedRecovery | DeletedAt(_) | DeletedUnsuspended => {
            ns.create_storage_secret(RELEASE, 1, "unknown").await?;
            ns.create_storage_secret(RELEASE, 2, "uninstalling").await?;
            if case.scenario == ForcedRecovery {
                // An Update owning `false`: the unforced acquire conflicts.
                ns.update_suspend_as(RELEASE, "velero", false).await?;
            }
            ns.mark_stuck(RELEASE).await?;
            if case.scenario == DeletedUnsuspended {
                ns.apply_as_flux_plunger(RELEASE, false).await?;
                ns.releases().delete(RELEASE, &Default::default()).await?;
                assert_eq!(
                    hc.handle(RELEASE).await?,
                    Handled::NothingRecordedToUninstall
                );
            }
        }
    }
    let (helm_controller, stop) = hc.clone().spawn(Duration::from_millis(200));

    let gate = PauseGate::new()?;
    let point = case.point;
    let points: Vec<&str> = match case.scenario {
        DeletedAt(delete_at) if delete_at != point => vec![delete_at, point],
        _ => vec![point],
    };
    let mut first = start(&ns, &gate.env(&points))?;
    if let DeletedAt(delete_at) = case.scenario {
        gate.wait_reached(delete_at, &mut first.process.child)
            .await?;
        ns.releases().delete(RELEASE, &Default::default()).await?;
        // helm-controller handles the delete while the release is suspended:
        // it skips the uninstall and drops its finalizer; only the fence holds.
        hc.handle(RELEASE).await?;
        if delete_at != point {
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

    let mut restarted = start(&ns, &[])?;
    // A release listed in neither `live` nor `deleted` must be gone.
    let settled = match case.scenario {
        Recovery | ForcedRecovery => Settled {
            live: vec![RELEASE.into()],
            kept_secrets: vec![BELOW.into()],
            reclaimed_secrets: vec![STUCK.into()],
            ..Default::default()
        },
        // helm-controller's uninstall purges the storage: nothing of it is
        // kept, and the uninstall itself is what `deleted` checks.
        DeletedAt(_) | DeletedUnsuspended => Settled {
            deleted: vec![RELEASE.into()],
            reclaimed_secrets: vec![BELOW.into(), STUCK.into()],
            ..Default::default()
        },
        ForeignSuspension | ForeignFence => Settled {
            live: vec![RELEASE.into()],
            ..Default::default()
        },
        // Gone without its uninstall: the migration suspended it to keep
        // its resources.
        ForeignSuspensionDeleted => Settled::default(),
    };
    let outcome = settled
        .wait(&ns, &hc, Some(&mut restarted.process.child))
        .await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    helm_controller.await?;
    outcome?;
    if matches!(case.scenario, Recovery | ForcedRecovery) {
        let view = ReleaseView::from_object(&ns.releases().get(RELEASE).await?);
        assert_eq!(
            view.annotations
                .get(PROCESSED_VERSION_ANNOTATION)
                .map(String::as_str),
            Some("2"),
            "the recovery is recorded"
        );
    }
    if case.scenario == ForeignSuspension {
        let view = ReleaseView::from_object(&ns.releases().get(RELEASE).await?);
        assert!(view.suspend, "the migration's suspension is left alone");
    }
    Ok(())
}

/// The release as words: `live`/`terminating`/`gone`, then `suspended` (by
/// flux-plunger), `fenced`, `annotated`, `requested` (a reconcile request of
/// flux-plunger's), then what helm-controller's uninstall changes: `history`
/// (its history names a release), `stuck-secret` (the stuck revision still
/// stored). Those two are left out while a pass of helm-controller's over
/// the unsuspended, deleted release is due: it answers on its own clock; the
/// settled state checks the uninstall.
async fn observe(ns: &TestNamespace) -> Result<String> {
    let view = ns
        .releases()
        .get_opt(RELEASE)
        .await?
        .map(|o| ReleaseView::from_object(&o));
    let mut words = release_words(view.as_ref());
    let Some(view) = view else {
        return Ok(words.join(" "));
    };
    if view.annotations.contains_key(PROCESSED_VERSION_ANNOTATION) {
        words.push("annotated");
    }
    if view
        .annotations
        .get(RECONCILE_REQUESTED_AT_ANNOTATION)
        .is_some_and(|v| v.starts_with(RECONCILE_REQUEST_PREFIX))
    {
        words.push("requested");
    }
    // Suspended, by anyone, helm-controller changes neither.
    if view.terminating && !view.suspend && pass_due(&view) {
        return Ok(words.join(" "));
    }
    if view.has_history {
        words.push("history");
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
    let kubeconfig = dir.path().join("kubeconfig");
    testkit::guard::shared()?.write_controller_kubeconfig(&kubeconfig)?;
    let [metrics, health] = free_ports()?;
    let mut command = Command::new(env!("CARGO_BIN_EXE_flux-plunger"));
    command
        .arg(format!("--kubeconfig={}", kubeconfig.display()))
        .arg("--leader-elect=false")
        .arg(format!("--watch-namespace={}", ns.name))
        .arg(format!("--metrics-addr=127.0.0.1:{metrics}"))
        .arg(format!("--health-addr=127.0.0.1:{health}"))
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
