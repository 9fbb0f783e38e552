//! The only module that talks to Redis.
//!
//! Redis Streams in brief: a stream is an append-only log of entries (`XADD`), each with an id `<ms>-<seq>` and a
//! few fields. A consumer group reads new entries (`XREADGROUP ... >`) and Redis remembers, per group, which entries
//! each consumer has read but not yet acknowledged (the pending entries list, PEL). `XACK` removes an entry from the
//! PEL; `XAUTOCLAIM` hands entries idle in a dead consumer's PEL to a live one. `XTRIM` bounds a stream's length.
//!
//! Keys (CONTRACT.md §3) are hash-tagged by queue, `<prefix>:{<queue>}:…`, so that a script touching a queue's stream
//! and its de-dup keys stays in one Redis Cluster slot; a queue split into partitions has one tag, so one slot, per
//! partition (`<prefix>:{<queue>:<p>}:…`, see [`layout`]). Scripts run on whichever node holds their slot, loaded
//! or not ([`script`]); in a cluster, fred follows `MOVED`/`ASK` and re-reads the slot map after a failover.
//!
//! Failover. fred learns that a master died from a reset connection or a `MOVED` reply. A master that dies silently
//! (its host down or cut off, its process frozen) gives neither: its connections stay open and its commands go
//! unanswered. So a command that times out makes its client look again ([`recover_after`]): a cluster client asks its
//! masters for the slot map and, where a replica took a master's slots, re-reads it, which drops the dead master's
//! connections; a sentinel client whose master does not answer asks the sentinels again. fred re-reads the slot map
//! inside the task that routes every command, trying the nodes it knows one after another, each silent one costing
//! every command of the client up to [`NODE_TIMEOUT`]: so the map is re-read only when it changed, and scripts are
//! routed by their keys' slot, which needs no re-read at all ([`script`]).

pub(crate) mod admin;
pub(crate) mod consumer;
pub(crate) mod keys;
pub(crate) mod layout;
pub(crate) mod producer;
mod script;
pub(crate) mod tls;
mod url;

use std::collections::{HashMap, HashSet};
use std::sync::{LazyLock, Mutex};
use std::time::{Duration, Instant};

use fred::prelude::{Builder, ClientLike, ClusterInterface, Config as RedisConfig, ReconnectPolicy, ServerConfig};
use fred::types::config::{ClusterDiscoveryPolicy, Options};
use fred::types::{ClusterHash, Value};

pub use fred::clients::Client as RedisClient;
pub use tls::{RedisTls, TlsFileError, url_uses_tls};

/// The longest one node may keep a client waiting per attempt: to connect (TCP and TLS), and then for each answer
/// while the connection is set up or the cluster's slot map is read (fred's defaults, 10 s each, let one dead seed
/// hold every command of a cluster client for 10 s each time it re-read the map). Loopback and LAN nodes answer in
/// milliseconds. Never more than the command time-out.
pub(crate) const NODE_TIMEOUT: Duration = Duration::from_secs(1);

/// How long after one look for its nodes a client may look again while its commands time out ([`recover_after`]).
const RECOVER_EVERY: Duration = Duration::from_secs(1);

/// Opens a Redis client that reconnects with exponential back-off forever (fred's default is never; at most 2 s
/// apart) and fails commands after `command_timeout` instead of queueing them while Redis is away. `url` is
/// `redis://`, `rediss://`, `redis-sentinel://`, `redis-cluster://` or their TLS forms `rediss-sentinel://` and
/// `rediss-cluster://` (verified against the system's roots; [`connect_with`] names a CA and a client certificate); a
/// cluster's seed nodes (or a sentinel setup's sentinels) may be listed with commas (`redis-cluster://h1:6379,h2:6379`)
/// or as fred's `?node=h2:6379` parameters. A cluster client follows `MOVED` and `ASK` redirections and re-reads the
/// slot map after a failover, from any node it knows: the seeds and every primary of the last slot map it read (fred's
/// default reads it from the seeds alone, so a client whose seeds had died could never find the cluster again). A node
/// that does not answer costs at most 1 s per attempt.
pub async fn connect(url: &str, command_timeout: Duration) -> Result<RedisClient, RedisError> {
    connect_with(url, command_timeout, &RedisTls::default()).await
}

