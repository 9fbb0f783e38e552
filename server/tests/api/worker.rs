//! Workers: end to end through the sandbox marketplace, crashes, retries, dead letters, lost Redis data, shutdown.

use crate::common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::{Process, TestApp, TestRedis, principal};
use conveyor_jobs::Metrics;
use conveyor_jobs::RedisKeys;
use conveyor_jobs::WorkerSettings;
use conveyor_server::auth::Principal;
use conveyor_shop::adapters::sandbox::Settings;
use reqwest::Method;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

async fn create_store(app: &TestApp, who: Principal, api_key: &str) -> (String, String) {
    let body = json!({"name": "Shop", "platform": "sandbox", "credentials": {"api_key": api_key, "api_secret": "s"}});
    let resp = app.send(Method::POST, "/v1/stores", who, Some(&body)).await;
    assert_eq!(resp.status(), 202);
    let v: Value = resp.json().await.unwrap();
    (v["store"]["id"].as_str().unwrap().to_owned(), v["operation"]["id"].as_str().unwrap().to_owned())
}

fn fast() -> WorkerSettings {
    WorkerSettings { concurrency: 8, ..WorkerSettings::default() }
}

fn process_vars(app: &TestApp, redis_url: &str, marketplace: &str) -> HashMap<String, String> {
    let mut vars = common::config_vars(&app.db, &app.redis_prefix);
    vars.insert("CONVEYOR_REDIS_URL".into(), redis_url.to_owned());
    vars.insert("CONVEYOR_ADMIN_ADDR".into(), format!("127.0.0.1:{}", common::free_port()));
    vars.insert("CONVEYOR_MARKETPLACE_URL".into(), marketplace.to_owned());
    vars.insert("CONVEYOR_DISPATCH_POLL".into(), "100ms".into());
    vars
}

#[tokio::test]
async fn a_created_store_is_verified_end_to_end_and_bad_credentials_end_invalid() {
    let app = TestApp::spawn().await;
    let redis = common::redis_url();
    let (sandbox, market) = common::sandbox(Settings::default()).await;
    let shutdown = CancellationToken::new();
    common::run_dispatcher(common::test_dispatcher(&app, &redis, |_| {}).await, &shutdown);
    let worker = common::test_worker(&app, &redis, &market, fast(), 5, Metrics::new()).await;
    tokio::spawn(worker.run(shutdown.clone(), Duration::from_secs(5)));

    let who = principal();
    let (good_store, good_op) = create_store(&app, who, "good-key").await;
    let (bad_store, bad_op) = create_store(&app, who, "invalid-key").await;
    let op =
        common::operation_reaches(&app, who, &good_op, "succeeded", Duration::from_secs(30)).await.expect("verified");
    assert_eq!(op["result"]["outcome"], "active");
    let store: Value =
        app.send(Method::GET, &format!("/v1/stores/{good_store}"), who, None).await.json().await.unwrap();
    assert_eq!(store["status"], "active");
    assert!(store["verified_at"].is_string());
    let op =
        common::operation_reaches(&app, who, &bad_op, "succeeded", Duration::from_secs(30)).await.expect("verified");
    assert_eq!(op["result"]["outcome"], "invalid_credentials");
    let store: Value = app.send(Method::GET, &format!("/v1/stores/{bad_store}"), who, None).await.json().await.unwrap();
    assert_eq!(store["status"], "invalid_credentials");
    assert_eq!(sandbox.stats().effects, 2);
    shutdown.cancel();
}

