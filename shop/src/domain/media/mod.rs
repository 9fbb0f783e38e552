//! Media: images uploaded into object storage (or adopted from a finished asset transfer), checked and derived by
//! the `media.process` job.
//!
//! A media goes `awaiting_upload` → `processing` → `ready` | `rejected`:
//!
//! - [`create_tx`] registers it (`awaiting_upload`); every upload writes a new object and [`record_upload_tx`] points
//!   the row at it, only while the media is still `awaiting_upload` (so a completion freezes the bytes it saw);
//! - [`complete_tx`] (or [`adopt_object_tx`] for a transferred object) moves it to `processing` with one conditional
//!   UPDATE and queues its operation and job: of two completions, the database lets exactly one win (a media whose
//!   operation ended `canceled` or `failed` without processing it may be completed again);
//! - the job ([`process_tx`]) checks the bytes and derives `thumb` and `large`, keyed by content: a media whose
//!   bytes were derived before in the workspace reuses that derivation.
//!
//! Rejections (`UNSUPPORTED_TYPE`, `TYPE_MISMATCH`, `TOO_LARGE`, `TOO_MANY_PIXELS`, `CORRUPT`) are results, not job
//! failures: the media ends `rejected` with the code, the operation `succeeded` with
//! `{"outcome": "rejected", "code", "detail"}`, and nothing is retried. Only object storage and database failures
//! are retried (and, past the attempts, fail the operation).

mod images;
mod process;
mod upload;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::ValidationError;
use crate::jobs::ProcessMedia;
use crate::storage::ObjectKey;
use conveyor_jobs::Operation;
use conveyor_jobs::WorkspaceTx;
use conveyor_jobs::{EnqueueError, EnqueueOptions};
use conveyor_jobs::{UserId, WorkspaceId};

pub use images::{
    Checked, Derived, DerivedImage, Format, ImageLimits, Refusal, RejectionCode, Sniffed, derive, inspect, sniff,
};
pub use process::{DecodeGate, Derivation, ProcessError, ProcessOutcome, ProcessSettings, process_tx};
pub use upload::{PART_BYTES, UploadError, store_upload};

/// The operation kind (and job kind) of processing.
pub const PROCESS_KIND: &str = <ProcessMedia as conveyor_jobs::JobKind>::KIND;

/// Declared content types Conveyor accepts; anything else is refused with `UNSUPPORTED_TYPE`.
pub const SUPPORTED_TYPES: &[&str] = &["image/png", "image/jpeg"];

/// The object-store collection of media originals.
pub const COLLECTION: &str = "media";

/// The object-store collection of derivations (keyed by the original's content).
pub const DERIVATIONS_COLLECTION: &str = "media-derivations";

/// A derived image as clients see it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Derivative {
    /// `thumb` or `large`.
    pub name: String,
    /// Pixels.
    pub width: u32,
    /// Pixels.
    pub height: u32,
    /// `image/png` or `image/jpeg`.
    pub content_type: String,
    /// Encoded size.
    pub size_bytes: u64,
    /// Where the bytes are served: `/v1/media/{id}/derivatives/{name}`.
    pub url: String,
}

/// A derived image as stored in `media_derivations.derivatives` (not shown to clients).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredDerivative {
    /// `thumb` or `large`.
    pub name: String,
    /// Pixels.
    pub width: u32,
    /// Pixels.
    pub height: u32,
    /// `image/png` or `image/jpeg`.
    pub content_type: String,
    /// Encoded size.
    pub size_bytes: u64,
    /// The object holding the bytes.
    pub object_key: String,
}

/// Why a media was rejected.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Rejection {
    /// `UNSUPPORTED_TYPE`, `TYPE_MISMATCH`, `TOO_LARGE`, `TOO_MANY_PIXELS` or `CORRUPT`.
    pub code: String,
    /// Text for the client.
    pub detail: String,
}

/// A media as clients see it.
#[derive(Clone, Debug, Serialize)]
pub struct Media {
    /// Id.
    pub id: Uuid,
    /// `awaiting_upload`, `processing`, `ready` or `rejected`.
    pub status: String,
    /// The client's file name.
    pub filename: String,
    /// The declared content type.
    pub content_type: String,
    /// The uploaded size once uploaded, else the declared one.
    pub size_bytes: u64,
    /// Pixels, once `ready`.
    pub width: Option<u32>,
    /// Pixels, once `ready`.
    pub height: Option<u32>,
    /// Hex SHA-256 of the original, once processed.
    pub sha256: Option<String>,
    /// `thumb` and `large`, once `ready`.
    pub derivatives: Vec<Derivative>,
    /// Why it was rejected, once `rejected`.
    pub rejection: Option<Rejection>,
    /// Where to `PUT` the bytes, while `awaiting_upload`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upload_url: Option<String>,
    /// The `media.process` operation, once completed.
    pub operation_id: Option<Uuid>,
    /// Created.
    pub created_at: DateTime<Utc>,
    /// Last changed.
    pub updated_at: DateTime<Utc>,
}

