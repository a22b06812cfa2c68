//! The drain (SPEC §6): once the controller has stopped, release every fence
//! this flux-plunger holds before the pod is killed.
//!
//! A live release loses our suspension (if ours) and the fence together;
//! another manager's suspension is left alone. A release being deleted goes
//! through SPEC §5 until helm-controller has uninstalled it and the fence can
//! go, or until the deadline. Each release is one `Reconciler::settle`, which
//! never starts a recovery; releases are drained in parallel, bounded.

use std::time::{Duration, Instant};

use futures::{StreamExt, stream};
use kube::Client;

use crate::reconcile::{Outcome, Reconciler};
use crate::release::{ReleaseView, list_all};

/// How often held releases are looked at again while helm-controller works.
const POLL: Duration = Duration::from_millis(500);

/// What the drain did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DrainReport {
    /// Fenced releases found at the start.
    pub found: usize,
    /// Releases whose fence is gone (released, or the release is gone).
    pub released: usize,
    /// `namespace/name` of releases still fenced at the deadline.
    pub left: Vec<String>,
    /// Listings that failed and were retried.
    pub failed_listings: u32,
    /// False when the final listing failed: `left` is then unknown.
    pub final_listing_succeeded: bool,
}

/// The fenced releases, listed from the apiserver (finalizers cannot be
/// selected server-side: list and filter).
pub async fn list_fenced(client: &Client) -> kube::Result<Vec<ReleaseView>> {
    list_all(client, |release| release.has_fence().then_some(release)).await
}

/// Drains until every fence is gone or `deadline` passes.
pub async fn drain(
    client: &Client,
    reconciler: &Reconciler,
    deadline: Instant,
    concurrency: usize,
) -> DrainReport {
    let mut report = DrainReport::default();
    let mut first = true;
    loop {
        let fenced = match list_fenced(client).await {
            Ok(fenced) => fenced,
            Err(err) => {
                report.failed_listings += 1;
                tracing::warn!(error = %err, "listing fenced HelmReleases failed; retrying");
                if Instant::now() + POLL >= deadline {
                    break;
                }
                tokio::time::sleep(POLL).await;
                continue;
            }
        };
        if first {
            report.found = fenced.len();
            first = false;
            tracing::info!(fenced = fenced.len(), "draining flux-plunger's fences");
        }
        if fenced.is_empty() {
            break;
        }
        let outcomes: Vec<(String, Result<Outcome, crate::error::Error>)> = stream::iter(fenced)
            .map(|release| async move {
                let outcome = reconciler.settle(&release.namespace, &release.name).await;
                (release.key(), outcome)
            })
            .buffer_unordered(concurrency.max(1))
            .collect()
            .await;
        for (key, outcome) in &outcomes {
            match outcome {
                Ok(Outcome::FenceDropped | Outcome::Gone) => {
                    tracing::info!(release = %key, "fence released")
                }
                Ok(Outcome::Lifted { kept_fence: false }) => {
                    tracing::info!(release = %key, "suspension and fence released")
                }
                Ok(other) => {
                    tracing::debug!(release = %key, outcome = ?other, "waiting for helm-controller")
                }
                Err(err) => {
                    tracing::warn!(release = %key, error = %err, "could not release; retrying")
                }
            }
        }
        if Instant::now() + POLL >= deadline {
            break;
        }
        tokio::time::sleep(POLL).await;
    }
    match list_fenced(client).await {
        Ok(left) => {
            report.left = left.iter().map(ReleaseView::key).collect();
            report.final_listing_succeeded = true;
        }
        Err(err) => {
            report.failed_listings += 1;
            tracing::warn!(error = %err, "the final listing failed: the count of fences left is unknown");
        }
    }
    report.released = report.found.saturating_sub(report.left.len());
    report
}
