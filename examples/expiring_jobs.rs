//! Expiring jobs (Faktory's expiring jobs, Hatchet's schedule timeout): a flash-sale reminder is worth sending within
//! a few hundred milliseconds of its enqueue, or not at all. Enqueued while no worker runs, it is canceled as expired
//! instead of sent late; a reminder with an hour to spare runs. One PostgreSQL URL (a role that owns its database) and
//! one Redis URL: `DATABASE_URL=postgres://… REDIS_URL=redis://… cargo run --example expiring_jobs`.

use std::env;
use std::time::Duration;

use conveyor_jobs::{Conveyor, EnqueueOptions, Handler, JobContext, JobError, JobKind, JobStatus};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// Tells a shopper that a sale is about to end.
#[derive(Serialize, Deserialize)]
struct SaleReminder {
    shopper: u64,
}

impl JobKind for SaleReminder {
    const KIND: &'static str = "example.sale_reminder";
    const QUEUE: &'static str = "example-reminders";
}

struct Remind;

impl Handler<SaleReminder> for Remind {
    async fn handle(&self, job: SaleReminder, _: &mut JobContext) -> Result<Value, JobError> {
        Ok(json!({ "reminded": job.shopper }))
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

    // Enqueued while nothing runs: one must start within 300 ms, the other within the hour.
    let urgent = conveyor.enqueue(&SaleReminder { shopper: 1 }, EnqueueOptions::new().start_within(ms(300))).await?;
    let relaxed = EnqueueOptions::new().start_within(Duration::from_secs(3600));
    let patient = conveyor.enqueue(&SaleReminder { shopper: 2 }, relaxed).await?;
    tokio::time::sleep(ms(600)).await;

    // The workers come up late: the first is past its deadline and never runs.
    let worker = conveyor.worker().handle::<SaleReminder>(Remind).build()?;
    let shutdown = tokio_util::sync::CancellationToken::new();
    let running = tokio::spawn(conveyor.clone().run(worker, shutdown.clone()));
    let late = conveyor.wait_for_job(urgent.id, Duration::from_secs(30)).await?;
    let sent = conveyor.wait_for_job(patient.id, Duration::from_secs(30)).await?;
    shutdown.cancel();
    running.await??;
    println!(
        "urgent: {:?} ({}), deadline {:?}",
        late.status,
        late.last_error.clone().unwrap_or_default(),
        late.expires_at
    );
    println!("patient: {:?}, result {}", sent.status, sent.result.clone().unwrap_or_default());
    if late.status != JobStatus::Canceled || !late.last_error.is_some_and(|e| e.starts_with("expired")) {
        return Err("the late reminder was not canceled as expired".into());
    }
    if sent.status != JobStatus::Succeeded {
        return Err("the reminder with time to spare did not run".into());
    }
    Ok(())
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}
