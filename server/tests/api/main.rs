//! The server's integration tests, one binary (zero2prod's `tests/api/main.rs` shape): the HTTP API, the admin API
//! and UI, the CLI, and the end-to-end scenarios with real `conveyor` processes, PostgreSQL and Redis (a Redis
//! Cluster, Sentinel and TLS-only servers of their own where that is the point). `common` is their harness.

mod common;

mod admin;
mod admin_api;
mod ai_tasks;
mod backend_tls;
mod backlog;
mod cancellation_hints;
mod catalog;
mod cli;
mod cluster;
mod definer;
mod dispatcher;
mod expiry;
mod fairness;
mod flows;
mod global_limits;
mod history;
mod idempotency;
mod keda;
mod library;
mod limits;
mod listings;
mod media;
mod memory_bounds;
mod metrics;
mod migrations;
mod openapi;
mod operations;
mod pg_faults;
mod privileges;
mod product_drafts;
mod rls;
mod s3;
mod schedules;
mod stores;
mod tls;
mod traces;
mod transfers;
mod ui;
mod worker;
