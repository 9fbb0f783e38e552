//! Catalog full sync end to end: one active sync per store decided by the database, page-by-page commits that a
//! SIGKILLed worker resumes after, removed products, cancellation, the products listing. Real PostgreSQL, Redis,
//! the sandbox marketplace over HTTP and real `conveyor worker` processes.

use crate::common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use common::{Process, TestApp, principal};
use conveyor_jobs::Metrics;
use conveyor_server::auth::Principal;
use conveyor_server::config::Config;
use conveyor_server::http::AppState;
use conveyor_shop::adapters::sandbox::Settings;
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

fn process_vars(app: &TestApp, market: &str, page_size: u32) -> HashMap<String, String> {
    let mut vars = common::config_vars(&app.db, &app.redis_prefix);
    vars.insert("CONVEYOR_ADMIN_ADDR".into(), format!("127.0.0.1:{}", common::free_port()));
    vars.insert("CONVEYOR_MARKETPLACE_URL".into(), market.to_owned());
    vars.insert("CONVEYOR_CATALOG_PAGE_SIZE".into(), page_size.to_string());
    vars.insert("CONVEYOR_WORKER_VISIBILITY".into(), "1s".into());
    vars
}

/// A worker in this process wired as `conveyor worker` wires it, until `shutdown`.
async fn start_worker(app: &TestApp, market: &str, page_size: u32, shutdown: &CancellationToken) {
    let config = Config::from_source(&process_vars(app, market, page_size)).expect("worker configuration");
    let state = AppState(Arc::new(conveyor_server::app::connect_state(&config, Metrics::new()).await.unwrap()));
    let worker = conveyor_server::app::build_worker(&config, &state).await.unwrap();
    tokio::spawn(worker.run(shutdown.clone(), Duration::from_secs(5)));
}

fn start_dispatcher(app: &TestApp, shutdown: &CancellationToken) -> impl std::future::Future<Output = ()> {
    let shutdown = shutdown.clone();
    async move {
        let dispatcher = common::test_dispatcher(app, &common::redis_url(), |v| {
            v.insert("CONVEYOR_DISPATCH_POLL".into(), "100ms".into());
        })
        .await;
        common::run_dispatcher(dispatcher, &shutdown);
    }
}

/// A store created through the API and made `active` directly (verification has tests of its own).
async fn active_store(app: &TestApp, who: Principal, api_key: &str) -> String {
    let body = json!({"name": "Shop", "platform": "sandbox", "credentials": {"api_key": api_key, "api_secret": "s"}});
    let resp = app.send(Method::POST, "/v1/stores", who, Some(&body)).await;
    assert_eq!(resp.status(), StatusCode::ACCEPTED);
    let store = resp.json::<Value>().await.unwrap()["store"]["id"].as_str().unwrap().to_owned();
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, who.workspace_id).await.unwrap();
    sqlx::query("UPDATE conveyor_shop.stores SET status = 'active' WHERE id = $1::uuid")
        .bind(&store)
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    store
}

async fn start_sync(app: &TestApp, who: Principal, store: &str) -> reqwest::Response {
    app.send(Method::POST, &format!("/v1/stores/{store}/catalog-syncs"), who, Some(&json!({}))).await
}

/// Starts a sync that must be accepted; returns (sync id, operation id).
async fn accepted_sync(app: &TestApp, who: Principal, store: &str) -> (String, String) {
    let resp = start_sync(app, who, store).await;
    assert_eq!(resp.status(), StatusCode::ACCEPTED);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["catalog_sync"]["status"], "queued");
    assert_eq!(body["operation"]["kind"], "catalog.sync");
    (body["catalog_sync"]["id"].as_str().unwrap().to_owned(), body["operation"]["id"].as_str().unwrap().to_owned())
}

async fn sync_state(app: &TestApp, who: Principal, sync: &str) -> Value {
    app.send(Method::GET, &format!("/v1/catalog-syncs/{sync}"), who, None).await.json().await.unwrap()
}

async fn sync_reaches(app: &TestApp, who: Principal, sync: &str, status: &str) -> Value {
    common::eventually(Duration::from_secs(60), || async {
        let state = sync_state(app, who, sync).await;
        (state["status"] == status).then_some(state)
    })
    .await
    .unwrap_or_else(|| panic!("sync {sync} never reached {status}: {}", "see the operation"))
}

/// Every product of the store through the API, page by page.
async fn all_products(app: &TestApp, who: Principal, store: &str, limit: u32) -> Vec<Value> {
    let (mut all, mut cursor) = (Vec::new(), String::new());
    loop {
        let path = format!("/v1/stores/{store}/products?limit={limit}&cursor={cursor}");
        let page: Value = app.send(Method::GET, &path, who, None).await.json().await.unwrap();
        all.extend(page["products"].as_array().unwrap().iter().cloned());
        match page["next_cursor"].as_str() {
            Some(next) => cursor = next.to_owned(),
            None => return all,
        }
    }
}

