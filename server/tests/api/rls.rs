//! Row-level security is the tenant wall: tested as the application role, which the API and the job handlers use,
//! and around the runtime role, which alone may call the functions that work across workspaces (issue 16).

use crate::common;

use std::collections::BTreeSet;

use common::{TestApp, principal, store_body};

use reqwest::Method;
use serde_json::{Value, json};
use sqlx::{Connection, Row};

const TENANT_TABLES: [&str; 5] = ["idempotency_requests", "operations", "outbox_events", "stores", "store_credentials"];

/// Two workspaces with a store each: store, credentials, operation, event and idempotency record.
async fn two_populated_workspaces(
    app: &TestApp,
) -> (conveyor_server::auth::Principal, conveyor_server::auth::Principal) {
    let (a, b) = (principal(), principal());
    for who in [a, b] {
        let resp = app.send(Method::POST, "/v1/stores", who, Some(&store_body("rls"))).await;
        assert_eq!(resp.status(), 202);
    }
    for table in TENANT_TABLES {
        assert_eq!(app.db.count(table, a.workspace_id).await, 1, "{table} has a row in A");
    }
    (a, b)
}

#[tokio::test]
async fn without_a_workspace_the_application_role_reads_and_changes_nothing() {
    let app = TestApp::spawn().await;
    let (a, _b) = two_populated_workspaces(&app).await;
    let mut conn = app.db.app_connection().await;
    for table in TENANT_TABLES {
        let (n,): (i64,) =
            sqlx::query_as(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {}", common::qualified(table))))
                .fetch_one(&mut conn)
                .await
                .unwrap();
        assert_eq!(n, 0, "SELECT on {table} without a workspace");
        let updated = sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE {} SET workspace_id = workspace_id",
            common::qualified(table)
        )))
        .execute(&mut conn)
        .await
        .unwrap();
        assert_eq!(updated.rows_affected(), 0, "UPDATE on {table} without a workspace");
        let deleted = sqlx::query(sqlx::AssertSqlSafe(format!("DELETE FROM {}", common::qualified(table))))
            .execute(&mut conn)
            .await
            .unwrap();
        assert_eq!(deleted.rows_affected(), 0, "DELETE on {table} without a workspace");
    }
    // An insert without a workspace fails the policy's WITH CHECK.
    let insert = sqlx::query(
        "INSERT INTO conveyor.operations (id, workspace_id, kind, created_by) VALUES (gen_random_uuid(), $1, 'x', $1)",
    )
    .bind(a.workspace_id.0)
    .execute(&mut conn)
    .await;
    assert!(insert.is_err(), "insert without a workspace context is refused");
    // A session-level setting is visible to the same session, but `set_config(.., true)` in a finished
    // transaction leaves '' behind, which must read as "no workspace" again.
    let mut tx = conn.begin().await.unwrap();
    sqlx::query("SELECT set_config('app.workspace_id', $1, true)")
        .bind(a.workspace_id.0.to_string())
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let (n,): (i64,) = sqlx::query_as("SELECT count(*) FROM conveyor_shop.stores").fetch_one(&mut conn).await.unwrap();
    assert_eq!(n, 0, "the workspace does not outlive its transaction");
    for table in TENANT_TABLES {
        assert_eq!(app.db.count(table, a.workspace_id).await, 1, "{table} rows still exist");
    }
}

#[tokio::test]
async fn with_workspace_a_the_rows_of_b_are_invisible_and_cannot_be_written() {
    let app = TestApp::spawn().await;
    let (a, b) = two_populated_workspaces(&app).await;
    let b_store: uuid::Uuid = app.db.rows("stores", b.workspace_id).await[0]["id"].as_str().unwrap().parse().unwrap();
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, a.workspace_id).await.unwrap();
    for table in TENANT_TABLES {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!("SELECT workspace_id FROM {}", common::qualified(table))))
            .fetch_all(&mut *tx)
            .await
            .unwrap();
        assert_eq!(rows.len(), 1, "{table}: only A's row");
        assert_eq!(rows[0].get::<uuid::Uuid, _>(0), a.workspace_id.0);
        let updated = sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE {} SET workspace_id = workspace_id WHERE workspace_id = $1",
            common::qualified(table)
        )))
        .bind(b.workspace_id.0)
        .execute(&mut *tx)
        .await
        .unwrap();
        assert_eq!(updated.rows_affected(), 0, "{table}: B's rows cannot be updated from A");
    }
    let found = sqlx::query("SELECT 1 FROM conveyor_shop.stores WHERE id = $1")
        .bind(b_store)
        .fetch_optional(&mut *tx)
        .await
        .unwrap();
    assert!(found.is_none());
    let deleted =
        sqlx::query("DELETE FROM conveyor_shop.stores WHERE id = $1").bind(b_store).execute(&mut *tx).await.unwrap();
    assert_eq!(deleted.rows_affected(), 0);
    tx.commit().await.unwrap();
    // Moving A's row into B, or writing a row for B, fails the WITH CHECK.
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, a.workspace_id).await.unwrap();
    let moved =
        sqlx::query("UPDATE conveyor_shop.stores SET workspace_id = $1").bind(b.workspace_id.0).execute(&mut *tx).await;
    assert!(moved.is_err(), "a row cannot be moved into another workspace");
    tx.rollback().await.unwrap();
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, a.workspace_id).await.unwrap();
    let insert = sqlx::query(
        "INSERT INTO conveyor.operations (id, workspace_id, kind, created_by) VALUES (gen_random_uuid(), $1, 'x', $1)",
    )
    .bind(b.workspace_id.0)
    .execute(&mut *tx)
    .await;
    assert!(insert.is_err(), "a row cannot be written into another workspace");
    tx.rollback().await.unwrap();
    for table in TENANT_TABLES {
        assert_eq!(app.db.count(table, b.workspace_id).await, 1, "{table}: B intact");
    }
}

