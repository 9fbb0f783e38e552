//! Every Prometheus metric, defined in one place and registered in one registry (served on the admin port).
//!
//! Names follow `conveyor_<thing>_<unit>[_total]`; labels come from small fixed sets only (never ids, keys,
//! workspaces or raw paths).

use prometheus::{HistogramOpts, HistogramVec, IntCounter, IntCounterVec, Opts, Registry};

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
}

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Self {
        let registry = Registry::new();
        let http_request_duration = HistogramVec::new(
            HistogramOpts::new("conveyor_http_request_duration_seconds", "HTTP request duration by route template")
                .buckets(vec![0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]),
            &["route", "method", "status_class"],
        )
        .expect("valid metric");
        let idempotency_requests = IntCounterVec::new(
            Opts::new("conveyor_idempotency_requests_total", "Idempotent requests by outcome"),
            &["outcome"],
        )
        .expect("valid metric");
        let idempotency_records_purged = IntCounter::new(
            "conveyor_idempotency_records_purged_total",
            "Expired idempotency records deleted by maintenance",
        )
        .expect("valid metric");
        registry.register(Box::new(http_request_duration.clone())).expect("unique metric");
        registry.register(Box::new(idempotency_requests.clone())).expect("unique metric");
        registry.register(Box::new(idempotency_records_purged.clone())).expect("unique metric");
        Self { registry, http_request_duration, idempotency_requests, idempotency_records_purged }
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
