//! Queue operations across workspaces: drain a queue or kind (cancel its waiting jobs) in one workspace or, said
//! explicitly, in all; clean a workspace's ended jobs; obliterate a workspace's queue. The workspaces come from the audited
//! `conveyor_admin_waiting_workspaces`; each change runs as the application role in its workspace, under row-level
//! security (`crate::drain_jobs`, `crate::clean_jobs`), with its intent on the audit trail first and its outcome after.

use serde::{Deserialize, Serialize};
use serde_json::json;
use uuid::Uuid;

use super::{Actor, Admin, AdminError, audit, filters};
use crate::ids::WorkspaceId;
use crate::outbox::control::JobStatus;
use crate::{CleanJobs, JobScope, ObliterateError, Obliterated};

/// Which waiting jobs a drain cancels: of a queue, a kind or both (at least one), in one workspace or, with `all`,
/// in every workspace.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct DrainFilter {
    /// Of this queue.
    pub queue: Option<String>,
    /// Of this kind.
    pub kind: Option<String>,
    /// In this workspace.
    pub workspace: Option<Uuid>,
    /// In every workspace, said explicitly (refused with `workspace`).
    #[serde(default)]
    pub all: bool,
}

/// What a drain did.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DrainOutcome {
    /// Workspaces drained (each counted once).
    pub workspaces: u64,
    /// Waiting jobs canceled.
    pub canceled: u64,
}

/// Which ended jobs of one workspace a clean deletes.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct CleanFilter {
    /// The end: `succeeded`, `failed` or `canceled`.
    pub status: JobStatus,
    /// In this workspace.
    pub workspace: Uuid,
    /// Of this queue.
    pub queue: Option<String>,
    /// Of this kind.
    pub kind: Option<String>,
    /// Ended at least this many seconds ago.
    pub older_than_seconds: Option<u64>,
    /// All but the newest this many.
    pub keep_last: Option<u32>,
}

/// Which workspace's queue an obliterate empties, and whether it cancels jobs that run.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct ObliterateFilter {
    /// In this workspace.
    pub workspace: Uuid,
    /// Cancel the queue's jobs that workers run too (else refused while there are some).
    #[serde(default)]
    pub force: bool,
}

/// What an obliterate did.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Obliteration {
    /// Emptied: see [`crate::obliterate_queue`].
    Done(Obliterated),
    /// Refused, nothing changed: this many jobs of the queue run, and `force` was not given.
    Running {
        /// Jobs of the queue handed to workers.
        running: u64,
    },
}

fn scope(queue: &Option<String>, kind: &Option<String>) -> JobScope {
    match (queue, kind) {
        (Some(queue), Some(kind)) => JobScope::queue(queue.clone()).and_kind(kind.clone()),
        (Some(queue), None) => JobScope::queue(queue.clone()),
        (None, Some(kind)) => JobScope::kind_named(kind.clone()),
        (None, None) => JobScope::every_queue(),
    }
}

/// Cancels the waiting jobs `filter` names, workspace by workspace.
pub(super) async fn drain(admin: &Admin, actor: &Actor, filter: &DrainFilter) -> Result<DrainOutcome, AdminError> {
    if filter.queue.is_none() && filter.kind.is_none() {
        return Err(AdminError::Invalid("a drain names a queue, a kind or both".into()));
    }
    if filter.workspace.is_some() == filter.all {
        return Err(AdminError::Invalid("a drain names a workspace, or every workspace with \"all\": true".into()));
    }
    let arguments =
        json!({ "queue": filter.queue, "kind": filter.kind, "workspace": filter.workspace, "all": filter.all });
    let intent = audit::intent(admin, actor, "drain", arguments.clone()).await?;
    let scope = scope(&filter.queue, &filter.kind);
    let mut outcome = DrainOutcome::default();
    let result: Result<(), AdminError> = async {
        if let Some(workspace) = filter.workspace {
            outcome.canceled += crate::drain_jobs(&admin.app, WorkspaceId(workspace), &scope).await?;
            outcome.workspaces += 1;
            return Ok(());
        }
        // Each round drains the workspaces that still have waiting jobs in scope; a round that cancels nothing ends
        // it (jobs enqueued meanwhile may be left, as in one workspace).
        let mut drained = std::collections::BTreeSet::new();
        loop {
            let workspaces: Vec<Uuid> = sqlx::query_scalar(
                "SELECT workspace_id FROM conveyor.conveyor_admin_waiting_workspaces($1, $2, $3, 500)",
            )
            .bind(filters::actor(actor)?)
            .bind(&filter.queue)
            .bind(&filter.kind)
            .fetch_all(&admin.operator)
            .await?;
            let mut round = 0;
            for workspace in &workspaces {
                round += crate::drain_jobs(&admin.app, WorkspaceId(*workspace), &scope).await?;
                drained.insert(*workspace);
            }
            outcome.canceled += round;
            outcome.workspaces = drained.len() as u64;
            if workspaces.len() < 500 || round == 0 {
                return Ok(());
            }
        }
    }
    .await;
    let mut recorded = arguments;
    recorded["workspaces"] = json!(outcome.workspaces);
    recorded["canceled"] = json!(outcome.canceled);
    match result {
        Ok(()) => {
            recorded["outcome"] = json!("done");
            intent.record(admin, actor, recorded).await;
            Ok(outcome)
        }
        Err(e) => {
            intent.failed(admin, actor, recorded, &e).await;
            Err(e)
        }
    }
}

