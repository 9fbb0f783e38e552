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
        let config = rustls::ServerConfig::builder_with_provider(std::sync::Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
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
