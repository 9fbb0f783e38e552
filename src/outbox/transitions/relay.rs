//! The relay's transitions: claim a leased batch by priority, mark it dispatched (fenced by the lease and the
//! generation), record failed hand-offs (back-off or dead letter), purge what retention allows. Every statement runs
//! under row-level security for one workspace.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use uuid::Uuid;

use crate::db;
use crate::ids::WorkspaceId;

/// A claimed event, leased to this dispatcher.
#[derive(Debug, sqlx::FromRow)]
pub(crate) struct ClaimedEvent {
    /// The claimed row version's physical address (`ctid`), which the mark goes by.
    pub tid: String,
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
    /// 0 high, 1 normal, 2 low.
    pub priority: i16,
    /// The job's own limit of runs, if set.
    pub max_attempts: Option<i32>,
    /// The job's own time-out, if set.
    pub timeout_ms: Option<i64>,
    /// The job's own back-off base, if set.
    pub backoff_ms: Option<i64>,
    /// The job's own back-off cap, if set.
    pub backoff_max_ms: Option<i64>,
    /// Its workspace's class at this claim (migrations 0024 and 0030): `backlogged` when the workspace's window held
    /// it back (room 0, or its due jobs filled the room and more were due), else `light`.
    pub workspace_class: String,
}

/// A workspace with due events (pending and due, or leased with an expired lease), and whether some are expired
/// leases: their dispatcher died between claim and mark.
#[derive(Debug)]
pub(crate) struct DueWorkspace {
    pub(crate) workspace: WorkspaceId,
    pub(crate) expired_leases: bool,
}

/// Which workspaces have due events, most overdue first (migration 0030).
pub(crate) async fn due_workspaces(pool: &PgPool, limit: i32) -> Result<Vec<DueWorkspace>, sqlx::Error> {
    let rows: Vec<(Uuid, bool)> =
        sqlx::query_as("SELECT workspace_id, expired_leases FROM conveyor.conveyor_due_workspaces($1)")
            .bind(limit)
            .fetch_all(pool)
            .await?;
    Ok(rows
        .into_iter()
        .map(|(id, expired_leases)| DueWorkspace { workspace: WorkspaceId(id), expired_leases })
        .collect())
}

/// When the earliest pending job becomes due, of those due later than `since` ago by PostgreSQL's clock (a time only,
/// from a `SECURITY DEFINER` function). The dispatcher passes the time since its sweep started: a job due before
/// then was the sweep's to take (or is held), one due since then asks for the next sweep.
pub(crate) async fn next_due_after(pool: &PgPool, since: Duration) -> Result<Option<DateTime<Utc>>, sqlx::Error> {
    sqlx::query_scalar("SELECT conveyor.conveyor_next_due_after(now() - $1 * interval '1 microsecond')")
        .bind(i64::try_from(since.as_micros()).unwrap_or(i64::MAX))
        .fetch_one(pool)
        .await
}

/// Tells enqueues that a dispatcher is awake for `for_how_long` from now (PostgreSQL's clock), or longer if another
/// said so: until then they skip their notification (migration 0039). The table is unlogged: no WAL, no flush.
pub(crate) async fn mark_awake(pool: &PgPool, for_how_long: Duration) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT conveyor.conveyor_dispatcher_awake($1 * interval '1 microsecond')")
        .bind(i64::try_from(for_how_long.as_micros()).unwrap_or(i64::MAX))
        .execute(pool)
        .await?;
    Ok(())
}

/// The dispatcher's own transactions skip the wait for their WAL flush. Safe: a claim or a mark lost in a PostgreSQL
/// crash only sends the event through the relay again, where its de-dup key finds it already in the stream. The
/// business transaction that wrote the event stays fully synchronous.
const RELAXED_COMMIT: &str = "SET LOCAL synchronous_commit = off;";

/// What bounds a claim of each workspace: the batch, the window (0: none), and the gate's room per queue.
#[derive(Debug, Default)]
pub(crate) struct Bounds {
    pub(crate) per_workspace: i64,
    pub(crate) window: i32,
    /// The gate's room per queue (see `crate::dispatcher`'s gate).
    pub(crate) gated: crate::dispatcher::Rooms,
}