#[tokio::test]
async fn the_application_role_cannot_turn_security_off_or_become_the_owner() {
    let app = TestApp::spawn().await;
    two_populated_workspaces(&app).await;
    let mut conn = app.db.app_connection().await;
    for table in TENANT_TABLES {
        for ddl in [
            format!("ALTER TABLE {} DISABLE ROW LEVEL SECURITY", common::qualified(table)),
            format!("ALTER TABLE {} NO FORCE ROW LEVEL SECURITY", common::qualified(table)),
            format!("DROP POLICY workspace_isolation ON {table}"),
            format!("CREATE POLICY open ON {table} USING (true)"),
        ] {
            assert!(sqlx::query(sqlx::AssertSqlSafe(ddl.clone())).execute(&mut conn).await.is_err(), "{ddl}");
        }
    }
    assert!(sqlx::query("SET ROLE conveyor_owner").execute(&mut conn).await.is_err(), "SET ROLE owner");
    assert!(sqlx::query("SET SESSION AUTHORIZATION conveyor_owner").execute(&mut conn).await.is_err());
    // row_security = off makes a query that RLS would filter fail instead of bypassing the policy.
    sqlx::query("SET row_security = off").execute(&mut conn).await.unwrap();
    assert!(sqlx::query("SELECT * FROM conveyor_shop.stores").fetch_all(&mut conn).await.is_err());
    let (superuser, bypass): (bool, bool) =
        sqlx::query_as("SELECT rolsuper, rolbypassrls FROM pg_roles WHERE rolname = current_user")
            .fetch_one(&mut conn)
            .await
            .unwrap();
    assert!(!superuser && !bypass);
}

/// Every function the application role can execute, and why each stays in the caller's workspace: an allow-list that
/// `conveyor migrate`'s own (`APPLICATION_FUNCTIONS`) must equal. A function that is not proven here (one that reads
/// or changes several workspaces in one call, or sets `app.workspace_id` from its arguments) belongs to the runtime
/// role.
const PROVEN: &[(&str, &str)] = &[
    ("conveyor_current_workspace", "reads the caller's own app.workspace_id; every policy compares with it"),
    ("conveyor_uuid_v7", "pure: reads no table"),
    ("conveyor_job_state", "pure: reads no table"),
    (
        "conveyor_enqueue",
        "SECURITY INVOKER: refused without a workspace, writes the caller's under RLS (checked below)",
    ),
    (
        "conveyor_wake_dispatchers",
        "SECURITY INVOKER: reads the one row of dispatchers_awake (no workspace's) and may NOTIFY; writes nothing",
    ),
    ("conveyor_listing_publication_is_final", "trigger: PostgreSQL calls it only for a row the caller writes"),
    ("conveyor_catalog_sync_ended", "trigger: PostgreSQL calls it only for a row the caller writes"),
    ("conveyor_catalog_sync_replayed", "trigger: PostgreSQL calls it only for a row the caller writes"),
    ("conveyor_asset_transfer_ended", "trigger: PostgreSQL calls it only for a row the caller writes"),
];

/// Tables without row-level security the application role may read (never write): global, no workspace's rows.
const GLOBAL_READABLE: &[&str] = &[
    "conveyor._sqlx_migrations",
    "conveyor_shop._sqlx_migrations",
    "conveyor_server._sqlx_migrations",
    "conveyor.job_kinds",
    // Whether a dispatcher is awake (migration 0039): one time, no workspace's.
    "conveyor.dispatchers_awake",
];

