//! A PostgreSQL server of one test's own, on a free loopback port, which the test may stop, kill, start again and
//! reset: `initdb` into a temporary directory, `postgres` started on it (as the `postgres` OS user when the test runs
//! as root: initdb refuses root), Conveyor's roles and a migrated database made the way `scripts/services.sh` and
//! `conveyor migrate` make them. Dropping it kills the server and removes its directory.
#![allow(dead_code)]

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use conveyor_server::config::MigrateConfig;
use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection};

use super::{TestDb, eventually, free_port};

/// The roles `scripts/services.sh` creates, with their attributes; each role's password is its name.
const ROLES: &[(&str, &str)] = &[
    ("conveyor_owner", "LOGIN CREATEDB NOSUPERUSER NOBYPASSRLS"),
    ("conveyor_app", "LOGIN NOSUPERUSER NOBYPASSRLS NOCREATEDB NOCREATEROLE NOINHERIT"),
    ("conveyor_operator", "LOGIN NOSUPERUSER NOBYPASSRLS NOCREATEDB NOCREATEROLE NOINHERIT"),
    ("conveyor_runtime", "LOGIN NOSUPERUSER NOBYPASSRLS NOCREATEDB NOCREATEROLE NOINHERIT"),
];

/// The database every test on the server uses.
const DATABASE: &str = "conveyor";

/// A running (or stopped) PostgreSQL of the test's own.
/// A benchmark's database: on a PostgreSQL of its own (kept alive with it; autovacuum on, as in production), or on the
/// shared development server with `BENCH_PG=shared`.
pub struct BenchDatabase {
    pub db: Arc<TestDb>,
    pub own: Option<TestPostgres>,
}

impl BenchDatabase {
    /// Starts (or connects to) it and creates a fresh database there.
    pub async fn create() -> Self {
        if std::env::var("BENCH_PG").as_deref() == Ok("shared") {
            return Self { db: Arc::new(TestDb::create().await), own: None };
        }
        let pg = TestPostgres::start().await;
        Self { db: pg.test_db().await, own: Some(pg) }
    }
}

pub struct TestPostgres {
    /// Its loopback port (the same across restarts).
    pub port: u16,
    /// The temporary directory: `data/` (the cluster), the server's socket and `postgres.log`.
    dir: PathBuf,
    /// The directory of `initdb` and `postgres`.
    bin: PathBuf,
    /// The OS user the server runs as, when the test runs as root.
    run_as: Option<(u32, u32)>,
    /// The postmaster, while it runs.
    child: Option<Child>,
    /// How many times it was started.
    pub starts: u32,
    /// With TLS: the CA file clients verify the server with (every URL then asks for `sslmode=verify-full`).
    tls_ca_file: Option<PathBuf>,
}

/// The certificate and key a [`TestPostgres`] serves TLS with (PEM), and the CA file that vouches for them.
pub struct PostgresTls {
    pub cert_chain_pem: String,
    pub key_pem: String,
    pub ca_file: PathBuf,
}

/// The directory of the newest PostgreSQL's binaries (`/usr/lib/postgresql/<version>/bin`, Debian's layout), else
/// `pg_config --bindir`.
fn bin_dir() -> PathBuf {
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| Some((e.file_name().to_str()?.parse().ok()?, e.path().join("bin"))))
        .filter(|(_, bin)| bin.join("postgres").exists())
        .collect();
    versions.sort();
    if let Some((_, bin)) = versions.pop() {
        return bin;
    }
    let out = Command::new("pg_config").arg("--bindir").output().expect("PostgreSQL's server binaries are installed");
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

/// The uid and gid of the `postgres` OS user, from `/etc/passwd`.
fn postgres_user() -> (u32, u32) {
    let passwd = std::fs::read_to_string("/etc/passwd").expect("read /etc/passwd");
    passwd
        .lines()
        .find_map(|line| {
            let fields: Vec<&str> = line.split(':').collect();
            (fields.first() == Some(&"postgres") && fields.len() > 3)
                .then(|| Some((fields[2].parse().ok()?, fields[3].parse().ok()?)))
                .flatten()
        })
        .expect("running as root, the tests need the `postgres` OS user (Debian's postgresql package makes it)")
}

fn running_as_root() -> bool {
    let out = Command::new("id").arg("-u").output().expect("id");
    String::from_utf8_lossy(&out.stdout).trim() == "0"
}

impl TestPostgres {
    /// Initializes a cluster in a fresh temporary directory, starts it, creates Conveyor's roles and database and
    /// applies the migrations.
    pub async fn start() -> Self {
        Self::start_with(None).await
    }

