//! Repeatable jobs: schedules fire once per tick across dispatchers, catch up once after downtime, pause and resume,
//! refuse bad input without writing, and stay within their workspace. Real PostgreSQL and Redis.

use crate::common;

use std::collections::HashMap;
use std::time::Duration;

use common::{TestApp, config_vars, conveyor_bin, eventually, principal, redis_url, run_dispatcher, test_dispatcher};
use conveyor_jobs::fire_due_schedules;
use conveyor_jobs::{JobKind, ScheduleError, ScheduleOptions, ScheduleSpec, WorkspaceId};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

#[derive(Serialize, Deserialize)]
struct Ping {
    target: String,
}

impl JobKind for Ping {
    const KIND: &'static str = "test.ping";
    const QUEUE: &'static str = "pings";
}

fn ping() -> Ping {
    Ping { target: "example".to_owned() }
}

async fn set(app: &TestApp, ws: WorkspaceId, name: &str, spec: ScheduleSpec, options: ScheduleOptions) {
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
    conveyor_jobs::upsert_schedule_tx(&mut tx, name, &ping(), spec, options).await.unwrap();
    tx.commit().await.unwrap();
}

/// Runs `sql` (which may bind `$1`, the schedule name) in the workspace, as the application role under RLS.
async fn exec(app: &TestApp, ws: WorkspaceId, sql: &'static str, name: &str) {
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
    sqlx::query(sql).bind(name).execute(&mut *tx).await.unwrap();
    tx.commit().await.unwrap();
}

/// The workspace's fired ticks (ms since the epoch) with their job ids, and its outbox rows enqueued by schedules
/// (de-duplication key and id), read in one statement (one snapshot).
async fn runs_and_jobs(app: &TestApp, ws: WorkspaceId) -> (Vec<(i64, Uuid)>, Vec<(String, Uuid)>) {
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
    let (runs, jobs): (serde_json::Value, serde_json::Value) = sqlx::query_as(
        "SELECT (SELECT coalesce(jsonb_agg(jsonb_build_array(floor(extract(epoch FROM tick_at) * 1000)::int8, job_id)
                                           ORDER BY tick_at), '[]')
                 FROM conveyor.job_schedule_runs),
                (SELECT coalesce(jsonb_agg(jsonb_build_array(dedup_key, id) ORDER BY id), '[]')
                 FROM conveyor.outbox_events WHERE dedup_key LIKE 'schedule:%')",
    )
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    (serde_json::from_value(runs).unwrap(), serde_json::from_value(jobs).unwrap())
}

#[tokio::test]
async fn three_dispatchers_fire_an_every_second_schedule_once_per_tick() {
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    let shutdown = CancellationToken::new();
    for _ in 0..3 {
        run_dispatcher(test_dispatcher(&app, &redis_url(), |_| {}).await, &shutdown);
    }
    set(&app, ws, "heartbeat", ScheduleSpec::every(Duration::from_secs(1)).unwrap(), ScheduleOptions::new()).await;
    let schedule_id: Uuid = {
        let rows = conveyor_jobs::list_schedules(&app.db.pool, ws).await.unwrap();
        rows[0].id
    };
    let fired = eventually(Duration::from_secs(30), || async {
        let (runs, _) = runs_and_jobs(&app, ws).await;
        (runs.len() >= 6).then_some(())
    })
    .await;
    assert!(fired.is_some(), "six ticks fired within 30 s");
    // The dispatchers relay what the schedule enqueued, like any job.
    let relayed = eventually(Duration::from_secs(10), || async {
        let n = app.db.rows("outbox_events", ws).await.iter().filter(|e| e["status"] == "dispatched").count();
        (n > 0).then_some(())
    })
    .await;
    assert!(relayed.is_some(), "the scheduled jobs are relayed to the stream");
    shutdown.cancel();

    // Whatever the moment: one run row and one job per tick, the same job, no tick twice.
    let (runs, jobs) = runs_and_jobs(&app, ws).await;
    assert_eq!(runs.len(), jobs.len(), "one job per fired tick: {runs:?} / {jobs:?}");
    let jobs: HashMap<String, Uuid> = jobs.into_iter().collect();
    let first = runs[0].0;
    for (tick, job) in &runs {
        assert_eq!(jobs.get(&format!("schedule:{schedule_id}:{tick}")), Some(job), "tick {tick} has its one job");
        assert_eq!((tick - first) % 1000, 0, "ticks are whole periods after the first");
    }
    let mut ticks: Vec<i64> = runs.iter().map(|(t, _)| *t).collect();
    ticks.dedup();
    assert_eq!(ticks.len(), runs.len(), "no tick fired twice");
    let skipped = (runs.last().unwrap().0 - first) / 1000 + 1 - runs.len() as i64;
    eprintln!("{} ticks fired by three dispatchers, {skipped} skipped (caught up late)", runs.len());
}

