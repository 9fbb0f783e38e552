//! Wiring of the roles (`api`, `all`, ...) and shutdown. Every long-running part takes a `CancellationToken`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::auth::TokenKeys;
use crate::config::Config;
use crate::http::{self, AppState, Shared};
use crate::idempotency::Fingerprinter;
use conveyor_jobs::Consumer;
use conveyor_jobs::Dispatcher;
use conveyor_jobs::Maintenance;
use conveyor_jobs::Metrics;
use conveyor_jobs::Producer;
use conveyor_jobs::RedisKeys;
use conveyor_jobs::{Worker, WorkerSettings};
use conveyor_shop::adapters::marketplace::HttpMarketplace;
use conveyor_shop::jobs::{VerifyCredentials, VerifyCredentialsHandler};
use conveyor_shop::sealing::Sealer;

/// Which parts a process runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The HTTP API.
    Api,
    /// The outbox relay.
    Dispatcher,
    /// Stream consumers running the job handlers.
    Worker,
    /// Retention and reconciliation.
    Maintenance,
    /// Every role in one process (development, demos).
    All,
}

impl Role {
    fn runs(self, part: Role) -> bool {
        self == Role::All || self == part
    }

    /// Its name: the subcommand, the `role` of `conveyor_build_info`, the default `OTEL_SERVICE_NAME` suffix.
    pub fn name(self) -> &'static str {
        match self {
            Role::Api => "api",
            Role::Dispatcher => "dispatcher",
            Role::Worker => "worker",
            Role::Maintenance => "maintenance",
            Role::All => "all",
        }
    }
}

/// Builds what the API shares, connecting to PostgreSQL and Redis.
pub async fn connect_state(config: &Config, metrics: Metrics) -> anyhow::Result<Shared> {
    let pool = conveyor_jobs::connect_postgres(config.database_url.expose(), config.database_max_connections)
        .await
        .context("Failed to connect to PostgreSQL (CONVEYOR_DATABASE_URL)")?;
    metrics.watch_pool("app", pool.clone());
    let redis =
        conveyor_jobs::connect_redis_with(config.redis_url.expose(), config.redis_command_timeout, &config.redis_tls)
            .await
            .context("Failed to connect to Redis (CONVEYOR_REDIS_URL)")?;
    // The operator role's pool opens lazily: a process serves its own role even while that role cannot connect; the
    // admin API then answers 503.
    let admin = match &config.operator_database_url {
        None => None,
        Some(url) => {
            let options = conveyor_jobs::postgres_options(url.expose())
                .context("CONVEYOR_OPERATOR_DATABASE_URL is not a valid PostgreSQL URL")?;
            let operator = conveyor_jobs::postgres_pool_options()
                .max_connections(4)
                .acquire_timeout(Duration::from_secs(5))
                .connect_lazy_with(options);
            metrics.watch_pool("operator", operator.clone());
            Some(conveyor_jobs::Admin::new(operator, pool.clone(), redis.clone(), RedisKeys::new(&config.redis_prefix)))
        }
    };
    let server_metrics = crate::metrics::ServerMetrics::register(&metrics.registry);
    let replays = crate::idempotency::ReplayCache::new(config.idempotency_replay_cache)
        .weighed_in(server_metrics.idempotency_replay_cache_bytes.clone());
    Ok(Shared {
        admin,
        replays,
        trace_url: config.trace_url.clone(),
        worker_visibility: config.worker_visibility,
        operator_auth: crate::operator_auth::OperatorAuth::new(
            config.admin_token.clone(),
            &[&config.operator_jwt_secret, &config.operator_jwt_previous_secret]
                .into_iter()
                .flatten()
                .collect::<Vec<_>>(),
        ),
        ui_sessions: http::ui::session::SessionKey::derive(
            config.admin_token.as_ref(),
            config.operator_jwt_secret.as_ref(),
        ),
        pool,
        redis,
        tokens: match &config.jwt_secret {
            Some(secret) => TokenKeys::rotating(secret, config.jwt_previous_secret.as_ref()),
            None => TokenKeys::refusing_all(),
        },
        sealer: Sealer::new(&config.encryption_key, "k1"),
        server_metrics,
        metrics,
        max_body_bytes: config.max_body_bytes,
        fingerprinter: Fingerprinter::new(config.idempotency_keys.clone()),
        idempotency_ttl: config.idempotency_ttl,
        storage: conveyor_shop::storage::ObjectStorage::open(&config.scenarios.object_store_url)
            .context("Failed to open object storage (CONVEYOR_OBJECT_STORE_URL)")?,
        scenarios: config.scenarios.clone(),
        uploads: Arc::new(tokio::sync::Semaphore::new(config.scenarios.media_max_concurrent_uploads)),
        redis_readiness: http::readiness::RedisGrace::new(config.ready_redis_grace),
        claim_hook: None,
        streams: CancellationToken::new(),
    })
}

