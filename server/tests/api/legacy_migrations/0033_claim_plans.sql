-- The claim's plans (issue 16). Inside a PL/pgSQL function the planner soon settles on a generic plan, one that knows
-- neither the workspace (it comes from the row-level security policy's setting) nor the room (a variable LIMIT), and
-- it costs an index by how closely its order follows the table's: outbox_events_next_due (every workspace's pending
-- jobs in due order, written in that order) looked cheaper than the workspace's own index. Seen with auto_explain on
-- a backlog of 100,000 jobs over 10 workspaces, before 0031 and 0032:
--
-- - Each claim scanned its workspace's priority levels over outbox_events_next_due, filtering the workspace and the
--   level out of every pending job: an empty level (no high-priority jobs, the usual case) walked all 100,000 before
--   it found none. Under a long-held snapshot the walk also met every row version the snapshot keeps, of every
--   workspace; benches/snapshot.rs counted 13.6 M entries read from it in one drain of 100,000 under a 2-minute
--   snapshot.
-- - The count for the workspace's fair-share class did the same for its 501 rows (36,000 entries walked), sometimes
--   in a parallel plan that started a worker per count.
-- - Given a generic plan, the due scan could also go by a bitmap of outbox_events_due_by_priority and a sort: every
--   due job of the workspace read, to take 500.
--
-- With outbox_events_next_due gone (0032), the workspace's own index is the one that serves these scans. Here the
-- claim is told to walk it in order and stop at its LIMIT: no bitmap scans and no parallel plans in it. Its
-- statements and their results are 0030's.
ALTER FUNCTION conveyor_claim_jobs_fair(uuid[], text, double precision, integer, integer, uuid[])
    SET enable_bitmapscan = off;
ALTER FUNCTION conveyor_claim_jobs_fair(uuid[], text, double precision, integer, integer, uuid[])
    SET max_parallel_workers_per_gather = 0;