#[tokio::test]
async fn of_twelve_concurrent_requests_one_starts_the_sync_and_eleven_are_told_which_one_is_active() {
    // Once armed, every request waits after claiming its idempotency key until all twelve have: their transactions
    // are open at once when they reach the sync's insert, so only the database can decide.
    let armed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let barrier = Arc::new(tokio::sync::Barrier::new(12));
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
            v.insert("CONVEYOR_DATABASE_MAX_CONNECTIONS".into(), "24".into());
        },
        Some(hook),
    )
    .await;
    let who = principal();
    let (store, other_store) = (active_store(&app, who, "shop-a").await, active_store(&app, who, "shop-b").await);
    armed.store(true, std::sync::atomic::Ordering::SeqCst);
    let answers = futures_util::future::join_all((0..12).map(|_| start_sync(&app, who, &store))).await;
    armed.store(false, std::sync::atomic::Ordering::SeqCst);
    let (mut accepted, mut conflicts) = (Vec::new(), Vec::new());
    for answer in answers {
        match answer.status() {
            StatusCode::ACCEPTED => accepted.push(answer.json::<Value>().await.unwrap()),
            StatusCode::CONFLICT => conflicts.push(answer.json::<Value>().await.unwrap()),
            other => panic!("unexpected {other}"),
        }
    }
    assert_eq!((accepted.len(), conflicts.len()), (1, 11));
    let active = accepted[0]["catalog_sync"]["id"].as_str().unwrap();
    for conflict in &conflicts {
        assert_eq!(conflict["code"], "SYNC_ALREADY_ACTIVE");
        assert_eq!(conflict["active_sync_id"], active);
    }
    assert_eq!(app.db.count("catalog_syncs", who.workspace_id).await, 1);
    assert_eq!(app.db.count("outbox_events", who.workspace_id).await, 2 + 1, "two verifications and one sync");
    // Another store syncs at the same time.
    let (other_sync, _) = accepted_sync(&app, who, &other_store).await;

    // Both run to their end; then the store is free for the next sync.
    let (_, market) = common::sandbox(Settings { catalog_size: 120, ..Settings::default() }).await;
    let shutdown = CancellationToken::new();
    start_dispatcher(&app, &shutdown).await;
    start_worker(&app, &market, 50, &shutdown).await;
    let done = sync_reaches(&app, who, active, "succeeded").await;
    assert_eq!((done["pages_done"].as_i64(), done["items_done"].as_i64()), (Some(3), Some(120)));
    assert_eq!(done["items_total"], 120);
    sync_reaches(&app, who, &other_sync, "succeeded").await;
    let (next, _) = accepted_sync(&app, who, &store).await;
    sync_reaches(&app, who, &next, "succeeded").await;
    let products = all_products(&app, who, &store, 50).await;
    assert_eq!(products.len(), 120);
    shutdown.cancel();
}

#[tokio::test]
async fn a_sync_killed_after_a_few_pages_resumes_after_its_last_committed_page_and_a_smaller_catalog_removes_the_rest()
{
    let app = TestApp::spawn().await;
    let who = principal();
    let store = active_store(&app, who, "big-shop").await;
    let (sandbox, market) =
        common::sandbox(Settings { catalog_size: 3000, latency_ms: 150, ..Settings::default() }).await;
    let shutdown = CancellationToken::new();
    start_dispatcher(&app, &shutdown).await;
    let vars = process_vars(&app, &market, 100);
    let mut first = Process::spawn(&["worker"], &vars);
    let (sync, operation) = accepted_sync(&app, who, &store).await;
    // The page's commit comes first, its progress on the operation just after (on the job's control connection):
    // both, before the kill.
    let shown = common::eventually(Duration::from_secs(60), || async {
        let committed = sync_state(&app, who, &sync).await["pages_done"].as_i64().unwrap_or(0) >= 3;
        let op = common::operation(&app, who, &operation).await;
        (committed && op["progress"]["pages_done"].as_i64().unwrap_or(0) >= 3).then_some(())
    })
    .await;
    assert!(shown.is_some(), "a few pages committed, and the progress shows on the operation");
    first.kill();
    let at_kill = sync_state(&app, who, &sync).await;
    assert_eq!(at_kill["status"], "running");

    let mut second = Process::spawn(&["worker"], &vars);
    let done = sync_reaches(&app, who, &sync, "succeeded").await;
    assert_eq!((done["pages_done"].as_i64(), done["items_done"].as_i64()), (Some(30), Some(3000)), "{done}");
    let products = all_products(&app, who, &store, 500).await;
    assert_eq!(products.len(), 3000);
    let mut ids: Vec<&str> = products.iter().map(|p| p["external_id"].as_str().unwrap()).collect();
    ids.dedup();
    assert_eq!(ids.len(), 3000, "every product exactly once");
    // Resumed after the last committed page: at most the page in flight at the kill was read twice.
    let stats = sandbox.stats();
    let twice: Vec<_> = stats.catalog_pages_by_offset.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.len() <= 1 && twice.iter().all(|(_, n)| **n == 2), "pages read more than once: {twice:?}");
    assert_eq!(stats.catalog_pages_by_offset.len(), 30);

    // The marketplace now lists 2,000: the next sync marks the other 1,000 removed and deletes nothing.
    sandbox.set(Settings { catalog_size: 2000, ..Settings::default() });
    let (smaller, _) = accepted_sync(&app, who, &store).await;
    let done = sync_reaches(&app, who, &smaller, "succeeded").await;
    assert_eq!(done["items_removed"], 1000);
    let products = all_products(&app, who, &store, 500).await;
    assert_eq!(products.len(), 3000);
    let removed = products.iter().filter(|p| p["status"] == "removed").count();
    assert_eq!(removed, 1000);
    assert!(products.iter().filter(|p| p["status"] == "removed").all(|p| p["removed_at"].is_string()));
    second.kill();
    shutdown.cancel();
}

