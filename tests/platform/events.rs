//! Job events across processes (`subscribe_events`): starts, progress, retries, stalls and ends, each job's in the order
//! it lived them, filtered, walled per workspace; a start is written only while a subscription wants it.

use std::time::Duration;

use conveyor_jobs::{
    EnqueueOptions, EventFilter, Handler, JobContext, JobError, JobEvent, JobEventType, JobEvents, JobId, JobKind,
    Outcome, Worker, WorkerSettings, WorkspaceId,
};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::kit::Platform;

#[derive(Serialize, Deserialize)]
struct Sync {
    /// Fail the first run.
    flaky: bool,
}

impl JobKind for Sync {
    const KIND: &'static str = "test.sync";
    const QUEUE: &'static str = "test-syncs";
    const MAX_ATTEMPTS: u32 = 3;
    const BACKOFF: conveyor_jobs::Backoff = conveyor_jobs::Backoff { base: Duration::ZERO, max: Duration::ZERO };
}

/// Reports its run as progress; a flaky job's first run then fails.
struct Syncer;

impl Handler<Sync> for Syncer {
    async fn handle(&self, job: Sync, cx: &mut JobContext) -> Result<Value, JobError> {
        cx.progress(json!({ "run": cx.attempt() })).await?;
        if job.flaky && cx.attempt() == 1 {
            return Err(JobError::retryable("the store timed out"));
        }
        Ok(json!({ "synced": true }))
    }
}

async fn worker(platform: &Platform, name: &str, settings: WorkerSettings) -> Worker {
    Worker::builder(platform.pool.clone(), platform.consumer(name).await)
        .runtime_pool(platform.runtime_pool.clone())
        .settings(settings)
        .handle::<Sync>(Syncer)
        .build()
        .unwrap()
}

async fn enqueue(platform: &Platform, ws: WorkspaceId, job: Sync) -> JobId {
    let mut tx = conveyor_jobs::begin_workspace(&platform.pool, ws).await.unwrap();
    let id = conveyor_jobs::enqueue_tx(&mut tx, &job, EnqueueOptions::new()).await.unwrap().id;
    tx.commit().await.unwrap();
    id
}

/// The next `n` events, each within 30 s.
async fn next(events: &mut JobEvents, n: usize) -> Vec<JobEvent> {
    let mut heard = Vec::new();
    for _ in 0..n {
        match tokio::time::timeout(Duration::from_secs(30), events.next()).await {
            Ok(event) => heard.push(event.unwrap()),
            Err(_) => panic!("{n} events within 30 s each; heard {:?}", seen(&heard)),
        }
    }
    heard
}

/// Nothing more within half a second.
async fn silent(events: &mut JobEvents) {
    if let Ok(e) = tokio::time::timeout(Duration::from_millis(500), events.next()).await {
        panic!("heard more: {:?}", e.map(|e| (e.event, e.job.id)));
    }
}

fn seen(events: &[JobEvent]) -> Vec<(JobEventType, u32)> {
    events.iter().map(|e| (e.event, e.attempt)).collect()
}

#[tokio::test]
async fn a_subscription_hears_each_event_of_a_job_in_the_order_it_lived_them_and_only_its_workspaces() {
    let platform = Platform::new(8).await;
    let (ws, other) = (WorkspaceId(Uuid::new_v4()), WorkspaceId(Uuid::new_v4()));
    let mut all = conveyor_jobs::subscribe_events(&platform.pool, ws, EventFilter::all()).await.unwrap();
    let mut progress = conveyor_jobs::subscribe_events(
        &platform.pool,
        ws,
        EventFilter::all().events([JobEventType::Progress]).kind(Sync::KIND),
    )
    .await
    .unwrap();
    let mut ends = conveyor_jobs::subscribe(&platform.pool, ws).await.unwrap();
    let flaky = enqueue(&platform, ws, Sync { flaky: true }).await;
    enqueue(&platform, other, Sync { flaky: true }).await;
    let dispatcher = platform.dispatcher(|_| {}).await;
    let worker = worker(&platform, "events", WorkerSettings::default()).await;
    worker.ensure_groups().await.unwrap();
    let outcomes = conveyor_jobs::testing::drain(&dispatcher, &worker).await.unwrap();
    assert_eq!(outcomes.iter().filter(|&&o| o == Outcome::Succeeded).count(), 2, "{outcomes:?}");

    let heard = next(&mut all, 6).await;
    assert!(heard.iter().all(|e| e.job.id == flaky && e.job.kind == Sync::KIND), "only its workspace's job");
    use JobEventType::*;
    assert_eq!(
        seen(&heard),
        [(Active, 1), (Progress, 1), (Retrying, 1), (Active, 2), (Progress, 2), (Completed, 2)],
        "in the order the job lived them"
    );
    assert!(heard.windows(2).all(|w| w[0].at <= w[1].at));
    assert_eq!(heard[1].progress, Some(json!({ "run": 1 })));
    assert_eq!(heard[2].error.as_deref(), Some("the store timed out"));
    assert_eq!(heard[5].job.result, Some(json!({ "synced": true })));
    silent(&mut all).await;

    let heard = next(&mut progress, 2).await;
    assert_eq!(seen(&heard), [(Progress, 1), (Progress, 2)], "only what its filter asks for");
    silent(&mut progress).await;
    let end = tokio::time::timeout(Duration::from_secs(30), ends.next()).await.unwrap().unwrap();
    assert_eq!((end.id, end.status), (flaky, conveyor_jobs::JobStatus::Succeeded), "`subscribe` hears the end alone");

    // A subscriber that stopped resumes from the time of the last event it handled, and hears the rest again.
    let mut resumed =
        conveyor_jobs::subscribe_events(&platform.pool, ws, EventFilter::all().job(flaky).since(heard[1].at))
            .await
            .unwrap();
    let again = next(&mut resumed, 2).await;
    assert_eq!(seen(&again), [(Progress, 2), (Completed, 2)]);
}

