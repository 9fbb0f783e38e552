//! Jobs: the search across workspaces, and one job in full (attempts with their redacted errors, payload, progress,
//! result) with cancel and retry (a replay, for a dead letter), and a change of a waiting one.

use axum::Form;
use axum::extract::{Path, Query};
use axum::response::{IntoResponse, Redirect, Response};
use maud::{Markup, html};
use serde::Deserialize;
use uuid::Uuid;

use super::layout::{self, Notice, Section, field, maybe, maybe_time, segment, short_id, url_with};
use super::{Page, UiError};
use crate::JobStatus;
use crate::{JobAction, JobDetail, JobFilter, JobSummary};
use crate::{JobChange, JobId, Priority};

/// The search's filters, as the form sends them.
#[derive(Deserialize)]
pub(super) struct Filters {
    /// A job id: its page, whatever the other fields.
    id: Option<String>,
    queue: Option<String>,
    kind: Option<String>,
    status: Option<String>,
    workspace: Option<String>,
    /// Enqueued at or after: an RFC 3339 time (UTC when it names no offset) or a duration ago (`2h`).
    since: Option<String>,
    /// Enqueued before, the same way.
    until: Option<String>,
    before: Option<String>,
}

/// A form's time: RFC 3339, a date and time read as UTC (`2026-12-07 06:00`, as a person types it), or a duration
/// before now (`90m`, `2h`); an error naming the field otherwise.
fn time_field(name: &str, value: &Option<String>) -> Result<Option<chrono::DateTime<chrono::Utc>>, UiError> {
    let Some(raw) = field(value) else { return Ok(None) };
    if let Ok(at) = chrono::DateTime::parse_from_rfc3339(raw) {
        return Ok(Some(at.with_timezone(&chrono::Utc)));
    }
    for format in ["%Y-%m-%d %H:%M:%S", "%Y-%m-%d %H:%M", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%dT%H:%M"] {
        if let Ok(at) = chrono::NaiveDateTime::parse_from_str(raw, format) {
            return Ok(Some(at.and_utc()));
        }
    }
    let ago = humantime::parse_duration(raw).map_err(|_| {
        UiError::Invalid(format!("{name} is neither a time (2026-12-07 06:00, UTC) nor a duration ago (2h): {raw}"))
    })?;
    let too_far = || UiError::Invalid(format!("{name} reaches too far back: {raw}"));
    let ago = chrono::Duration::from_std(ago).map_err(|_| too_far())?;
    chrono::Utc::now().checked_sub_signed(ago).map(Some).ok_or_else(too_far)
}

/// `GET /jobs`.
pub(super) async fn search(page: Page, Query(f): Query<Filters>) -> Result<Response, UiError> {
    if let Some(id) = field(&f.id) {
        let id = job_id(id)?;
        return Ok(Redirect::to(&page.at(&format!("/jobs/{}", id.0))).into_response());
    }
    // A time given as a duration ago is resolved once: the next pages keep the same window.
    let (since, until) = (time_field("since", &f.since)?, time_field("until", &f.until)?);
    let (since_text, until_text) = (since.map(|t| t.to_rfc3339()), until.map(|t| t.to_rfc3339()));
    let filter = JobFilter {
        queue: field(&f.queue).map(str::to_owned),
        kind: field(&f.kind).map(str::to_owned),
        status: layout::status_field(&f.status)?,
        workspace: layout::uuid_field("workspace", &f.workspace)?,
        since,
        until,
        before: layout::uuid_field("before", &f.before)?,
        ..JobFilter::default()
    };
    let jobs = page.admin.jobs(page.actor(), &filter).await?;
    let kept = [
        ("queue", field(&f.queue)),
        ("kind", field(&f.kind)),
        ("status", field(&f.status)),
        ("workspace", field(&f.workspace)),
        ("since", since_text.as_deref()),
        ("until", until_text.as_deref()),
    ];
    let body = html! {
        form.filters method="get" action=(page.at("/jobs")) {
            label { "Job id" input name="id" size="38" placeholder="go straight to it"; }
            label { "Queue" input name="queue" value=(field(&f.queue).unwrap_or("")); }
            label { "Kind" input name="kind" value=(field(&f.kind).unwrap_or("")); }
            label { "Status"
                select name="status" {
                    option value="" { "any" }
                    @for s in JobStatus::ALL {
                        @let s = s.as_str();
                        option value=(s) selected[field(&f.status) == Some(s)] { (s) }
                    }
                }
            }
            label { "Workspace" input name="workspace" size="38" value=(field(&f.workspace).unwrap_or("")); }
            label { "Enqueued since (UTC)" input name="since" size="16" placeholder="2h, or 2026-12-07 06:00" value=(field(&f.since).unwrap_or("")); }
            label { "until (UTC)" input name="until" size="16" value=(field(&f.until).unwrap_or("")); }
            button type="submit" { "Search" }
        }
        (job_table(&page, &jobs.items, true))
        (layout::pager(jobs.next, &page.at("/jobs"), &kept))
    };
    Ok(layout::page("Jobs", Section::Jobs, &page.chrome(), None, body).into_response())
}

