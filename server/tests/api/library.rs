//! Conveyor as a library: kinds defined outside the crate, enqueue in the caller's transaction with options, job
//! control, the SQL enqueue function for other languages, bad input. Real PostgreSQL, Redis and processes.

use crate::common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use common::{TestApp, principal};
use conveyor_jobs::{
    CancelError, Consumer, EnqueueError, EnqueueOptions, Handler, JobContext, JobError, JobId, JobKind, JobStatus,
    Priority, WaitError, Worker, WorkerSettings, WorkspaceId,
};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// A kind defined here, outside the crate, as another service would.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Greet {
    name: String,
    /// How the handler behaves: "ok", "fail", "slow" (runs until canceled).
    mode: String,
}

impl JobKind for Greet {
    const KIND: &'static str = "test.greet";
    const QUEUE: &'static str = "greetings";
    const MAX_ATTEMPTS: u32 = 3;
    const BACKOFF: conveyor_jobs::Backoff =
        conveyor_jobs::Backoff { base: Duration::from_millis(50), max: Duration::from_millis(100) };
}

fn greet(name: &str, mode: &str) -> Greet {
    Greet { name: name.into(), mode: mode.into() }
}

/// Which job started when.
type Starts = Arc<Mutex<Vec<(JobId, DateTime<Utc>)>>>;

/// When each job started (by this process's clock) and how its runs ended.
#[derive(Clone, Default)]
struct Log {
    starts: Starts,
    stopped_by_cancel: Arc<Mutex<Vec<JobId>>>,
}

impl Log {
    fn starts_of(&self, id: JobId) -> Vec<DateTime<Utc>> {
        self.starts.lock().unwrap().iter().filter(|(j, _)| *j == id).map(|(_, t)| *t).collect()
    }
}

struct Greeter(Log);

impl Handler<Greet> for Greeter {
    async fn handle(&self, job: Greet, cx: &mut JobContext) -> Result<Value, JobError> {
        self.0.starts.lock().unwrap().push((cx.id(), Utc::now()));
        match job.mode.as_str() {
            "fail" => Err(JobError::retryable("the greeting failed")),
            // Stops on its first run as a canceled handler would, though nobody canceled it.
            "stop" if cx.attempt() == 1 => Err(JobError::Canceled),
            "hold" => {
                // Holds its transaction (a pooled connection) for the whole run, reporting progress as it goes.
                sqlx::query("SELECT 1").execute(&mut **cx.tx().await?).await?;
                for step in 0..6 {
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    cx.progress(json!({ "step": step })).await?;
                }
                Ok(json!({ "held": cx.attempt() }))
            }
            "slow" => {
                // A long job with steps: each step reports progress, which tells it when it was canceled.
                for step in 0..600 {
                    tokio::select! {
                        _ = cx.cancellation().cancelled() => {}
                        _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                    }
                    if let Err(e) = cx.progress(json!({ "step": step })).await {
                        self.0.stopped_by_cancel.lock().unwrap().push(cx.id());
                        return Err(e);
                    }
                }
                Ok(json!("slow done"))
            }
            _ => {
                // A business row written in the job's transaction, committed with its completion.
                sqlx::query("SELECT 1").execute(&mut **cx.tx().await?).await?;
                Ok(json!({ "greeting": format!("hello {}", job.name), "attempt": cx.attempt() }))
            }
        }
    }
}

/// A dispatcher and a worker for `Greet` over the app's database and prefix, until `shutdown`.
async fn platform(app: &TestApp, log: &Log, shutdown: &CancellationToken) {
    let redis = common::redis_url();
    common::run_dispatcher(
        common::test_dispatcher(app, &redis, |v| {
            v.insert("CONVEYOR_DISPATCH_POLL".into(), "200ms".into());
        })
        .await,
        shutdown,
    );
    let settings = WorkerSettings { concurrency: 8, ..WorkerSettings::default() };
    let worker = worker_of::<Greet>(app, &app.db.pool, &redis, Greeter(log.clone()), settings).await;
    tokio::spawn(worker.run(shutdown.clone(), Duration::from_secs(5)));
}

/// A worker of kind `K` over `pool`, on the Redis at `redis` under the app's key prefix.
async fn worker_of<K: JobKind>(
    app: &TestApp,
    pool: &sqlx::PgPool,
    redis: &str,
    handler: impl Handler<K>,
    settings: WorkerSettings,
) -> Worker {
    Worker::builder(pool.clone(), Consumer::connect(redis, &app.redis_prefix).await.unwrap())
        .runtime_pool(app.db.runtime_pool.clone())
        .handle::<K>(handler)
        .settings(settings)
        .build()
        .unwrap()
}

async fn jobs_in(app: &TestApp, ws: WorkspaceId) -> i64 {
    app.db.count("outbox_events", ws).await
}

#[tokio::test]
async fn a_kind_defined_outside_the_crate_runs_end_to_end_and_its_end_can_be_waited_for() {
    let app = TestApp::spawn().await;
    let (log, shutdown) = (Log::default(), CancellationToken::new());
    platform(&app, &log, &shutdown).await;
    let ws = principal().workspace_id;

    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
    let job = conveyor_jobs::enqueue_tx(&mut tx, &greet("ada", "ok"), EnqueueOptions::new()).await.unwrap();
    assert!(job.created);
    tx.commit().await.unwrap();

    let done = conveyor_jobs::wait_for_job(&app.db.pool, ws, job.id, Duration::from_secs(30)).await.unwrap();
    assert_eq!(done.status, JobStatus::Succeeded);
    assert_eq!(done.kind, "test.greet");
    assert_eq!(done.queue, "greetings");
    assert_eq!(done.result, Some(json!({ "greeting": "hello ada", "attempt": 1 })));
    assert!(done.finished_at.is_some());
    assert_eq!(log.starts_of(job.id).len(), 1);
    // Another workspace cannot see it.
    assert!(conveyor_jobs::get_job(&app.db.pool, principal().workspace_id, job.id).await.unwrap().is_none());
    shutdown.cancel();
}

