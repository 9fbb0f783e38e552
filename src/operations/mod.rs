//! User-visible operations: what a client polls at `GET /v1/operations/{id}` (`queued` → `running` →
//! `succeeded` / `failed`). The source of truth for a job's outcome; the outbox and the streams only deliver.

use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

use crate::db::WorkspaceTx;
use crate::ids::{UserId, WorkspaceId};

/// An operation as clients see it.
#[derive(Clone, Debug, Serialize, sqlx::FromRow)]
pub struct Operation {
    /// Id.
    pub id: Uuid,
    /// What it does, e.g. `store.verify_credentials`.
    pub kind: String,
    /// `queued`, `running`, `succeeded`, `failed` or `canceled`.
    pub status: String,
    /// The resource it concerns.
    pub subject_id: Option<Uuid>,
    /// Progress reported by the worker.
    pub progress: Option<serde_json::Value>,
    /// Result, once succeeded.
    pub result: Option<serde_json::Value>,
    /// Redacted error, once failed.
    pub error: Option<String>,
    /// Created.
    pub created_at: DateTime<Utc>,
    /// Last changed.
    pub updated_at: DateTime<Utc>,
}

macro_rules! columns {
    () => {
        "id, kind, status, subject_id, progress, result, error, created_at, updated_at"
    };
}

/// Creates a `queued` operation inside the caller's transaction.
pub async fn create_tx(
    tx: &mut WorkspaceTx,
    workspace_id: WorkspaceId,
    created_by: UserId,
    kind: &str,
    subject_id: Option<Uuid>,
) -> Result<Operation, sqlx::Error> {
    sqlx::query_as::<_, Operation>(concat!(
        "INSERT INTO operations (id, workspace_id, kind, subject_id, created_by)
         VALUES ($1, $2, $3, $4, $5) RETURNING ",
        columns!()
    ))
    .bind(Uuid::now_v7())
    .bind(workspace_id.0)
    .bind(kind)
    .bind(subject_id)
    .bind(created_by.0)
    .fetch_one(&mut **tx)
    .await
}

/// The operation `id` of the transaction's workspace, if any.
pub async fn get_tx(tx: &mut WorkspaceTx, id: Uuid) -> Result<Option<Operation>, sqlx::Error> {
    sqlx::query_as::<_, Operation>(concat!("SELECT ", columns!(), " FROM operations WHERE id = $1"))
        .bind(id)
        .fetch_optional(&mut **tx)
        .await
}
