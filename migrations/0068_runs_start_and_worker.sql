-- When each run of a job started and which worker ran it (the consumer that read its entry), for the operator's job
-- page: recorded by the worker with the run's end, in the statement that records it, so that a run costs no write
-- more. `outbox_events.run_started_at` and `run_by` are the last run's; `job_failures` keeps each failed run's.
-- Times are the worker's clock (its start is not a PostgreSQL statement's); the end beside it is PostgreSQL's.
SET LOCAL search_path = conveyor;

-- Nullable, no default: added without rewriting the tables. A run recorded by a worker of the previous release has
-- neither.
ALTER TABLE outbox_events ADD COLUMN run_started_at timestamptz, ADD COLUMN run_by text;
ALTER TABLE job_failures ADD COLUMN run_started_at timestamptz, ADD COLUMN run_by text;

-- 0054's batched record of ends, with each job's start and the worker's consumer name. The previous release's workers
-- keep calling the old one.
CREATE FUNCTION conveyor_complete_jobs_v2(workspaces uuid[], ids uuid[], redrives integer[], results jsonb[],
                                          started timestamptz[], consumer text)
    RETURNS bigint
    LANGUAGE plpgsql VOLATILE SECURITY INVOKER
    SET search_path = pg_catalog, conveyor, pg_temp
    SET enable_seqscan = off
    SET enable_bitmapscan = off
    SET enable_hashjoin = off
    SET enable_mergejoin = off
    SET enable_material = off
    SET jit = off
    AS $$
    DECLARE
        ws uuid;
        done bigint := 0;
        n bigint;
        caller text := current_setting('app.workspace_id', true);
    BEGIN
        -- Relaxed commit, as 0054's (an end lost in a crash runs the job again: at least once).
        PERFORM set_config('synchronous_commit', 'off', true);
        FOR ws IN SELECT DISTINCT w FROM unnest(workspaces) AS w ORDER BY w LOOP
            PERFORM set_config('app.workspace_id', ws::text, true);
            UPDATE conveyor.outbox_events e
            SET status = 'completed', finished_at = clock_timestamp(), result = v.result, locked_by = NULL,
                locked_until = NULL, dispatched_at = coalesce(e.dispatched_at, now()), run_started_at = v.started,
                run_by = left(consumer, 200)
            FROM (SELECT b.id, b.result, b.started
                  FROM unnest(workspaces, ids, results, started) AS b(workspace_id, id, result, started)
                  WHERE b.workspace_id = ws
                  ORDER BY b.id) AS v
            WHERE e.id = v.id AND e.workspace_id = ws
              AND e.status IN ('pending', 'dispatching', 'dispatched');
            GET DIAGNOSTICS n = ROW_COUNT;
            IF n > 0 THEN
                PERFORM pg_notify('conveyor_jobs_done', ws::text);
            END IF;
            done := done + n;
        END LOOP;
        PERFORM set_config('app.workspace_id', coalesce(caller, ''), true);
        RETURN done;
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_complete_jobs_v2(uuid[], uuid[], integer[], jsonb[], timestamptz[], text) FROM PUBLIC;

-- One job's runs, for an operator (audited as every conveyor_admin_ read is): each failed one (`job_failures`, in the
-- order of their ids, as conveyor_admin_job lists them; `last` false) and the job's last one (`last` true), each with
-- its start and its worker where recorded.
CREATE FUNCTION conveyor_admin_job_runs(actor text, of_job uuid)
    RETURNS TABLE (last boolean, failure bigint, attempt integer, stage text, failed_at timestamptz,
                   run_started_at timestamptz, run_by text)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, conveyor, pg_temp
    AS $$
    #variable_conflict use_column
    BEGIN
        PERFORM conveyor.conveyor_admin_audit_write(actor, 'job_runs', pg_catalog.jsonb_build_object('job_id', of_job));
        RETURN QUERY
            SELECT r.* FROM (
                SELECT false AS last, f.id AS failure, f.attempt, f.stage, f.failed_at, f.run_started_at, f.run_by
                FROM conveyor.job_failures f
                WHERE f.job_id = of_job
                UNION ALL
                SELECT true, NULL::bigint, NULL::integer, NULL::text, NULL::timestamptz, e.run_started_at, e.run_by
                FROM conveyor.outbox_events e
                WHERE e.id = of_job AND e.status <> 'discarded') r
            ORDER BY r.last, r.failure;
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_admin_job_runs(text, uuid) FROM PUBLIC;

-- Processes of this release may run before `conveyor migrate` has granted the new functions: each goes to every role
-- that may call the function it stands beside.
DO $$
DECLARE
    pair record;
    grantee text;
BEGIN
    FOR pair IN SELECT * FROM (VALUES
        ('conveyor.conveyor_complete_jobs(uuid[], uuid[], integer[], jsonb[])',
         'conveyor.conveyor_complete_jobs_v2(uuid[], uuid[], integer[], jsonb[], timestamptz[], text)'),
        ('conveyor.conveyor_admin_job(text, uuid)', 'conveyor.conveyor_admin_job_runs(text, uuid)'))
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
