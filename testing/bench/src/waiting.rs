//! Releases waiting under the rate limit (SPEC §4,
//! `--max-recoveries-per-minute`): `RELEASES` releases stuck at once before a
//! controller allowed `PER_MINUTE` recovery a minute. It recovers one at once
//! and turns the others away, fencing each (SPEC §4.5) and giving it a turn of
//! its own, one interval after the turn before.
//!
//! The figures are what the waiting costs the apiserver. A waiting release
//! should cost its read and its storage listing once, at its turn, so that a
//! minute holds one recovery's requests and the Lease's and no second holds
//! much more than one recovery's. Were every waiting release told the same
//! time, each free turn would wake them all at once: about two requests each,
//! in one burst.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use plunger::names::FENCE_FINALIZER;
use testkit::TestNamespace;
use testkit::audit::{self, AuditedRequest};

use crate::burst::concerns;
use crate::controller::{Controller, Identity};
use crate::objects::{
    create_reclaimable_storage, create_releases, mark_all_stuck, release_name, unfence_releases,
};

/// Releases stuck at once.
pub const RELEASES: usize = 1000;
/// `--max-recoveries-per-minute`.
pub const PER_MINUTE: u32 = 1;
/// The window starts this long after the first recovery (or whole minutes
/// later, once every release has been turned away): half way between two
/// turns, so that each of its minutes holds one turn in its middle, and a
/// turn never falls on the edge of two minutes.
pub const WINDOW_START: Duration = Duration::from_secs(30);
/// The window's minutes: with one recovery a minute, three turns, one in
/// the middle of each.
pub const WINDOW_MINUTES: usize = 3;
/// The controller's concurrency: the chart's default.
pub const CONCURRENT: u16 = 4;
/// How long after the stuck writes the first recovery may take to show.
const FIRST_RECOVERY_WITHIN: Duration = Duration::from_secs(180);
/// How long the controller may take to turn every waiting release away.
const TURNING_AWAY_WITHIN: Duration = Duration::from_secs(300);
/// Left for the apiserver to log the window's last requests.
const AUDIT_SLACK: Duration = Duration::from_secs(2);

const SECOND: i128 = 1_000_000_000;
const MINUTE: i128 = 60 * SECOND;

pub struct WaitingFigures {
    /// The releases the controller fenced to wait: those it turned away.
    pub turned_away: usize,
    /// From the first stuck write to the last of those fences.
    pub turning_away: Duration,
    /// The controller's requests meanwhile (the first recovery's and the
    /// Lease's included), by label.
    pub turning_away_by_label: BTreeMap<String, u64>,
    pub turning_away_busiest_second: usize,
    /// The requests about one release turned away (the middle one), from
    /// its stuck write to the end of the turning away, in order, each with
    /// its time after that write.
    pub one_turned_away: Vec<String>,
    /// From the first recovery to the window's start.
    pub window_start: Duration,
    /// Each minute of the window, in order.
    pub minutes: Vec<Minute>,
    /// The most requests the apiserver received from the controller in any
    /// one second of the window.
    pub window_busiest_second: usize,
    /// Every recovery until the end of the window, in seconds after the
    /// first.
    pub recoveries_at: Vec<f64>,
}

/// One minute of the window.
pub struct Minute {
    /// The controller's requests (the Lease's and any watch opened
    /// included), by label.
    pub by_label: BTreeMap<String, u64>,
    /// The most requests received from the controller in any one second.
    pub busiest_second: usize,
    pub recoveries: usize,
}

impl WaitingFigures {
    /// The controller's requests a minute over the window.
    pub fn window_per_minute(&self) -> f64 {
        let total: u64 = self.minutes.iter().flat_map(|m| m.by_label.values()).sum();
        total as f64 / self.minutes.len() as f64
    }

    pub fn window_recoveries(&self) -> usize {
        self.minutes.iter().map(|m| m.recoveries).sum()
    }
}

/// Makes `RELEASES` releases stuck at once before the rate-limited
/// controller, lets it work until the end of the window, and reads what it
/// asked of the apiserver from the audit log. Fails only if something is
/// broken: the controller exits, recovers nothing, or does not turn the
/// waiting releases away.
pub async fn bench_waiting(admin: &Client, identity: &Identity) -> Result<WaitingFigures> {
    let ns = TestNamespace::create(admin, "bench-waiting").await?;
    create_releases(&ns, 0..RELEASES).await?;
    create_reclaimable_storage(&ns, 0..RELEASES).await?;
    let mut controller = Controller::spawn_rate_limited(
        admin,
        identity,
        &ns.name,
        CONCURRENT,
        "bench-waiting",
        PER_MINUTE,
    )
    .await?;
    controller.wait_ready(Duration::from_secs(120)).await?;

    let offset = audit::mark();
    mark_all_stuck(&ns, 0..RELEASES).await?;
    let username = identity.username();
    let first_recovery = wait_for_first_recovery(&mut controller, offset, &username).await?;
    let turned_away_by = wait_for_turning_away(&mut controller, offset, &username).await?;
    let window = Window::after(first_recovery, turned_away_by);
    wait_until(&mut controller, window.end() + nanos_of(AUDIT_SLACK)).await?;
    let requests = audit::read_since(offset)?;
    controller.stop().await?;
    // The later parts' drains must not find a thousand fences more.
    unfence_releases(&ns, 0..RELEASES).await?;
    figures(&requests, &ns.name, &username, first_recovery, window)
}

