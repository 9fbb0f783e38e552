//! The worker runtime: reads a queue's stream through its consumer group, runs each job's handler in a workspace
//! transaction, acknowledges after commit, keeps in-flight entries alive, takes over dead consumers' entries, and
//! stops gracefully.

use std::collections::{HashMap, HashSet};
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use futures_util::FutureExt;
use prometheus::{Histogram, IntCounter};
use sqlx::PgPool;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;
use uuid::Uuid;

use super::handler::{Handler, Job, JobError};
use super::record;
use crate::db;
use crate::ids::WorkspaceId;
use crate::metrics::Metrics;
use crate::outbox::JobPayload;
use crate::redact::redact;
use crate::stream::consumer::{Consumer, Entry, Text};

/// How a worker runs.
#[derive(Clone, Debug)]
pub struct WorkerSettings {
    /// Jobs run at once, at most (`CONVEYOR_WORKER_CONCURRENCY`, default 16).
    pub concurrency: usize,
    /// An entry idle this long belongs to a dead consumer and is taken over (`CONVEYOR_WORKER_VISIBILITY`,
    /// default 5 s, so a dead worker's job runs again within about 10 s). Live jobs heartbeat every third of it.
    pub visibility: Duration,
    /// Longest wait of one `XREADGROUP ... BLOCK`.
    pub block: Duration,
    /// How often idle entries of dead consumers are looked for.
    pub reclaim_interval: Duration,
    /// How often a running job with an operation refreshes the operation's `updated_at`, so that the reconciler,
    /// which re-drives operations without progress, leaves a long job alone (`CONVEYOR_OPERATION_KEEPALIVE`,
    /// default 1 min).
    pub keepalive: Duration,
}

impl Default for WorkerSettings {
    fn default() -> Self {
        Self {
            concurrency: 16,
            visibility: Duration::from_secs(5),
            block: Duration::from_secs(1),
            reclaim_interval: Duration::from_secs(1),
            keepalive: Duration::from_secs(60),
        }
    }
}

/// How one delivery ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The handler succeeded and its transaction committed.
    Succeeded,
    /// The operation had already finished: a repeat delivery, nothing run.
    Skipped,
    /// Failed; scheduled to run again after a back-off.
    Retried,
    /// Failed for good (permanent error, attempts exhausted, undecodable payload, unknown type).
    DeadLettered,
    /// Not a Conveyor job at all (no event id or workspace): acknowledged and dropped.
    Malformed,
    /// Stopped by shutdown; left unacknowledged for another worker.
    Abandoned,
    /// PostgreSQL or Redis failed around the job; left unacknowledged, it runs again after the visibility time-out.
    Failed,
}

impl Outcome {
    const ALL: [Outcome; 7] = [
        Self::Succeeded,
        Self::Skipped,
        Self::Retried,
        Self::DeadLettered,
        Self::Malformed,
        Self::Abandoned,
        Self::Failed,
    ];

    fn label(self) -> &'static str {
        match self {
            Self::Succeeded => "succeeded",
            Self::Skipped => "skipped",
            Self::Retried => "retried",
            Self::DeadLettered => "dead_lettered",
            Self::Malformed => "malformed",
            Self::Abandoned => "abandoned",
            Self::Failed => "failed",
        }
    }

    fn acknowledges(self) -> bool {
        !matches!(self, Self::Abandoned | Self::Failed)
    }
}

/// A queue this worker consumes, with its metrics looked up once: a labelled lookup per job costs a hash of the
/// labels and a lock.
struct Queue {
    name: String,
    /// Enqueue to start.
    wait: Histogram,
    /// Jobs and their duration, by [`Outcome`] (in the order of [`Outcome::ALL`]).
    ended: [(IntCounter, Histogram); Outcome::ALL.len()],
}

impl Queue {
    fn new(name: &str, metrics: &Metrics) -> Self {
        Self {
            name: name.to_owned(),
            wait: metrics.job_queue_wait.with_label_values(&[name]),
            ended: Outcome::ALL.map(|o| {
                let labels = [name, o.label()];
                (metrics.jobs.with_label_values(&labels), metrics.job_duration.with_label_values(&labels))
            }),
        }
    }