/// [`connect`] with the TLS files of `tls` (`CONVEYOR_REDIS_CA_FILE` and the client certificate's): refused unless
/// `url` asks for TLS. The first connection's failure says what to check: a plain URL to a server that speaks TLS
/// only, or a certificate that the CA does not vouch for.
pub async fn connect_with(url: &str, command_timeout: Duration, tls: &RedisTls) -> Result<RedisClient, RedisError> {
    use fred::error::{Error, ErrorKind};
    let uses_tls = tls::url_uses_tls(url);
    let mut config = RedisConfig::from_url(&self::url::fred_url(url)).map_err(RedisError::fred)?;
    if tls.is_set() {
        if !uses_tls {
            return Err(RedisError(Error::new(
                ErrorKind::Config,
                "CONVEYOR_REDIS_CA_FILE or a client certificate is set but CONVEYOR_REDIS_URL does not ask for TLS: \
                 use rediss://, rediss-cluster:// or rediss-sentinel://",
            )));
        }
        config.tls =
            tls.fred_config().map_err(|e| Error::new(ErrorKind::Tls, e.to_string())).map_err(RedisError::fred)?;
    }
    if uses_tls != config.tls.is_some() {
        return Err(RedisError(Error::new(
            ErrorKind::Tls,
            "CONVEYOR_REDIS_URL asks for TLS but no TLS configuration was made",
        )));
    }
    if config.server.is_clustered() {
        config.server.set_cluster_discovery_policy(ClusterDiscoveryPolicy::UseCache).map_err(RedisError::fred)?;
    }
    let node_timeout = NODE_TIMEOUT.min(command_timeout);
    let sentinels = matches!(config.server, ServerConfig::Sentinel { .. }).then(|| config.clone());
    let client = Builder::from_config(config)
        .with_connection_config(|c| {
            c.connection_timeout = node_timeout;
            c.internal_command_timeout = node_timeout;
            c.max_command_attempts = 2;
        })
        .with_performance_config(|p| {
            p.default_command_timeout = command_timeout;
        })
        .set_policy(ReconnectPolicy::new_exponential(0, 100, 2_000, 2))
        .build()
        .map_err(RedisError::fred)?;
    if let Err(e) = client.init().await {
        let _ = client.quit().await;
        let e = match sentinels {
            // fred's "Failed to connect to all sentinel nodes": no sentinel answered, and it says no more.
            Some(config) if *e.kind() == fred::error::ErrorKind::Sentinel => {
                why_no_sentinel(config, node_timeout, e).await
            }
            _ => e,
        };
        return Err(RedisError(explain_first_failure(uses_tls, e)));
    }
    Ok(client)
}

/// No sentinel of a sentinel client answered its first connection: fred says only "Failed to connect to all sentinel
/// nodes". Connects to the first sentinel alone, as a plain client with the same TLS and credentials (and no database:
/// a sentinel has no `SELECT`), and adds what it answered (a certificate not verified, a connection reset, a refused
/// password), so that the error says what to fix. The error keeps its kind.
async fn why_no_sentinel(mut config: RedisConfig, node_timeout: Duration, e: fred::error::Error) -> fred::error::Error {
    let Some(first) = config.server.hosts().into_iter().next() else { return e };
    config.server = ServerConfig::Centralized { server: first.clone() };
    config.database = None;
    let Ok(probe) = Builder::from_config(config)
        .with_connection_config(|c| {
            c.connection_timeout = node_timeout;
            c.internal_command_timeout = node_timeout;
            c.max_command_attempts = 1;
        })
        .build()
    else {
        return e;
    };
    let answered = probe.init().await;
    let _ = probe.quit().await;
    match answered {
        Ok(_) => e,
        Err(why) => fred::error::Error::new(
            e.kind().clone(),
            format!("{}; the first sentinel, {}:{}, answered: {}", e.details(), first.host, first.port, why.details()),
        ),
    }
}

/// The first connection's error, with what to check when it looks like TLS on one side only or an unverified
/// certificate.
fn explain_first_failure(uses_tls: bool, e: fred::error::Error) -> fred::error::Error {
    let message = e.details().to_lowercase();
    let hint = if !uses_tls
        && (message.contains("reset")
            || message.contains("timed out")
            || message.contains("closed")
            || message.contains("eof")
            || message.contains("broken pipe")
            || matches!(e.kind(), fred::error::ErrorKind::Protocol | fred::error::ErrorKind::Timeout))
    {
        Some(
            "Redis closed the connection or did not answer: if it accepts TLS only, CONVEYOR_REDIS_URL must be \
             rediss:// (or rediss-cluster://, rediss-sentinel://)",
        )
    } else if uses_tls && (message.contains("certificate") || message.contains("unknownissuer")) {
        Some(
            "the server's certificate was not verified: CONVEYOR_REDIS_CA_FILE must name the CA that signed it \
             (the system's roots are used when it is unset), and its name must match CONVEYOR_REDIS_URL's host",
        )
    } else if uses_tls && (message.contains("tls") || message.contains("handshake")) {
        Some("the TLS handshake failed: check that the server at CONVEYOR_REDIS_URL speaks TLS on that port")
    } else {
        None
    };
    match hint {
        Some(hint) => fred::error::Error::new(e.kind().clone(), format!("{}: {hint}", e.details())),
        None => e,
    }
}

