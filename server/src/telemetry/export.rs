//! The span exporter: OTLP over HTTP with protobuf bodies (`POST {endpoint}/v1/traces`), batched on a thread of its
//! own, configured by the standard OpenTelemetry variables:
//!
//! - `OTEL_EXPORTER_OTLP_ENDPOINT` (the collector's base URL, e.g. `http://otel-collector:4318`) or
//!   `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (the full URL of traces): traces are off when neither is set;
//! - `OTEL_SERVICE_NAME` (default `conveyor-<role>`), `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_EXPORTER_OTLP_HEADERS`,
//!   `OTEL_EXPORTER_OTLP_TIMEOUT` (ms, default 10000), `OTEL_TRACES_SAMPLER` / `_ARG` (default: parent-based,
//!   always on), `OTEL_BSP_SCHEDULE_DELAY` and the other batch settings;
//! - `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` turn traces off; `OTEL_EXPORTER_OTLP_PROTOCOL` may only
//!   be `http/protobuf` (no gRPC in this build).

use conveyor_jobs::redact;
use std::io::Read;
use std::time::Duration;

use anyhow::{Context, bail};
use opentelemetry::KeyValue;
use opentelemetry_http::{Bytes, HttpClient, HttpError, Request, Response};
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;

use crate::config::Source;

/// The collector's base URL; traces go to `{it}/v1/traces`.
pub const ENDPOINT: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";
/// The full URL traces are posted to (wins over [`ENDPOINT`]).
pub const TRACES_ENDPOINT: &str = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT";

/// Where and as what spans are exported.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OtlpSettings {
    /// The URL spans are posted to, `/v1/traces` included.
    pub traces_url: url::Url,
    /// `service.name` of this process's spans.
    pub service_name: String,
    /// How long one export may take.
    pub timeout: Duration,
}

impl OtlpSettings {
    /// Reads the OpenTelemetry variables of `source`: `Ok(None)` when traces are off (no endpoint, or disabled),
    /// an error naming the variable when one is invalid. `default_service` is the `service.name` without
    /// `OTEL_SERVICE_NAME`.
    pub fn from_source(source: &impl Source, default_service: &str) -> anyhow::Result<Option<Self>> {
        if source.get("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true")) {
            return Ok(None);
        }
        match source.get("OTEL_TRACES_EXPORTER").map(|v| v.trim().to_ascii_lowercase()).as_deref() {
            None | Some("otlp") => {}
            Some("none") => return Ok(None),
            Some(other) => bail!("OTEL_TRACES_EXPORTER must be `otlp` or `none`, not `{}`", redact(other)),
        }
        let (variable, url) = match (source.get(TRACES_ENDPOINT), source.get(ENDPOINT)) {
            (Some(url), _) => (TRACES_ENDPOINT, url.trim().to_owned()),
            (None, Some(base)) => (ENDPOINT, format!("{}/v1/traces", base.trim().trim_end_matches('/'))),
            (None, None) => return Ok(None),
        };
        let traces_url = url::Url::parse(&url)
            .map_err(|e| anyhow::anyhow!("{variable} is not a valid URL (`{}`): {e}", redact(&url)))?;
        if !matches!(traces_url.scheme(), "http" | "https") || traces_url.host_str().is_none_or(str::is_empty) {
            bail!("{variable} must be an http:// or https:// URL with a host (OTLP over HTTP), not `{}`", redact(&url));
        }
        for protocol in ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"] {
            if let Some(value) = source.get(protocol).filter(|v| v.trim() != "http/protobuf") {
                bail!(
                    "{protocol} must be `http/protobuf` (the only OTLP transport of this build), not `{}`",
                    redact(&value)
                );
            }
        }
        let timeout = match ["OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT"]
            .into_iter()
            .find_map(|name| source.get(name).map(|value| (name, value)))
        {
            None => Duration::from_secs(10),
            Some((name, value)) => match value.trim().parse::<u64>() {
                Ok(ms) if ms > 0 => Duration::from_millis(ms),
                _ => bail!("{name} must be a positive number of milliseconds, not `{}`", redact(&value)),
            },
        };
        let service_name = source.get("OTEL_SERVICE_NAME").unwrap_or_else(|| default_service.to_owned());
        Ok(Some(Self { traces_url, service_name, timeout }))
    }
}

/// The tracer provider exporting to `settings` through a batch processor (its own thread; `OTEL_BSP_*` apply).
pub fn provider(settings: &OtlpSettings) -> anyhow::Result<SdkTracerProvider> {
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(BlockingHttp::new(settings.timeout)?)
        .with_endpoint(settings.traces_url.as_str())
        .with_timeout(settings.timeout)
        .build()
        .context("Failed to build the OTLP span exporter")?;
    let resource = Resource::builder()
        .with_service_name(settings.service_name.clone())
        .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
        .with_attribute(KeyValue::new("service.instance.id", conveyor_jobs::instance_name()))
        .build();
    Ok(SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource).build())
}

