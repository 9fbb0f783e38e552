//! The idempotency layer of the API. An endpoint opts in by taking [`Idempotent<T>`] instead of `StrictJson<T>`
//! and running its transaction through [`Idempotent::run`]; the rest (key parsing, fingerprint, claim, replay,
//! completion in the same transaction, metrics) happens here.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::AppState;
use super::error::ApiError;
use super::json::{parse_json, read_json_body};
use crate::auth::Principal;
use crate::idempotency::cache::{Cached, Kept};
use crate::idempotency::fingerprint::{RequestParts, canonical_request, normalize_path};
use crate::idempotency::{Claim, IdempotencyKey, Scope, StoredResponse, store};
use conveyor_jobs::WorkspaceTx;

/// The header that carries the key.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// Set to `true` on a replayed response.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// A hook run right after a key is claimed, inside the open transaction. Tests use it to hold the first of several
/// concurrent duplicates open; production has none.
pub type ClaimHook = Arc<dyn Fn() -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// The future of an idempotent endpoint's work inside its transaction.
pub type Work<'t> = Pin<Box<dyn Future<Output = Result<Reply, ApiError>> + Send + 't>>;

/// A successful answer of an idempotent endpoint: what is sent now and stored for replay.
pub struct Reply {
    status: StatusCode,
    headers: Vec<(String, String)>,
    body: serde_json::Value,
}

impl Reply {
    /// `202 Accepted` with `Location: /v1/operations/{operation_id}`.
    pub fn accepted(body: &impl Serialize, operation_id: uuid::Uuid) -> Self {
        Self {
            status: StatusCode::ACCEPTED,
            headers: vec![("location".into(), format!("/v1/operations/{operation_id}"))],
            body: serde_json::to_value(body).expect("response bodies serialize"),
        }
    }

    /// `201 Created` with `Location: {location}` (the new resource's path).
    pub fn created(body: &impl Serialize, location: String) -> Self {
        Self {
            status: StatusCode::CREATED,
            headers: vec![("location".into(), location)],
            body: serde_json::to_value(body).expect("response bodies serialize"),
        }
    }

    fn stored(&self) -> StoredResponse {
        let mut headers = self.headers.clone();
        headers.push(("content-type".into(), "application/json".into()));
        StoredResponse { status: self.status.as_u16(), headers, body: self.body.clone() }
    }
}

fn respond(stored: &StoredResponse, replayed: bool) -> Response {
    let status = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::OK);
    let mut response = (status, axum::Json(&stored.body)).into_response();
    let headers = response.headers_mut();
    stored_headers(headers, &stored.headers);
    if replayed {
        headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    }
    response
}

fn stored_headers(headers: &mut HeaderMap, stored: &[(String, String)]) {
    for (name, value) in stored {
        if let (Ok(name), Ok(value)) = (HeaderName::try_from(name.as_str()), HeaderValue::from_str(value)) {
            headers.insert(name, value);
        }
    }
}

/// A replay answered from a copy ([`crate::idempotency::cache`]): its body as serialized when the copy was made.
fn respond_with_copy(copy: &Kept) -> Response {
    let status = StatusCode::from_u16(copy.status).unwrap_or(StatusCode::OK);
    let mut response = (status, copy.body.clone()).into_response();
    let headers = response.headers_mut();
    headers.insert(axum::http::header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    stored_headers(headers, &copy.headers);
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    response
}

/// An idempotent write: the caller, its key, the canonical request and the parsed body.
pub struct Idempotent<T> {
    /// The caller.
    pub principal: Principal,
    /// The parsed body.
    pub body: T,
    /// The trace context of the jobs this request enqueues: the request span's own while traces are exported (a
    /// child of the incoming one, with the incoming `tracestate`), else the incoming one, or a new one.
    pub trace: conveyor_jobs::TraceContext,
    scope: Scope,
    canonical: String,
}

fn parse_key(headers: &HeaderMap) -> Result<IdempotencyKey, ApiError> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let first = values.next().ok_or(ApiError::IdempotencyKeyRequired)?;
    if values.next().is_some() {
        return Err(ApiError::IdempotencyKeyInvalid);
    }
    let raw = first.to_str().map_err(|_| ApiError::IdempotencyKeyInvalid)?;
    IdempotencyKey::parse(raw).map_err(|_| ApiError::IdempotencyKeyInvalid)
}

