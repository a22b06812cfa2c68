//! Randomized interleavings: many seeded runs of "a stuck release is being
//! recovered while it is deleted", against the real apiserver.
//!
//! Each run has its own namespace and draws everything from its seed: random
//! delays at every recovery step of an in-process `Reconciler` (through its
//! `TestHooks`), between the simulated helm-controller's passes and between
//! the controller's passes, a delete that lands at a random moment (after a
//! random time, or as the recovery reaches a random step), another manager's
//! write of `spec.suspend` before it or not, and a fault proxy between flux-plunger's
//! client (its reads, writes and watch) and the apiserver; in some runs
//! helm-controller meets faults of its own. The test's own writes and checks
//! use a direct client.
//!
//! Once a run settles (the release is gone, or it stays the same while
//! helm-controller keeps passing over it and flux-plunger's controller has
//! nothing left to do) the invariants of SPEC §4-§5 are checked:
//! - a release deleted while flux-plunger held it (its fence or its
//!   suspension), without a foreign suspension, was uninstalled. One deleted
//!   while flux-plunger held nothing of it (before it took hold, or after it
//!   let go) is counted, not judged: helm-controller has cleared the stuck
//!   release's history, so its own deletion path uninstalls nothing, with
//!   flux-plunger or without (docs/helm-controller.md, "Known limits");
//! - a release suspended by another manager, then deleted, kept its resources;
//! - nothing is left Terminating once helm-controller has answered;
//! - a live, settled release carries no suspension or fence of ours;
//! - no storage Secret but the stuck revision was deleted (or the ones
//!   helm-controller's uninstall purged).
//!
//! A failing seed is printed with its timeline and can be replayed:
//! `FLUX_PLUNGER_SEEDS=17,23 cargo test -p plunger --test interleavings -- --nocapture`.
//! Which requests a fault hits depends on how the run's tasks interleave in
//! time, so a replay runs the same scenario and fault rates, not always the
//! very same order. CI runs a fixed seed set; `make soak` runs many more
//! (`FLUX_PLUNGER_SEED_COUNT`, from `FLUX_PLUNGER_SEED_BASE`).
//!
//! `scenario` draws a run from its seed, `actors` plays it, `checks` judges it.

#[path = "interleavings/actors.rs"]
mod actors;
#[path = "interleavings/checks.rs"]
mod checks;
#[path = "interleavings/scenario.rs"]
mod scenario;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Result;
use futures::StreamExt;
use plunger::reconcile::Step;
use serde_json::json;
use testkit::{
    FaultProxy, FaultReport, Handled, SeededRng, SimulatedHelmController, TestNamespace,
    control_plane,
};

use actors::{
    Loops, Progress, Timeline, act, controller_loop, helm_controller_loop, reconciler, settle,
};
use checks::{check, describe, secret_names};
use scenario::{ForeignWrite, Scenario, Trigger};

/// The seeds CI runs: fixed, so a red CI is a seed anyone can replay.
const CI_SEEDS: std::ops::RangeInclusive<u64> = 1..=48;
/// Runs at a time: each mostly waits on its own delays.
const DEFAULT_PARALLEL: usize = 4;
/// A run that has not settled by then is a violation: something is stuck.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(90);
const NAME: &str = "web";
/// Another release's storage in the same namespace: never ours to delete.
const NEIGHBOUR: &str = "neighbour";
/// What one run ended with.
struct RunResult {
    scenario: Scenario,
    violations: Vec<String>,
    timeline: String,
    faults: FaultReport,
    helm_controller_faults: FaultReport,
    recovered: bool,
    absorbed_foreign_update: bool,
    /// helm-controller met the delete under our suspension and skipped the
    /// uninstall: only the fence kept the release for a second pass.
    fence_mattered: bool,
    /// The delete landed while flux-plunger held nothing of the release.
    deleted_unheld: bool,
    took: Duration,
}

