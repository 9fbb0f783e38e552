//! The soak benchmark (issue 16): `SOAK_JOBS` (1,000,000) jobs through the full path, with the resident memory of
//! every role sampled, and Redis memory and PostgreSQL table sizes before the run, after it, and after retention.
//!
//! The path: real `conveyor api`, `dispatcher`, `worker` and `maintenance` processes and a real `conveyor sandbox`
//! (the marketplace), a PostgreSQL of the benchmark's own by default (autovacuum on, as in production;
//! `BENCH_PG=shared` for the development server) and a `redis-server` of its own (its memory is the run's alone).
//! Jobs are `store.verify_credentials` against the sandbox: the worker locks the store, opens its sealed credentials,
//! calls the marketplace over HTTP (idempotency key, traceparent) and records the result, in the job's transaction.
//! - Set-up: `SOAK_WORKSPACES` (20) workspaces of `SOAK_STORES` (25) stores each, created through the API (each
//!   creation is a job too).
//! - Enqueue, as another service does: `enqueue_many_tx` in the caller's transaction, `SOAK_BATCH` (50) jobs per
//!   transaction, round-robin over the workspaces, at `SOAK_RATE` (500) jobs/s, pausing while more than
//!   `SOAK_MAX_BACKLOG` (50000) jobs are enqueued and not yet acknowledged; beside it, `SOAK_API_RATE` (20) store
//!   creations a second through the API (`POST /v1/stores`, Idempotency-Key, bearer token), which count as jobs too.
//! - Every `SOAK_SAMPLE_SECONDS` (5): each process's `VmRSS`, Redis `used_memory`, the outbox's size, and the jobs
//!   acknowledged (the consumer group's `entries-read` minus its pending entries). After the warm-up (the first 10% of
//!   the jobs acknowledged), each role's min/max/last RSS and whether max ≤ 1.1 × min.
//! - Retention: the maintenance role runs through the run with `SOAK_RETENTION` (7d, the default: it deletes nothing
//!   during a run of minutes); afterwards a maintenance process with a retention of 1 s deletes the ended jobs, timed,
//!   with the WAL it wrote, then `VACUUM (ANALYZE)`. De-dup keys expire `SOAK_DEDUP_TTL_RECORDED` (2m, the least
//!   allowed; production's default is 15m) after their job's hand-off is recorded: Redis is read again once they have.
//!
//! One JSON line.

#[path = "../tests/api/common/mod.rs"]
mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::postgres::BenchDatabase;
use conveyor_jobs::RedisKeys;
use conveyor_jobs::{EnqueueOptions, UserId, WorkspaceId};
use conveyor_server::auth::{Principal, TokenKeys};
use conveyor_shop::jobs::VerifyCredentials;
use fred::prelude::{ClientLike, ServerInterface, StreamsInterface, Value as RedisValue};
use serde_json::{Value, json};
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

/// The queue of `store.verify_credentials`.
const QUEUE: &str = "stores";

/// The tables whose sizes are reported.
const TABLES: [&str; 6] =
    ["outbox_events", "operations", "stores", "store_credentials", "idempotency_requests", "job_failures"];

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn env_str(name: &str, default: &str) -> String {
    std::env::var(name).ok().filter(|v| !v.is_empty()).unwrap_or_else(|| default.to_owned())
}

fn round(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

fn mib(bytes: f64) -> f64 {
    round(bytes / (1024.0 * 1024.0))
}

/// A real `conveyor <args>` process over the run's database and Redis, with `extra` variables.
fn spawn_role(vars: &HashMap<String, String>, args: &[&str], extra: &[(&str, String)]) -> common::Process {
    let mut vars = vars.clone();
    for (k, v) in extra {
        vars.insert((*k).into(), v.clone());
    }
    common::Process::spawn(args, &vars)
}

/// A field of `/proc/<pid>/status` in kB (`VmRSS`, `VmHWM`).
fn status_kib(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':')?.trim().strip_suffix("kB")?.trim().parse().ok())
}

/// One process of the run and its RSS samples (jobs acknowledged at the time, kB).
struct Role {
    name: &'static str,
    process: common::Process,
    samples: Vec<(u64, u64)>,
}

