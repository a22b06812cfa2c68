//! Every branch of `decide`, `plan_recovery` and the small predicates.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{FieldsV1, ManagedFieldsEntry};
use serde_json::json;

use super::recovery::*;
use super::storage::*;
use super::*;
use crate::history::HistorySnapshot;
use crate::names::{
    FENCE_FINALIZER, HELM_CONTROLLER_FINALIZER, LEGACY_FENCE_LABEL_VALUE,
    PROCESSED_BELOW_UID_ANNOTATION, PROCESSED_VERSION_ANNOTATION,
};
use crate::notices::AfterRecovery;
use crate::release::view::{ReadyCondition, ReleasedCondition};

const MINUTE: Duration = Duration::from_secs(60);

fn entry(manager: &str, operation: &str, owns_suspend: bool) -> ManagedFieldsEntry {
    let fields = if owns_suspend {
        json!({"f:spec": {"f:suspend": {}}})
    } else {
        json!({"f:spec": {"f:interval": {}}})
    };
    ManagedFieldsEntry {
        manager: Some(manager.into()),
        operation: Some(operation.into()),
        fields_v1: Some(FieldsV1(fields)),
        ..Default::default()
    }
}

fn release() -> ReleaseView {
    ReleaseView {
        namespace: "apps".into(),
        name: "web".into(),
        uid: "uid-1".into(),
        resource_version: "7".into(),
        generation: Some(3),
        observed_generation: Some(3),
        finalizers: vec![HELM_CONTROLLER_FINALIZER.into()],
        status_storage_namespace: Some("apps".into()),
        status_latest_history_name: Some("web".into()),
        has_history: true,
        ..Default::default()
    }
}

/// As helm-controller leaves a release it no longer recognises: its history
/// cleared, its storage namespace kept.
fn stuck(mut r: ReleaseView) -> ReleaseView {
    r.ready = Some(ReadyCondition {
        status: "False".into(),
        message: "Helm upgrade failed: \"web\" has no deployed releases".into(),
    });
    r.has_history = false;
    r.status_latest_history_name = None;
    r
}

fn suspended_by(mut r: ReleaseView, manager: &str, operation: &str) -> ReleaseView {
    r.suspend = true;
    r.managed_fields.push(entry(manager, operation, true));
    r
}

fn ours(r: ReleaseView) -> ReleaseView {
    suspended_by(r, "flux-plunger", "Apply")
}

/// Fenced by flux-plunger: its `Apply` entry owns the finalizer.
fn fenced(r: ReleaseView) -> ReleaseView {
    fenced_by(r, "flux-plunger", "Apply")
}

/// The fence put there by `manager` (a client-side create is an `Update`).
fn fenced_by(mut r: ReleaseView, manager: &str, operation: &str) -> ReleaseView {
    r.finalizers.push(FENCE_FINALIZER.into());
    r.fence_label = Some(LEGACY_FENCE_LABEL_VALUE.to_owned());
    r.managed_fields.push(ManagedFieldsEntry {
        manager: Some(manager.into()),
        operation: Some(operation.into()),
        fields_v1: Some(FieldsV1(
            json!({"f:metadata": {"f:finalizers": {format!("v:\"{FENCE_FINALIZER}\""): {}}}}),
        )),
        ..Default::default()
    });
    r
}

fn annotated(mut r: ReleaseView, value: &str) -> ReleaseView {
    r.annotations
        .insert(PROCESSED_VERSION_ANNOTATION.into(), value.into());
    r
}

fn terminating(mut r: ReleaseView) -> ReleaseView {
    r.terminating = true;
    r
}

/// What `decide` answers before anything is read.
const NEEDS_STORAGE: Answer = Answer::Needs(Need::Storage);

/// `decide` before anything is read, when that decides.
fn decide(r: &ReleaseView, context: &Context) -> Decision {
    decided(super::decide(r, &Known::default(), context))
}

/// What `decide` answers before anything is read.
fn asks(r: &ReleaseView, context: &Context) -> Answer {
    super::decide(r, &Known::default(), context)
}

/// `decide`, knowing the storage (and given a turn, when it asks for one).
fn decide_with_storage(r: &ReleaseView, storage: &StorageFacts, context: &Context) -> Decision {
    let known = Known {
        storage: Some(storage.clone()),
        recovery_turn: Some(Ok(())),
    };
    decided(super::decide(r, &known, context))
}

fn decided(answer: Answer) -> Decision {
    match answer {
        Answer::Decided(decision) => decision,
        Answer::Needs(need) => panic!("decide needs {need:?}"),
    }
}

fn clock() -> Context {
    Context {
        terminating_for: None,
        since_last_fence_warning: None,
        fence_recheck_interval: MINUTE,
        fence_held_warning_after: 10 * MINUTE,
        storage_failure: None,
        holds_waiting_releases: true,
        fence_holder: FenceHolder::ThisInstall,
        may_recover: true,
        dry_run: false,
        rate_limited: false,
    }
}

/// As decided by an install whose fence's label the release does not carry.
fn fence_labelled_as(holder: FenceHolder) -> Context {
    Context {
        fence_holder: holder,
        ..clock()
    }
}

/// As the drain decides: it lets go of every live release.
fn draining() -> Context {
    Context {
        holds_waiting_releases: false,
        ..clock()
    }
}

fn held_for(held: Duration, warned: Option<Duration>) -> Context {
    Context {
        terminating_for: Some(held),
        since_last_fence_warning: warned,
        ..clock()
    }
}

fn event_of(decision: &Decision) -> Option<&EventSpec> {
    match decision {
        Decision::Nothing { event } | Decision::DropFence { event } => event.as_ref(),
        Decision::HoldFence { event, .. } => event.as_ref(),
        _ => None,
    }
}

// --- live releases (SPEC §4) ---

#[test]
fn a_healthy_release_needs_nothing() {
    assert_eq!(
        decide(&release(), &clock()),
        Decision::Nothing { event: None }
    );
}

#[test]
fn a_ready_false_release_with_another_message_is_not_stuck() {
    let mut r = release();
    r.ready = Some(ReadyCondition {
        status: "False".into(),
        message: "install retries exhausted".into(),
    });
    assert_eq!(decide(&r, &clock()), Decision::Nothing { event: None });
}

#[test]
fn a_ready_true_release_mentioning_the_message_is_not_stuck() {
    let mut r = stuck(release());
    r.ready.as_mut().unwrap().status = "True".into();
    assert_eq!(decide(&r, &clock()), Decision::Nothing { event: None });
}

#[test]
fn a_stuck_clean_release_goes_on_to_its_storage() {
    assert_eq!(asks(&stuck(release()), &clock()), NEEDS_STORAGE);
}

#[test]
fn our_suspension_on_a_live_release_is_lifted_with_the_fence_and_nothing_else() {
    let r = fenced(ours(release()));
    assert_eq!(decide(&r, &clock()), Decision::Lift { keep_fence: false });
}

#[test]
fn our_suspension_on_a_release_still_stuck_is_lifted_and_the_fence_kept_for_the_retry() {
    let r = stuck(fenced(ours(release())));
    assert_eq!(decide(&r, &clock()), Decision::Lift { keep_fence: true });
}

#[test]
fn the_drain_lifts_our_suspension_and_the_fence_of_a_stuck_release_together() {
    let r = stuck(fenced(ours(release())));
    assert_eq!(
        decide(&r, &draining()),
        Decision::Lift { keep_fence: false }
    );
}

#[test]
fn a_stuck_release_fenced_while_its_recovery_waits_goes_on_to_its_storage() {
    assert_eq!(asks(&stuck(fenced(release())), &clock()), NEEDS_STORAGE);
}

/// helm-controller's retry of a stuck release, while its action runs.
fn mid_pass(mut r: ReleaseView) -> ReleaseView {
    r.ready = Some(ReadyCondition {
        status: "Unknown".into(),
        message: "Running 'upgrade' action with timeout of 5m0s".into(),
    });
    r
}

