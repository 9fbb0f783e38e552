//! The relay's claims and marks against a real PostgreSQL: confined to the named workspaces, fenced by the lease and
//! the generation, never reading the whole outbox, and never deadlocking with a worker's record of ends.

use std::time::Duration;

use uuid::Uuid;

use super::*;
use crate::JobKind;
use crate::test_db::{Ping, TestDb};

#[tokio::test]
async fn one_claim_of_several_workspaces_confines_each_to_its_own_rows_and_leaves_no_workspace_set() {
    let db = TestDb::create().await;
    let (a, b, c) = (WorkspaceId(Uuid::new_v4()), WorkspaceId(Uuid::new_v4()), WorkspaceId(Uuid::new_v4()));
    let (in_a, in_b, in_c) = (db.enqueue(a, 3).await, db.enqueue(b, 5).await, db.enqueue(c, 2).await);

    let claimed =
        claim(&db.runtime_pool, &[a, b], &[], "me", Duration::from_secs(30), &Bounds::new(4, 0)).await.unwrap();
    let of =
        |ws: WorkspaceId| -> Vec<Uuid> { claimed.iter().filter(|e| e.workspace_id == ws.0).map(|e| e.id).collect() };
    assert_eq!(of(a), in_a, "all of a's, in the order written");
    assert_eq!(of(b), in_b[..4].to_vec(), "b's first four: the batch is per workspace");
    assert!(of(c).is_empty(), "c was not named");
    assert_eq!(db.count_status(&[c], "pending").await, in_c.len());
    assert_eq!(db.count_status(&[b], "pending").await, 1);

    // Inside a caller's transaction, the call leaves no workspace behind: the next statement sees nothing.
    let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&db.runtime_url).await.unwrap();
    let mut tx = sqlx::Connection::begin(&mut conn).await.unwrap();
    let again: Vec<(String,)> =
        sqlx::query_as("SELECT tid::text FROM conveyor.conveyor_claim_outbox($1, 'me', 30, 10)")
            .bind(vec![c.0])
            .fetch_all(&mut *tx)
            .await
            .unwrap();
    assert_eq!(again.len(), in_c.len());
    let (visible,): (i64,) =
        sqlx::query_as("SELECT count(*) FROM conveyor.outbox_events").fetch_one(&mut *tx).await.unwrap();
    assert_eq!(visible, 0, "no workspace is set after the call");
    tx.rollback().await.unwrap();

    // The mark is fenced per event: a stale row version (or another holder) marks nothing.
    let delivered: Vec<Delivered> = claimed.iter().map(|e| Delivered::new(e, "1-1".into())).collect();
    let by_other = settle(&db.runtime_pool, "someone-else", &delivered, &[], 10).await.unwrap();
    assert_eq!((by_other.dispatched, by_other.lost_lease), (0, delivered.len() as u64));
    let mine = settle(&db.runtime_pool, "me", &delivered, &[], 10).await.unwrap();
    assert_eq!((mine.dispatched, mine.lost_lease), (delivered.len() as u64, 0));
    assert_eq!(db.count_status(&[a, b], "dispatched").await, delivered.len());
}

