//! Dead letters: what one is, and replaying one of a workspace as the application role, under row-level security.
//!
//! Operators work across workspaces through [`crate::admin::Admin`] (`conveyor dlq list|show|replay|discard`, the
//! admin API, the web UI): listing goes through the audited `conveyor_admin_dead_letters` function, which only the
//! operator role may execute (operator metadata and redacted reasons, never payloads).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use uuid::Uuid;

use crate::db;
use crate::ids::WorkspaceId;
pub use crate::outbox::transitions::Replay;

/// A dead-lettered job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, sqlx::FromRow)]
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

/// Sends the dead letter `id` of `workspace` through the outbox again, from its first attempt, and re-queues its
/// operation; not while another live job holds its de-dup key. Another workspace's job is not a dead letter here.
pub async fn replay(pool: &PgPool, workspace: WorkspaceId, id: Uuid) -> Result<Replay, sqlx::Error> {
    let mut tx = db::begin_workspace(pool, workspace).await?;
    let operation: Option<Option<Uuid>> =
        sqlx::query_scalar("SELECT operation_id FROM conveyor.outbox_events WHERE id = $1 AND status = 'dead_letter'")
            .bind(id)
            .fetch_optional(&mut *tx)
            .await?;
    let Some(operation) = operation else { return Ok(Replay::NotDeadLetter) };
    let replayed = crate::outbox::transitions::replay_tx(&mut tx, workspace, id, operation).await?;
    tx.commit().await?;
    Ok(replayed)
}
