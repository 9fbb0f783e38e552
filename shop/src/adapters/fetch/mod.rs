//! SSRF-safe, resumable downloads of source files (asset transfers).
//!
//! In brief:
//! - **Which URLs.** `http`/`https` only, no userinfo, at most [`MAX_URL_LEN`] bytes ([`check_source_url`]). A host
//!   given as a literal address (however the URL spells it: `2130706433`, `0177.0.0.1` and `[::ffff:7f00:1]` are
//!   normalized by the URL parser first) is checked against the [`AddressPolicy`] before any request. The port
//!   (explicit, or the scheme's) must be 80 or 443, or one `CONVEYOR_ASSET_ALLOWED_PORTS` lists, whatever the host.
//! - **Which addresses.** A name is resolved by our own [`Resolver`] inside reqwest's connector, and the name is
//!   refused if any of its addresses is refused; reqwest then connects only to those checked addresses (no second
//!   lookup an attacker's DNS could answer differently). No proxy is used.
//! - **Redirects** are followed by hand (reqwest's policy is `none`), at most [`MAX_REDIRECTS`]; every hop's URL is
//!   checked again like the first (scheme, address and port), and its name resolved and checked again on connect.
//! - **Limits.** Connect and read time-outs, a size cap on `Content-Length` and on the running count, and a
//!   content-type allow-list ([`CONTENT_TYPES`]). A run of a download has a deadline (`CONVEYOR_ASSET_MAX_DURATION`)
//!   and a minimum throughput (`CONVEYOR_ASSET_MIN_THROUGHPUT` bytes a second, averaged over each window of
//!   `CONVEYOR_ASSET_THROUGHPUT_WINDOW` after a first window of grace): a source past either is `SOURCE_TOO_SLOW`
//!   ([`FetchError::TooSlow`], [`FetchError::DeadlineExceeded`]), checked by a timer, whether bytes arrive or not.
//! - **Resumable.** Bytes are handed to a [`PartSink`] in parts of `part_size` as they arrive, and the [`Progress`]
//!   (bytes and parts stored, total, validator) is what a later run resumes from: it asks for `Range: bytes=<done>-`
//!   with `If-Range: <validator>`, only when the source gave a validator (a strong `ETag`, else `Last-Modified`);
//!   without one it asks for the whole file again. A `206` continues only when its validator, start and total are
//!   those stored; any other `206`, or a `200` (the source changed, or ignores ranges), starts over cleanly. A connection dropped mid-body is resumed at once, a bounded number of times without progress.

mod policy;
mod resolver;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use reqwest::StatusCode;
use reqwest::header::{self, HeaderMap};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use url::{Host, Url};

pub use policy::{AddressPolicy, DEFAULT_PORTS, PortRefused, Refusal, default_refusal};
pub use resolver::{ForbiddenAddress, Resolver, Resolving, SystemResolver};

/// Longest accepted source URL, in bytes.
pub const MAX_URL_LEN: usize = 2048;

/// Most redirects followed.
pub const MAX_REDIRECTS: u32 = 5;

/// Media types a source may answer with (parameters ignored).
pub const CONTENT_TYPES: &[&str] = &["image/png", "image/jpeg", "image/webp", "image/gif"];

/// Default size of a stored part: what a crash can cost at most, re-downloaded.
pub const DEFAULT_PART_SIZE: usize = 256 * 1024;

/// How a [`Fetcher`] downloads.
#[derive(Clone, Debug)]
pub struct FetchSettings {
    /// Longest wait for a connection (`CONVEYOR_ASSET_CONNECT_TIMEOUT`).
    pub connect_timeout: Duration,
    /// Longest wait for the next bytes (`CONVEYOR_ASSET_READ_TIMEOUT`).
    pub read_timeout: Duration,
    /// Longest run of a download, from its start to its last byte stored (`CONVEYOR_ASSET_MAX_DURATION`): past it
    /// the run fails with [`FetchError::DeadlineExceeded`].
    pub max_duration: Duration,
    /// Fewest bytes a second a download must average over each [`FetchSettings::throughput_window`] after the first
    /// (`CONVEYOR_ASSET_MIN_THROUGHPUT`; 0: not checked): under it the run fails with [`FetchError::TooSlow`].
    pub min_throughput: u64,
    /// The window over which the throughput is averaged, and the grace at a run's start before the first window
    /// (`CONVEYOR_ASSET_THROUGHPUT_WINDOW`).
    pub throughput_window: Duration,
    /// Largest file (`CONVEYOR_ASSET_MAX_BYTES`).
    pub max_bytes: u64,
    /// Bytes per stored part.
    pub part_size: usize,
    /// Dropped connections resumed at once, in a row without a part stored in between, before giving up.
    pub max_resumes: u32,
    /// Networks opened despite the default refusals (`CONVEYOR_ASSET_ALLOWED_NETWORKS`).
    pub allowed_networks: Vec<ipnet::IpNet>,
    /// Ports allowed besides 80 and 443 (`CONVEYOR_ASSET_ALLOWED_PORTS`).
    pub allowed_ports: Vec<u16>,
    /// A private CA to trust besides the web roots (`CONVEYOR_TLS_CA_FILE`).
    pub ca_file: Option<PathBuf>,
}

