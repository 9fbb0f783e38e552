//! Listings and their publication (`listing.publish`): the API's answers and codes, one publication at a time however
//! many publishes race, and one marketplace product per listing however the job's processes die or its publication is
//! canceled and asked for again.

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
use conveyor_shop::adapters::sandbox::Settings;
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// The variables of a `conveyor` process of this test, calling the marketplace at `market`.
fn process_vars(app: &TestApp, market: &str) -> HashMap<String, String> {
    let mut vars = common::config_vars(&app.db, &app.redis_prefix);
    vars.insert("CONVEYOR_ADMIN_ADDR".into(), format!("127.0.0.1:{}", common::free_port()));
    vars.insert("CONVEYOR_MARKETPLACE_URL".into(), market.to_owned());
    vars.insert("CONVEYOR_DISPATCH_POLL".into(), "100ms".into());
    vars
}

/// A worker in this process, wired as `conveyor worker` wires it (every shipped handler), until `shutdown`.
async fn start_worker(app: &TestApp, market: &str, shutdown: &CancellationToken) {
    let config = Config::from_source(&process_vars(app, market)).expect("worker configuration");
    let state = AppState(Arc::new(conveyor_server::app::connect_state(&config, Metrics::new()).await.unwrap()));
    let worker = conveyor_server::app::build_worker(&config, &state).await.unwrap();
    tokio::spawn(worker.run(shutdown.clone(), Duration::from_secs(5)));
}

/// A dispatcher in this process until `shutdown`.
async fn start_dispatcher(app: &TestApp, shutdown: &CancellationToken) {
    let dispatcher = common::test_dispatcher(app, &common::redis_url(), |v| {
        v.insert("CONVEYOR_DISPATCH_POLL".into(), "100ms".into());
    })
    .await;
    common::run_dispatcher(dispatcher, shutdown);
}

/// A store created through the API (credentials sealed, verification queued); returns its id and operation.
async fn create_store(app: &TestApp, who: Principal) -> (String, String) {
    let resp = app.send(Method::POST, "/v1/stores", who, Some(&common::store_body("listings"))).await;
    assert_eq!(resp.status(), StatusCode::ACCEPTED);
    let v: Value = resp.json().await.unwrap();
    (v["store"]["id"].as_str().unwrap().to_owned(), v["operation"]["id"].as_str().unwrap().to_owned())
}

/// A store created through the API and marked `active` directly, for tests about what follows verification (the
/// verification itself goes through the worker in `a_listing_on_a_verified_store_is_published_...`).
async fn active_store(app: &TestApp, who: Principal) -> String {
    let (store, _) = create_store(app, who).await;
    set_store_status(app, who, &store, "active").await;
    store
}

async fn set_store_status(app: &TestApp, who: Principal, store: &str, status: &str) {
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, who.workspace_id).await.unwrap();
    sqlx::query("UPDATE conveyor_shop.stores SET status = $2 WHERE id = $1::uuid")
        .bind(store)
        .bind(status)
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
}

/// A media row of the workspace in `status`, as the media scenario leaves one (`ready` ones with a derivation).
async fn insert_media(app: &TestApp, who: Principal, status: &str) -> Uuid {
    let id = Uuid::now_v7();
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, who.workspace_id).await.unwrap();
    sqlx::query(
        "INSERT INTO conveyor_shop.media (id, workspace_id, filename, content_type, declared_size, object_key, operation_id,
                            created_by)
         VALUES ($1, $2, 'a.png', 'image/png', 1, CASE WHEN $3 THEN NULL ELSE 'objects/a' END,
                 CASE WHEN $3 THEN NULL ELSE gen_random_uuid() END, $2)",
    )
    .bind(id)
    .bind(who.workspace_id.0)
    .bind(status == "awaiting_upload")
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    if status != "awaiting_upload" {
        set_media_status(app, who, id, status).await;
    }
    id
}

/// Moves media `id` to `processing` or `ready` (with a derivation of its own).
async fn set_media_status(app: &TestApp, who: Principal, id: Uuid, status: &str) {
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, who.workspace_id).await.unwrap();
    let derivation = Uuid::now_v7();
    if status == "ready" {
        sqlx::query(
            "INSERT INTO conveyor_shop.media_derivations (id, workspace_id, sha256, content_type, width, height, derivatives)
             VALUES ($1, $2, $3, 'image/png', 1, 1, '[]')",
        )
        .bind(derivation)
        .bind(who.workspace_id.0)
        .bind(format!("{}{}", Uuid::new_v4().simple(), Uuid::new_v4().simple()))
        .execute(&mut *tx)
        .await
        .unwrap();
    }
    sqlx::query(
        "UPDATE conveyor_shop.media SET status = $2, object_key = coalesce(object_key, 'objects/a'),
                          operation_id = coalesce(operation_id, gen_random_uuid()),
                          derivation_id = CASE WHEN $2 = 'ready' THEN $3 END
         WHERE id = $1",
    )
    .bind(id)
    .bind(status)
    .bind(derivation)
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
}

fn listing_body(store: &str, media: &[Uuid]) -> Value {
    json!({
        "store_id": store,
        "title": "Blue mug",
        "description": "A mug, blue.",
        "price": {"amount": "12.50", "currency": "EUR"},
        "media_ids": media,
    })
}

/// Creates a listing (201) and returns its id.
async fn create_listing(app: &TestApp, who: Principal, body: &Value) -> String {
    let resp = app.send(Method::POST, "/v1/listings", who, Some(body)).await;
    assert_eq!(resp.status(), StatusCode::CREATED);
    let v: Value = resp.json().await.unwrap();
    v["listing"]["id"].as_str().unwrap().to_owned()
}

async fn publish(app: &TestApp, who: Principal, listing: &str) -> reqwest::Response {
    app.send(Method::POST, &format!("/v1/listings/{listing}/publish"), who, Some(&json!({}))).await
}

/// Publishes (202) and returns the operation's id.
async fn publish_accepted(app: &TestApp, who: Principal, listing: &str) -> String {
    let resp = publish(app, who, listing).await;
    assert_eq!(resp.status(), StatusCode::ACCEPTED);
    let v: Value = resp.json().await.unwrap();
    v["operation"]["id"].as_str().unwrap().to_owned()
}

