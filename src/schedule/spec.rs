//! When a schedule ticks: a cron expression read in an IANA time zone, or a fixed period.

use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use chrono_tz::Tz;
use croner::Cron;
use croner::parser::{CronParser, Seconds, Year};

use super::ScheduleError;

/// The shortest period of [`ScheduleSpec::every`].
pub(super) const MIN_EVERY: Duration = Duration::from_secs(1);

/// The longest period of [`ScheduleSpec::every`] (366 days).
pub(super) const MAX_EVERY: Duration = Duration::from_secs(366 * 86_400);

/// When a schedule ticks. Built checked: a spec that exists is valid.
///
/// ```
/// use std::time::Duration;
/// use conveyor_jobs::ScheduleSpec;
///
/// // At minute 0 of every hour from 9 to 17, Monday to Friday, Paris time (summer time handled).
/// let business_hours = ScheduleSpec::cron("0 9-17 * * 1-5", "Europe/Paris")?;
/// // Every 30 seconds (6 fields: the first is the second).
/// let often = ScheduleSpec::cron("*/30 * * * * *", "UTC")?;
/// let every_five_minutes = ScheduleSpec::every(Duration::from_secs(300))?;
/// # Ok::<(), conveyor_jobs::ScheduleError>(())
/// ```
#[derive(Clone, Debug)]
pub struct ScheduleSpec(Spec);

#[derive(Clone, Debug)]
enum Spec {
    Cron { expression: String, zone: Tz, cron: Box<Cron> },
    Every(Duration),
}

impl PartialEq for ScheduleSpec {
    fn eq(&self, other: &Self) -> bool {
        match (&self.0, &other.0) {
            (Spec::Cron { expression: a, zone: za, .. }, Spec::Cron { expression: b, zone: zb, .. }) => {
                a == b && za == zb
            }
            (Spec::Every(a), Spec::Every(b)) => a == b,
            _ => false,
        }
    }
}

impl ScheduleSpec {
    /// A cron expression of 5 fields (minute hour day-of-month month day-of-week) or 6 (a leading second), with
    /// the usual ranges, steps, lists, names (`MON`, `JAN`), `L`, `#`, `W` and aliases (`@hourly`, `@daily`), read in
    /// the IANA time zone `time_zone` (`"Europe/Paris"`, `"UTC"`).
    ///
    /// Daylight saving time: a tick whose local time does not exist (the hour skipped in spring) fires at the first
    /// instant after the gap; a local time that happens twice (the hour repeated in autumn) fires once, at its first
    /// occurrence. Errors: [`ScheduleError::BadCron`] (including an expression that never matches),
    /// [`ScheduleError::UnknownTimeZone`].
    pub fn cron(expression: &str, time_zone: &str) -> Result<Self, ScheduleError> {
        let zone: Tz = time_zone.parse().map_err(|_| ScheduleError::UnknownTimeZone(time_zone.to_owned()))?;
        let bad = |detail: String| ScheduleError::BadCron { expression: expression.to_owned(), detail };
        if expression.trim().is_empty() || expression.len() > 200 {
            return Err(bad("it must be 1 to 200 characters".to_owned()));
        }
        let cron = CronParser::builder()
            .seconds(Seconds::Optional)
            .year(Year::Disallowed)
            .build()
            .parse(expression)
            .map_err(|e| bad(e.to_string()))?;
        let spec = Self(Spec::Cron { expression: expression.trim().to_owned(), zone, cron: Box::new(cron) });
        // An expression that parses but never matches (the 30th of February) is refused here, not at its first tick.
        spec.next_after(Utc::now()).ok_or_else(|| bad("it never matches".to_owned()))?;
        Ok(spec)
    }

    /// Every `period` (1 s to 366 days, whole milliseconds), counted from when the schedule is set: ticks at set time
    /// + period, + 2 × period, and so on. Error: [`ScheduleError::BadEvery`].
    pub fn every(period: Duration) -> Result<Self, ScheduleError> {
        if period < MIN_EVERY || period > MAX_EVERY || !period.subsec_nanos().is_multiple_of(1_000_000) {
            return Err(ScheduleError::BadEvery(period));
        }
        Ok(Self(Spec::Every(period)))
    }

    /// The cron expression and time zone name, if a cron spec.
    pub fn cron_expression(&self) -> Option<(&str, &str)> {
        match &self.0 {
            Spec::Cron { expression, zone, .. } => Some((expression, zone.name())),
            Spec::Every(_) => None,
        }
    }

    /// The period, if an every-N spec.
    pub fn period(&self) -> Option<Duration> {
        match &self.0 {
            Spec::Every(period) => Some(*period),
            Spec::Cron { .. } => None,
        }
    }

    /// The first tick strictly after `at`; `None` when there is none (a cron expression that no longer matches).
    pub fn next_after(&self, at: DateTime<Utc>) -> Option<DateTime<Utc>> {
        match &self.0 {
            Spec::Cron { zone, cron, .. } => {
                let local = zone.from_utc_datetime(&at.naive_utc());
                cron.find_next_occurrence(&local, false).ok().map(|t| t.with_timezone(&Utc))
            }
            Spec::Every(period) => Some(at + chrono::Duration::from_std(*period).ok()?),
        }
    }

