//! How enqueues wake the dispatchers (migration 0039): a commit that wrote jobs notifies only while no dispatcher is
//! awake, since a `NOTIFY` makes its COMMIT wait for every other notifying commit's WAL flush; an awake dispatcher
//! finds the unnotified jobs by its ticks; one that fell asleep is woken by the next notification.
//!
//! Whether a commit notified is read in commit order: after the commit, the test notifies a marker channel of its
//! own, and the first notification that arrives tells (PostgreSQL delivers notifications in the order their
//! transactions committed).

use std::time::Duration;

use conveyor_jobs::{EnqueueOptions, WorkspaceId};
use sqlx::postgres::PgListener;
use uuid::Uuid;

use crate::kit::{Job, Platform, eventually};

const MARKER: &str = "test_wake_marker";

/// A listener on the dispatchers' channel and the marker.
async fn listener(platform: &Platform) -> PgListener {
    let mut listener = PgListener::connect_with(&platform.pool).await.unwrap();
    listener.listen_all(["conveyor_outbox", MARKER]).await.unwrap();
    listener
}

/// Whether the commits since the last call notified the dispatchers: notifies the marker, then reads up to it.
async fn notified(platform: &Platform, listener: &mut PgListener) -> Vec<String> {
    sqlx::query("SELECT pg_notify($1, '')").bind(MARKER).execute(&platform.pool).await.unwrap();
    let mut payloads = Vec::new();
    loop {
        let n = tokio::time::timeout(Duration::from_secs(10), listener.recv()).await.unwrap().unwrap();
        if n.channel() == MARKER {
            return payloads;
        }
        payloads.push(n.payload().to_owned());
    }
}

async fn enqueue_one(platform: &Platform, workspace: WorkspaceId) -> Uuid {
    let mut tx = conveyor_jobs::begin_workspace(&platform.pool, workspace).await.unwrap();
    let job = conveyor_jobs::enqueue_tx(&mut tx, &Job { tenant: 0, at_ms: 0.0 }, EnqueueOptions::new()).await.unwrap();
    tx.commit().await.unwrap();
    job.id.0
}

async fn enqueue_many(platform: &Platform, workspace: WorkspaceId) {
    let mut tx = conveyor_jobs::begin_workspace(&platform.pool, workspace).await.unwrap();
    let jobs: Vec<Job> = (0..3).map(|tenant| Job { tenant, at_ms: 0.0 }).collect();
    conveyor_jobs::enqueue_many_tx(&mut tx, jobs.iter().map(|j| (j, EnqueueOptions::new()))).await.unwrap();
    tx.commit().await.unwrap();
}

/// The SQL enqueue, as a product's trigger or a psql session calls it.
async fn enqueue_in_sql(platform: &Platform, workspace: WorkspaceId) {
    let mut tx = conveyor_jobs::begin_workspace(&platform.pool, workspace).await.unwrap();
    sqlx::query("SELECT conveyor.conveyor_enqueue('bench.job', '{\"tenant\": 0, \"at_ms\": 0}')")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
}

async fn mark(platform: &Platform, interval: &str) {
    sqlx::query("SELECT conveyor.conveyor_dispatcher_awake($1::interval)")
        .bind(interval)
        .execute(&platform.runtime_pool)
        .await
        .unwrap();
}

async fn status(platform: &Platform, id: Uuid) -> String {
    sqlx::query_scalar("SELECT status FROM conveyor.outbox_events WHERE id = $1")
        .bind(id)
        .fetch_one(&mut platform.owner().await)
        .await
        .unwrap()
}

/// Waits until the job has been handed to the stream and its hand-off recorded.
async fn relayed(platform: &Platform, id: Uuid) -> bool {
    eventually(Duration::from_secs(10), || async { (status(platform, id).await == "dispatched").then_some(()) })
        .await
        .is_some()
}

