//! Global limits against real PostgreSQL and Redis (migration 0062): a queue's or a kind's concurrency and rate hold
//! every workspace's jobs together, the workspaces take turns in the room, a workspace's own limits still apply, and
//! bad limits are refused with nothing written.

use crate::common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use common::{TestApp, principal};
use conveyor_jobs::{
    Consumer, EnqueueOptions, FlowError, GlobalLimit, GlobalScope, Handler, JobContext, JobError, JobId, JobKind,
    JobStatus, Worker, WorkerSettings, WorkspaceId,
};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

/// A call to a provider every workspace shares; the payload names its workspace, so that the handler knows it.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Call {
    workspace: usize,
}

impl JobKind for Call {
    const KIND: &'static str = "test.provider_call";
    const QUEUE: &'static str = "provider";
}

/// What the handler saw: the workspace of each start in order, and how many ran at once (in all, and per workspace).
#[derive(Default)]
struct Seen {
    starts: Mutex<Vec<usize>>,
    running: AtomicUsize,
    max_running: AtomicUsize,
    running_of: Mutex<HashMap<usize, usize>>,
    max_running_of: Mutex<HashMap<usize, usize>>,
}

struct Caller {
    seen: Arc<Seen>,
    /// How long a job of each workspace takes (the last one for workspaces past the list).
    costs: Vec<Duration>,
}

impl Handler<Call> for Caller {
    async fn handle(&self, job: Call, _: &mut JobContext) -> Result<Value, JobError> {
        let seen = &self.seen;
        seen.starts.lock().unwrap().push(job.workspace);
        let now = seen.running.fetch_add(1, Ordering::SeqCst) + 1;
        seen.max_running.fetch_max(now, Ordering::SeqCst);
        {
            let mut running = seen.running_of.lock().unwrap();
            let mine = running.entry(job.workspace).or_default();
            *mine += 1;
            let mut max = seen.max_running_of.lock().unwrap();
            let most = max.entry(job.workspace).or_default();
            *most = (*most).max(*mine);
        }
        tokio::time::sleep(self.costs[job.workspace.min(self.costs.len() - 1)]).await;
        *seen.running_of.lock().unwrap().get_mut(&job.workspace).unwrap() -= 1;
        seen.running.fetch_sub(1, Ordering::SeqCst);
        Ok(json!(null))
    }
}

/// A worker of 8 slots, and two dispatchers: their claims of one limit take turns on its row.
async fn platform(app: &TestApp, seen: &Arc<Seen>, costs: &[Duration], shutdown: &CancellationToken) {
    let worker =
        Worker::builder(app.db.pool.clone(), Consumer::connect(&common::redis_url(), &app.redis_prefix).await.unwrap())
            .runtime_pool(app.db.runtime_pool.clone())
            .handle::<Call>(Caller { seen: seen.clone(), costs: costs.to_vec() })
            .settings(WorkerSettings { concurrency: 8, ..WorkerSettings::default() })
            .build()
            .unwrap();
    tokio::spawn(worker.run(shutdown.clone(), Duration::from_secs(5)));
    for _ in 0..2 {
        let dispatcher = common::test_dispatcher(app, &common::redis_url(), |v| {
            v.insert("CONVEYOR_DISPATCH_POLL".into(), "100ms".into());
        })
        .await;
        common::run_dispatcher(dispatcher, shutdown);
    }
}

async fn operator(app: &TestApp) -> PgPool {
    conveyor_jobs::connect_postgres(&app.db.operator_url, 2).await.unwrap()
}

async fn enqueue(app: &TestApp, ws: WorkspaceId, workspace: usize, n: usize) -> Vec<JobId> {
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
    let jobs: Vec<Call> = (0..n).map(|_| Call { workspace }).collect();
    let ids = conveyor_jobs::enqueue_many_tx(&mut tx, jobs.iter().map(|j| (j, EnqueueOptions::new()))).await.unwrap();
    tx.commit().await.unwrap();
    ids.into_iter().map(|e| e.id).collect()
}

async fn wait_all(app: &TestApp, ws: WorkspaceId, jobs: &[JobId]) {
    for job in jobs {
        let done = conveyor_jobs::wait_for_job(&app.db.pool, ws, *job, Duration::from_secs(60)).await.unwrap();
        assert_eq!(done.status, JobStatus::Succeeded, "{job:?}");
    }
}

fn concurrency(n: u32) -> GlobalLimit {
    GlobalLimit { max_in_flight: Some(n), ..GlobalLimit::default() }
}

