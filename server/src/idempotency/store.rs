//! The `idempotency_requests` record inside the business transaction: claim, replay, complete.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::fingerprint::{Fingerprint, Fingerprinter};
use super::key::IdempotencyKey;
use conveyor_jobs::WorkspaceTx;
use conveyor_jobs::{UserId, WorkspaceId};

/// What a key is scoped to: the same key from another user, workspace, method or path is another request.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Scope {
    /// The caller's workspace.
    pub workspace_id: WorkspaceId,
    /// The caller.
    pub user_id: UserId,
    /// HTTP method, upper case.
    pub method: String,
    /// Normalized path.
    pub path: String,
    /// The key.
    pub key: IdempotencyKey,
}

impl Scope {
    /// A 64-bit advisory-lock key for this scope.
    fn lock_key(&self) -> String {
        format!(
            "conveyor-idempotency:{}:{}:{}:{}:{}",
            self.workspace_id, self.user_id, self.method, self.path, self.key.0
        )
    }
}

/// A response as stored for replay: status, allow-listed headers, body.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StoredResponse {
    /// HTTP status.
    pub status: u16,
    /// Allow-listed headers (`location`, `content-type`, `etag`).
    pub headers: Vec<(String, String)>,
    /// The body (secret-free by construction).
    pub body: serde_json::Value,
}

/// Headers kept for replay; anything else is dropped.
pub const REPLAYED_HEADERS: &[&str] = &["location", "content-type", "etag"];

fn replayed((name, _): &&(String, String)) -> bool {
    REPLAYED_HEADERS.contains(&name.as_str())
}

impl StoredResponse {
    /// The response as a replay sends it: its headers outside [`REPLAYED_HEADERS`] dropped.
    pub fn replayable(&self) -> StoredResponse {
        let headers = self.headers.iter().filter(replayed).cloned().collect();
        StoredResponse { status: self.status, headers, body: self.body.clone() }
    }
}

/// A completed record that answers a request: the fingerprint it was made with, its response, and how long it
/// lives from the reading transaction's start.
#[derive(Debug)]
pub struct Completed {
    /// The fingerprint of the request that completed it.
    pub fingerprint: Fingerprint,
    /// What a replay answers.
    pub response: StoredResponse,
    /// Until its `expires_at`, from the reading transaction's `now()`.
    pub expires_in: Duration,
}

/// The outcome of claiming a key.
#[derive(Debug)]
pub enum Claim {
    /// First use (or an expired record): execute, then [`complete_tx`]. The record holds this fingerprint.
    Execute(Fingerprint),
    /// Completed before with the same request: answer its response, execute nothing.
    Replay(Completed),
    /// Used before with a different request.
    Mismatch,
    /// Another transaction holds the key right now.
    InProgress,
}

#[derive(sqlx::FromRow)]
struct Record {
    request_fingerprint: Vec<u8>,
    fingerprint_key_id: String,
    status: String,
    response_status: Option<i16>,
    response_headers: Option<serde_json::Value>,
    response_body: Option<serde_json::Value>,
    expires_in_ms: i64,
}

async fn live_record(tx: &mut WorkspaceTx, scope: &Scope) -> Result<Option<Record>, sqlx::Error> {
    sqlx::query_as::<_, Record>(
        "SELECT request_fingerprint, fingerprint_key_id, status, response_status, response_headers, response_body,
                floor(extract(epoch FROM expires_at - now()) * 1000)::int8 AS expires_in_ms
         FROM conveyor_server.idempotency_requests
         WHERE workspace_id = $1 AND user_id = $2 AND http_method = $3 AND request_path = $4 AND idempotency_key = $5
           AND expires_at > now()",
    )
    .bind(scope.workspace_id.0)
    .bind(scope.user_id.0)
    .bind(&scope.method)
    .bind(&scope.path)
    .bind(scope.key.0)
    .fetch_optional(&mut **tx)
    .await
}

