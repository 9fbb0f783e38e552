//! The operator console (feature `console`): the web UI and the JSON API over [`Admin`], as an axum [`Router`] a
//! host mounts under any prefix, behind its own authentication.
//!
//! The console does not log anyone in. The host's layer authenticates the request its own way (a session cookie,
//! a bearer token, a proxy's header) and inserts an [`Operator`] into the request's extensions; the console acts as
//! that operator, and every change it makes is audited under the operator's [`Actor`]. A request without an
//! `Operator` gets a 401 (the API), or is sent to the host's login page ([`Console::login_path`]) or shown a 401
//! page (the UI).
//!
//! ```no_run
//! # async fn host(admin: conveyor_jobs::Admin) {
//! use axum::extract::Request;
//! use axum::middleware::{self, Next};
//! use conveyor_jobs::Actor;
//! use conveyor_jobs::console::{Console, Operator};
//!
//! /// The host's own authentication: here, an operator token the caller sends in `Authorization` (a script, a CLI).
//! async fn authenticate(mut req: Request, next: Next) -> axum::response::Response {
//!     let bearer = req.headers().get("authorization").and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
//!     if let Some(user) = bearer.and_then(verify_operator_token) {
//!         req.extensions_mut().insert(Operator::bearer(Actor(user)));
//!     }
//!     next.run(req).await
//! }
//! # fn verify_operator_token(_: &str) -> Option<String> { None }
//!
//! let app: axum::Router = axum::Router::new()
//!     .nest("/ops/jobs", Console::new(admin).router())
//!     .layer(middleware::from_fn(authenticate));
//! # let _ = app;
//! # }
//! ```
//!
//! Links, form actions and redirects follow the prefix the router is mounted under (read from the request, so
//! `nest("/ops/jobs", ...)` needs nothing more). Every change the UI makes is a form POST that must come from the
//! console's own origin and, for an operator authenticated by something the browser sends on its own (a cookie),
//! carry the CSRF token the host gave with the [`Operator`]. The API takes that token in [`CSRF_HEADER`].
//!
//! ```text
//! UI (Console::ui, or / of Console::router)
//! GET  /                          queues (counts by state, lag, throughput, oldest age), pauses
//! GET  /queues/{name}             one queue's counts and jobs, pause / resume
//! GET  /jobs, /jobs/{id}          job search; one job with its attempts and payload, cancel / retry
//! GET  /dead-letters              filter by queue, kind, workspace; replay / discard one or all matching
//! GET  /operations, /schedules    operation search; schedules with pause / resume
//! GET  /static/ui.css             the stylesheet (no script anywhere)
//!
//! JSON API (Console::api, or /api/v1 of Console::router)
//! GET    /queues, /queues/{name}, /jobs, /jobs/{id}, /operations, /dead-letters, /pauses, /schedules, /audit
//! POST   /jobs/{id}/cancel, /jobs/{id}/retry, /dead-letters/{id}/replay, /dead-letters/replay, /dead-letters/discard,
//!        /pauses, /schedules/{workspace}/{name}/pause, /schedules/{workspace}/{name}/resume
//! DELETE /dead-letters/{id}, /pauses
//! ```

mod api;
mod ui;

use std::sync::Arc;

use axum::Router;
use axum::http::{HeaderMap, HeaderValue, header};

use crate::{Actor, Admin};

pub use ui::security_headers;

/// The request header that carries the CSRF token on a state-changing API call by an operator whose
/// [`Operator::csrf`] is set.
pub const CSRF_HEADER: &str = "x-csrf-token";

/// The form field that carries the CSRF token on every UI form.
pub const CSRF_FIELD: &str = "csrf";

