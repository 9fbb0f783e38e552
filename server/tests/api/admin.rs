//! The admin listener: liveness, readiness and metrics.

use crate::common;

use std::time::Duration;

use common::{TestApp, TestRedis};
use serde_json::Value;

/// `/readyz` and its JSON body.
async fn readyz(app: &TestApp) -> Option<(u16, Value)> {
    let resp = app.http.get(format!("http://{}/readyz", app.admin_addr)).send().await.ok()?;
    let status = resp.status().as_u16();
    Some((status, resp.json().await.ok()?))
}

#[tokio::test]
async fn readiness_rides_out_a_redis_blip_then_follows_redis_while_liveness_stays_up() {
    let mut redis = TestRedis::start(None).await;
    let url = redis.url();
    let app = TestApp::spawn_with(|vars| {
        vars.insert("CONVEYOR_REDIS_URL".into(), url.clone());
        vars.insert("CONVEYOR_REDIS_COMMAND_TIMEOUT".into(), "500ms".into());
        vars.insert("CONVEYOR_READY_REDIS_GRACE".into(), "3s".into());
    })
    .await;
    let admin = |path: &str| format!("http://{}{path}", app.admin_addr);
    let (status, body) = readyz(&app).await.expect("/readyz answers");
    assert_eq!(status, 200, "{body}");
    assert_eq!((body["postgres"].as_str(), body["redis"].as_str()), (Some("ok"), Some("ok")));

    redis.stop();
    // The first failed checks fall within the grace: still ready, and the body says Redis is failing.
    let (_, blip) = common::eventually(Duration::from_secs(20), || async {
        readyz(&app).await.filter(|(status, body)| *status == 200 && body["redis"] == "degraded")
    })
    .await
    .expect("ready but degraded while Redis has failed for less than the grace");
    assert_eq!(blip["postgres"], "ok");
    assert_eq!(blip["ready"], true);
    assert!(blip["redis_error"].is_string(), "{blip}");
    assert_eq!(blip["redis_grace_seconds"], 3);

    // Past the grace: not ready.
    let (_, down) = common::eventually(Duration::from_secs(30), || async {
        readyz(&app).await.filter(|(status, _)| *status == 503)
    })
    .await
    .expect("not ready once Redis has failed for longer than the grace");
    assert_eq!(down["postgres"], "ok");
    assert_eq!(down["redis"], "down", "{down}");
    assert_eq!(down["ready"], false);
    assert_eq!(app.http.get(admin("/healthz")).send().await.unwrap().status(), 200, "alive all the same");

    redis.start_again().await;
    let back = common::eventually(Duration::from_secs(30), || async {
        readyz(&app).await.filter(|(status, body)| *status == 200 && body["redis"] == "ok")
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

#[tokio::test]
async fn readiness_fails_at_once_when_a_migration_is_missing() {
    let app = TestApp::spawn_with(|vars| {
        vars.insert("CONVEYOR_READY_REDIS_GRACE".into(), "1h".into());
    })
    .await;
    assert_eq!(readyz(&app).await.expect("/readyz answers").0, 200);
    let mut owner = app.db.owner().await;
    let history = conveyor_jobs::MIGRATION_HISTORY_TABLE;
    let forget = format!("UPDATE {history} SET success = false WHERE version = (SELECT max(version) FROM {history})");
    sqlx::query(sqlx::AssertSqlSafe(forget)).execute(&mut owner).await.unwrap();

    let (status, body) = readyz(&app).await.expect("/readyz answers");
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["postgres"], "1 migration(s) not applied");
    assert_eq!(body["redis"], "ok", "Redis is fine: only PostgreSQL's part is wrong");
}
