//! Every status change of a job (an outbox event) and of its operation after the enqueue, in one place: an operation
//! through `running` to its outcome, a job's completion, retries through the outbox, dead letters (each failed run
//! recorded in `job_failures`), replays, discards, re-drives, running a waiting job now and cancellation; the relay's
//! claim, mark, failed hand-offs and retention are in [`relay`]. Each function runs under row-level security in its
//! job's workspace. The fences, written once here:
//! - a job's run is current while its delivery's re-drive generation is the event's (`redrive_count`): a retry or a
//!   dead letter of an older generation changes nothing;
//! - an end state (completed, canceled, dead-lettered, discarded; an operation succeeded, failed or canceled) is never
//!   left: every update to one matches the live states only, so a cancellation that commits first wins over a run that
//!   ends later, and the run's transaction rolls back;
//! - a discarded dead letter keeps its row as a tombstone (`discarded`) until retention purges it, so that a delivery
//!   of it still in a stream finds the job ended rather than missing (a missing job reads as purged, and would run).

pub(crate) mod relay;
pub(crate) mod waiting;

use std::collections::HashMap;
use std::time::Duration;

use sqlx::PgPool;
use uuid::Uuid;

use super::{CANCEL_CHANNEL, DONE_CHANNEL, EVENTS_CHANNEL};
use crate::db::{self, WorkspaceTx};
use crate::ids::{JobId, WorkspaceId};

/// The statuses of a job that is still to run or running.
const LIVE: &str = "('pending', 'dispatching', 'dispatched')";

/// Locks the operation's row, if any, before its job's: every transaction that writes both takes the operation first
/// (the worker's commit, a cancellation, a retry, a dead letter), so none waits for another in a cycle.
async fn lock_operation_tx(tx: &mut WorkspaceTx, operation: Option<Uuid>) -> Result<(), sqlx::Error> {
    if let Some(operation) = operation {
        sqlx::query("SELECT 1 FROM conveyor.operations WHERE id = $1 FOR UPDATE")
            .bind(operation)
            .execute(&mut **tx)
            .await?;
    }
    Ok(())
}

/// Marks the operation `running` for attempt `attempt`. False when it has already finished (a repeat delivery).
pub(crate) async fn start(
    pool: &PgPool,
    workspace: WorkspaceId,
    operation: Uuid,
    attempt: u32,
) -> Result<bool, sqlx::Error> {
    let mut tx = db::begin_workspace(pool, workspace).await?;
    let started = sqlx::query(
        "UPDATE conveyor.operations
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
pub(crate) async fn keep_alive(pool: &PgPool, workspace: WorkspaceId, operation: Uuid) -> Result<(), sqlx::Error> {
    let mut tx = db::begin_workspace(pool, workspace).await?;
    sqlx::query("UPDATE conveyor.operations SET updated_at = now() WHERE id = $1 AND status = 'running'")
        .bind(operation)
        .execute(&mut *tx)
        .await?;
    tx.commit().await
}

/// Serializes runs of one job id: a duplicate delivery waits here until the first run's transaction ends.
pub(crate) async fn lock_job_tx(tx: &mut WorkspaceTx, event_id: Uuid) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('conveyor-job:' || $1::text, 0))")
        .bind(event_id)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Marks the operation `succeeded` with `result`, in the job's transaction. False when it is no longer live
/// (canceled meanwhile): the caller rolls back.
async fn succeed_tx(tx: &mut WorkspaceTx, operation: Uuid, result: &serde_json::Value) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(
        "UPDATE conveyor.operations SET status = 'succeeded', result = $2, error = NULL, progress = NULL,
                finished_at = now(), updated_at = now()
         WHERE id = $1 AND status IN ('queued', 'running')",
    )
    .bind(operation)
    .bind(result)
    .execute(&mut **tx)
    .await?
    .rows_affected();
    Ok(done == 1)
}

/// The run a delivery is ending: its job, the generation it was delivered as (`None`: whichever is current; where a
/// newer one was delivered since, a retry, throttle or dead letter of this run is not recorded) and the operation it
/// advances.
#[derive(Clone, Debug)]
pub(crate) struct Run {
    pub(crate) workspace: WorkspaceId,
    pub(crate) job: Uuid,
    pub(crate) redrive: Option<i32>,
    pub(crate) operation: Option<Uuid>,
    /// When its handler started (the worker's clock), and the consumer that ran it: recorded with its end.
    pub(crate) ran: Ran,
}

/// When a run's handler started (the worker's clock; `None` for one that never started) and the worker's consumer
/// that ran it, recorded with the run's end (`run_started_at`, `run_by`: migration 0068).
#[derive(Clone, Debug, Default)]
pub(crate) struct Ran {
    pub(crate) started_at: Option<chrono::DateTime<chrono::Utc>>,
    pub(crate) by: Option<std::sync::Arc<str>>,
}

