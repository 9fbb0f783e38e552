//! What a job handler implements, and what it gets: the decoded payload and a [`JobContext`] (the job's workspace
//! transaction, progress, cancellation, attempt, id).

use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::backoff::Backoff;
use crate::db::WorkspaceTx;
use crate::ids::{JobId, WorkspaceId};
use crate::kind::JobKind;
use crate::outbox::transitions;

/// A boxed future borrowing for `'a`.
pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Why a handler failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum JobError {
    /// Worth retrying with back-off (an unavailable dependency, a time-out).
    #[error("{0}")]
    Retryable(String),
    /// Worth retrying, but not before `after` (a `429` or `503` with `Retry-After`): the next run waits for the longer
    /// of `after` and the kind's back-off. Counts as an attempt like [`JobError::Retryable`].
    #[error("{reason} (retry after {after:?})")]
    RetryAfter {
        /// What failed.
        reason: String,
        /// The earliest sensible retry, from now.
        after: std::time::Duration,
    },
    /// The job's key (its [`crate::EnqueueOptions::limit_key`]) is rate limited until `until` (a `429` whose
    /// `Retry-After` speaks for the whole account, a quota that resets at a known time): the job goes back to the
    /// outbox due at `until` **without spending an attempt**, and none of the key's jobs is handed to workers before
    /// then (jobs of other keys go on; those already in the workers' hands run, and may answer the same). A job without
    /// a key just waits until `until`, without spending an attempt. Unlike [`JobError::RetryAfter`], which is a failure
    /// of this job (it spends an attempt, and only this job waits), this says the job could not do its work yet (its
    /// transaction rolls back): a handler that always answers it never dead-letters.
    #[error("rate limited until {until}: {reason}")]
    RateLimited {
        /// Why (stored as the job's last error and the key's block reason).
        reason: String,
        /// Not before this time.
        until: DateTime<Utc>,
    },
    /// Retrying cannot help: dead-letter at once.
    #[error("{0}")]
    Permanent(String),
    /// The job was canceled ([`JobContext::progress`] says so); the handler stopped.
    #[error("the job was canceled")]
    Canceled,
}

impl JobError {
    /// A failure worth retrying, from anything printable.
    pub fn retryable(e: impl std::fmt::Display) -> Self {
        Self::Retryable(e.to_string())
    }

    /// A failure worth retrying no sooner than `after` from now, from anything printable.
    pub fn retry_after(e: impl std::fmt::Display, after: std::time::Duration) -> Self {
        Self::RetryAfter { reason: e.to_string(), after }
    }

    /// The job's key is rate limited until `until` (see [`JobError::RateLimited`]), from anything printable.
    pub fn rate_limited(reason: impl std::fmt::Display, until: DateTime<Utc>) -> Self {
        Self::RateLimited { reason: reason.to_string(), until }
    }

    /// A failure retrying cannot fix, from anything printable.
    pub fn permanent(e: impl std::fmt::Display) -> Self {
        Self::Permanent(e.to_string())
    }
}

impl From<sqlx::Error> for JobError {
    /// Worth retrying. The error's own text (constraint, table and trigger names, values) goes to the log only: what a
    /// job fails with is stored on its operation, which clients read.
    fn from(e: sqlx::Error) -> Self {
        tracing::warn!(error = %crate::redact::redact(&e.to_string()), "A job's database statement failed");
        Self::Retryable("the database could not run a statement of the job".into())
    }
}

/// Where a [`JobContext`] opens its transaction and records progress.
pub(crate) enum Backing {
    /// A worker's run: the transaction opens on `pool`; progress goes through `control`, connections of their own, so
    /// that jobs holding every connection of `pool` cannot starve it.
    Pools { pool: PgPool, control: PgPool, announce: bool },
    /// A test's run ([`crate::testing::work`]): the transaction is the test's, progress is noted here.
    #[cfg(feature = "testing")]
    Test { progress: std::sync::Mutex<Vec<serde_json::Value>>, logs: std::sync::Mutex<Vec<String>> },
}

