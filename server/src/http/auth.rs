//! The bearer-token extractor: a handler that takes a [`Principal`] is authenticated.

use axum::extract::FromRequestParts;
use axum::http::header;
use axum::http::request::Parts;

use super::AppState;
use super::error::ApiError;
use crate::auth::Principal;

impl FromRequestParts<AppState> for Principal {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Self::Rejection> {
        let header = parts.headers.get(header::AUTHORIZATION).ok_or(ApiError::Unauthenticated)?;
        let token = header
            .to_str()
            .ok()
            .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .ok_or(ApiError::Unauthenticated)?;
        state.tokens.verify(token).map_err(|e| {
            tracing::debug!(reason = %e, "Bearer token refused");
            ApiError::Unauthenticated
        })
    }
}
