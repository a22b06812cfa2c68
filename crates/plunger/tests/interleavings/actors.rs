//! The parties of a run besides the checks: flux-plunger's controller, the
//! simulated helm-controller, the other managers and the delete, and the
//! wait until they have settled.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use futures::{FutureExt, StreamExt};
use kube::api::{DeleteParams, DynamicObject};
use kube::runtime::{WatchStreamExt, watcher};
use plunger::decide::is_of_interest;
use plunger::events::Events;
use plunger::reconcile::{Reconciler, Step, TestHooks};
use plunger::release::api::helmreleases;
use plunger::release::view::ReleaseView;
use plunger::timings::Timings;
use testkit::{Handled, SeededRng, SimulatedHelmController, TestNamespace};

use super::checks::owns_suspend;
use super::scenario::{ForeignWrite, Scenario, Trigger};
use super::{NAME, SETTLE_TIMEOUT};

/// The managers that write `spec.suspend` in these runs, besides us.
const MIGRATION_MANAGER: &str = "migration-tool";
const FLUX_CLI_MANAGER: &str = "flux";
const BACKUP_MANAGER: &str = "backup-controller";

/// What happened in a run, in order, for the report of a failing seed.
#[derive(Clone, Default)]
pub struct Timeline {
    started: Arc<Mutex<Option<Instant>>>,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Timeline {
    pub fn start(&self) {
        *self.started.lock().unwrap() = Some(Instant::now());
    }

    pub fn note(&self, who: &str, what: impl std::fmt::Display) {
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

    pub fn render(&self) -> String {
        self.lines.lock().unwrap().join("\n")
    }
}

/// What the loops report to the settle check.
#[derive(Default)]
pub struct Progress {
    /// Passes of the simulated helm-controller.
    pub helm_controller_passes: AtomicU64,
    /// The resourceVersion flux-plunger's controller last saw from its watch,
    /// while it waits for a change with nothing pending (no event, requeue
    /// or retry); `None` while it works or has something to do.
    pub controller_idle_at: Mutex<Option<String>>,
}

/// What a run's loops share: when to stop, what they report, their log.
#[derive(Clone)]
pub struct Loops {
    pub stop: Arc<AtomicBool>,
    pub progress: Arc<Progress>,
    pub timeline: Timeline,
}

/// flux-plunger's reconciler on `client`, sleeping a seeded delay at every
/// step and waking the actors that wait for one.
pub fn reconciler(
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
pub async fn controller_loop(
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
            Ok(outcome) if outcome.recheck_after().is_some() => {
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
pub async fn helm_controller_loop(
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

/// What the other actors did.
pub struct Acted {
    /// Whether another manager's suspension owns `spec.suspend` after its
    /// write (`None`: no suspension).
    pub foreign_owned: Option<bool>,
    /// The release carried flux-plunger's fence or suspension when the
    /// delete landed, as the apiserver's answer to the delete shows it.
    pub held_at_delete: bool,
}

/// The other actors: another manager's write of `spec.suspend`, then the
/// delete, each when its trigger fires.
pub async fn act(
    scenario: &Scenario,
    ns: &TestNamespace,
    timeline: &Timeline,
    steps: &tokio::sync::Notify,
    wanted_step: &Mutex<Vec<Step>>,
) -> Result<Acted> {
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
    let mut held_at_delete = false;
    if let Some(trigger) = scenario.delete {
        wait_for(trigger, steps, wanted_step).await;
        let deleted = ns
            .releases()
            .delete(NAME, &DeleteParams::default())
            .await
            .context("deleting the release")?;
        // The release as the delete left it (terminating, so no finalizer
        // can be added any more); gone at once if nothing held it.
        held_at_delete = deleted.left().is_some_and(|object| {
            let view = ReleaseView::from_object(&object);
            view.has_fence() || view.suspended_by_us()
        });
        timeline.note(
            "actor",
            format!("deleted the release; flux-plunger held it: {held_at_delete}"),
        );
    }
    Ok(Acted {
        foreign_owned,
        held_at_delete,
    })
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
    let (manager, object) = match kind {
        ForeignWrite::SuspendByApply => (
            MIGRATION_MANAGER,
            ns.apply_suspend_as(NAME, MIGRATION_MANAGER, true).await?,
        ),
        ForeignWrite::SuspendByUpdate => (
            FLUX_CLI_MANAGER,
            ns.update_suspend_as(NAME, FLUX_CLI_MANAGER, true).await?,
        ),
        ForeignWrite::UnsuspendByUpdate => (
            BACKUP_MANAGER,
            ns.update_suspend_as(NAME, BACKUP_MANAGER, false).await?,
        ),
    };
    Ok((object, manager))
}

/// Waits until the release is gone, or until it stays the same while
/// helm-controller passes over it twice and flux-plunger's controller has
/// seen that very version and has nothing left to do, twice running. False
/// when neither happens in time.
pub async fn settle(ns: &TestNamespace, progress: &Progress) -> Result<bool> {
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
