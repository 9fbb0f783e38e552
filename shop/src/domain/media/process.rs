//! `media.process`, the part that knows PostgreSQL and object storage: read the original (bounded), check it, find
//! or make its derivation, and record the media `ready` or `rejected`, all in the job's transaction.
//!
//! Derivation is keyed by content, at two levels:
//! - `media_derivations` has one row per (workspace, sha256), written in the job's transaction under a
//!   transaction-level advisory lock on that pair: a media whose bytes were derived before (or are being derived by a
//!   concurrent job, which it waits for) points at that row and derives nothing;
//! - the derivatives' objects are keyed by the content too, with a manifest written last: a job that crashed after
//!   storing them but before committing finds the manifest on its retry and derives nothing again.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use uuid::Uuid;

use super::images::{self, Checked, ImageLimits, Refusal};
use super::{DERIVATIONS_COLLECTION, StoredDerivative};
use crate::storage::{ObjectKey, ObjectStorage, StorageError};
use conveyor_jobs::WorkspaceId;
use conveyor_jobs::WorkspaceTx;

/// Bounds the runs that hold image bytes at once in this process (from reading the original to storing the
/// derivatives): at most `permits` runs, whose memory together stays within the decode memory
/// (`CONVEYOR_MEDIA_DECODE_MEMORY`), however many jobs the worker runs at once. Cheap to clone.
///
/// A run takes a permit, then reserves the original's size (and what inspecting its header takes) before reading it,
/// then, from the header, all that decoding and deriving it takes ([`images::Checked::memory`]) before decoding. The
/// memory is counted in KiB on a fair semaphore. The second reservation is only ever *tried* while the first is held:
/// when the memory is not free, the run lets its original go and waits for the whole reservation at once, holding no
/// memory while it waits (then reads the original again), so two runs never each hold part of what the other waits
/// for.
///
/// What a run holds moves into every blocking closure that works on the bytes and comes back out with its result: a
/// job whose future is dropped mid-decode (canceled, timed out) does not free its permit or its memory while the
/// decode it started goes on running on its blocking thread; they are released when that work and the bytes it holds
/// are gone.
#[derive(Clone, Debug)]
pub struct DecodeGate {
    permits: Arc<Semaphore>,
    memory: Arc<Semaphore>,
    memory_kib: u32,
}

/// What a run holds: one of the gate's permits and its memory.
#[derive(Debug)]
struct Held {
    _permit: OwnedSemaphorePermit,
    memory: OwnedSemaphorePermit,
}

/// What reading an original and inspecting its header may take besides the original itself.
const INSPECT_BYTES: u64 = 8 * 1024 * 1024;

fn kib(bytes: u64) -> u32 {
    u32::try_from(bytes.div_ceil(1024)).unwrap_or(u32::MAX)
}

impl DecodeGate {
    /// At most `permits` decodes at once (at least one), holding at most `memory` bytes together (at most 4 TiB).
    pub fn new(permits: usize, memory: u64) -> Self {
        let memory_kib = kib(memory).max(1);
        Self {
            permits: Arc::new(Semaphore::new(permits.max(1))),
            memory: Arc::new(Semaphore::new(memory_kib as usize)),
            memory_kib,
        }
    }

    /// Permits free right now (for tests and metrics).
    pub fn available(&self) -> usize {
        self.permits.available_permits()
    }

    /// Bytes of decode memory not reserved right now (to the KiB).
    #[cfg(test)]
    fn memory_available(&self) -> u64 {
        self.memory.available_permits() as u64 * 1024
    }

    /// The decode memory, all of it (to the KiB).
    pub fn memory(&self) -> u64 {
        u64::from(self.memory_kib) * 1024
    }

    async fn permit(&self) -> OwnedSemaphorePermit {
        self.permits.clone().acquire_owned().await.expect("the gate is never closed")
    }

    /// Waits for `bytes` of memory (at most all of it).
    async fn reserve(&self, bytes: u64) -> OwnedSemaphorePermit {
        let kib = kib(bytes).min(self.memory_kib);
        self.memory.clone().acquire_many_owned(kib).await.expect("the gate is never closed")
    }

    /// Grows `held` to `bytes` if that much is free now.
    fn try_grow(&self, held: &mut OwnedSemaphorePermit, bytes: u64) -> bool {
        let more = kib(bytes).min(self.memory_kib).saturating_sub(held.num_permits() as u32);
        if more == 0 {
            return true;
        }
        match self.memory.clone().try_acquire_many_owned(more) {
            Ok(extra) => {
                held.merge(extra);
                true
            }
            Err(_) => false,
        }
    }
}

