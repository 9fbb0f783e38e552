//! What `/metrics` shows an SRE's alerts: labelled counters born at 0 in a fresh process (so `increase()` sees the
//! first event), `conveyor_build_info` with each process's role, the process collector, and connection pools read at
//! scrape. Real processes of the `conveyor` binary against real PostgreSQL and Redis.

use crate::common;

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use common::{Process, TestApp};

// The fixed label sets the dashboards and alerts rely on, written out here (not read from the code under test): a
// label renamed or dropped fails the test.
/// `conveyor_job_dead_letters_total{reason}`.
const JOB_DEAD_LETTER_REASONS: [&str; 5] = ["no_handler", "undecodable", "permanent", "exhausted", "worker_stopped"];
/// `conveyor_outbox_dispatch_errors_total{reason}`.
const DISPATCH_ERROR_REASONS: [&str; 3] = ["database", "redis_unavailable", "redis_error"];
/// `conveyor_outbox_relay_passes_total{pass}`.
const RELAY_PASSES: [&str; 3] = ["sweep", "named", "tick"];
/// `conveyor_idempotency_requests_total{outcome}`.
const IDEMPOTENCY_OUTCOMES: [&str; 5] = ["executed", "replayed", "key_reused", "in_progress", "rejected"];
/// `conveyor_media_derivations_total{result}`.
const MEDIA_RESULTS: [&str; 3] = ["derived", "reused", "rejected"];

/// One sample of the text format: its name, its labels, its value.
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// The samples of a `/metrics` text (label values here hold no `,` or `"`).
fn samples(text: &str) -> Vec<Sample> {
    text.lines()
        .filter(|line| !line.starts_with('#') && !line.trim().is_empty())
        .map(|line| {
            let (series, value) = line.rsplit_once(' ').expect("a sample line has a value");
            let (name, labels) = match series.split_once('{') {
                None => (series, BTreeMap::new()),
                Some((name, rest)) => {
                    let labels = rest
                        .trim_end_matches('}')
                        .split(',')
                        .filter(|pair| !pair.is_empty())
                        .map(|pair| {
                            let (k, v) = pair.split_once('=').expect("label pair");
                            (k.to_owned(), v.trim_matches('"').to_owned())
                        })
                        .collect();
                    (name, labels)
                }
            };
            Sample { name: name.to_owned(), labels, value: value.parse().expect("numeric sample") }
        })
        .collect()
}

/// The value of the series `name` whose labels include `labels`, if exactly one such series exists.
fn value(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let matching: Vec<f64> = samples(text)
        .into_iter()
        .filter(|s| s.name == name && labels.iter().all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v)))
        .map(|s| s.value)
        .collect();
    match matching.as_slice() {
        [one] => Some(*one),
        _ => None,
    }
}

#[track_caller]
fn assert_value(text: &str, name: &str, labels: &[(&str, &str)], expected: f64) {
    assert_eq!(value(text, name, labels), Some(expected), "{name}{labels:?} in:\n{text}");
}

/// Variables of a real process of this test, its admin listener on a port of its own.
fn process_vars(app: &TestApp, admin_port: u16) -> HashMap<String, String> {
    let mut vars = common::config_vars(&app.db, &app.redis_prefix);
    vars.insert("CONVEYOR_ADMIN_ADDR".into(), format!("127.0.0.1:{admin_port}"));
    vars.insert("CONVEYOR_HTTP_ADDR".into(), format!("127.0.0.1:{}", common::free_port()));
    vars
}

/// The `/metrics` text of the process on `admin_port` once it shows `ready` (a series set when its part has
/// started: the role's parts start after the admin listener).
async fn scrape(process: &Process, admin_port: u16, ready: &str) -> String {
    let http = reqwest::Client::new();
    let get =
        || async { http.get(format!("http://127.0.0.1:{admin_port}/metrics")).send().await.ok()?.text().await.ok() };
    common::eventually(Duration::from_secs(30), || async { get().await.filter(|text| text.contains(ready)) })
        .await
        .unwrap_or_else(|| panic!("the process served /metrics with {ready}; log:\n{}", process.log()));
    // Once more: the scrape that saw `ready` may have read other collectors (the pools) before the process published
    // them, a moment before `ready`; a scrape that starts afterwards sees all it published before `ready`.
    get().await.unwrap_or_else(|| panic!("the process served /metrics again; log:\n{}", process.log()))
}

