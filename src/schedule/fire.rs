//! Firing due ticks: what a dispatcher does once per sweep.

use chrono::{DateTime, Utc};
use futures_util::StreamExt;
use sqlx::PgPool;
use uuid::Uuid;

use super::ScheduleError;
use super::store::stored_spec;
use crate::db::begin_workspace;
use crate::ids::WorkspaceId;
use crate::outbox::NOTIFY_CHANNEL;

/// Schedules fired per pass at most; the rest stay due for the next pass, which comes at once.
const SCHEDULES_PER_PASS: i32 = 1000;

/// Schedules fired at once (each a transaction on a connection of its own).
const FIRE_CONCURRENCY: usize = 4;

/// How long the record of a fired tick is kept (the primary key guards ticks far younger than that).
const RUNS_KEPT_DAYS: i32 = 7;

/// A schedule whose stored spec no longer reads (a time zone a newer release dropped) is tried again this much later.
const UNREADABLE_RETRY: chrono::Duration = chrono::Duration::hours(1);

/// The earliest next tick, with a due schedule's workspace and id (both `NULL` when none is due).
#[derive(sqlx::FromRow)]
struct DueRow {
    next_at: Option<DateTime<Utc>>,
    workspace_id: Option<Uuid>,
    schedule_id: Option<Uuid>,
}

/// What one pass over the due schedules did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FireOutcome {
    /// Ticks fired (a job enqueued for each).
    pub fired: u64,
    /// The earliest next tick of any schedule that is not paused, as the pass left them.
    pub next_at: Option<DateTime<Utc>>,
}

/// Fires every due schedule of every workspace once (the most recent due tick of each), each in a transaction of
/// its own under row-level security in its workspace, skipping those another dispatcher is firing. Safe to run from
/// any number of processes at once: a tick fires once. A schedule that fails is logged and left due.
pub async fn fire_due(pool: &PgPool) -> Result<FireOutcome, sqlx::Error> {
    // One round trip when nothing is due (the common case, at every sweep): the next tick, and the due schedules.
    let due: Vec<DueRow> = sqlx::query_as(
        "SELECT n.next_at, d.workspace_id, d.schedule_id
         FROM (SELECT conveyor.conveyor_next_schedule_at() AS next_at) n
         LEFT JOIN conveyor.conveyor_due_schedules($1) d ON true",
    )
    .bind(SCHEDULES_PER_PASS)
    .fetch_all(pool)
    .await?;
    let mut outcome = FireOutcome { fired: 0, next_at: due.first().and_then(|row| row.next_at) };
    let due = due.into_iter().filter_map(|row| Some((WorkspaceId(row.workspace_id?), row.schedule_id?)));
    let mut firing = futures_util::stream::iter(due)
        .map(|(workspace, schedule)| async move { (workspace, schedule, fire_one(pool, workspace, schedule).await) })
        .buffer_unordered(FIRE_CONCURRENCY);
    while let Some((workspace, schedule, result)) = firing.next().await {
        match result {
            Ok(true) => outcome.fired += 1,
            Ok(false) => {}
            Err(e) => tracing::warn!(%workspace, %schedule, error = %e, "Could not fire a schedule"),
        }
    }
    if outcome.next_at.is_some_and(|at| at <= Utc::now()) {
        // Some were due: where they stand now.
        outcome.next_at = sqlx::query_scalar("SELECT conveyor.conveyor_next_schedule_at()").fetch_one(pool).await?;
    }
    Ok(outcome)
}

/// [`fire_due`] for the dispatcher's sweep: logs a failure, and answers when to sweep again for the next tick. A
/// tick that fell due during the pass is swept for 10 ms later; one that was due before the pass and is still
/// pending (another dispatcher holds it, a schedule keeps failing, more were due than a pass fires) is left to the
/// next poll, not spun on.
pub(crate) async fn fire_for_sweep(pool: &PgPool) -> Option<DateTime<Utc>> {
    let started = Utc::now();
    match fire_due(pool).await {
        Ok(outcome) => {
            if outcome.fired > 0 {
                tracing::debug!(fired = outcome.fired, "Schedules fired");
            }
            let soonest = Utc::now() + chrono::Duration::milliseconds(10);
            outcome.next_at.filter(|&at| at > started).map(|at| at.max(soonest))
        }
        Err(e) => {
            tracing::warn!(error = ?e, "Could not fire due schedules; trying again at the next sweep");
            None
        }
    }
}

