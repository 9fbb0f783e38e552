//! Asset transfers: a source URL downloaded (SSRF-safe, resumable) into object storage, which then becomes a media.
//!
//! Creating a transfer writes, in the caller's transaction: the transfer (`queued`), a `queued` operation and an
//! `asset.transfer` outbox event naming the transfer's id only. The job then records its progress part by part, in
//! transactions of its own ([`begin`], [`record_part`]), so a later run resumes where the last one stopped, and
//! completes the transfer in its own transaction together with the media it creates ([`complete_tx`]).

use chrono::{DateTime, Utc};
use futures_util::StreamExt;
use serde::Serialize;
use sha2::{Digest, Sha256};
use sqlx::PgPool;
use uuid::Uuid;

use super::ValidationError;
use crate::Principal;
use crate::adapters::fetch::{self, AddressPolicy, FetchError, Progress};
use crate::jobs::TransferAsset;
use crate::storage::{ObjectKey, ObjectStorage, StorageError};
use conveyor_jobs::Operation;
use conveyor_jobs::WorkspaceTx;
use conveyor_jobs::{EnqueueError, EnqueueOptions};
use conveyor_jobs::{UserId, WorkspaceId};

/// The operation kind (and job kind) of a transfer.
pub const TRANSFER_KIND: &str = <TransferAsset as conveyor_jobs::JobKind>::KIND;

/// The object store collection of transfers: `parts/<index>` while downloading, then `original`.
pub const COLLECTION: &str = "asset-transfers";

/// The key of part `index` of transfer `id`.
pub fn part_key(workspace: WorkspaceId, id: Uuid, index: u32) -> ObjectKey {
    ObjectKey::new(workspace.0, COLLECTION, id, &format!("parts/{index:08}"))
}

/// The key of the whole transferred object of transfer `id`.
pub fn object_key(workspace: WorkspaceId, id: Uuid) -> ObjectKey {
    ObjectKey::new(workspace.0, COLLECTION, id, "original")
}

/// Makes the stored parts of a finished download one object (the transfer's [`object_key`]) and answers its size
/// and hex sha256. The parts are hashed while they are concatenated (two readers at once, no third pass over the
/// object). A run that died after assembling finds the object whole (its parts may be gone) and hashes it instead.
pub async fn assemble(
    storage: &ObjectStorage,
    workspace: WorkspaceId,
    id: Uuid,
    progress: &Progress,
) -> Result<(u64, String), StorageError> {
    let object = object_key(workspace, id);
    if storage.size(&object).await? == Some(progress.bytes_done) {
        return hash_objects(storage, std::slice::from_ref(&object)).await;
    }
    let parts: Vec<ObjectKey> = (0..progress.parts).map(|index| part_key(workspace, id, index)).collect();
    let (written, (hashed, sha256)) = tokio::try_join!(storage.concat(&object, &parts), hash_objects(storage, &parts))?;
    if written != hashed {
        return Err(StorageError::Backend(format!("wrote {written} bytes of {hashed}")));
    }
    Ok((written, sha256))
}

/// The size and hex sha256 of the concatenation of `objects`, streaming.
async fn hash_objects(storage: &ObjectStorage, objects: &[ObjectKey]) -> Result<(u64, String), StorageError> {
    let mut hasher = Sha256::new();
    let mut size = 0u64;
    for object in objects {
        let mut stream = Box::pin(storage.stream(object).await?);
        while let Some(chunk) = stream.next().await {
            let chunk = chunk?;
            size += chunk.len() as u64;
            hasher.update(&chunk);
        }
    }
    Ok((size, hasher.finalize().iter().map(|b| format!("{b:02x}")).collect()))
}

/// Why a transfer failed, as clients see it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TransferError {
    /// Stable code: `SOURCE_FORBIDDEN`, `TOO_LARGE`, `UNSUPPORTED_CONTENT_TYPE`, `SOURCE_UNAVAILABLE`,
    /// `SOURCE_TOO_SLOW` (under the minimum throughput, or past the deadline), `TOO_MANY_REDIRECTS`,
    /// `INVALID_SOURCE_URL`, `CANCELED`, ...
    pub code: String,
    /// Text for the client.
    pub detail: String,
}

