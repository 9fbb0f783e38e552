//! `/v1/ai-tasks`: AI tasks. Creating one is idempotent, reserves its price from the workspace's monthly credits
//! (`429 AI_QUOTA_EXCEEDED` when they cannot cover it, and nothing is queued) and starts an `ai.generate` job.

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

use conveyor_shop::domain::ai_tasks::{self, CreateError, NewAiTask};

pub fn routes() -> Router<AppState> {
    Router::new().route("/v1/ai-tasks", post(create)).route("/v1/ai-tasks/{id}", get(show))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateAiTask {
    kind: String,
    input: serde_json::Value,
    #[serde(default)]
    listing_id: Option<Uuid>,
}

impl From<CreateError> for ApiError {
    fn from(e: CreateError) -> Self {
        match e {
            CreateError::ListingNotFound(_) => Self::Refused { code: "LISTING_NOT_FOUND", detail: e.to_string() },
            CreateError::QuotaExceeded { credits_limit, credits_used, credits_requested, retry_after_secs } => {
                Self::AiQuotaExceeded {
                    credits_limit,
                    credits_used,
                    credits_requested,
                    retry_after_secs: Some(retry_after_secs),
                }
            }
            CreateError::Database(e) => e.into(),
        }
    }
}

async fn create(State(state): State<AppState>, request: Idempotent<CreateAiTask>) -> Result<Response, ApiError> {
    let body = &request.body;
    let new = NewAiTask::parse(&body.kind, body.input.clone(), body.listing_id)?;
    let (principal, trace) = (request.principal, request.trace.clone());
    let credits_limit = state.scenarios.ai_credits_per_workspace;
    request
        .run(&state, |tx| {
            Box::pin(async move {
                let created = ai_tasks::create_tx(tx, &principal, new, credits_limit, Some(trace)).await?;
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
    let id = Uuid::parse_str(&id).map_err(|_| ApiError::NotFound("AI task"))?;
    let mut tx = conveyor_jobs::begin_workspace(&state.pool, principal.workspace_id).await?;
    let task = ai_tasks::get_tx(&mut tx, id).await?.ok_or(ApiError::NotFound("AI task"))?;
    tx.commit().await?;
    Ok(Json(task).into_response())
}
