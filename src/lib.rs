//! Conveyor: a job platform on PostgreSQL and Redis Streams. Jobs are enqueued in the caller's own transaction (the
//! transactional outbox), relayed into Redis Streams by a dispatcher, and run by Rust workers with exactly-once
//! effects; tenants are walled off by row-level security.
//!
//! ```text
//! service ── one PostgreSQL transaction (begin_workspace sets app.workspace_id for RLS) ──────────────────┐
//!             business rows + enqueue_tx / enqueue_many_tx (an outbox_events row per job, + pg_notify)   │
//!             COMMIT ────────────────────────────────────────────────────────────────────────────────────┘
//! Dispatcher ◀─ LISTEN/NOTIFY + sweeps + a timer for the next delayed job or tick: claims each workspace's due jobs
//!               by priority within its window, pauses, key and kind limits (SKIP LOCKED, leased), XADDs them
//!               (de-duplicated by job id), marks them dispatched; tops a window up as its jobs end
//! Worker ◀────── XREADGROUP: the kind's Handler in a workspace transaction, completion recorded in it, XACK after
//!               commit; retries with back-off through the outbox, dead letters, cancellation, reclaim of dead consumers
//! get_job / cancel_job / wait_for_job ── job control, under RLS
//! ```
//!
//! The library's whole surface is the list below: define a kind ([`JobKind`]), enqueue it ([`enqueue_tx`],
//! [`enqueue_many_tx`], [`EnqueueOptions`]), run it ([`Worker`], [`Handler`], [`JobContext`]), relay it
//! ([`Dispatcher`]), control it ([`get_job`], [`cancel_job`], [`wait_for_job`], [`subscribe`]), hold it back
//! ([`pause`], [`set_workspace_weight`], [`set_key_limit`]), repeat it on a cron
//! or fixed schedule ([`upsert_schedule_tx`], [`ScheduleSpec`]), and apply Conveyor's schema to a database
//! ([`migrate`]). The README's library section holds a complete program.
//!
//! The modules behind this list are the `conveyor` binary's own (HTTP API, store scenario, configuration) or the
//! platform's internals; they stay reachable for the binary and the crate's integration tests, hidden from the
//! documentation, and are not part of the library's API: they may change in any release.

/// A crash point (the `fail` crate's `fail_point!`), compiled only with the feature `failpoints`.
macro_rules! fail_point {
    ($($arg:tt)*) => {
        #[cfg(feature = "failpoints")]
        fail::fail_point!($($arg)*);
    };
}
pub(crate) use fail_point;

#[doc(hidden)]
pub mod admin;
#[doc(hidden)]
pub mod backoff;
#[doc(hidden)]
pub mod db;
#[doc(hidden)]
pub mod dispatcher;
mod flow;
#[doc(hidden)]
pub mod ids;
mod kind;
mod limits;
#[doc(hidden)]
pub mod maintenance;
#[doc(hidden)]
pub mod metrics;
#[doc(hidden)]
pub mod migrate;
#[doc(hidden)]
pub mod operations;
#[doc(hidden)]
pub mod outbox;
#[doc(hidden)]
pub mod redact;
#[doc(hidden)]
pub mod schedule;
mod secret;
mod settings;
#[doc(hidden)]
pub mod stream;
#[doc(hidden)]
pub mod telemetry;
#[cfg(feature = "testing")]
pub mod testing;
#[doc(hidden)]
pub mod worker;

pub use backoff::Backoff;
pub use db::{WorkspaceTx, begin_workspace};
pub use dispatcher::Dispatcher;
pub use dispatcher::DispatcherSettings;
pub use flow::{FlowError, Pause, PauseScope, list_pauses, pause, resume, set_workspace_weight};
pub use ids::{JobId, UserId, WorkspaceId};
pub use kind::{JobKind, Priority, valid_queue_name};
pub use limits::{
    KeyLimit, KeyLimits, KindLimit, list_key_limits, list_kind_limits, remove_key_limit, remove_kind_limit,
    set_key_limit, set_kind_limit,
};
pub use migrate::migrate;
pub use outbox::control::{
    CancelError, JobEnds, JobInfo, JobStatus, WaitError, cancel_job, get_job, subscribe, wait_for_job,
};
pub use outbox::{EnqueueError, EnqueueOptions, Enqueued, enqueue_many_tx, enqueue_tx};
pub use schedule::{
    Schedule, ScheduleError, ScheduleOptions, ScheduleSpec, list_schedules, pause_schedule, remove_schedule_tx,
    resume_schedule, upsert_schedule_tx,
};
pub use secret::Secret;
pub use settings::SettingsError;
pub use stream::consumer::Consumer;
pub use telemetry::set_exporting as set_trace_export;
pub use worker::{Handler, JobContext, JobError, Outcome, Worker, WorkerBuilder, WorkerSettings};