/// A table of jobs, each linking to its page.
pub(super) fn job_table(page: &Page, jobs: &[JobSummary], with_queue: bool) -> Markup {
    html! {
        @if jobs.is_empty() {
            div.card.muted { "No job matches." }
        } @else {
            table #jobs {
                thead { tr {
                    th { "Job" } th { "Kind" } @if with_queue { th { "Queue" } } th { "Status" }
                    th.num { "Failed runs" } th { "Last error" } th { "Workspace" } th { "Enqueued" } th { "Ended" }
                } }
                tbody {
                    @for j in jobs {
                        @let status = j.status.as_str();
                        tr data-job=(j.id) data-status=(status) {
                            td { a href=(page.at(&format!("/jobs/{}", j.id))) { (short_id(j.id)) } }
                            td { (j.kind) }
                            @if with_queue { td { a href=(page.at(&format!("/queues/{}", segment(&j.queue)))) { (j.queue) } } }
                            td { (layout::status_badge(status)) }
                            td.num { (j.failed_runs) }
                            td.err { (layout::error_text(j.last_error.as_deref())) }
                            td { (short_id(j.workspace_id)) }
                            td { (layout::time(j.created_at)) }
                            td { (maybe_time(j.finished_at)) }
                        }
                    }
                }
            }
        }
    }
}

/// `GET /jobs/{id}`.
pub(super) async fn show(page: Page, Path(id): Path<String>, Query(notice): Query<Notice>) -> Result<Markup, UiError> {
    let id = job_id(&id)?;
    let Some(job) = page.admin.job(page.actor(), id).await? else {
        return Err(UiError::NotFound(format!("No job {}.", id.0)));
    };
    let title = format!("Job {}", job.job.id);
    Ok(layout::page(&title, Section::Jobs, &page.chrome(), notice.render(), detail(&page, &job)))
}