/// The minutes measured, in nanoseconds of the apiserver's clock.
#[derive(Debug, Clone, Copy)]
struct Window {
    start: i128,
}

impl Window {
    /// The first minute that starts `WINDOW_START` plus whole minutes after
    /// the first recovery, once every release has been turned away: the
    /// turning away is the first pass over a thousand new stuck releases,
    /// measured apart; the window is the waiting.
    fn after(first_recovery: i128, turned_away_by: i128) -> Self {
        let earliest = first_recovery + nanos_of(WINDOW_START);
        let late = (turned_away_by - earliest).max(0);
        let minutes_late = (late + MINUTE - 1) / MINUTE;
        Self {
            start: earliest + minutes_late * MINUTE,
        }
    }

    fn first_minute_after_first_recovery(self, first_recovery: i128) -> Duration {
        duration_of(self.start - first_recovery)
    }

    fn minute_start(self, minute: usize) -> i128 {
        self.start + MINUTE * minute as i128
    }

    fn end(self) -> i128 {
        self.minute_start(WINDOW_MINUTES)
    }
}

fn nanos(at: Timestamp) -> i128 {
    at.as_nanosecond()
}

fn nanos_of(duration: Duration) -> i128 {
    duration.as_nanos() as i128
}

fn duration_of(nanos: i128) -> Duration {
    Duration::from_nanos(u64::try_from(nanos).unwrap_or(0))
}

/// A recovery's one delete: its newest storage revision (SPEC §4.12).
fn is_recovery(request: &AuditedRequest) -> bool {
    request.verb == "delete" && request.resource() == "secrets" && request.succeeded()
}

/// The fence alone, applied to a stuck release whose recovery must wait
/// (SPEC §4.5): an apply carrying the fence and no suspension. The acquire
/// carries both, the lift neither.
fn is_fence_to_wait(request: &AuditedRequest) -> bool {
    let Some(body) = &request.body else {
        return false;
    };
    let fenced = body
        .pointer("/metadata/finalizers")
        .and_then(|f| f.as_array())
        .is_some_and(|f| f.iter().any(|name| name == FENCE_FINALIZER));
    let suspends = body.pointer("/spec/suspend").is_some();
    request.verb == "patch"
        && request.resource() == "helmreleases"
        && request.succeeded()
        && fenced
        && !suspends
}

