//! The `conveyor` binary: parses the command line and hands over to the library.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use conveyor::app::{self, Role};
use conveyor::auth::{Principal, TokenKeys};
use conveyor::config::{self, Config, Env, MigrateConfig};
use uuid::Uuid;

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
    /// Retention of expired records (and, later, the reconciler).
    Maintenance,
    /// Run every role in one process (development, demos).
    All,
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

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
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
