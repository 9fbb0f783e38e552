//! `conveyor config check`: every variable a role reads, validated at once (not only the first bad one), and the
//! effective configuration with secrets redacted.
//!
//! Each variable is validated by the real parsers, alone: over a baseline where every other variable is valid, so
//! one bad value cannot hide another. Then the whole environment is parsed once more for the rules that tie
//! variables together (a keep-alive shorter than the reconcile delay, a de-dup TTL of four leases, ...).

use std::collections::HashMap;

use super::variables::{self, VARIABLES, Variable};
use super::{Config, ConfigError, Source};

/// What the check found.
#[derive(Debug, Default)]
pub struct Report {
    /// Every problem, one line each, naming its variable.
    pub errors: Vec<String>,
    /// Every variable the role reads: name, the value in force (redacted for secrets), and where it comes from.
    pub effective: Vec<(&'static str, String, &'static str)>,
}

impl Report {
    /// Whether the configuration is usable.
    pub fn is_ok(&self) -> bool {
        self.errors.is_empty()
    }
}

/// Valid values of the required variables, so that one variable can be validated alone.
const BASELINE: &[(&str, &str)] = &[
    ("CONVEYOR_DATABASE_URL", "postgres://app@127.0.0.1/conveyor"),
    ("CONVEYOR_MIGRATION_DATABASE_URL", "postgres://owner@127.0.0.1/conveyor"),
    ("CONVEYOR_RUNTIME_DATABASE_URL", "postgres://runtime@127.0.0.1/conveyor"),
    ("CONVEYOR_REDIS_URL", "redis://127.0.0.1:6379"),
    ("CONVEYOR_JWT_SECRET", "baseline-jwt-secret-of-32-bytes-or-more"),
    ("CONVEYOR_IDEMPOTENCY_KEYS", "k1:baseline-fingerprint-key-of-32-bytes"),
    ("CONVEYOR_ENCRYPTION_KEY", "YmFzZWxpbmUtZW5jcnlwdGlvbi1rZXktMzItYnl0ZXM="),
];

fn parse(role: u8, src: &dyn Source) -> Result<(), ConfigError> {
    if role == variables::MIGRATE {
        return super::migrate_config(src).map(drop);
    }
    if role == variables::OPERATOR {
        super::database_url(src)?;
        super::redis(src)?;
        return super::operator_database_url(src).map(drop);
    }
    Config::from_source(src).map(drop)
}

/// `value` with the user and password of a URL (`scheme://user:password@host`) replaced by `[redacted]`: a URL that is
/// not a secret as a whole may still carry one.
fn without_userinfo(value: &str) -> String {
    let Some(scheme_end) = value.find("://") else { return value.to_owned() };
    let rest = &value[scheme_end + 3..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => format!("{}[redacted]{}", &value[..scheme_end + 3], &rest[at..]),
        None => value.to_owned(),
    }
}

