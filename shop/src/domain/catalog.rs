//! Catalog full sync: a store's products copied from its marketplace.
//!
//! Starting a sync inserts its row under a partial unique index (one active sync per store), so the database decides
//! between concurrent requests; the loser learns the active sync's id. The job then commits page after page, each
//! page's products together with the cursor after it, so a crash resumes after the last committed page. When every
//! page is in, the products this sync did not see are marked removed, in the job's own transaction with its
//! success. A sync's status is its operation's; the end of that operation frees the store (migration 0015).

use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

use crate::Principal;
use crate::adapters::catalog::ProductPage;
use crate::jobs::SyncCatalog;
use conveyor_jobs::Operation;
use conveyor_jobs::WorkspaceTx;
use conveyor_jobs::{EnqueueError, EnqueueOptions};

/// The operation kind (and job kind) of a sync.
pub const SYNC_KIND: &str = <SyncCatalog as conveyor_jobs::JobKind>::KIND;

/// A sync as clients see it.
#[derive(Clone, Debug, Serialize, sqlx::FromRow)]
pub struct CatalogSync {
    /// Id.
    pub id: Uuid,
    /// The store synced.
    pub store_id: Uuid,
    /// Its operation's status: `queued`, `running`, `succeeded`, `failed` or `canceled`.
    pub status: String,
    /// Its operation.
    pub operation_id: Uuid,
    /// Pages committed.
    pub pages_done: i32,
    /// Products committed (a product seen on two pages counts twice).
    pub items_done: i64,
    /// Products in the catalog, when the marketplace says.
    pub items_total: Option<i64>,
    /// Products marked removed when the sync finished.
    pub items_removed: Option<i64>,
    /// Created.
    pub created_at: DateTime<Utc>,
    /// Last changed.
    pub updated_at: DateTime<Utc>,
    /// Ended.
    pub finished_at: Option<DateTime<Utc>>,
}

macro_rules! sync_columns {
    () => {
        "s.id, s.store_id, o.status, s.operation_id, s.pages_done, s.items_done, s.items_total, s.items_removed,
         s.created_at, s.updated_at, s.finished_at"
    };
}

/// A sync and the operation that runs it.
#[derive(Clone, Debug, Serialize)]
pub struct Started {
    /// The sync.
    pub catalog_sync: CatalogSync,
    /// Its operation, `queued`.
    pub operation: Operation,
}

/// Why a sync cannot start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// No such store in the workspace.
    #[error("store not found")]
    StoreNotFound,
    /// The store's credentials are not verified.
    #[error("the store is `{status}`, not `active`")]
    StoreNotActive {
        /// The store.
        store_id: Uuid,
        /// Its status.
        status: String,
    },
    /// The store has a sync queued or running.
    #[error("catalog sync {0} of this store is still active")]
    AlreadyActive(Uuid),
    /// PostgreSQL failed.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// Starts a full sync of `store_id`: the sync row, its `queued` operation and its job, in the caller's transaction.
pub async fn start_tx(
    tx: &mut WorkspaceTx,
    principal: &Principal,
    store_id: Uuid,
    trace: Option<conveyor_jobs::TraceContext>,
) -> Result<Started, StartError> {
    // The store row is locked (shared) so a credentials change cannot slip between this check and the commit.
    let status: Option<(String,)> = sqlx::query_as("SELECT status FROM conveyor_shop.stores WHERE id = $1 FOR SHARE")
        .bind(store_id)
        .fetch_optional(&mut **tx)
        .await?;
    match status {
        None => return Err(StartError::StoreNotFound),
        Some((status,)) if status != "active" => return Err(StartError::StoreNotActive { store_id, status }),
        Some(_) => {}
    }
    let operation =
        conveyor_jobs::create_operation_tx(tx, principal.workspace_id, principal.user_id, SYNC_KIND, Some(store_id))
            .await?;
    let sync_id = Uuid::now_v7();
    // The unique index decides: of concurrent inserts one wins; the others wait for it to commit and insert nothing,
    // then read the winner (committed, so this statement's snapshot sees it). If the winner has ended in between,
    // the store is free again and the insert is simply tried again.
    for _ in 0..3 {
        let inserted = sqlx::query(
            "INSERT INTO conveyor_shop.catalog_syncs (id, workspace_id, store_id, operation_id, created_by)
             VALUES ($1, $2, $3, $4, $5)
             ON CONFLICT (workspace_id, store_id) WHERE active DO NOTHING",
        )
        .bind(sync_id)
        .bind(principal.workspace_id.0)
        .bind(store_id)
        .bind(operation.id)
        .bind(principal.user_id.0)
        .execute(&mut **tx)
        .await?
        .rows_affected();
        if inserted == 1 {
            break;
        }
        let active: Option<(Uuid,)> =
            sqlx::query_as("SELECT id FROM conveyor_shop.catalog_syncs WHERE store_id = $1 AND active")
                .bind(store_id)
                .fetch_optional(&mut **tx)
                .await?;
        if let Some((active,)) = active {
            return Err(StartError::AlreadyActive(active));
        }
    }
    let mut options = EnqueueOptions::new().operation(operation.id);
    if let Some(trace) = trace {
        options = options.trace(trace);
    }
    conveyor_jobs::enqueue_tx(tx, &SyncCatalog { sync_id }, options).await.map_err(|e| match e {
        EnqueueError::Database(e) => StartError::Database(e),
        other => StartError::Database(sqlx::Error::Protocol(other.to_string())),
    })?;
    let catalog_sync = get_tx(tx, sync_id).await?.ok_or_else(|| {
        StartError::Database(sqlx::Error::Protocol("the store's syncs kept ending and starting".into()))
    })?;
    Ok(Started { catalog_sync, operation })
}

