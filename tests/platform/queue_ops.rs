//! Queue operations, as a team leaving BullMQ calls them: a waiting job's priority, due time and payload changed (and
//! refused once the relay took it), a queue drained, ended jobs cleaned by age and beyond the newest N. Each against
//! the application role under row-level security, relayed and run for real.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use conveyor_jobs::{
    ChangeError, CleanJobs, Dispatcher, EnqueueOptions, Handler, JobChange, JobContext, JobError, JobId, JobKind,
    JobScope, JobStatus, Priority, Worker, WorkspaceId,
};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

use crate::kit::Platform;

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
struct Label {
    text: String,
}

impl JobKind for Label {
    const KIND: &'static str = "test.label";
    const QUEUE: &'static str = "test-labels";
}

#[derive(Serialize, Deserialize)]
struct Other {
    n: u32,
}

impl JobKind for Other {
    const KIND: &'static str = "test.other";
    const QUEUE: &'static str = "test-others";
}

/// Records each run's payload, in the order they ran; fails the label `fail` for good.
#[derive(Clone, Default)]
struct Labels(Arc<Mutex<Vec<String>>>);

impl Handler<Label> for Labels {
    async fn handle(&self, job: Label, _: &mut JobContext) -> Result<Value, JobError> {
        self.0.lock().unwrap().push(job.text.clone());
        if job.text == "fail" {
            return Err(JobError::permanent("asked to fail"));
        }
        Ok(Value::Null)
    }
}

struct Others;

impl Handler<Other> for Others {
    async fn handle(&self, _: Other, _: &mut JobContext) -> Result<Value, JobError> {
        Ok(Value::Null)
    }
}

async fn parts(platform: &Platform, labels: &Labels) -> (Dispatcher, Worker) {
    let dispatcher = platform.dispatcher(|_| {}).await;
    let worker = Worker::builder(platform.pool.clone(), platform.consumer("queue-ops").await)
        .runtime_pool(platform.runtime_pool.clone())
        .handle::<Label>(labels.clone())
        .handle::<Other>(Others)
        .build()
        .unwrap();
    worker.ensure_groups().await.unwrap();
    (dispatcher, worker)
}

fn label(text: &str) -> Label {
    Label { text: text.into() }
}

async fn enqueue(platform: &Platform, ws: WorkspaceId, text: &str, options: EnqueueOptions) -> JobId {
    let mut tx = conveyor_jobs::begin_workspace(&platform.pool, ws).await.unwrap();
    let id = conveyor_jobs::enqueue_tx(&mut tx, &label(text), options).await.unwrap().id;
    tx.commit().await.unwrap();
    id
}

async fn status(platform: &Platform, ws: WorkspaceId, id: JobId) -> Option<JobStatus> {
    conveyor_jobs::get_job(&platform.pool, ws, id).await.unwrap().map(|j| j.status)
}

#[tokio::test]
async fn a_waiting_jobs_priority_due_time_and_payload_change_and_the_run_gets_what_it_has_then() {
    let platform = Platform::new(8).await;
    let ws = WorkspaceId(Uuid::new_v4());
    let labels = Labels::default();
    let (dispatcher, worker) = parts(&platform, &labels).await;

    // Two due jobs in enqueue order; the second is raised to high: it is handed out, and runs, first.
    let first = enqueue(&platform, ws, "first", EnqueueOptions::new()).await;
    let second = enqueue(&platform, ws, "second", EnqueueOptions::new()).await;
    conveyor_jobs::change_job(&platform.pool, ws, second, &JobChange::new().priority(Priority::High)).await.unwrap();
    assert_eq!(conveyor_jobs::get_job(&platform.pool, ws, second).await.unwrap().unwrap().priority, Priority::High);
    // A job delayed by an hour, its payload replaced and made due now (BullMQ's updateData and promote).
    let delayed = enqueue(&platform, ws, "old", EnqueueOptions::new().delay(Duration::from_secs(3600))).await;
    assert_eq!(status(&platform, ws, delayed).await, Some(JobStatus::Scheduled));
    conveyor_jobs::change_job(&platform.pool, ws, delayed, &JobChange::new().payload(&label("new")).run_now())
        .await
        .unwrap();
    // A due job pushed an hour out (changeDelay) does not run.
    let pushed = enqueue(&platform, ws, "pushed", EnqueueOptions::new()).await;
    let due = conveyor_jobs::change_job(&platform.pool, ws, pushed, &JobChange::new().delay(Duration::from_secs(3600)))
        .await
        .unwrap();
    assert!(due > chrono::Utc::now() + chrono::Duration::minutes(59), "due at {due}");

    conveyor_jobs::testing::drain(&dispatcher, &worker).await.unwrap();
    let ran = labels.0.lock().unwrap().clone();
    assert_eq!(ran.len(), 3, "{ran:?}");
    let at = |text: &str| ran.iter().position(|r| r == text).unwrap_or_else(|| panic!("{text} did not run: {ran:?}"));
    assert!(at("second") < at("first"), "the raised job ran first: {ran:?}");
    assert!(!ran.contains(&"old".to_owned()), "the replaced payload never ran: {ran:?}");
    assert_eq!(status(&platform, ws, first).await, Some(JobStatus::Succeeded));
    assert_eq!(status(&platform, ws, delayed).await, Some(JobStatus::Succeeded));
    assert_eq!(status(&platform, ws, pushed).await, Some(JobStatus::Scheduled));
}

