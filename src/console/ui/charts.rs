//! A queue's last hour drawn on the server, as inline SVG (no script): jobs done, failed and expired per minute as
//! stacked bars, the due backlog and the 95th percentile of the wait as lines; in a table cell, the same three as
//! sparklines. Each chart says its scale (the largest value) and its time axis (an hour ago to now, in UTC); every bar
//! and point carries a `<title>` with its minute and value, which a browser shows on hover.

use maud::{Markup, html};

use crate::QueueMinute;

/// The drawing's size, in SVG units (it scales to the card's width).
const WIDTH: f64 = 600.0;
const HEIGHT: f64 = 120.0;
/// Room under the drawing for the time axis.
const AXIS: f64 = 20.0;

/// The three charts of a queue's minutes.
pub(super) fn queue_charts(minutes: &[QueueMinute]) -> Markup {
    let done: Vec<f64> = minutes.iter().map(|m| m.done as f64).collect();
    let failed: Vec<f64> = minutes.iter().map(|m| m.failed as f64).collect();
    let expired: Vec<f64> = minutes.iter().map(|m| m.expired as f64).collect();
    let (backlog, wait) = (backlog(minutes), wait(minutes));
    let label = |i: usize| minutes.get(i).map(|m| m.minute.format("%H:%M UTC").to_string()).unwrap_or_default();
    html! {
        div.charts #charts {
            div.card.chart data-chart="throughput" {
                h3 { "Done, failed and expired per minute" }
                (bars(&done, &failed, &expired, &label))
            }
            div.card.chart data-chart="backlog" {
                h3 { "Backlog (due, not yet handed out)" }
                (line(&backlog, "jobs", &label))
            }
            div.card.chart data-chart="wait" {
                h3 { "Wait p95 (due to hand-off)" }
                (line(&wait, "ms", &label))
            }
        }
    }
}

/// The due backlog of each minute, where recorded.
pub(super) fn backlog(minutes: &[QueueMinute]) -> Vec<Option<f64>> {
    minutes.iter().map(|m| m.backlog.map(|b| b as f64)).collect()
}

/// The 95th percentile of each minute's wait, in ms, where recorded.
pub(super) fn wait(minutes: &[QueueMinute]) -> Vec<Option<f64>> {
    minutes.iter().map(|m| m.wait_p95_ms.filter(|w| w.is_finite())).collect()
}

/// The sparkline's size, in pixels.
const SPARK_WIDTH: f64 = 120.0;
const SPARK_HEIGHT: f64 = 24.0;

/// A queue's last hour in a table cell: jobs done, failed and expired per minute as stacked bars, no axis; its label
/// and tooltip say the hour's totals and its busiest minute.
pub(super) fn sparkline(minutes: &[QueueMinute]) -> Markup {
    let n = minutes.len().max(1) as f64;
    let max = minutes.iter().map(|m| m.done + m.failed + m.expired).max().unwrap_or(0) as f64;
    let (done, failed, expired) =
        minutes.iter().fold((0, 0, 0), |(d, f, x), m| (d + m.done, f + m.failed, x + m.expired));
    let summary =
        format!("last hour: {done} done, {failed} failed, {expired} expired, busiest minute {}", format_value(max));
    // At least one pixel high, so that a minute of one job beside a busy one still shows; scaled to two pixels less
    // than the drawing, so that the three parts of a minute, each rounded up so, never reach past its top.
    let y = |v: f64| if max > 0.0 && v > 0.0 { (v / max * (SPARK_HEIGHT - 2.0)).max(1.0) } else { 0.0 };
    let slot = SPARK_WIDTH / n;
    html! {
        svg.spark width=(SPARK_WIDTH) height=(SPARK_HEIGHT) viewBox=(format!("0 0 {SPARK_WIDTH} {SPARK_HEIGHT}"))
            role="img" aria-label=(summary) {
            title { (summary) }
            line.base x1="0" y1=(SPARK_HEIGHT - 0.5) x2=(SPARK_WIDTH) y2=(SPARK_HEIGHT - 0.5) {}
            @for (i, m) in minutes.iter().enumerate() {
                @let (d, f, x) = (y(m.done as f64), y(m.failed as f64), y(m.expired as f64));
                @if d > 0.0 {
                    rect.done x=(format!("{:.1}", i as f64 * slot)) y=(format!("{:.1}", SPARK_HEIGHT - d))
                        width=(format!("{:.1}", slot * 0.8)) height=(format!("{d:.1}")) {}
                }
                @if f > 0.0 {
                    rect.failed x=(format!("{:.1}", i as f64 * slot)) y=(format!("{:.1}", SPARK_HEIGHT - d - f))
                        width=(format!("{:.1}", slot * 0.8)) height=(format!("{f:.1}")) {}
                }
                @if x > 0.0 {
                    rect.expired x=(format!("{:.1}", i as f64 * slot)) y=(format!("{:.1}", SPARK_HEIGHT - d - f - x))
                        width=(format!("{:.1}", slot * 0.8)) height=(format!("{x:.1}")) {}
                }
            }
        }
    }
}

