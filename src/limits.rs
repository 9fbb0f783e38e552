//! Limits per key, read by the relay's claim (migration 0023): a job enqueued with
//! [`EnqueueOptions::limit_key`](crate::EnqueueOptions::limit_key) obeys its key's limits in its workspace.
//!
//! - **Concurrency.** With [`KeyLimit::max_in_flight`], at most that many of the key's jobs are handed to workers and
//!   not ended (`dispatching` or `dispatched`) at once; the rest wait in the outbox, and jobs of other keys (or of no
//!   key) go on.
//! - **Rates.** With [`KeyLimit::max_per_interval`] `(n, interval)`, at most `n` of the key's jobs are handed out in
//!   any `interval` (a sliding window: the claim keeps the times of the key's latest hand-outs on the key's row,
//!   under the row lock it takes to count the key's room; migration 0024).
//! - **Blocks.** A handler answering [`JobError::RateLimited`](crate::JobError::RateLimited) blocks its key until the
//!   time it gives: none of the key's jobs is handed out before then.
//!
//! - **Kinds.** [`set_kind_limit`] keeps at most `max_in_flight` of a workspace's jobs of a kind in the workers' hands;
//!   other kinds go on.
//!
//! Keys are tenant data (they name a workspace's own stores or accounts): their rows are under row-level security,
//! and every call takes the workspace.
//!
//! - **Global limits.** [`set_global_limit`] holds a queue's or a kind's jobs of every workspace together to a
//!   concurrency, a rate or both (migration 0062: "one provider key, 100 requests a second in all"). A global limit is
//!   the operator's, as pauses and weights are: set through the operator role's pool, audited. The relay shares its
//!   room between the workspaces whose jobs wait (each takes at most a fair part of it in a claim), so one flooding
//!   workspace does not take it all.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;

use crate::flow::FlowError;
use crate::ids::WorkspaceId;

/// The longest limit key, in characters.
pub(crate) const MAX_KEY_CHARS: usize = 200;

/// Whether `key` can be a limit key: 1 to 200 characters, none of them a control character (PostgreSQL's text holds
/// no NUL, and a key is shown to operators).
pub(crate) fn valid_key(key: &str) -> bool {
    !key.is_empty() && key.chars().count() <= MAX_KEY_CHARS && !key.chars().any(char::is_control)
}

/// An operator's limits of one key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct KeyLimit {
    /// At most this many of the key's jobs in the workers' hands at once (1 to 1,000,000); `None`: no such limit.
    pub max_in_flight: Option<u32>,
    /// At most `n` of the key's jobs handed out in any `interval` (`n` from 1 to 10,000, `interval` from 1 ms to a
    /// day, in whole milliseconds); `None`: no rate.
    pub max_per_interval: Option<(u32, Duration)>,
}

/// The most jobs a rate lets through in one interval.
pub(crate) const MAX_PER_INTERVAL: u32 = 10_000;
/// The longest rate interval: a day.
pub(crate) const MAX_RATE_INTERVAL: Duration = Duration::from_secs(86_400);

/// A key's limits and block, as stored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct KeyLimits {
    /// The key.
    pub key: String,
    /// Its concurrency limit, if any.
    pub max_in_flight: Option<i32>,
    /// Its rate, if any: at most this many jobs handed out per [`KeyLimits::interval_ms`].
    pub max_per_interval: Option<i32>,
    /// Its rate's interval, in milliseconds.
    pub interval_ms: Option<i64>,
    /// Its jobs are not handed out before this time (a handler's [`crate::JobError::RateLimited`]); in the past when
    /// the block has passed.
    pub blocked_until: Option<DateTime<Utc>>,
    /// The reason the handler gave for the latest block.
    pub block_reason: Option<String>,
    /// When it last changed.
    pub updated_at: DateTime<Utc>,
}

/// A concurrency and a rate checked and put as stored: `max_in_flight`, `max_per_interval` and `interval_ms`.
type StoredLimit = (Option<i32>, Option<i32>, Option<i64>);

fn stored(max_in_flight: Option<u32>, max_per_interval: Option<(u32, Duration)>) -> Result<StoredLimit, FlowError> {
    if max_in_flight.is_some_and(|m| !(1..=1_000_000).contains(&m)) {
        return Err(FlowError::OutOfRange("max_in_flight is from 1 to 1000000"));
    }
    if let Some((n, interval)) = max_per_interval {
        if !(1..=MAX_PER_INTERVAL).contains(&n) {
            return Err(FlowError::OutOfRange("max_per_interval's count is from 1 to 10000"));
        }
        if interval < Duration::from_millis(1)
            || interval > MAX_RATE_INTERVAL
            || interval.subsec_nanos() % 1_000_000 != 0
        {
            return Err(FlowError::OutOfRange("max_per_interval's interval is from 1 ms to 1 day, in whole ms"));
        }
    }
    let (per, interval_ms) = match max_per_interval {
        Some((n, interval)) => (Some(n as i32), Some(interval.as_millis() as i64)),
        None => (None, None),
    };
    Ok((max_in_flight.map(|m| m as i32), per, interval_ms))
}

