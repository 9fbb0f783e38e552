//! Operator-facing Redis checks: server version and eviction policy; whether stream entries still exist.

use fred::cmd;
use fred::prelude::ClientLike;
use fred::types::Value;

use super::RedisClient;

/// What the start-up check found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerCheck {
    /// `redis_version` from `INFO server`.
    pub version: String,
    /// `maxmemory-policy`, when `CONFIG GET` is allowed (managed services may refuse it).
    pub maxmemory_policy: Option<String>,
}

/// Reads the server version and eviction policy, and logs loudly what is unsafe: an eviction policy other than
/// `noeviction` lets Redis drop stream entries or de-dup keys under memory pressure.
pub async fn check_server(client: &RedisClient) -> Result<ServerCheck, fred::error::Error> {
    let info: String = client.info(Some(fred::types::InfoKind::Server)).await?;
    let version = info
        .lines()
        .find_map(|l| l.strip_prefix("redis_version:"))
        .map(|v| v.trim().to_owned())
        .unwrap_or_else(|| "unknown".to_owned());
    let policy = match client.custom::<Value, _>(cmd!("CONFIG"), vec!["GET", "maxmemory-policy"]).await {
        Ok(Value::Array(items)) => items.get(1).and_then(Value::as_string),
        Ok(Value::Map(map)) => map.inner().values().next().and_then(Value::as_string),
        _ => None,
    };
    let major: u32 = version.split('.').next().and_then(|m| m.parse().ok()).unwrap_or(0);
    if major < 7 {
        tracing::error!(version = %version, "Redis older than 7.0: XAUTOCLAIM and stream features Conveyor uses may be missing");
    }
    match policy.as_deref() {
        Some("noeviction") => {}
        Some(other) => tracing::error!(
            policy = other,
            "Redis maxmemory-policy is not noeviction: under memory pressure Redis may evict stream entries or \
             de-dup keys, and jobs would be lost or doubled; set maxmemory-policy noeviction"
        ),
        None => {
            tracing::warn!("Could not read Redis maxmemory-policy (CONFIG GET refused); make sure it is noeviction")
        }
    }
    Ok(ServerCheck { version, maxmemory_policy: policy })
}

/// Whether each of `entries` (a stream key and an entry id) still exists, in one pipeline of `XRANGE key id id`.
pub(crate) async fn entries_exist(
    client: &RedisClient,
    entries: &[(String, String)],
) -> Result<Vec<bool>, fred::error::Error> {
    if entries.is_empty() {
        return Ok(Vec::new());
    }
    let pipeline = client.pipeline();
    for (stream, id) in entries {
        let _: () = pipeline.custom(cmd!("XRANGE"), vec![stream.as_str(), id.as_str(), id.as_str()]).await?;
    }
    let replies: Vec<Value> = pipeline.all().await?;
    Ok(replies.into_iter().map(|r| matches!(r, Value::Array(items) if !items.is_empty())).collect())
}