/// Checks the variables `role` (a constant of [`variables`]) reads from `src`.
pub fn check(src: &dyn Source, role: u8) -> Report {
    let mut report = Report::default();
    let read: Vec<&Variable> = VARIABLES.iter().filter(|v| v.roles & role != 0).collect();
    let baseline: HashMap<String, String> = BASELINE.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
    for v in &read {
        match src.get(v.name) {
            None if v.required & role != 0 => report.errors.push(ConfigError::Missing(v.name).to_string()),
            None => {}
            Some(value) => {
                let mut alone = baseline.clone();
                alone.insert(v.name.to_owned(), value);
                if let Err(e) = parse(role, &alone)
                    && e.variable() == v.name
                {
                    report.errors.push(e.to_string());
                }
            }
        }
        let (shown, origin) = match (src.get(v.name), v.default) {
            (Some(_), _) if v.secret => ("[redacted]".to_owned(), "set"),
            (Some(value), _) => (without_userinfo(&value), "set"),
            (None, Some(default)) => (default.to_owned(), "default"),
            (None, None) => (String::new(), "unset"),
        };
        report.effective.push((v.name, shown, origin));
    }
    if report.errors.is_empty()
        && let Err(e) = parse(role, src)
    {
        report.errors.push(e.to_string());
    }
    report
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::variables::{API, MIGRATE, WORKER};

    fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        let mut map: HashMap<String, String> =
            BASELINE.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        map.extend(pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
        map
    }

    #[test]
    fn every_bad_variable_is_reported_not_only_the_first() {
        let src = env(&[
            ("CONVEYOR_WORKER_CONCURRENCY", "many"),
            ("CONVEYOR_JOB_TIMEOUT", "soon"),
            ("CONVEYOR_REDIS_URL", "http://redis"),
            ("CONVEYOR_JWT_SECRET", "short"),
        ]);
        let report = check(&src, WORKER);
        let joined = report.errors.join("\n");
        for name in ["CONVEYOR_WORKER_CONCURRENCY", "CONVEYOR_JOB_TIMEOUT", "CONVEYOR_REDIS_URL"] {
            assert!(joined.contains(name), "{name} missing from:\n{joined}");
        }
        // The worker verifies no token: it does not read the tenants' JWT secret, so it says nothing of it.
        assert_eq!(report.errors.len(), 3, "{joined}");
        let api = check(&src, API).errors.join("\n");
        assert!(api.contains("CONVEYOR_JWT_SECRET") && api.contains("CONVEYOR_REDIS_URL"), "{api}");
    }

    #[test]
    fn secrets_are_redacted_and_defaults_shown() {
        let src = env(&[("CONVEYOR_HTTP_ADDR", "0.0.0.0:8081")]);
        let report = check(&src, API);
        assert!(report.is_ok(), "{:?}", report.errors);
        let get = |name: &str| report.effective.iter().find(|(n, ..)| *n == name).cloned().unwrap();
        assert_eq!(get("CONVEYOR_JWT_SECRET").1, "[redacted]");
        assert_eq!(get("CONVEYOR_DATABASE_URL").1, "[redacted]", "URLs carry passwords");
        assert_eq!(get("CONVEYOR_HTTP_ADDR"), ("CONVEYOR_HTTP_ADDR", "0.0.0.0:8081".to_owned(), "set"));
        assert_eq!(get("CONVEYOR_MAX_BODY_BYTES"), ("CONVEYOR_MAX_BODY_BYTES", "65536".to_owned(), "default"));
        let printed = format!("{:?}", report.effective);
        assert!(!printed.contains("baseline-jwt-secret"), "{printed}");
        // A URL that is not a secret as a whole loses its user and password.
        let src = env(&[("CONVEYOR_AI_PROVIDER_URL", "https://key:hunter2@ai.example/v1?x=a@b")]);
        let report = check(&src, WORKER);
        let shown = report.effective.iter().find(|(n, ..)| *n == "CONVEYOR_AI_PROVIDER_URL").unwrap().1.clone();
        assert_eq!(shown, "https://[redacted]@ai.example/v1?x=a@b");
        assert_eq!(without_userinfo("s3://bucket/prefix"), "s3://bucket/prefix");
        assert_eq!(without_userinfo("not a url"), "not a url");
    }

    #[test]
    fn the_operator_commands_need_a_valid_redis_url_too() {
        let src = env(&[("CONVEYOR_REDIS_URL", "http://redis")]);
        let report = check(&src, crate::config::variables::OPERATOR);
        assert!(report.errors.iter().any(|e| e.contains("CONVEYOR_REDIS_URL")), "{:?}", report.errors);
    }

    #[test]
    fn missing_required_variables_and_rules_between_variables_are_reported() {
        let report = check(&HashMap::new(), MIGRATE);
        assert_eq!(report.errors.len(), 3, "{:?}", report.errors);
        let src = env(&[("CONVEYOR_OPERATION_KEEPALIVE", "10m"), ("CONVEYOR_RECONCILE_AFTER", "5m")]);
        let report = check(&src, WORKER);
        assert!(report.errors.iter().any(|e| e.contains("CONVEYOR_RECONCILE_AFTER")), "{:?}", report.errors);
    }
}