#[tokio::test]
async fn an_expired_lease_is_leased_again_and_its_old_holder_can_no_longer_mark_it() {
    let db = TestDb::create().await;
    let ws = WorkspaceId(Uuid::new_v4());
    let ids = db.enqueue(ws, 2).await;
    let pool = &db.runtime_pool;
    let first = claim(pool, &[ws], &[], "dead", Duration::from_millis(1), &Bounds::new(10, 0)).await.unwrap();
    assert_eq!(first.len(), 2);
    tokio::time::sleep(Duration::from_millis(20)).await;
    // A claim of the workspace by name (a notification's) leaves expired leases to the sweeps: it never scans for them.
    let named = claim(pool, &[ws], &[], "alive", Duration::from_secs(30), &Bounds::new(10, 0)).await.unwrap();
    assert!(named.is_empty(), "a named claim takes no expired lease: {named:?}");
    assert_eq!(db.count_status(&[ws], "dispatching").await, 2);
    let second = claim(pool, &[ws], &[ws], "alive", Duration::from_secs(30), &Bounds::new(10, 0)).await.unwrap();
    assert_eq!(second.iter().map(|e| e.id).collect::<Vec<_>>(), ids, "the expired leases, taken over");
    let delivered = |events: &[ClaimedEvent]| -> Vec<Delivered> {
        events.iter().map(|e| Delivered::new(e, "1-1".into())).collect()
    };
    let late = settle(&db.runtime_pool, "dead", &delivered(&first), &[], 10).await.unwrap();
    assert_eq!((late.dispatched, late.lost_lease), (0, 2), "the old holder's mark is fenced off");
    let settled = settle(&db.runtime_pool, "alive", &delivered(&second), &[], 10).await.unwrap();
    assert_eq!(settled.dispatched, 2);
}

#[tokio::test]
async fn a_late_record_of_an_old_generation_does_not_land_on_the_same_dispatchers_newer_claim() {
    let db = TestDb::create().await;
    let ws = WorkspaceId(Uuid::new_v4());
    let ids = db.enqueue(ws, 1).await;
    let claimed =
        claim(&db.runtime_pool, &[ws], &[], "me", Duration::from_secs(30), &Bounds::new(10, 0)).await.unwrap();
    assert_eq!((claimed.len(), claimed[0].redrive_count), (1, 0));
    // Meanwhile its job ran and asked for a retry (generation 1), and this dispatcher claimed that generation too.
    let mut tx = db::begin_workspace(&db.pool, ws).await.unwrap();
    let moved = sqlx::query("UPDATE conveyor.outbox_events SET redrive_count = 1 WHERE id = $1")
        .bind(ids[0])
        .execute(&mut *tx)
        .await
        .unwrap();
    assert_eq!(moved.rows_affected(), 1);
    tx.commit().await.unwrap();
    let stale = Failure {
        workspace: ws,
        id: ids[0],
        attempt: 1,
        delay: Duration::from_secs(1),
        error: "XADD failed: timed out".into(),
        redrive: 0,
    };
    let settled = settle(&db.runtime_pool, "me", &[], &[stale], 10).await.unwrap();
    assert_eq!((settled.retried, settled.lost_lease), (0, 1), "the generation-0 failure is fenced off");
    let event = &db.events(ws).await[0];
    assert_eq!((event["status"].as_str(), &event["attempt_count"]), (Some("dispatching"), &serde_json::json!(0)));

    // Nor does a late mark, even one that names the row's current version.
    let mut tx = db::begin_workspace(&db.pool, ws).await.unwrap();
    let (tid,): (String,) = sqlx::query_as("SELECT ctid::text FROM conveyor.outbox_events WHERE id = $1")
        .bind(ids[0])
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let mark = |redrive| Delivered {
        workspace: ws,
        tid: tid.clone(),
        id: ids[0],
        stream_id: "1-1".into(),
        queue: Ping::QUEUE.into(),
        redrive,
    };
    let late = settle(&db.runtime_pool, "me", &[mark(0)], &[], 10).await.unwrap();
    assert_eq!((late.dispatched, late.lost_lease), (0, 1), "the generation-0 mark is fenced off");
    let current = settle(&db.runtime_pool, "me", &[mark(1)], &[], 10).await.unwrap();
    assert_eq!(current.dispatched, 1, "the generation-1 mark lands");
}

