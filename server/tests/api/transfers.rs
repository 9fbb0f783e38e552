//! Asset transfers: the endpoint, SSRF refusals (at the API, on resolution, on redirects), limits, resumption after
//! a dropped connection and after a killed worker, and the media a transfer becomes.

use crate::common;

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::{Process, TestApp, principal};
use conveyor_jobs::Metrics;
use conveyor_server::auth::Principal;
use conveyor_server::http::AppState;
use conveyor_shop::adapters::fetch::{
    FetchError, FetchSettings, Fetcher, PartSink, Progress, Resolver, Resolving, SinkError,
};
use conveyor_shop::adapters::sandbox::{Sandbox, Settings, files};
use reqwest::Method;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const LOOPBACK: &str = "127.0.0.0/8";

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// The port of `url` as `CONVEYOR_ASSET_ALLOWED_PORTS` takes it: transfers reach ports 80 and 443 only unless it
/// lists more, and the loopback sandbox listens on a random port.
fn port_of(url: &str) -> String {
    url::Url::parse(url).unwrap().port_or_known_default().unwrap().to_string()
}

/// An API whose transfers may reach `allowed` (the loopback sandbox with [`LOOPBACK`]; "" for the default policy)
/// and the sandbox's port, and whose worker calls the sandbox at `sandbox_url`.
async fn app(allowed: &str, sandbox_url: &str, extra: &[(&str, &str)]) -> TestApp {
    let (allowed, sandbox_url) = (allowed.to_owned(), sandbox_url.to_owned());
    let extra: Vec<(String, String)> = extra.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    TestApp::spawn_with(move |vars| {
        vars.insert("CONVEYOR_ASSET_ALLOWED_NETWORKS".into(), allowed);
        vars.insert("CONVEYOR_ASSET_ALLOWED_PORTS".into(), port_of(&sandbox_url));
        vars.insert("CONVEYOR_MARKETPLACE_URL".into(), sandbox_url);
        vars.extend(extra);
    })
    .await
}

/// A dispatcher and the shipped worker (every handler), in-process, until `shutdown`.
async fn run_pipeline(app: &TestApp, shutdown: &CancellationToken) {
    let dispatcher = common::test_dispatcher(app, &common::redis_url(), |v| {
        v.insert("CONVEYOR_DISPATCH_POLL".into(), "100ms".into());
    })
    .await;
    common::run_dispatcher(dispatcher, shutdown);
    let state = AppState(Arc::new(conveyor_server::app::connect_state(&app.config, Metrics::new()).await.unwrap()));
    let worker = conveyor_server::app::build_worker(&app.config, &state).await.unwrap();
    tokio::spawn(worker.run(shutdown.clone(), Duration::from_secs(5)));
}

async fn create(app: &TestApp, who: Principal, source_url: &str, filename: &str) -> reqwest::Response {
    app.send(Method::POST, "/v1/asset-transfers", who, Some(&json!({"source_url": source_url, "filename": filename})))
        .await
}

/// Creates a transfer, answering (transfer id, operation id).
async fn start(app: &TestApp, who: Principal, source_url: &str) -> (String, String) {
    let resp = create(app, who, source_url, "picture.png").await;
    assert_eq!(resp.status(), 202, "{}", resp.text().await.unwrap());
    let v: Value = resp.json().await.unwrap();
    (v["asset_transfer"]["id"].as_str().unwrap().to_owned(), v["operation"]["id"].as_str().unwrap().to_owned())
}

async fn transfer(app: &TestApp, who: Principal, id: &str) -> Value {
    app.send(Method::GET, &format!("/v1/asset-transfers/{id}"), who, None).await.json().await.unwrap()
}

/// Waits until the transfer has ended (completed or failed), answering it.
async fn ended(app: &TestApp, who: Principal, id: &str, limit: Duration) -> Value {
    common::eventually(limit, || async {
        let t = transfer(app, who, id).await;
        matches!(t["status"].as_str(), Some("completed" | "failed")).then_some(t)
    })
    .await
    .unwrap_or_else(|| panic!("transfer {id} did not end"))
}

#[tokio::test]
async fn a_transfer_is_accepted_replayed_and_shown_to_its_workspace_only() {
    let app = app("", "http://127.0.0.1:9", &[]).await;
    let who = principal();
    let body = json!({"source_url": "https://cdn.example.com/images/shoe.png", "filename": "shoe.png"});
    let key = Uuid::new_v4().to_string();
    let resp = app.send_with_key(Method::POST, "/v1/asset-transfers", who, Some(&key), Some(&body)).await;
    assert_eq!(resp.status(), 202);
    let location = resp.headers()["location"].to_str().unwrap().to_owned();
    let first: Value = resp.json().await.unwrap();
    let id = first["asset_transfer"]["id"].as_str().unwrap().to_owned();
    assert_eq!(first["asset_transfer"]["status"], "queued");
    assert_eq!(first["operation"]["kind"], "asset.transfer");
    assert_eq!(first["operation"]["status"], "queued");
    assert_eq!(location, format!("/v1/operations/{}", first["operation"]["id"].as_str().unwrap()));

    // The same request again: the same answer, replayed, and nothing new written.
    let again = app.send_with_key(Method::POST, "/v1/asset-transfers", who, Some(&key), Some(&body)).await;
    assert_eq!(again.status(), 202);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.json::<Value>().await.unwrap(), first);
    assert_eq!(app.db.count("asset_transfers", who.workspace_id).await, 1);
    assert_eq!(app.db.count("outbox_events", who.workspace_id).await, 1);
    // The same key with another request.
    let other = json!({"source_url": "https://cdn.example.com/images/other.png", "filename": "shoe.png"});
    let reused = app.send_with_key(Method::POST, "/v1/asset-transfers", who, Some(&key), Some(&other)).await;
    assert_eq!(reused.status(), 409);
    assert_eq!(reused.json::<Value>().await.unwrap()["code"], "IDEMPOTENCY_KEY_REUSED");

    let shown = transfer(&app, who, &id).await;
    assert_eq!(shown["id"], id.as_str());
    assert_eq!(shown["status"], "queued");
    assert_eq!(shown["bytes_done"], 0);
    assert!(shown["bytes_total"].is_null() && shown["sha256"].is_null() && shown["media_id"].is_null());
    assert!(shown["error"].is_null());
    assert!(shown.get("source_url").is_none(), "a source URL may carry a signature: never echoed");
    let stranger = app.send(Method::GET, &format!("/v1/asset-transfers/{id}"), principal(), None).await;
    assert_eq!(stranger.status(), 404);
    // Row-level security: the application role without a workspace sees no transfer at all.
    let mut conn = app.db.app_connection().await;
    let (visible,): (i64,) =
        sqlx::query_as("SELECT count(*) FROM conveyor_shop.asset_transfers").fetch_one(&mut conn).await.unwrap();
    assert_eq!(visible, 0);
    let unknown = app.send(Method::GET, &format!("/v1/asset-transfers/{}", Uuid::now_v7()), who, None).await;
    assert_eq!(unknown.status(), 404);
    assert_eq!(app.send(Method::GET, "/v1/asset-transfers/nope", who, None).await.status(), 404);

    for (source_url, filename) in [
        ("ftp://cdn.example.com/a.png", "a.png"),
        ("file:///etc/passwd", "a.png"),
        ("https://user:secret@cdn.example.com/a.png", "a.png"),
        ("not a url", "a.png"),
        (&format!("https://cdn.example.com/{}", "a".repeat(2100)), "a.png"),
        ("https://cdn.example.com/a.png", ""),
        ("https://cdn.example.com/a.png", "../a.png"),
    ] {
        let resp = create(&app, who, source_url, filename).await;
        assert_eq!(resp.status(), 422, "{source_url} {filename}");
        assert_eq!(resp.json::<Value>().await.unwrap()["code"], "VALIDATION_FAILED", "{source_url}");
    }
    let missing = app.send(Method::POST, "/v1/asset-transfers", who, Some(&json!({"source_url": "https://x"}))).await;
    assert_eq!(missing.status(), 422);
    assert_eq!(app.db.count("asset_transfers", who.workspace_id).await, 1);
}

