//! Rust workers: a runtime that other services can embed (see [`Worker::builder`]), the handler contract, and
//! the dead-letter tools.
//!
//! Delivery is at least once; effects are exactly once because the runtime skips jobs whose operation has finished,
//! serializes runs of one job id with an advisory lock, commits the handler's writes with the operation's outcome in
//! one transaction and acknowledges only after that commit, and handlers pass the operation id to external systems
//! as their idempotency token. Retries go back through the outbox (PostgreSQL holds the back-off), so a Redis that
//! forgets everything forgets no retry.

pub mod dlq;
pub mod handler;
pub mod record;
pub mod runtime;

pub use handler::{Handler, Job, JobError};
pub use runtime::{Outcome, Worker, WorkerBuilder, WorkerSettings};
