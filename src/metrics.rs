//! Every Prometheus metric, defined in one place and registered in one registry (served on the admin port).
//!
//! Names follow `conveyor_<thing>_<unit>[_total]`; labels come from small fixed sets only (never ids, keys,
//! workspaces or raw paths). Queue names are a fixed set defined in code.
//!
//! Labelled counters whose label values are known in advance are created at 0 when the part that counts them starts
//! (`init_*`), so that `increase()` sees their first event. `conveyor_build_info{role}` tells the roles apart; the
//! process collector (`process_*`) and the connection pools (`conveyor_db_pool_*`, read at scrape) complete the
//! picture of one process.

use std::sync::{Arc, Mutex};

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{
    GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};
use sqlx::PgPool;

/// The reasons of `conveyor_job_dead_letters_total` (the worker's dead-letter paths).
pub(crate) const JOB_DEAD_LETTER_REASONS: [&str; 5] =
    ["no_handler", "undecodable", "permanent", "exhausted", "worker_stopped"];
/// The reasons of `conveyor_outbox_dispatch_errors_total` (the relay's failures).
pub(crate) const DISPATCH_ERROR_REASONS: [&str; 3] = ["database", "redis_unavailable", "redis_error"];
/// The passes of `conveyor_outbox_relay_passes_total`: a sweep looks up every workspace with due jobs, a named pass
/// relays the workspaces that notifications named, a tick is an awake dispatcher's look for new jobs (migration 0039).
pub(crate) const RELAY_PASSES: [&str; 3] = ["sweep", "named", "tick"];

/// The source revision this binary was built from (`CONVEYOR_GIT_REVISION` at build time), or `unknown`.
pub(crate) const REVISION: &str = match option_env!("CONVEYOR_GIT_REVISION") {
    Some(revision) => revision,
    None => "unknown",
};

/// The metrics of one process.
#[derive(Clone)]
pub struct Metrics {
    /// The registry `/metrics` renders.
    pub registry: Registry,
    /// `conveyor_outbox_dispatched_total{queue}`.
    pub outbox_dispatched: IntCounterVec,
    /// `conveyor_outbox_dispatch_errors_total{reason}`.
    pub outbox_dispatch_errors: IntCounterVec,
    /// `conveyor_outbox_dead_letters_total{queue}`.
    pub outbox_dead_letters: IntCounterVec,
    /// `conveyor_outbox_dispatch_latency_seconds{queue}`: commit to `XADD` acknowledged.
    pub outbox_dispatch_latency: HistogramVec,
    /// `conveyor_outbox_batch_size`: events per claimed batch (one claim, of one or more workspaces).
    pub outbox_batch_size: Histogram,
    /// `conveyor_outbox_relay_passes_total{pass}`: the relay's passes by `sweep`, `named` and `tick`. Sweeps come
    /// every poll interval; while jobs flow, an awake dispatcher's ticks look them up, once a tick interval (enqueues
    /// skip their notification); `named` passes relay workspaces already known: the first notification after a quiet
    /// spell, and a backlog's workspaces, whose batch came back full.
    pub outbox_relay_passes: IntCounterVec,
    /// `conveyor_outbox_events{queue, status}`: jobs by state (`due`, `held` by a pause, `delayed`, `dispatching`,
    /// `dispatched` to the workers and not ended, `dead_letter`; migration 0029).
    pub outbox_events: IntGaugeVec,
    /// `conveyor_outbox_oldest_pending_age_seconds{queue}`: how long the oldest due job has waited since it fell due
    /// (a delayed job or a retry backing off is not due yet).
    pub outbox_oldest_pending_age: GaugeVec,
    /// `conveyor_outbox_events_purged_total`: dispatched events removed by retention.
    pub outbox_events_purged: IntCounter,
    /// `conveyor_dead_letters_purged_total`: dead letters discarded by their retention.
    pub dead_letters_purged: IntCounter,
    /// `conveyor_outbox_redriven_total`: events re-driven by the reconciler.
    pub outbox_redriven: IntCounter,
    /// `conveyor_jobs_expired_total`: jobs waiting in the outbox that maintenance canceled past their deadline (a
    /// worker counts those it expires as `conveyor_jobs_total{outcome="expired"}`).
    pub jobs_expired: IntCounter,
    /// `conveyor_jobs_total{queue, outcome}`.
    pub jobs: IntCounterVec,
    /// `conveyor_job_duration_seconds{queue, outcome}`.
    pub job_duration: HistogramVec,
    /// `conveyor_job_queue_wait_seconds{queue, class}`: due (the commit, or a delayed job's or a retry's due time) to
    /// handler start, by the fair-share class of the job's workspace when the relay claimed it (`light`,
    /// `backlogged`, or `unknown` for entries without one).
    pub job_queue_wait: HistogramVec,
    /// `conveyor_job_retries_total{type}`.
    pub job_retries: IntCounterVec,
    /// `conveyor_jobs_throttled_total{type}`: handlers' `JobError::RateLimited` answers (no attempt spent).
    pub jobs_throttled: IntCounterVec,
    /// `conveyor_job_dead_letters_total{reason}`.
    pub job_dead_letters: IntCounterVec,
    /// `conveyor_worker_jobs_in_flight`.
    pub worker_jobs_in_flight: IntGauge,
    /// `conveyor_dispatch_pauses`: pauses in force (`dispatch_pauses`), read by the dispatchers with the backlog.
    pub dispatch_pauses: IntGauge,
    /// `conveyor_worker_concurrency_limit`.
    pub worker_concurrency_limit: IntGauge,
    /// `conveyor_worker_reclaims_total{queue}`: entries taken over from dead consumers.
    pub worker_reclaims: IntCounterVec,
    /// `conveyor_stream_length{queue}`.
    pub stream_length: IntGaugeVec,
    /// `conveyor_stream_pending_entries{queue}`: delivered, not yet acknowledged.
    pub stream_pending_entries: IntGaugeVec,
    /// `conveyor_stream_group_lag{queue}`: not yet delivered.
    pub stream_group_lag: IntGaugeVec,
    /// `conveyor_build_info{version, revision, role}` = 1, once [`Metrics::set_role`] names the role.
    pub build_info: IntGaugeVec,
    /// The pools `conveyor_db_pool_*` reads at scrape ([`Metrics::watch_pool`]).
    pools: Pools,
}

