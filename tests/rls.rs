//! Row-level security is the tenant wall: tested as the application role, which is what the services use.

mod common;

use common::{TestApp, principal, store_body};
use conveyor::config::{MigrateConfig, Secret};
use conveyor::db;
use reqwest::Method;
use sqlx::{Connection, Row};

const TENANT_TABLES: [&str; 5] = ["idempotency_requests", "operations", "outbox_events", "stores", "store_credentials"];

/// Two workspaces with a store each: store, credentials, operation, event and idempotency record.
async fn two_populated_workspaces(app: &TestApp) -> (conveyor::auth::Principal, conveyor::auth::Principal) {
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
        let (n,): (i64,) = sqlx::query_as(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
            .fetch_one(&mut conn)
            .await
            .unwrap();
        assert_eq!(n, 0, "SELECT on {table} without a workspace");
        let updated = sqlx::query(sqlx::AssertSqlSafe(format!("UPDATE {table} SET workspace_id = workspace_id")))
            .execute(&mut conn)
            .await
            .unwrap();
        assert_eq!(updated.rows_affected(), 0, "UPDATE on {table} without a workspace");
        let deleted =
            sqlx::query(sqlx::AssertSqlSafe(format!("DELETE FROM {table}"))).execute(&mut conn).await.unwrap();
        assert_eq!(deleted.rows_affected(), 0, "DELETE on {table} without a workspace");
    }
    // An insert without a workspace fails the policy's WITH CHECK.
    let insert = sqlx::query(
        "INSERT INTO operations (id, workspace_id, kind, created_by) VALUES (gen_random_uuid(), $1, 'x', $1)",
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
    let (n,): (i64,) = sqlx::query_as("SELECT count(*) FROM stores").fetch_one(&mut conn).await.unwrap();
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
    let mut tx = db::begin_workspace(&app.db.pool, a.workspace_id).await.unwrap();
    for table in TENANT_TABLES {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!("SELECT workspace_id FROM {table}")))
            .fetch_all(&mut *tx)
            .await
            .unwrap();
        assert_eq!(rows.len(), 1, "{table}: only A's row");
        assert_eq!(rows[0].get::<uuid::Uuid, _>(0), a.workspace_id.0);
        let updated = sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE {table} SET workspace_id = workspace_id WHERE workspace_id = $1"
        )))
        .bind(b.workspace_id.0)
        .execute(&mut *tx)
        .await
        .unwrap();
        assert_eq!(updated.rows_affected(), 0, "{table}: B's rows cannot be updated from A");
    }
    let found = sqlx::query("SELECT 1 FROM stores WHERE id = $1").bind(b_store).fetch_optional(&mut *tx).await.unwrap();
    assert!(found.is_none());
    let deleted = sqlx::query("DELETE FROM stores WHERE id = $1").bind(b_store).execute(&mut *tx).await.unwrap();
    assert_eq!(deleted.rows_affected(), 0);
    tx.commit().await.unwrap();
    // Moving A's row into B, or writing a row for B, fails the WITH CHECK.
    let mut tx = db::begin_workspace(&app.db.pool, a.workspace_id).await.unwrap();
    let moved = sqlx::query("UPDATE stores SET workspace_id = $1").bind(b.workspace_id.0).execute(&mut *tx).await;
    assert!(moved.is_err(), "a row cannot be moved into another workspace");
    tx.rollback().await.unwrap();
    let mut tx = db::begin_workspace(&app.db.pool, a.workspace_id).await.unwrap();
    let insert = sqlx::query(
        "INSERT INTO operations (id, workspace_id, kind, created_by) VALUES (gen_random_uuid(), $1, 'x', $1)",
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
            format!("ALTER TABLE {table} DISABLE ROW LEVEL SECURITY"),
            format!("ALTER TABLE {table} NO FORCE ROW LEVEL SECURITY"),
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
    assert!(sqlx::query("SELECT * FROM stores").fetch_all(&mut conn).await.is_err());
    let (superuser, bypass): (bool, bool) =
        sqlx::query_as("SELECT rolsuper, rolbypassrls FROM pg_roles WHERE rolname = current_user")
            .fetch_one(&mut conn)
            .await
            .unwrap();
    assert!(!superuser && !bypass);
}

#[tokio::test]
async fn the_definer_function_reveals_workspace_ids_and_nothing_else() {
    let app = TestApp::spawn().await;
    let (a, b) = two_populated_workspaces(&app).await;
    let mut conn = app.db.app_connection().await;
    let rows = sqlx::query("SELECT * FROM conveyor_due_outbox_workspaces(100)").fetch_all(&mut conn).await.unwrap();
    assert_eq!(rows[0].columns().len(), 1, "one column: the workspace id");
    let mut ids: Vec<uuid::Uuid> = rows.iter().map(|r| r.get(0)).collect();
    ids.sort();
    let mut expected = vec![a.workspace_id.0, b.workspace_id.0];
    expected.sort();
    assert_eq!(ids, expected);
    // ... and the outbox itself stays invisible to the same connection.
    let (n,): (i64,) = sqlx::query_as("SELECT count(*) FROM outbox_events").fetch_one(&mut conn).await.unwrap();
    assert_eq!(n, 0);
}

#[tokio::test]
async fn migrate_refuses_an_application_role_that_would_bypass_the_wall() {
    let db = common::TestDb::create().await;
    // The owner as "application role": it owns the tables, so it could turn RLS off.
    let config = MigrateConfig {
        migration_database_url: Secret::new(db.owner_url.clone()),
        database_url: Secret::new(db.owner_url.clone()),
        operator_database_url: None,
    };
    let err = conveyor::migrate::run(&config).await.unwrap_err();
    assert!(format!("{err:#}").contains("must not be"), "{err:#}");
    // Running it again with the right roles is fine (idempotent).
    let config = MigrateConfig {
        migration_database_url: Secret::new(db.owner_url.clone()),
        database_url: Secret::new(db.app_url.clone()),
        operator_database_url: None,
    };
    conveyor::migrate::run(&config).await.unwrap();
}
