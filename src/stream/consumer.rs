//! Consuming a queue's stream through its consumer group: create the group, read new entries (`XREADGROUP`),
//! acknowledge and delete processed ones, keep in-flight ones from going idle (heartbeat), and take over the idle
//! entries of dead consumers (`XAUTOCLAIM`).
//!
//! Processed entries are acknowledged and deleted in one script, so a stream holds only work not yet done: its length
//! is bounded by the backlog, never by how many jobs ran, and nothing unacknowledged is ever trimmed away.

use super::RedisError;
use std::sync::Arc;

use fred::prelude::{ClientLike, StreamsInterface};
use fred::types::Value;
use fred::types::config::Options;

use super::keys::{Keys, Partition};
use super::layout::LayoutCache;
use super::script::LuaScript;
use super::{RedisClient, Watched};

const ACK_SCRIPT: &str = r#"
local acked = redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 2))
redis.call('XDEL', KEYS[1], unpack(ARGV, 2))
return acked
"#;

/// One stream entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Entry id (`<ms>-<seq>`).
    pub id: String,
    /// Its fields.
    pub fields: Fields,
    /// The stream of its queue it was read from.
    pub partition: Partition,
}

/// Text read from Redis: an immutable UTF-8 slice of the reply's buffer, shared rather than copied.
pub(crate) type Text = fred::bytes_utils::Str;

/// The field-value pairs of an entry (or of a reply shaped like one), in order. There are few (a job has under a
/// dozen), so a lookup scans them: cheaper than hashing every name of every entry read. Names and values are slices
/// of the reply (shared bytes): reading an entry copies none of them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Fields(Vec<(Text, Text)>);

impl Fields {
    /// The value of `name`.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0.iter().find(|(k, _)| &**k == name).map(|(_, v)| &**v)
    }

    /// Takes the value of `name` out (it is gone afterwards).
    pub(crate) fn take(&mut self, name: &str) -> Option<Text> {
        let at = self.0.iter().position(|(k, _)| &**k == name)?;
        Some(self.0.swap_remove(at).1)
    }
}

/// What `XAUTOCLAIM` handed over.
#[derive(Debug, Default)]
pub struct Reclaimed {
    /// Entries now owned by this consumer.
    pub entries: Vec<Entry>,
    /// Ids that were pending but are gone from the stream (trimmed or deleted); they were removed from the PEL.
    pub deleted: Vec<String>,
}

/// Group statistics of one queue (or one of its streams).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct QueueStats {
    /// `XLEN`.
    pub length: u64,
    /// Entries delivered to a consumer and not yet acknowledged.
    pub pending: u64,
    /// Entries not yet delivered to any consumer (`lag`; Redis may not know it after deletions).
    pub lag: Option<u64>,
}

/// Whether Redis answered that the stream or its group does not exist (Redis restarted empty, a failover promoted a
/// replica that had not received the group yet, or someone deleted the stream).
fn is_nogroup(e: &fred::error::Error) -> bool {
    e.details().contains("NOGROUP") || e.to_string().contains("NOGROUP")
}

fn text(v: &Value) -> Option<String> {
    v.as_string()
}

/// The fields of a reply entry: a stream entry's, or an `XINFO` entry's (a map, or a flat array under RESP2), each
/// value as text (numbers too; a null one empty).
pub(crate) fn fields_of(v: Value) -> Option<Fields> {
    match v {
        Value::Array(items) => {
            let mut pairs = Vec::with_capacity(items.len() / 2);
            let mut it = items.into_iter();
            while let (Some(k), Some(v)) = (it.next(), it.next()) {
                pairs.push((k.into_bytes_str()?, v.into_bytes_str().unwrap_or_default()));
            }
            Some(Fields(pairs))
        }
        Value::Map(map) => Some(Fields(
            map.inner()
                .into_iter()
                .filter_map(|(k, v)| Some((Text::from(k.as_str()?), v.into_bytes_str().unwrap_or_default())))
                .collect(),
        )),
        _ => None,
    }
}

/// Parses `[[id, [field, value, ...]], ...]`; entries without fields (deleted) are skipped.
fn entries_of(v: Value) -> Vec<Entry> {
    let Value::Array(items) = v else { return Vec::new() };
    items
        .into_iter()
        .filter_map(|item| {
            let Value::Array(mut pair) = item else { return None };
            if pair.len() != 2 {
                return None;
            }
            let fields = fields_of(pair.pop()?)?;
            let id = text(&pair.pop()?)?;
            Some(Entry { id, fields, partition: Partition::Whole })
        })
        .collect()
}