/// The series of a queue's last hour in a table cell (`what`: `backlog`, `wait p95`), as a line through the minutes that
/// have a value, no axis; its label and tooltip say the latest value and the hour's largest.
pub(super) fn spark_line(values: &[Option<f64>], what: &str, unit: &str) -> Markup {
    let n = values.len().max(2) as f64;
    let max = values.iter().flatten().copied().fold(0.0, f64::max);
    let summary = match values.iter().rev().flatten().next() {
        Some(latest) => format!(
            "{what}, last hour: {} {unit} at the last minute recorded, at most {} {unit}",
            format_value(*latest),
            format_value(max)
        ),
        None => format!("{what}, last hour: nothing recorded"),
    };
    let height = SPARK_LINE_HEIGHT;
    // Two pixels in from each side, so that a point at either end is drawn whole.
    let x = |i: usize| 2.0 + i as f64 * (SPARK_WIDTH - 4.0) / (n - 1.0);
    let y = |v: f64| height - 1.0 - if max > 0.0 { v / max * (height - 2.0) } else { 0.0 };
    html! {
        svg.spark.spark-line data-chart=(what) width=(SPARK_WIDTH) height=(height)
            viewBox=(format!("0 0 {SPARK_WIDTH} {height}")) role="img" aria-label=(summary) {
            title { (summary) }
            line.base x1="0" y1=(height - 0.5) x2=(SPARK_WIDTH) y2=(height - 0.5) {}
            @for run in runs(values) {
                @if let [(i, v)] = run.as_slice() {
                    circle.point cx=(format!("{:.1}", x(*i))) cy=(format!("{:.1}", y(*v))) r="1.5" {}
                } @else {
                    polyline.series points=(run.iter().map(|(i, v)| format!("{:.1},{:.1}", x(*i), y(*v))).collect::<Vec<_>>().join(" ")) {}
                }
            }
        }
    }
}

/// The height of a line sparkline, in pixels.
const SPARK_LINE_HEIGHT: f64 = 16.0;

/// Runs of consecutive minutes with a value, each drawn as one polyline.
fn runs(values: &[Option<f64>]) -> Vec<Vec<(usize, f64)>> {
    let mut runs: Vec<Vec<(usize, f64)>> = Vec::new();
    for (i, v) in values.iter().enumerate() {
        match (v, runs.last_mut()) {
            (Some(v), Some(run)) if run.last().is_some_and(|(j, _)| *j + 1 == i) => run.push((i, *v)),
            (Some(v), _) => runs.push(vec![(i, *v)]),
            (None, _) => {}
        }
    }
    runs
}

/// The time axis under a drawing: an hour ago on the left, now on the right.
fn axis(first: &str, last: &str) -> Markup {
    html! {
        line.axis x1="0" y1=(HEIGHT) x2=(WIDTH) y2=(HEIGHT) {}
        text.tick x="0" y=(HEIGHT + AXIS - 3.0) { (first) }
        text.tick x=(WIDTH) y=(HEIGHT + AXIS - 3.0) text-anchor="end" { (last) }
    }
}

