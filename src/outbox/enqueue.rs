//! Enqueueing jobs inside the caller's transaction: one job, or many in one statement.

use std::time::Duration;

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::backoff::Backoff;
use crate::db::WorkspaceTx;
use crate::ids::JobId;
use crate::kind::{self, JobKind, Keep, Priority};

/// How to run one job: when, under which de-duplication key, at which priority, how often and how long. Every option
/// is optional; unset ones take the kind's defaults.
///
/// ```
/// use std::time::Duration;
/// use conveyor_jobs::{EnqueueOptions, Priority};
///
/// let options = EnqueueOptions::new()
///     .delay(Duration::from_secs(30))
///     .dedup_key("order-42")
///     .limit_key("store:7")
///     .priority(Priority::High)
///     .max_attempts(3)
///     .timeout(Duration::from_secs(10));
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EnqueueOptions {
    run_at: Option<DateTime<Utc>>,
    delay: Option<Duration>,
    expire_at: Option<DateTime<Utc>>,
    start_within: Option<Duration>,
    dedup_key: Option<String>,
    dedup_mode: DedupMode,
    limit_key: Option<String>,
    priority: Priority,
    max_attempts: Option<u32>,
    timeout: Option<Duration>,
    backoff: Option<Backoff>,
    keep_succeeded: Option<Keep>,
    keep_failed: Option<Keep>,
    operation: Option<Uuid>,
    traceparent: Option<String>,
    tracestate: Option<String>,
}

impl EnqueueOptions {
    /// No options: run as soon as committed, the kind's defaults.
    pub fn new() -> Self {
        Self::default()
    }

    /// Not before `at` (a time in the past means at once). Exclusive with [`EnqueueOptions::delay`].
    pub fn run_at(mut self, at: DateTime<Utc>) -> Self {
        self.run_at = Some(at);
        self
    }

    /// Not before `delay` after the transaction's start, by the database's clock. Exclusive with
    /// [`EnqueueOptions::run_at`].
    pub fn delay(mut self, delay: Duration) -> Self {
        self.delay = Some(delay);
        self
    }

    /// Never started after `at`: a job not started by then is canceled instead, its last error saying it expired
    /// (Faktory's expiring jobs, Hatchet's schedule timeout). A worker checks as it takes the job from its stream, by
    /// PostgreSQL's clock; a job waiting in the outbox past it (paused, held by a limit, a child waiting) is canceled
    /// by the next maintenance pass; an enqueue of its de-dup key expires it and takes the key. Its operation is
    /// canceled with it. A job that has started runs to its end, and is not started again after `at` (a retry that
    /// would come later expires, and so does a job whose worker stopped). Must be in the future and later than
    /// [`EnqueueOptions::run_at`] (by this process's clock); exclusive with [`EnqueueOptions::start_within`], a
    /// debounce, and children (a parent of a flow starts when its last child ends).
    pub fn expire_at(mut self, at: DateTime<Utc>) -> Self {
        self.expire_at = Some(at);
        self
    }

    /// Never started later than `within` after it falls due (its run-at time, its delay, or the transaction's start,
    /// by the database's clock): see [`EnqueueOptions::expire_at`]. At least 1 ms and at most ten years.
    pub fn start_within(mut self, within: Duration) -> Self {
        self.start_within = Some(within);
        self
    }

    /// At most one live (queued or running) job of this kind per key and workspace, enforced by the database: while
    /// one lives, enqueueing another with the same key returns the live job's id and writes nothing. Once it has
    /// finished (succeeded, failed, canceled), the key is free again. 1 to 256 characters.
    pub fn dedup_key(self, key: impl Into<String>) -> Self {
        self.dedup(key, DedupMode::WhileLive)
    }

    /// De-duplication by `key` (1 to 256 characters, per kind and workspace) in `mode`: while live (what
    /// [`EnqueueOptions::dedup_key`] sets), a throttle for a period, or a debounce. See [`DedupMode`].
    pub fn dedup(mut self, key: impl Into<String>, mode: DedupMode) -> Self {
        self.dedup_key = Some(key.into());
        self.dedup_mode = mode;
        self
    }

    /// The key whose limits this job obeys, per workspace (1 to 200 characters; `store:<id>`, `account:<id>`): at
    /// most the key's `max_in_flight` of its jobs are handed to workers at once ([`crate::set_key_limit`]), and none
    /// while the key is blocked by a handler's [`crate::JobError::RateLimited`]. A key without limits limits nothing;
    /// a job without a key obeys none.
    pub fn limit_key(mut self, key: impl Into<String>) -> Self {
        self.limit_key = Some(key.into());
        self
    }

    /// See [`Priority`] for what it guarantees.
    pub fn priority(mut self, priority: Priority) -> Self {
        self.priority = priority;
        self
    }

