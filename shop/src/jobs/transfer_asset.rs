//! `asset.transfer`: downloads a transfer's source into object storage (SSRF-safe, resumable, part by part), then
//! makes the object a media that goes through `media.process`.
//!
//! A run's download has a deadline (`CONVEYOR_ASSET_MAX_DURATION`) and a minimum throughput
//! (`CONVEYOR_ASSET_MIN_THROUGHPUT`); a run past either fails `SOURCE_TOO_SLOW`, which is retried only after a first run
//! ([`TRANSFER_TOO_SLOW_ATTEMPTS`]), not on every attempt the kind has: a source too slow holds a worker's slot for two
//! runs of at most a deadline each. The job's time-out is the deadline plus [`TRANSFER_FINISH_TIME`], so the deadline
//! ends a slow run first.
//!
//! The run holds the job's transaction (and so its lock) from the start, so a second delivery of the same job waits
//! instead of downloading beside it. Progress commits part by part in transactions of its own; the completion (the
//! transfer `completed`, the media, its `media.process` job) commits in the job's transaction, once.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use serde_json::json;
use sqlx::PgPool;
use uuid::Uuid;

use crate::adapters::fetch::{self, FetchError, Fetcher, PartSink, Progress, SinkError};
use crate::domain::asset_transfers::{self, object_key, part_key};
use crate::storage::{ObjectStorage, StorageError};
use conveyor_jobs::WorkspaceId;
use conveyor_jobs::{Handler, JobContext, JobError, JobKind};

/// Transfer one asset. Ids only: the worker reads the source URL inside the job's workspace transaction.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransferAsset {
    /// The transfer.
    pub asset_transfer_id: Uuid,
}

impl JobKind for TransferAsset {
    const KIND: &'static str = "asset.transfer";
    const QUEUE: &'static str = "transfers";
    /// A large file on a slow source takes long; a crash costs one part, not the run. [`TransferAssetHandler`]
    /// replaces it by its deadline plus [`TRANSFER_FINISH_TIME`].
    const TIMEOUT: Duration = Duration::from_secs(30 * 60);
}

/// What a transfer's run may take beyond its download's deadline (`CONVEYOR_ASSET_MAX_DURATION`): assembling the
/// parts into one object (a copy and a hash of up to `CONVEYOR_ASSET_MAX_BYTES`) and committing. The handler's
/// time-out is the deadline plus this, so a slow source ends `SOURCE_TOO_SLOW` before the job times out.
pub(crate) const TRANSFER_FINISH_TIME: Duration = Duration::from_secs(5 * 60);

/// Runs that may end `SOURCE_TOO_SLOW`: a run too slow is retried (resuming where it stopped) only when it was the
/// first run; later, it fails the transfer, whatever attempts the kind has left.
pub(crate) const TRANSFER_TOO_SLOW_ATTEMPTS: u32 = 2;

/// Runs [`TransferAsset`] jobs.
pub struct TransferAssetHandler {
    /// A few connections of its own for progress commits, apart from the pool the jobs' transactions hold: a running
    /// transfer keeps its job's transaction open for the whole download, and with every connection of the worker's
    /// pool held that way, a commit of progress on the same pool would wait for ever.
    progress_pool: PgPool,
    storage: ObjectStorage,
    fetcher: Arc<Fetcher>,
    max_attempts: u32,
}

