//! The kit of the platform's integration tests (`tests/platform`) and benchmarks (`benches/`): a migrated database of
//! the run's own on the shared PostgreSQL (the roles `scripts/services.sh` creates, read from the tests'
//! `CONVEYOR_TEST_*_URL` variables), in the multi-tenant mode ([`Platform::new`]) or the single-role one
//! ([`Platform::single_role`]), a Redis key prefix of its own, a dispatcher and a worker built from the platform's
//! public API alone. No HTTP, no product: the end-to-end tests and benchmarks of the shipped processes are the
//! server's.

#![allow(dead_code)] // Each test binary and benchmark uses part of the kit.

pub mod browser;
pub mod report;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use conveyor_jobs::{
    Consumer, Dispatcher, DispatcherSettings, JobKind, MigrateConfig, Producer, RedisClient, RedisKeys,
};
use serde::{Deserialize, Serialize};
use sqlx::{Connection, PgConnection, PgPool};
use uuid::Uuid;

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

fn with_database(url: &str, database: &str) -> String {
    let (base, _) = url.rsplit_once('/').expect("a database URL has a path");
    format!("{base}/{database}")
}

/// The shared Redis (`CONVEYOR_TEST_REDIS_URL`).
pub fn redis_url() -> String {
    env_or("CONVEYOR_TEST_REDIS_URL", "redis://127.0.0.1:6379")
}

/// The benchmarks' job kind: a payload the handler ignores but for its commit time.
#[derive(Serialize, Deserialize)]
pub struct Job {
    /// Which tenant or series the job belongs to (the fairness benchmark's).
    pub tenant: usize,
    /// When its transaction was about to commit, ms since the epoch.
    pub at_ms: f64,
}

impl JobKind for Job {
    const KIND: &'static str = "bench.job";
    const QUEUE: &'static str = "bench";
}

/// A migrated database and a Redis prefix of one benchmark run's own.
pub struct Platform {
    /// The owner role's URL on the database.
    pub owner_url: String,
    /// The application role's URL (row-level security applies).
    pub app_url: String,
    /// The runtime role's URL (the dispatcher's and the worker's bookkeeping).
    pub runtime_url: String,
    /// A pool of the application role.
    pub pool: PgPool,
    /// A pool of the runtime role.
    pub runtime_pool: PgPool,
    /// The Redis key prefix of this run.
    pub prefix: String,
}

/// A database of one test's own, created by the owner role of `scripts/services.sh` (which then owns it), with nothing
/// in it yet; its URL as that owner.
pub async fn empty_database() -> String {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs();
    let name = format!("conveyor_test_{now}_{}", &Uuid::new_v4().simple().to_string()[..12]);
    let owner = env_or("CONVEYOR_TEST_OWNER_URL", "postgres://conveyor_owner:conveyor_owner@127.0.0.1:5432/conveyor");
    let mut admin = PgConnection::connect(&owner).await.expect("connect as the owner role: run scripts/services.sh");
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut admin)
        .await
        .expect("create the test's database");
    with_database(&owner, &name)
}

/// A fresh Redis key prefix.
pub fn prefix() -> String {
    format!("test:{}", &Uuid::new_v4().simple().to_string()[..12])
}

impl Platform {
    /// The single-role mode: a fresh database whose one role owns it (and everything), migrated by
    /// `conveyor_jobs::migrate(&pool)`; every pool of the platform is that role's.
    pub async fn single_role() -> Self {
        let url = empty_database().await;
        let pool = conveyor_jobs::connect_postgres(&url, 16).await.expect("connect as the database's owner");
        conveyor_jobs::migrate(&pool).await.expect("the migrations apply with one role");
        Self {
            owner_url: url.clone(),
            app_url: url.clone(),
            runtime_url: url,
            runtime_pool: pool.clone(),
            pool,
            prefix: prefix(),
        }
    }

    /// Creates a database (named like the tests', so that their harness drops it when it is stale), migrates it as
    /// `conveyor_jobs::migrate_with` does and opens pools of `max_connections` for the application role.
    pub async fn new(max_connections: u32) -> Self {
        let owner_url = empty_database().await;
        let database = owner_url.rsplit_once('/').expect("a database URL has a path").1.to_owned();
        let app = env_or("CONVEYOR_TEST_APP_URL", "postgres://conveyor_app:conveyor_app@127.0.0.1:5432/conveyor");
        let runtime =
            env_or("CONVEYOR_TEST_RUNTIME_URL", "postgres://conveyor_runtime:conveyor_runtime@127.0.0.1:5432/conveyor");
        let (app_url, runtime_url) = (with_database(&app, &database), with_database(&runtime, &database));
        let role = |url: &str| MigrateConfig::role_of(url).expect("a role's URL");
        let config = MigrateConfig::new(&owner_url, &role(&app_url), &role(&runtime_url));
        conveyor_jobs::migrate_with(&config).await.expect("the migrations apply");
        let pool = conveyor_jobs::connect_postgres(&app_url, max_connections).await.expect("connect as the app");
        let runtime_pool = conveyor_jobs::connect_postgres(&runtime_url, 8).await.expect("connect as the runtime");
        Self { owner_url, app_url, runtime_url, pool, runtime_pool, prefix: prefix() }
    }