#[tokio::test]
async fn a_change_is_refused_once_the_relay_took_the_job_and_for_a_wrong_kind_another_workspace_or_nothing() {
    let platform = Platform::new(8).await;
    let (ws, other_ws) = (WorkspaceId(Uuid::new_v4()), WorkspaceId(Uuid::new_v4()));
    let labels = Labels::default();
    let (dispatcher, worker) = parts(&platform, &labels).await;
    let job = enqueue(&platform, ws, "a", EnqueueOptions::new().delay(Duration::from_secs(3600))).await;
    let change = |c: JobChange| {
        let pool = platform.pool.clone();
        async move { conveyor_jobs::change_job(&pool, ws, job, &c).await }
    };

    assert!(matches!(change(JobChange::new()).await, Err(ChangeError::Invalid(_))));
    let wrong = change(JobChange::new().payload(&Other { n: 1 })).await;
    assert!(
        matches!(&wrong, Err(ChangeError::OtherKind { job, payload }) if job == "test.label" && payload == "test.other"),
        "{wrong:?}"
    );
    // Row-level security: another workspace does not see the job.
    let unseen = conveyor_jobs::change_job(&platform.pool, other_ws, job, &JobChange::new().run_now()).await;
    assert!(matches!(unseen, Err(ChangeError::NotFound)), "{unseen:?}");
    let none = conveyor_jobs::change_job(&platform.pool, ws, JobId(Uuid::new_v4()), &JobChange::new().run_now()).await;
    assert!(matches!(none, Err(ChangeError::NotFound)), "{none:?}");
    // Nothing changed by the refusals: still delayed, still "a".
    assert_eq!(status(&platform, ws, job).await, Some(JobStatus::Scheduled));

    // Relayed: handed to the workers, so no longer changed.
    change(JobChange::new().run_now()).await.unwrap();
    dispatcher.dispatch_once().await.unwrap();
    let taken = change(JobChange::new().payload(&label("b"))).await;
    assert!(matches!(taken, Err(ChangeError::NotWaiting(JobStatus::Active))), "{taken:?}");
    while worker.process_one().await.unwrap().is_some() {}
    assert_eq!(*labels.0.lock().unwrap(), ["a"]);
    let ended = change(JobChange::new().priority(Priority::Low)).await;
    assert!(matches!(ended, Err(ChangeError::NotWaiting(JobStatus::Succeeded))), "{ended:?}");
}

