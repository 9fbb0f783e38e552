//! De-duplication modes, as BullMQ's `deduplication` option offers them: a throttle (`{ id, ttl }`: one job per key
//! and period, even after it ended) and a debounce (`{ id, ttl, extend, replace }`: the waiting job takes the newest
//! payload and is due a delay after the last enqueue). One PostgreSQL URL (a role that owns its database) and one
//! Redis URL: `DATABASE_URL=postgres://… REDIS_URL=redis://… cargo run --example dedup_modes`.

use std::env;
use std::time::Duration;

use conveyor_jobs::{Conveyor, DedupMode, EnqueueOptions, Handler, JobContext, JobError, JobKind};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// Pushes a product's stock count to a marketplace.
#[derive(Serialize, Deserialize)]
struct PushStock {
    sku: String,
    count: i64,
}

impl JobKind for PushStock {
    const KIND: &'static str = "example.push_stock";
    const QUEUE: &'static str = "example-stock";
}

struct Pusher;

impl Handler<PushStock> for Pusher {
    async fn handle(&self, job: PushStock, _: &mut JobContext) -> Result<Value, JobError> {
        Ok(json!({ "pushed": job.count }))
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
    let worker = conveyor.worker().handle::<PushStock>(Pusher).build()?;
    let shutdown = tokio_util::sync::CancellationToken::new();
    let running = tokio::spawn(conveyor.clone().run(worker, shutdown.clone()));
    let run = format!("{}", std::process::id());
    let push = |count| PushStock { sku: "sku-7".into(), count };

    // Five stock changes within a second, debounced by 300 ms: one push, with the last count.
    let debounce = EnqueueOptions::new().dedup(format!("push:{run}"), DedupMode::debounce(Duration::from_millis(300)));
    let mut answers = Vec::new();
    for count in 1..=5 {
        answers.push(conveyor.enqueue(&push(count), debounce.clone()).await?);
    }
    let job = answers[0].id;
    if answers.iter().any(|a| a.id != job) || answers.iter().filter(|a| a.created).count() != 1 {
        return Err(format!("five debounced enqueues answered {answers:?}").into());
    }
    let pushed = conveyor.wait_for_job(job, Duration::from_secs(30)).await?;
    println!("debounced: 5 enqueues, 1 job, result {}", pushed.result.clone().unwrap_or_default());
    if pushed.result != Some(json!({ "pushed": 5 })) {
        return Err("the debounced job did not run with the last payload".into());
    }

    // Throttled to one a minute: the first enqueue writes a job; after it ran, the key still holds.
    let throttle = EnqueueOptions::new().dedup(format!("full:{run}"), DedupMode::throttle(Duration::from_secs(60)));
    let first = conveyor.enqueue(&push(10), throttle.clone()).await?;
    conveyor.wait_for_job(first.id, Duration::from_secs(30)).await?;
    let again = conveyor.enqueue(&push(11), throttle).await?;
    println!("throttled: the first wrote {}, the next answered it (created: {})", first.id, again.created);
    shutdown.cancel();
    running.await??;
    if !first.created || again.created || again.id != first.id {
        return Err("the throttle did not hold its key after its job ended".into());
    }
    Ok(())
}
