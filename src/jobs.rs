//! The job handlers Conveyor ships, wiring the worker runtime to the domain and the adapters.

use std::sync::Arc;
use std::time::Duration;

use crate::adapters::marketplace::{Marketplace, MarketplaceError};
use crate::domain::stores::{self, VerifyError};
use crate::outbox::JobPayload;
use crate::sealing::Sealer;
use crate::worker::handler::BoxFuture;
use crate::worker::{Handler, Job, JobError};

/// `store.verify_credentials`: asks the store's marketplace whether its credentials work; the store becomes
/// `active` or `invalid_credentials`.
pub struct VerifyCredentials {
    /// Opens the sealed credentials.
    pub sealer: Sealer,
    /// The marketplace adapter.
    pub marketplace: Arc<dyn Marketplace>,
    /// Runs before dead-lettering.
    pub max_attempts: u32,
    /// Longest run.
    pub timeout: Duration,
}

impl Handler for VerifyCredentials {
    fn handle<'a>(&'a self, job: &'a mut Job) -> BoxFuture<'a, Result<serde_json::Value, JobError>> {
        Box::pin(async move {
            let JobPayload::StoreVerifyCredentials { store_id, credentials_version } = job.payload.clone();
            let token = job.operation_id.unwrap_or(job.event_id).to_string();
            let workspace_id = job.workspace_id.0;
            let outcome = stores::verify_tx(
                job.tx().await?,
                &self.sealer,
                self.marketplace.as_ref(),
                workspace_id,
                store_id,
                credentials_version,
                &token,
            )
            .await
            .map_err(|e| match e {
                VerifyError::Marketplace(MarketplaceError::Transient(m)) => JobError::Retryable(m),
                VerifyError::Marketplace(MarketplaceError::Permanent(m)) => JobError::Permanent(m),
                VerifyError::Unreadable => JobError::Permanent(e.to_string()),
                VerifyError::Database(e) => JobError::Retryable(format!("database: {e}")),
            })?;
            Ok(serde_json::to_value(outcome).expect("outcomes serialize"))
        })
    }

    fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }
}