#[tokio::test]
async fn a_change_racing_the_relays_claim_either_lands_before_the_hand_off_or_is_refused() {
    let platform = Platform::new(16).await;
    let ws = WorkspaceId(Uuid::new_v4());
    let labels = Labels::default();
    let (dispatcher, worker) = parts(&platform, &labels).await;
    let dispatcher = Arc::new(dispatcher);
    let mut outcomes = (0, 0);
    for round in 0..16 {
        let job = enqueue(&platform, ws, &format!("old-{round}"), EnqueueOptions::new()).await;
        let relay = {
            let dispatcher = dispatcher.clone();
            tokio::spawn(async move { dispatcher.dispatch_once().await.unwrap() })
        };
        let new = format!("new-{round}");
        let changed = conveyor_jobs::change_job(&platform.pool, ws, job, &JobChange::new().payload(&label(&new))).await;
        relay.await.unwrap();
        conveyor_jobs::testing::drain(&dispatcher, &worker).await.unwrap();
        let ran = labels.0.lock().unwrap().pop().expect("the job ran");
        match changed {
            Ok(_) => {
                assert_eq!(ran, new, "round {round}: the change landed, so the run has its payload");
                outcomes.0 += 1;
            }
            Err(ChangeError::NotWaiting(_)) => {
                assert_eq!(ran, format!("old-{round}"), "round {round}: refused, so the run has the old payload");
                outcomes.1 += 1;
            }
            Err(e) => panic!("round {round}: {e}"),
        }
        assert!(labels.0.lock().unwrap().is_empty(), "round {round}: the job ran once");
    }
    eprintln!("changed before the hand-off: {}, refused: {}", outcomes.0, outcomes.1);
}

#[tokio::test]
async fn a_drain_cancels_the_waiting_jobs_of_its_queue_with_their_operations_and_leaves_the_rest() {
    let platform = Platform::new(8).await;
    let (ws, other_ws) = (WorkspaceId(Uuid::new_v4()), WorkspaceId(Uuid::new_v4()));
    let labels = Labels::default();
    let (dispatcher, worker) = parts(&platform, &labels).await;
    // One job of the queue handed to the workers before the drain: it runs on.
    let active = enqueue(&platform, ws, "active", EnqueueOptions::new()).await;
    dispatcher.dispatch_once().await.unwrap();
    // Waiting jobs of the queue: due, delayed, and one of an operation.
    let due = enqueue(&platform, ws, "due", EnqueueOptions::new()).await;
    let delayed = enqueue(&platform, ws, "delayed", EnqueueOptions::new().delay(Duration::from_secs(3600))).await;
    let mut tx = conveyor_jobs::begin_workspace(&platform.pool, ws).await.unwrap();
    let operation =
        conveyor_jobs::create_operation_tx(&mut tx, ws, conveyor_jobs::UserId(Uuid::new_v4()), "test.op", None)
            .await
            .unwrap();
    let of_operation = conveyor_jobs::enqueue_tx(&mut tx, &label("op"), EnqueueOptions::new().operation(operation.id))
        .await
        .unwrap()
        .id;
    // Another queue's job, and the same queue's job in another workspace: neither is drained.
    let mut other_tx = conveyor_jobs::begin_workspace(&platform.pool, ws).await.unwrap();
    let other_queue =
        conveyor_jobs::enqueue_tx(&mut other_tx, &Other { n: 1 }, EnqueueOptions::new()).await.unwrap().id;
    other_tx.commit().await.unwrap();
    tx.commit().await.unwrap();
    let elsewhere = enqueue(&platform, other_ws, "elsewhere", EnqueueOptions::new()).await;

    let drained = conveyor_jobs::drain_jobs(&platform.pool, ws, &JobScope::queue(Label::QUEUE)).await.unwrap();
    assert_eq!(drained, 3);
    for job in [due, delayed, of_operation] {
        assert_eq!(status(&platform, ws, job).await, Some(JobStatus::Canceled));
    }
    let mut tx = conveyor_jobs::begin_workspace(&platform.pool, ws).await.unwrap();
    let op = conveyor_jobs::get_operation_tx(&mut tx, operation.id).await.unwrap().unwrap();
    tx.commit().await.unwrap();
    assert_eq!(op.status, "canceled");
    assert_eq!(status(&platform, ws, other_queue).await, Some(JobStatus::Queued));
    assert_eq!(status(&platform, other_ws, elsewhere).await, Some(JobStatus::Queued));
    // The handed-out job runs to its end; the drained ones never run.
    conveyor_jobs::testing::drain(&dispatcher, &worker).await.unwrap();
    let ran = labels.0.lock().unwrap().clone();
    assert!(ran.contains(&"active".to_owned()) && ran.contains(&"elsewhere".to_owned()), "{ran:?}");
    assert!(!ran.iter().any(|r| ["due", "delayed", "op"].contains(&r.as_str())), "{ran:?}");
    assert_eq!(status(&platform, ws, active).await, Some(JobStatus::Succeeded));
    // Nothing waits in the queue any more: a second drain cancels nothing.
    assert_eq!(conveyor_jobs::drain_jobs(&platform.pool, ws, &JobScope::queue(Label::QUEUE)).await.unwrap(), 0);
}

