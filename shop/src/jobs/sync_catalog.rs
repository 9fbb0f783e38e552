//! `catalog.sync`: copies a store's whole catalog from its marketplace, page by page.
//!
//! Each page is committed in a transaction of its own with the cursor after it (fenced by the cursor it started
//! from), so a crash or a retry resumes after the last committed page, and memory holds one page at a time whatever
//! the catalog's size. Between pages the job shows its progress on the operation and stops if it was canceled. Once
//! every page is in, the products not seen are marked removed in the job's transaction, with its success.

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use uuid::Uuid;

use crate::adapters::catalog::{Catalog, MarketplaceError};
use crate::domain::catalog::{self, PageCommit};
use crate::domain::stores::{self, CredentialsError};
use crate::sealing::Sealer;

use conveyor_jobs::{Handler, JobContext, JobError, JobKind};

/// Sync the catalog of the store of sync `sync_id`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SyncCatalog {
    /// The sync (its row names the store and holds the cursor).
    pub sync_id: Uuid,
}

impl JobKind for SyncCatalog {
    const KIND: &'static str = "catalog.sync";
    const QUEUE: &'static str = "catalog";
    const TIMEOUT: Duration = Duration::from_secs(3600);
}

/// Runs [`SyncCatalog`] jobs.
pub struct SyncCatalogHandler {
    /// Commits each page in a transaction of its own.
    pub pool: PgPool,
    /// Opens the store's credentials.
    pub sealer: Sealer,
    /// The marketplace's catalog.
    pub catalog: Arc<dyn Catalog>,
    /// Products asked for per page (`CONVEYOR_CATALOG_PAGE_SIZE`).
    pub page_size: u32,
    /// Runs before dead-lettering (`CONVEYOR_JOB_MAX_ATTEMPTS`).
    pub max_attempts: u32,
}

fn marketplace_error(e: MarketplaceError) -> JobError {
    match e {
        MarketplaceError::Transient(m) => JobError::Retryable(m),
        MarketplaceError::RetryAfter { reason, after } => JobError::retry_after(reason, after),
        MarketplaceError::Permanent(m) => JobError::Permanent(m),
    }
}

impl Handler<SyncCatalog> for SyncCatalogHandler {
    async fn handle(&self, job: SyncCatalog, cx: &mut JobContext) -> Result<serde_json::Value, JobError> {
        let workspace = cx.workspace_id();
        let canceled = cx.cancellation().clone();
        let credentials = {
            let mut tx = conveyor_jobs::begin_workspace(&self.pool, workspace).await?;
            let Some(progress) = catalog::progress_tx(&mut tx, job.sync_id).await? else {
                return Err(JobError::Permanent("the catalog sync no longer exists".into()));
            };
            let credentials = stores::open_credentials_tx(&mut tx, &self.sealer, workspace.0, progress.store_id)
                .await
                .map_err(|e| match e {
                    CredentialsError::Database(e) => JobError::from(e),
                    other => JobError::Permanent(other.to_string()),
                })?;
            tx.commit().await?;
            credentials
        };
        loop {
            let mut tx = conveyor_jobs::begin_workspace(&self.pool, workspace).await?;
            let progress = catalog::progress_tx(&mut tx, job.sync_id)
                .await?
                .ok_or_else(|| JobError::Permanent("the catalog sync no longer exists".to_owned()))?;
            tx.commit().await?;
            if !progress.active {
                // Ended by another path (a cancel, another delivery's success): nothing left to do.
                return Err(JobError::Canceled);
            }
            if progress.listed {
                break;
            }
            if canceled.is_cancelled() {
                return Err(JobError::Canceled);
            }
            let reading = self.catalog.list_products(credentials.fields(), progress.cursor.as_deref(), self.page_size);
            let page = tokio::select! {
                page = reading => page.map_err(marketplace_error)?,
                _ = canceled.cancelled() => return Err(JobError::Canceled),
            };
            if page.next_cursor.is_some() && page.next_cursor == progress.cursor {
                // A marketplace that answers the page it was asked for as the next one would be read forever.
                return Err(JobError::Permanent("the marketplace's catalog cursor does not advance".into()));
            }
            let mut tx = conveyor_jobs::begin_workspace(&self.pool, workspace).await?;
            let committed =
                catalog::commit_page_tx(&mut tx, workspace.0, job.sync_id, progress.cursor.as_deref(), &page).await?;
            tx.commit().await?;
            if let PageCommit::Committed(progress) = committed {
                fail::fail_point!("catalog::after_page");
                // Also the moment a cancellation is heard: the next turn stops before reading another page.
                cx.progress(progress.to_json()).await?;
            }
        }
        let removed = catalog::finish_tx(cx.tx().await?, job.sync_id).await?;
        let mut tx = conveyor_jobs::begin_workspace(&self.pool, workspace).await?;
        let done = catalog::progress_tx(&mut tx, job.sync_id).await?;
        tx.commit().await?;
        let mut result = done.map(|p| p.to_json()).unwrap_or_default();
        result["items_removed"] = removed.into();
        Ok(result)
    }

    fn max_attempts(&self) -> u32 {
        self.max_attempts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_payload_names_the_sync_only() {
        let job = SyncCatalog { sync_id: Uuid::now_v7() };
        let text = serde_json::to_string(&job).unwrap();
        assert_eq!(serde_json::from_str::<SyncCatalog>(&text).unwrap(), job);
        assert!(serde_json::from_str::<SyncCatalog>(r#"{"sync_id":"x"}"#).is_err());
    }
}
