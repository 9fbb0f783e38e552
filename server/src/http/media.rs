//! `/v1/media`: register a media, upload its bytes, complete it (which queues `media.process`), read it and serve its
//! derivatives.
//!
//! - `POST /v1/media` (idempotent) → `201 {"media": {...}}`; a content type other than `image/png` or `image/jpeg`
//!   is `422 UNSUPPORTED_TYPE`, a `size_bytes` over `CONVEYOR_MEDIA_MAX_BYTES` `422 TOO_LARGE`, other bad fields
//!   `422 VALIDATION_FAILED`.
//! - `PUT /v1/media/{id}/content` (not idempotency-keyed): the raw bytes, streamed into object storage in parts; an
//!   upload replaces an earlier one while the media is `awaiting_upload`. More than `CONVEYOR_MEDIA_MAX_BYTES` → 413;
//!   an empty body → `422 VALIDATION_FAILED`; after completion → `409 MEDIA_ALREADY_COMPLETED` (with `operation_id`);
//!   while `CONVEYOR_MEDIA_MAX_CONCURRENT_UPLOADS` uploads are being received by the process → `503 UPLOADS_BUSY`
//!   with `Retry-After`, before a byte is read (each upload holds one part in memory: the cap bounds the process's).
//! - `POST /v1/media/{id}/complete` (idempotent) → `202 {"media", "operation"}`; without an upload
//!   `409 MEDIA_NOT_UPLOADED`; once completed (under another key) `409 MEDIA_ALREADY_COMPLETED` with `operation_id`,
//!   unless that operation ended `canceled` or `failed`, when a new one starts.
//! - `GET /v1/media/{id}` and `GET /v1/media/{id}/derivatives/{name}` (the bytes, streamed).

use axum::body::Body;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use serde::Deserialize;
use uuid::Uuid;

use super::AppState;
use super::error::ApiError;
use super::idempotent::{Idempotent, Reply};
use crate::auth::Principal;

use conveyor_shop::domain::media::{
    self, CompleteError, MediaState, NewMedia, NewMediaError, UploadError, UploadRecorded,
};
use conveyor_shop::storage::StorageError;