/// How a run ended, as the worker hands it to [`end_run`].
pub(crate) enum End<'a> {
    /// The handler succeeded: recorded in the job's transaction, with the handler's writes and the operation's
    /// result (the caller commits on [`Completion::Recorded`], else rolls back).
    Succeeded { tx: &'a mut WorkspaceTx, result: &'a serde_json::Value },
    /// Its operation had already ended: the job ends `canceled`, in `tx` (the caller commits).
    Orphaned { tx: &'a mut WorkspaceTx },
    /// It failed and runs again after `delay`: an attempt spent.
    Retry { delay: Duration, error: &'a str },
    /// Its key is rate limited until `until`: it waits, no attempt spent.
    Throttled { until: chrono::DateTime<chrono::Utc>, reason: &'a str },
    /// It failed for good: dead-lettered, its operation failed.
    DeadLettered { error: &'a str },
}

/// What [`end_run`] recorded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Completion {
    /// Recorded.
    Recorded,
    /// The job was canceled meanwhile: the caller rolls back.
    Canceled,
    /// It already ended otherwise (another delivery completed it, or it was dead-lettered, or discarded), or a newer
    /// generation was delivered since: this run's end is not recorded, the caller rolls back.
    Stale,
    /// The job is no longer in the outbox: only an ended job is deleted (by retention, a clean, an obliterate), so it
    /// ended otherwise while this run went on; nothing to record, the caller rolls back.
    Gone,
    /// Its operation is no longer live (canceled after the run began): the caller rolls back and ends the job as
    /// [`End::Orphaned`].
    OperationEnded,
}

/// The completion funnel: every end of a run the worker records goes through here (the batched successes of jobs
/// without a transaction of their own through [`complete_many`], its batched form). Each end is fenced by the job's
/// live states, so a run that lost its job (canceled, ended by another delivery) records nothing; a retry, throttle or
/// dead letter is fenced by the run's generation too (a newer delivery decides), while a success of any generation
/// ends a live job (its writes are the job's effect) and an orphan's end needs only the job live.
pub(crate) async fn end_run(pool: &PgPool, run: Run, end: End<'_>) -> Result<Completion, sqlx::Error> {
    let recorded = |done: bool| if done { Completion::Recorded } else { Completion::Stale };
    let Run { workspace, job, redrive, operation, ran } = run;
    Ok(match end {
        End::Succeeded { tx, result } => {
            if let Some(operation) = operation
                && !succeed_tx(tx, operation, result).await?
            {
                return Ok(Completion::OperationEnded);
            }
            complete_tx(tx, workspace, job, Some(result), &ran).await?
        }
        End::Orphaned { tx } => recorded(end_orphan_tx(tx, workspace, job).await?),
        End::Retry { delay, error } => {
            recorded(retry(pool, workspace, job, redrive, operation, delay, error, &ran).await?)
        }
        End::Throttled { until, reason } => {
            recorded(throttle(pool, workspace, job, redrive, operation, until, reason).await?)
        }
        End::DeadLettered { error } => {
            recorded(dead_letter(pool, workspace, job, redrive, operation, error, &ran).await?)
        }
    })
}

/// Records the job `completed` with `result` in its own transaction (with the handler's writes), fenced by the live
/// states (a successful run of any generation ends a live job; a newer generation's delivery is then skipped), and
/// announces it to waiters at commit. A job that ends before the relay recorded its hand-off takes this transaction's
/// start as its hand-off time (it was handed out no later), as every end a worker records does.
async fn complete_tx(
    tx: &mut WorkspaceTx,
    workspace: WorkspaceId,
    job: Uuid,
    result: Option<&serde_json::Value>,
    ran: &Ran,
) -> Result<Completion, sqlx::Error> {
    let done = sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE conveyor.outbox_events
         SET status = 'completed', finished_at = clock_timestamp(), result = $2, locked_by = NULL, locked_until = NULL,
             dispatched_at = coalesce(dispatched_at, now()), run_started_at = $3, run_by = left($4, 200)
         WHERE id = $1 AND status IN {LIVE}"
    )))
    .bind(job)
    .bind(result)
    .bind(ran.started_at)
    .bind(ran.by.as_deref())
    .execute(&mut **tx)
    .await?
    .rows_affected();
    if done == 1 {
        notify_done_tx(tx, workspace).await?;
        return Ok(Completion::Recorded);
    }
    let status: Option<(String,)> = sqlx::query_as("SELECT status FROM conveyor.outbox_events WHERE id = $1")
        .bind(job)
        .fetch_optional(&mut **tx)
        .await?;
    Ok(match status {
        None => Completion::Gone,
        Some((s,)) if s == "canceled" => Completion::Canceled,
        Some(_) => Completion::Stale,
    })
}

/// A job that ran without a transaction of its own, finished: recorded in batches by [`complete_many`].
#[derive(Clone, Debug)]
pub(crate) struct Finished {
    /// Its workspace.
    pub workspace: WorkspaceId,
    /// The job.
    pub job: Uuid,
    /// The generation that ran (`None`: whichever is current).
    pub redrive: Option<i32>,
    /// The handler's result.
    pub result: serde_json::Value,
    /// When its handler started (the worker's clock).
    pub started_at: chrono::DateTime<chrono::Utc>,
}

/// Records many jobs `completed` in one call (each workspace's statement under row-level security for it), skipping
/// those canceled, dead-lettered or moved to a newer generation meanwhile; announces them to waiters. Each with its
/// start and the `consumer` that ran it. Returns how many it recorded.
pub(crate) async fn complete_many(pool: &PgPool, finished: &[Finished], consumer: &str) -> Result<u64, sqlx::Error> {
    if finished.is_empty() {
        return Ok(0);
    }
    let workspaces: Vec<Uuid> = finished.iter().map(|f| f.workspace.0).collect();
    let ids: Vec<Uuid> = finished.iter().map(|f| f.job).collect();
    let redrives: Vec<Option<i32>> = finished.iter().map(|f| f.redrive).collect();
    let results: Vec<&serde_json::Value> = finished.iter().map(|f| &f.result).collect();
    let started: Vec<chrono::DateTime<chrono::Utc>> = finished.iter().map(|f| f.started_at).collect();
    let (done,): (i64,) = sqlx::query_as("SELECT conveyor.conveyor_complete_jobs_v2($1, $2, $3, $4, $5, $6)")
        .bind(&workspaces)
        .bind(&ids)
        .bind(&redrives)
        .bind(&results)
        .bind(&started)
        .bind(consumer)
        .fetch_one(pool)
        .await?;
    Ok(done as u64)
}

/// Why a delivered job does not run as it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Skip {
    /// Ended (canceled, completed, dead-lettered), gone, or moved to a newer generation (whose own delivery decides).
    NotToRun,
    /// Live and past its deadline: to expire ([`expire_job_tx`]) instead of running.
    Expired,
}

/// Of the delivered jobs (workspace, id, the delivery's generation), those that must not run, and those past their
/// deadline (migration 0064). One round trip for a whole read.
pub(crate) async fn to_skip(
    pool: &PgPool,
    jobs: &[(WorkspaceId, Uuid, Option<i32>)],
) -> Result<HashMap<Uuid, Skip>, sqlx::Error> {
    if jobs.is_empty() {
        return Ok(HashMap::new());
    }
    let workspaces: Vec<Uuid> = jobs.iter().map(|(w, _, _)| w.0).collect();
    let ids: Vec<Uuid> = jobs.iter().map(|(_, id, _)| *id).collect();
    let redrives: Vec<Option<i32>> = jobs.iter().map(|(_, _, r)| *r).collect();
    let rows: Vec<(Uuid, bool)> = sqlx::query_as("SELECT id, expired FROM conveyor.conveyor_jobs_to_skip($1, $2, $3)")
        .bind(&workspaces)
        .bind(&ids)
        .bind(&redrives)
        .fetch_all(pool)
        .await?;
    Ok(rows.into_iter().map(|(id, expired)| (id, if expired { Skip::Expired } else { Skip::NotToRun })).collect())
}

/// For `jobs`, entries taken over from a worker that stopped while it held them (migration 0036): by job id, the
/// runs of it that stopped their worker so far (as counted by [`count_stop`]), or `None` for a job that must not run
/// (ended, re-driven since, or gone).
pub(crate) async fn taken_over(
    pool: &PgPool,
    jobs: &[(WorkspaceId, Uuid, Option<i32>)],
) -> Result<HashMap<Uuid, Option<u32>>, sqlx::Error> {
    if jobs.is_empty() {
        return Ok(HashMap::new());
    }
    let workspaces: Vec<Uuid> = jobs.iter().map(|(w, _, _)| w.0).collect();
    let ids: Vec<Uuid> = jobs.iter().map(|(_, id, _)| *id).collect();
    let redrives: Vec<Option<i32>> = jobs.iter().map(|(_, _, r)| *r).collect();
    let rows: Vec<(Uuid, Option<i32>)> =
        sqlx::query_as("SELECT id, stops FROM conveyor.conveyor_jobs_taken_over($1, $2, $3)")
            .bind(&workspaces)
            .bind(&ids)
            .bind(&redrives)
            .fetch_all(pool)
            .await?;
    Ok(rows.into_iter().map(|(id, stops)| (id, stops.map(|s| s.max(0) as u32))).collect())
}