#[tokio::test]
async fn one_event_delivered_twice_makes_one_marketplace_effect_and_one_success() {
    let app = TestApp::spawn().await;
    let redis = common::redis_url();
    let (sandbox, market) = common::sandbox(Settings { latency_ms: 300, ..Settings::default() }).await;
    let who = principal();
    let (_, op_id) = create_store(&app, who, "good").await;

    // A dispatcher dies after its XADD and before marking; another finishes the hand-off (one stream entry).
    let mut vars = process_vars(&app, &redis, &market);
    vars.insert("CONVEYOR_DISPATCH_LEASE".into(), "1s".into());
    let mut crashing = vars.clone();
    crashing.insert("FAILPOINTS".into(), "dispatcher::after_xadd=sleep(60000)".into());
    let mut first = Process::spawn(&["dispatcher"], &crashing);
    let client = common::redis_client(&redis).await;
    let stream = RedisKeys::new(&app.redis_prefix).stream("stores");
    common::eventually(Duration::from_secs(20), || async {
        (common::stream_event_ids(&client, &stream).await.len() == 1).then_some(())
    })
    .await
    .expect("XADDed");
    first.kill();
    let shutdown = CancellationToken::new();
    common::run_dispatcher(
        common::test_dispatcher(&app, &redis, |v| {
            v.insert("CONVEYOR_DISPATCH_LEASE".into(), "1s".into());
        })
        .await,
        &shutdown,
    );

    // The same entry copied, as if delivered twice at once; plus a late third copy once the job has ended.
    let entries: Vec<(String, HashMap<String, String>)> = {
        use fred::prelude::StreamsInterface;
        client.xrange(&stream, "-", "+", None).await.unwrap()
    };
    let fields: Vec<(String, String)> = entries[0].1.clone().into_iter().collect();
    {
        use fred::prelude::StreamsInterface;
        let _: String = client.xadd(&stream, false, None, "*", fields).await.unwrap();
    }
    let worker = common::test_worker(&app, &redis, &market, fast(), 5, Metrics::new()).await;
    let worker_metrics = Metrics::new();
    let second_worker = common::test_worker(&app, &redis, &market, fast(), 5, worker_metrics.clone()).await;
    tokio::spawn(worker.run(shutdown.clone(), Duration::from_secs(5)));
    tokio::spawn(second_worker.run(shutdown.clone(), Duration::from_secs(5)));
    common::operation_reaches(&app, who, &op_id, "succeeded", Duration::from_secs(30)).await.expect("succeeded");

    common::eventually(Duration::from_secs(20), || async {
        (app.db.rows("outbox_events", who.workspace_id).await[0]["status"] == "completed").then_some(())
    })
    .await
    .expect("the job's end was recorded on its event");
    // A late third delivery of the same entry, after the job ended: skipped before it runs.
    {
        use fred::prelude::StreamsInterface;
        let fields: Vec<(String, String)> = entries[0].1.clone().into_iter().collect();
        let _: String = client.xadd(&stream, false, None, "*", fields).await.unwrap();
    }
    common::eventually(Duration::from_secs(20), || async {
        (common::stream_event_ids(&client, &stream).await.is_empty()).then_some(())
    })
    .await
    .expect("every delivery consumed");

    let stats = sandbox.stats();
    assert_eq!(stats.effects, 1, "one marketplace effect");
    assert_eq!(stats.calls_by_key.get(&op_id), Some(&1), "one marketplace call: the repeats were skipped");
    let op = common::operation(&app, who, &op_id).await;
    assert_eq!(op["status"], "succeeded");
    shutdown.cancel();
}

#[tokio::test]
async fn a_worker_killed_mid_job_is_replaced_and_a_live_long_job_is_not_stolen() {
    let app = TestApp::spawn().await;
    let redis = common::redis_url();
    let (sandbox, market) = common::sandbox(Settings { latency_ms: 3000, ..Settings::default() }).await;
    let shutdown = CancellationToken::new();
    common::run_dispatcher(common::test_dispatcher(&app, &redis, |_| {}).await, &shutdown);
    let who = principal();
    let (_, op_id) = create_store(&app, who, "good").await;

    // Default settings: a dead worker's job runs again within the visibility time-out plus a reclaim interval.
    let mut victim = Process::spawn(&["worker"], &process_vars(&app, &redis, &market));
    common::operation_reaches(&app, who, &op_id, "running", Duration::from_secs(30)).await.expect("running");
    victim.kill();
    let killed_at = Instant::now();
    let rescuer = Process::spawn(&["worker"], &process_vars(&app, &redis, &market));
    let done = common::operation_reaches(&app, who, &op_id, "succeeded", Duration::from_secs(30)).await;
    assert!(done.is_some(), "another worker completed it; log:\n{}", rescuer.log());
    eprintln!("killed worker's job completed {:?} after the kill (job itself takes 3 s)", killed_at.elapsed());
    assert!(rescuer.log().contains("Took over entries idle past the visibility time-out"));
    assert_eq!(sandbox.stats().effects, 1);
    drop(rescuer);

    // A job longer than the visibility time-out, on a live worker, is not taken by another one.
    sandbox.set(Settings { latency_ms: 5000, ..Settings::default() });
    let settings = WorkerSettings { visibility: Duration::from_millis(2500), ..fast() };
    let (m1, m2) = (Metrics::new(), Metrics::new());
    let w1 = common::test_worker(&app, &redis, &market, settings.clone(), 5, m1.clone()).await;
    tokio::spawn(w1.run(shutdown.clone(), Duration::from_secs(10)));
    let (_, long_op) = create_store(&app, who, "good").await;
    common::operation_reaches(&app, who, &long_op, "running", Duration::from_secs(30)).await.expect("running");
    let w2 = common::test_worker(&app, &redis, &market, settings, 5, m2.clone()).await;
    tokio::spawn(w2.run(shutdown.clone(), Duration::from_secs(10)));
    common::operation_reaches(&app, who, &long_op, "succeeded", Duration::from_secs(30)).await.expect("succeeded");
    assert_eq!(sandbox.stats().calls_by_key.get(&long_op), Some(&1), "run once");
    assert_eq!(m2.worker_reclaims.with_label_values(&["stores"]).get(), 0, "nothing taken from the live worker");
    shutdown.cancel();
}