#[derive(sqlx::FromRow)]
struct MediaRow {
    id: Uuid,
    status: String,
    filename: String,
    content_type: String,
    declared_size: i64,
    uploaded_size: Option<i64>,
    operation_id: Option<Uuid>,
    sha256: Option<String>,
    rejection_code: Option<String>,
    rejection_detail: Option<String>,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
    width: Option<i32>,
    height: Option<i32>,
    derivatives: Option<sqlx::types::Json<Vec<StoredDerivative>>>,
}

macro_rules! select_media {
    () => {
        "SELECT m.id, m.status, m.filename, m.content_type, m.declared_size, m.uploaded_size, m.operation_id,
                m.sha256, m.rejection_code, m.rejection_detail, m.created_at, m.updated_at,
                d.width, d.height, d.derivatives
         FROM conveyor_shop.media m LEFT JOIN conveyor_shop.media_derivations d ON d.id = m.derivation_id"
    };
}

impl From<MediaRow> for Media {
    fn from(row: MediaRow) -> Self {
        let id = row.id;
        let derivatives = row
            .derivatives
            .map(|d| d.0)
            .unwrap_or_default()
            .into_iter()
            .map(|d| Derivative {
                url: derivative_url(id, &d.name),
                name: d.name,
                width: d.width,
                height: d.height,
                content_type: d.content_type,
                size_bytes: d.size_bytes,
            })
            .collect();
        let rejection =
            row.rejection_code.map(|code| Rejection { code, detail: row.rejection_detail.unwrap_or_default() });
        Self {
            upload_url: (row.status == "awaiting_upload").then(|| format!("/v1/media/{id}/content")),
            id,
            status: row.status,
            filename: row.filename,
            content_type: row.content_type,
            size_bytes: row.uploaded_size.unwrap_or(row.declared_size).max(0) as u64,
            width: row.width.map(|w| w as u32),
            height: row.height.map(|h| h as u32),
            sha256: row.sha256,
            derivatives,
            rejection,
            operation_id: row.operation_id,
            created_at: row.created_at,
            updated_at: row.updated_at,
        }
    }
}

/// Where a derivative's bytes are served.
pub fn derivative_url(media_id: Uuid, name: &str) -> String {
    format!("/v1/media/{media_id}/derivatives/{name}")
}

/// A media to register.
#[derive(Clone, Debug)]
pub struct NewMedia {
    /// 1 to 255 characters, no control characters or path separators.
    pub filename: String,
    /// One of [`SUPPORTED_TYPES`].
    pub content_type: String,
    /// At most `CONVEYOR_MEDIA_MAX_BYTES`.
    pub size_bytes: u64,
}

