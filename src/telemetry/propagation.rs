//! W3C trace context between `tracing` spans and the `traceparent` strings that travel in headers, outbox rows and
//! stream entries. Every function is a cheap no-op while traces are not exported ([`super::exporting`]), and
//! without the feature `otel` (then spans are not linked to traceparents at all; traceparents still travel).

#[cfg(feature = "otel")]
use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
use tracing::Span;
#[cfg(feature = "otel")]
use tracing_opentelemetry::OpenTelemetrySpanExt;

use super::traceparent_or_new;
#[cfg(feature = "otel")]
use super::{exporting, is_valid_traceparent};

/// The remote span context a `traceparent` names, with its `tracestate` (empty when absent or unreadable); `None`
/// when the `traceparent` is not a valid version-00 header.
#[cfg(feature = "otel")]
fn remote_context(traceparent: &str, tracestate: Option<&str>) -> Option<SpanContext> {
    if !is_valid_traceparent(traceparent) {
        return None;
    }
    let mut parts = traceparent.split('-').skip(1);
    let trace_id = TraceId::from_hex(parts.next()?).ok()?;
    let span_id = SpanId::from_hex(parts.next()?).ok()?;
    let flags = u8::from_str_radix(parts.next()?, 16).ok()?;
    Some(SpanContext::new(
        trace_id,
        span_id,
        TraceFlags::new(flags & TraceFlags::SAMPLED.to_u8()),
        true,
        tracestate.and_then(|s| s.parse::<TraceState>().ok()).unwrap_or(TraceState::NONE),
    ))
}

/// Makes the span `traceparent` names the parent of `span`, which must not have been entered yet. Ignored while
/// traces are off, without the feature `otel`, for a malformed `traceparent`, and for a span the exporter does not see.
pub fn set_parent(span: &Span, traceparent: &str) {
    set_parent_with_state(span, traceparent, None);
}

/// [`set_parent`] with the `tracestate` that came with the `traceparent`: `span` and its children carry it on (a
/// malformed one is dropped).
pub fn set_parent_with_state(span: &Span, traceparent: &str, tracestate: Option<&str>) {
    #[cfg(feature = "otel")]
    if exporting()
        && !span.is_disabled()
        && let Some(remote) = remote_context(traceparent, tracestate)
    {
        let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(remote));
    }
    #[cfg(not(feature = "otel"))]
    let _ = (span, traceparent, tracestate);
}

/// The `tracestate` of `span` (what its parent passed on), to send beside [`traceparent_of`]; `None` when empty,
/// while traces are off, without the feature `otel`, or for a span the exporter does not see.
pub fn tracestate_of(span: &Span) -> Option<String> {
    #[cfg(feature = "otel")]
    if exporting() && !span.is_disabled() {
        let cx = span.context();
        let state = cx.span().span_context().trace_state().header();
        return (!state.is_empty()).then_some(state);
    }
    #[cfg(not(feature = "otel"))]
    let _ = span;
    None
}

/// The `traceparent` of `span` itself (its trace id and its own span id), to hand to whatever runs on its behalf
/// next; `None` while traces are off, without the feature `otel`, or for a span the exporter does not see. Starts the
/// span's clock if it had not started.
pub fn traceparent_of(span: &Span) -> Option<String> {
    #[cfg(feature = "otel")]
    if exporting() && !span.is_disabled() {
        let cx = span.context();
        let context = cx.span().span_context().clone();
        return context
            .is_valid()
            .then(|| format!("00-{}-{}-{:02x}", context.trace_id(), context.span_id(), context.trace_flags().to_u8()));
    }
    #[cfg(not(feature = "otel"))]
    let _ = span;
    None
}

/// The `traceparent` a job enqueued by the current request carries: the request span's own context (a child of
/// the caller's `traceparent`, when it sent one) while traces are exported; otherwise the caller's valid
/// `traceparent` as it came, or a new one.
pub fn request_traceparent(incoming: Option<&str>) -> String {
    traceparent_of(&Span::current()).unwrap_or_else(|| traceparent_or_new(incoming))
}

#[cfg(all(test, feature = "otel"))]
mod tests {
    use super::*;

    #[test]
    fn a_traceparent_reads_as_a_remote_sampled_context() {
        let context =
            remote_context("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", Some("congo=t61rcWkgMzE"))
                .unwrap();
        assert_eq!(context.trace_id().to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(context.span_id().to_string(), "00f067aa0ba902b7");
        assert!(context.is_sampled() && context.is_remote());
        assert_eq!(context.trace_state().header(), "congo=t61rcWkgMzE");
        let unsampled = remote_context("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00", None).unwrap();
        assert!(!unsampled.is_sampled());
        assert!(remote_context("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", None).is_none());
        assert!(remote_context("not a traceparent", None).is_none());
    }

    #[test]
    fn with_traces_off_the_incoming_traceparent_is_kept() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(request_traceparent(Some(tp)), tp);
        assert!(traceparent_of(&Span::current()).is_none());
    }
}
