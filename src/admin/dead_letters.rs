//! Dead letters across workspaces: search through `conveyor_admin_dead_letters`; replay and discard, one or in bulk,
//! as the application role in each dead letter's own workspace, through the transitions module. Each change writes
//! its intent to the audit trail first (and is not made if that fails), then its outcome. A bulk action needs a filter
//! or `all`; it lists its targets through the same function (audited as the bulk action, with its filter), then acts
//! on each, and records what it did.

use std::collections::BTreeMap;

use serde_json::json;
use uuid::Uuid;

use super::jobs::{locate, page};
use super::{Actor, Admin, AdminError, BulkOutcome, DeadLetter, DeadLetterFilter, Page, Replay, audit, filters};
use crate::db;
use crate::ids::{JobId, WorkspaceId};
use crate::outbox::control::JobStatus;
use crate::outbox::transitions;

/// Dead letters matching `filter`, listed for `action` (the audit row's name), at most `limit`.
async fn list(
    admin: &Admin,
    actor: &Actor,
    action: &str,
    filter: &DeadLetterFilter,
    limit: i32,
) -> Result<Vec<DeadLetter>, AdminError> {
    Ok(sqlx::query_as(
        "SELECT id, workspace_id, queue, event_type, failure_stage, attempts, last_error, operation_id, created_at,
                dead_lettered_at
         FROM conveyor.conveyor_admin_dead_letters($1, $2, $3, $4, $5, $6, $7, $8, $9)",
    )
    .bind(filters::actor(actor)?)
    .bind(action)
    .bind(&filter.queue)
    .bind(&filter.kind)
    .bind(filter.workspace)
    .bind(filter.since)
    .bind(filter.until)
    .bind(filter.before)
    .bind(limit)
    .fetch_all(&admin.operator)
    .await?)
}

/// Dead letters matching `filter`, newest first.
pub(super) async fn search(
    admin: &Admin,
    actor: &Actor,
    filter: &DeadLetterFilter,
) -> Result<Page<DeadLetter>, AdminError> {
    let limit = filters::dead_letters(filter, false)?;
    let items = list(admin, actor, "dead_letters", filter, limit).await?;
    Ok(page(items, limit, |d| d.id))
}

/// Whether `e` is a unique index refusing a change: a replay whose job or operation would hold what a live one holds
/// (a de-dup key, a store's one active sync).
pub(super) fn is_unique_violation(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d) if d.code().as_deref() == Some("23505"))
}

/// Replays one dead letter in its workspace.
async fn replay_in(
    admin: &Admin,
    workspace: WorkspaceId,
    id: Uuid,
    operation: Option<Uuid>,
) -> Result<Replay, sqlx::Error> {
    let mut tx = db::begin_workspace(&admin.app, workspace).await?;
    let replayed = transitions::replay_tx(&mut tx, workspace, id, operation).await?;
    tx.commit().await?;
    Ok(replayed)
}

fn replay_outcome(replay: &Result<Replay, sqlx::Error>) -> serde_json::Value {
    match replay {
        Ok(Replay::Replayed) => json!("replayed"),
        Ok(Replay::NotDeadLetter) => json!("not_dead_letter"),
        Ok(Replay::KeyHeld(holder)) => json!({ "key_held_by": holder }),
        Err(e) if is_unique_violation(e) => json!("refused_by_unique_index"),
        Err(_) => json!("error"),
    }
}

/// Replays one dead letter from its first attempt.
pub(super) async fn replay_one(admin: &Admin, actor: &Actor, id: JobId) -> Result<Replay, AdminError> {
    let intent = audit::intent(admin, actor, "replay_dead_letter", json!({ "job_id": id.0 })).await?;
    let located = match locate(admin, actor, id).await {
        Ok(located) => located.filter(|j| j.status == JobStatus::Failed),
        Err(e) => {
            intent.failed(admin, actor, json!({ "job_id": id.0 }), &e).await;
            return Err(e);
        }
    };
    let replayed = match &located {
        None => Ok(Replay::NotDeadLetter),
        Some(job) => replay_in(admin, job.workspace, id.0, job.operation).await,
    };
    let workspace = located.map(|j| j.workspace.0);
    intent
        .record(admin, actor, json!({ "job_id": id.0, "workspace": workspace, "outcome": replay_outcome(&replayed) }))
        .await;
    Ok(replayed?)
}

/// Discards `ids` of `workspace` that are dead letters; returns those discarded.
async fn discard_in(admin: &Admin, workspace: WorkspaceId, ids: &[Uuid]) -> Result<Vec<Uuid>, sqlx::Error> {
    let mut tx = db::begin_workspace(&admin.app, workspace).await?;
    let gone = transitions::discard_tx(&mut tx, ids).await?;
    tx.commit().await?;
    Ok(gone)
}

