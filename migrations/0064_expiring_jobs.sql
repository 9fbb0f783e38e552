-- Expiring jobs (Faktory's expiring jobs, Hatchet's schedule timeout): a job may carry a deadline (`expires_at`) past
-- which it never starts. One not started by then is canceled, its reason `expired: ...` in its last error, as a
-- cancellation: its operation is canceled, a child's parent decides by the child's failure policy (a job with
-- children takes no deadline). No new state: every reader, sweep, index and trigger already knows `canceled`.
--
-- Two places see a deadline pass:
-- - the worker, as it takes the job from its stream (`conveyor_jobs_to_skip` names the jobs past their deadline
--   among those it read, beside those that must not run), and expires it instead of running it;
-- - maintenance, for jobs still waiting in the outbox (a paused queue, a limit): `conveyor_expiring_workspaces` names
--   the workspaces that hold any, through the index of the next migration, and each job is expired in its workspace
--   as the runtime role, under row-level security.
SET LOCAL search_path = conveyor;

-- Nullable, no default: added without rewriting the table.
ALTER TABLE outbox_events ADD COLUMN expires_at timestamptz;

-- `conveyor_jobs_not_to_run` (kept for the previous release's workers), with the live jobs of the current delivery
-- that are past their deadline named too, `expired`: the worker expires those. Same plans, kept generic, and the same
-- planner settings: the look-up by primary key is the only plan.
CREATE FUNCTION conveyor_jobs_to_skip(workspaces uuid[], ids uuid[], redrives integer[])
    RETURNS TABLE (id uuid, expired boolean)
    LANGUAGE plpgsql STABLE SECURITY INVOKER
    SET search_path = pg_catalog, conveyor, pg_temp
    SET plan_cache_mode = force_generic_plan
    SET enable_seqscan = off
    SET enable_bitmapscan = off
    SET enable_hashjoin = off
    SET enable_mergejoin = off
    AS $$
    #variable_conflict use_column
    DECLARE
        ws uuid;
        caller text := current_setting('app.workspace_id', true);
    BEGIN
        FOR ws IN SELECT DISTINCT w FROM unnest(workspaces) AS w LOOP
            PERFORM set_config('app.workspace_id', ws::text, true);
            RETURN QUERY
                SELECT v.id,
                       NOT (e.id IS NULL OR e.status NOT IN ('pending', 'dispatching', 'dispatched')
                            OR (v.redrive IS NOT NULL AND e.redrive_count > v.redrive))
                FROM ROWS FROM (unnest(workspaces), unnest(ids), unnest(redrives)) AS v(workspace_id, id, redrive)
                LEFT JOIN conveyor.outbox_events e ON e.id = v.id AND e.workspace_id = ws
                WHERE v.workspace_id = ws
                  AND (e.id IS NULL
                       OR e.status NOT IN ('pending', 'dispatching', 'dispatched')
                       OR (v.redrive IS NOT NULL AND e.redrive_count > v.redrive)
                       OR e.expires_at <= now());
        END LOOP;
        PERFORM set_config('app.workspace_id', coalesce(caller, ''), true);
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_jobs_to_skip(uuid[], uuid[], integer[]) FROM PUBLIC;

-- The workspaces with jobs waiting in the outbox past their deadline, the most overdue first: ids only.
CREATE FUNCTION conveyor_expiring_workspaces(max_workspaces integer)
    RETURNS TABLE (workspace_id uuid)
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, conveyor, pg_temp
    AS $$
        SELECT e.workspace_id
        FROM conveyor.outbox_events e
        WHERE e.status = 'pending' AND e.expires_at <= pg_catalog.now()
        GROUP BY e.workspace_id
        ORDER BY pg_catalog.min(e.expires_at)
        LIMIT greatest(1, least(max_workspaces, 10000))
    $$;
REVOKE ALL ON FUNCTION conveyor_expiring_workspaces(integer) FROM PUBLIC;

-- A worker or a maintenance process of this release may run before `conveyor migrate` has granted the new functions
-- (a host that runs the migrations itself, then grants): each goes to every role that may call the function it
-- stands beside.
DO $$
DECLARE
    grantee text;
BEGIN
    FOR grantee IN
        SELECT DISTINCT r.rolname
        FROM pg_catalog.pg_proc p
        CROSS JOIN LATERAL pg_catalog.aclexplode(p.proacl) AS a
        JOIN pg_catalog.pg_roles r ON r.oid = a.grantee
        WHERE p.oid = 'conveyor.conveyor_jobs_not_to_run(uuid[], uuid[], integer[])'::pg_catalog.regprocedure
          AND a.privilege_type = 'EXECUTE' AND r.rolname <> current_user
    LOOP
        EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION conveyor.conveyor_jobs_to_skip(uuid[], uuid[], integer[]) '
                                  'TO %I', grantee);
    END LOOP;
    FOR grantee IN
        SELECT DISTINCT r.rolname
        FROM pg_catalog.pg_proc p
        CROSS JOIN LATERAL pg_catalog.aclexplode(p.proacl) AS a
        JOIN pg_catalog.pg_roles r ON r.oid = a.grantee
        WHERE p.oid = 'conveyor.conveyor_stalled_operation_workspaces(interval, integer)'::pg_catalog.regprocedure
          AND a.privilege_type = 'EXECUTE' AND r.rolname <> current_user
    LOOP
        EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION conveyor.conveyor_expiring_workspaces(integer) TO %I',
                                  grantee);
    END LOOP;
END
$$;
