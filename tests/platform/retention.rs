//! Retention per job and kind, as a team leaving BullMQ sets it (`removeOnComplete: true | N | { age, count }`,
//! `removeOnFail`): jobs relayed and run for real, then maintenance passes against the runtime role.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use conveyor_jobs::{
    Dispatcher, EnqueueOptions, Handler, JobContext, JobError, JobId, JobKind, JobStatus, Keep, Worker, WorkspaceId,
};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

use crate::kit::Platform;

#[derive(Serialize, Deserialize)]
struct Ping {
    n: u32,
    fail: bool,
}

impl JobKind for Ping {
    const KIND: &'static str = "test.ping";
    const QUEUE: &'static str = "test-pings";
    const MAX_ATTEMPTS: u32 = 1;
}

/// A kind that keeps its newest two succeeded jobs, and its newest failed one.
#[derive(Serialize, Deserialize)]
struct Tick {
    n: u32,
    #[serde(default)]
    fail: bool,
}

impl JobKind for Tick {
    const KIND: &'static str = "test.tick";
    const QUEUE: &'static str = "test-pings";
    const MAX_ATTEMPTS: u32 = 1;
    const KEEP_SUCCEEDED: Keep = Keep::last(2);
    const KEEP_FAILED: Keep = Keep::last(1);
}

#[derive(Clone, Default)]
struct Runs(Arc<Mutex<u32>>);

impl Handler<Ping> for Runs {
    async fn handle(&self, job: Ping, cx: &mut JobContext) -> Result<Value, JobError> {
        *self.0.lock().unwrap() += 1;
        cx.log(format!("ping {}", job.n)).await;
        if job.fail {
            return Err(JobError::permanent(format!("ping {} asked to fail", job.n)));
        }
        Ok(Value::Null)
    }
}

impl Handler<Tick> for Runs {
    async fn handle(&self, job: Tick, _: &mut JobContext) -> Result<Value, JobError> {
        *self.0.lock().unwrap() += 1;
        if job.fail {
            return Err(JobError::permanent(format!("tick {} asked to fail", job.n)));
        }
        Ok(Value::Null)
    }
}

async fn parts(platform: &Platform) -> (Dispatcher, Worker) {
    let dispatcher = platform.dispatcher(|_| {}).await;
    let runs = Runs::default();
    let worker = Worker::builder(platform.pool.clone(), platform.consumer("retention").await)
        .runtime_pool(platform.runtime_pool.clone())
        .handle::<Ping>(runs.clone())
        .handle::<Tick>(runs)
        .build()
        .unwrap();
    worker.ensure_groups().await.unwrap();
    (dispatcher, worker)
}

async fn enqueue<K: JobKind>(platform: &Platform, ws: WorkspaceId, job: &K, options: EnqueueOptions) -> JobId {
    let mut tx = conveyor_jobs::begin_workspace(&platform.pool, ws).await.unwrap();
    let id = conveyor_jobs::enqueue_tx(&mut tx, job, options).await.unwrap().id;
    tx.commit().await.unwrap();
    id
}

/// One maintenance pass with the global retention `outbox_retention` for ended jobs.
async fn pass(platform: &Platform, outbox_retention: Duration) -> conveyor_jobs::PassReport {
    conveyor_jobs::Maintenance::new(
        platform.runtime_pool.clone(),
        crate::kit::redis().await,
        platform.keys(),
        conveyor_jobs::Metrics::new(),
        Duration::from_secs(60),
        outbox_retention,
        Duration::from_secs(3600),
    )
    .run_once()
    .await
    .unwrap()
}

/// The job's status, and whether its row is still there (`None`: deleted).
async fn row(platform: &Platform, id: JobId) -> Option<String> {
    let mut owner = platform.owner().await;
    sqlx::query_scalar("SELECT status FROM conveyor.outbox_events WHERE id = $1")
        .bind(id.0)
        .fetch_optional(&mut owner)
        .await
        .unwrap()
}

