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

-- The operator's view of a job's family (0058's), with the job's deadline on its own row: a new name, so that an API of
-- the previous release keeps calling the function it knows.
CREATE FUNCTION conveyor_admin_job_family_v2(actor text, of_job uuid)
    RETURNS TABLE (relation text, id uuid, kind text, queue text, state text, child_failure text,
                   children_left integer, finished_at timestamptz, traceparent text, expires_at timestamptz)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, conveyor, pg_temp
    AS $$
    #variable_conflict use_column
    BEGIN
        PERFORM conveyor.conveyor_admin_audit_write(actor, 'job_family', pg_catalog.jsonb_build_object('job_id', of_job));
        RETURN QUERY
            SELECT 'self'::text, e.id, e.event_type, e.queue,
                   conveyor.conveyor_job_state(e.status, e.next_attempt_at, e.job_attempts + e.attempt_count),
                   e.child_failure, e.children_left, coalesce(e.finished_at, e.dead_lettered_at), e.traceparent,
                   e.expires_at
            FROM conveyor.outbox_events e
            WHERE e.id = of_job AND e.status <> 'discarded'
            UNION ALL
            SELECT 'parent'::text, p.id, p.event_type, p.queue,
                   conveyor.conveyor_job_state(p.status, p.next_attempt_at, p.job_attempts + p.attempt_count),
                   c.child_failure, p.children_left, coalesce(p.finished_at, p.dead_lettered_at), NULL::text,
                   NULL::timestamptz
            FROM conveyor.outbox_events c
            JOIN conveyor.outbox_events p ON p.id = c.parent_id
            WHERE c.id = of_job AND p.status <> 'discarded'
            UNION ALL
            SELECT * FROM (
                SELECT 'child'::text, c.id, c.event_type, c.queue,
                       conveyor.conveyor_job_state(c.status, c.next_attempt_at, c.job_attempts + c.attempt_count),
                       c.child_failure, c.children_left, coalesce(c.finished_at, c.dead_lettered_at), NULL::text,
                       NULL::timestamptz
                FROM conveyor.outbox_events c
                WHERE c.parent_id = of_job AND c.status <> 'discarded'
                ORDER BY c.id
                LIMIT 1000) children;
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_admin_job_family_v2(text, uuid) FROM PUBLIC;

-- A worker, a maintenance process or an API of this release may run before `conveyor migrate` has granted the new
-- functions (a host that runs the migrations itself, then grants): each goes to every role that may call the function
-- it stands beside.
DO $$
DECLARE
    pair record;
    grantee text;
BEGIN
    FOR pair IN SELECT * FROM (VALUES
        ('conveyor.conveyor_jobs_not_to_run(uuid[], uuid[], integer[])',
         'conveyor.conveyor_jobs_to_skip(uuid[], uuid[], integer[])'),
        ('conveyor.conveyor_stalled_operation_workspaces(interval, integer)',
         'conveyor.conveyor_expiring_workspaces(integer)'),
        ('conveyor.conveyor_admin_job_family(text, uuid)', 'conveyor.conveyor_admin_job_family_v2(text, uuid)'))
        AS p(beside, granted)
    LOOP
        FOR grantee IN
            SELECT DISTINCT r.rolname
            FROM pg_catalog.pg_proc p
            CROSS JOIN LATERAL pg_catalog.aclexplode(p.proacl) AS a
            JOIN pg_catalog.pg_roles r ON r.oid = a.grantee
            WHERE p.oid = pair.beside::pg_catalog.regprocedure
              AND a.privilege_type = 'EXECUTE' AND r.rolname <> current_user
        LOOP
            EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION %s TO %I', pair.granted, grantee);
        END LOOP;
    END LOOP;
END
$$;
