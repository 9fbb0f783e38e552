//! Wiring of the roles (`api`, `all`, ...) and shutdown. Every long-running part takes a `CancellationToken`.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::auth::TokenKeys;
use crate::config::Config;
use crate::http::{self, AppState, Shared};
use crate::idempotency::Fingerprinter;
use crate::metrics::Metrics;
use crate::sealing::Sealer;
use crate::{db, stream};

/// Which parts a process runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The HTTP API (and its admin listener).
    Api,
    /// Every role in one process (development, demos).
    All,
}

/// Builds what the API shares, connecting to PostgreSQL and Redis.
pub async fn connect_state(config: &Config, metrics: Metrics) -> anyhow::Result<Shared> {
    let pool = db::connect(config.database_url.expose(), config.database_max_connections)
        .await
        .context("Failed to connect to PostgreSQL (CONVEYOR_DATABASE_URL)")?;
    let redis = stream::connect(config.redis_url.expose(), Duration::from_secs(5))
        .await
        .context("Failed to connect to Redis (CONVEYOR_REDIS_URL)")?;
    Ok(Shared {
        pool,
        redis,
        tokens: TokenKeys::new(&config.jwt_secret),
        sealer: Sealer::new(&config.encryption_key, "k1"),
        metrics,
        max_body_bytes: config.max_body_bytes,
        fingerprinter: Fingerprinter::new(config.idempotency_keys.clone()),
        idempotency_ttl: config.idempotency_ttl,
        claim_hook: None,
    })
}

/// Serves the API on `api` and the admin endpoints on `admin` until `shutdown`, then drains in-flight requests.
pub async fn serve(
    state: AppState,
    api: TcpListener,
    admin: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let api_router = http::router(state.clone());
    let admin_router = http::admin_router(state);
    let api_shutdown = shutdown.clone();
    let api = axum::serve(api, api_router).with_graceful_shutdown(async move { api_shutdown.cancelled().await });
    let admin = axum::serve(admin, admin_router).with_graceful_shutdown(async move { shutdown.cancelled().await });
    tokio::try_join!(async { api.await.context("API server failed") }, async {
        admin.await.context("Admin server failed")
    })?;
    Ok(())
}

/// Runs `role` until SIGTERM or SIGINT, then stops within the configured grace period.
pub async fn run(config: Config, role: Role) -> anyhow::Result<()> {
    let shutdown = CancellationToken::new();
    let tracker = TaskTracker::new();
    let metrics = Metrics::new();
    let state = AppState(Arc::new(connect_state(&config, metrics).await?));

    let api = TcpListener::bind(config.http_addr)
        .await
        .with_context(|| format!("Failed to bind CONVEYOR_HTTP_ADDR {}", config.http_addr))?;
    let admin = TcpListener::bind(config.admin_addr)
        .await
        .with_context(|| format!("Failed to bind CONVEYOR_ADMIN_ADDR {}", config.admin_addr))?;
    tracing::info!(http = %config.http_addr, admin = %config.admin_addr, ?role, "Conveyor started");
    let server = tracker.spawn(serve(state, api, admin, shutdown.clone()));
    tracker.close();

    wait_for_signal().await;
    tracing::info!(grace = ?config.shutdown_grace, "Shutting down");
    shutdown.cancel();
    match tokio::time::timeout(config.shutdown_grace, tracker.wait()).await {
        Ok(()) => {}
        Err(_) => tracing::warn!("Grace period over; exiting with work unfinished"),
    }
    if server.is_finished() {
        server.await.context("API task panicked")??;
    }
    Ok(())
}

/// Resolves on the first SIGTERM or SIGINT.
pub async fn wait_for_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}
