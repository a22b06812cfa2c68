//! `make bench`: figures, never assertions. Runs the release binaries against
//! the local control plane and prints Markdown tables (and JSON under
//! `_out/bench/`):
//!
//! - sizes: each release binary, stripped;
//! - the controller's memory (peak and steady RSS) and time to ready,
//!   watching 0, 1,000 and 5,000 realistic HelmReleases;
//! - its requests per minute while idle with 5,000 (from the audit log);
//! - a burst of 200 releases stuck at once: time until all are recovered,
//!   p50/p99 latency per release, at `--concurrent` 1 and 8, and the
//!   requests per recovery by verb and resource (from the audit log);
//! - the drain: time from SIGTERM to exit with 100 and 500 fenced releases;
//! - the handover: time from the end of the first pod's drain to the second
//!   pod's first write, after a clean stop with 0 and 200 fences;
//! - the sweep (pre-delete hook): time for 500 fenced releases;
//! - one recovery of a release with 10 revisions of 200 KB: the requests and
//!   the bytes the controller received;
//! - the drain's and the sweep's peak memory (`VmHWM`) over 1,000 fenced
//!   releases carrying 50 KB of values each, and over the same without them;
//! - 1,000 releases stuck at once under `--max-recoveries-per-minute 1`
//!   (`waiting`): how many it turns away and what that costs, then, over
//!   three minutes, the requests a minute by verb and resource, the busiest
//!   second and the recoveries (the waiting releases must wake one at a
//!   time, not in a burst);
//! - 50,000 releases, in one namespace and over 500: the controller's memory,
//!   start-up and idle requests, and a drain's and a sweep's requests and
//!   bytes among them (`large`, run last: it leaves 100,000 releases).
#![forbid(unsafe_code)]

mod burst;
mod controller;
mod large;
mod memory;
mod objects;
mod peak;
mod scale;
mod sizes;
mod storage;
mod values;
mod waiting;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use futures::{StreamExt, stream};
use kube::api::{Patch, PatchParams};
use plunger::lease::{Attempt, LeaseLock};
use plunger::names::FIELD_MANAGER;
use serde_json::json;
use testkit::control_plane::AuthInfo;
use testkit::{TestNamespace, control_plane};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

pub const RUNS: usize = 3;

/// A release binary: from `$FLUX_PLUNGER_BENCH_BINARIES` when set (to
/// measure another build, e.g. an earlier commit's), else this workspace's.
pub fn release_binary(name: &str) -> Result<PathBuf> {
    let dir = match std::env::var_os("FLUX_PLUNGER_BENCH_BINARIES") {
        Some(dir) => PathBuf::from(dir),
        None => std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| testkit::control_plane::workspace_root().join("target"))
            .join("release"),
    };
    let path = dir.join(name);
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
            let body = testkit::fixtures::fence_body(&name, true);
            ns.releases()
                .patch(
                    &name,
                    &PatchParams::apply(FIELD_MANAGER),
                    &Patch::Apply(body),
                )
                .await?;
            anyhow::Ok(())
        })
        .buffer_unordered(16)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect()
}

pub(crate) async fn kubeconfig(dir: &Path) -> Result<PathBuf> {
    let path = dir.join("kubeconfig");
    control_plane().write_kubeconfig(&path, &AuthInfo::AdminCertificate)?;
    Ok(path)
}

/// Starts a drain sidecar for `pod`, waits until it idles, SIGTERMs it and
/// returns how long it took to exit.
async fn drain_once(ns: &TestNamespace, pod: &str, dir: &Path) -> Result<Duration> {
    signal_drain(ns, pod, &kubeconfig(dir).await?).await
}

/// [`drain_once`] with the given kubeconfig.
pub(crate) async fn signal_drain(
    ns: &TestNamespace,
    pod: &str,
    kubeconfig: &Path,
) -> Result<Duration> {
    Ok(drain_measured(ns, pod, kubeconfig).await?.took)
}

/// A release binary's run: from the start of its work (SIGTERM for the
/// drain, the spawn for the hook) to its exit, and its peak memory.
#[derive(Debug, Clone, Copy)]
pub struct Ran {
    pub took: Duration,
    /// `None` if no `VmHWM` could be read.
    pub peak: Option<peak::Peak>,
    /// From the last reading of `VmHWM` to the exit being seen.
    pub last_reading_before_exit: Option<Duration>,
}

