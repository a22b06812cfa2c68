//! A burst of stuck releases: how long the controller takes to recover them
//! all, each one's latency, and what it asked of the apiserver per recovery.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use futures::StreamExt;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::runtime::watcher;
use testkit::audit::{self, AuditedRequest};
use testkit::{TestNamespace, is_recovered};

use crate::controller::{Controller, Identity};
use crate::objects::{create_reclaimable_storage, create_releases, mark_all_stuck, release_name};

pub struct BurstRun {
    /// From the first stuck status write to the last lift (audit log, the
    /// apiserver's clock).
    pub all_recovered: Duration,
    pub p50: Duration,
    pub p99: Duration,
    /// The controller's requests, without its Lease's, by label.
    pub by_label: BTreeMap<String, u64>,
    /// Its Lease's requests and watches in the same window: not per recovery.
    pub background: BTreeMap<String, u64>,
    /// The requests of one recovery, in order.
    pub sequence: Vec<String>,
}

fn since(later: Timestamp, earlier: Timestamp) -> Duration {
    let nanos = later.as_nanosecond() - earlier.as_nanosecond();
    Duration::from_nanos(u64::try_from(nanos).unwrap_or(0))
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    // Nearest rank.
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Whether `request` concerns release `name` (the release itself, its
/// storage Secrets, their listing, or an event about it).
pub(crate) fn concerns(request: &AuditedRequest, name: &str) -> bool {
    request.name == name
        || request.name.starts_with(&format!("{name}."))
        || request.name.contains(&format!(".{name}."))
        || request.request_uri.contains(&format!("name%3D{name}&"))
        || request.request_uri.ends_with(&format!("name%3D{name}"))
}

pub async fn bench_burst(
    admin: &Client,
    identity: &Identity,
    count: usize,
    concurrent: u16,
    run: usize,
) -> Result<BurstRun> {
    let ns = TestNamespace::create(admin, &format!("bench-burst-c{concurrent}")).await?;
    create_releases(&ns, 0..count).await?;
    create_reclaimable_storage(&ns, 0..count).await?;
    let ns = &ns;

    let lease = format!("bench-burst-{concurrent}-{run}");
    let mut controller = Controller::spawn(admin, identity, &ns.name, concurrent, &lease).await?;
    controller.wait_ready(Duration::from_secs(120)).await?;

    // The bench's own watch tells when every release is recovered.
    let (seen_tx, mut seen_rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    let (synced_tx, synced_rx) = tokio::sync::oneshot::channel::<()>();
    let api = ns.releases();
    let watch = tokio::spawn(async move {
        let mut synced = Some(synced_tx);
        let mut events = watcher(api, watcher::Config::default()).boxed();
        while let Some(event) = events.next().await {
            match event {
                Ok(watcher::Event::InitDone) => {
                    if let Some(tx) = synced.take() {
                        let _ = tx.send(());
                    }
                }
                Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o))
                    if is_recovered(&o, 2) =>
                {
                    let _ = seen_tx.send(o.metadata.name.unwrap_or_default());
                }
                _ => {}
            }
        }
    });
    synced_rx.await.context("the bench's watch ended")?;

    let offset = audit::mark();
    mark_all_stuck(ns, 0..count).await?;
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut done = std::collections::HashSet::new();
    while done.len() < count {
        match tokio::time::timeout_at(deadline.into(), seen_rx.recv()).await {
            Ok(Some(name)) => {
                done.insert(name);
            }
            Ok(None) => bail!("the bench's watch ended"),
            Err(_) => bail!("only {} of {count} releases recovered in time", done.len()),
        }
    }
    watch.abort();
    // Whatever the controller still does after the last lift belongs to the
    // recoveries too (a pass woken by its own writes).
    tokio::time::sleep(Duration::from_secs(3)).await;
    controller.stop().await?;

    let username = identity.username();
    let requests = audit::read_since(offset)?;
    let in_ns = |r: &&AuditedRequest| r.namespace.as_deref() == Some(ns.name.as_str());
    let stuck_writes: HashMap<&str, Timestamp> = requests
        .iter()
        .filter(in_ns)
        .filter(|r| r.user != username && r.resource() == "helmreleases/status")
        .map(|r| (r.name.as_str(), r.at))
        .collect();
    let ours: Vec<&AuditedRequest> = requests.iter().filter(|r| r.user == username).collect();
    let mut lifts: HashMap<&str, Timestamp> = HashMap::new();
    for r in ours
        .iter()
        .filter(|r| r.verb == "patch" && r.resource() == "helmreleases")
    {
        lifts.insert(r.name.as_str(), r.at); // the last write is the lift
    }
    let mut latencies: Vec<Duration> = stuck_writes
        .iter()
        .filter_map(|(name, stuck)| lifts.get(name).map(|lift| since(*lift, *stuck)))
        .collect();
    if latencies.len() != count {
        bail!(
            "the audit log shows {} stuck writes and {} lifts for {count} releases",
            stuck_writes.len(),
            lifts.len()
        );
    }
    latencies.sort();
    let first = stuck_writes
        .values()
        .min()
        .copied()
        .context("no stuck write")?;
    let last = lifts.values().max().copied().context("no lift")?;
    let (background, per_release): (Vec<&AuditedRequest>, Vec<&AuditedRequest>) = ours
        .iter()
        .partition(|r| r.resource() == "leases" || r.verb == "watch");
    let example = release_name(0);
    Ok(BurstRun {
        all_recovered: since(last, first),
        p50: percentile(&latencies, 50.0),
        p99: percentile(&latencies, 99.0),
        by_label: audit::count_by_label(per_release.iter().copied()),
        background: audit::count_by_label(background.iter().copied()),
        sequence: per_release
            .iter()
            .filter(|r| concerns(r, &example))
            .map(|r| format!("{} → {}", r.label(), r.code))
            .collect(),
    })
}