fn ping(n: u32) -> Ping {
    Ping { n, fail: false }
}

const WEEK: Duration = Duration::from_secs(7 * 86_400);

#[tokio::test]
async fn a_succeeded_job_kept_for_none_goes_at_the_next_pass_one_kept_for_an_age_once_it_is_over() {
    let platform = Platform::new(8).await;
    let ws = WorkspaceId(Uuid::new_v4());
    let (dispatcher, worker) = parts(&platform).await;
    let none = enqueue(&platform, ws, &ping(1), EnqueueOptions::new().keep_succeeded(Keep::none())).await;
    let second = Keep::for_age(Duration::from_secs(1));
    let aged = enqueue(&platform, ws, &ping(2), EnqueueOptions::new().keep_succeeded(second)).await;
    let global = enqueue(&platform, ws, &ping(3), EnqueueOptions::new()).await;
    // A job removed at once has no say while it is queued: a live job is never removed.
    let live = enqueue(&platform, ws, &ping(4), EnqueueOptions::new().keep_succeeded(Keep::none()).delay(WEEK)).await;
    conveyor_jobs::testing::drain(&dispatcher, &worker).await.unwrap();

    assert_eq!(pass(&platform, WEEK).await.kept_jobs_purged, 1);
    assert_eq!(row(&platform, none).await, None, "removeOnComplete: true");
    assert_eq!(row(&platform, aged).await.as_deref(), Some("completed"), "kept for a second");
    assert_eq!(row(&platform, global).await.as_deref(), Some("completed"));
    assert_eq!(row(&platform, live).await.as_deref(), Some("pending"));

    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(pass(&platform, WEEK).await.kept_jobs_purged, 1);
    assert_eq!(row(&platform, aged).await, None, "its second is over");
    assert_eq!(row(&platform, global).await.as_deref(), Some("completed"), "the week is not");
    assert_eq!(conveyor_jobs::get_job(&platform.pool, ws, aged).await.unwrap().map(|j| j.status), None);
}

#[tokio::test]
async fn a_kind_keeps_its_newest_n_succeeded_jobs_per_workspace_and_the_global_age_caps_every_keep() {
    let platform = Platform::new(8).await;
    let (ws, other_ws) = (WorkspaceId(Uuid::new_v4()), WorkspaceId(Uuid::new_v4()));
    let (dispatcher, worker) = parts(&platform).await;
    let mut ticks = Vec::new();
    for n in 0..5 {
        ticks.push(enqueue(&platform, ws, &Tick { n, fail: false }, EnqueueOptions::new()).await);
        // One at a time, so that their ends are in this order.
        conveyor_jobs::testing::drain(&dispatcher, &worker).await.unwrap();
    }
    let other = enqueue(&platform, other_ws, &Tick { n: 9, fail: false }, EnqueueOptions::new()).await;
    // A tick of its own count is counted among the ticks of that count alone: kept.
    let own = EnqueueOptions::new().keep_succeeded(Keep::last(5));
    let own = enqueue(&platform, ws, &Tick { n: 8, fail: false }, own).await;
    let kept_long = Keep::for_age(Duration::from_secs(3600));
    let long = enqueue(&platform, ws, &ping(1), EnqueueOptions::new().keep_succeeded(kept_long)).await;
    let plain = enqueue(&platform, ws, &ping(2), EnqueueOptions::new()).await;
    conveyor_jobs::testing::drain(&dispatcher, &worker).await.unwrap();

    // A week of global retention: only the kind's count removes, its three oldest in `ws`.
    assert_eq!(pass(&platform, WEEK).await.kept_jobs_purged, 3);
    let mut left = Vec::new();
    for id in &ticks {
        left.push(row(&platform, *id).await.is_some());
    }
    assert_eq!(left, [false, false, false, true, true], "the newest two are kept");
    assert!(row(&platform, other).await.is_some(), "another workspace counts its own");
    assert_eq!(pass(&platform, WEEK).await.kept_jobs_purged, 0, "nothing more past it");

    assert!(row(&platform, own).await.is_some(), "its own count of five");
    assert!(row(&platform, long).await.is_some() && row(&platform, plain).await.is_some());

    // A global retention of nothing deletes every ended job: it caps a count, and an age of a job's own.
    let report = pass(&platform, Duration::ZERO).await;
    for id in [plain, long, own, ticks[4], other] {
        assert_eq!(row(&platform, id).await, None);
    }
    assert_eq!(report.outbox_purged, 6, "two pings, three ticks of ws and the other workspace's");
}

