//! Flows, as BullMQ's `FlowProducer` offers them: a parent job that runs once its children have ended, and reads their
//! results (`getChildrenValues`); a child on another queue; a grandchild; a child whose failure the parent ignores
//! (`ignoreDependencyOnFailure`). One PostgreSQL URL (a role that owns its database) and one Redis URL:
//! `DATABASE_URL=postgres://… REDIS_URL=redis://… cargo run --example flows`.

use std::env;
use std::time::Duration;

use conveyor_jobs::{ChildFailure, Conveyor, EnqueueOptions, Flow, Handler, JobContext, JobError, JobKind, JobStatus};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// Publishes a listing once its images are ready.
#[derive(Serialize, Deserialize)]
struct Publish {
    listing: u32,
}

impl JobKind for Publish {
    const KIND: &'static str = "example.publish_listing";
    const QUEUE: &'static str = "example-listings";
}

/// Resizes one image (`broken` fails for good); a resize of a source image waits for its fetch.
#[derive(Serialize, Deserialize)]
struct Resize {
    image: u32,
    broken: bool,
}

impl JobKind for Resize {
    const KIND: &'static str = "example.resize_image";
    const QUEUE: &'static str = "example-media";
    const MAX_ATTEMPTS: u32 = 1;
}

struct Publisher;

impl Handler<Publish> for Publisher {
    async fn handle(&self, job: Publish, cx: &mut JobContext) -> Result<Value, JobError> {
        // Every child has ended: their results, and the failure of the one whose failure is ignored.
        let children = cx.children().await?;
        let ready: Vec<Value> =
            children.iter().filter(|c| c.status == JobStatus::Succeeded).filter_map(|c| c.result.clone()).collect();
        Ok(json!({ "listing": job.listing, "images": ready, "children": children.len() }))
    }
}

struct Resizer;

impl Handler<Resize> for Resizer {
    async fn handle(&self, job: Resize, cx: &mut JobContext) -> Result<Value, JobError> {
        if job.broken {
            return Err(JobError::permanent(format!("image {} does not decode", job.image)));
        }
        let from = cx.children().await?.len();
        Ok(json!({ "image": job.image, "waited_for": from }))
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
    let worker = conveyor.worker().handle::<Publish>(Publisher).handle::<Resize>(Resizer).build()?;
    let shutdown = tokio_util::sync::CancellationToken::new();
    let running = tokio::spawn(conveyor.clone().run(worker, shutdown.clone()));

    let resize = |image, broken| Flow::job(&Resize { image, broken }, EnqueueOptions::new());
    let flow = Flow::job(&Publish { listing: 7 }, EnqueueOptions::new())?
        .child(resize(1, false)?.child(resize(10, false)?))
        .child(resize(2, false)?)
        .child_on_failure(resize(3, true)?, ChildFailure::Ignore);
    // One transaction: a service writes its own rows in it too (`enqueue_flow_tx`).
    let ids = conveyor.enqueue_flow(flow).await?;
    let waiting = conveyor.get_job(ids.id).await?.ok_or("the parent is not there")?;
    println!("enqueued {} with {} children: {:?}", ids.id, ids.children.len(), waiting.status);
    let published = conveyor.wait_for_job(ids.id, Duration::from_secs(30)).await?;
    println!("published: {}", published.result.clone().unwrap_or_default());
    shutdown.cancel();
    running.await??;
    let expected = json!({
        "listing": 7,
        "images": [{ "image": 1, "waited_for": 1 }, { "image": 2, "waited_for": 0 }],
        "children": 3,
    });
    if waiting.status != JobStatus::WaitingChildren || published.result != Some(expected) {
        return Err(format!("the flow ended as {published:?}").into());
    }
    Ok(())
}