#[tokio::test]
async fn the_relay_and_the_pre_run_check_never_read_the_whole_outbox_even_with_plans_made_while_it_was_empty() {
    let db = TestDb::create().await;
    let ws = WorkspaceId(Uuid::new_v4());
    // Known to be empty (as after a purge: a VACUUM records 0 pages), and no ANALYZE meanwhile, which would
    // invalidate the plans and hide a stale one.
    let mut owner = db.owner().await;
    sqlx::query("ALTER TABLE conveyor.outbox_events SET (autovacuum_enabled = false)")
        .execute(&mut owner)
        .await
        .unwrap();
    sqlx::query("VACUUM conveyor.outbox_events").execute(&mut owner).await.unwrap();
    // One connection, so that its cached plans are the ones under test: made on an empty table, then reused.
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect(&db.runtime_url).await.unwrap();
    let unknown = (ws, Uuid::new_v4(), None);
    for _ in 0..8 {
        let events = claim(&pool, &[ws], &[], "me", Duration::from_secs(30), &Bounds::new(10, 0)).await.unwrap();
        assert!(events.is_empty());
        settle(&pool, "me", &[], &[], 10).await.unwrap();
        assert!(due_workspaces(&pool, 10).await.unwrap().is_empty());
        assert_eq!(crate::outbox::transitions::to_skip(&pool, &[unknown]).await.unwrap().len(), 1);
    }
    let seq_scans = || async {
        let mut owner = db.owner().await;
        sqlx::query("SELECT pg_stat_force_next_flush()").execute(&mut owner).await.unwrap();
        let (n,): (i64,) = sqlx::query_as("SELECT seq_scan FROM pg_stat_user_tables WHERE relname = 'outbox_events'")
            .fetch_one(&mut owner)
            .await
            .unwrap();
        n
    };
    for _ in 0..20 {
        db.enqueue(ws, 100).await;
    }
    sqlx::query("SELECT pg_stat_force_next_flush()").execute(&pool).await.unwrap();
    let before = seq_scans().await;
    let mut relayed = 0;
    loop {
        // The look-up and the pre-run check, as a relay pass and a worker's read run them.
        assert_eq!(due_workspaces(&pool, 10).await.unwrap().len(), usize::from(relayed < 2000));
        let events = claim(&pool, &[ws], &[], "me", Duration::from_secs(30), &Bounds::new(100, 0)).await.unwrap();
        if events.is_empty() {
            break;
        }
        let read: Vec<_> = events.iter().map(|e| (ws, e.id, Some(e.redrive_count))).collect();
        assert!(crate::outbox::transitions::to_skip(&pool, &read).await.unwrap().is_empty());
        let delivered: Vec<Delivered> = events.iter().map(|e| Delivered::new(e, "1-1".into())).collect();
        relayed += settle(&pool, "me", &delivered, &[], 10).await.unwrap().dispatched;
    }
    assert_eq!(relayed, 2000);
    sqlx::query("SELECT pg_stat_force_next_flush()").execute(&pool).await.unwrap();
    assert_eq!(seq_scans().await, before, "no claim, mark, look-up or pre-run check read the whole table");
}

