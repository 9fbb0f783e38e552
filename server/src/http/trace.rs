//! The span of each API request (`http.request`, a server span): its route template, and, when traces are
//! exported, the caller's `traceparent` as its parent. An `INFO` span while traces are exported, else a `DEBUG` one,
//! so that with traces off and the default log level nothing is created per request.

use std::time::Duration;

use axum::extract::MatchedPath;
use axum::http::{Request, Response};
use tracing::Span;
use tracing::field::Empty;

/// The request's span; the parent is the incoming `traceparent` when traces are exported.
pub(super) fn request_span<B>(request: &Request<B>) -> Span {
    let route = request.extensions().get::<MatchedPath>().map_or("unmatched", MatchedPath::as_str);
    macro_rules! span {
        ($level:ident) => {
            tracing::$level!(
                "http.request",
                otel.name = Empty,
                otel.kind = "server",
                otel.status_code = Empty,
                http.request.method = %request.method(),
                http.route = route,
                url.path = request.uri().path(),
                http.response.status_code = Empty,
            )
        };
    }
    if !conveyor_jobs::trace_exporting() {
        return span!(debug_span);
    }
    let span = span!(info_span);
    if !span.is_disabled() {
        span.record("otel.name", format!("{} {route}", request.method()));
        let header = |name| request.headers().get(name).and_then(|v| v.to_str().ok());
        if let Some(incoming) = header("traceparent") {
            conveyor_jobs::set_span_parent_with_state(&span, incoming, header("tracestate"));
        }
    }
    span
}

/// Records the answer's status on the request's span (a 5xx marks the span as an error).
pub(super) fn record_response<B>(response: &Response<B>, _latency: Duration, span: &Span) {
    let status = response.status();
    span.record("http.response.status_code", status.as_u16());
    if status.is_server_error() {
        span.record("otel.status_code", "ERROR");
    }
}
