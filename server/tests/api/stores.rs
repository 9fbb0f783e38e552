//! The store-authorization write path through the HTTP API, against real PostgreSQL and Redis.

use crate::common;

use std::collections::HashMap;
use std::time::Duration;

use common::{TestApp, principal, store_body};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

async fn problem(resp: reqwest::Response) -> (StatusCode, String, Value) {
    let status = resp.status();
    let content_type = resp.headers().get("content-type").map(|v| v.to_str().unwrap().to_owned()).unwrap_or_default();
    let body: Value = resp.json().await.expect("problem+json body");
    assert_eq!(body["status"], status.as_u16(), "problem status member matches");
    (status, content_type, body)
}

#[tokio::test]
async fn creating_a_store_writes_one_store_one_operation_and_one_event() {
    let app = TestApp::spawn().await;
    let who = principal();
    let resp = app.send(Method::POST, "/v1/stores", who, Some(&store_body("m1"))).await;
    assert_eq!(resp.status(), StatusCode::ACCEPTED);
    let location = resp.headers()["location"].to_str().unwrap().to_owned();
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["store"]["status"], "pending_verification");
    assert_eq!(body["store"]["platform"], "sandbox");
    assert_eq!(body["operation"]["status"], "queued");
    assert_eq!(body["operation"]["kind"], "store.verify_credentials");
    let op_id = body["operation"]["id"].as_str().unwrap();
    assert_eq!(location, format!("/v1/operations/{op_id}"));

    for table in ["stores", "store_credentials", "operations", "outbox_events"] {
        assert_eq!(app.db.count(table, who.workspace_id).await, 1, "{table}");
    }
    let events = app.db.rows("outbox_events", who.workspace_id).await;
    let event = &events[0];
    assert_eq!(event["status"], "pending");
    assert_eq!(event["queue"], "stores");
    assert_eq!(event["event_type"], "store.verify_credentials");
    assert_eq!(event["operation_id"], op_id);
    assert_eq!(event["event_payload"], json!({ "store_id": body["store"]["id"], "credentials_version": 1 }));
    assert!(event["traceparent"].as_str().is_some_and(conveyor_jobs::is_valid_traceparent));

    let op: Value = app.send(Method::GET, &location, who, None).await.json().await.unwrap();
    assert_eq!(op["id"], op_id);
    assert_eq!(op["status"], "queued");
    let store_path = format!("/v1/stores/{}", body["store"]["id"].as_str().unwrap());
    let store: Value = app.send(Method::GET, &store_path, who, None).await.json().await.unwrap();
    assert_eq!(store["name"], "Main shop");
    assert!(store.get("credentials").is_none());
}

