//! One URL, one role: a service whose role owns its database migrates it with `migrate(&pool)` and runs everything
//! through that pool and one Redis URL, without naming a workspace.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use conveyor_jobs::{Conveyor, EnqueueOptions, Handler, JobContext, JobError, JobKind, JobStatus, WorkspaceId};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::kit::{self, Platform};

#[derive(Serialize, Deserialize)]
struct SendReceipt {
    order_id: Uuid,
}

impl JobKind for SendReceipt {
    const KIND: &'static str = "test.send_receipt";
    const QUEUE: &'static str = "test-receipts";
    const MAX_ATTEMPTS: u32 = 2;
}

/// Marks the order sent in the job's transaction; fails its first `failures` runs.
struct Receipts {
    failures: u32,
    runs: Arc<AtomicU32>,
}

impl Handler<SendReceipt> for Receipts {
    async fn handle(&self, job: SendReceipt, cx: &mut JobContext) -> Result<Value, JobError> {
        if self.runs.fetch_add(1, Ordering::SeqCst) < self.failures {
            return Err(JobError::retryable("the mail provider is down"));
        }
        let email: Option<String> =
            sqlx::query_scalar("UPDATE public.orders SET receipt_sent = true WHERE id = $1 RETURNING email")
                .bind(job.order_id)
                .fetch_optional(&mut **cx.tx().await?)
                .await?;
        let email = email.ok_or_else(|| JobError::permanent("no such order"))?;
        Ok(json!({ "sent_to": email, "attempt": cx.attempt() }))
    }
}

async fn orders_table(pool: &PgPool) {
    sqlx::query(
        "CREATE TABLE public.orders (id uuid PRIMARY KEY, email text NOT NULL, receipt_sent boolean NOT NULL DEFAULT false)",
    )
    .execute(pool)
    .await
    .unwrap();
}

/// A `Conveyor` over the platform's one pool, running a worker with `handler`, the dispatcher and maintenance.
async fn running(
    platform: &Platform,
    handler: Receipts,
) -> (Conveyor, CancellationToken, tokio::task::JoinHandle<Result<(), conveyor_jobs::Error>>) {
    let conveyor =
        Conveyor::builder(platform.pool.clone(), &kit::redis_url()).prefix(&platform.prefix).connect().await.unwrap();
    let worker = conveyor.worker().handle::<SendReceipt>(handler).build().unwrap();
    let shutdown = CancellationToken::new();
    let handle = tokio::spawn(conveyor.clone().run(worker, shutdown.clone()));
    (conveyor, shutdown, handle)
}

#[tokio::test]
async fn one_role_migrates_enqueues_with_its_own_rows_and_runs_the_job_to_its_effect() {
    let platform = Platform::single_role().await;
    orders_table(&platform.pool).await;
    let runs = Arc::new(AtomicU32::new(0));
    let (conveyor, shutdown, handle) = running(&platform, Receipts { failures: 1, runs: runs.clone() }).await;

    // The service's row and its job in one transaction of the default workspace.
    let order_id = Uuid::new_v4();
    let mut tx = conveyor_jobs::begin(&platform.pool).await.unwrap();
    sqlx::query("INSERT INTO public.orders (id, email) VALUES ($1, 'ada@example.com')")
        .bind(order_id)
        .execute(&mut *tx)
        .await
        .unwrap();
    let job = conveyor_jobs::enqueue_tx(&mut tx, &SendReceipt { order_id }, EnqueueOptions::new()).await.unwrap();
    tx.commit().await.unwrap();

    // The first run fails and is retried after its back-off; the second succeeds.
    let done = conveyor.wait_for_job(job.id, Duration::from_secs(60)).await.unwrap();
    assert_eq!(done.status, JobStatus::Succeeded, "{:?}", done.last_error);
    assert_eq!(done.result, Some(json!({ "sent_to": "ada@example.com", "attempt": 2 })));
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    let sent: bool = sqlx::query_scalar("SELECT receipt_sent FROM public.orders WHERE id = $1")
        .bind(order_id)
        .fetch_one(&platform.pool)
        .await
        .unwrap();
    assert!(sent, "the handler's write committed with the job");
    assert_eq!(conveyor.workspace(), WorkspaceId::DEFAULT);

    // Maintenance runs as the same role.
    conveyor.maintenance().run_once().await.unwrap();
    shutdown.cancel();
    handle.await.unwrap().unwrap();

    // The service's public schema holds its own table alone.
    let public: Vec<String> =
        sqlx::query_scalar("SELECT relname::text FROM pg_class WHERE relnamespace = 'public'::regnamespace ORDER BY 1")
            .fetch_all(&platform.pool)
            .await
            .unwrap();
    assert_eq!(public, ["orders", "orders_pkey"]);
}

