//! Typed configuration from `CONVEYOR_*` environment variables (CONTRACT.md §1), validated at start-up.
//!
//! Every error names the variable at fault. Secrets are wrapped in [`Secret`], whose `Debug` and `Display` print
//! `[redacted]`, so a configuration can be logged whole.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use base64::Engine as _;

pub mod check;
pub mod reference;
pub mod variables;

/// Shortest idempotency retention the seed allows, whatever the setting says.
pub const MIN_IDEMPOTENCY_TTL: Duration = Duration::from_secs(24 * 3600);

pub use conveyor_jobs::Secret;

/// A configuration error; its message names the variable.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A required variable is not set (or is empty).
    #[error("{0} is required but not set")]
    Missing(&'static str),
    /// A variable is set to something unusable; the value itself is not repeated (it may be a secret).
    #[error("{name} is invalid: {reason}")]
    Invalid {
        /// The variable.
        name: &'static str,
        /// What is wrong with it.
        reason: String,
    },
}

impl ConfigError {
    /// The variable it is about.
    pub fn variable(&self) -> &'static str {
        match self {
            Self::Missing(name) | Self::Invalid { name, .. } => name,
        }
    }
}

fn invalid(name: &'static str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { name, reason: reason.into() }
}

/// One HMAC key for idempotency fingerprints: an id stored beside each fingerprint, and the secret.
#[derive(Clone, Debug)]
pub struct FingerprintKey {
    /// Stored beside each fingerprint so that keys can rotate.
    pub id: String,
    /// The HMAC-SHA256 key.
    pub secret: Secret<Vec<u8>>,
}

/// The whole configuration of the server roles.
#[derive(Clone, Debug)]
pub struct Config {
    /// PostgreSQL URL of the application role (`CONVEYOR_DATABASE_URL`).
    pub database_url: Secret<String>,
    /// Redis URL (`CONVEYOR_REDIS_URL`).
    pub redis_url: Secret<String>,
    /// Prefix of every Redis key (`CONVEYOR_REDIS_PREFIX`, default `conveyor`).
    pub redis_prefix: String,
    /// The files of TLS to Redis (`CONVEYOR_REDIS_CA_FILE`, `CONVEYOR_REDIS_CLIENT_CERT_FILE`,
    /// `CONVEYOR_REDIS_CLIENT_KEY_FILE`), for a `rediss://` URL.
    pub redis_tls: conveyor_jobs::RedisTls,
    /// API listen address (`CONVEYOR_HTTP_ADDR`).
    pub http_addr: SocketAddr,
    /// Admin listen address for `/metrics`, `/healthz`, `/readyz` (`CONVEYOR_ADMIN_ADDR`).
    pub admin_addr: SocketAddr,
    /// HS256 secret of the workspace bearer tokens (`CONVEYOR_JWT_SECRET`): required by the api role alone, the
    /// only one that verifies them; every other role drops it.
    pub jwt_secret: Option<Secret<Vec<u8>>>,
    /// The secret it replaces, still accepted while tokens signed with it live (`CONVEYOR_JWT_PREVIOUS_SECRET`).
    pub jwt_previous_secret: Option<Secret<Vec<u8>>>,
    /// HS256 secret of the operator JWTs (`CONVEYOR_OPERATOR_JWT_SECRET`), never the workspace tokens' key; without
    /// it only `CONVEYOR_ADMIN_TOKEN` opens the admin API and the UI.
    pub operator_jwt_secret: Option<Secret<Vec<u8>>>,
    /// The operator secret it replaces, still accepted (`CONVEYOR_OPERATOR_JWT_PREVIOUS_SECRET`).
    pub operator_jwt_previous_secret: Option<Secret<Vec<u8>>>,
    /// Fingerprint keys; the first one signs, all of them verify (`CONVEYOR_IDEMPOTENCY_KEYS`).
    pub idempotency_keys: Vec<FingerprintKey>,
    /// Retention of idempotency records (`CONVEYOR_IDEMPOTENCY_TTL`), never below 24 hours.
    pub idempotency_ttl: Duration,
    /// Bytes of completed idempotency records an API process keeps copies of, to answer their replays without
    /// PostgreSQL (`CONVEYOR_IDEMPOTENCY_REPLAY_CACHE`, default 16 MiB, at most 1 GiB; 0 keeps none).
    pub idempotency_replay_cache: u64,
    /// 32-byte AES-256-GCM key for stored credentials (`CONVEYOR_ENCRYPTION_KEY`, base64).
    pub encryption_key: Secret<Vec<u8>>,
    /// Base URL of the marketplace API (`CONVEYOR_MARKETPLACE_URL`); workers need it.
    pub marketplace_url: Option<String>,
    /// Where the operator UI links a job's trace (`CONVEYOR_TRACE_URL`), `{trace_id}` standing for the trace's id.
    pub trace_url: Option<String>,
    /// Largest accepted request body in bytes (`CONVEYOR_MAX_BODY_BYTES`, default 64 KiB).
    pub max_body_bytes: usize,
    /// Grace period for in-flight work on shutdown (`CONVEYOR_SHUTDOWN_GRACE`, default 30s).
    pub shutdown_grace: Duration,
    /// Maximum PostgreSQL connections of this process (`CONVEYOR_DATABASE_MAX_CONNECTIONS`, default 16).
    pub database_max_connections: u32,
    /// JSON logs instead of human-readable ones (`CONVEYOR_LOG_JSON`).
    pub log_json: bool,
    /// Time-out of one Redis command (`CONVEYOR_REDIS_COMMAND_TIMEOUT`, default 5s).
    pub redis_command_timeout: Duration,
    /// Streams each queue is split into (`CONVEYOR_STREAM_PARTITIONS`, default 1, at most 1024): the relay raises the
    /// layout to it, workers read every partition (see `stream::layout`). It can be raised while jobs flow, never
    /// lowered.
    pub stream_partitions: u16,
    /// How long Redis may fail before `/readyz` reports the process not ready (`CONVEYOR_READY_REDIS_GRACE`,
    /// default 10s; 0: at the first failure). PostgreSQL failures count at once.
    pub ready_redis_grace: Duration,
    /// The outbox relay's settings.
    pub dispatcher: DispatcherSettings,
    /// Jobs a worker runs at once (`CONVEYOR_WORKER_CONCURRENCY`, default 16).
    pub worker_concurrency: usize,
    /// Idle time after which a dead consumer's entry is taken over (`CONVEYOR_WORKER_VISIBILITY`, default 5s).
    pub worker_visibility: Duration,
    /// Deliveries of a job that may end with their worker stopped before it is dead-lettered
    /// (`CONVEYOR_WORKER_MAX_DELIVERIES`, default 5).
    pub worker_max_deliveries: u32,
    /// Slots of each queue named, at most (`CONVEYOR_WORKER_QUEUE_CONCURRENCY=transfers=4,media=8`).
    pub worker_queue_concurrency: std::collections::BTreeMap<String, usize>,
    /// Longest run of one job (`CONVEYOR_JOB_TIMEOUT`, default 60s).
    pub job_timeout: Duration,
    /// Runs of a job before it is dead-lettered (`CONVEYOR_JOB_MAX_ATTEMPTS`, default 5).
    pub job_max_attempts: u32,
    /// How often maintenance runs (`CONVEYOR_MAINTENANCE_INTERVAL`, default 30s).
    pub maintenance_interval: Duration,
    /// An unfinished operation without progress for this long is re-driven (`CONVEYOR_RECONCILE_AFTER`, 5m).
    pub reconcile_after: Duration,
    /// How often a running job shows its operation is alive (`CONVEYOR_OPERATION_KEEPALIVE`, default 1m); the
    /// reconciler's wait must be at least twice as long.
    pub operation_keepalive: Duration,
    /// Object storage, media, transfer and TLS settings of the scenarios.
    pub scenarios: ScenarioSettings,
    /// PostgreSQL URL of the operator role (`CONVEYOR_OPERATOR_DATABASE_URL`): the admin API, the web UI and the
    /// operator commands read across workspaces through it; unset, they are off.
    pub operator_database_url: Option<Secret<String>>,
    /// PostgreSQL URL of the runtime role (`CONVEYOR_RUNTIME_DATABASE_URL`): the dispatcher, maintenance and the
    /// worker's bookkeeping work across workspaces through it; required by those roles, unused by the API.
    pub runtime_database_url: Option<Secret<String>>,
    /// Retention of the operators' audit trail (`CONVEYOR_AUDIT_RETENTION`, default 90d, at least 1d).
    pub audit_retention: Duration,
    /// Retention of dead letters (`CONVEYOR_DEAD_LETTER_RETENTION`, default 30d, at least 1d).
    pub dead_letter_retention: Duration,
    /// The shared operator token (`CONVEYOR_ADMIN_TOKEN`, at least 32 bytes): a bearer for `/admin/v1/...` and the
    /// web UI's login. JWTs signed with `CONVEYOR_OPERATOR_JWT_SECRET` that carry `"operator": true` are accepted too.
    pub admin_token: Option<Secret<String>>,
}

