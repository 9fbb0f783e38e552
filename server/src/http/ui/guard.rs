//! The rules every UI page obeys: a page needs a valid session (else a redirect to the login), a POST must come from
//! the UI's own origin and carry the session's CSRF token (else 403, and nothing changes), and every response carries
//! the security headers.

use axum::body::{Body, to_bytes};
use axum::extract::{Request, State};
use axum::http::header::{
    CACHE_CONTROL, CONTENT_SECURITY_POLICY, HOST, ORIGIN, REFERRER_POLICY, X_CONTENT_TYPE_OPTIONS, X_FRAME_OPTIONS,
};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};

use super::layout;
use super::session::session_from_cookie;
use crate::http::AppState;

/// No script at all, styles from the UI itself, forms posting only to it, never framed.
const CSP: &str = "default-src 'self'; script-src 'none'; style-src 'self'; img-src 'self' data:; object-src 'none'; \
                   form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

/// Largest form body a UI POST may carry.
const MAX_FORM_BYTES: usize = 64 * 1024;

/// The name of the CSRF field of every form.
pub(super) const CSRF_FIELD: &str = "csrf";

/// Adds the security headers to every UI response (and `Cache-Control: no-store` unless the handler set its own).
pub(super) async fn security_headers(req: Request, next: Next) -> Response {
    let mut response = next.run(req).await;
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

/// Lets a request through with its [`super::session::Session`] in the extensions, or redirects to the login (no
/// valid session), or refuses a POST that is cross-site or lacks the session's CSRF token.
pub(super) async fn require_session(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let Some(session) = session_from_cookie(&state, req.headers()) else {
        return Redirect::to(&login_url(&req)).into_response();
    };
    let req = if req.method() == Method::GET || req.method() == Method::HEAD {
        req
    } else {
        if let Err(why) = same_origin(req.headers()) {
            return forbidden(why);
        }
        let (parts, body) = req.into_parts();
        let Ok(bytes) = to_bytes(body, MAX_FORM_BYTES).await else {
            return (StatusCode::PAYLOAD_TOO_LARGE, layout::message_page("Form too large", "The form is too large."))
                .into_response();
        };
        let token = url::form_urlencoded::parse(&bytes).find(|(k, _)| k == CSRF_FIELD).map(|(_, v)| v.into_owned());
        if !token.is_some_and(|t| session.csrf_matches(&state.ui_sessions, &t)) {
            return forbidden("The form's CSRF token is missing or wrong. Reload the page and try again.");
        }
        Request::from_parts(parts, Body::from(bytes))
    };
    let mut req = req;
    req.extensions_mut().insert(session);
    next.run(req).await
}

fn forbidden(why: &str) -> Response {
    tracing::warn!(reason = why, "Operator UI refused a form");
    (StatusCode::FORBIDDEN, layout::message_page("Refused", why)).into_response()
}

/// The login page, returning to this page afterwards when it is one to return to (a GET of a UI page).
fn login_url(req: &Request) -> String {
    let target = req.uri().path_and_query().map(|p| p.as_str()).unwrap_or("/ui/");
    if req.method() == Method::GET && safe_next(target) && target != "/ui/" {
        layout::url_with("/ui/login", &[("next", Some(target))])
    } else {
        "/ui/login".to_owned()
    }
}

/// Whether `next` is a UI path to send the browser to after login (never another site: no `//`, no scheme).
pub(super) fn safe_next(next: &str) -> bool {
    next.starts_with("/ui/") && !next.contains("//") && !next.contains('\\') && !next.chars().any(char::is_control)
}

/// Refuses a request that a browser marks as coming from another site: `Sec-Fetch-Site` other than `same-origin`, or
/// an `Origin` whose host differs from the request's `Host` (or `X-Forwarded-Host`, behind a proxy). Either header
/// may be absent (older browsers, scripts); the CSRF token still has to match.
pub(super) fn same_origin(headers: &HeaderMap) -> Result<(), &'static str> {
    if headers.get("sec-fetch-site").is_some_and(|site| site.as_bytes() != b"same-origin") {
        return Err("The form was sent from another site.");
    }
    let Some(origin) = headers.get(ORIGIN) else { return Ok(()) };
    let origin_host = origin.to_str().ok().and_then(|o| o.split_once("://")).map(|(_, host)| host);
    let Some(origin_host) = origin_host else { return Err("The form's Origin is not this site.") };
    let matches = |name| {
        headers
            .get(name)
            .and_then(|v: &HeaderValue| v.to_str().ok())
            .is_some_and(|host| host.split(',').next().is_some_and(|h| h.trim().eq_ignore_ascii_case(origin_host)))
    };
    if matches(HOST.as_str()) || matches("x-forwarded-host") {
        Ok(())
    } else {
        Err("The form's Origin is not this site.")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            headers.append(*name, HeaderValue::from_str(value).unwrap());
        }
        headers
    }

    #[test]
    fn only_same_origin_posts_pass_the_origin_check() {
        assert!(same_origin(&headers(&[("host", "127.0.0.1:9000")])).is_ok());
        assert!(same_origin(&headers(&[("host", "127.0.0.1:9000"), ("origin", "http://127.0.0.1:9000")])).is_ok());
        assert!(same_origin(&headers(&[("host", "a.example"), ("sec-fetch-site", "same-origin")])).is_ok());
        assert!(
            same_origin(&headers(&[
                ("host", "internal:9000"),
                ("x-forwarded-host", "ops.example"),
                ("origin", "https://ops.example")
            ]))
            .is_ok()
        );
        assert!(same_origin(&headers(&[("host", "127.0.0.1:9000"), ("origin", "http://evil.example")])).is_err());
        assert!(same_origin(&headers(&[("host", "127.0.0.1:9000"), ("origin", "null")])).is_err());
        assert!(same_origin(&headers(&[("host", "127.0.0.1:9000"), ("origin", "http://127.0.0.1:9001")])).is_err());
        assert!(same_origin(&headers(&[("host", "a.example"), ("sec-fetch-site", "cross-site")])).is_err());
        assert!(same_origin(&headers(&[("host", "a.example"), ("sec-fetch-site", "same-site")])).is_err());
    }

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
