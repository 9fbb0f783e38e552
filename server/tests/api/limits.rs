//! Limits per key against real PostgreSQL and Redis (migration 0023): a key's concurrency limit holds however many of
//! its jobs are due, other keys go on meanwhile, and a handler's "rate limited until T" holds its key's jobs until T
//! without spending an attempt.

use crate::common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use common::{TestApp, principal};
use conveyor_jobs::{
    Consumer, EnqueueError, EnqueueOptions, FlowError, Handler, JobContext, JobError, JobId, JobKind, JobStatus,
    KeyLimit, Worker, WorkerSettings, WorkspaceId,
};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

/// A job of a key (the key is in the payload too, so that the handler knows it).
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Call {
    tag: String,
    key: Option<String>,
}

impl JobKind for Call {
    const KIND: &'static str = "test.call";
    const QUEUE: &'static str = "calls";
}

/// One run of a job: its tag, when it started (this process's clock, the database's machine) and its attempt.
#[derive(Clone, Debug)]
struct Run {
    tag: String,
    started: DateTime<Utc>,
    attempt: u32,
}

#[derive(Default)]
struct Seen {
    runs: Mutex<Vec<Run>>,
    /// Jobs of key `store:a` running now, and the most ever at once.
    running_a: AtomicUsize,
    max_a: AtomicUsize,
    /// The `until` each rate-limited job answered, by tag.
    limited: Mutex<HashMap<String, DateTime<Utc>>>,
}

impl Seen {
    fn runs(&self) -> Vec<Run> {
        self.runs.lock().unwrap().clone()
    }
}

struct Caller {
    seen: Arc<Seen>,
    cost: Duration,
    /// Tags that answer `RateLimited(now + 2 s)` on their first run.
    rate_limit_once: Vec<String>,
    limited_once: Mutex<HashMap<String, bool>>,
}

impl Handler<Call> for Caller {
    async fn handle(&self, job: Call, cx: &mut JobContext) -> Result<Value, JobError> {
        let started = Utc::now();
        self.seen.runs.lock().unwrap().push(Run { tag: job.tag.clone(), started, attempt: cx.attempt() });
        if self.rate_limit_once.contains(&job.tag) && !self.limited_once.lock().unwrap().contains_key(&job.tag) {
            self.limited_once.lock().unwrap().insert(job.tag.clone(), true);
            let until = Utc::now() + chrono::Duration::seconds(2);
            self.seen.limited.lock().unwrap().insert(job.tag.clone(), until);
            return Err(JobError::rate_limited("429 from the marketplace for this store", until));
        }
        let a = job.key.as_deref() == Some("store:a");
        if a {
            let now = self.seen.running_a.fetch_add(1, Ordering::SeqCst) + 1;
            self.seen.max_a.fetch_max(now, Ordering::SeqCst);
        }
        tokio::time::sleep(self.cost).await;
        if a {
            self.seen.running_a.fetch_sub(1, Ordering::SeqCst);
        }
        Ok(json!(null))
    }
}

/// Another kind, on another queue, whose handler counts how many run at once.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Slow {
    tag: String,
}

impl JobKind for Slow {
    const KIND: &'static str = "test.slow";
    const QUEUE: &'static str = "slow";
}

#[derive(Default)]
struct Running {
    now: AtomicUsize,
    max: AtomicUsize,
    ended: AtomicUsize,
}

struct Sleeper {
    running: Arc<Running>,
    cost: Duration,
}

impl Handler<Slow> for Sleeper {
    async fn handle(&self, _: Slow, _: &mut JobContext) -> Result<Value, JobError> {
        let now = self.running.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.running.max.fetch_max(now, Ordering::SeqCst);
        tokio::time::sleep(self.cost).await;
        self.running.now.fetch_sub(1, Ordering::SeqCst);
        self.running.ended.fetch_add(1, Ordering::SeqCst);
        Ok(json!(null))
    }
}

fn caller(seen: &Arc<Seen>, cost: Duration) -> Caller {
    Caller { seen: seen.clone(), cost, rate_limit_once: Vec::new(), limited_once: Mutex::default() }
}