/// Who is calling, as the host's authentication layer established it: insert one into the request's extensions
/// (`req.extensions_mut().insert(operator)`) before the console's router sees the request.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Operator {
    /// Who acts, as the audit trail records it.
    pub actor: Actor,
    /// The token a state-changing request must carry (the UI's forms carry it on their own), when the operator was
    /// authenticated by a credential the browser attaches by itself: a cookie, including the session cookie of an
    /// authenticating proxy (oauth2-proxy, IAP) whose header the host reads. `None` only when the request carries
    /// its own credential (an `Authorization` bearer token, a client certificate), which no other site can make a
    /// browser send. Whatever it is, every change must also come from the console's own origin.
    pub csrf: Option<String>,
}

impl Operator {
    /// An operator authenticated by a credential the request carries itself (`Authorization: Bearer`, a client
    /// certificate): no CSRF token is needed. Not for a proxy's header set from the proxy's own cookie: that is
    /// [`Operator::session`], with a token.
    pub fn bearer(actor: Actor) -> Self {
        Self { actor, csrf: None }
    }

    /// An operator authenticated by a session cookie, with the session's CSRF token (an unguessable value bound to
    /// the session, e.g. an HMAC of its id): every change must carry it. An empty token matches nothing: every change
    /// is refused.
    pub fn session(actor: Actor, csrf: impl Into<String>) -> Self {
        Self { actor, csrf: Some(csrf.into()) }
    }

    /// Whether `token` is this operator's CSRF token, or none is needed (compared in constant time).
    fn csrf_allows(&self, token: Option<&str>) -> bool {
        match (&self.csrf, token) {
            (None, _) => true,
            (Some(expected), Some(token)) => {
                !expected.is_empty() && constant_time_eq(expected.as_bytes(), token.as_bytes())
            }
            (Some(_), None) => false,
        }
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The operator console: build one per [`Admin`], set the host's login and logout paths if it has them, and mount
/// [`Console::router`] (or [`Console::ui`] and [`Console::api`] apart) where the host wants it.
#[derive(Clone)]
pub struct Console {
    settings: Arc<Settings>,
}

/// What every handler of the console shares.
struct Settings {
    /// `None`: the host has no operator role, and every authenticated request is answered 503 with `unavailable`.
    admin: Option<Admin>,
    unavailable: String,
    login: Option<String>,
    logout: Option<String>,
    trace_url: Option<String>,
    /// A consumer idle this long while it holds entries is shown stalled ([`Console::stalled_after`]).
    stalled_after: std::time::Duration,
    /// The event streams followed at once ([`api::FOLLOWERS`]).
    followers: std::sync::Arc<tokio::sync::Semaphore>,
    /// Ends every followed event stream ([`Console::end_streams_on`]).
    streams: tokio_util::sync::CancellationToken,
}

impl Console {
    /// A console acting through `admin`.
    pub fn new(admin: Admin) -> Self {
        Self::with(Some(admin), String::new())
    }

    /// A console for a host that has no operator role configured: every authenticated request is answered 503
    /// (the API's code `ADMIN_NOT_CONFIGURED`) with `reason`, which should say what to configure.
    pub fn unavailable(reason: impl Into<String>) -> Self {
        Self::with(None, reason.into())
    }

    fn with(admin: Option<Admin>, unavailable: String) -> Self {
        let stalled_after = crate::WorkerSettings::default().visibility;
        let followers = std::sync::Arc::new(tokio::sync::Semaphore::new(api::FOLLOWERS));
        let streams = tokio_util::sync::CancellationToken::new();
        let (login, logout, trace_url) = (None, None, None);
        let settings = Settings { admin, unavailable, login, logout, trace_url, stalled_after, followers, streams };
        Self { settings: Arc::new(settings) }
    }

    fn settings_mut(&mut self) -> &mut Settings {
        Arc::get_mut(&mut self.settings).expect("a console is configured before its routers are built")
    }

    /// The host's login page (an absolute path, e.g. `/login`): a UI page asked for without an [`Operator`] redirects
    /// there, with the page's own path and query in `next` (a GET) so that the host can send the operator back.
    /// Without it, such a request gets a 401 page.
    pub fn login_path(mut self, path: impl Into<String>) -> Self {
        self.settings_mut().login = Some(path.into());
        self
    }

    /// The host's logout endpoint (an absolute path): the UI's header shows a "Log out" button that POSTs there,
    /// with the operator's CSRF token in the form field [`CSRF_FIELD`]. Without it, no button.
    pub fn logout_path(mut self, path: impl Into<String>) -> Self {
        self.settings_mut().logout = Some(path.into());
        self
    }

    /// Where a job's trace is seen (Jaeger, Tempo, Honeycomb …): an `http://` or `https://` URL in which `{trace_id}`
    /// stands for the trace's id (32 hex digits), e.g. `https://jaeger.example/trace/{trace_id}`. A job's page then
    /// links to the trace of the request that enqueued it; without it, the page shows the trace id alone. Refused (the
    /// reason as the error) when it is not such a URL.
    pub fn trace_url(mut self, template: impl Into<String>) -> Result<Self, String> {
        let template = template.into();
        check_trace_url(&template)?;
        self.settings_mut().trace_url = Some(template);
        Ok(self)
    }

    /// How long a consumer may be idle while it holds entries before the consumers page shows it stalled: the workers'
    /// visibility time-out ([`crate::WorkerSettings::visibility`], 5 s by default), past which another worker takes
    /// its entries over (a live worker's heartbeat touches its entries, and so its idle time, three times within it).
    pub fn stalled_after(mut self, after: std::time::Duration) -> Self {
        self.settings_mut().stalled_after = after;
        self
    }

    /// Ends the followed event streams of the admin API (`GET /workspaces/{id}/events?follow=true`) when `token` is
    /// canceled. A host's graceful shutdown waits for every connection to close, and a followed stream never ends on
    /// its own: cancel this token as the shutdown begins.
    pub fn end_streams_on(mut self, token: tokio_util::sync::CancellationToken) -> Self {
        self.settings_mut().streams = token;
        self
    }

    /// The web UI alone, its overview at `/`. It carries its own state, so it nests into a router of any state.
    pub fn ui<S: Clone + Send + Sync + 'static>(&self) -> Router<S> {
        ui::router(self.settings.clone())
    }

    /// The JSON API alone (`/queues`, `/jobs`, …): nest it under a versioned path such as `/api/v1`.
    pub fn api<S: Clone + Send + Sync + 'static>(&self) -> Router<S> {
        api::router(self.settings.clone())
    }

