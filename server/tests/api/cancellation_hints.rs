//! Cancellation notices are hints (issue 24): any role may `NOTIFY conveyor_jobs_canceled, '<job id>'`, so a worker
//! stops a job only once PostgreSQL says it is canceled. A forged notice, sent from the application role's own
//! connection, stops neither a running job nor one that starts later; a real cancellation still stops its job. Real
//! PostgreSQL, Redis, dispatcher and worker.

use crate::common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{TestApp, principal};
use conveyor_jobs::{
    Consumer, EnqueueOptions, Handler, JobContext, JobError, JobId, JobKind, JobStatus, PauseScope, Worker,
    WorkerSettings, WorkspaceId,
};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

#[derive(Serialize, Deserialize)]
struct Hold;

impl JobKind for Hold {
    const KIND: &'static str = "test.hold";
    const QUEUE: &'static str = "holds";
}

/// The jobs that started, those that saw their cancellation, and the test's word to let the others end.
#[derive(Clone, Default)]
struct Log {
    started: Arc<Mutex<Vec<JobId>>>,
    canceled: Arc<Mutex<Vec<JobId>>>,
    release: Arc<AtomicBool>,
}

impl Log {
    fn started(&self, job: JobId) -> usize {
        self.started.lock().unwrap().iter().filter(|j| **j == job).count()
    }

    fn canceled(&self, job: JobId) -> bool {
        self.canceled.lock().unwrap().contains(&job)
    }
}

/// Runs until its cancellation (checked first: a job told before its release always says so) or the release.
struct Holder(Log);

impl Handler<Hold> for Holder {
    async fn handle(&self, _: Hold, cx: &mut JobContext) -> Result<Value, JobError> {
        self.0.started.lock().unwrap().push(cx.id());
        loop {
            if cx.cancellation().is_cancelled() {
                self.0.canceled.lock().unwrap().push(cx.id());
                return Err(JobError::Canceled);
            }
            if self.0.release.load(Ordering::SeqCst) {
                return Ok(json!("held to the end"));
            }
            tokio::select! {
                _ = cx.cancellation().cancelled() => {}
                _ = tokio::time::sleep(Duration::from_millis(20)) => {}
            }
        }
    }
}

async fn enqueue(app: &TestApp, ws: WorkspaceId) -> JobId {
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
    let job = conveyor_jobs::enqueue_tx(&mut tx, &Hold, EnqueueOptions::new()).await.unwrap();
    tx.commit().await.unwrap();
    job.id
}

async fn running(log: &Log, jobs: &[JobId]) {
    common::eventually(Duration::from_secs(30), || async { jobs.iter().all(|j| log.started(*j) == 1).then_some(()) })
        .await
        .expect("the jobs are running");
}

/// Cancels `job` for real and waits until its handler saw it: the worker has heard every notice sent before.
async fn cancel_for_real(app: &TestApp, log: &Log, ws: WorkspaceId, job: JobId) {
    conveyor_jobs::cancel_job(&app.db.pool, ws, job).await.unwrap();
    common::eventually(Duration::from_secs(30), || async { log.canceled(job).then_some(()) })
        .await
        .expect("a real cancellation stops its running job");
}

#[tokio::test]
async fn a_forged_cancellation_notice_stops_no_job_and_a_real_cancellation_still_does() {
    let app = TestApp::spawn().await;
    let (ws, later_ws) = (principal().workspace_id, principal().workspace_id);
    // A job of another workspace is held in the outbox (pauses are the operator's) until the forged notices are heard.
    let operator = conveyor_jobs::connect_postgres(&app.db.operator_url, 2).await.unwrap();
    assert!(conveyor_jobs::pause(&operator, &PauseScope::workspace(later_ws), None).await.unwrap());
    let (first, forged, last) = (enqueue(&app, ws).await, enqueue(&app, ws).await, enqueue(&app, ws).await);
    let later = enqueue(&app, later_ws).await;

    let (log, shutdown) = (Log::default(), CancellationToken::new());
    let redis = common::redis_url();
    common::run_dispatcher(
        common::test_dispatcher(&app, &redis, |v| {
            v.insert("CONVEYOR_DISPATCH_POLL".into(), "200ms".into());
        })
        .await,
        &shutdown,
    );
    let worker = Worker::builder(app.db.pool.clone(), Consumer::connect(&redis, &app.redis_prefix).await.unwrap())
        .runtime_pool(app.db.runtime_pool.clone())
        .handle::<Hold>(Holder(log.clone()))
        .settings(WorkerSettings { concurrency: 4, ..WorkerSettings::default() })
        .build()
        .unwrap();
    tokio::spawn(worker.run(shutdown.clone(), Duration::from_secs(5)));
    running(&log, &[first, forged, last]).await;
    // The worker listens: a real cancellation reaches it.
    cancel_for_real(&app, &log, ws, first).await;

    // Forged notices, from the application role's connection, for a running job and for one yet to start.
    let mut conn = app.db.app_connection().await;
    sqlx::query(sqlx::AssertSqlSafe(format!("NOTIFY conveyor_jobs_canceled, '{}'", forged.0)))
        .execute(&mut conn)
        .await
        .unwrap();
    sqlx::query("SELECT pg_notify('conveyor_jobs_canceled', $1)")
        .bind(later.0.to_string())
        .execute(&mut conn)
        .await
        .unwrap();
    // A real cancellation committed after them reaches the worker after them (one connection hears them in order).
    cancel_for_real(&app, &log, ws, last).await;
    assert!(!log.canceled(forged), "a forged notice stopped a running job");
    let job = conveyor_jobs::get_job(&app.db.pool, ws, forged).await.unwrap().unwrap();
    assert_eq!(job.status, JobStatus::Active, "still running");

    // Let it end: it completes, having run once.
    log.release.store(true, Ordering::SeqCst);
    let done = conveyor_jobs::wait_for_job(&app.db.pool, ws, forged, Duration::from_secs(30)).await.unwrap();
    assert_eq!(done.status, JobStatus::Succeeded);
    assert_eq!(done.result, Some(json!("held to the end")));
    assert_eq!(log.started(forged), 1);

    // The job named before it started runs when its workspace is resumed.
    assert!(conveyor_jobs::resume(&operator, &PauseScope::workspace(later_ws)).await.unwrap());
    let done = conveyor_jobs::wait_for_job(&app.db.pool, later_ws, later, Duration::from_secs(30)).await.unwrap();
    assert_eq!(done.status, JobStatus::Succeeded, "a forged notice kept a job from starting");
    assert_eq!(log.started(later), 1);
    assert!(!log.canceled(later));

    // The real cancellations ended their jobs canceled.
    for job in [first, last] {
        let done = conveyor_jobs::wait_for_job(&app.db.pool, ws, job, Duration::from_secs(30)).await.unwrap();
        assert_eq!(done.status, JobStatus::Canceled);
    }
    shutdown.cancel();
}