async fn get_listing(app: &TestApp, who: Principal, listing: &str) -> Value {
    let resp = app.send(Method::GET, &format!("/v1/listings/{listing}"), who, None).await;
    assert_eq!(resp.status(), StatusCode::OK);
    resp.json().await.unwrap()
}

/// Asserts a problem's status and code, and returns its body.
async fn problem(resp: reqwest::Response, status: u16, code: &str) -> Value {
    assert_eq!(resp.status().as_u16(), status);
    assert_eq!(resp.headers()["content-type"], "application/problem+json");
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["code"], code, "{body}");
    body
}

/// How many operations of `kind` the workspace has.
async fn operations_of(app: &TestApp, who: Principal, kind: &str) -> usize {
    app.db.rows("operations", who.workspace_id).await.iter().filter(|o| o["kind"] == kind).count()
}

#[tokio::test]
async fn a_listing_is_created_as_a_draft_and_invalid_bodies_are_refused() {
    let app = TestApp::spawn().await;
    let who = principal();
    let store = active_store(&app, who).await;
    let media = [insert_media(&app, who, "ready").await, insert_media(&app, who, "awaiting_upload").await];

    let resp = app.send(Method::POST, "/v1/listings", who, Some(&listing_body(&store, &media))).await;
    assert_eq!(resp.status(), StatusCode::CREATED);
    let location = resp.headers()["location"].to_str().unwrap().to_owned();
    let created: Value = resp.json().await.unwrap();
    let listing = &created["listing"];
    let id = listing["id"].as_str().unwrap();
    assert_eq!(location, format!("/v1/listings/{id}"));
    assert_eq!(listing["status"], "draft");
    assert_eq!(listing["store_id"], store.as_str());
    assert_eq!(listing["price"], json!({"amount": "12.50", "currency": "EUR"}));
    assert_eq!(listing["media_ids"], json!(media), "in the order given");
    assert_eq!(listing["marketplace_product_id"], Value::Null);
    assert_eq!(listing["publish_operation_id"], Value::Null);
    assert_eq!(&get_listing(&app, who, id).await, listing);
    let stored = app.db.rows("listings", who.workspace_id).await;
    assert_eq!((stored[0]["price_minor"].as_i64(), stored[0]["currency"].as_str()), (Some(1250), Some("EUR")));

    // Currencies keep their own digits: none for JPY.
    let mut yen = listing_body(&store, &[]);
    yen["price"] = json!({"amount": "1200", "currency": "JPY"});
    let resp = app.send(Method::POST, "/v1/listings", who, Some(&yen)).await;
    assert_eq!(resp.status(), StatusCode::CREATED);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["listing"]["price"], json!({"amount": "1200", "currency": "JPY"}));

    let other_store = active_store(&app, principal()).await;
    let refusals: Vec<(Value, u16, &str)> = vec![
        (
            json!({"store_id": store, "title": "t", "description": "", "price": {"amount": "1", "currency": "EUR"},
                "media_ids": [], "colour": "blue"}),
            422,
            "VALIDATION_FAILED",
        ),
        (
            json!({"store_id": store, "title": "t", "price": {"amount": "1", "currency": "EUR"}}),
            422,
            "VALIDATION_FAILED",
        ),
        (
            json!({"store_id": store, "title": "t", "description": "", "price": {"amount": 1, "currency": "EUR"}}),
            422,
            "VALIDATION_FAILED",
        ),
        (
            json!({"store_id": store, "title": "t", "description": "",
                "price": {"amount": "1", "currency": "EUR", "tax": "0"}}),
            422,
            "VALIDATION_FAILED",
        ),
        (
            json!({"store_id": "not-a-uuid", "title": "t", "description": "", "price": {"amount": "1", "currency": "EUR"}}),
            422,
            "VALIDATION_FAILED",
        ),
        (
            json!({"store_id": store, "title": " ", "description": "", "price": {"amount": "1", "currency": "EUR"}}),
            422,
            "VALIDATION_FAILED",
        ),
        (
            json!({"store_id": store, "title": "x".repeat(201), "description": "",
                "price": {"amount": "1", "currency": "EUR"}}),
            422,
            "VALIDATION_FAILED",
        ),
        (
            json!({"store_id": store, "title": "t", "description": "x".repeat(10_001),
                "price": {"amount": "1", "currency": "EUR"}}),
            422,
            "VALIDATION_FAILED",
        ),
        (
            json!({"store_id": store, "title": "t", "description": "", "price": {"amount": "12.505", "currency": "EUR"}}),
            422,
            "VALIDATION_FAILED",
        ),
        (
            json!({"store_id": store, "title": "t", "description": "", "price": {"amount": "0.00", "currency": "EUR"}}),
            422,
            "VALIDATION_FAILED",
        ),
        (
            json!({"store_id": store, "title": "t", "description": "", "price": {"amount": "-3", "currency": "EUR"}}),
            422,
            "VALIDATION_FAILED",
        ),
        (
            json!({"store_id": store, "title": "t", "description": "", "price": {"amount": "1e3", "currency": "EUR"}}),
            422,
            "VALIDATION_FAILED",
        ),
        (
            json!({"store_id": store, "title": "t", "description": "", "price": {"amount": "12.50", "currency": "JPY"}}),
            422,
            "VALIDATION_FAILED",
        ),
        (
            json!({"store_id": store, "title": "t", "description": "", "price": {"amount": "1", "currency": "eur"}}),
            422,
            "VALIDATION_FAILED",
        ),
        (
            json!({"store_id": store, "title": "t", "description": "", "price": {"amount": "1", "currency": "XYZ"}}),
            422,
            "VALIDATION_FAILED",
        ),
        (
            json!({"store_id": store, "title": "t", "description": "", "price": {"amount": "1", "currency": "EUR"},
                "media_ids": [media[0], media[0]]}),
            422,
            "VALIDATION_FAILED",
        ),
        (
            json!({"store_id": store, "title": "t", "description": "", "price": {"amount": "1", "currency": "EUR"},
                "media_ids": (0..21).map(|_| Uuid::now_v7()).collect::<Vec<_>>()}),
            422,
            "VALIDATION_FAILED",
        ),
        (
            json!({"store_id": Uuid::now_v7(), "title": "t", "description": "",
                "price": {"amount": "1", "currency": "EUR"}}),
            422,
            "STORE_NOT_FOUND",
        ),
        (
            json!({"store_id": other_store, "title": "t", "description": "",
                "price": {"amount": "1", "currency": "EUR"}}),
            422,
            "STORE_NOT_FOUND",
        ),
        (
            json!({"store_id": store, "title": "t", "description": "", "price": {"amount": "1", "currency": "EUR"},
                "media_ids": [media[0], Uuid::now_v7()]}),
            422,
            "MEDIA_NOT_FOUND",
        ),
    ];
    for (body, status, code) in refusals {
        let resp = app.send(Method::POST, "/v1/listings", who, Some(&body)).await;
        assert_eq!(resp.status().as_u16(), status, "{body}");
        let v: Value = resp.json().await.unwrap();
        assert_eq!(v["code"], code, "{body}: {v}");
    }
    let resp = app.send(Method::POST, "/v1/listings", who, Some(&json!(["not", "an", "object"]))).await;
    assert_eq!(resp.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(app.db.count("listings", who.workspace_id).await, 2, "nothing written by a refused request");
    assert_eq!(app.db.count("listing_media", who.workspace_id).await, 2);
}

