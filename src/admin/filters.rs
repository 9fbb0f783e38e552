//! Checks of what an operator asks for, before any query: page sizes, names, time ranges, states. Each refusal names
//! the field that was wrong.

use chrono::{DateTime, Utc};

use super::{Actor, AdminError, DeadLetterFilter, JobFilter, OperationFilter};
use crate::kind;
use crate::outbox::control::JobStatus;

/// Largest page (and bulk action).
pub(super) const MAX_LIMIT: u32 = 500;

/// Page size of a search when none is given.
pub(super) const DEFAULT_PAGE: u32 = 50;

/// The statuses an operation can have.
pub(super) const OPERATION_STATUSES: [&str; 5] = ["queued", "running", "succeeded", "failed", "canceled"];

/// `limit`, or `default`, checked to be 1 to [`MAX_LIMIT`].
pub(super) fn limit(limit: Option<u32>, default: u32) -> Result<i32, AdminError> {
    let limit = limit.unwrap_or(default);
    if !(1..=MAX_LIMIT).contains(&limit) {
        return Err(AdminError::Invalid(format!("limit must be 1 to {MAX_LIMIT}, not {limit}")));
    }
    Ok(limit as i32)
}

/// The actor, checked to be 1 to 200 characters (the audit trail's bound).
pub(super) fn actor(actor: &Actor) -> Result<&str, AdminError> {
    let n = actor.0.chars().count();
    if !(1..=200).contains(&n) {
        return Err(AdminError::Invalid(format!("the actor must be 1 to 200 characters, not {n}")));
    }
    Ok(&actor.0)
}

/// Refuses a queue name no job can have.
pub(super) fn queue(name: Option<&str>) -> Result<(), AdminError> {
    match name {
        Some(q) if !kind::valid_queue_name(q) => Err(AdminError::Invalid(format!(
            "queue: `{q}` is not a queue name (1 to 100 lower-case letters, digits and _ . -)"
        ))),
        _ => Ok(()),
    }
}

/// Refuses a kind name no job can have.
pub(super) fn kind(name: Option<&str>) -> Result<(), AdminError> {
    match name {
        Some(k) if !kind::valid_kind_name(k) => Err(AdminError::Invalid(format!(
            "kind: `{k}` is not a job kind name (1 to 100 lower-case letters, digits and _ . : -)"
        ))),
        _ => Ok(()),
    }
}

/// Refuses a schedule name no schedule can have.
pub(super) fn schedule_name(name: &str) -> Result<(), AdminError> {
    if kind::valid_kind_name(name) {
        Ok(())
    } else {
        Err(AdminError::Invalid(format!(
            "name: `{name}` is not a schedule name (1 to 100 lower-case letters, digits and _ . : -)"
        )))
    }
}

/// Refuses a range that ends before it starts.
fn range(since: Option<DateTime<Utc>>, until: Option<DateTime<Utc>>) -> Result<(), AdminError> {
    match (since, until) {
        (Some(s), Some(u)) if s >= u => {
            Err(AdminError::Invalid(format!("since ({}) must be before until ({})", s.to_rfc3339(), u.to_rfc3339())))
        }
        _ => Ok(()),
    }
}

/// A job state as the SQL functions name it (`conveyor_job_state`).
pub(super) fn state_name(status: JobStatus) -> &'static str {
    status.as_str()
}

/// The [`JobStatus`] a SQL function named.
pub(super) fn parse_state(name: &str) -> Result<JobStatus, sqlx::Error> {
    JobStatus::from_name(name).ok_or_else(|| sqlx::Error::Decode(format!("unknown job state `{name}`").into()))
}

/// Checks a job search; returns its page size.
pub(super) fn jobs(filter: &JobFilter) -> Result<i32, AdminError> {
    queue(filter.queue.as_deref())?;
    kind(filter.kind.as_deref())?;
    range(filter.since, filter.until)?;
    limit(filter.limit, DEFAULT_PAGE)
}

/// Checks an operation search; returns its page size.
pub(super) fn operations(filter: &OperationFilter) -> Result<i32, AdminError> {
    kind(filter.kind.as_deref())?;
    if let Some(status) = filter.status.as_deref()
        && !OPERATION_STATUSES.contains(&status)
    {
        return Err(AdminError::Invalid(format!(
            "status: `{status}` is not an operation status ({})",
            OPERATION_STATUSES.join(", ")
        )));
    }
    range(filter.since, filter.until)?;
    limit(filter.limit, DEFAULT_PAGE)
}