#[tokio::test]
async fn a_job_without_a_transaction_of_its_own_is_recorded_as_succeeded_too() {
    #[derive(Serialize, Deserialize)]
    struct Tick;
    impl JobKind for Tick {
        const KIND: &'static str = "test.tick";
        const QUEUE: &'static str = "ticks";
    }
    struct Ticker;
    impl Handler<Tick> for Ticker {
        async fn handle(&self, _: Tick, _: &mut JobContext) -> Result<Value, JobError> {
            Ok(json!("tock"))
        }
    }
    let app = TestApp::spawn().await;
    let shutdown = CancellationToken::new();
    let redis = common::redis_url();
    common::run_dispatcher(common::test_dispatcher(&app, &redis, |_| {}).await, &shutdown);
    let worker = worker_of::<Tick>(&app, &app.db.pool, &redis, Ticker, WorkerSettings::default()).await;
    tokio::spawn(worker.run(shutdown.clone(), Duration::from_secs(5)));
    let ws = principal().workspace_id;
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
    let jobs: Vec<Tick> = (0..50).map(|_| Tick).collect();
    let ids = conveyor_jobs::enqueue_many_tx(&mut tx, jobs.iter().map(|t| (t, EnqueueOptions::new()))).await.unwrap();
    tx.commit().await.unwrap();
    for job in ids {
        let done = conveyor_jobs::wait_for_job(&app.db.pool, ws, job.id, Duration::from_secs(30)).await.unwrap();
        assert_eq!((done.status, done.result), (JobStatus::Succeeded, Some(json!("tock"))));
    }
    shutdown.cancel();
}

#[tokio::test]
async fn an_enqueue_rolled_back_with_its_transaction_leaves_nothing_and_ten_thousand_commit_together() {
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    let pool = &app.db.pool;

    let mut tx = conveyor_jobs::begin_workspace(pool, ws).await.unwrap();
    conveyor_jobs::enqueue_tx(&mut tx, &greet("a", "ok"), EnqueueOptions::new()).await.unwrap();
    let jobs: Vec<Greet> = (0..500).map(|i| greet(&i.to_string(), "ok")).collect();
    conveyor_jobs::enqueue_many_tx(&mut tx, jobs.iter().map(|j| (j, EnqueueOptions::new()))).await.unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(jobs_in(&app, ws).await, 0);

    let jobs: Vec<Greet> = (0..10_000).map(|i| greet(&i.to_string(), "ok")).collect();
    let mut tx = conveyor_jobs::begin_workspace(pool, ws).await.unwrap();
    let ids = conveyor_jobs::enqueue_many_tx(&mut tx, jobs.iter().map(|j| (j, EnqueueOptions::new()))).await.unwrap();
    assert_eq!(ids.len(), 10_000);
    assert!(ids.iter().all(|e| e.created));
    // Nothing is visible to anyone before the commit.
    assert_eq!(jobs_in(&app, ws).await, 0);
    tx.commit().await.unwrap();
    assert_eq!(jobs_in(&app, ws).await, 10_000);
    // In the order given: the ids are time-ordered and the payloads line up with them.
    let first = conveyor_jobs::get_job(pool, ws, ids[0].id).await.unwrap().unwrap();
    assert_eq!(first.status, JobStatus::Queued);
    let mut sorted: Vec<Uuid> = ids.iter().map(|e| e.id.0).collect();
    sorted.sort();
    assert_eq!(sorted, ids.iter().map(|e| e.id.0).collect::<Vec<_>>());
}

#[tokio::test]
async fn delayed_jobs_never_start_early_and_are_scheduled_until_due() {
    let app = TestApp::spawn().await;
    let (log, shutdown) = (Log::default(), CancellationToken::new());
    platform(&app, &log, &shutdown).await;
    let ws = principal().workspace_id;
    let pool = &app.db.pool;

    let mut tx = conveyor_jobs::begin_workspace(pool, ws).await.unwrap();
    let at = Utc::now() + chrono::Duration::milliseconds(1500);
    let by_time =
        conveyor_jobs::enqueue_tx(&mut tx, &greet("at", "ok"), EnqueueOptions::new().run_at(at)).await.unwrap();
    let by_delay = conveyor_jobs::enqueue_tx(
        &mut tx,
        &greet("in", "ok"),
        EnqueueOptions::new().delay(Duration::from_millis(1200)),
    )
    .await
    .unwrap();
    let (db_now,): (DateTime<Utc>,) = sqlx::query_as("SELECT now()").fetch_one(&mut *tx).await.unwrap();
    tx.commit().await.unwrap();
    let scheduled = conveyor_jobs::get_job(pool, ws, by_time.id).await.unwrap().unwrap();
    assert_eq!(scheduled.status, JobStatus::Scheduled);
    assert_eq!(scheduled.run_at.timestamp_micros(), at.timestamp_micros());

    for (job, due) in [(by_time.id, at), (by_delay.id, db_now + chrono::Duration::milliseconds(1200))] {
        let done = conveyor_jobs::wait_for_job(pool, ws, job, Duration::from_secs(30)).await.unwrap();
        assert_eq!(done.status, JobStatus::Succeeded);
        let started = log.starts_of(job)[0];
        assert!(started >= due, "started {started} before it was due at {due}");
    }
    shutdown.cancel();
}

