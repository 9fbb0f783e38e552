//! The worker: its settings, its builder (typed handlers by kind), and its run with graceful shutdown. A running
//! worker is three roles, each a value owning what it works with: the [`Reader`] reads entries and starts jobs, the
//! [`Executor`] runs one job to its outcome (through the completion funnel: `transitions::end_run`, or its batched
//! form `complete_many`, which the acker calls for jobs that had no transaction of their own), the [`Acker`]
//! acknowledges finished entries, keeps running ones alive and hears cancellations. What they share is explicit: the
//! entries held ([`Tracker`]: the reader adds, the executor and the acker drop, the acker heart-beats), the jobs running
//! ([`Running`]: the executor starts and ends them, the acker cancels them) and the channel of finished entries
//! ([`Done`]: the reader and the executor send, the acker receives).

use crate::error::Public;
use std::collections::{HashMap, HashSet};
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use prometheus::{Histogram, IntCounter};
use sqlx::PgPool;
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use uuid::Uuid;

use super::acker::Acker;
use super::execute::Executor;
use super::handler::{Handler, Registered, Typed};
use super::listeners::Listeners;
use super::reader::Reader;
use super::slots::Slots;
use crate::kind::{self, JobKind};
use crate::metrics::Metrics;
use crate::outbox::transitions::Finished;
use crate::redact::redact;
use crate::stream::RedisError;
use crate::stream::consumer::Consumer;
use crate::stream::keys::Partition;

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
    /// Deliveries of one job that may end with their worker stopped (killed, out of memory) before the job is
    /// dead-lettered instead of run again, with the reason "its worker stopped N times while running it"
    /// (`CONVEYOR_WORKER_MAX_DELIVERIES`, default 5, like BullMQ's `maxStalledCount` but counted in PostgreSQL). A
    /// delivery counts when another worker takes it over past the visibility time-out.
    pub max_deliveries: u32,
    /// Slots of the queues named, at most (`CONVEYOR_WORKER_QUEUE_CONCURRENCY=transfers=4,media=8`, or
    /// [`WorkerBuilder::queue_concurrency`]), within `concurrency`. A queue not named may take every slot but one for
    /// each other queue, so that one queue's jobs (a slow source, a flood of one kind) never hold them all; caps that
    /// sum to `concurrency` or less reserve slots for every queue.
    pub queue_concurrency: std::collections::BTreeMap<String, usize>,
}

impl Default for WorkerSettings {
    fn default() -> Self {
        Self {
            concurrency: 16,
            visibility: Duration::from_secs(5),
            block: Duration::from_secs(1),
            reclaim_interval: Duration::from_secs(1),
            keepalive: Duration::from_secs(60),
            max_deliveries: 5,
            queue_concurrency: std::collections::BTreeMap::new(),
        }
    }
}

/// How one delivery ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// The handler succeeded and its transaction committed.
    Succeeded,
    /// The job had already ended (a repeat delivery), or a newer delivery decides: nothing run.
    Skipped,
    /// Failed; scheduled to run again after a back-off. Also a job rate limited ([`crate::JobError::RateLimited`]): back to
    /// the outbox until its key may go again, without spending an attempt.
    Retried,
    /// Failed for good (permanent error, attempts exhausted, undecodable payload, no handler for its kind).
    DeadLettered,
    /// Canceled while it ran: its writes rolled back, it stays canceled.
    Canceled,
    /// Not started by its deadline ([`crate::EnqueueOptions::expire_at`]): canceled as expired instead of run.
    Expired,
    /// Not a Conveyor job at all (no event id or workspace): acknowledged and dropped.
    Malformed,
    /// Stopped by shutdown; left unacknowledged for another worker.
    Abandoned,
    /// PostgreSQL or Redis failed around the job; left unacknowledged, it runs again after the visibility time-out.
    Failed,
}

impl Outcome {
    pub(super) const ALL: [Outcome; 9] = [
        Self::Succeeded,
        Self::Skipped,
        Self::Retried,
        Self::DeadLettered,
        Self::Canceled,
        Self::Expired,
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
            Self::Canceled => "canceled",
            Self::Expired => "expired",
            Self::Malformed => "malformed",
            Self::Abandoned => "abandoned",
            Self::Failed => "failed",
        }
    }

    pub(super) fn acknowledges(self) -> bool {
        !matches!(self, Self::Abandoned | Self::Failed)
    }
}

