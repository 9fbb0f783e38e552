//! Fairness: each workspace's weight, jobs in the workers' hands and share of them; the global limits (every
//! workspace's jobs of a queue or a kind held together to a concurrency and/or a rate); every workspace's key limits,
//! blocks and kind limits, each with what it holds now. Each is set, changed and removed here (audited, as every
//! change of the console is).

use std::time::Duration;

use axum::Form;
use axum::extract::Query;
use axum::response::{IntoResponse, Redirect, Response};
use maud::{Markup, html};
use serde::Deserialize;

use super::layout::{self, Notice, Section, field, maybe};
use super::{Page, UiError};
use crate::{GlobalLimit, GlobalScope, KeyLimit, WorkspaceId};

/// A limit form: its scope and name, and (to set) its numbers.
#[derive(Deserialize)]
pub(super) struct LimitForm {
    scope: Option<String>,
    name: Option<String>,
    max_in_flight: Option<String>,
    max_per_interval: Option<String>,
    interval_ms: Option<String>,
}

impl LimitForm {
    fn scope(&self) -> Result<GlobalScope, UiError> {
        let scope = field(&self.scope).ok_or_else(|| UiError::Invalid("scope is required".to_owned()))?;
        let name = field(&self.name).ok_or_else(|| UiError::Invalid("name is required".to_owned()))?;
        GlobalScope::parse(scope, name).map_err(|e| UiError::Invalid(e.to_string()))
    }

    fn number(name: &str, value: &Option<String>) -> Result<Option<u64>, UiError> {
        field(value)
            .map(|v| v.parse::<u64>().map_err(|_| UiError::Invalid(format!("{name} is not a whole number: {v}"))))
            .transpose()
    }

    fn limit(&self) -> Result<GlobalLimit, UiError> {
        let narrow =
            |n: u64, name: &str| u32::try_from(n).map_err(|_| UiError::Invalid(format!("{name} is too large: {n}")));
        let max_in_flight =
            Self::number("max in flight", &self.max_in_flight)?.map(|n| narrow(n, "max in flight")).transpose()?;
        let per = Self::number("jobs per interval", &self.max_per_interval)?;
        let interval = Self::number("interval", &self.interval_ms)?;
        let max_per_interval = match (per, interval) {
            (Some(n), Some(ms)) => Some((narrow(n, "jobs per interval")?, Duration::from_millis(ms))),
            (None, None) => None,
            _ => return Err(UiError::Invalid("a rate needs both its jobs and its interval".to_owned())),
        };
        Ok(GlobalLimit { max_in_flight, max_per_interval })
    }
}

/// The page's filter: one workspace's limits.
#[derive(Deserialize)]
pub(super) struct Filters {
    workspace: Option<String>,
}

