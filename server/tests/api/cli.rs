//! The operator's command line, run as the real binary: `config check`, each role's `--help`, completions,
//! `queues` and `jobs`.

use crate::common;

use std::collections::HashMap;
use std::process::{Command, Output};

use common::{TestApp, principal, store_body};
use serde_json::{Value, json};

fn conveyor(args: &[&str], vars: &HashMap<String, String>) -> Output {
    Command::new(common::conveyor_bin())
        .args(args)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .envs(vars)
        .output()
        .expect("run conveyor")
}

/// Runs `conveyor` with `args`, and `meanwhile` (if any) a second after it started; its standard output once it exits,
/// successfully, within 60 s (killed and failed otherwise).
fn conveyor_within(args: &[&str], vars: &HashMap<String, String>, meanwhile: Option<&dyn Fn()>) -> String {
    let mut child = Command::new(common::conveyor_bin())
        .args(args)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .envs(vars)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run conveyor");
    if let Some(meanwhile) = meanwhile {
        std::thread::sleep(std::time::Duration::from_secs(1));
        meanwhile();
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            child.kill().unwrap();
            panic!("conveyor {args:?} did not end within 60 s");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "conveyor {args:?}: {}", text(&out.stderr));
    text(&out.stdout)
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn config_check_reports_every_bad_variable_at_once_and_never_prints_a_secret() {
    let vars: HashMap<String, String> = [
        ("CONVEYOR_DATABASE_URL", "postgres://conveyor_app:hunter2-db-password@127.0.0.1/conveyor"),
        ("CONVEYOR_RUNTIME_DATABASE_URL", "postgres://conveyor_runtime:hunter2-runtime-password@127.0.0.1/conveyor"),
        ("CONVEYOR_REDIS_URL", "redis://127.0.0.1:6379"),
        ("CONVEYOR_JWT_SECRET", "a-jwt-secret-that-is-long-enough-0123456789"),
        ("CONVEYOR_IDEMPOTENCY_KEYS", "k1:a-fingerprint-key-long-enough-0123456789"),
        ("CONVEYOR_ENCRYPTION_KEY", "ZGV2LW9ubHktZW5jcnlwdGlvbi1rZXktMzItYnl0ZXM="),
        ("CONVEYOR_WORKER_CONCURRENCY", "lots"),
        ("CONVEYOR_JOB_TIMEOUT", "-3"),
        ("CONVEYOR_MARKETPLACE_URL", "ftp://market"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    let out = conveyor(&["config", "check", "--role", "worker"], &vars);
    assert!(!out.status.success(), "a bad configuration exits non-zero");
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    for name in ["CONVEYOR_WORKER_CONCURRENCY", "CONVEYOR_JOB_TIMEOUT", "CONVEYOR_MARKETPLACE_URL"] {
        assert!(stderr.contains(name), "{name} not reported:\n{stderr}");
    }
    assert!(stdout.contains("CONVEYOR_DATABASE_URL=[redacted]"), "{stdout}");
    assert!(stdout.contains("CONVEYOR_RUNTIME_DATABASE_URL=[redacted]"), "{stdout}");
    assert!(stdout.contains("CONVEYOR_OPERATION_KEEPALIVE=1m  # default"), "{stdout}");
    assert!(!stdout.contains("hunter2") && !stderr.contains("hunter2"), "a password was printed");
    assert!(!stdout.contains("a-jwt-secret"), "a secret was printed");

    let mut good = vars.clone();
    good.remove("CONVEYOR_JOB_TIMEOUT");
    good.insert("CONVEYOR_WORKER_CONCURRENCY".into(), "8".into());
    good.insert("CONVEYOR_MARKETPLACE_URL".into(), "http://127.0.0.1:8090".into());
    let out = conveyor(&["config", "check", "--role", "worker"], &good);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("CONVEYOR_WORKER_CONCURRENCY=8  # set"));

    // A worker without the runtime role's URL is refused: its bookkeeping works across workspaces.
    let mut without_runtime = good.clone();
    without_runtime.remove("CONVEYOR_RUNTIME_DATABASE_URL");
    let out = conveyor(&["config", "check", "--role", "worker"], &without_runtime);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("CONVEYOR_RUNTIME_DATABASE_URL is required"), "{}", text(&out.stderr));

    // The migration role needs its own URL, and nothing about Redis.
    let out = conveyor(&["config", "check", "--role", "migrate"], &HashMap::new());
    let stderr = text(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("CONVEYOR_MIGRATION_DATABASE_URL is required"), "{stderr}");
    assert!(!stderr.contains("CONVEYOR_REDIS_URL"), "{stderr}");
}

#[test]
fn each_role_lists_the_variables_it_reads_and_completions_are_generated() {
    let worker = text(&conveyor(&["worker", "--help"], &HashMap::new()).stdout);
    assert!(worker.contains("CONVEYOR_WORKER_CONCURRENCY [default: 16]"), "{worker}");
    assert!(!worker.contains("CONVEYOR_HTTP_ADDR"), "{worker}");
    let api = text(&conveyor(&["api", "--help"], &HashMap::new()).stdout);
    assert!(api.contains("CONVEYOR_HTTP_ADDR [default: 127.0.0.1:8080]"), "{api}");
    assert!(!api.contains("CONVEYOR_WORKER_CONCURRENCY"), "{api}");
    let bash = conveyor(&["completions", "bash"], &HashMap::new());
    assert!(bash.status.success());
    let script = text(&bash.stdout);
    assert!(script.contains("_conveyor") && script.contains("queues") && script.contains("dlq"), "{script}");
    let bad = conveyor(&["completions", "cmd.exe"], &HashMap::new());
    assert!(!bad.status.success(), "an unknown shell is refused");
}

#[tokio::test]
async fn queues_and_jobs_show_cancel_and_retry_across_workspaces() {
    let app = TestApp::spawn().await;
    let (alice, bob) = (principal(), principal());
    for who in [alice, bob] {
        let resp = app.send(reqwest::Method::POST, "/v1/stores", who, Some(&store_body("cli"))).await;
        assert_eq!(resp.status(), 202, "{:?}", resp.text().await);
    }
    let vars = common::config_vars(&app.db, &app.redis_prefix);

    // No dispatcher runs: both verifications wait, queued, in the `stores` queue.
    let out = conveyor(&["queues", "--json"], &vars);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let queues: Vec<Value> = text(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let stores = queues.iter().find(|q| q["name"] == "stores").expect("the stores queue is listed");
    assert_eq!(stores["counts"]["queued"], 2, "{stores}");
    let table = text(&conveyor(&["queues"], &vars).stdout);
    assert!(table.lines().any(|l| l.starts_with("stores ")), "{table}");

    let out = conveyor(&["jobs", "list", "--queue", "stores", "--status", "queued"], &vars);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let jobs: Vec<Value> = text(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(jobs.len(), 2, "both workspaces' jobs: {jobs:?}");
    let workspaces: std::collections::HashSet<_> = jobs.iter().map(|j| j["workspace_id"].clone()).collect();
    assert_eq!(workspaces.len(), 2);

    let id = jobs[0]["id"].as_str().unwrap();
    let shown = conveyor(&["jobs", "show", id], &vars);
    assert!(shown.status.success(), "{}", text(&shown.stderr));
    let job: Value = serde_json::from_slice(&shown.stdout).unwrap();
    assert_eq!((job["status"].as_str(), job["queue"].as_str()), (Some("queued"), Some("stores")));

    let canceled = conveyor(&["jobs", "cancel", id], &vars);
    assert!(canceled.status.success(), "{}", text(&canceled.stderr));
    let job: Value = serde_json::from_slice(&conveyor(&["jobs", "show", id], &vars).stdout).unwrap();
    assert_eq!(job["status"], "canceled");
    let again = conveyor(&["jobs", "cancel", id], &vars);
    assert!(!again.status.success(), "a finished job cannot be canceled");
    assert!(text(&again.stderr).contains("cannot be canceled"), "{}", text(&again.stderr));

    // Its workspace's events: the cancellation, read as recorded, as a table, and followed from before it.
    let workspace = jobs[0]["workspace_id"].as_str().unwrap();
    let out = conveyor(&["jobs", "events", "--workspace", workspace], &vars);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let events: Vec<Value> = text(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!((events[0]["event"].as_str(), events[0]["job"]["id"].as_str()), (Some("canceled"), Some(id)));
    let table = text(&conveyor(&["jobs", "events", "--workspace", workspace, "-o", "table"], &vars).stdout);
    assert!(
        table.starts_with("AT (UTC)") && table.lines().nth(1).unwrap().contains(&format!("canceled  {id}")),
        "{table}"
    );
    let only_failed = conveyor(&["jobs", "events", "--workspace", workspace, "--event", "failed,retrying"], &vars);
    assert!(only_failed.status.success() && only_failed.stdout.is_empty(), "{}", text(&only_failed.stdout));
    let followed = conveyor_within(
        &["jobs", "events", "--workspace", workspace, "--since", "1h", "--follow", "--count", "1"],
        &vars,
        None,
    );
    let heard: Value = serde_json::from_str(&followed).unwrap();
    assert_eq!(heard["event"], "canceled", "following from an hour ago hears what happened since");
    let refused = conveyor(&["jobs", "events", "--workspace", workspace, "--event", "exploded"], &vars);
    assert!(!refused.status.success());
    assert!(text(&refused.stderr).contains("one of active, progress"), "{}", text(&refused.stderr));
    let refused = conveyor(&["jobs", "events", "--workspace", workspace, "--count", "0"], &vars);
    assert!(!refused.status.success(), "a count of none is refused");

    // Followed from now: the other workspace's job, canceled while the command follows, is heard as it happens.
    let (other, other_workspace) = (jobs[1]["id"].as_str().unwrap(), jobs[1]["workspace_id"].as_str().unwrap());
    let live = conveyor_within(
        &["jobs", "events", "--workspace", other_workspace, "--follow", "--count", "1", "-o", "table"],
        &vars,
        Some(&|| assert!(conveyor(&["jobs", "cancel", other], &vars).status.success())),
    );
    assert!(live.starts_with("AT (UTC)") && live.lines().nth(1).unwrap().contains(other), "{live}");

    let missing = uuid::Uuid::now_v7().to_string();
    let out = conveyor(&["jobs", "show", &missing], &vars);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("no job"), "{}", text(&out.stderr));
    let out = conveyor(&["jobs", "list", "--status", "sleeping"], &vars);
    assert!(!out.status.success(), "an unknown state is refused");

    // Without the operator role's URL the commands say what is missing.
    let mut without = vars.clone();
    without.remove("CONVEYOR_OPERATOR_DATABASE_URL");
    let out = conveyor(&["queues"], &without);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("CONVEYOR_OPERATOR_DATABASE_URL"), "{}", text(&out.stderr));
    app.shutdown.cancel();
}

/// Only the api role reads the workspace tokens' key: `config check` and `--help` of the other roles never name it,
/// and the api refuses to start without it, saying which variable.
#[test]
fn the_tenant_jwt_secret_is_the_api_roles_alone() {
    for role in ["dispatcher", "worker", "maintenance"] {
        let help = text(&conveyor(&[role, "--help"], &HashMap::new()).stdout);
        assert!(!help.contains("CONVEYOR_JWT_SECRET"), "{role} --help lists the JWT secret:\n{help}");
        assert!(!help.contains("CONVEYOR_OPERATOR_JWT_SECRET"), "{role} --help lists the operator key");
    }
    let help = text(&conveyor(&["api", "--help"], &HashMap::new()).stdout);
    assert!(help.contains("CONVEYOR_JWT_SECRET") && help.contains("CONVEYOR_OPERATOR_JWT_SECRET"), "{help}");

    let vars: HashMap<String, String> = [
        ("CONVEYOR_DATABASE_URL", "postgres://conveyor_app:conveyor_app@127.0.0.1:1/conveyor"),
        ("CONVEYOR_REDIS_URL", "redis://127.0.0.1:1"),
        ("CONVEYOR_IDEMPOTENCY_KEYS", "k1:a-fingerprint-key-long-enough-0123456789"),
        ("CONVEYOR_ENCRYPTION_KEY", "ZGV2LW9ubHktZW5jcnlwdGlvbi1rZXktMzItYnl0ZXM="),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    let out = conveyor(&["api"], &vars);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("CONVEYOR_JWT_SECRET is required by the api role"), "{}", text(&out.stderr));
    let out = conveyor(&["config", "check", "--role", "worker"], &vars);
    let printed = format!("{}{}", text(&out.stdout), text(&out.stderr));
    assert!(!printed.contains("CONVEYOR_JWT_SECRET"), "{printed}");
}

#[tokio::test]
async fn listings_print_a_table_or_json_lines_and_jobs_page_back_with_their_cursor() {
    let app = TestApp::spawn().await;
    let who = principal();
    for _ in 0..3 {
        let resp = app.send(reqwest::Method::POST, "/v1/stores", who, Some(&store_body("cli"))).await;
        assert_eq!(resp.status(), 202, "{:?}", resp.text().await);
    }
    let vars = common::config_vars(&app.db, &app.redis_prefix);
    let ws = who.workspace_id.0.to_string();
    let lines = |out: &Output| -> Vec<Value> {
        assert!(out.status.success(), "{}", text(&out.stderr));
        text(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect()
    };

    // A page of two, newest first; stderr names the next page's cursor, which gives the third.
    let first = conveyor(&["jobs", "list", "--workspace", &ws, "--limit", "2"], &vars);
    let page = lines(&first);
    assert_eq!(page.len(), 2);
    let more = text(&first.stderr);
    let cursor = more.trim().strip_prefix("more: --before ").unwrap_or_else(|| panic!("a cursor: {more}"));
    assert_eq!(cursor, page[1]["id"].as_str().unwrap());
    let second = lines(&conveyor(&["jobs", "list", "--workspace", &ws, "--limit", "2", "--before", cursor], &vars));
    assert_eq!(second.len(), 1);
    assert!(second[0]["id"].as_str().unwrap() < cursor, "older than the cursor");
    // By time: all three were enqueued in the last hour, none before 2000.
    assert_eq!(lines(&conveyor(&["jobs", "list", "--workspace", &ws, "--since", "1h"], &vars)).len(), 3);
    let none = conveyor(&["jobs", "list", "--workspace", &ws, "--until", "2000-01-01T00:00:00Z"], &vars);
    assert!(lines(&none).is_empty());
    assert!(!conveyor(&["jobs", "list", "--since", "yesterday-ish"], &vars).status.success(), "a bad time is refused");

    // A table: a header with the time zone, a row per job starting with its id.
    let table = conveyor(&["jobs", "list", "--workspace", &ws, "-o", "table"], &vars);
    assert!(table.status.success(), "{}", text(&table.stderr));
    let table = text(&table.stdout);
    let rows: Vec<&str> = table.lines().collect();
    assert!(rows[0].starts_with("JOB ") && rows[0].contains("ENQUEUED (UTC)"), "{table}");
    assert_eq!(rows.len(), 4, "{table}");
    for (row, job) in rows[1..].iter().zip(page.iter().chain(&second)) {
        assert!(row.starts_with(job["id"].as_str().unwrap()), "{row}");
        assert!(row.contains("store.verify_credentials") && row.contains("queued"), "{row}");
    }
    let queues = text(&conveyor(&["queues", "-o", "json"], &vars).stdout);
    assert!(queues.lines().all(|l| serde_json::from_str::<Value>(l).is_ok()), "{queues}");
    assert!(!conveyor(&["jobs", "list", "-o", "yaml"], &vars).status.success(), "an unknown format is refused");
    // Pauses and schedules take the same formats.
    let pauses = conveyor(&["flow", "pauses", "-o", "table"], &vars);
    assert!(text(&pauses.stdout).starts_with("QUEUE "), "{}", text(&pauses.stderr));
    // A global limit: set, listed in both formats, refused when malformed, removed.
    let set = conveyor(&["flow", "limit", "--queue", "stores", "--max-in-flight", "3"], &vars);
    assert!(set.status.success(), "{}", text(&set.stderr));
    let rate = ["flow", "limit", "--kind", "store.verify_credentials", "--max-per-interval", "10", "--interval", "1s"];
    assert!(conveyor(&rate, &vars).status.success());
    let limits = lines(&conveyor(&["flow", "limits"], &vars));
    assert_eq!(limits.len(), 2, "{limits:?}");
    assert_eq!((limits[0]["scope"].clone(), limits[0]["max_per_interval"].clone()), (json!("kind"), json!(10)));
    assert_eq!((limits[1]["name"].clone(), limits[1]["max_in_flight"].clone()), (json!("stores"), json!(3)));
    let table = text(&conveyor(&["flow", "limits", "-o", "table"], &vars).stdout);
    assert!(table.starts_with("SCOPE ") && table.contains("10/1000ms"), "{table}");
    for bad in [
        &["flow", "limit", "--queue", "stores"][..],
        &["flow", "limit", "--queue", "stores", "--max-per-interval", "10"],
        &["flow", "limit", "--queue", "stores", "--kind", "k", "--max-in-flight", "1"],
        &["flow", "limit", "--queue", "Bad}", "--max-in-flight", "1"],
    ] {
        assert!(!conveyor(bad, &vars).status.success(), "{bad:?} is refused");
    }
    assert!(conveyor(&["flow", "unlimit", "--queue", "stores"], &vars).status.success());
    assert!(!conveyor(&["flow", "unlimit", "--queue", "stores"], &vars).status.success(), "nothing left to remove");
    assert_eq!(lines(&conveyor(&["flow", "limits"], &vars)).len(), 1);
    // Fairness: a weight set, listed with the workspace's share; a workspace's kind limit listed.
    assert!(conveyor(&["flow", "weight", "--workspace", &ws, "--weight", "5"], &vars).status.success());
    let shares = lines(&conveyor(&["flow", "fairness"], &vars));
    assert!(shares.iter().any(|w| w["workspace_id"] == ws.as_str() && w["weight"] == 5), "{shares:?}");
    let table = text(&conveyor(&["flow", "fairness", "-o", "table"], &vars).stdout);
    assert!(table.starts_with("WORKSPACE ") && table.contains(&ws), "{table}");
    conveyor_jobs::set_kind_limit(
        &app.db.pool,
        conveyor_jobs::WorkspaceId(ws.parse().unwrap()),
        "store.verify_credentials",
        2,
    )
    .await
    .unwrap();
    let kinds = lines(&conveyor(&["flow", "kind-limits", "--workspace", &ws], &vars));
    assert_eq!((kinds.len(), kinds[0]["max_in_flight"].clone()), (1, json!(2)));
    let rate = conveyor_jobs::KeyLimit {
        max_per_interval: Some((4, std::time::Duration::from_secs(1))),
        ..Default::default()
    };
    conveyor_jobs::set_key_limit(&app.db.pool, conveyor_jobs::WorkspaceId(ws.parse().unwrap()), "store:9", rate)
        .await
        .unwrap();
    let keys = text(&conveyor(&["flow", "key-limits", "-o", "table"], &vars).stdout);
    let row = keys.lines().find(|l| l.contains("store:9")).unwrap_or_default();
    assert!(keys.starts_with("WORKSPACE ") && row.starts_with(&ws) && row.contains("4/1000ms"), "{keys}");
    let schedules = conveyor(&["schedule", "list", "--workspace", &ws, "-o", "table"], &vars);
    assert!(text(&schedules.stdout).starts_with("NAME "), "{}", text(&schedules.stderr));

    // The development commands live under `dev`; their former names still answer.
    let user = uuid::Uuid::new_v4().to_string();
    for args in [&["dev", "token"][..], &["token"]] {
        let args: Vec<&str> = args.iter().copied().chain(["--workspace", &ws, "--user", &user]).collect();
        let out = conveyor(&args, &vars);
        assert!(out.status.success() && text(&out.stdout).split('.').count() == 3, "{args:?}: {}", text(&out.stderr));
    }
}

#[tokio::test]
async fn migrate_status_says_what_is_applied_pending_changed_or_unknown_and_fails_unless_all_applied() {
    let app = TestApp::spawn().await;
    let vars = common::config_vars(&app.db, &app.redis_prefix);
    let status = |vars: &HashMap<String, String>| {
        let out = conveyor(&["migrate", "status", "-o", "json"], vars);
        let rows: Vec<Value> = text(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        (out.status.code(), rows, text(&out.stderr))
    };
    // Read as the application role when no owner URL is given: it may read every history table.
    let mut as_app = vars.clone();
    as_app.remove("CONVEYOR_MIGRATION_DATABASE_URL");
    let (code, rows, stderr) = status(&as_app);
    assert_eq!(code, Some(0), "{stderr}");
    for schema in ["conveyor", "conveyor_shop", "conveyor_server"] {
        assert!(rows.iter().any(|r| r["schema"] == schema), "{schema}: {rows:?}");
    }
    assert!(rows.iter().all(|r| r["state"] == "applied"), "{rows:?}");
    let table = text(&conveyor(&["migrate", "status"], &vars).stdout);
    assert!(table.starts_with("CRATE ") && table.contains("applied"), "{table}");

    // A changed file, a migration not yet run, one a newer release ran: each is named, and the status fails.
    let mut owner = app.db.owner().await;
    for statement in [
        "UPDATE conveyor._sqlx_migrations SET checksum = '\\x00' WHERE version = 1",
        "UPDATE conveyor_shop._sqlx_migrations SET success = false WHERE version = 1",
        "DELETE FROM conveyor_server._sqlx_migrations WHERE version = (SELECT max(version) FROM conveyor_server._sqlx_migrations)",
        "INSERT INTO conveyor_shop._sqlx_migrations (version, description, installed_on, success, checksum, execution_time)
         VALUES (9999, 'from the future', now(), true, '\\x01', 1)",
    ] {
        sqlx::query(sqlx::AssertSqlSafe(statement)).execute(&mut owner).await.unwrap();
    }
    let (code, rows, stderr) = status(&vars);
    assert!(code == Some(2) && stderr.contains("not applied"), "{code:?}: {stderr}");
    let state = |schema: &str, version: i64| {
        rows.iter().find(|r| r["schema"] == schema && r["version"] == version).map(|r| r["state"].clone())
    };
    assert_eq!(state("conveyor", 1), Some("checksum_mismatch".into()));
    assert_eq!(state("conveyor_shop", 1), Some("failed".into()));
    assert_eq!(state("conveyor_shop", 9999), Some("unknown".into()));
    let pending: Vec<&Value> = rows.iter().filter(|r| r["state"] == "pending").collect();
    assert!(pending.len() == 1 && pending[0]["schema"] == "conveyor_server", "{pending:?}");
    // A database it cannot read is an error, exit 1, not a status.
    let mut unreachable = vars.clone();
    unreachable.insert("CONVEYOR_MIGRATION_DATABASE_URL".into(), "postgres://nobody:x@127.0.0.1:1/none".into());
    assert_eq!(status(&unreachable).0, Some(1));
}
