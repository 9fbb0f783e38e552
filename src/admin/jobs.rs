//! Jobs across workspaces: search and detail through the operator's functions; cancel and retry as the application
//! role in the job's own workspace, through the transitions module, each with its intent on the audit trail before it
//! runs (not made if that fails) and its outcome after.

use chrono::{DateTime, Utc};
use serde_json::json;
use uuid::Uuid;

use super::{
    Actor, Admin, AdminError, Attempt, FlowRelative, JobAction, JobDetail, JobFilter, JobSummary, Page, audit, filters,
};
use crate::db;
use crate::ids::{JobId, WorkspaceId};
use crate::outbox::control::JobStatus;
use crate::outbox::transitions::{self, Cancel, Replay, RunNow};

/// The columns of [`JobSummary`] that `conveyor_admin_jobs` and `conveyor_admin_job` return.
#[derive(sqlx::FromRow)]
struct SummaryRow {
    id: Uuid,
    workspace_id: Uuid,
    kind: String,
    queue: String,
    state: String,
    failed_runs: i32,
    last_error: Option<String>,
    operation_id: Option<Uuid>,
    created_at: DateTime<Utc>,
    run_at: DateTime<Utc>,
    finished_at: Option<DateTime<Utc>>,
}

impl TryFrom<SummaryRow> for JobSummary {
    type Error = sqlx::Error;

    fn try_from(r: SummaryRow) -> Result<Self, sqlx::Error> {
        Ok(Self {
            id: r.id,
            workspace_id: r.workspace_id,
            kind: r.kind,
            queue: r.queue,
            status: filters::parse_state(&r.state)?,
            failed_runs: u32::try_from(r.failed_runs).unwrap_or(0),
            last_error: r.last_error,
            operation_id: r.operation_id,
            created_at: r.created_at,
            run_at: r.run_at,
            finished_at: r.finished_at,
        })
    }
}

#[derive(sqlx::FromRow)]
struct DetailRow {
    #[sqlx(flatten)]
    summary: SummaryRow,
    payload: serde_json::Value,
    priority: i16,
    max_attempts: Option<i32>,
    dedup_key: Option<String>,
    progress: Option<serde_json::Value>,
    result: Option<serde_json::Value>,
    dispatched_at: Option<DateTime<Utc>>,
    failures: serde_json::Value,
}

const SUMMARY: &str =
    "id, workspace_id, kind, queue, state, failed_runs, last_error, operation_id, created_at, run_at, finished_at";

/// Jobs matching `filter`, newest first.
pub(super) async fn search(admin: &Admin, actor: &Actor, filter: &JobFilter) -> Result<Page<JobSummary>, AdminError> {
    let limit = filters::jobs(filter)?;
    let rows: Vec<SummaryRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {SUMMARY} FROM conveyor.conveyor_admin_jobs($1, $2, $3, $4, $5, $6, $7, $8, $9)"
    )))
    .bind(filters::actor(actor)?)
    .bind(&filter.queue)
    .bind(&filter.kind)
    .bind(filter.status.map(filters::state_name))
    .bind(filter.workspace)
    .bind(filter.since)
    .bind(filter.until)
    .bind(filter.before)
    .bind(limit)
    .fetch_all(&admin.operator)
    .await?;
    let items = rows.into_iter().map(JobSummary::try_from).collect::<Result<Vec<_>, _>>()?;
    Ok(page(items, limit, |j| j.id))
}

/// The page of `items` (at most `limit`), with the cursor of the next when this one is full.
pub(super) fn page<T>(items: Vec<T>, limit: i32, id: impl Fn(&T) -> Uuid) -> Page<T> {
    let next = (items.len() == limit as usize).then(|| items.last().map(id)).flatten();
    Page { items, next }
}

