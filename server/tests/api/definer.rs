//! No path to the owner: every `SECURITY DEFINER` function that the application, runtime or operator role can reach
//! (by calling it, or by writing a row whose trigger calls it) is attacked the way PostgreSQL's "Writing SECURITY
//! DEFINER Functions Safely" warns of. As that role, a temporary view is planted for every relation the function's
//! source names, shadowing it, with INSTEAD OF triggers; the view and its triggers call a function of the caller's
//! own that counts the times it runs as anyone but the caller and, if it does, tries to turn row-level security off
//! on every tenant table (what the application role did through the catalog and transfer triggers before 0034).
//! The function is then fired, and the test asserts the caller's code never ran as another role and that every
//! tenant table still enables and forces row-level security.

use crate::common;

use std::collections::BTreeSet;

use common::TestDb;
use sqlx::{Connection, PgConnection};
use uuid::Uuid;

/// How each definer trigger (by trigger name) is fired: a row written by the owner in the caller's workspace
/// (`$1` the row's id, `$2` the workspace), then the caller's statement that fires the trigger.
const TRIGGER_RECIPES: &[(&str, &str, &str)] = &[
    (
        "asset_transfer_ended",
        "INSERT INTO conveyor.operations (id, workspace_id, kind, status, created_by) \
         VALUES ($1, $2, 'asset.transfer', 'running', $2)",
        "UPDATE conveyor.operations SET status = 'failed' WHERE id = $1",
    ),
    (
        "catalog_sync_ended",
        "INSERT INTO conveyor.operations (id, workspace_id, kind, status, created_by) \
         VALUES ($1, $2, 'catalog.sync', 'running', $2)",
        "UPDATE conveyor.operations SET status = 'succeeded' WHERE id = $1",
    ),
    (
        "catalog_sync_replayed",
        "INSERT INTO conveyor.operations (id, workspace_id, kind, status, created_by) \
         VALUES ($1, $2, 'catalog.sync', 'failed', $2)",
        "UPDATE conveyor.operations SET status = 'queued' WHERE id = $1",
    ),
];

/// The attacker's code, created in the caller's temporary schema once per session: a counter that survives
/// rollbacks (a sequence), a function that bumps it and tries to open the wall when it runs as anyone but the
/// session's role, and the trigger function of the shadowing tables.
const ATTACKER: &[&str] = &[
    "CREATE TEMP SEQUENCE conveyor_hijacks",
    "GRANT ALL ON SEQUENCE pg_temp.conveyor_hijacks TO PUBLIC",
    r#"CREATE FUNCTION pg_temp.conveyor_hijack() RETURNS boolean LANGUAGE plpgsql AS $$
       DECLARE t regclass;
       BEGIN
           IF current_user <> session_user THEN
               PERFORM pg_catalog.nextval('pg_temp.conveyor_hijacks');
               FOR t IN SELECT c.oid FROM pg_catalog.pg_class c
                        JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
                        WHERE c.relrowsecurity AND n.nspname !~ '^pg_'
               LOOP
                   BEGIN
                       EXECUTE pg_catalog.format('ALTER TABLE %s NO FORCE ROW LEVEL SECURITY', t);
                       EXECUTE pg_catalog.format('ALTER TABLE %s DISABLE ROW LEVEL SECURITY', t);
                   EXCEPTION WHEN OTHERS THEN NULL;
                   END;
               END LOOP;
           END IF;
           RETURN true;
       END
       $$"#,
    r#"CREATE FUNCTION pg_temp.conveyor_hijack_statement() RETURNS trigger LANGUAGE plpgsql AS $$
       BEGIN
           PERFORM pg_temp.conveyor_hijack();
           RETURN NULL;
       END
       $$"#,
];