/// Checks a dead-letter search (`bulk`: for a bulk replay or discard, which takes no cursor, needs a filter or `all`,
/// and defaults to the largest batch); returns its page size.
pub(super) fn dead_letters(filter: &DeadLetterFilter, bulk: bool) -> Result<i32, AdminError> {
    queue(filter.queue.as_deref())?;
    kind(filter.kind.as_deref())?;
    range(filter.since, filter.until)?;
    if bulk && filter.before.is_some() {
        return Err(AdminError::Invalid(
            "before: a bulk replay or discard takes every match up to its limit, not a page".to_owned(),
        ));
    }
    let limit = limit(filter.limit, if bulk { MAX_LIMIT } else { DEFAULT_PAGE })?;
    let filtered = filter.queue.is_some()
        || filter.kind.is_some()
        || filter.workspace.is_some()
        || filter.since.is_some()
        || filter.until.is_some();
    if bulk && !filtered && !filter.all {
        return Err(AdminError::Invalid(
            "all: a bulk replay or discard needs a filter (queue, kind, workspace, since, until), or \"all\": true \
             to take every dead letter of every workspace"
                .to_owned(),
        ));
    }
    Ok(limit)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_outside_one_to_five_hundred_are_refused_by_name() {
        assert_eq!(limit(None, 50).unwrap(), 50);
        assert_eq!(limit(Some(500), 50).unwrap(), 500);
        for bad in [0, 501] {
            let e = limit(Some(bad), 50).unwrap_err().to_string();
            assert!(e.starts_with("limit must be 1 to 500"), "{e}");
        }
    }

    #[test]
    fn names_ranges_and_statuses_are_checked_before_any_query() {
        let bad_queue = JobFilter { queue: Some("a}b".into()), ..JobFilter::default() };
        assert!(jobs(&bad_queue).unwrap_err().to_string().starts_with("queue:"));
        let bad_kind = DeadLetterFilter { kind: Some("Upper".into()), ..DeadLetterFilter::default() };
        assert!(dead_letters(&bad_kind, false).unwrap_err().to_string().starts_with("kind:"));
        let now = Utc::now();
        let backwards = OperationFilter { since: Some(now), until: Some(now), ..OperationFilter::default() };
        assert!(operations(&backwards).unwrap_err().to_string().contains("must be before until"));
        let status = OperationFilter { status: Some("done".into()), ..OperationFilter::default() };
        assert!(operations(&status).unwrap_err().to_string().starts_with("status:"));
        let cursor = DeadLetterFilter { before: Some(uuid::Uuid::nil()), ..DeadLetterFilter::default() };
        assert!(dead_letters(&cursor, false).is_ok());
        assert!(dead_letters(&cursor, true).unwrap_err().to_string().starts_with("before:"));
        // A bulk action with no filter is refused unless it says `all`.
        let e = dead_letters(&DeadLetterFilter::default(), true).unwrap_err().to_string();
        assert!(e.starts_with("all: a bulk replay or discard needs a filter"), "{e}");
        assert_eq!(dead_letters(&DeadLetterFilter { all: true, ..DeadLetterFilter::default() }, true).unwrap(), 500);
        let until = DeadLetterFilter { until: Some(now), limit: Some(10), ..DeadLetterFilter::default() };
        assert_eq!(dead_letters(&until, true).unwrap(), 10);
        assert!(dead_letters(&DeadLetterFilter::default(), false).is_ok(), "a search needs no filter");
        assert!(actor(&Actor(String::new())).is_err());
        assert!(schedule_name("nightly-report").is_ok() && schedule_name("Nightly").is_err());
    }

    #[test]
    fn every_state_round_trips_through_its_sql_name() {
        for status in [
            JobStatus::Scheduled,
            JobStatus::Queued,
            JobStatus::Retrying,
            JobStatus::Active,
            JobStatus::Succeeded,
            JobStatus::Failed,
            JobStatus::Canceled,
        ] {
            assert_eq!(parse_state(state_name(status)).unwrap(), status);
            assert_eq!(serde_json::to_value(status).unwrap(), state_name(status));
        }
        assert!(parse_state("dead").is_err());
    }
}