/// Deletes the ended jobs of one workspace that `filter` names; returns how many.
pub(super) async fn clean(admin: &Admin, actor: &Actor, filter: &CleanFilter) -> Result<u64, AdminError> {
    let Some(mut clean) = CleanJobs::ended(filter.status) else {
        return Err(AdminError::Invalid(format!(
            "a clean takes ended jobs: succeeded, failed or canceled, not {}",
            filter.status.as_str()
        )));
    };
    if filter.older_than_seconds.is_none() && filter.keep_last.is_none() {
        return Err(AdminError::Invalid(
            "a clean names older_than_seconds, keep_last or both (older_than_seconds 0 takes every ended job)".into(),
        ));
    }
    if filter.older_than_seconds.is_some_and(|s| s > 10 * 366 * 24 * 3600) {
        return Err(AdminError::Invalid("older_than_seconds must be at most ten years".into()));
    }
    clean = clean.scope(scope(&filter.queue, &filter.kind));
    if let Some(seconds) = filter.older_than_seconds {
        clean = clean.older_than(std::time::Duration::from_secs(seconds));
    }
    if let Some(n) = filter.keep_last {
        clean = clean.keep_last(n);
    }
    let arguments = json!({
        "status": filter.status, "workspace": filter.workspace, "queue": filter.queue, "kind": filter.kind,
        "older_than_seconds": filter.older_than_seconds, "keep_last": filter.keep_last,
    });
    let intent = audit::intent(admin, actor, "clean", arguments.clone()).await?;
    let mut recorded = arguments;
    match crate::clean_jobs(&admin.app, WorkspaceId(filter.workspace), &clean).await {
        Ok(deleted) => {
            recorded["outcome"] = json!("done");
            recorded["deleted"] = json!(deleted);
            intent.record(admin, actor, recorded).await;
            Ok(deleted)
        }
        Err(e) => {
            let e = AdminError::from(e);
            intent.failed(admin, actor, recorded, &e).await;
            Err(e)
        }
    }
}

/// Empties a workspace's queue ([`crate::obliterate_queue`]), audited as `obliterate`.
pub(super) async fn obliterate(
    admin: &Admin,
    actor: &Actor,
    queue: &str,
    filter: &ObliterateFilter,
) -> Result<Obliteration, AdminError> {
    if !crate::valid_queue_name(queue) {
        return Err(AdminError::Invalid(format!("`{queue}` is not a queue name")));
    }
    let arguments = json!({ "queue": queue, "workspace": filter.workspace, "force": filter.force });
    let intent = audit::intent(admin, actor, "obliterate", arguments.clone()).await?;
    let mut recorded = arguments;
    match crate::obliterate_queue(&admin.app, WorkspaceId(filter.workspace), queue, filter.force).await {
        Ok(done) => {
            recorded["outcome"] = json!("done");
            recorded["done"] = json!(done);
            intent.record(admin, actor, recorded).await;
            Ok(Obliteration::Done(done))
        }
        Err(ObliterateError::Running(running)) => {
            recorded["outcome"] = json!("refused");
            recorded["running"] = json!(running);
            intent.record(admin, actor, recorded).await;
            Ok(Obliteration::Running { running })
        }
        Err(ObliterateError::Database(e)) => {
            let e = AdminError::from(e);
            intent.failed(admin, actor, recorded, &e).await;
            Err(e)
        }
    }
}
