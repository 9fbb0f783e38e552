//! Running one job to its outcome: decode the entry, skip a job whose operation ended, run the kind's handler with its
//! time-out, then commit its transaction with the outcome, or retry through the outbox, or dead-letter it.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use sqlx::PgPool;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use uuid::Uuid;

use super::handler::{Backing, JobContext, JobError, Registered};
use super::listeners::Listeners;
use super::runtime::{Cancellation, Done, Outcome, Queue, Running, Tracker, WorkerSettings};
use crate::backoff::Backoff;
use crate::ids::{JobId, WorkspaceId};
use crate::metrics::Metrics;
use crate::outbox::transitions::{self, Completion, End, Finished, Ran, Run};
use crate::redact::redact;
use crate::stream::consumer::{Entry, Text};

/// The fields of a job entry (CONTRACT.md §3).
pub(super) struct Delivery {
    pub(super) event_id: Uuid,
    pub(super) workspace_id: WorkspaceId,
    pub(super) event_type: Text,
    pub(super) payload: Text,
    pub(super) operation_id: Option<Uuid>,
    pub(super) attempt: u32,
    /// The event's re-drive generation when it was handed off (an entry without one is taken for the current one).
    pub(super) redrive: Option<i32>,
    pub(super) enqueued_at_ms: Option<i64>,
    /// When it fell due, where later than its commit (a delayed job, a retry): its queue wait starts there.
    pub(super) due_at_ms: Option<i64>,
    pub(super) traceparent: Text,
    /// The `tracestate` that came with it, if the entry has one.
    pub(super) tracestate: Option<Text>,
    /// The job's own options, where it set them.
    pub(super) max_attempts: Option<u32>,
    pub(super) timeout: Option<Duration>,
    pub(super) backoff: Option<Backoff>,
    /// How its entry came to be started.
    pub(super) start: Start,
    /// When its handler started (the worker's clock), once it has.
    pub(super) started_at: Option<chrono::DateTime<chrono::Utc>>,
}

/// How a job's entry came to be started, which decides what is checked before its handler runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Start {
    /// Read new from its stream, and checked as it was read: it runs.
    Read,
    /// Taken over from a worker that stopped while it held the entry (`XAUTOCLAIM`), rather than read new.
    TakenOver,
    /// Read, and found past its deadline as it was read: expired instead of run.
    Expire,
}

impl Delivery {
    /// Reads a job from `entry`, taking its text fields out of it rather than copying them.
    pub(super) fn parse(entry: &mut Entry) -> Option<Self> {
        let f = &mut entry.fields;
        let ms = |name: &str| f.get(name).and_then(|v| v.parse::<u64>().ok()).map(Duration::from_millis);
        let backoff = match (ms("backoff_ms"), ms("backoff_max_ms")) {
            (Some(base), Some(max)) => Some(Backoff { base, max }),
            _ => None,
        };
        let timeout = ms("timeout_ms").filter(|t| !t.is_zero());
        Some(Self {
            event_id: f.get("event_id")?.parse().ok()?,
            workspace_id: WorkspaceId(f.get("workspace_id")?.parse().ok()?),
            operation_id: f.get("operation_id").and_then(|o| o.parse().ok()),
            attempt: f.get("attempt").and_then(|a| a.parse().ok()).unwrap_or(1).max(1),
            redrive: f.get("redrive").and_then(|r| r.parse().ok()),
            enqueued_at_ms: f.get("enqueued_at").and_then(|t| t.parse().ok()),
            due_at_ms: f.get("due_at").and_then(|t| t.parse().ok()),
            max_attempts: f.get("max_attempts").and_then(|a| a.parse().ok()).filter(|&a| a >= 1),
            timeout,
            backoff,
            event_type: f.take("type").unwrap_or_default(),
            payload: f.take("payload").unwrap_or_default(),
            traceparent: f.take("traceparent").unwrap_or_default(),
            tracestate: f.take("tracestate"),
            start: Start::Read,
            started_at: None,
        })
    }
}

