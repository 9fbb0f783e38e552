//! Flow control: pauses and workspace weights, read by the relay's claim (migration 0021).
//!
//! A pause holds jobs in the outbox, durably: a queue, a kind, a workspace, or any combination of them. Jobs already
//! handed to workers finish; held jobs keep their order and go when the pause is lifted, whatever restarted meanwhile.
//! A weight gives a workspace a larger window of jobs in the workers' hands: `CONVEYOR_DISPATCH_WINDOW × weight`.
//!
//! These are operator data (migration 0035): every change goes through an audited function of the operator role
//! (`conveyor_admin_pause`, `conveyor_admin_resume`, `conveyor_admin_set_weight`), so [`pause`], [`resume`] and
//! [`set_workspace_weight`] take the operator role's pool (`CONVEYOR_OPERATOR_DATABASE_URL`) and are recorded on the
//! audit trail as `library`. The application role only reads them: a weight, and a pause that names a workspace, are
//! that workspace's rows under row-level security (read in its context); a pause that names no workspace belongs to
//! none and every role reads it. The relay's claim, as the runtime role, reads every pause.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;

use crate::ids::WorkspaceId;
use crate::kind::{self, JobKind};

/// What a pause holds: every job matching all of the fields that are set.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PauseScope {
    /// Jobs of this queue.
    pub queue: Option<String>,
    /// Jobs of this kind.
    pub kind: Option<String>,
    /// Jobs of this workspace.
    pub workspace: Option<WorkspaceId>,
}

impl PauseScope {
    /// Every job of `queue`.
    pub fn queue(queue: impl Into<String>) -> Self {
        Self { queue: Some(queue.into()), ..Self::default() }
    }

    /// Every job of kind `K`.
    pub fn kind<K: JobKind>() -> Self {
        Self { kind: Some(K::KIND.to_owned()), ..Self::default() }
    }

    /// Every job of the kind named `kind` (for tools that know kinds by name).
    pub fn kind_named(kind: impl Into<String>) -> Self {
        Self { kind: Some(kind.into()), ..Self::default() }
    }

    /// Every job of `workspace`.
    pub fn workspace(workspace: WorkspaceId) -> Self {
        Self { workspace: Some(workspace), ..Self::default() }
    }

    /// This scope, in `workspace` only.
    pub fn in_workspace(mut self, workspace: WorkspaceId) -> Self {
        self.workspace = Some(workspace);
        self
    }

    /// Refuses a scope that names nothing, or a name no queue or kind can have.
    pub(crate) fn check(&self) -> Result<(), FlowError> {
        if self.queue.is_none() && self.kind.is_none() && self.workspace.is_none() {
            return Err(FlowError::EmptyScope);
        }
        if self.queue.as_deref().is_some_and(|q| !kind::valid_queue_name(q)) {
            return Err(FlowError::InvalidName("queue"));
        }
        if self.kind.as_deref().is_some_and(|k| !kind::valid_kind_name(k)) {
            return Err(FlowError::InvalidName("kind"));
        }
        Ok(())
    }
}

/// A pause in force.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct Pause {
    /// The queue it holds, if it names one.
    pub queue: Option<String>,
    /// The kind it holds, if it names one.
    pub kind: Option<String>,
    /// The workspace it holds, if it names one.
    pub workspace_id: Option<uuid::Uuid>,
    /// Why, as given.
    pub reason: Option<String>,
    /// Since.
    pub created_at: DateTime<Utc>,
}

