//! W3C trace context (`traceparent`) and the platform's spans.
//!
//! The platform creates spans and carries a `traceparent` with every job; the host installs the subscriber and any
//! exporter (the server exports over OTLP/HTTP when `OTEL_EXPORTER_OTLP_ENDPOINT` is set) and says so with
//! [`set_exporting`]. Then, with the feature `otel`, one trace follows a job end to end (`propagation`):
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

mod propagation;

use std::sync::atomic::{AtomicBool, Ordering};

use rand::RngCore;

pub use propagation::{request_traceparent, set_parent, traceparent_of};

/// Whether spans are exported (an OTLP exporter is installed). Read on hot paths before any tracing work that only
/// the export needs.
static EXPORTING: AtomicBool = AtomicBool::new(false);

/// Whether this process exports traces.
pub fn exporting() -> bool {
    EXPORTING.load(Ordering::Relaxed)
}

/// Tells Conveyor whether the process exports its spans (an OpenTelemetry layer is installed in the `tracing`
/// subscriber): only then does it create the spans, and link the parents, that serve the export alone.
pub fn set_exporting(on: bool) {
    EXPORTING.store(on, Ordering::Relaxed);
}

/// Keeps an incoming `traceparent` when it is well-formed (version 00), else starts a new trace.
pub(crate) fn traceparent_or_new(incoming: Option<&str>) -> String {
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