/// Why a [`NewMedia`] is refused.
#[derive(Debug, thiserror::Error)]
pub enum NewMediaError {
    /// A field is malformed.
    #[error(transparent)]
    Invalid(#[from] ValidationError),
    /// The content type is not one of [`SUPPORTED_TYPES`].
    #[error("content_type must be one of: {}", SUPPORTED_TYPES.join(", "))]
    UnsupportedType,
    /// The declared size is over the limit.
    #[error("size_bytes exceeds the limit of {0} bytes")]
    TooLarge(u64),
}

/// Checks a file name: 1 to 255 characters, no control characters, no `/` or `\`.
pub fn validate_filename(filename: &str) -> Result<(), ValidationError> {
    let ok = (1..=255).contains(&filename.chars().count())
        && !filename.trim().is_empty()
        && !filename.chars().any(|c| c.is_control() || c == '/' || c == '\\');
    if ok {
        Ok(())
    } else {
        Err(ValidationError("filename must be 1 to 255 characters, without control characters or slashes".into()))
    }
}

impl NewMedia {
    /// Checks every field against the limits.
    pub fn validate(&self, max_bytes: u64) -> Result<(), NewMediaError> {
        validate_filename(&self.filename)?;
        if !SUPPORTED_TYPES.contains(&self.content_type.as_str()) {
            return Err(NewMediaError::UnsupportedType);
        }
        if self.size_bytes > max_bytes {
            return Err(NewMediaError::TooLarge(max_bytes));
        }
        Ok(())
    }
}

fn db_size(size: u64) -> i64 {
    i64::try_from(size).unwrap_or(i64::MAX)
}

/// Registers a media `awaiting_upload`.
pub async fn create_tx(
    tx: &mut WorkspaceTx,
    workspace_id: WorkspaceId,
    created_by: UserId,
    new: &NewMedia,
) -> Result<Media, sqlx::Error> {
    let id = Uuid::now_v7();
    sqlx::query(
        "INSERT INTO conveyor_shop.media (id, workspace_id, filename, content_type, declared_size, created_by)
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(id)
    .bind(workspace_id.0)
    .bind(&new.filename)
    .bind(&new.content_type)
    .bind(db_size(new.size_bytes))
    .bind(created_by.0)
    .execute(&mut **tx)
    .await?;
    Ok(get_tx(tx, id).await?.expect("the media was just inserted"))
}

/// The media `id` of the transaction's workspace, if any.
pub async fn get_tx(tx: &mut WorkspaceTx, id: Uuid) -> Result<Option<Media>, sqlx::Error> {
    let row = sqlx::query_as::<_, MediaRow>(concat!(select_media!(), " WHERE m.id = $1"))
        .bind(id)
        .fetch_optional(&mut **tx)
        .await?;
    Ok(row.map(Media::from))
}

/// The stored derivative `name` of a `ready` media, if any.
pub async fn derivative_tx(
    tx: &mut WorkspaceTx,
    media_id: Uuid,
    name: &str,
) -> Result<Option<StoredDerivative>, sqlx::Error> {
    let row: Option<(sqlx::types::Json<Vec<StoredDerivative>>,)> = sqlx::query_as(
        "SELECT d.derivatives FROM conveyor_shop.media m JOIN conveyor_shop.media_derivations d ON d.id = m.derivation_id
         WHERE m.id = $1 AND m.status = 'ready'",
    )
    .bind(media_id)
    .fetch_optional(&mut **tx)
    .await?;
    Ok(row.and_then(|(d,)| d.0.into_iter().find(|d| d.name == name)))
}

/// Where a media stands, for the writes that depend on it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MediaState {
    /// No such media in the workspace.
    Missing,
    /// Still taking uploads; `uploaded` once some bytes are in.
    AwaitingUpload {
        /// Whether an upload was recorded.
        uploaded: bool,
    },
    /// Completed: its operation.
    Completed {
        /// The `media.process` operation.
        operation_id: Uuid,
    },
}

/// Reads where media `id` stands.
pub async fn state_tx(tx: &mut WorkspaceTx, id: Uuid) -> Result<MediaState, sqlx::Error> {
    let row: Option<(String, Option<String>, Option<Uuid>)> =
        sqlx::query_as("SELECT status, object_key, operation_id FROM conveyor_shop.media WHERE id = $1")
            .bind(id)
            .fetch_optional(&mut **tx)
            .await?;
    Ok(match row {
        None => MediaState::Missing,
        Some((status, key, _)) if status == "awaiting_upload" => MediaState::AwaitingUpload { uploaded: key.is_some() },
        Some((_, _, operation_id)) => {
            MediaState::Completed { operation_id: operation_id.expect("a completed media has its operation") }
        }
    })
}

/// What [`record_upload_tx`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UploadRecorded {
    /// The media now points at the new object; `replaced` is the earlier upload's, to delete once committed.
    Recorded {
        /// The object of the upload this one replaces.
        replaced: Option<ObjectKey>,
    },
    /// The media is missing or no longer `awaiting_upload`: nothing changed.
    Refused(MediaState),
}

/// Points media `id` at a freshly stored upload, only while it is still `awaiting_upload` (decided by the UPDATE's
/// condition, under the row's lock, so a completion and an upload never interleave).
pub async fn record_upload_tx(
    tx: &mut WorkspaceTx,
    id: Uuid,
    object: &ObjectKey,
    size_bytes: u64,
) -> Result<UploadRecorded, sqlx::Error> {
    let replaced: Option<(Option<String>,)> = sqlx::query_as(
        "UPDATE conveyor_shop.media m SET object_key = $2, uploaded_size = $3, updated_at = now()
         FROM (SELECT id, object_key FROM conveyor_shop.media WHERE id = $1 FOR UPDATE) old
         WHERE m.id = old.id AND m.status = 'awaiting_upload'
         RETURNING old.object_key",
    )
    .bind(id)
    .bind(object.as_str())
    .bind(db_size(size_bytes))
    .fetch_optional(&mut **tx)
    .await?;
    Ok(match replaced {
        Some((old,)) => UploadRecorded::Recorded { replaced: old.and_then(|k| ObjectKey::parse(&k).ok()) },
        None => UploadRecorded::Refused(state_tx(tx, id).await?),
    })
}

/// A media now `processing` and the operation that processes it.
#[derive(Clone, Debug, Serialize)]
pub struct Completion {
    /// The media.
    pub media: Media,
    /// The queued `media.process` operation.
    pub operation: Operation,
}