#[tokio::test]
async fn a_start_is_written_only_while_a_subscription_wants_it() {
    let platform = Platform::new(8).await;
    let ws = WorkspaceId(Uuid::new_v4());
    let dispatcher = platform.dispatcher(|_| {}).await;
    let events_of = |job: JobId| {
        let owner_url = platform.owner_url.clone();
        async move {
            use sqlx::Connection;
            let mut owner = sqlx::PgConnection::connect(&owner_url).await.unwrap();
            let events: Vec<String> =
                sqlx::query_scalar("SELECT event FROM conveyor.job_events WHERE job_id = $1 ORDER BY id")
                    .bind(job.0)
                    .fetch_all(&mut owner)
                    .await
                    .unwrap();
            events
        }
    };

    // Only ends wanted: no registration, no start written.
    let ends = conveyor_jobs::subscribe_events(&platform.pool, ws, EventFilter::all().events(JobEventType::ENDS))
        .await
        .unwrap();
    assert!(!ends.is_registered());
    let quiet = enqueue(&platform, ws, Sync { flaky: false }).await;
    let first = worker(&platform, "quiet", WorkerSettings::default()).await;
    first.ensure_groups().await.unwrap();
    assert_eq!(conveyor_jobs::testing::drain(&dispatcher, &first).await.unwrap(), [Outcome::Succeeded]);
    assert_eq!(events_of(quiet).await, ["progress"], "a progress is always recorded, a start is not");

    // Progress wanted, not starts: registered (announced), still no start written.
    let progress =
        conveyor_jobs::subscribe_events(&platform.pool, ws, EventFilter::all().events([JobEventType::Progress]))
            .await
            .unwrap();
    assert!(progress.is_registered());
    let announced = enqueue(&platform, ws, Sync { flaky: false }).await;
    let second = worker(&platform, "announced", WorkerSettings::default()).await;
    assert_eq!(conveyor_jobs::testing::drain(&dispatcher, &second).await.unwrap(), [Outcome::Succeeded]);
    assert_eq!(events_of(announced).await, ["progress"]);

    // Starts wanted: written. Once that subscription is dropped, they are not any more.
    let active = conveyor_jobs::subscribe_events(&platform.pool, ws, EventFilter::all().events([JobEventType::Active]))
        .await
        .unwrap();
    let listened = enqueue(&platform, ws, Sync { flaky: false }).await;
    let third = worker(&platform, "listened", WorkerSettings::default()).await;
    assert_eq!(conveyor_jobs::testing::drain(&dispatcher, &third).await.unwrap(), [Outcome::Succeeded]);
    assert_eq!(events_of(listened).await, ["active", "progress"]);
    drop(active);
    drop(progress);
    crate::kit::eventually(Duration::from_secs(10), || async {
        let open: i64 = sqlx::query_scalar("SELECT count(*) FROM conveyor.conveyor_event_listened_workspaces()")
            .fetch_one(&platform.runtime_pool)
            .await
            .unwrap();
        (open == 0).then_some(())
    })
    .await
    .expect("a dropped subscription removes its registration");
    let after = enqueue(&platform, ws, Sync { flaky: false }).await;
    let fourth = worker(&platform, "after", WorkerSettings::default()).await;
    assert_eq!(conveyor_jobs::testing::drain(&dispatcher, &fourth).await.unwrap(), [Outcome::Succeeded]);
    assert_eq!(events_of(after).await, ["progress"]);
    drop(ends);
}