/// One job in full, in whichever workspace.
pub(super) async fn detail(admin: &Admin, actor: &Actor, id: JobId) -> Result<Option<JobDetail>, AdminError> {
    let row: Option<DetailRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {SUMMARY}, payload, priority, max_attempts, dedup_key, progress, result, dispatched_at, failures
         FROM conveyor.conveyor_admin_job($1, $2)"
    )))
    .bind(filters::actor(actor)?)
    .bind(id.0)
    .fetch_optional(&admin.operator)
    .await?;
    let Some(row) = row else { return Ok(None) };
    let mut attempts: Vec<Attempt> = serde_json::from_value(row.failures)
        .map_err(|e| sqlx::Error::Decode(format!("a job's failures do not decode: {e}").into()))?;
    // Each run's start and worker (migration 0068): the failed runs in the same order as `failures`, then the last.
    let runs: Vec<(bool, Option<DateTime<Utc>>, Option<String>)> =
        sqlx::query_as("SELECT last, run_started_at, run_by FROM conveyor.conveyor_admin_job_runs($1, $2)")
            .bind(filters::actor(actor)?)
            .bind(id.0)
            .fetch_all(&admin.operator)
            .await?;
    let (mut run_started_at, mut ran_by) = (None, None);
    let mut failed = attempts.iter_mut();
    for (last, started_at, by) in runs {
        if last {
            (run_started_at, ran_by) = (started_at, by);
        } else if let Some(attempt) = failed.next() {
            (attempt.started_at, attempt.ran_by) = (started_at, by);
        }
    }
    let logs = sqlx::query_as("SELECT seq, attempt, at, line FROM conveyor.conveyor_admin_job_logs($1, $2)")
        .bind(filters::actor(actor)?)
        .bind(id.0)
        .fetch_all(&admin.operator)
        .await?;
    type FamilyRow = (
        String,
        Uuid,
        String,
        String,
        String,
        Option<String>,
        i32,
        Option<DateTime<Utc>>,
        Option<String>,
        Option<DateTime<Utc>>,
    );
    let family: Vec<FamilyRow> = sqlx::query_as(
        "SELECT relation, id, kind, queue, state, child_failure, children_left, finished_at, traceparent, expires_at
         FROM conveyor.conveyor_admin_job_family_v2($1, $2)",
    )
    .bind(filters::actor(actor)?)
    .bind(id.0)
    .fetch_all(&admin.operator)
    .await?;
    let (mut parent, mut children, mut waits_for, mut trace_id, mut deadline) = (None, Vec::new(), 0, None, None);
    for (relation, id, kind, queue, state, on_failure, children_left, finished_at, traceparent, expires_at) in family {
        if relation == "self" {
            waits_for = children_left.max(0) as u32;
            trace_id = traceparent.as_deref().and_then(crate::telemetry::trace_id_of);
            deadline = expires_at;
            continue;
        }
        let relative = FlowRelative {
            id,
            kind,
            queue,
            status: filters::parse_state(&state)?,
            on_failure: on_failure.unwrap_or_default(),
            children_left: children_left.max(0) as u32,
            finished_at,
        };
        if relation == "parent" { parent = Some(relative) } else { children.push(relative) }
    }
    Ok(Some(JobDetail {
        job: row.summary.try_into()?,
        payload: row.payload,
        priority: row.priority,
        max_attempts: row.max_attempts.and_then(|a| u32::try_from(a).ok()),
        dedup_key: row.dedup_key,
        progress: row.progress,
        result: row.result,
        dispatched_at: row.dispatched_at,
        attempts,
        logs,
        parent,
        children,
        children_left: waits_for,
        trace_id,
        expires_at: deadline,
        run_started_at,
        ran_by,
    }))
}

/// Where a job is, before a change: its workspace, its operation, its state.
pub(super) struct Located {
    pub(super) workspace: WorkspaceId,
    pub(super) operation: Option<Uuid>,
    pub(super) status: JobStatus,
}

/// Finds the job `id` in whichever workspace (audited as `locate_job`).
pub(super) async fn locate(admin: &Admin, actor: &Actor, id: JobId) -> Result<Option<Located>, AdminError> {
    let row: Option<(Uuid, Option<Uuid>, String)> =
        sqlx::query_as("SELECT workspace_id, operation_id, state FROM conveyor.conveyor_admin_locate_job($1, $2)")
            .bind(filters::actor(actor)?)
            .bind(id.0)
            .fetch_optional(&admin.operator)
            .await?;
    row.map(|(workspace, operation, state)| {
        Ok(Located { workspace: WorkspaceId(workspace), operation, status: filters::parse_state(&state)? })
    })
    .transpose()
}

/// The audit name of an action's outcome.
fn outcome(action: &JobAction) -> serde_json::Value {
    match action {
        JobAction::Done => json!("done"),
        JobAction::NotFound => json!("not_found"),
        JobAction::NotAllowed => json!("not_allowed"),
        JobAction::KeyHeld(holder) => json!({ "key_held_by": holder }),
        JobAction::Held(why) => json!({ "held": why }),
    }
}

/// Runs `change` on job `id` as `action`: its intent on the audit trail first (nothing runs if that fails), then the
/// change, then its outcome (with the job's workspace when it was found).
async fn audited<F>(
    admin: &Admin,
    actor: &Actor,
    action: &'static str,
    id: JobId,
    change: F,
) -> Result<JobAction, AdminError>
where
    F: AsyncFnOnce() -> Result<(Option<WorkspaceId>, JobAction), AdminError>,
{
    audited_with(admin, actor, action, id, json!({}), change).await
}

