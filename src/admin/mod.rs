//! Operating Conveyor across workspaces: queue counts, job and operation search, one job's detail with its failed
//! attempts, dead letters (replay, discard, one or in bulk), pauses and schedules. What the admin API
//! (`/admin/v1/...`), the web UI (`/ui/`) and the operator commands (`conveyor queues|jobs|dlq`) call.
//!
//! Reading across workspaces goes through `conveyor_admin_*` functions (`SECURITY DEFINER`), which only the operator
//! role (`CONVEYOR_OPERATOR_DATABASE_URL`) may execute, never the application role, and each call writes a row of
//! `conveyor_admin_audit` (who, what, arguments). Changes (replay, discard, cancel, retry, schedules) run as the
//! application role in the job's own workspace, under row-level security, through the one home of job transitions;
//! pauses and weights, operator data the application role only reads, through audited `conveyor_admin_*` functions
//! as the operator role. Each writes its intent to the audit trail before it runs (and does not run if that fails),
//! then its outcome (the functions write it themselves, with the change).

mod audit;
mod consumers;
mod dead_letters;
mod fairness;
mod filters;
mod holds;
mod jobs;
mod operations;
mod queue_ops;
mod queues;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use uuid::Uuid;

use crate::ids::{JobId, WorkspaceId};
use crate::outbox::control::JobStatus;
use crate::outbox::events::{EventCursor, EventFilter, JobEvent, JobEvents};
use crate::stream::RedisClient;
use crate::stream::keys::Keys;

/// Who acts, for the audit trail: `token` for the shared operator token, or a JWT's `sub`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Actor(pub String);

/// Why an operator call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AdminError {
    /// A filter or argument that cannot be (bad status, cursor, limit out of 1..=500, ...).
    #[error("{0}")]
    Invalid(String),
    /// PostgreSQL failed.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    /// Redis failed (queue lag).
    #[error(transparent)]
    Redis(#[from] fred::error::Error),
    /// The audit trail did not take a change's intent, so the change was not made.
    #[error("the audit trail could not record the change, so it was not made: {0}")]
    Unaudited(#[source] sqlx::Error),
}

impl AdminError {
    /// Whether a unique index refused the change (a replay whose job or operation would hold what a live one holds,
    /// such as a store's one active sync): a conflict with another resource's state, not a fault.
    pub fn is_conflict(&self) -> bool {
        matches!(self, Self::Database(e) if dead_letters::is_unique_violation(e))
    }

    /// Whether PostgreSQL could not be reached (or the operator role could not connect in time).
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Self::Database(e) | Self::Unaudited(e) if crate::db::is_unavailable(e))
    }
}

/// Jobs of a queue by state. A job put back by a rate limit (its handler answered `JobError::RateLimited`, its key
/// blocked until then) counts as delayed, or retrying once a run of it failed: it waits for a time, like those.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateCounts {
    /// Due, waiting for the relay.
    pub queued: u64,
    /// Waiting for their run-at time (never run yet).
    pub delayed: u64,
    /// Handed to the workers (in the stream or running).
    pub running: u64,
    /// Failed a run; waiting out their back-off.
    pub retrying: u64,
    /// Dead-lettered.
    pub dead: u64,
    /// Parents of flows waiting for their children ([`crate::Flow`]).
    #[serde(default)]
    pub waiting_children: u64,
}

/// One queue as an operator sees it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct QueueSummary {
    /// The queue's name.
    pub name: String,
    /// Its jobs by state.
    pub counts: StateCounts,
    /// Entries of its stream not yet delivered to its consumer group (Redis 7's `lag`); `None` when Redis does not
    /// say (no group yet).
    pub lag: Option<u64>,
    /// Entries delivered and not yet acknowledged (capped by the workers' concurrency).
    pub pending: Option<u64>,
    /// Consumers of its group.
    pub consumers: Option<u64>,
    /// Jobs that succeeded per minute, over the last 5 minutes.
    pub completed_per_minute: f64,
    /// Jobs dead-lettered per minute, over the last 5 minutes.
    pub failed_per_minute: f64,
    /// Age in seconds of the oldest due job not yet handed to the workers.
    pub oldest_queued_seconds: Option<f64>,
    /// A pause names this queue alone.
    pub paused: bool,
}