/// The sooner of two optional times.
pub(crate) fn sooner(a: Option<DateTime<Utc>>, b: Option<DateTime<Utc>>) -> Option<DateTime<Utc>> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// A due schedule, locked for firing.
#[derive(sqlx::FromRow)]
struct Due {
    kind: String,
    queue: String,
    payload: serde_json::Value,
    cron: Option<String>,
    time_zone: Option<String>,
    every_ms: Option<i64>,
    priority: Option<i16>,
    max_attempts: Option<i32>,
    start_within_ms: Option<i64>,
    next_run_at: DateTime<Utc>,
    now: DateTime<Utc>,
}

/// Fires one schedule if it is still due and no one else holds it: the run row, the job and the advance of
/// `next_run_at`, in one transaction. True when it enqueued a job.
async fn fire_one(pool: &PgPool, workspace: WorkspaceId, schedule: Uuid) -> Result<bool, ScheduleError> {
    let mut tx = begin_workspace(pool, workspace).await?;
    // Under READ COMMITTED a row another dispatcher advanced and committed since this statement's snapshot is
    // checked again in its new version (no longer due); one it still holds is skipped.
    let found: Option<Due> = sqlx::query_as(
        "SELECT kind, queue, payload, cron, time_zone, every_ms, priority, max_attempts, start_within_ms, next_run_at,
                now() AS now
         FROM conveyor.job_schedules WHERE id = $1 AND NOT paused AND next_run_at <= now() FOR UPDATE SKIP LOCKED",
    )
    .bind(schedule)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(due) = found else {
        return Ok(false);
    };
    let now = due.now;
    let ticks = stored_spec(due.cron.as_deref(), due.time_zone.as_deref(), due.every_ms)
        .map(|spec| spec.catch_up(due.next_run_at, now));
    let Ok(Some((tick, next))) = ticks else {
        tracing::error!(%workspace, %schedule, "A schedule's stored spec no longer reads; trying again in an hour");
        sqlx::query("UPDATE conveyor.job_schedules SET next_run_at = $2, updated_at = now() WHERE id = $1")
            .bind(schedule)
            .bind(now + UNREADABLE_RETRY)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        return Ok(false);
    };
    // The run, the job and the advance in one statement: a tick already recorded enqueues nothing (the primary key),
    // and the schedule moves on either way.
    let job = Uuid::now_v7();
    let key = format!("schedule:{schedule}:{}", tick.timestamp_millis());
    let (recorded, enqueued): (bool, bool) = sqlx::query_as(
        "WITH run AS (
             INSERT INTO conveyor.job_schedule_runs (schedule_id, tick_at, workspace_id, job_id)
             VALUES ($1, $2, conveyor.conveyor_current_workspace(), $3)
             ON CONFLICT (schedule_id, tick_at) DO NOTHING
             RETURNING job_id),
         job AS (
             INSERT INTO conveyor.outbox_events (id, workspace_id, queue, event_type, event_payload, dedup_key, priority,
                                        max_attempts, expires_at)
             SELECT run.job_id, conveyor.conveyor_current_workspace(), $4, $5, $6, $7, coalesce($8, 1), $9,
                    $2 + make_interval(secs => $13::bigint / 1000.0)
             FROM run CROSS JOIN (SELECT pg_notify($10, conveyor.conveyor_current_workspace()::text)) AS notified
             ON CONFLICT (workspace_id, event_type, dedup_key)
                 WHERE dedup_key IS NOT NULL AND status IN ('pending', 'dispatching', 'dispatched')
                 DO NOTHING
             RETURNING id),
         advanced AS (
             UPDATE conveyor.job_schedules SET next_run_at = $11, last_tick_at = $2, updated_at = now() WHERE id = $1),
         pruned AS (
             DELETE FROM conveyor.job_schedule_runs WHERE schedule_id = $1 AND tick_at < $2 - make_interval(days => $12))
         SELECT EXISTS (SELECT 1 FROM run), EXISTS (SELECT 1 FROM job)",
    )
    .bind(schedule)
    .bind(tick)
    .bind(job)
    .bind(&due.queue)
    .bind(&due.kind)
    .bind(&due.payload)
    .bind(&key)
    .bind(due.priority)
    .bind(due.max_attempts)
    .bind(NOTIFY_CHANNEL)
    .bind(next)
    .bind(RUNS_KEPT_DAYS)
    .bind(due.start_within_ms)
    .fetch_one(&mut *tx)
    .await?;
    if recorded && !enqueued {
        // A live job holds the tick's de-duplication key already: the run records that job.
        sqlx::query(
            "UPDATE conveyor.job_schedule_runs r SET job_id = e.id FROM conveyor.outbox_events e
             WHERE r.schedule_id = $1 AND r.tick_at = $2
               AND e.event_type = $3 AND e.dedup_key = $4 AND e.status IN ('pending', 'dispatching', 'dispatched')",
        )
        .bind(schedule)
        .bind(tick)
        .bind(&due.kind)
        .bind(&key)
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(recorded)
}