/// Discards one dead letter; `false`: it is not one.
pub(super) async fn discard_one(admin: &Admin, actor: &Actor, id: JobId) -> Result<bool, AdminError> {
    let intent = audit::intent(admin, actor, "discard_dead_letter", json!({ "job_id": id.0 })).await?;
    let discarded = async {
        let located = locate(admin, actor, id).await?.filter(|j| j.status == JobStatus::Failed);
        let discarded = match &located {
            None => false,
            Some(job) => !discard_in(admin, job.workspace, &[id.0]).await?.is_empty(),
        };
        Ok::<_, AdminError>((located.map(|j| j.workspace.0), discarded))
    }
    .await;
    match discarded {
        Ok((workspace, discarded)) => {
            let outcome = if discarded { "discarded" } else { "not_dead_letter" };
            intent.record(admin, actor, json!({ "job_id": id.0, "workspace": workspace, "outcome": outcome })).await;
            Ok(discarded)
        }
        Err(e) => {
            intent.failed(admin, actor, json!({ "job_id": id.0 }), &e).await;
            Err(e)
        }
    }
}

/// The filter's fields, for the audit trail.
fn filter_arguments(filter: &DeadLetterFilter, limit: i32) -> serde_json::Value {
    json!({
        "queue": filter.queue, "kind": filter.kind, "workspace": filter.workspace, "since": filter.since,
        "until": filter.until, "limit": limit, "all": filter.all.then_some(true),
    })
}

/// The start of a bulk action: its filter checked, its audited intent written (nothing is done without it), and the
/// dead letters it takes.
async fn begin_bulk(
    admin: &Admin,
    actor: &Actor,
    action: &'static str,
    filter: &DeadLetterFilter,
) -> Result<(serde_json::Value, audit::Intent, Vec<DeadLetter>), AdminError> {
    let limit = filters::dead_letters(filter, true)?;
    let arguments = filter_arguments(filter, limit);
    let intent = audit::intent(admin, actor, action, json!({ "filter": arguments })).await?;
    match list(admin, actor, action, filter, limit).await {
        Ok(targets) => Ok((arguments, intent, targets)),
        Err(e) => {
            intent.failed(admin, actor, json!({ "filter": arguments }), &e).await;
            Err(e)
        }
    }
}

/// Replays every dead letter matching `filter` (at most its limit), each in its own transaction: one refused (its
/// key held, or a unique index) is skipped, the others go.
pub(super) async fn replay_many(
    admin: &Admin,
    actor: &Actor,
    filter: &DeadLetterFilter,
) -> Result<BulkOutcome, AdminError> {
    let (arguments, intent, targets) = begin_bulk(admin, actor, "replay_dead_letters", filter).await?;
    let mut outcome = BulkOutcome { matched: targets.len() as u64, ..BulkOutcome::default() };
    let mut replayed = Vec::new();
    let mut failure = None;
    for dead in &targets {
        match replay_in(admin, WorkspaceId(dead.workspace_id), dead.id, dead.operation_id).await {
            Ok(Replay::Replayed) => {
                outcome.done += 1;
                replayed.push(dead.id);
            }
            Ok(Replay::NotDeadLetter | Replay::KeyHeld(_)) => outcome.skipped += 1,
            Err(e) if is_unique_violation(&e) => outcome.skipped += 1,
            Err(e) => {
                failure = Some(e);
                break;
            }
        }
    }
    intent.record(admin, actor, bulk_arguments(arguments, &outcome, &replayed, failure.is_some())).await;
    match failure {
        Some(e) => Err(e.into()),
        None => Ok(outcome),
    }
}

/// Discards every dead letter matching `filter` (at most its limit), one transaction per workspace.
pub(super) async fn discard_many(
    admin: &Admin,
    actor: &Actor,
    filter: &DeadLetterFilter,
) -> Result<BulkOutcome, AdminError> {
    let (arguments, intent, targets) = begin_bulk(admin, actor, "discard_dead_letters", filter).await?;
    let mut by_workspace: BTreeMap<Uuid, Vec<Uuid>> = BTreeMap::new();
    for dead in &targets {
        by_workspace.entry(dead.workspace_id).or_default().push(dead.id);
    }
    let mut discarded = Vec::new();
    let mut failure = None;
    for (workspace, ids) in &by_workspace {
        match discard_in(admin, WorkspaceId(*workspace), ids).await {
            Ok(gone) => discarded.extend(gone),
            Err(e) => {
                failure = Some(e);
                break;
            }
        }
    }
    let done = discarded.len() as u64;
    let outcome = BulkOutcome { matched: targets.len() as u64, done, skipped: targets.len() as u64 - done };
    intent.record(admin, actor, bulk_arguments(arguments, &outcome, &discarded, failure.is_some())).await;
    match failure {
        Some(e) => Err(e.into()),
        None => Ok(outcome),
    }
}

/// What a bulk action did, for its outcome row: its filter, its counts, the ids it changed, and whether it stopped on
/// an error.
fn bulk_arguments(
    filter: serde_json::Value,
    outcome: &BulkOutcome,
    changed: &[Uuid],
    failed: bool,
) -> serde_json::Value {
    json!({
        "filter": filter,
        "outcome": if failed { "stopped_by_error" } else { "done" },
        "matched": outcome.matched,
        "done": outcome.done,
        "skipped": outcome.skipped,
        "job_ids": changed,
    })
}