#[tokio::test]
async fn an_incoming_traceparent_is_carried_into_the_outbox_event() {
    let app = TestApp::spawn().await;
    let who = principal();
    let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let resp = app
        .http
        .post(app.url("/v1/stores"))
        .bearer_auth(app.token(who))
        .header("idempotency-key", uuid::Uuid::new_v4().to_string())
        .header("traceparent", tp)
        .json(&store_body("tp"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::ACCEPTED);
    assert_eq!(app.db.rows("outbox_events", who.workspace_id).await[0]["traceparent"], tp);
}

#[tokio::test]
async fn when_the_outbox_write_fails_nothing_is_written() {
    let app = TestApp::spawn().await;
    let who = principal();
    // The owner makes every outbox insert fail; the store and operation written before it must roll back too.
    let mut owner = app.db.owner().await;
    sqlx::query("ALTER TABLE conveyor.outbox_events ADD CONSTRAINT test_reject_all CHECK (false) NOT VALID")
        .execute(&mut owner)
        .await
        .unwrap();
    let resp = app.send(Method::POST, "/v1/stores", who, Some(&store_body("rollback"))).await;
    let (status, content_type, body) = problem(resp).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(content_type, "application/problem+json");
    assert_eq!(body["code"], "INTERNAL");
    assert!(!body.to_string().contains("test_reject_all"), "5xx bodies carry no internals: {body}");
    for table in ["stores", "store_credentials", "operations", "outbox_events"] {
        assert_eq!(app.db.count(table, who.workspace_id).await, 0, "{table}");
    }
}

#[tokio::test]
async fn replacing_credentials_queues_a_new_verification_of_the_next_version() {
    let app = TestApp::spawn().await;
    let who = principal();
    let created: Value = app.send(Method::POST, "/v1/stores", who, Some(&store_body("v1"))).await.json().await.unwrap();
    let store_id = created["store"]["id"].as_str().unwrap();
    let path = format!("/v1/stores/{store_id}/authorization");
    let resp = app.send(Method::PUT, &path, who, Some(&json!({"credentials": {"api_key": "new"}}))).await;
    assert_eq!(resp.status(), StatusCode::ACCEPTED);
    let replaced: Value = resp.json().await.unwrap();
    assert_eq!(replaced["store"]["id"], store_id);
    assert_ne!(replaced["operation"]["id"], created["operation"]["id"]);
    assert_eq!(app.db.count("operations", who.workspace_id).await, 2);
    assert_eq!(app.db.count("store_credentials", who.workspace_id).await, 1);
    let events = app.db.rows("outbox_events", who.workspace_id).await;
    let versions: Vec<&Value> = events.iter().map(|e| &e["event_payload"]["credentials_version"]).collect();
    assert!(versions.contains(&&json!(1)) && versions.contains(&&json!(2)), "{versions:?}");
}

async fn assert_rejected(resp: reqwest::Response, status: StatusCode, code: &str) {
    let (got, content_type, body) = problem(resp).await;
    assert_eq!((got, body["code"].as_str().unwrap()), (status, code), "{body}");
    assert_eq!(content_type, "application/problem+json");
    for member in ["type", "title", "detail"] {
        assert!(body.get(member).is_some(), "problem has {member}");
    }
}

#[tokio::test]
async fn malformed_bodies_get_the_documented_status_and_write_nothing() {
    let app = TestApp::spawn_with(|vars| {
        vars.insert("CONVEYOR_MAX_BODY_BYTES".into(), "2048".into());
    })
    .await;
    let who = principal();
    let token = app.token(who);
    let post = |body: String, content_type: &'static str| {
        app.http
            .post(app.url("/v1/stores"))
            .bearer_auth(&token)
            .header("idempotency-key", uuid::Uuid::new_v4().to_string())
            .header("content-type", content_type)
            .body(body)
            .send()
    };
    assert_rejected(
        post("{\"name\": ".into(), "application/json").await.unwrap(),
        StatusCode::BAD_REQUEST,
        "MALFORMED_JSON",
    )
    .await;
    let mut unknown = store_body("x");
    unknown["extra"] = json!(true);
    assert_rejected(
        post(unknown.to_string(), "application/json").await.unwrap(),
        StatusCode::UNPROCESSABLE_ENTITY,
        "VALIDATION_FAILED",
    )
    .await;
    let mut wrong_type = store_body("x");
    wrong_type["credentials"]["api_key"] = json!(12345);
    let resp = post(wrong_type.to_string(), "application/json").await.unwrap();
    let (status, _, body) = problem(resp).await;
    assert_eq!((status, body["code"].as_str().unwrap()), (StatusCode::UNPROCESSABLE_ENTITY, "VALIDATION_FAILED"));
    assert!(!body.to_string().contains("12345"), "a rejected value is not echoed: {body}");
    let mut bad_platform = store_body("x");
    bad_platform["platform"] = json!("nowhere");
    assert_rejected(
        post(bad_platform.to_string(), "application/json").await.unwrap(),
        StatusCode::UNPROCESSABLE_ENTITY,
        "VALIDATION_FAILED",
    )
    .await;
    let mut no_credentials = store_body("x");
    no_credentials["credentials"] = json!({});
    assert_rejected(
        post(no_credentials.to_string(), "application/json").await.unwrap(),
        StatusCode::UNPROCESSABLE_ENTITY,
        "VALIDATION_FAILED",
    )
    .await;
    let mut huge = store_body("x");
    huge["name"] = json!("n".repeat(4096));
    assert_rejected(
        post(huge.to_string(), "application/json").await.unwrap(),
        StatusCode::PAYLOAD_TOO_LARGE,
        "PAYLOAD_TOO_LARGE",
    )
    .await;
    assert_rejected(
        post(store_body("x").to_string(), "text/plain").await.unwrap(),
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "UNSUPPORTED_MEDIA_TYPE",
    )
    .await;
    for table in ["stores", "operations", "outbox_events"] {
        assert_eq!(app.db.count(table, who.workspace_id).await, 0, "{table}");
    }
}

