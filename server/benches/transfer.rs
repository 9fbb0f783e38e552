//! The asset transfer's download path on loopback, against curl: `cargo bench --bench transfer`.
//!
//! A `conveyor sandbox` child process serves one patterned file of SIZE_MIB MiB (default 200). Each round, the
//! fetcher (SSRF policy, resolver, redirects, size and type checks) downloads it into object storage in parts of
//! 256 KiB, as the `asset.transfer` job does, then `asset_transfers::assemble` concatenates the parts into one object
//! and hashes them (sha256, streaming), as the job's completion does. A second variant also commits each part's
//! progress on a transfer row in PostgreSQL (a test database, as `server/tests/api/common` makes them): the job's real per-part
//! cost. `curl -o /dev/null` and `curl -o <file>` download the same URL. ROUNDS rounds (default 3), alternating;
//! medians compared. Prints one JSON line: throughputs in MiB/s, ratios to curl's, and this process's peak resident
//! memory (the fetcher and storage: the sandbox runs in its own process).

#[path = "../tests/api/common/mod.rs"]
mod common;

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use conveyor_jobs::WorkspaceId;
use conveyor_shop::adapters::fetch::{AddressPolicy, Fetcher, PartSink, Progress, SinkError, SystemResolver};
use conveyor_shop::domain::asset_transfers;
use conveyor_shop::storage::ObjectStorage;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// Stores parts as the job does, under the same keys; with `database`, also commits each part's progress on the
/// transfer's row as the job does.
struct StorageSink {
    storage: ObjectStorage,
    workspace: WorkspaceId,
    id: Uuid,
    database: Option<PgPool>,
}

fn failed(e: impl std::fmt::Display) -> SinkError {
    SinkError::Failed(e.to_string())
}

impl PartSink for StorageSink {
    async fn begin(&mut self, progress: &Progress, _restarted: bool) -> Result<(), SinkError> {
        if let Some(pool) = &self.database {
            assert!(asset_transfers::begin(pool, self.workspace, self.id, progress).await.map_err(failed)?);
        }
        Ok(())
    }

    async fn part(&mut self, index: u32, bytes: Bytes, progress: &Progress) -> Result<(), SinkError> {
        self.storage.put(&asset_transfers::part_key(self.workspace, self.id, index), bytes).await.map_err(failed)?;
        if let Some(pool) = &self.database {
            assert!(asset_transfers::record_part(pool, self.workspace, self.id, progress).await.map_err(failed)?);
        }
        Ok(())
    }
}

/// One download into parts, then their assembly; answers the seconds each took (download, download + assembly).
async fn transfer_once(
    fetcher: &Fetcher,
    url: &str,
    storage: &ObjectStorage,
    workspace: WorkspaceId,
    id: Uuid,
    database: Option<PgPool>,
) -> (f64, f64) {
    let mut sink = StorageSink { storage: storage.clone(), workspace, id, database };
    let mut progress = Progress::default();
    let started = Instant::now();
    fetcher.download(url, &mut progress, &mut sink, &CancellationToken::new()).await.expect("the download completes");
    let downloaded = started.elapsed();
    let (stored, _sha256) = asset_transfers::assemble(storage, workspace, id, &progress).await.unwrap();
    assert_eq!(Some(stored), progress.bytes_total);
    let assembled = started.elapsed();
    for index in 0..progress.parts {
        storage.delete(&asset_transfers::part_key(workspace, id, index)).await.unwrap();
    }
    storage.delete(&asset_transfers::object_key(workspace, id)).await.unwrap();
    (downloaded.as_secs_f64(), assembled.as_secs_f64())
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

fn curl(url: &str, output: &str) -> f64 {
    let started = Instant::now();
    let status = Command::new("curl").args(["-sSf", "-o", output, url]).status().expect("curl is installed");
    assert!(status.success(), "curl failed");
    started.elapsed().as_secs_f64()
}

#[tokio::main]
async fn main() {
    let size = env_number("SIZE_MIB", 200) * 1024 * 1024;
    let rounds = env_number("ROUNDS", 3).max(1);
    let port = common::free_port();
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
    let mut settings = conveyor_server::config::ScenarioSettings::default().fetch_settings();
    settings.allowed_networks = vec!["127.0.0.0/8".parse().unwrap()];
    settings.allowed_ports = vec![port];
    settings.max_bytes = size;
    let fetcher = Fetcher::new(settings, Arc::new(SystemResolver)).unwrap();
    let curl_file = dir.join("curl.out");
    let curl_file = curl_file.to_str().unwrap();

    // A transfer row for the rounds that commit progress, as the job does.
    let db = common::TestDb::create().await;
    let who = common::principal();
    let policy = AddressPolicy::new(vec!["127.0.0.0/8".parse().unwrap()]).with_ports([port]);
    let mut tx = conveyor_jobs::begin_workspace(&db.pool, who.workspace_id).await.unwrap();
    let new = asset_transfers::NewTransfer::parse(&url, "bench.png", &policy).unwrap();
    let row = asset_transfers::create_tx(&mut tx, &who, new, None).await.unwrap().asset_transfer.id;
    tx.commit().await.unwrap();

    let mib = size as f64 / (1024.0 * 1024.0);
    let (mut devnull, mut to_file, mut fetch, mut whole, mut committed) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        devnull.push(mib / curl(&url, "/dev/null"));
        to_file.push(mib / curl(&url, curl_file));
        std::fs::remove_file(curl_file).unwrap();
        let (downloaded, assembled) =
            transfer_once(&fetcher, &url, &storage, WorkspaceId(Uuid::new_v4()), Uuid::new_v4(), None).await;
        fetch.push(mib / downloaded);
        whole.push(mib / assembled);
        let (downloaded, _) =
            transfer_once(&fetcher, &url, &storage, who.workspace_id, row, Some(db.pool.clone())).await;
        committed.push(mib / downloaded);
    }
    let (devnull, to_file, fetch, whole, committed) =
        (median(devnull), median(to_file), median(fetch), median(whole), median(committed));
    let round2 = |v: f64| (v * 100.0).round() / 100.0;
    println!(
        "{}",
        serde_json::json!({
            "scenario": "transfer",
            "size_bytes": size,
            "rounds": rounds,
            "part_bytes": conveyor_shop::adapters::fetch::DEFAULT_PART_SIZE,
            "curl_devnull_mib_s": round2(devnull),
            "curl_file_mib_s": round2(to_file),
            "fetch_to_parts_mib_s": round2(fetch),
            "fetch_assemble_hash_mib_s": round2(whole),
            "fetch_with_progress_commits_mib_s": round2(committed),
            "ratio_fetch_vs_curl_devnull": round2(fetch / devnull),
            "ratio_fetch_vs_curl_file": round2(fetch / to_file),
            "ratio_whole_vs_curl_file": round2(whole / to_file),
            "ratio_committed_vs_curl_file": round2(committed / to_file),
            "peak_rss_mib": round2(peak_rss_mib()),
        })
    );
    let _ = sandbox.kill();
    let _ = sandbox.wait();
    let _ = std::fs::remove_dir_all(&dir);
}
