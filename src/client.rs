//! [`Conveyor`]: the platform in one value, over one PostgreSQL pool and one Redis. It enqueues and controls jobs
//! (in its workspace, [`WorkspaceId::DEFAULT`] unless told), builds the worker, the dispatcher and maintenance over
//! the same connections and metrics, and runs them in-process until a shutdown token fires.

use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::admin::Admin;
use crate::dispatcher::{Dispatcher, DispatcherSettings};
use crate::ids::{JobId, WorkspaceId};
use crate::kind::JobKind;
use crate::maintenance::Maintenance;
use crate::metrics::Metrics;
use crate::outbox::control::{CancelError, JobInfo, WaitError};
use crate::outbox::{EnqueueError, EnqueueOptions, Enqueued};
use crate::stream::consumer::Consumer;
use crate::stream::keys::Keys;
use crate::stream::producer::Producer;
use crate::stream::{RedisClient, RedisTls};
use crate::worker::{Worker, WorkerBuilder};
use crate::{Error, WorkspaceTx};

/// How often maintenance passes by default (`CONVEYOR_MAINTENANCE_INTERVAL` of the server).
pub const DEFAULT_MAINTENANCE_INTERVAL: Duration = Duration::from_secs(30);

/// After how long without progress an unfinished operation, or a dispatched job whose stream entry Redis lost, is
/// re-driven by maintenance, by default (`CONVEYOR_RECONCILE_AFTER` of the server).
pub const DEFAULT_RECONCILE_AFTER: Duration = Duration::from_secs(300);

/// The platform in one value: enqueue, control, and run jobs over one PostgreSQL pool and one Redis.
///
/// Size the pool for the worker's concurrency ([`crate::WorkerSettings::concurrency`], 16 by default: each running
/// job may hold a connection for its transaction) plus about four: the dispatcher holds one for `LISTEN`, each
/// [`Conveyor::wait_for_job`] one while it waits, and the relay and the worker's bookkeeping take one briefly. The
/// worker opens two connections of its own for progress and cancellations. sqlx's `PgPool::connect` makes 10.
/// [`crate::connect_postgres`] (or [`crate::postgres_pool_options`]) opens it as Conveyor opens its own: without
/// sqlx's round trip to check each connection it hands out, but for one idle a second or more.
///
/// One worker per `Conveyor`: [`Conveyor::worker`] gives every worker the same blocking Redis client, on which their
/// `XREADGROUP BLOCK` calls would wait behind each other. A second worker in one process takes a second `Conveyor`.
///
/// ```no_run
/// # use conveyor_jobs::{Conveyor, EnqueueOptions, Handler, JobContext, JobError, JobKind};
/// # #[derive(serde::Serialize, serde::Deserialize)] struct Ping;
/// # impl JobKind for Ping { const KIND: &'static str = "ping"; const QUEUE: &'static str = "pings"; }
/// # struct Pong;
/// # impl Handler<Ping> for Pong {
/// #     async fn handle(&self, _: Ping, _: &mut JobContext) -> Result<serde_json::Value, JobError> { Ok(().into()) }
/// # }
/// # async fn f(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// conveyor_jobs::migrate(&pool).await?;
/// let conveyor = Conveyor::connect(pool, "redis://127.0.0.1:6379").await?;
/// let shutdown = tokio_util::sync::CancellationToken::new();
/// let worker = conveyor.worker().handle::<Ping>(Pong).build()?;
/// let running = tokio::spawn(conveyor.clone().run(worker, shutdown.clone()));
/// let job = conveyor.enqueue(&Ping, EnqueueOptions::new()).await?;
/// conveyor.wait_for_job(job.id, std::time::Duration::from_secs(10)).await?;
/// shutdown.cancel();
/// running.await??;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Conveyor {
    pool: PgPool,
    runtime: PgPool,
    redis: RedisClient,
    blocking: RedisClient,
    keys: Keys,
    metrics: Metrics,
    workspace: WorkspaceId,
    dispatcher: DispatcherSettings,
    maintenance_interval: Duration,
    reconcile_after: Duration,
}

/// Builds a [`Conveyor`]: [`Conveyor::builder`].
#[must_use]
pub struct ConveyorBuilder {
    pool: PgPool,
    runtime: Option<PgPool>,
    redis_url: String,
    tls: RedisTls,
    prefix: String,
    metrics: Option<Metrics>,
    workspace: WorkspaceId,
    dispatcher: DispatcherSettings,
    maintenance_interval: Duration,
    reconcile_after: Duration,
}

