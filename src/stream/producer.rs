//! Publishing jobs: `XADD` de-duplicated by event id, in one atomic script per event, pipelined per batch.
//!
//! The script reads the event's de-dup key; if it is set, the event is already in the stream and the script returns
//! the stored entry id. Otherwise it `XADD`s with an auto id (explicit ids must grow, a UUID cannot be one) and sets
//! the de-dup key to the new id with a TTL. Both keys carry the queue's hash tag, so the script stays in one slot.

use fred::prelude::{ClientLike, LuaInterface};
use fred::types::Value;
use fred::types::{ClusterHash, CustomCommand};
use uuid::Uuid;

use super::RedisClient;
use super::keys::Keys;

const PUBLISH_SCRIPT: &str = r#"
local existing = redis.call('GET', KEYS[2])
if existing then
  return existing
end
local id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 2))
redis.call('SET', KEYS[2], id, 'PX', ARGV[1])
return id
"#;

/// One job to publish.
#[derive(Clone, Debug)]
pub struct Message {
    /// Queue (stream).
    pub queue: String,
    /// The outbox event id: the job id.
    pub event_id: Uuid,
    /// Tenant.
    pub workspace_id: Uuid,
    /// Job type.
    pub event_type: String,
    /// JSON payload (ids only).
    pub payload: String,
    /// The operation the job advances, if any.
    pub operation_id: Option<Uuid>,
    /// The job's attempt (1 on the first run; retries after failed runs count up).
    pub attempt: i32,
    /// When the event was committed, milliseconds since the epoch.
    pub enqueued_at_ms: i64,
    /// W3C trace context.
    pub traceparent: String,
    /// Re-drive generation (0 until the reconciler re-drives it).
    pub redrive: i32,
}

/// Publishes jobs into their queues' streams.
#[derive(Clone)]
pub struct Producer {
    client: RedisClient,
    keys: Keys,
    dedup_ttl_ms: u64,
    sha: String,
}

fn is_noscript(e: &fred::error::Error) -> bool {
    e.details().starts_with("NOSCRIPT") || e.to_string().contains("NOSCRIPT")
}

impl Producer {
    /// A producer whose de-dup keys live `dedup_ttl`.
    pub fn new(client: RedisClient, keys: Keys, dedup_ttl: std::time::Duration) -> Self {
        let sha = fred::util::sha1_hash(PUBLISH_SCRIPT);
        Self { client, keys, dedup_ttl_ms: dedup_ttl.as_millis().max(1) as u64, sha }
    }

    fn args(&self, m: &Message) -> (Vec<String>, Vec<String>) {
        let keys = vec![self.keys.stream(&m.queue), self.keys.dedup(&m.queue, &m.event_id, m.redrive)];
        let mut args = vec![
            self.dedup_ttl_ms.to_string(),
            "event_id".into(),
            m.event_id.to_string(),
            "workspace_id".into(),
            m.workspace_id.to_string(),
            "type".into(),
            m.event_type.clone(),
            "payload".into(),
            m.payload.clone(),
            "attempt".into(),
            m.attempt.to_string(),
            "enqueued_at".into(),
            m.enqueued_at_ms.to_string(),
            "traceparent".into(),
            m.traceparent.clone(),
            "redrive".into(),
            m.redrive.to_string(),
        ];
        if let Some(op) = m.operation_id {
            args.extend(["operation_id".to_owned(), op.to_string()]);
        }
        (keys, args)
    }

    /// Publishes `messages` in one pipeline. Each result is the stream entry id (new, or the one an earlier
    /// delivery of the same event got) or that message's error. Safe to repeat: the de-dup key makes it so.
    pub async fn publish(&self, messages: &[Message]) -> Vec<Result<String, fred::error::Error>> {
        let mut results = self.publish_with(&self.sha, messages).await;
        if results.iter().any(|r| r.as_ref().is_err_and(is_noscript)) {
            // First use on this server (or after a restart or SCRIPT FLUSH): load and run the batch again.
            if let Err(e) = self.client.script_load::<String, _>(PUBLISH_SCRIPT).await {
                return messages.iter().map(|_| Err(e.clone())).collect();
            }
            results = self.publish_with(&self.sha, messages).await;
        }
        results
    }

    async fn publish_with(&self, sha: &str, messages: &[Message]) -> Vec<Result<String, fred::error::Error>> {
        // Pipelines take no typed EVALSHA in fred, so it goes as a custom command routed by its first key.
        let evalsha = CustomCommand::new("EVALSHA", ClusterHash::Offset(2), false);
        let pipeline = self.client.pipeline();
        for m in messages {
            let (keys, args) = self.args(m);
            let mut command: Vec<String> = Vec::with_capacity(2 + keys.len() + args.len());
            command.push(sha.to_owned());
            command.push(keys.len().to_string());
            command.extend(keys);
            command.extend(args);
            if let Err(e) = pipeline.custom::<Value, _>(evalsha.clone(), command).await {
                return messages.iter().map(|_| Err(e.clone())).collect();
            }
        }
        let results = pipeline.try_all::<Value>().await;
        if results.len() != messages.len() {
            let e = results
                .into_iter()
                .find_map(Result::err)
                .unwrap_or_else(|| fred::error::Error::new(fred::error::ErrorKind::Unknown, "short pipeline reply"));
            return messages.iter().map(|_| Err(e.clone())).collect();
        }
        results
            .into_iter()
            .map(|r| {
                r.and_then(|v| {
                    v.as_string().ok_or_else(|| {
                        fred::error::Error::new(fred::error::ErrorKind::Protocol, "publish script returned no entry id")
                    })
                })
            })
            .collect()
    }

    /// The client, for status checks.
    pub fn client(&self) -> &RedisClient {
        &self.client
    }
}

/// Whether the client's connection is up (used to skip work while Redis is away).
pub fn is_connected(client: &RedisClient) -> bool {
    client.is_connected()
}
