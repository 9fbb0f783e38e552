//! The operator web UI (`/ui/` on the admin listener): sessions, CSRF, origin checks and headers over plain HTTP, and
//! the issue's scenario in a real headless Chromium (Debian `chromium` + `chromedriver`, driven over WebDriver):
//! log in, see a queue's counts, open a dead letter, replay it, see it succeed.
//!
//! Jobs run for real: a dispatcher and a worker over the test's database and Redis prefix, with a kind whose handler
//! fails permanently until the test flips a flag.

use crate::common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::{ADMIN_TOKEN, TestApp, eventually};
use conveyor_jobs::{EnqueueOptions, Handler, JobContext, JobError, JobId, JobKind, JobStatus, Worker, WorkspaceId};
use fantoccini::Locator;
use reqwest::StatusCode;
use reqwest::header::{HeaderMap, LOCATION, SET_COOKIE};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// The demo kind: fails for good while `wait_for_flag` is set and the flag is down.
#[derive(Serialize, Deserialize)]
struct Flaky {
    wait_for_flag: bool,
}

impl JobKind for Flaky {
    const KIND: &'static str = "ui_demo.flaky";
    const QUEUE: &'static str = "ui-demo";
    const MAX_ATTEMPTS: u32 = 3;
}

/// The error a failing run gives: markup (must show escaped) and a credential in a URL (must show redacted).
const FAILURE: &str = "marketplace refused <em>shop</em> at https://ops:hunter2@shop.example/api";

struct FlakyHandler {
    succeed: Arc<AtomicBool>,
}

impl Handler<Flaky> for FlakyHandler {
    async fn handle(&self, job: Flaky, cx: &mut JobContext) -> Result<Value, JobError> {
        if job.wait_for_flag && !self.succeed.load(Ordering::SeqCst) {
            // Its log says the same, and the job page shows it escaped and redacted too.
            cx.log(FAILURE).await;
            return Err(JobError::permanent(FAILURE));
        }
        Ok(json!({ "delivered": true }))
    }
}

/// A running app with a dispatcher and a worker, and jobs in every interesting state of queue `ui-demo`.
struct Scenario {
    app: TestApp,
    workspace: WorkspaceId,
    /// The handler succeeds once this is set.
    succeed: Arc<AtomicBool>,
    /// Dead-lettered (until replayed with the flag up).
    dead: JobId,
    /// Due tomorrow.
    delayed: JobId,
    shutdown: CancellationToken,
}

impl Scenario {
    async fn start() -> Self {
        let app = TestApp::spawn().await;
        let shutdown = CancellationToken::new();
        let dispatcher = common::test_dispatcher(&app, &common::redis_url(), |_| {}).await;
        common::run_dispatcher(dispatcher, &shutdown);
        let succeed = Arc::new(AtomicBool::new(false));
        let consumer = conveyor_jobs::Consumer::connect(&common::redis_url(), &app.redis_prefix).await.unwrap();
        let worker = Worker::builder(app.db.pool.clone(), consumer)
            .runtime_pool(app.db.runtime_pool.clone())
            .handle::<Flaky>(FlakyHandler { succeed: succeed.clone() })
            .build()
            .unwrap();
        tokio::spawn(worker.run(shutdown.clone(), Duration::from_secs(5)));

        let workspace = WorkspaceId(Uuid::new_v4());
        let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, workspace).await.unwrap();
        let mut fine = Vec::new();
        for _ in 0..2 {
            fine.push(
                conveyor_jobs::enqueue_tx(&mut tx, &Flaky { wait_for_flag: false }, EnqueueOptions::new())
                    .await
                    .unwrap(),
            );
        }
        let dead =
            conveyor_jobs::enqueue_tx(&mut tx, &Flaky { wait_for_flag: true }, EnqueueOptions::new()).await.unwrap();
        let later = EnqueueOptions::new().delay(Duration::from_secs(86_400));
        let delayed = conveyor_jobs::enqueue_tx(&mut tx, &Flaky { wait_for_flag: false }, later).await.unwrap();
        tx.commit().await.unwrap();
        for job in &fine {
            let done =
                conveyor_jobs::wait_for_job(&app.db.pool, workspace, job.id, Duration::from_secs(30)).await.unwrap();
            assert_eq!(done.status, JobStatus::Succeeded);
        }
        let failed =
            conveyor_jobs::wait_for_job(&app.db.pool, workspace, dead.id, Duration::from_secs(30)).await.unwrap();
        assert_eq!(failed.status, JobStatus::Failed, "the flaky job dead-letters");
        Self { app, workspace, succeed, dead: dead.id, delayed: delayed.id, shutdown }
    }

    async fn status(&self, id: JobId) -> JobStatus {
        conveyor_jobs::get_job(&self.app.db.pool, self.workspace, id).await.unwrap().expect("the job exists").status
    }
}

