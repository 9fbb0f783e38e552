//! The sandbox marketplace's catalog: `POST /v1/catalog/list` with `{"credentials", "cursor", "limit"}` pages through
//! `catalog_size` products of the store that the credentials' `api_key` names, in a stable order. Products are
//! derived from the key and their position, so every page is the same however often it is asked for; the cursor is
//! the offset of the next page.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde::Deserialize;

use super::Sandbox;
use crate::adapters::catalog::{CatalogProduct, MAX_PAGE_SIZE, ProductPage};

pub(super) fn routes() -> Router<Sandbox> {
    Router::new().route("/v1/catalog/list", post(list))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ListRequest {
    credentials: std::collections::HashMap<String, String>,
    cursor: Option<String>,
    limit: u32,
}

async fn list(State(sandbox): State<Sandbox>, Json(body): Json<ListRequest>) -> Response {
    let Some(store) = body.credentials.get("api_key").filter(|k| !k.starts_with("invalid")).cloned() else {
        return (StatusCode::UNAUTHORIZED, Json(serde_json::json!({"code": "INVALID_CREDENTIALS"}))).into_response();
    };
    if body.limit == 0 || body.limit > MAX_PAGE_SIZE {
        return (StatusCode::BAD_REQUEST, Json(serde_json::json!({"code": "INVALID_LIMIT"}))).into_response();
    }
    let offset = match body.cursor.as_deref().map(str::parse::<u64>) {
        None => 0,
        Some(Ok(offset)) => offset,
        Some(Err(_)) => {
            return (StatusCode::BAD_REQUEST, Json(serde_json::json!({"code": "INVALID_CURSOR"}))).into_response();
        }
    };
    if let Err(refused) = sandbox.act_up().await {
        return refused;
    }
    let size = {
        let mut inner = sandbox.0.lock().expect("sandbox lock");
        inner.stats.catalog_pages_served += 1;
        *inner.stats.catalog_pages_by_offset.entry(offset).or_default() += 1;
        inner.settings.catalog_size
    };
    let end = (offset + u64::from(body.limit)).min(size);
    let products = (offset.min(end)..end).map(|i| product(&store, i)).collect();
    let next_cursor = (end < size).then(|| end.to_string());
    Json(ProductPage { products, next_cursor, total: Some(size) }).into_response()
}

/// The `i`-th product of `store`'s catalog.
pub(crate) fn product(store: &str, i: u64) -> CatalogProduct {
    use sha2::Digest;
    let tag = hex(&sha2::Sha256::digest(store.as_bytes())[..4]);
    CatalogProduct {
        external_id: format!("{tag}-{i:07}"),
        title: format!("Sandbox product {i}"),
        price: format!("{}.{:02}", 1 + i % 500, i % 100),
        currency: "EUR".to_owned(),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
