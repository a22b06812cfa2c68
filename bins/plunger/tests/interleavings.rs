//! Randomized interleavings (issue #10): many seeded runs of "a stuck release
//! is being recovered while it is deleted", against the real apiserver.
//!
//! Each run has its own namespace and draws everything from its seed: random
//! delays at every recovery step of an in-process `Reconciler` (through its
//! `TestHooks`), between the simulated helm-controller's passes and between
//! the controller's passes, a delete that lands at a random moment (after a
//! random time, or as the recovery reaches a random step), a suspension by
//! another manager before it or not, and a fault proxy between flux-plunger's
//! client (its reads, writes and watch) and the apiserver; in some runs
//! helm-controller meets faults of its own. The test's own writes and checks
//! use a direct client.
//!
//! Once a run settles (the release is gone, or nothing changes while both
//! controllers keep passing over it) the invariants of SPEC §4-§5 are checked:
//! - a release deleted without a foreign suspension was uninstalled;
//! - a release suspended by another manager, then deleted, kept its resources;
//! - nothing is left Terminating once helm-controller has answered;
//! - a live, settled release carries no suspension or fence of ours;
//! - no storage Secret but the stuck revision was deleted.
//!
//! A failing seed is printed with its timeline and can be replayed:
//! `FLUX_PLUNGER_SEEDS=17,23 cargo test -p plunger --test interleavings -- --nocapture`.
//! Which requests a fault hits depends on how the run's tasks interleave in
//! time, so a replay runs the same scenario and fault rates, not always the
//! very same order. CI runs a fixed seed set; `make soak` runs many more
//! (`FLUX_PLUNGER_SEED_COUNT`, from `FLUX_PLUNGER_SEED_BASE`).

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use futures::{FutureExt, StreamExt};
use kube::api::{DeleteParams, DynamicObject, Patch, PatchParams};
use kube::runtime::{WatchStreamExt, watcher};
use plunger::decide::is_of_interest;
use plunger::events::Events;
use plunger::names::{FIELD_MANAGER, HELMRELEASE_API_VERSION, HELMRELEASE_KIND};
use plunger::reconcile::{Outcome, Reconciler, Step, TestHooks};
use plunger::release::{ReleaseView, helmreleases};
use plunger::timings::Timings;
use serde_json::json;
use testkit::{
    FaultPlan, FaultProxy, FaultReport, Handled, Rates, SeededRng, SimulatedHelmController,
    TestNamespace, control_plane,
};

/// The seeds CI runs: fixed, so a red CI is a seed anyone can replay.
const CI_SEEDS: std::ops::RangeInclusive<u64> = 1..=48;
/// Runs at a time: each mostly waits on its own delays.
const DEFAULT_PARALLEL: usize = 4;
/// A run that has not settled by then is a violation: something is stuck.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(90);
const NAME: &str = "web";
/// Another release's storage in the same namespace: never ours to delete.
const NEIGHBOUR: &str = "neighbour";
/// The managers that suspend a release in these runs, besides us.
const MIGRATION_MANAGER: &str = "migration-tool";
const FLUX_CLI_MANAGER: &str = "flux";
const BACKUP_MANAGER: &str = "backup-controller";

/// The steps a delete or a foreign suspension may be timed to, the ones
/// under our suspension twice as often: there the fence has work to do.
const STEPS: [Step; 7] = [
    Step::BeforeAcquire,
    Step::BeforeForcedAcquire,
    Step::Acquired,
    Step::Acquired,
    Step::Annotated,
    Step::Annotated,
    Step::BeforeLift,
];

#[derive(Debug, Clone, Copy)]
enum Trigger {
    /// This long after the run starts.
    After(Duration),
    /// When the recovery reaches this step (or after a while, if it never does).
    AtStep(Step),
}

/// Another manager's write of `spec.suspend`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ForeignWrite {
    /// A suspension by a forced server-side apply (a migration tool): it
    /// co-owns `spec.suspend` even when ours already set it.
    SuspendByApply,
    /// A suspension by a merge patch (`flux suspend`, kubectl): it owns
    /// `spec.suspend` only if it changed the value.
    SuspendByUpdate,
    /// `suspend: false` by a merge patch (a backup controller, `flux
    /// resume`): an owner of `false` that only a forced acquire can take
    /// over, or the end of our suspension mid-recovery. Not a suspension.
    UnsuspendByUpdate,
}