/// Plants, in the caller's temporary schema, a table shadowing every relation (of any schema but the temporary ones)
/// whose name appears as a word in the source of the function `oid`: the same columns and one row, a policy that
/// calls the attacker's function on every row read, updated or deleted (policies run before any other condition), and
/// a statement trigger that calls it on every write, even of no row. Returns the names shadowed.
async fn plant_shadows(conn: &mut PgConnection, oid: u32) -> Vec<String> {
    let names: Vec<(String, String)> = sqlx::query_as(
        "SELECT DISTINCT ON (c.relname) c.relname::text,
                coalesce((SELECT string_agg(format('%I %s', a.attname, format_type(a.atttypid, a.atttypmod)),
                                            ', ' ORDER BY a.attnum)
                          FROM pg_attribute a WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped), '')
         FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE c.relkind IN ('r', 'v', 'm', 'p', 'f') AND n.nspname !~ '^pg_(temp|toast)'
           AND (SELECT p.prosrc FROM pg_proc p WHERE p.oid = $1::oid) ~* ('\\m' || c.relname || '\\M')
         ORDER BY c.relname, n.nspname LIKE 'conveyor%' DESC",
    )
    .bind(i64::from(oid))
    .fetch_all(&mut *conn)
    .await
    .expect("list the relations a function names");
    for (name, columns) in &names {
        for sql in [
            format!("CREATE TEMP TABLE \"{name}\" ({columns})"),
            format!("INSERT INTO pg_temp.\"{name}\" DEFAULT VALUES"),
            format!("ALTER TABLE pg_temp.\"{name}\" ENABLE ROW LEVEL SECURITY"),
            format!(
                "CREATE POLICY conveyor_hijack ON pg_temp.\"{name}\" \
                 USING (pg_temp.conveyor_hijack()) WITH CHECK (pg_temp.conveyor_hijack())"
            ),
            format!(
                "CREATE TRIGGER conveyor_hijack BEFORE INSERT OR UPDATE OR DELETE ON pg_temp.\"{name}\" \
                 FOR EACH STATEMENT EXECUTE FUNCTION pg_temp.conveyor_hijack_statement()"
            ),
            format!("GRANT ALL ON pg_temp.\"{name}\" TO PUBLIC"),
        ] {
            sqlx::query(sqlx::AssertSqlSafe(sql)).execute(&mut *conn).await.expect("plant a shadowing table");
        }
    }
    names.into_iter().map(|(name, _)| name).collect()
}

/// How many times the attacker's code ran as another role on this session.
async fn hijacks(conn: &mut PgConnection) -> i64 {
    let (n,): (i64,) =
        sqlx::query_as("SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM pg_temp.conveyor_hijacks")
            .fetch_one(&mut *conn)
            .await
            .expect("read the hijack counter");
    n
}

/// The tables whose row-level security is not both enabled and forced (read by the owner).
async fn open_tables(owner: &mut PgConnection, tenant_tables: &BTreeSet<String>) -> Vec<String> {
    let rows: Vec<(String, bool, bool)> = sqlx::query_as(
        "SELECT c.oid::regclass::text, c.relrowsecurity, c.relforcerowsecurity FROM pg_class c
         WHERE c.oid::regclass::text = ANY($1)",
    )
    .bind(tenant_tables.iter().cloned().collect::<Vec<_>>())
    .fetch_all(&mut *owner)
    .await
    .unwrap();
    assert_eq!(rows.len(), tenant_tables.len(), "every tenant table is still there");
    rows.into_iter().filter(|(_, enabled, forced)| !(*enabled && *forced)).map(|(t, _, _)| t).collect()
}

/// A value of the SQL type `ty` (as `format_type` names it) that sends a function past its argument checks.
fn argument(ty: &str, workspace: Uuid) -> String {
    if let Some(element) = ty.strip_suffix("[]") {
        return format!("ARRAY[{}]::{ty}", argument(element, workspace));
    }
    let value = match ty {
        "integer" | "bigint" | "smallint" => "100".to_owned(),
        "double precision" | "real" | "numeric" => "1".to_owned(),
        "text" | "character varying" => "'default'".to_owned(),
        "uuid" => format!("'{workspace}'"),
        "timestamp with time zone" => "now()".to_owned(),
        "interval" => "'1 day'".to_owned(),
        "jsonb" | "json" => "'{}'".to_owned(),
        "boolean" => "false".to_owned(),
        "tid" => "'(0,1)'".to_owned(),
        _ => "NULL".to_owned(),
    };
    format!("{value}::{ty}")
}