#[tokio::test]
async fn one_role_cancels_dead_letters_and_enqueues_without_a_transaction_of_its_own() {
    let platform = Platform::single_role().await;
    orders_table(&platform.pool).await;
    let runs = Arc::new(AtomicU32::new(0));
    let (conveyor, shutdown, handle) = running(&platform, Receipts { failures: 0, runs }).await;

    // No such order: a permanent failure, dead-lettered at once.
    let missing = conveyor.enqueue(&SendReceipt { order_id: Uuid::new_v4() }, EnqueueOptions::new()).await.unwrap();
    let done = conveyor.wait_for_job(missing.id, Duration::from_secs(30)).await.unwrap();
    assert_eq!(done.status, JobStatus::Failed);
    assert_eq!(done.last_error.as_deref(), Some("no such order"));

    // A job for tomorrow, canceled before it runs.
    let later = EnqueueOptions::new().delay(Duration::from_secs(86_400));
    let tomorrow = conveyor.enqueue(&SendReceipt { order_id: Uuid::new_v4() }, later).await.unwrap();
    conveyor.cancel_job(tomorrow.id).await.unwrap();
    assert_eq!(conveyor.get_job(tomorrow.id).await.unwrap().unwrap().status, JobStatus::Canceled);

    // Workspaces are no wall in this mode (the one role reads them all, as `migrate`'s docs say): the multi-tenant
    // mode's tests (server/tests/api/rls.rs) hold the wall.
    let other = conveyor.in_workspace(WorkspaceId(Uuid::new_v4()));
    assert_eq!(other.get_job(tomorrow.id).await.unwrap().map(|j| j.id), Some(tomorrow.id));
    shutdown.cancel();
    handle.await.unwrap().unwrap();
}

#[tokio::test]
async fn a_plain_transaction_without_a_workspace_is_refused_with_the_way_to_begin_one_and_writes_nothing() {
    let platform = Platform::single_role().await;
    let mut tx = platform.pool.begin().await.unwrap();
    let err = conveyor_jobs::enqueue_tx(&mut tx, &SendReceipt { order_id: Uuid::new_v4() }, EnqueueOptions::new())
        .await
        .unwrap_err();
    assert!(matches!(err, conveyor_jobs::EnqueueError::NoWorkspace), "{err}");
    assert!(err.to_string().contains("conveyor_jobs::begin"), "{err}");
    drop(tx);
    let jobs: i64 =
        sqlx::query_scalar("SELECT count(*) FROM conveyor.outbox_events").fetch_one(&platform.pool).await.unwrap();
    assert_eq!(jobs, 0);
}

