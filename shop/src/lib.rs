//! Conveyor's first product, built on the [`conveyor_jobs`] platform's public API: the e-commerce scenarios of a
//! multi-tenant SaaS backend that manages stores and publishes marketplace listings.
//!
//! ```text
//! domain    stores, media, listings, product drafts, catalog sync, asset transfers, AI tasks: each write that
//!           starts work writes its rows, an operation and a job in one workspace transaction
//! jobs      the handlers of those jobs (conveyor_jobs::Handler), run by the platform's workers
//! adapters  the external systems (marketplace, catalog, AI provider, the asset fetcher), with sandbox
//!           implementations over real HTTP
//! storage   the object store of media and transferred assets; sealing: store credentials encrypted at rest
//! ```

pub mod adapters;
pub mod domain;
pub mod jobs;
pub mod metrics;
pub mod migrate;
pub mod sealing;
pub mod storage;

use conveyor_jobs::{UserId, WorkspaceId};

/// Who is calling.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Principal {
    /// The caller's workspace.
    pub workspace_id: WorkspaceId,
    /// The caller.
    pub user_id: UserId,
}
