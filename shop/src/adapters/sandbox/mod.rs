//! The sandbox: one real HTTP server that plays every external system for development and tests, one file each.
//!
//! - [`marketplace`]: `POST /v1/credentials/verify`, `POST /v1/products` (and the marketplace's other calls). Like a
//!   real marketplace it honours `Idempotency-Key`: a repeat returns the first answer and makes no new effect.
//! - [`files`]: `GET /files/{name}`, source files for asset transfers (sizes, ranges, throttling, dropped
//!   connections, redirects).
//! - [`ai`]: `POST /v1/ai/generate`, the AI provider: charges once per `Idempotency-Key` (`ai_charges`), answers a
//!   repeat with the stored result, and answers `429` with `Retry-After` for the next `ai_rate_limited_calls` calls.
//! - `GET /_sandbox/stats`: calls received, effects made, per system.
//! - `PUT /_sandbox/settings`: `latency_ms`, `error_rate` (answers 503), `timeout_rate` (hangs for `hang_ms`).

mod ai;
mod catalog;
pub mod files;
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
    /// Products in every store's catalog (`POST /v1/catalog/list`).
    pub catalog_size: u64,
    /// The next this many AI calls answer `429` with `Retry-After: ai_retry_after_secs` (counts down).
    pub ai_rate_limited_calls: u64,
    /// The `Retry-After` of a rate-limited AI call, in seconds (default 1).
    pub ai_retry_after_secs: u64,
    /// The next this many product creations answer `429` with `Retry-After: product_retry_after_secs` (counts down;
    /// nothing made).
    pub product_rate_limited_calls: u64,
    /// The `Retry-After` of a rate-limited product creation, in seconds (at least 1).
    pub product_retry_after_secs: u64,
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
    /// Product creation calls received (repeats included).
    pub product_calls: u64,
    /// The most product creation calls the sandbox was answering at once.
    #[serde(default)]
    pub product_calls_max_concurrent: u64,
    /// Product creation calls being answered now.
    #[serde(default)]
    pub product_calls_in_flight: u64,
    /// Products made: one per distinct idempotency key.
    pub products_created: u64,
    /// Catalog pages served (`POST /v1/catalog/list` answered with products).
    #[serde(default)]
    pub catalog_pages_served: u64,
    /// Catalog pages served, by the offset they start at: a page served twice shows as 2.
    #[serde(default)]
    pub catalog_pages_by_offset: std::collections::BTreeMap<u64, u64>,
    /// AI generation calls received (repeats, refusals and rate-limited calls included).
    #[serde(default)]
    pub ai_calls: u64,
    /// AI charges made: one per distinct idempotency key that was answered a result.
    #[serde(default)]
    pub ai_charges: u64,
    /// AI calls per idempotency key.
    #[serde(default)]
    pub ai_calls_by_key: HashMap<String, u64>,
    /// Source file requests received (`GET /files/{name}`, redirects included).
    #[serde(default)]
    pub file_requests: u64,
    /// Source file body bytes handed to connections.
    #[serde(default)]
    pub file_bytes_served: u64,
}

#[derive(Default)]
pub(crate) struct Inner {
    pub(crate) settings: Settings,
    pub(crate) stats: Stats,
    pub(crate) answers: HashMap<String, bool>,
    /// The product made for each idempotency key.
    pub(crate) products: HashMap<String, String>,
    /// Source files' memory (dropped names, generated images).
    pub(crate) files: files::FileState,
    /// The AI result given for each idempotency key.
    pub(crate) ai_results: HashMap<String, serde_json::Value>,
    /// The `traceparent` headers of marketplace calls, in the order received.
    pub(crate) traceparents: Vec<String>,
    /// The `tracestate` headers of marketplace calls, in the order received.
    pub(crate) tracestates: Vec<String>,
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

    /// The `traceparent` headers the marketplace calls carried, in the order received (calls without one: none).
    pub fn traceparents(&self) -> Vec<String> {
        self.0.lock().expect("sandbox lock").traceparents.clone()
    }

    /// The `tracestate` headers the marketplace calls carried, in the order received (calls without one: none).
    pub fn tracestates(&self) -> Vec<String> {
        self.0.lock().expect("sandbox lock").tracestates.clone()
    }

