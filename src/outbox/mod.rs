//! The transactional outbox (seed section 3): a business transaction that starts background work writes an
//! `outbox_events` row (a job) beside its business rows; the dispatcher relays committed rows into Redis Streams.
//! Every change of a job's status after that lives in [`transitions`].

pub(crate) mod control;
mod dedup;
mod enqueue;
pub(crate) mod events;
mod queue_ops;
pub(crate) mod reconcile;
pub(crate) mod transitions;
mod tree;

use crate::db::WorkspaceTx;
use crate::ids::WorkspaceId;
pub use enqueue::{DedupMode, EnqueueError, EnqueueOptions, Enqueued, enqueue_many_tx, enqueue_tx};
pub use queue_ops::{
    ChangeError, CleanJobs, JobChange, JobScope, ObliterateError, Obliterated, Retried, change_job, clean_jobs,
    drain_jobs, obliterate_queue, promote_jobs, retry_jobs,
};
pub use tree::{ChildFailure, EnqueuedFlow, Flow, MAX_FLOW_JOBS, enqueue_flow_tx};

/// The channel the dispatcher `LISTEN`s on; a commit that wrote events notifies it when no dispatcher is awake
/// (`conveyor_wake_dispatchers`, migration 0039). The payload is the workspace, followed by `@<ms since the epoch>`
/// when the earliest job written is due later.
pub(crate) const NOTIFY_CHANNEL: &str = "conveyor_outbox";

/// The channel a job's end (completed, failed, canceled) is announced on; the payload is its workspace.
pub(crate) const DONE_CHANNEL: &str = "conveyor_jobs_done";

/// The channel a job event other than an end (`job_events`) is announced on, where a subscription wants it; the
/// payload is its workspace.
pub(crate) const EVENTS_CHANNEL: &str = "conveyor_job_events";

/// The channel a cancellation is announced on, for the worker running the job; the payload is the job id.
pub(crate) const CANCEL_CHANNEL: &str = "conveyor_jobs_canceled";

/// Tells the dispatchers, at commit, that `workspace` has due events (the payload is its id, so they need not
/// look it up). Several notifications of one transaction with the same payload arrive as one.
pub(crate) async fn notify_tx(tx: &mut WorkspaceTx, workspace: WorkspaceId) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_notify($1, $2)")
        .bind(NOTIFY_CHANNEL)
        .bind(workspace.0.to_string())
        .execute(&mut **tx)
        .await?;
    Ok(())
}