/// What processing needs besides the transaction.
#[derive(Clone, Debug)]
pub struct ProcessSettings {
    /// Object storage (originals and derivatives).
    pub storage: ObjectStorage,
    /// `CONVEYOR_MEDIA_MAX_BYTES` and `CONVEYOR_MEDIA_MAX_PIXELS`.
    pub limits: ImageLimits,
    /// The process's bound on concurrent decodes and their memory (`CONVEYOR_MEDIA_DECODE_PERMITS`,
    /// `CONVEYOR_MEDIA_DECODE_MEMORY`).
    pub gate: DecodeGate,
}

/// How a derivation was obtained.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Derivation {
    /// Decoded and derived now.
    Derived,
    /// The workspace had these bytes derived already (another media, or an earlier run's stored manifest).
    Reused,
}

impl Derivation {
    /// The `result` label of `conveyor_media_derivations_total`.
    pub fn label(self) -> &'static str {
        match self {
            Self::Derived => "derived",
            Self::Reused => "reused",
        }
    }
}

/// What a run of `media.process` did: the operation's result.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum ProcessOutcome {
    /// The media is `ready`.
    Ready {
        /// Derived now or reused.
        derivation: Derivation,
        /// Pixels.
        width: u32,
        /// Pixels.
        height: u32,
    },
    /// The media is `rejected`.
    Rejected {
        /// The rejection code.
        code: &'static str,
        /// Text for the client.
        detail: String,
    },
    /// The media was not `processing` any more (a run of this job committed before): nothing done.
    AlreadyDone {
        /// Its status.
        status: String,
    },
    /// The media no longer exists.
    MediaGone,
}

/// Why a run could not finish (worth retrying: nothing of it committed).
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    /// Object storage failed, or the original is missing.
    #[error(transparent)]
    Storage(#[from] StorageError),
    /// PostgreSQL failed.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    /// A blocking task panicked.
    #[error("image processing panicked: {0}")]
    Panicked(String),
}

/// The manifest stored beside a derivation's objects, written after them.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Manifest {
    width: u32,
    height: u32,
    derivatives: Vec<StoredDerivative>,
}

/// The id of the derivation of content `sha256` in a workspace (16 bytes of a hash of both): the same bytes in the
/// same workspace always map to the same objects; workspaces never share a derivation.
fn derivation_id(workspace_id: WorkspaceId, sha256: &[u8; 32]) -> Uuid {
    let digest = Sha256::new().chain_update(workspace_id.0.as_bytes()).chain_update(sha256).finalize();
    Uuid::from_slice(&digest[..16]).expect("16 bytes")
}

