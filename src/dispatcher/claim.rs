//! The dispatcher's SQL: claim a leased batch, mark it dispatched (fenced by the lease), record failures. Every
//! statement runs in a transaction scoped to one workspace, under row-level security.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use uuid::Uuid;

use crate::db;
use crate::ids::WorkspaceId;

/// A claimed event, leased to this dispatcher.
#[derive(Debug, sqlx::FromRow)]
pub struct ClaimedEvent {
    /// Event id (job id).
    pub id: Uuid,
    /// Tenant.
    pub workspace_id: Uuid,
    /// Queue.
    pub queue: String,
    /// Job type.
    pub event_type: String,
    /// Payload (ids only).
    pub event_payload: serde_json::Value,
    /// The operation it advances.
    pub operation_id: Option<Uuid>,
    /// Failed hand-offs so far.
    pub attempt_count: i32,
    /// Committed at (approximately: the insert time).
    pub created_at: DateTime<Utc>,
    /// Trace context.
    pub traceparent: Option<String>,
    /// Re-drive generation.
    pub redrive_count: i32,
    /// Failed handler runs so far.
    pub job_attempts: i32,
    /// When it became due.
    pub next_attempt_at: DateTime<Utc>,
}

/// Which workspaces have due events (pending and due, or leased with an expired lease), most overdue first.
pub async fn due_workspaces(pool: &PgPool, limit: i32) -> Result<Vec<WorkspaceId>, sqlx::Error> {
    let rows: Vec<(Uuid,)> = sqlx::query_as("SELECT workspace_id FROM conveyor_due_outbox_workspaces($1)")
        .bind(limit)
        .fetch_all(pool)
        .await?;
    Ok(rows.into_iter().map(|(id,)| WorkspaceId(id)).collect())
}

/// The dispatcher's own transactions skip the wait for their WAL flush. Safe: a claim or a mark lost in a PostgreSQL
/// crash only sends the event through the relay again, where its de-dup key finds it already in the stream. The
/// business transaction that wrote the event stays fully synchronous.
const RELAXED_COMMIT: &str = "SET LOCAL synchronous_commit = off;";

/// Sent with the claim transaction's BEGIN: events whose lease expired (their dispatcher died) become due again.
const RELAXED_COMMIT_AND_EXPIRE_LEASES: &str = "SET LOCAL synchronous_commit = off;
     UPDATE outbox_events SET status = 'pending', locked_by = NULL, locked_until = NULL
     WHERE status = 'dispatching' AND locked_until <= now();";

/// Claims up to `limit` due events of `workspace` in due order (`next_attempt_at`, then id: for fresh events, the
/// order they were written), skipping rows another dispatcher has locked, and leases them to `me` for `lease`.
/// Events whose lease expired (their dispatcher died) become due again first. Commits before returning, so the
/// lease is visible to every other dispatcher.
pub async fn claim(
    pool: &PgPool,
    workspace: WorkspaceId,
    me: &str,
    lease: Duration,
    limit: i64,
) -> Result<Vec<ClaimedEvent>, sqlx::Error> {
    let mut tx = db::begin_workspace_then(pool, workspace, RELAXED_COMMIT_AND_EXPIRE_LEASES).await?;
    // The subquery walks the partial index (workspace_id, next_attempt_at, id) in order and stops at `limit`;
    // `= ANY(ARRAY(...))` keeps the update an index lookup per claimed id.
    let mut events = sqlx::query_as::<_, ClaimedEvent>(
        "UPDATE outbox_events e
         SET status = 'dispatching', locked_by = $2, locked_until = now() + make_interval(secs => $3)
         WHERE e.id = ANY(ARRAY(
             SELECT id FROM outbox_events
             WHERE status = 'pending' AND next_attempt_at <= now()
             ORDER BY next_attempt_at, id
             LIMIT $1
             FOR UPDATE SKIP LOCKED))
         RETURNING e.id, e.workspace_id, e.queue, e.event_type, e.event_payload, e.operation_id, e.attempt_count,
                   e.created_at, e.traceparent, e.redrive_count, e.job_attempts, e.next_attempt_at",
    )
    .bind(limit)
    .bind(me)
    .bind(lease.as_secs_f64())
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    events.sort_by_key(|e| (e.next_attempt_at, e.id));
    Ok(events)
}

/// A hand-off that failed.
pub struct Failure {
    /// The event.
    pub id: Uuid,
    /// Its failed hand-offs so far, this one included.
    pub attempt: i32,
    /// Back-off before the next try.
    pub delay: Duration,
    /// Redacted reason.
    pub error: String,
}

/// What [`settle`] changed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Settled {
    /// Events marked dispatched.
    pub dispatched: u64,
    /// Events returned to pending with a back-off.
    pub retried: u64,
    /// Events dead-lettered.
    pub dead_lettered: u64,
    /// Events no longer leased to us (lease expired and taken): left alone.
    pub lost_lease: u64,
}

