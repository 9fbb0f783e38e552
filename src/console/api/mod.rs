//! The console's JSON API: the HTTP face of [`crate::Admin`].
//!
//! ```text
//! GET    /queues, /queues/{name}                       counts by state, lag, throughput, oldest age, paused
//! GET    /consumers                                    each queue's consumers: entries held, idle time
//! GET    /jobs?queue&kind&status&workspace&since&until&before&limit, /jobs/{id}
//! POST   /jobs/{id}/cancel, /jobs/{id}/retry
//! POST   /jobs/{id}/change   body: priority, run_at | delay_ms | run_now, payload (a waiting job's; 409 once handed out)
//! POST   /queues/{name}/drain   body: kind, workspace | "all": true        cancels the queue's waiting jobs
//! POST   /queues/{name}/clean   body: status, workspace, kind, older_than_seconds, keep_last   deletes ended jobs
//! POST   /queues/{name}/obliterate   body: workspace, force   empties a workspace's queue (409 QUEUE_RUNNING)
//! GET    /operations?kind&status&workspace&since&until&before&limit
//! GET    /dead-letters?queue&kind&workspace&since&until&before&limit
//! POST   /dead-letters/{id}/replay      DELETE /dead-letters/{id}
//! POST   /dead-letters/replay, /dead-letters/discard   body: a filter (queue, kind, workspace, since, until, limit)
//!                                                      with at least one of its fields, or "all": true
//! GET    /pauses   POST /pauses (scope + reason)   DELETE /pauses (scope in the body or the query)
//! GET    /global-limits   PUT /global-limits/{queue|kind}/{name}   body: max_in_flight, max_per_interval + interval_ms
//!                         DELETE /global-limits/{queue|kind}/{name}
//! GET    /fairness?workspace   each workspace's weight, jobs in flight and share; key limits and blocks; kind limits
//! PUT    /workspaces/{id}/weight   body: weight
//! PUT    /workspaces/{id}/key-limits/{key}   body: max_in_flight, max_per_interval + interval_ms     DELETE the same
//! PUT    /workspaces/{id}/kind-limits/{kind}   body: max_in_flight                                 DELETE the same
//! GET    /schedules?workspace   POST /schedules/{workspace}/{name}/pause|resume
//! GET    /workspaces/{id}/events?event&kind&queue&job&since&after&limit   a workspace's job events recorded so far
//! GET    /workspaces/{id}/events?follow=true&event&kind&queue&job&since   the same, followed (Server-Sent Events)
//! GET    /audit?limit
//! ```
//!
//! Every call needs an [`Operator`] (401 with `WWW-Authenticate: Bearer` without one); a change by an operator with
//! a CSRF token must carry it in [`super::CSRF_HEADER`] (403 `CSRF_TOKEN_INVALID`). Without an operator role the
//! console answers 503 `ADMIN_NOT_CONFIGURED`. Every call, reads included, leaves a row in the audit trail; a change
//! leaves its intent there before it runs (503 `SERVICE_UNAVAILABLE`, and nothing changes, when that cannot be
//! written), then its outcome. Errors are problem+json: 400 names the parameter, 404 an unknown id, 409 a state that
//! refuses the change.

mod params;
mod problem;

use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{FromRequestParts, Path, Query};
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post, put};
use chrono::{DateTime, Utc};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use uuid::Uuid;

use self::params::Params;
use self::problem::ApiError;
use super::{CSRF_HEADER, Operator, Settings};
use crate::{Actor, Admin, GlobalLimit, GlobalScope, PauseScope};
use crate::{DeadLetterFilter, JobAction, JobFilter, OperationFilter, Replay};
use crate::{EventFilter, JobEventType, JobId, WorkspaceId};
use axum::response::sse::{Event, Sse};

type State = Arc<Settings>;

