//! First-batch business scenarios (seed section 5). Domain code knows PostgreSQL transactions, not HTTP or Redis.

pub mod ai_tasks;
pub mod asset_transfers;
pub mod catalog;
pub mod listings;
pub mod media;
pub mod product_drafts;
pub mod stores;
pub mod whole_number;

/// A domain rule was broken by the input; the message is safe to show the client.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ValidationError(pub String);
