//! Media: upload, complete, `media.process` and derivatives, against real PostgreSQL, Redis, object storage (a
//! directory per test) and workers (in-process, or a real `conveyor worker` process for the memory bound). Every
//! image is generated here with the image crate's encoders, metadata and bombs spliced in by hand.

use crate::common;

use conveyor_shop::metrics::MediaMetrics;
use std::collections::HashMap;
use std::io::Cursor;
use std::time::Duration;

use common::{TestApp, principal};
use conveyor_jobs::Metrics;
use conveyor_jobs::{Worker, WorkerSettings};
use conveyor_server::auth::Principal;
use conveyor_shop::domain::media::{self, DecodeGate, ImageLimits, ProcessOutcome, ProcessSettings};
use conveyor_shop::jobs::{ProcessMedia, ProcessMediaHandler};
use conveyor_shop::storage::{ObjectKey, ObjectStorage};
use image::{DynamicImage, ImageFormat};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(60);
const MARKER: &str = "secret-gps-48.8584N-2.2945E";

// ---------------------------------------------------------------------------------------------------------------
// Images made here.

fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 { (crc >> 1) ^ 0xEDB8_8320 } else { crc >> 1 };
        }
    }
    !crc
}

fn png_chunk(kind: &[u8; 4], data: &[u8]) -> Vec<u8> {
    let mut chunk = (data.len() as u32).to_be_bytes().to_vec();
    chunk.extend_from_slice(kind);
    chunk.extend_from_slice(data);
    let crc = crc32(&chunk[4..]);
    chunk.extend_from_slice(&crc.to_be_bytes());
    chunk
}

/// The chunk types of a PNG, in order.
fn png_chunk_types(bytes: &[u8]) -> Vec<String> {
    let mut at = 8;
    let mut types = Vec::new();
    while at + 8 <= bytes.len() {
        let length = u32::from_be_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
        types.push(String::from_utf8_lossy(&bytes[at + 4..at + 8]).into_owned());
        at += 12 + length;
    }
    types
}

fn gradient(width: u32, height: u32) -> DynamicImage {
    DynamicImage::ImageRgb8(image::RgbImage::from_fn(width, height, |x, y| {
        image::Rgb([(x % 251) as u8, (y % 241) as u8, ((x + y) % 239) as u8])
    }))
}

fn encode(image: &DynamicImage, format: ImageFormat) -> Vec<u8> {
    let mut out = Vec::new();
    image.write_to(&mut Cursor::new(&mut out), format).unwrap();
    out
}

/// A PNG with a text chunk and an EXIF chunk carrying [`MARKER`], right after its header.
fn png_with_metadata(width: u32, height: u32) -> Vec<u8> {
    let plain = encode(&gradient(width, height), ImageFormat::Png);
    let ihdr_end = 8 + 8 + 13 + 4;
    let mut exif = b"MM\x00\x2a\x00\x00\x00\x08\x00\x00".to_vec();
    exif.extend_from_slice(MARKER.as_bytes());
    let mut text = b"Comment\x00".to_vec();
    text.extend_from_slice(MARKER.as_bytes());
    let mut out = plain[..ihdr_end].to_vec();
    out.extend(png_chunk(b"tEXt", &text));
    out.extend(png_chunk(b"eXIf", &exif));
    out.extend_from_slice(&plain[ihdr_end..]);
    out
}

/// A JPEG with an APP1 EXIF segment and a comment carrying [`MARKER`], right after its start.
fn jpeg_with_metadata(width: u32, height: u32) -> Vec<u8> {
    let plain = encode(&gradient(width, height), ImageFormat::Jpeg);
    let mut exif = b"Exif\x00\x00MM\x00\x2a\x00\x00\x00\x08\x00\x00".to_vec();
    exif.extend_from_slice(MARKER.as_bytes());
    let segment = |marker: u8, payload: &[u8]| {
        let mut s = vec![0xFF, marker];
        s.extend_from_slice(&((payload.len() + 2) as u16).to_be_bytes());
        s.extend_from_slice(payload);
        s
    };
    let mut out = plain[..2].to_vec();
    out.extend(segment(0xE1, &exif));
    out.extend(segment(0xFE, MARKER.as_bytes()));
    out.extend_from_slice(&plain[2..]);
    out
}

/// A PNG whose header claims 100000 × 100000 pixels (10 GB of greyscale) in a few kilobytes: 10 rows of zeros,
/// deflated, under a header patched to claim 100000 rows.
fn png_bomb() -> Vec<u8> {
    let rows = DynamicImage::ImageLuma8(image::GrayImage::new(100_000, 10));
    let mut bytes = encode(&rows, ImageFormat::Png);
    bytes[20..24].copy_from_slice(&100_000u32.to_be_bytes());
    let crc = crc32(&bytes[12..29]);
    bytes[29..33].copy_from_slice(&crc.to_be_bytes());
    bytes
}

/// A real, complete PNG of 15000 × 15000 black pixels: 225 MB once inflated, a few hundred kilobytes deflated. Its
/// header is honest and under the image crate's own default allocation limit (512 MiB), so only the pixel limit
/// keeps a decoder from inflating all of it.
fn png_inflating_bomb() -> Vec<u8> {
    encode(&DynamicImage::ImageLuma8(image::GrayImage::new(15_000, 15_000)), ImageFormat::Png)
}

