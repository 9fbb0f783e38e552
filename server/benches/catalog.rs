//! Catalog sync throughput: a real `conveyor worker` process syncs an N-product catalog (default 100,000) from the
//! sandbox marketplace over HTTP into PostgreSQL, page by page; the floor is a plain `COPY` of the same rows into a
//! table of the same shape on the same database. Prints one JSON line: products/s of both, their ratio, and the
//! worker's peak RSS. `N`, `PAGE` (products per page, default 1000).

#[path = "../tests/api/common/mod.rs"]
mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use conveyor_shop::adapters::sandbox::Settings;
use reqwest::Method;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn peak_rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| l.strip_prefix("VmHWM:")).and_then(|v| v.trim().trim_end_matches(" kB").parse().ok())
        })
        .unwrap_or(0)
}

/// The rows the sandbox serves for store key `key`, as COPY text, for the floor.
fn copy_rows(workspace: uuid::Uuid, store: uuid::Uuid, n: u64, sync: uuid::Uuid) -> String {
    let mut text = String::with_capacity(n as usize * 120);
    for i in 0..n {
        let price = format!("{}.{:02}", 1 + i % 500, i % 100);
        text.push_str(&format!("{workspace}\t{store}\tcafe0000-{i:07}\tSandbox product {i}\t{price}\tEUR\t{sync}\n"));
    }
    text
}

async fn run() {
    let (n, page) = (env("N", 100_000), env("PAGE", 1000));
    let app = common::TestApp::spawn().await;
    let who = common::principal();
    let (_sandbox, market) = common::sandbox(Settings { catalog_size: n, ..Settings::default() }).await;
    let body = json!({"name": "Bench", "platform": "sandbox", "credentials": {"api_key": "bench", "api_secret": "s"}});
    let created: Value = app.send(Method::POST, "/v1/stores", who, Some(&body)).await.json().await.unwrap();
    let store = created["store"]["id"].as_str().unwrap().to_owned();
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, who.workspace_id).await.unwrap();
    sqlx::query("UPDATE conveyor_shop.stores SET status = 'active' WHERE id = $1::uuid")
        .bind(&store)
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let shutdown = CancellationToken::new();
    let dispatcher = common::test_dispatcher(&app, &common::redis_url(), |v| {
        v.insert("CONVEYOR_DISPATCH_POLL".into(), "50ms".into());
    })
    .await;
    common::run_dispatcher(dispatcher, &shutdown);
    let mut vars: HashMap<String, String> = common::config_vars(&app.db, &app.redis_prefix);
    vars.insert("CONVEYOR_MARKETPLACE_URL".into(), market);
    vars.insert("CONVEYOR_CATALOG_PAGE_SIZE".into(), page.to_string());
    vars.insert("CONVEYOR_ADMIN_ADDR".into(), format!("127.0.0.1:{}", common::free_port()));
    vars.insert("RUST_LOG".into(), "warn".into());
    let mut worker = common::Process::spawn(&["worker"], &vars);
    // The worker is up (its consumer groups exist) before the clock starts.
    tokio::time::sleep(Duration::from_secs(2)).await;

    let started = Instant::now();
    let resp = app.send(Method::POST, &format!("/v1/stores/{store}/catalog-syncs"), who, Some(&json!({}))).await;
    assert_eq!(resp.status(), 202);
    let sync = resp.json::<Value>().await.unwrap()["catalog_sync"]["id"].as_str().unwrap().to_owned();
    let mut peak_kib = 0;
    loop {
        peak_kib = peak_kib.max(peak_rss_kib(worker.child.id()));
        let state: Value =
            app.send(Method::GET, &format!("/v1/catalog-syncs/{sync}"), who, None).await.json().await.unwrap();
        if state["status"] != "queued" && state["status"] != "running" {
            assert_eq!(state["status"], "succeeded", "{state}");
            assert_eq!(state["items_done"], n, "{state}");
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(1800), "the sync did not finish: {state}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let sync_s = started.elapsed().as_secs_f64();
    peak_kib = peak_kib.max(peak_rss_kib(worker.child.id()));
    worker.kill();
    shutdown.cancel();

    // The floor: the same rows, COPYed into a table of the same shape (constraints and primary key included).
    let mut owner = app.db.owner().await;
    sqlx::query(
        "CREATE TABLE copy_floor (LIKE conveyor_shop.store_products INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING INDEXES)",
    )
    .execute(&mut owner)
    .await
    .unwrap();
    let rows = copy_rows(who.workspace_id.0, store.parse().unwrap(), n, uuid::Uuid::now_v7());
    let copy_started = Instant::now();
    let mut copy = owner
        .copy_in_raw(
            "COPY copy_floor (workspace_id, store_id, external_id, title, price, currency, last_sync_id) FROM STDIN",
        )
        .await
        .unwrap();
    copy.send(rows.as_bytes()).await.unwrap();
    copy.finish().await.unwrap();
    let copy_s = copy_started.elapsed().as_secs_f64();

    let (sync_rate, copy_rate) = (n as f64 / sync_s, n as f64 / copy_s);
    println!(
        "{}",
        json!({
            "scenario": "catalog-sync", "n": n, "page_size": page,
            "sync_products_per_s": sync_rate.round(), "copy_products_per_s": copy_rate.round(),
            "ratio_to_copy": (sync_rate / copy_rate * 100.0).round() / 100.0,
            "sync_seconds": (sync_s * 100.0).round() / 100.0,
            "worker_peak_rss_mib": (peak_kib as f64 / 1024.0 * 10.0).round() / 10.0,
        })
    );
}

fn main() {
    tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap().block_on(run());
}