fn seeds() -> Vec<u64> {
    if let Ok(list) = std::env::var("FLUX_PLUNGER_SEEDS") {
        return list
            .split(|c: char| c == ',' || c.is_whitespace())
            .filter(|s| !s.is_empty())
            .map(|s| {
                s.parse()
                    .expect("FLUX_PLUNGER_SEEDS: comma-separated integers")
            })
            .collect();
    }
    if let Ok(count) = std::env::var("FLUX_PLUNGER_SEED_COUNT") {
        let count: u64 = count.parse().expect("FLUX_PLUNGER_SEED_COUNT: an integer");
        let base = std::env::var("FLUX_PLUNGER_SEED_BASE")
            .ok()
            .filter(|b| !b.is_empty())
            .map(|b| b.parse().expect("FLUX_PLUNGER_SEED_BASE: an integer"))
            // A soak explores new seeds each time; the base is printed.
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_secs() % 1_000_000 * 1_000)
                    .unwrap_or_default()
            });
        println!("interleavings: seeds {base}..{}", base + count);
        return (base..base + count).collect();
    }
    CI_SEEDS.collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn recoveries_raced_by_deletes_and_faults_never_orphan_strand_or_lose_anything() -> Result<()>
{
    let seeds = seeds();
    let parallel = std::env::var("FLUX_PLUNGER_INTERLEAVINGS_PARALLEL")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(DEFAULT_PARALLEL);
    let started = Instant::now();
    let total = seeds.len();
    let done = AtomicU64::new(0);
    let results: Vec<RunResult> = futures::stream::iter(seeds)
        .map(|seed| async move {
            match run(Scenario::from_seed(seed)).await {
                Ok(result) => result,
                // A run that could not even be arranged is reported as such.
                Err(err) => RunResult {
                    scenario: Scenario::from_seed(seed),
                    violations: vec![format!("the run failed: {err:#}")],
                    timeline: String::new(),
                    faults: FaultReport::default(),
                    helm_controller_faults: FaultReport::default(),
                    recovered: false,
                    absorbed_foreign_update: false,
                    fence_mattered: false,
                    deleted_unheld: false,
                    took: Duration::ZERO,
                },
            }
        })
        .buffer_unordered(parallel)
        .inspect(|r| {
            let n = done.fetch_add(1, Ordering::SeqCst) + 1;
            println!(
                "[{n}/{total}] seed {}: {} in {:.1}s ({} faults injected){}",
                r.scenario.seed,
                if r.violations.is_empty() {
                    "ok"
                } else {
                    "VIOLATION"
                },
                r.took.as_secs_f64(),
                r.faults.total_faults(),
                if r.recovered { ", recovered" } else { "" },
            );
            if !r.violations.is_empty() {
                // Say it now: a soak may run long after this seed.
                println!("    {}", r.violations.join("\n    "));
            }
        })
        .collect()
        .await;

    let mut faults = FaultReport::default();
    let mut helm_controller_faults = FaultReport::default();
    for r in &results {
        faults.merge(&r.faults);
        helm_controller_faults.merge(&r.helm_controller_faults);
    }
    let failed: Vec<&RunResult> = results
        .iter()
        .filter(|r| !r.violations.is_empty())
        .collect();
    let deleted = results
        .iter()
        .filter(|r| r.scenario.delete.is_some())
        .count();
    let foreign = |kinds: &[ForeignWrite]| {
        results
            .iter()
            .filter(|r| r.scenario.foreign.is_some_and(|(k, _)| kinds.contains(&k)))
            .count()
    };
    println!(
        "interleavings: {} seeds in {:.1}s: {} deleted ({} of them under our suspension, held by the fence; {} while flux-plunger held nothing of them, not judged), {} suspended by another manager ({} of them absorbed by our suspension), {} unsuspended by another manager, {} recovered; {} violating",
        results.len(),
        started.elapsed().as_secs_f64(),
        deleted,
        results.iter().filter(|r| r.fence_mattered).count(),
        results.iter().filter(|r| r.deleted_unheld).count(),
        foreign(&[ForeignWrite::SuspendByApply, ForeignWrite::SuspendByUpdate]),
        results.iter().filter(|r| r.absorbed_foreign_update).count(),
        foreign(&[ForeignWrite::UnsuspendByUpdate]),
        results.iter().filter(|r| r.recovered).count(),
        failed.len(),
    );
    // Not an invariant (a fault may defer a recovery until the release next
    // changes), but worth seeing: live, never suspended by anyone else, and
    // still stuck when the run settled.
    let unrecovered: Vec<u64> = results
        .iter()
        .filter(|r| {
            !r.recovered
                && r.scenario.delete.is_none()
                && r.scenario
                    .foreign
                    .is_none_or(|(k, _)| k == ForeignWrite::UnsuspendByUpdate)
        })
        .map(|r| r.scenario.seed)
        .collect();
    println!(
        "interleavings: live and suspended by nobody else, but not recovered: {} {unrecovered:?}",
        unrecovered.len()
    );
    println!("interleavings: flux-plunger's fault proxy: {faults}");
    println!("interleavings: helm-controller's fault proxy: {helm_controller_faults}");
    // FLUX_PLUNGER_TIMELINES=1 shows every run's timeline, not only a failing one's.
    let shown: Vec<&RunResult> = if std::env::var_os("FLUX_PLUNGER_TIMELINES").is_some() {
        results.iter().collect()
    } else {
        failed.clone()
    };
    for r in &shown {
        println!(
            "\n=== seed {} {} ===\nscenario: {:?}\nviolations:{}\nfaults: {}\nhelm-controller's faults: {}\ntimeline:\n{}",
            r.scenario.seed,
            if r.violations.is_empty() {
                "ok"
            } else {
                "VIOLATED"
            },
            r.scenario,
            if r.violations.is_empty() {
                " none".to_owned()
            } else {
                format!("\n  - {}", r.violations.join("\n  - "))
            },
            r.faults,
            r.helm_controller_faults,
            r.timeline
        );
    }
    if !failed.is_empty() {
        let seeds: Vec<String> = failed.iter().map(|r| r.scenario.seed.to_string()).collect();
        panic!(
            "{} of {} seeds violated an invariant; replay with FLUX_PLUNGER_SEEDS={} cargo test -p plunger --test interleavings -- --nocapture",
            failed.len(),
            results.len(),
            seeds.join(",")
        );
    }
    Ok(())
}

