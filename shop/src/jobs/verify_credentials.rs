//! `store.verify_credentials`: asks the store's marketplace whether its credentials work; the store becomes `active`
//! or `invalid_credentials`.

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::adapters::marketplace::{Marketplace, MarketplaceError};
use crate::domain::stores::{self, VerifyError};
use crate::sealing::Sealer;
use conveyor_jobs::{Handler, JobContext, JobError, JobKind};

/// Verify a store's current credentials against its marketplace. Ids only: the worker reads the sealed credentials
/// inside the job's workspace transaction.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VerifyCredentials {
    /// The store.
    pub store_id: Uuid,
    /// The credentials version to verify; a newer one supersedes this job.
    pub credentials_version: i32,
}

impl JobKind for VerifyCredentials {
    const KIND: &'static str = "store.verify_credentials";
    const QUEUE: &'static str = "stores";
}

/// Runs [`VerifyCredentials`] jobs.
pub struct VerifyCredentialsHandler {
    /// Opens the sealed credentials.
    pub sealer: Sealer,
    /// The marketplace adapter.
    pub marketplace: Arc<dyn Marketplace>,
    /// Runs before dead-lettering (`CONVEYOR_JOB_MAX_ATTEMPTS`).
    pub max_attempts: u32,
    /// Longest run (`CONVEYOR_JOB_TIMEOUT`).
    pub timeout: Duration,
}

impl Handler<VerifyCredentials> for VerifyCredentialsHandler {
    async fn handle(&self, job: VerifyCredentials, cx: &mut JobContext) -> Result<serde_json::Value, JobError> {
        let token = cx.idempotency_token();
        let workspace_id = cx.workspace_id().0;
        let canceled = cx.cancellation().clone();
        let verifying = stores::verify_tx(
            cx.tx().await?,
            &self.sealer,
            self.marketplace.as_ref(),
            workspace_id,
            job.store_id,
            job.credentials_version,
            &token,
        );
        // A canceled job stops waiting for the marketplace (which, keyed by the token, acts at most once anyway).
        let outcome = tokio::select! {
            verified = verifying => verified,
            _ = canceled.cancelled() => return Err(JobError::Canceled),
        }
        .map_err(|e| match e {
            VerifyError::Marketplace(MarketplaceError::Transient(m)) => JobError::Retryable(m),
            VerifyError::Marketplace(MarketplaceError::RetryAfter { reason, after }) => {
                JobError::retry_after(reason, after)
            }
            VerifyError::Marketplace(MarketplaceError::Permanent(m)) => JobError::Permanent(m),
            VerifyError::Unreadable => JobError::Permanent(e.to_string()),
            VerifyError::Database(e) => JobError::from(e),
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
        let job = VerifyCredentials { store_id: Uuid::now_v7(), credentials_version: 3 };
        let text = serde_json::to_string(&job).unwrap();
        assert_eq!(serde_json::from_str::<VerifyCredentials>(&text).unwrap(), job);
        assert!(serde_json::from_str::<VerifyCredentials>(r#"{"store_id":"x","credentials_version":1}"#).is_err());
        let extra = format!(r#"{{"store_id":"{}","credentials_version":1,"api_key":"k"}}"#, job.store_id);
        assert!(serde_json::from_str::<VerifyCredentials>(&extra).is_err());
    }
}
