//! `conveyor migrate` (and [`migrate`], the same from a program): applies `migrations/` as the owner role, then grants
//! each role what it needs and no more, after checking that it is neither superuser, `BYPASSRLS`, the owner nor a
//! member of the owner, any of which would walk through row-level security:
//!
//! - the application role (`CONVEYOR_DATABASE_URL`: the API, job handlers): DML on Conveyor's tables (`job_kinds`,
//!   `workspace_weights` and `dispatch_pauses` read only: [`READ_ONLY_TABLES`]) and `EXECUTE` on the functions of
//!   [`APPLICATION_FUNCTIONS`] alone, each proven to stay in the caller's workspace;
//! - the runtime role (`CONVEYOR_RUNTIME_DATABASE_URL`: dispatcher, maintenance, the worker's bookkeeping): DML on
//!   the platform's tables alone ([`RUNTIME_TABLES`], never a business table; the operator's weights and pauses it
//!   only reads), every `conveyor_` function but the
//!   operator's (among them those that read or change rows of several
//!   workspaces in one call), and a policy that reads every pause (the relay's claim reads them across workspaces);
//! - the operator role (`CONVEYOR_OPERATOR_DATABASE_URL`, optional): `EXECUTE` on the audited `conveyor_admin_*`
//!   functions and nothing else.
//!
//! It also writes `CONVEYOR_AUDIT_RETENTION` into `conveyor_settings` (migration 0035, the owner's alone): the floor
//! under which `conveyor_audit_purge` deletes nothing, whatever its caller asks.
//!
//! PUBLIC loses `EXECUTE` on every `conveyor_` function (PostgreSQL grants it on creation), so a function added
//! later reaches no role but the runtime until it is listed.
//!
//! Conveyor keeps its migration history in a table of its own, [`HISTORY_TABLE`], so that a service that applies its
//! own sqlx migrations to the same database (into sqlx's default `_sqlx_migrations`) never clashes with Conveyor's.
//! A database migrated by an earlier release, whose history is in `_sqlx_migrations`, has it adopted on the next run.

use crate::error::Public;
use anyhow::{Context, bail};
use sqlx::migrate::Migrator;
use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection, PgPool};

use crate::Secret;
use std::time::Duration;

/// The migrations, embedded in the binary.
pub static MIGRATOR: Migrator = sqlx::migrate!("./migrations");

/// The table of Conveyor's migration history.
pub const HISTORY_TABLE: &str = "conveyor_schema_migrations";

/// Conveyor's tables: the application role gets DML on these and no others (a service sharing the database keeps its
/// own grants).
const TABLES: &[&str] = &[
    "idempotency_requests",
    "operations",
    "outbox_events",
    "stores",
    "store_credentials",
    "job_kinds",
    "media",
    "media_derivations",
    "asset_transfers",
    "listings",
    "listing_media",
    "product_drafts",
    "workspace_weights",
    "dispatch_pauses",
    "job_key_limits",
    "job_kind_limits",
    "catalog_syncs",
    "store_products",
    "ai_usage_months",
    "ai_tasks",
    "ai_usage_ledger",
    "job_schedules",
    "job_schedule_runs",
    "job_failures",
];

/// The tables the runtime role works on (DML): the platform's own. The business tables (stores and their credentials,
/// media, transfers, listings, drafts, catalog syncs, AI tasks) are never the runtime's: the dispatcher, maintenance
/// and the worker's bookkeeping read and write jobs, operations, limits and schedules only (a trigger that reaches a
/// business table on an operation's end runs as the owner, written safely, see migration 0034).
const RUNTIME_TABLES: &[&str] = &[
    "idempotency_requests",
    "operations",
    "outbox_events",
    "job_kinds",
    "job_key_limits",
    "job_kind_limits",
    "job_schedules",
    "job_schedule_runs",
    "job_failures",
];

/// The operator's functions (`LIKE` pattern): granted to the operator role only, never to the application role.
const ADMIN_FUNCTIONS: &str = "conveyor\\_admin\\_%";