/// Answers larger than this are refused (an OTLP answer is a few bytes).
const MAX_ANSWER_BYTES: u64 = 4 * 1024 * 1024;

/// The exporter's HTTP client: the crate's reqwest, blocking, as the batch processor calls it on its own thread with
/// no async runtime. (opentelemetry-otlp's own client would bring a second reqwest.)
#[derive(Debug)]
struct BlockingHttp(reqwest::blocking::Client);

impl BlockingHttp {
    fn new(timeout: Duration) -> anyhow::Result<Self> {
        // A blocking client starts a runtime of its own, which cannot be done from inside one: built on a thread.
        std::thread::spawn(move || reqwest::blocking::Client::builder().timeout(timeout).build())
            .join()
            .map_err(|_| anyhow::anyhow!("building the OTLP HTTP client panicked"))?
            .map(Self)
            .context("Failed to build the OTLP HTTP client")
    }
}

#[async_trait::async_trait]
impl HttpClient for BlockingHttp {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let (parts, body) = request.into_parts();
        let request = reqwest::blocking::Request::try_from(Request::from_parts(parts, body.to_vec()))?;
        let mut response = self.0.execute(request)?;
        let status = response.status();
        let headers = std::mem::take(response.headers_mut());
        let mut body = Vec::new();
        response.take(MAX_ANSWER_BYTES + 1).read_to_end(&mut body)?;
        if body.len() as u64 > MAX_ANSWER_BYTES {
            return Err("the OTLP collector's answer is larger than 4 MiB".into());
        }
        let mut answer = Response::builder().status(status).body(Bytes::from(body))?;
        *answer.headers_mut() = headers;
        Ok(answer)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn read(vars: &[(&str, &str)]) -> anyhow::Result<Option<OtlpSettings>> {
        let source: HashMap<String, String> = vars.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        OtlpSettings::from_source(&source, "conveyor-api")
    }

    #[test]
    fn traces_are_off_without_an_endpoint_or_when_disabled() {
        assert_eq!(read(&[]).unwrap(), None);
        assert_eq!(read(&[(ENDPOINT, "http://c:4318"), ("OTEL_SDK_DISABLED", "true")]).unwrap(), None);
        assert_eq!(read(&[(ENDPOINT, "http://c:4318"), ("OTEL_TRACES_EXPORTER", "none")]).unwrap(), None);
    }

    #[test]
    fn the_base_endpoint_gets_the_traces_path_and_the_service_its_default() {
        let settings = read(&[(ENDPOINT, "http://collector:4318/")]).unwrap().unwrap();
        assert_eq!(settings.traces_url.as_str(), "http://collector:4318/v1/traces");
        assert_eq!(settings.service_name, "conveyor-api");
        assert_eq!(settings.timeout, Duration::from_secs(10));
        let settings = read(&[
            (ENDPOINT, "http://ignored:4318"),
            (TRACES_ENDPOINT, "https://collector/otlp/traces"),
            ("OTEL_SERVICE_NAME", "shop-api"),
            ("OTEL_EXPORTER_OTLP_TIMEOUT", "2500"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(settings.traces_url.as_str(), "https://collector/otlp/traces");
        assert_eq!(settings.service_name, "shop-api");
        assert_eq!(settings.timeout, Duration::from_millis(2500));
    }

    #[test]
    fn an_invalid_setting_is_an_error_naming_its_variable() {
        for (vars, named) in [
            (vec![(ENDPOINT, "collector:4318")], ENDPOINT),
            (vec![(ENDPOINT, "not a url")], ENDPOINT),
            (vec![(TRACES_ENDPOINT, "grpc://collector:4317")], TRACES_ENDPOINT),
            (vec![(ENDPOINT, "http://c:4318"), ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")], "OTEL_EXPORTER_OTLP_PROTOCOL"),
            (vec![(ENDPOINT, "http://c:4318"), ("OTEL_EXPORTER_OTLP_TIMEOUT", "soon")], "OTEL_EXPORTER_OTLP_TIMEOUT"),
            (vec![(ENDPOINT, "http://c:4318"), ("OTEL_TRACES_EXPORTER", "jaeger")], "OTEL_TRACES_EXPORTER"),
        ] {
            let error = read(&vars).unwrap_err().to_string();
            assert!(error.contains(named), "{error}");
        }
        let error = read(&[(ENDPOINT, "http://user:hunter2@:4318")]).unwrap_err().to_string();
        assert!(!error.contains("hunter2"), "{error}");
    }
}
