//! `/v1/stores`: store authorizations. Both writes are idempotent and start a `store.verify_credentials` job.

use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use serde::Deserialize;
use uuid::Uuid;

use super::AppState;
use super::error::ApiError;
use super::idempotent::{Idempotent, Reply};
use crate::auth::Principal;

use conveyor_shop::domain::stores::{self, Credentials, NewStore};

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

fn parse_id(raw: &str) -> Result<Uuid, ApiError> {
    Uuid::parse_str(raw).map_err(|_| ApiError::NotFound("store"))
}

async fn create(State(state): State<AppState>, request: Idempotent<CreateStore>) -> Result<Response, ApiError> {
    let body = &request.body;
    let new =
        NewStore { name: body.name.clone(), platform: body.platform.clone(), credentials: body.credentials.clone() };
    new.validate()?;
    let (principal, trace) = (request.principal, request.trace.clone());
    let sealer = state.sealer.clone();
    request
        .run(&state, |tx| {
            Box::pin(async move {
                let created = stores::create_tx(tx, &principal, &sealer, new, Some(trace)).await?;
                Ok(Reply::accepted(&created, created.operation.id))
            })
        })
        .await
}

async fn replace_authorization(
    State(state): State<AppState>,
    Path(id): Path<String>,
    request: Idempotent<ReplaceAuthorization>,
) -> Result<Response, ApiError> {
    let id = parse_id(&id)?;
    let credentials = request.body.credentials.clone();
    credentials.validate()?;
    let (principal, trace) = (request.principal, request.trace.clone());
    let sealer = state.sealer.clone();
    request
        .run(&state, |tx| {
            Box::pin(async move {
                let replaced = stores::replace_credentials_tx(tx, &principal, &sealer, id, credentials, Some(trace))
                    .await?
                    .ok_or(ApiError::NotFound("store"))?;
                Ok(Reply::accepted(&replaced, replaced.operation.id))
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
    let store = stores::get_tx(&mut tx, id).await?.ok_or(ApiError::NotFound("store"))?;
    tx.commit().await?;
    Ok(Json(store).into_response())
}