#[tokio::test]
async fn many_concurrent_passes_over_one_due_tick_fire_it_once() {
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    set(&app, ws, "race", ScheduleSpec::every(Duration::from_secs(60)).unwrap(), ScheduleOptions::new()).await;
    for round in 0..5 {
        exec(
            &app,
            ws,
            "UPDATE conveyor.job_schedules SET next_run_at = now() - interval '1 second' WHERE name = $1",
            "race",
        )
        .await;
        let passes: Vec<_> = (0..8)
            .map(|_| {
                let pool = app.db.runtime_pool.clone();
                tokio::spawn(async move { fire_due_schedules(&pool).await.unwrap().fired })
            })
            .collect();
        let mut fired = 0;
        for pass in passes {
            fired += pass.await.unwrap();
        }
        assert_eq!(fired, 1, "round {round}: eight passes at once fire the due tick once");
    }
    let (runs, jobs) = runs_and_jobs(&app, ws).await;
    assert_eq!((runs.len(), jobs.len()), (5, 5));
}

#[tokio::test]
async fn after_downtime_a_schedule_fires_once_for_the_latest_missed_tick_then_goes_on() {
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    set(&app, ws, "minutely", ScheduleSpec::every(Duration::from_secs(60)).unwrap(), ScheduleOptions::new()).await;
    // Down for five and a half periods: ticks at -330 s, -270 s, ..., -30 s were all missed.
    exec(
        &app,
        ws,
        "UPDATE conveyor.job_schedules SET next_run_at = date_trunc('second', now()) - interval '330 seconds' WHERE name = $1",
        "minutely",
    )
    .await;
    let stored: chrono::DateTime<chrono::Utc> = {
        let rows = conveyor_jobs::list_schedules(&app.db.pool, ws).await.unwrap();
        rows[0].next_run_at
    };
    assert_eq!(fire_due_schedules(&app.db.runtime_pool).await.unwrap().fired, 1, "one job for all the missed ticks");
    assert_eq!(
        fire_due_schedules(&app.db.runtime_pool).await.unwrap().fired,
        0,
        "and nothing more until the next tick"
    );
    let (runs, jobs) = runs_and_jobs(&app, ws).await;
    assert_eq!((runs.len(), jobs.len()), (1, 1));
    let latest_missed = stored + chrono::Duration::seconds(300);
    assert_eq!(runs[0].0, latest_missed.timestamp_millis(), "the run stands for the most recent missed tick");
    let schedule = &conveyor_jobs::list_schedules(&app.db.pool, ws).await.unwrap()[0];
    assert_eq!(schedule.last_tick_at, Some(latest_missed));
    assert_eq!(schedule.next_run_at, latest_missed + chrono::Duration::seconds(60), "then the next future tick");
}