#[tokio::test]
async fn sixteen_concurrent_enqueues_with_one_dedup_key_make_one_job_and_the_key_frees_when_it_ends() {
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    let barrier = Arc::new(tokio::sync::Barrier::new(16));
    let mut tasks = Vec::new();
    for i in 0..16 {
        let (pool, barrier) = (app.db.pool.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            let mut tx = conveyor_jobs::begin_workspace(&pool, ws).await.unwrap();
            barrier.wait().await;
            let options = EnqueueOptions::new().dedup_key("order-42");
            let job = conveyor_jobs::enqueue_tx(&mut tx, &greet(&i.to_string(), "ok"), options).await.unwrap();
            tx.commit().await.unwrap();
            job
        }));
    }
    let mut answers = Vec::new();
    for t in tasks {
        answers.push(t.await.unwrap());
    }
    assert_eq!(jobs_in(&app, ws).await, 1);
    assert_eq!(answers.iter().filter(|a| a.created).count(), 1);
    assert!(answers.iter().all(|a| a.id == answers[0].id), "every enqueue answers the live job's id");
    // Another workspace's key is its own.
    let other = principal().workspace_id;
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, other).await.unwrap();
    let theirs = conveyor_jobs::enqueue_tx(&mut tx, &greet("x", "ok"), EnqueueOptions::new().dedup_key("order-42"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert!(theirs.created);
    // Once the job ends (here: canceled) the key is free again.
    conveyor_jobs::cancel_job(&app.db.pool, ws, answers[0].id).await.unwrap();
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
    let again = conveyor_jobs::enqueue_tx(&mut tx, &greet("y", "ok"), EnqueueOptions::new().dedup_key("order-42"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert!(again.created);
    assert_ne!(again.id, answers[0].id);
}

#[tokio::test]
async fn a_bulk_enqueue_answers_the_holder_of_each_held_key() {
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
    let held =
        conveyor_jobs::enqueue_tx(&mut tx, &greet("h", "ok"), EnqueueOptions::new().dedup_key("k1")).await.unwrap();
    let jobs = [greet("a", "ok"), greet("b", "ok"), greet("c", "ok"), greet("d", "ok")];
    let keys = [Some("k1"), Some("k2"), Some("k2"), None];
    let answers = conveyor_jobs::enqueue_many_tx(
        &mut tx,
        jobs.iter()
            .zip(keys)
            .map(|(j, k)| (j, k.map_or(EnqueueOptions::new(), |k| EnqueueOptions::new().dedup_key(k)))),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert_eq!((answers[0].id, answers[0].created), (held.id, false));
    assert!(answers[1].created);
    assert_eq!((answers[2].id, answers[2].created), (answers[1].id, false), "the same key twice in one call");
    assert!(answers[3].created);
    assert_eq!(jobs_in(&app, ws).await, 3);
}

#[tokio::test]
async fn of_a_workspaces_due_jobs_the_higher_priority_is_handed_off_first() {
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
    let mut expected = HashMap::new();
    // The lower priorities are written first: a claim that went by age alone would take them.
    let priorities = [Priority::Low, Priority::Low, Priority::Low, Priority::Normal, Priority::Normal, Priority::High];
    for (i, priority) in priorities.iter().chain([Priority::High].iter()).enumerate() {
        let job =
            conveyor_jobs::enqueue_tx(&mut tx, &greet(&i.to_string(), "ok"), EnqueueOptions::new().priority(*priority))
                .await
                .unwrap();
        expected.insert(job.id.0.to_string(), *priority);
    }
    tx.commit().await.unwrap();
    // Claims of two, smaller than the backlog of seven: each must choose what to hand off.
    let dispatcher = common::test_dispatcher(&app, &common::redis_url(), |v| {
        v.insert("CONVEYOR_DISPATCH_BATCH".into(), "2".into());
    })
    .await;
    let client = common::redis_client(&common::redis_url()).await;
    let stream = conveyor_jobs::RedisKeys::new(&app.redis_prefix).stream("greetings");
    let mut handed = 0;
    let mut claims = Vec::new();
    while handed < expected.len() {
        dispatcher.dispatch_once().await.unwrap();
        let ids = common::stream_event_ids(&client, &stream).await;
        assert!(ids.len() > handed, "a claim handed something off");
        claims.push(ids[handed..].iter().map(|id| expected[id]).collect::<Vec<Priority>>());
        handed = ids.len();
    }
    use Priority::{High, Low, Normal};
    assert_eq!(claims, [vec![High, High], vec![Normal, Normal], vec![Low, Low], vec![Low]]);
}

#[tokio::test]
async fn a_canceled_queued_job_never_runs_and_a_running_one_stops_at_its_next_step() {
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    let pool = &app.db.pool;
    let mut tx = conveyor_jobs::begin_workspace(pool, ws).await.unwrap();
    let queued = conveyor_jobs::enqueue_tx(&mut tx, &greet("q", "ok"), EnqueueOptions::new()).await.unwrap();
    let slow = conveyor_jobs::enqueue_tx(&mut tx, &greet("s", "slow"), EnqueueOptions::new()).await.unwrap();
    tx.commit().await.unwrap();
    // The queued job is canceled before any worker exists; then the platform starts.
    conveyor_jobs::cancel_job(pool, ws, queued.id).await.unwrap();
    let (log, shutdown) = (Log::default(), CancellationToken::new());
    platform(&app, &log, &shutdown).await;

    let running = common::eventually(Duration::from_secs(30), || async {
        let job = conveyor_jobs::get_job(pool, ws, slow.id).await.unwrap().unwrap();
        job.progress.is_some().then_some(job)
    })
    .await
    .expect("the slow job reports progress");
    assert_eq!(running.status, JobStatus::Active);
    conveyor_jobs::cancel_job(pool, ws, slow.id).await.unwrap();
    let done = conveyor_jobs::wait_for_job(pool, ws, slow.id, Duration::from_secs(10)).await.unwrap();
    assert_eq!(done.status, JobStatus::Canceled);
    common::eventually(Duration::from_secs(10), || async {
        log.stopped_by_cancel.lock().unwrap().contains(&slow.id).then_some(())
    })
    .await
    .expect("the handler saw its cancellation and stopped");

    // A finished job cannot be canceled; an unknown one is not found.
    assert!(matches!(
        conveyor_jobs::cancel_job(pool, ws, slow.id).await,
        Err(CancelError::Finished(JobStatus::Canceled))
    ));
    assert!(matches!(conveyor_jobs::cancel_job(pool, ws, JobId(Uuid::now_v7())).await, Err(CancelError::NotFound)));
    // Give the relay time to have handed the canceled job over, had it been going to.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(log.starts_of(queued.id).is_empty(), "a canceled queued job never runs");
    assert_eq!(conveyor_jobs::get_job(pool, ws, queued.id).await.unwrap().unwrap().status, JobStatus::Canceled);
    shutdown.cancel();
}

#[tokio::test]
async fn per_job_attempts_override_the_kinds_and_waiting_times_out_with_where_the_job_is() {
    let app = TestApp::spawn().await;
    let (log, shutdown) = (Log::default(), CancellationToken::new());
    platform(&app, &log, &shutdown).await;
    let ws = principal().workspace_id;
    let pool = &app.db.pool;
    let mut tx = conveyor_jobs::begin_workspace(pool, ws).await.unwrap();
    let once =
        conveyor_jobs::enqueue_tx(&mut tx, &greet("o", "fail"), EnqueueOptions::new().max_attempts(1)).await.unwrap();
    let thrice = conveyor_jobs::enqueue_tx(&mut tx, &greet("t", "fail"), EnqueueOptions::new()).await.unwrap();
    let later =
        conveyor_jobs::enqueue_tx(&mut tx, &greet("l", "ok"), EnqueueOptions::new().delay(Duration::from_secs(3600)))
            .await
            .unwrap();
    tx.commit().await.unwrap();

    let failed = conveyor_jobs::wait_for_job(pool, ws, once.id, Duration::from_secs(30)).await.unwrap();
    assert_eq!((failed.status, failed.max_attempts), (JobStatus::Failed, Some(1)));
    assert_eq!(failed.last_error.as_deref(), Some("the greeting failed"));
    let failed = conveyor_jobs::wait_for_job(pool, ws, thrice.id, Duration::from_secs(30)).await.unwrap();
    assert_eq!(failed.status, JobStatus::Failed);
    assert_eq!((log.starts_of(once.id).len(), log.starts_of(thrice.id).len()), (1, 3), "the kind allows three");

    match conveyor_jobs::wait_for_job(pool, ws, later.id, Duration::from_millis(300)).await {
        Err(WaitError::TimedOut(job)) => assert_eq!(job.status, JobStatus::Scheduled),
        other => panic!("expected a time-out, got {other:?}"),
    }
    assert!(matches!(
        conveyor_jobs::wait_for_job(pool, ws, JobId(Uuid::now_v7()), Duration::from_secs(1)).await,
        Err(WaitError::NotFound)
    ));
    shutdown.cancel();
}

#[tokio::test]
async fn bad_input_is_refused_with_a_clear_error_and_nothing_is_written() {
    #[derive(Serialize, Deserialize)]
    struct Unserializable {
        // serde_json refuses maps whose keys are not strings.
        by_pair: HashMap<(i32, i32), i32>,
    }
    impl JobKind for Unserializable {
        const KIND: &'static str = "test.unserializable";
        const QUEUE: &'static str = "greetings";
    }
    #[derive(Serialize, Deserialize)]
    struct BadlyNamed;
    impl JobKind for BadlyNamed {
        const KIND: &'static str = "Bad Kind!";
        const QUEUE: &'static str = "greetings";
    }
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
    let payload = Unserializable { by_pair: HashMap::from([((1, 2), 3)]) };
    let err = conveyor_jobs::enqueue_tx(&mut tx, &payload, EnqueueOptions::new()).await.unwrap_err();
    assert!(matches!(err, EnqueueError::Payload(_)), "{err}");
    let err = conveyor_jobs::enqueue_tx(&mut tx, &BadlyNamed, EnqueueOptions::new()).await.unwrap_err();
    assert!(err.to_string().contains("Bad Kind!"), "{err}");
    let err =
        conveyor_jobs::enqueue_tx(&mut tx, &greet("a", "ok"), EnqueueOptions::new().max_attempts(0)).await.unwrap_err();
    assert!(err.to_string().contains("max_attempts"), "{err}");
    let bulk = [greet("a", "ok"), greet("b", "ok")];
    let options = [EnqueueOptions::new(), EnqueueOptions::new().timeout(Duration::ZERO)];
    let err = conveyor_jobs::enqueue_many_tx(&mut tx, bulk.iter().zip(options)).await.unwrap_err();
    assert!(err.to_string().contains("timeout"), "{err}");
    // The transaction is still usable, and holds nothing.
    tx.commit().await.unwrap();
    assert_eq!(jobs_in(&app, ws).await, 0);

    // A transaction without a workspace cannot enqueue.
    let mut bare = app.db.pool.begin().await.unwrap();
    let err = conveyor_jobs::enqueue_tx(&mut bare, &greet("a", "ok"), EnqueueOptions::new()).await.unwrap_err();
    assert!(matches!(err, EnqueueError::NoWorkspace), "{err}");
}

/// Runs `sql` through `psql` as the application role, returning stdout or the error psql printed.
fn psql(app: &TestApp, sql: &str) -> Result<String, String> {
    let out = std::process::Command::new("psql")
        .args([&app.db.app_url, "-X", "-q", "-At", "-v", "ON_ERROR_STOP=1", "-c", sql])
        .output()
        .expect("psql is installed");
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_owned())
    }
}

#[tokio::test]
async fn another_language_enqueues_with_one_select_in_its_own_transaction_under_rls() {
    let app = TestApp::spawn().await;
    let (log, shutdown) = (Log::default(), CancellationToken::new());
    platform(&app, &log, &shutdown).await;
    let (ws, other) = (principal().workspace_id, principal().workspace_id);
    // The worker registers its kinds when it starts.
    common::eventually(Duration::from_secs(10), || async {
        psql(&app, "SELECT 1 FROM conveyor.job_kinds WHERE kind = 'test.greet'").ok().filter(|o| o == "1")
    })
    .await
    .expect("the worker registered its kind");

    let enqueue = format!(
        "BEGIN; SELECT set_config('app.workspace_id', '{ws}', true);
         SELECT conveyor.conveyor_enqueue('test.greet', '{{\"name\": \"psql\", \"mode\": \"ok\"}}', priority => 'high',
                                 dedup_key => 'from-node');
         COMMIT;"
    );
    let out = psql(&app, &enqueue).unwrap();
    let id: Uuid = out.lines().last().unwrap().parse().expect("the job id");
    let done = conveyor_jobs::wait_for_job(&app.db.pool, ws, JobId(id), Duration::from_secs(30)).await.unwrap();
    assert_eq!(done.status, JobStatus::Succeeded);
    assert_eq!(done.result, Some(json!({ "greeting": "hello psql", "attempt": 1 })));
    assert_eq!(done.priority, Priority::High);

    // Another workspace's context neither sees the job nor can write into the first workspace.
    let look = format!(
        "BEGIN; SELECT set_config('app.workspace_id', '{other}', true);
         SELECT count(*) FROM conveyor.outbox_events WHERE id = '{id}'; COMMIT;"
    );
    assert_eq!(psql(&app, &look).unwrap().lines().last(), Some("0"));
    let smuggle = format!(
        "BEGIN; SELECT set_config('app.workspace_id', '{other}', true);
         INSERT INTO conveyor.outbox_events (id, workspace_id, queue, event_type, event_payload)
         VALUES (conveyor.conveyor_uuid_v7(), '{ws}', 'greetings', 'test.greet', '{{}}'); COMMIT;"
    );
    assert!(psql(&app, &smuggle).unwrap_err().contains("row-level security"));
    // Without a workspace, and with bad arguments: clear errors, nothing written.
    let bare = psql(&app, "SELECT conveyor.conveyor_enqueue('test.greet', '{}')").unwrap_err();
    assert!(bare.contains("no workspace is set"), "{bare}");
    let in_ws = |call: &str| format!("BEGIN; SELECT set_config('app.workspace_id', '{ws}', true); {call}; COMMIT;");
    let unknown = psql(&app, &in_ws("SELECT conveyor.conveyor_enqueue('no.such_kind', '{}')")).unwrap_err();
    assert!(unknown.contains("unknown job kind no.such_kind"), "{unknown}");
    let priority =
        psql(&app, &in_ws("SELECT conveyor.conveyor_enqueue('test.greet', '{}', priority => 'urgent')")).unwrap_err();
    assert!(priority.contains("priority must be high, normal or low"), "{priority}");
    let attempts =
        psql(&app, &in_ws("SELECT conveyor.conveyor_enqueue('test.greet', '{}', max_attempts => 0)")).unwrap_err();
    assert!(attempts.contains("max_attempts must be at least 1"), "{attempts}");
    let within =
        |d: &str| in_ws(&format!("SELECT conveyor.conveyor_enqueue('test.greet', '{{}}', start_within => '{d}')"));
    for bad in ["0 seconds", "11 years"] {
        let refused = psql(&app, &within(bad)).unwrap_err();
        assert!(refused.contains("start_within must be at least 1 ms and at most ten years"), "{refused}");
    }
    assert_eq!(jobs_in(&app, ws).await, 1);
    // A deadline, counted from when the job falls due: a day ahead, it must start within the hour after.
    let deadline = in_ws(
        "SELECT conveyor.conveyor_enqueue('test.greet', '{}', run_at => now() + interval '1 day',
                                          start_within => interval '1 hour')",
    );
    let id: Uuid = psql(&app, &deadline).unwrap().lines().last().unwrap().parse().expect("the job id");
    let job = conveyor_jobs::get_job(&app.db.pool, ws, JobId(id)).await.unwrap().unwrap();
    assert_eq!(job.expires_at, Some(job.run_at + chrono::Duration::hours(1)), "{job:?}");
    conveyor_jobs::cancel_job(&app.db.pool, ws, JobId(id)).await.unwrap();
    assert_eq!(jobs_in(&app, other).await, 0);
    shutdown.cancel();
}

#[tokio::test]
async fn jobs_holding_every_pooled_connection_do_not_starve_their_progress_and_keep_alive() {
    let app = TestApp::spawn().await;
    let who = principal();
    let ws = who.workspace_id;
    // The pool is exactly as large as the worker's concurrency, and every job holds a connection all along.
    let pool = conveyor_jobs::connect_postgres(&app.db.app_url, 2).await.unwrap();
    let shutdown = CancellationToken::new();
    let redis = common::redis_url();
    common::run_dispatcher(common::test_dispatcher(&app, &redis, |_| {}).await, &shutdown);
    let settings =
        WorkerSettings { concurrency: 2, keepalive: Duration::from_millis(200), ..WorkerSettings::default() };
    let worker = worker_of::<Greet>(&app, &pool, &redis, Greeter(Log::default()), settings).await;
    tokio::spawn(worker.run(shutdown.clone(), Duration::from_secs(5)));

    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
    let mut jobs = Vec::new();
    for _ in 0..2 {
        let op = conveyor_jobs::create_operation_tx(&mut tx, ws, who.user_id, "test.greet", None).await.unwrap();
        let options = EnqueueOptions::new().operation(op.id);
        jobs.push(conveyor_jobs::enqueue_tx(&mut tx, &greet("h", "hold"), options).await.unwrap().id);
    }
    tx.commit().await.unwrap();
    // Progress shows while both run, each holding one of the pool's two connections.
    common::eventually(Duration::from_secs(20), || async {
        let ops = app.db.rows("operations", ws).await;
        ops.iter().all(|o| o["status"] == "running" && o["progress"]["step"].as_i64() >= Some(1)).then_some(())
    })
    .await
    .expect("progress of both running jobs is recorded while they hold every pooled connection");
    for job in jobs {
        let done = conveyor_jobs::wait_for_job(&app.db.pool, ws, job, Duration::from_secs(30)).await.unwrap();
        assert_eq!((done.status, done.result), (JobStatus::Succeeded, Some(json!({ "held": 1 }))), "first run");
    }
    shutdown.cancel();
}

#[tokio::test]
async fn a_services_own_test_drains_its_jobs_in_process_step_by_step() {
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    let log = Log::default();
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
    let mut ok = Vec::new();
    for name in ["a", "b", "c"] {
        ok.push(conveyor_jobs::enqueue_tx(&mut tx, &greet(name, "ok"), EnqueueOptions::new()).await.unwrap().id);
    }
    let failing = conveyor_jobs::enqueue_tx(&mut tx, &greet("f", "fail"), EnqueueOptions::new().max_attempts(1))
        .await
        .unwrap()
        .id;
    tx.commit().await.unwrap();
    let dispatcher = common::test_dispatcher(&app, &common::redis_url(), |_| {}).await;
    let redis = common::redis_url();
    let worker = worker_of::<Greet>(&app, &app.db.pool, &redis, Greeter(log.clone()), WorkerSettings::default()).await;

    let outcomes = conveyor_jobs::testing::drain(&dispatcher, &worker).await.unwrap();
    let count = |o: conveyor_jobs::Outcome| outcomes.iter().filter(|x| **x == o).count();
    assert_eq!((count(conveyor_jobs::Outcome::Succeeded), count(conveyor_jobs::Outcome::DeadLettered)), (3, 1));
    for job in ok {
        assert_eq!(conveyor_jobs::get_job(&app.db.pool, ws, job).await.unwrap().unwrap().status, JobStatus::Succeeded);
    }
    assert_eq!(conveyor_jobs::get_job(&app.db.pool, ws, failing).await.unwrap().unwrap().status, JobStatus::Failed);
    // Nothing is left: a second drain runs nothing.
    assert!(conveyor_jobs::testing::drain(&dispatcher, &worker).await.unwrap().is_empty());
}

#[tokio::test]
async fn jobs_without_an_operation_survive_a_redis_that_loses_everything() {
    let app = TestApp::spawn().await;
    let mut redis = common::TestRedis::start(None).await;
    let shutdown = CancellationToken::new();
    common::run_dispatcher(
        common::test_dispatcher(&app, &redis.url(), |v| {
            v.insert("CONVEYOR_DISPATCH_POLL".into(), "200ms".into());
        })
        .await,
        &shutdown,
    );
    let ws = principal().workspace_id;
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
    let jobs: Vec<Greet> = (0..5).map(|i| greet(&i.to_string(), "ok")).collect();
    let ids = conveyor_jobs::enqueue_many_tx(&mut tx, jobs.iter().map(|j| (j, EnqueueOptions::new()))).await.unwrap();
    tx.commit().await.unwrap();
    // Handed to the stream, with no worker yet; then Redis restarts empty: the entries are gone.
    common::eventually(Duration::from_secs(20), || async {
        let events = app.db.rows("outbox_events", ws).await;
        events.iter().all(|e| e["status"] == "dispatched").then_some(())
    })
    .await
    .expect("all handed off");
    redis.stop();
    redis.start_again().await;

    let log = Log::default();
    let worker =
        worker_of::<Greet>(&app, &app.db.pool, &redis.url(), Greeter(log.clone()), WorkerSettings::default()).await;
    tokio::spawn(worker.run(shutdown.clone(), Duration::from_secs(5)));
    let maintenance = conveyor_jobs::Maintenance::new(
        app.db.runtime_pool.clone(),
        common::redis_client(&redis.url()).await,
        conveyor_jobs::RedisKeys::new(&app.redis_prefix),
        conveyor_jobs::Metrics::new(),
        Duration::from_millis(300),
        Duration::from_secs(3600),
        Duration::from_secs(1),
    );
    tokio::spawn(maintenance.run(shutdown.clone()));
    for job in ids {
        let done = conveyor_jobs::wait_for_job(&app.db.pool, ws, job.id, Duration::from_secs(30)).await.unwrap();
        assert_eq!(done.status, JobStatus::Succeeded, "re-driven from PostgreSQL and run");
        assert_eq!(log.starts_of(job.id).len(), 1);
    }
    shutdown.cancel();
}

#[tokio::test]
async fn a_subscription_hears_each_end_of_its_workspaces_jobs_once() {
    let app = TestApp::spawn().await;
    let (ws, other) = (principal().workspace_id, principal().workspace_id);
    let pool = &app.db.pool;
    let mut ends = conveyor_jobs::subscribe(pool, ws).await.unwrap();
    let (log, shutdown) = (Log::default(), CancellationToken::new());
    platform(&app, &log, &shutdown).await;

    let mut expected = HashMap::new();
    for (workspace, n) in [(ws, 30), (other, 5)] {
        let mut tx = conveyor_jobs::begin_workspace(pool, workspace).await.unwrap();
        for i in 0..n {
            let (mode, options, status) = match i % 10 {
                0 => ("fail", EnqueueOptions::new().max_attempts(1), JobStatus::Failed),
                1 => ("ok", EnqueueOptions::new().delay(Duration::from_secs(3600)), JobStatus::Canceled),
                _ => ("ok", EnqueueOptions::new(), JobStatus::Succeeded),
            };
            let job = conveyor_jobs::enqueue_tx(&mut tx, &greet(&i.to_string(), mode), options).await.unwrap();
            if workspace == ws {
                expected.insert(job.id, status);
            }
        }
        tx.commit().await.unwrap();
    }
    for (job, status) in &expected {
        if *status == JobStatus::Canceled {
            conveyor_jobs::cancel_job(pool, ws, *job).await.unwrap();
        }
    }
    let mut heard = HashMap::new();
    while heard.len() < expected.len() {
        let end =
            tokio::time::timeout(Duration::from_secs(30), ends.next()).await.expect("an end within 30 s").unwrap();
        assert!(heard.insert(end.id, end.status).is_none(), "{} heard twice", end.id);
    }
    assert_eq!(heard, expected, "every end of the workspace's jobs, with its status, and none of another workspace's");
    // Nothing more comes.
    assert!(tokio::time::timeout(Duration::from_millis(500), ends.next()).await.is_err());
    shutdown.cancel();
}

#[tokio::test]
async fn two_deliveries_of_a_job_at_once_commit_its_writes_once() {
    #[derive(Serialize, Deserialize)]
    struct Record;
    impl JobKind for Record {
        const KIND: &'static str = "test.record";
        const QUEUE: &'static str = "records";
    }
    struct Recorder;
    impl Handler<Record> for Recorder {
        async fn handle(&self, _: Record, cx: &mut JobContext) -> Result<Value, JobError> {
            let id = cx.id().0;
            sqlx::query("INSERT INTO test_effects (job) VALUES ($1)").bind(id).execute(&mut **cx.tx().await?).await?;
            tokio::time::sleep(Duration::from_millis(400)).await;
            Ok(Value::Null)
        }
    }
    let app = TestApp::spawn().await;
    // A table of the test's own, as a service would have, written by the handler in the job's transaction.
    let mut owner = app.db.owner().await;
    sqlx::query("CREATE TABLE test_effects (job uuid NOT NULL)").execute(&mut owner).await.unwrap();
    sqlx::query("GRANT SELECT, INSERT ON test_effects TO conveyor_app").execute(&mut owner).await.unwrap();
    let ws = principal().workspace_id;
    let redis = common::redis_url();
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
    let job = conveyor_jobs::enqueue_tx(&mut tx, &Record, EnqueueOptions::new()).await.unwrap().id;
    tx.commit().await.unwrap();
    common::test_dispatcher(&app, &redis, |_| {}).await.dispatch_once().await.unwrap();
    // The same entry twice in the stream, as after a reclaim of a live consumer's entry.
    let client = common::redis_client(&redis).await;
    let stream = conveyor_jobs::RedisKeys::new(&app.redis_prefix).stream("records");
    {
        use fred::prelude::StreamsInterface;
        let entries: Vec<(String, HashMap<String, String>)> = client.xrange(&stream, "-", "+", None).await.unwrap();
        let fields: Vec<(String, String)> = entries[0].1.clone().into_iter().collect();
        let _: String = client.xadd(&stream, false, None, "*", fields).await.unwrap();
    }
    let shutdown = CancellationToken::new();
    let worker = worker_of::<Record>(
        &app,
        &app.db.pool,
        &redis,
        Recorder,
        WorkerSettings { concurrency: 4, ..WorkerSettings::default() },
    )
    .await;
    tokio::spawn(worker.run(shutdown.clone(), Duration::from_secs(5)));
    let done = conveyor_jobs::wait_for_job(&app.db.pool, ws, job, Duration::from_secs(30)).await.unwrap();
    assert_eq!(done.status, JobStatus::Succeeded);
    common::eventually(Duration::from_secs(10), || async {
        common::stream_event_ids(&client, &stream).await.is_empty().then_some(())
    })
    .await
    .expect("both deliveries settled");
    let written: i64 = sqlx::query_scalar("SELECT count(*) FROM test_effects").fetch_one(&mut owner).await.unwrap();
    assert_eq!(written, 1, "the delivery that waited for the other's run skipped it");
    shutdown.cancel();
}

#[tokio::test]
async fn an_operations_jobs_end_with_it_and_a_handler_that_stops_unasked_is_retried() {
    let app = TestApp::spawn().await;
    let who = principal();
    let ws = who.workspace_id;
    let pool = &app.db.pool;
    let mut tx = conveyor_jobs::begin_workspace(pool, ws).await.unwrap();
    let op = conveyor_jobs::create_operation_tx(&mut tx, ws, who.user_id, "test.greet", None).await.unwrap();
    let later = || EnqueueOptions::new().operation(op.id).delay(Duration::from_secs(3600));
    let first = conveyor_jobs::enqueue_tx(&mut tx, &greet("1", "ok"), later()).await.unwrap().id;
    let second = conveyor_jobs::enqueue_tx(&mut tx, &greet("2", "ok"), later()).await.unwrap().id;
    let other_op = conveyor_jobs::create_operation_tx(&mut tx, ws, who.user_id, "test.greet", None).await.unwrap();
    let orphan = conveyor_jobs::enqueue_tx(&mut tx, &greet("3", "ok"), EnqueueOptions::new().operation(other_op.id))
        .await
        .unwrap()
        .id;
    let stopper = conveyor_jobs::enqueue_tx(&mut tx, &greet("4", "stop"), EnqueueOptions::new()).await.unwrap().id;
    // The other operation ends (as another of its jobs could end it) before its job runs.
    sqlx::query("UPDATE conveyor.operations SET status = 'succeeded', finished_at = now() WHERE id = $1")
        .bind(other_op.id)
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();

    // Canceling one job of an operation cancels the operation and its other live job.
    conveyor_jobs::cancel_job(pool, ws, first).await.unwrap();
    for job in [first, second] {
        assert_eq!(conveyor_jobs::get_job(pool, ws, job).await.unwrap().unwrap().status, JobStatus::Canceled);
    }
    let (log, shutdown) = (Log::default(), CancellationToken::new());
    platform(&app, &log, &shutdown).await;
    // A job delivered after its operation ended does not run, and ends (it is not left live).
    let ended = conveyor_jobs::wait_for_job(pool, ws, orphan, Duration::from_secs(30)).await.unwrap();
    assert_eq!(ended.status, JobStatus::Canceled);
    assert!(log.starts_of(orphan).is_empty());
    // A handler that answers Canceled when nobody canceled it is retried, not dropped.
    let done = conveyor_jobs::wait_for_job(pool, ws, stopper, Duration::from_secs(30)).await.unwrap();
    assert_eq!(done.status, JobStatus::Succeeded);
    assert_eq!(log.starts_of(stopper).len(), 2);
    shutdown.cancel();
}

#[tokio::test]
async fn an_enqueue_refuses_another_workspaces_or_an_ended_operation_and_a_replay_a_held_key() {
    let app = TestApp::spawn().await;
    let (who, other) = (principal(), principal());
    let pool = &app.db.pool;
    let mut tx = conveyor_jobs::begin_workspace(pool, who.workspace_id).await.unwrap();
    let op =
        conveyor_jobs::create_operation_tx(&mut tx, who.workspace_id, who.user_id, "test.greet", None).await.unwrap();
    tx.commit().await.unwrap();
    let mut tx = conveyor_jobs::begin_workspace(pool, other.workspace_id).await.unwrap();
    let err = conveyor_jobs::enqueue_tx(&mut tx, &greet("x", "ok"), EnqueueOptions::new().operation(op.id))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("not a live operation of this workspace"), "{err}");
    let jobs = [greet("a", "ok")];
    let bulk =
        conveyor_jobs::enqueue_many_tx(&mut tx, jobs.iter().map(|j| (j, EnqueueOptions::new().operation(op.id))));
    assert!(bulk.await.unwrap_err().to_string().contains("not a live operation"));
    tx.rollback().await.unwrap();
    let sql = format!(
        "BEGIN; SELECT set_config('app.workspace_id', '{}', true);
         SELECT conveyor.conveyor_enqueue('test.greet', '{{}}', operation_id => '{}'); COMMIT;",
        other.workspace_id, op.id
    );
    // A worker registers its kinds (as the runtime role); here by hand.
    sqlx::query(
        "INSERT INTO conveyor.job_kinds (kind, queue, max_attempts, timeout_ms) VALUES ('test.greet', 'greetings', 3, 1000)",
    )
    .execute(&app.db.runtime_pool)
    .await
    .unwrap();
    assert!(psql(&app, &sql).unwrap_err().contains("is not a live operation of this workspace"));

    // A dead letter whose de-dup key a live job holds meanwhile is not replayed (there would be two).
    let mut tx = conveyor_jobs::begin_workspace(pool, who.workspace_id).await.unwrap();
    let options = || EnqueueOptions::new().dedup_key("k").max_attempts(1);
    let dead = conveyor_jobs::enqueue_tx(&mut tx, &greet("d", "fail"), options()).await.unwrap().id;
    tx.commit().await.unwrap();
    let (log, shutdown) = (Log::default(), CancellationToken::new());
    platform(&app, &log, &shutdown).await;
    let failed = conveyor_jobs::wait_for_job(pool, who.workspace_id, dead, Duration::from_secs(30)).await.unwrap();
    assert_eq!(failed.status, JobStatus::Failed);
    let mut tx = conveyor_jobs::begin_workspace(pool, who.workspace_id).await.unwrap();
    let live = conveyor_jobs::enqueue_tx(&mut tx, &greet("l", "ok"), options().delay(Duration::from_secs(3600)))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert!(live.created);
    let replay = conveyor_jobs::replay_dead_letter(pool, who.workspace_id, dead.0).await.unwrap();
    assert_eq!(replay, conveyor_jobs::Replay::KeyHeld(live.id.0));
    conveyor_jobs::cancel_job(pool, who.workspace_id, live.id).await.unwrap();
    assert_eq!(
        conveyor_jobs::replay_dead_letter(pool, who.workspace_id, dead.0).await.unwrap(),
        conveyor_jobs::Replay::Replayed
    );
    shutdown.cancel();
}

