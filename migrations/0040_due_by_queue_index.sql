-- no-transaction
-- Each workspace's pending jobs per queue, by priority and due order (issue 28): the queue gate (0041) claims per
-- queue, each queue up to its room. Over outbox_events_due_by_priority, which has no queue, a claim that holds back
-- one queue of a workspace walked that queue's whole backlog to find the other queues' jobs, at every tick; here it
-- reads the workspace's queues with one probe each (a loose scan) and each queue's due jobs in order. A job due at
-- its commit writes one index entry more.
--
-- Built CONCURRENTLY, one statement in the file (see 0027). An interrupted build leaves an INVALID index of this
-- name, which IF NOT EXISTS would then keep: drop it (DROP INDEX CONCURRENTLY conveyor.outbox_events_due_by_queue)
-- and migrate again.
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_events_due_by_queue
    ON conveyor.outbox_events (workspace_id, queue, priority, next_attempt_at, id)
    WHERE status = 'pending';
