//! Names of every Redis key Conveyor uses (CONTRACT.md §3), in one place.
//!
//! A queue's stream is `<prefix>:{<queue>}:stream`. Split into partitions (`CONVEYOR_STREAM_PARTITIONS`), partition
//! `p` is `<prefix>:{<queue>:<p>}:stream`: each has a hash tag, so a slot, of its own, and a hot queue spreads over
//! the masters of a Redis Cluster. A job's de-dup key carries its stream's tag (the publish script touches both).

use uuid::Uuid;

/// Key names under one prefix (`conveyor` by default; tests use a unique one each).
#[derive(Clone, Debug)]
pub struct Keys {
    prefix: String,
}

/// Which stream of a queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Partition {
    /// The queue's own stream, `<prefix>:{<queue>}:stream`: the only one of a queue with one partition, and the
    /// stream of every job relayed before the queue was split.
    Whole,
    /// Partition `p`: `<prefix>:{<queue>:<p>}:stream`.
    Part(u16),
}

impl Keys {
    /// Keys under `prefix`.
    pub fn new(prefix: &str) -> Self {
        Self { prefix: prefix.to_owned() }
    }

    fn tag(queue: &str, partition: Partition) -> String {
        match partition {
            Partition::Whole => format!("{{{queue}}}"),
            Partition::Part(p) => format!("{{{queue}:{p}}}"),
        }
    }

    /// The (whole) stream of `queue`: `<prefix>:{<queue>}:stream`.
    pub fn stream(&self, queue: &str) -> String {
        self.partition_stream(queue, Partition::Whole)
    }

    /// One stream of `queue`: its whole stream or one partition's.
    pub fn partition_stream(&self, queue: &str, partition: Partition) -> String {
        format!("{}:{}:stream", self.prefix, Self::tag(queue, partition))
    }

    /// The de-dup key of one delivery of an event into the whole stream of `queue`, in the same slot as the stream.
    /// The re-drive counter is part of the key so that a reconciler's re-drive gets past an earlier delivery's key.
    pub fn dedup(&self, queue: &str, event_id: &Uuid, redrive: i32) -> String {
        self.partition_dedup(queue, Partition::Whole, event_id, redrive)
    }

    /// The de-dup key of one delivery of an event into one stream of `queue`, in that stream's slot.
    pub(crate) fn partition_dedup(&self, queue: &str, partition: Partition, event_id: &Uuid, redrive: i32) -> String {
        format!("{}:{}:dedup:{event_id}:{redrive}", self.prefix, Self::tag(queue, partition))
    }

    /// The consumer group of `queue` (the same name in each of its streams; not a key).
    pub fn group(&self, queue: &str) -> String {
        format!("{}:{queue}:workers", self.prefix)
    }

    /// The partition layout's history (see `stream::layout`).
    pub fn layout(&self) -> String {
        format!("{}:layout", self.prefix)
    }
}

/// How a job row records where its entry is (`outbox_events.stream_id`): the entry id alone in a whole stream (as
/// before partitions), `<p>/<entry id>` in partition `p` (entry ids of different streams may be equal).
pub(crate) fn stream_ref(partition: Partition, entry_id: &str) -> String {
    match partition {
        Partition::Whole => entry_id.to_owned(),
        Partition::Part(p) => format!("{p}/{entry_id}"),
    }
}

/// The stream and entry id a [`stream_ref`] names.
pub(crate) fn parse_stream_ref(reference: &str) -> (Partition, &str) {
    match reference.split_once('/') {
        Some((p, id)) => match p.parse() {
            Ok(p) => (Partition::Part(p), id),
            Err(_) => (Partition::Whole, reference),
        },
        None => (Partition::Whole, reference),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_and_dedup_keys_share_the_queue_hash_tag() {
        let keys = Keys::new("conveyor");
        let id = Uuid::nil();
        assert_eq!(keys.stream("stores"), "conveyor:{stores}:stream");
        assert!(keys.dedup("stores", &id, 0).starts_with("conveyor:{stores}:"));
        assert_ne!(keys.dedup("stores", &id, 0), keys.dedup("stores", &id, 1));
    }

    #[test]
    fn each_partition_has_a_tag_of_its_own_shared_with_its_dedup_keys() {
        let keys = Keys::new("conveyor");
        let id = Uuid::nil();
        assert_eq!(keys.partition_stream("stores", Partition::Whole), keys.stream("stores"));
        assert_eq!(keys.partition_stream("stores", Partition::Part(3)), "conveyor:{stores:3}:stream");
        assert!(keys.partition_dedup("stores", Partition::Part(3), &id, 0).starts_with("conveyor:{stores:3}:dedup:"));
        assert_eq!(keys.group("stores"), "conveyor:stores:workers");
    }

    #[test]
    fn a_stream_reference_names_its_partition_and_a_whole_streams_is_the_bare_entry_id() {
        assert_eq!(stream_ref(Partition::Whole, "1-0"), "1-0");
        assert_eq!(stream_ref(Partition::Part(2), "1-0"), "2/1-0");
        for (partition, id) in [(Partition::Whole, "17-3"), (Partition::Part(0), "17-3"), (Partition::Part(9), "5-0")] {
            assert_eq!(parse_stream_ref(&stream_ref(partition, id)), (partition, id));
        }
    }
}