/// Counts a stop of the job as a delivery taken over from a stopped worker starts it: the delivery before it started
/// and never ended (run `attempt`: a `stalled` event, announced where a subscription listens, `announce`). The stops so
/// far, this one included; `None` when the job must not run (ended, re-driven since the entry was written, or gone).
pub(crate) async fn count_stop(
    pool: &PgPool,
    workspace: WorkspaceId,
    job: Uuid,
    redrive: Option<i32>,
    attempt: u32,
    announce: bool,
) -> Result<Option<u32>, sqlx::Error> {
    let mut tx = db::begin_workspace(pool, workspace).await?;
    // The stop is a `stalled` event of the run that stopped, recorded by the same statement.
    let stops: Option<i32> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "WITH counted AS (
             UPDATE conveyor.outbox_events SET stops = stops + 1
             WHERE id = $1 AND status IN {LIVE} AND NOT ($2::integer IS NOT NULL AND redrive_count > $2)
             RETURNING id, workspace_id, stops),
         stalled AS (
             INSERT INTO conveyor.job_events (workspace_id, job_id, event, attempt)
             SELECT workspace_id, id, 'stalled', $3 FROM counted)
         SELECT stops FROM counted"
    )))
    .bind(job)
    .bind(redrive)
    .bind(i32::try_from(attempt.max(1)).unwrap_or(i32::MAX))
    .fetch_optional(&mut *tx)
    .await?;
    if stops.is_some() && announce {
        announce_event_tx(&mut tx, workspace).await?;
    }
    tx.commit().await?;
    Ok(stops.map(|s| s.max(0) as u32))
}

/// The most lines one job's log keeps, and the most bytes (migration 0046).
pub(crate) const LOG_LINES: i64 = 100;
pub(crate) const LOG_BYTES: i64 = 64 * 1024;

/// Appends `line` (redacted already) to the log of `job`, written by its run `attempt`, in a transaction of its own.
/// False when the job's log is full (its lines or bytes): the line is dropped.
pub(crate) async fn append_log(
    pool: &PgPool,
    workspace: WorkspaceId,
    job: Uuid,
    attempt: u32,
    line: &str,
) -> Result<bool, sqlx::Error> {
    let mut tx = db::begin_workspace(pool, workspace).await?;
    // One line of a job at a time (two deliveries, or joined futures, may log at once): each numbers the line after
    // the job's last, unless the log is full.
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('conveyor-log:' || $1::text, 0))")
        .bind(job)
        .execute(&mut *tx)
        .await?;
    let kept = sqlx::query(
        "INSERT INTO conveyor.job_logs (job_id, workspace_id, seq, attempt, line)
         SELECT $1, $2, coalesce(max(l.seq), 0) + 1, $3, $4 FROM conveyor.job_logs l WHERE l.job_id = $1
         HAVING count(*) < $5 AND coalesce(sum(octet_length(l.line)), 0) + octet_length($4) <= $6
         ON CONFLICT (job_id, seq) DO NOTHING",
    )
    .bind(job)
    .bind(workspace.0)
    .bind(i32::try_from(attempt).unwrap_or(i32::MAX))
    .bind(line)
    .bind(LOG_LINES)
    .bind(LOG_BYTES)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    tx.commit().await?;
    Ok(kept == 1)
}

/// Records `progress` of a running job, run `attempt`: on its operation when it has one, else on the job, and as a
/// `progress` event (`job_events`) by the same statement; announced when a subscription listens (`announce`). False
/// when the job is no longer live (canceled): the handler should stop.
pub(crate) async fn progress(
    pool: &PgPool,
    workspace: WorkspaceId,
    job: Uuid,
    operation: Option<Uuid>,
    attempt: u32,
    progress: &serde_json::Value,
    announce: bool,
) -> Result<bool, sqlx::Error> {
    let mut tx = db::begin_workspace(pool, workspace).await?;
    let noted = match operation {
        Some(_) => "UPDATE conveyor.operations SET progress = $2, updated_at = now()
                    WHERE id = $5 AND status IN ('queued', 'running')"
            .to_owned(),
        None => format!("UPDATE conveyor.outbox_events SET progress = $2 WHERE id = $1 AND status IN {LIVE}"),
    };
    let live = sqlx::query(sqlx::AssertSqlSafe(format!(
        "WITH noted AS ({noted} RETURNING 1)
         INSERT INTO conveyor.job_events (workspace_id, job_id, event, attempt, progress)
         SELECT $3, $1, 'progress', $4, $2 FROM noted"
    )))
    .bind(job)
    .bind(progress)
    .bind(workspace.0)
    .bind(i32::try_from(attempt).unwrap_or(i32::MAX))
    .bind(operation)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    if live == 1 && announce {
        announce_event_tx(&mut tx, workspace).await?;
    }
    tx.commit().await?;
    Ok(live == 1)
}

/// At commit: tells the subscriptions of `workspace` that one of its jobs has a new event.
async fn announce_event_tx(tx: &mut WorkspaceTx, workspace: WorkspaceId) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_notify($1, $2)")
        .bind(EVENTS_CHANNEL)
        .bind(workspace.0.to_string())
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Records that run `attempt` of `job` started (an `active` event), in a statement of its own, and announces it: for
/// a workspace where a subscription wants it. One round trip: the workspace, the row and the notification in one
/// implicit transaction.
pub(crate) async fn record_active(
    pool: &PgPool,
    workspace: WorkspaceId,
    job: Uuid,
    attempt: u32,
) -> Result<(), sqlx::Error> {
    // Typed values only (UUIDs, an integer, a constant channel): nothing to quote.
    let statement = format!(
        "SELECT set_config('app.workspace_id', '{ws}', true);
         INSERT INTO conveyor.job_events (workspace_id, job_id, event, attempt) VALUES ('{ws}', '{job}', 'active', {attempt});
         SELECT pg_notify('{EVENTS_CHANNEL}', '{ws}')",
        ws = workspace.0,
        attempt = attempt.clamp(1, i32::MAX as u32),
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(statement)).execute(pool).await?;
    Ok(())
}

/// How a cancellation ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Cancel {
    /// Canceled now: the job will not run (or, running, is told to stop), and its operation is `canceled`.
    Canceled,
    /// It had already ended with this status (`completed`, `canceled`, `dead_letter`; for an operation `succeeded`,
    /// `failed`, `canceled`).
    Finished(String),
    /// No such job (or operation) in the workspace.
    NotFound,
}

