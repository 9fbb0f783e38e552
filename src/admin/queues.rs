//! Queues as an operator sees them: jobs by state and recent throughput from PostgreSQL (`conveyor_admin_queues`),
//! and from Redis each stream's consumer group (`XINFO GROUPS`): lag (entries not yet delivered), pending entries
//! (delivered, not acknowledged) and consumers.
//!
//! Redis only adds to the picture: a stream or group that does not exist yet, an old Redis without `lag`, or Redis
//! out of reach leave those three `None` (the last one logged), and the counts are still answered: they are what an
//! operator needs most when something is wrong.

use std::collections::HashMap;

use fred::prelude::StreamsInterface;
use fred::types::Value;

use chrono::{DateTime, Utc};

use super::{Actor, Admin, AdminError, QueueMinute, QueueSummary, StateCounts, filters};

#[derive(sqlx::FromRow)]
struct Row {
    queue: String,
    queued: i64,
    delayed: i64,
    running: i64,
    retrying: i64,
    dead: i64,
    completed_5m: i64,
    dead_5m: i64,
    oldest_queued_seconds: Option<f64>,
    paused: bool,
    waiting_children: i64,
}

/// What Redis says of a queue's consumer group.
#[derive(Debug, Default, PartialEq, Eq)]
struct GroupInfo {
    lag: Option<u64>,
    pending: Option<u64>,
    consumers: Option<u64>,
}

/// A minute as the operator's functions answer it, and with its queue.
type MinuteRow = (DateTime<Utc>, i64, i64, i64, Option<i64>, Option<f64>);
type QueueMinuteRow = (String, DateTime<Utc>, i64, i64, i64, Option<i64>, Option<f64>);

fn minute((minute, done, failed, expired, backlog, wait_p95_ms): MinuteRow) -> QueueMinute {
    let count = |n: i64| u64::try_from(n).unwrap_or(0);
    let (done, failed, expired) = (count(done), count(failed), count(expired));
    QueueMinute { minute, done, failed, expired, backlog: backlog.map(count), wait_p95_ms }
}

/// The last hour of `name`, minute by minute.
pub(super) async fn minutes(admin: &Admin, actor: &Actor, name: &str) -> Result<Vec<QueueMinute>, AdminError> {
    filters::queue(Some(name))?;
    let rows: Vec<MinuteRow> = sqlx::query_as(
        "SELECT minute, done, failed, expired, backlog, wait_p95_ms
         FROM conveyor.conveyor_admin_queue_minutes_v2($1, $2)",
    )
    .bind(filters::actor(actor)?)
    .bind(name)
    .fetch_all(&admin.operator)
    .await?;
    Ok(rows.into_iter().map(minute).collect())
}

/// The last hour of every queue that recorded a minute in it, by queue name, each minute by minute.
pub(super) async fn every_minutes(
    admin: &Admin,
    actor: &Actor,
) -> Result<std::collections::BTreeMap<String, Vec<QueueMinute>>, AdminError> {
    let rows: Vec<QueueMinuteRow> = sqlx::query_as(
        "SELECT queue, minute, done, failed, expired, backlog, wait_p95_ms
         FROM conveyor.conveyor_admin_queues_minutes_v2($1)",
    )
    .bind(filters::actor(actor)?)
    .fetch_all(&admin.operator)
    .await?;
    let mut queues = std::collections::BTreeMap::<String, Vec<QueueMinute>>::new();
    for (queue, at, done, failed, expired, backlog, wait) in rows {
        queues.entry(queue).or_default().push(minute((at, done, failed, expired, backlog, wait)));
    }
    Ok(queues)
}

/// Every queue, or only `name`.
pub(super) async fn list(admin: &Admin, actor: &Actor, name: Option<&str>) -> Result<Vec<QueueSummary>, AdminError> {
    filters::queue(name)?;
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT queue, queued, delayed, running, retrying, dead, completed_5m, dead_5m, oldest_queued_seconds, paused,
                waiting_children
         FROM conveyor.conveyor_admin_queues($1, $2)",
    )
    .bind(filters::actor(actor)?)
    .bind(name)
    .fetch_all(&admin.operator)
    .await?;
    let groups = futures_util::future::join_all(rows.iter().map(|r| group_info(admin, &r.queue))).await;
    Ok(rows.into_iter().zip(groups).map(|(row, group)| summary(row, group)).collect())
}

