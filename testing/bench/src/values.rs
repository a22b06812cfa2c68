//! The drain's and the pre-delete hook's peak memory (`VmHWM`) over
//! `FENCED` fenced live releases carrying `VALUES_BYTES` of `spec.values`
//! each, against the same releases without them: both list every fenced
//! release in pages, and decode each page without the values. Then the
//! drain of the heavy ones with, besides, one fenced release being deleted
//! whose one revision inflates far past the 16 MiB the payload decoder reads.

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use base64::Engine;
use flate2::Compression;
use flate2::write::GzEncoder;
use k8s_openapi::api::core::v1::Event;
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use plunger::names::FIELD_MANAGER;
use serde_json::{Map, Value, json};
use testkit::TestNamespace;
use testkit::fixtures::storage_secret;

use crate::objects::{
    applied, create_releases, create_releases_with_values, fence_releases, release_name,
};
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
    /// Drains of the heavy releases and one being deleted over a revision
    /// that inflates to `BOMB_INFLATES_TO`.
    pub bomb: Measured,
    /// That revision's `release` value, as stored.
    pub bomb_payload_bytes: usize,
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
    let bare = pair(&bare).await?;
    let heavy_pair = pair(&heavy).await?;
    let dir = tempfile::tempdir()?;
    let (bomb, bomb_payload_bytes) =
        drains_over_bomb(&heavy, &kubeconfig(dir.path()).await?).await?;
    Ok(ValuesFigures {
        values_bytes,
        bare,
        heavy: heavy_pair,
        bomb,
        bomb_payload_bytes,
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

/// How far the crafted revision inflates: twice the 16 MiB bound the
/// payload decoder reads (`plunger::history`).
pub const BOMB_INFLATES_TO: usize = 32 * 1024 * 1024;

/// The `release` value of a crafted storage Secret, of the kind issue 23
/// describes: base64 of the gzip of `{"config":[0,0,0,…]}` inflating to
/// `inflates_to` bytes. `config` is the field the decoder keeps as raw
/// JSON (the values it digests), so only its bound stops it.
pub fn bomb_payload(inflates_to: usize) -> Result<Vec<u8>> {
    let mut gz = GzEncoder::new(Vec::new(), Compression::best());
    gz.write_all(b"{\"config\":[0")?;
    let chunk = ",0".repeat(64 * 1024);
    for _ in 0..inflates_to / chunk.len() {
        gz.write_all(chunk.as_bytes())?;
    }
    gz.write_all(b"]}")?;
    Ok(base64::engine::general_purpose::STANDARD
        .encode(gz.finish()?)
        .into_bytes())
}

/// `RUNS` drains of the heavy namespace's `FENCED` fences with, besides,
/// release `FENCED` being deleted over a crafted revision: fenced (ours, no
/// suspension), without helm-controller's finalizer and observed at its
/// deleted generation (helm-controller's deletion pass has ended without an
/// uninstall, as over a cleared history), its history empty, its one
/// revision `deployed` and inflating to `BOMB_INFLATES_TO`. The drain reads
/// that revision for the hand-over, refuses it at the bound and lets the
/// release go (`ReleasedWithoutUninstall`).
async fn drains_over_bomb(ns: &TestNamespace, kubeconfig: &Path) -> Result<(Measured, usize)> {
    let name = release_name(FENCED);
    let payload = bomb_payload(BOMB_INFLATES_TO)?;
    let payload_bytes = payload.len();
    ns.secrets()
        .create(
            &PostParams::default(),
            &storage_secret(&name, 1, "deployed", payload),
        )
        .await?;
    let api = ns.releases();
    let helm_controller = PatchParams {
        field_manager: Some("helm-controller".to_owned()),
        ..PatchParams::default()
    };
    let mut drains = Vec::new();
    for _ in 0..RUNS {
        fence_releases(ns, 0..FENCED).await?;
        api.patch(
            &name,
            &PatchParams::apply("kustomize-controller").force(),
            &Patch::Apply(applied(&ns.name, &name, FENCED)),
        )
        .await?;
        api.patch(
            &name,
            &PatchParams::apply(FIELD_MANAGER),
            &Patch::Apply(testkit::fixtures::fence_body(&name, false)),
        )
        .await?;
        api.delete(&name, &DeleteParams::default()).await?;
        let generation = api
            .get(&name)
            .await?
            .metadata
            .generation
            .context("no generation")?;
        api.patch_status(
            &name,
            &helm_controller,
            &Patch::Merge(json!({"status": {"observedGeneration": generation}})),
        )
        .await?;
        lead(ns, "pod-a").await?;
        drains.push(drain_measured(ns, "pod-a", kubeconfig).await?);
        if api.get_opt(&name).await?.is_some() {
            bail!("the drain did not let {name} go");
        }
    }
    let events: Api<Event> = Api::namespaced(ns.client.clone(), &ns.name);
    let refused = events
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .any(|e| {
            e.message
                .is_some_and(|m| m.contains(&name) && m.contains("inflates past"))
        });
    if !refused {
        bail!("no event says that the revision of {name} was refused at the bound");
    }
    Ok((Measured::of(drains)?, payload_bytes))
}