/// The functions the application role may execute (every overload of each name): each reads and writes only the
/// workspace of the caller's context (`app.workspace_id`, under row-level security), or no table at all. Every other
/// `conveyor_` function but the operator's is the runtime role's. `server/tests/api/rls.rs` proves each one and fails when the
/// application role can execute anything else.
pub const APPLICATION_FUNCTIONS: &[&str] = &[
    // The workspace of the caller's context: what every row-level security policy compares with.
    "conveyor_current_workspace",
    // Pure: no table.
    "conveyor_uuid_v7",
    "conveyor_job_state",
    // Enqueues in the caller's workspace, refused without one (SECURITY INVOKER, under row-level security).
    "conveyor_enqueue",
    // Trigger functions: PostgreSQL refuses to call them but as the triggers of a row the caller writes.
    "conveyor_listing_publication_is_final",
    "conveyor_catalog_sync_ended",
    "conveyor_catalog_sync_replayed",
    "conveyor_asset_transfer_ended",
];

/// The tables the runtime role only reads: the operator's weights and pauses (the relay's claim reads them; only the
/// audited `conveyor_admin_*` functions change them).
const RUNTIME_READ_ONLY_TABLES: &[&str] = &["workspace_weights", "dispatch_pauses"];

/// The tables the application role only reads: the kinds (the worker's bookkeeping, as the runtime role, registers
/// them), and the operator's data, weights and pauses (migration 0035: changed through the audited
/// `conveyor_admin_pause`, `conveyor_admin_resume` and `conveyor_admin_set_weight`; the application role reads the
/// pauses that hold its jobs).
const READ_ONLY_TABLES: &[&str] = &["job_kinds", "workspace_weights", "dispatch_pauses"];

/// What `conveyor migrate` needs: the owner's URL, and the roles to grant.
#[derive(Clone, Debug)]
pub struct MigrateConfig {
    /// PostgreSQL URL of the owner role (`CONVEYOR_MIGRATION_DATABASE_URL`).
    pub migration_database_url: Secret<String>,
    /// PostgreSQL URL of the application role (`CONVEYOR_DATABASE_URL`); its user is granted DML rights.
    pub database_url: Secret<String>,
    /// PostgreSQL URL of the runtime role (`CONVEYOR_RUNTIME_DATABASE_URL`); its user is granted DML rights and the
    /// functions that work across workspaces.
    pub runtime_database_url: Secret<String>,
    /// PostgreSQL URL of the operator role (`CONVEYOR_OPERATOR_DATABASE_URL`, optional); its user is granted the
    /// audited `conveyor_admin_*` functions and nothing else.
    pub operator_database_url: Option<Secret<String>>,
    /// The audit trail's retention (`CONVEYOR_AUDIT_RETENTION`, at least 1d): written where only the owner can change
    /// it, as the floor of every purge; `None` writes the default, 90 days.
    pub audit_retention: Option<Duration>,
    /// Dead letters' retention (`CONVEYOR_DEAD_LETTER_RETENTION`, at least 1d), written the same way as the floor of
    /// every purge of them; `None` writes the default, 30 days.
    pub dead_letter_retention: Option<Duration>,
}

/// What `CONVEYOR_AUDIT_RETENTION` defaults to, written by [`migrate`] and a [`MigrateConfig`] without one.
const DEFAULT_AUDIT_RETENTION: std::time::Duration = crate::maintenance::DEFAULT_AUDIT_RETENTION;
const DEFAULT_DEAD_LETTER_RETENTION: std::time::Duration = crate::maintenance::DEFAULT_DEAD_LETTER_RETENTION;

/// The policy through which the runtime role reads every pause (`dispatch_pauses`, under row-level security since
/// migration 0026): the relay's claim reads them for every workspace it claims from.
const RUNTIME_PAUSES_POLICY: &str = "runtime_scan";

/// The embedded migrations, recording their history in [`HISTORY_TABLE`].
fn migrator() -> Migrator {
    let mut migrator = Migrator::with_migrations(MIGRATOR.iter().cloned().collect());
    migrator.dangerous_set_table_name(HISTORY_TABLE);
    migrator
}

