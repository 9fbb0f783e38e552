//! Logging in with the operator token or an operator JWT, and out.

use axum::Form;
use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::header::{LOCATION, SET_COOKIE};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use maud::{DOCTYPE, Markup, html};
use serde::Deserialize;

use super::session::{self, Session};
use crate::http::AppState;
use conveyor_jobs::console::{CSRF_FIELD, check_same_origin};

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
    if let Err(why) = check_same_origin(&headers) {
        return (StatusCode::FORBIDDEN, page("Refused", html! { div.notice.bad role="alert" { (why) } }))
            .into_response();
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

/// `POST /ui/logout`: clears the cookie, when the form comes from the UI with the session's CSRF token (another site
/// must not be able to log an operator out either).
pub(super) async fn logout(State(state): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    let token = url::form_urlencoded::parse(&body).find(|(k, _)| k == CSRF_FIELD).map(|(_, v)| v.into_owned());
    let session = session::session_from_cookie(&state, &headers);
    let refused = match &session {
        _ if check_same_origin(&headers).is_err() => true,
        Some(session) => !token.is_some_and(|t| session.csrf_matches(&state.ui_sessions, &t)),
        None => false,
    };
    if refused {
        let why = html! { div.notice.bad role="alert" { "The logout form is not this session's. Reload the page." } };
        return (StatusCode::FORBIDDEN, page("Refused", why)).into_response();
    }
    let mut response = see_other("/ui/login");
    if let Ok(value) = session::clear_cookie(&headers).parse() {
        response.headers_mut().insert(SET_COOKIE, value);
    }
    response
}

fn target(next: Option<&str>) -> String {
    next.filter(|n| safe_next(n)).unwrap_or("/ui").to_owned()
}

fn see_other(location: &str) -> Response {
    (StatusCode::SEE_OTHER, [(LOCATION, location.to_owned())]).into_response()
}

/// Whether `next` is a UI path to send the browser to after login (never another site: no `//`, no scheme).
pub(super) fn safe_next(next: &str) -> bool {
    next.starts_with("/ui/") && !next.contains("//") && !next.contains('\\') && !next.chars().any(char::is_control)
}

/// A page of the login's own, in the console's look (its stylesheet is the console's).
fn page(title: &str, content: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · Conveyor" }
                link rel="stylesheet" href="/ui/static/ui.css";
            }
            body {
                header { span.brand { "Conveyor" } }
                main.login { div.card { h1 { (title) } (content) } }
            }
        }
    }
}

fn login_page(state: &AppState, next: Option<&str>, error: Option<&str>) -> Markup {
    let next = next.filter(|n| safe_next(n));
    page(
        "Operator log in",
        html! {
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
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_ui_paths_are_followed_after_login() {
        assert!(safe_next("/ui/jobs/123?x=1"));
        for bad in
            ["//evil.example/ui/", "https://evil.example", "/ui//evil", "/admin/v1/queues", "/ui/\\evil", "/ui/\n"]
        {
            assert!(!safe_next(bad), "{bad:?}");
        }
    }
}