    /// Runs before the job is dead-lettered (1 to 1,000), instead of the kind's default.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = Some(attempts);
        self
    }

    /// Longest run (1 ms to 24 h), instead of the kind's default.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Back-off between runs (base and cap up to 24 h and 7 days, base not above cap), instead of the kind's default.
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = Some(backoff);
        self
    }

    /// How long the job is kept once it succeeded, instead of its kind's [`JobKind::KEEP_SUCCEEDED`] (BullMQ's
    /// `removeOnComplete`). See [`Keep`].
    pub fn keep_succeeded(mut self, keep: Keep) -> Self {
        self.keep_succeeded = Some(keep);
        self
    }

    /// How long the job is kept once it failed (a dead letter), instead of its kind's [`JobKind::KEEP_FAILED`]
    /// (BullMQ's `removeOnFail`). See [`Keep`].
    pub fn keep_failed(mut self, keep: Keep) -> Self {
        self.keep_failed = Some(keep);
        self
    }

    /// The user-visible operation this job advances: the worker moves it through `running` to its outcome, and
    /// canceling either cancels both.
    pub fn operation(mut self, operation: Uuid) -> Self {
        self.operation = Some(operation);
        self
    }

    /// W3C `traceparent` of the request that caused the job, carried to the worker.
    pub fn traceparent(mut self, traceparent: impl Into<String>) -> Self {
        self.traceparent = Some(traceparent.into());
        self
    }

    /// W3C `tracestate` that came with the `traceparent` (vendors' entries, kept as they are), carried to the worker
    /// beside it. Needs a [`EnqueueOptions::traceparent`].
    pub fn tracestate(mut self, tracestate: impl Into<String>) -> Self {
        self.tracestate = Some(tracestate.into());
        self
    }

    /// The request's whole trace context: its `traceparent` and, when it has one, its `tracestate`.
    pub fn trace(self, trace: crate::TraceContext) -> Self {
        let with_parent = self.traceparent(trace.traceparent);
        match trace.tracestate {
            Some(state) => with_parent.tracestate(state),
            None => with_parent,
        }
    }

    /// Checks every option, naming the first that is out of range.
    fn validate(&self) -> Result<(), EnqueueError> {
        let invalid = |m: &str| Err(EnqueueError::InvalidOptions(m.to_owned()));
        if self.run_at.is_some() && self.delay.is_some() {
            return invalid("run_at and delay exclude each other");
        }
        if self.delay.is_some_and(|d| d > TEN_YEARS) {
            return invalid("delay must be at most ten years");
        }
        if self.expire_at.is_some() && self.start_within.is_some() {
            return invalid("expire_at and start_within exclude each other");
        }
        if self.start_within.is_some_and(|d| d < Duration::from_millis(1) || d > TEN_YEARS) {
            return invalid("start_within must be at least 1 ms and at most ten years");
        }
        if let Some(at) = self.expire_at {
            if at <= Utc::now() {
                return invalid("expire_at is not in the future: the job could never start");
            }
            if self.run_at.is_some_and(|run_at| at <= run_at) {
                return invalid("expire_at is not later than run_at: the job could never start");
            }
            if self.delay.is_some_and(|d| chrono::Duration::from_std(d).is_ok_and(|d| at <= Utc::now() + d)) {
                return invalid("expire_at is not later than the delay's end: the job could never start");
            }
        }
        if let Some(key) = &self.dedup_key
            && (key.is_empty() || key.chars().count() > 256)
        {
            return invalid("dedup_key must be 1 to 256 characters");
        }
        match self.dedup_mode {
            DedupMode::WhileLive => {}
            DedupMode::Throttle { period } => {
                if period.is_zero() || period > TEN_YEARS {
                    return invalid("a throttle's period must be more than zero and at most ten years");
                }
            }
            DedupMode::Debounce { delay, .. } => {
                if delay > TEN_YEARS {
                    return invalid("a debounce's delay must be at most ten years");
                }
                if self.run_at.is_some() || self.delay.is_some() {
                    return invalid("a debounce sets the due time: run_at and delay exclude it");
                }
                if self.expire_at.is_some() || self.start_within.is_some() {
                    return invalid("a debounce moves the due time: expire_at and start_within exclude it");
                }
                if self.operation.is_some() {
                    return invalid(
                        "a debounce merges enqueues into one job, an operation follows one: they exclude each other",
                    );
                }
            }
        }
        if self.limit_key.as_deref().is_some_and(|key| !crate::limits::valid_key(key)) {
            return invalid("limit_key must be 1 to 200 characters");
        }
        if self.max_attempts.is_some_and(|a| !(1..=1000).contains(&a)) {
            return invalid("max_attempts must be between 1 and 1000");
        }
        if self.timeout.is_some_and(|t| t < Duration::from_millis(1) || t > Duration::from_secs(86_400)) {
            return invalid("timeout must be between 1 ms and 24 h");
        }
        if let Some(b) = self.backoff
            && (b.base > Duration::from_secs(86_400) || b.max > Duration::from_secs(7 * 86_400) || b.base > b.max)
        {
            return invalid(
                "backoff base must be at most 24 h, its cap at most 7 days, and the base not above the cap",
            );
        }
        if let Some(problem) = self.keep_succeeded.iter().chain(&self.keep_failed).find_map(Keep::invalid) {
            return invalid(problem);
        }
        if self.traceparent.as_ref().is_some_and(|t| t.len() > 128 || !t.is_ascii() || t.contains('\n')) {
            return invalid("traceparent must be ASCII, at most 128 characters, on one line");
        }
        if let Some(state) = &self.tracestate {
            if self.traceparent.is_none() {
                return invalid("tracestate needs the traceparent it came with");
            }
            if !crate::telemetry::is_valid_tracestate(state) {
                return invalid("tracestate must be printable ASCII, 1 to 512 characters");
            }
        }
        Ok(())
    }

    /// When the job is due, by this process's clock: a hint for the dispatcher's timer (it checks with the database).
    pub(super) fn due_hint(&self) -> Option<DateTime<Utc>> {
        if let DedupMode::Debounce { delay, .. } = self.dedup_mode {
            return Some(Utc::now() + chrono::Duration::from_std(delay).ok()?).filter(|_| !delay.is_zero());
        }
        match (self.run_at, self.delay) {
            (Some(at), _) if at > Utc::now() => Some(at),
            (_, Some(d)) if !d.is_zero() => Some(Utc::now() + chrono::Duration::from_std(d).ok()?),
            _ => None,
        }
    }
}

