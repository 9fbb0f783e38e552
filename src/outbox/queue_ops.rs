//! Queue operations on a workspace's jobs, the ones BullMQ's `Queue` and `Job` offer: change a job that waits
//! ([`change_job`]: its priority, due time or payload: `changePriority`, `changeDelay`, `promote`, `updateData`),
//! cancel every waiting job of a queue or kind ([`drain_jobs`]: `drain`), delete ended jobs by age or beyond the newest
//! N ([`clean_jobs`]: `clean`), make every delayed job due now ([`promote_jobs`]: `promoteJobs`), replay every failed
//! job ([`retry_jobs`]: `retryJobs`), empty a queue ([`obliterate_queue`]: `obliterate`). Each runs under row-level
//! security in the workspace it is given.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use super::control::JobStatus;
use super::transitions::waiting::{self, Change, ChangeOutcome, Due};
use crate::db;
use crate::ids::{JobId, WorkspaceId};
use crate::kind::{JobKind, Priority};

/// A change of a job that waits for the relay (delayed, due, or waiting out a retry's back-off); what is not set is
/// kept. Once the relay has taken the job (it is being handed to a worker, runs, or ended), a change is refused: a
/// worker may already hold what it had. A change starts a new generation of the job, as a replay does: an entry of an
/// earlier hand-off that may still be in a stream no longer runs.
#[derive(Clone, Debug, Default)]
pub struct JobChange {
    priority: Option<Priority>,
    due: Option<Due>,
    payload: Option<(Option<&'static str>, Result<serde_json::Value, String>)>,
}

impl JobChange {
    /// Changes nothing yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Its priority (BullMQ's `changePriority`).
    pub fn priority(mut self, priority: Priority) -> Self {
        self.priority = Some(priority);
        self
    }

    /// Due now, by PostgreSQL's clock (BullMQ's `promote`). A pause or a block of its key still holds it. Of
    /// `run_now`, `run_at` and `delay`, the last one called is the change.
    pub fn run_now(mut self) -> Self {
        self.due = Some(Due::Now);
        self
    }

    /// Due at `at`.
    pub fn run_at(mut self, at: DateTime<Utc>) -> Self {
        self.due = Some(Due::At(at));
        self
    }

    /// Due `delay` from now, by PostgreSQL's clock (BullMQ's `changeDelay`).
    pub fn delay(mut self, delay: Duration) -> Self {
        self.due = Some(Due::After(delay));
        self
    }

    /// Its payload, which must be of the job's kind (BullMQ's `updateData`). Ids only, as at enqueue.
    pub fn payload<K: JobKind>(mut self, payload: &K) -> Self {
        self.payload = Some((Some(K::KIND), serde_json::to_value(payload).map_err(|e| e.to_string())));
        self
    }

    /// Its payload, already in JSON, for the job's kind whatever it is (an operator's change: the admin API's).
    pub fn json_payload(mut self, payload: serde_json::Value) -> Self {
        self.payload = Some((None, Ok(payload)));
        self
    }

    /// What it sets, for the audit trail.
    pub(crate) fn describe(&self) -> serde_json::Value {
        let mut set = serde_json::Map::new();
        if let Some(priority) = self.priority {
            set.insert("priority".into(), serde_json::json!(priority));
        }
        match self.due {
            Some(Due::Now) => {
                set.insert("run_now".into(), true.into());
            }
            Some(Due::At(at)) => {
                set.insert("run_at".into(), serde_json::json!(at));
            }
            Some(Due::After(delay)) => {
                set.insert("delay_ms".into(), serde_json::json!(delay.as_millis() as u64));
            }
            None => {}
        }
        if let Some((_, payload)) = &self.payload {
            set.insert("payload".into(), payload.clone().unwrap_or_else(|e| serde_json::json!({ "invalid": e })));
        }
        serde_json::Value::Object(set)
    }

