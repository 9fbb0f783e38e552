//! Job events, across processes: a subscription reads what happened to a workspace's jobs from PostgreSQL (BullMQ's
//! `QueueEvents`, for one tenant). Ends (completed, failed, canceled) are read from the jobs themselves; a start
//! (`active`), a progress, a failed run that will run again (`retrying`) and a run whose worker stopped (`stalled`) from
//! `job_events` (migration 0066), written by the statement that records each, so that a job's events commit in the
//! order they happened.

use std::collections::{HashSet, VecDeque};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;
use sqlx::postgres::PgListener;
use uuid::Uuid;

use super::control::{COLUMNS, JobInfo, Row};
use super::{DONE_CHANNEL, EVENTS_CHANNEL};
use crate::db;
use crate::ids::{JobId, WorkspaceId};

/// What happened to a job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobEventType {
    /// A worker started its handler (a run). Recorded only while a subscription that wants it is open in the job's
    /// workspace: see [`subscribe_events`].
    Active,
    /// Its handler reported progress ([`crate::JobContext::progress`]).
    Progress,
    /// A run failed, and the job will run again after its back-off.
    Retrying,
    /// The worker running it stopped (killed, out of memory), and another worker took it over.
    Stalled,
    /// It succeeded.
    Completed,
    /// It failed for good (dead-lettered).
    Failed,
    /// It was canceled (or expired, or its parent's flow canceled it).
    Canceled,
}

impl JobEventType {
    /// Every event, in the order of a job's life.
    pub const ALL: [JobEventType; 7] =
        [Self::Active, Self::Progress, Self::Retrying, Self::Stalled, Self::Completed, Self::Failed, Self::Canceled];

    /// The ends: what [`subscribe`] hears.
    pub const ENDS: [JobEventType; 3] = [Self::Completed, Self::Failed, Self::Canceled];

    /// Its name, as JSON writes it (`retrying`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Active => "active",
            Self::Progress => "progress",
            Self::Retrying => "retrying",
            Self::Stalled => "stalled",
            Self::Completed => "completed",
            Self::Failed => "failed",
            Self::Canceled => "canceled",
        }
    }

    /// The event named `name` ([`JobEventType::as_str`]), if any.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|e| e.as_str() == name)
    }

    /// Whether it ends the job.
    pub fn is_end(self) -> bool {
        Self::ENDS.contains(&self)
    }
}

/// One event of a job ([`JobEvents::next`]).
#[derive(Clone, Debug, Serialize)]
pub struct JobEvent {
    /// What happened.
    pub event: JobEventType,
    /// When (PostgreSQL's clock).
    pub at: DateTime<Utc>,
    /// The run it happened in (1 = the first); for an end, the last run that started (1 when none did: a job canceled
    /// or dead-lettered by the relay before any run).
    pub attempt: u32,
    /// For [`JobEventType::Progress`], the value reported.
    pub progress: Option<serde_json::Value>,
    /// For [`JobEventType::Retrying`], the run's error, redacted.
    pub error: Option<String>,
    /// The job as it was when the event was read: an `active` event read late may find it ended already. An end's
    /// result and last error are here.
    pub job: JobInfo,
}

/// Which events a subscription reads ([`subscribe_events`]): by default every event of every job of the workspace,
/// from the moment it is made.
#[derive(Clone, Debug, Default)]
pub struct EventFilter {
    events: Option<Vec<JobEventType>>,
    kinds: Vec<String>,
    queues: Vec<String>,
    job: Option<JobId>,
    since: Option<DateTime<Utc>>,
}

impl EventFilter {
    /// Every event of every job.
    pub fn all() -> Self {
        Self::default()
    }

    /// Only these events.
    pub fn events(mut self, events: impl IntoIterator<Item = JobEventType>) -> Self {
        self.events = Some(events.into_iter().collect());
        self
    }

    /// Only jobs of this kind ([`crate::JobKind::KIND`]); may be given more than once.
    pub fn kind(mut self, kind: impl Into<String>) -> Self {
        self.kinds.push(kind.into());
        self
    }

    /// Only jobs of this queue; may be given more than once.
    pub fn queue(mut self, queue: impl Into<String>) -> Self {
        self.queues.push(queue.into());
        self
    }

