//! The dispatcher relays the outbox into Redis Streams: real PostgreSQL, real Redis, real processes killed at the
//! dangerous moments.

use crate::common;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use common::{Process, TestApp, TestRedis, principal, store_body};

use conveyor_jobs::EnqueueOptions;
use conveyor_jobs::Metrics;
use conveyor_jobs::RedisKeys;
use conveyor_jobs::WorkspaceId;
use conveyor_jobs::{DispatchOutcome, Dispatcher};
use conveyor_shop::jobs::VerifyCredentials;
use reqwest::Method;
use uuid::Uuid;

async fn enqueue(app: &TestApp, workspace: WorkspaceId, n: usize) -> Vec<Uuid> {
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, workspace).await.unwrap();
    let mut ids = Vec::with_capacity(n);
    for _ in 0..n {
        let payload = VerifyCredentials { store_id: Uuid::now_v7(), credentials_version: 1 };
        ids.push(conveyor_jobs::enqueue_tx(&mut tx, &payload, EnqueueOptions::new()).await.unwrap().id.0);
    }
    tx.commit().await.unwrap();
    ids
}

async fn dispatcher(app: &TestApp, redis_url: &str, tweak: impl FnOnce(&mut HashMap<String, String>)) -> Dispatcher {
    common::test_dispatcher(app, redis_url, tweak).await
}

/// Every outbox row of `workspace`: (id, status, stream_id).
async fn events(app: &TestApp, workspace: WorkspaceId) -> Vec<serde_json::Value> {
    app.db.rows("outbox_events", workspace).await
}

async fn count_status(app: &TestApp, workspaces: &[WorkspaceId], status: &str) -> usize {
    let mut n = 0;
    for ws in workspaces {
        n += events(app, *ws).await.iter().filter(|e| e["status"] == status).count();
    }
    n
}

/// Runs a dispatcher (with `CONVEYOR_DISPATCH_*` set by `tweak`) that relays notified workspaces only: its sweep
/// polls an hour apart, and it returns once past the start-up sweep. Cancel the token to stop it.
async fn run_notified_only(
    app: &TestApp,
    redis_url: &str,
    tweak: impl FnOnce(&mut HashMap<String, String>),
) -> tokio_util::sync::CancellationToken {
    let d = dispatcher(app, redis_url, |v| {
        tweak(v);
        v.insert("CONVEYOR_DISPATCH_POLL".into(), "1h".into());
    })
    .await;
    let shutdown = tokio_util::sync::CancellationToken::new();
    common::run_dispatcher(d, &shutdown);
    tokio::time::sleep(Duration::from_millis(500)).await;
    shutdown
}

fn stream_key(app: &TestApp) -> String {
    RedisKeys::new(&app.redis_prefix).stream("stores")
}

/// The stream holds each of `expected` exactly once, and nothing else.
async fn assert_stream_holds_each_once(app: &TestApp, redis_url: &str, expected: &[Uuid]) {
    let client = common::redis_client(redis_url).await;
    let ids = common::stream_event_ids(&client, &stream_key(app)).await;
    let unique: HashSet<&String> = ids.iter().collect();
    assert_eq!(ids.len(), unique.len(), "no event is in the stream twice");
    let expected: HashSet<String> = expected.iter().map(Uuid::to_string).collect();
    assert_eq!(unique.into_iter().cloned().collect::<HashSet<_>>(), expected);
}

fn process_vars(app: &TestApp, redis_url: &str) -> HashMap<String, String> {
    let mut vars = common::config_vars(&app.db, &app.redis_prefix);
    vars.insert("CONVEYOR_REDIS_URL".into(), redis_url.to_owned());
    vars.insert("CONVEYOR_ADMIN_ADDR".into(), format!("127.0.0.1:{}", common::free_port()));
    vars.insert("CONVEYOR_DISPATCH_POLL".into(), "100ms".into());
    vars
}

#[tokio::test]
async fn events_committed_while_no_dispatcher_ran_are_each_delivered_once_by_a_later_one() {
    let app = TestApp::spawn().await;
    let redis = common::redis_url();
    let workspaces: Vec<WorkspaceId> = (0..3).map(|_| WorkspaceId(Uuid::new_v4())).collect();
    let mut ids = Vec::new();
    for ws in &workspaces {
        ids.extend(enqueue(&app, *ws, 7).await);
    }
    let process = Process::spawn(&["dispatcher"], &process_vars(&app, &redis));
    let done = common::eventually(Duration::from_secs(30), || async {
        (count_status(&app, &workspaces, "dispatched").await == ids.len()).then_some(())
    })
    .await;
    assert!(done.is_some(), "all dispatched; log:\n{}", process.log());
    assert_stream_holds_each_once(&app, &redis, &ids).await;
    for ws in &workspaces {
        for event in events(&app, *ws).await {
            assert!(event["stream_id"].as_str().is_some_and(|s| s.contains('-')), "stream id recorded: {event}");
            assert!(event["locked_by"].is_null() && event["dispatched_at"].is_string());
        }
    }
}

