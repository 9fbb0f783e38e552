//! AI tasks (`ai.generate`): a text, category or image generation run by the AI provider, billed in credits.
//!
//! Creating a task writes, in the caller's transaction: a reservation of the task's price from the workspace's credits
//! of the month (one conditional UPDATE of the month's row, which serializes concurrent requests, so the month is
//! never overspent), the task, a `queued` operation and an `ai.generate` outbox event that names the task only.
//!
//! Prices: `text` 1 credit, `category` 1, `image` 5 ([`price`]). Credits are counted per workspace and calendar month
//! (UTC), `CONVEYOR_AI_CREDITS_PER_WORKSPACE` a month.
//!
//! The job calls the provider with the operation id as its idempotency key, then records the result and the task's one
//! ledger row (`ai_usage_ledger`, unique per task) in the job's transaction: a task is charged once however often it
//! runs.
//!
//! Before each provider call the job counts it as started, in a transaction of its own committed before the call
//! ([`start_provider_call`]); after a call the provider surely did not run (a refusal, a `429`, no connection) it
//! counts that too ([`provider_call_not_run`]). A task that ends without a result (refused, out of attempts, canceled)
//! has its reservation given back by the next reservation of its month ([`create_tx`]) only if none of its calls may
//! have run: a task canceled or dead-lettered after a call that may have run may have been charged by the provider, so
//! it keeps its credits (its ledger row is written if a replay of it runs again: the same key answers the provider's
//! first result). Cancelling a running task therefore never gives credits back for a charge the provider made, and the
//! provider's charges for a workspace never exceed the credits reserved.
//!
//! A dead letter replayed after its reservation was given back reserves its price again before it calls the provider
//! ([`reserve_again`]), in the task's original month (`ai_tasks.month`, the month it was created in), not the month of
//! the replay: a task replayed in a later month counts against the credits of the month it was created in (and is
//! refused if that month's credits are used up), and the later month's credits are untouched.

use chrono::{DateTime, NaiveDate, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sqlx::PgPool;
use uuid::Uuid;

use super::ValidationError;
use crate::Principal;
use crate::adapters::ai::{AiKind, AiResult};
use crate::jobs::GenerateAi;
use conveyor_jobs::Operation;
use conveyor_jobs::WorkspaceId;
use conveyor_jobs::WorkspaceTx;
use conveyor_jobs::{EnqueueError, EnqueueOptions};

/// The operation kind (and job kind) of a task.
pub const GENERATE_KIND: &str = <GenerateAi as conveyor_jobs::JobKind>::KIND;

/// Largest `input`, as compact JSON.
pub const MAX_INPUT_BYTES: usize = 16 * 1024;

/// What a task of `kind` costs, in credits.
pub fn price(kind: AiKind) -> u32 {
    match kind {
        AiKind::Text | AiKind::Category => 1,
        AiKind::Image => 5,
    }
}

/// `text` input: `prompt` (1 to 4000 characters), `max_words` (1 to 2000).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TextInput {
    prompt: String,
    #[serde(default, deserialize_with = "super::whole_number::optional")]
    max_words: Option<u32>,
}

/// `category` input: `title` (1 to 200 characters), `description` (up to 10000).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CategoryInput {
    title: String,
    #[serde(default)]
    description: Option<String>,
}

/// `image` input: `prompt` (1 to 4000 characters), `size` (`256x256`, `512x512` or `1024x1024`).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ImageInput {
    prompt: String,
    #[serde(default)]
    size: Option<String>,
}

/// Image sizes a task may ask for.
pub const IMAGE_SIZES: [&str; 3] = ["256x256", "512x512", "1024x1024"];

fn text_field(name: &str, value: &str, max_chars: usize) -> Result<(), ValidationError> {
    if value.trim().is_empty() || value.chars().count() > max_chars {
        return Err(ValidationError(format!("input.{name} must be 1 to {max_chars} characters")));
    }
    Ok(())
}

