//! One queue: its counts by state, its last hour in charts, its jobs (filtered by status, newest first, paginated),
//! pause / resume, and the queue operations: drain (a workspace or all), clean a workspace's ended jobs, obliterate a
//! workspace's queue.

use axum::Form;
use axum::extract::{Path, Query};
use axum::response::{IntoResponse, Redirect, Response};
use maud::{Markup, html};
use serde::Deserialize;

use super::jobs::job_table;
use super::layout::{self, Notice, Section, age, field, maybe, segment, url_with};
use super::{Page, UiError};
use crate::{CleanFilter, DrainFilter, JobFilter, ObliterateFilter, Obliteration, QueueSummary};
use crate::{JobStatus, PauseScope};

/// The queue page's filters.
#[derive(Deserialize)]
pub(super) struct Filters {
    status: Option<String>,
    before: Option<String>,
}

/// What the pause form sends.
#[derive(Deserialize)]
pub(super) struct PauseForm {
    reason: Option<String>,
}

/// What the drain form sends: a workspace, or `all`.
#[derive(Deserialize)]
pub(super) struct DrainForm {
    workspace: Option<String>,
    all: Option<String>,
}

/// What the clean form sends.
#[derive(Deserialize)]
pub(super) struct CleanForm {
    status: Option<String>,
    workspace: Option<String>,
    older_than: Option<String>,
    keep_last: Option<String>,
}

/// What the obliterate form sends.
#[derive(Deserialize)]
pub(super) struct ObliterateForm {
    workspace: Option<String>,
    force: Option<String>,
}

/// `GET /queues/{name}`.
pub(super) async fn show(
    page: Page,
    Path(name): Path<String>,
    Query(filters): Query<Filters>,
    Query(notice): Query<Notice>,
) -> Result<Markup, UiError> {
    let Some(queue) = page.admin.queue(page.actor(), &name).await? else {
        return Err(UiError::NotFound(format!("No queue {name}: no kind or job names it.")));
    };
    let status = layout::status_field(&filters.status)?;
    let filter = JobFilter {
        queue: Some(name.clone()),
        status,
        before: layout::uuid_field("before", &filters.before)?,
        ..JobFilter::default()
    };
    let jobs = page.admin.jobs(page.actor(), &filter).await?;
    let minutes = page.admin.queue_minutes(page.actor(), &name).await?;
    let path = page.at(&format!("/queues/{}", segment(&name)));
    let status_text = field(&filters.status);
    let body = html! {
        (counts(&queue))
        (super::charts::queue_charts(&minutes))
        div.actions {
            @if queue.paused {
                (layout::status_badge("paused"))
                (layout::post_button(&format!("{path}/resume"), "Resume queue", &page.csrf, &[], "primary"))
            } @else {
                form.inline method="post" action=(format!("{path}/pause")) {
                    (layout::csrf_field(&page.csrf))
                    input name="reason" placeholder="reason (optional)";
                    " "
                    button.danger type="submit" { "Pause queue" }
                }
            }
            a href=(url_with(&page.at("/dead-letters"), &[("queue", Some(name.as_str()))])) { "Dead letters of this queue →" }
        }
        (operations(&path, &page.csrf))
        h2 { "Jobs" }
        p {
            "Status: "
            a href=(path) { @if status.is_none() { strong { "all" } } @else { "all" } }
            @for s in JobStatus::ALL {
                @let s = s.as_str();
                " · "
                a href=(url_with(&path, &[("status", Some(s))])) {
                    @if status_text == Some(s) { strong { (s) } } @else { (s) }
                }
            }
        }
        (job_table(&page, &jobs.items, false))
        (layout::pager(jobs.next, &path, &[("status", status_text)]))
    };
    Ok(layout::page(&format!("Queue {name}"), Section::Overview, &page.chrome(), notice.render(), body))
}

/// The queue operations' forms: each acts on one workspace (a drain on all, said explicitly), audited.
fn operations(path: &str, csrf: &str) -> Markup {
    html! {
        details.card #queue-operations {
            summary { "Queue operations" }
            form.inline #drain method="post" action=(format!("{path}/drain")) {
                (layout::csrf_field(csrf))
                strong { "Drain" } " (cancel every waiting job) in workspace "
                input name="workspace" size="38" placeholder="workspace id";
                label { input type="checkbox" name="all" value="true"; " or every workspace" }
                " "
                button.danger type="submit" { "Drain" }
            }
            form.inline #clean method="post" action=(format!("{path}/clean")) {
                (layout::csrf_field(csrf))
                strong { "Clean" } " ended jobs "
                select name="status" {
                    option value="succeeded" { "succeeded" }
                    option value="failed" { "failed" }
                    option value="canceled" { "canceled" }
                }
                " of workspace " input name="workspace" size="38" placeholder="workspace id";
                " ended at least " input name="older_than" size="6" placeholder="7d";
                " ago, keeping the newest " input name="keep_last" size="6" placeholder="1000";
                " "
                button.danger type="submit" { "Clean" }
            }
            form.inline #obliterate method="post" action=(format!("{path}/obliterate")) {
                (layout::csrf_field(csrf))
                strong { "Obliterate" } " (cancel the waiting jobs, delete the ended ones) in workspace "
                input name="workspace" size="38" placeholder="workspace id";
                label { input type="checkbox" name="force" value="true"; " cancel the running ones too" }
                " "
                button.danger type="submit" { "Obliterate" }
            }
        }
    }
}

