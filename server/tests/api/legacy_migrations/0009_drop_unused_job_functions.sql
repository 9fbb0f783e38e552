-- Tidying what 0006 and 0008 left behind, found on a second read.
-- * The two-argument look before running (0006) was replaced by the three-argument one of 0008, which also skips
--   older generations; no release ever called it.
-- * Retention purges only jobs that ended (a `dispatched` job is live since 0006), so its list of workspaces need not
--   name those with old `dispatched` rows: it visited them for nothing, and up to its limit of 1,000 they could crowd
--   out the workspaces with something to purge.
DROP FUNCTION conveyor_jobs_not_to_run(uuid[], uuid[]);

CREATE OR REPLACE FUNCTION conveyor_outbox_retention_workspaces_v2(older_than interval, max_workspaces integer)
    RETURNS TABLE (workspace_id uuid)
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, public
    AS $$
        SELECT DISTINCT e.workspace_id FROM public.outbox_events e
        WHERE e.status IN ('completed', 'canceled') AND e.finished_at <= now() - older_than
        LIMIT greatest(1, least(max_workspaces, 10000))
    $$;