#[test]
fn a_fenced_release_keeps_its_fence_while_helm_controller_retries_it() {
    // Its retry shows Ready Unknown between two stuck answers: a delete in
    // that window must still be held.
    assert_eq!(
        decide(&mid_pass(fenced(release())), &clock()),
        Decision::Nothing { event: None }
    );
    assert_eq!(
        decide(&mid_pass(fenced(ours(release()))), &clock()),
        Decision::Lift { keep_fence: true }
    );
}

#[test]
fn the_drain_drops_the_fence_of_a_release_helm_controller_is_retrying() {
    assert_eq!(
        decide(&mid_pass(fenced(release())), &draining()),
        Decision::DropFence { event: None }
    );
}

#[test]
fn an_opted_out_release_keeps_no_fence_while_helm_controller_retries_it() {
    let mut r = mid_pass(fenced(release()));
    r.annotations
        .insert(crate::names::RECOVER_ANNOTATION.into(), "disabled".into());
    assert_eq!(decide(&r, &clock()), Decision::DropFence { event: None });
}

#[test]
fn a_release_helm_controller_is_retrying_gets_no_fence_it_did_not_have() {
    assert_eq!(
        decide(&mid_pass(release()), &clock()),
        Decision::Nothing { event: None }
    );
}

#[test]
fn the_drain_drops_the_fence_of_a_stuck_release_waiting_for_its_recovery() {
    assert_eq!(
        decide(&stuck(fenced(release())), &draining()),
        Decision::DropFence { event: None }
    );
}

#[test]
fn an_opted_out_stuck_release_keeps_no_fence_and_no_suspension_of_ours() {
    let mut r = stuck(fenced(release()));
    r.annotations
        .insert(crate::names::RECOVER_ANNOTATION.into(), "disabled".into());
    assert_eq!(decide(&r, &clock()), Decision::DropFence { event: None });
    let r = ours(r);
    assert_eq!(decide(&r, &clock()), Decision::Lift { keep_fence: false });
}

#[test]
fn our_suspension_shared_with_another_applier_still_counts_as_ours() {
    let r = suspended_by(ours(release()), "migration", "Apply");
    assert_eq!(decide(&r, &clock()), Decision::Lift { keep_fence: false });
}

#[test]
fn an_update_entry_of_our_manager_is_not_our_suspension() {
    let r = suspended_by(release(), "flux-plunger", "Update");
    assert!(matches!(
        decide(&r, &clock()),
        Decision::Nothing { event: Some(_) }
    ));
}

#[test]
fn an_apply_entry_of_ours_that_does_not_own_suspend_is_not_our_suspension() {
    let mut r = suspended_by(release(), "kubectl", "Update");
    r.managed_fields.push(entry("flux-plunger", "Apply", false));
    assert!(matches!(
        decide(&r, &clock()),
        Decision::Nothing { event: Some(_) }
    ));
}

#[test]
fn a_foreign_suspension_is_left_alone_with_a_normal_event() {
    let r = stuck(suspended_by(release(), "kubectl-patch", "Update"));
    let decision = decide(&r, &clock());
    let event = event_of(&decision).expect("an event");
    assert!(matches!(decision, Decision::Nothing { .. }));
    assert_eq!(event.reason, "SuspensionNotOwned");
    assert!(!event.warning);
}

#[test]
fn a_shared_client_side_apply_suspension_is_never_claimed() {
    let r = suspended_by(release(), "flux-client-side-apply", "Apply");
    let decision = decide(&r, &clock());
    assert!(matches!(decision, Decision::Nothing { .. }));
    assert_eq!(event_of(&decision).unwrap().reason, "SuspensionNotOwned");
}

#[test]
fn a_foreign_suspension_on_a_release_we_recovered_before_is_a_warning() {
    let r = annotated(
        suspended_by(release(), "flux-client-side-apply", "Update"),
        "4",
    );
    let event = decide(&r, &clock());
    let event = event_of(&event).unwrap();
    assert_eq!(event.reason, "SuspensionNotOwned");
    assert!(event.warning);
}

#[test]
fn our_fence_under_a_foreign_suspension_is_dropped_with_the_event() {
    let r = fenced(suspended_by(release(), "operator", "Apply"));
    let decision = decide(&r, &clock());
    assert!(matches!(decision, Decision::DropFence { event: Some(_) }));
    assert_eq!(event_of(&decision).unwrap().reason, "SuspensionNotOwned");
}

#[test]
fn a_fence_without_a_suspension_is_dropped_and_nothing_else_happens() {
    let r = fenced(release());
    assert_eq!(decide(&r, &clock()), Decision::DropFence { event: None });
}

#[test]
fn a_suspension_whose_value_is_false_is_no_suspension() {
    let mut r = stuck(release());
    r.managed_fields.push(entry("flux-plunger", "Apply", true));
    assert_eq!(asks(&r, &clock()), NEEDS_STORAGE);
}

// --- terminating releases (SPEC §5) ---

#[test]
fn our_suspension_on_a_deleted_release_is_lifted_and_the_fence_kept() {
    let r = terminating(fenced(ours(release())));
    assert_eq!(decide(&r, &clock()), Decision::Lift { keep_fence: true });
}

#[test]
fn our_suspension_on_a_deleted_release_without_a_fence_is_lifted_without_adding_one() {
    let r = terminating(ours(release()));
    assert_eq!(decide(&r, &clock()), Decision::Lift { keep_fence: false });
}

#[test]
fn a_deleted_release_under_a_foreign_suspension_loses_our_fence_with_a_normal_event() {
    let r = terminating(fenced(suspended_by(release(), "migration", "Apply")));
    let decision = decide(&r, &clock());
    assert!(matches!(decision, Decision::DropFence { event: Some(_) }));
    let event = event_of(&decision).unwrap();
    assert_eq!(event.reason, "TerminatingWhileSuspended");
    assert!(!event.warning);
}

#[test]
fn a_deleted_release_under_a_foreign_suspension_we_recovered_before_is_a_warning() {
    let r = annotated(
        terminating(fenced(suspended_by(release(), "migration", "Apply"))),
        "3",
    );
    let decision = decide(&r, &clock());
    let event = event_of(&decision).unwrap();
    assert_eq!(event.reason, "TerminatingWhileSuspended");
    assert!(event.warning);
}

#[test]
fn a_deleted_release_under_a_foreign_suspension_without_our_fence_only_gets_the_event() {
    let r = terminating(suspended_by(release(), "migration", "Apply"));
    let decision = decide(&r, &clock());
    assert!(matches!(decision, Decision::Nothing { event: Some(_) }));
}

#[test]
fn a_deleted_release_without_our_fence_needs_nothing() {
    let r = terminating(stuck(release()));
    assert_eq!(decide(&r, &clock()), Decision::Nothing { event: None });
}

/// helm-controller's pass over the delete: its finalizer gone, the
/// generation observed, the history and storage namespace cleared; with
/// `uninstalled`, the `Released` condition it writes for an uninstall.
fn handled_by_helm_controller(mut r: ReleaseView, uninstalled: bool) -> ReleaseView {
    r.finalizers.retain(|f| f != HELM_CONTROLLER_FINALIZER);
    r.generation = Some(5);
    r.observed_generation = Some(5);
    r.has_history = false;
    r.status_latest_history_name = None;
    r.status_storage_namespace = None;
    if uninstalled {
        r.released = Some(ReleasedCondition {
            reason: "UninstallSucceeded".into(),
            observed_generation: Some(5),
        });
    }
    r
}

#[test]
fn the_fence_goes_once_helm_controller_has_uninstalled_the_observed_generation() {
    let r = handled_by_helm_controller(terminating(fenced(release())), true);
    assert_eq!(decide(&r, &clock()), Decision::DropFence { event: None });
}