/// The scale's label: the largest value drawn, at the top left.
fn scale(max: f64, unit: &str) -> Markup {
    html! { text.scale x="2" y="14" { "max " (format_value(max)) " " (unit) } }
}

fn format_value(v: f64) -> String {
    if v >= 100.0 || v.fract() == 0.0 { format!("{v:.0}") } else { format!("{v:.1}") }
}

/// Stacked bars, `done` under `failed` under `expired`, one per minute.
fn bars(done: &[f64], failed: &[f64], expired: &[f64], label: &dyn Fn(usize) -> String) -> Markup {
    let n = done.len().max(1) as f64;
    let max = (0..done.len()).map(|i| done[i] + failed[i] + expired[i]).fold(0.0, f64::max);
    // At least one unit high, so that a minute of one job beside a busy one still shows, and can be hovered.
    let y = |v: f64| if max > 0.0 && v > 0.0 { (v / max * (HEIGHT - 20.0)).max(1.0) } else { 0.0 };
    let slot = WIDTH / n;
    html! {
        svg viewBox=(format!("0 0 {WIDTH} {}", HEIGHT + AXIS)) role="img"
            aria-label=(format!("jobs done, failed and expired per minute over the last hour, at most {}", format_value(max))) {
            @for i in 0..done.len() {
                @let x = i as f64 * slot;
                @let (d, f, e) = (y(done[i]), y(failed[i]), y(expired[i]));
                @if d > 0.0 {
                    rect.done x=(x) y=(HEIGHT - d) width=(slot * 0.8) height=(d) {
                        title { (label(i)) ": " (format_value(done[i])) " done" }
                    }
                }
                @if f > 0.0 {
                    rect.failed x=(x) y=(HEIGHT - d - f) width=(slot * 0.8) height=(f) {
                        title { (label(i)) ": " (format_value(failed[i])) " failed" }
                    }
                }
                @if e > 0.0 {
                    rect.expired x=(x) y=(HEIGHT - d - f - e) width=(slot * 0.8) height=(e) {
                        title { (label(i)) ": " (format_value(expired[i])) " expired" }
                    }
                }
            }
            (scale(max, "jobs/min"))
            (axis(&label(0), &label(done.len().saturating_sub(1))))
        }
    }
}

/// A line through the minutes that have a value (a gap where none was recorded), with a dot on each.
fn line(values: &[Option<f64>], unit: &str, label: &dyn Fn(usize) -> String) -> Markup {
    let n = values.len().max(2) as f64;
    let max = values.iter().flatten().copied().fold(0.0, f64::max);
    let x = |i: usize| i as f64 * WIDTH / (n - 1.0);
    let y = |v: f64| HEIGHT - if max > 0.0 { v / max * (HEIGHT - 20.0) } else { 0.0 };
    let runs = runs(values);
    html! {
        svg viewBox=(format!("0 0 {WIDTH} {}", HEIGHT + AXIS)) role="img"
            aria-label=(format!("{unit} per minute over the last hour, at most {}", format_value(max))) {
            @if runs.is_empty() {
                text.empty x=(WIDTH / 2.0) y=(HEIGHT / 2.0) text-anchor="middle" { "nothing recorded in the last hour" }
            }
            @for run in &runs {
                polyline.series points=(run.iter().map(|(i, v)| format!("{:.1},{:.1}", x(*i), y(*v))).collect::<Vec<_>>().join(" ")) {}
                @for (i, v) in run {
                    circle.point cx=(format!("{:.1}", x(*i))) cy=(format!("{:.1}", y(*v))) r="2" {
                        title { (label(*i)) ": " (format_value(*v)) " " (unit) }
                    }
                }
            }
            (scale(max, unit))
            (axis(&label(0), &label(values.len().saturating_sub(1))))
        }
    }
}
