//! Dead letters: filtered by queue, kind and workspace; replay or discard one, or every one matching the filter.

use axum::Form;
use axum::extract::{Path, Query};
use axum::response::{IntoResponse, Redirect, Response};
use maud::{Markup, html};
use serde::Deserialize;

use super::jobs::job_id;
use super::layout::{self, Notice, Section, field, maybe, maybe_time, segment, short_id, url_with};
use super::{Console, UiError};
use crate::admin::{DeadLetterFilter, Replay};

/// The filters, as the search form (GET) and the bulk forms (POST) send them.
#[derive(Default, Deserialize)]
pub(super) struct Filters {
    queue: Option<String>,
    kind: Option<String>,
    workspace: Option<String>,
    before: Option<String>,
}

impl Filters {
    fn filter(&self) -> Result<DeadLetterFilter, UiError> {
        Ok(DeadLetterFilter {
            queue: field(&self.queue).map(str::to_owned),
            kind: field(&self.kind).map(str::to_owned),
            workspace: layout::uuid_field("workspace", &self.workspace)?,
            before: layout::uuid_field("before", &self.before)?,
            ..DeadLetterFilter::default()
        })
    }

    fn kept(&self) -> [(&'static str, Option<&str>); 3] {
        [("queue", field(&self.queue)), ("kind", field(&self.kind)), ("workspace", field(&self.workspace))]
    }

    /// The list with these filters (not the page cursor).
    fn list_url(&self) -> String {
        url_with("/ui/dead-letters", &self.kept())
    }
}

/// `GET /ui/dead-letters`.
pub(super) async fn list(
    console: Console,
    Query(f): Query<Filters>,
    Query(notice): Query<Notice>,
) -> Result<Markup, UiError> {
    let page = console.admin.dead_letters(console.actor(), &f.filter()?).await?;
    let csrf = console.csrf.as_str();
    let kept = f.kept();
    let hidden: Vec<(&str, &str)> = kept.iter().filter_map(|(k, v)| v.map(|v| (*k, v))).collect();
    let back = f.list_url();
    let body = html! {
        form.filters method="get" action="/ui/dead-letters" {
            label { "Queue" input name="queue" value=(field(&f.queue).unwrap_or("")); }
            label { "Kind" input name="kind" value=(field(&f.kind).unwrap_or("")); }
            label { "Workspace" input name="workspace" size="38" value=(field(&f.workspace).unwrap_or("")); }
            button type="submit" { "Filter" }
        }
        @if page.items.is_empty() {
            div.card.muted { "No dead letter matches." }
        } @else {
            div.actions {
                (layout::post_button("/ui/dead-letters/replay", "Replay all matching (up to 500)", csrf, &hidden, "primary"))
                (layout::post_button("/ui/dead-letters/discard", "Discard all matching (up to 500)", csrf, &hidden, "danger"))
            }
            table #dead-letters {
                thead { tr {
                    th { "Job" } th { "Kind" } th { "Queue" } th { "Stage" } th.num { "Attempts" } th { "Reason" }
                    th { "Workspace" } th { "Operation" } th { "Dead since" } th { "" }
                } }
                tbody {
                    @for d in &page.items {
                        @let path = format!("/ui/dead-letters/{}", d.id);
                        tr data-job=(d.id) {
                            td { a.open href=(format!("/ui/jobs/{}", d.id)) { (short_id(d.id)) } }
                            td { (d.event_type) }
                            td { a href=(format!("/ui/queues/{}", segment(&d.queue))) { (d.queue) } }
                            td { (maybe(d.failure_stage.as_deref())) }
                            td.num { (d.attempts) }
                            td.err { (layout::error_text(d.last_error.as_deref())) }
                            td { (short_id(d.workspace_id)) }
                            td { (layout::or_dash(d.operation_id.map(short_id))) }
                            td { (maybe_time(d.dead_lettered_at)) }
                            td {
                                (layout::post_button(&format!("{path}/replay"), "Replay", csrf, &[("back", back.as_str())], ""))
                                " "
                                (layout::post_button(&format!("{path}/discard"), "Discard", csrf, &[("back", back.as_str())], "danger"))
                            }
                        }
                    }
                }
            }
        }
        (layout::pager(page.next, "/ui/dead-letters", &kept))
    };
    Ok(layout::page("Dead letters", Section::DeadLetters, &console.chrome(), notice.render(), body))
}

/// Where a one-letter action returns: the list it was taken from.
#[derive(Deserialize)]
pub(super) struct Back {
    back: Option<String>,
}

impl Back {
    fn url(&self) -> &str {
        let ours = |b: &&str| {
            b.strip_prefix("/ui/dead-letters").is_some_and(|rest| rest.is_empty() || rest.starts_with('?'))
                && !b.chars().any(char::is_control)
        };
        field(&self.back).filter(ours).unwrap_or("/ui/dead-letters")
    }
}

/// `POST /ui/dead-letters/{id}/replay`.
pub(super) async fn replay(
    console: Console,
    Path(id): Path<String>,
    Form(back): Form<Back>,
) -> Result<Response, UiError> {
    let id = job_id(&id)?;
    let url = match console.admin.replay_dead_letter(console.actor(), id).await? {
        Replay::Replayed => Notice::url(back.url(), "replayed", None),
        Replay::NotDeadLetter => Notice::url(back.url(), "not-dead-letter", None),
        Replay::KeyHeld(holder) => Notice::held_url(back.url(), holder),
    };
    Ok(Redirect::to(&url).into_response())
}

/// `POST /ui/dead-letters/{id}/discard`.
pub(super) async fn discard(
    console: Console,
    Path(id): Path<String>,
    Form(back): Form<Back>,
) -> Result<Response, UiError> {
    let id = job_id(&id)?;
    let gone = console.admin.discard_dead_letter(console.actor(), id).await?;
    Ok(Redirect::to(&Notice::url(back.url(), if gone { "discarded" } else { "not-dead-letter" }, None)).into_response())
}

/// `POST /ui/dead-letters/replay`: every dead letter matching the form's filters.
pub(super) async fn replay_matching(console: Console, Form(f): Form<Filters>) -> Result<Response, UiError> {
    let filter = DeadLetterFilter { before: None, ..f.filter()? };
    let outcome = console.admin.replay_dead_letters(console.actor(), &filter).await?;
    Ok(Redirect::to(&Notice::url(&f.list_url(), "bulk-replayed", Some(&outcome))).into_response())
}

/// `POST /ui/dead-letters/discard`: every dead letter matching the form's filters.
pub(super) async fn discard_matching(console: Console, Form(f): Form<Filters>) -> Result<Response, UiError> {
    let filter = DeadLetterFilter { before: None, ..f.filter()? };
    let outcome = console.admin.discard_dead_letters(console.actor(), &filter).await?;
    Ok(Redirect::to(&Notice::url(&f.list_url(), "bulk-discarded", Some(&outcome))).into_response())
}
