//! Flow control against real PostgreSQL and Redis: each workspace's window of jobs in the workers' hands (and its
//! weight), the bound it puts on how long a flood can delay another workspace, and pauses that hold jobs durably.

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{TestApp, principal};
use conveyor_jobs::{
    Consumer, EnqueueOptions, FlowError, Handler, JobContext, JobError, JobKind, JobStatus, PauseScope, Worker,
    WorkerSettings, WorkspaceId,
};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

/// A job of fixed cost; the handler records the order in which jobs start.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Work {
    tag: String,
}

impl JobKind for Work {
    const KIND: &'static str = "test.work";
    const QUEUE: &'static str = "work";
}

/// Another kind on another queue, never paused in these tests.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Ping;

impl JobKind for Ping {
    const KIND: &'static str = "test.ping";
    const QUEUE: &'static str = "pings";
}

#[derive(Clone, Default)]
struct Starts(Arc<Mutex<Vec<String>>>);

impl Starts {
    fn all(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
}

struct Worked {
    starts: Starts,
    cost: Duration,
}

impl Handler<Work> for Worked {
    async fn handle(&self, job: Work, _: &mut JobContext) -> Result<Value, JobError> {
        self.starts.0.lock().unwrap().push(job.tag);
        tokio::time::sleep(self.cost).await;
        Ok(json!(null))
    }
}

struct Pong;

impl Handler<Ping> for Pong {
    async fn handle(&self, _: Ping, _: &mut JobContext) -> Result<Value, JobError> {
        Ok(json!("pong"))
    }
}

async fn worker(app: &TestApp, starts: &Starts, cost: Duration, concurrency: usize) -> Worker {
    worker_with(app, starts, cost, concurrency, conveyor_jobs::Metrics::new()).await
}

async fn worker_with(
    app: &TestApp,
    starts: &Starts,
    cost: Duration,
    concurrency: usize,
    metrics: conveyor_jobs::Metrics,
) -> Worker {
    Worker::builder(app.db.pool.clone(), Consumer::connect(&common::redis_url(), &app.redis_prefix).await.unwrap())
        .runtime_pool(app.db.runtime_pool.clone())
        .handle::<Work>(Worked { starts: starts.clone(), cost })
        .handle::<Ping>(Pong)
        .settings(WorkerSettings { concurrency, ..WorkerSettings::default() })
        .metrics(metrics)
        .build()
        .unwrap()
}

async fn dispatcher(app: &TestApp, window: u32, shutdown: &CancellationToken) {
    let dispatcher = common::test_dispatcher(app, &common::redis_url(), |v| {
        v.insert("CONVEYOR_DISPATCH_POLL".into(), "100ms".into());
        v.insert("CONVEYOR_DISPATCH_WINDOW".into(), window.to_string());
    })
    .await;
    common::run_dispatcher(dispatcher, shutdown);
}

async fn enqueue(app: &TestApp, ws: WorkspaceId, tag: &str, n: usize) -> Vec<conveyor_jobs::JobId> {
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
    let jobs: Vec<Work> = (0..n).map(|i| Work { tag: format!("{tag}-{i}") }).collect();
    let ids = conveyor_jobs::enqueue_many_tx(&mut tx, jobs.iter().map(|j| (j, EnqueueOptions::new()))).await.unwrap();
    tx.commit().await.unwrap();
    ids.into_iter().map(|e| e.id).collect()
}

/// Jobs of the workspace handed to workers and not ended, by status.
async fn in_flight(app: &TestApp, ws: WorkspaceId) -> i64 {
    let rows = app.db.rows("outbox_events", ws).await;
    rows.iter().filter(|e| e["status"] == "dispatching" || e["status"] == "dispatched").count() as i64
}

#[tokio::test]
async fn each_workspace_has_a_window_of_jobs_in_the_workers_hands_times_its_weight() {
    let app = TestApp::spawn().await;
    let (light, heavy) = (principal().workspace_id, principal().workspace_id);
    // A weight is operator data: set through the operator role.
    let operator = conveyor_jobs::connect_postgres(&app.db.operator_url, 2).await.unwrap();
    conveyor_jobs::set_workspace_weight(&operator, heavy, 3).await.unwrap();
    enqueue(&app, light, "light", 200).await;
    enqueue(&app, heavy, "heavy", 200).await;
    // No worker: nothing ends, so the relay fills each window and stops there.
    let shutdown = CancellationToken::new();
    dispatcher(&app, 10, &shutdown).await;
    let filled = common::eventually(Duration::from_secs(20), || async {
        let counts = (in_flight(&app, light).await, in_flight(&app, heavy).await);
        (counts == (10, 30)).then_some(counts)
    })
    .await;
    assert_eq!(filled, Some((10, 30)));
    // A few more sweeps change nothing: the rest waits in PostgreSQL, not in the stream.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!((in_flight(&app, light).await, in_flight(&app, heavy).await), (10, 30));
    let stream = common::redis_client(&common::redis_url()).await;
    let len: u64 = {
        use fred::prelude::StreamsInterface;
        stream.xlen(conveyor_jobs::RedisKeys::new(&app.redis_prefix).stream("work")).await.unwrap()
    };
    assert_eq!(len, 40);
    shutdown.cancel();
}

#[tokio::test]
async fn a_flooding_workspace_delays_another_ones_job_by_at_most_its_window() {
    const WINDOW: usize = 8;
    const CONCURRENCY: usize = 4;
    let app = TestApp::spawn().await;
    let (flood, light) = (principal().workspace_id, principal().workspace_id);
    enqueue(&app, flood, "flood", 2000).await;
    let shutdown = CancellationToken::new();
    dispatcher(&app, WINDOW as u32, &shutdown).await;
    let starts = Starts::default();
    let worker = worker(&app, &starts, Duration::from_millis(10), CONCURRENCY).await;
    tokio::spawn(worker.run(shutdown.clone(), Duration::from_secs(5)));
    common::eventually(Duration::from_secs(30), || async { (starts.all().len() >= 50).then_some(()) })
        .await
        .expect("the flood runs");

    let before = starts.all().len();
    let light_job = enqueue(&app, light, "light", 1).await[0];
    let done = conveyor_jobs::wait_for_job(&app.db.pool, light, light_job, Duration::from_secs(60)).await.unwrap();
    assert_eq!(done.status, JobStatus::Succeeded);
    let order = starts.all();
    let position = order.iter().position(|t| t == "light-0").expect("the light job ran");
    // Ahead of it: at most the flood's window (in the stream or running) and the jobs the workers had read, plus
    // the one relay round that may have been under way when it was committed.
    let flood_ahead = position - before;
    assert!(
        flood_ahead <= 2 * WINDOW + CONCURRENCY,
        "the light job started after {flood_ahead} more of the flood's jobs (window {WINDOW})"
    );
    let waiting = app.db.rows("outbox_events", flood).await.iter().filter(|e| e["status"] == "pending").count();
    assert!(waiting > 1000, "the flood's backlog waits in PostgreSQL ({waiting} jobs), not in the stream");
    shutdown.cancel();
}

#[tokio::test]
async fn paused_jobs_wait_durably_across_a_worker_restart_and_go_on_resume() {
    let app = TestApp::spawn().await;
    let (ws, other) = (principal().workspace_id, principal().workspace_id);
    // Pauses are operator data: set and lifted through the operator role.
    let operator = conveyor_jobs::connect_postgres(&app.db.operator_url, 2).await.unwrap();
    assert!(conveyor_jobs::pause(&operator, &PauseScope::kind::<Work>(), Some("maintenance")).await.unwrap());
    assert!(!conveyor_jobs::pause(&operator, &PauseScope::kind::<Work>(), None).await.unwrap(), "already paused");
    assert!(conveyor_jobs::pause(&operator, &PauseScope::workspace(other), None).await.unwrap());
    let pauses = conveyor_jobs::list_pauses(&app.db.runtime_pool).await.unwrap();
    assert_eq!(pauses.len(), 2);
    assert_eq!(pauses[0].kind.as_deref(), Some("test.work"));
    assert_eq!(pauses[0].reason.as_deref(), Some("maintenance"));

    let held = enqueue(&app, ws, "held", 20).await;
    let held_elsewhere = enqueue(&app, other, "elsewhere", 5).await;
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
    let ping = conveyor_jobs::enqueue_tx(&mut tx, &Ping, EnqueueOptions::new()).await.unwrap().id;
    tx.commit().await.unwrap();

    let shutdown = CancellationToken::new();
    dispatcher(&app, 0, &shutdown).await;
    let starts = Starts::default();
    let first = CancellationToken::new();
    tokio::spawn(worker(&app, &starts, Duration::ZERO, 4).await.run(first.clone(), Duration::from_secs(5)));
    // Another kind of the same workspace flows; the paused ones stay in the outbox.
    let pong = conveyor_jobs::wait_for_job(&app.db.pool, ws, ping, Duration::from_secs(30)).await.unwrap();
    assert_eq!(pong.status, JobStatus::Succeeded);
    tokio::time::sleep(Duration::from_millis(500)).await;
    for (workspace, job) in held.iter().map(|j| (ws, *j)).chain(held_elsewhere.iter().map(|j| (other, *j))) {
        let info = conveyor_jobs::get_job(&app.db.pool, workspace, job).await.unwrap().unwrap();
        assert_eq!(info.status, JobStatus::Queued, "held in the outbox");
    }
    assert!(starts.all().is_empty());

    // The worker restarts; the pause lives in PostgreSQL, not in any process.
    first.cancel();
    let starts = Starts::default();
    tokio::spawn(worker(&app, &starts, Duration::ZERO, 4).await.run(shutdown.clone(), Duration::from_secs(5)));
    assert!(conveyor_jobs::resume(&operator, &PauseScope::kind::<Work>()).await.unwrap());
    for job in &held {
        let done = conveyor_jobs::wait_for_job(&app.db.pool, ws, *job, Duration::from_secs(30)).await.unwrap();
        assert_eq!(done.status, JobStatus::Succeeded);
    }
    let mut order: Vec<usize> = starts.all().iter().map(|t| t.trim_start_matches("held-").parse().unwrap()).collect();
    assert_eq!(order.len(), 20, "each held job ran once");
    order.sort_unstable();
    order.dedup();
    assert_eq!(order.len(), 20);
    // The other workspace is still paused as a whole.
    let info = conveyor_jobs::get_job(&app.db.pool, other, held_elsewhere[0]).await.unwrap().unwrap();
    assert_eq!(info.status, JobStatus::Queued);
    assert!(conveyor_jobs::resume(&operator, &PauseScope::workspace(other)).await.unwrap());
    for job in &held_elsewhere {
        let done = conveyor_jobs::wait_for_job(&app.db.pool, other, *job, Duration::from_secs(30)).await.unwrap();
        assert_eq!(done.status, JobStatus::Succeeded);
    }
    assert!(conveyor_jobs::list_pauses(&app.db.runtime_pool).await.unwrap().is_empty());
    shutdown.cancel();
}

#[tokio::test]
async fn bad_flow_settings_are_refused_and_change_nothing() {
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    let operator = conveyor_jobs::connect_postgres(&app.db.operator_url, 2).await.unwrap();
    let empty = conveyor_jobs::pause(&operator, &PauseScope::default(), None).await;
    assert!(matches!(empty, Err(FlowError::EmptyScope)), "{empty:?}");
    for scope in [PauseScope::queue("no spaces"), PauseScope::kind_named("Bad Kind!")] {
        let refused = conveyor_jobs::pause(&operator, &scope, None).await;
        assert!(matches!(refused, Err(FlowError::InvalidName(_))), "{refused:?}");
    }
    let long = "r".repeat(501);
    let refused = conveyor_jobs::pause(&operator, &PauseScope::workspace(ws), Some(&long)).await;
    assert!(matches!(refused, Err(FlowError::OutOfRange(_))), "{refused:?}");
    for weight in [0, 1001] {
        let refused = conveyor_jobs::set_workspace_weight(&operator, ws, weight).await;
        assert!(matches!(refused, Err(FlowError::OutOfRange(_))), "{refused:?}");
    }
    assert!(conveyor_jobs::list_pauses(&app.db.runtime_pool).await.unwrap().is_empty());
    assert!(!conveyor_jobs::resume(&operator, &PauseScope::queue("work")).await.unwrap(), "nothing to lift");
    let mut owner = app.db.owner().await;
    let weights: Vec<(i32,)> =
        sqlx::query_as("SELECT weight FROM conveyor.workspace_weights").fetch_all(&mut owner).await.unwrap();
    assert!(weights.is_empty());
}

fn cli(app: &TestApp, args: &[&str]) -> std::process::Output {
    std::process::Command::new(common::conveyor_bin())
        .args(args)
        .env_clear()
        .envs(common::config_vars(&app.db, &app.redis_prefix))
        .output()
        .expect("run conveyor")
}

#[tokio::test]
async fn the_cli_pauses_lists_resumes_and_weighs() {
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    let ws_text = ws.0.to_string();
    let out = cli(&app, &["flow", "pause", "--kind", "test.work", "--workspace", &ws_text, "--reason", "migration"]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "paused");
    let listed = cli(&app, &["flow", "pauses"]);
    let line: Value = serde_json::from_slice(&listed.stdout).unwrap();
    assert_eq!((line["kind"].as_str(), line["reason"].as_str()), (Some("test.work"), Some("migration")));
    assert_eq!(line["workspace_id"], ws_text.as_str());
    assert_eq!(conveyor_jobs::list_pauses(&app.db.runtime_pool).await.unwrap().len(), 1);

    let empty = cli(&app, &["flow", "pause"]);
    assert!(!empty.status.success());
    assert!(String::from_utf8_lossy(&empty.stderr).contains("names a queue, a kind or a workspace"), "{empty:?}");
    let other_scope = cli(&app, &["flow", "resume", "--kind", "test.work"]);
    assert!(!other_scope.status.success(), "a resume lifts exactly the scope paused");
    assert!(cli(&app, &["flow", "resume", "--kind", "test.work", "--workspace", &ws_text]).status.success());
    assert!(conveyor_jobs::list_pauses(&app.db.runtime_pool).await.unwrap().is_empty());

    assert!(cli(&app, &["flow", "weight", "--workspace", &ws_text, "--weight", "4"]).status.success());
    let bad = cli(&app, &["flow", "weight", "--workspace", &ws_text, "--weight", "0"]);
    assert!(!bad.status.success());
    // A workspace's weight is its row: read in its context.
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
    let (weight,): (i32,) = sqlx::query_as("SELECT weight FROM conveyor.workspace_weights WHERE workspace_id = $1")
        .bind(ws.0)
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(weight, 4);
}

#[tokio::test]
async fn queue_wait_is_observed_by_workspace_class_light_or_backlogged() {
    const WINDOW: u32 = 4;
    let app = TestApp::spawn().await;
    let (flood, light) = (principal().workspace_id, principal().workspace_id);
    enqueue(&app, flood, "flood", 500).await;
    let shutdown = CancellationToken::new();
    dispatcher(&app, WINDOW, &shutdown).await;
    let metrics = conveyor_jobs::Metrics::new();
    let starts = Starts::default();
    let worker = worker_with(&app, &starts, Duration::from_millis(10), 2, metrics.clone()).await;
    tokio::spawn(worker.run(shutdown.clone(), Duration::from_secs(5)));
    common::eventually(Duration::from_secs(30), || async { (starts.all().len() >= 20).then_some(()) })
        .await
        .expect("the flood runs");

    // The light workspace's jobs (on their own queue, to tell them apart in the metric) fit in its window.
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, light).await.unwrap();
    let pings = conveyor_jobs::enqueue_many_tx(&mut tx, (0..3).map(|_| (&Ping, EnqueueOptions::new()))).await.unwrap();
    tx.commit().await.unwrap();
    for ping in &pings {
        let done = conveyor_jobs::wait_for_job(&app.db.pool, light, ping.id, Duration::from_secs(60)).await.unwrap();
        assert_eq!(done.status, JobStatus::Succeeded);
    }
    let waited =
        |queue: &str, class: &str| metrics.job_queue_wait.with_label_values(&[queue, class]).get_sample_count();
    assert_eq!(waited("pings", "light"), 3, "the light workspace's jobs are light");
    assert_eq!(waited("pings", "backlogged"), 0);
    assert!(waited("work", "backlogged") >= 20, "the flood's jobs are backlogged: {}", waited("work", "backlogged"));
    let waiting = app.db.rows("outbox_events", flood).await.iter().filter(|e| e["status"] == "pending").count();
    assert!(waiting > 100, "the flood still has a backlog ({waiting} jobs)");
    assert_eq!(waited("work", "light"), 0, "a workspace with more due than its window is never light");
    assert_eq!(waited("work", "unknown") + waited("pings", "unknown"), 0, "every entry has its class");
    shutdown.cancel();
}

