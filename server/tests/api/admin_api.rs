//! The operator's admin API (`/admin/v1/...` on the admin listener) over real PostgreSQL, Redis, dispatcher and worker:
//! authentication, reads across workspaces only for operators, counts by state, job detail with redacted failures,
//! dead letters replayed and discarded one by one and in bulk, pauses, schedules, the audit trail; and the wall
//! beneath it: the application role executes no `conveyor_admin_*` function and reads no audit row.

use crate::common;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::{ADMIN_TOKEN, TestApp, principal};
use conveyor_jobs::{
    Consumer, EnqueueOptions, Handler, JobContext, JobError, JobId, JobKind, JobStatus, WorkerSettings, WorkspaceId,
};
use reqwest::{Method, StatusCode};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sqlx::{Connection, PgConnection};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// A job kind whose payload says how its handler behaves.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Chore {
    /// `ok`; `fail` (permanent, with a secret-bearing message); `flaky` (retryable, every time); `later` (retry in an
    /// hour); `heal` (fails permanently until the test heals it); `write` (like `heal`, and once healed writes an
    /// operation of kind `admin.marker` in the job's own transaction).
    mode: String,
}

impl JobKind for Chore {
    const KIND: &'static str = "admin.chore";
    const QUEUE: &'static str = "chores";
    const MAX_ATTEMPTS: u32 = 3;
    const BACKOFF: conveyor_jobs::Backoff =
        conveyor_jobs::Backoff { base: Duration::from_millis(20), max: Duration::from_millis(50) };
}

/// What a failing chore says: credentials that must never be shown or stored as such.
const SECRET_ERROR: &str = "could not reach postgres://admin:s3cret-pw@db.internal/x with password=hunter2";

struct Chores {
    healed: Arc<AtomicBool>,
}

impl Handler<Chore> for Chores {
    async fn handle(&self, job: Chore, cx: &mut JobContext) -> Result<Value, JobError> {
        match job.mode.as_str() {
            "fail" => Err(JobError::permanent(SECRET_ERROR)),
            "flaky" => Err(JobError::retryable(SECRET_ERROR)),
            "later" => Err(JobError::retry_after("not yet", Duration::from_secs(3600))),
            "heal" | "write" if !self.healed.load(Ordering::SeqCst) => Err(JobError::permanent("not healed yet")),
            "write" => {
                let workspace = cx.workspace_id();
                let tx = cx.tx().await?;
                conveyor_jobs::create_operation_tx(
                    tx,
                    workspace,
                    conveyor_jobs::UserId(Uuid::nil()),
                    "admin.marker",
                    None,
                )
                .await?;
                Ok(json!({ "wrote": true }))
            }
            _ => {
                cx.log(format!("done {} with password=hunter2", job.mode)).await;
                Ok(json!({ "done": job.mode }))
            }
        }
    }
}

/// A dispatcher and a worker of [`Chore`] running until [`Platform::stop`].
struct Platform {
    shutdown: CancellationToken,
    dispatcher: JoinHandle<Result<(), conveyor_jobs::Error>>,
    worker: JoinHandle<Result<(), conveyor_jobs::Error>>,
}

impl Platform {
    async fn start(app: &TestApp, healed: &Arc<AtomicBool>) -> Self {
        let shutdown = CancellationToken::new();
        let redis = common::redis_url();
        let dispatcher = common::test_dispatcher(app, &redis, |v| {
            v.insert("CONVEYOR_DISPATCH_POLL".into(), "200ms".into());
        })
        .await;
        let dispatcher = tokio::spawn(dispatcher.run(shutdown.clone()));
        let consumer = Consumer::connect(&redis, &app.redis_prefix).await.unwrap();
        let worker = conveyor_jobs::Worker::builder(app.db.pool.clone(), consumer)
            .runtime_pool(app.db.runtime_pool.clone())
            .handle::<Chore>(Chores { healed: healed.clone() })
            .settings(WorkerSettings { concurrency: 4, ..WorkerSettings::default() })
            .build()
            .unwrap();
        let worker = tokio::spawn(worker.run(shutdown.clone(), Duration::from_secs(5)));
        Self { shutdown, dispatcher, worker }
    }

    async fn stop(self) {
        self.shutdown.cancel();
        self.worker.await.unwrap().unwrap();
        self.dispatcher.await.unwrap().unwrap();
    }
}

async fn enqueue(app: &TestApp, ws: WorkspaceId, mode: &str, options: EnqueueOptions) -> JobId {
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
    let job = conveyor_jobs::enqueue_tx(&mut tx, &Chore { mode: mode.into() }, options).await.unwrap();
    tx.commit().await.unwrap();
    job.id
}

async fn ended(app: &TestApp, ws: WorkspaceId, job: JobId) -> conveyor_jobs::JobInfo {
    conveyor_jobs::wait_for_job(&app.db.pool, ws, job, Duration::from_secs(30)).await.unwrap()
}

/// Waits until the job is in `status`.
async fn reaches(app: &TestApp, ws: WorkspaceId, job: JobId, status: JobStatus) {
    let reached = common::eventually(Duration::from_secs(30), || async {
        let info = conveyor_jobs::get_job(&app.db.pool, ws, job).await.unwrap()?;
        (info.status == status).then_some(())
    })
    .await;
    assert!(reached.is_some(), "job {job} never reached {status:?}");
}

/// An HS256 JWT signed with the operator's test secret carrying `claims` (and a `sub` and `exp`).
fn jwt(sub: &str, extra: Value) -> String {
    jwt_signed_with(common::OPERATOR_JWT_SECRET, sub, extra)
}

/// [`jwt`] signed with `secret`.
fn jwt_signed_with(secret: &str, sub: &str, extra: Value) -> String {
    let exp = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs() + 600;
    let mut claims = json!({ "sub": sub, "exp": exp, "aud": "conveyor-operator" });
    claims.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    let key = jsonwebtoken::EncodingKey::from_secret(secret.as_bytes()).unwrap();
    jsonwebtoken::encode(&jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256), &claims, &key).unwrap()
}

/// An operator's JWT (`"operator": true`): its actor is `jwt:<sub>`.
fn operator_jwt(sub: &str) -> String {
    jwt(sub, json!({ "operator": true }))
}

/// Calls the admin API at `path` (under `/admin/v1`) with `credential` as bearer (none when `None`).
async fn call(app: &TestApp, method: Method, path: &str, credential: Option<&str>, body: Option<Value>) -> Response {
    let url = format!("http://{}/admin/v1{path}", app.admin_addr);
    let mut request = app.http.request(method, url);
    if let Some(credential) = credential {
        request = request.bearer_auth(credential);
    }
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request.send().await.expect("the admin listener answers");
    let status = response.status();
    let headers = response.headers().clone();
    let text = response.text().await.unwrap();
    let json = serde_json::from_str(&text).unwrap_or(Value::Null);
    Response { status, headers, json }
}

#[derive(Debug)]
struct Response {
    status: StatusCode,
    headers: reqwest::header::HeaderMap,
    json: Value,
}

impl Response {
    /// The body, after checking the status.
    fn expect(self, status: StatusCode) -> Value {
        assert_eq!(self.status, status, "{}", self.json);
        self.json
    }

    /// The problem's code, after checking the status and the media type.
    fn problem(self, status: StatusCode) -> Value {
        assert_eq!(self.status, status, "{}", self.json);
        assert_eq!(self.headers["content-type"], "application/problem+json");
        self.json
    }
}

async fn op(app: &TestApp, method: Method, path: &str, body: Option<Value>) -> Response {
    call(app, method, path, Some(ADMIN_TOKEN), body).await
}

/// Every endpoint, as (method, path, body): ids and names that need not exist.
fn every_endpoint() -> Vec<(Method, String, Option<Value>)> {
    let id = Uuid::now_v7();
    let ws = Uuid::new_v4();
    vec![
        (Method::GET, "/queues".into(), None),
        (Method::GET, "/queues/chores".into(), None),
        (Method::GET, "/queues/chores/minutes".into(), None),
        (Method::GET, "/jobs".into(), None),
        (Method::GET, format!("/jobs/{id}"), None),
        (Method::POST, format!("/jobs/{id}/cancel"), None),
        (Method::POST, format!("/jobs/{id}/retry"), None),
        (Method::POST, format!("/jobs/{id}/change"), Some(json!({ "run_now": true }))),
        (Method::POST, "/queues/nothing-here/drain".into(), Some(json!({ "workspace": ws }))),
        (
            Method::POST,
            "/queues/nothing-here/clean".into(),
            Some(json!({ "status": "succeeded", "workspace": ws, "keep_last": 1 })),
        ),
        (Method::POST, "/queues/nothing-here/obliterate".into(), Some(json!({ "workspace": ws }))),
        (Method::GET, "/consumers".into(), None),
        (Method::GET, "/operations".into(), None),
        (Method::GET, "/dead-letters".into(), None),
        (Method::POST, format!("/dead-letters/{id}/replay"), None),
        (Method::DELETE, format!("/dead-letters/{id}"), None),
        (Method::POST, "/dead-letters/replay".into(), Some(json!({ "queue": "nothing-here" }))),
        (Method::POST, "/dead-letters/discard".into(), Some(json!({ "queue": "nothing-here" }))),
        (Method::GET, "/pauses".into(), None),
        (Method::POST, "/pauses".into(), Some(json!({ "queue": "chores", "reason": "test" }))),
        (Method::DELETE, "/pauses?queue=chores".into(), None),
        (Method::GET, "/global-limits".into(), None),
        (Method::PUT, "/global-limits/queue/chores".into(), Some(json!({ "max_in_flight": 2 }))),
        (Method::DELETE, "/global-limits/queue/chores".into(), None),
        (Method::GET, "/fairness".into(), None),
        (Method::PUT, format!("/workspaces/{ws}/weight"), Some(json!({ "weight": 2 }))),
        (Method::PUT, format!("/workspaces/{ws}/key-limits/store:1"), Some(json!({ "max_in_flight": 2 }))),
        (Method::DELETE, format!("/workspaces/{ws}/key-limits/store:1"), None),
        (Method::PUT, format!("/workspaces/{ws}/kind-limits/admin.chore"), Some(json!({ "max_in_flight": 2 }))),
        (Method::DELETE, format!("/workspaces/{ws}/kind-limits/admin.chore"), None),
        (Method::GET, "/schedules".into(), None),
        (Method::POST, format!("/schedules/{ws}/nightly/pause"), None),
        (Method::POST, format!("/schedules/{ws}/nightly/resume"), None),
        (Method::GET, format!("/workspaces/{ws}/events"), None),
        (Method::GET, "/audit".into(), None),
    ]
}

#[tokio::test]
async fn every_endpoint_refuses_no_credential_a_wrong_one_and_a_workspace_users_token() {
    let app = TestApp::spawn().await;
    let user = app.token(principal());
    let not_operator = jwt("bob", json!({ "operator": false }));
    let wrong_secret = {
        let exp = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs() + 600;
        let key = jsonwebtoken::EncodingKey::from_secret(b"another-secret-of-at-least-32-bytes!!").unwrap();
        let claims = json!({ "sub": "mallory", "exp": exp, "aud": "conveyor-operator", "operator": true });
        jsonwebtoken::encode(&jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256), &claims, &key).unwrap()
    };
    let credentials: [Option<&str>; 6] = [
        None,
        Some("not-the-admin-token"),
        Some(&ADMIN_TOKEN[..ADMIN_TOKEN.len() - 1]),
        Some(&user),
        Some(&not_operator),
        Some(&wrong_secret),
    ];
    for (method, path, body) in every_endpoint() {
        for credential in credentials {
            let answer = call(&app, method.clone(), &path, credential, body.clone()).await;
            assert_eq!(answer.headers["www-authenticate"], "Bearer realm=\"conveyor-admin\"", "{method} {path}");
            let problem = answer.problem(StatusCode::UNAUTHORIZED);
            assert_eq!(problem["code"], "UNAUTHENTICATED", "{method} {path}");
        }
    }
    // Nothing was read nor changed: the audit trail is empty, the pause was not set.
    let mut owner = app.db.owner().await;
    let (audited,): (i64,) =
        sqlx::query_as("SELECT count(*) FROM conveyor.conveyor_admin_audit").fetch_one(&mut owner).await.unwrap();
    assert_eq!(audited, 0);
    assert!(conveyor_jobs::list_pauses(&app.db.runtime_pool).await.unwrap().is_empty());

    // The operator token and an operator's JWT pass, and the audit trail names each.
    op(&app, Method::GET, "/queues", None).await.expect(StatusCode::OK);
    call(&app, Method::GET, "/queues", Some(&operator_jwt("alice")), None).await.expect(StatusCode::OK);
    let trail = op(&app, Method::GET, "/audit?limit=3", None).await.expect(StatusCode::OK);
    let actors: Vec<&str> = trail["items"].as_array().unwrap().iter().map(|e| e["actor"].as_str().unwrap()).collect();
    assert_eq!(actors, ["token", "jwt:alice", "token"]);
    assert!(trail["items"].as_array().unwrap().iter().all(|e| e["role"] == "conveyor_operator"), "{trail}");
}

