//! Conveyor's benchmarks, run with `cargo bench --bench conveyor -- <scenario>[,<scenario>…]` (scripts/bench runs
//! them beside BullMQ's reference on the same Redis and prints the ratios). Each scenario prints one JSON line.
//!
//! - `idempotency`: idempotent creates per second and replays per second over HTTP at 32 concurrent clients, and
//!   the same SQL run by `pgbench` with 32 clients against the same database.
//! - `dispatch`: drains a backlog of N outbox events spread over 100 workspaces into the streams; events per second.
//! - `dispatch-latency`: commits events at RATE/s for SECONDS while a dispatcher runs; commit to `XADD` p50/p99.
//! - `worker`: drains N prefilled jobs with a no-op handler at concurrency CONC; jobs per second.
//! - `latency`: commits jobs at RATE/s for SECONDS through dispatcher and worker; commit to handler start p50/p99.
//! - `commit`: the same enqueue transactions at the same rate with nothing relaying them: the durable commit's own
//!   p50/p99 on this machine, the floor under `latency`'s figure measured from the moment COMMIT is sent.
//! - `worker-memory`: peak resident memory of a real `conveyor worker` process at concurrency CONC draining N jobs.
//! - `enqueue-bulk`: N jobs written into the outbox by `enqueue_many_tx`, 50 per transaction (BullMQ's `add-bulk`
//!   batch), one transaction after the other, commit included, nothing relaying them; jobs per second.
//! - `burst`: N jobs enqueued as in `enqueue-bulk` while a dispatcher and a worker (concurrency CONC, no-op handler)
//!   run, each on a runtime of its own; jobs per second from the first enqueue to the last job's end recorded, and
//!   where the time went (enqueue done, last `XADD`, last handler start, last end recorded).
//! - `delay-lateness`: at idle, JOBS jobs enqueued one at a time over SECONDS, each with a delay of 200 to 1000 ms;
//!   lateness (handler start minus due time, due = the enqueue transaction's `now()` plus the delay) p50/p99/max.
//!
//! Environment: N (default 100000), CONC (100), RATE (1000), SECONDS (10), JOBS (300), WORKSPACES (`burst`, 1), and
//! the test harness's database and Redis variables.

#[path = "../tests/api/common/mod.rs"]
mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use conveyor_jobs::EnqueueOptions;
use conveyor_jobs::Metrics;
use conveyor_jobs::RedisKeys;
use conveyor_jobs::WorkspaceId;
use conveyor_jobs::{Handler, JobContext, JobError, Worker, WorkerSettings};
use conveyor_jobs::{Producer, StreamMessage as Message};
use conveyor_shop::jobs::VerifyCredentials;
use serde_json::json;
use sha2::Digest;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// The allocator of the `conveyor` binary, so that what runs here in-process allocates as the shipped processes do.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The de-dup keys of a benchmark's hand-offs expire soon after it (four leases, the least allowed): left for the
/// default 24 h, a session's runs piled millions of keys into the shared Redis and slowed later runs.
const BENCH_DEDUP_TTL: &str = "2m";

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn emit(value: serde_json::Value) {
    let mut v = value;
    v["system"] = json!("conveyor");
    println!("{v}");
}

fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    Some(sorted[((p / 100.0 * sorted.len() as f64) as usize).min(sorted.len() - 1)])
}

fn round(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// The same uuid from a label in Rust and in SQL: the first 32 hex digits of sha256(label).
fn derived_uuid(label: &str) -> Uuid {
    let digest = sha2::Sha256::digest(label.as_bytes());
    Uuid::from_slice(&digest[..16]).unwrap()
}

const SQL_UUID: &str = "left(encode(sha256(convert_to";

fn pgbench(db: &common::TestDb, script: &str, clients: u64, seconds: u64) -> f64 {
    let path = std::env::temp_dir().join(format!("conveyor-bench-{}.sql", Uuid::new_v4().simple()));
    std::fs::write(&path, script).unwrap();
    let out = std::process::Command::new("pgbench")
        .args(["-n", "-M", "prepared", "-c", &clients.to_string(), "-j", "2", "-T", &seconds.to_string(), "-f"])
        .arg(&path)
        .arg(&db.app_url)
        .output()
        .expect("pgbench is installed (postgresql-contrib)");
    let _ = std::fs::remove_file(&path);
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.strip_prefix("tps = ").and_then(|r| r.split_whitespace().next()).and_then(|n| n.parse().ok()))
        .unwrap_or_else(|| panic!("pgbench failed: {}{}", text, String::from_utf8_lossy(&out.stderr)))
}

