//! Memory bounds that match the chart (issue 25), measured on real `conveyor` processes over real PostgreSQL, Redis
//! and object storage (a directory per test): a worker decodes a 16-bit RGBA PNG of 8000 × 8000 (64 megapixels, the
//! default pixel limit; about half a megabyte deflated, 512 MB of 16-bit samples inflated) within its decode memory,
//! or refuses it from its header when that memory is too small; an API process receives ten 24 MiB uploads at once
//! within a bound of its part buffer; uploads beyond `CONVEYOR_MEDIA_MAX_CONCURRENT_UPLOADS` are answered 503 with
//! `Retry-After`.
//!
//! Memory is read as `VmHWM` (the peak resident set the kernel recorded for the process) from `/proc/<pid>/status`,
//! not under a cgroup: the test machines give no cgroup of their own to make (and `prlimit --as` measures address
//! space, which tokio's and the allocator's reservations fill long before memory is used). A container's limit
//! counts the resident set plus page cache and kernel memory, so the bounds below keep 64 MiB under the chart's
//! limit. Every bound is on memory; nothing here is timed.

use crate::common;

use std::collections::HashMap;
use std::time::Duration;

use common::{Process, TestApp, principal};
use conveyor_server::auth::Principal;
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const MIB: u64 = 1024 * 1024;
/// The chart's memory limit of a worker Pod (helm/conveyor/values.yaml) and what the worker's bound keeps under it.
const CHART_WORKER_LIMIT: u64 = 512 * MIB;
/// The chart's memory limit of an API Pod.
const CHART_API_LIMIT: u64 = 256 * MIB;
/// Kept under a chart limit for what a container is charged besides the resident set (page cache, kernel memory).
const CGROUP_MARGIN: u64 = 64 * MIB;
/// The default of `CONVEYOR_MEDIA_DECODE_MEMORY`.
const DECODE_MEMORY: u64 = 320 * MIB;
const WAIT: Duration = Duration::from_secs(300);
/// The part an upload holds in memory (`conveyor_shop::domain::media::PART_BYTES`, S3's smallest part).
const PART: u64 = 5 * MIB;

/// `VmHWM` (peak resident set) of process `pid`, in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).expect("VmHWM in /proc/<pid>/status");
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

fn alive(process: &mut Process) -> bool {
    process.child.try_wait().unwrap().is_none()
}

/// The bomb: an 8000 × 8000 PNG of 16-bit RGBA, every pixel (0x1234, 0x5678, 0x9ABC, 0xFFFF), deflated to about
/// half a megabyte. 8 bytes a pixel once inflated (512 MB), 4 at 8 bits.
fn rgba16_bomb() -> Vec<u8> {
    const SIDE: u32 = 8000;
    let mut out = Vec::new();
    let mut encoder = png::Encoder::new(&mut out, SIDE, SIDE);
    encoder.set_color(png::ColorType::Rgba);
    encoder.set_depth(png::BitDepth::Sixteen);
    encoder.set_compression(png::Compression::High);
    encoder.set_filter(png::Filter::Up);
    let mut writer = encoder.write_header().unwrap();
    let row: Vec<u8> = (0..SIDE).flat_map(|_| [0x12, 0x34, 0x56, 0x78, 0x9A, 0xBC, 0xFF, 0xFF]).collect();
    let mut stream = writer.stream_writer().unwrap();
    for _ in 0..SIDE {
        std::io::Write::write_all(&mut stream, &row).unwrap();
    }
    stream.finish().unwrap();
    writer.finish().unwrap();
    out
}

async fn submit(app: &TestApp, who: Principal, bytes: &[u8]) -> String {
    let body = json!({"filename": "bomb.png", "content_type": "image/png", "size_bytes": bytes.len()});
    let created: Value = app.send(Method::POST, "/v1/media", who, Some(&body)).await.json().await.unwrap();
    let id = created["media"]["id"].as_str().unwrap().to_owned();
    let put = app
        .http
        .put(app.url(&format!("/v1/media/{id}/content")))
        .bearer_auth(app.token(who))
        .header("content-type", "image/png")
        .body(bytes.to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), StatusCode::OK);
    let completed = app.send(Method::POST, &format!("/v1/media/{id}/complete"), who, Some(&json!({}))).await.status();
    assert_eq!(completed, StatusCode::ACCEPTED);
    id
}

async fn processed(app: &TestApp, who: Principal, id: &str, worker: &Process) -> Value {
    common::eventually(WAIT, || async {
        let media: Value = app.send(Method::GET, &format!("/v1/media/{id}"), who, None).await.json().await.unwrap();
        (media["status"] != "processing").then_some(media)
    })
    .await
    .unwrap_or_else(|| panic!("media {id} was processed; log:\n{}", worker.log()))
}