/// The longest delay, period or due time ahead an enqueue accepts.
const TEN_YEARS: Duration = Duration::from_secs(10 * 365 * 86_400);

/// How a de-duplication key ([`EnqueueOptions::dedup`]) holds, per kind and workspace. Each is decided by the database,
/// race-free however many transactions enqueue the same key at once. Use one mode per key and kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum DedupMode {
    /// At most one live (queued or running) job per key: while one lives, an enqueue answers its id and writes
    /// nothing; once it ended, the key is free.
    #[default]
    WhileLive,
    /// At most one job per key and `period` (BullMQ's `deduplication: { ttl }`): the enqueue that finds the key free
    /// writes a job and holds the key for `period` from then, even after its job ended, and for as long as its job
    /// lives if that is longer. An enqueue while the key is held answers that job's id and writes nothing.
    Throttle {
        /// How long the key stays held after the enqueue that took it.
        period: Duration,
    },
    /// One waiting job per key, due `delay` after the last enqueue (BullMQ's `deduplication: { extend, replace }`):
    /// while the key's job waits (not yet handed to a worker), an enqueue updates it instead of writing another, taking
    /// the new payload (unless [`DedupMode::keep_payload`]) and pushing its due time to `delay` from now (unless
    /// [`DedupMode::keep_due_time`]); its other options stay the first enqueue's. A job already handed to a worker is
    /// left alone: the next enqueue writes a new waiting job, and the key follows it. Excludes `run_at`, `delay` and
    /// `operation`.
    Debounce {
        /// How long after the last enqueue the job becomes due.
        delay: Duration,
        /// Whether an enqueue replaces the waiting job's payload.
        replace_payload: bool,
        /// Whether an enqueue pushes the waiting job's due time to `delay` from now.
        extend_delay: bool,
    },
}

impl DedupMode {
    /// A throttle of `period` (see [`DedupMode::Throttle`]).
    pub fn throttle(period: Duration) -> Self {
        Self::Throttle { period }
    }

    /// A debounce of `delay` that replaces the payload and pushes the due time (see [`DedupMode::Debounce`]).
    pub fn debounce(delay: Duration) -> Self {
        Self::Debounce { delay, replace_payload: true, extend_delay: true }
    }

    /// A debounce that keeps the waiting job's payload (the first enqueue's); other modes are unchanged.
    pub fn keep_payload(self) -> Self {
        match self {
            Self::Debounce { delay, extend_delay, .. } => {
                Self::Debounce { delay, replace_payload: false, extend_delay }
            }
            other => other,
        }
    }

    /// A debounce that keeps the waiting job's due time (the first enqueue's); other modes are unchanged.
    pub fn keep_due_time(self) -> Self {
        match self {
            Self::Debounce { delay, replace_payload, .. } => {
                Self::Debounce { delay, replace_payload, extend_delay: false }
            }
            other => other,
        }
    }
}

/// The job an enqueue answered with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Enqueued {
    /// The job's id (a UUIDv7): the new job's, or the live job's that holds the de-duplication key.
    pub id: JobId,
    /// False when the de-duplication key was held, so no job was written: a live job held it, a throttle's period
    /// had not ended (the id is the job that took it), or a debounce's job was waiting (the id is that job, updated).
    pub created: bool,
}

/// Why an enqueue wrote nothing.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EnqueueError {
    /// An option is out of range, or the kind's name or queue is not valid.
    #[error("invalid enqueue options: {0}")]
    InvalidOptions(String),
    /// The payload does not serialize to JSON.
    #[error("the job payload does not serialize: {0}")]
    Payload(#[from] serde_json::Error),
    /// The transaction has no workspace set: [`crate::begin`] (a service without tenants), [`crate::Conveyor::begin`]
    /// or [`crate::begin_workspace`] set one, a plain `pool.begin()` does not.
    #[error(
        "the transaction has no workspace set; begin it with conveyor_jobs::begin (no tenants), Conveyor::begin or \
         conveyor_jobs::begin_workspace, not pool.begin()"
    )]
    NoWorkspace,
    /// PostgreSQL failed; the caller's transaction is aborted.
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
}

pub(super) fn check_kind<K: JobKind>() -> Result<(), EnqueueError> {
    if !kind::valid_kind_name(K::KIND) {
        return Err(EnqueueError::InvalidOptions(format!("`{}` is not a valid kind name", K::KIND)));
    }
    if !kind::valid_queue_name(K::QUEUE) {
        return Err(EnqueueError::InvalidOptions(format!("`{}` is not a valid queue name", K::QUEUE)));
    }
    Ok(())
}