impl Default for FetchSettings {
    /// The documented defaults: 10 s to connect, 30 s between reads, 10 minutes a run, at least 1 KiB/s over each
    /// 30 s, 100 MiB a file, ports 80 and 443 and public addresses only.
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(10),
            read_timeout: Duration::from_secs(30),
            max_duration: Duration::from_secs(10 * 60),
            min_throughput: 1024,
            throughput_window: Duration::from_secs(30),
            max_bytes: 100 * 1024 * 1024,
            part_size: DEFAULT_PART_SIZE,
            max_resumes: 5,
            allowed_networks: Vec::new(),
            allowed_ports: Vec::new(),
            ca_file: None,
        }
    }
}

/// What a client is told of a refused address found by the worker (a name's resolution, a redirect).
pub const FORBIDDEN_DETAIL: &str = "the source's address is not allowed";

/// What a client is told when storing a download failed.
pub const STORAGE_DETAIL: &str = "storage unavailable";

/// Why a download failed. [`FetchError::code`] is the transfer's error code; [`FetchError::detail`] what clients
/// see.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// Not an acceptable URL (scheme, userinfo, length, no host).
    #[error("{0}")]
    InvalidUrl(String),
    /// The URL, a redirect, or a name's resolution leads to a refused address.
    #[error("{0}")]
    Forbidden(String),
    /// More than [`MAX_REDIRECTS`] redirects.
    #[error("more than {MAX_REDIRECTS} redirects")]
    TooManyRedirects,
    /// The file is larger than the cap.
    #[error("the source is larger than {limit} bytes")]
    TooLarge {
        /// The cap.
        limit: u64,
    },
    /// The source's media type is not allowed.
    #[error("the source's content type `{0}` is not one of image/png, image/jpeg, image/webp, image/gif")]
    UnsupportedContentType(String),
    /// The source refused the request (a 4xx other than 408 and 429): retrying cannot help.
    #[error("the source answered {0}")]
    Rejected(u16),
    /// The source cannot be reached or failed (connection, time-out, 5xx): worth retrying.
    #[error("{0}")]
    Unavailable(String),
    /// Storing the bytes failed (worth retrying), or the sink stopped the download.
    #[error(transparent)]
    Sink(#[from] SinkError),
    /// The source sent fewer than `min` bytes a second over a window (after the grace at the run's start).
    #[error("the source sent {bytes} bytes in {}, less than the minimum of {min} bytes a second", humantime::format_duration(*window))]
    TooSlow {
        /// Bytes received in the window.
        bytes: u64,
        /// The window.
        window: Duration,
        /// The minimum, in bytes a second.
        min: u64,
    },
    /// The run did not store the whole file within its deadline.
    #[error("the source did not send the whole file within the transfer's deadline of {}", humantime::format_duration(*max_duration))]
    DeadlineExceeded {
        /// The deadline, from the run's start.
        max_duration: Duration,
    },
    /// The caller's cancellation token fired.
    #[error("the download was canceled")]
    Canceled,
}

impl FetchError {
    /// The stable code recorded on a failed transfer.
    pub fn code(&self) -> &'static str {
        match self {
            Self::InvalidUrl(_) => "INVALID_SOURCE_URL",
            Self::Forbidden(_) => "SOURCE_FORBIDDEN",
            Self::TooManyRedirects => "TOO_MANY_REDIRECTS",
            Self::TooLarge { .. } => "TOO_LARGE",
            Self::UnsupportedContentType(_) => "UNSUPPORTED_CONTENT_TYPE",
            Self::Rejected(_) | Self::Unavailable(_) => "SOURCE_UNAVAILABLE",
            Self::TooSlow { .. } | Self::DeadlineExceeded { .. } => "SOURCE_TOO_SLOW",
            Self::Sink(SinkError::Canceled) | Self::Canceled => "CANCELED",
            Self::Sink(_) => "STORAGE_UNAVAILABLE",
        }
    }

    /// The text a client sees (a transfer's `error.detail`, its operation's error): a fixed text where the error's own
    /// would reveal internals (the address a name resolves to, a redirect's target, storage or database errors).
    /// The full error is for logs.
    pub fn detail(&self) -> String {
        match self {
            Self::Forbidden(_) => FORBIDDEN_DETAIL.to_owned(),
            Self::Sink(SinkError::Failed(_)) => STORAGE_DETAIL.to_owned(),
            other => other.to_string(),
        }
    }

    /// Whether another run could succeed (a run too slow resumes where it stopped: its caller bounds how often).
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::Unavailable(_) | Self::Sink(SinkError::Failed(_))) || self.is_too_slow()
    }

    /// Whether the source was too slow (`SOURCE_TOO_SLOW`): under the minimum throughput, or past the deadline.
    pub(crate) fn is_too_slow(&self) -> bool {
        matches!(self, Self::TooSlow { .. } | Self::DeadlineExceeded { .. })
    }
}