/// Settings of the first-batch scenarios (media, asset transfers, external HTTPS).
#[derive(Clone, Debug)]
pub struct ScenarioSettings {
    /// `CONVEYOR_OBJECT_STORE_URL`: `file:///dir` or `s3://bucket/prefix`; default `file://<CONVEYOR_DATA_DIR>/objects`
    /// (`CONVEYOR_DATA_DIR` defaults to `./data`, made absolute).
    pub object_store_url: String,
    /// `CONVEYOR_MEDIA_MAX_BYTES`: largest media object (default 25 MiB).
    pub media_max_bytes: u64,
    /// `CONVEYOR_MEDIA_MAX_PIXELS`: largest width × height decoded (default 64 megapixels).
    pub media_max_pixels: u64,
    /// `CONVEYOR_MEDIA_DECODE_PERMITS`: images a worker process decodes at once (default: one per CPU core).
    pub media_decode_permits: usize,
    /// `CONVEYOR_MEDIA_DECODE_MEMORY`: what the images a worker process decodes at once may hold together, in bytes
    /// (default 320 MiB, within the chart's 512 MiB worker limit): each decode reserves, from its header and before a
    /// pixel is decoded, the original, its pixels at 8 bits a sample, the decoder's working memory and the
    /// derivatives; an image that needs more than all of it is rejected (`TOO_MANY_PIXELS`). At least twice
    /// `CONVEYOR_MEDIA_MAX_BYTES` plus 16 MiB.
    pub media_decode_memory: u64,
    /// `CONVEYOR_MEDIA_MAX_CONCURRENT_UPLOADS`: uploads one API process receives at once (default 16), each holding at
    /// most one part of [`conveyor_shop::domain::media::PART_BYTES`]; beyond it `503 UPLOADS_BUSY` with `Retry-After`.
    pub media_max_concurrent_uploads: usize,
    /// `CONVEYOR_ASSET_ALLOWED_NETWORKS`: CIDRs a transfer may reach although refused by default (empty).
    pub asset_allowed_networks: Vec<ipnet::IpNet>,
    /// `CONVEYOR_ASSET_ALLOWED_PORTS`: ports a transfer may reach besides 80 and 443, for every host (empty).
    pub asset_allowed_ports: Vec<u16>,
    /// `CONVEYOR_ASSET_MAX_BYTES`: largest transferred file (default 100 MiB).
    pub asset_max_bytes: u64,
    /// `CONVEYOR_ASSET_CONNECT_TIMEOUT` (default 10s).
    pub asset_connect_timeout: Duration,
    /// `CONVEYOR_ASSET_READ_TIMEOUT`: longest wait for the next bytes of a download (default 30s).
    pub asset_read_timeout: Duration,
    /// `CONVEYOR_ASSET_MAX_DURATION`: longest run of a transfer's download (default 10m, 1s to 24h); past it the run
    /// fails `SOURCE_TOO_SLOW`. The transfer job's time-out is this plus
    /// [`conveyor_shop::jobs::TRANSFER_FINISH_TIME`] (5m).
    pub asset_max_duration: Duration,
    /// `CONVEYOR_ASSET_MIN_THROUGHPUT`: fewest bytes a second a download must average over each throughput window
    /// after the first (default 1 KiB, at most 1 GiB; 0 turns the check off); under it the run fails
    /// `SOURCE_TOO_SLOW`.
    pub asset_min_throughput: u64,
    /// `CONVEYOR_ASSET_THROUGHPUT_WINDOW`: the window the throughput is averaged over, and the grace at a run's start
    /// before the first (default 30s, 1s to 1h).
    pub asset_throughput_window: Duration,
    /// `CONVEYOR_TLS_CA_FILE`: PEM certificates trusted besides the built-in roots (a private CA; the tests' own).
    pub tls_ca_file: Option<std::path::PathBuf>,
    /// `CONVEYOR_CATALOG_PAGE_SIZE`: products asked of the marketplace per catalog page (1 to 1000, default 200).
    pub catalog_page_size: u32,
    /// `CONVEYOR_AI_CREDITS_PER_WORKSPACE`: AI credits a workspace may reserve per calendar month, UTC (default 1000).
    pub ai_credits_per_workspace: u32,
    /// `CONVEYOR_AI_PROVIDER_URL`: base URL of the AI provider; unset, the worker calls `CONVEYOR_MARKETPLACE_URL`
    /// (where the sandbox serves its AI provider too).
    pub ai_provider_url: Option<String>,
}

impl Default for ScenarioSettings {
    /// The documented defaults (every variable unset).
    fn default() -> Self {
        Self::from_source(&HashMap::<String, String>::new()).expect("the defaults are valid")
    }
}

impl ScenarioSettings {
    /// The asset fetcher's settings these name, with its default part size.
    pub fn fetch_settings(&self) -> conveyor_shop::adapters::fetch::FetchSettings {
        conveyor_shop::adapters::fetch::FetchSettings {
            connect_timeout: self.asset_connect_timeout,
            read_timeout: self.asset_read_timeout,
            max_duration: self.asset_max_duration,
            min_throughput: self.asset_min_throughput,
            throughput_window: self.asset_throughput_window,
            max_bytes: self.asset_max_bytes,
            allowed_networks: self.asset_allowed_networks.clone(),
            allowed_ports: self.asset_allowed_ports.clone(),
            ca_file: self.tls_ca_file.clone(),
            ..Default::default()
        }
    }

