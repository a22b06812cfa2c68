//! What to do next, as pure functions of what was read (SPEC §4-§5).
//!
//! Nothing here talks to the apiserver; `reconcile` reads, asks, and carries
//! the answer out. Every branch is a unit test below.

use std::time::Duration;

use crate::history::HistorySnapshot;
pub(crate) use crate::install::FenceHolder;
use crate::notices::{self, AfterRecovery, EventSpec};
use crate::release::view::{ProcessedVersion, ReleaseView};
use crate::storage::view::StorageRevision;

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

/// What the Helm storage of a release holds, as far as its recovery or its
/// uninstall is concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum StorageFacts {
    Listed {
        /// The well-formed revisions, oldest first.
        revisions: Vec<StorageRevision>,
        /// For a release being deleted, when helm-controller's history is
        /// empty and the newest revision is live: its snapshot, or why none
        /// could be made from its payload.
        snapshot: Option<Result<Box<HistorySnapshot>, String>>,
    },
    /// The storage cannot be read, for this `cause`.
    Unreadable { why: String, cause: Unreadable },
}

/// Why a release's Helm storage cannot be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unreadable {
    /// The remote cluster's kubeconfig Secret is not there (yet): Cluster
    /// API and other provisioners create it after the release.
    KubeconfigMissing,
    /// The kubeconfig Secret is there and wrong: nothing changes until
    /// someone fixes it.
    RemoteClusterUnusable,
    /// helm-controller, acting for the release, could not reach the
    /// storage: nor may flux-plunger (`storage::reach`).
    OutOfReach,
    /// Listing or reading the storage was refused.
    AccessRefused,
    /// Reading it failed on every try for as long as a delete is held
    /// before the warning ([`storage_given_up`]).
    GivenUp,
}

/// Which revision a Helm uninstall of the storage would act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum UninstallTarget<'a> {
    /// Nothing is installed: no revision, or a newest `uninstalled` one.
    Nothing,
    /// The newest revision, live: the uninstall deletes what it installed.
    Revision(&'a StorageRevision),
}

/// Helm's uninstall acts on the newest revision. A newest `uninstalled` one
/// means nothing is installed, whatever lies below it: Helm writes that
/// status on the release it uninstalled, after deleting its objects, and
/// keeps the older revisions (`superseded` by then) only as history
/// (`keepHistory`). Handing one of those to helm-controller would run the
/// chart's delete hooks again and delete by name every object of an old
/// manifest, another release's objects of the same name included.
pub(crate) fn uninstall_target(revisions: &[StorageRevision]) -> UninstallTarget<'_> {
    match revisions.iter().max_by_key(|r| r.revision) {
        Some(newest) if is_live(newest) => UninstallTarget::Revision(newest),
        _ => UninstallTarget::Nothing,
    }
}

