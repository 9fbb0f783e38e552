//! Product drafts over HTTP against real PostgreSQL: revisions as ETags, `If-Match` required, one winner among
//! concurrent writers holding the same revision, bad input refused with nothing written.

use crate::common;

use common::{TestApp, principal};
use conveyor_server::auth::Principal;
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

async fn create(app: &TestApp, who: Principal, body: &Value) -> (String, String, Value) {
    let resp = app.send_with_key(Method::POST, "/v1/product-drafts", who, None, Some(body)).await;
    assert_eq!(resp.status(), StatusCode::CREATED);
    let etag = resp.headers()["etag"].to_str().unwrap().to_owned();
    let location = resp.headers()["location"].to_str().unwrap().to_owned();
    (etag, location, resp.json().await.unwrap())
}

async fn put(app: &TestApp, who: Principal, path: &str, if_match: Option<&str>, body: &Value) -> reqwest::Response {
    let mut req = app.http.put(app.url(path)).bearer_auth(app.token(who)).json(body);
    if let Some(tag) = if_match {
        req = req.header("if-match", tag);
    }
    req.send().await.unwrap()
}

#[tokio::test]
async fn a_draft_is_created_read_and_replaced_revision_by_revision() {
    let app = TestApp::spawn().await;
    let who = principal();
    let (etag, location, draft) =
        create(&app, who, &json!({"title": "Mug", "description": "Blue", "attributes": {"size": "L"}})).await;
    assert_eq!(etag, "\"1\"");
    assert_eq!(draft["revision"], 1);
    assert_eq!(draft["attributes"], json!({"size": "L"}));
    assert_eq!(location, format!("/v1/product-drafts/{}", draft["id"].as_str().unwrap()));

    let read = app.send(Method::GET, &location, who, None).await;
    assert_eq!(read.status(), StatusCode::OK);
    assert_eq!(read.headers()["etag"], "\"1\"");
    assert_eq!(read.json::<Value>().await.unwrap()["title"], "Mug");

    let replaced = put(&app, who, &location, Some("\"1\""), &json!({"title": "Big mug"})).await;
    assert_eq!(replaced.status(), StatusCode::OK);
    assert_eq!(replaced.headers()["etag"], "\"2\"");
    let body: Value = replaced.json().await.unwrap();
    assert_eq!((body["revision"].as_i64(), body["title"].as_str()), (Some(2), Some("Big mug")));
    assert_eq!(body["attributes"], json!({}), "PUT replaces the whole content");

    // A client holding the old revision is told the current one and changes nothing.
    let stale = put(&app, who, &location, Some("\"1\""), &json!({"title": "Lost update"})).await;
    assert_eq!(stale.status(), StatusCode::PRECONDITION_FAILED);
    let problem: Value = stale.json().await.unwrap();
    assert_eq!(
        (problem["code"].as_str(), problem["current_revision"].as_i64()),
        (Some("PRECONDITION_FAILED"), Some(2))
    );
    let missing = put(&app, who, &location, None, &json!({"title": "Blind write"})).await;
    assert_eq!(missing.status(), StatusCode::PRECONDITION_REQUIRED);
    assert_eq!(missing.json::<Value>().await.unwrap()["code"], "PRECONDITION_REQUIRED");
    let star = put(&app, who, &location, Some("*"), &json!({"title": "Blind write"})).await;
    assert_eq!(star.status(), StatusCode::PRECONDITION_REQUIRED);
    let weak = put(&app, who, &location, Some("W/\"2\""), &json!({"title": "Weak"})).await;
    assert_eq!(weak.status(), StatusCode::PRECONDITION_FAILED, "If-Match compares strongly");
    let several = put(&app, who, &location, Some("\"1\", \"2\""), &json!({"title": "Either"})).await;
    assert_eq!(several.status(), StatusCode::PRECONDITION_FAILED, "a write names the one revision it read");
    let nul = put(&app, who, &location, Some("\"2\""), &json!({"title": "a\u{0}b"})).await;
    assert_eq!(nul.status(), StatusCode::UNPROCESSABLE_ENTITY, "PostgreSQL stores no NUL: refused, not a 500");
    let now: Value = app.send(Method::GET, &location, who, None).await.json().await.unwrap();
    assert_eq!((now["revision"].as_i64(), now["title"].as_str()), (Some(2), Some("Big mug")));
}

