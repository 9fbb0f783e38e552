//! Exponential back-off with "equal jitter": attempt `n` waits between half and all of `base · 2^(n-1)`, capped at
//! `max`. Half the delay is fixed, so delays never shrink from one attempt to the next, and the other half is
//! random, so that many failures at once do not retry in lock-step.

use std::time::Duration;

use rand::Rng;

/// A back-off policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    /// Delay before the first retry (before jitter).
    pub base: Duration,
    /// Largest delay.
    pub max: Duration,
}

impl Backoff {
    /// The un-jittered ceiling of attempt `attempt` (1-based).
    pub fn ceiling(&self, attempt: u32) -> Duration {
        let exp = attempt.saturating_sub(1).min(30);
        self.base.saturating_mul(1u32 << exp).min(self.max)
    }

    /// The delay before retrying after failed attempt `attempt` (1-based): in `[ceiling/2, ceiling]`.
    pub fn delay(&self, attempt: u32) -> Duration {
        let ceiling = self.ceiling(attempt);
        let half = ceiling / 2;
        let jitter_ms = (ceiling - half).as_millis() as u64;
        half + Duration::from_millis(if jitter_ms == 0 { 0 } else { rand::rng().random_range(0..=jitter_ms) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_grow_stay_within_their_bounds_and_cap() {
        let b = Backoff { base: Duration::from_millis(100), max: Duration::from_secs(5) };
        assert_eq!(b.ceiling(1), Duration::from_millis(100));
        assert_eq!(b.ceiling(4), Duration::from_millis(800));
        assert_eq!(b.ceiling(40), Duration::from_secs(5));
        for attempt in 1..20 {
            for _ in 0..50 {
                let d = b.delay(attempt);
                assert!(d >= b.ceiling(attempt) / 2 && d <= b.ceiling(attempt), "attempt {attempt}: {d:?}");
                // The next attempt's smallest delay is at least this attempt's largest (until the cap).
                assert!(b.delay(attempt + 1) >= b.ceiling(attempt).min(b.max / 2));
            }
        }
    }
}
