//! SPEC §5: a release being deleted. The fence holds it until
//! helm-controller has uninstalled it; an emptied history gets the newest
//! live revision, a finished pass a reconcile request; what nothing can
//! uninstall is let go, saying what is left.

use super::storage::{StorageFacts, UninstallTarget, is_live, uninstall_target};
use super::{AfterHandOver, Context, Decision, FenceHolder};
use crate::notices;
use crate::release::view::ReleaseView;
use crate::storage::view::StorageRevision;

/// SPEC §5a-§5e: the decision for a release being deleted; `None` while it
/// depends on the storage, not known yet.
pub(super) fn decide_terminating(
    release: &ReleaseView,
    storage: Option<&StorageFacts>,
    context: &Context,
) -> Option<Decision> {
    if release.suspend {
        return if release.suspend_owned_by_us() {
            lift_for_the_uninstall(release, storage)
        } else {
            Some(suspended_by_another(release))
        };
    }
    if !release.has_fence() {
        return Some(Decision::Nothing { event: None });
    }
    if !release.fence_owned_by_us() {
        // Somebody else's copy of the fence: holding, handing over, asking
        // for a reconcile or reclaiming on its word would let whoever can
        // create a release drive flux-plunger's reads and deletes. It is
        // only removed.
        return Some(Decision::DropFence { event: None });
    }
    if !release.delete_handled_by_helm_controller() || release.reconcile_request_pending() {
        return Some(hold(release, context));
    }
    if release.reported_uninstall_succeeded() {
        return Some(Decision::DropFence { event: None });
    }
    Some(after_a_pass_without_uninstall(release, storage?, context))
}

/// SPEC §5a: our suspension on a release being deleted. helm-controller
/// must see an unsuspended generation to uninstall; the fence keeps the
/// release until it has. A finalizer cannot be added to an object being
/// deleted, so "keep" means keep the fence only where it already is.
fn lift_for_the_uninstall(
    release: &ReleaseView,
    storage: Option<&StorageFacts>,
) -> Option<Decision> {
    let keep_fence = release.has_fence();
    if release.has_history {
        return Some(Decision::Lift { keep_fence });
    }
    // Its history was cleared (the stuck state): hand it the newest live
    // revision before the lift, or its deletion path uninstalls nothing.
    // Whatever stands in the way, the suspension is lifted: ours must
    // never be what skips the uninstall, and §5d then says what is left.
    Some(
        hand_over(release, storage?, AfterHandOver::Lift { keep_fence })
            .unwrap_or(Decision::Lift { keep_fence }),
    )
}

/// Another manager suspended, then deleted: its decision to skip the
/// uninstall (migrations do this on purpose). Unless we recovered this
/// release before: then the suspension is most likely one an older
/// flux-plunger left behind, and the skipped uninstall an accident.
fn suspended_by_another(release: &ReleaseView) -> Decision {
    let event = notices::terminating_while_suspended(release);
    if release.has_fence() {
        Decision::DropFence { event: Some(event) }
    } else {
        Decision::Nothing { event: Some(event) }
    }
}

/// SPEC §5b-§5d: helm-controller finished with the delete without reporting
/// an uninstall. Its pass over a cleared history (`ErrNoLatest`) looks just
/// like this: whether anything is left to uninstall, only the storage says.
fn after_a_pass_without_uninstall(
    release: &ReleaseView,
    storage: &StorageFacts,
    context: &Context,
) -> Decision {
    let revisions = match storage {
        StorageFacts::Unreadable { why, .. } => {
            // A refused read, or a kubeconfig Secret missing for a moment
            // (credentials rotated, a short-lived token), may pass, and
            // helm-controller, with the same kubeconfig, retries: the fence
            // holds for as long as a delete is held before anyone is warned.
            if !held_until_warned(context) {
                return hold(release, context);
            }
            return let_go(
                release,
                &format!("its Helm storage cannot be read ({why})"),
                "whatever it installed",
            );
        }
        StorageFacts::Listed { revisions, .. } => revisions,
    };
    if uninstall_target(revisions) == UninstallTarget::Nothing {
        return Decision::DropFence { event: None };
    }
    let live: Vec<&StorageRevision> = revisions.iter().filter(|r| is_live(r)).collect();
    if release.our_reconcile_request_handled() {
        // helm-controller handled the history flux-plunger handed it. Kept,
        // it is retrying a failed uninstall; cleared, it let the release go
        // without one, and nothing else will uninstall it.
        return if release.has_history {
            hold(release, context)
        } else {
            let_go(
                release,
                "helm-controller cleared the history flux-plunger handed it without uninstalling",
                &describe_revisions(&live),
            )
        };
    }
    if release.has_history {
        return Decision::RequestReconcile;
    }
    hand_over(release, storage, AfterHandOver::RequestReconcile).unwrap_or_else(|why| {
        let_go(
            release,
            &format!("no history can be handed to helm-controller ({why})"),
            &describe_revisions(&live),
        )
    })
}