    /// The id of the product made for idempotency key `key`, if any.
    pub fn product(&self, key: &str) -> Option<String> {
        self.0.lock().expect("sandbox lock").products.get(key).cloned()
    }

    /// Plays the switches on one call: waits `latency_ms`, hangs for `hang_ms` on a `timeout_rate` share of calls,
    /// and answers `Err(503)` on an `error_rate` share.
    pub(crate) async fn act_up(&self) -> Result<(), axum::response::Response> {
        use axum::response::IntoResponse;
        use rand::Rng;
        let settings = self.0.lock().expect("sandbox lock").settings.clone();
        if settings.latency_ms > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(settings.latency_ms)).await;
        }
        let (fail, hang) = {
            let mut rng = rand::rng();
            (
                rng.random_bool(settings.error_rate.clamp(0.0, 1.0)),
                rng.random_bool(settings.timeout_rate.clamp(0.0, 1.0)),
            )
        };
        if hang {
            let hang_ms = if settings.hang_ms == 0 { 30_000 } else { settings.hang_ms };
            tokio::time::sleep(std::time::Duration::from_millis(hang_ms)).await;
        }
        if fail {
            return Err((axum::http::StatusCode::SERVICE_UNAVAILABLE, "sandbox: injected failure").into_response());
        }
        Ok(())
    }

    /// Changes the switches.
    pub fn set(&self, settings: Settings) {
        self.0.lock().expect("sandbox lock").settings = settings;
    }

    /// The sandbox's HTTP routes.
    pub fn router(&self) -> Router {
        Router::new()
            .merge(marketplace::routes())
            .merge(catalog::routes())
            .merge(ai::routes())
            .merge(files::routes())
            .route("/_sandbox/stats", get(stats))
            .route("/_sandbox/settings", put(settings))
            .with_state(self.clone())
    }

    /// Serves on `listener` until `shutdown`.
    pub async fn serve(self, listener: TcpListener, shutdown: CancellationToken) -> anyhow::Result<()> {
        axum::serve(listener, self.router()).with_graceful_shutdown(async move { shutdown.cancelled().await }).await?;
        Ok(())
    }

    /// Serves https (rustls) on `listener` until `shutdown`, so clients' TLS is exercised for real.
    pub async fn serve_tls(
        self,
        listener: TcpListener,
        tls: SandboxTls,
        shutdown: CancellationToken,
    ) -> anyhow::Result<()> {
        let handle = axum_server::Handle::new();
        let stopping = handle.clone();
        tokio::spawn(async move {
            shutdown.cancelled().await;
            stopping.graceful_shutdown(Some(std::time::Duration::from_secs(5)));
        });
        axum_server::from_tcp_rustls(listener.into_std()?, tls.0)
            .handle(handle)
            .serve(self.router().into_make_service_with_connect_info::<std::net::SocketAddr>())
            .await?;
        Ok(())
    }
}

/// The sandbox's TLS identity: a PEM certificate chain and its private key.
#[derive(Clone)]
pub struct SandboxTls(axum_server::tls_rustls::RustlsConfig);

impl SandboxTls {
    /// From PEM bytes.
    pub fn from_pem(cert: Vec<u8>, key: Vec<u8>) -> anyhow::Result<Self> {
        use rustls_pki_types::pem::PemObject;
        let certs = rustls_pki_types::CertificateDer::pem_slice_iter(&cert).collect::<Result<Vec<_>, _>>()?;
        let key = rustls_pki_types::PrivateKeyDer::from_pem_slice(&key)?;
        let config =
            rustls::ServerConfig::builder_with_provider(std::sync::Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()?
                .with_no_client_auth()
                .with_single_cert(certs, key)?;
        Ok(Self(axum_server::tls_rustls::RustlsConfig::from_config(std::sync::Arc::new(config))))
    }

    /// From PEM files.
    pub fn from_pem_files(cert: &std::path::Path, key: &std::path::Path) -> anyhow::Result<Self> {
        Self::from_pem(std::fs::read(cert)?, std::fs::read(key)?)
    }
}

async fn stats(State(sandbox): State<Sandbox>) -> Json<Stats> {
    Json(sandbox.stats())
}

async fn settings(State(sandbox): State<Sandbox>, Json(settings): Json<Settings>) -> Json<Settings> {
    sandbox.set(settings.clone());
    Json(settings)
}