    /// Refuses a change that sets nothing, or a due time further than ten years away (as an enqueue does).
    pub(crate) fn validate(&self) -> Result<(), ChangeError> {
        if self.priority.is_none() && self.due.is_none() && self.payload.is_none() {
            return Err(ChangeError::Invalid("it changes nothing: set a priority, a due time or a payload".into()));
        }
        let ten_years = Duration::from_secs(10 * 366 * 24 * 3600);
        let too_far = match self.due {
            Some(Due::After(delay)) => delay > ten_years,
            Some(Due::At(at)) => at > Utc::now() + chrono::Duration::days(3660),
            _ => false,
        };
        if too_far {
            return Err(ChangeError::Invalid("the due time must be at most ten years away".into()));
        }
        Ok(())
    }
}

/// Why a change of a job was refused; nothing changed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChangeError {
    /// No such job in the workspace.
    #[error("no such job")]
    NotFound,
    /// The relay has taken it, or it ended: it no longer waits.
    #[error("the job no longer waits ({0:?}): a worker may already hold it")]
    NotWaiting(JobStatus),
    /// Its due time cannot change: it is a parent of a flow waiting for its children, due when the last one ends.
    #[error("the job waits for its children: it is due when the last one ends")]
    WaitsForChildren,
    /// The new payload is of another kind than the job.
    #[error("the job is of kind {job}, the new payload of kind {payload}")]
    OtherKind {
        /// The job's kind.
        job: String,
        /// The payload's kind.
        payload: String,
    },
    /// The change sets nothing, or its payload does not serialize.
    #[error("invalid change: {0}")]
    Invalid(String),
    /// PostgreSQL failed.
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
}

/// The status a user sees of a job that no longer waits, from its row's status.
fn ended_or_taken(status: &str) -> JobStatus {
    match status {
        "completed" => JobStatus::Succeeded,
        "canceled" => JobStatus::Canceled,
        "dead_letter" => JobStatus::Failed,
        _ => JobStatus::Active,
    }
}

/// Changes the waiting job `id` of `workspace` in a transaction of its own, and wakes the dispatchers for it at
/// commit. Returns when it is due now. Changing a job that the relay is claiming at this instant waits for the
/// claim's transaction, then finds the job taken ([`ChangeError::NotWaiting`]); a job this change holds is skipped
/// by the claim until the change commits.
pub async fn change_job(
    pool: &PgPool,
    workspace: WorkspaceId,
    id: JobId,
    change: &JobChange,
) -> Result<DateTime<Utc>, ChangeError> {
    change.validate()?;
    let payload = match &change.payload {
        Some((kind, Ok(payload))) => Some((*kind, payload)),
        Some((_, Err(e))) => return Err(ChangeError::Invalid(format!("the payload does not serialize: {e}"))),
        None => None,
    };
    let mut tx = db::begin_workspace(pool, workspace).await?;
    let change = Change { priority: change.priority.map(Priority::level), due: change.due, payload };
    let changed = waiting::change_tx(&mut tx, workspace, id.0, &change).await?;
    match changed {
        ChangeOutcome::Done(due) => {
            tx.commit().await?;
            Ok(due)
        }
        ChangeOutcome::NotFound => Err(ChangeError::NotFound),
        ChangeOutcome::NotWaiting(status) => Err(ChangeError::NotWaiting(ended_or_taken(&status))),
        ChangeOutcome::WaitsForChildren => Err(ChangeError::WaitsForChildren),
        ChangeOutcome::OtherKind(job) => Err(ChangeError::OtherKind {
            job,
            payload: change.payload.and_then(|(kind, _)| kind).unwrap_or_default().to_owned(),
        }),
    }
}

/// Which jobs of a workspace a drain or a clean takes: of one queue, of one kind, of both, or of every queue.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobScope {
    queue: Option<String>,
    kind: Option<String>,
}

impl JobScope {
    /// The jobs of the queue `name`.
    pub fn queue(name: impl Into<String>) -> Self {
        Self { queue: Some(name.into()), kind: None }
    }

