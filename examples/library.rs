//! Conveyor's quick start: a job kind, its handler, one job enqueued, run in-process and awaited.

use std::{env, time::Duration};

use conveyor_jobs::{Conveyor, EnqueueOptions, Handler, JobContext, JobError, JobKind, JobStatus};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

#[derive(Serialize, Deserialize)]
struct Greet {
    name: String,
}

impl JobKind for Greet {
    const KIND: &'static str = "greet";
    const QUEUE: &'static str = "greetings";
}

struct Greeter;

impl Handler<Greet> for Greeter {
    async fn handle(&self, job: Greet, _cx: &mut JobContext) -> Result<serde_json::Value, JobError> {
        Ok(format!("hello, {}", job.name).into())
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let pool = sqlx::PgPool::connect(&env::var("DATABASE_URL")?).await?;
    conveyor_jobs::migrate(&pool).await?; // Conveyor's schema; safe to run again
    let conveyor = Conveyor::connect(pool, &env::var("REDIS_URL")?).await?;
    let shutdown = CancellationToken::new();
    let worker = conveyor.worker().handle::<Greet>(Greeter).build()?;
    let running = tokio::spawn(conveyor.clone().run(worker, shutdown.clone())); // worker, dispatcher, maintenance

    let job = conveyor.enqueue(&Greet { name: "Ada".into() }, EnqueueOptions::new()).await?;
    let done = conveyor.wait_for_job(job.id, Duration::from_secs(30)).await?;
    println!("{:?}: {:?}", done.status, done.result);
    shutdown.cancel();
    running.await??;
    if done.status != JobStatus::Succeeded {
        return Err(format!("the job ended {:?}", done.status).into());
    }
    Ok(())
}
