//! The operator console in a host of its own: a service that mounts `Console::router()` at `/ops/jobs` behind its own
//! login (a password form and a session cookie it keeps in memory), as any Rust service would, on the single-role
//! mode. Its operator logs in and replays a dead letter in a real Chromium; its API answers under the same prefix with
//! the host's session, and refuses what it must.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Form, Query, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use conveyor_jobs::console::{Console, Operator};
use conveyor_jobs::{Actor, Conveyor, EnqueueOptions, Handler, JobContext, JobError, JobId, JobKind, JobStatus};
use reqwest::header::LOCATION;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::kit::browser::browser_or_skip;
use crate::kit::{self, Platform};

/// The host's operator password.
const PASSWORD: &str = "correct horse battery staple";

#[derive(Serialize, Deserialize)]
struct Deliver {
    /// Fails for good while the flag is down.
    flaky: bool,
}

impl JobKind for Deliver {
    const KIND: &'static str = "host.deliver";
    const QUEUE: &'static str = "deliveries";
    const MAX_ATTEMPTS: u32 = 2;
}

struct Deliveries {
    succeed: Arc<AtomicBool>,
}

impl Handler<Deliver> for Deliveries {
    async fn handle(&self, job: Deliver, _cx: &mut JobContext) -> Result<Value, JobError> {
        if job.flaky && !self.succeed.load(Ordering::SeqCst) {
            return Err(JobError::permanent("the carrier refused the parcel"));
        }
        Ok(json!({ "delivered": true }))
    }
}

/// The host's sessions: id → (who, CSRF token).
type Sessions = Arc<Mutex<HashMap<String, (String, String)>>>;

fn session_of(sessions: &Sessions, headers: &HeaderMap) -> Option<(String, String)> {
    let cookies = headers.get(header::COOKIE)?.to_str().ok()?;
    let id = cookies.split(';').filter_map(|c| c.trim().strip_prefix("host_session=")).next()?;
    sessions.lock().unwrap().get(id).cloned()
}

/// The token a script of the host's sends in `Authorization: Bearer`.
const SCRIPT_TOKEN: &str = "the-hosts-script-token";

/// The host's authentication layer: its bearer token, else its session cookie, makes the request an operator's.
async fn authenticate(State(sessions): State<Sessions>, mut req: Request, next: Next) -> Response {
    let bearer = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).map(str::to_owned);
    if bearer.as_deref() == Some(&format!("Bearer {SCRIPT_TOKEN}")) {
        req.extensions_mut().insert(Operator::bearer(Actor("host:script".into())));
    } else if let Some((user, csrf)) = session_of(&sessions, req.headers()) {
        req.extensions_mut().insert(Operator::session(Actor(format!("host:{user}")), csrf));
    }
    next.run(req).await
}

#[derive(Deserialize)]
struct LoginQuery {
    next: Option<String>,
}

async fn login_form(Query(q): Query<LoginQuery>) -> Html<String> {
    let next = q.next.unwrap_or_default().replace('"', "");
    Html(format!(
        "<!doctype html><title>Host login</title><form method=post action=/login>\
         <input id=user name=user><input id=password type=password name=password>\
         <input type=hidden name=next value=\"{next}\"><button type=submit>Log in</button></form>"
    ))
}

#[derive(Deserialize)]
struct Login {
    user: String,
    password: String,
    next: String,
}

async fn login(State(sessions): State<Sessions>, Form(form): Form<Login>) -> Response {
    if form.password != PASSWORD {
        return (StatusCode::UNAUTHORIZED, "wrong password").into_response();
    }
    let (id, csrf) = (Uuid::new_v4().simple().to_string(), Uuid::new_v4().simple().to_string());
    sessions.lock().unwrap().insert(id.clone(), (form.user, csrf));
    let ours = form.next.starts_with("/ops/jobs") && !form.next.contains("//") && !form.next.contains('\\');
    let next = if ours { form.next } else { "/ops/jobs".into() };
    let cookie = format!("host_session={id}; Path=/; HttpOnly; SameSite=Strict");
    (StatusCode::SEE_OTHER, [(header::SET_COOKIE, cookie), (header::LOCATION, next)]).into_response()
}

#[derive(Deserialize)]
struct Logout {
    #[serde(default)]
    csrf: String,
}