/// Cancels the job `job` and its operation, if live, in the caller's transaction; at commit the worker running it (if
/// any) is told, and waiters learn that it ended.
pub(crate) async fn cancel_job_tx(
    tx: &mut WorkspaceTx,
    workspace: WorkspaceId,
    job: JobId,
) -> Result<Cancel, sqlx::Error> {
    let row: Option<(Option<Uuid>, String, i32)> =
        sqlx::query_as("SELECT operation_id, status, children_left FROM conveyor.outbox_events WHERE id = $1")
            .bind(job.0)
            .fetch_optional(&mut **tx)
            .await?;
    let Some((operation, status, children_left)) = row else { return Ok(Cancel::NotFound) };
    if status == "discarded" {
        // A discarded dead letter is gone to everyone but the worker's fence.
        return Ok(Cancel::NotFound);
    }
    if !matches!(status.as_str(), "pending" | "dispatching" | "dispatched") {
        return Ok(Cancel::Finished(status));
    }
    if children_left > 0 {
        lock_descendants_tx(tx, &[job.0]).await?;
    }
    // A job of a live operation is canceled with its operation and every other live job of it (none may advance it
    // any more); the operation's row is locked first, as every transition does.
    if let Some(operation) = operation
        && cancel_operation_tx(tx, workspace, operation).await? == Cancel::Canceled
    {
        return Ok(Cancel::Canceled);
    }
    // No operation, or one that has already ended: the job alone.
    let canceled = sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE conveyor.outbox_events
         SET status = 'canceled', finished_at = clock_timestamp(), locked_by = NULL, locked_until = NULL
         WHERE id = $1 AND status IN {LIVE}"
    )))
    .bind(job.0)
    .execute(&mut **tx)
    .await?
    .rows_affected();
    if canceled == 0 {
        let status: String = sqlx::query_scalar("SELECT status FROM conveyor.outbox_events WHERE id = $1")
            .bind(job.0)
            .fetch_one(&mut **tx)
            .await?;
        return Ok(Cancel::Finished(status));
    }
    announce_cancel_tx(tx, workspace, &[job.0]).await?;
    Ok(Cancel::Canceled)
}

/// The last error of a job canceled because it was not started by its deadline, and its operation's error.
pub(crate) const EXPIRED: &str = "expired: not started by its deadline";

/// The same, for a job whose worker stopped while it held it (it may have started), and whose deadline passed before
/// another worker took it over: it is not started again.
pub(crate) const EXPIRED_ON_TAKE_OVER: &str =
    "expired: its worker stopped, and its deadline passed before another took it";

#[cfg(test)]
mod expiry_texts {
    #[test]
    fn the_queue_minutes_recorder_counts_each_expirys_text_and_the_sql_enqueue_writes_the_first() {
        // SQL of the migrations that name them: a change of either text here must be made there too.
        let recorder = include_str!("../../../migrations/0073_expiries_in_queue_minutes.sql");
        let enqueue = include_str!("../../../migrations/0071_sql_enqueue_expires_holders.sql");
        for text in [super::EXPIRED, super::EXPIRED_ON_TAKE_OVER] {
            assert!(recorder.contains(&format!("'{text}'")), "the recorder counts `{text}`");
        }
        assert!(enqueue.contains(&format!("'{}'", super::EXPIRED)), "the SQL enqueue expires with `EXPIRED`");
    }
}

/// Cancels the job `job` because it expired: live and past its deadline (`expires_at`) by PostgreSQL's clock, which
/// the worker that took it from its stream, maintenance or an enqueue that found it holding a de-dup key saw. As a
/// cancellation does, with `reason` ([`EXPIRED`], [`EXPIRED_ON_TAKE_OVER`]) as its last error: its operation is
/// canceled (with that error) with every other live job of it, and the workers running any of them hear it. A job
/// handed to the workers keeps its hand-off time, as every end does. False, and nothing changes, when the job is not
/// there, has ended, is not past a deadline, or (with `waiting_only`, for whoever does not hold its delivery:
/// maintenance, an enqueue) is no longer waiting in the outbox: a job handed to the workers may be running, and only
/// the worker that takes it from its stream knows it has not started.
pub(crate) async fn expire_job_tx(
    tx: &mut WorkspaceTx,
    workspace: WorkspaceId,
    job: Uuid,
    reason: &str,
    waiting_only: bool,
) -> Result<bool, sqlx::Error> {
    let statuses = if waiting_only { "('pending')" } else { LIVE };
    let found: Option<(Option<Uuid>, i32)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT operation_id, children_left FROM conveyor.outbox_events
         WHERE id = $1 AND status IN {statuses} AND expires_at <= now()"
    )))
    .bind(job)
    .fetch_optional(&mut **tx)
    .await?;
    let Some((operation, children_left)) = found else { return Ok(false) };
    // The locks a cancellation takes, in its order: the descendants, the operation, then the job.
    if children_left > 0 {
        lock_descendants_tx(tx, &[job]).await?;
    }
    lock_operation_tx(tx, operation).await?;
    let expired = sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE conveyor.outbox_events
         SET status = 'canceled', last_error = $2, finished_at = clock_timestamp(), locked_by = NULL,
             locked_until = NULL,
             dispatched_at = CASE WHEN status = 'pending' THEN dispatched_at ELSE coalesce(dispatched_at, now()) END
         WHERE id = $1 AND status IN {statuses} AND expires_at <= now()"
    )))
    .bind(job)
    .bind(reason)
    .execute(&mut **tx)
    .await?
    .rows_affected();
    if expired == 0 {
        return Ok(false);
    }
    let mut canceled = vec![job];
    if let Some(operation) = operation {
        // The operation can no longer be advanced by it: canceled, with every other live job of it.
        if cancel_operation_row_tx(tx, operation, Some(reason)).await? {
            canceled.extend(cancel_operation_jobs_tx(tx, operation).await?);
        }
    }
    announce_cancel_tx(tx, workspace, &canceled).await?;
    Ok(true)
}

/// [`expire_job_tx`] in a transaction of its own.
pub(crate) async fn expire_job(
    pool: &PgPool,
    workspace: WorkspaceId,
    job: Uuid,
    reason: &str,
    waiting_only: bool,
) -> Result<bool, sqlx::Error> {
    let mut tx = db::begin_workspace(pool, workspace).await?;
    let expired = expire_job_tx(&mut tx, workspace, job, reason, waiting_only).await?;
    tx.commit().await?;
    Ok(expired)
}

/// Jobs waiting in the outbox past their deadline (pending: not handed to the workers), expired, the most overdue
/// workspaces first, at most `limit` in all, each in a transaction of its own: how many, and the first error. A
/// workspace that fails is passed over, so that it holds up no other. The workspaces come from the `SECURITY DEFINER`
/// `conveyor_expiring_workspaces` (ids only); each job is read and expired in its workspace under row-level security,
/// only while it still waits (one handed to the workers meanwhile is the worker's to expire).
pub(crate) async fn expire_waiting(pool: &PgPool, limit: i64) -> (u64, Result<(), sqlx::Error>) {
    let workspaces: Vec<Uuid> =
        match sqlx::query_scalar("SELECT workspace_id FROM conveyor.conveyor_expiring_workspaces(1000)")
            .fetch_all(pool)
            .await
        {
            Ok(workspaces) => workspaces,
            Err(e) => return (0, Err(e)),
        };
    let (mut expired, mut first_error) = (0u64, None);
    for workspace in workspaces.into_iter().map(WorkspaceId) {
        let left = limit - i64::try_from(expired).unwrap_or(i64::MAX);
        if left <= 0 {
            break;
        }
        let done = async {
            let mut tx = db::begin_workspace(pool, workspace).await?;
            let jobs: Vec<Uuid> = sqlx::query_scalar(
                "SELECT id FROM conveyor.outbox_events
                 WHERE status = 'pending' AND expires_at <= now() AND workspace_id = $1
                 ORDER BY expires_at LIMIT $2",
            )
            .bind(workspace.0)
            .bind(left)
            .fetch_all(&mut *tx)
            .await?;
            tx.commit().await?;
            for job in jobs {
                expired += u64::from(expire_job(pool, workspace, job, EXPIRED, true).await?);
            }
            Ok::<_, sqlx::Error>(())
        }
        .await;
        if let Err(e) = done {
            first_error.get_or_insert(e);
        }
    }
    (expired, first_error.map_or(Ok(()), Err))
}

