//! Test harness shared by every integration binary: a fresh database per test (migrations applied, application
//! role granted), a unique Redis key prefix per test, the API served in-process or as a real child process.
#![allow(dead_code)]

#[path = "../../../../tests/kit/browser.rs"]
pub mod browser;
pub mod cluster;
pub mod pki;
pub mod postgres;
pub mod roles;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use conveyor_jobs::Metrics;
use conveyor_jobs::{UserId, WorkspaceId};
use conveyor_server::auth::{Principal, TokenKeys};
use conveyor_server::config::{Config, MigrateConfig};
use conveyor_server::http::AppState;
use conveyor_server::http::idempotent::ClaimHook;
use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection, PgPool};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

pub const JWT_SECRET: &str = "test-jwt-secret-must-never-leak-0123456789";
/// The operator JWTs' own key (never the workspace tokens').
pub const OPERATOR_JWT_SECRET: &str = "test-operator-jwt-secret-never-the-tenants-0123";
pub const ENCRYPTION_KEY_B64: &str = "dGVzdC1lbmNyeXB0aW9uLWtleS0zMi1ieXRlcyEhISE=";
pub const FINGERPRINT_KEYS: &str = "t1:test-fingerprint-key-must-never-leak-0123";

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).ok().filter(|v| !v.is_empty()).unwrap_or_else(|| default.to_owned())
}

/// The owner role's URL on the maintenance database (`CONVEYOR_TEST_OWNER_URL`).
pub fn owner_base_url() -> String {
    env_or("CONVEYOR_TEST_OWNER_URL", "postgres://conveyor_owner:conveyor_owner@127.0.0.1:5432/conveyor")
}

/// The runtime role's URL on the maintenance database (`CONVEYOR_TEST_RUNTIME_URL`).
pub fn runtime_base_url() -> String {
    env_or("CONVEYOR_TEST_RUNTIME_URL", "postgres://conveyor_runtime:conveyor_runtime@127.0.0.1:5432/conveyor")
}

/// The operator role's URL on the maintenance database (`CONVEYOR_TEST_OPERATOR_URL`).
pub fn operator_base_url() -> String {
    env_or("CONVEYOR_TEST_OPERATOR_URL", "postgres://conveyor_operator:conveyor_operator@127.0.0.1:5432/conveyor")
}

/// The operator token of every test app.
pub const ADMIN_TOKEN: &str = "test-only-admin-token-0123456789abcdef";

pub fn app_base_url() -> String {
    env_or("CONVEYOR_TEST_APP_URL", "postgres://conveyor_app:conveyor_app@127.0.0.1:5432/conveyor")
}

/// The shared Redis (`CONVEYOR_TEST_REDIS_URL`).
pub fn redis_url() -> String {
    env_or("CONVEYOR_TEST_REDIS_URL", "redis://127.0.0.1:6379")
}

fn with_database(url: &str, database: &str) -> String {
    let (base, _) = url.rsplit_once('/').expect("a database URL has a path");
    format!("{base}/{database}")
}

/// What `conveyor migrate` gets for the roles of these URLs (their users), the owner's URL as given.
pub fn migrate_config(owner: &str, app: &str, runtime: &str, operator: Option<&str>) -> MigrateConfig {
    let role = |url: &str| MigrateConfig::role_of(url).expect("a role's URL");
    let config = MigrateConfig::new(owner, &role(app), &role(runtime));
    match operator {
        Some(operator) => config.operator(&role(operator)),
        None => config,
    }
}

/// A database of its own for one test, migrated, with the application role granted.
pub struct TestDb {
    /// Its name.
    pub name: String,
    /// The owner role's URL on it.
    pub owner_url: String,
    /// The application role's URL on it.
    pub app_url: String,
    /// The operator role's URL on it.
    pub operator_url: String,
    /// The runtime role's URL on it (dispatcher, maintenance, the worker's bookkeeping).
    pub runtime_url: String,
    /// A pool of the application role (subject to row-level security).
    pub pool: PgPool,
    /// A pool of the runtime role (subject to row-level security too; executes the functions that work across
    /// workspaces).
    pub runtime_pool: PgPool,
}

