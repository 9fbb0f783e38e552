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

/// Where one migration stands in a database.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MigrationState {
    /// Ran, with the checksum this binary has.
    Applied,
    /// Not run yet (`conveyor migrate` runs it).
    Pending,
    /// Ran and failed.
    Failed,
    /// Ran with another checksum: the file changed after it ran.
    ChecksumMismatch,
    /// Ran, and this binary does not have it (a newer release ran it).
    Unknown,
}

impl MigrationState {
    /// Its name, as the JSON output spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Applied => "applied",
            Self::Pending => "pending",
            Self::Failed => "failed",
            Self::ChecksumMismatch => "checksum_mismatch",
            Self::Unknown => "unknown",
        }
    }
}

/// One migration of one crate, and where it stands.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct MigrationStatus {
    /// The crate's schema (`conveyor`, `conveyor_shop`, `conveyor_server`).
    pub schema: &'static str,
    /// Its version (the file name's number).
    pub version: i64,
    /// Its description (the file name's rest).
    pub description: String,
    /// Where it stands.
    pub state: MigrationState,
}

/// Every crate's migrations, in the order `conveyor migrate` runs them, against each crate's history table (read by
/// any role that may read it: the owner, the application or the runtime role).
pub async fn status(pool: &PgPool) -> anyhow::Result<Vec<MigrationStatus>> {
    let crates: [(&'static str, &str, Migrator); 3] = [
        (conveyor_jobs::SCHEMA, conveyor_jobs::MIGRATION_HISTORY_TABLE, conveyor_jobs::migrator()),
        (conveyor_shop::migrate::SCHEMA, conveyor_shop::migrate::HISTORY_TABLE, conveyor_shop::migrate::migrator()),
        (SCHEMA, HISTORY_TABLE, migrator()),
    ];
    let mut rows = Vec::new();
    for (schema, table, migrator) in crates {
        let exists: Option<String> =
            sqlx::query_scalar("SELECT to_regclass($1)::text").bind(table).fetch_one(pool).await?;
        let ran: Vec<(i64, Vec<u8>, bool, String)> = match exists {
            Some(_) => sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "SELECT version, checksum, success, description FROM {table} ORDER BY version"
            )))
            .fetch_all(pool)
            .await
            .with_context(|| format!("Failed to read {table}"))?,
            None => Vec::new(),
        };
        let known: std::collections::HashSet<i64> =
            migrator.iter().filter(|m| m.migration_type.is_up_migration()).map(|m| m.version).collect();
        for m in migrator.iter().filter(|m| m.migration_type.is_up_migration()) {
            let state = match ran.iter().find(|(version, ..)| *version == m.version) {
                None => MigrationState::Pending,
                Some((_, _, false, _)) => MigrationState::Failed,
                Some((_, checksum, true, _)) if checksum[..] != m.checksum[..] => MigrationState::ChecksumMismatch,
                Some(_) => MigrationState::Applied,
            };
            rows.push(MigrationStatus { schema, version: m.version, description: m.description.to_string(), state });
        }
        for (version, _, _, description) in ran.into_iter().filter(|(version, ..)| !known.contains(version)) {
            rows.push(MigrationStatus { schema, version, description, state: MigrationState::Unknown });
        }
    }
    Ok(rows)
}
