//! What the OpenAPI document promises and the fuzzer (`scripts/fuzz`) found the server not keeping: integers written
//! with a zero fraction, empty uploads, and the document's own shape (3.1, one `Idempotency-Key` parameter).

use crate::common;

use common::{TestApp, principal};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

#[tokio::test]
async fn an_integer_written_with_a_zero_fraction_is_that_integer_and_a_fraction_is_refused() {
    let app = TestApp::spawn().await;
    let who = principal();

    let media = json!({"filename": "a.png", "content_type": "image/png", "size_bytes": 1234.0});
    let resp = app.send(Method::POST, "/v1/media", who, Some(&media)).await;
    assert_eq!(resp.status(), StatusCode::CREATED);
    let created: Value = resp.json().await.unwrap();
    assert_eq!(created["media"]["size_bytes"], 1234);

    let task = json!({"kind": "text", "input": {"prompt": "a blue mug", "max_words": 20.0}});
    let resp = app.send(Method::POST, "/v1/ai-tasks", who, Some(&task)).await;
    assert_eq!(resp.status(), StatusCode::ACCEPTED);
    let created: Value = resp.json().await.unwrap();
    assert_eq!(created["ai_task"]["input"]["max_words"], 20.0, "the input is kept as sent");

    for (path, body) in [
        ("/v1/media", json!({"filename": "a.png", "content_type": "image/png", "size_bytes": 12.5})),
        ("/v1/media", json!({"filename": "a.png", "content_type": "image/png", "size_bytes": -1.0})),
        ("/v1/ai-tasks", json!({"kind": "text", "input": {"prompt": "a mug", "max_words": 2.5}})),
    ] {
        let resp = app.send(Method::POST, path, who, Some(&body)).await;
        assert_eq!(resp.status(), StatusCode::UNPROCESSABLE_ENTITY, "{body}");
        let problem: Value = resp.json().await.unwrap();
        assert_eq!(problem["code"], "VALIDATION_FAILED");
    }
}

#[tokio::test]
async fn an_empty_upload_is_refused_and_the_media_still_awaits_its_bytes() {
    let app = TestApp::spawn().await;
    let who = principal();
    let media = json!({"filename": "a.png", "content_type": "image/png", "size_bytes": 10});
    let created: Value = app.send(Method::POST, "/v1/media", who, Some(&media)).await.json().await.unwrap();
    let id = created["media"]["id"].as_str().unwrap().to_owned();

    let upload = |body: Vec<u8>| {
        app.http
            .put(app.url(&format!("/v1/media/{id}/content")))
            .bearer_auth(app.token(who))
            .header("content-type", "image/png")
            .body(body)
            .send()
    };
    let resp = upload(Vec::new()).await.unwrap();
    assert_eq!(resp.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let problem: Value = resp.json().await.unwrap();
    assert_eq!(problem["code"], "VALIDATION_FAILED");
    assert!(problem["detail"].as_str().unwrap().contains("empty"), "{problem}");

    let complete = app.send(Method::POST, &format!("/v1/media/{id}/complete"), who, Some(&json!({}))).await;
    assert_eq!(complete.status(), StatusCode::CONFLICT, "nothing was uploaded");
    let problem: Value = complete.json().await.unwrap();
    assert_eq!(problem["code"], "MEDIA_NOT_UPLOADED");

    assert_eq!(upload(b"\x89PNG\r\n\x1a\n12".to_vec()).await.unwrap().status(), StatusCode::OK);
    let shown: Value = app.send(Method::GET, &format!("/v1/media/{id}"), who, None).await.json().await.unwrap();
    assert_eq!(shown["status"], "awaiting_upload");
    assert_eq!(shown["size_bytes"], 10);
}

#[tokio::test]
async fn the_document_is_openapi_3_1_and_every_idempotent_write_declares_the_key_as_the_server_parses_it() {
    let app = TestApp::spawn().await;
    let doc: Value = app.http.get(app.url("/v1/openapi.json")).send().await.unwrap().json().await.unwrap();
    assert_eq!(doc["openapi"], "3.1.0");
    let key = &doc["components"]["parameters"]["IdempotencyKey"];
    assert_eq!(key["name"], "Idempotency-Key");
    // Bare or quoted, hyphenated, any case: what `IdempotencyKey::parse` takes (its unit tests hold the cases).
    let uuid = "[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}";
    assert_eq!(key["schema"]["pattern"], format!("^({uuid}|\"{uuid}\")$"));

    let mut idempotent = Vec::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, operation) in item.as_object().unwrap() {
            let declares = operation["parameters"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|p| p["$ref"] == "#/components/parameters/IdempotencyKey" || p["name"] == "Idempotency-Key");
            if declares {
                let inline = operation["parameters"].as_array().unwrap().iter().any(|p| p["name"] == "Idempotency-Key");
                assert!(!inline, "{method} {path} declares its own Idempotency-Key instead of the shared one");
                idempotent.push(format!("{} {path}", method.to_uppercase()));
            }
        }
    }
    idempotent.sort();
    assert_eq!(
        idempotent,
        [
            "POST /v1/ai-tasks",
            "POST /v1/asset-transfers",
            "POST /v1/listings",
            "POST /v1/listings/{id}/publish",
            "POST /v1/media",
            "POST /v1/media/{id}/complete",
            "POST /v1/stores",
            "POST /v1/stores/{id}/catalog-syncs",
            "PUT /v1/stores/{id}/authorization",
        ]
    );
}