fn judge(record: Record, fingerprinter: &Fingerprinter, canonical: &str) -> Claim {
    let stored = Fingerprint { key_id: record.fingerprint_key_id, mac: record.request_fingerprint };
    if !fingerprinter.matches(&stored, canonical) {
        return Claim::Mismatch;
    }
    match (record.status.as_str(), record.response_status) {
        ("completed", Some(status)) => Claim::Replay(Completed {
            fingerprint: stored,
            response: StoredResponse {
                status: status as u16,
                headers: record.response_headers.and_then(|h| serde_json::from_value(h).ok()).unwrap_or_default(),
                body: record.response_body.unwrap_or(serde_json::Value::Null),
            },
            expires_in: Duration::from_millis(record.expires_in_ms.max(0) as u64),
        }),
        _ => Claim::InProgress,
    }
}

/// Claims `scope` for this transaction, or says why not. On [`Claim::Execute`] the record is written
/// `in_progress` (visible to no one else until commit) and the transaction holds the scope's advisory lock, so a
/// concurrent duplicate answers [`Claim::InProgress`] at once instead of waiting on this transaction.
pub async fn claim_tx(
    tx: &mut WorkspaceTx,
    scope: &Scope,
    fingerprinter: &Fingerprinter,
    canonical: &str,
    ttl: Duration,
) -> Result<Claim, sqlx::Error> {
    // A committed record decides alone; a mismatch is reported before "in progress".
    if let Some(record) = live_record(tx, scope).await? {
        return Ok(judge(record, fingerprinter, canonical));
    }
    let (locked,): (bool,) = sqlx::query_as("SELECT pg_try_advisory_xact_lock(hashtextextended($1, 0))")
        .bind(scope.lock_key())
        .fetch_one(&mut **tx)
        .await?;
    if !locked {
        return Ok(Claim::InProgress);
    }
    // Holding the lock: a duplicate may have committed between the first look and the lock.
    if let Some(record) = live_record(tx, scope).await? {
        return Ok(judge(record, fingerprinter, canonical));
    }
    let fingerprint = fingerprinter.sign(canonical);
    // An expired record of the same scope is treated as absent: replaced by this one.
    let inserted = sqlx::query(
        "INSERT INTO conveyor_server.idempotency_requests
             (workspace_id, user_id, http_method, request_path, idempotency_key, request_fingerprint,
              fingerprint_key_id, expires_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7, now() + make_interval(secs => $8))
         ON CONFLICT (workspace_id, user_id, http_method, request_path, idempotency_key) DO UPDATE
             SET request_fingerprint = EXCLUDED.request_fingerprint, fingerprint_key_id = EXCLUDED.fingerprint_key_id,
                 status = 'in_progress', response_status = NULL, response_headers = NULL, response_body = NULL,
                 created_at = now(), completed_at = NULL, expires_at = EXCLUDED.expires_at
             WHERE idempotency_requests.expires_at <= now()",
    )
    .bind(scope.workspace_id.0)
    .bind(scope.user_id.0)
    .bind(&scope.method)
    .bind(&scope.path)
    .bind(scope.key.0)
    .bind(&fingerprint.mac)
    .bind(&fingerprint.key_id)
    .bind(ttl.as_secs_f64())
    .execute(&mut **tx)
    .await?;
    Ok(if inserted.rows_affected() == 1 { Claim::Execute(fingerprint) } else { Claim::InProgress })
}

/// Completes the claimed record with the response, in the same transaction as the work.
pub async fn complete_tx(tx: &mut WorkspaceTx, scope: &Scope, response: &StoredResponse) -> Result<(), sqlx::Error> {
    let headers: Vec<&(String, String)> = response.headers.iter().filter(replayed).collect();
    let updated = sqlx::query(
        "UPDATE conveyor_server.idempotency_requests
         SET status = 'completed', response_status = $6, response_headers = $7, response_body = $8, completed_at = now()
         WHERE workspace_id = $1 AND user_id = $2 AND http_method = $3 AND request_path = $4 AND idempotency_key = $5
           AND status = 'in_progress'",
    )
    .bind(scope.workspace_id.0)
    .bind(scope.user_id.0)
    .bind(&scope.method)
    .bind(&scope.path)
    .bind(scope.key.0)
    .bind(response.status as i16)
    .bind(serde_json::to_value(headers).expect("headers serialize"))
    .bind(&response.body)
    .execute(&mut **tx)
    .await?;
    if updated.rows_affected() != 1 {
        return Err(sqlx::Error::RowNotFound);
    }
    Ok(())
}
