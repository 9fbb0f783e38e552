//! Logging and trace export: the `tracing` subscriber (logs on stderr, text or JSON lines, filtered by `RUST_LOG`)
//! and, when `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, the OTLP/HTTP exporter
//! of the spans the platform creates ([`export`]).

pub mod export;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

pub use export::OtlpSettings;

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
            conveyor_jobs::set_trace_export(false);
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
        conveyor_jobs::set_trace_export(true);
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
