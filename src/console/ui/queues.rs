//! One queue: its counts by state, its jobs (filtered by status, newest first, paginated) and pause / resume.

use axum::Form;
use axum::extract::{Path, Query};
use axum::response::{IntoResponse, Redirect, Response};
use maud::{Markup, html};
use serde::Deserialize;

use super::jobs::job_table;
use super::layout::{self, Notice, Section, age, field, maybe, segment, url_with};
use super::{Page, UiError};
use crate::{JobFilter, QueueSummary};
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
    let path = page.at(&format!("/queues/{}", segment(&name)));
    let status_text = field(&filters.status);
    let body = html! {
        (counts(&queue))
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
