//! Flows: a parent job that runs once its children have ended. Enqueued whole in the caller's transaction; released by
//! the transaction that records its last child's end; failure policies; cancellation of a waiting parent; a replayed
//! child; refusals; a PostgreSQL crash while children end; a worker process killed after a child's commit and before
//! its acknowledgement; a dispatcher process killed while it hands out a released parent. Real PostgreSQL, Redis,
//! dispatcher and worker.

use crate::common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{TestApp, principal};
use conveyor_jobs::{
    ChildFailure, Consumer, EnqueueError, EnqueueOptions, Flow, Handler, JobContext, JobError, JobId, JobInfo, JobKind,
    JobStatus, Worker, WorkerSettings, WorkspaceId,
};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

/// A child: "ok" answers its name, "slow" too after 50 ms, "bare" too without a transaction of its own (its end is
/// recorded in the worker's batches), "hold" holds its own row locked for 600 ms in its transaction (as its end does,
/// for an instant), "fail" fails for good, "later" is due in an hour.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Step {
    name: String,
    mode: String,
}

impl JobKind for Step {
    const KIND: &'static str = "test.flow_step";
    const QUEUE: &'static str = "flow-steps";
    // A run that met PostgreSQL going away is tried again soon ("fail" fails for good at once).
    const BACKOFF: conveyor_jobs::Backoff =
        conveyor_jobs::Backoff { base: Duration::from_millis(100), max: Duration::from_millis(500) };
}

/// A parent: answers what it read of its children.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Gather {
    name: String,
}

impl JobKind for Gather {
    const KIND: &'static str = "test.flow_gather";
    const QUEUE: &'static str = "flow-parents";
    const BACKOFF: conveyor_jobs::Backoff =
        conveyor_jobs::Backoff { base: Duration::from_millis(100), max: Duration::from_millis(500) };
}

fn step(name: &str, mode: &str) -> Flow {
    let options =
        if mode == "later" { EnqueueOptions::new().delay(Duration::from_secs(3600)) } else { EnqueueOptions::new() };
    Flow::job(&Step { name: name.into(), mode: mode.into() }, options).unwrap()
}

fn gather(name: &str) -> Flow {
    Flow::job(&Gather { name: name.into() }, EnqueueOptions::new()).unwrap()
}

/// Every run of a parent, by job: the children it read (status, result) when it ran.
type Runs = Arc<Mutex<HashMap<JobId, Vec<Vec<(JobStatus, Option<Value>)>>>>>;

struct Steps;

/// Told when a "hold" child holds its row.
static HOLDING: tokio::sync::Notify = tokio::sync::Notify::const_new();