/// The checks are worth something only if they catch what the fence is
/// for: without it, a delete landing while the recovery holds its suspension
/// makes helm-controller skip the uninstall, and some run must say so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_fence_the_checks_catch_an_orphaned_release() -> Result<()> {
    let mut orphaned = Vec::new();
    for seed in 1..=4 {
        let scenario = Scenario {
            foreign: None,
            delete: Some(Trigger::AtStep(Step::Acquired)),
            step_delay_max: Duration::from_millis(250),
            helm_controller_delay_max: Duration::from_millis(10),
            fault_level: 0.0,
            helm_controller_fault_level: 0.0,
            unfenced: true,
            ..Scenario::from_seed(seed)
        };
        let result = run(scenario).await?;
        if result
            .violations
            .iter()
            .any(|v| v.contains("not uninstalled"))
        {
            orphaned.push(seed);
        }
    }
    println!("unfenced: seeds {orphaned:?} of 1..=4 were caught orphaning their release");
    assert!(
        !orphaned.is_empty(),
        "no unfenced run was caught orphaning its release"
    );
    Ok(())
}

/// One seeded run: arrange, race, settle, check.
async fn run(scenario: Scenario) -> Result<RunResult> {
    let started = Instant::now();
    let admin = control_plane().client().await?;
    let ns = TestNamespace::create(&admin, "interleave").await?;
    let hc = SimulatedHelmController::new(admin.clone(), &ns.name);

    // A release as helm-controller leaves it stuck: installed, its finalizer
    // on, the newest revision in a status Helm cannot upgrade from.
    ns.create_release(NAME, json!({})).await?;
    hc.install(NAME).await?;
    if !scenario.installed() {
        // The objects went with the uninstall that stored `uninstalled`.
        kube::Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(admin.clone(), &ns.name)
            .delete(
                &SimulatedHelmController::resources_name(NAME),
                &Default::default(),
            )
            .await?;
    }
    anyhow::ensure!(hc.handle(NAME).await? == Handled::AddedFinalizer);
    ns.create_storage_secret(NAME, 1, scenario.below_status)
        .await?;
    ns.create_storage_secret(NAME, 2, scenario.stuck_status)
        .await?;
    ns.create_storage_secret(NEIGHBOUR, 1, "uninstalling")
        .await?;
    ns.mark_stuck_saying(NAME, scenario.stuck_message).await?;
    let stuck_secret = plunger::names::storage_secret_name(NAME, 2);
    let secrets_before = secret_names(&ns).await?;

    // flux-plunger's requests go as the chart's ServiceAccount, under the
    // chart's admission guard; unfenced, it suspends without the fence,
    // which the guard refuses, so that one runs with the admin's rights.
    let identity = if scenario.unfenced {
        control_plane().kubeconfig_yaml(&testkit::control_plane::AuthInfo::AdminCertificate)
    } else {
        testkit::guard::shared()?.controller_kubeconfig()
    };
    let proxy =
        FaultProxy::forwarding_as(&identity, scenario.fault_plan(scenario.fault_level, 0)).await?;
    // helm-controller meets faults of its own; its decisions go to the same
    // journal, and the checks read the world directly.
    let hc_proxy = FaultProxy::in_front_of_control_plane(
        scenario.fault_plan(scenario.helm_controller_fault_level, 0x4843),
    )
    .await?;
    let mut faulty_hc = SimulatedHelmController::new(hc_proxy.client()?, &ns.name);
    faulty_hc.journal = hc.journal.clone();
    faulty_hc.purged = hc.purged.clone();
    let timeline = Timeline::default();
    let steps = Arc::new(tokio::sync::Notify::new());
    let wanted_step: Arc<Mutex<Vec<Step>>> = Arc::default();
    let reconciler = Arc::new(reconciler(
        proxy.client()?,
        &scenario,
        &timeline,
        steps.clone(),
        wanted_step.clone(),
    ));

    let stop = Arc::new(AtomicBool::new(false));
    let progress = Arc::new(Progress::default());
    let loops = Loops {
        stop: stop.clone(),
        progress: progress.clone(),
        timeline: timeline.clone(),
    };
    timeline.start();
    let controller = tokio::spawn(controller_loop(
        reconciler,
        proxy.client()?,
        ns.name.clone(),
        SeededRng::fork(scenario.seed, "controller"),
        scenario.controller_delay_max,
        loops.clone(),
    ));
    let helm_controller = tokio::spawn(helm_controller_loop(
        faulty_hc,
        SeededRng::fork(scenario.seed, "helm-controller"),
        scenario.helm_controller_delay_max,
        loops.clone(),
    ));

    let acted = act(&scenario, &ns, &timeline, &steps, &wanted_step).await?;
    let foreign_owned = acted.foreign_owned;
    let settled = settle(&ns, &progress).await?;
    stop.store(true, Ordering::SeqCst);
    let _ = tokio::time::timeout(Duration::from_secs(30), controller).await;
    let _ = tokio::time::timeout(Duration::from_secs(30), helm_controller).await;
    if !settled {
        timeline.note("test", "did not settle");
    }

    let mut violations = Vec::new();
    if !settled {
        violations.push(format!(
            "did not settle within {SETTLE_TIMEOUT:?}: {}",
            describe(ns.releases().get_opt(NAME).await?.as_ref())
        ));
    }
    let foreign_suspended = foreign_owned == Some(true);
    check(
        &scenario,
        &ns,
        &hc,
        &acted,
        &secrets_before,
        &stuck_secret,
        &mut violations,
    )
    .await?;
    let recovered = !secret_names(&ns).await?.contains(&stuck_secret);
    let fence_mattered = !foreign_suspended
        && hc
            .decisions_for(NAME)
            .contains(&Handled::UninstallSkippedBecauseSuspended);
    Ok(RunResult {
        fence_mattered,
        deleted_unheld: scenario.delete.is_some() && !acted.held_at_delete,
        absorbed_foreign_update: foreign_owned == Some(false),
        scenario,
        violations,
        timeline: timeline.render(),
        faults: proxy.report(),
        helm_controller_faults: hc_proxy.report(),
        recovered,
        took: started.elapsed(),
    })
}
