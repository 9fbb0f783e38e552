//! Job kinds are types: a serde payload type that names itself, its queue and its defaults. A service defines its
//! own kinds without touching Conveyor; Conveyor's own jobs (`crate::jobs`) are defined the same way.

use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::backoff::Backoff;

/// A kind of job: its payload type, with a stable name, the queue its jobs go to and their defaults.
///
/// The payload carries what the handler needs to find its data (ids, versions), never secrets: it is stored in
/// PostgreSQL and copied into Redis. It is encoded as JSON; a payload that no longer decodes (the type changed under
/// jobs in flight) is dead-lettered with a redacted reason, so evolve payloads compatibly (new fields optional).
///
/// ```
/// use conveyor_jobs::JobKind;
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Serialize, Deserialize)]
/// struct SendReceipt {
///     order_id: uuid::Uuid,
/// }
///
/// impl JobKind for SendReceipt {
///     const KIND: &'static str = "orders.send_receipt";
///     const QUEUE: &'static str = "emails";
///     const MAX_ATTEMPTS: u32 = 10;
/// }
/// ```
pub trait JobKind: Serialize + DeserializeOwned + Send + Sync + 'static {
    /// The kind's name, stored with every job and matched by workers: never rename a kind with jobs in flight.
    /// Lower-case letters, digits and `_ . : -`, at most 100 characters.
    const KIND: &'static str;
    /// The queue (one Redis stream) its jobs go to. Lower-case letters, digits and `_ . -`.
    const QUEUE: &'static str;
    /// Runs before a failing job is dead-lettered (default 5). A job may set its own.
    const MAX_ATTEMPTS: u32 = 5;
    /// Longest run before the job is canceled and retried (default 60 s). A job may set its own.
    const TIMEOUT: Duration = Duration::from_secs(60);
    /// Back-off between runs (default 1 s doubling up to 5 min, with jitter). A job may set its own.
    const BACKOFF: Backoff = Backoff { base: Duration::from_secs(1), max: Duration::from_secs(300) };
    /// How long a job that succeeded is kept (default: the global retention). A job may set its own.
    const KEEP_SUCCEEDED: Keep = Keep::GLOBAL;
    /// How long a job that failed (a dead letter) is kept (default: the dead letters' retention). A job may set its
    /// own.
    const KEEP_FAILED: Keep = Keep::GLOBAL;
}

/// How long jobs of one end are kept before maintenance removes them (BullMQ's `removeOnComplete` /
/// `removeOnFail`): by age, by count (the newest N of the job's kind in its workspace that keep a count), or both
/// (kept while within both). A succeeded job past it is deleted; a failed one (a dead letter) is discarded, as an
/// operator's discard does (on the audit trail). The global retention still applies, and caps an age of the job's
/// own: `CONVEYOR_OUTBOX_RETENTION` once it succeeded, `CONVEYOR_DEAD_LETTER_RETENTION` once it failed (a failed job's
/// own setting may go below that retention's floor: the application chose it). Maintenance removes what is past it at
/// its next pass (`CONVEYOR_MAINTENANCE_INTERVAL`): a job removed at once may be gone before a [`crate::wait_for_job`]
/// or a [`crate::subscribe`] reads its end.
///
/// ```
/// use std::time::Duration;
/// use conveyor_jobs::Keep;
///
/// let gone = Keep::none(); // removeOnComplete: true
/// let last = Keep::last(1000); // removeOnComplete: 1000
/// let both = Keep::for_age(Duration::from_secs(3600)).and_last(100); // { age: 3600, count: 100 }
/// # let _ = (gone, last, both);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Keep {
    age: Option<Duration>,
    count: Option<u32>,
}

impl Keep {
    /// The global retention.
    pub const GLOBAL: Self = Self { age: None, count: None };

    /// Removed at maintenance's next pass after its end.
    pub const fn none() -> Self {
        Self { age: Some(Duration::ZERO), count: None }
    }

    /// Kept for `age` after its end (at most ten years).
    pub const fn for_age(age: Duration) -> Self {
        Self { age: Some(age), count: None }
    }