/// Why a [`PartSink`] could not take a part.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    /// Storage or the database failed: worth retrying.
    #[error("storing the download failed: {0}")]
    Failed(String),
    /// The sink wants no more bytes (its transfer was canceled or ended meanwhile): stop.
    #[error("the transfer was canceled")]
    Canceled,
}

/// Where a download stands: what a later run resumes from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Progress {
    /// Bytes stored, in `parts` parts.
    pub bytes_done: u64,
    /// Parts stored, numbered from 0.
    pub parts: u32,
    /// The file's size, once the source said (or once it ended).
    pub bytes_total: Option<u64>,
    /// The source's media type.
    pub content_type: Option<String>,
    /// The source's strong `ETag`, else its `Last-Modified`: sent as `If-Range` when resuming.
    pub validator: Option<String>,
}

impl Progress {
    /// Whether every byte of a known total is stored.
    pub fn is_complete(&self) -> bool {
        self.bytes_total.is_some_and(|total| total > 0 && total == self.bytes_done)
    }
}

/// Takes a download's parts as they arrive. Both calls must be durable before they return: a later run trusts them.
pub trait PartSink: Send {
    /// A response was accepted: `progress` holds its total, type and validator. `restarted`: the source sends the
    /// file from its start again, `progress` is back at zero, and parts stored earlier are obsolete.
    fn begin(&mut self, progress: &Progress, restarted: bool) -> impl Future<Output = Result<(), SinkError>> + Send;

    /// Stores part `index`; `progress` already counts it.
    fn part(
        &mut self,
        index: u32,
        bytes: Bytes,
        progress: &Progress,
    ) -> impl Future<Output = Result<(), SinkError>> + Send;
}

/// Checks a source URL: `http`/`https`, no userinfo, at most [`MAX_URL_LEN`] bytes, a host, a port (explicit or the
/// scheme's) allowed by `policy`, and a literal address host allowed by `policy`. Names are checked when resolved, on
/// connect.
pub fn check_source_url(raw: &str, policy: &AddressPolicy) -> Result<Url, FetchError> {
    if raw.len() > MAX_URL_LEN {
        return Err(FetchError::InvalidUrl(format!("the source URL must be at most {MAX_URL_LEN} bytes")));
    }
    let url = Url::parse(raw).map_err(|e| FetchError::InvalidUrl(format!("the source URL is not a URL: {e}")))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(FetchError::InvalidUrl(format!(
            "the source URL's scheme must be http or https, not {}",
            url.scheme()
        )));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(FetchError::InvalidUrl("the source URL must not carry a user name or password".into()));
    }
    let Some(host) = url.host() else {
        return Err(FetchError::InvalidUrl("the source URL has no host".into()));
    };
    let port =
        url.port_or_known_default().ok_or_else(|| FetchError::InvalidUrl("the source URL has no port".into()))?;
    policy.check_port(port).map_err(|refused| {
        FetchError::Forbidden(format!("{}:{port} is refused: {refused}", url.host_str().unwrap_or_default()))
    })?;
    let address = match host {
        Host::Domain(_) => return Ok(url),
        Host::Ipv4(v4) => v4.into(),
        Host::Ipv6(v6) => v6.into(),
    };
    policy.check(address).map_err(|refusal| FetchError::Forbidden(format!("{address} is {refusal}")))?;
    Ok(url)
}

/// How one pass (one response) ended, when not with the whole file.
enum Pass {
    /// The connection dropped (or the source restarted): resume at once.
    Dropped(String),
    /// Give up this run.
    Failed(FetchError),
}

impl From<FetchError> for Pass {
    fn from(e: FetchError) -> Self {
        Self::Failed(e)
    }
}

/// Downloads source files under the address policy (cheap to share; one connection pool).
pub struct Fetcher {
    client: reqwest::Client,
    policy: Arc<AddressPolicy>,
    settings: FetchSettings,
}

