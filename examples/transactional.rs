//! The transactional enqueue: an order written with its receipt's job in one transaction (they commit together, or
//! neither does), a second enqueue of the same receipt de-duplicated by its key, a job delayed to tomorrow and
//! canceled, the receipt's job run in-process and awaited, and its handler's write checked. One PostgreSQL URL (a role
//! that owns its database) and one Redis URL: `DATABASE_URL=postgres://… REDIS_URL=redis://… cargo run --example
//! transactional`.

use std::env;
use std::time::Duration;

use conveyor_jobs::{Conveyor, EnqueueOptions, Handler, JobContext, JobError, JobKind};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

#[derive(Serialize, Deserialize)]
struct SendReceipt {
    order_id: i64,
}

impl JobKind for SendReceipt {
    const KIND: &'static str = "example.send_receipt";
    const QUEUE: &'static str = "emails";
}

struct Receipts;

impl Handler<SendReceipt> for Receipts {
    async fn handle(&self, job: SendReceipt, cx: &mut JobContext) -> Result<Value, JobError> {
        // What the handler writes in `cx.tx()` commits with the job's end: once, however often it is delivered.
        sqlx::query("UPDATE orders SET receipt_sent = true WHERE id = $1")
            .bind(job.order_id)
            .execute(&mut **cx.tx().await?)
            .await?;
        Ok(json!({ "sent": job.order_id }))
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let pool = sqlx::PgPool::connect(&env::var("DATABASE_URL")?).await?;
    conveyor_jobs::migrate(&pool).await?; // the schema `conveyor`; safe to run again
    sqlx::query("CREATE TABLE IF NOT EXISTS orders (id bigint PRIMARY KEY, receipt_sent bool NOT NULL DEFAULT false)")
        .execute(&pool)
        .await?;
    let conveyor = Conveyor::connect(pool, &env::var("REDIS_URL")?).await?;
    let shutdown = tokio_util::sync::CancellationToken::new();
    let worker = conveyor.worker().handle::<SendReceipt>(Receipts).build()?;
    let running = tokio::spawn(conveyor.clone().run(worker, shutdown.clone())); // dispatcher, worker, maintenance

    // The order and its job commit together, or not at all.
    let mut tx = conveyor.begin().await?;
    let order_id: i64 =
        sqlx::query_scalar("INSERT INTO orders (id) SELECT coalesce(max(id), 0) + 1 FROM orders RETURNING id")
            .fetch_one(&mut *tx)
            .await?;
    let options = EnqueueOptions::new().dedup_key(format!("receipt-{order_id}"));
    let job = conveyor_jobs::enqueue_tx(&mut tx, &SendReceipt { order_id }, options.clone()).await?;
    // The same key again (a double click): nothing written, the live job's id answered.
    let again = conveyor_jobs::enqueue_tx(&mut tx, &SendReceipt { order_id }, options).await?;
    if again.created || again.id != job.id {
        return Err("the de-dup key let a second job in".into());
    }
    // A job for tomorrow, canceled below before it runs.
    let later = EnqueueOptions::new().delay(Duration::from_secs(86_400));
    let tomorrow = conveyor_jobs::enqueue_tx(&mut tx, &SendReceipt { order_id }, later).await?;
    tx.commit().await?;
    conveyor.cancel_job(tomorrow.id).await?;
    let canceled = conveyor.get_job(tomorrow.id).await?.ok_or("the job for tomorrow exists")?;
    if canceled.status != conveyor_jobs::JobStatus::Canceled {
        return Err(format!("the job for tomorrow is {:?}", canceled.status).into());
    }

    let done = conveyor.wait_for_job(job.id, Duration::from_secs(30)).await?;
    println!("job {} {:?}: {:?}", done.id, done.status, done.result);
    if done.status != conveyor_jobs::JobStatus::Succeeded {
        return Err(format!("the job ended {:?}: {:?}", done.status, done.last_error).into());
    }
    let sent: bool = sqlx::query_scalar("SELECT receipt_sent FROM orders WHERE id = $1")
        .bind(order_id)
        .fetch_one(conveyor.pool())
        .await?;
    if !sent {
        return Err("the handler's write did not commit".into());
    }
    shutdown.cancel();
    running.await??;
    Ok(())
}