/// What the role of `conn` may do that the wall does not allow: functions it can execute that are not [`PROVEN`] (in
/// any schema but PostgreSQL's own), proven ones that are `SECURITY DEFINER` (but triggers) or set a configuration
/// (`app.workspace_id`, whose value is the wall), relations without forced row-level security it can write, and ones
/// it can read beyond [`GLOBAL_READABLE`] (a view reads as its owner).
async fn wall_breaches(conn: &mut sqlx::PgConnection) -> Vec<String> {
    let mut breaches = Vec::new();
    let functions: Vec<(String, String, bool, bool, String)> = sqlx::query_as(
        "SELECT p.proname::text, p.oid::regprocedure::text, p.prosecdef, p.prorettype = 'trigger'::regtype,
                coalesce(p.prosrc, '')
         FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
         WHERE n.nspname NOT IN ('pg_catalog', 'information_schema')
           AND has_function_privilege(current_user, p.oid, 'EXECUTE')",
    )
    .fetch_all(&mut *conn)
    .await
    .unwrap();
    for (name, signature, definer, trigger, source) in &functions {
        if !PROVEN.iter().any(|(proven, _)| proven == name) {
            breaches.push(format!("executes {signature}, which is not proven to stay in one workspace"));
        } else if *definer && !*trigger {
            breaches.push(format!("executes {signature}, a SECURITY DEFINER function"));
        } else if calls_set_config(source) {
            breaches.push(format!("executes {signature}, which sets a configuration (app.workspace_id?)"));
        }
    }
    let relations: Vec<(String, bool, bool)> = sqlx::query_as(
        "SELECT c.oid::regclass::text,
                has_table_privilege(current_user, c.oid, 'INSERT, UPDATE, DELETE, TRUNCATE'),
                has_table_privilege(current_user, c.oid, 'SELECT')
         FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname NOT IN ('pg_catalog', 'information_schema', 'pg_toast')
           AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
           AND NOT (c.relkind IN ('r', 'p') AND c.relrowsecurity AND c.relforcerowsecurity)",
    )
    .fetch_all(&mut *conn)
    .await
    .unwrap();
    for (relation, writes, reads) in relations {
        if writes {
            breaches.push(format!("writes {relation}, which has no (forced) row-level security"));
        } else if reads && !GLOBAL_READABLE.contains(&relation.as_str()) {
            breaches.push(format!("reads {relation}, which has no (forced) row-level security"));
        }
    }
    breaches
}

/// Whether a function's source calls `set_config` (not merely names it in a string: `set_config(''app...`).
fn calls_set_config(source: &str) -> bool {
    let source = source.to_lowercase();
    source.match_indices("set_config").any(|(at, name)| {
        let rest = source[at + name.len()..].trim_start();
        rest.strip_prefix('(').is_some_and(|arguments| !arguments.trim_start().starts_with("''"))
    })
}

/// The functions `conn`'s role can execute whose names start with `conveyor_`.
async fn executable(conn: &mut sqlx::PgConnection) -> BTreeSet<String> {
    sqlx::query_scalar(
        "SELECT p.proname::text FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
         WHERE n.nspname IN ('conveyor', 'conveyor_shop', 'conveyor_server') AND p.proname LIKE 'conveyor\\_%'
           AND has_function_privilege(current_user, p.oid, 'EXECUTE')",
    )
    .fetch_all(conn)
    .await
    .unwrap()
    .into_iter()
    .collect()
}

#[tokio::test]
async fn every_function_and_table_the_application_role_can_use_is_proven_to_stay_in_one_workspace() {
    let db = common::TestDb::create().await;
    let mut app = db.app_connection().await;
    let breaches = wall_breaches(&mut app).await;
    assert!(breaches.is_empty(), "the application role:\n{}", breaches.join("\n"));
    // The allow-list has no stale names: each proven function exists and is the application role's, and it is the
    // list `conveyor migrate` grants.
    let proven: BTreeSet<String> = PROVEN.iter().map(|(name, _)| (*name).to_owned()).collect();
    assert_eq!(executable(&mut app).await, proven, "the application role executes exactly the proven functions");
    let granted: BTreeSet<String> = conveyor_jobs::APPLICATION_FUNCTIONS
        .iter()
        .chain(conveyor_shop::migrate::FUNCTIONS)
        .map(|n| (*n).to_owned())
        .collect();
    assert_eq!(
        granted, proven,
        "the platform's APPLICATION_FUNCTIONS and the shop's FUNCTIONS are not this test's PROVEN"
    );

    // The check catches a grant someone adds later: a function of the runtime's, a writable table without RLS.
    let mut owner = db.owner().await;
    let role = db.app_url.split("://").nth(1).unwrap().split(':').next().unwrap().to_owned();
    for grant in [
        format!("GRANT EXECUTE ON FUNCTION conveyor.conveyor_due_outbox_workspaces(integer) TO {role}"),
        format!("GRANT EXECUTE ON FUNCTION conveyor.conveyor_complete_jobs(uuid[], uuid[], integer[], jsonb[]) TO {role}"),
        format!("GRANT INSERT ON conveyor.job_kinds TO {role}"),
        "CREATE FUNCTION leak() RETURNS bigint LANGUAGE sql SECURITY DEFINER AS 'SELECT count(*) FROM conveyor_shop.stores'".into(),
        "GRANT EXECUTE ON FUNCTION leak() TO PUBLIC".into(),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(grant)).execute(&mut owner).await.unwrap();
    }
    let breaches = wall_breaches(&mut app).await.join("\n");
    for caught in [
        "conveyor.conveyor_due_outbox_workspaces(integer)",
        "conveyor.conveyor_complete_jobs(",
        "writes conveyor.job_kinds",
        "leak()",
    ] {
        assert!(breaches.contains(caught), "{caught} not caught:\n{breaches}");
    }
}

