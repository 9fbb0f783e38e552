-- no-transaction
-- Dead letters newest first (the operator's searches, bulk replay and discard: conveyor_admin_dead_letters, 0025), and
-- the tombstones of discarded ones (retention finds them here, 0025's conveyor_outbox_retention_workspaces_v2 and
-- purge_finished). Both are rare and dead letters stay until replayed or discarded, so walking the primary key back
-- to the newest of them could cross most of the table.
--
-- Built CONCURRENTLY, one statement alone in its file, for the reasons 0027 gives; after an interrupted build, DROP
-- INDEX CONCURRENTLY outbox_events_dead_by_id and migrate again.
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_events_dead_by_id ON conveyor.outbox_events (id)
    WHERE status IN ('dead_letter', 'discarded');
