//! Conveyor in a service's own database: one schema per crate (the platform's `conveyor`, the shop's
//! `conveyor_shop`, the API's `conveyor_server`), each with its own history, and `public` left to the service. A
//! database of the old layout, everything in `public`, built here by that release's own migrations
//! (`legacy_migrations/`, frozen copies), is adopted in place: same schema as a fresh one, every row and job still
//! there, and the jobs still run.

use crate::common;

use std::time::{SystemTime, UNIX_EPOCH};

use sqlx::migrate::Migrator;
use sqlx::{Connection, PgConnection};
use uuid::Uuid;

/// An empty database of the test's own: the owner's, the application role's and the runtime role's URLs on it.
async fn empty_database() -> (String, String, String) {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs();
    let name = format!("conveyor_test_{now}_{}", &Uuid::new_v4().simple().to_string()[..12]);
    let mut admin = PgConnection::connect(&common::owner_base_url()).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}"))).execute(&mut admin).await.unwrap();
    let on = |url: String| format!("{}/{name}", url.rsplit_once('/').unwrap().0);
    (on(common::owner_base_url()), on(common::app_base_url()), on(common::runtime_base_url()))
}

async fn versions(conn: &mut PgConnection, table: &str) -> Vec<i64> {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT version FROM {table} ORDER BY version")))
        .fetch_all(conn)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_services_own_sqlx_migrations_and_conveyors_share_a_database_without_clashing() {
    let (owner, app, runtime) = empty_database().await;
    conveyor_jobs::migrate_with(&common::migrate_config(&owner, &app, &runtime, None)).await.unwrap();

    // The service's own migrations, versions 1 and 2 as Conveyor's are: sqlx's default history table is theirs.
    let dir = std::env::temp_dir().join(format!("service-migrations-{}", Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("1_orders.sql"), "CREATE TABLE orders (id uuid PRIMARY KEY, item text NOT NULL);").unwrap();
    std::fs::write(dir.join("2_order_notes.sql"), "ALTER TABLE orders ADD COLUMN note text;").unwrap();
    let mut conn = PgConnection::connect(&owner).await.unwrap();
    Migrator::new(dir.as_path()).await.unwrap().run(&mut conn).await.unwrap();

    // Both run again, in either order, and each keeps its own history.
    conveyor_jobs::migrate_with(&common::migrate_config(&owner, &app, &runtime, None)).await.unwrap();
    Migrator::new(dir.as_path()).await.unwrap().run(&mut conn).await.unwrap();
    assert_eq!(versions(&mut conn, "_sqlx_migrations").await, [1, 2]);
    let ours: Vec<i64> = conveyor_jobs::migrator().iter().map(|m| m.version).collect();
    assert_eq!(versions(&mut conn, conveyor_jobs::MIGRATION_HISTORY_TABLE).await, ours);
    // Conveyor grants its application role its own tables only.
    let granted: bool = sqlx::query_scalar("SELECT has_table_privilege($1, 'orders', 'SELECT')")
        .bind(app.rsplit_once("://").unwrap().1.split(':').next().unwrap())
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert!(!granted, "the service's table is not Conveyor's to grant");
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test]
async fn jobs_that_ran_before_job_ends_were_recorded_are_ended_by_the_upgrade_and_live_ones_stay_live() {
    let (owner, app, runtime) = empty_database().await;
    // A database of the release before 0006: a job that ran ended `dispatched` for good.
    let mut conn = PgConnection::connect(&owner).await.unwrap();
    conveyor_jobs::migrator().run_to(5, &mut conn).await.unwrap();
    let ws = Uuid::new_v4();
    let (done_op, live_op, done_job, live_job) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
    let mut tx = conn.begin().await.unwrap();
    sqlx::query("SELECT set_config('app.workspace_id', $1, true)")
        .bind(ws.to_string())
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO conveyor.operations (id, workspace_id, kind, status, created_by)
         VALUES ($1, $3, 'k', 'succeeded', $3), ($2, $3, 'k', 'running', $3)",
    )
    .bind(done_op)
    .bind(live_op)
    .bind(ws)
    .execute(&mut *tx)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO conveyor.outbox_events (id, workspace_id, queue, event_type, event_payload, operation_id, status,
                                    stream_id, dispatched_at)
         VALUES ($1, $5, 'q', 'k', '{}', $3, 'dispatched', '1-1', now()),
                ($2, $5, 'q', 'k', '{}', $4, 'dispatched', '1-2', now())",
    )
    .bind(done_job)
    .bind(live_job)
    .bind(done_op)
    .bind(live_op)
    .bind(ws)
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();

    conveyor_jobs::migrate_with(&common::migrate_config(&owner, &app, &runtime, None)).await.unwrap();
    let mut tx = conn.begin().await.unwrap();
    sqlx::query("SELECT set_config('app.workspace_id', $1, true)")
        .bind(ws.to_string())
        .execute(&mut *tx)
        .await
        .unwrap();
    let statuses: Vec<(Uuid, String, bool)> =
        sqlx::query_as("SELECT id, status, finished_at IS NOT NULL FROM conveyor.outbox_events ORDER BY id")
            .fetch_all(&mut *tx)
            .await
            .unwrap();
    assert_eq!(statuses, [(done_job, "completed".into(), true), (live_job, "dispatched".into(), false)]);
}

