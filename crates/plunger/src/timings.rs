//! Every duration flux-plunger uses, derived from one chart value,
//! `shutdownGracePeriodSeconds` (SPEC §7). The chart renders the same numbers;
//! contract tests compare this module with `helm template` output, so a change
//! on either side alone turns a test red.

use std::time::Duration;

/// Lowest accepted grace period: below it the drain deadline (G − 25 s)
/// leaves too little time to carry a deleted release through its uninstall.
const MIN_GRACE_PERIOD_SECONDS: u64 = 40;
/// Highest accepted grace period: above it the hook's pod wait (G + 10 s)
/// would no longer fit inside its retry window.
const MAX_GRACE_PERIOD_SECONDS: u64 = 140;
/// The chart's default.
pub const DEFAULT_GRACE_PERIOD_SECONDS: u64 = 90;

/// How long the controller may take to stop after SIGTERM.
pub const CONTROLLER_STOP_BOUND: Duration = Duration::from_secs(10);
/// Room left before the kubelet's SIGKILL once the drain deadline passes.
const KILL_MARGIN: Duration = Duration::from_secs(15);

/// helm-controller's default uninstall timeout, which bounds a pre-delete hook.
pub const HELM_CONTROLLER_UNINSTALL_TIMEOUT: Duration = Duration::from_secs(300);
/// The hook Job's `activeDeadlineSeconds`: under helm-controller's timeout so
/// that the Job, not helm-controller, decides how the hook ends.
const HOOK_ACTIVE_DEADLINE: Duration = Duration::from_secs(240);
/// The window inside which the hook retries its reads and writes.
const HOOK_RETRY_WINDOW: Duration = Duration::from_secs(180);
/// How long past its retry window the hook may still be finishing: a last
/// attempt started inside the window, each release's one attempt after a
/// window spent waiting, the final listing. No request outlives it.
const HOOK_FINISH_MARGIN: Duration = Duration::from_secs(30);
/// What the hook's budget leaves of the Job's deadline for the pod to be
/// scheduled and its container started (the deadline counts from the Job's
/// start, not the process's).
#[cfg(test)]
pub(crate) const HOOK_POD_START_ALLOWANCE: Duration = Duration::from_secs(30);
/// How long a finished hook Job is kept so that its report can be read.
pub(crate) const HOOK_TTL_AFTER_FINISHED: Duration = Duration::from_secs(600);
/// Extra wait for the controller pods beyond their grace period.
pub(crate) const HOOK_POD_WAIT_MARGIN: Duration = Duration::from_secs(10);

/// How often a held fence is re-checked, whether or not helm-controller writes.
pub(crate) const FENCE_RECHECK_INTERVAL: Duration = Duration::from_secs(60);
/// How long a delete may be held by the fence before `UninstallFenceHeld`.
pub(crate) const FENCE_HELD_WARNING_AFTER: Duration = Duration::from_secs(600);

/// How often a waiting candidate tries for the Lease, a leader retries a
/// renewal that failed, and the drain renews while it works.
pub(crate) const LEASE_RETRY_PERIOD: Duration = Duration::from_secs(2);
/// How often a leader renews its Lease while renewals succeed: ten requests a
/// minute while idle (the original sends twelve). Short enough that a failed
/// renewal is retried before the renew deadline; the Lease's duration does
/// not depend on it (a leader gives up at the renew deadline whenever its
/// last success was).
pub(crate) const LEASE_RENEW_INTERVAL: Duration = Duration::from_secs(6);
/// A leader that could not renew for this long stops acting.
pub(crate) const LEASE_RENEW_DEADLINE: Duration = Duration::from_secs(10);
/// Margin for clock skew between nodes on top of the Lease arithmetic.
pub(crate) const LEASE_SKEW_MARGIN: Duration = Duration::from_secs(5);

/// How long any request but a watch may wait for its whole answer
/// (`plunger::client`). A write sent while the Lease is held is answered or
/// abandoned before the Lease can run out: renew deadline + this < Lease
/// duration.
pub(crate) const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The end of the drain deadline kept for handing the Lease over: the drain
/// stops working this long before its deadline, so that the handover (and
/// the report) never run past it.
pub(crate) const DRAIN_HANDOVER_RESERVE: Duration = Duration::from_secs(2);

/// A grace period that cannot be used, with the reason in its message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GracePeriodError {
    #[error(
        "shutdownGracePeriodSeconds must be a whole number of seconds between {MIN_GRACE_PERIOD_SECONDS} and {MAX_GRACE_PERIOD_SECONDS}, got {0:?}"
    )]
    NotAnInteger(String),
    #[error(
        "shutdownGracePeriodSeconds must be between {MIN_GRACE_PERIOD_SECONDS} and {MAX_GRACE_PERIOD_SECONDS} seconds, got {0}: below {MIN_GRACE_PERIOD_SECONDS} the drain deadline (grace period - 25 s) is too short to carry a delete through its uninstall; above {MAX_GRACE_PERIOD_SECONDS} the hook's pod wait (grace period + 10 s) no longer fits its {retry}-second retry window",
        retry = HOOK_RETRY_WINDOW.as_secs()
    )]
    OutOfRange(u64),
}

