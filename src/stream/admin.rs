//! Operator-facing Redis checks: server version and eviction policy; whether stream entries still exist.

use super::RedisError;
use fred::cmd;
use fred::prelude::ClientLike;
use fred::types::Value;

use super::{RedisClient, Watched};

/// What the start-up check found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerCheck {
    /// `redis_version` from `INFO server`.
    pub version: String,
    /// `maxmemory-policy`, when `CONFIG GET` is allowed (managed services may refuse it).
    pub maxmemory_policy: Option<String>,
}

/// Reads the server version and eviction policy, and logs loudly what is unsafe: an eviction policy other than
/// `noeviction` lets Redis drop stream entries or de-dup keys under memory pressure. In a cluster every primary is
/// checked (each holds some queues' streams); the answer is the oldest version and the first unsafe policy found.
pub async fn check_server(client: &RedisClient) -> Result<ServerCheck, RedisError> {
    let primaries = if client.is_clustered() { client.active_connections() } else { Vec::new() };
    if primaries.is_empty() {
        return check_one(client, None).await.map_err(RedisError::fred);
    }
    let mut worst: Option<ServerCheck> = None;
    for server in primaries {
        let check = check_one(&client.with_cluster_node(server.clone()), Some(&server.to_string()))
            .await
            .map_err(RedisError::fred)?;
        worst = Some(match worst {
            None => check,
            Some(w) => ServerCheck {
                version: if major(&check.version) < major(&w.version) { check.version } else { w.version },
                maxmemory_policy: match (&w.maxmemory_policy, &check.maxmemory_policy) {
                    (Some(p), _) if p != "noeviction" => w.maxmemory_policy,
                    (_, Some(_)) => check.maxmemory_policy,
                    _ => w.maxmemory_policy,
                },
            },
        });
    }
    Ok(worst.expect("at least one primary"))
}

fn major(version: &str) -> u32 {
    version.split('.').next().and_then(|m| m.parse().ok()).unwrap_or(0)
}

/// Checks one server (`node` names it in the log, for a cluster's primaries).
async fn check_one<C: ClientLike>(client: &C, node: Option<&str>) -> Result<ServerCheck, fred::error::Error> {
    let info: String = client.custom(cmd!("INFO"), vec!["server"]).await?;
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
    let node = node.unwrap_or("redis");
    if major(&version) < 7 {
        tracing::error!(node, version = %version, "Redis older than 7.0: XAUTOCLAIM and stream features Conveyor uses may be missing");
    }
    match policy.as_deref() {
        Some("noeviction") => {}
        Some(other) => tracing::error!(
            node,
            policy = other,
            "Redis maxmemory-policy is not noeviction: under memory pressure Redis may evict stream entries or \
             de-dup keys, and jobs would be lost or doubled; set maxmemory-policy noeviction"
        ),
        None => {
            tracing::warn!(
                node,
                "Could not read Redis maxmemory-policy (CONFIG GET refused); make sure it is noeviction"
            )
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
    let replies: Vec<Value> = pipeline.all().await.watched(client)?;
    Ok(replies.into_iter().map(|r| matches!(r, Value::Array(items) if !items.is_empty())).collect())
}