/// A Redis call that failed: Redis could not be reached ([`RedisError::is_unavailable`]) or refused the command. Its
/// message says which, and what to check where the cause is known (a plain URL to a TLS-only server, a certificate
/// its CA does not vouch for).
pub struct RedisError(fred::error::Error);

impl RedisError {
    /// Whether Redis could not be reached (a lost connection, a time-out, a command canceled on a reconnect), as
    /// opposed to refusing the command: worth retrying.
    pub fn is_unavailable(&self) -> bool {
        is_unavailable(&self.0)
    }
}

impl RedisError {
    /// fred's error, wrapped: the only way in, so that no public signature names fred's error.
    pub(crate) fn fred(e: fred::error::Error) -> Self {
        Self(e)
    }
}

impl std::fmt::Display for RedisError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&self.0, f)
    }
}

impl std::fmt::Debug for RedisError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&self.0, f)
    }
}

impl std::error::Error for RedisError {}

/// Whether `e` says Redis could not be reached (connection lost, time-out, command canceled on a reconnect), as
/// opposed to Redis refusing the command: callers outside this module classify errors with it, not by fred's kinds.
pub(crate) fn is_unavailable(e: &fred::error::Error) -> bool {
    e.is_canceled() || matches!(e.kind(), fred::error::ErrorKind::IO | fred::error::ErrorKind::Timeout)
}

/// `PING` with the client's command time-out: whether Redis answers.
pub async fn ping(client: &RedisClient) -> Result<(), RedisError> {
    client.ping::<()>(None).await.watched(client).map_err(RedisError::fred)
}

/// After a command of `client` timed out (Redis did not answer; a reset connection fred handles itself): makes the
/// client look for its nodes again, in the background, one look at a time and at most one every [`RECOVER_EVERY`].
/// A cluster client asks its masters for the slot map ([`slot_map_changed`]) and, if it names other masters than
/// the client's copy, re-reads it (fred's re-read, which connects to the new masters and drops the connections of the
/// ones gone: a silent master's, once a replica serves its slots). A sentinel client whose master does not answer a
/// `PING` reconnects, asking the sentinels for the master. A single server's client is left to fred (there is nowhere
/// else to look). A look that finds nothing changed costs a question per master: fred's re-read tries known nodes one
/// after another inside the task that routes every command, each silent one costing [`NODE_TIMEOUT`], so it is only
/// done when it would find something.
pub(crate) fn recover_after(client: &RedisClient, e: &fred::error::Error) {
    /// One client's looks: whether one is under way, and when the last one ended.
    type Look = (bool, Option<Instant>);
    static LOOKS: LazyLock<Mutex<HashMap<String, Look>>> = LazyLock::new(Mutex::default);
    let clustered = client.is_clustered();
    if *e.kind() != fred::error::ErrorKind::Timeout || !(clustered || client.uses_sentinels()) {
        return;
    }
    {
        let mut looks = LOOKS.lock().expect("recovery lock");
        let look = looks.entry(client.id().to_owned()).or_default();
        if look.0 || look.1.is_some_and(|ended| ended.elapsed() < RECOVER_EVERY) {
            return;
        }
        look.0 = true;
    }
    let client = client.clone();
    tokio::spawn(async move {
        let looked = if clustered { recover_cluster(&client).await } else { recover_sentinel(&client).await };
        match looked {
            Ok(true) => tracing::info!(client = client.id(), "Redis nodes changed; found them again after a time-out"),
            Ok(false) => {}
            Err(e) => tracing::debug!(client = client.id(), error = %e, "Could not look for the Redis nodes again"),
        }
        LOOKS.lock().expect("recovery lock").insert(client.id().to_owned(), (false, Some(Instant::now())));
    });
}

/// Re-reads the slot map if a master says it changed; whether it did.
async fn recover_cluster(client: &RedisClient) -> Result<bool, fred::error::Error> {
    if !slot_map_changed(client).await {
        return Ok(false);
    }
    client.sync_cluster().await?;
    Ok(true)
}

