//! The watch over HelmReleases and the kube-runtime Controller around
//! `plunger::reconcile` (SPEC §4 watch filter, retries, the fence timer).

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{FutureExt, StreamExt, TryStreamExt};
use kube::api::DynamicObject;
use kube::runtime::controller::{Action, Config as ControllerConfig, Controller};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use tokio::sync::mpsc;

use plunger::decide::is_of_interest;
use plunger::error::Error;
use plunger::reconcile::{Outcome, Pass, Reconciler};
use plunger::release::view::{ReleaseView, helmrelease_resource};
use plunger::scope::Scope;

use crate::metrics::Metrics;
use crate::outside::LeftSelector;
use crate::server::Readiness;
use crate::watched::Trimmed;

/// Shared by every reconcile.
pub struct Context {
    pub reconciler: Reconciler,
    pub metrics: Arc<Metrics>,
    /// Consecutive failures per release, for the retry backoff.
    failures: Mutex<HashMap<ObjectRef<DynamicObject>, u32>>,
    /// Releases a pass recovered or turned away, with the states it handled
    /// (`Pass::handled`): see [`reconcile`]. Kept for [`RECOVERED_MEMORY`]
    /// only, so that releases deleted without another event (no finalizer)
    /// do not stay here for the life of the process.
    recovered: Mutex<HashMap<ObjectRef<DynamicObject>, Handled>>,
}

/// The states of a release one pass wrote itself, and what a wake by one of
/// them comes to.
struct Handled {
    at: Instant,
    written: Vec<String>,
    /// `None` after a recovery (nothing is left to do); after a recovery
    /// turned away by the rate limit, its turn, when it is looked at again.
    turn: Option<Instant>,
}

impl Handled {
    /// A recovery's states are skipped while remembered; a turned-away
    /// release's only until its turn, when its pass must run.
    fn before_turn(&self) -> bool {
        self.turn.is_none_or(|turn| Instant::now() < turn)
    }

    /// What the controller does instead of a pass woken by one of these
    /// states: wait for a change, or for the release's turn.
    fn action(&self) -> Action {
        match self.turn {
            Some(turn) => Action::requeue(turn.saturating_duration_since(Instant::now())),
            None => Action::await_change(),
        }
    }
}

/// How long the resourceVersions of a recovery's own states are remembered:
/// their watch events arrive within seconds; after this a pass runs anyway
/// (and finds nothing to do, at the cost of a read and a listing).
const RECOVERED_MEMORY: Duration = Duration::from_secs(300);

impl Context {
    pub fn new(reconciler: Reconciler, metrics: Arc<Metrics>) -> Self {
        Self {
            reconciler,
            metrics,
            failures: Mutex::new(HashMap::new()),
            recovered: Mutex::new(HashMap::new()),
        }
    }
}

/// HelmReleases per page of the watch's listing (the drain's and the
/// sweep's listing: `plunger::release::api::LIST_PAGE_SIZE`).
const WATCH_PAGE_SIZE: u32 = 100;

/// Retry delays: 1 s doubling to 5 minutes.
pub fn backoff(failures: u32) -> Duration {
    const FIRST: Duration = Duration::from_secs(1);
    const MAX: Duration = Duration::from_secs(300);
    FIRST
        .checked_mul(2u32.saturating_pow(failures.saturating_sub(1)))
        .map_or(MAX, |d| d.min(MAX))
}

/// What the cache (and through it the queue) gets of a watch event: only the
/// releases the watch filter lets through (SPEC §4) are kept. A release that
/// stops being of interest is removed (its event becomes a delete), and one
/// that is of no interest when listed never enters. With thousands of healthy
/// releases the cache then holds a handful, however large the cluster; a
/// reconcile reads its release afresh anyway, and the fence and suspension
/// gauges count only releases of interest.
fn cached(event: watcher::Event<Trimmed>) -> Option<watcher::Event<DynamicObject>> {
    let of_interest = |o: &DynamicObject| is_of_interest(&ReleaseView::from_object(o));
    match event {
        watcher::Event::Apply(Trimmed(o)) if of_interest(&o) => Some(watcher::Event::Apply(o)),
        watcher::Event::Apply(Trimmed(o)) | watcher::Event::Delete(Trimmed(o)) => {
            Some(watcher::Event::Delete(o))
        }
        watcher::Event::InitApply(Trimmed(o)) => {
            of_interest(&o).then_some(watcher::Event::InitApply(o))
        }
        watcher::Event::Init => Some(watcher::Event::Init),
        watcher::Event::InitDone => Some(watcher::Event::InitDone),
    }
}

