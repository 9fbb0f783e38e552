//! Repeatable jobs: a named schedule per workspace that enqueues a job of a kind on every tick of a cron expression
//! (in a time zone) or of a fixed period.
//!
//! Set one with [`upsert_schedule_tx`] in the caller's workspace transaction; the dispatchers fire it. A tick fires
//! at most once across any number of dispatchers, enforced by the database: the `job_schedule_runs` row (primary key
//! schedule and tick), the job's outbox row and the advance of the schedule's `next_run_at` are written in one
//! transaction, with the schedule row locked `FOR UPDATE SKIP LOCKED` (a dispatcher skips a schedule another is
//! firing). The job is then an ordinary job: its de-duplication key is `schedule:<schedule id>:<tick in ms>`.
//!
//! On time: a dispatcher sleeps until the earliest next tick of all schedules, so a tick fires within moments of
//! its time; at worst (a dispatcher that missed the wake-up) within one poll interval.
//!
//! Catch-up after downtime: a schedule whose ticks were missed (no dispatcher ran, or it was paused and its
//! `next_run_at` was moved into the past) fires ONCE, for the most recent missed tick, and then continues from the
//! first tick after now. The run records which tick it stands for. Resuming a paused schedule starts from the first
//! tick after the resume, with no catch-up.

mod fire;
mod spec;
mod store;

use std::time::Duration;

pub use fire::{FireOutcome, fire_due};
pub(crate) use fire::{fire_for_sweep, sooner};
pub use spec::ScheduleSpec;
pub use store::{
    Schedule, ScheduleOptions, list_schedules, pause_schedule, registered_queue, remove_schedule_tx, resume_schedule,
    upsert_schedule_raw_tx, upsert_schedule_tx,
};

/// Why a schedule was not set or changed. Bad input never writes anything.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ScheduleError {
    /// The cron expression does not parse, or never matches.
    #[error("bad cron expression `{expression}`: {detail}")]
    BadCron {
        /// The expression given.
        expression: String,
        /// What is wrong with it.
        detail: String,
    },
    /// The time zone is not an IANA zone name.
    #[error("unknown time zone `{0}` (an IANA name such as Europe/Paris or UTC)")]
    UnknownTimeZone(String),
    /// The period of an every-N schedule is out of range.
    #[error("bad period {0:?}: it must be 1 s to 366 days, in whole milliseconds")]
    BadEvery(Duration),
    /// The schedule's name is not 1 to 100 lower-case letters, digits and `_ . : -` (starting with a letter or
    /// digit).
    #[error(
        "bad schedule name `{0}`: 1 to 100 lower-case letters, digits and _ . : - (starting with a letter or digit)"
    )]
    BadName(String),
    /// The kind's name or queue is not valid, or (for an untyped kind) the payload is not a JSON object.
    #[error("bad job: {0}")]
    BadJob(String),
    /// The payload does not serialize to JSON.
    #[error("the job payload does not serialize: {0}")]
    Payload(#[from] serde_json::Error),
    /// The transaction has no workspace set ([`crate::begin_workspace`] sets one).
    #[error(
        "the transaction has no workspace set; begin it with conveyor_jobs::begin (no tenants), Conveyor::begin or conveyor_jobs::begin_workspace"
    )]
    NoWorkspace,
    /// PostgreSQL failed; the caller's transaction is aborted.
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
}

/// Whether `name` is a valid schedule name (the check the table enforces too).
fn valid_schedule_name(name: &str) -> bool {
    crate::kind::valid_kind_name(name)
}