#[tokio::test]
async fn a_failing_job_backs_off_then_dead_letters_and_replays_once_fixed() {
    let app = TestApp::spawn().await;
    let redis = common::redis_url();
    let (sandbox, market) = common::sandbox(Settings { error_rate: 1.0, ..Settings::default() }).await;
    let shutdown = CancellationToken::new();
    common::run_dispatcher(
        common::test_dispatcher(&app, &redis, |v| {
            v.insert("CONVEYOR_DISPATCH_POLL".into(), "100ms".into());
        })
        .await,
        &shutdown,
    );
    let metrics = Metrics::new();
    tokio::spawn(
        common::test_worker(&app, &redis, &market, fast(), 3, metrics.clone())
            .await
            .run(shutdown.clone(), Duration::from_secs(5)),
    );
    let who = principal();
    let (_, op_id) = create_store(&app, who, "good").await;

    let failed =
        common::operation_reaches(&app, who, &op_id, "failed", Duration::from_secs(60)).await.expect("dead-lettered");
    assert_eq!(sandbox.stats().calls, 3, "three runs, then no more");
    let error = failed["error"].as_str().unwrap();
    assert!(error.contains("503"), "{error}");
    assert_eq!(metrics.job_retries.with_label_values(&["store.verify_credentials"]).get(), 2);
    let event = &app.db.rows("outbox_events", who.workspace_id).await[0];
    assert_eq!(
        (event["status"].as_str(), event["failure_stage"].as_str(), &event["job_attempts"]),
        (Some("dead_letter"), Some("job"), &json!(3))
    );

    // The operator's view, through the real binary.
    let vars = process_vars(&app, &redis, &market);
    let dlq = |args: &[&str]| {
        std::process::Command::new(common::conveyor_bin()).args(args).env_clear().envs(&vars).output().unwrap()
    };
    let listed = dlq(&["dlq", "list"]);
    assert!(listed.status.success(), "{}", String::from_utf8_lossy(&listed.stderr));
    let line = String::from_utf8(listed.stdout).unwrap();
    let dead: Value = serde_json::from_str(line.lines().next().expect("one dead letter")).unwrap();
    assert_eq!(dead["operation_id"], op_id.as_str());
    assert_eq!(dead["attempts"], 3);
    assert!(!line.contains("api_key") && !line.contains("good"), "no payload or credential: {line}");
    let id = dead["id"].as_str().unwrap();
    assert!(dlq(&["dlq", "show", id]).status.success());

    sandbox.set(Settings::default());
    let replayed = dlq(&["dlq", "replay", id]);
    assert!(replayed.status.success(), "{}", String::from_utf8_lossy(&replayed.stderr));
    let op =
        common::operation_reaches(&app, who, &op_id, "succeeded", Duration::from_secs(30)).await.expect("replayed");
    assert_eq!(op["result"]["outcome"], "active");
    assert!(!dlq(&["dlq", "replay", id]).status.success(), "no longer a dead letter");
    shutdown.cancel();
}