#[tokio::test]
async fn a_clean_deletes_ended_jobs_beyond_the_newest_n_or_by_age_and_discards_failed_ones() {
    let platform = Platform::new(8).await;
    let (ws, other_ws) = (WorkspaceId(Uuid::new_v4()), WorkspaceId(Uuid::new_v4()));
    let labels = Labels::default();
    let (dispatcher, worker) = parts(&platform, &labels).await;
    let mut done = Vec::new();
    for i in 0..5 {
        // One at a time, so that their ends are ordered as they were enqueued.
        done.push(enqueue(&platform, ws, &format!("ok-{i}"), EnqueueOptions::new()).await);
        conveyor_jobs::testing::drain(&dispatcher, &worker).await.unwrap();
    }
    let failed = enqueue(&platform, ws, "fail", EnqueueOptions::new()).await;
    let elsewhere = enqueue(&platform, other_ws, "elsewhere", EnqueueOptions::new()).await;
    let waiting = enqueue(&platform, ws, "waiting", EnqueueOptions::new().delay(Duration::from_secs(3600))).await;
    conveyor_jobs::testing::drain(&dispatcher, &worker).await.unwrap();
    assert_eq!(status(&platform, ws, failed).await, Some(JobStatus::Failed));

    let succeeded = || CleanJobs::ended(JobStatus::Succeeded).unwrap();
    // Ended an hour ago: none yet.
    let none = conveyor_jobs::clean_jobs(&platform.pool, ws, &succeeded().older_than(Duration::from_secs(3600))).await;
    assert_eq!(none.unwrap(), 0);
    // All but the newest two: the three oldest go.
    assert_eq!(conveyor_jobs::clean_jobs(&platform.pool, ws, &succeeded().keep_last(2)).await.unwrap(), 3);
    for (i, job) in done.iter().enumerate() {
        let expected = if i < 3 { None } else { Some(JobStatus::Succeeded) };
        assert_eq!(status(&platform, ws, *job).await, expected, "job {i}");
    }
    // The failed job is discarded (gone to its owner), the other workspace's and the waiting job stay.
    let failures = CleanJobs::ended(JobStatus::Failed).unwrap().scope(JobScope::queue(Label::QUEUE));
    assert_eq!(conveyor_jobs::clean_jobs(&platform.pool, ws, &failures).await.unwrap(), 1);
    assert_eq!(status(&platform, ws, failed).await, None);
    assert_eq!(status(&platform, other_ws, elsewhere).await, Some(JobStatus::Succeeded));
    assert_eq!(status(&platform, ws, waiting).await, Some(JobStatus::Scheduled));
    // A status that is not an end is no clean.
    assert!(CleanJobs::ended(JobStatus::Queued).is_none());
}

#[tokio::test]
async fn a_drain_of_more_than_a_step_cancels_every_waiting_job() {
    let platform = Platform::new(8).await;
    let ws = WorkspaceId(Uuid::new_v4());
    let mut tx = conveyor_jobs::begin_workspace(&platform.pool, ws).await.unwrap();
    let jobs: Vec<Label> = (0..2500).map(|i| label(&format!("bulk-{i}"))).collect();
    conveyor_jobs::enqueue_many_tx(&mut tx, jobs.iter().map(|j| (j, EnqueueOptions::new()))).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(conveyor_jobs::drain_jobs(&platform.pool, ws, &JobScope::kind::<Label>()).await.unwrap(), 2500);
    assert_eq!(conveyor_jobs::drain_jobs(&platform.pool, ws, &JobScope::kind::<Label>()).await.unwrap(), 0);
}

