//! The worker's SQL: an operation's progress through `running` to its outcome, retries through the outbox, dead
//! letters. Each function runs under row-level security in its job's workspace.

use std::time::Duration;

use sqlx::PgPool;
use uuid::Uuid;

use crate::db::{self, WorkspaceTx};
use crate::ids::WorkspaceId;

/// Marks the operation `running` for attempt `attempt`. False when it has already finished (a repeat delivery).
pub async fn start(pool: &PgPool, workspace: WorkspaceId, operation: Uuid, attempt: u32) -> Result<bool, sqlx::Error> {
    let mut tx = db::begin_workspace(pool, workspace).await?;
    let started = sqlx::query(
        "UPDATE operations
         SET status = 'running', started_at = coalesce(started_at, now()), attempt = $2, updated_at = now()
         WHERE id = $1 AND status IN ('queued', 'running')",
    )
    .bind(operation)
    .bind(attempt as i32)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    tx.commit().await?;
    Ok(started == 1)
}

/// Shows that the running operation's job is alive (`updated_at = now()`), outside the job's transaction.
pub async fn keep_alive(pool: &PgPool, workspace: WorkspaceId, operation: Uuid) -> Result<(), sqlx::Error> {
    let mut tx = db::begin_workspace(pool, workspace).await?;
    sqlx::query("UPDATE operations SET updated_at = now() WHERE id = $1 AND status = 'running'")
        .bind(operation)
        .execute(&mut *tx)
        .await?;
    tx.commit().await
}

/// Serializes runs of one job id: a duplicate delivery waits here until the first run's transaction ends.
pub async fn lock_job_tx(tx: &mut WorkspaceTx, event_id: Uuid) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('conveyor-job:' || $1::text, 0))")
        .bind(event_id)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Whether the operation has reached an end state (so a run would repeat finished work).
pub async fn finished_tx(tx: &mut WorkspaceTx, operation: Uuid) -> Result<bool, sqlx::Error> {
    let status: Option<(String,)> =
        sqlx::query_as("SELECT status FROM operations WHERE id = $1").bind(operation).fetch_optional(&mut **tx).await?;
    Ok(status.is_none_or(|(s,)| matches!(s.as_str(), "succeeded" | "failed" | "canceled")))
}

/// Marks the operation `succeeded` with `result`, in the job's transaction.
pub async fn succeed_tx(tx: &mut WorkspaceTx, operation: Uuid, result: &serde_json::Value) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE operations SET status = 'succeeded', result = $2, error = NULL, progress = NULL,
                finished_at = now(), updated_at = now()
         WHERE id = $1",
    )
    .bind(operation)
    .bind(result)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Schedules another run after `delay`: the outbox event goes back to `pending` with a new re-drive generation