fn detail(page: &Page, d: &JobDetail) -> Markup {
    let j = &d.job;
    let csrf = page.csrf.as_str();
    let status = j.status.as_str();
    let path = page.at(&format!("/jobs/{}", j.id));
    html! {
        div.actions {
            span #status data-status=(status) { (layout::status_badge(status)) }
            @if !j.status.is_finished() {
                (layout::post_button(&format!("{path}/cancel"), "Cancel", csrf, &[], "danger"))
            }
            @match j.status {
                JobStatus::Failed => (layout::post_button(&format!("{path}/retry"), "Replay", csrf, &[], "primary")),
                JobStatus::Retrying | JobStatus::Scheduled => (layout::post_button(&format!("{path}/retry"), "Run now", csrf, &[], "primary")),
                _ => {}
            }
            a #reload href=(path) { "Reload" }
        }
        @if matches!(j.status, JobStatus::Queued | JobStatus::Scheduled | JobStatus::Retrying) {
            (change_form(&path, csrf))
        }
        div.card {
            dl.facts {
                dt { "Id" } dd.mono { (j.id) }
                dt { "Kind" } dd { (j.kind) }
                dt { "Queue" } dd { a href=(page.at(&format!("/queues/{}", segment(&j.queue)))) { (j.queue) } }
                dt { "Workspace" } dd.mono {
                    a href=(url_with(&page.at("/jobs"), &[("workspace", Some(j.workspace_id.to_string().as_str()))])) { (j.workspace_id) }
                }
                dt { "Operation" } dd.mono { (maybe(j.operation_id)) }
                dt { "Trace" } dd.mono #trace {
                    @match (&d.trace_id, &page.trace_url) {
                        (Some(id), Some(url)) => a href=(url.replace("{trace_id}", id)) rel="noopener noreferrer" target="_blank" { (id) },
                        (Some(id), None) => (id),
                        (None, _) => "—",
                    }
                }
                dt { "Priority" } dd { (match d.priority { 0 => "high", 1 => "normal", 2 => "low", _ => "other" }) }
                dt { "Failed runs" } dd { (j.failed_runs) @if let Some(max) = d.max_attempts { " of at most " (max) " runs" } }
                dt { "De-dup key" } dd.mono { (maybe(d.dedup_key.as_deref())) }
                dt { "Enqueued" } dd { (layout::time(j.created_at)) }
                dt { "Runs at" } dd {
                    @if j.status == JobStatus::WaitingChildren { "when its last child ends" } @else { (layout::time(j.run_at)) }
                }
                dt { "Deadline" } dd #deadline { (maybe_time(d.expires_at)) }
                dt { "Last handed to workers" } dd { (maybe_time(d.dispatched_at)) }
                dt { "Last run started" } dd #run-started { (maybe_time(d.run_started_at)) }
                dt { "Ran on" } dd.mono #ran-by { (maybe(d.ran_by.as_deref())) }
                dt { "Ended" } dd { (maybe_time(j.finished_at)) }
                dt { "Last error" } dd.err { (layout::error_text(j.last_error.as_deref())) }
            }
        }
        @if d.parent.is_some() || !d.children.is_empty() {
            h2 { "Flow" }
            (family(page, d))
        }
        h2 { "Timeline" }
        (timeline(d))
        h2 { "Failed attempts" }
        @if d.attempts.is_empty() {
            div.card.muted { "None." }
        } @else {
            table #attempts {
                thead { tr { th.num { "Run" } th { "Stage" } th { "Error (redacted)" } th { "Failed at" } } }
                tbody {
                    @for a in &d.attempts {
                        tr { td.num { (a.attempt) } td { (a.stage) } td.err { (layout::error_text(a.error.as_deref())) }
                             td { (layout::time(a.failed_at)) } }
                    }
                }
            }
        }
        h2 { "Log" }
        @if d.logs.is_empty() {
            div.card.muted { "No lines." }
        } @else {
            table #logs {
                thead { tr { th.num { "#" } th.num { "Run" } th { "At" } th { "Line (redacted)" } } }
                tbody {
                    @for l in &d.logs {
                        tr { td.num { (l.seq) } td.num { (l.attempt) } td { (layout::time(l.at)) } td { (l.line) } }
                    }
                }
            }
        }
        h2 { "Payload" }
        (layout::json_block(&d.payload))
        @if let Some(progress) = &d.progress { h2 { "Progress" } (layout::json_block(progress)) }
        @if let Some(result) = &d.result { h2 { "Result" } (layout::json_block(result)) }
    }
}