/// Ends the session, when the console's logout button (which carries the session's CSRF token) sent it.
async fn logout(State(sessions): State<Sessions>, headers: HeaderMap, Form(form): Form<Logout>) -> Response {
    match session_of(&sessions, &headers) {
        Some((user, csrf)) if csrf == form.csrf => {
            sessions.lock().unwrap().retain(|_, (u, _)| *u != user);
            Redirect::to("/login").into_response()
        }
        Some(_) => (StatusCode::FORBIDDEN, "not this session's logout").into_response(),
        None => Redirect::to("/login").into_response(),
    }
}

/// A host on the single-role platform with the console at `/ops/jobs`, a worker and the dispatcher running, one job
/// succeeded and one dead-lettered in queue `deliveries`.
struct Host {
    url: String,
    conveyor: Conveyor,
    sessions: Sessions,
    succeed: Arc<AtomicBool>,
    dead: JobId,
    shutdown: CancellationToken,
}

impl Host {
    async fn start() -> Self {
        let platform = Platform::single_role().await;
        let conveyor = Conveyor::builder(platform.pool.clone(), &kit::redis_url())
            .prefix(&platform.prefix)
            .connect()
            .await
            .unwrap();
        let succeed = Arc::new(AtomicBool::new(false));
        let worker = conveyor.worker().handle::<Deliver>(Deliveries { succeed: succeed.clone() }).build().unwrap();
        let shutdown = CancellationToken::new();
        tokio::spawn(conveyor.clone().run(worker, shutdown.clone()));

        let sessions = Sessions::default();
        let console = Console::new(conveyor.admin()).login_path("/login").logout_path("/logout");
        let app = axum::Router::new()
            .route("/login", get(login_form).post(login))
            .route("/logout", post(logout))
            .route("/", get(|| async { "the host's own home" }))
            .nest("/ops/jobs", console.router())
            // Without a login path, and without an operator role.
            .nest("/bare", Console::new(conveyor.admin()).router())
            .nest("/off", Console::unavailable("configure the operator role").router())
            .layer(middleware::from_fn_with_state(sessions.clone(), authenticate))
            .with_state(sessions.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let stop = shutdown.clone();
        tokio::spawn(async move {
            axum::serve(listener, app).with_graceful_shutdown(stop.cancelled_owned()).await.unwrap();
        });

        let fine = conveyor.enqueue(&Deliver { flaky: false }, EnqueueOptions::new()).await.unwrap();
        let dead = conveyor.enqueue(&Deliver { flaky: true }, EnqueueOptions::new()).await.unwrap();
        let wait = |id| conveyor.wait_for_job(id, Duration::from_secs(30));
        assert_eq!(wait(fine.id).await.unwrap().status, JobStatus::Succeeded);
        assert_eq!(wait(dead.id).await.unwrap().status, JobStatus::Failed, "the flaky delivery dead-letters");
        Self { url, conveyor, sessions, succeed, dead: dead.id, shutdown }
    }

    fn at(&self, path: &str) -> String {
        format!("{}{path}", self.url)
    }

    /// `path`'s JSON, fetched with `cookie`.
    async fn json(&self, path: &str, cookie: &str) -> Value {
        let answer = reqwest::Client::new().get(self.at(path)).header("cookie", cookie).send().await.unwrap();
        answer.json().await.unwrap()
    }

    /// A session of the host's, as its login would start it: (cookie, CSRF token).
    fn session(&self) -> (String, String) {
        let (id, csrf) = ("test-session".to_owned(), "test-csrf-token".to_owned());
        self.sessions.lock().unwrap().insert(id.clone(), ("api".to_owned(), csrf.clone()));
        (format!("host_session={id}"), csrf)
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

#[tokio::test]
async fn an_operator_logs_in_to_the_host_sees_the_queue_and_replays_a_dead_letter_under_its_prefix_in_chromium() {
    let Some(browser) = browser_or_skip().await else { return };
    let host = Host::start().await;

    // The console sends a visitor without the host's session to the host's login, which brings them back.
    browser.goto(&host.at("/ops/jobs/queues/deliveries")).await;
    let login = "/login?next=%2Fops%2Fjobs%2Fqueues%2Fdeliveries";
    assert_eq!(browser.path_at(login).await, login);
    browser.type_into("#user", "grace").await;
    browser.type_into("#password", PASSWORD).await;
    browser.click("button[type=submit]").await;
    assert_eq!(browser.path_at("/ops/jobs/queues/deliveries").await, "/ops/jobs/queues/deliveries");

    // The queue: one succeeded, one dead; the header names the host's operator and links under the prefix.
    assert_eq!(browser.text("#counts [data-state=dead] .n").await, "1");
    assert!(browser.text("header .who").await.contains("host:grace"));
    let jobs = browser.client.find_all(fantoccini::Locator::Css("#jobs tbody tr")).await.unwrap();
    assert_eq!(jobs.len(), 2, "the queue's two jobs");

    // The dead letters, through the navigation; the letter with its reason.
    browser.click("header nav a[href='/ops/jobs/dead-letters']").await;
    assert_eq!(browser.path_at("/ops/jobs/dead-letters").await, "/ops/jobs/dead-letters");
    let row = format!("#dead-letters tr[data-job='{}']", host.dead.0);
    assert!(browser.text(&format!("{row} td.err")).await.contains("the carrier refused the parcel"));

    // Replay it with the handler now succeeding: the list says so, and the job succeeds.
    host.succeed.store(true, Ordering::SeqCst);
    browser.click(&format!("{row} form[action$='/replay'] button")).await;
    let replayed = "/ops/jobs/dead-letters?notice=replayed";
    assert_eq!(browser.path_at(replayed).await, replayed);
    assert!(browser.text("[role=status]").await.contains("Replayed"));
    let done = host.conveyor.wait_for_job(host.dead, Duration::from_secs(30)).await.unwrap();
    assert_eq!(done.status, JobStatus::Succeeded, "the replayed delivery succeeds");

    // Its job page, under the prefix, says so too; the audit trail names the host's operator.
    browser.goto(&host.at(&format!("/ops/jobs/jobs/{}", host.dead.0))).await;
    let status = browser.element("#status").await;
    assert_eq!(status.attr("data-status").await.unwrap().as_deref(), Some("succeeded"));
    let (cookie, _) = host.session();
    let audit = host.json("/ops/jobs/api/v1/audit", &cookie).await;
    let replay = audit["items"].as_array().unwrap().iter().find(|e| e["action"] == "replay_dead_letter");
    assert_eq!(replay.map(|e| e["actor"].clone()), Some(json!("host:grace")), "{audit}");

    // The host's logout button, from the console's header, ends the session: the console sends to the login again.
    browser.click("header .who form button").await;
    assert_eq!(browser.path_at("/login").await, "/login");
    browser.goto(&host.at("/ops/jobs")).await;
    assert_eq!(browser.path_at("/login").await, "/login");

    browser.client.clone().close().await.unwrap();
}

#[tokio::test]
async fn under_the_hosts_prefix_the_api_and_the_forms_need_the_hosts_operator_and_its_csrf_token() {
    let host = Host::start().await;
    let http = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap();
    let (cookie, csrf) = host.session();

    // Without the host's session: the API says 401, a page sends to the host's login, a form changes nothing.
    let api = http.get(host.at("/ops/jobs/api/v1/queues")).send().await.unwrap();
    assert_eq!(api.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(api.headers()["content-type"], "application/problem+json");
    let page = http.get(host.at("/ops/jobs/dead-letters?queue=deliveries")).send().await.unwrap();
    assert_eq!(page.status(), StatusCode::SEE_OTHER);
    assert_eq!(page.headers()[LOCATION], "/login?next=%2Fops%2Fjobs%2Fdead-letters%3Fqueue%3Ddeliveries");
    let replay = format!("/ops/jobs/dead-letters/{}/replay", host.dead.0);
    let form = http.post(host.at(&replay)).form(&[("csrf", csrf.as_str())]).send().await.unwrap();
    assert_eq!((form.status(), &form.headers()[LOCATION]), (StatusCode::SEE_OTHER, &"/login".parse().unwrap()));

    // With it: the API lists the queue; a change without the session's CSRF token is refused, with it done.
    let queues = host.json("/ops/jobs/api/v1/queues", &cookie).await;
    let deliveries = queues["items"].as_array().unwrap().iter().find(|q| q["name"] == "deliveries").cloned();
    assert_eq!(deliveries.map(|q| q["counts"]["dead"].clone()), Some(json!(1)), "{queues}");
    let pause =
        || http.post(host.at("/ops/jobs/api/v1/pauses")).header("cookie", &cookie).json(&json!({ "queue": "x" }));
    assert_eq!(pause().send().await.unwrap().status(), StatusCode::FORBIDDEN);
    assert_eq!(pause().header("x-csrf-token", "wrong").send().await.unwrap().status(), StatusCode::FORBIDDEN);
    assert_eq!(pause().header("x-csrf-token", &csrf).send().await.unwrap().status(), StatusCode::CREATED);

    // A form without the token, or from another site, is refused and the letter stays dead; with both it is
    // replayed, and the redirect stays under the prefix.
    let post = |fields: Vec<(&'static str, String)>, origin: &str| {
        http.post(host.at(&replay)).header("cookie", &cookie).header("origin", origin).form(&fields).send()
    };
    let same = host.url.clone();
    assert_eq!(post(vec![], &same).await.unwrap().status(), StatusCode::FORBIDDEN);
    let evil = post(vec![("csrf", csrf.clone())], "http://evil.example").await.unwrap();
    assert_eq!(evil.status(), StatusCode::FORBIDDEN);
    assert!(evil.text().await.unwrap().contains("Origin is not this site"));
    assert_eq!(host.conveyor.get_job(host.dead).await.unwrap().unwrap().status, JobStatus::Failed);
    let done = post(vec![("csrf", csrf.clone())], &same).await.unwrap();
    assert_eq!(done.status(), StatusCode::SEE_OTHER);
    assert_eq!(done.headers()[LOCATION], "/ops/jobs/dead-letters?notice=replayed");

    // The API refuses a change a browser sends from another site, the session's token or not.
    let cross = pause().header("x-csrf-token", &csrf).header("origin", "http://evil.example").send().await.unwrap();
    assert_eq!(cross.status(), StatusCode::FORBIDDEN);
    assert_eq!(cross.json::<Value>().await.unwrap()["code"], "CROSS_SITE_REFUSED");
    // A script's bearer token needs no CSRF token, but still no other site's origin.
    let script = || {
        http.post(host.at("/ops/jobs/api/v1/pauses"))
            .bearer_auth(SCRIPT_TOKEN)
            .json(&json!({ "queue": "y", "reason": "by script" }))
    };
    assert_eq!(script().header("origin", "http://evil.example").send().await.unwrap().status(), StatusCode::FORBIDDEN);
    assert_eq!(script().send().await.unwrap().status(), StatusCode::CREATED);
    let pauses: Value = http
        .get(host.at("/ops/jobs/api/v1/pauses"))
        .bearer_auth(SCRIPT_TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let queues: Vec<&str> = pauses["items"].as_array().unwrap().iter().filter_map(|p| p["queue"].as_str()).collect();
    assert_eq!(queues.len(), 2, "the session's pause and the script's: {pauses}");

    // A console without a login path answers 401 to a visitor; one without an operator role, 503 to an operator.
    let bare = http.get(host.at("/bare/jobs")).send().await.unwrap();
    assert_eq!(bare.status(), StatusCode::UNAUTHORIZED);
    assert!(bare.text().await.unwrap().contains("Not signed in"));
    let off = http.get(host.at("/off")).header("cookie", &cookie).send().await.unwrap();
    assert_eq!(off.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(off.text().await.unwrap().contains("configure the operator role"));
    let off_api = http.get(host.at("/off/api/v1/queues")).header("cookie", &cookie).send().await.unwrap();
    assert_eq!(off_api.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(off_api.json::<Value>().await.unwrap()["code"], "ADMIN_NOT_CONFIGURED");
    assert_eq!(http.get(host.at("/off/api/v1/queues")).send().await.unwrap().status(), StatusCode::UNAUTHORIZED);

    // The pages' links, the stylesheet and the error pages are under the prefix; the host's own routes are its own.
    let home = http.get(host.at("/ops/jobs")).header("cookie", &cookie).send().await.unwrap();
    assert_eq!(home.status(), StatusCode::OK);
    let home = home.text().await.unwrap();
    for link in ["href=\"/ops/jobs/static/ui.css\"", "href=\"/ops/jobs/dead-letters\"", "action=\"/logout\""] {
        assert!(home.contains(link), "{link} in {home}");
    }
    assert!(!home.contains("href=\"/jobs") && !home.contains("/ui/"), "no link leaves the prefix: {home}");
    let css = http.get(host.at("/ops/jobs/static/ui.css")).send().await.unwrap();
    assert_eq!(
        (css.status(), &css.headers()["content-type"]),
        (StatusCode::OK, &"text/css; charset=utf-8".parse().unwrap())
    );
    let missing = http.get(host.at("/ops/jobs/jobs/not-a-uuid")).header("cookie", &cookie).send().await.unwrap();
    assert_eq!(missing.status(), StatusCode::BAD_REQUEST);
    assert!(missing.text().await.unwrap().contains("href=\"/ops/jobs\""), "the error page links home under the prefix");
    assert_eq!(http.get(host.at("/")).send().await.unwrap().text().await.unwrap(), "the host's own home");
}
