//! `make bench`: figures, never assertions. Runs the release binaries against
//! the local control plane and prints a Markdown table (and JSON under
//! `_out/bench/`):
//!
//! - the drain: time from SIGTERM to exit with 100 and 500 fenced releases;
//! - the handover: time from the end of the first pod's drain to the second
//!   pod's first write, after a clean stop with 0 and 200 fences;
//! - the sweep (pre-delete hook): time for 500 fenced releases.
#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use futures::{StreamExt, stream};
use kube::api::{Patch, PatchParams};
use plunger::lease::{Attempt, LeaseLock};
use plunger::names::{FENCE_FINALIZER, FIELD_MANAGER, HELMRELEASE_API_VERSION, HELMRELEASE_KIND};
use serde_json::json;
use testkit::control_plane::AuthInfo;
use testkit::{TestNamespace, control_plane};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

const RUNS: usize = 3;

fn release_binary(name: &str) -> Result<PathBuf> {
    let path = testkit::control_plane::workspace_root()
        .join("target/release")
        .join(name);
    if !path.is_file() {
        bail!(
            "{} is missing: make bench builds it (cargo build --release)",
            path.display()
        );
    }
    Ok(path)
}

/// `count` live releases carrying our suspension and fence, as a stop in
/// the middle of many recoveries would leave them.
async fn fenced_releases(ns: &TestNamespace, count: usize) -> Result<()> {
    stream::iter(0..count)
        .map(|i| async move {
            let name = format!("r{i:04}");
            ns.create_release(&name, json!({})).await?;
            let body = json!({"apiVersion": HELMRELEASE_API_VERSION, "kind": HELMRELEASE_KIND,
                "metadata": {"name": name, "finalizers": [FENCE_FINALIZER]}, "spec": {"suspend": true}});
            ns.releases()
                .patch(&name, &PatchParams::apply(FIELD_MANAGER), &Patch::Apply(body))
                .await?;
            anyhow::Ok(())
        })
        .buffer_unordered(16)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect()
}

async fn kubeconfig(dir: &Path) -> Result<PathBuf> {
    let path = dir.join("kubeconfig");
    control_plane().write_kubeconfig(&path, &AuthInfo::AdminCertificate)?;
    Ok(path)
}

/// Starts a drain sidecar for `pod`, waits until it idles, SIGTERMs it and
/// returns how long it took to exit.
async fn drain_once(ns: &TestNamespace, pod: &str, dir: &Path) -> Result<Duration> {
    let kubeconfig = kubeconfig(dir).await?;
    let mut child = Command::new(release_binary("flux-plunger-drain")?)
        .arg(format!("--kubeconfig={}", kubeconfig.display()))
        .arg("--log-encoding=console")
        .env("POD_NAME", pod)
        .env("POD_NAMESPACE", &ns.name)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let mut lines = BufReader::new(child.stderr.take().context("stderr")?).lines();
    while let Some(line) = lines.next_line().await? {
        if line.contains("idle until SIGTERM") {
            break;
        }
    }
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    let started = Instant::now();
    std::process::Command::new("kill")
        .args(["-TERM", &child.id().context("pid")?.to_string()])
        .status()?;
    child.wait().await?;
    Ok(started.elapsed())
}

async fn lead(ns: &TestNamespace, pod: &str) -> Result<()> {
    let mut lock = LeaseLock::new(
        ns.client.clone(),
        &ns.name,
        "flux-plunger",
        pod,
        Duration::from_secs(27),
    );
    if lock.try_acquire_or_renew().await? != Attempt::Held {
        bail!("could not take the Lease for {pod}");
    }
    Ok(())
}

fn median(mut values: Vec<Duration>) -> Duration {
    values.sort();
    values[values.len() / 2]
}

async fn bench_drain(count: usize) -> Result<Duration> {
    let client = control_plane().client().await?;
    let mut runs = Vec::new();
    for _ in 0..RUNS {
        let ns = TestNamespace::create(&client, "bench-drain").await?;
        fenced_releases(&ns, count).await?;
        lead(&ns, "pod-a").await?;
        let dir = tempfile::tempdir()?;
        runs.push(drain_once(&ns, "pod-a", dir.path()).await?);
    }
    Ok(median(runs))
}