/// One job's columns, ready to bind.
pub(super) struct Row {
    pub(super) id: Uuid,
    pub(super) payload: serde_json::Value,
    pub(super) run_at: Option<DateTime<Utc>>,
    pub(super) delay_secs: f64,
    /// Its deadline, if it set one.
    pub(super) expire_at: Option<DateTime<Utc>>,
    /// How long after it falls due it may start, seconds, if it set that instead.
    pub(super) start_within_secs: Option<f64>,
    pub(super) dedup_key: Option<String>,
    pub(super) dedup_mode: DedupMode,
    pub(super) limit_key: Option<String>,
    pub(super) priority: i16,
    pub(super) max_attempts: Option<i32>,
    pub(super) timeout_ms: Option<i64>,
    pub(super) backoff_ms: Option<i64>,
    pub(super) backoff_max_ms: Option<i64>,
    pub(super) operation: Option<Uuid>,
    /// How long it is kept once it succeeded, failed: seconds and count each (`None`: the global retention).
    pub(super) keep: [Option<i32>; 4],
    /// The job's trace context as the `traceparent` column holds it ([`crate::telemetry::stored`]).
    pub(super) traceparent: Option<String>,
}

impl Row {
    /// The key the live jobs' unique index holds: a debounced job's key lives in `dedup_keys` alone.
    fn live_key(&self) -> Option<&str> {
        match self.dedup_mode {
            DedupMode::Debounce { .. } => None,
            _ => self.dedup_key.as_deref(),
        }
    }

    /// Whether a throttle or a debounce decides this job, on its key's row in `dedup_keys`.
    fn decided_by_its_key(&self) -> bool {
        self.dedup_key.is_some() && self.dedup_mode != DedupMode::WhileLive
    }

    pub(super) fn new<K: JobKind>(payload: &K, options: EnqueueOptions) -> Result<Self, EnqueueError> {
        options.validate()?;
        if let Some(problem) = [K::KEEP_SUCCEEDED, K::KEEP_FAILED].iter().find_map(Keep::invalid) {
            return Err(EnqueueError::InvalidOptions(format!("{}: {problem}", K::KIND)));
        }
        let ms = |d: Duration| i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        Ok(Self {
            id: Uuid::now_v7(),
            payload: serde_json::to_value(payload)?,
            run_at: options.run_at,
            delay_secs: match options.dedup_mode {
                DedupMode::Debounce { delay, .. } => delay,
                _ => options.delay.unwrap_or_default(),
            }
            .as_secs_f64(),
            expire_at: options.expire_at,
            start_within_secs: options.start_within.map(|d| d.as_secs_f64()),
            dedup_key: options.dedup_key,
            dedup_mode: options.dedup_mode,
            limit_key: options.limit_key,
            priority: options.priority.level(),
            max_attempts: options.max_attempts.map(|a| a as i32),
            timeout_ms: options.timeout.map(ms),
            backoff_ms: options.backoff.map(|b| ms(b.base)),
            backoff_max_ms: options.backoff.map(|b| ms(b.max)),
            operation: options.operation,
            keep: {
                let (succeeded_s, succeeded_n) = options.keep_succeeded.unwrap_or(K::KEEP_SUCCEEDED).columns();
                let (failed_s, failed_n) = options.keep_failed.unwrap_or(K::KEEP_FAILED).columns();
                [succeeded_s, succeeded_n, failed_s, failed_n]
            },
            traceparent: options
                .traceparent
                .map(|parent| crate::telemetry::stored(&parent, options.tracestate.as_deref())),
        })
    }
}

/// The notification a commit sends: the workspace (taken from the transaction), and the earliest due time of a
/// delayed job, if any, as `@<ms since the epoch>`, so that the dispatcher wakes for it.
pub(crate) fn notification_suffix(due: Option<DateTime<Utc>>) -> String {
    due.map(|d| format!("@{}", d.timestamp_millis())).unwrap_or_default()
}

pub(super) fn no_workspace(e: sqlx::Error) -> EnqueueError {
    // The row takes the transaction's workspace, so row-level security refusing it (42501), or the NOT NULL of
    // workspace_id (23502), means the transaction never set one.
    match &e {
        sqlx::Error::Database(d) if matches!(d.code().as_deref(), Some("23502" | "42501")) => EnqueueError::NoWorkspace,
        _ => EnqueueError::Database(e),
    }
}

/// Writes a job of kind `K` inside the caller's transaction, in the workspace the transaction was begun for, and tells
/// the dispatchers at commit, unless one of them is awake (relaying, it looks for new jobs every few milliseconds):
/// then the commit notifies nobody, and waits for no other commit's notification (migration 0039).
///
/// Call it in the transaction that writes the business rows the job belongs to: if that transaction rolls back, the
/// job never existed; once it commits, the job runs at least once even if this process dies the next instant. Nothing
/// is written when an option is invalid or the payload does not serialize.
///
/// ```no_run
/// # use conveyor_jobs::{JobKind, EnqueueOptions, WorkspaceId};
/// # #[derive(serde::Serialize, serde::Deserialize)] struct SendReceipt { order_id: uuid::Uuid }
/// # impl JobKind for SendReceipt { const KIND: &'static str = "orders.send_receipt"; const QUEUE: &'static str = "emails"; }
/// # async fn f(pool: sqlx::PgPool, ws: WorkspaceId, order_id: uuid::Uuid) -> Result<(), Box<dyn std::error::Error>> {
/// let mut tx = conveyor_jobs::begin_workspace(&pool, ws).await?;
/// // ... write the order with `&mut *tx` ...
/// let job = conveyor_jobs::enqueue_tx(&mut tx, &SendReceipt { order_id }, EnqueueOptions::new()).await?;
/// tx.commit().await?;
/// # Ok(()) }
/// ```
pub async fn enqueue_tx<K: JobKind>(
    tx: &mut WorkspaceTx,
    payload: &K,
    options: EnqueueOptions,
) -> Result<Enqueued, EnqueueError> {
    check_kind::<K>()?;
    let suffix = notification_suffix(options.due_hint());
    let row = Row::new(payload, options)?;
    insert::<K>(tx, &row, &suffix).await
}