/// The API's routes.
pub(super) fn router<S: Clone + Send + Sync + 'static>(settings: State) -> Router<S> {
    Router::new()
        .route("/queues", get(queues))
        .route("/queues/{name}", get(queue))
        .route("/queues/{name}/minutes", get(queue_minutes))
        .route("/consumers", get(consumers))
        .route("/queues/{name}/drain", post(drain))
        .route("/queues/{name}/clean", post(clean))
        .route("/queues/{name}/obliterate", post(obliterate))
        .route("/jobs", get(jobs))
        .route("/jobs/{id}", get(job))
        .route("/jobs/{id}/cancel", post(cancel_job))
        .route("/jobs/{id}/retry", post(retry_job))
        .route("/jobs/{id}/change", post(change_job))
        .route("/operations", get(operations))
        .route("/dead-letters", get(dead_letters))
        .route("/dead-letters/replay", post(replay_dead_letters))
        .route("/dead-letters/discard", post(discard_dead_letters))
        .route("/dead-letters/{id}", delete(discard_dead_letter))
        .route("/dead-letters/{id}/replay", post(replay_dead_letter))
        .route("/pauses", get(pauses).post(pause).delete(resume))
        .route("/global-limits", get(global_limits))
        .route("/global-limits/{scope}/{name}", put(set_global_limit).delete(remove_global_limit))
        .route("/fairness", get(fairness))
        .route("/workspaces/{workspace}/weight", put(set_weight))
        .route("/workspaces/{workspace}/key-limits/{key}", put(set_key_limit).delete(remove_key_limit))
        .route("/workspaces/{workspace}/kind-limits/{kind}", put(set_kind_limit).delete(remove_kind_limit))
        .route("/schedules", get(schedules))
        .route("/schedules/{workspace}/{name}/pause", post(pause_schedule))
        .route("/schedules/{workspace}/{name}/resume", post(resume_schedule))
        .route("/workspaces/{workspace}/events", get(job_events))
        .route("/audit", get(audit))
        .fallback(|| async { ApiError::NotFound("route") })
        .with_state(settings)
}

/// The operator of a call and the operator module to act with: 401 before anything else (and 403 for a change
/// without the operator's CSRF token), then 503 `ADMIN_NOT_CONFIGURED` when the host has no operator role.
struct Operating {
    actor: Actor,
    admin: Admin,
}

impl FromRequestParts<State> for Operating {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, settings: &State) -> Result<Self, ApiError> {
        let operator = parts.extensions.get::<Operator>().ok_or(ApiError::Unauthenticated)?;
        if !parts.method.is_safe() {
            // Whatever the credential, a change a browser sends from another site is refused (scripts send no Origin).
            let authority = parts.uri.authority().map(|a| a.as_str());
            if let Err(why) = super::same_origin(&parts.headers, authority) {
                return Err(ApiError::CrossSite(why));
            }
            let token = parts.headers.get(CSRF_HEADER).and_then(|v| v.to_str().ok());
            if !operator.csrf_allows(token) {
                return Err(ApiError::CsrfRejected);
            }
        }
        let admin = settings.admin.clone().ok_or_else(|| ApiError::NotConfigured(settings.unavailable.clone()))?;
        Ok(Self { actor: operator.actor.clone(), admin })
    }
}

type Answer = Result<Response, ApiError>;
type RawQuery = Result<Query<Vec<(String, String)>>, QueryRejection>;

fn params(query: RawQuery, allowed: &[&'static str]) -> Result<Params, ApiError> {
    let Query(pairs) = query.map_err(|e| ApiError::Invalid(format!("the query string: {}", e.body_text())))?;
    Params::new(pairs, allowed)
}

fn id(raw: &str, parameter: &'static str) -> Result<Uuid, ApiError> {
    raw.parse().map_err(|_| ApiError::BadParameter { parameter, detail: format!("`{raw}` is not a UUID") })
}

/// The JSON object of a request body, of the shape `T` (unknown fields refused).
fn body<T: DeserializeOwned>(bytes: &Bytes) -> Result<T, ApiError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::BadBody("must be a JSON object ({} for none of its fields)".to_owned()));
    }
    serde_json::from_slice(bytes).map_err(|e| ApiError::BadBody(format!("is not what this endpoint takes: {e}")))
}

fn ok(value: impl serde::Serialize) -> Answer {
    Ok(Json(value).into_response())
}

fn items(items: impl serde::Serialize) -> Answer {
    ok(json!({ "items": items }))
}