    /// The UI at `/` and the JSON API at `/api/v1`, in one router.
    pub fn router<S: Clone + Send + Sync + 'static>(&self) -> Router<S> {
        self.ui().nest("/api/v1", self.api())
    }
}

/// Why `template` cannot be a [`Console::trace_url`], if it cannot: for a host that reads it from its configuration
/// and says so at start.
pub fn check_trace_url(template: &str) -> Result<(), String> {
    if !(template.starts_with("http://") || template.starts_with("https://")) {
        return Err("must be an http:// or https:// URL".into());
    }
    if !template.contains("{trace_id}") {
        return Err("must hold {trace_id}, where the trace's id goes".into());
    }
    Ok(())
}

/// Refuses a request that a browser marks as coming from another site: `Sec-Fetch-Site` other than `same-origin`, or
/// an `Origin` whose host differs from the request's `Host` (or `X-Forwarded-Host`, behind a proxy). Either header
/// may be absent (older browsers, scripts). The console checks every UI form with it; a host's own login form should
/// too. The error says why, for the page that refuses.
pub fn check_same_origin(headers: &HeaderMap) -> Result<(), &'static str> {
    same_origin(headers, None)
}

/// [`check_same_origin`], also accepting an `Origin` that names `authority`, the request URI's (where HTTP/2 puts the
/// host, with no `Host` header).
pub(crate) fn same_origin(headers: &HeaderMap, authority: Option<&str>) -> Result<(), &'static str> {
    if headers.get("sec-fetch-site").is_some_and(|site| site.as_bytes() != b"same-origin") {
        return Err("The form was sent from another site.");
    }
    let Some(origin) = headers.get(header::ORIGIN) else { return Ok(()) };
    let origin_host = origin.to_str().ok().and_then(|o| o.split_once("://")).map(|(_, host)| host);
    let Some(origin_host) = origin_host else { return Err("The form's Origin is not this site.") };
    let matches = |name| {
        headers
            .get(name)
            .and_then(|v: &HeaderValue| v.to_str().ok())
            .is_some_and(|host| host.split(',').next().is_some_and(|h| h.trim().eq_ignore_ascii_case(origin_host)))
    };
    if matches(header::HOST.as_str())
        || matches("x-forwarded-host")
        || authority.is_some_and(|a| a.eq_ignore_ascii_case(origin_host))
    {
        Ok(())
    } else {
        Err("The form's Origin is not this site.")
    }
}

