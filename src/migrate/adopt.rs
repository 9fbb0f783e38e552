//! Adopting a database of the public layout. In release 0.1 every object of Conveyor's (the platform's, the
//! e-commerce product's and the HTTP API's) lived in `public`, with one history of 37 versions in
//! `public.conveyor_schema_migrations` (in its early builds, sqlx's default `public._sqlx_migrations`). Each crate now keeps
//! its objects and its history in a schema of its own; a database of the old layout has each crate's objects moved
//! there in place (`ALTER … SET SCHEMA`: rows, indexes, policies, triggers, grants and sequences go with them), the
//! functions re-pointed at the new schema, and the crate's history recorded as applied up to the version its files had
//! reached in that layout. Its later migrations then run as on any database.

use anyhow::{Context, bail};
use sqlx::migrate::Migrator;
use sqlx::{Connection, PgConnection};

/// The versions the public layout's single history had reached: a database is adopted only once it applied them all
/// (as 0.1.0's last build, commit 34f94ac, leaves it), so that what is moved is exactly what the new histories record as applied.
pub(crate) const PUBLIC_LAYOUT_VERSIONS: i64 = 37;

/// Where the adopted database's old history is kept, in the platform's schema: a record, and the proof that the
/// product crates' adoptions check that it was complete.
pub(crate) const PUBLIC_LAYOUT_HISTORY: &str = "conveyor.public_layout_history";

/// What a crate kept in `public` under the old layout, and where it goes.
#[derive(Clone, Copy, Debug)]
pub struct PublicLayout<'a> {
    /// The crate's schema (created when missing).
    pub schema: &'a str,
    /// What replaces `public` in the search path its functions pin (`conveyor_shop, conveyor` for a crate whose
    /// functions also read the platform's tables).
    pub search_path: &'a str,
    /// Its tables, moved with everything attached to them.
    pub tables: &'a [&'a str],
    /// Its functions (every overload of each name).
    pub functions: &'a [&'a str],
    /// Its migrations, with its own history table.
    pub migrator: &'a Migrator,
    /// The last of its versions whose objects the public layout held: recorded as applied, with these files'
    /// checksums.
    pub through: i64,
}

/// Moves `layout`'s objects out of `public` when the old layout left them there, in one transaction under an advisory
/// lock (replicas migrating at once adopt once). Returns whether it moved anything. The old layout is recognised by
/// all of the crate's tables together in `public`, its new history missing, and (for a product crate) the platform's
/// adoption done; anything else in `public` is the service's and left alone. Refuses a database whose old history is
/// incomplete.
///
/// What [`migrate`](crate::migrate) runs for the platform's own objects; a product crate that shipped in the public
/// layout runs it for its own before its migrations.
pub async fn adopt_public_layout(conn: &mut PgConnection, layout: &PublicLayout<'_>) -> Result<bool, crate::Error> {
    adopt(conn, layout, false).await.map_err(crate::Error::new)
}

/// The platform's adoption: checks the old history first and keeps it in [`PUBLIC_LAYOUT_HISTORY`].
pub(crate) async fn adopt_platform(conn: &mut PgConnection, layout: &PublicLayout<'_>) -> anyhow::Result<bool> {
    adopt(conn, layout, true).await
}