async fn idempotency() {
    let clients = 32u64;
    let seconds = env("SECONDS", 10);
    let app = Arc::new(common::TestApp::spawn().await);
    let body = common::store_body("bench");
    // Creates: every request a new key.
    let run = |replay: bool| {
        let app = app.clone();
        let body = body.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(seconds);
            let mut tasks = Vec::new();
            for client in 0..clients {
                let (app, body) = (app.clone(), body.clone());
                tasks.push(tokio::spawn(async move {
                    let principal = conveyor_server::auth::Principal {
                        workspace_id: WorkspaceId(derived_uuid(&format!("ws{}", client + 1))),
                        user_id: conveyor_jobs::UserId(derived_uuid(&format!("user{}", client + 1))),
                    };
                    let token = app.token(principal);
                    let replay_key = derived_uuid(&format!("replay{}", client + 1)).to_string();
                    let mut done = 0u64;
                    while Instant::now() < deadline {
                        let key = if replay { replay_key.clone() } else { Uuid::new_v4().to_string() };
                        let resp = app
                            .http
                            .post(app.url("/v1/stores"))
                            .bearer_auth(&token)
                            .header("idempotency-key", key)
                            .json(&body)
                            .send()
                            .await
                            .unwrap();
                        assert_eq!(resp.status(), 202);
                        assert_eq!(resp.headers().contains_key("idempotent-replayed"), replay);
                        done += 1;
                    }
                    done
                }));
            }
            let mut total = 0;
            for t in tasks {
                total += t.await.unwrap();
            }
            total as f64 / seconds as f64
        }
    };
    let creates = run(false).await;
    // Replays: one record per client, created once, then replayed.
    for client in 1..=clients {
        let principal = conveyor_server::auth::Principal {
            workspace_id: WorkspaceId(derived_uuid(&format!("ws{client}"))),
            user_id: conveyor_jobs::UserId(derived_uuid(&format!("user{client}"))),
        };
        let key = derived_uuid(&format!("replay{client}")).to_string();
        let resp = app.send_with_key(reqwest::Method::POST, "/v1/stores", principal, Some(&key), Some(&body)).await;
        assert_eq!(resp.status(), 202);
    }
    let replays = run(true).await;

    // pgbench's client ids count from 0, the HTTP clients' labels from 1.
    let uuid =
        |label: &str| format!("{SQL_UUID}('{label}' || (:client_id::int + 1)::text, 'UTF8')), 'hex'), 32)::uuid");
    let (ws, user, replay_key) = (uuid("ws"), uuid("user"), uuid("replay"));
    let create_sql = format!(
        r#"SELECT gen_random_uuid() AS k, gen_random_uuid() AS sid, gen_random_uuid() AS oid, gen_random_uuid() AS eid \gset
BEGIN;
SELECT set_config('app.workspace_id', ({ws})::text, true);
SELECT request_fingerprint, status FROM conveyor_server.idempotency_requests WHERE workspace_id = {ws} AND user_id = {user} AND http_method = 'POST' AND request_path = '/v1/stores' AND idempotency_key = :k::uuid AND expires_at > now();
SELECT pg_try_advisory_xact_lock(hashtextextended('conveyor-idempotency:' || :k::text, 0));
SELECT request_fingerprint, status FROM conveyor_server.idempotency_requests WHERE workspace_id = {ws} AND user_id = {user} AND http_method = 'POST' AND request_path = '/v1/stores' AND idempotency_key = :k::uuid AND expires_at > now();
INSERT INTO conveyor_server.idempotency_requests (workspace_id, user_id, http_method, request_path, idempotency_key, request_fingerprint, fingerprint_key_id, expires_at) VALUES ({ws}, {user}, 'POST', '/v1/stores', :k::uuid, sha256('x'), 't1', now() + interval '48 hours');
INSERT INTO conveyor_shop.stores (id, workspace_id, name, platform, created_by) VALUES (:sid::uuid, {ws}, 'Main shop', 'sandbox', {user}) RETURNING id, name, platform, status, status_detail, created_at, updated_at, verified_at;
INSERT INTO conveyor_shop.store_credentials (store_id, workspace_id, key_id, nonce, ciphertext) VALUES (:sid::uuid, {ws}, 'k1', substr(sha256('n'), 1, 12), sha256('c'));
INSERT INTO conveyor.operations (id, workspace_id, kind, subject_id, created_by) VALUES (:oid::uuid, {ws}, 'store.verify_credentials', :sid::uuid, {user}) RETURNING id, kind, status, subject_id, progress, result, error, created_at, updated_at;
INSERT INTO conveyor.outbox_events (id, workspace_id, queue, event_type, event_payload, operation_id, traceparent) VALUES (:eid::uuid, {ws}, 'stores', 'store.verify_credentials', '{{"store_id": "x", "credentials_version": 1}}', :oid::uuid, '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01');
SELECT pg_notify('conveyor_outbox', '');
UPDATE conveyor_server.idempotency_requests SET status = 'completed', response_status = 202, response_headers = '[]', response_body = '{{}}', completed_at = now() WHERE workspace_id = {ws} AND user_id = {user} AND http_method = 'POST' AND request_path = '/v1/stores' AND idempotency_key = :k::uuid AND status = 'in_progress';
COMMIT;
"#
    );
    let replay_sql = format!(
        r#"BEGIN;
SELECT set_config('app.workspace_id', ({ws})::text, true);
SELECT request_fingerprint, fingerprint_key_id, status, response_status, response_headers, response_body FROM conveyor_server.idempotency_requests WHERE workspace_id = {ws} AND user_id = {user} AND http_method = 'POST' AND request_path = '/v1/stores' AND idempotency_key = {replay_key} AND expires_at > now();
ROLLBACK;
"#
    );
    let pg_creates = pgbench(&app.db, &create_sql, clients, seconds);
    let pg_replays = pgbench(&app.db, &replay_sql, clients, seconds);
    emit(json!({
        "scenario": "idempotency", "clients": clients, "seconds": seconds,
        "creates_per_s": creates.round(), "pgbench_creates_per_s": pg_creates.round(),
        "creates_ratio": round(creates / pg_creates),
        "replays_per_s": replays.round(), "pgbench_replays_per_s": pg_replays.round(),
        "replays_ratio": round(replays / pg_replays),
    }));
}

/// Commits `per_workspace` events in each of `workspaces` workspaces, in batches of 1000 per transaction.
async fn backlog(app: &common::TestApp, workspaces: usize, per_workspace: usize) {
    for _ in 0..workspaces {
        let ws = WorkspaceId(Uuid::new_v4());
        let mut left = per_workspace;
        while left > 0 {
            let n = left.min(1000);
            let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
            sqlx::query(
                "INSERT INTO conveyor.outbox_events (id, workspace_id, queue, event_type, event_payload)
                 SELECT gen_random_uuid(), $1, 'stores', 'store.verify_credentials',
                        jsonb_build_object('store_id', gen_random_uuid(), 'credentials_version', 1)
                 FROM generate_series(1, $2)",
            )
            .bind(ws.0)
            .bind(n as i32)
            .execute(&mut *tx)
            .await
            .unwrap();
            tx.commit().await.unwrap();
            left -= n;
        }
    }
}

