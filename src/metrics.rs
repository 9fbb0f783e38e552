//! Every Prometheus metric, defined in one place and registered in one registry (served on the admin port).
//!
//! Names follow `conveyor_<thing>_<unit>[_total]`; labels come from small fixed sets only (never ids, keys,
//! workspaces or raw paths). Queue names are a fixed set defined in code.

use prometheus::{
    GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};

/// The metrics of one process.
#[derive(Clone)]
pub struct Metrics {
    /// The registry `/metrics` renders.
    pub registry: Registry,
    /// `conveyor_http_request_duration_seconds{route, method, status_class}`.
    pub http_request_duration: HistogramVec,
    /// `conveyor_idempotency_requests_total{outcome}`.
    pub idempotency_requests: IntCounterVec,
    /// `conveyor_idempotency_records_purged_total`.
    pub idempotency_records_purged: IntCounter,
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
    /// `conveyor_outbox_events{queue, status}`: backlog by status (pending, dispatching, dead_letter).
    pub outbox_events: IntGaugeVec,
    /// `conveyor_outbox_oldest_pending_age_seconds{queue}`.
    pub outbox_oldest_pending_age: GaugeVec,
    /// `conveyor_outbox_events_purged_total`: dispatched events removed by retention.
    pub outbox_events_purged: IntCounter,
    /// `conveyor_outbox_redriven_total`: events re-driven by the reconciler.
    pub outbox_redriven: IntCounter,
    /// `conveyor_jobs_total{queue, outcome}`.
    pub jobs: IntCounterVec,
    /// `conveyor_job_duration_seconds{queue, outcome}`.
    pub job_duration: HistogramVec,
    /// `conveyor_job_queue_wait_seconds{queue, class}`: enqueue (commit) to handler start, by the fair-share class of
    /// the job's workspace when the relay claimed it (`light`, `backlogged`, or `unknown` for entries without one).
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
    /// `conveyor_media_derivations_total{result}`: `media.process` runs by result (`derived`, `reused`, `rejected`).
    pub media_derivations: IntCounterVec,
}

fn counter_vec(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let metric = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
    registry.register(Box::new(metric.clone())).expect("unique metric");
    metric
}

fn counter(registry: &Registry, name: &str, help: &str) -> IntCounter {
    let metric = IntCounter::new(name, help).expect("valid metric");
    registry.register(Box::new(metric.clone())).expect("unique metric");
    metric
}

fn gauge(registry: &Registry, name: &str, help: &str) -> IntGauge {
    let metric = IntGauge::new(name, help).expect("valid metric");
    registry.register(Box::new(metric.clone())).expect("unique metric");
    metric
}

fn gauge_vec(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    let metric = IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
    registry.register(Box::new(metric.clone())).expect("unique metric");
    metric
}

fn histogram_vec(registry: &Registry, name: &str, help: &str, buckets: Vec<f64>, labels: &[&str]) -> HistogramVec {
    let metric = HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets), labels).expect("valid metric");
    registry.register(Box::new(metric.clone())).expect("unique metric");
    metric
}