/// A queue this worker consumes, with its metrics looked up once: a labelled lookup per job costs a hash of the
/// labels and a lock.
pub(super) struct Queue {
    pub(super) name: String,
    /// Its jobs running in this worker, at most ([`WorkerSettings::queue_concurrency`]).
    pub(super) cap: Arc<Semaphore>,
    /// Enqueue to start, by the workspace's class at the claim (in the order of [`Queue::CLASSES`]).
    wait: [Histogram; Queue::CLASSES.len()],
    /// Jobs and their duration by kind (the kinds registered on this queue, then `unknown` for anything else), by
    /// [`Outcome`] (in the order of [`Outcome::ALL`]).
    ended: Vec<(&'static str, Ended)>,
}

type Ended = [(IntCounter, Histogram); Outcome::ALL.len()];

impl Queue {
    fn new(name: &str, kinds: &[&'static str], cap: usize, metrics: &Metrics) -> Self {
        let ended = kinds
            .iter()
            .copied()
            .chain(std::iter::once("unknown"))
            .map(|kind| {
                let ended = Outcome::ALL.map(|o| {
                    let labels = [name, kind, o.label()];
                    (metrics.jobs.with_label_values(&labels), metrics.job_duration.with_label_values(&labels))
                });
                (kind, ended)
            })
            .collect();
        let wait = Self::CLASSES.map(|class| metrics.job_queue_wait.with_label_values(&[name, class]));
        Self { name: name.to_owned(), cap: Arc::new(Semaphore::new(cap)), wait, ended }
    }

    /// The fair-share classes a stream entry's `class` field can name, then `unknown` (no field, or another value).
    pub(super) const CLASSES: [&'static str; 3] = ["light", "backlogged", "unknown"];

    /// The wait slot of `class` (as a stream entry names it), in [`Queue::CLASSES`].
    pub(super) fn class_slot(class: Option<&str>) -> usize {
        Self::CLASSES[..Self::CLASSES.len() - 1]
            .iter()
            .position(|c| Some(*c) == class)
            .unwrap_or(Self::CLASSES.len() - 1)
    }

    /// Observes the queue wait of a job of the class in `slot` ([`Queue::class_slot`]).
    pub(super) fn waited(&self, slot: usize, secs: f64) {
        self.wait[slot].observe(secs);
    }

    /// The metrics slot of `kind` (as a stream entry names it): a registered kind's, or `unknown`'s.
    pub(super) fn kind_slot(&self, kind: Option<&str>) -> usize {
        kind.and_then(|kind| self.ended.iter().position(|(k, _)| *k == kind)).unwrap_or(self.ended.len() - 1)
    }

    /// Counts a job of the kind in `slot` ([`Queue::kind_slot`]) that ended with `outcome` after `took`.
    pub(super) fn ended(&self, slot: usize, outcome: Outcome, took: Duration) {
        let (count, duration) = &self.ended[slot].1[outcome as usize];
        count.inc();
        duration.observe(took.as_secs_f64());
    }
}

/// An entry whose job ended and which the ack loop acknowledges: its queue and stream, entry id, and the job's
/// completion when the job had no transaction to record it in.
pub(super) type Done = (Arc<Queue>, Partition, String, Option<Finished>);

/// One stream the worker reads: a queue's whole stream or one of its partitions.
pub(super) type Lane = (Arc<Queue>, Partition);

/// A running job's cancellation: `requested` fires only when the job was canceled (not on a time-out or shutdown),
/// `token` is the one its handler sees.
#[derive(Clone)]
pub(super) struct Cancellation {
    pub(super) requested: CancellationToken,
    pub(super) token: CancellationToken,
}

/// The jobs running in this worker, and the cancellations it heard for jobs not (yet) running: one lock for both, so
/// that a job starting and its cancellation arriving at the same moment cannot miss each other.
#[derive(Default)]
pub(super) struct Running {
    pub(super) jobs: HashMap<Uuid, Cancellation>,
    /// Heard, with when: a job read before its cancellation, and started after it, must not run. Kept a minute.
    pub(super) canceled: HashMap<Uuid, std::time::Instant>,
}

impl Running {
    /// Registers a job about to run; false when a cancellation of it was heard.
    pub(super) fn start(&mut self, job: Uuid, cancellation: Cancellation) -> bool {
        if self.canceled.remove(&job).is_some() {
            return false;
        }
        self.jobs.insert(job, cancellation);
        true
    }

    /// Tells the running job of its cancellation, or remembers it for a job that starts later.
    pub(super) fn cancel(&mut self, job: Uuid) -> bool {
        if let Some(c) = self.jobs.get(&job) {
            c.requested.cancel();
            c.token.cancel();
            return true;
        }
        let now = std::time::Instant::now();
        self.canceled.retain(|_, heard| now.duration_since(*heard) < Duration::from_secs(60));
        self.canceled.insert(job, now);
        false
    }
}

/// The entries this worker holds, read and not yet acknowledged, by stream: the heartbeat keeps them from being taken
/// over.
#[derive(Default)]
pub(super) struct Tracker(Mutex<HashMap<(String, Partition), HashSet<String>>>);

impl Tracker {
    pub(super) fn track(&self, queue: &str, partition: Partition, ids: impl IntoIterator<Item = String>) {
        let mut held = self.0.lock().expect("tracker lock");
        held.entry((queue.to_owned(), partition)).or_default().extend(ids);
    }

    pub(super) fn untrack<'a>(&self, queue: &str, partition: Partition, ids: impl IntoIterator<Item = &'a String>) {
        if let Some(held) = self.0.lock().expect("tracker lock").get_mut(&(queue.to_owned(), partition)) {
            for id in ids {
                held.remove(id);
            }
        }
    }

    /// What it holds now, by stream.
    pub(super) fn snapshot(&self) -> Vec<((String, Partition), Vec<String>)> {
        let held = self.0.lock().expect("tracker lock");
        held.iter().map(|(stream, ids)| (stream.clone(), ids.iter().cloned().collect())).collect()
    }
}

pub(super) struct Inner {
    reader: Arc<Reader>,
    executor: Arc<Executor>,
    acker: Arc<Acker>,
    /// The runtime role's: the check of the role, the kinds' registry.
    runtime: PgPool,
    /// The finished entries the acker acknowledges: taken by [`Worker::run`], or by [`Worker::process_one`] for its
    /// step.
    ack_queue: Mutex<Option<mpsc::UnboundedReceiver<Done>>>,
}

/// Builds a [`Worker`].
pub struct WorkerBuilder {
    pool: PgPool,
    runtime: Option<PgPool>,
    control: Option<PgPool>,
    consumer: Consumer,
    handlers: Vec<Arc<dyn Registered>>,
    settings: WorkerSettings,
    metrics: Metrics,
}

impl WorkerBuilder {
    /// Registers `handler` for the jobs of kind `K`; the worker consumes `K`'s queue.
    pub fn handle<K: JobKind>(mut self, handler: impl Handler<K>) -> Self {
        self.handlers.push(Arc::new(Typed { handler, kind: PhantomData::<fn() -> K> }));
        self
    }