/// One minute of a queue's last hour ([`Admin::queue_minutes`]), recorded by maintenance at each pass.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct QueueMinute {
    /// The minute's start (UTC).
    pub minute: DateTime<Utc>,
    /// Jobs that succeeded in it.
    pub done: u64,
    /// Jobs dead-lettered in it.
    pub failed: u64,
    /// Jobs canceled in it as expired: not started by their deadline ([`crate::EnqueueOptions::start_within`]).
    /// Absent (0) from a server of a release before it.
    #[serde(default)]
    pub expired: u64,
    /// Due jobs waiting for the relay, the most a pass of the minute saw; `None` when no pass looked.
    pub backlog: Option<u64>,
    /// Of the jobs that ended in it, how long each had waited from due to hand-off, 95th percentile in ms.
    pub wait_p95_ms: Option<f64>,
}

/// One page of a search, newest first. `next` is the cursor of the following page.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Page<T> {
    /// The items.
    pub items: Vec<T>,
    /// Pass as `before` to get the next page; `None` on the last.
    pub next: Option<Uuid>,
}

/// Which jobs a search answers (every field that is set must match).
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct JobFilter {
    /// Of this queue.
    pub queue: Option<String>,
    /// Of this kind.
    pub kind: Option<String>,
    /// In this state.
    pub status: Option<JobStatus>,
    /// Of this workspace.
    pub workspace: Option<Uuid>,
    /// Enqueued at or after.
    pub since: Option<DateTime<Utc>>,
    /// Enqueued before.
    pub until: Option<DateTime<Utc>>,
    /// Older than this job id (the previous page's `next`).
    pub before: Option<Uuid>,
    /// Page size, 1 to 500 (default 50).
    pub limit: Option<u32>,
}

/// A job in a list.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JobSummary {
    /// Its id.
    pub id: Uuid,
    /// Its workspace.
    pub workspace_id: Uuid,
    /// Its kind.
    pub kind: String,
    /// Its queue.
    pub queue: String,
    /// Where it is.
    pub status: JobStatus,
    /// Runs that failed so far.
    pub failed_runs: u32,
    /// The last failure, redacted.
    pub last_error: Option<String>,
    /// The operation it advances.
    pub operation_id: Option<Uuid>,
    /// Enqueued.
    pub created_at: DateTime<Utc>,
    /// Due to run (next).
    pub run_at: DateTime<Utc>,
    /// Ended.
    pub finished_at: Option<DateTime<Utc>>,
}

/// A failed run of a job.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Attempt {
    /// Which run (1 = the first).
    pub attempt: u32,
    /// `job` (the handler failed) or `dispatch` (the relay could not hand it over).
    pub stage: String,
    /// The error, redacted.
    pub error: Option<String>,
    /// When it failed.
    pub failed_at: DateTime<Utc>,
    /// When its handler started, by the worker's clock (a run recorded by a worker of an earlier release, or a failed
    /// hand-off, has none).
    #[serde(default)]
    pub started_at: Option<DateTime<Utc>>,
    /// The worker (its consumer name) that ran it.
    #[serde(default)]
    pub ran_by: Option<String>,
}