/// A connection of `url`'s role with the attacker's code planted.
async fn attacker(url: &str) -> PgConnection {
    let mut conn = PgConnection::connect(url).await.expect("connect as the attacking role");
    for sql in ATTACKER {
        sqlx::query(sqlx::AssertSqlSafe(*sql)).execute(&mut conn).await.expect("plant the attacker's code");
    }
    conn
}

/// Runs `fire` on `conn` in a transaction of `workspace`'s context with shadows planted for the function `oid`, and
/// commits what it did (a real attacker keeps what the owner's rights gave it). The error of `fire`, if any, is
/// returned (a function given made-up arguments may well refuse them); the shadows are dropped either way.
async fn attack(conn: &mut PgConnection, oid: u32, workspace: Uuid, fire: &str, id: Uuid) -> Option<String> {
    let mut tx = conn.begin().await.unwrap();
    sqlx::query("SELECT set_config('app.workspace_id', $1, true)")
        .bind(workspace.to_string())
        .execute(&mut *tx)
        .await
        .unwrap();
    let shadows = plant_shadows(&mut tx, oid).await;
    sqlx::query("SAVEPOINT fire").execute(&mut *tx).await.unwrap();
    let query = sqlx::query(sqlx::AssertSqlSafe(fire.to_owned()));
    let query = if fire.contains("$1") { query.bind(id) } else { query };
    let error = match query.execute(&mut *tx).await {
        Ok(_) => None,
        Err(e) => {
            sqlx::query("ROLLBACK TO SAVEPOINT fire").execute(&mut *tx).await.unwrap();
            Some(e.to_string())
        }
    };
    for name in shadows {
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE pg_temp.\"{name}\""))).execute(&mut *tx).await.unwrap();
    }
    tx.commit().await.unwrap();
    error
}

