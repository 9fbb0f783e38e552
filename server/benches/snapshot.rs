//! The long-snapshot benchmark (issue 16): relay throughput and outbox size with and without a transaction holding a
//! snapshot open, as a long report query or a `BEGIN` forgotten in a psql session does. PgQue measured SKIP LOCKED
//! queues losing a third of their throughput and growing fifteenfold under one: every row version the relay and the
//! workers leave behind stays, in the heap and in every index whose predicate it matched, until the snapshot ends.
//!
//! Each mode (`without`, then `with`; `SNAPSHOT_MODES`) runs on a fresh database, by default on a PostgreSQL of the
//! benchmark's own with autovacuum on, as in production (`BENCH_PG=shared`: the development server, whose autovacuum
//! may be off; the line says which). Redis is a `redis-server` of its own.
//! 1. Steady: real `conveyor dispatcher` and `conveyor worker` processes (concurrency `CONC`, 32; the shipped
//!    `store.verify_credentials` handler, whose store is gone: one query, no marketplace call), and jobs committed one
//!    per transaction at `RATE`/s (300: below what the whole path does on 2 cores, about 500) over `WORKSPACES` (10)
//!    workspaces for `SNAPSHOT_SECONDS` (300). In `with`, a `REPEATABLE READ` transaction that has read
//!    `outbox_events` is open from before the first commit to the end of the drain. Reported: jobs relayed per
//!    second (committed → `XADD`), commit → `XADD` p50/p99/max, the CPU the dispatcher process and PostgreSQL spent
//!    per 1000 jobs (PostgreSQL's only on a server of the benchmark's own), and every `SAMPLE_SECONDS` (10) the
//!    table's size and dead tuples with the cost of the relay's two index scans (due workspaces; one workspace's due
//!    jobs in claim order), read by `EXPLAIN (ANALYZE, BUFFERS)`.
//! 2. Drain: the processes stop, `DRAIN_N` (100000) jobs are committed into the same workspaces (50 per
//!    transaction), and an in-process relay (no window, no worker) drains them: the `dispatch` scenario's method.
//!
//! Each phase also reports the index entries each index of `outbox_events` gave (`idx_tup_read`), and, where the
//! server loads `pg_stat_statements`, the statements PostgreSQL spent most time in.
//!
//! Then the snapshot closes and `VACUUM` runs; the table is read after each. One JSON line per mode, then one with
//! the ratios (target: throughput within 10%, size bounded).

#[path = "../tests/api/common/mod.rs"]
mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::postgres::BenchDatabase;
use conveyor_jobs::RedisKeys;
use conveyor_jobs::{EnqueueOptions, WorkspaceId};
use conveyor_shop::jobs::VerifyCredentials;
use fred::prelude::{StreamsInterface, Value as RedisValue};
use serde_json::{Value, json};
use sqlx::{Connection, PgConnection, PgPool};
use uuid::Uuid;

/// The allocator of the `conveyor` binary, so that what runs here in-process allocates as the shipped processes do.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The queue of `store.verify_credentials`.
const QUEUE: &str = "stores";

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn now_ms() -> f64 {
    chrono::Utc::now().timestamp_micros() as f64 / 1000.0
}

fn round(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

fn mib(bytes: i64) -> f64 {
    round(bytes as f64 / (1024.0 * 1024.0))
}

fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    (!sorted.is_empty()).then(|| round(sorted[((p / 100.0 * sorted.len() as f64) as usize).min(sorted.len() - 1)]))
}

/// The server settings that decide what bloat does: autovacuum, fsync, shared_buffers.
async fn server_settings(conn: &mut PgConnection) -> Value {
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SELECT name, current_setting(name) FROM pg_settings
         WHERE name IN ('autovacuum', 'autovacuum_naptime', 'fsync', 'shared_buffers', 'server_version')",
    )
    .fetch_all(conn)
    .await
    .unwrap();
    Value::Object(rows.into_iter().map(|(k, v)| (k, Value::String(v))).collect())
}