async fn worker(app: &TestApp, caller: Caller, concurrency: usize) -> Worker {
    Worker::builder(app.db.pool.clone(), Consumer::connect(&common::redis_url(), &app.redis_prefix).await.unwrap())
        .runtime_pool(app.db.runtime_pool.clone())
        .handle::<Call>(caller)
        .settings(WorkerSettings { concurrency, ..WorkerSettings::default() })
        .build()
        .unwrap()
}

async fn dispatcher(app: &TestApp, shutdown: &CancellationToken) {
    let dispatcher = common::test_dispatcher(app, &common::redis_url(), |v| {
        v.insert("CONVEYOR_DISPATCH_POLL".into(), "100ms".into());
    })
    .await;
    common::run_dispatcher(dispatcher, shutdown);
}

async fn enqueue(app: &TestApp, ws: WorkspaceId, tag: &str, key: Option<&str>, n: usize) -> Vec<JobId> {
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
    let jobs: Vec<Call> = (0..n).map(|i| Call { tag: format!("{tag}-{i}"), key: key.map(str::to_owned) }).collect();
    let options = || key.map_or_else(EnqueueOptions::new, |k| EnqueueOptions::new().limit_key(k));
    let ids = conveyor_jobs::enqueue_many_tx(&mut tx, jobs.iter().map(|j| (j, options()))).await.unwrap();
    tx.commit().await.unwrap();
    ids.into_iter().map(|e| e.id).collect()
}

async fn wait_all(app: &TestApp, ws: WorkspaceId, jobs: &[JobId]) {
    for job in jobs {
        let done = conveyor_jobs::wait_for_job(&app.db.pool, ws, *job, Duration::from_secs(60)).await.unwrap();
        assert_eq!(done.status, JobStatus::Succeeded, "{job:?}");
    }
}

/// The outbox rows of `jobs`, by id.
async fn rows_of(app: &TestApp, ws: WorkspaceId, jobs: &[JobId]) -> Vec<Value> {
    let rows = app.db.rows("outbox_events", ws).await;
    let ids: Vec<String> = jobs.iter().map(|j| j.0.to_string()).collect();
    rows.into_iter().filter(|r| ids.iter().any(|id| r["id"] == id.as_str())).collect()
}

#[tokio::test]
async fn a_key_has_at_most_its_limit_in_flight_other_keys_go_on_and_the_limit_lifts() {
    let app = TestApp::spawn().await;
    let (ws, other) = (principal().workspace_id, principal().workspace_id);
    conveyor_jobs::set_key_limit(
        &app.db.pool,
        ws,
        "store:a",
        KeyLimit { max_in_flight: Some(2), ..KeyLimit::default() },
    )
    .await
    .unwrap();
    let limits = conveyor_jobs::list_key_limits(&app.db.pool, ws).await.unwrap();
    assert_eq!(limits.len(), 1);
    assert_eq!((limits[0].key.as_str(), limits[0].max_in_flight), ("store:a", Some(2)));
    assert!(conveyor_jobs::list_key_limits(&app.db.pool, other).await.unwrap().is_empty(), "tenant data");

    let a = enqueue(&app, ws, "a", Some("store:a"), 20).await;
    let b = enqueue(&app, ws, "b", Some("store:b"), 6).await;
    let none = enqueue(&app, ws, "n", None, 6).await;
    let seen = Arc::new(Seen::default());
    let shutdown = CancellationToken::new();
    let caller = Caller {
        seen: seen.clone(),
        cost: Duration::from_millis(200),
        rate_limit_once: Vec::new(),
        limited_once: Mutex::default(),
    };
    tokio::spawn(worker(&app, caller, 8).await.run(shutdown.clone(), Duration::from_secs(5)));
    dispatcher(&app, &shutdown).await;

    // Other keys, and jobs without a key, are not held back behind the limited key's backlog: they all end while
    // most of it still waits (20 jobs, 2 at a time, 200 ms each).
    wait_all(&app, ws, &b).await;
    wait_all(&app, ws, &none).await;
    let a_ended = rows_of(&app, ws, &a).await.iter().filter(|r| r["status"] == "completed").count();
    assert!(a_ended <= 12, "{a_ended} of the limited key's 20 jobs had ended when the other keys' had");
    wait_all(&app, ws, &a).await;
    assert_eq!(seen.max_a.load(Ordering::SeqCst), 2, "at most (and, with 8 worker slots, exactly) 2 at once");

    // Lifted: the key's jobs run as wide as the workers allow.
    assert!(conveyor_jobs::remove_key_limit(&app.db.pool, ws, "store:a").await.unwrap());
    assert!(!conveyor_jobs::remove_key_limit(&app.db.pool, ws, "store:a").await.unwrap(), "nothing left to remove");
    assert!(conveyor_jobs::list_key_limits(&app.db.pool, ws).await.unwrap().is_empty());
    seen.max_a.store(0, Ordering::SeqCst);
    let again = enqueue(&app, ws, "again", Some("store:a"), 20).await;
    wait_all(&app, ws, &again).await;
    assert!(seen.max_a.load(Ordering::SeqCst) > 2, "the limit no longer holds: {}", seen.max_a.load(Ordering::SeqCst));
    shutdown.cancel();
}