#[tokio::test]
async fn no_definer_function_a_role_can_reach_runs_the_callers_code_as_the_owner() {
    let db = TestDb::create().await;
    let mut owner = db.owner().await;
    let tenant_tables: BTreeSet<String> = sqlx::query_as::<_, (String,)>(
        "SELECT c.oid::regclass::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE c.relkind IN ('r', 'p') AND c.relrowsecurity AND n.nspname !~ '^pg_'",
    )
    .fetch_all(&mut owner)
    .await
    .unwrap()
    .into_iter()
    .map(|(t,)| t)
    .collect();
    assert!(
        tenant_tables.contains("conveyor_shop.store_credentials") && tenant_tables.contains("conveyor.outbox_events")
    );
    assert!(open_tables(&mut owner, &tenant_tables).await.is_empty(), "the wall starts closed");

    let definers: Vec<(u32, String, bool)> = sqlx::query_as(
        "SELECT p.oid::int8, p.oid::regprocedure::text, p.prorettype = 'trigger'::regtype
         FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
         WHERE p.prosecdef AND n.nspname !~ '^pg_' AND n.nspname <> 'information_schema' ORDER BY 2",
    )
    .fetch_all(&mut owner)
    .await
    .unwrap()
    .into_iter()
    .map(|(oid, name, trigger): (i64, String, bool)| (oid as u32, name, trigger))
    .collect();
    assert!(definers.len() > 20, "the catalogue's definer functions are found: {definers:?}");

    let mut attempts = Vec::new();
    let mut breaches = Vec::new();
    for (role, url) in [("application", &db.app_url), ("runtime", &db.runtime_url), ("operator", &db.operator_url)] {
        let mut conn = attacker(url).await;
        let workspace = Uuid::new_v4();
        for (oid, name, trigger) in &definers {
            let fires: Vec<String> = if *trigger {
                let triggers: Vec<(String, String)> = sqlx::query_as(
                    "SELECT t.tgname::text, t.tgrelid::regclass::text FROM pg_trigger t WHERE t.tgfoid = $1::int8::oid",
                )
                .bind(i64::from(*oid))
                .fetch_all(&mut owner)
                .await
                .unwrap();
                let mut fires = Vec::new();
                for (tgname, table) in triggers {
                    let (_, setup, fire) = TRIGGER_RECIPES
                        .iter()
                        .find(|(n, _, _)| *n == tgname)
                        .unwrap_or_else(|| panic!("no recipe fires the definer trigger {tgname} on {table}: add one"));
                    let (writable,): (bool,) =
                        sqlx::query_as("SELECT has_table_privilege(current_user, $1, 'INSERT, UPDATE, DELETE')")
                            .bind(&table)
                            .fetch_one(&mut conn)
                            .await
                            .unwrap();
                    if writable {
                        fires.push(format!("{setup}\n{fire}"));
                    }
                }
                fires
            } else {
                let (callable, arguments): (bool, Vec<String>) = sqlx::query_as(
                    "SELECT has_function_privilege(current_user, $1::int8::oid, 'EXECUTE'),
                            coalesce(ARRAY(SELECT format_type(t, NULL) FROM unnest(p.proargtypes) t), '{}')
                     FROM pg_proc p WHERE p.oid = $1::int8::oid",
                )
                .bind(i64::from(*oid))
                .fetch_one(&mut conn)
                .await
                .unwrap();
                let qualified: (String,) =
                    sqlx::query_as("SELECT format('%I.%I', n.nspname, p.proname) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace WHERE p.oid = $1::int8::oid")
                        .bind(i64::from(*oid))
                        .fetch_one(&mut owner)
                        .await
                        .unwrap();
                // Once with values that pass the usual checks, once with NULLs past the first argument (the
                // filters an operator leaves empty), so that both kinds of path run.
                let values: Vec<String> = arguments.iter().map(|t| argument(t, workspace)).collect();
                let nulls: Vec<String> = arguments
                    .iter()
                    .enumerate()
                    .map(|(i, t)| if i == 0 { argument(t, workspace) } else { format!("NULL::{t}") })
                    .collect();
                let mut fires = Vec::new();
                if callable {
                    fires.push(format!("SELECT * FROM {}({})", qualified.0, values.join(", ")));
                    if arguments.len() > 1 {
                        fires.push(format!("SELECT * FROM {}({})", qualified.0, nulls.join(", ")));
                    }
                }
                fires
            };
            for fire in fires {
                let id = Uuid::new_v4();
                let error = match fire.split_once('\n') {
                    Some((setup, fire)) => {
                        let mut tx = owner.begin().await.unwrap();
                        sqlx::query("SELECT set_config('app.workspace_id', $1, true)")
                            .bind(workspace.to_string())
                            .execute(&mut *tx)
                            .await
                            .unwrap();
                        sqlx::query(sqlx::AssertSqlSafe(setup.to_owned()))
                            .bind(id)
                            .bind(workspace)
                            .execute(&mut *tx)
                            .await
                            .expect("the owner writes the row whose change fires the trigger");
                        tx.commit().await.unwrap();
                        attack(&mut conn, *oid, workspace, fire, id).await
                    }
                    None => attack(&mut conn, *oid, workspace, &fire, id).await,
                };
                attempts.push(format!("{role}: {name} ({})", error.as_deref().unwrap_or("ran")));
                let ran_as_owner = hijacks(&mut conn).await;
                let open = open_tables(&mut owner, &tenant_tables).await;
                if ran_as_owner > 0 || !open.is_empty() {
                    breaches.push(format!(
                        "{role} through {name}: the caller's code ran {ran_as_owner} time(s) as another role; \
                         row-level security off on {open:?}"
                    ));
                    // Close the wall again, so that the next function is judged on its own.
                    for table in &open {
                        for sql in ["ENABLE", "FORCE"] {
                            sqlx::query(sqlx::AssertSqlSafe(format!("ALTER TABLE {table} {sql} ROW LEVEL SECURITY")))
                                .execute(&mut owner)
                                .await
                                .unwrap();
                        }
                    }
                    sqlx::query("SELECT setval('pg_temp.conveyor_hijacks', 1, false)")
                        .execute(&mut conn)
                        .await
                        .unwrap();
                }
            }
        }
    }
    assert!(
        attempts.iter().any(|a| a.starts_with("application: conveyor_shop.conveyor_catalog_sync_ended")),
        "{attempts:#?}"
    );
    assert!(attempts.iter().any(|a| a.starts_with("runtime: conveyor.conveyor_due_workspaces")), "{attempts:#?}");
    assert!(attempts.iter().any(|a| a.starts_with("operator: conveyor.conveyor_admin_queues")), "{attempts:#?}");
    assert!(breaches.is_empty(), "definer functions ran the caller's code as the owner:\n{breaches:#?}");
}