#[tokio::test]
async fn an_api_killed_right_after_its_commit_loses_no_event() {
    let app = TestApp::spawn().await;
    let redis = common::redis_url();
    let mut vars = process_vars(&app, &redis);
    let port = common::free_port();
    vars.insert("CONVEYOR_HTTP_ADDR".into(), format!("127.0.0.1:{port}"));
    vars.insert("FAILPOINTS".into(), "api::after_commit=sleep(60000)".into());
    let mut api = Process::spawn(&["api"], &vars);
    let who = principal();
    let token = app.token(who);
    let request = tokio::spawn(async move {
        let client = reqwest::Client::new();
        for _ in 0..100 {
            let sent = client
                .post(format!("http://127.0.0.1:{port}/v1/stores"))
                .bearer_auth(&token)
                .header("idempotency-key", Uuid::new_v4().to_string())
                .json(&store_body("crash"))
                .send()
                .await;
            match sent {
                Err(e) if e.is_connect() => tokio::time::sleep(Duration::from_millis(100)).await,
                other => return other.map(|r| r.status()),
            }
        }
        panic!("the api never listened");
    });
    // The commit happened (the event is visible) and the process hangs at the crash point: kill it there.
    let committed = common::eventually(Duration::from_secs(30), || async {
        (app.db.count("outbox_events", who.workspace_id).await == 1).then_some(())
    })
    .await;
    assert!(committed.is_some(), "the API committed; log:\n{}", api.log());
    api.kill();
    assert!(request.await.unwrap().is_err(), "the client never got an answer");
    let id: Uuid = events(&app, who.workspace_id).await[0]["id"].as_str().unwrap().parse().unwrap();

    let dispatcher = Process::spawn(&["dispatcher"], &process_vars(&app, &redis));
    let done = common::eventually(Duration::from_secs(30), || async {
        (count_status(&app, &[who.workspace_id], "dispatched").await == 1).then_some(())
    })
    .await;
    assert!(done.is_some(), "dispatched; log:\n{}", dispatcher.log());
    assert_stream_holds_each_once(&app, &redis, &[id]).await;
}

#[tokio::test]
async fn a_dispatcher_killed_between_xadd_and_marking_is_finished_by_another_without_a_duplicate() {
    let app = TestApp::spawn().await;
    let redis = common::redis_url();
    let ws = WorkspaceId(Uuid::new_v4());
    let ids = enqueue(&app, ws, 5).await;
    let mut vars = process_vars(&app, &redis);
    vars.insert("CONVEYOR_DISPATCH_LEASE".into(), "2s".into());
    vars.insert("CONVEYOR_DISPATCH_DEDUP_TTL".into(), "1h".into());
    vars.insert("CONVEYOR_DISPATCH_DEDUP_TTL_RECORDED".into(), "8s".into());
    let mut crashing = vars.clone();
    crashing.insert("FAILPOINTS".into(), "dispatcher::after_xadd=sleep(60000)".into());
    let mut first = Process::spawn(&["dispatcher"], &crashing);
    let client = common::redis_client(&redis).await;
    let added = common::eventually(Duration::from_secs(30), || async {
        (common::stream_event_ids(&client, &stream_key(&app)).await.len() == ids.len()).then_some(())
    })
    .await;
    assert!(added.is_some(), "the first dispatcher XADDed; log:\n{}", first.log());
    first.kill();
    assert_eq!(count_status(&app, &[ws], "dispatching").await, ids.len(), "XADDed but never marked");
    let keys = RedisKeys::new(&app.redis_prefix);
    let life = |id: Uuid| {
        let (client, key) = (client.clone(), keys.dedup("stores", &id, 0));
        async move {
            use fred::prelude::KeysInterface;
            client.pttl::<i64, _>(key).await.unwrap()
        }
    };
    assert!(life(ids[0]).await > 30 * 60 * 1000, "an unrecorded hand-off keeps its de-dup key for the full hour");

    let second = Process::spawn(&["dispatcher"], &vars);
    let done = common::eventually(Duration::from_secs(30), || async {
        (count_status(&app, &[ws], "dispatched").await == ids.len()).then_some(())
    })
    .await;
    assert!(done.is_some(), "the lease expired and another dispatcher finished; log:\n{}", second.log());
    assert_stream_holds_each_once(&app, &redis, &ids).await;
    // Recorded: the keys live CONVEYOR_DISPATCH_DEDUP_TTL_RECORDED (8 s) more, not the hour.
    let shortened = common::eventually(Duration::from_secs(10), || async {
        let mut lives = Vec::new();
        for id in &ids {
            lives.push(life(*id).await);
        }
        lives.iter().all(|&ms| ms > 0 && ms <= 8000).then_some(())
    })
    .await;
    assert!(shortened.is_some(), "recorded hand-offs' de-dup keys are shortened; log:\n{}", second.log());
    // The recorded stream ids are those of the first (and only) XADD.
    let entries: Vec<(String, HashMap<String, String>)> = {
        use fred::prelude::StreamsInterface;
        client.xrange(stream_key(&app), "-", "+", None).await.unwrap()
    };
    for event in events(&app, ws).await {
        let (entry_id, _) = entries.iter().find(|(_, f)| f["event_id"] == event["id"].as_str().unwrap()).unwrap();
        assert_eq!(event["stream_id"], entry_id.as_str());
    }
}