/// Everything a seed decides.
#[derive(Debug, Clone)]
struct Scenario {
    seed: u64,
    below_status: &'static str,
    stuck_status: &'static str,
    foreign: Option<(ForeignWrite, Trigger)>,
    delete: Option<Trigger>,
    step_delay_max: Duration,
    controller_delay_max: Duration,
    helm_controller_delay_max: Duration,
    fault_level: f64,
    /// Faults on helm-controller's own requests (a proxy of its own).
    helm_controller_fault_level: f64,
    /// Suspend without the fence: only for the test that shows the checks
    /// catch the orphaning the fence prevents.
    unfenced: bool,
}

impl Scenario {
    fn from_seed(seed: u64) -> Self {
        let mut rng = SeededRng::fork(seed, "scenario");
        let trigger = |rng: &mut SeededRng| match rng.below(10) {
            // At once: before the controller's first pass, most likely.
            0 | 1 => Trigger::After(Duration::ZERO),
            2..=5 => Trigger::AtStep(*rng.pick(&STEPS)),
            _ => Trigger::After(rng.delay_up_to(Duration::from_millis(1_200))),
        };
        let foreign = rng.chance(0.45).then(|| {
            let kind = *rng.pick(&[
                ForeignWrite::SuspendByApply,
                ForeignWrite::SuspendByUpdate,
                ForeignWrite::UnsuspendByUpdate,
            ]);
            (kind, trigger(&mut rng))
        });
        let delete = rng.chance(0.7).then(|| trigger(&mut rng));
        let ms = Duration::from_millis;
        Self {
            seed,
            // Statuses that explain "has no deployed releases" below too: only
            // the processed guard keeps the revision below from being reclaimed.
            below_status: *rng.pick(&["superseded", "failed", "pending-upgrade"]),
            stuck_status: *rng.pick(&["uninstalling", "failed", "pending-upgrade", "unknown"]),
            foreign,
            delete,
            step_delay_max: *rng.pick(&[ms(0), ms(20), ms(80), ms(250)]),
            controller_delay_max: *rng.pick(&[ms(5), ms(50), ms(150)]),
            helm_controller_delay_max: *rng.pick(&[ms(10), ms(80), ms(300)]),
            fault_level: *rng.pick(&[0.0, 0.02, 0.05, 0.08]),
            helm_controller_fault_level: *rng.pick(&[0.0, 0.0, 0.03]),
            unfenced: false,
        }
    }

    /// Faults on every verb; conflicts on writes; 429s rarer, each costs a
    /// second of `Retry-After`. `stream` keeps two proxies' draws apart.
    fn fault_plan(&self, level: f64, stream: u64) -> FaultPlan {
        let rates = Rates {
            reset_before: level,
            reset_after: level,
            internal_error: level,
            unavailable: level,
            conflict: level,
            too_many_requests: level / 4.0,
            latency: if level > 0.0 { 0.3 } else { 0.0 },
        };
        let mut plan = FaultPlan::every_verb(self.seed ^ stream, rates);
        plan.max_latency = Duration::from_millis(40);
        plan
    }
}

