//! The admin listener: `/healthz` (alive), `/readyz` (PostgreSQL reachable and migrations current; Redis reachable or
//! failing within its grace, see [`super::readiness`]), `/metrics` (Prometheus text format), and the operator
//! console ([`super::ui`]: the UI at `/ui/`, the admin API at `/admin/v1`).

use std::time::Duration;

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use serde_json::json;

use super::AppState;
use super::readiness::RedisVerdict;

/// The admin router.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics))
        .merge(super::ui::router(&state))
        .with_state(state)
}

/// `/readyz`: 503 when PostgreSQL is unreachable or migrations are missing; Redis failing only counts once it has
/// lasted longer than `CONVEYOR_READY_REDIS_GRACE` (see [`super::readiness`]). The body says which part is wrong.
async fn ready(State(state): State<AppState>) -> impl IntoResponse {
    let timeout = Duration::from_secs(2);
    let postgres = match tokio::time::timeout(timeout, crate::migrate::pending_versions(&state.pool)).await {
        Ok(Ok(0)) => "ok".to_owned(),
        Ok(Ok(n)) => format!("{n} migration(s) not applied"),
        Ok(Err(_)) => "unreachable".to_owned(),
        Err(_) => "timed out".to_owned(),
    };
    let redis_error = match tokio::time::timeout(timeout, conveyor_jobs::ping_redis(&state.redis)).await {
        Ok(Ok(())) => None,
        Ok(Err(_)) => Some("unreachable"),
        Err(_) => Some("timed out"),
    };
    let redis = state.redis_readiness.observe(redis_error.is_none(), std::time::Instant::now());
    let ready = postgres == "ok" && redis.is_ready();
    let mut body = json!({ "ready": ready, "postgres": postgres, "redis": redis.label() });
    if let RedisVerdict::Degraded { failing_for } | RedisVerdict::Down { failing_for } = redis {
        body["redis_error"] = json!(redis_error);
        body["redis_failing_for_seconds"] = json!(failing_for.as_secs());
        body["redis_grace_seconds"] = json!(state.redis_readiness.grace().as_secs());
    }
    let status = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (status, Json(body))
}

async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], state.metrics.render())
}
