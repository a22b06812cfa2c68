//! A small seeded random number generator (SplitMix64) for randomized tests:
//! the same seed gives the same sequence on every machine and every build,
//! with no dependency whose algorithm could change under us.

use std::time::Duration;

/// SplitMix64 (Steele, Lea, Flood 2014): tiny, fast, and good enough to
/// pick delays, fault kinds and orders; not for anything cryptographic.
#[derive(Debug, Clone)]
pub struct SeededRng {
    state: u64,
}

impl SeededRng {
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// A generator for one part of a run (`stream`), independent of the
    /// others drawn from the same seed: how many draws one part makes then
    /// never shifts what another part sees.
    pub fn fork(seed: u64, stream: &str) -> Self {
        let mut mixed = seed;
        for byte in stream.bytes() {
            mixed = splitmix(mixed ^ u64::from(byte));
        }
        Self::new(mixed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        splitmix(self.state)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        // The top 53 bits fill an f64 mantissa exactly.
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        self.unit() < p
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0, "below(0)");
        self.next_u64() % n
    }

    /// Uniform in `0..=max`, in whole milliseconds.
    pub fn delay_up_to(&mut self, max: Duration) -> Duration {
        let max_ms = u64::try_from(max.as_millis()).unwrap_or(u64::MAX - 1);
        Duration::from_millis(self.below(max_ms + 1))
    }

    /// One element of `items` (non-empty).
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }
}

fn splitmix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_sequence() {
        let a: Vec<u64> = {
            let mut r = SeededRng::new(42);
            (0..5).map(|_| r.next_u64()).collect()
        };
        let b: Vec<u64> = {
            let mut r = SeededRng::new(42);
            (0..5).map(|_| r.next_u64()).collect()
        };
        assert_eq!(a, b);
        // SplitMix64's published first output for seed 0.
        assert_eq!(SeededRng::new(0).next_u64(), 0xE220_A839_7B1D_CDAF);
    }

    #[test]
    fn forks_of_one_seed_differ_by_stream() {
        assert_ne!(
            SeededRng::fork(7, "proxy").next_u64(),
            SeededRng::fork(7, "delays").next_u64()
        );
    }

    #[test]
    fn unit_stays_in_range_and_chance_follows_its_rate() {
        let mut r = SeededRng::new(1);
        let hits = (0..10_000)
            .filter(|_| {
                let u = r.unit();
                assert!((0.0..1.0).contains(&u));
                u < 0.25
            })
            .count();
        assert!((2_200..2_800).contains(&hits), "{hits}");
    }
}