impl Handler<Step> for Steps {
    async fn handle(&self, job: Step, cx: &mut JobContext) -> Result<Value, JobError> {
        match job.mode.as_str() {
            "fail" => Err(JobError::permanent(format!("{} broke", job.name))),
            "bare" => Ok(json!(job.name)),
            "hold" => {
                let id = cx.id();
                sqlx::query("SELECT 1 FROM conveyor.outbox_events WHERE id = $1 FOR UPDATE")
                    .bind(id.0)
                    .execute(&mut **cx.tx().await?)
                    .await?;
                HOLDING.notify_one();
                tokio::time::sleep(Duration::from_millis(600)).await;
                Ok(json!(job.name))
            }
            mode => {
                if mode == "slow" {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                // Written in the job's transaction: the end (and its parent's count) commits with it.
                sqlx::query("SELECT 1").execute(&mut **cx.tx().await?).await?;
                Ok(json!(job.name))
            }
        }
    }
}

struct Gatherer(Runs);

impl Handler<Gather> for Gatherer {
    async fn handle(&self, _: Gather, cx: &mut JobContext) -> Result<Value, JobError> {
        let children = cx.children().await?;
        let seen: Vec<(JobStatus, Option<Value>)> = children.iter().map(|c| (c.status, c.result.clone())).collect();
        self.0.lock().unwrap().entry(cx.id()).or_default().push(seen.clone());
        sqlx::query("SELECT 1").execute(&mut **cx.tx().await?).await?;
        Ok(json!(children.iter().map(|c| json!({ "status": c.status, "result": c.result })).collect::<Vec<_>>()))
    }
}

/// A dispatcher and a worker of both kinds over `app`, until `shutdown`.
async fn platform(app: &TestApp, runs: &Runs, shutdown: &CancellationToken) {
    let redis = common::redis_url();
    common::run_dispatcher(
        common::test_dispatcher(app, &redis, |v| {
            v.insert("CONVEYOR_DISPATCH_POLL".into(), "200ms".into());
        })
        .await,
        shutdown,
    );
    let worker = Worker::builder(app.db.pool.clone(), Consumer::connect(&redis, &app.redis_prefix).await.unwrap())
        .runtime_pool(app.db.runtime_pool.clone())
        .handle::<Step>(Steps)
        .handle::<Gather>(Gatherer(runs.clone()))
        .settings(WorkerSettings { concurrency: 16, ..WorkerSettings::default() })
        .build()
        .unwrap();
    tokio::spawn(worker.run(shutdown.clone(), Duration::from_secs(5)));
}

async fn enqueue(app: &TestApp, ws: WorkspaceId, flow: Flow) -> conveyor_jobs::EnqueuedFlow {
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
    let enqueued = conveyor_jobs::enqueue_flow_tx(&mut tx, flow).await.unwrap();
    tx.commit().await.unwrap();
    enqueued
}

async fn job(app: &TestApp, ws: WorkspaceId, id: JobId) -> JobInfo {
    conveyor_jobs::get_job(&app.db.pool, ws, id).await.unwrap().expect("the job exists")
}

async fn ended(app: &TestApp, ws: WorkspaceId, id: JobId) -> JobInfo {
    conveyor_jobs::wait_for_job(&app.db.pool, ws, id, Duration::from_secs(30)).await.expect("the job ended")
}

#[tokio::test]
async fn a_parent_waits_for_every_child_and_grandchild_then_reads_their_results() {
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    let flow = gather("root")
        .child(step("a", "ok"))
        .child(gather("middle").child(step("b", "ok")).child(step("c", "ok")))
        .child(step("d", "ok"));
    let ids = enqueue(&app, ws, flow).await;
    let (a, middle, d) = (ids.children[0].id, ids.children[1].id, ids.children[2].id);
    let (b, c) = (ids.children[1].children[0].id, ids.children[1].children[1].id);

    // Before any worker: the parents wait for their children, the leaves are due, and each knows its parent.
    let root = job(&app, ws, ids.id).await;
    assert_eq!((root.status, root.children_left, root.parent_id), (JobStatus::WaitingChildren, 3, None));
    let mid = job(&app, ws, middle).await;
    assert_eq!((mid.status, mid.children_left, mid.parent_id), (JobStatus::WaitingChildren, 2, Some(ids.id)));
    assert_eq!(job(&app, ws, b).await.parent_id, Some(middle));
    assert_eq!(job(&app, ws, a).await.status, JobStatus::Queued);
    assert_eq!(job(&app, ws, a).await.queue, "flow-steps", "children live on their own queue");

    let (runs, shutdown) = (Runs::default(), CancellationToken::new());
    platform(&app, &runs, &shutdown).await;
    let root = ended(&app, ws, ids.id).await;
    assert_eq!(root.status, JobStatus::Succeeded);
    // The root read its children's ends in the order they were added: the middle one with what it read of its own.
    let middle_result = json!([{ "status": "succeeded", "result": "b" }, { "status": "succeeded", "result": "c" }]);
    assert_eq!(
        root.result,
        Some(json!([
            { "status": "succeeded", "result": "a" },
            { "status": "succeeded", "result": middle_result },
            { "status": "succeeded", "result": "d" },
        ]))
    );
    // Each parent was handed out only after its last child ended.
    for (parent, children) in [(ids.id, vec![a, middle, d]), (middle, vec![b, c])] {
        let handed_out = job(&app, ws, parent).await.dispatched_at.expect("handed out");
        for child in children {
            let child = job(&app, ws, child).await;
            assert!(child.finished_at.unwrap() <= handed_out, "{child:?} ended before its parent was handed out");
        }
    }
    assert_eq!(runs.lock().unwrap()[&ids.id].len(), 1, "the root ran once");
    assert_eq!(conveyor_jobs::get_children(&app.db.pool, ws, middle).await.unwrap().len(), 2);
    // Another workspace sees neither the flow nor its children.
    assert!(conveyor_jobs::get_children(&app.db.pool, principal().workspace_id, ids.id).await.unwrap().is_empty());
    shutdown.cancel();
}

#[tokio::test]
async fn a_failed_child_fails_its_parent_or_is_ignored_or_removed_as_its_policy_says() {
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    let failing = enqueue(&app, ws, gather("fails").child(step("ok", "ok")).child(step("bad", "fail"))).await;
    let ignoring = enqueue(
        &app,
        ws,
        gather("ignores").child(step("ok", "ok")).child_on_failure(step("bad", "fail"), ChildFailure::Ignore),
    )
    .await;
    let removing = enqueue(
        &app,
        ws,
        gather("removes").child(step("ok", "ok")).child_on_failure(step("bad", "fail"), ChildFailure::Remove),
    )
    .await;
    let (runs, shutdown) = (Runs::default(), CancellationToken::new());
    platform(&app, &runs, &shutdown).await;

    // Fail (the default): the parent fails without running, naming the child; the other child still ran.
    let parent = ended(&app, ws, failing.id).await;
    let bad = failing.children[1].id;
    assert_eq!(parent.status, JobStatus::Failed);
    let error = parent.last_error.unwrap();
    assert!(error.contains(&bad.0.to_string()) && error.contains("bad broke"), "{error}");
    assert_eq!(ended(&app, ws, failing.children[0].id).await.status, JobStatus::Succeeded);

    // Ignore: the parent runs and reads the failure among its children's ends.
    assert_eq!(ended(&app, ws, ignoring.id).await.status, JobStatus::Succeeded);
    // Remove: the parent runs as if the failed child had never been one.
    assert_eq!(ended(&app, ws, removing.id).await.status, JobStatus::Succeeded);
    let runs = runs.lock().unwrap();
    assert!(!runs.contains_key(&failing.id), "a parent failed by its child never runs");
    assert_eq!(runs[&ignoring.id], vec![vec![(JobStatus::Succeeded, Some(json!("ok"))), (JobStatus::Failed, None)]]);
    assert_eq!(runs[&removing.id], vec![vec![(JobStatus::Succeeded, Some(json!("ok")))]]);
    shutdown.cancel();
}

#[tokio::test]
async fn canceling_a_waiting_parent_cancels_its_live_children_and_theirs() {
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    let ids =
        enqueue(&app, ws, gather("root").child(step("a", "later")).child(gather("mid").child(step("b", "later"))))
            .await;
    let other = enqueue(&app, ws, gather("other").child(step("c", "later"))).await;
    conveyor_jobs::cancel_job(&app.db.pool, ws, ids.id).await.unwrap();
    for id in [ids.id, ids.children[0].id, ids.children[1].id, ids.children[1].children[0].id] {
        let canceled = job(&app, ws, id).await;
        assert_eq!(canceled.status, JobStatus::Canceled, "{canceled:?}");
    }
    assert_eq!(job(&app, ws, ids.children[0].id).await.last_error.as_deref(), Some("its parent was canceled"));
    assert_eq!(job(&app, ws, ids.id).await.children_left, 0, "a canceled parent waits for nobody");
    // Another flow is left alone.
    assert_eq!(job(&app, ws, other.id).await.status, JobStatus::WaitingChildren);
    assert_eq!(job(&app, ws, other.children[0].id).await.status, JobStatus::Scheduled);
}

#[tokio::test]
async fn canceling_a_parent_while_its_child_ends_waits_for_that_end_and_never_deadlocks() {
    // The child's end holds its row, then locks its parent; the cancellation locks what it will cancel before the
    // parent, so the two wait for each other in turn. Locking the parent first, it would wait for the child while the
    // child waits for it: PostgreSQL would break the cycle after a second by failing the cancellation.
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    let ids = enqueue(&app, ws, gather("root").child(step("held", "hold")).child(step("later", "later"))).await;
    let (runs, shutdown) = (Runs::default(), CancellationToken::new());
    platform(&app, &runs, &shutdown).await;
    let held = ids.children[0].id;
    tokio::time::timeout(Duration::from_secs(30), HOLDING.notified()).await.expect("the child holds its row");
    conveyor_jobs::cancel_job(&app.db.pool, ws, ids.id).await.expect("the cancellation is not broken as a deadlock");
    assert_eq!(job(&app, ws, ids.id).await.status, JobStatus::Canceled);
    assert_eq!(job(&app, ws, held).await.status, JobStatus::Succeeded, "the child's end went first");
    assert_eq!(job(&app, ws, ids.children[1].id).await.status, JobStatus::Canceled);
    assert!(!runs.lock().unwrap().contains_key(&ids.id), "the canceled parent never ran");
    shutdown.cancel();
}

#[tokio::test]
async fn a_replayed_child_makes_its_waiting_parent_wait_for_it_again() {
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    let ids = enqueue(
        &app,
        ws,
        gather("root").child_on_failure(step("bad", "fail"), ChildFailure::Ignore).child(step("later", "later")),
    )
    .await;
    let (runs, shutdown) = (Runs::default(), CancellationToken::new());
    platform(&app, &runs, &shutdown).await;
    let bad = ids.children[0].id;
    assert_eq!(ended(&app, ws, bad).await.status, JobStatus::Failed);
    assert_eq!(job(&app, ws, ids.id).await.children_left, 1, "the failed child counted as ended");
    shutdown.cancel();
    tokio::time::sleep(Duration::from_millis(500)).await;

    // Sent back to live, it is waited for again: the parent will not run before its second end.
    conveyor_jobs::replay_dead_letter(&app.db.pool, ws, bad.0).await.unwrap();
    let root = job(&app, ws, ids.id).await;
    assert_eq!((root.status, root.children_left), (JobStatus::WaitingChildren, 2));
    // A canceled child under `fail` (the default) fails its parent, which then waits for nobody.
    conveyor_jobs::cancel_job(&app.db.pool, ws, ids.children[1].id).await.unwrap();
    let root = job(&app, ws, ids.id).await;
    assert_eq!((root.status, root.children_left), (JobStatus::Failed, 0));
    assert!(root.last_error.as_deref().unwrap().contains("was canceled"), "{root:?}");
    // Replayed, the parent waits again for the children still live (the replayed one), not for the ended ones.
    conveyor_jobs::replay_dead_letter(&app.db.pool, ws, ids.id.0).await.unwrap();
    let root = job(&app, ws, ids.id).await;
    assert_eq!((root.status, root.children_left), (JobStatus::WaitingChildren, 1));
}

#[tokio::test]
async fn sixteen_children_ending_at_once_release_their_parent_once() {
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    let mut flows = Vec::new();
    for f in 0..4 {
        let mut flow = gather(&format!("f{f}"));
        for c in 0..16 {
            // Half end in their own transactions, half in the worker's batched record of ends, at once.
            flow = flow.child(step(&format!("{f}.{c}"), if c % 2 == 0 { "ok" } else { "bare" }));
        }
        flows.push(enqueue(&app, ws, flow).await);
    }
    let (runs, shutdown) = (Runs::default(), CancellationToken::new());
    platform(&app, &runs, &shutdown).await;
    for flow in &flows {
        assert_eq!(ended(&app, ws, flow.id).await.status, JobStatus::Succeeded);
        let runs = runs.lock().unwrap();
        assert_eq!(runs[&flow.id].len(), 1, "released once, run once");
        assert_eq!(runs[&flow.id][0].len(), 16);
        assert!(runs[&flow.id][0].iter().all(|(s, _)| *s == JobStatus::Succeeded), "every child had ended");
    }
    shutdown.cancel();
}

#[tokio::test]
async fn nothing_makes_a_waiting_parent_due_early_and_bad_flows_write_nothing() {
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    let ids = enqueue(&app, ws, gather("root").child(step("a", "later"))).await;

    // Its due time is its children's to decide: a change of it, a run-now, a promotion leave it waiting.
    let due_now = conveyor_jobs::JobChange::new().run_now();
    let refused = conveyor_jobs::change_job(&app.db.pool, ws, ids.id, &due_now).await.unwrap_err();
    assert!(matches!(refused, conveyor_jobs::ChangeError::WaitsForChildren), "{refused:?}");
    let priority = conveyor_jobs::JobChange::new().priority(conveyor_jobs::Priority::High);
    conveyor_jobs::change_job(&app.db.pool, ws, ids.id, &priority).await.expect("its priority may change");
    let promoted =
        conveyor_jobs::promote_jobs(&app.db.pool, ws, &conveyor_jobs::JobScope::every_queue()).await.unwrap();
    assert_eq!(promoted, 1, "the delayed child alone");
    assert_eq!(job(&app, ws, ids.id).await.status, JobStatus::WaitingChildren);
    // Nor does a statement written by hand: the table refuses it.
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
    let by_hand = sqlx::query("UPDATE conveyor.outbox_events SET next_attempt_at = now() WHERE id = $1")
        .bind(ids.id.0)
        .execute(&mut *tx)
        .await
        .unwrap_err();
    assert!(by_hand.to_string().contains("outbox_events_waits_for_children"), "{by_hand}");
    drop(tx);

    // Refused whole, with nothing written: a parent with a due time, a key, one operation named twice.
    let before = app.db.count("outbox_events", ws).await;
    let delayed = Flow::job(&Gather { name: "p".into() }, EnqueueOptions::new().delay(Duration::from_secs(5)))
        .unwrap()
        .child(step("x", "ok"));
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
    let error = conveyor_jobs::enqueue_flow_tx(&mut tx, delayed).await.unwrap_err();
    assert!(matches!(&error, EnqueueError::InvalidOptions(m) if m.contains("no due time")), "{error}");
    let keyed = Flow::job(&Step { name: "k".into(), mode: "ok".into() }, EnqueueOptions::new().dedup_key("k"));
    assert!(matches!(keyed, Err(EnqueueError::InvalidOptions(m)) if m.contains("de-duplication key")));
    let operation = uuid::Uuid::now_v7();
    let twice = Flow::job(&Gather { name: "p".into() }, EnqueueOptions::new().operation(operation)).unwrap().child(
        Flow::job(&Step { name: "s".into(), mode: "ok".into() }, EnqueueOptions::new().operation(operation)).unwrap(),
    );
    let error = conveyor_jobs::enqueue_flow_tx(&mut tx, twice).await.unwrap_err();
    assert!(matches!(&error, EnqueueError::InvalidOptions(m) if m.contains("two jobs of the flow")), "{error}");
    tx.commit().await.unwrap();
    assert_eq!(app.db.count("outbox_events", ws).await, before);
}

#[tokio::test]
async fn a_postgres_crash_while_children_end_neither_loses_a_release_nor_runs_a_parent_early() {
    // PostgreSQL of the test's own, killed (SIGKILL of every server process, then crash recovery) while children end
    // and their parents are released: each release is in its last child's transaction, so every parent runs, every
    // run of it finds all of its children ended, and no count is left over.
    const FLOWS: usize = 30;
    const CHILDREN: usize = 8;
    let mut pg = common::postgres::TestPostgres::start().await;
    let app = TestApp::spawn_on_db(pg.test_db().await, |_| {}).await;
    let ws = principal().workspace_id;
    let mut flows = Vec::new();
    for f in 0..FLOWS {
        let mut flow = gather(&format!("f{f}"));
        for c in 0..CHILDREN {
            flow = flow.child(step(&format!("{f}.{c}"), "slow"));
        }
        flows.push(enqueue(&app, ws, flow).await);
    }
    let (runs, shutdown) = (Runs::default(), CancellationToken::new());
    platform(&app, &runs, &shutdown).await;
    let children_done = || async {
        let mut owner = app.db.owner().await;
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM conveyor.outbox_events WHERE parent_id IS NOT NULL AND status = 'completed'",
        )
        .fetch_one(&mut owner)
        .await
        .unwrap_or(0)
    };
    common::eventually(Duration::from_secs(60), || async { (children_done().await >= 40).then_some(()) })
        .await
        .expect("children end before the crash");
    let done_at_crash = children_done().await;
    pg.kill_9().await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    pg.start_again().await;