/// A transfer as clients see it (never its source URL, which may carry a signature).
#[derive(Clone, Debug, Serialize)]
pub struct AssetTransfer {
    /// Id.
    pub id: Uuid,
    /// `queued`, `transferring`, `completed` or `failed`.
    pub status: String,
    /// The media's file name.
    pub filename: String,
    /// The file's size, once the source said.
    pub bytes_total: Option<i64>,
    /// Bytes stored so far.
    pub bytes_done: i64,
    /// Hex sha256 of the stored object, once completed.
    pub sha256: Option<String>,
    /// The media the object became, once completed.
    pub media_id: Option<Uuid>,
    /// Why it failed, if it did.
    pub error: Option<TransferError>,
    /// Created.
    pub created_at: DateTime<Utc>,
    /// Last changed.
    pub updated_at: DateTime<Utc>,
}

#[derive(sqlx::FromRow)]
struct Row {
    id: Uuid,
    status: String,
    filename: String,
    bytes_total: Option<i64>,
    bytes_done: i64,
    sha256: Option<String>,
    media_id: Option<Uuid>,
    error_code: Option<String>,
    error_detail: Option<String>,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
}

impl From<Row> for AssetTransfer {
    fn from(r: Row) -> Self {
        let error = r.error_code.map(|code| TransferError { code, detail: r.error_detail.unwrap_or_default() });
        Self {
            id: r.id,
            status: r.status,
            filename: r.filename,
            bytes_total: r.bytes_total,
            bytes_done: r.bytes_done,
            sha256: r.sha256,
            media_id: r.media_id,
            error,
            created_at: r.created_at,
            updated_at: r.updated_at,
        }
    }
}

macro_rules! columns {
    () => {
        "id, status, filename, bytes_total, bytes_done, sha256, media_id, error_code, error_detail, created_at, \
         updated_at"
    };
}

/// A transfer to create, checked: an acceptable URL whose literal address, if any, the policy allows.
#[derive(Debug)]
pub struct NewTransfer {
    source_url: String,
    filename: String,
}