#[tokio::test]
async fn literal_refused_addresses_are_refused_at_the_api() {
    let app = app("", "http://127.0.0.1:9", &[]).await;
    let who = principal();
    for url in [
        "http://127.0.0.1/a.png",
        "http://127.1/a.png",
        "http://2130706433/a.png",
        "http://0177.0.0.1/a.png",
        "http://0x7f000001/a.png",
        "http://0.0.0.0/a.png",
        "http://10.0.0.8/a.png",
        "http://172.16.3.4/a.png",
        "http://192.168.1.1/a.png",
        "http://100.64.0.1/a.png",
        "http://169.254.10.10/a.png",
        "http://169.254.169.254/latest/meta-data/iam/security-credentials/",
        "https://[::1]/a.png",
        "http://[::ffff:127.0.0.1]/a.png",
        "http://[::ffff:a9fe:a9fe]/a.png",
        "http://[fe80::1]/a.png",
        "http://[fd00:ec2::254]/latest/meta-data/",
        "http://[fc00::5]/a.png",
        "http://[64:ff9b::7f00:1]/a.png",
        "http://[2002:7f00:1::]/a.png",
        "http://224.0.0.1/a.png",
        "http://255.255.255.255/a.png",
    ] {
        let resp = create(&app, who, url, "a.png").await;
        assert_eq!(resp.status(), 422, "{url}");
        let problem: Value = resp.json().await.unwrap();
        assert_eq!(problem["code"], "SOURCE_FORBIDDEN", "{url}: {problem}");
    }
    assert_eq!(app.db.count("asset_transfers", who.workspace_id).await, 0, "nothing refused was queued");

    // Allowed networks open exactly their addresses: loopback, not its IPv4-mapped spelling, nor ::1.
    let open = app_sharing(&app, LOOPBACK, "9").await;
    assert_eq!(create(&open, who, "http://127.0.0.1:9/a.png", "a.png").await.status(), 202);
    for url in ["http://[::ffff:127.0.0.1]:9/a.png", "http://[::1]:9/a.png", "http://10.0.0.1/a.png"] {
        let resp = create(&open, who, url, "a.png").await;
        assert_eq!(resp.json::<Value>().await.unwrap()["code"], "SOURCE_FORBIDDEN", "{url}");
    }
    // No allowed network opens a cloud metadata address, not even everything.
    let everything = app_sharing(&app, "0.0.0.0/0,::/0", "9").await;
    assert_eq!(create(&everything, who, "http://10.0.0.1/a.png", "a.png").await.status(), 202);
    for url in [
        "http://169.254.169.254/latest/meta-data/",
        "http://168.63.129.16/metadata/instance",
        "http://[fd00:ec2::254]/latest/meta-data/",
        "http://[::ffff:169.254.169.254]/latest/meta-data/",
    ] {
        let resp = create(&everything, who, url, "a.png").await;
        assert_eq!(resp.status(), 422, "{url}");
        assert_eq!(resp.json::<Value>().await.unwrap()["code"], "SOURCE_FORBIDDEN", "{url}");
    }
}

async fn app_sharing(app: &TestApp, allowed: &str, ports: &str) -> TestApp {
    let (allowed, ports) = (allowed.to_owned(), ports.to_owned());
    app.spawn_sharing(move |vars| {
        vars.insert("CONVEYOR_ASSET_ALLOWED_NETWORKS".into(), allowed);
        vars.insert("CONVEYOR_ASSET_ALLOWED_PORTS".into(), ports);
    })
    .await
}

#[tokio::test]
async fn a_transfer_completes_with_the_sources_sha256_and_becomes_a_media() {
    let (sandbox, sandbox_url) = common::sandbox(Settings::default()).await;
    let app = app(LOOPBACK, &sandbox_url, &[]).await;
    let shutdown = CancellationToken::new();
    run_pipeline(&app, &shutdown).await;
    let who = principal();

    // A real image (so the media step has something to decode), and a patterned file of several parts.
    let image_url = format!("{sandbox_url}/files/photo.png?format=png&width=300&height=200");
    let (image_id, image_op) = start(&app, who, &image_url).await;
    let size = 5 * 256 * 1024 + 3;
    let pattern_url = format!("{sandbox_url}/files/big.jpg?size={size}&content_type=image/jpeg");
    let (pattern_id, _) = start(&app, who, &pattern_url).await;

    let image = ended(&app, who, &image_id, Duration::from_secs(60)).await;
    assert_eq!(image["status"], "completed", "{image}");
    let png = files::png_bytes(300, 200);
    assert_eq!(image["sha256"], sha256_hex(&png));
    assert_eq!(image["bytes_total"], png.len());
    assert_eq!(image["bytes_done"], png.len());
    assert!(image["error"].is_null());
    let media_id = image["media_id"].as_str().expect("a media").to_owned();
    let op = common::operation_reaches(&app, who, &image_op, "succeeded", Duration::from_secs(30)).await.unwrap();
    assert_eq!(op["result"]["media_id"], media_id.as_str());
    // The media goes through media.process, like an upload.
    let media = common::eventually(Duration::from_secs(60), || async {
        let m: Value = app.send(Method::GET, &format!("/v1/media/{media_id}"), who, None).await.json().await.unwrap();
        (m["status"] == "ready" || m["status"] == "rejected").then_some(m)
    })
    .await
    .expect("the media was processed");
    assert_eq!(media["status"], "ready", "{media}");

    let patterned = ended(&app, who, &pattern_id, Duration::from_secs(60)).await;
    assert_eq!(patterned["status"], "completed", "{patterned}");
    assert_eq!(patterned["sha256"], sha256_hex(&files::file_bytes("big.jpg", size)));
    assert_eq!(patterned["bytes_total"], size);
    // The object is stored whole, its parts gone.
    let objects = common::objects_dir(&app.redis_prefix)
        .join(format!("workspaces/{}/asset-transfers/{pattern_id}", who.workspace_id.0));
    let stored = std::fs::read(objects.join("original")).unwrap();
    assert_eq!(sha256_hex(&stored), patterned["sha256"].as_str().unwrap());
    let parts_left = std::fs::read_dir(objects.join("parts")).map(|d| d.count()).unwrap_or(0);
    assert_eq!(parts_left, 0, "parts are deleted once the object is whole");
    assert_eq!(sandbox.stats().file_requests, 2, "one request per transfer");
    shutdown.cancel();
}

#[tokio::test]
async fn a_dropped_connection_resumes_with_range_and_a_source_ignoring_ranges_restarts_cleanly() {
    let (sandbox, sandbox_url) = common::sandbox(Settings::default()).await;
    let app = app(LOOPBACK, &sandbox_url, &[]).await;
    let shutdown = CancellationToken::new();
    run_pipeline(&app, &shutdown).await;
    let who = principal();
    let size: u64 = 1024 * 1024 + 17;

    // Dropped after 300,000 bytes, once: the part received so far is kept, the rest asked for with Range.
    let url = format!("{sandbox_url}/files/dropped.png?size={size}&content_type=image/png&drop_after=300000");
    let (id, _) = start(&app, who, &url).await;
    let t = ended(&app, who, &id, Duration::from_secs(60)).await;
    assert_eq!(t["status"], "completed", "{t}");
    assert_eq!(t["sha256"], sha256_hex(&files::file_bytes("dropped.png", size)));
    let stats = sandbox.stats();
    assert_eq!(stats.file_requests, 2, "the first request and one ranged resumption");
    assert!(
        stats.file_bytes_served < size * 13 / 10,
        "resumed, not restarted: {} bytes served for {size}",
        stats.file_bytes_served
    );
    assert_eq!(stats.file_bytes_served, size, "not one byte twice: the bytes before the drop were kept");

    // A source that answers 200 to a Range: the transfer starts over from zero, and the result is still right.
    let url =
        format!("{sandbox_url}/files/stubborn.png?size={size}&content_type=image/png&drop_after=300000&no_range=true");
    let before = sandbox.stats().file_bytes_served;
    let (id, _) = start(&app, who, &url).await;
    let t = ended(&app, who, &id, Duration::from_secs(60)).await;
    assert_eq!(t["status"], "completed", "{t}");
    assert_eq!(t["sha256"], sha256_hex(&files::file_bytes("stubborn.png", size)));
    assert_eq!(t["bytes_done"], size);
    assert_eq!(sandbox.stats().file_bytes_served - before, size + 300_000);
    shutdown.cancel();
}