/// Named connection pools, read at scrape.
#[derive(Clone, Default)]
struct Pools(Arc<Mutex<Vec<(&'static str, PgPool)>>>);

/// `conveyor_db_pool_connections{pool, state}` (`idle`, `in_use`) and `conveyor_db_pool_max_connections{pool}`, read
/// from the pools when scraped.
struct PoolCollector {
    pools: Pools,
    connections: IntGaugeVec,
    max: IntGaugeVec,
}

impl PoolCollector {
    fn new(pools: Pools) -> Self {
        let connections = IntGaugeVec::new(
            Opts::new(
                "conveyor_db_pool_connections",
                "PostgreSQL connections open in the pool, by state (idle, in_use)",
            ),
            &["pool", "state"],
        )
        .expect("valid metric");
        let max = IntGaugeVec::new(
            Opts::new("conveyor_db_pool_max_connections", "Most connections the pool opens"),
            &["pool"],
        )
        .expect("valid metric");
        Self { pools, connections, max }
    }
}

impl Collector for PoolCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.connections.desc().into_iter().chain(self.max.desc()).collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        // The lock also keeps two scrapes from interleaving their reset and sets.
        let pools = self.pools.0.lock().expect("pools lock");
        self.connections.reset();
        self.max.reset();
        for (name, pool) in pools.iter() {
            let (open, idle) = (i64::from(pool.size()), pool.num_idle() as i64);
            self.connections.with_label_values(&[*name, "idle"]).set(idle);
            self.connections.with_label_values(&[*name, "in_use"]).set((open - idle).max(0));
            self.max.with_label_values(&[*name]).set(i64::from(pool.options().get_max_connections()));
        }
        let mut families = self.connections.collect();
        families.extend(self.max.collect());
        families
    }
}

fn counter_vec(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> prometheus::Result<IntCounterVec> {
    let metric = IntCounterVec::new(Opts::new(name, help), labels)?;
    registry.register(Box::new(metric.clone()))?;
    Ok(metric)
}

fn counter(registry: &Registry, name: &str, help: &str) -> prometheus::Result<IntCounter> {
    let metric = IntCounter::new(name, help)?;
    registry.register(Box::new(metric.clone()))?;
    Ok(metric)
}

fn gauge(registry: &Registry, name: &str, help: &str) -> prometheus::Result<IntGauge> {
    let metric = IntGauge::new(name, help)?;
    registry.register(Box::new(metric.clone()))?;
    Ok(metric)
}

fn gauge_vec(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> prometheus::Result<IntGaugeVec> {
    let metric = IntGaugeVec::new(Opts::new(name, help), labels)?;
    registry.register(Box::new(metric.clone()))?;
    Ok(metric)
}

fn histogram_vec(
    registry: &Registry,
    name: &str,
    help: &str,
    buckets: Vec<f64>,
    labels: &[&str],
) -> prometheus::Result<HistogramVec> {
    let metric = HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets), labels)?;
    registry.register(Box::new(metric.clone()))?;
    Ok(metric)
}

