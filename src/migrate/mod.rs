//! Conveyor's schema. [`migrate`] applies it as the role of a service's pool, which then does everything (one role).
//! [`run`] (`migrate_with`, what `conveyor migrate` does) is the multi-tenant mode: it applies `migrations/` as the
//! owner role, then grants each role what it needs and no more, after checking that it is neither superuser, `BYPASSRLS`, the owner nor a
//! member of the owner, any of which would walk through row-level security:
//!
//! - the application role (`CONVEYOR_DATABASE_URL`: the API, job handlers): DML on Conveyor's tables (`job_kinds`,
//!   `workspace_weights`, `dispatch_pauses` and `dispatchers_awake` read only: [`READ_ONLY_TABLES`]) and `EXECUTE` on the functions of
//!   [`APPLICATION_FUNCTIONS`] alone, each proven to stay in the caller's workspace;
//! - the runtime role (`CONVEYOR_RUNTIME_DATABASE_URL`: dispatcher, maintenance, the worker's bookkeeping): DML on
//!   the platform's tables alone ([`RUNTIME_TABLES`], never a business table; the operator's weights and pauses it
//!   only reads), every `conveyor_` function but the
//!   operator's (among them those that read or change rows of several
//!   workspaces in one call), and a policy that reads every pause (the relay's claim reads them across workspaces);
//! - the operator role (`CONVEYOR_OPERATOR_DATABASE_URL`, optional): `EXECUTE` on the audited `conveyor_admin_*`
//!   functions and nothing else.
//!
//! It also writes `CONVEYOR_AUDIT_RETENTION` into `conveyor_settings` (migration 0035, the owner's alone): the floor
//! under which `conveyor_audit_purge` deletes nothing, whatever its caller asks.
//!
//! PUBLIC loses `EXECUTE` on every `conveyor_` function (PostgreSQL grants it on creation), so a function added
//! later reaches no role but the runtime until it is listed.
//!
//! Every object of the platform's is in the schema `conveyor`, with its migration history ([`HISTORY_TABLE`]), so
//! that a service that keeps its own tables and its own sqlx migrations in `public` (sqlx's default
//! `_sqlx_migrations`) shares the database without a clash. Every function that reads a table pins its search path
//! to `pg_catalog, conveyor, pg_temp`, whatever the path of the connection that calls it. [`migrator`] is the
//! migrations unrun, for a host that composes its own. A database of the old layout, with everything in `public`, is
//! adopted in place ([`adopt_public_layout`]).

mod adopt;

pub use adopt::{PublicLayout, adopt_public_layout};

use crate::error::Public;
use anyhow::{Context, bail};
use sqlx::migrate::Migrator;
use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection, PgPool};

use crate::Secret;
use std::time::Duration;

/// The migrations, embedded in the binary (sqlx's default history table: [`migrator`] sets the platform's).
static MIGRATIONS: Migrator = sqlx::migrate!("./migrations");

/// The platform's schema.
pub const SCHEMA: &str = "conveyor";

/// The table of the platform's migration history.
pub const HISTORY_TABLE: &str = "conveyor._sqlx_migrations";

/// The platform's migrations, unrun: they create the schema `conveyor` and record their history in
/// [`HISTORY_TABLE`]. [`migrate`] runs them (one role), [`run`] runs them and grants the roles; a host that runs its own migrations can run these
/// with them (as the owner of its database), then grant what its roles need. They do not adopt a database of the old
/// layout (everything in `public`): such a host calls [`adopt_old_layout`] on the same connection first.
pub fn migrator() -> Migrator {
    let mut migrator = Migrator::with_migrations(MIGRATIONS.iter().cloned().collect());
    migrator.dangerous_set_table_name(HISTORY_TABLE);
    migrator.create_schema(SCHEMA);
    migrator
}

