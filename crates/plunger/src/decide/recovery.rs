//! SPEC §4 steps 6-8: what the storage of a stuck release holds decides
//! whether, and what, its recovery reclaims; when it may take the
//! suspension; how the release looks after it.

use std::time::Duration;

use super::storage::{StorageFacts, Unreadable};
use super::{Answer, Context, Decision, Need, Recovery};
use crate::notices::{self, AfterRecovery, EventSpec};
use crate::release::view::{ProcessedVersion, ReleaseView};
use crate::storage::view::StorageRevision;

/// SPEC §4 steps 6-7 and the rate limit: what the storage of a stuck release
/// holds decides whether, and what, its recovery reclaims.
pub(super) fn decide_recovery(
    release: &ReleaseView,
    storage: &StorageFacts,
    turn: Option<Result<(), Duration>>,
    context: &Context,
) -> Answer {
    let revisions = match storage {
        StorageFacts::Listed { revisions, .. } => revisions,
        StorageFacts::Unreadable { why, cause } => {
            let why = why.clone();
            return Answer::Decided(match cause {
                // Its creation wakes no watch of ours: retried with backoff,
                // with a warning.
                Unreadable::KubeconfigMissing => Decision::Recover(Recovery::Retry {
                    event: Some(notices::remote_kubeconfig_missing(release, &why)),
                }),
                Unreadable::AccessRefused | Unreadable::GivenUp => {
                    Decision::Recover(Recovery::Retry { event: None })
                }
                // Nothing changes until someone fixes the Secret or the
                // release, and their edit wakes it.
                Unreadable::RemoteClusterUnusable => skip(
                    release,
                    Some(notices::remote_cluster_unusable(release, &why)),
                    SkipReason::RemoteClusterUnusable { why },
                    context,
                ),
                Unreadable::OutOfReach => skip(
                    release,
                    Some(notices::storage_out_of_reach(release, &why)),
                    SkipReason::StorageOutOfReach { why },
                    context,
                ),
            });
        }
    };
    let target = match plan_recovery(release, revisions) {
        RecoveryPlan::Reclaim(target) => target,
        RecoveryPlan::Skip(reason) => return Answer::Decided(skip(release, None, reason, context)),
    };
    if context.dry_run {
        let would = format!(
            "suspend {} with the uninstall fence, annotate revision {}, delete Helm storage Secret {}/{} (status {:?}), then lift the suspension and the fence",
            release.key(),
            target.revision,
            target.namespace,
            target.name,
            target.status
        );
        let event = notices::recovery_dry_run(&would);
        return Answer::Decided(Decision::DryRun {
            would,
            event: Some(event),
        });
    }
    if context.rate_limited {
        match turn {
            None => return Answer::Needs(Need::RecoveryTurn),
            Some(Err(retry_after)) => {
                return Answer::Decided(Decision::Recover(Recovery::WaitForTurn {
                    retry_after,
                    fence: !release.has_fence(),
                }));
            }
            Some(Ok(())) => {}
        }
    }
    let below_uid = revision_below(revisions, &target).map(|r| r.uid.clone());
    Answer::Decided(Decision::Recover(Recovery::Start { target, below_uid }))
}

/// A stuck release whose storage holds nothing to reclaim has no recovery
/// to wait for: the fence it carried while it waited goes (SPEC §4.5).
fn skip(
    release: &ReleaseView,
    event: Option<EventSpec>,
    reason: SkipReason,
    context: &Context,
) -> Decision {
    Decision::Skip {
        reason,
        event,
        drop_fence: release.has_fence() && !context.dry_run,
    }
}

/// SPEC §4 steps 6-7: whether the storage of a stuck release holds a
/// revision to reclaim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RecoveryPlan {
    /// Reclaim (delete) this revision.
    Reclaim(StorageRevision),
    /// Leave the storage alone, for the reason given.
    Skip(SkipReason),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SkipReason {
    /// No storage Secret: nothing to reclaim.
    NoRevisions,
    /// The newest revision is the one just below the revision we reclaimed.
    AlreadyProcessed { latest: u64, processed: u64 },
    /// The newest revision is deployed: deleting it would lose a good release.
    LatestIsDeployed { latest: u64 },
    /// The newest revision's status does not explain the stuck state.
    StatusDoesNotExplain { latest: u64, status: String },
    /// The release lives in a remote cluster that cannot be reached or used.
    RemoteClusterUnusable { why: String },
    /// The storage is where helm-controller, acting for the release as its
    /// ServiceAccount, could not reach it (`storage::reach`).
    StorageOutOfReach { why: String },
    /// Read again right before the acquire, the release was no longer stuck.
    NoLongerStuck,
}

impl SkipReason {
    /// Whether the storage was listed and found to hold nothing to reclaim
    /// (SPEC §4.6–4.7), rather than never read: out of reach, in a remote
    /// cluster that cannot be used, or left unread by a release no longer
    /// stuck. Only a verdict on the storage names the storage it read.
    pub(crate) fn found_in_the_storage(&self) -> bool {
        match self {
            Self::NoRevisions
            | Self::AlreadyProcessed { .. }
            | Self::LatestIsDeployed { .. }
            | Self::StatusDoesNotExplain { .. } => true,
            Self::RemoteClusterUnusable { .. }
            | Self::StorageOutOfReach { .. }
            | Self::NoLongerStuck => false,
        }
    }
}

