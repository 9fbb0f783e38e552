//! The `conveyor` binary: parses the command line and hands over to the library.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use conveyor_server::app::{self, Role};
use conveyor_server::auth::{Principal, TokenKeys};
use conveyor_server::config::{self, Config, Env};
use conveyor_shop::adapters::sandbox::{Sandbox, SandboxTls, Settings};
use output::Output;
use uuid::Uuid;

mod output;

/// mimalloc instead of glibc's malloc: a worker allocates and frees many small buffers per job (Redis frames,
/// strings, task state), where glibc's malloc took about 15% of a drain's CPU. Its v2 line (the `v2` feature): over a
/// million jobs (`scripts/bench soak`) the dispatcher's RSS grew 15% on v3 and 4% on v2, at the same CPU per job. The
/// `system-allocator` feature keeps glibc's, for heap profilers that hook `malloc`.
#[cfg(not(feature = "system-allocator"))]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(name = "conveyor", version, about = "Transactional outbox, idempotent writes and Redis Streams workers")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Apply migrations as the owner role and grant the application role; `migrate status` says what is applied.
    Migrate {
        #[command(subcommand)]
        command: Option<MigrateCommand>,
    },
    /// Serve the HTTP API (and the admin endpoints).
    Api,
    /// Relay the outbox into Redis Streams.
    Dispatcher,
    /// Consume the streams and run the job handlers.
    Worker,
    /// Retention of expired records (and, later, the reconciler).
    Maintenance,
    /// Run every role in one process (development, demos).
    All,
    /// Development tools: the sandbox of the external systems, a signed token.
    Dev {
        #[command(subcommand)]
        command: DevCommand,
    },
    /// `conveyor dev sandbox` (this name stays for scripts written before).
    #[command(hide = true)]
    Sandbox(SandboxArgs),
    /// Every queue with its jobs by state, stream lag, throughput and oldest age (as the operator role).
    Queues {
        /// table or json (one object a line).
        #[arg(short, long, value_enum, default_value = "table")]
        output: Output,
        /// The same as `-o json`.
        #[arg(long, hide = true)]
        json: bool,
    },
    /// Each queue's consumers (the worker processes reading it): the entries each holds, and how long since it read.
    Consumers {
        /// table or json (one object a line).
        #[arg(short, long, value_enum, default_value = "table")]
        output: Output,
    },
    /// Find, show, cancel and retry jobs of any workspace (as the operator role; changes are audited).
    Jobs {
        #[command(subcommand)]
        command: JobsCommand,
    },
    /// Check the configuration a role would start with.
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
    /// Print a shell completion script (e.g. `conveyor completions bash > /etc/bash_completion.d/conveyor`).
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Inspect and replay dead-lettered jobs.
    Dlq {
        #[command(subcommand)]
        command: DlqCommand,
    },
    /// Hold jobs in the outbox (a queue, a kind, a workspace, or a combination), lift such a pause, list pauses,
    /// or set a workspace's weight in the fair share.
    Flow {
        #[command(subcommand)]
        command: FlowCommand,
    },
    /// List, set and remove a workspace's repeatable jobs (schedules).
    Schedule {
        #[command(subcommand)]
        command: ScheduleCommand,
    },
    /// `conveyor dev token` (this name stays for scripts written before).
    #[command(hide = true)]
    Token(TokenArgs),
}

#[derive(Subcommand)]
enum JobsCommand {
    /// Jobs matching the filters, newest first (a page; the next one's `--before` goes to stderr).
    List {
        /// Of this queue.
        #[arg(long)]
        queue: Option<String>,
        /// Of this kind.
        #[arg(long)]
        kind: Option<String>,
        /// In this state: scheduled, queued, retrying, active, succeeded, failed, canceled.
        #[arg(long, value_parser = parse_status)]
        status: Option<conveyor_jobs::JobStatus>,
        /// Of this workspace.
        #[arg(long)]
        workspace: Option<Uuid>,
        /// Enqueued at or after: an RFC 3339 time, or a duration ago (e.g. 2h).
        #[arg(long, value_parser = parse_time)]
        since: Option<chrono::DateTime<chrono::Utc>>,
        /// Enqueued before: an RFC 3339 time, or a duration ago.
        #[arg(long, value_parser = parse_time)]
        until: Option<chrono::DateTime<chrono::Utc>>,
        /// Older than this job id (the previous page's last, which stderr names).
        #[arg(long)]
        before: Option<Uuid>,
        /// How many (1 to 500).
        #[arg(long, default_value_t = 50)]
        limit: u32,
        /// json (one object a line) or table.
        #[arg(short, long, value_enum, default_value = "json")]
        output: Output,
    },
    /// One job in full, with its failed attempts.
    Show {
        /// The job id.
        id: Uuid,
    },
    /// A workspace's job events (active, progress, retrying, stalled, completed, failed, canceled), oldest first:
    /// those recorded so far (events other than ends are kept an hour), or with --follow those to come as well,
    /// until interrupted.
    Events {
        /// In this workspace.
        #[arg(long)]
        workspace: Uuid,
        /// Only these events, comma-separated (e.g. failed,retrying).
        #[arg(long, value_delimiter = ',', value_parser = parse_event)]
        event: Vec<conveyor_jobs::JobEventType>,
        /// Of this kind.
        #[arg(long)]
        kind: Option<String>,
        /// Of this queue.
        #[arg(long)]
        queue: Option<String>,
        /// Of this job.
        #[arg(long)]
        job: Option<Uuid>,
        /// From: an RFC 3339 time, or a duration ago (e.g. 10m). Default: an hour ago, or, following, now.
        #[arg(long, value_parser = parse_time)]
        since: Option<chrono::DateTime<chrono::Utc>>,
        /// Go on printing events as they happen, until interrupted (or --count of them).
        #[arg(long)]
        follow: bool,
        /// After this cursor: where the previous page ended (stderr names it: `more: --after …`).
        #[arg(long, conflicts_with = "follow")]
        after: Option<conveyor_jobs::EventCursor>,
        /// How many (1 to 1000): without --follow at most this many (default 100), with it stop after this many.
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1000))]
        count: Option<u32>,
        /// json (one object a line) or table.
        #[arg(short, long, value_enum, default_value = "json")]
        output: Output,
    },
    /// Cancel a job that has not ended.
    Cancel {
        /// The job id.
        id: Uuid,
    },
    /// Run a job again: a dead letter from its first attempt, a delayed or retrying job now.
    Retry {
        /// The job id.
        id: Uuid,
    },
    /// Change a job that waits for the relay (refused once it was handed to a worker): its priority, when it is due,
    /// its payload (at least one).
    #[command(group(clap::ArgGroup::new("what").required(true).multiple(true)
        .args(["priority", "delay", "run_at", "run_now", "payload"])))]
    Change {
        /// The job id.
        id: Uuid,
        /// high, normal or low.
        #[arg(long, value_parser = parse_priority)]
        priority: Option<conveyor_jobs::Priority>,
        /// Due this long from now, e.g. 30s or 2h.
        #[arg(long, value_parser = humantime::parse_duration, conflicts_with_all = ["run_at", "run_now"])]
        delay: Option<Duration>,
        /// Due at this time (RFC 3339).
        #[arg(long, conflicts_with = "run_now")]
        run_at: Option<chrono::DateTime<chrono::Utc>>,
        /// Due now.
        #[arg(long)]
        run_now: bool,
        /// Its new payload, as JSON.
        #[arg(long, value_parser = parse_json)]
        payload: Option<serde_json::Value>,
    },
    /// Cancel every waiting job (queued, delayed, retrying) of a queue or kind, in one workspace or in all.
    Drain {
        /// Of this queue.
        #[arg(long, required_unless_present = "kind")]
        queue: Option<String>,
        /// Of this kind.
        #[arg(long)]
        kind: Option<String>,
        /// In this workspace.
        #[arg(long, required_unless_present = "all", conflicts_with = "all")]
        workspace: Option<Uuid>,
        /// In every workspace.
        #[arg(long)]
        all: bool,
    },
    /// Empty a workspace's queue: cancel its waiting jobs and delete its ended ones (dead letters too). Refused while
    /// jobs of the queue run, unless --force, which cancels them too.
    Obliterate {
        /// The queue.
        #[arg(long)]
        queue: String,
        /// In this workspace.
        #[arg(long)]
        workspace: Uuid,
        /// Cancel the jobs that run too.
        #[arg(long)]
        force: bool,
    },
    /// Delete a workspace's ended jobs of one end, by age or all but the newest N (at least one of the two;
    /// `--older-than 0s` takes every one).
    #[command(group(clap::ArgGroup::new("which").required(true).multiple(true).args(["older_than", "keep_last"])))]
    Clean {
        /// succeeded, failed (dead letters are discarded) or canceled.
        #[arg(long, value_parser = parse_status)]
        status: conveyor_jobs::JobStatus,
        /// In this workspace.
        #[arg(long)]
        workspace: Uuid,
        /// Of this queue.
        #[arg(long)]
        queue: Option<String>,
        /// Of this kind.
        #[arg(long)]
        kind: Option<String>,
        /// Ended at least this long ago, e.g. 7d.
        #[arg(long, value_parser = humantime::parse_duration)]
        older_than: Option<Duration>,
        /// Keep the newest this many.
        #[arg(long)]
        keep_last: Option<u32>,
    },
}

