//! `/v1/product-drafts`: drafts guarded by revisions (`ETag: "<revision>"`, `If-Match` on `PUT`). No idempotency key
//! and no outbox: a draft starts no background work.

use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use uuid::Uuid;

use super::AppState;
use super::error::ApiError;
use super::json::StrictJson;
use crate::auth::Principal;

use conveyor_shop::domain::product_drafts::{self, DraftContent, ProductDraft, Replace};

pub fn routes() -> Router<AppState> {
    Router::new().route("/v1/product-drafts", post(create)).route("/v1/product-drafts/{id}", get(show).put(replace))
}

fn parse_id(raw: &str) -> Result<Uuid, ApiError> {
    Uuid::parse_str(raw).map_err(|_| ApiError::NotFound("product draft"))
}

/// The draft with its `ETag`.
fn with_etag(status: StatusCode, draft: ProductDraft) -> Response {
    let etag = HeaderValue::from_str(&format!("\"{}\"", draft.revision)).expect("digits are a valid header value");
    let mut response = (status, Json(&draft)).into_response();
    response.headers_mut().insert(header::ETAG, etag);
    if status == StatusCode::CREATED {
        let location = HeaderValue::from_str(&format!("/v1/product-drafts/{}", draft.id)).expect("a path");
        response.headers_mut().insert(header::LOCATION, location);
    }
    response
}

/// The revisions an `If-Match` header accepts. Entity tags are compared strongly (RFC 9110 §13.1.1): a weak tag or
/// one this API never issued matches nothing, and so does a list of several tags (a write names the one revision it
/// read); either ends in `412` with the current revision. `*` would make the write unconditional and is refused like a
/// missing header: a draft is written only by someone who has read it.
fn if_match(headers: &HeaderMap) -> Result<Vec<i64>, ApiError> {
    let values: Vec<&str> = headers.get_all(header::IF_MATCH).iter().filter_map(|v| v.to_str().ok()).collect();
    if values.is_empty() {
        return Err(ApiError::PreconditionRequired);
    }
    let tags: Vec<&str> = values.iter().flat_map(|v| v.split(',')).map(str::trim).filter(|t| !t.is_empty()).collect();
    if tags.is_empty() || tags.contains(&"*") {
        return Err(ApiError::PreconditionRequired);
    }
    if tags.len() > 1 {
        // Several revisions would let two writers that read different ones both win, one after the other: a write
        // names the one revision it read.
        return Ok(Vec::new());
    }
    Ok(tags
        .iter()
        .filter_map(|tag| tag.strip_prefix('"')?.strip_suffix('"')?.parse::<i64>().ok())
        .filter(|revision| *revision >= 1)
        .collect())
}

async fn create(
    State(state): State<AppState>,
    principal: Principal,
    StrictJson(content): StrictJson<DraftContent>,
) -> Result<Response, ApiError> {
    content.validate()?;
    let mut tx = conveyor_jobs::begin_workspace(&state.pool, principal.workspace_id).await?;
    let draft = product_drafts::create_tx(&mut tx, &principal, &content).await?;
    tx.commit().await?;
    Ok(with_etag(StatusCode::CREATED, draft))
}

async fn show(
    State(state): State<AppState>,
    principal: Principal,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let id = parse_id(&id)?;
    let mut tx = conveyor_jobs::begin_workspace(&state.pool, principal.workspace_id).await?;
    let draft = product_drafts::get_tx(&mut tx, id).await?.ok_or(ApiError::NotFound("product draft"))?;
    tx.commit().await?;
    Ok(with_etag(StatusCode::OK, draft))
}

async fn replace(
    State(state): State<AppState>,
    principal: Principal,
    Path(id): Path<String>,
    headers: HeaderMap,
    StrictJson(content): StrictJson<DraftContent>,
) -> Result<Response, ApiError> {
    let id = parse_id(&id)?;
    let expected = if_match(&headers)?;
    content.validate()?;
    let mut tx = conveyor_jobs::begin_workspace(&state.pool, principal.workspace_id).await?;
    let replaced = product_drafts::replace_tx(&mut tx, &principal, id, &expected, &content).await?;
    tx.commit().await?;
    match replaced {
        Replace::Replaced(draft) => Ok(with_etag(StatusCode::OK, draft)),
        Replace::Stale { current_revision } => Err(ApiError::PreconditionFailed(current_revision)),
        Replace::NotFound => Err(ApiError::NotFound("product draft")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(values: &[&str]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for v in values {
            map.append(header::IF_MATCH, HeaderValue::from_str(v).unwrap());
        }
        map
    }

    #[test]
    fn if_match_takes_strong_revision_tags_only() {
        assert!(matches!(if_match(&headers(&[])), Err(ApiError::PreconditionRequired)));
        assert!(matches!(if_match(&headers(&["*"])), Err(ApiError::PreconditionRequired)));
        assert!(matches!(if_match(&headers(&[" , "])), Err(ApiError::PreconditionRequired)));
        assert_eq!(if_match(&headers(&["\"3\""])).unwrap(), vec![3]);
        assert!(if_match(&headers(&["\"3\", \"4\"", "\"7\""])).unwrap().is_empty(), "one revision, not several");
        assert!(if_match(&headers(&["W/\"3\""])).unwrap().is_empty(), "weak tags never match");
        assert!(if_match(&headers(&["3", "\"x\"", "\"0\"", "\"-1\""])).unwrap().is_empty());
    }
}