/// In one transaction: marks `dispatched` the events whose lease `me` still holds (fenced: `locked_by = me` and
/// `locked_until > now()`), and returns `failures` to `pending` with their back-off, or to `dead_letter` once they
/// reach `max_attempts` (failing their operation with a redacted reason).
pub async fn settle(
    pool: &PgPool,
    workspace: WorkspaceId,
    me: &str,
    delivered: &[(Uuid, String)],
    failures: &[Failure],
    max_attempts: i32,
) -> Result<Settled, sqlx::Error> {
    let mut settled = Settled::default();
    let mut tx = db::begin_workspace_then(pool, workspace, RELAXED_COMMIT).await?;
    if !delivered.is_empty() {
        let ids: Vec<Uuid> = delivered.iter().map(|(id, _)| *id).collect();
        let stream_ids: Vec<&str> = delivered.iter().map(|(_, sid)| sid.as_str()).collect();
        settled.dispatched = sqlx::query(
            "UPDATE outbox_events e
             SET status = 'dispatched', stream_id = v.stream_id, dispatched_at = now(),
                 locked_by = NULL, locked_until = NULL, last_error = NULL
             FROM unnest($1::uuid[], $2::text[]) AS v(id, stream_id)
             WHERE e.id = v.id AND e.status = 'dispatching' AND e.locked_by = $3 AND e.locked_until > now()",
        )
        .bind(&ids)
        .bind(&stream_ids)
        .bind(me)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        settled.lost_lease += delivered.len() as u64 - settled.dispatched;
    }
    if !failures.is_empty() {
        let ids: Vec<Uuid> = failures.iter().map(|f| f.id).collect();
        let delays: Vec<f64> = failures.iter().map(|f| f.delay.as_secs_f64()).collect();
        let errors: Vec<&str> = failures.iter().map(|f| f.error.as_str()).collect();
        let rows: Vec<(String, Option<Uuid>)> = sqlx::query_as(
            "UPDATE outbox_events e
             SET attempt_count = e.attempt_count + 1,
                 status = CASE WHEN e.attempt_count + 1 >= $4 THEN 'dead_letter' ELSE 'pending' END,
                 failure_stage = CASE WHEN e.attempt_count + 1 >= $4 THEN 'dispatch' END,
                 dead_lettered_at = CASE WHEN e.attempt_count + 1 >= $4 THEN now() END,
                 next_attempt_at = now() + make_interval(secs => v.delay),
                 last_error = v.error, locked_by = NULL, locked_until = NULL
             FROM unnest($1::uuid[], $2::float8[], $3::text[]) AS v(id, delay, error)
             WHERE e.id = v.id AND e.status = 'dispatching' AND e.locked_by = $5
             RETURNING e.status, e.operation_id",
        )
        .bind(&ids)
        .bind(&delays)
        .bind(&errors)
        .bind(max_attempts)
        .bind(me)
        .fetch_all(&mut *tx)
        .await?;
        let dead_operations: Vec<Uuid> =
            rows.iter().filter(|(status, _)| status == "dead_letter").filter_map(|(_, op)| *op).collect();
        settled.dead_lettered = rows.iter().filter(|(status, _)| status == "dead_letter").count() as u64;
        settled.retried = rows.len() as u64 - settled.dead_lettered;
        settled.lost_lease += failures.len() as u64 - rows.len() as u64;
        if !dead_operations.is_empty() {
            sqlx::query(
                "UPDATE operations SET status = 'failed', error = 'the job could not be handed to a worker',
                        finished_at = now(), updated_at = now()
                 WHERE id = ANY($1) AND status IN ('queued', 'running')",
            )
            .bind(&dead_operations)
            .execute(&mut *tx)
            .await?;
        }
    }
    tx.commit().await?;
    Ok(settled)
}

/// Deletes dispatched events older than `retention`, at most `batch` per statement and `max_batches` in all.
pub async fn purge_dispatched(
    pool: &PgPool,
    retention: Duration,
    batch: i64,
    max_batches: usize,
) -> Result<u64, sqlx::Error> {
    let mut deleted = 0;
    let mut batches = 0;
    let retention_secs = retention.as_secs_f64();
    let workspaces: Vec<(Uuid,)> = sqlx::query_as(
        "SELECT workspace_id FROM conveyor_outbox_retention_workspaces(make_interval(secs => $1), 1000)",
    )
    .bind(retention_secs)
    .fetch_all(pool)
    .await?;
    for (workspace,) in workspaces {
        loop {
            if batches >= max_batches {
                return Ok(deleted);
            }
            let mut tx = db::begin_workspace(pool, WorkspaceId(workspace)).await?;
            let done = sqlx::query(
                "DELETE FROM outbox_events WHERE id IN (
                     SELECT id FROM outbox_events
                     WHERE status = 'dispatched' AND dispatched_at <= now() - make_interval(secs => $1)
                     LIMIT $2)",
            )
            .bind(retention_secs)
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
    Ok(deleted)
}