    /// Replaces the settings.
    pub fn settings(mut self, settings: WorkerSettings) -> Self {
        self.settings = settings;
        self
    }

    /// Runs at most `slots` jobs of `queue` at once (within the worker's concurrency), whatever its backlog: see
    /// [`WorkerSettings::queue_concurrency`].
    pub fn queue_concurrency(mut self, queue: &str, slots: usize) -> Self {
        self.settings.queue_concurrency.insert(queue.to_owned(), slots);
        self
    }

    /// Records into `metrics`.
    pub fn metrics(mut self, metrics: Metrics) -> Self {
        self.metrics = metrics;
        self
    }

    /// The runtime role's pool, in the multi-tenant mode ([`migrate_with`](crate::migrate_with)): the worker's
    /// bookkeeping checks and records the ends of many jobs of several workspaces in one statement (a skip check
    /// before a batch of jobs runs, the ends of jobs that ran without a transaction, the job of an entry Redis lost)
    /// and registers its kinds, which the application role may not. The jobs themselves run in transactions of the
    /// builder's pool, in their workspace. Without it the bookkeeping uses the builder's pool, as the single-role mode
    /// ([`migrate`](crate::migrate)) wants; an application role of the multi-tenant mode is refused it by PostgreSQL.
    pub fn runtime_pool(mut self, pool: PgPool) -> Self {
        self.runtime = Some(pool);
        self
    }