fn worker(app: &TestApp, market: &str, extra: &[(&str, &str)]) -> Process {
    let mut vars = common::config_vars(&app.db, &app.redis_prefix);
    vars.insert("CONVEYOR_ADMIN_ADDR".into(), format!("127.0.0.1:{}", common::free_port()));
    vars.insert("CONVEYOR_MARKETPLACE_URL".into(), market.to_owned());
    // A debug build inflates half a gigabyte slowly; the bound is on memory, not on time.
    vars.insert("CONVEYOR_JOB_TIMEOUT".into(), "20m".into());
    for (name, value) in extra {
        vars.insert((*name).to_owned(), (*value).to_owned());
    }
    Process::spawn(&["worker"], &vars)
}

#[tokio::test]
async fn a_16_bit_8000_square_png_stays_within_the_workers_decode_memory_or_is_refused_from_its_header() {
    let app = TestApp::spawn().await;
    let (_sandbox, market) = common::sandbox(conveyor_shop::adapters::sandbox::Settings::default()).await;
    let shutdown = CancellationToken::new();
    common::run_dispatcher(common::test_dispatcher(&app, &common::redis_url(), |_| {}).await, &shutdown);
    let who = principal();
    let bomb = rgba16_bomb();
    eprintln!("bomb: 8000x8000 16-bit RGBA, {} bytes", bomb.len());
    assert!(bomb.len() < 1 << 20, "{} bytes", bomb.len());
    // Small 16-bit images to warm each worker up on (different bytes: each is decoded, none reused).
    let small = |value: u16| {
        let mut out = Vec::new();
        let image = image::DynamicImage::ImageRgba16(image::ImageBuffer::from_pixel(64, 64, image::Rgba([value; 4])));
        image.write_to(&mut std::io::Cursor::new(&mut out), image::ImageFormat::Png).unwrap();
        out
    };

    // A worker whose decode memory (128 MiB) cannot hold the image's 256 MB of 8-bit pixels refuses it from the
    // header, without decoding: its peak stays near its baseline.
    let mut tight = worker(&app, &market, &[("CONVEYOR_MEDIA_DECODE_MEMORY", "128MiB")]);
    let pid = tight.child.id();
    let warm = submit(&app, who, &small(9)).await;
    assert_eq!(processed(&app, who, &warm, &tight).await["status"], "ready");
    let tight_baseline = peak_rss(pid);
    let id = submit(&app, who, &bomb).await;
    let media = processed(&app, who, &id, &tight).await;
    let refused_peak = peak_rss(pid);
    eprintln!(
        "worker VmHWM with CONVEYOR_MEDIA_DECODE_MEMORY=128MiB: {} MiB after the bomb ({}), baseline {} MiB",
        refused_peak >> 20,
        media["status"],
        tight_baseline >> 20
    );
    assert!(alive(&mut tight), "the worker died; log:\n{}", tight.log());
    assert_eq!(media["status"], "rejected", "{media}");
    assert_eq!(media["rejection"]["code"], "TOO_MANY_PIXELS", "{media}");
    let detail = media["rejection"]["detail"].as_str().unwrap();
    assert!(detail.contains("8000x8000 16-bit RGBA needs") && detail.contains("decode memory of 128 MiB"), "{detail}");
    assert!(
        refused_peak <= tight_baseline + 32 * MIB,
        "peak RSS {} MiB against a baseline of {} MiB: it decoded",
        refused_peak >> 20,
        tight_baseline >> 20
    );
    tight.stop().await;

    // A worker with the default decode memory (320 MiB) decodes it, straight to 8 bits (256 MB, no 16-bit image),
    // within that memory and under the chart's 512 MiB, and stays up: no kill, no redelivery.
    let mut roomy = worker(&app, &market, &[]);
    let pid = roomy.child.id();
    let warm = submit(&app, who, &small(10)).await;
    let warmed = processed(&app, who, &warm, &roomy).await;
    assert_eq!(warmed["status"], "ready", "{warmed}");
    let baseline = peak_rss(pid);
    let id = submit(&app, who, &bomb).await;
    let media = processed(&app, who, &id, &roomy).await;
    let peak = peak_rss(pid);
    assert!(alive(&mut roomy), "the worker died; log:\n{}", roomy.log());
    assert_eq!(media["status"], "ready", "{media}; log:\n{}", roomy.log());
    assert_eq!((media["width"].as_u64(), media["height"].as_u64()), (Some(8000), Some(8000)));
    let operation = common::operation(&app, who, media["operation_id"].as_str().unwrap()).await;
    assert_eq!(operation["status"], "succeeded", "{operation}");
    let large = media["derivatives"].as_array().unwrap().iter().find(|d| d["name"] == "large").unwrap().clone();
    let resp = app.send(Method::GET, large["url"].as_str().unwrap(), who, None).await;
    let large = image::load_from_memory(&resp.bytes().await.unwrap()).unwrap();
    assert_eq!((large.width(), large.height(), large.color()), (1600, 1600, image::ColorType::Rgba8));
    assert_eq!(large.to_rgba8().get_pixel(800, 800).0, [0x12, 0x56, 0x9A, 0xFF], "the high byte of each sample");
    let bound = baseline + DECODE_MEMORY + 32 * MIB;
    eprintln!(
        "worker VmHWM with the default decode memory: {} MiB after the bomb, baseline {} MiB, bound {} MiB",
        peak >> 20,
        baseline >> 20,
        bound >> 20
    );
    assert!(peak <= bound, "peak RSS {} MiB over the decode memory's bound of {} MiB", peak >> 20, bound >> 20);
    assert!(
        peak <= CHART_WORKER_LIMIT - CGROUP_MARGIN,
        "peak RSS {} MiB: the chart's worker would be killed",
        peak >> 20
    );
    shutdown.cancel();
}

