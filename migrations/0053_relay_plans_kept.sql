-- The relay's and the workers' statements run a few at a time at a trickle, and each paid for its plan again. Measured
-- at 1,000 jobs/s (the latency benchmark, 8 workspaces, pg_stat_statements with track = all): a claim took 9.3 ms, of
-- which its statements ran 2.4 ms; the rest was planning, since PL/pgSQL re-plans a statement whose generic plan looks
-- costlier than its custom ones (a LIMIT or a workspace given as a parameter does), and a LANGUAGE sql function that
-- cannot be inlined (this one is a SECURITY DEFINER) is parsed and planned on every call. PostgreSQL spent 1.5 cores
-- on 1,000 jobs a second, and the commit-to-start latency waited on it.
--
-- Now the relay's and the workers' functions keep one plan per statement and connection: `plan_cache_mode =
-- force_generic_plan` for the function's own statements, and the look-up of due workspaces in PL/pgSQL (same query,
-- same result) so that it has cached plans at all. Their plans stay index scans: each function already turns off
-- sequential and bitmap scans, or reads by primary key or ctid.
SET LOCAL search_path = conveyor;

CREATE OR REPLACE FUNCTION conveyor_due_workspaces(max_workspaces integer)
    RETURNS TABLE (workspace_id uuid, expired_leases boolean)
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, conveyor, pg_temp
    SET plan_cache_mode = force_generic_plan
    AS $$
    #variable_conflict use_column
    BEGIN
        RETURN QUERY
        WITH RECURSIVE pending(workspace_id) AS (
            (SELECT e.workspace_id FROM conveyor.outbox_events e
             WHERE e.status = 'pending'
             ORDER BY e.workspace_id LIMIT 1)
            UNION ALL
            SELECT (SELECT e.workspace_id FROM conveyor.outbox_events e
                    WHERE e.status = 'pending' AND e.workspace_id > p.workspace_id
                    ORDER BY e.workspace_id LIMIT 1)
            FROM pending p
            WHERE p.workspace_id IS NOT NULL
        ), due AS (
            SELECT p.workspace_id, (
                SELECT min(first.next_attempt_at)
                FROM unnest('{0,1,2}'::smallint[]) AS q(priority)
                CROSS JOIN LATERAL (
                    SELECT e.next_attempt_at FROM conveyor.outbox_events e
                    WHERE e.status = 'pending' AND e.workspace_id = p.workspace_id AND e.priority = q.priority
                    ORDER BY e.next_attempt_at LIMIT 1
                ) first
            ) AS due_at
            FROM pending p
            WHERE p.workspace_id IS NOT NULL
        )
        SELECT w.workspace_id, bool_or(w.expired)
        FROM (
            SELECT d.workspace_id, d.due_at, false AS expired
            FROM due d
            WHERE d.due_at <= now()
            UNION ALL
            SELECT e.workspace_id, min(e.locked_until), true
            FROM conveyor.outbox_events e
            WHERE e.status = 'dispatching' AND e.locked_until <= now()
            GROUP BY e.workspace_id
        ) w
        GROUP BY w.workspace_id
        ORDER BY min(w.due_at)
        LIMIT greatest(1, least(max_workspaces, 10000));
    END
    $$;

ALTER FUNCTION conveyor_claim_jobs_fair(uuid[], text, double precision, integer, integer, uuid[], text[], integer[],
                                        integer)
    SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION conveyor_jobs_not_to_run(uuid[], uuid[], integer[]) SET plan_cache_mode = force_generic_plan;
