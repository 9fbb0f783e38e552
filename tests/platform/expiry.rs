//! Expiring jobs (`EnqueueOptions::expire_at`, `start_within`): a job never starts after its deadline. The worker that
//! takes one from its stream past its deadline cancels it as expired instead of running it; maintenance cancels those
//! still waiting in the outbox; a job before its deadline runs as any other.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use chrono::Utc;
use conveyor_jobs::{
    EnqueueOptions, Flow, Handler, JobContext, JobError, JobId, JobKind, JobStatus, Outcome, UserId, Worker,
    WorkspaceId,
};
use fred::prelude::StreamsInterface;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

use crate::kit::Platform;

#[derive(Serialize, Deserialize)]
struct Reminder {
    n: u32,
}

impl JobKind for Reminder {
    const KIND: &'static str = "test.reminder";
    const QUEUE: &'static str = "test-reminders";
}

/// Counts its runs.
#[derive(Clone, Default)]
struct Send {
    runs: Arc<AtomicU32>,
}

impl Handler<Reminder> for Send {
    async fn handle(&self, _job: Reminder, _cx: &mut JobContext) -> Result<Value, JobError> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        Ok(Value::Null)
    }
}

async fn worker(platform: &Platform, send: &Send) -> Worker {
    let worker = Worker::builder(platform.pool.clone(), platform.consumer("expiry").await)
        .runtime_pool(platform.runtime_pool.clone())
        .handle::<Reminder>(send.clone())
        .build()
        .unwrap();
    worker.ensure_groups().await.unwrap();
    worker
}

async fn enqueue(platform: &Platform, ws: WorkspaceId, options: EnqueueOptions) -> JobId {
    let mut tx = conveyor_jobs::begin_workspace(&platform.pool, ws).await.unwrap();
    let id = conveyor_jobs::enqueue_tx(&mut tx, &Reminder { n: 1 }, options).await.unwrap().id;
    tx.commit().await.unwrap();
    id
}

async fn job(platform: &Platform, ws: WorkspaceId, id: JobId) -> conveyor_jobs::JobInfo {
    conveyor_jobs::get_job(&platform.pool, ws, id).await.unwrap().unwrap()
}

async fn maintenance_pass(platform: &Platform) -> conveyor_jobs::PassReport {
    let maintenance = conveyor_jobs::Maintenance::new(
        platform.runtime_pool.clone(),
        crate::kit::redis().await,
        platform.keys(),
        conveyor_jobs::Metrics::new(),
        Duration::from_secs(60),
        Duration::from_secs(3600),
        Duration::from_secs(3600),
    );
    maintenance.run_once().await.unwrap()
}

/// Waits until PostgreSQL's clock is past `id`'s deadline (no timing is asserted: the test needs the deadline gone).
async fn past_deadline(platform: &Platform, ws: WorkspaceId, id: JobId) {
    let deadline = job(platform, ws, id).await.expires_at.expect("a deadline");
    let left = (deadline - Utc::now()).to_std().unwrap_or_default();
    tokio::time::sleep(left + Duration::from_millis(50)).await;
    crate::kit::eventually(Duration::from_secs(5), || async {
        let now: chrono::DateTime<Utc> = sqlx::query_scalar("SELECT now()").fetch_one(&platform.pool).await.unwrap();
        (now > deadline).then_some(())
    })
    .await
    .expect("PostgreSQL's clock passes the deadline");
}

#[tokio::test]
async fn a_job_taken_from_its_stream_past_its_deadline_is_canceled_as_expired_with_its_operation_and_never_runs() {
    let platform = Platform::new(8).await;
    let ws = WorkspaceId(Uuid::new_v4());
    let send = Send::default();
    let worker = worker(&platform, &send).await;
    let dispatcher = platform.dispatcher(|_| {}).await;

    // An operation the user follows, and a job advancing it that must start within 400 ms; another with an hour.
    let mut tx = conveyor_jobs::begin_workspace(&platform.pool, ws).await.unwrap();
    let operation =
        conveyor_jobs::create_operation_tx(&mut tx, ws, UserId(Uuid::new_v4()), "test.reminder", None).await.unwrap();
    let options = EnqueueOptions::new().operation(operation.id).start_within(Duration::from_millis(400));
    let late = conveyor_jobs::enqueue_tx(&mut tx, &Reminder { n: 1 }, options).await.unwrap().id;
    tx.commit().await.unwrap();
    let in_time = enqueue(&platform, ws, EnqueueOptions::new().start_within(Duration::from_secs(3600))).await;
    let info = job(&platform, ws, late).await;
    assert_eq!(info.expires_at, Some(info.run_at + chrono::Duration::milliseconds(400)), "due time + start_within");

    // Both are relayed into the stream in time; no worker reads them before the first's deadline.
    dispatcher.dispatch_once().await.unwrap();
    assert_eq!(job(&platform, ws, late).await.status, JobStatus::Active);
    past_deadline(&platform, ws, late).await;

    let mut outcomes = Vec::new();
    while let Some(outcome) = worker.process_one().await.unwrap() {
        outcomes.push(outcome);
    }
    outcomes.sort_by_key(|o| format!("{o:?}"));
    assert_eq!(outcomes, [Outcome::Expired, Outcome::Succeeded]);
    assert_eq!(send.runs.load(Ordering::SeqCst), 1, "only the job in time ran");

    let expired = job(&platform, ws, late).await;
    assert_eq!(expired.status, JobStatus::Canceled);
    assert_eq!(expired.last_error.as_deref(), Some("expired: not started by its deadline"));
    assert!(expired.finished_at.is_some_and(|at| at >= expired.expires_at.unwrap()));
    assert_eq!(job(&platform, ws, in_time).await.status, JobStatus::Succeeded);
    let mut tx = conveyor_jobs::begin_workspace(&platform.pool, ws).await.unwrap();
    let operation = conveyor_jobs::get_operation_tx(&mut tx, operation.id).await.unwrap().unwrap();
    tx.commit().await.unwrap();
    assert_eq!((operation.status.as_str(), operation.error.as_deref()), ("canceled", expired.last_error.as_deref()));

    // Both entries were acknowledged: nothing is left to run or to take over.
    assert_eq!(worker.process_one().await.unwrap(), None);
    let (client, keys) = (crate::kit::redis().await, platform.keys());
    let summary: fred::types::Value =
        client.xpending(keys.stream(Reminder::QUEUE), keys.group(Reminder::QUEUE), ()).await.unwrap();
    let fred::types::Value::Array(summary) = summary else { panic!("XPENDING answered {summary:?}") };
    assert_eq!(summary[0].as_i64(), Some(0), "no entry is left unacknowledged");
}