impl Role {
    fn sample(&mut self, acked: u64) {
        if let Some(process_exited) = self.process.child.try_wait().ok().flatten() {
            panic!("the {} process exited ({process_exited}):\n{}", self.name, self.process.log());
        }
        if let Some(rss) = status_kib(self.process.child.id(), "VmRSS") {
            self.samples.push((acked, rss));
        }
    }

    /// Min/max/last after the warm-up (samples taken once `warm` jobs were acknowledged) and flatness (max within
    /// 10% of min); and growth, the median of the last third of those samples against the first third's, which
    /// tells a leak (steady growth) from a level that moves with the batches in hand.
    fn summary(&self, warm: u64) -> Value {
        let after: Vec<f64> = self.samples.iter().filter(|(a, _)| *a >= warm).map(|(_, kib)| *kib as f64).collect();
        let (min, max) = after.iter().fold((f64::MAX, 0f64), |(lo, hi), x| (lo.min(*x), hi.max(*x)));
        let to_mib = |kib: f64| round(kib / 1024.0);
        let third = after.len() / 3;
        let growth = (third > 0).then(|| median(&after[after.len() - third..]) / median(&after[..third]) - 1.0);
        json!({
            "samples": self.samples.len(), "after_warmup": after.len(),
            "first_mib": after.first().copied().map(to_mib), "min_mib": (!after.is_empty()).then(|| to_mib(min)),
            "max_mib": (!after.is_empty()).then(|| to_mib(max)), "last_mib": after.last().copied().map(to_mib),
            "peak_hwm_mib": status_kib(self.process.child.id(), "VmHWM").map(|k| to_mib(k as f64)),
            "spread": (!after.is_empty()).then(|| round(max / min - 1.0)),
            "flat_within_10pct": !after.is_empty() && max <= 1.1 * min,
            "growth_last_vs_first_third": growth.map(round), "no_growth_within_10pct": growth.is_some_and(|g| g <= 0.1),
            "series_mib": spaced(&after, 20).into_iter().map(to_mib).collect::<Vec<_>>(),
        })
    }
}

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[sorted.len() / 2]
}

/// At most `n` values evenly spaced over `values`, the last included.
fn spaced(values: &[f64], n: usize) -> Vec<f64> {
    if values.len() <= n {
        return values.to_vec();
    }
    (0..n).map(|i| values[i * (values.len() - 1) / (n - 1)]).collect()
}

/// Sizes of the reported tables (with live and dead tuples) and of the database.
async fn sizes(conn: &mut PgConnection) -> Value {
    sqlx::query("SELECT pg_stat_clear_snapshot()").execute(&mut *conn).await.unwrap();
    let rows: Vec<(String, i64, i64, i64)> = sqlx::query_as(
        "SELECT relname::text, pg_total_relation_size(relid), n_live_tup, n_dead_tup FROM pg_stat_user_tables
         WHERE relname = ANY($1) ORDER BY relname",
    )
    .bind(TABLES)
    .fetch_all(&mut *conn)
    .await
    .unwrap();
    let database: i64 =
        sqlx::query_scalar("SELECT pg_database_size(current_database())").fetch_one(&mut *conn).await.unwrap();
    let tables: serde_json::Map<String, Value> = rows
        .into_iter()
        .map(|(name, bytes, live, dead)| (name, json!({ "mib": mib(bytes as f64), "live": live, "dead": dead })))
        .collect();
    json!({ "database_mib": mib(database as f64), "tables": tables })
}

/// Redis `used_memory` and the number of keys.
async fn redis_stats(client: &conveyor_jobs::RedisClient) -> Value {
    let info: String = client.info(Some(fred::types::InfoKind::Memory)).await.unwrap();
    let field = |name: &str| -> Option<f64> {
        info.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(':')?.trim().parse().ok())
    };
    let keys: u64 = client.dbsize().await.unwrap();
    json!({ "used_memory_mib": field("used_memory").map(mib), "used_memory_bytes": field("used_memory"), "keys": keys })
}

