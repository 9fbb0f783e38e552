//! The rules every UI page obeys: a page needs an [`Operator`] (else the host's login, or a 401 page), a POST must
//! come from the console's own origin and carry the operator's CSRF token when it has one (else 403, and nothing
//! changes), every response carries the security headers, and every link starts with the prefix the console is
//! mounted under.

use std::sync::Arc;

use axum::body::{Body, to_bytes};
use axum::extract::{OriginalUri, Request, State};
use axum::http::header::{
    CACHE_CONTROL, CONTENT_SECURITY_POLICY, CONTENT_TYPE, REFERRER_POLICY, X_CONTENT_TYPE_OPTIONS, X_FRAME_OPTIONS,
};
use axum::http::{HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};

use super::{Message, State as Settings, layout};
use crate::console::{CSRF_FIELD, Operator, mount_prefix, same_origin};

/// No script at all, styles from the UI itself, forms posting only to it, never framed.
const CSP: &str = "default-src 'self'; script-src 'none'; style-src 'self'; img-src 'self' data:; object-src 'none'; \
                   form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

/// Largest form body a UI POST may carry.
const MAX_FORM_BYTES: usize = 64 * 1024;

/// The prefix the console is mounted under (`/ops/jobs`, or empty at the root), which every link starts with.
#[derive(Clone, Debug)]
pub(super) struct Base(Arc<str>);

impl Base {
    /// The console's own `path` (`/jobs`; `/` or `/?query` for the overview) under the prefix. The overview under a
    /// prefix is the prefix itself (`/ops/jobs`): axum's `nest("/ops/jobs", ...)` routes that, not `/ops/jobs/`.
    pub(super) fn at(&self, path: &str) -> String {
        debug_assert!(path.starts_with('/'), "a console path starts with /: {path}");
        match path.strip_prefix('/') {
            Some(rest) if !self.0.is_empty() && (rest.is_empty() || rest.starts_with('?')) => {
                format!("{}{rest}", self.0)
            }
            _ => format!("{}{path}", self.0),
        }
    }
}

/// Around every UI response: finds the mount prefix for the handlers, renders a [`Message`] a handler answered with
/// as a page, and adds the security headers ([`security_headers`]).
pub(super) async fn frame(mut req: Request, next: Next) -> Response {
    let original = req.extensions().get::<OriginalUri>().map(|uri| uri.path().to_owned());
    let base = Base(mount_prefix(original.as_deref().unwrap_or(req.uri().path()), req.uri().path()).into());
    req.extensions_mut().insert(base.clone());
    let mut response = next.run(req).await;
    if let Some(message) = response.extensions_mut().remove::<Message>() {
        let (parts, _) = response.into_parts();
        let page = layout::message_page(&base, message.title, &message.text).into_string();
        response = Response::from_parts(parts, Body::from(page));
        response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("text/html; charset=utf-8"));
    }
    with_security_headers(response)
}

/// Adds the console's security headers to every response (a middleware for `axum::middleware::from_fn`): a content
/// security policy that allows no script and forms posting only to the same origin, no framing, no sniffing, no
/// referrer to other sites, and `Cache-Control: no-store` unless the handler set its own. A host's own operator
/// pages (its login) should carry them too.
pub async fn security_headers(req: Request, next: Next) -> Response {
    with_security_headers(next.run(req).await)
}

fn with_security_headers(mut response: Response) -> Response {
    let headers = response.headers_mut();
    headers.insert(CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    headers.insert(X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(REFERRER_POLICY, HeaderValue::from_static("same-origin"));
    headers.insert(X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    if !headers.contains_key(CACHE_CONTROL) {
        headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    }
    response
}

/// Lets a request through when the host's layer put an [`Operator`] in it, or sends it to the host's login (a 401
/// page without one), and refuses a POST that is cross-site or lacks the operator's CSRF token.
pub(super) async fn require_operator(State(settings): State<Settings>, req: Request, next: Next) -> Response {
    let Some(operator) = req.extensions().get::<Operator>().cloned() else {
        return match &settings.login {
            Some(login) => Redirect::to(&login_url(login, &req)).into_response(),
            None => Message::response(StatusCode::UNAUTHORIZED, "Not signed in", "This page needs an operator."),
        };
    };
    if req.method() == Method::GET || req.method() == Method::HEAD {
        return next.run(req).await;
    }
    if let Err(why) = same_origin(req.headers(), req.uri().authority().map(|a| a.as_str())) {
        return forbidden(why);
    }
    let (parts, body) = req.into_parts();
    let Ok(bytes) = to_bytes(body, MAX_FORM_BYTES).await else {
        return Message::response(StatusCode::PAYLOAD_TOO_LARGE, "Form too large", "The form is too large.");
    };
    let token = url::form_urlencoded::parse(&bytes).find(|(k, _)| k == CSRF_FIELD).map(|(_, v)| v.into_owned());
    if !operator.csrf_allows(token.as_deref()) {
        return forbidden("The form's CSRF token is missing or wrong. Reload the page and try again.");
    }
    next.run(Request::from_parts(parts, Body::from(bytes))).await
}

fn forbidden(why: &'static str) -> Response {
    tracing::warn!(reason = why, "Console refused a form");
    Message::response(StatusCode::FORBIDDEN, "Refused", why)
}

/// The host's login page, told to return to this page afterwards when it is one to return to (a GET of a page other
/// than the overview).
fn login_url(login: &str, req: &Request) -> String {
    let seen = req.uri().path();
    let original = req.extensions().get::<OriginalUri>().map(|uri| &uri.0).unwrap_or(req.uri());
    match original.path_and_query() {
        Some(target) if req.method() == Method::GET && seen != "/" => {
            layout::append(login, &[("next", Some(target.as_str()))])
        }
        _ => login.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_start_with_the_prefix_and_the_overview_is_the_prefix_itself() {
        let nested = Base("/ops/jobs".into());
        assert_eq!(nested.at("/"), "/ops/jobs");
        assert_eq!(nested.at("/?refresh=5"), "/ops/jobs?refresh=5");
        assert_eq!(nested.at("/jobs/1"), "/ops/jobs/jobs/1");
        let root = Base("".into());
        assert_eq!(root.at("/"), "/");
        assert_eq!(root.at("/?refresh=5"), "/?refresh=5");
        assert_eq!(root.at("/jobs"), "/jobs");
    }
}