/// One job in full: what the list shows, its payload, progress, result and its failed runs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JobDetail {
    /// The job as listed.
    #[serde(flatten)]
    pub job: JobSummary,
    /// Its payload (ids only by contract; shown to operators).
    pub payload: serde_json::Value,
    /// Its priority (0 high, 1 normal, 2 low).
    pub priority: i16,
    /// Its own limit of runs, if it set one.
    pub max_attempts: Option<u32>,
    /// Its de-duplication key.
    pub dedup_key: Option<String>,
    /// The latest progress.
    pub progress: Option<serde_json::Value>,
    /// The handler's result, once succeeded.
    pub result: Option<serde_json::Value>,
    /// Last handed to the workers.
    pub dispatched_at: Option<DateTime<Utc>>,
    /// Its failed runs, oldest first.
    pub attempts: Vec<Attempt>,
    /// Its log ([`crate::JobContext::log`]), oldest line first.
    pub logs: Vec<crate::LogLine>,
    /// The job it is a child of, in a flow ([`crate::Flow`]).
    #[serde(default)]
    pub parent: Option<FlowRelative>,
    /// Its children, in a flow, in the order they were created (the first 1,000).
    #[serde(default)]
    pub children: Vec<FlowRelative>,
    /// The children it still waits for.
    #[serde(default)]
    pub children_left: u32,
    /// The W3C trace id of the request that enqueued it (32 hex digits), when it came with a `traceparent`.
    #[serde(default)]
    pub trace_id: Option<String>,
    /// Its deadline, if it set one ([`crate::EnqueueOptions::expire_at`]).
    #[serde(default)]
    pub expires_at: Option<DateTime<Utc>>,
    /// When its last recorded run's handler started, by the worker's clock: its run to success, or its last failed
    /// run.
    #[serde(default)]
    pub run_started_at: Option<DateTime<Utc>>,
    /// The worker (its consumer name) that ran its last recorded run.
    #[serde(default)]
    pub ran_by: Option<String>,
}

/// A parent or a child of a job in a flow, as its page lists it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FlowRelative {
    /// Its id.
    pub id: Uuid,
    /// Its kind.
    pub kind: String,
    /// Its queue.
    pub queue: String,
    /// Where it is.
    pub status: JobStatus,
    /// What the child's failure does to the parent: `fail`, `ignore` or `remove` ([`crate::ChildFailure`]).
    pub on_failure: String,
    /// The children it still waits for.
    pub children_left: u32,
    /// Ended.
    pub finished_at: Option<DateTime<Utc>>,
}

/// Which operations a search answers.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct OperationFilter {
    /// Of this kind.
    pub kind: Option<String>,
    /// In this status (`queued`, `running`, `succeeded`, `failed`, `canceled`).
    pub status: Option<String>,
    /// Of this workspace.
    pub workspace: Option<Uuid>,
    /// Created at or after.
    pub since: Option<DateTime<Utc>>,
    /// Created before.
    pub until: Option<DateTime<Utc>>,
    /// Older than this operation id.
    pub before: Option<Uuid>,
    /// Page size, 1 to 500 (default 50).
    pub limit: Option<u32>,
}

/// A user-visible operation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OperationSummary {
    /// Its id.
    pub id: Uuid,
    /// Its workspace.
    pub workspace_id: Uuid,
    /// Its kind.
    pub kind: String,
    /// Its status.
    pub status: String,
    /// What it acts on.
    pub subject_id: Option<Uuid>,
    /// Its error, redacted.
    pub error: Option<String>,
    /// Runs so far.
    pub attempt: i32,
    /// Created.
    pub created_at: DateTime<Utc>,
    /// Last changed.
    pub updated_at: DateTime<Utc>,
    /// Ended.
    pub finished_at: Option<DateTime<Utc>>,
}

/// Which dead letters a search, a bulk replay or a bulk discard takes. A bulk action needs at least one of `queue`,
/// `kind`, `workspace`, `since`, `until`, or `all` (every dead letter of every workspace, up to its limit): an empty
/// filter is refused, not taken to mean everything.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct DeadLetterFilter {
    /// Of this queue.
    pub queue: Option<String>,
    /// Of this kind.
    pub kind: Option<String>,
    /// Of this workspace.
    pub workspace: Option<Uuid>,
    /// Dead-lettered at or after.
    pub since: Option<DateTime<Utc>>,
    /// Dead-lettered before.
    pub until: Option<DateTime<Utc>>,
    /// Older than this job id (searches only).
    pub before: Option<Uuid>,
    /// Page size of a search, or most taken by a bulk action (1 to 500, default 50 / 500).
    pub limit: Option<u32>,
    /// A bulk action meant for every dead letter the other fields (if any) match, said explicitly.
    #[serde(default)]
    pub all: bool,
}

