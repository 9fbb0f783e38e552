//! Dead letters: filtered by queue, kind and workspace; replay or discard one, or every one matching the filter.
//!
//! A bulk action takes two steps: the list's button opens a confirmation page (a GET, changing nothing) that counts
//! the dead letters the action will take and carries `until`, the time it was rendered; its form posts the filter
//! with that `until`, so that letters dead-lettered after the operator saw the count are left alone. A bulk POST
//! without `until` changes nothing and leads to the confirmation page.

use axum::Form;
use axum::extract::{Path, Query};
use axum::response::{IntoResponse, Redirect, Response};
use chrono::{DateTime, SecondsFormat, Utc};
use maud::{Markup, html};
use serde::Deserialize;

use super::jobs::job_id;
use super::layout::{self, Notice, Section, field, maybe, maybe_time, segment, short_id, url_with};
use super::{Page, UiError};
use crate::{DeadLetterFilter, Replay};

/// Most dead letters one bulk action takes (the operator module's largest batch).
const BULK_LIMIT: u32 = 500;

/// How many of the letters a confirmation page lists.
const PREVIEW: usize = 10;

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
    fn list_url(&self, page: &Page) -> String {
        url_with(&page.at("/dead-letters"), &self.kept())
    }
}

/// `GET /dead-letters`.
pub(super) async fn list(
    page: Page,
    Query(f): Query<Filters>,
    Query(notice): Query<Notice>,
) -> Result<Markup, UiError> {
    let letters = page.admin.dead_letters(page.actor(), &f.filter()?).await?;
    let csrf = page.csrf.as_str();
    let kept = f.kept();
    let back = f.list_url(&page);
    let body = html! {
        form.filters method="get" action=(page.at("/dead-letters")) {
            label { "Queue" input name="queue" value=(field(&f.queue).unwrap_or("")); }
            label { "Kind" input name="kind" value=(field(&f.kind).unwrap_or("")); }
            label { "Workspace" input name="workspace" size="38" value=(field(&f.workspace).unwrap_or("")); }
            button type="submit" { "Filter" }
        }
        @if letters.items.is_empty() {
            div.card.muted { "No dead letter matches." }
        } @else {
            div.actions {
                (confirm_button(&page, Bulk::Replay, &kept, "primary"))
                (confirm_button(&page, Bulk::Discard, &kept, "danger"))
            }
            table #dead-letters {
                thead { tr {
                    th { "Job" } th { "Kind" } th { "Queue" } th { "Stage" } th.num { "Attempts" } th { "Reason" }
                    th { "Workspace" } th { "Operation" } th { "Dead since" } th { "" }
                } }
                tbody {
                    @for d in &letters.items {
                        @let path = page.at(&format!("/dead-letters/{}", d.id));
                        tr data-job=(d.id) {
                            td { a.open href=(page.at(&format!("/jobs/{}", d.id))) { (short_id(d.id)) } }
                            td { (d.event_type) }
                            td { a href=(page.at(&format!("/queues/{}", segment(&d.queue)))) { (d.queue) } }
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
        (layout::pager(letters.next, &page.at("/dead-letters"), &kept))
    };
    Ok(layout::page("Dead letters", Section::DeadLetters, &page.chrome(), notice.render(), body))
}

/// Where a one-letter action returns: the list it was taken from.
#[derive(Deserialize)]
pub(super) struct Back {
    back: Option<String>,
}

impl Back {
    /// The list to return to: the form's `back` when it is the console's own list, else the unfiltered list.
    fn url(&self, page: &Page) -> String {
        let list = page.at("/dead-letters");
        let ours = |b: &&str| {
            b.strip_prefix(list.as_str()).is_some_and(|rest| rest.is_empty() || rest.starts_with('?'))
                && !b.chars().any(char::is_control)
        };
        field(&self.back).filter(ours).map_or_else(|| list.clone(), str::to_owned)
    }
}

/// `POST /dead-letters/{id}/replay`.
pub(super) async fn replay(page: Page, Path(id): Path<String>, Form(back): Form<Back>) -> Result<Response, UiError> {
    let id = job_id(&id)?;
    let back = back.url(&page);
    let url = match page.admin.replay_dead_letter(page.actor(), id).await? {
        Replay::Replayed => Notice::url(&back, "replayed", None),
        Replay::NotDeadLetter => Notice::url(&back, "not-dead-letter", None),
        Replay::KeyHeld(holder) => Notice::held_url(&back, holder),
    };
    Ok(Redirect::to(&url).into_response())
}

/// `POST /dead-letters/{id}/discard`.
pub(super) async fn discard(page: Page, Path(id): Path<String>, Form(back): Form<Back>) -> Result<Response, UiError> {
    let id = job_id(&id)?;
    let gone = page.admin.discard_dead_letter(page.actor(), id).await?;
    Ok(Redirect::to(&Notice::url(&back.url(&page), if gone { "discarded" } else { "not-dead-letter" }, None))
        .into_response())
}

/// A bulk action.
#[derive(Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum Bulk {
    /// Replay every match.
    Replay,
    /// Discard every match.
    Discard,
}

impl Bulk {
    fn name(self) -> &'static str {
        match self {
            Self::Replay => "replay",
            Self::Discard => "discard",
        }
    }
}

/// The list's button to a bulk action's confirmation page (a GET form: opening it changes nothing).
fn confirm_button(page: &Page, action: Bulk, kept: &[(&'static str, Option<&str>)], class: &str) -> Markup {
    let label = match action {
        Bulk::Replay => "Replay all matching…",
        Bulk::Discard => "Discard all matching…",
    };
    html! {
        form.inline method="get" action=(page.at("/dead-letters/confirm")) {
            input type="hidden" name="action" value=(action.name());
            @for (name, value) in kept {
                @if let Some(value) = value { input type="hidden" name=(name) value=(value); }
            }
            button class=(class) type="submit" { (label) }
        }
    }
}

/// What the confirmation page is asked for: the action and the list's filters.
#[derive(Deserialize)]
pub(super) struct ConfirmQuery {
    action: Bulk,
    #[serde(flatten)]
    filters: Filters,
}

/// `GET /dead-letters/confirm?action=replay|discard&queue&kind&workspace`: how many dead letters the action will
/// take (those dead-lettered before now, the time it carries as `until`), a few of them, and the form that does it.
pub(super) async fn confirm(page: Page, Query(q): Query<ConfirmQuery>) -> Result<Markup, UiError> {
    let until = Utc::now();
    let filter = DeadLetterFilter { until: Some(until), limit: Some(BULK_LIMIT), before: None, ..q.filters.filter()? };
    let matched = page.admin.dead_letters(page.actor(), &filter).await?.items;
    let kept = q.filters.kept();
    let scoped = kept.iter().any(|(_, v)| v.is_some());
    let until_text = until.to_rfc3339_opts(SecondsFormat::Micros, true);
    let (verb, title) = match q.action {
        Bulk::Replay => ("replayed from their first attempt", "Replay dead letters?"),
        Bulk::Discard => ("discarded (their operations stay failed)", "Discard dead letters?"),
    };
    let scope: Vec<String> = kept.iter().filter_map(|(k, v)| v.map(|v| format!("{k} {v}"))).collect();
    let n = matched.len();
    let body = html! {
        div.card #confirm data-count=(n) {
            @if n == 0 {
                p { "No dead letter matches: nothing to do." }
            } @else {
                p {
                    strong #count { (n) (if n == 1 { " dead letter" } else { " dead letters" }) }
                    " will be " (verb) ": "
                    @if scoped { "those of " (scope.join(", ")) } @else { strong { "every queue, kind and workspace" } }
                    ", dead-lettered before " (layout::time(until)) "."
                }
                @if n == BULK_LIMIT as usize {
                    p.muted { "That is the most one action takes; more may match. Run it again for the rest." }
                }
                p.muted { "Letters dead-lettered after this page was shown are left alone." }
                table #preview {
                    thead { tr { th { "Job" } th { "Kind" } th { "Queue" } th { "Workspace" } th { "Dead since" } } }
                    tbody {
                        @for d in matched.iter().take(PREVIEW) {
                            tr { td { (short_id(d.id)) } td { (d.event_type) } td { (d.queue) }
                                 td { (short_id(d.workspace_id)) } td { (maybe_time(d.dead_lettered_at)) } }
                        }
                    }
                }
                @if n > PREVIEW { p.muted { "… and " (n - PREVIEW) " more." } }
                form method="post" action=(page.at(&format!("/dead-letters/{}", q.action.name()))) {
                    (layout::csrf_field(&page.csrf))
                    @for (name, value) in &kept {
                        @if let Some(value) = value { input type="hidden" name=(name) value=(value); }
                    }
                    input type="hidden" name="until" value=(until_text);
                    @if !scoped { input type="hidden" name="all" value="true"; }
                    div.actions {
                        button class=(if q.action == Bulk::Discard { "danger" } else { "primary" }) type="submit" {
                            (match q.action { Bulk::Replay => "Replay ", Bulk::Discard => "Discard " }) (n)
                        }
                        a href=(q.filters.list_url(&page)) { "Cancel" }
                    }
                }
            }
        }
        @if n == 0 { p { a href=(q.filters.list_url(&page)) { "Back to the dead letters" } } }
    };
    Ok(layout::page(title, Section::DeadLetters, &page.chrome(), None, body))
}

/// What a confirmed bulk form posts: the filters, the time its page was rendered, and `all` when it named none.
#[derive(Deserialize)]
pub(super) struct BulkForm {
    #[serde(flatten)]
    filters: Filters,
    until: Option<String>,
    all: Option<String>,
}

/// Runs `action` on the dead letters the confirmed form names; without `until` (not confirmed), changes nothing and
/// sends the browser to the confirmation page.
async fn bulk(page: Page, action: Bulk, form: BulkForm) -> Result<Response, UiError> {
    let Some(until) = field(&form.until) else {
        let mut pairs = vec![("action", Some(action.name()))];
        pairs.extend(form.filters.kept());
        return Ok(Redirect::to(&url_with(&page.at("/dead-letters/confirm"), &pairs)).into_response());
    };
    let until = DateTime::parse_from_rfc3339(until)
        .map_err(|_| UiError::Invalid(format!("until is not an RFC 3339 time: {until}")))?
        .with_timezone(&Utc);
    let filter = DeadLetterFilter {
        until: Some(until),
        before: None,
        all: field(&form.all) == Some("true"),
        ..form.filters.filter()?
    };
    let (outcome, code) = match action {
        Bulk::Replay => (page.admin.replay_dead_letters(page.actor(), &filter).await?, "bulk-replayed"),
        Bulk::Discard => (page.admin.discard_dead_letters(page.actor(), &filter).await?, "bulk-discarded"),
    };
    Ok(Redirect::to(&Notice::url(&form.filters.list_url(&page), code, Some(&outcome))).into_response())
}

/// `POST /dead-letters/replay`: every dead letter matching the confirmed form's filters, dead-lettered before its
/// `until`.
pub(super) async fn replay_matching(page: Page, Form(form): Form<BulkForm>) -> Result<Response, UiError> {
    bulk(page, Bulk::Replay, form).await
}

/// `POST /dead-letters/discard`: every dead letter matching the confirmed form's filters, dead-lettered before its
/// `until`.
pub(super) async fn discard_matching(page: Page, Form(form): Form<BulkForm>) -> Result<Response, UiError> {
    bulk(page, Bulk::Discard, form).await
}