    /// Kept while among the newest `count` jobs of its kind and workspace that ended the same way and keep the same
    /// count (with a kind's `KEEP_*`, every job of the kind); at most a million. The global age applies too.
    pub const fn last(count: u32) -> Self {
        Self { age: None, count: Some(count) }
    }

    /// This, and kept only while among the newest `count` too.
    pub const fn and_last(self, count: u32) -> Self {
        Self { age: self.age, count: Some(count) }
    }

    /// Its age, if it sets one.
    pub fn age(&self) -> Option<Duration> {
        self.age
    }

    /// Its count, if it sets one.
    pub fn count(&self) -> Option<u32> {
        self.count
    }

    /// What is out of range, if anything.
    pub(crate) fn invalid(&self) -> Option<&'static str> {
        if self.age.is_some_and(|a| a > Duration::from_secs(10 * 365 * 86_400)) {
            return Some("a kept age must be at most ten years");
        }
        if self.count.is_some_and(|c| c > 1_000_000) {
            return Some("a kept count must be at most a million");
        }
        None
    }

    /// The stored columns: whole seconds (rounded up) and the count.
    pub(crate) fn columns(&self) -> (Option<i32>, Option<i32>) {
        let secs = self.age.map(|a| i32::try_from(a.as_secs() + u64::from(a.subsec_nanos() > 0)).unwrap_or(i32::MAX));
        (secs, self.count.map(|c| i32::try_from(c).unwrap_or(i32::MAX)))
    }
}

/// What "higher" means: of one workspace's jobs that are due and waiting for the relay, every job of a higher
/// priority is handed to the workers before any of a lower one (within a priority, in due order). Once in a stream,
/// jobs are read in the order they arrived: priority orders the backlog that waits in PostgreSQL, not work already
/// handed over, and it does not reorder jobs of different workspaces.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Priority {
    /// Ahead of everything else of its workspace.
    High,
    /// The default.
    #[default]
    Normal,
    /// After everything else of its workspace.
    Low,
}

impl Priority {
    /// The stored level (0 high, 1 normal, 2 low).
    pub(crate) fn level(self) -> i16 {
        match self {
            Self::High => 0,
            Self::Normal => 1,
            Self::Low => 2,
        }
    }

    /// From a stored level.
    pub(crate) fn from_level(level: i16) -> Self {
        match level {
            0 => Self::High,
            2 => Self::Low,
            _ => Self::Normal,
        }
    }
}

/// Whether `name` is a valid kind name (the check the `job_kinds` table enforces too).
pub(crate) fn valid_kind_name(name: &str) -> bool {
    valid_name(name, |c| matches!(c, '_' | '.' | ':' | '-'))
}

/// Whether `name` is a valid queue name.
pub fn valid_queue_name(name: &str) -> bool {
    valid_name(name, |c| matches!(c, '_' | '.' | '-'))
}

fn valid_name(name: &str, punctuation: impl Fn(char) -> bool) -> bool {
    let mut chars = name.chars();
    let first_ok = chars.next().is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    first_ok && name.len() <= 100 && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || punctuation(c))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_documented_alphabet() {
        assert!(valid_kind_name("store.verify_credentials"));
        assert!(valid_kind_name("a:b-c"));
        assert!(!valid_kind_name(""));
        assert!(!valid_kind_name("Store.verify"));
        assert!(!valid_kind_name(".x"));
        assert!(!valid_kind_name(&"x".repeat(101)));
        assert!(valid_queue_name("stores"));
        assert!(!valid_queue_name("a:b"), "a colon would break the key layout");
        assert!(!valid_queue_name("a}b"), "braces would break the hash tag");
    }

    #[test]
    fn priorities_round_trip_through_their_levels() {
        for p in [Priority::High, Priority::Normal, Priority::Low] {
            assert_eq!(Priority::from_level(p.level()), p);
        }
        assert!(Priority::High.level() < Priority::Low.level());
    }
}
