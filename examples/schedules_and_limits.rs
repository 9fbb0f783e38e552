//! Repeatable jobs and limits: a schedule that enqueues a job every second (a cron expression in a time zone works
//! the same: `ScheduleSpec::cron("0 8 * * MON", "Europe/Paris")`), and a key limit that lets one store's jobs run
//! one at a time however many workers are free. One PostgreSQL URL (a role that owns its database) and one Redis URL:
//! `DATABASE_URL=postgres://… REDIS_URL=redis://… cargo run --example schedules_and_limits`.

use std::env;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use conveyor_jobs::{
    Conveyor, EnqueueOptions, Handler, JobContext, JobError, JobKind, JobStatus, KeyLimit, ScheduleOptions,
    ScheduleSpec,
};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Fired by the schedule.
#[derive(Serialize, Deserialize)]
struct Heartbeat;

impl JobKind for Heartbeat {
    const KIND: &'static str = "example.heartbeat";
    const QUEUE: &'static str = "example-heartbeats";
}

/// Counts its runs.
struct Beats(Arc<AtomicUsize>);

impl Handler<Heartbeat> for Beats {
    async fn handle(&self, _: Heartbeat, _: &mut JobContext) -> Result<Value, JobError> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Ok(Value::Null)
    }
}

/// A call to one store's marketplace account, which allows one call at a time.
#[derive(Serialize, Deserialize)]
struct SyncStore {
    store: String,
}

impl JobKind for SyncStore {
    const KIND: &'static str = "example.sync_store";
    const QUEUE: &'static str = "example-syncs";
}

/// Notes how many of its jobs run at once, and the most it saw.
#[derive(Default)]
struct Syncs {
    running: AtomicUsize,
    most: AtomicUsize,
}

impl Handler<SyncStore> for Arc<Syncs> {
    async fn handle(&self, _: SyncStore, _: &mut JobContext) -> Result<Value, JobError> {
        let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(now, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(100)).await;
        self.running.fetch_sub(1, Ordering::SeqCst);
        Ok(Value::Null)
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let pool = sqlx::PgPool::connect(&env::var("DATABASE_URL")?).await?;
    conveyor_jobs::migrate(&pool).await?;
    let conveyor = Conveyor::builder(pool.clone(), &env::var("REDIS_URL")?)
        .prefix(&format!("example-{}", std::process::id()))
        .connect()
        .await?;
    let (beats, syncs) = (Arc::new(AtomicUsize::new(0)), Arc::new(Syncs::default()));
    let worker =
        conveyor.worker().handle::<Heartbeat>(Beats(beats.clone())).handle::<SyncStore>(syncs.clone()).build()?;
    let shutdown = tokio_util::sync::CancellationToken::new();
    let running = tokio::spawn(conveyor.clone().run(worker, shutdown.clone()));

    // A schedule belongs to a workspace and is set in a transaction; setting it again replaces it.
    let mut tx = conveyor.begin().await?;
    let every = ScheduleSpec::every(Duration::from_secs(1))?;
    conveyor_jobs::upsert_schedule_tx(&mut tx, "heartbeat", &Heartbeat, every, ScheduleOptions::new()).await?;
    tx.commit().await?;

    // At most one job of the key `store-42` in the workers' hands at once; the others wait in PostgreSQL.
    let one_at_a_time = KeyLimit { max_in_flight: Some(1), ..KeyLimit::default() };
    conveyor_jobs::set_key_limit(&pool, conveyor.workspace(), "store-42", one_at_a_time).await?;
    let mut jobs = Vec::new();
    for _ in 0..5 {
        let options = EnqueueOptions::new().limit_key("store-42");
        jobs.push(conveyor.enqueue(&SyncStore { store: "42".into() }, options).await?);
    }
    for job in jobs {
        let done = conveyor.wait_for_job(job.id, Duration::from_secs(30)).await?;
        if done.status != JobStatus::Succeeded {
            return Err(format!("a sync ended {:?}", done.status).into());
        }
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while beats.load(Ordering::SeqCst) < 2 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!(
        "heartbeats: {}; most syncs of store-42 at once: {}",
        beats.load(Ordering::SeqCst),
        syncs.most.load(Ordering::SeqCst)
    );
    // Removed, so that no later dispatcher on this database keeps firing it.
    let mut tx = conveyor.begin().await?;
    conveyor_jobs::remove_schedule_tx(&mut tx, "heartbeat").await?;
    tx.commit().await?;
    shutdown.cancel();
    running.await??;
    if beats.load(Ordering::SeqCst) < 2 {
        return Err("the schedule did not fire twice".into());
    }
    if syncs.most.load(Ordering::SeqCst) != 1 {
        return Err("the key limit let two of its jobs run at once".into());
    }
    Ok(())
}
