//! What flux-plunger tells an operator on a HelmRelease: every event's
//! reason, action and words, in one place (SPEC §1 lists the reasons).
//! `decide` and `reconcile` choose which one; `events` records it.

use std::time::Duration;

use crate::history::HistorySnapshot;
use crate::release::view::ReleaseView;
use crate::storage::view::StorageRevision;

/// Event reasons (SPEC §1), each used by the event below that words it.
pub mod reasons {
    pub const SUSPENSION_NOT_OWNED: &str = "SuspensionNotOwned";
    pub const RECOVERY_DEFERRED: &str = "RecoveryDeferred";
    pub const UNSUSPEND_FAILED: &str = "UnsuspendFailed";
    pub const TERMINATING_WHILE_SUSPENDED: &str = "TerminatingWhileSuspended";
    pub const UNINSTALL_FENCE_HELD: &str = "UninstallFenceHeld";
    pub const RECOVERED: &str = "Recovered";
    pub(crate) const RECOVERY_DRY_RUN: &str = "RecoveryDryRun";
    pub const REMOTE_CLUSTER_UNUSABLE: &str = "RemoteClusterUnusable";
    /// A stuck release whose storage its own ServiceAccount could not reach
    /// (Warning): left alone.
    pub const STORAGE_OUT_OF_REACH: &str = "StorageOutOfReach";
    /// A revision was written to helm-controller's history so that its
    /// uninstall runs (Normal).
    pub const UNINSTALL_HANDED_OVER: &str = "UninstallHandedOver";
    /// The fence was let go though nothing could uninstall the release (Warning).
    pub const RELEASED_WITHOUT_UNINSTALL: &str = "ReleasedWithoutUninstall";
    /// A copy of the fence could not be removed (Warning).
    pub(crate) const FENCE_REMOVAL_FAILED: &str = "FenceRemovalFailed";
}

/// An event to record on the release.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EventSpec {
    pub(crate) warning: bool,
    pub(crate) reason: &'static str,
    pub(crate) action: &'static str,
    pub(crate) note: String,
}

impl EventSpec {
    fn normal(reason: &'static str, action: &'static str, note: String) -> Self {
        Self {
            warning: false,
            reason,
            action,
            note,
        }
    }

    fn warning(reason: &'static str, action: &'static str, note: String) -> Self {
        Self {
            warning: true,
            reason,
            action,
            note,
        }
    }
}

/// How a recovery's final lift left the release: what its `Recovered`
/// event says is true now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AfterRecovery {
    /// Live and unsuspended: helm-controller upgrades it again.
    Free,
    /// Live, and still suspended by another manager who co-owned the
    /// suspension: helm-controller upgrades it once that one is lifted.
    SuspendedByOther,
    /// A delete came before the final lift. `fenced`: our fence holds it
    /// until helm-controller has uninstalled it, to be re-checked on a timer.
    BeingDeleted { fenced: bool },
}

/// SPEC §4.13: which revision was reclaimed, and what is true of the release
/// now.
pub(crate) fn recovered(
    release: &ReleaseView,
    target: &StorageRevision,
    after: AfterRecovery,
) -> EventSpec {
    let reclaimed = format!(
        "reclaimed Helm storage revision {} ({}, status {:?}) of {}",
        target.revision,
        target.name,
        target.status,
        release.key()
    );
    let now = match after {
        AfterRecovery::Free => "helm-controller can upgrade again",
        AfterRecovery::SuspendedByOther => {
            "it stays suspended by another manager, who also suspended it meanwhile: helm-controller upgrades it once that suspension is lifted"
        }
        AfterRecovery::BeingDeleted { fenced: true } => {
            "it was deleted meanwhile: the uninstall fence holds it until helm-controller has uninstalled it"
        }
        AfterRecovery::BeingDeleted { fenced: false } => {
            "it was deleted meanwhile and holds nothing of flux-plunger's"
        }
    };
    EventSpec::normal(reasons::RECOVERED, "Recover", format!("{reclaimed}: {now}"))
}

/// `--dry-run`: what a recovery would have written.
pub(crate) fn recovery_dry_run(would: &str) -> EventSpec {
    EventSpec::normal(
        reasons::RECOVERY_DRY_RUN,
        "Recover",
        format!("dry run: flux-plunger would {would}"),
    )
}

/// SPEC §4.8: the suspension could not be taken.
pub(crate) fn recovery_deferred(release: &ReleaseView) -> EventSpec {
    EventSpec::normal(
        reasons::RECOVERY_DEFERRED,
        "Suspend",
        format!(
            "{} changed while flux-plunger was about to recover it (suspended, deleted or written meanwhile); recovery waits for its next change",
            release.key()
        ),
    )
}

/// SPEC §4.3: a suspension that is not flux-plunger's; a Warning when
/// flux-plunger recovered the release before (the original may have left
/// it mid-recovery).
pub(crate) fn suspension_not_owned(release: &ReleaseView) -> EventSpec {
    if release.carries_processed_annotation() {
        EventSpec::warning(
            reasons::SUSPENSION_NOT_OWNED,
            "Skip",
            format!(
                "{} is suspended by another manager and left alone. flux-plunger has recovered it before, so this may be a suspension an older flux-plunger left mid-recovery: resume it by hand (flux resume helmrelease) once nothing else holds it",
                release.key()
            ),
        )
    } else {
        EventSpec::normal(
            reasons::SUSPENSION_NOT_OWNED,
            "Skip",
            format!(
                "{} is suspended by another manager; flux-plunger leaves it alone",
                release.key()
            ),
        )
    }
}