impl ConveyorBuilder {
    /// The prefix of every Redis key (default `conveyor`): services that share a Redis each take their own.
    pub fn prefix(mut self, prefix: &str) -> Self {
        self.prefix = prefix.to_owned();
        self
    }

    /// TLS files for a `rediss://` URL (a private CA, a client certificate).
    pub fn redis_tls(mut self, tls: RedisTls) -> Self {
        self.tls = tls;
        self
    }

    /// The runtime role's pool, in the multi-tenant mode ([`migrate_with`](crate::migrate_with)): the dispatcher,
    /// maintenance and the worker's bookkeeping use it, the jobs' transactions the main pool. Without it they all use
    /// the main pool, as the single-role mode ([`migrate`](crate::migrate)) wants.
    pub fn runtime_pool(mut self, pool: PgPool) -> Self {
        self.runtime = Some(pool);
        self
    }

    /// Records into `metrics` (for instance [`Metrics::registered_in`] the host's registry, so that its own
    /// `/metrics` shows Conveyor's series); default: metrics of its own, in [`Conveyor::metrics`].
    pub fn metrics(mut self, metrics: Metrics) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// The workspace that [`Conveyor::enqueue`], [`Conveyor::begin`] and the job controls work in (default
    /// [`WorkspaceId::DEFAULT`]); [`Conveyor::in_workspace`] gives another per call.
    pub fn workspace(mut self, workspace: WorkspaceId) -> Self {
        self.workspace = workspace;
        self
    }

    /// The dispatcher's settings (default [`DispatcherSettings::default`]), checked by [`ConveyorBuilder::connect`].
    pub fn dispatcher_settings(mut self, settings: DispatcherSettings) -> Self {
        self.dispatcher = settings;
        self
    }

    /// How often maintenance passes ([`DEFAULT_MAINTENANCE_INTERVAL`]) and after how long without progress it
    /// re-drives an unfinished operation or a job Redis lost ([`DEFAULT_RECONCILE_AFTER`]).
    pub fn maintenance(mut self, interval: Duration, reconcile_after: Duration) -> Self {
        self.maintenance_interval = interval;
        self.reconcile_after = reconcile_after;
        self
    }

    /// Checks the settings and connects to Redis (a client for commands, another for the worker's blocking reads).
    pub async fn connect(self) -> Result<Conveyor, Error> {
        self.dispatcher.validate().map_err(|e| Error::invalid(e.into()))?;
        if self.maintenance_interval.is_zero() {
            return Err(Error::invalid(anyhow::anyhow!("the maintenance interval must be longer than zero")));
        }
        if self.reconcile_after < Duration::from_secs(1) {
            return Err(Error::invalid(anyhow::anyhow!("reconcile_after must be at least a second")));
        }
        let connect = |timeout| crate::stream::connect_with(&self.redis_url, timeout, &self.tls);
        let redis = connect(Duration::from_secs(5)).await.map_err(|e| Error::new(e.into()))?;
        let blocking = connect(Duration::from_secs(10)).await.map_err(|e| Error::new(e.into()))?;
        let metrics = self.metrics.unwrap_or_default();
        let runtime = self.runtime.unwrap_or_else(|| self.pool.clone());
        metrics.watch_pool("conveyor", self.pool.clone());
        // `conveyor_build_info{role="embedded"}`: the dashboard's version panel, for a service that embeds Conveyor.
        metrics.set_role("embedded");
        Ok(Conveyor {
            pool: self.pool,
            runtime,
            redis,
            blocking,
            keys: Keys::new(&self.prefix),
            metrics,
            workspace: self.workspace,
            dispatcher: self.dispatcher,
            maintenance_interval: self.maintenance_interval,
            reconcile_after: self.reconcile_after,
        })
    }
}

impl Conveyor {
    /// A builder over `pool` (its role owns Conveyor's schema in the single-role mode; the application role in the
    /// multi-tenant mode) and the Redis at `redis_url`.
    pub fn builder(pool: PgPool, redis_url: &str) -> ConveyorBuilder {
        ConveyorBuilder {
            pool,
            runtime: None,
            redis_url: redis_url.to_owned(),
            tls: RedisTls::default(),
            prefix: "conveyor".to_owned(),
            metrics: None,
            workspace: WorkspaceId::DEFAULT,
            dispatcher: DispatcherSettings::default(),
            maintenance_interval: DEFAULT_MAINTENANCE_INTERVAL,
            reconcile_after: DEFAULT_RECONCILE_AFTER,
        }
    }