/// `promtool check metrics` on `text`, when promtool is installed (Debian `prometheus`); CI installs it, and fails
/// without it.
fn promtool_accepts(text: &str) {
    use std::io::Write;
    let Ok(mut child) = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
    else {
        let why = "promtool not installed (Debian `prometheus`; scripts/promtool.sh installs it, as root)";
        // CI installs it (scripts/test runs scripts/promtool.sh as root): there, missing is a failure.
        assert!(std::env::var_os("CI").is_none(), "{why}");
        eprintln!("SKIPPED: `promtool check metrics`: {why}");
        return;
    };
    child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    // Lint findings about names already used by dashboards and alerts are reported, not fatal; a malformed
    // exposition is.
    assert!(out.status.success() || !said.contains("error while linting"), "promtool check metrics: {said}");
    assert!(!said.contains("text format parsing error"), "promtool check metrics: {said}");
    let ours: Vec<&str> = said
        .lines()
        .filter(|l| ["conveyor_build_info", "conveyor_db_pool", "process_"].iter().any(|m| l.starts_with(m)))
        .collect();
    assert!(ours.is_empty(), "promtool finds fault with the new metrics: {ours:?}");
}

/// The process metrics of a Linux process.
#[track_caller]
fn assert_process_metrics(text: &str) {
    for name in ["process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds"] {
        assert!(value(text, name, &[]).is_some(), "{name} in:\n{text}");
    }
    let started = value(text, "process_start_time_seconds", &[]).expect("process_start_time_seconds");
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
    assert!(started > now - 3600.0 && started <= now + 1.0, "a fresh process started just now: {started}");
    assert!(value(text, "process_resident_memory_bytes", &[]).unwrap() > 0.0);
}

#[tokio::test]
async fn a_fresh_worker_shows_its_role_and_every_fixed_counter_at_zero() {
    let app = TestApp::spawn().await;
    let (_sandbox, sandbox_url) = common::sandbox(Default::default()).await;
    let admin_port = common::free_port();
    let mut vars = process_vars(&app, admin_port);
    vars.insert("CONVEYOR_MARKETPLACE_URL".into(), sandbox_url);
    vars.insert("CONVEYOR_WORKER_CONCURRENCY".into(), "7".into());
    let worker = Process::spawn(&["worker"], &vars);
    let text = scrape(&worker, admin_port, "conveyor_worker_concurrency_limit 7").await;

    assert_value(&text, "conveyor_build_info", &[("role", "worker"), ("version", env!("CARGO_PKG_VERSION"))], 1.0);
    assert!(value(&text, "conveyor_build_info", &[("role", "worker")]).is_some());
    for reason in JOB_DEAD_LETTER_REASONS {
        assert_value(&text, "conveyor_job_dead_letters_total", &[("reason", reason)], 0.0);
    }
    for kind in ["store.verify_credentials", "listing.publish", "media.process"] {
        assert_value(&text, "conveyor_job_retries_total", &[("type", kind)], 0.0);
        assert_value(&text, "conveyor_jobs_throttled_total", &[("type", kind)], 0.0);
    }
    for outcome in ["succeeded", "dead_lettered", "retried", "failed"] {
        let labels = [("queue", "stores"), ("kind", "store.verify_credentials"), ("outcome", outcome)];
        assert_value(&text, "conveyor_jobs_total", &labels, 0.0);
    }
    for queue in ["stores", "media", "listings", "catalog", "transfers", "ai"] {
        assert_value(&text, "conveyor_worker_reclaims_total", &[("queue", queue)], 0.0);
    }
    for result in MEDIA_RESULTS {
        assert_value(&text, "conveyor_media_derivations_total", &[("result", result)], 0.0);
    }
    // Saturation: jobs in flight against the configured concurrency.
    assert_value(&text, "conveyor_worker_jobs_in_flight", &[], 0.0);
    assert_value(&text, "conveyor_worker_concurrency_limit", &[], 7.0);
    // Every pool of a worker, with its maximum.
    assert_value(&text, "conveyor_db_pool_max_connections", &[("pool", "app")], 16.0);
    assert_value(&text, "conveyor_db_pool_max_connections", &[("pool", "worker_handlers")], 7.0);
    assert_value(&text, "conveyor_db_pool_max_connections", &[("pool", "worker_control")], 2.0);
    // A worker holds no operator pool, although it was given the operator URL: only the API serves /admin/v1.
    assert!(value(&text, "conveyor_db_pool_max_connections", &[("pool", "operator")]).is_none(), "{text}");
    for pool in ["app", "worker_handlers", "worker_control"] {
        for state in ["idle", "in_use"] {
            assert!(value(&text, "conveyor_db_pool_connections", &[("pool", pool), ("state", state)]).is_some());
        }
    }
    // The worker's own pool holds connections open (the LISTEN of cancellations, the reads of its loop).
    let open = value(&text, "conveyor_db_pool_connections", &[("pool", "app"), ("state", "idle")]).unwrap()
        + value(&text, "conveyor_db_pool_connections", &[("pool", "app"), ("state", "in_use")]).unwrap();
    assert!(open >= 1.0, "the app pool has connections open:\n{text}");
    assert_process_metrics(&text);
    promtool_accepts(&text);
}