impl Bounds {
    /// At most `per_workspace` per workspace, within `window`, ungated.
    pub(crate) fn new(per_workspace: i64, window: i32) -> Self {
        Self { per_workspace, window, gated: Default::default() }
    }
}

/// For each of `workspaces`, claims up to `bounds.per_workspace` due events by priority, then in due order
/// (`next_attempt_at`, then id: for fresh events, the order they were written), skipping rows another dispatcher has locked, and leases them to `me`
/// for `lease`. Events whose lease expired (their dispatcher died) become due again first, in the workspaces of
/// `expired` only (a sweep's lookup says which have any; a claim of the workspaces that notifications named passes
/// none, and so never scans the leases, whose index spans every workspace). One statement, so one
/// transaction that commits before returning: the leases are visible to every other dispatcher. It runs as the
/// application role under row-level security: `conveyor_claim_outbox` is a function of the invoker that sets each
/// workspace in turn, so each workspace's claim sees that workspace's rows only.
///
/// The events come back by priority, then in due order, which keeps each workspace's events of one priority in the
/// order they were written.
///
/// With a `window` (> 0), a workspace gets only as many as keep its jobs handed to workers and not yet ended within
/// `window ×` its weight (`workspace_weights`), and none that a pause holds (`dispatch_pauses`): migration 0021. Key
/// limits, blocks and rates, and kind limits hold back their jobs too (migrations 0023 and 0024). Each of the gate's
/// queues takes at most its room in all, shared between the workspaces in their order: the first `light_first` may
/// take all that is left, the others a fair part each. The statement is migration 0041's.
pub(crate) async fn claim(
    pool: &PgPool,
    workspaces: &[WorkspaceId],
    expired: &[WorkspaceId],
    me: &str,
    lease: Duration,
    bounds: &Bounds,
) -> Result<Vec<ClaimedEvent>, sqlx::Error> {
    let Bounds { per_workspace, window, gated } = bounds;
    let ids: Vec<Uuid> = workspaces.iter().map(|w| w.0).collect();
    let expired: Vec<Uuid> = expired.iter().map(|w| w.0).collect();
    let mut events = sqlx::query_as::<_, ClaimedEvent>(
        "SELECT tid::text AS tid, id, workspace_id, queue, event_type, event_payload, operation_id, traceparent,
                attempt_count, job_attempts, redrive_count, created_at, next_attempt_at, priority, max_attempts,
                timeout_ms, backoff_ms, backoff_max_ms, workspace_class
         FROM conveyor.conveyor_claim_jobs_fair($1, $2, $3, $4, $5, $6, $7, $8, $9)",
    )
    .bind(&ids)
    .bind(me)
    .bind(lease.as_secs_f64())
    .bind(i32::try_from(*per_workspace).unwrap_or(i32::MAX))
    .bind(window)
    .bind(&expired)
    .bind(&gated.queues)
    .bind(&gated.rooms)
    .bind(i32::try_from(gated.light_first).unwrap_or(i32::MAX))
    .fetch_all(pool)
    .await?;
    events.sort_by_key(|e| (e.priority, e.next_attempt_at, e.id));
    Ok(events)
}

/// An event in the stream: its workspace, id and stream entry id.
pub(crate) struct Delivered {
    /// Tenant.
    pub workspace: WorkspaceId,
    /// The claimed row version ([`ClaimedEvent::tid`]).
    pub tid: String,
    /// Event id.
    pub id: Uuid,
    /// Stream entry id.
    pub stream_id: String,
    /// Its queue (stream).
    pub queue: String,
    /// Its re-drive generation, which names its de-dup key.
    pub redrive: i32,
}

impl Delivered {
    /// `event`, now in the stream under `stream_id`.
    pub(crate) fn new(event: &ClaimedEvent, stream_id: String) -> Self {
        Self {
            workspace: WorkspaceId(event.workspace_id),
            tid: event.tid.clone(),
            id: event.id,
            stream_id,
            queue: event.queue.clone(),
            redrive: event.redrive_count,
        }
    }
}

