//! The audit trail: every operator read writes its own row (inside its `conveyor_admin_*` function); every change is
//! recorded here, after it ran, with its outcome.

use chrono::{DateTime, Utc};
use serde_json::Value;

use super::{Actor, Admin, AdminError, AuditEntry, filters};

/// Appends `action` with `arguments` (nulls dropped) for `actor`; the database adds the time and its role.
pub(super) async fn write(admin: &Admin, actor: &Actor, action: &str, arguments: Value) -> Result<(), AdminError> {
    sqlx::query("SELECT conveyor_admin_audit_write($1, $2, $3)")
        .bind(filters::actor(actor)?)
        .bind(action)
        .bind(arguments)
        .execute(&admin.operator)
        .await?;
    Ok(())
}

#[derive(sqlx::FromRow)]
struct Row {
    at: DateTime<Utc>,
    who: String,
    role: String,
    action: String,
    arguments: Value,
}

/// The newest `limit` entries (1 to 500), this read's own first.
pub(super) async fn trail(admin: &Admin, actor: &Actor, limit: u32) -> Result<Vec<AuditEntry>, AdminError> {
    let limit = filters::limit(Some(limit), filters::DEFAULT_PAGE)?;
    let rows: Vec<Row> =
        sqlx::query_as("SELECT at, who, role, action, arguments FROM conveyor_admin_audit_trail($1, $2)")
            .bind(filters::actor(actor)?)
            .bind(limit)
            .fetch_all(&admin.operator)
            .await?;
    Ok(rows
        .into_iter()
        .map(|r| AuditEntry { at: r.at, actor: r.who, role: r.role, action: r.action, arguments: r.arguments })
        .collect())
}
