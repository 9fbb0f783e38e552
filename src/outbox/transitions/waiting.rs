//! Changes of a workspace's jobs that BullMQ's `Queue` and `Job` make: a waiting job's priority, due time or payload
//! changed (refused once the relay took it), the waiting jobs of a queue or kind canceled (a drain), ended jobs
//! deleted by age or beyond the newest N (a clean). Each runs in the caller's transaction of one workspace, under
//! row-level security, and takes the rows it changes with `FOR UPDATE`: the relay's claim skips a locked row
//! (`SKIP LOCKED`), so a job is either changed while it waits or claimed with what it had, never both.

use std::time::Duration;

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::{LIVE, announce_cancel_tx, discard_tx};
use crate::db::WorkspaceTx;
use crate::ids::WorkspaceId;

/// When a changed job becomes due.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Due {
    /// Now, by PostgreSQL's clock.
    Now,
    /// At this time.
    At(DateTime<Utc>),
    /// This long from now, by PostgreSQL's clock.
    After(Duration),
}

/// What to change of a waiting job; `None` keeps what it has.
#[derive(Debug, Default)]
pub(crate) struct Change<'a> {
    pub(crate) priority: Option<i16>,
    pub(crate) due: Option<Due>,
    /// The kind the payload is of (checked against the job's when set), and the payload.
    pub(crate) payload: Option<(Option<&'a str>, &'a serde_json::Value)>,
}

/// What a change did.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum ChangeOutcome {
    /// Changed; due at this time now.
    Done(DateTime<Utc>),
    /// No such job in the workspace.
    NotFound,
    /// Nothing changed: it is no longer waiting (the relay took it, or it ended). Its row's status.
    NotWaiting(String),
    /// Nothing changed: the payload is of another kind than the job (the job's kind).
    OtherKind(String),
    /// Nothing changed: its due time was to change, but it is a parent waiting for its children (due when the last
    /// one ends).
    WaitsForChildren,
}

/// Changes the waiting job `job` (status `pending`: delayed, due, or waiting out a retry's back-off) as `change`
/// says, and wakes the dispatchers at commit: at once when it is due, else at its due time. The change starts a new
/// generation of the job (as a replay does): an entry of an earlier hand-off still in a stream (an `XADD` whose reply
/// was lost, so the relay put the job back to `pending`) no longer runs, and the next hand-off gets past its de-dup
/// key with what the job has now.
pub(crate) async fn change_tx(
    tx: &mut WorkspaceTx,
    workspace: WorkspaceId,
    job: Uuid,
    change: &Change<'_>,
) -> Result<ChangeOutcome, sqlx::Error> {
    let row: Option<(String, String, i32)> = sqlx::query_as(
        "SELECT status, event_type, children_left FROM conveyor.outbox_events
         WHERE id = $1 AND status <> 'discarded' FOR UPDATE",
    )
    .bind(job)
    .fetch_optional(&mut **tx)
    .await?;
    let Some((status, kind, children_left)) = row else { return Ok(ChangeOutcome::NotFound) };
    if status != "pending" {
        return Ok(ChangeOutcome::NotWaiting(status));
    }
    if children_left > 0 && change.due.is_some() {
        return Ok(ChangeOutcome::WaitsForChildren);
    }
    if let Some((Some(payload_kind), _)) = change.payload
        && payload_kind != kind
    {
        return Ok(ChangeOutcome::OtherKind(kind));
    }
    let (due_how, due_at, due_after) = match change.due {
        None => (None, None, None),
        Some(Due::Now) => (Some("now"), None, None),
        Some(Due::At(at)) => (Some("at"), Some(at), None),
        Some(Due::After(after)) => (Some("after"), None, Some(after.as_secs_f64())),
    };
    let (due, later): (DateTime<Utc>, bool) = sqlx::query_as(
        "UPDATE conveyor.outbox_events
         SET priority = coalesce($2, priority),
             next_attempt_at = CASE $3 WHEN 'now' THEN now() WHEN 'at' THEN $4
                                       WHEN 'after' THEN now() + make_interval(secs => $5)
                                       ELSE next_attempt_at END,
             event_payload = coalesce($6, event_payload),
             redrive_count = redrive_count + 1, stream_id = NULL
         WHERE id = $1
         RETURNING next_attempt_at, next_attempt_at > now()",
    )
    .bind(job)
    .bind(change.priority)
    .bind(due_how)
    .bind(due_at)
    .bind(due_after)
    .bind(change.payload.map(|(_, payload)| payload))
    .fetch_one(&mut **tx)
    .await?;
    wake_tx(tx, workspace, later.then_some(due)).await?;
    Ok(ChangeOutcome::Done(due))
}

