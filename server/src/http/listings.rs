//! `/v1/listings`: listings and their publication. Both writes are idempotent; publishing starts a `listing.publish`
//! job. A listing whose publication is queued, running or done answers `409 LISTING_ALREADY_PUBLISHED` (naming that
//! operation); a `publish_failed` one may be published again, as the same marketplace product.
//!
//! A `store_id` or media id of the body that the workspace does not have answers `422` (`STORE_NOT_FOUND`,
//! `MEDIA_NOT_FOUND`): the request's resource is the new listing, and what it names is part of its content. Ids of
//! the path that the workspace does not have answer `404`.

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

use conveyor_shop::domain::listings::{self, CreateError, NewListing, Price, PublishError};

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/listings", post(create))
        .route("/v1/listings/{id}", get(show))
        .route("/v1/listings/{id}/publish", post(publish))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateListing {
    store_id: Uuid,
    title: String,
    description: String,
    price: PriceBody,
    #[serde(default)]
    media_ids: Vec<Uuid>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PriceBody {
    amount: String,
    currency: String,
}

/// The body of a publish: `{}`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Publish {}

fn parse_id(raw: &str) -> Result<Uuid, ApiError> {
    Uuid::parse_str(raw).map_err(|_| ApiError::NotFound("listing"))
}

impl From<CreateError> for ApiError {
    fn from(e: CreateError) -> Self {
        match e {
            CreateError::StoreNotFound(_) => Self::Refused { code: "STORE_NOT_FOUND", detail: e.to_string() },
            CreateError::MediaNotFound(_) => Self::Refused { code: "MEDIA_NOT_FOUND", detail: e.to_string() },
            CreateError::Database(e) => e.into(),
        }
    }
}

impl From<PublishError> for ApiError {
    fn from(e: PublishError) -> Self {
        let detail = e.to_string();
        let conflict = move |code, named| Self::Conflict { code, detail, named: Some(named) };
        match e {
            PublishError::NotFound => Self::NotFound("listing"),
            PublishError::AlreadyPublished { operation_id } => {
                conflict("LISTING_ALREADY_PUBLISHED", ("operation_id", operation_id))
            }
            PublishError::StoreNotActive { store_id } => conflict("STORE_NOT_ACTIVE", ("store_id", store_id)),
            PublishError::MediaNotReady { media_id } => conflict("MEDIA_NOT_READY", ("media_id", media_id)),
            PublishError::Database(e) => e.into(),
        }
    }
}

async fn create(State(state): State<AppState>, request: Idempotent<CreateListing>) -> Result<Response, ApiError> {
    let body = &request.body;
    let new = NewListing {
        store_id: body.store_id,
        title: body.title.clone(),
        description: body.description.clone(),
        price: Price::parse(&body.price.amount, &body.price.currency)?,
        media_ids: body.media_ids.clone(),
    };
    new.validate()?;
    let principal = request.principal;
    request
        .run(&state, |tx| {
            Box::pin(async move {
                let listing = listings::create_tx(tx, &principal, new).await?;
                let location = format!("/v1/listings/{}", listing.id);
                Ok(Reply::created(&serde_json::json!({ "listing": listing }), location))
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
    let listing = listings::get_tx(&mut tx, id).await?.ok_or(ApiError::NotFound("listing"))?;
    tx.commit().await?;
    Ok(Json(listing).into_response())
}

async fn publish(
    State(state): State<AppState>,
    Path(id): Path<String>,
    request: Idempotent<Publish>,
) -> Result<Response, ApiError> {
    let id = parse_id(&id)?;
    let (principal, trace) = (request.principal, request.trace.clone());
    request
        .run(&state, |tx| {
            Box::pin(async move {
                let publication = listings::publish_tx(tx, &principal, id, Some(trace)).await?;
                Ok(Reply::accepted(&publication, publication.operation.id))
            })
        })
        .await
}