    /// [`Conveyor::builder`] with every default: key prefix `conveyor`, workspace [`WorkspaceId::DEFAULT`].
    pub async fn connect(pool: PgPool, redis_url: &str) -> Result<Self, Error> {
        Self::builder(pool, redis_url).connect().await
    }

    /// The same platform working in `workspace` (a tenant of a multi-tenant service).
    pub fn in_workspace(&self, workspace: WorkspaceId) -> Self {
        Self { workspace, ..self.clone() }
    }

    /// The workspace it enqueues and controls jobs in.
    pub fn workspace(&self) -> WorkspaceId {
        self.workspace
    }

    /// The main pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The metrics every part built from it records into.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// The Redis key layout.
    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    /// Begins a transaction in its workspace: write your rows and enqueue jobs in it ([`crate::enqueue_tx`]), then
    /// commit; the jobs exist exactly when the rows do.
    pub async fn begin(&self) -> Result<WorkspaceTx, sqlx::Error> {
        crate::begin_workspace(&self.pool, self.workspace).await
    }

    /// Enqueues one job in a transaction of its own (BullMQ's `queue.add`). To enqueue with your own writes, use
    /// [`Conveyor::begin`] and [`crate::enqueue_tx`].
    pub async fn enqueue<K: JobKind>(&self, job: &K, options: EnqueueOptions) -> Result<Enqueued, EnqueueError> {
        let mut tx = self.begin().await?;
        let enqueued = crate::enqueue_tx(&mut tx, job, options).await?;
        tx.commit().await?;
        Ok(enqueued)
    }

    /// Enqueues a flow, a job with its children, in a transaction of its own ([`crate::enqueue_flow_tx`]).
    pub async fn enqueue_flow(&self, flow: crate::Flow) -> Result<crate::EnqueuedFlow, EnqueueError> {
        let mut tx = self.begin().await?;
        let enqueued = crate::enqueue_flow_tx(&mut tx, flow).await?;
        tx.commit().await?;
        Ok(enqueued)
    }

    /// The children of the flow job `id`, with how each ended ([`crate::get_children`]).
    pub async fn children(&self, id: JobId) -> Result<Vec<JobInfo>, sqlx::Error> {
        crate::get_children(&self.pool, self.workspace, id).await
    }

    /// The job `id` of its workspace, or `None`.
    pub async fn get_job(&self, id: JobId) -> Result<Option<JobInfo>, sqlx::Error> {
        crate::get_job(&self.pool, self.workspace, id).await
    }

    /// Cancels the job `id` ([`crate::cancel_job`]).
    pub async fn cancel_job(&self, id: JobId) -> Result<(), CancelError> {
        crate::cancel_job(&self.pool, self.workspace, id).await
    }

    /// Subscribes to the events of its workspace's jobs that `filter` selects ([`crate::subscribe_events`]).
    pub async fn subscribe_events(&self, filter: crate::EventFilter) -> Result<crate::JobEvents, sqlx::Error> {
        crate::subscribe_events(&self.pool, self.workspace, filter).await
    }

    /// The log of the job `id`, oldest line first ([`crate::get_job_logs`]).
    pub async fn job_logs(&self, id: JobId) -> Result<Vec<crate::LogLine>, sqlx::Error> {
        crate::get_job_logs(&self.pool, self.workspace, id).await
    }

    /// Changes the waiting job `id`: its priority, due time or payload ([`crate::change_job`]).
    pub async fn change_job(
        &self,
        id: JobId,
        change: &crate::JobChange,
    ) -> Result<chrono::DateTime<chrono::Utc>, crate::ChangeError> {
        crate::change_job(&self.pool, self.workspace, id, change).await
    }

    /// Cancels every waiting job in `scope` ([`crate::drain_jobs`]); returns how many.
    pub async fn drain_jobs(&self, scope: &crate::JobScope) -> Result<u64, sqlx::Error> {
        crate::drain_jobs(&self.pool, self.workspace, scope).await
    }

    /// Deletes the ended jobs `clean` matches ([`crate::clean_jobs`]); returns how many.
    pub async fn clean_jobs(&self, clean: &crate::CleanJobs) -> Result<u64, sqlx::Error> {
        crate::clean_jobs(&self.pool, self.workspace, clean).await
    }