    /// Only this job.
    pub fn job(mut self, id: JobId) -> Self {
        self.job = Some(id);
        self
    }

    /// From `at` rather than from the moment the subscription is made: a subscriber that stopped resumes from the
    /// time of the last event it handled (events are delivered again from there: at least once). Events other than
    /// ends are kept an hour; ends as long as their jobs are.
    pub fn since(mut self, at: DateTime<Utc>) -> Self {
        self.since = Some(at);
        self
    }

    /// What it selects, for the operator's audit trail.
    pub(crate) fn describe(&self) -> serde_json::Value {
        serde_json::json!({
            "events": self.events.as_ref().map(|e| e.iter().map(|e| e.as_str()).collect::<Vec<_>>()),
            "kinds": (!self.kinds.is_empty()).then_some(&self.kinds),
            "queues": (!self.queues.is_empty()).then_some(&self.queues),
            "job": self.job.map(|j| j.0),
            "since": self.since,
        })
    }

    fn wants(&self, event: JobEventType) -> bool {
        self.events.as_ref().is_none_or(|e| e.contains(&event))
    }

    fn names(&self) -> Vec<&'static str> {
        JobEventType::ALL.into_iter().filter(|&e| self.wants(e)).map(JobEventType::as_str).collect()
    }
}

/// How far back each look of a subscription reads again: an event is recorded with the time of its statement and
/// becomes visible at its commit, which follows within moments; one committed later than this after its statement
/// could be missed.
const WINDOW: Duration = Duration::from_secs(5);

/// Events per look.
const PAGE: i64 = 500;

/// How long a subscription's registration lives unless renewed, and how often it is renewed.
const LISTENER_TTL_SECS: f64 = 60.0;
const LISTENER_RENEWAL: Duration = Duration::from_secs(20);

/// A subscription to the events of a workspace's jobs ([`subscribe_events`]). Each event is delivered once, in the
/// order its job lived them (and, across jobs, in about the order they happened), within moments of its commit (it
/// listens; a look every few seconds covers a lost notification).
pub struct JobEvents {
    pool: PgPool,
    workspace: WorkspaceId,
    filter: EventFilter,
    names: Vec<&'static str>,
    listener: PgListener,
    /// The earliest time it reads from.
    floor: DateTime<Utc>,
    /// The latest event time delivered.
    since: DateTime<Utc>,
    /// When the last look that read every page began (PostgreSQL's clock): the next starts there, less the window,
    /// even when nothing matched meanwhile.
    scanned: DateTime<Utc>,
    /// Events delivered whose time is within [`WINDOW`] of `since`, so that a second look does not repeat them: by
    /// (job, event id or 0 for an end, time).
    seen: HashSet<(Uuid, i64, DateTime<Utc>)>,
    ready: VecDeque<JobEvent>,
    /// Renews the registration that makes workers write `active` events and announce the others, while it lives.
    registration: Option<Registration>,
}

/// A row of `event_listeners`, renewed by a task until dropped; then deleted.
struct Registration {
    pool: PgPool,
    workspace: WorkspaceId,
    id: Uuid,
    renewal: tokio::task::JoinHandle<()>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.renewal.abort();
        let (pool, workspace, id) = (self.pool.clone(), self.workspace, self.id);
        // Best effort: a row left behind expires within a minute.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _ = listener_statement(&pool, workspace, id, "DELETE FROM conveyor.event_listeners WHERE id = $1")
                    .await;
            });
        }
    }
}

async fn listener_statement(
    pool: &PgPool,
    workspace: WorkspaceId,
    id: Uuid,
    statement: &'static str,
) -> Result<(), sqlx::Error> {
    let mut tx = db::begin_workspace(pool, workspace).await?;
    sqlx::query(statement).bind(id).bind(workspace.0).execute(&mut *tx).await?;
    tx.commit().await
}

/// Registers (or renews) the listener `id`: wanting `active` events or not.
const REGISTER: &str = "INSERT INTO conveyor.event_listeners (id, workspace_id, active, expires_at)
     VALUES ($1, $2, $3, now() + make_interval(secs => $4))
     ON CONFLICT (id) DO UPDATE SET expires_at = excluded.expires_at";