/// A hand-off that failed.
pub(crate) struct Failure {
    /// Tenant.
    pub workspace: WorkspaceId,
    /// The event.
    pub id: Uuid,
    /// Its failed hand-offs so far, this one included.
    pub attempt: i32,
    /// Back-off before the next try.
    pub delay: Duration,
    /// Redacted reason.
    pub error: String,
    /// The re-drive generation that was claimed: a failure is recorded only on it.
    pub redrive: i32,
}

/// What a mark of delivered events and failed hand-offs changed.
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
    /// Signs that more is due at once: workspaces whose batch came back full, plus one for a sweep that met more
    /// workspaces than it looks at.
    pub full: u64,
}

/// Marks `dispatched` the events whose lease `me` still holds (fenced: `locked_by = me` and `locked_until > now()`),
/// all in one statement; then, in one transaction per workspace, returns `failures` to `pending` with their back-off,
/// or to `dead_letter` once they reach `max_attempts` (failing their operation with a redacted reason).
pub(crate) async fn settle(
    pool: &PgPool,
    me: &str,
    delivered: &[Delivered],
    failures: &[Failure],
    max_attempts: i32,
) -> Result<Settled, sqlx::Error> {
    let mut settled = Settled::default();
    if !delivered.is_empty() {
        let workspaces: Vec<Uuid> = delivered.iter().map(|d| d.workspace.0).collect();
        let tids: Vec<&str> = delivered.iter().map(|d| d.tid.as_str()).collect();
        let ids: Vec<Uuid> = delivered.iter().map(|d| d.id).collect();
        let redrives: Vec<i32> = delivered.iter().map(|d| d.redrive).collect();
        let stream_ids: Vec<&str> = delivered.iter().map(|d| d.stream_id.as_str()).collect();
        let (marked,): (i64,) =
            sqlx::query_as("SELECT conveyor.conveyor_mark_outbox_dispatched($1, $2, $3::tid[], $4, $5, $6)")
                .bind(me)
                .bind(&workspaces)
                .bind(&tids)
                .bind(&ids)
                .bind(&redrives)
                .bind(&stream_ids)
                .fetch_one(pool)
                .await?;
        settled.dispatched = marked as u64;
        settled.lost_lease += delivered.len() as u64 - settled.dispatched;
    }
    let mut workspaces: Vec<WorkspaceId> = failures.iter().map(|f| f.workspace).collect();
    workspaces.sort_by_key(|w| w.0);
    workspaces.dedup();
    for workspace in workspaces {
        let failed: Vec<&Failure> = failures.iter().filter(|f| f.workspace == workspace).collect();
        let s = record_failures(pool, workspace, me, &failed, max_attempts).await?;
        settled.retried += s.retried;
        settled.dead_lettered += s.dead_lettered;
        settled.lost_lease += s.lost_lease;
    }
    Ok(settled)
}

