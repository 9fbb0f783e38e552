-- no-transaction
-- One of the four indexes of conveyor_kept_jobs_purge (0048): partial, so that only jobs that keep a retention of
-- their own have an entry in it, once they ended that way. Built CONCURRENTLY, one statement in the file (see 0027);
-- an interrupted build leaves an INVALID index that IF NOT EXISTS would keep: drop it concurrently and migrate again.
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_events_kept_failed_by_count
    ON conveyor.outbox_events (workspace_id, event_type, keep_failed_n, dead_lettered_at, id) INCLUDE (redrive_count)
    WHERE status = 'dead_letter' AND keep_failed_n IS NOT NULL;
