//! The controller's memory and start-up with many watched releases, and its
//! requests to the apiserver while there is nothing to do.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Result;
use kube::Client;
use testkit::TestNamespace;

use crate::controller::{Controller, Identity};
use crate::{RUNS, median};
use testkit::audit;

/// How long after the sync the memory is read: long enough for the
/// allocator to have settled after the initial listing.
const SETTLE: Duration = Duration::from_secs(10);

pub struct MemoryFigures {
    /// Median over the runs.
    pub ready: Duration,
    pub peak_kib: u64,
    pub steady_kib: u64,
}

pub struct IdleFigures {
    pub releases: usize,
    pub window: Duration,
    pub per_minute: f64,
    pub by_label: BTreeMap<String, u64>,
    /// Resident memory at the end of the idle window.
    pub rss_after_kib: u64,
}

/// Starts the controller `RUNS` times over `count` realistic releases: time
/// to ready, then peak and resident memory `SETTLE` after the sync. With
/// `idle`, the last run also counts the controller's requests over that
/// window.
/// `ns` holds `have` of them already (counts grow from one call to the next).
pub async fn bench_memory(
    admin: &Client,
    identity: &Identity,
    ns: &TestNamespace,
    have: usize,
    count: usize,
    idle: Option<Duration>,
) -> Result<(MemoryFigures, Option<IdleFigures>)> {
    let started = std::time::Instant::now();
    crate::objects::create_releases(ns, have..count).await?;
    if count > have {
        eprintln!(
            "   created {} releases in {:.1}s",
            count - have,
            started.elapsed().as_secs_f64()
        );
    }
    let (mut ready, mut peak, mut steady) = (Vec::new(), Vec::new(), Vec::new());
    let mut idle_figures = None;
    for run in 0..RUNS {
        let lease = format!("bench-memory-{count}-{run}");
        let mut controller = Controller::spawn(admin, identity, &ns.name, 4, &lease).await?;
        ready.push(controller.wait_ready(Duration::from_secs(300)).await?);
        tokio::time::sleep(SETTLE).await;
        let memory = controller.memory()?;
        peak.push(memory.peak_kib);
        steady.push(memory.rss_kib);
        if let Some(window) = idle
            && run + 1 == RUNS
        {
            let offset = audit::mark();
            tokio::time::sleep(window).await;
            let username = identity.username();
            let requests: Vec<_> = audit::read_since(offset)?
                .into_iter()
                .filter(|r| r.user == username)
                .collect();
            idle_figures = Some(IdleFigures {
                releases: count,
                window,
                per_minute: requests.len() as f64 * 60.0 / window.as_secs_f64(),
                by_label: audit::count_by_label(&requests),
                rss_after_kib: controller.memory()?.rss_kib,
            });
        }
        controller.stop().await?;
    }
    Ok((
        MemoryFigures {
            ready: median(ready),
            peak_kib: median(peak),
            steady_kib: median(steady),
        },
        idle_figures,
    ))
}