#[tokio::test]
async fn a_rate_limited_key_waits_until_its_time_without_spending_an_attempt() {
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    let seen = Arc::new(Seen::default());
    let shutdown = CancellationToken::new();
    let caller = Caller {
        seen: seen.clone(),
        cost: Duration::from_millis(20),
        rate_limit_once: vec!["a-0".into(), "n-0".into()],
        limited_once: Mutex::default(),
    };
    tokio::spawn(worker(&app, caller, 4).await.run(shutdown.clone(), Duration::from_secs(5)));
    dispatcher(&app, &shutdown).await;

    // The key's first job answers "rate limited for 2 s": the key is blocked until then, in PostgreSQL.
    let first = enqueue(&app, ws, "a", Some("store:a"), 1).await;
    let until = common::eventually(Duration::from_secs(20), || async {
        let limits = conveyor_jobs::list_key_limits(&app.db.pool, ws).await.unwrap();
        limits.first().and_then(|l| l.blocked_until)
    })
    .await
    .expect("the key is blocked");
    let limits = conveyor_jobs::list_key_limits(&app.db.pool, ws).await.unwrap();
    assert_eq!(limits[0].key, "store:a");
    assert_eq!(limits[0].max_in_flight, None);
    assert_eq!(limits[0].block_reason.as_deref(), Some("429 from the marketplace for this store"));
    let answered = seen.limited.lock().unwrap()["a-0"];
    assert_eq!(until.timestamp_micros(), answered.timestamp_micros(), "blocked until the time the handler gave");
    let row = &rows_of(&app, ws, &first).await[0];
    assert_eq!(row["status"], "pending");
    assert_eq!(row["job_attempts"], 0, "no attempt spent");

    // Meanwhile: more of the key's jobs wait; another key's, and a job without a key, go on.
    let more_a = enqueue(&app, ws, "more", Some("store:a"), 5).await;
    let b = enqueue(&app, ws, "b", Some("store:b"), 5).await;
    let no_key = enqueue(&app, ws, "n", None, 1).await;
    wait_all(&app, ws, &b).await;
    let runs = seen.runs();
    for run in runs.iter().filter(|r| r.tag.starts_with("b-")) {
        assert!(
            run.started < until,
            "{} started at {} although only store:a is blocked (until {until})",
            run.tag,
            run.started
        );
    }

    let a: Vec<JobId> = first.iter().chain(&more_a).copied().collect();
    wait_all(&app, ws, &a).await;
    wait_all(&app, ws, &no_key).await;
    let runs = seen.runs();
    // None of the key's jobs started before the block's end (the first one's first run aside, which caused it).
    let a_runs: Vec<&Run> = runs.iter().filter(|r| r.tag.starts_with("a-") || r.tag.starts_with("more-")).collect();
    assert_eq!(a_runs.len(), 7, "the first job twice, the others once: {a_runs:?}");
    for run in &a_runs[1..] {
        assert!(
            run.started >= until,
            "{} started at {}, before the key's block ended at {until}",
            run.tag,
            run.started
        );
    }
    // The throttled run spent no attempt: its next run is attempt 1 again, and every row still has 0 failed runs.
    let reruns: Vec<u32> = a_runs.iter().filter(|r| r.tag == "a-0").map(|r| r.attempt).collect();
    assert_eq!(reruns, vec![1, 1]);
    for row in rows_of(&app, ws, &a).await {
        assert_eq!((row["status"].as_str(), row["job_attempts"].as_i64()), (Some("completed"), Some(0)), "{row}");
    }
    // A job without a key just waited until its own time, without spending an attempt, and blocked no key.
    let n_until = seen.limited.lock().unwrap()["n-0"];
    let n_runs: Vec<&Run> = runs.iter().filter(|r| r.tag == "n-0").collect();
    assert_eq!(n_runs.len(), 2);
    assert!(n_runs[1].started >= n_until && n_runs[1].attempt == 1, "{n_runs:?}");
    assert_eq!(rows_of(&app, ws, &no_key).await[0]["job_attempts"], 0);
    let keys: Vec<String> =
        conveyor_jobs::list_key_limits(&app.db.pool, ws).await.unwrap().into_iter().map(|l| l.key).collect();
    assert_eq!(keys, vec!["store:a"]);
    shutdown.cancel();
}

