//! Idempotent write requests (seed section 2, CONTRACT.md §2.1) against real PostgreSQL.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::{TestApp, principal, store_body};

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use tokio::sync::Notify;
use uuid::Uuid;

const TABLES: [&str; 4] = ["stores", "operations", "outbox_events", "idempotency_requests"];

async fn counts(app: &TestApp, who: conveyor_server::auth::Principal) -> Vec<i64> {
    let mut out = Vec::new();
    for table in TABLES {
        out.push(app.db.count(table, who.workspace_id).await);
    }
    out
}

#[tokio::test]
async fn replaying_a_key_returns_the_original_response_and_creates_nothing() {
    let app = TestApp::spawn().await;
    let who = principal();
    let key = Uuid::new_v4().to_string();
    let first = app.send_with_key(Method::POST, "/v1/stores", who, Some(&key), Some(&store_body("r"))).await;
    assert_eq!(first.status(), StatusCode::ACCEPTED);
    assert!(first.headers().get("idempotent-replayed").is_none());
    let location = first.headers()["location"].clone();
    let first_body: Value = first.json().await.unwrap();

    // The same request again, with the key quoted as a structured-field string this time.
    let quoted = format!("\"{key}\"");
    let again = app.send_with_key(Method::POST, "/v1/stores", who, Some(&quoted), Some(&store_body("r"))).await;
    assert_eq!(again.status(), StatusCode::ACCEPTED);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.headers()["location"], location);
    assert_eq!(again.headers()["content-type"], "application/json");
    assert_eq!(again.json::<Value>().await.unwrap(), first_body);
    assert_eq!(counts(&app, who).await, vec![1, 1, 1, 1]);

    let metrics = app.metrics().await;
    assert!(metrics.contains(r#"conveyor_idempotency_requests_total{outcome="executed"} 1"#), "{metrics}");
    assert!(metrics.contains(r#"conveyor_idempotency_requests_total{outcome="replayed"} 1"#), "{metrics}");
}

#[tokio::test]
async fn the_same_key_with_another_body_is_refused_as_reused() {
    let app = TestApp::spawn().await;
    let who = principal();
    let key = Uuid::new_v4().to_string();
    let first = app.send_with_key(Method::POST, "/v1/stores", who, Some(&key), Some(&store_body("a"))).await;
    assert_eq!(first.status(), StatusCode::ACCEPTED);
    let other = app.send_with_key(Method::POST, "/v1/stores", who, Some(&key), Some(&store_body("b"))).await;
    assert_eq!(other.status(), StatusCode::CONFLICT);
    assert_eq!(other.json::<Value>().await.unwrap()["code"], "IDEMPOTENCY_KEY_REUSED");
    assert_eq!(counts(&app, who).await, vec![1, 1, 1, 1]);
    assert!(app.metrics().await.contains(r#"conveyor_idempotency_requests_total{outcome="key_reused"} 1"#));
}

#[tokio::test]
async fn key_order_and_white_space_do_not_make_a_different_request() {
    let app = TestApp::spawn().await;
    let who = principal();
    let key = Uuid::new_v4().to_string();
    let compact = r#"{"name":"Shop","platform":"sandbox","credentials":{"api_key":"k","api_secret":"s"}}"#;
    let spaced = "{ \"credentials\": { \"api_secret\": \"s\", \"api_key\": \"k\" },\n  \"platform\": \"sandbox\", \"name\": \"Shop\" }";
    let mut statuses = Vec::new();
    for raw in [compact, spaced] {
        let resp = app
            .http
            .post(app.url("/v1/stores"))
            .bearer_auth(app.token(who))
            .header("idempotency-key", &key)
            .header("content-type", "application/json")
            .body(raw)
            .send()
            .await
            .unwrap();
        statuses.push((resp.status(), resp.headers().get("idempotent-replayed").is_some()));
    }
    assert_eq!(statuses, vec![(StatusCode::ACCEPTED, false), (StatusCode::ACCEPTED, true)]);
    assert_eq!(app.db.count("stores", who.workspace_id).await, 1);
}

#[tokio::test]
async fn a_missing_or_malformed_key_is_refused_and_writes_nothing() {
    let app = TestApp::spawn().await;
    let who = principal();
    let missing = app.send_with_key(Method::POST, "/v1/stores", who, None, Some(&store_body("k"))).await;
    assert_eq!(missing.status(), StatusCode::BAD_REQUEST);
    assert_eq!(missing.json::<Value>().await.unwrap()["code"], "IDEMPOTENCY_KEY_REQUIRED");
    for bad in ["not-a-uuid", "12345", "\"unterminated", "{8f421c70-2f6e-4c1a-9a39-5b0f3f0f7d11}"] {
        let resp = app.send_with_key(Method::POST, "/v1/stores", who, Some(bad), Some(&store_body("k"))).await;
        assert_eq!(resp.status(), StatusCode::BAD_REQUEST, "{bad}");
        assert_eq!(resp.json::<Value>().await.unwrap()["code"], "IDEMPOTENCY_KEY_INVALID", "{bad}");
    }
    assert_eq!(counts(&app, who).await, vec![0, 0, 0, 0]);
    assert!(app.metrics().await.contains(r#"conveyor_idempotency_requests_total{outcome="rejected"} 5"#));
}

/// A hook that holds the first claimed transaction open until released, and says when it got there.
fn holding_hook() -> (conveyor_server::http::idempotent::ClaimHook, Arc<Notify>, Arc<Notify>) {
    let (entered, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let first = Arc::new(AtomicBool::new(true));
    let (e, r) = (entered.clone(), release.clone());
    let hook: conveyor_server::http::idempotent::ClaimHook = Arc::new(move || {
        let (e, r, first) = (e.clone(), r.clone(), first.clone());
        Box::pin(async move {
            if first.swap(false, Ordering::SeqCst) {
                e.notify_one();
                r.notified().await;
            }
        })
    });
    (hook, entered, release)
}

#[tokio::test]
async fn duplicates_answer_in_progress_at_once_while_the_first_transaction_is_open() {
    let (hook, entered, release) = holding_hook();
    let app = Arc::new(TestApp::spawn_with_hook(|_| {}, Some(hook)).await);
    let who = principal();
    let key = Uuid::new_v4().to_string();
    let first = {
        let (app, key) = (app.clone(), key.clone());
        tokio::spawn(async move {
            app.send_with_key(Method::POST, "/v1/stores", who, Some(&key), Some(&store_body("c"))).await
        })
    };
    entered.notified().await;
    // The first request's transaction is open (held in the hook): 16 duplicates must answer now, not wait.
    let duplicates: Vec<_> = (0..16)
        .map(|_| {
            let (app, key) = (app.clone(), key.clone());
            tokio::spawn(async move {
                let resp = app.send_with_key(Method::POST, "/v1/stores", who, Some(&key), Some(&store_body("c"))).await;
                let retry_after = resp.headers().get("retry-after").map(|v| v.to_str().unwrap().to_owned());
                (resp.status(), retry_after, resp.json::<Value>().await.unwrap()["code"].clone())
            })
        })
        .collect();
    for duplicate in duplicates {
        let (status, retry_after, code) = tokio::time::timeout(Duration::from_secs(10), duplicate)
            .await
            .expect("a duplicate answers while the first transaction is still open")
            .unwrap();
        assert_eq!((status, code.as_str().unwrap()), (StatusCode::CONFLICT, "IDEMPOTENCY_REQUEST_IN_PROGRESS"));
        assert!(retry_after.is_some());
    }
    assert!(!first.is_finished(), "the first request is still held open");
    assert_eq!(app.db.count("stores", who.workspace_id).await, 0, "nothing is committed yet");
    release.notify_one();
    assert_eq!(first.await.unwrap().status(), StatusCode::ACCEPTED);
    let after = app.send_with_key(Method::POST, "/v1/stores", who, Some(&key), Some(&store_body("c"))).await;
    assert_eq!(after.headers()["idempotent-replayed"], "true");
    assert_eq!(counts(&app, who).await, vec![1, 1, 1, 1]);
}

#[tokio::test]
async fn of_many_concurrent_identical_requests_exactly_one_executes() {
    let app = Arc::new(TestApp::spawn().await);
    let who = principal();
    let key = Uuid::new_v4().to_string();
    let requests: Vec<_> = (0..24)
        .map(|_| {
            let (app, key) = (app.clone(), key.clone());
            tokio::spawn(async move {
                let resp = app.send_with_key(Method::POST, "/v1/stores", who, Some(&key), Some(&store_body("m"))).await;
                let replayed = resp.headers().get("idempotent-replayed").is_some();
                (resp.status(), replayed)
            })
        })
        .collect();
    let mut executed = 0;
    for request in requests {
        match request.await.unwrap() {
            (StatusCode::ACCEPTED, false) => executed += 1,
            (StatusCode::ACCEPTED, true) | (StatusCode::CONFLICT, false) => {}
            other => panic!("unexpected answer {other:?}"),
        }
    }
    assert_eq!(executed, 1);
    assert_eq!(counts(&app, who).await, vec![1, 1, 1, 1]);
}

#[tokio::test]
async fn a_failed_transaction_leaves_no_record_and_the_retry_executes() {
    let app = TestApp::spawn().await;
    let who = principal();
    let key = Uuid::new_v4().to_string();
    let mut owner = app.db.owner().await;
    sqlx::query("ALTER TABLE conveyor.outbox_events ADD CONSTRAINT test_reject_all CHECK (false) NOT VALID")
        .execute(&mut owner)
        .await
        .unwrap();
    let failed = app.send_with_key(Method::POST, "/v1/stores", who, Some(&key), Some(&store_body("f"))).await;
    assert_eq!(failed.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(counts(&app, who).await, vec![0, 0, 0, 0]);
    sqlx::query("ALTER TABLE conveyor.outbox_events DROP CONSTRAINT test_reject_all")
        .execute(&mut owner)
        .await
        .unwrap();
    let retry = app.send_with_key(Method::POST, "/v1/stores", who, Some(&key), Some(&store_body("f"))).await;
    assert_eq!(retry.status(), StatusCode::ACCEPTED);
    assert!(retry.headers().get("idempotent-replayed").is_none(), "the retry executed afresh");
    assert_eq!(counts(&app, who).await, vec![1, 1, 1, 1]);
}

#[tokio::test]
async fn the_same_key_from_another_user_workspace_method_or_path_is_another_request() {
    let app = TestApp::spawn().await;
    let alice = principal();
    let key = Uuid::new_v4().to_string();
    let created = app.send_with_key(Method::POST, "/v1/stores", alice, Some(&key), Some(&store_body("s"))).await;
    assert_eq!(created.status(), StatusCode::ACCEPTED);
    let store_id = created.json::<Value>().await.unwrap()["store"]["id"].as_str().unwrap().to_owned();

    let colleague = conveyor_server::auth::Principal { user_id: principal().user_id, ..alice };
    let resp = app.send_with_key(Method::POST, "/v1/stores", colleague, Some(&key), Some(&store_body("s"))).await;
    assert_eq!(resp.status(), StatusCode::ACCEPTED);
    assert!(resp.headers().get("idempotent-replayed").is_none(), "another user");
    let stranger = principal();
    let resp = app.send_with_key(Method::POST, "/v1/stores", stranger, Some(&key), Some(&store_body("s"))).await;
    assert!(resp.headers().get("idempotent-replayed").is_none(), "another workspace");
    assert_eq!(resp.status(), StatusCode::ACCEPTED);
    let path = format!("/v1/stores/{store_id}/authorization");
    let resp =
        app.send_with_key(Method::PUT, &path, alice, Some(&key), Some(&json!({"credentials": {"k": "v"}}))).await;
    assert_eq!(resp.status(), StatusCode::ACCEPTED, "another method and path");
    assert!(resp.headers().get("idempotent-replayed").is_none());
    assert_eq!(app.db.count("stores", alice.workspace_id).await, 2);
    assert_eq!(app.db.count("idempotency_requests", alice.workspace_id).await, 3);
    assert_eq!(app.db.count("stores", stranger.workspace_id).await, 1);
}

#[tokio::test]
async fn after_a_key_rotation_old_records_still_replay_and_still_detect_mismatches() {
    let app = TestApp::spawn().await;
    let who = principal();
    let key = Uuid::new_v4().to_string();
    let first = app.send_with_key(Method::POST, "/v1/stores", who, Some(&key), Some(&store_body("rot"))).await;
    assert_eq!(first.status(), StatusCode::ACCEPTED);
    let rotated = app
        .spawn_sharing(|vars| {
            let old = vars["CONVEYOR_IDEMPOTENCY_KEYS"].clone();
            vars.insert(
                "CONVEYOR_IDEMPOTENCY_KEYS".into(),
                format!("t2:a-brand-new-fingerprint-key-0123456789ab,{old}"),
            );
        })
        .await;
    let replay = rotated.send_with_key(Method::POST, "/v1/stores", who, Some(&key), Some(&store_body("rot"))).await;
    assert_eq!(replay.status(), StatusCode::ACCEPTED);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    let mismatch = rotated.send_with_key(Method::POST, "/v1/stores", who, Some(&key), Some(&store_body("other"))).await;
    assert_eq!(mismatch.json::<Value>().await.unwrap()["code"], "IDEMPOTENCY_KEY_REUSED");
    // New records are signed with the new key.
    let fresh = rotated.send(Method::POST, "/v1/stores", who, Some(&store_body("new"))).await;
    assert_eq!(fresh.status(), StatusCode::ACCEPTED);
    let mut key_ids: Vec<String> = rotated
        .db
        .rows("idempotency_requests", who.workspace_id)
        .await
        .iter()
        .map(|r| r["fingerprint_key_id"].as_str().unwrap().to_owned())
        .collect();
    key_ids.sort();
    assert_eq!(key_ids, vec!["t1", "t2"]);
}

#[tokio::test]
async fn no_record_holds_the_request_body_or_a_credential() {
    let app = TestApp::spawn().await;
    let who = principal();
    let marker = format!("M{}", Uuid::new_v4().simple());
    let resp = app.send(Method::POST, "/v1/stores", who, Some(&store_body(&marker))).await;
    assert_eq!(resp.status(), StatusCode::ACCEPTED);
    let records = app.db.rows("idempotency_requests", who.workspace_id).await;
    assert_eq!(records.len(), 1);
    let text = records[0].to_string();
    assert!(!text.contains(&marker), "{text}");
    assert_eq!(records[0]["status"], "completed");
    assert_eq!(records[0]["response_status"], 202);
    let fingerprint = records[0]["request_fingerprint"].as_str().unwrap();
    assert_eq!(fingerprint.len(), 2 + 64, "a 32-byte HMAC, not the body: {fingerprint}");
}

async fn age_records(app: &TestApp, who: conveyor_server::auth::Principal, created_hours_ago: f64, expired: bool) {
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, who.workspace_id).await.unwrap();
    sqlx::query(
        "UPDATE conveyor_server.idempotency_requests
         SET created_at = now() - make_interval(secs => $1 * 3600),
             expires_at = CASE WHEN $2 THEN now() - interval '1 second' ELSE expires_at END",
    )
    .bind(created_hours_ago)
    .bind(expired)
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
}

#[tokio::test]
async fn an_expired_record_is_treated_as_absent() {
    let app = TestApp::spawn().await;
    let who = principal();
    let key = Uuid::new_v4().to_string();
    let first = app.send_with_key(Method::POST, "/v1/stores", who, Some(&key), Some(&store_body("e1"))).await;
    assert_eq!(first.status(), StatusCode::ACCEPTED);
    age_records(&app, who, 49.0, true).await;
    // Forty-nine hours on, no process holds a copy of the record (a copy lives ten minutes at most): a process that
    // never saw it stands for that.
    let later = app.spawn_sharing(|_| {}).await;
    let reused = later.send_with_key(Method::POST, "/v1/stores", who, Some(&key), Some(&store_body("e2"))).await;
    assert_eq!(reused.status(), StatusCode::ACCEPTED, "an expired key is free again");
    assert!(reused.headers().get("idempotent-replayed").is_none());
    assert_eq!(app.db.count("stores", who.workspace_id).await, 2);
    assert_eq!(app.db.count("idempotency_requests", who.workspace_id).await, 1);
}

#[tokio::test]
async fn cleanup_deletes_expired_records_in_batches_and_never_one_under_a_day_old() {
    let app = TestApp::spawn().await;
    let (old, young, live) = (principal(), principal(), principal());
    for _ in 0..5 {
        assert_eq!(app.send(Method::POST, "/v1/stores", old, Some(&store_body("o"))).await.status(), 202);
    }
    for _ in 0..2 {
        assert_eq!(app.send(Method::POST, "/v1/stores", young, Some(&store_body("y"))).await.status(), 202);
    }
    assert_eq!(app.send(Method::POST, "/v1/stores", live, Some(&store_body("l"))).await.status(), 202);
    age_records(&app, old, 49.0, true).await;
    // Expired by its own column yet only 23 hours old: kept, whatever the setting said.
    age_records(&app, young, 23.0, true).await;

    let first = conveyor_server::idempotency::cleanup::purge_expired(&app.db.runtime_pool, 2, 1).await.unwrap();
    assert_eq!(first, 2, "one bounded batch");
    let rest = conveyor_server::idempotency::cleanup::purge_expired(&app.db.runtime_pool, 2, 100).await.unwrap();
    assert_eq!(rest, 3);
    assert_eq!(app.db.count("idempotency_requests", old.workspace_id).await, 0);
    assert_eq!(app.db.count("idempotency_requests", young.workspace_id).await, 2);
    assert_eq!(app.db.count("idempotency_requests", live.workspace_id).await, 1);
    assert_eq!(app.db.count("stores", old.workspace_id).await, 5, "business rows are untouched");
}

#[tokio::test]
async fn the_maintenance_process_purges_expired_records_and_counts_them() {
    let app = TestApp::spawn().await;
    let who = principal();
    assert_eq!(app.send(Method::POST, "/v1/stores", who, Some(&store_body("p"))).await.status(), 202);
    age_records(&app, who, 30.0, true).await;
    let mut vars = common::config_vars(&app.db, &app.redis_prefix);
    let admin_port = common::free_port();
    vars.insert("CONVEYOR_ADMIN_ADDR".into(), format!("127.0.0.1:{admin_port}"));
    let process = common::Process::spawn(&["maintenance"], &vars);
    let purged = common::eventually(Duration::from_secs(20), || async {
        (app.db.count("idempotency_requests", who.workspace_id).await == 0).then_some(())
    })
    .await;
    assert!(purged.is_some(), "maintenance purged the record; log:\n{}", process.log());
    // The pass counts what it deleted once it has finished (after the commit the count above saw): wait for it.
    let scrape = || async {
        app.http.get(format!("http://127.0.0.1:{admin_port}/metrics")).send().await.unwrap().text().await.unwrap()
    };
    let counted = common::eventually(Duration::from_secs(10), || async {
        scrape().await.contains("conveyor_idempotency_records_purged_total 1").then_some(())
    })
    .await;
    assert!(counted.is_some(), "{}", scrape().await);
}

/// `name`'s value in a metrics text.
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("{name} is not in the metrics"))
}

#[tokio::test]
async fn a_replay_of_a_record_this_process_completed_is_answered_from_memory_even_while_postgresql_is_down() {
    let mut pg = common::postgres::TestPostgres::start().await;
    let app = TestApp::spawn_on_db(pg.test_db().await, |_| {}).await;
    let who = principal();
    let key = Uuid::new_v4().to_string();
    let body = store_body("m1");
    let first = app.send_with_key(Method::POST, "/v1/stores", who, Some(&key), Some(&body)).await;
    assert_eq!(first.status(), StatusCode::ACCEPTED);
    let location = first.headers()["location"].clone();
    let first: Value = first.json().await.unwrap();

    pg.stop_fast().await;
    let replay = app.send_with_key(Method::POST, "/v1/stores", who, Some(&key), Some(&body)).await;
    assert_eq!(replay.status(), StatusCode::ACCEPTED, "{}", replay.text().await.unwrap());
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(replay.headers()["location"], location);
    assert_eq!(replay.json::<Value>().await.unwrap(), first);
    let reused = app.send_with_key(Method::POST, "/v1/stores", who, Some(&key), Some(&store_body("m2"))).await;
    assert_eq!(reused.status(), StatusCode::CONFLICT, "another request under the key is refused from the copy too");
    assert!(reused.text().await.unwrap().contains("IDEMPOTENCY_KEY_REUSED"));
    let other = principal();
    let theirs = app.send_with_key(Method::POST, "/v1/stores", other, Some(&key), Some(&body)).await;
    assert_eq!(theirs.status(), StatusCode::SERVICE_UNAVAILABLE, "another caller's key is theirs: PostgreSQL decides");
    let fresh = app.send(Method::POST, "/v1/stores", who, Some(&body)).await;
    assert_eq!(fresh.status(), StatusCode::SERVICE_UNAVAILABLE, "a first use needs PostgreSQL");
    let metrics = app.metrics().await;
    assert_eq!(metric(&metrics, "conveyor_idempotency_replays_from_memory_total"), 1.0);
    assert!(metric(&metrics, "conveyor_idempotency_replay_cache_bytes") > 0.0);

    pg.start_again().await;
    assert_eq!(app.db.count("stores", who.workspace_id).await, 1, "the replays created nothing");
    assert_eq!(app.db.count("stores", other.workspace_id).await, 0);
}

#[tokio::test]
async fn another_process_replays_from_the_record_then_keeps_a_copy_that_ends_with_the_record() {
    let app = TestApp::spawn().await;
    let who = principal();
    let key = Uuid::new_v4().to_string();
    let body = store_body("c1");
    let first = app.send_with_key(Method::POST, "/v1/stores", who, Some(&key), Some(&body)).await;
    assert_eq!(first.status(), StatusCode::ACCEPTED);
    let first: Value = first.json().await.unwrap();

    // Another replica holds no copy: its first replay reads the record, its second answers from the copy it made.
    let replica = app.spawn_sharing(|_| {}).await;
    for _ in 0..2 {
        let replay = replica.send_with_key(Method::POST, "/v1/stores", who, Some(&key), Some(&body)).await;
        assert_eq!(replay.headers()["idempotent-replayed"], "true");
        assert_eq!(replay.json::<Value>().await.unwrap(), first);
    }
    let metrics = replica.metrics().await;
    assert_eq!(metric(&metrics, "conveyor_idempotency_requests_total{outcome=\"replayed\"}"), 2.0);
    assert_eq!(metric(&metrics, "conveyor_idempotency_replays_from_memory_total"), 1.0);

    // A record read three seconds before it expires is kept no longer: once it expired, the key is free again in the
    // process that read it, where a copy that outlived it would refuse another request as a reuse.
    let late = app.spawn_sharing(|_| {}).await;
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, who.workspace_id).await.unwrap();
    sqlx::query("UPDATE conveyor_server.idempotency_requests SET expires_at = now() + interval '3 seconds'")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let replay = late.send_with_key(Method::POST, "/v1/stores", who, Some(&key), Some(&body)).await;
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let again = late.send_with_key(Method::POST, "/v1/stores", who, Some(&key), Some(&store_body("c2"))).await;
    assert_eq!(again.status(), StatusCode::ACCEPTED, "{}", again.text().await.unwrap());
    assert!(again.headers().get("idempotent-replayed").is_none(), "the expired key ran the new request");
    assert_eq!(app.db.count("stores", who.workspace_id).await, 2);
}

#[tokio::test]
async fn without_a_budget_no_copy_is_kept_and_every_replay_reads_its_record() {
    let app = TestApp::spawn_with(|vars| {
        vars.insert("CONVEYOR_IDEMPOTENCY_REPLAY_CACHE".into(), "0".into());
    })
    .await;
    let who = principal();
    let key = Uuid::new_v4().to_string();
    for _ in 0..3 {
        let resp = app.send_with_key(Method::POST, "/v1/stores", who, Some(&key), Some(&store_body("n1"))).await;
        assert_eq!(resp.status(), StatusCode::ACCEPTED);
    }
    let metrics = app.metrics().await;
    assert_eq!(metric(&metrics, "conveyor_idempotency_requests_total{outcome=\"replayed\"}"), 2.0);
    assert_eq!(metric(&metrics, "conveyor_idempotency_replays_from_memory_total"), 0.0);
    assert_eq!(metric(&metrics, "conveyor_idempotency_replay_cache_bytes"), 0.0);
}