/// Decodes `input` as `T`, with messages that name a field but never quote a value.
fn typed<T: serde::de::DeserializeOwned>(input: &Value) -> Result<T, ValidationError> {
    T::deserialize(input).map_err(|e| {
        let message = e.to_string();
        if ["unknown field", "missing field", "duplicate field"].iter().any(|p| message.starts_with(p)) {
            ValidationError(format!("input: {message}"))
        } else {
            ValidationError("input: a value has the wrong type or is out of range".into())
        }
    })
}

/// A task to create, validated.
#[derive(Clone, Debug)]
pub struct NewAiTask {
    /// What to generate.
    pub kind: AiKind,
    /// The kind's input (an object of the kind's fields).
    pub input: Value,
    /// The listing the task is for, if any (must exist in the workspace).
    pub listing_id: Option<Uuid>,
}

impl NewAiTask {
    /// Checks the kind and the input's size, shape and fields.
    pub fn parse(kind: &str, input: Value, listing_id: Option<Uuid>) -> Result<Self, ValidationError> {
        let kind = AiKind::parse(kind).ok_or_else(|| {
            let names: Vec<&str> = AiKind::ALL.iter().map(|k| k.as_str()).collect();
            ValidationError(format!("kind must be one of: {}", names.join(", ")))
        })?;
        if !input.is_object() {
            return Err(ValidationError("input must be an object".into()));
        }
        let size = serde_json::to_vec(&input).expect("JSON values serialize").len();
        if size > MAX_INPUT_BYTES {
            return Err(ValidationError(format!("input must be at most {MAX_INPUT_BYTES} bytes of JSON, not {size}")));
        }
        match kind {
            AiKind::Text => {
                let text: TextInput = typed(&input)?;
                text_field("prompt", &text.prompt, 4000)?;
                if text.max_words.is_some_and(|n| !(1..=2000).contains(&n)) {
                    return Err(ValidationError("input.max_words must be 1 to 2000".into()));
                }
            }
            AiKind::Category => {
                let category: CategoryInput = typed(&input)?;
                text_field("title", &category.title, 200)?;
                if category.description.as_ref().is_some_and(|d| d.chars().count() > 10_000) {
                    return Err(ValidationError("input.description must be at most 10000 characters".into()));
                }
            }
            AiKind::Image => {
                let image: ImageInput = typed(&input)?;
                text_field("prompt", &image.prompt, 4000)?;
                if image.size.as_deref().is_some_and(|s| !IMAGE_SIZES.contains(&s)) {
                    return Err(ValidationError(format!("input.size must be one of: {}", IMAGE_SIZES.join(", "))));
                }
            }
        }
        Ok(Self { kind, input, listing_id })
    }
}

/// A task's charge.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Cost {
    /// Credits charged.
    pub credits: i32,
}

/// A task as clients see it. Its `status` is its operation's.
#[derive(Clone, Debug, Serialize)]
pub struct AiTask {
    /// Id.
    pub id: Uuid,
    /// `text`, `category` or `image`.
    pub kind: String,
    /// `queued`, `running`, `succeeded`, `failed` or `canceled`.
    pub status: String,
    /// The input it was created with.
    pub input: Value,
    /// What the provider generated, once succeeded.
    pub result: Option<Value>,
    /// The charge, once succeeded (`null` otherwise: a task that did not succeed is not charged).
    pub cost: Option<Cost>,
    /// Its price, reserved from the month's credits when it was created.
    pub price_credits: i32,
    /// The listing it is for, if any.
    pub listing_id: Option<Uuid>,
    /// The operation that runs it.
    pub operation_id: Uuid,
    /// Why it failed (redacted), if it did.
    pub error: Option<String>,
    /// Created.
    pub created_at: DateTime<Utc>,
    /// Last changed (the task or its operation).
    pub updated_at: DateTime<Utc>,
    /// When its result was recorded.
    pub completed_at: Option<DateTime<Utc>>,
}