async fn queues(op: Operating) -> Answer {
    items(op.admin.queues(&op.actor).await?)
}

async fn consumers(op: Operating) -> Answer {
    items(op.admin.consumers(&op.actor).await?)
}

async fn queue(op: Operating, Path(name): Path<String>) -> Answer {
    match op.admin.queue(&op.actor, &name).await? {
        Some(queue) => ok(queue),
        None => Err(ApiError::NotFound("queue")),
    }
}

async fn queue_minutes(op: Operating, Path(name): Path<String>) -> Answer {
    let minutes = op.admin.queue_minutes(&op.actor, &name).await?;
    // An hour with nothing recorded is a queue of no job and no kind, unless the queues know it: a typo is a 404.
    let recorded = |m: &crate::QueueMinute| m.done + m.failed + m.expired > 0 || m.backlog.is_some();
    if !minutes.iter().any(recorded) && op.admin.queue(&op.actor, &name).await?.is_none() {
        return Err(ApiError::NotFound("queue"));
    }
    ok(minutes)
}

async fn jobs(op: Operating, query: RawQuery) -> Answer {
    let p = params(query, &["queue", "kind", "status", "workspace", "since", "until", "before", "limit"])?;
    let filter = JobFilter {
        queue: p.text("queue"),
        kind: p.text("kind"),
        status: p.status("status")?,
        workspace: p.uuid("workspace")?,
        since: p.time("since")?,
        until: p.time("until")?,
        before: p.uuid("before")?,
        limit: p.limit("limit")?,
    };
    ok(op.admin.jobs(&op.actor, &filter).await?)
}

async fn job(op: Operating, Path(raw): Path<String>) -> Answer {
    match op.admin.job(&op.actor, JobId(id(&raw, "id")?)).await? {
        Some(job) => ok(job),
        None => Err(ApiError::NotFound("job")),
    }
}

/// The answer to a cancel or retry.
fn job_action(id: Uuid, action: JobAction, done: &'static str, refused: &'static str) -> Answer {
    match action {
        JobAction::Done => ok(json!({ "id": id, "outcome": done })),
        JobAction::NotFound => Err(ApiError::NotFound("job")),
        JobAction::NotAllowed => Err(ApiError::Conflict {
            code: match done {
                "canceled" => "JOB_FINISHED",
                "changed" => "JOB_NOT_WAITING",
                _ => "JOB_NOT_RETRYABLE",
            },
            detail: format!("job {id} {refused}"),
            named: None,
        }),
        JobAction::KeyHeld(live) => Err(key_held(id, live)),
        JobAction::Held(why) => {
            Err(ApiError::Conflict { code: "JOB_HELD", detail: format!("job {id} is not run now: {why}"), named: None })
        }
    }
}

fn key_held(id: Uuid, live: Uuid) -> ApiError {
    ApiError::Conflict {
        code: "DEDUP_KEY_HELD",
        detail: format!("job {id} is not run again: live job {live} holds its de-duplication key"),
        named: Some(("live_job_id", json!(live))),
    }
}

async fn cancel_job(op: Operating, Path(raw): Path<String>) -> Answer {
    let id = id(&raw, "id")?;
    let action = op.admin.cancel_job(&op.actor, JobId(id)).await?;
    job_action(id, action, "canceled", "has already ended")
}

async fn retry_job(op: Operating, Path(raw): Path<String>) -> Answer {
    let id = id(&raw, "id")?;
    let action = op.admin.retry_job(&op.actor, JobId(id)).await?;
    job_action(id, action, "retried", "is neither failed, delayed nor waiting for a retry")
}

/// A change of a waiting job: at least one field; at most one of `run_at`, `delay_ms` and `run_now`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ChangeBody {
    priority: Option<crate::Priority>,
    run_at: Option<DateTime<Utc>>,
    delay_ms: Option<u64>,
    #[serde(default)]
    run_now: bool,
    payload: Option<Value>,
}

