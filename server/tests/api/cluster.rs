//! Redis Cluster, for real: six `redis-server` processes on loopback (three masters with a replica each), the real
//! `conveyor` processes (api, dispatcher, worker, maintenance) on `redis-cluster://`, and the sandbox marketplace.
//! The whole path runs on the cluster. Each master is killed in turn during a burst, the first seed first and
//! silently (a dead host, not a reset connection), then the master of the queue's stream (SIGKILL), then the last one
//! silently: every accepted job is done within 30 s of each promotion, with one marketplace effect each. Behind Redis
//! Sentinel (`redis-sentinel://`), a SIGKILLed master, and a master dead silently with the first-listed of three
//! sentinels. Partitioned streams: one queue in four streams spread over the masters, a master killed under it, and
//! the partitions raised from one to four mid-run with nothing lost or doubled. Over TLS only (`rediss-cluster://`,
//! `rediss-sentinel://`, client certificates required): a master SIGKILLed under each, each master of the cluster killed
//! in turn (the first seed silently), and the start-up refusals.

use crate::common;

use std::collections::HashMap;
use std::time::Duration;

use common::cluster::{Death, RedisCluster, RedisSentinel};
use common::pki::Pki;
use common::roles::Roles;
use common::{Process, TestApp};
use conveyor_jobs::RedisKeys;
use conveyor_server::auth::Principal;
use conveyor_shop::adapters::sandbox::{Sandbox, Settings};
use serde_json::Value;
use uuid::Uuid;

/// The variables of every process of one run on the Redis at `redis_url`.
fn process_vars(app: &TestApp, redis_url: &str, market: &str) -> HashMap<String, String> {
    let mut vars = common::config_vars(&app.db, &app.redis_prefix);
    vars.insert("CONVEYOR_REDIS_URL".into(), redis_url.to_owned());
    vars.insert("CONVEYOR_ADMIN_ADDR".into(), format!("127.0.0.1:{}", common::free_port()));
    vars.insert("CONVEYOR_MARKETPLACE_URL".into(), market.to_owned());
    vars.insert("CONVEYOR_REDIS_COMMAND_TIMEOUT".into(), "2s".into());
    common::roles::quick_intervals(&mut vars);
    vars
}

/// Creates a store through the API process (retrying while it starts); its operation id.
async fn create_store(http: &reqwest::Client, port: u16, token: &str, n: usize) -> String {
    for _ in 0..200 {
        let sent = http
            .post(format!("http://127.0.0.1:{port}/v1/stores"))
            .bearer_auth(token)
            .header("idempotency-key", Uuid::new_v4().to_string())
            .json(&common::store_body(&format!("cluster-{n}")))
            .send()
            .await;
        match sent {
            Ok(resp) if resp.status() == 202 => {
                let body: Value = resp.json().await.unwrap();
                return body["operation"]["id"].as_str().unwrap().to_owned();
            }
            Ok(resp) => panic!("store creation answered {}: {}", resp.status(), resp.text().await.unwrap_or_default()),
            Err(e) if e.is_connect() => tokio::time::sleep(Duration::from_millis(100)).await,
            Err(e) => panic!("store creation failed: {e}"),
        }
    }
    panic!("the API process never listened");
}

/// Creates `n` stores over `workspaces`, eight requests at a time; their operation ids by workspace.
async fn create_stores(app: &TestApp, port: u16, workspaces: &[Principal], n: usize) -> Vec<(Principal, String)> {
    use futures_util::StreamExt;
    let http = reqwest::Client::new();
    futures_util::stream::iter(0..n)
        .map(|i| {
            let who = workspaces[i % workspaces.len()];
            let (http, token) = (http.clone(), app.token(who));
            async move { (who, create_store(&http, port, &token, i).await) }
        })
        .buffer_unordered(8)
        .collect()
        .await
}

/// Operations of `workspaces` by status.
async fn operation_statuses(app: &TestApp, workspaces: &[Principal]) -> HashMap<String, usize> {
    let mut by_status = HashMap::new();
    for who in workspaces {
        for op in app.db.rows("operations", who.workspace_id).await {
            *by_status.entry(op["status"].as_str().unwrap_or("?").to_owned()).or_default() += 1;
        }
    }
    by_status
}

/// Waits until every one of `n` operations succeeded, printing progress; panics with the logs otherwise.
async fn all_succeed(app: &TestApp, workspaces: &[Principal], n: usize, roles: &Roles, limit: Duration) {
    let started = std::time::Instant::now();
    let mut shown = started;
    let done = common::eventually(limit, || {
        let show = shown.elapsed() >= Duration::from_secs(5);
        if show {
            shown = std::time::Instant::now();
        }
        async move {
            let statuses = operation_statuses(app, workspaces).await;
            if show {
                let mut events: HashMap<String, usize> = HashMap::new();
                for who in workspaces {
                    for e in app.db.rows("outbox_events", who.workspace_id).await {
                        *events.entry(e["status"].as_str().unwrap_or("?").to_owned()).or_default() += 1;
                    }
                }
                eprintln!("after {:?}: operations {statuses:?}, events {events:?}", started.elapsed());
            }
            (statuses.get("succeeded").copied().unwrap_or(0) == n).then_some(())
        }
    })
    .await;
    if done.is_none() {
        let statuses = operation_statuses(app, workspaces).await;
        panic!("not every operation succeeded: {statuses:?}\n{}", roles.logs());
    }
}