/// A JPEG whose frame header claims 60000 × 60000 pixels over the data of a 16 × 16 image.
fn jpeg_bomb() -> Vec<u8> {
    let mut bytes = encode(&gradient(16, 16), ImageFormat::Jpeg);
    let sof = bytes.windows(2).position(|w| w == [0xFF, 0xC0]).expect("a baseline frame header");
    bytes[sof + 5..sof + 7].copy_from_slice(&60_000u16.to_be_bytes());
    bytes[sof + 7..sof + 9].copy_from_slice(&60_000u16.to_be_bytes());
    bytes
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

// ---------------------------------------------------------------------------------------------------------------
// The API.

fn body(content_type: &str, size: usize) -> Value {
    json!({"filename": "photo.img", "content_type": content_type, "size_bytes": size})
}

async fn create(app: &TestApp, who: Principal, content_type: &str, size: usize) -> String {
    let resp = app.send(Method::POST, "/v1/media", who, Some(&body(content_type, size))).await;
    assert_eq!(resp.status(), StatusCode::CREATED);
    let created: Value = resp.json().await.unwrap();
    created["media"]["id"].as_str().unwrap().to_owned()
}

async fn put_content(app: &TestApp, who: Principal, id: &str, bytes: Vec<u8>) -> reqwest::Response {
    app.http
        .put(app.url(&format!("/v1/media/{id}/content")))
        .bearer_auth(app.token(who))
        .header("content-type", "application/octet-stream")
        .body(bytes)
        .send()
        .await
        .unwrap()
}

async fn complete(app: &TestApp, who: Principal, id: &str, key: &str) -> reqwest::Response {
    app.send_with_key(Method::POST, &format!("/v1/media/{id}/complete"), who, Some(key), Some(&json!({}))).await
}

async fn show(app: &TestApp, who: Principal, id: &str) -> Value {
    let resp = app.send(Method::GET, &format!("/v1/media/{id}"), who, None).await;
    assert_eq!(resp.status(), StatusCode::OK);
    resp.json().await.unwrap()
}

/// Creates, uploads and completes a media; returns its id and its operation's id.
async fn submit(app: &TestApp, who: Principal, content_type: &str, bytes: Vec<u8>) -> (String, String) {
    let id = create(app, who, content_type, bytes.len()).await;
    assert_eq!(put_content(app, who, &id, bytes).await.status(), StatusCode::OK);
    let resp = complete(app, who, &id, &Uuid::new_v4().to_string()).await;
    assert_eq!(resp.status(), StatusCode::ACCEPTED);
    let completed: Value = resp.json().await.unwrap();
    (id, completed["operation"]["id"].as_str().unwrap().to_owned())
}

/// Waits until the media leaves `processing`; returns it.
async fn processed(app: &TestApp, who: Principal, id: &str) -> Value {
    common::eventually(WAIT, || async {
        let media = show(app, who, id).await;
        (media["status"] != "processing").then_some(media)
    })
    .await
    .unwrap_or_else(|| panic!("media {id} was processed"))
}

async fn derivative_bytes(app: &TestApp, who: Principal, url: &str) -> (String, Vec<u8>) {
    let resp = app.send(Method::GET, url, who, None).await;
    assert_eq!(resp.status(), StatusCode::OK, "{url}");
    let content_type = resp.headers()["content-type"].to_str().unwrap().to_owned();
    (content_type, resp.bytes().await.unwrap().to_vec())
}

// ---------------------------------------------------------------------------------------------------------------
// Workers.

fn limits(app: &TestApp) -> ImageLimits {
    ImageLimits { max_bytes: app.config.scenarios.media_max_bytes, max_pixels: app.config.scenarios.media_max_pixels }
}

fn process_settings(app: &TestApp) -> ProcessSettings {
    ProcessSettings {
        storage: ObjectStorage::open(&app.config.scenarios.object_store_url).unwrap(),
        limits: limits(app),
        gate: DecodeGate::new(2, 320 << 20),
    }
}

/// A media worker counting into `metrics` (the platform's) and `media` (the shop's, in the same registry).
async fn media_worker(app: &TestApp, metrics: Metrics, media: MediaMetrics) -> Worker {
    let redis = common::redis_url();
    let client = conveyor_jobs::connect_redis(&redis, Duration::from_secs(2)).await.unwrap();
    let blocking = conveyor_jobs::connect_redis(&redis, Duration::from_secs(5)).await.unwrap();
    let consumer = conveyor_jobs::Consumer::new(
        client,
        blocking,
        conveyor_jobs::RedisKeys::new(&app.redis_prefix),
        format!("test-{}", Uuid::new_v4().simple()),
    );
    Worker::builder(app.db.pool.clone(), consumer)
        .runtime_pool(app.db.runtime_pool.clone())
        .handle::<ProcessMedia>(ProcessMediaHandler {
            settings: process_settings(app),
            metrics: media,
            max_attempts: 3,
            timeout: Duration::from_secs(120),
        })
        .settings(WorkerSettings { concurrency: 4, ..WorkerSettings::default() })
        .metrics(metrics)
        .build()
        .unwrap()
}

/// A dispatcher and a media worker in this process until the token is canceled; the worker's metrics.
async fn run_platform(app: &TestApp) -> (Metrics, CancellationToken) {
    let shutdown = CancellationToken::new();
    common::run_dispatcher(common::test_dispatcher(app, &common::redis_url(), |_| {}).await, &shutdown);
    let metrics = Metrics::new();
    let media = MediaMetrics::register(&metrics.registry);
    let worker = media_worker(app, metrics.clone(), media).await;
    tokio::spawn(worker.run(shutdown.clone(), Duration::from_secs(10)));
    (metrics, shutdown)
}

/// `conveyor_media_derivations_total{result}` as the process's registry (its `/metrics`) shows it.
fn derivations(metrics: &Metrics, result: &str) -> u64 {
    let families = metrics.registry.gather();
    let Some(family) = families.iter().find(|f| f.name() == "conveyor_media_derivations_total") else { return 0 };
    family
        .get_metric()
        .iter()
        .find(|m| m.get_label().iter().any(|l| l.name() == "result" && l.value() == result))
        .map_or(0, |m| m.get_counter().get_value() as u64)
}

// ---------------------------------------------------------------------------------------------------------------

#[tokio::test]
async fn a_png_and_a_jpeg_with_metadata_become_ready_with_clean_derivatives_of_the_right_sizes() {
    let app = TestApp::spawn().await;
    let (metrics, shutdown) = run_platform(&app).await;
    let who = principal();
    let cases = [
        ("image/png", png_with_metadata(1800, 900), (1800, 900), [(1600, 800), (256, 128)]),
        ("image/jpeg", jpeg_with_metadata(1000, 2000), (1000, 2000), [(800, 1600), (128, 256)]),
    ];
    for (content_type, original, (width, height), sizes) in cases {
        assert!(original.windows(MARKER.len()).any(|w| w == MARKER.as_bytes()), "the original carries metadata");
        let (id, op_id) = submit(&app, who, content_type, original.clone()).await;
        let media = processed(&app, who, &id).await;
        assert_eq!(media["status"], "ready", "{media}");
        assert_eq!((media["width"].as_u64().unwrap(), media["height"].as_u64().unwrap()), (width, height));
        assert_eq!(media["sha256"], sha256_hex(&original));
        assert_eq!(media["content_type"], content_type);
        assert_eq!(media["rejection"], Value::Null);
        assert!(media.get("upload_url").is_none(), "no upload URL once completed");
        let derivatives = media["derivatives"].as_array().unwrap();
        let names: Vec<&str> = derivatives.iter().map(|d| d["name"].as_str().unwrap()).collect();
        assert_eq!(names, ["large", "thumb"]);
        for (derivative, (w, h)) in derivatives.iter().zip(sizes) {
            let url = derivative["url"].as_str().unwrap();
            assert_eq!(url, format!("/v1/media/{id}/derivatives/{}", derivative["name"].as_str().unwrap()));
            assert_eq!((derivative["width"].as_u64().unwrap(), derivative["height"].as_u64().unwrap()), (w, h));
            assert_eq!(derivative["content_type"], content_type);
            let (served_type, bytes) = derivative_bytes(&app, who, url).await;
            assert_eq!(served_type, content_type);
            assert_eq!(derivative["size_bytes"].as_u64().unwrap(), bytes.len() as u64);
            let decoded = image::load_from_memory(&bytes).unwrap();
            assert_eq!((decoded.width() as u64, decoded.height() as u64), (w, h), "{url} decodes at its size");
            assert!(!bytes.windows(MARKER.len()).any(|w| w == MARKER.as_bytes()), "{url} carries no metadata");
            if content_type == "image/png" {
                assert_eq!(png_chunk_types(&bytes).iter().filter(|t| !["IDAT"].contains(&t.as_str())).count(), 2);
                assert_eq!(png_chunk_types(&bytes).first().map(String::as_str), Some("IHDR"));
                assert_eq!(png_chunk_types(&bytes).last().map(String::as_str), Some("IEND"));
            } else {
                assert!(!bytes.windows(2).any(|w| w == [0xFF, 0xE1]), "no APP1 (EXIF/XMP) segment");
                assert!(!bytes.windows(2).any(|w| w == [0xFF, 0xFE]), "no comment segment");
            }
        }
        let op = common::operation(&app, who, &op_id).await;
        assert_eq!(op["status"], "succeeded");
        assert_eq!(op["kind"], "media.process");
        assert_eq!(op["result"]["outcome"], "ready");
        assert_eq!(op["result"]["derivation"], "derived");
    }
    assert_eq!(derivations(&metrics, "derived"), 2);
    shutdown.cancel();
}

#[tokio::test]
async fn bad_bytes_end_rejected_with_their_codes_and_are_never_retried() {
    let app = TestApp::spawn_with(|v| {
        v.insert("CONVEYOR_MEDIA_MAX_BYTES".into(), (2 * 1024 * 1024).to_string());
    })
    .await;
    let (metrics, shutdown) = run_platform(&app).await;
    let who = principal();
    let png = encode(&gradient(300, 200), ImageFormat::Png);
    let cases = [
        ("image/png", encode(&gradient(30, 20), ImageFormat::Jpeg), "TYPE_MISMATCH"),
        ("image/jpeg", b"this is a text file, not a picture".to_vec(), "TYPE_MISMATCH"),
        ("image/png", b"GIF89a\x01\x00\x01\x00\x00\x00\x00;".to_vec(), "UNSUPPORTED_TYPE"),
        ("image/png", png[..png.len() / 2].to_vec(), "CORRUPT"),
        ("image/jpeg", jpeg_with_metadata(300, 200)[..2000].to_vec(), "CORRUPT"),
        ("image/png", png_bomb(), "TOO_MANY_PIXELS"),
        ("image/jpeg", jpeg_bomb(), "TOO_MANY_PIXELS"),
    ];
    assert!(png_bomb().len() < 16 * 1024, "the bomb is a few kilobytes: {}", png_bomb().len());
    for (content_type, bytes, code) in cases {
        let (id, op_id) = submit(&app, who, content_type, bytes).await;
        let media = processed(&app, who, &id).await;
        assert_eq!(media["status"], "rejected", "{code}: {media}");
        assert_eq!(media["rejection"]["code"], code, "{media}");
        assert!(!media["rejection"]["detail"].as_str().unwrap().is_empty());
        assert_eq!(media["derivatives"], json!([]));
        let op = common::operation(&app, who, &op_id).await;
        assert_eq!(op["status"], "succeeded", "a rejection is a result, not a failure: {op}");
        assert_eq!(op["result"], json!({"outcome": "rejected", "code": code, "detail": media["rejection"]["detail"]}));
    }

    // An object larger than the limit (a transfer's, adopted): rejected without being read.
    let storage = ObjectStorage::open(&app.config.scenarios.object_store_url).unwrap();
    let object = ObjectKey::new(who.workspace_id.0, "asset-transfers", Uuid::now_v7(), "object");
    let mut big = png.clone();
    big.resize(3 * 1024 * 1024, 0);
    storage.put(&object, big.into()).await.unwrap();
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, who.workspace_id).await.unwrap();
    let (adopted, operation) = media::adopt_object_tx(
        &mut tx,
        who.workspace_id,
        who.user_id,
        "big.png",
        "image/png",
        3 * 1024 * 1024,
        &object,
        None,
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert_eq!((adopted.status.as_str(), operation.kind.as_str()), ("processing", "media.process"));
    let media = processed(&app, who, &adopted.id.to_string()).await;
    assert_eq!(media["rejection"]["code"], "TOO_LARGE", "{media}");

    assert_eq!(derivations(&metrics, "rejected"), 8);
    assert_eq!(derivations(&metrics, "derived"), 0);
    assert_eq!(metrics.job_retries.with_label_values(&["media.process"]).get(), 0, "nothing was retried");
    shutdown.cancel();
}

#[tokio::test]
async fn each_endpoint_answers_with_its_codes() {
    let app = TestApp::spawn_with(|v| {
        v.insert("CONVEYOR_MEDIA_MAX_BYTES".into(), "200000".into());
    })
    .await;
    let who = principal();

    // POST /v1/media: 201 with the upload URL; refusals with codes; idempotent.
    let key = Uuid::new_v4().to_string();
    let first = app.send_with_key(Method::POST, "/v1/media", who, Some(&key), Some(&body("image/png", 1000))).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    let location = first.headers()["location"].to_str().unwrap().to_owned();
    let created: Value = first.json().await.unwrap();
    let id = created["media"]["id"].as_str().unwrap().to_owned();
    assert_eq!(location, format!("/v1/media/{id}"));
    assert_eq!(created["media"]["status"], "awaiting_upload");
    assert_eq!(created["media"]["upload_url"], format!("/v1/media/{id}/content"));
    let replay = app.send_with_key(Method::POST, "/v1/media", who, Some(&key), Some(&body("image/png", 1000))).await;
    assert_eq!(replay.status(), StatusCode::CREATED);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(replay.json::<Value>().await.unwrap(), created);
    let reused = app.send_with_key(Method::POST, "/v1/media", who, Some(&key), Some(&body("image/jpeg", 1000))).await;
    assert_eq!(reused.status(), StatusCode::CONFLICT);
    assert_eq!(reused.json::<Value>().await.unwrap()["code"], "IDEMPOTENCY_KEY_REUSED");
    assert_eq!(app.db.count("media", who.workspace_id).await, 1, "the replay and the reuse made nothing");
    let refusals = [
        (json!({"filename": "a.gif", "content_type": "image/gif", "size_bytes": 10}), "UNSUPPORTED_TYPE"),
        (json!({"filename": "a.png", "content_type": "image/png", "size_bytes": 200_001}), "TOO_LARGE"),
        (json!({"filename": "", "content_type": "image/png", "size_bytes": 10}), "VALIDATION_FAILED"),
        (json!({"filename": "../a.png", "content_type": "image/png", "size_bytes": 10}), "VALIDATION_FAILED"),
        (json!({"filename": "a.png", "content_type": "image/png"}), "VALIDATION_FAILED"),
        (json!({"filename": "a.png", "content_type": "image/png", "size_bytes": 1, "x": 1}), "VALIDATION_FAILED"),
    ];
    for (refused, code) in refusals {
        let resp = app.send(Method::POST, "/v1/media", who, Some(&refused)).await;
        assert_eq!(resp.status(), StatusCode::UNPROCESSABLE_ENTITY, "{refused}");
        assert_eq!(resp.json::<Value>().await.unwrap()["code"], code, "{refused}");
    }
    let keyless = app.send_with_key(Method::POST, "/v1/media", who, None, Some(&body("image/png", 1))).await;
    assert_eq!(keyless.status(), StatusCode::BAD_REQUEST);

    // Complete before any upload: 409 MEDIA_NOT_UPLOADED (and the key stays free for a later try).
    let complete_key = Uuid::new_v4().to_string();
    let early = complete(&app, who, &id, &complete_key).await;
    assert_eq!(early.status(), StatusCode::CONFLICT);
    assert_eq!(early.json::<Value>().await.unwrap()["code"], "MEDIA_NOT_UPLOADED");

    // PUT content: over the limit 413 (announced, or streamed without a length); re-uploads replace.
    let too_big = put_content(&app, who, &id, vec![0u8; 200_001]).await;
    assert_eq!(too_big.status(), StatusCode::PAYLOAD_TOO_LARGE);
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> = (0..4).map(|_| Ok(vec![0u8; 60_000])).collect();
    let streamed = app
        .http
        .put(app.url(&format!("/v1/media/{id}/content")))
        .bearer_auth(app.token(who))
        .body(reqwest::Body::wrap_stream(futures_util::stream::iter(chunks)))
        .send()
        .await
        .unwrap();
    assert_eq!(streamed.status(), StatusCode::PAYLOAD_TOO_LARGE);
    let objects = common::objects_dir(&app.redis_prefix).join(format!("workspaces/{}/media/{id}", who.workspace_id));
    let stored = || std::fs::read_dir(objects.join("uploads")).map(|d| d.count()).unwrap_or(0);
    assert_eq!(stored(), 0, "a refused upload leaves nothing behind");
    let first_upload = put_content(&app, who, &id, b"first bytes".to_vec()).await;
    assert_eq!(first_upload.status(), StatusCode::OK);
    assert_eq!(first_upload.json::<Value>().await.unwrap()["size_bytes"], 11);
    let png = encode(&gradient(40, 30), ImageFormat::Png);
    let second_upload = put_content(&app, who, &id, png.clone()).await;
    assert_eq!(second_upload.status(), StatusCode::OK);
    assert_eq!(second_upload.json::<Value>().await.unwrap()["size_bytes"], png.len());
    assert_eq!(stored(), 1, "the replaced upload was deleted");

    // Complete: 202 with the operation; replay; another key 409 naming the same operation; PUT now 409.
    let done = complete(&app, who, &id, &complete_key).await;
    assert_eq!(done.status(), StatusCode::ACCEPTED);
    let location = done.headers()["location"].to_str().unwrap().to_owned();
    let completed: Value = done.json().await.unwrap();
    let op_id = completed["operation"]["id"].as_str().unwrap().to_owned();
    assert_eq!(location, format!("/v1/operations/{op_id}"));
    assert_eq!(completed["media"]["id"], id.as_str());
    assert_eq!(completed["media"]["status"], "processing");
    assert_eq!(completed["operation"]["kind"], "media.process");
    assert_eq!(completed["operation"]["status"], "queued");
    let replayed = complete(&app, who, &id, &complete_key).await;
    assert_eq!(replayed.status(), StatusCode::ACCEPTED);
    assert_eq!(replayed.headers()["idempotent-replayed"], "true");
    assert_eq!(replayed.json::<Value>().await.unwrap(), completed);
    let again = complete(&app, who, &id, &Uuid::new_v4().to_string()).await;
    assert_eq!(again.status(), StatusCode::CONFLICT);
    let problem: Value = again.json().await.unwrap();
    assert_eq!(
        (problem["code"].as_str(), problem["operation_id"].as_str()),
        (Some("MEDIA_ALREADY_COMPLETED"), Some(op_id.as_str()))
    );
    // The same key on a request that means something else (a `Prefer` header changes the fingerprint).
    let reused = app
        .http
        .post(app.url(&format!("/v1/media/{id}/complete")))
        .bearer_auth(app.token(who))
        .header("idempotency-key", &complete_key)
        .header("prefer", "respond-async")
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(reused.status(), StatusCode::CONFLICT);
    assert_eq!(reused.json::<Value>().await.unwrap()["code"], "IDEMPOTENCY_KEY_REUSED");
    let late = put_content(&app, who, &id, png.clone()).await;
    assert_eq!(late.status(), StatusCode::CONFLICT);
    let problem: Value = late.json().await.unwrap();
    assert_eq!(
        (problem["code"].as_str(), problem["operation_id"].as_str()),
        (Some("MEDIA_ALREADY_COMPLETED"), Some(op_id.as_str()))
    );
    assert_eq!(stored(), 1, "the refused late upload was deleted");
    assert_eq!(app.db.count("operations", who.workspace_id).await, 1);
    assert_eq!(app.db.count("outbox_events", who.workspace_id).await, 1);

    // GET: the media while processing; derivatives 404 until ready; unknown ids and names 404.
    let media = show(&app, who, &id).await;
    assert_eq!((media["status"].as_str(), media["width"].as_u64()), (Some("processing"), None));
    assert_eq!(media["derivatives"], json!([]));
    for path in [
        format!("/v1/media/{id}/derivatives/thumb"),
        format!("/v1/media/{}", Uuid::new_v4()),
        "/v1/media/not-a-uuid".to_owned(),
    ] {
        let resp = app.send(Method::GET, &path, who, None).await;
        assert_eq!(resp.status(), StatusCode::NOT_FOUND, "{path}");
    }
    let missing = complete(&app, who, &Uuid::new_v4().to_string(), &Uuid::new_v4().to_string()).await;
    assert_eq!(missing.status(), StatusCode::NOT_FOUND);
    let missing = put_content(&app, who, &Uuid::new_v4().to_string(), b"x".to_vec()).await;
    assert_eq!(missing.status(), StatusCode::NOT_FOUND);

    // Once processed, the derivatives are served and unknown names are 404.
    let (_metrics, shutdown) = run_platform(&app).await;
    assert_eq!(processed(&app, who, &id).await["status"], "ready");
    let (content_type, _) = derivative_bytes(&app, who, &format!("/v1/media/{id}/derivatives/thumb")).await;
    assert_eq!(content_type, "image/png");
    let unknown = app.send(Method::GET, &format!("/v1/media/{id}/derivatives/original"), who, None).await;
    assert_eq!(unknown.status(), StatusCode::NOT_FOUND);
    shutdown.cancel();
}

#[tokio::test]
async fn completing_twice_at_once_derives_once_and_the_same_bytes_are_never_derived_again() {
    let app = TestApp::spawn().await;
    let who = principal();
    let jpeg = jpeg_with_metadata(640, 480);
    let id = create(&app, who, "image/jpeg", jpeg.len()).await;
    assert_eq!(put_content(&app, who, &id, jpeg.clone()).await.status(), StatusCode::OK);

    // Two completions under different keys at once: the database lets one in, the other names its operation.
    let (key_a, key_b) = (Uuid::new_v4().to_string(), Uuid::new_v4().to_string());
    let (a, b) = tokio::join!(complete(&app, who, &id, &key_a), complete(&app, who, &id, &key_b));
    let mut statuses = [a.status(), b.status()];
    statuses.sort();
    assert_eq!(statuses, [StatusCode::ACCEPTED, StatusCode::CONFLICT]);
    let (a, b): (Value, Value) = (a.json().await.unwrap(), b.json().await.unwrap());
    let (won, lost) = if a.get("operation").is_some() { (a, b) } else { (b, a) };
    assert_eq!(lost["code"], "MEDIA_ALREADY_COMPLETED");
    assert_eq!(lost["operation_id"], won["operation"]["id"]);
    assert_eq!(app.db.count("operations", who.workspace_id).await, 1);

    // A run that derived and stored everything, then died before its commit: its retry derives nothing again.
    let settings = process_settings(&app);
    let media_id: Uuid = id.parse().unwrap();
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, who.workspace_id).await.unwrap();
    let outcome = media::process_tx(&mut tx, &settings, who.workspace_id, media_id).await.unwrap();
    assert!(matches!(outcome, ProcessOutcome::Ready { derivation: media::Derivation::Derived, .. }), "{outcome:?}");
    tx.rollback().await.unwrap();
    assert_eq!(show(&app, who, &id).await["status"], "processing", "the crashed run committed nothing");

    let (metrics, shutdown) = run_platform(&app).await;
    let media = processed(&app, who, &id).await;
    assert_eq!(media["status"], "ready");
    let op = common::operation(&app, who, won["operation"]["id"].as_str().unwrap()).await;
    assert_eq!(op["result"]["derivation"], "reused", "{op}");
    assert_eq!((derivations(&metrics, "derived"), derivations(&metrics, "reused")), (0, 1));

    // A second delivery of the job after it committed: nothing done.
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, who.workspace_id).await.unwrap();
    let again = conveyor_jobs::enqueue_tx(&mut tx, &ProcessMedia { media_id }, conveyor_jobs::EnqueueOptions::new())
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let ended = conveyor_jobs::wait_for_job(&app.db.pool, who.workspace_id, again.id, WAIT).await.unwrap();
    assert_eq!(ended.result, Some(json!({"outcome": "already_done", "status": "ready"})));

    // The same bytes as another media of the workspace: the stored derivation is reused, nothing derived.
    let (other, _) = submit(&app, who, "image/jpeg", jpeg.clone()).await;
    let other = processed(&app, who, &other).await;
    assert_eq!(other["status"], "ready");
    assert_eq!(other["derivatives"].as_array().unwrap().len(), 2);
    assert_eq!(other["sha256"], media["sha256"]);
    let sizes =
        |m: &Value| m["derivatives"].as_array().unwrap().iter().map(|d| d["size_bytes"].clone()).collect::<Vec<_>>();
    assert_eq!(sizes(&other), sizes(&media));
    assert_eq!((derivations(&metrics, "derived"), derivations(&metrics, "reused")), (0, 2));
    assert_eq!(app.db.count("media_derivations", who.workspace_id).await, 1);

    // Other bytes are derived; so are the same bytes in another workspace (workspaces share nothing).
    let (fresh, _) = submit(&app, who, "image/jpeg", jpeg_with_metadata(64, 64)).await;
    assert_eq!(processed(&app, who, &fresh).await["status"], "ready");
    assert_eq!(derivations(&metrics, "derived"), 1);
    let elsewhere = principal();
    let (theirs, _) = submit(&app, elsewhere, "image/jpeg", jpeg.clone()).await;
    let theirs = processed(&app, elsewhere, &theirs).await;
    assert_eq!((theirs["status"].as_str(), &theirs["sha256"]), (Some("ready"), &media["sha256"]));
    assert_eq!(derivations(&metrics, "derived"), 2);
    assert_eq!(app.db.count("media_derivations", elsewhere.workspace_id).await, 1);
    shutdown.cancel();
}