/// Parses an `XREADGROUP` reply (RESP2 array of `[stream, entries]`, or a RESP3 map).
fn xread_reply(v: Value) -> Vec<Entry> {
    match v {
        Value::Array(streams) => streams
            .into_iter()
            .flat_map(|s| match s {
                Value::Array(mut pair) if pair.len() == 2 => entries_of(pair.pop().unwrap_or(Value::Null)),
                _ => Vec::new(),
            })
            .collect(),
        Value::Map(map) => map.inner().into_values().flat_map(entries_of).collect(),
        _ => Vec::new(),
    }
}

/// A consumer of some queues, named `consumer` within each queue's group (the group of each of a queue's streams).
#[derive(Clone)]
pub struct Consumer {
    /// For commands that do not block.
    client: RedisClient,
    /// For `XREADGROUP ... BLOCK`, which holds its connection while it waits.
    blocking: RedisClient,
    keys: Keys,
    consumer: String,
    ack_script: LuaScript,
    /// The layout, read only: the relay raises it.
    layout: Arc<LayoutCache>,
    /// Partitions read even before the layout names them (`CONVEYOR_STREAM_PARTITIONS`).
    partitions: u16,
    /// The command time-out of `client`: a blocking read times out this long after its wait.
    command_timeout: std::time::Duration,
}

impl Consumer {
    /// A consumer named `consumer` (pod or host name plus process id). `blocking` must be a client of its own.
    pub fn new(client: RedisClient, blocking: RedisClient, keys: Keys, consumer: String) -> Self {
        let layout = Arc::new(LayoutCache::new(client.clone(), &keys, 1));
        let command_timeout = client.perf_config().default_command_timeout;
        Self {
            client,
            blocking,
            keys,
            consumer,
            ack_script: LuaScript::new(ACK_SCRIPT),
            layout,
            partitions: 1,
            command_timeout,
        }
    }

    /// Reads the partitions of `partitions` (`CONVEYOR_STREAM_PARTITIONS`) from the start, as well as every stream
    /// the layout names (CONTRACT §3).
    pub fn with_partitions(mut self, partitions: u16) -> Self {
        self.partitions = partitions.clamp(1, super::layout::MAX_PARTITIONS);
        self
    }

    /// Connects to Redis at `url` with two clients (one for blocking reads) and names the consumer after this process
    /// ([`crate::ids::instance_name`]); keys start with `prefix`.
    pub async fn connect(url: &str, prefix: &str) -> Result<Self, RedisError> {
        let client = super::connect(url, std::time::Duration::from_secs(5)).await?;
        let blocking = super::connect(url, std::time::Duration::from_secs(10)).await?;
        Ok(Self::new(client, blocking, Keys::new(prefix), crate::ids::instance_name()))
    }

    /// This consumer's name.
    pub fn name(&self) -> &str {
        &self.consumer
    }

    /// The keys in use.
    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    /// The streams every queue may hold entries in now: the whole stream, and each partition the layout or this
    /// consumer's setting names. The layout is read again when the copy is a few seconds old.
    pub async fn streams(&self) -> Result<Vec<Partition>, RedisError> {
        Ok(self.layout.get().await.map_err(RedisError::fred)?.streams(self.partitions))
    }

    /// Creates the queue's group (and stream) in each of its streams where missing, reading from the beginning.
    pub async fn ensure_group(&self, queue: &str) -> Result<(), RedisError> {
        for partition in self.streams().await? {
            self.ensure_group_in(queue, partition).await?;
        }
        Ok(())
    }

    /// Creates the queue's group (and stream) in one of its streams if missing, reading from the beginning.
    pub(crate) async fn ensure_group_in(&self, queue: &str, partition: Partition) -> Result<(), RedisError> {
        let stream = self.keys.partition_stream(queue, partition);
        let created: Result<Value, _> =
            self.client.xgroup_create(stream, self.keys.group(queue), "0", true).await.watched(&self.client);
        match created {
            Ok(_) => Ok(()),
            Err(e) if e.details().contains("BUSYGROUP") || e.to_string().contains("BUSYGROUP") => Ok(()),
            Err(e) => Err(RedisError::fred(e)),
        }
    }