/// The old layout's migrations, as the last release of it shipped them (history in `public`).
static PUBLIC_LAYOUT: Migrator = sqlx::migrate!("tests/api/legacy_migrations");

/// [`PUBLIC_LAYOUT`] recording into `history`, as the old release did (`conveyor_schema_migrations`; sqlx's default
/// `_sqlx_migrations` in its early builds).
fn public_layout(history: &'static str) -> Migrator {
    let mut migrator = Migrator::with_migrations(PUBLIC_LAYOUT.iter().cloned().collect());
    migrator.dangerous_set_table_name(history);
    migrator
}

/// What of Conveyor's the schema `public` holds: relations, functions, triggers (none once migrated).
async fn public_objects(conn: &mut PgConnection) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT 'relation ' || c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = 'public' AND c.relname NOT LIKE 'service\\_%'
         UNION ALL
         SELECT 'function ' || p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
         WHERE n.nspname = 'public'
         UNION ALL
         SELECT 'trigger ' || t.tgname FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
         JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'public' AND NOT t.tgisinternal
         ORDER BY 1",
    )
    .fetch_all(conn)
    .await
    .unwrap()
}

/// The tables of `schema`.
async fn tables_of(conn: &mut PgConnection, schema: &str) -> Vec<String> {
    sqlx::query_scalar("SELECT tablename::text FROM pg_tables WHERE schemaname = $1 ORDER BY 1")
        .bind(schema)
        .fetch_all(conn)
        .await
        .unwrap()
}

#[tokio::test]
async fn after_migrate_public_holds_nothing_of_conveyors_and_each_crate_has_its_own_schema_and_history() {
    let db = common::TestDb::create().await;
    let mut owner = db.owner().await;
    assert_eq!(public_objects(&mut owner).await, Vec::<String>::new());
    let mut shop: Vec<String> = conveyor_shop::migrate::TABLES.iter().map(|t| t.to_string()).collect();
    shop.push("_sqlx_migrations".into());
    shop.sort();
    assert_eq!(tables_of(&mut owner, "conveyor_shop").await, shop);
    assert_eq!(tables_of(&mut owner, "conveyor_server").await, ["_sqlx_migrations", "idempotency_requests"]);
    let platform = tables_of(&mut owner, "conveyor").await;
    for table in ["_sqlx_migrations", "operations", "outbox_events", "job_kinds", "conveyor_settings"] {
        assert!(platform.contains(&table.to_owned()), "{table} in conveyor: {platform:?}");
    }
    let product = |t: &String| conveyor_shop::migrate::TABLES.contains(&t.as_str()) || t == "idempotency_requests";
    assert!(!platform.iter().any(product), "{platform:?}");
    // No platform function reads a product table, and no platform table points at one.
    let reaching: Vec<String> = sqlx::query_scalar(
        "SELECT p.proname::text FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
         WHERE n.nspname = 'conveyor' AND p.prosrc ~ '\\mconveyor_(shop|server)\\M'
         UNION ALL
         SELECT c.conname::text FROM pg_constraint c JOIN pg_class r ON r.oid = c.conrelid
         JOIN pg_class f ON f.oid = c.confrelid
         WHERE c.contype = 'f' AND r.relnamespace = 'conveyor'::regnamespace
           AND f.relnamespace <> 'conveyor'::regnamespace",
    )
    .fetch_all(&mut owner)
    .await
    .unwrap();
    assert_eq!(reaching, Vec::<String>::new());
    for (history, versions) in [
        (
            conveyor_jobs::MIGRATION_HISTORY_TABLE,
            conveyor_jobs::migrator().iter().map(|m| m.version).collect::<Vec<_>>(),
        ),
        (conveyor_shop::migrate::HISTORY_TABLE, conveyor_shop::migrate::migrator().iter().map(|m| m.version).collect()),
        (
            conveyor_server::migrate::HISTORY_TABLE,
            conveyor_server::migrate::migrator().iter().map(|m| m.version).collect(),
        ),
    ] {
        assert_eq!(self::versions(&mut owner, history).await, versions, "{history}");
    }
    assert_eq!(conveyor_server::migrate::pending_versions(&db.pool).await.unwrap(), 0);
}