#[tokio::test]
async fn a_worker_killed_mid_download_resumes_with_range() {
    let (sandbox, sandbox_url) = common::sandbox(Settings::default()).await;
    let app = app(LOOPBACK, &sandbox_url, &[]).await;
    let shutdown = CancellationToken::new();
    let dispatcher = common::test_dispatcher(&app, &common::redis_url(), |v| {
        v.insert("CONVEYOR_DISPATCH_POLL".into(), "100ms".into());
    })
    .await;
    common::run_dispatcher(dispatcher, &shutdown);
    let mut vars = common::config_vars(&app.db, &app.redis_prefix);
    vars.insert("CONVEYOR_ASSET_ALLOWED_NETWORKS".into(), LOOPBACK.into());
    vars.insert("CONVEYOR_ASSET_ALLOWED_PORTS".into(), port_of(&sandbox_url));
    vars.insert("CONVEYOR_MARKETPLACE_URL".into(), sandbox_url.clone());
    vars.insert("CONVEYOR_ADMIN_ADDR".into(), format!("127.0.0.1:{}", common::free_port()));
    let who = principal();
    let size: u64 = 2 * 1024 * 1024;
    // 512 KiB/s: four seconds for the whole file.
    let url = format!("{sandbox_url}/files/slow.png?size={size}&content_type=image/png&throttle_kbps=512");
    let (id, op) = start(&app, who, &url).await;

    let mut victim = Process::spawn(&["worker"], &vars);
    let done_at_kill = common::eventually(Duration::from_secs(30), || async {
        let t = transfer(&app, who, &id).await;
        let done = t["bytes_done"].as_u64().unwrap_or(0);
        (done >= 512 * 1024).then_some(done)
    })
    .await
    .unwrap_or_else(|| panic!("the download never progressed; worker log:\n{}", victim.log()));
    victim.kill();
    assert!(done_at_kill < size, "killed mid-download");
    let served_at_kill = sandbox.stats().file_bytes_served;

    vars.insert("CONVEYOR_ADMIN_ADDR".into(), format!("127.0.0.1:{}", common::free_port()));
    let rescuer = Process::spawn(&["worker"], &vars);
    let t = ended(&app, who, &id, Duration::from_secs(90)).await;
    assert_eq!(t["status"], "completed", "{t}; log:\n{}", rescuer.log());
    assert_eq!(t["sha256"], sha256_hex(&files::file_bytes("slow.png", size)));
    let stats = sandbox.stats();
    eprintln!(
        "killed at {done_at_kill} bytes stored ({served_at_kill} served); {} served in all for {size}",
        stats.file_bytes_served
    );
    assert_eq!(stats.file_requests, 2, "one request per run");
    // The rescuer asked only for what was not stored: at most the rest after the progress seen before the kill,
    // plus one part (a part stored after it was seen, or the chunk in flight when the victim died).
    let after_kill = stats.file_bytes_served - served_at_kill;
    assert!(
        after_kill <= size - done_at_kill + 256 * 1024,
        "the second run resumed: {after_kill} bytes served after the kill, {done_at_kill} of {size} were stored"
    );
    common::operation_reaches(&app, who, &op, "succeeded", Duration::from_secs(30)).await.expect("succeeded");
    shutdown.cancel();
}

#[tokio::test]
async fn a_worker_killed_after_assembling_completes_once_without_downloading_again() {
    let (sandbox, sandbox_url) = common::sandbox(Settings::default()).await;
    let app = app(LOOPBACK, &sandbox_url, &[]).await;
    let shutdown = CancellationToken::new();
    let dispatcher = common::test_dispatcher(&app, &common::redis_url(), |v| {
        v.insert("CONVEYOR_DISPATCH_POLL".into(), "100ms".into());
    })
    .await;
    common::run_dispatcher(dispatcher, &shutdown);
    let mut vars = common::config_vars(&app.db, &app.redis_prefix);
    vars.insert("CONVEYOR_ASSET_ALLOWED_NETWORKS".into(), LOOPBACK.into());
    vars.insert("CONVEYOR_ASSET_ALLOWED_PORTS".into(), port_of(&sandbox_url));
    vars.insert("CONVEYOR_MARKETPLACE_URL".into(), sandbox_url.clone());
    vars.insert("CONVEYOR_ADMIN_ADDR".into(), format!("127.0.0.1:{}", common::free_port()));
    let who = principal();
    let size: u64 = 700_000;
    let (id, op) = start(&app, who, &format!("{sandbox_url}/files/whole.png?size={size}&content_type=image/png")).await;
    let objects =
        common::objects_dir(&app.redis_prefix).join(format!("workspaces/{}/asset-transfers/{id}", who.workspace_id.0));

    // The worker dies with the object whole and its parts deleted, before its completion commits.
    let mut crashing = vars.clone();
    crashing.insert("FAILPOINTS".into(), "asset_transfer::before_commit=sleep(60000)".into());
    let mut victim = Process::spawn(&["worker"], &crashing);
    common::eventually(Duration::from_secs(30), || async {
        let parts_left = std::fs::read_dir(objects.join("parts")).map(|d| d.count()).unwrap_or(0);
        (objects.join("original").is_file() && parts_left == 0).then_some(())
    })
    .await
    .unwrap_or_else(|| panic!("the worker never assembled the object; log:\n{}", victim.log()));
    victim.kill();
    assert_eq!(transfer(&app, who, &id).await["status"], "transferring", "nothing committed yet");
    assert_eq!(app.db.count("media", who.workspace_id).await, 0);

    vars.insert("CONVEYOR_ADMIN_ADDR".into(), format!("127.0.0.1:{}", common::free_port()));
    let rescuer = Process::spawn(&["worker"], &vars);
    let t = ended(&app, who, &id, Duration::from_secs(60)).await;
    assert_eq!(t["status"], "completed", "{t}; log:\n{}", rescuer.log());
    assert_eq!(t["sha256"], sha256_hex(&files::file_bytes("whole.png", size)));
    assert_eq!(app.db.count("media", who.workspace_id).await, 1, "one media");
    let stats = sandbox.stats();
    assert_eq!((stats.file_requests, stats.file_bytes_served), (1, size), "the rescuer downloaded nothing");
    common::operation_reaches(&app, who, &op, "succeeded", Duration::from_secs(30)).await.expect("succeeded");
    shutdown.cancel();
}

