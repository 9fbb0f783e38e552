//! The queue gate: a flood of slow jobs waits in PostgreSQL, not in the stream, so a light workspace's job committed
//! in the middle of it starts after the few jobs the gate let into the stream, not after the flood's whole window.
//! Counted in jobs started, not timed: the same run with the gate off puts the light job behind most of the flood.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use conveyor_jobs::{EnqueueOptions, Handler, JobContext, JobError, Worker, WorkerSettings, WorkspaceId};
use serde_json::Value;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::kit::{Job, Platform, eventually};

/// The tenants in the order their jobs started.
type Starts = Arc<Mutex<Vec<usize>>>;

struct Slow {
    starts: Starts,
}

impl Handler<Job> for Slow {
    async fn handle(&self, job: Job, _: &mut JobContext) -> Result<Value, JobError> {
        self.starts.lock().unwrap().push(job.tenant);
        tokio::time::sleep(Duration::from_millis(50)).await;
        Ok(Value::Null)
    }
}

const FLOOD: usize = 200;
const SLOTS: usize = 4;

/// Flood jobs that started between the light job's commit and its start, with the gate's wait `queue_wait` (zero: no
/// gate); the window is the default (256), larger than the flood.
async fn flood_jobs_ahead_of_a_light_one(queue_wait: Duration) -> usize {
    let platform = Platform::new(8).await;
    let (flood, light) = (WorkspaceId(Uuid::new_v4()), WorkspaceId(Uuid::new_v4()));
    let mut tx = conveyor_jobs::begin_workspace(&platform.pool, flood).await.unwrap();
    let jobs: Vec<Job> = (0..FLOOD).map(|_| Job { tenant: 0, at_ms: 0.0 }).collect();
    conveyor_jobs::enqueue_many_tx(&mut tx, jobs.iter().map(|j| (j, EnqueueOptions::new()))).await.unwrap();
    tx.commit().await.unwrap();

    let starts: Starts = Arc::default();
    let shutdown = CancellationToken::new();
    let dispatcher = platform.dispatcher(|s| s.queue_wait = queue_wait).await;
    let worker = Worker::builder(platform.pool.clone(), platform.consumer("gate").await)
        .runtime_pool(platform.runtime_pool.clone())
        .handle::<Job>(Slow { starts: starts.clone() })
        .settings(WorkerSettings { concurrency: SLOTS, ..WorkerSettings::default() })
        .build()
        .unwrap();
    // The workers are there before the flood is relayed: the dispatcher's gate knows their queue from the start.
    worker.ensure_groups().await.unwrap();
    worker.register_kinds().await.unwrap();
    tokio::spawn(dispatcher.run(shutdown.clone()));
    tokio::spawn(worker.run(shutdown.clone(), Duration::from_secs(5)));

    // The flood runs (and the gate has measured its pace) before the light workspace commits.
    let running = eventually(Duration::from_secs(60), || async { (starts.lock().unwrap().len() >= 40).then_some(()) });
    assert!(running.await.is_some(), "the flood started");
    let mut tx = conveyor_jobs::begin_workspace(&platform.pool, light).await.unwrap();
    conveyor_jobs::enqueue_tx(&mut tx, &Job { tenant: 1, at_ms: 0.0 }, EnqueueOptions::new()).await.unwrap();
    let before = starts.lock().unwrap().len();
    tx.commit().await.unwrap();
    let started =
        eventually(Duration::from_secs(60), || async { starts.lock().unwrap().iter().position(|&tenant| tenant == 1) });
    let at = started.await.expect("the light job started");
    shutdown.cancel();
    at - before
}

#[tokio::test]
async fn a_light_workspaces_job_starts_after_the_few_flood_jobs_the_gate_let_into_the_stream() {
    // The gate keeps some 50 ms of the workers' pace waiting (80 jobs/s here: 4, its floor), plus what a claim made
    // before the next look could add.
    let gated = flood_jobs_ahead_of_a_light_one(Duration::from_millis(50)).await;
    assert!(gated <= 4 + SLOTS + 8, "{gated} flood jobs started ahead of the light one");
    // Without it the flood's whole window went into the stream at once, in front of the light job.
    let ungated = flood_jobs_ahead_of_a_light_one(Duration::ZERO).await;
    assert!(ungated >= FLOOD / 2, "only {ungated} flood jobs ahead without the gate");
}
