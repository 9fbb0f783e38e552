//! The marketplace a store sells on. Real marketplaces honour an idempotency token on writes; Conveyor sends the
//! operation id as that token, so a job that runs twice produces one effect.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tracing::{Instrument, Span};

/// What verifying credentials found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Verification {
    /// The marketplace accepted them.
    Valid,
    /// The marketplace refused them.
    Invalid,
}

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum MarketplaceError {
    /// Worth retrying: time-out, connection failure, 5xx, 429 without `Retry-After`.
    #[error("marketplace unavailable: {0}")]
    Transient(String),
    /// Worth retrying, not before `after` (a `429` or `5xx` with `Retry-After`).
    #[error("marketplace asks to retry later: {reason}")]
    RetryAfter {
        /// What it answered.
        reason: String,
        /// Its `Retry-After`.
        after: Duration,
    },
    /// Retrying will not help: 4xx other than 429, malformed answer.
    #[error("marketplace refused the request: {0}")]
    Permanent(String),
}

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A marketplace API.
pub trait Marketplace: Send + Sync + 'static {
    /// Checks `credentials`; `token` makes repeats of one logical call a single effect.
    fn verify_credentials<'a>(
        &'a self,
        token: &'a str,
        credentials: &'a BTreeMap<String, String>,
    ) -> BoxFuture<'a, Result<Verification, MarketplaceError>>;

    /// Creates `product` in the store that `credentials` open; `token` makes repeats of one logical call a single
    /// product (a repeat answers the product the first call made).
    fn create_product<'a>(
        &'a self,
        token: &'a str,
        credentials: &'a BTreeMap<String, String>,
        product: &'a NewProduct,
    ) -> BoxFuture<'a, Result<CreatedProduct, MarketplaceError>>;
}

/// A product to create on a marketplace: what a listing publishes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NewProduct {
    /// Title.
    pub title: String,
    /// Description.
    pub description: String,
    /// Price: an exact decimal string (`"12.50"`) in `currency`.
    pub price_amount: String,
    /// ISO 4217 code.
    pub currency: String,
    /// Conveyor's ids of the product's images, in order.
    pub media_ids: Vec<uuid::Uuid>,
}

/// A product the marketplace made (or had made for the same token).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreatedProduct {
    /// The marketplace's id of the product.
    pub id: String,
}

/// A marketplace over HTTP (`POST {base}/v1/credentials/verify`, `POST {base}/v1/products`, with `Idempotency-Key`).
///
/// Redirects are never followed: every request's body carries the store's credentials, and a `307`/`308` would have
/// them re-sent to wherever its `Location` points. A `3xx` answer is a permanent error, never a success nor a retry.
pub struct HttpMarketplace {
    base: String,
    http: reqwest::Client,
}

impl HttpMarketplace {
    /// A client of the marketplace at `base`, with a per-call time-out.
    pub fn new(base: &str, timeout: Duration) -> Self {
        Self::trusting(base, timeout, None).expect("a client without extra roots builds")
    }

    /// A client that also trusts the PEM certificates of `ca_file` (`CONVEYOR_TLS_CA_FILE`); https goes through rustls.
    pub fn trusting(
        base: &str,
        timeout: Duration,
        ca_file: Option<&std::path::Path>,
    ) -> Result<Self, super::tls::TlsError> {
        let http = super::tls::client_builder(ca_file)?.timeout(timeout).build().expect("an HTTP client builds");
        Ok(Self { base: base.trim_end_matches('/').to_owned(), http })
    }
}

#[derive(Deserialize)]
struct VerifyAnswer {
    valid: bool,
}

impl From<super::answer::Failure> for MarketplaceError {
    fn from(failure: super::answer::Failure) -> Self {
        match failure {
            super::answer::Failure::Unavailable { reason, retry_after: Some(after) } => {
                Self::RetryAfter { reason, after }
            }
            super::answer::Failure::Unavailable { reason, retry_after: None } => Self::Transient(reason),
            super::answer::Failure::Refused(reason) => Self::Permanent(reason),
        }
    }
}