/// One marketplace effect per store: as many effects as operations, each operation's key called.
fn one_effect_each(sandbox: &Sandbox, ops: &[(Principal, String)]) {
    let stats = sandbox.stats();
    assert_eq!(stats.effects, ops.len() as u64, "one marketplace effect per verification");
    for (_, op) in ops {
        assert!(stats.calls_by_key.get(op).is_some_and(|&c| c >= 1), "operation {op} reached the marketplace");
    }
}

async fn app_on(url: &str) -> TestApp {
    app_on_with(url, None).await
}

/// The API in the test's process on the Redis at `url`, over TLS with `pki`'s CA and client certificate.
async fn app_on_with(url: &str, pki: Option<&Pki>) -> TestApp {
    let url = url.to_owned();
    TestApp::spawn_with(move |v| {
        v.insert("CONVEYOR_REDIS_URL".into(), url);
        if let Some(pki) = pki {
            pki.redis_vars(v);
        }
    })
    .await
}

#[tokio::test]
async fn two_hundred_store_verifications_run_once_each_on_a_three_master_cluster() {
    let cluster = RedisCluster::start().await;
    let app = app_on(&cluster.url()).await;
    let (sandbox, market) = common::sandbox(Settings::default()).await;
    let roles = Roles::spawn(&process_vars(&app, &cluster.url(), &market));
    let workspaces: Vec<Principal> = (0..10).map(|_| common::principal()).collect();

    let ops = create_stores(&app, roles.api_port, &workspaces, 200).await;
    all_succeed(&app, &workspaces, 200, &roles, Duration::from_secs(120)).await;

    one_effect_each(&sandbox, &ops);
    let stats = sandbox.stats();
    let repeated: Vec<_> = stats.calls_by_key.iter().filter(|(_, c)| **c > 1).collect();
    assert!(repeated.is_empty(), "with no failure every job runs once: {repeated:?}");
    // Every processed entry was acknowledged and deleted on the master serving the queue.
    let stream = RedisKeys::new(&app.redis_prefix).stream("stores");
    let client = common::redis_client(&cluster.url()).await;
    let left = common::eventually(Duration::from_secs(20), || async {
        common::stream_event_ids(&client, &stream).await.is_empty().then_some(())
    })
    .await;
    assert!(left.is_some(), "the stream drains\n{}", roles.logs());
}

