//! The console API's errors: RFC 9457 `application/problem+json` with a stable `code` (as the e-commerce API's
//! are), `WWW-Authenticate` on 401, `ADMIN_NOT_CONFIGURED`, the parameter a 400 names. 5xx answers log the cause and
//! say nothing of it.

use std::collections::BTreeMap;

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::Value;

use crate::AdminError;

/// An RFC 9457 problem document, with the stable `code` and the members that name what it is about.
#[derive(serde::Serialize)]
struct Problem {
    #[serde(rename = "type")]
    kind: &'static str,
    title: &'static str,
    status: u16,
    detail: String,
    code: &'static str,
    #[serde(flatten)]
    named: BTreeMap<&'static str, Value>,
}

/// Everything a console API call can answer besides success.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ApiError {
    /// No operator: the host's authentication found no operator credential, or one that is not.
    #[error("an operator credential is required (Authorization: Bearer <an operator's token>)")]
    Unauthenticated,
    /// A state-changing call by an operator with a CSRF token, without it.
    #[error("this call needs the session's CSRF token in the X-CSRF-Token header")]
    CsrfRejected,
    /// A change sent by a browser from another site (`Origin`, `Sec-Fetch-Site`).
    #[error("refused: {0}")]
    CrossSite(&'static str),
    /// The host has no operator role; the text says what to configure.
    #[error("the admin API is off: {0}")]
    NotConfigured(String),
    /// A query or path parameter that cannot be.
    #[error("{parameter}: {detail}")]
    BadParameter {
        /// Its name.
        parameter: &'static str,
        /// What is wrong.
        detail: String,
    },
    /// A request body that is not what the endpoint takes.
    #[error("the request body {0}")]
    BadBody(String),
    /// A filter or argument the operator module refused (the text names the field).
    #[error("{0}")]
    Invalid(String),
    /// No such resource.
    #[error("{0} not found")]
    NotFound(&'static str),
    /// The resource's state refuses the change.
    #[error("{detail}")]
    Conflict {
        /// Stable code.
        code: &'static str,
        /// Text for the operator.
        detail: String,
        /// A member naming another resource, and its value.
        named: Option<(&'static str, Value)>,
    },
    /// As many event streams as a console follows at once are open ([`super::FOLLOWERS`]).
    #[error("{0} event streams are followed already, the most at once: try again later")]
    Busy(usize),
    /// PostgreSQL cannot be reached, or the operator role cannot connect.
    #[error("{0}")]
    Unavailable(&'static str, #[source] anyhow::Error),
    /// Anything else: logged, never shown.
    #[error("internal error")]
    Internal(#[source] anyhow::Error),
}

impl From<AdminError> for ApiError {
    fn from(e: AdminError) -> Self {
        if e.is_unavailable() {
            return Self::Unavailable("PostgreSQL is unavailable", e.into());
        }
        if e.is_conflict() {
            return Self::Conflict {
                code: "REPLAY_CONFLICT",
                detail: "a unique index refused the replay: the job or its operation would take what a live one holds \
                         (e.g. its store's one active sync)"
                    .to_owned(),
                named: None,
            };
        }
        match e {
            AdminError::Invalid(detail) => Self::Invalid(detail),
            AdminError::Unaudited(e) => Self::Unavailable(
                "the audit trail cannot be written, so the change was not made",
                anyhow::Error::new(e),
            ),
            AdminError::Database(sqlx::Error::Database(d))
                if matches!(d.code().as_deref(), Some("28P01" | "28000" | "3D000" | "42501")) =>
            {
                // Wrong password, no such role or database, or no EXECUTE on the operator's functions: the
                // deployment's operator role is not set up (migrating grants it).
                Self::Unavailable(
                    "the operator role cannot read (check its connection, and that the schema was migrated with it)",
                    anyhow::Error::new(sqlx::Error::Database(d)),
                )
            }
            other => Self::Internal(other.into()),
        }
    }
}

impl ApiError {
    /// The HTTP status.
    pub(crate) fn status(&self) -> StatusCode {
        match self {
            Self::Unauthenticated => StatusCode::UNAUTHORIZED,
            Self::CsrfRejected | Self::CrossSite(_) => StatusCode::FORBIDDEN,
            Self::NotConfigured(_) | Self::Unavailable(..) | Self::Busy(_) => StatusCode::SERVICE_UNAVAILABLE,
            Self::BadParameter { .. } | Self::BadBody(_) | Self::Invalid(_) => StatusCode::BAD_REQUEST,
            Self::NotFound(_) => StatusCode::NOT_FOUND,
            Self::Conflict { .. } => StatusCode::CONFLICT,
            Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The stable machine-readable code.
    pub(crate) fn code(&self) -> &'static str {
        match self {
            Self::Unauthenticated => "UNAUTHENTICATED",
            Self::CsrfRejected => "CSRF_TOKEN_INVALID",
            Self::CrossSite(_) => "CROSS_SITE_REFUSED",
            Self::NotConfigured(_) => "ADMIN_NOT_CONFIGURED",
            Self::BadParameter { .. } | Self::Invalid(_) => "INVALID_PARAMETER",
            Self::BadBody(_) => "INVALID_BODY",
            Self::NotFound(_) => "NOT_FOUND",
            Self::Conflict { code, .. } => code,
            Self::Unavailable(..) => "SERVICE_UNAVAILABLE",
            Self::Busy(_) => "TOO_MANY_FOLLOWERS",
            Self::Internal(_) => "INTERNAL",
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        match &self {
            Self::Internal(cause) => tracing::error!(error = ?cause, "Admin API request failed"),
            Self::Unavailable(_, cause) => tracing::warn!(error = ?cause, "Admin API request failed: unavailable"),
            _ => {}
        }
        let mut named = BTreeMap::new();
        match &self {
            Self::BadParameter { parameter, .. } => {
                named.insert("parameter", Value::from(*parameter));
            }
            Self::Conflict { named: Some((member, value)), .. } => {
                named.insert(*member, value.clone());
            }
            _ => {}
        }
        let problem = Problem {
            kind: "about:blank",
            title: status.canonical_reason().unwrap_or("Error"),
            status: status.as_u16(),
            detail: self.to_string(),
            code: self.code(),
            named,
        };
        let body = serde_json::to_vec(&problem).expect("a problem serializes");
        let mut response = (status, body).into_response();
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        match self {
            Self::Unauthenticated => {
                headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer realm=\"conveyor-admin\""));
            }
            Self::Unavailable(..) => {
                headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            }
            Self::Busy(_) => {
                headers.insert(header::RETRY_AFTER, HeaderValue::from_static("5"));
            }
            _ => {}
        }
        response
    }
}
