//! The configuration reference of the docs (`docs/configuration.md`), generated from [`VARIABLES`]: each variable
//! with the roles that read it, its default or the roles that require it, whether it is a secret, and what it is. A
//! test keeps the docs' table equal to [`markdown`]; `conveyor config reference` prints it.

use super::variables::{self, VARIABLES, Variable};

/// The docs' longer text for a variable, where one line of `--help` says less than a reader of the docs needs
/// (Markdown, links relative to `docs/`). Every other variable's entry is its `--help` line.
const DETAILS: &[(&str, &str)] = &[
    (
        "CONVEYOR_DATABASE_URL",
        "PostgreSQL URL of the application role (not owner, not superuser, no `BYPASSRLS`); TLS as libpq reads it: `?sslmode=verify-full&sslrootcert=/etc/conveyor/pg-ca.pem` (`require`, `verify-ca`, `verify-full` never fall back to plain text; `sslcert`/`sslkey` for a client certificate), the same in every PostgreSQL URL below",
    ),
    ("CONVEYOR_MIGRATION_DATABASE_URL", "PostgreSQL URL of the owner role, for `migrate`"),
    (
        "CONVEYOR_RUNTIME_DATABASE_URL",
        "PostgreSQL URL of the runtime role (not owner, not superuser, no `BYPASSRLS`, not the application role): the dispatcher, maintenance and the worker's bookkeeping call the functions that work across workspaces through it; the API ignores it",
    ),
    (
        "CONVEYOR_REDIS_URL",
        "`redis://`, `redis-cluster://h1:p1,h2:p2,…` (or fred's `?node=h2:p2`), `redis-sentinel://h:p/0?sentinelServiceName=…`; over TLS `rediss://`, `rediss-cluster://`, `rediss-sentinel://` (never plain text; `server/tests/api/backend_tls.rs` runs `rediss://` against a real TLS-only Redis, `server/tests/api/cluster.rs` (`over_tls`) runs `rediss-cluster://` and `rediss-sentinel://` against a TLS-only cluster and sentinel setup, a master SIGKILLed mid-run under each)",
    ),
    (
        "CONVEYOR_REDIS_CA_FILE",
        "PEM CA that signed Redis's certificate, trusted instead of the system's roots (`rediss` URLs only)",
    ),
    (
        "CONVEYOR_STREAM_PARTITIONS",
        "streams per queue (1–1024); raise it to spread a hot queue over a cluster's masters ([Redis layout](architecture.md#redis-layout)); never lower it",
    ),
    ("CONVEYOR_REDIS_PREFIX", "prefix of every Redis key"),
    ("CONVEYOR_HTTP_ADDR", "API listen address"),
    (
        "CONVEYOR_ADMIN_ADDR",
        "the admin listener: `/metrics`, `/healthz`, `/readyz`, and for the `api` role the operator UI (`/ui`) and the admin API (`/admin/v1`)",
    ),
    (
        "CONVEYOR_JWT_SECRET",
        "HS256 secret of the workspace bearer tokens, at least 32 bytes; read by the `api` role alone (the other roles verify no token and drop it)",
    ),
    ("CONVEYOR_JWT_PREVIOUS_SECRET", "the secret being rotated out: tokens it signed pass until it is unset"),
    (
        "CONVEYOR_OPERATOR_JWT_SECRET",
        "HS256 secret of operator JWTs (`aud: conveyor-operator`, `operator: true`), never the workspace tokens' key (refused when equal); `api` only; unset: only `CONVEYOR_ADMIN_TOKEN` opens `/admin/v1` and `/ui`",
    ),
    ("CONVEYOR_OPERATOR_JWT_PREVIOUS_SECRET", "the operator secret being rotated out"),
    ("CONVEYOR_IDEMPOTENCY_KEYS", "fingerprint HMAC keys, `id:secret[,id:secret…]`; the first signs, all verify"),
    ("CONVEYOR_IDEMPOTENCY_TTL", "retention of idempotency records (never below `24h`)"),
    ("CONVEYOR_ENCRYPTION_KEY", "32-byte key, base64, sealing stored credentials (AES-256-GCM)"),
    ("CONVEYOR_MARKETPLACE_URL", "base URL of the marketplace API"),
    ("CONVEYOR_MAX_BODY_BYTES", "largest accepted request body"),
    ("CONVEYOR_SHUTDOWN_GRACE", "grace period for in-flight work on SIGTERM"),
    ("CONVEYOR_DATABASE_MAX_CONNECTIONS", "pool size of one process"),
    ("CONVEYOR_LOG_JSON", "JSON log lines"),
    (
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTLP/HTTP collector base URL (`http://collector:4318`); traces go to `/v1/traces`; unset: no traces. `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, `_HEADERS`, `_TIMEOUT`, `OTEL_TRACES_SAMPLER`, `OTEL_BSP_*`, `OTEL_SDK_DISABLED` apply",
    ),
    ("OTEL_SERVICE_NAME", "`service.name` of the exported spans"),
    (
        "CONVEYOR_REDIS_COMMAND_TIMEOUT",
        "time-out of one Redis command (fails fast instead of queueing while Redis is away)",
    ),
    (
        "CONVEYOR_READY_REDIS_GRACE",
        "how long Redis may fail before `/readyz` answers 503 (`0`: at once); PostgreSQL down or a migration missing answer 503 at once",
    ),
    ("CONVEYOR_DISPATCH_BATCH", "events claimed per workspace and batch"),
    ("CONVEYOR_DISPATCH_LEASE", "how long a claim holds events (`locked_until`)"),
    ("CONVEYOR_DISPATCH_MAX_ATTEMPTS", "failed hand-offs before `dead_letter`"),
    (
        "CONVEYOR_DISPATCH_POLL",
        "sweep of every workspace beside LISTEN/NOTIFY (retries backing off, lost notifications)",
    ),
    (
        "CONVEYOR_DISPATCH_TICK",
        "while a dispatcher relays, how often it looks for new jobs without a notification; enqueues skip their `NOTIFY` (and its commit lock) while one is awake. `0`: off, every enqueue notifies",
    ),
    (
        "CONVEYOR_DISPATCH_QUEUE_WAIT",
        "how long a job should wait in its queue's stream for a worker, at most: a dispatcher relays into a queue only as many jobs as its workers take in that time at their measured pace (at least 4 waiting), so a flood waits in PostgreSQL, behind the light workspaces, not in the stream in front of everyone. `0`: no gate (the window alone)",
    ),
    (
        "CONVEYOR_DISPATCH_CONCURRENCY",
        "groups of workspaces relayed at once (each group: one claim, one pipeline, one mark)",
    ),
    (
        "CONVEYOR_DISPATCH_DEDUP_TTL",
        "life of an event's de-dup key in Redis until its hand-off is recorded as dispatched",
    ),
    (
        "CONVEYOR_DISPATCH_DEDUP_TTL_RECORDED",
        "what is left of it once the hand-off is recorded: at least four leases, and longer than PostgreSQL takes to recover from a crash (the relay's marks commit asynchronously)",
    ),
    (
        "CONVEYOR_DISPATCH_WINDOW",
        "jobs of one workspace handed to workers and not yet ended, at most (times its weight); 0 turns fairness off",
    ),
    (
        "CONVEYOR_OUTBOX_RETENTION",
        "how long dispatched, succeeded and canceled jobs are kept (failed ones stay for `conveyor dlq` until `CONVEYOR_DEAD_LETTER_RETENTION`); never shorter than `CONVEYOR_DISPATCH_DEDUP_TTL`",
    ),
    (
        "CONVEYOR_AUDIT_RETENTION",
        "how long the operators' audit trail (`conveyor_admin_audit`) is kept, at least `1d`; `conveyor migrate` records it as the floor the purge never goes below (set it for `migrate` too)",
    ),
    (
        "CONVEYOR_DEAD_LETTER_RETENTION",
        "how long dead letters are kept before maintenance discards them (each purge on the audit trail), at least `1d`; `conveyor migrate` records it as the floor (set it for `migrate` too)",
    ),
    ("CONVEYOR_WORKER_CONCURRENCY", "jobs a worker runs at once"),
    ("CONVEYOR_WORKER_VISIBILITY", "idle time after which a dead consumer's entry is taken over"),
    (
        "CONVEYOR_WORKER_QUEUE_CONCURRENCY",
        "slots of each queue named, at most, within `CONVEYOR_WORKER_CONCURRENCY` (`transfers=4,media=8`); a queue not named may take every slot but one for each other queue, so one queue's jobs (a slow source, a flood) never hold them all",
    ),
    (
        "CONVEYOR_WORKER_MAX_DELIVERIES",
        "deliveries of a job that may end with their worker stopped (killed, out of memory) before the job is dead-lettered instead of run again",
    ),
    ("CONVEYOR_MAINTENANCE_INTERVAL", "how often maintenance runs"),
    (
        "CONVEYOR_RECONCILE_AFTER",
        "an unfinished operation without progress this long is re-driven; so is a job without an operation dispatched this long ago whose stream entry Redis lost",
    ),
    ("CONVEYOR_OPERATION_KEEPALIVE", "how often a running job refreshes its operation (at most half the above)"),
    ("CONVEYOR_DATA_DIR", "where the embedded object store lives when `CONVEYOR_OBJECT_STORE_URL` is unset"),
    (
        "CONVEYOR_OBJECT_STORE_URL",
        "`file:///absolute/dir` or `s3://bucket[/prefix]` (`AWS_*` variables for credentials, region, endpoint)",
    ),
    ("CONVEYOR_MEDIA_DECODE_PERMITS", "images decoded at once by one worker"),
    (
        "CONVEYOR_MEDIA_DECODE_MEMORY",
        "memory the images one worker decodes at once hold together, a size (`320MiB`, `1GiB`, `335544320`; `Mi`/`Gi` as Kubernetes writes them): each decode reserves, from its header and before a pixel is decoded, the original, the pixels at 8 bits a sample, the decoder's working memory and the derivatives, waiting while others hold it; an image needing more than all of it is rejected `TOO_MANY_PIXELS`. At least twice `CONVEYOR_MEDIA_MAX_BYTES` + 16 MiB; keep it 192 MiB under the worker's memory limit (the chart's check does)",
    ),
    (
        "CONVEYOR_MEDIA_MAX_CONCURRENT_UPLOADS",
        "uploads one API process receives at once, each holding one 5 MiB part; beyond it `503 UPLOADS_BUSY` with `Retry-After` (96 MiB + 6 MiB each must fit the API's memory limit)",
    ),
    ("CONVEYOR_ASSET_ALLOWED_NETWORKS", "CIDRs transfers may reach although refused by default (development, tests)"),
    (
        "CONVEYOR_ASSET_ALLOWED_PORTS",
        "ports transfers may reach besides 80 and 443, on any host, comma-separated (`8080,8443`; each 1–65535); read by `api` and `worker`",
    ),
    ("CONVEYOR_ASSET_MAX_BYTES", "largest transferred file"),
    (
        "CONVEYOR_ASSET_MAX_DURATION",
        "longest run of a transfer's download, from the run's start (1s–24h); past it the run fails `SOURCE_TOO_SLOW`. The transfer job's time-out is this plus 5 minutes (to assemble and commit), so the deadline ends a slow run first",
    ),
    (
        "CONVEYOR_ASSET_MIN_THROUGHPUT",
        "bytes a second a transfer must average over each `CONVEYOR_ASSET_THROUGHPUT_WINDOW` after the first (a size: `1KiB`, `2KiB/s`, `1024`; at most `1GiB`); under it the run fails `SOURCE_TOO_SLOW`; `0` turns the check off",
    ),
    (
        "CONVEYOR_ASSET_THROUGHPUT_WINDOW",
        "the window that average is taken over, and the grace at a run's start before the first window (1s–1h)",
    ),
    ("CONVEYOR_TLS_CA_FILE", "PEM certificates trusted besides the web roots by every external client"),
    ("CONVEYOR_CATALOG_PAGE_SIZE", "products asked per catalog page (1–1000)"),
    ("CONVEYOR_AI_CREDITS_PER_WORKSPACE", "AI credits a workspace may reserve per calendar month (UTC)"),
    ("CONVEYOR_AI_PROVIDER_URL", "base URL of the AI provider"),
];