#[tokio::test]
async fn bad_input_is_a_typed_error_and_writes_nothing() {
    #[derive(Serialize, Deserialize)]
    struct Unserializable {
        // serde_json refuses maps whose keys are not strings.
        by_pair: HashMap<(i32, i32), i32>,
    }
    impl JobKind for Unserializable {
        const KIND: &'static str = "test.unserializable";
        const QUEUE: &'static str = "pings";
    }
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    assert!(matches!(ScheduleSpec::cron("every tuesday", "UTC"), Err(ScheduleError::BadCron { .. })));
    assert!(matches!(ScheduleSpec::cron("0 61 * * *", "UTC"), Err(ScheduleError::BadCron { .. })));
    assert!(matches!(ScheduleSpec::cron("0 9 * * *", "Europe/Atlantis"), Err(ScheduleError::UnknownTimeZone(_))));
    assert!(matches!(ScheduleSpec::every(Duration::ZERO), Err(ScheduleError::BadEvery(_))));
    let every = || ScheduleSpec::every(Duration::from_secs(5)).unwrap();
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
    let err = conveyor_jobs::upsert_schedule_tx(&mut tx, "Bad Name!", &ping(), every(), ScheduleOptions::new()).await;
    assert!(matches!(err, Err(ScheduleError::BadName(_))), "{err:?}");
    let payload = Unserializable { by_pair: HashMap::from([((1, 2), 3)]) };
    let err = conveyor_jobs::upsert_schedule_tx(&mut tx, "fine", &payload, every(), ScheduleOptions::new()).await;
    assert!(matches!(err, Err(ScheduleError::Payload(_))), "{err:?}");
    let err =
        conveyor_jobs::upsert_schedule_tx(&mut tx, "fine", &ping(), every(), ScheduleOptions::new().max_attempts(0))
            .await;
    assert!(matches!(err, Err(ScheduleError::BadJob(_))), "{err:?}");
    tx.commit().await.unwrap();
    assert_eq!(app.db.count("job_schedules", ws).await, 0, "nothing was written");

    // Without a workspace, nothing either.
    let mut tx = app.db.pool.begin().await.unwrap();
    let err = conveyor_jobs::upsert_schedule_tx(&mut tx, "fine", &ping(), every(), ScheduleOptions::new()).await;
    assert!(matches!(err, Err(ScheduleError::NoWorkspace)), "{err:?}");
}

#[tokio::test]
async fn another_workspace_can_neither_see_nor_change_a_schedule() {
    let app = TestApp::spawn().await;
    let (a, b) = (principal().workspace_id, principal().workspace_id);
    set(&app, a, "nightly", ScheduleSpec::cron("0 3 * * *", "Europe/Paris").unwrap(), ScheduleOptions::new()).await;
    assert!(conveyor_jobs::list_schedules(&app.db.pool, b).await.unwrap().is_empty());
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, b).await.unwrap();
    assert!(!conveyor_jobs::remove_schedule_tx(&mut tx, "nightly").await.unwrap());
    tx.commit().await.unwrap();
    assert!(!conveyor_jobs::pause_schedule(&app.db.pool, b, "nightly").await.unwrap());
    assert!(!conveyor_jobs::resume_schedule(&app.db.pool, b, "nightly").await.unwrap());
    // Names are unique per workspace: B may have its own "nightly".
    set(&app, b, "nightly", ScheduleSpec::every(Duration::from_secs(60)).unwrap(), ScheduleOptions::new()).await;
    let theirs = conveyor_jobs::list_schedules(&app.db.pool, a).await.unwrap();
    assert_eq!(theirs.len(), 1);
    assert_eq!(theirs[0].cron.as_deref(), Some("0 3 * * *"));
    assert_eq!(theirs[0].time_zone.as_deref(), Some("Europe/Paris"));
    assert!(!theirs[0].paused);
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, a).await.unwrap();
    assert!(conveyor_jobs::remove_schedule_tx(&mut tx, "nightly").await.unwrap());
    tx.commit().await.unwrap();
    assert!(conveyor_jobs::list_schedules(&app.db.pool, a).await.unwrap().is_empty());
    assert_eq!(conveyor_jobs::list_schedules(&app.db.pool, b).await.unwrap().len(), 1, "B's own is untouched");
}