/// The platform's objects as the old layout kept them in `public`, what [`adopt`] moves into `conveyor`: its tables
/// ([`TABLES`] and the owner's two) and its functions.
const OWNER_TABLES: &[&str] = &["conveyor_admin_audit", "conveyor_settings"];
const PUBLIC_FUNCTIONS: &[&str] = &[
    "conveyor_admin_audit_trail",
    "conveyor_admin_audit_write",
    "conveyor_admin_check_limit",
    "conveyor_admin_check_scope",
    "conveyor_admin_dead_letters",
    "conveyor_admin_job",
    "conveyor_admin_jobs",
    "conveyor_admin_locate_job",
    "conveyor_admin_operations",
    "conveyor_admin_pause",
    "conveyor_admin_pauses",
    "conveyor_admin_queues",
    "conveyor_admin_resume",
    "conveyor_admin_schedules",
    "conveyor_admin_set_weight",
    "conveyor_admin_state_condition",
    "conveyor_audit_purge",
    "conveyor_canceled_jobs",
    "conveyor_claim_jobs",
    "conveyor_claim_jobs_fair",
    "conveyor_claim_outbox",
    "conveyor_complete_jobs",
    "conveyor_current_workspace",
    "conveyor_dead_letter_purge",
    "conveyor_due_outbox_workspaces",
    "conveyor_due_schedules",
    "conveyor_due_workspaces",
    "conveyor_enqueue",
    "conveyor_event_by_stream_id",
    "conveyor_job_state",
    "conveyor_jobs_not_to_run",
    "conveyor_jobs_taken_over",
    "conveyor_mark_outbox_dispatched",
    "conveyor_next_due_after",
    "conveyor_next_due_at",
    "conveyor_next_schedule_at",
    "conveyor_outbox_backlog",
    "conveyor_outbox_backlog_due",
    "conveyor_outbox_retention_workspaces",
    "conveyor_outbox_retention_workspaces_v2",
    "conveyor_stalled_operation_workspaces",
    "conveyor_unattended_dispatched_workspaces",
    "conveyor_uuid_v7",
];

/// Moves the platform's objects of a database of the old layout (everything in `public`, Conveyor 0.1) into `conveyor`
/// in place, its history recorded up to 0037, the last migration of that layout; 0038 and later then run as anywhere.
/// What [`migrate`] does before the migrations, for a host that runs [`migrator`] itself (as the owner). Returns
/// whether it moved anything; refuses a database short of the old layout's last version, or holding both layouts.
pub async fn adopt_old_layout(conn: &mut PgConnection) -> Result<bool, crate::Error> {
    adopt(conn, &migrator()).await.map_err(crate::Error::new)
}

async fn adopt(conn: &mut PgConnection, migrator: &Migrator) -> anyhow::Result<bool> {
    let tables: Vec<&str> =
        TABLES.iter().chain(OWNER_TABLES).copied().filter(|t| !TABLES_SINCE_THE_MOVE.contains(t)).collect();
    let layout = PublicLayout {
        schema: SCHEMA,
        search_path: SCHEMA,
        tables: &tables,
        functions: PUBLIC_FUNCTIONS,
        migrator,
        through: adopt::PUBLIC_LAYOUT_VERSIONS,
    };
    adopt::adopt_platform(conn, &layout).await
}

/// Conveyor's tables: the application role gets DML on these and no others (a service sharing the database keeps its
/// own grants).
const TABLES: &[&str] = &[
    "operations",
    "outbox_events",
    "job_kinds",
    "workspace_weights",
    "dispatch_pauses",
    "job_key_limits",
    "job_kind_limits",
    "job_schedules",
    "job_schedule_runs",
    "job_failures",
    "dispatchers_awake",
    "job_logs",
    "dedup_keys",
    "job_events",
    "event_listeners",
];

/// Tables created after the move into `conveyor` (0038): a database of the old layout has none of them.
const TABLES_SINCE_THE_MOVE: &[&str] =
    &["dispatchers_awake", "job_logs", "dedup_keys", "job_events", "event_listeners"];