/// Runs `media.process` for media `media_id` in the job's transaction `tx`.
pub async fn process_tx(
    tx: &mut WorkspaceTx,
    settings: &ProcessSettings,
    workspace_id: WorkspaceId,
    media_id: Uuid,
) -> Result<ProcessOutcome, ProcessError> {
    let row: Option<(String, String, Option<String>)> =
        sqlx::query_as("SELECT status, content_type, object_key FROM conveyor_shop.media WHERE id = $1 FOR UPDATE")
            .bind(media_id)
            .fetch_optional(&mut **tx)
            .await?;
    let Some((status, content_type, object_key)) = row else { return Ok(ProcessOutcome::MediaGone) };
    if status != "processing" {
        return Ok(ProcessOutcome::AlreadyDone { status });
    }
    let object = ObjectKey::parse(object_key.as_deref().expect("a processing media has its object"))?;
    let limits = settings.limits;
    let gate = &settings.gate;
    // Held until the end: the original and its pixels are in memory from here on. Taken before the advisory lock
    // below, so the holder of that lock always holds a permit and its memory too and can finish. It moves into each
    // blocking closure and back (see [`DecodeGate`]).
    let permit = gate.permit().await;

    // Never read more than the limit: the size first, then a bounded read (in case the object grew meanwhile).
    let too_large =
        || Refusal { code: images::RejectionCode::TooLarge, detail: format!("larger than {} bytes", limits.max_bytes) };
    let size = settings.storage.size(&object).await?.ok_or_else(|| StorageError::NotFound(object.to_string()))?;
    if size > limits.max_bytes {
        return reject_tx(tx, media_id, None, too_large()).await;
    }
    let memory = gate.reserve(size + INSPECT_BYTES).await;
    let Some(bytes) = read_bounded(&settings.storage, &object, size, limits.max_bytes).await? else {
        return reject_tx(tx, media_id, None, too_large()).await;
    };

    let held = Held { _permit: permit, memory };
    let ((bytes, sha256, inspected), mut held) = blocking(held, move || {
        let sha256: [u8; 32] = Sha256::digest(&bytes).into();
        let inspected = guarded(|| images::inspect(&content_type, &bytes, limits));
        (bytes, sha256, inspected)
    })
    .await?;
    let sha_hex = hex(&sha256);
    let checked = match inspected.and_then(|checked| images::check_memory(&checked, gate.memory()).map(|()| checked)) {
        Ok(checked) => checked,
        Err(refusal) => return reject_tx(tx, media_id, Some(&sha_hex), refusal).await,
    };
    // All that decoding it takes, before a pixel is decoded: at once if it is free, else without holding any of it
    // while waiting (the original is read again once it is reserved).
    let bytes = if gate.try_grow(&mut held.memory, checked.memory) {
        bytes
    } else {
        drop(bytes);
        drop(held.memory);
        held.memory = gate.reserve(checked.memory).await;
        let again = read_bounded(&settings.storage, &object, size, limits.max_bytes).await?;
        match again.filter(|again| Sha256::digest(again).as_slice() == sha256) {
            Some(again) => again,
            // An original's object is written once; a different one is a storage fault, worth a retry.
            None => return Err(StorageError::Backend(format!("{object} changed while it was processed")).into()),
        }
    };
    let permit = held;

    // One derivation per content in the workspace: wait for a concurrent job on the same bytes, then look.
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))")
        .bind(format!("conveyor-media-derivation:{workspace_id}:{sha_hex}"))
        .execute(&mut **tx)
        .await?;
    let existing: Option<(Uuid, i32, i32)> =
        sqlx::query_as("SELECT id, width, height FROM conveyor_shop.media_derivations WHERE sha256 = $1")
            .bind(&sha_hex)
            .fetch_optional(&mut **tx)
            .await?;
    let (derivation, id, width, height) = match existing {
        Some((id, width, height)) => (Derivation::Reused, id, width as u32, height as u32),
        None => {
            let id = derivation_id(workspace_id, &sha256);
            let (derivation, manifest) = match stored_manifest(&settings.storage, workspace_id, id).await? {
                Some(manifest) => (Derivation::Reused, manifest),
                None => match derive_and_store(settings, permit, workspace_id, id, bytes, checked).await? {
                    Ok(manifest) => (Derivation::Derived, manifest),
                    Err(refusal) => return reject_tx(tx, media_id, Some(&sha_hex), refusal).await,
                },
            };
            sqlx::query(
                "INSERT INTO conveyor_shop.media_derivations (id, workspace_id, sha256, content_type, width, height, derivatives)
                 VALUES ($1, $2, $3, $4, $5, $6, $7)",
            )
            .bind(id)
            .bind(workspace_id.0)
            .bind(&sha_hex)
            .bind(checked.format.content_type())
            .bind(manifest.width as i32)
            .bind(manifest.height as i32)
            .bind(sqlx::types::Json(&manifest.derivatives))
            .execute(&mut **tx)
            .await?;
            (derivation, id, manifest.width, manifest.height)
        }
    };
    sqlx::query("UPDATE conveyor_shop.media SET status = 'ready', derivation_id = $2, sha256 = $3, updated_at = now() WHERE id = $1")
        .bind(media_id)
        .bind(id)
        .bind(&sha_hex)
        .execute(&mut **tx)
        .await?;
    Ok(ProcessOutcome::Ready { derivation, width, height })
}

async fn reject_tx(
    tx: &mut WorkspaceTx,
    media_id: Uuid,
    sha256: Option<&str>,
    refusal: Refusal,
) -> Result<ProcessOutcome, ProcessError> {
    sqlx::query(
        "UPDATE conveyor_shop.media SET status = 'rejected', rejection_code = $2, rejection_detail = $3, sha256 = $4,
                          updated_at = now()
         WHERE id = $1",
    )
    .bind(media_id)
    .bind(refusal.code.as_str())
    .bind(&refusal.detail)
    .bind(sha256)
    .execute(&mut **tx)
    .await?;
    Ok(ProcessOutcome::Rejected { code: refusal.code.as_str(), detail: refusal.detail })
}

/// The object, or `None` once it passes `max_bytes` (reading at most one chunk past the limit), into a buffer of its
/// announced `size` (no copy as it grows, unless the object grew meanwhile).
async fn read_bounded(
    storage: &ObjectStorage,
    object: &ObjectKey,
    size: u64,
    max_bytes: u64,
) -> Result<Option<bytes::Bytes>, StorageError> {
    use futures_util::StreamExt;
    let mut stream = std::pin::pin!(storage.stream(object).await?);
    let mut buffer = bytes::BytesMut::with_capacity(usize::try_from(size.min(max_bytes)).unwrap_or(0));
    while let Some(chunk) = stream.next().await {
        let chunk = chunk?;
        if (buffer.len() + chunk.len()) as u64 > max_bytes {
            return Ok(None);
        }
        buffer.extend_from_slice(&chunk);
    }
    Ok(Some(buffer.freeze()))
}

fn manifest_key(workspace_id: WorkspaceId, derivation_id: Uuid) -> ObjectKey {
    ObjectKey::new(workspace_id.0, DERIVATIONS_COLLECTION, derivation_id, "manifest.json")
}