/// Chooses the revision to reclaim (SPEC §4.6–4.7): the newest one, when
/// its status is one Helm cannot get past by itself, unless it is the one
/// below the revision we already reclaimed, or a deployed one.
pub(crate) fn plan_recovery(release: &ReleaseView, revisions: &[StorageRevision]) -> RecoveryPlan {
    let Some(latest) = revisions.iter().max_by_key(|r| r.revision) else {
        return RecoveryPlan::Skip(SkipReason::NoRevisions);
    };
    // The revision just below the one we reclaimed is left alone, unless
    // its uid shows it is not the one that was below then but one Helm made
    // later under the same number (a new failure, recovered like any), or
    // unless nothing is installed: with only `uninstalled` revisions left
    // helm-controller installs, and Helm refuses an install while any of
    // them is there ("cannot re-use a name that is still in use"), so each
    // goes in turn.
    if let ProcessedVersion::Revision(processed) = release.processed_version()
        && !only_uninstalled(revisions)
        && latest.revision.checked_add(1) == Some(processed)
        && release
            .processed_below_uid()
            .is_none_or(|uid| uid == latest.uid)
    {
        return RecoveryPlan::Skip(SkipReason::AlreadyProcessed {
            latest: latest.revision,
            processed,
        });
    }
    if latest.status == "deployed" {
        return RecoveryPlan::Skip(SkipReason::LatestIsDeployed {
            latest: latest.revision,
        });
    }
    if !status_explains_stuck(&latest.status) {
        return RecoveryPlan::Skip(SkipReason::StatusDoesNotExplain {
            latest: latest.revision,
            status: latest.status.clone(),
        });
    }
    RecoveryPlan::Reclaim(latest.clone())
}

/// Every revision is `uninstalled`: a keep-history uninstall's records, with
/// nothing installed.
fn only_uninstalled(revisions: &[StorageRevision]) -> bool {
    revisions.iter().all(|r| r.status == "uninstalled")
}

/// Whether a newest revision in `status` explains a stuck release
/// that helm-controller will not get past by itself: `uninstalling`,
/// `uninstalled` and `unknown`, the statuses the real helm-controller
/// (v1.4.0, v1.6.1, v1.6.4) was seen to leave stuck for good. A newest
/// `failed` or `superseded` revision it upgrades, and a `pending-*` one it
/// first unlocks (marks `failed`) and then upgrades; a `pending-upgrade`
/// revision is also what an upgrade in flight looks like, right after a
/// recovery, under the number just reclaimed. Reclaiming any of these would
/// at best do helm-controller's work and at worst delete a release being
/// written. A status Helm does not write explains nothing either.
pub fn status_explains_stuck(status: &str) -> bool {
    matches!(status, "uninstalling" | "uninstalled" | "unknown")
}

/// The revision just below `target`, whose uid the annotation records.
pub(crate) fn revision_below<'a>(
    revisions: &'a [StorageRevision],
    target: &StorageRevision,
) -> Option<&'a StorageRevision> {
    revisions
        .iter()
        .filter(|r| r.revision < target.revision)
        .max_by_key(|r| r.revision)
}

/// SPEC §4.8: what the read the acquire is locked on allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MayAcquire {
    /// Take the suspension and the fence.
    Take,
    /// Deleted, or suspended by someone, meanwhile: not ours to take.
    NotOurs,
    /// No longer stuck (helm-controller got past it, or started an upgrade
    /// after an earlier recovery): the storage listed before may be stale.
    NoLongerStuck,
}

/// SPEC §4.8: may we take the suspension, given the read the apply is locked
/// on? Only from a live release that nobody has suspended, and that is still
/// stuck (right after a recovery helm-controller starts an upgrade whose
/// in-flight revision must never be reclaimed). Asked of the read that
/// planned the recovery, before the unforced apply locked on it, and of the
/// read after it conflicted, before forcing. The second time a conflict with `spec.suspend` still false
/// means an owner of `false` (a backup controller's Update), which an
/// unforced apply can never take over; a `true` set meanwhile is somebody's
/// suspension and is never taken.
pub(crate) fn may_take_suspension(release: &ReleaseView) -> MayAcquire {
    if release.terminating || release.suspend {
        MayAcquire::NotOurs
    } else if !release.is_stuck() || release.recovery_disabled() {
        MayAcquire::NoLongerStuck
    } else {
        MayAcquire::Take
    }
}

/// Whether a release read again mid-recovery is still the one we acquired: the
/// same uid, live, under our suspension and our fence. Only then may a step
/// that met a 409 be sent again instead of undoing the recovery.
pub(crate) fn still_acquired(release: &ReleaseView, uid: &str) -> bool {
    release.uid == uid && !release.terminating && release.suspended_by_us() && release.has_fence()
}

/// Classifies the release as the recovery's last write left it (`None`:
/// gone).
pub(crate) fn after_recovery(last_seen: Option<&ReleaseView>) -> AfterRecovery {
    match last_seen {
        None => AfterRecovery::BeingDeleted { fenced: false },
        Some(release) if release.terminating => AfterRecovery::BeingDeleted {
            fenced: release.has_fence(),
        },
        Some(release) if release.suspend => AfterRecovery::SuspendedByOther,
        Some(_) => AfterRecovery::Free,
    }
}