/// Refuses a bad key or limit before anything is written (the admin module checks before it audits an intent).
pub(crate) fn check_key_limit(key: &str, limit: KeyLimit) -> Result<(), FlowError> {
    check_key(key)?;
    stored(limit.max_in_flight, limit.max_per_interval).map(|_| ())
}

/// Refuses a bad kind or count before anything is written.
pub(crate) fn check_kind_limit(kind: &str, max_in_flight: u32) -> Result<(), FlowError> {
    check_kind(kind)?;
    if !(1..=1_000_000).contains(&max_in_flight) {
        return Err(FlowError::OutOfRange("max_in_flight is from 1 to 1000000"));
    }
    Ok(())
}

pub(crate) fn check_key(key: &str) -> Result<(), FlowError> {
    if valid_key(key) { Ok(()) } else { Err(FlowError::InvalidName("limit key (1 to 200 characters)")) }
}

/// Sets the limits of `key` in `workspace` (replacing earlier ones; a block in force stays), and wakes the dispatchers
/// (a higher limit lets held jobs go at once).
pub async fn set_key_limit(pool: &PgPool, workspace: WorkspaceId, key: &str, limit: KeyLimit) -> Result<(), FlowError> {
    check_key(key)?;
    let (max_in_flight, per, interval_ms) = stored(limit.max_in_flight, limit.max_per_interval)?;
    let mut tx = crate::db::begin_workspace(pool, workspace).await?;
    sqlx::query(
        "INSERT INTO conveyor.job_key_limits (workspace_id, key, max_in_flight, max_per_interval, interval_ms)
         VALUES (conveyor.conveyor_current_workspace(), $1, $2, $3, $4)
         ON CONFLICT (workspace_id, key) DO UPDATE
         SET max_in_flight = EXCLUDED.max_in_flight, max_per_interval = EXCLUDED.max_per_interval,
             interval_ms = EXCLUDED.interval_ms, updated_at = now()",
    )
    .bind(key)
    .bind(max_in_flight)
    .bind(per)
    .bind(interval_ms)
    .execute(&mut *tx)
    .await?;
    crate::outbox::notify_tx(&mut tx, workspace).await?;
    tx.commit().await?;
    Ok(())
}

/// Removes the limits of `key` in `workspace`, and its block if any, and wakes the dispatchers: the key's held jobs go.
/// `false` when the key had none.
pub async fn remove_key_limit(pool: &PgPool, workspace: WorkspaceId, key: &str) -> Result<bool, FlowError> {
    check_key(key)?;
    let mut tx = crate::db::begin_workspace(pool, workspace).await?;
    let removed = sqlx::query("DELETE FROM conveyor.job_key_limits WHERE key = $1").bind(key).execute(&mut *tx).await?;
    crate::outbox::notify_tx(&mut tx, workspace).await?;
    tx.commit().await?;
    Ok(removed.rows_affected() == 1)
}

/// The keys of `workspace` with limits or blocks (passed ones included), by key.
pub async fn list_key_limits(pool: &PgPool, workspace: WorkspaceId) -> Result<Vec<KeyLimits>, FlowError> {
    let mut tx = crate::db::begin_workspace(pool, workspace).await?;
    let rows = sqlx::query_as(
        "SELECT key, max_in_flight, max_per_interval, interval_ms, blocked_until, block_reason, updated_at
         FROM conveyor.job_key_limits WHERE workspace_id = conveyor.conveyor_current_workspace() ORDER BY key",
    )
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(rows)
}

/// A workspace's concurrency limit of one kind, as stored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct KindLimit {
    /// The kind ([`crate::JobKind::KIND`]).
    pub kind: String,
    /// At most this many of the workspace's jobs of the kind in the workers' hands at once.
    pub max_in_flight: i32,
    /// When it last changed.
    pub updated_at: DateTime<Utc>,
}

pub(crate) fn check_kind(kind: &str) -> Result<(), FlowError> {
    if crate::kind::valid_kind_name(kind) { Ok(()) } else { Err(FlowError::InvalidName("kind")) }
}

