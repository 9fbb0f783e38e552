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
//! ([`migrate`]: everything in the schema `conveyor`). The README's quick start is a complete program; `docs/library.md` is the guide.
//!
//! Below the list, for services that run Conveyor's parts themselves and for the operator tools: user-visible
//! operations ([`create_operation_tx`], [`get_operation_tx`], [`list_operations_tx`]), the operator surface
//! ([`Admin`]), the connections ([`connect_postgres`], [`connect_redis`]) and the Redis key layout ([`RedisKeys`]),
//! the migrations ([`migrator`], [`migrate_with`], [`adopt_public_layout`]), maintenance ([`Maintenance`]), metrics ([`Metrics`]) and trace
//! context ([`traceparent_of`]). Every module is private but `testing` (feature `testing`): this page is the whole API.

#![warn(unreachable_pub, unnameable_types, missing_docs)]

/// A crash point (the `fail` crate's `fail_point!`), compiled only with the feature `failpoints`.
macro_rules! fail_point {
    ($($arg:tt)*) => {
        #[cfg(feature = "failpoints")]
        fail::fail_point!($($arg)*);
    };
}
pub(crate) use fail_point;

mod admin;
mod backoff;
mod client;
#[cfg(feature = "console")]
pub mod console;
mod db;
mod dispatcher;
mod error;
mod flow;
mod ids;
mod kind;
mod limits;
mod maintenance;
mod metrics;
mod migrate;
mod operations;
mod outbox;
mod redact;
mod schedule;
mod secret;
mod settings;
mod stream;
mod telemetry;
#[cfg(test)]
mod test_db;
#[cfg(feature = "testing")]
pub mod testing;
mod worker;

/// The guides' Rust blocks (`docs/*.md`), compiled and run as doctests: a guide's example that no longer compiles
/// fails `cargo test --doc`.
#[cfg(doctest)]
mod guides {
    #[doc = include_str!("../docs/library.md")]
    struct Library;

    #[cfg(feature = "console")]
    #[doc = include_str!("../docs/console.md")]
    struct Console;
}

pub use backoff::Backoff;
pub use client::{Conveyor, ConveyorBuilder, DEFAULT_MAINTENANCE_INTERVAL, DEFAULT_RECONCILE_AFTER};
pub use db::{WorkspaceTx, begin, begin_workspace};
pub use dispatcher::{DispatchOutcome, Dispatcher, DispatcherSettings};
pub use error::{Error, ErrorKind};
pub use flow::{FlowError, Pause, PauseScope, list_pauses, pause, resume, set_workspace_weight};
pub use ids::{JobId, UserId, WorkspaceId};
pub use kind::{JobKind, Keep, Priority, valid_queue_name};
pub use limits::{
    GlobalLimit, GlobalLimits, GlobalScope, KeyLimit, KeyLimits, KindLimit, list_global_limits, list_key_limits,
    list_kind_limits, remove_global_limit, remove_key_limit, remove_kind_limit, set_global_limit, set_key_limit,
    set_kind_limit,
};
pub use migrate::migrate;
pub use outbox::control::{
    CancelError, JobInfo, JobStatus, LogLine, WaitError, cancel_job, get_children, get_job, get_job_logs, wait_for_job,
};
pub use outbox::events::{
    EventCursor, EventFilter, JobEnds, JobEvent, JobEventType, JobEvents, subscribe, subscribe_events,
};
pub use outbox::transitions::relay::Settled;
pub use outbox::{
    ChangeError, ChildFailure, CleanJobs, DedupMode, EnqueueError, EnqueueOptions, Enqueued, EnqueuedFlow, Flow,
    JobChange, JobScope, MAX_FLOW_JOBS, ObliterateError, Obliterated, Retried, change_job, clean_jobs, drain_jobs,
    enqueue_flow_tx, enqueue_many_tx, enqueue_tx, obliterate_queue, promote_jobs, retry_jobs,
};
pub use schedule::{
    FireOutcome, Schedule, ScheduleError, ScheduleOptions, ScheduleSpec, fire_due as fire_due_schedules,
    list_schedules, pause_schedule, registered_queue, remove_schedule_tx, resume_schedule, upsert_schedule_raw_tx,
    upsert_schedule_tx,
};
pub use secret::Secret;
pub use settings::SettingsError;
pub use worker::dlq::replay as replay_dead_letter;
pub use worker::{Handler, JobContext, JobError, Outcome, Worker, WorkerBuilder, WorkerSettings};

