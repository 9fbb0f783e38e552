//! Flow control: pauses and workspace weights, read by the relay's claim (migration 0021).
//!
//! A pause holds jobs in the outbox, durably: a queue, a kind, a workspace, or any combination of them. Jobs already
//! handed to workers finish; held jobs keep their order and go when the pause is lifted, whatever restarted meanwhile.
//! A weight gives a workspace a larger window of jobs in the workers' hands: `CONVEYOR_DISPATCH_WINDOW × weight`.
//!
//! These are operator settings under row-level security (migration 0026): a weight, and a pause that names a
//! workspace, are that workspace's rows, written in its context (these calls set it); a pause that names no workspace
//! belongs to none. The relay's claim, as the runtime role, reads every pause.

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

/// A transaction in the context of the workspace `scope` names, if it names one (row-level security: a workspace's
/// pause is its row), or in none.
async fn begin_scope(
    pool: &PgPool,
    scope: &PauseScope,
) -> Result<sqlx::Transaction<'static, sqlx::Postgres>, sqlx::Error> {
    match scope.workspace {
        Some(workspace) => crate::db::begin_workspace(pool, workspace).await,
        None => pool.begin().await,
    }
}

/// Holds the jobs of `scope` in the outbox from the relay's next claim on. `false` when that pause already held them.
pub async fn pause(pool: &PgPool, scope: &PauseScope, reason: Option<&str>) -> Result<bool, FlowError> {
    scope.check()?;
    if reason.is_some_and(|r| r.len() > 500) {
        return Err(FlowError::OutOfRange("a pause's reason is at most 500 bytes"));
    }
    let mut tx = begin_scope(pool, scope).await?;
    let added = sqlx::query(
        "INSERT INTO dispatch_pauses (queue, kind, workspace_id, reason) VALUES ($1, $2, $3, $4)
         ON CONFLICT (coalesce(queue, ''), coalesce(kind, ''),
                      coalesce(workspace_id, '00000000-0000-0000-0000-000000000000')) DO NOTHING",
    )
    .bind(&scope.queue)
    .bind(&scope.kind)
    .bind(scope.workspace.map(|w| w.0))
    .bind(reason)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    tx.commit().await?;
    Ok(added == 1)
}

/// Lifts the pause of exactly `scope` and wakes the dispatchers. `false` when there was none.
pub async fn resume(pool: &PgPool, scope: &PauseScope) -> Result<bool, FlowError> {
    scope.check()?;
    let mut tx = begin_scope(pool, scope).await?;
    let removed = sqlx::query(
        "DELETE FROM dispatch_pauses
         WHERE queue IS NOT DISTINCT FROM $1 AND kind IS NOT DISTINCT FROM $2 AND workspace_id IS NOT DISTINCT FROM $3",
    )
    .bind(&scope.queue)
    .bind(&scope.kind)
    .bind(scope.workspace.map(|w| w.0))
    .execute(&mut *tx)
    .await?
    .rows_affected();
    // An empty payload asks every dispatcher for a sweep: the held jobs are due already.
    sqlx::query("SELECT pg_notify($1, '')").bind(crate::outbox::NOTIFY_CHANNEL).execute(&mut *tx).await?;
    tx.commit().await?;
    Ok(removed == 1)
}

/// The pauses in force that `pool`'s role reads outside any workspace, oldest first: every one with the runtime role's
/// pool; with the application role's, those that name no workspace (a workspace's own are its rows, read in its
/// context). Operators see all of them through the admin API (`GET /admin/v1/pauses`) or `conveyor flow pauses`.
pub async fn list_pauses(pool: &PgPool) -> Result<Vec<Pause>, FlowError> {
    Ok(sqlx::query_as("SELECT queue, kind, workspace_id, reason, created_at FROM dispatch_pauses ORDER BY id")
        .fetch_all(pool)
        .await?)
}

/// Gives `workspace` `weight` (1 to 1000; 1 is everyone's default) times the window of jobs in the workers' hands.
pub async fn set_workspace_weight(pool: &PgPool, workspace: WorkspaceId, weight: u32) -> Result<(), FlowError> {
    if !(1..=1000).contains(&weight) {
        return Err(FlowError::OutOfRange("a weight is from 1 to 1000"));
    }
    let mut tx = crate::db::begin_workspace(pool, workspace).await?;
    sqlx::query(
        "INSERT INTO workspace_weights (workspace_id, weight) VALUES ($1, $2)
         ON CONFLICT (workspace_id) DO UPDATE SET weight = EXCLUDED.weight, updated_at = now()",
    )
    .bind(workspace.0)
    .bind(weight as i32)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}
