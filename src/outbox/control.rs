//! Job control: look a job up, cancel it, wait for its end. Everything runs under row-level security in the caller's
//! workspace: another workspace's job is indistinguishable from one that does not exist.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;
use sqlx::postgres::PgListener;
use uuid::Uuid;

use super::DONE_CHANNEL;
use super::transitions::{self, Cancel};
use crate::db;
use crate::ids::{JobId, WorkspaceId};
use crate::kind::Priority;

/// Where a job is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobStatus {
    /// Waiting for its run-at time.
    Scheduled,
    /// A parent of a flow, waiting for its children to end ([`crate::Flow`]).
    WaitingChildren,
    /// Due, waiting for the relay to hand it to the workers.
    Queued,
    /// A run failed; waiting out its back-off before the next.
    Retrying,
    /// Handed to the workers: in its queue's stream, or running (its operation, if any, says `running`).
    Active,
    /// Ran to success.
    Succeeded,
    /// Failed for good (dead-lettered): a permanent error, attempts exhausted, or a payload that does not decode.
    Failed,
    /// Canceled before it ended.
    Canceled,
}

impl JobStatus {
    /// Every status, in the order of a job's life.
    pub const ALL: [JobStatus; 8] = [
        Self::WaitingChildren,
        Self::Scheduled,
        Self::Queued,
        Self::Active,
        Self::Retrying,
        Self::Succeeded,
        Self::Failed,
        Self::Canceled,
    ];

    /// Its name, as JSON, URLs and the SQL functions write it (`failed`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Scheduled => "scheduled",
            Self::WaitingChildren => "waiting_children",
            Self::Queued => "queued",
            Self::Retrying => "retrying",
            Self::Active => "active",
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
            Self::Canceled => "canceled",
        }
    }

    /// The status named `name` ([`JobStatus::as_str`]), if any.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.as_str() == name)
    }

    /// Whether the job has ended (succeeded, failed or canceled): it will not run again unless replayed.
    pub fn is_finished(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed | Self::Canceled)
    }
}

/// A job as its owner sees it. Never the payload's secrets: the payload holds ids only, and errors are redacted.
#[derive(Clone, Debug, Serialize)]
pub struct JobInfo {
    /// Its id.
    pub id: JobId,
    /// Its kind ([`crate::JobKind::KIND`]).
    pub kind: String,
    /// Its queue.
    pub queue: String,
    /// Where it is.
    pub status: JobStatus,
    /// Its priority.
    pub priority: Priority,
    /// Runs that failed so far.
    pub failed_runs: u32,
    /// Its own limit of runs, if it set one (else the kind's default applies).
    pub max_attempts: Option<u32>,
    /// When it is (or was) due to run next.
    pub run_at: DateTime<Utc>,
    /// The latest progress its handler reported.
    pub progress: Option<serde_json::Value>,
    /// The handler's result, once succeeded.
    pub result: Option<serde_json::Value>,
    /// The last failure, redacted.
    pub last_error: Option<String>,
    /// The operation it advances.
    pub operation_id: Option<Uuid>,
    /// Its de-duplication key.
    pub dedup_key: Option<String>,
    /// Enqueued.
    pub created_at: DateTime<Utc>,
    /// Last handed to the workers.
    pub dispatched_at: Option<DateTime<Utc>>,
    /// Ended.
    pub finished_at: Option<DateTime<Utc>>,
    /// The job it is a child of, in a flow ([`crate::Flow`]).
    pub parent_id: Option<JobId>,
    /// The children it still waits for (its status is [`JobStatus::WaitingChildren`] while there are any).
    pub children_left: u32,
    /// Its deadline, if it set one ([`crate::EnqueueOptions::expire_at`]): not started by then, it is canceled, its
    /// last error saying it expired.
    pub expires_at: Option<DateTime<Utc>>,
}

/// The columns of [`JobInfo`], for `FROM outbox_events e LEFT JOIN operations o ON o.id = e.operation_id`.
pub(super) const COLUMNS: &str = "e.id, e.event_type, e.queue, e.status, e.priority, e.job_attempts, e.attempt_count,
    e.max_attempts, e.next_attempt_at, coalesce(o.progress, e.progress) AS progress,
    coalesce(e.result, o.result) AS result, e.last_error, e.operation_id, e.dedup_key, e.created_at, e.dispatched_at,
    coalesce(e.finished_at, e.dead_lettered_at) AS finished_at, e.parent_id, e.children_left, e.expires_at,
    now() AS now";