    fn ended(&self, outcome: Outcome, took: Duration) {
        let (count, duration) = &self.ended[outcome as usize];
        count.inc();
        duration.observe(took.as_secs_f64());
    }
}

/// An entry whose job ended and which the ack loop acknowledges: its queue and entry id.
type Finished = (Arc<Queue>, String);

/// The fields of a job entry (CONTRACT.md §3).
struct Delivery {
    event_id: Uuid,
    workspace_id: WorkspaceId,
    event_type: Text,
    payload: Text,
    operation_id: Option<Uuid>,
    attempt: u32,
    /// The event's re-drive generation when it was handed off (an entry without one is taken for the current one).
    redrive: Option<i32>,
    enqueued_at_ms: Option<i64>,
    traceparent: Text,
}

impl Delivery {
    /// Reads a job from `entry`, taking its text fields out of it rather than copying them.
    fn parse(entry: &mut Entry) -> Option<Self> {
        let f = &mut entry.fields;
        Some(Self {
            event_id: f.get("event_id")?.parse().ok()?,
            workspace_id: WorkspaceId(f.get("workspace_id")?.parse().ok()?),
            operation_id: f.get("operation_id").and_then(|o| o.parse().ok()),
            attempt: f.get("attempt").and_then(|a| a.parse().ok()).unwrap_or(1).max(1),
            redrive: f.get("redrive").and_then(|r| r.parse().ok()),
            enqueued_at_ms: f.get("enqueued_at").and_then(|t| t.parse().ok()),
            event_type: f.take("type").unwrap_or_default(),
            payload: f.take("payload").unwrap_or_default(),
            traceparent: f.take("traceparent").unwrap_or_default(),
        })
    }
}

struct Inner {
    pool: PgPool,
    consumer: Consumer,
    queues: Vec<Arc<Queue>>,
    handlers: HashMap<String, Arc<dyn Handler>>,
    settings: WorkerSettings,
    metrics: Metrics,
    permits: Arc<Semaphore>,
    in_flight: Mutex<HashMap<String, HashSet<String>>>,
    acks: mpsc::UnboundedSender<Finished>,
    ack_queue: Mutex<Option<mpsc::UnboundedReceiver<Finished>>>,
}

/// Builds a [`Worker`].
pub struct WorkerBuilder {
    pool: PgPool,
    consumer: Consumer,
    handlers: HashMap<String, Arc<dyn Handler>>,
    settings: WorkerSettings,
    metrics: Metrics,
}

impl WorkerBuilder {
    /// Registers `handler` for jobs of `event_type`; its queue is the one the type is published to.
    pub fn handler(mut self, event_type: &str, handler: impl Handler) -> Self {
        self.handlers.insert(event_type.to_owned(), Arc::new(handler));
        self
    }

    /// Replaces the settings.
    pub fn settings(mut self, settings: WorkerSettings) -> Self {
        self.settings = settings;
        self
    }

    /// Records into `metrics`.
    pub fn metrics(mut self, metrics: Metrics) -> Self {
        self.metrics = metrics;
        self
    }

    /// The worker. Fails on a handler for a job type no queue carries.
    pub fn build(self) -> anyhow::Result<Worker> {
        let mut queues: Vec<Arc<Queue>> = Vec::new();
        for event_type in self.handlers.keys() {
            let queue = JobPayload::queue_of(event_type)
                .ok_or_else(|| anyhow::anyhow!("no queue carries job type `{event_type}`"))?;
            if !queues.iter().any(|q| q.name == queue) {
                queues.push(Arc::new(Queue::new(queue, &self.metrics)));
            }
        }
        anyhow::ensure!(!queues.is_empty(), "a worker needs at least one handler");
        anyhow::ensure!(self.settings.concurrency > 0, "concurrency must be at least 1");
        anyhow::ensure!(!self.settings.keepalive.is_zero(), "the operation keep-alive must be longer than zero");
        self.metrics.worker_concurrency_limit.set(self.settings.concurrency as i64);
        let (acks, ack_queue) = mpsc::unbounded_channel();
        Ok(Worker(Arc::new(Inner {
            acks,
            ack_queue: Mutex::new(Some(ack_queue)),
            pool: self.pool,
            consumer: self.consumer,
            queues,
            handlers: self.handlers,
            permits: Arc::new(Semaphore::new(self.settings.concurrency)),
            settings: self.settings,
            metrics: self.metrics,
            in_flight: Mutex::new(HashMap::new()),
        })))
    }
}

