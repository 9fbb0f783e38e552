//! Global limits: every workspace's jobs of a queue or a kind held together to a concurrency and/or a rate, with what
//! each holds now; set, changed and removed here (audited, as every change of the console is).

use std::time::Duration;

use axum::Form;
use axum::extract::Query;
use axum::response::{IntoResponse, Redirect, Response};
use maud::{Markup, html};
use serde::Deserialize;

use super::layout::{self, Notice, Section, field, maybe};
use super::{Page, UiError};
use crate::{GlobalLimit, GlobalScope};

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

/// `GET /limits`.
pub(super) async fn list(page: Page, Query(notice): Query<Notice>) -> Result<Markup, UiError> {
    let limits = page.admin.global_limits(page.actor()).await?;
    let csrf = page.csrf.as_str();
    let body = html! {
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
                            td { @if let (Some(n), Some(ms)) = (l.max_per_interval, l.interval_ms) {
                                (n) " per " (layout::age(ms as f64 / 1000.0))
                            } @else { "–" } }
                            td.num { (l.handed_out_in_interval) }
                            td { (layout::time(l.updated_at)) }
                            td { (layout::post_button(&page.at("/limits/remove"), "Remove", csrf,
                                &[("scope", l.scope.as_str()), ("name", l.name.as_str())], "danger")) }
                        }
                    }
                }
            }
        }
        h2 { "Set a global limit" }
        form.filters #set-limit method="post" action=(page.at("/limits")) {
            (layout::csrf_field(csrf))
            label { "Scope" select name="scope" { option value="queue" { "queue" } option value="kind" { "kind" } } }
            label { "Name" input name="name" required; }
            label { "Max in flight" input name="max_in_flight" inputmode="numeric" size="8" placeholder="none"; }
            label { "Jobs" input name="max_per_interval" inputmode="numeric" size="6" placeholder="none"; }
            label { "per ms" input name="interval_ms" inputmode="numeric" size="8" placeholder="1000"; }
            button.primary type="submit" { "Set" }
        }
    };
    Ok(layout::page("Global limits", Section::Limits, &page.chrome(), notice.render(), body))
}

/// `POST /limits`: sets (or replaces) a global limit.
pub(super) async fn set(page: Page, Form(form): Form<LimitForm>) -> Result<Response, UiError> {
    let (scope, limit) = (form.scope()?, form.limit()?);
    page.admin.set_global_limit(page.actor(), &scope, limit).await?;
    Ok(Redirect::to(&Notice::url(&page.at("/limits"), "limited", None)).into_response())
}

/// `POST /limits/remove`: removes a global limit.
pub(super) async fn remove(page: Page, Form(form): Form<LimitForm>) -> Result<Response, UiError> {
    let removed = page.admin.remove_global_limit(page.actor(), &form.scope()?).await?;
    let code = if removed { "unlimited" } else { "no-limit" };
    Ok(Redirect::to(&Notice::url(&page.at("/limits"), code, None)).into_response())
}