async fn change_job(op: Operating, Path(raw): Path<String>, bytes: Bytes) -> Answer {
    let id = id(&raw, "id")?;
    let body: ChangeBody = body(&bytes)?;
    let mut change = crate::JobChange::new();
    match (body.run_at, body.delay_ms, body.run_now) {
        (None, None, false) => {}
        (Some(at), None, false) => change = change.run_at(at),
        (None, Some(ms), false) => change = change.delay(std::time::Duration::from_millis(ms)),
        (None, None, true) => change = change.run_now(),
        _ => return Err(ApiError::BadBody("sets at most one of run_at, delay_ms and run_now".into())),
    }
    if let Some(priority) = body.priority {
        change = change.priority(priority);
    }
    if let Some(payload) = body.payload {
        change = change.json_payload(payload);
    }
    let action = op.admin.change_job(&op.actor, JobId(id), &change).await?;
    job_action(id, action, "changed", "no longer waits: it was handed to a worker or it ended")
}

/// A drain of a queue: of one kind too when set; in one workspace, or in every one with `"all": true`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DrainBody {
    kind: Option<String>,
    workspace: Option<Uuid>,
    #[serde(default)]
    all: bool,
}

async fn drain(op: Operating, Path(queue): Path<String>, bytes: Bytes) -> Answer {
    let body: DrainBody = body(&bytes)?;
    let filter = crate::DrainFilter { queue: Some(queue), kind: body.kind, workspace: body.workspace, all: body.all };
    ok(op.admin.drain(&op.actor, &filter).await?)
}

/// A clean of one workspace's ended jobs of a queue.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CleanBody {
    status: crate::JobStatus,
    workspace: Uuid,
    kind: Option<String>,
    older_than_seconds: Option<u64>,
    keep_last: Option<u32>,
}

async fn clean(op: Operating, Path(queue): Path<String>, bytes: Bytes) -> Answer {
    let body: CleanBody = body(&bytes)?;
    let filter = crate::CleanFilter {
        status: body.status,
        workspace: body.workspace,
        queue: Some(queue),
        kind: body.kind,
        older_than_seconds: body.older_than_seconds,
        keep_last: body.keep_last,
    };
    let deleted = op.admin.clean(&op.actor, &filter).await?;
    ok(json!({ "deleted": deleted }))
}

async fn obliterate(op: Operating, Path(queue): Path<String>, bytes: Bytes) -> Answer {
    let filter: crate::ObliterateFilter = body(&bytes)?;
    match op.admin.obliterate(&op.actor, &queue, &filter).await? {
        done @ crate::Obliteration::Done(_) => ok(done),
        crate::Obliteration::Running { running } => Err(ApiError::Conflict {
            code: "QUEUE_RUNNING",
            detail: format!("{running} jobs of queue {queue} run; obliterate with \"force\": true to cancel them too"),
            named: Some(("running", json!(running))),
        }),
    }
}

async fn operations(op: Operating, query: RawQuery) -> Answer {
    let p = params(query, &["kind", "status", "workspace", "since", "until", "before", "limit"])?;
    let filter = OperationFilter {
        kind: p.text("kind"),
        status: p.text("status"),
        workspace: p.uuid("workspace")?,
        since: p.time("since")?,
        until: p.time("until")?,
        before: p.uuid("before")?,
        limit: p.limit("limit")?,
    };
    ok(op.admin.operations(&op.actor, &filter).await?)
}

async fn dead_letters(op: Operating, query: RawQuery) -> Answer {
    let p = params(query, &["queue", "kind", "workspace", "since", "until", "before", "limit"])?;
    let filter = DeadLetterFilter {
        queue: p.text("queue"),
        kind: p.text("kind"),
        workspace: p.uuid("workspace")?,
        since: p.time("since")?,
        until: p.time("until")?,
        before: p.uuid("before")?,
        limit: p.limit("limit")?,
        all: false,
    };
    ok(op.admin.dead_letters(&op.actor, &filter).await?)
}

async fn replay_dead_letter(op: Operating, Path(raw): Path<String>) -> Answer {
    let id = id(&raw, "id")?;
    match op.admin.replay_dead_letter(&op.actor, JobId(id)).await? {
        Replay::Replayed => ok(json!({ "id": id, "outcome": "replayed" })),
        Replay::NotDeadLetter => Err(ApiError::NotFound("dead letter")),
        Replay::KeyHeld(live) => Err(key_held(id, live)),
    }
}