/// Reconnects (asking the sentinels for the master) if the master does not answer a `PING`; whether it did.
async fn recover_sentinel(client: &RedisClient) -> Result<bool, fred::error::Error> {
    let quick = Options { timeout: Some(NODE_TIMEOUT), max_attempts: Some(1), ..Options::default() };
    if client.with_options(&quick).ping::<()>(None).await.is_ok() {
        return Ok(false);
    }
    client.force_reconnection().await?;
    Ok(true)
}

/// Whether the slot map, as the first master to answer gives it, names other masters than `client`'s copy of it (or
/// no master answers). Every master of the copy is asked at once (routed by one of its slots, given
/// [`NODE_TIMEOUT`]): fred's routing task sends the questions and goes on, so a silent master delays nothing; it just
/// never answers.
async fn slot_map_changed(client: &RedisClient) -> bool {
    let Some(copy) = client.cached_cluster_state() else { return true };
    let known: HashSet<(String, u16)> =
        copy.unique_primary_nodes().into_iter().map(|s| (s.host.to_string(), s.port)).collect();
    let mut asked = HashSet::new();
    let questions: Vec<_> = copy
        .slots()
        .iter()
        .filter(|range| asked.insert((range.primary.host.to_string(), range.primary.port)))
        .map(|range| {
            let routed = Options {
                cluster_hash: Some(ClusterHash::Custom(range.start)),
                timeout: Some(NODE_TIMEOUT),
                max_attempts: Some(1),
                ..Options::default()
            };
            let (client, host) = (client.with_options(&routed), range.primary.host.to_string());
            Box::pin(async move { client.cluster_slots::<Value>().await.map(|slots| (host, slots)) })
        })
        .collect();
    if questions.is_empty() {
        return true;
    }
    // No master answering is a change too: the map is then read from the other nodes the client knows.
    match futures_util::future::select_ok(questions).await {
        Ok(((host, slots), _)) => slot_map_primaries(&slots, &host) != known,
        Err(_) => true,
    }
}

/// The masters (host, port) a `CLUSTER SLOTS` reply from a node on `host` names (a master named without a host is on
/// the node's, as fred reads it too).
fn slot_map_primaries(reply: &Value, host: &str) -> HashSet<(String, u16)> {
    let Value::Array(ranges) = reply else { return HashSet::new() };
    ranges
        .iter()
        .filter_map(|range| match range {
            Value::Array(fields) => match fields.get(2) {
                Some(Value::Array(node)) => {
                    let named = node.first()?.as_string()?;
                    let port = node.get(1)?.as_u64().and_then(|p| u16::try_from(p).ok())?;
                    Some((if named.is_empty() { host.to_owned() } else { named }, port))
                }
                _ => None,
            },
            _ => None,
        })
        .collect()
}

/// A Redis call's result that makes its client look for its nodes again when it timed out ([`recover_after`]).
pub(crate) trait Watched {
    /// `self`, after [`recover_after`] if it is a time-out.
    fn watched(self, client: &RedisClient) -> Self;
}

impl<T> Watched for Result<T, fred::error::Error> {
    fn watched(self, client: &RedisClient) -> Self {
        if let Err(e) = &self {
            recover_after(client, e);
        }
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &str) -> Value {
        Value::String(v.into())
    }

    #[test]
    fn the_masters_of_a_cluster_slots_reply_are_its_ranges_first_nodes() {
        let range = |start, end, port, replica| {
            Value::Array(vec![
                Value::Integer(start),
                Value::Integer(end),
                Value::Array(vec![s("10.0.0.1"), Value::Integer(port), s("id")]),
                Value::Array(vec![s("10.0.0.2"), Value::Integer(replica), s("id2")]),
            ])
        };
        let reply =
            Value::Array(vec![range(0, 99, 7000, 7100), range(100, 199, 7001, 7101), range(200, 299, 7000, 7100)]);
        let masters = slot_map_primaries(&reply, "10.0.0.9");
        assert_eq!(masters, HashSet::from([("10.0.0.1".to_owned(), 7000), ("10.0.0.1".to_owned(), 7001)]));
        assert!(slot_map_primaries(&Value::Null, "10.0.0.9").is_empty());
        let unnamed = Value::Array(vec![Value::Array(vec![
            Value::Integer(0),
            Value::Integer(16383),
            Value::Array(vec![s(""), Value::Integer(7000)]),
        ])]);
        assert_eq!(slot_map_primaries(&unnamed, "10.0.0.9"), HashSet::from([("10.0.0.9".to_owned(), 7000)]));
    }
}
