//! `GET /v1/operations` (keyset pagination, filters, workspace isolation) and `POST /v1/operations/{id}/cancel`
//! (queued and running operations, finished ones, other workspaces), against real PostgreSQL, Redis and the sandbox
//! marketplace.

use crate::common;

use std::collections::HashSet;
use std::time::Duration;

use chrono::{DateTime, Utc};
use common::{TestApp, principal, store_body};
use conveyor_jobs::Metrics;
use conveyor_jobs::WorkerSettings;
use conveyor_server::auth::Principal;
use conveyor_shop::adapters::sandbox::Settings;
use reqwest::{Method, StatusCode};
use serde_json::Value;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// Creates a store; returns its id and its operation's id.
async fn create_store(app: &TestApp, who: Principal, marker: &str) -> (String, String) {
    let resp = app.send(Method::POST, "/v1/stores", who, Some(&store_body(marker))).await;
    assert_eq!(resp.status(), StatusCode::ACCEPTED);
    let v: Value = resp.json().await.unwrap();
    (v["store"]["id"].as_str().unwrap().to_owned(), v["operation"]["id"].as_str().unwrap().to_owned())
}

/// Creates `n` operations of `kind` in one transaction: they share one `created_at`, so only their ids order them.
async fn create_batch(app: &TestApp, who: Principal, kind: &str, n: usize) -> Vec<String> {
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, who.workspace_id).await.unwrap();
    let mut ids = Vec::new();
    for _ in 0..n {
        let op = conveyor_jobs::create_operation_tx(&mut tx, who.workspace_id, who.user_id, kind, None).await.unwrap();
        ids.push(op.id.to_string());
    }
    tx.commit().await.unwrap();
    ids
}

async fn cancel(app: &TestApp, who: Principal, id: &str) -> reqwest::Response {
    app.send(Method::POST, &format!("/v1/operations/{id}/cancel"), who, None).await
}

/// One page of the listing: the operations and the next cursor.
async fn page(app: &TestApp, who: Principal, query: &str) -> (Vec<Value>, Option<String>) {
    let resp = app.send(Method::GET, &format!("/v1/operations{query}"), who, None).await;
    assert_eq!(resp.status(), StatusCode::OK, "{query}");
    let body: Value = resp.json().await.unwrap();
    let next = match &body["next_cursor"] {
        Value::Null => None,
        Value::String(s) => Some(s.clone()),
        other => panic!("next_cursor is {other}"),
    };
    (body["operations"].as_array().unwrap().clone(), next)
}

/// Every operation of the listing with `filter`, paging with `limit`; checks each page's size and that only the
/// last one has no cursor.
async fn all_pages(app: &TestApp, who: Principal, filter: &str, limit: usize) -> Vec<String> {
    let mut ids = Vec::new();
    let mut cursor: Option<String> = None;
    for _ in 0..100 {
        let query = match &cursor {
            Some(c) => format!("?limit={limit}{filter}&cursor={c}"),
            None => format!("?limit={limit}{filter}"),
        };
        let (ops, next) = page(app, who, &query).await;
        assert!(ops.len() <= limit);
        ids.extend(ops.iter().map(|op| op["id"].as_str().unwrap().to_owned()));
        match next {
            Some(next) => {
                assert_eq!(ops.len(), limit, "only the last page is short");
                cursor = Some(next);
            }
            None => return ids,
        }
    }
    panic!("the listing never ended");
}

/// `ids` ordered as the listing must order them: newest first by `created_at`, then by id, both descending.
async fn newest_first(app: &TestApp, who: Principal, ids: &[String]) -> Vec<String> {
    let mut keyed = Vec::new();
    for id in ids {
        let op = common::operation(app, who, id).await;
        let created: DateTime<Utc> = op["created_at"].as_str().unwrap().parse().unwrap();
        keyed.push((created, Uuid::parse_str(id).unwrap()));
    }
    keyed.sort_by(|a, b| b.cmp(a));
    keyed.into_iter().map(|(_, id)| id.to_string()).collect()
}

async fn assert_validation_failed(resp: reqwest::Response, what: &str) {
    assert_eq!(resp.status(), StatusCode::UNPROCESSABLE_ENTITY, "{what}");
    assert_eq!(resp.headers()["content-type"], "application/problem+json", "{what}");
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["code"], "VALIDATION_FAILED", "{what}");
    assert_eq!(body["status"], 422, "{what}");
}