#[tokio::test]
async fn redirects_are_followed_up_to_five_and_each_hop_is_checked() {
    let (sandbox, sandbox_url) = common::sandbox(Settings::default()).await;
    let app = app(LOOPBACK, &sandbox_url, &[]).await;
    let shutdown = CancellationToken::new();
    run_pipeline(&app, &shutdown).await;
    let who = principal();
    let port = sandbox_url.rsplit(':').next().unwrap().to_owned();
    let encode = |s: &str| url::form_urlencoded::byte_serialize(s.as_bytes()).collect::<String>();
    // A chain of `hops` redirects ending at a file.
    let chain = |hops: usize| {
        let mut target = "/files/end.png?size=1000&content_type=image/png".to_owned();
        for hop in 0..hops {
            target = format!("/files/hop{hop}?redirect_to={}", encode(&target));
        }
        format!("{sandbox_url}{target}")
    };

    let (five, _) = start(&app, who, &chain(5)).await;
    let (six, _) = start(&app, who, &chain(6)).await;
    let metadata = format!("{sandbox_url}/files/r1?redirect_to={}", encode("http://169.254.169.254/latest/meta-data/"));
    let (to_metadata, _) = start(&app, who, &metadata).await;
    let v6_loopback = format!("{sandbox_url}/files/r2?redirect_to={}", encode(&format!("http://[::1]:{port}/files/x")));
    let (to_v6_loopback, _) = start(&app, who, &v6_loopback).await;
    let private = format!("{sandbox_url}/files/r3?redirect_to={}", encode("http://10.1.2.3/x.png"));
    let (to_private, _) = start(&app, who, &private).await;
    let ftp = format!("{sandbox_url}/files/r4?redirect_to={}", encode("ftp://example.com/x.png"));
    let (to_ftp, _) = start(&app, who, &ftp).await;
    // A live server on an allowed network but a port not allowed (only the first sandbox's is): never reached.
    let (elsewhere, elsewhere_url) = common::sandbox(Settings::default()).await;
    let other_port =
        format!("{sandbox_url}/files/r5?redirect_to={}", encode(&format!("{elsewhere_url}/files/x.png?size=10")));
    let (to_other_port, _) = start(&app, who, &other_port).await;

    let t = ended(&app, who, &five, Duration::from_secs(60)).await;
    assert_eq!(t["status"], "completed", "five redirects are followed: {t}");
    assert_eq!(t["sha256"], sha256_hex(&files::file_bytes("end.png", 1000)));
    let t = ended(&app, who, &six, Duration::from_secs(60)).await;
    assert_eq!((t["status"].as_str(), t["error"]["code"].as_str()), (Some("failed"), Some("TOO_MANY_REDIRECTS")));
    for id in [&to_metadata, &to_v6_loopback, &to_private, &to_other_port] {
        let t = ended(&app, who, id, Duration::from_secs(60)).await;
        assert_eq!(t["status"], "failed");
        assert_eq!(t["error"]["code"], "SOURCE_FORBIDDEN", "{t}");
        assert_eq!(t["error"]["detail"], "the source's address is not allowed", "{t}");
        assert!(t["media_id"].is_null());
    }
    let t = ended(&app, who, &to_ftp, Duration::from_secs(60)).await;
    assert_eq!(t["error"]["code"], "INVALID_SOURCE_URL", "{t}");
    // 6 + 6 chain requests (five hops and the file; six hops), one for each refused redirect, none to the targets.
    assert_eq!(sandbox.stats().file_requests, 6 + 6 + 5);
    assert_eq!(elsewhere.stats().file_requests, 0, "the server on a port not allowed was never asked");
    shutdown.cancel();
}

#[tokio::test]
async fn a_name_resolving_to_a_refused_address_fails_the_transfer_with_source_forbidden() {
    let (sandbox, sandbox_url) = common::sandbox(Settings::default()).await;
    // The default policy: nothing opened. `localhost` passes the API (it is a name), then resolves to loopback.
    let app = app("", &sandbox_url, &[]).await;
    let shutdown = CancellationToken::new();
    run_pipeline(&app, &shutdown).await;
    let who = principal();
    let url = sandbox_url.replace("127.0.0.1", "localhost") + "/files/a.png?size=1000&content_type=image/png";
    let (id, op) = start(&app, who, &url).await;
    let t = ended(&app, who, &id, Duration::from_secs(60)).await;
    assert_eq!(t["status"], "failed");
    assert_eq!(t["error"]["code"], "SOURCE_FORBIDDEN", "{t}");
    // What the name resolved to is internal: the client reads a fixed text.
    assert_eq!(t["error"]["detail"], "the source's address is not allowed", "{t}");
    let op = common::operation_reaches(&app, who, &op, "failed", Duration::from_secs(30)).await.expect("op failed");
    assert!(op["error"].as_str().unwrap_or("").contains("SOURCE_FORBIDDEN"), "{op}");
    assert!(!op.to_string().contains("127.0.0.1") && !op.to_string().contains("::1"), "{op}");
    assert_eq!(sandbox.stats().file_requests, 0, "no connection was made");
    shutdown.cancel();
}

#[tokio::test]
async fn oversize_and_wrong_content_types_fail_with_their_codes() {
    let (sandbox, sandbox_url) = common::sandbox(Settings::default()).await;
    let app = app(LOOPBACK, &sandbox_url, &[("CONVEYOR_ASSET_MAX_BYTES", "100000")]).await;
    let shutdown = CancellationToken::new();
    run_pipeline(&app, &shutdown).await;
    let who = principal();
    let cases = [
        ("big.png?size=100001&content_type=image/png", "TOO_LARGE"),
        ("huge.png?size=50000000&content_type=image/png", "TOO_LARGE"),
        ("unsaid.png?size=50000000&content_type=image/png&no_length=true", "TOO_LARGE"),
        ("page.png?size=1000&content_type=text/html", "UNSUPPORTED_CONTENT_TYPE"),
        ("none.png?size=1000", "UNSUPPORTED_CONTENT_TYPE"),
    ];
    let mut ids = Vec::new();
    for (path, code) in cases {
        ids.push((start(&app, who, &format!("{sandbox_url}/files/{path}")).await.0, code));
    }
    // A source that answers 404: nothing to retry.
    ids.push((start(&app, who, &format!("{sandbox_url}/nowhere/missing.png")).await.0, "SOURCE_UNAVAILABLE"));
    let (exact, _) =
        start(&app, who, &format!("{sandbox_url}/files/exact.png?size=100000&content_type=image/png")).await;
    for (id, code) in ids {
        let t = ended(&app, who, &id, Duration::from_secs(60)).await;
        assert_eq!(t["status"], "failed");
        assert_eq!(t["error"]["code"], code, "{t}");
        assert!(t["error"]["detail"].as_str().is_some_and(|d| !d.is_empty()));
    }
    let t = ended(&app, who, &exact, Duration::from_secs(60)).await;
    assert_eq!(t["status"], "completed", "exactly the cap is allowed: {t}");
    // A refused file is not downloaded: what was served beyond the accepted file is what socket buffers took.
    let served = sandbox.stats().file_bytes_served;
    assert!(served < 100_000 + 20_000_000, "{served} bytes served: the 50 MB files were not downloaded");
    shutdown.cancel();
}

/// A resolver answering from a table (names that exist nowhere else).
struct FakeResolver(HashMap<String, Vec<IpAddr>>);

impl Resolver for FakeResolver {
    fn resolve(&self, host: &str) -> Resolving {
        let answer = self.0.get(host).cloned();
        let host = host.to_owned();
        Box::pin(async move {
            answer.ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, format!("no such name: {host}")))
        })
    }
}

/// Keeps parts in memory.
#[derive(Default)]
struct MemorySink {
    parts: Vec<Bytes>,
    begins: u32,
}

impl PartSink for MemorySink {
    async fn begin(&mut self, _progress: &Progress, restarted: bool) -> Result<(), SinkError> {
        self.begins += 1;
        if restarted {
            self.parts.clear();
        }
        Ok(())
    }

    async fn part(&mut self, index: u32, bytes: Bytes, _progress: &Progress) -> Result<(), SinkError> {
        assert_eq!(index as usize, self.parts.len());
        self.parts.push(bytes);
        Ok(())
    }
}

fn fetcher(allowed: &[&str], ports: &[u16], names: &[(&str, &[&str])]) -> Fetcher {
    let table = names
        .iter()
        .map(|(name, addresses)| (name.to_string(), addresses.iter().map(|a| a.parse().unwrap()).collect()))
        .collect();
    let settings = FetchSettings {
        connect_timeout: Duration::from_secs(5),
        read_timeout: Duration::from_secs(5),
        max_bytes: 10 * 1024 * 1024,
        part_size: 64 * 1024,
        max_resumes: 3,
        allowed_networks: allowed.iter().map(|n| n.parse().unwrap()).collect(),
        allowed_ports: ports.to_vec(),
        ca_file: None,
        ..conveyor_server::config::ScenarioSettings::default().fetch_settings()
    };
    Fetcher::new(settings, Arc::new(FakeResolver(table))).unwrap()
}

