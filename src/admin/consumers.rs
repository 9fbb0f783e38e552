//! The workers as Redis sees them (Sidekiq's "Busy", asynqmon's "Servers"): each consumer of each queue's group, with
//! the entries it holds (delivered, not yet acknowledged: the jobs it runs or is about to) and how long since it last
//! read (`XINFO CONSUMERS`), summed over the queue's streams (the whole stream and its partitions). A consumer idle
//! for long while it holds entries is a worker that died: another worker reclaims them after the visibility time-out.
//!
//! The queues come from the audited `conveyor_admin_queues`, so the read is on the audit trail. Without Redis (an
//! `Admin` built without it), or with Redis out of reach, the answer is an error: there is nothing else to show.

use std::collections::BTreeMap;

use fred::prelude::StreamsInterface;
use fred::types::Value;
use serde::{Deserialize, Serialize};

use super::{Actor, Admin, AdminError};

/// One consumer of one queue's group.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsumerInfo {
    /// The queue.
    pub queue: String,
    /// The consumer's name: a worker process's, its host and a random suffix, new at each start. A consumer that
    /// holds nothing and has long been idle is a worker that stopped; `XGROUP DELCONSUMER` forgets it.
    pub consumer: String,
    /// Entries delivered to it and not acknowledged, over the queue's streams.
    pub pending: u64,
    /// Milliseconds since its last read of any of the queue's streams.
    pub idle_ms: u64,
}

/// Every consumer of every queue, by queue then name.
pub(super) async fn list(admin: &Admin, actor: &Actor) -> Result<Vec<ConsumerInfo>, AdminError> {
    let Some((redis, keys)) = &admin.redis else {
        return Err(AdminError::Invalid("the consumers are in Redis: this operator module has no Redis".into()));
    };
    let queues = super::queues::list(admin, actor, None).await?;
    let mut all = Vec::new();
    for queue in queues.iter().map(|q| q.name.as_str()) {
        let streams = crate::stream::layout::stream_keys(redis, keys, queue)
            .await
            .map_err(|e| AdminError::Invalid(format!("the stream layout of {queue} could not be read: {e}")))?;
        let mut by_name: BTreeMap<String, (u64, u64)> = BTreeMap::new();
        for stream in streams {
            let reply = match redis.xinfo_consumers::<Value, _, _>(stream, keys.group(queue)).await {
                Ok(reply) => reply,
                // No stream or group yet: nobody consumes it.
                Err(e) if e.details().contains("no such key") || e.details().contains("NOGROUP") => continue,
                Err(e) => return Err(AdminError::Redis(e)),
            };
            for (name, pending, idle) in consumers_of(reply) {
                let entry = by_name.entry(name).or_insert((0, u64::MAX));
                entry.0 += pending;
                entry.1 = entry.1.min(idle);
            }
        }
        all.extend(by_name.into_iter().map(|(consumer, (pending, idle_ms))| ConsumerInfo {
            queue: queue.to_owned(),
            consumer,
            pending,
            idle_ms,
        }));
    }
    Ok(all)
}

/// (name, pending, idle ms) of each consumer in an `XINFO CONSUMERS` reply (maps, or flat arrays under RESP2).
fn consumers_of(reply: Value) -> Vec<(String, u64, u64)> {
    let Value::Array(consumers) = reply else { return Vec::new() };
    consumers
        .into_iter()
        .filter_map(|entry| {
            let fields = crate::stream::consumer::fields_of(entry)?;
            let number = |field: &str| fields.get(field).and_then(|n| n.parse().ok()).unwrap_or(0);
            Some((fields.get("name")?.to_owned(), number("pending"), number("idle")))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_consumer_of_the_reply_is_read_whatever_fields_come_beside() {
        let consumer = |name: &str, pending: i64, idle: i64| {
            Value::Array(vec![
                "name".into(),
                name.into(),
                "pending".into(),
                Value::Integer(pending),
                "idle".into(),
                Value::Integer(idle),
                "inactive".into(),
                Value::Integer(-1),
            ])
        };
        let reply = Value::Array(vec![consumer("w-1", 3, 10), consumer("w-2", 0, 90_000)]);
        assert_eq!(consumers_of(reply), [("w-1".to_owned(), 3, 10), ("w-2".to_owned(), 0, 90_000)]);
        assert!(consumers_of(Value::Null).is_empty());
    }
}
