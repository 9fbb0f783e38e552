//! The maintenance role: the queues' minutes for the operator's charts, the expiry of jobs waiting past their deadline,
//! periodic retention of ended outbox events, of dead letters and of the operators' audit trail (and of whatever a
//! host adds with [`Maintenance::with_purge`]), and the reconciler that re-drives jobs Redis lost. Each pass is
//! bounded; the loop sleeps between passes. Its pool is the runtime role's: it finds the workspaces to clean through
//! functions that read across workspaces, then cleans each in its own context.

use crate::error::Public;
use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use futures_util::future::BoxFuture;

use crate::metrics::Metrics;
use crate::outbox::reconcile;
use crate::outbox::transitions::{self, relay as claim};
use crate::stream::RedisClient;
use crate::stream::keys::Keys;

/// Rows deleted per statement.
pub const BATCH: i64 = 1000;
/// Statements per pass, so that one pass never holds the database for long.
pub const MAX_BATCHES_PER_PASS: usize = 100;

/// What one pass did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct PassReport {
    /// Rows each of the host's purges ([`Maintenance::with_purge`]) removed, by name.
    pub host_purged: Vec<(&'static str, u64)>,
    /// Dispatched outbox events past their retention deleted.
    pub outbox_purged: u64,
    /// Stalled jobs re-driven from PostgreSQL.
    pub redriven: u64,
    /// Entries of the audit trail past their retention deleted.
    pub audit_purged: u64,
    /// Dead letters past their retention discarded.
    pub dead_letters_purged: u64,
    /// De-duplication keys that held nothing any more forgotten: throttles whose period is over, debounces whose job
    /// no longer lives.
    pub dedup_keys_purged: u64,
    /// Jobs past a retention of their own ([`crate::Keep`]) removed: succeeded ones deleted, failed ones discarded.
    pub kept_jobs_purged: u64,
    /// Jobs waiting in the outbox past their deadline ([`crate::EnqueueOptions::expire_at`]) canceled as expired.
    pub expired: u64,
    /// Job events ([`crate::subscribe_events`]) older than an hour, and event subscriptions that expired, removed.
    pub job_events_purged: u64,
}

impl PassReport {
    /// Whether the pass removed, re-drove or expired anything.
    pub fn removed_any(&self) -> bool {
        self.outbox_purged
            + self.redriven
            + self.audit_purged
            + self.dead_letters_purged
            + self.dedup_keys_purged
            + self.kept_jobs_purged
            + self.expired
            + self.job_events_purged
            > 0
            || self.host_purged.iter().any(|(_, n)| *n > 0)
    }
}

/// Default retention of the audit trail (`CONVEYOR_AUDIT_RETENTION`).
pub const DEFAULT_AUDIT_RETENTION: Duration = Duration::from_secs(90 * 24 * 3600);

/// Default retention of dead letters (`CONVEYOR_DEAD_LETTER_RETENTION`).
pub const DEFAULT_DEAD_LETTER_RETENTION: Duration = Duration::from_secs(30 * 24 * 3600);

/// Periodic housekeeping over one database.
pub struct Maintenance {
    pool: PgPool,
    redis: RedisClient,
    keys: Keys,
    metrics: Metrics,
    interval: Duration,
    outbox_retention: Duration,
    reconcile_after: Duration,
    audit_retention: Duration,
    dead_letter_retention: Duration,
    purges: Vec<(&'static str, Purge)>,
}

/// A host's own bounded retention: given the maintenance pool, removes what it keeps no longer; answers how many.
type Purge = Box<dyn Fn(PgPool) -> BoxFuture<'static, Result<u64, sqlx::Error>> + Send + Sync>;

impl Maintenance {
    /// Housekeeping every `interval` over `pool` (the runtime role's); ended jobs are kept `outbox_retention`;
    /// operations without progress for `reconcile_after`, and jobs without an operation dispatched that long ago whose
    /// entry Redis (with keys `keys`) lost, are re-driven. The audit trail is kept [`DEFAULT_AUDIT_RETENTION`].
    pub fn new(
        pool: PgPool,
        redis: RedisClient,
        keys: Keys,
        metrics: Metrics,
        interval: Duration,
        outbox_retention: Duration,
        reconcile_after: Duration,
    ) -> Self {
        Self {
            pool,
            redis,
            keys,
            metrics,
            interval,
            outbox_retention,
            reconcile_after,
            audit_retention: DEFAULT_AUDIT_RETENTION,
            dead_letter_retention: DEFAULT_DEAD_LETTER_RETENTION,
            purges: Vec::new(),
        }
    }

    /// Adds a host's own retention to every pass, after the platform's: `purge` gets the maintenance pool and answers
    /// how many rows it removed (reported under `name`). Keep it bounded, as the platform's purges are (at most
    /// [`MAX_BATCHES_PER_PASS`] statements of [`BATCH`] rows); an error fails the pass, which the next interval retries.
    pub fn with_purge<F>(mut self, name: &'static str, purge: impl Fn(PgPool) -> F + Send + Sync + 'static) -> Self
    where
        F: Future<Output = Result<u64, sqlx::Error>> + Send + 'static,
    {
        self.purges.push((name, Box::new(move |pool| Box::pin(purge(pool)))));
        self
    }

    /// Keeps the audit trail `retention` (at least a day: the database refuses less).
    pub fn with_audit_retention(mut self, retention: Duration) -> Self {
        self.audit_retention = retention;
        self
    }