impl TestDb {
    pub async fn create() -> Self {
        Self::create_after(async |_| {}).await
    }

    /// A database of its own on which `prepare` runs first (with the owner's URL), then `conveyor migrate`: a database
    /// an earlier release migrated and filled, say.
    pub async fn create_after(prepare: impl AsyncFnOnce(&str)) -> Self {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs();
        let name = format!("conveyor_test_{now}_{}", &Uuid::new_v4().simple().to_string()[..12]);
        let mut admin =
            PgConnection::connect(&owner_base_url()).await.expect("connect as the owner role; run scripts/services.sh");
        sweep_stale_databases(&mut admin, now).await;
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut admin)
            .await
            .expect("create test database");
        let owner_url = with_database(&owner_base_url(), &name);
        let app_url = with_database(&app_base_url(), &name);
        let operator_url = with_database(&operator_base_url(), &name);
        let runtime_url = with_database(&runtime_base_url(), &name);
        prepare(&owner_url).await;
        let migrate = migrate_config(&owner_url, &app_url, &runtime_url, Some(&operator_url));
        conveyor_server::migrate::run(&migrate).await.expect("migrations apply");
        let pool = conveyor_jobs::connect_postgres(&app_url, 16).await.expect("connect as the application role");
        let runtime_pool = conveyor_jobs::connect_postgres(&runtime_url, 8).await.expect("connect as the runtime role");
        Self { name, owner_url, app_url, operator_url, runtime_url, pool, runtime_pool }
    }

    /// A single connection of the owner role.
    pub async fn owner(&self) -> PgConnection {
        PgConnection::connect(&self.owner_url).await.expect("connect as owner")
    }

    /// A single connection of the application role, with no workspace set.
    pub async fn app_connection(&self) -> PgConnection {
        let options: PgConnectOptions = self.app_url.parse().unwrap();
        PgConnection::connect_with(&options).await.expect("connect as application role")
    }

    /// How many rows of `table` the workspace holds (read as the application role under RLS).
    pub async fn count(&self, table: &str, workspace: WorkspaceId) -> i64 {
        let mut tx = conveyor_jobs::begin_workspace(&self.pool, workspace).await.unwrap();
        let (n,): (i64,) = sqlx::query_as(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {}", qualified(table))))
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        n
    }

    /// Every row of `table` in the workspace, as JSON.
    pub async fn rows(&self, table: &str, workspace: WorkspaceId) -> Vec<serde_json::Value> {
        let mut tx = conveyor_jobs::begin_workspace(&self.pool, workspace).await.unwrap();
        let rows: Vec<(serde_json::Value,)> =
            sqlx::query_as(sqlx::AssertSqlSafe(format!("SELECT to_jsonb(t) FROM {} t", qualified(table))))
                .fetch_all(&mut *tx)
                .await
                .unwrap();
        tx.commit().await.unwrap();
        rows.into_iter().map(|(v,)| v).collect()
    }
}

/// `table` named with its crate's schema: the shop's in `conveyor_shop`, the API's idempotency records in
/// `conveyor_server`, the rest in the platform's `conveyor` (a name with a schema already is left as it is).
pub fn qualified(table: &str) -> String {
    if table.contains('.') {
        table.to_owned()
    } else if conveyor_shop::migrate::TABLES.contains(&table) {
        format!("conveyor_shop.{table}")
    } else if table == "idempotency_requests" {
        format!("conveyor_server.{table}")
    } else {
        format!("conveyor.{table}")
    }
}

/// Drops test databases left by runs more than an hour old (a test process cannot drop its own on exit). Not while
/// `CONVEYOR_TEST_KEEP_STALE` is set, as `scripts/bench` does: dropping a database forces a checkpoint and deletes
/// its files, and the disk's stalls that follow would land in the measurements.
async fn sweep_stale_databases(admin: &mut PgConnection, now: u64) {
    if std::env::var_os("CONVEYOR_TEST_KEEP_STALE").is_some() {
        return;
    }
    let names: Vec<(String,)> =
        sqlx::query_as("SELECT datname::text FROM pg_database WHERE datname LIKE 'conveyor\\_test\\_%'")
            .fetch_all(&mut *admin)
            .await
            .unwrap_or_default();
    for (name,) in names {
        let created = name.split('_').nth(2).and_then(|s| s.parse::<u64>().ok()).unwrap_or(now);
        if now.saturating_sub(created) > 3600 {
            let _ =
                sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {name}"))).execute(&mut *admin).await;
        }
    }
}

