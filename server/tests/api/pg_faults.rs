//! PostgreSQL faults with real processes: the `api`, `dispatcher`, `worker` and `maintenance` roles of the `conveyor`
//! binary on a PostgreSQL of the test's own (`common::postgres`), the shared Redis under a prefix of the test's own,
//! and the sandbox marketplace. Clients create stores with idempotency keys and retry with the same key until they get
//! a definite answer, while PostgreSQL is restarted (fast stop, start again), crashes (SIGKILL of every server process,
//! then crash recovery) or has every application connection terminated (a failover-like reset). Every accepted
//! request's operation ends `succeeded` once, with one marketplace effect, and every role survives without a restart.
//! After a restart the dispatcher `LISTEN`s again and relays a new job on its notification.

use crate::common;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::TestDb;
use common::postgres::TestPostgres;
use common::roles::Roles;
use conveyor_server::auth::{Principal, TokenKeys};
use conveyor_server::config::Secret;
use conveyor_shop::adapters::sandbox::{Sandbox, Settings};
use serde_json::Value;
use uuid::Uuid;

/// The variables of every process of one run over `db`, with the keys of `prefix`, calling the marketplace `market`.
fn process_vars(db: &TestDb, prefix: &str, market: &str) -> HashMap<String, String> {
    let mut vars = common::config_vars(db, prefix);
    vars.insert("CONVEYOR_MARKETPLACE_URL".into(), market.to_owned());
    common::roles::quick_intervals(&mut vars);
    vars
}

/// One accepted request: the operation it started.
#[derive(Clone, Debug)]
struct Accepted {
    operation: String,
    /// Sends it took (more than one: a retry with the same key after a failure or a lost answer).
    tries: u32,
    /// Answers `500` among them: PostgreSQL going away is unavailability (`503` with `Retry-After`), never an
    /// internal error.
    internal_errors: u32,
}

