//! Every variable Conveyor reads, with the roles that read it, its default and whether it is a secret: what
//! `--help` of each role lists and what `conveyor config check` prints. The parsers in `config.rs` stay the one
//! place that validates a value; a test keeps this table and them in step.

/// The HTTP API (`conveyor api`).
pub const API: u8 = 1;
/// The outbox relay (`conveyor dispatcher`).
pub const DISPATCHER: u8 = 2;
/// The job runners (`conveyor worker`).
pub const WORKER: u8 = 4;
/// Retention and reconciliation (`conveyor maintenance`).
pub const MAINTENANCE: u8 = 8;
/// `conveyor migrate`.
pub const MIGRATE: u8 = 16;
/// The operator commands (`conveyor queues|jobs|dlq`).
pub const OPERATOR: u8 = 32;
/// Every long-running role (each also serves the admin listener).
pub const SERVERS: u8 = API | DISPATCHER | WORKER | MAINTENANCE;

/// One variable.
#[derive(Clone, Copy, Debug)]
pub struct Variable {
    /// Its name.
    pub name: &'static str,
    /// The roles that read it (a mask of the constants above).
    pub roles: u8,
    /// Its default as written in a value, or `None` when it has none (required, or optional and unset).
    pub default: Option<&'static str>,
    /// Required by these roles (a mask): they refuse to start without it.
    pub required: u8,
    /// A secret: never printed, not even by `config check`.
    pub secret: bool,
    /// What it is.
    pub help: &'static str,
}

const fn var(name: &'static str, roles: u8, default: Option<&'static str>, help: &'static str) -> Variable {
    Variable { name, roles, default, required: 0, secret: false, help }
}

const fn required(name: &'static str, roles: u8, secret: bool, help: &'static str) -> Variable {
    Variable { name, roles, default: None, required: roles, secret, help }
}

const fn secret(name: &'static str, roles: u8, help: &'static str) -> Variable {
    Variable { name, roles, default: None, required: 0, secret: true, help }
}