#[derive(sqlx::FromRow)]
struct AiTaskRow {
    id: Uuid,
    kind: String,
    status: String,
    input: Value,
    result: Option<Value>,
    charged_credits: Option<i32>,
    price_credits: i32,
    listing_id: Option<Uuid>,
    operation_id: Uuid,
    error: Option<String>,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
    completed_at: Option<DateTime<Utc>>,
}

impl From<AiTaskRow> for AiTask {
    fn from(r: AiTaskRow) -> Self {
        Self {
            id: r.id,
            kind: r.kind,
            status: r.status,
            input: r.input,
            result: r.result,
            cost: r.charged_credits.map(|credits| Cost { credits }),
            price_credits: r.price_credits,
            listing_id: r.listing_id,
            operation_id: r.operation_id,
            error: r.error,
            created_at: r.created_at,
            updated_at: r.updated_at,
            completed_at: r.completed_at,
        }
    }
}

/// The task `id` of the transaction's workspace, if any.
pub async fn get_tx(tx: &mut WorkspaceTx, id: Uuid) -> Result<Option<AiTask>, sqlx::Error> {
    let row = sqlx::query_as::<_, AiTaskRow>(
        "SELECT t.id, t.kind, o.status, t.input, t.result, l.credits AS charged_credits, t.credits AS price_credits,
                t.listing_id, t.operation_id, o.error, t.created_at, greatest(t.updated_at, o.updated_at) AS updated_at,
                t.completed_at
         FROM conveyor_shop.ai_tasks t
         JOIN conveyor.operations o ON o.id = t.operation_id
         LEFT JOIN conveyor_shop.ai_usage_ledger l ON l.task_id = t.id
         WHERE t.id = $1",
    )
    .bind(id)
    .fetch_optional(&mut **tx)
    .await?;
    Ok(row.map(AiTask::from))
}

/// A created task and the operation that runs it.
#[derive(Clone, Debug, Serialize)]
pub struct Created {
    /// The task (`queued`).
    pub ai_task: AiTask,
    /// Its operation.
    pub operation: Operation,
}

