//! Catalog full sync: `POST /v1/stores/{id}/catalog-syncs` (idempotent, starts `catalog.sync`),
//! `GET /v1/catalog-syncs/{id}`, and the synced products, `GET /v1/stores/{id}/products`.

use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine as _;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::AppState;
use super::error::ApiError;
use super::idempotent::{Idempotent, Reply};
use crate::auth::Principal;

use conveyor_shop::domain::catalog::{self, MAX_PRODUCTS_PAGE, StartError, StoreProduct};

/// Products per page when the client names no `limit`.
const DEFAULT_PRODUCTS_PAGE: u32 = 100;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/stores/{id}/catalog-syncs", post(start))
        .route("/v1/catalog-syncs/{id}", get(show))
        .route("/v1/stores/{id}/products", get(products))
}

/// The body of a start: empty, for now (`{}`).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StartSync {}

impl From<StartError> for ApiError {
    fn from(e: StartError) -> Self {
        match e {
            StartError::StoreNotFound => ApiError::NotFound("store"),
            StartError::StoreNotActive { store_id, status } => ApiError::Conflict {
                code: "STORE_NOT_ACTIVE",
                detail: format!("the store is `{status}`; only an `active` store can be synced"),
                named: Some(("store_id", store_id)),
            },
            StartError::AlreadyActive(id) => ApiError::Conflict {
                code: "SYNC_ALREADY_ACTIVE",
                detail: format!("catalog sync {id} of this store is still queued or running"),
                named: Some(("active_sync_id", id)),
            },
            StartError::Database(e) => e.into(),
        }
    }
}

async fn start(
    State(state): State<AppState>,
    Path(store_id): Path<String>,
    request: Idempotent<StartSync>,
) -> Result<Response, ApiError> {
    let store_id = Uuid::parse_str(&store_id).map_err(|_| ApiError::NotFound("store"))?;
    let (principal, trace) = (request.principal, request.trace.clone());
    request
        .run(&state, |tx| {
            Box::pin(async move {
                let started = catalog::start_tx(tx, &principal, store_id, Some(trace)).await?;
                Ok(Reply::accepted(&started, started.operation.id))
            })
        })
        .await
}

async fn show(
    State(state): State<AppState>,
    principal: Principal,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let id = Uuid::parse_str(&id).map_err(|_| ApiError::NotFound("catalog sync"))?;
    let mut tx = conveyor_jobs::begin_workspace(&state.pool, principal.workspace_id).await?;
    let sync = catalog::get_tx(&mut tx, id).await?.ok_or(ApiError::NotFound("catalog sync"))?;
    tx.commit().await?;
    Ok(Json(sync).into_response())
}

/// A page of `GET /v1/stores/{id}/products`.
#[derive(Serialize)]
struct ProductList {
    products: Vec<StoreProduct>,
    next_cursor: Option<String>,
}

/// Reads `limit` and `cursor` (the last external id of the previous page, base64url); anything else is `422`.
fn products_query(pairs: Vec<(String, String)>) -> Result<(u32, Option<String>), ApiError> {
    let (mut limit, mut after, mut seen) = (DEFAULT_PRODUCTS_PAGE, None, Vec::new());
    for (name, value) in pairs {
        if seen.contains(&name) {
            return Err(ApiError::Validation(format!("query parameter `{name}` is repeated")));
        }
        seen.push(name.clone());
        match name.as_str() {
            "limit" | "cursor" if value.is_empty() => {}
            "limit" => {
                limit = value.parse::<u32>().ok().filter(|l| (1..=MAX_PRODUCTS_PAGE).contains(l)).ok_or_else(|| {
                    ApiError::Validation(format!("`limit` must be an integer from 1 to {MAX_PRODUCTS_PAGE}"))
                })?;
            }
            "cursor" => {
                let decoded = base64::engine::general_purpose::URL_SAFE_NO_PAD
                    .decode(&value)
                    .ok()
                    .and_then(|bytes| String::from_utf8(bytes).ok())
                    .filter(|id| (1..=200).contains(&id.len()))
                    .ok_or_else(|| ApiError::Validation("`cursor` is not a cursor from a previous page".into()))?;
                after = Some(decoded);
            }
            _ => return Err(ApiError::Validation("unknown query parameter".into())),
        }
    }
    Ok((limit, after))
}

async fn products(
    State(state): State<AppState>,
    principal: Principal,
    Path(store_id): Path<String>,
    query: Result<Query<Vec<(String, String)>>, QueryRejection>,
) -> Result<Json<ProductList>, ApiError> {
    let store_id = Uuid::parse_str(&store_id).map_err(|_| ApiError::NotFound("store"))?;
    let Query(pairs) = query.map_err(|_| ApiError::Validation("the query string is not URL-encoded".into()))?;
    let (limit, after) = products_query(pairs)?;
    let mut tx = conveyor_jobs::begin_workspace(&state.pool, principal.workspace_id).await?;
    if !catalog::store_exists_tx(&mut tx, store_id).await? {
        return Err(ApiError::NotFound("store"));
    }
    // One more than asked tells whether another page follows.
    let mut products = catalog::products_tx(&mut tx, store_id, after.as_deref(), limit + 1).await?;
    tx.commit().await?;
    let next_cursor = if products.len() > limit as usize {
        products.truncate(limit as usize);
        products.last().map(|p| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&p.external_id))
    } else {
        None
    };
    Ok(Json(ProductList { products, next_cursor }))
}