async fn register(pool: &PgPool, workspace: WorkspaceId, id: Uuid, active: bool) -> Result<(), sqlx::Error> {
    let mut tx = db::begin_workspace(pool, workspace).await?;
    sqlx::query(REGISTER).bind(id).bind(workspace.0).bind(active).bind(LISTENER_TTL_SECS).execute(&mut *tx).await?;
    tx.commit().await
}

/// Subscribes to the events of `workspace`'s jobs that `filter` selects, from now on (or from
/// [`EventFilter::since`]). Holds one connection of `pool` (for `LISTEN`) while it lives.
///
/// Ends, progress, retries and stalls are always recorded. A start (`active`) costs a write per job, so the workers
/// record it only while a subscription that wants it is open in the workspace: they learn of a new one within a
/// second, and a job that starts before then has no `active` event. A subscription to anything but ends registers
/// itself in PostgreSQL (a row it renews every 20 s and removes when dropped) so that workers announce its events as
/// they happen.
pub async fn subscribe_events(
    pool: &PgPool,
    workspace: WorkspaceId,
    filter: EventFilter,
) -> Result<JobEvents, sqlx::Error> {
    let mut listener = PgListener::connect_with(pool).await?;
    let names = filter.names();
    let ends = JobEventType::ENDS.into_iter().any(|e| filter.wants(e));
    let others = JobEventType::ALL.into_iter().any(|e| !e.is_end() && filter.wants(e));
    if ends {
        listener.listen(DONE_CHANNEL).await?;
    }
    let registration = if others {
        listener.listen(EVENTS_CHANNEL).await?;
        let id = Uuid::now_v7();
        let active = filter.wants(JobEventType::Active);
        register(pool, workspace, id, active).await?;
        let renewing = pool.clone();
        let renewal = tokio::spawn(async move {
            loop {
                tokio::time::sleep(LISTENER_RENEWAL).await;
                if let Err(e) = register(&renewing, workspace, id, active).await {
                    tracing::warn!(error = %crate::redact(&e.to_string()), "Could not renew an event subscription");
                }
            }
        });
        Some(Registration { pool: pool.clone(), workspace, id, renewal })
    } else {
        None
    };
    let now: DateTime<Utc> = sqlx::query_scalar("SELECT clock_timestamp()").fetch_one(pool).await?;
    let floor = filter.since.unwrap_or(now);
    Ok(JobEvents {
        pool: pool.clone(),
        workspace,
        filter,
        names,
        listener,
        floor,
        since: floor,
        scanned: floor,
        seen: HashSet::new(),
        ready: VecDeque::new(),
        registration,
    })
}

/// An event as read: where it came from, and the job's columns.
#[derive(sqlx::FromRow)]
struct EventRow {
    seq: i64,
    event: String,
    at: DateTime<Utc>,
    attempt: i32,
    event_progress: Option<serde_json::Value>,
    event_error: Option<String>,
    #[sqlx(flatten)]
    job: Row,
}

impl EventRow {
    fn event(self) -> Option<JobEvent> {
        Some(JobEvent {
            event: JobEventType::from_name(&self.event)?,
            at: self.at,
            attempt: self.attempt.max(1) as u32,
            progress: self.event_progress,
            error: self.event_error,
            job: JobInfo::from(self.job),
        })
    }
}

/// Where a page of recorded events ended ([`crate::Admin::job_events`]): the next page starts after it. Written as
/// text (`Display`, `FromStr`) for a caller to hand back: the event's time, its order among events of that time, its
/// job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EventCursor {
    at: DateTime<Utc>,
    seq: i64,
    job: Uuid,
}

impl std::fmt::Display for EventCursor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let at = self.at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
        write!(f, "{at}~{}~{}", self.seq, self.job)
    }
}

impl std::str::FromStr for EventCursor {
    type Err = String;

