//! Dead letters: list, show and replay (`conveyor dlq list|show|replay`). Listing goes through a narrow
//! `SECURITY DEFINER` function (operator metadata and redacted reasons, never payloads); a replay writes under
//! row-level security in the dead letter's own workspace.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;
use uuid::Uuid;

use crate::db;
use crate::ids::WorkspaceId;

/// A dead-lettered job.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct DeadLetter {
    /// The outbox event (job) id.
    pub id: Uuid,
    /// Its workspace.
    pub workspace_id: Uuid,
    /// Queue.
    pub queue: String,
    /// Job type.
    pub event_type: String,
    /// `dispatch` (never reached Redis) or `job` (the handler failed).
    pub failure_stage: Option<String>,
    /// Attempts made at that stage.
    pub attempts: i32,
    /// Redacted reason.
    pub last_error: Option<String>,
    /// The operation it failed.
    pub operation_id: Option<Uuid>,
    /// Enqueued.
    pub created_at: DateTime<Utc>,
    /// Dead-lettered.
    pub dead_lettered_at: Option<DateTime<Utc>>,
}

/// The newest `limit` dead letters.
pub async fn list(pool: &PgPool, limit: i32) -> Result<Vec<DeadLetter>, sqlx::Error> {
    sqlx::query_as("SELECT * FROM conveyor_dead_letters($1)").bind(limit).fetch_all(pool).await
}

/// One dead letter.
pub async fn show(pool: &PgPool, id: Uuid) -> Result<Option<DeadLetter>, sqlx::Error> {
    sqlx::query_as("SELECT * FROM conveyor_dead_letters(1, $1)").bind(id).fetch_optional(pool).await
}

/// Sends a dead letter through the outbox again, from its first attempt, and re-queues its operation. False when
/// `id` is not a dead letter.
pub async fn replay(pool: &PgPool, id: Uuid) -> Result<bool, sqlx::Error> {
    let Some(dead) = show(pool, id).await? else { return Ok(false) };
    let mut tx = db::begin_workspace(pool, WorkspaceId(dead.workspace_id)).await?;
    let moved = sqlx::query(
        "UPDATE outbox_events
         SET status = 'pending', next_attempt_at = now(), attempt_count = 0, job_attempts = 0,
             redrive_count = redrive_count + 1, last_error = NULL, failure_stage = NULL, dead_lettered_at = NULL,
             stream_id = NULL, dispatched_at = NULL, locked_by = NULL, locked_until = NULL
         WHERE id = $1 AND status = 'dead_letter'",
    )
    .bind(id)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    if let Some(operation) = dead.operation_id {
        sqlx::query(
            "UPDATE operations SET status = 'queued', error = NULL, result = NULL, finished_at = NULL, updated_at = now()
             WHERE id = $1",
        )
        .bind(operation)
        .execute(&mut *tx)
        .await?;
    }
    crate::outbox::notify_tx(&mut tx, WorkspaceId(dead.workspace_id)).await?;
    tx.commit().await?;
    Ok(moved == 1)
}