/// A database migrated by an earlier release kept Conveyor's history in sqlx's default `_sqlx_migrations`: copy the
/// rows of Conveyor's versions into [`HISTORY_TABLE`], once, and leave that table alone (sqlx then checks their
/// checksums as usual). Serialized by an advisory lock, so replicas migrating at once adopt it once.
async fn adopt_old_history(conn: &mut PgConnection) -> anyhow::Result<()> {
    let versions: Vec<i64> = MIGRATOR.iter().map(|m| m.version).collect();
    let mut tx = conn.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('conveyor-migrate-adopt', 0))")
        .execute(&mut *tx)
        .await?;
    let (ours, old): (bool, bool) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT to_regclass('{HISTORY_TABLE}') IS NOT NULL, to_regclass('_sqlx_migrations') IS NOT NULL"
    )))
    .fetch_one(&mut *tx)
    .await?;
    if ours || !old {
        return Ok(());
    }
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE IF NOT EXISTS {HISTORY_TABLE} (LIKE _sqlx_migrations INCLUDING ALL)"
    )))
    .execute(&mut *tx)
    .await?;
    let adopted = sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {HISTORY_TABLE} SELECT * FROM _sqlx_migrations WHERE version = ANY($1) ON CONFLICT DO NOTHING"
    )))
    .bind(&versions)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    tx.commit().await?;
    tracing::info!(adopted, "Adopted Conveyor's migration history from _sqlx_migrations");
    Ok(())
}

/// Which role may execute a function.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Reach {
    /// The operator role alone (`conveyor_admin_*`).
    Operator,
    /// The application role and the runtime role ([`APPLICATION_FUNCTIONS`]).
    Application,
    /// The runtime role alone (every other `conveyor_` function).
    Runtime,
}

fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// Applies Conveyor's migrations to the database at `owner_url` (as its owner role) and grants the application role
/// of `app_url` and the runtime role of `runtime_url` what each needs and no more, after checking that row-level
/// security applies to both. Safe to run again; what `conveyor migrate` does. The audit trail's retention floor is
/// the default, 90 days ([`run`] with a [`MigrateConfig`] sets another).
///
/// The application role is the one of your requests and of the job handlers' transactions; the runtime role is the
/// one of the [`Dispatcher`](crate::Dispatcher)'s pool and of the worker's bookkeeping
/// ([`WorkerBuilder::runtime_pool`](crate::WorkerBuilder::runtime_pool)): it alone may call the functions that work
/// on several workspaces at once.
pub async fn migrate(owner_url: &str, app_url: &str, runtime_url: &str) -> Result<(), crate::Error> {
    let config = MigrateConfig {
        migration_database_url: Secret::new(owner_url.to_owned()),
        database_url: Secret::new(app_url.to_owned()),
        runtime_database_url: Secret::new(runtime_url.to_owned()),
        operator_database_url: None,
        audit_retention: None,
        dead_letter_retention: None,
    };
    run(&config).await
}

/// Applies every migration and grants the application, runtime and operator roles. Safe to run again.
pub async fn run(config: &MigrateConfig) -> Result<(), crate::Error> {
    let (audit_retention, dead_letter_retention) = retentions(config).map_err(crate::Error::invalid)?;
    run_inner(config, audit_retention, dead_letter_retention).await.public()
}

/// The retentions `config` asks for, each at least a day.
fn retentions(config: &MigrateConfig) -> anyhow::Result<(std::time::Duration, std::time::Duration)> {
    let audit_retention = config.audit_retention.unwrap_or(DEFAULT_AUDIT_RETENTION);
    if audit_retention < std::time::Duration::from_secs(24 * 3600) {
        bail!("CONVEYOR_AUDIT_RETENTION must be at least 1d: the audit trail is kept at least a day");
    }
    let dead_letter_retention = config.dead_letter_retention.unwrap_or(DEFAULT_DEAD_LETTER_RETENTION);
    if dead_letter_retention < std::time::Duration::from_secs(24 * 3600) {
        bail!("CONVEYOR_DEAD_LETTER_RETENTION must be at least 1d: dead letters are kept at least a day");
    }
    Ok((audit_retention, dead_letter_retention))
}