    /// Reads the scenario variables.
    pub fn from_source(src: &dyn Source) -> Result<Self, ConfigError> {
        // The fetcher's own defaults, where a variable is unset.
        let fetch = conveyor_shop::adapters::fetch::FetchSettings::default();
        let object_store_url = match src.get("CONVEYOR_OBJECT_STORE_URL") {
            Some(url) => {
                if !(url.starts_with("file:///") || url.starts_with("s3://")) {
                    return Err(invalid(
                        "CONVEYOR_OBJECT_STORE_URL",
                        "must be file:///absolute/path or s3://bucket[/prefix]",
                    ));
                }
                url
            }
            None => {
                let dir = std::path::PathBuf::from(src.get("CONVEYOR_DATA_DIR").unwrap_or_else(|| "data".to_owned()));
                let dir = std::path::absolute(&dir).map_err(|e| invalid("CONVEYOR_DATA_DIR", e.to_string()))?;
                format!("file://{}", dir.join("objects").display())
            }
        };
        let asset_allowed_networks = match src.get("CONVEYOR_ASSET_ALLOWED_NETWORKS") {
            None => Vec::new(),
            Some(list) => list
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(|cidr| {
                    cidr.parse::<ipnet::IpNet>().map_err(|_| {
                        invalid(
                            "CONVEYOR_ASSET_ALLOWED_NETWORKS",
                            format!("`{cidr}` is not a CIDR such as 127.0.0.0/8"),
                        )
                    })
                })
                .collect::<Result<_, _>>()?,
        };
        let asset_allowed_ports = match src.get("CONVEYOR_ASSET_ALLOWED_PORTS") {
            None => Vec::new(),
            Some(list) => list
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(|port| match port.parse::<u16>() {
                    Ok(n) if n > 0 => Ok(n),
                    _ => Err(invalid(
                        "CONVEYOR_ASSET_ALLOWED_PORTS",
                        format!("`{port}` is not a port number from 1 to 65535 (a list such as 8080,8443)"),
                    )),
                })
                .collect::<Result<_, _>>()?,
        };
        Ok(Self {
            object_store_url,
            media_max_bytes: positive(src, "CONVEYOR_MEDIA_MAX_BYTES", 25 * 1024 * 1024)?,
            media_max_pixels: positive(src, "CONVEYOR_MEDIA_MAX_PIXELS", 64_000_000)?,
            media_decode_permits: positive(
                src,
                "CONVEYOR_MEDIA_DECODE_PERMITS",
                std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            )?,
            media_decode_memory: {
                let max_bytes = positive(src, "CONVEYOR_MEDIA_MAX_BYTES", 25 * 1024 * 1024u64)?;
                let memory = size(src, "CONVEYOR_MEDIA_DECODE_MEMORY", 320 * MIB)?;
                let least = max_bytes.saturating_mul(2).saturating_add(16 * MIB);
                if memory < least {
                    return Err(invalid(
                        "CONVEYOR_MEDIA_DECODE_MEMORY",
                        format!(
                            "must be at least twice CONVEYOR_MEDIA_MAX_BYTES plus 16 MiB ({} MiB), so that every \
                             original it lets in can be read and inspected",
                            least.div_ceil(MIB)
                        ),
                    ));
                }
                if memory > 1024 * 1024 * MIB {
                    return Err(invalid("CONVEYOR_MEDIA_DECODE_MEMORY", "must be at most 1TiB"));
                }
                memory
            },
            media_max_concurrent_uploads: positive(src, "CONVEYOR_MEDIA_MAX_CONCURRENT_UPLOADS", 16)?,
            asset_allowed_networks,
            asset_allowed_ports,
            asset_max_bytes: positive(src, "CONVEYOR_ASSET_MAX_BYTES", fetch.max_bytes)?,
            asset_connect_timeout: duration(src, "CONVEYOR_ASSET_CONNECT_TIMEOUT", fetch.connect_timeout)?,
            asset_read_timeout: duration(src, "CONVEYOR_ASSET_READ_TIMEOUT", fetch.read_timeout)?,
            asset_max_duration: duration_within(
                src,
                "CONVEYOR_ASSET_MAX_DURATION",
                fetch.max_duration,
                Duration::from_secs(1)..=Duration::from_secs(24 * 3600),
                "between 1s and 24h",
            )?,
            asset_min_throughput: rate(src, "CONVEYOR_ASSET_MIN_THROUGHPUT", fetch.min_throughput)?,
            asset_throughput_window: duration_within(
                src,
                "CONVEYOR_ASSET_THROUGHPUT_WINDOW",
                fetch.throughput_window,
                Duration::from_secs(1)..=Duration::from_secs(3600),
                "between 1s and 1h",
            )?,
            tls_ca_file: src.get("CONVEYOR_TLS_CA_FILE").map(std::path::PathBuf::from),
            catalog_page_size: {
                let size = positive(src, "CONVEYOR_CATALOG_PAGE_SIZE", 200u32)?;
                if size > conveyor_shop::adapters::catalog::MAX_PAGE_SIZE {
                    return Err(invalid("CONVEYOR_CATALOG_PAGE_SIZE", "must be at most 1000"));
                }
                size
            },
            ai_credits_per_workspace: positive(src, "CONVEYOR_AI_CREDITS_PER_WORKSPACE", 1000)?,
            ai_provider_url: match src.get("CONVEYOR_AI_PROVIDER_URL") {
                None => None,
                Some(url) if url.starts_with("http://") || url.starts_with("https://") => {
                    Some(url.trim_end_matches('/').to_owned())
                }
                Some(_) => return Err(invalid("CONVEYOR_AI_PROVIDER_URL", "must be an http:// or https:// URL")),
            },
        })
    }
}

pub use conveyor_jobs::DispatcherSettings;

/// Where variables come from: the process environment, or a map in tests.
pub trait Source {
    /// The value of `name`, if set and not empty.
    fn get(&self, name: &str) -> Option<String>;
}

/// The process environment.
pub struct Env;

impl Source for Env {
    fn get(&self, name: &str) -> Option<String> {
        std::env::var(name).ok().filter(|v| !v.trim().is_empty())
    }
}

impl Source for HashMap<String, String> {
    fn get(&self, name: &str) -> Option<String> {
        HashMap::get(self, name).cloned().filter(|v| !v.trim().is_empty())
    }
}

fn required(src: &dyn Source, name: &'static str) -> Result<String, ConfigError> {
    src.get(name).ok_or(ConfigError::Missing(name))
}

fn addr(src: &dyn Source, name: &'static str, default: &str) -> Result<SocketAddr, ConfigError> {
    let raw = src.get(name).unwrap_or_else(|| default.to_owned());
    raw.trim().parse().map_err(|_| invalid(name, format!("`{raw}` is not a socket address such as 127.0.0.1:8080")))
}

fn duration(src: &dyn Source, name: &'static str, default: Duration) -> Result<Duration, ConfigError> {
    match src.get(name) {
        None => Ok(default),
        Some(raw) => humantime::parse_duration(raw.trim())
            .map_err(|e| invalid(name, format!("`{raw}` is not a duration such as 48h or 30s ({e})"))),
    }
}

/// A duration within `bounds` (`bounds_text` says which, for the error).
fn duration_within(
    src: &dyn Source,
    name: &'static str,
    default: Duration,
    bounds: std::ops::RangeInclusive<Duration>,
    bounds_text: &str,
) -> Result<Duration, ConfigError> {
    let value = duration(src, name, default)?;
    if !bounds.contains(&value) {
        return Err(invalid(name, format!("must be {bounds_text}")));
    }
    Ok(value)
}

const MIB: u64 = 1024 * 1024;

/// Bytes a second: a size ([`parse_size`]: `1KiB`, `1024`), optionally followed by `/s`; 0 allowed; at most 1 GiB.
fn rate(src: &dyn Source, name: &'static str, default: u64) -> Result<u64, ConfigError> {
    let Some(raw) = src.get(name) else { return Ok(default) };
    let text = raw.trim();
    parse_size(text.strip_suffix("/s").unwrap_or(text)).filter(|&n| n <= 1024 * MIB).ok_or_else(|| {
        invalid(
            name,
            format!("`{raw}` is not a rate of bytes a second such as 1KiB, 2KiB/s or 1024, at most 1GiB (0: off)"),
        )
    })
}