#[tokio::test]
async fn the_listing_pages_newest_first_filters_and_shows_only_the_callers_workspace() {
    let app = TestApp::spawn().await;
    let (who, other) = (principal(), principal());
    let mut stores = Vec::new();
    for i in 0..5 {
        stores.push(create_store(&app, who, &format!("a{i}")).await.1);
    }
    // Three created in one transaction (one created_at), between the stores: a page boundary falls among them.
    let batch = create_batch(&app, who, "test.batch", 3).await;
    for i in 5..7 {
        stores.push(create_store(&app, who, &format!("a{i}")).await.1);
    }
    let theirs = vec![create_store(&app, other, "b0").await.1, create_store(&app, other, "b1").await.1];
    let canceled = [stores[1].clone(), stores[5].clone()];
    for id in &canceled {
        assert_eq!(cancel(&app, who, id).await.status(), StatusCode::OK);
    }

    let every: Vec<String> = stores.iter().chain(&batch).cloned().collect();
    let expected = newest_first(&app, who, &every).await;
    for limit in [2, 3, 200] {
        let listed = all_pages(&app, who, "", limit).await;
        assert_eq!(listed, expected, "limit {limit}: newest first, no duplicates, no gaps");
    }
    let (ops, next) = page(&app, who, "").await;
    assert_eq!(ops.len(), expected.len(), "default limit holds all ten");
    assert_eq!(next, None);
    // Each entry has the shape of GET /v1/operations/{id}.
    assert_eq!(ops[0], common::operation(&app, who, &expected[0]).await);
    assert!(ops.iter().all(|op| op["created_at"].is_string() && op["updated_at"].is_string()));
    // Empty values count as absent.
    assert_eq!(page(&app, who, "?status=&kind=&limit=&cursor=").await.0.len(), expected.len());

    // Filters, alone and together, still newest first.
    assert_eq!(all_pages(&app, who, "&status=canceled", 2).await, newest_first(&app, who, &canceled).await);
    let queued: Vec<String> = every.iter().filter(|id| !canceled.contains(id)).cloned().collect();
    assert_eq!(all_pages(&app, who, "&status=queued", 2).await, newest_first(&app, who, &queued).await);
    assert_eq!(all_pages(&app, who, "&kind=test.batch", 2).await, newest_first(&app, who, &batch).await);
    let live_stores: Vec<String> = stores.iter().filter(|id| !canceled.contains(id)).cloned().collect();
    assert_eq!(
        all_pages(&app, who, "&kind=store.verify_credentials&status=queued", 2).await,
        newest_first(&app, who, &live_stores).await
    );
    assert_eq!(page(&app, who, "?kind=nothing.like.this").await, (vec![], None));
    assert_eq!(page(&app, who, "?status=succeeded").await, (vec![], None));

    // The other workspace sees its own two only, and mine never appear there (nor its in mine).
    let listed = all_pages(&app, other, "", 1).await;
    assert_eq!(listed, newest_first(&app, other, &theirs).await);
    let mine: HashSet<&String> = every.iter().collect();
    assert!(listed.iter().all(|id| !mine.contains(id)));
    // My cursor in the other workspace is only a position: it shows nothing of mine.
    let (_, my_cursor) = page(&app, who, "?limit=1").await;
    let (ops, _) = page(&app, other, &format!("?cursor={}", my_cursor.clone().unwrap())).await;
    assert!(ops.iter().all(|op| !mine.contains(&op["id"].as_str().unwrap().to_owned())));

    // Bad parameters: 422 problem+json.
    let cursor = my_cursor.unwrap();
    for query in [
        "?limit=0",
        "?limit=201",
        "?limit=-1",
        "?limit=abc",
        "?limit=1.5",
        "?status=done",
        "?status=QUEUED",
        "?cursor=not-a-cursor",
        "?cursor=%%%",
        "?cursor=AAAA",
        &format!("?cursor={cursor}x"),
        &format!("?cursor={}", &cursor[..cursor.len() - 2]),
        "?limit=2&limit=3",
        "?state=queued",
    ] {
        assert_validation_failed(app.send(Method::GET, &format!("/v1/operations{query}"), who, None).await, query)
            .await;
    }
    let resp = app.http.get(app.url("/v1/operations")).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
}

