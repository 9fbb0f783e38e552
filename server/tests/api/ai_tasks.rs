//! AI tasks (`ai.generate`): the API's answers and codes, the monthly credits never overspent by concurrent requests,
//! and one provider charge and one ledger row per task however the job runs (a hang past the job's time-out, a worker
//! killed mid-call, one event delivered twice, a rate limit), with the sandbox provider served in-process.

use crate::common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use common::{Process, TestApp, principal};
use conveyor_jobs::Metrics;
use conveyor_jobs::RedisKeys;
use conveyor_server::auth::Principal;
use conveyor_server::config::Config;
use conveyor_server::http::AppState;
use conveyor_shop::adapters::sandbox::{Sandbox, Settings};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// The tables an AI task writes (beside the idempotency record).
const AI_TABLES: [&str; 5] = ["ai_tasks", "ai_usage_months", "ai_usage_ledger", "operations", "outbox_events"];

/// The variables of a `conveyor` process of this test; the sandbox at `market` is the AI provider too.
fn process_vars(app: &TestApp, market: &str) -> HashMap<String, String> {
    let mut vars = common::config_vars(&app.db, &app.redis_prefix);
    vars.insert("CONVEYOR_ADMIN_ADDR".into(), format!("127.0.0.1:{}", common::free_port()));
    vars.insert("CONVEYOR_MARKETPLACE_URL".into(), market.to_owned());
    vars.insert("CONVEYOR_DISPATCH_POLL".into(), "100ms".into());
    vars
}

/// A worker in this process, wired as `conveyor worker` wires it, with variables changed by `tweak`, until `shutdown`;
/// returns its metrics.
async fn start_worker(
    app: &TestApp,
    market: &str,
    shutdown: &CancellationToken,
    tweak: impl FnOnce(&mut HashMap<String, String>),
) -> Metrics {
    let mut vars = process_vars(app, market);
    tweak(&mut vars);
    let config = Config::from_source(&vars).expect("worker configuration");
    let metrics = Metrics::new();
    let state = AppState(Arc::new(conveyor_server::app::connect_state(&config, metrics.clone()).await.unwrap()));
    let worker = conveyor_server::app::build_worker(&config, &state).await.unwrap();
    tokio::spawn(worker.run(shutdown.clone(), Duration::from_secs(5)));
    metrics
}

/// A dispatcher in this process until `shutdown`.
async fn start_dispatcher(app: &TestApp, shutdown: &CancellationToken) {
    let dispatcher = common::test_dispatcher(app, &common::redis_url(), |v| {
        v.insert("CONVEYOR_DISPATCH_POLL".into(), "100ms".into());
    })
    .await;
    common::run_dispatcher(dispatcher, shutdown);
}

fn text_task(prompt: &str) -> Value {
    json!({"kind": "text", "input": {"prompt": prompt}})
}

/// Posts `body` and expects `202`; returns the task's id and its operation's.
async fn accepted(app: &TestApp, who: Principal, body: &Value) -> (String, String) {
    let resp = app.send(Method::POST, "/v1/ai-tasks", who, Some(body)).await;
    let status = resp.status();
    let v: Value = resp.json().await.unwrap();
    assert_eq!(status, StatusCode::ACCEPTED, "{v}");
    (v["ai_task"]["id"].as_str().unwrap().to_owned(), v["operation"]["id"].as_str().unwrap().to_owned())
}

async fn get_task(app: &TestApp, who: Principal, id: &str) -> Value {
    let resp = app.send(Method::GET, &format!("/v1/ai-tasks/{id}"), who, None).await;
    assert_eq!(resp.status(), StatusCode::OK);
    resp.json().await.unwrap()
}

async fn succeeded(app: &TestApp, who: Principal, operation: &str, log: impl Fn() -> String) {
    let done = common::operation_reaches(app, who, operation, "succeeded", Duration::from_secs(40)).await;
    assert!(done.is_some(), "the task succeeded: {}; log:\n{}", common::operation(app, who, operation).await, log());
}

/// The workspace's credits reserved this month.
async fn credits_reserved(app: &TestApp, who: Principal) -> i64 {
    let rows = app.db.rows("ai_usage_months", who.workspace_id).await;
    rows.first().map(|r| r["credits_reserved"].as_i64().unwrap()).unwrap_or(0)
}

