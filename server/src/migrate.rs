//! `conveyor migrate`: the platform's schema `conveyor` ([`conveyor_jobs::migrate_with`]: the roles checked and
//! granted), then the shop's `conveyor_shop` ([`conveyor_shop::migrate`]), then the API's `conveyor_server` (its
//! idempotency records), each with its own history. Safe to run again; a database of the old layout, everything in
//! `public`, is adopted in place crate by crate.

use anyhow::Context;
use conveyor_jobs::{MigrateConfig, MigratedRoles, PublicLayout};
use sqlx::migrate::Migrator;
use sqlx::{Connection, PgConnection, PgPool};

/// The API's schema.
pub const SCHEMA: &str = "conveyor_server";

/// The table of the API's migration history.
pub const HISTORY_TABLE: &str = "conveyor_server._sqlx_migrations";

static MIGRATIONS: Migrator = sqlx::migrate!("./migrations");

/// The API's migrations, unrun, recording their history in [`HISTORY_TABLE`].
pub fn migrator() -> Migrator {
    let mut migrator = Migrator::with_migrations(MIGRATIONS.iter().cloned().collect());
    migrator.dangerous_set_table_name(HISTORY_TABLE);
    migrator.create_schema(SCHEMA);
    migrator
}

/// Every crate's migrations and grants, in order: what `conveyor migrate` runs.
pub async fn run(config: &MigrateConfig) -> anyhow::Result<MigratedRoles> {
    let roles = conveyor_jobs::migrate_with(config).await?;
    // The platform's reading of the URL (plain text unless `sslmode` says otherwise, as every Conveyor connection).
    let options = conveyor_jobs::postgres_options(config.owner_url.expose())
        .context("CONVEYOR_MIGRATION_DATABASE_URL is not a valid PostgreSQL URL")?;
    let mut owner = PgConnection::connect_with(&options).await.context("Failed to connect as the owner role")?;
    conveyor_shop::migrate::run(&mut owner, &roles).await?;
    run_own(&mut owner, &roles).await?;
    owner.close().await?;
    Ok(roles)
}

/// The API's own schema: the idempotency records (the application role's, and the runtime role's for the retention
/// job) and the retention's lookup (the runtime role's alone).
async fn run_own(owner: &mut PgConnection, roles: &MigratedRoles) -> anyhow::Result<()> {
    let migrator = migrator();
    let layout = PublicLayout {
        schema: SCHEMA,
        search_path: SCHEMA,
        tables: &["idempotency_requests"],
        functions: &["conveyor_expired_idempotency_workspaces"],
        migrator: &migrator,
        through: 1,
    };
    conveyor_jobs::adopt_public_layout(&mut *owner, &layout)
        .await
        .context("Failed to adopt the idempotency records an earlier release kept in public")?;
    migrator.run(&mut *owner).await.context("Failed to apply the API's migrations")?;
    let app = quote_ident(&roles.application);
    let runtime = quote_ident(&roles.runtime);
    for grant in [
        format!("GRANT USAGE ON SCHEMA {SCHEMA} TO {app}, {runtime}"),
        format!("GRANT SELECT ON {HISTORY_TABLE} TO {app}, {runtime}"),
        format!("GRANT SELECT, INSERT, UPDATE, DELETE ON {SCHEMA}.idempotency_requests TO {app}, {runtime}"),
        format!("REVOKE ALL ON FUNCTION {SCHEMA}.conveyor_expired_idempotency_workspaces(integer) FROM PUBLIC, {app}"),
        format!("GRANT EXECUTE ON FUNCTION {SCHEMA}.conveyor_expired_idempotency_workspaces(integer) TO {runtime}"),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(grant))
            .execute(&mut *owner)
            .await
            .context("Failed to grant the API's idempotency records")?;
    }
    Ok(())
}

/// How many migrations of any crate the database has not applied (0 when current): the readiness check's.
pub async fn pending_versions(pool: &PgPool) -> Result<usize, sqlx::Error> {
    let applied: Vec<i64> =
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT version FROM {HISTORY_TABLE} WHERE success")))
            .fetch_all(pool)
            .await?;
    let own = MIGRATIONS.iter().filter(|m| !applied.contains(&m.version)).count();
    Ok(conveyor_jobs::pending_migrations(pool).await? + conveyor_shop::migrate::pending_versions(pool).await? + own)
}

fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}