impl Fetcher {
    /// A fetcher resolving names with `resolver`.
    pub fn new(settings: FetchSettings, resolver: Arc<dyn Resolver>) -> anyhow::Result<Self> {
        let policy = Arc::new(
            AddressPolicy::new(settings.allowed_networks.clone()).with_ports(settings.allowed_ports.iter().copied()),
        );
        let client = crate::adapters::tls::client_builder(settings.ca_file.as_deref())?
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(settings.connect_timeout)
            .read_timeout(settings.read_timeout)
            .dns_resolver(Arc::new(resolver::PolicyResolver { inner: resolver, policy: policy.clone() }))
            .user_agent(concat!("conveyor-asset-transfer/", env!("CARGO_PKG_VERSION")))
            .build()?;
        Ok(Self { client, policy, settings })
    }

    /// Its settings.
    pub fn settings(&self) -> &FetchSettings {
        &self.settings
    }

    /// Downloads `source` into `sink`, continuing from `progress` (zero for a new download), which it keeps up to
    /// date. Returns once every byte is stored (`progress.bytes_total` then set). The run's deadline and throughput
    /// windows count from now.
    pub async fn download<S: PartSink>(
        &self,
        source: &str,
        progress: &mut Progress,
        sink: &mut S,
        cancel: &CancellationToken,
    ) -> Result<(), FetchError> {
        self.download_since(Instant::now().into_std(), source, progress, sink, cancel).await
    }

    /// [`Fetcher::download`] for a run that started at `started`: its deadline
    /// ([`FetchSettings::max_duration`]) and throughput windows count from then (a caller that downloads again in
    /// the same run, after starting over, passes the same instant).
    pub(crate) async fn download_since<S: PartSink>(
        &self,
        started: std::time::Instant,
        source: &str,
        progress: &mut Progress,
        sink: &mut S,
        cancel: &CancellationToken,
    ) -> Result<(), FetchError> {
        let mut pace = Pace::new(Instant::from_std(started), &self.settings);
        let mut resumes = 0;
        loop {
            if progress.is_complete() {
                return Ok(());
            }
            pace.check()?;
            let before = progress.bytes_done;
            match self.pass(source, progress, sink, cancel, &mut pace).await {
                Ok(()) => return Ok(()),
                Err(Pass::Failed(e)) => return Err(e),
                Err(Pass::Dropped(reason)) => {
                    if progress.bytes_done > before {
                        resumes = 0;
                    }
                    if resumes >= self.settings.max_resumes {
                        return Err(FetchError::Unavailable(format!(
                            "{reason} (gave up after {resumes} resumptions without progress)"
                        )));
                    }
                    resumes += 1;
                    tracing::info!(bytes_done = progress.bytes_done, reason, "Download interrupted; resuming");
                }
            }
        }
    }

