-- no-transaction
-- The index of delayed jobs (issue 16): pending jobs due later than they were written (run_at or a delay, a retry's
-- back-off, a failed hand-off's). conveyor_next_due_after (0030), the sweep's look ahead, asks for exactly these, and
-- its WHERE implies this predicate. It takes the place of 0006's outbox_events_next_due, which 0032 drops: that index
-- held every pending job of every workspace in due order, and the planner chose it for the claim's scans of one
-- workspace's due jobs (migration 0033 says what that cost). A job due at its commit, most jobs, now writes one index
-- entry fewer.
--
-- Built CONCURRENTLY, one statement in the file (see 0027). An interrupted build leaves an INVALID index of this
-- name, which IF NOT EXISTS would then keep: drop it (DROP INDEX CONCURRENTLY outbox_events_delayed) and migrate
-- again.
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_events_delayed ON conveyor.outbox_events (next_attempt_at)
    WHERE status = 'pending' AND next_attempt_at > created_at;
