//! External HTTPS: the marketplace client speaks TLS through rustls, trusts a private CA named by
//! `CONVEYOR_TLS_CA_FILE`, and refuses a server it cannot verify. The sandbox serves https with a certificate of a CA
//! made by the test.

use crate::common;

use std::time::Duration;

use common::pki::Pki;
use common::{Process, TestApp, principal};
use conveyor_shop::adapters::marketplace::{HttpMarketplace, Marketplace, MarketplaceError, Verification};
use conveyor_shop::adapters::sandbox::{Sandbox, SandboxTls, Settings};
use reqwest::Method;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// The sandbox's TLS: the server certificate (for `localhost` and `127.0.0.1`) of the test's CA.
fn sandbox_tls(pki: &Pki) -> SandboxTls {
    SandboxTls::from_pem(pki.server_chain_pem.clone().into_bytes(), pki.server_key_pem.clone().into_bytes()).unwrap()
}

async fn https_sandbox(tls: SandboxTls) -> (Sandbox, String) {
    let sandbox = Sandbox::new(Settings::default());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("https://localhost:{}", listener.local_addr().unwrap().port());
    tokio::spawn(sandbox.clone().serve_tls(listener, tls, CancellationToken::new()));
    (sandbox, url)
}

fn credentials(api_key: &str) -> std::collections::BTreeMap<String, String> {
    [("api_key".to_owned(), api_key.to_owned())].into()
}

#[tokio::test]
async fn the_marketplace_client_verifies_the_server_against_the_configured_ca() {
    let pki = Pki::new();
    let (sandbox, url) = https_sandbox(sandbox_tls(&pki)).await;

    let trusting = HttpMarketplace::trusting(&url, Duration::from_secs(5), Some(&pki.ca_file)).unwrap();
    let answer = trusting.verify_credentials("token-1", &credentials("good")).await.unwrap();
    assert_eq!(answer, Verification::Valid);
    assert_eq!(sandbox.stats().effects, 1);

    // Without the CA the server's certificate is unknown: the call fails before any request reaches the sandbox.
    let untrusting = HttpMarketplace::new(&url, Duration::from_secs(5));
    let refused = untrusting.verify_credentials("token-2", &credentials("good")).await;
    assert!(matches!(refused, Err(MarketplaceError::Transient(_))), "{refused:?}");
    assert_eq!(sandbox.stats().calls, 1, "no request was made over an unverified connection");
}

#[tokio::test]
async fn a_ca_file_that_is_not_pem_is_a_clear_error() {
    let path = std::env::temp_dir().join(format!("conveyor-test-bad-ca-{}.pem", uuid::Uuid::new_v4().simple()));
    std::fs::write(&path, "not a certificate").unwrap();
    let error = HttpMarketplace::trusting("https://localhost:1", Duration::from_secs(1), Some(&path)).err().unwrap();
    assert!(error.to_string().contains("CONVEYOR_TLS_CA_FILE"), "{error}");
    let missing = std::env::temp_dir().join("conveyor-no-such-ca.pem");
    let error = HttpMarketplace::trusting("https://localhost:1", Duration::from_secs(1), Some(&missing)).err().unwrap();
    assert!(error.to_string().contains("cannot be read"), "{error}");
}

#[tokio::test]
async fn a_worker_process_verifies_a_store_over_https() {
    let app = TestApp::spawn().await;
    let pki = Pki::new();
    let (sandbox, url) = https_sandbox(sandbox_tls(&pki)).await;
    let shutdown = CancellationToken::new();
    common::run_dispatcher(common::test_dispatcher(&app, &common::redis_url(), |_| {}).await, &shutdown);
    let mut vars = common::config_vars(&app.db, &app.redis_prefix);
    vars.insert("CONVEYOR_ADMIN_ADDR".into(), format!("127.0.0.1:{}", common::free_port()));
    vars.insert("CONVEYOR_MARKETPLACE_URL".into(), url);
    vars.insert("CONVEYOR_TLS_CA_FILE".into(), pki.ca_file.display().to_string());
    let mut worker = Process::spawn(&["worker"], &vars);

    let who = principal();
    let body = json!({"name": "Shop", "platform": "sandbox", "credentials": {"api_key": "good", "api_secret": "s"}});
    let created: Value = app.send(Method::POST, "/v1/stores", who, Some(&body)).await.json().await.unwrap();
    let op_id = created["operation"]["id"].as_str().unwrap();
    let op = common::operation_reaches(&app, who, op_id, "succeeded", Duration::from_secs(30)).await;
    assert!(op.is_some(), "verified over https; worker log:\n{}", worker.log());
    assert_eq!(op.unwrap()["result"]["outcome"], "active");
    assert_eq!(sandbox.stats().effects, 1);
    worker.kill();
    shutdown.cancel();
}