async fn adopt(conn: &mut PgConnection, layout: &PublicLayout<'_>, platform: bool) -> anyhow::Result<bool> {
    let schema = crate::migrate::quote_ident(layout.schema);
    let mut tx = conn.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('conveyor-migrate-adopt', 0))")
        .execute(&mut *tx)
        .await?;
    let history = layout.migrator.table_name.as_ref();
    let (new_history,): (bool,) =
        sqlx::query_as("SELECT to_regclass($1) IS NOT NULL").bind(history).fetch_one(&mut *tx).await?;
    let (present,): (i64,) = sqlx::query_as(
        "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p') AND c.relname = ANY($1)",
    )
    .bind(layout.tables)
    .fetch_one(&mut *tx)
    .await?;
    let all = present == layout.tables.len() as i64;
    if platform {
        // The old layout is told by what only Conveyor named so: its history table, or its first function. A
        // service's own `operations` or `outbox_events` in `public` is the service's, and stays where it is.
        let (old,): (bool,) = sqlx::query_as(
            "SELECT to_regclass('public.conveyor_schema_migrations') IS NOT NULL
                    OR to_regprocedure('public.conveyor_current_workspace()') IS NOT NULL",
        )
        .fetch_one(&mut *tx)
        .await?;
        if !old {
            return Ok(false);
        }
        if new_history {
            bail!(
                "public still holds Conveyor's objects of the old layout although {history} exists: the database \
                 holds both layouts (a new release migrated it without adopting it); move or drop one by hand"
            );
        }
        // Refuses a database the old layout left short of its last version, before anything moves.
        keep_old_history(&mut tx).await?;
        if !all {
            bail!(
                "public holds Conveyor's history of the old layout but only {present} of its tables: nothing is moved"
            );
        }
    } else {
        // A product's tables are the old layout's only all together, in a database whose platform objects were
        // adopted, before its own history exists.
        let (adopted,): (bool,) =
            sqlx::query_as(sqlx::AssertSqlSafe(format!("SELECT to_regclass('{PUBLIC_LAYOUT_HISTORY}') IS NOT NULL")))
                .fetch_one(&mut *tx)
                .await?;
        if new_history || !all || !adopted {
            return Ok(false);
        }
    }

    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA IF NOT EXISTS {schema}"))).execute(&mut *tx).await?;
    for table in layout.tables {
        let sql = format!("ALTER TABLE public.{} SET SCHEMA {schema}", crate::migrate::quote_ident(table));
        sqlx::query(sqlx::AssertSqlSafe(sql)).execute(&mut *tx).await?;
    }
    let functions: Vec<(i64, String)> = sqlx::query_as(
        "SELECT p.oid::int8, format('%I(%s)', p.proname, pg_get_function_identity_arguments(p.oid)) FROM pg_proc p
         JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = 'public' AND p.proname = ANY($1)",
    )
    .bind(layout.functions)
    .fetch_all(&mut *tx)
    .await?;
    for (oid, signature) in &functions {
        sqlx::query(sqlx::AssertSqlSafe(format!("ALTER FUNCTION public.{signature} SET SCHEMA {schema}")))
            .execute(&mut *tx)
            .await?;
        repoint(&mut tx, *oid, &format!("{schema}.{signature}"), layout).await?;
    }

    let sql = format!(
        "CREATE TABLE {history} (version bigint PRIMARY KEY, description text NOT NULL,
         installed_on timestamptz NOT NULL DEFAULT now(), success boolean NOT NULL, checksum bytea NOT NULL,
         execution_time bigint NOT NULL)"
    );
    sqlx::query(sqlx::AssertSqlSafe(sql)).execute(&mut *tx).await?;
    let applied: Vec<_> = layout.migrator.iter().filter(|m| m.version <= layout.through).collect();
    for m in &applied {
        let sql = format!(
            "INSERT INTO {history} (version, description, success, checksum, execution_time) VALUES ($1, $2, true, $3, 0)"
        );
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(m.version)
            .bind(m.description.as_ref())
            .bind(m.checksum.as_ref())
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    tracing::info!(
        schema = layout.schema,
        tables = layout.tables.len(),
        functions = functions.len(),
        versions = applied.len(),
        "Moved objects of an earlier release out of public"
    );
    Ok(true)
}

/// Points a moved function at its new schema: the `public` of its pinned search path becomes the crate's, and a body
/// that names `public.` relations is re-created naming the crate's schema (same oid, so its triggers stay attached).
async fn repoint(conn: &mut PgConnection, oid: i64, signature: &str, layout: &PublicLayout<'_>) -> anyhow::Result<()> {
    let (path, names_public): (Option<String>, bool) = sqlx::query_as(
        "SELECT (SELECT substr(c, length('search_path=') + 1) FROM unnest(p.proconfig) c WHERE c LIKE 'search_path=%'),
                p.prosrc ~ '\\mpublic\\.'
         FROM pg_proc p WHERE p.oid = $1::int8::oid",
    )
    .bind(oid)
    .fetch_one(&mut *conn)
    .await?;
    if let Some(path) = path {
        let repointed: Vec<&str> = path
            .split(',')
            .map(str::trim)
            .flat_map(|s| if s == "public" { layout.search_path.split(", ").collect() } else { vec![s] })
            .collect();
        let sql = format!("ALTER FUNCTION {signature} SET search_path = {}", repointed.join(", "));
        sqlx::query(sqlx::AssertSqlSafe(sql)).execute(&mut *conn).await?;
    }
    if names_public {
        let (definition,): (String,) =
            sqlx::query_as("SELECT pg_get_functiondef($1::int8::oid)").bind(oid).fetch_one(&mut *conn).await?;
        let definition = naming_schema(&definition, layout.schema);
        sqlx::query(sqlx::AssertSqlSafe(definition))
            .execute(&mut *conn)
            .await
            .with_context(|| format!("Failed to re-create {signature} in {}", layout.schema))?;
    }
    Ok(())
}