    /// One response: the request (with its redirects), its checks, and its body into parts.
    async fn pass<S: PartSink>(
        &self,
        source: &str,
        progress: &mut Progress,
        sink: &mut S,
        cancel: &CancellationToken,
        pace: &mut Pace,
    ) -> Result<(), Pass> {
        let response = self.request(source, progress, cancel, pace).await?;
        let resuming = progress.bytes_done > 0;
        let status = response.status();
        let (total, restarted) = match status {
            StatusCode::PARTIAL_CONTENT if resumable(progress) => {
                // The rest of the same file only: the range asked for, the same total, the same validator. Anything
                // else would splice two versions of the file.
                let same_file = validator(response.headers()) == progress.validator;
                match content_range(response.headers()) {
                    Some((start, total))
                        if same_file
                            && start == progress.bytes_done
                            && (progress.bytes_total.is_none() || total == progress.bytes_total) =>
                    {
                        (total, false)
                    }
                    _ => return self.start_over(progress, sink, "the source answered another range or version").await,
                }
            }
            StatusCode::PARTIAL_CONTENT => {
                return self.start_over(progress, sink, "the source answered a range it was not asked for").await;
            }
            StatusCode::OK => (response.content_length(), resuming),
            StatusCode::RANGE_NOT_SATISFIABLE if resuming => {
                return self.start_over(progress, sink, "the source cannot continue the download").await;
            }
            s if s.is_client_error() && s != StatusCode::REQUEST_TIMEOUT && s != StatusCode::TOO_MANY_REQUESTS => {
                return Err(FetchError::Rejected(s.as_u16()).into());
            }
            s => return Err(FetchError::Unavailable(format!("the source answered {s}")).into()),
        };
        let content_type = media_type(response.headers());
        if !CONTENT_TYPES.contains(&content_type.as_str()) {
            return Err(FetchError::UnsupportedContentType(content_type).into());
        }
        let limit = self.settings.max_bytes;
        if total.is_some_and(|t| t > limit) {
            return Err(FetchError::TooLarge { limit }.into());
        }
        if restarted {
            *progress = Progress::default();
        }
        if !resuming || restarted {
            progress.validator = validator(response.headers());
        }
        progress.bytes_total = total;
        progress.content_type = Some(content_type);
        sink.begin(progress, restarted).await.map_err(FetchError::from)?;

        let part_size = self.settings.part_size;
        let mut body = response.bytes_stream();
        let mut buffer = BytesMut::with_capacity(part_size);
        loop {
            let next = tokio::select! {
                biased;
                _ = cancel.cancelled() => return Err(FetchError::Canceled.into()),
                _ = tokio::time::sleep_until(pace.next_check()) => {
                    pace.check()?;
                    continue;
                }
                next = body.next() => next,
            };
            match next {
                None => break,
                Some(Ok(chunk)) => {
                    pace.received(chunk.len());
                    if progress.bytes_done + (buffer.len() + chunk.len()) as u64 > limit {
                        return Err(FetchError::TooLarge { limit }.into());
                    }
                    buffer.extend_from_slice(&chunk);
                    while buffer.len() >= part_size {
                        let part = buffer.split_to(part_size).freeze();
                        store(progress, sink, part).await?;
                    }
                }
                Some(Err(e)) => {
                    // What arrived before the drop is good: keep it.
                    if !buffer.is_empty() {
                        store(progress, sink, buffer.split().freeze()).await?;
                    }
                    return Err(Pass::Dropped(format!("the connection dropped: {}", error_chain(&e.without_url()))));
                }
            }
        }
        if !buffer.is_empty() {
            store(progress, sink, buffer.split().freeze()).await?;
        }
        match progress.bytes_total {
            Some(total) if total != progress.bytes_done => {
                Err(Pass::Dropped(format!("the body ended at {} of {total} bytes", progress.bytes_done)))
            }
            _ => {
                progress.bytes_total = Some(progress.bytes_done);
                Ok(())
            }
        }
    }

    /// Forgets what was stored and has the next pass start from the first byte.
    async fn start_over<S: PartSink>(&self, progress: &mut Progress, sink: &mut S, why: &str) -> Result<(), Pass> {
        *progress = Progress::default();
        sink.begin(progress, true).await.map_err(FetchError::from)?;
        Err(Pass::Dropped(why.to_owned()))
    }

    /// Sends the GET (with `Range` when resuming), following redirects by hand, each hop checked.
    async fn request(
        &self,
        source: &str,
        progress: &Progress,
        cancel: &CancellationToken,
        pace: &mut Pace,
    ) -> Result<reqwest::Response, Pass> {
        let mut url = check_source_url(source, &self.policy)?;
        let mut redirects = 0;
        loop {
            let mut request = self.client.get(url.clone());
            // Without a validator the source cannot tell us whether the file changed since the stored bytes: ask for
            // the whole file (a `200` starts over) rather than risk splicing two versions.
            if resumable(progress) {
                request = request.header(header::RANGE, format!("bytes={}-", progress.bytes_done));
                if let Some(validator) = &progress.validator {
                    request = request.header(header::IF_RANGE, validator);
                }
            }
            let sending = request.send();
            tokio::pin!(sending);
            let response = loop {
                tokio::select! {
                    biased;
                    _ = cancel.cancelled() => return Err(FetchError::Canceled.into()),
                    // Waiting for an answer counts too: no bytes arrive meanwhile.
                    _ = tokio::time::sleep_until(pace.next_check()) => pace.check()?,
                    sent = &mut sending => break sent.map_err(classify)?,
                }
            };
            if !response.status().is_redirection() || response.status() == StatusCode::NOT_MODIFIED {
                return Ok(response);
            }
            redirects += 1;
            if redirects > MAX_REDIRECTS {
                return Err(FetchError::TooManyRedirects.into());
            }
            let location = response
                .headers()
                .get(header::LOCATION)
                .and_then(|v| v.to_str().ok())
                .ok_or_else(|| FetchError::Unavailable("the source redirected without a Location".into()))?;
            let next = url
                .join(location)
                .map_err(|e| FetchError::InvalidUrl(format!("the source redirected to an invalid URL: {e}")))?;
            url = check_source_url(next.as_str(), &self.policy).map_err(|e| match e {
                FetchError::Forbidden(why) => {
                    FetchError::Forbidden(format!("the source redirected to a refused target: {why}"))
                }
                other => other,
            })?;
        }
    }
}