#[tokio::test]
async fn a_transfer_downloads_over_https_from_a_server_the_configured_ca_vouches_for() {
    use sha2::Digest;
    let pki = Pki::new();
    let ca_file = pki.ca_file.display().to_string();
    let (sandbox, url) = https_sandbox(sandbox_tls(&pki)).await;
    let trusting = {
        let (url, ca_file) = (url.clone(), ca_file.clone());
        TestApp::spawn_with(move |vars| {
            vars.insert("CONVEYOR_ASSET_ALLOWED_NETWORKS".into(), "127.0.0.0/8,::1/128".into());
            // The sandbox listens on a random port; transfers reach 80 and 443 only unless told more.
            let port = url.rsplit(':').next().unwrap().to_owned();
            vars.insert("CONVEYOR_ASSET_ALLOWED_PORTS".into(), port);
            vars.insert("CONVEYOR_MARKETPLACE_URL".into(), url);
            vars.insert("CONVEYOR_TLS_CA_FILE".into(), ca_file);
        })
        .await
    };
    let shutdown = CancellationToken::new();
    common::run_dispatcher(common::test_dispatcher(&trusting, &common::redis_url(), |_| {}).await, &shutdown);
    let state = conveyor_server::http::AppState(std::sync::Arc::new(
        conveyor_server::app::connect_state(&trusting.config, conveyor_jobs::Metrics::new()).await.unwrap(),
    ));
    let worker = conveyor_server::app::build_worker(&trusting.config, &state).await.unwrap();
    tokio::spawn(worker.run(shutdown.clone(), Duration::from_secs(5)));

    let who = principal();
    let source = format!("{url}/files/tls.png?size=300000&content_type=image/png");
    let body = json!({"source_url": source, "filename": "tls.png"});
    let created: Value =
        trusting.send(Method::POST, "/v1/asset-transfers", who, Some(&body)).await.json().await.unwrap();
    let path = format!("/v1/asset-transfers/{}", created["asset_transfer"]["id"].as_str().unwrap());
    let done = common::eventually(Duration::from_secs(30), || async {
        let t: Value = trusting.send(Method::GET, &path, who, None).await.json().await.unwrap();
        matches!(t["status"].as_str(), Some("completed" | "failed")).then_some(t)
    })
    .await
    .expect("the transfer ended");
    assert_eq!(done["status"], "completed", "{done}");
    let expected: String =
        sha2::Sha256::digest(conveyor_shop::adapters::sandbox::files::file_bytes("tls.png", 300_000))
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
    assert_eq!(done["sha256"], expected);
    assert!(sandbox.stats().file_bytes_served >= 300_000);
    shutdown.cancel();
}

/// What a plain local HTTP server received: each request's method, path and body.
type Received = std::sync::Arc<std::sync::Mutex<Vec<(String, String, String)>>>;

/// A local HTTP server answering every request with `status`, `location` (if any) and `body`, recording what it got.
async fn recording_server(status: u16, location: Option<String>, body: &'static str) -> (String, Received) {
    use axum::http::{HeaderValue, StatusCode, header};
    use axum::response::IntoResponse;
    let received: Received = Default::default();
    let seen = received.clone();
    let app = axum::Router::new().fallback(move |method: axum::http::Method, uri: axum::http::Uri, sent: String| {
        let (seen, location) = (seen.clone(), location.clone());
        async move {
            seen.lock().unwrap().push((method.to_string(), uri.path().to_owned(), sent));
            let mut response =
                (StatusCode::from_u16(status).unwrap(), [(header::CONTENT_TYPE, "application/json")], body)
                    .into_response();
            if let Some(location) = location {
                response.headers_mut().insert(header::LOCATION, HeaderValue::from_str(&location).unwrap());
            }
            response
        }
    });
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, received)
}

#[tokio::test]
async fn the_marketplace_client_never_follows_a_redirect_with_the_stores_credentials() {
    use conveyor_shop::adapters::marketplace::NewProduct;
    const SECRET: &str = "api-key-3f9b1c";
    // Where a redirect would lead: it would answer like the marketplace, and must never be asked anything.
    let (elsewhere, elsewhere_got) =
        recording_server(200, None, r#"{"valid": true, "id": "product-from-elsewhere"}"#).await;
    for status in [307, 308, 301, 302, 303] {
        let (url, got) = recording_server(status, Some(format!("{elsewhere}/v1/credentials/verify")), "").await;
        let client = HttpMarketplace::new(&url, Duration::from_secs(5));

        let verified = client.verify_credentials("token-1", &credentials(SECRET)).await;
        match &verified {
            Err(MarketplaceError::Permanent(reason)) => {
                assert!(reason.starts_with(&format!("HTTP {status} ")), "{status}: {reason}");
                assert!(reason.contains("redirects are not followed"), "{status}: {reason}");
                assert!(!reason.contains(&elsewhere), "the Location is not repeated: {reason}");
            }
            other => panic!("{status}: a redirect must be a permanent error, got {other:?}"),
        }
        let product = NewProduct {
            title: "Shoe".into(),
            description: "A shoe".into(),
            price_amount: "12.50".into(),
            currency: "EUR".into(),
            media_ids: Vec::new(),
        };
        let created = client.create_product("token-2", &credentials(SECRET), &product).await;
        assert!(matches!(&created, Err(MarketplaceError::Permanent(r)) if r.contains("redirect")), "{created:?}");

        // The marketplace got each call once (the client neither followed nor retried), with the credentials.
        let got = got.lock().unwrap().clone();
        let paths: Vec<&str> = got.iter().map(|(_, path, _)| path.as_str()).collect();
        assert_eq!(paths, ["/v1/credentials/verify", "/v1/products"], "{status}");
        assert!(got.iter().all(|(method, _, body)| method == "POST" && body.contains(SECRET)), "{status}: {got:?}");
    }
    assert_eq!(elsewhere_got.lock().unwrap().len(), 0, "the redirect's target never received a request");
}