#[derive(sqlx::FromRow)]
pub(super) struct Row {
    pub(super) id: Uuid,
    event_type: String,
    queue: String,
    status: String,
    priority: i16,
    job_attempts: i32,
    attempt_count: i32,
    max_attempts: Option<i32>,
    next_attempt_at: DateTime<Utc>,
    progress: Option<serde_json::Value>,
    result: Option<serde_json::Value>,
    last_error: Option<String>,
    operation_id: Option<Uuid>,
    dedup_key: Option<String>,
    created_at: DateTime<Utc>,
    dispatched_at: Option<DateTime<Utc>>,
    finished_at: Option<DateTime<Utc>>,
    parent_id: Option<Uuid>,
    children_left: i32,
    expires_at: Option<DateTime<Utc>>,
    now: DateTime<Utc>,
}

impl From<Row> for JobInfo {
    fn from(r: Row) -> Self {
        let status = match r.status.as_str() {
            "completed" => JobStatus::Succeeded,
            "canceled" => JobStatus::Canceled,
            "dead_letter" => JobStatus::Failed,
            "dispatched" => JobStatus::Active,
            "pending" if r.children_left > 0 => JobStatus::WaitingChildren,
            "pending" if r.next_attempt_at > r.now && r.job_attempts + r.attempt_count > 0 => JobStatus::Retrying,
            "pending" if r.next_attempt_at > r.now => JobStatus::Scheduled,
            _ => JobStatus::Queued,
        };
        Self {
            id: JobId(r.id),
            kind: r.event_type,
            queue: r.queue,
            status,
            priority: Priority::from_level(r.priority),
            failed_runs: r.job_attempts.max(0) as u32,
            max_attempts: r.max_attempts.map(|a| a as u32),
            run_at: r.next_attempt_at,
            progress: r.progress,
            result: r.result,
            last_error: r.last_error,
            operation_id: r.operation_id,
            dedup_key: r.dedup_key,
            created_at: r.created_at,
            dispatched_at: r.dispatched_at,
            finished_at: r.finished_at,
            parent_id: r.parent_id.map(JobId),
            children_left: r.children_left.max(0) as u32,
            expires_at: r.expires_at,
        }
    }
}

/// The job `id` of `workspace`, if it exists there (a discarded dead letter does not: its tombstone is the worker's).
pub async fn get_job(pool: &PgPool, workspace: WorkspaceId, id: JobId) -> Result<Option<JobInfo>, sqlx::Error> {
    let mut tx = db::begin_workspace(pool, workspace).await?;
    let row: Option<Row> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM conveyor.outbox_events e LEFT JOIN conveyor.operations o ON o.id = e.operation_id
         WHERE e.id = $1 AND e.status <> 'discarded'"
    )))
    .bind(id.0)
    .fetch_optional(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(row.map(JobInfo::from))
}

/// The children of the flow job `parent` of `workspace` ([`crate::Flow`]), in the order they were created, as their
/// parent's handler reads them ([`crate::JobContext::children`]): each with its status, result and last error. A child
/// whose failure was to [`crate::ChildFailure::Remove`] it, and failed, is no longer one; a discarded one is gone.
pub async fn get_children(pool: &PgPool, workspace: WorkspaceId, parent: JobId) -> Result<Vec<JobInfo>, sqlx::Error> {
    let mut tx = db::begin_workspace(pool, workspace).await?;
    let children = children_tx(&mut tx, parent).await?;
    tx.commit().await?;
    Ok(children)
}

/// [`get_children`], in the caller's transaction of the parent's workspace.
pub(crate) async fn children_tx(tx: &mut db::WorkspaceTx, parent: JobId) -> Result<Vec<JobInfo>, sqlx::Error> {
    let rows: Vec<Row> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM conveyor.outbox_events e LEFT JOIN conveyor.operations o ON o.id = e.operation_id
         WHERE e.parent_id = $1 AND e.status <> 'discarded'
           AND NOT (e.child_failure = 'remove' AND e.status IN ('dead_letter', 'canceled'))
         ORDER BY e.id"
    )))
    .bind(parent.0)
    .fetch_all(&mut **tx)
    .await?;
    Ok(rows.into_iter().map(JobInfo::from).collect())
}

/// A line of a job's log ([`crate::JobContext::log`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, serde::Deserialize, sqlx::FromRow)]
pub struct LogLine {
    /// Its number in the job's log, from 1.
    pub seq: i32,
    /// The run that wrote it (1 = the first).
    pub attempt: i32,
    /// When.
    pub at: DateTime<Utc>,
    /// The line, redacted.
    pub line: String,
}

