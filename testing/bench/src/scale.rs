//! The drain and the pre-delete sweep with a cluster's worth of releases
//! around them: `RELEASES` realistic HelmReleases, `FENCES` of them carrying
//! flux-plunger's suspension and fence. What each asks of the apiserver
//! (requests, and the bytes of the answers) is counted by a fault proxy that
//! injects nothing, in one run of each; the time is the median of `RUNS`
//! runs straight to the apiserver.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Result;
use kube::Client;
use testkit::{FaultPlan, FaultProxy, TestNamespace};

use crate::objects::{create_releases, fence_releases};
use crate::{RUNS, kubeconfig, lead, median, run_sweep, signal_drain};

/// Releases in the cluster, fenced ones included.
pub const RELEASES: usize = 5000;
/// Releases carrying flux-plunger's suspension and fence.
pub const FENCES: usize = 200;

/// One process's figures.
#[derive(Debug, Clone, Copy)]
pub struct Figures {
    /// Median over the direct runs.
    pub took: Duration,
    /// Requests and answer bytes of the counted run.
    pub requests: u64,
    pub bytes: u64,
}

/// The drain's and the sweep's figures.
pub struct ScaleFigures {
    pub drain: Figures,
    pub sweep: Figures,
}

/// Sets up `RELEASES` realistic releases (`FENCES` of them in a namespace of
/// their own) and measures a drain and a sweep over them.
pub async fn bench_scale(admin: &Client) -> Result<ScaleFigures> {
    let others = TestNamespace::create(admin, "bench-scale").await?;
    let fenced = TestNamespace::create(admin, "bench-scale-fenced").await?;
    let started = Instant::now();
    create_releases(&others, 0..RELEASES - FENCES).await?;
    create_releases(&fenced, 0..FENCES).await?;
    eprintln!(
        "   created {RELEASES} releases in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    drain_and_sweep(&fenced).await
}

/// Measures a drain and a sweep over the `FENCES` releases of `fenced`,
/// whatever else the cluster holds.
pub async fn drain_and_sweep(fenced: &TestNamespace) -> Result<ScaleFigures> {
    let drain = measure(fenced, |kubeconfig| async move {
        lead(fenced, "pod-a").await?;
        signal_drain(fenced, "pod-a", &kubeconfig).await
    })
    .await?;
    let sweep = measure(fenced, |kubeconfig| async move {
        run_sweep(fenced, &kubeconfig).await
    })
    .await?;
    Ok(ScaleFigures { drain, sweep })
}

/// Fences every release of `ns`, then runs `once` `RUNS` times straight to
/// the apiserver and once through a counting proxy (the fences set again
/// before each run).
async fn measure<F, Fut>(ns: &TestNamespace, mut once: F) -> Result<Figures>
where
    F: FnMut(PathBuf) -> Fut,
    Fut: std::future::Future<Output = Result<Duration>>,
{
    let dir = tempfile::tempdir()?;
    let direct = kubeconfig(dir.path()).await?;
    let mut runs = Vec::new();
    for _ in 0..RUNS {
        fence_all(ns).await?;
        runs.push(once(direct.clone()).await?);
    }
    fence_all(ns).await?;
    let proxy = FaultProxy::in_front_of_control_plane(FaultPlan::none(0)).await?;
    let through = dir.path().join("through-proxy.kubeconfig");
    std::fs::write(&through, proxy.kubeconfig_yaml(&ns.name))?;
    once(through).await?;
    let counted = proxy.report();
    Ok(Figures {
        took: median(runs),
        requests: counted.total_requests(),
        bytes: counted.response_bytes,
    })
}

/// Sets flux-plunger's suspension and fence on every release of `ns`.
async fn fence_all(ns: &TestNamespace) -> Result<()> {
    fence_releases(ns, 0..FENCES).await
}
