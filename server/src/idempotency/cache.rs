//! Completed records kept in memory, so that a replay is answered without PostgreSQL.
//!
//! A completed record never changes while it lives: it is written in the transaction that did the work, and only a
//! record past its `expires_at` is replaced or deleted. So a copy of it is as good as the row until then, and this
//! process keeps one for each record it completed or replayed, until the record expires or ten minutes pass,
//! whichever is first, within a budget in bytes (`CONVEYOR_IDEMPOTENCY_REPLAY_CACHE`; past it, quick_cache's S3-FIFO
//! evicts the copies seen once before those replayed). Each API replica keeps its own; a replica that holds no copy
//! reads the row, as before. A copy holds its reply's body serialized, as it is sent: what it weighs is what it holds.
//!
//! What stays in PostgreSQL's hands: every request that is not the replay of a record this process holds (first uses,
//! mismatches of a record it does not hold, duplicates in progress). A copy is made only after the commit that
//! wrote the record, or from a row read, never from a transaction that may still roll back.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use prometheus::IntGauge;
use quick_cache::Weighter;
use quick_cache::sync::Cache;

use super::fingerprint::{Fingerprint, Fingerprinter};
use super::store::{Scope, StoredResponse};

/// The longest a copy is kept, however long its record lives: clients replay within minutes of their first try, and
/// a short life bounds what a record edited by hand (an operator's repair) can disagree with.
const MAX_AGE: Duration = Duration::from_secs(600);

/// Copies of completed records, by scope; empty and inert with a budget of 0.
pub struct ReplayCache {
    copies: Option<Cache<Scope, Arc<Kept>, ByBytes>>,
    /// Shows what the copies weigh, after each change.
    weight: Option<IntGauge>,
}

/// A completed record as kept: its fingerprint, its reply as a replay sends it, until when it may answer, and what it
/// weighs.
pub(crate) struct Kept {
    fingerprint: Fingerprint,
    /// The reply's status.
    pub(crate) status: u16,
    /// The reply's headers (those a replay sends).
    pub(crate) headers: Vec<(String, String)>,
    /// The reply's body, serialized.
    pub(crate) body: Bytes,
    until: Instant,
    bytes: u64,
}

/// What a copy says of a request.
pub(crate) enum Cached {
    /// The same request: answer with the copy's reply.
    Replay(Arc<Kept>),
    /// Another request under the same key.
    Mismatch,
}

#[derive(Clone)]
struct ByBytes;

impl Weighter<Scope, Arc<Kept>> for ByBytes {
    fn weight(&self, _scope: &Scope, copy: &Arc<Kept>) -> u64 {
        copy.bytes
    }
}

/// What a copy weighs beside its body and headers: the key, the fingerprint, the entry's bookkeeping.
const OVERHEAD: u64 = 256;

impl ReplayCache {
    /// A cache of at most `budget` bytes of copies (0: none).
    pub fn new(budget: u64) -> Self {
        // quick_cache sizes its table from an estimate of the items: a reply is a few hundred bytes.
        let copies = (budget > 0).then(|| Cache::with_weighter((budget / 1024).max(16) as usize, budget, ByBytes));
        Self { copies, weight: None }
    }

    /// Shows what its copies weigh in `gauge`.
    pub fn weighed_in(mut self, gauge: IntGauge) -> Self {
        gauge.set(0);
        self.weight = Some(gauge);
        self
    }

    fn weighed(&self) {
        if let Some(gauge) = &self.weight {
            gauge.set(self.size().1 as i64);
        }
    }

    /// What the copy of `scope`'s record, if this process holds a live one, says of the request `canonical`.
    pub(crate) fn judge(&self, scope: &Scope, fingerprinter: &Fingerprinter, canonical: &str) -> Option<Cached> {
        let cache = self.copies.as_ref()?;
        let copy = cache.get(scope)?;
        let now = Instant::now();
        if copy.until <= now {
            // Unless another request has kept a copy of a newer record meanwhile.
            cache.remove_if(scope, |c| c.until <= now);
            self.weighed();
            return None;
        }
        Some(if fingerprinter.matches(&copy.fingerprint, canonical) { Cached::Replay(copy) } else { Cached::Mismatch })
    }

