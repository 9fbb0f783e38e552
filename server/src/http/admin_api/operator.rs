//! Who may call the admin API: an extractor that accepts `Authorization: Bearer <credential>` (the operator token or
//! an operator JWT, [`crate::operator_auth::OperatorAuth`]) or, as a hook for the web UI, its signed session cookie
//! ([`crate::http::ui::session`]). A workspace user's JWT carries no operator claim and is refused like any other
//! wrong credential.

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{HeaderMap, header};

use super::problem::AdminApiError;
use crate::http::AppState;
use crate::http::ui::session;
use conveyor_jobs::{Actor, Admin};

/// The header a state-changing call authenticated by the UI's session cookie carries its CSRF token in.
pub const CSRF_HEADER: &str = "x-csrf-token";

/// An authenticated operator: a handler that takes one answers 401 (with `WWW-Authenticate: Bearer`) to anyone else.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Operator(pub Actor);

/// The bearer credential of `headers`, if any.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, credential) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| credential.trim()).filter(|c| !c.is_empty())
}

/// The operator of a request, by its bearer credential, else by the web UI's session cookie. A call that changes
/// something (any method but GET and HEAD) authenticated by the cookie must also carry the session's CSRF token in
/// [`CSRF_HEADER`]: the cookie travels with any request the browser makes, the token only with the UI's own.
pub fn operator_of(state: &AppState, method: &axum::http::Method, headers: &HeaderMap) -> Result<Actor, AdminApiError> {
    if let Some(credential) = bearer(headers) {
        return state.operator_auth.verify(credential).map_err(|e| {
            tracing::debug!(reason = %e, "Admin API credential refused");
            AdminApiError::Unauthenticated
        });
    }
    // The web UI's hook: its session, as `crate::http::ui::session::actor_from_cookie` reads it, with the CSRF check
    // that accepting it for changes requires.
    let Some(session) = session::session_from_cookie(state, headers) else {
        return Err(AdminApiError::Unauthenticated);
    };
    if !method.is_safe() {
        let token = headers.get(CSRF_HEADER).and_then(|v| v.to_str().ok()).unwrap_or_default();
        if !session.csrf_matches(&state.ui_sessions, token) {
            return Err(AdminApiError::CsrfRejected);
        }
    }
    Ok(session.actor)
}

impl FromRequestParts<AppState> for Operator {
    type Rejection = AdminApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Self::Rejection> {
        operator_of(state, &parts.method, &parts.headers).map(Operator)
    }
}

/// An authenticated operator and the operator module to act with: 401 before anything else, then 503
/// `ADMIN_NOT_CONFIGURED` when the process has no operator database URL.
pub struct Operating {
    /// Who acts (for the audit trail).
    pub actor: Actor,
    /// The operator module.
    pub admin: Admin,
}

impl FromRequestParts<AppState> for Operating {
    type Rejection = AdminApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Self::Rejection> {
        let Operator(actor) = Operator::from_request_parts(parts, state).await?;
        let admin = state.admin.clone().ok_or(AdminApiError::NotConfigured)?;
        Ok(Self { actor, admin })
    }
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