impl Drop for Scenario {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// A client that shows redirects instead of following them.
fn http() -> reqwest::Client {
    reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap()
}

fn ui(app: &TestApp, path: &str) -> String {
    format!("http://{}{path}", app.admin_addr)
}

fn location(headers: &HeaderMap) -> &str {
    headers.get(LOCATION).and_then(|v| v.to_str().ok()).unwrap_or("")
}

/// Logs in with `credential`; the session cookie (`name=value`) on success.
pub(crate) async fn login(app: &TestApp, credential: &str) -> Option<String> {
    let response = http().post(ui(app, "/ui/login")).form(&[("credential", credential)]).send().await.unwrap();
    if response.status() != StatusCode::SEE_OTHER {
        return None;
    }
    let cookie = response.headers().get(SET_COOKIE)?.to_str().ok()?;
    Some(cookie.split(';').next()?.to_owned())
}

/// The CSRF token in a page's forms.
fn csrf_in(html: &str) -> String {
    let at = html.find(r#"name="csrf" value=""#).expect("the page has a form with the CSRF token");
    let rest = &html[at + r#"name="csrf" value=""#.len()..];
    rest[..rest.find('"').unwrap()].to_owned()
}

/// An operator JWT (or, with `operator: false`, a workspace user's) for `sub`, signed with the operator's key.
fn jwt(sub: &str, operator: bool) -> String {
    jwt_signed_with(common::OPERATOR_JWT_SECRET, sub, operator)
}

/// [`jwt`] signed with `secret`.
fn jwt_signed_with(secret: &str, sub: &str, operator: bool) -> String {
    let exp = chrono::Utc::now().timestamp() + 600;
    let key = jsonwebtoken::EncodingKey::from_secret(secret.as_bytes()).unwrap();
    jsonwebtoken::encode(
        &jsonwebtoken::Header::default(),
        &json!({ "sub": sub, "exp": exp, "aud": "conveyor-operator", "operator": operator }),
        &key,
    )
    .unwrap()
}

#[tokio::test]
async fn pages_need_a_session_and_only_operator_credentials_start_one() {
    let app = TestApp::spawn().await;
    let http = http();

    // No session: every page redirects to the login (returning to the page afterwards), a POST as well.
    let home = http.get(ui(&app, "/ui")).send().await.unwrap();
    assert_eq!(home.status(), StatusCode::SEE_OTHER);
    assert_eq!(location(home.headers()), "/ui/login");
    // `/ui/`, the overview's address before, leads to it.
    let slash = http.get(ui(&app, "/ui/")).send().await.unwrap();
    assert_eq!((slash.status(), location(slash.headers())), (StatusCode::PERMANENT_REDIRECT, "/ui"));
    let refreshing = http.get(ui(&app, "/ui/?refresh=5")).send().await.unwrap();
    assert_eq!(location(refreshing.headers()), "/ui?refresh=5", "the query is kept");
    let page = http.get(ui(&app, "/ui/dead-letters?queue=a")).send().await.unwrap();
    assert_eq!(page.status(), StatusCode::SEE_OTHER);
    assert_eq!(location(page.headers()), "/ui/login?next=%2Fui%2Fdead-letters%3Fqueue%3Da");
    let post = http.post(ui(&app, "/ui/dead-letters/discard")).form(&[("queue", "a")]).send().await.unwrap();
    assert_eq!(post.status(), StatusCode::SEE_OTHER);
    assert_eq!(location(post.headers()), "/ui/login");
    assert_eq!(http.get(ui(&app, "/ui")).send().await.unwrap().status(), StatusCode::SEE_OTHER);

    // The login form, with the security headers every UI page carries.
    let form = http.get(ui(&app, "/ui/login")).send().await.unwrap();
    assert_eq!(form.status(), StatusCode::OK);
    let headers = form.headers().clone();
    let csp = headers["content-security-policy"].to_str().unwrap();
    assert!(csp.starts_with("default-src 'self'") && csp.contains("script-src 'none'"), "{csp}");
    assert!(csp.contains("frame-ancestors 'none'") && csp.contains("form-action 'self'"), "{csp}");
    assert_eq!(headers["x-frame-options"], "DENY");
    assert_eq!(headers["referrer-policy"], "same-origin");
    assert_eq!(headers["cache-control"], "no-store");
    assert!(form.text().await.unwrap().contains(r#"<form method="post" action="/ui/login">"#));

    // A wrong token, a workspace user's JWT, a JWT without the operator claim and an operator's JWT signed with the
    // workspace tokens' key: the form again, 401, no cookie.
    let user = app.token(common::principal());
    let forged = jwt_signed_with(common::JWT_SECRET, "eve", true);
    for wrong in [format!("{ADMIN_TOKEN}x"), String::new(), user, jwt("bob", false), forged] {
        let response = http.post(ui(&app, "/ui/login")).form(&[("credential", wrong.as_str())]).send().await.unwrap();
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
        assert!(response.headers().get(SET_COOKIE).is_none());
        assert!(response.text().await.unwrap().contains("neither the operator token nor an operator JWT"));
    }

    // The operator token: a session cookie that names the actor, never the token, HttpOnly, SameSite=Strict, /ui.
    let response = http
        .post(ui(&app, "/ui/login"))
        .form(&[("credential", ADMIN_TOKEN), ("next", "/ui/jobs?kind=x")])
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::SEE_OTHER);
    assert_eq!(location(response.headers()), "/ui/jobs?kind=x");
    let set_cookie = response.headers()[SET_COOKIE].to_str().unwrap().to_owned();
    assert!(set_cookie.starts_with("conveyor_ui="), "{set_cookie}");
    assert!(set_cookie.contains("; Path=/ui;") && set_cookie.contains("; HttpOnly; SameSite=Strict"), "{set_cookie}");
    // Reached on loopback over plain HTTP: no `Secure` (the browser would drop it); behind HTTPS it has it.
    assert!(!set_cookie.contains("Secure"), "{set_cookie}");
    assert!(!set_cookie.contains(ADMIN_TOKEN));
    let cookie = set_cookie.split(';').next().unwrap().to_owned();
    let behind_tls = http
        .post(ui(&app, "/ui/login"))
        .header("x-forwarded-proto", "https")
        .form(&[("credential", ADMIN_TOKEN)])
        .send()
        .await
        .unwrap();
    assert!(behind_tls.headers()[SET_COOKIE].to_str().unwrap().ends_with("; Secure"));

    // Signed in, the login page moves on; a login never follows `next` off the UI.
    let again = http.get(ui(&app, "/ui/login")).header("cookie", &cookie).send().await.unwrap();
    assert_eq!((again.status(), location(again.headers())), (StatusCode::SEE_OTHER, "/ui"));
    let away = http
        .post(ui(&app, "/ui/login"))
        .form(&[("credential", ADMIN_TOKEN), ("next", "//evil.example/ui/")])
        .send()
        .await
        .unwrap();
    assert_eq!(location(away.headers()), "/ui");

    // A tampered cookie is no session.
    let (name, value) = cookie.split_once('=').unwrap();
    let mut bytes = value.as_bytes().to_vec();
    bytes[3] = if bytes[3] == b'a' { b'b' } else { b'a' };
    let forged = format!("{name}={}", String::from_utf8(bytes).unwrap());
    let refused = http.get(ui(&app, "/ui/jobs")).header("cookie", forged).send().await.unwrap();
    assert_eq!(refused.status(), StatusCode::SEE_OTHER);

    // An operator JWT logs in too.
    assert!(login(&app, &jwt("alice", true)).await.is_some());
}

#[tokio::test]
async fn a_post_without_the_sessions_csrf_token_or_from_another_site_is_refused_and_changes_nothing() {
    let s = Scenario::start().await;
    let app = &s.app;
    let http = http();
    let cookie = login(app, ADMIN_TOKEN).await.expect("the operator token logs in");
    let other = login(app, &jwt("mallory", true)).await.unwrap();
    let page = |cookie: String, path: String| {
        let http = http.clone();
        async move { http.get(ui(app, &path)).header("cookie", cookie).send().await.unwrap().text().await.unwrap() }
    };
    let job_page = format!("/ui/jobs/{}", s.delayed.0);
    let csrf = csrf_in(&page(cookie.clone(), job_page.clone()).await);
    let others_csrf = csrf_in(&page(other.clone(), job_page.clone()).await);
    assert_ne!(csrf, others_csrf, "each session has its own token");
    let cancel = ui(app, &format!("{job_page}/cancel"));

    // What is wrong with each: the CSRF field sent (if any), and a header saying where the form came from.
    let forged = [
        ("no token", None, None),
        ("a wrong token", Some("AAAA"), None),
        ("another session's token", Some(others_csrf.as_str()), None),
        ("the right token from another origin", Some(csrf.as_str()), Some(("origin", "http://evil.example"))),
        ("the right token, cross-site", Some(csrf.as_str()), Some(("sec-fetch-site", "cross-site"))),
    ];
    for (what, token, header) in forged {
        let form: Vec<(&str, &str)> = token.map(|t| ("csrf", t)).into_iter().collect();
        let mut request = http.post(&cancel).header("cookie", &cookie).form(&form);
        if let Some((name, value)) = header {
            request = request.header(name, value);
        }
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), StatusCode::FORBIDDEN, "{what}");
        assert!(response.text().await.unwrap().contains("Refused"), "{what}");
        assert_eq!(s.status(s.delayed).await, JobStatus::Scheduled, "{what} changed nothing");
    }
    // A GET never changes anything, whatever it carries.
    let get = http.get(format!("{cancel}?csrf={csrf}")).header("cookie", &cookie).send().await.unwrap();
    assert_eq!(get.status(), StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(s.status(s.delayed).await, JobStatus::Scheduled);

    // The same POST with the session's own token, from the UI's origin: done.
    let origin = format!("http://{}", app.admin_addr);
    let done = http
        .post(&cancel)
        .header("cookie", &cookie)
        .header("origin", origin)
        .header("sec-fetch-site", "same-origin")
        .form(&[("csrf", csrf.as_str())])
        .send()
        .await
        .unwrap();
    assert_eq!(done.status(), StatusCode::SEE_OTHER);
    assert_eq!(location(done.headers()), format!("{job_page}?notice=canceled"));
    assert_eq!(s.status(s.delayed).await, JobStatus::Canceled);

    // Logging out needs the token too; afterwards the browser holds no session.
    let refused = http.post(ui(app, "/ui/logout")).header("cookie", &cookie).send().await.unwrap();
    assert_eq!(refused.status(), StatusCode::FORBIDDEN);
    let out = http
        .post(ui(app, "/ui/logout"))
        .header("cookie", &cookie)
        .form(&[("csrf", csrf.as_str())])
        .send()
        .await
        .unwrap();
    assert_eq!(location(out.headers()), "/ui/login");
    assert!(out.headers()[SET_COOKIE].to_str().unwrap().starts_with("conveyor_ui=; Path=/ui; Max-Age=0"));
}

#[tokio::test]
async fn every_value_from_the_database_is_escaped_and_errors_are_redacted() {
    let s = Scenario::start().await;
    let cookie = login(&s.app, ADMIN_TOKEN).await.unwrap();
    for path in [format!("/ui/jobs/{}", s.dead.0), "/ui/dead-letters".to_owned(), "/ui/queues/ui-demo".to_owned()] {
        let response = http().get(ui(&s.app, &path)).header("cookie", &cookie).send().await.unwrap();
        assert_eq!(response.status(), StatusCode::OK, "{path}");
        let html = response.text().await.unwrap();
        assert!(html.contains("marketplace refused &lt;em&gt;shop&lt;/em&gt;"), "{path}: the error, escaped");
        assert!(!html.contains("<em>shop"), "{path}");
        assert!(!html.contains("hunter2"), "{path}: the credential in the error is redacted");
    }
    // The job page's log: the line the handler wrote, escaped and redacted.
    let path = format!("/ui/jobs/{}", s.dead.0);
    let html = http().get(ui(&s.app, &path)).header("cookie", &cookie).send().await.unwrap().text().await.unwrap();
    let log = html.split("id=\"logs\"").nth(1).expect("the job page shows its log");
    assert!(log.contains("marketplace refused &lt;em&gt;shop&lt;/em&gt;") && !log.contains("hunter2"), "{log}");
}

#[tokio::test]
async fn every_page_renders_and_its_forms_take_effect() {
    let s = Scenario::start().await;
    let app = &s.app;
    let pool = &app.db.pool;
    let mut tx = conveyor_jobs::begin_workspace(pool, s.workspace).await.unwrap();
    let spec = conveyor_jobs::ScheduleSpec::cron("0 3 * * *", "Europe/Paris").unwrap();
    let payload = Flaky { wait_for_flag: false };
    conveyor_jobs::upsert_schedule_tx(&mut tx, "nightly-digest", &payload, spec, conveyor_jobs::ScheduleOptions::new())
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let cookie = login(app, ADMIN_TOKEN).await.unwrap();
    let http = http();
    let get = |path: String| {
        let (http, cookie) = (http.clone(), cookie.clone());
        async move {
            let response = http.get(ui(app, &path)).header("cookie", cookie).send().await.unwrap();
            (response.status(), response.text().await.unwrap())
        }
    };
    let (dead, delayed) = (s.dead.0.simple().to_string(), s.delayed.0.simple().to_string());
    let short = |id: &str| id[20..].to_owned();

    // Pages and their filters.
    let (status, home) = get("/ui".into()).await;
    assert_eq!(status, StatusCode::OK);
    assert!(home.contains(r#"<tr data-queue="ui-demo">"#) && home.contains("Nothing is paused."));
    let csrf = csrf_in(&home);
    let (_, failed) = get("/ui/queues/ui-demo?status=failed".into()).await;
    assert!(failed.contains(&short(&dead)) && !failed.contains(&short(&delayed)));
    let (_, scheduled) = get("/ui/jobs?queue=ui-demo&status=scheduled&kind=&workspace=".into()).await;
    assert!(scheduled.contains(&short(&delayed)) && !scheduled.contains(&short(&dead)));
    let (_, others) = get(format!("/ui/jobs?workspace={}", Uuid::new_v4())).await;
    assert!(others.contains("No job matches."));
    let (status, operations) = get("/ui/operations?status=failed".into()).await;
    assert_eq!(status, StatusCode::OK);
    assert!(operations.contains("<h1>Operations</h1>"));
    let (_, schedules) = get("/ui/schedules".into()).await;
    assert!(schedules.contains("nightly-digest") && schedules.contains("0 3 * * * (Europe/Paris)"));
    for (path, code, text) in [
        ("/ui/jobs?status=bogus", StatusCode::BAD_REQUEST, "status must be one of"),
        ("/ui/dead-letters?workspace=nope", StatusCode::BAD_REQUEST, "workspace is not a UUID: nope"),
        ("/ui/operations?status=bogus", StatusCode::BAD_REQUEST, "status must be one of"),
        ("/ui/jobs/not-a-uuid", StatusCode::BAD_REQUEST, "job id is not a UUID"),
        ("/ui/queues/no-such-queue", StatusCode::NOT_FOUND, "No queue no-such-queue"),
    ] {
        let (status, body) = get(path.into()).await;
        assert_eq!(status, code, "{path}");
        assert!(body.contains(text), "{path}: {body}");
    }
    let (status, _) = get(format!("/ui/jobs/{}", Uuid::new_v4())).await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    let post = |path: &'static str, form: Vec<(&'static str, String)>| {
        let (http, cookie, csrf) = (http.clone(), cookie.clone(), csrf.clone());
        async move {
            let mut form = form;
            form.push(("csrf", csrf));
            let response = http.post(ui(app, path)).header("cookie", cookie).form(&form).send().await.unwrap();
            assert_eq!(response.status(), StatusCode::SEE_OTHER, "{path}");
            location(response.headers()).to_owned()
        }
    };

    // Pause the queue from its page, see it on the overview, resume it from there.
    let to = post("/ui/queues/ui-demo/pause", vec![("reason", "maintenance <b>now</b>".into())]).await;
    assert_eq!(to, "/ui/queues/ui-demo?notice=paused");
    let pauses = conveyor_jobs::list_pauses(&app.db.runtime_pool).await.unwrap();
    assert_eq!(pauses.len(), 1);
    assert_eq!(pauses[0].queue.as_deref(), Some("ui-demo"));
    let (_, home) = get("/ui".into()).await;
    assert!(home.contains("maintenance &lt;b&gt;now&lt;/b&gt;") && home.contains("s-paused"));
    let to =
        post("/ui/pauses/resume", vec![("queue", "ui-demo".into()), ("kind", "".into()), ("workspace", "".into())])
            .await;
    assert_eq!(to, "/ui?notice=resumed");
    assert!(conveyor_jobs::list_pauses(&app.db.runtime_pool).await.unwrap().is_empty());
    let to = post("/ui/pauses", vec![("kind", Flaky::KIND.into()), ("workspace", s.workspace.0.to_string())]).await;
    assert_eq!(to, "/ui?notice=paused");
    assert_eq!(conveyor_jobs::list_pauses(&app.db.runtime_pool).await.unwrap()[0].workspace_id, Some(s.workspace.0));

    // Fairness: a global limit set from its form, listed with what it holds, refused when malformed, removed from its
    // button; a workspace's weight, key limit and kind limit, each set and removed from its form.
    let (_, fair) = get("/ui/fairness".into()).await;
    assert!(fair.contains("No global limit.") && fair.contains(r#"id="set-limit""#), "{fair}");
    let limit = vec![
        ("scope", "queue".to_owned()),
        ("name", "ui-demo".to_owned()),
        ("max_in_flight", "3".to_owned()),
        ("max_per_interval", "10".to_owned()),
        ("interval_ms", "1000".to_owned()),
    ];
    assert_eq!(post("/ui/limits", limit).await, "/ui/fairness?notice=limited");
    let operator = conveyor_jobs::connect_postgres(&app.db.operator_url, 1).await.unwrap();
    let held = conveyor_jobs::list_global_limits(&operator).await.unwrap();
    assert_eq!((held.len(), held[0].max_in_flight, held[0].max_per_interval), (1, Some(3), Some(10)));
    let (_, fair) = get("/ui/fairness?notice=limited".into()).await;
    assert!(fair.contains(r#"data-limit="queue/ui-demo""#) && fair.contains("Limit set."), "{fair}");
    let ws = s.workspace.0.to_string();
    for (path, bad) in [
        ("/ui/limits", vec![("scope", "queue"), ("name", "ui-demo"), ("max_per_interval", "10")]),
        ("/ui/limits", vec![("scope", "shard"), ("name", "ui-demo"), ("max_in_flight", "1")]),
        ("/ui/limits", vec![("scope", "queue"), ("name", "ui-demo"), ("max_in_flight", "lots")]),
        ("/ui/limits", vec![("scope", "queue"), ("name", "ui-demo")]),
        ("/ui/weights", vec![("workspace", ws.as_str()), ("weight", "0")]),
        ("/ui/weights", vec![("workspace", "nope"), ("weight", "2")]),
        ("/ui/key-limits", vec![("workspace", ws.as_str()), ("key", "store:1")]),
        ("/ui/kind-limits", vec![("workspace", ws.as_str()), ("kind", Flaky::KIND), ("max_in_flight", "0")]),
    ] {
        let mut form = bad.clone();
        form.push(("csrf", csrf.as_str()));
        let response = http.post(ui(app, path)).header("cookie", &cookie).form(&form).send().await.unwrap();
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{path} {bad:?}");
    }
    assert_eq!(conveyor_jobs::list_global_limits(&operator).await.unwrap()[0].max_in_flight, Some(3), "unchanged");
    let target = vec![("scope", "queue".to_owned()), ("name", "ui-demo".to_owned())];
    assert_eq!(post("/ui/limits/remove", target.clone()).await, "/ui/fairness?notice=unlimited");
    assert_eq!(post("/ui/limits/remove", target).await, "/ui/fairness?notice=no-limit");
    assert!(conveyor_jobs::list_global_limits(&operator).await.unwrap().is_empty());

    let weigh = vec![("workspace", ws.clone()), ("weight", "4".to_owned())];
    assert_eq!(post("/ui/weights", weigh).await, "/ui/fairness?notice=weighed");
    let key = vec![
        ("workspace", ws.clone()),
        ("key", " store:<1>".to_owned()),
        ("max_in_flight", "2".to_owned()),
        ("max_per_interval", "".to_owned()),
        ("interval_ms", "".to_owned()),
    ];
    assert_eq!(post("/ui/key-limits", key).await, "/ui/fairness?notice=limited");
    let kind = vec![("workspace", ws.clone()), ("kind", Flaky::KIND.to_owned()), ("max_in_flight", "1".to_owned())];
    assert_eq!(post("/ui/kind-limits", kind).await, "/ui/fairness?notice=limited");
    let (_, fair) = get(format!("/ui/fairness?workspace={ws}")).await;
    let weighed = format!(r#"<tr data-workspace="{ws}"><td class="mono">{ws}</td><td class="num">4</td>"#);
    assert!(fair.contains(&weighed), "{fair}");
    assert!(
        fair.contains(r#"data-key=" store:&lt;1&gt;""#) && fair.contains(&format!(r#"data-kind="{}""#, Flaky::KIND))
    );
    let keys = conveyor_jobs::list_key_limits(pool, s.workspace).await.unwrap();
    assert_eq!((keys[0].key.as_str(), keys[0].max_in_flight), (" store:<1>", Some(2)));
    assert_eq!(conveyor_jobs::list_kind_limits(pool, s.workspace).await.unwrap()[0].max_in_flight, 1);
    let (_, other) = get(format!("/ui/fairness?workspace={}", Uuid::new_v4())).await;
    assert!(other.contains("No key limit or block.") && other.contains("No kind limit."), "another workspace's: none");
    let key = vec![("workspace", ws.clone()), ("key", " store:<1>".to_owned())];
    assert_eq!(post("/ui/key-limits/remove", key).await, "/ui/fairness?notice=unlimited");
    let kind = vec![("workspace", ws.clone()), ("kind", Flaky::KIND.to_owned())];
    assert_eq!(post("/ui/kind-limits/remove", kind.clone()).await, "/ui/fairness?notice=unlimited");
    assert_eq!(post("/ui/kind-limits/remove", kind).await, "/ui/fairness?notice=no-limit");
    assert!(conveyor_jobs::list_key_limits(pool, s.workspace).await.unwrap().is_empty());
    let audited: Vec<(String,)> = sqlx::query_as(
        "SELECT action FROM conveyor.conveyor_admin_audit WHERE action IN ('weight', 'key_limit', 'kind_limit')
         ORDER BY id",
    )
    .fetch_all(&mut app.db.owner().await)
    .await
    .unwrap();
    let actions: Vec<&str> = audited.iter().map(|(a,)| a.as_str()).collect();
    assert_eq!(actions, ["weight", "weight", "key_limit", "key_limit", "kind_limit", "kind_limit"], "intent, outcome");

    // Pause and resume the schedule.
    let target = || vec![("workspace", s.workspace.0.to_string()), ("name", "nightly-digest".to_owned())];
    assert_eq!(post("/ui/schedules/pause", target()).await, "/ui/schedules?notice=paused");
    assert!(conveyor_jobs::list_schedules(pool, s.workspace).await.unwrap()[0].paused);
    assert_eq!(post("/ui/schedules/resume", target()).await, "/ui/schedules?notice=resumed");
    assert!(!conveyor_jobs::list_schedules(pool, s.workspace).await.unwrap()[0].paused);

    // Discard every dead letter matching a filter. The list's button opens a confirmation page (a GET); a POST that
    // did not come from it (no `until`) changes nothing and leads there.
    let (_, list) = get("/ui/dead-letters?queue=ui-demo".into()).await;
    assert!(list.contains(r#"<form class="inline" method="get" action="/ui/dead-letters/confirm">"#), "{list}");
    let to = post("/ui/dead-letters/discard", vec![("queue", "ui-demo".into())]).await;
    assert_eq!(to, "/ui/dead-letters/confirm?action=discard&queue=ui-demo");
    assert_eq!(s.status(s.dead).await, JobStatus::Failed, "an unconfirmed bulk POST changes nothing");
    let (_, none) = get("/ui/dead-letters/confirm?action=discard&queue=another-queue".into()).await;
    assert!(none.contains(r#"data-count="0""#) && none.contains("nothing to do") && !none.contains("until"));
    // The page counts what the action will take, and carries the time it was shown.
    let (status, confirm) = get("/ui/dead-letters/confirm?action=discard&queue=ui-demo".into()).await;
    assert_eq!(status, StatusCode::OK);
    assert!(confirm.contains(r#"data-count="1""#) && confirm.contains("1 dead letter</strong> will be discarded"));
    assert!(confirm.contains("those of queue ui-demo") && !confirm.contains(r#"name="all""#), "{confirm}");
    let until = hidden_value(&confirm, "until");
    // A letter dead-lettered after the page was shown (in another workspace: the kind is paused in this one) is not
    // taken by its form.
    let elsewhere = WorkspaceId(Uuid::new_v4());
    let mut tx = conveyor_jobs::begin_workspace(pool, elsewhere).await.unwrap();
    let late =
        conveyor_jobs::enqueue_tx(&mut tx, &Flaky { wait_for_flag: true }, EnqueueOptions::new()).await.unwrap().id;
    tx.commit().await.unwrap();
    let failed = conveyor_jobs::wait_for_job(pool, elsewhere, late, Duration::from_secs(30)).await.unwrap();
    assert_eq!(failed.status, JobStatus::Failed);
    let to = post("/ui/dead-letters/discard", vec![("queue", "ui-demo".into()), ("until", until)]).await;
    assert_eq!(to, "/ui/dead-letters?queue=ui-demo&notice=bulk-discarded&matched=1&done=1&skipped=0");
    let (_, page) = get(to).await;
    assert!(page.contains("1 matched, 1 discarded, 0 skipped") && page.contains(&format!("data-job=\"{}\"", late.0)));
    assert!(conveyor_jobs::get_job(pool, s.workspace, s.dead).await.unwrap().is_none(), "the dead letter is gone");
    let late = conveyor_jobs::get_job(pool, elsewhere, late).await.unwrap().expect("the later one stays");
    assert_eq!(late.status, JobStatus::Failed, "the later one stays a dead letter");
    // Without a filter the page says it takes everything, and its form says so explicitly.
    let (_, every) = get("/ui/dead-letters/confirm?action=replay".into()).await;
    assert!(every.contains("every queue, kind and workspace") && every.contains(r#"name="all" value="true""#));
    assert!(every.contains("will be replayed from their first attempt"), "{every}");
}

/// The value of the hidden field `name` of a page's form.
fn hidden_value(html: &str, name: &str) -> String {
    let marker = format!(r#"name="{name}" value=""#);
    let at = html.find(&marker).unwrap_or_else(|| panic!("the page has a field {name}"));
    let rest = &html[at + marker.len()..];
    rest[..rest.find('"').unwrap()].to_owned()
}

/// An operator JWT for `sub` that expires at `exp` (Unix seconds).
fn operator_jwt_until(sub: &str, exp: i64) -> String {
    let key = jsonwebtoken::EncodingKey::from_secret(common::OPERATOR_JWT_SECRET.as_bytes()).unwrap();
    let claims = json!({ "sub": sub, "exp": exp, "aud": "conveyor-operator", "operator": true });
    jsonwebtoken::encode(&jsonwebtoken::Header::default(), &claims, &key).unwrap()
}

/// The `Max-Age` of a `Set-Cookie` value, and the expiry the session cookie's value carries.
fn cookie_lifetime(set_cookie: &str) -> (u64, u64) {
    let max_age = set_cookie.split("Max-Age=").nth(1).unwrap().split(';').next().unwrap().parse().unwrap();
    let value = set_cookie.split(';').next().unwrap().trim_start_matches("conveyor_ui=");
    let expires_at = value.split('.').nth(1).unwrap().parse().unwrap();
    (max_age, expires_at)
}

#[tokio::test]
async fn a_session_ends_when_the_operator_jwt_it_was_started_with_does() {
    let app = TestApp::spawn().await;
    let login_with = |credential: String| {
        let app = &app;
        async move {
            let response = http().post(ui(app, "/ui/login")).form(&[("credential", credential)]).send().await.unwrap();
            let cookie = response.headers().get(SET_COOKIE).map(|v| v.to_str().unwrap().to_owned());
            (response.status(), cookie)
        }
    };
    // A JWT valid two more minutes: a session of two minutes, not eight hours.
    let exp = chrono::Utc::now().timestamp() + 120;
    let (status, cookie) = login_with(operator_jwt_until("alice", exp)).await;
    assert_eq!(status, StatusCode::SEE_OTHER);
    let (max_age, expires_at) = cookie_lifetime(&cookie.unwrap());
    assert_eq!(expires_at, exp as u64, "the session ends with the JWT");
    assert!(max_age <= 120, "the browser keeps the cookie no longer: {max_age}");
    // The operator token has no expiry of its own: the full eight hours.
    let (_, cookie) = login_with(ADMIN_TOKEN.to_owned()).await;
    let (max_age, _) = cookie_lifetime(&cookie.unwrap());
    assert!(max_age > 7 * 3600 && max_age <= 8 * 3600, "{max_age}");
    // A JWT that has just expired (still inside the verifier's clock leeway) starts no session at all.
    let (status, cookie) = login_with(operator_jwt_until("alice", chrono::Utc::now().timestamp() - 2)).await;
    assert_eq!((status, cookie), (StatusCode::UNAUTHORIZED, None));
}

#[tokio::test]
async fn without_the_operator_role_the_ui_says_it_is_not_configured() {
    let app = TestApp::spawn_with(|vars| {
        vars.remove("CONVEYOR_OPERATOR_DATABASE_URL");
    })
    .await;
    let cookie = login(&app, ADMIN_TOKEN).await.expect("the operator token still logs in");
    for path in ["/ui", "/ui/dead-letters", "/ui/queues/any"] {
        let response = http().get(ui(&app, path)).header("cookie", &cookie).send().await.unwrap();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE, "{path}");
        assert!(response.text().await.unwrap().contains("CONVEYOR_OPERATOR_DATABASE_URL"), "{path}");
    }
}

// ---------------------------------------------------------------------------------------------------------------
// The browser.

/// Where screenshots go: `CONVEYOR_UI_SCREENSHOTS` (the README's are `docs/screenshots`), else the target dir.
fn screenshot_dir() -> PathBuf {
    match std::env::var_os("CONVEYOR_UI_SCREENSHOTS") {
        Some(dir) => Path::new(env!("CARGO_MANIFEST_DIR")).join(dir),
        None => Path::new(env!("CARGO_TARGET_TMPDIR")).join("ui-screenshots"),
    }
}

#[tokio::test]
async fn an_operator_logs_in_sees_a_queue_opens_a_dead_letter_replays_it_and_sees_it_succeed_in_chromium() {
    let Some(browser) = common::browser::browser_or_skip().await else { return };
    let s = Scenario::start().await;
    let app = &s.app;
    let shots = screenshot_dir();
    // A maintenance pass records the queue's last hour, the dead letter's end in it.
    let redis = common::redis_client(&common::redis_url()).await;
    conveyor_jobs::Maintenance::new(
        app.db.runtime_pool.clone(),
        redis,
        conveyor_jobs::RedisKeys::new(&app.redis_prefix),
        conveyor_jobs::Metrics::new(),
        Duration::from_secs(1),
        Duration::from_secs(7 * 86400),
        Duration::from_secs(3600),
    )
    .run_once()
    .await
    .unwrap();

    // A page without a session goes to the login, and comes back after it.
    browser.goto(&ui(app, "/ui/queues/ui-demo")).await;
    assert_eq!(
        browser.path_at("/ui/login?next=%2Fui%2Fqueues%2Fui-demo").await,
        "/ui/login?next=%2Fui%2Fqueues%2Fui-demo"
    );
    browser.type_into("#credential", "not-the-operator-token").await;
    browser.click("button[type=submit]").await;
    assert!(browser.text("[role=alert]").await.contains("neither the operator token nor an operator JWT"));
    assert!(browser.client.get_named_cookie("conveyor_ui").await.is_err(), "a wrong token starts no session");
    browser.type_into("#credential", ADMIN_TOKEN).await;
    browser.click("button[type=submit]").await;
    assert_eq!(browser.path_at("/ui/queues/ui-demo").await, "/ui/queues/ui-demo");
    let cookie = browser.client.get_named_cookie("conveyor_ui").await.expect("a session cookie");
    assert_eq!(cookie.http_only(), Some(true));

    // The overview: the queue with its counts by state.
    browser.click("header nav a[href='/ui']").await;
    let row = "#queues tr[data-queue='ui-demo']";
    let cells = browser.text(row).await;
    assert!(cells.starts_with("ui-demo"), "{cells}");
    // queued, delayed, running, retrying, dead
    let counts: Vec<String> = {
        let mut v = Vec::new();
        for i in 2..=6 {
            v.push(browser.text(&format!("{row} td:nth-child({i})")).await);
        }
        v
    };
    assert_eq!(counts, ["0", "1", "0", "0", "1"], "queued, delayed, running, retrying, dead");
    // Its last hour as a small chart in the row: the dead letter's minute has its bar, and the label says the totals.
    let spark = browser.element(&format!("{row} svg.spark")).await;
    let label = spark.attr("aria-label").await.unwrap().unwrap_or_default();
    assert!(label.starts_with("last hour: ") && label.contains(", 1 failed,"), "{label}");
    let (_, _, width, height) = spark.rectangle().await.unwrap();
    assert!(width >= 100.0 && height >= 20.0, "the sparkline is drawn at {width}x{height}");
    let failed = browser.client.find_all(Locator::Css(&format!("{row} svg.spark rect.failed"))).await.unwrap();
    assert_eq!(failed.len(), 1, "the dead letter's minute has its bar");
    // Beside it, the backlog and the wait p95 as lines: the maintenance pass recorded this minute's backlog.
    let backlog = browser.element(&format!("{row} svg.spark-line[data-chart='backlog']")).await;
    let label = backlog.attr("aria-label").await.unwrap().unwrap_or_default();
    assert!(label.starts_with("backlog, last hour: ") && label.contains("jobs at the last minute recorded"), "{label}");
    let drawn = browser
        .client
        .find_all(Locator::Css(&format!(
            "{row} svg.spark-line[data-chart='backlog'] circle, {row} svg.spark-line[data-chart='backlog'] polyline"
        )))
        .await
        .unwrap();
    assert!(!drawn.is_empty(), "the recorded minute is drawn");
    let wait = browser.element(&format!("{row} svg.spark-line[data-chart='wait p95']")).await;
    let label = wait.attr("aria-label").await.unwrap().unwrap_or_default();
    assert!(label.starts_with("wait p95, last hour: "), "{label}");
    browser.screenshot(&shots, "overview").await;

    // The queue: its counts, its last hour (recorded by the maintenance pass at the start) and its jobs.
    browser.click(&format!("{row} td:first-child a")).await;
    assert_eq!(browser.path_at("/ui/queues/ui-demo").await, "/ui/queues/ui-demo");
    assert_eq!(browser.text("#counts [data-state=dead] .n").await, "1");
    assert_eq!(browser.text("#counts [data-state=delayed] .n").await, "1");
    let charts = browser.client.find_all(Locator::Css("#charts svg")).await.unwrap();
    assert_eq!(charts.len(), 3, "the queue's last hour in three charts");
    let (_, _, width, height) = charts[0].rectangle().await.unwrap();
    assert!(width > 200.0 && height > 40.0, "the chart is drawn at {width}x{height}");
    let failed = browser.client.find_all(Locator::Css("#charts rect.failed")).await.unwrap();
    assert_eq!(failed.len(), 1, "the dead letter's minute has its bar");
    let jobs = browser.client.find_all(Locator::Css("#jobs tbody tr")).await.unwrap();
    assert_eq!(jobs.len(), 4, "the queue's four jobs");
    browser.screenshot(&shots, "queue").await;

    // The dead letters: the failed job with its redacted, escaped reason.
    browser.click("header nav a[href='/ui/dead-letters']").await;
    let dead_row = format!("#dead-letters tr[data-job='{}']", s.dead.0);
    let reason = browser.text(&format!("{dead_row} td.err")).await;
    assert!(reason.contains("marketplace refused <em>shop</em>"), "{reason}");
    assert!(!reason.contains("hunter2"), "{reason}");
    browser.screenshot(&shots, "dead-letters").await;

    // Open it: the job page shows it failed, its attempt and payload.
    browser.click(&format!("{dead_row} a.open")).await;
    let expected = format!("/ui/jobs/{}", s.dead.0);
    assert_eq!(browser.path_at(&expected).await, expected);
    let status = browser.client.find(Locator::Css("#status")).await.unwrap();
    assert_eq!(status.attr("data-status").await.unwrap().as_deref(), Some("failed"));
    assert!(browser.text("#attempts").await.contains("marketplace refused"));
    browser.screenshot(&shots, "dead-letter").await;

    // Replay it, with the handler now succeeding: the job page shows it succeeded.
    s.succeed.store(true, Ordering::SeqCst);
    browser.click("form[action$='/retry'] button").await;
    let expected = format!("/ui/jobs/{}?notice=retried", s.dead.0);
    assert_eq!(browser.path_at(&expected).await, expected);
    assert!(browser.text("[role=status]").await.contains("runs again"));
    let succeeded = eventually(Duration::from_secs(30), || async {
        browser.click("a#reload").await;
        let status = browser.client.find(Locator::Css("#status")).await.ok()?;
        (status.attr("data-status").await.ok()??.as_str() == "succeeded").then_some(())
    })
    .await;
    assert!(succeeded.is_some(), "the replayed job succeeds, and its page says so");
    assert_eq!(s.status(s.dead).await, JobStatus::Succeeded);
    browser.screenshot(&shots, "job").await;

    // The delayed job's page: raise it and push it an hour out with the change form.
    browser.goto(&ui(app, &format!("/ui/jobs/{}", s.delayed.0))).await;
    browser.click("#change summary").await;
    browser.click("#change select[name=priority] option[value=high]").await;
    browser.type_into("#change input[name=delay]", "1h").await;
    browser.click("#change button[type=submit]").await;
    let expected = format!("/ui/jobs/{}?notice=changed", s.delayed.0);
    assert_eq!(browser.path_at(&expected).await, expected);
    assert!(browser.text("[role=status]").await.contains("Changed."));
    let changed = conveyor_jobs::get_job(&app.db.pool, s.workspace, s.delayed).await.unwrap().unwrap();
    assert_eq!((changed.priority, changed.status), (conveyor_jobs::Priority::High, JobStatus::Scheduled));

    // The queue's operations: clean the workspace's succeeded jobs but the newest (the replayed one).
    browser.goto(&ui(app, "/ui/queues/ui-demo")).await;
    browser.click("#queue-operations summary").await;
    browser.type_into("#clean input[name=workspace]", &s.workspace.0.to_string()).await;
    browser.type_into("#clean input[name=keep_last]", "1").await;
    browser.screenshot(&shots, "queue-operations").await;
    browser.click("#clean button[type=submit]").await;
    let cleaned = "/ui/queues/ui-demo?notice=cleaned&matched=0&done=2&skipped=0";
    assert_eq!(browser.path_at(cleaned).await, cleaned);
    assert!(browser.text("[role=status]").await.contains("Cleaned: 2 ended jobs deleted."));
    assert_eq!(s.status(s.dead).await, JobStatus::Succeeded, "the newest succeeded job stays");

    // The consumers: the scenario's worker reads the queue, and holds nothing now.
    browser.click("header nav a[href='/ui/consumers']").await;
    assert_eq!(browser.path_at("/ui/consumers").await, "/ui/consumers");
    let consumer = browser.text("#consumers tr[data-queue='ui-demo'] td:nth-child(3)").await;
    assert_eq!(consumer, "0", "nothing held once its jobs ended");
    browser.screenshot(&shots, "consumers").await;

    // Fairness: a global limit set from its form, then shown with what it holds.
    browser.click("header nav a[href='/ui/fairness']").await;
    assert_eq!(browser.path_at("/ui/fairness").await, "/ui/fairness");
    browser.type_into("#set-limit input[name=name]", "ui-demo").await;
    browser.type_into("#set-limit input[name=max_in_flight]", "4").await;
    browser.type_into("#set-limit input[name=max_per_interval]", "100").await;
    browser.type_into("#set-limit input[name=interval_ms]", "1000").await;
    browser.click("#set-limit button[type=submit]").await;
    assert_eq!(browser.path_at("/ui/fairness?notice=limited").await, "/ui/fairness?notice=limited");
    let limit = browser.text("#global-limits tr[data-limit='queue/ui-demo'] td:nth-child(3)").await;
    assert_eq!(limit, "4");
    browser.screenshot(&shots, "fairness").await;

    // A form posted from a page of another origin: SameSite=Strict keeps the cookie back, and nothing changes.
    let target = format!("http://{}/ui/jobs/{}/cancel", app.admin_addr, s.delayed.0);
    let evil = format!(
        "data:text/html,<form id=f method=post action='{target}'><input name=csrf value=x></form>\
         <button id=go form=f>go</button>"
    );
    browser.client.goto(&evil).await.unwrap();
    browser.click("#go").await;
    // The POST arrives without the session, so the UI sends the browser to its login.
    let landed = eventually(Duration::from_secs(10), || async {
        let url = browser.client.current_url().await.ok()?;
        (url.path() == "/ui/login").then_some(())
    })
    .await;
    assert!(landed.is_some(), "the cross-site form lands on the login, not on a changed job");
    assert_eq!(s.status(s.delayed).await, JobStatus::Scheduled, "a cross-site form changes nothing");

    browser.client.clone().close().await.unwrap();
}

#[tokio::test]
async fn a_waiting_jobs_change_and_the_queue_operations_take_effect_from_their_forms() {
    let s = Scenario::start().await;
    let app = &s.app;
    let pool = &app.db.pool;
    let ws = s.workspace.0.to_string();
    let cookie = login(app, ADMIN_TOKEN).await.unwrap();
    let http = http();
    let get = |path: String| {
        let (http, cookie) = (http.clone(), cookie.clone());
        async move {
            let response = http.get(ui(app, &path)).header("cookie", cookie).send().await.unwrap();
            (response.status(), response.text().await.unwrap())
        }
    };
    let (_, queue) = get("/ui/queues/ui-demo".into()).await;
    assert!(queue.contains(r#"id="queue-operations""#), "{queue}");
    let csrf = csrf_in(&queue);
    let (_, delayed_page) = get(format!("/ui/jobs/{}", s.delayed.0)).await;
    assert!(delayed_page.contains(r#"id="change""#), "a waiting job can be changed");
    let (_, dead_page) = get(format!("/ui/jobs/{}", s.dead.0)).await;
    assert!(!dead_page.contains(r#"id="change""#), "a dead letter cannot");
    let post = |path: String, form: Vec<(&'static str, String)>| {
        let (http, cookie, csrf) = (http.clone(), cookie.clone(), csrf.clone());
        async move {
            let mut form = form;
            form.push(("csrf", csrf));
            let response = http.post(ui(app, &path)).header("cookie", cookie).form(&form).send().await.unwrap();
            let status = response.status();
            let to = response.headers().get("location").map(|l| l.to_str().unwrap().to_owned());
            (status, to.unwrap_or_else(|| String::from("(no redirect)")), response.text().await.unwrap())
        }
    };

    // The change of the delayed job: raised, due in two hours, a new payload.
    let change = format!("/ui/jobs/{}/change", s.delayed.0);
    let form =
        vec![("priority", "high".into()), ("delay", "2h".into()), ("payload", r#"{"wait_for_flag":true}"#.into())];
    let (status, to, _) = post(change.clone(), form).await;
    assert_eq!((status, to), (StatusCode::SEE_OTHER, format!("/ui/jobs/{}?notice=changed", s.delayed.0)));
    let job = conveyor_jobs::get_job(pool, s.workspace, s.delayed).await.unwrap().unwrap();
    assert_eq!(job.priority, conveyor_jobs::Priority::High);
    let hours = (job.run_at - chrono::Utc::now()).num_minutes();
    assert!((100..=121).contains(&hours), "due in about two hours: {hours} min");
    let (_, page) = get(format!("/ui/jobs/{}?notice=changed", s.delayed.0)).await;
    assert!(page.contains("Changed.") && page.contains("wait_for_flag"), "{page}");
    // Bad input: a 400 page naming it, and nothing changed.
    for (name, value, says) in [
        ("payload", "{not json", "the payload is not JSON"),
        ("delay", "soon", "due is not now or a delay"),
        ("priority", "urgent", "priority must be"),
    ] {
        let (status, _, body) = post(change.clone(), vec![(name, value.into())]).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{name}");
        assert!(body.contains(says), "{name}: {body}");
    }
    // A dead letter is not waiting: refused, and said so.
    let (_, to, _) = post(format!("/ui/jobs/{}/change", s.dead.0), vec![("delay", "now".into())]).await;
    assert_eq!(to, format!("/ui/jobs/{}?notice=not-waiting", s.dead.0));

    // Clean the workspace's succeeded jobs: the two that ran.
    let clean = vec![("status", "succeeded".into()), ("workspace", ws.clone()), ("older_than", "0s".into())];
    let (_, to, _) = post("/ui/queues/ui-demo/clean".into(), clean).await;
    assert_eq!(to, "/ui/queues/ui-demo?notice=cleaned&matched=0&done=2&skipped=0");
    let (_, page) = get(to).await;
    assert!(page.contains("Cleaned: 2 ended jobs deleted."), "{page}");
    let (status, _, body) =
        post("/ui/queues/ui-demo/clean".into(), vec![("status", "succeeded".into()), ("workspace", ws.clone())]).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "neither an age nor a count: {body}");

    // Drain: the delayed job is canceled; a drain names a workspace or all.
    let (status, _, _) = post("/ui/queues/ui-demo/drain".into(), vec![("workspace", "".into())]).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let (_, to, _) = post("/ui/queues/ui-demo/drain".into(), vec![("workspace", ws.clone())]).await;
    assert_eq!(to, "/ui/queues/ui-demo?notice=drained&matched=0&done=1&skipped=0");
    assert_eq!(s.status(s.delayed).await, JobStatus::Canceled);

    // Obliterate: the canceled job and the dead letter go.
    let (_, to, _) = post("/ui/queues/ui-demo/obliterate".into(), vec![("workspace", ws.clone())]).await;
    assert_eq!(to, "/ui/queues/ui-demo?notice=obliterated&matched=0&done=2&skipped=0");
    assert!(conveyor_jobs::get_job(pool, s.workspace, s.dead).await.unwrap().is_none());
    let (_, page) = get(to).await;
    assert!(page.contains("Obliterated: 0 jobs canceled, 2 deleted, 0 kept"), "{page}");
}

#[tokio::test]
async fn a_reloading_overview_shows_data_alone_so_that_a_reload_never_wipes_a_form_and_times_say_utc() {
    let s = Scenario::start().await;
    let app = &s.app;
    let cookie = login(app, ADMIN_TOKEN).await.unwrap();
    let operator = conveyor_jobs::connect_postgres(&app.db.operator_url, 1).await.unwrap();
    conveyor_jobs::pause(&operator, &conveyor_jobs::PauseScope::queue("ui-demo"), Some("maintenance")).await.unwrap();
    let get = |path: &'static str| {
        let (http, cookie) = (http(), cookie.clone());
        async move { http.get(ui(app, path)).header("cookie", cookie).send().await.unwrap().text().await.unwrap() }
    };
    let still = get("/ui").await;
    assert!(still.contains(r#"action="/ui/pauses""#) && still.contains(r#"action="/ui/pauses/resume""#), "{still}");
    assert!(!still.contains(r#"http-equiv="refresh""#));
    let reloading = get("/ui?refresh=5").await;
    assert!(reloading.contains(r#"http-equiv="refresh""#), "{reloading}");
    assert!(
        !reloading.contains(r#"action="/ui/pauses""#)
            && !reloading.contains(r#"action="/ui/pauses/resume""#)
            && !reloading.contains("<input name=")
            && reloading.contains(r#"id="no-forms""#),
        "no form to type into while reloading (the header's log-out button stays): {reloading}"
    );
    assert!(reloading.contains("maintenance"), "the pauses are still shown");
    // The consumers page: the scenario's worker reads the queue.
    let consumers = get("/ui/consumers").await;
    assert!(consumers.contains(r#"<tr data-queue="ui-demo" data-consumer=""#), "{consumers}");
    // Every time on a page says its zone.
    let job = get("/ui/jobs?queue=ui-demo").await;
    let times: Vec<&str> = job.split("<time ").skip(1).map(|t| t.split("</time>").next().unwrap()).collect();
    assert!(!times.is_empty() && times.iter().all(|t| t.ends_with(" UTC")), "{times:?}");
}

#[tokio::test]
async fn the_job_search_goes_to_an_id_filters_by_time_and_a_job_page_shows_its_timeline() {
    let s = Scenario::start().await;
    let app = &s.app;
    let cookie = login(app, ADMIN_TOKEN).await.unwrap();
    let get = |path: String| {
        let (http, cookie) = (http(), cookie.clone());
        async move {
            let response = http.get(ui(app, &path)).header("cookie", cookie).send().await.unwrap();
            let (status, to) = (response.status(), response.headers().get("location").cloned());
            (status, to.map(|l| l.to_str().unwrap().to_owned()), response.text().await.unwrap())
        }
    };
    let (dead, delayed) = (s.dead.0.to_string(), s.delayed.0.to_string());
    let short = |id: &str| id.replace('-', "")[20..].to_owned();

    // An id goes straight to its job, whatever else the form carries; a malformed one is refused by name.
    let (status, to, _) = get(format!("/ui/jobs?id={dead}&queue=ignored")).await;
    assert_eq!((status, to.as_deref()), (StatusCode::SEE_OTHER, Some(format!("/ui/jobs/{dead}").as_str())));
    let (status, _, body) = get("/ui/jobs?id=not-a-job".into()).await;
    assert!(status == StatusCode::BAD_REQUEST && body.contains("job id is not a UUID"), "{body}");

    // A time range, as a duration ago or a UTC date and time.
    let (_, _, recent) = get("/ui/jobs?queue=ui-demo&since=1h".into()).await;
    assert!(recent.contains(&short(&dead)) && recent.contains(&short(&delayed)), "{recent}");
    let (_, _, old) = get("/ui/jobs?queue=ui-demo&until=2000-01-01+00%3A00".into()).await;
    assert!(old.contains("No job matches."), "{old}");
    let (status, _, body) = get("/ui/jobs?since=last+tuesday".into()).await;
    assert!(status == StatusCode::BAD_REQUEST && body.contains("since is neither a time"), "{body}");
    let (status, _, body) = get("/ui/jobs?since=300000years".into()).await;
    assert!(status == StatusCode::BAD_REQUEST && body.contains("reaches too far back"), "{body}");

    // The dead letter's timeline: enqueued, its failed run, handed out, ended, each with the time since the one before.
    let (_, _, page) = get(format!("/ui/jobs/{dead}")).await;
    let timeline = page.split(r#"id="timeline""#).nth(1).expect("a timeline").split("</table>").next().unwrap();
    for step in ["enqueued", "run 1 started on ", "run 1 failed", "ended failed"] {
        assert!(timeline.contains(step), "{step}: {timeline}");
    }
    // The worker that ran it, by its consumer name, and when its run started.
    let ran_by = page.split(r#"id="ran-by""#).nth(1).and_then(|r| r.split('<').next()).expect("a worker row");
    let worker = ran_by.trim_start_matches('>').trim();
    assert!(!worker.is_empty() && worker != "—" && timeline.contains(&format!("started on {worker}")), "{page}");
    let started = page.split(r#"id="run-started""#).nth(1).and_then(|r| r.split("</dd>").next()).unwrap();
    assert!(started.contains("<time datetime="), "a start time: {started}");
    assert!(timeline.matches(" ms<").count() + timeline.matches(" s<").count() >= 2, "durations: {timeline}");
    // A delayed job's timeline ends with when it is due.
    let (_, _, page) = get(format!("/ui/jobs/{delayed}")).await;
    assert!(page.contains("<td>due</td>"), "{page}");
}

#[tokio::test]
async fn a_flows_pages_link_a_parent_and_its_children_both_ways() {
    let app = TestApp::spawn().await;
    let ws = common::principal().workspace_id;
    let later = || EnqueueOptions::new().delay(Duration::from_secs(3600));
    let flow = conveyor_jobs::Flow::job(&Flaky { wait_for_flag: false }, EnqueueOptions::new())
        .unwrap()
        .child(conveyor_jobs::Flow::job(&Flaky { wait_for_flag: false }, later()).unwrap())
        .child_on_failure(
            conveyor_jobs::Flow::job(&Flaky { wait_for_flag: false }, later()).unwrap(),
            conveyor_jobs::ChildFailure::Remove,
        );
    let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
    let ids = conveyor_jobs::enqueue_flow_tx(&mut tx, flow).await.unwrap();
    tx.commit().await.unwrap();
    let cookie = login(&app, ADMIN_TOKEN).await.unwrap();
    let page = |id: JobId| {
        let (http, cookie, url) = (http(), cookie.clone(), ui(&app, &format!("/ui/jobs/{}", id.0)));
        async move { http.get(url).header("cookie", cookie).send().await.unwrap().text().await.unwrap() }
    };

    let parent = page(ids.id).await;
    assert!(parent.contains("Waits for 2 of its 2 children."), "{parent}");
    assert!(parent.contains("when its last child ends"), "{parent}");
    for child in &ids.children {
        assert!(parent.contains(&format!(r#"href="/ui/jobs/{}""#, child.id.0)), "{parent}");
    }
    assert!(parent.contains(">remove<"), "each child says what its failure does: {parent}");
    let child = page(ids.children[1].id).await;
    assert!(child.contains(&format!(r#"href="/ui/jobs/{}""#, ids.id.0)), "{child}");
    assert!(child.contains("the parent runs without it"), "{child}");
}

#[tokio::test]
async fn a_jobs_page_links_to_its_trace_where_a_trace_url_is_configured() {
    const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
    let traceparent = format!("00-{TRACE}-00f067aa0ba902b7-01");
    let mut jobs = Vec::new();
    for url in [Some("https://traces.example/trace/{trace_id}?from=conveyor"), None] {
        let app = TestApp::spawn_with(|v| {
            if let Some(url) = url {
                v.insert("CONVEYOR_TRACE_URL".into(), url.into());
            }
        })
        .await;
        let ws = common::principal().workspace_id;
        let mut tx = conveyor_jobs::begin_workspace(&app.db.pool, ws).await.unwrap();
        let options = EnqueueOptions::new().traceparent(traceparent.clone());
        let job = conveyor_jobs::enqueue_tx(&mut tx, &Flaky { wait_for_flag: false }, options).await.unwrap();
        tx.commit().await.unwrap();
        let cookie = login(&app, ADMIN_TOKEN).await.unwrap();
        let page = http()
            .get(ui(&app, &format!("/ui/jobs/{}", job.id.0)))
            .header("cookie", cookie)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let detail: Value = http()
            .get(format!("http://{}/admin/v1/jobs/{}", app.admin_addr, job.id.0))
            .bearer_auth(ADMIN_TOKEN)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(detail["trace_id"], TRACE);
        jobs.push(page);
    }
    let link = format!(r#"href="https://traces.example/trace/{TRACE}?from=conveyor""#);
    assert!(jobs[0].contains(&link), "{}", jobs[0]);
    // Without a trace URL, the id alone.
    assert!(!jobs[1].contains("traces.example") && jobs[1].contains(TRACE), "{}", jobs[1]);
}
