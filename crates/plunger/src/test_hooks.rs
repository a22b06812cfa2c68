//! Test-only knobs, compiled in only with the `test-hooks` feature (which
//! `cargo test --workspace` turns on through testkit; a release build of a
//! binary alone never has it).
//!
//! ## Fail points
//!
//! Every write of SPEC §4, §5 and §8 has a named point right before it and
//! right after it (the [`Step`]s of a recovery, the [`SweepStep`]s of the
//! pre-delete hook). A test build of any of the three binaries can be held at
//! such a point from its environment:
//!
//! - `FLUX_PLUNGER_TEST_PAUSE_AT=POINT[,POINT...]` (the names of
//!   [`Step::name`] and [`SweepStep::name`], e.g. `before-delete-storage`;
//!   `NAME@N` for the N-th time the point is reached, e.g. the sweep's
//!   fourth release) with `FLUX_PLUNGER_TEST_PAUSE_FILE=PATH`: when the
//!   process reaches a listed point it writes the entry as listed to
//!   `PATH.reached` (atomically, by a rename), then waits (at most 120 s)
//!   until `PATH.release` exists, removes it, and goes on. Each entry pauses
//!   once per process; several entries pause one after the other, so a test
//!   can act at the first (land a delete) and act again at the second.
//! - While the process waits at a point, the test can SIGKILL it: that is a
//!   crash right before (or right after) that write, with nothing flushed or
//!   undone. The crash suites (`tests/crash.rs` of each binary) do that at
//!   every point, then restart the binary and check the invariants.
//! - `FLUX_PLUNGER_TEST_UNFENCED=1` (controller): suspend without the fence,
//!   to show the orphaning the fence prevents.
//! - `FLUX_PLUNGER_TEST_PANIC_AT=POINT` (controller, drain): panic when a
//!   recovery reaches that [`Step`], to show what the process does when its
//!   work ends unexpectedly.

use std::time::Duration;

/// Points inside a recovery where a test can act (a delete, a foreign
/// write, a crash): one right before and one right after every write of
/// SPEC §4 and §5, and one between the storage listing and the acquire
/// (where helm-controller's own progress can overtake a pass).
/// A test build of a binary is paused at them by name (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// The storage was listed and the revision to reclaim chosen; the
    /// acquire comes next.
    Planned,
    /// The unforced acquire, locked on the read that planned the recovery,
    /// comes next.
    BeforeAcquire,
    /// The unforced acquire conflicted and the release was read again; the
    /// forced acquire comes next.
    BeforeForcedAcquire,
    /// The suspension and fence are held (right after the acquire, forced or
    /// not); the annotation comes next.
    Acquired,
    /// The annotation is written, and its answer showed the release live;
    /// the storage Secret's delete comes next.
    Annotated,
    /// A storage Secret's delete comes next: in a recovery, once the
    /// annotation's answer showed the release live; on a release being deleted, an
    /// `uninstalled` newest revision above live ones.
    BeforeDeleteStorage,
    /// The storage Secret is deleted (or was already gone).
    AfterDeleteStorage,
    /// A lift of our suspension or fence is about to be sent.
    BeforeLift,
    /// A lift was accepted.
    AfterLift,
    /// The drop of our fence (no suspension of ours left) is about to be sent.
    BeforeDropFence,
    /// The drop of our fence was accepted.
    AfterDropFence,
    /// The history of a release being deleted is about to be written.
    BeforeHistoryWrite,
    /// The history was written; the lift or the reconcile request comes next.
    AfterHistoryWrite,
    /// The reconcile request is about to be written.
    BeforeReconcileRequest,
    /// The reconcile request was written.
    AfterReconcileRequest,
    /// A guarded patch is about to be sent: it removes a copy of the fence
    /// another manager also lists, or lets go where an apply was refused.
    BeforeGuardedPatch,
    /// A guarded patch was accepted.
    AfterGuardedPatch,
}

impl Step {
    /// Every step, in the order a recovery (then a delete) meets them.
    pub const ALL: [Step; 17] = [
        Step::Planned,
        Step::BeforeAcquire,
        Step::BeforeForcedAcquire,
        Step::Acquired,
        Step::Annotated,
        Step::BeforeDeleteStorage,
        Step::AfterDeleteStorage,
        Step::BeforeLift,
        Step::AfterLift,
        Step::BeforeDropFence,
        Step::AfterDropFence,
        Step::BeforeHistoryWrite,
        Step::AfterHistoryWrite,
        Step::BeforeReconcileRequest,
        Step::AfterReconcileRequest,
        Step::BeforeGuardedPatch,
        Step::AfterGuardedPatch,
    ];

