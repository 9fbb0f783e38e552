//! The server's own metrics (HTTP, idempotency, uploads) and the shop's, registered into the process's registry
//! beside the platform's ([`conveyor_jobs::Metrics::registry`]), under the names the dashboards use.

use conveyor_shop::metrics::MediaMetrics;
use prometheus::{HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts, Registry};

/// The outcomes of `conveyor_idempotency_requests_total`.
pub const IDEMPOTENCY_OUTCOMES: [&str; 5] = ["executed", "replayed", "key_reused", "in_progress", "rejected"];

/// The server's metrics.
#[derive(Clone)]
pub struct ServerMetrics {
    /// `conveyor_http_request_duration_seconds{route, method, status_class}`.
    pub http_request_duration: HistogramVec,
    /// `conveyor_idempotency_requests_total{outcome}`.
    pub idempotency_requests: IntCounterVec,
    /// `conveyor_idempotency_records_purged_total`.
    pub idempotency_records_purged: IntCounter,
    /// `conveyor_idempotency_replays_from_memory_total`: the replays answered from this process's copies, without
    /// PostgreSQL (counted in `replayed` too).
    pub idempotency_replays_from_memory: IntCounter,
    /// `conveyor_idempotency_replay_cache_bytes`: what those copies weigh (at most
    /// `CONVEYOR_IDEMPOTENCY_REPLAY_CACHE`).
    pub idempotency_replay_cache_bytes: IntGauge,
    /// `conveyor_media_uploads_in_progress`: media uploads this API process is receiving (at most
    /// `CONVEYOR_MEDIA_MAX_CONCURRENT_UPLOADS`).
    pub media_uploads_in_progress: IntGauge,
    /// `conveyor_media_uploads_refused_total`: uploads answered `503 UPLOADS_BUSY` because that many were in progress.
    pub media_uploads_refused: IntCounter,
    /// The shop's `media.process` results.
    pub media: MediaMetrics,
}

fn registered<M: prometheus::core::Collector + Clone + 'static>(registry: &Registry, metric: M) -> M {
    registry.register(Box::new(metric.clone())).expect("unique metric");
    metric
}

impl ServerMetrics {
    /// Registers every metric into `registry` (once per registry: a second registration panics).
    pub fn register(registry: &Registry) -> Self {
        Self {
            http_request_duration: registered(
                registry,
                HistogramVec::new(
                    HistogramOpts::new(
                        "conveyor_http_request_duration_seconds",
                        "HTTP request duration by route template",
                    )
                    .buckets(conveyor_jobs::LATENCY_BUCKETS.to_vec()),
                    &["route", "method", "status_class"],
                )
                .expect("valid metric"),
            ),
            idempotency_requests: registered(
                registry,
                IntCounterVec::new(
                    Opts::new("conveyor_idempotency_requests_total", "Idempotent requests by outcome"),
                    &["outcome"],
                )
                .expect("valid metric"),
            ),
            idempotency_records_purged: registered(
                registry,
                IntCounter::new(
                    "conveyor_idempotency_records_purged_total",
                    "Expired idempotency records deleted by maintenance",
                )
                .expect("valid metric"),
            ),
            idempotency_replays_from_memory: registered(
                registry,
                IntCounter::new(
                    "conveyor_idempotency_replays_from_memory_total",
                    "Idempotent replays answered from this process's copies of completed records, without PostgreSQL",
                )
                .expect("valid metric"),
            ),
            idempotency_replay_cache_bytes: registered(
                registry,
                IntGauge::new(
                    "conveyor_idempotency_replay_cache_bytes",
                    "Bytes held by the copies of completed idempotency records (CONVEYOR_IDEMPOTENCY_REPLAY_CACHE)",
                )
                .expect("valid metric"),
            ),
            media_uploads_in_progress: registered(
                registry,
                IntGauge::new(
                    "conveyor_media_uploads_in_progress",
                    "Media uploads being received (at most CONVEYOR_MEDIA_MAX_CONCURRENT_UPLOADS)",
                )
                .expect("valid metric"),
            ),
            media_uploads_refused: registered(
                registry,
                IntCounter::new(
                    "conveyor_media_uploads_refused_total",
                    "Media uploads answered 503 UPLOADS_BUSY: CONVEYOR_MEDIA_MAX_CONCURRENT_UPLOADS were in progress",
                )
                .expect("valid metric"),
            ),
            media: MediaMetrics::register(registry),
        }
    }

    /// Creates at 0 the API's idempotent requests by outcome.
    pub fn init_api(&self) {
        for outcome in IDEMPOTENCY_OUTCOMES {
            self.idempotency_requests.with_label_values(&[outcome]);
        }
    }
}