#[tokio::test]
async fn the_runtime_role_alone_executes_the_functions_that_work_across_workspaces() {
    let app = TestApp::spawn().await;
    let (a, b) = two_populated_workspaces(&app).await;
    let mut as_app = app.db.app_connection().await;
    let mut runtime = sqlx::PgConnection::connect(&app.db.runtime_url).await.unwrap();
    let everything = executable(&mut runtime).await;
    let application = executable(&mut as_app).await;
    let runtime_only: Vec<&String> = everything.difference(&application).collect();
    for function in [
        "conveyor_due_outbox_workspaces",
        "conveyor_due_workspaces",
        "conveyor_claim_jobs_fair",
        "conveyor_mark_outbox_dispatched",
        "conveyor_complete_jobs",
        "conveyor_jobs_not_to_run",
        "conveyor_event_by_stream_id",
        "conveyor_next_due_at",
        "conveyor_next_due_after",
        "conveyor_due_schedules",
        "conveyor_outbox_backlog_due",
        "conveyor_audit_purge",
    ] {
        assert!(runtime_only.iter().any(|f| *f == function), "{function} is the runtime's alone: {runtime_only:?}");
    }
    assert!(everything.is_superset(&application), "the runtime role runs what the application role runs too");
    assert!(!everything.iter().any(|f| f.starts_with("conveyor_admin_")), "the operator's functions are not its");

    // The application role is refused, with or without a workspace, and B's job stays as it was.
    let b_job: uuid::Uuid =
        app.db.rows("outbox_events", b.workspace_id).await[0]["id"].as_str().unwrap().parse().unwrap();
    for call in [
        "SELECT * FROM conveyor.conveyor_due_outbox_workspaces(100)".to_owned(),
        "SELECT conveyor.conveyor_next_due_at()".to_owned(),
        "SELECT * FROM conveyor.conveyor_due_workspaces(100)".to_owned(),
        "SELECT conveyor.conveyor_next_due_after(now() - interval '1 hour')".to_owned(),
        "SELECT * FROM conveyor.conveyor_claim_jobs_fair(ARRAY[]::uuid[], 'me', 30, 10, 0, ARRAY[]::uuid[])".to_owned(),
        format!(
            "SELECT conveyor.conveyor_complete_jobs(ARRAY['{}']::uuid[], ARRAY['{b_job}']::uuid[], ARRAY[NULL]::int[],
                                           ARRAY['null']::jsonb[])",
            b.workspace_id.0
        ),
        format!(
            "SELECT * FROM conveyor.conveyor_jobs_not_to_run(ARRAY['{}']::uuid[], ARRAY['{b_job}']::uuid[], ARRAY[NULL]::int[])",
            b.workspace_id.0
        ),
        "SELECT * FROM conveyor.conveyor_claim_jobs_fair(ARRAY[]::uuid[], 'me', 30, 10, 0)".to_owned(),
    ] {
        let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, a.workspace_id).await.unwrap();
        let err = sqlx::query(sqlx::AssertSqlSafe(call.clone())).execute(&mut *tx).await.unwrap_err();
        assert!(err.to_string().contains("permission denied for function"), "{call}: {err}");
        tx.rollback().await.unwrap();
        let err = sqlx::query(sqlx::AssertSqlSafe(call.clone())).execute(&mut as_app).await.unwrap_err();
        assert!(err.to_string().contains("permission denied for function"), "{call}: {err}");
    }
    let b_rows = app.db.rows("outbox_events", b.workspace_id).await;
    assert_eq!(b_rows[0]["status"], "pending", "B's job is untouched");

    // The runtime role's lookups return workspace ids and nothing else; the rows stay behind RLS for it too.
    let rows = sqlx::query("SELECT * FROM conveyor.conveyor_due_outbox_workspaces(100)")
        .fetch_all(&mut runtime)
        .await
        .unwrap();
    assert_eq!(rows[0].columns().len(), 1, "one column: the workspace id");
    let ids: BTreeSet<uuid::Uuid> = rows.iter().map(|r| r.get(0)).collect();
    assert_eq!(ids, BTreeSet::from([a.workspace_id.0, b.workspace_id.0]));
    let (n,): (i64,) =
        sqlx::query_as("SELECT count(*) FROM conveyor.outbox_events").fetch_one(&mut runtime).await.unwrap();
    assert_eq!(n, 0, "without a workspace the runtime role reads no row either");
}