#[tokio::test]
async fn a_services_own_tables_named_like_conveyors_in_public_are_left_untouched() {
    // The service's own tables, named as Conveyor's were in the old layout (and as River's and others' are).
    const SERVICE: &[&str] =
        &["operations", "stores", "media", "listings", "jobs", "job_kinds", "idempotency_requests"];
    let db = common::TestDb::create_after(async |owner: &str| {
        let mut conn = PgConnection::connect(owner).await.unwrap();
        for table in SERVICE {
            for sql in [
                format!("CREATE TABLE public.{table} (id bigint PRIMARY KEY, note text NOT NULL)"),
                format!("INSERT INTO public.{table} VALUES (1, 'the service''s own {table}')"),
            ] {
                sqlx::query(sqlx::AssertSqlSafe(sql)).execute(&mut conn).await.unwrap();
            }
        }
    })
    .await;
    let mut owner = db.owner().await;
    let app_role = db.app_url.rsplit_once("://").unwrap().1.split(':').next().unwrap().to_owned();
    for table in SERVICE {
        let rows: Vec<(i64, String)> =
            sqlx::query_as(sqlx::AssertSqlSafe(format!("SELECT id, note FROM public.{table}")))
                .fetch_all(&mut owner)
                .await
                .unwrap();
        assert_eq!(rows, [(1, format!("the service's own {table}"))], "{table}");
        let (columns, rls, granted): (i64, bool, bool) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM pg_attribute a WHERE a.attrelid = c.oid AND a.attnum > 0),
                    c.relrowsecurity, has_table_privilege($2, c.oid, 'SELECT')
             FROM pg_class c WHERE c.oid = ('public.' || $1)::regclass",
        )
        .bind(table)
        .bind(&app_role)
        .fetch_one(&mut owner)
        .await
        .unwrap();
        assert_eq!((columns, rls, granted), (2, false, false), "{table}: unchanged, and not granted");
    }
    // Conveyor's own are in their schemas, beside them.
    assert!(tables_of(&mut owner, "conveyor").await.contains(&"operations".to_owned()));
    assert!(tables_of(&mut owner, "conveyor_shop").await.contains(&"stores".to_owned()));
    assert!(tables_of(&mut owner, "conveyor_server").await.contains(&"idempotency_requests".to_owned()));
}