/// The history hand-over for a release being deleted, or why there is none.
fn hand_over(
    release: &ReleaseView,
    storage: &StorageFacts,
    then: AfterHandOver,
) -> Result<Decision, String> {
    let (revisions, snapshot) = match storage {
        StorageFacts::Listed {
            revisions,
            snapshot,
        } => (revisions, snapshot),
        StorageFacts::Unreadable { why, .. } => {
            return Err(format!("its Helm storage cannot be read: {why}"));
        }
    };
    let UninstallTarget::Revision(target) = uninstall_target(revisions) else {
        return Err(
            "nothing is installed: no revision is stored, or the newest is uninstalled".to_owned(),
        );
    };
    let snapshot = match snapshot {
        Some(Ok(snapshot)) => snapshot.clone(),
        Some(Err(why)) => {
            return Err(format!(
                "revision {} ({}/{}) cannot be read: {why}",
                target.revision, target.namespace, target.name
            ));
        }
        None => return Err(format!("revision {} was not read", target.revision)),
    };
    // The payload is whatever its Secret's writer put there: helm-
    // controller's uninstall acts on the namespace it names, and the
    // admission guard refuses any but the release's own.
    if snapshot.namespace != release.target_namespace() {
        return Err(format!(
            "revision {} says it is installed in namespace {}, not in {}",
            target.revision,
            snapshot.namespace,
            release.target_namespace()
        ));
    }
    let event = notices::uninstall_handed_over(release, &snapshot, target);
    Ok(Decision::HandOver {
        snapshot,
        storage_namespace: release
            .status_storage_namespace
            .is_none()
            .then(|| target.namespace.clone()),
        then,
        event,
    })
}

/// Drops the fence though the release was not uninstalled, saying why and
/// what is left.
fn let_go(release: &ReleaseView, why: &str, left: &str) -> Decision {
    Decision::ReleaseWithoutUninstall {
        event: notices::released_without_uninstall(release, why, left),
    }
}

fn describe_revisions(revisions: &[&StorageRevision]) -> String {
    let names: Vec<String> = revisions
        .iter()
        .map(|r| format!("{}/{} (status {})", r.namespace, r.name, r.status))
        .collect();
    format!(
        "Helm storage {} and the objects they installed",
        names.join(", ")
    )
}

/// The delete has been held as long as SPEC §5e lets it be before warning.
fn held_until_warned(context: &Context) -> bool {
    context
        .terminating_for
        .is_some_and(|held| held >= context.fence_held_warning_after)
}

/// Keeps the fence and looks again later, warning once the delete has been
/// held long (SPEC §5e).
fn hold(release: &ReleaseView, context: &Context) -> Decision {
    let held_long = held_until_warned(context);
    let warned_recently = context
        .since_last_fence_warning
        .is_some_and(|since| since < context.fence_recheck_interval);
    let event = (held_long && !warned_recently).then(|| {
        notices::uninstall_fence_held(release, context.terminating_for.unwrap_or_default())
    });
    Decision::HoldFence {
        recheck: context.fence_recheck_interval,
        event,
        label_fence: context.fence_holder != FenceHolder::ThisInstall,
    }
}