#[tokio::test]
async fn a_clean_keeps_a_canceled_job_whose_run_may_still_be_going() {
    let platform = Platform::new(8).await;
    let ws = WorkspaceId(Uuid::new_v4());
    let labels = Labels::default();
    let (dispatcher, worker) = parts(&platform, &labels).await;
    // Handed to a worker, then canceled: its run may be going, and must find its row to roll back.
    let handed_out = enqueue(&platform, ws, "handed-out", EnqueueOptions::new()).await;
    dispatcher.dispatch_once().await.unwrap();
    conveyor_jobs::cancel_job(&platform.pool, ws, handed_out).await.unwrap();
    // Canceled while it waited: nothing runs it.
    let waited = enqueue(&platform, ws, "waited", EnqueueOptions::new().delay(Duration::from_secs(3600))).await;
    conveyor_jobs::cancel_job(&platform.pool, ws, waited).await.unwrap();

    let canceled = CleanJobs::ended(JobStatus::Canceled).unwrap();
    assert_eq!(conveyor_jobs::clean_jobs(&platform.pool, ws, &canceled).await.unwrap(), 1);
    assert_eq!(status(&platform, ws, waited).await, None);
    assert_eq!(status(&platform, ws, handed_out).await, Some(JobStatus::Canceled));
    // Its delivery is skipped: it never runs.
    while worker.process_one().await.unwrap().is_some() {}
    assert!(labels.0.lock().unwrap().is_empty());
}

#[tokio::test]
async fn a_changed_job_does_not_run_from_an_earlier_hand_off_still_in_the_stream() {
    let platform = Platform::new(8).await;
    let ws = WorkspaceId(Uuid::new_v4());
    let labels = Labels::default();
    let (dispatcher, worker) = parts(&platform, &labels).await;
    let job = enqueue(&platform, ws, "old", EnqueueOptions::new()).await;
    dispatcher.dispatch_once().await.unwrap();
    // As when an XADD's reply is lost: the entry is in the stream, and the relay puts the job back to pending.
    platform.set_job_row(ws, job.0, Platform::XADD_REPLY_LOST).await;
    conveyor_jobs::change_job(&platform.pool, ws, job, &JobChange::new().payload(&label("new"))).await.unwrap();

    conveyor_jobs::testing::drain(&dispatcher, &worker).await.unwrap();
    assert_eq!(*labels.0.lock().unwrap(), ["new"], "only the changed job ran");
    assert_eq!(status(&platform, ws, job).await, Some(JobStatus::Succeeded));
}

#[tokio::test]
async fn a_clean_by_age_takes_the_jobs_that_ended_long_enough_ago_and_with_keep_last_only_those_beyond_the_newest() {
    let platform = Platform::new(8).await;
    let ws = WorkspaceId(Uuid::new_v4());
    let labels = Labels::default();
    let (dispatcher, worker) = parts(&platform, &labels).await;
    let mut ended = Vec::new();
    for i in 0..5 {
        if i == 3 {
            // The first three ended over a second before the last two.
            tokio::time::sleep(Duration::from_millis(1100)).await;
        }
        ended.push(enqueue(&platform, ws, &format!("ok-{i}"), EnqueueOptions::new()).await);
        conveyor_jobs::testing::drain(&dispatcher, &worker).await.unwrap();
    }
    let clean = |c: CleanJobs| {
        let pool = platform.pool.clone();
        async move { conveyor_jobs::clean_jobs(&pool, ws, &c).await.unwrap() }
    };
    let succeeded = || CleanJobs::ended(JobStatus::Succeeded).unwrap();
    let second = Duration::from_secs(1);
    // Older than a second and beyond the newest four: the oldest alone.
    assert_eq!(clean(succeeded().older_than(second).keep_last(4)).await, 1);
    // Older than a second: the two others of the first three.
    assert_eq!(clean(succeeded().older_than(second)).await, 2);
    assert_eq!(clean(succeeded().older_than(second)).await, 0);
    let mut left = Vec::new();
    for job in &ended {
        left.push(status(&platform, ws, *job).await.is_some());
    }
    assert_eq!(left, [false, false, false, true, true]);
}