    /// The jobs of kind `K`.
    pub fn kind<K: JobKind>() -> Self {
        Self::kind_named(K::KIND)
    }

    /// The jobs of the kind named `kind` (for tools that know kinds by name).
    pub fn kind_named(kind: impl Into<String>) -> Self {
        Self { queue: None, kind: Some(kind.into()) }
    }

    /// Only those of kind `kind` too.
    pub fn and_kind(mut self, kind: impl Into<String>) -> Self {
        self.kind = Some(kind.into());
        self
    }

    /// Every job of the workspace, whatever its queue or kind: said explicitly.
    pub fn every_queue() -> Self {
        Self { queue: None, kind: None }
    }

    /// The queue it names, if any.
    pub fn queue_name(&self) -> Option<&str> {
        self.queue.as_deref()
    }

    /// The kind it names, if any.
    pub fn kind_name(&self) -> Option<&str> {
        self.kind.as_deref()
    }
}

/// The most jobs one transaction of a drain or a clean takes: a large drain commits in steps, and each step's locks
/// are short.
const STEP: i64 = 1000;

/// Cancels every job of `workspace` in `scope` that waits for the relay (delayed, due, or waiting out a retry's
/// back-off), as [`crate::cancel_job`] would each (a job of a live operation is canceled with its operation and
/// that operation's other live jobs, handed out or not); BullMQ's `drain`, delayed jobs included. Other jobs already
/// handed to workers run on. Commits in steps of a thousand jobs; returns how many waiting jobs it canceled. A job
/// enqueued meanwhile may be canceled or not.
pub async fn drain_jobs(pool: &PgPool, workspace: WorkspaceId, scope: &JobScope) -> Result<u64, sqlx::Error> {
    let mut drained = 0;
    loop {
        let mut tx = db::begin_workspace(pool, workspace).await?;
        let step = waiting::drain_tx(&mut tx, workspace, scope.queue_name(), scope.kind_name(), STEP).await?;
        tx.commit().await?;
        drained += step.canceled;
        // A full step may have lost some jobs to the relay meanwhile: more may wait all the same.
        if step.found < STEP as u64 {
            return Ok(drained);
        }
    }
}

/// Which ended jobs [`clean_jobs`] deletes: of one end (succeeded, failed or canceled) in a scope, optionally only
/// those ended at least some time ago, or all but the newest N (both: those that pass both).
#[derive(Clone, Debug)]
pub struct CleanJobs {
    status: &'static str,
    scope: JobScope,
    older_than: Option<Duration>,
    keep_last: Option<u32>,
}

impl CleanJobs {
    /// Jobs that ended with `status`: [`JobStatus::Succeeded`], [`JobStatus::Failed`] or [`JobStatus::Canceled`]
    /// (`None` for a status that is not an end).
    pub fn ended(status: JobStatus) -> Option<Self> {
        let status = match status {
            JobStatus::Succeeded => "completed",
            JobStatus::Failed => "dead_letter",
            JobStatus::Canceled => "canceled",
            _ => return None,
        };
        Some(Self { status, scope: JobScope::every_queue(), older_than: None, keep_last: None })
    }

    /// Only those in `scope` (default: every queue).
    pub fn scope(mut self, scope: JobScope) -> Self {
        self.scope = scope;
        self
    }

    /// Only those that ended at least `age` ago (BullMQ's grace period).
    pub fn older_than(mut self, age: Duration) -> Self {
        self.older_than = Some(age);
        self
    }

    /// All but the newest `n` (by end time); 0 keeps none.
    pub fn keep_last(mut self, n: u32) -> Self {
        self.keep_last = Some(n);
        self
    }
}

