//! The shop's own metrics, registered into the process's registry beside the platform's
//! ([`conveyor_jobs::Metrics::registry`]), under the names the dashboards use.

use prometheus::{IntCounterVec, Opts, Registry};

/// The results of `conveyor_media_derivations_total`.
pub const MEDIA_RESULTS: [&str; 3] = ["derived", "reused", "rejected"];

/// `conveyor_media_derivations_total{result}`: `media.process` runs by result (`derived`, `reused` when the same
/// bytes were derived before, `rejected`).
#[derive(Clone)]
pub struct MediaMetrics {
    /// The counter.
    pub derivations: IntCounterVec,
}

impl MediaMetrics {
    /// Registers the metric into `registry` (once per registry: a second registration panics).
    pub fn register(registry: &Registry) -> Self {
        let derivations = IntCounterVec::new(
            Opts::new(
                "conveyor_media_derivations_total",
                "media.process runs by result: derived, reused (same bytes derived before) or rejected",
            ),
            &["result"],
        )
        .expect("valid metric");
        registry.register(Box::new(derivations.clone())).expect("unique metric");
        Self { derivations }
    }

    /// Creates every result at 0 (a worker that runs `media.process` shows them before its first job).
    pub fn init(&self) {
        for result in MEDIA_RESULTS {
            self.derivations.with_label_values(&[result]);
        }
    }
}