/// Keeps at most `max_in_flight` (1 to 1,000,000) of `workspace`'s jobs of `kind` handed to workers and not ended
/// (`dispatching` or `dispatched`) at once, replacing an earlier limit; the rest wait in the outbox, other kinds go on.
/// Wakes the dispatchers.
pub async fn set_kind_limit(
    pool: &PgPool,
    workspace: WorkspaceId,
    kind: &str,
    max_in_flight: u32,
) -> Result<(), FlowError> {
    check_kind_limit(kind, max_in_flight)?;
    let mut tx = crate::db::begin_workspace(pool, workspace).await?;
    sqlx::query(
        "INSERT INTO conveyor.job_kind_limits (workspace_id, kind, max_in_flight) VALUES (conveyor.conveyor_current_workspace(), $1, $2)
         ON CONFLICT (workspace_id, kind) DO UPDATE SET max_in_flight = EXCLUDED.max_in_flight, updated_at = now()",
    )
    .bind(kind)
    .bind(max_in_flight as i32)
    .execute(&mut *tx)
    .await?;
    crate::outbox::notify_tx(&mut tx, workspace).await?;
    tx.commit().await?;
    Ok(())
}

/// Removes `workspace`'s limit of `kind` and wakes the dispatchers: its held jobs go. `false` when it had none.
pub async fn remove_kind_limit(pool: &PgPool, workspace: WorkspaceId, kind: &str) -> Result<bool, FlowError> {
    check_kind(kind)?;
    let mut tx = crate::db::begin_workspace(pool, workspace).await?;
    let removed =
        sqlx::query("DELETE FROM conveyor.job_kind_limits WHERE kind = $1").bind(kind).execute(&mut *tx).await?;
    crate::outbox::notify_tx(&mut tx, workspace).await?;
    tx.commit().await?;
    Ok(removed.rows_affected() == 1)
}

/// The kinds of `workspace` with limits, by kind.
pub async fn list_kind_limits(pool: &PgPool, workspace: WorkspaceId) -> Result<Vec<KindLimit>, FlowError> {
    let mut tx = crate::db::begin_workspace(pool, workspace).await?;
    let rows = sqlx::query_as(
        "SELECT kind, max_in_flight, updated_at FROM conveyor.job_kind_limits
         WHERE workspace_id = conveyor.conveyor_current_workspace() ORDER BY kind",
    )
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(rows)
}

/// What a global limit holds: every workspace's jobs of one queue, or of one kind.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, serde::Deserialize)]
#[serde(tag = "scope", content = "name", rename_all = "snake_case")]
pub enum GlobalScope {
    /// The jobs of a queue ([`crate::JobKind::QUEUE`]).
    Queue(String),
    /// The jobs of a kind ([`crate::JobKind::KIND`]).
    Kind(String),
}

impl GlobalScope {
    /// `queue` or `kind`, as stored.
    pub fn scope(&self) -> &'static str {
        match self {
            Self::Queue(_) => "queue",
            Self::Kind(_) => "kind",
        }
    }

    /// The queue's or the kind's name.
    pub fn name(&self) -> &str {
        match self {
            Self::Queue(name) | Self::Kind(name) => name,
        }
    }

    /// The scope named `scope` (`queue` or `kind`) and `name`, its name checked.
    pub fn parse(scope: &str, name: &str) -> Result<Self, FlowError> {
        let parsed = match scope {
            "queue" => Self::Queue(name.to_owned()),
            "kind" => Self::Kind(name.to_owned()),
            _ => return Err(FlowError::InvalidName("global limit scope (queue or kind)")),
        };
        parsed.check()?;
        Ok(parsed)
    }

    pub(crate) fn check(&self) -> Result<(), FlowError> {
        match self {
            Self::Queue(name) if !crate::kind::valid_queue_name(name) => Err(FlowError::InvalidName("queue")),
            Self::Kind(name) => check_kind(name),
            Self::Queue(_) => Ok(()),
        }
    }
}

/// A global limit: at most `max_in_flight` of the scope's jobs, of every workspace, in the workers' hands at once, and
/// at most `n` of them handed out in any `interval`; either or both.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct GlobalLimit {
    /// At most this many in the workers' hands at once (1 to 1,000,000); `None`: no such limit.
    pub max_in_flight: Option<u32>,
    /// At most `n` handed out in any `interval` (`n` from 1 to 10,000, `interval` from 1 ms to a day, in whole
    /// milliseconds): a sliding window, as a key's rate; `None`: no rate.
    pub max_per_interval: Option<(u32, Duration)>,
}