/// Runs registered handlers over their queues' streams.
#[derive(Clone)]
pub struct Worker(Arc<Inner>);

impl Worker {
    /// A builder over PostgreSQL (the application role) and a stream consumer.
    pub fn builder(pool: PgPool, consumer: Consumer) -> WorkerBuilder {
        WorkerBuilder {
            pool,
            consumer,
            handlers: HashMap::new(),
            settings: WorkerSettings::default(),
            metrics: Metrics::new(),
        }
    }

    /// The queues it consumes.
    pub fn queues(&self) -> impl Iterator<Item = &str> {
        self.0.queues.iter().map(|q| q.name.as_str())
    }

    /// Creates the consumer groups (and streams) if missing.
    pub async fn ensure_groups(&self) -> Result<(), fred::error::Error> {
        for queue in &self.0.queues {
            self.0.consumer.ensure_group(&queue.name).await?;
        }
        Ok(())
    }

    /// Runs until `shutdown`; then reads no more, lets in-flight jobs finish (and acknowledge) within `grace`, and
    /// abandons whatever is still running, unacknowledged, to another worker.
    pub async fn run(self, shutdown: CancellationToken, grace: Duration) -> anyhow::Result<()> {
        loop {
            match self.ensure_groups().await {
                Ok(()) => break,
                Err(e) => {
                    tracing::warn!(error = %redact(&e.to_string()), "Cannot create consumer groups yet; retrying");
                    tokio::select! {
                        _ = shutdown.cancelled() => return Ok(()),
                        _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    }
                }
            }
        }
        tracing::info!(consumer = self.0.consumer.name(), queues = ?self.queues().collect::<Vec<_>>(), concurrency = self.0.settings.concurrency, "Worker started");
        let jobs = TaskTracker::new();
        let abandon = CancellationToken::new();
        let readers = TaskTracker::new();
        readers.spawn(self.clone().read_loop(shutdown.clone(), jobs.clone(), abandon.clone()));
        readers.spawn(self.clone().reclaim_loop(shutdown.clone(), jobs.clone(), abandon.clone()));
        readers.close();
        let ack_queue = self.0.ack_queue.lock().expect("ack queue lock").take().context("a worker runs once")?;
        let ack_stop = CancellationToken::new();
        let acker = tokio::spawn(self.clone().ack_loop(ack_queue, ack_stop.clone()));
        // The heartbeat outlives the readers: jobs finishing during shutdown must not look dead meanwhile.
        let heartbeat_stop = CancellationToken::new();
        let heartbeat = tokio::spawn(self.clone().heartbeat_loop(heartbeat_stop.clone()));

        shutdown.cancelled().await;
        readers.wait().await;
        jobs.close();
        tracing::info!(in_flight = jobs.len(), ?grace, "Worker stopping: no more reads, letting jobs finish");
        if tokio::time::timeout(grace, jobs.wait()).await.is_err() {
            tracing::warn!(left = jobs.len(), "Grace period over; abandoning unfinished jobs to another worker");
            abandon.cancel();
            let _ = tokio::time::timeout(Duration::from_secs(5), jobs.wait()).await;
        }
        ack_stop.cancel();
        let _ = acker.await;
        heartbeat_stop.cancel();
        let _ = heartbeat.await;
        tracing::info!("Worker stopped");
        Ok(())
    }

    fn track(&self, queue: &str, ids: impl IntoIterator<Item = String>) {
        let mut in_flight = self.0.in_flight.lock().expect("in-flight lock");
        in_flight.entry(queue.to_owned()).or_default().extend(ids);
    }