#[tokio::test]
async fn a_global_concurrency_holds_every_workspace_together_and_each_takes_its_turn() {
    let app = TestApp::spawn().await;
    let operator = operator(&app).await;
    let scope = GlobalScope::Queue(Call::QUEUE.into());
    conveyor_jobs::set_global_limit(&operator, &scope, concurrency(2)).await.unwrap();
    let workspaces: Vec<WorkspaceId> = (0..3).map(|_| principal().workspace_id).collect();
    // The first workspace's jobs are the oldest: without turns it would take every room until it has none left.
    let mut jobs = Vec::new();
    for (i, ws) in workspaces.iter().enumerate() {
        jobs.push(enqueue(&app, *ws, i, 8).await);
    }
    let seen = Arc::new(Seen::default());
    let shutdown = CancellationToken::new();
    platform(&app, &seen, &[Duration::from_millis(100)], &shutdown).await;

    // Sampled meanwhile: the operator's view never counts more than 2 in flight.
    let sampler = {
        let operator = operator.clone();
        tokio::spawn(async move {
            let mut most = 0;
            for _ in 0..40 {
                let limits = conveyor_jobs::list_global_limits(&operator).await.unwrap();
                most = most.max(limits[0].in_flight);
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            most
        })
    };
    for (ws, jobs) in workspaces.iter().zip(&jobs) {
        wait_all(&app, *ws, jobs).await;
    }
    let sampled = sampler.await.unwrap();
    assert!((1..=2).contains(&sampled), "the operator saw {sampled} in flight");
    assert_eq!(seen.max_running.load(Ordering::SeqCst), 2, "at most (and, with 8 worker slots, exactly) 2 at once");
    let starts = seen.starts.lock().unwrap().clone();
    for ws in 0..3 {
        let early = starts[..9].iter().filter(|w| **w == ws).count();
        assert!(early >= 2, "workspace {ws} had {early} of the first 9 starts: {starts:?}");
    }

    // Lifted: the queue runs as wide as the workers allow.
    assert!(conveyor_jobs::remove_global_limit(&operator, &scope).await.unwrap());
    assert!(!conveyor_jobs::remove_global_limit(&operator, &scope).await.unwrap(), "nothing left to remove");
    seen.max_running.store(0, Ordering::SeqCst);
    let again = enqueue(&app, workspaces[0], 0, 8).await;
    wait_all(&app, workspaces[0], &again).await;
    assert!(seen.max_running.load(Ordering::SeqCst) > 2, "the limit no longer holds");
    shutdown.cancel();
}

#[tokio::test]
async fn a_global_rate_holds_in_any_interval_across_workspaces_and_a_flood_does_not_take_it_all() {
    let app = TestApp::spawn().await;
    let operator = operator(&app).await;
    let rate = GlobalLimit { max_per_interval: Some((5, Duration::from_secs(1))), ..GlobalLimit::default() };
    conveyor_jobs::set_global_limit(&operator, &GlobalScope::Kind(Call::KIND.into()), rate).await.unwrap();
    // A flood of 20 first, then another workspace's 5.
    let (a, b) = (principal().workspace_id, principal().workspace_id);
    let flood = enqueue(&app, a, 0, 20).await;
    let few = enqueue(&app, b, 1, 5).await;
    let seen = Arc::new(Seen::default());
    let shutdown = CancellationToken::new();
    platform(&app, &seen, &[Duration::from_millis(10)], &shutdown).await;
    wait_all(&app, a, &flood).await;
    wait_all(&app, b, &few).await;

    // The hand-outs' times by the database's clock (`dispatched_at`, a little after the claim whose time the rate goes
    // by: hence the tolerance, as for a key's rate), of both workspaces together.
    let mut times: Vec<(DateTime<Utc>, usize)> = Vec::new();
    for (i, ws) in [a, b].into_iter().enumerate() {
        for row in app.db.rows("outbox_events", ws).await {
            let at: DateTime<Utc> = row["dispatched_at"].as_str().unwrap().parse().unwrap();
            times.push((at, i));
        }
    }
    times.sort();
    assert_eq!(times.len(), 25);
    let tolerance = chrono::Duration::milliseconds(400);
    for (i, later) in times.iter().enumerate().skip(5) {
        let gap = later.0 - times[i - 5].0;
        assert!(gap >= chrono::Duration::seconds(1) - tolerance, "6 jobs handed out within {gap}: {times:?}");
    }
    let span = times[24].0 - times[0].0;
    assert!(span >= chrono::Duration::seconds(4) - tolerance, "25 jobs at 5 per second took {span}");
    // The later workspace took turns with the flood: its last job went while the flood still had many to go (first
    // come, first served, it would have gone last).
    let last_of_b = times.iter().rposition(|t| t.1 == 1).unwrap();
    let flood_after = times[last_of_b..].iter().filter(|t| t.1 == 0).count();
    assert!(flood_after >= 5, "the flood had {flood_after} left after the other's last: {times:?}");
    let limits = conveyor_jobs::list_global_limits(&operator).await.unwrap();
    assert_eq!(
        (limits[0].scope.as_str(), limits[0].max_per_interval, limits[0].interval_ms),
        ("kind", Some(5), Some(1000))
    );
    shutdown.cancel();
}

#[tokio::test]
async fn a_job_obeys_its_workspaces_limits_inside_the_global_room() {
    let app = TestApp::spawn().await;
    let operator = operator(&app).await;
    conveyor_jobs::set_global_limit(&operator, &GlobalScope::Queue(Call::QUEUE.into()), concurrency(3)).await.unwrap();
    let (a, b) = (principal().workspace_id, principal().workspace_id);
    // The first workspace allows itself one of the kind at a time, and its jobs are long. It comes first, and waits
    // in the global limit's line on its own limit: it keeps no part of the room from the second workspace, which has
    // no limit of its own.
    conveyor_jobs::set_kind_limit(&app.db.pool, a, Call::KIND, 1).await.unwrap();
    let from_a = enqueue(&app, a, 0, 4).await;
    let seen = Arc::new(Seen::default());
    let shutdown = CancellationToken::new();
    platform(&app, &seen, &[Duration::from_millis(800), Duration::from_millis(100)], &shutdown).await;
    common::eventually(Duration::from_secs(20), || async { (!seen.starts.lock().unwrap().is_empty()).then_some(()) })
        .await
        .expect("the first workspace's first job runs");
    let from_b = enqueue(&app, b, 1, 12).await;
    wait_all(&app, b, &from_b).await;
    wait_all(&app, a, &from_a).await;
    let most = seen.max_running_of.lock().unwrap().clone();
    assert_eq!(most[&0], 1, "the workspace's own kind limit");
    assert_eq!(seen.max_running.load(Ordering::SeqCst), 3, "the global room, filled by the other workspace: {most:?}");
    // The second workspace ran while the first one's first job did: the first did not hold its place at the head of
    // the line while its own limit held it.
    let starts = seen.starts.lock().unwrap().clone();
    let first_of_b = starts.iter().position(|w| *w == 1).unwrap();
    let second_of_a = starts.iter().enumerate().filter(|(_, w)| **w == 0).nth(1).map(|(i, _)| i).unwrap();
    assert!(first_of_b < second_of_a, "the other workspace waited for the first's own limit: {starts:?}");
    shutdown.cancel();
}

#[tokio::test]
async fn bad_global_limits_are_refused_and_write_nothing() {
    let app = TestApp::spawn().await;
    let operator = operator(&app).await;
    let queue = GlobalScope::Queue("provider".into());
    let refused = [
        (GlobalScope::Queue("Bad}".into()), concurrency(1)),
        (GlobalScope::Kind(String::new()), concurrency(1)),
        (queue.clone(), GlobalLimit::default()),
        (queue.clone(), concurrency(0)),
        (queue.clone(), concurrency(1_000_001)),
        (queue.clone(), GlobalLimit { max_per_interval: Some((0, Duration::from_secs(1))), max_in_flight: None }),
        (queue.clone(), GlobalLimit { max_per_interval: Some((5, Duration::from_micros(1500))), max_in_flight: None }),
        (queue.clone(), GlobalLimit { max_per_interval: Some((5, Duration::from_secs(86_401))), max_in_flight: None }),
    ];
    for (scope, limit) in refused {
        let err = conveyor_jobs::set_global_limit(&operator, &scope, limit).await.unwrap_err();
        assert!(matches!(err, FlowError::InvalidName(_) | FlowError::OutOfRange(_)), "{scope:?} {limit:?}: {err:?}");
    }
    assert!(matches!(GlobalScope::parse("shard", "x"), Err(FlowError::InvalidName(_))));
    assert_eq!(GlobalScope::parse("kind", "a.b").unwrap(), GlobalScope::Kind("a.b".into()));
    // A global limit is the operator's: the application and runtime roles may not set one, nor read the table.
    for pool in [&app.db.pool, &app.db.runtime_pool] {
        let err = conveyor_jobs::set_global_limit(pool, &queue, concurrency(1)).await.unwrap_err();
        assert!(err.to_string().contains("permission denied"), "{err}");
        let err = sqlx::query("SELECT * FROM conveyor.global_limits").execute(pool).await.unwrap_err();
        assert!(err.to_string().contains("permission denied"), "{err}");
    }
    assert!(conveyor_jobs::list_global_limits(&operator).await.unwrap().is_empty());
    assert!(!conveyor_jobs::remove_global_limit(&operator, &queue).await.unwrap());
}