/// A `conveyor api` process over its own database and prefix, with `extra` variables; its URL, admin URL and a token.
async fn api_process(extra: &[(&str, &str)]) -> (Process, String, String, String) {
    let db = common::TestDb::create().await;
    let prefix = format!("conveyor-test-{}", Uuid::new_v4().simple());
    let mut vars: HashMap<String, String> = common::config_vars(&db, &prefix);
    let (port, admin_port) = (common::free_port(), common::free_port());
    vars.insert("CONVEYOR_HTTP_ADDR".into(), format!("127.0.0.1:{port}"));
    vars.insert("CONVEYOR_ADMIN_ADDR".into(), format!("127.0.0.1:{admin_port}"));
    for (name, value) in extra {
        vars.insert((*name).to_owned(), (*value).to_owned());
    }
    let process = Process::spawn(&["api"], &vars);
    let admin = format!("http://127.0.0.1:{admin_port}");
    let http = reqwest::Client::new();
    common::eventually(Duration::from_secs(30), || async {
        http.get(format!("{admin}/readyz")).send().await.ok().filter(|r| r.status().is_success())
    })
    .await
    .unwrap_or_else(|| panic!("the api process becomes ready; log:\n{}", process.log()));
    let tokens = conveyor_server::auth::TokenKeys::new(&conveyor_server::config::Secret::new(
        common::JWT_SECRET.as_bytes().to_vec(),
    ));
    let token = tokens.mint(principal(), Duration::from_secs(3600));
    (process, format!("http://127.0.0.1:{port}"), admin, token)
}

