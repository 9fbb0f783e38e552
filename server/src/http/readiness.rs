//! Readiness that rides out a brief Redis blip.
//!
//! `/readyz` answers 503 at once when PostgreSQL is unreachable or migrations are missing: nothing can be accepted
//! then. A Redis failure is different: the API writes jobs to the outbox in PostgreSQL and the relay publishes them
//! later, and every client reconnects on its own, so a failover or a restart of Redis lasting seconds must not take
//! every API pod out of its Service at once. Redis counts as down only once it has failed for longer than a grace
//! period (`CONVEYOR_READY_REDIS_GRACE`, default 10s); until then `/readyz` says `degraded` and stays 200.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// What the Redis part of readiness says, after the grace period is applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RedisVerdict {
    /// The last check succeeded.
    Ok,
    /// Checks have failed for `failing_for`, still within the grace period: ready all the same.
    Degraded {
        /// Since the first failed check after the last success.
        failing_for: Duration,
    },
    /// Checks have failed for longer than the grace period: not ready.
    Down {
        /// Since the first failed check after the last success.
        failing_for: Duration,
    },
}

impl RedisVerdict {
    /// Whether the process may take traffic as far as Redis is concerned.
    pub fn is_ready(self) -> bool {
        !matches!(self, Self::Down { .. })
    }

    /// `ok`, `degraded` or `down`, as `/readyz` shows it.
    pub fn label(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Degraded { .. } => "degraded",
            Self::Down { .. } => "down",
        }
    }
}

/// Remembers since when Redis checks have been failing (shared by every `/readyz` request of a process).
#[derive(Debug)]
pub struct RedisGrace {
    grace: Duration,
    failing_since: Mutex<Option<Instant>>,
}

impl RedisGrace {
    /// Redis counts as down once it has failed for longer than `grace` (zero: at the first failure).
    pub fn new(grace: Duration) -> Self {
        Self { grace, failing_since: Mutex::new(None) }
    }

    /// The grace period.
    pub fn grace(&self) -> Duration {
        self.grace
    }

    /// Records the outcome of one check made at `now` and says what readiness makes of it.
    pub fn observe(&self, ok: bool, now: Instant) -> RedisVerdict {
        // A poisoned lock only means another check panicked mid-update; the instant it holds is still usable.
        let mut since = self.failing_since.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if ok {
            *since = None;
            return RedisVerdict::Ok;
        }
        let failing_for = now.saturating_duration_since(*since.get_or_insert(now));
        if self.grace.is_zero() || failing_for > self.grace {
            RedisVerdict::Down { failing_for }
        } else {
            RedisVerdict::Degraded { failing_for }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GRACE: Duration = Duration::from_secs(10);

    #[test]
    fn a_failure_shorter_than_the_grace_is_degraded_and_ready() {
        let redis = RedisGrace::new(GRACE);
        let t0 = Instant::now();
        assert_eq!(redis.observe(false, t0), RedisVerdict::Degraded { failing_for: Duration::ZERO });
        let verdict = redis.observe(false, t0 + Duration::from_secs(9));
        assert_eq!(verdict, RedisVerdict::Degraded { failing_for: Duration::from_secs(9) });
        assert!(verdict.is_ready());
    }

    #[test]
    fn a_failure_longer_than_the_grace_is_down() {
        let redis = RedisGrace::new(GRACE);
        let t0 = Instant::now();
        redis.observe(false, t0);
        let verdict = redis.observe(false, t0 + Duration::from_secs(11));
        assert_eq!(verdict, RedisVerdict::Down { failing_for: Duration::from_secs(11) });
        assert!(!verdict.is_ready());
    }

    #[test]
    fn a_success_starts_the_grace_over() {
        let redis = RedisGrace::new(GRACE);
        let t0 = Instant::now();
        redis.observe(false, t0);
        assert_eq!(redis.observe(true, t0 + Duration::from_secs(8)), RedisVerdict::Ok);
        let verdict = redis.observe(false, t0 + Duration::from_secs(12));
        assert_eq!(verdict, RedisVerdict::Degraded { failing_for: Duration::ZERO });
    }

    #[test]
    fn without_a_grace_the_first_failure_is_down() {
        let redis = RedisGrace::new(Duration::ZERO);
        assert!(!redis.observe(false, Instant::now()).is_ready());
    }
}
