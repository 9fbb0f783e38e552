//! `listing.publish`: creates a listing's product on its store's marketplace, once, and records the product's id.

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::adapters::marketplace::{Marketplace, MarketplaceError};
use crate::domain::listings::{self, PublishJobError};
use crate::sealing::Sealer;
use conveyor_jobs::{Handler, JobContext, JobError, JobKind};

/// Publish a listing (the first time, or again after a publication that ended without success). Ids only: the worker reads the listing and the store's sealed credentials
/// inside the job's workspace transaction.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PublishListing {
    /// The listing.
    pub listing_id: Uuid,
}

impl JobKind for PublishListing {
    const KIND: &'static str = "listing.publish";
    const QUEUE: &'static str = "listings";
}

/// Runs [`PublishListing`] jobs.
pub struct PublishListingHandler {
    /// Opens the store's sealed credentials.
    pub sealer: Sealer,
    /// The marketplace adapter.
    pub marketplace: Arc<dyn Marketplace>,
    /// Runs before dead-lettering (`CONVEYOR_JOB_MAX_ATTEMPTS`).
    pub max_attempts: u32,
    /// Longest run (`CONVEYOR_JOB_TIMEOUT`).
    pub timeout: Duration,
}

impl Handler<PublishListing> for PublishListingHandler {
    async fn handle(&self, job: PublishListing, cx: &mut JobContext) -> Result<serde_json::Value, JobError> {
        // The marketplace's idempotency key is the listing's publication key (its first publication's operation id), so
        // however often this job runs, and whichever publication of the listing runs it, one product is made.
        let operation_id = cx.operation_id();
        let workspace_id = cx.workspace_id().0;
        let canceled = cx.cancellation().clone();
        let publishing = listings::publish_to_marketplace_tx(
            cx.tx().await?,
            &self.sealer,
            self.marketplace.as_ref(),
            workspace_id,
            job.listing_id,
            operation_id,
        );
        // A canceled job stops waiting for the marketplace; its writes roll back. A product the marketplace made
        // meanwhile is the one a later publication of the listing (same key) gets back and records.
        let outcome = tokio::select! {
            published = publishing => published,
            _ = canceled.cancelled() => return Err(JobError::Canceled),
        }
        .map_err(|e| match e {
            PublishJobError::Marketplace(MarketplaceError::Transient(m)) => JobError::Retryable(m),
            // The marketplace said when this store may call again: the store's jobs (one limit key) wait until then,
            // without spending an attempt; other stores go on.
            PublishJobError::Marketplace(MarketplaceError::RetryAfter { reason, after }) => JobError::rate_limited(
                reason,
                chrono::Utc::now() + chrono::Duration::from_std(after).unwrap_or(chrono::Duration::MAX),
            ),
            PublishJobError::Marketplace(MarketplaceError::Permanent(m)) => {
                JobError::Permanent(format!("the marketplace refused the product: {m}"))
            }
            PublishJobError::Database(e) => JobError::from(e),
            other => JobError::Permanent(other.to_string()),
        })?;
        Ok(serde_json::to_value(outcome).expect("outcomes serialize"))
    }

    fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_payload_round_trips_and_refuses_what_it_does_not_know() {
        let job = PublishListing { listing_id: Uuid::now_v7() };
        let text = serde_json::to_string(&job).unwrap();
        assert_eq!(serde_json::from_str::<PublishListing>(&text).unwrap(), job);
        assert!(serde_json::from_str::<PublishListing>(r#"{"listing_id":"x"}"#).is_err());
        let extra = format!(r#"{{"listing_id":"{}","title":"t"}}"#, job.listing_id);
        assert!(serde_json::from_str::<PublishListing>(&extra).is_err());
    }
}