    /// Reads up to `count` new entries of `queue`'s whole stream, waiting up to `block_ms` for some. A group that
    /// Redis lost (it restarted empty, a failover promoted a replica that had not received it) is created again, and
    /// the read answers nothing.
    pub async fn read(&self, queue: &str, count: u64, block_ms: u64) -> Result<Vec<Entry>, RedisError> {
        self.read_in(queue, Partition::Whole, count, block_ms).await
    }

    /// Reads up to `count` new entries of one stream of `queue`, waiting up to `block_ms` for some. A group that
    /// Redis lost (it restarted empty, a failover promoted a replica that had not received it, someone deleted the
    /// stream) is created again, and the read answers nothing.
    pub(crate) async fn read_in(
        &self,
        queue: &str,
        partition: Partition,
        count: u64,
        block_ms: u64,
    ) -> Result<Vec<Entry>, RedisError> {
        self.read_or_create(queue, partition, count, Some(block_ms)).await.map_err(RedisError::fred)
    }

    /// Reads up to `count` new entries of one stream of `queue` that are there now, without waiting.
    pub(crate) async fn read_now_in(
        &self,
        queue: &str,
        partition: Partition,
        count: u64,
    ) -> Result<Vec<Entry>, fred::error::Error> {
        self.read_or_create(queue, partition, count, None).await
    }

    async fn read_or_create(
        &self,
        queue: &str,
        partition: Partition,
        count: u64,
        block_ms: Option<u64>,
    ) -> Result<Vec<Entry>, fred::error::Error> {
        let (group, stream) = (self.keys.group(queue), self.keys.partition_stream(queue, partition));
        let read: Result<Value, _> = match block_ms {
            // A read that does not block may share a connection with other commands.
            None => {
                let read = self.client.xreadgroup(group, &self.consumer, Some(count), None, false, stream, ">");
                read.await.watched(&self.client)
            }
            // A blocking read is given up the command time-out after its wait, not the blocking client's own longer
            // time-out: a node that went silent under it is noticed (and looked for again) as soon as by any other
            // command, and the reader's other streams do not wait on it.
            Some(ms) => {
                let timeout = std::time::Duration::from_millis(ms) + self.command_timeout;
                let blocking = self.blocking.with_options(&Options { timeout: Some(timeout), ..Options::default() });
                let read = blocking.xreadgroup(group, &self.consumer, Some(count), Some(ms), false, stream, ">");
                read.await.watched(&self.blocking)
            }
        };
        match read {
            Err(e) if is_nogroup(&e) => {
                self.ensure_group_in(queue, partition).await.map_err(|e| e.0)?;
                Ok(Vec::new())
            }
            Err(e) => Err(e),
            Ok(reply) => Ok(in_partition(xread_reply(reply), partition)),
        }
    }

    /// Acknowledges and deletes processed entries of `queue`'s whole stream. Returns how many were still pending.
    pub async fn ack(&self, queue: &str, ids: &[String]) -> Result<u64, RedisError> {
        self.ack_in(queue, Partition::Whole, ids).await
    }

    /// Acknowledges and deletes processed entries of one stream of `queue`. Returns how many were still pending.
    pub(crate) async fn ack_in(&self, queue: &str, partition: Partition, ids: &[String]) -> Result<u64, RedisError> {
        if ids.is_empty() {
            return Ok(0);
        }
        let mut args = Vec::with_capacity(ids.len() + 1);
        args.push(self.keys.group(queue));
        args.extend(ids.iter().cloned());
        self.ack_script
            .run(&self.client, vec![self.keys.partition_stream(queue, partition)], args)
            .await
            .map_err(RedisError::fred)
    }

    /// Resets the idle time of entries of one stream of `queue` this consumer is working on, so no one reclaims them
    /// while it lives.
    pub(crate) async fn heartbeat_in(
        &self,
        queue: &str,
        partition: Partition,
        ids: &[String],
    ) -> Result<(), RedisError> {
        if ids.is_empty() {
            return Ok(());
        }
        let claimed: Result<Value, _> = self
            .client
            .xclaim(
                self.keys.partition_stream(queue, partition),
                self.keys.group(queue),
                &self.consumer,
                0,
                ids.to_vec(),
                None,
                None,
                None,
                false,
                true,
            )
            .await
            .watched(&self.client);
        match claimed {
            // The group is gone with the entries (see `read`): nothing to keep alive, make the group again.
            Err(e) if is_nogroup(&e) => self.ensure_group_in(queue, partition).await,
            Err(e) => Err(RedisError::fred(e)),
            Ok(_) => Ok(()),
        }
    }