#[tokio::test]
async fn three_dispatchers_drain_a_backlog_together_with_nothing_lost_or_doubled() {
    let app = TestApp::spawn().await;
    let redis = common::redis_url();
    let workspaces: Vec<WorkspaceId> = (0..30).map(|_| WorkspaceId(Uuid::new_v4())).collect();
    let mut ids = Vec::new();
    for ws in &workspaces {
        ids.extend(enqueue(&app, *ws, 100).await);
    }
    let mut handles = Vec::new();
    for _ in 0..3 {
        let d = dispatcher(&app, &redis, |v| {
            v.insert("CONVEYOR_DISPATCH_BATCH".into(), "37".into());
            v.insert("CONVEYOR_DISPATCH_CONCURRENCY".into(), "3".into());
        })
        .await;
        handles.push(tokio::spawn(async move {
            let mut dispatched = 0;
            loop {
                match d.dispatch_once().await.unwrap() {
                    DispatchOutcome::Worked(s) => dispatched += s.dispatched,
                    _ => return dispatched,
                }
            }
        }));
    }
    let mut total = 0;
    for handle in handles {
        total += tokio::time::timeout(Duration::from_secs(120), handle).await.expect("no deadlock").unwrap();
    }
    assert_eq!(total as usize, ids.len(), "every event marked exactly once across dispatchers");
    assert_eq!(count_status(&app, &workspaces, "dispatched").await, ids.len());
    assert_stream_holds_each_once(&app, &redis, &ids).await;
}

