//! The server's benchmarks, run with `cargo bench -p conveyor-server --bench server -- <scenario>[,<scenario>…]`
//! (scripts/bench runs them with the platform's, `benches/conveyor.rs`). They measure the shipped processes. Each
//! scenario prints one JSON line.
//!
//! - `idempotency`: idempotent creates per second and replays per second over HTTP at 32 concurrent clients, and
//!   the same SQL run by `pgbench` with 32 clients against the same database. Replays are measured twice: as the API
//!   answers them (from its copies of the records it completed), and by an API that keeps no copy (from PostgreSQL).
//! - `worker-memory`: peak resident memory of a real `conveyor worker` process at concurrency CONC draining a backlog
//!   of N jobs committed into the outbox and relayed before it starts.
//!
//! Environment: N (default 100000), CONC (100), SECONDS (10), and the test harness's database and Redis variables.

#[path = "../tests/api/common/mod.rs"]
mod common;
#[path = "../../tests/kit/report.rs"]
mod report;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use conveyor_jobs::WorkspaceId;
use report::{emit, env, round};
use serde_json::json;
use sha2::Digest;
use uuid::Uuid;

/// The same uuid from a label in Rust and in SQL: the first 32 hex digits of sha256(label).
fn derived_uuid(label: &str) -> Uuid {
    let digest = sha2::Sha256::digest(label.as_bytes());
    Uuid::from_slice(&digest[..16]).unwrap()
}

const SQL_UUID: &str = "left(encode(sha256(convert_to";

fn pgbench(db: &common::TestDb, script: &str, clients: u64, seconds: u64) -> f64 {
    let path = std::env::temp_dir().join(format!("conveyor-bench-{}.sql", Uuid::new_v4().simple()));
    std::fs::write(&path, script).unwrap();
    let out = std::process::Command::new("pgbench")
        .args(["-n", "-M", "prepared", "-c", &clients.to_string(), "-j", "2", "-T", &seconds.to_string(), "-f"])
        .arg(&path)
        .arg(&db.app_url)
        .output()
        .expect("pgbench is installed (postgresql-contrib)");
    let _ = std::fs::remove_file(&path);
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.strip_prefix("tps = ").and_then(|r| r.split_whitespace().next()).and_then(|n| n.parse().ok()))
        .unwrap_or_else(|| panic!("pgbench failed: {}{}", text, String::from_utf8_lossy(&out.stderr)))
}

