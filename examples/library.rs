//! A service that uses Conveyor as a library: it defines a job kind, writes an order and enqueues the order's receipt
//! in one transaction, runs a dispatcher and a worker in-process, waits for the job, and exits.
//!
//! Needs `CONVEYOR_DATABASE_URL` (the application role, after `conveyor migrate`), `CONVEYOR_RUNTIME_DATABASE_URL`
//! (the runtime role: the dispatcher and the worker's bookkeeping work across workspaces, which the application role
//! may not) and `CONVEYOR_REDIS_URL`. With `CONVEYOR_MIGRATION_DATABASE_URL` (the owner role) set too, it applies
//! Conveyor's schema itself first.

use std::env;
use std::time::Duration;

use anyhow::Context;
use conveyor_jobs::{
    Dispatcher, EnqueueOptions, Handler, JobContext, JobError, JobKind, JobStatus, Priority, Worker, WorkspaceId,
};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sqlx::postgres::PgPoolOptions;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// The job: send an order's receipt. The payload holds ids, never secrets: it is stored and copied into Redis.
#[derive(Serialize, Deserialize)]
struct SendReceipt {
    order_id: Uuid,
}

impl JobKind for SendReceipt {
    /// Stored with every job: never rename a kind with jobs in flight.
    const KIND: &'static str = "example.send_receipt";
    const QUEUE: &'static str = "example-emails";
    const MAX_ATTEMPTS: u32 = 3;
}

/// Runs `SendReceipt` jobs. Delivery is at least once; what the handler writes in `cx.tx()` commits with the job's
/// completion, so it happens once.
struct Receipts;

impl Handler<SendReceipt> for Receipts {
    async fn handle(&self, job: SendReceipt, cx: &mut JobContext) -> Result<Value, JobError> {
        let (email, total_cents): (String, i64) =
            sqlx::query_as("UPDATE orders SET receipt_sent = true WHERE id = $1 RETURNING email, total_cents")
                .bind(job.order_id)
                .fetch_optional(&mut **cx.tx().await?)
                .await?
                .ok_or_else(|| JobError::permanent("no such order"))?;
        // A real handler calls its mail provider here, with `cx.idempotency_token()` as the provider's idempotency
        // key, so that a second delivery sends no second mail.
        Ok(json!({ "sent_to": email, "total_cents": total_cents, "attempt": cx.attempt() }))
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let database_url = env::var("CONVEYOR_DATABASE_URL").context("set CONVEYOR_DATABASE_URL")?;
    let runtime_url = env::var("CONVEYOR_RUNTIME_DATABASE_URL").context("set CONVEYOR_RUNTIME_DATABASE_URL")?;
    let redis_url = env::var("CONVEYOR_REDIS_URL").context("set CONVEYOR_REDIS_URL")?;
    let prefix = env::var("CONVEYOR_REDIS_PREFIX").unwrap_or_else(|_| "conveyor".into());
    if let Ok(owner_url) = env::var("CONVEYOR_MIGRATION_DATABASE_URL") {
        conveyor_jobs::migrate(&owner_url, &database_url, &runtime_url).await?; // `conveyor migrate`; safe to run again
    }

    // The application role's pool (each wait_for_job keeps one connection for LISTEN while it waits), and the runtime
    // role's, for the dispatcher (one connection for LISTEN) and the worker's bookkeeping across workspaces.
    let pool = PgPoolOptions::new().max_connections(8).connect(&database_url).await?;
    let runtime = PgPoolOptions::new().max_connections(8).connect(&runtime_url).await?;
    // The application role may not create tables, so this demo keeps its orders in a TEMP table, which only one
    // session sees: a pool of one connection, for the order's transaction and for the worker's jobs. A real service
    // writes its own tables, and has one pool for its requests and the worker's jobs.
    let shop = PgPoolOptions::new().max_connections(1).connect(&database_url).await?;
    sqlx::query(
        "CREATE TEMP TABLE IF NOT EXISTS orders (id uuid PRIMARY KEY, email text NOT NULL,
                                                 total_cents bigint NOT NULL, receipt_sent boolean NOT NULL)",
    )
    .execute(&shop)
    .await?;

    // The relay (outbox to Redis Streams) and a worker, in this process until `shutdown`.
    let shutdown = CancellationToken::new();
    let dispatcher = Dispatcher::connect(runtime.clone(), &redis_url, &prefix).await?;
    let dispatching = tokio::spawn(dispatcher.run(shutdown.clone()));
    let consumer = conveyor_jobs::Consumer::connect(&redis_url, &prefix).await?;
    let worker =
        Worker::builder(shop.clone(), consumer).runtime_pool(runtime).handle::<SendReceipt>(Receipts).build()?;
    let working = tokio::spawn(worker.run(shutdown.clone(), Duration::from_secs(10)));

    // One transaction, scoped to a tenant: the order and its jobs commit together, or not at all.
    let workspace = WorkspaceId(Uuid::new_v4());
    let order_id = Uuid::new_v4();
    let mut tx = conveyor_jobs::begin_workspace(&shop, workspace).await?;
    sqlx::query("INSERT INTO orders VALUES ($1, 'ada@example.com', 4250, false)")
        .bind(order_id)
        .execute(&mut *tx)
        .await?;
    let options = EnqueueOptions::new().dedup_key(format!("receipt-{order_id}")).priority(Priority::High);
    let job = conveyor_jobs::enqueue_tx(&mut tx, &SendReceipt { order_id }, options.clone()).await?;
    // The same key again (a double click): nothing written, the live job's id answered.
    let again = conveyor_jobs::enqueue_tx(&mut tx, &SendReceipt { order_id }, options).await?;
    anyhow::ensure!(job.created && !again.created && again.id == job.id, "the de-dup key let a second job in");
    // A job for tomorrow, looked up and canceled below.
    let later = EnqueueOptions::new().delay(Duration::from_secs(86_400));
    let tomorrow = conveyor_jobs::enqueue_tx(&mut tx, &SendReceipt { order_id }, later).await?;
    tx.commit().await?;

    conveyor_jobs::cancel_job(&pool, workspace, tomorrow.id).await?;
    let canceled = conveyor_jobs::get_job(&pool, workspace, tomorrow.id).await?.context("the job exists")?;
    anyhow::ensure!(canceled.status == JobStatus::Canceled, "the job for tomorrow is {:?}", canceled.status);

    let done = conveyor_jobs::wait_for_job(&pool, workspace, job.id, Duration::from_secs(30)).await?;
    println!("job {} ({}) {:?}: {}", done.id, done.kind, done.status, done.result.clone().unwrap_or_default());
    anyhow::ensure!(done.status == JobStatus::Succeeded, "the job ended {:?}: {:?}", done.status, done.last_error);
    let (sent,): (bool,) =
        sqlx::query_as("SELECT receipt_sent FROM orders WHERE id = $1").bind(order_id).fetch_one(&shop).await?;
    anyhow::ensure!(sent, "the handler's write did not commit");

    shutdown.cancel();
    dispatching.await??;
    working.await??;
    Ok(())
}