    /// Keeps dead letters `retention` (at least a day: the database refuses less).
    pub fn with_dead_letter_retention(mut self, retention: Duration) -> Self {
        self.dead_letter_retention = retention;
        self
    }

    /// Discards dead letters older than their retention, [`BATCH`] at a time, as an operator's discard does (their
    /// operations stay failed); how many. Never younger ones than the retention `conveyor migrate` recorded
    /// (migration 0036), whatever this process was given; each purge that discarded any is on the audit trail.
    pub(crate) async fn purge_dead_letters(&self) -> Result<u64, sqlx::Error> {
        self.purge(
            "SELECT conveyor.conveyor_dead_letter_purge(make_interval(secs => $1), $2)",
            self.dead_letter_retention,
        )
        .await
    }

    /// Deletes the audit trail's entries older than its retention, [`BATCH`] at a time; how many. Never younger ones
    /// than the retention `conveyor migrate` recorded (the purge function's floor, migration 0035), whatever this
    /// process was given.
    pub(crate) async fn purge_audit(&self) -> Result<u64, sqlx::Error> {
        self.purge("SELECT conveyor.conveyor_audit_purge(make_interval(secs => $1), $2)", self.audit_retention).await
    }

    /// Runs `purge` (a purge function's call: `$1` the retention in seconds, `$2` the batch, answering how many it
    /// removed) until a batch comes back short, at most [`MAX_BATCHES_PER_PASS`] times; how many in all.
    async fn purge(&self, purge: &'static str, retention: Duration) -> Result<u64, sqlx::Error> {
        let mut purged = 0;
        for _ in 0..MAX_BATCHES_PER_PASS {
            let (done,): (i64,) =
                sqlx::query_as(purge).bind(retention.as_secs_f64()).bind(BATCH as i32).fetch_one(&self.pool).await?;
            purged += done as u64;
            if done < BATCH {
                break;
            }
        }
        Ok(purged)
    }

    /// Runs `purge` (a function of at most `$1` rows a call, answering how many it removed) until a call comes back
    /// short, at most [`MAX_BATCHES_PER_PASS`] times: de-duplication keys that hold nothing any more, jobs past a
    /// retention of their own. How many in all.
    async fn batches(&self, purge: &'static str) -> Result<u64, sqlx::Error> {
        let mut purged = 0;
        for _ in 0..MAX_BATCHES_PER_PASS {
            let done: i64 = sqlx::query_scalar(purge).bind(BATCH as i32).fetch_one(&self.pool).await?;
            purged += done as u64;
            if done < BATCH {
                break;
            }
        }
        Ok(purged)
    }

    /// One bounded pass.
    pub async fn run_once(&self) -> Result<PassReport, crate::Error> {
        self.run_once_inner().await.public()
    }

    async fn run_once_inner(&self) -> anyhow::Result<PassReport> {
        // First, while the ends since the last pass are all still there (a retention of a job's own removes it below).
        // The charts are worth less than the retention: a failure here is logged, and the pass goes on.
        if let Err(e) = sqlx::query("SELECT conveyor.conveyor_record_queue_minutes()").execute(&self.pool).await {
            tracing::warn!(error = %crate::redact(&e.to_string()), "Could not record the queues' minutes");
        }
        // Before retention: an expired job is kept as long as any canceled one. A failure is logged, and the pass
        // goes on: the next one expires what this one could not.
        let (expired, done) = transitions::expire_waiting(&self.pool, BATCH).await;
        self.metrics.jobs_expired.inc_by(expired);
        if let Err(e) = done {
            tracing::warn!(error = %crate::redact(&e.to_string()), expired, "Could not expire every job past its deadline");
        }
        let outbox_purged =
            claim::purge_finished(&self.pool, self.outbox_retention, BATCH, MAX_BATCHES_PER_PASS).await?;
        self.metrics.outbox_events_purged.inc_by(outbox_purged);
        let stalled = reconcile::redrive_stalled(&self.pool, self.reconcile_after, BATCH).await?;
        let lost = reconcile::redrive_lost(&self.pool, &self.redis, &self.keys, self.reconcile_after, BATCH).await?;
        let redriven = stalled + lost;
        self.metrics.outbox_redriven.inc_by(redriven);
        let audit_purged = self.purge_audit().await?;
        let dead_letters_purged = self.purge_dead_letters().await?;
        self.metrics.dead_letters_purged.inc_by(dead_letters_purged);
        let dedup_keys_purged = self.batches("SELECT conveyor.conveyor_dedup_keys_purge($1)").await?;
        let kept_jobs_purged = self.batches("SELECT conveyor.conveyor_kept_jobs_purge($1)").await?;
        let job_events_purged = self.batches("SELECT conveyor.conveyor_job_events_purge($1)").await?;
        let mut host_purged = Vec::with_capacity(self.purges.len());
        for (name, purge) in &self.purges {
            host_purged.push((*name, purge(self.pool.clone()).await?));
        }
        Ok(PassReport {
            host_purged,
            outbox_purged,
            redriven,
            audit_purged,
            dead_letters_purged,
            dedup_keys_purged,
            kept_jobs_purged,
            expired,
            job_events_purged,
        })
    }

    /// Passes every interval until `shutdown`. A failed pass is logged and retried at the next interval.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), crate::Error> {
        loop {
            match self.run_once().await {
                Ok(report) if report.removed_any() => tracing::info!(?report, "Maintenance pass done"),
                Ok(_) => {}
                Err(e) => tracing::warn!(error = ?e, "Maintenance pass failed; retrying next interval"),
            }
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                _ = tokio::time::sleep(self.interval) => {}
            }
        }
    }
}
