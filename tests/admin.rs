//! The admin listener: liveness, readiness and metrics.

mod common;

use std::time::Duration;

use common::{TestApp, TestRedis};
use serde_json::Value;

#[tokio::test]
async fn readiness_follows_redis_while_liveness_stays_up() {
    let mut redis = TestRedis::start(None).await;
    let url = redis.url();
    let app = TestApp::spawn_with(|vars| {
        vars.insert("CONVEYOR_REDIS_URL".into(), url.clone());
        vars.insert("CONVEYOR_REDIS_COMMAND_TIMEOUT".into(), "500ms".into());
    })
    .await;
    let admin = |path: &str| format!("http://{}{path}", app.admin_addr);
    let ready = app.http.get(admin("/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 200);
    let body: Value = ready.json().await.unwrap();
    assert_eq!((body["postgres"].as_str(), body["redis"].as_str()), (Some("ok"), Some("ok")));

    redis.stop();
    let down = common::eventually(Duration::from_secs(20), || async {
        let resp = app.http.get(admin("/readyz")).send().await.ok()?;
        (resp.status() == 503).then_some(resp)
    })
    .await
    .expect("not ready without Redis");
    let body: Value = down.json().await.unwrap();
    assert_eq!(body["postgres"], "ok");
    assert_ne!(body["redis"], "ok");
    assert_eq!(app.http.get(admin("/healthz")).send().await.unwrap().status(), 200, "alive all the same");

    redis.start_again().await;
    let back = common::eventually(Duration::from_secs(30), || async {
        (app.http.get(admin("/readyz")).send().await.ok()?.status() == 200).then_some(())
    })
    .await;
    assert!(back.is_some(), "ready again once Redis returns (the client reconnects)");
    // An API request is recorded by route template and status class, never by raw path.
    let id = uuid::Uuid::new_v4();
    assert_eq!(app.http.get(app.url(&format!("/v1/stores/{id}"))).send().await.unwrap().status(), 401);
    let metrics = app.metrics().await;
    assert!(
        metrics.contains(
            r#"conveyor_http_request_duration_seconds_count{method="GET",route="/v1/stores/{id}",status_class="4xx"} 1"#
        ),
        "{metrics}"
    );
    assert!(!metrics.contains(&id.to_string()));
}