#[tokio::test]
async fn idempotent_creates_and_publishes_replay_and_a_reused_key_is_refused() {
    let app = TestApp::spawn().await;
    let who = principal();
    let store = active_store(&app, who).await;
    let body = listing_body(&store, &[]);
    let key = Uuid::new_v4().to_string();

    let first = app.send_with_key(Method::POST, "/v1/listings", who, Some(&key), Some(&body)).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    let first: Value = first.json().await.unwrap();
    let again = app.send_with_key(Method::POST, "/v1/listings", who, Some(&key), Some(&body)).await;
    assert_eq!(again.status(), StatusCode::CREATED);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.json::<Value>().await.unwrap(), first, "the original answer");
    assert_eq!(app.db.count("listings", who.workspace_id).await, 1, "one listing");

    let mut changed = body.clone();
    changed["title"] = json!("Red mug");
    let reused = app.send_with_key(Method::POST, "/v1/listings", who, Some(&key), Some(&changed)).await;
    problem(reused, 409, "IDEMPOTENCY_KEY_REUSED").await;
    let missing = app.send_with_key(Method::POST, "/v1/listings", who, None, Some(&body)).await;
    problem(missing, 400, "IDEMPOTENCY_KEY_REQUIRED").await;
    assert_eq!(app.db.count("listings", who.workspace_id).await, 1);

    // A publish replayed under its key answers the same operation; nothing new is queued.
    let id = first["listing"]["id"].as_str().unwrap();
    let path = format!("/v1/listings/{id}/publish");
    let key = Uuid::new_v4().to_string();
    let first = app.send_with_key(Method::POST, &path, who, Some(&key), Some(&json!({}))).await;
    assert_eq!(first.status(), StatusCode::ACCEPTED);
    let location = first.headers()["location"].to_str().unwrap().to_owned();
    let first: Value = first.json().await.unwrap();
    let operation = first["operation"]["id"].as_str().unwrap();
    assert_eq!(location, format!("/v1/operations/{operation}"));
    assert_eq!(first["listing"]["status"], "publishing");
    assert_eq!(first["listing"]["publish_operation_id"], operation);
    assert_eq!(
        (first["operation"]["kind"].as_str(), first["operation"]["status"].as_str()),
        (Some("listing.publish"), Some("queued"))
    );
    let again = app.send_with_key(Method::POST, &path, who, Some(&key), Some(&json!({}))).await;
    assert_eq!(again.status(), StatusCode::ACCEPTED);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.json::<Value>().await.unwrap(), first);
    let unknown = app.send_with_key(Method::POST, &path, who, Some(&key), Some(&json!({"force": true}))).await;
    problem(unknown, 422, "VALIDATION_FAILED").await;
    assert_eq!(operations_of(&app, who, "listing.publish").await, 1);
    let events = app.db.rows("outbox_events", who.workspace_id).await;
    let publications: Vec<&Value> = events.iter().filter(|e| e["event_type"] == "listing.publish").collect();
    assert_eq!(publications.len(), 1);
    assert_eq!(publications[0]["event_payload"], json!({"listing_id": id}), "ids only");
}

#[tokio::test]
async fn a_listing_on_a_verified_store_is_published_with_the_marketplace_product_id() {
    let app = TestApp::spawn().await;
    let (sandbox, market) = common::sandbox(Settings::default()).await;
    let who = principal();
    let (store, verification) = create_store(&app, who).await;
    let listing = create_listing(&app, who, &listing_body(&store, &[])).await;
    let early = publish(&app, who, &listing).await;
    let early = problem(early, 409, "STORE_NOT_ACTIVE").await;
    assert_eq!(early["store_id"], store.as_str());

    // The store becomes active through the real flow: its credentials verified by the worker with the sandbox.
    let shutdown = CancellationToken::new();
    start_dispatcher(&app, &shutdown).await;
    start_worker(&app, &market, &shutdown).await;
    common::operation_reaches(&app, who, &verification, "succeeded", Duration::from_secs(30)).await.expect("verified");

    let operation = publish_accepted(&app, who, &listing).await;
    let done = common::operation_reaches(&app, who, &operation, "succeeded", Duration::from_secs(30)).await;
    let done = done.expect("published");
    let product = sandbox.product(&operation).expect("the sandbox made a product under the operation's id");
    assert_eq!(done["result"], json!({"outcome": "published", "marketplace_product_id": product}));
    let published = get_listing(&app, who, &listing).await;
    assert_eq!(published["status"], "published");
    assert_eq!(published["marketplace_product_id"], product.as_str());
    assert_eq!(published["publish_operation_id"], operation.as_str());
    assert!(published["published_at"].is_string());
    assert_eq!(published["publish_error"], Value::Null);
    let stats = sandbox.stats();
    assert_eq!((stats.products_created, stats.product_calls), (1, 1));

    // Published: a further publish under a new key names the publication, and nothing is queued.
    let again = problem(publish(&app, who, &listing).await, 409, "LISTING_ALREADY_PUBLISHED").await;
    assert_eq!(again["operation_id"], operation.as_str());
    assert_eq!(operations_of(&app, who, "listing.publish").await, 1);
    assert_eq!(sandbox.stats().products_created, 1);
    shutdown.cancel();
}

