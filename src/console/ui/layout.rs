//! The page frame (head, navigation, who is signed in), and the small pieces every page uses: forms that post with
//! the CSRF token, status badges, times, pagination links, the notice after an action.

use chrono::{DateTime, Utc};
use maud::{DOCTYPE, Markup, html};
use serde::Deserialize;
use uuid::Uuid;

use super::guard::Base;
use crate::Actor;
use crate::JobStatus;
use crate::console::CSRF_FIELD;

/// What the frame of a signed-in page shows: who, the prefix of its links, and the host's logout form.
pub(super) struct Chrome<'a> {
    /// Who is signed in.
    pub actor: &'a Actor,
    /// The operator's CSRF token (empty: none needed).
    pub csrf: &'a str,
    /// The prefix the console is mounted under.
    pub base: &'a Base,
    /// The host's logout endpoint, if it has one.
    pub logout: Option<&'a str>,
    /// Reload the page every this many seconds (2 to 300), without JavaScript.
    pub refresh: Option<u32>,
}

/// Which navigation entry a page belongs to.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Section {
    Overview,
    Jobs,
    DeadLetters,
    Operations,
    Schedules,
    Consumers,
    Fairness,
}

const SECTIONS: [(Section, &str, &str); 7] = [
    (Section::Overview, "/", "Overview"),
    (Section::Consumers, "/consumers", "Consumers"),
    (Section::Jobs, "/jobs", "Jobs"),
    (Section::DeadLetters, "/dead-letters", "Dead letters"),
    (Section::Operations, "/operations", "Operations"),
    (Section::Schedules, "/schedules", "Schedules"),
    (Section::Fairness, "/fairness", "Fairness"),
];

/// A whole signed-in page.
pub(super) fn page(title: &str, section: Section, chrome: &Chrome<'_>, notice: Option<Markup>, body: Markup) -> Markup {
    frame(
        chrome.base,
        title,
        refresh(chrome.refresh),
        html! {
            header {
                a.brand href=(chrome.base.at("/")) { "Conveyor" }
                nav {
                    @for (s, href, label) in SECTIONS {
                        a.here[s == section] href=(chrome.base.at(href)) { (label) }
                    }
                }
                div.who {
                    span { "Signed in as " strong { (chrome.actor.0) } }
                    @if let Some(logout) = chrome.logout { (post_button(logout, "Log out", chrome.csrf, &[], "")) }
                }
            }
            main {
                h1 { (title) }
                @if let Some(notice) = notice { (notice) }
                (body)
            }
        },
    )
}

/// A page with only a message (errors, refusals), with links back.
pub(super) fn message_page(base: &Base, title: &str, text: &str) -> Markup {
    frame(
        base,
        title,
        html! {},
        html! {
            header {
                a.brand href=(base.at("/")) { "Conveyor" }
                nav { a href=(base.at("/")) { "Overview" } }
            }
            main { h1 { (title) } div.card { p { (text) } } }
        },
    )
}

/// The document around `content`, with `head` added to its head.
fn frame(base: &Base, title: &str, head: Markup, content: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · Conveyor" }
                link rel="stylesheet" href=(base.at("/static/ui.css"));
                (head)
            }
            body { (content) }
        }
    }
}

/// A one-button form posting to `action` with the CSRF token and `hidden` fields.
pub(super) fn post_button(action: &str, label: &str, csrf: &str, hidden: &[(&str, &str)], class: &str) -> Markup {
    html! {
        form.inline method="post" action=(action) {
            (csrf_field(csrf))
            @for (name, value) in hidden { input type="hidden" name=(name) value=(value); }
            button class=(class) type="submit" { (label) }
        }
    }
}

/// The CSRF field of a form written by hand (none when the operator needs no token).
pub(super) fn csrf_field(csrf: &str) -> Markup {
    html! { @if !csrf.is_empty() { input type="hidden" name=(CSRF_FIELD) value=(csrf); } }
}

/// A job status as a coloured badge.
pub(super) fn status_badge(status: &str) -> Markup {
    html! { span class=(format!("badge s-{status}")) { (status) } }
}

/// A time in UTC, to the second, labelled so.
pub(super) fn time(at: DateTime<Utc>) -> Markup {
    html! { time datetime=(at.to_rfc3339()) { (at.format("%Y-%m-%d %H:%M:%S UTC")) } }
}

/// An optional time, or a dash.
pub(super) fn maybe_time(at: Option<DateTime<Utc>>) -> Markup {
    match at {
        Some(at) => time(at),
        None => html! { span.muted { "—" } },
    }
}