/// A label-selected watch is sent a delete for a release that stops matching
/// the selector; one still carrying the fence left the selector, not the
/// cluster (a finalizer keeps a deleted release until it goes), and its fence
/// is settled outside the watch (`crate::outside`).
fn note_fence_leaving(event: &watcher::Event<Trimmed>, left: &mpsc::UnboundedSender<LeftSelector>) {
    if let watcher::Event::Delete(Trimmed(object)) = event
        && ReleaseView::from_object(object).has_fence()
    {
        let _ = left.send((object.namespace().unwrap_or_default(), object.name_any()));
    }
}

/// Counts the fenced releases of a watch's first listing, once it is done
/// (`listed` is `None` from then on: a relist after a watch error is not
/// counted again). `run` starts once this process leads and reconciles
/// nothing before the listing is done, so each of them was set before: left
/// by the previous leader's drain, or by a crash.
fn note_inherited_fences(
    event: &watcher::Event<Trimmed>,
    listed: &mut Option<u64>,
    metrics: &Metrics,
) {
    let Some(fences) = listed else { return };
    match event {
        watcher::Event::InitApply(Trimmed(object))
            if ReleaseView::from_object(object).has_fence() =>
        {
            *fences += 1;
        }
        watcher::Event::InitDone => {
            metrics.observe_inherited_fences(*fences);
            *listed = None;
        }
        _ => {}
    }
}

async fn reconcile(object: Arc<DynamicObject>, ctx: Arc<Context>) -> Result<Action, Error> {
    let namespace = object.namespace().unwrap_or_default();
    let name = object.name_any();
    let key = ObjectRef::from_obj_with(object.as_ref(), helmrelease_resource());
    // A recovery's own writes (acquire, annotation, lift) each come back as a
    // watch event and wake the release once more. While the watch shows the
    // release in a state the recovery wrote (same resourceVersion: nobody
    // else wrote since), that pass would read it, list its storage and find
    // nothing to do (the processed guard); skip those two requests. So too
    // for the fence a release turned away by the rate limit gets: that pass
    // would be turned away again; it is looked at at its turn. Another
    // writer's change has a new resourceVersion and is reconciled as ever.
    {
        let mut recovered = ctx.recovered.lock().expect("recovered map poisoned");
        if let Some(handled) = recovered.get(&key) {
            if handled.at.elapsed() < RECOVERED_MEMORY
                && handled.before_turn()
                && object
                    .resource_version()
                    .is_some_and(|rv| handled.written.contains(&rv))
            {
                tracing::debug!(release = %format!("{namespace}/{name}"), resource_version = %object.resource_version().unwrap_or_default(), "unchanged since its own pass wrote it");
                return Ok(handled.action());
            }
            recovered.remove(&key);
        }
    }
    let started = Instant::now();
    let result = ctx.reconciler.pass(&namespace, &name).await;
    ctx.metrics
        .reconcile_duration
        .observe(started.elapsed().as_secs_f64());
    let Pass { outcome, handled } = result?;
    let turn = match outcome {
        Outcome::Recovered { .. } => Some(None),
        Outcome::RateLimited { retry_after } => Some(Some(Instant::now() + retry_after)),
        _ => None,
    };
    if let Some(turn) = turn
        && !handled.is_empty()
    {
        let mut recovered = ctx.recovered.lock().expect("recovered map poisoned");
        recovered.retain(|_, h| h.at.elapsed() < RECOVERED_MEMORY);
        recovered.insert(
            key.clone(),
            Handled {
                at: Instant::now(),
                written: handled,
                turn,
            },
        );
    }
    ctx.failures
        .lock()
        .expect("failure map poisoned")
        .remove(&key);
    ctx.metrics.observe(&outcome);
    tracing::debug!(release = %format!("{namespace}/{name}"), ?outcome, "reconciled");
    Ok(match outcome.recheck_after() {
        Some(after) => Action::requeue(after),
        None => Action::await_change(),
    })
}