#[tokio::test]
async fn jobs_waiting_past_their_deadline_are_canceled_by_maintenance_and_a_flows_expired_parent_cancels_its_children()
{
    let platform = Platform::new(8).await;
    let (ws, other) = (WorkspaceId(Uuid::new_v4()), WorkspaceId(Uuid::new_v4()));
    let soon = || EnqueueOptions::new().expire_at(Utc::now() + chrono::Duration::milliseconds(400));
    // Nothing relays them before their deadline: a job due at once, and a batch of two beside one without a deadline.
    let alone = enqueue(&platform, ws, soon()).await;
    let mut tx = conveyor_jobs::begin_workspace(&platform.pool, other).await.unwrap();
    let batch = conveyor_jobs::enqueue_many_tx(
        &mut tx,
        [
            (&Reminder { n: 1 }, soon()),
            (&Reminder { n: 2 }, EnqueueOptions::new()),
            (&Reminder { n: 3 }, EnqueueOptions::new().start_within(Duration::from_millis(300))),
        ],
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    // A parent that must start within 400 ms of its enqueue, waiting for a child due in an hour.
    let child = Flow::job(&Reminder { n: 4 }, EnqueueOptions::new().delay(Duration::from_secs(3600))).unwrap();
    let flow = Flow::job(&Reminder { n: 5 }, EnqueueOptions::new().start_within(Duration::from_millis(400)))
        .unwrap()
        .child(child);
    let mut tx = conveyor_jobs::begin_workspace(&platform.pool, ws).await.unwrap();
    let flow = conveyor_jobs::enqueue_flow_tx(&mut tx, flow).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(job(&platform, ws, flow.id).await.status, JobStatus::WaitingChildren);
    assert!(job(&platform, ws, flow.children[0].id).await.expires_at.is_none());

    // Before the deadline, maintenance leaves them alone.
    assert_eq!(maintenance_pass(&platform).await.expired, 0);
    past_deadline(&platform, ws, alone).await;
    past_deadline(&platform, ws, flow.id).await;
    past_deadline(&platform, other, batch[2].id).await;

    let report = maintenance_pass(&platform).await;
    assert_eq!(report.expired, 4, "the one alone, two of the batch, the parent: {report:?}");
    for (workspace, id) in [(ws, alone), (other, batch[0].id), (other, batch[2].id), (ws, flow.id)] {
        let info = job(&platform, workspace, id).await;
        assert_eq!(info.status, JobStatus::Canceled, "{id:?}");
        assert_eq!(info.last_error.as_deref(), Some("expired: not started by its deadline"), "{id:?}");
    }
    let child = job(&platform, ws, flow.children[0].id).await;
    assert_eq!((child.status, child.last_error.as_deref()), (JobStatus::Canceled, Some("its parent was canceled")));
    assert_eq!(job(&platform, other, batch[1].id).await.status, JobStatus::Queued, "no deadline, not touched");
    assert_eq!(maintenance_pass(&platform).await.expired, 0, "each expires once");

    // A worker runs only the job without a deadline.
    let send = Send::default();
    let worker = worker(&platform, &send).await;
    let dispatcher = platform.dispatcher(|_| {}).await;
    let outcomes = conveyor_jobs::testing::drain(&dispatcher, &worker).await.unwrap();
    assert_eq!(outcomes, [Outcome::Succeeded]);
    assert_eq!(send.runs.load(Ordering::SeqCst), 1);
}