#[tokio::test]
async fn a_mark_and_a_record_of_ends_sharing_rows_wait_for_each_other_but_never_deadlock() {
    let db = TestDb::create().await;
    let ws = WorkspaceId(Uuid::new_v4());
    // The relay's and the worker's bookkeeping: the runtime role's (it enqueues under RLS as well).
    let pool = &db.runtime_pool;
    // Three jobs, a < c < x by id (UUIDv7s written in that order), claimed by the relay "me".
    let mut tx = crate::begin_workspace(pool, ws).await.unwrap();
    let jobs = [Ping { n: 0 }, Ping { n: 1 }, Ping { n: 2 }];
    crate::enqueue_many_tx(&mut tx, jobs.iter().map(|j| (j, crate::EnqueueOptions::new()))).await.unwrap();
    tx.commit().await.unwrap();
    let claimed = claim(pool, &[ws], &[], "me", Duration::from_secs(60), &Bounds::new(10, 0)).await.unwrap();
    let [a, c, x] = [0, 1, 2].map(|i| &claimed[i]);
    assert!(a.id < c.id && c.id < x.id);

    // Someone holds c for a moment.
    let mut holder = crate::begin_workspace(pool, ws).await.unwrap();
    sqlx::query("SELECT 1 FROM conveyor.outbox_events WHERE id = $1 FOR UPDATE")
        .bind(c.id)
        .execute(&mut *holder)
        .await
        .unwrap();
    // The relay marks x, c, a (taking a, then waiting for c); the worker records the ends of x and a. Each is given
    // its rows out of id order: each must lock them in that order all the same.
    let marking = {
        let (pool, ws) = (pool.clone(), ws.0);
        let (tids, ids): (Vec<String>, Vec<Uuid>) = [x, c, a].iter().map(|e| (e.tid.clone(), e.id)).unzip();
        tokio::spawn(async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT conveyor.conveyor_mark_outbox_dispatched($1, $2, $3::tid[], $4, $5, $6)",
            )
            .bind("me")
            .bind(vec![ws; 3])
            .bind(tids)
            .bind(ids)
            .bind(vec![0i32; 3])
            .bind(vec!["1-3", "1-2", "1-1"])
            .fetch_one(&pool)
            .await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let ending = {
        let (pool, ids) = (pool.clone(), vec![x.id, a.id]);
        tokio::spawn(async move {
            sqlx::query_scalar::<_, i64>("SELECT conveyor.conveyor_complete_jobs($1, $2, $3, $4)")
                .bind(vec![ws.0; 2])
                .bind(ids)
                .bind(vec![None::<i32>; 2])
                .bind(vec![serde_json::json!(null); 2])
                .fetch_one(&pool)
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    holder.commit().await.unwrap();
    // Locked in one order (workspace, then id), the two wait for each other in turn; neither is broken as a deadlock.
    let marked = marking.await.unwrap().expect("the mark is not broken as a deadlock");
    let ended = ending.await.unwrap().expect("the record of ends is not broken as a deadlock");
    assert_eq!((marked, ended), (3, 2));
    let statuses: Vec<(Uuid, String)> = {
        let mut tx = crate::begin_workspace(pool, ws).await.unwrap();
        sqlx::query_as("SELECT id, status FROM conveyor.outbox_events ORDER BY id").fetch_all(&mut *tx).await.unwrap()
    };
    assert_eq!(
        statuses,
        [(a.id, "completed".into()), (c.id, "dispatched".into()), (x.id, "completed".into())],
        "the mark went first, then the ends"
    );
}

#[tokio::test]
async fn a_job_that_ends_before_its_hand_off_is_marked_keeps_a_hand_off_time() {
    let db = TestDb::create().await;
    let ws = WorkspaceId(Uuid::new_v4());
    let pool = &db.runtime_pool;
    let mut tx = crate::begin_workspace(pool, ws).await.unwrap();
    let jobs = [Ping { n: 0 }, Ping { n: 1 }];
    crate::enqueue_many_tx(&mut tx, jobs.iter().map(|j| (j, crate::EnqueueOptions::new()))).await.unwrap();
    tx.commit().await.unwrap();
    let claimed = claim(pool, &[ws], &[], "me", Duration::from_secs(60), &Bounds::new(10, 0)).await.unwrap();
    let (fast, slow) = (&claimed[0], &claimed[1]);

    // The worker read the first from the stream and recorded its end before the relay got to mark the batch.
    let ended: i64 = sqlx::query_scalar("SELECT conveyor.conveyor_complete_jobs($1, $2, $3, $4)")
        .bind(vec![ws.0])
        .bind(vec![fast.id])
        .bind(vec![None::<i32>])
        .bind(vec![serde_json::json!(null)])
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(ended, 1);
    let delivered: Vec<Delivered> = claimed.iter().map(|e| Delivered::new(e, "1-1".into())).collect();
    assert_eq!(settle(pool, "me", &delivered, &[], 10).await.unwrap().dispatched, 1, "the ended one is left alone");

    type Row = (Uuid, String, Option<DateTime<Utc>>, Option<DateTime<Utc>>);
    let rows: Vec<Row> = {
        let mut tx = crate::begin_workspace(pool, ws).await.unwrap();
        sqlx::query_as("SELECT id, status, dispatched_at, finished_at FROM conveyor.outbox_events ORDER BY id")
            .fetch_all(&mut *tx)
            .await
            .unwrap()
    };
    let (_, status, handed_out, ended_at) = &rows[0];
    assert_eq!((rows[0].0, status.as_str()), (fast.id, "completed"));
    let (handed_out, ended_at) = (handed_out.expect("a job that ran was handed out"), ended_at.unwrap());
    assert!(handed_out <= ended_at, "handed out at {handed_out}, after its end at {ended_at}");
    assert_eq!((rows[1].0, rows[1].1.as_str()), (slow.id, "dispatched"));
    assert!(rows[1].2.is_some());
}

#[tokio::test]
async fn a_gated_queue_gives_each_workspace_of_a_claim_its_share_of_the_room_in_the_order_named() {
    let db = TestDb::create().await;
    let (light, a, b) = (WorkspaceId(Uuid::new_v4()), WorkspaceId(Uuid::new_v4()), WorkspaceId(Uuid::new_v4()));
    db.enqueue(light, 1).await;
    let (in_a, in_b) = (db.enqueue(a, 10).await, db.enqueue(b, 10).await);
    let pool = &db.runtime_pool;
    let rooms = |queues: &[&str], rooms: Vec<i32>| crate::dispatcher::Rooms {
        queues: queues.iter().map(|q| q.to_string()).collect(),
        rooms,
        light_first: 0,
    };
    let gate = |room: i32| Bounds { gated: rooms(&[Ping::QUEUE], vec![room]), ..Bounds::new(10, 256) };
    let lease = Duration::from_secs(30);

    // Room 6 over three workspaces: at most 2 each, from what the ones before left.
    let claimed = claim(pool, &[light, a, b], &[], "me", lease, &gate(6)).await.unwrap();
    let of = |ws: WorkspaceId| -> Vec<&ClaimedEvent> { claimed.iter().filter(|e| e.workspace_id == ws.0).collect() };
    assert_eq!(of(light).len(), 1);
    assert_eq!(of(a).iter().map(|e| e.id).collect::<Vec<_>>(), in_a[..2].to_vec(), "a's first two, in due order");
    assert_eq!(of(b).iter().map(|e| e.id).collect::<Vec<_>>(), in_b[..2].to_vec());
    assert_eq!(of(light)[0].workspace_class, "light", "all of its due jobs were taken");
    assert!(of(a).iter().all(|e| e.workspace_class == "backlogged"), "the gate left some of a's behind");

    // Room 1: the first workspace named takes it; no room: the queue is held for everyone.
    let claimed = claim(pool, &[b, a], &[], "me", lease, &gate(1)).await.unwrap();
    assert_eq!(claimed.iter().map(|e| e.id).collect::<Vec<_>>(), vec![in_b[2]]);
    let claimed = claim(pool, &[a, b], &[], "me", lease, &gate(0)).await.unwrap();
    assert!(claimed.is_empty(), "a gated queue without room is held");
    assert_eq!(db.count_status(&[a], "pending").await + db.count_status(&[b], "pending").await, 15);

    // Ungated (another queue's gate, or none), the window and the batch alone bound the claim.
    let other = Bounds { gated: rooms(&["another-queue"], vec![0]), ..Bounds::new(5, 256) };
    let claimed = claim(pool, &[a], &[], "me", lease, &other).await.unwrap();
    assert_eq!(claimed.iter().map(|e| e.id).collect::<Vec<_>>(), in_a[2..7].to_vec());
    let claimed = claim(pool, &[b], &[], "me", lease, &Bounds::new(100, 256)).await.unwrap();
    assert_eq!(claimed.iter().map(|e| e.id).collect::<Vec<_>>(), in_b[3..].to_vec());

    // The light workspaces at the head may take all that is left: here the first of two takes both.
    let c = WorkspaceId(Uuid::new_v4());
    let in_c = db.enqueue(c, 2).await;
    let light_first = Bounds {
        gated: crate::dispatcher::Rooms { light_first: 1, ..rooms(&[Ping::QUEUE], vec![2]) },
        ..Bounds::new(10, 256)
    };
    let claimed = claim(pool, &[c, a], &[], "me", lease, &light_first).await.unwrap();
    assert_eq!(claimed.iter().map(|e| e.id).collect::<Vec<_>>(), in_c);

    // The previous release's six-argument form claims ungated.
    let d = WorkspaceId(Uuid::new_v4());
    db.enqueue(d, 3).await;
    let (n,): (i64,) =
        sqlx::query_as("SELECT count(*) FROM conveyor.conveyor_claim_jobs_fair($1, 'old', 30, 10, 256, '{}')")
            .bind(vec![d.0])
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(n, 3);
}

/// A kind on a queue of its own, beside [`Ping`]'s.
#[derive(serde::Serialize, serde::Deserialize)]
struct Pong;

impl JobKind for Pong {
    const KIND: &'static str = "test.pong";
    const QUEUE: &'static str = "test-pongs";
}

fn gated(queue: &str, room: i32, light_first: usize) -> Bounds {
    let rooms = crate::dispatcher::Rooms { queues: vec![queue.to_owned()], rooms: vec![room], light_first };
    Bounds { gated: rooms, ..Bounds::new(10, 256) }
}

#[tokio::test]
async fn a_queue_the_gate_holds_leaves_the_workspace_backlogged_and_its_other_queues_flowing() {
    let db = TestDb::create().await;
    let ws = WorkspaceId(Uuid::new_v4());
    db.enqueue(ws, 20).await;
    let mut tx = crate::begin_workspace(&db.pool, ws).await.unwrap();
    let pong = crate::enqueue_tx(&mut tx, &Pong, crate::EnqueueOptions::new()).await.unwrap().id.0;
    tx.commit().await.unwrap();
    let claimed =
        claim(&db.runtime_pool, &[ws], &[], "me", Duration::from_secs(30), &gated(Ping::QUEUE, 0, 1)).await.unwrap();
    assert_eq!(claimed.iter().map(|e| e.id).collect::<Vec<_>>(), vec![pong], "the ungated queue's job, alone");
    assert_eq!(claimed[0].workspace_class, "backlogged", "20 jobs held by the gate are still due: not light");
}

#[tokio::test]
async fn light_first_counts_a_paused_workspace_in_its_place() {
    let db = TestDb::create().await;
    let (paused, light, flood) =
        (WorkspaceId(Uuid::new_v4()), WorkspaceId(Uuid::new_v4()), WorkspaceId(Uuid::new_v4()));
    db.enqueue(paused, 1).await;
    db.enqueue(light, 1).await;
    let in_flood = db.enqueue(flood, 10).await;
    sqlx::query("INSERT INTO conveyor.dispatch_pauses (workspace_id, reason) VALUES ($1, 'test')")
        .bind(paused.0)
        .execute(&mut db.owner().await)
        .await
        .unwrap();
    // Room 4 over three workspaces, the first two light: the flood, third, gets a fair part (2), not all that is left.
    let claimed =
        claim(&db.runtime_pool, &[paused, light, flood], &[], "me", Duration::from_secs(30), &gated(Ping::QUEUE, 4, 2))
            .await
            .unwrap();
    let of = |ws: WorkspaceId| claimed.iter().filter(|e| e.workspace_id == ws.0).map(|e| e.id).collect::<Vec<_>>();
    assert!(of(paused).is_empty());
    assert_eq!(of(light).len(), 1);
    assert_eq!(of(flood), in_flood[..2].to_vec());
}

#[tokio::test]
async fn a_claim_never_walks_the_backlog_of_a_queue_the_gate_holds() {
    let db = TestDb::create().await;
    let ws = WorkspaceId(Uuid::new_v4());
    for _ in 0..20 {
        db.enqueue(ws, 100).await;
    }
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect(&db.runtime_url).await.unwrap();
    sqlx::query("SELECT pg_stat_force_next_flush()").execute(&pool).await.unwrap();
    let before = outbox_index_reads(&db).await;
    for _ in 0..10 {
        let mut tx = crate::begin_workspace(&db.pool, ws).await.unwrap();
        crate::enqueue_tx(&mut tx, &Pong, crate::EnqueueOptions::new()).await.unwrap();
        tx.commit().await.unwrap();
        let claimed = claim(&pool, &[ws], &[], "me", Duration::from_secs(30), &gated(Ping::QUEUE, 0, 0)).await.unwrap();
        assert_eq!(claimed.len(), 1, "the other queue's job");
    }
    sqlx::query("SELECT pg_stat_force_next_flush()").execute(&pool).await.unwrap();
    let read = outbox_index_reads(&db).await - before;
    assert!(read < 2_000, "10 claims read {read} index entries beside a held backlog of 2,000");
}

#[tokio::test]
async fn the_look_up_of_due_workspaces_reads_a_few_index_entries_per_workspace_not_the_backlog() {
    let db = TestDb::create().await;
    let (flood, light, later) = (WorkspaceId(Uuid::new_v4()), WorkspaceId(Uuid::new_v4()), WorkspaceId(Uuid::new_v4()));
    for _ in 0..20 {
        db.enqueue(flood, 100).await;
    }
    db.enqueue(light, 1).await;
    let mut tx = crate::begin_workspace(&db.pool, later).await.unwrap();
    let options = crate::EnqueueOptions::new().delay(Duration::from_secs(600));
    crate::enqueue_tx(&mut tx, &Ping { n: 0 }, options).await.unwrap();
    tx.commit().await.unwrap();
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect(&db.runtime_url).await.unwrap();
    sqlx::query("SELECT pg_stat_force_next_flush()").execute(&pool).await.unwrap();
    let before = outbox_index_reads(&db).await;
    for _ in 0..10 {
        let due = due_workspaces(&pool, 100).await.unwrap();
        let mut listed: Vec<WorkspaceId> = due.iter().map(|d| d.workspace).collect();
        listed.sort_by_key(|w| w.0);
        let mut expected = vec![flood, light];
        expected.sort_by_key(|w| w.0);
        assert_eq!(listed, expected, "the two with due jobs; not the one whose only job is due in 10 minutes");
        assert!(due.iter().all(|d| !d.expired_leases));
    }
    sqlx::query("SELECT pg_stat_force_next_flush()").execute(&pool).await.unwrap();
    let read = outbox_index_reads(&db).await - before;
    assert!(read < 2_000, "10 look-ups read {read} index entries beside a backlog of 2,000");

    // A lease that expired is found, and said so.
    let claimed = claim(&pool, &[light], &[], "gone", Duration::from_secs(1), &Bounds::new(10, 0)).await.unwrap();
    assert_eq!(claimed.len(), 1);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let due = due_workspaces(&pool, 100).await.unwrap();
    let of_light: Vec<bool> = due.iter().filter(|d| d.workspace == light).map(|d| d.expired_leases).collect();
    assert_eq!(of_light, [true], "{due:?}");
}

/// Index entries read in the outbox's indexes so far, by every backend (the caller flushes its own counters first).
async fn outbox_index_reads(db: &TestDb) -> i64 {
    let mut owner = db.owner().await;
    sqlx::query("SELECT pg_stat_force_next_flush()").execute(&mut owner).await.unwrap();
    sqlx::query_scalar(
        "SELECT coalesce(sum(idx_tup_read), 0)::bigint FROM pg_stat_user_indexes WHERE relname = 'outbox_events'",
    )
    .fetch_one(&mut owner)
    .await
    .unwrap()
}

/// The statements a relay pass and a worker's pre-run check run at a trickle keep one plan per connection: PL/pgSQL
/// re-planned each of them on every call (a generic plan with a LIMIT or a workspace as a parameter looks costlier
/// than the custom ones), and the look-up of due workspaces, a non-inlinable LANGUAGE sql function, was parsed and
/// planned on every call; at 1,000 jobs/s that planning took most of PostgreSQL's time (see `scripts/bench`'s
/// latency scenario). A `CREATE OR REPLACE` that forgets the setting drops it: this test names each function.
#[tokio::test]
async fn the_relays_functions_keep_their_plans() {
    let db = TestDb::create().await;
    let mut owner = db.owner().await;
    let rows: Vec<(String, String, Vec<String>)> = sqlx::query_as(
        "SELECT p.proname::text, l.lanname::text, coalesce(p.proconfig, '{}')
         FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang
         WHERE p.pronamespace = 'conveyor'::regnamespace
           AND p.proname IN ('conveyor_due_workspaces', 'conveyor_claim_jobs_fair', 'conveyor_jobs_not_to_run',
                             'conveyor_jobs_to_skip')
           AND (p.proname <> 'conveyor_claim_jobs_fair' OR p.pronargs = 9)
         ORDER BY 1",
    )
    .fetch_all(&mut owner)
    .await
    .unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r.0.as_str()).collect();
    assert_eq!(
        names,
        ["conveyor_claim_jobs_fair", "conveyor_due_workspaces", "conveyor_jobs_not_to_run", "conveyor_jobs_to_skip"]
    );
    for (name, language, config) in &rows {
        assert_eq!(language, "plpgsql", "{name} caches its plans");
        assert!(config.iter().any(|c| c == "plan_cache_mode=force_generic_plan"), "{name}: {config:?}");
    }
    // And the PL/pgSQL look-up answers as the SQL one did.
    let ws = WorkspaceId(Uuid::new_v4());
    db.enqueue(ws, 1).await;
    let due = due_workspaces(&db.runtime_pool, 10).await.unwrap();
    assert_eq!(due.iter().map(|d| (d.workspace, d.expired_leases)).collect::<Vec<_>>(), [(ws, false)]);
}

/// A workspace with key limits and more jobs in flight than its window (here: a lower window than when its jobs were
/// claimed; in production, expired leases taken over on top of its room, or a weight lowered) has no room. With the
/// claim's plans forced generic, its negative room reached a `LIMIT` that only a custom plan folded away: "LIMIT must
/// not be negative" aborted the whole claim, every other workspace of the call with it.
#[tokio::test]
async fn a_workspace_over_its_window_with_key_limits_gets_nothing_and_fails_no_claim() {
    let db = TestDb::create().await;
    let (full, other) = (WorkspaceId(Uuid::new_v4()), WorkspaceId(Uuid::new_v4()));
    let mut tx = crate::begin_workspace(&db.pool, full).await.unwrap();
    sqlx::query("INSERT INTO conveyor.job_key_limits (workspace_id, key, max_in_flight) VALUES ($1, 'k', 5)")
        .bind(full.0)
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    db.enqueue(full, 20).await;
    let lease = Duration::from_secs(30);
    let in_flight = claim(&db.runtime_pool, &[full], &[], "me", lease, &Bounds::new(100, 0)).await.unwrap();
    assert_eq!(in_flight.len(), 20);
    db.enqueue(full, 20).await;
    let waiting = db.enqueue(other, 3).await;
    // One connection, called more often than PostgreSQL plans custom before it settles on a generic plan.
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect(&db.runtime_url).await.unwrap();
    for round in 0..8 {
        let events = claim(&pool, &[full, other], &[], "me", lease, &Bounds::new(10, 10)).await.unwrap();
        let taken: Vec<Uuid> = events.iter().filter(|e| e.workspace_id == other.0).map(|e| e.id).collect();
        assert!(events.iter().all(|e| e.workspace_id == other.0), "round {round}: the full workspace gets nothing");
        assert_eq!(taken, if round == 0 { waiting.clone() } else { Vec::new() }, "round {round}");
    }
    assert_eq!(db.count_status(&[full], "pending").await, 20);
}
