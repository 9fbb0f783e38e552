//! The platform's benchmarks, run with `cargo bench --bench conveyor -- <scenario>[,<scenario>…]` (scripts/bench runs
//! them beside BullMQ's reference on the same Redis and prints the ratios). Each scenario prints one JSON line. They
//! use the platform's public API alone, with a job kind of their own (`kit::Job`); the shipped processes' benchmarks
//! (idempotent requests over HTTP, a real worker process's memory) are the server's, in `server/benches/server.rs`.
//!
//! - `dispatch`: drains a backlog of N outbox events spread over 100 workspaces into the streams; events per second.
//! - `dispatch-latency`: commits events at RATE/s for SECONDS while a dispatcher runs; commit to `XADD` p50/p99.
//! - `worker`: drains a backlog of N jobs with a no-op handler at concurrency CONC; jobs per second and the process's
//!   CPU per job. The jobs are real: committed into the outbox and relayed into the stream before the worker starts,
//!   so its pre-run checks and recorded ends touch their rows as a production drain does.
//! - `latency`: commits jobs at RATE/s for SECONDS through dispatcher and worker; commit to handler start p50/p99.
//! - `commit`: the same enqueue transactions at the same rate with nothing relaying them: the durable commit's own
//!   p50/p99 on this machine, the floor under `latency`'s figure measured from the moment COMMIT is sent.
//! - `enqueue-bulk`: N jobs written into the outbox by `enqueue_many_tx`, 50 per transaction (BullMQ's `add-bulk`
//!   batch), one transaction after the other, commit included, nothing relaying them; jobs per second.
//! - `burst`: N jobs enqueued as in `enqueue-bulk` while a dispatcher and a worker (concurrency CONC, no-op handler)
//!   run, each on a runtime of its own; jobs per second from the first enqueue to the last job's end recorded, and
//!   where the time went (enqueue done, last `XADD`, last handler start, last end recorded); the CPU per job of each
//!   process (the enqueuing client, dispatcher, worker, PostgreSQL, Redis) and what PostgreSQL wrote per job
//!   (commits, row versions, WAL; statements with `pg_stat_statements`).
//! - `delay-lateness`: at idle, JOBS jobs enqueued one at a time over SECONDS, each with a delay of 200 to 1000 ms;
//!   lateness (handler start minus due time, due = the enqueue transaction's `now()` plus the delay) p50/p99/max.
//!
//! `commit` and `latency` also say what the callers' COMMITs waited on (`commit_waits`: the share of each
//! `pg_stat_activity` wait event among COMMITs seen running, sampled every 5 ms through CONVEYOR_BENCH_MONITOR_URL).
//!
//! Environment: N (default 100000), CONC (100), RATE (1000), SECONDS (10), JOBS (300), WORKSPACES (`burst`, 1),
//! DISPATCH_POLL_MS (the dispatcher's sweep interval), and the tests' database and Redis variables
//! (`CONVEYOR_TEST_*_URL`).

#[path = "../tests/kit/mod.rs"]
mod kit;

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use conveyor_jobs::{EnqueueOptions, Handler, JobContext, JobError, Metrics, Worker, WorkerSettings, WorkspaceId};
use kit::report::{emit, env, now_ms, percentile, process_cpu_seconds, round};
use kit::{Job, Platform};
use serde_json::json;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// The allocator of the `conveyor` binary, so that what runs here in-process allocates as the shipped processes do.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The de-dup keys of a benchmark's hand-offs expire soon after it (four leases, the least allowed): left for the
/// default 24 h, a session's runs piled millions of keys into the shared Redis and slowed later runs.
const BENCH_DEDUP_TTL: Duration = Duration::from_secs(120);

/// The stream the benchmarks' jobs go to.
fn stream(platform: &Platform) -> String {
    platform.keys().stream(<Job as conveyor_jobs::JobKind>::QUEUE)
}

/// A job of the benchmarks' kind, committed now.
fn job() -> Job {
    Job { tenant: 0, at_ms: now_ms() }
}