/// What a running job knows about itself, and its way to PostgreSQL.
pub struct JobContext {
    pub(crate) id: JobId,
    pub(crate) workspace: WorkspaceId,
    pub(crate) operation: Option<Uuid>,
    pub(crate) attempt: u32,
    pub(crate) max_attempts: u32,
    pub(crate) traceparent: String,
    pub(crate) tracestate: Option<String>,
    pub(crate) enqueued_at: Option<DateTime<Utc>>,
    pub(crate) cancel: CancellationToken,
    pub(crate) tx: Option<WorkspaceTx>,
    pub(crate) backing: Backing,
    /// Set when [`JobContext::tx`] found, once it held the job's lock, that the job had ended meanwhile (another
    /// delivery ran it): the run is skipped.
    pub(crate) ended: bool,
    /// Set when [`JobContext::tx`] found that the job's operation had ended: the run is skipped.
    pub(crate) operation_ended: bool,
    /// With `ended`: the end found was a cancel, so this delivery ends as canceled, not skipped.
    pub(crate) ended_canceled: bool,
}

impl JobContext {
    /// How a delivery that found its job already ended ends: canceled when the end was a cancel, else skipped.
    pub(crate) fn ended_outcome(&self) -> super::Outcome {
        if self.ended_canceled { super::Outcome::Canceled } else { super::Outcome::Skipped }
    }

    /// The job's id (its outbox event's id).
    pub fn id(&self) -> JobId {
        self.id
    }

    /// Its workspace: [`JobContext::tx`] is scoped to it.
    pub fn workspace_id(&self) -> WorkspaceId {
        self.workspace
    }

    /// The user-visible operation it advances, if any.
    pub fn operation_id(&self) -> Option<Uuid> {
        self.operation
    }

    /// This run's number: 1 on the first run.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// Runs it gets before it is dead-lettered.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// The token to pass to external systems as their idempotency key, so that however often the job runs they act
    /// once: the operation id when there is one, else the job id.
    pub fn idempotency_token(&self) -> String {
        self.operation.unwrap_or(self.id.0).to_string()
    }

    /// W3C `traceparent` of the request that caused the job (the dispatcher's hand-off span's, while traces are
    /// exported).
    pub fn traceparent(&self) -> &str {
        &self.traceparent
    }

    /// The W3C `tracestate` that came with [`JobContext::traceparent`], if any.
    pub fn tracestate(&self) -> Option<&str> {
        self.tracestate.as_deref()
    }

    /// Both, to enqueue follow-up jobs in the same trace ([`crate::EnqueueOptions::trace`]).
    pub fn trace(&self) -> crate::TraceContext {
        crate::TraceContext { traceparent: self.traceparent.clone(), tracestate: self.tracestate.clone() }
    }

    /// When the job was committed, if its entry says.
    pub fn enqueued_at(&self) -> Option<DateTime<Utc>> {
        self.enqueued_at
    }

    /// Cancelled when the job is canceled, when it times out, and when the worker stops past its grace period.
    /// A long handler should `select!` on it, or check [`JobContext::is_canceled`] between steps.
    pub fn cancellation(&self) -> &CancellationToken {
        &self.cancel
    }

    /// Whether [`JobContext::cancellation`] has fired.
    pub fn is_canceled(&self) -> bool {
        self.cancel.is_cancelled()
    }