#[tokio::test]
async fn a_fresh_dispatcher_counts_every_registered_queue_and_failure_from_zero() {
    let app = TestApp::spawn().await;
    // A worker registered its kinds (and their queues) before this dispatcher starts.
    let worker = common::test_worker(
        &app,
        &common::redis_url(),
        "http://127.0.0.1:9",
        Default::default(),
        3,
        conveyor_jobs::Metrics::new(),
    )
    .await;
    worker.register_kinds().await.unwrap();
    let admin_port = common::free_port();
    let dispatcher = Process::spawn(&["dispatcher"], &process_vars(&app, admin_port));
    // The queues are read with the backlog, right after the dispatcher starts.
    let text = scrape(&dispatcher, admin_port, "conveyor_outbox_dead_letters_total{").await;

    assert!(value(&text, "conveyor_build_info", &[("role", "dispatcher")]).is_some(), "{text}");
    assert!(value(&text, "conveyor_build_info", &[("role", "worker")]).is_none());
    for reason in DISPATCH_ERROR_REASONS {
        assert_value(&text, "conveyor_outbox_dispatch_errors_total", &[("reason", reason)], 0.0);
    }
    assert_value(&text, "conveyor_outbox_dead_letters_total", &[("queue", "stores")], 0.0);
    assert_value(&text, "conveyor_outbox_dispatched_total", &[("queue", "stores")], 0.0);
    // Both kinds of relay pass are series from the start (the first sweep has run; named passes may not have).
    for pass in RELAY_PASSES {
        let passes = value(&text, "conveyor_outbox_relay_passes_total", &[("pass", pass)]);
        assert!(passes.is_some(), "conveyor_outbox_relay_passes_total{{pass={pass}}} in:\n{text}");
    }
    // A dispatcher runs no jobs: no worker series, and its role tells alerts apart.
    assert!(value(&text, "conveyor_worker_concurrency_limit", &[]).is_none_or(|v| v == 0.0));
    assert!(value(&text, "conveyor_db_pool_max_connections", &[("pool", "app")]).is_some());
    assert_process_metrics(&text);
    promtool_accepts(&text);
}

#[tokio::test]
async fn a_fresh_api_counts_idempotent_requests_from_zero() {
    let app = TestApp::spawn().await;
    let admin_port = common::free_port();
    let api = Process::spawn(&["api"], &process_vars(&app, admin_port));
    let text = scrape(&api, admin_port, "conveyor_idempotency_requests_total{").await;

    assert!(value(&text, "conveyor_build_info", &[("role", "api")]).is_some(), "{text}");
    for outcome in IDEMPOTENCY_OUTCOMES {
        assert_value(&text, "conveyor_idempotency_requests_total", &[("outcome", outcome)], 0.0);
    }
    assert_value(&text, "conveyor_db_pool_max_connections", &[("pool", "operator")], 4.0);
    assert_process_metrics(&text);
    promtool_accepts(&text);
}

#[tokio::test]
async fn pool_gauges_follow_the_connections_held() {
    let db = common::TestDb::create().await;
    let pool = conveyor_jobs::connect_postgres(&db.app_url, 5).await.unwrap();
    let metrics = conveyor_jobs::Metrics::new();
    metrics.watch_pool("app", pool.clone());
    let in_use = |text: &str| value(text, "conveyor_db_pool_connections", &[("pool", "app"), ("state", "in_use")]);
    let idle = |text: &str| value(text, "conveyor_db_pool_connections", &[("pool", "app"), ("state", "idle")]);

    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(pool.acquire().await.unwrap());
    }
    let text = metrics.render();
    assert_eq!(in_use(&text), Some(3.0), "{text}");
    assert_value(&text, "conveyor_db_pool_max_connections", &[("pool", "app")], 5.0);

    drop(held);
    // A released connection goes back to the pool's idle set.
    let text = common::eventually(Duration::from_secs(10), || {
        let text = metrics.render();
        std::future::ready((in_use(&text) == Some(0.0)).then_some(text))
    })
    .await
    .expect("connections released");
    assert!(idle(&text).is_some_and(|n| n >= 3.0), "{text}");

    // The same name watched again is one pool, not two series.
    metrics.watch_pool("app", pool.clone());
    assert_value(&metrics.render(), "conveyor_db_pool_max_connections", &[("pool", "app")], 5.0);
}
