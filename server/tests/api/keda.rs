//! The numbers the Helm chart's KEDA `ScaledObject` can scale the workers on, as Redis reports them for one stream:
//! its length (`XLEN`, the triggers' `streamLength`, the chart's default), the consumer group's `lag` (`XINFO GROUPS`,
//! Redis 7+; `lagCount`) and its pending entries (`pendingEntriesCount`, never used).
//!
//! A worker reads only as many entries as it has free slots (`XREADGROUP ... COUNT <free slots>`), so the pending
//! entries list of a queue never holds more than the workers' total concurrency, however large the backlog: a
//! `pendingEntriesCount` trigger asks for ceil(16N / target) replicas when N replicas are full, which is never more
//! than N for a target above 16. The lag counts the entries not yet delivered to anyone, the backlog itself, but only
//! that: once the workers keep up it is 0 while they are busy, and a lag trigger lets the HPA scale them down until a
//! backlog builds again. Workers delete the entries they acknowledge, so `XLEN` is the backlog plus the jobs running:
//! the work in hand, which stays while the workers keep up.

use crate::common;

use std::time::Duration;

use conveyor_jobs::Consumer;
use conveyor_jobs::RedisClient;
use conveyor_jobs::{Partition, RedisKeys};
use conveyor_jobs::{Producer, StreamJobOptions as JobOptions, StreamMessage as Message};
use fred::prelude::{KeysInterface, StreamsInterface};
use fred::types::Value;
use uuid::Uuid;

const QUEUE: &str = "stores";
/// Jobs one worker runs at once (`CONVEYOR_WORKER_CONCURRENCY`'s default).
const CONCURRENCY: u64 = 16;

/// What `XINFO GROUPS` and `XPENDING` say about the worker group.
#[derive(Debug, PartialEq, Eq)]
struct Group {
    /// `lag`: entries not yet delivered (`None` when Redis cannot tell).
    lag: Option<i64>,
    /// `XPENDING`'s count: delivered, not yet acknowledged.
    pending: i64,
}

/// The field-value pairs of one `XINFO GROUPS` entry (a RESP2 array or a RESP3 map).
fn pairs(group: Value) -> Vec<(String, Value)> {
    match group {
        Value::Array(items) => {
            items.chunks(2).map(|kv| (kv[0].as_string().expect("a field name"), kv[1].clone())).collect()
        }
        Value::Map(map) => {
            map.inner().into_iter().map(|(k, v)| (k.as_str().expect("a field name").to_owned(), v)).collect()
        }
        other => panic!("a group of XINFO GROUPS is {other:?}"),
    }
}

async fn group(client: &RedisClient, keys: &RedisKeys) -> Group {
    let name = keys.group(QUEUE);
    let groups: Value = client.xinfo_groups(keys.stream(QUEUE)).await.expect("XINFO GROUPS");
    let Value::Array(groups) = groups else { panic!("XINFO GROUPS answered {groups:?}") };
    let fields = groups
        .into_iter()
        .map(pairs)
        .find(|fields| fields.iter().any(|(k, v)| k == "name" && v.as_string().as_deref() == Some(name.as_str())))
        .expect("the worker group exists");
    let lag = match fields.into_iter().find(|(k, _)| k == "lag").expect("Redis 7 reports the lag").1 {
        Value::Null => None,
        v => Some(v.as_i64().expect("an integer lag")),
    };
    let summary: Value = client.xpending(keys.stream(QUEUE), name, ()).await.expect("XPENDING");
    let Value::Array(summary) = summary else { panic!("XPENDING answered {summary:?}") };
    Group { lag, pending: summary[0].as_i64().expect("XPENDING's count") }
}

/// `XLEN` of the queue's stream: what a `streamLength` trigger reads.
async fn xlen(client: &RedisClient, keys: &RedisKeys) -> i64 {
    client.xlen(keys.stream(QUEUE)).await.expect("XLEN")
}

/// Publishes `n` jobs the way the relay does (de-duplicated `XADD`s through the publish script).
async fn publish(producer: &Producer, n: usize) {
    let workspace_id = Uuid::new_v4();
    let messages: Vec<Message> = (0..n)
        .map(|_| Message {
            queue: QUEUE.to_owned(),
            event_id: Uuid::new_v4(),
            workspace_id,
            event_type: "store.verify_credentials".to_owned(),
            payload: r#"{"store_id":"00000000-0000-0000-0000-000000000000"}"#.to_owned(),
            operation_id: None,
            attempt: 1,
            enqueued_at_ms: 0,
            due_at_ms: None,
            traceparent: String::new(),
            tracestate: None,
            redrive: 0,
            class: String::new(),
            options: JobOptions::default(),
        })
        .collect();
    for published in producer.publish(&messages).await {
        published.expect("XADD");
    }
}