#[tokio::test]
async fn a_drain_racing_the_relay_cancels_each_job_or_leaves_it_handed_out_to_run_never_both() {
    let platform = Platform::new(16).await;
    let ws = WorkspaceId(Uuid::new_v4());
    let labels = Labels::default();
    let (dispatcher, worker) = parts(&platform, &labels).await;
    let dispatcher = Arc::new(dispatcher);
    let (mut canceled, mut ran) = (0, 0);
    for round in 0..8 {
        let mut jobs = Vec::new();
        for i in 0..20 {
            jobs.push((enqueue(&platform, ws, &format!("r{round}-{i}"), EnqueueOptions::new()).await, i));
        }
        let relay = {
            let dispatcher = dispatcher.clone();
            tokio::spawn(async move { dispatcher.dispatch_once().await.unwrap() })
        };
        let drained = conveyor_jobs::drain_jobs(&platform.pool, ws, &JobScope::queue(Label::QUEUE)).await.unwrap();
        relay.await.unwrap();
        conveyor_jobs::testing::drain(&dispatcher, &worker).await.unwrap();
        let runs = std::mem::take(&mut *labels.0.lock().unwrap());
        let mut round_canceled = 0;
        for (job, i) in jobs {
            let ran_it = runs.iter().filter(|r| **r == format!("r{round}-{i}")).count();
            match status(&platform, ws, job).await {
                Some(JobStatus::Canceled) => {
                    assert_eq!(ran_it, 0, "round {round}: job {i} was drained and ran");
                    round_canceled += 1;
                }
                Some(JobStatus::Succeeded) => assert_eq!(ran_it, 1, "round {round}: job {i} ran {ran_it} times"),
                other => panic!("round {round}: job {i} is {other:?}"),
            }
        }
        assert_eq!(round_canceled, drained, "round {round}: the drain counts what it canceled");
        canceled += round_canceled;
        ran += runs.len() as u64;
    }
    eprintln!("drained before the hand-off: {canceled}, handed out and ran: {ran}");
}

#[tokio::test]
async fn a_promote_makes_every_delayed_job_of_its_scope_due_now_and_leaves_the_rest() {
    let platform = Platform::new(8).await;
    let ws = WorkspaceId(Uuid::new_v4());
    let labels = Labels::default();
    let (dispatcher, worker) = parts(&platform, &labels).await;
    let hour = || EnqueueOptions::new().delay(Duration::from_secs(3600));
    for i in 0..3 {
        enqueue(&platform, ws, &format!("delayed-{i}"), hour()).await;
    }
    let mut tx = conveyor_jobs::begin_workspace(&platform.pool, ws).await.unwrap();
    let other = conveyor_jobs::enqueue_tx(&mut tx, &Other { n: 1 }, hour()).await.unwrap().id;
    tx.commit().await.unwrap();

    assert_eq!(conveyor_jobs::promote_jobs(&platform.pool, ws, &JobScope::queue(Label::QUEUE)).await.unwrap(), 3);
    assert_eq!(conveyor_jobs::promote_jobs(&platform.pool, ws, &JobScope::queue(Label::QUEUE)).await.unwrap(), 0);
    conveyor_jobs::testing::drain(&dispatcher, &worker).await.unwrap();
    let mut ran = labels.0.lock().unwrap().clone();
    ran.sort();
    assert_eq!(ran, ["delayed-0", "delayed-1", "delayed-2"]);
    assert_eq!(status(&platform, ws, other).await, Some(JobStatus::Scheduled), "another queue's job still waits");
}

#[tokio::test]
async fn a_retry_replays_every_failed_job_of_its_scope_but_one_whose_key_a_live_job_holds() {
    let platform = Platform::new(8).await;
    let (ws, other_ws) = (WorkspaceId(Uuid::new_v4()), WorkspaceId(Uuid::new_v4()));
    let labels = Labels::default();
    let (dispatcher, worker) = parts(&platform, &labels).await;
    let failed = enqueue(&platform, ws, "fail", EnqueueOptions::new()).await;
    let keyed = enqueue(&platform, ws, "fail", EnqueueOptions::new().dedup_key("k")).await;
    let elsewhere = enqueue(&platform, other_ws, "fail", EnqueueOptions::new()).await;
    conveyor_jobs::testing::drain(&dispatcher, &worker).await.unwrap();
    assert_eq!(labels.0.lock().unwrap().len(), 3);
    // A live job now holds the failed one's key.
    let holder = enqueue(&platform, ws, "held", EnqueueOptions::new().dedup_key("k").delay(Duration::from_secs(3600)));
    holder.await;

    let retried = conveyor_jobs::retry_jobs(&platform.pool, ws, &JobScope::queue(Label::QUEUE)).await.unwrap();
    assert_eq!(retried, conveyor_jobs::Retried { replayed: 1, key_held: 1, refused: 0 });
    assert_eq!(status(&platform, ws, failed).await, Some(JobStatus::Queued));
    assert_eq!(status(&platform, ws, keyed).await, Some(JobStatus::Failed));
    assert_eq!(status(&platform, other_ws, elsewhere).await, Some(JobStatus::Failed), "another workspace's stays");
    labels.0.lock().unwrap().clear();
    conveyor_jobs::testing::drain(&dispatcher, &worker).await.unwrap();
    assert_eq!(*labels.0.lock().unwrap(), ["fail"], "the replayed job ran again, from its first attempt");
}