/// The tables the runtime role works on (DML): the platform's own. A product's tables are never the runtime's: the
/// dispatcher, maintenance and the worker's bookkeeping read and write jobs, operations, limits and schedules only (a
/// product's trigger that reaches its own table on an operation's end runs as the owner, written safely).
const RUNTIME_TABLES: &[&str] = &[
    "operations",
    "outbox_events",
    "job_kinds",
    "job_key_limits",
    "job_kind_limits",
    "job_schedules",
    "job_schedule_runs",
    "job_failures",
    "dispatchers_awake",
    "dedup_keys",
    "job_events",
    "event_listeners",
];

/// The operator's functions (`LIKE` pattern): granted to the operator role only, never to the application role.
const ADMIN_FUNCTIONS: &str = "conveyor\\_admin\\_%";

/// The functions the application role may execute (every overload of each name): each reads and writes only the
/// workspace of the caller's context (`app.workspace_id`, under row-level security), or no table at all. Every other
/// `conveyor_` function but the operator's is the runtime role's. `server/tests/api/rls.rs` proves each one and fails when the
/// application role can execute anything else.
pub const APPLICATION_FUNCTIONS: &[&str] = &[
    // The workspace of the caller's context: what every row-level security policy compares with.
    "conveyor_current_workspace",
    // Pure: no table.
    "conveyor_uuid_v7",
    "conveyor_job_state",
    // Enqueues in the caller's workspace, refused without one (SECURITY INVOKER, under row-level security).
    "conveyor_enqueue",
    // Notifies the dispatchers unless one is awake (migration 0039): reads one row of no workspace's.
    "conveyor_wake_dispatchers",
];

/// The tables the runtime role only reads: the operator's weights and pauses (the relay's claim reads them; only the
/// audited `conveyor_admin_*` functions change them).
const RUNTIME_READ_ONLY_TABLES: &[&str] = &["workspace_weights", "dispatch_pauses"];

/// The tables the application role only reads: the kinds (the worker's bookkeeping, as the runtime role, registers
/// them), and the operator's data, weights and pauses (migration 0035: changed through the audited
/// `conveyor_admin_pause`, `conveyor_admin_resume` and `conveyor_admin_set_weight`; the application role reads the
/// pauses that hold its jobs), and the dispatchers' mark (migration 0039: an enqueue reads it; only the runtime role
/// writes it).
const READ_ONLY_TABLES: &[&str] = &["job_kinds", "workspace_weights", "dispatch_pauses", "dispatchers_awake"];

/// The multi-tenant mode's migration: the owner's URL, and the names of the roles to check and grant (each must
/// exist; `migrate_with` never needs their passwords).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct MigrateConfig {
    /// PostgreSQL URL of the owner role (`CONVEYOR_MIGRATION_DATABASE_URL`), which applies the schema.
    pub owner_url: Secret<String>,
    /// The application role (the user of `CONVEYOR_DATABASE_URL`): DML rights, the functions that stay in one
    /// workspace.
    pub application_role: String,
    /// The runtime role (the user of `CONVEYOR_RUNTIME_DATABASE_URL`): DML rights and the functions that work across
    /// workspaces.
    pub runtime_role: String,
    /// The operator role (the user of `CONVEYOR_OPERATOR_DATABASE_URL`), optional: the audited `conveyor_admin_*`
    /// functions and nothing else.
    pub operator_role: Option<String>,
    /// The audit trail's retention (`CONVEYOR_AUDIT_RETENTION`, at least 1d): written where only the owner can change
    /// it, as the floor of every purge; `None` writes the default, 90 days.
    pub audit_retention: Option<Duration>,
    /// Dead letters' retention (`CONVEYOR_DEAD_LETTER_RETENTION`, at least 1d), written the same way as the floor of
    /// every purge of them; `None` writes the default, 30 days.
    pub dead_letter_retention: Option<Duration>,
}

/// What `CONVEYOR_AUDIT_RETENTION` defaults to, written by [`migrate`] and a [`MigrateConfig`] without one.
const DEFAULT_AUDIT_RETENTION: std::time::Duration = crate::maintenance::DEFAULT_AUDIT_RETENTION;
const DEFAULT_DEAD_LETTER_RETENTION: std::time::Duration = crate::maintenance::DEFAULT_DEAD_LETTER_RETENTION;

