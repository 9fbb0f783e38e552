//! The sandbox marketplace: a real HTTP server that behaves like a marketplace for development and tests.
//!
//! - `POST /v1/credentials/verify` with `Idempotency-Key` and `{"credentials": {...}}`: credentials are valid when
//!   they hold an `api_key` that does not start with `invalid`. Like a real marketplace it honours the key: a repeat
//!   returns the first answer and makes no new effect.
//! - `GET /_sandbox/stats`: calls received, effects made (distinct keys), and calls per key.
//! - `PUT /_sandbox/settings`: `latency_ms`, `error_rate` (answers 503), `timeout_rate` (hangs for `hang_ms`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use rand::Rng;
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Behaviour switches.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Settings {
    /// Added to every answer.
    pub latency_ms: u64,
    /// Share of calls answered `503` (0 to 1).
    pub error_rate: f64,
    /// Share of calls that hang for `hang_ms` before answering.
    pub timeout_rate: f64,
    /// How long a hanging call hangs (default 30 s).
    pub hang_ms: u64,
}

/// What the sandbox has seen.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Stats {
    /// Verification calls received (repeats included).
    pub calls: u64,
    /// Effects made: distinct idempotency keys.
    pub effects: u64,
    /// Calls per idempotency key.
    pub calls_by_key: HashMap<String, u64>,
}

#[derive(Default)]
struct Inner {
    settings: Settings,
    stats: Stats,
    answers: HashMap<String, bool>,
}

/// A running sandbox's shared state (also readable in-process).
#[derive(Clone, Default)]
pub struct Sandbox(Arc<Mutex<Inner>>);

impl Sandbox {
    /// A sandbox with `settings`.
    pub fn new(settings: Settings) -> Self {
        Self(Arc::new(Mutex::new(Inner { settings, ..Inner::default() })))
    }

    /// A copy of the counters.
    pub fn stats(&self) -> Stats {
        self.0.lock().expect("sandbox lock").stats.clone()
    }

    /// Changes the switches.
    pub fn set(&self, settings: Settings) {
        self.0.lock().expect("sandbox lock").settings = settings;
    }

    /// The sandbox's HTTP routes.
    pub fn router(&self) -> Router {
        Router::new()
            .route("/v1/credentials/verify", post(verify))
            .route("/_sandbox/stats", get(stats))
            .route("/_sandbox/settings", put(settings))
            .with_state(self.clone())
    }

    /// Serves on `listener` until `shutdown`.
    pub async fn serve(self, listener: TcpListener, shutdown: CancellationToken) -> anyhow::Result<()> {
        axum::serve(listener, self.router()).with_graceful_shutdown(async move { shutdown.cancelled().await }).await?;
        Ok(())
    }
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

async fn stats(State(sandbox): State<Sandbox>) -> Json<Stats> {
    Json(sandbox.stats())
}

async fn settings(State(sandbox): State<Sandbox>, Json(settings): Json<Settings>) -> Json<Settings> {
    sandbox.set(settings.clone());
    Json(settings)
}
