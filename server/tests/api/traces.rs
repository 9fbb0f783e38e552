//! One trace end to end: a store verification requested from the API, relayed by the dispatcher through the outbox
//! and the stream, run by a worker, which calls the marketplace. Three real `conveyor` processes export their spans
//! over OTLP/HTTP to a small collector this test serves; the sandbox marketplace records the `traceparent` it got.

use crate::common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use common::{Process, TestApp, principal, store_body};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use prost::Message;
use tokio::net::TcpListener;

/// A span as exported, with the service that exported it.
#[derive(Clone, Debug)]
struct Exported {
    service: String,
    trace_id: String,
    span_id: String,
    parent_span_id: String,
    name: String,
    kind: SpanKind,
    attributes: HashMap<String, String>,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn text(value: Option<&opentelemetry_proto::tonic::common::v1::AnyValue>) -> String {
    match value.and_then(|v| v.value.as_ref()) {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        _ => String::new(),
    }
}

/// An OTLP/HTTP receiver: `POST /v1/traces` with a protobuf `ExportTraceServiceRequest`, as a collector takes it.
#[derive(Clone, Default)]
struct Collector(Arc<Mutex<Vec<Exported>>>);

impl Collector {
    async fn serve() -> (Self, String) {
        let collector = Self::default();
        let app = axum::Router::new().route("/v1/traces", axum::routing::post(receive)).with_state(collector.clone());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        (collector, url)
    }