#[tokio::test]
async fn a_canceled_sync_stops_at_its_next_page_and_frees_the_store() {
    let app = TestApp::spawn().await;
    let who = principal();
    let store = active_store(&app, who, "slow-shop").await;
    let (sandbox, market) =
        common::sandbox(Settings { catalog_size: 3000, latency_ms: 200, ..Settings::default() }).await;
    let shutdown = CancellationToken::new();
    start_dispatcher(&app, &shutdown).await;
    start_worker(&app, &market, 100, &shutdown).await;
    let (sync, operation) = accepted_sync(&app, who, &store).await;
    common::eventually(Duration::from_secs(60), || async {
        (sync_state(&app, who, &sync).await["pages_done"].as_i64().unwrap_or(0) >= 1).then_some(())
    })
    .await
    .expect("a page committed");
    let resp = app.send(Method::POST, &format!("/v1/operations/{operation}/cancel"), who, None).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let canceled = sync_reaches(&app, who, &sync, "canceled").await;
    assert!(canceled["finished_at"].is_string());
    // It stops: the pages served stop growing (at most the page in flight at the cancel is read after it).
    let settled = common::eventually(Duration::from_secs(10), || async {
        let before = sandbox.stats().catalog_pages_served;
        tokio::time::sleep(Duration::from_millis(600)).await;
        (sandbox.stats().catalog_pages_served == before).then_some(before)
    })
    .await
    .expect("no more pages are read");
    assert!(settled < 30, "the sync did not run to its end ({settled} pages)");
    let state = sync_state(&app, who, &sync).await;
    assert_eq!(state["items_done"].as_i64().unwrap(), state["pages_done"].as_i64().unwrap() * 100);
    // The store is free again.
    let (next, _) = accepted_sync(&app, who, &store).await;
    assert_ne!(next, sync);
    shutdown.cancel();
}

