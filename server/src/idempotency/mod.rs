//! Idempotent write requests (seed section 2; CONTRACT.md §2.1).
//!
//! A client sends `Idempotency-Key: <uuid>` with a write. Inside the business transaction the server claims the key
//! for its scope (workspace, user, method, normalized path, key):
//!
//! - a completed record with the same fingerprint replays the stored status, allow-listed headers and body;
//! - a record with a different fingerprint is `409 IDEMPOTENCY_KEY_REUSED`;
//! - a transaction still holding the key (a transaction-scoped advisory lock) is `409
//!   IDEMPOTENCY_REQUEST_IN_PROGRESS`, answered at once rather than after waiting for that transaction;
//! - otherwise the request executes, and the record is completed with the response in the same transaction. A
//!   rollback takes the record with it, so a key never sticks "in progress" and a retry executes afresh.
//!
//! What is stored: the scope, an HMAC-SHA256 fingerprint of the canonical request and the id of the key that made
//! it, the response status, allow-listed headers and the (secret-free) response body. The request body itself is
//! stored nowhere. Records live `CONVEYOR_IDEMPOTENCY_TTL` (48 hours by default, never less than 24), are treated
//! as absent once expired, and are deleted by the maintenance role in bounded batches. Each API process keeps copies
//! of the completed records it wrote or replayed for a while ([`cache`]), and answers their replays from memory.

pub mod cache;
pub mod cleanup;
pub mod fingerprint;
pub mod key;
pub mod store;

pub use cache::ReplayCache;
pub use fingerprint::{Fingerprint, Fingerprinter};
pub use key::IdempotencyKey;
pub use store::{Claim, Completed, Scope, StoredResponse};
