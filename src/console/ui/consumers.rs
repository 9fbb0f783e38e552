//! The consumers: each worker reading each queue, the entries it holds and how long since it read.

use maud::{Markup, html};

use super::layout::{self, Section, segment};
use super::{Page, UiError};
use crate::ConsumerInfo;

/// A consumer idle this long while it holds entries is likely gone: shown as such.
const GONE_AFTER_MS: u64 = 60_000;

/// `GET /consumers`.
pub(super) async fn list(page: Page) -> Result<Markup, UiError> {
    let consumers = page.admin.consumers(page.actor()).await?;
    let body = html! {
        p.muted { "Each worker process is a consumer of every queue it serves. Held: entries delivered to it and not yet \
                   acknowledged (the jobs it runs or is about to). A consumer idle for long while it holds entries \
                   has likely died: another worker reclaims them after the visibility time-out." }
        @if consumers.is_empty() {
            div.card.muted { "No consumer: no worker has read a queue yet." }
        } @else {
            table #consumers {
                thead { tr { th { "Queue" } th { "Consumer" } th.num { "Held" } th.num { "Idle" } th { "" } } }
                tbody {
                    @for c in &consumers {
                        (row(&page, c))
                    }
                }
            }
        }
    };
    Ok(layout::page("Consumers", Section::Consumers, &page.chrome(), None, body))
}

fn row(page: &Page, c: &ConsumerInfo) -> Markup {
    let stale = c.pending > 0 && c.idle_ms >= GONE_AFTER_MS;
    html! {
        tr data-queue=(c.queue) data-consumer=(c.consumer) {
            td { a href=(page.at(&format!("/queues/{}", segment(&c.queue)))) { (c.queue) } }
            td.mono { (c.consumer) }
            td.num { (c.pending) }
            td.num { (layout::age(c.idle_ms as f64 / 1000.0)) }
            td { @if stale { (layout::status_badge("stalled")) } }
        }
    }
}