#[tokio::test]
async fn a_failed_job_past_its_own_or_its_kinds_keep_is_discarded_with_its_failures_and_log_and_the_others_stay() {
    let platform = Platform::new(8).await;
    let ws = WorkspaceId(Uuid::new_v4());
    let (dispatcher, worker) = parts(&platform).await;
    let failing = Ping { n: 1, fail: true };
    let gone = enqueue(&platform, ws, &failing, EnqueueOptions::new().keep_failed(Keep::none())).await;
    let kept = enqueue(&platform, ws, &failing, EnqueueOptions::new()).await;
    // The kind keeps its newest failed tick; a tick that says "global" keeps the global retention instead.
    let older = enqueue(&platform, ws, &Tick { n: 1, fail: true }, EnqueueOptions::new()).await;
    conveyor_jobs::testing::drain(&dispatcher, &worker).await.unwrap();
    let newer = enqueue(&platform, ws, &Tick { n: 2, fail: true }, EnqueueOptions::new()).await;
    let own = enqueue(&platform, ws, &Tick { n: 3, fail: true }, EnqueueOptions::new().keep_failed(Keep::GLOBAL)).await;
    conveyor_jobs::testing::drain(&dispatcher, &worker).await.unwrap();
    let status = |id| {
        let pool = platform.pool.clone();
        async move { conveyor_jobs::get_job(&pool, ws, id).await.unwrap().map(|j| j.status) }
    };
    assert_eq!(status(gone).await, Some(JobStatus::Failed));
    assert!(!conveyor_jobs::get_job_logs(&platform.pool, ws, gone).await.unwrap().is_empty());

    assert_eq!(pass(&platform, WEEK).await.kept_jobs_purged, 2);
    // Discarded as an operator's discard does: a tombstone, its payload, failures and log gone.
    assert_eq!(row(&platform, gone).await.as_deref(), Some("discarded"));
    assert_eq!(row(&platform, older).await.as_deref(), Some("discarded"), "beyond the kind's newest one");
    assert_eq!(status(newer).await, Some(JobStatus::Failed));
    assert_eq!(status(own).await, Some(JobStatus::Failed), "its own setting wins over its kind's");
    assert_eq!(status(kept).await, Some(JobStatus::Failed), "the dead letters' retention keeps it");
    let mut owner = platform.owner().await;
    let (failures, logs, payload): (i64, i64, Value) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM conveyor.job_failures WHERE job_id = $1),
                (SELECT count(*) FROM conveyor.job_logs WHERE job_id = $1), event_payload
         FROM conveyor.outbox_events WHERE id = $1",
    )
    .bind(gone.0)
    .fetch_one(&mut owner)
    .await
    .unwrap();
    assert_eq!((failures, logs, payload), (0, 0, serde_json::json!({})));
    let audited: serde_json::Value = sqlx::query_scalar(
        "SELECT arguments FROM conveyor.conveyor_admin_audit WHERE action = 'kept_jobs_purge' ORDER BY id DESC LIMIT 1",
    )
    .fetch_one(&mut owner)
    .await
    .unwrap();
    assert_eq!(audited["discarded"], 2, "{audited}");
}
