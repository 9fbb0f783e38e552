//! `/v1/asset-transfers`: a source URL downloaded into object storage, which becomes a media. The create is
//! idempotent and starts an `asset.transfer` job; a literal refused address answers `422 SOURCE_FORBIDDEN` at once.

use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use uuid::Uuid;

use super::AppState;
use super::error::ApiError;
use super::idempotent::{Idempotent, Reply};
use crate::auth::Principal;

use conveyor_shop::adapters::fetch::AddressPolicy;
use conveyor_shop::domain::asset_transfers::{self, NewTransfer, NewTransferError};

pub fn routes() -> Router<AppState> {
    Router::new().route("/v1/asset-transfers", post(create)).route("/v1/asset-transfers/{id}", get(show))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateTransfer {
    source_url: String,
    filename: String,
}

async fn create(State(state): State<AppState>, request: Idempotent<CreateTransfer>) -> Result<Response, ApiError> {
    let policy = AddressPolicy::new(state.scenarios.asset_allowed_networks.clone())
        .with_ports(state.scenarios.asset_allowed_ports.iter().copied());
    let new = NewTransfer::parse(&request.body.source_url, &request.body.filename, &policy).map_err(|e| match e {
        NewTransferError::Invalid(e) => ApiError::from(e),
        NewTransferError::Forbidden(detail) => ApiError::Refused { code: "SOURCE_FORBIDDEN", detail },
    })?;
    let (principal, trace) = (request.principal, request.trace.clone());
    request
        .run(&state, |tx| {
            Box::pin(async move {
                let created = asset_transfers::create_tx(tx, &principal, new, Some(trace)).await?;
                Ok(Reply::accepted(&created, created.operation.id))
            })
        })
        .await
}

async fn show(
    State(state): State<AppState>,
    principal: Principal,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let id = Uuid::parse_str(&id).map_err(|_| ApiError::NotFound("asset transfer"))?;
    let mut tx = conveyor_jobs::begin_workspace(&state.pool, principal.workspace_id).await?;
    let transfer = asset_transfers::get_tx(&mut tx, id).await?.ok_or(ApiError::NotFound("asset transfer"))?;
    tx.commit().await?;
    Ok(Json(transfer).into_response())
}