#[tokio::test]
async fn bad_limit_input_is_refused_and_writes_nothing() {
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    let long = "k".repeat(201);
    for key in ["", long.as_str()] {
        let refused = conveyor_jobs::set_key_limit(
            &app.db.pool,
            ws,
            key,
            KeyLimit { max_in_flight: Some(1), ..KeyLimit::default() },
        )
        .await;
        assert!(matches!(refused, Err(FlowError::InvalidName(_))), "{refused:?}");
        let refused = conveyor_jobs::remove_key_limit(&app.db.pool, ws, key).await;
        assert!(matches!(refused, Err(FlowError::InvalidName(_))), "{refused:?}");

        let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
        let job = Call { tag: "x".into(), key: None };
        let refused = conveyor_jobs::enqueue_tx(&mut tx, &job, EnqueueOptions::new().limit_key(key)).await;
        assert!(matches!(&refused, Err(EnqueueError::InvalidOptions(m)) if m.contains("limit_key")), "{refused:?}");
        let jobs = [(&job, EnqueueOptions::new()), (&job, EnqueueOptions::new().limit_key(key))];
        let refused = conveyor_jobs::enqueue_many_tx(&mut tx, jobs).await;
        assert!(matches!(&refused, Err(EnqueueError::InvalidOptions(m)) if m.contains("limit_key")), "{refused:?}");
        tx.commit().await.unwrap();
    }
    let zero = conveyor_jobs::set_key_limit(
        &app.db.pool,
        ws,
        "store:a",
        KeyLimit { max_in_flight: Some(0), ..KeyLimit::default() },
    )
    .await;
    assert!(matches!(zero, Err(FlowError::OutOfRange(_))), "{zero:?}");
    assert!(conveyor_jobs::list_key_limits(&app.db.pool, ws).await.unwrap().is_empty());
    assert!(app.db.rows("outbox_events", ws).await.is_empty());

    // The longest key is accepted, by the library and by the database.
    let longest = "é".repeat(200);
    conveyor_jobs::set_key_limit(
        &app.db.pool,
        ws,
        &longest,
        KeyLimit { max_in_flight: Some(1), ..KeyLimit::default() },
    )
    .await
    .unwrap();
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
    let job = Call { tag: "x".into(), key: Some(longest.clone()) };
    conveyor_jobs::enqueue_tx(&mut tx, &job, EnqueueOptions::new().limit_key(&longest)).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(app.db.rows("outbox_events", ws).await[0]["limit_key"], longest.as_str());
    assert!(conveyor_jobs::remove_key_limit(&app.db.pool, ws, &longest).await.unwrap());
}