/// `outbox_events` as PostgreSQL's statistics see it: sizes, live and dead tuples, updates (HOT or not), vacuums.
async fn table_stats(conn: &mut PgConnection) -> Value {
    sqlx::query("SELECT pg_stat_clear_snapshot()").execute(&mut *conn).await.unwrap();
    let (total, heap, indexes, live, dead, upd, hot, del, vacuums): (i64, i64, i64, i64, i64, i64, i64, i64, i64) =
        sqlx::query_as(
            "SELECT pg_total_relation_size(relid), pg_relation_size(relid), pg_indexes_size(relid), n_live_tup,
                    n_dead_tup, n_tup_upd, n_tup_hot_upd, n_tup_del, autovacuum_count + vacuum_count
             FROM pg_stat_user_tables WHERE relname = 'outbox_events'",
        )
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    json!({
        "total_mib": mib(total), "heap_mib": mib(heap), "indexes_mib": mib(indexes), "live": live, "dead": dead,
        "updates": upd, "hot_updates": hot, "hot_ratio": (upd > 0).then(|| round(hot as f64 / upd as f64)),
        "deletes": del, "vacuums": vacuums,
    })
}

/// The largest indexes of `outbox_events`, in MiB.
async fn index_sizes(conn: &mut PgConnection) -> Value {
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT indexrelname::text, pg_relation_size(indexrelid) FROM pg_stat_user_indexes
         WHERE relname = 'outbox_events' ORDER BY 2 DESC LIMIT 6",
    )
    .fetch_all(conn)
    .await
    .unwrap();
    Value::Object(rows.into_iter().map(|(k, v)| (k, json!(mib(v)))).collect())
}

/// Index entries read so far (`idx_tup_read`) by each index of `outbox_events`.
async fn index_reads(conn: &mut PgConnection) -> HashMap<String, i64> {
    sqlx::query("SELECT pg_stat_clear_snapshot()").execute(&mut *conn).await.unwrap();
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT indexrelname::text, idx_tup_read FROM pg_stat_user_indexes WHERE relname = 'outbox_events'",
    )
    .fetch_all(conn)
    .await
    .unwrap();
    rows.into_iter().collect()
}

/// The entries each index gave between two readings, in millions, largest first (indexes that gave none left out).
fn reads_between(before: &HashMap<String, i64>, after: &HashMap<String, i64>) -> Value {
    let mut delta: Vec<(&String, i64)> =
        after.iter().map(|(k, v)| (k, v - before.get(k).copied().unwrap_or(0))).filter(|(_, d)| *d > 0).collect();
    delta.sort_by_key(|(_, d)| -d);
    Value::Object(delta.into_iter().map(|(k, d)| (k.clone(), json!(round(d as f64 / 1e6)))).collect())
}

/// The statements PostgreSQL spent most time in since `reset`, where the server loads `pg_stat_statements`
/// (`BENCH_PG_SETTINGS="shared_preload_libraries=pg_stat_statements pg_stat_statements.track=all"`): what a phase's
/// time went to, the statements inside the relay's functions included. `None` where it is not loaded.
struct Statements(Option<PgConnection>);

impl Statements {
    async fn open(database: &BenchDatabase) -> Self {
        let Some(pg) = database.own.as_ref() else { return Self(None) };
        let mut conn = pg.superuser().await;
        let loaded = sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements").execute(&mut conn).await.is_ok()
            && sqlx::query("SELECT pg_stat_statements_reset()").execute(&mut conn).await.is_ok();
        Self(loaded.then_some(conn))
    }

    async fn reset(&mut self) {
        if let Some(conn) = self.0.as_mut() {
            sqlx::query("SELECT pg_stat_statements_reset()").execute(conn).await.unwrap();
        }
    }

    /// The `n` statements with the most execution time: ms in all, calls, rows and shared blocks touched.
    async fn top(&mut self, n: i64) -> Value {
        let Some(conn) = self.0.as_mut() else { return Value::Null };
        let rows: Vec<(String, f64, i64, i64, i64)> = sqlx::query_as(
            "SELECT left(regexp_replace(query, '\\s+', ' ', 'g'), 160), total_exec_time, calls, rows,
                    shared_blks_hit + shared_blks_read
             FROM pg_stat_statements ORDER BY total_exec_time DESC LIMIT $1",
        )
        .bind(n)
        .fetch_all(conn)
        .await
        .unwrap();
        rows.into_iter()
            .map(|(query, ms, calls, rows, blocks)| {
                json!({ "query": query, "ms": ms.round(), "calls": calls, "rows": rows, "blocks": blocks })
            })
            .collect()
    }
}

