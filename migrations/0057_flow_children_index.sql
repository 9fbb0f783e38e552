-- no-transaction
-- A parent's children (0056): read when its handler asks for their results, when it is canceled while it waits, and
-- by the operator's page of a job. Partial: a job that is no one's child has no entry. Built CONCURRENTLY, one
-- statement in the file (see 0027); an interrupted build leaves an INVALID index that IF NOT EXISTS would keep: drop
-- it concurrently and migrate again.
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_events_children
    ON conveyor.outbox_events (parent_id) WHERE parent_id IS NOT NULL;
