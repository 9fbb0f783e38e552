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

/// Whether `e` means PostgreSQL cannot serve now, rather than that the request or the code is wrong: the connection
/// failed or was lost (I/O, TLS, a protocol break mid-reply, SQLSTATE class `08` but `08P01`), the server is shutting down or
/// starting (`57P01` admin shutdown, `57P02` crash shutdown, `57P03` cannot connect now), it has no connection slot
/// left (`53300`), or the pool gave none in time. The API answers these `503` with `Retry-After`; the roles retry.
pub fn is_unavailable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::Io(_) | sqlx::Error::Tls(_) => true,
        sqlx::Error::Protocol(_) => true,
        sqlx::Error::Database(d) => d.code().is_some_and(|code| unavailable_sqlstate(&code)),
        _ => false,
    }
}

/// The SQLSTATEs of [`is_unavailable`].
fn unavailable_sqlstate(code: &str) -> bool {
    // Class 08 but 08P01 (protocol_violation), which a wrong number of bind parameters raises too: a bug, not an
    // outage.
    matches!(code, "08000" | "08001" | "08003" | "08004" | "08006" | "08007" | "57P01" | "57P02" | "57P03" | "53300")
}

/// The options of a PostgreSQL URL. TLS is used when the URL asks for it (`sslmode=require`, `verify-ca` or
/// `verify-full`, as libpq reads them, or `PGSSLMODE`), and then never falls back to plain text. A URL that names no
/// `sslmode` speaks plain text, where libpq would try TLS first without verifying anything (`prefer`, which an
/// attacker on the path can downgrade anyway): running jobs canceled over such a connection were seen not to end
/// (server/tests/api/operations.rs), so TLS is a choice made in the URL, with verification.
pub fn connect_options(url: &str) -> Result<PgConnectOptions, sqlx::Error> {
    let options: PgConnectOptions = url.parse()?;
    let named =
        url::Url::parse(url).map(|u| u.query_pairs().any(|(k, _)| k == "sslmode" || k == "ssl-mode")).unwrap_or(false);
    if named || std::env::var_os("PGSSLMODE").is_some() {
        return Ok(options);
    }
    Ok(options.ssl_mode(sqlx::postgres::PgSslMode::Disable))
}

/// A connection of [`pool_options`]' pools idle at least this long is checked (a round trip) before the pool hands
/// it out again.
pub const CHECK_IDLE_AFTER: Duration = Duration::from_secs(1);

/// The options of every pool Conveyor opens: sqlx's, but a connection is checked before it is handed out only when it
/// has been idle [`CHECK_IDLE_AFTER`] or longer (HikariCP's rule). sqlx checks every connection twice per use, a round
/// trip each, as it takes it and as it gives it back: the second flushes what a dropped transaction left (its
/// `ROLLBACK`) and stays; the first, on the way of every statement and transaction, found nothing the second had not
/// found an instant before. A connection PostgreSQL closed within the last second fails its first statement instead,
/// as one closed during that statement would, and the pool replaces it.
pub fn pool_options() -> PgPoolOptions {
    PgPoolOptions::new().test_before_acquire(false).before_acquire(|conn, meta| {
        Box::pin(async move {
            if meta.idle_for >= CHECK_IDLE_AFTER {
                sqlx::Connection::ping(conn).await?;
            }
            Ok(true)
        })
    })
}

/// Opens a pool on `url` with at most `max_connections` ([`pool_options`]).
pub async fn connect(url: &str, max_connections: u32) -> Result<PgPool, sqlx::Error> {
    let options = connect_options(url)?;
    pool_options()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(options.application_name("conveyor"))
        .await
}

/// Begins a transaction of a service without tenants, in [`WorkspaceId::DEFAULT`]: enqueue its jobs in it with
/// [`enqueue_tx`](crate::enqueue_tx), beside the service's own writes, and commit.
pub async fn begin(pool: &PgPool) -> Result<WorkspaceTx, sqlx::Error> {
    begin_workspace(pool, WorkspaceId::DEFAULT).await
}

/// Begins a transaction scoped to `workspace`: row-level security shows and accepts only its rows.
pub async fn begin_workspace(pool: &PgPool, workspace: WorkspaceId) -> Result<WorkspaceTx, sqlx::Error> {
    begin_workspace_then(pool, workspace, "").await
}

/// Like [`begin_workspace`], then runs `then` (fixed SQL, no parameters) in the same round trip, after the
/// workspace is set, so row-level security applies to it.
pub(crate) async fn begin_workspace_then(
    pool: &PgPool,
    workspace: WorkspaceId,
    then: &'static str,
) -> Result<WorkspaceTx, sqlx::Error> {
    // One round trip for BEGIN and the setting. A typed UUID renders as 36 hex digits and hyphens: nothing to quote.
    let statement = format!("BEGIN; SELECT set_config('app.workspace_id', '{}', true); {then}", workspace.0);
    pool.begin_with(sqlx::AssertSqlSafe(statement)).await
}

/// Fails when `pool`'s role may not execute the functions that work across workspaces (those `conveyor migrate`
/// grants the runtime role only): `component` was given the application role's pool, and every pass would be refused.
/// Passes when PostgreSQL cannot answer now (the component's own loop retries and says so).
pub(crate) async fn ensure_runtime_role(pool: &PgPool, component: &str) -> anyhow::Result<()> {
    let check: Result<(String, bool), sqlx::Error> = sqlx::query_as(
        "SELECT current_user::text,
                has_function_privilege('conveyor.conveyor_due_outbox_workspaces(integer)', 'EXECUTE')
                AND has_function_privilege('conveyor.conveyor_complete_jobs(uuid[], uuid[], integer[], jsonb[])', 'EXECUTE')",
    )
    .fetch_one(pool)
    .await;
    match check {
        Ok((_, true)) => Ok(()),
        Ok((role, false)) => anyhow::bail!(
            "the {component}'s pool connects as `{role}`, which may not execute Conveyor's functions that work across \
             workspaces: give it the runtime role's pool (CONVEYOR_RUNTIME_DATABASE_URL, granted by `conveyor migrate`), \
             not the application role's"
        ),
        Err(e) => {
            tracing::warn!(component, error = %crate::redact::redact(&e.to_string()), "Cannot check the runtime role yet");
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_loss_and_shutdown_states_are_unavailability_and_others_are_not() {
        for code in ["08000", "08003", "08006", "08001", "08004", "57P01", "57P02", "57P03", "53300"] {
            assert!(unavailable_sqlstate(code), "{code}");
        }
        for code in ["23505", "42501", "40001", "57014", "53100", "22P02", "08P01"] {
            assert!(!unavailable_sqlstate(code), "{code}");
        }
        assert!(is_unavailable(&sqlx::Error::PoolTimedOut));
        assert!(is_unavailable(&sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionReset))));
        assert!(!is_unavailable(&sqlx::Error::RowNotFound));
    }
}