#[tokio::test]
async fn an_enqueue_notifies_the_dispatchers_only_while_none_is_awake() {
    let platform = Platform::new(4).await;
    sqlx::query(
        "INSERT INTO conveyor.job_kinds (kind, queue, max_attempts, timeout_ms) VALUES ('bench.job', 'bench', 3, 1000)",
    )
    .execute(&mut platform.owner().await)
    .await
    .unwrap();
    let workspace = WorkspaceId(Uuid::new_v4());
    let mut listener = listener(&platform).await;
    let me = workspace.0.to_string();

    // No dispatcher awake: each enqueue (one, many, the SQL function) notifies, naming its workspace.
    enqueue_one(&platform, workspace).await;
    assert_eq!(notified(&platform, &mut listener).await, std::slice::from_ref(&me));
    enqueue_many(&platform, workspace).await;
    assert_eq!(notified(&platform, &mut listener).await, std::slice::from_ref(&me));
    enqueue_in_sql(&platform, workspace).await;
    assert_eq!(notified(&platform, &mut listener).await, std::slice::from_ref(&me));

    // Awake: none notifies.
    mark(&platform, "1 hour").await;
    enqueue_one(&platform, workspace).await;
    enqueue_many(&platform, workspace).await;
    enqueue_in_sql(&platform, workspace).await;
    assert_eq!(notified(&platform, &mut listener).await, Vec::<String>::new());

    // A mark only ever moves later: a dispatcher with a shorter one does not cut another's short.
    mark(&platform, "1 second").await;
    enqueue_one(&platform, workspace).await;
    assert_eq!(notified(&platform, &mut listener).await, Vec::<String>::new());

    // The mark lapsed: they notify again.
    sqlx::query("UPDATE conveyor.dispatchers_awake SET until = clock_timestamp() - interval '1 second'")
        .execute(&mut platform.owner().await)
        .await
        .unwrap();
    enqueue_one(&platform, workspace).await;
    assert_eq!(notified(&platform, &mut listener).await, [me]);

    // The application role (a tenant's request) reads the mark and cannot write it: it cannot silence the
    // notifications of other tenants' jobs.
    for write in [
        "UPDATE conveyor.dispatchers_awake SET until = 'infinity'",
        "INSERT INTO conveyor.dispatchers_awake (until) VALUES ('infinity')",
        "SELECT conveyor.conveyor_dispatcher_awake(interval '1 day')",
    ] {
        let refused = sqlx::query(write).execute(&platform.pool).await.unwrap_err();
        let code = refused.as_database_error().and_then(|e| e.code()).map(|c| c.into_owned());
        assert_eq!(code.as_deref(), Some("42501"), "{write}: {refused}");
    }
}

#[tokio::test]
async fn an_awake_dispatcher_relays_the_jobs_that_notified_nobody_and_a_sleeping_one_is_woken() {
    let platform = Platform::new(4).await;
    // No sweep in the test's time: only notifications and ticks relay.
    let dispatcher = platform.dispatcher(|s| s.poll_interval = Duration::from_secs(3600)).await;
    let shutdown = tokio_util::sync::CancellationToken::new();
    let running = tokio::spawn(dispatcher.run(shutdown.clone()));
    let workspace = WorkspaceId(Uuid::new_v4());
    let mut listener = listener(&platform).await;

    // The first job notifies (nobody is awake) and wakes the dispatcher, which marks itself awake.
    let first = enqueue_one(&platform, workspace).await;
    assert_eq!(notified(&platform, &mut listener).await.len(), 1);
    assert!(relayed(&platform, first).await, "the notified job is relayed");
    // Held awake for the test (the dispatcher's own mark lasts a second): the next job notifies nobody, and only the
    // dispatcher's ticks, which go on for seconds after the work it saw, can find it.
    mark(&platform, "1 hour").await;
    let second = enqueue_one(&platform, workspace).await;
    assert_eq!(notified(&platform, &mut listener).await, Vec::<String>::new(), "the second job notified nobody");
    assert!(relayed(&platform, second).await, "the awake dispatcher's tick relays the unnotified job");

    // Quiet: the mark lapses, the dispatcher stops ticking (a second's mark, two seconds' grace) and sleeps until a
    // notification, which the next enqueue sends again.
    sqlx::query("UPDATE conveyor.dispatchers_awake SET until = clock_timestamp()")
        .execute(&mut platform.owner().await)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let third = enqueue_one(&platform, workspace).await;
    assert_eq!(notified(&platform, &mut listener).await.len(), 1, "after the quiet spell, the enqueue notifies");
    assert!(relayed(&platform, third).await, "the notification wakes the sleeping dispatcher");

    shutdown.cancel();
    running.await.unwrap().unwrap();
}

#[tokio::test]
async fn with_ticks_off_the_dispatcher_never_marks_itself_awake() {
    let platform = Platform::new(4).await;
    let dispatcher = platform
        .dispatcher(|s| {
            s.poll_interval = Duration::from_secs(3600);
            s.tick = Duration::ZERO;
        })
        .await;
    let shutdown = tokio_util::sync::CancellationToken::new();
    let running = tokio::spawn(dispatcher.run(shutdown.clone()));
    let workspace = WorkspaceId(Uuid::new_v4());
    let mut listener = listener(&platform).await;
    for _ in 0..3 {
        let id = enqueue_one(&platform, workspace).await;
        assert_eq!(notified(&platform, &mut listener).await.len(), 1, "every enqueue notifies");
        assert!(relayed(&platform, id).await);
    }
    let marks: i64 = sqlx::query_scalar("SELECT count(*) FROM conveyor.dispatchers_awake")
        .fetch_one(&platform.runtime_pool)
        .await
        .unwrap();
    assert_eq!(marks, 0);
    shutdown.cancel();
    running.await.unwrap().unwrap();
}