#[test]
fn the_fence_stays_while_helm_controller_still_holds_its_finalizer() {
    let r = terminating(fenced(release()));
    assert_eq!(
        decide(&r, &clock()),
        Decision::HoldFence {
            recheck: MINUTE,
            event: None,
            label_fence: false,
        }
    );
}

#[test]
fn a_held_fence_an_older_flux_plunger_set_without_its_label_gets_the_label() {
    let mut r = terminating(fenced(release()));
    r.fence_label = None;
    assert_eq!(
        decide(&r, &fence_labelled_as(FenceHolder::Unlabelled)),
        Decision::HoldFence {
            recheck: MINUTE,
            event: None,
            label_fence: true,
        }
    );
}

#[test]
fn a_held_fence_labelled_before_the_label_named_an_install_is_labelled_as_this_ones() {
    let r = terminating(fenced(release()));
    assert_eq!(
        decide(&r, &fence_labelled_as(FenceHolder::Legacy)),
        Decision::HoldFence {
            recheck: MINUTE,
            event: None,
            label_fence: true,
        }
    );
}

#[test]
fn another_installs_fence_is_left_to_that_install_whatever_the_release_needs() {
    let other = fence_labelled_as(FenceHolder::AnotherInstall);
    // Stuck and waiting for its recovery: not started here.
    assert_eq!(
        decide(&fenced(stuck(release())), &other),
        Decision::Nothing { event: None }
    );
    // Under a suspension of flux-plunger's manager, which came with that
    // install's fence: not lifted here.
    let suspended = ours(fenced(stuck(release())));
    assert_eq!(
        decide(&suspended, &other),
        Decision::Nothing { event: None }
    );
    assert_eq!(
        decide(&terminating(suspended), &other),
        Decision::Nothing { event: None }
    );
    // Deleted with the fence: neither held, handed over nor let go here.
    assert_eq!(
        decide(&terminating(fenced(release())), &other),
        Decision::Nothing { event: None }
    );
}

#[test]
fn another_installs_label_without_its_fence_stops_nothing() {
    let mut r = stuck(release());
    r.fence_label = Some("tenant-b.flux-plunger".into());
    assert_eq!(
        asks(&r, &fence_labelled_as(FenceHolder::AnotherInstall)),
        NEEDS_STORAGE
    );
}

#[test]
fn the_fence_stays_until_helm_controller_has_observed_the_unsuspended_generation() {
    let mut r = terminating(fenced(release()));
    r.finalizers.retain(|f| f != HELM_CONTROLLER_FINALIZER);
    r.generation = Some(5);
    r.observed_generation = Some(4);
    assert!(matches!(decide(&r, &clock()), Decision::HoldFence { .. }));
    r.observed_generation = None;
    assert!(matches!(decide(&r, &clock()), Decision::HoldFence { .. }));
}

#[test]
fn a_delete_held_ten_minutes_raises_uninstall_fence_held() {
    let r = terminating(fenced(release()));
    let decision = decide(&r, &held_for(10 * MINUTE, None));
    let event = event_of(&decision).expect("a warning");
    assert_eq!(event.reason, "UninstallFenceHeld");
    assert!(event.warning);
    assert!(event.note.contains("10m 0s"), "{}", event.note);
}

#[test]
fn a_delete_held_less_than_ten_minutes_raises_nothing() {
    let r = terminating(fenced(release()));
    let decision = decide(&r, &held_for(10 * MINUTE - Duration::from_secs(1), None));
    assert_eq!(event_of(&decision), None);
}

#[test]
fn a_held_delete_warns_at_most_once_per_recheck_interval() {
    let r = terminating(fenced(release()));
    let soon = decide(&r, &held_for(30 * MINUTE, Some(Duration::from_secs(59))));
    assert_eq!(event_of(&soon), None);
    let later = decide(&r, &held_for(30 * MINUTE, Some(MINUTE)));
    assert!(event_of(&later).is_some());
}

#[test]
fn a_terminating_stuck_release_never_starts_a_recovery() {
    let r = terminating(stuck(release()));
    let known = Known {
        storage: Some(listed(&[revision(2, "uninstalling")])),
        recovery_turn: Some(Ok(())),
    };
    assert_eq!(
        super::decide(&r, &known, &clock()),
        Answer::Decided(Decision::Nothing { event: None })
    );
}

// --- the uninstall of a release deleted with an empty history (SPEC §5a, §5d) ---

fn snapshot_of(r: &StorageRevision) -> HistorySnapshot {
    HistorySnapshot::example("web", r.revision, &r.status)
}

/// The storage as `reconcile` reads it: the snapshot of the uninstall's
/// target is read only when it is a live newest revision.
fn listed(revisions: &[StorageRevision]) -> StorageFacts {
    let snapshot = match uninstall_target(revisions) {
        UninstallTarget::Revision(target) => Some(Ok(Box::new(snapshot_of(target)))),
        _ => None,
    };
    StorageFacts::Listed {
        revisions: revisions.to_vec(),
        snapshot,
    }
}

fn stuck_storage() -> StorageFacts {
    listed(&[revision(1, "superseded"), revision(2, "uninstalling")])
}

fn hand_over_of(decision: &Decision) -> (&HistorySnapshot, Option<&str>, AfterHandOver) {
    match decision {
        Decision::HandOver {
            snapshot,
            storage_namespace,
            then,
            ..
        } => (snapshot, storage_namespace.as_deref(), *then),
        other => panic!("not a hand-over: {other:?}"),
    }
}

#[test]
fn our_suspension_on_a_deleted_release_with_an_empty_history_waits_for_its_storage() {
    let r = terminating(fenced(ours(stuck(release()))));
    assert_eq!(asks(&r, &clock()), NEEDS_STORAGE);
}

#[test]
fn the_newest_revision_is_handed_to_helm_controller_before_our_suspension_is_lifted() {
    let r = terminating(fenced(ours(stuck(release()))));
    let decision = decide_with_storage(&r, &stuck_storage(), &clock());
    let (snapshot, storage_namespace, then) = hand_over_of(&decision);
    assert_eq!(snapshot, &snapshot_of(&revision(2, "uninstalling")));
    assert_eq!(storage_namespace, None, "the status still names it");
    assert_eq!(then, AfterHandOver::Lift { keep_fence: true });
    let event = match &decision {
        Decision::HandOver { event, .. } => event,
        _ => unreachable!(),
    };
    assert_eq!(
        (event.reason, event.warning),
        ("UninstallHandedOver", false)
    );
    assert!(
        event.note.contains("revision 2 (apps/web.v2")
            && event.note.contains("sh.helm.release.v1.web.v2"),
        "{}",
        event.note
    );
}

#[test]
fn a_storage_namespace_the_status_lost_is_handed_over_with_the_history() {
    let mut r = terminating(fenced(ours(stuck(release()))));
    r.status_storage_namespace = None;
    let decision = decide_with_storage(&r, &stuck_storage(), &clock());
    assert_eq!(hand_over_of(&decision).1, Some("apps"));
}

#[test]
fn a_newest_uninstalled_revision_above_history_is_nothing_to_hand_over() {
    let r = terminating(fenced(ours(stuck(release()))));
    let storage = listed(&[revision(1, "superseded"), revision(2, "uninstalled")]);
    assert_eq!(
        decide_with_storage(&r, &storage, &clock()),
        Decision::Lift { keep_fence: true },
        "our suspension goes; no superseded revision is handed over"
    );
}

#[test]
fn a_newest_uninstalled_revision_above_history_drops_the_fence_once_helm_controller_is_done() {
    let r = handled_by_helm_controller(terminating(fenced(release())), false);
    let storage = listed(&[revision(1, "superseded"), revision(2, "uninstalled")]);
    assert_eq!(
        decide_with_storage(&r, &storage, &clock()),
        Decision::DropFence { event: None },
        "nothing is installed: nothing to uninstall, nothing to warn about"
    );
}