/// A job's queue wait counts from when it fell due: a retry backing off, or a delayed job, waits on purpose until then
/// (the relay writes the entry's `due_at` when that is later than the commit). Before, it counted from the commit, so
/// delayed jobs and retries of old jobs inflated `conveyor_job_queue_wait_seconds` and paged ConveyorQueueWaitHigh.
#[tokio::test]
async fn queue_wait_counts_from_when_the_job_fell_due_not_from_its_commit() {
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    // A job committed two hours ago that fell due just now, as a retry of an old job after its back-off.
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
    let ping = conveyor_jobs::enqueue_tx(&mut tx, &Ping, EnqueueOptions::new().delay(Duration::from_secs(3600)))
        .await
        .unwrap();
    sqlx::query(
        "UPDATE conveyor.outbox_events SET created_at = now() - interval '2 hours', next_attempt_at = now() WHERE id = $1",
    )
    .bind(ping.id.0)
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let shutdown = CancellationToken::new();
    dispatcher(&app, 0, &shutdown).await;
    let metrics = conveyor_jobs::Metrics::new();
    let worker = worker_with(&app, &Starts::default(), Duration::ZERO, 1, metrics.clone()).await;
    tokio::spawn(worker.run(shutdown.clone(), Duration::from_secs(5)));
    let done = conveyor_jobs::wait_for_job(&app.db.pool, ws, ping.id, Duration::from_secs(60)).await.unwrap();
    assert_eq!(done.status, JobStatus::Succeeded);
    let waited = metrics.job_queue_wait.with_label_values(&["pings", "light"]);
    assert_eq!(waited.get_sample_count(), 1);
    assert!(
        waited.get_sample_sum() < 600.0,
        "waited {} s: counted from its commit two hours ago",
        waited.get_sample_sum()
    );
    shutdown.cancel();
}