    /// Takes over up to `count` entries of one stream of `queue` idle for at least `min_idle_ms` (their consumer is
    /// presumed dead), scanning from the start of the pending list.
    pub async fn reclaim_in(
        &self,
        queue: &str,
        partition: Partition,
        min_idle_ms: u64,
        count: u64,
    ) -> Result<Reclaimed, RedisError> {
        let stream = self.keys.partition_stream(queue, partition);
        // Read as a raw reply: Redis 7 adds a third element, the ids it found deleted.
        let reply: Value = match self
            .client
            .xautoclaim(&stream, self.keys.group(queue), &self.consumer, min_idle_ms, "0-0", Some(count), false)
            .await
            .watched(&self.client)
        {
            Err(e) if is_nogroup(&e) => {
                self.ensure_group_in(queue, partition).await?;
                return Ok(Reclaimed::default());
            }
            reply => reply.map_err(RedisError::fred)?,
        };
        let Value::Array(mut parts) = reply else { return Ok(Reclaimed::default()) };
        let deleted = if parts.len() >= 3 {
            match parts.remove(2) {
                Value::Array(ids) => ids.iter().filter_map(text).collect(),
                _ => Vec::new(),
            }
        } else {
            Vec::new()
        };
        let entries = if parts.len() >= 2 { in_partition(entries_of(parts.remove(1)), partition) } else { Vec::new() };
        Ok(Reclaimed { entries, deleted })
    }

    /// Length, pending entries and lag of `queue`: its streams' and their groups', summed.
    pub async fn stats(&self, queue: &str) -> Result<QueueStats, RedisError> {
        let mut total = QueueStats { lag: Some(0), ..QueueStats::default() };
        for partition in self.streams().await? {
            let stats = stream_stats(&self.client, &self.keys, queue, partition).await.map_err(RedisError::fred)?;
            total.length += stats.length;
            total.pending += stats.pending;
            total.lag = total.lag.zip(stats.lag).map(|(a, b)| a + b);
        }
        Ok(total)
    }
}

/// Length, pending entries and lag of one stream of `queue` and its group.
pub(crate) async fn stream_stats(
    client: &RedisClient,
    keys: &Keys,
    queue: &str,
    partition: Partition,
) -> Result<QueueStats, fred::error::Error> {
    let stream = keys.partition_stream(queue, partition);
    let length: u64 = client.xlen(&stream).await.watched(client)?;
    let groups: Value = client.xinfo_groups(&stream).await.unwrap_or(Value::Null);
    let group = keys.group(queue);
    let mut stats = QueueStats { length, ..QueueStats::default() };
    if let Value::Array(groups) = groups {
        for g in groups {
            let Some(fields) = fields_of(g) else { continue };
            if fields.get("name") == Some(group.as_str()) {
                stats.pending = fields.get("pending").and_then(|p| p.parse().ok()).unwrap_or(0);
                stats.lag = fields.get("lag").and_then(|l| l.parse().ok());
            }
        }
    } else if length == 0 {
        // No stream, no group: nothing waits.
        stats.lag = Some(0);
    }
    Ok(stats)
}

/// Marks `entries` as read from `partition`.
fn in_partition(mut entries: Vec<Entry>, partition: Partition) -> Vec<Entry> {
    for entry in &mut entries {
        entry.partition = partition;
    }
    entries
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &str) -> Value {
        Value::String(v.into())
    }

    #[test]
    fn xreadgroup_replies_parse_into_entries() {
        let reply = Value::Array(vec![Value::Array(vec![
            s("q"),
            Value::Array(vec![
                Value::Array(vec![s("1-0"), Value::Array(vec![s("event_id"), s("e1"), s("type"), s("t")])]),
                Value::Array(vec![s("2-0"), Value::Null]),
            ]),
        ])]);
        let entries = xread_reply(reply);
        assert_eq!(entries.len(), 1);
        assert_eq!(entries[0].id, "1-0");
        assert_eq!(entries[0].fields.get("event_id"), Some("e1"));
    }
}
