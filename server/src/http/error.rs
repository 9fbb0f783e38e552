//! One error type for the API, rendered as RFC 9457 `application/problem+json` with a stable `code`.
//!
//! 4xx answers carry text meant for the client; 5xx answers say nothing about internals and log the cause.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use uuid::Uuid;

use conveyor_shop::domain::ValidationError;

/// Everything an API call can answer besides success.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// No, or an unusable, bearer token.
    #[error("missing or invalid bearer token")]
    Unauthenticated,
    /// The resource does not exist in the caller's workspace (other workspaces' ids look the same).
    #[error("{0} not found")]
    NotFound(&'static str),
    /// The body is not JSON.
    #[error("the request body is not valid JSON: {0}")]
    MalformedJson(String),
    /// The body is not declared as JSON.
    #[error("the request body must be application/json")]
    UnsupportedMediaType,
    /// The body is larger than the limit.
    #[error("the request body exceeds {0} bytes")]
    PayloadTooLarge(usize),
    /// JSON of the wrong shape, an unknown field, or a broken business rule.
    #[error("{0}")]
    Validation(String),
    /// The route takes an `Idempotency-Key` and none was sent.
    #[error("this endpoint requires an Idempotency-Key header")]
    IdempotencyKeyRequired,
    /// The `Idempotency-Key` is not a UUID.
    #[error("Idempotency-Key must be a UUID, bare or as a quoted string")]
    IdempotencyKeyInvalid,
    /// The key was used before with a different request.
    #[error("this Idempotency-Key was already used with a different request")]
    IdempotencyKeyReused,
    /// The first request with this key is still executing.
    #[error("a request with this Idempotency-Key is still in progress; retry later")]
    IdempotencyRequestInProgress,
    /// The operation has already ended (succeeded, failed or canceled), so it cannot be canceled; the problem names it
    /// in `operation_id`.
    #[error("operation {0} has already finished")]
    OperationFinished(Uuid),
    /// A rule refuses the request because of another resource's state (`409`). The problem carries `code` and names
    /// the conflicting resource in the member `named.0` (`operation_id`, `active_sync_id`, ...).
    #[error("{detail}")]
    Conflict {
        /// Stable code, e.g. `LISTING_ALREADY_PUBLISHED`.
        code: &'static str,
        /// Text for the client.
        detail: String,
        /// The member naming the conflicting resource, and its id.
        named: Option<(&'static str, Uuid)>,
    },
    /// A well-formed request that a rule with its own code refuses (`422`), e.g. `SOURCE_FORBIDDEN`.
    #[error("{detail}")]
    Refused {
        /// Stable code.
        code: &'static str,
        /// Text for the client.
        detail: String,
    },
    /// The workspace's AI credits for the month cannot cover the task (`429 AI_QUOTA_EXCEEDED`); the problem carries
    /// `credits_limit`, `credits_used` and `credits_requested`, and `Retry-After` says when the next month starts.
    #[error(
        "this task needs {credits_requested} AI credits and the workspace has used {credits_used} of its \
             {credits_limit} for this month"
    )]
    AiQuotaExceeded {
        /// Credits per workspace and calendar month (UTC).
        credits_limit: u32,
        /// Credits reserved so far this month.
        credits_used: u32,
        /// What the refused task costs.
        credits_requested: u32,
        /// Seconds until the next month starts, if known.
        retry_after_secs: Option<u64>,
    },
    /// A write that must be conditional came without `If-Match` (`428`).
    #[error("this request must be conditional: send If-Match with the ETag last read")]
    PreconditionRequired,
    /// The `If-Match` revision is not the current one (`412`); the problem carries `current_revision`.
    #[error("the resource has changed since it was read; its current revision is {0}")]
    PreconditionFailed(i64),
    /// As many media uploads as `CONVEYOR_MEDIA_MAX_CONCURRENT_UPLOADS` are being received by this process (`503
    /// UPLOADS_BUSY` with `Retry-After`); nothing was read or kept.
    #[error("this server is receiving {0} uploads already, its limit; retry later")]
    UploadsBusy(usize),
    /// PostgreSQL or Redis cannot be reached right now.
    #[error("a backing service is unavailable")]
    Unavailable(#[source] anyhow::Error),
    /// Anything else: logged, never shown.
    #[error("internal error")]
    Internal(#[source] anyhow::Error),
}

/// The `Retry-After` of `503 UPLOADS_BUSY`: about what an upload of a few megabytes takes.
pub(crate) const UPLOADS_RETRY_AFTER_SECS: u64 = 2;

#[derive(Serialize)]
struct Problem<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    title: &'a str,
    status: u16,
    detail: String,
    code: &'static str,
    /// What the problem names: the conflicting resource of a 409 (`operation_id`, `active_sync_id`, ...), the
    /// `current_revision` of a 412, the parameter of an admin API 400.
    #[serde(flatten)]
    named: std::collections::BTreeMap<&'static str, serde_json::Value>,
}