/// Every variable, in the order `--help` and `config check` show them.
pub const VARIABLES: &[Variable] = &[
    required(
        "CONVEYOR_DATABASE_URL",
        SERVERS | MIGRATE | OPERATOR,
        true,
        "PostgreSQL URL of the application role (subject to row-level security)",
    ),
    required("CONVEYOR_MIGRATION_DATABASE_URL", MIGRATE, true, "PostgreSQL URL of the owner role"),
    Variable {
        name: "CONVEYOR_RUNTIME_DATABASE_URL",
        roles: DISPATCHER | WORKER | MAINTENANCE | MIGRATE,
        default: None,
        required: DISPATCHER | WORKER | MAINTENANCE | MIGRATE,
        secret: true,
        help: "PostgreSQL URL of the runtime role: relay, maintenance, the worker's bookkeeping (works across \
               workspaces; never the application role)",
    },
    secret(
        "CONVEYOR_OPERATOR_DATABASE_URL",
        SERVERS | MIGRATE | OPERATOR,
        "PostgreSQL URL of the operator role: admin API, web UI, operator commands (off when unset)",
    ),
    secret("CONVEYOR_ADMIN_TOKEN", API, "operator token for /admin/v1 and /ui (at least 32 bytes)"),
    required(
        "CONVEYOR_REDIS_URL",
        SERVERS | OPERATOR,
        true,
        "redis[s]://, redis[s]-cluster:// or redis[s]-sentinel:// URL",
    ),
    var("CONVEYOR_REDIS_PREFIX", SERVERS | OPERATOR, Some("conveyor"), "prefix of every Redis key"),
    var("CONVEYOR_REDIS_CA_FILE", SERVERS | OPERATOR, None, "PEM file of the CA that signs Redis's TLS certificate"),
    var(
        "CONVEYOR_REDIS_CLIENT_CERT_FILE",
        SERVERS | OPERATOR,
        None,
        "PEM file of a client certificate for Redis's TLS",
    ),
    var("CONVEYOR_REDIS_CLIENT_KEY_FILE", SERVERS | OPERATOR, None, "PEM file of that client certificate's key"),
    var("CONVEYOR_REDIS_COMMAND_TIMEOUT", SERVERS, Some("5s"), "time-out of one Redis command"),
    var(
        "CONVEYOR_STREAM_PARTITIONS",
        SERVERS,
        Some("1"),
        "streams per queue (1-1024); raise it to spread a hot queue over cluster masters, never lower it",
    ),
    var("CONVEYOR_READY_REDIS_GRACE", SERVERS, Some("10s"), "how long Redis may fail before /readyz says not ready"),
    var("CONVEYOR_HTTP_ADDR", API, Some("127.0.0.1:8080"), "API listen address"),
    var("CONVEYOR_ADMIN_ADDR", SERVERS, Some("127.0.0.1:9090"), "admin listener: metrics, health, admin API, UI"),
    required("CONVEYOR_JWT_SECRET", API, true, "HS256 secret of workspace bearer tokens (at least 32 bytes)"),
    secret("CONVEYOR_JWT_PREVIOUS_SECRET", API, "the workspace tokens' previous secret, accepted while it rotates"),
    secret(
        "CONVEYOR_OPERATOR_JWT_SECRET",
        API,
        "HS256 secret of operator JWTs, never the workspace tokens' (32+ bytes)",
    ),
    secret(
        "CONVEYOR_OPERATOR_JWT_PREVIOUS_SECRET",
        API,
        "the operator JWTs' previous secret, accepted while it rotates",
    ),
    required("CONVEYOR_IDEMPOTENCY_KEYS", SERVERS, true, "fingerprint keys, id:secret[,id:secret...]"),
    var("CONVEYOR_IDEMPOTENCY_TTL", API | MAINTENANCE, Some("48h"), "retention of idempotency records (>= 24h)"),
    var(
        "CONVEYOR_IDEMPOTENCY_REPLAY_CACHE",
        API,
        Some("16777216"),
        "bytes of completed idempotency records kept in memory, to answer their replays without PostgreSQL for up \
         to 10 min (0: none; at most 1 GiB)",
    ),
    required("CONVEYOR_ENCRYPTION_KEY", SERVERS, true, "32-byte key, base64, sealing stored credentials"),
    var("CONVEYOR_MARKETPLACE_URL", WORKER, None, "base URL of the marketplace API (required by workers)"),
    var(
        "CONVEYOR_TRACE_URL",
        API,
        None,
        "a trace's page in your tracing UI, `{trace_id}` standing for the trace's id \
         (`https://jaeger.example/trace/{trace_id}`): the operator UI's job page links to the trace of the request \
         that enqueued the job; unset, it shows the trace id",
    ),
    var("CONVEYOR_MAX_BODY_BYTES", API, Some("65536"), "largest accepted request body"),
    var("CONVEYOR_SHUTDOWN_GRACE", SERVERS, Some("30s"), "grace period for in-flight work on SIGTERM"),
    var("CONVEYOR_DATABASE_MAX_CONNECTIONS", SERVERS, Some("16"), "PostgreSQL pool size of one process"),
    var("CONVEYOR_LOG_JSON", SERVERS | MIGRATE | OPERATOR, Some("false"), "JSON log lines"),
    var("CONVEYOR_DISPATCH_BATCH", DISPATCHER, Some("500"), "events claimed per workspace and batch"),
    var("CONVEYOR_DISPATCH_LEASE", DISPATCHER, Some("30s"), "how long a claim holds events"),
    var("CONVEYOR_DISPATCH_MAX_ATTEMPTS", DISPATCHER, Some("12"), "failed hand-offs before a dead letter"),
    var("CONVEYOR_DISPATCH_BACKOFF_BASE", DISPATCHER, Some("1s"), "first back-off of a failed hand-off"),
    var("CONVEYOR_DISPATCH_BACKOFF_MAX", DISPATCHER, Some("10m"), "largest back-off of a failed hand-off"),
    var("CONVEYOR_DISPATCH_POLL", DISPATCHER, Some("1s"), "interval of the sweep beside notifications"),
    var(
        "CONVEYOR_DISPATCH_TICK",
        DISPATCHER,
        Some("2ms"),
        "while relaying, how often to look for new jobs unnotified (0: off, every enqueue notifies)",
    ),
    var(
        "CONVEYOR_DISPATCH_QUEUE_WAIT",
        DISPATCHER,
        Some("50ms"),
        "longest wait in a queue's stream, at the workers' measured pace (0: no gate)",
    ),
    var("CONVEYOR_DISPATCH_CONCURRENCY", DISPATCHER, Some("4"), "groups of workspaces relayed at once"),
    var("CONVEYOR_DISPATCH_DEDUP_TTL", DISPATCHER, Some("24h"), "life of an event's de-dup key in Redis"),
    var(
        "CONVEYOR_DISPATCH_DEDUP_TTL_RECORDED",
        DISPATCHER,
        Some("15m"),
        "life of a de-dup key once its dispatch is recorded (at most CONVEYOR_DISPATCH_DEDUP_TTL)",
    ),
    var("CONVEYOR_DISPATCH_WINDOW", DISPATCHER, Some("256"), "jobs per workspace in the workers' hands (0: off)"),
    var("CONVEYOR_OUTBOX_RETENTION", MAINTENANCE, Some("7d"), "how long ended jobs are kept"),
    var(
        "CONVEYOR_AUDIT_RETENTION",
        MAINTENANCE | MIGRATE,
        Some("90d"),
        "how long the operators' audit trail is kept (>= 1d; migrate writes it as the floor of every purge)",
    ),
    var(
        "CONVEYOR_DEAD_LETTER_RETENTION",
        MAINTENANCE | MIGRATE,
        Some("30d"),
        "how long dead letters are kept before maintenance discards them (>= 1d; migrate writes the floor)",
    ),
    var("CONVEYOR_WORKER_CONCURRENCY", WORKER, Some("16"), "jobs a worker process runs at once"),
    var(
        "CONVEYOR_WORKER_VISIBILITY",
        API | WORKER,
        Some("5s"),
        "idle time before a dead consumer's entry is reclaimed (the operator UI shows a consumer idle past it stalled)",
    ),
    var(
        "CONVEYOR_WORKER_QUEUE_CONCURRENCY",
        WORKER,
        None,
        "slots of each queue named, at most (transfers=4,media=8); others: all but one per other queue",
    ),
    var(
        "CONVEYOR_WORKER_MAX_DELIVERIES",
        WORKER,
        Some("5"),
        "times a job may stop its worker before it is dead-lettered",
    ),
    var("CONVEYOR_JOB_TIMEOUT", WORKER, Some("60s"), "longest run of one job"),
    var("CONVEYOR_JOB_MAX_ATTEMPTS", WORKER, Some("5"), "runs of a job before it is dead-lettered"),
    var("CONVEYOR_MAINTENANCE_INTERVAL", MAINTENANCE, Some("30s"), "how often maintenance runs"),
    var("CONVEYOR_RECONCILE_AFTER", MAINTENANCE, Some("5m"), "an operation silent this long is re-driven"),
    var("CONVEYOR_OPERATION_KEEPALIVE", WORKER, Some("1m"), "how often a running job shows it is alive"),
    var("CONVEYOR_OBJECT_STORE_URL", API | WORKER, None, "file:///dir or s3://bucket/prefix (default under DATA_DIR)"),
    var("CONVEYOR_DATA_DIR", API | WORKER, Some("./data"), "local data directory (file:// object store)"),
    var("CONVEYOR_MEDIA_MAX_BYTES", API | WORKER, Some("26214400"), "largest media object"),
    var("CONVEYOR_MEDIA_MAX_PIXELS", WORKER, Some("64000000"), "largest width x height decoded"),
    var("CONVEYOR_MEDIA_DECODE_PERMITS", WORKER, None, "images decoded at once (default: one per CPU core)"),
    var(
        "CONVEYOR_MEDIA_DECODE_MEMORY",
        WORKER,
        Some("320MiB"),
        "memory the images decoded at once may hold together, reserved from each header (a size: 320MiB, 1GiB)",
    ),
    var(
        "CONVEYOR_MEDIA_MAX_CONCURRENT_UPLOADS",
        API,
        Some("16"),
        "uploads received at once by one API process (each holds at most a 5 MiB part); beyond it 503",
    ),
    var(
        "CONVEYOR_ASSET_ALLOWED_NETWORKS",
        API | WORKER,
        None,
        "CIDRs a transfer may reach although refused by default",
    ),
    var("CONVEYOR_ASSET_ALLOWED_PORTS", API | WORKER, None, "ports a transfer may reach besides 80 and 443 (8080,...)"),
    var("CONVEYOR_ASSET_MAX_BYTES", WORKER, Some("104857600"), "largest transferred file"),
    var("CONVEYOR_ASSET_CONNECT_TIMEOUT", WORKER, Some("10s"), "connect time-out of a transfer"),
    var("CONVEYOR_ASSET_READ_TIMEOUT", WORKER, Some("30s"), "longest wait for a transfer's next bytes"),
    var(
        "CONVEYOR_ASSET_MAX_DURATION",
        WORKER,
        Some("10m"),
        "longest run of a transfer (1s-24h), then SOURCE_TOO_SLOW; its job's time-out is this plus 5m",
    ),
    var(
        "CONVEYOR_ASSET_MIN_THROUGHPUT",
        WORKER,
        Some("1KiB"),
        "bytes a second a transfer must average over each window after the first, else SOURCE_TOO_SLOW (0: off)",
    ),
    var(
        "CONVEYOR_ASSET_THROUGHPUT_WINDOW",
        WORKER,
        Some("30s"),
        "window of that average, and the grace at a transfer run's start (1s-1h)",
    ),
    var("CONVEYOR_TLS_CA_FILE", WORKER, None, "PEM certificates trusted besides the built-in roots"),
    var("CONVEYOR_CATALOG_PAGE_SIZE", WORKER, Some("200"), "products asked per catalog page (1 to 1000)"),
    var("CONVEYOR_AI_CREDITS_PER_WORKSPACE", API, Some("1000"), "AI credits a workspace may reserve per month"),
    var("CONVEYOR_AI_PROVIDER_URL", WORKER, None, "base URL of the AI provider (default: the marketplace URL)"),
    var(
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        SERVERS,
        None,
        "OTLP/HTTP collector base URL; traces are exported only when it (or ..._TRACES_ENDPOINT) is set",
    ),
    var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", SERVERS, None, "OTLP/HTTP traces URL (overrides the base URL)"),
    var("OTEL_SERVICE_NAME", SERVERS, None, "service name of exported spans (default: conveyor-<role>)"),
];

