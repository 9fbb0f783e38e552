//! What every benchmark prints and reads: its settings from the environment, one JSON line per scenario, percentiles,
//! clocks. Shared with the server's benchmarks (`server/benches`), which include this file.

#![allow(dead_code)] // Each benchmark uses part of it.

/// The number in the variable `name`, or `default`.
pub fn env(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Prints one scenario's result as a JSON line, marked as Conveyor's (`scripts/bench` pairs it with the references').
pub fn emit(value: serde_json::Value) {
    let mut v = value;
    v["system"] = serde_json::json!("conveyor");
    println!("{v}");
}

/// The `p`-th percentile of `sorted` (nearest rank, from below).
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    Some(sorted[((p / 100.0 * sorted.len() as f64) as usize).min(sorted.len() - 1)])
}

/// `x` to two decimals.
pub fn round(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// The wall clock, ms since the epoch, with µs resolution.
pub fn now_ms() -> f64 {
    chrono::Utc::now().timestamp_micros() as f64 / 1000.0
}

/// CPU time (user and system) this process has used so far, in seconds, from `/proc/self/stat` (clock ticks of 10 ms).
pub fn process_cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    // The fields after the command name, which is in parentheses and may hold spaces: utime and stime are the 12th
    // and 13th of them.
    let fields: Vec<&str> = stat.rsplit_once(')').unwrap().1.split_whitespace().collect();
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    ticks / 100.0
}