async fn run_inner(
    config: &MigrateConfig,
    audit_retention: std::time::Duration,
    dead_letter_retention: std::time::Duration,
) -> anyhow::Result<()> {
    let owner_options: PgConnectOptions = crate::db::connect_options(config.migration_database_url.expose())
        .context("CONVEYOR_MIGRATION_DATABASE_URL is not a valid PostgreSQL URL")?;
    let app_options: PgConnectOptions =
        config.database_url.expose().parse().context("CONVEYOR_DATABASE_URL is not a valid PostgreSQL URL")?;
    let app_role = app_options.get_username().to_owned();

    let mut conn = PgConnection::connect_with(&owner_options).await.context("Failed to connect as the owner role")?;
    adopt_old_history(&mut conn).await.context("Failed to adopt the migration history of an earlier release")?;
    migrator().run(&mut conn).await.context("Failed to apply migrations")?;

    check_role(&mut conn, &app_role, "application role", "CONVEYOR_DATABASE_URL").await?;
    let runtime_options: PgConnectOptions = config
        .runtime_database_url
        .expose()
        .parse()
        .context("CONVEYOR_RUNTIME_DATABASE_URL is not a valid PostgreSQL URL")?;
    let runtime_role = runtime_options.get_username().to_owned();
    if runtime_role == app_role {
        bail!(
            "the runtime role `{runtime_role}` of CONVEYOR_RUNTIME_DATABASE_URL is the application role: the runtime's \
             functions work across workspaces and must not be granted to the application"
        );
    }
    check_role(&mut conn, &runtime_role, "runtime role", "CONVEYOR_RUNTIME_DATABASE_URL").await?;
    let operator_role = match &config.operator_database_url {
        None => None,
        Some(url) => {
            let options: PgConnectOptions =
                url.expose().parse().context("CONVEYOR_OPERATOR_DATABASE_URL is not a valid PostgreSQL URL")?;
            let role = options.get_username().to_owned();
            if role == app_role {
                bail!(
                    "the operator role `{role}` of CONVEYOR_OPERATOR_DATABASE_URL is the application role: the \
                     operator's functions read across workspaces and must not be granted to the application"
                );
            }
            if role == runtime_role {
                bail!(
                    "the operator role `{role}` of CONVEYOR_OPERATOR_DATABASE_URL is the runtime role of \
                     CONVEYOR_RUNTIME_DATABASE_URL: give each its own role"
                );
            }
            check_role(&mut conn, &role, "operator role", "CONVEYOR_OPERATOR_DATABASE_URL").await?;
            Some(role)
        }
    };

    let role = quote_ident(&app_role);
    let runtime = quote_ident(&runtime_role);
    let mut tx = conn.begin().await?;
    let database: (String,) = sqlx::query_as("SELECT current_database()::text").fetch_one(&mut *tx).await?;
    let database = quote_ident(&database.0);
    let tables: Vec<(String,)> =
        sqlx::query_as("SELECT tablename::text FROM pg_tables WHERE schemaname = 'public' AND tablename = ANY($1)")
            .bind(TABLES)
            .fetch_all(&mut *tx)
            .await?;
    let functions: Vec<(String, Reach)> = sqlx::query_as::<_, (String, bool, bool)>(
        "SELECT p.oid::regprocedure::text, p.proname LIKE $1, p.proname = ANY($2) FROM pg_proc p
         JOIN pg_namespace n ON n.oid = p.pronamespace
         WHERE n.nspname = 'public' AND p.proname LIKE 'conveyor\\_%'",
    )
    .bind(ADMIN_FUNCTIONS)
    .bind(APPLICATION_FUNCTIONS)
    .fetch_all(&mut *tx)
    .await?
    .into_iter()
    .map(|(function, admin, application)| {
        let reach = match (admin, application) {
            (true, _) => Reach::Operator,
            (false, true) => Reach::Application,
            (false, false) => Reach::Runtime,
        };
        (function, reach)
    })
    .collect();
    let mut grants = Vec::new();
    for grantee in [&role, &runtime] {
        grants.push(format!("GRANT CONNECT ON DATABASE {database} TO {grantee}"));
        grants.push(format!("GRANT USAGE ON SCHEMA public TO {grantee}"));
        grants.push(format!("GRANT SELECT ON {HISTORY_TABLE} TO {grantee}"));
    }
    for (t,) in &tables {
        let table = quote_ident(t);
        grants.push(format!("GRANT SELECT, INSERT, UPDATE, DELETE ON {table} TO {role}"));
        if RUNTIME_READ_ONLY_TABLES.contains(&t.as_str()) {
            // Earlier releases let it write them too.
            grants.push(format!("REVOKE ALL ON {table} FROM {runtime}"));
            grants.push(format!("GRANT SELECT ON {table} TO {runtime}"));
            continue;
        }
        grants.push(if RUNTIME_TABLES.contains(&t.as_str()) {
            format!("GRANT SELECT, INSERT, UPDATE, DELETE ON {table} TO {runtime}")
        } else {
            // Defensively too: earlier releases granted the runtime role every table.
            format!("REVOKE ALL ON {table} FROM {runtime}")
        });
    }
    // The application role reads the kinds the workers register, the weights and the pauses; it changes none (a kind
    // is every workspace's, weights and pauses are the operator's).
    grants.extend(
        tables
            .iter()
            .filter(|(t,)| READ_ONLY_TABLES.contains(&t.as_str()))
            .map(|(t,)| format!("REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON {} FROM {role}", quote_ident(t))),
    );
    for (function, reach) in &functions {
        // Defensively too: an earlier release granted every `conveyor_` function to the application role.
        grants.push(format!("REVOKE ALL ON FUNCTION {function} FROM PUBLIC"));
        match reach {
            Reach::Operator => {
                grants.push(format!("REVOKE ALL ON FUNCTION {function} FROM {role}"));
                grants.push(format!("REVOKE ALL ON FUNCTION {function} FROM {runtime}"));
            }
            Reach::Application => {
                grants.push(format!("GRANT EXECUTE ON FUNCTION {function} TO {role}"));
                grants.push(format!("GRANT EXECUTE ON FUNCTION {function} TO {runtime}"));
            }
            Reach::Runtime => {
                grants.push(format!("REVOKE ALL ON FUNCTION {function} FROM {role}"));
                grants.push(format!("GRANT EXECUTE ON FUNCTION {function} TO {runtime}"));
            }
        }
    }
    // Recreated on every run, so that it follows the runtime role when the URL names another.
    grants.push(format!("DROP POLICY IF EXISTS {RUNTIME_PAUSES_POLICY} ON dispatch_pauses"));
    grants
        .push(format!("CREATE POLICY {RUNTIME_PAUSES_POLICY} ON dispatch_pauses FOR SELECT TO {runtime} USING (true)"));
    if let Some(operator) = &operator_role {
        let operator = quote_ident(operator);
        grants.push(format!("GRANT CONNECT ON DATABASE {database} TO {operator}"));
        grants.push(format!("GRANT USAGE ON SCHEMA public TO {operator}"));
        grants.extend(
            functions
                .iter()
                .filter(|(_, reach)| *reach == Reach::Operator)
                .map(|(function, _)| format!("GRANT EXECUTE ON FUNCTION {function} TO {operator}")),
        );
    }
    for grant in grants {
        sqlx::query(sqlx::AssertSqlSafe(grant))
            .execute(&mut *tx)
            .await
            .context("Failed to grant the application, runtime and operator roles")?;
    }
    // The retentions of the audit trail and of dead letters, where no role but the owner reads or writes them: the
    // floors of their purges.
    for (setting, retention, variable) in [
        ("audit_retention", audit_retention, "CONVEYOR_AUDIT_RETENTION"),
        ("dead_letter_retention", dead_letter_retention, "CONVEYOR_DEAD_LETTER_RETENTION"),
    ] {
        sqlx::query(
            "INSERT INTO conveyor_settings (name, value) VALUES ($1, justify_hours(make_interval(secs => $2))::text)
             ON CONFLICT (name) DO UPDATE SET value = EXCLUDED.value, updated_at = now()",
        )
        .bind(setting)
        .bind(retention.as_secs_f64())
        .execute(&mut *tx)
        .await
        .with_context(|| format!("Failed to record {variable}"))?;
    }
    tx.commit().await?;
    tracing::info!(
        role = %app_role,
        runtime = %runtime_role,
        operator = operator_role.as_deref().unwrap_or("none"),
        tables = tables.len(),
        "Migrations applied and roles granted"
    );
    Ok(())
}