/// Why a task cannot be created.
#[derive(Debug, thiserror::Error)]
pub enum CreateError {
    /// The workspace has no such listing.
    #[error("listing {0} does not exist in this workspace")]
    ListingNotFound(Uuid),
    /// The month's credits cannot cover the task.
    #[error("this task needs {credits_requested} AI credits and {credits_used} of {credits_limit} are used this month")]
    QuotaExceeded {
        /// Credits per workspace and month.
        credits_limit: u32,
        /// Credits reserved this month.
        credits_used: u32,
        /// The task's price.
        credits_requested: u32,
        /// Seconds until the next month (UTC) starts.
        retry_after_secs: u64,
    },
    /// PostgreSQL failed.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// Reserves `credits` from the workspace's credits of the current month (UTC), at most `credits_limit` in all: the
/// month's row is locked first, so concurrent reservations queue behind each other. Gives back, first, the credits of
/// the month's tasks that ended without a charge and without a provider call that may have run. Answers the month.
async fn reserve_tx(
    tx: &mut WorkspaceTx,
    workspace_id: WorkspaceId,
    credits: u32,
    credits_limit: u32,
) -> Result<NaiveDate, CreateError> {
    let (month, retry_after_secs): (NaiveDate, i64) = sqlx::query_as(
        "INSERT INTO conveyor_shop.ai_usage_months (workspace_id, month)
         VALUES ($1, date_trunc('month', now() AT TIME ZONE 'UTC')::date)
         ON CONFLICT (workspace_id, month) DO UPDATE SET updated_at = now()
         RETURNING month, ceil(extract(epoch FROM (month + interval '1 month') AT TIME ZONE 'UTC' - now()))::bigint",
    )
    .bind(workspace_id.0)
    .fetch_one(&mut **tx)
    .await?;
    let (used,): (i64,) = sqlx::query_as(
        "WITH released AS (
             UPDATE conveyor_shop.ai_tasks t SET reservation = 'released', updated_at = now()
             FROM conveyor.operations o
             WHERE t.workspace_id = $1 AND t.month = $2 AND t.reservation = 'held'
               AND t.provider_calls_started = t.provider_calls_not_run
               AND o.id = t.operation_id AND o.status IN ('failed', 'canceled')
             RETURNING t.credits
         )
         UPDATE conveyor_shop.ai_usage_months SET credits_reserved = credits_reserved - (SELECT coalesce(sum(credits), 0) FROM released)
         WHERE workspace_id = $1 AND month = $2
         RETURNING credits_reserved",
    )
    .bind(workspace_id.0)
    .bind(month)
    .fetch_one(&mut **tx)
    .await?;
    let reserved: Option<(i64,)> = sqlx::query_as(
        "UPDATE conveyor_shop.ai_usage_months SET credits_reserved = credits_reserved + $3, updated_at = now()
         WHERE workspace_id = $1 AND month = $2 AND credits_reserved + $3 <= $4
         RETURNING credits_reserved",
    )
    .bind(workspace_id.0)
    .bind(month)
    .bind(i64::from(credits))
    .bind(i64::from(credits_limit))
    .fetch_optional(&mut **tx)
    .await?;
    if reserved.is_none() {
        return Err(CreateError::QuotaExceeded {
            credits_limit,
            credits_used: u32::try_from(used).unwrap_or(u32::MAX),
            credits_requested: credits,
            retry_after_secs: u64::try_from(retry_after_secs).unwrap_or(0).max(1),
        });
    }
    Ok(month)
}

/// Creates a task: checks its listing, reserves its price (`CreateError::QuotaExceeded` when the month's credits
/// cannot cover it), and writes the task, a queued operation and its `ai.generate` outbox event.
pub async fn create_tx(
    tx: &mut WorkspaceTx,
    principal: &Principal,
    new: NewAiTask,
    credits_limit: u32,
    trace: Option<conveyor_jobs::TraceContext>,
) -> Result<Created, CreateError> {
    if let Some(listing_id) = new.listing_id {
        let found: Option<(Uuid,)> = sqlx::query_as("SELECT id FROM conveyor_shop.listings WHERE id = $1")
            .bind(listing_id)
            .fetch_optional(&mut **tx)
            .await?;
        if found.is_none() {
            return Err(CreateError::ListingNotFound(listing_id));
        }
    }
    let credits = price(new.kind);
    let month = reserve_tx(tx, principal.workspace_id, credits, credits_limit).await?;
    let id = Uuid::now_v7();
    let operation =
        conveyor_jobs::create_operation_tx(tx, principal.workspace_id, principal.user_id, GENERATE_KIND, Some(id))
            .await?;
    sqlx::query(
        "INSERT INTO conveyor_shop.ai_tasks (id, workspace_id, kind, input, listing_id, operation_id, credits, month, created_by)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
    )
    .bind(id)
    .bind(principal.workspace_id.0)
    .bind(new.kind.as_str())
    .bind(&new.input)
    .bind(new.listing_id)
    .bind(operation.id)
    .bind(credits as i32)
    .bind(month)
    .bind(principal.user_id.0)
    .execute(&mut **tx)
    .await?;
    let mut options = EnqueueOptions::new().operation(operation.id);
    if let Some(trace) = trace {
        options = options.trace(trace);
    }
    conveyor_jobs::enqueue_tx(tx, &GenerateAi { task_id: id }, options).await.map_err(|e| match e {
        EnqueueError::Database(e) => e,
        // A fixed kind with valid options and a payload of ids: none of these can happen.
        other => sqlx::Error::Protocol(other.to_string()),
    })?;
    let ai_task = get_tx(tx, id).await?.ok_or_else(|| sqlx::Error::RowNotFound)?;
    Ok(Created { ai_task, operation })
}

