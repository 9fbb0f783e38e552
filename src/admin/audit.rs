//! The audit trail: every operator read writes its own row (inside its `conveyor_admin_*` function); every change
//! writes two here: its intent (action, arguments, `"outcome": "pending"`) before it runs, and the change is refused
//! when that row cannot be written; then its outcome (naming the intent row by id), after it ran or failed, best
//! effort (a failure to write it is logged: the intent row already says the change was attempted).

use chrono::{DateTime, Utc};
use serde_json::{Value, json};

use super::{Actor, Admin, AdminError, AuditEntry, filters};

/// Appends `action` with `arguments` (nulls dropped) for `actor`; the database adds the time and its role. Returns
/// the row's id.
pub(super) async fn write(admin: &Admin, actor: &Actor, action: &str, arguments: Value) -> Result<i64, AdminError> {
    let (id,): (i64,) = sqlx::query_as("SELECT conveyor.conveyor_admin_audit_write($1, $2, $3)")
        .bind(filters::actor(actor)?)
        .bind(action)
        .bind(arguments)
        .fetch_one(&admin.operator)
        .await?;
    Ok(id)
}

/// A change whose intent is on the audit trail: what its outcome row names.
#[must_use = "a change's outcome is recorded with `Intent::record`"]
pub(super) struct Intent {
    id: i64,
    action: &'static str,
}

/// Writes the intent row of the change `action` with `arguments` (plus `"outcome": "pending"`), before the change
/// runs. An error ([`AdminError::Unaudited`]) means the change must not run.
pub(super) async fn intent(
    admin: &Admin,
    actor: &Actor,
    action: &'static str,
    mut arguments: Value,
) -> Result<Intent, AdminError> {
    filters::actor(actor)?;
    arguments["outcome"] = json!("pending");
    match write(admin, actor, action, arguments).await {
        Ok(id) => Ok(Intent { id, action }),
        Err(AdminError::Database(e)) => Err(AdminError::Unaudited(e)),
        Err(e) => Err(e),
    }
}

impl Intent {
    /// The intent row's id: what a change made by a `conveyor_admin_*` function names in the outcome row it writes
    /// itself, in the change's transaction (then [`Intent::record`] is not called).
    pub(super) fn id(&self) -> i64 {
        self.id
    }

    /// Writes the outcome row (`arguments`, which say what happened, plus `"intent": <the intent row's id>`). Best
    /// effort: the change has already run (or failed); a failure here is logged, not returned.
    pub(super) async fn record(self, admin: &Admin, actor: &Actor, mut arguments: Value) {
        arguments["intent"] = json!(self.id);
        if let Err(e) = write(admin, actor, self.action, arguments).await {
            tracing::warn!(action = self.action, intent = self.id, actor = %actor.0, error = %e,
                "Could not record an operator change's outcome on the audit trail; its intent row stands");
        }
    }

    /// Writes the outcome row of a change that failed with `error` (its kind only: the cause is logged by the caller).
    pub(super) async fn failed(self, admin: &Admin, actor: &Actor, mut arguments: Value, error: &AdminError) {
        arguments["outcome"] = json!("error");
        arguments["error"] = json!(error_kind(error));
        self.record(admin, actor, arguments).await;
    }
}

/// A short name of what went wrong, for the audit trail (never a message that could carry data).
fn error_kind(error: &AdminError) -> &'static str {
    match error {
        AdminError::Invalid(_) => "invalid",
        e if e.is_conflict() => "refused_by_unique_index",
        e if e.is_unavailable() => "database_unavailable",
        AdminError::Database(_) | AdminError::Unaudited(_) => "database",
        AdminError::Redis(_) => "redis",
    }
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
        sqlx::query_as("SELECT at, who, role, action, arguments FROM conveyor.conveyor_admin_audit_trail($1, $2)")
            .bind(filters::actor(actor)?)
            .bind(limit)
            .fetch_all(&admin.operator)
            .await?;
    Ok(rows
        .into_iter()
        .map(|r| AuditEntry { at: r.at, actor: r.who, role: r.role, action: r.action, arguments: r.arguments })
        .collect())
}