#[tokio::test]
async fn bad_requests_are_refused_and_other_workspaces_see_nothing() {
    let app = TestApp::spawn().await;
    let who = principal();
    let store = active_store(&app, who, "shop").await;
    // A store that is not active yet.
    let resp = app.send(Method::POST, "/v1/stores", who, Some(&common::store_body("pending"))).await;
    let pending = resp.json::<Value>().await.unwrap()["store"]["id"].as_str().unwrap().to_owned();
    let resp = start_sync(&app, who, &pending).await;
    assert_eq!(resp.status(), StatusCode::CONFLICT);
    assert_eq!(resp.json::<Value>().await.unwrap()["code"], "STORE_NOT_ACTIVE");
    let unknown_field =
        app.send(Method::POST, &format!("/v1/stores/{store}/catalog-syncs"), who, Some(&json!({"full": true}))).await;
    assert_eq!(unknown_field.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let no_key = app
        .send_with_key(Method::POST, &format!("/v1/stores/{store}/catalog-syncs"), who, None, Some(&json!({})))
        .await;
    assert_eq!(no_key.status(), StatusCode::BAD_REQUEST);
    assert_eq!(app.db.count("catalog_syncs", who.workspace_id).await, 0);

    for query in ["limit=0", "limit=501", "limit=x", "cursor=%%%", "cursor=bm90LWEtY3Vyc29y&cursor=x", "sort=title"] {
        let resp = app.send(Method::GET, &format!("/v1/stores/{store}/products?{query}"), who, None).await;
        assert_eq!(resp.status(), StatusCode::UNPROCESSABLE_ENTITY, "{query}");
    }

    let (sync, _) = accepted_sync(&app, who, &store).await;
    let stranger = principal();
    for (method, path) in [
        (Method::POST, format!("/v1/stores/{store}/catalog-syncs")),
        (Method::GET, format!("/v1/catalog-syncs/{sync}")),
        (Method::GET, format!("/v1/stores/{store}/products")),
        (Method::GET, "/v1/catalog-syncs/not-a-uuid".to_owned()),
    ] {
        let body = (method == Method::POST).then(|| json!({}));
        let resp = app.send(method.clone(), &path, stranger, body.as_ref()).await;
        assert_eq!(resp.status(), StatusCode::NOT_FOUND, "{method} {path}");
    }
    assert_eq!(app.db.count("catalog_syncs", stranger.workspace_id).await, 0);
}

#[tokio::test]
async fn a_replayed_start_answers_the_same_sync_and_starts_nothing_more() {
    let app = TestApp::spawn().await;
    let who = principal();
    let store = active_store(&app, who, "a").await;
    let key = uuid::Uuid::new_v4().to_string();
    let path = format!("/v1/stores/{store}/catalog-syncs");
    let first = app.send_with_key(Method::POST, &path, who, Some(&key), Some(&json!({}))).await;
    assert_eq!(first.status(), StatusCode::ACCEPTED);
    let first: Value = first.json().await.unwrap();
    let replay = app.send_with_key(Method::POST, &path, who, Some(&key), Some(&json!({}))).await;
    assert_eq!(replay.status(), StatusCode::ACCEPTED);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(replay.json::<Value>().await.unwrap(), first);
    assert_eq!(app.db.count("catalog_syncs", who.workspace_id).await, 1);
    // A new key is a new request: the database refuses it while the first sync is active.
    let again = start_sync(&app, who, &store).await;
    assert_eq!(again.status(), StatusCode::CONFLICT);
    assert_eq!(again.json::<Value>().await.unwrap()["active_sync_id"], first["catalog_sync"]["id"]);
}

#[tokio::test]
async fn a_replayed_dead_letter_is_its_stores_active_sync_again_unless_another_one_started() {
    let app = TestApp::spawn().await;
    let who = principal();
    // The sandbox refuses these credentials for good: the sync is dead-lettered at once.
    let store = active_store(&app, who, "invalid-key").await;
    let (_, market) = common::sandbox(Settings { catalog_size: 10, ..Settings::default() }).await;
    let run_until_failed = |sync: String| {
        let (app, market) = (&app, market.clone());
        async move {
            let shutdown = CancellationToken::new();
            start_dispatcher(app, &shutdown).await;
            start_worker(app, &market, 5, &shutdown).await;
            sync_reaches(app, who, &sync, "failed").await;
            shutdown.cancel();
            // The worker also verified the store's credentials (refused): active again, for what follows.
            let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, who.workspace_id).await.unwrap();
            sqlx::query("UPDATE conveyor_shop.stores SET status = 'active'").execute(&mut *tx).await.unwrap();
            tx.commit().await.unwrap();
        }
    };
    let (sync, _) = accepted_sync(&app, who, &store).await;
    run_until_failed(sync.clone()).await;
    let job = app.db.rows("outbox_events", who.workspace_id).await.into_iter().find(|e| e["status"] == "dead_letter");
    let job: uuid::Uuid = job.expect("a dead letter")["id"].as_str().unwrap().parse().unwrap();

    // Replayed (nothing runs it yet): it is the store's active sync again, so a new request is refused in its name.
    let replay = conveyor_jobs::replay_dead_letter(&app.db.pool, who.workspace_id, job).await.unwrap();
    assert!(matches!(replay, conveyor_jobs::Replay::Replayed), "{replay:?}");
    assert_eq!(sync_state(&app, who, &sync).await["status"], "queued");
    let refused = start_sync(&app, who, &store).await;
    assert_eq!(refused.status(), StatusCode::CONFLICT);
    assert_eq!(refused.json::<Value>().await.unwrap()["active_sync_id"], sync.as_str());

    // Failed again, the store is free and a new sync is accepted; while that one is active, a replay of the old one
    // is refused by the unique index: two syncs of one store never run at once.
    run_until_failed(sync.clone()).await;
    let (next, _) = accepted_sync(&app, who, &store).await;
    assert!(
        conveyor_jobs::replay_dead_letter(&app.db.pool, who.workspace_id, job).await.is_err(),
        "the unique index refuses the replay"
    );
    assert_eq!(sync_state(&app, who, &sync).await["status"], "failed");
    assert_eq!(sync_state(&app, who, &next).await["status"], "queued");
}
