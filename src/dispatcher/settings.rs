//! [`DispatcherSettings`]: the relay's settings, with their defaults and checks.

use std::time::Duration;

use crate::SettingsError;

/// The outbox relay's settings: start from [`Default`] (the documented defaults), change fields, and
/// [`DispatcherSettings::validate`]. The server reads them from `CONVEYOR_DISPATCH_*` and `CONVEYOR_OUTBOX_RETENTION`.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct DispatcherSettings {
    /// Events claimed per workspace and batch (`CONVEYOR_DISPATCH_BATCH`, default 500).
    pub batch_size: i64,
    /// How long a claim holds events before another dispatcher may take them (`CONVEYOR_DISPATCH_LEASE`, 30s).
    pub lease: Duration,
    /// Failed hand-offs before an event is dead-lettered (`CONVEYOR_DISPATCH_MAX_ATTEMPTS`, default 12).
    pub max_attempts: i32,
    /// First back-off delay (`CONVEYOR_DISPATCH_BACKOFF_BASE`, default 1s).
    pub backoff_base: Duration,
    /// Largest back-off delay (`CONVEYOR_DISPATCH_BACKOFF_MAX`, default 10m).
    pub backoff_max: Duration,
    /// Interval of the sweep over every workspace, beside notifications (`CONVEYOR_DISPATCH_POLL`, default 1s).
    pub poll_interval: Duration,
    /// Groups of workspaces relayed at once (`CONVEYOR_DISPATCH_CONCURRENCY`, default 4).
    pub concurrency: usize,
    /// Life of an event's de-dup key in Redis (`CONVEYOR_DISPATCH_DEDUP_TTL`, default 24h); must exceed the longest
    /// time an event can stay undispatched after its first `XADD` (lease plus back-offs).
    pub dedup_ttl: Duration,
    /// What is left of a de-dup key's life once its hand-off is recorded as dispatched
    /// (`CONVEYOR_DISPATCH_DEDUP_TTL_RECORDED`, default 15m, or the whole `dedup_ttl` if that is shorter). No dispatcher
    /// sends a recorded generation again, except a straggler that lost its lease, or one whose claim and mark a
    /// PostgreSQL crash took back (the relay commits them asynchronously): the key must outlive a lease plus
    /// PostgreSQL's recovery. At least four leases.
    pub dedup_ttl_recorded: Duration,
    /// How long dispatched events are kept for troubleshooting (`CONVEYOR_OUTBOX_RETENTION`, default 7d).
    pub retention: Duration,
    /// Jobs of one workspace handed to the workers and not yet ended, at most, times the workspace's weight
    /// (`CONVEYOR_DISPATCH_WINDOW`, default 256; 0 turns the window, and with it fairness, off).
    pub window: i32,
    /// While it relays, how often the dispatcher looks for new jobs without being told (`CONVEYOR_DISPATCH_TICK`,
    /// default 2ms; 0 turns it off). A dispatcher that saw work in the last second says it is awake, and enqueues
    /// then skip their `NOTIFY`, whose commit lock made every enqueueing COMMIT wait for the others' (migration
    /// 0039); at idle it sleeps, and the first enqueue's notification wakes it. Off, every enqueue notifies.
    pub tick: Duration,
    /// How long, at most, a job should wait in its queue's stream for a worker, at the workers' measured pace
    /// (`CONVEYOR_DISPATCH_QUEUE_WAIT`, default 50ms; 0 turns the gate off). A dispatcher relays into a queue only as
    /// many jobs as its workers take in that time (at least 4 waiting): a flood waits in PostgreSQL, where the
    /// window and the light workspaces' turn apply, not in the stream in front of everyone. Off with the window too.
    pub queue_wait: Duration,
}

impl Default for DispatcherSettings {
    fn default() -> Self {
        Self {
            batch_size: 500,
            lease: Duration::from_secs(30),
            max_attempts: 12,
            backoff_base: Duration::from_secs(1),
            backoff_max: Duration::from_secs(600),
            poll_interval: Duration::from_secs(1),
            concurrency: 4,
            dedup_ttl: Duration::from_secs(24 * 3600),
            dedup_ttl_recorded: Duration::from_secs(15 * 60),
            retention: Duration::from_secs(7 * 24 * 3600),
            window: 256,
            tick: Duration::from_millis(2),
            queue_wait: Duration::from_millis(50),
        }
    }
}

impl DispatcherSettings {
    /// Checks the settings together; the error names the field (and any other it is compared with, in backticks).
    pub fn validate(&self) -> Result<(), SettingsError> {
        let fail = |setting, reason: &str| Err(SettingsError::new(setting, reason));
        if !(0..=100_000).contains(&self.window) {
            return fail("window", "must be between 0 (off) and 100000");
        }
        if !self.queue_wait.is_zero() && self.queue_wait < super::gate::MEASURE_EVERY
            || self.queue_wait > Duration::from_secs(60)
        {
            // Shorter than the time between the gate's looks, the room it gives out at each look runs dry before the
            // next.
            return fail("queue_wait", "must be 0 (off) or between 20ms and 60s");
        }
        if self.tick > Duration::from_millis(100) {
            return fail("tick", "must be at most 100ms (0 turns it off)");
        }
        if !(1..=10_000).contains(&self.batch_size) {
            return fail("batch_size", "must be between 1 and 10000");
        }
        if self.lease < Duration::from_secs(1) {
            return fail("lease", "must be at least 1s");
        }
        if self.max_attempts < 1 {
            return fail("max_attempts", "must be at least 1");
        }
        if self.backoff_max < self.backoff_base {
            return fail("backoff_max", "must not be below `backoff_base`");
        }
        if self.concurrency == 0 {
            return fail("concurrency", "must be at least 1");
        }
        if self.dedup_ttl < self.lease * 4 {
            return fail("dedup_ttl", "must be at least four leases long");
        }
        if self.dedup_ttl_recorded < self.lease * 4 {
            return fail("dedup_ttl_recorded", "must be at least four leases long");
        }
        if self.dedup_ttl_recorded > self.dedup_ttl {
            return fail("dedup_ttl_recorded", "must not exceed `dedup_ttl`");
        }
        if self.retention < self.dedup_ttl {
            // A job deleted while a hand-off of it may still be repeated would leave that repeat nothing to check.
            return fail("retention", "must not be shorter than `dedup_ttl` (the de-dup window)");
        }
        Ok(())
    }
}