    /// The pool for keep-alives, progress and cancellations (default: two connections of their own, made with the
    /// main pool's options when first needed).
    pub fn control_pool(mut self, pool: PgPool) -> Self {
        self.control = Some(pool);
        self
    }

    /// The worker. Fails without handlers, on a kind registered twice or with an invalid name, and on settings it
    /// cannot run with.
    pub fn build(self) -> Result<Worker, crate::Error> {
        self.build_inner().map_err(crate::Error::invalid)
    }

    fn build_inner(self) -> anyhow::Result<Worker> {
        anyhow::ensure!(!self.handlers.is_empty(), "a worker needs at least one handler");
        let runtime = self.runtime.unwrap_or_else(|| self.pool.clone());
        anyhow::ensure!(self.settings.concurrency > 0, "concurrency must be at least 1");
        anyhow::ensure!(!self.settings.keepalive.is_zero(), "the operation keep-alive must be longer than zero");
        let mut handlers = HashMap::new();
        let mut queue_names: Vec<&'static str> = Vec::new();
        for handler in self.handlers {
            let (kind, queue) = (handler.kind(), handler.queue());
            anyhow::ensure!(kind::valid_kind_name(kind), "`{kind}` is not a valid kind name");
            anyhow::ensure!(kind::valid_queue_name(queue), "`{queue}` (of kind `{kind}`) is not a valid queue name");
            anyhow::ensure!(handler.max_attempts() >= 1, "kind `{kind}` must allow at least one attempt");
            anyhow::ensure!(
                handler.timeout() >= Duration::from_millis(1),
                "kind `{kind}` must have a time-out of at least 1 ms"
            );
            anyhow::ensure!(handlers.insert(kind, handler).is_none(), "kind `{kind}` has two handlers");
            if !queue_names.contains(&queue) {
                queue_names.push(queue);
            }
        }
        let kinds: Vec<&str> = handlers.keys().copied().collect();
        self.metrics.init_worker(&queue_names, &kinds);
        for (queue, &cap) in &self.settings.queue_concurrency {
            anyhow::ensure!(
                queue_names.contains(&queue.as_str()),
                "the slots of queue `{queue}` are set (CONVEYOR_WORKER_QUEUE_CONCURRENCY), but no kind of this worker \
                 is in that queue (its queues: {})",
                queue_names.join(", ")
            );
            anyhow::ensure!(cap >= 1, "queue `{queue}` must have at least one slot");
        }
        let caps = super::slots::caps(self.settings.concurrency, &queue_names, &self.settings.queue_concurrency);
        let queues: Vec<Arc<Queue>> = queue_names
            .into_iter()
            .zip(caps)
            .map(|(queue, cap)| {
                let kinds: Vec<&'static str> =
                    handlers.values().filter(|h| h.queue() == queue).map(|h| h.kind()).collect();
                Arc::new(Queue::new(queue, &kinds, cap, &self.metrics))
            })
            .collect();
        let control = self.control.unwrap_or_else(|| {
            crate::db::pool_options()
                .max_connections(2)
                .acquire_timeout(Duration::from_secs(5))
                .connect_lazy_with((*self.pool.connect_options()).clone())
        });
        self.metrics.watch_pool("worker_control", control.clone());
        self.metrics.worker_concurrency_limit.set(self.settings.concurrency as i64);
        let (acks, ack_queue) = mpsc::unbounded_channel();
        let tracker = Arc::new(Tracker::default());
        let running = Arc::new(Mutex::new(Running::default()));
        let executor = Arc::new(Executor {
            pool: self.pool.clone(),
            control: control.clone(),
            handlers,
            settings: self.settings.clone(),
            metrics: self.metrics.clone(),
            running: running.clone(),
            tracker: tracker.clone(),
            acks: acks.clone(),
            listeners: Listeners::new(runtime.clone()),
            consumer: Arc::from(self.consumer.name()),
        });
        let reader = Arc::new(Reader {
            consumer: self.consumer.clone(),
            runtime: runtime.clone(),
            pool: self.pool,
            lanes: Mutex::new(Arc::new(queues.iter().map(|q| (q.clone(), Partition::Whole)).collect())),
            queues,
            slots: Slots::new(self.settings.concurrency),
            settings: self.settings.clone(),
            metrics: self.metrics,
            tracker: tracker.clone(),
            acks,
            executor: executor.clone(),
        });
        let acker = Arc::new(Acker {
            consumer: self.consumer,
            runtime: runtime.clone(),
            control,
            visibility: self.settings.visibility,
            tracker,
            running,
        });
        Ok(Worker(Arc::new(Inner { reader, executor, acker, runtime, ack_queue: Mutex::new(Some(ack_queue)) })))
    }
}

/// Runs registered handlers over their queues' streams.
///
/// ```no_run
/// # use conveyor_jobs::{Handler, JobContext, JobError, JobKind, Worker};
/// # #[derive(serde::Serialize, serde::Deserialize)] struct SendReceipt { order_id: uuid::Uuid }
/// # impl JobKind for SendReceipt { const KIND: &'static str = "orders.send_receipt"; const QUEUE: &'static str = "emails"; }
/// # struct Receipts;
/// # impl Handler<SendReceipt> for Receipts {
/// #     async fn handle(&self, _: SendReceipt, _: &mut JobContext) -> Result<serde_json::Value, JobError> { Ok(serde_json::Value::Null) }
/// # }
/// # async fn f(pool: sqlx::PgPool) -> anyhow::Result<()> {
/// let consumer = conveyor_jobs::Consumer::connect("redis://127.0.0.1:6379", "conveyor").await?;
/// let worker = Worker::builder(pool, consumer).handle::<SendReceipt>(Receipts).build()?;
/// let shutdown = tokio_util::sync::CancellationToken::new();
/// worker.run(shutdown, std::time::Duration::from_secs(30)).await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Worker(pub(super) Arc<Inner>);

impl Worker {
    /// A builder over PostgreSQL (the application role's pool, for the jobs' transactions) and a stream consumer; the
    /// runtime role's pool follows ([`WorkerBuilder::runtime_pool`]).
    pub fn builder(pool: PgPool, consumer: Consumer) -> WorkerBuilder {
        WorkerBuilder {
            pool,
            runtime: None,
            control: None,
            consumer,
            handlers: Vec::new(),
            settings: WorkerSettings::default(),
            metrics: Metrics::new(),
        }
    }