/// The job's place in a flow: its parent (with what its failure does to it) and its children, each linking to its page.
fn family(page: &Page, d: &JobDetail) -> Markup {
    let link = |id: uuid::Uuid| html! { a href=(page.at(&format!("/jobs/{id}"))) { (short_id(id)) } };
    html! {
        @if let Some(p) = &d.parent {
            div.card #parent {
                dl.facts {
                    dt { "Parent" } dd { (link(p.id)) " " (p.kind) " " (layout::status_badge(p.status.as_str())) }
                    dt { "If this job fails" } dd { (match p.on_failure.as_str() {
                        "ignore" => "the parent runs, and reads the failure",
                        "remove" => "the parent runs without it",
                        _ => "the parent fails",
                    }) }
                }
            }
        }
        @if !d.children.is_empty() {
            @if d.job.status == JobStatus::WaitingChildren {
                p.muted { "Waits for " (d.children_left) " of its " (d.children.len()) " children." }
            }
            table #children {
                thead { tr { th { "Child" } th { "Kind" } th { "Queue" } th { "Status" } th { "If it fails" } th { "Ended" } } }
                tbody {
                    @for c in &d.children {
                        tr data-job=(c.id) data-status=(c.status.as_str()) {
                            td { (link(c.id)) }
                            td { (c.kind) }
                            td { (c.queue) }
                            td { (layout::status_badge(c.status.as_str())) @if c.children_left > 0 { " (" (c.children_left) " left)" } }
                            td { (c.on_failure) }
                            td { (maybe_time(c.finished_at)) }
                        }
                    }
                }
            }
        }
    }
}

/// The job's life so far, each step with the time since the one before: enqueued, each run's start (by the worker's
/// clock, where recorded) and the worker that ran it, each failed run, last handed to the workers, ended.
fn timeline(d: &JobDetail) -> Markup {
    let j = &d.job;
    let on = |by: &Option<String>| by.as_deref().map(|w| format!(" on {w}")).unwrap_or_default();
    let mut steps: Vec<(String, chrono::DateTime<chrono::Utc>)> = vec![("enqueued".into(), j.created_at)];
    for a in &d.attempts {
        // A failed run of the handler, or a failed hand-off to the stream; a replay's earlier ones stay listed.
        let step = match a.stage.as_str() {
            "dispatch" => format!("hand-off {} failed", a.attempt),
            _ => format!("run {} failed", a.attempt),
        };
        if let Some(started) = a.started_at {
            steps.push((format!("run {} started{}", a.attempt, on(&a.ran_by)), started));
        }
        steps.push((step, a.failed_at));
    }
    // The run that succeeded (a failed last run is among the attempts already). Not numbered: a replay counts its
    // runs from 1 again.
    if j.status == JobStatus::Succeeded
        && let Some(started) = d.run_started_at
        && !d.attempts.iter().any(|a| a.started_at == Some(started))
    {
        steps.push((format!("last run started{}", on(&d.ran_by)), started));
    }
    if let Some(at) = d.dispatched_at {
        steps.push(("last handed to the workers".into(), at));
    }
    if let Some(at) = j.finished_at {
        steps.push((format!("ended {}", j.status.as_str()), at));
    } else if j.run_at > j.created_at && !j.status.is_finished() && j.status != JobStatus::WaitingChildren {
        steps.push(("due".into(), j.run_at));
    }
    steps.sort_by_key(|(_, at)| *at);
    html! {
        table #timeline {
            thead { tr { th { "Step" } th { "At" } th.num { "After the step before" } } }
            tbody {
                @for (i, (step, at)) in steps.iter().enumerate() {
                    tr {
                        td { (step) }
                        td { (layout::time(*at)) }
                        td.num { @if i > 0 { (duration(*at - steps[i - 1].1)) } @else { "-" } }
                    }
                }
            }
        }
        @if let Some(max) = d.max_attempts {
            p.muted { "Failed runs: " (j.failed_runs) " of at most " (max) "." }
        }
    }
}

/// A span as a person reads it: milliseconds under a second, else seconds, minutes, hours.
fn duration(span: chrono::Duration) -> String {
    let ms = span.num_milliseconds().max(0);
    match ms {
        0..1_000 => format!("{ms} ms"),
        1_000..60_000 => format!("{:.1} s", ms as f64 / 1000.0),
        60_000..3_600_000 => format!("{:.1} min", ms as f64 / 60_000.0),
        _ => format!("{:.1} h", ms as f64 / 3_600_000.0),
    }
}