    fn from_str(raw: &str) -> Result<Self, String> {
        let bad = || format!("`{raw}` is not a cursor of events (a page's `next`)");
        let mut parts = raw.split('~');
        let (Some(at), Some(seq), Some(job), None) = (parts.next(), parts.next(), parts.next(), parts.next()) else {
            return Err(bad());
        };
        Ok(Self {
            at: DateTime::parse_from_rfc3339(at).map_err(|_| bad())?.with_timezone(&Utc),
            seq: seq.parse().map_err(|_| bad())?,
            job: job.parse().map_err(|_| bad())?,
        })
    }
}

/// The events of `workspace`'s jobs that `filter` selects recorded so far, oldest first, at most `limit`: after
/// `after` (a previous page's end), or from [`EventFilter::since`] (an hour ago without it: events other than ends are
/// kept that long); and, when more follow, where this page ended. No subscription: nothing is registered, nothing
/// listened to.
pub(crate) async fn recorded_events(
    pool: &PgPool,
    workspace: WorkspaceId,
    filter: &EventFilter,
    after: Option<EventCursor>,
    limit: u32,
) -> Result<(Vec<JobEvent>, Option<EventCursor>), sqlx::Error> {
    let mut tx = db::begin_workspace(pool, workspace).await?;
    let start = match (after, filter.since) {
        (Some(c), _) => (c.at, c.seq, c.job),
        (None, Some(since)) => (since, -1, Uuid::nil()),
        (None, None) => {
            (sqlx::query_scalar("SELECT now() - interval '1 hour'").fetch_one(&mut *tx).await?, -1, Uuid::nil())
        }
    };
    let names = filter.names();
    let limit = i64::from(limit);
    // One more than asked, to tell whether more follow.
    let mut rows = page(&mut tx, workspace, filter, &names, start, limit + 1).await?;
    tx.commit().await?;
    let more = rows.len() as i64 > limit;
    rows.truncate(limit as usize);
    let next = rows.last().filter(|_| more).map(|r| EventCursor { at: r.at, seq: r.seq, job: r.job.id });
    Ok((rows.into_iter().filter_map(EventRow::event).collect(), next))
}

impl JobEvents {
    /// The next event, waiting for one as long as it takes.
    pub async fn next(&mut self) -> Result<JobEvent, sqlx::Error> {
        let me = self.workspace.0.to_string();
        loop {
            if let Some(event) = self.ready.pop_front() {
                return Ok(event);
            }
            self.look().await?;
            if !self.ready.is_empty() {
                continue;
            }
            // Until a notification names this workspace (another's costs no look), or the fallback look is due.
            let fallback = tokio::time::sleep(Duration::from_secs(3));
            tokio::pin!(fallback);
            loop {
                tokio::select! {
                    next = self.listener.recv() => match next {
                        Ok(n) if n.payload() != me => continue,
                        Ok(_) => break,
                        // The listener reconnects on its next recv; look meanwhile.
                        Err(_) => {
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            break;
                        }
                    },
                    _ = &mut fallback => break,
                }
            }
        }
    }

    /// Whether the subscription is registered for the workers (it wants events other than ends).
    pub fn is_registered(&self) -> bool {
        self.registration.is_some()
    }

    /// Reads the events recorded since shortly before the latest one delivered, page by page, skipping those already
    /// delivered. One statement per page, so that it sees a job's events up to a point, none after it missing.
    async fn look(&mut self) -> Result<(), sqlx::Error> {
        let window = chrono::Duration::from_std(WINDOW).expect("a small window");
        let mut after = ((self.since.max(self.scanned) - window).max(self.floor), -1_i64, Uuid::nil());
        let mut began = None;
        loop {
            let mut tx = db::begin_workspace(&self.pool, self.workspace).await?;
            if began.is_none() {
                began = Some(sqlx::query_scalar::<_, DateTime<Utc>>("SELECT now()").fetch_one(&mut *tx).await?);
            }
            let rows = page(&mut tx, self.workspace, &self.filter, &self.names, after, PAGE).await?;
            tx.commit().await?;
            let full = rows.len() as i64 == PAGE;
            for row in rows {
                after = (row.at, row.seq, row.job.id);
                if !self.seen.insert((row.job.id, row.seq, row.at)) {
                    continue;
                }
                let Some(event) = row.event() else { continue };
                self.since = self.since.max(event.at);
                self.ready.push_back(event);
            }
            let horizon = self.since - window;
            self.seen.retain(|(_, _, at)| *at >= horizon);
            if !full {
                self.scanned = began.unwrap_or(self.scanned);
                return Ok(());
            }
        }
    }
}