fn summary(row: Row, group: GroupInfo) -> QueueSummary {
    let count = |n: i64| u64::try_from(n).unwrap_or(0);
    QueueSummary {
        counts: StateCounts {
            queued: count(row.queued),
            delayed: count(row.delayed),
            running: count(row.running),
            retrying: count(row.retrying),
            dead: count(row.dead),
            waiting_children: count(row.waiting_children),
        },
        lag: group.lag,
        pending: group.pending,
        consumers: group.consumers,
        completed_per_minute: row.completed_5m as f64 / 5.0,
        failed_per_minute: row.dead_5m as f64 / 5.0,
        oldest_queued_seconds: row.oldest_queued_seconds.map(|s| s.max(0.0)),
        paused: row.paused,
        name: row.queue,
    }
}

/// `XINFO GROUPS` of every stream of the queue (the whole stream and its partitions, as the layout in Redis says),
/// for its group: lag and pending entries summed, the most consumers any of them has.
async fn group_info(admin: &Admin, queue: &str) -> GroupInfo {
    let Some((redis, keys)) = &admin.redis else { return GroupInfo::default() };
    let streams = match crate::stream::layout::stream_keys(redis, keys, queue).await {
        Ok(streams) => streams,
        Err(e) => {
            let error = crate::redact::redact(&e.to_string());
            tracing::warn!(queue, %error, "Could not read the stream layout from Redis");
            return GroupInfo::default();
        }
    };
    let mut total = GroupInfo::default();
    for stream in streams {
        let info = match redis.xinfo_groups::<Value, _>(stream).await {
            Ok(reply) => find_group(reply, &keys.group(queue)),
            // No stream yet: nothing was ever relayed to it.
            Err(e) if e.details().contains("no such key") => GroupInfo::default(),
            Err(e) => {
                let error = crate::redact::redact(&e.to_string());
                tracing::warn!(queue, %error, "Could not read the queue's consumer group from Redis");
                return GroupInfo::default();
            }
        };
        total = total.plus(info);
    }
    total
}

impl GroupInfo {
    /// Two streams' figures together: counts add up (unknown stays unknown only when both are), consumers are the
    /// most either has (the same workers read every partition).
    fn plus(self, other: GroupInfo) -> GroupInfo {
        let add = |a: Option<u64>, b: Option<u64>| match (a, b) {
            (None, None) => None,
            (a, b) => Some(a.unwrap_or(0) + b.unwrap_or(0)),
        };
        GroupInfo {
            lag: add(self.lag, other.lag),
            pending: add(self.pending, other.pending),
            consumers: self.consumers.max(other.consumers),
        }
    }
}

/// The entry of `group` in an `XINFO GROUPS` reply (an array of maps, or of flat arrays under RESP2).
fn find_group(reply: Value, group: &str) -> GroupInfo {
    let Value::Array(groups) = reply else { return GroupInfo::default() };
    for entry in groups {
        let Ok(map) = entry.into_map() else { continue };
        let fields: HashMap<String, Value> =
            map.inner().into_iter().filter_map(|(k, v)| Some((k.as_str()?.to_owned(), v))).collect();
        if fields.get("name").and_then(Value::as_string).as_deref() != Some(group) {
            continue;
        }
        let number = |name: &str| fields.get(name).and_then(Value::as_u64);
        // `lag` is null when Redis cannot tell (entries deleted after the group's last delivery), and absent before
        // Redis 7.
        return GroupInfo { lag: number("lag"), pending: number("pending"), consumers: number("consumers") };
    }
    GroupInfo::default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(name: &str, lag: Value) -> Value {
        Value::Array(vec![
            "name".into(),
            name.into(),
            "consumers".into(),
            Value::Integer(2),
            "pending".into(),
            Value::Integer(16),
            "last-delivered-id".into(),
            "1-0".into(),
            "lag".into(),
            lag,
        ])
    }

    #[test]
    fn the_queues_group_is_found_and_a_null_lag_stays_unknown() {
        let reply = Value::Array(vec![group("other", Value::Integer(1)), group("p:q:workers", Value::Integer(40))]);
        assert_eq!(
            find_group(reply, "p:q:workers"),
            GroupInfo { lag: Some(40), pending: Some(16), consumers: Some(2) }
        );
        let reply = Value::Array(vec![group("p:q:workers", Value::Null)]);
        assert_eq!(find_group(reply, "p:q:workers").lag, None);
        assert_eq!(find_group(Value::Array(vec![]), "p:q:workers"), GroupInfo::default());
        assert_eq!(find_group(Value::Null, "p:q:workers"), GroupInfo::default());
    }

    #[test]
    fn partitions_add_up() {
        let a = GroupInfo { lag: Some(3), pending: Some(16), consumers: Some(2) };
        let b = GroupInfo { lag: None, pending: Some(4), consumers: Some(3) };
        assert_eq!(a.plus(b), GroupInfo { lag: Some(3), pending: Some(20), consumers: Some(3) });
        assert_eq!(GroupInfo::default().plus(GroupInfo::default()), GroupInfo::default());
    }
}