/// What happened in a run, in order, for the report of a failing seed.
#[derive(Clone, Default)]
struct Timeline {
    started: Arc<Mutex<Option<Instant>>>,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Timeline {
    fn start(&self) {
        *self.started.lock().unwrap() = Some(Instant::now());
    }

    fn note(&self, who: &str, what: impl std::fmt::Display) {
        let at = self
            .started
            .lock()
            .unwrap()
            .map(|s| s.elapsed().as_millis())
            .unwrap_or_default();
        self.lines
            .lock()
            .unwrap()
            .push(format!("{at:>6} ms  {who:<8} {what}"));
    }

    fn render(&self) -> String {
        self.lines.lock().unwrap().join("\n")
    }
}

/// What the loops report to the settle check.
#[derive(Default)]
struct Progress {
    /// Passes of the simulated helm-controller.
    helm_controller_passes: AtomicU64,
    /// The resourceVersion flux-plunger's controller last saw from its watch,
    /// while it waits for a change with nothing pending (no event, requeue
    /// or retry); `None` while it works or has something to do.
    controller_idle_at: Mutex<Option<String>>,
}

/// What a run's loops share: when to stop, what they report, their log.
#[derive(Clone)]
struct Loops {
    stop: Arc<AtomicBool>,
    progress: Arc<Progress>,
    timeline: Timeline,
}

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
        "interleavings: {} seeds in {:.1}s: {} deleted ({} of them under our suspension, held by the fence), {} suspended by another manager ({} of them absorbed by our suspension), {} unsuspended by another manager, {} recovered; {} violating",
        results.len(),
        started.elapsed().as_secs_f64(),
        deleted,
        results.iter().filter(|r| r.fence_mattered).count(),
        foreign(&[ForeignWrite::SuspendByApply, ForeignWrite::SuspendByUpdate]),
        results.iter().filter(|r| r.absorbed_foreign_update).count(),
        foreign(&[ForeignWrite::UnsuspendByUpdate]),
        results.iter().filter(|r| r.recovered).count(),
        failed.len(),
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
            "\n=== seed {} {} ===\nscenario: {:?}\nviolations:\n  - {}\nfaults: {}\nhelm-controller's faults: {}\ntimeline:\n{}",
            r.scenario.seed,
            if r.violations.is_empty() {
                "ok"
            } else {
                "VIOLATED"
            },
            r.scenario,
            r.violations.join("\n  - "),
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
    anyhow::ensure!(hc.handle(NAME).await? == Handled::AddedFinalizer);
    ns.create_storage_secret(NAME, 1, scenario.below_status)
        .await?;
    ns.create_storage_secret(NAME, 2, scenario.stuck_status)
        .await?;
    ns.create_storage_secret(NEIGHBOUR, 1, "uninstalling")
        .await?;
    ns.mark_stuck(NAME).await?;
    let stuck_secret = plunger::names::storage_secret_name(NAME, 2);
    let secrets_before = secret_names(&ns).await?;

    let proxy =
        FaultProxy::in_front_of_control_plane(scenario.fault_plan(scenario.fault_level, 0)).await?;
    // helm-controller meets faults of its own; its decisions go to the same
    // journal, and the checks read the world directly.
    let hc_proxy = FaultProxy::in_front_of_control_plane(
        scenario.fault_plan(scenario.helm_controller_fault_level, 0x4843),
    )
    .await?;
    let mut faulty_hc = SimulatedHelmController::new(hc_proxy.client()?, &ns.name);
    faulty_hc.journal = hc.journal.clone();
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