    /// Keeps a copy of `scope`'s completed record, made with `fingerprint` and answered with `response` (as a replay
    /// sends it: [`StoredResponse::replayable`]), until `expires` (the record's expiry, as this process's clock sees
    /// it: no later than the row's) or [`MAX_AGE`] from now.
    pub(crate) fn remember(&self, scope: &Scope, fingerprint: Fingerprint, response: StoredResponse, expires: Instant) {
        let Some(cache) = &self.copies else { return };
        let until = expires.min(Instant::now() + MAX_AGE);
        if until <= Instant::now() {
            return;
        }
        let body = Bytes::from(serde_json::to_vec(&response.body).expect("a JSON value serializes"));
        let headers: usize = response.headers.iter().map(|(n, v)| n.len() + v.len()).sum();
        let bytes = (scope.path.len() + fingerprint.mac.len() + headers + body.len()) as u64 + OVERHEAD;
        let (status, headers) = (response.status, response.headers);
        cache.insert(scope.clone(), Arc::new(Kept { fingerprint, status, headers, body, until, bytes }));
        self.weighed();
    }

    /// The copies held and what they weigh, in bytes.
    fn size(&self) -> (usize, u64) {
        self.copies.as_ref().map_or((0, 0), |c| (c.len(), c.weight()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::FingerprintKey;
    use crate::idempotency::IdempotencyKey;
    use conveyor_jobs::{UserId, WorkspaceId};
    use uuid::Uuid;

    fn scope() -> Scope {
        Scope {
            workspace_id: WorkspaceId(Uuid::new_v4()),
            user_id: UserId(Uuid::new_v4()),
            method: "POST".into(),
            path: "/v1/stores".into(),
            key: IdempotencyKey(Uuid::new_v4()),
        }
    }

    fn fingerprinter() -> Fingerprinter {
        Fingerprinter::new(vec![FingerprintKey { id: "k1".into(), secret: crate::config::Secret::new(b"s".to_vec()) }])
    }

    fn reply(body: serde_json::Value) -> StoredResponse {
        StoredResponse { status: 202, headers: vec![("location".into(), "/v1/operations/x".into())], body }
    }

    #[test]
    fn a_copy_answers_its_own_request_and_refuses_another_under_its_key_alone() {
        let (cache, f, s) = (ReplayCache::new(1 << 20), fingerprinter(), scope());
        assert!(cache.judge(&s, &f, "request").is_none(), "nothing kept yet");
        cache.remember(&s, f.sign("request"), reply(serde_json::json!({"id": 1})), Instant::now() + MAX_AGE);
        match cache.judge(&s, &f, "request") {
            Some(Cached::Replay(copy)) => {
                assert_eq!((copy.status, &*copy.body), (202, &br#"{"id":1}"#[..]));
                assert_eq!(copy.headers, reply(serde_json::Value::Null).headers);
            }
            _ => panic!("the same request replays"),
        }
        assert!(matches!(cache.judge(&s, &f, "another"), Some(Cached::Mismatch)));
        let other = Scope { user_id: UserId(Uuid::new_v4()), ..s.clone() };
        assert!(cache.judge(&other, &f, "request").is_none(), "another user's key is another record");
    }

    #[test]
    fn a_copy_lives_no_longer_than_its_record_and_none_is_kept_without_a_budget() {
        let (f, s) = (fingerprinter(), scope());
        let cache = ReplayCache::new(1 << 20);
        cache.remember(&s, f.sign("request"), reply(serde_json::Value::Null), Instant::now());
        assert!(cache.judge(&s, &f, "request").is_none(), "an expired record is not kept");
        cache.remember(
            &s,
            f.sign("request"),
            reply(serde_json::Value::Null),
            Instant::now() + Duration::from_millis(30),
        );
        assert!(cache.judge(&s, &f, "request").is_some());
        std::thread::sleep(Duration::from_millis(40));
        assert!(cache.judge(&s, &f, "request").is_none(), "past its record's expiry the copy is gone");
        assert_eq!(cache.size().0, 0);
        let off = ReplayCache::new(0);
        off.remember(&s, f.sign("request"), reply(serde_json::Value::Null), Instant::now() + MAX_AGE);
        assert!(off.judge(&s, &f, "request").is_none());
    }

    #[test]
    fn copies_stay_within_their_budget_in_bytes() {
        let (f, cache) = (fingerprinter(), ReplayCache::new(64 * 1024));
        let body = serde_json::json!({"name": "x".repeat(1000)});
        for _ in 0..1000 {
            cache.remember(&scope(), f.sign("r"), reply(body.clone()), Instant::now() + MAX_AGE);
        }
        let (copies, bytes) = cache.size();
        assert!(bytes <= 64 * 1024, "{bytes} bytes held");
        assert!(copies > 10 && copies < 1000, "{copies} copies held of a thousand of over 1 KiB each");
    }
}
