//! What holds jobs back: pauses of the relay ([`crate::flow`]: read across workspaces through `conveyor_admin_pauses`,
//! set and lifted through `conveyor_admin_pause` and `conveyor_admin_resume`, as the operator role: pauses and
//! weights are operator data, which the application role only reads; weights likewise, through
//! `conveyor_admin_set_weight`) and
//! schedules (read across workspaces through `conveyor_admin_schedules_v2`; paused and resumed as the application role
//! in their workspace through [`crate::schedule`]). Every call is audited; a change writes its intent first (and is
//! not made if that fails), then its outcome.

use serde_json::json;
use uuid::Uuid;

use super::{Actor, Admin, AdminError, audit, filters};
use crate::flow::{self, FlowError, Pause, PauseScope};
use crate::ids::WorkspaceId;
use crate::limits::{self, GlobalLimit, GlobalLimits, GlobalScope};
use crate::schedule::{self, Schedule, ScheduleError};

impl From<FlowError> for AdminError {
    fn from(e: FlowError) -> Self {
        match e {
            FlowError::Database(e) => Self::Database(e),
            other => Self::Invalid(other.to_string()),
        }
    }
}

impl From<ScheduleError> for AdminError {
    fn from(e: ScheduleError) -> Self {
        match e {
            ScheduleError::Database(e) => Self::Database(e),
            other => Self::Invalid(other.to_string()),
        }
    }
}

fn scope_arguments(scope: &PauseScope) -> serde_json::Value {
    json!({ "queue": scope.queue, "kind": scope.kind, "workspace": scope.workspace.map(|w| w.0) })
}

/// The pauses in force in every workspace, oldest first (the read is audited by the function).
pub(super) async fn pauses(admin: &Admin, actor: &Actor) -> Result<Vec<Pause>, AdminError> {
    Ok(sqlx::query_as("SELECT queue, kind, workspace_id, reason, created_at FROM conveyor.conveyor_admin_pauses($1)")
        .bind(filters::actor(actor)?)
        .fetch_all(&admin.operator)
        .await?)
}

/// Pauses `scope`; `false`: it was already paused.
pub(super) async fn pause(
    admin: &Admin,
    actor: &Actor,
    scope: &PauseScope,
    reason: Option<&str>,
) -> Result<bool, AdminError> {
    scope.check()?;
    let mut arguments = scope_arguments(scope);
    arguments["reason"] = json!(reason);
    let intent = audit::intent(admin, actor, "pause", arguments.clone()).await?;
    let who = filters::actor(actor)?;
    match flow::pause_as(&admin.operator, who, Some(intent.id()), scope, reason).await.map_err(AdminError::from) {
        // The function wrote the outcome row, naming the intent, with the pause.
        Ok(added) => Ok(added),
        Err(e) => {
            intent.failed(admin, actor, arguments, &e).await;
            Err(e)
        }
    }
}

/// Lifts the pause of exactly `scope`; `false`: there was none.
pub(super) async fn resume(admin: &Admin, actor: &Actor, scope: &PauseScope) -> Result<bool, AdminError> {
    scope.check()?;
    let arguments = scope_arguments(scope);
    let intent = audit::intent(admin, actor, "resume", arguments.clone()).await?;
    let who = filters::actor(actor)?;
    match flow::resume_as(&admin.operator, who, Some(intent.id()), scope).await.map_err(AdminError::from) {
        // The function wrote the outcome row, naming the intent, with the change.
        Ok(removed) => Ok(removed),
        Err(e) => {
            intent.failed(admin, actor, arguments, &e).await;
            Err(e)
        }
    }
}

/// Gives `workspace` `weight` times the window of jobs in the workers' hands (1 to 1000).
pub(super) async fn set_weight(
    admin: &Admin,
    actor: &Actor,
    workspace: WorkspaceId,
    weight: u32,
) -> Result<(), AdminError> {
    flow::check_weight(weight)?;
    let arguments = json!({ "workspace": workspace.0, "weight": weight });
    let intent = audit::intent(admin, actor, "weight", arguments.clone()).await?;
    let who = filters::actor(actor)?;
    match flow::set_workspace_weight_as(&admin.operator, who, Some(intent.id()), workspace, weight)
        .await
        .map_err(AdminError::from)
    {
        // The function wrote the outcome row, naming the intent, with the weight.
        Ok(()) => Ok(()),
        Err(e) => {
            intent.failed(admin, actor, arguments, &e).await;
            Err(e)
        }
    }
}

