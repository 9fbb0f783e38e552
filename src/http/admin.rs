//! The admin listener: `/healthz` (alive), `/readyz` (PostgreSQL and Redis reachable, migrations current) and
//! `/metrics` (Prometheus text format).

use std::time::Duration;

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use serde_json::json;

use super::AppState;
use crate::{migrate, stream};

/// The admin router.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics))
        .with_state(state)
}

async fn ready(State(state): State<AppState>) -> impl IntoResponse {
    let timeout = Duration::from_secs(2);
    let postgres = match tokio::time::timeout(timeout, migrate::pending_versions(&state.pool)).await {
        Ok(Ok(0)) => "ok".to_owned(),
        Ok(Ok(n)) => format!("{n} migration(s) not applied"),
        Ok(Err(_)) => "unreachable".to_owned(),
        Err(_) => "timed out".to_owned(),
    };
    let redis = match tokio::time::timeout(timeout, stream::ping(&state.redis)).await {
        Ok(Ok(())) => "ok",
        Ok(Err(_)) => "unreachable",
        Err(_) => "timed out",
    };
    let ready = postgres == "ok" && redis == "ok";
    let status = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (status, Json(json!({ "ready": ready, "postgres": postgres, "redis": redis })))
}

async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], state.metrics.render())
}