#[tokio::test]
async fn the_fetcher_checks_every_address_a_name_resolves_to() {
    let sandbox = Sandbox::new(Settings::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(sandbox.clone().serve(listener, CancellationToken::new()));
    let cancel = CancellationToken::new();
    let path = format!(":{port}/files/f.png?size=200000&content_type=image/png");

    // Names that resolve to refused addresses: refused before connecting, whichever address comes first.
    let closed = fetcher(
        &[],
        &[port],
        &[
            ("files.internal", &["10.0.0.7"]),
            ("metadata.internal", &["169.254.169.254"]),
            ("mixed.example", &["93.184.216.34", "127.0.0.1"]),
            ("v6.example", &["::1"]),
            ("mapped.example", &["::ffff:127.0.0.1"]),
        ],
    );
    for name in ["files.internal", "metadata.internal", "mixed.example", "v6.example", "mapped.example"] {
        let mut progress = Progress::default();
        let result =
            closed.download(&format!("http://{name}{path}"), &mut progress, &mut MemorySink::default(), &cancel).await;
        assert!(matches!(result, Err(FetchError::Forbidden(_))), "{name}: {result:?}");
    }
    assert_eq!(sandbox.stats().file_requests, 0, "no refused name was connected to");

    // A name that exists only in the injected resolver reaches the sandbox: the fetcher connects where it resolved.
    let open =
        fetcher(&["127.0.0.0/8"], &[port], &[("sandbox.test", &["127.0.0.1"]), ("twice.test", &["127.0.0.1", "::1"])]);
    let mut progress = Progress::default();
    let mut sink = MemorySink::default();
    open.download(&format!("http://sandbox.test{path}"), &mut progress, &mut sink, &cancel).await.unwrap();
    assert_eq!(sink.parts.concat(), files::file_bytes("f.png", 200_000));
    assert_eq!(progress.bytes_total, Some(200_000));
    assert_eq!(progress.parts, 4, "parts of 64 KiB");
    // Allowed loopback v4, refused ::1 among the answers: the name is refused.
    let result = open.download(&format!("http://twice.test{path}"), &mut Progress::default(), &mut sink, &cancel).await;
    assert!(matches!(result, Err(FetchError::Forbidden(_))), "{result:?}");

    // Resuming from a stored prefix asks for the rest only.
    let before = sandbox.stats().file_bytes_served;
    let stored = files::file_bytes("f.png", 200_000)[..65_536].to_vec();
    let mut progress = Progress { bytes_done: 65_536, parts: 1, ..Progress::default() };
    progress.validator = Some("\"f.png-200000-pattern\"".into());
    let mut sink = MemorySink { parts: vec![Bytes::from(stored)], begins: 0 };
    open.download(&format!("http://sandbox.test{path}"), &mut progress, &mut sink, &cancel).await.unwrap();
    assert_eq!(sink.parts.concat(), files::file_bytes("f.png", 200_000));
    assert_eq!(sandbox.stats().file_bytes_served - before, 200_000 - 65_536);
    // A changed source (another validator): If-Range gets the whole file, and the download starts over.
    let mut progress =
        Progress { bytes_done: 65_536, parts: 1, validator: Some("\"old\"".into()), ..Progress::default() };
    let mut sink = MemorySink { parts: vec![Bytes::from_static(b"stale")], begins: 0 };
    open.download(&format!("http://sandbox.test{path}"), &mut progress, &mut sink, &cancel).await.unwrap();
    assert_eq!(sink.parts.concat(), files::file_bytes("f.png", 200_000));
}

#[tokio::test]
async fn a_canceled_transfer_stops_downloading_and_ends_failed() {
    let (sandbox, sandbox_url) = common::sandbox(Settings::default()).await;
    let app = app(LOOPBACK, &sandbox_url, &[]).await;
    let shutdown = CancellationToken::new();
    run_pipeline(&app, &shutdown).await;
    let who = principal();
    let size: u64 = 8 * 1024 * 1024;
    let url = format!("{sandbox_url}/files/long.png?size={size}&content_type=image/png&throttle_kbps=512");
    let (id, op) = start(&app, who, &url).await;
    common::eventually(Duration::from_secs(30), || async {
        (transfer(&app, who, &id).await["bytes_done"].as_u64().unwrap_or(0) > 0).then_some(())
    })
    .await
    .expect("the download started");
    let resp = app.send(Method::POST, &format!("/v1/operations/{op}/cancel"), who, Some(&json!({}))).await;
    assert_eq!(resp.status(), 200);
    let t = ended(&app, who, &id, Duration::from_secs(30)).await;
    assert_eq!(t["status"], "failed");
    assert_eq!(t["error"]["code"], "CANCELED", "{t}");
    assert!(t["media_id"].is_null());
    // The row itself ended (not only the operation it is read through), and forgot its source URL.
    let row = common::eventually(Duration::from_secs(30), || async {
        let rows = app.db.rows("asset_transfers", who.workspace_id).await;
        rows.into_iter().find(|r| r["id"] == id.as_str() && r["status"] == "failed")
    })
    .await
    .expect("the transfer's row is failed");
    assert_eq!(row["error_code"], "CANCELED", "{row}");
    assert!(row["source_url"].is_null(), "{row}");
    let served = sandbox.stats().file_bytes_served;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // At most the one chunk the sandbox had in hand when the connection closed.
    let later = sandbox.stats().file_bytes_served;
    assert!(later - served <= 64 * 1024, "no more bytes are fetched once canceled: {served} then {later}");
    assert!(served < size);
    shutdown.cancel();
}

#[tokio::test]
async fn a_transfer_canceled_before_its_job_ran_reads_failed_with_canceled() {
    let (sandbox, sandbox_url) = common::sandbox(Settings::default()).await;
    let app = app(LOOPBACK, &sandbox_url, &[]).await;
    let who = principal();
    // No dispatcher and no worker: the job never starts, only its operation can say how it ended.
    let (id, op) = start(&app, who, &format!("{sandbox_url}/files/never.png?size=1024&content_type=image/png")).await;
    assert_eq!(transfer(&app, who, &id).await["status"], "queued");
    let resp = app.send(Method::POST, &format!("/v1/operations/{op}/cancel"), who, Some(&json!({}))).await;
    assert_eq!(resp.status(), 200);
    let t = transfer(&app, who, &id).await;
    assert_eq!((t["status"].as_str(), t["error"]["code"].as_str()), (Some("failed"), Some("CANCELED")), "{t}");
    assert_eq!(sandbox.stats().file_requests, 0);
    // Its source URL (a token, perhaps) is forgotten with the end of its operation, though no job ran.
    let rows = app.db.rows("asset_transfers", who.workspace_id).await;
    assert!(rows[0]["source_url"].is_null(), "{}", rows[0]);
}

#[tokio::test]
async fn a_changing_source_is_never_spliced_without_a_matching_validator() {
    let sandbox = Sandbox::new(Settings::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(sandbox.clone().serve(listener, CancellationToken::new()));
    let cancel = CancellationToken::new();
    let open = fetcher(&["127.0.0.0/8"], &[port], &[("sandbox.test", &["127.0.0.1"])]);
    let size = 200_000u64;
    let version = |name: &str, n: u64| files::file_bytes(&files::version_name(name, n), size);

    // No validator at all: the file changes between the dropped request and the next. Without a validator the
    // rest cannot be trusted to belong to the bytes stored: the second request asks for the whole file.
    let url = format!(
        "http://sandbox.test:{port}/files/plain.png?size={size}&content_type=image/png&changing=true&no_validator=true\
         &drop_after=100000"
    );
    let mut progress = Progress::default();
    let mut sink = MemorySink::default();
    open.download(&url, &mut progress, &mut sink, &cancel).await.unwrap();
    let whole = |sink: &MemorySink| sha256_hex(&sink.parts.concat());
    assert_eq!(whole(&sink), sha256_hex(&version("plain.png", 1)), "the second version whole, not spliced");
    assert_eq!(progress.bytes_done, size);

    // A source (or cache) that answers the Range with 206 although If-Range named another version: its ETag differs
    // from the stored one, so the download starts over instead of splicing.
    let before = sandbox.stats().file_requests;
    let url = format!(
        "http://sandbox.test:{port}/files/etag.png?size={size}&content_type=image/png&changing=true\
         &ignore_if_range=true&drop_after=100000"
    );
    let mut progress = Progress::default();
    let mut sink = MemorySink::default();
    open.download(&url, &mut progress, &mut sink, &cancel).await.unwrap();
    assert_eq!(whole(&sink), sha256_hex(&version("etag.png", 2)), "the third version whole");
    assert_eq!(sandbox.stats().file_requests - before, 3, "dropped, refused 206, whole file");

    // A 206 with the stored validator but another total (a resumption from a stored prefix): started over too.
    let url = format!("http://sandbox.test:{port}/files/total.png?size={size}&content_type=image/png");
    let stored = files::file_bytes("total.png", size)[..65_536].to_vec();
    let mut progress = Progress {
        bytes_done: 65_536,
        parts: 1,
        bytes_total: Some(size + 1),
        validator: Some(format!("\"total.png-{size}-pattern\"")),
        ..Progress::default()
    };
    let mut sink = MemorySink { parts: vec![Bytes::from(stored)], begins: 0 };
    open.download(&url, &mut progress, &mut sink, &cancel).await.unwrap();
    assert_eq!(whole(&sink), sha256_hex(&files::file_bytes("total.png", size)));
    assert_eq!(progress.bytes_total, Some(size));
    assert_eq!(sink.begins, 2, "the refused 206, then the whole file");
}

#[tokio::test]
async fn a_stored_part_gone_missing_restarts_the_download_instead_of_failing_forever() {
    let (sandbox, sandbox_url) = common::sandbox(Settings::default()).await;
    let app = app(LOOPBACK, &sandbox_url, &[]).await;
    let shutdown = CancellationToken::new();
    let dispatcher = common::test_dispatcher(&app, &common::redis_url(), |v| {
        v.insert("CONVEYOR_DISPATCH_POLL".into(), "100ms".into());
    })
    .await;
    common::run_dispatcher(dispatcher, &shutdown);
    let mut vars = common::config_vars(&app.db, &app.redis_prefix);
    vars.insert("CONVEYOR_ASSET_ALLOWED_NETWORKS".into(), LOOPBACK.into());
    vars.insert("CONVEYOR_ASSET_ALLOWED_PORTS".into(), port_of(&sandbox_url));
    vars.insert("CONVEYOR_MARKETPLACE_URL".into(), sandbox_url.clone());
    vars.insert("CONVEYOR_ADMIN_ADDR".into(), format!("127.0.0.1:{}", common::free_port()));
    vars.insert("CONVEYOR_JOB_MAX_ATTEMPTS".into(), "3".into());
    let who = principal();
    let size: u64 = 2 * 1024 * 1024;
    let url = format!("{sandbox_url}/files/holey.png?size={size}&content_type=image/png&throttle_kbps=512");
    let (id, op) = start(&app, who, &url).await;
    let parts = common::objects_dir(&app.redis_prefix)
        .join(format!("workspaces/{}/asset-transfers/{id}/parts", who.workspace_id.0));

    let mut victim = Process::spawn(&["worker"], &vars);
    common::eventually(Duration::from_secs(30), || async {
        (transfer(&app, who, &id).await["bytes_done"].as_u64().unwrap_or(0) >= 512 * 1024).then_some(())
    })
    .await
    .unwrap_or_else(|| panic!("the download never progressed; worker log:\n{}", victim.log()));
    victim.kill();
    // The first part, recorded as stored, is lost.
    std::fs::remove_file(parts.join("00000000")).unwrap();

    vars.insert("CONVEYOR_ADMIN_ADDR".into(), format!("127.0.0.1:{}", common::free_port()));
    let rescuer = Process::spawn(&["worker"], &vars);
    let t = ended(&app, who, &id, Duration::from_secs(90)).await;
    assert_eq!(t["status"], "completed", "{t}; log:\n{}", rescuer.log());
    assert_eq!(t["sha256"], sha256_hex(&files::file_bytes("holey.png", size)));
    common::operation_reaches(&app, who, &op, "succeeded", Duration::from_secs(30)).await.expect("succeeded");
    assert_eq!(sandbox.stats().file_requests, 3, "the first run, the resumption, the download again from zero");
    shutdown.cancel();
}

#[tokio::test]
async fn a_source_urls_token_is_kept_nowhere_once_its_transfer_ended() {
    const SECRET: &str = "SECRET-7d1f0c9a";
    let (_sandbox, sandbox_url) = common::sandbox(Settings::default()).await;
    let app = app(LOOPBACK, &sandbox_url, &[("CONVEYOR_ASSET_MAX_BYTES", "100000")]).await;
    let shutdown = CancellationToken::new();
    let dispatcher = common::test_dispatcher(&app, &common::redis_url(), |v| {
        v.insert("CONVEYOR_DISPATCH_POLL".into(), "100ms".into());
    })
    .await;
    common::run_dispatcher(dispatcher, &shutdown);
    let mut vars = common::config_vars(&app.db, &app.redis_prefix);
    vars.insert("CONVEYOR_ASSET_ALLOWED_NETWORKS".into(), LOOPBACK.into());
    vars.insert("CONVEYOR_ASSET_ALLOWED_PORTS".into(), port_of(&sandbox_url));
    vars.insert("CONVEYOR_ASSET_MAX_BYTES".into(), "100000".into());
    vars.insert("CONVEYOR_MARKETPLACE_URL".into(), sandbox_url.clone());
    vars.insert("CONVEYOR_ADMIN_ADDR".into(), format!("127.0.0.1:{}", common::free_port()));
    vars.insert("RUST_LOG".into(), "debug".into());
    let worker = Process::spawn(&["worker"], &vars);
    let who = principal();
    let encode = |s: &str| url::form_urlencoded::byte_serialize(s.as_bytes()).collect::<String>();
    let token = format!("token={SECRET}");
    let mut too_many = format!("/files/end.png?size=1000&content_type=image/png&{token}");
    for hop in 0..6 {
        too_many = format!("/files/hop{hop}?redirect_to={}&{token}", encode(&too_many));
    }
    let cases = [
        (format!("/files/f?redirect_to={}&{token}", encode(&format!("http://10.1.2.3/x.png?{token}"))), "failed"),
        (format!("/nowhere/missing.png?{token}"), "failed"),
        (format!("/files/dropped.png?size=90000&content_type=image/png&drop_after=30000&{token}"), "completed"),
        (format!("/files/big.png?size=100001&content_type=image/png&{token}"), "failed"),
        (too_many, "failed"),
    ];
    let mut ids = Vec::new();
    for (path, expected) in &cases {
        ids.push((start(&app, who, &format!("{sandbox_url}{path}")).await.0, *expected));
    }
    for (id, expected) in &ids {
        let t = ended(&app, who, id, Duration::from_secs(60)).await;
        assert_eq!(t["status"], *expected, "{t}; log:\n{}", worker.log());
    }
    // Every operation ended too (their errors and results are written after the transfer's row).
    common::eventually(Duration::from_secs(30), || async {
        let ops = app.db.rows("operations", who.workspace_id).await;
        let transfers = ops.iter().filter(|o| o["kind"] == "asset.transfer");
        transfers.clone().count().eq(&cases.len()).then_some(())?;
        transfers.into_iter().all(|o| o["status"] == "succeeded" || o["status"] == "failed").then_some(())
    })
    .await
    .expect("every transfer's operation ended");
    for table in ["asset_transfers", "operations", "outbox_events", "idempotency_requests"] {
        let rows = app.db.rows(table, who.workspace_id).await;
        assert!(!rows.is_empty(), "{table}");
        for row in rows {
            assert!(!row.to_string().contains(SECRET), "{table} keeps the token: {row}");
        }
    }
    assert!(!worker.log().contains(SECRET), "the worker's log shows the token:\n{}", worker.log());
    shutdown.cancel();
}

#[tokio::test]
async fn ports_other_than_80_and_443_are_refused_at_the_api_unless_configured() {
    // No CONVEYOR_ASSET_ALLOWED_PORTS: ports 80 and 443 only, whatever the host.
    let app = TestApp::spawn().await;
    let who = principal();
    for (url, port) in [
        ("https://cdn.example.com:8443/a.png", 8443),
        ("http://cdn.example.com:8080/a.png", 8080),
        ("http://cdn.example.com:6379/a.png", 6379),
        ("http://8.8.8.8:22/a.png", 22),
        ("http://[2606:4700:4700::1111]:9090/a.png", 9090),
    ] {
        let resp = create(&app, who, url, "a.png").await;
        assert_eq!(resp.status(), 422, "{url}");
        let problem: Value = resp.json().await.unwrap();
        assert_eq!(problem["code"], "SOURCE_FORBIDDEN", "{url}: {problem}");
        let detail = problem["detail"].as_str().unwrap_or("");
        assert!(detail.contains(&format!("port {port} is not allowed (allowed ports: 80, 443)")), "{url}: {detail}");
    }
    assert_eq!(app.db.count("asset_transfers", who.workspace_id).await, 0, "nothing refused was queued");
    for url in ["https://cdn.example.com/a.png", "https://cdn.example.com:443/a.png", "http://cdn.example.com:80/a.png"]
    {
        assert_eq!(create(&app, who, url, "a.png").await.status(), 202, "{url}");
    }

    // Configured ports are added to 80 and 443, for every host; others stay refused.
    let more = app
        .spawn_sharing(|vars| {
            vars.insert("CONVEYOR_ASSET_ALLOWED_PORTS".into(), "8443, 8080".into());
        })
        .await;
    for url in ["https://cdn.example.com:8443/a.png", "http://cdn.example.com:8080/a.png", "https://cdn.example.com/a"]
    {
        assert_eq!(create(&more, who, url, "a.png").await.status(), 202, "{url}");
    }
    let resp = create(&more, who, "http://cdn.example.com:9090/a.png", "a.png").await;
    assert_eq!(resp.status(), 422);
    let problem: Value = resp.json().await.unwrap();
    assert_eq!(problem["code"], "SOURCE_FORBIDDEN", "{problem}");
    assert!(
        problem["detail"]
            .as_str()
            .unwrap_or("")
            .contains("port 9090 is not allowed (allowed ports: 80, 443, 8080, 8443)"),
        "{problem}"
    );
    // A port does not open an address: loopback on an allowed port is still refused.
    let resp = create(&more, who, "http://127.0.0.1:8080/a.png", "a.png").await;
    assert_eq!(resp.json::<Value>().await.unwrap()["code"], "SOURCE_FORBIDDEN");
}

#[tokio::test]
async fn the_fetcher_refuses_a_port_not_allowed_in_the_url_and_on_every_redirect() {
    let first = Sandbox::new(Settings::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let allowed = listener.local_addr().unwrap().port();
    tokio::spawn(first.clone().serve(listener, CancellationToken::new()));
    let second = Sandbox::new(Settings::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let other = listener.local_addr().unwrap().port();
    tokio::spawn(second.clone().serve(listener, CancellationToken::new()));
    let cancel = CancellationToken::new();
    let names: &[(&str, &[&str])] = &[("sandbox.test", &["127.0.0.1"])];
    let file = "/files/f.png?size=1000&content_type=image/png";
    let encode = |s: &str| url::form_urlencoded::byte_serialize(s.as_bytes()).collect::<String>();
    let redirect = format!(
        "http://sandbox.test:{allowed}/files/r?redirect_to={}",
        encode(&format!("http://sandbox.test:{other}{file}"))
    );

    // The loopback network is open, but only the first server's port.
    let one_port = fetcher(&["127.0.0.0/8"], &[allowed], names);
    let direct = format!("http://sandbox.test:{other}{file}");
    let result = one_port.download(&direct, &mut Progress::default(), &mut MemorySink::default(), &cancel).await;
    match &result {
        Err(e @ FetchError::Forbidden(why)) => {
            assert!(why.contains(&format!("port {other} is not allowed (allowed ports: 80, 443, {allowed})")), "{why}");
            assert_eq!(e.code(), "SOURCE_FORBIDDEN");
        }
        other => panic!("{other:?}"),
    }
    let result = one_port.download(&redirect, &mut Progress::default(), &mut MemorySink::default(), &cancel).await;
    match &result {
        Err(FetchError::Forbidden(why)) => {
            assert!(why.starts_with("the source redirected to a refused target: "), "{why}");
            assert!(why.contains(&format!("port {other} is not allowed")), "{why}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(first.stats().file_requests, 1, "the redirect was asked for");
    assert_eq!(second.stats().file_requests, 0, "the server on a port not allowed was never asked");

    // With both ports allowed the same redirect is followed to the file.
    let both_ports = fetcher(&["127.0.0.0/8"], &[allowed, other], names);
    let mut sink = MemorySink::default();
    both_ports.download(&redirect, &mut Progress::default(), &mut sink, &cancel).await.unwrap();
    assert_eq!(sink.parts.concat(), files::file_bytes("f.png", 1000));
    assert_eq!(second.stats().file_requests, 1);
}

#[test]
fn the_allowed_ports_variable_is_validated_with_a_message_naming_it() {
    use conveyor_server::config::ScenarioSettings;
    let parse = |value: &str| {
        ScenarioSettings::from_source(&HashMap::from([("CONVEYOR_ASSET_ALLOWED_PORTS".to_owned(), value.to_owned())]))
    };
    assert!(ScenarioSettings::default().asset_allowed_ports.is_empty(), "none besides 80 and 443 by default");
    assert_eq!(parse("8080, 8443,").unwrap().asset_allowed_ports, vec![8080, 8443]);
    assert_eq!(parse("1,65535").unwrap().asset_allowed_ports, vec![1, 65535]);
    assert!(parse("").unwrap().asset_allowed_ports.is_empty());
    for bad in ["0", "65536", "-1", "http", "80;443", "8080 8443", "1.5", "8080,x"] {
        let error = parse(bad).unwrap_err();
        assert_eq!(error.variable(), "CONVEYOR_ASSET_ALLOWED_PORTS", "{bad}");
        let text = error.to_string();
        assert!(text.starts_with("CONVEYOR_ASSET_ALLOWED_PORTS is invalid: "), "{bad}: {text}");
        assert!(text.contains("is not a port number from 1 to 65535"), "{bad}: {text}");
    }
}

/// A 2×2 PNG.
fn tiny_png() -> Vec<u8> {
    let mut bytes = std::io::Cursor::new(Vec::new());
    image::DynamicImage::ImageRgb8(image::RgbImage::from_pixel(2, 2, image::Rgb([200, 40, 40])))
        .write_to(&mut bytes, image::ImageFormat::Png)
        .unwrap();
    bytes.into_inner()
}

#[tokio::test]
async fn one_tenants_slow_transfers_never_hold_the_slot_another_tenants_media_job_needs() {
    let (_sandbox, sandbox_url) = common::sandbox(Settings::default()).await;
    // Two slots, as in the report: two transfers could hold both.
    let app = app(LOOPBACK, &sandbox_url, &[("CONVEYOR_WORKER_CONCURRENCY", "2")]).await;
    let shutdown = CancellationToken::new();
    run_pipeline(&app, &shutdown).await;
    let (slow, other) = (principal(), principal());
    // Sources that send 1 KiB a second: 8 MiB would take over two hours.
    let size = 8 * 1024 * 1024;
    let mut transfers = Vec::new();
    for n in 0..2 {
        let url = format!("{sandbox_url}/files/slow-{n}.png?size={size}&content_type=image/png&throttle_kbps=1");
        transfers.push(start(&app, slow, &url).await.0);
    }
    common::eventually(Duration::from_secs(30), || async {
        for id in &transfers {
            if transfer(&app, slow, id).await["status"] == "transferring" {
                return Some(());
            }
        }
        None
    })
    .await
    .expect("a slow transfer is downloading");

    // Another tenant's upload: its media job gets a slot while the transfers go on.
    let png = tiny_png();
    let body = json!({"filename": "dot.png", "content_type": "image/png", "size_bytes": png.len()});
    let created: Value = app.send(Method::POST, "/v1/media", other, Some(&body)).await.json().await.unwrap();
    let media = created["media"]["id"].as_str().unwrap().to_owned();
    let put = app
        .http
        .put(app.url(&format!("/v1/media/{media}/content")))
        .bearer_auth(app.token(other))
        .header("content-type", "application/octet-stream")
        .body(png)
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), 200);
    let key = Uuid::new_v4().to_string();
    let path = format!("/v1/media/{media}/complete");
    assert_eq!(app.send_with_key(Method::POST, &path, other, Some(&key), Some(&json!({}))).await.status(), 202);
    let processed = common::eventually(Duration::from_secs(30), || async {
        let m: Value = app.send(Method::GET, &format!("/v1/media/{media}"), other, None).await.json().await.unwrap();
        (m["status"] != "processing").then_some(m)
    })
    .await
    .expect("the other tenant's media was processed while the slow transfers went on");
    assert_eq!(processed["status"], "ready", "{processed}");
    for id in &transfers {
        let t = transfer(&app, slow, id).await;
        assert!(!matches!(t["status"].as_str(), Some("completed" | "failed")), "still transferring: {t}");
    }
    shutdown.cancel();
}

/// The transfer's job row (its outbox event): status and runs.
async fn transfer_job(app: &TestApp, who: Principal, operation: &str) -> Value {
    let rows = app.db.rows("outbox_events", who.workspace_id).await;
    rows.into_iter().find(|r| r["operation_id"] == operation).expect("the transfer's job")
}

#[tokio::test]
async fn a_source_under_the_minimum_throughput_fails_source_too_slow_after_two_runs_while_a_steady_one_completes() {
    let (sandbox, sandbox_url) = common::sandbox(Settings::default()).await;
    // 1 KiB a second over windows of one second, after a first second of grace.
    let tight = [("CONVEYOR_ASSET_MIN_THROUGHPUT", "1KiB"), ("CONVEYOR_ASSET_THROUGHPUT_WINDOW", "1s")];
    let app = app(LOOPBACK, &sandbox_url, &tight).await;
    let shutdown = CancellationToken::new();
    run_pipeline(&app, &shutdown).await;
    let who = principal();

    // One byte a second: it never times out a read (30 s), and would take a day.
    let drip = format!("{sandbox_url}/files/drip.png?size=100000&content_type=image/png&drip_ms=1000");
    let (slow, slow_op) = start(&app, who, &drip).await;
    // 256 KiB a second over several windows: far above the minimum.
    let size: u64 = 1024 * 1024 + 5;
    let steady_url = format!("{sandbox_url}/files/steady.png?size={size}&content_type=image/png&throttle_kbps=256");
    let (steady, steady_op) = start(&app, who, &steady_url).await;

    let t = ended(&app, who, &slow, Duration::from_secs(90)).await;
    assert_eq!(t["status"], "failed", "{t}");
    assert_eq!(t["error"]["code"], "SOURCE_TOO_SLOW", "{t}");
    let detail = t["error"]["detail"].as_str().unwrap_or_default();
    assert!(detail.contains("less than the minimum of 1024 bytes a second"), "{t}");
    assert!(t["media_id"].is_null());
    let op = common::operation_reaches(&app, who, &slow_op, "failed", Duration::from_secs(30)).await.expect("failed");
    assert!(op["error"].as_str().unwrap_or_default().contains("SOURCE_TOO_SLOW"), "{op}");
    // Two runs, not the kind's five: the retry, then the end.
    let job = common::eventually(Duration::from_secs(30), || async {
        let job = transfer_job(&app, who, &slow_op).await;
        (job["status"] == "dead_letter").then_some(job)
    })
    .await
    .expect("the slow transfer's job ended");
    assert_eq!(job["job_attempts"], 2, "{job}");

    let t = ended(&app, who, &steady, Duration::from_secs(60)).await;
    assert_eq!(t["status"], "completed", "{t}");
    assert_eq!(t["sha256"], sha256_hex(&files::file_bytes("steady.png", size)));
    common::operation_reaches(&app, who, &steady_op, "succeeded", Duration::from_secs(30)).await.expect("succeeded");
    assert_eq!(sandbox.stats().file_requests, 2 + 1, "one request per run: two of the drip, one of the steady file");
    shutdown.cancel();
}

#[tokio::test]
async fn a_transfer_past_its_deadline_fails_source_too_slow_after_two_runs_while_a_short_one_completes() {
    let (sandbox, sandbox_url) = common::sandbox(Settings::default()).await;
    // A three-second deadline; the minimum throughput checked every second, which these sources pass.
    let vars = [
        ("CONVEYOR_ASSET_MAX_DURATION", "3s"),
        ("CONVEYOR_ASSET_MIN_THROUGHPUT", "1KiB"),
        ("CONVEYOR_ASSET_THROUGHPUT_WINDOW", "1s"),
    ];
    let app = app(LOOPBACK, &sandbox_url, &vars).await;
    let shutdown = CancellationToken::new();
    run_pipeline(&app, &shutdown).await;
    let who = principal();

    // 16 KiB every 100 ms (160 KiB a second): never too slow, but 4 MiB take 25 s.
    let size: u64 = 4 * 1024 * 1024;
    let long = format!("{sandbox_url}/files/long.png?size={size}&content_type=image/png&drip_ms=100&drip_bytes=16384");
    let (id, op) = start(&app, who, &long).await;
    let short_url = format!("{sandbox_url}/files/short.png?size=300000&content_type=image/png");
    let (short, _) = start(&app, who, &short_url).await;

    let t = ended(&app, who, &id, Duration::from_secs(90)).await;
    assert_eq!(t["status"], "failed", "{t}");
    assert_eq!(t["error"]["code"], "SOURCE_TOO_SLOW", "{t}");
    let detail = t["error"]["detail"].as_str().unwrap_or_default();
    assert!(detail.contains("deadline of 3s"), "{t}");
    assert!(t["media_id"].is_null());
    let op = common::operation_reaches(&app, who, &op, "failed", Duration::from_secs(30)).await.expect("failed");
    assert!(op["error"].as_str().unwrap_or_default().contains("SOURCE_TOO_SLOW"), "{op}");
    let job = common::eventually(Duration::from_secs(30), || async {
        let job = transfer_job(&app, who, op["id"].as_str().unwrap()).await;
        (job["status"] == "dead_letter").then_some(job)
    })
    .await
    .expect("the long transfer's job ended");
    assert_eq!(job["job_attempts"], 2, "{job}");

    let t = ended(&app, who, &short, Duration::from_secs(60)).await;
    assert_eq!(t["status"], "completed", "{t}");
    assert_eq!(t["sha256"], sha256_hex(&files::file_bytes("short.png", 300_000)));
    assert_eq!(sandbox.stats().file_requests, 2 + 1, "one request per run: two of the long file, one of the short");
    shutdown.cancel();
}
