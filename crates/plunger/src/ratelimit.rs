//! The recovery rate limit (`--max-recoveries-per-minute`): a burst up to the
//! limit, then one recovery per (60 s / limit), and a queue for the releases
//! that wait.
//!
//! A release the limit turns away is given a turn of its own, one interval
//! after the turn of the release before it, and is told to come back then:
//! at its turn the recovery is its, whoever else asked meanwhile. Without the
//! queue every waiting release would be told the same time, wake together,
//! and cost a read and a storage listing each for one recovery (N waiting
//! releases: about 2N requests an interval, in one burst).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The limit's arithmetic, apart from the clock: `now` is the time since
/// the limiter started.
#[derive(Debug, Clone, PartialEq)]
struct Schedule {
    interval: Duration,
    /// How far ahead of `now` the next free turn may be while a recovery
    /// still starts at once: the burst.
    tolerance: Duration,
    /// The next free turn (the generic cell rate algorithm's theoretical
    /// arrival time): every recovery started or promised moved it on by one
    /// interval.
    next_free: Duration,
    /// The turns promised to releases that wait, by key (uid).
    turns: HashMap<String, Duration>,
}

/// A turn nobody came back for is forgotten this long after it passed (the
/// release was recovered otherwise, deleted, or is no longer stuck).
const FORGET_TURNS_AFTER: Duration = Duration::from_secs(600);

impl Schedule {
    fn per_minute(per_minute: u32) -> Self {
        let interval = Duration::from_secs(60) / per_minute.max(1);
        Self {
            interval,
            tolerance: interval * per_minute.max(1).saturating_sub(1),
            next_free: Duration::ZERO,
            turns: HashMap::new(),
        }
    }

    /// Starts the recovery of `key` now, or says how long until its turn.
    pub(crate) fn take(&mut self, key: &str, now: Duration) -> Result<(), Duration> {
        self.turns
            .retain(|_, turn| *turn + FORGET_TURNS_AFTER > now);
        if let Some(&turn) = self.turns.get(key) {
            if now >= turn {
                self.turns.remove(key);
                return Ok(());
            }
            return Err(turn - now);
        }
        let free = self.next_free.max(now);
        if free <= now + self.tolerance {
            self.next_free = free + self.interval;
            return Ok(());
        }
        let turn = free - self.tolerance;
        self.next_free = free + self.interval;
        self.turns.insert(key.to_owned(), turn);
        Err(turn - now)
    }

    /// How many releases hold a turn.
    #[cfg(test)]
    pub(crate) fn waiting(&self) -> usize {
        self.turns.len()
    }
}

/// A shared schedule on the monotonic clock.
pub struct RateLimiter {
    started: Instant,
    schedule: Mutex<Schedule>,
}

impl RateLimiter {
    /// `None` for 0: no limit.
    pub fn per_minute(limit: u32) -> Option<Self> {
        (limit > 0).then(|| Self {
            started: Instant::now(),
            schedule: Mutex::new(Schedule::per_minute(limit)),
        })
    }

    /// Starts the recovery of the release `key` (its uid) now, or says when
    /// its turn is.
    pub(crate) fn try_take(&self, key: &str) -> Result<(), Duration> {
        self.schedule
            .lock()
            .expect("rate limiter poisoned")
            .take(key, self.started.elapsed())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: fn(u64) -> Duration = Duration::from_secs;

    #[test]
    fn a_burst_up_to_the_limit_starts_at_once_then_recoveries_are_spread() {
        let mut schedule = Schedule::per_minute(3);
        assert_eq!(schedule.take("a", S(0)), Ok(()));
        assert_eq!(schedule.take("b", S(0)), Ok(()));
        assert_eq!(schedule.take("c", S(0)), Ok(()));
        assert_eq!(schedule.take("d", S(0)), Err(S(20)));
    }

    #[test]
    fn each_waiting_release_gets_a_turn_of_its_own() {
        let mut schedule = Schedule::per_minute(1);
        assert_eq!(schedule.take("first", S(0)), Ok(()));
        let turns: Vec<_> = ["a", "b", "c"]
            .iter()
            .map(|key| schedule.take(key, S(0)).unwrap_err())
            .collect();
        assert_eq!(turns, vec![S(60), S(120), S(180)]);
        assert_eq!(schedule.waiting(), 3);
    }

    #[test]
    fn a_release_woken_before_its_turn_keeps_it() {
        let mut schedule = Schedule::per_minute(1);
        assert_eq!(schedule.take("first", S(0)), Ok(()));
        assert_eq!(schedule.take("a", S(0)), Err(S(60)));
        assert_eq!(schedule.take("a", S(45)), Err(S(15)), "not moved back");
        assert_eq!(schedule.take("b", S(45)), Err(S(75)));
    }

    #[test]
    fn at_its_turn_the_recovery_is_the_waiting_release_s_whoever_else_asks() {
        let mut schedule = Schedule::per_minute(1);
        assert_eq!(schedule.take("first", S(0)), Ok(()));
        assert_eq!(schedule.take("a", S(0)), Err(S(60)));
        assert_eq!(
            schedule.take("newcomer", S(60)),
            Err(S(60)),
            "queued behind a"
        );
        assert_eq!(schedule.take("a", S(60)), Ok(()));
        assert_eq!(schedule.waiting(), 1);
    }

    #[test]
    fn tokens_come_back_at_the_limit_and_never_above_it() {
        let mut schedule = Schedule::per_minute(6);
        for key in ["a", "b", "c", "d", "e", "f"] {
            assert_eq!(schedule.take(key, S(0)), Ok(()));
        }
        assert!(schedule.take("g", S(0)).is_err());
        let mut later = Schedule::per_minute(6);
        for key in ["a", "b", "c", "d", "e", "f"] {
            assert_eq!(later.take(key, S(3600)), Ok(()), "a full burst again");
        }
        assert!(later.take("g", S(3600)).is_err(), "not more than the limit");
    }

    #[test]
    fn a_turn_nobody_comes_back_for_is_forgotten() {
        let mut schedule = Schedule::per_minute(1);
        assert_eq!(schedule.take("first", S(0)), Ok(()));
        assert_eq!(schedule.take("gone", S(0)), Err(S(60)));
        assert_eq!(schedule.take("later", S(60) + FORGET_TURNS_AFTER), Ok(()));
        assert_eq!(schedule.waiting(), 0);
    }

    #[test]
    fn zero_means_no_limit() {
        assert!(RateLimiter::per_minute(0).is_none());
        let limiter = RateLimiter::per_minute(1).unwrap();
        assert_eq!(limiter.try_take("a"), Ok(()));
        assert!(limiter.try_take("b").is_err());
    }
}