    fn spans(&self) -> Vec<Exported> {
        self.0.lock().unwrap().clone()
    }
}

async fn receive(State(collector): State<Collector>, headers: HeaderMap, body: Bytes) -> (StatusCode, Vec<u8>) {
    if headers.get("content-type").is_none_or(|v| v != "application/x-protobuf") {
        return (StatusCode::UNSUPPORTED_MEDIA_TYPE, Vec::new());
    }
    let Ok(request) = ExportTraceServiceRequest::decode(body) else {
        return (StatusCode::BAD_REQUEST, Vec::new());
    };
    let mut spans = collector.0.lock().unwrap();
    for resource_spans in request.resource_spans {
        let service = resource_spans
            .resource
            .iter()
            .flat_map(|r| &r.attributes)
            .find(|kv| kv.key == "service.name")
            .map(|kv| text(kv.value.as_ref()))
            .unwrap_or_default();
        for span in resource_spans.scope_spans.into_iter().flat_map(|s| s.spans) {
            spans.push(Exported {
                service: service.clone(),
                trace_id: hex(&span.trace_id),
                span_id: hex(&span.span_id),
                parent_span_id: hex(&span.parent_span_id),
                name: span.name.clone(),
                kind: SpanKind::try_from(span.kind).unwrap_or(SpanKind::Unspecified),
                attributes: span.attributes.iter().map(|kv| (kv.key.clone(), text(kv.value.as_ref()))).collect(),
            });
        }
    }
    (StatusCode::OK, ExportTraceServiceResponse::default().encode_to_vec())
}

/// Stops `process` with SIGTERM and waits for its exit (which flushes its spans).
async fn stop(mut process: Process) {
    process.signal(15);
    let (status, process) =
        tokio::task::spawn_blocking(move || (process.child.wait().unwrap(), process)).await.unwrap();
    assert!(status.success(), "exit 0 on SIGTERM; log:\n{}", process.log());
}

#[tokio::test]
async fn one_store_verification_is_one_trace_from_the_request_to_the_marketplace_call() {
    let app = TestApp::spawn().await;
    let (collector, collector_url) = Collector::serve().await;
    let (sandbox, sandbox_url) = common::sandbox(Default::default()).await;
    let vars = || {
        let mut vars = common::config_vars(&app.db, &app.redis_prefix);
        vars.insert("CONVEYOR_ADMIN_ADDR".into(), format!("127.0.0.1:{}", common::free_port()));
        vars.insert("CONVEYOR_MARKETPLACE_URL".into(), sandbox_url.clone());
        vars.insert("OTEL_EXPORTER_OTLP_ENDPOINT".into(), collector_url.clone());
        // Spans wait in the batch for a minute: what reaches the collector before then was flushed at shutdown.
        vars.insert("OTEL_BSP_SCHEDULE_DELAY".into(), "60000".into());
        vars
    };
    let api_port = common::free_port();
    let mut api_vars = vars();
    api_vars.insert("CONVEYOR_HTTP_ADDR".into(), format!("127.0.0.1:{api_port}"));
    let api = Process::spawn(&["api"], &api_vars);
    let dispatcher = Process::spawn(&["dispatcher"], &vars());
    let worker = Process::spawn(&["worker"], &vars());

    // The caller's own trace: the request's span is its child.
    let (caller_trace, caller_span) = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
    let who = principal();
    let http = reqwest::Client::new();
    let accepted = common::eventually(Duration::from_secs(30), || async {
        http.post(format!("http://127.0.0.1:{api_port}/v1/stores"))
            .bearer_auth(app.token(who))
            .header("idempotency-key", uuid::Uuid::new_v4().to_string())
            .header("traceparent", format!("00-{caller_trace}-{caller_span}-01"))
            .header("tracestate", "congo=t61rcWkgMzE")
            .json(&store_body("traced"))
            .send()
            .await
            .ok()
    })
    .await
    .unwrap_or_else(|| panic!("the API answers; log:\n{}", api.log()));
    assert_eq!(accepted.status(), reqwest::StatusCode::ACCEPTED);
    let body: serde_json::Value = accepted.json().await.unwrap();
    let operation = body["operation"]["id"].as_str().unwrap().to_owned();
    let done = common::operation_reaches(&app, who, &operation, "succeeded", Duration::from_secs(40)).await;
    assert!(done.is_some(), "verified; worker log:\n{}\ndispatcher log:\n{}", worker.log(), dispatcher.log());
    // The job's traceparent in the outbox is the API request span's, in the caller's trace.
    let event = &app.db.rows("outbox_events", who.workspace_id).await[0];
    // The column holds the traceparent, then on a line of its own the tracestate that came with it.
    let (stored, state) = event["traceparent"].as_str().unwrap().split_once('\n').expect("a tracestate stored");
    let stored = stored.to_owned();
    assert_eq!(state, "congo=t61rcWkgMzE");
    assert!(stored.starts_with(&format!("00-{caller_trace}-")), "{stored}");
    assert!(!stored.contains(caller_span), "the request span is a child of the caller's, not the caller's: {stored}");

    for process in [api, dispatcher, worker] {
        stop(process).await;
    }
    let spans = collector.spans();
    let find = |service: &str, name: &str| -> Exported {
        let found: Vec<&Exported> =
            spans.iter().filter(|s| s.service == service && s.name == name && s.trace_id == caller_trace).collect();
        assert_eq!(found.len(), 1, "one {name} span of {service} in the trace; spans:\n{spans:#?}");
        found[0].clone()
    };
    let request = find("conveyor-api", "POST /v1/stores");
    let relay = find("conveyor-dispatcher", "outbox.relay");
    let job = find("conveyor-worker", "job store.verify_credentials");
    let call = find("conveyor-worker", "marketplace.verify_credentials");

    // A chain: caller → API request → relay of the job → the worker's run → the marketplace call.
    assert_eq!(request.parent_span_id, caller_span);
    assert_eq!(relay.parent_span_id, request.span_id);
    assert_eq!(job.parent_span_id, relay.span_id);
    assert_eq!(call.parent_span_id, job.span_id);
    assert_eq!(stored, format!("00-{caller_trace}-{}-01", request.span_id));
    assert_eq!(
        [request.kind, relay.kind, job.kind, call.kind],
        [SpanKind::Server, SpanKind::Producer, SpanKind::Consumer, SpanKind::Client]
    );
    assert_eq!(request.attributes.get("http.route").map(String::as_str), Some("/v1/stores"));
    assert_eq!(request.attributes.get("http.response.status_code").map(String::as_str), Some("202"));
    assert_eq!(relay.attributes.get("job.kind").map(String::as_str), Some("store.verify_credentials"));
    assert_eq!(call.attributes.get("http.response.status_code").map(String::as_str), Some("200"));

    // The marketplace got the call span's own context.
    assert_eq!(sandbox.traceparents(), vec![format!("00-{caller_trace}-{}-01", call.span_id)]);
    // And the caller's tracestate, carried through the request, the outbox row, the stream entry and the run.
    assert_eq!(sandbox.tracestates(), vec!["congo=t61rcWkgMzE".to_owned()]);
}

#[tokio::test]
async fn an_invalid_otlp_endpoint_stops_the_process_at_start_with_the_variable_named() {
    let app = TestApp::spawn().await;
    let mut vars = common::config_vars(&app.db, &app.redis_prefix);
    vars.insert("OTEL_EXPORTER_OTLP_ENDPOINT".into(), "collector:4318".into());
    let mut api = Process::spawn(&["api"], &vars);
    let status = tokio::task::spawn_blocking(move || {
        let status = api.child.wait().unwrap();
        (status, api)
    })
    .await
    .unwrap();
    assert!(!status.0.success());
    let log = status.1.log();
    assert!(log.contains("OTEL_EXPORTER_OTLP_ENDPOINT must be an http:// or https:// URL"), "{log}");
}