/// Time and buffers of one statement, by `EXPLAIN (ANALYZE, BUFFERS)`.
async fn explain(conn: &mut PgConnection, sql: &str) -> Value {
    let (plan,): (Value,) =
        sqlx::query_as(sqlx::AssertSqlSafe(format!("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}")))
            .fetch_one(conn)
            .await
            .unwrap();
    let top = &plan[0];
    let buffers = top["Plan"]["Shared Hit Blocks"].as_i64().unwrap_or(0)
        + top["Plan"]["Shared Read Blocks"].as_i64().unwrap_or(0);
    json!({ "ms": top["Execution Time"].as_f64().map(round), "buffers": buffers })
}

/// The relay's two index scans as the owner runs them (its policy sees every row): which workspaces have due jobs
/// (`conveyor_due_outbox_workspaces`' scan), and one workspace's due jobs in claim order (the claim's scan).
async fn probe(conn: &mut PgConnection, workspace: WorkspaceId) -> Value {
    let due = explain(
        conn,
        "SELECT e.workspace_id, min(e.next_attempt_at) FROM conveyor.outbox_events e
         WHERE e.status = 'pending' AND e.next_attempt_at <= now() GROUP BY e.workspace_id",
    )
    .await;
    let claim = explain(
        conn,
        &format!(
            "SELECT d.ctid FROM conveyor.outbox_events d
             WHERE d.workspace_id = '{}' AND d.status = 'pending' AND d.priority = 1 AND d.next_attempt_at <= now()
             ORDER BY d.next_attempt_at, d.id LIMIT 500",
            workspace.0
        ),
    )
    .await;
    json!({ "due_workspaces": due, "claim": claim })
}

/// CPU seconds (user and system) of process `pid` and, with `children`, of its reaped children.
fn cpu_seconds(pid: u32, children: bool) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the command name (which may hold spaces): utime, stime, cutime, cstime are the 12th to 15th.
    let fields: Vec<f64> = stat.rsplit_once(')')?.1.split_whitespace().map(|f| f.parse().unwrap_or(0.0)).collect();
    let ticks = fields[11] + fields[12] + if children { fields[13] + fields[14] } else { 0.0 };
    Some(ticks / 100.0)
}

/// CPU seconds of a PostgreSQL server: its postmaster (found by its `-p <port>` argument), the children it reaped,
/// and the children alive now (backends, autovacuum, checkpointer, ...).
fn postgres_cpu_seconds(port: u16) -> Option<f64> {
    let port = port.to_string();
    let mut procs: Vec<(u32, u32)> = Vec::new();
    let mut postmaster = None;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else { continue };
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        if args.first().is_some_and(|a| a.ends_with(b"/postgres"))
            && args.windows(2).any(|w| w == [b"-p", port.as_bytes()])
        {
            postmaster = Some(pid);
        }
        let ppid = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| s.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse().ok()));
        if let Some(ppid) = ppid {
            procs.push((pid, ppid));
        }
    }
    let postmaster = postmaster?;
    let children: f64 =
        procs.iter().filter(|(_, ppid)| *ppid == postmaster).filter_map(|(p, _)| cpu_seconds(*p, false)).sum();
    Some(cpu_seconds(postmaster, true)? + children)
}

/// A real `conveyor <role>` process over the run's database and Redis.
fn spawn_role(db: &common::TestDb, prefix: &str, redis: &str, role: &str, extra: &[(&str, String)]) -> common::Process {
    let mut vars = common::config_vars(db, prefix);
    vars.insert("CONVEYOR_REDIS_URL".into(), redis.into());
    vars.insert("RUST_LOG".into(), "warn".into());
    for (k, v) in extra {
        vars.insert((*k).into(), v.clone());
    }
    common::Process::spawn(&[role], &vars)
}

/// Entries ever added to the queue's stream (`XINFO STREAM` `entries-added`, Redis 7): the relay's count.
async fn entries_added(client: &conveyor_jobs::RedisClient, keys: &RedisKeys) -> u64 {
    let info: Result<HashMap<String, RedisValue>, _> = client.xinfo_stream(keys.stream(QUEUE), false, None).await;
    info.ok().and_then(|i| i.get("entries-added")?.as_u64()).unwrap_or(0)
}

/// The id Redis gave the stream's last `XADD`, as ms since the epoch.
async fn last_xadd_ms(client: &conveyor_jobs::RedisClient, keys: &RedisKeys) -> Option<f64> {
    let info: HashMap<String, RedisValue> = client.xinfo_stream(keys.stream(QUEUE), false, None).await.ok()?;
    info.get("last-generated-id")?.as_string()?.split('-').next()?.parse().ok()
}

/// What the load generator committed: how many, and each job's id with the time its COMMIT returned (ms).
#[derive(Default)]
struct Committed {
    count: AtomicU64,
    jobs: Mutex<Vec<(Uuid, f64)>>,
}

