//! Expiring jobs (`EnqueueOptions::expire_at`, `start_within`): a job never starts after its deadline. The worker that
//! takes one from its stream past its deadline cancels it as expired instead of running it; maintenance cancels those
//! still waiting in the outbox; a job before its deadline runs as any other.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use chrono::Utc;
use conveyor_jobs::{
    ChildFailure, EnqueueOptions, Flow, Handler, JobContext, JobError, JobId, JobKind, JobStatus, Outcome, UserId,
    Worker, WorkspaceId,
};
use fred::prelude::StreamsInterface;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

use crate::kit::Platform;

const EXPIRED: &str = "expired: not started by its deadline";

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

pub(crate) async fn maintenance_pass(platform: &Platform) -> conveyor_jobs::PassReport {
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
async fn jobs_waiting_past_their_deadline_are_canceled_by_maintenance_and_an_expired_child_releases_its_parent() {
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
    // A child that must start within 400 ms, under a parent that ignores its failure; a parent takes no deadline.
    let child = Flow::job(&Reminder { n: 4 }, EnqueueOptions::new().start_within(Duration::from_millis(400))).unwrap();
    let flow =
        Flow::job(&Reminder { n: 5 }, EnqueueOptions::new()).unwrap().child_on_failure(child, ChildFailure::Ignore);
    let mut tx = conveyor_jobs::begin_workspace(&platform.pool, ws).await.unwrap();
    let flow = conveyor_jobs::enqueue_flow_tx(&mut tx, flow).await.unwrap();
    let with_deadline = Flow::job(&Reminder { n: 6 }, EnqueueOptions::new().start_within(Duration::from_secs(60)))
        .unwrap()
        .child(Flow::job(&Reminder { n: 7 }, EnqueueOptions::new()).unwrap());
    let refused = conveyor_jobs::enqueue_flow_tx(&mut tx, with_deadline).await.unwrap_err().to_string();
    assert!(refused.contains("takes no deadline"), "{refused}");
    tx.commit().await.unwrap();
    assert_eq!(job(&platform, ws, flow.id).await.status, JobStatus::WaitingChildren);

    // Before the deadline, maintenance leaves them alone.
    assert_eq!(maintenance_pass(&platform).await.expired, 0);
    past_deadline(&platform, ws, alone).await;
    past_deadline(&platform, ws, flow.children[0].id).await;
    past_deadline(&platform, other, batch[2].id).await;

    let report = maintenance_pass(&platform).await;
    assert_eq!(report.expired, 4, "the one alone, two of the batch, the child: {report:?}");
    for (workspace, id) in [(ws, alone), (other, batch[0].id), (other, batch[2].id), (ws, flow.children[0].id)] {
        let info = job(&platform, workspace, id).await;
        assert_eq!(info.status, JobStatus::Canceled, "{id:?}");
        assert_eq!(info.last_error.as_deref(), Some("expired: not started by its deadline"), "{id:?}");
    }
    // The expired child ended, for its parent: released.
    assert_eq!(job(&platform, ws, flow.id).await.status, JobStatus::Queued);
    assert_eq!(job(&platform, other, batch[1].id).await.status, JobStatus::Queued, "no deadline, not touched");
    assert_eq!(maintenance_pass(&platform).await.expired, 0, "each expires once");

    // A worker runs only the jobs without a deadline: the one of the batch and the parent.
    let send = Send::default();
    let worker = worker(&platform, &send).await;
    let dispatcher = platform.dispatcher(|_| {}).await;
    let outcomes = conveyor_jobs::testing::drain(&dispatcher, &worker).await.unwrap();
    assert_eq!(outcomes, [Outcome::Succeeded, Outcome::Succeeded]);
    assert_eq!(send.runs.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_de_dup_key_held_by_a_job_past_its_deadline_goes_to_the_next_enqueue() {
    let platform = Platform::new(8).await;
    let ws = WorkspaceId(Uuid::new_v4());
    let keyed = |key: &str| EnqueueOptions::new().dedup_key(key).start_within(Duration::from_millis(300));
    let first = enqueue(&platform, ws, keyed("a")).await;
    let mut tx = conveyor_jobs::begin_workspace(&platform.pool, ws).await.unwrap();
    let batch = conveyor_jobs::enqueue_many_tx(&mut tx, [(&Reminder { n: 1 }, keyed("b"))]).await.unwrap();
    tx.commit().await.unwrap();
    // While in time, the key answers its holder.
    let mut tx = conveyor_jobs::begin_workspace(&platform.pool, ws).await.unwrap();
    let again = conveyor_jobs::enqueue_tx(&mut tx, &Reminder { n: 2 }, keyed("a")).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!((again.id, again.created), (first, false));
    past_deadline(&platform, ws, first).await;
    past_deadline(&platform, ws, batch[0].id).await;

    // Past it, the holder would never run: the next enqueue of each key expires it and writes a job of its own.
    let mut tx = conveyor_jobs::begin_workspace(&platform.pool, ws).await.unwrap();
    let one =
        conveyor_jobs::enqueue_tx(&mut tx, &Reminder { n: 3 }, EnqueueOptions::new().dedup_key("a")).await.unwrap();
    let many = conveyor_jobs::enqueue_many_tx(&mut tx, [(&Reminder { n: 4 }, EnqueueOptions::new().dedup_key("b"))])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert!(one.created && one.id != first, "{one:?}");
    assert!(many[0].created && many[0].id != batch[0].id, "{many:?}");
    for old in [first, batch[0].id] {
        let info = job(&platform, ws, old).await;
        assert_eq!(
            (info.status, info.last_error.as_deref()),
            (JobStatus::Canceled, Some("expired: not started by its deadline"))
        );
    }
    assert_eq!(job(&platform, ws, one.id).await.status, JobStatus::Queued);
}

#[tokio::test]
async fn the_sql_enqueue_expires_a_de_dup_key_holder_past_its_deadline_and_takes_the_key() {
    let platform = Platform::new(8).await;
    worker(&platform, &Send::default()).await.register_kinds().await.unwrap();
    let ws = WorkspaceId(Uuid::new_v4());
    let mut tx = conveyor_jobs::begin_workspace(&platform.pool, ws).await.unwrap();
    let operation =
        conveyor_jobs::create_operation_tx(&mut tx, ws, UserId(Uuid::new_v4()), "test.reminder", None).await.unwrap();
    let options = EnqueueOptions::new().dedup_key("a").operation(operation.id).start_within(Duration::from_millis(300));
    let first = conveyor_jobs::enqueue_tx(&mut tx, &Reminder { n: 1 }, options).await.unwrap().id;
    tx.commit().await.unwrap();
    let sql_enqueue = async |n: u32| -> JobId {
        let mut tx = conveyor_jobs::begin_workspace(&platform.pool, ws).await.unwrap();
        let id = sqlx::query_scalar("SELECT conveyor.conveyor_enqueue('test.reminder', $1, dedup_key => 'a')")
            .bind(serde_json::json!({ "n": n }))
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        JobId(id)
    };
    assert_eq!(sql_enqueue(2).await, first, "while in time, the key answers its holder");
    past_deadline(&platform, ws, first).await;

    // Expiring the holder cancels its operation: an enqueue that names that operation is refused, and writes nothing.
    let mut tx = conveyor_jobs::begin_workspace(&platform.pool, ws).await.unwrap();
    let refused =
        sqlx::query("SELECT conveyor.conveyor_enqueue('test.reminder', '{}', dedup_key => 'a', operation_id => $1)")
            .bind(operation.id)
            .execute(&mut *tx)
            .await
            .unwrap_err()
            .to_string();
    assert!(refused.contains("is not a live operation of this workspace"), "{refused}");
    tx.rollback().await.unwrap();
    assert_eq!(job(&platform, ws, first).await.status, JobStatus::Queued, "rolled back with the refusal");

    let mut canceled = sqlx::postgres::PgListener::connect_with(&platform.pool).await.unwrap();
    canceled.listen("conveyor_jobs_canceled").await.unwrap();
    let next = sql_enqueue(3).await;
    assert_ne!(next, first, "past it, the holder would never run: the enqueue writes a job of its own");
    let old = job(&platform, ws, first).await;
    assert_eq!((old.status, old.last_error.as_deref()), (JobStatus::Canceled, Some(EXPIRED)));
    let mut tx = conveyor_jobs::begin_workspace(&platform.pool, ws).await.unwrap();
    let op = conveyor_jobs::get_operation_tx(&mut tx, operation.id).await.unwrap().unwrap();
    tx.commit().await.unwrap();
    assert_eq!((op.status.as_str(), op.error.as_deref()), ("canceled", Some(EXPIRED)), "its operation ends with it");
    let heard = tokio::time::timeout(Duration::from_secs(5), canceled.recv()).await.unwrap().unwrap();
    assert_eq!(heard.payload(), first.0.to_string(), "the workers are told, as of any cancellation");
    let (status, payload): (String, Value) = {
        let mut tx = conveyor_jobs::begin_workspace(&platform.pool, ws).await.unwrap();
        sqlx::query_as("SELECT status, event_payload FROM conveyor.outbox_events WHERE id = $1")
            .bind(next.0)
            .fetch_one(&mut *tx)
            .await
            .unwrap()
    };
    assert_eq!((status.as_str(), payload), ("pending", serde_json::json!({ "n": 3 })));
}

/// Holds its run until told to end.
#[derive(Clone, Default)]
struct Slow {
    started: Arc<tokio::sync::Notify>,
    end: Arc<tokio::sync::Notify>,
}

impl Handler<Reminder> for Slow {
    async fn handle(&self, _job: Reminder, _cx: &mut JobContext) -> Result<Value, JobError> {
        self.started.notify_one();
        self.end.notified().await;
        Ok(Value::Null)
    }
}

#[tokio::test]
async fn a_job_that_started_before_its_deadline_runs_to_its_end_and_keeps_its_de_dup_key_past_it() {
    let platform = Platform::new(8).await;
    let ws = WorkspaceId(Uuid::new_v4());
    let slow = Slow::default();
    let worker = Worker::builder(platform.pool.clone(), platform.consumer("expiry").await)
        .runtime_pool(platform.runtime_pool.clone())
        .handle::<Reminder>(slow.clone())
        .build()
        .unwrap();
    worker.ensure_groups().await.unwrap();
    let dispatcher = platform.dispatcher(|_| {}).await;
    let keyed = EnqueueOptions::new().dedup_key("k").start_within(Duration::from_millis(300));
    let id = enqueue(&platform, ws, keyed).await;
    dispatcher.dispatch_once().await.unwrap();
    let running = tokio::spawn(async move { worker.process_one().await.unwrap() });
    slow.started.notified().await;
    past_deadline(&platform, ws, id).await;

    // Running past its deadline: an enqueue of its key is answered with it, and maintenance leaves it alone.
    let mut tx = conveyor_jobs::begin_workspace(&platform.pool, ws).await.unwrap();
    let again = conveyor_jobs::enqueue_tx(&mut tx, &Reminder { n: 2 }, EnqueueOptions::new().dedup_key("k")).await;
    tx.commit().await.unwrap();
    assert_eq!(again.unwrap(), conveyor_jobs::Enqueued { id, created: false });
    assert_eq!(maintenance_pass(&platform).await.expired, 0);
    slow.end.notify_one();
    assert_eq!(running.await.unwrap(), Some(Outcome::Succeeded));
    assert_eq!(job(&platform, ws, id).await.status, JobStatus::Succeeded);
}

#[tokio::test]
async fn a_schedules_jobs_carry_its_deadline_from_their_tick_and_expire_unstarted() {
    let platform = Platform::new(8).await;
    let ws = WorkspaceId(Uuid::new_v4());
    let spec = || conveyor_jobs::ScheduleSpec::every(Duration::from_secs(1)).unwrap();
    let set = |options: conveyor_jobs::ScheduleOptions| {
        let pool = platform.pool.clone();
        async move {
            let mut tx = conveyor_jobs::begin_workspace(&pool, ws).await.unwrap();
            let set = conveyor_jobs::upsert_schedule_tx(&mut tx, "nudge", &Reminder { n: 7 }, spec(), options).await;
            tx.commit().await.unwrap();
            set
        }
    };
    // Refused, with nothing written: a deadline under 1 ms or over ten years.
    for within in [Duration::ZERO, Duration::from_secs(11 * 365 * 86_400)] {
        let refused = set(conveyor_jobs::ScheduleOptions::new().start_within(within)).await.unwrap_err();
        assert!(refused.to_string().contains("start_within must be at least 1 ms"), "{refused}");
    }
    assert!(conveyor_jobs::list_schedules(&platform.pool, ws).await.unwrap().is_empty());

    let schedule = set(conveyor_jobs::ScheduleOptions::new().start_within(Duration::from_millis(300))).await.unwrap();
    assert_eq!(schedule.start_within_ms, Some(300));
    // Its next tick comes within the second; no worker runs.
    let fired = crate::kit::eventually(Duration::from_secs(10), || async {
        let outcome = conveyor_jobs::fire_due_schedules(&platform.runtime_pool).await.unwrap();
        (outcome.fired > 0).then_some(())
    })
    .await;
    assert!(fired.is_some(), "the schedule fired");
    let tick = conveyor_jobs::list_schedules(&platform.pool, ws).await.unwrap()[0].last_tick_at.expect("a tick");
    let mut owner = platform.owner().await;
    let id: Uuid = sqlx::query_scalar("SELECT id FROM conveyor.outbox_events WHERE workspace_id = $1")
        .bind(ws.0)
        .fetch_one(&mut owner)
        .await
        .unwrap();
    let fired_job = job(&platform, ws, JobId(id)).await;
    assert_eq!(fired_job.expires_at, Some(tick + chrono::Duration::milliseconds(300)), "its tick + start_within");

    // Never started by then: the next maintenance pass cancels it as expired.
    past_deadline(&platform, ws, JobId(id)).await;
    let pass = maintenance_pass(&platform).await;
    assert_eq!(pass.expired, 1);
    let expired = job(&platform, ws, JobId(id)).await;
    assert_eq!(expired.status, JobStatus::Canceled);
    assert_eq!(expired.last_error.as_deref(), Some("expired: not started by its deadline"));
}
