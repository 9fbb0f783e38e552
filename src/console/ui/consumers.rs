//! The consumers: each worker reading each queue, the entries it holds and how long since it read.

use maud::{Markup, html};

use super::layout::{self, Section, segment};
use super::{Page, UiError};
use crate::ConsumerInfo;

/// `GET /consumers`.
pub(super) async fn list(page: Page) -> Result<Markup, UiError> {
    let consumers = page.admin.consumers(page.actor()).await?;
    let body = html! {
        p.muted {
            "Each worker process is a consumer of every queue it serves. Held: entries delivered to it and not yet \
             acknowledged (the jobs it runs or is about to). A live worker touches the entries it holds three times \
             within the visibility time-out; one idle past it ("
            (layout::age(page.stalled_after.as_secs_f64()))
            ") while it holds entries has stalled, and another worker takes them over."
        }
        @if consumers.is_empty() {
            div.card.muted { "No consumer: no worker has read a queue yet." }
        } @else {
            table #consumers {
                thead { tr { th { "Queue" } th { "Consumer" } th.num { "Held" } th.num { "Idle" } th { "" } } }
                tbody {
                    @for c in &consumers {
                        (row(&page, c, stalled(c, page.stalled_after)))
                    }
                }
            }
        }
    };
    Ok(layout::page("Consumers", Section::Consumers, &page.chrome(), None, body))
}

/// Whether `c` holds entries and has been idle for `after` or more: it stopped touching them.
fn stalled(c: &ConsumerInfo, after: std::time::Duration) -> bool {
    c.pending > 0 && u128::from(c.idle_ms) >= after.as_millis()
}

fn row(page: &Page, c: &ConsumerInfo, stale: bool) -> Markup {
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_consumer_holding_entries_is_stalled_once_idle_for_the_visibility_time_out() {
        let consumer = |pending, idle_ms| ConsumerInfo { queue: "q".into(), consumer: "w".into(), pending, idle_ms };
        let visibility = Duration::from_secs(5);
        assert!(!stalled(&consumer(1, 4_999), visibility));
        assert!(stalled(&consumer(1, 5_000), visibility));
        assert!(!stalled(&consumer(0, 600_000), visibility), "holding nothing, an idle worker is only idle");
        assert!(!stalled(&consumer(3, 30_000), Duration::from_secs(60)), "a longer visibility time-out waits longer");
    }
}