/// `GET /fairness`.
pub(super) async fn show(
    page: Page,
    Query(f): Query<Filters>,
    Query(notice): Query<Notice>,
) -> Result<Markup, UiError> {
    let workspace = layout::uuid_field("workspace", &f.workspace)?.map(WorkspaceId);
    let shares = page.admin.workspace_shares(page.actor()).await?;
    let limits = page.admin.global_limits(page.actor()).await?;
    let keys = page.admin.key_limits(page.actor(), workspace).await?;
    let kinds = page.admin.kind_limits(page.actor(), workspace).await?;
    let csrf = page.csrf.as_str();
    let body = html! {
        h2 { "Workspaces" }
        p.muted { "Each workspace keeps its weight times the window (CONVEYOR_DISPATCH_WINDOW) of jobs in the workers' \
                   hands; its share is its part of all jobs in flight now." }
        @if shares.is_empty() {
            div.card.muted { "No workspace has jobs in flight or a weight of its own." }
        } @else {
            table #workspaces {
                thead { tr { th { "Workspace" } th.num { "Weight" } th.num { "In flight" } th.num { "Share" } th { "" } } }
                tbody {
                    @for w in &shares {
                        @let ws = w.workspace_id.to_string();
                        tr data-workspace=(ws) {
                            td.mono { (ws) } td.num { (w.weight) } td.num { (w.in_flight) }
                            td.num { (format!("{:.0}%", w.share * 100.0)) }
                            td {
                                form.inline method="post" action=(page.at("/weights")) {
                                    (layout::csrf_field(csrf))
                                    input type="hidden" name="workspace" value=(ws);
                                    input name="weight" inputmode="numeric" size="4" value=(w.weight) aria-label="weight";
                                    button type="submit" { "Weigh" }
                                }
                            }
                        }
                    }
                }
            }
        }
        form.filters #set-weight method="post" action=(page.at("/weights")) {
            (layout::csrf_field(csrf))
            label { "Workspace" input name="workspace" size="38" required; }
            label { "Weight" input name="weight" inputmode="numeric" size="4" placeholder="1 to 1000" required; }
            button type="submit" { "Weigh" }
        }

        h2 { "Global limits" }
        p.muted {
            "A global limit holds every workspace's jobs of a queue or a kind together, beside each workspace's own \
             limits; the workspaces whose jobs wait take turns in its room."
        }
        @if limits.is_empty() {
            div.card.muted { "No global limit." }
        } @else {
            table #global-limits {
                thead { tr {
                    th { "Scope" } th { "Name" } th.num { "Max in flight" } th.num { "In flight" } th { "Rate" }
                    th.num { "In its interval" } th { "Since" } th { "" }
                } }
                tbody {
                    @for l in &limits {
                        tr data-limit=(format!("{}/{}", l.scope, l.name)) {
                            td { (l.scope) } td { (l.name) }
                            td.num { (maybe(l.max_in_flight)) } td.num { (l.in_flight) }
                            td { (rate(l.max_per_interval, l.interval_ms)) }
                            td.num { (l.handed_out_in_interval) }
                            td { (layout::time(l.updated_at)) }
                            td { (layout::post_button(&page.at("/limits/remove"), "Remove", csrf,
                                &[("scope", l.scope.as_str()), ("name", l.name.as_str())], "danger")) }
                        }
                    }
                }
            }
        }
        form.filters #set-limit method="post" action=(page.at("/limits")) {
            (layout::csrf_field(csrf))
            label { "Scope" select name="scope" { option value="queue" { "queue" } option value="kind" { "kind" } } }
            label { "Name" input name="name" required; }
            label { "Max in flight" input name="max_in_flight" inputmode="numeric" size="8" placeholder="none"; }
            label { "Jobs" input name="max_per_interval" inputmode="numeric" size="6" placeholder="none"; }
            label { "per ms" input name="interval_ms" inputmode="numeric" size="8" placeholder="1000"; }
            button.primary type="submit" { "Set" }
        }

        h2 { "Key limits and blocks" }
        form.filters method="get" action=(page.at("/fairness")) {
            label { "Workspace" input name="workspace" size="38" value=(field(&f.workspace).unwrap_or("")); }
            button type="submit" { "Filter" }
        }
        @if keys.is_empty() {
            div.card.muted { "No key limit or block." }
        } @else {
            table #key-limits {
                thead { tr {
                    th { "Workspace" } th { "Key" } th.num { "Max in flight" } th.num { "In flight" } th { "Rate" }
                    th { "Blocked until" } th { "Reason" } th { "" }
                } }
                tbody {
                    @for k in &keys {
                        @let ws = k.workspace_id.to_string();
                        tr data-key=(k.key) {
                            td.mono { (layout::short_id(k.workspace_id)) } td { (k.key) }
                            td.num { (maybe(k.max_in_flight)) } td.num { (k.in_flight) }
                            td { (rate(k.max_per_interval, k.interval_ms)) }
                            td { (layout::maybe_time(k.blocked_until)) } td { (layout::error_text(k.block_reason.as_deref())) }
                            td { (layout::post_button(&page.at("/key-limits/remove"), "Remove", csrf,
                                &[("workspace", ws.as_str()), ("key", k.key.as_str())], "danger")) }
                        }
                    }
                }
            }
        }
        form.filters #set-key-limit method="post" action=(page.at("/key-limits")) {
            (layout::csrf_field(csrf))
            label { "Workspace" input name="workspace" size="38" required; }
            label { "Key" input name="key" required; }
            label { "Max in flight" input name="max_in_flight" inputmode="numeric" size="8" placeholder="none"; }
            label { "Jobs" input name="max_per_interval" inputmode="numeric" size="6" placeholder="none"; }
            label { "per ms" input name="interval_ms" inputmode="numeric" size="8" placeholder="1000"; }
            button.primary type="submit" { "Set" }
        }

        h2 { "Kind limits" }
        @if kinds.is_empty() {
            div.card.muted { "No kind limit." }
        } @else {
            table #kind-limits {
                thead { tr { th { "Workspace" } th { "Kind" } th.num { "Max in flight" } th.num { "In flight" } th { "" } } }
                tbody {
                    @for k in &kinds {
                        @let ws = k.workspace_id.to_string();
                        tr data-kind=(k.kind) {
                            td.mono { (layout::short_id(k.workspace_id)) } td { (k.kind) }
                            td.num { (k.max_in_flight) } td.num { (k.in_flight) }
                            td { (layout::post_button(&page.at("/kind-limits/remove"), "Remove", csrf,
                                &[("workspace", ws.as_str()), ("kind", k.kind.as_str())], "danger")) }
                        }
                    }
                }
            }
        }
        form.filters #set-kind-limit method="post" action=(page.at("/kind-limits")) {
            (layout::csrf_field(csrf))
            label { "Workspace" input name="workspace" size="38" required; }
            label { "Kind" input name="kind" required; }
            label { "Max in flight" input name="max_in_flight" inputmode="numeric" size="8" required; }
            button.primary type="submit" { "Set" }
        }
    };
    Ok(layout::page("Fairness", Section::Fairness, &page.chrome(), notice.render(), body))
}

fn rate(n: Option<i32>, interval_ms: Option<i64>) -> Markup {
    html! {
        @if let (Some(n), Some(ms)) = (n, interval_ms) { (n) " per " (layout::age(ms as f64 / 1000.0)) } @else { "–" }
    }
}