#[tokio::test]
async fn an_undecodable_payload_is_dead_lettered_at_once_and_the_worker_keeps_serving() {
    let app = TestApp::spawn().await;
    let redis = common::redis_url();
    let (_sandbox, market) = common::sandbox(Settings::default()).await;
    let who = principal();
    // A malformed event, as a buggy producer might write it, committed beside a good one.
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, who.workspace_id).await.unwrap();
    sqlx::query(
        "INSERT INTO conveyor.outbox_events (id, workspace_id, queue, event_type, event_payload)
         VALUES ($1, $2, 'stores', 'store.verify_credentials', '{\"store_id\": 42}')",
    )
    .bind(Uuid::now_v7())
    .bind(who.workspace_id.0)
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let shutdown = CancellationToken::new();
    common::run_dispatcher(common::test_dispatcher(&app, &redis, |_| {}).await, &shutdown);
    let metrics = Metrics::new();
    let worker = common::test_worker(&app, &redis, &market, fast(), 5, metrics.clone()).await;
    worker.ensure_groups().await.unwrap();
    // And an entry that is no Conveyor job at all.
    let client = common::redis_client(&redis).await;
    {
        use fred::prelude::StreamsInterface;
        let _: String = client
            .xadd(RedisKeys::new(&app.redis_prefix).stream("stores"), false, None, "*", vec![("junk", "1")])
            .await
            .unwrap();
    }
    tokio::spawn(worker.run(shutdown.clone(), Duration::from_secs(5)));
    common::eventually(Duration::from_secs(20), || async {
        let events = app.db.rows("outbox_events", who.workspace_id).await;
        (events.iter().any(|e| e["status"] == "dead_letter")).then_some(())
    })
    .await
    .expect("dead-lettered");
    let events = app.db.rows("outbox_events", who.workspace_id).await;
    let dead = events.iter().find(|e| e["status"] == "dead_letter").unwrap();
    assert_eq!(dead["job_attempts"], 1, "at once, without retries");
    assert!(dead["last_error"].as_str().unwrap().contains("undecodable"));
    let (_, op_id) = create_store(&app, who, "good").await;
    common::operation_reaches(&app, who, &op_id, "succeeded", Duration::from_secs(30)).await.expect("still serving");
    assert_eq!(metrics.jobs.with_label_values(&["stores", "unknown", "malformed"]).get(), 1);
    shutdown.cancel();
}

#[tokio::test]
async fn work_in_flight_survives_a_redis_that_loses_everything() {
    let app = TestApp::spawn().await;
    let mut redis = TestRedis::start(None).await;
    let (sandbox, market) = common::sandbox(Settings { latency_ms: 1500, ..Settings::default() }).await;
    let mut vars = process_vars(&app, &redis.url(), &market);
    vars.insert("CONVEYOR_RECONCILE_AFTER".into(), "3s".into());
    vars.insert("CONVEYOR_OPERATION_KEEPALIVE".into(), "1s".into());
    vars.insert("CONVEYOR_MAINTENANCE_INTERVAL".into(), "500ms".into());
    vars.insert("CONVEYOR_REDIS_COMMAND_TIMEOUT".into(), "1s".into());
    let platform = Process::spawn(&["all"], &{
        let mut v = vars.clone();
        v.insert("CONVEYOR_HTTP_ADDR".into(), format!("127.0.0.1:{}", common::free_port()));
        v
    });
    let who = principal();
    let mut ops = Vec::new();
    for _ in 0..5 {
        ops.push(create_store(&app, who, "good").await.1);
    }
    common::operation_reaches(&app, who, &ops[0], "running", Duration::from_secs(30)).await.expect("work in flight");
    // Redis restarts empty: streams, groups, pending entries and de-dup keys are gone.
    redis.stop();
    redis.start_again().await;
    for op in &ops {
        let done = common::operation_reaches(&app, who, op, "succeeded", Duration::from_secs(60)).await;
        assert!(done.is_some(), "operation {op} completed; log:\n{}", platform.log());
    }
    let stats = sandbox.stats();
    assert_eq!(stats.effects, 5, "one effect per operation");
    for op in &ops {
        assert_eq!(stats.calls_by_key.get(op).copied().unwrap_or(0).min(1), 1);
    }
}

