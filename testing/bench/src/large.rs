//! 50,000 realistic releases: the controller's steady memory, its time from
//! start to synced and its requests while idle, with the releases in one
//! namespace and spread over 500; then a drain and a sweep among all of them
//! (`FENCES` fenced in a namespace of their own). With
//! `FLUX_PLUNGER_BENCH_COMPARE` naming a directory of another build's
//! release binaries, its controller is measured on the same releases too.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Result;
use futures::{StreamExt, stream};
use kube::Client;
use testkit::{TestNamespace, audit};

use crate::controller::{Controller, Identity, Watch};
use crate::objects::{SETUP_CONCURRENCY, create_labelled_releases, create_releases};
use crate::scale::{self, ScaleFigures};
use crate::{RUNS, median, release_binary};

/// Releases in each layout.
pub const RELEASES: usize = 50_000;
/// Namespaces the spread layout uses.
pub const NAMESPACES: usize = 500;
/// The label that selects the spread layout's releases.
const SPREAD_LABEL: (&str, &str) = ("bench.flux-plunger.io/layout", "spread");
/// How long after the sync the memory is read.
const SETTLE: Duration = Duration::from_secs(10);
/// The idle window, on the last run of each layout.
const IDLE: Duration = Duration::from_secs(60);

/// One controller build over one layout.
pub struct LayoutFigures {
    pub layout: &'static str,
    pub build: String,
    pub ready: Duration,
    pub peak_kib: u64,
    pub steady_kib: u64,
    pub idle_per_minute: f64,
}

pub struct LargeFigures {
    pub layouts: Vec<LayoutFigures>,
    /// The drain and the sweep, among `cluster_releases` releases.
    pub among: ScaleFigures,
    pub cluster_releases: usize,
}

/// The controller builds to measure: this workspace's, and the one
/// `FLUX_PLUNGER_BENCH_COMPARE` names.
fn builds() -> Result<Vec<(String, PathBuf)>> {
    let mut builds = vec![("now".to_owned(), release_binary("flux-plunger")?)];
    if let Some(dir) = std::env::var_os("FLUX_PLUNGER_BENCH_COMPARE") {
        let dir = PathBuf::from(dir);
        builds.push((dir.display().to_string(), dir.join("flux-plunger")));
    }
    Ok(builds)
}

pub async fn bench_large(admin: &Client, identity: &Identity) -> Result<LargeFigures> {
    let builds = builds()?;
    let mut layouts = Vec::new();

    let one = TestNamespace::create(admin, "bench-large").await?;
    let started = Instant::now();
    create_releases(&one, 0..RELEASES).await?;
    eprintln!(
        "   created {RELEASES} releases in one namespace in {:.0}s",
        started.elapsed().as_secs_f64()
    );
    for (build, binary) in &builds {
        eprintln!("   controller ({build}) over {RELEASES} releases in one namespace");
        let figures = measure(admin, identity, binary, Watch::Namespace(&one.name)).await?;
        layouts.push(LayoutFigures {
            layout: "one namespace",
            build: build.clone(),
            ..figures
        });
    }

    let started = Instant::now();
    let per_namespace = RELEASES / NAMESPACES;
    stream::iter(0..NAMESPACES)
        .map(|_| async move {
            let ns = TestNamespace::create(admin, "bench-spread").await?;
            create_labelled_releases(&ns, 0..per_namespace, Some(SPREAD_LABEL)).await
        })
        .buffer_unordered(SETUP_CONCURRENCY / 8)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<()>>()?;
    eprintln!(
        "   created {RELEASES} releases in {NAMESPACES} namespaces in {:.0}s",
        started.elapsed().as_secs_f64()
    );
    let selector = format!("{}={}", SPREAD_LABEL.0, SPREAD_LABEL.1);
    for (build, binary) in &builds {
        eprintln!("   controller ({build}) over {RELEASES} releases in {NAMESPACES} namespaces");
        let watch = Watch::Selected {
            selector: &selector,
            lease_namespace: &identity.namespace,
        };
        let figures = measure(admin, identity, binary, watch).await?;
        layouts.push(LayoutFigures {
            layout: "500 namespaces",
            build: build.clone(),
            ..figures
        });
    }

    let fenced = TestNamespace::create(admin, "bench-large-fenced").await?;
    create_releases(&fenced, 0..scale::FENCES).await?;
    let cluster_releases = count_releases(admin).await?;
    eprintln!(
        "   drain and sweep of {} fences among {cluster_releases} releases",
        scale::FENCES
    );
    let among = scale::drain_and_sweep(&fenced).await?;
    Ok(LargeFigures {
        layouts,
        among,
        cluster_releases,
    })
}

/// Every HelmRelease of the cluster, counted from a metadata listing.
async fn count_releases(admin: &Client) -> Result<usize> {
    let api: kube::Api<kube::api::DynamicObject> = kube::Api::all_with(
        admin.clone(),
        &plunger::release::view::helmrelease_resource(),
    );
    let mut params = kube::api::ListParams::default().limit(5000);
    let mut count = 0;
    loop {
        let page = api.list_metadata(&params).await?;
        count += page.items.len();
        match page.metadata.continue_ {
            Some(token) if !token.is_empty() => params = params.continue_token(&token),
            _ => return Ok(count),
        }
    }
}

/// `RUNS` starts of `binary` watching `watch`: time to ready, peak and
/// steady memory `SETTLE` after the sync; the last run also counts its
/// requests over `IDLE`.
async fn measure(
    admin: &Client,
    identity: &Identity,
    binary: &std::path::Path,
    watch: Watch<'_>,
) -> Result<LayoutFigures> {
    let (mut ready, mut peak, mut steady) = (Vec::new(), Vec::new(), Vec::new());
    let mut idle_per_minute = 0.0;
    for run in 0..RUNS {
        let dir = tempfile::tempdir()?;
        let kubeconfig = identity.kubeconfig(admin, dir.path()).await?;
        let lease = format!("bench-large-{run}");
        let mut controller =
            Controller::spawn_watching(binary, dir, &kubeconfig, watch, 4, &lease)?;
        ready.push(controller.wait_ready(Duration::from_secs(600)).await?);
        tokio::time::sleep(SETTLE).await;
        let memory = controller.memory()?;
        peak.push(memory.peak_kib);
        steady.push(memory.rss_kib);
        if run + 1 == RUNS {
            let offset = audit::mark();
            tokio::time::sleep(IDLE).await;
            let username = identity.username();
            let requests = audit::read_since(offset)?
                .into_iter()
                .filter(|r| r.user == username)
                .count();
            idle_per_minute = requests as f64 * 60.0 / IDLE.as_secs_f64();
        }
        controller.stop().await?;
    }
    Ok(LayoutFigures {
        layout: "",
        build: String::new(),
        ready: median(ready),
        peak_kib: median(peak),
        steady_kib: median(steady),
        idle_per_minute,
    })
}
