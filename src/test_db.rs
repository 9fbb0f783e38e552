//! The platform's own test kit (unit tests only): a database of the test's own on the shared PostgreSQL, migrated as
//! [`crate::migrate_with`] does with the three roles `scripts/services.sh` creates, and a job kind of the platform's
//! own. No HTTP, no product: what the platform's tests of its internals need. The databases share the prefix of the
//! server's tests (`conveyor_test_`), whose harness drops those left by runs more than an hour old.

use std::time::{SystemTime, UNIX_EPOCH};

use sqlx::{Connection, PgConnection, PgPool};
use uuid::Uuid;

use crate::{EnqueueOptions, JobKind, MigrateConfig, WorkspaceId};

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

fn with_database(url: &str, database: &str) -> String {
    let (base, _) = url.rsplit_once('/').expect("a database URL has a path");
    format!("{base}/{database}")
}

/// A migrated database of one test's own.
pub(crate) struct TestDb {
    /// The owner role's URL.
    pub(crate) owner_url: String,
    /// The runtime role's URL.
    pub(crate) runtime_url: String,
    /// The application role's pool.
    pub(crate) pool: PgPool,
    /// The runtime role's pool.
    pub(crate) runtime_pool: PgPool,
}

/// A job kind of the platform's tests.
#[derive(serde::Serialize, serde::Deserialize)]
pub(crate) struct Ping {
    pub(crate) n: u32,
}

impl JobKind for Ping {
    const KIND: &'static str = "test.ping";
    const QUEUE: &'static str = "test-pings";
}

impl TestDb {
    /// Creates and migrates the database (the roles' URLs from `CONVEYOR_TEST_{OWNER,APP,RUNTIME,OPERATOR}_URL`, as
    /// the server's tests read them).
    pub(crate) async fn create() -> Self {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs();
        let name = format!("conveyor_test_{now}_{}", &Uuid::new_v4().simple().to_string()[..12]);
        let owner =
            env_or("CONVEYOR_TEST_OWNER_URL", "postgres://conveyor_owner:conveyor_owner@127.0.0.1:5432/conveyor");
        let app = env_or("CONVEYOR_TEST_APP_URL", "postgres://conveyor_app:conveyor_app@127.0.0.1:5432/conveyor");
        let runtime =
            env_or("CONVEYOR_TEST_RUNTIME_URL", "postgres://conveyor_runtime:conveyor_runtime@127.0.0.1:5432/conveyor");
        let operator = env_or(
            "CONVEYOR_TEST_OPERATOR_URL",
            "postgres://conveyor_operator:conveyor_operator@127.0.0.1:5432/conveyor",
        );
        let mut admin =
            PgConnection::connect(&owner).await.expect("connect as the owner role; run scripts/services.sh");
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut admin)
            .await
            .expect("create a test database");
        let (owner_url, app_url, runtime_url) =
            (with_database(&owner, &name), with_database(&app, &name), with_database(&runtime, &name));
        let role = |url: &str| MigrateConfig::role_of(url).expect("a role's URL");
        let config = MigrateConfig::new(&owner_url, &role(&app_url), &role(&runtime_url)).operator(&role(&operator));
        crate::migrate_with(&config).await.expect("the migrations apply");
        let pool = crate::connect_postgres(&app_url, 8).await.expect("connect as the application role");
        let runtime_pool = crate::connect_postgres(&runtime_url, 4).await.expect("connect as the runtime role");
        Self { owner_url, runtime_url, pool, runtime_pool }
    }

    /// A connection of the owner role.
    pub(crate) async fn owner(&self) -> PgConnection {
        PgConnection::connect(&self.owner_url).await.expect("connect as the owner role")
    }

    /// Enqueues `n` [`Ping`]s in one transaction of `workspace`; their ids in order.
    pub(crate) async fn enqueue(&self, workspace: WorkspaceId, n: u32) -> Vec<Uuid> {
        let mut tx = crate::begin_workspace(&self.pool, workspace).await.unwrap();
        let mut ids = Vec::new();
        for i in 0..n {
            ids.push(crate::enqueue_tx(&mut tx, &Ping { n: i }, EnqueueOptions::new()).await.unwrap().id.0);
        }
        tx.commit().await.unwrap();
        ids
    }

    /// Every outbox row of `workspace`, as JSON (read as the application role, under row-level security).
    pub(crate) async fn events(&self, workspace: WorkspaceId) -> Vec<serde_json::Value> {
        let mut tx = crate::begin_workspace(&self.pool, workspace).await.unwrap();
        let rows: Vec<(serde_json::Value,)> =
            sqlx::query_as("SELECT to_jsonb(e) FROM conveyor.outbox_events e ORDER BY created_at, id")
                .fetch_all(&mut *tx)
                .await
                .unwrap();
        tx.commit().await.unwrap();
        rows.into_iter().map(|(v,)| v).collect()
    }

    /// How many outbox rows of `workspaces` are in `status`.
    pub(crate) async fn count_status(&self, workspaces: &[WorkspaceId], status: &str) -> usize {
        let mut n = 0;
        for ws in workspaces {
            n += self.events(*ws).await.iter().filter(|e| e["status"] == status).count();
        }
        n
    }
}