/// Checks that task `task` has exactly one ledger row, of `credits`, and that it is the workspace's only one.
async fn one_ledger_row(app: &TestApp, who: Principal, task: &str, credits: i64) {
    let ledger = app.db.rows("ai_usage_ledger", who.workspace_id).await;
    assert_eq!(ledger.len(), 1, "one ledger row: {ledger:?}");
    assert_eq!(ledger[0]["task_id"], task);
    assert_eq!(ledger[0]["credits"], credits);
    assert!(ledger[0]["provider_charge_id"].as_str().unwrap().starts_with("ch_"), "{ledger:?}");
}

/// Whether the sandbox's provider has made `n` charges by now.
async fn charges_reach(sandbox: &Sandbox, n: u64) -> bool {
    common::eventually(Duration::from_secs(30), || async { (sandbox.stats().ai_charges >= n).then_some(()) })
        .await
        .is_some()
}

#[tokio::test]
async fn a_task_is_accepted_replayed_run_once_and_charged_once() {
    let app = TestApp::spawn().await;
    let (sandbox, market) = common::sandbox(Settings::default()).await;
    let who = principal();
    let key = Uuid::new_v4().to_string();
    let body = text_task("write a title for a red cotton shirt");

    let resp = app.send_with_key(Method::POST, "/v1/ai-tasks", who, Some(&key), Some(&body)).await;
    assert_eq!(resp.status(), StatusCode::ACCEPTED);
    let location = resp.headers()["location"].to_str().unwrap().to_owned();
    let first: Value = resp.json().await.unwrap();
    let (task, operation) =
        (first["ai_task"]["id"].as_str().unwrap().to_owned(), first["operation"]["id"].as_str().unwrap().to_owned());
    assert_eq!(location, format!("/v1/operations/{operation}"));
    assert_eq!(first["ai_task"]["status"], "queued");
    assert_eq!(first["ai_task"]["kind"], "text");
    assert_eq!(first["ai_task"]["result"], Value::Null);
    assert_eq!(first["ai_task"]["cost"], Value::Null);
    assert_eq!(first["ai_task"]["price_credits"], 1);
    assert_eq!(first["operation"]["kind"], "ai.generate");
    assert_eq!(first["operation"]["status"], "queued");

    // The same request again: the stored answer, nothing executed; the key with another request: 409.
    let replay = app.send_with_key(Method::POST, "/v1/ai-tasks", who, Some(&key), Some(&body)).await;
    assert_eq!(replay.status(), StatusCode::ACCEPTED);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(replay.json::<Value>().await.unwrap(), first);
    let other = text_task("something else");
    let reused = app.send_with_key(Method::POST, "/v1/ai-tasks", who, Some(&key), Some(&other)).await;
    assert_eq!(reused.status(), StatusCode::CONFLICT);
    assert_eq!(reused.json::<Value>().await.unwrap()["code"], "IDEMPOTENCY_KEY_REUSED");
    assert_eq!(app.db.count("ai_tasks", who.workspace_id).await, 1);
    assert_eq!(credits_reserved(&app, who).await, 1, "the replay reserved nothing");

    let shutdown = CancellationToken::new();
    start_dispatcher(&app, &shutdown).await;
    start_worker(&app, &market, &shutdown, |_| {}).await;
    succeeded(&app, who, &operation, String::new).await;
    let done = get_task(&app, who, &task).await;
    assert_eq!(done["status"], "succeeded");
    assert_eq!(done["result"]["title"], "Write A Title For A Red Cotton Shirt");
    assert_eq!(done["cost"], json!({"credits": 1}));
    assert!(done["completed_at"].is_string());
    let op = common::operation(&app, who, &operation).await;
    assert_eq!(op["result"]["ai_task_id"], task.as_str());
    assert_eq!(op["result"]["credits"], 1);
    one_ledger_row(&app, who, &task, 1).await;
    let stats = sandbox.stats();
    assert_eq!((stats.ai_calls, stats.ai_charges), (1, 1));
    assert_eq!(stats.ai_calls_by_key.get(&operation), Some(&1), "the provider got the operation id as its key");

    // Other workspaces see nothing; a malformed id is unknown too.
    let stranger = principal();
    for path in [format!("/v1/ai-tasks/{task}"), format!("/v1/ai-tasks/{}", Uuid::now_v7()), "/v1/ai-tasks/x".into()] {
        let resp = app.send(Method::GET, &path, stranger, None).await;
        assert_eq!(resp.status(), StatusCode::NOT_FOUND, "{path}");
        assert_eq!(resp.json::<Value>().await.unwrap()["code"], "NOT_FOUND");
    }
    // Row-level security: the tables are forced, and a session without a workspace sees none of their rows.
    let mut owner = app.db.owner().await;
    let forced: Vec<(bool, bool)> = sqlx::query_as(
        "SELECT relrowsecurity, relforcerowsecurity FROM pg_class
         WHERE relname IN ('ai_tasks', 'ai_usage_months', 'ai_usage_ledger')",
    )
    .fetch_all(&mut owner)
    .await
    .unwrap();
    assert_eq!(forced, vec![(true, true); 3]);
    let mut anonymous = app.db.app_connection().await;
    for table in ["ai_tasks", "ai_usage_months", "ai_usage_ledger"] {
        let (n,): (i64,) =
            sqlx::query_as(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {}", common::qualified(table))))
                .fetch_one(&mut anonymous)
                .await
                .unwrap();
        assert_eq!(n, 0, "{table}");
    }
    shutdown.cancel();
}

#[tokio::test]
async fn bad_input_is_refused_with_the_contracts_error_and_writes_nothing() {
    let app = TestApp::spawn().await;
    let (who, owner) = (principal(), principal());
    // A listing of another workspace.
    let store: Value =
        app.send(Method::POST, "/v1/stores", owner, Some(&common::store_body("ai"))).await.json().await.unwrap();
    let listing_body = json!({
        "store_id": store["store"]["id"],
        "title": "Blue mug",
        "description": "A mug, blue.",
        "price": {"amount": "12.50", "currency": "EUR"},
        "media_ids": [],
    });
    let resp = app.send(Method::POST, "/v1/listings", owner, Some(&listing_body)).await;
    assert_eq!(resp.status(), StatusCode::CREATED);
    let foreign_listing = resp.json::<Value>().await.unwrap()["listing"]["id"].as_str().unwrap().to_owned();

    let prompt = json!({"prompt": "a title"});
    let cases = [
        (json!({"kind": "text", "input": prompt, "priority": "high"}), "VALIDATION_FAILED", "unknown field"),
        (json!({"kind": "video", "input": prompt}), "VALIDATION_FAILED", "kind must be one of"),
        (json!({"kind": 5, "input": prompt}), "VALIDATION_FAILED", "wrong type"),
        (json!({"input": prompt}), "VALIDATION_FAILED", "missing field"),
        (json!({"kind": "text", "input": "a title"}), "VALIDATION_FAILED", "must be an object"),
        (json!({"kind": "text", "input": {}}), "VALIDATION_FAILED", "missing field `prompt`"),
        (json!({"kind": "text", "input": {"prompt": 5}}), "VALIDATION_FAILED", "wrong type"),
        (json!({"kind": "text", "input": {"prompt": "x", "seed": 1}}), "VALIDATION_FAILED", "unknown field `seed`"),
        (json!({"kind": "image", "input": {"prompt": "x", "size": "9x9"}}), "VALIDATION_FAILED", "input.size"),
        (json!({"kind": "text", "input": {"prompt": "x".repeat(20_000)}}), "VALIDATION_FAILED", "at most 16384 bytes"),
        (json!({"kind": "text", "input": prompt, "listing_id": "nope"}), "VALIDATION_FAILED", "wrong type"),
        (json!({"kind": "text", "input": prompt, "listing_id": foreign_listing}), "LISTING_NOT_FOUND", "listing"),
        (json!({"kind": "text", "input": prompt, "listing_id": Uuid::now_v7()}), "LISTING_NOT_FOUND", "listing"),
    ];
    for (body, code, detail) in cases {
        let resp = app.send(Method::POST, "/v1/ai-tasks", who, Some(&body)).await;
        assert_eq!(resp.status(), StatusCode::UNPROCESSABLE_ENTITY, "{body}");
        assert_eq!(resp.headers()["content-type"], "application/problem+json");
        let problem: Value = resp.json().await.unwrap();
        assert_eq!(problem["code"], code, "{body}: {problem}");
        assert!(problem["detail"].as_str().unwrap().contains(detail), "{body}: {problem}");
    }
    let resp = app.send_with_key(Method::POST, "/v1/ai-tasks", who, None, Some(&text_task("x"))).await;
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    assert_eq!(resp.json::<Value>().await.unwrap()["code"], "IDEMPOTENCY_KEY_REQUIRED");
    for table in AI_TABLES.into_iter().chain(["idempotency_requests"]) {
        assert_eq!(app.db.count(table, who.workspace_id).await, 0, "{table} has rows after refused requests");
    }

    // A listing of its own workspace is accepted and shown.
    let store: Value =
        app.send(Method::POST, "/v1/stores", who, Some(&common::store_body("ai"))).await.json().await.unwrap();
    let mut own_listing = listing_body.clone();
    own_listing["store_id"] = store["store"]["id"].clone();
    let resp = app.send(Method::POST, "/v1/listings", who, Some(&own_listing)).await;
    let listing = resp.json::<Value>().await.unwrap()["listing"]["id"].as_str().unwrap().to_owned();
    let body = json!({"kind": "category", "input": {"title": "Blue mug"}, "listing_id": listing});
    let (task, _) = accepted(&app, who, &body).await;
    assert_eq!(get_task(&app, who, &task).await["listing_id"], listing.as_str());
}

#[tokio::test]
async fn concurrent_requests_near_the_quota_never_overspend_it() {
    // Once armed, every request waits after claiming its key until all sixteen have: their transactions are open at
    // once when they reach the month's credits.
    let armed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let barrier = Arc::new(tokio::sync::Barrier::new(16));
    let hook: conveyor_server::http::idempotent::ClaimHook = {
        let (armed, barrier) = (armed.clone(), barrier.clone());
        Arc::new(move || {
            let (armed, barrier) = (armed.clone(), barrier.clone());
            Box::pin(async move {
                if armed.load(std::sync::atomic::Ordering::SeqCst) {
                    barrier.wait().await;
                }
            })
        })
    };
    let app = TestApp::spawn_with_hook(
        |v| {
            v.insert("CONVEYOR_AI_CREDITS_PER_WORKSPACE".into(), "10".into());
            v.insert("CONVEYOR_DATABASE_MAX_CONNECTIONS".into(), "24".into());
        },
        Some(hook),
    )
    .await;
    let who = principal();
    let (_, _) = accepted(&app, who, &json!({"kind": "image", "input": {"prompt": "a lamp"}})).await;
    assert_eq!(credits_reserved(&app, who).await, 5, "an image costs 5 credits");

    // 16 text tasks (1 credit each) at once, with 5 credits left.
    armed.store(true, std::sync::atomic::Ordering::SeqCst);
    let app = Arc::new(app);
    let requests: Vec<_> = (0..16)
        .map(|i| {
            let app = app.clone();
            tokio::spawn(async move {
                let resp = app.send(Method::POST, "/v1/ai-tasks", who, Some(&text_task(&format!("title {i}")))).await;
                let retry_after = resp.headers().get("retry-after").map(|v| v.to_str().unwrap().to_owned());
                (resp.status(), retry_after, resp.json::<Value>().await.unwrap())
            })
        })
        .collect();
    let mut granted = 0;
    for request in requests {
        let (status, retry_after, body) = request.await.unwrap();
        match status {
            StatusCode::ACCEPTED => granted += 1,
            StatusCode::TOO_MANY_REQUESTS => {
                assert_eq!(body["code"], "AI_QUOTA_EXCEEDED", "{body}");
                assert_eq!(body["credits_limit"], 10);
                assert_eq!(body["credits_used"], 10, "refused only once the month is used up: {body}");
                assert_eq!(body["credits_requested"], 1);
                let secs: u64 = retry_after.expect("Retry-After").parse().unwrap();
                assert!((1..=31 * 86_400).contains(&secs), "seconds until the next month: {secs}");
            }
            other => panic!("unexpected {other}: {body}"),
        }
    }
    assert_eq!(granted, 5, "5 credits left: 5 text tasks accepted, the other 11 refused");
    armed.store(false, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(credits_reserved(&app, who).await, 10);
    // Nothing was written for the refused ones.
    for table in ["ai_tasks", "operations", "outbox_events", "idempotency_requests"] {
        assert_eq!(app.db.count(table, who.workspace_id).await, 6, "{table}");
    }
    let resp =
        app.send(Method::POST, "/v1/ai-tasks", who, Some(&json!({"kind": "image", "input": {"prompt": "x"}}))).await;
    assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(resp.json::<Value>().await.unwrap()["credits_requested"], 5);
    // Another workspace has credits of its own.
    accepted(&app, principal(), &text_task("elsewhere")).await;
}

#[tokio::test]
async fn a_refused_task_gives_its_credit_back_and_one_canceled_mid_call_keeps_it() {
    let app = TestApp::spawn_with(|v| {
        v.insert("CONVEYOR_AI_CREDITS_PER_WORKSPACE".into(), "1".into());
    })
    .await;
    let (sandbox, market) = common::sandbox(Settings::default()).await;
    let shutdown = CancellationToken::new();
    start_dispatcher(&app, &shutdown).await;
    let metrics = start_worker(&app, &market, &shutdown, |_| {}).await;
    let who = principal();

    // The provider refuses the content (422): the task fails at once, uncharged.
    let (refused, operation) = accepted(&app, who, &text_task("REFUSE to write this")).await;
    let failed = common::operation_reaches(&app, who, &operation, "failed", Duration::from_secs(30)).await;
    assert!(failed.is_some(), "{}", common::operation(&app, who, &operation).await);
    let task = get_task(&app, who, &refused).await;
    assert_eq!(task["status"], "failed");
    assert_eq!(task["cost"], Value::Null);
    assert!(task["error"].as_str().unwrap().contains("CONTENT_REFUSED"), "{task}");
    assert_eq!(sandbox.stats().ai_charges, 0);

    // Its credit is back (the provider said it did not run the call): the month (1 credit) takes another task, which
    // is canceled while the provider works on it. The provider charges at once and answers a minute later.
    sandbox.set(Settings { latency_ms: 60_000, ..Settings::default() });
    let (canceled, operation) = accepted(&app, who, &text_task("a slow one")).await;
    common::operation_reaches(&app, who, &operation, "running", Duration::from_secs(30)).await.expect("running");
    assert!(charges_reach(&sandbox, 1).await, "the provider was called and charged");
    let resp = app.send(Method::POST, &format!("/v1/operations/{operation}/cancel"), who, Some(&json!({}))).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let task = get_task(&app, who, &canceled).await;
    assert_eq!(task["status"], "canceled");
    assert_eq!(task["cost"], Value::Null);
    // The job stops waiting for the provider (which would answer a minute later) and records nothing.
    let canceled_runs = metrics.jobs.with_label_values(&["ai", "ai.generate", "canceled"]);
    let stopped = common::eventually(Duration::from_secs(20), || async { (canceled_runs.get() == 1).then_some(()) });
    assert!(stopped.await.is_some(), "the run ended as canceled before the provider answered");
    assert_eq!(app.db.count("ai_usage_ledger", who.workspace_id).await, 0, "no result was recorded");

    // The provider may have charged (and did): the canceled task keeps its credit, so the month's one credit cannot
    // buy a second charge by cancelling and submitting again.
    sandbox.set(Settings::default());
    let resp = app.send(Method::POST, "/v1/ai-tasks", who, Some(&text_task("a second try"))).await;
    assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS, "the canceled task keeps its credit");
    assert_eq!(resp.json::<Value>().await.unwrap()["credits_used"], 1);
    let charges = sandbox.stats().ai_charges;
    let reserved = credits_reserved(&app, who).await;
    assert_eq!((charges, reserved), (1, 1), "one provider charge, one credit consumed");
    assert!(charges as i64 <= reserved, "never more provider charges than credits reserved");
    shutdown.cancel();
}

#[tokio::test]
async fn a_provider_that_hangs_past_the_job_time_out_is_charged_once() {
    let app = TestApp::spawn().await;
    // The provider charges, then hangs for 20 s; the job gives up after 1 s and runs again.
    let (sandbox, market) =
        common::sandbox(Settings { timeout_rate: 1.0, hang_ms: 20_000, ..Settings::default() }).await;
    let shutdown = CancellationToken::new();
    start_dispatcher(&app, &shutdown).await;
    start_worker(&app, &market, &shutdown, |v| {
        v.insert("CONVEYOR_JOB_TIMEOUT".into(), "1s".into());
    })
    .await;
    let who = principal();
    let (task, operation) = accepted(&app, who, &text_task("a title please")).await;
    assert!(charges_reach(&sandbox, 1).await, "the provider was called");
    // The first run times out; once the provider answers again, the retry gets the first call's result.
    let timed_out = common::eventually(Duration::from_secs(30), || async {
        let events = app.db.rows("outbox_events", who.workspace_id).await;
        events[0]["last_error"].as_str().is_some_and(|e| e.contains("timed out")).then_some(())
    })
    .await;
    assert!(timed_out.is_some(), "{:?}", app.db.rows("outbox_events", who.workspace_id).await);
    sandbox.set(Settings::default());
    succeeded(&app, who, &operation, String::new).await;
    let stats = sandbox.stats();
    assert!(stats.ai_calls_by_key[&operation] >= 2, "called again: {stats:?}");
    assert_eq!(stats.ai_charges, 1, "one charge: every call carried the operation id");
    one_ledger_row(&app, who, &task, 1).await;
    assert_eq!(get_task(&app, who, &task).await["cost"], json!({"credits": 1}));
    shutdown.cancel();
}

#[tokio::test]
async fn a_worker_killed_mid_call_is_replaced_and_the_task_charged_once() {
    let app = TestApp::spawn().await;
    // The provider charges at once and answers 4 s later: the worker dies with the charge made.
    let (sandbox, market) = common::sandbox(Settings { latency_ms: 4000, ..Settings::default() }).await;
    let shutdown = CancellationToken::new();
    start_dispatcher(&app, &shutdown).await;
    let who = principal();
    let (task, operation) = accepted(&app, who, &json!({"kind": "image", "input": {"prompt": "a blue mug"}})).await;

    let mut victim = Process::spawn(&["worker"], &process_vars(&app, &market));
    assert!(charges_reach(&sandbox, 1).await, "the worker called the provider; log:\n{}", victim.log());
    victim.kill();
    assert_eq!(get_task(&app, who, &task).await["status"], "running", "nothing recorded yet");
    assert_eq!(app.db.count("ai_usage_ledger", who.workspace_id).await, 0);

    // Another worker takes the entry over after the visibility time-out and calls again with the same key.
    sandbox.set(Settings::default());
    let rescuer = Process::spawn(&["worker"], &process_vars(&app, &market));
    succeeded(&app, who, &operation, || rescuer.log()).await;
    let stats = sandbox.stats();
    assert_eq!(stats.ai_calls, 2, "the provider was called again");
    assert_eq!(stats.ai_charges, 1, "one charge: the repeat carried the same idempotency key");
    one_ledger_row(&app, who, &task, 5).await;
    let done = get_task(&app, who, &task).await;
    assert!(done["result"]["url"].as_str().unwrap().starts_with("https://sandbox.invalid/ai/images/"), "{done}");
    shutdown.cancel();
}

#[tokio::test]
async fn one_event_delivered_twice_is_charged_once() {
    let app = TestApp::spawn().await;
    let redis = common::redis_url();
    let (sandbox, market) = common::sandbox(Settings { latency_ms: 300, ..Settings::default() }).await;
    let who = principal();
    let (task, operation) = accepted(&app, who, &text_task("twice delivered")).await;
    let shutdown = CancellationToken::new();
    start_dispatcher(&app, &shutdown).await;
    let client = common::redis_client(&redis).await;
    let stream = RedisKeys::new(&app.redis_prefix).stream("ai");
    common::eventually(Duration::from_secs(20), || async {
        (common::stream_event_ids(&client, &stream).await.len() == 1).then_some(())
    })
    .await
    .expect("relayed");

    // The entry copied, as if delivered twice at once, to two workers.
    {
        use fred::prelude::StreamsInterface;
        let entries: Vec<(String, HashMap<String, String>)> = client.xrange(&stream, "-", "+", None).await.unwrap();
        let fields: Vec<(String, String)> = entries[0].1.clone().into_iter().collect();
        let _: String = client.xadd(&stream, false, None, "*", fields).await.unwrap();
    }
    start_worker(&app, &market, &shutdown, |_| {}).await;
    start_worker(&app, &market, &shutdown, |_| {}).await;
    succeeded(&app, who, &operation, String::new).await;
    common::eventually(Duration::from_secs(20), || async {
        common::stream_event_ids(&client, &stream).await.is_empty().then_some(())
    })
    .await
    .expect("both deliveries consumed");
    let stats = sandbox.stats();
    assert_eq!(stats.ai_calls_by_key.get(&operation), Some(&1), "one provider call: the repeat was skipped");
    assert_eq!(stats.ai_charges, 1);
    one_ledger_row(&app, who, &task, 1).await;
    shutdown.cancel();
}

#[tokio::test]
async fn a_rate_limited_call_is_retried_after_its_retry_after_and_succeeds() {
    let app = TestApp::spawn().await;
    // The provider's next call answers 429 with Retry-After: 5 (the kind's first back-off is at most 1 s).
    let settings = Settings { ai_rate_limited_calls: 1, ai_retry_after_secs: 5, ..Settings::default() };
    let (sandbox, market) = common::sandbox(settings).await;
    let shutdown = CancellationToken::new();
    start_dispatcher(&app, &shutdown).await;
    start_worker(&app, &market, &shutdown, |_| {}).await;
    let who = principal();
    let (task, operation) = accepted(&app, who, &text_task("rate limited")).await;

    let wait = common::eventually(Duration::from_secs(30), || async {
        let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, who.workspace_id).await.unwrap();
        let row: Option<(Option<String>, f64)> = sqlx::query_as(
            "SELECT last_error, extract(epoch FROM next_attempt_at - now())::float8 FROM conveyor.outbox_events
             WHERE last_error IS NOT NULL",
        )
        .fetch_optional(&mut *tx)
        .await
        .unwrap();
        tx.commit().await.unwrap();
        row.filter(|(error, _)| error.as_deref().is_some_and(|e| e.contains("429"))).map(|(_, wait)| wait)
    })
    .await
    .expect("the 429 was recorded");
    assert!(wait > 2.5, "the retry waits for the provider's Retry-After, not the 1 s back-off: {wait} s");
    succeeded(&app, who, &operation, String::new).await;
    let stats = sandbox.stats();
    assert_eq!(stats.ai_calls_by_key.get(&operation), Some(&2), "one refused call, one that ran");
    assert_eq!(stats.ai_charges, 1);
    one_ledger_row(&app, who, &task, 1).await;
    shutdown.cancel();
}