/// A duration in seconds as `4s`, `3m 20s`, `2h 5m`, `3d 4h`.
pub(super) fn age(seconds: f64) -> String {
    let s = seconds.max(0.0).round() as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m {}s", s / 60, s % 60),
        3600..86400 => format!("{}h {}m", s / 3600, (s % 3600) / 60),
        _ => format!("{}d {}h", s / 86400, (s % 86400) / 3600),
    }
}

/// An optional number, or a dash.
pub(super) fn maybe<T: std::fmt::Display>(value: Option<T>) -> Markup {
    match value {
        Some(v) => html! { (v) },
        None => html! { span.muted { "—" } },
    }
}

/// Optional markup, or a dash.
pub(super) fn or_dash(value: Option<Markup>) -> Markup {
    value.unwrap_or_else(|| html! { span.muted { "—" } })
}

/// A UUID shortened for tables (its last 12 hex digits: UUIDv7s share their leading time bits), whole in `title`.
pub(super) fn short_id(id: Uuid) -> Markup {
    let text = id.simple().to_string();
    html! { span.mono title=(id) { "…" (&text[20..]) } }
}

/// Pretty JSON in a `<pre>`.
pub(super) fn json_block(value: &serde_json::Value) -> Markup {
    let text = serde_json::to_string_pretty(value).unwrap_or_else(|_| value.to_string());
    html! { pre { (text) } }
}

/// An error text as stored (already redacted), redacted once more for display.
pub(super) fn error_text(text: Option<&str>) -> Markup {
    match text {
        Some(t) => html! { (crate::redact(t)) },
        None => html! { span.muted { "—" } },
    }
}

/// `path` with `pairs` (empty values left out) as its query string.
pub(super) fn url_with(path: &str, pairs: &[(&str, Option<&str>)]) -> String {
    let mut query = url::form_urlencoded::Serializer::new(String::new());
    for (name, value) in pairs {
        if let Some(value) = value.filter(|v| !v.is_empty()) {
            query.append_pair(name, value);
        }
    }
    let query = query.finish();
    if query.is_empty() { path.to_owned() } else { format!("{path}?{query}") }
}

/// `path`, which may have a query already, with `pairs` (empty values left out) added to it.
pub(super) fn append(path: &str, pairs: &[(&str, Option<&str>)]) -> String {
    let query = url_with("", pairs);
    let query = query.trim_start_matches('?');
    let separator = if path.contains('?') { '&' } else { '?' };
    if query.is_empty() { path.to_owned() } else { format!("{path}{separator}{query}") }
}