/// Where a task's reservation stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reservation {
    /// Reserved, not charged yet.
    Held,
    /// Charged: the task has its result and its ledger row.
    Charged,
    /// Given back: the task ended without a charge (it may be replayed).
    Released,
}

/// What the job needs of its task.
#[derive(Clone, Debug)]
pub struct TaskToRun {
    /// What to generate.
    pub kind: AiKind,
    /// The input.
    pub input: Value,
    /// Its price.
    pub credits: i32,
    /// Its reservation.
    pub reservation: Reservation,
    /// Its result, once charged.
    pub result: Option<Value>,
}

/// The task `id`, as its job reads it (in the job's transaction).
pub async fn load_for_run_tx(tx: &mut WorkspaceTx, id: Uuid) -> Result<Option<TaskToRun>, sqlx::Error> {
    let row: Option<(String, Value, i32, String, Option<Value>)> =
        sqlx::query_as("SELECT kind, input, credits, reservation, result FROM conveyor_shop.ai_tasks WHERE id = $1")
            .bind(id)
            .fetch_optional(&mut **tx)
            .await?;
    Ok(row.and_then(|(kind, input, credits, reservation, result)| {
        let reservation = match reservation.as_str() {
            "held" => Reservation::Held,
            "charged" => Reservation::Charged,
            _ => Reservation::Released,
        };
        Some(TaskToRun { kind: AiKind::parse(&kind)?, input, credits, reservation, result })
    }))
}

/// Reserves again the price of a task whose reservation was given back (a dead letter replayed), in a transaction of
/// its own, before the provider is called: `false` when the credits of the task's month can no longer cover it. The
/// month is the task's own (the one it was created in), whenever the replay runs.
pub async fn reserve_again(
    pool: &PgPool,
    workspace_id: WorkspaceId,
    task_id: Uuid,
    credits_limit: u32,
) -> Result<bool, sqlx::Error> {
    let mut tx = conveyor_jobs::begin_workspace(pool, workspace_id).await?;
    // The month's row first, as every reservation takes it.
    sqlx::query(
        "SELECT 1 FROM conveyor_shop.ai_usage_months m JOIN conveyor_shop.ai_tasks t ON t.workspace_id = m.workspace_id AND t.month = m.month
         WHERE t.id = $1 FOR UPDATE OF m",
    )
    .bind(task_id)
    .execute(&mut *tx)
    .await?;
    let reserved: Option<(i64,)> = sqlx::query_as(
        "WITH task AS (
             UPDATE conveyor_shop.ai_tasks SET reservation = 'held', updated_at = now()
             WHERE id = $1 AND reservation = 'released'
             RETURNING workspace_id, month, credits
         )
         UPDATE conveyor_shop.ai_usage_months m SET credits_reserved = m.credits_reserved + task.credits, updated_at = now()
         FROM task
         WHERE m.workspace_id = task.workspace_id AND m.month = task.month
           AND m.credits_reserved + task.credits <= $2
         RETURNING m.credits_reserved",
    )
    .bind(task_id)
    .bind(i64::from(credits_limit))
    .fetch_optional(&mut *tx)
    .await?;
    if reserved.is_none() {
        tx.rollback().await?;
        return Ok(false);
    }
    tx.commit().await?;
    Ok(true)
}

/// Counts a provider call of task `id` as started, in a transaction of its own committed before the call: from then on
/// its reservation is never given back unless the call turns out not to have run. `false` when the task holds no
/// reservation (given back because its operation ended, or charged meanwhile): the provider must not be called.
pub async fn start_provider_call(pool: &PgPool, workspace_id: WorkspaceId, id: Uuid) -> Result<bool, sqlx::Error> {
    let mut tx = conveyor_jobs::begin_workspace(pool, workspace_id).await?;
    let started = sqlx::query(
        "UPDATE conveyor_shop.ai_tasks SET provider_calls_started = provider_calls_started + 1, updated_at = now()
         WHERE id = $1 AND reservation = 'held'",
    )
    .bind(id)
    .execute(&mut *tx)
    .await?
    .rows_affected()
        == 1;
    tx.commit().await?;
    Ok(started)
}