#[tokio::test]
async fn a_replayed_dead_letter_reserves_its_credits_again_and_is_charged_once() {
    let app = TestApp::spawn_with(|v| {
        v.insert("CONVEYOR_AI_CREDITS_PER_WORKSPACE".into(), "2".into());
    })
    .await;
    let (sandbox, market) = common::sandbox(Settings::default()).await;
    let shutdown = CancellationToken::new();
    start_dispatcher(&app, &shutdown).await;
    // The provider cannot be reached (nothing listens), and a task gets one run: the first task is dead-lettered
    // without any call having run, so it was surely not charged.
    let unreachable = CancellationToken::new();
    start_worker(&app, &market, &unreachable, |v| {
        v.insert("CONVEYOR_MARKETPLACE_URL".into(), format!("http://127.0.0.1:{}", common::free_port()));
        v.insert("CONVEYOR_JOB_MAX_ATTEMPTS".into(), "1".into());
    })
    .await;
    let who = principal();
    let (first, operation) = accepted(&app, who, &text_task("first")).await;
    common::operation_reaches(&app, who, &operation, "failed", Duration::from_secs(30)).await.expect("dead-lettered");
    unreachable.cancel();
    start_worker(&app, &market, &shutdown, |_| {}).await;

    // The next reservation gives its credit back (1 of 2 reserved, by the second task).
    let (second, second_operation) = accepted(&app, who, &text_task("second")).await;
    assert_eq!(credits_reserved(&app, who).await, 1, "the failed task's credit was given back");
    succeeded(&app, who, &second_operation, String::new).await;

    // Replayed, the first task reserves its credit again (in its own month) before it calls the provider, and is
    // charged once.
    let events = app.db.rows("outbox_events", who.workspace_id).await;
    let dead = events.iter().find(|e| e["status"] == "dead_letter").expect("a dead letter")["id"].as_str().unwrap();
    let replayed =
        conveyor_jobs::replay_dead_letter(&app.db.pool, who.workspace_id, dead.parse().unwrap()).await.unwrap();
    assert_eq!(replayed, conveyor_jobs::Replay::Replayed);
    succeeded(&app, who, &operation, String::new).await;
    assert_eq!(credits_reserved(&app, who).await, 2);
    let ledger = app.db.rows("ai_usage_ledger", who.workspace_id).await;
    let charged: Vec<&str> = ledger.iter().map(|r| r["task_id"].as_str().unwrap()).collect();
    assert_eq!(charged.len(), 2, "{ledger:?}");
    assert!(charged.contains(&first.as_str()) && charged.contains(&second.as_str()));
    assert_eq!(sandbox.stats().ai_charges, 2);
    let resp = app.send(Method::POST, "/v1/ai-tasks", who, Some(&text_task("third"))).await;
    assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS, "both credits are charged");
    shutdown.cancel();
}

