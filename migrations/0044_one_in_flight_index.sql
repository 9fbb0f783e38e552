-- no-transaction
-- Every job's row gets a new version at its claim and at its mark, and each version an entry in every index whose
-- predicate it meets: a job in flight wrote one into outbox_events_in_flight (workspace_id) and one into
-- outbox_events_kind_in_flight (workspace_id, event_type), under the same predicate. The second serves every count
-- the first served (the window's count of a workspace's jobs in flight reads its leading column), so the first goes:
-- two index entries fewer per job, in the WAL and in the relay's and the workers' transactions.
DROP INDEX CONCURRENTLY IF EXISTS conveyor.outbox_events_in_flight;
