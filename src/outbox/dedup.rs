//! The throttle and the debounce of a de-duplication key ([`DedupMode`]), decided on the key's row in `dedup_keys`
//! (migration 0047): an enqueue takes the row's lock with `INSERT .. ON CONFLICT DO UPDATE` and holds it until the
//! caller's transaction ends, so concurrent enqueues of one key take their turns and each sees what the one before
//! committed. A key's mode is part of the key. Every statement names the workspace as well as row-level security
//! does, so that a role that reads every workspace (the owner, in the single-role mode) reads its own alone.

use std::time::Duration;

use uuid::Uuid;

use super::enqueue::{EnqueueError, Enqueued, Row, insert_row, no_workspace};
use crate::db::WorkspaceTx;
use crate::ids::JobId;
use crate::kind::JobKind;

/// A throttled enqueue: takes the key if its period is over, then writes the job, which also carries the key in
/// `dedup_key` so that the live jobs' index holds it while the job lives. A key still held answers the job that holds
/// it: the live one if any, else the one that took the key (which retention may have deleted since).
pub(super) async fn throttled<K: JobKind>(
    tx: &mut WorkspaceTx,
    row: &Row,
    key: &str,
    period: Duration,
    suffix: &str,
) -> Result<Enqueued, EnqueueError> {
    let taken: Option<bool> = sqlx::query_scalar(
        "INSERT INTO conveyor.dedup_keys AS k (workspace_id, event_type, mode, dedup_key, job_id, held_until)
         VALUES (conveyor.conveyor_current_workspace(), $1, 'throttle', $2, $3,
                 statement_timestamp() + make_interval(secs => $4))
         ON CONFLICT (workspace_id, event_type, mode, dedup_key) DO UPDATE
             SET job_id = excluded.job_id, held_until = excluded.held_until
             WHERE k.held_until <= statement_timestamp()
         RETURNING true",
    )
    .bind(K::KIND)
    .bind(key)
    .bind(row.id)
    .bind(period.as_secs_f64())
    .fetch_optional(&mut **tx)
    .await
    .map_err(no_workspace)?;
    if taken.is_none() {
        // Held: a statement of its own, whose snapshot sees the enqueue that took the key.
        let holder: Uuid = sqlx::query_scalar(
            "SELECT coalesce(
                 (SELECT e.id FROM conveyor.outbox_events e
                  WHERE e.workspace_id = k.workspace_id AND e.event_type = k.event_type AND e.dedup_key = k.dedup_key
                    AND e.status IN ('pending', 'dispatching', 'dispatched')),
                 k.job_id)
             FROM conveyor.dedup_keys k
             WHERE k.workspace_id = conveyor.conveyor_current_workspace() AND k.event_type = $1
               AND k.mode = 'throttle' AND k.dedup_key = $2",
        )
        .bind(K::KIND)
        .bind(key)
        .fetch_one(&mut **tx)
        .await?;
        return Ok(Enqueued { id: JobId(holder), created: false });
    }
    let enqueued = insert_row::<K>(tx, row, suffix).await?;
    if !enqueued.created {
        // A live job holds the key beyond a period that is over (or was enqueued while live only): the key names it,
        // and holds no period of its own, since this enqueue wrote nothing.
        sqlx::query(
            "UPDATE conveyor.dedup_keys SET job_id = $3, held_until = statement_timestamp()
             WHERE workspace_id = conveyor.conveyor_current_workspace() AND event_type = $1 AND mode = 'throttle'
               AND dedup_key = $2",
        )
        .bind(K::KIND)
        .bind(key)
        .bind(enqueued.id.0)
        .execute(&mut **tx)
        .await?;
    }
    Ok(enqueued)
}

/// A debounced enqueue: the key's row names the job it last wrote. While that job waits (`pending`), it takes the new
/// payload and due time, as a new generation (as `change_job` does: an entry of an earlier hand-off still in a stream
/// no longer runs, and the next hand-off gets past its de-dup key with the new payload); the dispatchers are woken for
/// its new due time. Once it was handed to a worker (or ended), a new job is written and the key follows it.
pub(super) async fn debounced<K: JobKind>(
    tx: &mut WorkspaceTx,
    row: &Row,
    key: &str,
    replace_payload: bool,
    extend_delay: bool,
    suffix: &str,
) -> Result<Enqueued, EnqueueError> {
    // The update changes nothing but takes the row's lock; a row that names this enqueue's id was inserted by it.
    let named: Uuid = sqlx::query_scalar(
        "INSERT INTO conveyor.dedup_keys AS k (workspace_id, event_type, mode, dedup_key, job_id, held_until)
         VALUES (conveyor.conveyor_current_workspace(), $1, 'debounce', $2, $3, NULL)
         ON CONFLICT (workspace_id, event_type, mode, dedup_key) DO UPDATE SET job_id = k.job_id
         RETURNING k.job_id",
    )
    .bind(K::KIND)
    .bind(key)
    .bind(row.id)
    .fetch_one(&mut **tx)
    .await
    .map_err(no_workspace)?;
    let inserted = named == row.id;
    if !inserted {
        let waiting: Option<Uuid> = sqlx::query_scalar(
            "UPDATE conveyor.outbox_events
             SET event_payload = CASE WHEN $3 THEN $4 ELSE event_payload END,
                 next_attempt_at = CASE WHEN $5 THEN statement_timestamp() + make_interval(secs => $6)
                                        ELSE next_attempt_at END,
                 redrive_count = redrive_count + 1, stream_id = NULL
             FROM conveyor.conveyor_wake_dispatchers(conveyor.conveyor_current_workspace()::text || $7) AS notified
             WHERE id = $1 AND workspace_id = conveyor.conveyor_current_workspace() AND event_type = $2
               AND status = 'pending'
             RETURNING id",
        )
        .bind(named)
        .bind(K::KIND)
        .bind(replace_payload)
        .bind(&row.payload)
        .bind(extend_delay)
        .bind(row.delay_secs)
        .bind(if extend_delay { suffix } else { "" })
        .fetch_optional(&mut **tx)
        .await?;
        if let Some(id) = waiting {
            return Ok(Enqueued { id: JobId(id), created: false });
        }
    }
    let enqueued = insert_row::<K>(tx, row, suffix).await?;
    if !inserted {
        sqlx::query(
            "UPDATE conveyor.dedup_keys SET job_id = $3
             WHERE workspace_id = conveyor.conveyor_current_workspace() AND event_type = $1 AND mode = 'debounce'
               AND dedup_key = $2",
        )
        .bind(K::KIND)
        .bind(key)
        .bind(enqueued.id.0)
        .execute(&mut **tx)
        .await?;
    }
    Ok(enqueued)
}