async fn create_media(http: &reqwest::Client, base: &str, token: &str, size: usize) -> String {
    let resp = http
        .post(format!("{base}/v1/media"))
        .bearer_auth(token)
        .header("idempotency-key", Uuid::new_v4().to_string())
        .json(&json!({"filename": "big.png", "content_type": "image/png", "size_bytes": size}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::CREATED);
    resp.json::<Value>().await.unwrap()["media"]["id"].as_str().unwrap().to_owned()
}

async fn metric(http: &reqwest::Client, admin: &str, name: &str) -> Option<f64> {
    let text = http.get(format!("{admin}/metrics")).send().await.ok()?.text().await.ok()?;
    text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

#[tokio::test]
async fn ten_concurrent_24_mib_uploads_keep_an_api_process_within_its_part_buffers() {
    const UPLOADS: u64 = 10;
    const SIZE: usize = 24 * 1024 * 1024;
    let (mut api, base, _admin, token) = api_process(&[]).await;
    let pid = api.child.id();
    let at_start = peak_rss(pid);
    let http = reqwest::Client::new();
    let mut ids = Vec::new();
    for _ in 0..=UPLOADS {
        ids.push(create_media(&http, &base, &token, SIZE).await);
    }
    // Every body differs (a PNG signature, then bytes of the media's own), so nothing is shared between them.
    let body = |i: usize| {
        let mut bytes = vec![i as u8; SIZE];
        bytes[..8].copy_from_slice(b"\x89PNG\r\n\x1a\n");
        bytes
    };
    // Warm up on one upload (connections, threads, the first part's allocation), then take the baseline.
    let put = |id: String, bytes: Vec<u8>| {
        let (http, base, token) = (http.clone(), base.clone(), token.clone());
        async move {
            http.put(format!("{base}/v1/media/{id}/content"))
                .bearer_auth(token)
                .header("content-type", "application/octet-stream")
                .body(bytes)
                .send()
                .await
                .unwrap()
                .status()
        }
    };
    assert_eq!(put(ids[0].clone(), body(0)).await, StatusCode::OK, "log:\n{}", api.log());
    let baseline = peak_rss(pid);
    let bodies: Vec<Vec<u8>> = (1..=UPLOADS as usize).map(body).collect();
    let uploads = ids[1..].iter().cloned().zip(bodies).map(|(id, bytes)| tokio::spawn(put(id, bytes)));
    for upload in futures_util::future::join_all(uploads).await {
        assert_eq!(upload.unwrap(), StatusCode::OK, "log:\n{}", api.log());
    }
    let peak = peak_rss(pid);
    // Each upload holds one part (5 MiB) and its connection's buffers (under a mebibyte), plus 32 MiB for the
    // allocator's and the runtime's slack.
    let bound = baseline + UPLOADS * (PART + MIB) + 32 * MIB;
    eprintln!(
        "api VmHWM: at start {} MiB, after one upload (the baseline) {} MiB, after {UPLOADS} concurrent 24 MiB \
         uploads {} MiB, bound {} MiB",
        at_start >> 20,
        baseline >> 20,
        peak >> 20,
        bound >> 20
    );
    assert!(alive(&mut api), "the api died; log:\n{}", api.log());
    assert!(peak <= bound, "peak RSS {} MiB over the bound of {} MiB", peak >> 20, bound >> 20);
    assert!(peak <= CHART_API_LIMIT - CGROUP_MARGIN, "peak RSS {} MiB: the chart's API would be killed", peak >> 20);
}

#[tokio::test]
async fn uploads_beyond_the_cap_are_answered_503_with_retry_after_and_the_cap_frees_as_they_end() {
    let (api, base, admin, token) = api_process(&[("CONVEYOR_MEDIA_MAX_CONCURRENT_UPLOADS", "2")]).await;
    let http = reqwest::Client::new();
    let mut ids = Vec::new();
    for _ in 0..4 {
        ids.push(create_media(&http, &base, &token, 1 << 20).await);
    }
    // Two uploads whose bodies the test feeds: each sends its first bytes, then waits.
    let mut feeds = Vec::new();
    let mut held = Vec::new();
    for id in &ids[..2] {
        let (feed, rx) = tokio::sync::mpsc::channel::<Result<Vec<u8>, std::io::Error>>(4);
        let body = futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|chunk| (chunk, rx)) });
        feed.send(Ok(b"\x89PNG\r\n\x1a\n".to_vec())).await.unwrap();
        feeds.push(feed);
        let request = http
            .put(format!("{base}/v1/media/{id}/content"))
            .bearer_auth(&token)
            .header("content-type", "image/png")
            .body(reqwest::Body::wrap_stream(body))
            .send();
        held.push(tokio::spawn(request));
    }
    let both = common::eventually(Duration::from_secs(30), || async {
        (metric(&http, &admin, "conveyor_media_uploads_in_progress").await == Some(2.0)).then_some(())
    })
    .await;
    if both.is_none() {
        eprintln!("conveyor_media_uploads_in_progress never showed 2 uploads in progress");
    }

    // A third, while they last: refused at once, before its body is read, with a time to retry after.
    let third = http
        .put(format!("{base}/v1/media/{}/content", ids[2]))
        .bearer_auth(&token)
        .header("content-type", "image/png")
        .body(b"\x89PNG\r\n\x1a\nthird".to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(third.status(), StatusCode::SERVICE_UNAVAILABLE, "log:\n{}", api.log());
    let retry_after = third.headers().get("retry-after").map(|v| v.to_str().unwrap().to_owned());
    assert!(retry_after.as_deref().is_some_and(|s| s.parse::<u64>().is_ok_and(|n| n >= 1)), "{retry_after:?}");
    let problem: Value = third.json().await.unwrap();
    assert_eq!(problem["code"], "UPLOADS_BUSY", "{problem}");
    assert_eq!(metric(&http, &admin, "conveyor_media_uploads_refused_total").await, Some(1.0));

    // The two end (their bodies finish) and are stored; then an upload goes through again.
    for feed in feeds {
        feed.send(Ok(b"the rest of the image".to_vec())).await.unwrap();
    }
    for request in held {
        assert_eq!(request.await.unwrap().unwrap().status(), StatusCode::OK, "log:\n{}", api.log());
    }
    common::eventually(Duration::from_secs(30), || async {
        (metric(&http, &admin, "conveyor_media_uploads_in_progress").await == Some(0.0)).then_some(())
    })
    .await
    .expect("no upload in progress any more");
    let fourth = http
        .put(format!("{base}/v1/media/{}/content", ids[3]))
        .bearer_auth(&token)
        .header("content-type", "image/png")
        .body(b"\x89PNG\r\n\x1a\nfourth".to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(fourth.status(), StatusCode::OK);
    let stored: Value = fourth.json().await.unwrap();
    assert_eq!(stored["size_bytes"], 14);
}