#[tokio::test]
async fn a_job_whose_worker_stopped_is_heard_stalled_before_another_worker_starts_it() {
    let platform = Platform::new(8).await;
    let ws = WorkspaceId(Uuid::new_v4());
    let mut events = conveyor_jobs::subscribe_events(&platform.pool, ws, EventFilter::all()).await.unwrap();
    let job = enqueue(&platform, ws, Sync { flaky: false }).await;
    platform.dispatcher(|_| {}).await.dispatch_once().await.unwrap();
    // A worker that read the entry and stopped without running it: the entry stays pending under its name.
    let dead = platform.consumer("stopped").await;
    dead.ensure_group(Sync::QUEUE).await.unwrap();
    assert_eq!(dead.read(Sync::QUEUE, 1, 0).await.unwrap().len(), 1);

    let settings = WorkerSettings {
        visibility: Duration::from_millis(300),
        reclaim_interval: Duration::from_millis(50),
        ..WorkerSettings::default()
    };
    let rescuer = worker(&platform, "rescuer", settings).await;
    let shutdown = CancellationToken::new();
    tokio::spawn(rescuer.run(shutdown.clone(), Duration::from_secs(5)));
    let heard = next(&mut events, 4).await;
    shutdown.cancel();
    use JobEventType::*;
    assert!(heard.iter().all(|e| e.job.id == job));
    assert_eq!(seen(&heard), [(Stalled, 1), (Active, 1), (Progress, 1), (Completed, 1)]);
}

#[tokio::test]
async fn maintenance_removes_events_past_an_hour_and_subscriptions_that_expired() {
    let platform = Platform::new(8).await;
    let ws = WorkspaceId(Uuid::new_v4());
    let (old, recent) =
        (enqueue(&platform, ws, Sync { flaky: true }).await, enqueue(&platform, ws, Sync { flaky: false }).await);
    let dispatcher = platform.dispatcher(|_| {}).await;
    let worker = worker(&platform, "purged", WorkerSettings::default()).await;
    worker.ensure_groups().await.unwrap();
    conveyor_jobs::testing::drain(&dispatcher, &worker).await.unwrap();
    // The first job's events (two progress, a retry) are made two hours old; a subscription left behind by a process
    // that died expired long ago.
    let mut owner = platform.owner().await;
    sqlx::query("SELECT set_config('app.workspace_id', $1, false)")
        .bind(ws.0.to_string())
        .execute(&mut owner)
        .await
        .unwrap();
    let aged = sqlx::query("UPDATE conveyor.job_events SET at = at - interval '2 hours' WHERE job_id = $1")
        .bind(old.0)
        .execute(&mut owner)
        .await
        .unwrap()
        .rows_affected();
    assert_eq!(aged, 3);
    // And one that claims to live a day, which no subscription does (one renews a one-minute lease): the workers ignore
    // it, so that no row can make them write every start for good.
    sqlx::query(
        "INSERT INTO conveyor.event_listeners (id, workspace_id, active, expires_at)
         VALUES (gen_random_uuid(), $1, true, now() - interval '1 hour'), (gen_random_uuid(), $1, true, now() + interval '1 day')",
    )
    .bind(ws.0)
    .execute(&mut owner)
    .await
    .unwrap();
    let listened: i64 = sqlx::query_scalar("SELECT count(*) FROM conveyor.conveyor_event_listened_workspaces()")
        .fetch_one(&platform.runtime_pool)
        .await
        .unwrap();
    assert_eq!(listened, 0);

    let pass = crate::expiry::maintenance_pass(&platform).await;
    assert_eq!(pass.job_events_purged, 5, "three events and two subscriptions");
    let left: Vec<(Uuid, String)> = sqlx::query_as("SELECT job_id, event FROM conveyor.job_events ORDER BY id")
        .fetch_all(&mut owner)
        .await
        .unwrap();
    assert_eq!(left, [(recent.0, "progress".to_owned())], "the recent event stays");
    assert_eq!(crate::expiry::maintenance_pass(&platform).await.job_events_purged, 0);
}

#[tokio::test]
async fn in_the_single_role_mode_a_subscription_hears_its_workspace_alone() {
    // One role owns everything and reads every workspace's rows: the subscription names its workspace itself.
    let platform = Platform::single_role().await;
    let (ws, other) = (WorkspaceId(Uuid::new_v4()), WorkspaceId(Uuid::new_v4()));
    let mut events = conveyor_jobs::subscribe_events(&platform.pool, ws, EventFilter::all()).await.unwrap();
    let mut ends = conveyor_jobs::subscribe(&platform.pool, ws).await.unwrap();
    enqueue(&platform, other, Sync { flaky: true }).await;
    let mine = enqueue(&platform, ws, Sync { flaky: false }).await;
    let dispatcher = platform.dispatcher(|_| {}).await;
    let worker = worker(&platform, "single", WorkerSettings::default()).await;
    worker.ensure_groups().await.unwrap();
    conveyor_jobs::testing::drain(&dispatcher, &worker).await.unwrap();
    let heard = next(&mut events, 3).await;
    use JobEventType::*;
    assert_eq!(seen(&heard), [(Active, 1), (Progress, 1), (Completed, 1)]);
    assert!(heard.iter().all(|e| e.job.id == mine), "another workspace's job was heard");
    silent(&mut events).await;
    let end = tokio::time::timeout(Duration::from_secs(30), ends.next()).await.unwrap().unwrap();
    assert_eq!(end.id, mine);
    assert!(tokio::time::timeout(Duration::from_millis(500), ends.next()).await.is_err(), "another workspace's end");
}