#[tokio::test]
async fn an_obliterate_is_refused_while_jobs_run_and_forced_cancels_them_and_empties_the_queue() {
    let platform = Platform::new(8).await;
    let (ws, other_ws) = (WorkspaceId(Uuid::new_v4()), WorkspaceId(Uuid::new_v4()));
    let labels = Labels::default();
    let (dispatcher, worker) = parts(&platform, &labels).await;
    let succeeded = enqueue(&platform, ws, "ok", EnqueueOptions::new()).await;
    let failed = enqueue(&platform, ws, "fail", EnqueueOptions::new()).await;
    let elsewhere = enqueue(&platform, other_ws, "elsewhere", EnqueueOptions::new()).await;
    conveyor_jobs::testing::drain(&dispatcher, &worker).await.unwrap();
    let running = enqueue(&platform, ws, "running", EnqueueOptions::new()).await;
    dispatcher.dispatch_once().await.unwrap();
    let waiting = enqueue(&platform, ws, "waiting", EnqueueOptions::new().delay(Duration::from_secs(3600))).await;
    let mut tx = conveyor_jobs::begin_workspace(&platform.pool, ws).await.unwrap();
    let other_queue = conveyor_jobs::enqueue_tx(&mut tx, &Other { n: 1 }, EnqueueOptions::new()).await.unwrap().id;
    tx.commit().await.unwrap();

    let refused = conveyor_jobs::obliterate_queue(&platform.pool, ws, Label::QUEUE, false).await;
    assert!(matches!(refused, Err(conveyor_jobs::ObliterateError::Running(1))), "{refused:?}");
    assert_eq!(status(&platform, ws, waiting).await, Some(JobStatus::Scheduled), "a refusal changes nothing");
    assert_eq!(status(&platform, ws, succeeded).await, Some(JobStatus::Succeeded));

    let done = conveyor_jobs::obliterate_queue(&platform.pool, ws, Label::QUEUE, true).await.unwrap();
    assert_eq!(done, conveyor_jobs::Obliterated { canceled: 2, deleted: 3, kept_running: 1 });
    for gone in [succeeded, failed, waiting] {
        assert_eq!(status(&platform, ws, gone).await, None);
    }
    assert_eq!(status(&platform, ws, running).await, Some(JobStatus::Canceled), "kept while its run may go on");
    assert_eq!(status(&platform, other_ws, elsewhere).await, Some(JobStatus::Succeeded));
    assert_eq!(status(&platform, ws, other_queue).await, Some(JobStatus::Queued));
    // The running job's delivery is skipped: it never runs.
    labels.0.lock().unwrap().clear();
    conveyor_jobs::testing::drain(&dispatcher, &worker).await.unwrap();
    assert!(labels.0.lock().unwrap().is_empty(), "{:?}", labels.0.lock().unwrap());
}

#[tokio::test]
async fn a_forced_obliterate_keeps_the_row_of_a_job_in_a_stream_whose_mark_is_not_recorded_yet() {
    let platform = Platform::new(8).await;
    let ws = WorkspaceId(Uuid::new_v4());
    let labels = Labels::default();
    let (dispatcher, worker) = parts(&platform, &labels).await;
    let job = enqueue(&platform, ws, "in-the-stream", EnqueueOptions::new()).await;
    dispatcher.dispatch_once().await.unwrap();
    // As when the relay has XADDed the job and not yet recorded its mark: leased, no hand-off time.
    platform.set_job_row(ws, job.0, Platform::MARK_NOT_RECORDED).await;

    let done = conveyor_jobs::obliterate_queue(&platform.pool, ws, Label::QUEUE, true).await.unwrap();
    assert_eq!(done, conveyor_jobs::Obliterated { canceled: 1, deleted: 0, kept_running: 1 });
    assert_eq!(status(&platform, ws, job).await, Some(JobStatus::Canceled), "its run must find it to roll back");
    // Its delivery is skipped: it never runs.
    while worker.process_one().await.unwrap().is_some() {}
    assert!(labels.0.lock().unwrap().is_empty());
}
