//! The fences this install set on releases its label selector no longer
//! matches (SPEC §3): the watch drops such a release, yet its fence stays
//! this install's to settle, or a later delete of it (and of its namespace)
//! would hang. The watch tells when a fenced release leaves the selector (the
//! apiserver sends a label-selected watch a delete for an object that stops
//! matching), and that release is settled at once; at start and every fence
//! re-check interval the controller also lists them in its namespaces by the
//! fence's label, which names the install (a selector narrowed while it was
//! stopped, an event missed). Each is settled as the drain does: a live one loses the fence (and flux-plunger's
//! suspension, if it holds one), a deleted one goes through SPEC §5 until the
//! fence can go. Nothing is started there: the release is no longer this
//! install's to recover.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use kube::Client;
use plunger::error::Error;
use plunger::reconcile::{Outcome, Reconciler};
use plunger::release::api::list_own_fences_outside_selector;
use plunger::scope::Scope;
use tokio::sync::mpsc;

use crate::metrics::Metrics;

/// A fenced release the watch saw leave the label selector: `(namespace, name)`.
pub type LeftSelector = (String, String);

/// Settles this install's fences outside its label selector: each release
/// `left` names, and every one listed at start and every `every`, until
/// `shutdown` resolves. `reconciler` lets go of live releases
/// (`Reconciler::letting_go`). A scope without a label selector has nothing
/// outside it that the install could still reach.
pub async fn settle_fences_outside_selector(
    client: Client,
    reconciler: Reconciler,
    scope: Scope,
    metrics: Arc<Metrics>,
    every: Duration,
    mut left: mpsc::UnboundedReceiver<LeftSelector>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    if scope.label_selector.is_none() {
        return;
    }
    let mut shutdown = shutdown.boxed();
    let mut next_listing = tokio::time::Instant::now();
    loop {
        tokio::select! {
            () = &mut shutdown => return,
            () = tokio::time::sleep_until(next_listing) => {
                settle_listed(&client, &reconciler, &scope, &metrics).await;
                next_listing = tokio::time::Instant::now() + every;
            }
            Some((namespace, name)) = left.recv() => {
                let outcome = reconciler.settle(&namespace, &name).await;
                observe(&metrics, &format!("{namespace}/{name}"), outcome);
            }
        }
    }
}

async fn settle_listed(client: &Client, reconciler: &Reconciler, scope: &Scope, metrics: &Metrics) {
    let outside = match list_own_fences_outside_selector(client, scope, reconciler.install()).await
    {
        Ok(outside) => outside,
        Err(err) => {
            tracing::warn!(error = %err, "listing this install's fences outside its label selector failed; trying again at the next re-check");
            return;
        }
    };
    for release in outside {
        let outcome = reconciler.settle_as_listed(&release).await;
        observe(metrics, &release.key(), outcome);
    }
}

fn observe(metrics: &Metrics, key: &str, outcome: Result<Outcome, Error>) {
    match outcome {
        Ok(outcome) => {
            tracing::info!(release = %key, ?outcome, "settled a fence of this install's on a release outside its label selector");
            metrics.observe(&outcome);
        }
        Err(err) => {
            tracing::warn!(release = %key, error = %err, "settling a fence outside the label selector failed; trying again at the next re-check");
            metrics.observe_error(err.kind());
        }
    }
}
