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

pub use propagation::{request_traceparent, set_parent, set_parent_with_state, traceparent_of, tracestate_of};

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

/// Whether `state` can travel as a W3C `tracestate`: 1 to 512 printable ASCII characters (what the header's list of
/// `key=value` entries is made of). Its entries are kept as they came, not parsed.
pub fn is_valid_tracestate(state: &str) -> bool {
    !state.trim().is_empty() && state.len() <= 512 && state.bytes().all(|b| (0x20..=0x7e).contains(&b))
}

/// A job's W3C trace context: the `traceparent`, and the `tracestate` that came with it (vendors' entries, kept as
/// they are). It travels from the enqueueing request through the outbox row and the stream entry to the handler
/// ([`crate::JobContext::trace`]) and the calls the handler makes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceContext {
    /// The W3C `traceparent`.
    pub traceparent: String,
    /// The W3C `tracestate`, when there is one.
    pub tracestate: Option<String>,
}

impl TraceContext {
    /// The context of a request's headers: a well-formed `traceparent` (version 00) is kept, with a valid
    /// `tracestate`; otherwise a new trace, without the state (which belongs to the trace it came with).
    pub fn from_headers(traceparent: Option<&str>, tracestate: Option<&str>) -> Self {
        match traceparent {
            Some(tp) if is_valid_traceparent(tp) => Self {
                traceparent: tp.to_ascii_lowercase(),
                tracestate: tracestate.filter(|s| is_valid_tracestate(s)).map(|s| s.trim().to_owned()),
            },
            _ => Self { traceparent: new_traceparent(), tracestate: None },
        }
    }

    /// The context a job enqueued by the current request carries: the request span's own (its id, and the state it
    /// inherited) while traces are exported; otherwise the caller's headers as [`TraceContext::from_headers`] keeps
    /// them.
    pub fn of_request(traceparent: Option<&str>, tracestate: Option<&str>) -> Self {
        let span = tracing::Span::current();
        match traceparent_of(&span) {
            Some(own) => Self { traceparent: own, tracestate: tracestate_of(&span) },
            None => Self::from_headers(traceparent, tracestate),
        }
    }
}

/// The `traceparent` column's value for a job: its `traceparent`, then a newline and its `tracestate` when it has
/// one (neither can hold a newline).
pub(crate) fn stored(traceparent: &str, tracestate: Option<&str>) -> String {
    match tracestate {
        Some(state) => format!("{traceparent}\n{state}"),
        None => traceparent.to_owned(),
    }
}

/// A `traceparent` column's value read back: the `traceparent` and the `tracestate`, if any.
pub(crate) fn from_stored(value: &str) -> (&str, Option<&str>) {
    match value.split_once('\n') {
        Some((parent, state)) => (parent, Some(state)),
        None => (value, None),
    }
}

/// The trace id (32 hex digits) of a `traceparent` column's value, when it holds a valid `traceparent`.
pub(crate) fn trace_id_of(stored: &str) -> Option<String> {
    let (traceparent, _) = from_stored(stored);
    is_valid_traceparent(traceparent).then(|| traceparent.split('-').nth(1).unwrap_or_default().to_owned())
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

    #[test]
    fn a_tracestate_is_kept_with_its_traceparent_and_stored_beside_it() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let kept = TraceContext::from_headers(Some(tp), Some("congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"));
        assert_eq!(kept.tracestate.as_deref(), Some("congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"));
        // A state without a valid parent belongs to no trace of ours; a malformed state is dropped.
        assert_eq!(TraceContext::from_headers(Some("garbage"), Some("a=b")).tracestate, None);
        assert_eq!(TraceContext::from_headers(Some(tp), Some("a=b\nc")).tracestate, None);
        assert_eq!(TraceContext::from_headers(Some(tp), Some(&"a".repeat(513))).tracestate, None);
        let value = stored(tp, Some("a=b"));
        assert_eq!(from_stored(&value), (tp, Some("a=b")));
        assert_eq!(from_stored(tp), (tp, None));
    }
}
