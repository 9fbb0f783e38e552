//! The asset transfer's download path on loopback, against curl: `cargo bench --bench transfer`.
//!
//! A `conveyor sandbox` child process serves one patterned file of SIZE_MIB MiB (default 200). Each round, the
//! fetcher (SSRF policy, resolver, redirects, size and type checks) downloads it into object storage in parts of
//! 256 KiB, as the `asset.transfer` job does (without PostgreSQL, whose per-part commits the job adds), then the
//! parts are concatenated and the object hashed (sha256, streaming), as the job's completion does. `curl -o
//! /dev/null` and `curl -o <file>` download the same URL. ROUNDS rounds (default 3), alternating; medians compared.
//! Prints one JSON line: throughputs in MiB/s, the ratios of the fetcher's to curl's, and this process's peak
//! resident memory (the fetcher and storage only: the sandbox runs in its own process).

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use conveyor::adapters::fetch::{FetchSettings, Fetcher, PartSink, Progress, SinkError, SystemResolver};
use conveyor::storage::{ObjectKey, ObjectStorage};
use futures_util::StreamExt;
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// Stores parts as the job does, without the database.
struct StorageSink {
    storage: ObjectStorage,
    workspace: Uuid,
    id: Uuid,
}

impl StorageSink {
    fn part_key(&self, index: u32) -> ObjectKey {
        ObjectKey::new(self.workspace, "asset-transfers", self.id, &format!("parts/{index:08}"))
    }
}

impl PartSink for StorageSink {
    async fn begin(&mut self, _progress: &Progress, _restarted: bool) -> Result<(), SinkError> {
        Ok(())
    }

    async fn part(&mut self, index: u32, bytes: Bytes, _progress: &Progress) -> Result<(), SinkError> {
        self.storage.put(&self.part_key(index), bytes).await.map_err(|e| SinkError::Failed(e.to_string()))
    }
}

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(|a, b| a.partial_cmp(b).unwrap());
    values[values.len() / 2]
}

/// This process's peak resident set, in MiB (Linux: `VmHWM`).
fn peak_rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .unwrap_or(0.0);
    kib / 1024.0
}

fn curl(url: &str, output: &str) -> Duration {
    let started = Instant::now();
    let status = Command::new("curl").args(["-sSf", "-o", output, url]).status().expect("curl is installed");
    assert!(status.success(), "curl failed");
    started.elapsed()
}

#[tokio::main]
async fn main() {
    let size = env_number("SIZE_MIB", 200) * 1024 * 1024;
    let rounds = env_number("ROUNDS", 3).max(1);
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut sandbox = Command::new(env!("CARGO_BIN_EXE_conveyor"))
        .args(["sandbox", "--addr", &format!("127.0.0.1:{port}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn conveyor sandbox");
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "the sandbox did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let url = format!("http://127.0.0.1:{port}/files/bench.png?size={size}&content_type=image/png");

    let dir = std::env::temp_dir().join(format!("conveyor-bench-transfer-{}", Uuid::new_v4().simple()));
    let storage = ObjectStorage::open(&format!("file://{}", dir.display())).unwrap();
    let mut settings = FetchSettings::from_scenarios(&conveyor::config::ScenarioSettings::default());
    settings.allowed_networks = vec!["127.0.0.0/8".parse().unwrap()];
    settings.max_bytes = size;
    let fetcher = Fetcher::new(settings, Arc::new(SystemResolver)).unwrap();
    let cancel = CancellationToken::new();
    let curl_file = dir.join("curl.out");
    let curl_file = curl_file.to_str().unwrap();

    let (mut fetch, mut whole, mut devnull, mut to_file) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mib = size as f64 / (1024.0 * 1024.0);
    for _ in 0..rounds {
        devnull.push(mib / curl(&url, "/dev/null").as_secs_f64());
        to_file.push(mib / curl(&url, curl_file).as_secs_f64());
        std::fs::remove_file(curl_file).unwrap();

        let (workspace, id) = (Uuid::new_v4(), Uuid::new_v4());
        let mut sink = StorageSink { storage: storage.clone(), workspace, id };
        let mut progress = Progress::default();
        let started = Instant::now();
        fetcher.download(&url, &mut progress, &mut sink, &cancel).await.expect("the download completes");
        let downloaded = started.elapsed();
        let parts: Vec<ObjectKey> = (0..progress.parts).map(|i| sink.part_key(i)).collect();
        let object = ObjectKey::new(workspace, "asset-transfers", id, "original");
        storage.concat(&object, &parts).await.unwrap();
        let mut hasher = Sha256::new();
        let mut stream = Box::pin(storage.stream(&object).await.unwrap());
        while let Some(chunk) = stream.next().await {
            hasher.update(chunk.unwrap());
        }
        let _digest = hasher.finalize();
        let assembled = started.elapsed();
        assert_eq!(progress.bytes_done, size);
        fetch.push(mib / downloaded.as_secs_f64());
        whole.push(mib / assembled.as_secs_f64());
        for part in &parts {
            storage.delete(part).await.unwrap();
        }
        storage.delete(&object).await.unwrap();
    }
    let (fetch, whole, devnull, to_file) = (median(fetch), median(whole), median(devnull), median(to_file));
    let round2 = |v: f64| (v * 100.0).round() / 100.0;
    println!(
        "{}",
        serde_json::json!({
            "scenario": "transfer",
            "size_bytes": size,
            "rounds": rounds,
            "part_bytes": conveyor::adapters::fetch::DEFAULT_PART_SIZE,
            "fetch_to_parts_mib_s": round2(fetch),
            "fetch_assemble_hash_mib_s": round2(whole),
            "curl_devnull_mib_s": round2(devnull),
            "curl_file_mib_s": round2(to_file),
            "ratio_fetch_vs_curl_devnull": round2(fetch / devnull),
            "ratio_fetch_vs_curl_file": round2(fetch / to_file),
            "ratio_whole_vs_curl_file": round2(whole / to_file),
            "peak_rss_mib": round2(peak_rss_mib()),
        })
    );
    let _ = sandbox.kill();
    let _ = sandbox.wait();
    let _ = std::fs::remove_dir_all(&dir);
}
