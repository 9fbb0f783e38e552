//! Job events across processes (BullMQ's `QueueEvents`): a dashboard follows a catalog import as it happens. The
//! import reports its progress, fails its first run and succeeds on the next; the subscriber hears each start, each
//! progress, the retry and the end, in the order the job lived them. One PostgreSQL URL (a role that owns its database)
//! and one Redis URL: `DATABASE_URL=postgres://… REDIS_URL=redis://… cargo run --example job_events`.

use std::env;
use std::time::Duration;

use conveyor_jobs::{Conveyor, EnqueueOptions, EventFilter, Handler, JobContext, JobError, JobEventType, JobKind};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// Imports a store's catalog, in pages.
#[derive(Serialize, Deserialize)]
struct ImportCatalog {
    store: u64,
    pages: u32,
}

impl JobKind for ImportCatalog {
    const KIND: &'static str = "example.import_catalog";
    const QUEUE: &'static str = "example-imports";
    const BACKOFF: conveyor_jobs::Backoff =
        conveyor_jobs::Backoff { base: Duration::from_millis(100), max: Duration::from_millis(100) };
}

struct Import;

impl Handler<ImportCatalog> for Import {
    async fn handle(&self, job: ImportCatalog, cx: &mut JobContext) -> Result<Value, JobError> {
        for page in 1..=job.pages {
            cx.progress(json!({ "page": page, "of": job.pages })).await?;
            if cx.attempt() == 1 && page == 2 {
                return Err(JobError::retryable("the marketplace answered 503"));
            }
        }
        Ok(json!({ "store": job.store, "imported_pages": job.pages }))
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

    // Any process of the workspace may subscribe: this one follows the imports, starts included.
    let mut events = conveyor.subscribe_events(EventFilter::all().kind(ImportCatalog::KIND)).await?;
    let import = conveyor.enqueue(&ImportCatalog { store: 42, pages: 3 }, EnqueueOptions::new()).await?;

    let worker = conveyor.worker().handle::<ImportCatalog>(Import).build()?;
    let shutdown = tokio_util::sync::CancellationToken::new();
    let running = tokio::spawn(conveyor.clone().run(worker, shutdown.clone()));
    let mut heard = Vec::new();
    loop {
        let event = tokio::time::timeout(Duration::from_secs(30), events.next()).await??;
        let detail = match event.event {
            JobEventType::Progress => event.progress.clone().unwrap_or_default().to_string(),
            JobEventType::Retrying => event.error.clone().unwrap_or_default(),
            JobEventType::Completed => event.job.result.clone().unwrap_or_default().to_string(),
            _ => String::new(),
        };
        println!("{} run {}: {:<9} {detail}", event.job.id.0, event.attempt, event.event.as_str());
        heard.push((event.event, event.attempt));
        if event.event.is_end() {
            break;
        }
    }
    shutdown.cancel();
    running.await??;

    use JobEventType::*;
    let expected = [
        (Active, 1),
        (Progress, 1),
        (Progress, 1),
        (Retrying, 1),
        (Active, 2),
        (Progress, 2),
        (Progress, 2),
        (Progress, 2),
        (Completed, 2),
    ];
    if heard != expected {
        return Err(format!("heard {heard:?} of {}, expected {expected:?}", import.id.0).into());
    }
    Ok(())
}
