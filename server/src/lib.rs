//! Conveyor's server: the HTTP API of the shop (`/v1`), the admin API (`/admin/v1`) and operator UI, the
//! environment configuration of every role, logging and trace export, and the roles the `conveyor` binary runs
//! (`migrate`, `api`, `dispatcher`, `worker`, `maintenance`, `all`), on [`conveyor_jobs`] and [`conveyor_shop`].

pub mod app;
pub mod auth;
pub mod config;
pub mod http;
pub mod idempotency;
pub mod metrics;
pub mod migrate;
pub mod operator_auth;
pub mod telemetry;