/// Refuses `role` (the `what` of `variable`) unless it exists and row-level security applies to it: not a superuser,
/// no `BYPASSRLS`, neither the owner (the connected role) nor a member of it.
async fn check_role(conn: &mut PgConnection, role: &str, what: &str, variable: &str) -> anyhow::Result<()> {
    let (owner, exists, superuser, bypass, member): (String, bool, bool, bool, bool) = sqlx::query_as(
        "SELECT current_user::text,
                r.rolname IS NOT NULL,
                coalesce(r.rolsuper, false),
                coalesce(r.rolbypassrls, false),
                r.rolname IS NOT NULL AND pg_has_role(r.rolname, current_user, 'MEMBER')
         FROM (SELECT 1) one LEFT JOIN pg_roles r ON r.rolname = $1",
    )
    .bind(role)
    .fetch_one(&mut *conn)
    .await
    .with_context(|| format!("Failed to inspect the {what}"))?;
    if !exists {
        bail!("the {what} `{role}` of {variable} does not exist; create it first");
    }
    if superuser || bypass || member || owner == role {
        bail!(
            "the {what} `{role}` must not be a superuser, have BYPASSRLS, or be (a member of) the owner `{owner}`: \
             row-level security would not apply to it"
        );
    }
    // Conveyor's definer functions search `pg_catalog, public, pg_temp` (migration 0034): a role that may create
    // objects in `public` could plant a function or operator there that one of them would call as the owner.
    // PostgreSQL 15 and later no longer grant it to PUBLIC; earlier releases did.
    let (create,): (bool,) = sqlx::query_as("SELECT has_schema_privilege($1, 'public', 'CREATE')")
        .bind(role)
        .fetch_one(&mut *conn)
        .await
        .with_context(|| format!("Failed to inspect the {what}'s rights on the schema public"))?;
    if create {
        bail!(
            "the {what} `{role}` of {variable} may create objects in the schema public, where Conveyor's SECURITY \
             DEFINER functions look names up: run `REVOKE CREATE ON SCHEMA public FROM PUBLIC` (and from `{role}`) \
             as the database's owner, the default since PostgreSQL 15"
        );
    }
    Ok(())
}