/// The media routes; the upload route takes bodies up to `CONVEYOR_MEDIA_MAX_BYTES` (the API's default limit is
/// far smaller).
pub fn routes(state: &AppState) -> Router<AppState> {
    let upload_limit = usize::try_from(state.scenarios.media_max_bytes).unwrap_or(usize::MAX);
    Router::new()
        .route("/v1/media", post(create))
        .route("/v1/media/{id}", get(show))
        .route("/v1/media/{id}/content", put(upload).layer(DefaultBodyLimit::max(upload_limit)))
        .route("/v1/media/{id}/complete", post(complete))
        .route("/v1/media/{id}/derivatives/{name}", get(derivative))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateMedia {
    filename: String,
    content_type: String,
    #[serde(deserialize_with = "conveyor_shop::domain::whole_number::deserialize")]
    size_bytes: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CompleteMedia {}

fn parse_id(raw: &str) -> Result<Uuid, ApiError> {
    Uuid::parse_str(raw).map_err(|_| ApiError::NotFound("media"))
}

fn storage_error(e: StorageError) -> ApiError {
    match e {
        StorageError::NotFound(_) => ApiError::NotFound("derivative"),
        other => ApiError::Unavailable(anyhow::Error::new(other).context("object storage unavailable")),
    }
}

fn already_completed(operation_id: Uuid) -> ApiError {
    ApiError::Conflict {
        code: "MEDIA_ALREADY_COMPLETED",
        detail: "the media was already completed; its operation processes the uploaded bytes".into(),
        named: Some(("operation_id", operation_id)),
    }
}

async fn create(State(state): State<AppState>, request: Idempotent<CreateMedia>) -> Result<Response, ApiError> {
    let body = &request.body;
    let new = NewMedia {
        filename: body.filename.clone(),
        content_type: body.content_type.clone(),
        size_bytes: body.size_bytes,
    };
    new.validate(state.scenarios.media_max_bytes).map_err(|e| match e {
        NewMediaError::Invalid(e) => ApiError::from(e),
        NewMediaError::UnsupportedType => ApiError::Refused { code: "UNSUPPORTED_TYPE", detail: e.to_string() },
        NewMediaError::TooLarge(_) => ApiError::Refused { code: "TOO_LARGE", detail: e.to_string() },
    })?;
    let principal = request.principal;
    request
        .run(&state, |tx| {
            Box::pin(async move {
                let created = media::create_tx(tx, principal.workspace_id, principal.user_id, &new).await?;
                let location = format!("/v1/media/{}", created.id);
                Ok(Reply::created(&serde_json::json!({ "media": created }), location))
            })
        })
        .await
}

async fn upload(
    State(state): State<AppState>,
    principal: Principal,
    Path(id): Path<String>,
    request: Request,
) -> Result<Response, ApiError> {
    let id = parse_id(&id)?;
    let _receiving = Receiving::enter(&state)?;
    let max_bytes = state.scenarios.media_max_bytes;
    // Refuse before reading a byte when the media cannot take an upload or the body announces too many bytes.
    let mut tx = conveyor_jobs::begin_workspace(&state.pool, principal.workspace_id).await?;
    match media::state_tx(&mut tx, id).await? {
        MediaState::Missing => return Err(ApiError::NotFound("media")),
        MediaState::Completed { operation_id } => return Err(already_completed(operation_id)),
        MediaState::AwaitingUpload { .. } => {}
    }
    tx.commit().await?;
    let announced = request.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if announced.is_some_and(|n| n > max_bytes) {
        return Err(ApiError::PayloadTooLarge(usize::try_from(max_bytes).unwrap_or(usize::MAX)));
    }

    let body = request.into_body().into_data_stream();
    let (object, size) = media::store_upload(&state.storage, principal.workspace_id, id, body, announced, max_bytes)
        .await
        .map_err(|e| match e {
            UploadError::TooLarge(max) => ApiError::PayloadTooLarge(usize::try_from(max).unwrap_or(usize::MAX)),
            UploadError::Body(detail) => ApiError::Validation(format!("the upload could not be read: {detail}")),
            UploadError::Storage(e) => storage_error(e),
        })?;
    if size == 0 {
        discard(&state, &object).await;
        return Err(ApiError::Validation("the upload is empty: send the media's bytes as the request body".into()));
    }

    let mut tx = conveyor_jobs::begin_workspace(&state.pool, principal.workspace_id).await?;
    let recorded = media::record_upload_tx(&mut tx, id, &object, size).await?;
    let refused = match recorded {
        UploadRecorded::Recorded { replaced } => {
            let shown = media::get_tx(&mut tx, id).await?.ok_or(ApiError::NotFound("media"))?;
            tx.commit().await?;
            if let Some(replaced) = replaced {
                discard(&state, &replaced).await;
            }
            return Ok(Json(shown).into_response());
        }
        UploadRecorded::Refused(MediaState::Completed { operation_id }) => already_completed(operation_id),
        UploadRecorded::Refused(_) => ApiError::NotFound("media"),
    };
    drop(tx);
    discard(&state, &object).await;
    Err(refused)
}

/// One of the uploads the process receives at once, counted in `conveyor_media_uploads_in_progress` while it lasts
/// (until the handler returns or its client goes away).
struct Receiving {
    _permit: tokio::sync::OwnedSemaphorePermit,
    gauge: prometheus::IntGauge,
}

impl Receiving {
    fn enter(state: &AppState) -> Result<Self, ApiError> {
        let Ok(permit) = state.uploads.clone().try_acquire_owned() else {
            state.server_metrics.media_uploads_refused.inc();
            return Err(ApiError::UploadsBusy(state.scenarios.media_max_concurrent_uploads));
        };
        let gauge = state.server_metrics.media_uploads_in_progress.clone();
        gauge.inc();
        Ok(Self { _permit: permit, gauge })
    }
}

impl Drop for Receiving {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}

/// Deletes an object nothing points at any more; a failure leaves garbage, not an error.
async fn discard(state: &AppState, object: &conveyor_shop::storage::ObjectKey) {
    if let Err(e) = state.storage.delete(object).await {
        tracing::warn!(object = %object, error = %e, "Failed to delete an unused upload");
    }
}

async fn complete(
    State(state): State<AppState>,
    Path(id): Path<String>,
    request: Idempotent<CompleteMedia>,
) -> Result<Response, ApiError> {
    let id = parse_id(&id)?;
    let (principal, trace) = (request.principal, request.trace.clone());
    request
        .run(&state, |tx| {
            Box::pin(async move {
                let completion = media::complete_tx(tx, principal.workspace_id, principal.user_id, id, Some(trace))
                    .await
                    .map_err(|e| match e {
                        CompleteError::NotFound => ApiError::NotFound("media"),
                        CompleteError::NotUploaded => {
                            ApiError::Conflict { code: "MEDIA_NOT_UPLOADED", detail: e.to_string(), named: None }
                        }
                        CompleteError::AlreadyCompleted(operation_id) => already_completed(operation_id),
                        CompleteError::Database(e) => ApiError::from(e),
                    })?;
                Ok(Reply::accepted(&completion, completion.operation.id))
            })
        })
        .await
}

async fn show(
    State(state): State<AppState>,
    principal: Principal,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let id = parse_id(&id)?;
    let mut tx = conveyor_jobs::begin_workspace(&state.pool, principal.workspace_id).await?;
    let shown = media::get_tx(&mut tx, id).await?.ok_or(ApiError::NotFound("media"))?;
    tx.commit().await?;
    Ok(Json(shown).into_response())
}

async fn derivative(
    State(state): State<AppState>,
    principal: Principal,
    Path((id, name)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let id = parse_id(&id)?;
    let mut tx = conveyor_jobs::begin_workspace(&state.pool, principal.workspace_id).await?;
    let stored = media::derivative_tx(&mut tx, id, &name).await?.ok_or(ApiError::NotFound("derivative"))?;
    tx.commit().await?;
    let object = conveyor_shop::storage::ObjectKey::parse(&stored.object_key).map_err(storage_error)?;
    let stream = state.storage.stream(&object).await.map_err(storage_error)?;
    let mut response = Body::from_stream(stream).into_response();
    let headers = response.headers_mut();
    let content_type =
        HeaderValue::from_str(&stored.content_type).unwrap_or(HeaderValue::from_static("application/octet-stream"));
    headers.insert(header::CONTENT_TYPE, content_type);
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(stored.size_bytes));
    headers.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    // The bytes under this URL never change once the media is ready.
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("private, max-age=86400, immutable"));
    Ok(response)
}
