//! `/v1/operations/{id}`: what a client polls after a `202 Accepted`.

use axum::extract::{Path, State};
use axum::routing::get;
use axum::{Json, Router};
use uuid::Uuid;

use super::AppState;
use super::error::ApiError;
use crate::auth::Principal;
use crate::db;
use crate::operations::{self, Operation};

pub fn routes() -> Router<AppState> {
    Router::new().route("/v1/operations/{id}", get(show))
}

async fn show(
    State(state): State<AppState>,
    principal: Principal,
    Path(id): Path<String>,
) -> Result<Json<Operation>, ApiError> {
    let id = Uuid::parse_str(&id).map_err(|_| ApiError::NotFound("operation"))?;
    let mut tx = db::begin_workspace(&state.pool, principal.workspace_id).await?;
    let operation = operations::get_tx(&mut tx, id).await?.ok_or(ApiError::NotFound("operation"))?;
    tx.commit().await?;
    Ok(Json(operation))
}
