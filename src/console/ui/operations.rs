//! Operations: the search across workspaces by kind, status and workspace.

use axum::extract::Query;
use maud::{Markup, html};
use serde::Deserialize;

use super::layout::{self, Section, field, maybe_time, short_id};
use super::{Page, UiError};
use crate::OperationFilter;

/// The statuses an operation has.
const STATUSES: [&str; 5] = ["queued", "running", "succeeded", "failed", "canceled"];

/// The search's filters, as the form sends them.
#[derive(Deserialize)]
pub(super) struct Filters {
    kind: Option<String>,
    status: Option<String>,
    workspace: Option<String>,
    before: Option<String>,
}

/// `GET /operations`.
pub(super) async fn search(page: Page, Query(f): Query<Filters>) -> Result<Markup, UiError> {
    let status = field(&f.status);
    if let Some(status) = status.filter(|s| !STATUSES.contains(s)) {
        return Err(UiError::Invalid(format!("status must be one of {}, not {status}", STATUSES.join(", "))));
    }
    let filter = OperationFilter {
        kind: field(&f.kind).map(str::to_owned),
        status: status.map(str::to_owned),
        workspace: layout::uuid_field("workspace", &f.workspace)?,
        before: layout::uuid_field("before", &f.before)?,
        ..OperationFilter::default()
    };
    let operations = page.admin.operations(page.actor(), &filter).await?;
    let kept = [("kind", field(&f.kind)), ("status", status), ("workspace", field(&f.workspace))];
    let body = html! {
        form.filters method="get" action=(page.at("/operations")) {
            label { "Kind" input name="kind" value=(field(&f.kind).unwrap_or("")); }
            label { "Status"
                select name="status" {
                    option value="" { "any" }
                    @for s in STATUSES { option value=(s) selected[status == Some(s)] { (s) } }
                }
            }
            label { "Workspace" input name="workspace" size="38" value=(field(&f.workspace).unwrap_or("")); }
            button type="submit" { "Search" }
        }
        @if operations.items.is_empty() {
            div.card.muted { "No operation matches." }
        } @else {
            table #operations {
                thead { tr {
                    th { "Operation" } th { "Kind" } th { "Status" } th.num { "Attempt" } th { "Error" }
                    th { "Subject" } th { "Workspace" } th { "Created" } th { "Updated" } th { "Ended" }
                } }
                tbody {
                    @for o in &operations.items {
                        tr data-operation=(o.id) {
                            td { (short_id(o.id)) } td { (o.kind) } td { (layout::status_badge(&o.status)) }
                            td.num { (o.attempt) } td.err { (layout::error_text(o.error.as_deref())) }
                            td { (layout::or_dash(o.subject_id.map(short_id))) } td { (short_id(o.workspace_id)) }
                            td { (layout::time(o.created_at)) } td { (layout::time(o.updated_at)) }
                            td { (maybe_time(o.finished_at)) }
                        }
                    }
                }
            }
        }
        (layout::pager(operations.next, &page.at("/operations"), &kept))
    };
    Ok(layout::page("Operations", Section::Operations, &page.chrome(), None, body))
}