/// Serves the API on `api` and the admin endpoints on `admin` until `shutdown`, then drains in-flight requests.
pub async fn serve(
    state: AppState,
    api: TcpListener,
    admin: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    tokio::try_join!(serve_api(state.clone(), api, shutdown.clone()), serve_admin(state, admin, shutdown))?;
    Ok(())
}

/// Serves the public API until `shutdown`.
pub async fn serve_api(state: AppState, listener: TcpListener, shutdown: CancellationToken) -> anyhow::Result<()> {
    axum::serve(listener, http::router(state))
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await
        .context("API server failed")
}

/// Serves `/healthz`, `/readyz` and `/metrics` until `shutdown`.
pub async fn serve_admin(state: AppState, listener: TcpListener, shutdown: CancellationToken) -> anyhow::Result<()> {
    let streams = state.streams.clone();
    axum::serve(listener, http::admin_router(state))
        .with_graceful_shutdown(async move {
            shutdown.cancelled().await;
            // Followed event streams never end on their own: ended here, so that their connections close.
            streams.cancel();
        })
        .await
        .context("Admin server failed")
}

async fn bind(addr: std::net::SocketAddr, variable: &str) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr).await.with_context(|| format!("Failed to bind {variable} {addr}"))
}

/// Runs `role` until SIGTERM or SIGINT (or until one of its parts fails), then stops within the grace period.
pub async fn run(mut config: Config, role: Role) -> anyhow::Result<()> {
    // Only the API role serves the admin API and the web UI: the operator's credentials stay out of the processes
    // that run job handlers on untrusted input (a worker fetching and decoding remote files).
    if !role.runs(Role::Api)
        && (config.operator_database_url.is_some()
            || config.admin_token.is_some()
            || config.operator_jwt_secret.is_some()
            || config.operator_jwt_previous_secret.is_some())
    {
        tracing::warn!(
            ?role,
            "CONVEYOR_OPERATOR_DATABASE_URL, CONVEYOR_ADMIN_TOKEN and CONVEYOR_OPERATOR_JWT_SECRET are ignored: only \
             the api role serves /admin/v1 and /ui; do not give them to this process"
        );
        config.operator_database_url = None;
        config.admin_token = None;
        config.operator_jwt_secret = None;
        config.operator_jwt_previous_secret = None;
    }
    // Only the API verifies workspace tokens; the other roles must not hold the key that mints them.
    if role.runs(Role::Api) && config.jwt_secret.is_none() {
        anyhow::bail!("CONVEYOR_JWT_SECRET is required by the api role (it verifies the workspace bearer tokens)");
    }
    if !role.runs(Role::Api) && (config.jwt_secret.is_some() || config.jwt_previous_secret.is_some()) {
        tracing::warn!(
            ?role,
            "CONVEYOR_JWT_SECRET is ignored: only the api role verifies workspace tokens; do not give it to this process"
        );
        config.jwt_secret = None;
        config.jwt_previous_secret = None;
    }
    // The API serves requests and runs no job: it never needs the runtime role's cross-workspace rights.
    if role == Role::Api && config.runtime_database_url.is_some() {
        tracing::warn!("CONVEYOR_RUNTIME_DATABASE_URL is ignored by the api role; do not give it to this process");
        config.runtime_database_url = None;
    }
    let shutdown = CancellationToken::new();
    let tracker = TaskTracker::new();
    let failed = Arc::new(AtomicBool::new(false));
    let state = AppState(Arc::new(connect_state(&config, Metrics::new()).await?));
    state.metrics.set_role(role.name());
    if role.runs(Role::Api) {
        state.server_metrics.init_api();
    }
    // The dispatcher, maintenance and the worker's bookkeeping (its own pool, see `build_worker`) work across
    // workspaces: as the runtime role, which the API and the job handlers' transactions never use.
    let runtime = if role.runs(Role::Dispatcher) || role.runs(Role::Maintenance) {
        Some(connect_runtime(&config, &state.metrics, "runtime").await?)
    } else {
        None
    };
    // A part that fails stops the whole process: a half-running service is worse than a restart.
    let spawn = |name: &'static str, part: BoxFuture| {
        let (shutdown, failed) = (shutdown.clone(), failed.clone());
        tracker.spawn(async move {
            if let Err(e) = part.await {
                tracing::error!(part = name, error = ?e, "Part failed; shutting down");
                failed.store(true, Ordering::SeqCst);
                shutdown.cancel();
            }
        });
    };

    spawn(
        "admin",
        Box::pin(serve_admin(state.clone(), bind(config.admin_addr, "CONVEYOR_ADMIN_ADDR").await?, shutdown.clone())),
    );
    if role.runs(Role::Api) {
        let listener = bind(config.http_addr, "CONVEYOR_HTTP_ADDR").await?;
        spawn("api", Box::pin(serve_api(state.clone(), listener, shutdown.clone())));
    }
    if role.runs(Role::Dispatcher) {
        let producer =
            Producer::new(state.redis.clone(), RedisKeys::new(&config.redis_prefix), config.dispatcher.dedup_ttl)
                .with_partitions(config.stream_partitions);
        let dispatcher = Dispatcher::new(
            runtime.clone().context("the runtime pool")?,
            producer,
            config.dispatcher.clone(),
            state.metrics.clone(),
            conveyor_jobs::instance_name(),
        );
        {
            let shutdown = shutdown.clone();
            spawn("dispatcher", Box::pin(async move { Ok(dispatcher.run(shutdown).await?) }));
        }
    }
    if role.runs(Role::Maintenance) {
        let maintenance = Maintenance::new(
            runtime.clone().context("the runtime pool")?,
            state.redis.clone(),
            RedisKeys::new(&config.redis_prefix),
            state.metrics.clone(),
            config.maintenance_interval,
            config.dispatcher.retention,
            config.reconcile_after,
        )
        .with_audit_retention(config.audit_retention)
        .with_dead_letter_retention(config.dead_letter_retention)
        .with_purge("idempotency_records", {
            // The API's idempotency records are the server's: expired ones go in the platform's pass.
            let purged = state.server_metrics.idempotency_records_purged.clone();
            move |pool| {
                let purged = purged.clone();
                async move {
                    let deleted = crate::idempotency::cleanup::purge_expired(
                        &pool,
                        conveyor_jobs::PURGE_BATCH,
                        conveyor_jobs::MAX_BATCHES_PER_PASS,
                    )
                    .await?;
                    purged.inc_by(deleted);
                    Ok(deleted)
                }
            }
        });
        {
            let shutdown = shutdown.clone();
            spawn("maintenance", Box::pin(async move { Ok(maintenance.run(shutdown).await?) }));
        }
    }
    if role.runs(Role::Worker) {
        let worker = build_worker(&config, &state).await?;
        {
            let (shutdown, grace) = (shutdown.clone(), config.shutdown_grace);
            spawn("worker", Box::pin(async move { Ok(worker.run(shutdown, grace).await?) }));
        }
    }
    tracker.close();
    tracing::info!(http = %config.http_addr, admin = %config.admin_addr, ?role, "Conveyor started");

    tokio::select! {
        _ = wait_for_signal() => tracing::info!(grace = ?config.shutdown_grace, "Shutting down"),
        _ = shutdown.cancelled() => {}
    }
    shutdown.cancel();
    // Parts keep their own grace periods; this outer deadline only catches one that hangs past its own.
    if tokio::time::timeout(config.shutdown_grace + Duration::from_secs(10), tracker.wait()).await.is_err() {
        tracing::warn!("Grace period over; exiting with work unfinished");
    }
    if failed.load(Ordering::SeqCst) {
        anyhow::bail!("a part of the process failed; see the log");
    }
    Ok(())
}

