//! Conveyor's metrics in the host's own registry, under the names the shipped dashboard queries.

use std::collections::BTreeSet;
use std::time::Duration;

use conveyor_jobs::{
    Conveyor, EnqueueOptions, Handler, JobContext, JobError, JobKind, JobStatus, Metrics, WorkerSettings,
};
use prometheus::{Encoder, IntCounter, Registry, TextEncoder};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::kit::{self, Platform};

#[derive(Serialize, Deserialize)]
struct Tick;

impl JobKind for Tick {
    const KIND: &'static str = "test.tick";
    const QUEUE: &'static str = "test-ticks";
}

struct Ticks;

impl Handler<Tick> for Ticks {
    async fn handle(&self, _: Tick, _: &mut JobContext) -> Result<Value, JobError> {
        Ok(Value::Null)
    }
}

/// The series names in a text exposition (`_bucket`, `_sum` and `_count` of histograms as the dashboard queries them).
fn series_names(exposition: &str) -> BTreeSet<String> {
    exposition
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| l.split(['{', ' ']).next().unwrap().to_owned())
        .collect()
}

/// Every `conveyor_…` name the dashboard's queries use.
fn dashboard_names() -> BTreeSet<String> {
    let dashboard: Value = serde_json::from_str(include_str!("../../dashboards/conveyor.json")).unwrap();
    let mut exprs = Vec::new();
    fn walk(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Object(map) => map.iter().for_each(|(k, v)| match (k.as_str(), v) {
                ("expr", Value::String(e)) => out.push(e.clone()),
                _ => walk(v, out),
            }),
            Value::Array(items) => items.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    walk(&dashboard, &mut exprs);
    assert!(exprs.len() > 20, "the dashboard has its queries ({})", exprs.len());
    let mut names = BTreeSet::new();
    for e in exprs {
        for (i, _) in e.match_indices("conveyor_") {
            let name: String =
                e[i..].chars().take_while(|c| c.is_ascii_lowercase() || *c == '_' || c.is_ascii_digit()).collect();
            names.insert(name);
        }
    }
    names
}

/// The server's and the shop's own series on the shared dashboard (HTTP, idempotency, media): not the platform's.
const PRODUCT_SERIES: &[&str] = &[
    "conveyor_http_request_duration_seconds_bucket",
    "conveyor_http_request_duration_seconds_count",
    "conveyor_idempotency_records_purged_total",
    "conveyor_idempotency_requests_total",
    "conveyor_media_derivations_total",
];

#[tokio::test]
async fn a_hosts_registry_shows_conveyors_series_under_the_dashboards_names_beside_its_own() {
    let platform = Platform::single_role().await;
    // The host's registry, with a series of its own.
    let registry = Registry::new();
    let own = IntCounter::new("host_requests_total", "The host's own").unwrap();
    registry.register(Box::new(own.clone())).unwrap();
    own.inc();
    let metrics = Metrics::registered_in(&registry).unwrap();
    let families = registry.gather().len();
    assert!(Metrics::registered_in(&registry).is_err(), "a second set in one registry is refused, not doubled");
    assert_eq!(registry.gather().len(), families, "and the refusal registered nothing");
    let conveyor = Conveyor::builder(platform.pool.clone(), &kit::redis_url())
        .prefix(&platform.prefix)
        .metrics(metrics)
        .connect()
        .await
        .unwrap();
    let render = || {
        let mut text = Vec::new();
        TextEncoder::new().encode(&registry.gather(), &mut text).unwrap();
        String::from_utf8(text).unwrap()
    };
    // The backlog gauges, read while a job waits in the outbox (a running dispatcher reads them again, and once the
    // job has ended they have no series left): their names are taken now.
    let job = conveyor.enqueue(&Tick, EnqueueOptions::new()).await.unwrap();
    conveyor.dispatcher().observe_backlog().await.unwrap();
    let with_backlog = series_names(&render());
    // The stream gauges come with the worker's reclaim pass.
    let settings = WorkerSettings { reclaim_interval: Duration::from_millis(50), ..WorkerSettings::default() };
    let worker = conveyor.worker().handle::<Tick>(Ticks).settings(settings).build().unwrap();
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(conveyor.clone().run(worker, shutdown.clone()));
    assert_eq!(conveyor.wait_for_job(job.id, Duration::from_secs(30)).await.unwrap().status, JobStatus::Succeeded);
    conveyor.maintenance().run_once().await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !render().contains("conveyor_stream_length{") && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    shutdown.cancel();
    running.await.unwrap().unwrap();
    let text = render();
    assert!(text.contains("host_requests_total 1"), "the host's own series stays");
    assert!(
        text.contains(r#"conveyor_jobs_total{kind="test.tick",outcome="succeeded",queue="test-ticks"} 1"#),
        "the job is counted in the host's registry:\n{text}"
    );
    let mut exported = series_names(&text);
    exported.extend(with_backlog);
    let missing: Vec<String> = dashboard_names()
        .into_iter()
        .filter(|n| !exported.contains(n) && !PRODUCT_SERIES.contains(&n.as_str()))
        .collect();
    assert!(missing.is_empty(), "the dashboard queries series the platform does not export: {missing:?}");
    for name in PRODUCT_SERIES {
        assert!(!exported.contains(*name), "{name} is the platform's after all: take it off PRODUCT_SERIES");
    }
}