    /// The queues it consumes.
    pub fn queues(&self) -> impl Iterator<Item = &str> {
        self.0.reader.queues()
    }

    /// Creates the consumer groups (and streams) if missing, in every stream of its queues (the whole stream, and
    /// each partition the layout or the consumer's setting names), and reads all of them from then on.
    pub async fn ensure_groups(&self) -> Result<(), RedisError> {
        self.0.reader.ensure_groups().await
    }

    /// Records its kinds, their queues and defaults in `job_kinds`, where the SQL enqueue function finds them (as the
    /// runtime role: a kind is every workspace's, and the application role only reads them).
    pub async fn register_kinds(&self) -> Result<(), sqlx::Error> {
        let handlers: Vec<&Arc<dyn Registered>> = self.0.executor.handlers.values().collect();
        let kinds: Vec<&str> = handlers.iter().map(|h| h.kind()).collect();
        let queues: Vec<&str> = handlers.iter().map(|h| h.queue()).collect();
        let attempts: Vec<i32> = handlers.iter().map(|h| h.max_attempts().min(1000) as i32).collect();
        let timeouts: Vec<i64> =
            handlers.iter().map(|h| h.timeout().as_millis().min(i64::MAX as u128) as i64).collect();
        sqlx::query(
            "INSERT INTO conveyor.job_kinds (kind, queue, max_attempts, timeout_ms)
             SELECT * FROM unnest($1::text[], $2::text[], $3::int4[], $4::int8[])
             ON CONFLICT (kind) DO UPDATE
             SET queue = excluded.queue, max_attempts = excluded.max_attempts, timeout_ms = excluded.timeout_ms,
                 updated_at = now()
             WHERE (job_kinds.queue, job_kinds.max_attempts, job_kinds.timeout_ms)
                   IS DISTINCT FROM (excluded.queue, excluded.max_attempts, excluded.timeout_ms)",
        )
        .bind(&kinds)
        .bind(&queues)
        .bind(&attempts)
        .bind(&timeouts)
        .execute(&self.0.runtime)
        .await?;
        Ok(())
    }