/// Why a completion was refused.
#[derive(Debug, thiserror::Error)]
pub enum CompleteError {
    /// No such media in the workspace.
    #[error("media not found")]
    NotFound,
    /// Nothing was uploaded yet.
    #[error("the media has no uploaded content yet; PUT its upload_url first")]
    NotUploaded,
    /// It was completed before (under another key): its operation.
    #[error("the media was already completed")]
    AlreadyCompleted(Uuid),
    /// PostgreSQL failed.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

async fn queue_processing_tx(
    tx: &mut WorkspaceTx,
    workspace_id: WorkspaceId,
    created_by: UserId,
    media_id: Uuid,
    trace: Option<conveyor_jobs::TraceContext>,
) -> Result<Operation, sqlx::Error> {
    let operation =
        conveyor_jobs::create_operation_tx(tx, workspace_id, created_by, PROCESS_KIND, Some(media_id)).await?;
    let mut options = EnqueueOptions::new().operation(operation.id);
    if let Some(trace) = trace {
        options = options.trace(trace);
    }
    conveyor_jobs::enqueue_tx(tx, &ProcessMedia { media_id }, options).await.map_err(|e| match e {
        EnqueueError::Database(e) => e,
        // A fixed kind with valid options and a payload of ids: none of these can happen.
        other => sqlx::Error::Protocol(other.to_string()),
    })?;
    Ok(operation)
}

/// Completes the upload of media `id`: one conditional UPDATE moves it from `awaiting_upload` (with an upload) to
/// `processing` with a new operation, and its `media.process` job is queued, in the caller's transaction. A
/// concurrent completion waits for the row and then finds it completed: [`CompleteError::AlreadyCompleted`].
///
/// A media whose processing operation ended without processing it (`canceled`, or `failed` after its retries, e.g.
/// object storage down for that long) is still `processing`; completing it again queues a new operation. While its
/// operation is live or once it succeeded, any further completion is [`CompleteError::AlreadyCompleted`].
pub async fn complete_tx(
    tx: &mut WorkspaceTx,
    workspace_id: WorkspaceId,
    created_by: UserId,
    id: Uuid,
    trace: Option<conveyor_jobs::TraceContext>,
) -> Result<Completion, CompleteError> {
    let operation = queue_processing_tx(tx, workspace_id, created_by, id, trace).await?;
    let completed = sqlx::query(
        "UPDATE conveyor_shop.media SET status = 'processing', operation_id = $2, updated_at = now()
         WHERE id = $1
           AND (   (status = 'awaiting_upload' AND object_key IS NOT NULL)
                OR (status = 'processing' AND EXISTS (SELECT 1 FROM conveyor.operations o
                                                      WHERE o.id = media.operation_id
                                                        AND o.status IN ('failed', 'canceled'))))",
    )
    .bind(id)
    .bind(operation.id)
    .execute(&mut **tx)
    .await?;
    if completed.rows_affected() == 0 {
        // The caller rolls back, taking the operation and the job with it.
        return Err(match state_tx(tx, id).await? {
            MediaState::Missing => CompleteError::NotFound,
            MediaState::AwaitingUpload { .. } => CompleteError::NotUploaded,
            MediaState::Completed { operation_id } => CompleteError::AlreadyCompleted(operation_id),
        });
    }
    let media = get_tx(tx, id).await?.expect("the media was just completed");
    Ok(Completion { media, operation })
}

/// Makes an object already in storage (a finished asset transfer) a media in `processing` and queues its
/// `media.process` job and operation, in the caller's transaction.
#[allow(clippy::too_many_arguments)]
pub async fn adopt_object_tx(
    tx: &mut WorkspaceTx,
    workspace_id: WorkspaceId,
    created_by: UserId,
    filename: &str,
    content_type: &str,
    size_bytes: u64,
    object: &ObjectKey,
    trace: Option<conveyor_jobs::TraceContext>,
) -> Result<(Media, Operation), sqlx::Error> {
    let id = Uuid::now_v7();
    // A name the API would refuse still makes a media (the job decides on the bytes); keep it within the column's
    // rule.
    let filename = if validate_filename(filename).is_ok() { filename.to_owned() } else { format!("{id}") };
    let operation = queue_processing_tx(tx, workspace_id, created_by, id, trace).await?;
    sqlx::query(
        "INSERT INTO conveyor_shop.media (id, workspace_id, filename, content_type, declared_size, status, object_key,
                            uploaded_size, operation_id, created_by)
         VALUES ($1, $2, $3, $4, $5, 'processing', $6, $5, $7, $8)",
    )
    .bind(id)
    .bind(workspace_id.0)
    .bind(&filename)
    .bind(content_type)
    .bind(db_size(size_bytes))
    .bind(object.as_str())
    .bind(operation.id)
    .bind(created_by.0)
    .execute(&mut **tx)
    .await?;
    let media = get_tx(tx, id).await?.expect("the media was just inserted");
    Ok((media, operation))
}