async fn dispatch() {
    let n = env("N", 100_000) as usize;
    let app = common::TestApp::spawn().await;
    backlog(&app, 100, n / 100).await;
    sqlx::query("ANALYZE conveyor.outbox_events").execute(&mut app.db.owner().await).await.unwrap();
    let concurrency = env("DISPATCH_CONCURRENCY", 4);
    let batch = env("DISPATCH_BATCH", 500);
    let dispatcher = common::test_dispatcher(&app, &common::redis_url(), |v| {
        v.insert("CONVEYOR_DISPATCH_CONCURRENCY".into(), concurrency.to_string());
        v.insert("CONVEYOR_DISPATCH_BATCH".into(), batch.to_string());
        v.insert("CONVEYOR_DISPATCH_DEDUP_TTL".into(), BENCH_DEDUP_TTL.into());
        // The relay alone, no worker: nothing ends, so a fairness window would stop it once full.
        v.insert("CONVEYOR_DISPATCH_WINDOW".into(), "0".into());
    })
    .await;
    let started = Instant::now();
    let mut dispatched = 0;
    while let conveyor_jobs::DispatchOutcome::Worked(s) = dispatcher.dispatch_once().await.unwrap() {
        dispatched += s.dispatched;
    }
    let elapsed = started.elapsed().as_secs_f64();
    assert_eq!(dispatched as usize, n / 100 * 100);
    emit(
        json!({ "scenario": "dispatch", "n": dispatched, "workspaces": 100, "per_s": (dispatched as f64 / elapsed).round() }),
    );
}

