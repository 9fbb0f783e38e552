//! Operations (the records clients poll) across workspaces, through `conveyor_admin_operations`.

use super::jobs::page;
use super::{Actor, Admin, AdminError, OperationFilter, OperationSummary, Page, filters};

#[derive(sqlx::FromRow)]
struct Row {
    id: uuid::Uuid,
    workspace_id: uuid::Uuid,
    kind: String,
    status: String,
    subject_id: Option<uuid::Uuid>,
    error: Option<String>,
    attempt: i32,
    created_at: chrono::DateTime<chrono::Utc>,
    updated_at: chrono::DateTime<chrono::Utc>,
    finished_at: Option<chrono::DateTime<chrono::Utc>>,
}

/// Operations matching `filter`, newest first.
pub(super) async fn search(
    admin: &Admin,
    actor: &Actor,
    filter: &OperationFilter,
) -> Result<Page<OperationSummary>, AdminError> {
    let limit = filters::operations(filter)?;
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT id, workspace_id, kind, status, subject_id, error, attempt, created_at, updated_at, finished_at
         FROM conveyor.conveyor_admin_operations($1, $2, $3, $4, $5, $6, $7, $8)",
    )
    .bind(filters::actor(actor)?)
    .bind(&filter.kind)
    .bind(&filter.status)
    .bind(filter.workspace)
    .bind(filter.since)
    .bind(filter.until)
    .bind(filter.before)
    .bind(limit)
    .fetch_all(&admin.operator)
    .await?;
    let items = rows
        .into_iter()
        .map(|r| OperationSummary {
            id: r.id,
            workspace_id: r.workspace_id,
            kind: r.kind,
            status: r.status,
            subject_id: r.subject_id,
            error: r.error,
            attempt: r.attempt,
            created_at: r.created_at,
            updated_at: r.updated_at,
            finished_at: r.finished_at,
        })
        .collect();
    Ok(page(items, limit, |o| o.id))
}