/// In one transaction of `workspace`: returns `failures` to `pending` with their back-off, or to `dead_letter` once
/// they reach `max_attempts`, failing their operation with a redacted reason; records each in `job_failures`.
async fn record_failures(
    pool: &PgPool,
    workspace: WorkspaceId,
    me: &str,
    failures: &[&Failure],
    max_attempts: i32,
) -> Result<Settled, sqlx::Error> {
    let mut settled = Settled::default();
    let mut tx = db::begin_workspace_then(pool, workspace, RELAXED_COMMIT).await?;
    let ids: Vec<Uuid> = failures.iter().map(|f| f.id).collect();
    let delays: Vec<f64> = failures.iter().map(|f| f.delay.as_secs_f64()).collect();
    let errors: Vec<&str> = failures.iter().map(|f| f.error.as_str()).collect();
    let redrives: Vec<i32> = failures.iter().map(|f| f.redrive).collect();
    // Operations first, in id order, as every transition locks them (a cancel of the same job locks its operation,
    // then the job): then the jobs.
    sqlx::query(
        "SELECT 1 FROM conveyor.operations
         WHERE id IN (SELECT operation_id FROM conveyor.outbox_events WHERE id = ANY($1))
         ORDER BY id FOR UPDATE",
    )
    .bind(&ids)
    .execute(&mut *tx)
    .await?;
    // Each failed hand-off is recorded in `job_failures` by the same statement.
    let rows: Vec<(String, Option<Uuid>)> = sqlx::query_as(
        "WITH moved AS (
             UPDATE conveyor.outbox_events e
             SET attempt_count = e.attempt_count + 1,
                 status = CASE WHEN e.attempt_count + 1 >= $4 THEN 'dead_letter' ELSE 'pending' END,
                 failure_stage = CASE WHEN e.attempt_count + 1 >= $4 THEN 'dispatch' END,
                 dead_lettered_at = CASE WHEN e.attempt_count + 1 >= $4 THEN now() END,
                 next_attempt_at = now() + make_interval(secs => v.delay),
                 last_error = v.error, locked_by = NULL, locked_until = NULL
             FROM unnest($1::uuid[], $2::float8[], $3::text[], $6::int[]) AS v(id, delay, error, redrive)
             WHERE e.id = v.id AND e.status = 'dispatching' AND e.locked_by = $5 AND e.redrive_count = v.redrive
             RETURNING e.id, e.workspace_id, e.attempt_count, e.last_error, e.status, e.operation_id),
         failed AS (
             INSERT INTO conveyor.job_failures (job_id, workspace_id, attempt, stage, error)
             SELECT id, workspace_id, attempt_count, 'dispatch', left(last_error, 2000) FROM moved)
         SELECT status, operation_id FROM moved",
    )
    .bind(&ids)
    .bind(&delays)
    .bind(&errors)
    .bind(max_attempts)
    .bind(me)
    .bind(&redrives)
    .fetch_all(&mut *tx)
    .await?;
    let dead_operations: Vec<Uuid> =
        rows.iter().filter(|(status, _)| status == "dead_letter").filter_map(|(_, op)| *op).collect();
    settled.dead_lettered = rows.iter().filter(|(status, _)| status == "dead_letter").count() as u64;
    settled.retried = rows.len() as u64 - settled.dead_lettered;
    settled.lost_lease += failures.len() as u64 - rows.len() as u64;
    if !dead_operations.is_empty() {
        sqlx::query(
            "UPDATE conveyor.operations SET status = 'failed', error = 'the job could not be handed to a worker',
                    finished_at = now(), updated_at = now()
             WHERE id = ANY($1) AND status IN ('queued', 'running')",
        )
        .bind(&dead_operations)
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(settled)
}

/// Deletes jobs that ended (completed, canceled) longer than `retention` ago, and the tombstones of dead letters
/// discarded that long ago (a `dispatched` job is live: handed to the workers, its end not yet recorded; dead letters
/// stay for operators), at most `batch` per statement and `max_batches` in all.
pub async fn purge_finished(
    pool: &PgPool,
    retention: Duration,
    batch: i64,
    max_batches: usize,
) -> Result<u64, sqlx::Error> {
    // Each statement names its states as literals, so that it is planned for its partial index (0006's finished
    // jobs; 0028's dead letters and tombstones).
    const PURGES: [&str; 2] = [
        "DELETE FROM conveyor.outbox_events WHERE id IN (
             SELECT id FROM conveyor.outbox_events
             WHERE status IN ('completed', 'canceled') AND finished_at <= now() - make_interval(secs => $1)
             LIMIT $2)",
        "DELETE FROM conveyor.outbox_events WHERE id IN (
             SELECT id FROM conveyor.outbox_events
             WHERE status = 'discarded' AND finished_at <= now() - make_interval(secs => $1)
             LIMIT $2)",
    ];
    let mut deleted = 0;
    let mut batches = 0;
    let retention_secs = retention.as_secs_f64();
    let workspaces: Vec<(Uuid,)> = sqlx::query_as(
        "SELECT workspace_id FROM conveyor.conveyor_outbox_retention_workspaces_v2(make_interval(secs => $1), 1000)",
    )
    .bind(retention_secs)
    .fetch_all(pool)
    .await?;
    for (workspace,) in workspaces {
        for purge in PURGES {
            loop {
                if batches >= max_batches {
                    return Ok(deleted);
                }
                let mut tx = db::begin_workspace(pool, WorkspaceId(workspace)).await?;
                let done = sqlx::query(purge).bind(retention_secs).bind(batch).execute(&mut *tx).await?.rows_affected();
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

#[cfg(test)]
mod tests;
