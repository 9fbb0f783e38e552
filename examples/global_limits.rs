//! A global limit, as BullMQ's `setGlobalConcurrency` offers it, across tenants: three stores (workspaces) publish to
//! one marketplace that takes 2 calls at once from all of them together. A store that enqueued first does not keep
//! the room: the stores take turns. One PostgreSQL URL (a role that owns its database, which may set global limits as
//! the operator role would) and one Redis URL: `DATABASE_URL=postgres://… REDIS_URL=redis://… cargo run --example
//! global_limits`.

use std::env;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use conveyor_jobs::{
    Conveyor, EnqueueOptions, GlobalLimit, GlobalScope, Handler, JobContext, JobError, JobKind, WorkspaceId,
};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// Publishes one listing of a store to the marketplace.
#[derive(Serialize, Deserialize)]
struct Publish {
    store: usize,
}

impl JobKind for Publish {
    const KIND: &'static str = "example.marketplace_publish";
    const QUEUE: &'static str = "example-marketplace";
}

/// Calls the marketplace (a sleep here), counting the calls in progress.
#[derive(Default)]
struct Marketplace {
    calls: AtomicUsize,
    most: AtomicUsize,
    order: Mutex<Vec<usize>>,
}

struct Publisher(Arc<Marketplace>);

impl Handler<Publish> for Publisher {
    async fn handle(&self, job: Publish, _: &mut JobContext) -> Result<Value, JobError> {
        let now = self.0.calls.fetch_add(1, Ordering::SeqCst) + 1;
        self.0.most.fetch_max(now, Ordering::SeqCst);
        self.0.order.lock().unwrap().push(job.store);
        tokio::time::sleep(Duration::from_millis(50)).await;
        self.0.calls.fetch_sub(1, Ordering::SeqCst);
        Ok(json!({ "store": job.store }))
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let pool = sqlx::PgPool::connect(&env::var("DATABASE_URL")?).await?;
    conveyor_jobs::migrate(&pool).await?;
    let prefix = format!("example-{}", std::process::id());
    let conveyor = Conveyor::builder(pool.clone(), &env::var("REDIS_URL")?).prefix(&prefix).connect().await?;

    // 2 at once, every store together (with the operator role's pool in a multi-tenant deployment).
    let scope = GlobalScope::Queue(Publish::QUEUE.into());
    let limit = GlobalLimit { max_in_flight: Some(2), ..GlobalLimit::default() };
    conveyor_jobs::set_global_limit(&pool, &scope, limit).await?;

    // The first store enqueues 6 listings, then the two others 3 each.
    let stores: Vec<WorkspaceId> = (0..3).map(|_| WorkspaceId(uuid::Uuid::new_v4())).collect();
    let mut jobs = Vec::new();
    for (i, store) in stores.iter().enumerate() {
        for _ in 0..if i == 0 { 6 } else { 3 } {
            let enqueued = conveyor.in_workspace(*store).enqueue(&Publish { store: i }, EnqueueOptions::new()).await?;
            jobs.push((*store, enqueued.id));
        }
    }

    let marketplace = Arc::new(Marketplace::default());
    let worker = conveyor.worker().handle::<Publish>(Publisher(marketplace.clone())).build()?;
    let shutdown = tokio_util::sync::CancellationToken::new();
    let running = tokio::spawn(conveyor.clone().run(worker, shutdown.clone()));
    for (store, id) in &jobs {
        conveyor.in_workspace(*store).wait_for_job(*id, Duration::from_secs(30)).await?;
    }
    shutdown.cancel();
    running.await??;
    conveyor_jobs::remove_global_limit(&pool, &scope).await?;

    let order = marketplace.order.lock().unwrap().clone();
    let most = marketplace.most.load(Ordering::SeqCst);
    println!("calls at once, at most: {most}; stores in the order they were served: {order:?}");
    // Every store had a call among the first six, though the first store's six came first.
    let early = &order[..6];
    if most > 2 || !(0..3).all(|store| early.contains(&store)) {
        return Err(format!("the limit or the turns did not hold: {most} at once, order {order:?}").into());
    }
    Ok(())
}