fn forge(header: &Value, claims: &Value, secret: &[u8]) -> String {
    use base64::Engine as _;
    use hmac::Mac as _;
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let signing_input = format!("{}.{}", b64.encode(header.to_string()), b64.encode(claims.to_string()));
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(secret).unwrap();
    mac.update(signing_input.as_bytes());
    format!("{signing_input}.{}", b64.encode(mac.finalize().into_bytes()))
}

#[tokio::test]
async fn missing_expired_forged_and_unsigned_tokens_are_refused_and_write_nothing() {
    let app = TestApp::spawn().await;
    let who = principal();
    let now = chrono::Utc::now().timestamp();
    let claims = |exp: i64| json!({"sub": who.user_id.0, "workspace_id": who.workspace_id.0, "exp": exp});
    let hs256 = json!({"alg": "HS256", "typ": "JWT"});
    let valid = forge(&hs256, &claims(now + 600), common::JWT_SECRET.as_bytes());
    let unsigned = {
        use base64::Engine as _;
        let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
        format!(
            "{}.{}.",
            b64.encode(json!({"alg": "none", "typ": "JWT"}).to_string()),
            b64.encode(claims(now + 600).to_string())
        )
    };
    let cases: Vec<(&str, Option<String>)> = vec![
        ("missing", None),
        ("not a bearer", Some("Basic dXNlcjpwYXNz".into())),
        ("garbage", Some("Bearer not.a.jwt".into())),
        ("expired", Some(format!("Bearer {}", forge(&hs256, &claims(now - 600), common::JWT_SECRET.as_bytes())))),
        (
            "forged",
            Some(format!("Bearer {}", forge(&hs256, &claims(now + 600), b"another-secret-entirely-0123456789abcdef"))),
        ),
        ("alg none", Some(format!("Bearer {unsigned}"))),
        (
            "alg HS512",
            Some(format!(
                "Bearer {}",
                forge(&json!({"alg": "HS512"}), &claims(now + 600), common::JWT_SECRET.as_bytes())
            )),
        ),
        (
            "no workspace",
            Some(format!(
                "Bearer {}",
                forge(&hs256, &json!({"sub": who.user_id.0, "exp": now + 600}), common::JWT_SECRET.as_bytes())
            )),
        ),
    ];
    for (name, auth) in cases {
        let mut req = app
            .http
            .post(app.url("/v1/stores"))
            .header("idempotency-key", uuid::Uuid::new_v4().to_string())
            .json(&store_body("t"));
        if let Some(auth) = auth {
            req = req.header("authorization", auth);
        }
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status(), StatusCode::UNAUTHORIZED, "{name}");
        let body: Value = resp.json().await.unwrap();
        assert_eq!(body["code"], "UNAUTHENTICATED", "{name}");
    }
    assert_eq!(app.db.count("stores", who.workspace_id).await, 0);
    // The hand-forged token with the right secret is accepted: the refusals above are about the token, not the forge.
    let resp = app
        .http
        .post(app.url("/v1/stores"))
        .bearer_auth(valid)
        .header("idempotency-key", uuid::Uuid::new_v4().to_string())
        .json(&store_body("t"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::ACCEPTED);
}