/// The executor: the handlers by kind and the pools their jobs run on; one [`Executor::process`] per job.
pub(super) struct Executor {
    /// The application role's: the jobs' transactions, each in its workspace under row-level security.
    pub(super) pool: PgPool,
    /// A few connections of their own for keep-alives, progress and cancellations: jobs holding every connection of
    /// `pool` in their transactions cannot starve them.
    pub(super) control: PgPool,
    pub(super) handlers: HashMap<&'static str, Arc<dyn Registered>>,
    pub(super) settings: WorkerSettings,
    pub(super) metrics: Metrics,
    /// The jobs running, shared with the acker, which tells them of their cancellation.
    pub(super) running: Arc<Mutex<Running>>,
    pub(super) tracker: Arc<Tracker>,
    /// Finished entries, for the acker.
    pub(super) acks: mpsc::UnboundedSender<Done>,
    /// The workspaces whose event subscriptions want a job's start written, and its events announced.
    pub(super) listeners: Listeners,
    /// The worker's consumer name, recorded with each run's end as the worker that ran it.
    pub(super) consumer: Arc<str>,
}

impl Executor {
    /// Runs one entry to its end and acknowledges it when the outcome allows.
    pub(super) async fn process(
        &self,
        queue: Arc<Queue>,
        mut entry: Entry,
        abandon: CancellationToken,
        start: Start,
    ) -> Outcome {
        let started = Instant::now();
        let kind = queue.kind_slot(entry.fields.get("type"));
        let class = Queue::class_slot(entry.fields.get("class"));
        let (outcome, finished) = match Delivery::parse(&mut entry) {
            None => {
                tracing::error!(queue = %queue.name, entry_id = %entry.id, "Stream entry is not a Conveyor job (no event or workspace id); dropping it");
                (Outcome::Malformed, None)
            }
            Some(mut delivery) => {
                delivery.start = start;
                // From when the job fell due: a delayed job, or a retry backing off, waits on purpose until then.
                if let Some(since) = delivery.due_at_ms.or(delivery.enqueued_at_ms) {
                    let wait = (chrono::Utc::now().timestamp_millis() - since).max(0) as f64 / 1000.0;
                    queue.waited(class, wait);
                }
                let span = if crate::telemetry::exporting() {
                    // The job runs in the trace of the request that enqueued it, under the dispatcher's hand-off.
                    let span = tracing::info_span!("job", event_id = %delivery.event_id,
                        r#type = %delivery.event_type, attempt = delivery.attempt, traceparent = %delivery.traceparent,
                        otel.name = format!("job {}", &*delivery.event_type), otel.kind = "consumer");
                    let state = delivery.tracestate.as_deref();
                    crate::telemetry::set_parent_with_state(&span, &delivery.traceparent, state);
                    span
                } else {
                    tracing::info_span!("job", event_id = %delivery.event_id, r#type = %delivery.event_type,
                        attempt = delivery.attempt, traceparent = %delivery.traceparent)
                };
                let cancellation = Cancellation { requested: CancellationToken::new(), token: abandon.child_token() };
                let ran = if self.running.lock().expect("running lock").start(delivery.event_id, cancellation.clone()) {
                    let ran = self.execute(&mut delivery, &cancellation, &abandon).instrument(span).await;
                    self.running.lock().expect("running lock").jobs.remove(&delivery.event_id);
                    ran
                } else {
                    // Canceled after this worker read it, before it started: it never runs.
                    Ok((Outcome::Canceled, None))
                };
                match ran {
                    Ok(done) => done,
                    Err(e) => {
                        tracing::warn!(event_id = %delivery.event_id, error = ?e, "Job could not be settled; it will run again");
                        (Outcome::Failed, None)
                    }
                }
            }
        };
        crate::fail_point!("worker::before_ack", |_| outcome);
        queue.ended(kind, outcome, started.elapsed());
        if outcome.acknowledges() {
            // Acknowledged in batches by the ack loop; the heartbeat keeps the entry until then.
            let _ = self.acks.send((queue, entry.partition, entry.id, finished));
        } else {
            self.tracker.untrack(&queue.name, entry.partition, [&entry.id]);
        }
        outcome
    }

