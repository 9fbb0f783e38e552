//! The HTTP surface (axum): the public API router and the admin router. The only module that knows axum.

mod admin;
mod ai_tasks;
mod asset_transfers;
mod auth;
mod catalog;
pub mod error;
pub mod idempotent;
pub mod json;
mod listings;
mod media;
mod operations;
mod product_drafts;
pub mod readiness;
mod stores;
mod trace;
pub mod ui;

use std::ops::Deref;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::middleware::{self, Next};
use axum::response::Response;
use sqlx::PgPool;
use tower_http::trace::TraceLayer;

use crate::auth::TokenKeys;
use crate::idempotency::Fingerprinter;
use conveyor_jobs::Metrics;
use conveyor_jobs::RedisClient;
use conveyor_shop::sealing::Sealer;

pub use admin::router as admin_router;

/// What every handler shares.
pub struct Shared {
    /// PostgreSQL, as the application role.
    pub pool: PgPool,
    /// Redis.
    pub redis: RedisClient,
    /// Bearer-token verification.
    pub tokens: TokenKeys,
    /// Seals credentials at rest.
    pub sealer: Sealer,
    /// This process's metrics: the platform's, and in the same registry the server's and the shop's.
    pub metrics: Metrics,
    /// The server's and the shop's metrics (HTTP, idempotency, uploads, media).
    pub server_metrics: crate::metrics::ServerMetrics,
    /// Largest accepted request body.
    pub max_body_bytes: usize,
    /// Fingerprints idempotent requests.
    pub fingerprinter: Fingerprinter,
    /// How long idempotency records live.
    pub idempotency_ttl: Duration,
    /// Copies of the completed idempotency records this process wrote or replayed (`CONVEYOR_IDEMPOTENCY_REPLAY_CACHE`).
    pub replays: crate::idempotency::ReplayCache,
    /// Object storage (media, transfers).
    pub storage: conveyor_shop::storage::ObjectStorage,
    /// Media, transfer and TLS settings.
    pub scenarios: crate::config::ScenarioSettings,
    /// The uploads received at once (`CONVEYOR_MEDIA_MAX_CONCURRENT_UPLOADS`): one permit each, taken without waiting.
    pub uploads: Arc<tokio::sync::Semaphore>,
    /// Operating across workspaces (admin API, web UI); `None` without `CONVEYOR_OPERATOR_DATABASE_URL`.
    pub admin: Option<conveyor_jobs::Admin>,
    /// Where the UI links a job's trace (`CONVEYOR_TRACE_URL`).
    pub trace_url: Option<String>,
    /// The workers' visibility time-out (`CONVEYOR_WORKER_VISIBILITY`): the UI shows a consumer idle past it while it
    /// holds entries as stalled.
    pub worker_visibility: std::time::Duration,
    /// Checks operator credentials (`CONVEYOR_ADMIN_TOKEN`, operator JWTs).
    pub operator_auth: crate::operator_auth::OperatorAuth,
    /// Signs the operator UI's sessions and CSRF tokens (derived from the JWT secret and the operator token).
    pub ui_sessions: ui::session::SessionKey,
    /// Since when Redis checks of `/readyz` fail, and how long that may last (`CONVEYOR_READY_REDIS_GRACE`).
    pub redis_readiness: readiness::RedisGrace,
    /// Test hook run right after an idempotency key is claimed; `None` in production.
    pub claim_hook: Option<idempotent::ClaimHook>,
    /// Canceled when the admin listener shuts down: ends the operators' followed event streams, whose connections
    /// would otherwise hold the graceful shutdown open.
    pub streams: tokio_util::sync::CancellationToken,
}

/// Cheap-to-clone handle on [`Shared`].
#[derive(Clone)]
pub struct AppState(pub Arc<Shared>);

impl Deref for AppState {
    type Target = Shared;
    fn deref(&self) -> &Shared {
        &self.0
    }
}

/// The public API: `/v1/...`.
pub fn router(state: AppState) -> Router {
    let limit = state.max_body_bytes;
    Router::new()
        .merge(stores::routes())
        .merge(ai_tasks::routes())
        .merge(asset_transfers::routes())
        .merge(operations::routes())
        .merge(catalog::routes())
        .merge(listings::routes())
        .merge(product_drafts::routes())
        .merge(media::routes(&state))
        .route("/v1/openapi.json", axum::routing::get(openapi))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(limit))
        .layer(middleware::from_fn_with_state(state.clone(), track_metrics))
        .layer(TraceLayer::new_for_http().make_span_with(trace::request_span).on_response(trace::record_response))
        .with_state(state)
}

/// The OpenAPI 3 document of this API (tests check that it matches the router).
pub const OPENAPI: &str = include_str!("openapi.json");

async fn openapi() -> impl axum::response::IntoResponse {
    ([(axum::http::header::CONTENT_TYPE, "application/json")], OPENAPI)
}

async fn not_found() -> error::ApiError {
    error::ApiError::NotFound("route")
}

/// Records `conveyor_http_request_duration_seconds` by route template (never the raw path), method and status class.
async fn track_metrics(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let started = Instant::now();
    let route =
        req.extensions().get::<MatchedPath>().map(|p| p.as_str().to_owned()).unwrap_or_else(|| "unmatched".to_owned());
    let method = req.method().as_str().to_owned();
    let response = next.run(req).await;
    let class = match response.status().as_u16() {
        100..=199 => "1xx",
        200..=299 => "2xx",
        300..=399 => "3xx",
        400..=499 => "4xx",
        _ => "5xx",
    };
    let method = match method.as_str() {
        "GET" | "POST" | "PUT" | "PATCH" | "DELETE" | "HEAD" | "OPTIONS" => method,
        _ => "other".to_owned(),
    };
    state
        .server_metrics
        .http_request_duration
        .with_label_values(&[route.as_str(), method.as_str(), class])
        .observe(started.elapsed().as_secs_f64());
    response
}