#[tokio::test]
async fn a_keys_rate_holds_in_any_interval_by_the_databases_clock() {
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    let rate = KeyLimit { max_per_interval: Some((3, Duration::from_secs(1))), ..KeyLimit::default() };
    conveyor_jobs::set_key_limit(&app.db.pool, ws, "store:r", rate).await.unwrap();
    let limits = conveyor_jobs::list_key_limits(&app.db.pool, ws).await.unwrap();
    assert_eq!(
        (limits[0].max_in_flight, limits[0].max_per_interval, limits[0].interval_ms),
        (None, Some(3), Some(1000))
    );

    let seen = Arc::new(Seen::default());
    let shutdown = CancellationToken::new();
    tokio::spawn(
        worker(&app, caller(&seen, Duration::from_millis(10)), 8).await.run(shutdown.clone(), Duration::from_secs(5)),
    );
    dispatcher(&app, &shutdown).await;
    let rated = enqueue(&app, ws, "r", Some("store:r"), 12).await;
    let free = enqueue(&app, ws, "f", Some("store:f"), 6).await;
    // Another key is not held by the rate: its jobs all end while most of the rated key's wait (12 at 3 per second).
    wait_all(&app, ws, &free).await;
    let rated_ended = rows_of(&app, ws, &rated).await.iter().filter(|r| r["status"] == "completed").count();
    assert!(rated_ended <= 9, "{rated_ended} of the rated key's 12 jobs had ended when the other key's had");
    wait_all(&app, ws, &rated).await;

    // The hand-outs' times, by the database's clock: `dispatched_at`, written when the relay marks a job it has
    // handed out, or by the record of its end when that came first (a little after the claim, whose time the rate
    // goes by; hence the tolerance: without the rate the 12 go within a few ms, and a fixed window would let 6 go
    // across one of its boundaries).
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
    let ids: Vec<uuid::Uuid> = rated.iter().map(|j| j.0).collect();
    let times: Vec<(DateTime<Utc>,)> = sqlx::query_as(
        "SELECT dispatched_at FROM conveyor.outbox_events WHERE id = ANY($1) AND dispatched_at IS NOT NULL ORDER BY dispatched_at",
    )
    .bind(&ids)
    .fetch_all(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(times.len(), 12);
    let tolerance = chrono::Duration::milliseconds(400);
    for (i, later) in times.iter().enumerate().skip(3) {
        let gap = later.0 - times[i - 3].0;
        assert!(
            gap >= chrono::Duration::seconds(1) - tolerance,
            "4 of the key's jobs handed out within {gap} (the {}th to the {}th): {times:?}",
            i - 2,
            i + 1
        );
    }
    let span = times[11].0 - times[0].0;
    assert!(span >= chrono::Duration::seconds(3) - tolerance, "12 jobs at 3 per second took {span}");
    shutdown.cancel();
}

#[tokio::test]
async fn a_kind_has_at_most_its_limit_running_while_other_kinds_go_on() {
    let app = TestApp::spawn().await;
    let (ws, other) = (principal().workspace_id, principal().workspace_id);
    conveyor_jobs::set_kind_limit(&app.db.pool, ws, Slow::KIND, 2).await.unwrap();
    let limits = conveyor_jobs::list_kind_limits(&app.db.pool, ws).await.unwrap();
    assert_eq!((limits.len(), limits[0].kind.as_str(), limits[0].max_in_flight), (1, "test.slow", 2));
    assert!(conveyor_jobs::list_kind_limits(&app.db.pool, other).await.unwrap().is_empty(), "tenant data");

    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
    let jobs: Vec<Slow> = (0..12).map(|i| Slow { tag: format!("s-{i}") }).collect();
    let slow: Vec<JobId> = conveyor_jobs::enqueue_many_tx(&mut tx, jobs.iter().map(|j| (j, EnqueueOptions::new())))
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.id)
        .collect();
    tx.commit().await.unwrap();
    let calls = enqueue(&app, ws, "c", None, 8).await;

    let running = Arc::new(Running::default());
    let seen = Arc::new(Seen::default());
    let shutdown = CancellationToken::new();
    let worker =
        Worker::builder(app.db.pool.clone(), Consumer::connect(&common::redis_url(), &app.redis_prefix).await.unwrap())
            .runtime_pool(app.db.runtime_pool.clone())
            .handle::<Call>(caller(&seen, Duration::from_millis(20)))
            .handle::<Slow>(Sleeper { running: running.clone(), cost: Duration::from_millis(200) })
            .settings(WorkerSettings { concurrency: 8, ..WorkerSettings::default() })
            .build()
            .unwrap();
    tokio::spawn(worker.run(shutdown.clone(), Duration::from_secs(5)));
    dispatcher(&app, &shutdown).await;

    // The other kind goes on while most of the limited kind waits (12 jobs, 2 at a time, 200 ms each).
    wait_all(&app, ws, &calls).await;
    let ended = running.ended.load(Ordering::SeqCst);
    assert!(ended <= 8, "{ended} of the limited kind's 12 jobs had ended when the other kind's had");
    wait_all(&app, ws, &slow).await;
    assert_eq!(running.max.load(Ordering::SeqCst), 2, "at most (and, with 8 worker slots, exactly) 2 at once");

    // Lifted: the kind runs as wide as the workers allow.
    assert!(conveyor_jobs::remove_kind_limit(&app.db.pool, ws, Slow::KIND).await.unwrap());
    assert!(!conveyor_jobs::remove_kind_limit(&app.db.pool, ws, Slow::KIND).await.unwrap(), "nothing left to remove");
    running.max.store(0, Ordering::SeqCst);
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
    let again: Vec<JobId> = conveyor_jobs::enqueue_many_tx(&mut tx, jobs.iter().map(|j| (j, EnqueueOptions::new())))
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.id)
        .collect();
    tx.commit().await.unwrap();
    wait_all(&app, ws, &again).await;
    assert!(running.max.load(Ordering::SeqCst) > 2, "the limit no longer holds");
    shutdown.cancel();
}

