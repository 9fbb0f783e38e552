-- no-transaction
-- 0006's index of every pending job in due order goes (0031 says why and what replaces it). Without it, the claim's
-- scans of a workspace's due jobs and the count for its class can only walk outbox_events_due_by_priority, the
-- workspace's own due jobs; the sweep's lookup of due workspaces walks that index too, as many entries as before.
-- 0006's conveyor_next_due_at, which dispatchers of releases before 0030 call, walks every pending job without it:
-- slower for the length of a rolling upgrade, the same answer.
DROP INDEX CONCURRENTLY IF EXISTS outbox_events_next_due;