    /// The tick to fire when `now` has reached the stored next tick `due`, and the tick after it: the most recent
    /// tick at or before `now` (once for all ticks missed while nothing fired), then the first tick after `now`.
    pub(crate) fn catch_up(&self, due: DateTime<Utc>, now: DateTime<Utc>) -> Option<(DateTime<Utc>, DateTime<Utc>)> {
        if now < due {
            return None;
        }
        let tick = match &self.0 {
            Spec::Every(period) => {
                let period_ms = i64::try_from(period.as_millis()).ok()?;
                let missed = (now - due).num_milliseconds() / period_ms;
                due + chrono::Duration::milliseconds(missed * period_ms)
            }
            Spec::Cron { zone, cron, .. } => {
                let local = zone.from_utc_datetime(&now.naive_utc());
                let latest = cron.find_previous_occurrence(&local, true).ok().map(|t| t.with_timezone(&Utc));
                // The stored tick is one of the expression's, unless the spec changed under it: never earlier.
                latest.map_or(due, |l| l.max(due))
            }
        };
        let next = match &self.0 {
            Spec::Every(period) => tick + chrono::Duration::from_std(*period).ok()?,
            Spec::Cron { .. } => self.next_after(now)?,
        };
        Some((tick, next))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn utc(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
    }

    #[test]
    fn a_cron_in_paris_ticks_at_paris_time_across_both_daylight_saving_changes() {
        let nine = ScheduleSpec::cron("0 9 * * *", "Europe/Paris").unwrap();
        // Winter (UTC+1): 09:00 Paris is 08:00 UTC.
        assert_eq!(nine.next_after(utc("2026-03-27T12:00:00Z")), Some(utc("2026-03-28T08:00:00Z")));
        // Summer time starts on 29 March 2026 (02:00 → 03:00): 09:00 Paris is 07:00 UTC that very day.
        assert_eq!(nine.next_after(utc("2026-03-28T12:00:00Z")), Some(utc("2026-03-29T07:00:00Z")));
        // It ends on 25 October 2026 (03:00 → 02:00): back to 08:00 UTC.
        assert_eq!(nine.next_after(utc("2026-10-24T12:00:00Z")), Some(utc("2026-10-25T08:00:00Z")));
    }

    #[test]
    fn a_tick_in_the_skipped_hour_fires_after_the_gap_and_a_repeated_hour_fires_once() {
        let half_past_two = ScheduleSpec::cron("30 2 * * *", "Europe/Paris").unwrap();
        // 02:30 does not exist on 29 March 2026 in Paris: the first instant after the gap, 03:00 CEST (01:00 UTC).
        assert_eq!(half_past_two.next_after(utc("2026-03-28T12:00:00Z")), Some(utc("2026-03-29T01:00:00Z")));
        // 02:30 happens twice on 25 October 2026: once, at the first (02:30 CEST, 00:30 UTC), then the next day.
        let first = half_past_two.next_after(utc("2026-10-24T12:00:00Z")).unwrap();
        assert_eq!(first, utc("2026-10-25T00:30:00Z"));
        assert_eq!(half_past_two.next_after(first), Some(utc("2026-10-26T01:30:00Z")));
    }

    #[test]
    fn six_fields_count_seconds_and_five_count_minutes() {
        let every_ten_seconds = ScheduleSpec::cron("*/10 * * * * *", "UTC").unwrap();
        assert_eq!(every_ten_seconds.next_after(utc("2026-01-01T00:00:01Z")), Some(utc("2026-01-01T00:00:10Z")));
        let every_five_minutes = ScheduleSpec::cron("*/5 * * * *", "UTC").unwrap();
        assert_eq!(every_five_minutes.next_after(utc("2026-01-01T00:00:01Z")), Some(utc("2026-01-01T00:05:00Z")));
    }

    #[test]
    fn bad_specs_are_refused_by_kind() {
        assert!(matches!(ScheduleSpec::cron("not a cron", "UTC"), Err(ScheduleError::BadCron { .. })));
        assert!(matches!(ScheduleSpec::cron("* * * * * * *", "UTC"), Err(ScheduleError::BadCron { .. })));
        assert!(matches!(ScheduleSpec::cron("0 0 30 2 *", "UTC"), Err(ScheduleError::BadCron { .. })));
        assert!(matches!(ScheduleSpec::cron("* * * * *", "Mars/Olympus"), Err(ScheduleError::UnknownTimeZone(_))));
        assert!(matches!(ScheduleSpec::every(Duration::ZERO), Err(ScheduleError::BadEvery(_))));
        assert!(matches!(ScheduleSpec::every(Duration::from_micros(1_500_500)), Err(ScheduleError::BadEvery(_))));
        assert!(ScheduleSpec::every(Duration::from_secs(1)).is_ok());
    }

    #[test]
    fn catching_up_fires_the_latest_missed_tick_once_then_the_next_future_one() {
        let minute = ScheduleSpec::every(Duration::from_secs(60)).unwrap();
        let due = utc("2026-01-01T00:00:00Z");
        let (tick, next) = minute.catch_up(due, utc("2026-01-01T00:05:30Z")).unwrap();
        assert_eq!((tick, next), (utc("2026-01-01T00:05:00Z"), utc("2026-01-01T00:06:00Z")));
        assert_eq!(minute.catch_up(due, utc("2025-12-31T23:59:59Z")), None, "not due yet");
        let cron = ScheduleSpec::cron("0 * * * *", "Europe/Paris").unwrap();
        let (tick, next) = cron.catch_up(utc("2026-01-01T00:00:00Z"), utc("2026-01-01T05:10:00Z")).unwrap();
        assert_eq!((tick, next), (utc("2026-01-01T05:00:00Z"), utc("2026-01-01T06:00:00Z")));
        // Exactly on a tick: that tick.
        let (tick, _) = cron.catch_up(utc("2026-01-01T05:00:00Z"), utc("2026-01-01T05:00:00Z")).unwrap();
        assert_eq!(tick, utc("2026-01-01T05:00:00Z"));
    }
}