/// [`audited`], with `details` (an object) beside the job id in both entries: what the change sets.
async fn audited_with<F>(
    admin: &Admin,
    actor: &Actor,
    action: &'static str,
    id: JobId,
    details: serde_json::Value,
    change: F,
) -> Result<JobAction, AdminError>
where
    F: AsyncFnOnce() -> Result<(Option<WorkspaceId>, JobAction), AdminError>,
{
    let with = |mut arguments: serde_json::Value| {
        if let (Some(into), Some(from)) = (arguments.as_object_mut(), details.as_object()) {
            into.extend(from.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
        arguments
    };
    let intent = audit::intent(admin, actor, action, with(json!({ "job_id": id.0 }))).await?;
    match change().await {
        Ok((workspace, done)) => {
            let arguments = json!({ "job_id": id.0, "workspace": workspace.map(|w| w.0), "outcome": outcome(&done) });
            intent.record(admin, actor, with(arguments)).await;
            Ok(done)
        }
        Err(e) => {
            intent.failed(admin, actor, with(json!({ "job_id": id.0 })), &e).await;
            Err(e)
        }
    }
}

/// Cancels a job that has not ended, with its operation.
pub(super) async fn cancel(admin: &Admin, actor: &Actor, id: JobId) -> Result<JobAction, AdminError> {
    audited(admin, actor, "cancel_job", id, async || {
        let Some(job) = locate(admin, actor, id).await? else { return Ok((None, JobAction::NotFound)) };
        let mut tx = db::begin_workspace(&admin.app, job.workspace).await?;
        let canceled = transitions::cancel_job_tx(&mut tx, job.workspace, id).await?;
        tx.commit().await?;
        let done = match canceled {
            Cancel::Canceled => JobAction::Done,
            Cancel::Finished(_) => JobAction::NotAllowed,
            Cancel::NotFound => JobAction::NotFound,
        };
        Ok((Some(job.workspace), done))
    })
    .await
}

/// Runs a job again: a dead letter from its first attempt, a delayed or retrying job now (unless a pause or its key's
/// rate-limit block holds it: see [`RunNow::Held`]).
pub(super) async fn retry(admin: &Admin, actor: &Actor, id: JobId) -> Result<JobAction, AdminError> {
    audited(admin, actor, "retry_job", id, async || {
        let Some(job) = locate(admin, actor, id).await? else { return Ok((None, JobAction::NotFound)) };
        let done = match job.status {
            JobStatus::Failed => {
                let mut tx = db::begin_workspace(&admin.app, job.workspace).await?;
                let replayed = transitions::replay_tx(&mut tx, job.workspace, id.0, job.operation).await?;
                tx.commit().await?;
                match replayed {
                    Replay::Replayed => JobAction::Done,
                    Replay::KeyHeld(holder) => JobAction::KeyHeld(holder),
                    Replay::NotDeadLetter => JobAction::NotAllowed,
                }
            }
            JobStatus::Scheduled | JobStatus::Retrying => {
                let mut tx = db::begin_workspace(&admin.app, job.workspace).await?;
                let moved = transitions::run_now_tx(&mut tx, job.workspace, id.0).await?;
                tx.commit().await?;
                match moved {
                    RunNow::Moved => JobAction::Done,
                    RunNow::NotWaiting => JobAction::NotAllowed,
                    RunNow::Held(why) => JobAction::Held(why),
                }
            }
            _ => JobAction::NotAllowed,
        };
        Ok((Some(job.workspace), done))
    })
    .await
}

/// Changes a waiting job in whichever workspace: its priority, due time or payload ([`crate::change_job`]; the new
/// payload is taken as the job's own kind's). Refused ([`JobAction::NotAllowed`]) once the relay took the job.
pub(super) async fn change(
    admin: &Admin,
    actor: &Actor,
    id: JobId,
    change: &crate::JobChange,
) -> Result<JobAction, AdminError> {
    // Bad input is refused before anything is read or written, the audit trail included.
    change.validate().map_err(|e| AdminError::Invalid(e.to_string()))?;
    audited_with(admin, actor, "change_job", id, change.describe(), async || {
        let Some(job) = locate(admin, actor, id).await? else { return Ok((None, JobAction::NotFound)) };
        let done = match crate::change_job(&admin.app, job.workspace, id, change).await {
            Ok(_) => JobAction::Done,
            Err(crate::ChangeError::NotFound) => JobAction::NotFound,
            Err(crate::ChangeError::NotWaiting(_)) => JobAction::NotAllowed,
            Err(crate::ChangeError::Database(e)) => return Err(e.into()),
            Err(e) => return Err(AdminError::Invalid(e.to_string())),
        };
        Ok((Some(job.workspace), done))
    })
    .await
}