/// Creates 200 stores at 20 a second through the API process, with the queue in `partitions` streams, SIGKILLs a
/// master (with `kill`, given the key of the stream to hit: the whole one, or partition 1; it returns once a replica
/// took over) when 40 verifications are done, and checks that every one of them completes with one marketplace
/// effect each. Over TLS with `pki`'s CA and client certificate when given.
async fn verifications_survive_a_master_kill(
    url: String,
    pki: Option<&Pki>,
    partitions: u16,
    kill: impl AsyncFnOnce(&str) -> u16,
) {
    let app = app_on_with(&url, pki).await;
    let (sandbox, market) = common::sandbox(Settings { latency_ms: 20, ..Settings::default() }).await;
    let mut vars = process_vars(&app, &url, &market);
    vars.insert("CONVEYOR_STREAM_PARTITIONS".into(), partitions.to_string());
    if let Some(pki) = pki {
        pki.redis_vars(&mut vars);
    }
    let roles = Roles::spawn(&vars);
    let keys = RedisKeys::new(&app.redis_prefix);
    let client = common::redis_client_with(&url, &pki.map(Pki::redis_client).unwrap_or_default()).await;
    if partitions > 1 {
        partitions::layout_in_force(&client, &keys, partitions).await;
    }
    let workspaces: Vec<Principal> = (0..20).map(|_| common::principal()).collect();

    let port = roles.api_port;
    let creating = {
        let app_token: Vec<(Principal, String)> = workspaces.iter().map(|w| (*w, app.token(*w))).collect();
        tokio::spawn(async move {
            use futures_util::StreamExt;
            let http = reqwest::Client::new();
            let start = tokio::time::Instant::now();
            futures_util::stream::iter(0..200)
                .map(|i| {
                    let (who, token) = app_token[i % app_token.len()].clone();
                    let http = http.clone();
                    async move {
                        tokio::time::sleep_until(start + Duration::from_millis(50 * i as u64)).await;
                        (who, create_store(&http, port, &token, i).await)
                    }
                })
                .buffer_unordered(8)
                .collect::<Vec<_>>()
                .await
        })
    };
    // Mid-run: some verifications done, more on their way.
    let midway = common::eventually(Duration::from_secs(60), || async {
        (operation_statuses(&app, &workspaces).await.get("succeeded").copied().unwrap_or(0) >= 40).then_some(())
    })
    .await;
    assert!(midway.is_some(), "the run got going\n{}", roles.logs());
    let stream = match partitions {
        1 => keys.stream("stores"),
        _ => keys.partition_stream("stores", conveyor_jobs::Partition::Part(1)),
    };
    let killed_at = std::time::Instant::now();
    let killed = kill(&stream).await;
    let done_before = operation_statuses(&app, &workspaces).await.get("succeeded").copied().unwrap_or(0);
    eprintln!(
        "killed master 127.0.0.1:{killed}, which served {stream}; a replica took over in {:?}, {done_before} of 200 \
         done by then",
        killed_at.elapsed()
    );
    assert!(done_before < 200, "the master died mid-run");

    let ops = creating.await.expect("every store creation was accepted");
    all_succeed(&app, &workspaces, 200, &roles, Duration::from_secs(180)).await;
    one_effect_each(&sandbox, &ops);
    let stats = sandbox.stats();
    let repeated = stats.calls_by_key.values().filter(|c| **c > 1).count();
    eprintln!(
        "200 verifications, all done {:?} after the kill; {} marketplace calls, {repeated} repeated (answered by the key)",
        killed_at.elapsed(),
        stats.calls
    );
    if partitions > 1 {
        let mut used = Vec::new();
        for (_, stream) in partitions::streams(&keys, "stores", partitions) {
            used.push((partitions::entries_added(&client, &stream).await, stream));
        }
        eprintln!("entries added per stream: {used:?}");
        assert!(used.iter().filter(|(n, _)| *n > 0).count() >= 2, "the queue used several partitions: {used:?}");
    }
}

#[tokio::test]
async fn a_cluster_master_sigkilled_under_a_queue_in_four_partitions_loses_no_job_and_doubles_no_effect() {
    let mut cluster = RedisCluster::start().await;
    let url = cluster.url();
    verifications_survive_a_master_kill(url, None, 4, async |stream| cluster.kill_master_of(stream).await).await;
}

#[tokio::test]
async fn a_sentinel_failover_mid_run_loses_no_job_and_doubles_no_effect() {
    let mut sentinel = RedisSentinel::start().await;
    let url = sentinel.url();
    verifications_survive_a_master_kill(url, None, 1, async |_| sentinel.kill_master().await).await;
}

/// What [`burst_with_a_kill`] measured.
struct Round {
    /// The creations of the burst, by workspace.
    ops: Vec<(Principal, String)>,
    /// Seconds from the promotion to the last job of the burst done.
    after_promotion: f64,
}

/// The 30 s a failover may take, from the promotion of a replica to the last accepted job done.
const FAILOVER_BOUND: Duration = Duration::from_secs(30);