/// The policy through which the runtime role reads every pause (`dispatch_pauses`, under row-level security since
/// migration 0026): the relay's claim reads them for every workspace it claims from.
const RUNTIME_PAUSES_POLICY: &str = "runtime_scan";

/// Which role may execute a function.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Reach {
    /// The operator role alone (`conveyor_admin_*`).
    Operator,
    /// The application role and the runtime role ([`APPLICATION_FUNCTIONS`]).
    Application,
    /// The runtime role alone (every other `conveyor_` function).
    Runtime,
}

pub(crate) fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// Applies Conveyor's schema to the database of `pool`, whose role owns it (a service's own role, as most have) and is
/// then the one role Conveyor uses: requests, job handlers, the dispatcher, the worker's bookkeeping and maintenance
/// all work through `pool`. Safe to run again, and from several processes at once (one migrates while the others wait,
/// between statements, for its advisory lock). The retentions of the audit trail and of dead letters are the defaults (90 and 30 days) where none is
/// recorded yet. It grants no role: a database of the multi-tenant mode is migrated with
/// [`migrate_with`](crate::migrate_with), which grants its roles what new migrations add.
///
/// This is the single-role mode. Jobs still carry a workspace (a service without tenants uses
/// [`WorkspaceId::DEFAULT`](crate::WorkspaceId::DEFAULT), through [`begin`](crate::begin)), which fairness, pauses
/// and limits go by, but workspaces are no wall: the one role reads every workspace's jobs. For the multi-tenant
/// wall, where requests and handlers run as a role that row-level security confines to its workspace, migrate with
/// [`migrate_with`](crate::migrate_with) and the roles it names instead.
///
/// ```no_run
/// # async fn f() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = sqlx::PgPool::connect("postgres://app:secret@127.0.0.1/app").await?;
/// conveyor_jobs::migrate(&pool).await?;
/// # Ok(()) }
/// ```
pub async fn migrate(pool: &PgPool) -> Result<(), crate::Error> {
    migrate_single(pool).await.public()
}