/// Posts `body` to `url` with `key` until a definite answer, as a careful client does: a connection error, a time-out,
/// a `5xx` or `409 IDEMPOTENCY_REQUEST_IN_PROGRESS` is retried with the same key. Returns the accepted operation, the
/// sends it took and how many were answered `500`; panics on any other answer, and on a `503` without `Retry-After`.
async fn until_accepted(http: &reqwest::Client, url: &str, token: &str, key: &str, body: &Value) -> (String, u32, u32) {
    let (mut tries, mut internal_errors) = (0, 0);
    loop {
        tries += 1;
        let sent = http.post(url).bearer_auth(token).header("idempotency-key", key).json(body).send().await;
        match sent {
            Ok(resp) if resp.status() == 202 => {
                // An answer cut off half-way is retried too: the key replays it.
                if let Ok(answer) = resp.json::<Value>().await
                    && let Some(op) = answer["operation"]["id"].as_str()
                {
                    return (op.to_owned(), tries, internal_errors);
                }
            }
            Ok(resp) if resp.status() == 503 => {
                assert!(resp.headers().contains_key("retry-after"), "a 503 says when to retry");
            }
            Ok(resp) if resp.status().is_server_error() => {
                if resp.status() == 500 {
                    internal_errors += 1;
                    eprintln!("{url} answered 500: {}", resp.text().await.unwrap_or_default());
                }
            }
            Ok(resp) if resp.status() == 409 => {
                let text = resp.text().await.unwrap_or_default();
                assert!(text.contains("IDEMPOTENCY_REQUEST_IN_PROGRESS"), "unexpected conflict: {text}");
            }
            Ok(resp) => panic!("{url} answered {}: {}", resp.status(), resp.text().await.unwrap_or_default()),
            Err(_) => {}
        }
        assert!(tries < 3000, "{url} never gave a definite answer to key {key}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn http_client() -> reqwest::Client {
    reqwest::Client::builder().timeout(Duration::from_secs(15)).build().unwrap()
}

fn tokens() -> TokenKeys {
    TokenKeys::new(&Secret::new(common::JWT_SECRET.as_bytes().to_vec()))
}

/// Creates `n` stores over `workspaces` through the API at `port`, `rate` a second, eight at a time, each with an
/// idempotency key of its own retried until accepted.
async fn create_stores(port: u16, workspaces: Vec<Principal>, n: usize, rate: u64) -> Vec<Accepted> {
    use futures_util::StreamExt;
    let (http, keys) = (http_client(), tokens());
    let url = format!("http://127.0.0.1:{port}/v1/stores");
    let start = tokio::time::Instant::now();
    futures_util::stream::iter(0..n)
        .map(|i| {
            let who = workspaces[i % workspaces.len()];
            let (http, url, token) = (http.clone(), url.clone(), keys.mint(who, Duration::from_secs(3600)));
            async move {
                tokio::time::sleep_until(start + Duration::from_millis(1000 * i as u64 / rate)).await;
                let key = Uuid::new_v4().to_string();
                let (operation, tries, internal_errors) =
                    until_accepted(&http, &url, &token, &key, &common::store_body(&key)).await;
                Accepted { operation, tries, internal_errors }
            }
        })
        .buffer_unordered(8)
        .collect()
        .await
}

/// Operations of `workspaces`: id → status. `None` while PostgreSQL does not answer.
async fn operations(db: &TestDb, workspaces: &[Principal]) -> Option<HashMap<String, String>> {
    let mut all = HashMap::new();
    for who in workspaces {
        let mut tx = conveyor_jobs::begin_workspace(&db.pool, who.workspace_id).await.ok()?;
        let rows: Vec<(Uuid, String)> =
            sqlx::query_as("SELECT id, status FROM conveyor.operations").fetch_all(&mut *tx).await.ok()?;
        tx.commit().await.ok()?;
        all.extend(rows.into_iter().map(|(id, status)| (id.to_string(), status)));
    }
    Some(all)
}

async fn succeeded(db: &TestDb, workspaces: &[Principal]) -> usize {
    operations(db, workspaces).await.map_or(0, |ops| ops.values().filter(|s| *s == "succeeded").count())
}

/// Waits until every operation of `workspaces` succeeded and there are `n` of them; panics with the logs otherwise.
async fn all_succeed(db: &TestDb, workspaces: &[Principal], n: usize, roles: &Roles) {
    let done = common::eventually(Duration::from_secs(120), || async {
        let ops = operations(db, workspaces).await?;
        (ops.len() == n && ops.values().all(|s| s == "succeeded")).then_some(())
    })
    .await;
    if done.is_none() {
        let mut statuses: HashMap<String, usize> = HashMap::new();
        for status in operations(db, workspaces).await.unwrap_or_default().into_values() {
            *statuses.entry(status).or_default() += 1;
        }
        panic!("not every operation succeeded ({n} expected): {statuses:?}\n{}", roles.logs());
    }
}

/// Exactly once: the operations of `workspaces` are exactly the accepted requests' (none lost, none without a
/// request), there is one store per request, and the marketplace made one effect per operation, under its key.
async fn once_each(db: &TestDb, sandbox: &Sandbox, workspaces: &[Principal], accepted: &[Accepted]) {
    let ops = operations(db, workspaces).await.expect("PostgreSQL answers");
    let requested: HashSet<&str> = accepted.iter().map(|a| a.operation.as_str()).collect();
    assert_eq!(requested.len(), accepted.len(), "every request started an operation of its own");
    let recorded: HashSet<&str> = ops.keys().map(String::as_str).collect();
    assert_eq!(recorded, requested, "the operations recorded are exactly the accepted requests'");
    let mut stores = 0;
    for who in workspaces {
        stores += db.count("stores", who.workspace_id).await;
    }
    assert_eq!(stores as usize, accepted.len(), "one store per accepted request");
    let stats = sandbox.stats();
    let effects: HashSet<&str> = stats.calls_by_key.keys().map(String::as_str).collect();
    assert_eq!(effects, requested, "the marketplace was called for every operation, and for nothing else");
    assert_eq!(stats.effects, accepted.len() as u64, "one marketplace effect per operation");
}

/// One run: 160 stores created at 25 a second over six workspaces while `fault` strikes PostgreSQL mid-run (it is
/// given the server and a way to wait for a number of succeeded operations); then every accepted operation succeeds
/// once, with one effect, and no role's process exited.
async fn creations_survive(name: &str, fault: impl AsyncFnOnce(&mut TestPostgres, &dyn Fn(usize) -> Waiting)) {
    const N: usize = 160;
    let mut pg = TestPostgres::start().await;
    let db = pg.test_db().await;
    let prefix = format!("conveyor-test-{}", Uuid::new_v4().simple());
    let (sandbox, market) = common::sandbox(Settings { latency_ms: 20, ..Settings::default() }).await;
    let mut roles = Roles::spawn(&process_vars(&db, &prefix, &market));
    let workspaces: Vec<Principal> = (0..6).map(|_| common::principal()).collect();

    let creating = tokio::spawn(create_stores(roles.api_port, workspaces.clone(), N, 25));
    let (wait_db, wait_ws) = (db.clone(), workspaces.clone());
    let waiting = move |n: usize| Waiting { db: wait_db.clone(), workspaces: wait_ws.clone(), n };
    let started = Instant::now();
    fault(&mut pg, &waiting).await;
    let faulted = started.elapsed();
    let done_at_fault = succeeded(&db, &workspaces).await;
    assert!(done_at_fault < N, "the fault struck mid-run");

    let accepted = creating.await.expect("every store creation was accepted");
    all_succeed(&db, &workspaces, N, &roles).await;
    once_each(&db, &sandbox, &workspaces, &accepted).await;
    let exited = roles.exited();
    assert!(exited.is_empty(), "every role survives {name}; exited: {exited:?}\n{}", roles.logs());
    let retried = accepted.iter().filter(|a| a.tries > 1).count();
    let internal_errors: u32 = accepted.iter().map(|a| a.internal_errors).sum();
    assert_eq!(internal_errors, 0, "PostgreSQL going away ({name}) answers 503 with Retry-After, never 500");
    let stats = sandbox.stats();
    eprintln!(
        "{name}: {N} operations succeeded once each, {} marketplace effects ({} calls); fault over after {faulted:?} \
         with {done_at_fault} done; {retried} requests retried with their key (most sends: {}); all done {:?} after \
         the start; no role restarted",
        stats.effects,
        stats.calls,
        accepted.iter().map(|a| a.tries).max().unwrap_or(0),
        started.elapsed(),
    );
    assert!(roles.log("dispatcher").contains("LISTEN re-established"), "the dispatcher listens again");
}

/// Waits until `n` operations succeeded.
struct Waiting {
    db: Arc<TestDb>,
    workspaces: Vec<Principal>,
    n: usize,
}

impl Waiting {
    async fn wait(self) {
        let reached = common::eventually(Duration::from_secs(60), || async {
            (succeeded(&self.db, &self.workspaces).await >= self.n).then_some(())
        })
        .await;
        assert!(reached.is_some(), "{} operations succeeded before the fault", self.n);
    }
}

#[tokio::test]
async fn every_accepted_operation_completes_once_across_a_postgres_restart() {
    creations_survive("a PostgreSQL restart", async |pg, succeeded| {
        succeeded(25).wait().await;
        pg.stop_fast().await;
        // Down for a while: requests fail meanwhile and clients retry with their keys.
        tokio::time::sleep(Duration::from_secs(2)).await;
        pg.start_again().await;
    })
    .await;
}

#[tokio::test]
async fn every_accepted_operation_completes_once_across_a_postgres_crash() {
    creations_survive("a PostgreSQL crash (SIGKILL, then crash recovery)", async |pg, succeeded| {
        succeeded(25).wait().await;
        pg.kill_9().await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        pg.start_again().await;
    })
    .await;
}

#[tokio::test]
async fn every_accepted_operation_completes_once_across_two_connection_resets() {
    creations_survive("two resets of every connection", async |pg, succeeded| {
        succeeded(25).wait().await;
        let first = pg.terminate_backends().await;
        succeeded(60).wait().await;
        let second = pg.terminate_backends().await;
        eprintln!("terminated {first}, then {second} connections");
        assert!(first > 0 && second > 0, "the roles' connections were terminated");
    })
    .await;
}

#[tokio::test]
async fn after_a_restart_the_dispatcher_listens_again_and_relays_a_new_job_on_its_notification() {
    let mut pg = TestPostgres::start().await;
    let db = pg.test_db().await;
    let prefix = format!("conveyor-test-{}", Uuid::new_v4().simple());
    let (sandbox, market) = common::sandbox(Settings::default()).await;
    let mut vars = process_vars(&db, &prefix, &market);
    // No sweep during the test: a job relayed after the restart was relayed on its notification.
    vars.insert("CONVEYOR_DISPATCH_POLL".into(), "1h".into());
    let mut roles = Roles::spawn(&vars);
    let who = common::principal();

    let first = create_stores(roles.api_port, vec![who], 1, 10).await;
    all_succeed(&db, &[who], 1, &roles).await;
    let listened_before = roles.log("dispatcher").matches("LISTEN re-established").count();

    pg.stop_fast().await;
    pg.start_again().await;
    let relistened = common::eventually(Duration::from_secs(60), || async {
        (roles.log("dispatcher").matches("LISTEN re-established").count() > listened_before).then_some(())
    })
    .await;
    assert!(relistened.is_some(), "the dispatcher says it listens again\n{}", roles.logs());

    let second = create_stores(roles.api_port, vec![who], 1, 10).await;
    all_succeed(&db, &[who], 2, &roles).await;
    let accepted: Vec<Accepted> = first.into_iter().chain(second).collect();
    once_each(&db, &sandbox, &[who], &accepted).await;
    let exited = roles.exited();
    assert!(exited.is_empty(), "every role survives the restart; exited: {exited:?}\n{}", roles.logs());
}

/// A request whose statement is cut off by PostgreSQL (`57P01`, "terminating connection due to administrator command",
/// what every backend gets in a fast shutdown) answers `503` with `Retry-After`, not `500`; the same request sent again
/// once PostgreSQL serves is accepted.
#[tokio::test]
async fn a_request_whose_statement_postgres_terminates_answers_503_with_retry_after() {
    let app = common::TestApp::spawn().await;
    let who = common::principal();
    // The owner holds the stores table, so the request's statement waits on its lock, in flight.
    let mut owner = app.db.owner().await;
    sqlx::query("BEGIN").execute(&mut owner).await.unwrap();
    sqlx::query("LOCK TABLE conveyor_shop.stores IN ACCESS EXCLUSIVE MODE").execute(&mut owner).await.unwrap();
    let key = Uuid::new_v4().to_string();
    let sending = {
        let (http, url, token) = (app.http.clone(), app.url("/v1/stores"), app.token(who));
        let key = key.clone();
        tokio::spawn(async move {
            http.post(url)
                .bearer_auth(token)
                .header("idempotency-key", key)
                .json(&common::store_body("cut"))
                .send()
                .await
        })
    };
    // Its backend, waiting on the lock; terminated as a shutdown would (the application role may end its own).
    let mut app_conn = app.db.app_connection().await;
    let mut waiting = Vec::new();
    for _ in 0..100 {
        waiting = sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'
               AND usename = current_user AND pid <> pg_backend_pid()",
        )
        .fetch_all(&mut app_conn)
        .await
        .unwrap();
        if !waiting.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(!waiting.is_empty(), "the request's statement waits on the lock");
    for pid in waiting.iter().copied::<i32>() {
        sqlx::query("SELECT pg_terminate_backend($1)").bind(pid).execute(&mut app_conn).await.unwrap();
    }
    let answer = sending.await.unwrap().unwrap();
    let status = answer.status();
    let retry_after = answer.headers().get("retry-after").cloned();
    let body = answer.text().await.unwrap();
    assert_eq!(status, 503, "{body}");
    assert_eq!(retry_after.as_ref().map(|v| v.to_str().unwrap()), Some("1"));
    assert!(body.contains("SERVICE_UNAVAILABLE"), "{body}");
    sqlx::query("ROLLBACK").execute(&mut owner).await.unwrap();
    // Nothing half-done: the same key is accepted once PostgreSQL serves.
    let resp =
        app.send_with_key(reqwest::Method::POST, "/v1/stores", who, Some(&key), Some(&common::store_body("cut"))).await;
    assert_eq!(resp.status(), 202);
}

#[tokio::test]
async fn a_pool_checks_no_connection_it_used_an_instant_ago_and_comes_back_after_a_restart() {
    // Conveyor's pools check a connection before handing it out only when it sat idle a second or more: sqlx checks
    // every one, a round trip in the way of each statement and transaction. The price: PostgreSQL closing a connection
    // that was used an instant ago is seen by the next statement, which fails as one in flight would, and the pool
    // replaces the connection for the one after. After a restart, the pool's first statement works.
    let mut pg = TestPostgres::start().await;
    let pool = conveyor_jobs::connect_postgres(&pg.url("conveyor_app"), 1).await.unwrap();
    let backend = || async { sqlx::query_scalar::<_, i32>("SELECT pg_backend_pid()").fetch_one(&pool).await };
    let mut superuser = pg.superuser().await;
    let first = backend().await.unwrap();
    assert_eq!(backend().await.unwrap(), first, "one connection, used again");
    // Terminated through a connection already open: at once, well within the second.
    let terminated: bool =
        sqlx::query_scalar("SELECT pg_terminate_backend($1)").bind(first).fetch_one(&mut superuser).await.unwrap();
    assert!(terminated);
    assert!(backend().await.is_err(), "not checked: the statement met the closed connection");
    let second = backend().await.expect("a new connection");
    assert_ne!(second, first);
    drop(superuser);
    pg.stop_fast().await;
    pg.start_again().await;
    tokio::time::sleep(conveyor_jobs::POSTGRES_CHECK_IDLE_AFTER + Duration::from_millis(100)).await;
    assert_ne!(backend().await.expect("a live connection after the restart"), second);
}