#[tokio::test]
async fn while_redis_is_down_events_back_off_then_flow_or_dead_letter_with_a_redacted_error() {
    let app = TestApp::spawn().await;
    let password = "hunter2-redis-password";
    let mut redis = TestRedis::start(Some(password)).await;
    // The dispatcher's Redis client, kept to tell when it has reconnected (a clone shares its connection).
    let vars: HashMap<String, String> = [
        ("CONVEYOR_DISPATCH_BACKOFF_BASE", "200ms"),
        ("CONVEYOR_DISPATCH_BACKOFF_MAX", "10s"),
        ("CONVEYOR_DISPATCH_MAX_ATTEMPTS", "4"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    let settings = conveyor_server::config::dispatcher_settings(&vars).unwrap();
    let client = conveyor_jobs::connect_redis(&redis.url(), Duration::from_millis(500)).await.unwrap();
    let producer = conveyor_jobs::Producer::new(
        client.clone(),
        conveyor_jobs::RedisKeys::new(&app.redis_prefix),
        settings.dedup_ttl,
    );
    let pool = conveyor_jobs::connect_postgres(&app.db.runtime_url, 8).await.unwrap();
    let d = Dispatcher::new(pool, producer, settings, Metrics::new(), conveyor_jobs::instance_name());
    let ws = WorkspaceId(Uuid::new_v4());
    let ids = enqueue(&app, ws, 3).await;
    redis.stop();

    // Three failed passes: pending each time, attempt_count growing, each back-off at least its floor.
    let mut floors = Vec::new();
    for attempt in 1..=3u32 {
        let (before,): (chrono::DateTime<chrono::Utc>,) =
            sqlx::query_as("SELECT now()").fetch_one(&app.db.pool).await.unwrap();
        common::eventually(Duration::from_secs(30), || async {
            matches!(d.dispatch_once().await, Ok(DispatchOutcome::Worked(s)) if s.retried == 3).then_some(())
        })
        .await
        .expect("a pass that fails the whole batch");
        for event in events(&app, ws).await {
            assert_eq!(event["status"], "pending");
            assert_eq!(event["attempt_count"], attempt);
            let error = event["last_error"].as_str().unwrap();
            assert!(!error.contains(password), "{error}");
            let next: chrono::DateTime<chrono::Utc> = serde_json::from_value(event["next_attempt_at"].clone()).unwrap();
            let waited = (next - before).to_std().unwrap();
            let floor = Duration::from_millis(100 * (1 << (attempt - 1)));
            assert!(waited >= floor, "attempt {attempt}: back-off {waited:?} under its floor {floor:?}");
            floors.push(waited);
        }
        // Not due yet: a pass right now finds nothing.
        assert_eq!(d.dispatch_once().await.unwrap(), DispatchOutcome::Idle);
        tokio::time::sleep(Duration::from_millis(200 * (1 << (attempt - 1)) + 50)).await;
    }
    assert_eq!(count_status(&app, &[ws], "dead_letter").await, 0, "nothing lost, nothing given up yet");

    // Redis comes back: once the dispatcher's client has reconnected (a pass before that would spend the last
    // attempt), everything flows.
    redis.start_again().await;
    common::eventually(Duration::from_secs(30), || async {
        use fred::prelude::ClientLike;
        client.ping::<()>(None).await.ok()
    })
    .await
    .expect("the dispatcher's client reconnects");
    common::eventually(Duration::from_secs(30), || async {
        let _ = d.dispatch_once().await;
        (count_status(&app, &[ws], "dispatched").await == 3).then_some(())
    })
    .await
    .expect("delivery resumes when Redis returns");
    assert_stream_holds_each_once(&app, &redis.url(), &ids).await;

    // Redis away for good: past the maximum attempts, dead letters with a redacted error and a failed operation.
    let who = principal();
    let created = app.send(Method::POST, "/v1/stores", who, Some(&store_body("dl"))).await;
    assert_eq!(created.status(), 202);
    let operation: serde_json::Value = created.json().await.unwrap();
    redis.stop();
    let dead = common::eventually(Duration::from_secs(60), || async {
        let _ = d.dispatch_once().await;
        (count_status(&app, &[who.workspace_id], "dead_letter").await == 1).then_some(())
    })
    .await;
    assert!(dead.is_some(), "dead-lettered after 4 attempts");
    let event = &events(&app, who.workspace_id).await[0];
    assert_eq!(event["attempt_count"], 4);
    assert!(!event["last_error"].as_str().unwrap().contains(password));
    let op_path = format!("/v1/operations/{}", operation["operation"]["id"].as_str().unwrap());
    let op: serde_json::Value = app.send(Method::GET, &op_path, who, None).await.json().await.unwrap();
    assert_eq!(op["status"], "failed");
    assert!(!op.to_string().contains(password));
}

#[tokio::test]
async fn without_a_workspace_the_application_role_can_neither_read_claim_nor_update_events() {
    let app = TestApp::spawn().await;
    let ws = WorkspaceId(Uuid::new_v4());
    enqueue(&app, ws, 4).await;
    let mut conn = app.db.app_connection().await;
    let claimed = sqlx::query(
        "WITH due AS (SELECT id FROM conveyor.outbox_events WHERE status = 'pending' ORDER BY id LIMIT 100 FOR UPDATE SKIP LOCKED)
         UPDATE conveyor.outbox_events e SET status = 'dispatching', locked_by = 'thief', locked_until = now() + interval '1 hour'
         FROM due WHERE e.id = due.id RETURNING e.id",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap();
    assert!(claimed.is_empty(), "nothing claimed without a workspace");
    let (visible,): (i64,) =
        sqlx::query_as("SELECT count(*) FROM conveyor.outbox_events").fetch_one(&mut conn).await.unwrap();
    assert_eq!(visible, 0);
    let updated =
        sqlx::query("UPDATE conveyor.outbox_events SET status = 'dispatched'").execute(&mut conn).await.unwrap();
    assert_eq!(updated.rows_affected(), 0);
    let deleted = sqlx::query("DELETE FROM conveyor.outbox_events").execute(&mut conn).await.unwrap();
    assert_eq!(deleted.rows_affected(), 0);
    assert_eq!(count_status(&app, &[ws], "pending").await, 4, "the events are untouched");
}

#[tokio::test]
async fn retention_deletes_only_jobs_that_ended_past_the_period() {
    let app = TestApp::spawn().await;
    let redis = common::redis_url();
    let ws = WorkspaceId(Uuid::new_v4());
    enqueue(&app, ws, 6).await;
    let d = dispatcher(&app, &redis, |_| {}).await;
    d.dispatch_once().await.unwrap();
    let pending = enqueue(&app, ws, 2).await;
    // Of the six handed off eight days ago, four succeeded and one was canceled long ago; one is still live.
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
    let live: Uuid = sqlx::query_scalar(
        "WITH old AS (UPDATE conveyor.outbox_events SET dispatched_at = now() - interval '8 days' WHERE status = 'dispatched'
                      RETURNING id)
         SELECT min(id::text)::uuid FROM old",
    )
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    sqlx::query(
        "UPDATE conveyor.outbox_events SET status = CASE WHEN id::text = (SELECT max(id::text) FROM conveyor.outbox_events WHERE status = 'dispatched')
                                               THEN 'canceled' ELSE 'completed' END,
                finished_at = now() - interval '8 days'
         WHERE status = 'dispatched' AND id <> $1",
    )
    .bind(live)
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let purged =
        conveyor_jobs::purge_finished_jobs(&app.db.runtime_pool, Duration::from_secs(7 * 86400), 4, 100).await.unwrap();
    assert_eq!(purged, 5);
    let left: Vec<String> = events(&app, ws).await.iter().map(|e| e["id"].as_str().unwrap().to_owned()).collect();
    let mut expected: Vec<String> = pending.iter().chain([&live]).map(Uuid::to_string).collect();
    expected.sort();
    let mut left = left;
    left.sort();
    assert_eq!(left, expected, "jobs not handed off, and a live one handed off long ago, are never purged");
}

#[tokio::test]
async fn sigterm_stops_the_dispatcher_cleanly_with_no_lease_left_behind() {
    let app = TestApp::spawn().await;
    let redis = common::redis_url();
    let ws = WorkspaceId(Uuid::new_v4());
    enqueue(&app, ws, 50).await;
    let mut process = Process::spawn(&["dispatcher"], &process_vars(&app, &redis));
    common::eventually(Duration::from_secs(30), || async {
        (count_status(&app, &[ws], "dispatched").await > 0).then_some(())
    })
    .await
    .expect("the dispatcher works");
    enqueue(&app, ws, 50).await;
    process.signal(15);
    let status = tokio::task::spawn_blocking(move || {
        let status = process.child.wait().unwrap();
        (status, process)
    })
    .await
    .unwrap();
    assert!(status.0.success(), "exit 0 on SIGTERM; log:\n{}", status.1.log());
    assert_eq!(count_status(&app, &[ws], "dispatching").await, 0, "no lease left held");
}

#[tokio::test]
async fn a_dispatcher_stopped_while_its_marks_are_being_recorded_records_them_all_before_it_exits() {
    let app = TestApp::spawn().await;
    let redis = common::redis_url();
    let mut vars = process_vars(&app, &redis);
    // Notified batches only (no sweep after the start-up one), each mark held back for two seconds.
    vars.insert("CONVEYOR_DISPATCH_POLL".into(), "1h".into());
    vars.insert("FAILPOINTS".into(), "dispatcher::before_mark=sleep(2000)".into());
    let mut process = Process::spawn(&["dispatcher"], &vars);
    let listening = common::eventually(Duration::from_secs(30), || async {
        process.log().contains("Dispatcher started").then_some(())
    })
    .await;
    assert!(listening.is_some(), "the dispatcher starts; log:\n{}", process.log());
    tokio::time::sleep(Duration::from_millis(500)).await; // past the start-up sweep

    let ws = WorkspaceId(Uuid::new_v4());
    let ids = enqueue(&app, ws, 5).await;
    let client = common::redis_client(&redis).await;
    let handed_off = common::eventually(Duration::from_secs(20), || async {
        (common::stream_event_ids(&client, &stream_key(&app)).await.len() == ids.len()).then_some(())
    })
    .await;
    assert!(handed_off.is_some(), "the notified batch is in the stream");
    assert_eq!(count_status(&app, &[ws], "dispatching").await, 5, "its mark is still being recorded");

    process.signal(15);
    let (status, process) =
        tokio::task::spawn_blocking(move || (process.child.wait().unwrap(), process)).await.unwrap();
    assert!(status.success(), "exit 0 on SIGTERM; log:\n{}", process.log());
    assert_eq!(count_status(&app, &[ws], "dispatched").await, 5, "every batch handed off was recorded before exit");
    assert_stream_holds_each_once(&app, &redis, &ids).await;
}

#[tokio::test]
async fn one_dispatcher_relays_a_workspaces_events_in_the_order_they_were_written() {
    let app = TestApp::spawn().await;
    let redis = common::redis_url();
    let ws = WorkspaceId(Uuid::new_v4());
    let mut written = Vec::new();
    for _ in 0..8 {
        written.extend(enqueue(&app, ws, 5).await);
    }
    // Small batches, so that order must hold across batches too.
    let d = dispatcher(&app, &redis, |v| {
        v.insert("CONVEYOR_DISPATCH_BATCH".into(), "7".into());
    })
    .await;
    while d.dispatch_once().await.unwrap() != DispatchOutcome::Idle {}
    let client = common::redis_client(&redis).await;
    let relayed = common::stream_event_ids(&client, &stream_key(&app)).await;
    let written: Vec<String> = written.iter().map(Uuid::to_string).collect();
    assert_eq!(relayed, written);
}

#[tokio::test]
async fn notified_batches_go_out_in_the_order_they_were_written_while_earlier_marks_are_still_being_recorded() {
    let app = TestApp::spawn().await;
    let redis = common::redis_url();
    // The loop, not a sweep: notified batches of two, marked in the background while the next one is claimed.
    let shutdown = run_notified_only(&app, &redis, |v| {
        v.insert("CONVEYOR_DISPATCH_BATCH".into(), "2".into());
    })
    .await;
    let ws = WorkspaceId(Uuid::new_v4());
    let mut written = Vec::new();
    for _ in 0..30 {
        written.extend(enqueue(&app, ws, 1).await);
    }
    let relayed = common::eventually(Duration::from_secs(30), || async {
        (count_status(&app, &[ws], "dispatched").await == written.len()).then_some(())
    })
    .await;
    assert!(relayed.is_some(), "every notified event relayed and marked");
    let client = common::redis_client(&redis).await;
    let in_stream = common::stream_event_ids(&client, &stream_key(&app)).await;
    let written: Vec<String> = written.iter().map(Uuid::to_string).collect();
    assert_eq!(in_stream, written);
    shutdown.cancel();
}

/// The relay's passes by kind, from a dispatcher process's `/metrics` (`conveyor_outbox_relay_passes_total`).
async fn relay_passes(admin_addr: &str, pass: &str) -> Option<u64> {
    let text = reqwest::get(format!("http://{admin_addr}/metrics")).await.ok()?.text().await.ok()?;
    let series = format!("conveyor_outbox_relay_passes_total{{pass=\"{pass}\"}} ");
    text.lines().find_map(|line| line.strip_prefix(&series)?.trim().parse().ok())
}

/// At a steady trickle the named passes relay the traffic, and the dispatcher sweeps about once a poll interval, not
/// after every pass: a sweep looks up every workspace with due jobs, which under a long-held snapshot walks every row
/// version the snapshot keeps, and becomes slow (here: a failpoint makes each sweep take 200 ms). Before 0030's release
/// a sweep that relayed anything was followed by another while a job committed within the last second was pending, so
/// a trickle of commits during slow sweeps kept the relay sweeping without pause.
#[tokio::test]
async fn at_a_steady_trickle_named_passes_and_ticks_relay_and_the_dispatcher_sweeps_once_a_poll_interval() {
    let app = TestApp::spawn().await;
    let redis = common::redis_url();
    let (_sandbox, market) = common::sandbox(Default::default()).await;
    let settings = conveyor_jobs::WorkerSettings { concurrency: 8, ..Default::default() };
    let worker = common::test_worker(&app, &redis, &market, settings, 3, conveyor_jobs::Metrics::new()).await;
    worker.ensure_groups().await.unwrap();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let working = tokio::spawn(worker.run(shutdown.clone(), Duration::from_secs(5)));
    let mut vars = process_vars(&app, &redis);
    vars.insert("CONVEYOR_DISPATCH_POLL".into(), "1s".into());
    vars.insert("FAILPOINTS".into(), "dispatcher::sweep=sleep(200)".into());
    let admin = vars["CONVEYOR_ADMIN_ADDR"].clone();
    let dispatcher = Process::spawn(&["dispatcher"], &vars);
    // Its first sweeps (at start, and when its LISTEN opens) are behind it.
    let up = common::eventually(Duration::from_secs(20), || async {
        relay_passes(&admin, "sweep").await.filter(|n| *n >= 2)
    })
    .await;
    assert!(up.is_some(), "the dispatcher serves its metrics; log:\n{}", dispatcher.log());
    tokio::time::sleep(Duration::from_millis(300)).await;

    let workspaces: Vec<WorkspaceId> = (0..4).map(|_| WorkspaceId(Uuid::new_v4())).collect();
    let (sweeps_before, started) = (relay_passes(&admin, "sweep").await.unwrap(), std::time::Instant::now());
    let mut ids = Vec::new();
    for i in 0..300 {
        ids.extend(enqueue(&app, workspaces[i % workspaces.len()], 1).await);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let done = common::eventually(Duration::from_secs(60), || async {
        (count_status(&app, &workspaces, "completed").await == ids.len()).then_some(())
    })
    .await;
    let sweeps = relay_passes(&admin, "sweep").await.unwrap() - sweeps_before;
    let (elapsed, named) = (
        started.elapsed(),
        relay_passes(&admin, "named").await.unwrap() + relay_passes(&admin, "tick").await.unwrap_or(0),
    );
    shutdown.cancel();
    working.await.unwrap().unwrap();
    assert!(done.is_some(), "every job ran; log:\n{}", dispatcher.log());
    assert!(named >= 20, "the named passes and ticks carried the trickle: {named} of them");
    // One a poll interval, and one more for a partial interval at each end.
    assert!(
        sweeps as f64 <= elapsed.as_secs_f64() + 2.0,
        "{sweeps} sweeps in {elapsed:?} with a poll interval of 1 s ({named} named passes)"
    );
}

/// The sweep's look ahead (migration 0030): which due time makes the dispatcher sweep again. Jobs due at their commit
/// are left out (the commit's notification names their workspace, which the next pass relays by name), and so are
/// jobs due before the sweep began (they were the sweep's to take): before, every sweep that relayed anything was
/// followed by another while a job committed within the last second was pending, so a steady trickle kept the relay
/// sweeping every workspace instead of relaying the named ones.
#[tokio::test]
async fn the_sweeps_look_ahead_names_only_jobs_that_fall_due_later_and_were_not_due_at_their_commit() {
    let app = TestApp::spawn().await;
    let ws = WorkspaceId(Uuid::new_v4());
    enqueue(&app, ws, 2).await;
    let mut runtime = <sqlx::PgConnection as sqlx::Connection>::connect(&app.db.runtime_url).await.unwrap();
    let after = |ago: &str| format!("SELECT conveyor.conveyor_next_due_after(now() - interval '{ago}')");
    async fn ahead(conn: &mut sqlx::PgConnection, sql: String) -> Option<chrono::DateTime<chrono::Utc>> {
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql)).fetch_one(conn).await.unwrap()
    }
    assert_eq!(ahead(&mut runtime, after("1 hour")).await, None, "jobs due at their commit were notified");
    let old: Option<chrono::DateTime<chrono::Utc>> =
        sqlx::query_scalar("SELECT conveyor.conveyor_next_due_at()").fetch_one(&mut runtime).await.unwrap();
    assert!(old.is_some(), "0008's look ahead, which the previous release's dispatchers call, still names them");

    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
    let payload = VerifyCredentials { store_id: Uuid::now_v7(), credentials_version: 1 };
    let options = EnqueueOptions::new().delay(Duration::from_secs(3600));
    conveyor_jobs::enqueue_tx(&mut tx, &payload, options).await.unwrap();
    tx.commit().await.unwrap();
    let due = ahead(&mut runtime, after("1 hour")).await.expect("the delayed job is named");
    let in_an_hour = chrono::Utc::now() + chrono::Duration::hours(1);
    assert!((due - in_an_hour).num_seconds().abs() < 60, "{due} is the delayed job's due time");
    assert_eq!(ahead(&mut runtime, after("-2 hours")).await, None, "nothing falls due after two hours from now");

    // A job due again later than its commit (a retry backing off, a failed hand-off) is named once it is due after
    // the sweep began, and not when it was due before.
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
    sqlx::query(
        "UPDATE conveyor.outbox_events SET next_attempt_at = created_at + interval '1 second'
         WHERE next_attempt_at < now() + interval '1 minute'",
    )
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let retried = ahead(&mut runtime, after("1 hour")).await.expect("the backed-off jobs are named");
    assert!(retried < due, "the back-off is sooner than the delayed job");
    assert_eq!(
        ahead(&mut runtime, format!("SELECT conveyor.conveyor_next_due_after('{}')", retried.to_rfc3339())).await,
        Some(due)
    );
}

#[tokio::test]
async fn a_commit_wakes_the_dispatcher_long_before_its_poll_and_a_silent_insert_waits_for_the_poll() {
    let app = TestApp::spawn().await;
    let redis = common::redis_url();
    // Whatever is relayed within the test's time came through a notification.
    let shutdown = run_notified_only(&app, &redis, |_| {}).await;

    let ws = WorkspaceId(Uuid::new_v4());
    // An event written without a notification (as by a process that bypassed `enqueue_tx`) waits for the poll.
    let silent = insert_without_notification(&app, ws).await;
    // A committed `enqueue_tx` names its workspace in a notification; the dispatcher relays that workspace, the silent
    // event included, at once.
    let ids = enqueue(&app, ws, 3).await;
    let relayed = common::eventually(Duration::from_secs(20), || async {
        (count_status(&app, &[ws], "dispatched").await == 4).then_some(())
    })
    .await;
    assert!(relayed.is_some(), "the notification woke the dispatcher");
    let mut expected = ids.clone();
    expected.push(silent);
    assert_stream_holds_each_once(&app, &redis, &expected).await;

    // Awake (it relayed a moment ago), the dispatcher ticks: a silent event is found without a notification.
    let other = WorkspaceId(Uuid::new_v4());
    insert_without_notification(&app, other).await;
    let ticked = common::eventually(Duration::from_secs(20), || async {
        (count_status(&app, &[other], "dispatched").await == 1).then_some(())
    })
    .await;
    assert!(ticked.is_some(), "the awake dispatcher's tick relayed the silent event");
    // Asleep after a quiet spell (a second's mark, two seconds' grace), it waits for a notification or the poll.
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let last = WorkspaceId(Uuid::new_v4());
    insert_without_notification(&app, last).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(count_status(&app, &[last], "pending").await, 1, "no notification, no poll yet: still pending");
    shutdown.cancel();
}

/// The dangerous moment of migration 0039: the only awake dispatcher is SIGKILLed with its mark fresh, so the next
/// enqueue notifies nobody. Another dispatcher, asleep (its ticks off, as an older release's), relays the job at its
/// poll: sweeps never depended on notifications, and the dead one's mark lapses within a second.
#[tokio::test]
async fn an_awake_dispatcher_killed_leaves_the_jobs_that_skipped_their_notification_to_the_next_sweep() {
    let app = TestApp::spawn().await;
    let redis = common::redis_url();
    let mut awake_vars = process_vars(&app, &redis);
    awake_vars.insert("CONVEYOR_DISPATCH_POLL".into(), "1h".into());
    let mut awake = Process::spawn(&["dispatcher"], &awake_vars);
    let mut sleeper_vars = process_vars(&app, &redis);
    sleeper_vars.insert("CONVEYOR_DISPATCH_POLL".into(), "1s".into());
    sleeper_vars.insert("CONVEYOR_DISPATCH_TICK".into(), "0".into());
    let mut sleeper = Process::spawn(&["dispatcher"], &sleeper_vars);
    let ws = WorkspaceId(Uuid::new_v4());
    // A job wakes the awake one, which marks itself awake.
    let up = common::eventually(Duration::from_secs(30), || async {
        enqueue(&app, ws, 1).await;
        let marked: Option<bool> =
            sqlx::query_scalar("SELECT until > clock_timestamp() + interval '100 ms' FROM conveyor.dispatchers_awake")
                .fetch_optional(&mut app.db.owner().await)
                .await
                .unwrap();
        marked.filter(|m| *m)
    })
    .await;
    assert!(up.is_some(), "a dispatcher marked itself awake; log:\n{}", awake.log());
    awake.kill();
    let mut listener = sqlx::postgres::PgListener::connect_with(&app.db.pool).await.unwrap();
    listener.listen_all(["conveyor_outbox", "test_marker"]).await.unwrap();
    let skipped = enqueue(&app, ws, 1).await[0];
    sqlx::query("SELECT pg_notify('test_marker', '')").execute(&app.db.pool).await.unwrap();
    let first = tokio::time::timeout(Duration::from_secs(10), listener.recv()).await.unwrap().unwrap();
    assert_eq!(first.channel(), "test_marker", "the dead dispatcher's mark made the enqueue skip its notification");
    let relayed = common::eventually(Duration::from_secs(20), || async {
        let (status,): (String,) = sqlx::query_as("SELECT status FROM conveyor.outbox_events WHERE id = $1")
            .bind(skipped)
            .fetch_one(&mut app.db.owner().await)
            .await
            .unwrap();
        (status == "dispatched").then_some(())
    })
    .await;
    assert!(relayed.is_some(), "the other dispatcher's sweep relayed it; log:\n{}", sleeper.log());
    sleeper.stop().await;
    assert_stream_holds_each_once_of(&app, &redis, skipped).await;
}

/// The stream holds `id` once.
async fn assert_stream_holds_each_once_of(app: &TestApp, redis_url: &str, id: Uuid) {
    let client = common::redis_client(redis_url).await;
    let ids = common::stream_event_ids(&client, &stream_key(app)).await;
    assert_eq!(ids.iter().filter(|i| **i == id.to_string()).count(), 1, "{id} once in {ids:?}");
}

/// Writes a pending event of `workspace` with no notification.
async fn insert_without_notification(app: &TestApp, workspace: WorkspaceId) -> Uuid {
    let id = Uuid::now_v7();
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, workspace).await.unwrap();
    sqlx::query(
        "INSERT INTO conveyor.outbox_events (id, workspace_id, queue, event_type, event_payload)
         VALUES ($1, $2, 'stores', 'store.verify_credentials', '{}')",
    )
    .bind(id)
    .bind(workspace.0)
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    id
}