/// The variables a Conveyor process of this test runs with.
pub fn config_vars(db: &TestDb, redis_prefix: &str) -> HashMap<String, String> {
    HashMap::from([
        ("CONVEYOR_DATABASE_URL".to_owned(), db.app_url.clone()),
        ("CONVEYOR_MIGRATION_DATABASE_URL".to_owned(), db.owner_url.clone()),
        ("CONVEYOR_OPERATOR_DATABASE_URL".to_owned(), db.operator_url.clone()),
        ("CONVEYOR_RUNTIME_DATABASE_URL".to_owned(), db.runtime_url.clone()),
        ("CONVEYOR_ADMIN_TOKEN".to_owned(), ADMIN_TOKEN.to_owned()),
        ("CONVEYOR_REDIS_URL".to_owned(), redis_url()),
        ("CONVEYOR_REDIS_PREFIX".to_owned(), redis_prefix.to_owned()),
        ("CONVEYOR_JWT_SECRET".to_owned(), JWT_SECRET.to_owned()),
        ("CONVEYOR_OPERATOR_JWT_SECRET".to_owned(), OPERATOR_JWT_SECRET.to_owned()),
        ("CONVEYOR_IDEMPOTENCY_KEYS".to_owned(), FINGERPRINT_KEYS.to_owned()),
        ("CONVEYOR_ENCRYPTION_KEY".to_owned(), ENCRYPTION_KEY_B64.to_owned()),
        ("CONVEYOR_HTTP_ADDR".to_owned(), "127.0.0.1:0".to_owned()),
        ("CONVEYOR_ADMIN_ADDR".to_owned(), "127.0.0.1:0".to_owned()),
        ("CONVEYOR_OBJECT_STORE_URL".to_owned(), format!("file://{}", objects_dir(redis_prefix).display())),
    ])
}

/// The object store directory of the test with `redis_prefix` (under the system's temporary directory).
pub fn objects_dir(redis_prefix: &str) -> PathBuf {
    std::env::temp_dir().join("conveyor-test-objects").join(redis_prefix)
}

/// A random workspace and user.
pub fn principal() -> Principal {
    Principal { workspace_id: WorkspaceId(Uuid::new_v4()), user_id: UserId(Uuid::new_v4()) }
}

/// The API served in-process over a fresh database and Redis prefix.
pub struct TestApp {
    pub db: Arc<TestDb>,
    pub config: Config,
    pub redis_prefix: String,
    pub addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub http: reqwest::Client,
    pub tokens: TokenKeys,
    pub shutdown: CancellationToken,
}

impl TestApp {
    pub async fn spawn() -> Self {
        Self::spawn_with(|_| {}).await
    }

    /// Spawns with variables changed by `tweak` first.
    pub async fn spawn_with(tweak: impl FnOnce(&mut HashMap<String, String>)) -> Self {
        Self::spawn_with_hook(tweak, None).await
    }

    /// Spawns with variables changed by `tweak` and a hook run right after each idempotency claim.
    pub async fn spawn_with_hook(tweak: impl FnOnce(&mut HashMap<String, String>), hook: Option<ClaimHook>) -> Self {
        Self::spawn_on(Arc::new(TestDb::create().await), tweak, hook).await
    }

    /// The API over `db` (a database of the test's own server, say), with variables changed by `tweak`.
    pub async fn spawn_on_db(db: Arc<TestDb>, tweak: impl FnOnce(&mut HashMap<String, String>)) -> Self {
        Self::spawn_on(db, tweak, None).await
    }

    /// A second API over the same database as `self` (another process's view), with variables changed by `tweak`.
    pub async fn spawn_sharing(&self, tweak: impl FnOnce(&mut HashMap<String, String>)) -> Self {
        Self::spawn_on(self.db.clone(), tweak, None).await
    }

