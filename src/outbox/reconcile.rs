//! The reconciler: PostgreSQL heals Redis. An operation still `queued` or `running` whose event was handed off
//! (`dispatched`) and which has shown no progress for a while has lost its job somewhere: Redis restarted without
//! persistence, the entry was trimmed, the consumer vanished. Its event goes back through the outbox with a new
//! re-drive generation, which gets it past the de-dup key of the earlier hand-off. Workers being re-entrant (a
//! finished operation is skipped, one run per job id at a time) makes a re-drive of work that was merely slow safe.
//!
//! A job without an operation shows no progress to judge it by, so [`redrive_lost`] asks Redis: a job still
//! `dispatched` whose stream entry no longer exists was lost, since workers delete an entry only after its job's end
//! is recorded. One that waits in a long backlog, or runs, keeps its entry and is left alone.

use std::time::Duration;

use sqlx::PgPool;
use uuid::Uuid;

use crate::db;
use crate::ids::WorkspaceId;
use crate::stream::RedisClient;
use crate::stream::keys::{Keys, parse_stream_ref};

/// Re-drives the events of operations stalled for `stalled_for`, at most `limit` per workspace. Returns how many.
pub(crate) async fn redrive_stalled(pool: &PgPool, stalled_for: Duration, limit: i64) -> Result<u64, sqlx::Error> {
    let secs = stalled_for.as_secs_f64();
    let workspaces: Vec<(Uuid,)> = sqlx::query_as(
        "SELECT workspace_id FROM conveyor.conveyor_stalled_operation_workspaces(make_interval(secs => $1), 1000)",
    )
    .bind(secs)
    .fetch_all(pool)
    .await?;
    let mut redriven = 0;
    for (workspace,) in workspaces {
        let mut tx = db::begin_workspace(pool, WorkspaceId(workspace)).await?;
        let moved = super::transitions::redrive_stalled_tx(&mut tx, WorkspaceId(workspace), stalled_for, limit).await?;
        if moved > 0 {
            tracing::warn!(workspace = %workspace, events = moved, "Re-driven stalled jobs from PostgreSQL");
        }
        tx.commit().await?;
        redriven += moved;
    }
    Ok(redriven)
}

/// Re-drives the jobs without an operation that were dispatched more than `older_than` ago and whose stream entry
/// Redis no longer has, at most `limit` per workspace. Returns how many.
pub(crate) async fn redrive_lost(
    pool: &PgPool,
    redis: &RedisClient,
    keys: &Keys,
    older_than: Duration,
    limit: i64,
) -> anyhow::Result<u64> {
    let secs = older_than.as_secs_f64();
    let workspaces: Vec<(Uuid,)> = sqlx::query_as(
        "SELECT workspace_id FROM conveyor.conveyor_unattended_dispatched_workspaces(make_interval(secs => $1), 1000)",
    )
    .bind(secs)
    .fetch_all(pool)
    .await?;
    let mut redriven = 0;
    for (workspace,) in workspaces {
        let workspace = WorkspaceId(workspace);
        let mut tx = db::begin_workspace(pool, workspace).await?;
        let candidates: Vec<(Uuid, String, String)> = sqlx::query_as(
            "SELECT id, queue, stream_id FROM conveyor.outbox_events
             WHERE status = 'dispatched' AND operation_id IS NULL AND stream_id IS NOT NULL
               AND dispatched_at <= now() - make_interval(secs => $1)
             ORDER BY dispatched_at LIMIT $2",
        )
        .bind(secs)
        .bind(limit)
        .fetch_all(&mut *tx)
        .await?;
        tx.commit().await?;
        let entries: Vec<(String, String)> = candidates
            .iter()
            .map(|(_, queue, stream_id)| {
                let (partition, entry_id) = parse_stream_ref(stream_id);
                (keys.partition_stream(queue, partition), entry_id.to_owned())
            })
            .collect();
        let exist = crate::stream::admin::entries_exist(redis, &entries).await?;
        let lost: Vec<(Uuid, String)> = candidates
            .into_iter()
            .zip(exist)
            .filter(|(_, exists)| !exists)
            .map(|((id, _, stream_id), _)| (id, stream_id))
            .collect();
        if lost.is_empty() {
            continue;
        }
        let mut tx = db::begin_workspace(pool, workspace).await?;
        let mut moved = 0;
        for (id, stream_id) in &lost {
            // Fenced by the entry that was found missing: a job handed off again meanwhile is left alone.
            moved += u64::from(super::transitions::redrive_tx(&mut tx, workspace, *id, stream_id).await?);
        }
        tx.commit().await?;
        tracing::warn!(workspace = %workspace, jobs = moved, "Re-driven jobs whose stream entries Redis lost");
        redriven += moved;
    }
    Ok(redriven)
}