pub use crate::worker::dlq::{DeadLetter, Replay};
pub use consumers::ConsumerInfo;
pub use fairness::{WorkspaceKeyLimit, WorkspaceKindLimit, WorkspaceShare};
pub use queue_ops::{CleanFilter, DrainFilter, DrainOutcome, ObliterateFilter, Obliteration};

/// What a bulk replay or discard did.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BulkOutcome {
    /// Dead letters matched.
    pub matched: u64,
    /// Replayed or discarded.
    pub done: u64,
    /// Skipped: their de-dup key is held by a live job, or they stopped being dead letters meanwhile.
    pub skipped: u64,
}

/// What a cancel or retry of one job did.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobAction {
    /// Done.
    Done,
    /// No such job.
    NotFound,
    /// The job's state does not allow it (e.g. cancel of a finished job, retry of a running one).
    NotAllowed,
    /// Retry of a dead letter whose de-dup key a live job holds.
    KeyHeld(Uuid),
    /// Run now of a waiting job that something holds back whatever its due time (a pause, a rate-limit block of its
    /// key), named here: nothing changed, since making it due would not run it.
    Held(String),
}

/// An entry of the audit trail.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AuditEntry {
    /// When.
    pub at: DateTime<Utc>,
    /// Who (the actor).
    pub actor: String,
    /// The database role it ran as.
    pub role: String,
    /// What (`queues`, `jobs`, `replay_dead_letter`, ...).
    pub action: String,
    /// Its arguments. A change writes two entries: its intent (`"outcome": "pending"`) before it runs, then what it
    /// did (`outcome`, and `"intent"`: the id of its intent entry).
    pub arguments: serde_json::Value,
}

/// The operator's handle: the operator role's pool for reads across workspaces, the application role's pool for
/// changes under row-level security, and Redis for stream lag.
#[derive(Clone)]
pub struct Admin {
    operator: PgPool,
    app: PgPool,
    /// Redis and the key names, for the queues' consumer groups; `None` for tools that need no lag.
    redis: Option<(RedisClient, Keys)>,
}

impl Admin {
    /// An operator handle over both pools and Redis.
    pub fn new(operator: PgPool, app: PgPool, redis: RedisClient, keys: Keys) -> Self {
        Self { operator, app, redis: Some((redis, keys)) }
    }

    /// An operator handle over both pools alone (the `conveyor dlq` commands): queues then show no lag, pending
    /// entries or consumers.
    pub fn without_redis(operator: PgPool, app: PgPool) -> Self {
        Self { operator, app, redis: None }
    }

    /// Every queue (registered kinds' queues and queues with live, dead or recently finished jobs), by name.
    pub async fn queues(&self, actor: &Actor) -> Result<Vec<QueueSummary>, AdminError> {
        queues::list(self, actor, None).await
    }

    /// Every consumer of every queue's group, as Redis sees it: the entries each holds and how long since it read.
    pub async fn consumers(&self, actor: &Actor) -> Result<Vec<ConsumerInfo>, AdminError> {
        consumers::list(self, actor).await
    }

    /// One queue, or `None` when no registered kind names it and it has no live, dead or recently finished job.
    pub async fn queue(&self, actor: &Actor, name: &str) -> Result<Option<QueueSummary>, AdminError> {
        Ok(queues::list(self, actor, Some(name)).await?.into_iter().next())
    }

    /// The last hour of queue `name`, minute by minute, oldest first: sixty minutes, the current one last (audited as
    /// `queue_minutes`). Maintenance records them at each pass; a minute before it ran reads zero.
    pub async fn queue_minutes(&self, actor: &Actor, name: &str) -> Result<Vec<QueueMinute>, AdminError> {
        queues::minutes(self, actor, name).await
    }