/// An `application/problem+json` answer (RFC 9457) with Conveyor's `code` and the members `named` adds: the one
/// shape of every error of the public and the admin API.
pub(crate) fn problem_response(
    status: StatusCode,
    detail: String,
    code: &'static str,
    named: std::collections::BTreeMap<&'static str, serde_json::Value>,
) -> Response {
    let problem = Problem {
        kind: "about:blank",
        title: status.canonical_reason().unwrap_or("Error"),
        status: status.as_u16(),
        detail,
        code,
        named,
    };
    let mut response = (status, serde_json::to_vec(&problem).expect("problem serializes")).into_response();
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
    response
}

impl ApiError {
    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::Unauthenticated => StatusCode::UNAUTHORIZED,
            Self::NotFound(_) => StatusCode::NOT_FOUND,
            Self::MalformedJson(_) | Self::IdempotencyKeyRequired | Self::IdempotencyKeyInvalid => {
                StatusCode::BAD_REQUEST
            }
            Self::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Self::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Validation(_) | Self::Refused { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            Self::Conflict { .. } => StatusCode::CONFLICT,
            Self::PreconditionRequired => StatusCode::PRECONDITION_REQUIRED,
            Self::AiQuotaExceeded { .. } => StatusCode::TOO_MANY_REQUESTS,
            Self::PreconditionFailed(_) => StatusCode::PRECONDITION_FAILED,
            Self::IdempotencyKeyReused | Self::IdempotencyRequestInProgress | Self::OperationFinished(_) => {
                StatusCode::CONFLICT
            }
            Self::Unavailable(_) | Self::UploadsBusy(_) => StatusCode::SERVICE_UNAVAILABLE,
            Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The stable machine-readable code.
    pub fn code(&self) -> &'static str {
        match self {
            Self::Unauthenticated => "UNAUTHENTICATED",
            Self::NotFound(_) => "NOT_FOUND",
            Self::MalformedJson(_) => "MALFORMED_JSON",
            Self::UnsupportedMediaType => "UNSUPPORTED_MEDIA_TYPE",
            Self::PayloadTooLarge(_) => "PAYLOAD_TOO_LARGE",
            Self::Validation(_) => "VALIDATION_FAILED",
            Self::IdempotencyKeyRequired => "IDEMPOTENCY_KEY_REQUIRED",
            Self::IdempotencyKeyInvalid => "IDEMPOTENCY_KEY_INVALID",
            Self::IdempotencyKeyReused => "IDEMPOTENCY_KEY_REUSED",
            Self::IdempotencyRequestInProgress => "IDEMPOTENCY_REQUEST_IN_PROGRESS",
            Self::OperationFinished(_) => "OPERATION_FINISHED",
            Self::Conflict { code, .. } | Self::Refused { code, .. } => code,
            Self::PreconditionRequired => "PRECONDITION_REQUIRED",
            Self::AiQuotaExceeded { .. } => "AI_QUOTA_EXCEEDED",
            Self::PreconditionFailed(_) => "PRECONDITION_FAILED",
            Self::Unavailable(_) => "SERVICE_UNAVAILABLE",
            Self::UploadsBusy(_) => "UPLOADS_BUSY",
            Self::Internal(_) => "INTERNAL",
        }
    }
}

impl From<ValidationError> for ApiError {
    fn from(e: ValidationError) -> Self {
        Self::Validation(e.0)
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(e: sqlx::Error) -> Self {
        if conveyor_jobs::is_postgres_unavailable(&e) {
            Self::Unavailable(anyhow::Error::new(e).context("PostgreSQL unavailable"))
        } else {
            Self::Internal(anyhow::Error::new(e))
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        match &self {
            Self::Internal(cause) => tracing::error!(error = ?cause, "Request failed"),
            Self::Unavailable(cause) => {
                tracing::warn!(error = ?cause, "Request failed: backing service unavailable")
            }
            _ => {}
        }
        let named = match self {
            Self::OperationFinished(id) => [("operation_id", id.to_string().into())].into(),
            Self::Conflict { named: Some((member, id)), .. } => [(member, id.to_string().into())].into(),
            Self::PreconditionFailed(revision) => [("current_revision", revision.into())].into(),
            Self::AiQuotaExceeded { credits_limit, credits_used, credits_requested, .. } => [
                ("credits_limit", credits_limit.into()),
                ("credits_used", credits_used.into()),
                ("credits_requested", credits_requested.into()),
            ]
            .into(),
            _ => Default::default(),
        };
        let mut response = problem_response(status, self.to_string(), self.code(), named);
        let headers = response.headers_mut();
        if matches!(self, Self::IdempotencyRequestInProgress | Self::Unavailable(_)) {
            headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if let Self::UploadsBusy(_) = self {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(UPLOADS_RETRY_AFTER_SECS));
        }
        if let Self::AiQuotaExceeded { retry_after_secs: Some(secs), .. } = self {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}
