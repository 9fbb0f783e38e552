//! The sandbox marketplace: credential verification (and the marketplace's other calls), honouring
//! `Idempotency-Key` like a real marketplace.

use std::collections::HashMap;
use std::time::Duration;

use axum::Json;
use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use rand::Rng;
use serde::Deserialize;

use super::Sandbox;

pub(super) fn routes() -> Router<Sandbox> {
    Router::new().route("/v1/credentials/verify", post(verify))
}

#[derive(Deserialize)]
struct VerifyRequest {
    credentials: HashMap<String, String>,
}

async fn verify(State(sandbox): State<Sandbox>, headers: HeaderMap, Json(body): Json<VerifyRequest>) -> Response {
    let Some(key) = headers.get("idempotency-key").and_then(|v| v.to_str().ok()).map(str::to_owned) else {
        return (StatusCode::BAD_REQUEST, "Idempotency-Key required").into_response();
    };
    let settings = sandbox.0.lock().expect("sandbox lock").settings.clone();
    if settings.latency_ms > 0 {
        tokio::time::sleep(Duration::from_millis(settings.latency_ms)).await;
    }
    let (fail, hang) = {
        let mut rng = rand::rng();
        (rng.random_bool(settings.error_rate.clamp(0.0, 1.0)), rng.random_bool(settings.timeout_rate.clamp(0.0, 1.0)))
    };
    if hang {
        tokio::time::sleep(Duration::from_millis(if settings.hang_ms == 0 { 30_000 } else { settings.hang_ms })).await;
    }
    let mut inner = sandbox.0.lock().expect("sandbox lock");
    inner.stats.calls += 1;
    *inner.stats.calls_by_key.entry(key.clone()).or_default() += 1;
    if fail {
        return (StatusCode::SERVICE_UNAVAILABLE, "sandbox: injected failure").into_response();
    }
    let valid = match inner.answers.get(&key) {
        Some(valid) => *valid,
        None => {
            let valid = body.credentials.get("api_key").is_some_and(|k| !k.starts_with("invalid"));
            inner.answers.insert(key, valid);
            inner.stats.effects += 1;
            valid
        }
    };
    Json(serde_json::json!({ "valid": valid })).into_response()
}