/// Latency buckets from 1 ms to 60 s.
fn latency_buckets() -> Vec<f64> {
    vec![0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
}

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Self {
        let registry = Registry::new();
        let r = &registry;
        let outbox_batch_size = Histogram::with_opts(
            HistogramOpts::new("conveyor_outbox_batch_size", "Events per claimed outbox batch")
                .buckets(vec![1.0, 5.0, 10.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 5000.0]),
        )
        .expect("valid metric");
        registry.register(Box::new(outbox_batch_size.clone())).expect("unique metric");
        let outbox_events = IntGaugeVec::new(
            Opts::new("conveyor_outbox_events", "Outbox backlog by queue and status"),
            &["queue", "status"],
        )
        .expect("valid metric");
        registry.register(Box::new(outbox_events.clone())).expect("unique metric");
        let outbox_oldest_pending_age = GaugeVec::new(
            Opts::new("conveyor_outbox_oldest_pending_age_seconds", "Age of the oldest undispatched event by queue"),
            &["queue"],
        )
        .expect("valid metric");
        registry.register(Box::new(outbox_oldest_pending_age.clone())).expect("unique metric");
        Self {
            http_request_duration: histogram_vec(
                r,
                "conveyor_http_request_duration_seconds",
                "HTTP request duration by route template",
                latency_buckets(),
                &["route", "method", "status_class"],
            ),
            idempotency_requests: counter_vec(
                r,
                "conveyor_idempotency_requests_total",
                "Idempotent requests by outcome",
                &["outcome"],
            ),
            idempotency_records_purged: counter(
                r,
                "conveyor_idempotency_records_purged_total",
                "Expired idempotency records deleted by maintenance",
            ),
            outbox_dispatched: counter_vec(
                r,
                "conveyor_outbox_dispatched_total",
                "Events relayed into streams",
                &["queue"],
            ),
            outbox_dispatch_errors: counter_vec(
                r,
                "conveyor_outbox_dispatch_errors_total",
                "Failed relays by reason",
                &["reason"],
            ),
            outbox_dead_letters: counter_vec(
                r,
                "conveyor_outbox_dead_letters_total",
                "Events dead-lettered by the relay",
                &["queue"],
            ),
            outbox_dispatch_latency: histogram_vec(
                r,
                "conveyor_outbox_dispatch_latency_seconds",
                "Commit of an event to its XADD acknowledged",
                latency_buckets(),
                &["queue"],
            ),
            outbox_batch_size,
            outbox_events,
            outbox_oldest_pending_age,
            outbox_events_purged: counter(
                r,
                "conveyor_outbox_events_purged_total",
                "Dispatched events deleted by retention",
            ),
            outbox_redriven: counter(r, "conveyor_outbox_redriven_total", "Events re-driven by the reconciler"),
            jobs: counter_vec(
                r,
                "conveyor_jobs_total",
                "Job deliveries by queue, kind and outcome",
                &["queue", "kind", "outcome"],
            ),
            job_duration: histogram_vec(
                r,
                "conveyor_job_duration_seconds",
                "Job run time by queue, kind and outcome",
                latency_buckets(),
                &["queue", "kind", "outcome"],
            ),
            job_queue_wait: histogram_vec(
                r,
                "conveyor_job_queue_wait_seconds",
                "Enqueue (commit) to handler start, by the workspace's fair-share class at the claim",
                latency_buckets(),
                &["queue", "class"],
            ),
            job_retries: counter_vec(r, "conveyor_job_retries_total", "Jobs scheduled to run again", &["type"]),
            jobs_throttled: counter_vec(
                r,
                "conveyor_jobs_throttled_total",
                "Jobs whose handler answered rate limited: back to the outbox without spending an attempt",
                &["type"],
            ),
            job_dead_letters: counter_vec(
                r,
                "conveyor_job_dead_letters_total",
                "Jobs dead-lettered by the worker",
                &["reason"],
            ),
            worker_jobs_in_flight: gauge(r, "conveyor_worker_jobs_in_flight", "Jobs running now"),
            dispatch_pauses: gauge(r, "conveyor_dispatch_pauses", "Pauses in force (jobs held in the outbox)"),
            worker_concurrency_limit: gauge(r, "conveyor_worker_concurrency_limit", "Most jobs run at once"),
            worker_reclaims: counter_vec(
                r,
                "conveyor_worker_reclaims_total",
                "Entries taken over from dead consumers",
                &["queue"],
            ),
            stream_length: gauge_vec(r, "conveyor_stream_length", "Entries in the queue's stream", &["queue"]),
            stream_pending_entries: gauge_vec(
                r,
                "conveyor_stream_pending_entries",
                "Entries delivered and not yet acknowledged",
                &["queue"],
            ),
            stream_group_lag: gauge_vec(r, "conveyor_stream_group_lag", "Entries not yet delivered", &["queue"]),
            media_derivations: counter_vec(
                r,
                "conveyor_media_derivations_total",
                "media.process runs by result: derived, reused (same bytes derived before) or rejected",
                &["result"],
            ),
            registry,
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
