//! The AI provider that runs text, category and image tasks. Like a payment API it bills per request and honours an
//! idempotency key: Conveyor sends the task's operation id, so a job that runs twice (a time-out, a crash, a double
//! delivery) is answered the first result and billed once.
//!
//! Over HTTP: `POST {base}/v1/ai/generate` with `Idempotency-Key` and `{"kind", "input"}`, answered
//! `{"id", "charge_id"?, "output": {…}}`; `429`/`503` may carry `Retry-After` (seconds).
//!
//! Errors say whether the call may have run (and so been charged): only a call that never reached the provider (no
//! connection), a `429` and a refusal (another 4xx) surely did not; a time-out, a `5xx` or an unreadable success may
//! have.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// What a task asks the provider for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AiKind {
    /// A text from a prompt (a title, a description).
    Text,
    /// A product category for a title (and description).
    Category,
    /// An image from a prompt.
    Image,
}

impl AiKind {
    /// Every kind.
    pub const ALL: [AiKind; 3] = [AiKind::Text, AiKind::Category, AiKind::Image];

    /// The name clients and the provider use.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Text => "text",
            Self::Category => "category",
            Self::Image => "image",
        }
    }

    /// The kind named `name`, if any.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.as_str() == name)
    }
}

/// The provider's answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AiResult {
    /// The provider's id of the generation.
    pub id: String,
    /// The provider's id of its charge, when it says.
    #[serde(default)]
    pub charge_id: Option<String>,
    /// What it generated (kind-specific JSON object).
    pub output: serde_json::Value,
}

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum AiError {
    /// Worth retrying soon; the call may have run: time-out, a connection lost after sending, a 5xx.
    #[error("AI provider unavailable: {0}")]
    Transient(String),
    /// Worth retrying, not before `after`; the call may have run (a `5xx` with `Retry-After`).
    #[error("AI provider asks to retry later: {reason}")]
    RetryAfter {
        /// What it answered.
        reason: String,
        /// Its `Retry-After`.
        after: Duration,
    },
    /// Worth retrying (not before `after`, if given); the call surely did not run: no connection was made, or the
    /// provider answered `429`.
    #[error("AI provider did not run the request: {reason}")]
    NotRun {
        /// What happened.
        reason: String,
        /// Its `Retry-After`, if it answered one.
        after: Option<Duration>,
    },
    /// Retrying will not help, and the call did not run: a 4xx other than 429.
    #[error("AI provider refused the request: {0}")]
    Refused(String),
    /// Retrying will not help, but the call may have run: a success whose answer cannot be read.
    #[error("AI provider answered unreadably: {0}")]
    Malformed(String),
}

impl AiError {
    /// Whether the failed call may have run on the provider (and been charged).
    pub fn may_have_run(&self) -> bool {
        matches!(self, Self::Transient(_) | Self::RetryAfter { .. } | Self::Malformed(_))
    }
}

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// An AI provider.
pub trait AiProvider: Send + Sync + 'static {
    /// Runs a task of `kind` on `input`; `token` makes repeats of one logical call a single generation and charge
    /// (a repeat answers the first result).
    fn generate<'a>(
        &'a self,
        token: &'a str,
        kind: AiKind,
        input: &'a serde_json::Value,
    ) -> BoxFuture<'a, Result<AiResult, AiError>>;
}

/// An AI provider over HTTP (https through rustls), with a per-call time-out.
pub struct HttpAiProvider {
    base: String,
    http: reqwest::Client,
}

impl HttpAiProvider {
    /// A client of the provider at `base` that also trusts the PEM certificates of `ca_file`
    /// (`CONVEYOR_TLS_CA_FILE`); every call gives up after `timeout`.
    pub fn new(base: &str, timeout: Duration, ca_file: Option<&std::path::Path>) -> Result<Self, super::tls::TlsError> {
        let http = super::tls::client_builder(ca_file)?.timeout(timeout).build().expect("an HTTP client builds");
        Ok(Self { base: base.trim_end_matches('/').to_owned(), http })
    }
}

impl AiError {
    /// The error of a failed call; `not_run` when the call surely did not run (no connection made, or a `429`).
    fn of_failure(failure: super::answer::Failure, not_run: bool) -> Self {
        match failure {
            super::answer::Failure::Unavailable { reason, retry_after } if not_run => {
                Self::NotRun { reason, after: retry_after }
            }
            super::answer::Failure::Unavailable { reason, retry_after: Some(after) } => {
                Self::RetryAfter { reason, after }
            }
            super::answer::Failure::Unavailable { reason, retry_after: None } => Self::Transient(reason),
            super::answer::Failure::Refused(reason) => Self::Refused(reason),
        }
    }
}

impl AiProvider for HttpAiProvider {
    fn generate<'a>(
        &'a self,
        token: &'a str,
        kind: AiKind,
        input: &'a serde_json::Value,
    ) -> BoxFuture<'a, Result<AiResult, AiError>> {
        Box::pin(async move {
            let sent = self
                .http
                .post(format!("{}/v1/ai/generate", self.base))
                .header("idempotency-key", token)
                .json(&serde_json::json!({ "kind": kind, "input": input }))
                .send()
                .await;
            let not_run = match &sent {
                Err(e) => e.is_connect(),
                Ok(response) => response.status() == reqwest::StatusCode::TOO_MANY_REQUESTS,
            };
            let response = super::answer::read(sent).await.map_err(|f| AiError::of_failure(f, not_run))?;
            // A body cut short may still mean a charge was made: worth a retry, which the token answers with it.
            let body = response.bytes().await.map_err(|e| AiError::Transient(e.without_url().to_string()))?;
            let result: AiResult =
                serde_json::from_slice(&body).map_err(|_| AiError::Malformed("malformed answer".into()))?;
            let id_ok = |id: &str| (1..=200).contains(&id.len());
            if !id_ok(&result.id)
                || result.charge_id.as_deref().is_some_and(|c| !id_ok(c))
                || !result.output.is_object()
            {
                return Err(AiError::Malformed("malformed answer".into()));
            }
            Ok(result)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_round_trip_through_their_names() {
        for kind in AiKind::ALL {
            assert_eq!(AiKind::parse(kind.as_str()), Some(kind));
            assert_eq!(serde_json::to_value(kind).unwrap(), kind.as_str());
        }
        assert_eq!(AiKind::parse("video"), None);
    }

    #[test]
    fn only_calls_the_provider_surely_did_not_run_count_as_not_run() {
        use super::super::answer::Failure;
        let unavailable = |retry_after| Failure::Unavailable { reason: "HTTP 503".into(), retry_after };
        assert!(AiError::of_failure(unavailable(None), false).may_have_run(), "a 5xx or a time-out may have run");
        let after = Some(Duration::from_secs(5));
        assert!(AiError::of_failure(unavailable(after), false).may_have_run());
        let not_run = AiError::of_failure(unavailable(after), true);
        assert!(matches!(not_run, AiError::NotRun { after: Some(_), .. }) && !not_run.may_have_run(), "a 429");
        assert!(!AiError::of_failure(Failure::Refused("HTTP 422".into()), false).may_have_run());
        assert!(AiError::Malformed("malformed answer".into()).may_have_run(), "a success that could not be read");
    }
}