/// A form's workspace, required.
fn workspace(value: &Option<String>) -> Result<uuid::Uuid, UiError> {
    layout::uuid_field("workspace", value)?.ok_or_else(|| UiError::Invalid("a workspace is required".into()))
}

/// `POST /queues/{name}/drain`.
pub(super) async fn drain(
    page: Page,
    Path(name): Path<String>,
    Form(form): Form<DrainForm>,
) -> Result<Response, UiError> {
    let all = field(&form.all) == Some("true");
    let filter = DrainFilter {
        queue: Some(name.clone()),
        kind: None,
        workspace: layout::uuid_field("workspace", &form.workspace)?,
        all,
    };
    let drained = page.admin.drain(page.actor(), &filter).await?;
    let path = page.at(&format!("/queues/{}", segment(&name)));
    Ok(Redirect::to(&Notice::counts_url(&path, "drained", [0, drained.canceled, 0])).into_response())
}

/// `POST /queues/{name}/clean`.
pub(super) async fn clean(
    page: Page,
    Path(name): Path<String>,
    Form(form): Form<CleanForm>,
) -> Result<Response, UiError> {
    let status = layout::status_field(&form.status)?.ok_or_else(|| UiError::Invalid("a status is required".into()))?;
    let older_than = field(&form.older_than)
        .map(|v| {
            humantime::parse_duration(v)
                .map_err(|e| UiError::Invalid(format!("older than is not a duration such as 7d or 90m: {v} ({e})")))
        })
        .transpose()?;
    let keep_last = field(&form.keep_last)
        .map(|v| v.parse::<u32>().map_err(|_| UiError::Invalid(format!("keep the newest is not a count: {v}"))))
        .transpose()?;
    let filter = CleanFilter {
        status,
        workspace: workspace(&form.workspace)?,
        queue: Some(name.clone()),
        kind: None,
        older_than_seconds: older_than.map(|d| d.as_secs()),
        keep_last,
    };
    let deleted = page.admin.clean(page.actor(), &filter).await?;
    let path = page.at(&format!("/queues/{}", segment(&name)));
    Ok(Redirect::to(&Notice::counts_url(&path, "cleaned", [0, deleted, 0])).into_response())
}

/// `POST /queues/{name}/obliterate`.
pub(super) async fn obliterate(
    page: Page,
    Path(name): Path<String>,
    Form(form): Form<ObliterateForm>,
) -> Result<Response, UiError> {
    let filter = ObliterateFilter { workspace: workspace(&form.workspace)?, force: field(&form.force) == Some("true") };
    let path = page.at(&format!("/queues/{}", segment(&name)));
    let url = match page.admin.obliterate(page.actor(), &name, &filter).await? {
        Obliteration::Done(done) => {
            Notice::counts_url(&path, "obliterated", [done.canceled, done.deleted, done.kept_running])
        }
        Obliteration::Running { running } => Notice::counts_url(&path, "queue-running", [running, 0, 0]),
    };
    Ok(Redirect::to(&url).into_response())
}

fn counts(q: &QueueSummary) -> Markup {
    let card = |label: &str, n: u64, class: &str| {
        html! { div class=(format!("count {class}")) data-state=(label) { div.n { (n) } div.l { (label) } } }
    };
    html! {
        div.counts #counts {
            (card("queued", q.counts.queued, ""))
            (card("delayed", q.counts.delayed, ""))
            (card("running", q.counts.running, ""))
            (card("retrying", q.counts.retrying, ""))
            (card("dead", q.counts.dead, "dead"))
            @if q.counts.waiting_children > 0 { (card("waiting for children", q.counts.waiting_children, "")) }
        }
        div.card {
            dl.facts {
                dt { "Stream lag (not yet delivered)" } dd { (maybe(q.lag)) }
                dt { "Pending (delivered, not acknowledged)" } dd { (maybe(q.pending)) }
                dt { "Consumers" } dd { (maybe(q.consumers)) }
                dt { "Succeeded per minute (5 min)" } dd { (format!("{:.1}", q.completed_per_minute)) }
                dt { "Dead-lettered per minute (5 min)" } dd { (format!("{:.1}", q.failed_per_minute)) }
                dt { "Oldest queued job" } dd { (maybe(q.oldest_queued_seconds.map(age))) }
            }
        }
    }
}

/// `POST /queues/{name}/pause`.
pub(super) async fn pause(
    page: Page,
    Path(name): Path<String>,
    Form(form): Form<PauseForm>,
) -> Result<Response, UiError> {
    let new = page.admin.pause(page.actor(), &PauseScope::queue(name.as_str()), field(&form.reason)).await?;
    let path = page.at(&format!("/queues/{}", segment(&name)));
    Ok(Redirect::to(&Notice::url(&path, if new { "paused" } else { "already-paused" }, None)).into_response())
}

/// `POST /queues/{name}/resume`.
pub(super) async fn resume(page: Page, Path(name): Path<String>) -> Result<Response, UiError> {
    let lifted = page.admin.resume(page.actor(), &PauseScope::queue(name.as_str())).await?;
    let path = page.at(&format!("/queues/{}", segment(&name)));
    Ok(Redirect::to(&Notice::url(&path, if lifted { "resumed" } else { "not-paused" }, None)).into_response())
}