#[test]
fn with_nothing_to_hand_over_our_suspension_is_still_lifted() {
    let r = terminating(fenced(ours(stuck(release()))));
    let unreadable_payload = StorageFacts::Listed {
        revisions: vec![revision(2, "uninstalling")],
        snapshot: Some(Err("not gzip".into())),
    };
    for storage in [
        listed(&[]),
        listed(&[revision(1, "uninstalled")]),
        StorageFacts::Unreadable {
            why: "forbidden".into(),
            cause: Unreadable::AccessRefused,
        },
        unreadable_payload,
    ] {
        assert_eq!(
            decide_with_storage(&r, &storage, &clock()),
            Decision::Lift { keep_fence: true },
            "{storage:?}"
        );
    }
}

#[test]
fn a_revision_installed_outside_the_release_s_target_namespace_is_never_handed_over() {
    // Whoever can write the storage namespace writes the payload. helm-
    // controller's uninstall acts on the history's namespace, and the
    // admission guard refuses a history outside the release's own target
    // namespace: handed over, it would be refused on every retry, and our
    // suspension never lifted.
    let elsewhere = |revision: &StorageRevision| {
        let mut snapshot = snapshot_of(revision);
        snapshot.namespace = "kube-system".into();
        StorageFacts::Listed {
            revisions: vec![revision.clone()],
            snapshot: Some(Ok(Box::new(snapshot))),
        }
    };
    let storage = elsewhere(&revision(2, "uninstalling"));
    let suspended = terminating(fenced(ours(stuck(release()))));
    assert_eq!(
        decide_with_storage(&suspended, &storage, &clock()),
        Decision::Lift { keep_fence: true }
    );
    let passed = handled_by_helm_controller(terminating(fenced(release())), false);
    match decide_with_storage(&passed, &storage, &clock()) {
        Decision::ReleaseWithoutUninstall { event } => {
            assert!(event.note.contains("kube-system"), "{}", event.note)
        }
        other => panic!("{other:?}"),
    }
    let mut targeted = suspended.clone();
    targeted.spec_target_namespace = Some("kube-system".into());
    let handed_over = decide_with_storage(&targeted, &storage, &clock());
    let (snapshot, _, _) = hand_over_of(&handed_over);
    assert_eq!(
        snapshot.namespace, "kube-system",
        "its own target namespace"
    );
}

#[test]
fn a_release_whose_history_helm_controller_kept_is_lifted_without_reading_storage() {
    let r = terminating(fenced(ours(release())));
    assert_eq!(decide(&r, &clock()), Decision::Lift { keep_fence: true });
}

#[test]
fn an_uninstall_reported_for_an_older_generation_does_not_count() {
    let mut r = handled_by_helm_controller(terminating(fenced(release())), true);
    r.released = Some(ReleasedCondition {
        reason: "UninstallSucceeded".into(),
        observed_generation: Some(4),
    });
    assert_eq!(asks(&r, &clock()), NEEDS_STORAGE);
}

#[test]
fn after_helm_controller_s_pass_over_an_empty_history_the_history_is_handed_over_with_a_reconcile_request()
 {
    let r = handled_by_helm_controller(terminating(fenced(release())), false);
    assert_eq!(asks(&r, &clock()), NEEDS_STORAGE);
    let decision = decide_with_storage(&r, &stuck_storage(), &clock());
    let (snapshot, storage_namespace, then) = hand_over_of(&decision);
    assert_eq!(snapshot.version, 2);
    assert_eq!(
        storage_namespace,
        Some("apps"),
        "helm-controller skips the uninstall of a release without one"
    );
    assert_eq!(then, AfterHandOver::RequestReconcile);
}

#[test]
fn a_history_handed_over_but_not_yet_requested_is_followed_by_the_request() {
    let mut r = handled_by_helm_controller(terminating(fenced(release())), false);
    r.has_history = true;
    assert_eq!(
        decide_with_storage(&r, &stuck_storage(), &clock()),
        Decision::RequestReconcile
    );
}

fn requested(mut r: ReleaseView, value: &str, handled: Option<&str>) -> ReleaseView {
    r.annotations
        .insert("reconcile.fluxcd.io/requestedAt".into(), value.into());
    r.last_handled_reconcile_at = handled.map(str::to_owned);
    r
}

#[test]
fn a_pending_reconcile_request_holds_the_fence() {
    let r = requested(
        handled_by_helm_controller(terminating(fenced(release())), false),
        "flux-plunger-uninstall-2",
        Some("flux-plunger-uninstall-1"),
    );
    assert!(matches!(decide(&r, &clock()), Decision::HoldFence { .. }));
}

#[test]
fn a_history_helm_controller_cleared_again_is_let_go_with_a_warning_naming_what_is_left() {
    let r = requested(
        handled_by_helm_controller(terminating(fenced(release())), false),
        "flux-plunger-uninstall-1",
        Some("flux-plunger-uninstall-1"),
    );
    let decision = decide_with_storage(&r, &stuck_storage(), &clock());
    let Decision::ReleaseWithoutUninstall { event } = decision else {
        panic!("{decision:?}")
    };
    assert_eq!(
        (event.reason, event.warning),
        ("ReleasedWithoutUninstall", true)
    );
    assert!(
        event
            .note
            .contains("apps/sh.helm.release.v1.web.v1 (status superseded), apps/sh.helm.release.v1.web.v2 (status uninstalling)"),
        "{}",
        event.note
    );
}

#[test]
fn a_history_kept_after_our_request_means_helm_controller_retries_its_uninstall() {
    let mut r = requested(
        handled_by_helm_controller(terminating(fenced(release())), false),
        "flux-plunger-uninstall-1",
        Some("flux-plunger-uninstall-1"),
    );
    r.has_history = true;
    assert!(matches!(
        decide_with_storage(&r, &stuck_storage(), &clock()),
        Decision::HoldFence { .. }
    ));
}

#[test]
fn someone_else_s_handled_request_is_not_taken_for_ours() {
    let r = requested(
        handled_by_helm_controller(terminating(fenced(release())), false),
        "2026-01-01T00:00:00Z",
        Some("2026-01-01T00:00:00Z"),
    );
    let decision = decide_with_storage(&r, &stuck_storage(), &clock());
    assert_eq!(hand_over_of(&decision).2, AfterHandOver::RequestReconcile);
}

#[test]
fn with_no_live_revision_left_the_fence_goes() {
    let r = handled_by_helm_controller(terminating(fenced(release())), false);
    for storage in [listed(&[]), listed(&[revision(3, "uninstalled")])] {
        assert_eq!(
            decide_with_storage(&r, &storage, &clock()),
            Decision::DropFence { event: None },
            "{storage:?}"
        );
    }
}

#[test]
fn a_release_nothing_can_uninstall_is_let_go_with_the_reason() {
    let r = handled_by_helm_controller(terminating(fenced(release())), false);
    let cases = [
        (
            StorageFacts::Unreadable {
                why: "the remote cluster is unreachable".into(),
                cause: Unreadable::RemoteClusterUnusable,
            },
            "its Helm storage cannot be read (the remote cluster is unreachable)",
        ),
        (
            StorageFacts::Listed {
                revisions: vec![revision(2, "uninstalling")],
                snapshot: Some(Err("not gzip".into())),
            },
            "revision 2 (apps/sh.helm.release.v1.web.v2) cannot be read: not gzip",
        ),
    ];
    for (storage, why) in cases {
        let decision = decide_with_storage(&r, &storage, &held_for(10 * MINUTE, None));
        let Decision::ReleaseWithoutUninstall { event } = &decision else {
            panic!("{decision:?}")
        };
        assert!(event.warning && event.note.contains(why), "{}", event.note);
    }
}