#[tokio::test]
async fn schedules_and_their_runs_are_walled_off_by_row_level_security() {
    let app = TestApp::spawn().await;
    let (a, b) = (principal().workspace_id, principal().workspace_id);
    set(&app, a, "often", ScheduleSpec::every(Duration::from_secs(60)).unwrap(), ScheduleOptions::new()).await;
    exec(
        &app,
        a,
        "UPDATE conveyor.job_schedules SET next_run_at = now() - interval '1 second' WHERE name = $1",
        "often",
    )
    .await;
    assert_eq!(
        fire_due_schedules(&app.db.runtime_pool).await.unwrap().fired,
        1,
        "fired under RLS in its own workspace"
    );
    for table in ["job_schedules", "job_schedule_runs"] {
        let mut owner = app.db.owner().await;
        let (enabled, forced): (bool, bool) =
            sqlx::query_as("SELECT relrowsecurity, relforcerowsecurity FROM pg_class WHERE relname = $1")
                .bind(table)
                .fetch_one(&mut owner)
                .await
                .unwrap();
        assert!(enabled && forced, "{table}: row-level security enabled and forced");
        assert_eq!(app.db.count(table, a).await, 1, "{table}: A sees its row");
        assert_eq!(app.db.count(table, b).await, 0, "{table}: B sees nothing");
        // Without a workspace, the application role sees nothing either.
        let mut conn = app.db.app_connection().await;
        let (n,): (i64,) =
            sqlx::query_as(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {}", common::qualified(table))))
                .fetch_one(&mut conn)
                .await
                .unwrap();
        assert_eq!(n, 0, "{table}: no workspace, no rows");
        let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, b).await.unwrap();
        let changed = sqlx::query(sqlx::AssertSqlSafe(format!("DELETE FROM {}", common::qualified(table))))
            .execute(&mut *tx)
            .await
            .unwrap()
            .rows_affected();
        tx.commit().await.unwrap();
        assert_eq!(changed, 0, "{table}: B deletes nothing of A's");
    }
}

#[tokio::test]
async fn a_paused_schedule_does_not_fire_and_resumes_from_the_next_tick() {
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    let every = ScheduleSpec::every(Duration::from_secs(60)).unwrap();
    set(&app, ws, "paused", every.clone(), ScheduleOptions::new().paused(true)).await;
    set(&app, ws, "later", every, ScheduleOptions::new()).await;
    assert!(conveyor_jobs::pause_schedule(&app.db.pool, ws, "later").await.unwrap());
    exec(
        &app,
        ws,
        "UPDATE conveyor.job_schedules SET next_run_at = now() - interval '10 minutes' WHERE name <> $1",
        "",
    )
    .await;
    assert_eq!(
        fire_due_schedules(&app.db.runtime_pool).await.unwrap().fired,
        0,
        "paused schedules fire nothing, however late"
    );

    assert!(conveyor_jobs::resume_schedule(&app.db.pool, ws, "later").await.unwrap());
    let later = conveyor_jobs::list_schedules(&app.db.pool, ws).await.unwrap().into_iter().find(|s| s.name == "later");
    let later = later.unwrap();
    assert!(!later.paused);
    assert!(later.next_run_at > chrono::Utc::now(), "resumed from the next tick, the paused ones not caught up");
    assert_eq!(fire_due_schedules(&app.db.runtime_pool).await.unwrap().fired, 0);

    // Once its tick comes, it fires; the other one, still paused, does not.
    exec(
        &app,
        ws,
        "UPDATE conveyor.job_schedules SET next_run_at = now() - interval '1 second' WHERE name = $1",
        "later",
    )
    .await;
    assert_eq!(fire_due_schedules(&app.db.runtime_pool).await.unwrap().fired, 1);
    let (runs, jobs) = runs_and_jobs(&app, ws).await;
    assert_eq!((runs.len(), jobs.len()), (1, 1));
}

