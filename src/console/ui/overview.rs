//! The overview: every queue with its counts by state, lag, throughput, its last hour as small charts (done and failed,
//! backlog, wait p95) and oldest age, and the pauses in force (with a form to add one and a button to lift each).

use std::collections::BTreeMap;

use axum::Form;
use axum::extract::Query;
use axum::response::{IntoResponse, Redirect, Response};
use maud::{Markup, html};
use serde::Deserialize;

use super::layout::{self, Notice, Section, age, field, maybe, segment, url_with};
use super::{Page, UiError, charts};
use crate::{Pause, PauseScope, QueueMinute, QueueSummary, WorkspaceId};

/// The overview's options.
#[derive(Deserialize)]
pub(super) struct View {
    /// Reload every this many seconds (2 to 300; anything else: no reload).
    refresh: Option<String>,
}

/// A pause scope (and reason) as the forms send it.
#[derive(Deserialize)]
pub(super) struct ScopeForm {
    queue: Option<String>,
    kind: Option<String>,
    workspace: Option<String>,
    reason: Option<String>,
}

impl ScopeForm {
    fn scope(&self) -> Result<PauseScope, UiError> {
        Ok(PauseScope {
            queue: field(&self.queue).map(str::to_owned),
            kind: field(&self.kind).map(str::to_owned),
            workspace: layout::uuid_field("workspace", &self.workspace)?.map(WorkspaceId),
        })
    }
}

/// `GET /`.
pub(super) async fn show(
    page: Page,
    Query(view): Query<View>,
    Query(notice): Query<Notice>,
) -> Result<Markup, UiError> {
    let queues = page.admin.queues(page.actor()).await?;
    let minutes = page.admin.every_queue_minutes(page.actor()).await?;
    let pauses = page.admin.pauses(page.actor()).await?;
    let mut chrome = page.chrome();
    chrome.refresh = view.refresh.and_then(|s| s.parse().ok()).filter(|s| (2..=300).contains(s));
    let body = html! {
        p.muted {
            @if let Some(seconds) = chrome.refresh {
                "Reloading every " (seconds) " s. " a href=(page.at("/")) { "Stop" }
            } @else {
                a href=(page.at("/?refresh=5")) { "Reload every 5 s" }
            }
        }
        (queue_table(&page, &queues, &minutes))
        h2 { "Pauses" }
        // A reload would wipe what is typed into a form: while reloading, the page shows data alone.
        @if chrome.refresh.is_some() {
            (pause_table(&page, &pauses, false))
            p.muted #no-forms { "To pause or resume, " a href=(page.at("/")) { "stop reloading" } "." }
        } @else {
            (pause_table(&page, &pauses, true))
            (pause_form(&page))
        }
    };
    Ok(layout::page("Overview", Section::Overview, &chrome, notice.render(), body))
}

fn queue_table(page: &Page, queues: &[QueueSummary], minutes: &BTreeMap<String, Vec<QueueMinute>>) -> Markup {
    html! {
        h2 { "Queues" }
        @if queues.is_empty() {
            div.card.muted { "No queue yet: no kind is registered and no job was enqueued." }
        } @else {
            table #queues {
                thead { tr {
                    th { "Queue" } th.num { "Queued" } th.num { "Delayed" } th.num { "Running" } th.num { "Retrying" }
                    th.num { "Dead" } th.num { "Stream lag" } th.num { "Pending" } th.num { "Consumers" }
                    th.num { "Done/min" } th.num { "Failed/min" } th { "Last hour" } th.num { "Oldest queued" }
                    th { "" }
                } }
                tbody {
                    @for q in queues {
                        @let dead = url_with(&page.at("/dead-letters"), &[("queue", Some(q.name.as_str()))]);
                        tr data-queue=(q.name) {
                            td { a href=(page.at(&format!("/queues/{}", segment(&q.name)))) { (q.name) } }
                            td.num { (q.counts.queued) } td.num { (q.counts.delayed) } td.num { (q.counts.running) }
                            td.num { (q.counts.retrying) }
                            td.num { a.dead href=(dead) { (q.counts.dead) } }
                            td.num { (maybe(q.lag)) } td.num { (maybe(q.pending)) } td.num { (maybe(q.consumers)) }
                            td.num { (format!("{:.1}", q.completed_per_minute)) }
                            td.num { (format!("{:.1}", q.failed_per_minute)) }
                            td.spark { @match minutes.get(&q.name) {
                                Some(hour) => {
                                    (charts::sparkline(hour))
                                    (charts::spark_line(&charts::backlog(hour), "backlog", "jobs"))
                                    (charts::spark_line(&charts::wait(hour), "wait p95", "ms"))
                                },
                                None => span.muted { "nothing recorded" },
                            } }
                            td.num { (maybe(q.oldest_queued_seconds.map(age))) }
                            td { @if q.paused { (layout::status_badge("paused")) } }
                        }
                    }
                }
            }
            p.muted #last-hour-legend {
                "Last hour, a minute a step: jobs done, failed and expired (bars), then the due backlog and the wait p95 (lines). "
                "Hover a chart for its figures."
            }
        }
    }
}

fn pause_table(page: &Page, pauses: &[Pause], with_forms: bool) -> Markup {
    html! {
        @if pauses.is_empty() {
            div.card.muted { "Nothing is paused." }
        } @else {
            table #pauses {
                thead { tr { th { "Queue" } th { "Kind" } th { "Workspace" } th { "Reason" } th { "Since" } th { "" } } }
                tbody {
                    @for p in pauses {
                        @let workspace = p.workspace_id.map(|w| w.to_string()).unwrap_or_default();
                        tr {
                            td { (maybe(p.queue.as_deref())) } td { (maybe(p.kind.as_deref())) }
                            td.mono { (maybe(p.workspace_id)) } td { (maybe(p.reason.as_deref())) }
                            td { (layout::time(p.created_at)) }
                            td { @if with_forms { (layout::post_button(&page.at("/pauses/resume"), "Resume", &page.csrf, &[
                                ("queue", p.queue.as_deref().unwrap_or("")),
                                ("kind", p.kind.as_deref().unwrap_or("")),
                                ("workspace", workspace.as_str()),
                            ], "")) } }
                        }
                    }
                }
            }
        }
    }
}

fn pause_form(page: &Page) -> Markup {
    html! {
        form.filters method="post" action=(page.at("/pauses")) {
            (layout::csrf_field(&page.csrf))
            label { "Queue" input name="queue" placeholder="any"; }
            label { "Kind" input name="kind" placeholder="any"; }
            label { "Workspace" input name="workspace" placeholder="any" size="38"; }
            label { "Reason" input name="reason" placeholder="optional"; }
            button type="submit" { "Pause" }
        }
    }
}

/// `POST /pauses`: pauses a scope.
pub(super) async fn pause(page: Page, Form(form): Form<ScopeForm>) -> Result<Response, UiError> {
    let scope = form.scope()?;
    let new = page.admin.pause(page.actor(), &scope, field(&form.reason)).await?;
    Ok(Redirect::to(&Notice::url(&page.at("/"), if new { "paused" } else { "already-paused" }, None)).into_response())
}

/// `POST /pauses/resume`: lifts the pause of exactly this scope.
pub(super) async fn resume(page: Page, Form(form): Form<ScopeForm>) -> Result<Response, UiError> {
    let scope = form.scope()?;
    let lifted = page.admin.resume(page.actor(), &scope).await?;
    Ok(Redirect::to(&Notice::url(&page.at("/"), if lifted { "resumed" } else { "not-paused" }, None)).into_response())
}
