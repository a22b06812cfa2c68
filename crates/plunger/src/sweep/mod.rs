//! The pre-delete sweep (SPEC §8) and the operator's `list` / `release`.
//!
//! When the chart is removed nothing of flux-plunger may be left holding a
//! release. The sweep stops flux-plunger, waits for its pods, then releases
//! every fence with guarded JSON patches: `test` ops pin the resourceVersion
//! and uid that were read, and each fence is removed at its index only after a
//! `test` that the index still holds it. Never a server-side apply: on a
//! release last written by a client-side `kubectl apply`, an apply moves that
//! apply's fields to the applying manager and strips every field it leaves out.
//!
//! [`plan`] decides without a request; [`hook`] is the pre-delete hook's
//! steps; letting go of one release, which the hook and `release` share, and
//! the listing of `list` are here.

pub mod hook;
pub mod plan;

use std::time::Duration;

use backon::RetryableWithContext;
use kube::Client;
use kube::api::DynamicObject;

use crate::apply::patch_guarded;
use crate::error::{describe, is_permanent_refusal};
use crate::names::SWEEP_FIELD_MANAGER;
use crate::release::api::{helmreleases, list_all};
use crate::release::view::ReleaseView;
use crate::scope::Scope;
use crate::sweep::plan::{Budget, ReleasePlan, Row, row_of};
use crate::test_hooks::{SweepStep, pause_at};

/// The first wait before a release whose patch failed is read again and
/// patched again; it doubles up to the longest.
const RELEASE_FIRST_WAIT: Duration = Duration::from_millis(250);
const RELEASE_LONGEST_WAIT: Duration = Duration::from_secs(5);

/// Whether a release may be let go of before helm-controller uninstalled it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Uninstall {
    /// The hook: the chart is going, a fence left behind would be stranded.
    MaySkip,
    /// `release` without `--without-uninstall`: refuse, on every read.
    MustNotSkip,
}

/// What a refusal that reading again cannot cure (a 403, an admission
/// policy's denial) ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusals {
    /// The hook: retried through the window. Its RBAC is created right
    /// before it runs and may not be in force yet, and a failed hook fails
    /// the uninstall anyway.
    Retry,
    /// `release`: an operator at a terminal hears about it at once.
    End,
}

/// A release let go of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Released {
    /// It was being deleted and helm-controller had not uninstalled it.
    pub without_uninstall: bool,
}

/// Why a release was not let go of.
#[derive(Debug, thiserror::Error)]
pub enum NotReleased {
    #[error("{}", describe(.0))]
    Failed(kube::Error),
    /// [`Uninstall::MustNotSkip`], and the release is being deleted without
    /// helm-controller having uninstalled it.
    #[error(
        "it is being deleted and helm-controller has not uninstalled it: releasing it now skips the Helm uninstall"
    )]
    WouldSkipUninstall,
}

/// Applies the plan for `release` as read; 422 (a failed `test`) or 409 mean
/// the release changed since the read.
async fn release_one(
    client: &Client,
    release: &ReleaseView,
    plan: &ReleasePlan,
) -> kube::Result<()> {
    patch_guarded(
        client,
        release,
        plan.lift_suspension,
        &plan.fence_indices,
        plan.remove_label,
        SWEEP_FIELD_MANAGER,
    )
    .await?;
    Ok(())
}

/// Releases one HelmRelease, reading it again after a failure (a 409 or a
/// failed `test` means it changed since the read), until the budget's
/// retries end.
pub async fn release_with_retry(
    client: &Client,
    release: ReleaseView,
    budget: Budget,
    uninstall: Uninstall,
    refusals: Refusals,
) -> Result<Released, NotReleased> {
    let key = release.key();
    let api = helmreleases(client.clone(), &release.namespace);
    let first = Attempt {
        release,
        read_again: false,
    };
    let (_, outcome) = (|attempt: Attempt| attempt.run(client, &api, budget, uninstall))
        .retry(budget.backoff(RELEASE_FIRST_WAIT, RELEASE_LONGEST_WAIT))
        .context(first)
        .when(|err: &NotReleased| match err {
            NotReleased::WouldSkipUninstall => false,
            NotReleased::Failed(err) => refusals == Refusals::Retry || !is_permanent_refusal(err),
        })
        .notify(|err, _| tracing::warn!(release = %key, error = %err, "releasing failed; reading again"))
        .await;
    outcome
}

/// One try at letting go of a release: the last read of it, and whether a
/// try before failed (the release is then read again first).
struct Attempt {
    release: ReleaseView,
    read_again: bool,
}

impl Attempt {
    /// Reads the release again if a try before failed, then lets go of it;
    /// hands the read on to the next try. A failed read leaves the last one
    /// in place: the patch's `test`s refuse it if the release changed.
    async fn run(
        mut self,
        client: &Client,
        api: &kube::Api<DynamicObject>,
        budget: Budget,
        uninstall: Uninstall,
    ) -> (Self, Result<Released, NotReleased>) {
        if self.read_again {
            match budget.bounded(api.get_opt(&self.release.name)).await {
                Ok(Some(object)) => self.release = ReleaseView::from_object(&object),
                Ok(None) => {
                    let gone = Released {
                        without_uninstall: false,
                    };
                    return (self, Ok(gone));
                }
                Err(read) => {
                    tracing::warn!(release = %self.release.key(), error = %describe(&read), "reading again failed")
                }
            }
        }
        self.read_again = true;
        let outcome = try_release(client, &self.release, budget, uninstall).await;
        (self, outcome)
    }
}

/// Lets go of `release` as read, by its plan.
async fn try_release(
    client: &Client,
    release: &ReleaseView,
    budget: Budget,
    uninstall: Uninstall,
) -> Result<Released, NotReleased> {
    let plan = ReleasePlan::of(release);
    if plan.is_empty() {
        return Ok(Released {
            without_uninstall: false,
        });
    }
    if plan.without_uninstall && uninstall == Uninstall::MustNotSkip {
        return Err(NotReleased::WouldSkipUninstall);
    }
    if plan.without_uninstall {
        // Said before the write: a run killed right after it (the Job's
        // deadline, an eviction) must still have named the release whose
        // uninstall it skipped; its report is never printed then.
        tracing::warn!(release = %release.key(), "letting go of a release being deleted that helm-controller has not uninstalled: its Helm uninstall is skipped");
    }
    pause_at(SweepStep::BeforeReleasePatch.name()).await;
    budget
        .bounded(release_one(client, release, &plan))
        .await
        .map_err(NotReleased::Failed)?;
    pause_at(SweepStep::ReleasePatched.name()).await;
    Ok(Released {
        without_uninstall: plan.without_uninstall,
    })
}

/// Every HelmRelease of `scope` that `list` shows.
pub async fn list_rows(client: &Client, scope: &Scope) -> kube::Result<Vec<Row>> {
    let mut rows = list_all(client, scope, |release| row_of(&release)).await?;
    rows.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    Ok(rows)
}