#[tokio::test]
async fn a_retry_after_from_the_handler_postpones_the_next_run_beyond_the_kinds_back_off() {
    #[derive(Serialize, Deserialize)]
    struct Limited;
    impl JobKind for Limited {
        const KIND: &'static str = "test.limited";
        const QUEUE: &'static str = "limited";
        const BACKOFF: conveyor_jobs::Backoff =
            conveyor_jobs::Backoff { base: Duration::from_millis(10), max: Duration::from_millis(20) };
    }
    struct Provider;
    impl Handler<Limited> for Provider {
        async fn handle(&self, _: Limited, _: &mut JobContext) -> Result<Value, JobError> {
            Err(JobError::retry_after("provider answered 429", Duration::from_secs(120)))
        }
    }
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
    let job = conveyor_jobs::enqueue_tx(&mut tx, &Limited, EnqueueOptions::new()).await.unwrap().id;
    tx.commit().await.unwrap();
    let dispatcher = common::test_dispatcher(&app, &common::redis_url(), |_| {}).await;
    let worker =
        worker_of::<Limited>(&app, &app.db.pool, &common::redis_url(), Provider, WorkerSettings::default()).await;
    let outcomes = conveyor_jobs::testing::drain(&dispatcher, &worker).await.unwrap();
    assert_eq!(outcomes, vec![conveyor_jobs::Outcome::Retried], "one run, then nothing due");
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
    let (wait, error): (f64, String) = sqlx::query_as(
        "SELECT extract(epoch FROM next_attempt_at - now())::float8, last_error FROM conveyor.outbox_events WHERE id = $1",
    )
    .bind(job.0)
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    // The kind's back-off alone would make it due within 20 ms; the handler's Retry-After holds it for two minutes.
    assert!(wait > 100.0, "next run in {wait} s");
    assert!(error.contains("429"), "{error}");
    assert_eq!(conveyor_jobs::get_job(&app.db.pool, ws, job).await.unwrap().unwrap().status, JobStatus::Retrying);
}