#[tokio::test]
async fn a_job_running_longer_than_the_reconcilers_wait_keeps_its_operation_alive_and_is_not_redriven() {
    let app = TestApp::spawn().await;
    let redis = common::redis_url();
    // The marketplace takes 5 s; the reconciler re-drives operations quiet for 2 s, looking every 300 ms.
    let (sandbox, market) = common::sandbox(Settings { latency_ms: 5000, ..Settings::default() }).await;
    let mut vars = process_vars(&app, &redis, &market);
    vars.insert("CONVEYOR_RECONCILE_AFTER".into(), "2s".into());
    vars.insert("CONVEYOR_OPERATION_KEEPALIVE".into(), "500ms".into());
    vars.insert("CONVEYOR_MAINTENANCE_INTERVAL".into(), "300ms".into());
    vars.insert("CONVEYOR_HTTP_ADDR".into(), format!("127.0.0.1:{}", common::free_port()));
    let platform = Process::spawn(&["all"], &vars);
    let who = principal();
    let (_, op) = create_store(&app, who, "good").await;
    let done = common::operation_reaches(&app, who, &op, "succeeded", Duration::from_secs(60)).await;
    assert!(done.is_some(), "the long job completes; log:\n{}", platform.log());
    let events = app.db.rows("outbox_events", who.workspace_id).await;
    assert_eq!(events.len(), 1);
    assert_eq!(events[0]["redrive_count"], 0, "never re-driven while it ran; log:\n{}", platform.log());
    assert_eq!(sandbox.stats().effects, 1);
}

#[tokio::test]
async fn sigterm_lets_jobs_in_flight_finish_and_acknowledge_then_exits_zero() {
    let app = TestApp::spawn().await;
    let redis = common::redis_url();
    let (_sandbox, market) = common::sandbox(Settings { latency_ms: 1500, ..Settings::default() }).await;
    let shutdown = CancellationToken::new();
    common::run_dispatcher(common::test_dispatcher(&app, &redis, |_| {}).await, &shutdown);
    let who = principal();
    let mut ops = Vec::new();
    for _ in 0..3 {
        ops.push(create_store(&app, who, "good").await.1);
    }
    let mut worker = Process::spawn(&["worker"], &process_vars(&app, &redis, &market));
    for op in &ops {
        common::operation_reaches(&app, who, op, "running", Duration::from_secs(30)).await.expect("in flight");
    }
    worker.signal(15);
    let (status, worker) = tokio::task::spawn_blocking(move || (worker.child.wait().unwrap(), worker)).await.unwrap();
    assert!(status.success(), "exit 0; log:\n{}", worker.log());
    for op in &ops {
        assert_eq!(common::operation(&app, who, op).await["status"], "succeeded", "finished within the grace period");
    }
    let client = common::redis_client(&redis).await;
    let stream = RedisKeys::new(&app.redis_prefix).stream("stores");
    assert!(common::stream_event_ids(&client, &stream).await.is_empty(), "acknowledged (and removed)");
    shutdown.cancel();
}

#[tokio::test]
async fn the_stream_stays_bounded_however_many_jobs_run() {
    let app = TestApp::spawn().await;
    let redis = common::redis_url();
    let (_sandbox, market) = common::sandbox(Settings::default()).await;
    let shutdown = CancellationToken::new();
    common::run_dispatcher(common::test_dispatcher(&app, &redis, |_| {}).await, &shutdown);
    let worker =
        common::test_worker(&app, &redis, &market, WorkerSettings { concurrency: 32, ..fast() }, 5, Metrics::new())
            .await;
    tokio::spawn(worker.run(shutdown.clone(), Duration::from_secs(5)));
    let client = common::redis_client(&redis).await;
    let stream = RedisKeys::new(&app.redis_prefix).stream("stores");
    let who = principal();
    let mut longest = 0;
    for round in 0..4 {
        let mut ops = Vec::new();
        for _ in 0..25 {
            ops.push(create_store(&app, who, "good").await.1);
        }
        for op in &ops {
            common::operation_reaches(&app, who, op, "succeeded", Duration::from_secs(30)).await.expect("done");
        }
        let len: u64 = {
            use fred::prelude::StreamsInterface;
            client.xlen(&stream).await.unwrap()
        };
        longest = longest.max(len);
        assert_eq!(len, 0, "round {round}: processed entries do not stay in the stream");
    }
    assert_eq!(longest, 0);
    shutdown.cancel();
}