    /// [`TestPostgres::start`] serving TLS only (`ssl = on`, `hostssl` lines alone in `pg_hba.conf`, so a plain
    /// connection over TCP is refused), with the certificate and key of `tls`.
    pub async fn start_tls(tls: PostgresTls) -> Self {
        Self::start_with(Some(tls)).await
    }

    async fn start_with(tls: Option<PostgresTls>) -> Self {
        let dir =
            std::env::temp_dir().join(format!("conveyor-pg-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]));
        std::fs::create_dir_all(&dir).unwrap();
        let run_as = running_as_root().then(postgres_user);
        if let Some((uid, gid)) = run_as {
            std::os::unix::fs::chown(&dir, Some(uid), Some(gid)).expect("hand the directory to the postgres user");
        }
        let mut pg = Self { port: free_port(), dir, bin: bin_dir(), run_as, child: None, starts: 0, tls_ca_file: None };
        let initdb = pg
            .command("initdb")
            .args(["-D", &pg.data().display().to_string(), "-U", "postgres", "--encoding=UTF8", "--locale=C"])
            .args(["--auth-local=trust", "--auth-host=scram-sha-256", "--no-sync", "--no-instructions"])
            .output()
            .expect("run initdb");
        assert!(initdb.status.success(), "initdb failed: {}", String::from_utf8_lossy(&initdb.stderr));
        if let Some(tls) = tls {
            pg.serve_tls_only(&tls);
            pg.tls_ca_file = Some(tls.ca_file);
        }
        pg.start_again().await;
        pg.create_roles().await;
        let migrate = MigrateConfig::new(&pg.url("conveyor_owner"), "conveyor_app", "conveyor_runtime")
            .operator("conveyor_operator");
        conveyor_server::migrate::run(&migrate).await.expect("migrations apply to the test's own PostgreSQL");
        pg
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// Writes the server's certificate and key into the cluster (owned by the server's user, the key `0600` as
    /// PostgreSQL requires), turns `ssl` on and lets TCP clients in over TLS only.
    fn serve_tls_only(&self, tls: &PostgresTls) {
        use std::os::unix::fs::PermissionsExt;
        let data = self.data();
        for (name, contents) in [("server.crt", &tls.cert_chain_pem), ("server.key", &tls.key_pem)] {
            let path = data.join(name);
            std::fs::write(&path, contents).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
            if let Some((uid, gid)) = self.run_as {
                std::os::unix::fs::chown(&path, Some(uid), Some(gid)).unwrap();
            }
        }
        let conf = data.join("postgresql.conf");
        let mut settings = std::fs::read_to_string(&conf).unwrap();
        settings.push_str("\nssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\n");
        std::fs::write(&conf, settings).unwrap();
        let hba = "local all all trust\nhostssl all all 127.0.0.1/32 scram-sha-256\n";
        std::fs::write(data.join("pg_hba.conf"), hba).unwrap();
    }

    /// A command of PostgreSQL's `bin` directory, run as the postgres OS user when the test is root.
    fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(self.bin.join(program));
        cmd.current_dir(&self.dir).env_clear().env("PATH", "/usr/bin:/bin").env("LC_ALL", "C");
        if let Some((uid, gid)) = self.run_as {
            cmd.uid(uid).gid(gid);
        }
        cmd
    }

    /// Starts the server on its port and data (after [`TestPostgres::stop_fast`] or [`TestPostgres::kill_9`], crash
    /// recovery included) and waits until it accepts connections.
    pub async fn start_again(&mut self) {
        assert!(self.child.is_none(), "the test's PostgreSQL is already running");
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.dir.join("postgres.log")).unwrap();
        // A benchmark may ask for a server sized like production's (`BENCH_PG_SETTINGS="shared_buffers=1GB"`); the
        // tests never set it. Later settings win over the defaults above them.
        let extra: Vec<String> = std::env::var("BENCH_PG_SETTINGS")
            .unwrap_or_default()
            .split_whitespace()
            .flat_map(|setting| ["-c".to_owned(), setting.to_owned()])
            .collect();
        let child = self
            .command("postgres")
            .args(["-D", &self.data().display().to_string(), "-p", &self.port.to_string()])
            .args(["-k", &self.dir.display().to_string()])
            .args(["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "max_connections=300"])
            .args(["-c", "shared_buffers=64MB", "-c", "log_min_messages=warning"])
            .args(&extra)
            // A process group of its own: the postmaster and its backends are killed together.
            .process_group(0)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start postgres");
        self.child = Some(child);
        self.starts += 1;
        let options = self.superuser_options();
        let ready = eventually(Duration::from_secs(60), || {
            let options = options.clone();
            async move {
                let mut conn = PgConnection::connect_with(&options).await.ok()?;
                sqlx::query("SELECT 1").execute(&mut conn).await.ok().map(|_| ())
            }
        })
        .await;
        assert!(ready.is_some(), "the test's PostgreSQL did not come up:\n{}", self.log());
    }

    /// Fast shutdown (SIGINT: connections are terminated, a checkpoint is written), waiting until it exits.
    pub async fn stop_fast(&mut self) {
        let Some(mut child) = self.child.take() else { return };
        signal(child.id(), "INT");
        wait_exit(&mut child).await;
    }

    /// SIGKILL of the postmaster and every backend at once: a crash; the next start runs crash recovery.
    pub async fn kill_9(&mut self) {
        let Some(mut child) = self.child.take() else { return };
        signal_group(child.id(), "KILL");
        wait_exit(&mut child).await;
        // The backends are gone before a new postmaster may take the shared memory over.
        let pgid = child.id();
        let gone = eventually(Duration::from_secs(20), || async move {
            let out = Command::new("pgrep").args(["-g", &pgid.to_string()]).output().ok()?;
            String::from_utf8_lossy(&out.stdout).trim().is_empty().then_some(())
        })
        .await;
        assert!(gone.is_some(), "the killed PostgreSQL's backends did not exit");
    }

    /// Terminates every connection of a non-superuser role (`pg_terminate_backend`), as a failover or a proxy reset
    /// would; returns how many.
    pub async fn terminate_backends(&self) -> i64 {
        let mut conn = self.superuser().await;
        let (n,): (i64,) = sqlx::query_as(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(a.pid))
             FROM pg_stat_activity a JOIN pg_roles r ON r.oid = a.usesysid
             WHERE a.backend_type = 'client backend' AND a.pid <> pg_backend_pid() AND NOT r.rolsuper",
        )
        .fetch_one(&mut conn)
        .await
        .expect("terminate backends");
        n
    }

    /// Whether the postmaster runs.
    pub fn running(&mut self) -> bool {
        self.child.as_mut().is_some_and(|c| c.try_wait().ok().flatten().is_none())
    }

    /// The server's log.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("postgres.log")).unwrap_or_default()
    }

    fn superuser_options(&self) -> PgConnectOptions {
        PgConnectOptions::new().socket(&self.dir).port(self.port).username("postgres").database("postgres")
    }

    /// A superuser connection (over the server's socket).
    pub async fn superuser(&self) -> PgConnection {
        PgConnection::connect_with(&self.superuser_options()).await.expect("connect to the test's PostgreSQL")
    }

    /// The URL of `role` (password = its name) on Conveyor's database, over loopback TCP.
    pub fn url(&self, role: &str) -> String {
        let url = format!("postgres://{role}:{role}@127.0.0.1:{}/{DATABASE}", self.port);
        match &self.tls_ca_file {
            Some(ca) => format!("{url}?sslmode=verify-full&sslrootcert={}", ca.display()),
            None => url,
        }
    }

    /// Conveyor's database on this server as a [`TestDb`] (already migrated), for `config_vars` and the assertions.
    pub async fn test_db(&self) -> Arc<TestDb> {
        let (app_url, runtime_url) = (self.url("conveyor_app"), self.url("conveyor_runtime"));
        let pool = conveyor_jobs::connect_postgres(&app_url, 8).await.expect("connect as the application role");
        let runtime_pool = conveyor_jobs::connect_postgres(&runtime_url, 4).await.expect("connect as the runtime role");
        Arc::new(TestDb {
            name: DATABASE.to_owned(),
            owner_url: self.url("conveyor_owner"),
            app_url,
            operator_url: self.url("conveyor_operator"),
            runtime_url,
            pool,
            runtime_pool,
        })
    }

    async fn create_roles(&self) {
        let mut conn = self.superuser().await;
        for (role, attributes) in ROLES {
            let sql = format!("CREATE ROLE {role} {attributes} PASSWORD '{role}'");
            sqlx::query(sqlx::AssertSqlSafe(sql)).execute(&mut conn).await.expect("create role");
        }
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {DATABASE} OWNER conveyor_owner")))
            .execute(&mut conn)
            .await
            .expect("create database");
    }
}

impl Drop for TestPostgres {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            signal_group(child.id(), "KILL");
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn signal(pid: u32, signal: &str) {
    let _ = Command::new("kill").arg(format!("-{signal}")).arg(pid.to_string()).status();
}

/// Signals every process of the group led by `pid`.
fn signal_group(pid: u32, signal: &str) {
    let _ = Command::new("kill").arg(format!("-{signal}")).arg("--").arg(format!("-{pid}")).status();
}

/// Reaps `child`, polling so that the runtime is not blocked.
async fn wait_exit(child: &mut Child) {
    let exited = eventually(Duration::from_secs(60), || {
        let status = child.try_wait();
        async move { status.ok().flatten().map(|_| ()) }
    })
    .await;
    if exited.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
}