/// A burst of 200 store creations over 8 fresh workspaces (8 requests at a time, as fast as the API takes them);
/// `kill` runs 0.3 s into it and returns once a replica was promoted. Every job of the burst must be done within
/// [`FAILOVER_BOUND`] of that promotion.
async fn burst_with_a_kill(app: &TestApp, roles: &Roles, what: &str, kill: impl AsyncFnOnce()) -> Round {
    let workspaces: Vec<Principal> = (0..8).map(|_| common::principal()).collect();
    let creating = {
        let tokens: Vec<(Principal, String)> = workspaces.iter().map(|w| (*w, app.token(*w))).collect();
        let port = roles.api_port;
        tokio::spawn(async move {
            use futures_util::StreamExt;
            let http = reqwest::Client::new();
            futures_util::stream::iter(0..200)
                .map(|i| {
                    let (who, token) = tokens[i % tokens.len()].clone();
                    let http = http.clone();
                    async move { (who, create_store(&http, port, &token, i).await) }
                })
                .buffer_unordered(8)
                .collect::<Vec<_>>()
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let killed_at = std::time::Instant::now();
    kill().await;
    let promoted = std::time::Instant::now();
    let done_then = operation_statuses(app, &workspaces).await.get("succeeded").copied().unwrap_or(0);
    eprintln!("{what}: a replica took over {:?} after the kill, {done_then} of 200 done by then", promoted - killed_at);
    assert!(done_then < 200, "{what}: the kill fell in the burst");
    let ops = creating.await.expect("every store creation was accepted");
    let done = common::eventually(FAILOVER_BOUND.saturating_sub(promoted.elapsed()), || async {
        (operation_statuses(app, &workspaces).await.get("succeeded").copied().unwrap_or(0) == 200).then_some(())
    })
    .await;
    if done.is_none() {
        let statuses = operation_statuses(app, &workspaces).await;
        panic!("{what}: not every job done {FAILOVER_BOUND:?} after the promotion: {statuses:?}\n{}", roles.logs());
    }
    let after_promotion = promoted.elapsed().as_secs_f64();
    eprintln!("{what}: the last of 200 jobs done {after_promotion:.1} s after the promotion");
    Round { ops, after_promotion }
}

/// Kills each of the three masters in turn, each during a burst of 200 store creations, and requires every accepted
/// job done within 30 s of each promotion, with one marketplace effect each. The first kill is of the master every
/// URL names first, and the one fred tries first too (it walks its seeds in address order, and this one has the
/// lowest port); it dies silently, as a host does, and stays so for the rest of the test: every client that looks
/// for the cluster through its seeds meets it first. The master of the queue's stream dies in the first kill or the
/// second (SIGKILLed), the last master silently. The dispatcher and maintenance have the seeds as a comma list, the
/// API and the worker in fred's `?node=` form: both forms live through every kill.
#[tokio::test]
async fn each_master_killed_in_turn_first_seed_silently_every_job_done_within_30_s_of_each_promotion() {
    each_master_killed_in_turn(RedisCluster::start().await, None).await;
}

/// The body of the test above, on `cluster` (over TLS with `pki`'s CA and client certificate when given).
async fn each_master_killed_in_turn(mut cluster: RedisCluster, pki: Option<&Pki>) {
    let mut masters: Vec<u16> = cluster.masters().iter().map(|m| m.port).collect();
    masters.sort();
    let first_seed = masters[0];
    assert_eq!(Some(&first_seed), cluster.live_ports().iter().min(), "the lowest address is a master's");
    let of_stream = cluster.master_of(&RedisKeys::new("any").stream("stores"));
    let mut order = vec![first_seed];
    if of_stream != first_seed {
        order.push(of_stream);
    }
    order.extend(masters.iter().filter(|p| !order.contains(p)).collect::<Vec<_>>());
    let deaths = [Death::Silent, Death::Sigkill, Death::Silent];
    let commas = cluster.url_led_by(first_seed, true);
    let nodes = cluster.url_led_by(first_seed, false);
    let app = app_on_with(&nodes, pki).await;
    let (sandbox, market) = common::sandbox(Settings::default()).await;
    let mut vars = process_vars(&app, &commas, &market);
    if let Some(pki) = pki {
        pki.redis_vars(&mut vars);
    }
    let roles = Roles::spawn_each(&vars, |role, vars| {
        if matches!(role, "api" | "worker") {
            vars.insert("CONVEYOR_REDIS_URL".into(), nodes.clone());
        }
    });
    // Every role is up, and has run jobs, before the first kill.
    let warm: Vec<Principal> = (0..8).map(|_| common::principal()).collect();
    let mut ops = create_stores(&app, roles.api_port, &warm, 8).await;
    all_succeed(&app, &warm, 8, &roles, Duration::from_secs(60)).await;

    let mut figures = Vec::new();
    for (port, death) in order.into_iter().zip(deaths) {
        let mut what = format!("master 127.0.0.1:{port} killed ({death:?})");
        if port == first_seed {
            what.push_str(", the first seed");
        }
        if port == of_stream {
            what.push_str(", serving the queue's stream");
        }
        let round = burst_with_a_kill(&app, &roles, &what, async || cluster.kill_master(port, death).await).await;
        ops.extend(round.ops);
        one_effect_each(&sandbox, &ops);
        figures.push(format!("{what}: {:.1} s", round.after_promotion));
    }
    eprintln!("from each promotion to the last job of its burst done:\n  {}", figures.join("\n  "));
}

/// Behind three sentinels (quorum 2): during a burst of 200 store creations the sentinel every URL lists first is
/// SIGKILLed and the master dies silently; every accepted job must be done within 30 s of the promotion, with one
/// marketplace effect each. The dispatcher and maintenance list the sentinels with commas, the API and the worker in
/// fred's `?node=` form. (A sentinel that hangs, accepting connections and answering nothing, is another matter: see
/// the README's Redis Cluster and Sentinel notes.)
#[tokio::test]
async fn the_master_dead_silently_and_the_first_listed_sentinel_killed_every_job_done_within_30_s_of_the_promotion() {
    let mut sentinel = RedisSentinel::start_with(3).await;
    let (commas, nodes) = (sentinel.url_in(true), sentinel.url_in(false));
    let app = app_on(&nodes).await;
    let (sandbox, market) = common::sandbox(Settings::default()).await;
    let roles = Roles::spawn_each(&process_vars(&app, &commas, &market), |role, vars| {
        if matches!(role, "api" | "worker") {
            vars.insert("CONVEYOR_REDIS_URL".into(), nodes.clone());
        }
    });
    let warm: Vec<Principal> = (0..8).map(|_| common::principal()).collect();
    let mut ops = create_stores(&app, roles.api_port, &warm, 8).await;
    all_succeed(&app, &warm, 8, &roles, Duration::from_secs(60)).await;

    let what = "the first-listed sentinel killed (Sigkill), the master (Silent)";
    let round = burst_with_a_kill(&app, &roles, what, async || {
        sentinel.kill_sentinel(0, Death::Sigkill);
        sentinel.kill_master_by(Death::Silent).await;
    })
    .await;
    ops.extend(round.ops);
    one_effect_each(&sandbox, &ops);
}

#[tokio::test]
async fn the_start_up_check_finds_an_unsafe_eviction_policy_on_any_cluster_primary() {
    let cluster = RedisCluster::start().await;
    let client = common::redis_client(&cluster.url()).await;
    let check = conveyor_jobs::check_redis(&client).await.unwrap();
    assert_eq!(check.maxmemory_policy.as_deref(), Some("noeviction"));
    // One primary of three evicts: the check says so, whichever node the client would have asked first.
    let last = cluster.masters().last().unwrap().port;
    let set = std::process::Command::new("redis-cli")
        .args(["-p", &last.to_string(), "CONFIG", "SET", "maxmemory-policy", "allkeys-lru"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&set.stdout).contains("OK"));
    let check = conveyor_jobs::check_redis(&client).await.unwrap();
    assert_eq!(check.maxmemory_policy.as_deref(), Some("allkeys-lru"));
    assert!(check.version.starts_with('7'), "{check:?}");
}

/// Partitioned streams (`CONVEYOR_STREAM_PARTITIONS`).
mod partitions {
    use super::*;
    use conveyor_jobs::Partition;
    use conveyor_jobs::RedisClient;
    use conveyor_jobs::{Producer, StreamJobOptions as JobOptions, StreamMessage as Message};
    use fred::prelude::{KeysInterface, StreamsInterface};
    use fred::types::Value;

    /// How many entries were ever added to `stream` (`XINFO STREAM` `entries-added`; 0 for no stream).
    pub(super) async fn entries_added(client: &RedisClient, stream: &str) -> u64 {
        let info: Value = match client.xinfo_stream(stream, false, None).await {
            Ok(info) => info,
            Err(_) => return 0,
        };
        let pairs: Vec<(String, Value)> = match info {
            Value::Array(items) => {
                items.chunks(2).filter_map(|kv| Some((kv.first()?.as_string()?, kv.get(1)?.clone()))).collect()
            }
            Value::Map(map) => {
                map.inner().into_iter().filter_map(|(k, v)| Some((k.as_str()?.to_string(), v))).collect()
            }
            _ => Vec::new(),
        };
        pairs.into_iter().find(|(k, _)| k == "entries-added").and_then(|(_, v)| v.as_u64()).unwrap_or(0)
    }

    /// The whole stream and the first `n` partitions of `queue`.
    pub(super) fn streams(keys: &RedisKeys, queue: &str, n: u16) -> Vec<(Partition, String)> {
        std::iter::once(Partition::Whole)
            .chain((0..n).map(Partition::Part))
            .map(|p| (p, keys.partition_stream(queue, p)))
            .collect()
    }

    /// Waits until the layout's latest epoch has `partitions` and is in force.
    pub(super) async fn layout_in_force(client: &RedisClient, keys: &RedisKeys, partitions: u16) {
        let in_force = common::eventually(Duration::from_secs(30), || async {
            let layout: Option<String> = client.get(keys.layout()).await.ok().flatten();
            let (p, since) = layout?.rsplit(',').next()?.split_once('@').map(|(p, s)| (p.to_owned(), s.to_owned()))?;
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).ok()?.as_millis() as i64;
            (p.parse::<u16>().ok()? == partitions && since.parse::<i64>().ok()? + 200 <= now).then_some(())
        })
        .await;
        assert!(in_force.is_some(), "the layout reached {partitions} partitions");
    }

    fn message(workspace: Uuid, created_ms: i64) -> Message {
        Message {
            queue: "stores".into(),
            event_id: Uuid::now_v7(),
            workspace_id: workspace,
            event_type: "store.verify_credentials".into(),
            payload: "{}".into(),
            operation_id: None,
            attempt: 1,
            enqueued_at_ms: created_ms,
            due_at_ms: None,
            traceparent: String::new(),
            tracestate: None,
            redrive: 0,
            class: String::new(),
            options: JobOptions::default(),
        }
    }

    #[tokio::test]
    async fn a_job_handed_off_again_after_the_partitions_were_raised_lands_in_its_first_stream_only() {
        let cluster = RedisCluster::start().await;
        let client = common::redis_client(&cluster.url()).await;
        let keys = RedisKeys::new(&format!("conveyor-test-{}", Uuid::new_v4().simple()));
        let one = Producer::new(client.clone(), keys.clone(), Duration::from_secs(3600));
        let now = chrono::Utc::now().timestamp_millis();
        let workspaces: Vec<Uuid> = (0..16).map(|_| Uuid::new_v4()).collect();
        // Handed off under one partition, never recorded (its dispatcher died).
        let early: Vec<Message> = workspaces.iter().map(|w| message(*w, now)).collect();
        let first: Vec<String> = one.publish(&early).await.into_iter().map(Result::unwrap).collect();
        assert!(first.iter().all(|r| !r.contains('/')), "one partition: the whole stream, bare entry ids");

        // A dispatcher configured with four raises the layout; by the time the old jobs are handed off again, the
        // new epoch is in force.
        let four = Producer::new(client.clone(), keys.clone(), Duration::from_secs(3600)).with_partitions(4);
        assert!(four.publish(&[]).await.is_empty(), "publishing reads (and raises) the layout first");
        layout_in_force(&client, &keys, 4).await;
        let again: Vec<String> = four.publish(&early).await.into_iter().map(Result::unwrap).collect();
        assert_eq!(again, first, "each job found in its first stream by its de-dup key");
        let whole = keys.stream("stores");
        assert_eq!(entries_added(&client, &whole).await, early.len() as u64, "no entry added twice");

        // Jobs created under the new epoch spread over the partitions, each workspace keeping its own.
        let later = chrono::Utc::now().timestamp_millis();
        let fresh: Vec<Message> = workspaces.iter().flat_map(|w| [message(*w, later), message(*w, later)]).collect();
        let refs: Vec<String> = four.publish(&fresh).await.into_iter().map(Result::unwrap).collect();
        let partition_of = |r: &str| r.split_once('/').map(|(p, _)| p.to_owned()).expect("a partition's reference");
        for pair in refs.chunks(2) {
            assert_eq!(partition_of(&pair[0]), partition_of(&pair[1]), "one workspace, one partition: its order holds");
        }
        let used: std::collections::HashSet<String> = refs.iter().map(|r| partition_of(r)).collect();
        assert!(used.len() >= 2, "16 workspaces over 4 partitions use several: {used:?}");
        let mut added = 0;
        for (_, stream) in streams(&keys, "stores", 4) {
            added += entries_added(&client, &stream).await;
        }
        assert_eq!(added, (early.len() + fresh.len()) as u64);
        // A consumer configured with one partition reads all five streams once the layout names them.
        let consumer = conveyor_jobs::Consumer::new(
            client.clone(),
            common::redis_client(&cluster.url()).await,
            keys.clone(),
            "reader".into(),
        );
        assert_eq!(consumer.streams().await.unwrap().len(), 5);
    }

    /// Per stream of `stores` (whole, then partitions 0-3): entries ever added, and the master serving it.
    async fn spread(cluster: &RedisCluster, client: &RedisClient, keys: &RedisKeys) -> Vec<(Partition, u64, u16)> {
        let mut spread = Vec::new();
        for (partition, stream) in streams(keys, "stores", 4) {
            spread.push((partition, entries_added(client, &stream).await, cluster.master_of(&stream)));
        }
        spread
    }

    /// Waits until every stream of `stores` is empty (each processed entry acknowledged and deleted).
    async fn drained(client: &RedisClient, keys: &RedisKeys, roles: &Roles) {
        let empty = common::eventually(Duration::from_secs(30), || async {
            for (_, stream) in streams(keys, "stores", 4) {
                if client.xlen::<u64, _>(&stream).await.unwrap_or(1) > 0 {
                    return None;
                }
            }
            Some(())
        })
        .await;
        assert!(empty.is_some(), "every stream drains\n{}", roles.logs());
    }

    #[tokio::test]
    async fn a_queue_in_four_partitions_spreads_over_the_masters_and_runs_each_job_once() {
        let cluster = RedisCluster::start().await;
        let app = app_on(&cluster.url()).await;
        let (sandbox, market) = common::sandbox(Settings::default()).await;
        let mut vars = process_vars(&app, &cluster.url(), &market);
        vars.insert("CONVEYOR_STREAM_PARTITIONS".into(), "4".into());
        let roles = Roles::spawn(&vars);
        let client = common::redis_client(&cluster.url()).await;
        let keys = RedisKeys::new(&app.redis_prefix);
        layout_in_force(&client, &keys, 4).await;
        let workspaces: Vec<Principal> = (0..20).map(|_| common::principal()).collect();

        let ops = create_stores(&app, roles.api_port, &workspaces, 200).await;
        all_succeed(&app, &workspaces, 200, &roles, Duration::from_secs(120)).await;

        one_effect_each(&sandbox, &ops);
        let repeated = sandbox.stats().calls_by_key.values().filter(|c| **c > 1).count();
        assert_eq!(repeated, 0, "with no failure every job runs once");
        let spread = spread(&cluster, &client, &keys).await;
        eprintln!("entries added per stream (partition, entries, master port): {spread:?}");
        assert_eq!(spread.iter().map(|s| s.1).sum::<u64>(), 200, "each job added once, to one stream");
        assert_eq!(spread[0].1, 0, "nothing in the whole stream once the layout is in force");
        let masters: std::collections::HashSet<u16> = spread.iter().filter(|s| s.1 > 0).map(|s| s.2).collect();
        assert!(masters.len() >= 2, "one queue's entries spread over at least two masters: {spread:?}");
        drained(&client, &keys, &roles).await;
    }

    #[tokio::test]
    async fn raising_the_partitions_from_one_to_four_mid_run_loses_and_doubles_nothing() {
        let cluster = RedisCluster::start().await;
        let app = app_on(&cluster.url()).await;
        let (sandbox, market) = common::sandbox(Settings { latency_ms: 20, ..Settings::default() }).await;
        let mut vars = process_vars(&app, &cluster.url(), &market);
        vars.insert("CONVEYOR_DISPATCH_LEASE".into(), "5s".into());
        // The worker keeps its setting of one partition: it follows the layout the relay raises.
        let mut roles = Roles::spawn(&vars);
        let client = common::redis_client(&cluster.url()).await;
        let keys = RedisKeys::new(&app.redis_prefix);
        let workspaces: Vec<Principal> = (0..20).map(|_| common::principal()).collect();

        let port = roles.api_port;
        let tokens: Vec<(Principal, String)> = workspaces.iter().map(|w| (*w, app.token(*w))).collect();
        let creating = tokio::spawn(async move {
            use futures_util::StreamExt;
            let http = reqwest::Client::new();
            let start = tokio::time::Instant::now();
            futures_util::stream::iter(0..300)
                .map(|i| {
                    let (who, token) = tokens[i % tokens.len()].clone();
                    let http = http.clone();
                    async move {
                        tokio::time::sleep_until(start + Duration::from_millis(70 * i as u64)).await;
                        (who, create_store(&http, port, &token, i).await)
                    }
                })
                .buffer_unordered(8)
                .collect::<Vec<_>>()
                .await
        });
        let midway = common::eventually(Duration::from_secs(60), || async {
            (operation_statuses(&app, &workspaces).await.get("succeeded").copied().unwrap_or(0) >= 50).then_some(())
        })
        .await;
        assert!(midway.is_some(), "the run got going\n{}", roles.logs());
        // The dispatcher dies wherever it is; its successor is configured with four partitions.
        let at = roles.processes.iter().position(|(role, _)| *role == "dispatcher").unwrap();
        roles.processes[at].1.kill();
        let mut four = vars.clone();
        four.insert("CONVEYOR_STREAM_PARTITIONS".into(), "4".into());
        four.insert("CONVEYOR_ADMIN_ADDR".into(), format!("127.0.0.1:{}", common::free_port()));
        roles.processes[at] = ("dispatcher", Process::spawn(&["dispatcher"], &four));

        let ops = creating.await.expect("every store creation was accepted");
        all_succeed(&app, &workspaces, 300, &roles, Duration::from_secs(120)).await;
        one_effect_each(&sandbox, &ops);
        let spread = spread(&cluster, &client, &keys).await;
        eprintln!("entries added per stream (partition, entries, master port): {spread:?}");
        assert_eq!(spread.iter().map(|s| s.1).sum::<u64>(), 300, "each job added once, to one stream");
        assert!(spread[0].1 > 0, "jobs from before the raise went to the whole stream");
        let masters: std::collections::HashSet<u16> = spread.iter().filter(|s| s.1 > 0).map(|s| s.2).collect();
        assert!(spread[1..].iter().filter(|s| s.1 > 0).count() >= 2, "later jobs spread over the partitions");
        assert!(masters.len() >= 2, "over at least two masters: {spread:?}");
        drained(&client, &keys, &roles).await;
        let worker = &roles.processes.iter().find(|(role, _)| *role == "worker").unwrap().1;
        assert!(worker.log().contains("More stream partitions; reading them too"), "{}", worker.log());
    }
}

/// The same runs with every Redis process speaking TLS only (`rediss-cluster://`, `rediss-sentinel://`): to clients,
/// who must present a certificate of the test's CA, on the cluster bus, and between masters, replicas and sentinels.
/// A master is SIGKILLed mid-run under each; and a plain URL or a CA that did not sign the servers' certificates
/// stops a process at start-up with a message naming the variable to fix.
mod over_tls {
    use super::*;

    #[tokio::test]
    async fn a_tls_only_cluster_master_sigkilled_under_four_partitions_loses_no_job_and_doubles_no_effect() {
        let pki = Pki::new();
        let mut cluster = RedisCluster::start_tls(pki.redis_server()).await;
        let url = cluster.url();
        assert!(url.starts_with("rediss-cluster://"), "{url}");
        verifications_survive_a_master_kill(url, Some(&pki), 4, async |stream| cluster.kill_master_of(stream).await)
            .await;
    }

    #[tokio::test]
    async fn each_master_of_a_tls_only_cluster_killed_in_turn_first_seed_silently_every_job_done_within_30_s() {
        let pki = Pki::new();
        let cluster = RedisCluster::start_tls(pki.redis_server()).await;
        assert!(cluster.url().starts_with("rediss-cluster://"));
        each_master_killed_in_turn(cluster, Some(&pki)).await;
    }

    #[tokio::test]
    async fn a_tls_only_sentinel_failover_mid_run_loses_no_job_and_doubles_no_effect() {
        let pki = Pki::new();
        let mut sentinel = RedisSentinel::start_tls(pki.redis_server()).await;
        let url = sentinel.url();
        assert!(url.starts_with("rediss-sentinel://"), "{url}");
        verifications_survive_a_master_kill(url, Some(&pki), 1, async |_| sentinel.kill_master().await).await;
    }

    #[tokio::test]
    async fn a_plain_url_or_a_wrong_ca_to_a_tls_only_cluster_or_sentinel_fails_at_start_up_naming_the_variable() {
        let pki = Pki::new();
        let cluster = RedisCluster::start_tls(pki.redis_server()).await;
        let sentinel = RedisSentinel::start_tls(pki.redis_server()).await;
        let db = common::TestDb::create().await;
        let base = {
            let mut vars = common::config_vars(&db, "conveyor-tls-refused");
            vars.insert("CONVEYOR_ADMIN_ADDR".into(), format!("127.0.0.1:{}", common::free_port()));
            vars.insert("CONVEYOR_REDIS_COMMAND_TIMEOUT".into(), "2s".into());
            vars
        };
        for url in [cluster.url(), sentinel.url()] {
            // The plain form of the URL, no TLS files: the servers speak TLS only.
            let mut plain = base.clone();
            plain.insert("CONVEYOR_REDIS_URL".into(), url.replacen("rediss-", "redis-", 1));
            let log = Process::spawn(&["dispatcher"], &plain).fails_at_start().await;
            assert!(log.contains("CONVEYOR_REDIS_URL") && log.contains("rediss"), "{url} in plain text:\n{log}");

            // The TLS URL verified against a CA that did not sign the servers' certificates.
            let mut wrong_ca = base.clone();
            wrong_ca.insert("CONVEYOR_REDIS_URL".into(), url.clone());
            pki.redis_vars(&mut wrong_ca);
            wrong_ca.insert("CONVEYOR_REDIS_CA_FILE".into(), pki.other_ca_file.display().to_string());
            let log = Process::spawn(&["dispatcher"], &wrong_ca).fails_at_start().await;
            assert!(
                log.contains("CONVEYOR_REDIS_CA_FILE") && log.contains("certificate"),
                "{url} with another CA:\n{log}"
            );

            // And with the right files, the same process starts and reaches Redis over TLS.
            let mut right = wrong_ca.clone();
            pki.redis_vars(&mut right);
            let mut process = Process::spawn(&["dispatcher"], &right);
            let ready = common::eventually(Duration::from_secs(30), || {
                let (exited, log) = (process.child.try_wait().ok().flatten(), process.log());
                let url = &url;
                async move {
                    assert!(exited.is_none(), "{url} with the right CA exited:\n{log}");
                    log.contains("Dispatcher started").then_some(())
                }
            })
            .await;
            assert!(ready.is_some(), "{url} with the right CA did not start:\n{}", process.log());
        }
    }
}

/// A sentinel that answers and a master that refuses the client (it requires a password the URL does not give): the
/// start-up error is the master's refusal, with nothing said of the sentinels (they answered), and the process stops.
#[tokio::test]
async fn a_master_refusing_the_client_behind_a_healthy_sentinel_is_reported_as_the_masters_refusal() {
    let sentinel = RedisSentinel::start_with_password("not-given").await;
    let db = common::TestDb::create().await;
    let mut vars = common::config_vars(&db, "conveyor-sentinel-auth");
    vars.insert("CONVEYOR_ADMIN_ADDR".into(), format!("127.0.0.1:{}", common::free_port()));
    vars.insert("CONVEYOR_REDIS_URL".into(), sentinel.url());
    vars.insert("CONVEYOR_REDIS_COMMAND_TIMEOUT".into(), "2s".into());
    let log = Process::spawn(&["dispatcher"], &vars).fails_at_start().await;
    assert!(log.contains("CONVEYOR_REDIS_URL"), "{log}");
    assert!(log.to_uppercase().contains("NOAUTH"), "the master's refusal: {log}");
    let lower = log.to_lowercase();
    assert!(!lower.contains("first sentinel") && !lower.contains("unknown command"), "the sentinels answered: {log}");
}
