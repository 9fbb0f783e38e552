//! Conveyor's schema in a service's own database: its migration history never clashes with the service's own sqlx
//! migrations, and a database migrated by an earlier release (history in `_sqlx_migrations`) is adopted.

use crate::common;

use std::time::{SystemTime, UNIX_EPOCH};

use sqlx::migrate::Migrator;
use sqlx::{Connection, PgConnection};
use uuid::Uuid;

/// An empty database of the test's own: the owner's, the application role's and the runtime role's URLs on it.
async fn empty_database() -> (String, String, String) {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs();
    let name = format!("conveyor_test_{now}_{}", &Uuid::new_v4().simple().to_string()[..12]);
    let mut admin = PgConnection::connect(&common::owner_base_url()).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}"))).execute(&mut admin).await.unwrap();
    let on = |url: String| format!("{}/{name}", url.rsplit_once('/').unwrap().0);
    (on(common::owner_base_url()), on(common::app_base_url()), on(common::runtime_base_url()))
}

async fn versions(conn: &mut PgConnection, table: &str) -> Vec<i64> {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT version FROM {table} ORDER BY version")))
        .fetch_all(conn)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_services_own_sqlx_migrations_and_conveyors_share_a_database_without_clashing() {
    let (owner, app, runtime) = empty_database().await;
    conveyor_jobs::migrate(&owner, &app, &runtime).await.unwrap();

    // The service's own migrations, versions 1 and 2 as Conveyor's are: sqlx's default history table is theirs.
    let dir = std::env::temp_dir().join(format!("service-migrations-{}", Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("1_orders.sql"), "CREATE TABLE orders (id uuid PRIMARY KEY, item text NOT NULL);").unwrap();
    std::fs::write(dir.join("2_order_notes.sql"), "ALTER TABLE orders ADD COLUMN note text;").unwrap();
    let mut conn = PgConnection::connect(&owner).await.unwrap();
    Migrator::new(dir.as_path()).await.unwrap().run(&mut conn).await.unwrap();

    // Both run again, in either order, and each keeps its own history.
    conveyor_jobs::migrate(&owner, &app, &runtime).await.unwrap();
    Migrator::new(dir.as_path()).await.unwrap().run(&mut conn).await.unwrap();
    assert_eq!(versions(&mut conn, "_sqlx_migrations").await, [1, 2]);
    let ours: Vec<i64> = conveyor_jobs::MIGRATOR.iter().map(|m| m.version).collect();
    assert_eq!(versions(&mut conn, conveyor_jobs::MIGRATION_HISTORY_TABLE).await, ours);
    // Conveyor grants its application role its own tables only.
    let granted: bool = sqlx::query_scalar("SELECT has_table_privilege($1, 'orders', 'SELECT')")
        .bind(app.rsplit_once("://").unwrap().1.split(':').next().unwrap())
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert!(!granted, "the service's table is not Conveyor's to grant");
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test]
async fn a_database_migrated_by_an_earlier_release_has_its_history_adopted() {
    let (owner, app, runtime) = empty_database().await;
    // An earlier release recorded Conveyor's history in `_sqlx_migrations`, and had applied up to version 5.
    let mut conn = PgConnection::connect(&owner).await.unwrap();
    conveyor_jobs::MIGRATOR.run_to(5, &mut conn).await.unwrap();
    assert_eq!(versions(&mut conn, "_sqlx_migrations").await, [1, 2, 3, 4, 5]);

    conveyor_jobs::migrate(&owner, &app, &runtime).await.unwrap();
    let ours: Vec<i64> = conveyor_jobs::MIGRATOR.iter().map(|m| m.version).collect();
    assert_eq!(
        versions(&mut conn, conveyor_jobs::MIGRATION_HISTORY_TABLE).await,
        ours,
        "adopted, then the rest applied"
    );
    let kinds: Option<String> =
        sqlx::query_scalar("SELECT to_regclass('job_kinds')::text").fetch_one(&mut conn).await.unwrap();
    assert_eq!(kinds.as_deref(), Some("job_kinds"));
    // The application role's readiness check reads the new history: nothing pending.
    let pool = conveyor_jobs::connect_postgres(&app, 2).await.unwrap();
    assert_eq!(conveyor_jobs::pending_migrations(&pool).await.unwrap(), 0);
}

#[tokio::test]
async fn jobs_that_ran_before_job_ends_were_recorded_are_ended_by_the_upgrade_and_live_ones_stay_live() {
    let (owner, app, runtime) = empty_database().await;
    // A database of the release before 0006: a job that ran ended `dispatched` for good.
    let mut conn = PgConnection::connect(&owner).await.unwrap();
    conveyor_jobs::MIGRATOR.run_to(5, &mut conn).await.unwrap();
    let ws = Uuid::new_v4();
    let (done_op, live_op, done_job, live_job) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
    let mut tx = conn.begin().await.unwrap();
    sqlx::query("SELECT set_config('app.workspace_id', $1, true)")
        .bind(ws.to_string())
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO operations (id, workspace_id, kind, status, created_by)
         VALUES ($1, $3, 'k', 'succeeded', $3), ($2, $3, 'k', 'running', $3)",
    )
    .bind(done_op)
    .bind(live_op)
    .bind(ws)
    .execute(&mut *tx)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO outbox_events (id, workspace_id, queue, event_type, event_payload, operation_id, status,
                                    stream_id, dispatched_at)
         VALUES ($1, $5, 'q', 'k', '{}', $3, 'dispatched', '1-1', now()),
                ($2, $5, 'q', 'k', '{}', $4, 'dispatched', '1-2', now())",
    )
    .bind(done_job)
    .bind(live_job)
    .bind(done_op)
    .bind(live_op)
    .bind(ws)
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();

    conveyor_jobs::migrate(&owner, &app, &runtime).await.unwrap();
    let mut tx = conn.begin().await.unwrap();
    sqlx::query("SELECT set_config('app.workspace_id', $1, true)")
        .bind(ws.to_string())
        .execute(&mut *tx)
        .await
        .unwrap();
    let statuses: Vec<(Uuid, String, bool)> =
        sqlx::query_as("SELECT id, status, finished_at IS NOT NULL FROM outbox_events ORDER BY id")
            .fetch_all(&mut *tx)
            .await
            .unwrap();
    assert_eq!(statuses, [(done_job, "completed".into(), true), (live_job, "dispatched".into(), false)]);
}