/// Deletes the ended jobs of `workspace` that `clean` matches, oldest end first, and returns how many (BullMQ's
/// `clean`). Succeeded and canceled jobs are deleted with their recorded failures; failed ones (dead letters) are
/// discarded, as an operator's discard does: a tombstone stays until retention, so that a delivery still in a stream
/// is skipped, and the job can no longer be replayed. A canceled job that was handed to a worker stays for a day
/// after its cancel (the longest a run may last): its run may still be going, and must find its row to roll back.
/// With neither [`CleanJobs::older_than`] nor [`CleanJobs::keep_last`], every job of that end in the scope goes.
/// Commits in steps of a thousand jobs.
pub async fn clean_jobs(pool: &PgPool, workspace: WorkspaceId, clean: &CleanJobs) -> Result<u64, sqlx::Error> {
    let spec = waiting::Clean {
        status: clean.status,
        queue: clean.scope.queue_name(),
        kind: clean.scope.kind_name(),
        older_than: clean.older_than,
        keep_last: clean.keep_last.filter(|n| *n > 0).map(i64::from),
    };
    let mut cleaned = 0;
    loop {
        let mut tx = db::begin_workspace(pool, workspace).await?;
        let (found, deleted) = waiting::clean_tx(&mut tx, &spec, STEP).await?;
        tx.commit().await?;
        cleaned += deleted;
        if found < STEP as u64 {
            return Ok(cleaned);
        }
    }
}

/// Makes every delayed job of `workspace` in `scope` due now (those waiting for the relay and due later: delayed, or
/// waiting out a retry's back-off), BullMQ's `promoteJobs`, and wakes the dispatchers; returns how many. A pause or a
/// block of its key still holds a job (and is counted all the same); one that another transaction holds at this
/// instant (a change) is left as it is, and so is one enqueued after the call began. Commits in steps of a thousand
/// jobs.
pub async fn promote_jobs(pool: &PgPool, workspace: WorkspaceId, scope: &JobScope) -> Result<u64, sqlx::Error> {
    let mut promoted = 0;
    // Jobs enqueued from now on (by PostgreSQL's clock) are not this promote's: a producer that keeps adding cannot
    // keep it going.
    let started: DateTime<Utc> = sqlx::query_scalar("SELECT now()").fetch_one(pool).await?;
    loop {
        let mut tx = db::begin_workspace(pool, workspace).await?;
        let (queue, kind) = (scope.queue_name(), scope.kind_name());
        let step = waiting::promote_tx(&mut tx, workspace, queue, kind, started, STEP).await?;
        tx.commit().await?;
        promoted += step;
        if step < STEP as u64 {
            return Ok(promoted);
        }
    }
}

/// What [`retry_jobs`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Retried {
    /// Failed jobs (dead letters) sent through the outbox again, from their first attempt.
    pub replayed: u64,
    /// Failed jobs left as they were: a live job holds their de-dup key, and replaying would make two.
    pub key_held: u64,
    /// Failed jobs left as they were: a unique index refused the replay (of the host's: a store's one active sync).
    pub refused: u64,
}

/// Replays every failed job (dead letter) of `workspace` in `scope` from its first attempt, as
/// [`crate::replay_dead_letter`] does each (its operation queued again), BullMQ's `retryJobs({ state: 'failed' })`.
/// One whose de-dup key a live job holds is left failed ([`Retried::key_held`]), and so is one a unique index refuses
/// ([`Retried::refused`]). A transaction per job.
pub async fn retry_jobs(pool: &PgPool, workspace: WorkspaceId, scope: &JobScope) -> Result<Retried, sqlx::Error> {
    let mut retried = Retried::default();
    let mut after = uuid::Uuid::nil();
    loop {
        let mut tx = db::begin_workspace(pool, workspace).await?;
        let failed: Vec<uuid::Uuid> = sqlx::query_scalar(
            "SELECT id FROM conveyor.outbox_events
             WHERE status = 'dead_letter' AND id > $3
               AND ($1::text IS NULL OR queue = $1) AND ($2::text IS NULL OR event_type = $2)
             ORDER BY id LIMIT $4",
        )
        .bind(scope.queue_name())
        .bind(scope.kind_name())
        .bind(after)
        .bind(STEP)
        .fetch_all(&mut *tx)
        .await?;
        tx.commit().await?;
        for id in &failed {
            match crate::worker::dlq::replay(pool, workspace, *id).await {
                Ok(super::transitions::Replay::Replayed) => retried.replayed += 1,
                Ok(super::transitions::Replay::KeyHeld(_)) => retried.key_held += 1,
                Ok(super::transitions::Replay::NotDeadLetter) => {}
                // A unique index of the host's refused it (its operation would hold what a live one holds).
                Err(sqlx::Error::Database(d)) if d.code().as_deref() == Some("23505") => retried.refused += 1,
                Err(e) => return Err(e),
            }
        }
        match failed.last() {
            Some(last) if failed.len() as i64 == STEP => after = *last,
            _ => return Ok(retried),
        }
    }
}