/// Jobs acknowledged so far: the consumer group's `entries-read` minus its pending entries (the worker acknowledges
/// an entry only once the job's end is recorded in PostgreSQL).
async fn acknowledged(client: &conveyor_jobs::RedisClient, keys: &RedisKeys) -> Option<u64> {
    let groups: Vec<HashMap<String, RedisValue>> = client.xinfo_groups(keys.stream(QUEUE)).await.ok()?;
    let group = groups.iter().find(|g| g.get("name").and_then(|n| n.as_string()) == Some(keys.group(QUEUE)))?;
    Some(group.get("entries-read")?.as_u64()?.saturating_sub(group.get("pending")?.as_u64()?))
}

/// The run's counters, shared by the load generators and the sampler.
#[derive(Default)]
struct Progress {
    enqueued: AtomicU64,
    acked: AtomicU64,
    library_done: AtomicBool,
    api_ok: AtomicU64,
    api_failed: AtomicU64,
}

/// A workspace, its user's token and its stores.
struct Tenant {
    workspace: WorkspaceId,
    token: String,
    stores: Vec<Uuid>,
}

/// Creates a store through the API; its id, if the API accepted it.
async fn create_store(http: &reqwest::Client, base: &str, token: &str) -> Option<Uuid> {
    let resp = http
        .post(format!("{base}/v1/stores"))
        .bearer_auth(token)
        .header("idempotency-key", Uuid::new_v4().to_string())
        .json(&common::store_body(&Uuid::new_v4().simple().to_string()))
        .send()
        .await
        .ok()?;
    if resp.status() != 202 {
        return None;
    }
    let body: Value = resp.json().await.ok()?;
    body["store"]["id"].as_str()?.parse().ok()
}

/// Enqueues through the library until `target` jobs in all are enqueued: `batch` per transaction, at `rate` jobs/s,
/// waiting while more than `max_backlog` are not yet acknowledged. Returns the seconds spent waiting so, and when
/// it ended.
async fn enqueue(pool: PgPool, tenants: Arc<Vec<Tenant>>, target: u64, progress: Arc<Progress>) -> (f64, Instant) {
    let (rate, batch, max_backlog) = (env("SOAK_RATE", 500), env("SOAK_BATCH", 50), env("SOAK_MAX_BACKLOG", 50_000));
    let started = tokio::time::Instant::now();
    let (mut sent, mut waited, mut i) = (0u64, 0f64, 0usize);
    loop {
        let total = progress.enqueued.load(Ordering::Relaxed);
        if total >= target {
            break;
        }
        tokio::time::sleep_until(started + Duration::from_secs_f64(sent as f64 / rate as f64)).await;
        while progress.enqueued.load(Ordering::Relaxed).saturating_sub(progress.acked.load(Ordering::Relaxed))
            > max_backlog
        {
            tokio::time::sleep(Duration::from_millis(100)).await;
            waited += 0.1;
        }
        let tenant = &tenants[i % tenants.len()];
        let n = batch.min(target - total) as usize;
        let jobs: Vec<VerifyCredentials> = (0..n)
            .map(|k| VerifyCredentials {
                store_id: tenant.stores[(i * n + k) % tenant.stores.len()],
                credentials_version: 1,
            })
            .collect();
        let mut tx = conveyor_jobs::begin_workspace(&pool, tenant.workspace).await.unwrap();
        conveyor_jobs::enqueue_many_tx(&mut tx, jobs.iter().map(|j| (j, EnqueueOptions::new()))).await.unwrap();
        tx.commit().await.unwrap();
        progress.enqueued.fetch_add(n as u64, Ordering::Relaxed);
        sent += n as u64;
        i += 1;
    }
    progress.library_done.store(true, Ordering::Relaxed);
    (waited, Instant::now())
}

