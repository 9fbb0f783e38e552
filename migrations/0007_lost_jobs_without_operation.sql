-- PostgreSQL heals Redis for jobs without an operation too. The reconciler re-drives an operation that made no
-- progress; a job without one has no such sign, so the maintenance role asks Redis instead: a job still `dispatched`
-- (handed to the workers, its end not recorded) whose stream entry no longer exists was lost by Redis (a restart
-- without persistence), because workers delete an entry only after its job's end is recorded. This function lists
-- the workspaces holding such candidates, dispatched longer ago than `older_than`: ids only.
SET LOCAL search_path = conveyor;

CREATE FUNCTION conveyor_unattended_dispatched_workspaces(older_than interval, max_workspaces integer)
    RETURNS TABLE (workspace_id uuid)
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, conveyor
    AS $$
        SELECT DISTINCT e.workspace_id
        FROM conveyor.outbox_events e
        WHERE e.status = 'dispatched' AND e.operation_id IS NULL AND e.dispatched_at <= now() - older_than
        LIMIT greatest(1, least(max_workspaces, 10000))
    $$;
REVOKE ALL ON FUNCTION conveyor_unattended_dispatched_workspaces(interval, integer) FROM PUBLIC;