/// Inserts one job by its de-duplication mode.
async fn insert<K: JobKind>(tx: &mut WorkspaceTx, row: &Row, suffix: &str) -> Result<Enqueued, EnqueueError> {
    match (row.dedup_key.as_deref(), row.dedup_mode) {
        (Some(key), DedupMode::Throttle { period }) => super::dedup::throttled::<K>(tx, row, key, period, suffix).await,
        (Some(key), DedupMode::Debounce { replace_payload, extend_delay, .. }) => {
            super::dedup::debounced::<K>(tx, row, key, replace_payload, extend_delay, suffix).await
        }
        _ => insert_row::<K>(tx, row, suffix).await,
    }
}

/// Inserts one job, or answers the live holder of its de-dup key. An operation must be a live one of this workspace
/// (a foreign key check would accept another workspace's): checked in the insert's own round trip, and looked at again
/// only when nothing was written.
pub(super) async fn insert_row<K: JobKind>(
    tx: &mut WorkspaceTx,
    row: &Row,
    suffix: &str,
) -> Result<Enqueued, EnqueueError> {
    for _ in 0..3 {
        // The notification (when one is needed) rides in the insert's round trip.
        let inserted: Option<(Uuid,)> = sqlx::query_as(
            "INSERT INTO conveyor.outbox_events (id, workspace_id, queue, event_type, event_payload, operation_id, traceparent,
                                        next_attempt_at, dedup_key, priority, max_attempts, timeout_ms, backoff_ms,
                                        backoff_max_ms, limit_key, keep_succeeded_s, keep_succeeded_n, keep_failed_s,
                                        keep_failed_n, expires_at)
             SELECT $1, conveyor.conveyor_current_workspace(), $2, $3, $4, $5, $6,
                    coalesce($7, now() + make_interval(secs => $8)), $9, $10, $11, $12, $13, $14, $16, $17, $18, $19,
                    $20,
                    coalesce($21, greatest(coalesce($7, now() + make_interval(secs => $8)), now())
                                  + make_interval(secs => $22))
             FROM conveyor.conveyor_wake_dispatchers(conveyor.conveyor_current_workspace()::text || $15) AS notified
             WHERE $5::uuid IS NULL
                OR EXISTS (SELECT 1 FROM conveyor.operations o WHERE o.id = $5 AND o.status IN ('queued', 'running'))
             ON CONFLICT (workspace_id, event_type, dedup_key)
                 WHERE dedup_key IS NOT NULL AND status IN ('pending', 'dispatching', 'dispatched')
                 DO NOTHING
             RETURNING id",
        )
        .bind(row.id)
        .bind(K::QUEUE)
        .bind(K::KIND)
        .bind(&row.payload)
        .bind(row.operation)
        .bind(&row.traceparent)
        .bind(row.run_at)
        .bind(row.delay_secs)
        .bind(row.live_key())
        .bind(row.priority)
        .bind(row.max_attempts)
        .bind(row.timeout_ms)
        .bind(row.backoff_ms)
        .bind(row.backoff_max_ms)
        .bind(suffix)
        .bind(&row.limit_key)
        .bind(row.keep[0])
        .bind(row.keep[1])
        .bind(row.keep[2])
        .bind(row.keep[3])
        .bind(row.expire_at)
        .bind(row.start_within_secs)
        .fetch_optional(&mut **tx)
        .await
        .map_err(no_workspace)?;
        if let Some((id,)) = inserted {
            return Ok(Enqueued { id: JobId(id), created: true });
        }
        if let Some(operation) = row.operation {
            check_operations(tx, &[operation]).await?;
        }
        let Some(key) = row.live_key() else {
            return Err(EnqueueError::Database(sqlx::Error::Protocol("the insert wrote nothing".into())));
        };
        match holder::<K>(tx, key).await? {
            Some((id, false)) => return Ok(Enqueued { id: JobId(id), created: false }),
            // Past its deadline, it will never run: expired here, it frees the key for this job.
            Some((id, true)) => expire_holder(tx, id).await?,
            // The holder ended between the insert and the look-up: the key is free again.
            None => {}
        }
        // Try again.
    }
    Err(EnqueueError::Database(sqlx::Error::Protocol("the de-dup key keeps changing hands; try again".into())))
}