/// One refused read of the storage (a 401/403, a kubeconfig Secret rotated
/// away for a moment) is no proof that nothing can uninstall the release:
/// the fence holds, re-checked, until the delete has been held as long as
/// SPEC §5e allows before warning; only then is it let go.
#[test]
fn storage_that_cannot_be_read_holds_the_fence_until_the_warning_threshold() {
    let r = handled_by_helm_controller(terminating(fenced(release())), false);
    let unreadable = StorageFacts::Unreadable {
        why: "listing namespace apps: 403 Forbidden".into(),
        cause: Unreadable::AccessRefused,
    };
    for held in [Duration::ZERO, MINUTE, 10 * MINUTE - Duration::from_secs(1)] {
        assert!(
            matches!(
                decide_with_storage(&r, &unreadable, &held_for(held, None)),
                Decision::HoldFence { event: None, .. }
            ),
            "held {held:?}"
        );
    }
    assert!(matches!(
        decide_with_storage(&r, &unreadable, &held_for(10 * MINUTE, None)),
        Decision::ReleaseWithoutUninstall { .. }
    ));
}

#[test]
fn the_uninstall_targets_the_newest_revision_unless_it_is_uninstalled() {
    assert_eq!(uninstall_target(&[]), UninstallTarget::Nothing);
    let live = [revision(2, "failed"), revision(1, "superseded")];
    assert_eq!(uninstall_target(&live), UninstallTarget::Revision(&live[0]));
    let history = [revision(1, "superseded"), revision(2, "uninstalled")];
    assert_eq!(uninstall_target(&history), UninstallTarget::Nothing);
    let gone = [revision(1, "uninstalled"), revision(2, "uninstalled")];
    assert_eq!(uninstall_target(&gone), UninstallTarget::Nothing);
}

// --- storage (SPEC §4.6-4.7) ---

fn revision(n: u64, status: &str) -> StorageRevision {
    StorageRevision {
        namespace: "apps".into(),
        name: format!("sh.helm.release.v1.web.v{n}"),
        revision: n,
        status: status.into(),
        uid: format!("s-{n}"),
        resource_version: "1".into(),
    }
}

#[test]
fn no_storage_means_nothing_to_reclaim() {
    assert_eq!(
        plan_recovery(&stuck(release()), &[]),
        RecoveryPlan::Skip(SkipReason::NoRevisions)
    );
}

#[test]
fn the_highest_revision_is_reclaimed_whatever_the_listing_order() {
    let revisions = [
        revision(2, "superseded"),
        revision(5, "uninstalling"),
        revision(1, "superseded"),
    ];
    assert_eq!(
        plan_recovery(&stuck(release()), &revisions),
        RecoveryPlan::Reclaim(revision(5, "uninstalling"))
    );
}

#[test]
fn the_revision_just_below_the_one_we_reclaimed_is_left_alone() {
    let r = annotated(stuck(release()), "5");
    assert_eq!(
        plan_recovery(&r, &[revision(3, "unknown"), revision(4, "unknown")]),
        RecoveryPlan::Skip(SkipReason::AlreadyProcessed {
            latest: 4,
            processed: 5
        })
    );
}

#[test]
fn any_other_processed_value_lets_the_recovery_run() {
    for value in [
        "4",
        "5",
        "7",
        "0",
        "abc",
        "",
        "-5",
        "99999999999999999999999",
    ] {
        let r = annotated(stuck(release()), value);
        assert_eq!(
            plan_recovery(&r, &[revision(5, "unknown")]),
            RecoveryPlan::Reclaim(revision(5, "unknown")),
            "annotation {value:?}"
        );
    }
}

#[test]
fn the_processed_guard_does_not_overflow_at_the_largest_revision() {
    let r = annotated(stuck(release()), &u64::MAX.to_string());
    assert_eq!(
        plan_recovery(&r, &[revision(u64::MAX, "unknown")]),
        RecoveryPlan::Reclaim(revision(u64::MAX, "unknown"))
    );
}

#[test]
fn a_deployed_newest_revision_is_never_reclaimed() {
    assert_eq!(
        plan_recovery(
            &stuck(release()),
            &[revision(1, "superseded"), revision(2, "deployed")]
        ),
        RecoveryPlan::Skip(SkipReason::LatestIsDeployed { latest: 2 })
    );
}

// --- the stuck states Helm storage causes (SPEC §4.6, the table) ---

/// Stuck as helm-controller says it: `Ready=False` with `message`.
fn stuck_saying(message: &str) -> ReleaseView {
    let mut r = stuck(release());
    r.ready = Some(ReadyCondition {
        status: "False".into(),
        message: message.into(),
    });
    r
}

/// helm-controller's install over a newest `uninstalled` revision, refused
/// by Helm 3 (helm-controller up to v1.4) and Helm 4 (from v1.5).
fn refused_install() -> [ReleaseView; 2] {
    [
        stuck_saying(
            "Helm install failed for release apps/web with chart demo@1.0.0: cannot re-use a name that is still in use",
        ),
        stuck_saying(
            "Helm install failed for release apps/web with chart demo@1.0.0: cannot reuse a name that is still in use",
        ),
    ]
}

/// helm-controller's state machine over a revision its own history names.
fn undetermined(status: &str) -> ReleaseView {
    let mut r = stuck_saying(&format!(
        "Could not determine release state: unable to determine state for release with status '{status}'"
    ));
    r.has_history = true;
    r.status_latest_history_name = Some("web".into());
    r
}

#[test]
fn row_has_no_deployed_releases_over_a_newest_uninstalling_uninstalled_or_unknown_revision_reclaims_it()
 {
    for status in ["uninstalling", "uninstalled", "unknown"] {
        assert_eq!(
            plan_recovery(
                &stuck(release()),
                &[revision(1, "superseded"), revision(2, status)]
            ),
            RecoveryPlan::Reclaim(revision(2, status)),
            "{status}"
        );
    }
}

#[test]
fn row_an_install_refused_over_a_newest_uninstalled_revision_above_live_ones_reclaims_that_one() {
    for r in refused_install() {
        assert!(r.is_stuck(), "{:?}", r.ready);
        assert_eq!(asks(&r, &clock()), NEEDS_STORAGE);
        assert_eq!(
            plan_recovery(&r, &[revision(1, "superseded"), revision(2, "uninstalled")]),
            RecoveryPlan::Reclaim(revision(2, "uninstalled"))
        );
    }
}

#[test]
fn row_an_install_refused_over_uninstalled_revisions_only_reclaims_each_in_turn() {
    for r in refused_install() {
        let kept = [revision(1, "uninstalled"), revision(2, "uninstalled")];
        assert_eq!(
            plan_recovery(&r, &kept),
            RecoveryPlan::Reclaim(revision(2, "uninstalled"))
        );
        // Revision 2 reclaimed: the processed guard would keep revision 1 for
        // an upgrade, but nothing is installed and Helm installs only once
        // every record is gone.
        let mut after = annotated(r, "2");
        after
            .annotations
            .insert(PROCESSED_BELOW_UID_ANNOTATION.into(), "s-1".into());
        assert_eq!(
            plan_recovery(&after, &kept[..1]),
            RecoveryPlan::Reclaim(revision(1, "uninstalled"))
        );
    }
}

#[test]
fn row_the_processed_guard_still_keeps_a_live_revision_below_a_reclaimed_uninstalled_one() {
    let [r, _] = refused_install();
    let mut after = annotated(r, "3");
    after
        .annotations
        .insert(PROCESSED_BELOW_UID_ANNOTATION.into(), "s-2".into());
    assert_eq!(
        plan_recovery(
            &after,
            &[revision(1, "uninstalled"), revision(2, "superseded")]
        ),
        RecoveryPlan::Skip(SkipReason::AlreadyProcessed {
            latest: 2,
            processed: 3
        })
    );
}