/// Commits `rate` jobs a second for `seconds`, one per transaction, round-robin over `workspaces`.
async fn commit_steadily(pool: PgPool, workspaces: Vec<WorkspaceId>, rate: u64, seconds: u64, out: Arc<Committed>) {
    let started = tokio::time::Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..rate * seconds {
        tokio::time::sleep_until(started + Duration::from_secs_f64(i as f64 / rate as f64)).await;
        let (pool, ws, out) = (pool.clone(), workspaces[i as usize % workspaces.len()], out.clone());
        tasks.spawn(async move {
            let job = VerifyCredentials { store_id: Uuid::now_v7(), credentials_version: 1 };
            let mut tx = conveyor_jobs::begin_workspace(&pool, ws).await.unwrap();
            let id = conveyor_jobs::enqueue_tx(&mut tx, &job, EnqueueOptions::new()).await.unwrap().id.0;
            tx.commit().await.unwrap();
            out.jobs.lock().unwrap().push((id, now_ms()));
            out.count.fetch_add(1, Ordering::Relaxed);
        });
        while let Some(done) = tasks.try_join_next() {
            done.unwrap();
        }
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }
}

/// Commits `n` jobs into `workspaces`, 50 per transaction, one transaction after the other.
async fn commit_backlog(pool: &PgPool, workspaces: &[WorkspaceId], n: u64) {
    let mut left = n as usize;
    let mut i = 0;
    while left > 0 {
        let jobs: Vec<VerifyCredentials> =
            (0..left.min(50)).map(|_| VerifyCredentials { store_id: Uuid::now_v7(), credentials_version: 1 }).collect();
        let mut tx = conveyor_jobs::begin_workspace(pool, workspaces[i % workspaces.len()]).await.unwrap();
        conveyor_jobs::enqueue_many_tx(&mut tx, jobs.iter().map(|j| (j, EnqueueOptions::new()))).await.unwrap();
        tx.commit().await.unwrap();
        left -= jobs.len();
        i += 1;
    }
}