fn fast() -> WorkerSettings {
    WorkerSettings { concurrency: 8, ..WorkerSettings::default() }
}

#[tokio::test]
async fn a_queued_operation_canceled_never_reaches_the_marketplace_and_cannot_be_canceled_twice() {
    let app = TestApp::spawn().await;
    let redis = common::redis_url();
    let (who, other) = (principal(), principal());
    let (store, op) = create_store(&app, who, "first").await;
    let (_, second_op) = create_store(&app, who, "second").await;

    // No worker yet: the operation is queued.
    let resp = cancel(&app, who, &op).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let canceled: Value = resp.json().await.unwrap();
    assert_eq!(canceled["id"], op.as_str());
    assert_eq!(canceled["status"], "canceled");
    assert_eq!(canceled["kind"], "store.verify_credentials");
    assert_eq!(canceled, common::operation(&app, who, &op).await);
    let events = app.db.rows("outbox_events", who.workspace_id).await;
    let event = events.iter().find(|e| e["operation_id"] == op.as_str()).unwrap();
    assert_eq!(event["status"], "canceled", "its job is canceled with it");

    // A second cancel: 409 naming the operation.
    let resp = cancel(&app, who, &op).await;
    assert_eq!(resp.status(), StatusCode::CONFLICT);
    assert_eq!(resp.headers()["content-type"], "application/problem+json");
    let problem: Value = resp.json().await.unwrap();
    assert_eq!(problem["code"], "OPERATION_FINISHED");
    assert_eq!(problem["operation_id"], op.as_str());
    assert_eq!(problem["status"], 409);

    // Unknown ids, malformed ids and other workspaces' ids: 404, and nothing changes.
    for (caller, id) in [(who, Uuid::now_v7().to_string()), (who, "not-a-uuid".to_owned()), (other, second_op.clone())]
    {
        let resp = cancel(&app, caller, &id).await;
        assert_eq!(resp.status(), StatusCode::NOT_FOUND, "{id}");
        let problem: Value = resp.json().await.unwrap();
        assert_eq!(problem["code"], "NOT_FOUND");
        assert!(problem.get("operation_id").is_none());
    }
    assert_eq!(common::operation(&app, who, &second_op).await["status"], "queued");

    // Now the work runs: the second store is verified, the canceled one never reaches the marketplace.
    let (sandbox, market) = common::sandbox(Settings::default()).await;
    let shutdown = CancellationToken::new();
    common::run_dispatcher(common::test_dispatcher(&app, &redis, |_| {}).await, &shutdown);
    let worker = common::test_worker(&app, &redis, &market, fast(), 5, Metrics::new()).await;
    tokio::spawn(worker.run(shutdown.clone(), Duration::from_secs(5)));
    common::operation_reaches(&app, who, &second_op, "succeeded", Duration::from_secs(30)).await.expect("verified");
    // And a third, created after the worker started, goes through too.
    let (_, third_op) = create_store(&app, who, "third").await;
    common::operation_reaches(&app, who, &third_op, "succeeded", Duration::from_secs(30)).await.expect("verified");

    let stats = sandbox.stats();
    assert_eq!(stats.calls_by_key.get(&op), None, "the canceled operation never reached the marketplace");
    assert_eq!(stats.effects, 2, "only the other two did");
    assert_eq!(common::operation(&app, who, &op).await["status"], "canceled");
    let store: Value = app.send(Method::GET, &format!("/v1/stores/{store}"), who, None).await.json().await.unwrap();
    assert_eq!(store["status"], "pending_verification");
    let resp = cancel(&app, who, &second_op).await;
    assert_eq!(resp.status(), StatusCode::CONFLICT, "a succeeded operation is finished too");
    assert_eq!(resp.json::<Value>().await.unwrap()["operation_id"], second_op.as_str());
    shutdown.cancel();
}