    async fn spawn_on(
        db: Arc<TestDb>,
        tweak: impl FnOnce(&mut HashMap<String, String>),
        hook: Option<ClaimHook>,
    ) -> Self {
        let redis_prefix = format!("conveyor-test-{}", Uuid::new_v4().simple());
        let mut vars = config_vars(&db, &redis_prefix);
        tweak(&mut vars);
        let config = Config::from_source(&vars).expect("test configuration is valid");
        let mut shared = conveyor_server::app::connect_state(&config, Metrics::new()).await.expect("state");
        shared.claim_hook = hook;
        let state = AppState(Arc::new(shared));
        let api = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let admin = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (addr, admin_addr) = (api.local_addr().unwrap(), admin.local_addr().unwrap());
        let shutdown = CancellationToken::new();
        tokio::spawn(conveyor_server::app::serve(state, api, admin, shutdown.clone()));
        Self {
            tokens: TokenKeys::new(config.jwt_secret.as_ref().expect("the test API has a JWT secret")),
            db,
            config,
            redis_prefix,
            addr,
            admin_addr,
            http: reqwest::Client::new(),
            shutdown,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// The admin listener's `/metrics` text.
    pub async fn metrics(&self) -> String {
        self.http.get(format!("http://{}/metrics", self.admin_addr)).send().await.unwrap().text().await.unwrap()
    }

    pub fn token(&self, principal: Principal) -> String {
        self.tokens.mint(principal, Duration::from_secs(3600))
    }

    /// Sends `body` as JSON with a bearer token for `principal`, and a fresh `Idempotency-Key` on writes.
    pub async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        principal: Principal,
        body: Option<&serde_json::Value>,
    ) -> reqwest::Response {
        let key = (method != reqwest::Method::GET).then(|| Uuid::new_v4().to_string());
        self.send_with_key(method, path, principal, key.as_deref(), body).await
    }

    /// Sends `body` as JSON with a bearer token for `principal` and the given `Idempotency-Key`, if any.
    pub async fn send_with_key(
        &self,
        method: reqwest::Method,
        path: &str,
        principal: Principal,
        key: Option<&str>,
        body: Option<&serde_json::Value>,
    ) -> reqwest::Response {
        let mut req = self.http.request(method, self.url(path)).bearer_auth(self.token(principal));
        if let Some(key) = key {
            req = req.header("idempotency-key", key);
        }
        if let Some(body) = body {
            req = req.json(body);
        }
        req.send().await.expect("request reaches the API")
    }
}

impl Drop for TestApp {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// A store creation body whose credentials carry `marker`.
pub fn store_body(marker: &str) -> serde_json::Value {
    serde_json::json!({
        "name": "Main shop",
        "platform": "sandbox",
        "credentials": { "api_key": format!("key-{marker}"), "api_secret": format!("secret-{marker}") }
    })
}

/// The `conveyor` binary built for this test run.
pub fn conveyor_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_conveyor"))
}

/// A real `conveyor` process whose stderr goes to a file read back with [`Process::log`].
pub struct Process {
    pub child: Child,
    pub log_path: PathBuf,
}

impl Process {
    pub fn spawn(args: &[&str], vars: &HashMap<String, String>) -> Self {
        let log_path = std::env::temp_dir().join(format!("conveyor-test-{}.log", Uuid::new_v4().simple()));
        let log = std::fs::File::create(&log_path).unwrap();
        let child = Command::new(conveyor_bin())
            .args(args)
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .envs(vars)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn conveyor");
        Self { child, log_path }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// Waits for the process to exit, as it must within 30 s and not successfully (a start-up refused), and returns
    /// its log.
    pub async fn fails_at_start(mut self) -> String {
        let exited = eventually(Duration::from_secs(30), || {
            let status = self.child.try_wait().ok().flatten();
            async move { status }
        })
        .await;
        let log = self.log();
        let status = exited.unwrap_or_else(|| panic!("the process did not exit; its log:\n{log}"));
        assert!(!status.success(), "the process exited successfully; its log:\n{log}");
        log
    }

    /// Sends SIGKILL and reaps the process.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends a signal by number (15 = SIGTERM).
    pub fn signal(&self, signal: i32) {
        let _ = Command::new("kill").arg(format!("-{signal}")).arg(self.child.id().to_string()).status();
    }

    /// SIGTERM, then waits for the process to end its in-flight work and exit (SIGKILL after 60 s).
    pub async fn stop(&mut self) {
        if self.child.try_wait().ok().flatten().is_some() {
            return;
        }
        self.signal(15);
        for _ in 0..600 {
            if self.child.try_wait().ok().flatten().is_some() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        self.kill();
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_file(&self.log_path);
    }
}

/// Polls `check` every 50 ms until it returns `Some`, for at most `limit`.
pub async fn eventually<T, F, Fut>(limit: Duration, mut check: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
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

/// A free loopback port for a process a test starts, below Linux's ephemeral range (32768-60999): a port the kernel
/// handed out for `:0` is also the kind it hands every outgoing connection (to PostgreSQL, to Redis) as its local
/// port, and one of those, opened by a concurrent test between this call and the process's bind, took it at times
/// ("Address already in use"). Free when checked, and never one this process handed out already (a port picked and
/// not yet bound by the process it was for is free too); another test's pick collides with it once in about 12,000.
pub fn free_port() -> u16 {
    static HANDED_OUT: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut handed_out = HANDED_OUT.lock().expect("handed-out ports lock");
    let start = rand::random_range(20_000..32_000u16);
    let port = (0..12_000u16)
        .map(|i| 20_000 + (start - 20_000 + i) % 12_000)
        .find(|port| !handed_out.contains(port) && std::net::TcpListener::bind(("127.0.0.1", *port)).is_ok())
        .expect("a free loopback port between 20000 and 32000");
    handed_out.push(port);
    port
}

/// A `redis-server` of the test's own on a free loopback port, which the test may stop and start again.
pub struct TestRedis {
    pub port: u16,
    pub password: Option<String>,
    child: Option<Child>,
    /// With TLS only: the server's certificate, key and the CA of its clients' certificates (PEM files).
    tls: Option<RedisServerTls>,
}

/// The files a TLS-only `redis-server` serves with; clients must present a certificate `ca_file` vouches for
/// (`redis-cli` presents `client_cert_file`).
#[derive(Clone)]
pub struct RedisServerTls {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    pub ca_file: PathBuf,
    pub client_cert_file: PathBuf,
    pub client_key_file: PathBuf,
}

impl RedisServerTls {
    /// `redis-server` arguments serving TLS only on `port` (no plain port), a client certificate required; the
    /// server presents its own certificate to the servers it connects to (a replica to its master, a sentinel to
    /// what it watches, a cluster node to the others: each has its `tls-*` switch).
    pub fn server_args(&self, port: u16) -> Vec<String> {
        let mut args: Vec<String> =
            ["--port", "0", "--tls-port", &port.to_string(), "--tls-auth-clients", "yes"].map(str::to_owned).into();
        for (flag, file) in [
            ("--tls-cert-file", &self.cert_file),
            ("--tls-key-file", &self.key_file),
            ("--tls-ca-cert-file", &self.ca_file),
        ] {
            args.extend([flag.to_owned(), file.display().to_string()]);
        }
        args
    }

    /// The same as `redis.conf` lines (a sentinel's configuration file).
    pub fn config_lines(&self, port: u16) -> String {
        self.server_args(port).chunks(2).map(|kv| format!("{} {}\n", kv[0].trim_start_matches('-'), kv[1])).collect()
    }

    /// `redis-cli` arguments to talk to such a server.
    pub fn cli_args(&self) -> Vec<String> {
        let mut args = vec!["--tls".to_owned()];
        for (flag, file) in
            [("--cacert", &self.ca_file), ("--cert", &self.client_cert_file), ("--key", &self.client_key_file)]
        {
            args.extend([flag.to_owned(), file.display().to_string()]);
        }
        args
    }
}

impl TestRedis {
    pub async fn start(password: Option<&str>) -> Self {
        let mut redis = Self { port: free_port(), password: password.map(str::to_owned), child: None, tls: None };
        redis.start_again().await;
        redis
    }

    /// A server that speaks TLS only (no plain port) and requires a client certificate.
    pub async fn start_tls(tls: RedisServerTls) -> Self {
        let mut redis = Self { port: free_port(), password: None, child: None, tls: Some(tls) };
        redis.start_again().await;
        redis
    }

    /// The URL to reach it (with the password, if any).
    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "rediss" } else { "redis" };
        match &self.password {
            Some(p) => format!("{scheme}://:{p}@127.0.0.1:{}", self.port),
            None => format!("{scheme}://127.0.0.1:{}", self.port),
        }
    }

    /// Starts the server (empty: it keeps nothing on disk) and waits until it answers.
    pub async fn start_again(&mut self) {
        let mut cmd = Command::new("redis-server");
        match &self.tls {
            None => cmd.args(["--port", &self.port.to_string()]),
            Some(tls) => cmd.args(tls.server_args(self.port)),
        };
        cmd.args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]);
        if let Some(p) = &self.password {
            cmd.args(["--requirepass", p]);
        }
        self.child = Some(cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn().expect("redis-server is installed"));
        let port = self.port;
        eventually(Duration::from_secs(10), || async move {
            std::net::TcpStream::connect(("127.0.0.1", port)).ok().map(|_| ())
        })
        .await
        .expect("test redis-server answers");
    }