/// A run's clock: its deadline, and the throughput window being counted.
struct Pace {
    deadline: Instant,
    max_duration: Duration,
    /// Bytes a second a window must average; 0: not checked.
    min: u64,
    window: Duration,
    /// Where the window being counted ends; it began one window earlier (the first after a window of grace).
    window_end: Instant,
    /// Bytes received in that window.
    window_bytes: u64,
}

impl Pace {
    /// The clock of a run that started at `started`. A download the run starts again later (after a stored part went
    /// missing) keeps the run's deadline, and counts its first window from now.
    fn new(started: Instant, settings: &FetchSettings) -> Self {
        let window = settings.throughput_window;
        Self {
            deadline: started + settings.max_duration,
            max_duration: settings.max_duration,
            min: settings.min_throughput,
            window,
            window_end: (started + window * 2).max(Instant::now() + window),
            window_bytes: 0,
        }
    }

    /// When [`Pace::check`] is due next: the window's end or the deadline.
    fn next_check(&self) -> Instant {
        if self.min == 0 { self.deadline } else { self.deadline.min(self.window_end) }
    }

    /// Counts `n` bytes received now (nothing during the grace).
    fn received(&mut self, n: usize) {
        if self.min > 0 && Instant::now() + self.window >= self.window_end {
            self.window_bytes += n as u64;
        }
    }

    /// Fails a run past its deadline, or whose window ended with fewer bytes than the minimum; else starts the next
    /// window if this one ended.
    fn check(&mut self) -> Result<(), FetchError> {
        let now = Instant::now();
        if now >= self.deadline {
            return Err(FetchError::DeadlineExceeded { max_duration: self.max_duration });
        }
        if self.min > 0 && now >= self.window_end {
            if u128::from(self.window_bytes) * 1000 < u128::from(self.min) * self.window.as_millis() {
                return Err(FetchError::TooSlow { bytes: self.window_bytes, window: self.window, min: self.min });
            }
            // A check that came late (the sink took its time) starts the next window now.
            self.window_end = now + self.window;
            self.window_bytes = 0;
        }
        Ok(())
    }
}

/// Whether a download may continue with `Range`: bytes are stored and the source gave a validator (a strong `ETag`
/// or `Last-Modified`) for `If-Range` and for checking the `206`.
fn resumable(progress: &Progress) -> bool {
    progress.bytes_done > 0 && progress.validator.is_some()
}

/// Stores one part and counts it.
async fn store<S: PartSink>(progress: &mut Progress, sink: &mut S, part: Bytes) -> Result<(), Pass> {
    let index = progress.parts;
    progress.parts += 1;
    progress.bytes_done += part.len() as u64;
    sink.part(index, part, progress).await.map_err(|e| Pass::Failed(e.into()))
}

/// A request error as a [`FetchError`]: a refused resolution is `Forbidden`, anything else `Unavailable`.
fn classify(e: reqwest::Error) -> Pass {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    while let Some(cause) = source {
        if let Some(forbidden) = cause.downcast_ref::<ForbiddenAddress>() {
            return FetchError::Forbidden(forbidden.to_string()).into();
        }
        source = cause.source();
    }
    let what = if e.is_timeout() {
        "the source timed out"
    } else if e.is_connect() {
        "the source cannot be reached"
    } else {
        "the request failed"
    };
    FetchError::Unavailable(format!("{what}: {}", error_chain(&e.without_url()))).into()
}

/// An error and its causes, on one line.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// `Content-Range: bytes <start>-<end>/<total|*>` as (start, total).
fn content_range(headers: &HeaderMap) -> Option<(u64, Option<u64>)> {
    let value = headers.get(header::CONTENT_RANGE)?.to_str().ok()?;
    let (range, total) = value.strip_prefix("bytes ")?.split_once('/')?;
    let (start, end) = range.split_once('-')?;
    let (start, end): (u64, u64) = (start.trim().parse().ok()?, end.trim().parse().ok()?);
    if end < start {
        return None;
    }
    let total = match total.trim() {
        "*" => None,
        t => Some(t.parse().ok()?),
    };
    Some((start, total))
}

/// The response's media type, lower-cased, without parameters ("" when absent).
fn media_type(headers: &HeaderMap) -> String {
    let raw = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    raw.split(';').next().unwrap_or("").trim().to_ascii_lowercase()
}

