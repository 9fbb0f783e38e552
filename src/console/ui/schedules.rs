//! Schedules of every workspace (or of one), with pause and resume.

use axum::Form;
use axum::extract::Query;
use axum::response::{IntoResponse, Redirect, Response};
use maud::{Markup, html};
use serde::Deserialize;

use super::layout::{self, Notice, Section, field, maybe, maybe_time, short_id, url_with};
use super::{Page, UiError};
use crate::WorkspaceId;

/// The list's filter.
#[derive(Deserialize)]
pub(super) struct Filters {
    workspace: Option<String>,
}

/// Which schedule a form acts on.
#[derive(Deserialize)]
pub(super) struct Target {
    workspace: Option<String>,
    name: Option<String>,
    /// The list's filter, to return to.
    back_workspace: Option<String>,
}

/// `GET /schedules`.
pub(super) async fn list(
    page: Page,
    Query(f): Query<Filters>,
    Query(notice): Query<Notice>,
) -> Result<Markup, UiError> {
    let workspace = layout::uuid_field("workspace", &f.workspace)?.map(WorkspaceId);
    let schedules = page.admin.schedules(page.actor(), workspace).await?;
    let csrf = page.csrf.as_str();
    let back = field(&f.workspace).unwrap_or("");
    let body = html! {
        form.filters method="get" action=(page.at("/schedules")) {
            label { "Workspace" input name="workspace" size="38" value=(back); }
            button type="submit" { "Filter" }
        }
        @if schedules.is_empty() {
            div.card.muted { "No schedule." }
        } @else {
            table #schedules {
                thead { tr {
                    th { "Name" } th { "Workspace" } th { "Kind" } th { "Queue" } th { "When" } th { "State" }
                    th { "Next run" } th { "Last tick" } th { "" }
                } }
                tbody {
                    @for (ws, s) in &schedules {
                        @let ws_text = ws.to_string();
                        @let target = [("workspace", ws_text.as_str()), ("name", s.name.as_str()), ("back_workspace", back)];
                        tr data-schedule=(s.name) {
                            td { (s.name) } td { (short_id(*ws)) } td { (s.kind) } td { (s.queue) }
                            td.mono {
                                @if let Some(cron) = &s.cron { (cron) " (" (s.time_zone.as_deref().unwrap_or("UTC")) ")" }
                                @else { "every " (maybe(s.every_ms.map(|ms| layout::age(ms as f64 / 1000.0)))) }
                            }
                            td { @if s.paused { (layout::status_badge("paused")) } @else { "active" } }
                            td { (layout::time(s.next_run_at)) } td { (maybe_time(s.last_tick_at)) }
                            td {
                                @if s.paused { (layout::post_button(&page.at("/schedules/resume"), "Resume", csrf, &target, "primary")) }
                                @else { (layout::post_button(&page.at("/schedules/pause"), "Pause", csrf, &target, "danger")) }
                            }
                        }
                    }
                }
            }
        }
    };
    Ok(layout::page("Schedules", Section::Schedules, &page.chrome(), notice.render(), body))
}

/// `POST /schedules/pause`.
pub(super) async fn pause(page: Page, Form(t): Form<Target>) -> Result<Response, UiError> {
    set_paused(page, t, true).await
}

/// `POST /schedules/resume`.
pub(super) async fn resume(page: Page, Form(t): Form<Target>) -> Result<Response, UiError> {
    set_paused(page, t, false).await
}

async fn set_paused(page: Page, t: Target, paused: bool) -> Result<Response, UiError> {
    let workspace = layout::uuid_field("workspace", &t.workspace)?
        .ok_or_else(|| UiError::Invalid("workspace is required".to_owned()))?;
    let name = field(&t.name).ok_or_else(|| UiError::Invalid("name is required".to_owned()))?;
    let found = page.admin.set_schedule_paused(page.actor(), WorkspaceId(workspace), name, paused).await?;
    let back_workspace = layout::uuid_field("back_workspace", &t.back_workspace)?.map(|w| w.to_string());
    let back = url_with(&page.at("/schedules"), &[("workspace", back_workspace.as_deref())]);
    let code = match (found, paused) {
        (false, _) => "no-schedule",
        (true, true) => "paused",
        (true, false) => "resumed",
    };
    Ok(Redirect::to(&Notice::url(&back, code, None)).into_response())
}