async fn idempotency() {
    let clients = 32u64;
    let seconds = env("SECONDS", 10);
    let app = Arc::new(common::TestApp::spawn().await);
    let body = common::store_body("bench");
    // Creates: every request a new key.
    let run = |app: Arc<common::TestApp>, replay: bool| {
        let body = body.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(seconds);
            let mut tasks = Vec::new();
            for client in 0..clients {
                let (app, body) = (app.clone(), body.clone());
                tasks.push(tokio::spawn(async move {
                    let principal = conveyor_server::auth::Principal {
                        workspace_id: WorkspaceId(derived_uuid(&format!("ws{}", client + 1))),
                        user_id: conveyor_jobs::UserId(derived_uuid(&format!("user{}", client + 1))),
                    };
                    let token = app.token(principal);
                    let replay_key = derived_uuid(&format!("replay{}", client + 1)).to_string();
                    let mut done = 0u64;
                    while Instant::now() < deadline {
                        let key = if replay { replay_key.clone() } else { Uuid::new_v4().to_string() };
                        let resp = app
                            .http
                            .post(app.url("/v1/stores"))
                            .bearer_auth(&token)
                            .header("idempotency-key", key)
                            .json(&body)
                            .send()
                            .await
                            .unwrap();
                        assert_eq!(resp.status(), 202);
                        assert_eq!(resp.headers().contains_key("idempotent-replayed"), replay);
                        done += 1;
                    }
                    done
                }));
            }
            let mut total = 0;
            for t in tasks {
                total += t.await.unwrap();
            }
            total as f64 / seconds as f64
        }
    };
    let creates = run(app.clone(), false).await;
    // Replays: one record per client, created once, then replayed: answered from the API's copies of its records
    // (the default), and by an API that keeps none, from the records in PostgreSQL (what pgbench runs).
    for client in 1..=clients {
        let principal = conveyor_server::auth::Principal {
            workspace_id: WorkspaceId(derived_uuid(&format!("ws{client}"))),
            user_id: conveyor_jobs::UserId(derived_uuid(&format!("user{client}"))),
        };
        let key = derived_uuid(&format!("replay{client}")).to_string();
        let resp = app.send_with_key(reqwest::Method::POST, "/v1/stores", principal, Some(&key), Some(&body)).await;
        assert_eq!(resp.status(), 202);
    }
    let replays = run(app.clone(), true).await;
    let uncached = Arc::new(
        app.spawn_sharing(|vars| drop(vars.insert("CONVEYOR_IDEMPOTENCY_REPLAY_CACHE".into(), "0".into()))).await,
    );
    let replays_from_records = run(uncached, true).await;

    // pgbench's client ids count from 0, the HTTP clients' labels from 1.
    let uuid =
        |label: &str| format!("{SQL_UUID}('{label}' || (:client_id::int + 1)::text, 'UTF8')), 'hex'), 32)::uuid");
    let (ws, user, replay_key) = (uuid("ws"), uuid("user"), uuid("replay"));
    let create_sql = format!(
        r#"SELECT gen_random_uuid() AS k, gen_random_uuid() AS sid, gen_random_uuid() AS oid, gen_random_uuid() AS eid \gset
BEGIN;
SELECT set_config('app.workspace_id', ({ws})::text, true);
SELECT request_fingerprint, status FROM conveyor_server.idempotency_requests WHERE workspace_id = {ws} AND user_id = {user} AND http_method = 'POST' AND request_path = '/v1/stores' AND idempotency_key = :k::uuid AND expires_at > now();
SELECT pg_try_advisory_xact_lock(hashtextextended('conveyor-idempotency:' || :k::text, 0));
SELECT request_fingerprint, status FROM conveyor_server.idempotency_requests WHERE workspace_id = {ws} AND user_id = {user} AND http_method = 'POST' AND request_path = '/v1/stores' AND idempotency_key = :k::uuid AND expires_at > now();
INSERT INTO conveyor_server.idempotency_requests (workspace_id, user_id, http_method, request_path, idempotency_key, request_fingerprint, fingerprint_key_id, expires_at) VALUES ({ws}, {user}, 'POST', '/v1/stores', :k::uuid, sha256('x'), 't1', now() + interval '48 hours');
INSERT INTO conveyor_shop.stores (id, workspace_id, name, platform, created_by) VALUES (:sid::uuid, {ws}, 'Main shop', 'sandbox', {user}) RETURNING id, name, platform, status, status_detail, created_at, updated_at, verified_at;
INSERT INTO conveyor_shop.store_credentials (store_id, workspace_id, key_id, nonce, ciphertext) VALUES (:sid::uuid, {ws}, 'k1', substr(sha256('n'), 1, 12), sha256('c'));
INSERT INTO conveyor.operations (id, workspace_id, kind, subject_id, created_by) VALUES (:oid::uuid, {ws}, 'store.verify_credentials', :sid::uuid, {user}) RETURNING id, kind, status, subject_id, progress, result, error, created_at, updated_at;
INSERT INTO conveyor.outbox_events (id, workspace_id, queue, event_type, event_payload, operation_id, traceparent) VALUES (:eid::uuid, {ws}, 'stores', 'store.verify_credentials', '{{"store_id": "x", "credentials_version": 1}}', :oid::uuid, '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01');
SELECT pg_notify('conveyor_outbox', '');
UPDATE conveyor_server.idempotency_requests SET status = 'completed', response_status = 202, response_headers = '[]', response_body = '{{}}', completed_at = now() WHERE workspace_id = {ws} AND user_id = {user} AND http_method = 'POST' AND request_path = '/v1/stores' AND idempotency_key = :k::uuid AND status = 'in_progress';
COMMIT;
"#
    );
    let replay_sql = format!(
        r#"BEGIN;
SELECT set_config('app.workspace_id', ({ws})::text, true);
SELECT request_fingerprint, fingerprint_key_id, status, response_status, response_headers, response_body FROM conveyor_server.idempotency_requests WHERE workspace_id = {ws} AND user_id = {user} AND http_method = 'POST' AND request_path = '/v1/stores' AND idempotency_key = {replay_key} AND expires_at > now();
ROLLBACK;
"#
    );
    let pg_creates = pgbench(&app.db, &create_sql, clients, seconds);
    let pg_replays = pgbench(&app.db, &replay_sql, clients, seconds);
    emit(json!({
        "scenario": "idempotency", "clients": clients, "seconds": seconds,
        "creates_per_s": creates.round(), "pgbench_creates_per_s": pg_creates.round(),
        "creates_ratio": round(creates / pg_creates),
        "replays_per_s": replays.round(), "pgbench_replays_per_s": pg_replays.round(),
        "replays_ratio": round(replays / pg_replays),
        "replays_from_records_per_s": replays_from_records.round(),
        "replays_from_records_ratio": round(replays_from_records / pg_replays),
    }));
}