/// A size in bytes: a whole number of bytes, or one with a unit, binary (`KiB`, `MiB`, `GiB`, `TiB`; `Ki`, `Mi`, ...
/// as Kubernetes writes them) or decimal (`kB`, `MB`, `GB`, `TB`; `k`, `M`, `G`, `T`).
pub(crate) fn parse_size(raw: &str) -> Option<u64> {
    let raw = raw.trim();
    let split = raw.find(|c: char| !c.is_ascii_digit()).unwrap_or(raw.len());
    let (number, unit) = raw.split_at(split);
    let number: u64 = number.parse().ok()?;
    let unit: u64 = match unit.trim() {
        "" | "B" => 1,
        "k" | "kB" | "K" | "KB" => 1000,
        "M" | "MB" => 1000_u64.pow(2),
        "G" | "GB" => 1000_u64.pow(3),
        "T" | "TB" => 1000_u64.pow(4),
        "Ki" | "KiB" => 1 << 10,
        "Mi" | "MiB" => 1 << 20,
        "Gi" | "GiB" => 1 << 30,
        "Ti" | "TiB" => 1 << 40,
        _ => return None,
    };
    number.checked_mul(unit)
}

fn size(src: &dyn Source, name: &'static str, default: u64) -> Result<u64, ConfigError> {
    match src.get(name) {
        None => Ok(default),
        Some(raw) => parse_size(&raw)
            .filter(|&n| n > 0)
            .ok_or_else(|| invalid(name, format!("`{raw}` is not a size such as 320MiB, 1GiB or 335544320 (bytes)"))),
    }
}

fn number<T: std::str::FromStr>(src: &dyn Source, name: &'static str, default: T) -> Result<T, ConfigError> {
    match src.get(name) {
        None => Ok(default),
        Some(raw) => raw.trim().parse().map_err(|_| invalid(name, format!("`{raw}` is not a valid number"))),
    }
}

fn positive<T: std::str::FromStr + PartialOrd + Default>(
    src: &dyn Source,
    name: &'static str,
    default: T,
) -> Result<T, ConfigError> {
    let value = number(src, name, default)?;
    if value <= T::default() {
        return Err(invalid(name, "must be at least 1"));
    }
    Ok(value)
}

fn postgres_url(src: &dyn Source, name: &'static str) -> Result<Secret<String>, ConfigError> {
    let url = required(src, name)?;
    if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
        return Err(invalid(name, "must be a postgres:// or postgresql:// URL"));
    }
    // TLS is asked for in the URL, as libpq reads it: sslmode (disable, allow, prefer, require, verify-ca,
    // verify-full) and sslrootcert, sslcert, sslkey. Check here what can be checked without connecting.
    let parsed = url::Url::parse(&url).map_err(|_| invalid(name, "is not a valid URL"))?;
    for (key, value) in parsed.query_pairs() {
        match &*key {
            "sslmode" | "ssl-mode"
                if !["disable", "allow", "prefer", "require", "verify-ca", "verify-full"].contains(&&*value) =>
            {
                return Err(invalid(
                    name,
                    format!("sslmode={value} is not one of disable, allow, prefer, require, verify-ca, verify-full"),
                ));
            }
            "sslrootcert" | "sslcert" | "sslkey" | "ssl-root-cert" | "ssl-ca" | "ssl-cert" | "ssl-key"
                if !value.starts_with("-----BEGIN") && !std::path::Path::new(&*value).is_file() =>
            {
                return Err(invalid(name, format!("{key}={value} is not a readable file")));
            }
            _ => {}
        }
    }
    Ok(Secret::new(url))
}

/// Parses `CONVEYOR_DATABASE_URL` alone (for the operator commands).
pub fn database_url(src: &dyn Source) -> Result<Secret<String>, ConfigError> {
    postgres_url(src, "CONVEYOR_DATABASE_URL")
}

/// The URL `conveyor migrate status` reads the migration histories with: `CONVEYOR_MIGRATION_DATABASE_URL` when set,
/// else `CONVEYOR_DATABASE_URL` (the application role may read every history table).
pub fn history_database_url(src: &dyn Source) -> Result<Secret<String>, ConfigError> {
    match src.get("CONVEYOR_MIGRATION_DATABASE_URL").filter(|v| !v.trim().is_empty()) {
        Some(_) => postgres_url(src, "CONVEYOR_MIGRATION_DATABASE_URL"),
        None => database_url(src),
    }
}

/// Parses `CONVEYOR_JWT_SECRET` (required here): at least 32 bytes, as HS256 wants.
pub fn jwt_secret(src: &dyn Source) -> Result<Secret<Vec<u8>>, ConfigError> {
    optional_hmac_secret(src, "CONVEYOR_JWT_SECRET")?.ok_or(ConfigError::Missing("CONVEYOR_JWT_SECRET"))
}

/// An optional HS256 secret: at least 32 bytes.
fn optional_hmac_secret(src: &dyn Source, name: &'static str) -> Result<Option<Secret<Vec<u8>>>, ConfigError> {
    let Some(raw) = src.get(name) else { return Ok(None) };
    if raw.len() < 32 {
        return Err(invalid(name, "must be at least 32 bytes long"));
    }
    Ok(Some(Secret::new(raw.into_bytes())))
}

/// The workspace tokens' keys and the operator's must differ: whoever may mint a workspace token (every issuer of
/// the SaaS's logins) must not be able to mint an operator's.
fn keys_apart(config: &Config) -> Result<(), ConfigError> {
    let tenant = [&config.jwt_secret, &config.jwt_previous_secret];
    for (name, operator) in [
        ("CONVEYOR_OPERATOR_JWT_SECRET", &config.operator_jwt_secret),
        ("CONVEYOR_OPERATOR_JWT_PREVIOUS_SECRET", &config.operator_jwt_previous_secret),
    ] {
        let Some(operator) = operator else { continue };
        if tenant.iter().any(|t| t.as_ref().is_some_and(|t| t.expose() == operator.expose())) {
            return Err(invalid(
                name,
                "must differ from CONVEYOR_JWT_SECRET and CONVEYOR_JWT_PREVIOUS_SECRET (workspace tokens must never \
                 pass as an operator's)",
            ));
        }
    }
    if config.jwt_previous_secret.is_some() && config.jwt_secret.is_none() {
        return Err(invalid("CONVEYOR_JWT_PREVIOUS_SECRET", "is set without CONVEYOR_JWT_SECRET"));
    }
    if config.operator_jwt_previous_secret.is_some() && config.operator_jwt_secret.is_none() {
        return Err(invalid("CONVEYOR_OPERATOR_JWT_PREVIOUS_SECRET", "is set without CONVEYOR_OPERATOR_JWT_SECRET"));
    }
    Ok(())
}

fn idempotency_keys(src: &dyn Source) -> Result<Vec<FingerprintKey>, ConfigError> {
    const NAME: &str = "CONVEYOR_IDEMPOTENCY_KEYS";
    let raw = required(src, NAME)?;
    let mut keys: Vec<FingerprintKey> = Vec::new();
    for (i, part) in raw.split(',').enumerate() {
        let (id, secret) =
            part.trim().split_once(':').ok_or_else(|| invalid(NAME, format!("entry {} is not `id:secret`", i + 1)))?;
        let id = id.trim();
        if id.is_empty() || !id.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
            return Err(invalid(NAME, format!("entry {} has an empty or non [A-Za-z0-9_-] id", i + 1)));
        }
        if secret.len() < 32 {
            return Err(invalid(NAME, format!("the secret of key `{id}` must be at least 32 bytes long")));
        }
        if keys.iter().any(|k| k.id == id) {
            return Err(invalid(NAME, format!("key id `{id}` appears twice")));
        }
        keys.push(FingerprintKey { id: id.to_owned(), secret: Secret::new(secret.as_bytes().to_vec()) });
    }
    Ok(keys)
}

