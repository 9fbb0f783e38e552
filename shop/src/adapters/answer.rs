//! How an external system's HTTP answer is read, the same way for every adapter: a success; a failure worth retrying
//! (no answer, a 5xx, a 429, with the `Retry-After` it gave); or a refusal (any other 4xx), described by its status and
//! the answer's short `code`, never by its message, which could echo what was sent.

use std::time::Duration;

use serde::Deserialize;

/// Why a call did not succeed.
#[derive(Debug)]
pub(crate) enum Failure {
    /// Worth retrying: no answer, a 5xx or a 429; `retry_after` when the answer said when.
    Unavailable {
        /// What happened, safe to log.
        reason: String,
        /// The answer's `Retry-After`, in seconds (capped at a day).
        retry_after: Option<Duration>,
    },
    /// Retrying will not help: `HTTP 422 Unprocessable Entity (CODE)`.
    Refused(String),
}

impl From<reqwest::Error> for Failure {
    fn from(e: reqwest::Error) -> Self {
        // Without the URL: it names the system, and errors are shown to clients redacted anyway.
        Self::Unavailable { reason: e.without_url().to_string(), retry_after: None }
    }
}

/// The error body a system may send with a 4xx: only its `code` is kept, and only when it looks like one.
#[derive(Deserialize)]
struct RefusalBody {
    code: Option<String>,
}

/// The seconds of a `Retry-After` header (the HTTP-date form is not used by the systems Conveyor talks to).
fn retry_after(response: &reqwest::Response) -> Option<Duration> {
    let secs = response.headers().get(reqwest::header::RETRY_AFTER)?.to_str().ok()?.trim().parse::<u64>().ok()?;
    Some(Duration::from_secs(secs.min(24 * 3600)))
}

/// The answer to a sent request: the response when it succeeded, else why not.
pub(crate) async fn read(sent: Result<reqwest::Response, reqwest::Error>) -> Result<reqwest::Response, Failure> {
    let response = sent?;
    let status = response.status();
    if status.is_success() {
        return Ok(response);
    }
    if status.is_server_error() || status.as_u16() == 429 {
        return Err(Failure::Unavailable { reason: format!("HTTP {status}"), retry_after: retry_after(&response) });
    }
    let code = response.json::<RefusalBody>().await.ok().and_then(|b| b.code).filter(|c| {
        (1..=64).contains(&c.len()) && c.bytes().all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
    });
    Err(Failure::Refused(match code {
        Some(code) => format!("HTTP {status} ({code})"),
        None => format!("HTTP {status}"),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;
    use axum::response::IntoResponse;

    async fn answer_of(
        status: StatusCode,
        headers: &'static [(&'static str, &'static str)],
        body: &'static str,
    ) -> Result<u16, Failure> {
        let app = axum::Router::new().route(
            "/",
            axum::routing::get(move || async move {
                let mut response = (status, body).into_response();
                for (name, value) in headers {
                    response.headers_mut().insert(*name, value.parse().unwrap());
                }
                response
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        read(reqwest::get(url).await).await.map(|r| r.status().as_u16())
    }

    #[tokio::test]
    async fn answers_are_sorted_into_success_retry_and_refusal() {
        assert_eq!(answer_of(StatusCode::OK, &[], "{}").await.unwrap(), 200);
        match answer_of(StatusCode::TOO_MANY_REQUESTS, &[("retry-after", "7")], "").await {
            Err(Failure::Unavailable { retry_after, .. }) => assert_eq!(retry_after, Some(Duration::from_secs(7))),
            other => panic!("{other:?}"),
        }
        match answer_of(StatusCode::SERVICE_UNAVAILABLE, &[("retry-after", "Wed, 21 Oct 2015 07:28:00 GMT")], "").await
        {
            Err(Failure::Unavailable { retry_after, .. }) => assert_eq!(retry_after, None),
            other => panic!("{other:?}"),
        }
        match answer_of(StatusCode::UNPROCESSABLE_ENTITY, &[], r#"{"code": "PRODUCT_REFUSED", "message": "secret"}"#)
            .await
        {
            Err(Failure::Refused(reason)) => assert_eq!(reason, "HTTP 422 Unprocessable Entity (PRODUCT_REFUSED)"),
            other => panic!("{other:?}"),
        }
        match answer_of(StatusCode::BAD_REQUEST, &[], r#"{"code": "echo of what was sent: api_key=abc"}"#).await {
            Err(Failure::Refused(reason)) => assert_eq!(reason, "HTTP 400 Bad Request"),
            other => panic!("{other:?}"),
        }
        let nowhere = read(reqwest::get("http://127.0.0.1:9/").await).await;
        assert!(matches!(nowhere, Err(Failure::Unavailable { .. })), "{nowhere:?}");
    }
}