/// At commit, tells the dispatchers that `workspace` has a job due at `due` (now when `None`), as an enqueue does.
async fn wake_tx(tx: &mut WorkspaceTx, workspace: WorkspaceId, due: Option<DateTime<Utc>>) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_notify($1, $2)")
        .bind(crate::outbox::NOTIFY_CHANNEL)
        .bind(format!("{}{}", workspace.0, crate::outbox::enqueue::notification_suffix(due)))
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// What one step of a drain did.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Drained {
    /// Waiting jobs it found (`limit`: there may be more).
    pub(crate) found: u64,
    /// Of those, canceled (the others were taken by the relay, or ended, meanwhile).
    pub(crate) canceled: u64,
}

/// Cancels, in the caller's transaction, up to `limit` of the workspace's waiting jobs (status `pending`) of `queue`
/// and of `kind` (each when set), as a cancel of each would: a job that advances a live operation is canceled with
/// the operation and the operation's other live jobs. Workers running any of those are told at commit, and waiters
/// learn that they ended.
pub(crate) async fn drain_tx(
    tx: &mut WorkspaceTx,
    workspace: WorkspaceId,
    queue: Option<&str>,
    kind: Option<&str>,
    limit: i64,
) -> Result<Drained, sqlx::Error> {
    cancel_tx(tx, workspace, queue, kind, false, limit).await
}

/// What [`drain_tx`] does, and with `handed_out_too` to the jobs handed to workers as well (a forced obliterate): a
/// worker running one is told at commit, and rolls its run back when it ends. A job canceled once handed out (in a
/// stream, its mark perhaps not recorded yet) gets a hand-off time, so that a clean or an obliterate keeps its row
/// while its run may go on.
async fn cancel_tx(
    tx: &mut WorkspaceTx,
    workspace: WorkspaceId,
    queue: Option<&str>,
    kind: Option<&str>,
    handed_out_too: bool,
    limit: i64,
) -> Result<Drained, sqlx::Error> {
    // Any `limit` of them, in index order (no sort over the backlog); the rows are locked in id order below.
    let waiting: Vec<(Uuid, Option<Uuid>)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT id, operation_id FROM conveyor.outbox_events
         WHERE status IN {} AND ($1::text IS NULL OR queue = $1) AND ($2::text IS NULL OR event_type = $2)
         LIMIT $3",
        if handed_out_too { LIVE } else { "('pending')" }
    )))
    .bind(queue)
    .bind(kind)
    .bind(limit)
    .fetch_all(&mut **tx)
    .await?;
    if waiting.is_empty() {
        return Ok(Drained::default());
    }
    let ids: Vec<Uuid> = waiting.iter().map(|(id, _)| *id).collect();
    let mut operations: Vec<Uuid> = waiting.iter().filter_map(|(_, op)| *op).collect();
    operations.sort();
    operations.dedup();
    // A waiting parent of a flow cancels its live children with it: what they lock, locked first.
    super::lock_descendants_tx(tx, &ids).await?;
    // Operations first, in id order, as every transition locks them: then the jobs.
    let canceled_operations: Vec<Uuid> = sqlx::query_scalar(
        "WITH locked AS (SELECT id FROM conveyor.operations WHERE id = ANY($1) ORDER BY id FOR UPDATE)
         UPDATE conveyor.operations o
         SET status = 'canceled', error = NULL, finished_at = clock_timestamp(), updated_at = now()
         FROM locked WHERE o.id = locked.id AND o.status IN ('queued', 'running')
         RETURNING o.id",
    )
    .bind(&operations)
    .fetch_all(&mut **tx)
    .await?;
    let rows: Vec<(Uuid, bool)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "WITH locked AS (
             SELECT id FROM conveyor.outbox_events
             WHERE status IN {LIVE} AND ((id = ANY($1) AND (status = 'pending' OR $3)) OR operation_id = ANY($2))
             ORDER BY id FOR UPDATE)
         UPDATE conveyor.outbox_events e
         SET status = 'canceled', finished_at = clock_timestamp(), locked_by = NULL, locked_until = NULL,
             dispatched_at = CASE WHEN e.status = 'pending' THEN e.dispatched_at
                                  ELSE coalesce(e.dispatched_at, clock_timestamp()) END
         FROM locked WHERE e.id = locked.id AND e.status IN {LIVE}
           AND ((e.id = ANY($1) AND (e.status = 'pending' OR $3)) OR e.operation_id = ANY($2))
         RETURNING e.id, e.id = ANY($1)"
    )))
    .bind(&ids)
    .bind(&canceled_operations)
    .bind(handed_out_too)
    .fetch_all(&mut **tx)
    .await?;
    let canceled: Vec<Uuid> = rows.iter().map(|(id, _)| *id).collect();
    announce_cancel_tx(tx, workspace, &canceled).await?;
    Ok(Drained { found: ids.len() as u64, canceled: rows.iter().filter(|(_, waiting)| *waiting).count() as u64 })
}

