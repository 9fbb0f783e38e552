//! The history check: a minute of load through the real `conveyor` processes while a chaos task SIGKILLs a random one
//! of the API, the dispatcher and the worker every one to four seconds and starts it again, as Kubernetes would. Six
//! clients in three workspaces create stores and replace their credentials, each request with an idempotency key of
//! its own, retried with the same key until it gets a definite answer. After the load the system drains, and a
//! checker reads the history back from PostgreSQL and the sandbox marketplace:
//!
//! - lost: an accepted request whose operation is missing or did not succeed, a verification that says it asked the
//!   marketplace with no effect there, a store whose credentials are older than the replacements accepted for it;
//! - doubled: an operation, store or job no request asked for, a second job of one operation, credentials replaced
//!   more often than accepted, a marketplace effect that belongs to no operation (or to one twice).
//!
//! It prints `kills=N operations=N lost=0 doubled=0` and requires both zero.

use crate::common;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Process, TestDb};
use conveyor_server::auth::{Principal, TokenKeys};
use conveyor_server::config::Secret;
use conveyor_shop::adapters::sandbox::{Sandbox, Settings};
use rand::Rng;
use serde_json::{Value, json};
use tokio::sync::Mutex;
use uuid::Uuid;

/// How long the clients send requests, and the chaos task kills (at least).
const LOAD: Duration = Duration::from_secs(60);

/// Kills at least, however long that takes past [`LOAD`].
const MIN_KILLS: usize = 20;

/// The roles the chaos task kills.
const VICTIMS: [&str; 3] = ["api", "dispatcher", "worker"];

/// The variables of every process of the run.
fn process_vars(db: &TestDb, prefix: &str, market: &str, api_port: u16) -> HashMap<String, String> {
    let mut vars = common::config_vars(db, prefix);
    vars.insert("CONVEYOR_MARKETPLACE_URL".into(), market.to_owned());
    vars.insert("CONVEYOR_HTTP_ADDR".into(), format!("127.0.0.1:{api_port}"));
    vars.insert("CONVEYOR_DISPATCH_POLL".into(), "200ms".into());
    // A killed dispatcher's claims are taken over after the lease; a killed worker's entries after the visibility.
    vars.insert("CONVEYOR_DISPATCH_LEASE".into(), "3s".into());
    vars.insert("CONVEYOR_MAINTENANCE_INTERVAL".into(), "1s".into());
    vars.insert("CONVEYOR_OPERATION_KEEPALIVE".into(), "2s".into());
    vars.insert("CONVEYOR_RECONCILE_AFTER".into(), "10s".into());
    // The crash points held open a little now and then (a blocking sleep, 10% of the times each is passed), so that
    // the random kills land in them often: the API after its commit and before its answer, the dispatcher after XADD
    // and before the mark, the worker after the job's commit and before its XACK.
    vars.insert(
        "FAILPOINTS".into(),
        "api::after_commit=10%sleep(300);dispatcher::after_xadd=10%sleep(300);worker::before_ack=10%sleep(300)".into(),
    );
    vars.insert("RUST_LOG".into(), "info".into());
    vars
}

/// The processes of the run: one per role, started again after each kill; the killed ones are kept for their logs.
struct Fleet {
    vars: HashMap<String, String>,
    running: HashMap<&'static str, Process>,
    killed: Vec<(&'static str, Process)>,
}

impl Fleet {
    fn start(vars: HashMap<String, String>) -> Self {
        let mut fleet = Self { vars, running: HashMap::new(), killed: Vec::new() };
        for role in ["api", "dispatcher", "worker", "maintenance"] {
            fleet.spawn(role);
        }
        fleet
    }

    fn spawn(&mut self, role: &'static str) {
        let mut vars = self.vars.clone();
        vars.insert("CONVEYOR_ADMIN_ADDR".into(), format!("127.0.0.1:{}", common::free_port()));
        self.running.insert(role, Process::spawn(&[role], &vars));
    }

    /// SIGKILLs the process of `role` (and reaps it).
    fn kill(&mut self, role: &'static str) {
        if let Some(mut process) = self.running.remove(role) {
            process.kill();
            self.killed.push((role, process));
        }
    }

    /// Starts again every role whose process is not running (killed, or exited on its own: counted in the second).
    fn restart_missing(&mut self) -> usize {
        let mut exited = 0;
        for role in ["api", "dispatcher", "worker", "maintenance"] {
            let gone = match self.running.get_mut(role) {
                None => true,
                Some(p) => {
                    let ended = p.child.try_wait().ok().flatten().is_some();
                    if ended {
                        exited += 1;
                        eprintln!("{role} exited on its own:\n{}", tail(&p.log(), 20));
                        let p = self.running.remove(role).expect("present");
                        self.killed.push((role, p));
                    }
                    ended
                }
            };
            if gone {
                self.spawn(role);
            }
        }
        exited
    }