    /// The name `FLUX_PLUNGER_TEST_PAUSE_AT` knows it by.
    pub fn name(self) -> &'static str {
        match self {
            Step::Planned => "planned",
            Step::BeforeAcquire => "before-acquire",
            Step::BeforeForcedAcquire => "before-forced-acquire",
            Step::Acquired => "acquired",
            Step::Annotated => "annotated",
            Step::BeforeDeleteStorage => "before-delete-storage",
            Step::AfterDeleteStorage => "after-delete-storage",
            Step::BeforeLift => "before-lift",
            Step::AfterLift => "after-lift",
            Step::BeforeDropFence => "before-drop-fence",
            Step::AfterDropFence => "after-drop-fence",
            Step::BeforeHistoryWrite => "before-history-write",
            Step::AfterHistoryWrite => "after-history-write",
            Step::BeforeReconcileRequest => "before-reconcile-request",
            Step::AfterReconcileRequest => "after-reconcile-request",
            Step::BeforeGuardedPatch => "before-guarded-patch",
            Step::AfterGuardedPatch => "after-guarded-patch",
        }
    }
}

/// Test-only switches: a pause at each [`Step`], and the fence turned off so
/// that a test can show the orphaning the fence prevents.
#[cfg(feature = "test-hooks")]
#[derive(Default, Clone)]
pub struct TestHooks {
    pub unfenced: bool,
    #[allow(clippy::type_complexity)]
    pub pause: Option<
        std::sync::Arc<dyn Fn(Step) -> futures::future::BoxFuture<'static, ()> + Send + Sync>,
    >,
}

/// `timings` as the pre-delete hook runs with them: in a test build, the
/// retry window shortened for tests of failures that persist (the real one is
/// 180 s; `FLUX_PLUNGER_TEST_HOOK_RETRY_WINDOW_SECONDS`) and the pod wait for
/// tests of a pod stuck `Terminating` that need retries after it (the real one
/// is G + 10 s, at least 50 s; `FLUX_PLUNGER_TEST_HOOK_POD_WAIT_SECONDS`).
/// In a release build, `timings` unchanged.
pub fn hook_timings(timings: crate::timings::Timings) -> crate::timings::Timings {
    crate::timings::Timings {
        hook_retry_window: seconds_from("FLUX_PLUNGER_TEST_HOOK_RETRY_WINDOW_SECONDS")
            .unwrap_or(timings.hook_retry_window),
        hook_pod_wait: seconds_from("FLUX_PLUNGER_TEST_HOOK_POD_WAIT_SECONDS")
            .unwrap_or(timings.hook_pod_wait),
        ..timings
    }
}

fn seconds_from(var: &str) -> Option<Duration> {
    if !cfg!(feature = "test-hooks") {
        return None;
    }
    std::env::var(var)
        .ok()
        .and_then(|s| s.parse().ok())
        .map(Duration::from_secs)
}

/// The fail points of the pre-delete hook (SPEC §8): around the scale-down of
/// the Deployment, around each release's guarded JSON patch, and around the
/// removal of the leader Lease once no flux-plunger pod is left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SweepStep {
    /// The Deployment was read; its scale-down to 0 comes next.
    BeforeScaleDown,
    /// The Deployment is scaled to 0.
    ScaledDown,
    /// A release's patch (lift our suspension, remove the fence) comes next.
    BeforeReleasePatch,
    /// A release's patch was accepted.
    ReleasePatched,
    /// The summary is out and no pod is left; the Lease's delete comes next.
    BeforeLeaseDelete,
    /// The Lease is deleted.
    LeaseDeleted,
}

impl SweepStep {
    pub const ALL: [SweepStep; 6] = [
        SweepStep::BeforeScaleDown,
        SweepStep::ScaledDown,
        SweepStep::BeforeReleasePatch,
        SweepStep::ReleasePatched,
        SweepStep::BeforeLeaseDelete,
        SweepStep::LeaseDeleted,
    ];

    /// The name `FLUX_PLUNGER_TEST_PAUSE_AT` knows it by.
    pub fn name(self) -> &'static str {
        match self {
            SweepStep::BeforeScaleDown => "before-scale-down",
            SweepStep::ScaledDown => "scaled-down",
            SweepStep::BeforeReleasePatch => "before-release-patch",
            SweepStep::ReleasePatched => "release-patched",
            SweepStep::BeforeLeaseDelete => "before-lease-delete",
            SweepStep::LeaseDeleted => "lease-deleted",
        }
    }
}

/// Pauses at `point` if the environment asks for it (see the module doc); a
/// no-op in a build without the `test-hooks` feature.
pub(crate) async fn pause_at(point: &'static str) {
    #[cfg(feature = "test-hooks")]
    if let Some(pauser) = env_pauser() {
        pauser.pause(point).await;
    }
    #[cfg(not(feature = "test-hooks"))]
    let _ = point;
}

/// The pauses `FLUX_PLUNGER_TEST_PAUSE_AT` / `_FILE` ask for, read once.
#[cfg(feature = "test-hooks")]
fn env_pauser() -> Option<&'static EnvPauser> {
    static PAUSER: std::sync::OnceLock<Option<EnvPauser>> = std::sync::OnceLock::new();
    PAUSER
        .get_or_init(|| {
            let points = std::env::var("FLUX_PLUNGER_TEST_PAUSE_AT").ok()?;
            let file = std::env::var("FLUX_PLUNGER_TEST_PAUSE_FILE").ok()?;
            let points = points
                .split(',')
                .map(str::trim)
                .filter(|p| !p.is_empty())
                .filter_map(|listed| match PausePoint::parse(listed) {
                    Some(point) => Some(point),
                    None => {
                        // A typo would make a test wait for a pause that never comes.
                        tracing::error!(point = %listed, "test build: FLUX_PLUNGER_TEST_PAUSE_AT names no fail point");
                        None
                    }
                })
                .collect();
            Some(EnvPauser {
                points,
                file,
                reached: std::sync::Mutex::default(),
            })
        })
        .as_ref()
}