#[tokio::test]
async fn publishing_needs_an_active_store_and_ready_media_checked_in_the_publishing_transaction() {
    let app = TestApp::spawn().await;
    let who = principal();
    let (store, _) = create_store(&app, who).await;
    let ready = insert_media(&app, who, "ready").await;
    let processing = insert_media(&app, who, "processing").await;
    let uploading = insert_media(&app, who, "awaiting_upload").await;
    let listing = create_listing(&app, who, &listing_body(&store, &[ready, processing, uploading])).await;

    for status in ["pending_verification", "invalid_credentials"] {
        set_store_status(&app, who, &store, status).await;
        let refused = problem(publish(&app, who, &listing).await, 409, "STORE_NOT_ACTIVE").await;
        assert_eq!(refused["store_id"], store.as_str());
    }
    set_store_status(&app, who, &store, "active").await;
    let refused = problem(publish(&app, who, &listing).await, 409, "MEDIA_NOT_READY").await;
    assert_eq!(refused["media_id"], processing.to_string(), "the first media not ready, in the listing's order");
    set_media_status(&app, who, processing, "ready").await;
    let refused = problem(publish(&app, who, &listing).await, 409, "MEDIA_NOT_READY").await;
    assert_eq!(refused["media_id"], uploading.to_string());
    let draft = get_listing(&app, who, &listing).await;
    assert_eq!((draft["status"].as_str(), &draft["publish_operation_id"]), (Some("draft"), &Value::Null));
    assert_eq!(operations_of(&app, who, "listing.publish").await, 0, "a refused publish queues nothing");

    set_media_status(&app, who, uploading, "ready").await;
    let operation = publish_accepted(&app, who, &listing).await;

    // The publish held its rows locked to its commit, and the publication is now on the listing for good: the store's
    // status can change afterwards, but the publication stands and no second one starts.
    set_store_status(&app, who, &store, "pending_verification").await;
    let again = problem(publish(&app, who, &listing).await, 409, "LISTING_ALREADY_PUBLISHED").await;
    assert_eq!(again["operation_id"], operation.as_str());
}

/// Sends a publish in the background, waits until it is blocked on a row lock that `blocker` holds, then commits
/// `blocker`: the publish must see what `blocker` changed.
async fn publish_behind(app: &TestApp, who: Principal, listing: &str, blocker: conveyor_jobs::WorkspaceTx) -> Value {
    let publishing = {
        let (url, token, http) =
            (app.url(&format!("/v1/listings/{listing}/publish")), app.token(who), app.http.clone());
        tokio::spawn(async move {
            let resp = http
                .post(url)
                .bearer_auth(token)
                .header("idempotency-key", Uuid::new_v4().to_string())
                .json(&json!({}))
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), StatusCode::CONFLICT);
            resp.json::<Value>().await.unwrap()
        })
    };
    common::eventually(Duration::from_secs(20), || async {
        let (waiting,): (i64,) = sqlx::query_as(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(&app.db.pool)
        .await
        .unwrap();
        (waiting > 0).then_some(())
    })
    .await
    .expect("the publish waits for the blocker's row lock");
    blocker.commit().await.unwrap();
    publishing.await.unwrap()
}

#[tokio::test]
async fn a_publish_waits_for_a_concurrent_store_or_media_change_and_sees_it() {
    let app = TestApp::spawn().await;
    let who = principal();
    let store = active_store(&app, who).await;
    let media = insert_media(&app, who, "ready").await;
    let listing = create_listing(&app, who, &listing_body(&store, &[media])).await;

    // New credentials are being submitted (the store's row is updated, not yet committed) while the publish checks:
    // the publish's share lock waits for that commit and reads the store's new status, not the one before.
    let mut blocker = conveyor_jobs::begin_workspace(&app.db.pool, who.workspace_id).await.unwrap();
    sqlx::query("UPDATE conveyor_shop.stores SET status = 'pending_verification' WHERE id = $1::uuid")
        .bind(&store)
        .execute(&mut *blocker)
        .await
        .unwrap();
    let refused = publish_behind(&app, who, &listing, blocker).await;
    assert_eq!(refused["code"], "STORE_NOT_ACTIVE");
    set_store_status(&app, who, &store, "active").await;

    // The same for a media going back to processing (a re-upload) while the publish checks.
    let mut blocker = conveyor_jobs::begin_workspace(&app.db.pool, who.workspace_id).await.unwrap();
    sqlx::query("UPDATE conveyor_shop.media SET status = 'processing', derivation_id = NULL WHERE id = $1")
        .bind(media)
        .execute(&mut *blocker)
        .await
        .unwrap();
    let refused = publish_behind(&app, who, &listing, blocker).await;
    assert_eq!(
        (refused["code"].as_str(), refused["media_id"].as_str()),
        (Some("MEDIA_NOT_READY"), Some(&*media.to_string()))
    );
    assert_eq!(operations_of(&app, who, "listing.publish").await, 0, "nothing queued");
}