#[tokio::test]
async fn three_dispatchers_relaying_one_flood_never_hand_out_more_than_its_window() {
    const WINDOW: i64 = 10;
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    let ids = enqueue(&app, ws, "flood", 600).await;
    let shutdown = CancellationToken::new();
    for _ in 0..3 {
        dispatcher(&app, WINDOW as u32, &shutdown).await;
    }
    // More slots than the window, and short jobs: the window is what holds the relays back, and it reopens often, each
    // end waking all three at once.
    let starts = Starts::default();
    tokio::spawn(
        worker(&app, &starts, Duration::from_millis(10), 16).await.run(shutdown.clone(), Duration::from_secs(5)),
    );
    let (mut samples, mut most) = (0, 0);
    let last = *ids.last().unwrap();
    let give_up = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
        let (in_flight, left): (i64, i64) = sqlx::query_as(
            "SELECT count(*) FILTER (WHERE status = 'dispatching' AND locked_until > now() OR status = 'dispatched'),
                    count(*) FILTER (WHERE status <> 'completed')
             FROM conveyor.outbox_events",
        )
        .fetch_one(&mut *tx)
        .await
        .unwrap();
        tx.commit().await.unwrap();
        samples += 1;
        most = most.max(in_flight);
        if left == 0 {
            break;
        }
        assert!(std::time::Instant::now() < give_up, "the flood drained within 120 s");
    }
    assert_eq!(conveyor_jobs::get_job(&app.db.pool, ws, last).await.unwrap().unwrap().status, JobStatus::Succeeded);
    eprintln!("{samples} samples of the jobs in the workers' hands: at most {most} (window {WINDOW})");
    assert!(most <= WINDOW, "at most {most} jobs were in the workers' hands at once; the window is {WINDOW}");
    assert_eq!(starts.all().len(), 600);
    shutdown.cancel();
}