#[tokio::test]
async fn the_application_role_enqueues_only_in_its_workspace() {
    let app = TestApp::spawn().await;
    let (a, b) = two_populated_workspaces(&app).await;
    sqlx::query(
        "INSERT INTO conveyor.job_kinds (kind, queue, max_attempts, timeout_ms) VALUES ('test.leak', 'leaks', 3, 1000)",
    )
    .execute(&mut app.db.owner().await)
    .await
    .unwrap();
    let mut conn = app.db.app_connection().await;
    let err = sqlx::query("SELECT conveyor.conveyor_enqueue('test.leak', '{}')").execute(&mut conn).await.unwrap_err();
    assert!(err.to_string().contains("no workspace is set"), "{err}");
    // From A, B's live operation cannot carry A's job, and the job lands in A.
    let b_operation: uuid::Uuid =
        app.db.rows("operations", b.workspace_id).await[0]["id"].as_str().unwrap().parse().unwrap();
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, a.workspace_id).await.unwrap();
    let err = sqlx::query("SELECT conveyor.conveyor_enqueue('test.leak', '{}', operation_id => $1)")
        .bind(b_operation)
        .execute(&mut *tx)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("not a live operation of this workspace"), "{err}");
    tx.rollback().await.unwrap();
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, a.workspace_id).await.unwrap();
    let (id,): (uuid::Uuid,) =
        sqlx::query_as("SELECT conveyor.conveyor_enqueue('test.leak', '{}')").fetch_one(&mut *tx).await.unwrap();
    tx.commit().await.unwrap();
    assert!(app.db.rows("outbox_events", a.workspace_id).await.iter().any(|e| e["id"] == id.to_string()));
    assert_eq!(app.db.count("outbox_events", b.workspace_id).await, 1, "B has its own job only");
    // Trigger functions cannot be called at all.
    for trigger in PROVEN.iter().filter(|(_, why)| why.starts_with("trigger")).map(|(name, _)| name) {
        let err = sqlx::query(sqlx::AssertSqlSafe(format!("SELECT conveyor_shop.{trigger}()")))
            .execute(&mut conn)
            .await
            .unwrap_err();
        assert!(err.to_string().contains("trigger functions can only be called as triggers"), "{trigger}: {err}");
    }
}

#[tokio::test]
async fn a_workspaces_weight_and_pauses_are_its_rows_and_a_pause_of_every_workspace_is_no_ones() {
    let app = TestApp::spawn().await;
    let (a, b) = (principal().workspace_id, principal().workspace_id);
    // Weights and pauses are the operator's (migration 0035): set through its audited functions.
    let operator = conveyor_jobs::connect_postgres(&app.db.operator_url, 2).await.unwrap();
    conveyor_jobs::set_workspace_weight(&operator, b, 5).await.unwrap();
    let b_pause = conveyor_jobs::PauseScope::kind_named("test.work").in_workspace(b);
    assert!(conveyor_jobs::pause(&operator, &b_pause, Some("b's")).await.unwrap());
    let everywhere = conveyor_jobs::PauseScope::queue("work");
    assert!(conveyor_jobs::pause(&operator, &everywhere, None).await.unwrap());

    // Without a workspace: no weight, and only the pause of every workspace; nothing to change.
    let mut conn = app.db.app_connection().await;
    let (weights,): (i64,) =
        sqlx::query_as("SELECT count(*) FROM conveyor.workspace_weights").fetch_one(&mut conn).await.unwrap();
    assert_eq!(weights, 0);
    let pauses = conveyor_jobs::list_pauses(&app.db.pool).await.unwrap();
    assert_eq!(pauses.iter().map(|p| p.workspace_id).collect::<Vec<_>>(), [None], "{pauses:?}");
    for change in [
        "UPDATE conveyor.workspace_weights SET weight = 1",
        "DELETE FROM conveyor.workspace_weights",
        "DELETE FROM conveyor.dispatch_pauses WHERE workspace_id IS NOT NULL",
    ] {
        let err = sqlx::query(change).execute(&mut conn).await.unwrap_err();
        assert_eq!(code(&err), "42501", "{change} without a workspace: {err}");
    }
    // From A: B's weight and pause are invisible, and cannot be changed nor written for B.
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, a).await.unwrap();
    let (seen,): (i64,) =
        sqlx::query_as("SELECT count(*) FROM conveyor.dispatch_pauses").fetch_one(&mut *tx).await.unwrap();
    assert_eq!(seen, 1, "A sees the pause of every workspace only");
    tx.commit().await.unwrap();
    for write in [
        "UPDATE conveyor.workspace_weights SET weight = 1 WHERE workspace_id = $1",
        "DELETE FROM conveyor.dispatch_pauses WHERE workspace_id = $1",
        "INSERT INTO conveyor.workspace_weights (workspace_id, weight) VALUES ($1, 9)",
        "INSERT INTO conveyor.dispatch_pauses (queue, workspace_id) VALUES ('work', $1)",
    ] {
        let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, a).await.unwrap();
        let err = sqlx::query(write).bind(b.0).execute(&mut *tx).await.unwrap_err();
        assert_eq!(code(&err), "42501", "{write} for B from A: {err}");
    }
    // B's rows are intact, in B's context; the runtime role (the relay's claim) reads every pause.
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, b).await.unwrap();
    let (weight,): (i32,) =
        sqlx::query_as("SELECT weight FROM conveyor.workspace_weights").fetch_one(&mut *tx).await.unwrap();
    assert_eq!(weight, 5);
    let (seen,): (i64,) =
        sqlx::query_as("SELECT count(*) FROM conveyor.dispatch_pauses").fetch_one(&mut *tx).await.unwrap();
    assert_eq!(seen, 2, "B sees its own pause and the pause of every workspace");
    tx.commit().await.unwrap();
    assert_eq!(conveyor_jobs::list_pauses(&app.db.runtime_pool).await.unwrap().len(), 2);
    assert!(conveyor_jobs::resume(&operator, &b_pause).await.unwrap(), "lifted by the operator");
}

