//! The multi-tenant mode: requests and handlers run as an application role that row-level security confines to one
//! workspace; the dispatcher, maintenance and the worker's bookkeeping run as a runtime role. Two tenants enqueue a
//! job each; each sees its own job and not the other's, and both run.
//!
//! The roles are the README's ("The multi-tenant mode"; `scripts/services.sh` creates them for development):
//! `OWNER_URL` (owns the database), `APP_URL` (the application role), `RUNTIME_URL` (the runtime role), `REDIS_URL`.

use std::env;
use std::time::Duration;

use conveyor_jobs::{
    Conveyor, EnqueueOptions, Handler, JobContext, JobError, JobKind, JobStatus, MigrateConfig, WorkspaceId,
};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use uuid::Uuid;

#[derive(Serialize, Deserialize)]
struct Report {
    title: String,
}

impl JobKind for Report {
    const KIND: &'static str = "example.report";
    const QUEUE: &'static str = "example-reports";
}

struct Reports;

impl Handler<Report> for Reports {
    async fn handle(&self, job: Report, cx: &mut JobContext) -> Result<Value, JobError> {
        // `cx.tx()` is scoped to the job's workspace: the wall holds inside handlers too.
        Ok(json!({ "report": job.title, "workspace": cx.workspace_id() }))
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (owner, app, runtime) = (env::var("OWNER_URL")?, env::var("APP_URL")?, env::var("RUNTIME_URL")?);
    // As the owner: the schema, then each role's grants, after checking that row-level security applies to them.
    let (app_role, runtime_role) = (MigrateConfig::role_of(&app)?, MigrateConfig::role_of(&runtime)?);
    conveyor_jobs::migrate_with(&MigrateConfig::new(&owner, &app_role, &runtime_role)).await?;
    let app_pool = sqlx::PgPool::connect(&app).await?;
    let runtime_pool = sqlx::PgPool::connect(&runtime).await?;
    let conveyor = Conveyor::builder(app_pool, &env::var("REDIS_URL")?)
        .prefix(&format!("example-{}", std::process::id()))
        .runtime_pool(runtime_pool)
        .connect()
        .await?;
    let shutdown = tokio_util::sync::CancellationToken::new();
    let worker = conveyor.worker().handle::<Report>(Reports).build()?;
    let running = tokio::spawn(conveyor.clone().run(worker, shutdown.clone()));

    let (acme, globex) = (WorkspaceId(Uuid::new_v4()), WorkspaceId(Uuid::new_v4()));
    let (acme, globex) = (conveyor.in_workspace(acme), conveyor.in_workspace(globex));
    let a = acme.enqueue(&Report { title: "acme's sales".into() }, EnqueueOptions::new()).await?;
    let g = globex.enqueue(&Report { title: "globex's sales".into() }, EnqueueOptions::new()).await?;
    if globex.get_job(a.id).await?.is_some() || acme.get_job(g.id).await?.is_some() {
        return Err("a tenant saw another tenant's job".into());
    }
    for (tenant, job) in [(&acme, a), (&globex, g)] {
        let done = tenant.wait_for_job(job.id, Duration::from_secs(30)).await?;
        println!("{}: {:?} {:?}", tenant.workspace(), done.status, done.result);
        if done.status != JobStatus::Succeeded {
            return Err(format!("the job ended {:?}: {:?}", done.status, done.last_error).into());
        }
    }
    shutdown.cancel();
    running.await??;
    Ok(())
}