/// `definition` with every `public.` that starts a qualified name (not part of a longer word) naming `schema`.
fn naming_schema(definition: &str, schema: &str) -> String {
    let mut out = String::with_capacity(definition.len());
    let mut rest = definition;
    while let Some(at) = rest.find("public.") {
        let word_before = rest[..at].chars().next_back().is_some_and(|c| c.is_alphanumeric() || c == '_');
        out.push_str(&rest[..at]);
        out.push_str(if word_before { "public." } else { schema });
        if !word_before {
            out.push('.');
        }
        rest = &rest[at + "public.".len()..];
    }
    out.push_str(rest);
    out
}

/// Keeps the old history in [`PUBLIC_LAYOUT_HISTORY`] after checking that it holds every version of the public layout
/// (a database migrated by an earlier build of 0.1 is migrated by its last build first, which holds them all). The table
/// `public.conveyor_schema_migrations` moves; sqlx's default `public._sqlx_migrations`, which may be the service's own,
/// is only read.
async fn keep_old_history(conn: &mut PgConnection) -> anyhow::Result<()> {
    let (ours, sqlx_default): (bool, bool) = sqlx::query_as(
        "SELECT to_regclass('public.conveyor_schema_migrations') IS NOT NULL,
                to_regclass('public._sqlx_migrations') IS NOT NULL",
    )
    .fetch_one(&mut *conn)
    .await?;
    let source = match (ours, sqlx_default) {
        (true, _) => "public.conveyor_schema_migrations",
        (false, true) => "public._sqlx_migrations",
        (false, false) => bail!("public holds Conveyor's tables but no history of their migrations: nothing is moved"),
    };
    let (applied,): (i64,) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT count(DISTINCT version) FROM {source} WHERE success AND version BETWEEN 1 AND {PUBLIC_LAYOUT_VERSIONS}"
    )))
    .fetch_one(&mut *conn)
    .await?;
    if applied != PUBLIC_LAYOUT_VERSIONS {
        bail!(
            "this database was migrated by an earlier build of Conveyor 0.1 ({applied} of the {PUBLIC_LAYOUT_VERSIONS} \
             migrations of {source} applied): run `conveyor migrate` of 0.1.0's last build (commit 34f94ac) first, \
             then this one"
        );
    }
    sqlx::query("CREATE SCHEMA IF NOT EXISTS conveyor").execute(&mut *conn).await?;
    if ours {
        sqlx::query("ALTER TABLE public.conveyor_schema_migrations SET SCHEMA conveyor").execute(&mut *conn).await?;
        sqlx::query("ALTER TABLE conveyor.conveyor_schema_migrations RENAME TO public_layout_history")
            .execute(&mut *conn)
            .await?;
        sqlx::query(
            "ALTER INDEX IF EXISTS conveyor.conveyor_schema_migrations_pkey RENAME TO public_layout_history_pkey",
        )
        .execute(&mut *conn)
        .await?;
    } else {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE {PUBLIC_LAYOUT_HISTORY} AS SELECT * FROM public._sqlx_migrations
             WHERE version BETWEEN 1 AND {PUBLIC_LAYOUT_VERSIONS}"
        )))
        .execute(&mut *conn)
        .await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::naming_schema;

    #[test]
    fn only_qualified_names_starting_with_public_are_repointed() {
        let body = "UPDATE public.asset_transfers SET x = 1; -- not_public.t, public.catalog_syncs";
        assert_eq!(
            naming_schema(body, "conveyor_shop"),
            "UPDATE conveyor_shop.asset_transfers SET x = 1; -- not_public.t, conveyor_shop.catalog_syncs"
        );
    }
}