#[test]
fn row_a_state_helm_controller_cannot_determine_over_uninstalling_or_unknown_reclaims_that_revision()
 {
    for status in ["uninstalling", "unknown"] {
        let r = undetermined(status);
        assert!(r.is_stuck(), "{status}");
        assert_eq!(asks(&r, &clock()), NEEDS_STORAGE, "{status}");
        assert_eq!(
            plan_recovery(&r, &[revision(1, status)]),
            RecoveryPlan::Reclaim(revision(1, status)),
            "{status}"
        );
        assert_eq!(
            plan_recovery(&r, &[revision(1, "deployed"), revision(2, status)]),
            RecoveryPlan::Reclaim(revision(2, status)),
            "{status}"
        );
    }
}

#[test]
fn row_a_pending_newest_revision_is_helm_controllers_to_unlock_whatever_the_message() {
    let messages = refused_install()
        .into_iter()
        .chain([undetermined("uninstalling"), stuck(release())]);
    for r in messages {
        for status in ["pending-install", "pending-upgrade", "pending-rollback"] {
            assert_eq!(
                plan_recovery(&r, &[revision(1, "deployed"), revision(2, status)]),
                RecoveryPlan::Skip(SkipReason::StatusDoesNotExplain {
                    latest: 2,
                    status: status.into()
                }),
                "{status} {:?}",
                r.ready
            );
        }
    }
}

#[test]
fn row_a_message_the_storage_does_not_bear_out_reclaims_nothing() {
    let [refused, _] = refused_install();
    assert_eq!(
        plan_recovery(
            &refused,
            &[revision(1, "superseded"), revision(2, "failed")]
        ),
        RecoveryPlan::Skip(SkipReason::StatusDoesNotExplain {
            latest: 2,
            status: "failed".into()
        })
    );
    assert_eq!(
        plan_recovery(&undetermined("uninstalling"), &[revision(1, "deployed")]),
        RecoveryPlan::Skip(SkipReason::LatestIsDeployed { latest: 1 })
    );
}

#[test]
fn row_other_failures_and_states_helm_controller_can_determine_are_not_stuck() {
    for message in [
        "Helm install failed for release apps/web with chart demo@1.0.0: timed out waiting for the condition",
        "Could not determine release state: unable to determine state for release with status 'failed'",
        "Helm upgrade failed: another operation (install/upgrade/rollback) is in progress",
    ] {
        let r = stuck_saying(message);
        assert!(!r.is_stuck(), "{message}");
        assert_eq!(
            decide(&r, &clock()),
            Decision::Nothing { event: None },
            "{message}"
        );
    }
}

// --- the predicates ---

#[test]
fn the_suspension_may_be_taken_only_from_a_live_unsuspended_release() {
    assert_eq!(may_take_suspension(&stuck(release())), MayAcquire::Take);
    assert_eq!(
        may_take_suspension(&terminating(stuck(release()))),
        MayAcquire::NotOurs
    );
    assert_eq!(
        may_take_suspension(&suspended_by(stuck(release()), "backup", "Update")),
        MayAcquire::NotOurs
    );
}

#[test]
fn the_watch_filter_lets_through_exactly_the_releases_we_may_act_on() {
    assert!(!is_of_interest(&release()));
    assert!(is_of_interest(&stuck(release())));
    assert!(is_of_interest(&ours(release())));
    assert!(is_of_interest(&fenced(release())));
    assert!(is_of_interest(&terminating(suspended_by(
        release(),
        "m",
        "Apply"
    ))));
    assert!(!is_of_interest(&suspended_by(release(), "m", "Apply")));
    assert!(!is_of_interest(&terminating(release())));
}

#[test]
fn a_stuck_release_opted_out_by_its_annotation_is_not_recovered() {
    let mut r = stuck(release());
    r.annotations
        .insert(crate::names::RECOVER_ANNOTATION.into(), "disabled".into());
    assert_eq!(decide(&r, &clock()), Decision::Nothing { event: None });
    r.annotations
        .insert(crate::names::RECOVER_ANNOTATION.into(), "enabled".into());
    assert_eq!(asks(&r, &clock()), NEEDS_STORAGE);
}

#[test]
fn an_opted_out_release_still_loses_our_suspension_and_fence() {
    let mut r = stuck(fenced(ours(release())));
    r.annotations
        .insert(crate::names::RECOVER_ANNOTATION.into(), "disabled".into());
    assert_eq!(decide(&r, &clock()), Decision::Lift { keep_fence: false });
}

#[test]
fn the_revision_below_is_left_alone_only_while_it_is_the_same_secret() {
    let mut r = annotated(stuck(release()), "5");
    r.annotations.insert(
        crate::names::PROCESSED_BELOW_UID_ANNOTATION.into(),
        "s-4".into(),
    );
    assert!(matches!(
        plan_recovery(&r, &[revision(4, "unknown")]),
        RecoveryPlan::Skip(SkipReason::AlreadyProcessed { .. })
    ));
    let mut recreated = revision(4, "unknown");
    recreated.uid = "new-uid".into();
    assert_eq!(
        plan_recovery(&r, std::slice::from_ref(&recreated)),
        RecoveryPlan::Reclaim(recreated.clone()),
        "the same number under another uid is a revision Helm made later"
    );
    // Nothing was below the reclaimed revision: any revision 4 now is new.
    r.annotations.insert(
        crate::names::PROCESSED_BELOW_UID_ANNOTATION.into(),
        String::new(),
    );
    assert!(matches!(
        plan_recovery(&r, &[revision(4, "unknown")]),
        RecoveryPlan::Reclaim(_)
    ));
}

#[test]
fn the_revision_below_the_target_is_the_highest_lower_one() {
    let revisions = [
        revision(1, "superseded"),
        revision(5, "unknown"),
        revision(3, "superseded"),
    ];
    assert_eq!(
        revision_below(&revisions, &revisions[1]),
        Some(&revisions[2])
    );
    assert_eq!(revision_below(&revisions, &revisions[0]), None);
}

#[test]
fn a_release_is_still_acquired_only_if_same_live_ours_and_fenced() {
    let held = fenced(ours(stuck(release())));
    assert!(still_acquired(&held, "uid-1"));
    assert!(!still_acquired(&held, "another-uid"), "re-created");
    assert!(
        !still_acquired(&terminating(held.clone()), "uid-1"),
        "being deleted"
    );
    assert!(
        !still_acquired(&ours(stuck(release())), "uid-1"),
        "fence gone"
    );
    assert!(
        !still_acquired(&fenced(stuck(release())), "uid-1"),
        "suspension gone"
    );
    assert!(
        !still_acquired(
            &fenced(suspended_by(stuck(release()), "operator", "Apply")),
            "uid-1"
        ),
        "someone else's"
    );
}

#[test]
fn only_a_newest_revision_the_real_helm_controller_leaves_stuck_is_reclaimed() {
    for status in ["uninstalling", "uninstalled", "unknown"] {
        assert_eq!(
            plan_recovery(&stuck(release()), &[revision(3, status)]),
            RecoveryPlan::Reclaim(revision(3, status)),
            "{status}"
        );
    }
    // helm-controller upgrades these itself (a pending one after marking it
    // failed); a pending-upgrade one may be an upgrade in flight.
    for status in [
        "failed",
        "superseded",
        "pending-install",
        "pending-upgrade",
        "pending-rollback",
        "",
        "something-else",
    ] {
        assert_eq!(
            plan_recovery(&stuck(release()), &[revision(3, status)]),
            RecoveryPlan::Skip(SkipReason::StatusDoesNotExplain {
                latest: 3,
                status: status.into()
            }),
            "{status:?}"
        );
    }
}