/// The sync `id` of the transaction's workspace, if any.
pub async fn get_tx(tx: &mut WorkspaceTx, id: Uuid) -> Result<Option<CatalogSync>, sqlx::Error> {
    sqlx::query_as::<_, CatalogSync>(concat!(
        "SELECT ",
        sync_columns!(),
        " FROM conveyor_shop.catalog_syncs s JOIN conveyor.operations o ON o.id = s.operation_id WHERE s.id = $1"
    ))
    .bind(id)
    .fetch_optional(&mut **tx)
    .await
}

/// Where a running sync stands, as its job reads it before each page.
#[derive(Clone, Debug, sqlx::FromRow)]
pub struct Progress {
    /// The store.
    pub store_id: Uuid,
    /// Still the store's active sync.
    pub active: bool,
    /// Where the next page starts.
    pub cursor: Option<String>,
    /// Every page is in.
    pub listed: bool,
    /// Pages committed.
    pub pages_done: i32,
    /// Products committed.
    pub items_done: i64,
    /// Products in the catalog, when known.
    pub items_total: Option<i64>,
}

impl Progress {
    /// What the operation shows.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "pages_done": self.pages_done,
            "items_done": self.items_done,
            "items_total": self.items_total,
        })
    }
}

/// The progress of sync `id`, if it exists.
pub async fn progress_tx(tx: &mut WorkspaceTx, id: Uuid) -> Result<Option<Progress>, sqlx::Error> {
    sqlx::query_as::<_, Progress>(
        "SELECT store_id, active, cursor, listed, pages_done, items_done, items_total FROM conveyor_shop.catalog_syncs WHERE id = $1",
    )
    .bind(id)
    .fetch_optional(&mut **tx)
    .await
}

/// What committing a page did.
#[derive(Debug)]
pub enum PageCommit {
    /// The page's products and the cursor after it are committed.
    Committed(Progress),
    /// The sync is no longer where this page started (another delivery moved it on, or it ended): nothing written.
    Moved,
}

/// Upserts `page` (read from `from`) and moves the sync's cursor past it, in one transaction, fenced by `from`: a
/// delivery that read an older position writes nothing.
pub async fn commit_page_tx(
    tx: &mut WorkspaceTx,
    workspace_id: Uuid,
    sync_id: Uuid,
    from: Option<&str>,
    page: &ProductPage,
) -> Result<PageCommit, sqlx::Error> {
    let current: Option<(Uuid, Option<String>)> = sqlx::query_as(
        "SELECT store_id, cursor FROM conveyor_shop.catalog_syncs WHERE id = $1 AND active AND NOT listed FOR UPDATE",
    )
    .bind(sync_id)
    .fetch_optional(&mut **tx)
    .await?;
    let Some((store_id, cursor)) = current else { return Ok(PageCommit::Moved) };
    if cursor.as_deref() != from {
        return Ok(PageCommit::Moved);
    }
    let (mut ids, mut titles, mut prices, mut currencies) = (vec![], vec![], vec![], vec![]);
    for p in &page.products {
        ids.push(p.external_id.as_str());
        titles.push(p.title.as_str());
        prices.push(p.price.as_str());
        currencies.push(p.currency.as_str());
    }
    sqlx::query(
        "INSERT INTO conveyor_shop.store_products (workspace_id, store_id, external_id, title, price, currency, last_sync_id)
         SELECT $1, $2, p.external_id, p.title, p.price, p.currency, $3
         FROM UNNEST($4::text[], $5::text[], $6::text[], $7::text[]) AS p (external_id, title, price, currency)
         ON CONFLICT (workspace_id, store_id, external_id) DO UPDATE
         SET title = EXCLUDED.title, price = EXCLUDED.price, currency = EXCLUDED.currency,
             last_sync_id = EXCLUDED.last_sync_id, synced_at = now(), removed_at = NULL",
    )
    .bind(workspace_id)
    .bind(store_id)
    .bind(sync_id)
    .bind(&ids)
    .bind(&titles)
    .bind(&prices)
    .bind(&currencies)
    .execute(&mut **tx)
    .await?;
    let progress = sqlx::query_as::<_, Progress>(
        "UPDATE conveyor_shop.catalog_syncs
         SET cursor = $2, listed = $3, pages_done = pages_done + 1, items_done = items_done + $4,
             items_total = coalesce($5, items_total), updated_at = now()
         WHERE id = $1
         RETURNING store_id, active, cursor, listed, pages_done, items_done, items_total",
    )
    .bind(sync_id)
    .bind(&page.next_cursor)
    .bind(page.next_cursor.is_none())
    .bind(page.products.len() as i64)
    .bind(page.total.map(|t| t.min(i64::MAX as u64) as i64))
    .fetch_one(&mut **tx)
    .await?;
    Ok(PageCommit::Committed(progress))
}

