-- no-transaction
-- A queue's throughput over the last minutes (conveyor_admin_queues, 0025) reads the jobs completed since then:
-- completions are kept for days (retention), and without this index that read would walk all of them.
--
-- Built CONCURRENTLY, so the release still running keeps writing to the outbox meanwhile. PostgreSQL refuses CREATE
-- INDEX CONCURRENTLY inside a transaction, and a string of several statements runs as one; sqlx sends a
-- `-- no-transaction` file as one string, so each such file holds one statement (0028 builds the other index). An
-- interrupted build leaves an INVALID index of this name, which IF NOT EXISTS would then keep: drop it (DROP INDEX
-- CONCURRENTLY outbox_events_completed_at) and migrate again.
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_events_completed_at ON outbox_events (finished_at)
    WHERE status = 'completed';
