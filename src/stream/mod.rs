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

pub mod admin;
pub mod consumer;
pub mod keys;
pub mod layout;
pub mod producer;
mod script;
mod url;

use std::time::Duration;

use fred::prelude::{Builder, ClientLike, Config as RedisConfig, ReconnectPolicy};

pub use fred::clients::Client as RedisClient;

/// Opens a Redis client that reconnects with exponential back-off forever (fred's default is never) and fails
/// commands after `command_timeout` instead of queueing them while Redis is away. `url` is `redis://`, `rediss://`,
/// `redis-sentinel://` or `redis-cluster://`; a cluster's seed nodes may be listed with commas
/// (`redis-cluster://h1:6379,h2:6379`) or as fred's `?node=h2:6379` parameters. A cluster client follows `MOVED` and
/// `ASK` redirections and re-reads the slot map after a failover.
pub async fn connect(url: &str, command_timeout: Duration) -> Result<RedisClient, fred::error::Error> {
    let config = RedisConfig::from_url(&self::url::fred_url(url))?;
    let client = Builder::from_config(config)
        .with_connection_config(|c| {
            c.connection_timeout = Duration::from_secs(3);
            c.max_command_attempts = 2;
        })
        .with_performance_config(|p| {
            p.default_command_timeout = command_timeout;
        })
        .set_policy(ReconnectPolicy::new_exponential(0, 100, 5_000, 2))
        .build()?;
    client.init().await?;
    Ok(client)
}

/// Whether `e` says Redis could not be reached (connection lost, time-out, command canceled on a reconnect), as
/// opposed to Redis refusing the command: callers outside this module classify errors with it, not by fred's kinds.
pub(crate) fn is_unavailable(e: &fred::error::Error) -> bool {
    e.is_canceled() || matches!(e.kind(), fred::error::ErrorKind::IO | fred::error::ErrorKind::Timeout)
}

/// `PING` with the client's command time-out: whether Redis answers.
pub async fn ping(client: &RedisClient) -> Result<(), fred::error::Error> {
    client.ping::<()>(None).await
}