#[tokio::test]
async fn another_workspace_gets_404_on_every_media_route() {
    let app = TestApp::spawn().await;
    let (_metrics, shutdown) = run_platform(&app).await;
    let (owner, stranger) = (principal(), principal());
    let (id, _) = submit(&app, owner, "image/png", encode(&gradient(50, 40), ImageFormat::Png)).await;
    assert_eq!(processed(&app, owner, &id).await["status"], "ready");
    let pending = create(&app, owner, "image/png", 10).await;

    for path in [format!("/v1/media/{id}"), format!("/v1/media/{id}/derivatives/thumb"), format!("/v1/media/{pending}")]
    {
        let resp = app.send(Method::GET, &path, stranger, None).await;
        assert_eq!(resp.status(), StatusCode::NOT_FOUND, "{path}");
        assert_eq!(resp.json::<Value>().await.unwrap()["code"], "NOT_FOUND");
    }
    for target in [&id, &pending] {
        let resp = put_content(&app, stranger, target, b"not yours".to_vec()).await;
        assert_eq!(resp.status(), StatusCode::NOT_FOUND);
        let resp = complete(&app, stranger, target, &Uuid::new_v4().to_string()).await;
        assert_eq!(resp.status(), StatusCode::NOT_FOUND);
    }
    // The owner's media are untouched.
    assert_eq!(show(&app, owner, &pending).await["status"], "awaiting_upload");
    assert_eq!(show(&app, owner, &pending).await["size_bytes"], 10);
    assert_eq!(app.db.count("media", stranger.workspace_id).await, 0);

    // Row-level security: both tables are forced, and a session without a workspace sees none of their rows.
    let mut owner_conn = app.db.owner().await;
    let forced: Vec<(String, bool, bool)> = sqlx::query_as(
        "SELECT relname::text, relrowsecurity, relforcerowsecurity FROM pg_class
         WHERE relname IN ('media', 'media_derivations') ORDER BY relname",
    )
    .fetch_all(&mut owner_conn)
    .await
    .unwrap();
    assert_eq!(forced, [("media".into(), true, true), ("media_derivations".into(), true, true)]);
    let mut conn = app.db.app_connection().await;
    for (table, owned) in [("media", 2), ("media_derivations", 1)] {
        let (seen,): (i64,) =
            sqlx::query_as(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {}", common::qualified(table))))
                .fetch_one(&mut conn)
                .await
                .unwrap();
        assert_eq!(seen, 0, "{table} without a workspace");
        assert_eq!(app.db.count(table, owner.workspace_id).await, owned, "{table} of the owner");
    }
    shutdown.cancel();
}

/// `VmHWM` (peak resident set) of process `pid`, in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).expect("VmHWM in /proc/<pid>/status");
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

#[tokio::test]
async fn a_decompression_bomb_never_grows_a_worker_process_past_the_bound_of_its_limits() {
    const MAX_BYTES: u64 = 4 * 1024 * 1024;
    const MAX_PIXELS: u64 = 4_000_000;
    // Fewer permits than images at once (and than cores): the bound follows the permits.
    const PERMITS: u64 = 1;
    let limits = |v: &mut HashMap<String, String>| {
        v.insert("CONVEYOR_MEDIA_MAX_BYTES".into(), MAX_BYTES.to_string());
        v.insert("CONVEYOR_MEDIA_MAX_PIXELS".into(), MAX_PIXELS.to_string());
    };
    let app = TestApp::spawn_with(limits).await;
    let (_sandbox, market) = common::sandbox(conveyor_shop::adapters::sandbox::Settings::default()).await;
    let shutdown = CancellationToken::new();
    // The relay's queue gate off: the burst below needs all eight jobs in the stream at once, as a worker finds them
    // when the gate is off, or after its workers died with entries read (the gate would keep four waiting).
    let ungated = |v: &mut std::collections::HashMap<String, String>| {
        v.insert("CONVEYOR_DISPATCH_QUEUE_WAIT".into(), "0s".into());
    };
    common::run_dispatcher(common::test_dispatcher(&app, &common::redis_url(), ungated).await, &shutdown);
    let mut vars = common::config_vars(&app.db, &app.redis_prefix);
    limits(&mut vars);
    vars.insert("CONVEYOR_ADMIN_ADDR".into(), format!("127.0.0.1:{}", common::free_port()));
    vars.insert("CONVEYOR_MARKETPLACE_URL".into(), market);
    vars.insert("CONVEYOR_MEDIA_DECODE_PERMITS".into(), PERMITS.to_string());
    let worker = common::Process::spawn(&["worker"], &vars);
    let pid = worker.child.id();
    let who = principal();

    // Warm up (connections, threads, the decoder's code) on a small image, then take the baseline.
    let (warm, _) = submit(&app, who, "image/png", encode(&gradient(64, 64), ImageFormat::Png)).await;
    assert_eq!(processed(&app, who, &warm).await["status"], "ready", "log:\n{}", worker.log());
    let baseline = peak_rss(pid);

    // At most one decode per permit at once (the worker's gate, `CONVEYOR_MEDIA_DECODE_PERMITS`), each holding at
    // most the original and 12 bytes a pixel (what a 16-bit RGBA decode and its 8-bit copy took before decodes went
    // straight to 8 bits; an upper bound still); plus 64 MiB for the allocator's and the runtime's slack. The bombs
    // claim 10^10, 3.6 × 10^9 and 2.25 × 10^8 pixels. (tests/memory_bounds.rs holds the decode memory's bounds.)
    let bound = baseline + PERMITS * (MAX_BYTES + 12 * MAX_PIXELS) + 64 * 1024 * 1024;
    let started = std::time::Instant::now();
    let inflating = png_inflating_bomb();
    eprintln!("inflating bomb: {} bytes, made in {:?}", inflating.len(), started.elapsed());
    for (content_type, bomb) in [("image/png", png_bomb()), ("image/jpeg", jpeg_bomb()), ("image/png", inflating)] {
        let (id, _) = submit(&app, who, content_type, bomb).await;
        let media = processed(&app, who, &id).await;
        let peak = peak_rss(pid);
        assert!(peak <= bound, "peak RSS {peak} over the bound {bound} (baseline {baseline}) after {media}");
        assert_eq!(media["rejection"]["code"], "TOO_MANY_PIXELS", "{media}");
    }
    let after_bombs = peak_rss(pid);

    // A real image just under the pixel limit decodes within the same bound.
    let (big, _) = submit(&app, who, "image/png", encode(&gradient(2000, 1999), ImageFormat::Png)).await;
    assert_eq!(processed(&app, who, &big).await["status"], "ready");
    let after_decode = peak_rss(pid);
    assert!(after_decode <= bound, "peak RSS {after_decode} over the bound {bound} (baseline {baseline})");

    // Eight different RGBA images of 4 MP queued while no worker runs, then a fresh worker (16 jobs at once) takes
    // them all at once: the gate keeps it to one image in memory per permit. (Without it: about 8 × 27 MB more.)
    drop(worker);
    let mut ids = Vec::new();
    for i in 0..8u32 {
        let rgba = DynamicImage::ImageRgba8(image::RgbaImage::from_fn(2000, 1990 - i, |x, y| {
            image::Rgba([(x / 8 % 256) as u8, (y / 8 % 256) as u8, (i * 30) as u8, 200])
        }));
        ids.push(submit(&app, who, "image/png", encode(&rgba, ImageFormat::Png)).await.0);
    }
    common::eventually(WAIT, || async {
        let rows = app.db.rows("outbox_events", who.workspace_id).await;
        rows.iter().all(|r| r["status"] != "pending" && r["status"] != "dispatching").then_some(())
    })
    .await
    .expect("the eight jobs are in the stream");
    let worker = common::Process::spawn(&["worker"], &vars);
    for id in &ids {
        let media = processed(&app, who, id).await;
        assert_eq!(media["status"], "ready", "{media}; log:\n{}", worker.log());
    }
    let after_burst = peak_rss(worker.child.id());
    assert!(after_burst <= bound, "peak RSS {after_burst} over the bound {bound} (baseline {baseline})");
    eprintln!(
        "worker VmHWM: baseline {} MiB, after the bombs {} MiB, after a 4 MP decode {} MiB, a fresh worker after \
         8 RGBA 4 MP at once {} MiB, bound {} MiB",
        baseline >> 20,
        after_bombs >> 20,
        after_decode >> 20,
        after_burst >> 20,
        bound >> 20
    );
    shutdown.cancel();
}

#[tokio::test]
async fn a_media_whose_processing_was_canceled_can_be_completed_again_and_only_then() {
    let app = TestApp::spawn().await;
    let who = principal();
    let png = encode(&gradient(120, 90), ImageFormat::Png);
    let (id, first_op) = submit(&app, who, "image/png", png).await;
    // Not started yet (nothing runs the job): cancel it. The media stays `processing`, its bytes frozen.
    let canceled = app.send(Method::POST, &format!("/v1/operations/{first_op}/cancel"), who, Some(&json!({}))).await;
    assert_eq!(canceled.status(), StatusCode::OK);
    assert_eq!(show(&app, who, &id).await["status"], "processing");

    // Completing again starts a new operation; a third completion names that one.
    let again = complete(&app, who, &id, &Uuid::new_v4().to_string()).await;
    assert_eq!(again.status(), StatusCode::ACCEPTED);
    let second_op = again.json::<Value>().await.unwrap()["operation"]["id"].as_str().unwrap().to_owned();
    assert_ne!(second_op, first_op);
    let third = complete(&app, who, &id, &Uuid::new_v4().to_string()).await;
    assert_eq!(third.status(), StatusCode::CONFLICT);
    assert_eq!(third.json::<Value>().await.unwrap()["operation_id"], second_op.as_str());

    let (metrics, shutdown) = run_platform(&app).await;
    assert_eq!(processed(&app, who, &id).await["status"], "ready");
    assert_eq!(common::operation(&app, who, &second_op).await["status"], "succeeded");
    assert_eq!(common::operation(&app, who, &first_op).await["status"], "canceled");
    assert_eq!(derivations(&metrics, "derived"), 1);
    // Once it succeeded, no completion goes through any more.
    let late = complete(&app, who, &id, &Uuid::new_v4().to_string()).await;
    assert_eq!(late.status(), StatusCode::CONFLICT);
    assert_eq!(late.json::<Value>().await.unwrap()["operation_id"], second_op.as_str());
    shutdown.cancel();
}

// ---------------------------------------------------------------------------------------------------------------
// Review fixes: the gate's permit outlives a canceled job's decode, decoder panics, orientation, concurrent twins.

/// A dispatcher in this process and a real `conveyor worker` process with `extra` variables (until the token is
/// canceled and the process dropped).
async fn worker_process(app: &TestApp, extra: &[(&str, String)]) -> (common::Process, CancellationToken) {
    let (_sandbox, market) = common::sandbox(conveyor_shop::adapters::sandbox::Settings::default()).await;
    let shutdown = CancellationToken::new();
    common::run_dispatcher(common::test_dispatcher(app, &common::redis_url(), |_| {}).await, &shutdown);
    let mut vars = common::config_vars(&app.db, &app.redis_prefix);
    vars.insert("CONVEYOR_ADMIN_ADDR".into(), format!("127.0.0.1:{}", common::free_port()));
    vars.insert("CONVEYOR_MARKETPLACE_URL".into(), market);
    for (name, value) in extra {
        vars.insert((*name).to_owned(), value.clone());
    }
    (common::Process::spawn(&["worker"], &vars), shutdown)
}

async fn cancel(app: &TestApp, who: Principal, operation: &str) {
    let resp = app.send(Method::POST, &format!("/v1/operations/{operation}/cancel"), who, Some(&json!({}))).await;
    assert_eq!(resp.status(), StatusCode::OK, "{}", resp.text().await.unwrap());
}

#[tokio::test]
async fn a_canceled_decode_keeps_its_permit_until_its_blocking_work_ends() {
    const MAX_BYTES: u64 = 16 * 1024 * 1024;
    const MAX_PIXELS: u64 = 16_000_000;
    const PERMITS: u64 = 1;
    let limits = |v: &mut HashMap<String, String>| {
        v.insert("CONVEYOR_MEDIA_MAX_BYTES".into(), MAX_BYTES.to_string());
        v.insert("CONVEYOR_MEDIA_MAX_PIXELS".into(), MAX_PIXELS.to_string());
    };
    let app = TestApp::spawn_with(limits).await;
    let who = principal();
    // 16-bit RGBA, decoded straight to 8 bits (64 MB of pixels), held (by the failpoint) for 12 s after each decode.
    let (width, height) = (4000u32, 3990u32);
    let rgba16 = DynamicImage::ImageRgba16(image::ImageBuffer::from_fn(width, height, |x, y| {
        image::Rgba([(x * 16 % 65536) as u16, (y * 16 % 65536) as u16, 9000, 50000])
    }));
    let png = encode(&rgba16, ImageFormat::Png);
    drop(rgba16);
    assert!(png.len() as u64 <= MAX_BYTES, "{} bytes", png.len());
    // What one decode of it reserves from the decode memory (the original, its 8-bit pixels, the decoder's working
    // memory and the derivatives), as the worker computes it from the header.
    let reserved =
        media::inspect("image/png", &png, ImageLimits { max_bytes: MAX_BYTES, max_pixels: MAX_PIXELS }).unwrap().memory;
    let (worker, shutdown) = worker_process(
        &app,
        &[
            ("CONVEYOR_MEDIA_MAX_BYTES", MAX_BYTES.to_string()),
            ("CONVEYOR_MEDIA_MAX_PIXELS", MAX_PIXELS.to_string()),
            ("CONVEYOR_MEDIA_DECODE_PERMITS", PERMITS.to_string()),
            ("FAILPOINTS", "media::decoded=sleep(12000)".into()),
        ],
    )
    .await;
    let pid = worker.child.id();
    // Warm up on a small image (it sleeps in the failpoint too), then take the baseline.
    let (warm, _) = submit(&app, who, "image/png", encode(&gradient(64, 64), ImageFormat::Png)).await;
    assert_eq!(processed(&app, who, &warm).await["status"], "ready", "log:\n{}", worker.log());
    let baseline = peak_rss(pid);
    // One decode per permit, each holding at most what it reserved, plus 64 MiB of slack: the bound of
    // `CONVEYOR_MEDIA_DECODE_PERMITS`, not of the cores.
    let bound = baseline + PERMITS * reserved + 64 * 1024 * 1024;

    // Complete, let the job start its decode, cancel it, complete again: five times. Each canceled decode goes on
    // running on its blocking thread, holding its original and 64 MB of pixels for 12 s; if its job gave the permit
    // back when it was dropped, the next job would decode beside it (five at once: some 380 MB over the baseline).
    let (id, mut op) = submit(&app, who, "image/png", png).await;
    for round in 0..5 {
        common::operation_reaches(&app, who, &op, "running", WAIT)
            .await
            .unwrap_or_else(|| panic!("round {round}: the job never started; log:\n{}", worker.log()));
        tokio::time::sleep(Duration::from_millis(500)).await;
        cancel(&app, who, &op).await;
        common::operation_reaches(&app, who, &op, "canceled", WAIT).await.expect("canceled");
        let again = complete(&app, who, &id, &Uuid::new_v4().to_string()).await;
        assert_eq!(again.status(), StatusCode::ACCEPTED, "round {round}");
        op = again.json::<Value>().await.unwrap()["operation"]["id"].as_str().unwrap().to_owned();
    }
    let media = processed(&app, who, &id).await;
    assert_eq!(media["status"], "ready", "{media}; log:\n{}", worker.log());
    assert_eq!((media["width"].as_u64(), media["height"].as_u64()), (Some(4000), Some(3990)));
    let peak = peak_rss(pid);
    eprintln!(
        "worker VmHWM: baseline {} MiB, after five canceled decodes {} MiB, bound {} MiB",
        baseline >> 20,
        peak >> 20,
        bound >> 20
    );
    assert!(peak <= bound, "peak RSS {peak} over the bound {bound} of {PERMITS} permit (baseline {baseline})");
    shutdown.cancel();
}

#[tokio::test]
async fn a_decoder_panic_rejects_the_media_as_corrupt_instead_of_leaving_it_processing() {
    let app = TestApp::spawn().await;
    let who = principal();
    let (worker, shutdown) = worker_process(&app, &[("FAILPOINTS", "media::derive=panic".into())]).await;
    let (id, op) = submit(&app, who, "image/png", encode(&gradient(40, 30), ImageFormat::Png)).await;
    let media = processed(&app, who, &id).await;
    assert_eq!(media["status"], "rejected", "{media}; log:\n{}", worker.log());
    assert_eq!(media["rejection"]["code"], "CORRUPT");
    assert_eq!(media["rejection"]["detail"], "the image could not be decoded");
    let op = common::operation_reaches(&app, who, &op, "succeeded", WAIT).await.expect("the operation succeeded");
    assert_eq!(op["result"]["outcome"], "rejected", "{op}");
    assert_eq!(op["result"]["code"], "CORRUPT");
    shutdown.cancel();
}

/// A JPEG of `width` × `height` (left half red, right half blue) whose EXIF says orientation `orientation`.
fn jpeg_with_orientation(width: u32, height: u32, orientation: u16) -> Vec<u8> {
    let image = DynamicImage::ImageRgb8(image::RgbImage::from_fn(width, height, |x, _| {
        if x < width / 2 { image::Rgb([230, 20, 20]) } else { image::Rgb([20, 20, 230]) }
    }));
    let plain = encode(&image, ImageFormat::Jpeg);
    // TIFF, big-endian: one IFD of one entry, Orientation (0x0112), SHORT, count 1.
    let mut exif = b"Exif\x00\x00MM\x00\x2a\x00\x00\x00\x08\x00\x01\x01\x12\x00\x03\x00\x00\x00\x01".to_vec();
    exif.extend_from_slice(&orientation.to_be_bytes());
    exif.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
    let mut out = plain[..2].to_vec();
    out.extend_from_slice(&[0xFF, 0xE1]);
    out.extend_from_slice(&((exif.len() + 2) as u16).to_be_bytes());
    out.extend_from_slice(&exif);
    out.extend_from_slice(&plain[2..]);
    out
}

#[tokio::test]
async fn a_jpeg_with_exif_orientation_is_derived_upright() {
    let app = TestApp::spawn().await;
    let (_metrics, shutdown) = run_platform(&app).await;
    let who = principal();
    // Stored 300 × 200, to be shown turned 90° clockwise (orientation 6): 200 × 300, the left (red) half on top.
    let (id, _) = submit(&app, who, "image/jpeg", jpeg_with_orientation(300, 200, 6)).await;
    let media = processed(&app, who, &id).await;
    assert_eq!(media["status"], "ready", "{media}");
    assert_eq!((media["width"].as_u64(), media["height"].as_u64()), (Some(200), Some(300)), "{media}");
    for derivative in media["derivatives"].as_array().unwrap() {
        let (_, bytes) = derivative_bytes(&app, who, derivative["url"].as_str().unwrap()).await;
        let image = image::load_from_memory(&bytes).unwrap().to_rgb8();
        assert!(image.height() > image.width(), "{derivative}: upright, taller than wide");
        assert_eq!(
            (Some(u64::from(image.width())), Some(u64::from(image.height()))),
            (derivative["width"].as_u64(), derivative["height"].as_u64())
        );
        let top = image.get_pixel(image.width() / 2, image.height() / 8);
        let bottom = image.get_pixel(image.width() / 2, image.height() * 7 / 8);
        assert!(top[0] > 150 && top[2] < 100, "{derivative}: red on top, got {top:?}");
        assert!(bottom[2] > 150 && bottom[0] < 100, "{derivative}: blue below, got {bottom:?}");
        // The tag itself is gone with the rest of the metadata (the pixels carry the orientation now).
        assert!(!bytes.windows(6).any(|w| w == b"Exif\x00\x00"), "{derivative}: no EXIF left");
    }
    shutdown.cancel();
}

#[tokio::test]
async fn two_media_with_the_same_bytes_processed_at_once_are_derived_once() {
    let app = TestApp::spawn().await;
    let who = principal();
    // Large enough that one decode takes a while: both runs are past their first look before either could store.
    let jpeg = jpeg_with_metadata(2000, 1500);
    let (a, _) = submit(&app, who, "image/jpeg", jpeg.clone()).await;
    let (b, _) = submit(&app, who, "image/jpeg", jpeg).await;
    // Two runs at once, each in its own transaction, committed as soon as it returns (as the worker does).
    let run = |media_id: String| {
        let (pool, settings) = (app.db.pool.clone(), process_settings(&app));
        tokio::spawn(async move {
            let mut tx = conveyor_jobs::begin_workspace(&pool, who.workspace_id).await.unwrap();
            let outcome = media::process_tx(&mut tx, &settings, who.workspace_id, media_id.parse().unwrap()).await;
            tx.commit().await.unwrap();
            outcome.map_err(|e| e.to_string())
        })
    };
    let (first, second) = tokio::join!(run(a.clone()), run(b.clone()));
    let mut derivations: Vec<String> = [first.unwrap(), second.unwrap()]
        .into_iter()
        .map(|outcome| match outcome {
            Ok(ProcessOutcome::Ready { derivation, .. }) => derivation.label().to_owned(),
            other => format!("{other:?}"),
        })
        .collect();
    derivations.sort();
    assert_eq!(derivations, ["derived", "reused"], "one derivation, the other run reuses it");
    let (a, b) = (show(&app, who, &a).await, show(&app, who, &b).await);
    assert_eq!((a["status"].as_str(), b["status"].as_str()), (Some("ready"), Some("ready")));
    assert_eq!(a["sha256"], b["sha256"]);
    assert_eq!(app.db.count("media_derivations", who.workspace_id).await, 1);
}
