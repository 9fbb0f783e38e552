//! TLS to PostgreSQL and Redis, against real servers that speak TLS only: a PostgreSQL of the test's own with
//! `ssl = on` and `hostssl` lines alone, and a `redis-server --tls-port` (no plain port) that requires a client
//! certificate, both with certificates of a CA the test makes. A job runs end to end over both, in real dispatcher
//! and worker processes; a plain URL to the TLS-only Redis and a CA that did not sign the servers' certificates are
//! refused at start-up with a message naming the variable to fix.

use crate::common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use common::pki::Pki;
use common::postgres::{PostgresTls, TestPostgres};
use common::{Process, TestApp, TestRedis, principal};
use reqwest::Method;
use serde_json::{Value, json};

/// A TLS-only PostgreSQL (migrated as `conveyor migrate` does, over TLS) and a TLS-only Redis.
async fn servers(pki: &Pki) -> (TestPostgres, TestRedis) {
    let pg = TestPostgres::start_tls(PostgresTls {
        cert_chain_pem: pki.server_chain_pem.clone(),
        key_pem: pki.server_key_pem.clone(),
        ca_file: pki.ca_file.clone(),
    })
    .await;
    let redis = TestRedis::start_tls(pki.redis_server()).await;
    (pg, redis)
}

/// The Redis TLS variables: the CA and the client certificate.
fn redis_tls_vars(pki: &Pki, redis: &TestRedis, vars: &mut HashMap<String, String>) {
    vars.insert("CONVEYOR_REDIS_URL".into(), redis.url());
    pki.redis_vars(vars);
}

#[tokio::test]
async fn a_job_runs_end_to_end_with_postgresql_and_redis_both_over_verified_tls() {
    let pki = Pki::new();
    let (pg, redis) = servers(&pki).await;
    let db = pg.test_db().await;
    assert!(db.app_url.contains("sslmode=verify-full"), "{}", db.app_url);
    let (ssl,): (bool,) =
        sqlx::query_as("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").fetch_one(&db.pool).await.unwrap();
    assert!(ssl, "the application role's pool speaks TLS");

    let (sandbox, marketplace) = common::sandbox(Default::default()).await;
    let app = TestApp::spawn_on_db(Arc::clone(&db), |vars| redis_tls_vars(&pki, &redis, vars)).await;
    let mut vars = common::config_vars(&db, &app.redis_prefix);
    redis_tls_vars(&pki, &redis, &mut vars);
    vars.insert("CONVEYOR_MARKETPLACE_URL".into(), marketplace);
    let processes: Vec<Process> = ["dispatcher", "worker"]
        .into_iter()
        .map(|role| {
            let mut vars = vars.clone();
            vars.insert("CONVEYOR_ADMIN_ADDR".into(), format!("127.0.0.1:{}", common::free_port()));
            Process::spawn(&[role], &vars)
        })
        .collect();

    let who = principal();
    let body = json!({"name": "Shop", "platform": "sandbox", "credentials": {"api_key": "good", "api_secret": "s"}});
    let created: Value = app.send(Method::POST, "/v1/stores", who, Some(&body)).await.json().await.unwrap();
    let op_id = created["operation"]["id"].as_str().unwrap();
    let op = common::operation_reaches(&app, who, op_id, "succeeded", Duration::from_secs(60)).await;
    let logs: Vec<String> = processes.iter().map(Process::log).collect();
    assert!(op.is_some(), "the job ran over TLS; logs:\n{}", logs.join("\n---\n"));
    assert_eq!(sandbox.stats().effects, 1);

    // Every connection of Conveyor's roles to this server was over TLS.
    let mut superuser = pg.superuser().await;
    let (plain,): (i64,) = sqlx::query_as(
        "SELECT count(*) FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)
         WHERE a.usename LIKE 'conveyor%' AND NOT s.ssl",
    )
    .fetch_one(&mut superuser)
    .await
    .unwrap();
    assert_eq!(plain, 0);
    // And Redis holds the job's stream, written by the dispatcher over TLS.
    let client = common::redis_client_with(&redis.url(), &pki.redis_client()).await;
    let keys: Vec<String> =
        fred::interfaces::KeysInterface::scan_page(&client, "0", &format!("{}:*", app.redis_prefix), Some(1000), None)
            .await
            .map(|(_, keys): (String, Vec<String>)| keys)
            .unwrap_or_default();
    assert!(keys.iter().any(|k| k.ends_with(":stream")), "{keys:?}");
}