/// The live job of kind `K` holding the de-dup key `key`, if any, and whether it waits in the outbox past its deadline.
/// A statement of its own, so that under READ COMMITTED its snapshot sees a job that committed while the insert waited
/// for it.
async fn holder<K: JobKind>(tx: &mut WorkspaceTx, key: &str) -> Result<Option<(Uuid, bool)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, coalesce(status = 'pending' AND expires_at <= now(), false) FROM conveyor.outbox_events
         WHERE workspace_id = conveyor.conveyor_current_workspace() AND event_type = $1 AND dedup_key = $2
           AND status IN ('pending', 'dispatching', 'dispatched')",
    )
    .bind(K::KIND)
    .bind(key)
    .fetch_optional(&mut **tx)
    .await
}

/// Cancels, as expired, the holder `job` of a de-dup key that waits in the outbox past its deadline: it would never
/// run, and an enqueue answered with it would be lost (maintenance would have expired it soon). A holder handed to the
/// workers is left alone, even past its deadline: it may be running.
async fn expire_holder(tx: &mut WorkspaceTx, job: Uuid) -> Result<(), sqlx::Error> {
    let workspace: Uuid =
        sqlx::query_scalar("SELECT conveyor.conveyor_current_workspace()").fetch_one(&mut **tx).await?;
    super::transitions::expire_job_tx(tx, crate::ids::WorkspaceId(workspace), job, super::transitions::EXPIRED, true)
        .await?;
    Ok(())
}

/// Refuses operations that are not live operations of the transaction's workspace.
pub(super) async fn check_operations(tx: &mut WorkspaceTx, operations: &[Uuid]) -> Result<(), EnqueueError> {
    let live: Vec<Uuid> =
        sqlx::query_scalar("SELECT id FROM conveyor.operations WHERE id = ANY($1) AND status IN ('queued', 'running')")
            .bind(operations)
            .fetch_all(&mut **tx)
            .await?;
    match operations.iter().find(|o| !live.contains(o)) {
        Some(o) => {
            Err(EnqueueError::InvalidOptions(format!("operation {o} is not a live operation of this workspace")))
        }
        None => Ok(()),
    }
}

