//! Names of every Redis key Conveyor uses (CONTRACT.md §3), in one place.

/// Key names under one prefix (`conveyor` by default; tests use a unique one each).
#[derive(Clone, Debug)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    /// Keys under `prefix`.
    pub fn new(prefix: &str) -> Self {
        Self { prefix: prefix.to_owned() }
    }

    /// The stream of `queue`: `<prefix>:{<queue>}:stream`.
    pub fn stream(&self, queue: &str) -> String {
        format!("{}:{{{queue}}}:stream", self.prefix)
    }

    /// The de-dup key of one delivery of an event, in the same slot as its queue's stream. The re-drive counter is
    /// part of the key so that a reconciler's re-drive gets past an earlier delivery's key.
    pub fn dedup(&self, queue: &str, event_id: &uuid::Uuid, redrive: i32) -> String {
        format!("{}:{{{queue}}}:dedup:{event_id}:{redrive}", self.prefix)
    }

    /// The consumer group of `queue`.
    pub fn group(&self, queue: &str) -> String {
        format!("{}:{queue}:workers", self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_and_dedup_keys_share_the_queue_hash_tag() {
        let keys = Keys::new("conveyor");
        let id = uuid::Uuid::nil();
        assert_eq!(keys.stream("stores"), "conveyor:{stores}:stream");
        assert!(keys.dedup("stores", &id, 0).starts_with("conveyor:{stores}:"));
        assert_ne!(keys.dedup("stores", &id, 0), keys.dedup("stores", &id, 1));
    }
}