/// An operation canceled after its job started (the operation shows `running`) but before the job's transaction
/// opened (held open here by `worker::before_job_tx`, the window a slower connection such as TLS widens): the
/// delivery finds the job canceled and ends as canceled, not skipped, and nothing runs.
#[tokio::test]
async fn an_operation_canceled_before_its_job_transaction_opens_ends_the_run_canceled() {
    let _scenario = fail::FailScenario::setup();
    fail::cfg("worker::before_job_tx", "return(1500)").unwrap();
    let app = TestApp::spawn().await;
    let redis = common::redis_url();
    let (sandbox, market) = common::sandbox(Settings::default()).await;
    let shutdown = CancellationToken::new();
    common::run_dispatcher(common::test_dispatcher(&app, &redis, |_| {}).await, &shutdown);
    let metrics = Metrics::new();
    let worker = common::test_worker(&app, &redis, &market, fast(), 5, metrics.clone()).await;
    tokio::spawn(worker.run(shutdown.clone(), Duration::from_secs(5)));

    let who = principal();
    let (store, op) = create_store(&app, who, "held").await;
    common::operation_reaches(&app, who, &op, "running", Duration::from_secs(30)).await.expect("running");
    assert_eq!(cancel(&app, who, &op).await.status(), StatusCode::OK);

    let label = |outcome| metrics.jobs.with_label_values(&["stores", "store.verify_credentials", outcome]);
    let (canceled, skipped) = (label("canceled"), label("skipped"));
    common::eventually(Duration::from_secs(30), || async { (canceled.get() + skipped.get() > 0).then_some(()) })
        .await
        .expect("the delivery ended");
    assert_eq!((canceled.get(), skipped.get()), (1, 0), "a delivery that finds its job canceled ends canceled");
    assert_eq!(sandbox.stats().calls, 0, "the handler never ran");
    let store: Value = app.send(Method::GET, &format!("/v1/stores/{store}"), who, None).await.json().await.unwrap();
    assert_eq!(store["status"], "pending_verification");
    shutdown.cancel();
}

#[tokio::test]
async fn a_running_operation_canceled_ends_canceled_and_its_writes_roll_back() {
    let app = TestApp::spawn().await;
    let redis = common::redis_url();
    let (sandbox, market) = common::sandbox(Settings { latency_ms: 3000, ..Settings::default() }).await;
    let shutdown = CancellationToken::new();
    common::run_dispatcher(common::test_dispatcher(&app, &redis, |_| {}).await, &shutdown);
    let metrics = Metrics::new();
    let worker = common::test_worker(&app, &redis, &market, fast(), 5, metrics.clone()).await;
    tokio::spawn(worker.run(shutdown.clone(), Duration::from_secs(5)));

    let who = principal();
    let (store, op) = create_store(&app, who, "slow").await;
    common::operation_reaches(&app, who, &op, "running", Duration::from_secs(30)).await.expect("running");
    let resp = cancel(&app, who, &op).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let canceled: Value = resp.json().await.unwrap();
    assert_eq!(canceled["status"], "canceled");

    // The worker hears of it and rolls the run back once the marketplace answers.
    let ended = metrics.jobs.with_label_values(&["stores", "store.verify_credentials", "canceled"]);
    common::eventually(Duration::from_secs(30), || async { (ended.get() == 1).then_some(()) })
        .await
        .expect("the worker ended the run as canceled");
    let op_now = common::operation(&app, who, &op).await;
    assert_eq!(op_now["status"], "canceled");
    assert!(op_now["result"].is_null());
    let store: Value = app.send(Method::GET, &format!("/v1/stores/{store}"), who, None).await.json().await.unwrap();
    assert_eq!(store["status"], "pending_verification", "the run's writes rolled back");
    let events = app.db.rows("outbox_events", who.workspace_id).await;
    assert_eq!(events[0]["status"], "canceled");
    assert!(sandbox.stats().calls <= 1, "not retried");

    // It stays canceled: no retry, no late success.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(common::operation(&app, who, &op).await["status"], "canceled");
    assert_eq!(metrics.jobs.with_label_values(&["stores", "store.verify_credentials", "succeeded"]).get(), 0);
    assert_eq!(metrics.jobs.with_label_values(&["stores", "store.verify_credentials", "retried"]).get(), 0);
    let resp = cancel(&app, who, &op).await;
    assert_eq!(resp.status(), StatusCode::CONFLICT);
    assert_eq!(resp.json::<Value>().await.unwrap()["code"], "OPERATION_FINISHED");
    shutdown.cancel();
}
