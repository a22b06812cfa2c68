//! A token bucket for recoveries (`--max-recoveries-per-minute`): a burst up
//! to the limit, then one recovery per (60 s / limit).

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The bucket's arithmetic, apart from the clock.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bucket {
    pub tokens: f64,
    pub per_minute: u32,
}

impl Bucket {
    pub fn full(per_minute: u32) -> Self {
        Self {
            tokens: f64::from(per_minute),
            per_minute,
        }
    }

    /// Adds the tokens earned over `elapsed`, up to the limit.
    pub fn refill(&mut self, elapsed: Duration) {
        let rate = f64::from(self.per_minute) / 60.0;
        self.tokens = (self.tokens + elapsed.as_secs_f64() * rate).min(f64::from(self.per_minute));
    }

    /// Takes a token, or says how long until one is there.
    pub fn take(&mut self) -> Result<(), Duration> {
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            return Ok(());
        }
        let rate = f64::from(self.per_minute) / 60.0;
        Err(Duration::from_secs_f64((1.0 - self.tokens) / rate))
    }
}

/// A shared bucket on the monotonic clock.
pub struct RateLimiter {
    state: Mutex<(Bucket, Instant)>,
}

impl RateLimiter {
    /// `None` for 0: no limit.
    pub fn per_minute(limit: u32) -> Option<Self> {
        (limit > 0).then(|| Self {
            state: Mutex::new((Bucket::full(limit), Instant::now())),
        })
    }

    pub fn try_take(&self) -> Result<(), Duration> {
        let mut state = self.state.lock().expect("rate limiter poisoned");
        let now = Instant::now();
        let elapsed = now - state.1;
        state.1 = now;
        state.0.refill(elapsed);
        state.0.take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_bucket_allows_a_burst_up_to_the_limit_then_waits() {
        let mut bucket = Bucket::full(3);
        assert_eq!(bucket.take(), Ok(()));
        assert_eq!(bucket.take(), Ok(()));
        assert_eq!(bucket.take(), Ok(()));
        assert_eq!(bucket.take(), Err(Duration::from_secs(20)));
    }

    #[test]
    fn tokens_come_back_at_the_limit_per_minute_and_never_above_it() {
        let mut bucket = Bucket {
            tokens: 0.0,
            per_minute: 6,
        };
        bucket.refill(Duration::from_secs(10));
        assert_eq!(bucket.take(), Ok(()));
        assert!(bucket.take().is_err());
        bucket.refill(Duration::from_secs(3600));
        assert_eq!(bucket.tokens, 6.0);
    }

    #[test]
    fn zero_means_no_limit() {
        assert!(RateLimiter::per_minute(0).is_none());
        let limiter = RateLimiter::per_minute(1).unwrap();
        assert_eq!(limiter.try_take(), Ok(()));
        assert!(limiter.try_take().is_err());
    }
}