#[tokio::test]
async fn a_worker_killed_after_its_commit_and_before_its_ack_causes_no_second_effect() {
    let app = TestApp::spawn().await;
    let redis = common::redis_url();
    let (sandbox, market) = common::sandbox(Settings::default()).await;
    let shutdown = CancellationToken::new();
    common::run_dispatcher(common::test_dispatcher(&app, &redis, |_| {}).await, &shutdown);
    let who = principal();
    let (_, op_id) = create_store(&app, who, "good").await;
    let mut vars = process_vars(&app, &redis, &market);
    vars.insert("FAILPOINTS".into(), "worker::before_ack=sleep(60000)".into());
    let mut victim = Process::spawn(&["worker"], &vars);
    common::operation_reaches(&app, who, &op_id, "succeeded", Duration::from_secs(30)).await.expect("committed");
    victim.kill();
    let metrics = Metrics::new();
    let settings = WorkerSettings { visibility: Duration::from_secs(1), ..fast() };
    tokio::spawn(
        common::test_worker(&app, &redis, &market, settings, 5, metrics.clone())
            .await
            .run(shutdown.clone(), Duration::from_secs(5)),
    );
    let client = common::redis_client(&redis).await;
    let stream = RedisKeys::new(&app.redis_prefix).stream("stores");
    common::eventually(Duration::from_secs(30), || async {
        common::stream_event_ids(&client, &stream).await.is_empty().then_some(())
    })
    .await
    .expect("the unacknowledged entry was taken over and acknowledged");
    assert_eq!(
        metrics.jobs.with_label_values(&["stores", "store.verify_credentials", "skipped"]).get(),
        1,
        "the repeat was skipped"
    );
    assert_eq!(sandbox.stats().calls, 1, "one marketplace call in all");
    shutdown.cancel();
}

#[tokio::test]
async fn a_job_that_fails_before_its_dispatcher_has_recorded_the_hand_off_is_still_retried() {
    let app = TestApp::spawn().await;
    let redis = common::redis_url();
    let (sandbox, market) = common::sandbox(Settings { error_rate: 1.0, ..Settings::default() }).await;
    // A dispatcher process that records every hand-off a second and a half after its XADD: each run fails (and
    // asks for its retry) while the event is still `dispatching`.
    let mut vars = process_vars(&app, &redis, &market);
    vars.insert("FAILPOINTS".into(), "dispatcher::before_mark=sleep(1500)".into());
    let _dispatcher = Process::spawn(&["dispatcher"], &vars);
    let metrics = Metrics::new();
    let shutdown = CancellationToken::new();
    tokio::spawn(
        common::test_worker(&app, &redis, &market, fast(), 3, metrics.clone())
            .await
            .run(shutdown.clone(), Duration::from_secs(5)),
    );
    let who = principal();
    let (_, op_id) = create_store(&app, who, "good").await;

    let failed = common::operation_reaches(&app, who, &op_id, "failed", Duration::from_secs(60)).await;
    assert!(failed.is_some(), "every run was retried until the last, then dead-lettered");
    assert_eq!(sandbox.stats().calls, 3, "three runs");
    assert_eq!(metrics.job_retries.with_label_values(&["store.verify_credentials"]).get(), 2);
    let event = &app.db.rows("outbox_events", who.workspace_id).await[0];
    assert_eq!((event["status"].as_str(), &event["job_attempts"]), (Some("dead_letter"), &json!(3)));
    shutdown.cancel();
}

#[tokio::test]
async fn a_stale_delivery_does_not_dead_letter_the_newer_generation_of_its_event() {
    let app = TestApp::spawn().await;
    let redis = common::redis_url();
    let (_sandbox, market) = common::sandbox(Settings::default()).await;
    let who = principal();
    // An event already re-driven once (generation 1, waiting out a back-off), and a leftover entry of its
    // generation 0 whose payload cannot be decoded: what the worker decides about the old entry must not touch
    // the new generation.
    let id = Uuid::now_v7();
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, who.workspace_id).await.unwrap();
    sqlx::query(
        "INSERT INTO conveyor.outbox_events (id, workspace_id, queue, event_type, event_payload, redrive_count, next_attempt_at)
         VALUES ($1, $2, 'stores', 'store.verify_credentials', '{\"store_id\": 42}', 1, now() + interval '1 hour')",
    )
    .bind(id)
    .bind(who.workspace_id.0)
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let metrics = Metrics::new();
    let worker = common::test_worker(&app, &redis, &market, fast(), 5, metrics.clone()).await;
    worker.ensure_groups().await.unwrap();
    let client = common::redis_client(&redis).await;
    let stream = RedisKeys::new(&app.redis_prefix).stream("stores");
    add_undecodable_entry(&client, &stream, id, who.workspace_id, None).await;
    let shutdown = CancellationToken::new();
    tokio::spawn(worker.run(shutdown.clone(), Duration::from_secs(5)));
    common::eventually(Duration::from_secs(20), || async {
        common::stream_event_ids(&client, &stream).await.is_empty().then_some(())
    })
    .await
    .expect("the stale entry was settled and acknowledged");
    assert_eq!(metrics.jobs.with_label_values(&["stores", "store.verify_credentials", "skipped"]).get(), 1);
    let event = &app.db.rows("outbox_events", who.workspace_id).await[0];
    assert_eq!(
        (event["status"].as_str(), &event["redrive_count"], &event["job_attempts"]),
        (Some("pending"), &json!(1), &json!(0)),
        "the newer generation is untouched"
    );
    shutdown.cancel();
}