#[tokio::test]
async fn a_plain_url_to_a_tls_only_redis_or_a_wrong_ca_fails_at_start_up_naming_the_variable() {
    let pki = Pki::new();
    let (pg, redis) = servers(&pki).await;
    let db = pg.test_db().await;
    let base = {
        let mut vars = common::config_vars(&db, "conveyor-tls-refused");
        redis_tls_vars(&pki, &redis, &mut vars);
        vars.insert("CONVEYOR_ADMIN_ADDR".into(), format!("127.0.0.1:{}", common::free_port()));
        vars.insert("CONVEYOR_HTTP_ADDR".into(), format!("127.0.0.1:{}", common::free_port()));
        vars
    };

    // redis:// to a server that speaks TLS only.
    let mut plain = base.clone();
    plain.insert("CONVEYOR_REDIS_URL".into(), format!("redis://127.0.0.1:{}", redis.port));
    for name in ["CONVEYOR_REDIS_CA_FILE", "CONVEYOR_REDIS_CLIENT_CERT_FILE", "CONVEYOR_REDIS_CLIENT_KEY_FILE"] {
        plain.remove(name);
    }
    let log = Process::spawn(&["dispatcher"], &plain).fails_at_start().await;
    assert!(log.contains("CONVEYOR_REDIS_URL") && log.contains("rediss://"), "{log}");

    // The CA files set beside a plain URL: refused before connecting.
    let mut mixed = base.clone();
    mixed.insert("CONVEYOR_REDIS_URL".into(), format!("redis://127.0.0.1:{}", redis.port));
    let log = Process::spawn(&["dispatcher"], &mixed).fails_at_start().await;
    assert!(log.contains("CONVEYOR_REDIS_CA_FILE") && log.contains("does not ask for TLS"), "{log}");

    // rediss:// verified against a CA that did not sign Redis's certificate.
    let mut wrong_redis_ca = base.clone();
    wrong_redis_ca.insert("CONVEYOR_REDIS_CA_FILE".into(), pki.other_ca_file.display().to_string());
    let log = Process::spawn(&["api"], &wrong_redis_ca).fails_at_start().await;
    assert!(log.contains("CONVEYOR_REDIS_CA_FILE") && log.contains("certificate"), "{log}");

    // PostgreSQL verified against a CA that did not sign its certificate.
    let mut wrong_pg_ca = base.clone();
    let wrong = db.app_url.replace(&pki.ca_file.display().to_string(), &pki.other_ca_file.display().to_string());
    assert_ne!(wrong, db.app_url);
    wrong_pg_ca.insert("CONVEYOR_DATABASE_URL".into(), wrong);
    let log = Process::spawn(&["api"], &wrong_pg_ca).fails_at_start().await;
    assert!(log.contains("CONVEYOR_DATABASE_URL") && log.to_lowercase().contains("certificate"), "{log}");

    // Plain text to the TLS-only PostgreSQL: the server refuses it (sslmode=disable never falls back to TLS either).
    let mut plain_pg = base.clone();
    let (url, _) = db.app_url.split_once('?').unwrap();
    plain_pg.insert("CONVEYOR_DATABASE_URL".into(), format!("{url}?sslmode=disable"));
    let log = Process::spawn(&["api"], &plain_pg).fails_at_start().await;
    assert!(log.contains("CONVEYOR_DATABASE_URL") && log.contains("no encryption"), "{log}");

    // A CA file that does not exist: a configuration error, before any connection.
    let mut missing = base.clone();
    missing.insert("CONVEYOR_REDIS_CA_FILE".into(), "/nonexistent/ca.pem".into());
    let log = Process::spawn(&["dispatcher"], &missing).fails_at_start().await;
    assert!(log.contains("CONVEYOR_REDIS_CA_FILE") && log.contains("/nonexistent/ca.pem"), "{log}");
}