/// How many embedded migrations the database has not applied (0 when current).
pub async fn pending_versions(pool: &PgPool) -> Result<usize, sqlx::Error> {
    let applied: Vec<(i64,)> =
        sqlx::query_as(sqlx::AssertSqlSafe(format!("SELECT version FROM {HISTORY_TABLE} WHERE success")))
            .fetch_all(pool)
            .await?;
    Ok(MIGRATOR.iter().filter(|m| !applied.iter().any(|(v,)| *v == m.version)).count())
}

#[cfg(test)]
mod retention_tests {
    use super::*;

    #[tokio::test]
    async fn a_retention_under_a_day_is_refused_as_invalid_before_any_connection() {
        // Nothing listens on port 1: a call that connected would fail as a PostgreSQL error instead.
        let nowhere = || Secret::new("postgres://nobody@127.0.0.1:1/none".to_owned());
        let config = |audit: u64, dead: u64| MigrateConfig {
            migration_database_url: nowhere(),
            database_url: nowhere(),
            runtime_database_url: nowhere(),
            operator_database_url: None,
            audit_retention: Some(std::time::Duration::from_secs(audit)),
            dead_letter_retention: Some(std::time::Duration::from_secs(dead)),
        };
        let day = 24 * 3600;
        let e = run(&config(3600, day)).await.unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::Invalid, "{e:#}");
        assert!(e.to_string().contains("CONVEYOR_AUDIT_RETENTION"), "{e}");
        let e = run(&config(day, 60)).await.unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::Invalid, "{e:#}");
        assert!(e.to_string().contains("CONVEYOR_DEAD_LETTER_RETENTION"), "{e}");
        let e = run(&config(day, day)).await.unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::Postgres, "with valid retentions it tries to connect: {e:#}");
    }
}