/// Creates stores through the API at `SOAK_API_RATE` a second until the library's enqueuing ends.
async fn api_trickle(http: reqwest::Client, base: String, tenants: Arc<Vec<Tenant>>, progress: Arc<Progress>) {
    let rate = env("SOAK_API_RATE", 20);
    if rate == 0 {
        return;
    }
    let started = tokio::time::Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    let mut i = 0u64;
    while !progress.library_done.load(Ordering::Relaxed) {
        tokio::time::sleep_until(started + Duration::from_secs_f64(i as f64 / rate as f64)).await;
        let (http, base, tenants, progress) = (http.clone(), base.clone(), tenants.clone(), progress.clone());
        tasks.spawn(async move {
            let token = &tenants[i as usize % tenants.len()].token;
            match create_store(&http, &base, token).await {
                Some(_) => {
                    progress.enqueued.fetch_add(1, Ordering::Relaxed);
                    progress.api_ok.fetch_add(1, Ordering::Relaxed)
                }
                None => progress.api_failed.fetch_add(1, Ordering::Relaxed),
            };
        });
        while let Some(done) = tasks.try_join_next() {
            done.unwrap();
        }
        i += 1;
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }
}

/// Jobs by status.
async fn statuses(conn: &mut PgConnection) -> Value {
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT status, count(*) FROM conveyor.outbox_events GROUP BY status")
            .fetch_all(conn)
            .await
            .unwrap();
    Value::Object(rows.into_iter().map(|(k, v)| (k, json!(v))).collect())
}

