//! A job's log (`JobContext::log`): lines of every run, a failed one's included, redacted, bounded per job, walled per
//! workspace, read back by `get_job_logs`; and the testing helper's copy of them.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use conveyor_jobs::{EnqueueOptions, Handler, JobContext, JobError, JobKind, JobStatus, Outcome, Worker, WorkspaceId};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

use crate::kit::Platform;

#[derive(Serialize, Deserialize)]
struct Import {
    lines: u32,
}

impl JobKind for Import {
    const KIND: &'static str = "test.import";
    const QUEUE: &'static str = "test-imports";
    const MAX_ATTEMPTS: u32 = 3;
    const BACKOFF: conveyor_jobs::Backoff =
        conveyor_jobs::Backoff { base: std::time::Duration::ZERO, max: std::time::Duration::ZERO };
}

/// Logs a line naming its run, with a credential that must not be stored; fails its first run after logging; then
/// logs `lines` more.
struct Importer {
    runs: Arc<AtomicU32>,
}

impl Handler<Import> for Importer {
    async fn handle(&self, job: Import, cx: &mut JobContext) -> Result<Value, JobError> {
        let run = self.runs.fetch_add(1, Ordering::SeqCst) + 1;
        cx.log(format!("run {run}: fetching postgres://importer:s3cret-pw@db.internal/feed")).await;
        if run == 1 {
            return Err(JobError::retryable("the feed timed out"));
        }
        for i in 0..job.lines {
            cx.log(format!("row {i}")).await;
        }
        Ok(Value::Null)
    }
}

async fn run_import(platform: &Platform, ws: WorkspaceId, lines: u32) -> conveyor_jobs::JobId {
    let mut tx = conveyor_jobs::begin_workspace(&platform.pool, ws).await.unwrap();
    let id = conveyor_jobs::enqueue_tx(&mut tx, &Import { lines }, EnqueueOptions::new()).await.unwrap().id;
    tx.commit().await.unwrap();
    let dispatcher = platform.dispatcher(|_| {}).await;
    let worker = Worker::builder(platform.pool.clone(), platform.consumer("logs").await)
        .runtime_pool(platform.runtime_pool.clone())
        .handle::<Import>(Importer { runs: Arc::default() })
        .build()
        .unwrap();
    worker.ensure_groups().await.unwrap();
    let outcomes = conveyor_jobs::testing::drain(&dispatcher, &worker).await.unwrap();
    assert_eq!(outcomes, [Outcome::Retried, Outcome::Succeeded]);
    id
}

#[tokio::test]
async fn a_jobs_log_keeps_every_runs_lines_redacted_and_is_its_workspaces_alone() {
    let platform = Platform::new(8).await;
    let (ws, other) = (WorkspaceId(Uuid::new_v4()), WorkspaceId(Uuid::new_v4()));
    let job = run_import(&platform, ws, 2).await;
    assert_eq!(conveyor_jobs::get_job(&platform.pool, ws, job).await.unwrap().unwrap().status, JobStatus::Succeeded);

    let logs = conveyor_jobs::get_job_logs(&platform.pool, ws, job).await.unwrap();
    let seen: Vec<(i32, i32, &str)> = logs.iter().map(|l| (l.seq, l.attempt, l.line.as_str())).collect();
    assert_eq!(seen.len(), 4, "{seen:?}");
    // The failed first run's line stays; each line names its run, in order.
    assert_eq!((seen[0].0, seen[0].1), (1, 1));
    assert!(seen[0].2.starts_with("run 1: fetching postgres://"), "{seen:?}");
    assert_eq!(seen[1..].iter().map(|l| (l.0, l.1)).collect::<Vec<_>>(), [(2, 2), (3, 2), (4, 2)]);
    assert_eq!((seen[2].2, seen[3].2), ("row 0", "row 1"));
    assert!(logs.iter().all(|l| !l.line.contains("s3cret")), "a credential was stored: {seen:?}");
    assert!(logs.windows(2).all(|w| w[0].at <= w[1].at));
    // Another workspace sees no line of it.
    assert!(conveyor_jobs::get_job_logs(&platform.pool, other, job).await.unwrap().is_empty());
}

