//! Jobs in a service's own tests (feature `testing`): run one job through its handler in the test's transaction,
//! without Redis ([`work`]); read what a transaction enqueued ([`enqueued`]); or relay what is due and run it to the
//! end, step by step, without background tasks and without sleeping ([`drain`]).
//!
//! ```no_run
//! # async fn f(dispatcher: conveyor_jobs::Dispatcher, worker: conveyor_jobs::Worker) -> anyhow::Result<()> {
//! // ... enqueue jobs in a transaction and commit it ...
//! let outcomes = conveyor_jobs::testing::drain(&dispatcher, &worker).await?;
//! assert!(outcomes.iter().all(|o| *o == conveyor_jobs::Outcome::Succeeded));
//! # Ok(()) }
//! ```

use std::panic::AssertUnwindSafe;

use futures_util::FutureExt;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::WorkspaceTx;
use crate::dispatcher::{DispatchOutcome, Dispatcher};
use crate::ids::{JobId, WorkspaceId};
use crate::kind::JobKind;
use crate::worker::handler::Backing;
use crate::worker::{Handler, JobContext, JobError, Outcome, Worker};

/// Relays every job that is due and runs each with `worker` ([`Worker::process_one`]) until nothing is due and its
/// queues are empty, retries that fall due meanwhile included; returns every run's outcome. Jobs due later (a delay,
/// a back-off still running) are left; so are jobs of queues `worker` does not consume.
pub async fn drain(dispatcher: &Dispatcher, worker: &Worker) -> Result<Vec<Outcome>, crate::Error> {
    let mut outcomes = Vec::new();
    loop {
        let relayed = dispatcher.dispatch_once().await?;
        let before = outcomes.len();
        while let Some(outcome) = worker.process_one().await? {
            outcomes.push(outcome);
        }
        if relayed == DispatchOutcome::Idle && outcomes.len() == before {
            return Ok(outcomes);
        }
    }
}

/// One job run by [`work`]: what the handler answered, what the worker would make of it, and the test's transaction
/// with the handler's writes in it (uncommitted: assert on them, then drop it to roll back).
#[non_exhaustive]
pub struct Worked {
    /// What the handler answered.
    pub result: Result<serde_json::Value, JobError>,
    /// What a worker would record for it: [`Outcome::Succeeded`], [`Outcome::Retried`] (a retryable error, a panic
    /// or a time-out before the last attempt, or a rate limit) or [`Outcome::DeadLettered`] (a permanent error, or a
    /// retryable one at the last attempt).
    pub outcome: Outcome,
    /// The progress it recorded ([`JobContext::progress`]), in order.
    pub progress: Vec<serde_json::Value>,
    /// The lines it logged ([`JobContext::log`]), redacted, in order.
    pub logs: Vec<String>,
    /// The test's transaction, with whatever the handler wrote in [`JobContext::tx`] when it succeeded (a failed run's
    /// writes are undone, as a worker's are).
    pub tx: WorkspaceTx,
}

/// Runs `job` through `handler` as its first attempt, in the caller's transaction `tx`: no dispatcher, no Redis, no
/// outbox row. The payload goes through JSON first, as a real job's does. See [`work_attempt`].
///
/// ```no_run
/// # use conveyor_jobs::{Handler, JobContext, JobError, JobKind, Outcome};
/// # #[derive(serde::Serialize, serde::Deserialize)] struct SendReceipt { order_id: uuid::Uuid }
/// # impl JobKind for SendReceipt { const KIND: &'static str = "orders.send_receipt"; const QUEUE: &'static str = "emails"; }
/// # struct Receipts;
/// # impl Handler<SendReceipt> for Receipts {
/// #     async fn handle(&self, _: SendReceipt, _: &mut JobContext) -> Result<serde_json::Value, JobError> { Ok(().into()) }
/// # }
/// # async fn f(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let tx = conveyor_jobs::begin(&pool).await?;
/// let worked = conveyor_jobs::testing::work(&Receipts, tx, SendReceipt { order_id: uuid::Uuid::new_v4() }).await;
/// assert_eq!(worked.outcome, Outcome::Succeeded);
/// # Ok(()) }
/// ```
pub async fn work<K: JobKind>(handler: &impl Handler<K>, tx: WorkspaceTx, job: K) -> Worked {
    work_attempt(handler, tx, job, 1).await
}

