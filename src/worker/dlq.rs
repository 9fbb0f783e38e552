//! Dead letters: list, show and replay (`conveyor dlq list|show|replay`). Listing goes through a narrow
//! `SECURITY DEFINER` function (operator metadata and redacted reasons, never payloads); a replay writes under
//! row-level security in the dead letter's own workspace.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;
use uuid::Uuid;

use crate::db;
use crate::ids::WorkspaceId;
pub use crate::outbox::transitions::Replay;

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

/// Sends a dead letter through the outbox again, from its first attempt, and re-queues its operation; not while
/// another live job holds its de-dup key.
pub async fn replay(pool: &PgPool, id: Uuid) -> Result<Replay, sqlx::Error> {
    let Some(dead) = show(pool, id).await? else { return Ok(Replay::NotDeadLetter) };
    let workspace = WorkspaceId(dead.workspace_id);
    let mut tx = db::begin_workspace(pool, workspace).await?;
    let moved = crate::outbox::transitions::replay_tx(&mut tx, workspace, id, dead.operation_id).await?;
    tx.commit().await?;
    Ok(moved)
}
