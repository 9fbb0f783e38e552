//! The transactional outbox (seed section 3): a business transaction that starts background work writes an
//! `outbox_events` row beside its business rows; the dispatcher relays committed rows into Redis Streams.

pub mod event;
pub mod reconcile;

use uuid::Uuid;

use crate::db::WorkspaceTx;
use crate::ids::WorkspaceId;
pub use event::JobPayload;

/// The channel the dispatcher `LISTEN`s on; a commit that wrote events notifies it.
pub const NOTIFY_CHANNEL: &str = "conveyor_outbox";

/// Tells the dispatchers, at commit, that `workspace` has due events (the payload is its id, so they need not
/// look it up). Several notifications of one transaction with the same payload arrive as one.
pub async fn notify_tx(tx: &mut WorkspaceTx, workspace: WorkspaceId) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_notify($1, $2)")
        .bind(NOTIFY_CHANNEL)
        .bind(workspace.0.to_string())
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// An event to enqueue.
#[derive(Clone, Debug)]
pub struct NewEvent {
    /// The tenant; must be the workspace of the transaction.
    pub workspace_id: WorkspaceId,
    /// What to do.
    pub payload: JobPayload,
    /// The user-visible operation the job advances, if any.
    pub operation_id: Option<Uuid>,
    /// W3C `traceparent` of the request that caused it, carried to the worker.
    pub traceparent: Option<String>,
}

/// Writes `event` as a `pending` outbox row inside the caller's transaction and notifies the dispatcher at commit.
///
/// Call it in the same transaction as the business rows it belongs to: if that transaction rolls back, the event
/// never existed; once it commits, the dispatcher delivers it at least once even if this process dies the next
/// instant. Returns the event id (a UUIDv7, which is also the queue's job id).
///
/// ```no_run
/// # async fn f(pool: sqlx::PgPool, ws: conveyor::ids::WorkspaceId, store_id: uuid::Uuid) -> Result<(), sqlx::Error> {
/// use conveyor::outbox::{enqueue_tx, JobPayload, NewEvent};
/// let mut tx = conveyor::db::begin_workspace(&pool, ws).await?;
/// // ... write the business rows with `&mut *tx` ...
/// let payload = JobPayload::StoreVerifyCredentials { store_id, credentials_version: 1 };
/// enqueue_tx(&mut tx, NewEvent { workspace_id: ws, payload, operation_id: None, traceparent: None }).await?;
/// tx.commit().await?;
/// # Ok(()) }
/// ```
pub async fn enqueue_tx(tx: &mut WorkspaceTx, event: NewEvent) -> Result<Uuid, sqlx::Error> {
    let id = Uuid::now_v7();
    // The notification rides in the insert's round trip (see `notify_tx`).
    sqlx::query(
        "INSERT INTO outbox_events (id, workspace_id, queue, event_type, event_payload, operation_id, traceparent)
         SELECT $1, $2, $3, $4, $5, $6, $7 FROM (SELECT pg_notify($8, $2::text)) AS notified",
    )
    .bind(id)
    .bind(event.workspace_id.0)
    .bind(event.payload.queue())
    .bind(event.payload.event_type())
    .bind(event.payload.body())
    .bind(event.operation_id)
    .bind(event.traceparent)
    .bind(NOTIFY_CHANNEL)
    .execute(&mut **tx)
    .await?;
    Ok(id)
}
