//! Rust workers: a runtime that other services embed (see [`Worker::builder`]), the typed handler contract, and
//! the dead-letter tools.
//!
//! Delivery is at least once; effects are exactly once because the runtime skips jobs that ended, serializes runs of
//! one job id with an advisory lock, commits the handler's writes with the job's outcome (and its operation's) in one
//! transaction and acknowledges only after that commit, and handlers pass [`JobContext::idempotency_token`] to
//! external systems. Retries go back through the outbox (PostgreSQL holds the back-off), so a Redis that forgets
//! everything forgets no retry.
//!
//! A running worker has three roles, one value and one file each, each owning what it works with: the `Reader`
//! (`reader.rs`: read entries, take over dead consumers' entries, start jobs), the `Executor` (`execute.rs`: one job
//! to its outcome, every ending it records through the completion funnel, `transitions::end_run`, or its batched
//! form `complete_many`, which the acker calls for jobs that had no transaction), the `Acker` (`acker.rs`:
//! acknowledge, heartbeat, hear cancellations). `runtime.rs` builds them and says what they share.

mod acker;
pub(crate) mod dlq;
mod execute;
pub(crate) mod handler;
mod listeners;
mod reader;
pub(crate) mod runtime;
mod slots;

pub use handler::{Handler, JobContext, JobError};
pub use runtime::{Outcome, Worker, WorkerBuilder, WorkerSettings};