#[tokio::test]
async fn bad_rate_and_kind_limits_are_refused_and_write_nothing() {
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    let rate = |n, interval| KeyLimit { max_per_interval: Some((n, interval)), ..KeyLimit::default() };
    for bad in [
        rate(0, Duration::from_secs(1)),
        rate(10_001, Duration::from_secs(1)),
        rate(1, Duration::ZERO),
        rate(1, Duration::from_micros(1500)),
        rate(1, Duration::from_secs(86_401)),
    ] {
        let refused = conveyor_jobs::set_key_limit(&app.db.pool, ws, "store:a", bad).await;
        assert!(matches!(refused, Err(FlowError::OutOfRange(_))), "{bad:?}: {refused:?}");
    }
    assert!(conveyor_jobs::list_key_limits(&app.db.pool, ws).await.unwrap().is_empty());
    for (kind, max) in [("Not A Kind", 1), ("", 1), ("test.slow", 0), ("test.slow", 1_000_001)] {
        let refused = conveyor_jobs::set_kind_limit(&app.db.pool, ws, kind, max).await;
        assert!(
            matches!(refused, Err(FlowError::InvalidName(_) | FlowError::OutOfRange(_))),
            "{kind} {max}: {refused:?}"
        );
    }
    assert!(matches!(
        conveyor_jobs::remove_kind_limit(&app.db.pool, ws, "Not A Kind").await,
        Err(FlowError::InvalidName(_))
    ));
    assert!(conveyor_jobs::list_kind_limits(&app.db.pool, ws).await.unwrap().is_empty());
    // The bounds themselves are accepted.
    conveyor_jobs::set_key_limit(&app.db.pool, ws, "store:a", rate(10_000, Duration::from_secs(86_400))).await.unwrap();
    conveyor_jobs::set_key_limit(&app.db.pool, ws, "store:b", rate(1, Duration::from_millis(1))).await.unwrap();
    conveyor_jobs::set_kind_limit(&app.db.pool, ws, "test.slow", 1_000_000).await.unwrap();
}