/// Waits for, and takes, the lock that lets one process at a time migrate the database, on `conn`'s session (released
/// by [`unlock_migrations`], or with the session). sqlx's migrator takes one too, but waits for it inside a statement,
/// whose snapshot a `CREATE INDEX CONCURRENTLY` of the process migrating must wait for in turn: PostgreSQL breaks that
/// cycle by failing one of them (seen with two processes migrating a new database at once). Here a process waits
/// between statements, holding no snapshot, so an index built concurrently never waits for it.
async fn lock_migrations(conn: &mut PgConnection) -> anyhow::Result<()> {
    loop {
        let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock(hashtextextended('conveyor-migrate', 0))")
            .fetch_one(&mut *conn)
            .await
            .context("Failed to take the migrations' lock")?;
        if locked {
            return Ok(());
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// Releases the lock of [`lock_migrations`].
async fn unlock_migrations(conn: &mut PgConnection) -> anyhow::Result<()> {
    sqlx::query("SELECT pg_advisory_unlock(hashtextextended('conveyor-migrate', 0))").execute(&mut *conn).await?;
    Ok(())
}

/// Adopts an earlier release's layout and applies the migrations on `conn`, one process at a time.
async fn apply(conn: &mut PgConnection, migrator: &Migrator) -> anyhow::Result<()> {
    lock_migrations(conn).await?;
    let applied = apply_locked(conn, migrator).await;
    unlock_migrations(conn).await?;
    applied
}

async fn apply_locked(conn: &mut PgConnection, migrator: &Migrator) -> anyhow::Result<()> {
    adopt(conn, migrator).await.context("Failed to adopt the objects an earlier release kept in public")?;
    migrator.run(conn).await.context("Failed to apply migrations")?;
    Ok(())
}

async fn migrate_single(pool: &PgPool) -> anyhow::Result<()> {
    let mut conn = pool.acquire().await.context("Failed to connect to PostgreSQL")?;
    let migrator = migrator();
    apply(&mut conn, &migrator).await?;
    let mut tx = conn.begin().await?;
    // The defaults where none is recorded: never lowers a floor `migrate_with` wrote.
    record_retentions(&mut tx, DEFAULT_AUDIT_RETENTION, DEFAULT_DEAD_LETTER_RETENTION, false).await?;
    tx.commit().await?;
    tracing::info!("Migrations applied (one role)");
    Ok(())
}

impl MigrateConfig {
    /// The multi-tenant setup: the owner's URL and the names of the application and runtime roles (no operator
    /// role), with the default retentions.
    pub fn new(owner_url: &str, application_role: &str, runtime_role: &str) -> Self {
        Self {
            owner_url: Secret::new(owner_url.to_owned()),
            application_role: application_role.to_owned(),
            runtime_role: runtime_role.to_owned(),
            operator_role: None,
            audit_retention: None,
            dead_letter_retention: None,
        }
    }

    /// Grants the operator role `role` the audited operator functions too.
    pub fn operator(mut self, role: &str) -> Self {
        self.operator_role = Some(role.to_owned());
        self
    }

    /// Keeps the audit trail `audit` and dead letters `dead_letters` (each at least a day), where the defaults are 90
    /// and 30 days.
    pub fn retentions(mut self, audit: Duration, dead_letters: Duration) -> Self {
        self.audit_retention = Some(audit);
        self.dead_letter_retention = Some(dead_letters);
        self
    }

    /// The user a PostgreSQL URL connects as, for a caller that holds the roles' URLs.
    pub fn role_of(url: &str) -> Result<String, crate::Error> {
        let options: PgConnectOptions = url
            .parse()
            .map_err(|e: sqlx::Error| crate::Error::invalid(anyhow::anyhow!("not a PostgreSQL URL: {e}")))?;
        Ok(options.get_username().to_owned())
    }
}

/// The roles [`run`] checked and granted: a product crate that keeps tables beside the platform's grants them its own.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Roles {
    /// The application role (requests, job handlers).
    pub application: String,
    /// The runtime role (dispatcher, maintenance, the worker's bookkeeping).
    pub runtime: String,
    /// The operator role, when one was given.
    pub operator: Option<String>,
}

/// Applies every migration and grants the application, runtime and operator roles. Safe to run again. Returns the
/// roles, checked.
pub async fn run(config: &MigrateConfig) -> Result<Roles, crate::Error> {
    let (audit_retention, dead_letter_retention) = retentions(config).map_err(crate::Error::invalid)?;
    run_inner(config, audit_retention, dead_letter_retention).await.public()
}

/// The retentions `config` asks for, each at least a day.
fn retentions(config: &MigrateConfig) -> anyhow::Result<(std::time::Duration, std::time::Duration)> {
    let audit_retention = config.audit_retention.unwrap_or(DEFAULT_AUDIT_RETENTION);
    if audit_retention < std::time::Duration::from_secs(24 * 3600) {
        bail!("CONVEYOR_AUDIT_RETENTION must be at least 1d: the audit trail is kept at least a day");
    }
    let dead_letter_retention = config.dead_letter_retention.unwrap_or(DEFAULT_DEAD_LETTER_RETENTION);
    if dead_letter_retention < std::time::Duration::from_secs(24 * 3600) {
        bail!("CONVEYOR_DEAD_LETTER_RETENTION must be at least 1d: dead letters are kept at least a day");
    }
    Ok((audit_retention, dead_letter_retention))
}

async fn run_inner(
    config: &MigrateConfig,
    audit_retention: std::time::Duration,
    dead_letter_retention: std::time::Duration,
) -> anyhow::Result<Roles> {
    let owner_options: PgConnectOptions = crate::db::connect_options(config.owner_url.expose())
        .context("the owner's URL (CONVEYOR_MIGRATION_DATABASE_URL) is not a valid PostgreSQL URL")?;
    let app_role = config.application_role.clone();
    let runtime_role = config.runtime_role.clone();

    let mut conn = PgConnection::connect_with(&owner_options).await.context("Failed to connect as the owner role")?;
    let migrator = migrator();
    apply(&mut conn, &migrator).await?;

    check_role(&mut conn, &app_role, "application role").await?;
    if runtime_role == app_role {
        bail!(
            "the runtime role `{runtime_role}` is the application role: the runtime's functions work across \
             workspaces and must not be granted to the application"
        );
    }
    check_role(&mut conn, &runtime_role, "runtime role").await?;
    let operator_role = match &config.operator_role {
        None => None,
        Some(role) => {
            if *role == app_role {
                bail!(
                    "the operator role `{role}` is the application role: the operator's functions read across \
                     workspaces and must not be granted to the application"
                );
            }
            if *role == runtime_role {
                bail!("the operator role `{role}` is the runtime role: give each its own role");
            }
            check_role(&mut conn, role, "operator role").await?;
            Some(role.clone())
        }
    };

    let role = quote_ident(&app_role);
    let runtime = quote_ident(&runtime_role);
    let mut tx = conn.begin().await?;
    let database: (String,) = sqlx::query_as("SELECT current_database()::text").fetch_one(&mut *tx).await?;
    let database = quote_ident(&database.0);
    let tables: Vec<(String,)> =
        sqlx::query_as("SELECT tablename::text FROM pg_tables WHERE schemaname = 'conveyor' AND tablename = ANY($1)")
            .bind(TABLES)
            .fetch_all(&mut *tx)
            .await?;
    let functions: Vec<(String, Reach)> = sqlx::query_as::<_, (String, bool, bool)>(
        "SELECT p.oid::regprocedure::text, p.proname LIKE $1, p.proname = ANY($2) FROM pg_proc p
         JOIN pg_namespace n ON n.oid = p.pronamespace
         WHERE n.nspname = 'conveyor' AND p.proname LIKE 'conveyor\\_%'",
    )
    .bind(ADMIN_FUNCTIONS)
    .bind(APPLICATION_FUNCTIONS)
    .fetch_all(&mut *tx)
    .await?
    .into_iter()
    .map(|(function, admin, application)| {
        let reach = match (admin, application) {
            (true, _) => Reach::Operator,
            (false, true) => Reach::Application,
            (false, false) => Reach::Runtime,
        };
        (function, reach)
    })
    .collect();
    let mut grants = Vec::new();
    for grantee in [&role, &runtime] {
        grants.push(format!("GRANT CONNECT ON DATABASE {database} TO {grantee}"));
        grants.push(format!("GRANT USAGE ON SCHEMA conveyor TO {grantee}"));
        grants.push(format!("GRANT SELECT ON {HISTORY_TABLE} TO {grantee}"));
    }
    // The old layout's history, kept by an adoption as a record: the owner's alone now.
    let (kept,): (bool,) =
        sqlx::query_as("SELECT to_regclass('conveyor.public_layout_history') IS NOT NULL").fetch_one(&mut *tx).await?;
    if kept {
        grants.push(format!("REVOKE ALL ON conveyor.public_layout_history FROM PUBLIC, {role}, {runtime}"));
    }
    for (t,) in &tables {
        let table = format!("conveyor.{}", quote_ident(t));
        grants.push(format!("GRANT SELECT, INSERT, UPDATE, DELETE ON {table} TO {role}"));
        if RUNTIME_READ_ONLY_TABLES.contains(&t.as_str()) {
            // Earlier releases let it write them too.
            grants.push(format!("REVOKE ALL ON {table} FROM {runtime}"));
            grants.push(format!("GRANT SELECT ON {table} TO {runtime}"));
            continue;
        }
        grants.push(if RUNTIME_TABLES.contains(&t.as_str()) {
            format!("GRANT SELECT, INSERT, UPDATE, DELETE ON {table} TO {runtime}")
        } else {
            // Defensively too: earlier releases granted the runtime role every table.
            format!("REVOKE ALL ON {table} FROM {runtime}")
        });
    }
    // The application role reads the kinds the workers register, the weights and the pauses; it changes none (a kind
    // is every workspace's, weights and pauses are the operator's).
    grants.extend(
        tables
            .iter()
            .filter(|(t,)| READ_ONLY_TABLES.contains(&t.as_str()))
            .map(|(t,)| format!("REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON conveyor.{} FROM {role}", quote_ident(t))),
    );
    for (function, reach) in &functions {
        // Defensively too: an earlier release granted every `conveyor_` function to the application role.
        grants.push(format!("REVOKE ALL ON FUNCTION {function} FROM PUBLIC"));
        match reach {
            Reach::Operator => {
                grants.push(format!("REVOKE ALL ON FUNCTION {function} FROM {role}"));
                grants.push(format!("REVOKE ALL ON FUNCTION {function} FROM {runtime}"));
            }
            Reach::Application => {
                grants.push(format!("GRANT EXECUTE ON FUNCTION {function} TO {role}"));
                grants.push(format!("GRANT EXECUTE ON FUNCTION {function} TO {runtime}"));
            }
            Reach::Runtime => {
                grants.push(format!("REVOKE ALL ON FUNCTION {function} FROM {role}"));
                grants.push(format!("GRANT EXECUTE ON FUNCTION {function} TO {runtime}"));
            }
        }
    }
    // Recreated on every run, so that it follows the runtime role when the URL names another.
    grants.push(format!("DROP POLICY IF EXISTS {RUNTIME_PAUSES_POLICY} ON conveyor.dispatch_pauses"));
    grants.push(format!(
        "CREATE POLICY {RUNTIME_PAUSES_POLICY} ON conveyor.dispatch_pauses FOR SELECT TO {runtime} USING (true)"
    ));
    if let Some(operator) = &operator_role {
        let operator = quote_ident(operator);
        grants.push(format!("GRANT CONNECT ON DATABASE {database} TO {operator}"));
        grants.push(format!("GRANT USAGE ON SCHEMA conveyor TO {operator}"));
        grants.extend(
            functions
                .iter()
                .filter(|(_, reach)| *reach == Reach::Operator)
                .map(|(function, _)| format!("GRANT EXECUTE ON FUNCTION {function} TO {operator}")),
        );
    }
    for grant in grants {
        sqlx::query(sqlx::AssertSqlSafe(grant))
            .execute(&mut *tx)
            .await
            .context("Failed to grant the application, runtime and operator roles")?;
    }
    record_retentions(&mut tx, audit_retention, dead_letter_retention, true).await?;
    tx.commit().await?;
    tracing::info!(
        role = %app_role,
        runtime = %runtime_role,
        operator = operator_role.as_deref().unwrap_or("none"),
        tables = tables.len(),
        "Migrations applied and roles granted"
    );
    Ok(Roles { application: app_role, runtime: runtime_role, operator: operator_role })
}

/// Writes the retentions of the audit trail and of dead letters where no role but the owner reads or writes them: the
/// floors of their purges. `replace`: over the recorded ones; else only where none is recorded.
async fn record_retentions(
    tx: &mut PgConnection,
    audit_retention: std::time::Duration,
    dead_letter_retention: std::time::Duration,
    replace: bool,
) -> anyhow::Result<()> {
    let conflict = if replace { "DO UPDATE SET value = EXCLUDED.value, updated_at = now()" } else { "DO NOTHING" };
    for (setting, retention, variable) in [
        ("audit_retention", audit_retention, "CONVEYOR_AUDIT_RETENTION"),
        ("dead_letter_retention", dead_letter_retention, "CONVEYOR_DEAD_LETTER_RETENTION"),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO conveyor.conveyor_settings (name, value) VALUES ($1, justify_hours(make_interval(secs => $2))::text)
             ON CONFLICT (name) {conflict}"
        )))
        .bind(setting)
        .bind(retention.as_secs_f64())
        .execute(&mut *tx)
        .await
        .with_context(|| format!("Failed to record {variable}"))?;
    }
    Ok(())
}