    /// The workspace transaction the job's effects are written in, opened on first use (a job that never touches
    /// PostgreSQL never pays for one). It holds the job's lock, so two deliveries of one job never run their
    /// transactions at once, and a delivery that waited for another's learns here that the job has ended: then it
    /// answers an error, and the runtime skips the run whatever the handler returns. The runtime commits the
    /// transaction with the job's outcome (and its operation's), then acknowledges the entry; if the handler fails or
    /// the job is canceled, it rolls back.
    pub async fn tx(&mut self) -> Result<&mut WorkspaceTx, sqlx::Error> {
        if self.tx.is_none() {
            let pool = match &self.backing {
                Backing::Pools { pool, .. } => pool,
                #[cfg(feature = "testing")]
                Backing::Test { .. } => {
                    return Err(sqlx::Error::Protocol("the test's transaction has been taken".into()));
                }
            };
            let mut tx = crate::db::begin_workspace(pool, self.workspace).await?;
            transitions::lock_job_tx(&mut tx, self.id.0).await?;
            let state = transitions::job_state_tx(&mut tx, self.id.0, self.operation).await?;
            self.operation_ended = self.operation.is_some() && state.operation_ended;
            if !state.live {
                self.ended = true;
                self.ended_canceled = state.canceled;
                tx.rollback().await?;
                return Err(sqlx::Error::Protocol("the job has already ended; this delivery is skipped".into()));
            }
            self.tx = Some(tx);
        }
        Ok(self.tx.as_mut().expect("just opened"))
    }

    /// Records progress, visible at once (outside the job's transaction): on the operation when the job has one,
    /// else on the job, and as a `progress` event for [`crate::subscribe_events`]. Answers [`JobError::Canceled`] once
    /// the job has been canceled: return it to stop.
    pub async fn progress(&self, progress: serde_json::Value) -> Result<(), JobError> {
        let live = match &self.backing {
            Backing::Pools { control, announce, .. } => {
                let (ws, job, op) = (self.workspace, self.id.0, self.operation);
                transitions::progress(control, ws, job, op, self.attempt, &progress, *announce).await?
            }
            #[cfg(feature = "testing")]
            Backing::Test { progress: noted, .. } => {
                noted.lock().expect("progress lock").push(progress);
                true
            }
        };
        if !live || self.is_canceled() {
            return Err(JobError::Canceled);
        }
        Ok(())
    }

    /// The children of this job, a parent of a flow ([`crate::Flow`]), each with how it ended: its status, its result
    /// (BullMQ's `getChildrenValues`), its last error; in the order they were created. Empty for a job without
    /// children. A child that failed under [`crate::ChildFailure::Remove`] is not among them; under
    /// [`crate::ChildFailure::Ignore`] it is, [`crate::JobStatus::Failed`] or [`crate::JobStatus::Canceled`].
    /// Read outside the job's transaction (in it, in a test's run).
    pub async fn children(&mut self) -> Result<Vec<crate::JobInfo>, sqlx::Error> {
        match &self.backing {
            Backing::Pools { control, .. } => crate::get_children(control, self.workspace, self.id).await,
            #[cfg(feature = "testing")]
            Backing::Test { .. } => {
                let id = self.id;
                let tx =
                    self.tx.as_mut().ok_or_else(|| sqlx::Error::Protocol("the test's transaction is gone".into()))?;
                crate::outbox::control::children_tx(tx, id).await
            }
        }
    }

    /// Appends `line` to the job's log, visible at once, outside the job's transaction, so that a failed run's lines
    /// stay: [`crate::get_job_logs`], the admin API, the UI and `conveyor jobs show` read it, each line with the run
    /// that wrote it. Redacted as errors are (credentials in URLs and after `password=`-like words removed, cut at 500
    /// characters). A job keeps at most 100 lines and 64 KiB across its runs; later lines are dropped. A log line is a
    /// round trip to PostgreSQL: write a few per run, not one per item of a loop. Best effort: a line PostgreSQL could
    /// not take is logged as a warning of the worker's, and the job runs on.
    pub async fn log(&self, line: impl AsRef<str>) {
        let line = crate::redact(line.as_ref());
        match &self.backing {
            Backing::Pools { control, .. } => {
                match transitions::append_log(control, self.workspace, self.id.0, self.attempt, &line).await {
                    Ok(true) => {}
                    Ok(false) => tracing::debug!(job = %self.id.0, "The job's log is full; a line was dropped"),
                    Err(e) => tracing::warn!(job = %self.id.0, error = %e, "Could not append a line to the job's log"),
                }
            }
            #[cfg(feature = "testing")]
            Backing::Test { logs, .. } => {
                let mut logs = logs.lock().expect("logs lock");
                // The same bound as the table's, so that a test sees what a worker would keep.
                let bytes: usize = logs.iter().map(String::len).sum();
                if (logs.len() as i64) < transitions::LOG_LINES && (bytes + line.len()) as i64 <= transitions::LOG_BYTES
                {
                    logs.push(line);
                }
            }
        }
    }
}

