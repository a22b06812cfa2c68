//! The drain's and the pre-delete hook's peak memory (`VmHWM`) over
//! `FENCED` fenced live releases carrying `VALUES_BYTES` of `spec.values`
//! each, against the same releases without them: both list every fenced
//! release in pages, and decode each page without the values.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use kube::Client;
use serde_json::{Map, Value, json};
use testkit::TestNamespace;

use crate::objects::{create_releases, create_releases_with_values, fence_releases};
use crate::{RUNS, Ran, drain_measured, kubeconfig, lead, median, sweep_measured};

/// Fenced releases in each namespace.
pub const FENCED: usize = 1000;
/// About how much `spec.values` each release of the heavy namespace carries
/// on top of the realistic ones', as JSON.
pub const VALUES_BYTES: usize = 50_000;
/// Configuration files the values embed (a chart that takes its files, a
/// dashboard or a proxy's configuration, as strings of its values).
const FILES: usize = 5;

/// One binary over one namespace, `RUNS` times.
pub struct Measured {
    /// Median.
    pub took: Duration,
    /// Median of the runs' `VmHWM`, in KiB.
    pub peak_kib: u64,
    pub runs: Vec<Ran>,
}

impl Measured {
    fn of(runs: Vec<Ran>) -> Result<Self> {
        let peaks = runs
            .iter()
            .map(|r| r.peak.map(|p| p.kib))
            .collect::<Option<Vec<_>>>()
            .context("no VmHWM was read")?;
        Ok(Self {
            took: median(runs.iter().map(|r| r.took).collect()),
            peak_kib: median(peaks),
            runs,
        })
    }

    pub fn json(&self) -> Value {
        json!({
            "seconds": self.took.as_secs_f64(),
            "peak_kib": self.peak_kib,
            "runs": self.runs.iter().map(|r| json!({
                "seconds": r.took.as_secs_f64(),
                "peak_kib": r.peak.map(|p| p.kib),
                "vm_hwm_at_start_kib": r.peak.map(|p| p.first_kib),
                "readings": r.peak.map(|p| p.samples),
                "last_reading_before_exit_ms": r.last_reading_before_exit.map(|d| d.as_secs_f64() * 1000.0),
            })).collect::<Vec<_>>(),
        })
    }
}

/// The drain and the sweep over one namespace of fenced releases.
pub struct Pair {
    pub drain: Measured,
    pub sweep: Measured,
}

pub struct ValuesFigures {
    /// The JSON size of the values added to each heavy release.
    pub values_bytes: usize,
    /// The releases without the added values.
    pub bare: Pair,
    /// The releases with them.
    pub heavy: Pair,
}

/// `FENCED` realistic releases in one namespace, the same with
/// `VALUES_BYTES` of values each in another; a drain and a sweep over each,
/// `RUNS` times, the fences set again before each run.
pub async fn bench_values(admin: &Client) -> Result<ValuesFigures> {
    let values = large_values(VALUES_BYTES);
    let values_bytes = serde_json::to_string(&values)?.len();
    let bare = TestNamespace::create(admin, "bench-values-bare").await?;
    let heavy = TestNamespace::create(admin, "bench-values").await?;
    let started = Instant::now();
    create_releases(&bare, 0..FENCED).await?;
    create_releases_with_values(&heavy, 0..FENCED, &values).await?;
    eprintln!(
        "   created {FENCED} releases, and {FENCED} with {values_bytes} bytes of values each, in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    Ok(ValuesFigures {
        values_bytes,
        bare: pair(&bare).await?,
        heavy: pair(&heavy).await?,
    })
}

async fn pair(ns: &TestNamespace) -> Result<Pair> {
    let dir = tempfile::tempdir()?;
    let kubeconfig = kubeconfig(dir.path()).await?;
    let mut drains = Vec::new();
    for _ in 0..RUNS {
        fence_releases(ns, 0..FENCED).await?;
        lead(ns, "pod-a").await?;
        drains.push(drain_measured(ns, "pod-a", &kubeconfig).await?);
    }
    let mut sweeps = Vec::new();
    for _ in 0..RUNS {
        fence_releases(ns, 0..FENCED).await?;
        sweeps.push(sweep_measured(ns, &kubeconfig).await?);
    }
    Ok(Pair {
        drain: Measured::of(drains)?,
        sweep: Measured::of(sweeps)?,
    })
}

/// About `bytes` of values (as JSON): `FILES` configuration files, each a
/// string of text lines, under `configFiles`.
pub fn large_values(bytes: usize) -> Value {
    let mut files = Map::new();
    for file in 0..FILES {
        let mut text = String::new();
        let mut line = 0;
        // A newline is two characters in JSON.
        while text.len() + line < bytes / FILES {
            text.push_str(&format!(
                "section-{file}.setting-{line:04} = the value of setting {line}, spelled out in full\n"
            ));
            line += 1;
        }
        files.insert(format!("file-{file}.conf"), Value::String(text));
    }
    json!({ "configFiles": files })
}