/// Counts a started provider call of task `id` that surely did not run (refused, rate-limited, never connected), in a
/// transaction of its own: once every started call is so counted, the task's reservation may be given back again.
pub async fn provider_call_not_run(pool: &PgPool, workspace_id: WorkspaceId, id: Uuid) -> Result<(), sqlx::Error> {
    let mut tx = conveyor_jobs::begin_workspace(pool, workspace_id).await?;
    sqlx::query(
        "UPDATE conveyor_shop.ai_tasks SET provider_calls_not_run = provider_calls_not_run + 1, updated_at = now()
         WHERE id = $1 AND provider_calls_not_run < provider_calls_started",
    )
    .bind(id)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}

/// Records the provider's answer for task `id` with its one ledger row, in the job's transaction: `None` when the task
/// holds no reservation any more (already charged, or given back because its operation ended).
pub async fn record_result_tx(tx: &mut WorkspaceTx, id: Uuid, result: &AiResult) -> Result<Option<Cost>, sqlx::Error> {
    let charged: Option<(i32,)> = sqlx::query_as(
        "WITH charged AS (
             UPDATE conveyor_shop.ai_tasks SET reservation = 'charged', result = $2, completed_at = now(), updated_at = now()
             WHERE id = $1 AND reservation = 'held'
             RETURNING id, workspace_id, month, kind, credits
         )
         INSERT INTO conveyor_shop.ai_usage_ledger (id, workspace_id, task_id, month, kind, credits, provider_charge_id)
         SELECT $3, workspace_id, id, month, kind, credits, $4 FROM charged
         RETURNING credits",
    )
    .bind(id)
    .bind(&result.output)
    .bind(Uuid::now_v7())
    .bind(result.charge_id.as_deref())
    .fetch_optional(&mut **tx)
    .await?;
    Ok(charged.map(|(credits,)| Cost { credits }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn inputs_are_checked_per_kind() {
        assert!(NewAiTask::parse("text", json!({"prompt": "a title"}), None).is_ok());
        assert!(NewAiTask::parse("category", json!({"title": "Shirt", "description": "cotton"}), None).is_ok());
        assert!(NewAiTask::parse("image", json!({"prompt": "a lamp", "size": "512x512"}), None).is_ok());
        let refused = [
            ("video", json!({"prompt": "x"}), "kind must be one of"),
            ("text", json!("a prompt"), "must be an object"),
            ("text", json!({}), "missing field `prompt`"),
            ("text", json!({"prompt": "x", "temperature": 2}), "unknown field `temperature`"),
            ("text", json!({"prompt": 5}), "wrong type"),
            ("text", json!({"prompt": "  "}), "input.prompt"),
            ("text", json!({"prompt": "x", "max_words": 0}), "input.max_words"),
            ("image", json!({"prompt": "x", "size": "4x4"}), "input.size"),
            ("category", json!({"title": "x".repeat(201)}), "input.title"),
            ("text", json!({"prompt": "x".repeat(MAX_INPUT_BYTES)}), "at most 16384 bytes"),
        ];
        for (kind, input, expected) in refused {
            let err = NewAiTask::parse(kind, input.clone(), None).unwrap_err().0;
            assert!(err.contains(expected), "{kind} {input}: {err}");
        }
    }

    #[test]
    fn images_cost_more_than_texts() {
        assert_eq!(price(AiKind::Text), 1);
        assert_eq!(price(AiKind::Category), 1);
        assert_eq!(price(AiKind::Image), 5);
    }
}