async fn discard_dead_letter(op: Operating, Path(raw): Path<String>) -> Answer {
    let id = id(&raw, "id")?;
    if op.admin.discard_dead_letter(&op.actor, JobId(id)).await? {
        Ok(StatusCode::NO_CONTENT.into_response())
    } else {
        Err(ApiError::NotFound("dead letter"))
    }
}

/// The filter of a bulk replay or discard: at least one field, or `"all": true` (checked by the operator module).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BulkFilter {
    queue: Option<String>,
    kind: Option<String>,
    workspace: Option<Uuid>,
    since: Option<DateTime<Utc>>,
    until: Option<DateTime<Utc>>,
    limit: Option<u32>,
    #[serde(default)]
    all: bool,
}

impl From<BulkFilter> for DeadLetterFilter {
    fn from(f: BulkFilter) -> Self {
        Self {
            queue: f.queue,
            kind: f.kind,
            workspace: f.workspace,
            since: f.since,
            until: f.until,
            before: None,
            limit: f.limit,
            all: f.all,
        }
    }
}

async fn replay_dead_letters(op: Operating, bytes: Bytes) -> Answer {
    let filter: DeadLetterFilter = body::<BulkFilter>(&bytes)?.into();
    ok(op.admin.replay_dead_letters(&op.actor, &filter).await?)
}

async fn discard_dead_letters(op: Operating, bytes: Bytes) -> Answer {
    let filter: DeadLetterFilter = body::<BulkFilter>(&bytes)?.into();
    ok(op.admin.discard_dead_letters(&op.actor, &filter).await?)
}

async fn pauses(op: Operating) -> Answer {
    items(op.admin.pauses(&op.actor).await?)
}

/// A pause's scope, and its reason when one is set.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PauseBody {
    queue: Option<String>,
    kind: Option<String>,
    workspace: Option<Uuid>,
    reason: Option<String>,
}

impl PauseBody {
    fn scope(&self) -> PauseScope {
        PauseScope { queue: self.queue.clone(), kind: self.kind.clone(), workspace: self.workspace.map(WorkspaceId) }
    }
}

async fn pause(op: Operating, bytes: Bytes) -> Answer {
    let pause: PauseBody = body(&bytes)?;
    let scope = pause.scope();
    let created = op.admin.pause(&op.actor, &scope, pause.reason.as_deref()).await?;
    let status = if created { StatusCode::CREATED } else { StatusCode::OK };
    Ok((status, Json(json!({ "scope": scope, "created": created }))).into_response())
}

async fn resume(op: Operating, query: RawQuery, bytes: Bytes) -> Answer {
    let p = params(query, &["queue", "kind", "workspace"])?;
    let from_query =
        PauseBody { queue: p.text("queue"), kind: p.text("kind"), workspace: p.uuid("workspace")?, reason: None };
    let given = from_query.queue.is_some() || from_query.kind.is_some() || from_query.workspace.is_some();
    let scope = match (given, bytes.iter().all(u8::is_ascii_whitespace)) {
        (true, true) => from_query.scope(),
        (false, false) => {
            let body: PauseBody = body(&bytes)?;
            if body.reason.is_some() {
                return Err(ApiError::BadBody("names a scope only (queue, kind, workspace), not a reason".into()));
            }
            body.scope()
        }
        (true, false) => return Err(ApiError::BadBody("and the query both name a scope: give one".to_owned())),
        (false, true) => {
            return Err(ApiError::Invalid(
                "name the pause's scope (queue, kind, workspace) in the query or a JSON body".to_owned(),
            ));
        }
    };
    if op.admin.resume(&op.actor, &scope).await? {
        Ok(StatusCode::NO_CONTENT.into_response())
    } else {
        Err(ApiError::NotFound("pause of exactly that scope"))
    }
}

async fn global_limits(op: Operating) -> Answer {
    items(op.admin.global_limits(&op.actor).await?)
}