/// Adds to `stream` a generation-0 job entry for `event` whose payload cannot be decoded.
async fn add_undecodable_entry(
    client: &conveyor_jobs::RedisClient,
    stream: &str,
    event: Uuid,
    workspace: conveyor_jobs::WorkspaceId,
    operation: Option<&str>,
) {
    use fred::prelude::StreamsInterface;
    let (event, workspace) = (event.to_string(), workspace.0.to_string());
    let mut fields = vec![
        ("event_id", event.as_str()),
        ("workspace_id", workspace.as_str()),
        ("type", "store.verify_credentials"),
        ("payload", "{\"store_id\": 42}"),
        ("attempt", "1"),
        ("redrive", "0"),
    ];
    fields.extend(operation.map(|o| ("operation_id", o)));
    let _: String = client.xadd(stream, false, None, "*", fields).await.unwrap();
}

#[tokio::test]
async fn after_sigterm_a_worker_starts_no_job_it_read_beyond_its_free_slots() {
    let app = TestApp::spawn().await;
    let redis = common::redis_url();
    let (sandbox, market) = common::sandbox(Settings { latency_ms: 3000, ..Settings::default() }).await;
    let shutdown = CancellationToken::new();
    common::run_dispatcher(common::test_dispatcher(&app, &redis, |_| {}).await, &shutdown);
    let who = principal();
    let mut ops = Vec::new();
    for _ in 0..4 {
        ops.push(create_store(&app, who, "good").await.1);
    }
    // One slot, and a read that returns three entries more than there are free slots: they wait for the slot.
    let mut vars = process_vars(&app, &redis, &market);
    vars.insert("CONVEYOR_WORKER_CONCURRENCY".into(), "1".into());
    vars.insert("CONVEYOR_SHUTDOWN_GRACE".into(), "8s".into());
    vars.insert("FAILPOINTS".into(), "worker::read_beyond_free_slots=return(3)".into());
    let client = common::redis_client(&redis).await;
    let stream = RedisKeys::new(&app.redis_prefix).stream("stores");
    common::eventually(Duration::from_secs(20), || async {
        (common::stream_event_ids(&client, &stream).await.len() == 4).then_some(())
    })
    .await
    .expect("all four handed off before the worker reads");
    let mut worker = Process::spawn(&["worker"], &vars);
    // SIGTERM while the first job waits for the marketplace (3 s), the three others for its slot.
    common::eventually(Duration::from_secs(20), || async {
        for op in &ops {
            if common::operation(&app, who, op).await["status"] == "running" {
                return Some(());
            }
        }
        None
    })
    .await
    .expect("the first job is in flight");
    worker.signal(15);
    let (status, worker) = tokio::task::spawn_blocking(move || (worker.child.wait().unwrap(), worker)).await.unwrap();
    assert!(status.success(), "exit 0; log:\n{}", worker.log());
    // The job in flight finished; none of the three waiting for the slot started after the signal.
    assert_eq!(sandbox.stats().calls, 1, "no job started after SIGTERM; log:\n{}", worker.log());
    let succeeded = {
        let mut n = 0;
        for op in &ops {
            n += usize::from(common::operation(&app, who, op).await["status"] == "succeeded");
        }
        n
    };
    assert_eq!(succeeded, 1);
    // Nothing is lost: another worker takes the three over after the visibility time-out.
    let other = common::test_worker(&app, &redis, &market, fast(), 5, Metrics::new()).await;
    tokio::spawn(other.run(shutdown.clone(), Duration::from_secs(5)));
    for op in &ops {
        common::operation_reaches(&app, who, op, "succeeded", Duration::from_secs(40)).await.expect("taken over");
    }
    assert_eq!(sandbox.stats().effects, 4);
    shutdown.cancel();
}

