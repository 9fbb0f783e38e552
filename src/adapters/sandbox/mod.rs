//! The sandbox: one real HTTP server that plays every external system for development and tests, one file each.
//!
//! - [`marketplace`]: `POST /v1/credentials/verify` (and the marketplace's other calls). Like a real marketplace it
//!   honours `Idempotency-Key`: a repeat returns the first answer and makes no new effect.
//! - `GET /_sandbox/stats`: calls received, effects made, per system.
//! - `PUT /_sandbox/settings`: `latency_ms`, `error_rate` (answers 503), `timeout_rate` (hangs for `hang_ms`).

mod marketplace;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::routing::{get, put};
use axum::{Json, Router};
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
pub(crate) struct Inner {
    pub(crate) settings: Settings,
    pub(crate) stats: Stats,
    pub(crate) answers: HashMap<String, bool>,
}

/// A running sandbox's shared state (also readable in-process).
#[derive(Clone, Default)]
pub struct Sandbox(pub(crate) Arc<Mutex<Inner>>);

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
            .merge(marketplace::routes())
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

async fn stats(State(sandbox): State<Sandbox>) -> Json<Stats> {
    Json(sandbox.stats())
}

async fn settings(State(sandbox): State<Sandbox>, Json(settings): Json<Settings>) -> Json<Settings> {
    sandbox.set(settings.clone());
    Json(settings)
}