/// A strong `ETag`, else `Last-Modified`: what `If-Range` may carry.
fn validator(headers: &HeaderMap) -> Option<String> {
    let etag = headers.get(header::ETAG).and_then(|v| v.to_str().ok()).filter(|e| !e.starts_with("W/"));
    let modified = || headers.get(header::LAST_MODIFIED).and_then(|v| v.to_str().ok());
    etag.or_else(modified).map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn source_urls_are_checked_before_any_request() {
        let policy = AddressPolicy::default();
        assert!(check_source_url("https://cdn.example.com/a.png", &policy).is_ok());
        assert!(check_source_url("http://8.8.8.8/a.png", &policy).is_ok());
        for bad in ["ftp://example.com/a.png", "file:///etc/passwd", "https://user:pw@example.com/a", "not a url"] {
            assert!(matches!(check_source_url(bad, &policy), Err(FetchError::InvalidUrl(_))), "{bad}");
        }
        let long = format!("https://example.com/{}", "a".repeat(MAX_URL_LEN));
        assert!(matches!(check_source_url(&long, &policy), Err(FetchError::InvalidUrl(_))));
        for forbidden in [
            "http://127.0.0.1/",
            "http://2130706433/",
            "http://0177.0.0.1/",
            "http://0x7f.1/",
            "http://0.0.0.0/",
            "http://10.1.2.3/",
            "http://169.254.169.254/latest/meta-data/",
            "http://[::1]/",
            "http://[::ffff:127.0.0.1]/",
            "http://[::ffff:7f00:1]/",
            "http://[fe80::1]/",
            "http://[fd00:ec2::254]/",
            "http://[64:ff9b::a9fe:a9fe]/",
        ] {
            assert!(matches!(check_source_url(forbidden, &policy), Err(FetchError::Forbidden(_))), "{forbidden}");
        }
        let open = AddressPolicy::new(vec!["127.0.0.0/8".parse().unwrap()]).with_ports([8080]);
        assert!(check_source_url("http://127.0.0.1:8080/x", &open).is_ok());
        assert!(check_source_url("http://[::ffff:127.0.0.1]/", &open).is_err());
    }

    #[test]
    fn source_urls_on_ports_other_than_80_and_443_are_refused_unless_allowed() {
        let policy = AddressPolicy::default();
        // The scheme's port, spelled or not.
        for ok in [
            "http://cdn.example.com/a.png",
            "http://cdn.example.com:80/a.png",
            "https://cdn.example.com/a.png",
            "https://cdn.example.com:443/a.png",
            "https://cdn.example.com:0443/a.png",
            "http://cdn.example.com:443/a.png",
            "https://8.8.8.8:80/a.png",
        ] {
            assert!(check_source_url(ok, &policy).is_ok(), "{ok}");
        }
        for (bad, port) in [
            ("http://cdn.example.com:8080/a.png", 8080),
            ("https://cdn.example.com:8443/a.png", 8443),
            ("http://cdn.example.com:22/a.png", 22),
            ("http://cdn.example.com:6379/a.png", 6379),
            ("http://8.8.8.8:25/a.png", 25),
            ("http://[2606:4700:4700::1111]:9090/a.png", 9090),
            ("http://cdn.example.com:0/a.png", 0),
            ("http://cdn.example.com:65535/a.png", 65535),
        ] {
            match check_source_url(bad, &policy) {
                Err(FetchError::Forbidden(why)) => {
                    assert!(why.contains(&format!("port {port} is not allowed (allowed ports: 80, 443)")), "{why}")
                }
                other => panic!("{bad}: {other:?}"),
            }
        }
        assert!(matches!(check_source_url("http://cdn.example.com:65536/a", &policy), Err(FetchError::InvalidUrl(_))));
        // Allowed networks open addresses, not ports; allowed ports open ports, not addresses.
        let loopback = AddressPolicy::new(vec!["127.0.0.0/8".parse().unwrap()]);
        assert!(matches!(check_source_url("http://127.0.0.1:8080/x", &loopback), Err(FetchError::Forbidden(_))));
        assert!(check_source_url("http://127.0.0.1/x", &loopback).is_ok());
        let ports = AddressPolicy::default().with_ports([8080, 8443]);
        assert!(check_source_url("http://cdn.example.com:8080/a.png", &ports).is_ok());
        assert!(check_source_url("https://cdn.example.com:8443/a.png", &ports).is_ok());
        assert!(check_source_url("https://cdn.example.com/a.png", &ports).is_ok(), "the defaults stay");
        assert!(matches!(check_source_url("http://cdn.example.com:9090/a", &ports), Err(FetchError::Forbidden(_))));
        assert!(matches!(check_source_url("http://127.0.0.1:8080/x", &ports), Err(FetchError::Forbidden(_))));
        // A refused port is reported as forbidden to clients, like a refused address.
        let refused = check_source_url("http://cdn.example.com:8080/a.png", &AddressPolicy::default()).unwrap_err();
        assert_eq!((refused.code(), refused.detail().as_str()), ("SOURCE_FORBIDDEN", FORBIDDEN_DETAIL));
    }

    #[test]
    fn client_details_reveal_no_address_nor_storage_error() {
        let forbidden = FetchError::Forbidden("files.internal resolves to 10.0.0.7, a private address".into());
        assert_eq!(forbidden.detail(), FORBIDDEN_DETAIL);
        assert!(forbidden.to_string().contains("10.0.0.7"), "the full text stays for logs");
        let storage = FetchError::Sink(SinkError::Failed("error returned from database: relation \"x\"".into()));
        assert_eq!((storage.code(), storage.detail().as_str()), ("STORAGE_UNAVAILABLE", STORAGE_DETAIL));
        assert_eq!(FetchError::Rejected(404).detail(), "the source answered 404");
    }

    fn pace_settings(max_duration: Duration, min_throughput: u64, throughput_window: Duration) -> FetchSettings {
        FetchSettings { max_duration, min_throughput, throughput_window, ..FetchSettings::default() }
    }

    #[test]
    fn a_run_fails_too_slow_under_the_minimum_or_past_its_deadline_and_a_late_restart_gets_a_fresh_window() {
        let window = Duration::from_secs(10);
        let settings = pace_settings(Duration::from_secs(60), 100, window);
        // A window that ended with fewer bytes than 100 a second: too slow; with enough, the next window starts.
        let mut pace = Pace::new(Instant::now(), &settings);
        pace.window_end = Instant::now();
        pace.window_bytes = 999;
        let slow = pace.check().unwrap_err();
        assert!(matches!(slow, FetchError::TooSlow { bytes: 999, min: 100, .. }), "{slow:?}");
        assert_eq!(slow.code(), "SOURCE_TOO_SLOW");
        assert!(slow.is_retryable() && slow.is_too_slow());
        assert_eq!(slow.detail(), "the source sent 999 bytes in 10s, less than the minimum of 100 bytes a second");
        let mut pace = Pace::new(Instant::now(), &settings);
        pace.window_end = Instant::now();
        pace.window_bytes = 1000;
        pace.check().unwrap();
        assert_eq!(pace.window_bytes, 0);
        assert!(pace.window_end > Instant::now(), "the next window");
        // Bytes received during the grace (the first window) do not count.
        let mut pace = Pace::new(Instant::now(), &settings);
        pace.received(5000);
        assert_eq!(pace.window_bytes, 0);
        // Off: no window is checked, only the deadline.
        let mut off = Pace::new(Instant::now(), &pace_settings(Duration::from_secs(60), 0, window));
        off.window_end = Instant::now();
        off.check().unwrap();
        assert_eq!(off.next_check(), off.deadline);

        // A download started again late in its run (after a stored part went missing): the run's deadline stays, its
        // first window starts now instead of failing at once for the bytes counted by the first download.
        let started = Instant::now() - Duration::from_secs(30);
        let mut late = Pace::new(started, &settings);
        late.check().unwrap();
        assert_eq!(late.deadline, started + Duration::from_secs(60));
        let past = Pace::new(started, &pace_settings(Duration::from_secs(20), 100, window)).check().unwrap_err();
        assert!(matches!(past, FetchError::DeadlineExceeded { .. }), "{past:?}");
        assert_eq!(past.code(), "SOURCE_TOO_SLOW");
        assert_eq!(past.detail(), "the source did not send the whole file within the transfer's deadline of 20s");
    }

    #[test]
    fn content_ranges_and_media_types_parse() {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_RANGE, "bytes 100-199/1000".parse().unwrap());
        assert_eq!(content_range(&headers), Some((100, Some(1000))));
        headers.insert(header::CONTENT_RANGE, "bytes 5-9/*".parse().unwrap());
        assert_eq!(content_range(&headers), Some((5, None)));
        headers.insert(header::CONTENT_RANGE, "bytes 9-5/10".parse().unwrap());
        assert_eq!(content_range(&headers), None);
        headers.insert(header::CONTENT_TYPE, "Image/PNG; charset=binary".parse().unwrap());
        assert_eq!(media_type(&headers), "image/png");
        headers.insert(header::ETAG, "W/\"weak\"".parse().unwrap());
        headers.insert(header::LAST_MODIFIED, "Tue, 01 Dec 2026 00:00:00 GMT".parse().unwrap());
        assert_eq!(validator(&headers).as_deref(), Some("Tue, 01 Dec 2026 00:00:00 GMT"));
        headers.insert(header::ETAG, "\"strong\"".parse().unwrap());
        assert_eq!(validator(&headers).as_deref(), Some("\"strong\""));
    }
}