/// Locks what the cancellation of `parents` will reach: a parent of a flow canceled while it waits cancels its live
/// children, and theirs (migration 0056), each of which locks its parent when it ends. A child's end locks its
/// operation, the child, then its parent; locked here first in that order (the live descendants' operations, then the
/// descendants, each in id order), before the parents, a child ending meanwhile and this cancellation wait for each
/// other in turn, never in a circle.
pub(crate) async fn lock_descendants_tx(tx: &mut WorkspaceTx, parents: &[Uuid]) -> Result<(), sqlx::Error> {
    let descendants = format!(
        "WITH RECURSIVE d AS (
             SELECT e.id, e.operation_id FROM conveyor.outbox_events e WHERE e.parent_id = ANY($1) AND e.status IN {LIVE}
             UNION
             SELECT e.id, e.operation_id FROM conveyor.outbox_events e JOIN d ON e.parent_id = d.id
             WHERE e.status IN {LIVE})"
    );
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "{descendants}
         SELECT 1 FROM conveyor.operations o WHERE o.id IN (SELECT d.operation_id FROM d) ORDER BY o.id FOR UPDATE"
    )))
    .bind(parents)
    .execute(&mut **tx)
    .await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "{descendants}
         SELECT 1 FROM conveyor.outbox_events e WHERE e.id IN (SELECT d.id FROM d) ORDER BY e.id FOR UPDATE"
    )))
    .bind(parents)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Ends, as `canceled`, a live job whose operation has already ended: it can no longer advance it (its operation was
/// canceled, or finished by another delivery). Announced to waiters at commit. False when the job was not live.
async fn end_orphan_tx(tx: &mut WorkspaceTx, workspace: WorkspaceId, job: Uuid) -> Result<bool, sqlx::Error> {
    let ended = sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE conveyor.outbox_events
         SET status = 'canceled', finished_at = clock_timestamp(), locked_by = NULL, locked_until = NULL,
             last_error = 'its operation had already ended', dispatched_at = coalesce(dispatched_at, now())
         WHERE id = $1 AND status IN {LIVE}"
    )))
    .bind(job)
    .execute(&mut **tx)
    .await?
    .rows_affected();
    if ended == 1 {
        notify_done_tx(tx, workspace).await?;
    }
    Ok(ended == 1)
}

/// Where a job and its operation stand, read once the job's lock is held: a delivery that waited for another one's
/// run learns here that it has nothing left to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct JobState {
    /// The job's end is not recorded (a job no longer in the outbox, purged by retention, has no end to protect; a
    /// discarded one keeps a tombstone, and is not live).
    pub(crate) live: bool,
    /// The job was canceled (its end is the cancel's): a delivery that finds it so ends as canceled.
    pub(crate) canceled: bool,
    /// It advances an operation that has ended (or no longer exists): a run would repeat finished work.
    pub(crate) operation_ended: bool,
}

/// Reads [`JobState`] of `job` and of `operation`, the operation its delivery names, in one statement.
pub(crate) async fn job_state_tx(
    tx: &mut WorkspaceTx,
    job: Uuid,
    operation: Option<Uuid>,
) -> Result<JobState, sqlx::Error> {
    let (job, operation): (Option<String>, Option<String>) = sqlx::query_as(
        "SELECT (SELECT status FROM conveyor.outbox_events WHERE id = $1), (SELECT status FROM conveyor.operations WHERE id = $2)",
    )
    .bind(job)
    .bind(operation)
    .fetch_one(&mut **tx)
    .await?;
    Ok(JobState {
        live: job.as_deref().is_none_or(|s| matches!(s, "pending" | "dispatching" | "dispatched")),
        canceled: job.as_deref() == Some("canceled"),
        operation_ended: operation.is_none_or(|s| matches!(s.as_str(), "succeeded" | "failed" | "canceled")),
    })
}

/// Cancels the operation `operation` and every live job that advances it, in the caller's transaction.
pub async fn cancel_operation_tx(
    tx: &mut WorkspaceTx,
    workspace: WorkspaceId,
    operation: Uuid,
) -> Result<Cancel, sqlx::Error> {
    if !cancel_operation_row_tx(tx, operation, None).await? {
        let status: Option<(String,)> = sqlx::query_as("SELECT status FROM conveyor.operations WHERE id = $1")
            .bind(operation)
            .fetch_optional(&mut **tx)
            .await?;
        return Ok(status.map_or(Cancel::NotFound, |(s,)| Cancel::Finished(s)));
    }
    let jobs = cancel_operation_jobs_tx(tx, operation).await?;
    announce_cancel_tx(tx, workspace, &jobs).await?;
    Ok(Cancel::Canceled)
}

/// Cancels the live jobs of `operation` (whose row the caller canceled); their ids.
async fn cancel_operation_jobs_tx(tx: &mut WorkspaceTx, operation: Uuid) -> Result<Vec<Uuid>, sqlx::Error> {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "UPDATE conveyor.outbox_events
         SET status = 'canceled', finished_at = clock_timestamp(), locked_by = NULL, locked_until = NULL
         WHERE operation_id = $1 AND status IN {LIVE}
         RETURNING id"
    )))
    .bind(operation)
    .fetch_all(&mut **tx)
    .await
}

/// Cancels `operation` if it is live, with `error` (none for a cancellation); whether it did.
async fn cancel_operation_row_tx(
    tx: &mut WorkspaceTx,
    operation: Uuid,
    error: Option<&str>,
) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(
        "UPDATE conveyor.operations SET status = 'canceled', error = $2, finished_at = clock_timestamp(), updated_at = now()
         WHERE id = $1 AND status IN ('queued', 'running')",
    )
    .bind(operation)
    .bind(error)
    .execute(&mut **tx)
    .await?
    .rows_affected();
    Ok(done == 1)
}