/// One mode: steady load, then a drain, with or without a snapshot held open throughout.
async fn run(with_snapshot: bool) -> Value {
    let (rate, seconds, sample) = (env("RATE", 300), env("SNAPSHOT_SECONDS", 300), env("SAMPLE_SECONDS", 10));
    let (drain_n, conc) = (env("DRAIN_N", 100_000), env("CONC", 32));
    let database = BenchDatabase::create().await;
    let db = database.db.clone();
    let redis = common::TestRedis::start(None).await;
    let prefix = format!("snapshot-{}", Uuid::new_v4().simple());
    let keys = RedisKeys::new(&prefix);
    let redis_client = common::redis_client(&redis.url()).await;
    let (_sandbox, market) = common::sandbox(Default::default()).await;
    let mut owner = db.owner().await;
    let settings = server_settings(&mut owner).await;
    let workspaces: Vec<WorkspaceId> = (0..env("WORKSPACES", 10)).map(|_| WorkspaceId(Uuid::new_v4())).collect();

    let mut worker = spawn_role(
        &db,
        &prefix,
        &redis.url(),
        "worker",
        &[
            ("CONVEYOR_MARKETPLACE_URL", market),
            ("CONVEYOR_WORKER_CONCURRENCY", conc.to_string()),
            ("CONVEYOR_DATABASE_MAX_CONNECTIONS", "32".into()),
        ],
    );
    let mut dispatcher = spawn_role(&db, &prefix, &redis.url(), "dispatcher", &[]);
    // Both connected, the worker's consumer group made, before the first commit.
    tokio::time::sleep(Duration::from_secs(2)).await;

    let mut holder = PgConnection::connect(&db.owner_url).await.unwrap();
    let holder_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut holder).await.unwrap();
    if with_snapshot {
        sqlx::query("BEGIN ISOLATION LEVEL REPEATABLE READ").execute(&mut holder).await.unwrap();
        sqlx::query("SELECT 1 FROM conveyor.outbox_events LIMIT 1").execute(&mut holder).await.unwrap();
    }
    let at_start = table_stats(&mut owner).await;
    let mut statements = Statements::open(&database).await;
    let reads_at_start = index_reads(&mut owner).await;
    let pg_port = database.own.as_ref().map(|pg| pg.port);
    let (dispatcher_cpu0, pg_cpu0) =
        (cpu_seconds(dispatcher.child.id(), false), pg_port.and_then(postgres_cpu_seconds));

    // Connections opened before the clock starts, and a wait for one that a slow moment cannot turn into a panic.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(32)
        .min_connections(32)
        .acquire_timeout(Duration::from_secs(600))
        .connect(&db.app_url)
        .await
        .unwrap();
    let committed = Arc::new(Committed::default());
    let t0 = now_ms();
    let load = tokio::spawn(commit_steadily(pool.clone(), workspaces.clone(), rate, seconds, committed.clone()));
    let started = Instant::now();
    let mut series = Vec::new();
    let mut max_lag = 0u64;
    let mut next_sample = started + Duration::from_secs(sample);
    while !load.is_finished() {
        tokio::time::sleep(Duration::from_millis(200)).await;
        if Instant::now() < next_sample {
            continue;
        }
        next_sample += Duration::from_secs(sample);
        let added = entries_added(&redis_client, &keys).await;
        let count = committed.count.load(Ordering::Relaxed);
        max_lag = max_lag.max(count.saturating_sub(added));
        let table = table_stats(&mut owner).await;
        series.push(json!({
            "t_s": started.elapsed().as_secs(), "committed": count, "relayed": added,
            "lag": count.saturating_sub(added),
            "total_mib": table["total_mib"], "dead": table["dead"], "vacuums": table["vacuums"],
            "scans": probe(&mut owner, workspaces[0]).await,
        }));
    }
    load.await.unwrap();
    let total = committed.count.load(Ordering::Relaxed);
    let last_commit = committed.jobs.lock().unwrap().iter().map(|(_, at)| *at).fold(t0, f64::max);
    let caught_up = common::eventually(Duration::from_secs(300), || async {
        (entries_added(&redis_client, &keys).await >= total).then_some(())
    })
    .await
    .is_some();
    // The relay's last XADD, by the id Redis gave it (its clock, this machine's).
    let last_xadd = last_xadd_ms(&redis_client, &keys).await.unwrap_or(t0);
    let (dispatcher_cpu, pg_cpu) = (cpu_seconds(dispatcher.child.id(), false), pg_port.and_then(postgres_cpu_seconds));
    let per_1000 = |a: Option<f64>, b: Option<f64>| Some(round((a? - b?) * 1000.0 * 1000.0 / total as f64));

    // Commit (COMMIT returned) to XADD (the entry id's millisecond), for every job.
    let rows: Vec<(Uuid, String)> =
        sqlx::query_as("SELECT id, stream_id FROM conveyor.outbox_events WHERE stream_id IS NOT NULL")
            .fetch_all(&mut owner)
            .await
            .unwrap();
    let xadd: HashMap<Uuid, f64> =
        rows.into_iter().filter_map(|(id, sid)| Some((id, sid.split('-').next()?.parse().ok()?))).collect();
    let mut latency: Vec<f64> =
        committed.jobs.lock().unwrap().iter().filter_map(|(id, at)| xadd.get(id).map(|x| (x - at).max(0.0))).collect();
    latency.sort_by(f64::total_cmp);
    let end_steady = table_stats(&mut owner).await;
    let steady_reads = reads_between(&reads_at_start, &index_reads(&mut owner).await);
    let steady_statements = statements.top(8).await;
    let steady_scans = probe(&mut owner, workspaces[0]).await;

    // Drain: the snapshot (if any) still open, the processes stopped, a backlog in the same workspaces.
    dispatcher.stop().await;
    worker.stop().await;
    commit_backlog(&pool, &workspaces, drain_n).await;
    sqlx::query("ANALYZE conveyor.outbox_events").execute(&mut owner).await.unwrap();
    let relay = common::test_dispatcher_on(&db.runtime_url, &prefix, &redis.url(), |v| {
        v.insert("CONVEYOR_DISPATCH_WINDOW".into(), "0".into());
        v.insert("CONVEYOR_DISPATCH_CONCURRENCY".into(), env("DISPATCH_CONCURRENCY", 4).to_string());
        v.insert("CONVEYOR_DISPATCH_BATCH".into(), env("DISPATCH_BATCH", 500).to_string());
    })
    .await;
    let reads_at_drain = index_reads(&mut owner).await;
    statements.reset().await;
    let drain_started = Instant::now();
    let mut drained = 0u64;
    while let conveyor_jobs::DispatchOutcome::Worked(s) = relay.dispatch_once().await.unwrap() {
        drained += s.dispatched;
    }
    let drain_s = drain_started.elapsed().as_secs_f64();
    let drain_reads = reads_between(&reads_at_drain, &index_reads(&mut owner).await);
    let drain_statements = statements.top(8).await;
    let end_drain = table_stats(&mut owner).await;
    let drain_scans = probe(&mut owner, workspaces[0]).await;
    let indexes = index_sizes(&mut owner).await;
    let xmin_age: Option<i32> = sqlx::query_scalar("SELECT age(backend_xmin) FROM pg_stat_activity WHERE pid = $1")
        .bind(holder_pid)
        .fetch_one(&mut owner)
        .await
        .unwrap();

    if with_snapshot {
        sqlx::query("COMMIT").execute(&mut holder).await.unwrap();
    }
    holder.close().await.unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after_close = table_stats(&mut owner).await;
    sqlx::query("VACUUM conveyor.outbox_events").execute(&mut owner).await.unwrap();
    let after_vacuum = table_stats(&mut owner).await;

    json!({
        "scenario": "snapshot", "snapshot": with_snapshot, "snapshot_s": seconds, "rate_per_s": rate,
        "workspaces": workspaces.len(), "worker_concurrency": conc,
        "postgres": if database.own.is_some() { "own" } else { "shared" },
        "settings": settings,
        "steady": {
            "committed": total, "committed_per_s": round(total as f64 * 1000.0 / (last_commit - t0)),
            "relayed_per_s": round(total as f64 * 1000.0 / (last_xadd - t0)), "caught_up": caught_up,
            "last_xadd_after_last_commit_ms": round(last_xadd - last_commit), "max_lag": max_lag,
            "commit_to_xadd_p50_ms": percentile(&latency, 50.0), "commit_to_xadd_p99_ms": percentile(&latency, 99.0),
            "commit_to_xadd_max_ms": latency.last().copied().map(round),
            "dispatcher_cpu_ms_per_1000": per_1000(dispatcher_cpu, dispatcher_cpu0),
            "postgres_cpu_ms_per_1000": per_1000(pg_cpu, pg_cpu0),
            "scans_at_end": steady_scans,
            "index_entries_read_m": steady_reads, "top_statements": steady_statements,
        },
        "drain": {
            "n": drain_n, "dispatched": drained, "per_s": (drained as f64 / drain_s).round(),
            "scans_at_end": drain_scans,
            "index_entries_read_m": drain_reads, "top_statements": drain_statements,
        },
        "snapshot_xmin_age_at_end": xmin_age,
        "table": { "start": at_start, "end_steady": end_steady, "end_drain": end_drain, "snapshot_closed": after_close,
                   "after_vacuum": after_vacuum },
        "indexes_mib_end_drain": indexes,
        "series": series,
    })
}