/// The change of a waiting job: what is left blank is kept.
fn change_form(path: &str, csrf: &str) -> Markup {
    html! {
        details.card #change {
            summary { "Change this waiting job" }
            form method="post" action=(format!("{path}/change")) {
                (layout::csrf_field(csrf))
                label { "Priority "
                    select name="priority" {
                        option value="" { "keep" }
                        option value="high" { "high" }
                        option value="normal" { "normal" }
                        option value="low" { "low" }
                    }
                }
                " "
                label { "Due " input name="delay" size="8" placeholder="now, 10m, 2h"; }
                label.block { "Payload (JSON, of this job's kind)" textarea name="payload" rows="4" cols="60" {} }
                button.primary type="submit" { "Change" }
            }
        }
    }
}

/// What the change form sends.
#[derive(Deserialize)]
pub(super) struct ChangeForm {
    priority: Option<String>,
    delay: Option<String>,
    payload: Option<String>,
}

/// `POST /jobs/{id}/change`: a waiting job's priority, due time (`now` or a delay from now) or payload.
pub(super) async fn change(
    page: Page,
    Path(id): Path<String>,
    Form(form): Form<ChangeForm>,
) -> Result<Response, UiError> {
    let id = job_id(&id)?;
    let mut change = JobChange::new();
    match field(&form.priority) {
        None => {}
        Some("high") => change = change.priority(Priority::High),
        Some("normal") => change = change.priority(Priority::Normal),
        Some("low") => change = change.priority(Priority::Low),
        Some(other) => return Err(UiError::Invalid(format!("priority must be high, normal or low, not {other}"))),
    }
    match field(&form.delay) {
        None => {}
        Some("now") => change = change.run_now(),
        Some(delay) => {
            let delay = humantime::parse_duration(delay)
                .map_err(|e| UiError::Invalid(format!("due is not now or a delay such as 10m: {delay} ({e})")))?;
            change = change.delay(delay);
        }
    }
    if let Some(payload) = field(&form.payload) {
        let payload =
            serde_json::from_str(payload).map_err(|e| UiError::Invalid(format!("the payload is not JSON: {e}")))?;
        change = change.json_payload(payload);
    }
    let action = page.admin.change_job(page.actor(), id, &change).await?;
    let path = page.at(&format!("/jobs/{}", id.0));
    let url = match action {
        JobAction::Done => Notice::url(&path, "changed", None),
        JobAction::NotAllowed => Notice::url(&path, "not-waiting", None),
        other => return Ok(after(&page, id, other, "changed")),
    };
    Ok(Redirect::to(&url).into_response())
}

/// A job id from the path, or an error naming it.
pub(super) fn job_id(text: &str) -> Result<JobId, UiError> {
    text.parse::<Uuid>().map(JobId).map_err(|_| UiError::Invalid(format!("job id is not a UUID: {text}")))
}

/// `POST /jobs/{id}/cancel`.
pub(super) async fn cancel(page: Page, Path(id): Path<String>) -> Result<Response, UiError> {
    let id = job_id(&id)?;
    let action = page.admin.cancel_job(page.actor(), id).await?;
    Ok(after(&page, id, action, "canceled"))
}

/// `POST /jobs/{id}/retry`: a dead letter is replayed from its first attempt; a retrying or delayed job runs now.
pub(super) async fn retry(page: Page, Path(id): Path<String>) -> Result<Response, UiError> {
    let id = job_id(&id)?;
    let action = page.admin.retry_job(page.actor(), id).await?;
    Ok(after(&page, id, action, "retried"))
}

fn after(page: &Page, id: JobId, action: JobAction, done: &str) -> Response {
    let path = page.at(&format!("/jobs/{}", id.0));
    let url = match action {
        JobAction::Done => Notice::url(&path, done, None),
        JobAction::NotFound => Notice::url(&path, "not-found", None),
        JobAction::NotAllowed => Notice::url(&path, "not-allowed", None),
        JobAction::KeyHeld(holder) => Notice::held_url(&path, holder),
        JobAction::Held(_) => Notice::url(&path, "held-back", None),
    };
    Redirect::to(&url).into_response()
}
