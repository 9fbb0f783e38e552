//! Object storage on S3, for real: an S3 server (moto, `scripts/s3.sh`) on a free loopback port, the bucket created
//! over its REST API. The store's own operations (a multipart concatenation, ranges, deletes), then `conveyor api`,
//! `dispatcher` and `worker` processes given the credentials, region and endpoint as the chart gives them, in the
//! standard `AWS_*` variables: an upload of several parts, its derivatives and an asset transfer, end to end.

use crate::common;

use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use common::{Process, principal};
use conveyor_shop::adapters::sandbox::{Settings, files};
use conveyor_shop::storage::{ObjectKey, ObjectStorage, StorageError};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use uuid::Uuid;

/// moto's S3 server on a loopback port of its own, with one bucket; killed when dropped.
struct S3 {
    child: Child,
    endpoint: String,
    bucket: String,
}

impl S3 {
    async fn start() -> Self {
        let tools = std::env::var("CONVEYOR_TOOLS_DIR")
            .unwrap_or_else(|_| format!("{}/.cache/conveyor-tools", std::env::var("HOME").unwrap_or_default()));
        let server =
            std::env::var("CONVEYOR_TEST_MOTO_SERVER").unwrap_or_else(|_| format!("{tools}/moto/bin/moto_server"));
        assert!(
            std::path::Path::new(&server).is_file(),
            "no S3 server at {server}: run scripts/s3.sh (scripts/test does), which installs moto[server]"
        );
        let port = common::free_port();
        let child = Command::new(&server)
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start moto_server");
        let endpoint = format!("http://127.0.0.1:{port}");
        let http = reqwest::Client::new();
        let up = common::eventually(Duration::from_secs(30), || async {
            http.get(format!("{endpoint}/")).send().await.ok().filter(|r| r.status().is_success())
        })
        .await;
        assert!(up.is_some(), "moto_server answers on {endpoint}");
        let bucket = format!("conveyor-{}", Uuid::new_v4().simple());
        let created = http.put(format!("{endpoint}/{bucket}")).send().await.unwrap();
        assert!(created.status().is_success(), "bucket created: {}", created.status());
        Self { child, endpoint, bucket }
    }

    /// The variables the chart's `extraEnvFrom` passes: static keys, the region, the endpoint of an S3-compatible store.
    fn vars(&self) -> [(&'static str, String); 5] {
        [
            ("AWS_ACCESS_KEY_ID", "conveyor-test".into()),
            ("AWS_SECRET_ACCESS_KEY", "conveyor-test-secret".into()),
            ("AWS_REGION", "us-east-1".into()),
            ("AWS_ENDPOINT", self.endpoint.clone()),
            ("AWS_ALLOW_HTTP", "true".into()),
        ]
    }

    /// The same, as `object_store`'s settings, for a store opened in this process.
    fn options(&self) -> Vec<(String, String)> {
        self.vars().into_iter().map(|(name, value)| (name.to_ascii_lowercase(), value)).collect()
    }

    /// How many parts the object `key` was uploaded in, from its ETag (`"<md5>-<parts>"` for a multipart upload, a
    /// plain MD5 for a single PUT: 1). Unsigned: moto answers it for objects of a multipart upload.
    async fn parts_of(&self, key: &str) -> u32 {
        let url = format!("{}/{}/{key}", self.endpoint, self.bucket);
        let head = reqwest::Client::new().head(url).send().await.unwrap();
        assert!(head.status().is_success(), "{key}: {}", head.status());
        let etag = head.headers()["etag"].to_str().unwrap().trim_matches('"').to_owned();
        etag.split_once('-').map_or(1, |(_, parts)| parts.parse().unwrap())
    }

    /// Keys of the bucket under `prefix`, as S3 lists them.
    async fn keys(&self, prefix: &str) -> Vec<String> {
        let url = format!("{}/{}?list-type=2&prefix={prefix}", self.endpoint, self.bucket);
        let xml = reqwest::get(url).await.unwrap().text().await.unwrap();
        xml.split("<Key>").skip(1).filter_map(|s| s.split("</Key>").next()).map(str::to_owned).collect()
    }
}

impl Drop for S3 {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test]
async fn the_object_store_writes_parts_concatenates_and_reads_ranges_on_an_s3_server() {
    let s3 = S3::start().await;
    let store = ObjectStorage::open_with(&format!("s3://{}/ci", s3.bucket), s3.options()).unwrap();
    let (ws, id) = (Uuid::new_v4(), Uuid::new_v4());

    let key = ObjectKey::new(ws, "t", id, "hello.txt");
    store.put(&key, Bytes::from_static(b"hello world")).await.unwrap();
    assert_eq!(store.get(&key).await.unwrap(), Bytes::from_static(b"hello world"));
    assert_eq!(store.get_range(&key, 6..11).await.unwrap(), Bytes::from_static(b"world"));
    assert_eq!(store.size(&key).await.unwrap(), Some(11));
    assert_eq!(s3.keys("ci/").await, [format!("ci/{}", key.as_str())], "under the URL's prefix, in the bucket");

    // Three parts of 10 MiB and more, concatenated in one multipart upload (S3's parts: 5 MiB at least but the last).
    let parts: Vec<ObjectKey> = (0..3).map(|i| ObjectKey::new(ws, "t", id, &format!("parts/{i:08}"))).collect();
    for (i, part) in parts.iter().enumerate() {
        store.put(part, Bytes::from(vec![b'a' + i as u8; 10 * 1024 * 1024 + i])).await.unwrap();
    }
    let whole = ObjectKey::new(ws, "t", id, "whole");
    assert_eq!(store.concat(&whole, &parts).await.unwrap(), 30 * 1024 * 1024 + 3);
    assert_eq!(store.size(&whole).await.unwrap(), Some(30 * 1024 * 1024 + 3));
    assert!(s3.parts_of(&format!("ci/{}", whole.as_str())).await >= 6, "one multipart upload of 5 MiB parts");
    let edge = store.get_range(&whole, 10 * 1024 * 1024 - 1..10 * 1024 * 1024 + 1).await.unwrap();
    assert_eq!(&edge[..], b"ab", "the parts in order");

    store.delete(&key).await.unwrap();
    store.delete(&key).await.unwrap();
    assert!(matches!(store.get(&key).await, Err(StorageError::NotFound(_))), "deleted, and deleting again is no error");
    // An s3:// URL without a bucket, or a setting the store does not know, is refused before any request.
    let refused = ObjectStorage::open("s3:///ci").err().map(|e| e.to_string()).expect("refused");
    assert!(refused.contains("bucket"), "{refused}");
    let unknown = ObjectStorage::open_with("s3://b", [("aws_colour", "red")]).err().map(|e| e.to_string());
    assert!(unknown.is_some_and(|e| e.contains("aws_colour")));
}

/// A PNG of `side`² pixels of noise (it does not compress: its size is about 3 × side² bytes).
fn noisy_png(side: u32) -> Vec<u8> {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let image = image::RgbImage::from_fn(side, side, |_, _| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        image::Rgb([state as u8, (state >> 8) as u8, (state >> 16) as u8])
    });
    let mut out = Vec::new();
    image::DynamicImage::ImageRgb8(image)
        .write_to(&mut std::io::Cursor::new(&mut out), image::ImageFormat::Png)
        .unwrap();
    out
}