/// From the first pod's drain exit to the second pod becoming the leader
/// (read from its log), after a clean stop with `count` fences.
async fn bench_handover(count: usize) -> Result<Duration> {
    let client = control_plane().client().await?;
    let mut runs = Vec::new();
    for _ in 0..RUNS {
        let ns = TestNamespace::create(&client, "bench-handover").await?;
        fenced_releases(&ns, count).await?;
        lead(&ns, "pod-a").await?;
        let dir = tempfile::tempdir()?;
        let kubeconfig = kubeconfig(dir.path()).await?;
        let mut next = Command::new(release_binary("flux-plunger")?)
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .args([
                "--log-encoding=console",
                "--metrics-addr=127.0.0.1:0",
                "--health-addr=127.0.0.1:0",
            ])
            .arg(format!("--watch-namespace={}", ns.name))
            .env("POD_NAME", "pod-b")
            .env("POD_NAMESPACE", &ns.name)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let mut lines = BufReader::new(next.stderr.take().context("stderr")?).lines();
        while let Some(line) = lines.next_line().await? {
            if line.contains("waiting for the leader Lease") {
                break;
            }
        }
        drain_once(&ns, "pod-a", dir.path()).await?;
        let drained = Instant::now();
        while let Some(line) = lines.next_line().await? {
            if line.contains("became the leader") {
                break;
            }
        }
        runs.push(drained.elapsed());
        next.kill().await?;
        testkit::strip_fences(&ns).await?;
    }
    Ok(median(runs))
}

async fn bench_sweep(count: usize) -> Result<Duration> {
    let client = control_plane().client().await?;
    let mut runs = Vec::new();
    for _ in 0..RUNS {
        let ns = TestNamespace::create(&client, "bench-sweep").await?;
        fenced_releases(&ns, count).await?;
        let dir = tempfile::tempdir()?;
        let kubeconfig = kubeconfig(dir.path()).await?;
        let started = Instant::now();
        let output = Command::new(release_binary("flux-plunger-sweep")?)
            .arg("hook")
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .arg(format!("--namespace={}", ns.name))
            .arg("--log-encoding=console")
            .output()
            .await?;
        runs.push(started.elapsed());
        if !output.status.success() {
            bail!(
                "the sweep failed: {}",
                String::from_utf8_lossy(&output.stdout)
            );
        }
    }
    Ok(median(runs))
}

#[tokio::main]
async fn main() -> Result<()> {
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let memory = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .next()
                .map(|l| l.split_whitespace().nth(1).unwrap_or("0").to_owned())
        })
        .and_then(|kb| kb.parse::<u64>().ok())
        .map_or(0, |kb| kb / 1024 / 1024);
    let mut rows: Vec<(String, Duration)> = Vec::new();
    for count in [100, 500] {
        eprintln!(">> drain of {count} fenced live releases ({RUNS} runs)");
        rows.push((
            format!("drain, {count} fenced live releases"),
            bench_drain(count).await?,
        ));
    }
    for count in [0, 200] {
        eprintln!(">> handover after a clean stop with {count} fences ({RUNS} runs)");
        rows.push((
            format!("handover to the next leader after the drain, {count} fences"),
            bench_handover(count).await?,
        ));
    }
    eprintln!(">> sweep of 500 fenced releases ({RUNS} runs)");
    rows.push((
        "pre-delete sweep, 500 fenced releases".to_owned(),
        bench_sweep(500).await?,
    ));

    println!("\nMachine: {cores} cores, {memory} GiB; median of {RUNS} runs; release binaries.\n");
    println!("| what | median |\n|---|---|");
    for (what, took) in &rows {
        println!("| {what} | {:.2} s |", took.as_secs_f64());
    }
    let out = testkit::control_plane::out_dir().join("bench");
    std::fs::create_dir_all(&out)?;
    let json = json!({
        "machine": {"cores": cores, "memory_gib": memory},
        "runs": RUNS,
        "figures": rows.iter().map(|(w, d)| json!({"what": w, "median_seconds": d.as_secs_f64()})).collect::<Vec<_>>(),
    });
    std::fs::write(out.join("bench.json"), serde_json::to_string_pretty(&json)?)?;
    eprintln!(">> written {}", out.join("bench.json").display());
    Ok(())
}