/// One page of `workspace`'s events that `filter` selects (its event names: `names`), after `after` (time, event id,
/// job), in order. One statement, so that it sees a job's events up to a point, none after it missing.
async fn page(
    tx: &mut db::WorkspaceTx,
    workspace: WorkspaceId,
    filter: &EventFilter,
    names: &[&'static str],
    after: (DateTime<Utc>, i64, Uuid),
    limit: i64,
) -> Result<Vec<EventRow>, sqlx::Error> {
    // An end is `seq` i64::MAX, after every recorded event of its time. The workspace is named, not left to
    // row-level security alone: the owner of the single-role mode reads every workspace's rows.
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT x.seq, x.event, x.at, x.attempt, x.event_progress, x.event_error, {COLUMNS}
         FROM (
             SELECT v.id AS seq, v.job_id, v.event, v.at, v.attempt, v.progress AS event_progress,
                    v.error AS event_error
             FROM conveyor.job_events v
             WHERE v.workspace_id = $9 AND v.at >= $1 AND v.event = ANY($4)
             UNION ALL
             SELECT 9223372036854775807, e.id,
                    CASE e.status WHEN 'completed' THEN 'completed' WHEN 'dead_letter' THEN 'failed'
                                  ELSE 'canceled' END,
                    coalesce(e.finished_at, e.dead_lettered_at),
                    CASE e.status WHEN 'completed' THEN e.job_attempts + 1
                                  WHEN 'dead_letter' THEN greatest(e.job_attempts, 1)
                                  ELSE greatest(e.job_attempts + (e.dispatched_at IS NOT NULL)::integer, 1)
                                  END,
                    NULL::jsonb, NULL::text
             FROM conveyor.outbox_events e
             WHERE e.workspace_id = $9
               AND ((e.status IN ('completed', 'canceled') AND e.finished_at >= $1)
                    OR (e.status = 'dead_letter' AND e.dead_lettered_at >= $1))
               AND CASE e.status WHEN 'completed' THEN 'completed' WHEN 'dead_letter' THEN 'failed'
                                 ELSE 'canceled' END = ANY($4)
         ) x
         JOIN conveyor.outbox_events e ON e.id = x.job_id AND e.workspace_id = $9
         LEFT JOIN conveyor.operations o ON o.id = e.operation_id
         WHERE (x.at, x.seq, x.job_id) > ($1, $2, $3)
           AND e.status <> 'discarded'
           AND (cardinality($5::text[]) = 0 OR e.event_type = ANY($5))
           AND (cardinality($6::text[]) = 0 OR e.queue = ANY($6))
           AND ($7::uuid IS NULL OR e.id = $7)
         ORDER BY x.at, x.seq, x.job_id
         LIMIT $8"
    )))
    .bind(after.0)
    .bind(after.1)
    .bind(after.2)
    .bind(names)
    .bind(&filter.kinds)
    .bind(&filter.queues)
    .bind(filter.job.map(|j| j.0))
    .bind(limit)
    .bind(workspace.0)
    .fetch_all(&mut **tx)
    .await
}

/// A subscription to the ends (succeeded, failed, canceled) of a workspace's jobs, from the moment it was made
/// ([`subscribe`]): [`JobEvents`] of [`JobEventType::ENDS`], each as its job.
pub struct JobEnds(JobEvents);

/// Subscribes to the ends of `workspace`'s jobs from now on. Holds one connection of `pool` (for `LISTEN`) while it
/// lives. [`subscribe_events`] hears more: starts, progress, retries, stalls.
pub async fn subscribe(pool: &PgPool, workspace: WorkspaceId) -> Result<JobEnds, sqlx::Error> {
    Ok(JobEnds(subscribe_events(pool, workspace, EventFilter::all().events(JobEventType::ENDS)).await?))
}

impl JobEnds {
    /// The next job of the workspace that ended, waiting for one as long as it takes.
    pub async fn next(&mut self) -> Result<JobInfo, sqlx::Error> {
        Ok(self.0.next().await?.job)
    }
}