/// The global limits, with what each holds now (the read is audited by the function).
pub(super) async fn global_limits(admin: &Admin, actor: &Actor) -> Result<Vec<GlobalLimits>, AdminError> {
    Ok(limits::list_global_limits_as(&admin.operator, filters::actor(actor)?).await?)
}

fn global_arguments(scope: &GlobalScope, limit: Option<GlobalLimit>) -> serde_json::Value {
    let mut arguments = json!({ "scope": scope.scope(), "name": scope.name() });
    if let Some(limit) = limit {
        arguments["max_in_flight"] = json!(limit.max_in_flight);
        arguments["max_per_interval"] = json!(limit.max_per_interval.map(|(n, _)| n));
        arguments["interval_ms"] = json!(limit.max_per_interval.map(|(_, i)| i.as_millis() as u64));
    }
    arguments
}

/// Sets the global limit of `scope`.
pub(super) async fn set_global_limit(
    admin: &Admin,
    actor: &Actor,
    scope: &GlobalScope,
    limit: GlobalLimit,
) -> Result<(), AdminError> {
    limits::check_global(scope, limit)?;
    let arguments = global_arguments(scope, Some(limit));
    let intent = audit::intent(admin, actor, "global_limit", arguments.clone()).await?;
    let who = filters::actor(actor)?;
    match limits::set_global_limit_as(&admin.operator, who, Some(intent.id()), scope, limit)
        .await
        .map_err(AdminError::from)
    {
        // The function wrote the outcome row, naming the intent, with the limit.
        Ok(()) => Ok(()),
        Err(e) => {
            intent.failed(admin, actor, arguments, &e).await;
            Err(e)
        }
    }
}

/// Removes the global limit of `scope`; `false`: there was none.
pub(super) async fn remove_global_limit(admin: &Admin, actor: &Actor, scope: &GlobalScope) -> Result<bool, AdminError> {
    scope.check()?;
    let arguments = global_arguments(scope, None);
    let intent = audit::intent(admin, actor, "remove_global_limit", arguments.clone()).await?;
    let who = filters::actor(actor)?;
    match limits::remove_global_limit_as(&admin.operator, who, Some(intent.id()), scope).await.map_err(AdminError::from)
    {
        // The function wrote the outcome row, naming the intent, with the change.
        Ok(removed) => Ok(removed),
        Err(e) => {
            intent.failed(admin, actor, arguments, &e).await;
            Err(e)
        }
    }
}

#[derive(sqlx::FromRow)]
struct ScheduleRow {
    workspace_id: Uuid,
    #[sqlx(flatten)]
    schedule: Schedule,
}

/// Schedules of every workspace (or of one), by workspace and name.
pub(super) async fn schedules(
    admin: &Admin,
    actor: &Actor,
    workspace: Option<WorkspaceId>,
) -> Result<Vec<(Uuid, Schedule)>, AdminError> {
    let rows: Vec<ScheduleRow> = sqlx::query_as(
        "SELECT workspace_id, id, name, kind, queue, payload, cron, time_zone, every_ms, priority, max_attempts,
                start_within_ms, paused, next_run_at, last_tick_at, created_at, updated_at
         FROM conveyor.conveyor_admin_schedules_v2($1, $2)",
    )
    .bind(filters::actor(actor)?)
    .bind(workspace.map(|w| w.0))
    .fetch_all(&admin.operator)
    .await?;
    Ok(rows.into_iter().map(|r| (r.workspace_id, r.schedule)).collect())
}

/// Pauses or resumes the schedule `name` of `workspace`; `false`: no such schedule.
pub(super) async fn set_schedule_paused(
    admin: &Admin,
    actor: &Actor,
    workspace: WorkspaceId,
    name: &str,
    paused: bool,
) -> Result<bool, AdminError> {
    filters::schedule_name(name)?;
    let action = if paused { "pause_schedule" } else { "resume_schedule" };
    let mut arguments = json!({ "workspace": workspace.0, "name": name });
    let intent = audit::intent(admin, actor, action, arguments.clone()).await?;
    let found = if paused {
        schedule::pause_schedule(&admin.app, workspace, name).await
    } else {
        schedule::resume_schedule(&admin.app, workspace, name).await
    };
    match found.map_err(AdminError::from) {
        Ok(found) => {
            arguments["outcome"] = json!(if found { "done" } else { "not_found" });
            intent.record(admin, actor, arguments).await;
            Ok(found)
        }
        Err(e) => {
            intent.failed(admin, actor, arguments, &e).await;
            Err(e)
        }
    }
}