/// The variables `role` (one of the constants above) reads, as `--help` text.
pub fn help_for(role: u8) -> String {
    let mut text = String::from("Environment variables:\n");
    for v in VARIABLES.iter().filter(|v| v.roles & role != 0) {
        let note = match (v.required & role != 0, v.default) {
            (true, _) => " [required]".to_owned(),
            (false, Some(d)) => format!(" [default: {d}]"),
            (false, None) => String::new(),
        };
        text.push_str(&format!("  {}{note}\n      {}\n", v.name, v.help));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `CONVEYOR_*` name the parsers read is in the table, and the table names nothing they do not read.
    #[test]
    fn the_table_names_exactly_the_variables_the_parsers_read() {
        let source = include_str!("../config.rs");
        let mut read: Vec<&str> = source
            .match_indices("\"CONVEYOR_")
            .map(|(i, _)| {
                let rest = &source[i + 1..];
                &rest[..rest.find('"').expect("a closing quote")]
            })
            .collect();
        read.sort_unstable();
        read.dedup();
        let mut listed: Vec<&str> =
            VARIABLES.iter().map(|v| v.name).filter(|name| name.starts_with("CONVEYOR_")).collect();
        listed.sort_unstable();
        let before = listed.len();
        listed.dedup();
        assert_eq!(before, listed.len(), "a variable is listed twice");
        assert_eq!(read, listed, "src/config.rs and src/config/variables.rs disagree");
    }

    #[test]
    fn each_role_lists_its_own_variables() {
        let worker = help_for(WORKER);
        assert!(worker.contains("CONVEYOR_WORKER_CONCURRENCY [default: 16]"), "{worker}");
        assert!(worker.contains("CONVEYOR_DATABASE_URL [required]"), "{worker}");
        assert!(worker.contains("CONVEYOR_RUNTIME_DATABASE_URL [required]"), "{worker}");
        assert!(!help_for(API).contains("CONVEYOR_RUNTIME_DATABASE_URL"), "the API never holds the runtime role");
        assert!(!worker.contains("CONVEYOR_HTTP_ADDR"), "{worker}");
        let migrate = help_for(MIGRATE);
        assert!(migrate.contains("CONVEYOR_MIGRATION_DATABASE_URL [required]"), "{migrate}");
        assert!(!migrate.contains("CONVEYOR_REDIS_URL"), "{migrate}");
    }
}
