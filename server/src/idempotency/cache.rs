//! Completed records kept in memory, so that a replay is answered without PostgreSQL.
//!
//! A completed record never changes while it lives: it is written in the transaction that did the work, and only a
//! record past its `expires_at` is replaced or deleted. So a copy of it is as good as the row until then, and this
//! process keeps one for each record it completed or replayed, until the record expires or [`MAX_AGE`] passes,
//! whichever is first, within a budget in bytes (`CONVEYOR_IDEMPOTENCY_REPLAY_CACHE`, least recently used first out,
//! as S3-FIFO picks it). Each API replica keeps its own; a replica that holds no copy reads the row, as before.
//!
//! What stays in PostgreSQL's hands: every request that is not the replay of a record this process holds (first uses,
//! mismatches of a record it does not hold, duplicates in progress). A copy is made only after the commit that
//! wrote the record, or from a row read, never from a transaction that may still roll back.

use std::sync::Arc;
use std::time::{Duration, Instant};

use quick_cache::Weighter;
use quick_cache::sync::Cache;

use super::fingerprint::{Fingerprint, Fingerprinter};
use super::store::{Scope, StoredResponse};

/// The longest a copy is kept, however long its record lives: clients replay within minutes of their first try, and
/// a short life bounds what a record edited by hand (an operator's repair) can disagree with.
pub const MAX_AGE: Duration = Duration::from_secs(600);

/// Copies of completed records, by scope; empty and inert with a budget of 0.
pub struct ReplayCache(Option<Cache<Scope, Arc<Copy>, ByBytes>>);

/// A completed record as kept: its fingerprint, its reply, until when it may answer, and what it weighs.
pub struct Copy {
    fingerprint: Fingerprint,
    /// The reply, as a replay sends it.
    pub response: StoredResponse,
    until: Instant,
    bytes: u64,
}

/// What a copy says of a request.
pub enum Cached {
    /// The same request: answer with the copy's reply.
    Replay(Arc<Copy>),
    /// Another request under the same key.
    Mismatch,
}

#[derive(Clone)]
struct ByBytes;

impl Weighter<Scope, Arc<Copy>> for ByBytes {
    fn weight(&self, _scope: &Scope, copy: &Arc<Copy>) -> u64 {
        copy.bytes
    }
}

/// What a copy weighs beside its body and headers: the key, the fingerprint, the entry's bookkeeping.
const OVERHEAD: u64 = 256;

impl ReplayCache {
    /// A cache of at most `budget` bytes of copies (0: none).
    pub fn new(budget: u64) -> Self {
        // quick_cache sizes its table from an estimate of the items: a reply is a few hundred bytes.
        Self((budget > 0).then(|| Cache::with_weighter((budget / 1024).max(16) as usize, budget, ByBytes)))
    }

    /// What the copy of `scope`'s record, if this process holds a live one, says of the request `canonical`.
    pub fn judge(&self, scope: &Scope, fingerprinter: &Fingerprinter, canonical: &str) -> Option<Cached> {
        let cache = self.0.as_ref()?;
        let copy = cache.get(scope)?;
        if copy.until <= Instant::now() {
            cache.remove(scope);
            return None;
        }
        Some(if fingerprinter.matches(&copy.fingerprint, canonical) { Cached::Replay(copy) } else { Cached::Mismatch })
    }

    /// Keeps a copy of `scope`'s completed record, made with `fingerprint` and answered with `response`, until
    /// `expires` (the record's expiry, as this process's clock sees it: no later than the row's) or [`MAX_AGE`] from
    /// now.
    pub fn remember(&self, scope: &Scope, fingerprint: Fingerprint, response: StoredResponse, expires: Instant) {
        let Some(cache) = &self.0 else { return };
        let until = expires.min(Instant::now() + MAX_AGE);
        if until <= Instant::now() {
            return;
        }
        let headers: usize = response.headers.iter().map(|(n, v)| n.len() + v.len()).sum();
        let body = serde_json::to_vec(&response.body).map_or(0, |b| b.len());
        let bytes = (scope.path.len() + fingerprint.mac.len() + headers + body) as u64 + OVERHEAD;
        cache.insert(scope.clone(), Arc::new(Copy { fingerprint, response, until, bytes }));
    }

    /// The copies held and what they weigh, in bytes.
    pub fn size(&self) -> (usize, u64) {
        self.0.as_ref().map_or((0, 0), |c| (c.len(), c.weight()))
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
            Some(Cached::Replay(copy)) => assert_eq!(copy.response, reply(serde_json::json!({"id": 1}))),
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
