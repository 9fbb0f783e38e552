//! PostgreSQL: the pool of the application role and workspace-scoped transactions.
//!
//! The application role is subject to row-level security. [`begin_workspace`] opens a transaction and sets
//! `app.workspace_id` with `set_config(..., true)`, which is transaction-local: it ends with the transaction and can
//! never leak to the next user of a pooled connection.

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgPool, Postgres, Transaction};

use crate::ids::WorkspaceId;

/// A transaction whose every statement sees one workspace only.
pub type WorkspaceTx = Transaction<'static, Postgres>;

/// Opens a pool on `url` with at most `max_connections`.
pub async fn connect(url: &str, max_connections: u32) -> Result<PgPool, sqlx::Error> {
    let options: PgConnectOptions = url.parse()?;
    PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(options.application_name("conveyor"))
        .await
}

/// Begins a transaction scoped to `workspace`: row-level security shows and accepts only its rows.
pub async fn begin_workspace(pool: &PgPool, workspace: WorkspaceId) -> Result<WorkspaceTx, sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT set_config('app.workspace_id', $1, true)")
        .bind(workspace.0.to_string())
        .execute(&mut *tx)
        .await?;
    Ok(tx)
}
