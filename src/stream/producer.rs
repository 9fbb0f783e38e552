//! Publishing jobs: `XADD` de-duplicated by event id, atomically, in chunks of up to [`CHUNK`] events per script
//! call, pipelined.
//!
//! For each event the script reads its de-dup key; if it is set, the event is already in the stream and the script
//! returns the stored entry id. Otherwise it `XADD`s with an auto id (explicit ids must grow, a UUID cannot be one)
//! and sets the de-dup key to the new id with a TTL. All keys of a call belong to one stream (a queue, or one
//! partition of it) and carry its hash tag, so a call stays in one Redis Cluster slot. A chunk that fails half-way is safe to run again: the events it had
//! added are found by their de-dup keys.

use super::RedisError;
use std::collections::HashMap;
use std::sync::Arc;

use fred::prelude::ClientLike;
use fred::types::{CustomCommand, Value};
use uuid::Uuid;

use super::keys::{Keys, Partition, parse_stream_ref, stream_ref};
use super::layout::LayoutCache;
use super::script::{LuaScript, is_noscript, routed_by};
use super::{RedisClient, Watched};

/// A queue and one of its streams.
type Stream<'a> = (&'a str, Partition);

/// Events per script call: large enough to amortize the call, small enough to keep Redis responsive.
pub(crate) const CHUNK: usize = 100;

// KEYS[1] = the stream, KEYS[2..] = one de-dup key per event. ARGV[1] = de-dup TTL (ms); then, per event, the
// number of field/value arguments followed by them.
const PUBLISH_SCRIPT: &str = r#"
local ids = {}
local pos = 2
for i = 2, #KEYS do
  local n = tonumber(ARGV[pos])
  pos = pos + 1
  local id = redis.call('GET', KEYS[i])
  if not id then
    id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, pos, pos + n - 1))
    redis.call('SET', KEYS[i], id, 'PX', ARGV[1])
  end
  ids[#ids + 1] = id
  pos = pos + n
end
return ids
"#;

// KEYS[1] = a stream, ARGV[1] = its group. Entries ever added to the stream, and of those in it, the ones the group
// has not read yet (its length less the group's pending entries: the worker deletes what it acknowledges). No stream:
// nothing. The dispatcher's gate reads it (see `crate::dispatcher`).
const LOAD_SCRIPT: &str = r#"
if redis.call('EXISTS', KEYS[1]) == 0 then return {0, 0} end
local length = redis.call('XLEN', KEYS[1])
local added = 0
local info = redis.call('XINFO', 'STREAM', KEYS[1])
for i = 1, #info, 2 do
  if info[i] == 'entries-added' then added = info[i + 1] end
end
local pending = 0
for _, group in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  local name, count
  for i = 1, #group, 2 do
    if group[i] == 'name' then name = group[i + 1] elseif group[i] == 'pending' then count = group[i + 1] end
  end
  if name == ARGV[1] then pending = count end
end
return {added, math.max(length - pending, 0)}
"#;

// KEYS = de-dup keys of one queue, ARGV[1] = their new time to live (ms).
// LT: a key is only ever shortened (Redis 7.0+).
const EXPIRE_SCRIPT: &str = "for i = 1, #KEYS do redis.call('PEXPIRE', KEYS[i], ARGV[1], 'LT') end return #KEYS";

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
    /// When the job fell due, milliseconds since the epoch, where that is later than its commit (a delayed job, a
    /// retry backing off, a failed hand-off's back-off): the worker measures the job's queue wait from it. Written as
    /// the entry's `due_at` field when set.
    pub due_at_ms: Option<i64>,
    /// W3C trace context.
    pub traceparent: String,
    /// The W3C `tracestate` that came with it, if any: the entry's `tracestate` field when set.
    pub tracestate: Option<String>,
    /// Re-drive generation (0 until the reconciler re-drives it).
    pub redrive: i32,
    /// Its workspace's fair-share class when the relay claimed it (`light` or `backlogged`): the worker's queue-wait
    /// metric is labelled with it. Written as the entry's `class` field when not empty.
    pub class: String,
    /// The job's own options (runs, time-out, back-off base and cap, in ms), where it set them.
    pub options: JobOptions,
}