/// When the apiserver received the controller's first storage delete, read
/// from the audit log since `offset`.
async fn wait_for_first_recovery(
    controller: &mut Controller,
    offset: u64,
    username: &str,
) -> Result<i128> {
    let deadline = Instant::now() + FIRST_RECOVERY_WITHIN;
    loop {
        controller.ensure_running()?;
        let first = audit::read_since(offset)?
            .iter()
            .filter(|r| r.user == username && is_recovery(r))
            .map(|r| nanos(r.received_at))
            .min();
        if let Some(first) = first {
            return Ok(first);
        }
        if Instant::now() > deadline {
            bail!("no recovery within {FIRST_RECOVERY_WITHIN:?} of the stuck writes");
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// When the last release was fenced to wait, once every release but those
/// of the first burst has been (read from the audit log since `offset`).
async fn wait_for_turning_away(
    controller: &mut Controller,
    offset: u64,
    username: &str,
) -> Result<i128> {
    let waiting = RELEASES - PER_MINUTE as usize;
    let deadline = Instant::now() + TURNING_AWAY_WITHIN;
    loop {
        controller.ensure_running()?;
        let requests = audit::read_since(offset)?;
        let fences: Vec<&AuditedRequest> = requests
            .iter()
            .filter(|r| r.user == username && is_fence_to_wait(r))
            .collect();
        let fenced: BTreeSet<&str> = fences.iter().map(|r| r.name.as_str()).collect();
        if fenced.len() >= waiting {
            return Ok(fences.iter().map(|r| nanos(r.at)).max().unwrap_or(0));
        }
        if Instant::now() > deadline {
            bail!(
                "only {} of {waiting} releases fenced to wait within {TURNING_AWAY_WITHIN:?}",
                fenced.len()
            );
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

/// Sleeps until `until` on the wall clock (the apiserver's: the same
/// machine), checking every second that the controller still runs.
async fn wait_until(controller: &mut Controller, until: i128) -> Result<()> {
    loop {
        controller.ensure_running()?;
        let left = until - nanos(Timestamp::now());
        if left <= 0 {
            return Ok(());
        }
        tokio::time::sleep(duration_of(left).min(Duration::from_secs(1))).await;
    }
}

/// The requests the apiserver received in `[from, to)`.
fn received_between<'a>(
    requests: &[&'a AuditedRequest],
    from: i128,
    to: i128,
) -> Vec<&'a AuditedRequest> {
    requests
        .iter()
        .copied()
        .filter(|r| (from..to).contains(&nanos(r.received_at)))
        .collect()
}

/// The most requests received within any one second (a sliding second, not
/// seconds of the clock: a burst across a second's edge counts whole).
fn busiest_second(requests: &[&AuditedRequest]) -> usize {
    most_within_a_second(requests.iter().map(|r| nanos(r.received_at)).collect())
}

/// [`busiest_second`] over instants in nanoseconds.
fn most_within_a_second(mut times: Vec<i128>) -> usize {
    times.sort_unstable();
    let mut first = 0;
    let mut most = 0;
    for (last, &at) in times.iter().enumerate() {
        while at - times[first] >= SECOND {
            first += 1;
        }
        most = most.max(last - first + 1);
    }
    most
}

fn minute(requests: &[&AuditedRequest]) -> Minute {
    Minute {
        by_label: audit::count_by_label(requests.iter().copied()),
        busiest_second: busiest_second(requests),
        recoveries: requests.iter().filter(|r| is_recovery(r)).count(),
    }
}

fn figures(
    requests: &[AuditedRequest],
    namespace: &str,
    username: &str,
    first_recovery: i128,
    window: Window,
) -> Result<WaitingFigures> {
    let ours: Vec<&AuditedRequest> = requests.iter().filter(|r| r.user == username).collect();
    let first_stuck = requests
        .iter()
        .filter(|r| r.user != username && r.namespace.as_deref() == Some(namespace))
        .filter(|r| r.resource() == "helmreleases/status")
        .map(|r| nanos(r.received_at))
        .min()
        .context("no stuck write in the audit log")?;
    let fences: Vec<&AuditedRequest> = ours
        .iter()
        .copied()
        .filter(|r| is_fence_to_wait(r))
        .collect();
    let turned_away: BTreeSet<&str> = fences.iter().map(|r| r.name.as_str()).collect();
    let last_fence = fences
        .iter()
        .map(|r| nanos(r.at))
        .max()
        .context("the controller fenced no release to wait: the rate limit turned none away")?;
    let turning = received_between(&ours, first_stuck, last_fence + 1);
    let example = release_name(RELEASES / 2);
    let example_stuck = requests
        .iter()
        .filter(|r| r.user != username && r.name == example)
        .filter(|r| r.resource() == "helmreleases/status")
        .map(|r| nanos(r.received_at))
        .min()
        .unwrap_or(first_stuck);
    let minutes = (0..WINDOW_MINUTES)
        .map(|m| {
            minute(&received_between(
                &ours,
                window.minute_start(m),
                window.minute_start(m + 1),
            ))
        })
        .collect();
    let mut recoveries: Vec<i128> = ours
        .iter()
        .filter(|r| is_recovery(r))
        .map(|r| nanos(r.received_at))
        .filter(|&at| at < window.end())
        .collect();
    recoveries.sort_unstable();
    Ok(WaitingFigures {
        turned_away: turned_away.len(),
        turning_away: duration_of(last_fence - first_stuck),
        turning_away_by_label: audit::count_by_label(turning.iter().copied()),
        turning_away_busiest_second: busiest_second(&turning),
        one_turned_away: turning
            .iter()
            .filter(|r| concerns(r, &example))
            .map(|r| {
                let after = duration_of(nanos(r.received_at) - example_stuck);
                format!("{} → {} (+{} ms)", r.label(), r.code, after.as_millis())
            })
            .collect(),
        window_start: window.first_minute_after_first_recovery(first_recovery),
        minutes,
        window_busiest_second: busiest_second(&received_between(&ours, window.start, window.end())),
        recoveries_at: recoveries
            .iter()
            .map(|&at| duration_of(at - first_recovery).as_secs_f64())
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_busiest_second_slides_across_the_clock_s_seconds() {
        let ms = |ms: i128| ms * 1_000_000;
        assert_eq!(most_within_a_second(vec![]), 0);
        assert_eq!(most_within_a_second(vec![ms(5)]), 1);
        // Three requests across a second's edge (0.9, 1.1, 1.2 s) count
        // together; one a whole second after the first does not.
        assert_eq!(
            most_within_a_second(vec![ms(1200), ms(900), ms(1100), ms(1900)]),
            3
        );
        assert_eq!(most_within_a_second(vec![ms(0), ms(1000), ms(2000)]), 1);
    }
}
