-- no-transaction
-- The jobs waiting in the outbox with a deadline (the migration before): maintenance finds those past it here. Partial,
-- so that only jobs that set a deadline have an entry, while they wait. Built CONCURRENTLY, one statement in the file;
-- an interrupted build leaves an INVALID index that IF NOT EXISTS would keep: drop it concurrently and migrate again.
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_events_expiring
    ON conveyor.outbox_events (expires_at, workspace_id)
    WHERE status = 'pending' AND expires_at IS NOT NULL;