async fn stored_manifest(
    storage: &ObjectStorage,
    workspace_id: WorkspaceId,
    derivation_id: Uuid,
) -> Result<Option<Manifest>, StorageError> {
    match storage.get(&manifest_key(workspace_id, derivation_id)).await {
        // An unreadable manifest (from another release) is derived again and overwritten.
        Ok(bytes) => Ok(serde_json::from_slice(&bytes).ok()),
        Err(StorageError::NotFound(_)) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Decodes and derives on a blocking thread, then stores the derivatives and, last, their manifest.
async fn derive_and_store(
    settings: &ProcessSettings,
    permit: Held,
    workspace_id: WorkspaceId,
    derivation_id: Uuid,
    bytes: bytes::Bytes,
    checked: Checked,
) -> Result<Result<Manifest, Refusal>, ProcessError> {
    let limits = settings.limits;
    let (derived, _permit) = blocking(permit, move || {
        guarded(|| {
            // Test hook: a decoder that panics.
            fail::fail_point!("media::derive");
            images::derive(&bytes, checked, limits)
        })
    })
    .await?;
    let derived = match derived {
        Ok(derived) => derived,
        Err(refusal) => return Ok(Err(refusal)),
    };
    let mut derivatives = Vec::with_capacity(derived.images.len());
    for image in derived.images {
        let key = ObjectKey::new(workspace_id.0, DERIVATIONS_COLLECTION, derivation_id, image.name);
        let size_bytes = image.bytes.len() as u64;
        settings.storage.put(&key, image.bytes).await?;
        derivatives.push(StoredDerivative {
            name: image.name.to_owned(),
            width: image.width,
            height: image.height,
            content_type: image.content_type.to_owned(),
            size_bytes,
            object_key: key.as_str().to_owned(),
        });
    }
    let manifest = Manifest { width: derived.width, height: derived.height, derivatives };
    let json = serde_json::to_vec(&manifest).expect("a manifest serializes");
    settings.storage.put(&manifest_key(workspace_id, derivation_id), json.into()).await?;
    Ok(Ok(manifest))
}

/// Runs `work` on a blocking thread holding `permit` (and its memory), and hands them back with the result. If the
/// caller's future is dropped meanwhile, they stay with the work until it ends.
async fn blocking<T: Send + 'static>(
    permit: Held,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<(T, Held), ProcessError> {
    tokio::task::spawn_blocking(move || (work(), permit)).await.map_err(|e| ProcessError::Panicked(e.to_string()))
}

/// Runs the checks or the derivation of one image, a panic (a decoder bug on hostile bytes) becoming a `CORRUPT`
/// refusal: the media ends `rejected` instead of staying `processing` while its job is retried into a dead letter.
fn guarded<T>(work: impl FnOnce() -> Result<T, Refusal>) -> Result<T, Refusal> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(work)) {
        Ok(result) => result,
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            tracing::warn!(panic = %what, "The image decoder panicked; the media is rejected as corrupt");
            Err(panic_refusal())
        }
    }
}

/// What a client is told of an image the decoder panicked on.
fn panic_refusal() -> Refusal {
    Refusal { code: images::RejectionCode::Corrupt, detail: "the image could not be decoded".to_owned() }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn memory_is_reserved_whole_or_waited_for_without_holding_any() {
        let gate = DecodeGate::new(2, 100 << 20);
        assert_eq!(gate.memory(), 100 << 20);
        let mut first = gate.reserve(10 << 20).await;
        assert!(gate.try_grow(&mut first, 80 << 20), "80 of 100 MiB are free");
        let mut second = gate.reserve(10 << 20).await;
        assert!(!gate.try_grow(&mut second, 30 << 20), "only 10 MiB are left");
        assert_eq!(gate.memory_available(), 10 << 20, "a failed try takes nothing");
        // The second run lets its part go and waits for the whole: the first finishes and it gets it.
        drop(second);
        let waiting = tokio::spawn({
            let gate = gate.clone();
            async move { gate.reserve(30 << 20).await }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        drop(first);
        let second = waiting.await.unwrap();
        assert_eq!(second.num_permits() as u64 * 1024, 30 << 20);
        // Never more than all of it, however much is asked.
        drop(second);
        assert_eq!(gate.reserve(1 << 40).await.num_permits() as u64 * 1024, 100 << 20);
    }

    #[test]
    fn a_panic_in_the_decoder_is_a_corrupt_refusal() {
        let refused = guarded::<()>(|| panic!("index out of bounds in a decoder"));
        assert_eq!(refused, Err(panic_refusal()));
        assert_eq!(refused.unwrap_err().code, images::RejectionCode::Corrupt);
        assert_eq!(guarded(|| Ok::<_, Refusal>(7)), Ok(7));
    }
}
