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
pub(crate) mod tls;
mod url;

use std::time::Duration;

use fred::prelude::{Builder, ClientLike, Config as RedisConfig, ReconnectPolicy};

pub use fred::clients::Client as RedisClient;
pub use tls::{RedisTls, TlsFileError};

/// Opens a Redis client that reconnects with exponential back-off forever (fred's default is never) and fails
/// commands after `command_timeout` instead of queueing them while Redis is away. `url` is `redis://`, `rediss://`,
/// `redis-sentinel://`, `redis-cluster://` or their TLS forms `rediss-sentinel://` and `rediss-cluster://` (verified
/// against the system's roots; [`connect_with`] names a CA and a client certificate); a cluster's seed nodes may be
/// listed with commas (`redis-cluster://h1:6379,h2:6379`) or as fred's `?node=h2:6379` parameters. A cluster client
/// follows `MOVED` and `ASK` redirections and re-reads the slot map after a failover.
pub async fn connect(url: &str, command_timeout: Duration) -> Result<RedisClient, fred::error::Error> {
    connect_with(url, command_timeout, &RedisTls::default()).await
}

/// [`connect`] with the TLS files of `tls` (`CONVEYOR_REDIS_CA_FILE` and the client certificate's): refused unless
/// `url` asks for TLS. The first connection's failure says what to check: a plain URL to a server that speaks TLS
/// only, or a certificate that the CA does not vouch for.
pub async fn connect_with(
    url: &str,
    command_timeout: Duration,
    tls: &RedisTls,
) -> Result<RedisClient, fred::error::Error> {
    use fred::error::{Error, ErrorKind};
    let uses_tls = tls::url_uses_tls(url);
    let mut config = RedisConfig::from_url(&self::url::fred_url(url))?;
    if tls.is_set() {
        if !uses_tls {
            return Err(Error::new(
                ErrorKind::Config,
                "CONVEYOR_REDIS_CA_FILE or a client certificate is set but CONVEYOR_REDIS_URL does not ask for TLS: \
                 use rediss://, rediss-cluster:// or rediss-sentinel://",
            ));
        }
        config.tls = tls.fred_config().map_err(|e| Error::new(ErrorKind::Tls, e.to_string()))?;
    }
    if uses_tls != config.tls.is_some() {
        return Err(Error::new(ErrorKind::Tls, "CONVEYOR_REDIS_URL asks for TLS but no TLS configuration was made"));
    }
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
    if let Err(e) = client.init().await {
        let _ = client.quit().await;
        return Err(explain_first_failure(uses_tls, e));
    }
    Ok(client)
}

/// The first connection's error, with what to check when it looks like TLS on one side only or an unverified
/// certificate.
fn explain_first_failure(uses_tls: bool, e: fred::error::Error) -> fred::error::Error {
    let message = e.details().to_lowercase();
    let hint = if !uses_tls
        && (message.contains("reset")
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

/// Whether `e` says Redis could not be reached (connection lost, time-out, command canceled on a reconnect), as
/// opposed to Redis refusing the command: callers outside this module classify errors with it, not by fred's kinds.
pub(crate) fn is_unavailable(e: &fred::error::Error) -> bool {
    e.is_canceled() || matches!(e.kind(), fred::error::ErrorKind::IO | fred::error::ErrorKind::Timeout)
}

/// `PING` with the client's command time-out: whether Redis answers.
pub async fn ping(client: &RedisClient) -> Result<(), fred::error::Error> {
    client.ping::<()>(None).await
}