    fn untrack<'a>(&self, queue: &str, ids: impl IntoIterator<Item = &'a String>) {
        if let Some(tracked) = self.0.in_flight.lock().expect("in-flight lock").get_mut(queue) {
            for id in ids {
                tracked.remove(id);
            }
        }
    }

    fn spawn_job(
        &self,
        jobs: &TaskTracker,
        queue: Arc<Queue>,
        entry: Entry,
        permit: OwnedSemaphorePermit,
        abandon: CancellationToken,
    ) {
        let worker = self.clone();
        worker.0.metrics.worker_jobs_in_flight.inc();
        jobs.spawn(async move {
            let _permit = permit;
            worker.process(queue, entry, abandon).await;
            worker.0.metrics.worker_jobs_in_flight.dec();
        });
    }

    /// Waits for a free job slot and returns it with the number of slots free now (at least 1).
    async fn free_slots(&self, shutdown: &CancellationToken) -> Option<(OwnedSemaphorePermit, usize)> {
        let first = tokio::select! {
            p = self.0.permits.clone().acquire_owned() => p.expect("the semaphore is never closed"),
            _ = shutdown.cancelled() => return None,
        };
        Some((first, 1 + self.0.permits.available_permits().min(255)))
    }

    /// Starts jobs for `entries`, each as soon as a slot is free (the first takes `first`).
    async fn start_jobs(
        &self,
        queue: &Arc<Queue>,
        entries: Vec<Entry>,
        first: OwnedSemaphorePermit,
        jobs: &TaskTracker,
        abandon: &CancellationToken,
    ) {
        self.track(&queue.name, entries.iter().map(|e| e.id.clone()));
        let mut first = Some(first);
        for entry in entries {
            let permit = match first.take() {
                Some(p) => p,
                None => self.0.permits.clone().acquire_owned().await.expect("the semaphore is never closed"),
            };
            self.spawn_job(jobs, queue.clone(), entry, permit, abandon.clone());
        }
    }

    async fn read_loop(self, shutdown: CancellationToken, jobs: TaskTracker, abandon: CancellationToken) {
        let block_ms = self.0.settings.block.as_millis() as u64;
        let mut turn = 0usize;
        // Slots are not held while blocked in XREADGROUP (the reclaimer needs them too); entries read beyond the
        // free slots wait for one, and are kept alive by the heartbeat meanwhile.
        while let Some((first, free)) = self.free_slots(&shutdown).await {
            // Queues take turns, one blocking read each: the blocking connection serves one read at a time.
            let queue = self.0.queues[turn % self.0.queues.len()].clone();
            turn += 1;
            let block = if self.0.queues.len() > 1 { block_ms.min(100) } else { block_ms };
            drop(first);
            match self.0.consumer.read(&queue.name, free as u64, block).await {
                Ok(entries) if entries.is_empty() => {}
                Ok(entries) => {
                    let first = self.0.permits.clone().acquire_owned().await.expect("the semaphore is never closed");
                    self.start_jobs(&queue, entries, first, &jobs, &abandon).await;
                }
                Err(e) => {
                    tracing::warn!(queue = %queue.name, error = %redact(&e.to_string()), "XREADGROUP failed; retrying");
                    if e.details().contains("NOGROUP") || e.to_string().contains("NOGROUP") {
                        let _ = self.0.consumer.ensure_group(&queue.name).await;
                    }
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                    }
                }
            }
        }
    }

    async fn reclaim_loop(self, shutdown: CancellationToken, jobs: TaskTracker, abandon: CancellationToken) {
        let min_idle = self.0.settings.visibility.as_millis() as u64;
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(self.0.settings.reclaim_interval) => {}
            }
            for queue in self.0.queues.clone() {
                if let Err(e) = self.reclaim(&queue, min_idle, &jobs, &abandon).await {
                    tracing::warn!(queue = %queue.name, error = ?e, "Reclaiming idle entries failed");
                }
            }
            self.observe_streams().await;
        }
    }

    async fn reclaim(
        &self,
        queue: &Arc<Queue>,
        min_idle: u64,
        jobs: &TaskTracker,
        abandon: &CancellationToken,
    ) -> anyhow::Result<()> {
        let Ok(first) = self.0.permits.clone().try_acquire_owned() else { return Ok(()) };
        let count = 1 + self.0.permits.available_permits().min(99) as u64;
        let name = queue.name.as_str();
        let reclaimed = self.0.consumer.reclaim(name, min_idle, count).await?;
        if !reclaimed.entries.is_empty() {
            tracing::info!(
                queue = name,
                count = reclaimed.entries.len(),
                "Took over entries idle past the visibility time-out"
            );
            self.0.metrics.worker_reclaims.with_label_values(&[name]).inc_by(reclaimed.entries.len() as u64);
        }
        self.start_jobs(queue, reclaimed.entries, first, jobs, abandon).await;
        // Pending entries whose data Redis no longer has: the job is re-driven from PostgreSQL.
        for entry_id in reclaimed.deleted {
            if let Some((event_id, workspace)) = record::event_by_stream_id(&self.0.pool, name, &entry_id).await? {
                let mut tx = db::begin_workspace(&self.0.pool, workspace).await?;
                if record::redrive_tx(&mut tx, workspace, event_id).await? {
                    tracing::warn!(queue = name, event_id = %event_id, "Stream entry lost by Redis; re-driven from PostgreSQL");
                }
                tx.commit().await?;
            }
        }
        Ok(())
    }

    /// Acknowledges (and deletes) finished entries in batches: one script call for everything finished since the
    /// last one. On `stop`, flushes what is left.
    async fn ack_loop(self, mut queue: mpsc::UnboundedReceiver<Finished>, stop: CancellationToken) {
        loop {
            let first = tokio::select! {
                next = queue.recv() => match next { Some(a) => a, None => return },
                _ = stop.cancelled() => match queue.try_recv() { Ok(a) => a, Err(_) => return },
            };
            // By queue: a worker has a queue or a few, so a short list.
            let mut batch: Vec<(Arc<Queue>, Vec<String>)> = Vec::new();
            let mut next = Some(first);
            let mut size = 0;
            while let Some((q, id)) = next.take() {
                match batch.iter_mut().find(|(b, _)| Arc::ptr_eq(b, &q)) {
                    Some((_, ids)) => ids.push(id),
                    None => batch.push((q, vec![id])),
                }
                size += 1;
                if size < 1000 {
                    next = queue.try_recv().ok();
                }
            }
            for (q, ids) in batch {
                let q = q.name.as_str();
                let mut last_error = None;
                for attempt in 0..3 {
                    match self.0.consumer.ack(q, &ids).await {
                        Ok(_) => {
                            last_error = None;
                            break;
                        }
                        Err(e) => {
                            last_error = Some(e);
                            tokio::time::sleep(Duration::from_millis(50 << attempt)).await;
                        }
                    }
                }
                if let Some(e) = last_error {
                    tracing::warn!(queue = %q, count = ids.len(), error = %redact(&e.to_string()), "XACK failed; the entries will be taken over and skipped");
                }
                self.untrack(q, &ids);
            }
        }
    }

    async fn heartbeat_loop(self, stop: CancellationToken) {
        let every = self.0.settings.visibility / 3;
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
            let snapshot: Vec<(String, Vec<String>)> = self
                .0
                .in_flight
                .lock()
                .expect("in-flight lock")
                .iter()
                .map(|(q, ids)| (q.clone(), ids.iter().cloned().collect()))
                .collect();
            for (queue, ids) in snapshot {
                if let Err(e) = self.0.consumer.heartbeat(&queue, &ids).await {
                    tracing::warn!(queue = %queue, error = %redact(&e.to_string()), "Heartbeat failed");
                }
            }
        }
    }

    async fn observe_streams(&self) {
        for queue in self.queues() {
            if let Ok(stats) = self.0.consumer.stats(queue).await {
                let m = &self.0.metrics;
                m.stream_length.with_label_values(&[queue]).set(stats.length as i64);
                m.stream_pending_entries.with_label_values(&[queue]).set(stats.pending as i64);
                if let Some(lag) = stats.lag {
                    m.stream_group_lag.with_label_values(&[queue]).set(lag as i64);
                }
            }
        }
    }

    /// Runs one entry to its end and acknowledges it when the outcome allows.
    async fn process(&self, queue: Arc<Queue>, mut entry: Entry, abandon: CancellationToken) {
        let started = Instant::now();
        let outcome = match Delivery::parse(&mut entry) {
            None => {
                tracing::error!(queue = %queue.name, entry_id = %entry.id, "Stream entry is not a Conveyor job (no event or workspace id); dropping it");
                Outcome::Malformed
            }
            Some(delivery) => {
                if let Some(enqueued) = delivery.enqueued_at_ms {
                    let wait = (chrono::Utc::now().timestamp_millis() - enqueued).max(0) as f64 / 1000.0;
                    queue.wait.observe(wait);
                }
                let span = tracing::info_span!("job", event_id = %delivery.event_id, r#type = %delivery.event_type,
                    attempt = delivery.attempt, traceparent = %delivery.traceparent);
                match self.execute(&delivery, &abandon).instrument(span).await {
                    Ok(outcome) => outcome,
                    Err(e) => {
                        tracing::warn!(event_id = %delivery.event_id, error = ?e, "Job could not be settled; it will run again");
                        Outcome::Failed
                    }
                }
            }
        };
        fail::fail_point!("worker::before_ack");
        queue.ended(outcome, started.elapsed());
        if outcome.acknowledges() {
            // Acknowledged in batches by the ack loop; the heartbeat keeps the entry until then.
            let _ = self.0.acks.send((queue, entry.id));
        } else {
            self.untrack(&queue.name, [&entry.id]);
        }
    }

    async fn execute(&self, d: &Delivery, abandon: &CancellationToken) -> anyhow::Result<Outcome> {
        let pool = &self.0.pool;
        let payload = match JobPayload::decode(&d.event_type, &d.payload) {
            Ok(payload) => payload,
            Err(e) => {
                let reason =
                    format!("undecodable payload ({:?} error) for type `{}`", e.classify(), redact(&d.event_type));
                tracing::error!(event_id = %d.event_id, reason = %reason, "Dead-lettering an undecodable job");
                return Box::pin(self.dead_letter(d, &reason, "undecodable")).await;
            }
        };
        let Some(handler) = self.0.handlers.get(&*d.event_type).cloned() else {
            let reason = format!("no handler registered for type `{}`", d.event_type);
            return Box::pin(self.dead_letter(d, &reason, "no_handler")).await;
        };
        let cancel = abandon.child_token();
        let mut job = Job {
            event_id: d.event_id,
            workspace_id: d.workspace_id,
            operation_id: d.operation_id,
            attempt: d.attempt,
            payload,
            traceparent: d.traceparent.to_string(),
            enqueued_at: d.enqueued_at_ms.and_then(chrono::DateTime::from_timestamp_millis),
            cancel: cancel.clone(),
            tx: None,
            pool: pool.clone(),
        };
        if let Some(operation) = d.operation_id {
            if !Box::pin(record::start(pool, d.workspace_id, operation, d.attempt)).await? {
                return Ok(Outcome::Skipped);
            }
            // With an operation, the transaction (and the job's lock) comes first: a repeat delivery waits here
            // for the first run, then sees the operation finished and skips.
            if Box::pin(async { record::finished_tx(job.tx().await?, operation).await }).await? {
                return Ok(Outcome::Skipped);
            }
        }
        let timeout = handler.timeout();
        // Boxed, and only for a job with an operation: the job's own future stays small.
        let keepalive = d
            .operation_id
            .map(|operation| Box::pin(keep_alive(pool.clone(), d.workspace_id, operation, self.0.settings.keepalive)));
        let result = {
            let run = AssertUnwindSafe(handler.handle(&mut job)).catch_unwind();
            let keeping = async {
                match keepalive {
                    Some(k) => k.await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                ran = tokio::time::timeout(timeout, run) => Some(match ran {
                    Ok(Ok(result)) => result,
                    Ok(Err(_)) => Err(JobError::Retryable("the handler panicked".into())),
                    Err(_) => {
                        cancel.cancel();
                        Err(JobError::Retryable(format!("timed out after {timeout:?}")))
                    }
                }),
                _ = abandon.cancelled() => None,
                never = keeping => match never {},
            }
        };
        let Some(result) = result else {
            return Ok(Outcome::Abandoned);
        };
        match result {
            Ok(value) => {
                if let Some(operation) = d.operation_id {
                    Box::pin(async { record::succeed_tx(job.tx().await?, operation, &value).await }).await?;
                }
                if let Some(tx) = job.tx.take() {
                    Box::pin(tx.commit()).await?;
                }
                Ok(Outcome::Succeeded)
            }
            Err(e) => {
                if let Some(tx) = job.tx.take() {
                    Box::pin(tx.rollback()).await?;
                }
                let error = redact(&e.to_string());
                let permanent = matches!(e, JobError::Permanent(_));
                if permanent || d.attempt >= handler.max_attempts() {
                    tracing::error!(event_id = %d.event_id, attempt = d.attempt, error = %error, "Job failed for good; dead-lettered");
                    let reason = if permanent { "permanent" } else { "exhausted" };
                    Box::pin(self.dead_letter(d, &error, reason)).await
                } else {
                    let delay = handler.backoff().delay(d.attempt);
                    tracing::warn!(event_id = %d.event_id, attempt = d.attempt, ?delay, error = %error, "Job failed; retrying after back-off");
                    let (workspace, event, operation) = (d.workspace_id, d.event_id, d.operation_id);
                    if !Box::pin(record::retry(pool, workspace, event, d.redrive, operation, delay, &error)).await? {
                        tracing::warn!(event_id = %d.event_id, redrive = ?d.redrive, "A newer delivery of this job exists; not scheduling a retry");
                        return Ok(Outcome::Skipped);
                    }
                    self.0.metrics.job_retries.with_label_values(&[&*d.event_type]).inc();
                    Ok(Outcome::Retried)
                }
            }
        }
    }

    /// Dead-letters the delivered job with `reason` (redacted), counted under `why`; skipped when the delivery's
    /// generation is no longer the event's (a newer delivery exists, and it decides).
    async fn dead_letter(&self, d: &Delivery, reason: &str, why: &str) -> anyhow::Result<Outcome> {
        let (workspace, event, operation) = (d.workspace_id, d.event_id, d.operation_id);
        if !record::dead_letter(&self.0.pool, workspace, event, d.redrive, operation, reason).await? {
            tracing::warn!(event_id = %d.event_id, redrive = ?d.redrive, "A newer delivery of this job exists; not dead-lettering it");
            return Ok(Outcome::Skipped);
        }
        self.0.metrics.job_dead_letters.with_label_values(&[why]).inc();
        Ok(Outcome::DeadLettered)
    }
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
        if let Err(e) = record::keep_alive(&pool, workspace, operation).await {
            tracing::warn!(operation = %operation, error = %redact(&e.to_string()), "Could not refresh a running operation");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream::keys::Keys;
    use crate::worker::handler::BoxFuture;

    struct Nothing;

    impl Handler for Nothing {
        fn handle<'a>(&'a self, _job: &'a mut Job) -> BoxFuture<'a, Result<serde_json::Value, JobError>> {
            Box::pin(async { Ok(serde_json::Value::Null) })
        }
    }

    #[tokio::test]
    async fn settings_a_worker_cannot_run_with_are_refused_when_it_is_built() {
        // Nothing connects: a lazy pool and clients that were never initialised.
        let pool = sqlx::postgres::PgPoolOptions::new().connect_lazy("postgres://127.0.0.1:1/none").unwrap();
        let client = || fred::prelude::Builder::default_centralized().build().unwrap();
        let build = |settings: WorkerSettings| {
            let consumer = Consumer::new(client(), client(), Keys::new("t"), "c".into());
            Worker::builder(pool.clone(), consumer)
                .handler("store.verify_credentials", Nothing)
                .settings(settings)
                .build()
                .map(|_| ())
                .map_err(|e| e.to_string())
        };
        assert_eq!(build(WorkerSettings::default()), Ok(()));
        let no_slots = build(WorkerSettings { concurrency: 0, ..WorkerSettings::default() });
        assert!(no_slots.unwrap_err().contains("concurrency"));
        let no_keepalive = build(WorkerSettings { keepalive: Duration::ZERO, ..WorkerSettings::default() });
        assert!(no_keepalive.unwrap_err().contains("keep-alive"));
        let unknown = Worker::builder(pool.clone(), Consumer::new(client(), client(), Keys::new("t"), "c".into()))
            .handler("no.such_type", Nothing)
            .build();
        assert!(unknown.err().unwrap().to_string().contains("no.such_type"));
    }
}
