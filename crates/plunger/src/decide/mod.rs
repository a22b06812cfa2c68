//! What to do next, as pure functions of what was read (SPEC §4-§5).
//!
//! Nothing here talks to the apiserver; `reconcile` reads, asks, and carries
//! the answer out. This module answers for one release; `recovery` decides
//! a stuck one's recovery (SPEC §4), `deleted` a release being deleted
//! (SPEC §5), `storage` what its Helm storage holds, `dry_run` what
//! `--dry-run` reports instead, `let_go` the guarded patch. Every branch is
//! a unit test in `tests.rs`.

mod deleted;
mod dry_run;
mod let_go;
mod recovery;
mod storage;

use std::time::Duration;

use crate::history::HistorySnapshot;
pub(crate) use crate::install::FenceHolder;
use crate::notices::{self, EventSpec};
use crate::release::view::ReleaseView;
use crate::storage::view::StorageRevision;
use deleted::decide_terminating;
use dry_run::as_dry_run;
pub(crate) use let_go::{GuardedPatch, fence_left_after_give_up, let_go_without_apply};
use recovery::decide_recovery;
pub(crate) use recovery::{MayAcquire, after_recovery, may_take_suspension, still_acquired};
pub use recovery::{SkipReason, status_explains_stuck};
use storage::known_storage;
pub(crate) use storage::{
    StorageFacts, StorageFailing, UninstallTarget, Unreadable, uninstall_target,
};

/// What [`decide`] answers: the decision, or what it must know first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Answer {
    Decided(Decision),
    /// Read this, put it in [`Known`], and ask again.
    Needs(Need),
}

/// What a decision may depend on that costs a request or a turn: asked for
/// only when the decision does depend on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Need {
    /// The release's Helm storage, as [`StorageFacts`].
    Storage,
    /// A turn of the recovery rate limit (`--max-recoveries-per-minute`),
    /// taken when the recovery is to start: asked last, so that a release
    /// with nothing to reclaim spends none.
    RecoveryTurn,
}

/// What the caller has read or taken for [`decide`], on its asking.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Known {
    pub storage: Option<StorageFacts>,
    /// `Err`: how long until the release's turn.
    pub recovery_turn: Option<Result<(), Duration>>,
}

/// The next step for a release, decided from one fresh read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Decision {
    /// Nothing to write.
    Nothing { event: Option<EventSpec> },
    /// Give up our suspension; keep the fence only when a delete is pending,
    /// so that the delete waits for helm-controller's uninstall (SPEC §5a).
    Lift { keep_fence: bool },
    /// Give up the fence alone; someone else's suspension is left as it is.
    DropFence { event: Option<EventSpec> },
    /// A delete waits for helm-controller's uninstall: keep the fence and look
    /// again after `recheck`, whether or not helm-controller writes. With
    /// `label_fence`, the fence lacks its label (an older flux-plunger set
    /// it): add the label, so that the drain and the hook select it.
    HoldFence {
        recheck: Duration,
        event: Option<EventSpec>,
        label_fence: bool,
    },
    /// A stuck release's recovery: start it, wait for its turn, or retry
    /// it. Only a pass that may start recoveries gets this
    /// ([`Context::may_recover`]).
    Recover(Recovery),
    /// Stuck, but the storage holds nothing to reclaim (or cannot be
    /// reached for good): say so, and drop the fence the release carried
    /// while it waited when `drop_fence` (SPEC §4.5).
    Skip {
        reason: SkipReason,
        event: Option<EventSpec>,
        drop_fence: bool,
    },
    /// helm-controller's history is empty, so its deletion path would
    /// uninstall nothing: write `snapshot` (the newest live revision) to
    /// `status.history`, with `storage_namespace` when the status lost it,
    /// then do `then` (SPEC §5a, §5d).
    HandOver {
        snapshot: Box<HistorySnapshot>,
        storage_namespace: Option<String>,
        then: AfterHandOver,
        event: EventSpec,
    },
    /// helm-controller finished with the delete while its history (restored)
    /// names a release to uninstall: ask it to reconcile again.
    RequestReconcile,
    /// Nothing can uninstall the release any more: drop the fence, and say
    /// what is left behind.
    ReleaseWithoutUninstall { event: EventSpec },
    /// `--dry-run`: report what the decision would have written, and
    /// record `event`; write nothing.
    DryRun {
        would: String,
        event: Option<EventSpec>,
    },
}

/// What a stuck release's recovery does next (SPEC §4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Recovery {
    /// Reclaim `target`, recording the uid of the revision below it.
    Start {
        target: StorageRevision,
        below_uid: Option<String>,
    },
    /// The rate limit gives the release its turn after `retry_after`; fence
    /// it meanwhile when `fence` (SPEC §4.5).
    WaitForTurn { retry_after: Duration, fence: bool },
    /// The storage may be readable later (a refused listing, a kubeconfig
    /// Secret not created yet): fail the pass, so it is retried with
    /// backoff, recording `event`.
    Retry { event: Option<EventSpec> },
}

