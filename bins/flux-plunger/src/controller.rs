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
use serde_json::{Map, Value};

use plunger::decide::is_of_interest;
use plunger::error::Error;
use plunger::names::{
    FENCE_FINALIZER, FIELD_MANAGER, PROCESSED_VERSION_ANNOTATION, READY_CONDITION,
};
use plunger::reconcile::{Outcome, Reconciler};
use plunger::release::view::{ReleaseView, helmrelease_resource};
use plunger::scope::Scope;

use crate::metrics::Metrics;
use crate::server::Readiness;
use crate::watched::Trimmed;

/// Shared by every reconcile.
pub struct Context {
    pub reconciler: Reconciler,
    pub metrics: Arc<Metrics>,
    /// Consecutive failures per release, for the retry backoff.
    failures: Mutex<HashMap<ObjectRef<DynamicObject>, u32>>,
    /// Releases a pass recovered, with when and the resourceVersions its
    /// writes left them at: see [`reconcile`]. Kept for
    /// [`RECOVERED_MEMORY`] only, so that releases deleted without another
    /// event (no finalizer) do not stay here for the life of the process.
    recovered: Mutex<HashMap<ObjectRef<DynamicObject>, OwnWrites>>,
}

/// When a recovery ended, and the resourceVersions its writes left.
type OwnWrites = (Instant, Vec<String>);

/// How long the resourceVersions of a recovery's own writes are remembered:
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

/// Keeps only what the watch filter and the metrics read: the cache then
/// costs a few hundred bytes a release instead of its whole spec, status and
/// managedFields. Every decision that leads to a write reads the release
/// afresh from the apiserver, so nothing is lost.
///
/// What the filter reads is kept only where it says yes: the `Ready`
/// condition only of a stuck release, `spec.suspend` only when true, of the
/// finalizers only our fence. A healthy release then holds no JSON map at
/// all (each costs a B-tree node of some 600 bytes), which is most of the
/// cache with thousands of releases.
pub fn trim(object: &mut DynamicObject) {
    object.types = None;
    let meta = &mut object.metadata;
    meta.labels = None;
    meta.owner_references = None;
    if let Some(annotations) = meta.annotations.as_mut() {
        annotations.retain(|k, _| k == PROCESSED_VERSION_ANNOTATION);
    }
    if let Some(entries) = meta.managed_fields.as_mut() {
        entries.retain(|e| e.manager.as_deref() == Some(FIELD_MANAGER));
    }
    if let Some(finalizers) = meta.finalizers.as_mut() {
        finalizers.retain(|f| f == FENCE_FINALIZER);
    }
    let stuck = ReleaseView::from_object(object).is_stuck();
    let mut data = Map::new();
    if object.data.pointer("/spec/suspend") == Some(&Value::Bool(true)) {
        data.insert("spec".into(), serde_json::json!({ "suspend": true }));
    }
    let ready = object
        .data
        .pointer("/status/conditions")
        .and_then(Value::as_array)
        .and_then(|conditions| {
            conditions
                .iter()
                .find(|c| c.get("type").and_then(Value::as_str) == Some(READY_CONDITION))
        });
    if let Some(ready) = ready.filter(|_| stuck) {
        let keep: Map<String, Value> = ["type", "status", "message"]
            .iter()
            .filter_map(|k| ready.get(*k).map(|v| ((*k).to_owned(), v.clone())))
            .collect();
        data.insert("status".into(), serde_json::json!({ "conditions": [keep] }));
    }
    object.data = Value::Object(data);
}

