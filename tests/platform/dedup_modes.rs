//! De-duplication modes, as a team leaving BullMQ uses them (`deduplication: { ttl }`, `{ extend, replace }`): a
//! throttle that holds its key for a period even after its job ended, a debounce that folds enqueues into the waiting
//! job. Each decided by the database under 16 concurrent enqueues, against the application role under row-level
//! security, relayed and run for real.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use conveyor_jobs::{
    DedupMode, Dispatcher, EnqueueOptions, Enqueued, Handler, JobChange, JobContext, JobError, JobId, JobKind,
    JobStatus, Worker, WorkspaceId,
};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

use crate::kit::Platform;

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
struct Sync {
    version: u32,
}

impl JobKind for Sync {
    const KIND: &'static str = "test.sync";
    const QUEUE: &'static str = "test-syncs";
}

/// Records each run's version, in the order they ran.
#[derive(Clone, Default)]
struct Syncs(Arc<Mutex<Vec<u32>>>);

impl Handler<Sync> for Syncs {
    async fn handle(&self, job: Sync, _: &mut JobContext) -> Result<Value, JobError> {
        self.0.lock().unwrap().push(job.version);
        Ok(Value::Null)
    }
}

async fn parts(platform: &Platform, syncs: &Syncs) -> (Dispatcher, Worker) {
    let dispatcher = platform.dispatcher(|_| {}).await;
    let worker = Worker::builder(platform.pool.clone(), platform.consumer("dedup-modes").await)
        .runtime_pool(platform.runtime_pool.clone())
        .handle::<Sync>(syncs.clone())
        .build()
        .unwrap();
    worker.ensure_groups().await.unwrap();
    (dispatcher, worker)
}

async fn enqueue(platform: &Platform, ws: WorkspaceId, version: u32, options: EnqueueOptions) -> Enqueued {
    let mut tx = conveyor_jobs::begin_workspace(&platform.pool, ws).await.unwrap();
    let enqueued = conveyor_jobs::enqueue_tx(&mut tx, &Sync { version }, options).await.unwrap();
    tx.commit().await.unwrap();
    enqueued
}