async fn soak() -> Value {
    let target = env("SOAK_JOBS", 1_000_000);
    let sample = Duration::from_secs(env("SOAK_SAMPLE_SECONDS", 5));
    let dedup_recorded = env_str("SOAK_DEDUP_TTL_RECORDED", "2m");
    let database = BenchDatabase::create().await;
    let db = database.db.clone();
    let redis = common::TestRedis::start(None).await;
    let prefix = format!("soak-{}", Uuid::new_v4().simple());
    let keys = RedisKeys::new(&prefix);
    let redis_client = common::redis_client(&redis.url()).await;
    let mut owner = db.owner().await;

    let mut vars = common::config_vars(&db, &prefix);
    vars.insert("CONVEYOR_REDIS_URL".into(), redis.url());
    vars.insert("RUST_LOG".into(), "warn".into());
    let sandbox_addr = format!("127.0.0.1:{}", common::free_port());
    let api_addr = format!("127.0.0.1:{}", common::free_port());
    let sandbox = spawn_role(&vars, &["sandbox", "--addr", &sandbox_addr], &[]);
    let worker_vars = [
        ("CONVEYOR_MARKETPLACE_URL", format!("http://{sandbox_addr}")),
        ("CONVEYOR_WORKER_CONCURRENCY", env("SOAK_CONC", 32).to_string()),
        ("CONVEYOR_DATABASE_MAX_CONNECTIONS", "32".into()),
    ];
    let mut roles = [
        Role {
            name: "api",
            process: spawn_role(&vars, &["api"], &[("CONVEYOR_HTTP_ADDR", api_addr.clone())]),
            samples: vec![],
        },
        Role {
            name: "dispatcher",
            process: spawn_role(
                &vars,
                &["dispatcher"],
                &[("CONVEYOR_DISPATCH_DEDUP_TTL_RECORDED", dedup_recorded.clone())],
            ),
            samples: vec![],
        },
        Role { name: "worker", process: spawn_role(&vars, &["worker"], &worker_vars), samples: vec![] },
        Role {
            name: "maintenance",
            process: spawn_role(
                &vars,
                &["maintenance"],
                &[("CONVEYOR_OUTBOX_RETENTION", env_str("SOAK_RETENTION", "7d"))],
            ),
            samples: vec![],
        },
    ];
    let mut sandbox = Role { name: "sandbox", process: sandbox, samples: vec![] };

    // The API answers (and the other roles are up) before the set-up.
    let http = reqwest::Client::new();
    let base = format!("http://{api_addr}");
    let up = common::eventually(Duration::from_secs(30), || async {
        http.get(format!("{base}/v1/openapi.json")).send().await.ok().filter(|r| r.status() == 200).map(|_| ())
    })
    .await;
    assert!(up.is_some(), "the api process did not answer:\n{}", roles[0].process.log());
    tokio::time::sleep(Duration::from_secs(1)).await;

    let tokens = TokenKeys::new(&conveyor_server::config::jwt_secret(&vars).unwrap());
    let mut tenants = Vec::new();
    for _ in 0..env("SOAK_WORKSPACES", 20) {
        let principal = Principal { workspace_id: WorkspaceId(Uuid::new_v4()), user_id: UserId(Uuid::new_v4()) };
        let token = tokens.mint(principal, Duration::from_secs(24 * 3600));
        let created =
            futures_util::future::join_all((0..env("SOAK_STORES", 25)).map(|_| create_store(&http, &base, &token)))
                .await;
        let stores: Vec<Uuid> = created.into_iter().map(|s| s.expect("the API creates a set-up store")).collect();
        tenants.push(Tenant { workspace: principal.workspace_id, token, stores });
    }
    let tenants = Arc::new(tenants);
    let progress = Arc::new(Progress::default());
    progress.enqueued.store(tenants.iter().map(|t| t.stores.len() as u64).sum(), Ordering::Relaxed);
    let before = json!({ "postgres": sizes(&mut owner).await, "redis": redis_stats(&redis_client).await });

    let pool = conveyor_jobs::connect_postgres(&db.app_url, 8).await.unwrap();
    let started = Instant::now();
    let library = tokio::spawn(enqueue(pool, tenants.clone(), target, progress.clone()));
    let api = tokio::spawn(api_trickle(http.clone(), base.clone(), tenants.clone(), progress.clone()));
    let limit = Duration::from_secs(600 + target / 100);
    let (mut redis_series, mut outbox_series) = (Vec::new(), Vec::new());
    let mut redis_peak = 0f64;
    let mut next_sample = Instant::now();
    loop {
        let acked = acknowledged(&redis_client, &keys).await.unwrap_or(0);
        progress.acked.store(acked, Ordering::Relaxed);
        let done = progress.library_done.load(Ordering::Relaxed) && api.is_finished();
        if done && acked >= progress.enqueued.load(Ordering::Relaxed) || started.elapsed() > limit {
            break;
        }
        if Instant::now() >= next_sample {
            next_sample += sample;
            for role in roles.iter_mut().chain(std::iter::once(&mut sandbox)) {
                role.sample(acked);
            }
            let used = redis_stats(&redis_client).await["used_memory_bytes"].as_f64().unwrap_or(0.0);
            redis_peak = redis_peak.max(used);
            redis_series.push(mib(used));
            let outbox: i64 = sqlx::query_scalar("SELECT pg_total_relation_size('conveyor.outbox_events')")
                .fetch_one(&mut owner)
                .await
                .unwrap();
            outbox_series.push(mib(outbox as f64));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let run_s = started.elapsed().as_secs_f64();
    let (throttled_s, enqueue_ended) = library.await.unwrap();
    api.await.unwrap();
    let enqueued = progress.enqueued.load(Ordering::Relaxed);
    let acked = progress.acked.load(Ordering::Relaxed);
    let warm = enqueued / 10;
    let rss: serde_json::Map<String, Value> = roles.iter().map(|r| (r.name.to_owned(), r.summary(warm))).collect();
    let all_flat = roles.iter().all(|r| r.summary(warm)["flat_within_10pct"] == true);
    let no_growth = roles.iter().all(|r| r.summary(warm)["no_growth_within_10pct"] == true);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after_run = json!({
        "postgres": sizes(&mut owner).await, "redis": redis_stats(&redis_client).await,
        "jobs": statuses(&mut owner).await,
    });

    // Retention: a maintenance process that keeps ended jobs as short as the configuration allows (the de-dup window,
    // here 2 min), until none is left.
    let maintenance = roles.iter_mut().find(|r| r.name == "maintenance").unwrap();
    maintenance.process.stop().await;
    let wal_before: String =
        sqlx::query_scalar("SELECT pg_current_wal_lsn()::text").fetch_one(&mut owner).await.unwrap();
    let retention_started = Instant::now();
    let mut retention = spawn_role(
        &vars,
        &["maintenance"],
        &[
            ("CONVEYOR_OUTBOX_RETENTION", "2m".into()),
            ("CONVEYOR_DISPATCH_DEDUP_TTL", "2m".into()),
            ("CONVEYOR_MAINTENANCE_INTERVAL", "1s".into()),
        ],
    );
    let purged = common::eventually(Duration::from_secs(1800), || async {
        let mut conn = db.owner().await;
        let left: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM conveyor.outbox_events WHERE status IN ('completed', 'canceled', 'discarded')",
        )
        .fetch_one(&mut conn)
        .await
        .unwrap();
        (left == 0).then_some(())
    })
    .await
    .is_some();
    let retention_s = retention_started.elapsed().as_secs_f64();
    retention.stop().await;
    let wal: i64 = sqlx::query_scalar("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::pg_lsn)::bigint")
        .bind(&wal_before)
        .fetch_one(&mut owner)
        .await
        .unwrap();
    let after_retention = sizes(&mut owner).await;
    for table in TABLES {
        sqlx::query(sqlx::AssertSqlSafe(format!("VACUUM (ANALYZE) {table}"))).execute(&mut owner).await.unwrap();
    }
    let after_vacuum = sizes(&mut owner).await;

    // Redis once the recorded hand-offs' de-dup keys have expired.
    let at_end = redis_stats(&redis_client).await;
    let ttl = humantime::parse_duration(&dedup_recorded).unwrap_or(Duration::from_secs(120));
    common::eventually(ttl + Duration::from_secs(90), || async {
        (redis_stats(&redis_client).await["keys"].as_u64().unwrap_or(0) <= 8).then_some(())
    })
    .await;
    let after_expiry = redis_stats(&redis_client).await;
    let expired = at_end["keys"].as_f64().unwrap_or(0.0) - after_expiry["keys"].as_f64().unwrap_or(0.0);
    let freed =
        at_end["used_memory_bytes"].as_f64().unwrap_or(0.0) - after_expiry["used_memory_bytes"].as_f64().unwrap_or(0.0);
    let per_key = (expired > 0.0).then(|| freed / expired);
    let per_s = acked as f64 / run_s;

    let mut rss = rss;
    rss.insert("sandbox (test double, keeps every call)".into(), sandbox.summary(warm));
    for role in roles.iter_mut() {
        role.process.stop().await;
    }
    json!({
        "scenario": "soak",
        "allocator": if cfg!(feature = "system-allocator") { "glibc malloc" } else { "mimalloc v2" },
        "jobs_target": target, "enqueued": enqueued, "acknowledged": acked,
        "completed_all": acked >= enqueued, "api_created": progress.api_ok.load(Ordering::Relaxed),
        "api_failed": progress.api_failed.load(Ordering::Relaxed), "run_s": round(run_s), "per_s": per_s.round(),
        "throttled_s": round(throttled_s), "enqueue_s": round((enqueue_ended - started).as_secs_f64()),
        "warmup_jobs": warm, "all_roles_no_growth_within_10pct": no_growth,
        "enqueue": "library: enqueue_many_tx in the caller's transaction (plus API store creations)",
        "postgres": if database.own.is_some() { "own (autovacuum on)" } else { "shared" },
        "rss": rss, "all_roles_flat_within_10pct": all_flat,
        "redis": {
            "before": before["redis"], "after_run": after_run["redis"], "after_dedup_expiry": after_expiry,
            "peak_used_mib": mib(redis_peak), "series_used_mib": spaced(&redis_series, 20),
            "dedup_ttl_recorded": dedup_recorded, "bytes_per_dedup_key": per_key.map(round),
            "dedup_mib_at_15m_default_at_this_rate": per_key.map(|b| mib(b * per_s * 900.0)),
        },
        "postgres_sizes": {
            "before": before["postgres"], "after_run": after_run["postgres"], "after_retention": after_retention,
            "after_vacuum": after_vacuum, "outbox_series_mib": spaced(&outbox_series, 20),
        },
        "jobs_by_status_after_run": after_run["jobs"],
        "retention": { "purged_all": purged, "seconds": round(retention_s), "wal_mib": mib(wal as f64) },
    })
}

fn main() {
    if std::env::var("RUST_LOG").is_ok() {
        conveyor_server::telemetry::init_logging(false);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    runtime.block_on(async { println!("{}", soak().await) });
}