/// A global limit: a concurrency, a rate (a count and its interval), or both.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GlobalLimitBody {
    max_in_flight: Option<u32>,
    max_per_interval: Option<u32>,
    interval_ms: Option<u64>,
}

/// A concurrency and a rate from a body, the rate's count and interval together or neither.
fn rate(limit: GlobalLimitBody) -> Result<GlobalLimit, ApiError> {
    let max_per_interval = match (limit.max_per_interval, limit.interval_ms) {
        (Some(n), Some(ms)) => Some((n, std::time::Duration::from_millis(ms))),
        (None, None) => None,
        _ => return Err(ApiError::BadBody("gives max_per_interval and interval_ms together, or neither".into())),
    };
    Ok(GlobalLimit { max_in_flight: limit.max_in_flight, max_per_interval })
}

fn global_scope(scope: &str, name: &str) -> Result<GlobalScope, ApiError> {
    GlobalScope::parse(scope, name)
        .map_err(|e| ApiError::BadParameter { parameter: "scope", detail: format!("`{scope}/{name}`: {e}") })
}

async fn set_global_limit(op: Operating, Path((scope, name)): Path<(String, String)>, bytes: Bytes) -> Answer {
    let scope = global_scope(&scope, &name)?;
    let limit = rate(body::<GlobalLimitBody>(&bytes)?)?;
    op.admin.set_global_limit(&op.actor, &scope, limit).await?;
    ok(json!({ "scope": scope.scope(), "name": scope.name(), "max_in_flight": limit.max_in_flight,
               "max_per_interval": limit.max_per_interval.map(|(n, _)| n),
               "interval_ms": limit.max_per_interval.map(|(_, i)| i.as_millis() as u64) }))
}

async fn remove_global_limit(op: Operating, Path((scope, name)): Path<(String, String)>) -> Answer {
    let scope = global_scope(&scope, &name)?;
    if op.admin.remove_global_limit(&op.actor, &scope).await? {
        Ok(StatusCode::NO_CONTENT.into_response())
    } else {
        Err(ApiError::NotFound("global limit"))
    }
}

