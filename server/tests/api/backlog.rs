//! The outbox backlog gauges the alerts and the autoscaler read, as a dispatcher reports them
//! (`conveyor_outbox_backlog_due()`, migration 0029): `conveyor_outbox_oldest_pending_age_seconds` ages only due jobs,
//! from when they fell due, so a job delayed on purpose or a retry backing off from a job created long ago never pages
//! (`ConveyorOutboxOldestPendingTooOld`); `conveyor_outbox_events{status}` tells due jobs from delayed, paused
//! (`held`) and dispatched ones (handed to the workers and not ended: what `ConveyorWorkerDown` needs to know that
//! work waits while no worker runs). Real PostgreSQL and Redis.

use crate::common;

use std::time::Duration;

use chrono::Utc;
use common::TestDb;
use conveyor_jobs::Metrics;
use conveyor_jobs::Producer;
use conveyor_jobs::RedisKeys;
use conveyor_jobs::{Dispatcher, DispatcherSettings, EnqueueOptions, JobKind, PauseScope, WorkspaceId};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// A kind of this test's own queue.
#[derive(Serialize, Deserialize)]
struct Report {
    n: u32,
}

impl JobKind for Report {
    const KIND: &'static str = "test.report";
    const QUEUE: &'static str = "reports";
}

/// A dispatcher over the test's database reporting into `metrics`, on a key prefix of its own, connected as a
/// dispatcher process of the harness would be (the runtime role's URL when the harness has one).
async fn dispatcher(db: &TestDb, metrics: &Metrics) -> Dispatcher {
    let prefix = format!("conveyor-test-{}", Uuid::new_v4().simple());
    let vars = common::config_vars(db, &prefix);
    let url = vars.get("CONVEYOR_RUNTIME_DATABASE_URL").or_else(|| vars.get("CONVEYOR_DATABASE_URL")).unwrap();
    let pool = conveyor_jobs::connect_postgres(url, 4).await.unwrap();
    let client = conveyor_jobs::connect_redis(&common::redis_url(), Duration::from_secs(2)).await.unwrap();
    let producer = Producer::new(client, RedisKeys::new(&prefix), Duration::from_secs(60));
    Dispatcher::new(pool, producer, DispatcherSettings::default(), metrics.clone(), "backlog-test".to_owned())
}

/// Enqueues one job of the workspace, then rewrites its timestamps as `shape` says (a fixed SQL fragment), as if it
/// had been created and retried earlier.
async fn job(db: &TestDb, ws: WorkspaceId, options: EnqueueOptions, shape: Option<&'static str>) -> Uuid {
    let mut tx = conveyor_jobs::begin_workspace(&db.pool, ws).await.unwrap();
    let job = conveyor_jobs::enqueue_tx(&mut tx, &Report { n: 1 }, options).await.unwrap();
    if let Some(shape) = shape {
        let sql = format!("UPDATE conveyor.outbox_events SET {shape} WHERE id = $1");
        sqlx::query(sqlx::AssertSqlSafe(sql)).bind(job.id.0).execute(&mut *tx).await.unwrap();
    }
    tx.commit().await.unwrap();
    job.id.0
}

/// The age gauge and the job counts of the queue, as the dispatcher last reported them.
fn reported(metrics: &Metrics) -> (f64, [i64; 4]) {
    let jobs = |state: &str| metrics.outbox_events.with_label_values(&[Report::QUEUE, state]).get();
    let age = metrics.outbox_oldest_pending_age.with_label_values(&[Report::QUEUE]).get();
    (age, [jobs("due"), jobs("delayed"), jobs("held"), jobs("dispatched")])
}

#[tokio::test]
async fn only_due_jobs_age_the_backlog_not_delayed_jobs_nor_retries_backing_off() {
    let db = TestDb::create().await;
    let ws = WorkspaceId(Uuid::new_v4());
    let metrics = Metrics::new();
    let dispatcher = dispatcher(&db, &metrics).await;

    // A job enqueued to run in 10 minutes, and a retry of a job created 20 minutes ago, backing off for a minute:
    // neither is due, so nothing ages (0002's gauge said 20 minutes here, and paged).
    job(&db, ws, EnqueueOptions::new().run_at(Utc::now() + chrono::Duration::minutes(10)), None).await;
    let retry = "created_at = now() - interval '20 minutes', job_attempts = 1, \
                 next_attempt_at = now() + interval '1 minute'";
    job(&db, ws, EnqueueOptions::new(), Some(retry)).await;
    dispatcher.observe_backlog().await.unwrap();
    assert_eq!(reported(&metrics), (0.0, [0, 2, 0, 0]));

    // A job created 30 minutes ago that fell due 2 minutes ago and was not relayed (no relay ran): it has waited
    // 2 minutes, not 30.
    let due = "created_at = now() - interval '30 minutes', next_attempt_at = now() - interval '2 minutes'";
    job(&db, ws, EnqueueOptions::new(), Some(due)).await;
    dispatcher.observe_backlog().await.unwrap();
    let (age, jobs) = reported(&metrics);
    assert_eq!(jobs, [1, 2, 0, 0]);
    assert!((119.0..600.0).contains(&age), "the due job has waited about 2 minutes, the gauge says {age}s");

    // A pause holds the due job: it is counted as held and ages nothing.
    let scope = PauseScope::queue(Report::QUEUE);
    let operator = conveyor_jobs::connect_postgres(&db.operator_url, 2).await.unwrap();
    assert!(conveyor_jobs::pause(&operator, &scope, Some("maintenance window")).await.unwrap());
    dispatcher.observe_backlog().await.unwrap();
    assert_eq!(reported(&metrics), (0.0, [0, 2, 1, 0]));

    // Resumed and relayed, it waits in its stream for a worker: dispatched, not due, and nothing ages.
    assert!(conveyor_jobs::resume(&operator, &scope).await.unwrap());
    dispatcher.dispatch_once().await.unwrap();
    dispatcher.observe_backlog().await.unwrap();
    assert_eq!(reported(&metrics), (0.0, [0, 2, 0, 1]));
}