impl<T: DeserializeOwned + Send> FromRequest<AppState> for Idempotent<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, Self::Rejection> {
        let (mut parts, body) = req.into_parts();
        let principal = Principal::from_request_parts(&mut parts, state).await?;
        let key = parse_key(&parts.headers).inspect_err(|_| {
            state.server_metrics.idempotency_requests.with_label_values(&["rejected"]).inc();
        })?;
        let method = parts.method.as_str().to_ascii_uppercase();
        let path = parts.uri.path().to_owned();
        let query = parts.uri.query().map(str::to_owned);
        let headers = parts.headers.clone();
        let raw = read_json_body(Request::from_parts(parts, body), state).await?;
        let json: serde_json::Value = parse_json(&raw)?;
        let header_pairs: Vec<(&str, &str)> =
            headers.iter().filter_map(|(n, v)| v.to_str().ok().map(|v| (n.as_str(), v))).collect();
        let canonical = canonical_request(&RequestParts {
            method: &method,
            path: &path,
            query: query.as_deref(),
            content_type: headers.get("content-type").and_then(|v| v.to_str().ok()),
            headers: header_pairs,
            body: Some(&json),
        });
        let body: T = serde_json::from_value(json)
            .map_err(|e| parse_json::<T>(&raw).err().unwrap_or(ApiError::Validation(e.to_string())))?;
        let header = |name| headers.get(name).and_then(|v: &axum::http::HeaderValue| v.to_str().ok());
        let trace = conveyor_jobs::TraceContext::of_request(header("traceparent"), header("tracestate"));
        let scope = Scope {
            workspace_id: principal.workspace_id,
            user_id: principal.user_id,
            method,
            path: normalize_path(&path),
            key,
        };
        Ok(Self { principal, body, trace, scope, canonical })
    }
}

impl<T> Idempotent<T> {
    /// Runs `work` in one workspace transaction that also claims the key and, on success, completes its record
    /// with the reply; or answers a replay or a conflict without running it. An error rolls everything back. The
    /// replay of a record this process holds a copy of ([`crate::idempotency::cache`]) is answered from it, without
    /// PostgreSQL.
    pub async fn run<W>(self, state: &AppState, work: W) -> Result<Response, ApiError>
    where
        W: for<'t> FnOnce(&'t mut WorkspaceTx) -> Work<'t>,
    {
        let outcome = |label: &str| state.server_metrics.idempotency_requests.with_label_values(&[label]).inc();
        match state.replays.judge(&self.scope, &state.fingerprinter, &self.canonical) {
            Some(Cached::Replay(copy)) => {
                outcome("replayed");
                state.server_metrics.idempotency_replays_from_memory.inc();
                return Ok(respond_with_copy(&copy));
            }
            Some(Cached::Mismatch) => {
                outcome("key_reused");
                return Err(ApiError::IdempotencyKeyReused);
            }
            None => {}
        }
        // Before the transaction's start, so before its now(): a copy's expiry read on this clock is never later
        // than its record's.
        let started = Instant::now();
        let mut tx = conveyor_jobs::begin_workspace(&state.pool, self.scope.workspace_id).await?;
        let fingerprint =
            match store::claim_tx(&mut tx, &self.scope, &state.fingerprinter, &self.canonical, state.idempotency_ttl)
                .await?
            {
                Claim::Execute(fingerprint) => fingerprint,
                Claim::Replay(done) => {
                    outcome("replayed");
                    let response = respond(&done.response, true);
                    state.replays.remember(&self.scope, done.fingerprint, done.response, started + done.expires_in);
                    return Ok(response);
                }
                Claim::Mismatch => {
                    outcome("key_reused");
                    return Err(ApiError::IdempotencyKeyReused);
                }
                Claim::InProgress => {
                    outcome("in_progress");
                    return Err(ApiError::IdempotencyRequestInProgress);
                }
            };
        if let Some(hook) = &state.claim_hook {
            hook().await;
        }
        let reply = work(&mut tx).await?;
        let stored = reply.stored();
        store::complete_tx(&mut tx, &self.scope, &stored).await?;
        tx.commit().await?;
        // Crash point for tests: the API dies right after its commit, before answering.
        fail::fail_point!("api::after_commit");
        outcome("executed");
        let response = respond(&stored, false);
        state.replays.remember(&self.scope, fingerprint, stored.replayable(), started + state.idempotency_ttl);
        Ok(response)
    }
}