/// A path segment, percent-encoded (queue names are URL-safe already; this keeps any other value harmless).
pub(super) fn segment(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The link to the next (older) page, when there is one.
pub(super) fn pager(next: Option<Uuid>, path: &str, filters: &[(&str, Option<&str>)]) -> Markup {
    let Some(next) = next else { return html! {} };
    let next = next.to_string();
    let mut pairs = filters.to_vec();
    pairs.push(("before", Some(&next)));
    html! { p.pager { a href=(url_with(path, &pairs)) { "Older →" } } }
}

/// What the page after an action says happened (fixed texts chosen by code; the numbers are parsed).
#[derive(Debug, Default, Deserialize)]
pub(super) struct Notice {
    notice: Option<String>,
    matched: Option<String>,
    done: Option<String>,
    skipped: Option<String>,
    held: Option<String>,
}

impl Notice {
    /// The redirect target `path` with the notice `code` (and bulk counts) in its query.
    pub(super) fn url(path: &str, code: &str, counts: Option<&crate::BulkOutcome>) -> String {
        let (m, d, s) = counts.map_or((None, None, None), |c| {
            (Some(c.matched.to_string()), Some(c.done.to_string()), Some(c.skipped.to_string()))
        });
        append(
            path,
            &[("notice", Some(code)), ("matched", m.as_deref()), ("done", d.as_deref()), ("skipped", s.as_deref())],
        )
    }

    /// The redirect target `path` with the notice `code` and up to three counts (shown as the notice says).
    pub(super) fn counts_url(path: &str, code: &str, counts: [u64; 3]) -> String {
        let [m, d, s] = counts.map(|n| n.to_string());
        append(
            path,
            &[
                ("notice", Some(code)),
                ("matched", Some(m.as_str())),
                ("done", Some(d.as_str())),
                ("skipped", Some(s.as_str())),
            ],
        )
    }

    /// The redirect target `path` with the `key-held` notice naming the job that holds the de-dup key.
    pub(super) fn held_url(path: &str, holder: Uuid) -> String {
        append(path, &[("notice", Some("key-held")), ("held", Some(&holder.to_string()))])
    }

    /// The notice as a banner, if the code is one the UI knows.
    pub(super) fn render(&self) -> Option<Markup> {
        let n = |v: &Option<String>| v.as_deref().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        let (text, bad) = match self.notice.as_deref()? {
            "replayed" => ("Replayed: the job runs again from its first attempt.".to_owned(), false),
            "retried" => ("Retried: the job runs again now.".to_owned(), false),
            "canceled" => ("Canceled.".to_owned(), false),
            "discarded" => ("Discarded: the dead letter is gone (its operation stays failed).".to_owned(), false),
            "paused" => ("Paused.".to_owned(), false),
            "already-paused" => ("It was already paused.".to_owned(), false),
            "resumed" => ("Resumed.".to_owned(), false),
            "not-paused" => ("There was no such pause.".to_owned(), true),
            "not-allowed" => ("The job's state does not allow that.".to_owned(), true),
            "held-back" => (
                "Not run now: a pause of its queue, kind or workspace, or a rate-limit block of its key, holds it; it \
                 runs once that ends (see Overview for pauses)."
                    .to_owned(),
                true,
            ),
            "not-dead-letter" => ("It is not a dead letter (any more).".to_owned(), true),
            "changed" => ("Changed.".to_owned(), false),
            "not-waiting" => ("Not changed: the job was handed to a worker, or ended.".to_owned(), true),
            "drained" => (format!("Drained: {} waiting jobs canceled.", n(&self.done)), false),
            "cleaned" => (format!("Cleaned: {} ended jobs deleted.", n(&self.done)), false),
            "obliterated" => (
                format!(
                    "Obliterated: {} jobs canceled, {} deleted, {} kept while their runs may go on.",
                    n(&self.matched),
                    n(&self.done),
                    n(&self.skipped)
                ),
                false,
            ),
            "queue-running" => (
                format!(
                    "Not obliterated: {} jobs of the queue run. Nothing changed; force it to cancel them too.",
                    n(&self.matched)
                ),
                true,
            ),
            "not-found" => ("No such job.".to_owned(), true),
            "no-schedule" => ("No such schedule.".to_owned(), true),
            "limited" => ("Limit set.".to_owned(), false),
            "unlimited" => ("Limit removed: its held jobs go.".to_owned(), false),
            "no-limit" => ("There was no such limit.".to_owned(), true),
            "weighed" => ("Weight set.".to_owned(), false),
            "key-held" => {
                let holder = self.held.as_deref().and_then(|h| h.parse::<Uuid>().ok());
                let text = match holder {
                    Some(h) => format!("Not replayed: live job {h} holds its de-duplication key."),
                    None => "Not replayed: a live job holds its de-duplication key.".to_owned(),
                };
                (text, true)
            }
            "bulk-replayed" | "bulk-discarded" => {
                let verb = if self.notice.as_deref() == Some("bulk-replayed") { "replayed" } else { "discarded" };
                let text = format!(
                    "{} matched, {} {verb}, {} skipped (de-dup key held, or no longer dead letters).",
                    n(&self.matched),
                    n(&self.done),
                    n(&self.skipped)
                );
                (text, false)
            }
            _ => return None,
        };
        Some(html! { div.notice.bad[bad] role="status" { (text) } })
    }
}

/// A form's optional text field: trimmed, `None` when empty.
pub(super) fn field(value: &Option<String>) -> Option<&str> {
    value.as_deref().map(str::trim).filter(|v| !v.is_empty())
}

/// A form's optional UUID field, or an error naming it.
pub(super) fn uuid_field(name: &str, value: &Option<String>) -> Result<Option<Uuid>, super::UiError> {
    field(value)
        .map(|v| v.parse::<Uuid>().map_err(|_| super::UiError::Invalid(format!("{name} is not a UUID: {v}"))))
        .transpose()
}

/// A form's optional job status, or an error listing the valid ones.
pub(super) fn status_field(value: &Option<String>) -> Result<Option<JobStatus>, super::UiError> {
    let Some(value) = field(value) else { return Ok(None) };
    JobStatus::from_name(value).map(Some).ok_or_else(|| {
        let names: Vec<&str> = JobStatus::ALL.into_iter().map(JobStatus::as_str).collect();
        super::UiError::Invalid(format!("status must be one of {}, not {value}", names.join(", ")))
    })
}

/// An auto-refresh every `seconds` without JavaScript (`<meta http-equiv="refresh">`), when asked for.
fn refresh(seconds: Option<u32>) -> Markup {
    match seconds {
        Some(s) => html! { meta http-equiv="refresh" content=(s); },
        None => html! {},
    }
}