    let foreign_owned = act(&scenario, &ns, &timeline, &steps, &wanted_step).await?;
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
        foreign_suspended,
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

fn reconciler(
    client: kube::Client,
    scenario: &Scenario,
    timeline: &Timeline,
    steps: Arc<tokio::sync::Notify>,
    wanted_step: Arc<Mutex<Vec<Step>>>,
) -> Reconciler {
    let mut reconciler = Reconciler::new(
        client.clone(),
        Events::new(client, "flux-plunger", None),
        Timings::default(),
    );
    let rng = Arc::new(Mutex::new(SeededRng::fork(scenario.seed, "steps")));
    let max = scenario.step_delay_max;
    let timeline = timeline.clone();
    reconciler.hooks = TestHooks {
        unfenced: scenario.unfenced,
        pause: Some(Arc::new(move |step| {
            timeline.note("step", format!("{step:?}"));
            // The actor waits for this step: wake it, and let the delete race
            // the rest of this step.
            let mut wanted = wanted_step.lock().unwrap();
            if let Some(i) = wanted.iter().position(|s| *s == step) {
                wanted.remove(i);
                steps.notify_one();
            }
            let delay = rng.lock().unwrap().delay_up_to(max);
            tokio::time::sleep(delay).boxed()
        })),
    };
    reconciler
}

/// flux-plunger's controller as `flux-plunger` runs it (bins/flux-plunger's
/// controller.rs): a watch through the same faulty client, filtered by
/// `is_of_interest`, a pass per change, a requeue after `FenceHeld` or
/// `RateLimited`, a retry with backoff after an error, and otherwise nothing
/// until the next change. Polling instead would hide a pass that leaves work
/// behind without a change to wake the next one. The waits are shortened
/// (a fence recheck is 60 s in the product) and drawn from the seed.
async fn controller_loop(
    reconciler: Arc<Reconciler>,
    client: kube::Client,
    namespace: String,
    mut rng: SeededRng,
    delay_max: Duration,
    loops: Loops,
) {
    let Loops {
        stop,
        progress,
        timeline,
    } = loops;
    let config = watcher::Config::default().fields(&format!("metadata.name={NAME}"));
    let mut changes = watcher(helmreleases(client, &namespace), config)
        .default_backoff()
        .applied_objects()
        .boxed();
    let mut last_seen: Option<String> = None;
    let mut due = false;
    let mut requeue_at: Option<tokio::time::Instant> = None;
    while !stop.load(Ordering::SeqCst) {
        if !due {
            *progress.controller_idle_at.lock().unwrap() =
                requeue_at.is_none().then(|| last_seen.clone()).flatten();
            let requeue = requeue_at.unwrap_or_else(tokio::time::Instant::now);
            tokio::select! {
                change = changes.next() => match change {
                    Some(Ok(object)) => {
                        last_seen = object.metadata.resource_version.clone();
                        due |= is_of_interest(&ReleaseView::from_object(&object));
                    }
                    Some(Err(err)) => timeline.note("plunger", format!("watch: {err}")),
                    None => return,
                },
                _ = tokio::time::sleep_until(requeue), if requeue_at.is_some() => due = true,
                // Look at the stop flag now and then.
                _ = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
            continue;
        }
        *progress.controller_idle_at.lock().unwrap() = None;
        // Changes that came in meanwhile make one pass, not one each: the
        // controller's queue holds a release once however often it changes.
        while let Some(Some(change)) = changes.next().now_or_never() {
            if let Ok(object) = change {
                last_seen = object.metadata.resource_version.clone();
            }
        }
        due = false;
        requeue_at = None;
        let woken_at = last_seen.clone().unwrap_or_default();
        // The queue's and the scheduler's delay before a pass starts.
        tokio::time::sleep(rng.delay_up_to(delay_max)).await;
        match reconciler.reconcile(&namespace, NAME).await {
            Ok(outcome @ (Outcome::FenceHeld { .. } | Outcome::RateLimited { .. })) => {
                timeline.note("plunger", format!("{outcome:?} (woken at {woken_at})"));
                requeue_at = Some(tokio::time::Instant::now() + rng.delay_up_to(delay_max * 4));
            }
            Ok(outcome) => timeline.note("plunger", format!("{outcome:?} (woken at {woken_at})")),
            Err(err) => {
                timeline.note("plunger", format!("error: {err} (woken at {woken_at})"));
                let backoff = Duration::from_millis(10) + rng.delay_up_to(delay_max * 2);
                requeue_at = Some(tokio::time::Instant::now() + backoff);
            }
        }
    }
}

/// The simulated helm-controller, passing over the release at random times.
async fn helm_controller_loop(
    hc: SimulatedHelmController,
    mut rng: SeededRng,
    delay_max: Duration,
    loops: Loops,
) {
    let Loops {
        stop,
        progress,
        timeline,
    } = loops;
    while !stop.load(Ordering::SeqCst) {
        tokio::time::sleep(rng.delay_up_to(delay_max)).await;
        match hc.handle(NAME).await {
            Ok(handled) => {
                // Gone is a pass too: the settle check counts passes.
                if !matches!(handled, Handled::Reconciled | Handled::Gone) {
                    timeline.note("helm", format!("{handled:?}"));
                }
                progress
                    .helm_controller_passes
                    .fetch_add(1, Ordering::SeqCst);
            }
            Err(err) => timeline.note("helm", format!("error: {err:#}")),
        }
    }
}

/// The other actors: another manager's write of `spec.suspend`, then the
/// delete, each when its trigger fires. Returns whether another manager's
/// suspension owns `spec.suspend` after its write (`None`: no suspension).
async fn act(
    scenario: &Scenario,
    ns: &TestNamespace,
    timeline: &Timeline,
    steps: &tokio::sync::Notify,
    wanted_step: &Mutex<Vec<Step>>,
) -> Result<Option<bool>> {
    let mut foreign_owned = None;
    if let Some((kind, trigger)) = scenario.foreign {
        wait_for(trigger, steps, wanted_step).await;
        let (object, manager) = write_suspend_as_another_manager(ns, kind).await?;
        let owned = owns_suspend(&object, manager);
        timeline.note(
            "actor",
            format!("{kind:?} by {manager}; it owns spec.suspend: {owned}"),
        );
        if kind != ForeignWrite::UnsuspendByUpdate {
            foreign_owned = Some(owned);
        }
    }
    if let Some(trigger) = scenario.delete {
        wait_for(trigger, steps, wanted_step).await;
        ns.releases()
            .delete(NAME, &DeleteParams::default())
            .await
            .context("deleting the release")?;
        timeline.note("actor", "deleted the release");
    }
    Ok(foreign_owned)
}

async fn wait_for(trigger: Trigger, steps: &tokio::sync::Notify, wanted_step: &Mutex<Vec<Step>>) {
    match trigger {
        Trigger::After(delay) => tokio::time::sleep(delay).await,
        Trigger::AtStep(step) => {
            wanted_step.lock().unwrap().push(step);
            // A recovery may never reach the step (a deferred acquire, a
            // release already recovered): then act a little later anyway.
            let _ = tokio::time::timeout(Duration::from_millis(1_500), steps.notified()).await;
            wanted_step.lock().unwrap().retain(|s| *s != step);
        }
    }
}

async fn write_suspend_as_another_manager(
    ns: &TestNamespace,
    kind: ForeignWrite,
) -> Result<(DynamicObject, &'static str)> {
    let update = |manager: &'static str, suspend: bool| async move {
        let params = PatchParams {
            field_manager: Some(manager.into()),
            ..Default::default()
        };
        let object = ns
            .releases()
            .patch(
                NAME,
                &params,
                &Patch::Merge(json!({"spec": {"suspend": suspend}})),
            )
            .await?;
        anyhow::Ok((object, manager))
    };
    match kind {
        ForeignWrite::SuspendByApply => {
            let body = json!({"apiVersion": HELMRELEASE_API_VERSION, "kind": HELMRELEASE_KIND,
                "metadata": {"name": NAME}, "spec": {"suspend": true}});
            let object = ns
                .releases()
                .patch(
                    NAME,
                    &PatchParams::apply(MIGRATION_MANAGER).force(),
                    &Patch::Apply(body),
                )
                .await?;
            Ok((object, MIGRATION_MANAGER))
        }
        ForeignWrite::SuspendByUpdate => update(FLUX_CLI_MANAGER, true).await,
        ForeignWrite::UnsuspendByUpdate => update(BACKUP_MANAGER, false).await,
    }
}

/// Waits until the release is gone, or until it stays the same while
/// helm-controller passes over it twice and flux-plunger's controller has
/// seen that very version and has nothing left to do, twice running. False
/// when neither happens in time.
async fn settle(ns: &TestNamespace, progress: &Progress) -> Result<bool> {
    let deadline = Instant::now() + SETTLE_TIMEOUT;
    let mut quiet = 0;
    while Instant::now() < deadline {
        let Some(before) = resource_version(ns).await? else {
            return Ok(true);
        };
        let passes = || progress.helm_controller_passes.load(Ordering::SeqCst);
        let start = passes();
        while passes() < start + 2 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        let after = resource_version(ns).await?;
        let idle_at = progress.controller_idle_at.lock().unwrap().clone();
        if after.as_ref() == Some(&before) && idle_at == after {
            quiet += 1;
            if quiet >= 2 {
                return Ok(true);
            }
        } else {
            quiet = 0;
        }
    }
    Ok(false)
}

async fn resource_version(ns: &TestNamespace) -> Result<Option<String>> {
    Ok(ns
        .releases()
        .get_opt(NAME)
        .await?
        .and_then(|o| o.metadata.resource_version))
}

/// The invariants, on the settled world, read directly.
async fn check(
    scenario: &Scenario,
    ns: &TestNamespace,
    hc: &SimulatedHelmController,
    foreign_suspended: bool,
    secrets_before: &BTreeSet<String>,
    stuck_secret: &str,
    violations: &mut Vec<String>,
) -> Result<()> {
    let secrets_after = secret_names(ns).await?;
    for lost in secrets_before.difference(&secrets_after) {
        if lost != stuck_secret {
            violations.push(format!(
                "storage Secret {lost} was deleted; only {stuck_secret} may be"
            ));
        }
    }
    let release = ns.releases().get_opt(NAME).await?;
    let decisions = hc.decisions_for(NAME);
    let resources = hc.resources_exist(NAME).await?;
    if scenario.delete.is_some() {
        if let Some(object) = &release {
            violations.push(format!(
                "left Terminating after helm-controller answered ({decisions:?}): {}",
                describe(Some(object))
            ));
        }
        if foreign_suspended {
            if !resources {
                violations.push(format!(
                    "suspended by another manager, then deleted: its resources must stay, but were uninstalled ({decisions:?})"
                ));
            }
        } else if !decisions.contains(&Handled::Uninstalled) || resources {
            violations.push(format!(
                "deleted without a foreign suspension but not uninstalled: decisions {decisions:?}, resources left: {resources}"
            ));
        }
    } else {
        let Some(object) = &release else {
            violations.push("a release nobody deleted is gone".to_owned());
            return Ok(());
        };
        let view = ReleaseView::from_object(object);
        if view.has_fence() {
            violations.push(format!(
                "our fence is left on a live, settled release: {}",
                describe(Some(object))
            ));
        }
        if we_own_suspend_or_finalizers(object) {
            violations.push(format!(
                "flux-plunger still owns spec.suspend or finalizers of a live, settled release: {}",
                describe(Some(object))
            ));
        }
        if view.suspend && !foreign_suspended {
            violations.push(format!(
                "suspended, and no other manager suspended it: {}",
                describe(Some(object))
            ));
        }
        if !resources {
            violations.push("a live release lost its resources".to_owned());
        }
    }
    Ok(())
}

async fn secret_names(ns: &TestNamespace) -> Result<BTreeSet<String>> {
    Ok(ns
        .secrets()
        .list(&Default::default())
        .await?
        .items
        .into_iter()
        .filter_map(|s| s.metadata.name)
        .collect())
}

/// Whether `manager` owns `spec.suspend` in any managedFields entry.
fn owns_suspend(object: &DynamicObject, manager: &str) -> bool {
    object.metadata.managed_fields.iter().flatten().any(|e| {
        e.manager.as_deref() == Some(manager)
            && e.fields_v1
                .as_ref()
                .is_some_and(|f| f.0.pointer("/f:spec/f:suspend").is_some())
    })
}

fn we_own_suspend_or_finalizers(object: &DynamicObject) -> bool {
    object.metadata.managed_fields.iter().flatten().any(|e| {
        e.manager.as_deref() == Some(FIELD_MANAGER)
            && e.fields_v1.as_ref().is_some_and(|f| {
                f.0.pointer("/f:spec/f:suspend").is_some()
                    || f.0.pointer("/f:metadata/f:finalizers").is_some()
            })
    })
}

fn describe(object: Option<&DynamicObject>) -> String {
    let Some(object) = object else {
        return "gone".to_owned();
    };
    let view = ReleaseView::from_object(object);
    let owners: Vec<String> = object
        .metadata
        .managed_fields
        .iter()
        .flatten()
        .map(|e| {
            format!(
                "{}/{}",
                e.manager.as_deref().unwrap_or("?"),
                e.operation.as_deref().unwrap_or("?")
            )
        })
        .collect();
    format!(
        "terminating {}, suspend {}, finalizers {:?}, generation {:?}, observed {:?}, managers {owners:?}",
        view.terminating, view.suspend, view.finalizers, view.generation, view.observed_generation
    )
}
