//! Letting go of a release: the suspension lifted, the fence dropped, and
//! any copy of the fence another manager lists removed by a guarded patch
//! (SPEC §4.13, §5).

use super::Reconciler;
use crate::apply::{self, Claim};
use crate::decide;
use crate::error::{Error, describe, is_failed_guard, is_field_manager_conflict, is_stale_write};
use crate::names::PATCH_FIELD_MANAGER;
use crate::notices;
use crate::release::view::ReleaseView;
use crate::test_hooks::Step;

impl Reconciler {
    /// Gives up our suspension, and the fence unless `keep_fence`.
    pub(super) async fn lift(
        &self,
        release: &ReleaseView,
        keep_fence: bool,
    ) -> Result<ReleaseView, Error> {
        let write = self.let_go(release, keep_fence);
        match self
            .write_between((Step::BeforeLift, Step::AfterLift), write)
            .await
        {
            Ok(written) => {
                tracing::info!(release = %release.key(), kept_fence = keep_fence, "lifted flux-plunger's suspension");
                Ok(written)
            }
            Err(failed) => {
                let fence_left = matches!(failed, LetGoFailed::FenceLeft(_));
                let source = failed.into_source();
                // A race is retried after reading again, and a write held
                // back because the Lease lapsed was never sent; anything else
                // an operator must hear about.
                if fence_left && !is_retried_quietly(&source) {
                    self.warn_fence_left(release, &source).await;
                } else if !is_retried_quietly(&source) {
                    let event = notices::unsuspend_failed(release, &describe(&source));
                    self.events.record(release, &event).await;
                }
                Err(Error::Lift {
                    key: release.key(),
                    source,
                })
            }
        }
    }

    /// Gives up the fence: an apply that claims nothing (another manager's
    /// suspension stays as it is), then any copy of the fence another
    /// manager also lists (see [`Self::let_go`]). Returns the release as the
    /// last write left it.
    pub(super) async fn drop_fence(&self, release: &ReleaseView) -> Result<ReleaseView, Error> {
        let write = self.let_go(release, false);
        match self
            .write_between((Step::BeforeDropFence, Step::AfterDropFence), write)
            .await
        {
            Ok(written) => Ok(written),
            Err(failed) => {
                let source = failed.into_source();
                if !is_retried_quietly(&source) {
                    self.warn_fence_left(release, &source).await;
                }
                Err(Error::Lift {
                    key: release.key(),
                    source,
                })
            }
        }
    }

    /// Gives up our suspension and, unless `keep_fence`, the fence, by one
    /// apply that leaves them out; then makes sure they are gone from the
    /// release and not only our claim on them. An apply gives up only its
    /// own claim: a copy of the fence another manager also lists stays, and
    /// is removed by a guarded patch. Where the apply itself is refused by a
    /// field-manager conflict (the fence listed twice, a copy another
    /// manager owns, refuses every apply naming it), the guarded patch lets
    /// go instead, still pinned to the read.
    async fn let_go(
        &self,
        release: &ReleaseView,
        keep_fence: bool,
    ) -> Result<ReleaseView, LetGoFailed> {
        let claim = if keep_fence {
            Claim::FENCE_ONLY
        } else {
            Claim::NOTHING
        };
        let written = match self.apply(release, claim, false).await {
            Ok(object) => self.view(&object),
            Err(err) if is_field_manager_conflict(&err) => {
                let let_go = decide::let_go_without_apply(release, keep_fence);
                if let_go.is_empty() {
                    return Err(LetGoFailed::Holding(err));
                }
                tracing::info!(release = %release.key(), error = %crate::error::describe(&err), "another field manager's copy of the fence refuses the apply; letting go by a guarded patch");
                return self
                    .patch(release, &let_go)
                    .await
                    .map_err(LetGoFailed::Holding);
            }
            Err(err) => return Err(LetGoFailed::Holding(err)),
        };
        if keep_fence {
            return Ok(written);
        }
        let left = decide::fence_left_after_give_up(&written);
        if left.is_empty() {
            return Ok(written);
        }
        tracing::info!(release = %written.key(), copies = left.fence_indices.len(), "another field manager also lists the uninstall fence; removing it by a guarded patch");
        self.patch(&written, &left)
            .await
            .map_err(LetGoFailed::FenceLeft)
    }

    /// Sends the guarded patch for `release` as read.
    async fn patch(
        &self,
        release: &ReleaseView,
        let_go: &decide::GuardedPatch,
    ) -> kube::Result<ReleaseView> {
        let write = apply::patch_guarded(
            &self.client,
            release,
            let_go.lift_suspension,
            &let_go.fence_indices,
            let_go.remove_label,
            PATCH_FIELD_MANAGER,
        );
        let object = self
            .write_between((Step::BeforeGuardedPatch, Step::AfterGuardedPatch), write)
            .await?;
        Ok(self.view(&object))
    }

    /// Warns that a fence could not be removed: its release cannot go (or,
    /// live, is held by nothing flux-plunger does) until it is.
    async fn warn_fence_left(&self, release: &ReleaseView, source: &kube::Error) {
        let event = notices::fence_removal_failed(release, &describe(source));
        self.events.record(release, &event).await;
    }
}

/// Why letting go of a release failed.
enum LetGoFailed {
    /// Nothing more was given up than before: the apply (or the patch in
    /// its place) was refused.
    Holding(kube::Error),
    /// Our claim is given up, but a copy of the fence another manager also
    /// lists could not be removed.
    FenceLeft(kube::Error),
}

impl LetGoFailed {
    fn into_source(self) -> kube::Error {
        match self {
            LetGoFailed::Holding(err) | LetGoFailed::FenceLeft(err) => err,
        }
    }
}

/// A failure retried without a Warning: a write that lost a race with
/// another writer (reading again cures it), or one the client held back
/// because our Lease claim had lapsed (it was never sent).
fn is_retried_quietly(err: &kube::Error) -> bool {
    is_stale_write(err) || is_failed_guard(err) || crate::client::is_not_leader(err)
}
