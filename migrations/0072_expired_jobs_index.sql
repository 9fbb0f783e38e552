-- no-transaction
-- The jobs canceled as expired, by when they ended: maintenance counts them per queue and minute (0073), across
-- workspaces. Only canceled jobs that had a deadline are in it (few: expiries, and cancellations of jobs with a
-- deadline), so no other job's write pays for it.
--
-- Built CONCURRENTLY, one statement alone in its file, for the reasons 0027 gives; after an interrupted build, DROP
-- INDEX CONCURRENTLY outbox_events_expired and migrate again.
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_events_expired ON conveyor.outbox_events (finished_at)
    WHERE status = 'canceled' AND expires_at IS NOT NULL;