/// [`work`] as attempt number `attempt` (from 1; 0 counts as 1) of the handler's [`Handler::max_attempts`]: for the
/// outcome of a failure at the last attempt, or a handler that reads [`JobContext::attempt`].
///
/// As a worker does, it runs the handler within [`Handler::timeout`], counts a panic or a time-out as a retryable
/// failure, and undoes the handler's writes when it fails (a savepoint of the test's transaction, rolled back to).
/// Nothing cancels a job here, so a handler that answers [`JobError::Canceled`] fails like any other: so it does in a
/// worker when nobody canceled its job. A job's own `max_attempts` ([`crate::EnqueueOptions::max_attempts`]) is not
/// known here; the handler's is used.
///
/// # Panics
///
/// When the test's transaction cannot run a statement (Conveyor's schema not applied, the transaction aborted).
pub async fn work_attempt<K: JobKind>(handler: &impl Handler<K>, mut tx: WorkspaceTx, job: K, attempt: u32) -> Worked {
    // The workspace the test's transaction is in (begin / begin_workspace set it), and a savepoint the handler's
    // writes are undone to if it fails.
    let workspace = sqlx::query_scalar::<_, Option<Uuid>>("SELECT conveyor.conveyor_current_workspace()")
        .fetch_one(&mut *tx)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "testing::work: the test's transaction cannot read its workspace ({e}): is Conveyor's schema applied?"
            )
        })
        .map_or(WorkspaceId::DEFAULT, WorkspaceId);
    sqlx::query("SAVEPOINT conveyor_testing_work").execute(&mut *tx).await.expect("testing::work: a savepoint");
    let attempt = attempt.max(1);
    let max_attempts = handler.max_attempts();
    let mut cx = JobContext {
        id: JobId(Uuid::now_v7()),
        workspace,
        operation: None,
        attempt,
        max_attempts,
        traceparent: crate::telemetry::new_traceparent(),
        tracestate: None,
        enqueued_at: Some(chrono::Utc::now()),
        cancel: CancellationToken::new(),
        tx: Some(tx),
        backing: Backing::Test { progress: Default::default(), logs: Default::default() },
        ended: false,
        operation_ended: false,
        ended_canceled: false,
    };
    let result = match serde_json::to_value(&job).and_then(serde_json::from_value::<K>) {
        Ok(job) => {
            let timeout = handler.timeout();
            let run = AssertUnwindSafe(handler.handle(job, &mut cx)).catch_unwind();
            match tokio::time::timeout(timeout, run).await {
                Ok(Ok(result)) => result,
                Ok(Err(_)) => Err(JobError::Retryable("the handler panicked".into())),
                Err(_) => Err(JobError::Retryable(format!("timed out after {timeout:?}"))),
            }
        }
        Err(e) => Err(JobError::Permanent(format!("undecodable payload: {e}"))),
    };
    let outcome = match &result {
        Ok(_) => Outcome::Succeeded,
        Err(JobError::RateLimited { .. }) => Outcome::Retried,
        Err(JobError::Permanent(_)) => Outcome::DeadLettered,
        Err(_) if attempt >= max_attempts => Outcome::DeadLettered,
        Err(_) => Outcome::Retried,
    };
    let Backing::Test { progress, logs } = cx.backing else { unreachable!("a test's context") };
    let mut tx = cx.tx.expect("the test's transaction stays in the context");
    let end = if result.is_ok() { "RELEASE SAVEPOINT" } else { "ROLLBACK TO SAVEPOINT" };
    sqlx::query(sqlx::AssertSqlSafe(format!("{end} conveyor_testing_work")))
        .execute(&mut *tx)
        .await
        .expect("testing::work: the savepoint's end");
    let (progress, logs) = (progress.into_inner().expect("progress lock"), logs.into_inner().expect("logs lock"));
    Worked { result, outcome, progress, logs, tx }
}

/// The jobs of kind `K` that `tx` enqueued and that are still waiting (every pending job of its workspace of that
/// kind, committed or not), decoded, oldest first: what a request's transaction enqueued, asserted before it commits.
pub async fn enqueued<K: JobKind>(tx: &mut WorkspaceTx) -> Result<Vec<(JobId, K)>, sqlx::Error> {
    let rows: Vec<(Uuid, serde_json::Value)> = sqlx::query_as(
        "SELECT id, event_payload FROM conveyor.outbox_events
         WHERE event_type = $1 AND status = 'pending' AND workspace_id = conveyor.conveyor_current_workspace()
         ORDER BY created_at, id",
    )
    .bind(K::KIND)
    .fetch_all(&mut **tx)
    .await?;
    rows.into_iter()
        .map(|(id, payload)| {
            let job = serde_json::from_value(payload).map_err(|e| sqlx::Error::Decode(Box::new(e)))?;
            Ok((JobId(id), job))
        })
        .collect()
}