/// The buckets of the platform's latency histograms, 1 ms to 60 s: a host's own latency histograms use them too, so
/// that the dashboards' quantiles read alike.
pub const LATENCY_BUCKETS: [f64; 15] =
    [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

fn latency_buckets() -> Vec<f64> {
    LATENCY_BUCKETS.to_vec()
}

impl Metrics {
    /// Creates every metric in a registry of its own, with the process's own (`process_*`): what `/metrics` of the
    /// `conveyor` binary renders ([`Metrics::render`]).
    pub fn new() -> Self {
        let registry = Registry::new();
        #[cfg(target_os = "linux")]
        registry
            .register(Box::new(prometheus::process_collector::ProcessCollector::for_self()))
            .expect("a new registry holds no process metrics");
        Self::build(registry).expect("a new registry holds none of the platform's metrics")
    }

    /// Creates every metric in the host's `registry`, under the names the shipped dashboard and alerts query, so that
    /// the host's own `/metrics` shows them. Fails when the registry holds one of those names already (one `Metrics` per
    /// registry: clone it for every part, as [`Conveyor`](crate::Conveyor) does). The process's own metrics are the
    /// host's to register.
    pub fn registered_in(registry: &Registry) -> prometheus::Result<Self> {
        // Every name checked before any is registered, so that a refusal leaves the host's registry as it was.
        let ours = Self::build(Registry::new())?.registry.gather();
        let theirs: std::collections::HashSet<String> =
            registry.gather().iter().map(|family| family.name().to_owned()).collect();
        if let Some(taken) = ours.iter().find(|family| theirs.contains(family.name())) {
            return Err(prometheus::Error::Msg(format!("the registry already holds {}", taken.name())));
        }
        Self::build(registry.clone())
    }

    fn build(registry: Registry) -> prometheus::Result<Self> {
        let r = &registry;
        let outbox_batch_size = Histogram::with_opts(
            HistogramOpts::new("conveyor_outbox_batch_size", "Events per claimed outbox batch")
                .buckets(vec![1.0, 5.0, 10.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 5000.0]),
        )?;
        registry.register(Box::new(outbox_batch_size.clone()))?;
        let outbox_events = IntGaugeVec::new(
            Opts::new("conveyor_outbox_events", "Outbox jobs by queue and state (due, held, delayed, dispatched, ...)"),
            &["queue", "status"],
        )?;
        registry.register(Box::new(outbox_events.clone()))?;
        let outbox_oldest_pending_age = GaugeVec::new(
            Opts::new("conveyor_outbox_oldest_pending_age_seconds", "Wait of the oldest due job since it fell due"),
            &["queue"],
        )?;
        registry.register(Box::new(outbox_oldest_pending_age.clone()))?;
        let pools = Pools::default();
        registry.register(Box::new(PoolCollector::new(pools.clone())))?;
        Ok(Self {
            build_info: gauge_vec(
                r,
                "conveyor_build_info",
                "Always 1: the version, source revision and role of this process",
                &["version", "revision", "role"],
            )?,
            pools,
            outbox_dispatched: counter_vec(
                r,
                "conveyor_outbox_dispatched_total",
                "Events relayed into streams",
                &["queue"],
            )?,
            outbox_relay_passes: counter_vec(
                r,
                "conveyor_outbox_relay_passes_total",
                "Relay passes: sweeps of every workspace with due jobs, and passes over the workspaces notifications named",
                &["pass"],
            )?,
            outbox_dispatch_errors: counter_vec(
                r,
                "conveyor_outbox_dispatch_errors_total",
                "Failed relays by reason",
                &["reason"],
            )?,
            outbox_dead_letters: counter_vec(
                r,
                "conveyor_outbox_dead_letters_total",
                "Events dead-lettered by the relay",
                &["queue"],
            )?,
            outbox_dispatch_latency: histogram_vec(
                r,
                "conveyor_outbox_dispatch_latency_seconds",
                "Commit of an event to its XADD acknowledged",
                latency_buckets(),
                &["queue"],
            )?,
            outbox_batch_size,
            outbox_events,
            outbox_oldest_pending_age,
            outbox_events_purged: counter(
                r,
                "conveyor_outbox_events_purged_total",
                "Dispatched events deleted by retention",
            )?,
            dead_letters_purged: counter(
                r,
                "conveyor_dead_letters_purged_total",
                "Dead letters discarded by their retention (CONVEYOR_DEAD_LETTER_RETENTION)",
            )?,
            outbox_redriven: counter(r, "conveyor_outbox_redriven_total", "Events re-driven by the reconciler")?,
            jobs_expired: counter(
                r,
                "conveyor_jobs_expired_total",
                "Jobs waiting in the outbox canceled by maintenance because their deadline passed",
            )?,
            jobs: counter_vec(
                r,
                "conveyor_jobs_total",
                "Job deliveries by queue, kind and outcome",
                &["queue", "kind", "outcome"],
            )?,
            job_duration: histogram_vec(
                r,
                "conveyor_job_duration_seconds",
                "Job run time by queue, kind and outcome",
                latency_buckets(),
                &["queue", "kind", "outcome"],
            )?,
            job_queue_wait: histogram_vec(
                r,
                "conveyor_job_queue_wait_seconds",
                "Enqueue (commit) to handler start, by the workspace's fair-share class at the claim",
                latency_buckets(),
                &["queue", "class"],
            )?,
            job_retries: counter_vec(r, "conveyor_job_retries_total", "Jobs scheduled to run again", &["type"])?,
            jobs_throttled: counter_vec(
                r,
                "conveyor_jobs_throttled_total",
                "Jobs whose handler answered rate limited: back to the outbox without spending an attempt",
                &["type"],
            )?,
            job_dead_letters: counter_vec(
                r,
                "conveyor_job_dead_letters_total",
                "Jobs dead-lettered by the worker",
                &["reason"],
            )?,
            worker_jobs_in_flight: gauge(r, "conveyor_worker_jobs_in_flight", "Jobs running now")?,
            dispatch_pauses: gauge(r, "conveyor_dispatch_pauses", "Pauses in force (jobs held in the outbox)")?,
            worker_concurrency_limit: gauge(r, "conveyor_worker_concurrency_limit", "Most jobs run at once")?,
            worker_reclaims: counter_vec(
                r,
                "conveyor_worker_reclaims_total",
                "Entries taken over from dead consumers",
                &["queue"],
            )?,
            stream_length: gauge_vec(r, "conveyor_stream_length", "Entries in the queue's stream", &["queue"])?,
            stream_pending_entries: gauge_vec(
                r,
                "conveyor_stream_pending_entries",
                "Entries delivered and not yet acknowledged",
                &["queue"],
            )?,
            stream_group_lag: gauge_vec(r, "conveyor_stream_group_lag", "Entries not yet delivered", &["queue"])?,
            registry,
        })
    }

    /// Names this process's role (`api`, `dispatcher`, `worker`, `maintenance`, `all`) in `conveyor_build_info`.
    pub fn set_role(&self, role: &str) {
        self.build_info.reset();
        self.build_info.with_label_values(&[env!("CARGO_PKG_VERSION"), REVISION, role]).set(1);
    }

    /// Reports `pool` as `conveyor_db_pool_*{pool=name}` from now on (replacing a pool watched under that name).
    pub fn watch_pool(&self, name: &'static str, pool: PgPool) {
        let mut pools = self.pools.0.lock().expect("pools lock");
        pools.retain(|(watched, _)| *watched != name);
        pools.push((name, pool));
    }

    /// Creates at 0 the counters of a worker consuming `queues` with handlers for `kinds`: dead letters by reason,
    /// retries and throttles by kind, reclaims by queue. (`conveyor_jobs_total` is created per queue and kind by the
    /// worker's queues.)
    pub(crate) fn init_worker(&self, queues: &[&str], kinds: &[&str]) {
        for reason in JOB_DEAD_LETTER_REASONS {
            self.job_dead_letters.with_label_values(&[reason]);
        }
        for kind in kinds {
            self.job_retries.with_label_values(&[kind]);
            self.jobs_throttled.with_label_values(&[kind]);
        }
        for queue in queues {
            self.worker_reclaims.with_label_values(&[queue]);
        }
    }

    /// Creates at 0 the relay's failures by reason.
    pub(crate) fn init_dispatcher(&self) {
        for reason in DISPATCH_ERROR_REASONS {
            self.outbox_dispatch_errors.with_label_values(&[reason]);
        }
        for pass in RELAY_PASSES {
            self.outbox_relay_passes.with_label_values(&[pass]);
        }
    }

    /// Creates at 0 the relay's counters of each of `queues` (dispatched, dead-lettered).
    pub(crate) fn init_queues<'q>(&self, queues: impl IntoIterator<Item = &'q str>) {
        for queue in queues {
            self.outbox_dispatched.with_label_values(&[queue]);
            self.outbox_dead_letters.with_label_values(&[queue]);
        }
    }

    /// The registry in the Prometheus text format.
    pub fn render(&self) -> String {
        prometheus::TextEncoder::new()
            .encode_to_string(&self.registry.gather())
            .expect("text encoding of gathered metrics cannot fail")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