fn stream_partitions(src: &dyn Source) -> Result<u16, ConfigError> {
    const NAME: &str = "CONVEYOR_STREAM_PARTITIONS";
    let max = conveyor_jobs::MAX_PARTITIONS;
    match number(src, NAME, 1u16)? {
        p if (1..=max).contains(&p) => Ok(p),
        _ => Err(invalid(NAME, format!("must be between 1 and {max}"))),
    }
}

fn encryption_key(src: &dyn Source) -> Result<Secret<Vec<u8>>, ConfigError> {
    const NAME: &str = "CONVEYOR_ENCRYPTION_KEY";
    let raw = required(src, NAME)?;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(raw.trim())
        .map_err(|_| invalid(NAME, "is not valid base64"))?;
    if bytes.len() != 32 {
        return Err(invalid(NAME, format!("must decode to 32 bytes, got {}", bytes.len())));
    }
    Ok(Secret::new(bytes))
}

impl Config {
    /// Reads and validates the configuration from the process environment.
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_source(&Env)
    }

    /// Reads and validates the configuration from any [`Source`].
    pub fn from_source(src: &dyn Source) -> Result<Self, ConfigError> {
        let (redis_url, redis_prefix) = redis(src)?;
        let idempotency_ttl = duration(src, "CONVEYOR_IDEMPOTENCY_TTL", Duration::from_secs(48 * 3600))?;
        if idempotency_ttl < MIN_IDEMPOTENCY_TTL {
            return Err(invalid("CONVEYOR_IDEMPOTENCY_TTL", "must be at least 24h (seed section 2.1)"));
        }
        let idempotency_replay_cache = number(src, "CONVEYOR_IDEMPOTENCY_REPLAY_CACHE", 16 * 1024 * 1024u64)?;
        if idempotency_replay_cache > 1024 * 1024 * 1024 {
            return Err(invalid("CONVEYOR_IDEMPOTENCY_REPLAY_CACHE", "must be at most 1 GiB (1073741824 bytes)"));
        }
        let max_body_bytes = number(src, "CONVEYOR_MAX_BODY_BYTES", 64 * 1024)?;
        if max_body_bytes < 1024 {
            return Err(invalid("CONVEYOR_MAX_BODY_BYTES", "must be at least 1024"));
        }
        let database_max_connections = number(src, "CONVEYOR_DATABASE_MAX_CONNECTIONS", 16u32)?;
        if database_max_connections == 0 {
            return Err(invalid("CONVEYOR_DATABASE_MAX_CONNECTIONS", "must be at least 1"));
        }
        let marketplace_url = match src.get("CONVEYOR_MARKETPLACE_URL") {
            None => None,
            Some(url) if url.starts_with("http://") || url.starts_with("https://") => {
                Some(url.trim_end_matches('/').to_owned())
            }
            Some(_) => {
                return Err(invalid("CONVEYOR_MARKETPLACE_URL", "must be an http:// or https:// URL"));
            }
        };
        let trace_url = match src.get("CONVEYOR_TRACE_URL") {
            None => None,
            Some(url) => match conveyor_jobs::console::check_trace_url(&url) {
                Ok(()) => Some(url),
                Err(why) => return Err(invalid("CONVEYOR_TRACE_URL", &why)),
            },
        };
        let log_json = match src.get("CONVEYOR_LOG_JSON").as_deref() {
            None | Some("0" | "false") => false,
            Some("1" | "true") => true,
            Some(_) => return Err(invalid("CONVEYOR_LOG_JSON", "must be true or false")),
        };
        let reconcile_after = duration(src, "CONVEYOR_RECONCILE_AFTER", conveyor_jobs::DEFAULT_RECONCILE_AFTER)?;
        let operation_keepalive = duration(src, "CONVEYOR_OPERATION_KEEPALIVE", Duration::from_secs(60))?;
        if operation_keepalive.is_zero() {
            return Err(invalid("CONVEYOR_OPERATION_KEEPALIVE", "must be more than zero"));
        }
        if reconcile_after < operation_keepalive * 2 {
            return Err(invalid(
                "CONVEYOR_RECONCILE_AFTER",
                "must be at least twice CONVEYOR_OPERATION_KEEPALIVE, or running jobs would be re-driven",
            ));
        }
        let config = Self {
            database_url: postgres_url(src, "CONVEYOR_DATABASE_URL")?,
            redis_tls: redis_tls(src, &redis_url)?,
            redis_url: Secret::new(redis_url),
            redis_prefix,
            http_addr: addr(src, "CONVEYOR_HTTP_ADDR", "127.0.0.1:8080")?,
            admin_addr: addr(src, "CONVEYOR_ADMIN_ADDR", "127.0.0.1:9090")?,
            jwt_secret: optional_hmac_secret(src, "CONVEYOR_JWT_SECRET")?,
            jwt_previous_secret: optional_hmac_secret(src, "CONVEYOR_JWT_PREVIOUS_SECRET")?,
            operator_jwt_secret: optional_hmac_secret(src, "CONVEYOR_OPERATOR_JWT_SECRET")?,
            operator_jwt_previous_secret: optional_hmac_secret(src, "CONVEYOR_OPERATOR_JWT_PREVIOUS_SECRET")?,
            idempotency_keys: idempotency_keys(src)?,
            idempotency_ttl,
            idempotency_replay_cache,
            encryption_key: encryption_key(src)?,
            marketplace_url,
            trace_url,
            max_body_bytes,
            shutdown_grace: duration(src, "CONVEYOR_SHUTDOWN_GRACE", Duration::from_secs(30))?,
            database_max_connections,
            log_json,
            redis_command_timeout: duration(src, "CONVEYOR_REDIS_COMMAND_TIMEOUT", Duration::from_secs(5))?,
            stream_partitions: stream_partitions(src)?,
            ready_redis_grace: duration(src, "CONVEYOR_READY_REDIS_GRACE", Duration::from_secs(10))?,
            dispatcher: dispatcher_settings(src)?,
            worker_concurrency: positive(src, "CONVEYOR_WORKER_CONCURRENCY", 16)?,
            worker_visibility: duration(src, "CONVEYOR_WORKER_VISIBILITY", Duration::from_secs(5))?,
            worker_max_deliveries: positive(src, "CONVEYOR_WORKER_MAX_DELIVERIES", 5u32)?,
            worker_queue_concurrency: queue_concurrency(src)?,
            job_timeout: duration(src, "CONVEYOR_JOB_TIMEOUT", Duration::from_secs(60))?,
            job_max_attempts: positive(src, "CONVEYOR_JOB_MAX_ATTEMPTS", 5)?,
            maintenance_interval: duration(
                src,
                "CONVEYOR_MAINTENANCE_INTERVAL",
                conveyor_jobs::DEFAULT_MAINTENANCE_INTERVAL,
            )?,
            reconcile_after,
            operation_keepalive,
            scenarios: ScenarioSettings::from_source(src)?,
            operator_database_url: operator_database_url(src)?,
            runtime_database_url: optional_runtime_database_url(src)?,
            audit_retention: audit_retention(src)?,
            dead_letter_retention: dead_letter_retention(src)?,
            admin_token: admin_token(src)?,
        };
        keys_apart(&config)?;
        Ok(config)
    }
}