/// What a variable without a literal default does when unset, where that is something (the table's default column).
const UNSET: &[(&str, &str)] = &[
    ("CONVEYOR_REDIS_CA_FILE", "the system's roots"),
    ("CONVEYOR_OBJECT_STORE_URL", "`file://<data dir>/objects`"),
    ("CONVEYOR_MEDIA_DECODE_PERMITS", "one per core"),
    ("CONVEYOR_ASSET_ALLOWED_PORTS", "empty: 80 and 443 only"),
    ("CONVEYOR_AI_PROVIDER_URL", "`CONVEYOR_MARKETPLACE_URL`"),
    ("OTEL_SERVICE_NAME", "`conveyor-<role>`"),
];

/// The roles of a mask, as the commands name them.
fn roles(mask: u8) -> String {
    let names = [
        (variables::API, "api"),
        (variables::DISPATCHER, "dispatcher"),
        (variables::WORKER, "worker"),
        (variables::MAINTENANCE, "maintenance"),
        (variables::MIGRATE, "migrate"),
        (variables::OPERATOR, "operator commands"),
    ];
    let named: Vec<&str> = names.iter().filter(|(bit, _)| mask & bit != 0).map(|(_, name)| *name).collect();
    named.join(", ")
}

fn meaning(v: &Variable) -> &'static str {
    DETAILS.iter().find(|(name, _)| *name == v.name).map_or(v.help, |(_, text)| text)
}

