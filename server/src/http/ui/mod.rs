//! The operator web UI at `/ui/` on the admin listener: server-rendered HTML (maud, escaped by construction), plain
//! links and forms, no JavaScript. It calls [`conveyor_jobs::Admin`] exactly as the admin API does.
//!
//! ```text
//! GET  /ui/login, POST /ui/login          the operator token or an operator JWT → a signed session cookie
//! GET  /ui/                                overview: queues (counts by state, lag, throughput, oldest age), pauses
//! GET  /ui/queues/{name}                   one queue's counts and jobs (status filter), pause / resume
//! GET  /ui/jobs, /ui/jobs/{id}             job search; one job with its attempts and payload, cancel / retry
//! GET  /ui/dead-letters                    filter by queue, kind, workspace; replay / discard one or all matching
//! GET  /ui/dead-letters/confirm            a bulk action's count and confirmation form (bounded by its `until`)
//! GET  /ui/operations, /ui/schedules       operation search; schedules with pause / resume
//! POST ...                                 every change: a form carrying the session's CSRF token
//! ```
//!
//! [`guard`] holds the rules every page obeys: a valid session or a redirect to the login, CSRF and origin checks on
//! every POST, security headers on every response.

mod dead_letters;
mod guard;
mod jobs;
mod layout;
mod login;
mod operations;
mod overview;
mod queues;
mod schedules;
pub mod session;

use axum::Router;
use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{StatusCode, header};
use axum::middleware;
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};

use self::session::Session;
use super::AppState;
use conveyor_jobs::{Actor, Admin, AdminError};

/// The stylesheet, embedded in the binary.
const CSS: &str = include_str!("ui.css");

/// The UI's routes, to merge into the admin router (which supplies the state).
pub fn router(state: &AppState) -> Router<AppState> {
    let pages = Router::new()
        .route("/ui/", get(overview::show))
        .route("/ui/logout", post(login::logout))
        .route("/ui/pauses", post(overview::pause))
        .route("/ui/pauses/resume", post(overview::resume))
        .route("/ui/queues/{name}", get(queues::show))
        .route("/ui/queues/{name}/pause", post(queues::pause))
        .route("/ui/queues/{name}/resume", post(queues::resume))
        .route("/ui/jobs", get(jobs::search))
        .route("/ui/jobs/{id}", get(jobs::show))
        .route("/ui/jobs/{id}/cancel", post(jobs::cancel))
        .route("/ui/jobs/{id}/retry", post(jobs::retry))
        .route("/ui/dead-letters", get(dead_letters::list))
        .route("/ui/dead-letters/confirm", get(dead_letters::confirm))
        .route("/ui/dead-letters/replay", post(dead_letters::replay_matching))
        .route("/ui/dead-letters/discard", post(dead_letters::discard_matching))
        .route("/ui/dead-letters/{id}/replay", post(dead_letters::replay))
        .route("/ui/dead-letters/{id}/discard", post(dead_letters::discard))
        .route("/ui/operations", get(operations::search))
        .route("/ui/schedules", get(schedules::list))
        .route("/ui/schedules/pause", post(schedules::pause))
        .route("/ui/schedules/resume", post(schedules::resume))
        .route_layer(middleware::from_fn_with_state(state.clone(), guard::require_session));
    Router::new()
        .route("/ui", get(|| async { Redirect::to("/ui/") }))
        .route("/ui/login", get(login::form).post(login::submit))
        .route("/ui/static/ui.css", get(stylesheet))
        .merge(pages)
        .layer(middleware::from_fn(guard::security_headers))
}

async fn stylesheet() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/css; charset=utf-8"), (header::CACHE_CONTROL, "max-age=3600")], CSS)
}

/// What a signed-in page has: the operator handle, the session and its CSRF token for the page's forms.
pub(super) struct Console {
    admin: Admin,
    session: Session,
    csrf: String,
}

impl Console {
    fn actor(&self) -> &Actor {
        &self.session.actor
    }

    fn chrome(&self) -> layout::Chrome<'_> {
        layout::Chrome { actor: &self.session.actor, csrf: &self.csrf, refresh: None }
    }
}

impl FromRequestParts<AppState> for Console {
    type Rejection = UiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, UiError> {
        // The guard put the session there; without it the route was not behind the guard.
        let session = parts.extensions.get::<Session>().cloned().ok_or(UiError::NoSession)?;
        let admin = state.admin.clone().ok_or(UiError::Unavailable)?;
        let csrf = session.csrf_token(&state.ui_sessions);
        Ok(Self { admin, session, csrf })
    }
}

/// Why a page could not be shown; each renders as a page of its own.
#[derive(Debug)]
pub(super) enum UiError {
    /// No operator role configured (`CONVEYOR_OPERATOR_DATABASE_URL`).
    Unavailable,
    /// The route is not behind the session guard (a wiring fault).
    NoSession,
    /// Nothing by that name or id.
    NotFound(String),
    /// A filter or argument that cannot be; the text says which.
    Invalid(String),
    /// The operator store failed (logged; not shown).
    Failed(AdminError),
}

impl From<AdminError> for UiError {
    fn from(e: AdminError) -> Self {
        match e {
            AdminError::Invalid(text) => Self::Invalid(text),
            e => Self::Failed(e),
        }
    }
}

impl IntoResponse for UiError {
    fn into_response(self) -> Response {
        let (status, title, text) = match self {
            Self::Unavailable => (
                StatusCode::SERVICE_UNAVAILABLE,
                "Operator role not configured",
                "This process has no operator database role: set CONVEYOR_OPERATOR_DATABASE_URL to use the operator \
                 UI."
                .to_owned(),
            ),
            Self::NoSession => {
                tracing::error!("A UI page was served without the session guard");
                (StatusCode::INTERNAL_SERVER_ERROR, "Internal error", "The page is not wired correctly.".to_owned())
            }
            Self::NotFound(what) => (StatusCode::NOT_FOUND, "Not found", what),
            Self::Invalid(text) => (StatusCode::BAD_REQUEST, "Invalid request", text),
            Self::Failed(e @ AdminError::Unaudited(_)) => {
                tracing::error!(error = ?e, "Operator UI change refused: its intent could not be audited");
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "Not changed",
                    "The audit trail could not record the change, so it was not made; the server's log has the cause."
                        .to_owned(),
                )
            }
            Self::Failed(e) => {
                tracing::error!(error = ?e, "Operator UI call failed");
                let unreachable = e.is_unavailable() || matches!(&e, AdminError::Redis(_));
                let status =
                    if unreachable { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::INTERNAL_SERVER_ERROR };
                (status, "Operator store failed", "The call failed; the server's log has the cause.".to_owned())
            }
        };
        (status, layout::message_page(title, &text)).into_response()
    }
}
