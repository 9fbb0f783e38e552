//! Logging, traces and W3C trace context (`traceparent`).
//!
//! Logs go to stderr (text or JSON lines), filtered by `RUST_LOG`. Traces are off unless
//! `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set; then Conveyor's spans are exported
//! over OTLP/HTTP protobuf ([`export`]) and one trace follows a job end to end ([`propagation`]):
//!
//! ```text
//! API   http.request (server; child of an incoming traceparent)
//!        └ its context is the job's traceparent, stored in the outbox row
//! Dispatcher  outbox.relay (producer; child of the row's traceparent) ─ its context goes into the stream entry
//! Worker      job (consumer; child of the entry's traceparent)
//!              └ marketplace.* (client) ─ sent as the call's traceparent header
//! ```
//!
//! The spans are `INFO` spans while traces are exported (so `RUST_LOG` must let Conveyor's `INFO` through, as the
//! default `info` does; the log lines inside them show them as context). With traces off, the spans that only serve
//! the export are not created (the request's is a `DEBUG` span, as before) and `traceparent` travels as before: the
//! incoming one, or a new one per request.

pub mod export;
pub mod propagation;

use std::sync::atomic::{AtomicBool, Ordering};

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::SdkTracerProvider;
use rand::RngCore;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

pub use export::OtlpSettings;
pub use propagation::{request_traceparent, set_parent, traceparent_of};

/// Whether spans are exported (an OTLP exporter is installed). Read on hot paths before any tracing work that only
/// the export needs.
static EXPORTING: AtomicBool = AtomicBool::new(false);

/// Whether this process exports traces.
pub fn exporting() -> bool {
    EXPORTING.load(Ordering::Relaxed)
}

/// What [`init`] installed; [`Telemetry::shutdown`] exports the spans still buffered.
#[must_use = "call shutdown() at exit, or buffered spans are lost"]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Whether traces are exported.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Flushes and stops the exporter (blocks up to its export time-out). Call outside the async runtime, at exit.
    pub fn shutdown(self) {
        if let Some(provider) = self.provider {
            EXPORTING.store(false, Ordering::Relaxed);
            if let Err(e) = provider.shutdown() {
                eprintln!("conveyor: could not export the last spans: {e}");
            }
        }
    }
}

/// Installs the global `tracing` subscriber: logs on stderr, human-readable or JSON lines, filtered by `RUST_LOG`
/// (default `info`); and, with `service` given and an OTLP endpoint configured, the span exporter, whose
/// `service.name` is `OTEL_SERVICE_NAME` or `service`. Fails on an invalid OpenTelemetry configuration. Call it
/// before the async runtime starts (the exporter's client runs on threads of its own).
pub fn init(json: bool, service: Option<&str>) -> anyhow::Result<Telemetry> {
    let settings = match service {
        Some(service) => OtlpSettings::from_source(&crate::config::Env, service)?,
        None => None,
    };
    let provider = settings.as_ref().map(export::provider).transpose()?;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let _ = subscriber(json, filter, provider.as_ref()).try_init();
    if let Some(settings) = &settings {
        EXPORTING.store(true, Ordering::Relaxed);
        tracing::info!(endpoint = %settings.traces_url, service = %settings.service_name, "Exporting traces (OTLP/HTTP)");
    }
    Ok(Telemetry { provider })
}

/// Logs, and spans exported to `provider`, both filtered by `filter`. One global filter, not one per layer: with
/// per-layer filters (tracing-subscriber 0.3.23), a worker's log lines and spans went missing at random.
fn subscriber(
    json: bool,
    filter: EnvFilter,
    provider: Option<&SdkTracerProvider>,
) -> impl tracing::Subscriber + Send + Sync + for<'a> tracing_subscriber::registry::LookupSpan<'a> {
    let otel = provider.map(|provider| {
        tracing_opentelemetry::layer().with_tracer(provider.tracer("conveyor")).with_level(false).with_threads(false)
    });
    let logs = if json {
        tracing_subscriber::fmt::layer().json().with_writer(std::io::stderr).boxed()
    } else {
        tracing_subscriber::fmt::layer().with_writer(std::io::stderr).boxed()
    };
    tracing_subscriber::registry().with(filter).with(otel).with(logs)
}

/// Installs the logging subscriber alone (no trace export), as [`init`] does without a service.
pub fn init_logging(json: bool) {
    // Without a service no variable is read, so nothing can fail.
    let _ = init(json, None);
}

/// Keeps an incoming `traceparent` when it is well-formed (version 00), else starts a new trace.
pub fn traceparent_or_new(incoming: Option<&str>) -> String {
    match incoming {
        Some(tp) if is_valid_traceparent(tp) => tp.to_ascii_lowercase(),
        _ => new_traceparent(),
    }
}

/// A fresh `traceparent` with random trace and span ids, sampled.
pub fn new_traceparent() -> String {
    let mut trace = [0u8; 16];
    let mut span = [0u8; 8];
    let mut rng = rand::rng();
    rng.fill_bytes(&mut trace);
    rng.fill_bytes(&mut span);
    format!("00-{}-{}-01", hex(&trace), hex(&span))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `tp` is a W3C `traceparent` of version 00 with non-zero ids.
pub fn is_valid_traceparent(tp: &str) -> bool {
    let parts: Vec<&str> = tp.split('-').collect();
    let hex_of = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
    parts.len() == 4
        && parts[0] == "00"
        && hex_of(parts[1], 32)
        && parts[1].bytes().any(|b| b != b'0')
        && hex_of(parts[2], 16)
        && parts[2].bytes().any(|b| b != b'0')
        && hex_of(parts[3], 2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_valid_traceparent_is_kept_and_a_bad_one_replaced() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(traceparent_or_new(Some(tp)), tp);
        let fresh = traceparent_or_new(Some("00-00000000000000000000000000000000-00f067aa0ba902b7-01"));
        assert!(is_valid_traceparent(&fresh));
        assert_ne!(fresh, tp);
        assert!(is_valid_traceparent(&traceparent_or_new(None)));
    }
}