/// Why a flow-control call was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FlowError {
    /// A pause must name a queue, a kind or a workspace: pausing everything is stopping the dispatchers.
    #[error("a pause names a queue, a kind or a workspace")]
    EmptyScope,
    /// A queue or kind name that no job can have.
    #[error("invalid {0} name")]
    InvalidName(&'static str),
    /// A reason longer than 500 bytes, or a weight outside 1..=1000.
    #[error("{0}")]
    OutOfRange(&'static str),
    /// PostgreSQL failed.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// Who the library's changes are recorded as on the audit trail (beside the role, which the database records).
pub(crate) const LIBRARY_ACTOR: &str = "library";

/// Holds the jobs of `scope` in the outbox from the relay's next claim on. `false` when that pause already held them.
/// `pool` is the operator role's: the change is audited (`conveyor_admin_pause`); the application role's pool is
/// refused (permission denied), whatever the scope.
pub async fn pause(pool: &PgPool, scope: &PauseScope, reason: Option<&str>) -> Result<bool, FlowError> {
    pause_as(pool, LIBRARY_ACTOR, None, scope, reason).await
}

/// [`pause`] for `actor`, whose change's intent is the audit row `intent` (the admin module's).
pub(crate) async fn pause_as(
    operator: &PgPool,
    actor: &str,
    intent: Option<i64>,
    scope: &PauseScope,
    reason: Option<&str>,
) -> Result<bool, FlowError> {
    scope.check()?;
    if reason.is_some_and(|r| r.len() > 500) {
        return Err(FlowError::OutOfRange("a pause's reason is at most 500 bytes"));
    }
    let (added,): (bool,) = sqlx::query_as("SELECT conveyor.conveyor_admin_pause($1, $2, $3, $4, $5, $6)")
        .bind(actor)
        .bind(intent)
        .bind(&scope.queue)
        .bind(&scope.kind)
        .bind(scope.workspace.map(|w| w.0))
        .bind(reason)
        .fetch_one(operator)
        .await?;
    Ok(added)
}

/// Lifts the pause of exactly `scope` and wakes the dispatchers. `false` when there was none. `pool` is the operator
/// role's, as for [`pause`].
pub async fn resume(pool: &PgPool, scope: &PauseScope) -> Result<bool, FlowError> {
    resume_as(pool, LIBRARY_ACTOR, None, scope).await
}

/// [`resume`] for `actor`, whose change's intent is the audit row `intent`.
pub(crate) async fn resume_as(
    operator: &PgPool,
    actor: &str,
    intent: Option<i64>,
    scope: &PauseScope,
) -> Result<bool, FlowError> {
    scope.check()?;
    // The function also asks every dispatcher for a sweep: the held jobs are due already.
    let (removed,): (bool,) = sqlx::query_as("SELECT conveyor.conveyor_admin_resume($1, $2, $3, $4, $5)")
        .bind(actor)
        .bind(intent)
        .bind(&scope.queue)
        .bind(&scope.kind)
        .bind(scope.workspace.map(|w| w.0))
        .fetch_one(operator)
        .await?;
    Ok(removed)
}

/// The pauses in force that `pool`'s role reads outside any workspace, oldest first: every one with the runtime role's
/// pool; with the application role's, those that name no workspace (a workspace's own are its rows, read in its
/// context). Operators see all of them through the admin API (`GET /admin/v1/pauses`) or `conveyor flow pauses`.
pub async fn list_pauses(pool: &PgPool) -> Result<Vec<Pause>, FlowError> {
    Ok(sqlx::query_as("SELECT queue, kind, workspace_id, reason, created_at FROM conveyor.dispatch_pauses ORDER BY id")
        .fetch_all(pool)
        .await?)
}

/// Gives `workspace` `weight` (1 to 1000; 1 is everyone's default) times the window of jobs in the workers' hands.
/// `pool` is the operator role's: the change is audited (`conveyor_admin_set_weight`); a workspace's own application
/// role may not weigh it.
pub async fn set_workspace_weight(pool: &PgPool, workspace: WorkspaceId, weight: u32) -> Result<(), FlowError> {
    set_workspace_weight_as(pool, LIBRARY_ACTOR, None, workspace, weight).await
}

/// Refuses a weight outside 1..=1000.
pub(crate) fn check_weight(weight: u32) -> Result<(), FlowError> {
    if !(1..=1000).contains(&weight) {
        return Err(FlowError::OutOfRange("a weight is from 1 to 1000"));
    }
    Ok(())
}

/// [`set_workspace_weight`] for `actor`, whose change's intent is the audit row `intent`.
pub(crate) async fn set_workspace_weight_as(
    operator: &PgPool,
    actor: &str,
    intent: Option<i64>,
    workspace: WorkspaceId,
    weight: u32,
) -> Result<(), FlowError> {
    check_weight(weight)?;
    sqlx::query("SELECT conveyor.conveyor_admin_set_weight($1, $2, $3, $4)")
        .bind(actor)
        .bind(intent)
        .bind(workspace.0)
        .bind(weight as i32)
        .execute(operator)
        .await?;
    Ok(())
}