#[tokio::test]
async fn group_lag_grows_with_the_backlog_while_pending_entries_stay_capped_at_the_concurrency() {
    let keys = RedisKeys::new(&format!("conveyor-test-{}", Uuid::new_v4().simple()));
    let url = common::redis_url();
    let client = common::redis_client(&url).await;
    // De-dup keys outlive the test by a minute at most.
    let producer = Producer::new(client.clone(), keys.clone(), Duration::from_secs(60));
    let worker = Consumer::new(client.clone(), common::redis_client(&url).await, keys.clone(), "keda-test".to_owned());
    worker.ensure_group(QUEUE).await.unwrap();

    publish(&producer, 1000).await;
    // The worker's read: as many entries as it has free slots, all of them here.
    let held = worker.read(QUEUE, CONCURRENCY, 100).await.unwrap();
    assert_eq!(held.len() as u64, CONCURRENCY);
    let busy = group(&client, &keys).await;
    assert_eq!(busy, Group { lag: Some(1000 - CONCURRENCY as i64), pending: CONCURRENCY as i64 });
    assert_eq!(xlen(&client, &keys).await, 1000, "XLEN counts the backlog and the jobs running");

    // Full, the worker reads nothing more; the backlog grows by 500. The lag follows, the pending entries do not.
    publish(&producer, 500).await;
    let grown = group(&client, &keys).await;
    assert_eq!(grown, Group { lag: Some(1500 - CONCURRENCY as i64), pending: CONCURRENCY as i64 });
    assert_eq!(xlen(&client, &keys).await, 1500);

    // The worker finishes its jobs (acknowledging deletes them, as the runtime does) and takes the next batch: the lag
    // stays known after the deletions and still measures what waits; the pending entries stay at the concurrency.
    let ids: Vec<String> = held.iter().map(|e| e.id.clone()).collect();
    assert_eq!(worker.ack(QUEUE, &ids).await.unwrap(), CONCURRENCY);
    assert_eq!(worker.read(QUEUE, CONCURRENCY, 100).await.unwrap().len() as u64, CONCURRENCY);
    let next = group(&client, &keys).await;
    assert_eq!(next, Group { lag: Some(1500 - 2 * CONCURRENCY as i64), pending: CONCURRENCY as i64 });
    // The acknowledged entries are gone: XLEN is what waits plus what runs, never what ran.
    assert_eq!(xlen(&client, &keys).await, 1500 - CONCURRENCY as i64);
    // `conveyor_stream_group_lag` (the workers' own gauge, on the dashboard) reads the same number.
    let stats = worker.stats(QUEUE).await.unwrap();
    assert_eq!((stats.lag, stats.pending), (Some(1500 - 2 * CONCURRENCY), CONCURRENCY));

    let _: i64 = client.del(keys.stream(QUEUE)).await.unwrap();
}

#[tokio::test]
async fn once_the_workers_keep_up_the_lag_is_zero_while_the_stream_length_still_counts_the_jobs_running() {
    let keys = RedisKeys::new(&format!("conveyor-test-{}", Uuid::new_v4().simple()));
    let url = common::redis_url();
    let client = common::redis_client(&url).await;
    let producer = Producer::new(client.clone(), keys.clone(), Duration::from_secs(60));
    let worker = Consumer::new(client.clone(), common::redis_client(&url).await, keys.clone(), "keda-test".to_owned());
    worker.ensure_group(QUEUE).await.unwrap();

    // Jobs arrive no faster than the workers take them: each is read at once and runs. Nothing waits, so the lag is
    // 0 (a lagCount trigger asks for no replica at all), while XLEN still counts the 12 jobs running (a streamLength
    // trigger of 12 per replica keeps one replica).
    publish(&producer, 12).await;
    let running = worker.read(QUEUE, CONCURRENCY, 100).await.unwrap();
    assert_eq!(running.len(), 12);
    assert_eq!(group(&client, &keys).await, Group { lag: Some(0), pending: 12 });
    assert_eq!(xlen(&client, &keys).await, 12);

    // The worker is scaled away mid-run: its entries stay pending, delivered to nobody alive. The lag still says 0;
    // XLEN still says 12, and wakes a worker that takes them over.
    drop(worker);
    assert_eq!(group(&client, &keys).await, Group { lag: Some(0), pending: 12 });
    assert_eq!(xlen(&client, &keys).await, 12);

    // Done and acknowledged (deleted): the stream is empty, and KEDA may let the workers go.
    let survivor =
        Consumer::new(client.clone(), common::redis_client(&url).await, keys.clone(), "keda-test-2".to_owned());
    let taken = survivor.reclaim_in(QUEUE, Partition::Whole, 0, 100).await.unwrap();
    assert_eq!(taken.entries.len(), 12);
    let ids: Vec<String> = taken.entries.iter().map(|e| e.id.clone()).collect();
    assert_eq!(survivor.ack(QUEUE, &ids).await.unwrap(), 12);
    assert_eq!(xlen(&client, &keys).await, 0);
    assert_eq!(group(&client, &keys).await.pending, 0);

    let _: i64 = client.del(keys.stream(QUEUE)).await.unwrap();
}