/// `conveyor <role>` processes over one database, Redis prefix and S3 store, as the chart runs them; killed when dropped.
struct Platform {
    processes: Vec<Process>,
    base: String,
    http: reqwest::Client,
    token: String,
    /// The workspace the token names.
    workspace: Uuid,
}

impl Platform {
    async fn start(s3: &S3, prefix: &str, sandbox_url: &str) -> Self {
        let db = common::TestDb::create().await;
        let redis_prefix = format!("conveyor-test-{}", Uuid::new_v4().simple());
        let mut vars: HashMap<String, String> = common::config_vars(&db, &redis_prefix);
        vars.insert("CONVEYOR_OBJECT_STORE_URL".into(), format!("s3://{}/{prefix}", s3.bucket));
        vars.insert("CONVEYOR_ASSET_ALLOWED_NETWORKS".into(), "127.0.0.0/8".into());
        let port = url::Url::parse(sandbox_url).unwrap().port().unwrap();
        vars.insert("CONVEYOR_ASSET_ALLOWED_PORTS".into(), port.to_string());
        vars.insert("CONVEYOR_MARKETPLACE_URL".into(), sandbox_url.to_owned());
        vars.extend(s3.vars().into_iter().map(|(k, v)| (k.to_owned(), v)));
        let http_port = common::free_port();
        let mut processes = Vec::new();
        for role in ["api", "dispatcher", "worker"] {
            let mut own = vars.clone();
            own.insert("CONVEYOR_HTTP_ADDR".into(), format!("127.0.0.1:{http_port}"));
            own.insert("CONVEYOR_ADMIN_ADDR".into(), format!("127.0.0.1:{}", common::free_port()));
            processes.push(Process::spawn(&[role], &own));
        }
        let base = format!("http://127.0.0.1:{http_port}");
        let http = reqwest::Client::new();
        let ready = common::eventually(Duration::from_secs(60), || async {
            http.get(format!("{base}/v1/media/{}", Uuid::new_v4())).send().await.ok()
        })
        .await;
        assert!(ready.is_some(), "the api process serves; log:\n{}", processes[0].log());
        let tokens = conveyor_server::auth::TokenKeys::new(&conveyor_server::config::Secret::new(
            common::JWT_SECRET.as_bytes().to_vec(),
        ));
        let who = principal();
        let token = tokens.mint(who, Duration::from_secs(3600));
        Self { processes, base, http, token, workspace: who.workspace_id.0 }
    }

    fn send(&self, method: Method, path: &str) -> reqwest::RequestBuilder {
        let request = self.http.request(method.clone(), format!("{}{path}", self.base)).bearer_auth(&self.token);
        if method == Method::GET { request } else { request.header("idempotency-key", Uuid::new_v4().to_string()) }
    }