#[tokio::test]
async fn without_an_operator_database_the_api_answers_503_to_operators_and_401_to_others() {
    let app = TestApp::spawn_with(|vars| {
        vars.remove("CONVEYOR_OPERATOR_DATABASE_URL");
    })
    .await;
    let problem = op(&app, Method::GET, "/queues", None).await.problem(StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(problem["code"], "ADMIN_NOT_CONFIGURED");
    assert!(problem["detail"].as_str().unwrap().contains("CONVEYOR_OPERATOR_DATABASE_URL"), "{problem}");
    let problem = call(&app, Method::GET, "/queues", None, None).await.problem(StatusCode::UNAUTHORIZED);
    assert_eq!(problem["code"], "UNAUTHENTICATED");
    // Unknown routes under /admin/v1 are problems too.
    let problem = op(&app, Method::GET, "/nothing", None).await.problem(StatusCode::NOT_FOUND);
    assert_eq!(problem["code"], "NOT_FOUND");
}

#[tokio::test]
async fn queue_counts_match_jobs_put_in_each_state() {
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    let healed = Arc::new(AtomicBool::new(false));

    // With a dispatcher and a worker: one job succeeds, one is dead-lettered, one waits out an hour's back-off.
    let platform = Platform::start(&app, &healed).await;
    let ok = enqueue(&app, ws, "ok", EnqueueOptions::new()).await;
    let dead = enqueue(&app, ws, "fail", EnqueueOptions::new()).await;
    let later = enqueue(&app, ws, "later", EnqueueOptions::new()).await;
    assert_eq!(ended(&app, ws, ok).await.status, JobStatus::Succeeded);
    assert_eq!(ended(&app, ws, dead).await.status, JobStatus::Failed);
    reaches(&app, ws, later, JobStatus::Retrying).await;
    platform.stop().await;

    // A dispatcher alone: the next job is handed to the (stopped) workers' stream and stays there.
    let shutdown = CancellationToken::new();
    let dispatcher = common::test_dispatcher(&app, &common::redis_url(), |v| {
        v.insert("CONVEYOR_DISPATCH_POLL".into(), "200ms".into());
    })
    .await;
    let relay = tokio::spawn(dispatcher.run(shutdown.clone()));
    let running = enqueue(&app, ws, "ok", EnqueueOptions::new()).await;
    reaches(&app, ws, running, JobStatus::Active).await;
    shutdown.cancel();
    relay.await.unwrap().unwrap();
    // Nothing relays now: one job due, one delayed.
    let queued = enqueue(&app, ws, "ok", EnqueueOptions::new()).await;
    let delayed = enqueue(&app, ws, "ok", EnqueueOptions::new().delay(Duration::from_secs(3600))).await;
    for (job, status) in [(queued, JobStatus::Queued), (delayed, JobStatus::Scheduled)] {
        assert_eq!(conveyor_jobs::get_job(&app.db.pool, ws, job).await.unwrap().unwrap().status, status);
    }

    let queues = op(&app, Method::GET, "/queues", None).await.expect(StatusCode::OK);
    let chores = queues["items"].as_array().unwrap().iter().find(|q| q["name"] == "chores").expect("the chores queue");
    assert_eq!(
        chores["counts"],
        json!({ "queued": 1, "delayed": 1, "running": 1, "retrying": 1, "dead": 1, "waiting_children": 0 }),
        "{chores}"
    );
    // One completion and one dead letter in the last 5 minutes.
    assert_eq!(chores["completed_per_minute"], json!(0.2));
    assert_eq!(chores["failed_per_minute"], json!(0.2));
    assert!(chores["oldest_queued_seconds"].as_f64().is_some_and(|s| s >= 0.0), "{chores}");
    // Redis: the running job's entry was never delivered (the worker had stopped): lag 1, nothing pending.
    assert_eq!((chores["lag"].clone(), chores["pending"].clone()), (json!(1), json!(0)), "{chores}");
    assert!(chores["consumers"].as_u64().is_some(), "{chores}");
    assert_eq!(chores["paused"], false);

    // One queue by name; an unknown one is 404, an impossible name 400.
    let one = op(&app, Method::GET, "/queues/chores", None).await.expect(StatusCode::OK);
    assert_eq!(one["counts"], chores["counts"]);
    op(&app, Method::GET, "/queues/nobody-uses-this", None).await.problem(StatusCode::NOT_FOUND);
    let problem = op(&app, Method::GET, "/queues/Bad%7DName", None).await.problem(StatusCode::BAD_REQUEST);
    assert!(problem["detail"].as_str().unwrap().starts_with("queue:"), "{problem}");

    // A pause of the queue shows.
    op(&app, Method::POST, "/pauses", Some(json!({ "queue": "chores" }))).await.expect(StatusCode::CREATED);
    assert_eq!(op(&app, Method::GET, "/queues/chores", None).await.expect(StatusCode::OK)["paused"], true);

    // The job search by state finds each job where the counts put it.
    for (status, job) in [
        ("succeeded", ok),
        ("failed", dead),
        ("retrying", later),
        ("active", running),
        ("queued", queued),
        ("scheduled", delayed),
    ] {
        let page = op(&app, Method::GET, &format!("/jobs?queue=chores&status={status}"), None).await;
        let page = page.expect(StatusCode::OK);
        let ids: Vec<&str> = page["items"].as_array().unwrap().iter().map(|j| j["id"].as_str().unwrap()).collect();
        assert_eq!(ids, [job.0.to_string()], "{status}: {page}");
        assert_eq!(page["items"][0]["status"], status);
    }
}

#[tokio::test]
async fn reads_across_workspaces_need_operator_authentication() {
    let app = TestApp::spawn().await;
    let (a, b) = (principal(), principal());
    let mut ops = HashMap::new();
    for who in [a, b] {
        let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, who.workspace_id).await.unwrap();
        let operation = conveyor_jobs::create_operation_tx(&mut tx, who.workspace_id, who.user_id, "admin.chore", None)
            .await
            .unwrap();
        conveyor_jobs::enqueue_tx(&mut tx, &Chore { mode: "ok".into() }, EnqueueOptions::new().operation(operation.id))
            .await
            .unwrap();
        tx.commit().await.unwrap();
        ops.insert(who.workspace_id.0, operation.id);
    }

    // The operator sees both workspaces' jobs and operations, and can narrow to one.
    let jobs = op(&app, Method::GET, "/jobs", None).await.expect(StatusCode::OK);
    let mut workspaces: Vec<&str> =
        jobs["items"].as_array().unwrap().iter().map(|j| j["workspace_id"].as_str().unwrap()).collect();
    workspaces.sort_unstable();
    let mut expected = vec![a.workspace_id.0.to_string(), b.workspace_id.0.to_string()];
    expected.sort_unstable();
    assert_eq!(workspaces, expected);
    let only_a = op(&app, Method::GET, &format!("/jobs?workspace={}", a.workspace_id), None).await;
    let only_a = only_a.expect(StatusCode::OK);
    assert_eq!(only_a["items"].as_array().unwrap().len(), 1);
    assert_eq!(only_a["items"][0]["workspace_id"], a.workspace_id.0.to_string());
    let operations = op(&app, Method::GET, "/operations", None).await.expect(StatusCode::OK);
    assert_eq!(operations["items"].as_array().unwrap().len(), 2, "{operations}");
    let queued = op(&app, Method::GET, "/operations?status=queued&kind=admin.chore", None).await;
    assert_eq!(queued.expect(StatusCode::OK)["items"].as_array().unwrap().len(), 2);
    let none = op(&app, Method::GET, "/operations?status=succeeded", None).await.expect(StatusCode::OK);
    assert_eq!(none, json!({ "items": [], "next": null }));
    // Pages: newest first, and the cursor leads to the rest.
    let first = op(&app, Method::GET, "/jobs?limit=1", None).await.expect(StatusCode::OK);
    let next = first["next"].as_str().expect("a full page has a cursor");
    assert_eq!(next, first["items"][0]["id"]);
    let second = op(&app, Method::GET, &format!("/jobs?limit=1&before={next}"), None).await.expect(StatusCode::OK);
    assert_eq!(second["items"].as_array().unwrap().len(), 1);
    assert!(second["items"][0]["id"].as_str().unwrap() < next);
    let third =
        op(&app, Method::GET, &format!("/jobs?limit=1&before={}", second["items"][0]["id"].as_str().unwrap()), None)
            .await
            .expect(StatusCode::OK);
    assert_eq!(third, json!({ "items": [], "next": null }));

    // A workspace user reaches neither the admin API nor, through the public API, the other workspace's operation.
    let user = app.token(a);
    call(&app, Method::GET, "/jobs", Some(&user), None).await.problem(StatusCode::UNAUTHORIZED);
    let theirs = app.send(Method::GET, &format!("/v1/operations/{}", ops[&b.workspace_id.0]), a, None).await;
    assert_eq!(theirs.status(), StatusCode::NOT_FOUND);
    let mine = app.send(Method::GET, &format!("/v1/operations/{}", ops[&a.workspace_id.0]), a, None).await;
    assert_eq!(mine.status(), StatusCode::OK);
}

#[tokio::test]
async fn the_application_role_executes_no_admin_function_and_reads_no_audit_row() {
    let app = TestApp::spawn().await;
    op(&app, Method::GET, "/queues", None).await.expect(StatusCode::OK);
    let mut owner = app.db.owner().await;
    let functions: Vec<(String, i16)> = sqlx::query_as(
        "SELECT p.proname::text, p.pronargs FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
         WHERE n.nspname = 'conveyor' AND p.proname LIKE 'conveyor\\_admin\\_%' ORDER BY 1",
    )
    .fetch_all(&mut owner)
    .await
    .unwrap();
    assert!(functions.len() >= 10, "{functions:?}");
    let mut app_role = app.db.app_connection().await;
    let mut operator = PgConnection::connect(&app.db.operator_url).await.unwrap();
    for (name, args) in &functions {
        let call = format!("SELECT conveyor.{name}({})", vec!["NULL"; *args as usize].join(", "));
        let refused = sqlx::query(sqlx::AssertSqlSafe(call.clone())).execute(&mut app_role).await.unwrap_err();
        assert_eq!(code(&refused), "42501", "{call}: {refused}");
        // The operator role may call each (NULL arguments are refused by the function, not by a permission).
        if let Err(e) = sqlx::query(sqlx::AssertSqlSafe(call.clone())).execute(&mut operator).await {
            assert_ne!(code(&e), "42501", "{call}: {e}");
        }
    }
    for (role, conn) in [("application", &mut app_role), ("operator", &mut operator)] {
        let refused = sqlx::query("SELECT * FROM conveyor.conveyor_admin_audit").execute(&mut *conn).await.unwrap_err();
        assert_eq!(code(&refused), "42501", "the {role} role reads the audit table: {refused}");
        let refused = sqlx::query("INSERT INTO conveyor.conveyor_admin_audit (actor, action) VALUES ('x', 'y')")
            .execute(&mut *conn)
            .await;
        assert_eq!(code(&refused.unwrap_err()), "42501", "the {role} role writes the audit table");
    }
    // The operator role reads no table directly: only through the audited functions.
    for table in ["outbox_events", "operations", "job_failures", "job_schedules", "dispatch_pauses"] {
        let refused = sqlx::query(sqlx::AssertSqlSafe(format!("SELECT 1 FROM {}", common::qualified(table))))
            .execute(&mut operator)
            .await;
        assert_eq!(code(&refused.unwrap_err()), "42501", "the operator role reads {table}");
    }

    // The old cross-workspace dead-letter listing is gone; under RLS the application role sees one workspace's dead
    // letters, and none without a workspace.
    let gone =
        sqlx::query("SELECT * FROM conveyor.conveyor_dead_letters(10)").execute(&mut app_role).await.unwrap_err();
    assert_eq!(code(&gone), "42883", "{gone}");
    let healed = Arc::new(AtomicBool::new(false));
    let platform = Platform::start(&app, &healed).await;
    let (a, b) = (principal().workspace_id, principal().workspace_id);
    let dead_a = enqueue(&app, a, "fail", EnqueueOptions::new()).await;
    let dead_b = enqueue(&app, b, "fail", EnqueueOptions::new()).await;
    ended(&app, a, dead_a).await;
    ended(&app, b, dead_b).await;
    platform.stop().await;
    let (seen,): (i64,) = sqlx::query_as("SELECT count(*) FROM conveyor.outbox_events WHERE status = 'dead_letter'")
        .fetch_one(&mut app_role)
        .await
        .unwrap();
    assert_eq!(seen, 0, "no workspace set: no row");
    assert_eq!(app.db.count("outbox_events", a).await, 1);
    let dead = op(&app, Method::GET, "/dead-letters", None).await.expect(StatusCode::OK);
    assert_eq!(dead["items"].as_array().unwrap().len(), 2, "the operator sees both: {dead}");
    // A workspace's replay cannot reach another workspace's dead letter.
    let replay = conveyor_jobs::replay_dead_letter(&app.db.pool, a, dead_b.0).await.unwrap();
    assert_eq!(replay, conveyor_jobs::Replay::NotDeadLetter);
}

fn code(e: &sqlx::Error) -> String {
    match e {
        sqlx::Error::Database(d) => d.code().map(|c| c.into_owned()).unwrap_or_default(),
        other => format!("not a database error: {other}"),
    }
}

#[tokio::test]
async fn every_call_leaves_an_audit_row_naming_the_actor_and_the_role() {
    let app = TestApp::spawn().await;
    let mut owner = app.db.owner().await;
    let credential = operator_jwt("alice");
    for (method, path, body) in every_endpoint() {
        let (before,): (i64,) = sqlx::query_as("SELECT coalesce(max(id), 0) FROM conveyor.conveyor_admin_audit")
            .fetch_one(&mut owner)
            .await
            .unwrap();
        let answer = call(&app, method.clone(), &path, Some(&credential), body).await;
        assert!(
            answer.status.is_success() || answer.status == StatusCode::NOT_FOUND,
            "{method} {path}: {}",
            answer.json
        );
        let rows: Vec<(i64, String, String, String, Value)> = sqlx::query_as(
            "SELECT id, actor, role, action, arguments FROM conveyor.conveyor_admin_audit WHERE id > $1 ORDER BY id",
        )
        .bind(before)
        .fetch_all(&mut owner)
        .await
        .unwrap();
        assert!(!rows.is_empty(), "{method} {path} left no audit row");
        for (_, actor, role, action, _) in &rows {
            assert_eq!(
                (actor.as_str(), role.as_str()),
                ("jwt:alice", "conveyor_operator"),
                "{method} {path}: {action}"
            );
        }
        // A change writes its intent first, even when it then fails (every id and name here is unknown: most answer
        // 404), and last what it did, naming its intent.
        if method != Method::GET {
            let (first, last) = (rows.first().unwrap(), rows.last().unwrap());
            assert_eq!(first.4["outcome"], "pending", "{method} {path}: the first row is the intent: {rows:?}");
            assert_eq!(first.3, last.3, "{method} {path}: intent and outcome name one action: {rows:?}");
            assert_eq!(last.4["intent"], json!(first.0), "{method} {path}: {rows:?}");
            assert!(last.4["outcome"].is_string() || last.4["outcome"].is_object(), "{method} {path}: {rows:?}");
            assert_ne!(last.4["outcome"], "pending", "{method} {path}: {rows:?}");
        }
    }
}