/// SPEC §4.3: a suspension of flux-plunger's it could not lift (`error`
/// as `error::describe` puts it).
pub(crate) fn unsuspend_failed(release: &ReleaseView, error: &str) -> EventSpec {
    EventSpec::warning(
        reasons::UNSUSPEND_FAILED,
        "Unsuspend",
        format!(
            "flux-plunger holds a suspension of {} it could not lift: {error}; it will retry",
            release.key()
        ),
    )
}

/// SPEC §3: a copy of the fence that could not be removed.
pub(crate) fn fence_removal_failed(release: &ReleaseView, error: &str) -> EventSpec {
    EventSpec::warning(
        reasons::FENCE_REMOVAL_FAILED,
        "ReleaseFence",
        format!(
            "flux-plunger could not remove its uninstall fence from {}: {error}; it will retry (by hand: flux-plunger-sweep release {})",
            release.key(),
            release.key()
        ),
    )
}

/// SPEC §9: a stuck release in a remote cluster whose kubeconfig is there
/// but cannot be used.
pub(crate) fn remote_cluster_unusable(release: &ReleaseView, why: &str) -> EventSpec {
    EventSpec::warning(
        reasons::REMOTE_CLUSTER_UNUSABLE,
        "Recover",
        format!(
            "{} is stuck in a remote cluster flux-plunger cannot use: {why}",
            release.key()
        ),
    )
}

/// SPEC §9: a stuck release whose storage helm-controller, acting for it,
/// could not reach.
pub(crate) fn storage_out_of_reach(release: &ReleaseView, why: &str) -> EventSpec {
    EventSpec::warning(
        reasons::STORAGE_OUT_OF_REACH,
        "Recover",
        format!(
            "{} is stuck, and flux-plunger leaves its storage alone: {why}",
            release.key()
        ),
    )
}

/// SPEC §9: a stuck release in a remote cluster whose kubeconfig Secret does
/// not exist (yet).
pub(crate) fn remote_kubeconfig_missing(release: &ReleaseView, error: &str) -> EventSpec {
    EventSpec::warning(
        reasons::REMOTE_CLUSTER_UNUSABLE,
        "Recover",
        format!(
            "{} is stuck in a remote cluster whose kubeconfig Secret does not exist ({error}); flux-plunger retries",
            release.key()
        ),
    )
}

/// SPEC §5b: deleted under another manager's suspension.
pub(crate) fn terminating_while_suspended(release: &ReleaseView) -> EventSpec {
    if release.carries_processed_annotation() {
        EventSpec::warning(
            reasons::TERMINATING_WHILE_SUSPENDED,
            "ReleaseFence",
            format!(
                "{} is being deleted while suspended by another manager; helm-controller will skip the Helm uninstall. It carries flux-plunger's processed-revision annotation, so the suspension may have been left by an older flux-plunger: check that the release's resources are meant to stay",
                release.key()
            ),
        )
    } else {
        EventSpec::normal(
            reasons::TERMINATING_WHILE_SUSPENDED,
            "ReleaseFence",
            format!(
                "{} is being deleted while suspended by another manager; helm-controller will skip the Helm uninstall, as that manager intended",
                release.key()
            ),
        )
    }
}

/// SPEC §5a: the revision handed to helm-controller's uninstall.
pub(crate) fn uninstall_handed_over(
    release: &ReleaseView,
    snapshot: &HistorySnapshot,
    target: &StorageRevision,
) -> EventSpec {
    EventSpec::normal(
        reasons::UNINSTALL_HANDED_OVER,
        "HandOverUninstall",
        format!(
            "{} is being deleted while helm-controller's status no longer names its Helm release: flux-plunger wrote revision {} ({}, status {:?}, from storage Secret {}/{}) to status.history so that helm-controller's uninstall removes what it installed",
            release.key(),
            snapshot.version,
            snapshot.full_name(),
            snapshot.status,
            target.namespace,
            target.name,
        ),
    )
}

/// SPEC §5d: the fence let go though nothing uninstalled the release: why,
/// and what is left behind.
pub(crate) fn released_without_uninstall(
    release: &ReleaseView,
    why: &str,
    left: &str,
) -> EventSpec {
    EventSpec::warning(
        reasons::RELEASED_WITHOUT_UNINSTALL,
        "ReleaseFence",
        format!(
            "flux-plunger lets the delete of {} go without a Helm uninstall: {why}. Left behind: {left}",
            release.key()
        ),
    )
}

/// SPEC §5e: a delete held long by the fence.
pub(crate) fn uninstall_fence_held(release: &ReleaseView, held_for: Duration) -> EventSpec {
    EventSpec::warning(
        reasons::UNINSTALL_FENCE_HELD,
        "HoldFence",
        format!(
            "the delete of {} has been held by flux-plunger's uninstall fence for {}: helm-controller has not finished its uninstall (its finalizer is {}, observed generation {:?} of {:?})",
            release.key(),
            humanize(held_for),
            if release.has_helm_controller_finalizer() {
                "still present"
            } else {
                "gone"
            },
            release.observed_generation,
            release.generation,
        ),
    )
}

/// Short, human text for a duration, e.g. "12m 5s".
fn humanize(d: Duration) -> String {
    let secs = d.as_secs();
    if secs >= 60 {
        format!("{}m {}s", secs / 60, secs % 60)
    } else {
        format!("{secs}s")
    }
}