/// One entry of `FLUX_PLUNGER_TEST_PAUSE_AT`: `NAME` pauses the first time
/// the point is reached, `NAME@N` the N-th time (a later release of a drain
/// or a sweep, a second attempt).
#[cfg(feature = "test-hooks")]
#[derive(Debug, Clone, PartialEq, Eq)]
struct PausePoint {
    listed: String,
    name: &'static str,
    occurrence: u32,
}

#[cfg(feature = "test-hooks")]
impl PausePoint {
    fn parse(listed: &str) -> Option<Self> {
        let (name, occurrence) = match listed.split_once('@') {
            Some((name, n)) => (name, n.parse().ok().filter(|n| *n >= 1)?),
            None => (listed, 1),
        };
        let name = Step::ALL
            .iter()
            .map(|s| s.name())
            .chain(SweepStep::ALL.iter().map(|s| s.name()))
            .find(|known| *known == name)?;
        Some(Self {
            listed: listed.to_owned(),
            name,
            occurrence,
        })
    }
}

#[cfg(feature = "test-hooks")]
struct EnvPauser {
    points: Vec<PausePoint>,
    file: String,
    /// How often each point was reached in this process.
    reached: std::sync::Mutex<std::collections::HashMap<&'static str, u32>>,
}

#[cfg(feature = "test-hooks")]
impl EnvPauser {
    async fn pause(&self, point: &'static str) {
        if !self.points.iter().any(|p| p.name == point) {
            return;
        }
        let occurrence = {
            let mut reached = self.reached.lock().expect("pause counts poisoned");
            let count = reached.entry(point).or_default();
            *count += 1;
            *count
        };
        let Some(listed) = self
            .points
            .iter()
            .find(|p| p.name == point && p.occurrence == occurrence)
            .map(|p| p.listed.clone())
        else {
            return;
        };
        let reached = format!("{}.reached", self.file);
        let release = format!("{}.release", self.file);
        // Written aside and renamed: a test polling the file never reads it half written.
        let aside = format!("{}.reached.tmp", self.file);
        if std::fs::write(&aside, &listed).is_ok() {
            let _ = std::fs::rename(&aside, &reached);
        }
        tracing::warn!(point = %listed, "test build: paused until {release} exists");
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        while !std::path::Path::new(&release).exists() && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Consumed, so that a later point of the list waits for its own release.
        let _ = std::fs::remove_file(&release);
        tracing::warn!(point = %listed, "test build: going on");
    }
}

/// Test builds only: recovery hooks from the environment (see the module
/// doc), so that a test (or the demo) can hold a real `flux-plunger` or
/// `flux-plunger-drain` process at a step of its recovery or drain.
#[cfg(feature = "test-hooks")]
pub(crate) fn hooks_from_env() -> TestHooks {
    use futures::FutureExt;
    use std::sync::Arc;

    let unfenced = std::env::var("FLUX_PLUNGER_TEST_UNFENCED").is_ok_and(|v| v == "1");
    let panic_at = std::env::var("FLUX_PLUNGER_TEST_PANIC_AT")
        .ok()
        .filter(|p| !p.is_empty());
    let pauser = env_pauser();
    let pause = (pauser.is_some() || panic_at.is_some()).then(|| {
        let pause: Arc<dyn Fn(Step) -> futures::future::BoxFuture<'static, ()> + Send + Sync> =
            Arc::new(move |step: Step| {
                if panic_at.as_deref() == Some(step.name()) {
                    panic!("test build: FLUX_PLUNGER_TEST_PANIC_AT={}", step.name());
                }
                match pauser {
                    Some(pauser) => pauser.pause(step.name()).boxed(),
                    None => async {}.boxed(),
                }
            });
        pause
    });
    TestHooks { unfenced, pause }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_fail_point_has_its_own_name() {
        let mut names: Vec<&str> = Step::ALL.iter().map(|s| s.name()).collect();
        names.extend(SweepStep::ALL.iter().map(|s| s.name()));
        let count = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), count, "{names:?}");
    }

    #[cfg(feature = "test-hooks")]
    #[test]
    fn a_pause_entry_names_a_known_point_and_which_time_it_is_reached() {
        let parsed = PausePoint::parse("release-patched@4").unwrap();
        assert_eq!((parsed.name, parsed.occurrence), ("release-patched", 4));
        assert_eq!(PausePoint::parse("annotated").unwrap().occurrence, 1);
        assert_eq!(PausePoint::parse("anotated"), None);
        assert_eq!(PausePoint::parse("annotated@0"), None);
        assert_eq!(PausePoint::parse("annotated@x"), None);
    }
}