/// Which ended jobs a clean deletes.
#[derive(Debug)]
pub(crate) struct Clean<'a> {
    /// The row status: `completed`, `canceled` or `dead_letter`.
    pub(crate) status: &'a str,
    pub(crate) queue: Option<&'a str>,
    pub(crate) kind: Option<&'a str>,
    /// Ended at least this long ago.
    pub(crate) older_than: Option<Duration>,
    /// Beyond the newest this many of those matching (by end time); at least 1.
    pub(crate) keep_last: Option<i64>,
}

/// How long a canceled job that was handed to a worker stays out of a clean: the longest a run may last (a time-out
/// is at most 24 hours). A run canceled while it runs ends when its handler returns, and its worker then finds the
/// job canceled and rolls its writes back; were the row gone, it would find nothing to fence and commit them.
const RUN_AT_MOST: &str = "interval '24 hours'";

/// Deletes, in the caller's transaction, up to `limit` of the workspace's ended jobs that `clean` matches, oldest end
/// first; returns how many it found (`limit`: there may be more) and how many it deleted. Succeeded and canceled
/// jobs go (with their recorded failures and logs); failed ones (dead letters) are discarded, as an operator's
/// discard does: a tombstone stays until retention, so that a delivery still in a stream is skipped. A canceled job
/// that was handed to a worker stays until its run cannot be going on any more ([`RUN_AT_MOST`] after its cancel).
pub(crate) async fn clean_tx(tx: &mut WorkspaceTx, clean: &Clean<'_>, limit: i64) -> Result<(u64, u64), sqlx::Error> {
    // The end time of each status: a dead letter's is when it was dead-lettered.
    let ended = if clean.status == "dead_letter" { "dead_lettered_at" } else { "finished_at" };
    // The newest `keep_last` stay: the rows ended before the last of them go (none when fewer match). The filter is
    // written twice, not shared through a CTE, which PostgreSQL would materialize whole.
    let matching = format!(
        "status = $1 AND ($2::text IS NULL OR queue = $2) AND ($3::text IS NULL OR event_type = $3)
         AND NOT (status = 'canceled' AND dispatched_at IS NOT NULL AND finished_at > now() - {RUN_AT_MOST})"
    );
    let ids: Vec<Uuid> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT id FROM conveyor.outbox_events
         WHERE {matching}
           AND ($4::float8 IS NULL OR {ended} <= now() - make_interval(secs => $4))
           AND ($5::bigint IS NULL
                OR ({ended}, id) < (SELECT k.{ended}, k.id FROM conveyor.outbox_events k
                                    WHERE {matching} ORDER BY k.{ended} DESC, k.id DESC OFFSET $5 - 1 LIMIT 1))
         ORDER BY {ended}, id
         LIMIT $6"
    )))
    .bind(clean.status)
    .bind(clean.queue)
    .bind(clean.kind)
    .bind(clean.older_than.map(|d| d.as_secs_f64()))
    .bind(clean.keep_last)
    .bind(limit)
    .fetch_all(&mut **tx)
    .await?;
    let found = ids.len() as u64;
    if ids.is_empty() {
        return Ok((0, 0));
    }
    if clean.status == "dead_letter" {
        return Ok((found, discard_tx(tx, &ids).await?.len() as u64));
    }
    // Their recorded failures go with them (ON DELETE CASCADE).
    let deleted =
        sqlx::query("DELETE FROM conveyor.outbox_events WHERE id = ANY($1) AND status IN ('completed', 'canceled')")
            .bind(&ids)
            .execute(&mut **tx)
            .await?;
    Ok((found, deleted.rows_affected()))
}