fn main() {
    if std::env::var("RUST_LOG").is_ok() {
        conveyor_server::telemetry::init_logging(false);
    }
    let modes = std::env::var("SNAPSHOT_MODES").unwrap_or_else(|_| "without,with".into());
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let mut results: HashMap<bool, Value> = HashMap::new();
        for mode in modes.split(',') {
            let with = match mode {
                "with" => true,
                "without" => false,
                other => panic!("unknown mode {other}: SNAPSHOT_MODES takes with and without"),
            };
            let result = run(with).await;
            println!("{result}");
            results.insert(with, result);
        }
        if let (Some(without), Some(with)) = (results.get(&false), results.get(&true)) {
            let ratio = |path: &[&str]| {
                let get = |v: &Value| path.iter().fold(v, |v, k| &v[*k]).as_f64();
                Some(round(get(with)? / get(without)?))
            };
            println!(
                "{}",
                json!({
                    "scenario": "snapshot-compare", "snapshot_s": with["snapshot_s"],
                    "steady_relayed_ratio": ratio(&["steady", "relayed_per_s"]),
                    "steady_commit_to_xadd_p99_ratio": ratio(&["steady", "commit_to_xadd_p99_ms"]),
                    "steady_postgres_cpu_ratio": ratio(&["steady", "postgres_cpu_ms_per_1000"]),
                    "drain_ratio": ratio(&["drain", "per_s"]),
                    "size_end_steady_ratio": ratio(&["table", "end_steady", "total_mib"]),
                    "size_end_drain_ratio": ratio(&["table", "end_drain", "total_mib"]),
                    "claim_scan_buffers_ratio": ratio(&["drain", "scans_at_end", "claim", "buffers"]),
                })
            );
        }
    });
}