/// A pool of the runtime role (`CONVEYOR_RUNTIME_DATABASE_URL`, required by the dispatcher, maintenance and worker
/// roles), watched by the metrics as `name`.
pub async fn connect_runtime(config: &Config, metrics: &Metrics, name: &'static str) -> anyhow::Result<sqlx::PgPool> {
    let url = config.runtime_database_url.as_ref().context(
        "CONVEYOR_RUNTIME_DATABASE_URL is required by the dispatcher, maintenance and worker roles (the runtime role's \
         URL: they work across workspaces, which the application role of CONVEYOR_DATABASE_URL may not)",
    )?;
    let pool = conveyor_jobs::connect_postgres(url.expose(), config.database_max_connections)
        .await
        .context("Failed to connect to PostgreSQL as the runtime role (CONVEYOR_RUNTIME_DATABASE_URL)")?;
    metrics.watch_pool(name, pool.clone());
    Ok(pool)
}

/// The worker of this process: every handler Conveyor ships, over the configured marketplace; the jobs' transactions
/// as the application role, its bookkeeping across workspaces as the runtime role (a pool of its own).
pub async fn build_worker(config: &Config, state: &AppState) -> anyhow::Result<Worker> {
    let runtime = connect_runtime(config, &state.metrics, "worker_runtime").await?;
    let marketplace_url = config
        .marketplace_url
        .as_deref()
        .context("CONVEYOR_MARKETPLACE_URL is required by the worker (the sandbox's URL in development)")?;
    let blocking_timeout = config.redis_command_timeout + Duration::from_secs(5);
    let blocking = conveyor_jobs::connect_redis_with(config.redis_url.expose(), blocking_timeout, &config.redis_tls)
        .await
        .context("Failed to open the blocking Redis connection")?;
    let consumer = Consumer::new(
        state.redis.clone(),
        blocking,
        RedisKeys::new(&config.redis_prefix),
        conveyor_jobs::instance_name(),
    )
    .with_partitions(config.stream_partitions);
    let marketplace = Arc::new(HttpMarketplace::trusting(
        marketplace_url,
        config.job_timeout,
        config.scenarios.tls_ca_file.as_deref(),
    )?);
    // Every running job with an operation holds a connection of the worker's pool in its transaction for its whole
    // run; handlers that commit transactions of their own (a catalog page, AI reservations) take them from this pool,
    // one per job slot at most, so they never wait for connections their own jobs hold.
    let handler_pool = conveyor_jobs::postgres_pool_options()
        .max_connections(u32::try_from(config.worker_concurrency).unwrap_or(u32::MAX))
        .acquire_timeout(Duration::from_secs(5))
        .connect_lazy_with((*state.pool.connect_options()).clone());
    state.metrics.watch_pool("worker_handlers", handler_pool.clone());
    state.server_metrics.media.init();
    let settings = WorkerSettings {
        concurrency: config.worker_concurrency,
        visibility: config.worker_visibility,
        keepalive: config.operation_keepalive,
        max_deliveries: config.worker_max_deliveries,
        queue_concurrency: config.worker_queue_concurrency.clone(),
        ..WorkerSettings::default()
    };
    Worker::builder(state.pool.clone(), consumer)
        .runtime_pool(runtime)
        .handle::<VerifyCredentials>(VerifyCredentialsHandler {
            sealer: state.sealer.clone(),
            marketplace: marketplace.clone(),
            max_attempts: config.job_max_attempts,
            timeout: config.job_timeout,
        })
        .handle::<conveyor_shop::jobs::PublishListing>(conveyor_shop::jobs::PublishListingHandler {
            sealer: state.sealer.clone(),
            marketplace,
            max_attempts: config.job_max_attempts,
            timeout: config.job_timeout,
        })
        .handle::<conveyor_shop::jobs::ProcessMedia>(conveyor_shop::jobs::ProcessMediaHandler {
            settings: conveyor_shop::domain::media::ProcessSettings {
                storage: state.storage.clone(),
                limits: conveyor_shop::domain::media::ImageLimits {
                    max_bytes: config.scenarios.media_max_bytes,
                    max_pixels: config.scenarios.media_max_pixels,
                },
                gate: conveyor_shop::domain::media::DecodeGate::new(
                    config.scenarios.media_decode_permits,
                    config.scenarios.media_decode_memory,
                ),
            },
            metrics: state.server_metrics.media.clone(),
            max_attempts: config.job_max_attempts,
            timeout: config.job_timeout,
        })
        .handle::<conveyor_shop::jobs::TransferAsset>(conveyor_shop::jobs::TransferAssetHandler::new(
            &state.pool,
            state.storage.clone(),
            Arc::new(conveyor_shop::adapters::fetch::Fetcher::new(
                config.scenarios.fetch_settings(),
                Arc::new(conveyor_shop::adapters::fetch::SystemResolver),
            )?),
            config.job_max_attempts,
        ))
        .handle::<conveyor_shop::jobs::SyncCatalog>(conveyor_shop::jobs::SyncCatalogHandler {
            pool: handler_pool.clone(),
            sealer: state.sealer.clone(),
            catalog: Arc::new(conveyor_shop::adapters::catalog::HttpCatalog::new(
                marketplace_url,
                config.job_timeout,
                config.scenarios.tls_ca_file.as_deref(),
            )?),
            page_size: config.scenarios.catalog_page_size,
            max_attempts: config.job_max_attempts,
        })
        .handle::<conveyor_shop::jobs::GenerateAi>(conveyor_shop::jobs::GenerateAiHandler {
            provider: Arc::new(conveyor_shop::adapters::ai::HttpAiProvider::new(
                config.scenarios.ai_provider_url.as_deref().unwrap_or(marketplace_url),
                config.job_timeout,
                config.scenarios.tls_ca_file.as_deref(),
            )?),
            pool: handler_pool.clone(),
            credits_limit: config.scenarios.ai_credits_per_workspace,
            max_attempts: config.job_max_attempts,
            timeout: config.job_timeout,
        })
        .settings(settings)
        .metrics(state.metrics.clone())
        .build()
        .map_err(Into::into)
}

type BoxFuture = std::pin::Pin<Box<dyn std::future::Future<Output = anyhow::Result<()>> + Send>>;

/// Resolves on the first SIGTERM or SIGINT.
pub async fn wait_for_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}
