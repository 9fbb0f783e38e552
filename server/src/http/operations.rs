//! `/v1/operations`: what a client polls after a `202 Accepted`, its workspace's operations page by page, and
//! cancellation.

use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Serialize;
use uuid::Uuid;

use super::AppState;
use super::error::ApiError;
use crate::auth::Principal;

use conveyor_jobs::{MAX_OPERATIONS_PAGE, OPERATION_STATUSES, Operation, OperationCursor, OperationQuery};
use conveyor_jobs::{OperationCancel, cancel_operation_tx};

/// Page size when the client names none.
const DEFAULT_PAGE: u32 = 50;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/operations", get(list))
        .route("/v1/operations/{id}", get(show))
        .route("/v1/operations/{id}/cancel", post(cancel))
}

fn parse_id(raw: &str) -> Result<Uuid, ApiError> {
    Uuid::parse_str(raw).map_err(|_| ApiError::NotFound("operation"))
}

async fn show(
    State(state): State<AppState>,
    principal: Principal,
    Path(id): Path<String>,
) -> Result<Json<Operation>, ApiError> {
    let id = parse_id(&id)?;
    let mut tx = conveyor_jobs::begin_workspace(&state.pool, principal.workspace_id).await?;
    let operation = conveyor_jobs::get_operation_tx(&mut tx, id).await?.ok_or(ApiError::NotFound("operation"))?;
    tx.commit().await?;
    Ok(Json(operation))
}

/// A page of `GET /v1/operations`.
#[derive(Serialize)]
struct List {
    operations: Vec<Operation>,
    next_cursor: Option<String>,
}

/// Reads `status`, `kind`, `limit` and `cursor`. An empty value counts as absent; an unknown or repeated parameter,
/// an unknown status, a limit outside 1..=200 and a cursor this API did not issue are `422 VALIDATION_FAILED`.
fn list_query(pairs: Vec<(String, String)>) -> Result<OperationQuery, ApiError> {
    let mut query = OperationQuery { status: None, kind: None, after: None, limit: DEFAULT_PAGE };
    let mut seen = Vec::new();
    for (name, value) in pairs {
        if seen.contains(&name) {
            return Err(ApiError::Validation(format!("query parameter `{name}` is repeated")));
        }
        seen.push(name.clone());
        match name.as_str() {
            "status" | "kind" | "limit" | "cursor" if value.is_empty() => {}
            "status" => {
                if !OPERATION_STATUSES.contains(&value.as_str()) {
                    return Err(ApiError::Validation(format!(
                        "`status` must be one of {}",
                        OPERATION_STATUSES.join(", ")
                    )));
                }
                query.status = Some(value);
            }
            "kind" => query.kind = Some(value),
            "limit" => {
                query.limit =
                    value.parse::<u32>().ok().filter(|l| (1..=MAX_OPERATIONS_PAGE).contains(l)).ok_or_else(|| {
                        ApiError::Validation(format!("`limit` must be an integer from 1 to {MAX_OPERATIONS_PAGE}"))
                    })?;
            }
            "cursor" => {
                query.after = Some(OperationCursor::decode(&value).ok_or_else(|| {
                    ApiError::Validation("`cursor` is not a cursor from a previous page of this listing".into())
                })?);
            }
            // The name is echoed, not the value: a value could be anything the client holds.
            _ if name.len() <= 64 => {
                return Err(ApiError::Validation(format!("unknown query parameter `{name}`")));
            }
            _ => return Err(ApiError::Validation("unknown query parameter".into())),
        }
    }
    Ok(query)
}

/// `GET /v1/operations?status=&kind=&limit=&cursor=`: the caller's workspace's operations, newest first.
async fn list(
    State(state): State<AppState>,
    principal: Principal,
    query: Result<Query<Vec<(String, String)>>, QueryRejection>,
) -> Result<Json<List>, ApiError> {
    let Query(pairs) = query.map_err(|_| ApiError::Validation("the query string is not URL-encoded".into()))?;
    let query = list_query(pairs)?;
    let mut tx = conveyor_jobs::begin_workspace(&state.pool, principal.workspace_id).await?;
    let page = conveyor_jobs::list_operations_tx(&mut tx, principal.workspace_id, &query).await?;
    tx.commit().await?;
    Ok(Json(List { operations: page.operations, next_cursor: page.next_cursor.map(|c| c.encode()) }))
}

/// `POST /v1/operations/{id}/cancel`: cancels a queued or running operation and every live job of it (a running
/// worker is told and its writes roll back). No `Idempotency-Key`: a repeat finds the operation finished and answers
/// `409 OPERATION_FINISHED`.
async fn cancel(
    State(state): State<AppState>,
    principal: Principal,
    Path(id): Path<String>,
) -> Result<Json<Operation>, ApiError> {
    let id = parse_id(&id)?;
    let mut tx = conveyor_jobs::begin_workspace(&state.pool, principal.workspace_id).await?;
    match cancel_operation_tx(&mut tx, principal.workspace_id, id).await? {
        OperationCancel::Canceled => {}
        OperationCancel::Finished(_) => return Err(ApiError::OperationFinished(id)),
        OperationCancel::NotFound => return Err(ApiError::NotFound("operation")),
    }
    tx.commit().await?;
    let mut tx = conveyor_jobs::begin_workspace(&state.pool, principal.workspace_id).await?;
    let operation = conveyor_jobs::get_operation_tx(&mut tx, id).await?.ok_or(ApiError::NotFound("operation"))?;
    tx.commit().await?;
    Ok(Json(operation))
}