    async fn get(&self, path: &str) -> Value {
        self.send(Method::GET, path).send().await.unwrap().json().await.unwrap()
    }

    fn logs(&self) -> String {
        self.processes.iter().map(Process::log).collect::<Vec<_>>().join("\n---\n")
    }
}

#[tokio::test]
async fn an_upload_its_derivatives_and_a_transfer_run_end_to_end_on_s3() {
    let s3 = S3::start().await;
    let (_sandbox, sandbox_url) = common::sandbox(Settings::default()).await;
    let prefix = format!("run-{}", Uuid::new_v4().simple());
    let platform = Platform::start(&s3, &prefix, &sandbox_url).await;
    let ws = platform.workspace;

    // An upload of more than one 5 MiB part: the API writes it to S3 as a multipart upload.
    let png = noisy_png(1400);
    assert!(png.len() > 5 * 1024 * 1024, "{} bytes: more than one part", png.len());
    let body = json!({"filename": "noise.png", "content_type": "image/png", "size_bytes": png.len()});
    let created = platform.send(Method::POST, "/v1/media").json(&body).send().await.unwrap();
    assert_eq!(created.status(), StatusCode::CREATED, "{}", platform.logs());
    let id = created.json::<Value>().await.unwrap()["media"]["id"].as_str().unwrap().to_owned();
    let put = platform
        .send(Method::PUT, &format!("/v1/media/{id}/content"))
        .header("content-type", "application/octet-stream")
        .body(png.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), StatusCode::OK, "{}", put.text().await.unwrap());
    let done = platform.send(Method::POST, &format!("/v1/media/{id}/complete")).json(&json!({})).send().await.unwrap();
    assert_eq!(done.status(), StatusCode::ACCEPTED);
    let media = common::eventually(Duration::from_secs(120), || async {
        let m = platform.get(&format!("/v1/media/{id}")).await;
        (m["status"] != "processing").then_some(m)
    })
    .await
    .unwrap_or_else(|| panic!("the media was processed; logs:\n{}", platform.logs()));
    assert_eq!(media["status"], "ready", "{media}");
    // Its derivatives, read back from S3 through the API, are images.
    let derivatives = media["derivatives"].as_array().expect("derivatives").clone();
    assert!(!derivatives.is_empty(), "{media}");
    for d in &derivatives {
        let url = d["url"].as_str().unwrap();
        let resp = platform.send(Method::GET, url).send().await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK, "{url}");
        let bytes = resp.bytes().await.unwrap();
        image::load_from_memory(&bytes).unwrap_or_else(|e| panic!("{url} is not an image: {e}"));
    }
    let stored = s3.keys(&format!("{prefix}/workspaces/{ws}/")).await;
    let upload = stored.iter().find(|k| k.contains(&format!("/media/{id}/uploads/")));
    let upload = upload.unwrap_or_else(|| panic!("the upload is in the bucket: {stored:?}"));
    assert!(stored.len() > derivatives.len(), "each derivative is in the bucket too: {stored:?}");
    assert_eq!(s3.parts_of(upload).await, 2, "the upload went up as a multipart upload of two parts");

    // A transfer of several parts, assembled on S3 with a multipart concatenation, its parts deleted.
    let size = 6 * 1024 * 1024 + 5;
    let source = format!("{}/files/big.jpg?size={size}&content_type=image/jpeg", sandbox_url.trim_end_matches('/'));
    let body = json!({"source_url": source, "filename": "big.jpg"});
    let resp = platform.send(Method::POST, "/v1/asset-transfers").json(&body).send().await.unwrap();
    assert_eq!(resp.status(), 202, "{}", resp.text().await.unwrap());
    let transfer_id = resp.json::<Value>().await.unwrap()["asset_transfer"]["id"].as_str().unwrap().to_owned();
    let transfer = common::eventually(Duration::from_secs(120), || async {
        let t = platform.get(&format!("/v1/asset-transfers/{transfer_id}")).await;
        matches!(t["status"].as_str(), Some("completed" | "failed")).then_some(t)
    })
    .await
    .unwrap_or_else(|| panic!("the transfer ended; logs:\n{}", platform.logs()));
    assert_eq!(transfer["status"], "completed", "{transfer}");
    assert_eq!(transfer["sha256"], sha256_hex(&files::file_bytes("big.jpg", size)));
    let objects = s3.keys(&format!("{prefix}/workspaces/{ws}/asset-transfers/{transfer_id}/")).await;
    let original = format!("{prefix}/workspaces/{ws}/asset-transfers/{transfer_id}/original");
    assert_eq!(objects, std::slice::from_ref(&original), "the object whole, its parts gone");
    assert!(s3.parts_of(&original).await >= 2, "assembled by a multipart concatenation");
    let store = ObjectStorage::open_with(&format!("s3://{}/{prefix}", s3.bucket), s3.options()).unwrap();
    let key = ObjectKey::parse(&format!("workspaces/{ws}/asset-transfers/{transfer_id}/original")).unwrap();
    assert_eq!(sha256_hex(&store.get(&key).await.unwrap()), transfer["sha256"].as_str().unwrap());
}