/// Index entries read so far from `outbox_events`' indexes (`idx_tup_read`), once `claimer`'s statistics are in: its
/// backend is asked to flush them, and does at the end of its next statement.
async fn index_entries_read(owner: &mut sqlx::PgConnection, claimer: &mut sqlx::PgConnection) -> i64 {
    sqlx::query("SELECT pg_stat_force_next_flush()").execute(&mut *claimer).await.unwrap();
    sqlx::query("SELECT 1").execute(&mut *claimer).await.unwrap();
    sqlx::query("SELECT pg_stat_clear_snapshot()").execute(&mut *owner).await.unwrap();
    sqlx::query_scalar("SELECT sum(idx_tup_read)::bigint FROM pg_stat_user_indexes WHERE relname = 'outbox_events'")
        .fetch_one(&mut *owner)
        .await
        .unwrap()
}

/// Migrations 0031 to 0033: a claim walks its workspace's own due jobs in claim order and stops when it has its
/// batch, in every plan the function settles on. Before, its plans walked the outbox-wide index of due jobs (every
/// workspace's), filtering: here 25,085 entries for these 12 claims, about 2,000 a claim, the other workspace's
/// backlog each time (and under a long-held snapshot every row version it keeps too). Now about 40 a claim.
#[tokio::test]
async fn a_claim_reads_its_own_workspaces_due_jobs_and_no_more_than_it_takes() {
    // A server of its own: on the shared one, another test's open transaction holds the cluster-wide horizon back, so
    // the index entries of the rows earlier claims replaced cannot be marked dead, and each claim walks them again.
    let pg = common::postgres::TestPostgres::start().await;
    let app = TestApp::spawn_on_db(pg.test_db().await, |_| {}).await;
    let (busy, quiet) = (WorkspaceId(Uuid::new_v4()), WorkspaceId(Uuid::new_v4()));
    // The other workspace's jobs first: a walk of every workspace's due jobs in due order meets them before busy's.
    for (ws, n) in [(quiet, 2_000), (busy, 3_000)] {
        let jobs: Vec<VerifyCredentials> =
            (0..n).map(|_| VerifyCredentials { store_id: Uuid::now_v7(), credentials_version: 1 }).collect();
        let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
        conveyor_jobs::enqueue_many_tx(&mut tx, jobs.iter().map(|j| (j, EnqueueOptions::new()))).await.unwrap();
        tx.commit().await.unwrap();
    }
    let mut owner = app.db.owner().await;
    sqlx::query("ANALYZE conveyor.outbox_events").execute(&mut owner).await.unwrap();
    // One connection, so that the function's plans are cached and settle (PL/pgSQL turns to a generic plan after
    // five runs) as in a long-running dispatcher's.
    let mut claimer = <sqlx::PgConnection as sqlx::Connection>::connect(&app.db.runtime_url).await.unwrap();
    let claim = "SELECT count(*) FROM conveyor.conveyor_claim_jobs_fair($1, 'me', 30, 10, 0, '{}')";
    let (claims, per_claim) = (12, 10);
    let before = index_entries_read(&mut owner, &mut claimer).await;
    let mut claimed = 0;
    for _ in 0..claims {
        let n: i64 = sqlx::query_scalar(claim).bind(vec![busy.0]).fetch_one(&mut claimer).await.unwrap();
        claimed += n;
    }
    let read = index_entries_read(&mut owner, &mut claimer).await - before;
    assert_eq!(claimed, claims * per_claim, "each claim took its batch");
    // Each claim reads the jobs it takes, the count's one more, and a few entries of each priority level's boundary.
    assert!(
        read <= claims * (3 * per_claim + 20),
        "{claims} claims of {per_claim} read {read} index entries (the backlogs: 2,000 due jobs, then 3,000)"
    );
    assert_eq!(count_status(&app, &[quiet], "pending").await, 2_000, "the other workspace's jobs are untouched");
}