/// [`signal_drain`], reading the drain's `VmHWM` from SIGTERM to its exit.
pub(crate) async fn drain_measured(
    ns: &TestNamespace,
    pod: &str,
    kubeconfig: &Path,
) -> Result<Ran> {
    let mut child = Command::new(release_binary("flux-plunger-drain")?)
        .arg(format!("--kubeconfig={}", kubeconfig.display()))
        .arg("--log-encoding=console")
        .env("POD_NAME", pod)
        .env("POD_NAMESPACE", &ns.name)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let pid = child.id().context("pid")?;
    let mut lines = BufReader::new(child.stderr.take().context("stderr")?).lines();
    while let Some(line) = lines.next_line().await? {
        if line.contains("idle until SIGTERM") {
            break;
        }
    }
    // It says so just before it installs its handler: a SIGTERM in between
    // would kill it.
    let handling = Instant::now();
    while !peak::catches_sigterm(pid) {
        if handling.elapsed() > Duration::from_secs(10) {
            bail!("the drain did not handle SIGTERM within 10 s");
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let log = tokio::spawn(async move {
        let mut log = Vec::new();
        while let Ok(Some(line)) = lines.next_line().await {
            log.push(line);
        }
        log
    });
    let watch = peak::PeakWatch::start(pid);
    let started = Instant::now();
    std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()?;
    let status = child.wait().await?;
    let ran = ran(started, watch);
    let log = log.await?;
    // It exits 0 too when it finds that this pod was not the last leader.
    if !status.success() || log.iter().any(|l| l.contains("nothing to drain")) {
        bail!("the drain exited with {status}:\n{}", log.join("\n"));
    }
    Ok(ran)
}

fn ran(started: Instant, watch: peak::PeakWatch) -> Ran {
    let exited = Instant::now();
    let peak = watch.finish();
    Ran {
        took: exited - started,
        peak,
        last_reading_before_exit: peak.map(|p| exited.saturating_duration_since(p.last)),
    }
}

pub(crate) async fn lead(ns: &TestNamespace, pod: &str) -> Result<()> {
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

pub fn median<T: Ord + Copy>(mut values: Vec<T>) -> T {
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
        runs.push(run_sweep(&ns, &kubeconfig(dir.path()).await?).await?);
    }
    Ok(median(runs))
}

/// Runs the pre-delete hook over the cluster (no Deployment, no pods: it
/// goes straight to the fences); returns how long it took.
pub(crate) async fn run_sweep(ns: &TestNamespace, kubeconfig: &Path) -> Result<Duration> {
    Ok(sweep_measured(ns, kubeconfig).await?.took)
}

/// [`run_sweep`], reading the hook's `VmHWM` from its spawn to its exit.
pub(crate) async fn sweep_measured(ns: &TestNamespace, kubeconfig: &Path) -> Result<Ran> {
    let started = Instant::now();
    let child = Command::new(release_binary("flux-plunger-sweep")?)
        .arg("hook")
        .arg(format!("--kubeconfig={}", kubeconfig.display()))
        .arg(format!("--namespace={}", ns.name))
        .arg("--log-encoding=console")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let watch = peak::PeakWatch::start(child.id().context("pid")?);
    let output = child.wait_with_output().await?;
    let ran = ran(started, watch);
    if !output.status.success() {
        bail!(
            "the sweep failed: {}",
            String::from_utf8_lossy(&output.stdout)
        );
    }
    Ok(ran)
}

/// The figures, as printed and as written to `bench.json`.
#[derive(Default)]
struct Report {
    /// (figure, value) rows of the main table.
    rows: Vec<(String, String)>,
    json: serde_json::Map<String, serde_json::Value>,
}

impl Report {
    fn row(&mut self, what: impl Into<String>, value: impl Into<String>) {
        self.rows.push((what.into(), value.into()));
    }
}

fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

fn secs(d: Duration) -> String {
    if d < Duration::from_secs(1) {
        format!("{:.0} ms", d.as_secs_f64() * 1000.0)
    } else {
        format!("{:.2} s", d.as_secs_f64())
    }
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn machine() -> (usize, u64) {
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let memory_mib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .next()
                .map(|l| l.split_whitespace().nth(1).unwrap_or("0").to_owned())
        })
        .and_then(|kb| kb.parse::<u64>().ok())
        .map_or(0, |kb| kb / 1024);
    (cores, memory_mib)
}

const BURST: usize = 200;
const IDLE_WINDOW: Duration = Duration::from_secs(60);

fn print_counts(title: &str, counts: &BTreeMap<String, f64>) {
    println!("\n{title}\n\n| request | count |\n|---|---|");
    for (label, n) in counts {
        println!("| {label} | {n:.2} |");
    }
    println!("| **total** | **{:.2}** |", counts.values().sum::<f64>());
}

/// The rows and the JSON of the `waiting` part.
fn report_waiting(report: &mut Report, figures: &waiting::WaitingFigures) {
    let title = format!(
        "{} releases stuck at once, `--max-recoveries-per-minute {}`",
        waiting::RELEASES,
        waiting::PER_MINUTE
    );
    let turning_total: u64 = figures.turning_away_by_label.values().sum();
    report.row(
        format!("{title}: turned away (fenced to wait) / in (first stuck write → last fence) / requests meanwhile / busiest second"),
        format!(
            "{} / {} / {turning_total} / {}",
            figures.turned_away,
            secs(figures.turning_away),
            figures.turning_away_busiest_second
        ),
    );
    report.row(
        format!(
            "{title}, waiting ({} min from {} s after the first recovery): requests a minute / busiest second",
            waiting::WINDOW_MINUTES,
            figures.window_start.as_secs()
        ),
        format!(
            "{:.1} / {}",
            figures.window_per_minute(),
            figures.window_busiest_second
        ),
    );
    let at: Vec<String> = figures
        .recoveries_at
        .iter()
        .map(|s| format!("{s:.1}"))
        .collect();
    report.row(
        format!("{title}: recoveries in the window / all until its end (s after the first)"),
        format!("{} / {} s", figures.window_recoveries(), at.join(", ")),
    );
    report.json.insert(
        "waiting".into(),
        json!({"releases": waiting::RELEASES, "max_recoveries_per_minute": waiting::PER_MINUTE,
            "concurrent": waiting::CONCURRENT,
            "turned_away": figures.turned_away, "turning_away_seconds": figures.turning_away.as_secs_f64(),
            "turning_away_requests": figures.turning_away_by_label,
            "turning_away_busiest_second": figures.turning_away_busiest_second,
            "one_turned_away": figures.one_turned_away,
            "window_start_after_first_recovery_seconds": figures.window_start.as_secs_f64(),
            "window_requests_per_minute": figures.window_per_minute(),
            "window_busiest_second": figures.window_busiest_second,
            "minutes": figures.minutes.iter().map(|m| json!({"requests": m.by_label,
                "busiest_second": m.busiest_second, "recoveries": m.recoveries})).collect::<Vec<_>>(),
            "recoveries_seconds_after_first": figures.recoveries_at}),
    );
}

/// The `waiting` part's window, minute by minute: each request by verb and
/// resource, the busiest second, the recoveries.
fn print_waiting_minutes(figures: &waiting::WaitingFigures) {
    let labels: std::collections::BTreeSet<&String> = figures
        .minutes
        .iter()
        .flat_map(|m| m.by_label.keys())
        .collect();
    let start = figures.window_start.as_secs();
    let heads: Vec<String> = (0..figures.minutes.len() as u64)
        .map(|m| format!("{}–{} s", start + 60 * m, start + 60 * (m + 1)))
        .collect();
    println!(
        "\nThe controller's requests while {} releases wait at {} recovery a minute, minute by minute (seconds after the first recovery):\n",
        waiting::RELEASES,
        waiting::PER_MINUTE
    );
    println!("| request | {} |", heads.join(" | "));
    println!("|---|{}", "---|".repeat(heads.len()));
    let row = |what: &str, value: &dyn Fn(&waiting::Minute) -> String| {
        let values: Vec<String> = figures.minutes.iter().map(value).collect();
        println!("| {what} | {} |", values.join(" | "));
    };
    for label in labels {
        row(label, &|m| {
            m.by_label.get(label).copied().unwrap_or(0).to_string()
        });
    }
    row("**total**", &|m| {
        format!("**{}**", m.by_label.values().sum::<u64>())
    });
    row("busiest second", &|m| m.busiest_second.to_string());
    row("recoveries", &|m| m.recoveries.to_string());
    println!(
        "\nWhile turning {} releases away ({}), by verb and resource: {:?}",
        figures.turned_away,
        secs(figures.turning_away),
        figures.turning_away_by_label
    );
    println!(
        "\nThe requests about {} while it was turned away (after its stuck write):\n",
        objects::release_name(waiting::RELEASES / 2)
    );
    for (i, step) in figures.one_turned_away.iter().enumerate() {
        println!("{}. {step}", i + 1);
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let (cores, memory_mib) = machine();
    let load_before = load_average();
    let bench_started = Instant::now();
    let mut report = Report::default();

    eprintln!(">> sizes of the release binaries");
    let mut sizes_json = Vec::new();
    for size in sizes::sizes()? {
        let value = match size.stripped_bytes {
            Some(stripped) => format!("{:.2} MiB", stripped as f64 / 1048576.0),
            None => format!(
                "{:.2} MiB (not stripped: no strip or objcopy here)",
                size.bytes as f64 / 1048576.0
            ),
        };
        report.row(format!("size of `{}`, stripped", size.binary), value);
        sizes_json.push(json!({"binary": size.binary, "bytes": size.bytes, "stripped_bytes": size.stripped_bytes}));
    }
    report.json.insert("sizes".into(), json!(sizes_json));

    let admin = control_plane().client().await?;
    let identity = controller::Identity::create(&admin).await?;
    // For working on the bench: FLUX_PLUNGER_BENCH_ONLY=memory,burst,drain
    // runs only those parts (sizes always run).
    let only = std::env::var("FLUX_PLUNGER_BENCH_ONLY").unwrap_or_default();
    let wanted = |part: &str| only.is_empty() || only.split(',').any(|p| p == part);

    // First, on a control plane without the thousands of releases the
    // parts below leave: the drain lists every HelmRelease of the cluster.
    if wanted("drain") {
        for count in [100, 500] {
            eprintln!(">> drain of {count} fenced live releases ({RUNS} runs)");
            let took = bench_drain(count).await?;
            report.row(
                format!("drain, {count} fenced live releases (SIGTERM to exit)"),
                secs(took),
            );
        }
        for count in [0, 200] {
            eprintln!(">> handover after a clean stop with {count} fences ({RUNS} runs)");
            let took = bench_handover(count).await?;
            report.row(
                format!("handover: drain ended → next pod leads, {count} fences"),
                secs(took),
            );
        }
        eprintln!(">> sweep of 500 fenced releases ({RUNS} runs)");
        report.row(
            "pre-delete sweep, 500 fenced releases",
            secs(bench_sweep(500).await?),
        );
    }

    if wanted("scale") {
        eprintln!(
            ">> drain and sweep with {} releases, {} fenced ({RUNS} runs each, and one counted)",
            scale::RELEASES,
            scale::FENCES
        );
        let figures = scale::bench_scale(&admin).await?;
        let mut scale_json = serde_json::Map::new();
        for (what, f) in [("drain", figures.drain), ("sweep", figures.sweep)] {
            let title = match what {
                "drain" => "drain (SIGTERM to exit)",
                _ => "pre-delete sweep",
            };
            report.row(
                format!(
                    "{title}, {} releases, {} fenced: time / requests / bytes received",
                    scale::RELEASES,
                    scale::FENCES
                ),
                format!(
                    "{} / {} / {:.1} MiB",
                    secs(f.took),
                    f.requests,
                    f.bytes as f64 / 1048576.0
                ),
            );
            scale_json.insert(
                what.into(),
                json!({"seconds": f.took.as_secs_f64(), "requests": f.requests, "response_bytes": f.bytes}),
            );
        }
        scale_json.insert("releases".into(), json!(scale::RELEASES));
        scale_json.insert("fenced".into(), json!(scale::FENCES));
        report
            .json
            .insert("scale".into(), serde_json::Value::Object(scale_json));
    }

    if wanted("storage") {
        eprintln!(
            ">> one recovery, {} revisions of about {} KB each, counted",
            storage::REVISIONS,
            storage::PAYLOAD_BYTES / 1000
        );
        let figures = storage::bench_storage(&admin).await?;
        report.row(
            format!(
                "one recovery, {} revisions of {:.0} KB: requests / bytes received (controller start to recovery)",
                storage::REVISIONS,
                figures.payload_bytes as f64 / 1000.0
            ),
            format!(
                "{} / {:.1} KiB",
                figures.requests,
                figures.bytes as f64 / 1024.0
            ),
        );
        report.json.insert(
            "storage".into(),
            json!({"revisions": storage::REVISIONS, "payload_bytes": figures.payload_bytes,
                "requests": figures.requests, "response_bytes": figures.bytes}),
        );
    }

    let mut idle = None;
    if wanted("memory") {
        let mut memory_json = Vec::new();
        let mut steady = BTreeMap::new();
        let memory_ns = TestNamespace::create(&admin, "bench-memory").await?;
        let mut have = 0;
        for count in [0, 1000, 5000] {
            eprintln!(">> controller memory and start-up, {count} releases watched ({RUNS} runs)");
            let window = (count == 5000).then_some(IDLE_WINDOW);
            let (figures, idle_figures) =
                memory::bench_memory(&admin, &identity, &memory_ns, have, count, window).await?;
            have = count;
            report.row(
                format!("controller start-up to `/readyz` 200, {count} releases"),
                secs(figures.ready),
            );
            report.row(
                format!("controller RSS, {count} releases: peak / steady (10 s after sync)"),
                format!("{} / {}", mib(figures.peak_kib), mib(figures.steady_kib)),
            );
            steady.insert(count, figures.steady_kib);
            memory_json.push(json!({
                "releases": count, "ready_seconds": figures.ready.as_secs_f64(),
                "peak_rss_kib": figures.peak_kib, "steady_rss_kib": figures.steady_kib,
            }));
            idle = idle.or(idle_figures);
        }
        let per_release = |from: usize, to: usize| {
            (steady[&to] as f64 - steady[&from] as f64) * 1024.0 / (to - from) as f64
        };
        report.row(
            "controller memory per watched release (steady, 1,000 → 5,000)",
            format!("{:.0} bytes", per_release(1000, 5000)),
        );
        report.json.insert(
            "memory".into(),
            json!({"runs": memory_json, "bytes_per_release_1000_to_5000": per_release(1000, 5000),
            "bytes_per_release_0_to_5000": per_release(0, 5000)}),
        );
        let idle_figures = idle.as_ref().context("no idle figures")?;
        report.row(
            format!(
                "controller requests per minute while idle, {} releases ({} s window)",
                idle_figures.releases,
                idle_figures.window.as_secs()
            ),
            format!("{:.1}", idle_figures.per_minute),
        );
        report.row(
            format!(
                "controller RSS after {} s idle, {} releases",
                idle_figures.window.as_secs(),
                idle_figures.releases
            ),
            mib(idle_figures.rss_after_kib),
        );
        report.json.insert(
        "idle".into(),
        json!({"releases": idle_figures.releases, "window_seconds": idle_figures.window.as_secs(),
            "requests_per_minute": idle_figures.per_minute, "by_request": idle_figures.by_label,
            "rss_after_kib": idle_figures.rss_after_kib}),
    );
    }

    let mut burst_json = Vec::new();
    let mut breakdown = None;
    let concurrencies: &[u16] = if wanted("burst") { &[1, 8] } else { &[] };
    for &concurrent in concurrencies {
        eprintln!(">> burst of {BURST} stuck releases, --concurrent {concurrent} ({RUNS} runs)");
        let mut runs = Vec::new();
        for run in 0..RUNS {
            runs.push(burst::bench_burst(&admin, &identity, BURST, concurrent, run).await?);
        }
        let all = median(runs.iter().map(|r| r.all_recovered).collect());
        let p50 = median(runs.iter().map(|r| r.p50).collect());
        let p99 = median(runs.iter().map(|r| r.p99).collect());
        report.row(
            format!("burst of {BURST} stuck releases, `--concurrent {concurrent}`: all recovered"),
            secs(all),
        );
        report.row(
            format!("burst, `--concurrent {concurrent}`: latency per release (stuck write → unsuspend), p50 / p99"),
            format!("{} / {}", secs(p50), secs(p99)),
        );
        let requests: Vec<u64> = runs.iter().map(|r| r.by_label.values().sum()).collect();
        let per_recovery = median(requests) as f64 / BURST as f64;
        report.row(
            format!("apiserver requests per recovery, `--concurrent {concurrent}` (audit log)"),
            format!("{per_recovery:.2}"),
        );
        burst_json.push(json!({
            "concurrent": concurrent, "releases": BURST,
            "all_recovered_seconds": all.as_secs_f64(),
            "p50_seconds": p50.as_secs_f64(), "p99_seconds": p99.as_secs_f64(),
            "requests_per_recovery": per_recovery,
            "runs": runs.iter().map(|r| json!({
                "all_recovered_seconds": r.all_recovered.as_secs_f64(),
                "p50_seconds": r.p50.as_secs_f64(), "p99_seconds": r.p99.as_secs_f64(),
                "requests_by_kind": r.by_label, "background_requests": r.background,
            })).collect::<Vec<_>>(),
        }));
        if concurrent == 8 {
            breakdown = runs.into_iter().next();
        }
    }
    report.json.insert("burst".into(), json!(burst_json));

    let mut waiting_figures = None;
    if wanted("waiting") {
        eprintln!(
            ">> {} releases stuck at once, --max-recoveries-per-minute {}: what turning them away and their waiting cost ({} minutes, from {} s or whole minutes more after the first recovery, once all are turned away; one run)",
            waiting::RELEASES,
            waiting::PER_MINUTE,
            waiting::WINDOW_MINUTES,
            waiting::WINDOW_START.as_secs()
        );
        let figures = waiting::bench_waiting(&admin, &identity).await?;
        report_waiting(&mut report, &figures);
        waiting_figures = Some(figures);
    }

    if wanted("values") {
        eprintln!(
            ">> drain and sweep peak memory, {} fenced releases with and without {} KB of values each ({RUNS} runs each)",
            values::FENCED,
            values::VALUES_BYTES / 1000
        );
        let figures = values::bench_values(&admin).await?;
        let kb = figures.values_bytes as f64 / 1000.0;
        for (what, title) in [
            ("drain", "drain (SIGTERM to exit)"),
            ("sweep", "pre-delete sweep"),
        ] {
            let [bare, heavy] = [&figures.bare, &figures.heavy].map(|pair| match what {
                "drain" => &pair.drain,
                _ => &pair.sweep,
            });
            report.row(
                format!(
                    "{title}, {} fenced releases: peak RSS (VmHWM) / time, without large values",
                    values::FENCED
                ),
                format!("{} / {}", mib(bare.peak_kib), secs(bare.took)),
            );
            report.row(
                format!(
                    "{title}, {} fenced releases: peak RSS (VmHWM) / time, {kb:.0} KB of values each",
                    values::FENCED
                ),
                format!("{} / {}", mib(heavy.peak_kib), secs(heavy.took)),
            );
        }
        report.row(
            format!(
                "drain, the same and one deleted release whose revision ({:.0} KB stored) inflates to {} MiB: peak RSS (VmHWM) / time",
                figures.bomb_payload_bytes as f64 / 1000.0,
                values::BOMB_INFLATES_TO >> 20
            ),
            format!("{} / {}", mib(figures.bomb.peak_kib), secs(figures.bomb.took)),
        );
        report.json.insert(
            "values".into(),
            json!({"fenced": values::FENCED, "values_bytes": figures.values_bytes,
                "without_values": {"drain": figures.bare.drain.json(), "sweep": figures.bare.sweep.json()},
                "with_values": {"drain": figures.heavy.drain.json(), "sweep": figures.heavy.sweep.json()},
                "with_values_and_bomb": {"drain": figures.bomb.json(), "payload_bytes": figures.bomb_payload_bytes,
                    "inflates_to_bytes": values::BOMB_INFLATES_TO}}),
        );
    }

    if wanted("large") {
        eprintln!(
            ">> {} releases in one namespace and in {} ({RUNS} runs each; creating them takes minutes)",
            large::RELEASES,
            large::NAMESPACES
        );
        let figures = large::bench_large(&admin, &identity).await?;
        let mut layouts_json = Vec::new();
        for f in &figures.layouts {
            report.row(
                format!(
                    "controller ({}), {} releases in {}: start-up to `/readyz` / steady RSS / idle requests a minute",
                    f.build,
                    large::RELEASES,
                    f.layout
                ),
                format!(
                    "{} / {} / {:.0}",
                    secs(f.ready),
                    mib(f.steady_kib),
                    f.idle_per_minute
                ),
            );
            layouts_json.push(json!({"layout": f.layout, "build": f.build,
                "ready_seconds": f.ready.as_secs_f64(), "peak_rss_kib": f.peak_kib,
                "steady_rss_kib": f.steady_kib, "idle_requests_per_minute": f.idle_per_minute}));
        }
        for (what, f) in [
            ("drain", figures.among.drain),
            ("sweep", figures.among.sweep),
        ] {
            report.row(
                format!(
                    "{what} of {} fences among {} releases: time / requests / bytes received",
                    scale::FENCES,
                    figures.cluster_releases
                ),
                format!(
                    "{} / {} / {:.1} MiB",
                    secs(f.took),
                    f.requests,
                    f.bytes as f64 / 1048576.0
                ),
            );
        }
        report.json.insert(
            "large".into(),
            json!({"releases": large::RELEASES, "namespaces": large::NAMESPACES, "layouts": layouts_json,
                "cluster_releases": figures.cluster_releases,
                "drain": {"seconds": figures.among.drain.took.as_secs_f64(), "requests": figures.among.drain.requests, "response_bytes": figures.among.drain.bytes},
                "sweep": {"seconds": figures.among.sweep.took.as_secs_f64(), "requests": figures.among.sweep.requests, "response_bytes": figures.among.sweep.bytes}}),
        );
    }

    let load_after = load_average();
    let took = bench_started.elapsed();
    println!(
        "\nMachine: {cores} cores, {:.1} GiB; load average {load_before} at the start, {load_after} at the end; \
         median of {RUNS} runs; release binaries (glibc); the bench took {:.0} s.\n",
        memory_mib as f64 / 1024.0,
        took.as_secs_f64()
    );
    println!("| figure | value |\n|---|---|");
    for (what, value) in &report.rows {
        println!("| {what} | {value} |");
    }
    if let Some(run) = &breakdown {
        let per: BTreeMap<String, f64> = run
            .by_label
            .iter()
            .map(|(k, v)| (k.clone(), *v as f64 / BURST as f64))
            .collect();
        print_counts(
            &format!(
                "Requests per recovery, by verb and resource (`--concurrent 8`, first run, {BURST} recoveries; the Lease's own requests and the watch left out):"
            ),
            &per,
        );
        println!(
            "\nThe Lease and the watch in the same window: {:?}",
            run.background
        );
        println!(
            "\nThe requests of one recovery ({}), in the order the apiserver answered them:\n",
            objects::release_name(0)
        );
        for (i, step) in run.sequence.iter().enumerate() {
            println!("{}. {step}", i + 1);
        }
    }
    if let Some(figures) = &waiting_figures {
        print_waiting_minutes(figures);
    }
    if let Some(idle) = &idle {
        let idle_counts: BTreeMap<String, f64> = idle
            .by_label
            .iter()
            .map(|(k, v)| (k.clone(), *v as f64 * 60.0 / idle.window.as_secs_f64()))
            .collect();
        print_counts(
            &format!(
                "Requests per minute while idle with {} releases:",
                idle.releases
            ),
            &idle_counts,
        );
    }

    report.json.insert(
        "machine".into(),
        json!({"cores": cores, "memory_mib": memory_mib, "load_average_before": load_before,
            "load_average_after": load_after}),
    );
    report.json.insert("runs".into(), json!(RUNS));
    report
        .json
        .insert("bench_seconds".into(), json!(took.as_secs_f64()));
    report.json.insert(
        "figures".into(),
        json!(
            report
                .rows
                .iter()
                .map(|(w, v)| json!({"what": w, "value": v}))
                .collect::<Vec<_>>()
        ),
    );
    if let Some(run) = &breakdown {
        report
            .json
            .insert("one_recovery".into(), json!(run.sequence));
    }
    let out = testkit::control_plane::out_dir().join("bench");
    std::fs::create_dir_all(&out)?;
    std::fs::write(
        out.join("bench.json"),
        serde_json::to_string_pretty(&serde_json::Value::Object(report.json))?,
    )?;
    eprintln!(">> written {}", out.join("bench.json").display());
    Ok(())
}