#[tokio::test]
async fn an_entry_whose_job_retention_deleted_is_acknowledged_without_running() {
    use fred::prelude::{KeysInterface, StreamsInterface};
    let app = TestApp::spawn().await;
    let redis = common::redis_url();
    let shutdown = CancellationToken::new();
    common::run_dispatcher(
        common::test_dispatcher(&app, &redis, |v| {
            v.insert("CONVEYOR_DISPATCH_POLL".into(), "200ms".into());
        })
        .await,
        &shutdown,
    );
    let ws = principal().workspace_id;
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
    let job = conveyor_jobs::enqueue_tx(&mut tx, &greet("late", "ok"), EnqueueOptions::new()).await.unwrap();
    tx.commit().await.unwrap();
    // Handed to its stream, with no worker yet: a copy of the entry is kept, as a late duplicate would bring it back.
    let client = common::redis_client(&redis).await;
    let stream = conveyor_jobs::RedisKeys::new(&app.redis_prefix).stream("greetings");
    let entry = common::eventually(Duration::from_secs(20), || async {
        let entries: Vec<(String, HashMap<String, String>)> = client.xrange(&stream, "-", "+", None).await.ok()?;
        entries.into_iter().next().map(|(_, fields)| fields)
    })
    .await
    .expect("handed off");

    let (log, metrics) = (Log::default(), conveyor_jobs::Metrics::new());
    let worker = Worker::builder(app.db.pool.clone(), Consumer::connect(&redis, &app.redis_prefix).await.unwrap())
        .runtime_pool(app.db.runtime_pool.clone())
        .handle::<Greet>(Greeter(log.clone()))
        .metrics(metrics.clone())
        .build()
        .unwrap();
    tokio::spawn(worker.run(shutdown.clone(), Duration::from_secs(5)));
    let done = conveyor_jobs::wait_for_job(&app.db.pool, ws, job.id, Duration::from_secs(30)).await.unwrap();
    assert_eq!(done.status, JobStatus::Succeeded);

    // Retention deletes the ended job; then its entry turns up again.
    let maintenance = conveyor_jobs::Maintenance::new(
        app.db.runtime_pool.clone(),
        client.clone(),
        conveyor_jobs::RedisKeys::new(&app.redis_prefix),
        conveyor_jobs::Metrics::new(),
        Duration::from_secs(1),
        Duration::ZERO,
        Duration::from_secs(3600),
    );
    assert!(maintenance.run_once().await.unwrap().outbox_purged >= 1);
    assert!(conveyor_jobs::get_job(&app.db.pool, ws, job.id).await.unwrap().is_none(), "retention deleted it");
    let fields: Vec<(String, String)> = entry.into_iter().collect();
    let _: String = client.xadd(&stream, false, None, "*", fields).await.unwrap();

    let skipped = metrics.jobs.with_label_values(&["greetings", "test.greet", "skipped"]);
    let drained = common::eventually(Duration::from_secs(20), || async {
        let length: u64 = client.xlen(&stream).await.ok()?;
        (skipped.get() == 1 && length == 0).then_some(())
    })
    .await;
    assert!(drained.is_some(), "the entry was acknowledged as skipped ({} skipped)", skipped.get());
    assert_eq!(log.starts_of(job.id).len(), 1, "a job PostgreSQL no longer knows never runs again");
    let _: () = client.del(&stream).await.unwrap_or(());
    shutdown.cancel();
}

#[tokio::test]
async fn slots_set_for_a_queue_the_worker_does_not_consume_are_refused_naming_it() {
    let app = TestApp::spawn().await;
    let redis = common::redis_url();
    let build = |queue: &'static str, slots: usize| {
        let app = &app;
        let redis = redis.clone();
        async move {
            Worker::builder(app.db.pool.clone(), Consumer::connect(&redis, &app.redis_prefix).await.unwrap())
                .runtime_pool(app.db.runtime_pool.clone())
                .handle::<Greet>(Greeter(Log::default()))
                .queue_concurrency(queue, slots)
                .build()
        }
    };
    let err = build("greeting", 2).await.err().expect("refused").to_string();
    assert!(err.contains("`greeting`") && err.contains("greetings"), "{err}");
    let err = build("greetings", 0).await.err().expect("refused").to_string();
    assert!(err.contains("at least one slot"), "{err}");
    assert!(build("greetings", 2).await.is_ok());
}