#[tokio::test]
async fn a_change_whose_intent_cannot_be_audited_is_not_made() {
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    let delayed = enqueue(&app, ws, "ok", EnqueueOptions::new().delay(Duration::from_secs(3600))).await;
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
    let spec = conveyor_jobs::ScheduleSpec::every(Duration::from_secs(3600)).unwrap();
    let chore = Chore { mode: "ok".into() };
    conveyor_jobs::upsert_schedule_tx(&mut tx, "nightly", &chore, spec, conveyor_jobs::ScheduleOptions::new())
        .await
        .unwrap();
    tx.commit().await.unwrap();
    // The operator role loses the right to append to the audit trail (its reads still audit themselves: their
    // functions run as the owner).
    let mut owner = app.db.owner().await;
    let operator: sqlx::postgres::PgConnectOptions = app.db.operator_url.parse().unwrap();
    let right = |verb: &str| {
        let (to, role) = (if verb == "GRANT" { "TO" } else { "FROM" }, operator.get_username());
        format!("{verb} EXECUTE ON FUNCTION conveyor.conveyor_admin_audit_write(text, text, jsonb) {to} \"{role}\"")
    };
    sqlx::query(sqlx::AssertSqlSafe(right("REVOKE"))).execute(&mut owner).await.unwrap();

    let refused = op(&app, Method::POST, "/pauses", Some(json!({ "queue": "chores" }))).await;
    assert!(refused.problem(StatusCode::SERVICE_UNAVAILABLE)["detail"].as_str().unwrap().contains("audit"));
    assert!(
        conveyor_jobs::list_pauses(&app.db.runtime_pool).await.unwrap().is_empty(),
        "no pause without its audit row"
    );
    op(&app, Method::POST, &format!("/jobs/{delayed}/retry"), None).await.problem(StatusCode::SERVICE_UNAVAILABLE);
    op(&app, Method::POST, &format!("/jobs/{delayed}/cancel"), None).await.problem(StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(conveyor_jobs::get_job(&app.db.pool, ws, delayed).await.unwrap().unwrap().status, JobStatus::Scheduled);
    op(&app, Method::POST, &format!("/schedules/{ws}/nightly/pause"), None)
        .await
        .problem(StatusCode::SERVICE_UNAVAILABLE);
    assert!(!conveyor_jobs::list_schedules(&app.db.pool, ws).await.unwrap()[0].paused);
    let bulk = op(&app, Method::POST, "/dead-letters/discard", Some(json!({ "all": true }))).await;
    bulk.problem(StatusCode::SERVICE_UNAVAILABLE);
    let (changes,): (i64,) =
        sqlx::query_as("SELECT count(*) FROM conveyor.conveyor_admin_audit WHERE arguments ? 'outcome'")
            .fetch_one(&mut owner)
            .await
            .unwrap();
    assert_eq!(changes, 0, "nothing recorded as done, and nothing done");

    // The right back: the same change goes, intent first.
    sqlx::query(sqlx::AssertSqlSafe(right("GRANT"))).execute(&mut owner).await.unwrap();
    op(&app, Method::POST, "/pauses", Some(json!({ "queue": "chores" }))).await.expect(StatusCode::CREATED);
    let trail: Vec<(String, Value)> = sqlx::query_as(
        "SELECT action, arguments FROM conveyor.conveyor_admin_audit WHERE action = 'pause' ORDER BY id",
    )
    .fetch_all(&mut owner)
    .await
    .unwrap();
    assert_eq!(trail.len(), 2, "{trail:?}");
    assert_eq!((trail[0].1["outcome"].clone(), trail[1].1["outcome"].clone()), (json!("pending"), json!("paused")));
}

#[tokio::test]
async fn a_replayed_dead_letter_runs_to_success_and_its_detail_keeps_its_failures_redacted() {
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    let healed = Arc::new(AtomicBool::new(false));
    let platform = Platform::start(&app, &healed).await;
    let flaky = enqueue(&app, ws, "flaky", EnqueueOptions::new()).await;
    let heal = enqueue(&app, ws, "heal", EnqueueOptions::new()).await;
    assert_eq!(ended(&app, ws, flaky).await.status, JobStatus::Failed);
    assert_eq!(ended(&app, ws, heal).await.status, JobStatus::Failed);

    // Three runs failed, each recorded with its attempt and its error, credentials redacted.
    let detail = op(&app, Method::GET, &format!("/jobs/{flaky}"), None).await.expect(StatusCode::OK);
    assert_eq!(detail["status"], "failed");
    assert_eq!(detail["failed_runs"], 3);
    assert_eq!(detail["payload"], json!({ "mode": "flaky" }));
    let attempts = detail["attempts"].as_array().unwrap();
    assert_eq!(attempts.iter().map(|a| a["attempt"].as_u64().unwrap()).collect::<Vec<_>>(), [1, 2, 3], "{detail}");
    for attempt in attempts {
        assert_eq!(attempt["stage"], "job");
        let error = attempt["error"].as_str().unwrap();
        assert!(
            error.contains("postgres://[redacted]@db.internal") && error.contains("password=[redacted]"),
            "{error}"
        );
    }
    let text = detail.to_string();
    assert!(!text.contains("s3cret-pw") && !text.contains("hunter2"), "{text}");
    op(&app, Method::GET, &format!("/jobs/{}", Uuid::now_v7()), None).await.problem(StatusCode::NOT_FOUND);

    // Replayed once healed: it runs again from its first attempt, to success; its failures stay on record.
    healed.store(true, Ordering::SeqCst);
    let replayed = op(&app, Method::POST, &format!("/dead-letters/{heal}/replay"), None).await.expect(StatusCode::OK);
    assert_eq!(replayed, json!({ "id": heal.0, "outcome": "replayed" }));
    let done = ended(&app, ws, heal).await;
    assert_eq!(done.status, JobStatus::Succeeded);
    assert_eq!(done.result, Some(json!({ "done": "heal" })));
    let detail = op(&app, Method::GET, &format!("/jobs/{heal}"), None).await.expect(StatusCode::OK);
    assert_eq!(detail["status"], "succeeded");
    assert_eq!(detail["attempts"].as_array().unwrap().len(), 1);
    assert_eq!(detail["attempts"][0]["error"], "not healed yet");
    // Each run with when its handler started and the worker that ran it: the failed one, and the one that succeeded.
    let time = |v: &Value| v.as_str().and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok()).expect("a time");
    let failed = &detail["attempts"][0];
    let worker = failed["ran_by"].as_str().expect("the failed run's worker");
    assert!(!worker.is_empty());
    assert!(time(&failed["started_at"]) <= time(&failed["failed_at"]), "{detail}");
    assert_eq!(detail["ran_by"], worker, "one worker ran both");
    assert!(time(&failed["started_at"]) < time(&detail["run_started_at"]), "{detail}");
    assert!(time(&detail["run_started_at"]) <= time(&detail["finished_at"]), "{detail}");
    // Not a dead letter any more: neither replayed nor discarded again.
    op(&app, Method::POST, &format!("/dead-letters/{heal}/replay"), None).await.problem(StatusCode::NOT_FOUND);
    op(&app, Method::DELETE, &format!("/dead-letters/{heal}"), None).await.problem(StatusCode::NOT_FOUND);

    // The same through retry: a dead letter retried runs again.
    let retried = op(&app, Method::POST, &format!("/jobs/{flaky}/retry"), None).await.expect(StatusCode::OK);
    assert_eq!(retried["outcome"], "retried");
    assert_eq!(ended(&app, ws, flaky).await.status, JobStatus::Failed, "still flaky: dead-lettered again");
    let detail = op(&app, Method::GET, &format!("/jobs/{flaky}"), None).await.expect(StatusCode::OK);
    assert_eq!(detail["attempts"].as_array().unwrap().len(), 6, "three runs before the retry, three after");

    // Discarded: the job goes with its failures; its operation (none here) would stay failed.
    op(&app, Method::DELETE, &format!("/dead-letters/{flaky}"), None).await.expect(StatusCode::NO_CONTENT);
    op(&app, Method::GET, &format!("/jobs/{flaky}"), None).await.problem(StatusCode::NOT_FOUND);
    let mut owner = app.db.owner().await;
    let (left,): (i64,) = sqlx::query_as("SELECT count(*) FROM conveyor.job_failures WHERE job_id = $1")
        .bind(flaky.0)
        .fetch_one(&mut owner)
        .await
        .unwrap();
    assert_eq!(left, 0);
    platform.stop().await;
}