/// The SQLSTATE of a database error (empty for another error).
fn code(e: &sqlx::Error) -> String {
    e.as_database_error().and_then(|d| d.code()).map(|c| c.into_owned()).unwrap_or_default()
}

#[tokio::test]
async fn the_application_role_may_not_pause_every_workspace_nor_weigh_its_own() {
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    let operator = conveyor_jobs::connect_postgres(&app.db.operator_url, 2).await.unwrap();
    assert!(
        conveyor_jobs::pause(&operator, &conveyor_jobs::PauseScope::queue("work"), Some("the operator's"))
            .await
            .unwrap()
    );
    conveyor_jobs::set_workspace_weight(&operator, ws, 2).await.unwrap();

    // As the application role, in its own workspace's context and in none: every write of a pause of every
    // workspace, and of a weight (its own included), is refused.
    let forbidden = [
        "INSERT INTO conveyor.dispatch_pauses (queue, kind, workspace_id, reason) VALUES ('emails', NULL, NULL, 'forged')",
        "INSERT INTO conveyor.dispatch_pauses (queue, workspace_id) VALUES ('emails', NULL)",
        "UPDATE conveyor.dispatch_pauses SET reason = 'forged' WHERE workspace_id IS NULL",
        "UPDATE conveyor.dispatch_pauses SET workspace_id = NULL",
        "DELETE FROM conveyor.dispatch_pauses WHERE workspace_id IS NULL",
        "DELETE FROM conveyor.dispatch_pauses",
        "INSERT INTO conveyor.workspace_weights (workspace_id, weight) VALUES (conveyor.conveyor_current_workspace(), 1000)",
        "INSERT INTO conveyor.workspace_weights (workspace_id, weight) VALUES (gen_random_uuid(), 1000)",
        "UPDATE conveyor.workspace_weights SET weight = 1000",
        "DELETE FROM conveyor.workspace_weights",
        "SELECT conveyor.conveyor_admin_pause('forged', NULL, 'emails', NULL, NULL, NULL)",
        "SELECT conveyor.conveyor_admin_resume('forged', NULL, 'work', NULL, NULL)",
        "SELECT conveyor.conveyor_admin_set_weight('forged', NULL, gen_random_uuid(), 1000)",
    ];
    for context in [Some(ws), None] {
        for sql in forbidden {
            let mut tx = match context {
                Some(ws) => conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap(),
                None => app.db.pool.begin().await.unwrap(),
            };
            let err = sqlx::query(sql).execute(&mut *tx).await.expect_err(sql);
            assert_eq!(code(&err), "42501", "{sql} (in {context:?}): {err}");
        }
    }
    // The library's calls with the application role's pool are refused too, whatever the scope.
    for scope in [conveyor_jobs::PauseScope::queue("emails"), conveyor_jobs::PauseScope::workspace(ws)] {
        let err = conveyor_jobs::pause(&app.db.pool, &scope, None).await.unwrap_err();
        assert!(err.to_string().contains("permission denied"), "{scope:?}: {err}");
    }
    let err = conveyor_jobs::set_workspace_weight(&app.db.pool, ws, 1000).await.unwrap_err();
    assert!(err.to_string().contains("permission denied"), "{err}");
    // The runtime role, which writes the platform's tables, writes no pause of every workspace either.
    let err = sqlx::query("INSERT INTO conveyor.dispatch_pauses (queue) VALUES ('emails')")
        .execute(&app.db.runtime_pool)
        .await
        .unwrap_err();
    assert_eq!(code(&err), "42501", "{err}");

    // Nothing changed: the operator's pause and weight stand, and each change of theirs is on the audit trail.
    let pauses = conveyor_jobs::list_pauses(&app.db.runtime_pool).await.unwrap();
    assert_eq!(pauses.len(), 1, "{pauses:?}");
    assert_eq!((pauses[0].queue.as_deref(), pauses[0].reason.as_deref()), (Some("work"), Some("the operator's")));
    let mut owner = app.db.owner().await;
    let (weight,): (i32,) = sqlx::query_as("SELECT weight FROM conveyor.workspace_weights WHERE workspace_id = $1")
        .bind(ws.0)
        .fetch_one(&mut owner)
        .await
        .unwrap();
    assert_eq!(weight, 2);
    let trail: Vec<(String, String, Value)> =
        sqlx::query_as("SELECT actor, action, arguments FROM conveyor.conveyor_admin_audit ORDER BY id")
            .fetch_all(&mut owner)
            .await
            .unwrap();
    let trail: Vec<(&str, &str, &Value)> =
        trail.iter().map(|(a, b, c)| (a.as_str(), b.as_str(), &c["outcome"])).collect();
    assert_eq!(trail, [("library", "pause", &json!("paused")), ("library", "weight", &json!("set"))]);
}