/// Parses `CONVEYOR_REDIS_URL` (required) and `CONVEYOR_REDIS_PREFIX` (default `conveyor`).
pub fn redis(src: &dyn Source) -> Result<(String, String), ConfigError> {
    let redis_url = required(src, "CONVEYOR_REDIS_URL")?;
    const SCHEMES: [&str; 6] =
        ["redis", "rediss", "redis-cluster", "rediss-cluster", "redis-sentinel", "rediss-sentinel"];
    if !redis_url.split_once("://").is_some_and(|(scheme, _)| SCHEMES.contains(&scheme)) {
        return Err(invalid(
            "CONVEYOR_REDIS_URL",
            "must be a redis://, rediss://, redis-cluster://, rediss-cluster://, redis-sentinel:// or \
             rediss-sentinel:// URL",
        ));
    }
    let redis_prefix = src.get("CONVEYOR_REDIS_PREFIX").unwrap_or_else(|| "conveyor".to_owned());
    if redis_prefix.contains(['{', '}', ' ']) {
        return Err(invalid("CONVEYOR_REDIS_PREFIX", "must not contain braces or spaces"));
    }
    Ok((redis_url, redis_prefix))
}

/// Parses the TLS files of Redis (each optional, each a readable PEM file): `CONVEYOR_REDIS_CA_FILE`,
/// `CONVEYOR_REDIS_CLIENT_CERT_FILE` and `CONVEYOR_REDIS_CLIENT_KEY_FILE` (the last two together), refused unless
/// `redis_url` asks for TLS.
pub fn redis_tls(src: &dyn Source, redis_url: &str) -> Result<conveyor_jobs::RedisTls, ConfigError> {
    let file = |name: &'static str| -> Result<Option<std::path::PathBuf>, ConfigError> {
        let Some(path) = src.get(name) else { return Ok(None) };
        std::fs::metadata(&path)
            .map_err(|e| invalid(name, format!("cannot read {path}: {e}")))
            .and_then(|m| if m.is_file() { Ok(()) } else { Err(invalid(name, format!("{path} is not a file"))) })?;
        Ok(Some(path.into()))
    };
    let tls = conveyor_jobs::RedisTls {
        ca_file: file("CONVEYOR_REDIS_CA_FILE")?,
        client_cert_file: file("CONVEYOR_REDIS_CLIENT_CERT_FILE")?,
        client_key_file: file("CONVEYOR_REDIS_CLIENT_KEY_FILE")?,
    };
    if tls.is_set() && !conveyor_jobs::redis_url_uses_tls(redis_url) {
        let name = if tls.ca_file.is_some() { "CONVEYOR_REDIS_CA_FILE" } else { "CONVEYOR_REDIS_CLIENT_CERT_FILE" };
        return Err(invalid(name, "is set but CONVEYOR_REDIS_URL does not ask for TLS (rediss://)"));
    }
    tls.check().map_err(|e| invalid(e.variable, e.reason))?;
    Ok(tls)
}

/// Parses `CONVEYOR_OPERATOR_DATABASE_URL` (optional).
pub fn operator_database_url(src: &dyn Source) -> Result<Option<Secret<String>>, ConfigError> {
    const NAME: &str = "CONVEYOR_OPERATOR_DATABASE_URL";
    match src.get(NAME) {
        None => Ok(None),
        Some(_) => postgres_url(src, NAME).map(Some),
    }
}

/// Parses `CONVEYOR_RUNTIME_DATABASE_URL` (required).
pub fn runtime_database_url(src: &dyn Source) -> Result<Secret<String>, ConfigError> {
    postgres_url(src, "CONVEYOR_RUNTIME_DATABASE_URL")
}

fn optional_runtime_database_url(src: &dyn Source) -> Result<Option<Secret<String>>, ConfigError> {
    match src.get("CONVEYOR_RUNTIME_DATABASE_URL") {
        None => Ok(None),
        Some(_) => runtime_database_url(src).map(Some),
    }
}

/// `CONVEYOR_WORKER_QUEUE_CONCURRENCY`: `queue=slots` pairs separated by commas.
fn queue_concurrency(src: &dyn Source) -> Result<std::collections::BTreeMap<String, usize>, ConfigError> {
    const NAME: &str = "CONVEYOR_WORKER_QUEUE_CONCURRENCY";
    let mut caps = std::collections::BTreeMap::new();
    for pair in src.get(NAME).unwrap_or_default().split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let Some((queue, slots)) = pair.split_once('=') else {
            return Err(invalid(NAME, format!("`{pair}` is not queue=slots (say transfers=4,media=8)")));
        };
        let queue = queue.trim();
        if !conveyor_jobs::valid_queue_name(queue) {
            return Err(invalid(NAME, format!("`{queue}` is not a valid queue name")));
        }
        let slots: usize = match slots.trim().parse() {
            Ok(n) if n >= 1 => n,
            _ => return Err(invalid(NAME, format!("the slots of `{queue}` must be a whole number of at least 1"))),
        };
        if caps.insert(queue.to_owned(), slots).is_some() {
            return Err(invalid(NAME, format!("`{queue}` is named twice")));
        }
    }
    Ok(caps)
}

fn dead_letter_retention(src: &dyn Source) -> Result<Duration, ConfigError> {
    const NAME: &str = "CONVEYOR_DEAD_LETTER_RETENTION";
    let retention = duration(src, NAME, conveyor_jobs::DEFAULT_DEAD_LETTER_RETENTION)?;
    if retention < Duration::from_secs(24 * 3600) {
        return Err(invalid(NAME, "must be at least 1d"));
    }
    Ok(retention)
}

fn audit_retention(src: &dyn Source) -> Result<Duration, ConfigError> {
    const NAME: &str = "CONVEYOR_AUDIT_RETENTION";
    let retention = duration(src, NAME, Duration::from_secs(90 * 24 * 3600))?;
    if retention < Duration::from_secs(24 * 3600) {
        return Err(invalid(NAME, "must be at least 1d"));
    }
    Ok(retention)
}

/// Parses `CONVEYOR_ADMIN_TOKEN` (optional): at least 32 bytes.
pub fn admin_token(src: &dyn Source) -> Result<Option<Secret<String>>, ConfigError> {
    const NAME: &str = "CONVEYOR_ADMIN_TOKEN";
    match src.get(NAME) {
        None => Ok(None),
        Some(token) if token.len() < 32 => Err(invalid(NAME, "must be at least 32 bytes long")),
        Some(token) => Ok(Some(Secret::new(token))),
    }
}