/// Every duration of SPEC §7 for one grace period.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timings {
    /// The pod's `terminationGracePeriodSeconds`, G.
    pub grace_period: Duration,
    /// The controller's stop bound after SIGTERM.
    pub controller_stop_bound: Duration,
    /// Margin before SIGKILL.
    pub kill_margin: Duration,
    /// The drain's deadline, G − stop bound − kill margin.
    pub drain_deadline: Duration,
    /// The end of the drain deadline kept for the handover.
    pub drain_handover_reserve: Duration,
    /// Lease timings (see [`Timings::lease_duration`] for the reasoning).
    pub lease_duration: Duration,
    pub lease_renew_deadline: Duration,
    pub lease_retry_period: Duration,
    pub lease_renew_interval: Duration,
    /// How long any request but a watch may wait for its answer.
    pub request_timeout: Duration,
    /// The pre-delete hook's budget.
    pub hook_active_deadline: Duration,
    pub hook_retry_window: Duration,
    pub hook_finish_margin: Duration,
    pub hook_pod_wait: Duration,
    pub hook_ttl_after_finished: Duration,
    /// The fence's re-check cadence and the warning threshold.
    pub fence_recheck_interval: Duration,
    pub fence_held_warning_after: Duration,
}

impl Timings {
    /// Parses a grace period as the chart and the flags carry it: a decimal
    /// whole number of seconds.
    pub fn parse_grace_period(text: &str) -> Result<Self, GracePeriodError> {
        let seconds: u64 = text
            .trim()
            .parse()
            .map_err(|_| GracePeriodError::NotAnInteger(text.to_owned()))?;
        Self::from_grace_period(seconds)
    }

    /// Derives every duration from the grace period G, refusing a G outside
    /// 40..=140 seconds.
    pub fn from_grace_period(seconds: u64) -> Result<Self, GracePeriodError> {
        if !(MIN_GRACE_PERIOD_SECONDS..=MAX_GRACE_PERIOD_SECONDS).contains(&seconds) {
            return Err(GracePeriodError::OutOfRange(seconds));
        }
        let grace_period = Duration::from_secs(seconds);
        Ok(Self {
            grace_period,
            controller_stop_bound: CONTROLLER_STOP_BOUND,
            kill_margin: KILL_MARGIN,
            drain_deadline: grace_period - CONTROLLER_STOP_BOUND - KILL_MARGIN,
            drain_handover_reserve: DRAIN_HANDOVER_RESERVE,
            // The Lease must outlast the longest time a leader that lost touch
            // with the apiserver can still be writing: one retry period to
            // notice, the renew deadline, then the bounded stop. The drain
            // sidecar renews the Lease before its first write and hands it over
            // when it ends, so a clean stop never waits for the Lease to expire;
            // only a crash does.
            lease_duration: LEASE_RETRY_PERIOD
                + LEASE_RENEW_DEADLINE
                + CONTROLLER_STOP_BOUND
                + LEASE_SKEW_MARGIN,
            lease_renew_deadline: LEASE_RENEW_DEADLINE,
            lease_retry_period: LEASE_RETRY_PERIOD,
            lease_renew_interval: LEASE_RENEW_INTERVAL,
            request_timeout: REQUEST_TIMEOUT,
            hook_active_deadline: HOOK_ACTIVE_DEADLINE,
            hook_retry_window: HOOK_RETRY_WINDOW,
            hook_finish_margin: HOOK_FINISH_MARGIN,
            hook_pod_wait: grace_period + HOOK_POD_WAIT_MARGIN,
            hook_ttl_after_finished: HOOK_TTL_AFTER_FINISHED,
            fence_recheck_interval: FENCE_RECHECK_INTERVAL,
            fence_held_warning_after: FENCE_HELD_WARNING_AFTER,
        })
    }
}

impl Default for Timings {
    fn default() -> Self {
        Self::from_grace_period(DEFAULT_GRACE_PERIOD_SECONDS).expect("the default is in range")
    }
}

