//! What a seed decides: the statuses, the delays, the fault levels, and when
//! the delete and another manager's write land.

use std::time::Duration;

use plunger::reconcile::Step;
use testkit::{FaultPlan, Rates, SeededRng};

/// The steps a delete or a foreign suspension may be timed to, the ones
/// under our suspension twice as often: there the fence has work to do.
pub const STEPS: [Step; 7] = [
    Step::BeforeAcquire,
    Step::BeforeForcedAcquire,
    Step::Acquired,
    Step::Acquired,
    Step::Annotated,
    Step::Annotated,
    Step::BeforeLift,
];

#[derive(Debug, Clone, Copy)]
pub enum Trigger {
    /// This long after the run starts.
    After(Duration),
    /// When the recovery reaches this step (or after a while, if it never does).
    AtStep(Step),
}

/// Another manager's write of `spec.suspend`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ForeignWrite {
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
pub struct Scenario {
    pub seed: u64,
    pub below_status: &'static str,
    pub stuck_status: &'static str,
    /// How helm-controller's `Ready` message says the release is stuck, in
    /// one of the spellings it writes over `stuck_status` (SPEC §4.6).
    pub stuck_message: &'static str,
    pub foreign: Option<(ForeignWrite, Trigger)>,
    pub delete: Option<Trigger>,
    pub step_delay_max: Duration,
    pub controller_delay_max: Duration,
    pub helm_controller_delay_max: Duration,
    pub fault_level: f64,
    /// Faults on helm-controller's own requests (a proxy of its own).
    pub helm_controller_fault_level: f64,
    /// Suspend without the fence: only for the test that shows the checks
    /// catch the orphaning the fence prevents.
    pub unfenced: bool,
}

/// What helm-controller's `Ready` says over a newest revision in `status`:
/// its first upgrade refused, then its install refused (Helm 3 and 4) over an
/// `uninstalled` one, or its state machine stopped over an `uninstalling` or
/// `unknown` one its history names.
fn messages_over(status: &str) -> &'static [&'static str] {
    match status {
        "uninstalled" => &[
            "has no deployed releases",
            "cannot re-use a name that is still in use",
            "cannot reuse a name that is still in use",
        ],
        "uninstalling" => &[
            "has no deployed releases",
            "unable to determine state for release with status 'uninstalling'",
        ],
        _ => &[
            "has no deployed releases",
            "unable to determine state for release with status 'unknown'",
        ],
    }
}

impl Scenario {
    /// Whether the release has anything installed: Helm writes a newest
    /// `uninstalled` only after deleting the objects, and keeps the revisions
    /// below only as history, so such a release has none.
    pub fn installed(&self) -> bool {
        self.stuck_status != "uninstalled"
    }

    pub fn from_seed(seed: u64) -> Self {
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
        // Statuses that explain "has no deployed releases" below too: only
        // the processed guard keeps the revision below from being reclaimed.
        let below_status = *rng.pick(&["superseded", "uninstalled", "unknown"]);
        // The statuses the real helm-controller leaves stuck.
        let stuck_status = *rng.pick(&["uninstalling", "uninstalled", "unknown"]);
        // Helm writes `uninstalled` only after deleting the objects, so a
        // release whose every revision says so has nothing installed, which
        // the world's installed resources would contradict (and nothing for a
        // delete to uninstall). Below the stuck revision that is what the
        // recovery leaves once it reclaimed it, and a delete landing between
        // its last read and its Secret delete then has no revision left to
        // uninstall (a known limit, docs/helm-controller.md): below the stuck
        // one, `unknown` instead of `uninstalled`.
        let below_status = if below_status == "uninstalled" {
            "unknown"
        } else {
            below_status
        };
        // Drawn last, so that every draw above stays what a seed drew before.
        let stuck_message = *rng.pick(messages_over(stuck_status));
        Self {
            seed,
            below_status,
            stuck_status,
            stuck_message,
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
    pub fn fault_plan(&self, level: f64, stream: u64) -> FaultPlan {
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