/// Reads the dispatcher's settings (`CONVEYOR_DISPATCH_*`, `CONVEYOR_OUTBOX_RETENTION`) over the platform's defaults
/// and checks them together ([`DispatcherSettings::validate`]); an error names the variable.
pub fn dispatcher_settings(src: &dyn Source) -> Result<DispatcherSettings, ConfigError> {
    const VARIABLES: [(&str, &str); 13] = [
        ("batch_size", "CONVEYOR_DISPATCH_BATCH"),
        ("lease", "CONVEYOR_DISPATCH_LEASE"),
        ("max_attempts", "CONVEYOR_DISPATCH_MAX_ATTEMPTS"),
        ("backoff_base", "CONVEYOR_DISPATCH_BACKOFF_BASE"),
        ("backoff_max", "CONVEYOR_DISPATCH_BACKOFF_MAX"),
        ("poll_interval", "CONVEYOR_DISPATCH_POLL"),
        ("concurrency", "CONVEYOR_DISPATCH_CONCURRENCY"),
        ("dedup_ttl_recorded", "CONVEYOR_DISPATCH_DEDUP_TTL_RECORDED"),
        ("dedup_ttl", "CONVEYOR_DISPATCH_DEDUP_TTL"),
        ("retention", "CONVEYOR_OUTBOX_RETENTION"),
        ("window", "CONVEYOR_DISPATCH_WINDOW"),
        ("tick", "CONVEYOR_DISPATCH_TICK"),
        ("queue_wait", "CONVEYOR_DISPATCH_QUEUE_WAIT"),
    ];
    let d = DispatcherSettings::default();
    let mut settings = DispatcherSettings::default();
    settings.batch_size = number(src, "CONVEYOR_DISPATCH_BATCH", d.batch_size)?;
    settings.lease = duration(src, "CONVEYOR_DISPATCH_LEASE", d.lease)?;
    settings.max_attempts = number(src, "CONVEYOR_DISPATCH_MAX_ATTEMPTS", d.max_attempts)?;
    settings.backoff_base = duration(src, "CONVEYOR_DISPATCH_BACKOFF_BASE", d.backoff_base)?;
    settings.backoff_max = duration(src, "CONVEYOR_DISPATCH_BACKOFF_MAX", d.backoff_max)?;
    settings.poll_interval = duration(src, "CONVEYOR_DISPATCH_POLL", d.poll_interval)?;
    settings.concurrency = number(src, "CONVEYOR_DISPATCH_CONCURRENCY", d.concurrency)?;
    settings.dedup_ttl = duration(src, "CONVEYOR_DISPATCH_DEDUP_TTL", d.dedup_ttl)?;
    // Unset, it is the default or the whole de-dup TTL, whichever is shorter.
    settings.dedup_ttl_recorded =
        duration(src, "CONVEYOR_DISPATCH_DEDUP_TTL_RECORDED", d.dedup_ttl_recorded.min(settings.dedup_ttl))?;
    settings.retention = duration(src, "CONVEYOR_OUTBOX_RETENTION", d.retention)?;
    settings.window = number(src, "CONVEYOR_DISPATCH_WINDOW", d.window)?;
    settings.tick = duration(src, "CONVEYOR_DISPATCH_TICK", d.tick)?;
    settings.queue_wait = duration(src, "CONVEYOR_DISPATCH_QUEUE_WAIT", d.queue_wait)?;
    settings.validate().map_err(|e| {
        let variable = |field: &str| VARIABLES.iter().find(|(f, _)| *f == field).map_or("?", |(_, v)| *v);
        let mut reason = e.reason.clone();
        for (field, var) in VARIABLES {
            reason = reason.replace(&format!("`{field}`"), var);
        }
        invalid(variable(e.setting), reason)
    })?;
    Ok(settings)
}

pub use conveyor_jobs::MigrateConfig;