fn error_policy(object: Arc<DynamicObject>, error: &Error, ctx: Arc<Context>) -> Action {
    let key = ObjectRef::from_obj_with(object.as_ref(), helmrelease_resource());
    let failures = {
        let mut map = ctx.failures.lock().expect("failure map poisoned");
        let count = map.entry(key).or_insert(0);
        *count = count.saturating_add(1);
        *count
    };
    let kind = if error.is_stale_write() {
        "conflict"
    } else {
        error.kind()
    };
    ctx.metrics.observe_error(kind);
    let delay = backoff(failures);
    if error.is_stale_write() {
        tracing::info!(error = %error, retry_in = ?delay, "a write raced another writer; reading again");
    } else {
        tracing::warn!(error = %error, retry_in = ?delay, "reconcile failed");
    }
    Action::requeue(delay)
}

/// Counts fences and suspensions in the watch caches, for the gauges.
pub fn refresh_gauges(stores: &[Store<DynamicObject>], metrics: &Metrics) {
    let (mut fences, mut suspensions) = (0i64, 0i64);
    for object in stores.iter().flat_map(Store::state) {
        let view = ReleaseView::from_object(&object);
        fences += i64::from(view.has_fence());
        suspensions += i64::from(view.suspended_by_us());
    }
    metrics.fences_held.set(fences);
    metrics.suspensions_held.set(suspensions);
}

/// The watch's listing pages: smaller than the default 500, as each page is
/// read whole before it is decoded, so the page bounds the memory peak.
fn watcher_config(scope: &Scope) -> watcher::Config {
    let config = watcher::Config::default().page_size(WATCH_PAGE_SIZE);
    match &scope.label_selector {
        Some(selector) => config.labels(selector),
        None => config,
    }
}

/// What the watch tells the rest of the process.
pub struct WatchReports {
    /// Set ready once every watch has synced.
    pub readiness: Readiness,
    /// Every fenced release that left the label selector (`crate::outside`).
    pub left_selector: mpsc::UnboundedSender<LeftSelector>,
    /// The watch caches, for the gauges.
    pub stores: tokio::sync::oneshot::Sender<Vec<Store<DynamicObject>>>,
}