async fn reconcile(object: Arc<DynamicObject>, ctx: Arc<Context>) -> Result<Action, Error> {
    let namespace = object.namespace().unwrap_or_default();
    let name = object.name_any();
    let key = ObjectRef::from_obj_with(object.as_ref(), helmrelease_resource());
    // A recovery's own writes (acquire, annotation, lift) each come back as a
    // watch event and wake the release once more. While the watch shows the
    // release in a state the recovery wrote (same resourceVersion: nobody
    // else wrote since), that pass would read it, list its storage and find
    // nothing to do (the processed guard); skip those two requests. Another
    // writer's change has a new resourceVersion and is reconciled as ever.
    {
        let mut recovered = ctx.recovered.lock().expect("recovered map poisoned");
        if let Some((at, written)) = recovered.get(&key) {
            if at.elapsed() < RECOVERED_MEMORY
                && object
                    .resource_version()
                    .is_some_and(|rv| written.contains(&rv))
            {
                tracing::debug!(release = %format!("{namespace}/{name}"), "unchanged since its recovery");
                return Ok(Action::await_change());
            }
            recovered.remove(&key);
        }
    }
    let uid = object.uid().unwrap_or_default();
    // Only this pass's writes count (a failed pass may have left some).
    ctx.reconciler.take_writes(&uid);
    let started = Instant::now();
    let result = ctx.reconciler.reconcile(&namespace, &name).await;
    ctx.metrics
        .reconcile_duration
        .observe(started.elapsed().as_secs_f64());
    let outcome = result?;
    let written = ctx.reconciler.take_writes(&uid);
    if matches!(outcome, Outcome::Recovered { .. }) && !written.is_empty() {
        let mut recovered = ctx.recovered.lock().expect("recovered map poisoned");
        recovered.retain(|_, (at, _)| at.elapsed() < RECOVERED_MEMORY);
        recovered.insert(key.clone(), (Instant::now(), written));
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

/// Watches the HelmReleases in `scope` and reconciles those of interest
/// until `shutdown` resolves; in-flight reconciles are then allowed to finish.
/// One Controller per watched namespace (one for all when unscoped), sharing
/// the reconcile context.
pub async fn run(
    client: Client,
    ctx: Arc<Context>,
    scope: Scope,
    concurrency: u16,
    readiness: Readiness,
    stores_out: tokio::sync::oneshot::Sender<Vec<Store<DynamicObject>>>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let resource = helmrelease_resource();
    let shutdown = shutdown.boxed().shared();
    let mut stores = Vec::new();
    let mut controllers = Vec::new();
    for api in scope.apis::<Trimmed>(&client) {
        let writer = reflector::store::Writer::new(resource.clone());
        let store = writer.as_reader();
        stores.push(store.clone());
        // Decoded straight into the trimmed form (see `watched`).
        let stream = watcher(api, watcher_config(&scope))
            .map_ok(|event| match event {
                watcher::Event::Apply(Trimmed(o)) => watcher::Event::Apply(o),
                watcher::Event::Delete(Trimmed(o)) => watcher::Event::Delete(o),
                watcher::Event::Init => watcher::Event::Init,
                watcher::Event::InitApply(Trimmed(o)) => watcher::Event::InitApply(o),
                watcher::Event::InitDone => watcher::Event::InitDone,
            })
            .default_backoff()
            .reflect(writer)
            .applied_objects()
            .try_filter(|object| {
                std::future::ready(is_of_interest(&ReleaseView::from_object(object)))
            });
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

    #[test]
    fn the_trimmed_cache_keeps_exactly_what_the_watch_filter_reads() {
        let full: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "helm.toolkit.fluxcd.io/v2", "kind": "HelmRelease",
            "metadata": {
                "name": "web", "namespace": "apps", "uid": "u", "resourceVersion": "3",
                "labels": {"a": "b"},
                "annotations": {PROCESSED_VERSION_ANNOTATION: "4", "other": "x"},
                "finalizers": ["finalizers.fluxcd.io", "flux-plunger.cozystack.io/uninstall-fence"],
                "managedFields": [
                    {"manager": "flux-plunger", "operation": "Apply", "fieldsType": "FieldsV1", "fieldsV1": {"f:spec": {"f:suspend": {}}}},
                    {"manager": "helm-controller", "operation": "Update", "fieldsType": "FieldsV1", "fieldsV1": {"f:status": {}}},
                ],
            },
            "spec": {"suspend": true, "interval": "5m", "values": {"big": "x".repeat(1000)}},
            "status": {"conditions": [
                {"type": "Released", "status": "False", "message": "m", "reason": "r", "lastTransitionTime": "2026-01-01T00:00:00Z"},
                {"type": "Ready", "status": "False", "message": "x has no deployed releases", "reason": "r", "lastTransitionTime": "2026-01-01T00:00:00Z"},
            ], "history": [{"name": "web"}]},
        }))
        .unwrap();
        let before = ReleaseView::from_object(&full);
        let mut trimmed = full.clone();
        trim(&mut trimmed);
        let after = ReleaseView::from_object(&trimmed);

        assert_eq!(is_of_interest(&before), is_of_interest(&after));
        assert_eq!(before.is_stuck(), after.is_stuck());
        assert_eq!(before.suspended_by_us(), after.suspended_by_us());
        assert_eq!(before.has_fence(), after.has_fence());
        assert_eq!(
            before.carries_processed_annotation(),
            after.carries_processed_annotation()
        );
        assert_eq!(
            trimmed.data,
            json!({"spec": {"suspend": true}, "status": {"conditions": [
                {"type": "Ready", "status": "False", "message": "x has no deployed releases"}]}})
        );
        assert_eq!(trimmed.metadata.labels, None);
        assert_eq!(
            trimmed.metadata.managed_fields.as_ref().map(Vec::len),
            Some(1)
        );
        assert!(
            serde_json::to_vec(&trimmed).unwrap().len() * 3
                < serde_json::to_vec(&full).unwrap().len()
        );
        assert_eq!(
            trimmed.metadata.finalizers,
            Some(vec!["flux-plunger.cozystack.io/uninstall-fence".to_owned()])
        );
    }

    #[test]
    fn a_healthy_release_keeps_no_json_at_all() {
        let mut healthy: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "helm.toolkit.fluxcd.io/v2", "kind": "HelmRelease",
            "metadata": {"name": "web", "namespace": "apps", "finalizers": ["finalizers.fluxcd.io"]},
            "spec": {"suspend": false, "interval": "5m"},
            "status": {"conditions": [
                {"type": "Ready", "status": "True", "message": "Helm upgrade succeeded", "reason": "r", "lastTransitionTime": "2026-01-01T00:00:00Z"},
            ]},
        }))
        .unwrap();
        let before = ReleaseView::from_object(&healthy);
        trim(&mut healthy);
        let after = ReleaseView::from_object(&healthy);
        assert_eq!(healthy.data, json!({}));
        assert_eq!(healthy.metadata.finalizers, Some(vec![]));
        assert_eq!(is_of_interest(&before), is_of_interest(&after));
        assert_eq!(before.suspend, after.suspend);
        assert_eq!(before.has_fence(), after.has_fence());
    }
}
