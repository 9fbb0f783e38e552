//! `ai.generate`: runs an AI task on the provider, once, and records its result with the task's one charge.

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use uuid::Uuid;

use crate::adapters::ai::{AiError, AiProvider};
use crate::domain::ai_tasks::{self, Reservation};
use conveyor_jobs::{Handler, JobContext, JobError, JobKind};

/// Run an AI task. Ids only: the worker reads the task's kind and input inside the job's workspace transaction.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenerateAi {
    /// The task.
    pub task_id: Uuid,
}

impl JobKind for GenerateAi {
    const KIND: &'static str = "ai.generate";
    const QUEUE: &'static str = "ai";
}

/// Runs [`GenerateAi`] jobs.
pub struct GenerateAiHandler {
    /// The AI provider.
    pub provider: Arc<dyn AiProvider>,
    /// For reserving again the credits of a replayed task, outside the job's transaction.
    pub pool: PgPool,
    /// `CONVEYOR_AI_CREDITS_PER_WORKSPACE`.
    pub credits_limit: u32,
    /// Runs before dead-lettering (`CONVEYOR_JOB_MAX_ATTEMPTS`).
    pub max_attempts: u32,
    /// Longest run (`CONVEYOR_JOB_TIMEOUT`).
    pub timeout: Duration,
}

impl Handler<GenerateAi> for GenerateAiHandler {
    async fn handle(&self, job: GenerateAi, cx: &mut JobContext) -> Result<serde_json::Value, JobError> {
        // The operation id: however often this job runs, the provider generates and charges once for it.
        let token = cx.idempotency_token();
        let workspace_id = cx.workspace_id();
        let canceled = cx.cancellation().clone();
        let task = ai_tasks::load_for_run_tx(cx.tx().await?, job.task_id)
            .await?
            .ok_or_else(|| JobError::permanent("the AI task no longer exists"))?;
        let summary = |result: &serde_json::Value, credits: i32| serde_json::json!({ "ai_task_id": job.task_id, "credits": credits, "result": result });
        match task.reservation {
            Reservation::Charged => {
                // Recorded by an earlier run whose outcome was lost: answer it again, charge nothing.
                return Ok(summary(task.result.as_ref().unwrap_or(&serde_json::Value::Null), task.credits));
            }
            Reservation::Released => {
                if !ai_tasks::reserve_again(&self.pool, workspace_id, job.task_id, self.credits_limit).await? {
                    return Err(JobError::permanent("AI_QUOTA_EXCEEDED: the month's credits no longer cover the task"));
                }
            }
            Reservation::Held => {}
        }
        // Counted (and committed) before the call: a task canceled or dead-lettered from now on may have been charged
        // by the provider, so it keeps its reservation whatever becomes of this run.
        if !ai_tasks::start_provider_call(&self.pool, workspace_id, job.task_id).await? {
            return Err(JobError::retryable("the task's reservation was given back or charged meanwhile"));
        }
        // A canceled job stops waiting for the provider; nothing is recorded, and the task keeps its credits (a charge
        // the provider made meanwhile belongs to the key, and a replay of the task is answered it).
        let generated = tokio::select! {
            generated = self.provider.generate(&token, task.kind, &task.input) => generated,
            _ = canceled.cancelled() => return Err(JobError::Canceled),
        };
        let generated = match generated {
            Ok(generated) => generated,
            Err(e) => {
                if !e.may_have_run() {
                    ai_tasks::provider_call_not_run(&self.pool, workspace_id, job.task_id).await?;
                }
                return Err(match e {
                    AiError::Transient(m) => JobError::Retryable(m),
                    AiError::RetryAfter { reason, after } | AiError::NotRun { reason, after: Some(after) } => {
                        JobError::retry_after(reason, after)
                    }
                    AiError::NotRun { reason, after: None } => JobError::Retryable(reason),
                    AiError::Refused(m) => JobError::Permanent(format!("the AI provider refused the task: {m}")),
                    AiError::Malformed(m) => JobError::Permanent(format!("the AI provider's answer: {m}")),
                });
            }
        };
        let cost = ai_tasks::record_result_tx(cx.tx().await?, job.task_id, &generated)
            .await?
            .ok_or_else(|| JobError::retryable("the task's reservation was given back meanwhile"))?;
        Ok(summary(&generated.output, cost.credits))
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
        let job = GenerateAi { task_id: Uuid::now_v7() };
        let text = serde_json::to_string(&job).unwrap();
        assert_eq!(serde_json::from_str::<GenerateAi>(&text).unwrap(), job);
        let extra = format!(r#"{{"task_id":"{}","prompt":"p"}}"#, job.task_id);
        assert!(serde_json::from_str::<GenerateAi>(&extra).is_err());
    }
}
