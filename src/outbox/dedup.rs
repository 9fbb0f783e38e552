//! The throttle and the debounce of a de-duplication key ([`DedupMode`]), decided on the key's row in `dedup_keys`
//! (migration 0047): an enqueue takes the row's lock with `INSERT .. ON CONFLICT DO UPDATE` and holds it until the
//! caller's transaction ends, so concurrent enqueues of one key take their turns and each sees what the one before
//! committed.

use std::time::Duration;

use uuid::Uuid;

use super::enqueue::{DedupMode, EnqueueError, Enqueued, Row, insert_row};
use crate::db::WorkspaceTx;
use crate::ids::JobId;
use crate::kind::JobKind;

/// A throttled enqueue: takes the key if its period is over (or it has none), then writes the job, which also carries
/// the key in `dedup_key` so that the live jobs' index holds it while the job lives. A key still held answers the job
/// that holds it: the live one if any, else the one that took the key.
pub(super) async fn throttled<K: JobKind>(
    tx: &mut WorkspaceTx,
    row: &Row,
    key: &str,
    period: Duration,
    suffix: &str,
) -> Result<Enqueued, EnqueueError> {
    debug_assert!(matches!(row.dedup_mode, DedupMode::Throttle { .. }));
    let taken: Option<bool> = sqlx::query_scalar(
        "INSERT INTO conveyor.dedup_keys AS k (workspace_id, event_type, dedup_key, job_id, held_until)
         VALUES (conveyor.conveyor_current_workspace(), $1, $2, $3, statement_timestamp() + make_interval(secs => $4))
         ON CONFLICT (workspace_id, event_type, dedup_key) DO UPDATE
             SET job_id = excluded.job_id, held_until = excluded.held_until
             WHERE coalesce(k.held_until, '-infinity') <= statement_timestamp()
         RETURNING true",
    )
    .bind(K::KIND)
    .bind(key)
    .bind(row.id)
    .bind(period.as_secs_f64())
    .fetch_optional(&mut **tx)
    .await
    .map_err(super::enqueue::no_workspace)?;
    if taken.is_none() {
        // Held: a statement of its own, whose snapshot sees the enqueue that took the key.
        let holder: Uuid = sqlx::query_scalar(
            "SELECT coalesce(
                 (SELECT e.id FROM conveyor.outbox_events e
                  WHERE e.event_type = $1 AND e.dedup_key = $2 AND e.status IN ('pending', 'dispatching', 'dispatched')),
                 k.job_id)
             FROM conveyor.dedup_keys k WHERE k.event_type = $1 AND k.dedup_key = $2",
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
             WHERE event_type = $1 AND dedup_key = $2",
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
/// payload and due time; once handed to a worker (or ended), a new job is written and the key follows it.
pub(super) async fn debounced<K: JobKind>(
    tx: &mut WorkspaceTx,
    row: &Row,
    key: &str,
    replace_payload: bool,
    extend_delay: bool,
    suffix: &str,
) -> Result<Enqueued, EnqueueError> {
    // `xmax = 0`: the row was inserted, not updated. The update changes nothing but takes the row's lock.
    let (named, inserted): (Uuid, bool) = sqlx::query_as(
        "INSERT INTO conveyor.dedup_keys AS k (workspace_id, event_type, dedup_key, job_id, held_until)
         VALUES (conveyor.conveyor_current_workspace(), $1, $2, $3, NULL)
         ON CONFLICT (workspace_id, event_type, dedup_key) DO UPDATE SET held_until = NULL
         RETURNING k.job_id, k.xmax = 0",
    )
    .bind(K::KIND)
    .bind(key)
    .bind(row.id)
    .fetch_one(&mut **tx)
    .await
    .map_err(super::enqueue::no_workspace)?;
    if !inserted {
        let waiting: Option<Uuid> = sqlx::query_scalar(
            "UPDATE conveyor.outbox_events
             SET event_payload = CASE WHEN $3 THEN $4 ELSE event_payload END,
                 next_attempt_at = CASE WHEN $5 THEN now() + make_interval(secs => $6) ELSE next_attempt_at END
             WHERE id = $1 AND event_type = $2 AND status = 'pending'
             RETURNING id",
        )
        .bind(named)
        .bind(K::KIND)
        .bind(replace_payload)
        .bind(&row.payload)
        .bind(extend_delay)
        .bind(row.delay_secs)
        .fetch_optional(&mut **tx)
        .await?;
        if let Some(id) = waiting {
            return Ok(Enqueued { id: JobId(id), created: false });
        }
    }
    let enqueued = insert_row::<K>(tx, row, suffix).await?;
    if !inserted {
        sqlx::query("UPDATE conveyor.dedup_keys SET job_id = $3 WHERE event_type = $1 AND dedup_key = $2")
            .bind(K::KIND)
            .bind(key)
            .bind(enqueued.id.0)
            .execute(&mut **tx)
            .await?;
    }
    Ok(enqueued)
}
