//! Setting, listing, pausing and removing schedules, under row-level security.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;
use uuid::Uuid;

use super::{ScheduleError, ScheduleSpec, valid_schedule_name};
use crate::db::{WorkspaceTx, begin_workspace};
use crate::ids::WorkspaceId;
use crate::kind::{self, JobKind, Priority};
use crate::outbox::NOTIFY_CHANNEL;

/// How a schedule's jobs run, and whether it is paused. Unset options take the kind's defaults.
///
/// ```
/// use conveyor_jobs::{Priority, ScheduleOptions};
///
/// let options = ScheduleOptions::new().priority(Priority::Low).max_attempts(3);
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ScheduleOptions {
    priority: Option<Priority>,
    max_attempts: Option<u32>,
    paused: bool,
    start_within: Option<Duration>,
}

impl ScheduleOptions {
    /// No options: normal priority, the kind's attempts, not paused.
    pub fn new() -> Self {
        Self::default()
    }

    /// The priority of every job it enqueues.
    pub fn priority(mut self, priority: Priority) -> Self {
        self.priority = Some(priority);
        self
    }

    /// Runs before each of its jobs is dead-lettered (1 to 1,000), instead of the kind's default.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = Some(attempts);
        self
    }

    /// Each job it enqueues must start within `within` of its tick (1 ms to ten years), or it is canceled as expired,
    /// as [`crate::EnqueueOptions::start_within`] does for one job: a report that is worthless an hour late. A tick
    /// fired later than that (no dispatcher ran meanwhile) still enqueues its job, which expires instead of running.
    pub fn start_within(mut self, within: Duration) -> Self {
        self.start_within = Some(within);
        self
    }

    /// Set it paused: it fires nothing until [`resume_schedule`].
    pub fn paused(mut self, paused: bool) -> Self {
        self.paused = paused;
        self
    }
}

/// The longest deadline a schedule's jobs take (as [`crate::EnqueueOptions::start_within`]'s).
const TEN_YEARS: Duration = Duration::from_secs(10 * 365 * 86_400);

/// A schedule as stored: what [`list_schedules`] and [`upsert_schedule_tx`] answer.
#[derive(Clone, Debug, PartialEq, Serialize, sqlx::FromRow)]
pub struct Schedule {
    /// Its id (a UUIDv7).
    pub id: Uuid,
    /// Its name, unique in its workspace.
    pub name: String,
    /// The kind of the jobs it enqueues.
    pub kind: String,
    /// Their queue.
    pub queue: String,
    /// Their payload.
    pub payload: serde_json::Value,
    /// The cron expression, for a cron schedule.
    pub cron: Option<String>,
    /// The time zone the cron expression is read in, for a cron schedule.
    pub time_zone: Option<String>,
    /// The period in milliseconds, for an every-N schedule.
    pub every_ms: Option<i64>,
    /// The priority of its jobs (0 high, 1 normal, 2 low); `None`: normal.
    pub priority: Option<i16>,
    /// Runs of each of its jobs before dead-lettering; `None`: the kind's default.
    pub max_attempts: Option<i32>,
    /// How long after its tick each of its jobs may start, in milliseconds ([`ScheduleOptions::start_within`]).
    pub start_within_ms: Option<i64>,
    /// Paused: fires nothing.
    pub paused: bool,
    /// The next tick it fires for.
    pub next_run_at: DateTime<Utc>,
    /// The tick it fired last.
    pub last_tick_at: Option<DateTime<Utc>>,
    /// When it was first set.
    pub created_at: DateTime<Utc>,
    /// When it was last set, paused, resumed or fired.
    pub updated_at: DateTime<Utc>,
}

const COLUMNS: &str = "id, name, kind, queue, payload, cron, time_zone, every_ms, priority, max_attempts, \
                       start_within_ms, paused, next_run_at, last_tick_at, created_at, updated_at";

/// The spec of a stored schedule.
pub(crate) fn stored_spec(
    cron: Option<&str>,
    time_zone: Option<&str>,
    every_ms: Option<i64>,
) -> Result<ScheduleSpec, ScheduleError> {
    match (cron, time_zone, every_ms) {
        (Some(expression), Some(zone), _) => ScheduleSpec::cron(expression, zone),
        (_, _, Some(ms)) => ScheduleSpec::every(Duration::from_millis(u64::try_from(ms).unwrap_or(0))),
        _ => Err(ScheduleError::BadJob("the stored schedule has no spec".to_owned())),
    }
}

fn no_workspace(e: sqlx::Error) -> ScheduleError {
    // The row takes the transaction's workspace: row-level security refusing it (42501), or the NOT NULL of
    // workspace_id (23502), means the transaction never set one.
    match &e {
        sqlx::Error::Database(d) if matches!(d.code().as_deref(), Some("23502" | "42501")) => {
            ScheduleError::NoWorkspace
        }
        _ => ScheduleError::Database(e),
    }
}