/// Why a new transfer is refused.
#[derive(Debug, thiserror::Error)]
pub enum NewTransferError {
    /// A malformed field.
    #[error(transparent)]
    Invalid(#[from] ValidationError),
    /// The URL names a refused address.
    #[error("{0}")]
    Forbidden(String),
}

impl NewTransfer {
    /// Checks the URL ([`fetch::check_source_url`] under `policy`) and the file name.
    pub fn parse(source_url: &str, filename: &str, policy: &AddressPolicy) -> Result<Self, NewTransferError> {
        let url = fetch::check_source_url(source_url, policy).map_err(|e| match e {
            FetchError::Forbidden(why) => NewTransferError::Forbidden(format!("the source address {why}")),
            other => NewTransferError::Invalid(ValidationError(other.to_string())),
        })?;
        super::media::validate_filename(filename)?;
        Ok(Self { source_url: url.into(), filename: filename.to_owned() })
    }
}

/// A transfer and the operation that runs it.
#[derive(Clone, Debug, Serialize)]
pub struct Created {
    /// The transfer, `queued`.
    pub asset_transfer: AssetTransfer,
    /// Its operation, `queued`.
    pub operation: Operation,
}

/// Creates a queued transfer, its operation and its `asset.transfer` outbox event.
pub async fn create_tx(
    tx: &mut WorkspaceTx,
    principal: &Principal,
    new: NewTransfer,
    trace: Option<conveyor_jobs::TraceContext>,
) -> Result<Created, sqlx::Error> {
    let id = Uuid::now_v7();
    let asset_transfer = sqlx::query_as::<_, Row>(concat!(
        "INSERT INTO conveyor_shop.asset_transfers (id, workspace_id, source_url, filename, created_by) VALUES ($1, $2, $3, $4, $5)
         RETURNING ",
        columns!()
    ))
    .bind(id)
    .bind(principal.workspace_id.0)
    .bind(&new.source_url)
    .bind(&new.filename)
    .bind(principal.user_id.0)
    .fetch_one(&mut **tx)
    .await?
    .into();
    let operation =
        conveyor_jobs::create_operation_tx(tx, principal.workspace_id, principal.user_id, TRANSFER_KIND, Some(id))
            .await?;
    let mut options = EnqueueOptions::new().operation(operation.id);
    if let Some(trace) = trace {
        options = options.trace(trace);
    }
    conveyor_jobs::enqueue_tx(tx, &TransferAsset { asset_transfer_id: id }, options).await.map_err(|e| match e {
        EnqueueError::Database(e) => e,
        // A fixed kind with valid options and a payload of ids: none of these can happen.
        other => sqlx::Error::Protocol(other.to_string()),
    })?;
    Ok(Created { asset_transfer, operation })
}

/// The transfer `id` of the transaction's workspace, if any.
///
/// A transfer whose operation ended without it (canceled before or while it ran, or failed for good by a path that
/// could not write the transfer, such as a dead letter) reads as `failed`, with `CANCELED` or the operation's
/// redacted error: the operation is where every path records an end.
pub async fn get_tx(tx: &mut WorkspaceTx, id: Uuid) -> Result<Option<AssetTransfer>, sqlx::Error> {
    let row = sqlx::query_as::<_, Row>(
        "SELECT t.id, t.filename, t.bytes_total, t.bytes_done, t.sha256, t.media_id, t.created_at, t.updated_at,
                CASE WHEN ended THEN 'failed' ELSE t.status END AS status,
                CASE WHEN ended THEN coalesce(t.error_code,
                         CASE o.status WHEN 'canceled' THEN 'CANCELED' ELSE 'SOURCE_UNAVAILABLE' END)
                     ELSE t.error_code END AS error_code,
                CASE WHEN ended THEN coalesce(t.error_detail, o.error, 'the transfer was canceled')
                     ELSE t.error_detail END AS error_detail
         FROM conveyor_shop.asset_transfers t
         LEFT JOIN conveyor.operations o ON o.subject_id = t.id AND o.workspace_id = t.workspace_id AND o.kind = $2
         CROSS JOIN LATERAL (SELECT t.status IN ('queued', 'transferring')
                                    AND o.status IN ('failed', 'canceled') AS ended) e
         WHERE t.id = $1",
    )
    .bind(id)
    .bind(TRANSFER_KIND)
    .fetch_optional(&mut **tx)
    .await?;
    Ok(row.map(AssetTransfer::from))
}

/// What the job needs of a transfer.
#[derive(Clone, Debug)]
pub struct Job {
    /// The source; `None` once the transfer ended (it is cleared then: a presigned URL carries a token).
    pub source_url: Option<String>,
    /// The media's file name.
    pub filename: String,
    /// Who asked (the media's creator).
    pub created_by: UserId,
    /// `queued`, `transferring`, `completed` or `failed`.
    pub status: String,
    /// Where the download stands.
    pub progress: Progress,
}

/// The transfer `id` as the job sees it.
pub async fn job_tx(tx: &mut WorkspaceTx, id: Uuid) -> Result<Option<Job>, sqlx::Error> {
    type JobRow = (Option<String>, String, Uuid, String, i64, i32, Option<i64>, Option<String>, Option<String>);
    let row: Option<JobRow> = sqlx::query_as(
        "SELECT source_url, filename, created_by, status, bytes_done, parts, bytes_total, content_type, validator
         FROM conveyor_shop.asset_transfers WHERE id = $1",
    )
    .bind(id)
    .fetch_optional(&mut **tx)
    .await?;
    Ok(row.map(|(source_url, filename, created_by, status, done, parts, total, content_type, validator)| Job {
        source_url,
        filename,
        created_by: UserId(created_by),
        status,
        progress: Progress {
            bytes_done: done as u64,
            parts: parts as u32,
            bytes_total: total.map(|t| t as u64),
            content_type,
            validator,
        },
    }))
}

/// Records, in a transaction of its own, that the transfer is `transferring` from `progress` (a response was
/// accepted, or the source started over). False when the transfer has ended meanwhile.
pub async fn begin(pool: &PgPool, workspace: WorkspaceId, id: Uuid, progress: &Progress) -> Result<bool, sqlx::Error> {
    let mut tx = conveyor_jobs::begin_workspace(pool, workspace).await?;
    let updated = sqlx::query(
        "UPDATE conveyor_shop.asset_transfers
         SET status = 'transferring', bytes_done = $2, parts = $3, bytes_total = $4, content_type = $5,
             validator = $6, updated_at = now()
         WHERE id = $1 AND status IN ('queued', 'transferring')",
    )
    .bind(id)
    .bind(progress.bytes_done as i64)
    .bind(progress.parts as i32)
    .bind(progress.bytes_total.map(|t| t as i64))
    .bind(&progress.content_type)
    .bind(&progress.validator)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    tx.commit().await?;
    Ok(updated == 1)
}

/// Records, in a transaction of its own, one more stored part (and the total, once known). False when the transfer
/// has ended meanwhile.
pub async fn record_part(
    pool: &PgPool,
    workspace: WorkspaceId,
    id: Uuid,
    progress: &Progress,
) -> Result<bool, sqlx::Error> {
    let mut tx = conveyor_jobs::begin_workspace(pool, workspace).await?;
    let updated = sqlx::query(
        "UPDATE conveyor_shop.asset_transfers SET bytes_done = $2, parts = $3, bytes_total = coalesce($4, bytes_total),
                updated_at = now()
         WHERE id = $1 AND status = 'transferring'",
    )
    .bind(id)
    .bind(progress.bytes_done as i64)
    .bind(progress.parts as i32)
    .bind(progress.bytes_total.map(|t| t as i64))
    .execute(&mut *tx)
    .await?
    .rows_affected();
    tx.commit().await?;
    Ok(updated == 1)
}

/// Marks the transfer `failed` with `code`, in a transaction of its own (the job's own rolls back on failure), and
/// forgets its source URL. A transfer that already ended stays as it is. `detail` is shown to clients: a fixed text,
/// never an address or a storage or database error.
pub async fn fail(
    pool: &PgPool,
    workspace: WorkspaceId,
    id: Uuid,
    code: &str,
    detail: &str,
) -> Result<(), sqlx::Error> {
    let mut tx = conveyor_jobs::begin_workspace(pool, workspace).await?;
    sqlx::query(
        "UPDATE conveyor_shop.asset_transfers SET status = 'failed', error_code = $2, error_detail = $3, source_url = NULL,
                updated_at = now()
         WHERE id = $1 AND status IN ('queued', 'transferring')",
    )
    .bind(id)
    .bind(code)
    .bind(detail)
    .execute(&mut *tx)
    .await?;
    tx.commit().await
}

/// Completes the transfer in the job's transaction: the stored object becomes a `processing` media (which queues
/// `media.process`) and the transfer `completed` with its sha256 and media; its source URL is forgotten. `None` when the transfer is no longer
/// `transferring`.
#[allow(clippy::too_many_arguments)]
pub async fn complete_tx(
    tx: &mut WorkspaceTx,
    workspace: WorkspaceId,
    id: Uuid,
    job: &Job,
    size: u64,
    sha256: &str,
    object: &ObjectKey,
    trace: Option<conveyor_jobs::TraceContext>,
) -> Result<Option<Uuid>, sqlx::Error> {
    let live: Option<(Uuid,)> = sqlx::query_as(
        "SELECT id FROM conveyor_shop.asset_transfers WHERE id = $1 AND status = 'transferring' FOR UPDATE",
    )
    .bind(id)
    .fetch_optional(&mut **tx)
    .await?;
    if live.is_none() {
        return Ok(None);
    }
    let content_type = job.progress.content_type.as_deref().unwrap_or("application/octet-stream");
    let (media, _operation) =
        super::media::adopt_object_tx(tx, workspace, job.created_by, &job.filename, content_type, size, object, trace)
            .await?;
    sqlx::query(
        "UPDATE conveyor_shop.asset_transfers
         SET status = 'completed', sha256 = $2, media_id = $3, bytes_done = $4, bytes_total = $4,
             source_url = NULL, completed_at = now(), updated_at = now()
         WHERE id = $1",
    )
    .bind(id)
    .bind(sha256)
    .bind(media.id)
    .bind(size as i64)
    .execute(&mut **tx)
    .await?;
    Ok(Some(media.id))
}