#[tokio::test]
async fn migrating_with_one_role_again_is_a_no_op_and_bad_settings_are_refused_before_connecting() {
    let platform = Platform::single_role().await;
    conveyor_jobs::migrate(&platform.pool).await.unwrap();
    assert_eq!(conveyor_jobs::pending_migrations(&platform.pool).await.unwrap(), 0);

    let mut settings = conveyor_jobs::DispatcherSettings::default();
    settings.window = -1;
    let err = Conveyor::builder(platform.pool.clone(), "redis://127.0.0.1:1")
        .dispatcher_settings(settings)
        .connect()
        .await
        .err()
        .expect("refused");
    assert_eq!(err.kind(), conveyor_jobs::ErrorKind::Invalid);
    assert!(err.to_string().contains("window"), "{err}");
    // A Redis that is not there: an error that says so, not a hang.
    let err = Conveyor::connect(platform.pool.clone(), "redis://127.0.0.1:1").await.err().expect("no Redis there");
    assert_eq!(err.kind(), conveyor_jobs::ErrorKind::Redis, "{err:#}");
}

#[tokio::test]
async fn run_stops_every_part_and_says_why_when_one_cannot_run() {
    // The multi-tenant mode's application role, given as the only pool: the dispatcher may not do its work as it.
    let platform = Platform::new(8).await;
    let conveyor =
        Conveyor::builder(platform.pool.clone(), &kit::redis_url()).prefix(&platform.prefix).connect().await.unwrap();
    let worker = conveyor
        .worker()
        .handle::<SendReceipt>(Receipts { failures: 0, runs: Arc::new(AtomicU32::new(0)) })
        .build()
        .unwrap();
    let shutdown = CancellationToken::new();
    let ran = tokio::time::timeout(Duration::from_secs(60), conveyor.run(worker, shutdown.clone())).await;
    let err = ran.expect("run returned by itself, without the shutdown token").unwrap_err();
    assert!(err.to_string().contains("runtime role's pool"), "{err:#}");
    assert!(!shutdown.is_cancelled(), "the caller's token is the caller's");
}

#[tokio::test]
async fn migrating_with_one_role_never_lowers_a_retention_floor_recorded_before() {
    let platform = Platform::new(4).await;
    let role = |url: &str| conveyor_jobs::MigrateConfig::role_of(url).unwrap();
    let day = Duration::from_secs(86_400);
    let config =
        conveyor_jobs::MigrateConfig::new(&platform.owner_url, &role(&platform.app_url), &role(&platform.runtime_url))
            .retentions(365 * day, 60 * day);
    conveyor_jobs::migrate_with(&config).await.unwrap();
    let owner = conveyor_jobs::connect_postgres(&platform.owner_url, 1).await.unwrap();
    conveyor_jobs::migrate(&owner).await.unwrap();
    let floors: Vec<(String, String)> =
        sqlx::query_as("SELECT name, value FROM conveyor.conveyor_settings WHERE name LIKE '%retention' ORDER BY name")
            .fetch_all(&owner)
            .await
            .unwrap();
    assert_eq!(
        floors,
        [
            ("audit_retention".to_owned(), "365 days".to_owned()),
            ("dead_letter_retention".to_owned(), "60 days".to_owned())
        ]
    );
}

#[tokio::test]
async fn four_migrations_of_a_new_database_at_once_all_succeed_and_leave_every_index_valid() {
    // Each on a connection of its own, as four processes starting together would. Its indexes built concurrently must
    // not wait for a migration waiting for its turn, nor be left half-built by one failing.
    let url = kit::empty_database().await;
    let migrating = (0..4).map(|_| async {
        let pool = conveyor_jobs::connect_postgres(&url, 2).await.expect("connect as the database's owner");
        conveyor_jobs::migrate(&pool).await
    });
    for migration in futures_util::future::join_all(migrating).await {
        migration.expect("every migration succeeds");
    }
    let pool = conveyor_jobs::connect_postgres(&url, 2).await.unwrap();
    assert_eq!(conveyor_jobs::pending_migrations(&pool).await.unwrap(), 0);
    let invalid: Vec<String> = sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
         WHERE i.indrelid = 'conveyor.outbox_events'::regclass AND NOT i.indisvalid",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(invalid.is_empty(), "indexes left invalid: {invalid:?}");
}