    /// The last hour of every queue that recorded a minute in it, as [`Admin::queue_minutes`] answers for one, by
    /// queue name (one audit entry, `queues_minutes`): the overview's charts.
    pub async fn every_queue_minutes(
        &self,
        actor: &Actor,
    ) -> Result<std::collections::BTreeMap<String, Vec<QueueMinute>>, AdminError> {
        queues::every_minutes(self, actor).await
    }

    /// Jobs matching `filter`, newest first.
    pub async fn jobs(&self, actor: &Actor, filter: &JobFilter) -> Result<Page<JobSummary>, AdminError> {
        jobs::search(self, actor, filter).await
    }

    /// One job in full, in whichever workspace.
    pub async fn job(&self, actor: &Actor, id: JobId) -> Result<Option<JobDetail>, AdminError> {
        jobs::detail(self, actor, id).await
    }

    /// The events of `workspace`'s jobs that `filter` selects, recorded so far, oldest first, at most `limit` (1 to
    /// 1000): after `after` (the previous page's end), or from [`EventFilter::since`], or the last hour (events other
    /// than ends are kept that long); and, when more follow, where this page ended. Read as the application role in
    /// that workspace (each statement names it); on the audit trail (`job_events`).
    pub async fn job_events(
        &self,
        actor: &Actor,
        workspace: WorkspaceId,
        filter: &EventFilter,
        after: Option<EventCursor>,
        limit: u32,
    ) -> Result<(Vec<JobEvent>, Option<EventCursor>), AdminError> {
        if !(1..=1000).contains(&limit) {
            return Err(AdminError::Invalid(format!("limit must be 1 to 1000, not {limit}")));
        }
        let arguments = serde_json::json!({
            "workspace": workspace.0, "filter": filter.describe(), "after": after.map(|c| c.to_string()),
            "limit": limit,
        });
        audit::write(self, actor, "job_events", arguments).await?;
        Ok(crate::outbox::events::recorded_events(&self.app, workspace, filter, after, limit).await?)
    }

    /// Follows the events of `workspace`'s jobs that `filter` selects, from now (or [`EventFilter::since`]), as the
    /// workspace's own processes hear them ([`crate::subscribe_events`]: a subscription that wants `active` makes the
    /// workers record starts while it lives). Holds a connection of the application pool (the host's, which an API
    /// shares with its requests) until dropped. On the audit trail once, when it starts (`follow_job_events`).
    pub async fn follow_job_events(
        &self,
        actor: &Actor,
        workspace: WorkspaceId,
        filter: EventFilter,
    ) -> Result<JobEvents, AdminError> {
        let arguments = serde_json::json!({ "workspace": workspace.0, "filter": filter.describe() });
        audit::write(self, actor, "follow_job_events", arguments).await?;
        Ok(crate::outbox::events::subscribe_events(&self.app, workspace, filter).await?)
    }

    /// Cancels a job that has not ended (a running handler sees it at once).
    pub async fn cancel_job(&self, actor: &Actor, id: JobId) -> Result<JobAction, AdminError> {
        jobs::cancel(self, actor, id).await
    }

    /// Runs a job again: a dead letter from its first attempt (a replay), a retrying or delayed job now (refused,
    /// [`JobAction::Held`], while a pause or its key's rate-limit block holds it back).
    pub async fn retry_job(&self, actor: &Actor, id: JobId) -> Result<JobAction, AdminError> {
        jobs::retry(self, actor, id).await
    }
    /// Changes a waiting job of any workspace: its priority, due time or payload (audited as `change_job`, with what
    /// it sets). [`JobAction::NotAllowed`] once the relay took it.
    pub async fn change_job(
        &self,
        actor: &Actor,
        id: JobId,
        change: &crate::JobChange,
    ) -> Result<JobAction, AdminError> {
        jobs::change(self, actor, id, change).await
    }

    /// Cancels the waiting jobs of a queue or kind, in one workspace or in all (audited as `drain`).
    pub async fn drain(&self, actor: &Actor, filter: &DrainFilter) -> Result<DrainOutcome, AdminError> {
        queue_ops::drain(self, actor, filter).await
    }