/// Marks the store's products that sync `sync_id` did not see removed and records how many; in the job's
/// transaction, which also records its success. Returns the number removed.
///
/// Locks the sync's operation before the sync, the order every transition of an operation takes (a cancel locks the
/// operation, then its trigger the sync): the other order could deadlock with a cancel arriving at the end.
pub async fn finish_tx(tx: &mut WorkspaceTx, sync_id: Uuid) -> Result<i64, sqlx::Error> {
    sqlx::query(
        "SELECT 1 FROM conveyor.operations WHERE id = (SELECT operation_id FROM conveyor_shop.catalog_syncs WHERE id = $1) FOR UPDATE",
    )
    .bind(sync_id)
    .execute(&mut **tx)
    .await?;
    let (store_id,): (Uuid,) =
        sqlx::query_as("SELECT store_id FROM conveyor_shop.catalog_syncs WHERE id = $1 FOR UPDATE")
            .bind(sync_id)
            .fetch_one(&mut **tx)
            .await?;
    let removed = sqlx::query(
        "UPDATE conveyor_shop.store_products SET removed_at = now()
         WHERE store_id = $1 AND last_sync_id <> $2 AND removed_at IS NULL",
    )
    .bind(store_id)
    .bind(sync_id)
    .execute(&mut **tx)
    .await?
    .rows_affected() as i64;
    sqlx::query("UPDATE conveyor_shop.catalog_syncs SET items_removed = $2, updated_at = now() WHERE id = $1")
        .bind(sync_id)
        .bind(removed)
        .execute(&mut **tx)
        .await?;
    Ok(removed)
}

/// A synced product as clients see it.
#[derive(Clone, Debug, Serialize, sqlx::FromRow)]
pub struct StoreProduct {
    /// The marketplace's id.
    pub external_id: String,
    /// Title.
    pub title: String,
    /// Price, an exact decimal string.
    pub price: String,
    /// ISO 4217 code.
    pub currency: String,
    /// `active`, or `removed` once a finished sync no longer saw it.
    pub status: String,
    /// Last seen by a sync.
    pub synced_at: DateTime<Utc>,
    /// Marked removed.
    pub removed_at: Option<DateTime<Utc>>,
}

/// Largest page of products.
pub const MAX_PRODUCTS_PAGE: u32 = 500;

/// The store's products after `after` (an external id), in external id order, at most `limit`.
pub async fn products_tx(
    tx: &mut WorkspaceTx,
    store_id: Uuid,
    after: Option<&str>,
    limit: u32,
) -> Result<Vec<StoreProduct>, sqlx::Error> {
    sqlx::query_as::<_, StoreProduct>(
        "SELECT external_id, title, price, currency,
                CASE WHEN removed_at IS NULL THEN 'active' ELSE 'removed' END AS status, synced_at, removed_at
         FROM conveyor_shop.store_products
         WHERE store_id = $1 AND ($2::text IS NULL OR external_id > $2)
         ORDER BY external_id
         LIMIT $3",
    )
    .bind(store_id)
    .bind(after)
    .bind(i64::from(limit))
    .fetch_all(&mut **tx)
    .await
}

/// Whether the store exists in the transaction's workspace.
pub async fn store_exists_tx(tx: &mut WorkspaceTx, store_id: Uuid) -> Result<bool, sqlx::Error> {
    let found: Option<(i32,)> = sqlx::query_as("SELECT 1 FROM conveyor_shop.stores WHERE id = $1")
        .bind(store_id)
        .fetch_optional(&mut **tx)
        .await?;
    Ok(found.is_some())
}
