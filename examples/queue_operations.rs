//! Queue operations, as BullMQ's `Queue` and `Job` offer them: a waiting job's priority, due time and payload changed
//! (`changePriority`, `changeDelay`, `promote`, `updateData`), a queue drained (`drain`), ended jobs cleaned
//! (`clean`), every delayed job promoted (`promoteJobs`), a queue obliterated (`obliterate`), and a job removed once it
//! succeeded (`removeOnComplete: true`). One PostgreSQL URL (a role that owns its database) and one Redis URL:
//! `DATABASE_URL=postgres://… REDIS_URL=redis://… cargo run --example queue_operations`.

use std::env;
use std::time::Duration;

use conveyor_jobs::{
    ChangeError, CleanJobs, Conveyor, EnqueueOptions, Handler, JobChange, JobContext, JobError, JobKind, JobScope,
    JobStatus, Keep, Priority,
};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// Sends a newsletter issue.
#[derive(Serialize, Deserialize)]
struct SendIssue {
    issue: u32,
}

impl JobKind for SendIssue {
    const KIND: &'static str = "example.send_issue";
    const QUEUE: &'static str = "example-newsletters";
}

struct Sender;

impl Handler<SendIssue> for Sender {
    async fn handle(&self, job: SendIssue, _: &mut JobContext) -> Result<Value, JobError> {
        Ok(json!({ "sent": job.issue }))
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let pool = sqlx::PgPool::connect(&env::var("DATABASE_URL")?).await?;
    conveyor_jobs::migrate(&pool).await?;
    let conveyor = Conveyor::builder(pool.clone(), &env::var("REDIS_URL")?)
        .prefix(&format!("example-{}", std::process::id()))
        // Maintenance every 200 ms, so that the job kept for no time below goes at once.
        .maintenance(Duration::from_millis(200), Duration::from_secs(300))
        .connect()
        .await?;
    let worker = conveyor.worker().handle::<SendIssue>(Sender).build()?;
    let shutdown = tokio_util::sync::CancellationToken::new();
    let running = tokio::spawn(conveyor.clone().run(worker, shutdown.clone()));
    let tomorrow = EnqueueOptions::new().delay(Duration::from_secs(24 * 3600));

    // Issue 1 waits for tomorrow: fix its payload to issue 2, raise it, and send it now.
    let job = conveyor.enqueue(&SendIssue { issue: 1 }, tomorrow.clone()).await?;
    let change = JobChange::new().payload(&SendIssue { issue: 2 }).priority(Priority::High).run_now();
    conveyor.change_job(job.id, &change).await?;
    let sent = conveyor.wait_for_job(job.id, Duration::from_secs(30)).await?;
    println!("changed, then sent: {:?} {}", sent.status, sent.result.clone().unwrap_or_default());
    if sent.result != Some(json!({ "sent": 2 })) {
        return Err("the changed payload did not run".into());
    }
    // Once it ran, a change is refused.
    match conveyor.change_job(job.id, &JobChange::new().priority(Priority::Low)).await {
        Err(ChangeError::NotWaiting(status)) => println!("a change after its run is refused: {status:?}"),
        other => return Err(format!("a change after the run answered {other:?}").into()),
    }

    // Three issues wait for tomorrow; drain the queue: none will be sent.
    let mut waiting = Vec::new();
    for issue in 3..6 {
        waiting.push(conveyor.enqueue(&SendIssue { issue }, tomorrow.clone()).await?.id);
    }
    let drained = conveyor.drain_jobs(&JobScope::queue(SendIssue::QUEUE)).await?;
    println!("drained: {drained} waiting jobs canceled");
    for id in waiting {
        if conveyor.get_job(id).await?.map(|j| j.status) != Some(JobStatus::Canceled) {
            return Err("a drained job is not canceled".into());
        }
    }

    // Clean the queue: its canceled jobs all go; of its succeeded ones, all but the newest (the sent one).
    let queue = JobScope::queue(SendIssue::QUEUE);
    let canceled = CleanJobs::ended(JobStatus::Canceled).ok_or("canceled is an end")?.scope(queue.clone());
    let succeeded = CleanJobs::ended(JobStatus::Succeeded).ok_or("succeeded is an end")?.scope(queue).keep_last(1);
    let cleaned = conveyor.clean_jobs(&canceled).await?;
    let older = conveyor.clean_jobs(&succeeded).await?;
    println!("cleaned: {cleaned} canceled and {older} older succeeded jobs deleted");
    if conveyor.get_job(job.id).await?.is_none() {
        return Err("the newest succeeded job was cleaned".into());
    }
    // Two issues for next week, promoted: both sent now. One is kept for no time once sent (removeOnComplete: true).
    let next_week = EnqueueOptions::new().delay(Duration::from_secs(7 * 24 * 3600));
    let kept = conveyor.enqueue(&SendIssue { issue: 7 }, next_week.clone()).await?.id;
    let gone = conveyor.enqueue(&SendIssue { issue: 8 }, next_week.keep_succeeded(Keep::none())).await?.id;
    let promoted = conveyor.promote_jobs(&JobScope::queue(SendIssue::QUEUE)).await?;
    // The job kept for no time may be gone (maintenance runs every 200 ms) before a wait for it would look.
    conveyor.wait_for_job(kept, Duration::from_secs(30)).await?;
    let mut removed = false;
    for _ in 0..100 {
        if conveyor.get_job(gone).await?.is_none() {
            removed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!("promoted: {promoted} sent now; the one kept for no time removed by maintenance: {removed}");
    if promoted != 2 || !removed || conveyor.get_job(kept).await?.is_none() {
        return Err("the promoted jobs did not run, or retention per job did not hold".into());
    }

    // Obliterate the queue: every row of it goes (nothing runs, so no force is needed).
    let obliterated = conveyor.obliterate_queue(SendIssue::QUEUE, false).await?;
    println!("obliterated: {obliterated:?}");
    if conveyor.get_job(kept).await?.is_some() {
        return Err("the obliterated queue still has its jobs".into());
    }
    shutdown.cancel();
    running.await??;
    if drained != 3 || cleaned < 3 || obliterated.deleted < 2 {
        return Err(
            format!("drained {drained}, cleaned {cleaned}, obliterated {obliterated:?}: expected 3, 3, 2+").into()
        );
    }
    Ok(())
}