    for flow in &flows {
        let parent = conveyor_jobs::wait_for_job(&app.db.pool, ws, flow.id, Duration::from_secs(120)).await.unwrap();
        let mut children = Vec::new();
        for child in &flow.children {
            children.push(job(&app, ws, child.id).await);
        }
        assert_eq!(parent.status, JobStatus::Succeeded, "{parent:?}\n{children:#?}");
        assert!(children.iter().all(|c| c.status == JobStatus::Succeeded), "{children:#?}");
    }
    for flow in &flows {
        // A run may repeat (at least once), but every run of a parent found all of its children ended.
        for seen in &runs.lock().unwrap()[&flow.id] {
            assert_eq!(seen.len(), CHILDREN);
            assert!(seen.iter().all(|(s, _)| *s == JobStatus::Succeeded), "{seen:?}");
        }
    }
    let mut owner = app.db.owner().await;
    let waiting: i64 = sqlx::query_scalar("SELECT count(*) FROM conveyor.outbox_events WHERE children_left <> 0")
        .fetch_one(&mut owner)
        .await
        .unwrap();
    assert_eq!(waiting, 0, "no parent keeps a count");
    eprintln!("the crash struck with {done_at_crash} of {} children ended", FLOWS * CHILDREN);
    assert!(done_at_crash < (FLOWS * CHILDREN) as i64, "the crash struck mid-run");
    shutdown.cancel();
}