/// Commits one event per transaction at `rate`/s for `seconds`, over 10 workspaces, after a warm-up of
/// `WARMUP_SECONDS` (default 2) at the same rate whose events are not counted: a running API has its connections open
/// and its pages in memory, while a fresh test database starts cold (and the harness may have just dropped stale test
/// databases, which forces a checkpoint). Returns, per measured event, its id, the wall-clock time (ms since the epoch)
/// at which its COMMIT was sent, and the time at which it returned.
async fn steady_commits(app: &common::TestApp, rate: u64, seconds: u64) -> Vec<(Uuid, f64, f64)> {
    let workspaces: Vec<WorkspaceId> = (0..10).map(|_| WorkspaceId(Uuid::new_v4())).collect();
    let pool = conveyor_jobs::connect_postgres(&app.db.app_url, 32).await.unwrap();
    let warmup = env("WARMUP_SECONDS", 2);
    if warmup > 0 {
        commit_at_rate(&pool, &workspaces, rate, warmup).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    commit_at_rate(&pool, &workspaces, rate, seconds).await
}

async fn commit_at_rate(pool: &PgPool, workspaces: &[WorkspaceId], rate: u64, seconds: u64) -> Vec<(Uuid, f64, f64)> {
    let total = (rate * seconds) as usize;
    let started = tokio::time::Instant::now();
    let mut tasks = Vec::with_capacity(total);
    for i in 0..total {
        let due = started + Duration::from_secs_f64(i as f64 / rate as f64);
        tokio::time::sleep_until(due).await;
        let (pool, ws) = (pool.clone(), workspaces[i % workspaces.len()]);
        tasks.push(tokio::spawn(async move {
            let mut tx = conveyor_jobs::begin_workspace(&pool, ws).await.unwrap();
            let payload = VerifyCredentials { store_id: Uuid::now_v7(), credentials_version: 1 };
            let id = conveyor_jobs::enqueue_tx(&mut tx, &payload, EnqueueOptions::new()).await.unwrap().id.0;
            let sent = chrono::Utc::now().timestamp_micros() as f64 / 1000.0;
            tx.commit().await.unwrap();
            (id, sent, chrono::Utc::now().timestamp_micros() as f64 / 1000.0)
        }));
    }
    let mut committed = Vec::with_capacity(total);
    for t in tasks {
        committed.push(t.await.unwrap());
    }
    committed
}

/// Runs `task` on a runtime of its own, in a thread of its own, as a process of its own would run it: not behind the
/// load generator's tasks. `one_thread` as the `conveyor dispatcher` process (see `src/main.rs`).
fn on_own_runtime(
    name: &str,
    one_thread: bool,
    task: impl Future<Output = ()> + Send + 'static,
) -> std::thread::JoinHandle<()> {
    let mut builder = match one_thread {
        true => tokio::runtime::Builder::new_current_thread(),
        false => tokio::runtime::Builder::new_multi_thread(),
    };
    let runtime = builder.thread_name(name).enable_all().build().unwrap();
    std::thread::Builder::new().name(name.into()).spawn(move || runtime.block_on(task)).unwrap()
}

/// A dispatcher over `app`'s database and prefix, on a runtime of its own, running until `shutdown`
/// (`DISPATCH_CONCURRENCY` sets its concurrency).
fn spawn_dispatcher(app: &common::TestApp, shutdown: CancellationToken) -> std::thread::JoinHandle<()> {
    spawn_dispatcher_windowed(app, shutdown, std::env::var("DISPATCH_WINDOW").ok())
}

/// A dispatcher with the fairness window `window` (`None`: the default). Scenarios without a worker relay with no
/// window ("0"): nothing ends there, so a window would stop the relay once full.
fn spawn_dispatcher_windowed(
    app: &common::TestApp,
    shutdown: CancellationToken,
    window: Option<String>,
) -> std::thread::JoinHandle<()> {
    let (url, prefix) = (app.db.runtime_url.clone(), app.redis_prefix.clone());
    on_own_runtime("dispatcher", true, async move {
        let dispatcher = common::test_dispatcher_on(&url, &prefix, &common::redis_url(), |v| {
            v.insert("CONVEYOR_DISPATCH_DEDUP_TTL".into(), BENCH_DEDUP_TTL.into());
            if let Ok(c) = std::env::var("DISPATCH_CONCURRENCY") {
                v.insert("CONVEYOR_DISPATCH_CONCURRENCY".into(), c);
            }
            // The fairness window (default 256): `DISPATCH_WINDOW=0` measures the relay without it.
            if let Some(w) = window {
                v.insert("CONVEYOR_DISPATCH_WINDOW".into(), w);
            }
        })
        .await;
        dispatcher.run(shutdown).await.unwrap();
    })
}

async fn dispatch_latency() {
    let (rate, seconds) = (env("RATE", 1000), env("SECONDS", 10));
    let app = common::TestApp::spawn().await;
    let shutdown = CancellationToken::new();
    let dispatcher = spawn_dispatcher_windowed(&app, shutdown.clone(), Some("0".into()));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let committed = steady_commits(&app, rate, seconds).await;
    let total = committed.len();
    let drained = common::eventually(Duration::from_secs(60), || async {
        let rows: Vec<(String, i64)> = sqlx::query_as("SELECT status, events FROM conveyor.conveyor_outbox_backlog()")
            .fetch_all(&app.db.runtime_pool)
            .await
            .unwrap();
        rows.iter().all(|(status, n)| status == "dead_letter" || *n == 0).then_some(())
    })
    .await;
    assert!(drained.is_some(), "the dispatcher kept up");
    // Commit (when the enqueue transaction's COMMIT returned) to XADD (the entry id's millisecond timestamp).
    let mut owner = app.db.owner().await;
    let rows: Vec<(Uuid, String)> =
        sqlx::query_as("SELECT id, stream_id FROM conveyor.outbox_events WHERE status = 'dispatched'")
            .fetch_all(&mut owner)
            .await
            .unwrap();
    let added: HashMap<Uuid, f64> =
        rows.into_iter().map(|(id, sid)| (id, sid.split('-').next().unwrap().parse::<f64>().unwrap())).collect();
    let latencies: Vec<(f64,)> = committed.iter().filter_map(|(id, _, at)| added.get(id).map(|x| (x - at,))).collect();
    shutdown.cancel();
    dispatcher.join().unwrap();
    // The entry id has millisecond resolution: a latency under a millisecond can read as slightly negative.
    let mut ms: Vec<f64> = latencies.into_iter().map(|(l,)| l.max(0.0)).collect();
    ms.sort_by(f64::total_cmp);
    let mut commit: Vec<f64> = committed.iter().map(|(_, sent, done)| done - sent).collect();
    commit.sort_by(f64::total_cmp);
    emit(json!({
        "scenario": "dispatch-latency", "rate_per_s": rate, "seconds": seconds, "warmup_s": env("WARMUP_SECONDS", 2),
        "sent": total, "received": ms.len(),
        "commit_p50_ms": percentile(&commit, 50.0).map(round), "commit_p99_ms": percentile(&commit, 99.0).map(round),
        "p50_ms": percentile(&ms, 50.0), "p99_ms": percentile(&ms, 99.0), "max_ms": ms.last(),
    }));
}

/// A handler that does nothing but note which job started when (ms since the epoch), or count its starts.
#[derive(Default)]
struct Noop {
    started: Option<Arc<Mutex<HashMap<Uuid, f64>>>>,
    starts: Option<Arc<Starts>>,
}

/// Handler starts, counted without a lock: how many, and the latest (µs since the epoch).
#[derive(Default)]
struct Starts {
    count: AtomicUsize,
    last_us: AtomicI64,
}

impl Handler<VerifyCredentials> for Noop {
    async fn handle(&self, _job: VerifyCredentials, cx: &mut JobContext) -> Result<serde_json::Value, JobError> {
        if let Some(started) = &self.started {
            let now = chrono::Utc::now().timestamp_micros() as f64 / 1000.0;
            started.lock().unwrap().entry(cx.id().0).or_insert(now);
        }
        if let Some(starts) = &self.starts {
            starts.last_us.fetch_max(chrono::Utc::now().timestamp_micros(), Ordering::Relaxed);
            starts.count.fetch_add(1, Ordering::Relaxed);
        }
        Ok(serde_json::Value::Null)
    }
}

async fn noop_worker(
    app: &common::TestApp,
    concurrency: usize,
    started: Option<Arc<Mutex<HashMap<Uuid, f64>>>>,
) -> Worker {
    noop_worker_on(app.db.pool.clone(), &app.redis_prefix, concurrency, started).await
}

async fn noop_worker_on(
    pool: sqlx::PgPool,
    prefix: &str,
    concurrency: usize,
    started: Option<Arc<Mutex<HashMap<Uuid, f64>>>>,
) -> Worker {
    noop_worker_with(pool, prefix, concurrency, Noop { started, starts: None }).await
}

async fn noop_worker_with(pool: sqlx::PgPool, prefix: &str, concurrency: usize, handler: Noop) -> Worker {
    let redis = common::redis_url();
    let client = conveyor_jobs::connect_redis(&redis, Duration::from_secs(5)).await.unwrap();
    let blocking = conveyor_jobs::connect_redis(&redis, Duration::from_secs(10)).await.unwrap();
    let consumer = conveyor_jobs::Consumer::new(client, blocking, RedisKeys::new(prefix), "bench".into());
    // The worker's bookkeeping as the runtime role, on the same database as `pool`.
    let database = pool.connect_options().get_database().expect("a database").to_owned();
    let runtime_url = format!("{}/{database}", common::runtime_base_url().rsplit_once('/').unwrap().0);
    let runtime = conveyor_jobs::connect_postgres(&runtime_url, 4).await.unwrap();
    Worker::builder(pool, consumer)
        .runtime_pool(runtime)
        .handle::<VerifyCredentials>(handler)
        .settings(WorkerSettings { concurrency, ..WorkerSettings::default() })
        .metrics(Metrics::new())
        .build()
        .unwrap()
}

/// Publishes `n` jobs (no operation) straight into the stream, 1000 per pipeline, each with its outbox row (handed
/// off, as a dispatcher leaves it): a worker runs only jobs PostgreSQL knows.
async fn prefill(app: &common::TestApp, n: usize) {
    let client = conveyor_jobs::connect_redis(&common::redis_url(), Duration::from_secs(10)).await.unwrap();
    let producer = Producer::new(client, RedisKeys::new(&app.redis_prefix), Duration::from_secs(120));
    let ws = Uuid::new_v4();
    let mut left = n;
    while left > 0 {
        let batch: Vec<Message> = (0..left.min(1000))
            .map(|_| Message {
                queue: "stores".into(),
                event_id: Uuid::now_v7(),
                workspace_id: ws,
                event_type: "store.verify_credentials".into(),
                payload: json!({"store_id": Uuid::now_v7(), "credentials_version": 1}).to_string(),
                operation_id: None,
                attempt: 1,
                enqueued_at_ms: chrono::Utc::now().timestamp_millis(),
                due_at_ms: None,
                traceparent: conveyor_jobs::new_traceparent(),
                redrive: 0,
                class: String::new(),
                options: Default::default(),
            })
            .collect();
        let ids: Vec<Uuid> = batch.iter().map(|m| m.event_id).collect();
        let payloads: Vec<String> = batch.iter().map(|m| m.payload.clone()).collect();
        let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, conveyor_jobs::WorkspaceId(ws)).await.unwrap();
        sqlx::query(
            "INSERT INTO conveyor.outbox_events (id, workspace_id, queue, event_type, event_payload, status, dispatched_at)
             SELECT id, $2, 'stores', 'store.verify_credentials', payload::jsonb, 'dispatched', now()
             FROM unnest($1::uuid[], $3::text[]) AS j(id, payload)",
        )
        .bind(&ids)
        .bind(ws)
        .bind(&payloads)
        .execute(&mut *tx)
        .await
        .unwrap();
        tx.commit().await.unwrap();
        for r in producer.publish(&batch).await {
            r.unwrap();
        }
        left -= batch.len();
    }
}