/// Sets the schedule `name` of the transaction's workspace (creates it, or replaces what it enqueues and when): on
/// every tick of `spec`, a job of kind `K` with `payload` and `options`. It commits or rolls back with the caller's
/// transaction, and tells the dispatchers at commit when its first tick is.
///
/// Replacing a schedule keeps its next tick when neither the spec nor the paused flag changed; otherwise the next
/// tick is the first after now (no catch-up). Nothing is written when the name is invalid, the kind's name or queue
/// is invalid, or the payload does not serialize.
///
/// ```no_run
/// # use conveyor_jobs::{JobKind, ScheduleOptions, ScheduleSpec, WorkspaceId};
/// # #[derive(serde::Serialize, serde::Deserialize)] struct SendDigest { list_id: uuid::Uuid }
/// # impl JobKind for SendDigest { const KIND: &'static str = "mail.digest"; const QUEUE: &'static str = "emails"; }
/// # async fn f(pool: sqlx::PgPool, ws: WorkspaceId, list_id: uuid::Uuid) -> Result<(), Box<dyn std::error::Error>> {
/// let mut tx = conveyor_jobs::begin_workspace(&pool, ws).await?;
/// let spec = ScheduleSpec::cron("0 8 * * MON", "Europe/Paris")?;
/// conveyor_jobs::upsert_schedule_tx(&mut tx, "weekly-digest", &SendDigest { list_id }, spec, ScheduleOptions::new())
///     .await?;
/// tx.commit().await?;
/// # Ok(()) }
/// ```
pub async fn upsert_schedule_tx<K: JobKind>(
    tx: &mut WorkspaceTx,
    name: &str,
    payload: &K,
    spec: ScheduleSpec,
    options: ScheduleOptions,
) -> Result<Schedule, ScheduleError> {
    let payload = serde_json::to_value(payload)?;
    upsert_schedule_raw_tx(tx, name, K::KIND, K::QUEUE, payload, &spec, options).await
}

/// [`upsert_schedule_tx`] for a kind known by name only (the `conveyor schedule set` command): the caller vouches
/// that `queue` is the kind's.
#[doc(hidden)]
pub async fn upsert_schedule_raw_tx(
    tx: &mut WorkspaceTx,
    name: &str,
    kind_name: &str,
    queue: &str,
    payload: serde_json::Value,
    spec: &ScheduleSpec,
    options: ScheduleOptions,
) -> Result<Schedule, ScheduleError> {
    if !valid_schedule_name(name) {
        return Err(ScheduleError::BadName(name.to_owned()));
    }
    if !kind::valid_kind_name(kind_name) {
        return Err(ScheduleError::BadJob(format!("`{kind_name}` is not a valid kind name")));
    }
    if !kind::valid_queue_name(queue) {
        return Err(ScheduleError::BadJob(format!("`{queue}` is not a valid queue name")));
    }
    if options.max_attempts.is_some_and(|a| !(1..=1000).contains(&a)) {
        return Err(ScheduleError::BadJob("max_attempts must be between 1 and 1000".to_owned()));
    }
    if options.start_within.is_some_and(|d| d < Duration::from_millis(1) || d > TEN_YEARS) {
        return Err(ScheduleError::BadJob("start_within must be at least 1 ms and at most ten years".to_owned()));
    }
    let now: DateTime<Utc> = sqlx::query_scalar("SELECT now()").fetch_one(&mut **tx).await?;
    let next =
        spec.next_after(now).ok_or_else(|| ScheduleError::BadJob("the schedule has no tick after now".to_owned()))?;
    let (cron, zone) = spec.cron_expression().unzip();
    let every_ms = spec.period().map(|p| i64::try_from(p.as_millis()).unwrap_or(i64::MAX));
    let schedule: Schedule = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "INSERT INTO conveyor.job_schedules AS s (id, workspace_id, name, kind, queue, payload, cron, time_zone, every_ms,
                                         priority, max_attempts, paused, next_run_at, start_within_ms)
         VALUES ($1, conveyor.conveyor_current_workspace(), $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)
         ON CONFLICT (workspace_id, name) DO UPDATE SET
             kind = EXCLUDED.kind, queue = EXCLUDED.queue, payload = EXCLUDED.payload, cron = EXCLUDED.cron,
             time_zone = EXCLUDED.time_zone, every_ms = EXCLUDED.every_ms, priority = EXCLUDED.priority,
             max_attempts = EXCLUDED.max_attempts, paused = EXCLUDED.paused, updated_at = now(),
             start_within_ms = EXCLUDED.start_within_ms,
             next_run_at = CASE WHEN s.cron IS NOT DISTINCT FROM EXCLUDED.cron
                                 AND s.time_zone IS NOT DISTINCT FROM EXCLUDED.time_zone
                                 AND s.every_ms IS NOT DISTINCT FROM EXCLUDED.every_ms
                                 AND s.paused = EXCLUDED.paused
                                THEN s.next_run_at ELSE EXCLUDED.next_run_at END
         RETURNING {COLUMNS}"
    )))
    .bind(Uuid::now_v7())
    .bind(name)
    .bind(kind_name)
    .bind(queue)
    .bind(&payload)
    .bind(cron)
    .bind(zone)
    .bind(every_ms)
    .bind(options.priority.map(Priority::level))
    .bind(options.max_attempts.map(|a| a as i32))
    .bind(options.paused)
    .bind(next)
    .bind(options.start_within.map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX)))
    .fetch_one(&mut **tx)
    .await
    .map_err(no_workspace)?;
    if !schedule.paused {
        notify_next_tick(tx, schedule.next_run_at).await?;
    }
    Ok(schedule)
}