#[tokio::test]
async fn sixteen_concurrent_publishes_under_different_keys_make_exactly_one_publication() {
    // Once armed, every request waits after claiming its key until all sixteen have: their transactions are open
    // at once when they reach the listing.
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
            v.insert("CONVEYOR_DATABASE_MAX_CONNECTIONS".into(), "24".into());
        },
        Some(hook),
    )
    .await;
    let who = principal();
    let store = active_store(&app, who).await;
    let listing = create_listing(&app, who, &listing_body(&store, &[])).await;

    armed.store(true, std::sync::atomic::Ordering::SeqCst);
    let answers = futures_util::future::join_all((0..16).map(|_| async {
        let resp = publish(&app, who, &listing).await;
        let status = resp.status().as_u16();
        (status, resp.json::<Value>().await.unwrap())
    }))
    .await;
    let accepted: Vec<&Value> = answers.iter().filter(|(s, _)| *s == 202).map(|(_, b)| b).collect();
    assert_eq!(accepted.len(), 1, "exactly one publish accepted: {answers:?}");
    let operation = accepted[0]["operation"]["id"].as_str().unwrap();
    let refused: Vec<&Value> = answers.iter().filter(|(s, _)| *s == 409).map(|(_, b)| b).collect();
    assert_eq!(refused.len(), 15, "{answers:?}");
    for body in refused {
        assert_eq!(body["code"], "LISTING_ALREADY_PUBLISHED");
        assert_eq!(body["operation_id"], operation, "every refusal names the one publication");
    }
    assert_eq!(operations_of(&app, who, "listing.publish").await, 1);
    let events = app.db.rows("outbox_events", who.workspace_id).await;
    assert_eq!(events.iter().filter(|e| e["event_type"] == "listing.publish").count(), 1);
    assert_eq!(get_listing(&app, who, &listing).await["publish_operation_id"], operation);

    // Canceled (publish_failed), the listing may be published again: of sixteen racing publishes, again exactly one.
    let resp = app.send(Method::POST, &format!("/v1/operations/{operation}/cancel"), who, Some(&json!({}))).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(get_listing(&app, who, &listing).await["status"], "publish_failed");
    let answers = futures_util::future::join_all((0..16).map(|_| async {
        let resp = publish(&app, who, &listing).await;
        let status = resp.status().as_u16();
        (status, resp.json::<Value>().await.unwrap())
    }))
    .await;
    let accepted: Vec<&Value> = answers.iter().filter(|(s, _)| *s == 202).map(|(_, b)| b).collect();
    assert_eq!(accepted.len(), 1, "exactly one publish accepted again: {answers:?}");
    let second = accepted[0]["operation"]["id"].as_str().unwrap();
    assert_ne!(second, operation);
    let refused: Vec<&Value> = answers.iter().filter(|(s, _)| *s == 409).map(|(_, b)| b).collect();
    assert_eq!(refused.len(), 15, "{answers:?}");
    assert!(refused.iter().all(|b| b["operation_id"] == second), "every refusal names the new publication");
    assert_eq!(operations_of(&app, who, "listing.publish").await, 2);
    let rows = app.db.rows("listings", who.workspace_id).await;
    assert_eq!(
        (rows[0]["publish_operation_id"].as_str(), rows[0]["publication_key"].as_str()),
        (Some(second), Some(operation)),
        "a new publication, the first one's key"
    );
}

#[tokio::test]
async fn the_database_refuses_a_second_publication_or_product_for_a_listing() {
    let app = TestApp::spawn().await;
    let who = principal();
    let store = active_store(&app, who).await;
    let listing = create_listing(&app, who, &listing_body(&store, &[])).await;
    let operation = publish_accepted(&app, who, &listing).await;
    let update = |statement: &'static str, value: String| {
        let (pool, workspace, listing) = (app.db.pool.clone(), who.workspace_id, listing.clone());
        async move {
            let mut tx = conveyor_jobs::begin_workspace(&pool, workspace).await.unwrap();
            let result =
                sqlx::query(sqlx::AssertSqlSafe(statement)).bind(&listing).bind(&value).execute(&mut *tx).await;
            if result.is_ok() {
                tx.commit().await.unwrap();
            }
            result.is_ok()
        }
    };
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, who.workspace_id).await.unwrap();
    let replacement =
        conveyor_jobs::create_operation_tx(&mut tx, who.workspace_id, who.user_id, "listing.publish", None)
            .await
            .unwrap();
    tx.commit().await.unwrap();
    let replace = "UPDATE conveyor_shop.listings SET publish_operation_id = $2::uuid WHERE id = $1::uuid";
    assert!(!update(replace, replacement.id.to_string()).await, "a queued publication cannot be replaced");
    // Once its operation is canceled (no product recorded), a new publication may replace it; the key stays.
    let resp = app.send(Method::POST, &format!("/v1/operations/{operation}/cancel"), who, Some(&json!({}))).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let rekey = "UPDATE conveyor_shop.listings SET publication_key = $2::uuid WHERE id = $1::uuid";
    assert!(!update(rekey, replacement.id.to_string()).await, "the publication key never changes");
    let clear =
        "UPDATE conveyor_shop.listings SET status = 'draft', publish_operation_id = NULL, publication_key = NULL
                 WHERE id = $1::uuid AND $2 <> ''";
    assert!(!update(clear, "x".into()).await, "a publication is never cleared");
    assert!(update(replace, replacement.id.to_string()).await, "a canceled publication may be replaced");
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, who.workspace_id).await.unwrap();
    sqlx::query(
        "UPDATE conveyor_shop.listings SET status = 'published', marketplace_product_id = 'prod_1', published_at = now()
         WHERE id = $1::uuid",
    )
    .bind(&listing)
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();

    // Whatever code runs: a new operation, a cleared one, or another product are refused by the database.
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, who.workspace_id).await.unwrap();
    let second = conveyor_jobs::create_operation_tx(&mut tx, who.workspace_id, who.user_id, "listing.publish", None)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    for (statement, value) in [
        (
            "UPDATE conveyor_shop.listings SET publish_operation_id = $2::uuid WHERE id = $1::uuid",
            second.id.to_string(),
        ),
        (
            "UPDATE conveyor_shop.listings SET status = 'draft', publish_operation_id = NULL WHERE id = $1::uuid AND $2 <> ''",
            "x".into(),
        ),
        ("UPDATE conveyor_shop.listings SET marketplace_product_id = $2 WHERE id = $1::uuid", "prod_2".into()),
    ] {
        let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, who.workspace_id).await.unwrap();
        let result = sqlx::query(sqlx::AssertSqlSafe(statement)).bind(&listing).bind(&value).execute(&mut *tx).await;
        assert!(result.is_err(), "{statement} was allowed");
    }
    let rows = app.db.rows("listings", who.workspace_id).await;
    assert_eq!(rows[0]["publication_key"], operation.as_str(), "the key of the first publication");
    let listing = get_listing(&app, who, &listing).await;
    assert_eq!(
        (listing["publish_operation_id"].as_str(), listing["marketplace_product_id"].as_str()),
        (Some(&*replacement.id.to_string()), Some("prod_1"))
    );
}