/// What [`obliterate_queue`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Obliterated {
    /// Live jobs canceled: waiting ones, and with `force` those handed to workers too.
    pub canceled: u64,
    /// Jobs deleted, with their recorded failures and logs: those that had ended, and the waiting ones just canceled.
    pub deleted: u64,
    /// Jobs left because a worker may be running them: canceled ones kept for a day since their cancel (the run must
    /// find its row to roll back; a later obliterate or retention deletes them), and any handed out meanwhile.
    pub kept_running: u64,
}

/// Why [`obliterate_queue`] changed nothing.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ObliterateError {
    /// Jobs of the queue are handed to workers (running, or about to): refused without `force`.
    #[error("{0} jobs of the queue are running; obliterate with force to cancel them too")]
    Running(u64),
    /// PostgreSQL failed.
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
}

/// Empties `queue` of `workspace`'s jobs, BullMQ's `obliterate`: cancels every waiting job (as a drain does, with
/// its operation) and deletes every ended job of the queue, whatever its end (dead letters too). Refused, nothing
/// changed, while jobs of the queue are handed to workers ([`ObliterateError::Running`]), unless `force`: then they
/// are canceled too (each worker is told, and rolls its run back when the handler returns), and their rows are kept
/// for a day ([`Obliterated::kept_running`]). The check is made once, at the start: a job the relay hands over at
/// that instant, or between two steps of a large queue, runs on and is counted in `kept_running`. Commits in steps
/// of a thousand jobs; a job enqueued meanwhile may be left. Schedules, throttle keys (which may then answer a deleted
/// job's id until their period ends) and the queue's stream stay.
pub async fn obliterate_queue(
    pool: &PgPool,
    workspace: WorkspaceId,
    queue: &str,
    force: bool,
) -> Result<Obliterated, ObliterateError> {
    let mut done = Obliterated::default();
    let mut first = true;
    loop {
        let mut tx = db::begin_workspace(pool, workspace).await?;
        if first && !force {
            let running = waiting::handed_out_tx(&mut tx, queue).await?;
            if running > 0 {
                return Err(ObliterateError::Running(running));
            }
        }
        first = false;
        let step = waiting::cancel_queue_tx(&mut tx, workspace, queue, force, STEP).await?;
        tx.commit().await?;
        done.canceled += step.canceled;
        if step.found < STEP as u64 {
            break;
        }
    }
    loop {
        let mut tx = db::begin_workspace(pool, workspace).await?;
        let (found, deleted) = waiting::delete_ended_tx(&mut tx, queue, STEP).await?;
        tx.commit().await?;
        done.deleted += deleted;
        if found < STEP as u64 {
            break;
        }
    }
    let mut tx = db::begin_workspace(pool, workspace).await?;
    done.kept_running = sqlx::query_scalar::<_, i64>(
        "SELECT count(*) FROM conveyor.outbox_events WHERE queue = $1 AND status IN ('canceled', 'dispatching', 'dispatched')",
    )
    .bind(queue)
    .fetch_one(&mut *tx)
    .await? as u64;
    tx.commit().await?;
    Ok(done)
}