/// The columns of an event's line: a listing's table, or a followed one's rows.
const EVENT_COLUMNS: [&str; 7] = ["AT (UTC)", "EVENT", "JOB", "KIND", "QUEUE", "RUN", "DETAIL"];

fn event_cells(e: &conveyor_jobs::JobEvent) -> [String; 7] {
    let detail = match (&e.progress, &e.error) {
        (Some(progress), _) => progress.to_string(),
        // One line a row, whatever the error says.
        (None, Some(error)) => error.split_whitespace().collect::<Vec<_>>().join(" "),
        (None, None) => "-".to_owned(),
    };
    [
        e.at.format("%Y-%m-%d %H:%M:%S%.3f").to_string(),
        e.event.as_str().to_owned(),
        e.job.id.to_string(),
        e.job.kind.clone(),
        e.job.queue.clone(),
        e.attempt.to_string(),
        detail,
    ]
}

/// Events as JSON lines, or as a table.
fn print_events(output: Output, events: &[conveyor_jobs::JobEvent]) -> anyhow::Result<()> {
    type Event = conveyor_jobs::JobEvent;
    output::print(
        output,
        events,
        &[
            (EVENT_COLUMNS[0], &|e: &Event| event_cells(e)[0].clone()),
            (EVENT_COLUMNS[1], &|e: &Event| event_cells(e)[1].clone()),
            (EVENT_COLUMNS[2], &|e: &Event| event_cells(e)[2].clone()),
            (EVENT_COLUMNS[3], &|e: &Event| event_cells(e)[3].clone()),
            (EVENT_COLUMNS[4], &|e: &Event| event_cells(e)[4].clone()),
            (EVENT_COLUMNS[5], &|e: &Event| event_cells(e)[5].clone()),
            (EVENT_COLUMNS[6], &|e: &Event| event_cells(e)[6].clone()),
        ],
    )
}

/// A followed event as a JSON line, or as a row of fixed-width columns under the header printed first.
fn print_followed(output: Output, event: &conveyor_jobs::JobEvent, first: bool) -> anyhow::Result<()> {
    if output == Output::Json {
        println!("{}", serde_json::to_string(event)?);
        return Ok(());
    }
    let row = |cells: [&str; 7]| {
        format!(
            "{:<23}  {:<9}  {:<36}  {:<24}  {:<16}  {:>3}  {}",
            cells[0], cells[1], cells[2], cells[3], cells[4], cells[5], cells[6]
        )
    };
    if first {
        println!("{}", row(EVENT_COLUMNS));
    }
    let cells = event_cells(event);
    println!("{}", row(cells.each_ref().map(String::as_str)));
    Ok(())
}

fn parse_event(raw: &str) -> Result<conveyor_jobs::JobEventType, String> {
    conveyor_jobs::JobEventType::from_name(raw.trim()).ok_or_else(|| {
        format!("one of {}", conveyor_jobs::JobEventType::ALL.map(conveyor_jobs::JobEventType::as_str).join(", "))
    })
}

fn parse_priority(raw: &str) -> Result<conveyor_jobs::Priority, String> {
    serde_json::from_value(serde_json::Value::String(raw.to_owned())).map_err(|_| "one of high, normal, low".to_owned())
}