/// Runs jobs of kind `K`. Delivery is at least once, so a handler must be re-entrant: the runtime already skips
/// jobs that ended, lets one delivery of a job at a time hold [`JobContext::tx`] (and commits it with the outcome), and
/// external systems get [`JobContext::idempotency_token`].
///
/// ```
/// use conveyor_jobs::{Handler, JobContext, JobError, JobKind};
/// # #[derive(serde::Serialize, serde::Deserialize)] struct SendReceipt { order_id: uuid::Uuid }
/// # impl JobKind for SendReceipt { const KIND: &'static str = "orders.send_receipt"; const QUEUE: &'static str = "emails"; }
///
/// struct Receipts;
///
/// impl Handler<SendReceipt> for Receipts {
///     async fn handle(&self, job: SendReceipt, cx: &mut JobContext) -> Result<serde_json::Value, JobError> {
///         sqlx::query("UPDATE orders SET receipt_sent = true WHERE id = $1")
///             .bind(job.order_id)
///             .execute(&mut **cx.tx().await?)
///             .await?;
///         Ok(serde_json::json!({ "sent": true }))
///     }
/// }
/// ```
pub trait Handler<K: JobKind>: Send + Sync + 'static {
    /// Runs one job; the value becomes its result (and its operation's).
    fn handle(&self, job: K, cx: &mut JobContext) -> impl Future<Output = Result<serde_json::Value, JobError>> + Send;

    /// Runs before dead-lettering, for jobs that did not set their own (default: the kind's).
    fn max_attempts(&self) -> u32 {
        K::MAX_ATTEMPTS
    }

    /// Longest run, for jobs that did not set their own (default: the kind's).
    fn timeout(&self) -> Duration {
        K::TIMEOUT
    }

    /// Back-off between runs, for jobs that did not set their own (default: the kind's).
    fn backoff(&self) -> Backoff {
        K::BACKOFF
    }
}

/// A registered handler with its kind erased: what the runtime holds, by kind name.
pub(crate) trait Registered: Send + Sync {
    fn kind(&self) -> &'static str;
    fn queue(&self) -> &'static str;
    fn max_attempts(&self) -> u32;
    fn timeout(&self) -> Duration;
    fn backoff(&self) -> Backoff;
    /// Decodes `payload` and starts the handler on it; an error when the payload does not decode.
    fn run<'a>(
        &'a self,
        payload: &str,
        cx: &'a mut JobContext,
    ) -> Result<BoxFuture<'a, Result<serde_json::Value, JobError>>, serde_json::Error>;
}

/// A handler of `K`.
pub(crate) struct Typed<K, H> {
    pub(crate) handler: H,
    pub(crate) kind: PhantomData<fn() -> K>,
}

impl<K: JobKind, H: Handler<K>> Registered for Typed<K, H> {
    fn kind(&self) -> &'static str {
        K::KIND
    }

    fn queue(&self) -> &'static str {
        K::QUEUE
    }

    fn max_attempts(&self) -> u32 {
        self.handler.max_attempts()
    }

    fn timeout(&self) -> Duration {
        self.handler.timeout()
    }

    fn backoff(&self) -> Backoff {
        self.handler.backoff()
    }

    fn run<'a>(
        &'a self,
        payload: &str,
        cx: &'a mut JobContext,
    ) -> Result<BoxFuture<'a, Result<serde_json::Value, JobError>>, serde_json::Error> {
        let job: K = serde_json::from_str(payload)?;
        Ok(Box::pin(self.handler.handle(job, cx)))
    }
}