    /// Kills the server (SIGKILL): everything in it is lost.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for TestRedis {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A Redis client for assertions.
pub async fn redis_client(url: &str) -> conveyor_jobs::RedisClient {
    redis_client_with(url, &Default::default()).await
}

/// [`redis_client`] with TLS files (a `rediss…://` URL).
pub async fn redis_client_with(url: &str, tls: &conveyor_jobs::RedisTls) -> conveyor_jobs::RedisClient {
    conveyor_jobs::connect_redis_with(url, Duration::from_secs(5), tls).await.expect("connect to redis")
}

/// The entries of the stream of `queue` (under `app`'s prefix) that its workers read and have not acknowledged yet: 0
/// before any worker made the group.
pub async fn unacknowledged(client: &conveyor_jobs::RedisClient, app: &TestApp, queue: &str) -> i64 {
    use fred::prelude::StreamsInterface;
    let keys = conveyor_jobs::RedisKeys::new(&app.redis_prefix);
    let Ok(summary) = client.xpending::<fred::types::Value, _, _, _>(keys.stream(queue), keys.group(queue), ()).await
    else {
        return 0;
    };
    let fred::types::Value::Array(summary) = summary else { panic!("XPENDING answered {summary:?}") };
    summary[0].as_i64().expect("XPENDING's count")
}

/// The `event_id` field of every entry of `stream`, in stream order.
pub async fn stream_event_ids(client: &conveyor_jobs::RedisClient, stream: &str) -> Vec<String> {
    use fred::prelude::StreamsInterface;
    let entries: Vec<(String, HashMap<String, String>)> = client.xrange(stream, "-", "+", None).await.expect("XRANGE");
    entries.into_iter().map(|(_, fields)| fields.get("event_id").cloned().unwrap_or_default()).collect()
}

/// The sandbox marketplace, served in-process on a free port; its URL and a handle to read its counters.
pub async fn sandbox(
    settings: conveyor_shop::adapters::sandbox::Settings,
) -> (conveyor_shop::adapters::sandbox::Sandbox, String) {
    let sandbox = conveyor_shop::adapters::sandbox::Sandbox::new(settings);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(sandbox.clone().serve(listener, CancellationToken::new()));
    (sandbox, url)
}

/// A dispatcher over the test's database and prefix, on `redis_url`, with `CONVEYOR_DISPATCH_*` set by `tweak`.
pub async fn test_dispatcher(
    app: &TestApp,
    redis_url: &str,
    tweak: impl FnOnce(&mut HashMap<String, String>),
) -> conveyor_jobs::Dispatcher {
    test_dispatcher_on(&app.db.runtime_url, &app.redis_prefix, redis_url, tweak).await
}

/// A dispatcher over the database at `runtime_url` (the runtime role) and the key prefix `redis_prefix`: what
/// [`test_dispatcher`] builds, for a runtime that does not hold the [`TestApp`].
pub async fn test_dispatcher_on(
    runtime_url: &str,
    redis_prefix: &str,
    redis_url: &str,
    tweak: impl FnOnce(&mut HashMap<String, String>),
) -> conveyor_jobs::Dispatcher {
    test_dispatcher_metered(runtime_url, redis_prefix, redis_url, tweak, Metrics::new()).await
}

/// What [`test_dispatcher_on`] builds, counting into `metrics`.
pub async fn test_dispatcher_metered(
    runtime_url: &str,
    redis_prefix: &str,
    redis_url: &str,
    tweak: impl FnOnce(&mut HashMap<String, String>),
    metrics: Metrics,
) -> conveyor_jobs::Dispatcher {
    use conveyor_jobs::Dispatcher;
    let mut vars = HashMap::new();
    tweak(&mut vars);
    let settings = conveyor_server::config::dispatcher_settings(&vars).unwrap();
    let client = conveyor_jobs::connect_redis(redis_url, Duration::from_millis(500)).await.unwrap();
    let producer =
        conveyor_jobs::Producer::new(client, conveyor_jobs::RedisKeys::new(redis_prefix), settings.dedup_ttl);
    // A pool of its own, as a dispatcher process would have.
    let pool = conveyor_jobs::connect_postgres(runtime_url, 8).await.unwrap();
    Dispatcher::new(pool, producer, settings, metrics, conveyor_jobs::instance_name())
}

/// A worker with the shipped handlers over the test's database and prefix, on `redis_url`, calling the
/// marketplace at `marketplace_url`.
pub async fn test_worker(
    app: &TestApp,
    redis_url: &str,
    marketplace_url: &str,
    settings: conveyor_jobs::WorkerSettings,
    max_attempts: u32,
    metrics: Metrics,
) -> conveyor_jobs::Worker {
    let client = conveyor_jobs::connect_redis(redis_url, Duration::from_secs(2)).await.unwrap();
    let blocking = conveyor_jobs::connect_redis(redis_url, Duration::from_secs(5)).await.unwrap();
    let consumer = conveyor_jobs::Consumer::new(
        client,
        blocking,
        conveyor_jobs::RedisKeys::new(&app.redis_prefix),
        format!("test-{}", Uuid::new_v4().simple()),
    );
    let sealer = conveyor_shop::sealing::Sealer::new(&app.config.encryption_key, "k1");
    let marketplace =
        Arc::new(conveyor_shop::adapters::marketplace::HttpMarketplace::new(marketplace_url, Duration::from_secs(10)));
    conveyor_jobs::Worker::builder(app.db.pool.clone(), consumer)
        .runtime_pool(app.db.runtime_pool.clone())
        .handle::<conveyor_shop::jobs::VerifyCredentials>(conveyor_shop::jobs::VerifyCredentialsHandler {
            sealer,
            marketplace,
            max_attempts,
            timeout: Duration::from_secs(30),
        })
        .settings(settings)
        .metrics(metrics)
        .build()
        .unwrap()
}

/// Runs `dispatcher` in the background until `shutdown`.
pub fn run_dispatcher(dispatcher: conveyor_jobs::Dispatcher, shutdown: &CancellationToken) {
    tokio::spawn(dispatcher.run(shutdown.clone()));
}

/// The operation `id` as the API shows it.
pub async fn operation(app: &TestApp, who: Principal, id: &str) -> serde_json::Value {
    app.send(reqwest::Method::GET, &format!("/v1/operations/{id}"), who, None).await.json().await.unwrap()
}

/// Waits until the operation reaches `status` (or `limit` passes), returning it.
pub async fn operation_reaches(
    app: &TestApp,
    who: Principal,
    id: &str,
    status: &str,
    limit: Duration,
) -> Option<serde_json::Value> {
    eventually(limit, || async {
        let op = operation(app, who, id).await;
        (op["status"] == status).then_some(op)
    })
    .await
}
