//! The testing helpers: a handler run in the test's own transaction with PostgreSQL alone (no Redis, no dispatcher),
//! and what a transaction enqueued.

use conveyor_jobs::testing::{enqueued, work, work_attempt};
use conveyor_jobs::{EnqueueOptions, Handler, JobContext, JobError, JobKind, Outcome, WorkspaceId};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use uuid::Uuid;

use crate::kit::Platform;

#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Charge {
    order_id: Uuid,
    cents: i64,
}

impl JobKind for Charge {
    const KIND: &'static str = "test.charge";
    const QUEUE: &'static str = "test-charges";
    const MAX_ATTEMPTS: u32 = 3;
}

/// Writes the charge in the job's transaction, reports progress; refuses negative amounts for good, fails amounts over
/// 1,000,000 cents as a retryable error after writing them, and panics at 13 cents.
struct Charges;

impl Handler<Charge> for Charges {
    async fn handle(&self, job: Charge, cx: &mut JobContext) -> Result<Value, JobError> {
        if job.cents < 0 {
            return Err(JobError::permanent("a negative charge"));
        }
        if job.cents == 13 {
            panic!("an unlucky amount");
        }
        cx.progress(json!({ "step": "charging" })).await?;
        sqlx::query("INSERT INTO public.charges (order_id, cents, workspace_id) VALUES ($1, $2, $3)")
            .bind(job.order_id)
            .bind(job.cents)
            .bind(cx.workspace_id().0)
            .execute(&mut **cx.tx().await?)
            .await?;
        // After its write: a failure must undo it.
        if job.cents > 1_000_000 {
            return Err(JobError::retryable("the bank is slow for large amounts"));
        }
        Ok(json!({ "charged": job.cents, "attempt": cx.attempt() }))
    }
}

async fn platform_with_charges() -> Platform {
    let platform = Platform::single_role().await;
    sqlx::query(
        "CREATE TABLE public.charges (order_id uuid PRIMARY KEY, cents bigint NOT NULL, workspace_id uuid NOT NULL)",
    )
    .execute(&platform.pool)
    .await
    .unwrap();
    platform
}

#[tokio::test]
async fn a_handler_runs_in_the_tests_transaction_with_postgresql_alone() {
    // The platform's Redis prefix is never used: this test needs no Redis.
    let platform = platform_with_charges().await;
    let order_id = Uuid::new_v4();
    let workspace = WorkspaceId(Uuid::new_v4());
    let tx = conveyor_jobs::begin_workspace(&platform.pool, workspace).await.unwrap();
    let mut worked = work(&Charges, tx, Charge { order_id, cents: 4250 }).await;
    assert_eq!(worked.outcome, Outcome::Succeeded);
    assert_eq!(worked.result.as_ref().unwrap(), &json!({ "charged": 4250, "attempt": 1 }));
    assert_eq!(worked.progress, [json!({ "step": "charging" })]);
    // The handler's write is in the test's transaction, in its workspace, uncommitted.
    let (cents, ws): (i64, Uuid) = sqlx::query_as("SELECT cents, workspace_id FROM public.charges WHERE order_id = $1")
        .bind(order_id)
        .fetch_one(&mut *worked.tx)
        .await
        .unwrap();
    assert_eq!((cents, ws), (4250, workspace.0));
    drop(worked);
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM public.charges").fetch_one(&platform.pool).await.unwrap();
    assert_eq!(left, 0, "dropping the transaction rolled the write back");
}

#[tokio::test]
async fn a_handlers_failures_map_to_what_the_worker_would_record() {
    let platform = platform_with_charges().await;
    let begin = || conveyor_jobs::begin(&platform.pool);
    let negative = work(&Charges, begin().await.unwrap(), Charge { order_id: Uuid::new_v4(), cents: -1 }).await;
    assert_eq!(negative.outcome, Outcome::DeadLettered);
    assert!(matches!(negative.result, Err(JobError::Permanent(ref m)) if m == "a negative charge"));
    let large = Charge { order_id: Uuid::new_v4(), cents: 2_000_000 };
    let mut failed = work(&Charges, begin().await.unwrap(), large).await;
    assert_eq!(failed.outcome, Outcome::Retried);
    let kept: i64 = sqlx::query_scalar("SELECT count(*) FROM public.charges").fetch_one(&mut *failed.tx).await.unwrap();
    assert_eq!(kept, 0, "a failed run's write is undone, as a worker undoes it");
    // A panic is a retryable failure, as in a worker.
    let unlucky = Charge { order_id: Uuid::new_v4(), cents: 13 };
    let panicked = work(&Charges, begin().await.unwrap(), unlucky).await;
    assert_eq!(panicked.outcome, Outcome::Retried);
    assert!(matches!(panicked.result, Err(JobError::Retryable(ref m)) if m == "the handler panicked"));
    let large = Charge { order_id: Uuid::new_v4(), cents: 2_000_000 };
    // At the last of its three attempts, the same failure dead-letters.
    assert_eq!(work_attempt(&Charges, begin().await.unwrap(), large, 3).await.outcome, Outcome::DeadLettered);
}

#[tokio::test]
async fn what_a_transaction_enqueued_is_read_back_decoded_before_it_commits() {
    let platform = Platform::single_role().await;
    let mut tx = conveyor_jobs::begin(&platform.pool).await.unwrap();
    let first = Charge { order_id: Uuid::new_v4(), cents: 1 };
    let second = Charge { order_id: Uuid::new_v4(), cents: 2 };
    let a = conveyor_jobs::enqueue_tx(&mut tx, &first, EnqueueOptions::new()).await.unwrap();
    let b = conveyor_jobs::enqueue_tx(&mut tx, &second, EnqueueOptions::new()).await.unwrap();
    let jobs = enqueued::<Charge>(&mut tx).await.unwrap();
    assert_eq!(jobs, [(a.id, first), (b.id, second)]);
    tx.rollback().await.unwrap();
    let mut tx = conveyor_jobs::begin(&platform.pool).await.unwrap();
    assert!(enqueued::<Charge>(&mut tx).await.unwrap().is_empty(), "rolled back, nothing was enqueued");
}
