//! Query parameters of the admin API, read by name: an unknown or repeated parameter, or a value of the wrong shape,
//! is a 400 naming the parameter. An empty value counts as absent (what an HTML form sends for an empty field).

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::problem::ApiError;
use crate::JobStatus;

/// The query parameters of one request.
pub(super) struct Params(Vec<(String, String)>);

fn bad(parameter: &'static str, detail: impl Into<String>) -> ApiError {
    ApiError::BadParameter { parameter, detail: detail.into() }
}

impl Params {
    /// `pairs`, when each names one of `allowed` at most once.
    pub(super) fn new(pairs: Vec<(String, String)>, allowed: &[&'static str]) -> Result<Self, ApiError> {
        for (i, (name, _)) in pairs.iter().enumerate() {
            let Some(known) = allowed.iter().find(|a| **a == name) else {
                let names = allowed.join(", ");
                return Err(ApiError::Invalid(format!(
                    "unknown query parameter `{name}` (this endpoint takes {})",
                    if names.is_empty() { "none" } else { &names }
                )));
            };
            if pairs[..i].iter().any(|(n, _)| n == name) {
                return Err(bad(known, "given more than once"));
            }
        }
        Ok(Self(pairs))
    }

    fn raw(&self, name: &str) -> Option<&str> {
        self.0.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str()).filter(|v| !v.is_empty())
    }

    /// A text value.
    pub(super) fn text(&self, name: &'static str) -> Option<String> {
        self.raw(name).map(str::to_owned)
    }

    /// A UUID.
    pub(super) fn uuid(&self, name: &'static str) -> Result<Option<Uuid>, ApiError> {
        self.raw(name).map(|v| v.parse().map_err(|_| bad(name, format!("`{v}` is not a UUID")))).transpose()
    }

    /// An RFC 3339 time.
    pub(super) fn time(&self, name: &'static str) -> Result<Option<DateTime<Utc>>, ApiError> {
        self.raw(name)
            .map(|v| {
                DateTime::parse_from_rfc3339(v)
                    .map(|t| t.with_timezone(&Utc))
                    .map_err(|_| bad(name, format!("`{v}` is not an RFC 3339 time (e.g. 2026-01-31T08:00:00Z)")))
            })
            .transpose()
    }

    /// A whole number of 1 to 500.
    pub(super) fn limit(&self, name: &'static str) -> Result<Option<u32>, ApiError> {
        self.raw(name)
            .map(|v| match v.parse::<u32>() {
                Ok(n) if (1..=500).contains(&n) => Ok(n),
                _ => Err(bad(name, format!("`{v}` is not a whole number of 1 to 500"))),
            })
            .transpose()
    }

    /// A job state.
    pub(super) fn status(&self, name: &'static str) -> Result<Option<JobStatus>, ApiError> {
        self.raw(name)
            .map(|v| {
                let states = "scheduled, queued, retrying, active, succeeded, failed, canceled";
                JobStatus::from_name(v).ok_or_else(|| bad(name, format!("`{v}` is not a job state ({states})")))
            })
            .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(query: &[(&str, &str)], allowed: &[&'static str]) -> Result<Params, ApiError> {
        Params::new(query.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(), allowed)
    }

    #[test]
    fn values_of_the_wrong_shape_name_their_parameter() {
        let p = params(
            &[("before", "x"), ("since", "yesterday"), ("limit", "0"), ("status", "dead")],
            &["before", "since", "limit", "status"],
        )
        .unwrap();
        for (got, name) in [
            (p.uuid("before").map(|_| ()), "before"),
            (p.time("since").map(|_| ()), "since"),
            (p.limit("limit").map(|_| ()), "limit"),
            (p.status("status").map(|_| ()), "status"),
        ] {
            match got {
                Err(ApiError::BadParameter { parameter, .. }) => assert_eq!(parameter, name),
                other => panic!("{name}: {other:?}"),
            }
        }
    }

    #[test]
    fn unknown_repeated_and_empty_parameters() {
        assert!(matches!(params(&[("color", "red")], &["queue"]), Err(ApiError::Invalid(_))));
        assert!(matches!(
            params(&[("queue", "a"), ("queue", "b")], &["queue"]),
            Err(ApiError::BadParameter { parameter: "queue", .. })
        ));
        let p = params(&[("queue", ""), ("limit", "")], &["queue", "limit"]).unwrap();
        assert_eq!(p.text("queue"), None);
        assert_eq!(p.limit("limit").unwrap(), None);
        let p = params(&[("since", "2026-01-31T08:00:00+01:00"), ("status", "failed")], &["since", "status"]).unwrap();
        assert_eq!(p.time("since").unwrap().unwrap().to_rfc3339(), "2026-01-31T07:00:00+00:00");
        assert_eq!(p.status("status").unwrap(), Some(JobStatus::Failed));
    }
}
