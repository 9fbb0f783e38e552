//! The console's web UI: server-rendered HTML (maud, escaped by construction), plain links and forms, no
//! JavaScript. It calls [`crate::Admin`] exactly as the JSON API does.
//!
//! [`guard`] holds the rules every page obeys: an [`super::Operator`] or a redirect to the host's login, origin and
//! CSRF checks on every POST, security headers on every response, and the mount prefix every link is built on.

mod charts;
mod consumers;
mod dead_letters;
mod fairness;
mod guard;
mod jobs;
mod layout;
mod operations;
mod overview;
mod queues;
mod schedules;

use std::sync::Arc;

use axum::Router;
use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{StatusCode, header};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

use self::guard::Base;
pub use self::guard::security_headers;
use super::{Operator, Settings};
use crate::{Actor, Admin, AdminError};

/// The stylesheet, embedded in the binary.
const CSS: &str = include_str!("ui.css");

type State = Arc<Settings>;

/// The UI's routes, the overview at `/`.
pub(super) fn router<S: Clone + Send + Sync + 'static>(settings: State) -> Router<S> {
    let pages = Router::new()
        .route("/", get(overview::show))
        .route("/pauses", post(overview::pause))
        .route("/pauses/resume", post(overview::resume))
        .route("/queues/{name}", get(queues::show))
        .route("/consumers", get(consumers::list))
        .route("/queues/{name}/pause", post(queues::pause))
        .route("/queues/{name}/resume", post(queues::resume))
        .route("/queues/{name}/drain", post(queues::drain))
        .route("/queues/{name}/clean", post(queues::clean))
        .route("/queues/{name}/obliterate", post(queues::obliterate))
        .route("/jobs", get(jobs::search))
        .route("/jobs/{id}", get(jobs::show))
        .route("/jobs/{id}/cancel", post(jobs::cancel))
        .route("/jobs/{id}/retry", post(jobs::retry))
        .route("/jobs/{id}/change", post(jobs::change))
        .route("/dead-letters", get(dead_letters::list))
        .route("/dead-letters/confirm", get(dead_letters::confirm))
        .route("/dead-letters/replay", post(dead_letters::replay_matching))
        .route("/dead-letters/discard", post(dead_letters::discard_matching))
        .route("/dead-letters/{id}/replay", post(dead_letters::replay))
        .route("/dead-letters/{id}/discard", post(dead_letters::discard))
        .route("/operations", get(operations::search))
        .route("/schedules", get(schedules::list))
        .route("/schedules/pause", post(schedules::pause))
        .route("/schedules/resume", post(schedules::resume))
        .route("/fairness", get(fairness::show))
        .route("/weights", post(fairness::weigh))
        .route("/limits", post(fairness::set))
        .route("/limits/remove", post(fairness::remove))
        .route("/key-limits", post(fairness::set_key))
        .route("/key-limits/remove", post(fairness::remove_key))
        .route("/kind-limits", post(fairness::set_kind))
        .route("/kind-limits/remove", post(fairness::remove_kind))
        .route_layer(middleware::from_fn_with_state(settings.clone(), guard::require_operator));
    Router::new()
        .route("/static/ui.css", get(stylesheet))
        .merge(pages)
        .fallback(|| async { UiError::NotFound("No such page.".to_owned()) })
        .layer(middleware::from_fn_with_state(settings.clone(), guard::frame))
        .with_state(settings)
}

async fn stylesheet() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/css; charset=utf-8"), (header::CACHE_CONTROL, "max-age=3600")], CSS)
}

/// What a signed-in page has: the operator module, who acts, the CSRF token for its forms (empty when none is
/// needed) and the prefix its links start with.
pub(super) struct Page {
    admin: Admin,
    operator: Operator,
    csrf: String,
    base: Base,
    logout: Option<String>,
    /// The link to a trace, `{trace_id}` in it standing for the trace's id ([`super::Console::trace_url`]).
    trace_url: Option<String>,
    /// [`super::Console::stalled_after`].
    stalled_after: std::time::Duration,
}

impl Page {
    fn actor(&self) -> &Actor {
        &self.operator.actor
    }

    /// The console's own `path` (`/jobs`) under the prefix it is mounted at.
    fn at(&self, path: &str) -> String {
        self.base.at(path)
    }

    fn chrome(&self) -> layout::Chrome<'_> {
        layout::Chrome {
            actor: &self.operator.actor,
            csrf: &self.csrf,
            base: &self.base,
            logout: self.logout.as_deref(),
            refresh: None,
        }
    }
}

impl FromRequestParts<State> for Page {
    type Rejection = UiError;

    async fn from_request_parts(parts: &mut Parts, settings: &State) -> Result<Self, UiError> {
        // The guard let the request through with an operator; without one the route was not behind the guard.
        let operator = parts.extensions.get::<Operator>().cloned().ok_or(UiError::NoOperator)?;
        let base = parts.extensions.get::<Base>().cloned().ok_or(UiError::NoOperator)?;
        let admin = settings.admin.clone().ok_or_else(|| UiError::Unavailable(settings.unavailable.clone()))?;
        let csrf = operator.csrf.clone().unwrap_or_default();
        let (logout, trace_url) = (settings.logout.clone(), settings.trace_url.clone());
        Ok(Self { admin, operator, csrf, base, logout, trace_url, stalled_after: settings.stalled_after })
    }
}

/// Why a page could not be shown; each renders as a page of its own (by [`guard::frame`], which knows the prefix).
#[derive(Debug)]
pub(super) enum UiError {
    /// The host has no operator role; the text says what to configure.
    Unavailable(String),
    /// The route is not behind the guard (a wiring fault).
    NoOperator,
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

/// A page with only a message, for [`guard::frame`] to render around the prefix it knows.
#[derive(Clone, Debug)]
pub(super) struct Message {
    title: &'static str,
    text: String,
}

impl Message {
    /// A response of `status` whose body is the message page of `title` and `text`.
    pub(super) fn response(status: StatusCode, title: &'static str, text: impl Into<String>) -> Response {
        let mut response = status.into_response();
        response.extensions_mut().insert(Self { title, text: text.into() });
        response
    }
}

impl IntoResponse for UiError {
    fn into_response(self) -> Response {
        let (status, title, text) = match self {
            Self::Unavailable(reason) => (StatusCode::SERVICE_UNAVAILABLE, "Operator role not configured", reason),
            Self::NoOperator => {
                tracing::error!("A console page was served without its guard");
                (StatusCode::INTERNAL_SERVER_ERROR, "Internal error", "The page is not wired correctly.".to_owned())
            }
            Self::NotFound(what) => (StatusCode::NOT_FOUND, "Not found", what),
            Self::Invalid(text) => (StatusCode::BAD_REQUEST, "Invalid request", text),
            Self::Failed(e @ AdminError::Unaudited(_)) => {
                tracing::error!(error = ?e, "Console change refused: its intent could not be audited");
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "Not changed",
                    "The audit trail could not record the change, so it was not made; the server's log has the cause."
                        .to_owned(),
                )
            }
            Self::Failed(e) => {
                tracing::error!(error = ?e, "Console call failed");
                let unreachable = e.is_unavailable() || matches!(&e, AdminError::Redis(_));
                let status =
                    if unreachable { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::INTERNAL_SERVER_ERROR };
                (status, "Operator store failed", "The call failed; the server's log has the cause.".to_owned())
            }
        };
        Message::response(status, title, text)
    }
}
