//! The sandbox marketplace: credential verification and product creation (and the marketplace's other calls),
//! honouring `Idempotency-Key` like a real marketplace.

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
    Router::new().route("/v1/credentials/verify", post(verify)).route("/v1/products", post(create_product))
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
    if let Some(traceparent) = headers.get("traceparent").and_then(|v| v.to_str().ok()) {
        inner.traceparents.push(traceparent.to_owned());
    }
    if let Some(tracestate) = headers.get("tracestate").and_then(|v| v.to_str().ok()) {
        inner.tracestates.push(tracestate.to_owned());
    }
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

#[derive(Deserialize)]
struct ProductRequest {
    credentials: HashMap<String, String>,
    product: ProductFields,
}

#[derive(Deserialize)]
struct ProductFields {
    title: String,
}

/// `POST /v1/products`: makes a product, one per `Idempotency-Key`; a repeat answers the same id (`200`) and makes
/// nothing. The effect comes first and the latency after it, so a caller that dies or gives up while waiting leaves a
/// product behind, as with a real marketplace whose answer is lost: only the key keeps its retry from making a second
/// one. Refuses credentials whose `api_key` starts with `invalid` (`401 INVALID_CREDENTIALS`) and a product whose
/// title starts with `REFUSE` (`422 PRODUCT_REFUSED`); an injected failure (`503`) makes nothing, and so does a call
/// rate-limited by `product_rate_limited_calls` (`429` with `Retry-After: product_retry_after_secs`).
async fn create_product(
    State(sandbox): State<Sandbox>,
    headers: HeaderMap,
    Json(body): Json<ProductRequest>,
) -> Response {
    let Some(key) = headers.get("idempotency-key").and_then(|v| v.to_str().ok()).map(str::to_owned) else {
        return (StatusCode::BAD_REQUEST, "Idempotency-Key required").into_response();
    };
    let settings = sandbox.0.lock().expect("sandbox lock").settings.clone();
    let (fail, hang) = {
        let mut rng = rand::rng();
        (rng.random_bool(settings.error_rate.clamp(0.0, 1.0)), rng.random_bool(settings.timeout_rate.clamp(0.0, 1.0)))
    };
    let mut retry_after = None;
    let answer = {
        let mut inner = sandbox.0.lock().expect("sandbox lock");
        if let Some(traceparent) = headers.get("traceparent").and_then(|v| v.to_str().ok()) {
            inner.traceparents.push(traceparent.to_owned());
        }
        if let Some(tracestate) = headers.get("tracestate").and_then(|v| v.to_str().ok()) {
            inner.tracestates.push(tracestate.to_owned());
        }
        inner.stats.product_calls += 1;
        inner.stats.product_calls_in_flight += 1;
        inner.stats.product_calls_max_concurrent =
            inner.stats.product_calls_max_concurrent.max(inner.stats.product_calls_in_flight);
        if inner.settings.product_rate_limited_calls > 0 {
            inner.settings.product_rate_limited_calls -= 1;
            retry_after = Some(settings.product_retry_after_secs.max(1));
            (StatusCode::TOO_MANY_REQUESTS, serde_json::json!({ "code": "RATE_LIMITED" }))
        } else if fail {
            (StatusCode::SERVICE_UNAVAILABLE, serde_json::json!({ "code": "UNAVAILABLE" }))
        } else if body.credentials.get("api_key").is_none_or(|k| k.starts_with("invalid")) {
            (StatusCode::UNAUTHORIZED, serde_json::json!({ "code": "INVALID_CREDENTIALS" }))
        } else if body.product.title.starts_with("REFUSE") {
            (StatusCode::UNPROCESSABLE_ENTITY, serde_json::json!({ "code": "PRODUCT_REFUSED" }))
        } else if let Some(id) = inner.products.get(&key) {
            (StatusCode::OK, serde_json::json!({ "id": id }))
        } else {
            let id = format!("prod_{}", uuid::Uuid::new_v4().simple());
            inner.products.insert(key, id.clone());
            inner.stats.products_created += 1;
            (StatusCode::CREATED, serde_json::json!({ "id": id }))
        }
    };
    // Counted until answered, or until the caller hangs up (the future is dropped).
    let in_flight = InFlight(sandbox.clone());
    if settings.latency_ms > 0 {
        tokio::time::sleep(Duration::from_millis(settings.latency_ms)).await;
    }
    if hang {
        tokio::time::sleep(Duration::from_millis(if settings.hang_ms == 0 { 30_000 } else { settings.hang_ms })).await;
    }
    drop(in_flight);
    let mut response = (answer.0, Json(answer.1)).into_response();
    if let Some(secs) = retry_after {
        response.headers_mut().insert(axum::http::header::RETRY_AFTER, axum::http::HeaderValue::from(secs));
    }
    response
}

/// One product creation call being answered.
struct InFlight(Sandbox);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.0.lock().expect("sandbox lock").stats.product_calls_in_flight -= 1;
    }
}