#[test]
fn the_acquire_s_fresh_read_must_still_be_stuck() {
    assert_eq!(may_take_suspension(&stuck(release())), MayAcquire::Take);
    assert_eq!(
        may_take_suspension(&release()),
        MayAcquire::NoLongerStuck,
        "helm-controller got past it, or started an upgrade"
    );
    let mut opted_out = stuck(release());
    opted_out.annotations.insert(
        crate::names::RECOVER_ANNOTATION.into(),
        crate::names::RECOVER_DISABLED.into(),
    );
    assert_eq!(may_take_suspension(&opted_out), MayAcquire::NoLongerStuck);
}

#[test]
fn a_fence_still_listed_after_our_give_up_is_removed_at_every_index() {
    let mut written = release();
    written.finalizers = vec![
        FENCE_FINALIZER.into(),
        "finalizers.fluxcd.io".into(),
        FENCE_FINALIZER.into(),
    ];
    assert_eq!(
        fence_left_after_give_up(&written),
        GuardedPatch {
            lift_suspension: false,
            fence_indices: vec![0, 2],
            remove_label: false,
        }
    );
    written.fence_label = Some(LEGACY_FENCE_LABEL_VALUE.to_owned());
    assert!(
        fence_left_after_give_up(&written).remove_label,
        "the label goes with the last copy"
    );
    assert!(fence_left_after_give_up(&release()).is_empty());
}

#[test]
fn only_a_verdict_on_the_listed_storage_is_found_in_the_storage() {
    for listed in [
        SkipReason::NoRevisions,
        SkipReason::AlreadyProcessed {
            latest: 1,
            processed: 2,
        },
        SkipReason::LatestIsDeployed { latest: 1 },
        SkipReason::StatusDoesNotExplain {
            latest: 1,
            status: "failed".into(),
        },
    ] {
        assert!(listed.found_in_the_storage(), "{listed:?}");
    }
    for unread in [
        SkipReason::RemoteClusterUnusable { why: "x".into() },
        SkipReason::StorageOutOfReach { why: "x".into() },
        SkipReason::NoLongerStuck,
    ] {
        assert!(!unread.found_in_the_storage(), "{unread:?}");
    }
}

#[test]
fn a_guarded_patch_is_empty_only_when_it_neither_lifts_nor_removes_a_fence() {
    assert!(GuardedPatch::default().is_empty());
    let lift = GuardedPatch {
        lift_suspension: true,
        ..GuardedPatch::default()
    };
    assert!(!lift.is_empty(), "a lift alone is something to write");
    let drop_fence = GuardedPatch {
        fence_indices: vec![1],
        ..GuardedPatch::default()
    };
    assert!(
        !drop_fence.is_empty(),
        "a fence alone is something to write"
    );
    let label_only = GuardedPatch {
        remove_label: true,
        ..GuardedPatch::default()
    };
    assert!(
        label_only.is_empty(),
        "the label only ever goes with the fence's last copy"
    );
}

#[test]
fn letting_go_without_an_apply_lifts_only_a_suspension_we_alone_hold() {
    let mut twice = fenced(ours(release()));
    twice.finalizers.push(FENCE_FINALIZER.into());
    assert_eq!(
        let_go_without_apply(&twice, true),
        GuardedPatch {
            lift_suspension: true,
            fence_indices: vec![],
            remove_label: false,
        },
        "every copy of the fence stays"
    );
    let both = twice.fence_indices();
    assert_eq!(both.len(), 2);
    assert_eq!(
        let_go_without_apply(&twice, false),
        GuardedPatch {
            lift_suspension: true,
            fence_indices: both.clone(),
            remove_label: true,
        }
    );
    let mut shared = twice.clone();
    shared
        .managed_fields
        .push(entry("migration", "Apply", true));
    assert!(
        let_go_without_apply(&shared, true).is_empty(),
        "a co-owner's suspension is never removed"
    );
    assert_eq!(let_go_without_apply(&shared, false).fence_indices, both);
}

#[test]
fn a_recovery_says_what_is_true_of_the_release_after_its_final_lift() {
    let target = revision(2, "uninstalling");
    let note = |after| crate::notices::recovered(&release(), &target, after).note;
    assert_eq!(after_recovery(Some(&release())), AfterRecovery::Free);
    assert!(note(AfterRecovery::Free).ends_with("helm-controller can upgrade again"));
    let co_owned = suspended_by(release(), "migration", "Apply");
    assert_eq!(
        after_recovery(Some(&co_owned)),
        AfterRecovery::SuspendedByOther
    );
    assert!(note(AfterRecovery::SuspendedByOther).contains("stays suspended by another manager"));
    assert_eq!(
        after_recovery(Some(&fenced(terminating(release())))),
        AfterRecovery::BeingDeleted { fenced: true }
    );
    assert!(
        note(AfterRecovery::BeingDeleted { fenced: true }).contains("the uninstall fence holds it")
    );
    assert_eq!(
        after_recovery(Some(&terminating(release()))),
        AfterRecovery::BeingDeleted { fenced: false }
    );
    assert_eq!(
        after_recovery(None),
        AfterRecovery::BeingDeleted { fenced: false }
    );
    for after in [
        AfterRecovery::Free,
        AfterRecovery::SuspendedByOther,
        AfterRecovery::BeingDeleted { fenced: true },
        AfterRecovery::BeingDeleted { fenced: false },
    ] {
        let event = crate::notices::recovered(&release(), &target, after);
        assert_eq!((event.reason, event.warning), ("Recovered", false));
        assert!(event.note.starts_with("reclaimed Helm storage revision 2"));
    }
}

/// A fence flux-plunger did not set (a tenant's client-side create carrying
/// the finalizer, or an apply under another manager's name) drives nothing
/// of SPEC §5: the deleted release is neither held, nor handed over, nor
/// asked to reconcile; the copy is only removed.
#[test]
fn a_deleted_release_whose_fence_is_not_ours_is_only_let_go_of_the_fence() {
    let clock = clock();
    for (manager, operation) in [
        ("kubectl-create", "Update"),
        ("tenant", "Apply"),
        ("flux-plunger", "Update"),
    ] {
        let self_fenced = terminating(fenced_by(stuck(release()), manager, operation));
        assert!(!self_fenced.fence_owned_by_us(), "{manager} {operation}");
        assert_eq!(
            decide(&self_fenced, &clock),
            Decision::DropFence { event: None },
            "{manager} {operation}: held by its word"
        );
        let mut handled = self_fenced.clone();
        handled
            .finalizers
            .retain(|f| f != HELM_CONTROLLER_FINALIZER);
        assert_eq!(
            decide(&handled, &clock),
            Decision::DropFence { event: None },
            "{manager} {operation}: no storage read, no hand-over"
        );
    }
}

/// Our suspension on a deleted release whose fence another manager listed
/// a second time (which moves the ownership of both copies to it): the
/// suspension and the fence were applied together, so the fence is still
/// ours and the release is handed over as any other.
#[test]
fn under_our_suspension_a_fence_listed_again_by_another_manager_is_still_ours() {
    let release = terminating(fenced_by(ours(stuck(release())), "kubectl-patch", "Update"));
    assert!(release.fence_owned_by_us());
    assert_eq!(asks(&release, &clock()), NEEDS_STORAGE);
}

#[test]
fn storage_steps_that_fail_for_as_long_as_a_delete_is_held_before_the_warning_are_given_up() {
    let failing = |failing: Option<Duration>| Context {
        storage_failure: failing.map(|failing_for| StorageFailing {
            failing_for,
            last_error: "500".into(),
        }),
        ..clock()
    };
    assert!(!storage_given_up(&failing(None)), "not failing");
    assert!(
        !storage_given_up(&failing(Some(10 * MINUTE - Duration::from_secs(1)))),
        "retried until the bound"
    );
    assert!(storage_given_up(&failing(Some(10 * MINUTE))));
}

fn dry_run() -> Context {
    Context {
        dry_run: true,
        ..clock()
    }
}

fn rate_limited() -> Context {
    Context {
        rate_limited: true,
        ..clock()
    }
}