/// The id of the job of operation `op`, read as the owner.
async fn job_of_operation(app: &TestApp, op: &str) -> Uuid {
    let mut owner = app.db.owner().await;
    sqlx::query_scalar("SELECT id FROM conveyor.outbox_events WHERE operation_id = $1::uuid")
        .bind(op)
        .fetch_one(&mut owner)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_job_that_kills_its_worker_is_dead_lettered_after_five_deaths_while_the_queue_goes_on() {
    let app = TestApp::spawn().await;
    let redis = common::redis_url();
    // The other jobs take longer than the poison job takes to kill its worker: they die with it, in flight.
    let (sandbox, market) = common::sandbox(Settings { latency_ms: 1000, ..Settings::default() }).await;
    let shutdown = CancellationToken::new();
    common::run_dispatcher(common::test_dispatcher(&app, &redis, |_| {}).await, &shutdown);
    let who = principal();
    let (_, poison_op) = create_store(&app, who, "poison").await;
    let poison = job_of_operation(&app, &poison_op).await;
    let mut good = Vec::new();
    for i in 0..6 {
        good.push(create_store(&app, who, &format!("good-{i}")).await.1);
    }

    // The worker process aborts 0.3 s into the poison job, as one the kernel kills for its memory would; a supervisor
    // starts it again each time, as Kubernetes restarts a pod.
    let mut vars = process_vars(&app, &redis, &market);
    vars.insert("CONVEYOR_WORKER_VISIBILITY".into(), "1s".into());
    vars.insert("FAILPOINTS".into(), format!("worker::abort_on_job=return({poison})"));
    let mut worker = Process::spawn(&["worker"], &vars);
    let mut deaths = 0;
    let mut logs = String::new();
    let ended = common::eventually(Duration::from_secs(120), || {
        if worker.child.try_wait().ok().flatten().is_some() {
            deaths += 1;
            logs.push_str(&worker.log());
            worker = Process::spawn(&["worker"], &vars);
        }
        let (app, poison_op, good) = (&app, &poison_op, &good);
        async move {
            let failed = common::operation(app, who, poison_op).await;
            if failed["status"] != "failed" {
                return None;
            }
            for op in good {
                if common::operation(app, who, op).await["status"] != "succeeded" {
                    return None;
                }
            }
            Some(failed)
        }
    })
    .await;
    let failed = ended.unwrap_or_else(|| panic!("the poison job ended and the others succeeded; logs:\n{logs}"));
    assert_eq!(deaths, 5, "the worker died CONVEYOR_WORKER_MAX_DELIVERIES (5) times, no more; logs:\n{logs}");
    let reason = "its worker stopped 5 times while running it";
    assert_eq!(failed["error"], reason, "{failed}");
    let mut owner = app.db.owner().await;
    let (status, stops, error): (String, i32, String) =
        sqlx::query_as("SELECT status, stops, last_error FROM conveyor.outbox_events WHERE id = $1")
            .bind(poison)
            .fetch_one(&mut owner)
            .await
            .unwrap();
    assert_eq!((status.as_str(), stops, error.as_str()), ("dead_letter", 5, reason));
    // The other jobs of the queue went on (a job that has stopped a worker after a take-over runs alone, so none died
    // with the poison job more than twice): each succeeded, with one marketplace effect.
    let stats = sandbox.stats();
    for op in &good {
        assert!(stats.calls_by_key.contains_key(op), "{op} reached the marketplace");
        let stops: i32 = sqlx::query_scalar("SELECT stops FROM conveyor.outbox_events WHERE operation_id = $1::uuid")
            .bind(op)
            .fetch_one(&mut owner)
            .await
            .unwrap();
        assert!(stops <= 2, "{op} stopped with its worker {stops} times");
    }
    assert_eq!(stats.effects as usize, stats.calls_by_key.len(), "one effect per job, however many calls");
    // Shown as such to operators: `conveyor dlq` lists it with its reason. The worker that dead-lettered it lives.
    let out = std::process::Command::new(common::conveyor_bin())
        .args(["dlq", "list", "--queue", "stores"])
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .envs(common::config_vars(&app.db, &app.redis_prefix))
        .output()
        .unwrap();
    let listed = String::from_utf8_lossy(&out.stdout);
    assert!(listed.contains(&poison.to_string()) && listed.contains(reason), "{listed}");
    assert!(worker.child.try_wait().unwrap().is_none(), "the last worker runs on");
    assert!(worker.log().contains("dead-lettered"), "{}", worker.log());
    shutdown.cancel();
}