/// Watches the HelmReleases in `scope` and reconciles those of interest
/// until `shutdown` resolves; in-flight reconciles are then allowed to finish.
/// One Controller per watched namespace (one for all when unscoped), sharing
/// the reconcile context.
pub async fn run(
    client: Client,
    ctx: Arc<Context>,
    scope: Scope,
    concurrency: u16,
    reports: WatchReports,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let WatchReports {
        readiness,
        left_selector,
        stores: stores_out,
    } = reports;
    let resource = helmrelease_resource();
    let shutdown = shutdown.boxed().shared();
    let mut stores = Vec::new();
    let mut controllers = Vec::new();
    for api in scope.apis::<Trimmed>(&client) {
        let writer = reflector::store::Writer::new(resource.clone());
        let store = writer.as_reader();
        stores.push(store.clone());
        // Decoded straight into the trimmed form (see `watched`); only the
        // releases of interest reach the cache and the queue.
        let left = left_selector.clone();
        let metrics = ctx.metrics.clone();
        let mut listed = Some(0);
        let stream = watcher(api, watcher_config(&scope))
            .inspect_ok(move |event| {
                note_inherited_fences(event, &mut listed, &metrics);
                note_fence_leaving(event, &left);
            })
            .try_filter_map(|event| std::future::ready(Ok(cached(event))))
            .default_backoff()
            .reflect(writer)
            .applied_objects();
        let controller = Controller::for_stream_with(stream, store, resource.clone())
            .with_config(ControllerConfig::default().concurrency(concurrency))
            .graceful_shutdown_on(shutdown.clone())
            .run(reconcile, error_policy, ctx.clone())
            .for_each(|result| async move {
                if let Err(err) = result {
                    tracing::debug!(error = %err, "controller event");
                }
            });
        controllers.push(controller);
    }
    let _ = stores_out.send(stores.clone());
    // Polled, not awaited: a store's readiness is a oneshot that wakes only
    // its last waiter, and its Controller waits on it too.
    tokio::spawn(async move {
        loop {
            let ready = stores
                .iter()
                .all(|s| matches!(s.wait_until_ready().now_or_never(), Some(Ok(()))));
            if ready {
                tracing::info!("the HelmRelease watch has synced");
                readiness.set_ready();
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    futures::future::join_all(controllers).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use plunger::names::FENCE_FINALIZER;
    use serde_json::json;

    #[test]
    fn retries_back_off_from_one_second_to_five_minutes() {
        assert_eq!(backoff(1), Duration::from_secs(1));
        assert_eq!(backoff(2), Duration::from_secs(2));
        assert_eq!(backoff(4), Duration::from_secs(8));
        assert_eq!(backoff(9), Duration::from_secs(256));
        assert_eq!(backoff(10), Duration::from_secs(300));
        assert_eq!(backoff(u32::MAX), Duration::from_secs(300));
    }

    fn watched(value: serde_json::Value) -> Trimmed {
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn the_fences_of_the_first_listing_are_counted_once() {
        let release = |name: &str, fenced: bool| {
            let finalizers = if fenced {
                vec![FENCE_FINALIZER]
            } else {
                vec![]
            };
            watched(json!({"metadata": {"name": name, "namespace": "apps",
                "finalizers": finalizers}, "spec": {}}))
        };
        let metrics = Metrics::default();
        let mut listed = Some(0);
        let mut note = |event| note_inherited_fences(&event, &mut listed, &metrics);
        note(watcher::Event::Init);
        note(watcher::Event::InitApply(release("a", true)));
        note(watcher::Event::InitApply(release("b", false)));
        note(watcher::Event::InitApply(release("c", true)));
        note(watcher::Event::InitDone);
        // After the listing: this process's own fences, and a relist.
        note(watcher::Event::Apply(release("d", true)));
        note(watcher::Event::Init);
        note(watcher::Event::InitApply(release("a", true)));
        note(watcher::Event::InitDone);
        assert_eq!(metrics.fences_inherited.get(), 2);
    }

    #[test]
    fn the_cache_holds_only_releases_of_interest() {
        let healthy = json!({"metadata": {"name": "ok", "namespace": "apps"}, "spec": {}});
        let fenced = json!({"metadata": {"name": "held", "namespace": "apps",
            "finalizers": [FENCE_FINALIZER]}, "spec": {}});
        let name = |event: &watcher::Event<DynamicObject>| match event {
            watcher::Event::Apply(o) | watcher::Event::InitApply(o) | watcher::Event::Delete(o) => {
                o.metadata.name.clone()
            }
            _ => None,
        };

        let kept = cached(watcher::Event::Apply(watched(fenced.clone()))).unwrap();
        assert!(matches!(kept, watcher::Event::Apply(_)));
        assert_eq!(name(&kept).as_deref(), Some("held"));
        // No longer of interest: taken out of the cache, never queued.
        let evicted = cached(watcher::Event::Apply(watched(healthy.clone()))).unwrap();
        assert!(matches!(evicted, watcher::Event::Delete(_)));
        assert_eq!(name(&evicted).as_deref(), Some("ok"));
        assert!(cached(watcher::Event::InitApply(watched(healthy))).is_none());
        assert!(matches!(
            cached(watcher::Event::InitApply(watched(fenced))),
            Some(watcher::Event::InitApply(_))
        ));
        assert!(matches!(
            cached(watcher::Event::InitDone),
            Some(watcher::Event::InitDone)
        ));
    }
}