/// Commits `n` verifications of stores that do not exist (the handler finds the store gone and ends the job) over
/// 100 workspaces, and relays them into the stream in-process.
async fn backlog(app: &common::TestApp, n: usize) {
    for _ in 0..100 {
        let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, WorkspaceId(Uuid::new_v4())).await.unwrap();
        sqlx::query(
            "INSERT INTO conveyor.outbox_events (id, workspace_id, queue, event_type, event_payload)
             SELECT gen_random_uuid(), current_setting('app.workspace_id')::uuid, 'stores', 'store.verify_credentials',
                    jsonb_build_object('store_id', gen_random_uuid(), 'credentials_version', 1)
             FROM generate_series(1, $1)",
        )
        .bind((n / 100) as i32)
        .execute(&mut *tx)
        .await
        .unwrap();
        tx.commit().await.unwrap();
    }
    let dispatcher = common::test_dispatcher(app, &common::redis_url(), |v| {
        v.insert("CONVEYOR_DISPATCH_WINDOW".into(), "0".into());
        v.insert("CONVEYOR_DISPATCH_DEDUP_TTL".into(), "2m".into());
    })
    .await;
    while let conveyor_jobs::DispatchOutcome::Worked(_) = dispatcher.dispatch_once().await.unwrap() {}
}

async fn stream_len(app: &common::TestApp) -> u64 {
    use fred::prelude::StreamsInterface;
    let client = common::redis_client(&common::redis_url()).await;
    client.xlen(conveyor_jobs::RedisKeys::new(&app.redis_prefix).stream("stores")).await.unwrap()
}

async fn worker_memory() {
    let (n, conc) = (env("N", 100_000) as usize, env("CONC", 100));
    let app = common::TestApp::spawn().await;
    let (_sandbox, market) = common::sandbox(Default::default()).await;
    backlog(&app, n).await;
    let mut vars: HashMap<String, String> = common::config_vars(&app.db, &app.redis_prefix);
    vars.insert("CONVEYOR_MARKETPLACE_URL".into(), market);
    vars.insert("CONVEYOR_WORKER_CONCURRENCY".into(), conc.to_string());
    vars.insert("CONVEYOR_DATABASE_MAX_CONNECTIONS".into(), "32".into());
    vars.insert("RUST_LOG".into(), "warn".into());
    let mut process = common::Process::spawn(&["worker"], &vars);
    let started = Instant::now();
    let mut peak_kib = 0u64;
    let status = format!("/proc/{}/status", process.child.id());
    loop {
        if let Ok(s) = std::fs::read_to_string(&status) {
            let hwm = s
                .lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok());
            peak_kib = peak_kib.max(hwm.unwrap_or(0));
        }
        if stream_len(&app).await == 0 || started.elapsed() > Duration::from_secs(300) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let elapsed = started.elapsed().as_secs_f64();
    process.kill();
    emit(json!({
        "scenario": "worker-memory", "n": n, "concurrency": conc, "handler": "store.verify_credentials (store gone)",
        "peak_rss_mib": round(peak_kib as f64 / 1024.0), "per_s": (n as f64 / elapsed).round(),
    }));
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let which = args.first().cloned().unwrap_or_else(|| "idempotency,worker-memory".into());
    if std::env::var("RUST_LOG").is_ok() {
        conveyor_server::telemetry::init_logging(false);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        for scenario in which.split(',') {
            match scenario {
                "idempotency" => idempotency().await,
                "worker-memory" => worker_memory().await,
                other => panic!("unknown scenario {other} (the platform's are in benches/conveyor.rs)"),
            }
        }
    });
}