    /// Deletes a workspace's ended jobs by age or beyond the newest N (audited as `clean`); returns how many.
    pub async fn clean(&self, actor: &Actor, filter: &CleanFilter) -> Result<u64, AdminError> {
        queue_ops::clean(self, actor, filter).await
    }

    /// Empties a workspace's queue: cancels its waiting jobs and deletes its ended ones; refused while its jobs run,
    /// unless forced (audited as `obliterate`).
    pub async fn obliterate(
        &self,
        actor: &Actor,
        queue: &str,
        filter: &ObliterateFilter,
    ) -> Result<Obliteration, AdminError> {
        queue_ops::obliterate(self, actor, queue, filter).await
    }

    /// Operations matching `filter`, newest first.
    pub async fn operations(
        &self,
        actor: &Actor,
        filter: &OperationFilter,
    ) -> Result<Page<OperationSummary>, AdminError> {
        operations::search(self, actor, filter).await
    }

    /// Dead letters matching `filter`, newest first.
    pub async fn dead_letters(&self, actor: &Actor, filter: &DeadLetterFilter) -> Result<Page<DeadLetter>, AdminError> {
        dead_letters::search(self, actor, filter).await
    }

    /// Replays one dead letter from its first attempt. A unique index refusing it (a store's one active sync) is
    /// [`AdminError::Database`]: see [`AdminError::is_conflict`].
    pub async fn replay_dead_letter(&self, actor: &Actor, id: JobId) -> Result<Replay, AdminError> {
        dead_letters::replay_one(self, actor, id).await
    }

    /// Discards one dead letter (no read shows it any more; its row stays as a tombstone, which retention purges, so
    /// that a delivery of it still in a stream is skipped; its operation stays failed). `false`: not a dead letter.
    pub async fn discard_dead_letter(&self, actor: &Actor, id: JobId) -> Result<bool, AdminError> {
        dead_letters::discard_one(self, actor, id).await
    }

    /// Replays every dead letter matching `filter` (at most its limit, default 500).
    pub async fn replay_dead_letters(
        &self,
        actor: &Actor,
        filter: &DeadLetterFilter,
    ) -> Result<BulkOutcome, AdminError> {
        dead_letters::replay_many(self, actor, filter).await
    }

    /// Discards every dead letter matching `filter` (at most its limit, default 500).
    pub async fn discard_dead_letters(
        &self,
        actor: &Actor,
        filter: &DeadLetterFilter,
    ) -> Result<BulkOutcome, AdminError> {
        dead_letters::discard_many(self, actor, filter).await
    }

    /// The pauses in force.
    pub async fn pauses(&self, actor: &Actor) -> Result<Vec<crate::Pause>, AdminError> {
        holds::pauses(self, actor).await
    }

    /// Pauses a scope (see [`crate::pause`]); `false`: it was already paused.
    pub async fn pause(
        &self,
        actor: &Actor,
        scope: &crate::PauseScope,
        reason: Option<&str>,
    ) -> Result<bool, AdminError> {
        holds::pause(self, actor, scope, reason).await
    }

    /// Lifts the pause of exactly this scope; `false`: there was none.
    pub async fn resume(&self, actor: &Actor, scope: &crate::PauseScope) -> Result<bool, AdminError> {
        holds::resume(self, actor, scope).await
    }

    /// Gives a workspace `weight` (1 to 1000) times the window of jobs in the workers' hands (see
    /// [`crate::set_workspace_weight`]).
    pub async fn set_workspace_weight(
        &self,
        actor: &Actor,
        workspace: WorkspaceId,
        weight: u32,
    ) -> Result<(), AdminError> {
        holds::set_weight(self, actor, workspace, weight).await
    }

    /// The global limits, each with its jobs in flight and its recent hand-outs (see [`crate::set_global_limit`]).
    pub async fn global_limits(&self, actor: &Actor) -> Result<Vec<crate::GlobalLimits>, AdminError> {
        holds::global_limits(self, actor).await
    }