/// A revision whose objects may still exist: any but `uninstalled` (Helm
/// deletes the objects before it writes that status).
fn is_live(revision: &StorageRevision) -> bool {
    revision.status != "uninstalled"
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

/// A storage read that has failed on every try since a while.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StorageFailing {
    pub failing_for: Duration,
    pub last_error: String,
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

/// SPEC §4 steps 6-7 and the rate limit: what the storage of a stuck release
/// holds decides whether, and what, its recovery reclaims.
fn decide_recovery(
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

/// The storage as known, or as given up on ([`storage_given_up`]) when
/// reading it has failed long enough.
fn known_storage(known: &Known, context: &Context) -> Option<StorageFacts> {
    if let Some(storage) = &known.storage {
        return Some(storage.clone());
    }
    let failing = context.storage_failure.as_ref()?;
    storage_given_up(context).then(|| StorageFacts::Unreadable {
        why: format!(
            "reading its storage failed on every try for {}s: {}",
            context.fence_held_warning_after.as_secs(),
            failing.last_error
        ),
        cause: Unreadable::GivenUp,
    })
}

/// `--dry-run`: a decision that would write is reported instead, with the
/// event it would record where that event reports what was found rather
/// than what was done; a held fence is still held (nothing is written to
/// hold it), its label left as it is.
fn as_dry_run(decision: Decision) -> Decision {
    match decision {
        Decision::HoldFence { recheck, event, .. } => Decision::HoldFence {
            recheck,
            event,
            label_fence: false,
        },
        decision => match would_write(&decision) {
            Some(would) => Decision::DryRun {
                would,
                event: match decision {
                    Decision::DropFence { event } => event,
                    _ => None,
                },
            },
            None => decision,
        },
    }
}

/// What a decision would write, for `--dry-run`; `None` for no write.
fn would_write(decision: &Decision) -> Option<String> {
    match decision {
        Decision::Lift { keep_fence: true } => {
            Some("lift flux-plunger's suspension and keep the fence".to_owned())
        }
        Decision::Lift { keep_fence: false } => {
            Some("lift flux-plunger's suspension and the fence".to_owned())
        }
        Decision::DropFence { .. } => Some("remove the uninstall fence".to_owned()),
        Decision::HandOver { snapshot, then, .. } => Some(format!(
            "write revision {} ({}) to status.history for helm-controller's uninstall, then {}",
            snapshot.version,
            snapshot.full_name(),
            match then {
                AfterHandOver::Lift { .. } => "lift flux-plunger's suspension",
                AfterHandOver::RequestReconcile => "ask helm-controller to reconcile",
            }
        )),
        Decision::RequestReconcile => Some("ask helm-controller to reconcile".to_owned()),
        Decision::ReleaseWithoutUninstall { .. } => {
            Some("remove the uninstall fence without an uninstall".to_owned())
        }
        Decision::Nothing { .. }
        | Decision::HoldFence { .. }
        | Decision::Recover(_)
        | Decision::Skip { .. }
        | Decision::DryRun { .. } => None,
    }
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

fn decide_terminating(
    release: &ReleaseView,
    storage: Option<&StorageFacts>,
    context: &Context,
) -> Option<Decision> {
    if release.suspend && release.suspend_owned_by_us() {
        // helm-controller must see an unsuspended generation to uninstall;
        // the fence keeps the release until it has.
        // A finalizer cannot be added to an object being deleted, so "keep"
        // means keep the fence only where it already is.
        let keep_fence = release.has_fence();
        if release.has_history {
            return Some(Decision::Lift { keep_fence });
        }
        // Its history was cleared (the stuck state): hand it the newest live
        // revision before the lift, or its deletion path uninstalls nothing.
        // Whatever stands in the way, the suspension is lifted: ours must
        // never be what skips the uninstall, and §5d then says what is left.
        let storage = storage?;
        return Some(
            hand_over(release, storage, AfterHandOver::Lift { keep_fence })
                .unwrap_or(Decision::Lift { keep_fence }),
        );
    }
    if release.suspend {
        // Another manager suspended, then deleted: its decision to skip the
        // uninstall (migrations do this on purpose). Unless we recovered this
        // release before: then the suspension is most likely one an older
        // flux-plunger left behind, and the skipped uninstall an accident.
        let event = notices::terminating_while_suspended(release);
        return Some(if release.has_fence() {
            Decision::DropFence { event: Some(event) }
        } else {
            Decision::Nothing { event: Some(event) }
        });
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
    // helm-controller finished without reporting an uninstall: its pass
    // over a cleared history (`ErrNoLatest`) looks just like this. Whether
    // anything is left to uninstall, only the storage says.
    let storage = storage?;
    let revisions = match storage {
        StorageFacts::Unreadable { why, .. } => {
            // A refused read, or a kubeconfig Secret missing for a moment
            // (credentials rotated, a short-lived token), may pass, and
            // helm-controller, with the same kubeconfig, retries: the fence
            // holds for as long as a delete is held before anyone is warned.
            if !held_until_warned(context) {
                return Some(hold(release, context));
            }
            return Some(let_go(
                release,
                &format!("its Helm storage cannot be read ({why})"),
                "whatever it installed",
            ));
        }
        StorageFacts::Listed { revisions, .. } => revisions,
    };
    if uninstall_target(revisions) == UninstallTarget::Nothing {
        return Some(Decision::DropFence { event: None });
    }
    let live: Vec<&StorageRevision> = revisions.iter().filter(|r| is_live(r)).collect();
    if release.our_reconcile_request_handled() {
        // helm-controller handled the history flux-plunger handed it. Kept,
        // it is retrying a failed uninstall; cleared, it let the release go
        // without one, and nothing else will uninstall it.
        return Some(if release.has_history {
            hold(release, context)
        } else {
            let_go(
                release,
                "helm-controller cleared the history flux-plunger handed it without uninstalling",
                &describe_revisions(&live),
            )
        });
    }
    if release.has_history {
        return Some(Decision::RequestReconcile);
    }
    let hand_over = hand_over(release, storage, AfterHandOver::RequestReconcile);
    Some(hand_over.unwrap_or_else(|why| {
        let_go(
            release,
            &format!("no history can be handed to helm-controller ({why})"),
            &describe_revisions(&live),
        )
    }))
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

/// SPEC §5a: the storage read a decision on a release being deleted needs,
/// failing on every try for as long as a delete is held before the warning
/// (a payload the apiserver keeps failing to serve, a kubeconfig Secret that
/// cannot be read, a review that is not answered) is given up: the storage
/// counts as unreadable, so nothing is handed over, our suspension is lifted
/// and the fence let go with a Warning. Retrying the same step for ever
/// would keep the release Terminating, under our suspension, for good.
pub(crate) fn storage_given_up(context: &Context) -> bool {
    context
        .storage_failure
        .as_ref()
        .is_some_and(|failing| failing.failing_for >= context.fence_held_warning_after)
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

/// Whether a release read again mid-recovery is still the one we hold: the
/// same uid, live, under our suspension and our fence. Only then may a step
/// that met a 409 be sent again instead of undoing the recovery.
pub(crate) fn still_held(release: &ReleaseView, uid: &str) -> bool {
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

/// What a guarded JSON patch must write to give up our hold on a release.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct GuardedPatch {
    /// Remove `spec.suspend`.
    pub(crate) lift_suspension: bool,
    /// Remove the fence at these indices of `metadata.finalizers`.
    pub(crate) fence_indices: Vec<usize>,
    /// Remove the fence's label: it goes with the last copy of the fence.
    pub(crate) remove_label: bool,
}

impl GuardedPatch {
    /// Nothing for a patch to write.
    pub(crate) fn is_empty(&self) -> bool {
        !self.lift_suspension && self.fence_indices.is_empty()
    }
}

/// After our apply gave up the fence and returned `written`: the copies of
/// the fence still listed are held by another manager (a backup restore, a
/// hand edit, a re-applied manifest), and `metadata.finalizers` is a set, so
/// giving up our claim cannot remove them. The fence is flux-plunger's
/// wherever it is: remove every copy by the guarded patch.
pub(crate) fn fence_left_after_give_up(written: &ReleaseView) -> GuardedPatch {
    let fence_indices = written.fence_indices();
    GuardedPatch {
        lift_suspension: false,
        remove_label: written.fence_labelled() && !fence_indices.is_empty(),
        fence_indices,
    }
}

/// Our apply giving up the suspension (and, unless `keep_fence`, the fence)
/// was refused by a field-manager conflict: the fence is listed twice and
/// another manager owns the duplicated entry, so every apply naming the fence
/// is refused. The guarded patch does the same without an apply: it
/// lifts the suspension where flux-plunger alone holds it (a co-owner's
/// suspension is never removed) and, unless the fence is kept, removes every
/// copy of it; when the fence is kept, every copy stays.
pub(crate) fn let_go_without_apply(release: &ReleaseView, keep_fence: bool) -> GuardedPatch {
    let fence_indices = if keep_fence {
        Vec::new()
    } else {
        release.fence_indices()
    };
    GuardedPatch {
        lift_suspension: release.suspend && release.suspend_owned_by_us_alone(),
        remove_label: release.fence_labelled() && !fence_indices.is_empty(),
        fence_indices,
    }
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
#[path = "decide_tests.rs"]
mod tests;