#[tokio::test]
async fn bulk_replay_and_discard_act_on_what_the_filter_matches_and_count_it() {
    let app = TestApp::spawn().await;
    let (a, b) = (principal().workspace_id, principal().workspace_id);
    let healed = Arc::new(AtomicBool::new(false));
    let platform = Platform::start(&app, &healed).await;
    let before_any = chrono::Utc::now();
    let mut dead = Vec::new();
    for (ws, key) in [(a, Some("k1")), (a, None), (a, None), (b, None)] {
        let options = match key {
            Some(key) => EnqueueOptions::new().dedup_key(key),
            None => EnqueueOptions::new(),
        };
        let job = enqueue(&app, ws, "heal", options).await;
        assert_eq!(ended(&app, ws, job).await.status, JobStatus::Failed);
        dead.push((ws, job));
    }
    platform.stop().await;
    // A live job holds the first dead letter's de-dup key: its replay is skipped.
    let holder = enqueue(&app, a, "ok", EnqueueOptions::new().dedup_key("k1").delay(Duration::from_secs(3600))).await;

    // A body is required, and it is a filter with no cursor.
    op(&app, Method::POST, "/dead-letters/replay", None).await.problem(StatusCode::BAD_REQUEST);
    let problem = op(&app, Method::POST, "/dead-letters/replay", Some(json!({ "before": dead[0].1.0 }))).await;
    assert_eq!(problem.problem(StatusCode::BAD_REQUEST)["code"], "INVALID_BODY");
    let problem = op(&app, Method::POST, "/dead-letters/discard", Some(json!({ "limit": 0 }))).await;
    assert!(problem.problem(StatusCode::BAD_REQUEST)["detail"].as_str().unwrap().starts_with("limit"));
    // An empty filter is not "every dead letter": a bulk action needs a filter, or says `"all": true`.
    for (path, body) in [
        ("/dead-letters/discard", json!({})),
        ("/dead-letters/replay", json!({})),
        ("/dead-letters/discard", json!({ "limit": 10 })),
        ("/dead-letters/discard", json!({ "all": false })),
    ] {
        let problem = op(&app, Method::POST, path, Some(body.clone())).await.problem(StatusCode::BAD_REQUEST);
        assert!(
            problem["detail"].as_str().unwrap().starts_with("all: a bulk replay or discard needs a filter"),
            "{body}"
        );
    }
    let untouched = op(&app, Method::GET, "/dead-letters", None).await.expect(StatusCode::OK);
    assert_eq!(untouched["items"].as_array().unwrap().len(), 4);
    // `until` bounds it: nothing of workspace b was dead-lettered before the jobs were enqueued.
    let bounded = json!({ "workspace": b.0, "until": before_any });
    let none = op(&app, Method::POST, "/dead-letters/discard", Some(bounded)).await.expect(StatusCode::OK);
    assert_eq!(none, json!({ "matched": 0, "done": 0, "skipped": 0 }));

    // Workspace b's only dead letter, discarded.
    let discarded = op(&app, Method::POST, "/dead-letters/discard", Some(json!({ "workspace": b.0 }))).await;
    assert_eq!(discarded.expect(StatusCode::OK), json!({ "matched": 1, "done": 1, "skipped": 0 }));
    assert!(conveyor_jobs::get_job(&app.db.pool, b, dead[3].1).await.unwrap().is_none());
    // Every dead letter of the kind: workspace a's three; the one whose key is held is skipped.
    let replayed = op(&app, Method::POST, "/dead-letters/replay", Some(json!({ "kind": "admin.chore" }))).await;
    assert_eq!(replayed.expect(StatusCode::OK), json!({ "matched": 3, "done": 2, "skipped": 1 }));
    let left = op(&app, Method::GET, "/dead-letters", None).await.expect(StatusCode::OK);
    assert_eq!(left["items"].as_array().unwrap().len(), 1);
    assert_eq!(left["items"][0]["id"], dead[0].1.0.to_string());
    // One by one: the held key refuses the replay with the holder named.
    let held = op(&app, Method::POST, &format!("/dead-letters/{}/replay", dead[0].1), None).await;
    let held = held.problem(StatusCode::CONFLICT);
    assert_eq!((held["code"].clone(), held["live_job_id"].clone()), (json!("DEDUP_KEY_HELD"), json!(holder.0)));
    let held = op(&app, Method::POST, &format!("/jobs/{}/retry", dead[0].1), None).await;
    assert_eq!(held.problem(StatusCode::CONFLICT)["code"], "DEDUP_KEY_HELD");

    // The replayed ones run to success once healed.
    healed.store(true, Ordering::SeqCst);
    let platform = Platform::start(&app, &healed).await;
    for (ws, job) in &dead[1..3] {
        assert_eq!(ended(&app, *ws, *job).await.status, JobStatus::Succeeded);
    }
    platform.stop().await;
    // Nothing matches any more: zero counts, not an error.
    let none =
        op(&app, Method::POST, "/dead-letters/discard", Some(json!({ "queue": "chores", "kind": "other.kind" })));
    assert_eq!(none.await.expect(StatusCode::OK), json!({ "matched": 0, "done": 0, "skipped": 0 }));
    // Every dead letter of every workspace, said explicitly: the one whose key is held, discarded.
    let all = op(&app, Method::POST, "/dead-letters/discard", Some(json!({ "all": true }))).await;
    assert_eq!(all.expect(StatusCode::OK), json!({ "matched": 1, "done": 1, "skipped": 0 }));
    // The audit trail has each bulk action with its filter and what it did.
    let trail = op(&app, Method::GET, "/audit?limit=100", None).await.expect(StatusCode::OK);
    let bulk: Vec<&Value> = trail["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["action"] == "replay_dead_letters" && e["arguments"].get("done").is_some())
        .collect();
    assert_eq!(bulk.len(), 1, "{trail}");
    assert_eq!(bulk[0]["arguments"]["filter"]["kind"], "admin.chore");
    assert_eq!(bulk[0]["arguments"]["job_ids"].as_array().unwrap().len(), 2);
}

#[tokio::test]
async fn cancel_and_retry_change_a_job_as_far_as_its_state_allows() {
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    let delayed = enqueue(&app, ws, "ok", EnqueueOptions::new().delay(Duration::from_secs(3600))).await;
    let other = enqueue(&app, ws, "ok", EnqueueOptions::new().delay(Duration::from_secs(3600))).await;

    // Retry of a delayed job makes it due now; a due job cannot be retried.
    let retried = op(&app, Method::POST, &format!("/jobs/{delayed}/retry"), None).await.expect(StatusCode::OK);
    assert_eq!(retried, json!({ "id": delayed.0, "outcome": "retried" }));
    let job = conveyor_jobs::get_job(&app.db.pool, ws, delayed).await.unwrap().unwrap();
    assert_eq!(job.status, JobStatus::Queued);
    let again = op(&app, Method::POST, &format!("/jobs/{delayed}/retry"), None).await;
    assert_eq!(again.problem(StatusCode::CONFLICT)["code"], "JOB_NOT_RETRYABLE");

    // Cancel: once; then the job has ended.
    let canceled = op(&app, Method::POST, &format!("/jobs/{other}/cancel"), None).await.expect(StatusCode::OK);
    assert_eq!(canceled["outcome"], "canceled");
    assert_eq!(conveyor_jobs::get_job(&app.db.pool, ws, other).await.unwrap().unwrap().status, JobStatus::Canceled);
    let again = op(&app, Method::POST, &format!("/jobs/{other}/cancel"), None).await;
    assert_eq!(again.problem(StatusCode::CONFLICT)["code"], "JOB_FINISHED");
    op(&app, Method::POST, &format!("/jobs/{other}/retry"), None).await.problem(StatusCode::CONFLICT);

    // Unknown and malformed ids.
    let unknown = Uuid::now_v7();
    op(&app, Method::POST, &format!("/jobs/{unknown}/cancel"), None).await.problem(StatusCode::NOT_FOUND);
    op(&app, Method::POST, &format!("/jobs/{unknown}/retry"), None).await.problem(StatusCode::NOT_FOUND);
    let problem = op(&app, Method::POST, "/jobs/not-a-uuid/cancel", None).await.problem(StatusCode::BAD_REQUEST);
    assert_eq!(problem["parameter"], "id");
}

#[tokio::test]
async fn a_waiting_job_is_changed_a_queue_drained_and_cleaned_through_the_api_with_refusals_and_audit() {
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    let other_ws = WorkspaceId(Uuid::new_v4());
    let delayed = enqueue(&app, ws, "ok", EnqueueOptions::new().delay(Duration::from_secs(3600))).await;

    // A change: priority and payload of a delayed job, then due now.
    let body = json!({ "priority": "high", "payload": { "mode": "changed" } });
    let changed = op(&app, Method::POST, &format!("/jobs/{delayed}/change"), Some(body)).await.expect(StatusCode::OK);
    assert_eq!(changed, json!({ "id": delayed.0, "outcome": "changed" }));
    let detail = op(&app, Method::GET, &format!("/jobs/{delayed}"), None).await.expect(StatusCode::OK);
    assert_eq!((detail["priority"].clone(), detail["payload"].clone()), (json!(0), json!({ "mode": "changed" })));
    assert_eq!(detail["status"], "scheduled");
    // Bad bodies: two due times, nothing known, no body at all; an unknown job.
    let bad_bodies = [
        json!({ "run_now": true, "delay_ms": 5 }),
        json!({ "colour": "red" }),
        json!({}),
        json!({ "delay_ms": u64::MAX }),
    ];
    for bad in bad_bodies {
        let path = format!("/jobs/{delayed}/change");
        op(&app, Method::POST, &path, Some(bad.clone())).await.problem(StatusCode::BAD_REQUEST);
    }
    let unknown = Uuid::now_v7();
    let path = format!("/jobs/{unknown}/change");
    op(&app, Method::POST, &path, Some(json!({ "run_now": true }))).await.problem(StatusCode::NOT_FOUND);

    // Handed to a worker and run: a change is refused with 409, and nothing changed.
    let platform = Platform::start(&app, &Arc::new(AtomicBool::new(true))).await;
    let path = format!("/jobs/{delayed}/change");
    op(&app, Method::POST, &path, Some(json!({ "run_now": true }))).await.expect(StatusCode::OK);
    let ran = ended(&app, ws, delayed).await;
    assert_eq!((ran.status, ran.result), (JobStatus::Succeeded, Some(json!({ "done": "changed" }))));
    let refused = op(&app, Method::POST, &path, Some(json!({ "priority": "low" }))).await;
    assert_eq!(refused.problem(StatusCode::CONFLICT)["code"], "JOB_NOT_WAITING");
    // Its log is in its detail, redacted.
    let detail = op(&app, Method::GET, &format!("/jobs/{delayed}"), None).await.expect(StatusCode::OK);
    assert_eq!(detail["logs"][0]["line"], "done changed with password=[redacted]", "{detail}");
    assert_eq!(detail["logs"][0]["attempt"], 1);
    platform.stop().await;

    // A drain: one workspace, or all said explicitly; never neither, never both.
    let waiting: Vec<JobId> = [
        enqueue(&app, ws, "ok", EnqueueOptions::new().delay(Duration::from_secs(3600))).await,
        enqueue(&app, ws, "ok", EnqueueOptions::new().delay(Duration::from_secs(3600))).await,
        enqueue(&app, other_ws, "ok", EnqueueOptions::new().delay(Duration::from_secs(3600))).await,
    ]
    .into();
    op(&app, Method::POST, "/queues/chores/drain", Some(json!({}))).await.problem(StatusCode::BAD_REQUEST);
    let both = json!({ "workspace": ws.0, "all": true });
    op(&app, Method::POST, "/queues/chores/drain", Some(both)).await.problem(StatusCode::BAD_REQUEST);
    let one = json!({ "workspace": other_ws.0 });
    let drained = op(&app, Method::POST, "/queues/chores/drain", Some(one)).await.expect(StatusCode::OK);
    assert_eq!(drained, json!({ "workspaces": 1, "canceled": 1 }));
    assert_eq!(
        conveyor_jobs::get_job(&app.db.pool, ws, waiting[0]).await.unwrap().unwrap().status,
        JobStatus::Scheduled
    );
    let all = op(&app, Method::POST, "/queues/chores/drain", Some(json!({ "all": true }))).await.expect(StatusCode::OK);
    assert_eq!(all, json!({ "workspaces": 1, "canceled": 2 }));
    for (job, in_ws) in waiting.iter().zip([ws, ws, other_ws]) {
        assert_eq!(
            conveyor_jobs::get_job(&app.db.pool, in_ws, *job).await.unwrap().unwrap().status,
            JobStatus::Canceled
        );
    }

    // A clean of the canceled ones, keeping the newest; a status that is not an end is refused.
    let clean = json!({ "status": "canceled", "workspace": ws.0, "keep_last": 1 });
    let cleaned = op(&app, Method::POST, "/queues/chores/clean", Some(clean)).await.expect(StatusCode::OK);
    assert_eq!(cleaned, json!({ "deleted": 1 }));
    let mut left = 0;
    for job in &waiting[..2] {
        left += usize::from(conveyor_jobs::get_job(&app.db.pool, ws, *job).await.unwrap().is_some());
    }
    assert_eq!(left, 1, "the newest canceled job stays");
    let neither = json!({ "status": "canceled", "workspace": ws.0 });
    op(&app, Method::POST, "/queues/chores/clean", Some(neither)).await.problem(StatusCode::BAD_REQUEST);
    let not_an_end = json!({ "status": "queued", "workspace": ws.0, "keep_last": 1 });
    op(&app, Method::POST, "/queues/chores/clean", Some(not_an_end)).await.problem(StatusCode::BAD_REQUEST);

    // Each change is on the audit trail with what it set.
    let trail = op(&app, Method::GET, "/audit?limit=100", None).await.expect(StatusCode::OK);
    let entries = trail["items"].as_array().cloned().unwrap_or_else(|| trail.as_array().cloned().unwrap());
    let done = |action: &str| {
        entries.iter().filter(|e| e["action"] == action && e["arguments"]["outcome"] != "pending").count()
    };
    assert!(entries.iter().any(|e| e["action"] == "change_job" && e["arguments"]["priority"] == "high"));
    assert!(done("change_job") >= 2 && done("drain") >= 2 && done("clean") >= 1, "{entries:?}");
}

#[tokio::test]
async fn a_queue_is_obliterated_through_the_api_refused_while_its_jobs_run_unless_forced_and_audited() {
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    let redis = common::redis_url();
    let dispatcher = common::test_dispatcher(&app, &redis, |_| {}).await;
    let waiting = enqueue(&app, ws, "ok", EnqueueOptions::new().delay(Duration::from_secs(3600))).await;
    let running = enqueue(&app, ws, "ok", EnqueueOptions::new()).await;
    dispatcher.dispatch_once().await.unwrap();

    let path = "/queues/chores/obliterate";
    op(&app, Method::POST, path, Some(json!({}))).await.problem(StatusCode::BAD_REQUEST);
    op(&app, Method::POST, "/queues/No%20Such/obliterate", Some(json!({ "workspace": ws.0 })))
        .await
        .problem(StatusCode::BAD_REQUEST);
    let refused = op(&app, Method::POST, path, Some(json!({ "workspace": ws.0 }))).await;
    let problem = refused.problem(StatusCode::CONFLICT);
    assert_eq!((problem["code"].clone(), problem["running"].clone()), (json!("QUEUE_RUNNING"), json!(1)));
    let still = conveyor_jobs::get_job(&app.db.pool, ws, waiting).await.unwrap().unwrap().status;
    assert_eq!(still, JobStatus::Scheduled, "a refusal changes nothing");

    let forced = json!({ "workspace": ws.0, "force": true });
    let done = op(&app, Method::POST, path, Some(forced)).await.expect(StatusCode::OK);
    assert_eq!(done, json!({ "outcome": "done", "canceled": 2, "deleted": 1, "kept_running": 1 }));
    assert!(conveyor_jobs::get_job(&app.db.pool, ws, waiting).await.unwrap().is_none(), "canceled, then deleted");
    let canceled = conveyor_jobs::get_job(&app.db.pool, ws, running).await.unwrap().unwrap().status;
    assert_eq!(canceled, JobStatus::Canceled, "kept while its run may go on");

    let trail = op(&app, Method::GET, "/audit?limit=100", None).await.expect(StatusCode::OK);
    let entries = trail["items"].as_array().cloned().unwrap_or_else(|| trail.as_array().cloned().unwrap());
    let outcomes: Vec<Value> = entries
        .iter()
        .filter(|e| e["action"] == "obliterate" && e["arguments"]["outcome"] != "pending")
        .map(|e| e["arguments"]["outcome"].clone())
        .collect();
    assert!(outcomes.contains(&json!("refused")) && outcomes.contains(&json!("done")), "{entries:?}");

    // The CLI: a workspace is required, and a refusal is an error that says why.
    assert!(cli(&app, "jobs", &["obliterate", "--queue", "chores"]).unwrap_err().contains("--workspace"));
    enqueue(&app, ws, "ok", EnqueueOptions::new()).await;
    dispatcher.dispatch_once().await.unwrap();
    let refused = cli(&app, "jobs", &["obliterate", "--queue", "chores", "--workspace", &ws.0.to_string()]);
    assert!(refused.unwrap_err().contains("nothing changed"));
    let forced = cli(&app, "jobs", &["obliterate", "--queue", "chores", "--workspace", &ws.0.to_string(), "--force"]);
    assert_eq!(serde_json::from_str::<Value>(&forced.unwrap()).unwrap()["canceled"], 1);
}

#[tokio::test]
async fn the_consumers_each_queue_has_are_listed_with_what_they_hold_by_the_api_and_the_cli() {
    use fred::prelude::StreamsInterface;
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    let redis = common::redis_url();
    let dispatcher = common::test_dispatcher(&app, &redis, |_| {}).await;
    enqueue(&app, ws, "ok", EnqueueOptions::new()).await;
    enqueue(&app, ws, "ok", EnqueueOptions::new()).await;
    dispatcher.dispatch_once().await.unwrap();
    // A consumer that read one entry and has not acknowledged it, as a worker running a job has.
    let keys = conveyor_jobs::RedisKeys::new(&app.redis_prefix);
    let (stream, group) = (keys.stream(Chore::QUEUE), keys.group(Chore::QUEUE));
    let client = common::redis_client(&redis).await;
    let _: Result<fred::types::Value, _> = client.xgroup_create(&stream, &group, "0", true).await;
    let read: fred::types::Value =
        client.xreadgroup(&group, "inspector-1", Some(1), None, false, &stream, ">").await.unwrap();
    assert!(!read.is_null(), "an entry was read");

    let listed = op(&app, Method::GET, "/consumers", None).await.expect(StatusCode::OK);
    let items = listed["items"].as_array().cloned().unwrap_or_else(|| listed.as_array().cloned().unwrap());
    let inspector = items.iter().find(|c| c["consumer"] == "inspector-1").unwrap_or_else(|| panic!("{listed}"));
    assert_eq!((inspector["queue"].clone(), inspector["pending"].clone()), (json!(Chore::QUEUE), json!(1)));
    assert!(inspector["idle_ms"].as_u64().unwrap() < 600_000, "{inspector}");

    let lines = cli(&app, "consumers", &["-o", "json"]).unwrap();
    let rows: Vec<Value> = lines.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert!(rows.iter().any(|c| c["consumer"] == "inspector-1" && c["pending"] == 1), "{lines}");
    let table = cli(&app, "consumers", &[]).unwrap();
    assert!(table.starts_with("QUEUE ") && table.lines().any(|l| l.contains("inspector-1")), "{table}");
}

#[tokio::test]
async fn bad_query_values_are_400s_naming_the_parameter() {
    let app = TestApp::spawn().await;
    for (path, parameter) in [
        ("/jobs?limit=0", "limit"),
        ("/jobs?limit=501", "limit"),
        ("/jobs?limit=many", "limit"),
        ("/jobs?status=dead", "status"),
        ("/jobs?since=yesterday", "since"),
        ("/jobs?until=2026-13-01", "until"),
        ("/jobs?before=42", "before"),
        ("/jobs?workspace=acme", "workspace"),
        ("/jobs?queue=a&queue=b", "queue"),
        ("/operations?before=x", "before"),
        ("/dead-letters?since=now", "since"),
        ("/schedules?workspace=nope", "workspace"),
        ("/audit?limit=0", "limit"),
        ("/jobs/123", "id"),
        ("/dead-letters/123/replay", "id"),
        ("/schedules/nope/nightly/pause", "workspace"),
    ] {
        let method = if path.contains("/replay") || path.ends_with("/pause") { Method::POST } else { Method::GET };
        let problem = op(&app, method, path, None).await.problem(StatusCode::BAD_REQUEST);
        assert_eq!(problem["parameter"], parameter, "{path}: {problem}");
        assert!(problem["detail"].as_str().unwrap().starts_with(parameter), "{path}: {problem}");
        assert_eq!(problem["code"], "INVALID_PARAMETER");
    }
    // What the operator module refuses names its field in the detail.
    for (path, field) in [
        ("/jobs?queue=A%7D", "queue:"),
        ("/jobs?kind=Upper", "kind:"),
        ("/operations?status=done", "status:"),
        ("/dead-letters?queue=a%3Ab", "queue:"),
        ("/jobs?since=2026-01-02T00:00:00Z&until=2026-01-01T00:00:00Z", "since"),
        ("/jobs?color=red", "unknown query parameter `color`"),
    ] {
        let problem = op(&app, Method::GET, path, None).await.problem(StatusCode::BAD_REQUEST);
        assert!(problem["detail"].as_str().unwrap().starts_with(field), "{path}: {problem}");
    }
}

#[tokio::test]
async fn pauses_and_schedules_are_listed_and_changed_through_the_api() {
    let app = TestApp::spawn().await;
    let (a, b) = (principal().workspace_id, principal().workspace_id);

    // Pauses: set, set again, listed, lifted by query or body, and refused without a scope.
    let created = op(&app, Method::POST, "/pauses", Some(json!({ "queue": "chores", "reason": "deploy" }))).await;
    assert_eq!(created.expect(StatusCode::CREATED)["created"], true);
    let again = op(&app, Method::POST, "/pauses", Some(json!({ "queue": "chores" }))).await.expect(StatusCode::OK);
    assert_eq!(again["created"], false);
    op(&app, Method::POST, "/pauses", Some(json!({ "kind": "admin.chore", "workspace": a.0 })))
        .await
        .expect(StatusCode::CREATED);
    let pauses = op(&app, Method::GET, "/pauses", None).await.expect(StatusCode::OK);
    assert_eq!(pauses["items"].as_array().unwrap().len(), 2);
    assert_eq!(pauses["items"][0]["reason"], "deploy");
    op(&app, Method::POST, "/pauses", Some(json!({}))).await.problem(StatusCode::BAD_REQUEST);
    op(&app, Method::POST, "/pauses", Some(json!({ "queue": "Bad}" }))).await.problem(StatusCode::BAD_REQUEST);
    op(&app, Method::POST, "/pauses", Some(json!({ "queue": "q", "color": "red" })))
        .await
        .problem(StatusCode::BAD_REQUEST);
    op(&app, Method::DELETE, "/pauses?queue=chores", None).await.expect(StatusCode::NO_CONTENT);
    op(&app, Method::DELETE, "/pauses?queue=chores", None).await.problem(StatusCode::NOT_FOUND);
    let body = json!({ "kind": "admin.chore", "workspace": a.0 });
    op(&app, Method::DELETE, "/pauses", Some(body)).await.expect(StatusCode::NO_CONTENT);
    op(&app, Method::DELETE, "/pauses", None).await.problem(StatusCode::BAD_REQUEST);
    assert!(conveyor_jobs::list_pauses(&app.db.runtime_pool).await.unwrap().is_empty());

    // Global limits: set (a concurrency, a rate, both), listed, changed, refused when malformed, removed.
    let set = op(&app, Method::PUT, "/global-limits/queue/chores", Some(json!({ "max_in_flight": 4 }))).await;
    assert_eq!(set.expect(StatusCode::OK)["max_in_flight"], 4);
    let rate = json!({ "max_per_interval": 100, "interval_ms": 1000 });
    op(&app, Method::PUT, "/global-limits/kind/admin.chore", Some(rate)).await.expect(StatusCode::OK);
    let both = json!({ "max_in_flight": 2, "max_per_interval": 10, "interval_ms": 60000 });
    op(&app, Method::PUT, "/global-limits/queue/chores", Some(both)).await.expect(StatusCode::OK);
    let limits = op(&app, Method::GET, "/global-limits", None).await.expect(StatusCode::OK);
    let items = limits["items"].as_array().unwrap();
    assert_eq!(items.len(), 2, "{limits}");
    assert_eq!((items[0]["scope"].clone(), items[0]["name"].clone()), (json!("kind"), json!("admin.chore")));
    assert_eq!((items[0]["max_per_interval"].clone(), items[0]["max_in_flight"].clone()), (json!(100), Value::Null));
    assert_eq!(
        (items[1]["max_in_flight"].clone(), items[1]["max_per_interval"].clone(), items[1]["interval_ms"].clone()),
        (json!(2), json!(10), json!(60000))
    );
    assert_eq!(items[1]["in_flight"], 0);
    for (path, body) in [
        ("/global-limits/queue/chores", json!({})),
        ("/global-limits/queue/chores", json!({ "max_per_interval": 5 })),
        ("/global-limits/queue/chores", json!({ "max_in_flight": 0 })),
        ("/global-limits/queue/chores", json!({ "max_in_flight": 2, "color": "red" })),
        ("/global-limits/shard/chores", json!({ "max_in_flight": 2 })),
        ("/global-limits/queue/Bad%7D", json!({ "max_in_flight": 2 })),
    ] {
        op(&app, Method::PUT, path, Some(body.clone())).await.problem(StatusCode::BAD_REQUEST);
    }
    let unchanged = op(&app, Method::GET, "/global-limits", None).await.expect(StatusCode::OK);
    assert_eq!(unchanged["items"][1]["max_in_flight"], 2, "a refused change changes nothing");
    op(&app, Method::DELETE, "/global-limits/queue/chores", None).await.expect(StatusCode::NO_CONTENT);
    op(&app, Method::DELETE, "/global-limits/queue/chores", None).await.problem(StatusCode::NOT_FOUND);
    op(&app, Method::DELETE, "/global-limits/kind/admin.chore", None).await.expect(StatusCode::NO_CONTENT);
    let none = op(&app, Method::GET, "/global-limits", None).await.expect(StatusCode::OK);
    assert!(none["items"].as_array().unwrap().is_empty());

    // Fairness: a workspace's weight, key limit (with a rate) and kind limit set, listed with what they hold (the
    // limits of one workspace or of all), refused when malformed, removed.
    op(&app, Method::PUT, &format!("/workspaces/{a}/weight"), Some(json!({ "weight": 3 })))
        .await
        .expect(StatusCode::OK);
    let key = json!({ "max_in_flight": 2, "max_per_interval": 5, "interval_ms": 1000 });
    op(&app, Method::PUT, &format!("/workspaces/{a}/key-limits/store%3A7"), Some(key)).await.expect(StatusCode::OK);
    let kind = json!({ "max_in_flight": 1 });
    op(&app, Method::PUT, &format!("/workspaces/{b}/kind-limits/admin.chore"), Some(kind)).await.expect(StatusCode::OK);
    let fair = op(&app, Method::GET, "/fairness", None).await.expect(StatusCode::OK);
    let weighed = fair["workspaces"].as_array().unwrap().iter().find(|w| w["workspace_id"] == json!(a.0)).cloned();
    assert_eq!(weighed.map(|w| (w["weight"].clone(), w["in_flight"].clone())), Some((json!(3), json!(0))), "{fair}");
    assert_eq!(fair["key_limits"][0]["key"], "store:7");
    assert_eq!(
        (fair["key_limits"][0]["max_per_interval"].clone(), fair["key_limits"][0]["interval_ms"].clone()),
        (json!(5), json!(1000))
    );
    assert_eq!(
        (fair["kind_limits"][0]["workspace_id"].clone(), fair["kind_limits"][0]["kind"].clone()),
        (json!(b.0), json!("admin.chore"))
    );
    let only_a = op(&app, Method::GET, &format!("/fairness?workspace={a}"), None).await.expect(StatusCode::OK);
    assert_eq!(
        (only_a["key_limits"].as_array().unwrap().len(), only_a["kind_limits"].as_array().unwrap().len()),
        (1, 0)
    );
    for (method, path, body) in [
        (Method::PUT, format!("/workspaces/{a}/weight"), json!({ "weight": 0 })),
        (Method::PUT, format!("/workspaces/{a}/weight"), json!({ "weight": "heavy" })),
        (Method::PUT, "/workspaces/nope/weight".to_owned(), json!({ "weight": 2 })),
        (Method::PUT, format!("/workspaces/{a}/key-limits/k"), json!({})),
        (Method::PUT, format!("/workspaces/{a}/key-limits/k"), json!({ "max_per_interval": 5 })),
        (Method::PUT, format!("/workspaces/{a}/kind-limits/admin.chore"), json!({ "max_in_flight": 0 })),
        (Method::PUT, format!("/workspaces/{a}/kind-limits/Bad%7D"), json!({ "max_in_flight": 1 })),
    ] {
        op(&app, method.clone(), &path, Some(body)).await.problem(StatusCode::BAD_REQUEST);
    }
    // Refused before anything is written, the audit trail included: a key too long, a key with a NUL, a bad kind.
    let mut owner = app.db.owner().await;
    let audited = async |owner: &mut sqlx::PgConnection| -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM conveyor.conveyor_admin_audit").fetch_one(owner).await.unwrap()
    };
    let before = audited(&mut owner).await;
    let long = "k".repeat(201);
    for (method, path) in [
        (Method::DELETE, format!("/workspaces/{a}/key-limits/{long}")),
        (Method::PUT, format!("/workspaces/{a}/key-limits/{long}")),
        (Method::DELETE, format!("/workspaces/{a}/key-limits/a%00b")),
        (Method::PUT, format!("/workspaces/{a}/key-limits/a%00b")),
        (Method::DELETE, format!("/workspaces/{a}/kind-limits/Bad%7D")),
    ] {
        op(&app, method.clone(), &path, Some(json!({ "max_in_flight": 1 }))).await.problem(StatusCode::BAD_REQUEST);
    }
    assert_eq!(audited(&mut owner).await, before, "nothing audited, nothing changed");
    op(&app, Method::DELETE, &format!("/workspaces/{a}/key-limits/store%3A7"), None)
        .await
        .expect(StatusCode::NO_CONTENT);
    op(&app, Method::DELETE, &format!("/workspaces/{a}/key-limits/store%3A7"), None)
        .await
        .problem(StatusCode::NOT_FOUND);
    let path = format!("/workspaces/{b}/kind-limits/admin.chore");
    op(&app, Method::DELETE, &path, None).await.expect(StatusCode::NO_CONTENT);
    let none = op(&app, Method::GET, "/fairness", None).await.expect(StatusCode::OK);
    assert!(none["key_limits"].as_array().unwrap().is_empty() && none["kind_limits"].as_array().unwrap().is_empty());

    // Schedules of both workspaces; one workspace's; paused and resumed in their workspace.
    for ws in [a, b] {
        let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
        let spec = conveyor_jobs::ScheduleSpec::every(Duration::from_secs(3600)).unwrap();
        conveyor_jobs::upsert_schedule_tx(
            &mut tx,
            "nightly",
            &Chore { mode: "ok".into() },
            spec,
            conveyor_jobs::ScheduleOptions::new(),
        )
        .await
        .unwrap();
        tx.commit().await.unwrap();
    }
    let all = op(&app, Method::GET, "/schedules", None).await.expect(StatusCode::OK);
    assert_eq!(all["items"].as_array().unwrap().len(), 2);
    let only_b = op(&app, Method::GET, &format!("/schedules?workspace={b}"), None).await.expect(StatusCode::OK);
    assert_eq!(only_b["items"].as_array().unwrap().len(), 1);
    assert_eq!(
        (only_b["items"][0]["workspace_id"].clone(), only_b["items"][0]["name"].clone()),
        (json!(b.0), json!("nightly"))
    );
    let paused = op(&app, Method::POST, &format!("/schedules/{a}/nightly/pause"), None).await.expect(StatusCode::OK);
    assert_eq!(paused, json!({ "workspace_id": a.0, "name": "nightly", "paused": true }));
    assert!(conveyor_jobs::list_schedules(&app.db.pool, a).await.unwrap()[0].paused);
    assert!(
        !conveyor_jobs::list_schedules(&app.db.pool, b).await.unwrap()[0].paused,
        "the other workspace's is untouched"
    );
    op(&app, Method::POST, &format!("/schedules/{a}/nightly/resume"), None).await.expect(StatusCode::OK);
    assert!(!conveyor_jobs::list_schedules(&app.db.pool, a).await.unwrap()[0].paused);
    op(&app, Method::POST, &format!("/schedules/{a}/weekly/pause"), None).await.problem(StatusCode::NOT_FOUND);
    let problem = op(&app, Method::POST, &format!("/schedules/{a}/Bad%20Name/pause"), None).await;
    assert!(problem.problem(StatusCode::BAD_REQUEST)["detail"].as_str().unwrap().starts_with("name:"));
}