/// The rows the old layout's tables hold for `workspace`, table by table (read as the owner, under the policies).
async fn row_counts(conn: &mut PgConnection, workspace: Uuid, tables: &[String]) -> Vec<(String, i64)> {
    let mut tx = conn.begin().await.unwrap();
    sqlx::query("SELECT set_config('app.workspace_id', $1, true)")
        .bind(workspace.to_string())
        .execute(&mut *tx)
        .await
        .unwrap();
    let mut counts = Vec::new();
    for table in tables {
        let (n,): (i64,) = sqlx::query_as(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        let name = table.rsplit_once('.').map_or(table.as_str(), |(_, name)| name).to_owned();
        counts.push((name, n));
    }
    counts
}

const FILLED: &[&str] =
    &["operations", "outbox_events", "job_kinds", "stores", "store_credentials", "idempotency_requests"];

#[tokio::test]
async fn a_database_the_old_layout_migrated_and_filled_is_adopted_in_place_and_its_jobs_still_run() {
    use conveyor_server::auth::Principal;
    use conveyor_shop::adapters::sandbox::Settings;
    use tokio_util::sync::CancellationToken;

    let who: Principal = common::principal();
    let (ws, user) = (who.workspace_id.0, who.user_id.0);
    let (store, operation) = (Uuid::now_v7(), Uuid::now_v7());
    let mut jobs = (Uuid::nil(), Uuid::nil());
    let mut before = Vec::new();
    let db = common::TestDb::create_after(async |owner: &str| {
        let mut conn = PgConnection::connect(owner).await.unwrap();
        public_layout("conveyor_schema_migrations").run(&mut conn).await.unwrap();
        // What the old release's API and worker wrote: a kind registered, a store with sealed credentials, its
        // verification (operation and job), a job delayed by a day, an idempotency record.
        let key = base64::Engine::decode(&base64::engine::general_purpose::STANDARD, common::ENCRYPTION_KEY_B64)
            .unwrap();
        let sealer = conveyor_shop::sealing::Sealer::new(&conveyor_jobs::Secret::new(key), "k1");
        let sealed = sealer.seal(
            br#"{"api_key":"key-upgrade","api_secret":"secret-upgrade"}"#,
            &conveyor_shop::domain::stores::credentials_aad(ws, store),
        );
        let mut tx = conn.begin().await.unwrap();
        sqlx::query("SELECT set_config('app.workspace_id', $1, true)")
            .bind(ws.to_string())
            .execute(&mut *tx)
            .await
            .unwrap();
        sqlx::query(
            "INSERT INTO public.job_kinds (kind, queue, max_attempts, timeout_ms)
             VALUES ('store.verify_credentials', 'stores', 5, 30000)",
        )
        .execute(&mut *tx)
        .await
        .unwrap();
        sqlx::query("INSERT INTO public.stores (id, workspace_id, name, platform, created_by) VALUES ($1, $2, 'Main shop', 'sandbox', $3)")
            .bind(store)
            .bind(ws)
            .bind(user)
            .execute(&mut *tx)
            .await
            .unwrap();
        sqlx::query(
            "INSERT INTO public.store_credentials (store_id, workspace_id, key_id, nonce, ciphertext)
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(store)
        .bind(ws)
        .bind(&sealed.key_id)
        .bind(&sealed.nonce)
        .bind(&sealed.ciphertext)
        .execute(&mut *tx)
        .await
        .unwrap();
        sqlx::query(
            "INSERT INTO public.operations (id, workspace_id, kind, status, subject_id, created_by)
             VALUES ($1, $2, 'store.verify_credentials', 'queued', $3, $4)",
        )
        .bind(operation)
        .bind(ws)
        .bind(store)
        .bind(user)
        .execute(&mut *tx)
        .await
        .unwrap();
        let payload = serde_json::json!({ "store_id": store, "credentials_version": 1 });
        let (now,): (Uuid,) =
            sqlx::query_as("SELECT conveyor_enqueue('store.verify_credentials', $1, NULL, NULL, 'normal', NULL, $2)")
                .bind(&payload)
                .bind(operation)
                .fetch_one(&mut *tx)
                .await
                .unwrap();
        let (later,): (Uuid,) =
            sqlx::query_as("SELECT conveyor_enqueue('store.verify_credentials', $1, now() + interval '1 day')")
                .bind(&payload)
                .fetch_one(&mut *tx)
                .await
                .unwrap();
        jobs = (now, later);
        sqlx::query(
            "INSERT INTO public.idempotency_requests (workspace_id, user_id, http_method, request_path, idempotency_key,
                                                      request_fingerprint, fingerprint_key_id, status, response_status)
             VALUES ($1, $2, 'POST', '/v1/stores', $3, '\\x00', 'dev1', 'completed', 202)",
        )
        .bind(ws)
        .bind(user)
        .bind(Uuid::new_v4())
        .execute(&mut *tx)
        .await
        .unwrap();
        tx.commit().await.unwrap();
        let tables: Vec<String> = FILLED.iter().map(|t| format!("public.{t}")).collect();
        before = row_counts(&mut conn, ws, &tables).await;
    })
    .await;
    let (now, later) = jobs;

    // Moved, every row still there; nothing of Conveyor's left in public; the old history kept as a record.
    let mut owner = db.owner().await;
    assert_eq!(public_objects(&mut owner).await, Vec::<String>::new());
    let moved: Vec<String> = FILLED
        .iter()
        .map(|t| match *t {
            "stores" | "store_credentials" => format!("conveyor_shop.{t}"),
            "idempotency_requests" => format!("conveyor_server.{t}"),
            _ => format!("conveyor.{t}"),
        })
        .collect();
    assert_eq!(row_counts(&mut owner, ws, &moved).await, before);
    assert!(before.iter().all(|(_, n)| *n > 0), "{before:?}");
    assert_eq!(versions(&mut owner, "conveyor.public_layout_history").await, (1..=37).collect::<Vec<i64>>());
    assert_eq!(conveyor_server::migrate::pending_versions(&db.pool).await.unwrap(), 0);
    let delayed = conveyor_jobs::get_job(&db.pool, who.workspace_id, conveyor_jobs::JobId(later))
        .await
        .unwrap()
        .expect("the delayed job");
    assert_eq!(delayed.status, conveyor_jobs::JobStatus::Scheduled, "{delayed:?}");

    // The new release runs the old release's queued verification: the store turns active.
    let db = std::sync::Arc::new(db);
    let app = common::TestApp::spawn_on_db(db.clone(), |_| {}).await;
    let redis = common::redis_url();
    let (sandbox, market) = common::sandbox(Settings::default()).await;
    let shutdown = CancellationToken::new();
    common::run_dispatcher(common::test_dispatcher(&app, &redis, |_| {}).await, &shutdown);
    let settings = conveyor_jobs::WorkerSettings { concurrency: 4, ..conveyor_jobs::WorkerSettings::default() };
    let worker = common::test_worker(&app, &redis, &market, settings, 5, conveyor_jobs::Metrics::new()).await;
    tokio::spawn(worker.run(shutdown.clone(), std::time::Duration::from_secs(5)));
    let done =
        common::operation_reaches(&app, who, &operation.to_string(), "succeeded", std::time::Duration::from_secs(30))
            .await;
    assert!(done.is_some(), "{:?}", common::operation(&app, who, &operation.to_string()).await);
    let shown: serde_json::Value =
        app.send(reqwest::Method::GET, &format!("/v1/stores/{store}"), who, None).await.json().await.unwrap();
    assert_eq!(shown["status"], "active", "{shown}");
    assert_eq!(sandbox.stats().effects, 1);
    let ran = conveyor_jobs::get_job(&db.pool, who.workspace_id, conveyor_jobs::JobId(now)).await.unwrap().unwrap();
    assert_eq!(ran.status, conveyor_jobs::JobStatus::Succeeded, "{ran:?}");
    shutdown.cancel();
}

/// Everything PostgreSQL knows of the three schemas but the rows and the histories' timings: columns, constraints,
/// indexes, policies, triggers, functions (source, settings, security), sequences and grants.
async fn catalog(conn: &mut PgConnection) -> Vec<String> {
    sqlx::query_scalar(
        "WITH ours AS (SELECT oid FROM pg_namespace WHERE nspname IN ('conveyor', 'conveyor_shop', 'conveyor_server')),
              rel AS (SELECT c.* FROM pg_class c WHERE c.relnamespace IN (SELECT oid FROM ours)
                      AND c.relname NOT LIKE 'public\\_layout\\_history%')
         SELECT format('relation %s %s acl=%s rls=%s/%s', c.oid::regclass, c.relkind, c.relacl, c.relrowsecurity,
                       c.relforcerowsecurity) FROM rel c
         UNION ALL
         SELECT format('column %s.%s %s notnull=%s default=%s', a.attrelid::regclass, a.attname,
                       format_type(a.atttypid, a.atttypmod), a.attnotnull, pg_get_expr(d.adbin, d.adrelid))
         FROM pg_attribute a JOIN rel c ON c.oid = a.attrelid
         LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
         WHERE a.attnum > 0 AND NOT a.attisdropped
         UNION ALL
         SELECT format('constraint %s %s %s', k.conrelid::regclass, k.conname, pg_get_constraintdef(k.oid))
         FROM pg_constraint k JOIN rel c ON c.oid = k.conrelid
         UNION ALL
         SELECT format('index %s', pg_get_indexdef(i.indexrelid)) FROM pg_index i JOIN rel c ON c.oid = i.indrelid
         UNION ALL
         SELECT format('policy %s.%s %s %s %s %s', schemaname, tablename, policyname, roles, qual, with_check)
         FROM pg_policies WHERE schemaname IN ('conveyor', 'conveyor_shop', 'conveyor_server')
         UNION ALL
         SELECT format('trigger %s', pg_get_triggerdef(t.oid)) FROM pg_trigger t JOIN rel c ON c.oid = t.tgrelid
         WHERE NOT t.tgisinternal
         UNION ALL
         SELECT format('function %s definer=%s config=%s acl=%s src=%s', p.oid::regprocedure, p.prosecdef,
                       p.proconfig, p.proacl, p.prosrc)
         FROM pg_proc p WHERE p.pronamespace IN (SELECT oid FROM ours)
         UNION ALL
         SELECT format('history %s %s %s', v.version, v.description, encode(v.checksum, 'hex'))
         FROM (SELECT version, description, checksum FROM conveyor._sqlx_migrations
               UNION ALL SELECT version, description, checksum FROM conveyor_shop._sqlx_migrations
               UNION ALL SELECT version + 1000000, description, checksum FROM conveyor_server._sqlx_migrations) v
         ORDER BY 1",
    )
    .fetch_all(conn)
    .await
    .unwrap()
}

#[tokio::test]
async fn an_adopted_database_has_the_schema_a_fresh_one_has() {
    for history in ["conveyor_schema_migrations", "_sqlx_migrations"] {
        let fresh = common::TestDb::create().await;
        let adopted = common::TestDb::create_after(async |owner: &str| {
            let mut conn = PgConnection::connect(owner).await.unwrap();
            public_layout(history).run(&mut conn).await.unwrap();
        })
        .await;
        let (fresh, adopted) = (catalog(&mut fresh.owner().await).await, catalog(&mut adopted.owner().await).await);
        let only_fresh: Vec<&String> = fresh.iter().filter(|l| !adopted.contains(l)).collect();
        let only_adopted: Vec<&String> = adopted.iter().filter(|l| !fresh.contains(l)).collect();
        assert!(
            only_fresh.is_empty() && only_adopted.is_empty(),
            "history in {history}: only in the fresh database:\n{only_fresh:#?}\nonly in the adopted one:\n{only_adopted:#?}"
        );
        assert!(fresh.len() > 500, "{} lines: the catalog was read", fresh.len());
    }
}

#[tokio::test]
async fn a_database_the_old_layout_left_part_way_is_refused_and_left_as_it_was() {
    // 20: before the old layout had all its tables (0035 added the last); 36: one short of its last version.
    for (version, history) in
        [(20, "conveyor_schema_migrations"), (36, "conveyor_schema_migrations"), (20, "_sqlx_migrations")]
    {
        let (owner, app, runtime) = empty_database().await;
        let mut conn = PgConnection::connect(&owner).await.unwrap();
        public_layout(history).run_to(version, &mut conn).await.unwrap();
        let before = public_objects(&mut conn).await;
        let err = conveyor_jobs::migrate_with(&common::migrate_config(&owner, &app, &runtime, None)).await.unwrap_err();
        let message = format!("{err:#}");
        assert!(message.contains(&format!("{version} of the 37")) && message.contains("34f94ac"), "{message}");
        assert_eq!(public_objects(&mut conn).await, before, "{version}: nothing moved");
        let (schema,): (bool,) =
            sqlx::query_as("SELECT to_regnamespace('conveyor') IS NOT NULL").fetch_one(&mut conn).await.unwrap();
        assert!(!schema, "{version}: nothing created either");
    }
}