/// A job's own options, carried in its entry where set (the kind's defaults apply to the others).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct JobOptions {
    /// Runs before dead-lettering.
    pub max_attempts: Option<i32>,
    /// Longest run, ms.
    pub timeout_ms: Option<i64>,
    /// Back-off base and cap, ms.
    pub backoff_ms: Option<(i64, i64)>,
}

/// Publishes jobs into their queues' streams.
#[derive(Clone)]
pub struct Producer {
    client: RedisClient,
    keys: Keys,
    dedup_ttl_ms: u64,
    script: LuaScript,
    layout: Arc<LayoutCache>,
}

/// How a chunk's script call goes out: by SHA, or with the script's text for a node that does not know it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Call {
    Sha,
    Text,
}

impl Producer {
    /// A producer whose de-dup keys live `dedup_ttl`, into the streams the layout names (one per queue until
    /// [`Producer::with_partitions`] raises it).
    pub fn new(client: RedisClient, keys: Keys, dedup_ttl: std::time::Duration) -> Self {
        let layout = Arc::new(LayoutCache::new(client.clone(), &keys, 1));
        let dedup_ttl_ms = dedup_ttl.as_millis().max(1) as u64;
        Self { client, keys, dedup_ttl_ms, script: LuaScript::new(PUBLISH_SCRIPT), layout }
    }

    /// Splits every queue into `partitions` streams (`CONVEYOR_STREAM_PARTITIONS`): raises the layout to it (never
    /// lowers it) for jobs created 10 s after the change on, so that every reader knows the new streams before they fill.
    pub fn with_partitions(mut self, partitions: u16) -> Self {
        self.layout = Arc::new(LayoutCache::new(self.client.clone(), &self.keys, partitions));
        self
    }