/// The reference table, one row per variable in the order of [`VARIABLES`].
pub fn markdown() -> String {
    let mut table = String::from("| variable | meaning | read by | default |\n|---|---|---|---|\n");
    for v in VARIABLES {
        let unset = UNSET.iter().find(|(name, _)| *name == v.name).map(|(_, text)| *text);
        let default = match (v.required, v.default) {
            (0, Some(value)) => format!("`{value}`"),
            (0, None) => unset.unwrap_or("—").to_owned(),
            (required, _) => format!("required by {}", roles(required)),
        };
        let secret = if v.secret { " (a secret: never printed)" } else { "" };
        let cell = |text: &str| text.replace('|', "\\|");
        table.push_str(&format!(
            "| `{}` | {}{secret} | {} | {} |\n",
            v.name,
            cell(meaning(v)),
            roles(v.roles),
            cell(&default)
        ));
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    const BEGIN: &str = "<!-- generated from server/src/config/variables.rs by `conveyor config reference` -->\n";
    const END: &str = "<!-- end of the generated reference -->";

    /// The docs' table is the generated one: a variable added, renamed or given another default changes the docs.
    #[test]
    fn the_docs_reference_is_the_table_the_code_reads() {
        let docs = include_str!("../../../docs/configuration.md");
        let start = docs.find(BEGIN).expect("docs/configuration.md marks its generated reference") + BEGIN.len();
        let end = start + docs[start..].find(END).expect("and its end");
        assert_eq!(
            &docs[start..end],
            markdown(),
            "docs/configuration.md is out of date: run scripts/config-reference to write the table again"
        );
    }

    #[test]
    fn every_detail_names_a_variable_of_the_table() {
        for (name, _) in DETAILS.iter().chain(UNSET) {
            assert!(VARIABLES.iter().any(|v| v.name == *name), "{name} is not a variable");
        }
    }
}
