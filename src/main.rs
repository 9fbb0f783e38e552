//! The `conveyor` binary: parses the command line and hands over to the library.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use conveyor::adapters::sandbox::{Sandbox, SandboxTls, Settings};
use conveyor::app::{self, Role};
use conveyor::auth::{Principal, TokenKeys};
use conveyor::config::{self, Config, Env, MigrateConfig};
use conveyor::worker::dlq;
use uuid::Uuid;

/// mimalloc instead of glibc's malloc: a worker allocates and frees many small buffers per job (Redis frames,
/// strings, task state), where glibc's malloc took about 15% of a drain's CPU.
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
    /// Apply migrations as the owner role and grant the application role.
    Migrate,
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
    /// Serve the sandbox of every external system: marketplace, catalog, AI provider, source files (development and
    /// tests).
    Sandbox {
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
    /// Print a signed development JWT.
    Token {
        /// The workspace the token grants.
        #[arg(long)]
        workspace: Uuid,
        /// The user (`sub`).
        #[arg(long)]
        user: Uuid,
        /// How long it is valid, e.g. 1h or 30m.
        #[arg(long, default_value = "1h", value_parser = humantime::parse_duration)]
        ttl: Duration,
    },
}

#[derive(Subcommand)]
enum DlqCommand {
    /// The newest dead letters, one JSON object a line.
    List {
        /// How many.
        #[arg(long, default_value_t = 50)]
        limit: i32,
    },
    /// One dead letter.
    Show {
        /// The job (outbox event) id.
        id: Uuid,
    },
    /// Run a dead letter again from its first attempt.
    Replay {
        /// The job (outbox event) id.
        id: Uuid,
    },
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
    fn into_scope(self) -> conveyor::PauseScope {
        conveyor::PauseScope {
            queue: self.queue,
            kind: self.kind,
            workspace: self.workspace.map(conveyor::WorkspaceId),
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
    /// The pauses in force, one JSON object a line.
    Pauses,
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
    /// The workspace's schedules, one JSON object a line.
    List {
        /// The workspace.
        #[arg(long)]
        workspace: Uuid,
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

fn main() -> ExitCode {
    no_transparent_huge_pages();
    let cli = Cli::parse();
    // The dispatcher is one loop that waits on PostgreSQL and Redis in turn: on one thread, a notification reaches it
    // with no wake-up across threads. dispatch-latency, six alternating runs: p50 0.72 against 0.86 ms, p99 5.5
    // against 6.9 ms (medians).
    let mut builder = match cli.command {
        Command::Dispatcher => tokio::runtime::Builder::new_current_thread(),
        _ => tokio::runtime::Builder::new_multi_thread(),
    };
    match builder.enable_all().build() {
        Ok(runtime) => runtime.block_on(start(cli)),
        Err(e) => {
            eprintln!("conveyor: cannot start the async runtime: {e}");
            ExitCode::FAILURE
        }
    }
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
    let log_json = std::env::var("CONVEYOR_LOG_JSON").is_ok_and(|v| v == "true" || v == "1");
    conveyor::telemetry::init_logging(log_json);
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
        Command::Migrate => conveyor::migrate::run(&MigrateConfig::from_source(&Env)?).await,
        Command::Api => app::run(Config::from_env()?, Role::Api).await,
        Command::Dispatcher => app::run(Config::from_env()?, Role::Dispatcher).await,
        Command::Worker => app::run(Config::from_env()?, Role::Worker).await,
        Command::Sandbox { addr, latency_ms, error_rate, timeout_rate, catalog_size, tls_cert, tls_key } => {
            let settings =
                Settings { latency_ms, error_rate, timeout_rate, hang_ms: 30_000, catalog_size, ..Settings::default() };
            let listener = tokio::net::TcpListener::bind(addr).await?;
            let shutdown = tokio_util::sync::CancellationToken::new();
            let stop = shutdown.clone();
            tokio::spawn(async move {
                app::wait_for_signal().await;
                stop.cancel();
            });
            let sandbox = Sandbox::new(settings);
            match (tls_cert, tls_key) {
                (Some(cert), Some(key)) => {
                    tracing::info!(%addr, "Sandbox listening (https)");
                    let tls = SandboxTls::from_pem_files(&cert, &key)?;
                    sandbox.serve_tls(listener, tls, shutdown).await
                }
                _ => {
                    tracing::info!(%addr, "Sandbox listening (http)");
                    sandbox.serve(listener, shutdown).await
                }
            }
        }
        Command::Dlq { command } => {
            let url = config::database_url(&Env)?;
            let pool = conveyor::db::connect(url.expose(), 2).await?;
            match command {
                DlqCommand::List { limit } => {
                    for dead in dlq::list(&pool, limit).await? {
                        println!("{}", serde_json::to_string(&dead)?);
                    }
                }
                DlqCommand::Show { id } => match dlq::show(&pool, id).await? {
                    Some(dead) => println!("{}", serde_json::to_string_pretty(&dead)?),
                    None => anyhow::bail!("no dead letter {id}"),
                },
                DlqCommand::Replay { id } => match dlq::replay(&pool, id).await? {
                    dlq::Replay::Replayed => println!("replaying {id}"),
                    dlq::Replay::NotDeadLetter => anyhow::bail!("no dead letter {id}"),
                    dlq::Replay::KeyHeld(live) => anyhow::bail!(
                        "dead letter {id} is not replayed: live job {live} holds its de-dup key (cancel it, or \
                             wait for it to end)"
                    ),
                },
            }
            Ok(())
        }
        Command::Schedule { command } => schedule(command).await,
        Command::Flow { command } => {
            let url = config::database_url(&Env)?;
            let pool = conveyor::db::connect(url.expose(), 2).await?;
            match command {
                FlowCommand::Pause { scope, reason } => {
                    let added = conveyor::pause(&pool, &scope.into_scope(), reason.as_deref()).await?;
                    println!("{}", if added { "paused" } else { "already paused" });
                }
                FlowCommand::Resume { scope } => {
                    if !conveyor::resume(&pool, &scope.into_scope()).await? {
                        anyhow::bail!("no pause of exactly that scope (see `conveyor flow pauses`)");
                    }
                    println!("resumed");
                }
                FlowCommand::Pauses => {
                    for pause in conveyor::list_pauses(&pool).await? {
                        println!("{}", serde_json::to_string(&pause)?);
                    }
                }
                FlowCommand::Weight { workspace, weight } => {
                    conveyor::set_workspace_weight(&pool, conveyor::WorkspaceId(workspace), weight).await?;
                    println!("weight {weight}");
                }
            }
            Ok(())
        }
        Command::Maintenance => app::run(Config::from_env()?, Role::Maintenance).await,
        Command::All => app::run(Config::from_env()?, Role::All).await,
        Command::Token { workspace, user, ttl } => {
            let keys = TokenKeys::new(&config::jwt_secret(&Env)?);
            let principal = Principal { workspace_id: workspace.into(), user_id: user.into() };
            println!("{}", keys.mint(principal, ttl));
            Ok(())
        }
    }
}

/// `conveyor schedule ...`: as the application role, under row-level security in the given workspace.
async fn schedule(command: ScheduleCommand) -> anyhow::Result<()> {
    use conveyor::schedule::{ScheduleOptions, ScheduleSpec};
    let url = config::database_url(&Env)?;
    let pool = conveyor::db::connect(url.expose(), 2).await?;
    match command {
        ScheduleCommand::List { workspace } => {
            for schedule in conveyor::list_schedules(&pool, workspace.into()).await? {
                println!("{}", serde_json::to_string(&schedule)?);
            }
        }
        ScheduleCommand::Set { workspace, name, kind, payload, cron, tz, every, paused } => {
            let spec = match (cron, every) {
                (Some(expression), _) => ScheduleSpec::cron(&expression, &tz)?,
                (None, Some(period)) => ScheduleSpec::every(period)?,
                (None, None) => anyhow::bail!("give --cron or --every"),
            };
            let payload: serde_json::Value =
                serde_json::from_str(&payload).map_err(|e| anyhow::anyhow!("--payload is not JSON: {e}"))?;
            anyhow::ensure!(payload.is_object(), "--payload must be a JSON object");
            let Some(queue) = conveyor::schedule::registered_queue(&pool, &kind).await? else {
                anyhow::bail!(
                    "unknown job kind `{kind}`: a worker registers its kinds (and their queue) when it starts"
                )
            };
            let mut tx = conveyor::begin_workspace(&pool, workspace.into()).await?;
            let options = ScheduleOptions::new().paused(paused);
            let schedule =
                conveyor::schedule::upsert_schedule_raw_tx(&mut tx, &name, &kind, &queue, payload, &spec, options)
                    .await?;
            tx.commit().await?;
            println!("{}", serde_json::to_string(&schedule)?);
        }
        ScheduleCommand::Remove { workspace, name } => {
            let mut tx = conveyor::begin_workspace(&pool, workspace.into()).await?;
            let removed = conveyor::remove_schedule_tx(&mut tx, &name).await?;
            tx.commit().await?;
            anyhow::ensure!(removed, "no schedule `{name}` in workspace {workspace}");
            println!("removed {name}");
        }
    }
    Ok(())
}
