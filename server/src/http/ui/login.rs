//! Logging in with the operator token or an operator JWT, and out.

use axum::Form;
use axum::extract::{Query, State};
use axum::http::header::{LOCATION, SET_COOKIE};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use maud::{Markup, html};
use serde::Deserialize;

use super::guard::{safe_next, same_origin};
use super::layout;
use super::session::{self, Session};
use crate::http::AppState;

/// Where to go after logging in.
#[derive(Deserialize)]
pub(super) struct Next {
    next: Option<String>,
}

/// What the login form sends.
#[derive(Deserialize)]
pub(super) struct Credentials {
    #[serde(default)]
    credential: String,
    next: Option<String>,
}

/// `GET /ui/login`: the form (straight to the overview when already signed in).
pub(super) async fn form(State(state): State<AppState>, headers: HeaderMap, Query(next): Query<Next>) -> Response {
    if session::session_from_cookie(&state, &headers).is_some() {
        return see_other(&target(next.next.as_deref()));
    }
    login_page(&state, next.next.as_deref(), None).into_response()
}

/// `POST /ui/login`: a valid operator credential sets the session cookie; anything else shows the form again (401).
pub(super) async fn submit(
    State(state): State<AppState>,
    headers: HeaderMap,
    Form(form): Form<Credentials>,
) -> Response {
    if let Err(why) = same_origin(&headers) {
        return (StatusCode::FORBIDDEN, layout::message_page("Refused", why)).into_response();
    }
    let verified = state.operator_auth.verify_with_expiry(form.credential.trim()).ok();
    // A session lasts no longer than its credential: an operator JWT's expiry bounds it.
    match verified.and_then(|(actor, expiry)| Session::start(actor, expiry)) {
        Some(session) => {
            tracing::info!(actor = %session.actor.0, expires_at = session.expires_at, "Operator signed in to the UI");
            let cookie = session::set_cookie(&state.ui_sessions, &session, &headers);
            let mut response = see_other(&target(form.next.as_deref()));
            if let Ok(value) = cookie.parse() {
                response.headers_mut().insert(SET_COOKIE, value);
            }
            response
        }
        None => {
            tracing::warn!("Operator UI login refused");
            let error = "That is neither the operator token nor an operator JWT.";
            (StatusCode::UNAUTHORIZED, login_page(&state, form.next.as_deref(), Some(error))).into_response()
        }
    }
}

/// `POST /ui/logout` (behind the guard: CSRF-checked): clears the cookie.
pub(super) async fn logout(headers: HeaderMap) -> Response {
    let mut response = see_other("/ui/login");
    if let Ok(value) = session::clear_cookie(&headers).parse() {
        response.headers_mut().insert(SET_COOKIE, value);
    }
    response
}

fn target(next: Option<&str>) -> String {
    next.filter(|n| safe_next(n)).unwrap_or("/ui/").to_owned()
}

fn see_other(location: &str) -> Response {
    (StatusCode::SEE_OTHER, [(LOCATION, location.to_owned())]).into_response()
}

fn login_page(state: &AppState, next: Option<&str>, error: Option<&str>) -> Markup {
    let next = next.filter(|n| safe_next(n));
    layout::frame(
        "Log in",
        html! {},
        html! {
            header { span.brand { "Conveyor" } }
            main.login {
                div.card {
                    h1 { "Operator log in" }
                    @if state.admin.is_none() {
                        div.notice.bad { "The operator role is not configured (CONVEYOR_OPERATOR_DATABASE_URL): \
                                           pages will answer 503." }
                    }
                    @if let Some(error) = error { div.notice.bad role="alert" { (error) } }
                    form method="post" action="/ui/login" {
                        label for="credential" { "Operator token or operator JWT" }
                        input #credential type="password" name="credential" autocomplete="current-password" required autofocus;
                        @if let Some(next) = next { input type="hidden" name="next" value=(next); }
                        button.primary type="submit" { "Log in" }
                    }
                    p.muted { "The session lasts 8 hours, or until the JWT you log in with expires if sooner; it \
                               names you, never the credential." }
                }
            }
        },
    )
}
