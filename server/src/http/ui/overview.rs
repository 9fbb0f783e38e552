//! The overview: every queue with its counts by state, lag, throughput and oldest age, and the pauses in force (with
//! a form to add one and a button to lift each).

use axum::Form;
use axum::extract::Query;
use axum::response::{IntoResponse, Redirect, Response};
use maud::{Markup, html};
use serde::Deserialize;

use super::layout::{self, Notice, Section, age, field, maybe, segment, url_with};
use super::{Console, UiError};
use conveyor_jobs::QueueSummary;
use conveyor_jobs::WorkspaceId;
use conveyor_jobs::{Pause, PauseScope};

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

/// `GET /ui/`.
pub(super) async fn show(
    console: Console,
    Query(view): Query<View>,
    Query(notice): Query<Notice>,
) -> Result<Markup, UiError> {
    let queues = console.admin.queues(console.actor()).await?;
    let pauses = console.admin.pauses(console.actor()).await?;
    let mut chrome = console.chrome();
    chrome.refresh = view.refresh.and_then(|s| s.parse().ok()).filter(|s| (2..=300).contains(s));
    let body = html! {
        p.muted {
            @if let Some(seconds) = chrome.refresh {
                "Reloading every " (seconds) " s. " a href="/ui/" { "Stop" }
            } @else {
                a href="/ui/?refresh=5" { "Reload every 5 s" }
            }
        }
        (queue_table(&queues))
        h2 { "Pauses" }
        (pause_table(&pauses, console.csrf.as_str()))
        (pause_form(console.csrf.as_str()))
    };
    Ok(layout::page("Overview", Section::Overview, &chrome, notice.render(), body))
}

fn queue_table(queues: &[QueueSummary]) -> Markup {
    html! {
        h2 { "Queues" }
        @if queues.is_empty() {
            div.card.muted { "No queue yet: no kind is registered and no job was enqueued." }
        } @else {
            table #queues {
                thead { tr {
                    th { "Queue" } th.num { "Queued" } th.num { "Delayed" } th.num { "Running" } th.num { "Retrying" }
                    th.num { "Dead" } th.num { "Stream lag" } th.num { "Pending" } th.num { "Consumers" }
                    th.num { "Done/min" } th.num { "Failed/min" } th.num { "Oldest queued" } th { "" }
                } }
                tbody {
                    @for q in queues {
                        @let dead = url_with("/ui/dead-letters", &[("queue", Some(q.name.as_str()))]);
                        tr data-queue=(q.name) {
                            td { a href=(format!("/ui/queues/{}", segment(&q.name))) { (q.name) } }
                            td.num { (q.counts.queued) } td.num { (q.counts.delayed) } td.num { (q.counts.running) }
                            td.num { (q.counts.retrying) }
                            td.num { a.dead href=(dead) { (q.counts.dead) } }
                            td.num { (maybe(q.lag)) } td.num { (maybe(q.pending)) } td.num { (maybe(q.consumers)) }
                            td.num { (format!("{:.1}", q.completed_per_minute)) }
                            td.num { (format!("{:.1}", q.failed_per_minute)) }
                            td.num { (maybe(q.oldest_queued_seconds.map(age))) }
                            td { @if q.paused { (layout::status_badge("paused")) } }
                        }
                    }
                }
            }
        }
    }
}

fn pause_table(pauses: &[Pause], csrf: &str) -> Markup {
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
                            td { (layout::post_button("/ui/pauses/resume", "Resume", csrf, &[
                                ("queue", p.queue.as_deref().unwrap_or("")),
                                ("kind", p.kind.as_deref().unwrap_or("")),
                                ("workspace", workspace.as_str()),
                            ], "")) }
                        }
                    }
                }
            }
        }
    }
}

fn pause_form(csrf: &str) -> Markup {
    html! {
        form.filters method="post" action="/ui/pauses" {
            (layout::csrf_field(csrf))
            label { "Queue" input name="queue" placeholder="any"; }
            label { "Kind" input name="kind" placeholder="any"; }
            label { "Workspace" input name="workspace" placeholder="any" size="38"; }
            label { "Reason" input name="reason" placeholder="optional"; }
            button type="submit" { "Pause" }
        }
    }
}

/// `POST /ui/pauses`: pauses a scope.
pub(super) async fn pause(console: Console, Form(form): Form<ScopeForm>) -> Result<Response, UiError> {
    let scope = form.scope()?;
    let new = console.admin.pause(console.actor(), &scope, field(&form.reason)).await?;
    Ok(Redirect::to(&Notice::url("/ui/", if new { "paused" } else { "already-paused" }, None)).into_response())
}

/// `POST /ui/pauses/resume`: lifts the pause of exactly this scope.
pub(super) async fn resume(console: Console, Form(form): Form<ScopeForm>) -> Result<Response, UiError> {
    let scope = form.scope()?;
    let lifted = console.admin.resume(console.actor(), &scope).await?;
    Ok(Redirect::to(&Notice::url("/ui/", if lifted { "resumed" } else { "not-paused" }, None)).into_response())
}