/// Reads and validates the migration configuration (`conveyor migrate`) from any [`Source`].
pub fn migrate_config(src: &dyn Source) -> Result<MigrateConfig, ConfigError> {
    // The roles are the users of the URLs the processes connect with: `migrate` grants them, by name.
    let role = |url: &Secret<String>, name: &'static str| {
        MigrateConfig::role_of(url.expose()).map_err(|e| invalid(name, e.to_string()))
    };
    let owner = postgres_url(src, "CONVEYOR_MIGRATION_DATABASE_URL")?;
    let app = role(&postgres_url(src, "CONVEYOR_DATABASE_URL")?, "CONVEYOR_DATABASE_URL")?;
    let runtime = role(&runtime_database_url(src)?, "CONVEYOR_RUNTIME_DATABASE_URL")?;
    let mut config = MigrateConfig::new(owner.expose(), &app, &runtime)
        .retentions(audit_retention(src)?, dead_letter_retention(src)?);
    if let Some(operator) = operator_database_url(src)? {
        config = config.operator(&role(&operator, "CONVEYOR_OPERATOR_DATABASE_URL")?);
    }
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn valid() -> HashMap<String, String> {
        [
            ("CONVEYOR_DATABASE_URL", "postgres://app:pw@127.0.0.1/conveyor"),
            ("CONVEYOR_REDIS_URL", "redis://127.0.0.1:6379"),
            ("CONVEYOR_JWT_SECRET", "0123456789abcdef0123456789abcdef"),
            ("CONVEYOR_IDEMPOTENCY_KEYS", "k1:0123456789abcdef0123456789abcdef,k0:fedcba9876543210fedcba9876543210"),
            ("CONVEYOR_ENCRYPTION_KEY", "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA="),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
    }

    fn error_with(name: &str, value: Option<&str>) -> String {
        let mut vars = valid();
        match value {
            Some(v) => vars.insert(name.to_owned(), v.to_owned()),
            None => vars.remove(name),
        };
        Config::from_source(&vars).unwrap_err().to_string()
    }

    #[test]
    fn a_complete_environment_parses_with_the_documented_defaults() {
        let config = Config::from_source(&valid()).unwrap();
        assert_eq!(config.http_addr.to_string(), "127.0.0.1:8080");
        assert_eq!(config.admin_addr.to_string(), "127.0.0.1:9090");
        assert_eq!(config.idempotency_ttl, Duration::from_secs(48 * 3600));
        assert_eq!(config.idempotency_keys.len(), 2);
        assert_eq!(config.idempotency_keys[0].id, "k1", "the first key signs");
        assert_eq!(config.redis_prefix, "conveyor");
        assert_eq!(config.dispatcher.dedup_ttl_recorded, Duration::from_secs(15 * 60));
        assert_eq!(config.scenarios.media_decode_memory, 320 * 1024 * 1024);
        assert_eq!(config.scenarios.media_max_concurrent_uploads, 16);
        assert_eq!(config.scenarios.asset_max_duration, Duration::from_secs(600));
        assert_eq!(config.scenarios.asset_min_throughput, 1024);
        assert_eq!(config.scenarios.asset_throughput_window, Duration::from_secs(30));
    }

    #[test]
    fn sizes_take_binary_and_decimal_units() {
        assert_eq!(parse_size("335544320"), Some(320 << 20));
        assert_eq!(parse_size("320MiB"), Some(320 << 20));
        assert_eq!(parse_size("320Mi"), Some(320 << 20));
        assert_eq!(parse_size(" 1GiB "), Some(1 << 30));
        assert_eq!(parse_size("512 KiB"), Some(512 << 10));
        assert_eq!(parse_size("300MB"), Some(300_000_000));
        assert_eq!(parse_size("2G"), Some(2_000_000_000));
        for bad in ["", "MiB", "1.5GiB", "-1", "12 parsecs", "99999999999999TiB"] {
            assert_eq!(parse_size(bad), None, "{bad}");
        }
    }

    #[test]
    fn every_error_names_its_variable() {
        for name in
            ["CONVEYOR_DATABASE_URL", "CONVEYOR_REDIS_URL", "CONVEYOR_IDEMPOTENCY_KEYS", "CONVEYOR_ENCRYPTION_KEY"]
        {
            assert!(error_with(name, None).contains(name), "missing {name}");
        }
        let cases = [
            ("CONVEYOR_DATABASE_URL", "mysql://x"),
            ("CONVEYOR_REDIS_URL", "http://x"),
            ("CONVEYOR_JWT_SECRET", "short"),
            ("CONVEYOR_JWT_PREVIOUS_SECRET", "short"),
            ("CONVEYOR_OPERATOR_JWT_SECRET", "short"),
            // The workspace tokens' key cannot sign an operator's.
            ("CONVEYOR_OPERATOR_JWT_SECRET", "0123456789abcdef0123456789abcdef"),
            ("CONVEYOR_OPERATOR_JWT_PREVIOUS_SECRET", "0123456789abcdef0123456789abcdef"),
            ("CONVEYOR_REDIS_CA_FILE", "/nonexistent/ca.pem"),
            ("CONVEYOR_DATABASE_URL", "postgres://app:pw@db/conveyor?sslmode=sometimes"),
            ("CONVEYOR_DATABASE_URL", "postgres://app:pw@db/conveyor?sslmode=verify-full&sslrootcert=/nonexistent"),
            ("CONVEYOR_IDEMPOTENCY_KEYS", "no-colon"),
            ("CONVEYOR_IDEMPOTENCY_KEYS", "k1:short"),
            ("CONVEYOR_IDEMPOTENCY_KEYS", "k1:0123456789abcdef0123456789abcdef,k1:0123456789abcdef0123456789abcdef"),
            ("CONVEYOR_ENCRYPTION_KEY", "not base64!"),
            ("CONVEYOR_ENCRYPTION_KEY", "AAAA"),
            ("CONVEYOR_HTTP_ADDR", "localhost"),
            ("CONVEYOR_IDEMPOTENCY_TTL", "forever"),
            ("CONVEYOR_IDEMPOTENCY_TTL", "23h"),
            ("CONVEYOR_IDEMPOTENCY_REPLAY_CACHE", "-1"),
            ("CONVEYOR_IDEMPOTENCY_REPLAY_CACHE", "16MiB"),
            ("CONVEYOR_IDEMPOTENCY_REPLAY_CACHE", "1073741825"),
            ("CONVEYOR_MAX_BODY_BYTES", "-1"),
            ("CONVEYOR_MARKETPLACE_URL", "ftp://x"),
            ("CONVEYOR_TRACE_URL", "jaeger.example/trace/{trace_id}"),
            ("CONVEYOR_TRACE_URL", "https://jaeger.example/trace/"),
            ("CONVEYOR_AI_CREDITS_PER_WORKSPACE", "0"),
            ("CONVEYOR_AI_CREDITS_PER_WORKSPACE", "lots"),
            ("CONVEYOR_AI_PROVIDER_URL", "ftp://x"),
            ("CONVEYOR_MEDIA_DECODE_MEMORY", "lots"),
            ("CONVEYOR_MEDIA_DECODE_MEMORY", "0"),
            // Less than twice the largest original (25 MiB by default) plus 16 MiB.
            ("CONVEYOR_MEDIA_DECODE_MEMORY", "64MiB"),
            ("CONVEYOR_MEDIA_MAX_CONCURRENT_UPLOADS", "0"),
            ("CONVEYOR_RUNTIME_DATABASE_URL", "mysql://x"),
            ("CONVEYOR_AUDIT_RETENTION", "1h"),
            ("CONVEYOR_DEAD_LETTER_RETENTION", "12h"),
            ("CONVEYOR_WORKER_MAX_DELIVERIES", "0"),
            ("CONVEYOR_WORKER_QUEUE_CONCURRENCY", "transfers"),
            ("CONVEYOR_WORKER_QUEUE_CONCURRENCY", "transfers=0"),
            ("CONVEYOR_WORKER_QUEUE_CONCURRENCY", "Bad Queue=2"),
            ("CONVEYOR_WORKER_QUEUE_CONCURRENCY", "media=2,media=3"),
            // Shorter than the de-dup window (24 h): a repeated hand-off could outlive its job's row.
            ("CONVEYOR_OUTBOX_RETENTION", "1h"),
            ("CONVEYOR_OPERATION_KEEPALIVE", "0s"),
            // Shorter than four leases (default 30 s), then longer than the de-dup key's whole life (24 h).
            ("CONVEYOR_DISPATCH_DEDUP_TTL_RECORDED", "1m"),
            ("CONVEYOR_DISPATCH_DEDUP_TTL_RECORDED", "25h"),
            // Shorter than two keep-alives (default 1 min): running jobs would be re-driven.
            ("CONVEYOR_RECONCILE_AFTER", "90s"),
            // Shorter than the gate's looks (20 ms), or longer than a minute.
            ("CONVEYOR_DISPATCH_QUEUE_WAIT", "5ms"),
            ("CONVEYOR_DISPATCH_QUEUE_WAIT", "2m"),
        ];
        for (name, value) in cases {
            assert!(error_with(name, Some(value)).contains(name), "{name}={value}");
        }
    }

    #[test]
    fn the_transfer_deadline_and_minimum_throughput_refuse_bad_values_naming_their_variable() {
        let cases = [
            ("CONVEYOR_ASSET_MAX_DURATION", "forever"),
            ("CONVEYOR_ASSET_MAX_DURATION", "-1s"),
            ("CONVEYOR_ASSET_MAX_DURATION", "0s"),
            ("CONVEYOR_ASSET_MAX_DURATION", "500ms"),
            ("CONVEYOR_ASSET_MAX_DURATION", "25h"),
            ("CONVEYOR_ASSET_MIN_THROUGHPUT", "fast"),
            ("CONVEYOR_ASSET_MIN_THROUGHPUT", "-1"),
            ("CONVEYOR_ASSET_MIN_THROUGHPUT", "1.5KiB"),
            ("CONVEYOR_ASSET_MIN_THROUGHPUT", "1KiB/min"),
            ("CONVEYOR_ASSET_MIN_THROUGHPUT", "2GiB"),
            ("CONVEYOR_ASSET_THROUGHPUT_WINDOW", "soon"),
            ("CONVEYOR_ASSET_THROUGHPUT_WINDOW", "0s"),
            ("CONVEYOR_ASSET_THROUGHPUT_WINDOW", "500ms"),
            ("CONVEYOR_ASSET_THROUGHPUT_WINDOW", "2h"),
        ];
        for (name, value) in cases {
            let mut vars = valid();
            vars.insert(name.to_owned(), value.to_owned());
            let result = Config::from_source(&vars);
            let Err(error) = result else { panic!("{name}={value} was accepted") };
            assert_eq!(error.variable(), name, "{name}={value}: {error}");
            assert!(error.to_string().starts_with(&format!("{name} is invalid: ")), "{name}={value}: {error}");
        }
        for (name, value) in [
            ("CONVEYOR_ASSET_MAX_DURATION", "1s"),
            ("CONVEYOR_ASSET_MAX_DURATION", "24h"),
            ("CONVEYOR_ASSET_MIN_THROUGHPUT", "0"),
            ("CONVEYOR_ASSET_MIN_THROUGHPUT", "512"),
            ("CONVEYOR_ASSET_MIN_THROUGHPUT", "2KiB/s"),
            ("CONVEYOR_ASSET_MIN_THROUGHPUT", "1GiB"),
            ("CONVEYOR_ASSET_THROUGHPUT_WINDOW", "1s"),
            ("CONVEYOR_ASSET_THROUGHPUT_WINDOW", "1h"),
        ] {
            let mut vars = valid();
            vars.insert(name.to_owned(), value.to_owned());
            assert!(Config::from_source(&vars).is_ok(), "{name}={value} is refused");
        }
    }

    #[test]
    fn errors_and_debug_output_never_show_a_secret() {
        let secret = "0123456789abcdef0123456789abcdef-very-secret";
        let err = error_with("CONVEYOR_ENCRYPTION_KEY", Some(secret));
        assert!(!err.contains(secret), "{err}");
        let mut vars = valid();
        vars.insert("CONVEYOR_JWT_SECRET".into(), secret.into());
        let config = Config::from_source(&vars).unwrap();
        let printed = format!("{config:?}");
        assert!(!printed.contains(secret) && !printed.contains("app:pw"), "{printed}");
        assert!(printed.contains("[redacted]"));
    }
}
