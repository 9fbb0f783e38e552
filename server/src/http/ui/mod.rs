//! The operator web UI at `/ui` on the admin listener, and who may use it and the admin API.
//!
//! The pages and the JSON API are the platform's [`Console`], mounted at `/ui` and `/admin/v1`. This module is the
//! server's authentication around them:
//!
//! ```text
//! GET  /ui/login, POST /ui/login    the operator token or an operator JWT → a signed session cookie
//! POST /ui/logout                   clears it (a form carrying the session's CSRF token)
//! /ui/..., /admin/v1/...            the console, as the operator of the request's bearer credential or session
//! ```
//!
//! [`attach_operator`] gives the console its [`Operator`]: `Authorization: Bearer` with the operator token or an
//! operator JWT, else the session cookie (with the session's CSRF token, which every change must then carry).

mod login;
pub mod session;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, header};
use axum::middleware::{self, Next};
use axum::response::{Redirect, Response};
use axum::routing::get;

use super::AppState;
use conveyor_jobs::console::{self, Console, Operator};

/// What the console says when the process has no operator role.
const NOT_CONFIGURED: &str = "set CONVEYOR_OPERATOR_DATABASE_URL (the operator role's connection) to use the \
                              operator UI and the admin API";

/// The UI at `/ui`, the admin API at `/admin/v1` and the login around them, to merge into the admin router.
pub fn router(state: &AppState) -> Router<AppState> {
    let mut console = match &state.admin {
        Some(admin) => Console::new(admin.clone()),
        None => Console::unavailable(NOT_CONFIGURED),
    }
    .login_path("/ui/login")
    .logout_path("/ui/logout")
    .stalled_after(state.worker_visibility)
    .end_streams_on(state.streams.clone());
    if let Some(url) = &state.trace_url {
        console =
            console.trace_url(url.clone()).expect("CONVEYOR_TRACE_URL was checked when the configuration was read");
    }
    let login = Router::new()
        // The overview is `/ui` (what `nest` routes); `/ui/`, its address before, leads there.
        .route("/ui/", get(|uri: axum::http::Uri| async move { Redirect::permanent(&slashless(&uri)) }))
        .route("/ui/login", get(login::form).post(login::submit))
        .route("/ui/logout", axum::routing::post(login::logout))
        .layer(middleware::from_fn(console::security_headers));
    login
        .nest("/ui", console.ui())
        .nest("/admin/v1", console.api())
        .layer(middleware::from_fn_with_state(state.clone(), attach_operator))
}

/// `/ui/?query` as `/ui?query`: the overview's address, the query kept (`?refresh=5`).
fn slashless(uri: &axum::http::Uri) -> String {
    match uri.query() {
        Some(query) => format!("/ui?{query}"),
        None => "/ui".to_owned(),
    }
}

/// Puts the request's [`Operator`] in its extensions when it has one: by its bearer credential (a wrong one is no
/// operator, whatever cookie comes with it), else by the UI's session cookie.
async fn attach_operator(State(state): State<AppState>, mut req: Request, next: Next) -> Response {
    if let Some(operator) = operator_of(&state, req.headers()) {
        req.extensions_mut().insert(operator);
    }
    next.run(req).await
}

fn operator_of(state: &AppState, headers: &HeaderMap) -> Option<Operator> {
    if let Some(credential) = bearer(headers) {
        return match state.operator_auth.verify(credential) {
            Ok(actor) => Some(Operator::bearer(actor)),
            Err(e) => {
                tracing::debug!(reason = %e, "Admin credential refused");
                None
            }
        };
    }
    let session = session::session_from_cookie(state, headers)?;
    let csrf = session.csrf_token(&state.ui_sessions);
    Some(Operator::session(session.actor, csrf))
}

/// The bearer credential of `headers`, if any.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, credential) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| credential.trim()).filter(|c| !c.is_empty())
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;

    use super::*;

    #[test]
    fn only_a_bearer_scheme_with_a_credential_is_read() {
        let with = |value: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(header::AUTHORIZATION, HeaderValue::from_str(value).unwrap());
            bearer(&headers).map(str::to_owned)
        };
        assert_eq!(with("Bearer abc").as_deref(), Some("abc"));
        assert_eq!(with("bearer  abc ").as_deref(), Some("abc"));
        assert_eq!(with("Basic abc"), None);
        assert_eq!(with("Bearer "), None);
        assert_eq!(with("Bearer"), None);
        assert_eq!(bearer(&HeaderMap::new()), None);
    }
}
