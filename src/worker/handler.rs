//! What a job handler implements, and what it gets: the job, its workspace transaction, a cancellation token and a
//! way to report progress.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::backoff::Backoff;
use chrono::{DateTime, Utc};

use crate::db::WorkspaceTx;
use crate::ids::WorkspaceId;
use crate::outbox::JobPayload;

/// A boxed future borrowing for `'a`.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Why a handler failed.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// Worth retrying with back-off (an unavailable dependency, a time-out).
    #[error("{0}")]
    Retryable(String),
    /// Retrying cannot help: dead-letter at once.
    #[error("{0}")]
    Permanent(String),
}

impl From<sqlx::Error> for JobError {
    fn from(e: sqlx::Error) -> Self {
        Self::Retryable(format!("database: {e}"))
    }
}

/// One job being run.
pub struct Job {
    /// The outbox event id (the job id).
    pub event_id: Uuid,
    /// Its workspace; [`Job::tx`] is scoped to it.
    pub workspace_id: WorkspaceId,
    /// The operation it advances, if any.
    pub operation_id: Option<Uuid>,
    /// 1 on the first run.
    pub attempt: u32,
    /// What to do.
    pub payload: JobPayload,
    /// W3C trace context from the request that caused it.
    pub traceparent: String,
    /// When its event was committed, if the entry says.
    pub enqueued_at: Option<DateTime<Utc>>,
    /// Cancelled when the job times out or the worker stops past its grace period.
    pub cancel: CancellationToken,
    pub(crate) tx: Option<WorkspaceTx>,
    pub(crate) pool: PgPool,
}

impl Job {
    /// The workspace transaction the job's effects are written in, opened on first use (a job that never touches
    /// PostgreSQL never pays for one). It holds the job's lock, so two deliveries of one job never run their
    /// transactions at once. The runtime commits it with the operation's outcome, then acknowledges the entry; if
    /// the handler fails, it rolls back.
    pub async fn tx(&mut self) -> Result<&mut WorkspaceTx, sqlx::Error> {
        if self.tx.is_none() {
            let mut tx = crate::db::begin_workspace(&self.pool, self.workspace_id).await?;
            super::record::lock_job_tx(&mut tx, self.event_id).await?;
            self.tx = Some(tx);
        }
        Ok(self.tx.as_mut().expect("just opened"))
    }

    /// Records progress on the operation (visible to clients at once, outside the job's transaction).
    pub async fn progress(&self, progress: serde_json::Value) -> Result<(), sqlx::Error> {
        let Some(operation) = self.operation_id else { return Ok(()) };
        let mut tx = crate::db::begin_workspace(&self.pool, self.workspace_id).await?;
        sqlx::query("UPDATE operations SET progress = $2, updated_at = now() WHERE id = $1 AND status = 'running'")
            .bind(operation)
            .bind(progress)
            .execute(&mut *tx)
            .await?;
        tx.commit().await
    }
}

/// A job handler: must be re-entrant, since delivery is at least once (the runtime already skips jobs whose
/// operation has finished, and runs one job id at a time).
pub trait Handler: Send + Sync + 'static {
    /// Runs the job; the value becomes the operation's `result`.
    fn handle<'a>(&'a self, job: &'a mut Job) -> BoxFuture<'a, Result<serde_json::Value, JobError>>;

    /// Runs before dead-lettering (default 5).
    fn max_attempts(&self) -> u32 {
        5
    }

    /// Longest run before the job is cancelled and retried (default 60 s).
    fn timeout(&self) -> Duration {
        Duration::from_secs(60)
    }

    /// Back-off between runs (default 1 s doubling to 5 min, with jitter).
    fn backoff(&self) -> Backoff {
        Backoff { base: Duration::from_secs(1), max: Duration::from_secs(300) }
    }
}