#[tokio::test]
async fn maintenance_purges_the_audit_trail_past_its_retention_and_says_so_in_it() {
    let app = TestApp::spawn().await;
    let mut owner = app.db.owner().await;
    sqlx::query(
        "INSERT INTO conveyor.conveyor_admin_audit (at, actor, action) VALUES
             (now() - interval '100 days', 'old', 'jobs'), (now() - interval '95 days', 'old', 'jobs'),
             (now() - interval '10 days', 'recent', 'jobs')",
    )
    .execute(&mut owner)
    .await
    .unwrap();
    // Neither the application role nor a retention under a day.
    let mut conn = app.db.app_connection().await;
    let err =
        sqlx::query("SELECT conveyor.conveyor_audit_purge(interval '1 day', 10)").execute(&mut conn).await.unwrap_err();
    assert!(err.to_string().contains("permission denied"), "{err}");
    let err = sqlx::query("SELECT conveyor.conveyor_audit_purge(interval '1 hour', 10)")
        .execute(&app.db.runtime_pool)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("at least a day"), "{err}");

    let maintenance = conveyor_jobs::Maintenance::new(
        app.db.runtime_pool.clone(),
        common::redis_client(&common::redis_url()).await,
        conveyor_jobs::RedisKeys::new(&app.redis_prefix),
        conveyor_jobs::Metrics::new(),
        std::time::Duration::from_secs(60),
        std::time::Duration::from_secs(7 * 86400),
        std::time::Duration::from_secs(300),
    );
    let report = maintenance.run_once().await.unwrap();
    assert_eq!(report.audit_purged, 2, "the two entries older than 90 days");
    let left: Vec<(String, String)> =
        sqlx::query_as("SELECT actor, action FROM conveyor.conveyor_admin_audit ORDER BY id")
            .fetch_all(&mut owner)
            .await
            .unwrap();
    assert_eq!(left, [("recent".into(), "jobs".into()), ("maintenance".into(), "audit_purge".into())]);
    // A maintenance given a shorter retention than `conveyor migrate` recorded (90 days by default) keeps what the
    // recorded one keeps: the purge's floor is the owner's.
    let shorter = maintenance.with_audit_retention(std::time::Duration::from_secs(86400));
    assert_eq!(shorter.run_once().await.unwrap().audit_purged, 0, "the 10-day-old entry stays");
}

#[tokio::test]
async fn the_audit_purge_never_goes_below_the_retention_migrate_recorded() {
    let app = TestApp::spawn().await;
    let mut owner = app.db.owner().await;
    let plant = "INSERT INTO conveyor.conveyor_admin_audit (at, actor, action) VALUES
                     (now() - interval '100 days', 'old', 'jobs'), (now() - interval '10 days', 'recent', 'jobs')";
    sqlx::query(plant).execute(&mut owner).await.unwrap();

    // As the runtime role, asking for a day: what the configured 90 days keep stays.
    let (purged,): (i64,) = sqlx::query_as("SELECT conveyor.conveyor_audit_purge(interval '1 day', 100)")
        .fetch_one(&app.db.runtime_pool)
        .await
        .unwrap();
    assert_eq!(purged, 1, "the 100-day-old entry only");
    assert_eq!(actors(&mut owner).await, ["recent", "maintenance"]);
    let (arguments,): (Value,) =
        sqlx::query_as("SELECT arguments FROM conveyor.conveyor_admin_audit WHERE action = 'audit_purge'")
            .fetch_one(&mut owner)
            .await
            .unwrap();
    assert_eq!((arguments["older_than"].as_str(), arguments["kept"].as_str()), (Some("1 day"), Some("90 days")));

    // The floor lives where neither the runtime role nor the application role reads or writes it.
    let mut app_conn = app.db.app_connection().await;
    let mut runtime_conn = sqlx::PgConnection::connect(&app.db.runtime_url).await.unwrap();
    for conn in [&mut app_conn, &mut runtime_conn] {
        for sql in [
            "SELECT value FROM conveyor.conveyor_settings",
            "UPDATE conveyor.conveyor_settings SET value = '1 day'",
            "DELETE FROM conveyor.conveyor_settings",
            "INSERT INTO conveyor.conveyor_settings (name, value) VALUES ('audit_retention_2', '1 day')",
        ] {
            let err = sqlx::query(sql).execute(&mut *conn).await.expect_err(sql);
            assert_eq!(code(&err), "42501", "{sql}: {err}");
        }
    }

    // `conveyor migrate` with CONVEYOR_AUDIT_RETENTION=2d records a shorter floor; the purge then goes down to it.
    let mut migrate =
        common::migrate_config(&app.db.owner_url, &app.db.app_url, &app.db.runtime_url, Some(&app.db.operator_url));
    migrate.audit_retention = Some(std::time::Duration::from_secs(2 * 86400));
    conveyor_jobs::migrate_with(&migrate).await.unwrap();
    let (purged,): (i64,) = sqlx::query_as("SELECT conveyor.conveyor_audit_purge(interval '1 day', 100)")
        .fetch_one(&app.db.runtime_pool)
        .await
        .unwrap();
    assert_eq!(purged, 1, "the 10-day-old entry, under a 2-day retention");
    assert_eq!(actors(&mut owner).await, ["maintenance", "maintenance"]);
    // A retention under a day is refused by migrate itself; and `migrate()` records the default again.
    let mut under = migrate.clone();
    under.audit_retention = Some(std::time::Duration::from_secs(3600));
    let err = conveyor_jobs::migrate_with(&under).await.unwrap_err();
    assert!(format!("{err:#}").contains("CONVEYOR_AUDIT_RETENTION"), "{err:#}");
    conveyor_jobs::migrate_with(&common::migrate_config(&app.db.owner_url, &app.db.app_url, &app.db.runtime_url, None))
        .await
        .unwrap();
    let (floor,): (String,) =
        sqlx::query_as("SELECT value FROM conveyor.conveyor_settings WHERE name = 'audit_retention'")
            .fetch_one(&mut owner)
            .await
            .unwrap();
    assert_eq!(floor, "90 days");
}