    /// Makes every delayed job in `scope` due now ([`crate::promote_jobs`]); returns how many.
    pub async fn promote_jobs(&self, scope: &crate::JobScope) -> Result<u64, sqlx::Error> {
        crate::promote_jobs(&self.pool, self.workspace, scope).await
    }

    /// Replays every failed job in `scope` ([`crate::retry_jobs`]).
    pub async fn retry_jobs(&self, scope: &crate::JobScope) -> Result<crate::Retried, sqlx::Error> {
        crate::retry_jobs(&self.pool, self.workspace, scope).await
    }

    /// Empties `queue` ([`crate::obliterate_queue`]): refused while its jobs run, unless `force`.
    pub async fn obliterate_queue(
        &self,
        queue: &str,
        force: bool,
    ) -> Result<crate::Obliterated, crate::ObliterateError> {
        crate::obliterate_queue(&self.pool, self.workspace, queue, force).await
    }

    /// Waits until the job `id` ends, at most `timeout` ([`crate::wait_for_job`]).
    pub async fn wait_for_job(&self, id: JobId, timeout: Duration) -> Result<JobInfo, WaitError> {
        crate::wait_for_job(&self.pool, self.workspace, id, timeout).await
    }

    /// The operator module over its pool and Redis, for the single-role mode, where the pool's role owns the schema
    /// and may do what an operator does: list and change jobs, dead letters, pauses and schedules across workspaces,
    /// every call audited. Mount it in the host's router with the feature `console`
    /// (`conveyor_jobs::console::Console::new(conveyor.admin())`). In the multi-tenant mode, build
    /// [`Admin::new`] over a pool of the operator role instead.
    pub fn admin(&self) -> Admin {
        Admin::new(self.pool.clone(), self.pool.clone(), self.redis.clone(), self.keys.clone())
    }

    /// A worker builder over its pools, Redis and metrics: add handlers, then `build()`.
    pub fn worker(&self) -> WorkerBuilder {
        let consumer =
            Consumer::new(self.redis.clone(), self.blocking.clone(), self.keys.clone(), crate::ids::instance_name());
        Worker::builder(self.pool.clone(), consumer).runtime_pool(self.runtime.clone()).metrics(self.metrics.clone())
    }

    /// The dispatcher (the relay from the outbox into the streams) over its runtime pool, Redis and metrics.
    pub fn dispatcher(&self) -> Dispatcher {
        let producer = Producer::new(self.redis.clone(), self.keys.clone(), self.dispatcher.dedup_ttl);
        Dispatcher::new(
            self.runtime.clone(),
            producer,
            self.dispatcher.clone(),
            self.metrics.clone(),
            crate::ids::instance_name(),
        )
    }

    /// Maintenance (retention of ended jobs, dead letters and the audit trail; the reconciler that re-drives what
    /// Redis lost) over its runtime pool, Redis and metrics.
    pub fn maintenance(&self) -> Maintenance {
        Maintenance::new(
            self.runtime.clone(),
            self.redis.clone(),
            self.keys.clone(),
            self.metrics.clone(),
            self.maintenance_interval,
            self.dispatcher.retention,
            self.reconcile_after,
        )
    }

    /// Runs `worker`, the dispatcher and maintenance in this process until `shutdown` (the worker finishes its
    /// running jobs for up to 30 s), or until one of them fails: then the others are stopped too (with the same
    /// grace) and its error is returned. A failed pass of the relay or of maintenance is logged and retried, not a
    /// failure; what fails is what cannot run at all (a pool whose role may not do a part's work, a lost worker).
    /// Dropping or aborting the future stops the three at once, without the grace. For only some of them, run
    /// [`Conveyor::dispatcher`], [`Conveyor::maintenance`] or a worker alone.
    pub async fn run(self, worker: Worker, shutdown: CancellationToken) -> Result<(), Error> {
        let stop = shutdown.child_token();
        let mut parts = tokio::task::JoinSet::new();
        parts.spawn(self.dispatcher().run(stop.clone()));
        parts.spawn(self.maintenance().run(stop.clone()));
        parts.spawn(worker.run(stop.clone(), Duration::from_secs(30)));
        let mut first_error = None;
        while let Some(ended) = parts.join_next().await {
            let result = ended.unwrap_or_else(|e| Err(Error::new(anyhow::anyhow!("a part of Conveyor panicked: {e}"))));
            if let Err(e) = result {
                stop.cancel();
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}
