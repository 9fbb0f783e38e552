//! Fairness between workspaces, measured as trigger.dev's fairness study does: 10 workspaces with a 30:1 skew (one
//! enqueues 30 times as many jobs as each of the others), handlers of fixed cost (`COST_MS`, default 5 ms), a worker of
//! concurrency `CONC` (32), a dispatcher with the window `WINDOW` (256). Reports, while every tenant still has work
//! waiting: the worst tenant's share of dequeues against its fair share (target >= 0.95) and Jain's index over the
//! tenants' dequeues (>= 0.99); each tenant's p50/p99 wait (commit -> handler start); and the drain rate with the
//! window against the same run without it (>= 90%). Then a light workspace's commit -> start p99 while another
//! floods 100,000 jobs (`FLOOD`; target <= 250 ms). Then the same beside a flood of slow jobs, with default settings
//! (`fairness-slow`): 3,000 jobs of 200 ms (`SLOW_FLOOD`, `SLOW_MS`) on 16 slots (`SLOW_CONC`), and 20 light jobs
//! committed 250 ms apart once the flood runs: the worst light job's commit -> start (target <= 250 ms), beside the
//! same run with the queue gate off. One JSON line per scenario.

#[path = "../tests/kit/mod.rs"]
mod kit;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use conveyor_jobs::{
    DispatcherSettings, EnqueueOptions, Handler, JobContext, JobError, Worker, WorkerSettings, WorkspaceId,
};
use kit::report::{env, now_ms};
use kit::{Job, Platform};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// (tenant, wait in ms) of each start, in start order.
type Starts = Arc<Mutex<Vec<(usize, f64)>>>;

struct Fixed {
    starts: Starts,
    cost: Duration,
}

impl Handler<Job> for Fixed {
    async fn handle(&self, job: Job, _: &mut JobContext) -> Result<Value, JobError> {
        self.starts.lock().unwrap().push((job.tenant, now_ms() - job.at_ms));
        tokio::time::sleep(self.cost).await;
        Ok(Value::Null)
    }
}

async fn enqueue(pool: &sqlx::PgPool, ws: WorkspaceId, tenant: usize, n: usize) {
    for chunk in (0..n).collect::<Vec<_>>().chunks(500) {
        let mut tx = conveyor_jobs::begin_workspace(pool, ws).await.unwrap();
        let at_ms = now_ms();
        let jobs: Vec<Job> = chunk.iter().map(|_| Job { tenant, at_ms }).collect();
        conveyor_jobs::enqueue_many_tx(&mut tx, jobs.iter().map(|j| (j, EnqueueOptions::new()))).await.unwrap();
        tx.commit().await.unwrap();
    }
}

fn percentile(values: &mut [f64], p: f64) -> f64 {
    values.sort_by(|a, b| a.partial_cmp(b).unwrap());
    values.get(((values.len() as f64 - 1.0) * p).round() as usize).copied().unwrap_or(f64::NAN)
}

/// A dispatcher with `window` and a worker, over a fresh database; the jobs are enqueued before either starts.
async fn run_platform(platform: &Platform, window: u64, starts: &Starts, shutdown: &CancellationToken) {
    let dispatcher = platform.dispatcher(|s| s.window = window as i32).await;
    let (cost, concurrency) = (Duration::from_millis(env("COST_MS", 5)), env("CONC", 32) as usize);
    start_worker(platform, dispatcher, cost, concurrency, starts, shutdown).await;
}

/// Starts `dispatcher` and a worker of `concurrency` slots whose handler takes `cost`.
async fn start_worker(
    platform: &Platform,
    dispatcher: conveyor_jobs::Dispatcher,
    cost: Duration,
    concurrency: usize,
    starts: &Starts,
    shutdown: &CancellationToken,
) {
    let worker = Worker::builder(platform.pool.clone(), platform.consumer("bench").await)
        .runtime_pool(platform.runtime_pool.clone())
        .handle::<Job>(Fixed { starts: starts.clone(), cost })
        .settings(WorkerSettings { concurrency, ..WorkerSettings::default() })
        .build()
        .unwrap();
    worker.ensure_groups().await.unwrap();
    worker.register_kinds().await.unwrap();
    tokio::spawn(dispatcher.run(shutdown.clone()));
    tokio::spawn(worker.run(shutdown.clone(), Duration::from_secs(5)));
}

