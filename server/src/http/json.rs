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
///
/// A string holding U+0000 is refused with `422` before anything else: PostgreSQL stores no NUL in `text` or `jsonb`,
/// and the write would otherwise fail as a `500`.
pub fn parse_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    if has_escaped_nul(body) {
        return Err(ApiError::Validation("strings must not contain the NUL character (\\u0000)".into()));
    }
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

/// Whether the JSON text escapes U+0000 (`\u0000`) in a string: the only way JSON carries a NUL, as a raw
/// control character inside a string is malformed JSON. A backslash that is itself escaped (`\\u0000`) is text.
fn has_escaped_nul(body: &[u8]) -> bool {
    let mut backslashes = 0usize;
    for (i, &b) in body.iter().enumerate() {
        if b == b'\\' {
            backslashes += 1;
            continue;
        }
        if b == b'u' && backslashes % 2 == 1 && body.get(i + 1..i + 5).is_some_and(|hex| hex == b"0000") {
            return true;
        }
        backslashes = 0;
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_escaped_nul_is_found_and_an_escaped_backslash_is_not_one() {
        assert!(has_escaped_nul(br#"{"title": "a\u0000b"}"#));
        assert!(has_escaped_nul(br#"{"a\u0000": 1}"#));
        assert!(has_escaped_nul(br#"["\\\u0000"]"#), "an escaped backslash, then an escaped NUL");
        assert!(!has_escaped_nul(br#"{"title": "a\\u0000b"}"#), "an escaped backslash, then text");
        assert!(has_escaped_nul(br#"{"title": "\u00001"}"#), "a NUL, then a digit");
        assert!(!has_escaped_nul(br#"{"title": "\u0001"}"#));
        assert!(matches!(parse_json::<serde_json::Value>(br#"{"t": "x\u0000"}"#), Err(ApiError::Validation(_))));
        assert!(parse_json::<serde_json::Value>(br#"{"t": "x\\u0000"}"#).is_ok());
    }
}