#[tokio::test]
async fn migrate_refuses_an_operator_role_that_would_bypass_the_wall_or_is_the_application() {
    let db = common::TestDb::create().await;
    let config = |operator: &str| common::migrate_config(&db.owner_url, &db.app_url, &db.runtime_url, Some(operator));
    let err = conveyor_jobs::migrate_with(&config(&db.owner_url)).await.unwrap_err();
    assert!(format!("{err:#}").contains("operator role `conveyor_owner` must not be"), "{err:#}");
    let err = conveyor_jobs::migrate_with(&config(&db.app_url)).await.unwrap_err();
    assert!(format!("{err:#}").contains("is the application role"), "{err:#}");
    conveyor_jobs::migrate_with(&config(&db.operator_url)).await.unwrap();
}

/// Runs `conveyor dlq <args>` against the app's database; its stdout, or its stderr on failure.
fn dlq(app: &TestApp, args: &[&str]) -> Result<String, String> {
    cli(app, "dlq", args)
}

/// Runs `conveyor <group> <args>` as the user `tester` with the app's configuration: its stdout, or its stderr.
fn cli(app: &TestApp, group: &str, args: &[&str]) -> Result<String, String> {
    let out = std::process::Command::new(common::conveyor_bin())
        .arg(group)
        .args(args)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("USER", "tester")
        .envs(common::config_vars(&app.db, &app.redis_prefix))
        .output()
        .expect("run conveyor");
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

#[tokio::test]
async fn the_jobs_commands_change_drain_and_clean_with_clear_refusals() {
    let app = TestApp::spawn().await;
    let (a, b) = (principal().workspace_id, principal().workspace_id);
    let later = || EnqueueOptions::new().delay(Duration::from_secs(3600));
    let job = enqueue(&app, a, "ok", later()).await;
    let id = job.0.to_string();

    let changed = cli(&app, "jobs", &["change", &id, "--priority", "low", "--payload", r#"{"mode":"new"}"#]).unwrap();
    assert_eq!(changed.trim(), format!("changed {id}"));
    let shown: Value = serde_json::from_str(&cli(&app, "jobs", &["show", &id]).unwrap()).unwrap();
    assert_eq!((shown["priority"].clone(), shown["payload"].clone()), (json!(2), json!({ "mode": "new" })));
    // Bad input is refused before anything runs: a priority that is none, two due times, JSON that is not.
    for bad in [&["--priority", "urgent"][..], &["--run-now", "--delay", "1m"], &["--payload", "{not json"]] {
        let args: Vec<&str> = ["change", id.as_str()].into_iter().chain(bad.iter().copied()).collect();
        assert!(cli(&app, "jobs", &args).is_err(), "{bad:?} was taken");
    }
    // A drain names a workspace or --all, and a queue or a kind.
    assert!(cli(&app, "jobs", &["drain", "--queue", "chores"]).unwrap_err().contains("--workspace"));
    assert!(cli(&app, "jobs", &["drain", "--all"]).is_err());
    enqueue(&app, b, "ok", later()).await;
    let drained: Value =
        serde_json::from_str(&cli(&app, "jobs", &["drain", "--queue", "chores", "--all"]).unwrap()).unwrap();
    assert_eq!(drained, json!({ "workspaces": 2, "canceled": 2 }));
    // The drained job can no longer be changed.
    let refused = cli(&app, "jobs", &["change", &id, "--run-now"]).unwrap_err();
    assert!(refused.contains("cannot be changed"), "{refused}");
    // A clean names an age, a number to keep, or both.
    assert!(cli(&app, "jobs", &["clean", "--status", "canceled", "--workspace", &a.0.to_string()]).is_err());
    let every = ["clean", "--status", "canceled", "--workspace", &a.0.to_string(), "--older-than", "0s"];
    let cleaned = cli(&app, "jobs", &every).unwrap();
    assert_eq!(serde_json::from_str::<Value>(&cleaned).unwrap(), json!({ "deleted": 1 }));
    assert!(conveyor_jobs::get_job(&app.db.pool, a, job).await.unwrap().is_none());
    let not_an_end =
        cli(&app, "jobs", &["clean", "--status", "queued", "--workspace", &a.0.to_string(), "--keep-last", "1"])
            .unwrap_err();
    assert!(not_an_end.contains("ended jobs"), "{not_an_end}");
}

#[tokio::test]
async fn the_dlq_commands_filter_show_replay_and_discard_across_workspaces() {
    let app = TestApp::spawn().await;
    let (a, b) = (principal().workspace_id, principal().workspace_id);
    let healed = Arc::new(AtomicBool::new(false));
    let platform = Platform::start(&app, &healed).await;
    let mut dead = Vec::new();
    for ws in [a, a, b] {
        let job = enqueue(&app, ws, "heal", EnqueueOptions::new()).await;
        ended(&app, ws, job).await;
        dead.push(job);
    }
    platform.stop().await;

    let listed = dlq(&app, &["list", "--queue", "chores", "--since", "1h"]).unwrap();
    let listed: Vec<Value> = listed.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(listed.len(), 3);
    assert_eq!(listed[0]["id"], dead[2].0.to_string(), "newest first");
    let only_a = dlq(&app, &["list", "--workspace", &a.0.to_string()]).unwrap();
    assert_eq!(only_a.lines().count(), 2);
    assert_eq!(dlq(&app, &["list", "--until", "2000-01-01T00:00:00Z"]).unwrap(), "");
    let shown: Value = serde_json::from_str(&dlq(&app, &["show", &dead[0].0.to_string()]).unwrap()).unwrap();
    assert_eq!(
        (shown["status"].clone(), shown["attempts"][0]["error"].clone()),
        (json!("failed"), json!("not healed yet"))
    );

    assert_eq!(dlq(&app, &["replay", &dead[0].0.to_string()]).unwrap().trim(), format!("replaying {}", dead[0]));
    let again = dlq(&app, &["replay", &dead[0].0.to_string()]).unwrap_err();
    assert!(again.contains("no dead letter"), "{again}");
    assert!(dlq(&app, &["replay", &dead[1].0.to_string(), "--queue", "chores"]).unwrap_err().contains("--all"));
    let bulk: Value =
        serde_json::from_str(&dlq(&app, &["discard", "--all", "--workspace", &b.0.to_string()]).unwrap()).unwrap();
    assert_eq!(bulk, json!({ "matched": 1, "done": 1, "skipped": 0 }));
    let bulk: Value = serde_json::from_str(&dlq(&app, &["replay", "--all", "--kind", "admin.chore"]).unwrap()).unwrap();
    assert_eq!(bulk, json!({ "matched": 1, "done": 1, "skipped": 0 }));
    assert_eq!(dlq(&app, &["list"]).unwrap(), "");
    assert!(dlq(&app, &["discard", &dead[1].0.to_string()]).unwrap_err().contains("no dead letter"));

    // Each command is on the audit trail as the CLI's user.
    let trail = op(&app, Method::GET, "/audit?limit=500", None).await.expect(StatusCode::OK);
    let by_cli = trail["items"].as_array().unwrap().iter().filter(|e| e["actor"] == "cli:tester").count();
    assert!(by_cli >= 9, "{trail}");

    // Without the operator's URL the commands say what is missing.
    let out = std::process::Command::new(common::conveyor_bin())
        .args(["dlq", "list"])
        .env_clear()
        .envs(
            common::config_vars(&app.db, &app.redis_prefix)
                .into_iter()
                .filter(|(k, _)| k != "CONVEYOR_OPERATOR_DATABASE_URL"),
        )
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("CONVEYOR_OPERATOR_DATABASE_URL"));
}

#[tokio::test]
async fn failed_hand_offs_are_listed_as_dispatch_attempts_of_the_dead_letter() {
    let app = TestApp::spawn().await;
    let password = "hunter2-redis-password";
    let mut redis = common::TestRedis::start(Some(password)).await;
    let dispatcher = common::test_dispatcher(&app, &redis.url(), |v| {
        v.insert("CONVEYOR_DISPATCH_BACKOFF_BASE".into(), "10ms".into());
        v.insert("CONVEYOR_DISPATCH_BACKOFF_MAX".into(), "20ms".into());
        v.insert("CONVEYOR_DISPATCH_MAX_ATTEMPTS".into(), "2".into());
    })
    .await;
    redis.stop();
    let ws = principal().workspace_id;
    let job = enqueue(&app, ws, "ok", EnqueueOptions::new()).await;
    let dead = common::eventually(Duration::from_secs(60), || async {
        let _ = dispatcher.dispatch_once().await;
        let info = conveyor_jobs::get_job(&app.db.pool, ws, job).await.unwrap()?;
        (info.status == JobStatus::Failed).then_some(())
    })
    .await;
    assert!(dead.is_some(), "dead-lettered after two failed hand-offs");

    let detail = op(&app, Method::GET, &format!("/jobs/{job}"), None).await.expect(StatusCode::OK);
    let attempts = detail["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 2, "{detail}");
    for (n, attempt) in attempts.iter().enumerate() {
        assert_eq!((attempt["attempt"].as_u64(), attempt["stage"].as_str()), (Some(n as u64 + 1), Some("dispatch")));
        assert!(!attempt["error"].as_str().unwrap().is_empty());
    }
    assert!(!detail.to_string().contains(password), "{detail}");
    let listed = op(&app, Method::GET, "/dead-letters?queue=chores", None).await.expect(StatusCode::OK);
    assert_eq!(listed["items"][0]["failure_stage"], "dispatch");
    assert_eq!(listed["items"][0]["attempts"], 2);
}

#[tokio::test]
async fn a_discarded_dead_letters_stale_delivery_does_not_commit_its_handlers_writes() {
    use fred::prelude::StreamsInterface;
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    let redis = common::redis_url();
    let healed = Arc::new(AtomicBool::new(false));
    let dispatcher = common::test_dispatcher(&app, &redis, |_| {}).await;
    let consumer = Consumer::connect(&redis, &app.redis_prefix).await.unwrap();
    let worker = conveyor_jobs::Worker::builder(app.db.pool.clone(), consumer)
        .runtime_pool(app.db.runtime_pool.clone())
        .handle::<Chore>(Chores { healed: healed.clone() })
        .build()
        .unwrap();
    let client = common::redis_client(&redis).await;
    let stream = conveyor_jobs::RedisKeys::new(&app.redis_prefix).stream(Chore::QUEUE);

    // A job that writes in its own transaction once healed; its first run fails for good.
    let job = enqueue(&app, ws, "write", EnqueueOptions::new().max_attempts(1)).await;
    dispatcher.dispatch_once().await.unwrap();
    let entries: Vec<(String, HashMap<String, String>)> = client.xrange(&stream, "-", "+", None).await.unwrap();
    assert_eq!(entries.len(), 1, "the job's one delivery");
    assert_eq!(worker.process_one().await.unwrap(), Some(conveyor_jobs::Outcome::DeadLettered));
    // Its delivery again, as a worker that died between the dead letter's commit and its XACK leaves it for another
    // to claim.
    let fields: Vec<(String, String)> = entries[0].1.clone().into_iter().collect();
    let _: String = client.xadd(&stream, false, None, "*", fields).await.unwrap();

    // The operator discards the dead letter: gone from every read.
    op(&app, Method::DELETE, &format!("/dead-letters/{job}"), None).await.expect(StatusCode::NO_CONTENT);
    op(&app, Method::GET, &format!("/jobs/{job}"), None).await.problem(StatusCode::NOT_FOUND);
    assert!(conveyor_jobs::get_job(&app.db.pool, ws, job).await.unwrap().is_none());
    op(&app, Method::POST, &format!("/jobs/{job}/cancel"), None).await.problem(StatusCode::NOT_FOUND);
    op(&app, Method::DELETE, &format!("/dead-letters/{job}"), None).await.problem(StatusCode::NOT_FOUND);

    // The lingering delivery, now that the handler would succeed: skipped, and nothing it would write is committed.
    healed.store(true, Ordering::SeqCst);
    assert_eq!(worker.process_one().await.unwrap(), Some(conveyor_jobs::Outcome::Skipped));
    assert_eq!(worker.process_one().await.unwrap(), None, "nothing else to run");
    assert_eq!(app.db.count("operations", ws).await, 0, "the handler's writes were not committed");
    let mut owner = app.db.owner().await;
    let (status, payload): (String, Value) =
        sqlx::query_as("SELECT status, event_payload FROM conveyor.outbox_events WHERE id = $1")
            .bind(job.0)
            .fetch_one(&mut owner)
            .await
            .unwrap();
    assert_eq!((status.as_str(), payload), ("discarded", json!({})), "a tombstone, its payload dropped");

    // Retention purges tombstones like ended jobs.
    let purged = conveyor_jobs::purge_finished_jobs(&app.db.runtime_pool, Duration::ZERO, 100, 10).await.unwrap();
    assert_eq!(purged, 1);
    let (left,): (i64,) =
        sqlx::query_as("SELECT count(*) FROM conveyor.outbox_events").fetch_one(&mut owner).await.unwrap();
    assert_eq!(left, 0);
}

#[tokio::test]
async fn run_now_of_a_job_held_by_a_pause_or_a_blocked_key_says_so_and_changes_nothing() {
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    let later = || EnqueueOptions::new().delay(Duration::from_secs(3600));
    let paused = enqueue(&app, ws, "ok", later()).await;
    let keyed = enqueue(&app, ws, "ok", later().limit_key("store:1")).await;

    // A pause of its kind in its workspace holds the first.
    op(&app, Method::POST, "/pauses", Some(json!({ "kind": Chore::KIND, "workspace": ws.0 })))
        .await
        .expect(StatusCode::CREATED);
    let held = op(&app, Method::POST, &format!("/jobs/{paused}/retry"), None).await.problem(StatusCode::CONFLICT);
    assert_eq!(held["code"], "JOB_HELD");
    assert!(held["detail"].as_str().unwrap().contains(&format!("a pause of kind {}", Chore::KIND)), "{held}");
    assert_eq!(conveyor_jobs::get_job(&app.db.pool, ws, paused).await.unwrap().unwrap().status, JobStatus::Scheduled);
    op(&app, Method::DELETE, &format!("/pauses?kind={}&workspace={}", Chore::KIND, ws.0), None)
        .await
        .expect(StatusCode::NO_CONTENT);

    // A rate limit blocked the second's key for ten minutes (what a 429 with Retry-After does).
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
    sqlx::query(
        "INSERT INTO conveyor.job_key_limits (key, blocked_until, block_reason)
         VALUES ('store:1', now() + interval '10 minutes', 'HTTP 429')",
    )
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let held = op(&app, Method::POST, &format!("/jobs/{keyed}/retry"), None).await.problem(StatusCode::CONFLICT);
    assert_eq!(held["code"], "JOB_HELD");
    assert!(held["detail"].as_str().unwrap().contains("its limit key store:1 is blocked until"), "{held}");
    assert_eq!(conveyor_jobs::get_job(&app.db.pool, ws, keyed).await.unwrap().unwrap().status, JobStatus::Scheduled);
    let trail = op(&app, Method::GET, "/audit?limit=20", None).await.expect(StatusCode::OK);
    let refused = trail["items"].as_array().unwrap().iter().find(|e| e["action"] == "retry_job").unwrap();
    assert!(refused["arguments"]["outcome"]["held"].as_str().unwrap().contains("store:1"), "{refused}");

    // With the pause lifted, the first runs now.
    let done = op(&app, Method::POST, &format!("/jobs/{paused}/retry"), None).await.expect(StatusCode::OK);
    assert_eq!(done["outcome"], "retried");
    assert_eq!(conveyor_jobs::get_job(&app.db.pool, ws, paused).await.unwrap().unwrap().status, JobStatus::Queued);
}

#[tokio::test]
async fn the_operators_outbox_indexes_are_built_concurrently_one_per_migration_outside_a_transaction() {
    // From the operator's migration on, an index on the outbox is built CONCURRENTLY (a plain CREATE INDEX holds off
    // every write of the release still running while it scans the table), alone in a `-- no-transaction` file
    // (PostgreSQL refuses it in a transaction, and a file of several statements runs as one).
    let mut built = Vec::new();
    for migration in conveyor_jobs::migrator().iter().filter(|m| m.version >= 25) {
        let sql = migration.sql.as_str();
        // Statements without their comments (0025's functions hold semicolons too: enough to count more than one).
        let statements: Vec<String> = sql
            .split(';')
            .map(|s| s.lines().filter(|l| !l.trim_start().starts_with("--")).collect::<Vec<_>>().join(" "))
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty())
            .collect();
        for statement in
            statements.iter().filter(|s| s.contains("CREATE INDEX") && s.contains(" ON conveyor.outbox_events "))
        {
            let v = migration.version;
            assert!(statement.contains("CREATE INDEX CONCURRENTLY IF NOT EXISTS"), "{v}: {statement}");
            assert!(migration.no_tx, "{v} builds an outbox index in a transaction");
            assert_eq!(statements.len(), 1, "{v}: a concurrent build alone in its file");
            built.push(v);
        }
    }
    assert_eq!(built, [27, 28, 31, 40, 49, 50, 51, 52, 57, 65, 72]);
    // Applied by `conveyor migrate`, they are there and valid.
    let app = TestApp::spawn().await;
    let mut owner = app.db.owner().await;
    let indexes: Vec<(String, bool)> = sqlx::query_as(
        "SELECT c.relname::text, i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
         WHERE i.indrelid = 'conveyor.outbox_events'::regclass
           AND c.relname IN ('outbox_events_completed_at', 'outbox_events_dead_by_id', 'outbox_events_delayed',
                             'outbox_events_due_by_queue', 'outbox_events_next_due', 'outbox_events_expiring',
                             'outbox_events_expired')
         ORDER BY 1",
    )
    .fetch_all(&mut owner)
    .await
    .unwrap();
    // 0032 dropped the index of every pending job in due order (concurrently too), which 0031's replaced.
    assert_eq!(
        indexes,
        [
            ("outbox_events_completed_at".to_owned(), true),
            ("outbox_events_dead_by_id".to_owned(), true),
            ("outbox_events_delayed".to_owned(), true),
            ("outbox_events_due_by_queue".to_owned(), true),
            ("outbox_events_expired".to_owned(), true),
            ("outbox_events_expiring".to_owned(), true)
        ]
    );
}

/// Every route of the admin API (as `src/http/admin_api.rs` mounts them), with a method it answers.
const ADMIN_ROUTES: &[(&str, &str)] = &[
    ("GET", "/queues"),
    ("GET", "/queues/q"),
    ("GET", "/queues/q/minutes"),
    ("GET", "/jobs"),
    ("GET", "/jobs/00000000-0000-0000-0000-000000000001"),
    ("POST", "/jobs/00000000-0000-0000-0000-000000000001/cancel"),
    ("POST", "/jobs/00000000-0000-0000-0000-000000000001/retry"),
    ("POST", "/jobs/00000000-0000-0000-0000-000000000001/change"),
    ("POST", "/queues/q/drain"),
    ("POST", "/queues/q/clean"),
    ("POST", "/queues/q/obliterate"),
    ("GET", "/consumers"),
    ("GET", "/operations"),
    ("GET", "/dead-letters"),
    ("POST", "/dead-letters/replay"),
    ("POST", "/dead-letters/discard"),
    ("DELETE", "/dead-letters/00000000-0000-0000-0000-000000000001"),
    ("POST", "/dead-letters/00000000-0000-0000-0000-000000000001/replay"),
    ("GET", "/pauses"),
    ("POST", "/pauses"),
    ("DELETE", "/pauses"),
    ("GET", "/global-limits"),
    ("PUT", "/global-limits/queue/q"),
    ("DELETE", "/global-limits/queue/q"),
    ("GET", "/fairness"),
    ("PUT", "/workspaces/00000000-0000-0000-0000-000000000001/weight"),
    ("PUT", "/workspaces/00000000-0000-0000-0000-000000000001/key-limits/k"),
    ("DELETE", "/workspaces/00000000-0000-0000-0000-000000000001/key-limits/k"),
    ("PUT", "/workspaces/00000000-0000-0000-0000-000000000001/kind-limits/k"),
    ("DELETE", "/workspaces/00000000-0000-0000-0000-000000000001/kind-limits/k"),
    ("GET", "/schedules"),
    ("POST", "/schedules/00000000-0000-0000-0000-000000000001/s/pause"),
    ("POST", "/schedules/00000000-0000-0000-0000-000000000001/s/resume"),
    ("GET", "/workspaces/00000000-0000-0000-0000-000000000001/events"),
    ("GET", "/audit"),
];

#[tokio::test]
async fn tenant_tokens_and_operator_jwts_signed_with_the_tenant_key_get_401_on_every_admin_route() {
    let app = TestApp::spawn().await;
    let router_source = include_str!("../../../src/console/api/mod.rs");
    assert_eq!(
        router_source.matches(".route(\"").count(),
        ADMIN_ROUTES.iter().map(|(_, path)| *path).collect::<std::collections::BTreeSet<_>>().len(),
        "ADMIN_ROUTES lists every route the admin API mounts"
    );
    let forged = jwt_signed_with(common::JWT_SECRET, "eve", json!({ "operator": true }));
    let tenant = app.token(common::principal());
    let genuine = operator_jwt("alice");
    for (method, path) in ADMIN_ROUTES {
        let method: Method = method.parse().unwrap();
        for (what, credential) in [("forged operator JWT", &forged), ("tenant token", &tenant)] {
            let response = call(&app, method.clone(), path, Some(credential), Some(json!({}))).await;
            assert_eq!(response.status, 401, "{what} on {method} {path}");
        }
        // The operator's own key passes the gate (whatever the route then answers of a made-up id).
        let response = call(&app, method.clone(), path, Some(&genuine), Some(json!({}))).await;
        assert_ne!(response.status, 401, "operator JWT on {method} {path}");
    }
}

#[tokio::test]
async fn dead_letters_past_their_retention_are_discarded_by_maintenance_never_younger_and_on_the_audit_trail() {
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    let healed = Arc::new(AtomicBool::new(false));
    let platform = Platform::start(&app, &healed).await;
    let mut dead = Vec::new();
    for _ in 0..3 {
        let job = enqueue(&app, ws, "heal", EnqueueOptions::new()).await;
        ended(&app, ws, job).await;
        dead.push(job);
    }
    platform.stop().await;
    // Dead-lettered 40 days ago, 10 days ago, and now; `conveyor migrate` recorded the default, 30 days.
    let mut owner = app.db.owner().await;
    // Writes are walled off by workspace even for the owner.
    sqlx::query("SELECT set_config('app.workspace_id', $1, false)")
        .bind(ws.0.to_string())
        .execute(&mut owner)
        .await
        .unwrap();
    for (job, days) in [(dead[0], 40), (dead[1], 10)] {
        sqlx::query(
            "UPDATE conveyor.outbox_events SET dead_lettered_at = now() - make_interval(days => $2) WHERE id = $1",
        )
        .bind(job.0)
        .bind(days)
        .execute(&mut owner)
        .await
        .unwrap();
    }
    let status = async |job: JobId| -> String {
        let mut owner = app.db.owner().await;
        sqlx::query_scalar("SELECT status FROM conveyor.outbox_events WHERE id = $1")
            .bind(job.0)
            .fetch_one(&mut owner)
            .await
            .unwrap()
    };
    let redis = common::redis_client(&common::redis_url()).await;
    let maintenance = |retention: Duration| {
        conveyor_jobs::Maintenance::new(
            app.db.runtime_pool.clone(),
            redis.clone(),
            conveyor_jobs::RedisKeys::new(&app.redis_prefix),
            conveyor_jobs::Metrics::new(),
            Duration::from_secs(1),
            Duration::from_secs(7 * 86400),
            Duration::from_secs(3600),
        )
        .with_dead_letter_retention(retention)
    };
    // A maintenance process told one day keeps what the floor keeps: only the 40-day-old one goes.
    let report = maintenance(Duration::from_secs(86400)).run_once().await.unwrap();
    assert_eq!(report.dead_letters_purged, 1);
    assert_eq!(status(dead[0]).await, "discarded");
    assert_eq!((status(dead[1]).await, status(dead[2]).await), ("dead_letter".into(), "dead_letter".into()));
    let failures: i64 = sqlx::query_scalar("SELECT count(*) FROM conveyor.job_failures WHERE job_id = $1")
        .bind(dead[0].0)
        .fetch_one(&mut owner)
        .await
        .unwrap();
    assert_eq!(failures, 0, "its recorded failures went with it");
    let (actor, arguments): (String, Value) = sqlx::query_as(
        "SELECT actor, arguments FROM conveyor.conveyor_admin_audit WHERE action = 'dead_letter_purge' ORDER BY id DESC LIMIT 1",
    )
    .fetch_one(&mut owner)
    .await
    .unwrap();
    assert_eq!((actor.as_str(), &arguments["discarded"]), ("maintenance", &json!(1)));
    assert_eq!(arguments["kept"], "30 days");
    // A longer retention keeps more; less than a day is refused by the database itself.
    assert_eq!(maintenance(Duration::from_secs(90 * 86400)).run_once().await.unwrap().dead_letters_purged, 0);
    let refused = sqlx::query("SELECT conveyor.conveyor_dead_letter_purge('1 hour', 100)")
        .execute(&app.db.runtime_pool)
        .await
        .unwrap_err();
    assert_eq!(code(&refused), "22023");
    // The application role may not purge at all.
    let refused = sqlx::query("SELECT conveyor.conveyor_dead_letter_purge('40 days', 100)")
        .execute(&app.db.pool)
        .await
        .unwrap_err();
    assert_eq!(code(&refused), "42501");
}

#[tokio::test]
async fn a_jobs_detail_shows_its_flow_its_parent_and_its_children_on_the_api_and_the_ui() {
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    let chore = |mode: &str| Chore { mode: mode.into() };
    let flow = conveyor_jobs::Flow::job(&chore("ok"), EnqueueOptions::new())
        .unwrap()
        .child(conveyor_jobs::Flow::job(&chore("ok"), EnqueueOptions::new().delay(Duration::from_secs(3600))).unwrap())
        .child_on_failure(
            conveyor_jobs::Flow::job(&chore("ok"), EnqueueOptions::new()).unwrap(),
            conveyor_jobs::ChildFailure::Ignore,
        );
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
    let ids = conveyor_jobs::enqueue_flow_tx(&mut tx, flow).await.unwrap();
    tx.commit().await.unwrap();

    let parent = op(&app, Method::GET, &format!("/jobs/{}", ids.id), None).await.expect(StatusCode::OK);
    assert_eq!((parent["status"].as_str(), parent["children_left"].as_u64()), (Some("waiting_children"), Some(2)));
    assert!(parent["parent"].is_null());
    let children = parent["children"].as_array().unwrap();
    let listed: Vec<(&str, &str, &str)> = children
        .iter()
        .map(|c| (c["id"].as_str().unwrap(), c["status"].as_str().unwrap(), c["on_failure"].as_str().unwrap()))
        .collect();
    let (first, second) = (ids.children[0].id.0.to_string(), ids.children[1].id.0.to_string());
    assert_eq!(listed, [(first.as_str(), "scheduled", "fail"), (second.as_str(), "queued", "ignore")]);
    let child = op(&app, Method::GET, &format!("/jobs/{second}"), None).await.expect(StatusCode::OK);
    assert_eq!(child["parent"]["id"].as_str(), Some(ids.id.0.to_string().as_str()));
    assert_eq!(child["parent"]["on_failure"], "ignore");
    assert_eq!(child["children"], json!([]));
    // A waiting parent is found by its state; it is not counted as scheduled.
    let waiting = op(&app, Method::GET, "/jobs?status=waiting_children", None).await.expect(StatusCode::OK);
    let found: Vec<&str> = waiting["items"].as_array().unwrap().iter().map(|j| j["id"].as_str().unwrap()).collect();
    assert_eq!(found, [ids.id.0.to_string()]);
    let scheduled = op(&app, Method::GET, "/jobs?status=scheduled", None).await.expect(StatusCode::OK);
    let found: Vec<&str> = scheduled["items"].as_array().unwrap().iter().map(|j| j["id"].as_str().unwrap()).collect();
    assert_eq!(found, [first.as_str()]);
    // Its queue counts it apart: not delayed, not queued.
    let queue = op(&app, Method::GET, "/queues/chores", None).await.expect(StatusCode::OK);
    let counts = &queue["counts"];
    assert_eq!((counts["waiting_children"].as_u64(), counts["delayed"].as_u64()), (Some(1), Some(1)), "{queue}");
    assert_eq!(counts["queued"].as_u64(), Some(1), "{queue}");
    // The CLI's `jobs show` prints the same.
    let shown: Value = serde_json::from_str(&cli(&app, "jobs", &["show", &ids.id.0.to_string()]).unwrap()).unwrap();
    assert_eq!((shown["status"].clone(), shown["children"].as_array().unwrap().len()), (json!("waiting_children"), 2));
}

#[tokio::test]
async fn a_queues_last_hour_is_recorded_by_maintenance_and_drawn_on_its_page() {
    let app = TestApp::spawn().await;
    let (a, b) = (principal().workspace_id, principal().workspace_id);
    let redis = common::redis_client(&common::redis_url()).await;
    let maintenance = conveyor_jobs::Maintenance::new(
        app.db.runtime_pool.clone(),
        redis,
        conveyor_jobs::RedisKeys::new(&app.redis_prefix),
        conveyor_jobs::Metrics::new(),
        Duration::from_secs(1),
        Duration::from_secs(7 * 86400),
        Duration::from_secs(3600),
    );
    // A queue nobody knows (no job, no kind, nothing recorded): 404, as for its summary.
    op(&app, Method::GET, "/queues/chores/minutes", None).await.expect(StatusCode::NOT_FOUND);

    // Three jobs due with no worker. Before maintenance passed: sixty minutes, the current one last, all empty.
    let mut jobs = Vec::new();
    for (ws, mode) in [(a, "ok"), (b, "ok"), (a, "fail")] {
        jobs.push((ws, enqueue(&app, ws, mode, EnqueueOptions::new()).await));
    }
    let minutes = op(&app, Method::GET, "/queues/chores/minutes", None).await.expect(StatusCode::OK);
    let minutes = minutes.as_array().unwrap();
    assert_eq!(minutes.len(), 60);
    assert!(minutes.iter().all(|m| m["done"] == 0 && m["failed"] == 0 && m["backlog"].is_null()), "{minutes:?}");
    // The backlog a pass samples, summed over workspaces.
    maintenance.run_once().await.unwrap();
    let minutes = op(&app, Method::GET, "/queues/chores/minutes", None).await.expect(StatusCode::OK);
    let sampled: Vec<u64> = minutes.as_array().unwrap().iter().filter_map(|m| m["backlog"].as_u64()).collect();
    assert_eq!(sampled, [3], "{minutes}");

    // They run: two done, one failed, each counted once however often maintenance passes.
    let platform = Platform::start(&app, &Arc::new(AtomicBool::new(false))).await;
    for (ws, job) in &jobs {
        ended(&app, *ws, *job).await;
    }
    platform.stop().await;
    maintenance.run_once().await.unwrap();
    maintenance.run_once().await.unwrap();
    let minutes = op(&app, Method::GET, "/queues/chores/minutes", None).await.expect(StatusCode::OK);
    let minutes = minutes.as_array().unwrap();
    let sum = |field: &str| minutes.iter().map(|m| m[field].as_u64().unwrap()).sum::<u64>();
    assert_eq!((sum("done"), sum("failed")), (2, 1), "{minutes:?}");
    assert!(minutes.iter().any(|m| m["wait_p95_ms"].as_f64().is_some_and(|w| w >= 0.0)), "{minutes:?}");

    // The queue's page draws them: the bars of the minutes with ends, each titled with its minute and count.
    let cookie = crate::ui::login(&app, ADMIN_TOKEN).await.expect("a UI session");
    let page = reqwest::Client::new()
        .get(format!("http://{}/ui/queues/chores", app.admin_addr))
        .header("cookie", cookie)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(page.contains(r#"data-chart="throughput""#) && page.contains("<svg"), "{page}");
    assert_eq!(page.matches(r#"<rect class="failed""#).count(), 1, "{page}");
    assert!(page.contains(" done</title>") && page.contains("1 failed</title>"), "{page}");
    assert!(page.contains("max 3 jobs</text>"), "the backlog's scale: {page}");
    // The reads are on the audit trail.
    let trail = op(&app, Method::GET, "/audit?limit=50", None).await.expect(StatusCode::OK);
    assert!(trail["items"].as_array().unwrap().iter().any(|e| e["action"] == "queue_minutes"), "{trail}");
}

#[tokio::test]
async fn a_jobs_deadline_is_shown_by_the_admin_api_and_its_page_and_an_expired_job_says_why_it_ended() {
    let app = TestApp::spawn().await;
    let ws = principal().workspace_id;
    let within = enqueue(&app, ws, "ok", EnqueueOptions::new().start_within(Duration::from_millis(300))).await;
    let without = enqueue(&app, ws, "ok", EnqueueOptions::new()).await;
    let deadline = conveyor_jobs::get_job(&app.db.pool, ws, within).await.unwrap().unwrap().expires_at.unwrap();
    let detail = op(&app, Method::GET, &format!("/jobs/{}", within.0), None).await.expect(StatusCode::OK);
    let shown: chrono::DateTime<chrono::Utc> = serde_json::from_value(detail["expires_at"].clone()).unwrap();
    assert_eq!(shown, deadline, "{detail}");
    let detail = op(&app, Method::GET, &format!("/jobs/{}", without.0), None).await.expect(StatusCode::OK);
    assert!(detail["expires_at"].is_null(), "{detail}");

    // Past it, with nothing to run it: maintenance expires it, and its page says so.
    tokio::time::sleep((deadline - chrono::Utc::now()).to_std().unwrap_or_default() + Duration::from_millis(100)).await;
    let redis = common::redis_client(&common::redis_url()).await;
    let maintenance = conveyor_jobs::Maintenance::new(
        app.db.runtime_pool.clone(),
        redis,
        conveyor_jobs::RedisKeys::new(&app.redis_prefix),
        conveyor_jobs::Metrics::new(),
        Duration::from_secs(1),
        Duration::from_secs(7 * 86400),
        Duration::from_secs(3600),
    );
    assert_eq!(maintenance.run_once().await.unwrap().expired, 1);
    let cookie = crate::ui::login(&app, ADMIN_TOKEN).await.expect("a UI session");
    let page = reqwest::Client::new()
        .get(format!("http://{}/ui/jobs/{}", app.admin_addr, within.0))
        .header("cookie", cookie.clone())
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(page.contains(r#"data-status="canceled""#), "{page}");
    assert!(page.contains("expired: not started by its deadline"), "{page}");
    let row = page.split(r#"id="deadline""#).nth(1).expect("a deadline row");
    let shown = format!(r#"><time datetime="{}">"#, deadline.to_rfc3339());
    assert!(row.starts_with(&shown), "the deadline is shown: {row:.120}");

    // The queue's minutes count the expiry, and not a job with a deadline that an operator canceled.
    let kept = enqueue(&app, ws, "ok", EnqueueOptions::new().start_within(Duration::from_secs(3600))).await;
    op(&app, Method::POST, &format!("/jobs/{}/cancel", kept.0), None).await.expect(StatusCode::OK);
    maintenance.run_once().await.unwrap();
    let minutes = op(&app, Method::GET, "/queues/chores/minutes", None).await.expect(StatusCode::OK);
    let minutes = minutes.as_array().unwrap();
    let sum = |field: &str| minutes.iter().map(|m| m[field].as_u64().unwrap()).sum::<u64>();
    assert_eq!((sum("expired"), sum("done"), sum("failed")), (1, 0, 0), "{minutes:?}");
    let ui = |path: &'static str| {
        let cookie = cookie.clone();
        let url = format!("http://{}{path}", app.admin_addr);
        async move {
            let page = reqwest::Client::new().get(url).header("cookie", cookie).send().await.unwrap();
            page.text().await.unwrap()
        }
    };
    let queue = ui("/ui/queues/chores").await;
    assert_eq!(queue.matches(r#"<rect class="expired""#).count(), 1, "{queue}");
    assert!(queue.contains("1 expired</title>"), "{queue}");
    let overview = ui("/ui").await;
    assert!(overview.contains("0 done, 0 failed, 1 expired, busiest minute 1"), "{overview}");
}

/// A followed event stream of the admin API (Server-Sent Events), read frame by frame.
struct Followed {
    response: reqwest::Response,
    buffer: String,
}

/// One frame: its `event`, `id` and `data` fields (a comment frame has none).
#[derive(Debug)]
struct Frame {
    event: Option<String>,
    id: Option<String>,
    data: Value,
}

impl Followed {
    async fn open(app: &TestApp, path: &str, last_event: Option<&str>) -> Result<Self, Response> {
        let url = format!("http://{}/admin/v1{path}", app.admin_addr);
        let mut request = app.http.get(url).bearer_auth(ADMIN_TOKEN);
        if let Some(id) = last_event {
            request = request.header("last-event-id", id);
        }
        let response = request.send().await.unwrap();
        if response.status() != StatusCode::OK {
            let (status, headers) = (response.status(), response.headers().clone());
            let json = serde_json::from_str(&response.text().await.unwrap()).unwrap_or(Value::Null);
            return Err(Response { status, headers, json });
        }
        assert_eq!(response.headers()["content-type"], "text/event-stream");
        Ok(Self { response, buffer: String::new() })
    }

    /// The next frame that carries an event (comments skipped), within a minute.
    async fn next(&mut self) -> Frame {
        loop {
            if let Some(end) = self.buffer.find("\n\n") {
                let frame: String = self.buffer.drain(..end + 2).collect();
                let field =
                    |name: &str| frame.lines().find_map(|l| l.strip_prefix(name).map(|v| v.trim_start().to_owned()));
                let Some(event) = field("event:") else { continue };
                let data = field("data:").map(|d| serde_json::from_str(&d).unwrap_or(Value::String(d)));
                return Frame { event: Some(event), id: field("id:"), data: data.unwrap_or(Value::Null) };
            }
            let chunk = tokio::time::timeout(Duration::from_secs(60), self.response.chunk())
                .await
                .expect("an event within a minute")
                .unwrap()
                .expect("the stream stays open");
            self.buffer.push_str(std::str::from_utf8(&chunk).unwrap());
        }
    }
}

#[tokio::test]
async fn an_operator_reads_and_follows_a_workspaces_job_events_resumes_them_and_is_audited() {
    let app = TestApp::spawn().await;
    let healed = Arc::new(AtomicBool::new(false));
    let ws = principal().workspace_id;
    let path = |query: &str| format!("/workspaces/{ws}/events?{query}");
    let mut follow = Followed::open(&app, &path("follow=true&event=retrying,failed,completed"), None).await.unwrap();
    let platform = Platform::start(&app, &healed).await;

    // A job that fails every run: two retries, then a dead letter; and one that succeeds, of another workspace.
    let flaky = enqueue(&app, ws, "flaky", EnqueueOptions::new()).await;
    let other = principal().workspace_id;
    let elsewhere = enqueue(&app, other, "ok", EnqueueOptions::new()).await;
    let mut frames = Vec::new();
    while frames.last().is_none_or(|f: &Frame| f.event.as_deref() != Some("failed")) {
        frames.push(follow.next().await);
    }
    let names: Vec<&str> = frames.iter().map(|f| f.event.as_deref().unwrap()).collect();
    assert_eq!(names, ["retrying", "retrying", "failed"], "{frames:?}");
    for frame in &frames {
        assert_eq!(frame.data["job"]["id"], json!(flaky.0), "only its workspace's jobs: {frame:?}");
        assert_eq!(frame.data["event"], json!(frame.event), "{frame:?}");
    }
    assert_eq!(frames[0].data["attempt"], 1);
    let error = frames[0].data["error"].as_str().unwrap();
    assert!(error.contains("could not reach") && !error.contains("hunter2"), "redacted: {error}");
    ended(&app, other, elsewhere).await;

    // The same events, read as recorded: in one page, or a page of one at a time, each naming where the next starts.
    let read = op(&app, Method::GET, &path(&format!("job={}", flaky.0)), None).await.expect(StatusCode::OK);
    let names: Vec<&str> = read["items"].as_array().unwrap().iter().map(|e| e["event"].as_str().unwrap()).collect();
    assert_eq!((names.as_slice(), &read["next"]), (["retrying", "retrying", "failed"].as_slice(), &Value::Null));
    let (mut paged, mut after) = (Vec::new(), String::new());
    loop {
        let query = format!("job={}&limit=1{after}", flaky.0);
        let page = op(&app, Method::GET, &path(&query), None).await.expect(StatusCode::OK);
        paged.extend(page["items"].as_array().unwrap().iter().map(|e| (e["event"].clone(), e["at"].clone())));
        match page["next"].as_str() {
            Some(next) => after = format!("&after={}", urlencode(next)),
            None => break,
        }
    }
    let whole: Vec<(Value, Value)> =
        read["items"].as_array().unwrap().iter().map(|e| (e["event"].clone(), e["at"].clone())).collect();
    assert_eq!(paged, whole, "pages of one hold each event once, in order");

    // A client that reconnects with the last id it had hears again from that event on (at least once), even where
    // its address says `since`.
    let resumed = frames[1].id.clone().expect("each event has an id");
    let from_start = path("follow=true&event=retrying,failed&since=2000-01-01T00:00:00Z");
    let mut again = Followed::open(&app, &from_start, Some(&resumed)).await.unwrap();
    let (first, second) = (again.next().await, again.next().await);
    assert_eq!((first.id.as_deref(), first.event.as_deref()), (Some(resumed.as_str()), Some("retrying")));
    assert_eq!(second.event.as_deref(), Some("failed"));

    // Bad parameters are refused by name; past four follows at once, a fifth waits its turn.
    let bad = op(&app, Method::GET, &path("event=exploded"), None).await.problem(StatusCode::BAD_REQUEST);
    assert_eq!(bad["parameter"], "event");
    let bad = op(&app, Method::GET, &path("follow=maybe"), None).await.problem(StatusCode::BAD_REQUEST);
    assert_eq!(bad["parameter"], "follow");
    let bad = op(&app, Method::GET, &path("after=yesterday"), None).await.problem(StatusCode::BAD_REQUEST);
    assert_eq!(bad["parameter"], "after");
    let bad = op(&app, Method::GET, &path("follow=true&limit=5"), None).await.problem(StatusCode::BAD_REQUEST);
    assert_eq!(bad["parameter"], "limit");
    let bad = Followed::open(&app, &path("follow=true"), Some("not a time")).await.err().unwrap();
    assert_eq!(bad.problem(StatusCode::BAD_REQUEST)["parameter"], "Last-Event-ID");
    let mut open = vec![follow, again];
    for _ in 0..2 {
        open.push(Followed::open(&app, &path("follow=true"), None).await.unwrap());
    }
    let busy = Followed::open(&app, &path("follow=true"), None).await.err().expect("a fifth follow is refused");
    assert_eq!(busy.headers["retry-after"], "5");
    assert_eq!(busy.problem(StatusCode::SERVICE_UNAVAILABLE)["code"], "TOO_MANY_FOLLOWERS");
    drop(open.pop());
    let freed = common::eventually(Duration::from_secs(10), || async {
        Followed::open(&app, &path("follow=true"), None).await.ok()
    })
    .await;
    assert!(freed.is_some(), "a closed follow frees its place");

    // Each read and each follow is on the audit trail, naming the workspace.
    let mut owner = app.db.owner().await;
    let audited: Vec<(String, Value)> = sqlx::query_as(
        "SELECT action, arguments FROM conveyor.conveyor_admin_audit
         WHERE action IN ('job_events', 'follow_job_events') ORDER BY id",
    )
    .fetch_all(&mut owner)
    .await
    .unwrap();
    let actions: Vec<&str> = audited.iter().map(|(a, _)| a.as_str()).collect();
    // The first follow, the whole read and three pages of one, then four more follows (refusals are not audited).
    let expected = [&["follow_job_events"][..], &["job_events"; 4], &["follow_job_events"; 4]].concat();
    assert_eq!(actions, expected, "{audited:?}");
    assert!(audited.iter().all(|(_, args)| args["workspace"] == json!(ws.0)), "{audited:?}");
    platform.stop().await;

    // The host's shutdown ends every followed stream (its graceful shutdown waits for their connections).
    let mut last = freed.unwrap();
    app.shutdown.cancel();
    let end = last.next().await;
    assert_eq!(end.event.as_deref(), Some("end"), "{end:?}");
    let closed = tokio::time::timeout(Duration::from_secs(10), last.response.chunk()).await.expect("it closes");
    assert!(closed.unwrap().is_none(), "the stream ended");
}

/// A cursor or time as a query value.
fn urlencode(raw: &str) -> String {
    raw.replace('+', "%2B").replace(':', "%3A")
}