    fn fields(m: &Message) -> Vec<String> {
        let mut fields = vec![
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
        if let Some(due) = m.due_at_ms {
            fields.extend(["due_at".to_owned(), due.to_string()]);
        }
        if let Some(state) = &m.tracestate {
            fields.extend(["tracestate".to_owned(), state.clone()]);
        }
        if !m.class.is_empty() {
            fields.extend(["class".to_owned(), m.class.clone()]);
        }
        if let Some(op) = m.operation_id {
            fields.extend(["operation_id".to_owned(), op.to_string()]);
        }
        if let Some(a) = m.options.max_attempts {
            fields.extend(["max_attempts".to_owned(), a.to_string()]);
        }
        if let Some(t) = m.options.timeout_ms {
            fields.extend(["timeout_ms".to_owned(), t.to_string()]);
        }
        if let Some((base, max)) = m.options.backoff_ms {
            fields.extend(["backoff_ms".to_owned(), base.to_string(), "backoff_max_ms".to_owned(), max.to_string()]);
        }
        fields
    }

    /// The script's keys and arguments for one chunk of one stream's messages.
    fn call(&self, (queue, partition): Stream<'_>, chunk: &[&Message]) -> (Vec<String>, Vec<String>) {
        let mut keys = Vec::with_capacity(1 + chunk.len());
        keys.push(self.keys.partition_stream(queue, partition));
        keys.extend(chunk.iter().map(|m| self.keys.partition_dedup(queue, partition, &m.event_id, m.redrive)));
        let mut args = Vec::with_capacity(1 + chunk.len() * 20);
        args.push(self.dedup_ttl_ms.to_string());
        for m in chunk {
            let fields = Self::fields(m);
            args.push(fields.len().to_string());
            args.extend(fields);
        }
        (keys, args)
    }

    /// Shortens the de-dup keys of `handed_off` (queue, stream reference as [`Producer::publish`] returned it, event
    /// id, re-drive generation) to expire after `ttl`, if they would live longer: one script call per stream and
    /// chunk, in one pipeline (one command per key would cost the client more than the keys cost Redis).
    pub(crate) async fn expire_dedup(
        &self,
        handed_off: &[(&str, &str, Uuid, i32)],
        ttl: std::time::Duration,
    ) -> Result<(), RedisError> {
        let mut by_queue: HashMap<Stream<'_>, Vec<String>> = HashMap::new();
        for (queue, reference, id, redrive) in handed_off {
            let (partition, _) = parse_stream_ref(reference);
            by_queue
                .entry((queue, partition))
                .or_default()
                .push(self.keys.partition_dedup(queue, partition, id, *redrive));
        }
        if by_queue.is_empty() {
            return Ok(());
        }
        let ms = ttl.as_millis().max(1).to_string();
        let pipeline = self.client.pipeline();
        for keys in by_queue.values() {
            // EVAL, not EVALSHA: the script is short, and a restarted Redis needs no reload. Routed by the stream's
            // slot, which all of its de-dup keys share.
            let eval = CustomCommand::new("EVAL", routed_by(&keys[0]), false);
            for chunk in keys.chunks(CHUNK) {
                let mut args = Vec::with_capacity(chunk.len() + 3);
                args.extend([EXPIRE_SCRIPT.to_owned(), chunk.len().to_string()]);
                args.extend(chunk.iter().cloned());
                args.push(ms.clone());
                pipeline.custom::<Value, _>(eval.clone(), args).await.map_err(RedisError::fred)?;
            }
        }
        pipeline
            .try_all::<Value>()
            .await
            .into_iter()
            .try_for_each(|r| r.map(drop))
            .watched(&self.client)
            .map_err(RedisError::fred)
    }

    /// Publishes `messages` in one pipeline. Each result is the stream reference (the entry id, new
    /// or the one an earlier delivery of the same event got, and its partition) or the error of its chunk. Safe to
    /// repeat: the de-dup keys make it so.
    ///
    /// Each job goes to the stream the layout gives its workspace and creation time . The chunks
    /// go out by SHA; the chunks a node answered `NOSCRIPT` (first use on it, a restart, a replica promoted by a
    /// failover) go again with the script's text, and the script is loaded on every primary.
    pub async fn publish(&self, messages: &[Message]) -> Vec<Result<String, RedisError>> {
        let layout = match self.layout.get().await {
            Ok(layout) => layout,
            Err(e) => return messages.iter().map(|_| Err(RedisError::fred(e.clone()))).collect(),
        };
        // Chunks per stream, remembering where each message's answer goes.
        let mut by_stream: HashMap<Stream<'_>, Vec<usize>> = HashMap::new();
        for (i, m) in messages.iter().enumerate() {
            let partition = layout.partition_of(&m.workspace_id, m.enqueued_at_ms);
            by_stream.entry((m.queue.as_str(), partition)).or_default().push(i);
        }
        let chunks: Vec<(Stream<'_>, Vec<usize>)> = by_stream
            .into_iter()
            .flat_map(|(stream, idx)| idx.chunks(CHUNK).map(|c| (stream, c.to_vec())).collect::<Vec<_>>())
            .collect();
        let mut results: Vec<Result<String, fred::error::Error>> = messages
            .iter()
            .map(|_| Err(fred::error::Error::new(fred::error::ErrorKind::Unknown, "not sent")))
            .collect();
        let unknown = self.publish_chunks(messages, &chunks, Call::Sha, &mut results).await;
        if !unknown.is_empty() {
            self.script.load_everywhere(&self.client);
            let again: Vec<(Stream<'_>, Vec<usize>)> = unknown.into_iter().map(|c| chunks[c].clone()).collect();
            self.publish_chunks(messages, &again, Call::Text, &mut results).await;
        }
        results.into_iter().map(|r| r.map_err(RedisError::fred)).collect()
    }

    /// Sends `chunks` of `messages` in one pipeline and writes each message's answer into `results`. Returns the
    /// chunks answered `NOSCRIPT`.
    async fn publish_chunks(
        &self,
        messages: &[Message],
        chunks: &[(Stream<'_>, Vec<usize>)],
        how: Call,
        results: &mut [Result<String, fred::error::Error>],
    ) -> Vec<usize> {
        let fail_all = |results: &mut [Result<String, fred::error::Error>], e: &fred::error::Error| {
            for (_, idx) in chunks {
                for &i in idx {
                    results[i] = Err(e.clone());
                }
            }
        };
        let pipeline = self.client.pipeline();
        for (stream, idx) in chunks {
            let chunk: Vec<&Message> = idx.iter().map(|&i| &messages[i]).collect();
            let (keys, args) = self.call(*stream, &chunk);
            let (cmd, command) = match how {
                Call::Sha => self.script.evalsha(keys, args),
                Call::Text => self.script.eval(keys, args),
            };
            if let Err(e) = pipeline.custom::<Value, _>(cmd, command).await {
                fail_all(results, &e);
                return Vec::new();
            }
        }
        let replies = pipeline.try_all::<Value>().await;
        if let Some(Err(e)) = replies.iter().find(|r| r.is_err()) {
            super::recover_after(&self.client, e);
        }
        if replies.len() != chunks.len() {
            let e = replies
                .into_iter()
                .find_map(Result::err)
                .unwrap_or_else(|| fred::error::Error::new(fred::error::ErrorKind::Unknown, "short pipeline reply"));
            fail_all(results, &e);
            return Vec::new();
        }
        let mut unknown = Vec::new();
        for (c, (((_, partition), idx), reply)) in chunks.iter().zip(replies).enumerate() {
            let ids: Result<Vec<String>, fred::error::Error> = reply.and_then(|v| match v {
                Value::Array(items) if items.len() == idx.len() => items
                    .iter()
                    .map(|i| {
                        i.as_string().ok_or_else(|| {
                            fred::error::Error::new(
                                fred::error::ErrorKind::Protocol,
                                "publish script returned no entry id",
                            )
                        })
                    })
                    .collect(),
                _ => Err(fred::error::Error::new(fred::error::ErrorKind::Protocol, "unexpected publish script reply")),
            });
            match ids {
                Ok(ids) => {
                    for (&i, id) in idx.iter().zip(ids) {
                        results[i] = Ok(stream_ref(*partition, &id));
                    }
                }
                Err(e) => {
                    if is_noscript(&e) {
                        unknown.push(c);
                    }
                    for &i in idx {
                        results[i] = Err(e.clone());
                    }
                }
            }
        }
        unknown
    }

    /// What waits in `queue`'s streams (every stream the layout names), and how many entries they were ever given:
    /// one script call per stream, in one pipeline.
    pub(crate) async fn queue_load(&self, queue: &str) -> Result<crate::dispatcher::QueueLoad, RedisError> {
        let layout = self.layout.get().await.map_err(RedisError::fred)?;
        let group = self.keys.group(queue);
        let pipeline = self.client.pipeline();
        for partition in layout.streams(1) {
            let stream = self.keys.partition_stream(queue, partition);
            let eval = CustomCommand::new("EVAL", routed_by(&stream), false);
            let args = vec![LOAD_SCRIPT.to_owned(), "1".to_owned(), stream, group.clone()];
            pipeline.custom::<Value, _>(eval, args).await.map_err(RedisError::fred)?;
        }
        let mut load = crate::dispatcher::QueueLoad::default();
        for reply in pipeline.try_all::<Vec<u64>>().await {
            let reply = reply.watched(&self.client).map_err(RedisError::fred)?;
            load.added += reply.first().copied().unwrap_or(0);
            load.waiting += reply.get(1).copied().unwrap_or(0);
        }
        Ok(load)
    }

    /// The partition layout jobs are routed by, read (and raised to this producer's partitions) if the copy is a
    /// few seconds old.
    pub async fn layout(&self) -> Result<super::layout::Layout, RedisError> {
        self.layout.get().await.map_err(RedisError::fred)
    }

    /// The client, for status checks.
    pub fn client(&self) -> &RedisClient {
        &self.client
    }
}
