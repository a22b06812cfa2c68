//! What the Helm storage of a release holds, as far as its recovery or its
//! uninstall is concerned, and when a read that keeps failing is given up.

use std::time::Duration;

use super::{Context, Known};
use crate::history::HistorySnapshot;
use crate::storage::view::StorageRevision;

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
pub(super) fn is_live(revision: &StorageRevision) -> bool {
    revision.status != "uninstalled"
}

/// The storage as known, or as given up on ([`storage_given_up`]) when
/// reading it has failed long enough.
pub(super) fn known_storage(known: &Known, context: &Context) -> Option<StorageFacts> {
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

/// A storage read that has failed on every try since a while.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StorageFailing {
    pub failing_for: Duration,
    pub last_error: String,
}
