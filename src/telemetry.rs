//! Logging set-up and W3C trace context (`traceparent`), which travels from the API through the outbox and the
//! stream to the worker.

use rand::RngCore;
use tracing_subscriber::EnvFilter;

/// Installs the global `tracing` subscriber: human-readable or JSON lines on stderr, filtered by `RUST_LOG`
/// (default `info`).
pub fn init_logging(json: bool) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let _ = if json { builder.json().try_init() } else { builder.try_init() };
}

/// Keeps an incoming `traceparent` when it is well-formed (version 00), else starts a new trace.
pub fn traceparent_or_new(incoming: Option<&str>) -> String {
    match incoming {
        Some(tp) if is_valid_traceparent(tp) => tp.to_ascii_lowercase(),
        _ => new_traceparent(),
    }
}

/// A fresh `traceparent` with random trace and span ids, sampled.
pub fn new_traceparent() -> String {
    let mut trace = [0u8; 16];
    let mut span = [0u8; 8];
    let mut rng = rand::rng();
    rng.fill_bytes(&mut trace);
    rng.fill_bytes(&mut span);
    format!("00-{}-{}-01", hex(&trace), hex(&span))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `tp` is a W3C `traceparent` of version 00 with non-zero ids.
pub fn is_valid_traceparent(tp: &str) -> bool {
    let parts: Vec<&str> = tp.split('-').collect();
    let hex_of = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
    parts.len() == 4
        && parts[0] == "00"
        && hex_of(parts[1], 32)
        && parts[1].bytes().any(|b| b != b'0')
        && hex_of(parts[2], 16)
        && parts[2].bytes().any(|b| b != b'0')
        && hex_of(parts[3], 2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_valid_traceparent_is_kept_and_a_bad_one_replaced() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(traceparent_or_new(Some(tp)), tp);
        let fresh = traceparent_or_new(Some("00-00000000000000000000000000000000-00f067aa0ba902b7-01"));
        assert!(is_valid_traceparent(&fresh));
        assert_ne!(fresh, tp);
        assert!(is_valid_traceparent(&traceparent_or_new(None)));
    }
}
