-- Backlog of the outbox per queue and status, for metrics: counts and the oldest creation time only, never a
-- workspace id or a payload. Runs as the owner (SELECT policy owner_scan), callable by the application role.
CREATE FUNCTION conveyor_outbox_backlog()
    RETURNS TABLE (queue text, status text, events bigint, oldest timestamptz)
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, public
    AS $$
        SELECT e.queue, e.status, count(*), min(e.created_at)
        FROM public.outbox_events e
        WHERE e.status IN ('pending', 'dispatching', 'dead_letter')
        GROUP BY e.queue, e.status
    $$;
REVOKE ALL ON FUNCTION conveyor_outbox_backlog() FROM PUBLIC;

-- Which workspaces hold dispatched events older than the retention period: ids only, for the retention job.
CREATE FUNCTION conveyor_outbox_retention_workspaces(older_than interval, max_workspaces integer)
    RETURNS TABLE (workspace_id uuid)
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, public
    AS $$
        SELECT DISTINCT e.workspace_id
        FROM public.outbox_events e
        WHERE e.status = 'dispatched' AND e.dispatched_at <= now() - older_than
        LIMIT greatest(1, least(max_workspaces, 10000))
    $$;
REVOKE ALL ON FUNCTION conveyor_outbox_retention_workspaces(interval, integer) FROM PUBLIC;