fn knowing(storage: StorageFacts, recovery_turn: Option<Result<(), Duration>>) -> Known {
    Known {
        storage: Some(storage),
        recovery_turn,
    }
}

fn unreadable(cause: Unreadable) -> StorageFacts {
    StorageFacts::Unreadable {
        why: "the reason".into(),
        cause,
    }
}

#[test]
fn a_stuck_release_whose_storage_explains_it_starts_its_recovery_on_the_newest_revision() {
    assert_eq!(
        decide_with_storage(&stuck(release()), &stuck_storage(), &clock()),
        Decision::Recover(Recovery::Start {
            target: revision(2, "uninstalling"),
            below_uid: Some("s-1".into()),
        })
    );
}

#[test]
fn a_settle_never_starts_a_recovery() {
    let settling = Context {
        may_recover: false,
        ..clock()
    };
    for r in [stuck(release()), stuck(fenced(release()))] {
        assert_eq!(
            super::decide(&r, &knowing(stuck_storage(), Some(Ok(()))), &settling),
            Answer::Decided(Decision::Nothing { event: None })
        );
    }
}

#[test]
fn under_the_rate_limit_a_recovery_asks_for_its_turn_only_once_it_has_a_revision_to_reclaim() {
    let r = stuck(release());
    assert_eq!(asks(&r, &rate_limited()), NEEDS_STORAGE);
    assert_eq!(
        super::decide(&r, &knowing(stuck_storage(), None), &rate_limited()),
        Answer::Needs(Need::RecoveryTurn)
    );
    assert_eq!(
        super::decide(&r, &knowing(listed(&[]), None), &rate_limited()),
        Answer::Decided(Decision::Skip {
            reason: SkipReason::NoRevisions,
            event: None,
            drop_fence: false,
        }),
        "nothing to reclaim spends no turn"
    );
    assert!(matches!(
        super::decide(&r, &knowing(stuck_storage(), Some(Ok(()))), &rate_limited()),
        Answer::Decided(Decision::Recover(Recovery::Start { .. }))
    ));
    assert_eq!(
        super::decide(&r, &knowing(stuck_storage(), None), &clock()),
        super::decide(&r, &knowing(stuck_storage(), Some(Ok(()))), &clock()),
        "without a limit no turn is asked for"
    );
}

#[test]
fn a_recovery_turned_away_by_the_rate_limit_waits_fenced() {
    let turned_away = Some(Err(Duration::from_secs(20)));
    let waits =
        |r: ReleaseView| super::decide(&r, &knowing(stuck_storage(), turned_away), &rate_limited());
    assert_eq!(
        waits(stuck(release())),
        Answer::Decided(Decision::Recover(Recovery::WaitForTurn {
            retry_after: Duration::from_secs(20),
            fence: true,
        }))
    );
    assert_eq!(
        waits(stuck(fenced(release()))),
        Answer::Decided(Decision::Recover(Recovery::WaitForTurn {
            retry_after: Duration::from_secs(20),
            fence: false,
        })),
        "fenced already"
    );
}

#[test]
fn a_stuck_release_with_nothing_to_reclaim_is_skipped_and_drops_the_fence_it_waited_with() {
    let skipped = |r: ReleaseView, context: &Context| {
        decide_with_storage(&r, &listed(&[revision(1, "deployed")]), context)
    };
    let skip = |drop_fence| Decision::Skip {
        reason: SkipReason::LatestIsDeployed { latest: 1 },
        event: None,
        drop_fence,
    };
    assert_eq!(skipped(stuck(release()), &clock()), skip(false));
    assert_eq!(skipped(stuck(fenced(release())), &clock()), skip(true));
    assert_eq!(
        skipped(stuck(fenced(release())), &dry_run()),
        skip(false),
        "a dry run writes nothing"
    );
}

#[test]
fn the_storage_of_a_stuck_release_that_cannot_be_read_is_retried_or_skipped_by_its_cause() {
    let r = stuck(fenced(release()));
    let by = |cause| decide_with_storage(&r, &unreadable(cause), &clock());
    let Decision::Recover(Recovery::Retry { event: Some(event) }) =
        by(Unreadable::KubeconfigMissing)
    else {
        panic!("{:?}", by(Unreadable::KubeconfigMissing))
    };
    assert!(event.warning && event.note.contains("(the reason); flux-plunger retries"));
    assert_eq!(
        by(Unreadable::AccessRefused),
        Decision::Recover(Recovery::Retry { event: None })
    );
    for (cause, reason) in [
        (
            Unreadable::RemoteClusterUnusable,
            SkipReason::RemoteClusterUnusable {
                why: "the reason".into(),
            },
        ),
        (
            Unreadable::OutOfReach,
            SkipReason::StorageOutOfReach {
                why: "the reason".into(),
            },
        ),
    ] {
        let decision = by(cause);
        let Decision::Skip {
            reason: skipped,
            event: Some(event),
            drop_fence: true,
        } = &decision
        else {
            panic!("{decision:?}")
        };
        assert_eq!(skipped, &reason);
        assert!(
            event.warning && event.note.contains("the reason"),
            "{}",
            event.note
        );
    }
}

#[test]
fn a_dry_run_reports_the_recovery_it_would_run_without_asking_for_a_turn() {
    let r = stuck(release());
    let dry_and_limited = Context {
        rate_limited: true,
        ..dry_run()
    };
    let answer = super::decide(&r, &knowing(stuck_storage(), None), &dry_and_limited);
    let Answer::Decided(Decision::DryRun {
        would,
        event: Some(event),
    }) = &answer
    else {
        panic!("{answer:?}")
    };
    assert!(
        would.contains("annotate revision 2")
            && would.contains("delete Helm storage Secret apps/sh.helm.release.v1.web.v2"),
        "{would}"
    );
    assert!(
        !event.warning && event.note.contains(would.as_str()),
        "{}",
        event.note
    );
}

#[test]
fn a_dry_run_reports_every_write_and_still_holds_a_fence() {
    let lift = decide(&ours(release()), &dry_run());
    assert_eq!(
        lift,
        Decision::DryRun {
            would: "lift flux-plunger's suspension and the fence".into(),
            event: None,
        }
    );
    let not_ours = suspended_by(fenced(release()), "kubectl-edit", "Update");
    let Decision::DropFence { event: dropped } = decide(&not_ours, &clock()) else {
        panic!("not a drop")
    };
    assert_eq!(
        decide(&not_ours, &dry_run()),
        Decision::DryRun {
            would: "remove the uninstall fence".into(),
            event: dropped,
        },
        "the drop's event says what was found, so a dry run records it too"
    );
    let held = terminating(fenced(release()));
    let unlabelled = fence_labelled_as(FenceHolder::Unlabelled);
    assert!(matches!(
        decide(&held, &unlabelled),
        Decision::HoldFence {
            label_fence: true,
            ..
        }
    ));
    assert!(matches!(
        decide(
            &held,
            &Context {
                dry_run: true,
                ..unlabelled
            }
        ),
        Decision::HoldFence {
            label_fence: false,
            ..
        }
    ));
}

#[test]
fn a_delete_whose_storage_read_was_given_up_is_decided_without_reading_it() {
    let r = handled_by_helm_controller(terminating(fenced(release())), false);
    let failing_for = |failing_for| Context {
        storage_failure: Some(StorageFailing {
            failing_for,
            last_error: "500 Internal Server Error".into(),
        }),
        ..held_for(10 * MINUTE, None)
    };
    assert_eq!(asks(&r, &failing_for(MINUTE)), NEEDS_STORAGE);
    let Decision::ReleaseWithoutUninstall { event } = decide(&r, &failing_for(10 * MINUTE)) else {
        panic!("not let go")
    };
    assert!(
        event.note.contains(
            "reading its storage failed on every try for 600s: 500 Internal Server Error"
        ),
        "{}",
        event.note
    );
}