#[tokio::test]
async fn a_task_dead_lettered_after_a_call_that_may_have_run_keeps_its_credit_and_a_replay_records_the_charge() {
    let app = TestApp::spawn_with(|v| {
        v.insert("CONVEYOR_AI_CREDITS_PER_WORKSPACE".into(), "1".into());
    })
    .await;
    // The provider charges, then hangs for 20 s; the job gives up after 1 s, and a task gets one run.
    let (sandbox, market) =
        common::sandbox(Settings { timeout_rate: 1.0, hang_ms: 20_000, ..Settings::default() }).await;
    let shutdown = CancellationToken::new();
    start_dispatcher(&app, &shutdown).await;
    start_worker(&app, &market, &shutdown, |v| {
        v.insert("CONVEYOR_JOB_TIMEOUT".into(), "1s".into());
        v.insert("CONVEYOR_JOB_MAX_ATTEMPTS".into(), "1".into());
    })
    .await;
    let who = principal();
    let (task, operation) = accepted(&app, who, &text_task("charged then lost")).await;
    common::operation_reaches(&app, who, &operation, "failed", Duration::from_secs(30)).await.expect("dead-lettered");
    assert_eq!(sandbox.stats().ai_charges, 1, "the provider charged before the run gave up");

    // The task may have been charged: it keeps its credit, and the month (1 credit) takes no other task.
    let resp = app.send(Method::POST, "/v1/ai-tasks", who, Some(&text_task("another"))).await;
    assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS, "the dead-lettered task keeps its credit");
    assert_eq!(credits_reserved(&app, who).await, 1);
    assert!(sandbox.stats().ai_charges as i64 <= credits_reserved(&app, who).await);

    // Replayed, it calls again with the same key (no new charge) and records its one ledger row, reserving nothing.
    sandbox.set(Settings::default());
    let events = app.db.rows("outbox_events", who.workspace_id).await;
    let dead = events.iter().find(|e| e["status"] == "dead_letter").expect("a dead letter")["id"].as_str().unwrap();
    let replayed =
        conveyor_jobs::replay_dead_letter(&app.db.pool, who.workspace_id, dead.parse().unwrap()).await.unwrap();
    assert_eq!(replayed, conveyor_jobs::Replay::Replayed);
    succeeded(&app, who, &operation, String::new).await;
    one_ledger_row(&app, who, &task, 1).await;
    assert_eq!(credits_reserved(&app, who).await, 1);
    assert_eq!(sandbox.stats().ai_charges, 1, "one charge: the replay carried the same key");
    shutdown.cancel();
}