    /// The end of each running process's log, for a failure message.
    fn logs(&self) -> String {
        self.running.iter().map(|(role, p)| format!("----- {role}\n{}\n", tail(&p.log(), 40))).collect()
    }
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// What a request did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// `POST /v1/stores`.
    Create,
    /// `PUT /v1/stores/{id}/authorization`.
    Replace,
}

/// An accepted request, as its client saw it.
#[derive(Clone, Debug)]
struct Accepted {
    kind: Kind,
    store: String,
    operation: String,
    /// Sends it took: more than one is a retry with the same key.
    tries: u32,
}

/// Sends one write with `key` until a definite answer: a connection error, a time-out, a `5xx` or `409
/// IDEMPOTENCY_REQUEST_IN_PROGRESS` is retried with the same key. The accepted answer's body and the sends it took;
/// panics on any other answer.
async fn until_accepted(request: impl Fn() -> reqwest::RequestBuilder, key: &str) -> (Value, u32) {
    let mut tries = 0;
    loop {
        tries += 1;
        match request().header("idempotency-key", key).send().await {
            Ok(resp) if resp.status() == 202 => {
                // An answer cut off half-way is asked for again: the key replays it.
                if let Ok(answer) = resp.json::<Value>().await {
                    return (answer, tries);
                }
            }
            Ok(resp) if resp.status().is_server_error() => {}
            Ok(resp) if resp.status() == 409 => {
                let text = resp.text().await.unwrap_or_default();
                assert!(text.contains("IDEMPOTENCY_REQUEST_IN_PROGRESS"), "unexpected conflict: {text}");
            }
            Ok(resp) => panic!("a write answered {}: {}", resp.status(), resp.text().await.unwrap_or_default()),
            Err(_) => {}
        }
        assert!(tries < 3000, "no definite answer to key {key}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One client: until `until`, creates a store or replaces the credentials of one it created, one request at a time,
/// with a short pause between them. Every request it got accepted.
async fn client(who: Principal, port: u16, until: Instant) -> Vec<Accepted> {
    let http = reqwest::Client::builder().timeout(Duration::from_secs(15)).build().unwrap();
    let token = TokenKeys::new(&Secret::new(common::JWT_SECRET.as_bytes().to_vec())).mint(who, LOAD * 10);
    let base = format!("http://127.0.0.1:{port}");
    let mut accepted: Vec<Accepted> = Vec::new();
    let mut stores: Vec<String> = Vec::new();
    while Instant::now() < until {
        let key = Uuid::new_v4().to_string();
        let (replace, pick, pause) = {
            let mut rng = rand::rng();
            (
                !stores.is_empty() && rng.random_bool(0.4),
                rng.random_range(0..stores.len().max(1)),
                rng.random_range(20..120),
            )
        };
        let (kind, (answer, tries)) = if replace {
            let url = format!("{base}/v1/stores/{}/authorization", stores[pick]);
            let body = json!({ "credentials": { "api_key": format!("key-{key}"), "api_secret": "s" } });
            (Kind::Replace, until_accepted(|| http.put(&url).bearer_auth(&token).json(&body), &key).await)
        } else {
            let (url, body) = (format!("{base}/v1/stores"), common::store_body(&key));
            (Kind::Create, until_accepted(|| http.post(&url).bearer_auth(&token).json(&body), &key).await)
        };
        let store = answer["store"]["id"].as_str().expect("the answer names the store").to_owned();
        let operation = answer["operation"]["id"].as_str().expect("the answer names the operation").to_owned();
        if kind == Kind::Create {
            stores.push(store.clone());
        }
        accepted.push(Accepted { kind, store, operation, tries });
        tokio::time::sleep(Duration::from_millis(pause)).await;
    }
    accepted
}

/// Kills a random victim every one to four seconds and starts it again, until `until` and at least [`MIN_KILLS`]
/// kills; also starts again any role that exited on its own. Kills by role, and how many exited on their own.
async fn chaos(fleet: Arc<Mutex<Fleet>>, until: Instant) -> (HashMap<&'static str, usize>, usize) {
    let (mut kills, mut exited): (HashMap<&'static str, usize>, usize) = (HashMap::new(), 0);
    while Instant::now() < until || kills.values().sum::<usize>() < MIN_KILLS {
        let (wait, victim, down) = {
            let mut rng = rand::rng();
            (rng.random_range(1000..4000), VICTIMS[rng.random_range(0..VICTIMS.len())], rng.random_range(0..500))
        };
        tokio::time::sleep(Duration::from_millis(wait)).await;
        fleet.lock().await.kill(victim);
        *kills.entry(victim).or_default() += 1;
        // Down for a moment, as a pod being rescheduled.
        tokio::time::sleep(Duration::from_millis(down)).await;
        exited += fleet.lock().await.restart_missing();
    }
    (kills, exited)
}

/// What PostgreSQL holds for the workspaces: operations (id → status, result), stores, credential versions by store,
/// jobs by operation.
#[derive(Default)]
struct Recorded {
    operations: HashMap<String, (String, Value)>,
    stores: HashSet<String>,
    versions: HashMap<String, i64>,
    jobs: HashMap<String, i64>,
}

async fn recorded(db: &TestDb, workspaces: &[Principal]) -> Recorded {
    let mut all = Recorded::default();
    for who in workspaces {
        let mut tx = conveyor_jobs::begin_workspace(&db.pool, who.workspace_id).await.unwrap();
        let ops: Vec<(Uuid, String, Option<Value>)> =
            sqlx::query_as("SELECT id, status, result FROM conveyor.operations").fetch_all(&mut *tx).await.unwrap();
        let versions: Vec<(Uuid, i32)> =
            sqlx::query_as("SELECT store_id, version FROM conveyor_shop.store_credentials")
                .fetch_all(&mut *tx)
                .await
                .unwrap();
        let stores: Vec<(Uuid,)> =
            sqlx::query_as("SELECT id FROM conveyor_shop.stores").fetch_all(&mut *tx).await.unwrap();
        let jobs: Vec<(Uuid, i64)> = sqlx::query_as(
            "SELECT operation_id, count(*) FROM conveyor.outbox_events WHERE operation_id IS NOT NULL GROUP BY operation_id",
        )
        .fetch_all(&mut *tx)
        .await
        .unwrap();
        tx.commit().await.unwrap();
        all.operations.extend(ops.into_iter().map(|(id, s, r)| (id.to_string(), (s, r.unwrap_or(Value::Null)))));
        all.versions.extend(versions.into_iter().map(|(id, v)| (id.to_string(), i64::from(v))));
        all.stores.extend(stores.into_iter().map(|(id,)| id.to_string()));
        all.jobs.extend(jobs.into_iter().map(|(id, n)| (id.to_string(), n)));
    }
    all
}

/// Waits until every accepted operation has finished (or a generous limit passes), printing progress.
async fn drain(db: &TestDb, workspaces: &[Principal], accepted: &[Accepted]) {
    let started = Instant::now();
    let mut shown = Instant::now();
    common::eventually(Duration::from_secs(240), || {
        let show = shown.elapsed() >= Duration::from_secs(10);
        if show {
            shown = Instant::now();
        }
        async move {
            let ops = recorded(db, workspaces).await.operations;
            let open = accepted
                .iter()
                .filter(|a| !ops.get(&a.operation).is_some_and(|(s, _)| matches!(s.as_str(), "succeeded" | "failed")))
                .count();
            if show {
                eprintln!("draining for {:?}: {open} operations still open", started.elapsed());
            }
            (open == 0).then_some(())
        }
    })
    .await;
}

/// Every way the history can lose or double work, counted, with the first few of each for the report.
#[derive(Debug, Default)]
struct Verdict {
    lost: Vec<String>,
    doubled: Vec<String>,
    /// Operations whose verification asked the marketplace (the rest found their credentials superseded).
    asked: usize,
}

fn check(accepted: &[Accepted], db: &Recorded, sandbox: &Sandbox) -> Verdict {
    let mut v = Verdict::default();
    let effects = sandbox.stats();
    let requested: HashSet<&str> = accepted.iter().map(|a| a.operation.as_str()).collect();
    if requested.len() != accepted.len() {
        v.doubled.push(format!("{} requests share an operation", accepted.len() - requested.len()));
    }
    for a in accepted {
        match db.operations.get(&a.operation) {
            None => v.lost.push(format!("operation {} of an accepted request is missing", a.operation)),
            Some((status, _)) if status != "succeeded" => {
                v.lost.push(format!("operation {} ended {status}", a.operation));
            }
            Some((_, result)) => {
                // A verification that asked the marketplace left an effect there, under its operation's key.
                let asked = matches!(result["outcome"].as_str(), Some("active" | "invalid_credentials"));
                v.asked += usize::from(asked);
                if asked && !effects.calls_by_key.contains_key(&a.operation) {
                    v.lost.push(format!("operation {} says it verified, but the marketplace saw nothing", a.operation));
                }
            }
        }
    }
    for id in db.operations.keys().filter(|id| !requested.contains(id.as_str())) {
        v.doubled.push(format!("operation {id} belongs to no accepted request"));
    }
    for (op, n) in db.jobs.iter().filter(|(_, n)| **n > 1) {
        v.doubled.push(format!("operation {op} has {n} jobs"));
    }
    let created: HashSet<&str> = accepted.iter().filter(|a| a.kind == Kind::Create).map(|a| a.store.as_str()).collect();
    if created.len() != accepted.iter().filter(|a| a.kind == Kind::Create).count() {
        v.doubled.push("two creations answered with one store".to_owned());
    }
    for store in db.stores.iter().filter(|s| !created.contains(s.as_str())) {
        v.doubled.push(format!("store {store} belongs to no accepted creation"));
    }
    for store in &created {
        let replaced = accepted.iter().filter(|a| a.kind == Kind::Replace && a.store == *store).count() as i64;
        match db.versions.get(*store) {
            None => v.lost.push(format!("store {store} has no credentials")),
            Some(&version) if version < replaced + 1 => {
                v.lost
                    .push(format!("store {store} at credentials version {version}, {replaced} replacements accepted"));
            }
            Some(&version) if version > replaced + 1 => v
                .doubled
                .push(format!("store {store} at credentials version {version}, {replaced} replacements accepted")),
            Some(_) => {}
        }
    }
    for key in effects.calls_by_key.keys().filter(|k| !requested.contains(k.as_str())) {
        v.doubled.push(format!("marketplace effect under {key} belongs to no operation"));
    }
    if effects.effects != effects.calls_by_key.len() as u64 {
        v.doubled.push(format!("{} effects under {} keys", effects.effects, effects.calls_by_key.len()));
    }
    v
}

#[tokio::test]
async fn a_minute_of_random_sigkills_loses_no_accepted_operation_and_doubles_no_effect() {
    let set_up = Instant::now();
    let db = Arc::new(TestDb::create().await);
    let prefix = format!("conveyor-test-{}", Uuid::new_v4().simple());
    let (sandbox, market) = common::sandbox(Settings { latency_ms: 10, ..Settings::default() }).await;
    let api_port = common::free_port();
    let fleet = Arc::new(Mutex::new(Fleet::start(process_vars(&db, &prefix, &market, api_port))));
    let workspaces: Vec<Principal> = (0..3).map(|_| common::principal()).collect();

    let started = Instant::now();
    let set_up = started - set_up;
    let until = started + LOAD;
    let clients: Vec<_> =
        (0..6).map(|i| tokio::spawn(client(workspaces[i % workspaces.len()], api_port, until))).collect();
    let chaos = tokio::spawn(chaos(fleet.clone(), until));
    let mut accepted = Vec::new();
    for c in clients {
        accepted.extend(c.await.expect("every client got a definite answer to every request"));
    }
    let (kills, exited) = chaos.await.expect("the chaos task ran");
    let loaded = started.elapsed();
    fleet.lock().await.restart_missing();

    drain(&db, &workspaces, &accepted).await;
    let verdict = check(&accepted, &recorded(&db, &workspaces).await, &sandbox);
    let total_kills: usize = kills.values().sum();
    let retried = accepted.iter().filter(|a| a.tries > 1).count();
    let stats = sandbox.stats();
    eprintln!(
        "set up in {set_up:?}; load {loaded:?} with kills {kills:?} ({exited} exits on their own); {} accepted \
         requests ({} creations, {} replacements), {retried} retried with their key; {} verifications asked the \
         marketplace: {} effects, {} calls; drained {:?} after the load",
        accepted.len(),
        accepted.iter().filter(|a| a.kind == Kind::Create).count(),
        accepted.iter().filter(|a| a.kind == Kind::Replace).count(),
        verdict.asked,
        stats.effects,
        stats.calls,
        started.elapsed() - loaded,
    );
    println!(
        "kills={total_kills} operations={} lost={} doubled={}",
        accepted.len(),
        verdict.lost.len(),
        verdict.doubled.len()
    );
    let logs = fleet.lock().await.logs();
    assert!(total_kills >= MIN_KILLS, "at least {MIN_KILLS} kills");
    assert!(verdict.asked > 0, "the checker reads the verifications' outcomes");
    assert!(verdict.lost.is_empty(), "lost: {:?}\n{logs}", &verdict.lost[..verdict.lost.len().min(10)]);
    assert!(verdict.doubled.is_empty(), "doubled: {:?}\n{logs}", &verdict.doubled[..verdict.doubled.len().min(10)]);
}