/// The log of the job `id` of `workspace`, oldest line first: empty for a job that logged nothing, and for a job
/// that is not there (another workspace's, or none).
pub async fn get_job_logs(pool: &PgPool, workspace: WorkspaceId, id: JobId) -> Result<Vec<LogLine>, sqlx::Error> {
    let mut tx = db::begin_workspace(pool, workspace).await?;
    // A discarded dead letter is gone to its owner, its log with it.
    let lines = sqlx::query_as(
        "SELECT l.seq, l.attempt, l.at, l.line FROM conveyor.job_logs l
         WHERE l.job_id = $1
           AND EXISTS (SELECT 1 FROM conveyor.outbox_events e WHERE e.id = $1 AND e.status <> 'discarded')
         ORDER BY l.seq",
    )
    .bind(id.0)
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(lines)
}

/// Why a job could not be canceled.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CancelError {
    /// No such job in the workspace.
    #[error("no such job")]
    NotFound,
    /// It had already ended.
    #[error("the job has already ended ({0:?})")]
    Finished(JobStatus),
    /// PostgreSQL failed; nothing changed.
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
}

/// Cancels the job `id` of `workspace`, and its operation. A queued or scheduled job never runs. A running job's
/// handler sees its cancellation ([`crate::JobContext::cancellation`], and [`crate::JobContext::progress`] answers
/// [`crate::JobError::Canceled`]) and should stop at its next step; whatever it then returns, its transaction rolls
/// back and the job stays `canceled`. A finished job answers [`CancelError::Finished`].
pub async fn cancel_job(pool: &PgPool, workspace: WorkspaceId, id: JobId) -> Result<(), CancelError> {
    let mut tx = db::begin_workspace(pool, workspace).await?;
    let outcome = transitions::cancel_job_tx(&mut tx, workspace, id).await?;
    tx.commit().await?;
    match outcome {
        Cancel::Canceled => Ok(()),
        Cancel::NotFound => Err(CancelError::NotFound),
        Cancel::Finished(_) => {
            let status = get_job(pool, workspace, id).await?.map_or(JobStatus::Canceled, |j| j.status);
            Err(CancelError::Finished(status))
        }
    }
}

/// Why waiting for a job ended without its end.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WaitError {
    /// No such job in the workspace.
    #[error("no such job")]
    NotFound,
    /// Still not finished when the time ran out; where it was then.
    #[error("the job had not finished in time (status {:?})", .0.status)]
    TimedOut(Box<JobInfo>),
    /// PostgreSQL failed.
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
}

/// Waits until the job `id` of `workspace` has finished (succeeded, failed or canceled), for at most `timeout`, and
/// returns it. It listens for the notification that a job of the workspace ended (`LISTEN`), so it answers within
/// moments of the end without polling; a check every few seconds covers a notification lost with a connection. The
/// `LISTEN` holds one connection of `pool` while it waits: size the pool for the waits you run at once.
pub async fn wait_for_job(
    pool: &PgPool,
    workspace: WorkspaceId,
    id: JobId,
    timeout: Duration,
) -> Result<JobInfo, WaitError> {
    let deadline = tokio::time::Instant::now() + timeout;
    // Listening before the first look: an end between the look and the LISTEN would otherwise be missed.
    let mut listener = PgListener::connect_with(pool).await?;
    listener.listen(DONE_CHANNEL).await?;
    let me = workspace.0.to_string();
    loop {
        let job = get_job(pool, workspace, id).await?.ok_or(WaitError::NotFound)?;
        if job.status.is_finished() {
            return Ok(job);
        }
        // Until a notification names this workspace, the fallback look is due, or time runs out.
        let fallback = tokio::time::Instant::now() + Duration::from_secs(3);
        loop {
            let wake = fallback.min(deadline);
            tokio::select! {
                next = listener.recv() => match next {
                    Ok(n) if n.payload() == me => break,
                    Ok(_) => {}
                    Err(_) => {
                        // The listener reconnects on its next recv; look meanwhile.
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        break;
                    }
                },
                _ = tokio::time::sleep_until(wake) => {
                    if wake == deadline {
                        let job = get_job(pool, workspace, id).await?.ok_or(WaitError::NotFound)?;
                        return if job.status.is_finished() { Ok(job) } else { Err(WaitError::TimedOut(Box::new(job))) };
                    }
                    break;
                }
            }
        }
    }
}