/// Tells the dispatchers, at commit, when a schedule of the transaction's workspace ticks next (the outbox channel's
/// `<workspace>@<ms>` form), so that they wake for it.
pub(crate) async fn notify_next_tick(tx: &mut WorkspaceTx, at: DateTime<Utc>) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_notify($1, conveyor.conveyor_current_workspace()::text || $2)")
        .bind(NOTIFY_CHANNEL)
        .bind(format!("@{}", at.timestamp_millis()))
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// The schedules of `workspace`, by name. Another workspace's are invisible (row-level security).
pub async fn list_schedules(pool: &PgPool, workspace: WorkspaceId) -> Result<Vec<Schedule>, ScheduleError> {
    let mut tx = begin_workspace(pool, workspace).await?;
    let schedules =
        sqlx::query_as(sqlx::AssertSqlSafe(format!("SELECT {COLUMNS} FROM conveyor.job_schedules ORDER BY name")))
            .fetch_all(&mut *tx)
            .await?;
    tx.commit().await?;
    Ok(schedules)
}

/// Removes the schedule `name` of the transaction's workspace, with its record of fired ticks (the jobs it enqueued
/// stay). False when the workspace has none of that name.
pub async fn remove_schedule_tx(tx: &mut WorkspaceTx, name: &str) -> Result<bool, ScheduleError> {
    let removed =
        sqlx::query("DELETE FROM conveyor.job_schedules WHERE name = $1").bind(name).execute(&mut **tx).await?;
    Ok(removed.rows_affected() > 0)
}

/// Pauses the schedule `name` of `workspace`: it fires nothing until resumed. False when there is none of that name.
pub async fn pause_schedule(pool: &PgPool, workspace: WorkspaceId, name: &str) -> Result<bool, ScheduleError> {
    let mut tx = begin_workspace(pool, workspace).await?;
    let paused = sqlx::query("UPDATE conveyor.job_schedules SET paused = true, updated_at = now() WHERE name = $1")
        .bind(name)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(paused.rows_affected() > 0)
}

/// Resumes the schedule `name` of `workspace` from its first tick after now: the ticks it missed while paused are
/// not fired. A schedule that is not paused is left as it is. False when there is none of that name.
pub async fn resume_schedule(pool: &PgPool, workspace: WorkspaceId, name: &str) -> Result<bool, ScheduleError> {
    let mut tx = begin_workspace(pool, workspace).await?;
    let found: Option<Schedule> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM conveyor.job_schedules WHERE name = $1 FOR UPDATE"
    )))
    .bind(name)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(schedule) = found else {
        return Ok(false);
    };
    if schedule.paused {
        let now: DateTime<Utc> = sqlx::query_scalar("SELECT now()").fetch_one(&mut *tx).await?;
        let spec = stored_spec(schedule.cron.as_deref(), schedule.time_zone.as_deref(), schedule.every_ms)?;
        let next = spec
            .next_after(now)
            .ok_or_else(|| ScheduleError::BadJob("the schedule has no tick after now".to_owned()))?;
        sqlx::query(
            "UPDATE conveyor.job_schedules SET paused = false, next_run_at = $2, updated_at = now() WHERE id = $1",
        )
        .bind(schedule.id)
        .bind(next)
        .execute(&mut *tx)
        .await?;
        notify_next_tick(&mut tx, next).await?;
    }
    tx.commit().await?;
    Ok(true)
}

/// The queue of the kind `kind_name` as workers registered it (`job_kinds`); `None` when no worker has.
#[doc(hidden)]
pub async fn registered_queue(pool: &PgPool, kind_name: &str) -> Result<Option<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT queue FROM conveyor.job_kinds WHERE kind = $1")
        .bind(kind_name)
        .fetch_optional(pool)
        .await
}