#[tokio::test]
async fn replacing_a_schedule_keeps_its_next_tick_unless_the_spec_changes() {
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    let hourly = || ScheduleSpec::cron("0 * * * *", "UTC").unwrap();
    set(&app, ws, "report", hourly(), ScheduleOptions::new()).await;
    let before = conveyor_jobs::list_schedules(&app.db.pool, ws).await.unwrap().remove(0);
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
    let other = Ping { target: "changed".to_owned() };
    let after =
        conveyor_jobs::upsert_schedule_tx(&mut tx, "report", &other, hourly(), ScheduleOptions::new()).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!((after.id, after.next_run_at), (before.id, before.next_run_at));
    assert_eq!(after.payload["target"], "changed");
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
    let spec = ScheduleSpec::cron("*/10 * * * * *", "UTC").unwrap();
    let after =
        conveyor_jobs::upsert_schedule_tx(&mut tx, "report", &other, spec, ScheduleOptions::new()).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(after.id, before.id);
    assert!(after.next_run_at <= before.next_run_at, "a new spec ticks from now: {after:?}");
    assert_eq!(conveyor_jobs::list_schedules(&app.db.pool, ws).await.unwrap().len(), 1);
}

fn cli(app: &TestApp, args: &[&str]) -> std::process::Output {
    std::process::Command::new(conveyor_bin())
        .args(args)
        .env_clear()
        .envs(config_vars(&app.db, &app.redis_prefix))
        .output()
        .expect("run conveyor")
}

#[tokio::test]
async fn the_cli_sets_lists_and_removes_schedules_of_registered_kinds() {
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id.0.to_string();
    let set_args = |kind: &'static str| {
        vec![
            "schedule",
            "set",
            "--workspace",
            &ws,
            "--name",
            "hourly",
            "--kind",
            kind,
            "--payload",
            "{\"target\":\"x\"}",
        ]
    };
    let mut args = set_args("test.ping");
    args.extend(["--cron", "0 * * * *", "--tz", "Europe/Paris"]);
    let out = cli(&app, &args);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown job kind `test.ping`"), "{out:?}");

    // A worker registers its kinds; here by hand.
    let mut owner = app.db.owner().await;
    sqlx::query(
        "INSERT INTO conveyor.job_kinds (kind, queue, max_attempts, timeout_ms) VALUES ('test.ping', 'pings', 5, 60000)",
    )
    .execute(&mut owner)
    .await
    .unwrap();
    let mut bad_tz = set_args("test.ping");
    bad_tz.extend(["--cron", "0 * * * *", "--tz", "Nowhere/Land"]);
    let out = cli(&app, &bad_tz);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("unknown time zone"), "{out:?}");
    let out = cli(&app, &args);
    assert!(out.status.success(), "{out:?}");
    let mut every = set_args("test.ping");
    every[5] = "often";
    every.extend(["--every", "5m", "--start-within", "2m"]);
    assert!(cli(&app, &every).status.success());

    let out = cli(&app, &["schedule", "list", "--workspace", &ws]);
    assert!(out.status.success(), "{out:?}");
    let lines: Vec<serde_json::Value> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 2);
    assert_eq!(
        (&lines[0]["name"], &lines[0]["queue"], &lines[0]["cron"]),
        (&"hourly".into(), &"pings".into(), &"0 * * * *".into())
    );
    // Each of the every-5-minutes schedule's jobs must start within 2 minutes of its tick; the hourly one's need not.
    let deadlines: Vec<(&serde_json::Value, &serde_json::Value)> =
        lines.iter().map(|l| (&l["name"], &l["start_within_ms"])).collect();
    assert_eq!(deadlines, [(&"hourly".into(), &serde_json::Value::Null), (&"often".into(), &120_000.into())]);
    assert_eq!((&lines[1]["name"], &lines[1]["every_ms"]), (&"often".into(), &300_000.into()));

    assert!(cli(&app, &["schedule", "remove", "--workspace", &ws, "--name", "hourly"]).status.success());
    assert!(!cli(&app, &["schedule", "remove", "--workspace", &ws, "--name", "hourly"]).status.success());
    let out = cli(&app, &["schedule", "list", "--workspace", &ws]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 1);
}