    /// Runs until `shutdown`; then reads no more and starts no more jobs, lets in-flight jobs finish (and
    /// acknowledge) within `grace`, and abandons whatever is still running, unacknowledged, to another worker.
    pub async fn run(self, shutdown: CancellationToken, grace: Duration) -> Result<(), crate::Error> {
        self.run_inner(shutdown, grace).await.public()
    }

    async fn run_inner(self, shutdown: CancellationToken, grace: Duration) -> anyhow::Result<()> {
        crate::db::ensure_runtime_role(&self.0.runtime, "worker").await?;
        loop {
            let ready = match self.ensure_groups().await {
                Ok(()) => self.register_kinds().await.map_err(|e| redact(&e.to_string())),
                Err(e) => Err(redact(&e.to_string())),
            };
            match ready {
                Ok(()) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "Cannot create consumer groups or register kinds yet; retrying");
                    tokio::select! {
                        _ = shutdown.cancelled() => return Ok(()),
                        _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    }
                }
            }
        }
        let (reader, acker) = (&self.0.reader, &self.0.acker);
        tracing::info!(consumer = reader.consumer.name(), queues = ?self.queues().collect::<Vec<_>>(), concurrency = reader.settings.concurrency, "Worker started");
        let jobs = TaskTracker::new();
        let abandon = CancellationToken::new();
        let readers = TaskTracker::new();
        readers.spawn(reader.clone().read_loop(shutdown.clone(), jobs.clone(), abandon.clone()));
        readers.spawn(reader.clone().reclaim_loop(shutdown.clone(), jobs.clone(), abandon.clone()));
        readers.close();
        let ack_queue = self.0.ack_queue.lock().expect("ack queue lock").take().context("a worker runs once")?;
        let ack_stop = CancellationToken::new();
        let acks = tokio::spawn(acker.clone().ack_loop(ack_queue, ack_stop.clone()));
        // The heartbeat and the cancellation listener outlive the readers: jobs finishing during shutdown must
        // neither look dead nor miss their cancellation meanwhile.
        let heartbeat_stop = CancellationToken::new();
        let heartbeat = tokio::spawn(acker.clone().heartbeat_loop(heartbeat_stop.clone()));
        let cancels = tokio::spawn(acker.clone().cancel_loop(heartbeat_stop.clone()));

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
        let _ = acks.await;
        heartbeat_stop.cancel();
        let _ = heartbeat.await;
        let _ = cancels.await;
        tracing::info!("Worker stopped");
        Ok(())
    }

    /// One step, for tests and one-shot tools: takes one entry that waits in its queues now (without blocking), runs
    /// its job to its end and settles it (records the end, acknowledges). `None` when every queue is empty. Fails
    /// while [`Worker::run`] runs (the two would share the acknowledgements).
    pub async fn process_one(&self) -> Result<Option<Outcome>, crate::Error> {
        self.process_one_inner().await.public()
    }