#[tokio::test]
async fn of_sixteen_concurrent_writes_on_one_revision_exactly_one_succeeds() {
    let app = TestApp::spawn().await;
    let who = principal();
    let (_, location, _) = create(&app, who, &json!({"title": "Lamp"})).await;
    let writes = (0..16).map(|i| {
        let (app, location) = (&app, location.clone());
        async move { put(app, who, &location, Some("\"1\""), &json!({"title": format!("Lamp {i}")})).await }
    });
    let answers = futures_util::future::join_all(writes).await;
    let mut ok = 0;
    for answer in answers {
        match answer.status() {
            StatusCode::OK => ok += 1,
            StatusCode::PRECONDITION_FAILED => {
                assert_eq!(answer.json::<Value>().await.unwrap()["current_revision"], 2);
            }
            other => panic!("unexpected {other}"),
        }
    }
    assert_eq!(ok, 1);
    let now: Value = app.send(Method::GET, &location, who, None).await.json().await.unwrap();
    assert_eq!(now["revision"], 2);
}

#[tokio::test]
async fn bad_input_is_refused_and_writes_nothing() {
    let app = TestApp::spawn().await;
    let who = principal();
    let bad_bodies = [
        json!({"title": "Mug", "price": 3}),
        json!({"title": 42}),
        json!({"description": "no title"}),
        json!({"title": ""}),
        json!({"title": "x".repeat(201)}),
        json!({"title": "Mug", "attributes": ["not", "an", "object"]}),
    ];
    for body in &bad_bodies {
        let resp = app.send_with_key(Method::POST, "/v1/product-drafts", who, None, Some(body)).await;
        assert_eq!(resp.status(), StatusCode::UNPROCESSABLE_ENTITY, "{body}");
        assert_eq!(resp.json::<Value>().await.unwrap()["code"], "VALIDATION_FAILED");
    }
    let huge = json!({"title": "Mug", "description": "d".repeat(70 * 1024)});
    let resp = app.send_with_key(Method::POST, "/v1/product-drafts", who, None, Some(&huge)).await;
    assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE);
    let not_json = app
        .http
        .post(app.url("/v1/product-drafts"))
        .bearer_auth(app.token(who))
        .header("content-type", "application/json")
        .body("{\"title\": ")
        .send()
        .await
        .unwrap();
    assert_eq!(not_json.status(), StatusCode::BAD_REQUEST);
    assert_eq!(app.db.count("product_drafts", who.workspace_id).await, 0);

    let (_, location, _) = create(&app, who, &json!({"title": "Mug"})).await;
    for body in &bad_bodies {
        let resp = put(&app, who, &location, Some("\"1\""), body).await;
        assert_eq!(resp.status(), StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    }
    let now: Value = app.send(Method::GET, &location, who, None).await.json().await.unwrap();
    assert_eq!((now["revision"].as_i64(), now["title"].as_str()), (Some(1), Some("Mug")));

    // Another workspace's draft, an id that is not a UUID, and no token.
    let stranger = principal();
    assert_eq!(app.send(Method::GET, &location, stranger, None).await.status(), StatusCode::NOT_FOUND);
    let foreign = put(&app, stranger, &location, Some("\"1\""), &json!({"title": "Taken over"})).await;
    assert_eq!(foreign.status(), StatusCode::NOT_FOUND);
    assert_eq!(app.send(Method::GET, "/v1/product-drafts/not-a-uuid", who, None).await.status(), StatusCode::NOT_FOUND);
    let anonymous = app.http.get(app.url(&location)).send().await.unwrap();
    assert_eq!(anonymous.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(app.db.count("product_drafts", stranger.workspace_id).await, 0);
    let now: Value = app.send(Method::GET, &location, who, None).await.json().await.unwrap();
    assert_eq!(now["revision"], 1);
}
