//! Retention: deletes expired idempotency records in bounded batches, one workspace at a time under RLS. Nothing
//! younger than 24 hours is ever deleted, whatever its `expires_at` says (seed section 2.1).

use sqlx::PgPool;
use uuid::Uuid;

use conveyor_jobs::WorkspaceId;

/// Deletes expired records, at most `batch` per statement, until none is left or `max_batches` ran. Returns how
/// many rows it deleted.
pub async fn purge_expired(pool: &PgPool, batch: i64, max_batches: usize) -> Result<u64, sqlx::Error> {
    let mut deleted = 0;
    let mut batches = 0;
    while batches < max_batches {
        let workspaces: Vec<(Uuid,)> =
            sqlx::query_as("SELECT workspace_id FROM conveyor_server.conveyor_expired_idempotency_workspaces(100)")
                .fetch_all(pool)
                .await?;
        if workspaces.is_empty() {
            break;
        }
        for (workspace,) in workspaces {
            loop {
                if batches >= max_batches {
                    return Ok(deleted);
                }
                let mut tx = conveyor_jobs::begin_workspace(pool, WorkspaceId(workspace)).await?;
                let done = sqlx::query(
                    "DELETE FROM conveyor_server.idempotency_requests WHERE ctid IN (
                         SELECT ctid FROM conveyor_server.idempotency_requests
                         WHERE expires_at <= now() AND created_at <= now() - interval '24 hours'
                         LIMIT $1)",
                )
                .bind(batch)
                .execute(&mut *tx)
                .await?
                .rows_affected();
                tx.commit().await?;
                batches += 1;
                deleted += done;
                if (done as i64) < batch {
                    break;
                }
            }
        }
    }
    Ok(deleted)
}