#[tokio::test]
async fn a_refused_product_ends_publish_failed_with_a_redacted_reason_and_the_operation_failed() {
    let app = TestApp::spawn().await;
    let (sandbox, market) = common::sandbox(Settings::default()).await;
    let shutdown = CancellationToken::new();
    start_dispatcher(&app, &shutdown).await;
    start_worker(&app, &market, &shutdown).await;
    let who = principal();
    let store = active_store(&app, who).await;
    let mut body = listing_body(&store, &[]);
    body["title"] = json!("REFUSE this product");
    let listing = create_listing(&app, who, &body).await;
    let operation = publish_accepted(&app, who, &listing).await;

    let failed = common::operation_reaches(&app, who, &operation, "failed", Duration::from_secs(30)).await;
    let failed = failed.expect("the refusal fails the operation at once");
    let error = failed["error"].as_str().unwrap();
    assert!(error.contains("422") && error.contains("PRODUCT_REFUSED"), "{error}");
    let listing_now = get_listing(&app, who, &listing).await;
    assert_eq!(listing_now["status"], "publish_failed");
    assert_eq!(listing_now["publish_error"], error);
    assert_eq!(listing_now["marketplace_product_id"], Value::Null);
    let stats = sandbox.stats();
    assert_eq!((stats.product_calls, stats.products_created), (1, 0), "not retried: a refusal is permanent");

    // A failed publication may be asked for again: a new operation, the same marketplace key; refused again here.
    let second = publish_accepted(&app, who, &listing).await;
    assert_ne!(second, operation);
    common::operation_reaches(&app, who, &second, "failed", Duration::from_secs(30)).await.expect("refused again");
    let listing_now = get_listing(&app, who, &listing).await;
    assert_eq!(
        (listing_now["status"].as_str(), listing_now["publish_operation_id"].as_str()),
        (Some("publish_failed"), Some(second.as_str()))
    );
    let stats = sandbox.stats();
    assert_eq!((stats.product_calls, stats.products_created), (2, 0));
    shutdown.cancel();
}

#[tokio::test]
async fn a_marketplace_that_fails_for_a_while_is_retried_into_one_product() {
    let app = TestApp::spawn().await;
    let (sandbox, market) = common::sandbox(Settings { error_rate: 1.0, ..Settings::default() }).await;
    let shutdown = CancellationToken::new();
    start_dispatcher(&app, &shutdown).await;
    start_worker(&app, &market, &shutdown).await;
    let who = principal();
    let store = active_store(&app, who).await;
    let listing = create_listing(&app, who, &listing_body(&store, &[])).await;
    let operation = publish_accepted(&app, who, &listing).await;

    common::eventually(Duration::from_secs(30), || async { (sandbox.stats().product_calls >= 2).then_some(()) })
        .await
        .expect("a failed call is retried after its back-off");
    assert_eq!(get_listing(&app, who, &listing).await["status"], "publishing", "still publishing while it retries");
    sandbox.set(Settings::default());
    common::operation_reaches(&app, who, &operation, "succeeded", Duration::from_secs(30)).await.expect("published");
    let stats = sandbox.stats();
    assert_eq!(stats.products_created, 1);
    assert!(stats.product_calls >= 3);
    let listing = get_listing(&app, who, &listing).await;
    assert_eq!(listing["marketplace_product_id"].as_str(), sandbox.product(&operation).as_deref());
    shutdown.cancel();
}

#[tokio::test]
async fn a_publication_canceled_mid_call_then_asked_for_again_records_the_same_product() {
    let app = TestApp::spawn().await;
    // The sandbox makes the product at once and answers 3 s later.
    let (sandbox, market) = common::sandbox(Settings { latency_ms: 3000, ..Settings::default() }).await;
    let shutdown = CancellationToken::new();
    start_dispatcher(&app, &shutdown).await;
    start_worker(&app, &market, &shutdown).await;
    let who = principal();
    let store = active_store(&app, who).await;
    let listing = create_listing(&app, who, &listing_body(&store, &[])).await;
    let first = publish_accepted(&app, who, &listing).await;
    common::eventually(Duration::from_secs(30), || async { (sandbox.stats().products_created == 1).then_some(()) })
        .await
        .expect("the marketplace made the product and the job is waiting for its answer");

    let resp = app.send(Method::POST, &format!("/v1/operations/{first}/cancel"), who, Some(&json!({}))).await;
    assert_eq!(resp.status(), StatusCode::OK);
    common::eventually(Duration::from_secs(20), || async {
        let events = app.db.rows("outbox_events", who.workspace_id).await;
        events.iter().any(|e| e["event_type"] == "listing.publish" && e["status"] == "canceled").then_some(())
    })
    .await
    .expect("the job ended canceled");
    // Past the marketplace's answer: the handler stopped waiting and its write rolled back.
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let listing_now = get_listing(&app, who, &listing).await;
    assert_eq!(listing_now["status"], "publish_failed");
    assert_eq!(listing_now["marketplace_product_id"], Value::Null);
    assert!(listing_now["publish_error"].as_str().unwrap().contains("canceled"), "{listing_now}");
    assert_eq!(common::operation(&app, who, &first).await["status"], "canceled");
    let product = sandbox.product(&first).expect("a live product that nothing recorded yet");

    // Published again: a new operation, the listing's first key, so the marketplace answers the product it made.
    let second = publish_accepted(&app, who, &listing).await;
    assert_ne!(second, first);
    let done = common::operation_reaches(&app, who, &second, "succeeded", Duration::from_secs(30)).await;
    let done = done.expect("the second publication succeeded");
    assert_eq!(done["result"], json!({"outcome": "published", "marketplace_product_id": product}));
    let published = get_listing(&app, who, &listing).await;
    assert_eq!(published["status"], "published");
    assert_eq!(published["marketplace_product_id"], product.as_str());
    assert_eq!(published["publish_operation_id"], second.as_str());
    let stats = sandbox.stats();
    assert_eq!((stats.product_calls, stats.products_created), (2, 1), "one product for the listing, ever");
    assert_eq!(sandbox.product(&second), None, "the second publication used the listing's first key");
    // Now published: any further publish is refused and names the publication that made it.
    let again = problem(publish(&app, who, &listing).await, 409, "LISTING_ALREADY_PUBLISHED").await;
    assert_eq!(again["operation_id"], second.as_str());
    shutdown.cancel();
}