    /// A connection of the owner role (reads across workspaces, `ANALYZE`).
    pub async fn owner(&self) -> PgConnection {
        PgConnection::connect(&self.owner_url).await.expect("connect as the owner role")
    }

    /// The row of a job whose `XADD` reached the stream but whose reply was lost: the relay put it back to pending.
    pub const XADD_REPLY_LOST: &str =
        "status = 'pending', locked_by = NULL, locked_until = NULL, stream_id = NULL, dispatched_at = NULL";
    /// The row of a job the relay has `XADD`ed and not marked yet: leased, no hand-off time.
    pub const MARK_NOT_RECORDED: &str = "status = 'dispatching', locked_by = 'a-relay', \
         locked_until = now() + interval '1 minute', dispatched_at = NULL, stream_id = NULL";

    /// Puts job `job` of `workspace` in a state no public call reaches on its own, as the owner role: `set` is the
    /// `SET` list of an `UPDATE` of its row (a relay that died between its `XADD` and its mark, say).
    pub async fn set_job_row(&self, workspace: conveyor_jobs::WorkspaceId, job: Uuid, set: &str) {
        let mut owner = self.owner().await;
        sqlx::query("SELECT set_config('app.workspace_id', $1, false)")
            .bind(workspace.0.to_string())
            .execute(&mut owner)
            .await
            .unwrap();
        let updated =
            sqlx::query(sqlx::AssertSqlSafe(format!("UPDATE conveyor.outbox_events SET {set} WHERE id = $1")))
                .bind(job)
                .execute(&mut owner)
                .await
                .unwrap()
                .rows_affected();
        assert_eq!(updated, 1, "job {job} of workspace {} was set", workspace.0);
    }

    /// This run's Redis keys.
    pub fn keys(&self) -> RedisKeys {
        RedisKeys::new(&self.prefix)
    }

    /// A dispatcher over this run's database and prefix, with a pool of its own, as a dispatcher process has.
    pub async fn dispatcher(&self, tweak: impl FnOnce(&mut DispatcherSettings)) -> Dispatcher {
        dispatcher_on(&self.runtime_url, &self.prefix, tweak).await
    }

    /// A consumer of this run's streams (a client for commands, another for blocking reads).
    pub async fn consumer(&self, name: &str) -> Consumer {
        consumer_on(&self.prefix, name).await
    }
}

/// A dispatcher on the runtime role's `runtime_url` and Redis `prefix` (for one built on a runtime of its own).
pub async fn dispatcher_on(runtime_url: &str, prefix: &str, tweak: impl FnOnce(&mut DispatcherSettings)) -> Dispatcher {
    let mut settings = DispatcherSettings::default();
    tweak(&mut settings);
    settings.validate().expect("valid dispatcher settings");
    let client = conveyor_jobs::connect_redis(&redis_url(), Duration::from_secs(5)).await.expect("connect to Redis");
    let producer = Producer::new(client, RedisKeys::new(prefix), settings.dedup_ttl);
    let pool = conveyor_jobs::connect_postgres(runtime_url, 8).await.expect("connect as the runtime role");
    Dispatcher::new(pool, producer, settings, conveyor_jobs::Metrics::new(), conveyor_jobs::instance_name())
}

/// A consumer named `name` of the streams under `prefix`.
pub async fn consumer_on(prefix: &str, name: &str) -> Consumer {
    let client = conveyor_jobs::connect_redis(&redis_url(), Duration::from_secs(5)).await.expect("connect to Redis");
    let blocking = conveyor_jobs::connect_redis(&redis_url(), Duration::from_secs(10)).await.expect("connect to Redis");
    Consumer::new(client, blocking, RedisKeys::new(prefix), name.into())
}

/// A client of the shared Redis.
pub async fn redis() -> RedisClient {
    conveyor_jobs::connect_redis(&redis_url(), Duration::from_secs(5)).await.expect("connect to Redis")
}

/// Calls `check` every 50 ms until it returns `Some` or `limit` passes.
pub async fn eventually<T, F, Fut>(limit: Duration, mut check: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if let Some(v) = check().await {
            return Some(v);
        }
        if tokio::time::Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