/// The answer to a marketplace call, read as every adapter reads one, except that a redirect (never followed) is a
/// permanent error: retrying would meet the same redirect, and following it would re-send the credentials elsewhere.
/// Its `Location` is not repeated (it may name an internal host or carry a token).
async fn read_answer(sent: reqwest::Result<reqwest::Response>) -> Result<reqwest::Response, MarketplaceError> {
    if let Ok(response) = &sent
        && response.status().is_redirection()
    {
        return Err(MarketplaceError::Permanent(format!(
            "HTTP {}: the marketplace redirected the call, and redirects are not followed (they would re-send the \
             store's credentials elsewhere)",
            response.status()
        )));
    }
    Ok(super::answer::read(sent).await?)
}

/// The span of one marketplace call (a client span, a child of the running job's); none while traces are off.
fn call_span(operation: &'static str, path: &'static str) -> Span {
    if !conveyor_jobs::trace_exporting() {
        return Span::none();
    }
    tracing::info_span!(
        "marketplace.call",
        otel.name = operation,
        otel.kind = "client",
        otel.status_code = tracing::field::Empty,
        http.request.method = "POST",
        url.path = path,
        http.response.status_code = tracing::field::Empty,
    )
}

/// Sends `request` in `span`, with a `traceparent` header naming the span (and the `tracestate` it carries on) when
/// traces are exported, and records the answer's status on it.
async fn send_traced(request: reqwest::RequestBuilder, span: Span) -> reqwest::Result<reqwest::Response> {
    let request = match conveyor_jobs::traceparent_of(&span) {
        Some(traceparent) => match conveyor_jobs::tracestate_of(&span) {
            Some(state) => request.header("traceparent", traceparent).header("tracestate", state),
            None => request.header("traceparent", traceparent),
        },
        None => request,
    };
    let sent = request.send().instrument(span.clone()).await;
    match &sent {
        Ok(response) => {
            span.record("http.response.status_code", response.status().as_u16());
            if !response.status().is_success() {
                span.record("otel.status_code", "ERROR");
            }
        }
        Err(_) => {
            span.record("otel.status_code", "ERROR");
        }
    }
    sent
}

impl Marketplace for HttpMarketplace {
    fn verify_credentials<'a>(
        &'a self,
        token: &'a str,
        credentials: &'a BTreeMap<String, String>,
    ) -> BoxFuture<'a, Result<Verification, MarketplaceError>> {
        Box::pin(async move {
            let request = self
                .http
                .post(format!("{}/v1/credentials/verify", self.base))
                .header("idempotency-key", token)
                .json(&serde_json::json!({ "credentials": credentials }));
            let sent =
                send_traced(request, call_span("marketplace.verify_credentials", "/v1/credentials/verify")).await;
            let response = read_answer(sent).await?;
            let answer: VerifyAnswer =
                response.json().await.map_err(|_| MarketplaceError::Permanent("malformed answer".into()))?;
            Ok(if answer.valid { Verification::Valid } else { Verification::Invalid })
        })
    }

    fn create_product<'a>(
        &'a self,
        token: &'a str,
        credentials: &'a BTreeMap<String, String>,
        product: &'a NewProduct,
    ) -> BoxFuture<'a, Result<CreatedProduct, MarketplaceError>> {
        Box::pin(async move {
            let request = self
                .http
                .post(format!("{}/v1/products", self.base))
                .header("idempotency-key", token)
                .json(&serde_json::json!({ "credentials": credentials, "product": product }));
            let sent = send_traced(request, call_span("marketplace.create_product", "/v1/products")).await;
            let response = read_answer(sent).await?;
            // A body cut short may still mean a product was made: worth a retry, which the token answers with it.
            let body = response.bytes().await.map_err(|e| MarketplaceError::Transient(e.without_url().to_string()))?;
            let created: CreatedProduct =
                serde_json::from_slice(&body).map_err(|_| MarketplaceError::Permanent("malformed answer".into()))?;
            if created.id.is_empty() || created.id.len() > 200 {
                return Err(MarketplaceError::Permanent("malformed answer: product id".into()));
            }
            Ok(created)
        })
    }
}