fn parse_json(raw: &str) -> Result<serde_json::Value, String> {
    serde_json::from_str(raw).map_err(|e| format!("not JSON: {e}"))
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum CheckedRole {
    Api,
    Dispatcher,
    Worker,
    Maintenance,
    All,
    Migrate,
    Operator,
}

#[derive(Subcommand)]
enum ConfigCommand {
    /// Validate every variable the role reads (all problems at once) and print the effective configuration, secrets
    /// redacted. Exits 1 when something is wrong.
    Check {
        /// The role to check for.
        #[arg(long, value_enum, default_value = "all")]
        role: CheckedRole,
    },
    /// Print every variable as the Markdown table of the configuration reference (docs/configuration.md).
    Reference,
}

fn parse_status(raw: &str) -> Result<conveyor_jobs::JobStatus, String> {
    serde_json::from_value(serde_json::Value::String(raw.to_owned()))
        .map_err(|_| "one of scheduled, queued, retrying, active, succeeded, failed, canceled".to_owned())
}

#[derive(Subcommand)]
enum DlqCommand {
    /// Dead letters of every workspace matching the filters, newest first (a page; the next one's `--before` goes to
    /// stderr).
    List {
        #[command(flatten)]
        filter: DlqFilter,
        /// Older than this job id (the last one of the previous page).
        #[arg(long)]
        before: Option<Uuid>,
        /// json (one object a line) or table.
        #[arg(short, long, value_enum, default_value = "json")]
        output: Output,
    },
    /// One dead letter in full, with its failed attempts.
    Show {
        /// The job (outbox event) id.
        id: Uuid,
    },
    /// Run a dead letter again from its first attempt; with --all, every one matching the filters.
    Replay {
        /// The job (outbox event) id.
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        id: Option<Uuid>,
        /// Every dead letter matching the filters (at most --limit, default 500).
        #[arg(long)]
        all: bool,
        #[command(flatten)]
        filter: DlqFilter,
    },
    /// Delete a dead letter (its operation stays failed); with --all, every one matching the filters.
    Discard {
        /// The job (outbox event) id.
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        id: Option<Uuid>,
        /// Every dead letter matching the filters (at most --limit, default 500).
        #[arg(long)]
        all: bool,
        #[command(flatten)]
        filter: DlqFilter,
    },
}

/// Which dead letters a `dlq` command takes (every option given must match).
#[derive(clap::Args)]
struct DlqFilter {
    /// Of this queue.
    #[arg(long)]
    queue: Option<String>,
    /// Of this kind.
    #[arg(long)]
    kind: Option<String>,
    /// Of this workspace.
    #[arg(long)]
    workspace: Option<Uuid>,
    /// Dead-lettered at or after: an RFC 3339 time, or a duration ago (e.g. 2h).
    #[arg(long, value_parser = parse_time)]
    since: Option<chrono::DateTime<chrono::Utc>>,
    /// Dead-lettered before: an RFC 3339 time, or a duration ago.
    #[arg(long, value_parser = parse_time)]
    until: Option<chrono::DateTime<chrono::Utc>>,
    /// How many (1 to 500; default 50 for list, 500 for --all).
    #[arg(long)]
    limit: Option<u32>,
}

impl DlqFilter {
    fn is_empty(&self) -> bool {
        let Self { queue, kind, workspace, since, until, limit } = self;
        queue.is_none()
            && kind.is_none()
            && workspace.is_none()
            && since.is_none()
            && until.is_none()
            && limit.is_none()
    }

    /// The filter; `all`: a bulk action the operator asked for with `--all` (with or without other filters).
    fn into_filter(self, before: Option<Uuid>, all: bool) -> conveyor_jobs::DeadLetterFilter {
        let Self { queue, kind, workspace, since, until, limit } = self;
        conveyor_jobs::DeadLetterFilter { queue, kind, workspace, since, until, before, limit, all }
    }
}

/// An RFC 3339 time, or a duration before now (`90m`, `2h`, `1day`).
fn parse_time(raw: &str) -> Result<chrono::DateTime<chrono::Utc>, String> {
    if let Ok(at) = chrono::DateTime::parse_from_rfc3339(raw) {
        return Ok(at.with_timezone(&chrono::Utc));
    }
    let ago = humantime::parse_duration(raw)
        .map_err(|_| format!("`{raw}` is neither an RFC 3339 time nor a duration such as 2h"))?;
    chrono::Duration::from_std(ago)
        .ok()
        .and_then(|ago| chrono::Utc::now().checked_sub_signed(ago))
        .ok_or_else(|| format!("`{raw}` reaches too far back"))
}

/// What a pause holds: every job matching all the options given (at least one).
#[derive(clap::Args)]
struct Scope {
    /// Jobs of this queue.
    #[arg(long)]
    queue: Option<String>,
    /// Jobs of this kind.
    #[arg(long)]
    kind: Option<String>,
    /// Jobs of this workspace.
    #[arg(long)]
    workspace: Option<Uuid>,
}

impl Scope {
    fn into_scope(self) -> conveyor_jobs::PauseScope {
        conveyor_jobs::PauseScope {
            queue: self.queue,
            kind: self.kind,
            workspace: self.workspace.map(conveyor_jobs::WorkspaceId),
        }
    }
}

/// What a global limit holds: a queue's jobs or a kind's, of every workspace.
#[derive(clap::Args)]
#[group(required = true, multiple = false)]
struct GlobalScopeArgs {
    /// Jobs of this queue.
    #[arg(long)]
    queue: Option<String>,
    /// Jobs of this kind.
    #[arg(long)]
    kind: Option<String>,
}

impl GlobalScopeArgs {
    fn into_scope(self) -> conveyor_jobs::GlobalScope {
        match (self.queue, self.kind) {
            (Some(queue), _) => conveyor_jobs::GlobalScope::Queue(queue),
            (None, kind) => conveyor_jobs::GlobalScope::Kind(kind.unwrap_or_default()),
        }
    }
}

#[derive(Subcommand)]
enum FlowCommand {
    /// Hold the jobs of a scope in the outbox; jobs already handed to workers finish.
    Pause {
        #[command(flatten)]
        scope: Scope,
        /// Why (shown by `flow pauses`).
        #[arg(long)]
        reason: Option<String>,
    },
    /// Lift the pause of exactly this scope; the held jobs go in their order.
    Resume {
        #[command(flatten)]
        scope: Scope,
    },
    /// The pauses in force.
    Pauses {
        /// json (one object a line) or table.
        #[arg(short, long, value_enum, default_value = "json")]
        output: Output,
    },
    /// Hold every workspace's jobs of a queue or a kind together to a concurrency, a rate or both (replacing an
    /// earlier global limit of it); each workspace's own limits still apply.
    Limit {
        #[command(flatten)]
        scope: GlobalScopeArgs,
        /// At most this many in the workers' hands at once, across workspaces (1 to 1000000).
        #[arg(long)]
        max_in_flight: Option<u32>,
        /// At most this many handed out in any --interval (1 to 10000).
        #[arg(long, requires = "interval")]
        max_per_interval: Option<u32>,
        /// The rate's interval (1ms to 1d, in whole milliseconds), e.g. 1s.
        #[arg(long, value_parser = humantime::parse_duration, requires = "max_per_interval")]
        interval: Option<std::time::Duration>,
    },
    /// Remove the global limit of a queue or a kind; its held jobs go.
    Unlimit {
        #[command(flatten)]
        scope: GlobalScopeArgs,
    },
    /// The global limits, each with its jobs in flight and its hand-outs in its rate's last interval.
    Limits {
        /// json (one object a line) or table.
        #[arg(short, long, value_enum, default_value = "json")]
        output: Output,
    },
    /// Workspaces with jobs in the workers' hands or a weight: each one's weight, jobs in flight and share of them.
    Fairness {
        /// json (one object a line) or table.
        #[arg(short, long, value_enum, default_value = "json")]
        output: Output,
    },
    /// Every workspace's key limits and blocks (or one workspace's), each with its jobs in flight.
    KeyLimits {
        /// Only this workspace's.
        #[arg(long)]
        workspace: Option<Uuid>,
        /// json (one object a line) or table.
        #[arg(short, long, value_enum, default_value = "json")]
        output: Output,
    },
    /// Every workspace's kind limits (or one workspace's), each with its jobs in flight.
    KindLimits {
        /// Only this workspace's.
        #[arg(long)]
        workspace: Option<Uuid>,
        /// json (one object a line) or table.
        #[arg(short, long, value_enum, default_value = "json")]
        output: Output,
    },
    /// A workspace's weight: it keeps weight × CONVEYOR_DISPATCH_WINDOW jobs in the workers' hands (default 1).
    Weight {
        /// The workspace.
        #[arg(long)]
        workspace: Uuid,
        /// 1 to 1000.
        #[arg(long)]
        weight: u32,
    },
}

#[derive(Subcommand)]
enum ScheduleCommand {
    /// The workspace's schedules.
    List {
        /// The workspace.
        #[arg(long)]
        workspace: Uuid,
        /// json (one object a line) or table.
        #[arg(short, long, value_enum, default_value = "json")]
        output: Output,
    },
    /// Create or replace a schedule: a job of a registered kind on every tick.
    Set {
        /// The workspace.
        #[arg(long)]
        workspace: Uuid,
        /// The schedule's name, unique in the workspace.
        #[arg(long)]
        name: String,
        /// The job kind (registered by a worker: its queue is looked up).
        #[arg(long)]
        kind: String,
        /// The job payload, a JSON object.
        #[arg(long, default_value = "{}")]
        payload: String,
        /// A cron expression of 5 or 6 fields (a leading second).
        #[arg(long, conflicts_with = "every", required_unless_present = "every")]
        cron: Option<String>,
        /// The time zone the cron expression is read in (IANA name).
        #[arg(long, default_value = "UTC", requires = "cron")]
        tz: String,
        /// A fixed period instead, e.g. 30s or 5m.
        #[arg(long, value_parser = humantime::parse_duration)]
        every: Option<Duration>,
        /// Set it paused.
        #[arg(long)]
        paused: bool,
        /// Each job it enqueues must start within this of its tick (e.g. 10m), or it is canceled as expired.
        #[arg(long, value_parser = humantime::parse_duration)]
        start_within: Option<Duration>,
    },
    /// Remove a schedule (the jobs it enqueued stay).
    Remove {
        /// The workspace.
        #[arg(long)]
        workspace: Uuid,
        /// The schedule's name.
        #[arg(long)]
        name: String,
    },
}

/// `conveyor dev sandbox`'s options (and `conveyor sandbox`'s, its former name).
#[derive(clap::Args)]
struct SandboxArgs {
    /// Listen address.
    #[arg(long, default_value = "127.0.0.1:8090")]
    addr: std::net::SocketAddr,
    /// Latency added to every answer, in milliseconds.
    #[arg(long, default_value_t = 0)]
    latency_ms: u64,
    /// Share of calls answered 503 (0 to 1).
    #[arg(long, default_value_t = 0.0)]
    error_rate: f64,
    /// Share of calls that hang for 30 s (0 to 1).
    #[arg(long, default_value_t = 0.0)]
    timeout_rate: f64,
    /// Products in every store's catalog.
    #[arg(long, default_value_t = 250)]
    catalog_size: u64,
    /// Serve https with this PEM certificate chain (with `--tls-key`).
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<std::path::PathBuf>,
    /// The PEM private key of `--tls-cert`.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<std::path::PathBuf>,
}

/// `conveyor dev token`'s options (and `conveyor token`'s, its former name).
#[derive(clap::Args)]
struct TokenArgs {
    /// The workspace the token grants.
    #[arg(long)]
    workspace: Uuid,
    /// The user (`sub`).
    #[arg(long)]
    user: Uuid,
    /// How long it is valid, e.g. 1h or 30m.
    #[arg(long, default_value = "1h", value_parser = humantime::parse_duration)]
    ttl: Duration,
}

#[derive(Subcommand)]
enum MigrateCommand {
    /// Each migration of each crate: applied, pending, failed, or applied with another checksum (the file changed
    /// after it ran), and any the database ran that this binary does not know (a newer release ran). Exits 2 unless
    /// every one is applied (1 on an error: the database could not be read).
    Status {
        /// table or json (one object a line).
        #[arg(short, long, value_enum, default_value = "table")]
        output: Output,
    },
}

#[derive(Subcommand)]
enum DevCommand {
    /// Serve the sandbox of every external system: marketplace, catalog, AI provider, source files (development and
    /// tests).
    Sandbox(SandboxArgs),
    /// Print a signed development JWT.
    Token(TokenArgs),
}

fn main() -> ExitCode {
    no_transparent_huge_pages();
    let cli = parse_cli();
    // The dispatcher is one loop that waits on PostgreSQL and Redis in turn: on one thread, a notification reaches it
    // with no wake-up across threads. dispatch-latency, six alternating runs: p50 0.72 against 0.86 ms, p99 5.5
    // against 6.9 ms (medians).
    let mut builder = match cli.command {
        Command::Dispatcher => tokio::runtime::Builder::new_current_thread(),
        _ => tokio::runtime::Builder::new_multi_thread(),
    };
    // Logs, and traces for the long-running roles when OTEL_EXPORTER_OTLP_ENDPOINT is set; set up before the runtime
    // (the exporter runs on threads of its own) and flushed after it.
    let log_json = std::env::var("CONVEYOR_LOG_JSON").is_ok_and(|v| v == "true" || v == "1");
    let service = role(&cli.command).map(|role| format!("conveyor-{}", role.name()));
    let telemetry = match conveyor_server::telemetry::init(log_json, service.as_deref()) {
        Ok(telemetry) => telemetry,
        Err(e) => {
            eprintln!("conveyor: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    let code = match builder.enable_all().build() {
        Ok(runtime) => runtime.block_on(start(cli)),
        Err(e) => {
            eprintln!("conveyor: cannot start the async runtime: {e}");
            ExitCode::FAILURE
        }
    };
    telemetry.shutdown();
    code
}

/// The role a command runs, for the long-running ones.
fn role(command: &Command) -> Option<Role> {
    match command {
        Command::Api => Some(Role::Api),
        Command::Dispatcher => Some(Role::Dispatcher),
        Command::Worker => Some(Role::Worker),
        Command::Maintenance => Some(Role::Maintenance),
        Command::All => Some(Role::All),
        _ => None,
    }
}

/// Parses the command line, with each role's `--help` listing the variables it reads.
fn parse_cli() -> Cli {
    use clap::{CommandFactory, FromArgMatches};
    use conveyor_server::config::variables::{self as vars, help_for};
    let mut command = Cli::command();
    for (name, role) in [
        ("api", vars::API),
        ("dispatcher", vars::DISPATCHER),
        ("worker", vars::WORKER),
        ("maintenance", vars::MAINTENANCE),
        ("all", vars::SERVERS),
        ("migrate", vars::MIGRATE),
        ("queues", vars::OPERATOR),
        ("jobs", vars::OPERATOR),
        ("dlq", vars::OPERATOR),
    ] {
        command = command.mut_subcommand(name, |sub| sub.after_long_help(help_for(role)));
    }
    let matches = command.get_matches();
    Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
}

/// Opts this process out of transparent huge pages, before any thread starts. Where the kernel applies them to every
/// mapping (`/sys/kernel/mm/transparent_hugepage/enabled` = `always`), the allocator's first touch of its arena
/// would be backed by a 2 MiB page: a worker's resident memory went from 17 to 29 MiB that way. Elsewhere it changes
/// nothing. Best effort: a kernel without the switch just says no.
fn no_transparent_huge_pages() {
    #[cfg(target_os = "linux")]
    let _ = nix::sys::prctl::set_thp_disable(true);
}

async fn start(cli: Cli) -> ExitCode {
    // With the `failpoints` feature, FAILPOINTS=name=action;... arms crash points for tests; without it, nothing.
    #[cfg(feature = "failpoints")]
    let _failpoints = fail::FailScenario::setup();
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("conveyor: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Migrate { command: None } => {
            conveyor_server::migrate::run(&config::migrate_config(&Env)?).await.map(drop)
        }
        Command::Migrate { command: Some(MigrateCommand::Status { output }) } => migrate_status(output).await,
        Command::Api => app::run(Config::from_env()?, Role::Api).await,
        Command::Dispatcher => app::run(Config::from_env()?, Role::Dispatcher).await,
        Command::Worker => app::run(Config::from_env()?, Role::Worker).await,
        Command::Sandbox(args) | Command::Dev { command: DevCommand::Sandbox(args) } => {
            let SandboxArgs { addr, latency_ms, error_rate, timeout_rate, catalog_size, tls_cert, tls_key } = args;
            let settings =
                Settings { latency_ms, error_rate, timeout_rate, hang_ms: 30_000, catalog_size, ..Settings::default() };
            sandbox(addr, settings, tls_cert.zip(tls_key)).await
        }
        Command::Dlq { command } => dlq(command).await,
        Command::Schedule { command } => schedule(command).await,
        Command::Queues { output, json } => queues(if json { Output::Json } else { output }).await,
        Command::Jobs { command } => jobs(command).await,
        Command::Consumers { output } => {
            let (admin, actor) = operator(Needs::Redis).await?;
            let consumers = admin.consumers(&actor).await?;
            output::print(
                output,
                &consumers,
                &[
                    ("QUEUE", &|c: &conveyor_jobs::ConsumerInfo| c.queue.clone()),
                    ("CONSUMER", &|c| c.consumer.clone()),
                    ("HELD", &|c| c.pending.to_string()),
                    ("IDLE(s)", &|c| format!("{:.0}", c.idle_ms as f64 / 1000.0)),
                ],
            )
        }
        Command::Config { command: ConfigCommand::Check { role } } => config_check(role),
        Command::Config { command: ConfigCommand::Reference } => {
            print!("{}", conveyor_server::config::reference::markdown());
            Ok(())
        }
        Command::Completions { shell } => {
            use clap::CommandFactory;
            clap_complete::generate(shell, &mut Cli::command(), "conveyor", &mut std::io::stdout());
            Ok(())
        }
        Command::Flow { command } => {
            // Pauses and weights are operator data: read and changed through the operator role, audited.
            let (admin, actor) = operator(Needs::Postgres).await?;
            match command {
                FlowCommand::Pause { scope, reason } => {
                    let added = admin.pause(&actor, &scope.into_scope(), reason.as_deref()).await?;
                    println!("{}", if added { "paused" } else { "already paused" });
                }
                FlowCommand::Resume { scope } => {
                    if !admin.resume(&actor, &scope.into_scope()).await? {
                        anyhow::bail!("no pause of exactly that scope (see `conveyor flow pauses`)");
                    }
                    println!("resumed");
                }
                FlowCommand::Pauses { output } => {
                    let pauses = admin.pauses(&actor).await?;
                    output::print(
                        output,
                        &pauses,
                        &[
                            ("QUEUE", &|p: &conveyor_jobs::Pause| output::maybe(&p.queue)),
                            ("KIND", &|p| output::maybe(&p.kind)),
                            ("WORKSPACE", &|p| output::maybe(&p.workspace_id)),
                            ("REASON", &|p| output::maybe(&p.reason)),
                            ("SINCE (UTC)", &|p| output::time(&p.created_at)),
                        ],
                    )?;
                }
                FlowCommand::Limit { scope, max_in_flight, max_per_interval, interval } => {
                    let limit =
                        conveyor_jobs::GlobalLimit { max_in_flight, max_per_interval: max_per_interval.zip(interval) };
                    admin.set_global_limit(&actor, &scope.into_scope(), limit).await?;
                    println!("limited");
                }
                FlowCommand::Unlimit { scope } => {
                    if !admin.remove_global_limit(&actor, &scope.into_scope()).await? {
                        anyhow::bail!("no global limit of that queue or kind (see `conveyor flow limits`)");
                    }
                    println!("unlimited");
                }
                FlowCommand::Limits { output } => {
                    let limits = admin.global_limits(&actor).await?;
                    output::print(
                        output,
                        &limits,
                        &[
                            ("SCOPE", &|l: &conveyor_jobs::GlobalLimits| l.scope.clone()),
                            ("NAME", &|l| l.name.clone()),
                            ("MAX IN FLIGHT", &|l| output::maybe(&l.max_in_flight)),
                            ("IN FLIGHT", &|l| l.in_flight.to_string()),
                            ("RATE", &|l| match (l.max_per_interval, l.interval_ms) {
                                (Some(n), Some(ms)) => format!("{n}/{ms}ms"),
                                _ => "-".to_owned(),
                            }),
                            ("IN INTERVAL", &|l| l.handed_out_in_interval.to_string()),
                            ("SINCE (UTC)", &|l| output::time(&l.updated_at)),
                        ],
                    )?;
                }
                FlowCommand::Fairness { output } => {
                    let shares = admin.workspace_shares(&actor).await?;
                    output::print(
                        output,
                        &shares,
                        &[
                            ("WORKSPACE", &|w: &conveyor_jobs::WorkspaceShare| w.workspace_id.to_string()),
                            ("WEIGHT", &|w| w.weight.to_string()),
                            ("IN FLIGHT", &|w| w.in_flight.to_string()),
                            ("SHARE", &|w| format!("{:.0}%", w.share * 100.0)),
                        ],
                    )?;
                }
                FlowCommand::KeyLimits { workspace, output } => {
                    let limits = admin.key_limits(&actor, workspace.map(conveyor_jobs::WorkspaceId)).await?;
                    output::print(
                        output,
                        &limits,
                        &[
                            ("WORKSPACE", &|l: &conveyor_jobs::WorkspaceKeyLimit| l.workspace_id.to_string()),
                            ("KEY", &|l| l.key.clone()),
                            ("MAX IN FLIGHT", &|l| output::maybe(&l.max_in_flight)),
                            ("IN FLIGHT", &|l| l.in_flight.to_string()),
                            ("RATE", &|l| match (l.max_per_interval, l.interval_ms) {
                                (Some(n), Some(ms)) => format!("{n}/{ms}ms"),
                                _ => "-".to_owned(),
                            }),
                            ("BLOCKED UNTIL (UTC)", &|l| l.blocked_until.as_ref().map_or("-".to_owned(), output::time)),
                        ],
                    )?;
                }
                FlowCommand::KindLimits { workspace, output } => {
                    let limits = admin.kind_limits(&actor, workspace.map(conveyor_jobs::WorkspaceId)).await?;
                    output::print(
                        output,
                        &limits,
                        &[
                            ("WORKSPACE", &|l: &conveyor_jobs::WorkspaceKindLimit| l.workspace_id.to_string()),
                            ("KIND", &|l| l.kind.clone()),
                            ("MAX IN FLIGHT", &|l| l.max_in_flight.to_string()),
                            ("IN FLIGHT", &|l| l.in_flight.to_string()),
                        ],
                    )?;
                }
                FlowCommand::Weight { workspace, weight } => {
                    admin.set_workspace_weight(&actor, conveyor_jobs::WorkspaceId(workspace), weight).await?;
                    println!("weight {weight}");
                }
            }
            Ok(())
        }
        Command::Maintenance => app::run(Config::from_env()?, Role::Maintenance).await,
        Command::All => app::run(Config::from_env()?, Role::All).await,
        Command::Token(TokenArgs { workspace, user, ttl })
        | Command::Dev { command: DevCommand::Token(TokenArgs { workspace, user, ttl }) } => {
            let keys = TokenKeys::new(&config::jwt_secret(&Env)?);
            let principal = Principal { workspace_id: workspace.into(), user_id: user.into() };
            println!("{}", keys.mint(principal, ttl));
            Ok(())
        }
    }
}

/// `conveyor dev sandbox`: the sandbox of every external system on `addr`, https with `tls` (certificate, key).
async fn sandbox(
    addr: std::net::SocketAddr,
    settings: Settings,
    tls: Option<(std::path::PathBuf, std::path::PathBuf)>,
) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let shutdown = tokio_util::sync::CancellationToken::new();
    let stop = shutdown.clone();
    tokio::spawn(async move {
        app::wait_for_signal().await;
        stop.cancel();
    });
    let sandbox = Sandbox::new(settings);
    match tls {
        Some((cert, key)) => {
            tracing::info!(%addr, "Sandbox listening (https)");
            let tls = SandboxTls::from_pem_files(&cert, &key)?;
            sandbox.serve_tls(listener, tls, shutdown).await
        }
        None => {
            tracing::info!(%addr, "Sandbox listening (http)");
            sandbox.serve(listener, shutdown).await
        }
    }
}

/// `conveyor migrate status`: every crate's migrations against its history table.
async fn migrate_status(output: Output) -> anyhow::Result<()> {
    let url = config::history_database_url(&Env)?;
    let pool = conveyor_jobs::connect_postgres(url.expose(), 1).await?;
    let rows = conveyor_server::migrate::status(&pool).await?;
    output::print(
        output,
        &rows,
        &[
            ("CRATE", &|r: &conveyor_server::migrate::MigrationStatus| r.schema.to_owned()),
            ("VERSION", &|r| r.version.to_string()),
            ("DESCRIPTION", &|r| r.description.clone()),
            ("STATE", &|r| r.state.as_str().to_owned()),
        ],
    )?;
    let not_applied = rows.iter().filter(|r| r.state != conveyor_server::migrate::MigrationState::Applied).count();
    if not_applied > 0 {
        // Its own exit status, apart from an error's (1): a deploy gate tells "not migrated" from "could not look".
        eprintln!("conveyor: {not_applied} migrations are not applied as this binary has them");
        std::process::exit(2);
    }
    Ok(())
}

/// `conveyor schedule ...`: as the application role, under row-level security in the given workspace.
async fn schedule(command: ScheduleCommand) -> anyhow::Result<()> {
    use conveyor_jobs::{ScheduleOptions, ScheduleSpec};
    let url = config::database_url(&Env)?;
    let pool = conveyor_jobs::connect_postgres(url.expose(), 2).await?;
    match command {
        ScheduleCommand::List { workspace, output } => {
            let schedules = conveyor_jobs::list_schedules(&pool, workspace.into()).await?;
            output::print(
                output,
                &schedules,
                &[
                    ("NAME", &|s: &conveyor_jobs::Schedule| s.name.clone()),
                    ("KIND", &|s| s.kind.clone()),
                    ("WHEN", &|s| match (&s.cron, s.every_ms) {
                        (Some(cron), _) => format!("{cron} ({})", s.time_zone.as_deref().unwrap_or("UTC")),
                        (None, Some(ms)) => {
                            format!("every {}", humantime::format_duration(Duration::from_millis(ms as u64)))
                        }
                        (None, None) => "-".to_owned(),
                    }),
                    ("PAUSED", &|s| if s.paused { "yes".into() } else { "no".into() }),
                    ("NEXT RUN (UTC)", &|s| output::time(&s.next_run_at)),
                ],
            )?;
        }
        ScheduleCommand::Set { workspace, name, kind, payload, cron, tz, every, paused, start_within } => {
            let spec = match (cron, every) {
                (Some(expression), _) => ScheduleSpec::cron(&expression, &tz)?,
                (None, Some(period)) => ScheduleSpec::every(period)?,
                (None, None) => anyhow::bail!("give --cron or --every"),
            };
            let payload: serde_json::Value =
                serde_json::from_str(&payload).map_err(|e| anyhow::anyhow!("--payload is not JSON: {e}"))?;
            anyhow::ensure!(payload.is_object(), "--payload must be a JSON object");
            let Some(queue) = conveyor_jobs::registered_queue(&pool, &kind).await? else {
                anyhow::bail!(
                    "unknown job kind `{kind}`: a worker registers its kinds (and their queue) when it starts"
                )
            };
            let mut tx = conveyor_jobs::begin_workspace(&pool, workspace.into()).await?;
            let mut options = ScheduleOptions::new().paused(paused);
            if let Some(within) = start_within {
                options = options.start_within(within);
            }
            let schedule =
                conveyor_jobs::upsert_schedule_raw_tx(&mut tx, &name, &kind, &queue, payload, &spec, options).await?;
            tx.commit().await?;
            println!("{}", serde_json::to_string(&schedule)?);
        }
        ScheduleCommand::Remove { workspace, name } => {
            let mut tx = conveyor_jobs::begin_workspace(&pool, workspace.into()).await?;
            let removed = conveyor_jobs::remove_schedule_tx(&mut tx, &name).await?;
            tx.commit().await?;
            anyhow::ensure!(removed, "no schedule `{name}` in workspace {workspace}");
            println!("removed {name}");
        }
    }
    Ok(())
}

/// What an operator command connects to besides PostgreSQL.
#[derive(PartialEq, Eq)]
enum Needs {
    /// PostgreSQL only (jobs, dead letters).
    Postgres,
    /// Redis too, for stream lag (queues).
    Redis,
}

/// The operator's handle from the environment: the operator role for reads across workspaces, the application role
/// for changes under row-level security, and Redis for stream lag when `needs` says so. The actor of the audit trail
/// is `cli:<user>`.
async fn operator(needs: Needs) -> anyhow::Result<(conveyor_jobs::Admin, conveyor_jobs::Actor)> {
    use anyhow::Context;
    use conveyor_jobs::{Actor, Admin};
    let operator_url = config::operator_database_url(&Env)?
        .context("CONVEYOR_OPERATOR_DATABASE_URL is required by the operator commands (the operator role's URL)")?;
    let app_url = config::database_url(&Env)?;
    let operator = conveyor_jobs::connect_postgres(operator_url.expose(), 2)
        .await
        .context("Failed to connect as the operator role (CONVEYOR_OPERATOR_DATABASE_URL)")?;
    let app = conveyor_jobs::connect_postgres(app_url.expose(), 2)
        .await
        .context("Failed to connect as the application role (CONVEYOR_DATABASE_URL)")?;
    let admin = if needs == Needs::Redis {
        let (redis_url, prefix) = config::redis(&Env)?;
        let tls = config::redis_tls(&Env, &redis_url)?;
        let redis = conveyor_jobs::connect_redis_with(&redis_url, Duration::from_secs(5), &tls)
            .await
            .context("Failed to connect to Redis (CONVEYOR_REDIS_URL)")?;
        Admin::new(operator, app, redis, conveyor_jobs::RedisKeys::new(&prefix))
    } else {
        Admin::without_redis(operator, app)
    };
    let user = std::env::var("USER").unwrap_or_else(|_| "unknown".to_owned());
    Ok((admin, Actor(format!("cli:{user}"))))
}

/// `conveyor queues`: a table (or JSON lines) of every queue.
async fn queues(output: Output) -> anyhow::Result<()> {
    let (admin, actor) = operator(Needs::Redis).await?;
    let queues = admin.queues(&actor).await?;
    output::print(
        output,
        &queues,
        &[
            ("QUEUE", &|q: &conveyor_jobs::QueueSummary| q.name.clone()),
            ("QUEUED", &|q| q.counts.queued.to_string()),
            ("DELAYED", &|q| q.counts.delayed.to_string()),
            ("RUNNING", &|q| q.counts.running.to_string()),
            ("RETRYING", &|q| q.counts.retrying.to_string()),
            ("DEAD", &|q| q.counts.dead.to_string()),
            ("WAITING", &|q| q.counts.waiting_children.to_string()),
            ("LAG", &|q| output::maybe(&q.lag)),
            ("DONE/MIN", &|q| format!("{:.1}", q.completed_per_minute)),
            ("OLDEST(s)", &|q| q.oldest_queued_seconds.map_or_else(|| "-".to_owned(), |s| format!("{s:.0}"))),
            ("PAUSED", &|q| if q.paused { "yes".into() } else { "no".into() }),
        ],
    )
}

/// `conveyor jobs list|show|cancel|retry`.
async fn jobs(command: JobsCommand) -> anyhow::Result<()> {
    use conveyor_jobs::{JobAction, JobFilter};
    let (admin, actor) = operator(Needs::Postgres).await?;
    let acted = |id: Uuid, action: JobAction, verb: &str| -> anyhow::Result<()> {
        match action {
            JobAction::Done => {
                println!("{verb} {id}");
                Ok(())
            }
            JobAction::NotFound => anyhow::bail!("no job {id}"),
            JobAction::NotAllowed => anyhow::bail!("job {id} cannot be {verb} in its state (see `conveyor jobs show`)"),
            JobAction::KeyHeld(live) => {
                anyhow::bail!("job {id} is not {verb}: live job {live} holds its de-dup key")
            }
            JobAction::Held(why) => anyhow::bail!("job {id} is not {verb}: {why}"),
        }
    };
    match command {
        JobsCommand::List { queue, kind, status, workspace, since, until, before, limit, output } => {
            let filter = JobFilter { queue, kind, status, workspace, since, until, before, limit: Some(limit) };
            let page = admin.jobs(&actor, &filter).await?;
            output::print(
                output,
                &page.items,
                &[
                    ("JOB", &|j: &conveyor_jobs::JobSummary| j.id.to_string()),
                    ("KIND", &|j| j.kind.clone()),
                    ("QUEUE", &|j| j.queue.clone()),
                    ("STATUS", &|j| j.status.as_str().to_owned()),
                    ("FAILED RUNS", &|j| j.failed_runs.to_string()),
                    ("WORKSPACE", &|j| j.workspace_id.to_string()),
                    ("ENQUEUED (UTC)", &|j| output::time(&j.created_at)),
                    ("ENDED (UTC)", &|j| j.finished_at.as_ref().map_or_else(|| "-".to_owned(), output::time)),
                ],
            )?;
            if let Some(next) = page.next {
                eprintln!("more: --before {next}");
            }
            Ok(())
        }
        JobsCommand::Show { id } => match admin.job(&actor, conveyor_jobs::JobId(id)).await? {
            Some(job) => {
                println!("{}", serde_json::to_string_pretty(&job)?);
                Ok(())
            }
            None => anyhow::bail!("no job {id}"),
        },
        JobsCommand::Events { workspace, event, kind, queue, job, since, after, follow, count, output } => {
            let mut filter = conveyor_jobs::EventFilter::all();
            if !event.is_empty() {
                filter = filter.events(event);
            }
            if let Some(kind) = kind {
                filter = filter.kind(kind);
            }
            if let Some(queue) = queue {
                filter = filter.queue(queue);
            }
            if let Some(job) = job {
                filter = filter.job(conveyor_jobs::JobId(job));
            }
            if let Some(since) = since {
                filter = filter.since(since);
            }
            let workspace = conveyor_jobs::WorkspaceId(workspace);
            if !follow {
                let (events, next) = admin.job_events(&actor, workspace, &filter, after, count.unwrap_or(100)).await?;
                print_events(output, &events)?;
                if let Some(next) = next {
                    eprintln!("more: --after {next}");
                }
                return Ok(());
            }
            let mut events = admin.follow_job_events(&actor, workspace, filter).await?;
            let mut printed = 0;
            let interrupted = tokio::signal::ctrl_c();
            tokio::pin!(interrupted);
            while count.is_none_or(|count| printed < count) {
                let event = tokio::select! {
                    event = events.next() => event?,
                    _ = &mut interrupted => break,
                };
                print_followed(output, &event, printed == 0)?;
                printed += 1;
            }
            Ok(())
        }
        JobsCommand::Cancel { id } => acted(id, admin.cancel_job(&actor, conveyor_jobs::JobId(id)).await?, "canceled"),
        JobsCommand::Retry { id } => acted(id, admin.retry_job(&actor, conveyor_jobs::JobId(id)).await?, "retried"),
        JobsCommand::Change { id, priority, delay, run_at, run_now, payload } => {
            let mut change = conveyor_jobs::JobChange::new();
            if let Some(priority) = priority {
                change = change.priority(priority);
            }
            if let Some(delay) = delay {
                change = change.delay(delay);
            }
            if let Some(at) = run_at {
                change = change.run_at(at);
            }
            if run_now {
                change = change.run_now();
            }
            if let Some(payload) = payload {
                change = change.json_payload(payload);
            }
            acted(id, admin.change_job(&actor, conveyor_jobs::JobId(id), &change).await?, "changed")
        }
        JobsCommand::Drain { queue, kind, workspace, all } => {
            let drained = admin.drain(&actor, &conveyor_jobs::DrainFilter { queue, kind, workspace, all }).await?;
            println!("{}", serde_json::to_string(&drained)?);
            Ok(())
        }
        JobsCommand::Obliterate { queue, workspace, force } => {
            match admin.obliterate(&actor, &queue, &conveyor_jobs::ObliterateFilter { workspace, force }).await? {
                done @ conveyor_jobs::Obliteration::Done(_) => {
                    println!("{}", serde_json::to_string(&done)?);
                    Ok(())
                }
                conveyor_jobs::Obliteration::Running { running } => {
                    anyhow::bail!("{running} jobs of queue {queue} run; nothing changed (--force cancels them too)")
                }
            }
        }
        JobsCommand::Clean { status, workspace, queue, kind, older_than, keep_last } => {
            let filter = conveyor_jobs::CleanFilter {
                status,
                workspace,
                queue,
                kind,
                older_than_seconds: older_than.map(|d| d.as_secs()),
                keep_last,
            };
            let deleted = admin.clean(&actor, &filter).await?;
            println!("{}", serde_json::json!({ "deleted": deleted }));
            Ok(())
        }
    }
}

/// `conveyor config check`: prints the effective configuration (secrets redacted) and every problem.
fn config_check(role: CheckedRole) -> anyhow::Result<()> {
    use conveyor_server::config::variables as vars;
    let mask = match role {
        CheckedRole::Api => vars::API,
        CheckedRole::Dispatcher => vars::DISPATCHER,
        CheckedRole::Worker => vars::WORKER,
        CheckedRole::Maintenance => vars::MAINTENANCE,
        CheckedRole::All => vars::SERVERS,
        CheckedRole::Migrate => vars::MIGRATE,
        CheckedRole::Operator => vars::OPERATOR,
    };
    let report = conveyor_server::config::check::check(&Env, mask);
    for (name, value, origin) in &report.effective {
        println!("{name}={value}  # {origin}");
    }
    if report.is_ok() {
        eprintln!("config check: ok");
        return Ok(());
    }
    for error in &report.errors {
        eprintln!("config check: {error}");
    }
    anyhow::bail!("{} problem(s) in the configuration", report.errors.len())
}

/// `conveyor dlq ...`: as the operator role across workspaces (changes as the application role in each dead letter's
/// workspace), audited as `cli:<user>`. Needs CONVEYOR_OPERATOR_DATABASE_URL and CONVEYOR_DATABASE_URL, not Redis.
async fn dlq(command: DlqCommand) -> anyhow::Result<()> {
    use conveyor_jobs::Replay;
    let (admin, actor) = operator(Needs::Postgres).await?;
    let single = |id: Option<Uuid>, filter: &DlqFilter| -> anyhow::Result<Option<conveyor_jobs::JobId>> {
        anyhow::ensure!(id.is_none() || filter.is_empty(), "the filters apply with --all, not to one id");
        Ok(id.map(conveyor_jobs::JobId))
    };
    match command {
        DlqCommand::List { filter, before, output } => {
            let page = admin.dead_letters(&actor, &filter.into_filter(before, false)).await?;
            output::print(
                output,
                &page.items,
                &[
                    ("JOB", &|d: &conveyor_jobs::DeadLetter| d.id.to_string()),
                    ("KIND", &|d| d.event_type.clone()),
                    ("QUEUE", &|d| d.queue.clone()),
                    ("STAGE", &|d| output::maybe(&d.failure_stage)),
                    ("ATTEMPTS", &|d| d.attempts.to_string()),
                    ("WORKSPACE", &|d| d.workspace_id.to_string()),
                    ("DEAD-LETTERED (UTC)", &|d| {
                        d.dead_lettered_at.as_ref().map_or_else(|| "-".to_owned(), output::time)
                    }),
                    ("ERROR", &|d| output::maybe(&d.last_error)),
                ],
            )?;
            if let Some(next) = page.next {
                eprintln!("more: --before {next}");
            }
        }
        DlqCommand::Show { id } => match admin.job(&actor, conveyor_jobs::JobId(id)).await? {
            Some(job) if job.job.status == conveyor_jobs::JobStatus::Failed => {
                println!("{}", serde_json::to_string_pretty(&job)?)
            }
            _ => anyhow::bail!("no dead letter {id}"),
        },
        DlqCommand::Replay { id, all: _, filter } => match single(id, &filter)? {
            Some(id) => match admin.replay_dead_letter(&actor, id).await? {
                Replay::Replayed => println!("replaying {id}"),
                Replay::NotDeadLetter => anyhow::bail!("no dead letter {id}"),
                Replay::KeyHeld(live) => anyhow::bail!(
                    "dead letter {id} is not replayed: live job {live} holds its de-dup key (cancel it, or wait for it \
                     to end)"
                ),
            },
            None => println!(
                "{}",
                serde_json::to_string(&admin.replay_dead_letters(&actor, &filter.into_filter(None, true)).await?)?
            ),
        },
        DlqCommand::Discard { id, all: _, filter } => match single(id, &filter)? {
            Some(id) => {
                anyhow::ensure!(admin.discard_dead_letter(&actor, id).await?, "no dead letter {id}");
                println!("discarded {id}");
            }
            None => println!(
                "{}",
                serde_json::to_string(&admin.discard_dead_letters(&actor, &filter.into_filter(None, true)).await?)?
            ),
        },
    }
    Ok(())
}
