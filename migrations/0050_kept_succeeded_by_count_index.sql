-- no-transaction
-- One of the four indexes of conveyor_kept_jobs_purge (0048): partial, so that only jobs that keep a retention of
-- their own have an entry in it, once they ended that way. Built CONCURRENTLY, one statement in the file (see 0027);
-- an interrupted build leaves an INVALID index that IF NOT EXISTS would keep: drop it concurrently and migrate again.
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_events_kept_succeeded_by_count
    ON conveyor.outbox_events (workspace_id, event_type, keep_succeeded_n, finished_at, id)
    WHERE status = 'completed' AND keep_succeeded_n IS NOT NULL;