// User-visible operations: what a request started, as its caller sees it.
pub use operations::{
    Cursor as OperationCursor, ListQuery as OperationQuery, MAX_PAGE as MAX_OPERATIONS_PAGE, Operation,
    Page as OperationPage, STATUSES as OPERATION_STATUSES, create_tx as create_operation_tx,
    get_tx as get_operation_tx, list_tx as list_operations_tx,
};
pub use outbox::transitions::{Cancel as OperationCancel, cancel_operation_tx};

// The operator surface: reads across workspaces and audited changes.
pub use admin::{
    Actor, Admin, AdminError, Attempt, AuditEntry, BulkOutcome, CleanFilter, ConsumerInfo, DeadLetter,
    DeadLetterFilter, DrainFilter, DrainOutcome, FlowRelative, JobAction, JobDetail, JobFilter, JobSummary,
    ObliterateFilter, Obliteration, OperationFilter, OperationSummary, Page as AdminPage, QueueMinute, QueueSummary,
    Replay, StateCounts, WorkspaceKeyLimit, WorkspaceKindLimit, WorkspaceShare,
};

// Connections: PostgreSQL, Redis (its TLS, its keys, the producer and consumer the dispatcher and worker use).
pub use db::{
    CHECK_IDLE_AFTER as POSTGRES_CHECK_IDLE_AFTER, connect as connect_postgres, connect_options as postgres_options,
    is_unavailable as is_postgres_unavailable, pool_options as postgres_pool_options,
};
pub use ids::instance_name;
pub use stream::admin::{ServerCheck as RedisCheck, check_server as check_redis};
pub use stream::consumer::{Consumer, Entry as StreamEntry, Fields as StreamFields, QueueStats, Reclaimed};
pub use stream::keys::{Keys as RedisKeys, Partition};
pub use stream::layout::{Layout as StreamLayout, MAX_PARTITIONS};
pub use stream::producer::{JobOptions as StreamJobOptions, Message as StreamMessage, Producer};
pub use stream::{
    RedisClient, RedisError, RedisTls, TlsFileError as RedisTlsError, connect as connect_redis,
    connect_with as connect_redis_with, ping as ping_redis, url_uses_tls as redis_url_uses_tls,
};

// Schema, maintenance, metrics, traces.
pub use maintenance::{
    BATCH as PURGE_BATCH, DEFAULT_AUDIT_RETENTION, DEFAULT_DEAD_LETTER_RETENTION, MAX_BATCHES_PER_PASS, Maintenance,
    PassReport,
};
pub use metrics::{LATENCY_BUCKETS, Metrics};
pub use migrate::{
    APPLICATION_FUNCTIONS, HISTORY_TABLE as MIGRATION_HISTORY_TABLE, MigrateConfig, PublicLayout,
    Roles as MigratedRoles, SCHEMA, adopt_old_layout, adopt_public_layout, migrator,
    pending_versions as pending_migrations, run as migrate_with,
};
pub use outbox::transitions::relay::purge_finished as purge_finished_jobs;
pub use redact::redact;
pub use telemetry::{
    TraceContext, exporting as trace_exporting, is_valid_traceparent, is_valid_tracestate, new_traceparent,
    request_traceparent, set_exporting as set_trace_export, set_parent as set_span_parent,
    set_parent_with_state as set_span_parent_with_state, traceparent_of, tracestate_of,
};