    /// Runs the job; with its outcome, the completion the ack loop records when the job had no transaction of its own.
    async fn execute(
        &self,
        d: &mut Delivery,
        cancellation: &Cancellation,
        abandon: &CancellationToken,
    ) -> anyhow::Result<(Outcome, Option<Finished>)> {
        let pool = &self.pool;
        // Past its deadline, it never starts (an entry taken over is checked here, one read new as it was read).
        match d.start {
            Start::Expire => {
                // Crash point for tests: the worker dies before the expiry commits.
                crate::fail_point!("worker::before_expire");
                let expired =
                    Box::pin(transitions::expire_job(pool, d.workspace_id, d.event_id, transitions::EXPIRED, false))
                        .await?;
                // Not expired now: it ended meanwhile.
                return Ok((if expired { Outcome::Expired } else { Outcome::Skipped }, None));
            }
            // Its worker stopped while it held it: past its deadline, it is not started again.
            Start::TakenOver
                if Box::pin(transitions::expire_job(
                    pool,
                    d.workspace_id,
                    d.event_id,
                    transitions::EXPIRED_ON_TAKE_OVER,
                    false,
                ))
                .await? =>
            {
                return Ok((Outcome::Expired, None));
            }
            Start::TakenOver | Start::Read => {}
        }
        let Some(handler) = self.handlers.get(&*d.event_type).cloned() else {
            let reason = format!("no handler registered for kind `{}`", redact(&d.event_type));
            return Ok((Box::pin(self.dead_letter(d, &reason, "no_handler")).await?, None));
        };
        let listening = self.listeners.of(d.workspace_id).await;
        if d.start == Start::TakenOver {
            // The delivery before this one started and never ended: its worker stopped. Counted before this run, so
            // that a run that stops this worker too is counted by the next one.
            match Box::pin(transitions::count_stop(
                pool,
                d.workspace_id,
                d.event_id,
                d.redrive,
                d.attempt,
                listening.announce,
            ))
            .await?
            {
                None => return Ok((Outcome::Skipped, None)),
                Some(stops) if stops >= self.settings.max_deliveries => {
                    // Its runs keep stopping their worker (killed, out of memory): it would stop the next one too.
                    let reason = format!("its worker stopped {stops} times while running it");
                    tracing::error!(event_id = %d.event_id, stops, "Job stopped its worker every time it ran; dead-lettered");
                    return Ok((Box::pin(self.dead_letter(d, &reason, "worker_stopped")).await?, None));
                }
                Some(stops) => {
                    tracing::warn!(event_id = %d.event_id, stops, "Running a job whose worker stopped while running it");
                }
            }
        }
        abort_on_job(d.event_id);
        let max_attempts = d.max_attempts.unwrap_or_else(|| handler.max_attempts());
        let mut cx = JobContext {
            id: JobId(d.event_id),
            workspace: d.workspace_id,
            operation: d.operation_id,
            attempt: d.attempt,
            max_attempts,
            traceparent: d.traceparent.to_string(),
            tracestate: d.tracestate.as_deref().map(str::to_owned),
            enqueued_at: d.enqueued_at_ms.and_then(chrono::DateTime::from_timestamp_millis),
            cancel: cancellation.token.clone(),
            tx: None,
            backing: Backing::Pools { pool: pool.clone(), control: self.control.clone(), announce: listening.announce },
            ended: false,
            operation_ended: false,
            ended_canceled: false,
        };
        if let Some(operation) = d.operation_id {
            if !Box::pin(transitions::start(pool, d.workspace_id, operation, d.attempt)).await? {
                // The operation has ended: this job can no longer advance it.
                Box::pin(self.end_orphan(d)).await?;
                return Ok((Outcome::Skipped, None));
            }
            // With an operation, the transaction (and the job's lock) comes first: a repeat delivery waits here
            // for the first run, then sees the job or its operation ended and skips (or, canceled, ends so).
            #[cfg(feature = "failpoints")]
            if let Some(Some(ms)) = fail::eval("worker::before_job_tx", |ms| ms.and_then(|ms| ms.parse().ok())) {
                tokio::time::sleep(Duration::from_millis(ms)).await; // `return(<ms>)`: a slow connection, not a stall
            }
            match Box::pin(cx.tx()).await.map(|_| ()) {
                Err(_) if cx.ended => return Ok((cx.ended_outcome(), None)),
                opened => opened?,
            }
            if cx.operation_ended {
                if let Some(mut tx) = cx.tx.take() {
                    transitions::end_run(pool, self.run(d), End::Orphaned { tx: &mut tx }).await?;
                    tx.commit().await?;
                }
                return Ok((Outcome::Skipped, None));
            }
        }
        if listening.active {
            // Best effort, as a log line: a start PostgreSQL could not take is a warning, and the job runs on.
            let (ws, job) = (d.workspace_id, d.event_id);
            if let Err(e) = Box::pin(transitions::record_active(&self.control, ws, job, d.attempt)).await {
                tracing::warn!(event_id = %job, error = %redact(&e.to_string()), "Could not record the job's start");
            }
        }
        let timeout = d.timeout.unwrap_or_else(|| handler.timeout());
        d.started_at = Some(chrono::Utc::now());
        let d = &*d;
        // Boxed, and only for a job with an operation: the job's own future stays small.
        let keepalive = d.operation_id.map(|operation| {
            Box::pin(keep_alive(self.control.clone(), d.workspace_id, operation, self.settings.keepalive))
        });
        let result = {
            let token = cancellation.token.clone();
            let run = async {
                match handler.run(&d.payload, &mut cx) {
                    Ok(running) => AssertUnwindSafe(running).catch_unwind().await.map_err(|_| ()).map(Some),
                    Err(e) => Ok(Some(Err(JobError::Permanent(format!(
                        "undecodable payload ({:?} error) for kind `{}`",
                        e.classify(),
                        redact(&d.event_type)
                    ))))),
                }
            };
            let keeping = async {
                match keepalive {
                    Some(k) => k.await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                ran = tokio::time::timeout(timeout, run) => Some(match ran {
                    Ok(Ok(Some(result))) => result,
                    Ok(Ok(None)) => unreachable!("a started handler always answers"),
                    Ok(Err(())) => Err(JobError::Retryable("the handler panicked".into())),
                    Err(_) => {
                        token.cancel();
                        Err(JobError::Retryable(format!("timed out after {timeout:?}")))
                    }
                }),
                _ = abandon.cancelled() => None,
                never = keeping => match never {},
            }
        };
        let Some(result) = result else {
            return Ok((Outcome::Abandoned, None));
        };
        if cancellation.requested.is_cancelled() || cx.ended {
            // Canceled while it ran, or ended by another delivery it waited for: whatever it answered, its writes
            // roll back.
            if let Some(tx) = cx.tx.take() {
                Box::pin(tx.rollback()).await?;
            }
            let outcome = if cx.ended { cx.ended_outcome() } else { Outcome::Canceled };
            return Ok((outcome, None));
        }
        match result {
            Ok(value) => Box::pin(self.succeed(d, cx, value)).await,
            Err(e) => {
                if let Some(tx) = cx.tx.take() {
                    Box::pin(tx.rollback()).await?;
                }
                if matches!(e, JobError::Canceled) {
                    if abandon.is_cancelled() {
                        // The worker's grace period ended: the entry stays for another worker.
                        return Ok((Outcome::Abandoned, None));
                    }
                    if !Box::pin(self.is_live(d)).await? {
                        // It read a cancellation (or another end) this worker has not heard of yet.
                        return Ok((Outcome::Canceled, None));
                    }
                    // Nobody canceled it: a failure like any other, retried below.
                }
                if let JobError::RateLimited { reason, until } = &e {
                    // Not a failure of this job: no attempt spent, whatever attempt this was.
                    let reason = redact(reason);
                    tracing::info!(event_id = %d.event_id, %until, reason = %reason, "Job rate limited; its key waits until then");
                    let throttled = End::Throttled { until: *until, reason: &reason };
                    if Box::pin(transitions::end_run(pool, self.run(d), throttled)).await? != Completion::Recorded {
                        tracing::warn!(event_id = %d.event_id, redrive = ?d.redrive, "A newer delivery of this job exists; not throttling it");
                        return Ok((Outcome::Skipped, None));
                    }
                    self.metrics.jobs_throttled.with_label_values(&[&*d.event_type]).inc();
                    return Ok((Outcome::Retried, None));
                }
                let error = redact(&e.to_string());
                let permanent = matches!(e, JobError::Permanent(_));
                if permanent || d.attempt >= max_attempts {
                    tracing::error!(event_id = %d.event_id, attempt = d.attempt, error = %error, "Job failed for good; dead-lettered");
                    let reason = if error.starts_with("undecodable payload") {
                        "undecodable"
                    } else if permanent {
                        "permanent"
                    } else {
                        "exhausted"
                    };
                    Ok((Box::pin(self.dead_letter(d, &error, reason)).await?, None))
                } else {
                    let backoff = d.backoff.unwrap_or_else(|| handler.backoff());
                    let delay = match e {
                        JobError::RetryAfter { after, .. } => backoff.delay(d.attempt).max(after),
                        _ => backoff.delay(d.attempt),
                    };
                    tracing::warn!(event_id = %d.event_id, attempt = d.attempt, ?delay, error = %error, "Job failed; retrying after back-off");
                    let retry = End::Retry { delay, error: &error };
                    if Box::pin(transitions::end_run(pool, self.run(d), retry)).await? != Completion::Recorded {
                        tracing::warn!(event_id = %d.event_id, redrive = ?d.redrive, "A newer delivery of this job exists; not scheduling a retry");
                        return Ok((Outcome::Skipped, None));
                    }
                    self.metrics.job_retries.with_label_values(&[&*d.event_type]).inc();
                    Ok((Outcome::Retried, None))
                }
            }
        }
    }

    /// Records a successful run: in the job's transaction when it has one (with the handler's writes and the
    /// operation's outcome), else through the ack loop's batch. A job canceled meanwhile rolls back.
    async fn succeed(
        &self,
        d: &Delivery,
        mut cx: JobContext,
        value: serde_json::Value,
    ) -> anyhow::Result<(Outcome, Option<Finished>)> {
        if d.operation_id.is_some() {
            match cx.tx().await.map(|_| ()) {
                Ok(()) => {}
                Err(_) if cx.ended => return Ok((cx.ended_outcome(), None)),
                Err(e) => return Err(e.into()),
            }
        }
        let Some(mut tx) = cx.tx.take() else {
            // No transaction (and so no operation): recorded in the acker's batch, the funnel's batched form.
            let started_at = d.started_at.unwrap_or_else(chrono::Utc::now);
            let finished =
                Finished { workspace: d.workspace_id, job: d.event_id, redrive: None, result: value, started_at };
            return Ok((Outcome::Succeeded, Some(finished)));
        };
        match transitions::end_run(&self.pool, self.run(d), End::Succeeded { tx: &mut tx, result: &value }).await? {
            Completion::OperationEnded => {
                // The operation is no longer live (canceled after the run began): roll back, and end the job.
                tx.rollback().await?;
                self.end_orphan(d).await?;
                Ok((Outcome::Canceled, None))
            }
            Completion::Canceled => {
                tx.rollback().await?;
                Ok((Outcome::Canceled, None))
            }
            Completion::Stale | Completion::Gone => {
                // Ended by another delivery meanwhile (and perhaps deleted since, by a clean or retention, which take
                // ended jobs only): its writes stand, these roll back.
                tx.rollback().await?;
                Ok((Outcome::Skipped, None))
            }
            Completion::Recorded => {
                tx.commit().await?;
                Ok((Outcome::Succeeded, None))
            }
        }
    }

    /// Ends a live job whose operation has already ended ([`End::Orphaned`]).
    async fn end_orphan(&self, d: &Delivery) -> anyhow::Result<()> {
        let mut tx = crate::db::begin_workspace(&self.pool, d.workspace_id).await?;
        transitions::end_run(&self.pool, self.run(d), End::Orphaned { tx: &mut tx }).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Whether the delivered job is still live.
    async fn is_live(&self, d: &Delivery) -> anyhow::Result<bool> {
        let mut tx = crate::db::begin_workspace(&self.pool, d.workspace_id).await?;
        let state = transitions::job_state_tx(&mut tx, d.event_id, None).await?;
        tx.commit().await?;
        Ok(state.live)
    }

    /// Dead-letters the delivered job with `reason` (redacted), counted under `why`; skipped when the delivery's
    /// generation is no longer the event's (a newer delivery exists, and it decides).
    async fn dead_letter(&self, d: &Delivery, reason: &str, why: &str) -> anyhow::Result<Outcome> {
        if transitions::end_run(&self.pool, self.run(d), End::DeadLettered { error: reason }).await?
            != Completion::Recorded
        {
            tracing::warn!(event_id = %d.event_id, redrive = ?d.redrive, "A newer delivery of this job exists; not dead-lettering it");
            return Ok(Outcome::Skipped);
        }
        self.metrics.job_dead_letters.with_label_values(&[why]).inc();
        Ok(Outcome::DeadLettered)
    }
}

impl Executor {
    /// The run `d` delivers, as the completion funnel fences it, with when it started and this worker's name.
    fn run(&self, d: &Delivery) -> Run {
        // A run that never started (no handler, a worker stopped by it before) was run by no worker of this one.
        let ran = Ran { started_at: d.started_at, by: d.started_at.map(|_| self.consumer.clone()) };
        Run { workspace: d.workspace_id, job: d.event_id, redrive: d.redrive, operation: d.operation_id, ran }
    }
}

/// Crash tests (`worker::abort_on_job=return(<job id>)`): the worker process aborts 0.3 s into that job, as one the
/// kernel kills for the memory its job took would, with whatever else it runs in flight.
#[cfg_attr(not(feature = "failpoints"), allow(unused_variables))]
fn abort_on_job(job: Uuid) {
    crate::fail_point!("worker::abort_on_job", |target: Option<String>| {
        if target.is_some_and(|t| t == job.to_string()) {
            std::thread::spawn(|| {
                std::thread::sleep(Duration::from_millis(300));
                std::process::abort();
            });
        }
    });
}

/// Refreshes the operation's `updated_at` every `every` while its job runs, so that the reconciler, which re-drives
/// operations without progress, leaves a long job alone. Never ends: the job's end drops it.
async fn keep_alive(
    pool: PgPool,
    workspace: WorkspaceId,
    operation: Uuid,
    every: Duration,
) -> std::convert::Infallible {
    loop {
        tokio::time::sleep(every).await;
        if let Err(e) = transitions::keep_alive(&pool, workspace, operation).await {
            tracing::warn!(operation = %operation, error = %redact(&e.to_string()), "Could not refresh a running operation");
        }
    }
}