#[tokio::test]
async fn a_jobs_log_is_bounded_and_the_job_runs_on_past_the_bound() {
    let platform = Platform::new(8).await;
    let ws = WorkspaceId(Uuid::new_v4());
    let job = run_import(&platform, ws, 150).await;
    assert_eq!(conveyor_jobs::get_job(&platform.pool, ws, job).await.unwrap().unwrap().status, JobStatus::Succeeded);
    let logs = conveyor_jobs::get_job_logs(&platform.pool, ws, job).await.unwrap();
    assert_eq!(logs.len(), 100, "at most 100 lines a job");
    assert_eq!(
        logs.last().unwrap().line,
        "row 97",
        "the first lines are kept (two of runs, 98 rows), later ones dropped"
    );
}

#[tokio::test]
async fn the_testing_helper_returns_what_a_run_logged() {
    let platform = Platform::new(8).await;
    let tx = conveyor_jobs::begin_workspace(&platform.pool, WorkspaceId(Uuid::new_v4())).await.unwrap();
    let runs = Arc::new(AtomicU32::new(1));
    let worked = conveyor_jobs::testing::work(&Importer { runs }, tx, Import { lines: 1 }).await;
    assert_eq!(worked.outcome, Outcome::Succeeded);
    assert_eq!(worked.logs.len(), 2);
    assert!(worked.logs[0].starts_with("run 2: fetching") && !worked.logs[0].contains("s3cret"), "{:?}", worked.logs);
    assert_eq!(worked.logs[1], "row 0");
}

/// Logs `lines` lines of 500 three-byte characters each (the most a line keeps), then succeeds.
#[derive(Serialize, Deserialize)]
struct Wide {
    lines: u32,
}

impl JobKind for Wide {
    const KIND: &'static str = "test.wide";
    const QUEUE: &'static str = "test-imports";
}

struct WideLogger;

impl Handler<Wide> for WideLogger {
    async fn handle(&self, job: Wide, cx: &mut JobContext) -> Result<Value, JobError> {
        for _ in 0..job.lines {
            cx.log("€".repeat(500)).await;
        }
        Ok(Value::Null)
    }
}

#[tokio::test]
async fn a_jobs_log_keeps_at_most_64_kib_whatever_its_count_of_lines() {
    let platform = Platform::new(8).await;
    let ws = WorkspaceId(Uuid::new_v4());
    let mut tx = conveyor_jobs::begin_workspace(&platform.pool, ws).await.unwrap();
    let job = conveyor_jobs::enqueue_tx(&mut tx, &Wide { lines: 60 }, EnqueueOptions::new()).await.unwrap().id;
    tx.commit().await.unwrap();
    let dispatcher = platform.dispatcher(|_| {}).await;
    let worker = Worker::builder(platform.pool.clone(), platform.consumer("wide-logs").await)
        .runtime_pool(platform.runtime_pool.clone())
        .handle::<Wide>(WideLogger)
        .build()
        .unwrap();
    worker.ensure_groups().await.unwrap();
    assert_eq!(conveyor_jobs::testing::drain(&dispatcher, &worker).await.unwrap(), [Outcome::Succeeded]);

    let logs = conveyor_jobs::get_job_logs(&platform.pool, ws, job).await.unwrap();
    let line = logs[0].line.len();
    assert_eq!(line, 1500, "500 characters of 3 bytes");
    assert!(logs.iter().all(|l| l.line.len() == line));
    // The byte bound, not the count: as many whole lines as 64 KiB holds, of the 60 logged.
    assert_eq!(logs.len(), 64 * 1024 / line, "{} lines kept", logs.len());
    // The testing helper keeps the same bound.
    let tx = conveyor_jobs::begin_workspace(&platform.pool, ws).await.unwrap();
    let worked = conveyor_jobs::testing::work(&WideLogger, tx, Wide { lines: 60 }).await;
    assert_eq!(worked.logs.len(), logs.len());
}