impl Handler<TransferAsset> for TransferAssetHandler {
    async fn handle(&self, job: TransferAsset, cx: &mut JobContext) -> Result<serde_json::Value, JobError> {
        // The run's deadline and throughput windows count from here, through a download started over.
        let started = Instant::now();
        let (workspace, id) = (cx.workspace_id(), job.asset_transfer_id);
        let transfer = asset_transfers::job_tx(cx.tx().await?, id)
            .await?
            .ok_or_else(|| JobError::permanent("the asset transfer does not exist"))?;
        // Ended by an earlier run (whose own end was not recorded) or by a cancellation: nothing to do again.
        match transfer.status.as_str() {
            "completed" => return Ok(json!({ "asset_transfer_id": id, "status": "completed" })),
            "failed" => return Err(JobError::permanent("the asset transfer has already failed")),
            _ => {}
        }

        let source_url = transfer
            .source_url
            .clone()
            .ok_or_else(|| JobError::permanent("the asset transfer has no source URL any more"))?;
        let mut progress = transfer.progress.clone();
        let cancel = cx.cancellation().clone();
        let mut stored_parts = progress.parts;
        // A second pass only when a stored part went missing: the download starts over from zero.
        let (size, sha256) = loop {
            let mut sink = TransferSink {
                pool: &self.progress_pool,
                storage: &self.storage,
                workspace,
                id,
                cx: &*cx,
                stored_parts,
                shown_at: None,
            };
            let downloaded = self.fetcher.download_since(started, &source_url, &mut progress, &mut sink, &cancel).await;
            stored_parts = sink.stored_parts.max(progress.parts);
            if let Err(e) = downloaded {
                return Err(self.failed(cx, id, stored_parts, e).await);
            }
            match asset_transfers::assemble(&self.storage, workspace, id, &progress).await {
                Ok(assembled) => break assembled,
                Err(StorageError::NotFound(missing)) if progress.bytes_done > 0 => {
                    // A part recorded as stored is gone (deleted by hand, or by a run that died between deleting
                    // and resetting): waiting cannot bring it back. Start over, progress reset first.
                    tracing::warn!(asset_transfer_id = %id, missing, "A stored part is missing; downloading again");
                    progress = Progress::default();
                    let mut sink = TransferSink {
                        pool: &self.progress_pool,
                        storage: &self.storage,
                        workspace,
                        id,
                        cx: &*cx,
                        stored_parts,
                        shown_at: None,
                    };
                    if let Err(e) = sink.begin(&progress, true).await {
                        return Err(self.failed(cx, id, stored_parts, e.into()).await);
                    }
                    stored_parts = 0;
                }
                Err(e) => return Err(storage_unavailable(id, e)),
            }
        };
        let object = object_key(workspace, id);
        if size != progress.bytes_done {
            tracing::warn!(asset_transfer_id = %id, size, bytes_done = progress.bytes_done, "Stored size differs");
            return Err(JobError::Retryable(format!("stored {size} bytes, downloaded {}", progress.bytes_done)));
        }
        let trace = Some(cx.trace());
        let completed = asset_transfers::complete_tx(
            cx.tx().await?,
            workspace,
            id,
            &asset_transfers::Job { progress: progress.clone(), ..transfer },
            size,
            &sha256,
            &object,
            trace,
        )
        .await?;
        for index in 0..stored_parts {
            // Leftovers cost space, not correctness: a failed delete is not the job's failure.
            let _ = self.storage.delete(&part_key(workspace, id, index)).await;
        }
        // Crash point for tests: the object whole, its parts gone, the completion not yet committed.
        fail::fail_point!("asset_transfer::before_commit");
        match completed {
            Some(media_id) => {
                Ok(json!({ "asset_transfer_id": id, "media_id": media_id, "sha256": sha256, "bytes": size }))
            }
            None => Ok(json!({ "asset_transfer_id": id, "status": "ended meanwhile" })),
        }
    }

    fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// The download's deadline plus [`TRANSFER_FINISH_TIME`]: never shorter than the deadline.
    fn timeout(&self) -> Duration {
        self.fetcher.settings().max_duration + TRANSFER_FINISH_TIME
    }
}

impl TransferAssetHandler {
    /// A handler storing into `storage` through `fetcher`; its progress connections (at most 4, opened on demand)
    /// go where `pool`'s do.
    pub fn new(pool: &PgPool, storage: ObjectStorage, fetcher: Arc<Fetcher>, max_attempts: u32) -> Self {
        let progress_pool = conveyor_jobs::postgres_pool_options()
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(5))
            .connect_lazy_with((*pool.connect_options()).clone());
        Self { progress_pool, storage, fetcher, max_attempts }
    }

    /// The job's error for a failed download; the transfer is marked `failed` (in a transaction of its own) unless
    /// another run may still succeed.
    async fn failed(&self, cx: &JobContext, id: Uuid, stored_parts: u32, e: FetchError) -> JobError {
        let workspace = cx.workspace_id();
        match &e {
            FetchError::Canceled => {
                // Canceled by the client: the transfer ends too. The worker stopping or the job timing out: the run
                // after this one resumes.
                if self.operation_canceled(cx).await {
                    let _ = asset_transfers::fail(
                        &self.progress_pool,
                        workspace,
                        id,
                        e.code(),
                        "the operation was canceled",
                    )
                    .await;
                }
                return JobError::Canceled;
            }
            e if e.is_retryable() && cx.attempt() < attempts_for(e, cx.max_attempts()) => {
                tracing::info!(asset_transfer_id = %id, code = e.code(), error = %e, "Asset transfer run failed");
                return JobError::Retryable(e.detail());
            }
            _ => {}
        }
        tracing::info!(asset_transfer_id = %id, code = e.code(), error = %e, "Asset transfer failed");
        if let Err(db) = asset_transfers::fail(&self.progress_pool, workspace, id, e.code(), &e.detail()).await {
            tracing::warn!(asset_transfer_id = %id, error = %db, "Failed to record the transfer's failure");
            return JobError::Retryable(fetch::STORAGE_DETAIL.to_owned());
        }
        for index in 0..stored_parts {
            let _ = self.storage.delete(&part_key(workspace, id, index)).await;
        }
        match e {
            FetchError::Sink(SinkError::Canceled) => JobError::Canceled,
            // Ended before the kind's attempts are spent: a retry would only find the transfer failed.
            e if e.is_retryable() && !e.is_too_slow() => JobError::Retryable(e.detail()),
            e => JobError::Permanent(format!("{}: {}", e.code(), e.detail())),
        }
    }
}

