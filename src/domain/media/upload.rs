//! Streams an upload into object storage without holding it whole: the body is cut into parts of
//! [`PART_BYTES`], each stored as its own object and concatenated into the final object at the end (a body of one
//! part is stored directly). Memory per upload stays at one part, whatever the body's size.

use bytes::{Bytes, BytesMut};
use futures_util::{Stream, StreamExt};
use uuid::Uuid;

use super::COLLECTION;
use crate::ids::WorkspaceId;
use crate::storage::{ObjectKey, ObjectStorage, StorageError};

/// Largest part held in memory by one upload.
pub const PART_BYTES: usize = 8 * 1024 * 1024;

/// Why an upload was not stored.
#[derive(Debug, thiserror::Error)]
pub enum UploadError {
    /// The body is larger than the limit (nothing is kept).
    #[error("the upload exceeds {0} bytes")]
    TooLarge(u64),
    /// The body could not be read (the client went away).
    #[error("the upload could not be read: {0}")]
    Body(String),
    /// Object storage failed.
    #[error(transparent)]
    Storage(#[from] StorageError),
}

/// Stores `body` under a new object of media `media_id`, refusing it once it passes `max_bytes`. Returns the object
/// and its size. On any error, the parts written so far are deleted and no object is left under the returned key.
pub async fn store_upload<S, E>(
    storage: &ObjectStorage,
    workspace_id: WorkspaceId,
    media_id: Uuid,
    body: S,
    max_bytes: u64,
) -> Result<(ObjectKey, u64), UploadError>
where
    S: Stream<Item = Result<Bytes, E>> + Send,
    E: std::fmt::Display,
{
    let upload = Uuid::now_v7().simple().to_string();
    let key = ObjectKey::new(workspace_id.0, COLLECTION, media_id, &format!("uploads/{upload}"));
    let mut parts: Vec<ObjectKey> = Vec::new();
    let result = stream_parts(storage, workspace_id, media_id, &upload, body, max_bytes, &key, &mut parts).await;
    for part in &parts {
        if let Err(e) = storage.delete(part).await {
            tracing::warn!(part = %part, error = %e, "Failed to delete an upload part; it stays as garbage");
        }
    }
    result.map(|size| (key, size))
}

#[allow(clippy::too_many_arguments)]
async fn stream_parts<S, E>(
    storage: &ObjectStorage,
    workspace_id: WorkspaceId,
    media_id: Uuid,
    upload: &str,
    body: S,
    max_bytes: u64,
    key: &ObjectKey,
    parts: &mut Vec<ObjectKey>,
) -> Result<u64, UploadError>
where
    S: Stream<Item = Result<Bytes, E>> + Send,
    E: std::fmt::Display,
{
    let mut body = std::pin::pin!(body);
    let mut buffer = BytesMut::new();
    let mut total = 0u64;
    while let Some(chunk) = body.next().await {
        let mut chunk = chunk.map_err(|e| UploadError::Body(e.to_string()))?;
        total += chunk.len() as u64;
        if total > max_bytes {
            return Err(UploadError::TooLarge(max_bytes));
        }
        while !chunk.is_empty() {
            let take = chunk.len().min(PART_BYTES - buffer.len());
            buffer.extend_from_slice(&chunk.split_to(take));
            if buffer.len() == PART_BYTES {
                let part = ObjectKey::new(
                    workspace_id.0,
                    COLLECTION,
                    media_id,
                    &format!("uploads/{upload}.parts/{:05}", parts.len()),
                );
                parts.push(part.clone());
                storage.put(&part, buffer.split().freeze()).await?;
            }
        }
    }
    if parts.is_empty() {
        storage.put(key, buffer.freeze()).await?;
        return Ok(total);
    }
    if !buffer.is_empty() {
        let part =
            ObjectKey::new(workspace_id.0, COLLECTION, media_id, &format!("uploads/{upload}.parts/{:05}", parts.len()));
        parts.push(part.clone());
        storage.put(&part, buffer.freeze()).await?;
    }
    storage.concat(key, parts).await?;
    Ok(total)
}
