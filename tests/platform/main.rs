//! The platform's integration tests, one binary (`cargo test -p conveyor-jobs --features testing --test platform`),
//! on its public API alone against a real PostgreSQL and Redis: the single-role mode a service adopts with one URL, the
//! in-process [`conveyor_jobs::Conveyor`], its metrics in a host's registry, and the testing helpers. The kit
//! (`tests/kit`) is shared with the benchmarks.

#[path = "../kit/mod.rs"]
mod kit;

mod console;
mod dedup_modes;
mod events;
mod expiry;
mod gate;
mod job_logs;
mod metrics;
mod queue_ops;
mod retention;
mod single_role;
mod testing;
mod trace_context;
mod wake;