/// The runs a transfer gets for error `e`, of `max_attempts`.
fn attempts_for(e: &FetchError, max_attempts: u32) -> u32 {
    if e.is_too_slow() { TRANSFER_TOO_SLOW_ATTEMPTS.min(max_attempts) } else { max_attempts }
}

impl TransferAssetHandler {
    /// Whether the job's operation was canceled.
    async fn operation_canceled(&self, cx: &JobContext) -> bool {
        let Some(operation) = cx.operation_id() else { return false };
        let Ok(mut tx) = conveyor_jobs::begin_workspace(&self.progress_pool, cx.workspace_id()).await else {
            return false;
        };
        let status = conveyor_jobs::get_operation_tx(&mut tx, operation).await.ok().flatten().map(|op| op.status);
        let _ = tx.rollback().await;
        status.as_deref() == Some("canceled")
    }
}

/// A storage failure as the job's (retryable) error: the specifics are logged, the operation shows a fixed text.
fn storage_unavailable(id: Uuid, e: StorageError) -> JobError {
    tracing::warn!(asset_transfer_id = %id, error = %e, "Object storage failed");
    JobError::Retryable(fetch::STORAGE_DETAIL.to_owned())
}

/// Stores a transfer's parts and commits its progress after each.
struct TransferSink<'a> {
    pool: &'a PgPool,
    storage: &'a ObjectStorage,
    workspace: WorkspaceId,
    id: Uuid,
    cx: &'a JobContext,
    /// Parts that may exist in storage (to delete when the source starts over, or the transfer fails).
    stored_parts: u32,
    /// When the operation's progress was last shown.
    shown_at: Option<Instant>,
}

/// The operation's progress is shown at most this often (the transfer's own row, every part).
const SHOW_PROGRESS_EVERY: Duration = Duration::from_secs(1);

fn sink_failed(e: impl std::fmt::Display) -> SinkError {
    SinkError::Failed(e.to_string())
}

impl PartSink for TransferSink<'_> {
    async fn begin(&mut self, progress: &Progress, restarted: bool) -> Result<(), SinkError> {
        // The progress first, then the deletes: a run dying in between leaves stray objects (overwritten or deleted
        // later), never recorded parts that are gone.
        if !asset_transfers::begin(self.pool, self.workspace, self.id, progress).await.map_err(sink_failed)? {
            return Err(SinkError::Canceled);
        }
        if restarted {
            for index in 0..self.stored_parts {
                self.storage.delete(&part_key(self.workspace, self.id, index)).await.map_err(sink_failed)?;
            }
            self.storage.delete(&object_key(self.workspace, self.id)).await.map_err(sink_failed)?;
            self.stored_parts = 0;
        }
        Ok(())
    }

    async fn part(&mut self, index: u32, bytes: Bytes, progress: &Progress) -> Result<(), SinkError> {
        self.stored_parts = self.stored_parts.max(index + 1);
        self.storage.put(&part_key(self.workspace, self.id, index), bytes).await.map_err(sink_failed)?;
        if !asset_transfers::record_part(self.pool, self.workspace, self.id, progress).await.map_err(sink_failed)? {
            return Err(SinkError::Canceled);
        }
        if self.shown_at.is_some_and(|at| at.elapsed() < SHOW_PROGRESS_EVERY) && !progress.is_complete() {
            return Ok(());
        }
        self.shown_at = Some(Instant::now());
        let shown = json!({ "bytes_done": progress.bytes_done, "bytes_total": progress.bytes_total });
        match self.cx.progress(shown).await {
            Ok(()) => Ok(()),
            Err(JobError::Canceled) => Err(SinkError::Canceled),
            Err(e) => Err(sink_failed(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_payload_round_trips_and_refuses_what_it_does_not_know() {
        let job = TransferAsset { asset_transfer_id: Uuid::now_v7() };
        let text = serde_json::to_string(&job).unwrap();
        assert_eq!(serde_json::from_str::<TransferAsset>(&text).unwrap(), job);
        let extra = format!(r#"{{"asset_transfer_id":"{}","source_url":"http://x"}}"#, job.asset_transfer_id);
        assert!(serde_json::from_str::<TransferAsset>(&extra).is_err());
    }
}