    /// Holds every workspace's jobs of `scope` to `limit` together (see [`crate::set_global_limit`]).
    pub async fn set_global_limit(
        &self,
        actor: &Actor,
        scope: &crate::GlobalScope,
        limit: crate::GlobalLimit,
    ) -> Result<(), AdminError> {
        holds::set_global_limit(self, actor, scope, limit).await
    }

    /// Removes the global limit of `scope`; `false`: there was none.
    pub async fn remove_global_limit(&self, actor: &Actor, scope: &crate::GlobalScope) -> Result<bool, AdminError> {
        holds::remove_global_limit(self, actor, scope).await
    }

    /// Workspaces with jobs in the workers' hands or a weight of their own: each one's weight, jobs in flight and
    /// share of all jobs in flight (the 500 with the most).
    pub async fn workspace_shares(&self, actor: &Actor) -> Result<Vec<WorkspaceShare>, AdminError> {
        fairness::workspace_shares(self, actor).await
    }

    /// Every workspace's key limits and blocks (or one workspace's), each with its jobs in flight.
    pub async fn key_limits(
        &self,
        actor: &Actor,
        workspace: Option<WorkspaceId>,
    ) -> Result<Vec<WorkspaceKeyLimit>, AdminError> {
        fairness::key_limits(self, actor, workspace).await
    }

    /// Every workspace's kind limits (or one workspace's), each with its jobs in flight.
    pub async fn kind_limits(
        &self,
        actor: &Actor,
        workspace: Option<WorkspaceId>,
    ) -> Result<Vec<WorkspaceKindLimit>, AdminError> {
        fairness::kind_limits(self, actor, workspace).await
    }

    /// Sets a key's limits in a workspace (see [`crate::set_key_limit`]), audited.
    pub async fn set_key_limit(
        &self,
        actor: &Actor,
        workspace: WorkspaceId,
        key: &str,
        limit: crate::KeyLimit,
    ) -> Result<(), AdminError> {
        fairness::set_key_limit(self, actor, workspace, key, limit).await
    }

    /// Removes a key's limits and block in a workspace; `false`: it had none.
    pub async fn remove_key_limit(&self, actor: &Actor, workspace: WorkspaceId, key: &str) -> Result<bool, AdminError> {
        fairness::remove_key_limit(self, actor, workspace, key).await
    }

    /// Sets a kind's concurrency limit in a workspace (see [`crate::set_kind_limit`]), audited.
    pub async fn set_kind_limit(
        &self,
        actor: &Actor,
        workspace: WorkspaceId,
        kind: &str,
        max_in_flight: u32,
    ) -> Result<(), AdminError> {
        fairness::set_kind_limit(self, actor, workspace, kind, max_in_flight).await
    }

    /// Removes a kind's limit in a workspace; `false`: it had none.
    pub async fn remove_kind_limit(
        &self,
        actor: &Actor,
        workspace: WorkspaceId,
        kind: &str,
    ) -> Result<bool, AdminError> {
        fairness::remove_kind_limit(self, actor, workspace, kind).await
    }

    /// Schedules of every workspace (or of one).
    pub async fn schedules(
        &self,
        actor: &Actor,
        workspace: Option<WorkspaceId>,
    ) -> Result<Vec<(Uuid, crate::Schedule)>, AdminError> {
        holds::schedules(self, actor, workspace).await
    }

    /// Pauses or resumes one schedule; `false`: no such schedule.
    pub async fn set_schedule_paused(
        &self,
        actor: &Actor,
        workspace: WorkspaceId,
        name: &str,
        paused: bool,
    ) -> Result<bool, AdminError> {
        holds::set_schedule_paused(self, actor, workspace, name, paused).await
    }

    /// The newest entries of the audit trail (`limit` 1 to 500).
    pub async fn audit(&self, actor: &Actor, limit: u32) -> Result<Vec<AuditEntry>, AdminError> {
        audit::trail(self, actor, limit).await
    }
}