/// Makes up to `limit` of the workspace's delayed jobs (waiting for the relay, due later: delayed, or waiting out a
/// retry's back-off) of `queue` and of `kind` (each when set), enqueued by `enqueued_by`, due now, and wakes the dispatchers at commit; how many.
/// A job another transaction holds (a change, the relay) is skipped. A pause or a block still holds what it holds.
pub(crate) async fn promote_tx(
    tx: &mut WorkspaceTx,
    workspace: WorkspaceId,
    queue: Option<&str>,
    kind: Option<&str>,
    enqueued_by: DateTime<Utc>,
    limit: i64,
) -> Result<u64, sqlx::Error> {
    let promoted = sqlx::query(
        "UPDATE conveyor.outbox_events SET next_attempt_at = now()
         WHERE id IN (SELECT id FROM conveyor.outbox_events
                      WHERE status = 'pending' AND next_attempt_at > now() AND created_at <= $4 AND children_left = 0
                        AND ($1::text IS NULL OR queue = $1) AND ($2::text IS NULL OR event_type = $2)
                      LIMIT $3 FOR UPDATE SKIP LOCKED)
           AND status = 'pending'",
    )
    .bind(queue)
    .bind(kind)
    .bind(limit)
    .bind(enqueued_by)
    .execute(&mut **tx)
    .await?
    .rows_affected();
    if promoted > 0 {
        wake_tx(tx, workspace, None).await?;
    }
    Ok(promoted)
}

/// The jobs of `queue` in the workspace that are handed to workers (and not ended).
pub(crate) async fn handed_out_tx(tx: &mut WorkspaceTx, queue: &str) -> Result<u64, sqlx::Error> {
    let n: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM conveyor.outbox_events WHERE queue = $1 AND status IN ('dispatching', 'dispatched')",
    )
    .bind(queue)
    .fetch_one(&mut **tx)
    .await?;
    Ok(n as u64)
}

/// Cancels up to `limit` live jobs of `queue` (handed out too when `handed_out_too`), as a drain does.
pub(crate) async fn cancel_queue_tx(
    tx: &mut WorkspaceTx,
    workspace: WorkspaceId,
    queue: &str,
    handed_out_too: bool,
    limit: i64,
) -> Result<Drained, sqlx::Error> {
    cancel_tx(tx, workspace, Some(queue), None, handed_out_too, limit).await
}

/// Deletes up to `limit` ended jobs of `queue` in the workspace, whatever their end (a dead letter's tombstone too),
/// but a canceled job that was handed to a worker in the last [`RUN_AT_MOST`] (its run may still be going, and must
/// find its row to roll back); how many it found, and deleted.
pub(crate) async fn delete_ended_tx(tx: &mut WorkspaceTx, queue: &str, limit: i64) -> Result<(u64, u64), sqlx::Error> {
    let ids: Vec<Uuid> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT id FROM conveyor.outbox_events
         WHERE queue = $1 AND status IN ('completed', 'canceled', 'dead_letter', 'discarded')
           AND NOT (status = 'canceled' AND dispatched_at IS NOT NULL AND finished_at > now() - {RUN_AT_MOST})
         LIMIT $2"
    )))
    .bind(queue)
    .bind(limit)
    .fetch_all(&mut **tx)
    .await?;
    // Their recorded failures and logs go with them (ON DELETE CASCADE).
    let deleted = sqlx::query(
        "DELETE FROM conveyor.outbox_events
         WHERE id = ANY($1) AND status IN ('completed', 'canceled', 'dead_letter', 'discarded')",
    )
    .bind(&ids)
    .execute(&mut **tx)
    .await?
    .rows_affected();
    Ok((ids.len() as u64, deleted))
}
