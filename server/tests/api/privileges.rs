//! Least privilege, read from the catalogue: what each of Conveyor's roles may do to each table is exactly what the
//! README's table says ("What each role may do"), and a forbidden act fails with a permission error.

use crate::common;

use std::collections::BTreeMap;

use common::TestDb;
use sqlx::Connection;

/// The README's table: table name → (application, runtime, operator), each `read, write`, `read` or `—`.
fn readme_table() -> BTreeMap<String, [String; 3]> {
    let readme = include_str!("../../../docs/security.md");
    let start = readme.find("## What each role may do").expect("the README has the privilege table");
    let section = &readme[start..];
    let section = &section[..section[4..].find("\n#").map_or(section.len(), |i| i + 4)];
    section
        .lines()
        .filter(|line| line.starts_with("| `"))
        .map(|line| {
            let cells: Vec<String> = line.trim_matches('|').split('|').map(|c| c.trim().to_owned()).collect();
            assert_eq!(cells.len(), 4, "a row of four cells: {line}");
            (cells[0].trim_matches('`').to_owned(), [cells[1].clone(), cells[2].clone(), cells[3].clone()])
        })
        .collect()
}

/// What `role` may do to `table`, as the README writes it.
async fn rights(conn: &mut sqlx::PgConnection, role: &str, table: &str) -> String {
    let (select, insert, update, delete, truncate): (bool, bool, bool, bool, bool) = sqlx::query_as(
        "SELECT has_table_privilege($1, $2, 'SELECT'), has_table_privilege($1, $2, 'INSERT'),
                has_table_privilege($1, $2, 'UPDATE'), has_table_privilege($1, $2, 'DELETE'),
                has_table_privilege($1, $2, 'TRUNCATE')",
    )
    .bind(role)
    .bind(table)
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    match (select, insert, update, delete, truncate) {
        (false, false, false, false, false) => "—".to_owned(),
        (true, false, false, false, false) => "read".to_owned(),
        (true, true, true, true, false) => "read, write".to_owned(),
        other => format!("{other:?} (select, insert, update, delete, truncate)"),
    }
}

fn username(url: &str) -> String {
    let options: sqlx::postgres::PgConnectOptions = url.parse().unwrap();
    options.get_username().to_owned()
}

#[tokio::test]
async fn the_readme_privilege_table_is_what_the_catalogue_grants_each_role() {
    let db = TestDb::create().await;
    let mut owner = db.owner().await;
    let documented = readme_table();
    let tables: Vec<(String,)> = sqlx::query_as(
        "SELECT n.nspname || '.' || c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname IN ('conveyor', 'conveyor_shop', 'conveyor_server') AND c.relkind IN ('r', 'p', 'v', 'm')
         ORDER BY 1",
    )
    .fetch_all(&mut owner)
    .await
    .unwrap();
    let roles = [username(&db.app_url), username(&db.runtime_url), username(&db.operator_url)];
    let mut actual = BTreeMap::new();
    for (table,) in &tables {
        let mut row: [String; 3] = Default::default();
        for (i, role) in roles.iter().enumerate() {
            row[i] = rights(&mut owner, role, table).await;
        }
        actual.insert(table.clone(), row);
    }
    let mut differences = Vec::new();
    for (table, row) in &actual {
        match documented.get(table) {
            Some(doc) if doc == row => {}
            Some(doc) => differences.push(format!("{table}: README says {doc:?}, the catalogue {row:?}")),
            None => differences.push(format!("{table}: missing from the README, the catalogue says {row:?}")),
        }
    }
    for table in documented.keys().filter(|t| !actual.contains_key(*t)) {
        differences.push(format!("{table}: in the README but no such table"));
    }
    let rows: Vec<String> = actual.iter().map(|(t, [a, r, o])| format!("| `{t}` | {a} | {r} | {o} |")).collect();
    assert!(
        differences.is_empty(),
        "the README's privilege table is wrong:\n{}\n\nThe catalogue's:\n{}",
        differences.join("\n"),
        rows.join("\n")
    );
    // The runtime role never touches a business table, credentials above all.
    assert_eq!(actual["conveyor_shop.store_credentials"][1], "—");
    assert_eq!(actual["conveyor_shop.stores"][1], "—");
}

#[tokio::test]
async fn each_role_gets_a_permission_error_for_what_it_may_not_do() {
    let db = TestDb::create().await;
    let forbidden: &[(&str, &str)] = &[
        (&db.runtime_url, "SELECT * FROM conveyor_shop.store_credentials"),
        (&db.runtime_url, "SELECT * FROM conveyor_shop.stores"),
        (&db.runtime_url, "UPDATE conveyor_shop.media SET status = status"),
        (&db.runtime_url, "DELETE FROM conveyor_shop.asset_transfers"),
        // The operator's data: the runtime role reads weights and pauses, never sets them.
        (
            &db.runtime_url,
            "INSERT INTO conveyor.workspace_weights (workspace_id, weight) VALUES (gen_random_uuid(), 1000)",
        ),
        (&db.runtime_url, "DELETE FROM conveyor.dispatch_pauses"),
        (&db.operator_url, "SELECT * FROM conveyor.outbox_events"),
        (&db.operator_url, "SELECT * FROM conveyor_shop.store_credentials"),
        (&db.operator_url, "SELECT * FROM conveyor.conveyor_admin_audit"),
        (&db.operator_url, "SELECT conveyor.conveyor_due_workspaces(10)"),
        (&db.app_url, "SELECT conveyor.conveyor_due_workspaces(10)"),
        (&db.app_url, "SELECT * FROM conveyor.conveyor_admin_audit"),
        (&db.app_url, "SELECT conveyor.conveyor_admin_queues('x', NULL)"),
        (&db.app_url, "INSERT INTO conveyor.job_kinds (kind) VALUES ('forged')"),
    ];
    for (url, sql) in forbidden {
        let mut conn = sqlx::PgConnection::connect(url).await.unwrap();
        let error = sqlx::query(sqlx::AssertSqlSafe(*sql)).execute(&mut conn).await.expect_err(sql);
        let code = error.as_database_error().and_then(|e| e.code()).map(|c| c.into_owned());
        assert_eq!(code.as_deref(), Some("42501"), "{} → {error}", username(url) + ": " + sql);
    }
}
