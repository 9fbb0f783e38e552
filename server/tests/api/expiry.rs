//! Expiring jobs against real worker processes: a worker killed as it expires a job, before the expiry commits, leaves
//! the entry to the worker that takes it over, which expires the job instead of running it.

use crate::common;

use std::time::Duration;

use common::{TestApp, principal};
use conveyor_jobs::{EnqueueOptions, JobId, JobInfo, JobStatus, WorkspaceId};
use tokio_util::sync::CancellationToken;

async fn job(app: &TestApp, ws: WorkspaceId, id: JobId) -> JobInfo {
    conveyor_jobs::get_job(&app.db.pool, ws, id).await.unwrap().expect("the job exists")
}

#[tokio::test]
async fn a_worker_killed_before_its_expiry_of_a_job_commits_leaves_it_to_the_next_which_expires_it_unrun() {
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    let (_sandbox, market) = common::sandbox(Default::default()).await;
    let shutdown = CancellationToken::new();
    common::run_dispatcher(
        common::test_dispatcher(&app, &common::redis_url(), |v| {
            v.insert("CONVEYOR_DISPATCH_POLL".into(), "200ms".into());
        })
        .await,
        &shutdown,
    );
    // A verification that must start within 500 ms: relayed at once, read by no worker before its deadline. Its
    // store does not exist: a run would end it succeeded, after a look at the marketplace.
    let payload = conveyor_shop::jobs::VerifyCredentials { store_id: uuid::Uuid::now_v7(), credentials_version: 1 };
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
    let options = EnqueueOptions::new().start_within(Duration::from_millis(500));
    let id = conveyor_jobs::enqueue_tx(&mut tx, &payload, options).await.unwrap().id;
    tx.commit().await.unwrap();
    let relayed = common::eventually(Duration::from_secs(30), || async {
        (job(&app, ws, id).await.status == JobStatus::Active).then_some(())
    })
    .await;
    assert!(relayed.is_some(), "the job was handed to the workers");
    let deadline = job(&app, ws, id).await.expires_at.expect("a deadline");
    tokio::time::sleep((deadline - chrono::Utc::now()).to_std().unwrap_or_default() + Duration::from_millis(100)).await;

    let mut vars = common::config_vars(&app.db, &app.redis_prefix);
    vars.insert("CONVEYOR_MARKETPLACE_URL".into(), market);
    vars.insert("CONVEYOR_WORKER_VISIBILITY".into(), "1s".into());
    let mut crashing = vars.clone();
    crashing.insert("CONVEYOR_ADMIN_ADDR".into(), format!("127.0.0.1:{}", common::free_port()));
    crashing.insert("FAILPOINTS".into(), "worker::before_expire=sleep(60000)".into());
    let mut victim = common::Process::spawn(&["worker"], &crashing);
    let client = common::redis_client(&common::redis_url()).await;
    let read = common::eventually(Duration::from_secs(30), || async {
        (common::unacknowledged(&client, &app, "stores").await == 1).then_some(())
    })
    .await;
    assert!(read.is_some(), "the worker read the entry; log:\n{}", victim.log());
    // Past the read, the worker stops at the expiry (or just before): nothing it does commits.
    tokio::time::sleep(Duration::from_millis(300)).await;
    victim.kill();
    assert_eq!(job(&app, ws, id).await.status, JobStatus::Active, "the expiry never committed");
    assert_eq!(common::unacknowledged(&client, &app, "stores").await, 1, "nor was the entry acknowledged");

    vars.insert("CONVEYOR_ADMIN_ADDR".into(), format!("127.0.0.1:{}", common::free_port()));
    let rescuer = common::Process::spawn(&["worker"], &vars);
    let taken_over = common::eventually(Duration::from_secs(30), || async {
        (common::unacknowledged(&client, &app, "stores").await == 0).then_some(())
    })
    .await;
    assert!(taken_over.is_some(), "another worker took the entry over; log:\n{}", rescuer.log());
    let expired = job(&app, ws, id).await;
    assert_eq!(expired.status, JobStatus::Canceled, "log:\n{}", rescuer.log());
    assert_eq!(
        expired.last_error.as_deref(),
        Some("expired: its worker stopped, and its deadline passed before another took it")
    );
    assert_eq!(expired.failed_runs, 0);
    shutdown.cancel();
}