/// Refuses `role` (the `what`) unless it exists and row-level security applies to it: not a superuser,
/// no `BYPASSRLS`, neither the owner (the connected role) nor a member of it.
async fn check_role(conn: &mut PgConnection, role: &str, what: &str) -> anyhow::Result<()> {
    let (owner, exists, superuser, bypass, member): (String, bool, bool, bool, bool) = sqlx::query_as(
        "SELECT current_user::text,
                r.rolname IS NOT NULL,
                coalesce(r.rolsuper, false),
                coalesce(r.rolbypassrls, false),
                r.rolname IS NOT NULL AND pg_has_role(r.rolname, current_user, 'MEMBER')
         FROM (SELECT 1) one LEFT JOIN pg_roles r ON r.rolname = $1",
    )
    .bind(role)
    .fetch_one(&mut *conn)
    .await
    .with_context(|| format!("Failed to inspect the {what}"))?;
    if !exists {
        bail!("the {what} `{role}` does not exist; create it first");
    }
    if superuser || bypass || member || owner == role {
        bail!(
            "the {what} `{role}` must not be a superuser, have BYPASSRLS, or be (a member of) the owner `{owner}`: \
             row-level security would not apply to it"
        );
    }
    // Conveyor's functions search `pg_catalog, conveyor, pg_temp`: a role that may create objects in `conveyor` could
    // plant a function or operator there that a definer function would call as the owner. Only the owner has that
    // right, unless somebody granted it. In `public` too, out of caution: the few functions that pin no path (pure,
    // no table) then find nothing of such a role's either. PostgreSQL 15 and later no longer grant it to PUBLIC.
    for schema in ["conveyor", "public"] {
        let (create,): (bool,) = sqlx::query_as("SELECT has_schema_privilege($1, $2, 'CREATE')")
            .bind(role)
            .bind(schema)
            .fetch_one(&mut *conn)
            .await
            .with_context(|| format!("Failed to inspect the {what}'s rights on the schema {schema}"))?;
        if create {
            bail!(
                "the {what} `{role}` may create objects in the schema {schema}, where Conveyor's \
                 functions could find them: run `REVOKE CREATE ON SCHEMA {schema} FROM PUBLIC, {role}` as its owner \
                 (for public, the default since PostgreSQL 15)"
            );
        }
    }
    Ok(())
}