#[tokio::test]
async fn a_429_holds_back_only_its_stores_publications_until_its_retry_after_and_spends_no_attempt() {
    let app = TestApp::spawn().await;
    // The next product creation answers 429 with Retry-After: 5 (the kind's first back-off is at most 1 s).
    let settings = Settings { product_rate_limited_calls: 1, product_retry_after_secs: 5, ..Settings::default() };
    let (sandbox, market) = common::sandbox(settings).await;
    let shutdown = CancellationToken::new();
    start_dispatcher(&app, &shutdown).await;
    start_worker(&app, &market, &shutdown).await;
    let who = principal();
    let (limited, other) = (active_store(&app, who).await, active_store(&app, who).await);
    let listing = create_listing(&app, who, &listing_body(&limited, &[])).await;
    let operation = publish_accepted(&app, who, &listing).await;

    let wait = common::eventually(Duration::from_secs(30), || async {
        let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, who.workspace_id).await.unwrap();
        let row: Option<(Option<String>, f64, i32)> = sqlx::query_as(
            "SELECT last_error, extract(epoch FROM next_attempt_at - now())::float8, job_attempts FROM conveyor.outbox_events
             WHERE event_type = 'listing.publish' AND last_error IS NOT NULL",
        )
        .fetch_optional(&mut *tx)
        .await
        .unwrap();
        tx.commit().await.unwrap();
        row.filter(|(error, _, _)| error.as_deref().is_some_and(|e| e.contains("429"))).map(|(_, w, a)| (w, a))
    })
    .await
    .expect("the 429 was recorded");
    assert!(wait.0 > 2.5, "the retry waits for the marketplace's Retry-After, not the 1 s back-off: {} s", wait.0);
    assert_eq!(wait.1, 0, "a rate limit spends no attempt");
    let keys = conveyor_jobs::list_key_limits(&app.db.pool, who.workspace_id).await.unwrap();
    let blocked = format!("store:{limited}");
    assert!(keys.iter().any(|k| k.key == blocked && k.blocked_until.is_some()), "{keys:?}");

    // Another store's publication goes on meanwhile, and ends before the limited store may call again.
    let other_listing = create_listing(&app, who, &listing_body(&other, &[])).await;
    let other_operation = publish_accepted(&app, who, &other_listing).await;
    common::operation_reaches(&app, who, &other_operation, "succeeded", Duration::from_secs(30)).await.expect("other");
    assert_ne!(common::operation(&app, who, &operation).await["status"], "succeeded", "still held back");

    common::operation_reaches(&app, who, &operation, "succeeded", Duration::from_secs(30)).await.expect("published");
    let stats = sandbox.stats();
    assert_eq!((stats.product_calls, stats.products_created), (3, 2), "one refused call, one product per listing");
    shutdown.cancel();
}

#[tokio::test]
async fn a_stores_limit_holds_its_publications_to_that_many_simultaneous_marketplace_calls() {
    let app = TestApp::spawn().await;
    let (sandbox, market) = common::sandbox(Settings { latency_ms: 300, ..Settings::default() }).await;
    let who = principal();
    let store = active_store(&app, who).await;
    let key = format!("store:{store}");
    let limit = conveyor_jobs::KeyLimit { max_in_flight: Some(2), ..conveyor_jobs::KeyLimit::default() };
    conveyor_jobs::set_key_limit(&app.db.pool, who.workspace_id, &key, limit).await.unwrap();
    let mut operations = Vec::new();
    for _ in 0..8 {
        let listing = create_listing(&app, who, &listing_body(&store, &[])).await;
        operations.push(publish_accepted(&app, who, &listing).await);
    }
    let shutdown = CancellationToken::new();
    start_dispatcher(&app, &shutdown).await;
    start_worker(&app, &market, &shutdown).await;
    for operation in &operations {
        common::operation_reaches(&app, who, operation, "succeeded", Duration::from_secs(60)).await.expect("published");
    }
    let stats = sandbox.stats();
    assert_eq!(stats.products_created, 8);
    // The marketplace's own view: never more than the store's limit of calls at once (8 worker slots were free).
    assert!(stats.product_calls_max_concurrent <= 2, "{} calls at once", stats.product_calls_max_concurrent);
    assert_eq!(stats.product_calls_in_flight, 0);
    shutdown.cancel();
}

#[tokio::test]
async fn a_worker_killed_while_the_marketplace_call_is_in_flight_still_makes_one_product() {
    let app = TestApp::spawn().await;
    // The sandbox makes the product at once and answers 4 s later: the worker dies with the product made.
    let (sandbox, market) = common::sandbox(Settings { latency_ms: 4000, ..Settings::default() }).await;
    let shutdown = CancellationToken::new();
    start_dispatcher(&app, &shutdown).await;
    let who = principal();
    let store = active_store(&app, who).await;
    let listing = create_listing(&app, who, &listing_body(&store, &[])).await;
    let operation = publish_accepted(&app, who, &listing).await;

    let mut victim = Process::spawn(&["worker"], &process_vars(&app, &market));
    let made =
        common::eventually(Duration::from_secs(30), || async { (sandbox.stats().products_created == 1).then_some(()) })
            .await;
    assert!(made.is_some(), "the worker called the marketplace; log:\n{}", victim.log());
    victim.kill();
    assert_eq!(get_listing(&app, who, &listing).await["status"], "publishing", "nothing recorded yet");

    // Another worker takes the entry over after the visibility time-out and calls again with the same key.
    sandbox.set(Settings::default());
    let rescuer = Process::spawn(&["worker"], &process_vars(&app, &market));
    let done = common::operation_reaches(&app, who, &operation, "succeeded", Duration::from_secs(40)).await;
    assert!(done.is_some(), "the job ran again and completed; log:\n{}", rescuer.log());
    let stats = sandbox.stats();
    assert_eq!(stats.product_calls, 2, "the marketplace was called again");
    assert_eq!(stats.products_created, 1, "one product: the repeat carried the same idempotency key");
    let published = get_listing(&app, who, &listing).await;
    assert_eq!(published["status"], "published");
    assert_eq!(published["marketplace_product_id"].as_str(), sandbox.product(&operation).as_deref());
    shutdown.cancel();
}

