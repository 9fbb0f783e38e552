//! Fairness, seen and changed by an operator: each workspace's weight, its jobs in the workers' hands and its share of
//! them (`conveyor_admin_workspace_shares`), and every workspace's key and kind limits with their blocks and what each
//! holds now (`conveyor_admin_key_limits`, `conveyor_admin_kind_limits`), read across workspaces and audited. A
//! workspace's own limits are changed as the application role in that workspace (they are tenant data, under
//! row-level security), its intent audited first and its outcome after, as a schedule's pause is.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::{Value, json};
use uuid::Uuid;

use super::{Actor, Admin, AdminError, audit, filters};
use crate::ids::WorkspaceId;
use crate::limits::{self, KeyLimit};

/// A workspace's part of the workers' hands.
#[derive(Clone, Debug, PartialEq, Serialize, sqlx::FromRow)]
pub struct WorkspaceShare {
    /// The workspace.
    pub workspace_id: Uuid,
    /// Its weight (1 unless an operator set one): it keeps weight × the window in the workers' hands.
    pub weight: i32,
    /// Its jobs handed to workers and not ended.
    pub in_flight: i64,
    /// Its part of every workspace's jobs in flight, from 0 to 1.
    pub share: f64,
}

/// A key's limits and block in a workspace, with its jobs in flight.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct WorkspaceKeyLimit {
    /// The workspace.
    pub workspace_id: Uuid,
    /// The key.
    pub key: String,
    /// At most this many of the key's jobs in flight, if set.
    pub max_in_flight: Option<i32>,
    /// At most this many handed out per `interval_ms`, if set.
    pub max_per_interval: Option<i32>,
    /// The rate's interval, in milliseconds.
    pub interval_ms: Option<i64>,
    /// None of the key's jobs is handed out before this time (a handler's rate-limited answer); past when passed.
    pub blocked_until: Option<DateTime<Utc>>,
    /// The reason the handler gave for the latest block.
    pub block_reason: Option<String>,
    /// The key's jobs handed to workers and not ended.
    pub in_flight: i64,
    /// When it last changed.
    pub updated_at: DateTime<Utc>,
}

/// A kind's concurrency limit in a workspace, with its jobs in flight.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct WorkspaceKindLimit {
    /// The workspace.
    pub workspace_id: Uuid,
    /// The kind.
    pub kind: String,
    /// At most this many of the workspace's jobs of the kind in flight.
    pub max_in_flight: i32,
    /// The kind's jobs of the workspace handed to workers and not ended.
    pub in_flight: i64,
    /// When it last changed.
    pub updated_at: DateTime<Utc>,
}

pub(super) async fn workspace_shares(admin: &Admin, actor: &Actor) -> Result<Vec<WorkspaceShare>, AdminError> {
    Ok(sqlx::query_as(
        "SELECT workspace_id, weight, in_flight, share FROM conveyor.conveyor_admin_workspace_shares($1)",
    )
    .bind(filters::actor(actor)?)
    .fetch_all(&admin.operator)
    .await?)
}

pub(super) async fn key_limits(
    admin: &Admin,
    actor: &Actor,
    workspace: Option<WorkspaceId>,
) -> Result<Vec<WorkspaceKeyLimit>, AdminError> {
    Ok(sqlx::query_as(
        "SELECT workspace_id, key, max_in_flight, max_per_interval, interval_ms, blocked_until, block_reason,
                in_flight, updated_at
         FROM conveyor.conveyor_admin_key_limits($1, $2)",
    )
    .bind(filters::actor(actor)?)
    .bind(workspace.map(|w| w.0))
    .fetch_all(&admin.operator)
    .await?)
}

pub(super) async fn kind_limits(
    admin: &Admin,
    actor: &Actor,
    workspace: Option<WorkspaceId>,
) -> Result<Vec<WorkspaceKindLimit>, AdminError> {
    Ok(sqlx::query_as(
        "SELECT workspace_id, kind, max_in_flight, in_flight, updated_at FROM conveyor.conveyor_admin_kind_limits($1, $2)",
    )
    .bind(filters::actor(actor)?)
    .bind(workspace.map(|w| w.0))
    .fetch_all(&admin.operator)
    .await?)
}

/// Runs `change` (a workspace's own limit, changed as the application role) between its audited intent and outcome.
async fn audited<T>(
    admin: &Admin,
    actor: &Actor,
    action: &'static str,
    mut arguments: Value,
    change: impl std::future::Future<Output = Result<T, crate::FlowError>>,
    outcome: impl Fn(&T) -> &'static str,
) -> Result<T, AdminError> {
    let intent = audit::intent(admin, actor, action, arguments.clone()).await?;
    match change.await.map_err(AdminError::from) {
        Ok(done) => {
            arguments["outcome"] = json!(outcome(&done));
            intent.record(admin, actor, arguments).await;
            Ok(done)
        }
        Err(e) => {
            intent.failed(admin, actor, arguments, &e).await;
            Err(e)
        }
    }
}

pub(super) async fn set_key_limit(
    admin: &Admin,
    actor: &Actor,
    workspace: WorkspaceId,
    key: &str,
    limit: KeyLimit,
) -> Result<(), AdminError> {
    limits::check_key_limit(key, limit)?;
    let arguments = json!({
        "workspace": workspace.0, "key": key, "max_in_flight": limit.max_in_flight,
        "max_per_interval": limit.max_per_interval.map(|(n, _)| n),
        "interval_ms": limit.max_per_interval.map(|(_, i)| i.as_millis() as u64),
    });
    let change = limits::set_key_limit(&admin.app, workspace, key, limit);
    audited(admin, actor, "key_limit", arguments, change, |_| "set").await
}

pub(super) async fn remove_key_limit(
    admin: &Admin,
    actor: &Actor,
    workspace: WorkspaceId,
    key: &str,
) -> Result<bool, AdminError> {
    limits::check_key(key)?;
    let arguments = json!({ "workspace": workspace.0, "key": key });
    let change = limits::remove_key_limit(&admin.app, workspace, key);
    audited(admin, actor, "remove_key_limit", arguments, change, |&removed| if removed { "removed" } else { "none" })
        .await
}

pub(super) async fn set_kind_limit(
    admin: &Admin,
    actor: &Actor,
    workspace: WorkspaceId,
    kind: &str,
    max_in_flight: u32,
) -> Result<(), AdminError> {
    limits::check_kind_limit(kind, max_in_flight)?;
    let arguments = json!({ "workspace": workspace.0, "kind": kind, "max_in_flight": max_in_flight });
    let change = limits::set_kind_limit(&admin.app, workspace, kind, max_in_flight);
    audited(admin, actor, "kind_limit", arguments, change, |_| "set").await
}

pub(super) async fn remove_kind_limit(
    admin: &Admin,
    actor: &Actor,
    workspace: WorkspaceId,
    kind: &str,
) -> Result<bool, AdminError> {
    limits::check_kind(kind)?;
    let arguments = json!({ "workspace": workspace.0, "kind": kind });
    let change = limits::remove_kind_limit(&admin.app, workspace, kind);
    audited(admin, actor, "remove_kind_limit", arguments, change, |&removed| if removed { "removed" } else { "none" })
        .await
}