/// A shipped kind whose run, for a store that does not exist, ends at once in its own transaction (the `conveyor
/// worker` process runs it): the crash tests' children and parent.
fn verify(options: EnqueueOptions) -> Flow {
    let payload = conveyor_shop::jobs::VerifyCredentials { store_id: uuid::Uuid::now_v7(), credentials_version: 1 };
    Flow::job(&payload, options).unwrap()
}

/// The entries ever added to `stream` (acknowledged ones are deleted from it).
async fn entries_added(client: &conveyor_jobs::RedisClient, stream: &str) -> i64 {
    use fred::prelude::StreamsInterface;
    // No stream yet: nothing was ever added.
    let Ok(info) = client.xinfo_stream::<HashMap<String, fred::types::Value>, _>(stream, false, None).await else {
        return 0;
    };
    info["entries-added"].as_i64().expect("XINFO STREAM's entries-added")
}

#[tokio::test]
async fn a_worker_killed_after_a_childs_commit_and_before_its_acknowledgement_releases_the_parent_once() {
    // The child's end, and its parent's count, commit in the child's transaction; the worker process dies before it
    // acknowledges the entry. Another worker takes the entry over and finds the child ended: the parent's count is not
    // taken again, so it waits for its other child, and then runs once.
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    let (_sandbox, market) = common::sandbox(Default::default()).await;
    let shutdown = CancellationToken::new();
    common::run_dispatcher(
        common::test_dispatcher(&app, &common::redis_url(), |v| {
            v.insert("CONVEYOR_DISPATCH_POLL".into(), "200ms".into());
        })
        .await,
        &shutdown,
    );
    let flow = verify(EnqueueOptions::new())
        .child(verify(EnqueueOptions::new()))
        .child(verify(EnqueueOptions::new().delay(Duration::from_secs(3600))));
    let ids = enqueue(&app, ws, flow).await;
    let (first, held) = (ids.children[0].id, ids.children[1].id);

    let mut vars = common::config_vars(&app.db, &app.redis_prefix);
    vars.insert("CONVEYOR_MARKETPLACE_URL".into(), market);
    vars.insert("CONVEYOR_WORKER_VISIBILITY".into(), "1s".into());
    let mut crashing = vars.clone();
    crashing.insert("CONVEYOR_ADMIN_ADDR".into(), format!("127.0.0.1:{}", common::free_port()));
    crashing.insert("FAILPOINTS".into(), "worker::before_ack=sleep(60000)".into());
    let mut victim = common::Process::spawn(&["worker"], &crashing);
    let committed = common::eventually(Duration::from_secs(30), || async {
        (job(&app, ws, first).await.status == JobStatus::Succeeded).then_some(())
    })
    .await;
    assert!(committed.is_some(), "the child's end committed; log:\n{}", victim.log());
    victim.kill();
    let client = common::redis_client(&common::redis_url()).await;
    let stream = conveyor_jobs::RedisKeys::new(&app.redis_prefix).stream("stores");
    assert_eq!(common::unacknowledged(&client, &app, "stores").await, 1, "the child's entry was never acknowledged");
    assert_eq!(job(&app, ws, ids.id).await.children_left, 1, "the commit counted the child once");

    vars.insert("CONVEYOR_ADMIN_ADDR".into(), format!("127.0.0.1:{}", common::free_port()));
    let rescuer = common::Process::spawn(&["worker"], &vars);
    let taken_over = common::eventually(Duration::from_secs(30), || async {
        (common::unacknowledged(&client, &app, "stores").await == 0).then_some(())
    })
    .await;
    assert!(taken_over.is_some(), "another worker took the entry over; log:\n{}", rescuer.log());
    let parent = job(&app, ws, ids.id).await;
    assert_eq!((parent.status, parent.children_left), (JobStatus::WaitingChildren, 1), "not released by the repeat");
    assert_eq!(job(&app, ws, first).await.failed_runs, 0);

    // The other child now: the parent goes, once.
    conveyor_jobs::change_job(&app.db.pool, ws, held, &conveyor_jobs::JobChange::new().run_now()).await.unwrap();
    let parent = conveyor_jobs::wait_for_job(&app.db.pool, ws, ids.id, Duration::from_secs(30)).await.unwrap();
    assert_eq!(parent.status, JobStatus::Succeeded, "log:\n{}", rescuer.log());
    assert_eq!((parent.failed_runs, job(&app, ws, first).await.failed_runs), (0, 0));
    assert_eq!(entries_added(&client, &stream).await, 3, "each of the three jobs was added to the stream once");
    shutdown.cancel();
}

