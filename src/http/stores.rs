//! `/v1/stores`: store authorizations.

use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use serde::Deserialize;
use uuid::Uuid;

use super::AppState;
use super::error::ApiError;
use super::json::StrictJson;
use crate::auth::Principal;
use crate::db;
use crate::domain::stores::{self, Authorization, Credentials, NewStore};
use crate::telemetry;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/stores", post(create))
        .route("/v1/stores/{id}", get(show))
        .route("/v1/stores/{id}/authorization", put(replace_authorization))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateStore {
    name: String,
    platform: String,
    credentials: Credentials,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReplaceAuthorization {
    credentials: Credentials,
}

fn traceparent(headers: &HeaderMap) -> String {
    telemetry::traceparent_or_new(headers.get("traceparent").and_then(|v| v.to_str().ok()))
}

/// `202 Accepted` with the resource, its operation and `Location: /v1/operations/{id}`.
fn accepted(authorization: &Authorization) -> Response {
    let location = format!("/v1/operations/{}", authorization.operation.id);
    let mut response = (StatusCode::ACCEPTED, Json(authorization)).into_response();
    response.headers_mut().insert(
        header::LOCATION,
        HeaderValue::from_str(&location).expect("a uuid path is a valid header"),
    );
    response
}

fn parse_id(raw: &str) -> Result<Uuid, ApiError> {
    Uuid::parse_str(raw).map_err(|_| ApiError::NotFound("store"))
}

async fn create(
    State(state): State<AppState>,
    principal: Principal,
    headers: HeaderMap,
    StrictJson(body): StrictJson<CreateStore>,
) -> Result<Response, ApiError> {
    let new = NewStore {
        name: body.name,
        platform: body.platform,
        credentials: body.credentials,
    };
    new.validate()?;
    let mut tx = db::begin_workspace(&state.pool, principal.workspace_id).await?;
    let authorization = stores::create_tx(
        &mut tx,
        &principal,
        &state.sealer,
        new,
        Some(traceparent(&headers)),
    )
    .await?;
    tx.commit().await?;
    Ok(accepted(&authorization))
}

async fn replace_authorization(
    State(state): State<AppState>,
    principal: Principal,
    Path(id): Path<String>,
    headers: HeaderMap,
    StrictJson(body): StrictJson<ReplaceAuthorization>,
) -> Result<Response, ApiError> {
    let id = parse_id(&id)?;
    body.credentials.validate()?;
    let mut tx = db::begin_workspace(&state.pool, principal.workspace_id).await?;
    let authorization = stores::replace_credentials_tx(
        &mut tx,
        &principal,
        &state.sealer,
        id,
        body.credentials,
        Some(traceparent(&headers)),
    )
    .await?
    .ok_or(ApiError::NotFound("store"))?;
    tx.commit().await?;
    Ok(accepted(&authorization))
}

async fn show(
    State(state): State<AppState>,
    principal: Principal,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let id = parse_id(&id)?;
    let mut tx = db::begin_workspace(&state.pool, principal.workspace_id).await?;
    let store = stores::get_tx(&mut tx, id)
        .await?
        .ok_or(ApiError::NotFound("store"))?;
    tx.commit().await?;
    Ok(Json(store).into_response())
}