/// (so its next hand-off gets past the de-dup key), and the operation back to `queued` with the redacted error.
///
/// Fenced by the delivery's generation (`redrive`), not by the event's status: the dispatcher records a hand-off after
/// its `XADD`, so a job that fails fast can find its event still `dispatching` (or, if its dispatcher died, `pending`
/// again). Any status but `dead_letter` with the same generation means this delivery is the current one; a lease still
/// held on it is simply lost (its holder's mark no longer matches, and its `XADD` found the old de-dup key). False,
/// and nothing changes, when the generation has moved on (another delivery is already under way). `redrive` is
/// `None` for an entry that carries no generation: it is taken for the current one.
pub async fn retry(
    pool: &PgPool,
    workspace: WorkspaceId,
    event_id: Uuid,
    redrive: Option<i32>,
    operation: Option<Uuid>,
    delay: Duration,
    error: &str,
) -> Result<bool, sqlx::Error> {
    let mut tx = db::begin_workspace(pool, workspace).await?;
    let moved = sqlx::query(
        "UPDATE outbox_events
         SET status = 'pending', next_attempt_at = now() + make_interval(secs => $2), job_attempts = job_attempts + 1,
             redrive_count = redrive_count + 1, last_error = $3, stream_id = NULL, dispatched_at = NULL,
             locked_by = NULL, locked_until = NULL
         WHERE id = $1 AND redrive_count = coalesce($4, redrive_count) AND status <> 'dead_letter'",
    )
    .bind(event_id)
    .bind(delay.as_secs_f64())
    .bind(error)
    .bind(redrive)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    if let Some(operation) = operation.filter(|_| moved == 1) {
        sqlx::query(
            "UPDATE operations SET status = 'queued', error = $2, updated_at = now()
             WHERE id = $1 AND status IN ('queued', 'running')",
        )
        .bind(operation)
        .bind(error)
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(moved == 1)
}

/// Dead-letters the job: the outbox event keeps the redacted reason, the operation fails with it. Fenced by the
/// delivery's generation, like [`retry`]: false, and nothing changes, when a newer delivery exists or the event is
/// already dead-lettered. An event no longer in the outbox (purged) has no generation to protect: its operation
/// fails.
pub async fn dead_letter(
    pool: &PgPool,
    workspace: WorkspaceId,
    event_id: Uuid,
    redrive: Option<i32>,
    operation: Option<Uuid>,
    error: &str,
) -> Result<bool, sqlx::Error> {
    let mut tx = db::begin_workspace(pool, workspace).await?;
    let moved = sqlx::query(
        "UPDATE outbox_events
         SET status = 'dead_letter', failure_stage = 'job', dead_lettered_at = now(), last_error = $2,
             job_attempts = job_attempts + 1, locked_by = NULL, locked_until = NULL
         WHERE id = $1 AND redrive_count = coalesce($3, redrive_count) AND status <> 'dead_letter'",
    )
    .bind(event_id)
    .bind(error)
    .bind(redrive)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    // An event already purged (its entry outlived the outbox's retention) still fails its operation.
    let gone = moved == 0
        && sqlx::query_scalar::<_, bool>("SELECT NOT EXISTS (SELECT 1 FROM outbox_events WHERE id = $1)")
            .bind(event_id)
            .fetch_one(&mut *tx)
            .await?;
    if let Some(operation) = operation.filter(|_| moved == 1 || gone) {
        sqlx::query(
            "UPDATE operations SET status = 'failed', error = $2, finished_at = now(), updated_at = now()
             WHERE id = $1 AND status IN ('queued', 'running')",
        )
        .bind(operation)
        .bind(error)
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(moved == 1 || gone)
}

/// Sends a `dispatched` event through the outbox again (new re-drive generation), e.g. after Redis lost its entry.
pub async fn redrive_tx(tx: &mut WorkspaceTx, workspace: WorkspaceId, event_id: Uuid) -> Result<bool, sqlx::Error> {
    let moved = sqlx::query(
        "UPDATE outbox_events
         SET status = 'pending', next_attempt_at = now(), redrive_count = redrive_count + 1,
             stream_id = NULL, dispatched_at = NULL
         WHERE id = $1 AND status = 'dispatched'",
    )
    .bind(event_id)
    .execute(&mut **tx)
    .await?
    .rows_affected();
    crate::outbox::notify_tx(tx, workspace).await?;
    Ok(moved == 1)
}

/// The event behind a stream entry id of `queue`, found across workspaces (ids only).
pub async fn event_by_stream_id(
    pool: &PgPool,
    queue: &str,
    entry_id: &str,
) -> Result<Option<(Uuid, WorkspaceId)>, sqlx::Error> {
    let row: Option<(Uuid, Uuid)> = sqlx::query_as("SELECT id, workspace_id FROM conveyor_event_by_stream_id($1, $2)")
        .bind(queue)
        .bind(entry_id)
        .fetch_optional(pool)
        .await?;
    Ok(row.map(|(id, ws)| (id, WorkspaceId(ws))))
}