/// How many embedded migrations the database has not applied (0 when current).
pub async fn pending_versions(pool: &PgPool) -> Result<usize, sqlx::Error> {
    let applied: Vec<(i64,)> =
        sqlx::query_as(sqlx::AssertSqlSafe(format!("SELECT version FROM {HISTORY_TABLE} WHERE success")))
            .fetch_all(pool)
            .await?;
    Ok(MIGRATIONS.iter().filter(|m| !applied.iter().any(|(v,)| *v == m.version)).count())
}

#[cfg(test)]
mod retention_tests {
    use super::*;

    #[tokio::test]
    async fn a_retention_under_a_day_is_refused_as_invalid_before_any_connection() {
        // Nothing listens on port 1: a call that connected would fail as a PostgreSQL error instead.
        let config = |audit: u64, dead: u64| {
            MigrateConfig::new("postgres://nobody@127.0.0.1:1/none", "app", "runtime")
                .retentions(std::time::Duration::from_secs(audit), std::time::Duration::from_secs(dead))
        };
        let day = 24 * 3600;
        let e = run(&config(3600, day)).await.unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::Invalid, "{e:#}");
        assert!(e.to_string().contains("CONVEYOR_AUDIT_RETENTION"), "{e}");
        let e = run(&config(day, 60)).await.unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::Invalid, "{e:#}");
        assert!(e.to_string().contains("CONVEYOR_DEAD_LETTER_RETENTION"), "{e}");
        let e = run(&config(day, day)).await.unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::Postgres, "with valid retentions it tries to connect: {e:#}");
    }
}
