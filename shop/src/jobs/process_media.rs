//! `media.process`: checks an uploaded image and derives `thumb` and `large`; the media becomes `ready` or
//! `rejected`. A rejection is a result (the operation succeeds with `{"outcome": "rejected", "code", "detail"}`),
//! never retried; only storage and database failures are retried.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::domain::media::{self, ProcessError, ProcessOutcome, ProcessSettings};
use conveyor_jobs::{Handler, JobContext, JobError, JobKind};

/// Process a media. Ids only: the bytes stay in object storage.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProcessMedia {
    /// The media.
    pub media_id: Uuid,
}

impl JobKind for ProcessMedia {
    const KIND: &'static str = "media.process";
    const QUEUE: &'static str = "media";
}

/// Runs [`ProcessMedia`] jobs.
pub struct ProcessMediaHandler {
    /// Storage, limits and the process's bound on concurrent decodes.
    pub settings: ProcessSettings,
    /// Counts `conveyor_media_derivations_total{result}`.
    pub metrics: crate::metrics::MediaMetrics,
    /// Runs before dead-lettering (`CONVEYOR_JOB_MAX_ATTEMPTS`).
    pub max_attempts: u32,
    /// Longest run (`CONVEYOR_JOB_TIMEOUT`).
    pub timeout: Duration,
}

impl Handler<ProcessMedia> for ProcessMediaHandler {
    async fn handle(&self, job: ProcessMedia, cx: &mut JobContext) -> Result<serde_json::Value, JobError> {
        let workspace_id = cx.workspace_id();
        let canceled = cx.cancellation().clone();
        let processing = media::process_tx(cx.tx().await?, &self.settings, workspace_id, job.media_id);
        let outcome = tokio::select! {
            outcome = processing => outcome,
            _ = canceled.cancelled() => return Err(JobError::Canceled),
        }
        .map_err(|e| match e {
            ProcessError::Storage(e) => JobError::Retryable(format!("object storage: {e}")),
            ProcessError::Database(e) => JobError::from(e),
            ProcessError::Panicked(e) => JobError::Permanent(e),
        })?;
        let label = match &outcome {
            ProcessOutcome::Ready { derivation, .. } => Some(derivation.label()),
            ProcessOutcome::Rejected { .. } => Some("rejected"),
            ProcessOutcome::AlreadyDone { .. } | ProcessOutcome::MediaGone => None,
        };
        if let Some(label) = label {
            // Counted before the commit: a run whose commit then fails counts once more on its retry.
            self.metrics.derivations.with_label_values(&[label]).inc();
        }
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
        let job = ProcessMedia { media_id: Uuid::now_v7() };
        let text = serde_json::to_string(&job).unwrap();
        assert_eq!(serde_json::from_str::<ProcessMedia>(&text).unwrap(), job);
        assert!(serde_json::from_str::<ProcessMedia>(r#"{"media_id":"x"}"#).is_err());
    }
}