#[tokio::test]
async fn unknown_and_other_workspaces_ids_are_not_found_and_unchanged() {
    let app = TestApp::spawn().await;
    let (alice, mallory) = (principal(), principal());
    let created: Value =
        app.send(Method::POST, "/v1/stores", alice, Some(&store_body("a"))).await.json().await.unwrap();
    let store_id = created["store"]["id"].as_str().unwrap();
    let op_id = created["operation"]["id"].as_str().unwrap();
    let unknown = uuid::Uuid::now_v7();
    for path in [format!("/v1/stores/{unknown}"), format!("/v1/stores/{store_id}"), "/v1/stores/not-a-uuid".into()] {
        assert_rejected(app.send(Method::GET, &path, mallory, None).await, StatusCode::NOT_FOUND, "NOT_FOUND").await;
    }
    for path in [format!("/v1/operations/{op_id}"), format!("/v1/operations/{unknown}")] {
        assert_rejected(app.send(Method::GET, &path, mallory, None).await, StatusCode::NOT_FOUND, "NOT_FOUND").await;
    }
    let creds = json!({"credentials": {"api_key": "hijack"}});
    for id in [store_id.to_owned(), unknown.to_string()] {
        let resp = app.send(Method::PUT, &format!("/v1/stores/{id}/authorization"), mallory, Some(&creds)).await;
        assert_rejected(resp, StatusCode::NOT_FOUND, "NOT_FOUND").await;
    }
    assert_eq!(app.db.count("operations", alice.workspace_id).await, 1);
    assert_eq!(app.db.count("outbox_events", alice.workspace_id).await, 1);
    assert_eq!(app.db.count("operations", mallory.workspace_id).await, 0);
    assert_eq!(app.db.count("outbox_events", mallory.workspace_id).await, 0);
    let store = &app.db.rows("store_credentials", alice.workspace_id).await[0];
    assert_eq!(store["version"], 1, "the victim's credentials were not replaced");
}

#[tokio::test]
async fn no_secret_reaches_a_response_a_payload_a_plain_column_or_a_log_line() {
    let db = common::TestDb::create().await;
    let prefix = format!("conveyor-test-{}", uuid::Uuid::new_v4().simple());
    let mut vars: HashMap<String, String> = common::config_vars(&db, &prefix);
    let (port, admin_port) = (common::free_port(), common::free_port());
    vars.insert("CONVEYOR_HTTP_ADDR".into(), format!("127.0.0.1:{port}"));
    vars.insert("CONVEYOR_ADMIN_ADDR".into(), format!("127.0.0.1:{admin_port}"));
    vars.insert("RUST_LOG".into(), "trace,hyper=info,h2=info".into());
    let process = common::Process::spawn(&["api"], &vars);
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::builder()
        .default_headers(reqwest::header::HeaderMap::from_iter([(
            reqwest::header::HeaderName::from_static("idempotency-key"),
            reqwest::header::HeaderValue::from_str(&uuid::Uuid::new_v4().to_string()).unwrap(),
        )]))
        .build()
        .unwrap();
    common::eventually(Duration::from_secs(20), || async {
        http.get(format!("http://127.0.0.1:{admin_port}/readyz")).send().await.ok().filter(|r| r.status().is_success())
    })
    .await
    .expect("the api process becomes ready");

    let who = principal();
    let tokens = conveyor_server::auth::TokenKeys::new(&conveyor_server::config::Secret::new(
        common::JWT_SECRET.as_bytes().to_vec(),
    ));
    let token = tokens.mint(who, Duration::from_secs(600));
    let marker = format!("S3CR3T{}", uuid::Uuid::new_v4().simple());
    let mut bodies = Vec::new();
    let created =
        http.post(format!("{base}/v1/stores")).bearer_auth(&token).json(&store_body(&marker)).send().await.unwrap();
    assert_eq!(created.status(), StatusCode::ACCEPTED);
    let created: Value = created.json().await.unwrap();
    bodies.push(created.to_string());
    let store_id = created["store"]["id"].as_str().unwrap().to_owned();
    let replace = json!({"credentials": {"api_key": format!("new-{marker}")}});
    let put = http
        .put(format!("{base}/v1/stores/{store_id}/authorization"))
        .bearer_auth(&token)
        .json(&replace)
        .send()
        .await
        .unwrap();
    bodies.push(put.text().await.unwrap());
    // Rejected requests that carry the secret, too.
    let mut bad = store_body(&marker);
    bad["extra"] = json!(marker);
    bodies.push(
        http.post(format!("{base}/v1/stores"))
            .bearer_auth(&token)
            .json(&bad)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap(),
    );
    bodies.push(
        http.post(format!("{base}/v1/stores")).json(&store_body(&marker)).send().await.unwrap().text().await.unwrap(),
    );
    bodies.push(
        http.get(format!("{base}/v1/stores/{store_id}"))
            .bearer_auth(&token)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap(),
    );
    bodies.push(http.get(format!("http://127.0.0.1:{admin_port}/metrics")).send().await.unwrap().text().await.unwrap());

    let secrets =
        [marker.as_str(), common::JWT_SECRET, common::ENCRYPTION_KEY_B64, "test-fingerprint-key-must-never-leak"];
    for body in &bodies {
        for secret in secrets {
            assert!(!body.contains(secret), "a response leaks a secret: {body}");
        }
    }
    for table in ["stores", "store_credentials", "operations", "outbox_events", "idempotency_requests"] {
        for row in db.rows(table, who.workspace_id).await {
            let text = row.to_string();
            for secret in secrets {
                assert!(!text.contains(secret), "{table} leaks a secret: {text}");
            }
        }
    }
    // The sealed column is ciphertext: the marker's bytes are not in it either.
    let sealed = db.rows("store_credentials", who.workspace_id).await;
    let ciphertext = sealed[0]["ciphertext"].as_str().unwrap();
    assert!(!ciphertext.contains(&marker.bytes().map(|b| format!("{b:02x}")).collect::<String>()));

    let log = process.log();
    assert!(log.contains("/v1/stores"), "the log captured the requests (trace level)");
    for secret in secrets.iter().chain([&token.as_str()]) {
        assert!(!log.contains(secret), "a log line leaks a secret");
    }
}