/// The path prefix the console is mounted under (`/ops/jobs`; empty at the root): the request's original path less
/// the path the nested router sees.
fn mount_prefix(original: &str, seen: &str) -> String {
    let prefix = match original.strip_suffix(seen) {
        Some(prefix) => prefix,
        None if seen == "/" => original,
        None => {
            // A layer of the host rewrote the path inside the router: no prefix can be told, links start at the root.
            tracing::warn!(original, seen, "The console cannot tell the prefix it is mounted under");
            ""
        }
    };
    prefix.trim_end_matches('/').to_owned()
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
        assert!(check_same_origin(&headers(&[("host", "127.0.0.1:9000")])).is_ok());
        assert!(
            check_same_origin(&headers(&[("host", "127.0.0.1:9000"), ("origin", "http://127.0.0.1:9000")])).is_ok()
        );
        assert!(check_same_origin(&headers(&[("host", "a.example"), ("sec-fetch-site", "same-origin")])).is_ok());
        assert!(
            check_same_origin(&headers(&[
                ("host", "internal:9000"),
                ("x-forwarded-host", "ops.example"),
                ("origin", "https://ops.example")
            ]))
            .is_ok()
        );
        assert!(same_origin(&headers(&[("origin", "https://ops.example")]), Some("ops.example")).is_ok(), "HTTP/2");
        for bad in [
            &[("host", "127.0.0.1:9000"), ("origin", "http://evil.example")][..],
            &[("host", "127.0.0.1:9000"), ("origin", "null")],
            &[("host", "127.0.0.1:9000"), ("origin", "http://127.0.0.1:9001")],
            &[("host", "a.example"), ("sec-fetch-site", "cross-site")],
            &[("host", "a.example"), ("sec-fetch-site", "same-site")],
        ] {
            assert!(check_same_origin(&headers(bad)).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_prefix_is_what_the_nesting_took_off() {
        assert_eq!(mount_prefix("/ops/jobs/queues/a", "/queues/a"), "/ops/jobs");
        assert_eq!(mount_prefix("/ops/jobs/", "/"), "/ops/jobs");
        assert_eq!(mount_prefix("/ops/jobs", "/"), "/ops/jobs");
        assert_eq!(mount_prefix("/jobs", "/jobs"), "");
        assert_eq!(mount_prefix("/", "/"), "");
        assert_eq!(mount_prefix("/rewritten/x", "/jobs"), "", "an original path the nested one does not end");
    }

    #[test]
    fn a_csrf_token_is_needed_only_for_an_ambient_credential() {
        let bearer = Operator::bearer(Actor("ci".into()));
        assert!(bearer.csrf_allows(None) && bearer.csrf_allows(Some("anything")));
        let session = Operator::session(Actor("alice".into()), "t0ken");
        assert!(session.csrf_allows(Some("t0ken")));
        for wrong in [None, Some(""), Some("t0ke"), Some("t0ken!"), Some("T0KEN")] {
            assert!(!session.csrf_allows(wrong), "{wrong:?}");
        }
        // A host that hands an empty token refuses every change rather than letting an empty form through.
        let empty = Operator::session(Actor("alice".into()), "");
        assert!(!empty.csrf_allows(Some("")) && !empty.csrf_allows(None));
    }
}