/// Written as the one value every duration derives from, the grace period
/// in whole seconds, as the flag and the chart take it (so that
/// [`Timings::parse_grace_period`] reads it back).
impl std::fmt::Display for Timings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.grace_period.as_secs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_grace_period_gives_a_65_second_drain() {
        let t = Timings::default();
        assert_eq!(t.grace_period, Duration::from_secs(90));
        assert_eq!(t.drain_deadline, Duration::from_secs(65));
        assert_eq!(t.hook_pod_wait, Duration::from_secs(100));
    }

    #[test]
    fn every_relation_of_spec_7_holds_for_every_accepted_grace_period() {
        for g in MIN_GRACE_PERIOD_SECONDS..=MAX_GRACE_PERIOD_SECONDS {
            let t = Timings::from_grace_period(g).unwrap();
            assert_eq!(t.grace_period.as_secs(), g);
            assert_eq!(t.drain_deadline.as_secs(), g - 25, "G={g}");
            assert_eq!(
                t.controller_stop_bound + t.drain_deadline + t.kill_margin,
                t.grace_period,
                "G={g}: stop + drain + margin fill the grace period exactly"
            );
            assert!(
                t.hook_active_deadline < HELM_CONTROLLER_UNINSTALL_TIMEOUT,
                "G={g}"
            );
            assert!(
                t.hook_active_deadline - t.hook_retry_window >= Duration::from_secs(60),
                "G={g}"
            );
            assert!(t.hook_pod_wait > t.grace_period, "G={g}");
            assert!(t.hook_pod_wait < t.hook_retry_window, "G={g}");
            assert!(
                t.lease_duration
                    > t.lease_retry_period + t.lease_renew_deadline + t.controller_stop_bound,
                "G={g}: a leader that lost the apiserver has stopped before its Lease runs out"
            );
            assert!(t.lease_renew_deadline < t.lease_duration, "G={g}");
            assert!(
                t.lease_renew_deadline + t.request_timeout < t.lease_duration,
                "G={g}: a write sent while the Lease is held ends before it can run out"
            );
            assert!(
                t.request_timeout + t.drain_handover_reserve < t.drain_deadline,
                "G={g}: a whole request fits in the drain's working time"
            );
            assert!(
                t.request_timeout <= t.hook_finish_margin,
                "G={g}: a request started at the end of the hook's window ends inside its margin"
            );
            assert!(t.lease_retry_period < t.lease_renew_deadline, "G={g}");
            assert!(
                t.lease_renew_interval + t.lease_retry_period < t.lease_renew_deadline,
                "G={g}: a renewal that fails is tried again before the leader gives up"
            );
            assert!(
                t.lease_renew_interval >= t.lease_retry_period,
                "G={g}: a healthy leader renews no more often than a candidate retries"
            );
        }
    }

    /// The hook's longest run: the Deployment read and scale retried inside
    /// the window, the pod wait (G + 10 s) cut at the window's end, then the
    /// listing and the releases, whose retries also end with the window; a
    /// request still pending at window + finish margin fails at once. So a
    /// run never outlives window + margin, whatever G is, and what is left of
    /// the Job's deadline is the room for its pod to start.
    #[test]
    fn the_hook_ends_inside_its_job_deadline_for_every_grace_period() {
        for g in MIN_GRACE_PERIOD_SECONDS..=MAX_GRACE_PERIOD_SECONDS {
            let t = Timings::from_grace_period(g).unwrap();
            let pod_wait = t.hook_pod_wait.min(t.hook_retry_window);
            assert_eq!(
                pod_wait, t.hook_pod_wait,
                "G={g}: the pod wait is never cut"
            );
            assert!(
                t.hook_retry_window - pod_wait >= Duration::from_secs(30),
                "G={g}: at least 30 s of the window are left for retries after the longest pod wait"
            );
            let longest_run = t.hook_retry_window + t.hook_finish_margin;
            assert_eq!(longest_run, Duration::from_secs(210), "G={g}");
            assert!(
                longest_run + HOOK_POD_START_ALLOWANCE <= t.hook_active_deadline,
                "G={g}: {longest_run:?} + pod start {HOOK_POD_START_ALLOWANCE:?} within {:?}",
                t.hook_active_deadline
            );
        }
    }

    #[test]
    fn a_grace_period_just_outside_the_range_is_refused_with_the_reason() {
        for g in [0, 39, 141, 1000] {
            let err = Timings::from_grace_period(g).unwrap_err();
            assert_eq!(err, GracePeriodError::OutOfRange(g));
            let msg = err.to_string();
            assert!(msg.contains("between 40 and 140"), "{msg}");
            assert!(msg.contains(&format!("got {g}")), "{msg}");
        }
        assert!(Timings::from_grace_period(40).is_ok());
        assert!(Timings::from_grace_period(140).is_ok());
    }

    #[test]
    fn a_fractional_or_non_numeric_grace_period_is_refused() {
        for text in ["90.7", "abc", "", "-5", "1e2"] {
            let err = Timings::parse_grace_period(text).unwrap_err();
            assert_eq!(err, GracePeriodError::NotAnInteger(text.to_owned()));
            assert!(err.to_string().contains("whole number"), "{err}");
        }
        assert_eq!(
            Timings::parse_grace_period("120").unwrap().drain_deadline,
            Duration::from_secs(95)
        );
    }

    #[test]
    fn timings_are_written_as_the_grace_period_they_are_read_from() {
        assert_eq!(Timings::default().to_string(), "90");
        for g in MIN_GRACE_PERIOD_SECONDS..=MAX_GRACE_PERIOD_SECONDS {
            let t = Timings::from_grace_period(g).unwrap();
            assert_eq!(Timings::parse_grace_period(&t.to_string()), Ok(t));
        }
    }
}