#[tokio::test]
async fn every_operation_of_the_openapi_document_is_routed_and_every_route_documented() {
    let app = TestApp::spawn().await;
    let doc: Value = app.http.get(app.url("/v1/openapi.json")).send().await.unwrap().json().await.unwrap();
    assert_eq!(doc["openapi"], "3.1.0");
    let paths = doc["paths"].as_object().unwrap();
    let who = principal();
    let mut documented = Vec::new();
    for (path, item) in paths {
        for method in item.as_object().unwrap().keys() {
            documented.push(format!("{} {path}", method.to_uppercase()));
            let concrete = path.replace("{id}", &uuid::Uuid::now_v7().to_string());
            let method = Method::from_bytes(method.to_uppercase().as_bytes()).unwrap();
            let resp = app.send(method, &concrete, who, Some(&json!({}))).await;
            let status = resp.status();
            let body = resp.text().await.unwrap();
            assert!(!body.contains("route not found"), "{path} is documented but not routed ({status})");
        }
    }
    documented.sort();
    // The routes the router serves (kept here; a new route without documentation fails below).
    let mut routed = vec![
        "POST /v1/stores",
        "GET /v1/stores/{id}",
        "PUT /v1/stores/{id}/authorization",
        "POST /v1/listings",
        "GET /v1/listings/{id}",
        "POST /v1/listings/{id}/publish",
        "GET /v1/operations",
        "GET /v1/operations/{id}",
        "POST /v1/operations/{id}/cancel",
        "GET /v1/openapi.json",
        "POST /v1/media",
        "GET /v1/media/{id}",
        "PUT /v1/media/{id}/content",
        "POST /v1/media/{id}/complete",
        "GET /v1/media/{id}/derivatives/{name}",
        "POST /v1/asset-transfers",
        "GET /v1/asset-transfers/{id}",
        "POST /v1/product-drafts",
        "POST /v1/stores/{id}/catalog-syncs",
        "GET /v1/catalog-syncs/{id}",
        "GET /v1/stores/{id}/products",
        "GET /v1/product-drafts/{id}",
        "PUT /v1/product-drafts/{id}",
        "POST /v1/ai-tasks",
        "GET /v1/ai-tasks/{id}",
    ];
    routed.sort();
    assert_eq!(documented, routed);
    let resp = app.send(Method::GET, "/v1/nowhere", who, None).await;
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
}