/// 16 transactions enqueueing `key` at once, each with its own version (1 to 16); each holds its transaction open a
/// moment after its enqueue, so that the others meet it uncommitted. Answers each enqueue with its version, in the
/// order their commits returned (commits of one key take turns, so this is their order).
async fn sixteen_at_once(platform: &Platform, ws: WorkspaceId, mode: DedupMode) -> Vec<(u32, Enqueued)> {
    let committed = Arc::new(tokio::sync::Mutex::new(Vec::new()));
    let start = Arc::new(tokio::sync::Barrier::new(16));
    let tasks: Vec<_> = (1..=16u32)
        .map(|version| {
            let (pool, committed, start) = (platform.pool.clone(), committed.clone(), start.clone());
            tokio::spawn(async move {
                let mut tx = conveyor_jobs::begin_workspace(&pool, ws).await.unwrap();
                start.wait().await;
                let options = EnqueueOptions::new().dedup("sku-7", mode);
                let enqueued = conveyor_jobs::enqueue_tx(&mut tx, &Sync { version }, options).await.unwrap();
                tokio::time::sleep(Duration::from_millis(5)).await;
                let mut order = committed.lock().await;
                tx.commit().await.unwrap();
                order.push((version, enqueued));
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    Arc::try_unwrap(committed).unwrap().into_inner()
}

/// The jobs of kind `Sync` in `ws`, with their status, as the owner reads them.
async fn jobs(platform: &Platform, ws: WorkspaceId) -> Vec<(Uuid, String)> {
    let mut owner = platform.owner().await;
    sqlx::query_as(
        "SELECT id, status FROM conveyor.outbox_events WHERE workspace_id = $1 AND event_type = $2 ORDER BY id",
    )
    .bind(ws.0)
    .bind(Sync::KIND)
    .fetch_all(&mut owner)
    .await
    .unwrap()
}

async fn run_at(platform: &Platform, ws: WorkspaceId, id: JobId) -> chrono::DateTime<chrono::Utc> {
    conveyor_jobs::get_job(&platform.pool, ws, id).await.unwrap().unwrap().run_at
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

#[tokio::test]
async fn sixteen_concurrent_throttled_enqueues_write_one_job_whose_key_holds_after_its_end_until_the_period_is_over() {
    let platform = Platform::new(24).await;
    let (ws, other_ws) = (WorkspaceId(Uuid::new_v4()), WorkspaceId(Uuid::new_v4()));
    let syncs = Syncs::default();
    let (dispatcher, worker) = parts(&platform, &syncs).await;
    let period = Duration::from_secs(3);

    let answers = sixteen_at_once(&platform, ws, DedupMode::throttle(period)).await;
    let created: Vec<_> = answers.iter().filter(|(_, e)| e.created).collect();
    assert_eq!(created.len(), 1, "one enqueue took the key: {answers:?}");
    let (winner, job) = (created[0].0, created[0].1.id);
    assert!(answers.iter().all(|(_, e)| e.id == job), "every other answers the job that took it: {answers:?}");
    assert_eq!(jobs(&platform, ws).await.len(), 1);
    // Another workspace's key of the same name is its own.
    assert!(
        enqueue(&platform, other_ws, 1, EnqueueOptions::new().dedup("sku-7", DedupMode::throttle(period)))
            .await
            .created
    );

    // Run it: the key still holds, although its job ended.
    conveyor_jobs::testing::drain(&dispatcher, &worker).await.unwrap();
    let mut ran = std::mem::take(&mut *syncs.0.lock().unwrap());
    ran.sort();
    let mut expected = vec![1, winner];
    expected.sort();
    assert_eq!(ran, expected, "the winner's job, and the other workspace's");
    assert_eq!(conveyor_jobs::get_job(&platform.pool, ws, job).await.unwrap().unwrap().status, JobStatus::Succeeded);
    let held = enqueue(&platform, ws, 99, EnqueueOptions::new().dedup("sku-7", DedupMode::throttle(period))).await;
    assert_eq!(held, Enqueued { id: job, created: false });
    assert_eq!(maintenance_pass(&platform).await.dedup_keys_purged, 0, "a held key is kept");

    // Once the period is over, the key is free: the next enqueue writes a job.
    tokio::time::sleep(period).await;
    assert_eq!(maintenance_pass(&platform).await.dedup_keys_purged, 2, "both workspaces' keys are over");
    let next = enqueue(&platform, ws, 100, EnqueueOptions::new().dedup("sku-7", DedupMode::throttle(period))).await;
    assert!(next.created && next.id != job, "{next:?}");
    conveyor_jobs::testing::drain(&dispatcher, &worker).await.unwrap();
    assert_eq!(*syncs.0.lock().unwrap(), [100]);
}

#[tokio::test]
async fn a_throttled_job_that_outlives_its_period_holds_its_key_until_it_ends_and_no_longer() {
    let platform = Platform::new(8).await;
    let ws = WorkspaceId(Uuid::new_v4());
    let syncs = Syncs::default();
    let (dispatcher, worker) = parts(&platform, &syncs).await;
    let throttle = |version| {
        let pool = platform.pool.clone();
        async move {
            let mut tx = conveyor_jobs::begin_workspace(&pool, ws).await.unwrap();
            let options = EnqueueOptions::new().dedup("sku-8", DedupMode::throttle(Duration::from_millis(200)));
            let enqueued = conveyor_jobs::enqueue_tx(&mut tx, &Sync { version }, options).await.unwrap();
            tx.commit().await.unwrap();
            enqueued
        }
    };
    // A job of the throttled key, and one of the same key enqueued while live only: both hold it while they live.
    let first = throttle(1).await;
    assert!(first.created);
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The period is over but the job still waits: the live job holds the key.
    assert_eq!(throttle(2).await, Enqueued { id: first.id, created: false });
    conveyor_jobs::testing::drain(&dispatcher, &worker).await.unwrap();
    // Ended, and its period long over: the key is free at once (the refused enqueue held no period of its own).
    let second = throttle(3).await;
    assert!(second.created && second.id != first.id, "{second:?}");
    // A live job enqueued with the plain key holds a throttle off too.
    conveyor_jobs::testing::drain(&dispatcher, &worker).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let plain = enqueue(&platform, ws, 4, EnqueueOptions::new().dedup_key("sku-8")).await;
    assert!(plain.created);
    assert_eq!(throttle(5).await, Enqueued { id: plain.id, created: false });
    conveyor_jobs::testing::drain(&dispatcher, &worker).await.unwrap();
    assert_eq!(*syncs.0.lock().unwrap(), [1, 3, 4]);
}

#[tokio::test]
async fn sixteen_concurrent_debounced_enqueues_leave_one_waiting_job_with_the_last_payload_and_a_pushed_due_time() {
    let platform = Platform::new(24).await;
    let ws = WorkspaceId(Uuid::new_v4());
    let syncs = Syncs::default();
    let (dispatcher, worker) = parts(&platform, &syncs).await;
    let hour = DedupMode::debounce(Duration::from_secs(3600));

    // 16 at once on a key nobody holds: one writes the job, the 15 others fold into it.
    let answers = sixteen_at_once(&platform, ws, hour).await;
    let created: Vec<_> = answers.iter().filter(|(_, e)| e.created).collect();
    assert_eq!(created.len(), 1, "one enqueue wrote the job: {answers:?}");
    let first = created[0].1;
    assert!(answers.iter().all(|(_, e)| e.id == first.id), "{answers:?}");
    assert_eq!(jobs(&platform, ws).await, [(first.id.0, "pending".to_owned())]);
    let due_first = run_at(&platform, ws, first.id).await;
    // Maintenance keeps the key of a waiting job.
    assert_eq!(maintenance_pass(&platform).await.dedup_keys_purged, 0);

    // 16 more at once on the key now held: all fold in, the due time moves on.
    let answers = sixteen_at_once(&platform, ws, hour).await;
    assert!(answers.iter().all(|(_, e)| *e == Enqueued { id: first.id, created: false }), "{answers:?}");
    assert_eq!(jobs(&platform, ws).await, [(first.id.0, "pending".to_owned())]);
    assert!(run_at(&platform, ws, first.id).await > due_first, "the due time was pushed");

    // Made due, it runs once, with the payload of the enqueue that committed last.
    conveyor_jobs::change_job(&platform.pool, ws, first.id, &JobChange::new().run_now()).await.unwrap();
    conveyor_jobs::testing::drain(&dispatcher, &worker).await.unwrap();
    let last = answers.last().unwrap().0;
    assert_eq!(*syncs.0.lock().unwrap(), [last]);
}

#[tokio::test]
async fn a_debounce_leaves_a_job_handed_to_a_worker_alone_and_writes_the_next_beside_it() {
    let platform = Platform::new(8).await;
    let ws = WorkspaceId(Uuid::new_v4());
    let syncs = Syncs::default();
    let (dispatcher, worker) = parts(&platform, &syncs).await;
    let now = DedupMode::debounce(Duration::ZERO);

    let first = enqueue(&platform, ws, 1, EnqueueOptions::new().dedup("sku-9", now)).await;
    dispatcher.dispatch_once().await.unwrap();
    // Handed out, its key is kept: the job could come back to wait, for a retry.
    assert_eq!(maintenance_pass(&platform).await.dedup_keys_purged, 0);
    // Handed out: left alone, so a new waiting job is written, and the key follows it.
    let second = enqueue(&platform, ws, 2, EnqueueOptions::new().dedup("sku-9", now)).await;
    assert!(second.created && second.id != first.id, "{second:?}");
    let third = enqueue(&platform, ws, 3, EnqueueOptions::new().dedup("sku-9", now)).await;
    assert_eq!(third, Enqueued { id: second.id, created: false });
    conveyor_jobs::testing::drain(&dispatcher, &worker).await.unwrap();
    assert_eq!(
        *syncs.0.lock().unwrap(),
        [1, 3],
        "the first ran as it was handed out, the second with the third's payload"
    );
    // Both ended: the key's row holds nothing, and maintenance forgets it; the next enqueue starts again.
    assert_eq!(maintenance_pass(&platform).await.dedup_keys_purged, 1);
    assert!(enqueue(&platform, ws, 4, EnqueueOptions::new().dedup("sku-9", now)).await.created);
}

#[tokio::test]
async fn a_debounce_can_keep_the_first_payload_or_the_first_due_time_and_a_batch_folds_in_order() {
    let platform = Platform::new(8).await;
    let ws = WorkspaceId(Uuid::new_v4());
    let syncs = Syncs::default();
    let (dispatcher, worker) = parts(&platform, &syncs).await;
    let hour = Duration::from_secs(3600);

    let kept = enqueue(&platform, ws, 1, EnqueueOptions::new().dedup("a", DedupMode::debounce(hour))).await;
    let due = run_at(&platform, ws, kept.id).await;
    let again = enqueue(&platform, ws, 2, EnqueueOptions::new().dedup("a", DedupMode::debounce(hour).keep_due_time()));
    assert_eq!(again.await, Enqueued { id: kept.id, created: false });
    assert_eq!(run_at(&platform, ws, kept.id).await, due, "the due time was kept");
    let pushed = enqueue(&platform, ws, 3, EnqueueOptions::new().dedup("a", DedupMode::debounce(hour).keep_payload()));
    assert_eq!(pushed.await, Enqueued { id: kept.id, created: false });
    assert!(run_at(&platform, ws, kept.id).await > due, "the due time was pushed");

    // A batch of one key folds into its first job, in order; another key of the batch is its own.
    let mut tx = conveyor_jobs::begin_workspace(&platform.pool, ws).await.unwrap();
    let batch = [(Sync { version: 10 }, "b"), (Sync { version: 11 }, "b"), (Sync { version: 12 }, "c")];
    let now = DedupMode::debounce(Duration::ZERO);
    let answers = conveyor_jobs::enqueue_many_tx(
        &mut tx,
        batch.iter().map(|(sync, key)| (sync, EnqueueOptions::new().dedup(*key, now))),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert!(answers[0].created && answers[2].created, "{answers:?}");
    assert_eq!(answers[1], Enqueued { id: answers[0].id, created: false });

    conveyor_jobs::change_job(&platform.pool, ws, kept.id, &JobChange::new().run_now()).await.unwrap();
    conveyor_jobs::testing::drain(&dispatcher, &worker).await.unwrap();
    let mut ran = syncs.0.lock().unwrap().clone();
    ran.sort();
    assert_eq!(ran, [2, 11, 12], "the first key's second payload (the third kept it), the batch's last of b, and c");
}

#[tokio::test]
async fn a_throttle_and_a_debounce_of_one_name_are_two_keys_and_each_workspace_has_its_own_under_one_role() {
    // The single-role mode: one role, the owner, that reads every workspace's rows; each enqueue still meets its own.
    let platform = Platform::single_role().await;
    let (a, b) = (WorkspaceId(Uuid::new_v4()), WorkspaceId(Uuid::new_v4()));
    let throttle = DedupMode::throttle(Duration::from_secs(3600));
    let debounce = DedupMode::debounce(Duration::from_secs(3600));

    let a_throttled = enqueue(&platform, a, 1, EnqueueOptions::new().dedup("k", throttle)).await;
    let b_throttled = enqueue(&platform, b, 2, EnqueueOptions::new().dedup("k", throttle)).await;
    assert!(a_throttled.created && b_throttled.created);
    // A debounce of the same name is another key: it writes its own job, and leaves the throttled job's payload.
    let a_debounced = enqueue(&platform, a, 3, EnqueueOptions::new().dedup("k", debounce)).await;
    assert!(a_debounced.created && a_debounced.id != a_throttled.id);
    let b_debounced = enqueue(&platform, b, 6, EnqueueOptions::new().dedup("k", debounce)).await;
    assert!(b_debounced.created);
    // Each workspace's held keys answer its own jobs.
    for _ in 0..3 {
        assert_eq!(
            enqueue(&platform, a, 4, EnqueueOptions::new().dedup("k", throttle)).await,
            Enqueued { id: a_throttled.id, created: false }
        );
        assert_eq!(
            enqueue(&platform, b, 5, EnqueueOptions::new().dedup("k", throttle)).await,
            Enqueued { id: b_throttled.id, created: false }
        );
        assert_eq!(
            enqueue(&platform, b, 6, EnqueueOptions::new().dedup("k", debounce)).await,
            Enqueued { id: b_debounced.id, created: false }
        );
    }
    let mut owner = platform.owner().await;
    let payloads: Vec<(Uuid, Value)> =
        sqlx::query_as("SELECT id, event_payload FROM conveyor.outbox_events WHERE workspace_id = ANY($1) ORDER BY id")
            .bind(vec![a.0, b.0])
            .fetch_all(&mut owner)
            .await
            .unwrap();
    let payload = |id: JobId| payloads.iter().find(|(j, _)| *j == id.0).map(|(_, p)| p["version"].clone());
    assert_eq!(payload(a_throttled.id), Some(1.into()), "a throttle's job keeps its payload");
    assert_eq!(payload(a_debounced.id), Some(3.into()));
    assert_eq!(payloads.len(), 4, "a: throttled and debounced; b: throttled and debounced: {payloads:?}");
}

#[tokio::test]
async fn a_debounced_job_does_not_run_from_an_earlier_hand_off_still_in_the_stream() {
    let platform = Platform::new(8).await;
    let ws = WorkspaceId(Uuid::new_v4());
    let syncs = Syncs::default();
    let (dispatcher, worker) = parts(&platform, &syncs).await;
    let now = DedupMode::debounce(Duration::ZERO);
    let job = enqueue(&platform, ws, 1, EnqueueOptions::new().dedup("sku-10", now)).await.id;
    dispatcher.dispatch_once().await.unwrap();
    // As when an XADD's reply is lost: the entry is in the stream, and the relay puts the job back to pending.
    platform.set_job_row(ws, job.0, Platform::XADD_REPLY_LOST).await;
    // The debounce folds into the waiting job: a new generation, so the old entry does not run its old payload.
    assert_eq!(
        enqueue(&platform, ws, 2, EnqueueOptions::new().dedup("sku-10", now)).await,
        Enqueued { id: job, created: false }
    );
    conveyor_jobs::testing::drain(&dispatcher, &worker).await.unwrap();
    assert_eq!(*syncs.0.lock().unwrap(), [2], "only the debounced payload ran");
}
