//! A JSON body extractor that answers with problem+json: 400 for malformed JSON, 415 for another media type,
//! 413 over the body limit, 422 for the wrong shape or an unknown field (types opt in with
//! `#[serde(deny_unknown_fields)]`).

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::{StatusCode, header};
use serde::de::DeserializeOwned;

use super::AppState;
use super::error::ApiError;

/// A JSON body of type `T`.
pub struct StrictJson<T>(pub T);

/// Reads the raw body under the limit, checking its media type.
pub async fn read_json_body(req: Request, state: &AppState) -> Result<Bytes, ApiError> {
    let is_json = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|mime| {
            let mime = mime.trim().to_ascii_lowercase();
            mime == "application/json" || (mime.starts_with("application/") && mime.ends_with("+json"))
        });
    if !is_json {
        return Err(ApiError::UnsupportedMediaType);
    }
    Bytes::from_request(req, state).await.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::PayloadTooLarge(state.max_body_bytes)
        } else {
            ApiError::MalformedJson("the body could not be read".into())
        }
    })
}

/// Parses a body, telling malformed JSON (400) from the wrong shape (422).
///
/// serde's "invalid type" and "invalid value" messages quote the submitted value, which may be a credential, so
/// only messages that name a field (unknown, missing, duplicate) are passed on verbatim.
pub fn parse_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| match e.classify() {
        serde_json::error::Category::Data => {
            let message = e.to_string();
            let names_a_field =
                ["unknown field", "missing field", "duplicate field"].iter().any(|p| message.starts_with(p));
            if names_a_field {
                ApiError::Validation(message)
            } else {
                ApiError::Validation(format!(
                    "a value has the wrong type or is out of range at line {} column {}",
                    e.line(),
                    e.column()
                ))
            }
        }
        _ => ApiError::MalformedJson(format!("syntax error at line {} column {}", e.line(), e.column())),
    })
}

impl<T: DeserializeOwned> FromRequest<AppState> for StrictJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, Self::Rejection> {
        let body = read_json_body(req, state).await?;
        parse_json(&body).map(StrictJson)
    }
}