async fn skewed(window: u64) -> Value {
    let (tenants, light) = (10usize, env("LIGHT", 300) as usize);
    let counts: Vec<usize> = (0..tenants).map(|t| if t == 0 { 30 * light } else { light }).collect();
    let total: usize = counts.iter().sum();
    let platform = Platform::new(48).await;
    let workspaces: Vec<WorkspaceId> = (0..tenants).map(|_| WorkspaceId(Uuid::new_v4())).collect();
    for (t, ws) in workspaces.iter().enumerate() {
        enqueue(&platform.pool, *ws, t, counts[t]).await;
    }
    let starts: Starts = Arc::default();
    let shutdown = CancellationToken::new();
    let started = Instant::now();
    run_platform(&platform, window, &starts, &shutdown).await;
    while starts.lock().unwrap().len() < total {
        assert!(started.elapsed() < Duration::from_secs(600), "the backlog did not drain");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let drain_s = started.elapsed().as_secs_f64();
    shutdown.cancel();
    let starts = starts.lock().unwrap().clone();
    // Contention: until the first tenant has started all its jobs, every tenant has work waiting.
    let mut seen = vec![0usize; tenants];
    let mut contended = starts.len();
    for (i, (t, _)) in starts.iter().enumerate() {
        seen[*t] += 1;
        if seen[*t] == counts[*t] {
            contended = i + 1;
            break;
        }
    }
    let mut during = vec![0f64; tenants];
    for (t, _) in &starts[..contended] {
        during[*t] += 1.0;
    }
    let fair = contended as f64 / tenants as f64;
    let worst_share = during.iter().cloned().fold(f64::INFINITY, f64::min) / fair;
    let sum: f64 = during.iter().sum();
    let jain = sum * sum / (tenants as f64 * during.iter().map(|x| x * x).sum::<f64>());
    let mut waits: HashMap<usize, Vec<f64>> = HashMap::new();
    for (t, w) in &starts {
        waits.entry(*t).or_default().push(*w);
    }
    let heavy = waits.get_mut(&0).unwrap();
    let (heavy_p50, heavy_p99) = (percentile(heavy, 0.5), percentile(heavy, 0.99));
    let mut light_p50 = Vec::new();
    let mut light_p99 = Vec::new();
    for t in 1..tenants {
        let w = waits.get_mut(&t).unwrap();
        light_p50.push(percentile(w, 0.5));
        light_p99.push(percentile(w, 0.99));
    }
    json!({
        "window": window, "jobs": total, "drain_per_s": (total as f64 / drain_s).round(),
        "contended_dequeues": contended, "worst_tenant_share": (worst_share * 1000.0).round() / 1000.0,
        "jain_index": (jain * 10000.0).round() / 10000.0,
        "heavy_wait_ms": {"p50": heavy_p50.round(), "p99": heavy_p99.round()},
        "light_wait_ms_p50_max": light_p50.iter().cloned().fold(0.0, f64::max).round(),
        "light_wait_ms_p99_max": light_p99.iter().cloned().fold(0.0, f64::max).round(),
    })
}

async fn flood_latency(window: u64) -> Value {
    let flood_n = env("FLOOD", 100_000) as usize;
    let platform = Platform::new(48).await;
    let (flood, light) = (WorkspaceId(Uuid::new_v4()), WorkspaceId(Uuid::new_v4()));
    enqueue(&platform.pool, flood, 0, flood_n).await;
    let starts: Starts = Arc::default();
    let shutdown = CancellationToken::new();
    run_platform(&platform, window, &starts, &shutdown).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    // The light workspace commits a job every 50 ms for 10 s while the flood drains.
    for _ in 0..200 {
        enqueue(&platform.pool, light, 1, 1).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    while starts.lock().unwrap().iter().filter(|(t, _)| *t == 1).count() < 200 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown.cancel();
    let mut light_waits: Vec<f64> = starts.lock().unwrap().iter().filter(|(t, _)| *t == 1).map(|(_, w)| *w).collect();
    let started = light_waits.len();
    json!({
        "window": window, "flood": flood_n, "light_jobs_started": started,
        "light_wait_ms": {"p50": percentile(&mut light_waits, 0.5).round(), "p99": percentile(&mut light_waits, 0.99).round()},
    })
}

/// A light workspace beside a flood of slow jobs, default settings but `queue_wait`: the light jobs' commit -> start.
async fn slow_flood(queue_wait: Option<Duration>) -> Value {
    let (flood_n, cost) = (env("SLOW_FLOOD", 3_000) as usize, Duration::from_millis(env("SLOW_MS", 200)));
    let concurrency = env("SLOW_CONC", 16) as usize;
    let platform = Platform::new(48).await;
    let (flood, light) = (WorkspaceId(Uuid::new_v4()), WorkspaceId(Uuid::new_v4()));
    enqueue(&platform.pool, flood, 0, flood_n).await;
    let starts: Starts = Arc::default();
    let shutdown = CancellationToken::new();
    let dispatcher = platform
        .dispatcher(|s| {
            if let Some(wait) = queue_wait {
                s.queue_wait = wait;
            }
        })
        .await;
    start_worker(&platform, dispatcher, cost, concurrency, &starts, &shutdown).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    for _ in 0..20 {
        enqueue(&platform.pool, light, 1, 1).await;
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(600);
    while starts.lock().unwrap().iter().filter(|(t, _)| *t == 1).count() < 20 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown.cancel();
    let mut waits: Vec<f64> = starts.lock().unwrap().iter().filter(|(t, _)| *t == 1).map(|(_, w)| *w).collect();
    let worst = waits.iter().cloned().fold(0.0, f64::max);
    json!({
        "queue_wait_ms": queue_wait.unwrap_or(DispatcherSettings::default().queue_wait).as_millis() as u64,
        "flood": flood_n, "handler_ms": cost.as_millis() as u64, "concurrency": concurrency,
        "light_jobs_started": waits.len(),
        "light_wait_ms": {"p50": percentile(&mut waits, 0.5).round(), "max": worst.round()},
        "target_max_ms": 250, "met": waits.len() == 20 && worst <= 250.0,
    })
}

fn main() {
    // Scenarios to run (`skew`, `flood`, `slow`; all by default), as the first argument: `-- slow`.
    let which = std::env::args().skip(1).find(|a| !a.starts_with("--")).unwrap_or_else(|| "skew,flood,slow".into());
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let window = env("WINDOW", 256);
        for scenario in which.split(',') {
            match scenario {
                "skew" => {
                    let fair = skewed(window).await;
                    let unfair = skewed(0).await;
                    let ratio = fair["drain_per_s"].as_f64().unwrap() / unfair["drain_per_s"].as_f64().unwrap();
                    println!(
                        "{}",
                        json!({"scenario": "fairness-skew", "with_window": fair, "without_window": unfair,
                        "drain_with_vs_without": (ratio * 1000.0).round() / 1000.0})
                    );
                }
                "flood" => println!("{}", json!({"scenario": "fairness-flood", "result": flood_latency(window).await})),
                "slow" => println!(
                    "{}",
                    json!({"scenario": "fairness-slow", "default": slow_flood(None).await,
                           "without_gate": slow_flood(Some(Duration::ZERO)).await})
                ),
                other => panic!("unknown scenario {other}"),
            }
        }
    });
}