/// A global limit as stored, with what it holds now.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct GlobalLimits {
    /// `queue` or `kind`.
    pub scope: String,
    /// The queue's or the kind's name.
    pub name: String,
    /// Its concurrency limit, if any.
    pub max_in_flight: Option<i32>,
    /// Its rate, if any: at most this many jobs handed out per [`GlobalLimits::interval_ms`].
    pub max_per_interval: Option<i32>,
    /// Its rate's interval, in milliseconds.
    pub interval_ms: Option<i64>,
    /// The scope's jobs in the workers' hands now, in every workspace.
    pub in_flight: i64,
    /// The scope's jobs handed out in the rate's last interval (0 without a rate).
    pub handed_out_in_interval: i64,
    /// When it last changed.
    pub updated_at: DateTime<Utc>,
}

/// Holds every workspace's jobs of `scope` to `limit` together, beside each workspace's own key and kind limits (a job
/// obeys all that apply), replacing an earlier global limit of the scope, and wakes the dispatchers. The relay shares
/// the room between the workspaces whose jobs wait: in each claim, each takes at most its fair part of it.
///
/// `pool` is the operator role's: a global limit is the operator's, as pauses and weights are, and the change is
/// audited (`conveyor_admin_set_global_limit`).
pub async fn set_global_limit(pool: &PgPool, scope: &GlobalScope, limit: GlobalLimit) -> Result<(), FlowError> {
    set_global_limit_as(pool, crate::flow::LIBRARY_ACTOR, None, scope, limit).await
}

/// [`set_global_limit`] for `actor`, whose change's intent is the audit row `intent`.
pub(crate) async fn set_global_limit_as(
    operator: &PgPool,
    actor: &str,
    intent: Option<i64>,
    scope: &GlobalScope,
    limit: GlobalLimit,
) -> Result<(), FlowError> {
    check_global(scope, limit)?;
    let (max_in_flight, per, interval_ms) = stored(limit.max_in_flight, limit.max_per_interval)?;
    sqlx::query("SELECT conveyor.conveyor_admin_set_global_limit($1, $2, $3, $4, $5, $6, $7)")
        .bind(actor)
        .bind(intent)
        .bind(scope.scope())
        .bind(scope.name())
        .bind(max_in_flight)
        .bind(per)
        .bind(interval_ms)
        .execute(operator)
        .await?;
    Ok(())
}

/// Refuses a bad scope, a limit of nothing, or a number out of range, before anything is written.
pub(crate) fn check_global(scope: &GlobalScope, limit: GlobalLimit) -> Result<(), FlowError> {
    scope.check()?;
    if limit.max_in_flight.is_none() && limit.max_per_interval.is_none() {
        return Err(FlowError::OutOfRange("a global limit has max_in_flight, max_per_interval or both"));
    }
    stored(limit.max_in_flight, limit.max_per_interval).map(|_| ())
}

/// Removes the global limit of `scope` and wakes the dispatchers: its held jobs go. `false` when it had none. `pool` is
/// the operator role's.
pub async fn remove_global_limit(pool: &PgPool, scope: &GlobalScope) -> Result<bool, FlowError> {
    remove_global_limit_as(pool, crate::flow::LIBRARY_ACTOR, None, scope).await
}

/// [`remove_global_limit`] for `actor`, whose change's intent is the audit row `intent`.
pub(crate) async fn remove_global_limit_as(
    operator: &PgPool,
    actor: &str,
    intent: Option<i64>,
    scope: &GlobalScope,
) -> Result<bool, FlowError> {
    scope.check()?;
    let (removed,): (bool,) = sqlx::query_as("SELECT conveyor.conveyor_admin_remove_global_limit($1, $2, $3, $4)")
        .bind(actor)
        .bind(intent)
        .bind(scope.scope())
        .bind(scope.name())
        .fetch_one(operator)
        .await?;
    Ok(removed)
}

/// The global limits, by scope and name, each with its jobs in flight and its recent hand-outs. `pool` is the operator
/// role's (the read is audited).
pub async fn list_global_limits(pool: &PgPool) -> Result<Vec<GlobalLimits>, FlowError> {
    list_global_limits_as(pool, crate::flow::LIBRARY_ACTOR).await
}

/// [`list_global_limits`] for `actor`.
pub(crate) async fn list_global_limits_as(operator: &PgPool, actor: &str) -> Result<Vec<GlobalLimits>, FlowError> {
    Ok(sqlx::query_as(
        "SELECT scope, name, max_in_flight, max_per_interval, interval_ms, in_flight, handed_out_in_interval,
                updated_at
         FROM conveyor.conveyor_admin_global_limits($1)",
    )
    .bind(actor)
    .fetch_all(operator)
    .await?)
}