    async fn process_one_inner(&self) -> anyhow::Result<Option<Outcome>> {
        let mut acks = self
            .0
            .ack_queue
            .lock()
            .expect("ack queue lock")
            .take()
            .ok_or_else(|| anyhow::anyhow!("process_one cannot be used while the worker runs"))?;
        let outcome = self.0.reader.take_one().await;
        let mut done = Vec::new();
        while let Ok(d) = acks.try_recv() {
            done.push(d);
        }
        self.0.acker.settle(done).await;
        *self.0.ack_queue.lock().expect("ack queue lock") = Some(acks);
        outcome
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream::keys::Keys;
    use crate::worker::{JobContext, JobError};

    #[derive(serde::Serialize, serde::Deserialize)]
    struct Ping;

    impl JobKind for Ping {
        const KIND: &'static str = "test.ping";
        const QUEUE: &'static str = "test";
    }

    #[derive(serde::Serialize, serde::Deserialize)]
    struct BadName;

    impl JobKind for BadName {
        const KIND: &'static str = "Not A Kind";
        const QUEUE: &'static str = "test";
    }

    struct Nothing;

    impl<K: JobKind> Handler<K> for Nothing {
        async fn handle(&self, _job: K, _cx: &mut JobContext) -> Result<serde_json::Value, JobError> {
            Ok(serde_json::Value::Null)
        }
    }

    fn cancellation() -> Cancellation {
        Cancellation { requested: CancellationToken::new(), token: CancellationToken::new() }
    }

    #[test]
    fn a_cancellation_heard_before_its_job_starts_keeps_it_from_starting_and_one_heard_while_it_runs_tells_it() {
        let mut running = Running::default();
        let (early, late) = (Uuid::now_v7(), Uuid::now_v7());
        assert!(!running.cancel(early), "not running yet: remembered");
        assert!(!running.start(early, cancellation()), "a job canceled before it starts never starts");
        let c = cancellation();
        assert!(running.start(late, c.clone()));
        assert!(running.cancel(late), "a running job is told");
        assert!(c.requested.is_cancelled() && c.token.is_cancelled());
    }

    #[tokio::test]
    async fn settings_a_worker_cannot_run_with_are_refused_when_it_is_built() {
        // Nothing connects: a lazy pool and clients that were never initialised.
        let pool = sqlx::postgres::PgPoolOptions::new().connect_lazy("postgres://127.0.0.1:1/none").unwrap();
        let client = || fred::prelude::Builder::default_centralized().build().unwrap();
        let bare = || Worker::builder(pool.clone(), Consumer::new(client(), client(), Keys::new("t"), "c".into()));
        // Without a runtime pool, the bookkeeping uses the main pool (the single-role mode).
        assert!(bare().handle::<Ping>(Nothing).build().is_ok(), "a runtime pool is optional");
        let builder = || bare().runtime_pool(pool.clone());
        let build = |settings: WorkerSettings| {
            builder().handle::<Ping>(Nothing).settings(settings).build().map(|_| ()).map_err(|e| e.to_string())
        };
        assert_eq!(build(WorkerSettings::default()), Ok(()));
        let no_slots = build(WorkerSettings { concurrency: 0, ..WorkerSettings::default() });
        assert!(no_slots.unwrap_err().contains("concurrency"));
        let no_keepalive = build(WorkerSettings { keepalive: Duration::ZERO, ..WorkerSettings::default() });
        assert!(no_keepalive.unwrap_err().contains("keep-alive"));
        let twice = builder().handle::<Ping>(Nothing).handle::<Ping>(Nothing).build();
        assert!(twice.err().unwrap().to_string().contains("two handlers"));
        let bad = builder().handle::<BadName>(Nothing).build();
        assert!(bad.err().unwrap().to_string().contains("Not A Kind"));
        assert!(builder().build().err().unwrap().to_string().contains("at least one handler"));
    }

    #[test]
    fn queue_wait_is_observed_by_the_entrys_class_or_unknown() {
        let metrics = Metrics::new();
        let queue = Queue::new("test", &["test.ping"], 1, &metrics);
        for class in [Some("light"), Some("backlogged"), Some("backlogged"), None, Some("other")] {
            queue.waited(Queue::class_slot(class), 0.1);
        }
        let count = |class: &str| metrics.job_queue_wait.with_label_values(&["test", class]).get_sample_count();
        assert_eq!((count("light"), count("backlogged"), count("unknown")), (1, 2, 2));
    }
}