async fn stream_len(app: &common::TestApp) -> u64 {
    use fred::prelude::StreamsInterface;
    let client = common::redis_client(&common::redis_url()).await;
    client.xlen(RedisKeys::new(&app.redis_prefix).stream("stores")).await.unwrap()
}

/// CPU time (user and system) this process has used so far, in seconds, from `/proc/self/stat` (clock ticks of 10 ms).
fn process_cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    // The fields after the command name, which is in parentheses and may hold spaces: utime and stime are the 12th
    // and 13th of them.
    let fields: Vec<&str> = stat.rsplit_once(')').unwrap().1.split_whitespace().collect();
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    ticks / 100.0
}

async fn worker() {
    let (n, conc) = (env("N", 100_000) as usize, env("CONC", 100) as usize);
    let app = common::TestApp::spawn().await;
    let starts = Arc::new(Starts::default());
    let handler = Noop { started: None, starts: Some(starts.clone()) };
    let worker = noop_worker_with(app.db.pool.clone(), &app.redis_prefix, conc, handler).await;
    worker.ensure_groups().await.unwrap();
    prefill(&app, n).await;
    let shutdown = CancellationToken::new();
    let started = Instant::now();
    let cpu_before = process_cpu_seconds();
    let handle = tokio::spawn(worker.run(shutdown.clone(), Duration::from_secs(10)));
    let client = common::redis_client(&common::redis_url()).await;
    let stream = RedisKeys::new(&app.redis_prefix).stream("stores");
    loop {
        use fred::prelude::StreamsInterface;
        let len: u64 = client.xlen(&stream).await.unwrap();
        if len == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let cpu = process_cpu_seconds() - cpu_before;
    shutdown.cancel();
    handle.await.unwrap().unwrap();
    // Every job ran its handler: a drain of skipped entries would measure nothing a user asked for.
    assert_eq!(starts.count.load(Ordering::Relaxed), n, "every prefilled job ran");
    emit(json!({
        "scenario": "worker", "n": n, "concurrency": conc, "per_s": (n as f64 / elapsed).round(),
        "cpu_us_per_job": round(cpu * 1e6 / n as f64),
    }));
}

async fn latency() {
    let (rate, seconds, conc) = (env("RATE", 1000), env("SECONDS", 10), env("CONC", 100) as usize);
    let app = common::TestApp::spawn().await;
    let started = Arc::new(Mutex::new(HashMap::new()));
    let shutdown = CancellationToken::new();
    let (ready_tx, ready) = std::sync::mpsc::channel();
    let worker_thread = {
        let (url, prefix, started, shutdown) =
            (app.db.app_url.clone(), app.redis_prefix.clone(), started.clone(), shutdown.clone());
        on_own_runtime("worker", false, async move {
            let pool = conveyor_jobs::connect_postgres(&url, 4).await.unwrap();
            let worker = noop_worker_on(pool, &prefix, conc, Some(started)).await;
            worker.ensure_groups().await.unwrap();
            ready_tx.send(()).unwrap();
            worker.run(shutdown, Duration::from_secs(10)).await.unwrap();
        })
    };
    ready.recv().unwrap();
    let dispatcher = spawn_dispatcher(&app, shutdown.clone());
    tokio::time::sleep(Duration::from_millis(300)).await;
    let committed = steady_commits(&app, rate, seconds).await;
    let total = committed.len();
    common::eventually(Duration::from_secs(60), || async {
        let started = started.lock().unwrap();
        committed.iter().all(|(id, _, _)| started.contains_key(id)).then_some(())
    })
    .await;
    shutdown.cancel();
    worker_thread.join().unwrap();
    dispatcher.join().unwrap();
    // From the moment COMMIT was sent (BullMQ's reference measures from the moment `add` is called).
    let started = started.lock().unwrap().clone();
    let mut ms: Vec<f64> =
        committed.iter().filter_map(|(id, sent, _)| started.get(id).map(|at| (at - sent).max(0.0))).collect();
    // And from the moment COMMIT returned: the relay and the worker alone, without the commit's own wait.
    let mut from_commit: Vec<f64> =
        committed.iter().filter_map(|(id, _, done)| started.get(id).map(|at| (at - done).max(0.0))).collect();
    from_commit.sort_by(f64::total_cmp);
    let mut commit: Vec<f64> = committed.iter().map(|(_, sent, done)| done - sent).collect();
    commit.sort_by(f64::total_cmp);
    // Where the time goes: the XADD (the entry id's millisecond) to the handler's start.
    let rows: Vec<(Uuid, String)> =
        sqlx::query_as("SELECT id, stream_id FROM conveyor.outbox_events WHERE stream_id IS NOT NULL")
            .fetch_all(&mut app.db.owner().await)
            .await
            .unwrap();
    let mut from_xadd: Vec<f64> = rows
        .iter()
        .filter_map(|(id, sid)| Some(started.get(id)? - sid.split('-').next()?.parse::<f64>().ok()?))
        .collect();
    from_xadd.sort_by(f64::total_cmp);
    ms.sort_by(f64::total_cmp);
    emit(json!({
        "scenario": "latency", "rate_per_s": rate, "seconds": seconds, "warmup_s": env("WARMUP_SECONDS", 2),
        "concurrency": conc, "sent": total,
        "commit_p50_ms": percentile(&commit, 50.0).map(round), "commit_p99_ms": percentile(&commit, 99.0).map(round),
        "xadd_to_start_p50_ms": percentile(&from_xadd, 50.0).map(round),
        "xadd_to_start_p99_ms": percentile(&from_xadd, 99.0).map(round),
        "committed_to_start_p50_ms": percentile(&from_commit, 50.0).map(round),
        "committed_to_start_p99_ms": percentile(&from_commit, 99.0).map(round),
        "received": ms.len(), "p50_ms": percentile(&ms, 50.0).map(round), "p99_ms": percentile(&ms, 99.0).map(round),
        "max_ms": ms.last().copied().map(round),
    }));
}

async fn commit() {
    let (rate, seconds) = (env("RATE", 1000), env("SECONDS", 10));
    let app = common::TestApp::spawn().await;
    let committed = steady_commits(&app, rate, seconds).await;
    let mut commit: Vec<f64> = committed.iter().map(|(_, sent, done)| done - sent).collect();
    commit.sort_by(f64::total_cmp);
    emit(json!({
        "scenario": "commit", "rate_per_s": rate, "seconds": seconds, "warmup_s": env("WARMUP_SECONDS", 2),
        "sent": commit.len(), "commit_p50_ms": percentile(&commit, 50.0).map(round),
        "commit_p99_ms": percentile(&commit, 99.0).map(round), "max_ms": commit.last().copied().map(round),
    }));
}

async fn worker_memory() {
    let (n, conc) = (env("N", 100_000) as usize, env("CONC", 100));
    let app = common::TestApp::spawn().await;
    let (_sandbox, market) = common::sandbox(Default::default()).await;
    noop_worker(&app, 1, None).await.ensure_groups().await.unwrap();
    prefill(&app, n).await;
    let mut vars: HashMap<String, String> = common::config_vars(&app.db, &app.redis_prefix);
    vars.insert("CONVEYOR_MARKETPLACE_URL".into(), market);
    vars.insert("CONVEYOR_WORKER_CONCURRENCY".into(), conc.to_string());
    vars.insert("CONVEYOR_DATABASE_MAX_CONNECTIONS".into(), "32".into());
    vars.insert("RUST_LOG".into(), "warn".into());
    let mut process = common::Process::spawn(&["worker"], &vars);
    let started = Instant::now();
    let mut peak_kib = 0u64;
    let status = format!("/proc/{}/status", process.child.id());
    loop {
        if let Ok(s) = std::fs::read_to_string(&status) {
            let hwm = s
                .lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok());
            peak_kib = peak_kib.max(hwm.unwrap_or(0));
        }
        if stream_len(&app).await == 0 || started.elapsed() > Duration::from_secs(300) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let elapsed = started.elapsed().as_secs_f64();
    process.kill();
    emit(json!({
        "scenario": "worker-memory", "n": n, "concurrency": conc, "handler": "store.verify_credentials (store gone)",
        "peak_rss_mib": round(peak_kib as f64 / 1024.0), "per_s": (n as f64 / elapsed).round(),
    }));
}

/// Jobs per transaction in `enqueue-bulk` and `burst`: the batch of BullMQ's `add-bulk` and `burst` (`addBulk` of 50,
/// one call after the other, in both references).
const BULK_BATCH: usize = 50;

fn now_ms() -> f64 {
    chrono::Utc::now().timestamp_micros() as f64 / 1000.0
}

/// Enqueues `n` jobs with `enqueue_many_tx`, [`BULK_BATCH`] per transaction, one transaction after the other (each
/// begun, written and committed before the next), round-robin over `workspaces`. Returns each transaction's duration
/// in ms, begin to commit.
async fn enqueue_in_bulk(pool: &PgPool, workspaces: &[WorkspaceId], n: usize) -> Vec<f64> {
    let mut took = Vec::with_capacity(n.div_ceil(BULK_BATCH));
    let mut left = n;
    while left > 0 {
        let t = Instant::now();
        let jobs: Vec<VerifyCredentials> = (0..left.min(BULK_BATCH))
            .map(|_| VerifyCredentials { store_id: Uuid::now_v7(), credentials_version: 1 })
            .collect();
        let mut tx = conveyor_jobs::begin_workspace(pool, workspaces[took.len() % workspaces.len()]).await.unwrap();
        let enqueued =
            conveyor_jobs::enqueue_many_tx(&mut tx, jobs.iter().map(|j| (j, EnqueueOptions::new()))).await.unwrap();
        assert_eq!(enqueued.len(), jobs.len());
        tx.commit().await.unwrap();
        left -= jobs.len();
        took.push(t.elapsed().as_secs_f64() * 1e3);
    }
    took
}

/// What the references' `add-bulk` measures: N jobs in batches of 50, one batch after the other, nothing consuming.
async fn enqueue_bulk() {
    let n = env("N", 100_000) as usize;
    let app = common::TestApp::spawn().await;
    let workspace = [WorkspaceId(Uuid::new_v4())];
    let started = Instant::now();
    let mut took = enqueue_in_bulk(&app.db.pool, &workspace, n).await;
    let elapsed = started.elapsed().as_secs_f64();
    let (written,): (i64,) = sqlx::query_as("SELECT count(*) FROM conveyor.outbox_events")
        .fetch_one(&mut app.db.owner().await)
        .await
        .unwrap();
    assert_eq!(written as usize, n);
    took.sort_by(f64::total_cmp);
    emit(json!({
        "scenario": "enqueue-bulk", "n": n, "batch": BULK_BATCH, "transactions": took.len(),
        "per_s": (n as f64 / elapsed).round(),
        "tx_p50_ms": percentile(&took, 50.0).map(round), "tx_p99_ms": percentile(&took, 99.0).map(round),
    }));
}

/// A no-op worker at `concurrency` over `app`'s database and prefix, on a multi-threaded runtime of its own (as the
/// `conveyor worker` process runs, with its default pool of 16 connections), running until `shutdown`. Returns once
/// its consumer groups exist.
fn spawn_worker(
    app: &common::TestApp,
    concurrency: usize,
    handler: Noop,
    shutdown: CancellationToken,
) -> std::thread::JoinHandle<()> {
    let (url, prefix) = (app.db.app_url.clone(), app.redis_prefix.clone());
    let (ready_tx, ready) = std::sync::mpsc::channel();
    let thread = on_own_runtime("worker", false, async move {
        let pool = conveyor_jobs::connect_postgres(&url, 16).await.unwrap();
        let worker = noop_worker_with(pool, &prefix, concurrency, handler).await;
        worker.ensure_groups().await.unwrap();
        ready_tx.send(()).unwrap();
        worker.run(shutdown, Duration::from_secs(10)).await.unwrap();
    });
    ready.recv().unwrap();
    thread
}

/// The id Redis gave the stream's last `XADD`, as ms since the epoch (its clock, this machine's): it stays when the
/// entries are acknowledged and deleted.
async fn last_xadd_ms(app: &common::TestApp, queue: &str) -> Option<f64> {
    use fred::prelude::StreamsInterface;
    let client = common::redis_client(&common::redis_url()).await;
    let info: HashMap<String, fred::prelude::Value> =
        client.xinfo_stream(RedisKeys::new(&app.redis_prefix).stream(queue), false, None).await.unwrap();
    info.get("last-generated-id")?.as_string()?.split('-').next()?.parse().ok()
}

/// Deadlocks detected in `app`'s database so far (`pg_stat_database`).
async fn database_deadlocks(app: &common::TestApp) -> i64 {
    sqlx::query_scalar("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
        .fetch_one(&mut app.db.owner().await)
        .await
        .unwrap()
}

/// The references' `burst`: N jobs added in batches of 50 while a worker (concurrency CONC, no-op handler) already
/// runs, timed from the first add. The references stop at the N-th handler call; here the end is stricter, the last
/// job's end recorded in PostgreSQL (status `completed`): the handler counts its starts, and once all N have started,
/// the stream is watched until it is empty, which it is only when every entry has been acknowledged (and deleted),
/// which the worker does only after recording the job's end. The N-th start is reported too (`per_s_to_last_start`,
/// the references' own end point). Enqueue, relay and worker run at once, as in production: the enqueuing client on
/// this runtime, the dispatcher and the worker each on a runtime of its own.
async fn burst() {
    let (n, conc) = (env("N", 100_000) as usize, env("CONC", 100) as usize);
    let workspaces: Vec<WorkspaceId> = (0..env("WORKSPACES", 1).max(1)).map(|_| WorkspaceId(Uuid::new_v4())).collect();
    let app = common::TestApp::spawn().await;
    let starts = Arc::new(Starts::default());
    let shutdown = CancellationToken::new();
    let handler = Noop { starts: Some(starts.clone()), ..Noop::default() };
    let worker_thread = spawn_worker(&app, conc, handler, shutdown.clone());
    let dispatcher = spawn_dispatcher(&app, shutdown.clone());
    // The dispatcher LISTENs before the first commit (else the first jobs would wait for its first poll).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let deadlocks_before = database_deadlocks(&app).await;
    let cpu_before = process_cpu_seconds();
    let clock = Instant::now();
    let t0 = now_ms();
    let mut took = enqueue_in_bulk(&app.db.pool, &workspaces, n).await;
    let t1 = now_ms();
    let limit = Duration::from_secs(600);
    while starts.count.load(Ordering::Relaxed) < n {
        assert!(clock.elapsed() < limit, "only {} of {n} jobs started", starts.count.load(Ordering::Relaxed));
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let redis = common::redis_client(&common::redis_url()).await;
    let stream = RedisKeys::new(&app.redis_prefix).stream("stores");
    loop {
        use fred::prelude::StreamsInterface;
        let len: u64 = redis.xlen(&stream).await.unwrap();
        if len == 0 {
            break;
        }
        assert!(clock.elapsed() < limit, "{len} entries still in the stream");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let t3 = now_ms();
    let cpu = process_cpu_seconds() - cpu_before;
    shutdown.cancel();
    worker_thread.join().unwrap();
    dispatcher.join().unwrap();
    let t2 = last_xadd_ms(&app, "stores").await.unwrap();
    // Deadlocks PostgreSQL broke in this database during the run (each one after `deadlock_timeout`, 1 s by default):
    // a backend flushes its counters at exit, and the worker's and the dispatcher's have just been closed.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let deadlocks = database_deadlocks(&app).await - deadlocks_before;
    let last_start = starts.last_us.load(Ordering::Relaxed) as f64 / 1000.0;
    let (completed, last_end): (i64, Option<chrono::DateTime<chrono::Utc>>) =
        sqlx::query_as("SELECT count(*), max(finished_at) FROM conveyor.outbox_events WHERE status = 'completed'")
            .fetch_one(&mut app.db.owner().await)
            .await
            .unwrap();
    assert_eq!(completed as usize, n, "every job's end is recorded");
    took.sort_by(f64::total_cmp);
    let at = |t: f64| round(t - t0);
    emit(json!({
        "scenario": "burst", "n": n, "concurrency": conc, "batch": BULK_BATCH, "workspaces": workspaces.len(),
        "per_s": (n as f64 / ((t3 - t0) / 1e3)).round(),
        "per_s_to_last_start": (n as f64 / ((last_start - t0) / 1e3)).round(),
        "enqueued_ms": at(t1), "last_xadd_ms": at(t2), "last_start_ms": at(last_start), "done_ms": at(t3),
        // finished_at is the recording transaction's start (the database's clock, this machine's).
        "last_finished_at_ms": last_end.map(|e| at(e.timestamp_micros() as f64 / 1000.0)),
        "enqueue_per_s": (n as f64 / ((t1 - t0) / 1e3)).round(),
        "tx_p50_ms": percentile(&took, 50.0).map(round), "tx_p99_ms": percentile(&took, 99.0).map(round),
        "starts": starts.count.load(Ordering::Relaxed), "deadlocks": deadlocks,
        "cpu_us_per_job": round(cpu * 1e6 / n as f64),
    }));
}

/// Delayed jobs at idle: JOBS jobs, one per transaction, spread evenly over SECONDS, each due 200 to 1000 ms after
/// its transaction's `now()` (read in the same transaction, which is the time `delay` counts from); lateness is the
/// handler's start minus that due time.
async fn delay_lateness() {
    let (jobs, seconds, conc) = (env("JOBS", 300) as usize, env("SECONDS", 10), env("CONC", 100) as usize);
    let app = common::TestApp::spawn().await;
    let started = Arc::new(Mutex::new(HashMap::new()));
    let shutdown = CancellationToken::new();
    let handler = Noop { started: Some(started.clone()), ..Noop::default() };
    let worker_thread = spawn_worker(&app, conc, handler, shutdown.clone());
    let dispatcher = spawn_dispatcher(&app, shutdown.clone());
    tokio::time::sleep(Duration::from_millis(500)).await;
    let workspace = WorkspaceId(Uuid::new_v4());
    let clock = tokio::time::Instant::now();
    let mut due: Vec<(Uuid, f64)> = Vec::with_capacity(jobs);
    for i in 0..jobs {
        tokio::time::sleep_until(clock + Duration::from_secs_f64(i as f64 * seconds as f64 / jobs as f64)).await;
        // 389 and 801 are coprime: the delays go over every ms from 200 to 1000, not in order.
        let delay = Duration::from_millis(200 + (i as u64 * 389) % 801);
        let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, workspace).await.unwrap();
        let (now,): (chrono::DateTime<chrono::Utc>,) =
            sqlx::query_as("SELECT now()").fetch_one(&mut *tx).await.unwrap();
        let job = VerifyCredentials { store_id: Uuid::now_v7(), credentials_version: 1 };
        let id = conveyor_jobs::enqueue_tx(&mut tx, &job, EnqueueOptions::new().delay(delay)).await.unwrap().id.0;
        tx.commit().await.unwrap();
        due.push((id, now.timestamp_micros() as f64 / 1000.0 + delay.as_secs_f64() * 1e3));
    }
    let all = common::eventually(Duration::from_secs(30), || async {
        let started = started.lock().unwrap();
        due.iter().all(|(id, _)| started.contains_key(id)).then_some(())
    })
    .await;
    shutdown.cancel();
    worker_thread.join().unwrap();
    dispatcher.join().unwrap();
    let started = started.lock().unwrap().clone();
    let mut late: Vec<f64> = due.iter().filter_map(|(id, at)| Some(started.get(id)? - at)).collect();
    late.sort_by(f64::total_cmp);
    let count = |over: f64| late.iter().filter(|l| **l > over).count();
    emit(json!({
        "scenario": "delay-lateness", "jobs": jobs, "seconds": seconds, "delay_ms": [200, 1000],
        "received": late.len(), "all_started": all.is_some(),
        "early": late.iter().filter(|l| **l < 0.0).count(), "over_50ms": count(50.0), "over_500ms": count(500.0),
        "min_ms": late.first().copied().map(round),
        "p50_ms": percentile(&late, 50.0).map(round), "p99_ms": percentile(&late, 99.0).map(round),
        "max_ms": late.last().copied().map(round),
    }));
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let which = args.first().cloned().unwrap_or_else(|| {
        "idempotency,dispatch,dispatch-latency,worker,latency,worker-memory,enqueue-bulk,burst,delay-lateness".into()
    });
    if std::env::var("RUST_LOG").is_ok() {
        conveyor_server::telemetry::init_logging(false);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        for scenario in which.split(',') {
            match scenario {
                "idempotency" => idempotency().await,
                "dispatch" => dispatch().await,
                "dispatch-latency" => dispatch_latency().await,
                "worker" => worker().await,
                "latency" => latency().await,
                "commit" => commit().await,
                "worker-memory" => worker_memory().await,
                "enqueue-bulk" => enqueue_bulk().await,
                "burst" => burst().await,
                "delay-lateness" => delay_lateness().await,
                other => panic!("unknown scenario {other}"),
            }
        }
    });
}
