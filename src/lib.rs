//! Conveyor: idempotent write requests, a transactional outbox relayed into Redis Streams, and Rust workers.
//!
//! ```text
//! client ──HTTP──▶ http ── one PostgreSQL transaction (db::begin_workspace sets app.workspace_id for RLS) ──┐
//!                  auth      domain::* writes the resource, operations::create_tx the user-visible operation, │
//!                             outbox::enqueue_tx the pending event (+ pg_notify) ── COMMIT ──────────────────┘
//! dispatcher ◀── LISTEN/NOTIFY + polling: claims due events per workspace (SKIP LOCKED, leased),
//!                XADDs them through stream (de-duplicated by event id), marks them dispatched (fenced)
//! worker ◀────── XREADGROUP: runs the handler in a workspace transaction, XACKs after commit,
//!                retries with back-off, reclaims dead consumers' entries, dead-letters what keeps failing
//! maintenance ── retention of outbox and idempotency rows; re-drives work Redis lost
//! ```
//!
//! Modules: [`config`] (typed environment), [`db`] (pool, RLS-scoped transactions), [`auth`] (JWT),
//! [`http`] (axum: router, errors, extractors), [`domain`] (business scenarios), [`operations`],
//! [`outbox`], [`stream`] (the only Redis code), [`sealing`] (credentials at rest), [`metrics`],
//! [`migrate`], [`app`] (roles and shutdown).

pub mod adapters;
pub mod app;
pub mod auth;
pub mod backoff;
pub mod config;
pub mod db;
pub mod dispatcher;
pub mod domain;
pub mod http;
pub mod idempotency;
pub mod ids;
pub mod jobs;
pub mod maintenance;
pub mod metrics;
pub mod migrate;
pub mod operations;
pub mod outbox;
pub mod redact;
pub mod sealing;
pub mod stream;
pub mod telemetry;
pub mod worker;