#[tokio::test]
async fn a_dispatcher_killed_while_it_hands_out_a_released_parent_hands_it_out_once() {
    // The child's end (a cancel, which the parent ignores) releases the parent; the dispatcher process claims it and
    // adds it to its stream, and dies before it records the hand-off. Another dispatcher takes the lease over: the
    // stream's de-duplication keeps one entry, and the parent runs once.
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    let ids = enqueue(&app, ws, gather("p").child_on_failure(step("c", "later"), ChildFailure::Ignore)).await;
    let mut vars = common::config_vars(&app.db, &app.redis_prefix);
    vars.insert("CONVEYOR_DISPATCH_LEASE".into(), "2s".into());
    vars.insert("CONVEYOR_DISPATCH_POLL".into(), "200ms".into());
    let mut crashing = vars.clone();
    crashing.insert("CONVEYOR_ADMIN_ADDR".into(), format!("127.0.0.1:{}", common::free_port()));
    crashing.insert("FAILPOINTS".into(), "dispatcher::after_xadd=sleep(60000)".into());
    let mut victim = common::Process::spawn(&["dispatcher"], &crashing);
    conveyor_jobs::cancel_job(&app.db.pool, ws, ids.children[0].id).await.unwrap();
    let client = common::redis_client(&common::redis_url()).await;
    let parents = conveyor_jobs::RedisKeys::new(&app.redis_prefix).stream(Gather::QUEUE);
    let added = common::eventually(Duration::from_secs(30), || async {
        (entries_added(&client, &parents).await == 1).then_some(())
    })
    .await;
    assert!(added.is_some(), "the parent was released and added to its stream; log:\n{}", victim.log());
    victim.kill();
    let row = app.db.rows("outbox_events", ws).await.into_iter().find(|r| r["id"] == ids.id.0.to_string()).unwrap();
    assert_eq!(row["status"], "dispatching", "added to the stream, the hand-off never recorded");

    let (runs, shutdown) = (Runs::default(), CancellationToken::new());
    let worker =
        Worker::builder(app.db.pool.clone(), Consumer::connect(&common::redis_url(), &app.redis_prefix).await.unwrap())
            .runtime_pool(app.db.runtime_pool.clone())
            .handle::<Step>(Steps)
            .handle::<Gather>(Gatherer(runs.clone()))
            .build()
            .unwrap();
    tokio::spawn(worker.run(shutdown.clone(), Duration::from_secs(5)));
    vars.insert("CONVEYOR_ADMIN_ADDR".into(), format!("127.0.0.1:{}", common::free_port()));
    let rescuer = common::Process::spawn(&["dispatcher"], &vars);
    let parent = conveyor_jobs::wait_for_job(&app.db.pool, ws, ids.id, Duration::from_secs(30)).await.unwrap();
    assert_eq!(parent.status, JobStatus::Succeeded, "log:\n{}", rescuer.log());
    // Past the lease, which the other dispatcher took over: the parent was added to its stream once, and ran once.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(entries_added(&client, &parents).await, 1);
    assert_eq!(runs.lock().unwrap()[&ids.id].len(), 1, "the parent ran once");
    assert_eq!(parent.failed_runs, 0);
    shutdown.cancel();
}