/// The audit trail's actors, oldest first (read by the owner).
async fn actors(owner: &mut sqlx::PgConnection) -> Vec<String> {
    let rows: Vec<(String,)> =
        sqlx::query_as("SELECT actor FROM conveyor.conveyor_admin_audit ORDER BY id").fetch_all(owner).await.unwrap();
    rows.into_iter().map(|(a,)| a).collect()
}

#[tokio::test]
async fn migrate_refuses_an_application_role_that_would_bypass_the_wall() {
    let db = common::TestDb::create().await;
    let config = |app: &str, runtime: &str, operator: Option<&str>| {
        common::migrate_config(&db.owner_url, app, runtime, operator)
    };
    // The owner as "application role": it owns the tables, so it could turn RLS off; as runtime role likewise.
    let err = conveyor_jobs::migrate_with(&config(&db.owner_url, &db.runtime_url, None)).await.unwrap_err();
    assert!(format!("{err:#}").contains("application role `conveyor_owner` must not be"), "{err:#}");
    let err = conveyor_jobs::migrate_with(&config(&db.app_url, &db.owner_url, None)).await.unwrap_err();
    assert!(format!("{err:#}").contains("runtime role `conveyor_owner` must not be"), "{err:#}");
    // The runtime's functions never go to the application role, nor the operator's to the runtime role.
    let err = conveyor_jobs::migrate_with(&config(&db.app_url, &db.app_url, None)).await.unwrap_err();
    assert!(format!("{err:#}").contains("is the application role"), "{err:#}");
    let err =
        conveyor_jobs::migrate_with(&config(&db.app_url, &db.runtime_url, Some(&db.runtime_url))).await.unwrap_err();
    assert!(format!("{err:#}").contains("is the runtime role"), "{err:#}");
    // Running it again with the right roles is fine (idempotent), and the wall still holds.
    conveyor_jobs::migrate_with(&config(&db.app_url, &db.runtime_url, Some(&db.operator_url))).await.unwrap();
    assert!(wall_breaches(&mut db.app_connection().await).await.is_empty());
}

#[tokio::test]
async fn a_dispatcher_or_worker_given_the_application_roles_pool_refuses_to_start_and_says_why() {
    let app = TestApp::spawn().await;
    let redis = common::redis_url();
    let dispatcher = common::test_dispatcher_on(&app.db.app_url, &app.redis_prefix, &redis, |_| {}).await;
    let err = dispatcher.run(tokio_util::sync::CancellationToken::new()).await.unwrap_err();
    assert!(err.to_string().contains("give it the runtime role's pool (CONVEYOR_RUNTIME_DATABASE_URL"), "{err:#}");
    let consumer = conveyor_jobs::Consumer::connect(&redis, &app.redis_prefix).await.unwrap();
    let worker = conveyor_jobs::Worker::builder(app.db.pool.clone(), consumer)
        .runtime_pool(app.db.pool.clone())
        .handle::<conveyor_shop::jobs::VerifyCredentials>(conveyor_shop::jobs::VerifyCredentialsHandler {
            sealer: conveyor_shop::sealing::Sealer::new(&app.config.encryption_key, "k1"),
            marketplace: std::sync::Arc::new(conveyor_shop::adapters::marketplace::HttpMarketplace::new(
                "http://127.0.0.1:9",
                std::time::Duration::from_secs(1),
            )),
            max_attempts: 1,
            timeout: std::time::Duration::from_secs(1),
        })
        .build()
        .unwrap();
    let err = worker.run(tokio_util::sync::CancellationToken::new(), std::time::Duration::ZERO).await.unwrap_err();
    assert!(err.to_string().contains("the worker's pool connects as `conveyor_app`"), "{err:#}");
}
