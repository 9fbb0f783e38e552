//! Streams an upload into object storage without holding it whole: the body is gathered into parts of
//! [`PART_BYTES`], each written to the object's multipart upload and freed before the next is read (one part in
//! memory and in flight at a time); a body of one part is stored with a single put. Memory per upload stays at one
//! part, whatever the body's size, and the object becomes visible only once complete.

use bytes::{Bytes, BytesMut};
use futures_util::{Stream, StreamExt};
use uuid::Uuid;

use super::COLLECTION;
use crate::storage::{ObjectKey, ObjectStorage, PartUpload, StorageError};
use conveyor_jobs::WorkspaceId;

/// Largest part held in memory by one upload: 5 MiB, the smallest part S3 takes (every part but the last).
pub const PART_BYTES: usize = 5 * 1024 * 1024;

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

/// Stores `body` under a new object of media `media_id`, refusing it once it passes `max_bytes`. `announced` (the
/// request's `Content-Length`, if any) sizes the buffer of a body smaller than a part. Returns the object and its
/// size. On any error, the upload is aborted and no object is left under the returned key.
pub async fn store_upload<S, E>(
    storage: &ObjectStorage,
    workspace_id: WorkspaceId,
    media_id: Uuid,
    body: S,
    announced: Option<u64>,
    max_bytes: u64,
) -> Result<(ObjectKey, u64), UploadError>
where
    S: Stream<Item = Result<Bytes, E>> + Send,
    E: std::fmt::Display,
{
    let upload = Uuid::now_v7().simple().to_string();
    let key = ObjectKey::new(workspace_id.0, COLLECTION, media_id, &format!("uploads/{upload}"));
    let mut parts: Option<PartUpload> = None;
    let result = stream_parts(storage, &key, body, announced, max_bytes, &mut parts).await;
    match (result, parts) {
        (Ok(size), Some(parts)) => {
            parts.finish().await?;
            Ok((key, size))
        }
        (Ok(size), None) => Ok((key, size)),
        (Err(e), parts) => {
            if let Some(parts) = parts
                && let Err(abort) = parts.abort().await
            {
                tracing::warn!(object = %key, error = %abort, "Failed to abort an upload; its parts stay as garbage");
            }
            Err(e)
        }
    }
}

async fn stream_parts<S, E>(
    storage: &ObjectStorage,
    key: &ObjectKey,
    body: S,
    announced: Option<u64>,
    max_bytes: u64,
    parts: &mut Option<PartUpload>,
) -> Result<u64, UploadError>
where
    S: Stream<Item = Result<Bytes, E>> + Send,
    E: std::fmt::Display,
{
    // One buffer for the whole upload, allocated at the first bytes at its full size (no copy as it fills), no larger
    // than the body says when that is less than a part; each part's bytes are handed to storage and the buffer
    // reclaimed once they are stored, so an upload holds one allocation whatever its number of parts.
    let first = announced.map_or(PART_BYTES, |n| usize::try_from(n).unwrap_or(PART_BYTES).clamp(1, PART_BYTES));
    let mut body = std::pin::pin!(body);
    let mut buffer = BytesMut::new();
    let mut total = 0u64;
    while let Some(chunk) = body.next().await {
        let mut chunk = chunk.map_err(|e| UploadError::Body(e.to_string()))?;
        total += chunk.len() as u64;
        if total > max_bytes {
            return Err(UploadError::TooLarge(max_bytes));
        }
        if buffer.capacity() == 0 {
            buffer.reserve(first);
        }
        while !chunk.is_empty() {
            let take = chunk.len().min(PART_BYTES - buffer.len());
            buffer.extend_from_slice(&chunk.split_to(take));
            if buffer.len() == PART_BYTES {
                let part = buffer.split().freeze();
                let upload = match parts {
                    Some(upload) => upload,
                    None => parts.insert(storage.start_upload(key).await?),
                };
                upload.put_part(part).await?;
                // The part is stored and its bytes dropped: this takes the same allocation back.
                buffer.reserve(PART_BYTES);
            }
        }
    }
    match parts {
        None => storage.put(key, buffer.freeze()).await?,
        Some(upload) if !buffer.is_empty() => upload.put_part(buffer.freeze()).await?,
        Some(_) => {}
    }
    Ok(total)
}