/// What follows the history write of [`Decision::HandOver`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AfterHandOver {
    /// Lift our suspension: helm-controller's unsuspended deletion path then
    /// runs with the history.
    Lift { keep_fence: bool },
    /// helm-controller already passed (its `ErrNoLatest` pass): ask it to
    /// reconcile again.
    RequestReconcile,
}

/// What `decide` knows besides the release and what it asked for: the
/// clock, and how this process runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Context {
    /// How long the release has been terminating (since its deletionTimestamp).
    pub(crate) terminating_for: Option<Duration>,
    /// How long ago we last warned that this release's delete is held.
    pub(crate) since_last_fence_warning: Option<Duration>,
    /// How often a held fence is re-checked (SPEC §5e).
    pub(crate) fence_recheck_interval: Duration,
    /// How long a delete may be held before we warn (SPEC §5e).
    pub fence_held_warning_after: Duration,
    /// Since when, and with what last error, the storage read a decision on
    /// this release being deleted needs has failed on every try; `None`
    /// while it does not.
    pub storage_failure: Option<StorageFailing>,
    /// Whether the fence stays on a stuck release while its recovery waits
    /// (SPEC §4.5): the controller's passes; the drain lets go of every
    /// live release instead, as its pod is going away.
    pub(crate) holds_waiting_releases: bool,
    /// Whose the release's fence is, by its label (SPEC §3): another
    /// install's is left to that install; one this install keeps is
    /// labelled as its own.
    pub fence_holder: FenceHolder,
    /// Whether this pass may start a recovery: the controller's reconcile
    /// does; a settle (the undo after a failed step, the drain) never.
    pub may_recover: bool,
    /// `--dry-run`: every decision that would write becomes
    /// [`Decision::DryRun`].
    pub dry_run: bool,
    /// `--max-recoveries-per-minute` is set: a recovery starts only on a
    /// turn of the rate limit ([`Need::RecoveryTurn`]).
    pub rate_limited: bool,
}

/// SPEC §4 steps 2-7 and §5: the decision for one fresh read of a release,
/// or what it needs to know first.
pub(crate) fn decide(release: &ReleaseView, known: &Known, context: &Context) -> Answer {
    match decide_from(release, known, context) {
        Answer::Decided(decision) if context.dry_run => Answer::Decided(as_dry_run(decision)),
        answer => answer,
    }
}

fn decide_from(release: &ReleaseView, known: &Known, context: &Context) -> Answer {
    if release.has_fence() && context.fence_holder == FenceHolder::AnotherInstall {
        // SPEC §3: another install fenced it, and settles it wherever the
        // release is now; its suspension, if any, came with that fence.
        return Answer::Decided(Decision::Nothing { event: None });
    }
    if release.terminating {
        let storage = known_storage(known, context);
        return match decide_terminating(release, storage.as_ref(), context) {
            Some(decision) => Answer::Decided(decision),
            None => Answer::Needs(Need::Storage),
        };
    }
    let holds_fence = context.holds_waiting_releases
        && (awaits_recovery(release) || keeps_fence_through_a_retry(release));
    if release.suspend {
        if release.suspend_owned_by_us() {
            // Ours on a live release: an earlier run (or this pass's failed
            // step) stopped mid-recovery. Lift it, and nothing else in this
            // pass; the fence stays only while the recovery is to come.
            return Answer::Decided(Decision::Lift {
                keep_fence: holds_fence,
            });
        }
        let event = notices::suspension_not_owned(release);
        return Answer::Decided(if release.has_fence() {
            Decision::DropFence { event: Some(event) }
        } else {
            Decision::Nothing { event: Some(event) }
        });
    }
    if release.has_fence() && !holds_fence {
        // A fence without a suspension protects nothing, but a stuck release
        // waiting for its recovery (§4.5).
        return Answer::Decided(Decision::DropFence { event: None });
    }
    if !awaits_recovery(release) || !context.may_recover {
        return Answer::Decided(Decision::Nothing { event: None });
    }
    let Some(storage) = &known.storage else {
        return Answer::Needs(Need::Storage);
    };
    decide_recovery(release, storage, known.recovery_turn, context)
}

/// A live release flux-plunger means to recover: stuck, and not opted out.
/// Whether its storage holds anything to reclaim the listing tells.
fn awaits_recovery(release: &ReleaseView) -> bool {
    release.is_stuck() && !release.recovery_disabled()
}

/// A fenced release that helm-controller is passing over right now (`Ready`
/// Unknown: its retry of a stuck release runs an action between two stuck
/// answers) keeps the fence until the pass has ended: the release may well
/// be stuck again, and a delete in that window must still be held.
fn keeps_fence_through_a_retry(release: &ReleaseView) -> bool {
    release.has_fence() && release.helm_controller_mid_pass() && !release.recovery_disabled()
}

/// Whether a release is worth a reconcile when the watch reports it (SPEC §4
/// watch filter): stuck, suspended by us, fenced, or suspended and terminating.
pub fn is_of_interest(release: &ReleaseView) -> bool {
    release.is_stuck()
        || release.suspended_by_us()
        || release.has_fence()
        || (release.suspend && release.terminating)
}

#[cfg(test)]
mod tests;
