//! User-visible operations: what a client polls at `GET /v1/operations/{id}` (`queued` → `running` →
//! `succeeded` / `failed`). The source of truth for a job's outcome; the outbox and the streams only deliver.

use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

use crate::db::WorkspaceTx;
use crate::ids::{UserId, WorkspaceId};

/// An operation as clients see it.
#[derive(Clone, Debug, Serialize, sqlx::FromRow)]
pub struct Operation {
    /// Id.
    pub id: Uuid,
    /// What it does, e.g. `store.verify_credentials`.
    pub kind: String,
    /// `queued`, `running`, `succeeded`, `failed` or `canceled`.
    pub status: String,
    /// The resource it concerns.
    pub subject_id: Option<Uuid>,
    /// Progress reported by the worker.
    pub progress: Option<serde_json::Value>,
    /// Result, once succeeded.
    pub result: Option<serde_json::Value>,
    /// Redacted error, once failed.
    pub error: Option<String>,
    /// Created.
    pub created_at: DateTime<Utc>,
    /// Last changed.
    pub updated_at: DateTime<Utc>,
}

macro_rules! columns {
    () => {
        "id, kind, status, subject_id, progress, result, error, created_at, updated_at"
    };
}

/// Creates a `queued` operation inside the caller's transaction.
pub async fn create_tx(
    tx: &mut WorkspaceTx,
    workspace_id: WorkspaceId,
    created_by: UserId,
    kind: &str,
    subject_id: Option<Uuid>,
) -> Result<Operation, sqlx::Error> {
    sqlx::query_as::<_, Operation>(concat!(
        "INSERT INTO conveyor.operations (id, workspace_id, kind, subject_id, created_by)
         VALUES ($1, $2, $3, $4, $5) RETURNING ",
        columns!()
    ))
    .bind(Uuid::now_v7())
    .bind(workspace_id.0)
    .bind(kind)
    .bind(subject_id)
    .bind(created_by.0)
    .fetch_one(&mut **tx)
    .await
}

/// The operation `id` of the transaction's workspace, if any.
pub async fn get_tx(tx: &mut WorkspaceTx, id: Uuid) -> Result<Option<Operation>, sqlx::Error> {
    sqlx::query_as::<_, Operation>(concat!("SELECT ", columns!(), " FROM conveyor.operations WHERE id = $1"))
        .bind(id)
        .fetch_optional(&mut **tx)
        .await
}

/// The statuses an operation can have.
pub const STATUSES: [&str; 5] = ["queued", "running", "succeeded", "failed", "canceled"];

/// Largest page [`list_tx`] answers.
pub const MAX_PAGE: u32 = 200;

/// A position in the newest-first order of operations: the last one of a page. Opaque to clients, who get it as
/// [`Cursor::encode`]: a version byte, `created_at` in microseconds and `id`, in base64url without padding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cursor {
    /// The operation's `created_at` (PostgreSQL keeps microseconds, so this round-trips exactly).
    pub created_at: DateTime<Utc>,
    /// The operation's id, which orders operations created in the same microsecond.
    pub id: Uuid,
}

const CURSOR_VERSION: u8 = 1;

impl Cursor {
    /// The cursor after `operation`.
    pub fn after(operation: &Operation) -> Self {
        Self { created_at: operation.created_at, id: operation.id }
    }

    /// The opaque text form.
    pub fn encode(&self) -> String {
        use base64::Engine;
        let mut bytes = Vec::with_capacity(25);
        bytes.push(CURSOR_VERSION);
        bytes.extend_from_slice(&self.created_at.timestamp_micros().to_be_bytes());
        bytes.extend_from_slice(self.id.as_bytes());
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
    }

    /// Reads [`Cursor::encode`]'s form; `None` for anything else.
    pub fn decode(text: &str) -> Option<Self> {
        use base64::Engine;
        let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(text).ok()?;
        let (&version, rest) = bytes.split_first()?;
        if version != CURSOR_VERSION || rest.len() != 24 {
            return None;
        }
        let (micros, id) = rest.split_at(8);
        let created_at = DateTime::from_timestamp_micros(i64::from_be_bytes(micros.try_into().ok()?))?;
        Some(Self { created_at, id: Uuid::from_slice(id).ok()? })
    }
}

/// Which operations [`list_tx`] answers.
#[derive(Clone, Debug)]
pub struct ListQuery {
    /// Only those with this status.
    pub status: Option<String>,
    /// Only those of this kind.
    pub kind: Option<String>,
    /// Only those after this position (the previous page's last).
    pub after: Option<Cursor>,
    /// At most this many (1 to [`MAX_PAGE`]; clamped).
    pub limit: u32,
}

/// A page of operations, newest first.
#[derive(Clone, Debug)]
pub struct Page {
    /// The operations.
    pub operations: Vec<Operation>,
    /// Where the next page starts; `None` on the last page.
    pub next_cursor: Option<Cursor>,
}

/// A page of the workspace's operations, newest first (`created_at DESC, id DESC`), by keyset pagination.
///
/// No index serves this order yet (the table has its primary key and the partial `operations_unfinished` only): it
/// is a scan of the table, filtered to the workspace by the explicit predicate and row-level security, then a top-N
/// sort. Acceptable while a workspace's history is short (retention bounds it); an index on
/// `(workspace_id, created_at DESC, id DESC)` in a later migration turns it into a range scan with no query change.
pub async fn list_tx(tx: &mut WorkspaceTx, workspace_id: WorkspaceId, query: &ListQuery) -> Result<Page, sqlx::Error> {
    let limit = query.limit.clamp(1, MAX_PAGE);
    let mut operations = sqlx::query_as::<_, Operation>(concat!(
        "SELECT ",
        columns!(),
        " FROM conveyor.operations
         WHERE workspace_id = $1
           AND ($2::text IS NULL OR status = $2)
           AND ($3::text IS NULL OR kind = $3)
           AND ($4::timestamptz IS NULL OR (created_at, id) < ($4, $5))
         ORDER BY created_at DESC, id DESC
         LIMIT $6"
    ))
    .bind(workspace_id.0)
    .bind(query.status.as_deref())
    .bind(query.kind.as_deref())
    .bind(query.after.map(|c| c.created_at))
    .bind(query.after.map(|c| c.id))
    .bind(i64::from(limit) + 1)
    .fetch_all(&mut **tx)
    .await?;
    let more = operations.len() > limit as usize;
    operations.truncate(limit as usize);
    let next_cursor = if more { operations.last().map(Cursor::after) } else { None };
    Ok(Page { operations, next_cursor })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cursor_round_trips_and_anything_else_is_refused() {
        let cursor =
            Cursor { created_at: DateTime::from_timestamp_micros(1_760_000_000_123_456).unwrap(), id: Uuid::now_v7() };
        let text = cursor.encode();
        assert!(text.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'), "{text}");
        assert_eq!(Cursor::decode(&text), Some(cursor));
        for bad in ["", "x", "not a cursor", &text[1..], &format!("{text}A"), &format!("{text}=")] {
            assert_eq!(Cursor::decode(bad), None, "{bad}");
        }
        use base64::Engine;
        let mut other_version = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(&text).unwrap();
        other_version[0] = 2;
        assert_eq!(Cursor::decode(&base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(other_version)), None);
    }
}