/// The rule itself, read from the catalogue: every definer function pins a `search_path` that starts with
/// `pg_catalog` and ends with `pg_temp` (searched first when left out), and no role that may call one can create
/// objects in a schema of that path.
#[tokio::test]
async fn every_definer_function_and_every_one_of_conveyors_but_three_pure_ones_pins_a_search_path_ending_with_pg_temp()
{
    // A function without a pinned path resolves what it calls with its caller's: a service's own connections put
    // `public` first, where `public.unnest(uuid[])` beats `pg_catalog.unnest(anyarray)`. Only the three that call
    // nothing but exactly typed built-ins stay unpinned, so that PostgreSQL can inline them.
    let db = TestDb::create().await;
    let mut owner = db.owner().await;
    let paths: Vec<(String, Option<String>)> = sqlx::query_as(
        "SELECT p.oid::regprocedure::text,
                (SELECT substr(c, length('search_path=') + 1) FROM unnest(p.proconfig) c WHERE c LIKE 'search_path=%')
         FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
         WHERE (p.prosecdef AND n.nspname !~ '^pg_' AND n.nspname <> 'information_schema')
            OR (n.nspname IN ('conveyor', 'conveyor_shop', 'conveyor_server')
                AND p.proname NOT IN ('conveyor_current_workspace', 'conveyor_uuid_v7', 'conveyor_job_state'))
         ORDER BY 1",
    )
    .fetch_all(&mut owner)
    .await
    .unwrap();
    assert!(paths.iter().any(|(f, _)| f.starts_with("conveyor.conveyor_claim_outbox(")), "{paths:?}");
    let mut unsafe_paths = Vec::new();
    let mut schemas = BTreeSet::new();
    for (function, path) in &paths {
        let entries: Vec<String> = path
            .as_deref()
            .unwrap_or("")
            .split(',')
            .map(|s| s.trim().trim_matches('"').to_owned())
            .filter(|s| !s.is_empty())
            .collect();
        if entries.first().map(String::as_str) != Some("pg_catalog")
            || entries.last().map(String::as_str) != Some("pg_temp")
        {
            unsafe_paths.push(format!("{function}: {path:?}"));
        }
        schemas.extend(entries.into_iter().filter(|s| s != "pg_catalog" && s != "pg_temp"));
    }
    assert!(unsafe_paths.is_empty(), "functions without a safe search_path:\n{unsafe_paths:#?}");
    for url in [&db.app_url, &db.runtime_url, &db.operator_url] {
        let options: sqlx::postgres::PgConnectOptions = url.parse().unwrap();
        let role = options.get_username();
        for schema in &schemas {
            let (create,): (bool,) = sqlx::query_as("SELECT has_schema_privilege($1, $2, 'CREATE')")
                .bind(role)
                .bind(schema)
                .fetch_one(&mut owner)
                .await
                .unwrap();
            assert!(!create, "{role} may create objects in {schema}, a schema of the definer functions' path");
        }
    }
}
