//! The shop's schema, `conveyor_shop`: its tables (stores and their credentials, media, transfers, listings, drafts,
//! catalog syncs, AI tasks) and trigger functions beside the platform's `conveyor`, with a migration history of its
//! own ([`HISTORY_TABLE`]). Its foreign keys point at the platform's operations, never back; its triggers on
//! `conveyor.operations` run functions of this schema. Run after the platform's migrations (`conveyor migrate` does
//! both), as the same owner.

use anyhow::Context;
use conveyor_jobs::{MigratedRoles, PublicLayout};
use sqlx::PgConnection;
use sqlx::migrate::Migrator;

/// The shop's schema.
pub const SCHEMA: &str = "conveyor_shop";

/// The table of the shop's migration history.
pub const HISTORY_TABLE: &str = "conveyor_shop._sqlx_migrations";

static MIGRATIONS: Migrator = sqlx::migrate!("./migrations");

/// The shop's tables: the application role's (DML), never the runtime role's.
pub const TABLES: &[&str] = &[
    "stores",
    "store_credentials",
    "media",
    "media_derivations",
    "asset_transfers",
    "listings",
    "listing_media",
    "product_drafts",
    "catalog_syncs",
    "store_products",
    "ai_usage_months",
    "ai_tasks",
    "ai_usage_ledger",
];

/// The shop's functions: triggers, which PostgreSQL calls only as the triggers of a row the caller writes (the
/// application role's and the runtime role's, as the platform's own application functions are).
pub const FUNCTIONS: &[&str] = &[
    "conveyor_listing_publication_is_final",
    "conveyor_catalog_sync_ended",
    "conveyor_catalog_sync_replayed",
    "conveyor_asset_transfer_ended",
];

/// The shop's migrations, unrun, recording their history in [`HISTORY_TABLE`].
pub fn migrator() -> Migrator {
    let mut migrator = Migrator::with_migrations(MIGRATIONS.iter().cloned().collect());
    migrator.dangerous_set_table_name(HISTORY_TABLE);
    migrator.create_schema(SCHEMA);
    migrator
}

/// Applies the shop's migrations on `owner` (the platform's already applied), after moving its objects out of
/// `public` if an earlier release left them there (shop version 12 was the last of that layout), and grants `roles`.
pub async fn run(owner: &mut PgConnection, roles: &MigratedRoles) -> anyhow::Result<()> {
    let migrator = migrator();
    let layout = PublicLayout {
        schema: SCHEMA,
        search_path: "conveyor_shop, conveyor",
        tables: TABLES,
        functions: FUNCTIONS,
        migrator: &migrator,
        through: 12,
    };
    conveyor_jobs::adopt_public_layout(&mut *owner, &layout)
        .await
        .context("Failed to adopt the shop's tables an earlier release kept in public")?;
    migrator.run(&mut *owner).await.context("Failed to apply the shop's migrations")?;

    let app = quote_ident(&roles.application);
    let runtime = quote_ident(&roles.runtime);
    let mut grants =
        vec![format!("GRANT USAGE ON SCHEMA {SCHEMA} TO {app}"), format!("GRANT SELECT ON {HISTORY_TABLE} TO {app}")];
    for table in TABLES {
        grants.push(format!("GRANT SELECT, INSERT, UPDATE, DELETE ON {SCHEMA}.{table} TO {app}"));
        grants.push(format!("REVOKE ALL ON {SCHEMA}.{table} FROM {runtime}"));
    }
    for function in FUNCTIONS {
        grants.push(format!("REVOKE ALL ON FUNCTION {SCHEMA}.{function}() FROM PUBLIC"));
        grants.push(format!("GRANT EXECUTE ON FUNCTION {SCHEMA}.{function}() TO {app}, {runtime}"));
    }
    for grant in grants {
        sqlx::query(sqlx::AssertSqlSafe(grant))
            .execute(&mut *owner)
            .await
            .context("Failed to grant the shop's tables and functions")?;
    }
    Ok(())
}

/// How many of the shop's migrations the database has not applied (0 when current).
pub async fn pending_versions(pool: &sqlx::PgPool) -> Result<usize, sqlx::Error> {
    let applied: Vec<i64> =
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT version FROM {HISTORY_TABLE} WHERE success")))
            .fetch_all(pool)
            .await?;
    Ok(MIGRATIONS.iter().filter(|m| !applied.contains(&m.version)).count())
}

fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}