/// Commits `per_workspace` events in each of `workspaces` workspaces, in batches of 1000 per transaction, written by
/// one `INSERT … SELECT` each (the relay's benchmark measures the relay, not the enqueue).
async fn backlog(platform: &Platform, workspaces: usize, per_workspace: usize) {
    for _ in 0..workspaces {
        let ws = WorkspaceId(Uuid::new_v4());
        let mut left = per_workspace;
        while left > 0 {
            let n = left.min(1000);
            let mut tx = conveyor_jobs::begin_workspace(&platform.pool, ws).await.unwrap();
            sqlx::query(
                "INSERT INTO conveyor.outbox_events (id, workspace_id, queue, event_type, event_payload)
                 SELECT gen_random_uuid(), $1, 'bench', 'bench.job', jsonb_build_object('tenant', 0, 'at_ms', 0)
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

/// The settings of a dispatcher of these benchmarks: `window` (`None`: the default, or `DISPATCH_WINDOW`), and
/// `DISPATCH_CONCURRENCY` / `DISPATCH_BATCH` / `DISPATCH_QUEUE_WAIT_MS` (the queue gate; 0: off) when set. Scenarios
/// without a worker relay with no window (0): nothing ends there, so a window would stop the relay once full.
fn bench_settings(window: Option<i32>) -> impl FnOnce(&mut conveyor_jobs::DispatcherSettings) {
    move |s| {
        s.dedup_ttl = BENCH_DEDUP_TTL;
        s.dedup_ttl_recorded = s.dedup_ttl_recorded.min(BENCH_DEDUP_TTL);
        if let Ok(c) = std::env::var("DISPATCH_CONCURRENCY") {
            s.concurrency = c.parse().expect("DISPATCH_CONCURRENCY is a number");
        }
        if let Ok(p) = std::env::var("DISPATCH_POLL_MS") {
            s.poll_interval = Duration::from_millis(p.parse().unwrap());
        }
        if let Ok(w) = std::env::var("DISPATCH_QUEUE_WAIT_MS") {
            s.queue_wait = Duration::from_millis(w.parse().expect("DISPATCH_QUEUE_WAIT_MS is a number"));
        }
        if let Ok(b) = std::env::var("DISPATCH_BATCH") {
            s.batch_size = b.parse().expect("DISPATCH_BATCH is a number");
        }
        let from_env = std::env::var("DISPATCH_WINDOW").ok().map(|w| w.parse().expect("DISPATCH_WINDOW is a number"));
        if let Some(w) = window.or(from_env) {
            s.window = w;
        }
    }
}

/// Relays every due outbox row of `platform` into the streams, in the caller's task; how many.
async fn relay_all(platform: &Platform) -> u64 {
    let dispatcher = platform.dispatcher(bench_settings(Some(0))).await;
    let mut dispatched = 0;
    while let conveyor_jobs::DispatchOutcome::Worked(s) = dispatcher.dispatch_once().await.unwrap() {
        dispatched += s.dispatched;
    }
    dispatched
}

async fn dispatch() {
    let n = env("N", 100_000) as usize;
    let platform = Platform::new(8).await;
    backlog(&platform, 100, n / 100).await;
    sqlx::query("ANALYZE conveyor.outbox_events").execute(&mut platform.owner().await).await.unwrap();
    let started = Instant::now();
    let dispatched = relay_all(&platform).await;
    let elapsed = started.elapsed().as_secs_f64();
    assert_eq!(dispatched as usize, n / 100 * 100);
    emit(
        json!({ "scenario": "dispatch", "n": dispatched, "workspaces": 100, "per_s": (dispatched as f64 / elapsed).round() }),
    );
}

/// The URL of a role that reads every session's activity and statistics: CONVEYOR_BENCH_MONITOR_URL, by default the
/// local `postgres` superuser.
fn monitor_url() -> String {
    std::env::var("CONVEYOR_BENCH_MONITOR_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// The name of `platform`'s database.
fn database_of(platform: &Platform) -> String {
    platform.owner_url.rsplit_once('/').expect("a database URL").1.to_owned()
}

/// What the callers' COMMITs wait on while `stop` is not cancelled: `pg_stat_activity` sampled every 5 ms for the
/// sessions of `platform`'s database that run `COMMIT`, as the share of those sightings per wait event (`CPU` when
/// it waits on nothing). Reading other roles' wait events needs a superuser or `pg_monitor`:
/// `CONVEYOR_BENCH_MONITOR_URL` (default the local `postgres`); `null`, with the reason, when it cannot connect.
fn sample_commit_waits(platform: &Platform, stop: CancellationToken) -> tokio::task::JoinHandle<serde_json::Value> {
    let (database, url) = (database_of(platform), monitor_url());
    tokio::spawn(async move {
        use sqlx::Connection;
        let mut monitor = match sqlx::PgConnection::connect(&url).await {
            Ok(c) => c,
            Err(e) => return json!({ "unavailable": format!("CONVEYOR_BENCH_MONITOR_URL: {e}") }),
        };
        let mut seen: HashMap<String, u64> = HashMap::new();
        let mut total = 0u64;
        while !stop.is_cancelled() {
            let waits: Vec<String> = sqlx::query_scalar(
                "SELECT coalesce(wait_event_type || ':' || wait_event, 'CPU') FROM pg_stat_activity
                 WHERE datname = $1 AND state = 'active' AND query = 'COMMIT'",
            )
            .bind(&database)
            .fetch_all(&mut monitor)
            .await
            .unwrap_or_default();
            for wait in waits {
                total += 1;
                *seen.entry(wait).or_default() += 1;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let mut shares: Vec<(String, u64)> = seen.into_iter().collect();
        shares.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
        let top: serde_json::Map<String, serde_json::Value> =
            shares.into_iter().take(6).map(|(k, n)| (k, json!(round(n as f64 / total.max(1) as f64)))).collect();
        json!({ "sightings": total, "share": top })
    })
}

/// Commits one job per transaction at `rate`/s for `seconds`, over 10 workspaces, after a warm-up of
/// `WARMUP_SECONDS` (default 2) at the same rate whose jobs are not counted: a running service has its connections
/// open and its pages in memory, while a fresh database starts cold. Returns, per measured job, its id, the wall-clock
/// time (ms since the epoch) at which its COMMIT was sent, and the time at which it returned.
async fn steady_commits(platform: &Platform, rate: u64, seconds: u64) -> Vec<(Uuid, f64, f64)> {
    let workspaces: Vec<WorkspaceId> = (0..10).map(|_| WorkspaceId(Uuid::new_v4())).collect();
    let pool = conveyor_jobs::connect_postgres(&platform.app_url, 32).await.unwrap();
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
            let id = conveyor_jobs::enqueue_tx(&mut tx, &job(), EnqueueOptions::new()).await.unwrap().id.0;
            let sent = now_ms();
            tx.commit().await.unwrap();
            (id, sent, now_ms())
        }));
    }
    let mut committed = Vec::with_capacity(total);
    for t in tasks {
        committed.push(t.await.unwrap());
    }
    committed
}

/// Runs `task` on a runtime of its own, in a thread of its own, as a process of its own would run it: not behind the
/// load generator's tasks. `one_thread` as the `conveyor dispatcher` process runs.
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

/// A dispatcher over `platform`'s database and prefix with the fairness window `window` (`None`: the default, or
/// `DISPATCH_WINDOW`), on a runtime of its own, running until `shutdown`.
fn spawn_dispatcher(
    platform: &Platform,
    shutdown: CancellationToken,
    window: Option<i32>,
) -> std::thread::JoinHandle<()> {
    let (url, prefix) = (platform.runtime_url.clone(), platform.prefix.clone());
    on_own_runtime("dispatcher", true, async move {
        let dispatcher = kit::dispatcher_on(&url, &prefix, bench_settings(window)).await;
        dispatcher.run(shutdown).await.unwrap();
    })
}

async fn dispatch_latency() {
    let (rate, seconds) = (env("RATE", 1000), env("SECONDS", 10));
    let platform = Platform::new(8).await;
    let shutdown = CancellationToken::new();
    let dispatcher = spawn_dispatcher(&platform, shutdown.clone(), Some(0));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let committed = steady_commits(&platform, rate, seconds).await;
    let total = committed.len();
    let drained = kit::eventually(Duration::from_secs(60), || async {
        let rows: Vec<(String, i64)> = sqlx::query_as("SELECT status, events FROM conveyor.conveyor_outbox_backlog()")
            .fetch_all(&platform.runtime_pool)
            .await
            .unwrap();
        rows.iter().all(|(status, n)| status == "dead_letter" || *n == 0).then_some(())
    })
    .await;
    assert!(drained.is_some(), "the dispatcher kept up");
    // Commit (when the enqueue transaction's COMMIT returned) to XADD (the entry id's millisecond timestamp).
    let rows: Vec<(Uuid, String)> =
        sqlx::query_as("SELECT id, stream_id FROM conveyor.outbox_events WHERE status = 'dispatched'")
            .fetch_all(&mut platform.owner().await)
            .await
            .unwrap();
    let added: HashMap<Uuid, f64> =
        rows.into_iter().map(|(id, sid)| (id, sid.split('-').next().unwrap().parse::<f64>().unwrap())).collect();
    let latencies: Vec<f64> = committed.iter().filter_map(|(id, _, at)| added.get(id).map(|x| x - at)).collect();
    shutdown.cancel();
    dispatcher.join().unwrap();
    // The entry id has millisecond resolution: a latency under a millisecond can read as slightly negative.
    let mut ms: Vec<f64> = latencies.into_iter().map(|l| l.max(0.0)).collect();
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

impl Handler<Job> for Noop {
    async fn handle(&self, _job: Job, cx: &mut JobContext) -> Result<serde_json::Value, JobError> {
        if let Some(started) = &self.started {
            started.lock().unwrap().entry(cx.id().0).or_insert(now_ms());
        }
        if let Some(starts) = &self.starts {
            starts.last_us.fetch_max(chrono::Utc::now().timestamp_micros(), Ordering::Relaxed);
            starts.count.fetch_add(1, Ordering::Relaxed);
        }
        Ok(serde_json::Value::Null)
    }
}

/// A worker of the benchmarks' kind at `concurrency` on the application role's `pool`, its bookkeeping as the
/// runtime role on the same database.
async fn noop_worker(pool: PgPool, runtime_url: &str, prefix: &str, concurrency: usize, handler: Noop) -> Worker {
    let runtime = conveyor_jobs::connect_postgres(runtime_url, 4).await.unwrap();
    Worker::builder(pool, kit::consumer_on(prefix, "bench").await)
        .runtime_pool(runtime)
        .handle::<Job>(handler)
        .settings(WorkerSettings { concurrency, ..WorkerSettings::default() })
        .metrics(Metrics::new())
        .build()
        .unwrap()
}

/// A no-op worker at `concurrency` over `platform`'s database and prefix, on a multi-threaded runtime of its own (as
/// the `conveyor worker` process runs, with its default pool of 16 connections), running until `shutdown`. Returns
/// once its consumer groups exist.
fn spawn_worker(
    platform: &Platform,
    concurrency: usize,
    handler: Noop,
    shutdown: CancellationToken,
) -> std::thread::JoinHandle<()> {
    let (url, runtime_url, prefix) = (platform.app_url.clone(), platform.runtime_url.clone(), platform.prefix.clone());
    let (ready_tx, ready) = std::sync::mpsc::channel();
    let thread = on_own_runtime("worker", false, async move {
        let pool = conveyor_jobs::connect_postgres(&url, 16).await.unwrap();
        let worker = noop_worker(pool, &runtime_url, &prefix, concurrency, handler).await;
        worker.ensure_groups().await.unwrap();
        ready_tx.send(()).unwrap();
        worker.run(shutdown, Duration::from_secs(10)).await.unwrap();
    });
    ready.recv().unwrap();
    thread
}

/// Waits until the benchmarks' stream is empty: every entry acknowledged (and deleted), which the worker does only
/// after recording the job's end.
async fn until_stream_empty(platform: &Platform, clock: Instant, limit: Duration) {
    use fred::prelude::StreamsInterface;
    let (redis, stream) = (kit::redis().await, stream(platform));
    loop {
        let len: u64 = redis.xlen(&stream).await.unwrap();
        if len == 0 {
            return;
        }
        assert!(clock.elapsed() < limit, "{len} entries still in the stream");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// How many of `platform`'s jobs have their end recorded as completed, and the latest end.
async fn completed(platform: &Platform) -> (i64, Option<chrono::DateTime<chrono::Utc>>) {
    sqlx::query_as("SELECT count(*), max(finished_at) FROM conveyor.outbox_events WHERE status = 'completed'")
        .fetch_one(&mut platform.owner().await)
        .await
        .unwrap()
}

/// The drain of a real backlog: N jobs committed into the outbox over 100 workspaces and relayed into the stream
/// before the worker starts (both untimed), then run to their recorded ends by one worker on this runtime.
async fn worker() {
    let (n, conc) = (env("N", 100_000) as usize, env("CONC", 100) as usize);
    let platform = Platform::new(16).await;
    let starts = Arc::new(Starts::default());
    let handler = Noop { started: None, starts: Some(starts.clone()) };
    let worker = noop_worker(platform.pool.clone(), &platform.runtime_url, &platform.prefix, conc, handler).await;
    worker.ensure_groups().await.unwrap();
    backlog(&platform, 100, n / 100).await;
    let n = relay_all(&platform).await as usize;
    assert_eq!(n, env("N", 100_000) as usize / 100 * 100, "the whole backlog was relayed");
    let shutdown = CancellationToken::new();
    let started = Instant::now();
    let cpu_before = process_cpu_seconds();
    let handle = tokio::spawn(worker.run(shutdown.clone(), Duration::from_secs(10)));
    until_stream_empty(&platform, started, Duration::from_secs(600)).await;
    let elapsed = started.elapsed().as_secs_f64();
    let cpu = process_cpu_seconds() - cpu_before;
    shutdown.cancel();
    handle.await.unwrap().unwrap();
    // Every job ran its handler and has its end recorded: a drain of skipped entries would measure nothing a user
    // asked for.
    assert_eq!(starts.count.load(Ordering::Relaxed), n, "every relayed job ran");
    assert_eq!(completed(&platform).await.0 as usize, n, "every job's end is recorded");
    emit(json!({
        "scenario": "worker", "n": n, "concurrency": conc, "workspaces": 100, "per_s": (n as f64 / elapsed).round(),
        "cpu_us_per_job": round(cpu * 1e6 / n as f64),
    }));
}

async fn latency() {
    let (rate, seconds, conc) = (env("RATE", 1000), env("SECONDS", 10), env("CONC", 100) as usize);
    let platform = Platform::new(8).await;
    let started = Arc::new(Mutex::new(HashMap::new()));
    let shutdown = CancellationToken::new();
    let handler = Noop { started: Some(started.clone()), ..Noop::default() };
    let worker_thread = spawn_worker(&platform, conc, handler, shutdown.clone());
    let dispatcher = spawn_dispatcher(&platform, shutdown.clone(), None);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let sampling = CancellationToken::new();
    let waits = sample_commit_waits(&platform, sampling.clone());
    let committed = steady_commits(&platform, rate, seconds).await;
    sampling.cancel();
    let commit_waits = waits.await.unwrap();
    let total = committed.len();
    let all = kit::eventually(Duration::from_secs(60), || async {
        let started = started.lock().unwrap();
        committed.iter().all(|(id, _, _)| started.contains_key(id)).then_some(())
    })
    .await;
    assert!(all.is_some(), "every committed job started within a minute");
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
            .fetch_all(&mut platform.owner().await)
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
        "max_ms": ms.last().copied().map(round), "commit_waits": commit_waits,
    }));
}

async fn commit() {
    let (rate, seconds) = (env("RATE", 1000), env("SECONDS", 10));
    let platform = Platform::new(8).await;
    let sampling = CancellationToken::new();
    let waits = sample_commit_waits(&platform, sampling.clone());
    let committed = steady_commits(&platform, rate, seconds).await;
    sampling.cancel();
    let mut commit: Vec<f64> = committed.iter().map(|(_, sent, done)| done - sent).collect();
    commit.sort_by(f64::total_cmp);
    emit(json!({
        "scenario": "commit", "rate_per_s": rate, "seconds": seconds, "warmup_s": env("WARMUP_SECONDS", 2),
        "sent": commit.len(), "commit_p50_ms": percentile(&commit, 50.0).map(round),
        "commit_p99_ms": percentile(&commit, 99.0).map(round), "max_ms": commit.last().copied().map(round),
        "commit_waits": waits.await.unwrap(),
    }));
}

/// Jobs per transaction in `enqueue-bulk` and `burst`: the batch of BullMQ's `add-bulk` and `burst` (`addBulk` of 50,
/// one call after the other, in both references).
const BULK_BATCH: usize = 50;

/// Enqueues `n` jobs with `enqueue_many_tx`, [`BULK_BATCH`] per transaction, one transaction after the other (each
/// begun, written and committed before the next), round-robin over `workspaces`. Returns each transaction's duration
/// in ms, begin to commit.
async fn enqueue_in_bulk(pool: &PgPool, workspaces: &[WorkspaceId], n: usize) -> Vec<f64> {
    let mut took = Vec::with_capacity(n.div_ceil(BULK_BATCH));
    let mut left = n;
    while left > 0 {
        let t = Instant::now();
        let jobs: Vec<Job> = (0..left.min(BULK_BATCH)).map(|_| job()).collect();
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
    let platform = Platform::new(8).await;
    let workspace = [WorkspaceId(Uuid::new_v4())];
    let started = Instant::now();
    let mut took = enqueue_in_bulk(&platform.pool, &workspace, n).await;
    let elapsed = started.elapsed().as_secs_f64();
    let (written,): (i64,) = sqlx::query_as("SELECT count(*) FROM conveyor.outbox_events")
        .fetch_one(&mut platform.owner().await)
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

/// The id Redis gave the stream's last `XADD`, as ms since the epoch (its clock, this machine's): it stays when the
/// entries are acknowledged and deleted.
async fn last_xadd_ms(platform: &Platform) -> Option<f64> {
    use fred::prelude::StreamsInterface;
    let info: HashMap<String, fred::prelude::Value> =
        kit::redis().await.xinfo_stream(stream(platform), false, None).await.unwrap();
    info.get("last-generated-id")?.as_string()?.split('-').next()?.parse().ok()
}

/// Deadlocks detected in `platform`'s database so far (`pg_stat_database`).
async fn database_deadlocks(platform: &Platform) -> i64 {
    sqlx::query_scalar("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
        .fetch_one(&mut platform.owner().await)
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
    let platform = Platform::new(8).await;
    let starts = Arc::new(Starts::default());
    let shutdown = CancellationToken::new();
    let handler = Noop { starts: Some(starts.clone()), ..Noop::default() };
    let worker_thread = spawn_worker(&platform, conc, handler, shutdown.clone());
    let dispatcher = spawn_dispatcher(&platform, shutdown.clone(), None);
    // The dispatcher LISTENs before the first commit (else the first jobs would wait for its first poll).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let deadlocks_before = database_deadlocks(&platform).await;
    flush_statistics(&platform.pool).await;
    let (cpu_before, written_before) = (Cpu::read().await, Written::read(&platform).await);
    let cpu_before_process = process_cpu_seconds();
    let clock = Instant::now();
    let t0 = now_ms();
    let mut took = enqueue_in_bulk(&platform.pool, &workspaces, n).await;
    let t1 = now_ms();
    let limit = Duration::from_secs(600);
    while starts.count.load(Ordering::Relaxed) < n {
        assert!(clock.elapsed() < limit, "only {} of {n} jobs started", starts.count.load(Ordering::Relaxed));
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    until_stream_empty(&platform, clock, limit).await;
    let t3 = now_ms();
    let cpu = process_cpu_seconds() - cpu_before_process;
    // Before the worker's and the dispatcher's threads end (their CPU time goes with them).
    let cpu_by_process = Cpu::read().await.since(&cpu_before, n);
    shutdown.cancel();
    worker_thread.join().unwrap();
    dispatcher.join().unwrap();
    let t2 = last_xadd_ms(&platform).await.unwrap();
    // Deadlocks PostgreSQL broke in this database during the run (each one after `deadlock_timeout`, 1 s by default):
    // a backend flushes its counters at exit, and the worker's and the dispatcher's have just been closed.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let deadlocks = database_deadlocks(&platform).await - deadlocks_before;
    // The worker's and the dispatcher's backends flushed their counters at exit; the enqueuing pools' idle ones are
    // told to.
    flush_statistics(&platform.pool).await;
    flush_statistics(&platform.runtime_pool).await;
    let written = Written::read(&platform).await.since(&written_before, n);
    let last_start = starts.last_us.load(Ordering::Relaxed) as f64 / 1000.0;
    let (completed, last_end) = completed(&platform).await;
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
        "cpu_us_per_job_by_process": cpu_by_process, "postgres_per_job": written,
    }));
}

/// CPU seconds spent so far, by process: this one's threads by role (the dispatcher's and the worker's runtimes run on
/// threads named after them; the rest, `client`, is the enqueuing side with the benchmark's own polling; threads that
/// ended before the reading, as idle blocking threads, are not counted), every PostgreSQL process of this machine (with the
/// children it reaped: backends that exited), and Redis (`INFO cpu`). The database and Redis must run here, on loopback,
/// and serve nothing else meanwhile, as on the benchmark machine.
struct Cpu {
    threads: HashMap<String, f64>,
    postgres: Option<f64>,
    redis: Option<f64>,
}

impl Cpu {
    async fn read() -> Self {
        let mut threads: HashMap<String, f64> = HashMap::new();
        for task in std::fs::read_dir("/proc/self/task").into_iter().flatten().flatten() {
            if let Some((name, seconds)) = proc_stat_cpu(&task.path().join("stat"), false) {
                let role = if name == "dispatcher" || name == "worker" { name } else { "client".to_owned() };
                *threads.entry(role).or_default() += seconds;
            }
        }
        let mut postgres = None;
        for process in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            if let Some((name, seconds)) = proc_stat_cpu(&process.path().join("stat"), true)
                && name == "postgres"
            {
                *postgres.get_or_insert(0.0) += seconds;
            }
        }
        use fred::prelude::ClientLike;
        let info: Option<String> = kit::redis().await.custom(fred::cmd!("INFO"), vec!["cpu"]).await.ok();
        let redis = info.map(|info| {
            info.lines()
                .filter_map(|l| l.split_once(':'))
                .filter(|(k, _)| *k == "used_cpu_sys" || *k == "used_cpu_user")
                .filter_map(|(_, v)| v.trim().parse::<f64>().ok())
                .sum()
        });
        Self { threads, postgres, redis }
    }

    /// Microseconds per job of each, from `before` to now.
    fn since(&self, before: &Self, jobs: usize) -> serde_json::Value {
        let per_job = |now: f64, then: f64| round((now - then) * 1e6 / jobs as f64);
        let mut out = serde_json::Map::new();
        for (role, now) in &self.threads {
            out.insert(role.clone(), json!(per_job(*now, before.threads.get(role).copied().unwrap_or(0.0))));
        }
        out.insert("postgres".into(), json!(self.postgres.zip(before.postgres).map(|(n, b)| per_job(n, b))));
        out.insert("redis".into(), json!(self.redis.zip(before.redis).map(|(n, b)| per_job(n, b))));
        serde_json::Value::Object(out)
    }
}

/// A process's or thread's name and CPU seconds (user and system; with `children`, plus those of the children it
/// waited for) from its `stat` file; `None` when it is gone or unreadable.
fn proc_stat_cpu(path: &std::path::Path, children: bool) -> Option<(String, f64)> {
    let stat = std::fs::read_to_string(path).ok()?;
    let (head, rest) = stat.rsplit_once(')')?;
    let name = head.split_once('(')?.1.to_owned();
    let fields: Vec<f64> = rest.split_whitespace().skip(11).take(4).filter_map(|f| f.parse().ok()).collect();
    let ticks = if children { fields.iter().sum() } else { fields.iter().take(2).sum::<f64>() };
    Some((name, ticks / 100.0))
}

/// Has every open connection of `pool` flush its statistics, which an idle backend otherwise keeps for up to 10 s.
async fn flush_statistics(pool: &PgPool) {
    let mut held = Vec::new();
    for _ in 0..pool.size() {
        let mut connection = pool.acquire().await.unwrap();
        sqlx::query("SELECT pg_stat_force_next_flush()").execute(&mut *connection).await.unwrap();
        held.push(connection);
    }
}

/// What PostgreSQL wrote so far: WAL (the whole server's), and in this database transactions committed and row
/// versions inserted, updated (of which HOT, in the outbox) and deleted. Statements are counted with
/// `pg_stat_statements` only, when the server loads it (`shared_preload_libraries`).
struct Written {
    wal_records: f64,
    wal_bytes: f64,
    commits: f64,
    inserted: f64,
    updated: f64,
    deleted: f64,
    outbox_hot: f64,
    statements: Option<f64>,
}

impl Written {
    async fn read(platform: &Platform) -> Self {
        let mut owner = platform.owner().await;
        let (wal_records, wal_bytes): (f64, f64) =
            sqlx::query_as("SELECT wal_records::float8, wal_bytes::float8 FROM pg_stat_wal")
                .fetch_one(&mut owner)
                .await
                .unwrap();
        let (commits, inserted, updated, deleted): (f64, f64, f64, f64) = sqlx::query_as(
            "SELECT xact_commit::float8, tup_inserted::float8, tup_updated::float8, tup_deleted::float8
             FROM pg_stat_database WHERE datname = current_database()",
        )
        .fetch_one(&mut owner)
        .await
        .unwrap();
        let outbox_hot: f64 = sqlx::query_scalar(
            "SELECT coalesce(sum(n_tup_hot_upd), 0)::float8 FROM pg_stat_user_tables WHERE relname = 'outbox_events'",
        )
        .fetch_one(&mut owner)
        .await
        .unwrap();
        let statements = Self::statements(platform).await;
        Self { wal_records, wal_bytes, commits, inserted, updated, deleted, outbox_hot, statements }
    }

    /// Statements run in `platform`'s database so far, nested ones included when `pg_stat_statements.track = all`:
    /// read through CONVEYOR_BENCH_MONITOR_URL (a superuser's, which may create the extension's view in its own
    /// database; the benchmark's database has none), `None` when the server does not load the library.
    async fn statements(platform: &Platform) -> Option<f64> {
        use sqlx::Connection;
        let mut monitor = sqlx::PgConnection::connect(&monitor_url()).await.ok()?;
        sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements").execute(&mut monitor).await.ok()?;
        sqlx::query_scalar(
            "SELECT sum(calls)::float8 FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database WHERE datname = $1)",
        )
        .bind(database_of(platform))
        .fetch_one(&mut monitor)
        .await
        .ok()
        .flatten()
    }

    /// Per job, from `before` to now.
    fn since(&self, before: &Self, jobs: usize) -> serde_json::Value {
        // Three decimals: a commit per 50 jobs is 0.02.
        let per_job = |now: f64, then: f64| ((now - then) / jobs as f64 * 1000.0).round() / 1000.0;
        json!({
            "wal_bytes": per_job(self.wal_bytes, before.wal_bytes),
            "wal_records": per_job(self.wal_records, before.wal_records),
            "commits": per_job(self.commits, before.commits),
            "rows_inserted": per_job(self.inserted, before.inserted),
            "rows_updated": per_job(self.updated, before.updated),
            "outbox_hot_updates": per_job(self.outbox_hot, before.outbox_hot),
            "rows_deleted": per_job(self.deleted, before.deleted),
            "statements": self.statements.zip(before.statements).map(|(n, b)| per_job(n, b)),
        })
    }
}

/// Delayed jobs at idle: JOBS jobs, one per transaction, spread evenly over SECONDS, each due 200 to 1000 ms after
/// its transaction's `now()` (read in the same transaction, which is the time `delay` counts from); lateness is the
/// handler's start minus that due time.
async fn delay_lateness() {
    let (jobs, seconds, conc) = (env("JOBS", 300) as usize, env("SECONDS", 10), env("CONC", 100) as usize);
    let platform = Platform::new(8).await;
    let started = Arc::new(Mutex::new(HashMap::new()));
    let shutdown = CancellationToken::new();
    let handler = Noop { started: Some(started.clone()), ..Noop::default() };
    let worker_thread = spawn_worker(&platform, conc, handler, shutdown.clone());
    let dispatcher = spawn_dispatcher(&platform, shutdown.clone(), None);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let workspace = WorkspaceId(Uuid::new_v4());
    let clock = tokio::time::Instant::now();
    let mut due: Vec<(Uuid, f64)> = Vec::with_capacity(jobs);
    for i in 0..jobs {
        tokio::time::sleep_until(clock + Duration::from_secs_f64(i as f64 * seconds as f64 / jobs as f64)).await;
        // 389 and 801 are coprime: the delays go over every ms from 200 to 1000, not in order.
        let delay = Duration::from_millis(200 + (i as u64 * 389) % 801);
        let mut tx = conveyor_jobs::begin_workspace(&platform.pool, workspace).await.unwrap();
        let (now,): (chrono::DateTime<chrono::Utc>,) =
            sqlx::query_as("SELECT now()").fetch_one(&mut *tx).await.unwrap();
        let id = conveyor_jobs::enqueue_tx(&mut tx, &job(), EnqueueOptions::new().delay(delay)).await.unwrap().id.0;
        tx.commit().await.unwrap();
        due.push((id, now.timestamp_micros() as f64 / 1000.0 + delay.as_secs_f64() * 1e3));
    }
    let all = kit::eventually(Duration::from_secs(30), || async {
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
    let which = args
        .first()
        .cloned()
        .unwrap_or_else(|| "dispatch,dispatch-latency,worker,latency,enqueue-bulk,burst,delay-lateness".into());
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        for scenario in which.split(',') {
            match scenario {
                "dispatch" => dispatch().await,
                "dispatch-latency" => dispatch_latency().await,
                "worker" => worker().await,
                "latency" => latency().await,
                "commit" => commit().await,
                "enqueue-bulk" => enqueue_bulk().await,
                "burst" => burst().await,
                "delay-lateness" => delay_lateness().await,
                other => panic!("unknown scenario {other} (the server's are in server/benches/server.rs)"),
            }
        }
    });
}