/// Writes many jobs of kind `K` in one statement (thousands per round trip), inside the caller's transaction: they
/// commit or roll back with it, together. A call with a throttled or debounced job ([`DedupMode`]) writes its jobs one
/// statement each, in order. Answers in the order given; a job whose de-duplication key a live job holds
/// (or an earlier job of the same call) answers that job's id with `created: false`. Nothing is written when any
/// option is invalid or any payload does not serialize.
pub async fn enqueue_many_tx<'a, K: JobKind>(
    tx: &mut WorkspaceTx,
    jobs: impl IntoIterator<Item = (&'a K, EnqueueOptions)>,
) -> Result<Vec<Enqueued>, EnqueueError> {
    check_kind::<K>()?;
    let mut due: Option<DateTime<Utc>> = None;
    let mut rows = Vec::new();
    for (payload, options) in jobs {
        if let Some(hint) = options.due_hint() {
            due = Some(due.map_or(hint, |d| d.min(hint)));
        }
        rows.push(Row::new(payload, options)?);
    }
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    if rows.iter().any(Row::decided_by_its_key) {
        // A throttle or a debounce decides on its key's row, one job after the other: in the order of their keys and
        // modes (so that two calls lock the rows of their keys in one order, never waiting for each other in a
        // circle), each key's jobs in the order given. Answered in the order given.
        let suffix = notification_suffix(due);
        let mut order: Vec<usize> = (0..rows.len()).collect();
        let lock_order = |i: usize| {
            let mode = match rows[i].dedup_mode {
                DedupMode::Throttle { .. } => 0,
                DedupMode::Debounce { .. } => 1,
                DedupMode::WhileLive => 2,
            };
            (rows[i].dedup_key.as_deref(), mode, i)
        };
        order.sort_by_key(|&i| lock_order(i));
        let mut answers = vec![None; rows.len()];
        for i in order {
            answers[i] = Some(insert::<K>(tx, &rows[i], &suffix).await?);
        }
        return Ok(answers.into_iter().map(|a| a.expect("every job was answered")).collect());
    }
    let mut operations: Vec<Uuid> = rows.iter().filter_map(|r| r.operation).collect();
    operations.sort();
    operations.dedup();
    if !operations.is_empty() {
        check_operations(tx, &operations).await?;
    }
    fn column<T>(rows: &[Row], f: impl Fn(&Row) -> T) -> Vec<T> {
        rows.iter().map(f).collect()
    }
    let ids: Vec<Uuid> = column(&rows, |r| r.id);
    let inserted: Vec<(Uuid,)> = sqlx::query_as(
        "INSERT INTO conveyor.outbox_events (id, workspace_id, queue, event_type, event_payload, operation_id, traceparent,
                                    next_attempt_at, dedup_key, priority, max_attempts, timeout_ms, backoff_ms,
                                    backoff_max_ms, limit_key, keep_succeeded_s, keep_succeeded_n, keep_failed_s,
                                    keep_failed_n, expires_at)
         SELECT v.id, conveyor.conveyor_current_workspace(), $1, $2, v.payload, v.operation_id, v.traceparent,
                coalesce(v.run_at, now() + make_interval(secs => v.delay)), v.dedup_key, v.priority, v.max_attempts,
                v.timeout_ms, v.backoff_ms, v.backoff_max_ms, v.limit_key, v.keep_succeeded_s, v.keep_succeeded_n,
                v.keep_failed_s, v.keep_failed_n,
                coalesce(v.expire_at, greatest(coalesce(v.run_at, now() + make_interval(secs => v.delay)), now())
                                      + make_interval(secs => v.start_within))
         FROM conveyor.conveyor_wake_dispatchers(conveyor.conveyor_current_workspace()::text || $3) AS notified
         CROSS JOIN unnest($4::uuid[], $5::jsonb[], $6::uuid[], $7::text[], $8::timestamptz[], $9::float8[],
                           $10::text[], $11::int2[], $12::int4[], $13::int8[], $14::int8[], $15::int8[], $16::text[],
                           $17::int4[], $18::int4[], $19::int4[], $20::int4[], $21::timestamptz[], $22::float8[])
                    WITH ORDINALITY AS v(id, payload, operation_id, traceparent, run_at, delay, dedup_key, priority,
                                         max_attempts, timeout_ms, backoff_ms, backoff_max_ms, limit_key,
                                         keep_succeeded_s, keep_succeeded_n, keep_failed_s, keep_failed_n, expire_at,
                                         start_within, n)
         ORDER BY v.n
         ON CONFLICT (workspace_id, event_type, dedup_key)
             WHERE dedup_key IS NOT NULL AND status IN ('pending', 'dispatching', 'dispatched')
             DO NOTHING
         RETURNING id",
    )
    .bind(K::QUEUE)
    .bind(K::KIND)
    .bind(notification_suffix(due))
    .bind(&ids)
    .bind(column(&rows, |r| r.payload.clone()))
    .bind(column(&rows, |r| r.operation))
    .bind(column(&rows, |r| r.traceparent.clone()))
    .bind(column(&rows, |r| r.run_at))
    .bind(column(&rows, |r| r.delay_secs))
    .bind(column(&rows, |r| r.dedup_key.clone()))
    .bind(column(&rows, |r| r.priority))
    .bind(column(&rows, |r| r.max_attempts))
    .bind(column(&rows, |r| r.timeout_ms))
    .bind(column(&rows, |r| r.backoff_ms))
    .bind(column(&rows, |r| r.backoff_max_ms))
    .bind(column(&rows, |r| r.limit_key.clone()))
    .bind(column(&rows, |r| r.keep[0]))
    .bind(column(&rows, |r| r.keep[1]))
    .bind(column(&rows, |r| r.keep[2]))
    .bind(column(&rows, |r| r.keep[3]))
    .bind(column(&rows, |r| r.expire_at))
    .bind(column(&rows, |r| r.start_within_secs))
    .fetch_all(&mut **tx)
    .await
    .map_err(no_workspace)?;
    if inserted.len() == rows.len() {
        return Ok(ids.into_iter().map(|id| Enqueued { id: JobId(id), created: true }).collect());
    }
    // Some keys were held: look up the live holder of each key that was not inserted.
    let created: std::collections::HashSet<Uuid> = inserted.into_iter().map(|(id,)| id).collect();
    let held: Vec<String> =
        rows.iter().filter(|r| !created.contains(&r.id)).filter_map(|r| r.dedup_key.clone()).collect();
    let holders: Vec<(String, Uuid, bool)> = sqlx::query_as(
        "SELECT dedup_key, id, coalesce(status = 'pending' AND expires_at <= now(), false) FROM conveyor.outbox_events
         WHERE workspace_id = conveyor.conveyor_current_workspace() AND event_type = $1 AND dedup_key = ANY($2)
           AND status IN ('pending', 'dispatching', 'dispatched')
         ORDER BY id",
    )
    .bind(K::KIND)
    .bind(&held)
    .fetch_all(&mut **tx)
    .await?;
    let mut live = std::collections::HashMap::new();
    for (key, id, expired) in holders {
        if expired {
            // Past its deadline: expired, its key goes to this call's job (inserted one at a time below).
            expire_holder(tx, id).await?;
        } else {
            live.insert(key, id);
        }
    }
    let holders = live;
    let mut answers = Vec::with_capacity(rows.len());
    for r in &rows {
        if created.contains(&r.id) {
            answers.push(Enqueued { id: JobId(r.id), created: true });
            continue;
        }
        match r.dedup_key.as_deref().and_then(|key| holders.get(key)) {
            Some(id) => answers.push(Enqueued { id: JobId(*id), created: false }),
            // The holder ended between the insert and the look-up: the key is free again.
            None => answers.push(insert_row::<K>(tx, r, "").await?),
        }
    }
    Ok(answers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_range_options_are_refused_by_name() {
        let refused = |o: EnqueueOptions| o.validate().unwrap_err().to_string();
        assert!(refused(EnqueueOptions::new().max_attempts(0)).contains("max_attempts"));
        assert!(refused(EnqueueOptions::new().timeout(Duration::ZERO)).contains("timeout"));
        assert!(refused(EnqueueOptions::new().dedup_key("")).contains("dedup_key"));
        assert!(refused(EnqueueOptions::new().dedup_key("k".repeat(257))).contains("dedup_key"));
        assert!(refused(EnqueueOptions::new().limit_key("")).contains("limit_key"));
        assert!(refused(EnqueueOptions::new().limit_key("k".repeat(201))).contains("limit_key"));
        assert!(EnqueueOptions::new().limit_key("é".repeat(200)).validate().is_ok());
        assert!(refused(EnqueueOptions::new().run_at(Utc::now()).delay(Duration::from_secs(1))).contains("run_at"));
        let inverted = Backoff { base: Duration::from_secs(10), max: Duration::from_secs(1) };
        assert!(refused(EnqueueOptions::new().backoff(inverted)).contains("backoff"));
        assert!(
            EnqueueOptions::new().max_attempts(1).dedup_key("k").timeout(Duration::from_millis(1)).validate().is_ok()
        );
    }

    #[test]
    fn a_deadline_the_job_could_never_start_by_is_refused() {
        let refused = |o: EnqueueOptions| o.validate().unwrap_err().to_string();
        let soon = Utc::now() + chrono::Duration::seconds(60);
        let past = Utc::now() - chrono::Duration::seconds(1);
        assert!(refused(EnqueueOptions::new().expire_at(past)).contains("not in the future"));
        assert!(refused(EnqueueOptions::new().expire_at(soon).run_at(soon)).contains("not later than run_at"));
        let later = EnqueueOptions::new().expire_at(soon).delay(Duration::from_secs(120));
        assert!(refused(later).contains("delay"));
        let both = EnqueueOptions::new().expire_at(soon).start_within(Duration::from_secs(1));
        assert!(refused(both).contains("exclude each other"));
        assert!(refused(EnqueueOptions::new().start_within(Duration::ZERO)).contains("start_within"));
        assert!(refused(EnqueueOptions::new().start_within(Duration::from_micros(999))).contains("1 ms"));
        assert!(refused(EnqueueOptions::new().start_within(TEN_YEARS * 2)).contains("start_within"));
        let debounced = EnqueueOptions::new().dedup("k", DedupMode::debounce(Duration::from_secs(1)));
        assert!(refused(debounced.start_within(Duration::from_secs(5))).contains("debounce"));
        // A deadline after a delayed start, or after a due time, is fine.
        assert!(EnqueueOptions::new().expire_at(soon).delay(Duration::from_secs(30)).validate().is_ok());
        assert!(EnqueueOptions::new().expire_at(soon).run_at(Utc::now()).validate().is_ok());
        assert!(EnqueueOptions::new().start_within(Duration::from_millis(1)).run_at(past).validate().is_ok());
    }

    #[test]
    fn a_keep_out_of_range_is_refused_by_name_and_stored_in_whole_seconds() {
        let refused = |o: EnqueueOptions| o.validate().unwrap_err().to_string();
        assert!(refused(EnqueueOptions::new().keep_succeeded(Keep::for_age(TEN_YEARS * 2))).contains("kept age"));
        assert!(refused(EnqueueOptions::new().keep_failed(Keep::last(1_000_001))).contains("kept count"));
        assert!(EnqueueOptions::new().keep_failed(Keep::none().and_last(0)).validate().is_ok());
        assert_eq!(Keep::for_age(Duration::from_millis(1500)).and_last(3).columns(), (Some(2), Some(3)));
        assert_eq!(Keep::none().columns(), (Some(0), None));
        assert_eq!(Keep::GLOBAL.columns(), (None, None));
    }

    #[test]
    fn a_throttle_needs_a_period_and_a_debounce_owns_the_due_time_and_takes_no_operation() {
        let refused = |o: EnqueueOptions| o.validate().unwrap_err().to_string();
        let debounce = DedupMode::debounce(Duration::from_secs(5));
        assert!(refused(EnqueueOptions::new().dedup("k", DedupMode::throttle(Duration::ZERO))).contains("period"));
        assert!(refused(EnqueueOptions::new().dedup("k", DedupMode::throttle(TEN_YEARS * 2))).contains("period"));
        assert!(refused(EnqueueOptions::new().dedup("", debounce)).contains("dedup_key"));
        assert!(refused(EnqueueOptions::new().dedup("k", debounce).delay(Duration::from_secs(1))).contains("due time"));
        assert!(refused(EnqueueOptions::new().dedup("k", debounce).run_at(Utc::now())).contains("due time"));
        assert!(refused(EnqueueOptions::new().dedup("k", debounce).operation(Uuid::nil())).contains("operation"));
        assert!(EnqueueOptions::new().dedup("k", debounce.keep_payload().keep_due_time()).validate().is_ok());
        assert_eq!(
            debounce.keep_payload(),
            DedupMode::Debounce { delay: Duration::from_secs(5), replace_payload: false, extend_delay: true }
        );
        assert_eq!(
            DedupMode::throttle(Duration::from_secs(1)).keep_payload(),
            DedupMode::throttle(Duration::from_secs(1))
        );
        // A debounce's delay hints the dispatcher as a delay does.
        assert!(EnqueueOptions::new().dedup("k", debounce).due_hint().is_some());
        assert!(EnqueueOptions::new().dedup("k", DedupMode::debounce(Duration::ZERO)).due_hint().is_none());
    }

    #[test]
    fn only_a_job_due_later_hints_the_dispatcher() {
        assert_eq!(EnqueueOptions::new().due_hint(), None);
        assert_eq!(EnqueueOptions::new().delay(Duration::ZERO).due_hint(), None);
        assert_eq!(EnqueueOptions::new().run_at(Utc::now() - chrono::Duration::seconds(5)).due_hint(), None);
        let later = Utc::now() + chrono::Duration::seconds(5);
        assert_eq!(EnqueueOptions::new().run_at(later).due_hint(), Some(later));
        assert_eq!(notification_suffix(Some(later)), format!("@{}", later.timestamp_millis()));
    }
}