#[tokio::test]
async fn a_dispatcher_killed_after_its_xadd_and_before_marking_still_makes_one_product() {
    let app = TestApp::spawn().await;
    let redis = common::redis_url();
    let (sandbox, market) = common::sandbox(Settings::default()).await;
    let who = principal();
    let store = active_store(&app, who).await;
    let listing = create_listing(&app, who, &listing_body(&store, &[])).await;
    let operation = publish_accepted(&app, who, &listing).await;

    let mut vars = process_vars(&app, &market);
    vars.insert("CONVEYOR_DISPATCH_LEASE".into(), "1s".into());
    let mut crashing = vars.clone();
    crashing.insert("FAILPOINTS".into(), "dispatcher::after_xadd=sleep(60000)".into());
    let mut first = Process::spawn(&["dispatcher"], &crashing);
    let client = common::redis_client(&redis).await;
    let stream = RedisKeys::new(&app.redis_prefix).stream("listings");
    let added = common::eventually(Duration::from_secs(20), || async {
        (common::stream_event_ids(&client, &stream).await.len() == 1).then_some(())
    })
    .await;
    assert!(added.is_some(), "the first dispatcher XADDed; log:\n{}", first.log());
    first.kill();
    let event = app.db.rows("outbox_events", who.workspace_id).await;
    let event = event.iter().find(|e| e["event_type"] == "listing.publish").unwrap().clone();
    assert_eq!(event["status"], "dispatching", "handed off but never marked");

    // Another dispatcher takes the lease over and hands the event off again: the de-dup key keeps one entry.
    let second = Process::spawn(&["dispatcher"], &vars);
    let relayed = common::eventually(Duration::from_secs(20), || async {
        let events = app.db.rows("outbox_events", who.workspace_id).await;
        events.iter().any(|e| e["id"] == event["id"] && e["status"] == "dispatched").then_some(())
    })
    .await;
    assert!(relayed.is_some(), "the second dispatcher finished the hand-off; log:\n{}", second.log());
    assert_eq!(common::stream_event_ids(&client, &stream).await.len(), 1, "one stream entry");

    // And the entry delivered twice, as at-least-once delivery may: still one product.
    {
        use fred::prelude::StreamsInterface;
        let entries: Vec<(String, HashMap<String, String>)> = client.xrange(&stream, "-", "+", None).await.unwrap();
        let fields: Vec<(String, String)> = entries[0].1.clone().into_iter().collect();
        let _: String = client.xadd(&stream, false, None, "*", fields).await.unwrap();
    }
    let shutdown = CancellationToken::new();
    start_worker(&app, &market, &shutdown).await;
    start_worker(&app, &market, &shutdown).await;
    common::operation_reaches(&app, who, &operation, "succeeded", Duration::from_secs(30)).await.expect("published");
    common::eventually(Duration::from_secs(20), || async {
        common::stream_event_ids(&client, &stream).await.is_empty().then_some(())
    })
    .await
    .expect("both deliveries consumed");
    assert_eq!(sandbox.stats().products_created, 1);
    let published = get_listing(&app, who, &listing).await;
    assert_eq!(published["status"], "published");
    assert_eq!(published["marketplace_product_id"].as_str(), sandbox.product(&operation).as_deref());
    shutdown.cancel();
}

#[tokio::test]
async fn another_workspace_gets_404_on_every_listing_route_and_sees_no_row() {
    let app = TestApp::spawn().await;
    let (owner, stranger) = (principal(), principal());
    let store = active_store(&app, owner).await;
    let listing = create_listing(&app, owner, &listing_body(&store, &[])).await;

    let get = app.send(Method::GET, &format!("/v1/listings/{listing}"), stranger, None).await;
    problem(get, 404, "NOT_FOUND").await;
    problem(publish(&app, stranger, &listing).await, 404, "NOT_FOUND").await;
    let create = app.send(Method::POST, "/v1/listings", stranger, Some(&listing_body(&store, &[]))).await;
    problem(create, 422, "STORE_NOT_FOUND").await;
    let malformed = app.send(Method::GET, "/v1/listings/not-a-uuid", owner, None).await;
    problem(malformed, 404, "NOT_FOUND").await;
    let unknown = app.send(Method::GET, &format!("/v1/listings/{}", Uuid::now_v7()), owner, None).await;
    problem(unknown, 404, "NOT_FOUND").await;
    let anonymous = app.http.get(app.url(&format!("/v1/listings/{listing}"))).send().await.unwrap();
    problem(anonymous, 401, "UNAUTHENTICATED").await;
    assert_eq!(get_listing(&app, owner, &listing).await["status"], "draft", "untouched by the stranger");

    // Row-level security: the tables are forced, and a session without the workspace sees nothing.
    let mut owner_conn = app.db.owner().await;
    let forced: Vec<(String, bool, bool)> = sqlx::query_as(
        "SELECT relname::text, relrowsecurity, relforcerowsecurity FROM pg_class
         WHERE relname IN ('listings', 'listing_media') ORDER BY relname",
    )
    .fetch_all(&mut owner_conn)
    .await
    .unwrap();
    assert_eq!(forced, [("listing_media".into(), true, true), ("listings".into(), true, true)]);
    let mut conn = app.db.app_connection().await;
    let (seen,): (i64,) =
        sqlx::query_as("SELECT count(*) FROM conveyor_shop.listings").fetch_one(&mut conn).await.unwrap();
    assert_eq!(seen, 0);
    assert_eq!(app.db.count("listings", stranger.workspace_id).await, 0);
    assert_eq!(app.db.count("listings", owner.workspace_id).await, 1);
}