async fn fairness(op: Operating, query: RawQuery) -> Answer {
    let p = params(query, &["workspace"])?;
    let workspace = p.uuid("workspace")?.map(WorkspaceId);
    let workspaces = op.admin.workspace_shares(&op.actor).await?;
    let key_limits = op.admin.key_limits(&op.actor, workspace).await?;
    let kind_limits = op.admin.kind_limits(&op.actor, workspace).await?;
    ok(json!({ "workspaces": workspaces, "key_limits": key_limits, "kind_limits": kind_limits }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WeightBody {
    weight: u32,
}

async fn set_weight(op: Operating, Path(workspace): Path<String>, bytes: Bytes) -> Answer {
    let workspace = WorkspaceId(id(&workspace, "workspace")?);
    let WeightBody { weight } = body(&bytes)?;
    op.admin.set_workspace_weight(&op.actor, workspace, weight).await?;
    ok(json!({ "workspace_id": workspace.0, "weight": weight }))
}

async fn set_key_limit(op: Operating, Path((workspace, key)): Path<(String, String)>, bytes: Bytes) -> Answer {
    let workspace = WorkspaceId(id(&workspace, "workspace")?);
    let limit: GlobalLimitBody = body(&bytes)?;
    let limit = rate(limit)?;
    let key_limit = crate::KeyLimit { max_in_flight: limit.max_in_flight, max_per_interval: limit.max_per_interval };
    if key_limit == crate::KeyLimit::default() {
        return Err(ApiError::BadBody("gives max_in_flight, max_per_interval with interval_ms, or both".into()));
    }
    op.admin.set_key_limit(&op.actor, workspace, &key, key_limit).await?;
    ok(json!({ "workspace_id": workspace.0, "key": key }))
}

async fn remove_key_limit(op: Operating, Path((workspace, key)): Path<(String, String)>) -> Answer {
    let workspace = WorkspaceId(id(&workspace, "workspace")?);
    if op.admin.remove_key_limit(&op.actor, workspace, &key).await? {
        Ok(StatusCode::NO_CONTENT.into_response())
    } else {
        Err(ApiError::NotFound("key limit"))
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KindLimitBody {
    max_in_flight: u32,
}

async fn set_kind_limit(op: Operating, Path((workspace, kind)): Path<(String, String)>, bytes: Bytes) -> Answer {
    let workspace = WorkspaceId(id(&workspace, "workspace")?);
    let KindLimitBody { max_in_flight } = body(&bytes)?;
    op.admin.set_kind_limit(&op.actor, workspace, &kind, max_in_flight).await?;
    ok(json!({ "workspace_id": workspace.0, "kind": kind, "max_in_flight": max_in_flight }))
}

async fn remove_kind_limit(op: Operating, Path((workspace, kind)): Path<(String, String)>) -> Answer {
    let workspace = WorkspaceId(id(&workspace, "workspace")?);
    if op.admin.remove_kind_limit(&op.actor, workspace, &kind).await? {
        Ok(StatusCode::NO_CONTENT.into_response())
    } else {
        Err(ApiError::NotFound("kind limit"))
    }
}

async fn schedules(op: Operating, query: RawQuery) -> Answer {
    let p = params(query, &["workspace"])?;
    let schedules = op.admin.schedules(&op.actor, p.uuid("workspace")?.map(WorkspaceId)).await?;
    let listed: Vec<Value> = schedules
        .into_iter()
        .map(|(workspace, schedule)| {
            let mut value = serde_json::to_value(schedule).unwrap_or_default();
            value["workspace_id"] = json!(workspace);
            value
        })
        .collect();
    items(listed)
}

async fn set_schedule_paused(op: Operating, workspace: &str, name: &str, paused: bool) -> Answer {
    let workspace = WorkspaceId(id(workspace, "workspace")?);
    if op.admin.set_schedule_paused(&op.actor, workspace, name, paused).await? {
        ok(json!({ "workspace_id": workspace.0, "name": name, "paused": paused }))
    } else {
        Err(ApiError::NotFound("schedule"))
    }
}

async fn pause_schedule(op: Operating, Path((workspace, name)): Path<(String, String)>) -> Answer {
    set_schedule_paused(op, &workspace, &name, true).await
}

async fn resume_schedule(op: Operating, Path((workspace, name)): Path<(String, String)>) -> Answer {
    set_schedule_paused(op, &workspace, &name, false).await
}

/// The filter of an events call: `event` (names, comma-separated), `kind`, `queue`, `job`, and from when: `resumed`
/// (a reconnecting client's `Last-Event-ID`) before `since`.
fn event_filter(p: &Params, resumed: Option<DateTime<Utc>>) -> Result<EventFilter, ApiError> {
    let mut filter = EventFilter::all();
    if let Some(names) = p.text("event") {
        let events = names
            .split(',')
            .map(|name| {
                JobEventType::from_name(name.trim()).ok_or_else(|| ApiError::BadParameter {
                    parameter: "event",
                    detail: format!(
                        "`{name}` is not an event (one of {})",
                        JobEventType::ALL.map(JobEventType::as_str).join(", ")
                    ),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        filter = filter.events(events);
    }
    if let Some(kind) = p.text("kind") {
        filter = filter.kind(kind);
    }
    if let Some(queue) = p.text("queue") {
        filter = filter.queue(queue);
    }
    if let Some(job) = p.uuid("job")? {
        filter = filter.job(JobId(job));
    }
    let since = p.time("since")?;
    if let Some(from) = resumed.or(since) {
        filter = filter.since(from);
    }
    Ok(filter)
}

/// Follows at once, at most, per console: each holds a PostgreSQL connection of the host's application pool.
pub(super) const FOLLOWERS: usize = 4;

/// How long a followed stream may stay silent: a comment then keeps proxies from closing it.
const KEEP_ALIVE: std::time::Duration = std::time::Duration::from_secs(15);

/// How long a followed stream lasts: then it ends, and a client that reconnects is authenticated (and audited) again.
const FOLLOW_FOR: std::time::Duration = std::time::Duration::from_secs(3600);

async fn job_events(
    op: Operating,
    axum::extract::State(settings): axum::extract::State<State>,
    Path(raw): Path<String>,
    headers: axum::http::HeaderMap,
    query: RawQuery,
) -> Answer {
    let workspace = WorkspaceId(id(&raw, "workspace")?);
    let p = params(query, &["event", "kind", "queue", "job", "since", "after", "limit", "follow"])?;
    let follow = match p.text("follow").as_deref() {
        None | Some("false") => false,
        Some("true") => true,
        Some(other) => {
            let detail = format!("`{other}` is neither true nor false");
            return Err(ApiError::BadParameter { parameter: "follow", detail });
        }
    };
    if !follow {
        let filter = event_filter(&p, None)?;
        let after = p
            .text("after")
            .map(|raw| raw.parse().map_err(|detail| ApiError::BadParameter { parameter: "after", detail }))
            .transpose()?;
        let limit = p.limit("limit")?.unwrap_or(100);
        let (events, next) = op.admin.job_events(&op.actor, workspace, &filter, after, limit).await?;
        return ok(json!({ "items": events, "next": next.map(|c| c.to_string()) }));
    }
    for unfit in ["limit", "after"] {
        if p.text(unfit).is_some() {
            let detail = "a followed stream takes `since` (or `Last-Event-ID`) instead".to_owned();
            return Err(ApiError::BadParameter { parameter: unfit, detail });
        }
    }
    // A reconnecting client (an `EventSource`, to the same address) resumes from the last event it had, even where
    // the address says `since`.
    let resumed = match headers.get("last-event-id") {
        None => None,
        Some(value) => Some(
            value
                .to_str()
                .ok()
                .and_then(|id| DateTime::parse_from_rfc3339(id).ok())
                .map(|t| t.with_timezone(&Utc))
                .ok_or_else(|| ApiError::BadParameter {
                    parameter: "Last-Event-ID",
                    detail: "not an event's id (its time, RFC 3339)".into(),
                })?,
        ),
    };
    let filter = event_filter(&p, resumed)?;
    let permit = settings.followers.clone().try_acquire_owned().map_err(|_| ApiError::Busy(FOLLOWERS))?;
    let events = op.admin.follow_job_events(&op.actor, workspace, filter).await?;
    let (ending, until) = (settings.streams.clone(), tokio::time::Instant::now() + FOLLOW_FOR);
    // Each event as `event: <name>`, `id: <its time>` (a client that reconnects sends it back as `Last-Event-ID`, and
    // hears again from there: at least once) and `data: <the event as JSON>`. A failure ends the stream with an
    // `error` event, and so do the host's shutdown and the stream's hour; the client reconnects.
    let stream = futures_util::stream::unfold(Some((events, permit)), move |state| {
        let ending = ending.clone();
        async move {
            let (mut events, permit) = state?;
            let end = |why: String| Some((Ok(Event::default().event("end").data(why)), None));
            let sent = tokio::select! {
                _ = ending.cancelled() => return end("the server is shutting down: reconnect".into()),
                _ = tokio::time::sleep_until(until) => return end("the stream's hour is over: reconnect".into()),
                next = tokio::time::timeout(KEEP_ALIVE, events.next()) => match next {
                    Err(_) => Event::default().comment("keep-alive"),
                    Ok(Ok(event)) => Event::default()
                        .event(event.event.as_str())
                        .id(event.at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true))
                        .json_data(&event)
                        .unwrap_or_else(|_| Event::default().comment("an event that does not serialize")),
                    Ok(Err(e)) => {
                        let error = crate::redact(&e.to_string());
                        tracing::warn!(error = %error, "A followed event stream failed; ending it");
                        let sent = Event::default().event("error").data(format!("the events cannot be read now: {error}"));
                        return Some((Ok::<_, std::convert::Infallible>(sent), None));
                    }
                },
            };
            Some((Ok(sent), Some((events, permit))))
        }
    });
    Ok(Sse::new(stream).into_response())
}

async fn audit(op: Operating, query: RawQuery) -> Answer {
    let p = params(query, &["limit"])?;
    items(op.admin.audit(&op.actor, p.limit("limit")?.unwrap_or(50)).await?)
}