/// At commit: tells workers that `jobs` were canceled, and waiters of `workspace` that jobs ended.
async fn announce_cancel_tx(tx: &mut WorkspaceTx, workspace: WorkspaceId, jobs: &[Uuid]) -> Result<(), sqlx::Error> {
    let ids: Vec<String> = jobs.iter().map(Uuid::to_string).collect();
    sqlx::query("SELECT pg_notify($1, id) FROM unnest($2::text[]) AS id")
        .bind(CANCEL_CHANNEL)
        .bind(&ids)
        .execute(&mut **tx)
        .await?;
    notify_done_tx(tx, workspace).await
}

/// At commit: tells waiters of `workspace` that some of its jobs ended.
pub(crate) async fn notify_done_tx(tx: &mut WorkspaceTx, workspace: WorkspaceId) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_notify($1, $2)").bind(DONE_CHANNEL).bind(workspace.0.to_string()).execute(&mut **tx).await?;
    Ok(())
}

/// Schedules another run after `delay`: the outbox event goes back to `pending` with a new re-drive generation
/// (so its next hand-off gets past the de-dup key), and the operation back to `queued` with the redacted error.
///
/// Fenced by the delivery's generation (`redrive`), not by the event's status: the dispatcher records a hand-off after
/// its `XADD`, so a job that fails fast can find its event still `dispatching` (or, if its dispatcher died, `pending`
/// again). Any live status with the same generation means this delivery is the current one; a lease still
/// held on it is simply lost (its holder's mark no longer matches, and its `XADD` found the old de-dup key). False,
/// and nothing changes, when the generation has moved on (another delivery is already under way). `redrive` is
/// `None` for an entry that carries no generation: it is taken for the current one. The failed run is recorded in
/// `job_failures` (attempt, redacted error) in the same transaction.
#[allow(clippy::too_many_arguments)]
async fn retry(
    pool: &PgPool,
    workspace: WorkspaceId,
    event_id: Uuid,
    redrive: Option<i32>,
    operation: Option<Uuid>,
    delay: Duration,
    error: &str,
    ran: &Ran,
) -> Result<bool, sqlx::Error> {
    let mut tx = db::begin_workspace(pool, workspace).await?;
    lock_operation_tx(&mut tx, operation).await?;
    // The failed run is recorded in `job_failures`, and as a `retrying` event, by the same statement.
    let moved = sqlx::query(
        "WITH moved AS (
             UPDATE conveyor.outbox_events
             SET status = 'pending', next_attempt_at = now() + make_interval(secs => $2),
                 job_attempts = job_attempts + 1, redrive_count = redrive_count + 1, last_error = $3, stops = 0,
                 stream_id = NULL, dispatched_at = NULL, locked_by = NULL, locked_until = NULL,
                 run_started_at = $5, run_by = left($6, 200)
             WHERE id = $1 AND redrive_count = coalesce($4, redrive_count)
               AND status IN ('pending', 'dispatching', 'dispatched')
             RETURNING id, workspace_id, job_attempts, run_started_at, run_by),
         failed AS (
             INSERT INTO conveyor.job_failures (job_id, workspace_id, attempt, stage, error, run_started_at, run_by)
             SELECT id, workspace_id, job_attempts, 'job', left($3, 2000), run_started_at, run_by FROM moved)
         INSERT INTO conveyor.job_events (workspace_id, job_id, event, attempt, error)
         SELECT workspace_id, id, 'retrying', job_attempts, left($3, 2000) FROM moved",
    )
    .bind(event_id)
    .bind(delay.as_secs_f64())
    .bind(error)
    .bind(redrive)
    .bind(ran.started_at)
    .bind(ran.by.as_deref())
    .execute(&mut *tx)
    .await?
    .rows_affected();
    if moved == 1 {
        // Wakes the dispatchers when the retry is due, not at their next sweep.
        let due = chrono::Utc::now() + chrono::Duration::from_std(delay).unwrap_or_default();
        // Its subscriptions too, in the same statement: this transaction notifies already, so one more costs nothing
        // at commit.
        sqlx::query("SELECT pg_notify($1, $2), pg_notify($3, $4)")
            .bind(super::NOTIFY_CHANNEL)
            .bind(format!("{}@{}", workspace.0, due.timestamp_millis()))
            .bind(EVENTS_CHANNEL)
            .bind(workspace.0.to_string())
            .execute(&mut *tx)
            .await?;
    }
    if let Some(operation) = operation.filter(|_| moved == 1) {
        sqlx::query(
            "UPDATE conveyor.operations SET status = 'queued', error = $2, updated_at = now()
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

/// Puts a job whose key is rate limited (the handler answered `JobError::RateLimited`) back to `pending`, due at
/// `until`, **without spending an attempt** (`job_attempts` unchanged), with a new re-drive generation like [`retry`];
/// blocks its key (if it has one) until the later of its block and `until`, so that the claim hands out none of the
/// key's jobs before then; and puts the operation back to `queued`. Fenced by the delivery's generation exactly like
/// [`retry`]: false, and nothing changes, when the generation has moved on.
async fn throttle(
    pool: &PgPool,
    workspace: WorkspaceId,
    event_id: Uuid,
    redrive: Option<i32>,
    operation: Option<Uuid>,
    until: chrono::DateTime<chrono::Utc>,
    reason: &str,
) -> Result<bool, sqlx::Error> {
    let mut tx = db::begin_workspace(pool, workspace).await?;
    lock_operation_tx(&mut tx, operation).await?;
    let moved: Option<(Option<String>, chrono::DateTime<chrono::Utc>)> = sqlx::query_as(
        "UPDATE conveyor.outbox_events
         SET status = 'pending', next_attempt_at = greatest($2, now()), redrive_count = redrive_count + 1,
             last_error = $3, stops = 0, stream_id = NULL, dispatched_at = NULL, locked_by = NULL, locked_until = NULL
         WHERE id = $1 AND redrive_count = coalesce($4, redrive_count)
           AND status IN ('pending', 'dispatching', 'dispatched')
         RETURNING limit_key, next_attempt_at",
    )
    .bind(event_id)
    .bind(until)
    .bind(reason)
    .bind(redrive)
    .fetch_optional(&mut *tx)
    .await?;
    let Some((key, due)) = moved else {
        tx.rollback().await?;
        return Ok(false);
    };
    if let Some(key) = key {
        sqlx::query(
            "INSERT INTO conveyor.job_key_limits (workspace_id, key, blocked_until, block_reason)
             VALUES (conveyor.conveyor_current_workspace(), $1, $2, $3)
             ON CONFLICT (workspace_id, key) DO UPDATE
                 SET blocked_until = greatest(job_key_limits.blocked_until, EXCLUDED.blocked_until),
                     block_reason = EXCLUDED.block_reason, updated_at = now()",
        )
        .bind(&key)
        .bind(due)
        .bind(reason.get(..reason.floor_char_boundary(500)).unwrap_or_default())
        .execute(&mut *tx)
        .await?;
    }
    // Wakes the dispatchers when the job (and its key) is due again, not at their next sweep.
    sqlx::query("SELECT pg_notify($1, $2)")
        .bind(super::NOTIFY_CHANNEL)
        .bind(format!("{}@{}", workspace.0, due.timestamp_millis()))
        .execute(&mut *tx)
        .await?;
    if let Some(operation) = operation {
        sqlx::query(
            "UPDATE conveyor.operations SET status = 'queued', error = $2, updated_at = now()
             WHERE id = $1 AND status IN ('queued', 'running')",
        )
        .bind(operation)
        .bind(reason)
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(true)
}

/// Dead-letters the job: the outbox event keeps the redacted reason, the operation fails with it. Fenced by the
/// delivery's generation, like [`retry`]: false, and nothing changes, when a newer delivery exists or the event is
/// already dead-lettered. An event no longer in the outbox (purged) has no generation to protect: its operation
/// fails. The failed run is recorded in `job_failures` in the same transaction.
async fn dead_letter(
    pool: &PgPool,
    workspace: WorkspaceId,
    event_id: Uuid,
    redrive: Option<i32>,
    operation: Option<Uuid>,
    error: &str,
    ran: &Ran,
) -> Result<bool, sqlx::Error> {
    let mut tx = db::begin_workspace(pool, workspace).await?;
    lock_operation_tx(&mut tx, operation).await?;
    // The failed run is recorded in `job_failures` by the same statement.
    let moved = sqlx::query(
        "WITH moved AS (
             UPDATE conveyor.outbox_events
             SET status = 'dead_letter', failure_stage = 'job', dead_lettered_at = now(), last_error = $2,
                 job_attempts = job_attempts + 1, locked_by = NULL, locked_until = NULL,
                 dispatched_at = coalesce(dispatched_at, now()), run_started_at = $4, run_by = left($5, 200)
             WHERE id = $1 AND redrive_count = coalesce($3, redrive_count)
               AND status IN ('pending', 'dispatching', 'dispatched')
             RETURNING id, workspace_id, job_attempts, run_started_at, run_by)
         INSERT INTO conveyor.job_failures (job_id, workspace_id, attempt, stage, error, run_started_at, run_by)
         SELECT id, workspace_id, job_attempts, 'job', left($2, 2000), run_started_at, run_by FROM moved",
    )
    .bind(event_id)
    .bind(error)
    .bind(redrive)
    .bind(ran.started_at)
    .bind(ran.by.as_deref())
    .execute(&mut *tx)
    .await?
    .rows_affected();
    // An event already purged (its entry outlived the outbox's retention) still fails its operation.
    let gone = moved == 0
        && sqlx::query_scalar::<_, bool>("SELECT NOT EXISTS (SELECT 1 FROM conveyor.outbox_events WHERE id = $1)")
            .bind(event_id)
            .fetch_one(&mut *tx)
            .await?;
    if moved == 1 || gone {
        notify_done_tx(&mut tx, workspace).await?;
    }
    if let Some(operation) = operation.filter(|_| moved == 1 || gone) {
        sqlx::query(
            "UPDATE conveyor.operations SET status = 'failed', error = $2, finished_at = now(), updated_at = now()
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

/// How a replay of a dead letter went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Replay {
    /// Sent through the outbox again.
    Replayed,
    /// It is not a dead letter (any more).
    NotDeadLetter,
    /// Its de-dup key is held by this live job meanwhile: replaying would make two.
    KeyHeld(Uuid),
}

/// Sends a dead-lettered job through the outbox again, from its first attempt (a new generation), and re-queues its
/// operation; not while another live job holds its de-dup key.
pub(crate) async fn replay_tx(
    tx: &mut WorkspaceTx,
    workspace: WorkspaceId,
    job: Uuid,
    operation: Option<Uuid>,
) -> Result<Replay, sqlx::Error> {
    let holder: Option<Uuid> = sqlx::query_scalar(
        "SELECT live.id FROM conveyor.outbox_events dead
         JOIN conveyor.outbox_events live ON live.workspace_id = dead.workspace_id
                                         AND live.event_type = dead.event_type AND live.dedup_key = dead.dedup_key
         WHERE dead.id = $1 AND live.status IN ('pending', 'dispatching', 'dispatched')",
    )
    .bind(job)
    .fetch_optional(&mut **tx)
    .await?;
    if let Some(holder) = holder {
        return Ok(Replay::KeyHeld(holder));
    }
    let moved = sqlx::query(
        // A parent of a flow failed by a child (migration 0056) waits again for its children still live, if any.
        // Its row is locked by this statement, so a child ending meanwhile counts it down after this commits.
        "WITH live AS (SELECT count(*)::integer AS n FROM conveyor.outbox_events c
                       WHERE c.parent_id = $1 AND c.status IN ('pending', 'dispatching', 'dispatched'))
         UPDATE conveyor.outbox_events
         SET status = 'pending',
             next_attempt_at = CASE WHEN live.n > 0 THEN '9999-12-31 00:00:00+00'::timestamptz ELSE now() END,
             children_left = live.n, attempt_count = 0, job_attempts = 0, stops = 0,
             redrive_count = redrive_count + 1, last_error = NULL, failure_stage = NULL, dead_lettered_at = NULL,
             stream_id = NULL, dispatched_at = NULL, locked_by = NULL, locked_until = NULL
         FROM live
         WHERE id = $1 AND status = 'dead_letter'",
    )
    .bind(job)
    .execute(&mut **tx)
    .await?
    .rows_affected();
    if let Some(operation) = operation.filter(|_| moved == 1) {
        sqlx::query(
            "UPDATE conveyor.operations SET status = 'queued', error = NULL, result = NULL, finished_at = NULL, updated_at = now()
             WHERE id = $1",
        )
        .bind(operation)
        .execute(&mut **tx)
        .await?;
    }
    super::notify_tx(tx, workspace).await?;
    Ok(if moved == 1 { Replay::Replayed } else { Replay::NotDeadLetter })
}

/// Discards, in the caller's transaction, those of `jobs` that are dead letters: each becomes a tombstone (status
/// `discarded`, ended now, its payload, progress, result and error cleared, its recorded failures and log deleted) that
/// retention purges like a completed job; until then a delivery of it still in a stream is skipped, as for any ended
/// job. Their operations stay failed. Returns the ids discarded.
pub(crate) async fn discard_tx(tx: &mut WorkspaceTx, jobs: &[Uuid]) -> Result<Vec<Uuid>, sqlx::Error> {
    let gone: Vec<(Uuid,)> = sqlx::query_as(
        "WITH discarded AS (
             UPDATE conveyor.outbox_events
             SET status = 'discarded', finished_at = clock_timestamp(), event_payload = '{}', progress = NULL,
                 result = NULL, last_error = NULL, locked_by = NULL, locked_until = NULL
             WHERE id = ANY($1) AND status = 'dead_letter'
             RETURNING id),
         forgotten AS (DELETE FROM conveyor.job_failures WHERE job_id IN (SELECT id FROM discarded)),
         unlogged AS (DELETE FROM conveyor.job_logs WHERE job_id IN (SELECT id FROM discarded))
         SELECT id FROM discarded",
    )
    .bind(jobs)
    .fetch_all(&mut **tx)
    .await?;
    Ok(gone.into_iter().map(|(id,)| id).collect())
}

/// What running a waiting job now did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum RunNow {
    /// It is due now; the dispatchers are told at commit.
    Moved,
    /// It is not waiting (due already, handed over, or ended): nothing changed.
    NotWaiting,
    /// Nothing changed: making it due would not run it, because this holds it back until it ends (a pause naming its
    /// queue, kind or workspace, or a block of its limit key after a rate limit).
    Held(String),
}

/// Makes a job that waits (delayed, or a retry waiting out its back-off) due now, in the caller's transaction, and
/// wakes the dispatchers at commit. Refused ([`RunNow::Held`]) when a pause or its key's rate-limit block holds the
/// job: the relay would not hand it over before that ends, so "now" would be untrue (a concurrency limit of its key
/// or kind is not a refusal: it runs as soon as a slot frees, ahead of jobs due later).
pub(crate) async fn run_now_tx(tx: &mut WorkspaceTx, workspace: WorkspaceId, job: Uuid) -> Result<RunNow, sqlx::Error> {
    let waiting: Option<(String, String, Option<String>)> = sqlx::query_as(
        "SELECT queue, event_type, limit_key FROM conveyor.outbox_events
         WHERE id = $1 AND status = 'pending' AND next_attempt_at > now() AND children_left = 0
         FOR UPDATE",
    )
    .bind(job)
    .fetch_optional(&mut **tx)
    .await?;
    let Some((queue, kind, key)) = waiting else { return Ok(RunNow::NotWaiting) };
    if let Some(held) = hold_of(tx, workspace, &queue, &kind, key.as_deref()).await? {
        return Ok(RunNow::Held(held));
    }
    sqlx::query("UPDATE conveyor.outbox_events SET next_attempt_at = now() WHERE id = $1")
        .bind(job)
        .execute(&mut **tx)
        .await?;
    super::notify_tx(tx, workspace).await?;
    Ok(RunNow::Moved)
}

/// What holds a job of `queue`, `kind` and limit `key` back from the relay whatever its due time, said for an operator:
/// a pause of its workspace, queue or kind (the claim's rule, 0021), or a block of its key until a time to come.
async fn hold_of(
    tx: &mut WorkspaceTx,
    workspace: WorkspaceId,
    queue: &str,
    kind: &str,
    key: Option<&str>,
) -> Result<Option<String>, sqlx::Error> {
    let pause: Option<(Option<String>, Option<String>, Option<Uuid>)> = sqlx::query_as(
        "SELECT queue, kind, workspace_id FROM conveyor.dispatch_pauses
         WHERE (workspace_id IS NULL OR workspace_id = $1)
           AND ((queue IS NULL AND kind IS NULL) OR (kind IS NULL AND queue = $2) OR kind = $3)
         ORDER BY id LIMIT 1",
    )
    .bind(workspace.0)
    .bind(queue)
    .bind(kind)
    .fetch_optional(&mut **tx)
    .await?;
    if let Some((q, k, w)) = pause {
        let scope: Vec<String> =
            [q.map(|q| format!("queue {q}")), k.map(|k| format!("kind {k}")), w.map(|w| format!("workspace {w}"))]
                .into_iter()
                .flatten()
                .collect();
        return Ok(Some(format!("a pause of {} holds it until it is resumed", scope.join(", "))));
    }
    let Some(key) = key else { return Ok(None) };
    let blocked: Option<(chrono::DateTime<chrono::Utc>,)> = sqlx::query_as(
        "SELECT blocked_until FROM conveyor.job_key_limits
             WHERE workspace_id = conveyor.conveyor_current_workspace() AND key = $1 AND blocked_until > now()",
    )
    .bind(key)
    .fetch_optional(&mut **tx)
    .await?;
    Ok(blocked.map(|(until,)| format!("its limit key {key} is blocked until {} (rate limited)", until.to_rfc3339())))
}

/// Re-drives, in the caller's transaction, the dispatched jobs of the operations of the workspace that made no
/// progress for `stalled_for` (at most `limit` operations): each gets a new generation, which gets it past the de-dup
/// key of its earlier hand-off, and the dispatchers are told at commit. Returns how many jobs moved.
pub(crate) async fn redrive_stalled_tx(
    tx: &mut WorkspaceTx,
    workspace: WorkspaceId,
    stalled_for: Duration,
    limit: i64,
) -> Result<u64, sqlx::Error> {
    let secs = stalled_for.as_secs_f64();
    let stalled: Vec<(Uuid,)> = sqlx::query_as(
        "UPDATE conveyor.operations SET updated_at = now()
         WHERE id IN (SELECT id FROM conveyor.operations
                      WHERE status IN ('queued', 'running') AND updated_at <= now() - make_interval(secs => $1)
                      ORDER BY updated_at LIMIT $2 FOR UPDATE SKIP LOCKED)
         RETURNING id",
    )
    .bind(secs)
    .bind(limit)
    .fetch_all(&mut **tx)
    .await?;
    let ids: Vec<Uuid> = stalled.into_iter().map(|(id,)| id).collect();
    let moved = sqlx::query(
        "UPDATE conveyor.outbox_events
         SET status = 'pending', next_attempt_at = now(), redrive_count = redrive_count + 1,
             stream_id = NULL, dispatched_at = NULL
         WHERE operation_id = ANY($1) AND status = 'dispatched'",
    )
    .bind(&ids)
    .execute(&mut **tx)
    .await?
    .rows_affected();
    if moved > 0 {
        super::notify_tx(tx, workspace).await?;
    }
    Ok(moved)
}

/// Sends a `dispatched` event through the outbox again (new re-drive generation) after Redis lost its entry
/// `stream_id`: fenced by that entry, so a job handed off again meanwhile (another entry) is left alone.
pub(crate) async fn redrive_tx(
    tx: &mut WorkspaceTx,
    workspace: WorkspaceId,
    event_id: Uuid,
    stream_id: &str,
) -> Result<bool, sqlx::Error> {
    let moved = sqlx::query(
        "UPDATE conveyor.outbox_events
         SET status = 'pending', next_attempt_at = now(), redrive_count = redrive_count + 1,
             stream_id = NULL, dispatched_at = NULL
         WHERE id = $1 AND status = 'dispatched' AND stream_id = $2",
    )
    .bind(event_id)
    .bind(stream_id)
    .execute(&mut **tx)
    .await?
    .rows_affected();
    crate::outbox::notify_tx(tx, workspace).await?;
    Ok(moved == 1)
}

/// The event behind a stream entry id of `queue`, found across workspaces (ids only).
pub(crate) async fn event_by_stream_id(
    pool: &PgPool,
    queue: &str,
    entry_id: &str,
) -> Result<Option<(Uuid, WorkspaceId)>, sqlx::Error> {
    let row: Option<(Uuid, Uuid)> =
        sqlx::query_as("SELECT id, workspace_id FROM conveyor.conveyor_event_by_stream_id($1, $2)")
            .bind(queue)
            .bind(entry_id)
            .fetch_optional(pool)
            .await?;
    Ok(row.map(|(id, ws)| (id, WorkspaceId(ws))))
}