fn back(page: &Page, code: &str) -> Response {
    Redirect::to(&Notice::url(&page.at("/fairness"), code, None)).into_response()
}

fn workspace(value: &Option<String>) -> Result<WorkspaceId, UiError> {
    layout::uuid_field("workspace", value)?
        .map(WorkspaceId)
        .ok_or_else(|| UiError::Invalid("workspace is required".to_owned()))
}

/// A weight form.
#[derive(Deserialize)]
pub(super) struct WeightForm {
    workspace: Option<String>,
    weight: Option<String>,
}

/// `POST /weights`: a workspace's weight.
pub(super) async fn weigh(page: Page, Form(form): Form<WeightForm>) -> Result<Response, UiError> {
    let ws = workspace(&form.workspace)?;
    let weight =
        LimitForm::number("weight", &form.weight)?.ok_or_else(|| UiError::Invalid("weight is required".to_owned()))?;
    let weight = u32::try_from(weight).map_err(|_| UiError::Invalid(format!("weight is too large: {weight}")))?;
    page.admin.set_workspace_weight(page.actor(), ws, weight).await?;
    Ok(back(&page, "weighed"))
}

/// A workspace's key or kind limit form.
#[derive(Deserialize)]
pub(super) struct OwnLimitForm {
    workspace: Option<String>,
    key: Option<String>,
    kind: Option<String>,
    max_in_flight: Option<String>,
    max_per_interval: Option<String>,
    interval_ms: Option<String>,
}

impl OwnLimitForm {
    /// A key or kind as given: a key is free text, so its spaces are its own and are kept.
    fn named<'a>(value: &'a Option<String>, what: &str) -> Result<&'a str, UiError> {
        value.as_deref().filter(|v| !v.is_empty()).ok_or_else(|| UiError::Invalid(format!("{what} is required")))
    }
}

/// `POST /key-limits`: a key's limits in a workspace.
pub(super) async fn set_key(page: Page, Form(form): Form<OwnLimitForm>) -> Result<Response, UiError> {
    let ws = workspace(&form.workspace)?;
    let key = OwnLimitForm::named(&form.key, "key")?;
    let numbers = LimitForm {
        scope: None,
        name: None,
        max_in_flight: form.max_in_flight.clone(),
        max_per_interval: form.max_per_interval.clone(),
        interval_ms: form.interval_ms.clone(),
    }
    .limit()?;
    let limit = KeyLimit { max_in_flight: numbers.max_in_flight, max_per_interval: numbers.max_per_interval };
    if limit == KeyLimit::default() {
        return Err(UiError::Invalid("a key limit needs a max in flight, a rate or both".to_owned()));
    }
    page.admin.set_key_limit(page.actor(), ws, key, limit).await?;
    Ok(back(&page, "limited"))
}

/// `POST /key-limits/remove`: a key's limits and block in a workspace.
pub(super) async fn remove_key(page: Page, Form(form): Form<OwnLimitForm>) -> Result<Response, UiError> {
    let ws = workspace(&form.workspace)?;
    let removed = page.admin.remove_key_limit(page.actor(), ws, OwnLimitForm::named(&form.key, "key")?).await?;
    Ok(back(&page, if removed { "unlimited" } else { "no-limit" }))
}

/// `POST /kind-limits`: a kind's limit in a workspace.
pub(super) async fn set_kind(page: Page, Form(form): Form<OwnLimitForm>) -> Result<Response, UiError> {
    let ws = workspace(&form.workspace)?;
    let kind = OwnLimitForm::named(&form.kind, "kind")?;
    let n = LimitForm::number("max in flight", &form.max_in_flight)?
        .ok_or_else(|| UiError::Invalid("max in flight is required".to_owned()))?;
    let n = u32::try_from(n).map_err(|_| UiError::Invalid(format!("max in flight is too large: {n}")))?;
    page.admin.set_kind_limit(page.actor(), ws, kind, n).await?;
    Ok(back(&page, "limited"))
}

/// `POST /kind-limits/remove`: a kind's limit in a workspace.
pub(super) async fn remove_kind(page: Page, Form(form): Form<OwnLimitForm>) -> Result<Response, UiError> {
    let ws = workspace(&form.workspace)?;
    let removed = page.admin.remove_kind_limit(page.actor(), ws, OwnLimitForm::named(&form.kind, "kind")?).await?;
    Ok(back(&page, if removed { "unlimited" } else { "no-limit" }))
}

/// `POST /limits`: sets (or replaces) a global limit.
pub(super) async fn set(page: Page, Form(form): Form<LimitForm>) -> Result<Response, UiError> {
    let (scope, limit) = (form.scope()?, form.limit()?);
    page.admin.set_global_limit(page.actor(), &scope, limit).await?;
    Ok(back(&page, "limited"))
}

/// `POST /limits/remove`: removes a global limit.
pub(super) async fn remove(page: Page, Form(form): Form<LimitForm>) -> Result<Response, UiError> {
    let removed = page.admin.remove_global_limit(page.actor(), &form.scope()?).await?;
    Ok(back(&page, if removed { "unlimited" } else { "no-limit" }))
}
