-- A schedule's jobs may carry a deadline (EnqueueOptions::start_within's, for repeatable jobs): each job a tick
-- enqueues must start within `start_within_ms` of its tick, or it is canceled as expired, as any job past its
-- deadline. Nullable, no default: added without rewriting the table; a schedule set before has none.
SET LOCAL search_path = conveyor;

ALTER TABLE job_schedules
    ADD COLUMN start_within_ms bigint CHECK (start_within_ms BETWEEN 1 AND 315360000000);

-- The operator's listing of schedules (0025's), with the deadline: a new name, so that an API of the previous release
-- keeps calling the function it knows.
CREATE FUNCTION conveyor_admin_schedules_v2(actor text, workspace uuid DEFAULT NULL)
    RETURNS TABLE (workspace_id uuid, id uuid, name text, kind text, queue text, payload jsonb, cron text,
                   time_zone text, every_ms bigint, priority smallint, max_attempts integer, start_within_ms bigint,
                   paused boolean, next_run_at timestamptz, last_tick_at timestamptz, created_at timestamptz,
                   updated_at timestamptz)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, conveyor, pg_temp
    AS $$
    #variable_conflict use_column
    BEGIN
        PERFORM conveyor.conveyor_admin_audit_write(actor, 'schedules',
                                                    pg_catalog.jsonb_build_object('workspace', workspace));
        RETURN QUERY
            SELECT s.workspace_id, s.id, s.name, s.kind, s.queue, s.payload, s.cron, s.time_zone, s.every_ms,
                   s.priority, s.max_attempts, s.start_within_ms, s.paused, s.next_run_at, s.last_tick_at, s.created_at,
                   s.updated_at
            FROM conveyor.job_schedules s
            WHERE conveyor_admin_schedules_v2.workspace IS NULL
               OR s.workspace_id = conveyor_admin_schedules_v2.workspace
            ORDER BY s.workspace_id, s.name;
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_admin_schedules_v2(text, uuid) FROM PUBLIC;

-- An API of this release may run before `conveyor migrate` has granted it: it goes to every role that may call the
-- function it stands beside.
DO $$
DECLARE
    grantee text;
BEGIN
    FOR grantee IN
        SELECT DISTINCT r.rolname
        FROM pg_catalog.pg_proc p
        CROSS JOIN LATERAL pg_catalog.aclexplode(p.proacl) AS a
        JOIN pg_catalog.pg_roles r ON r.oid = a.grantee
        WHERE p.oid = 'conveyor.conveyor_admin_schedules(text, uuid)'::pg_catalog.regprocedure
          AND a.privilege_type = 'EXECUTE' AND r.rolname <> current_user
    LOOP
        EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION conveyor.conveyor_admin_schedules_v2(text, uuid) TO %I',
                                  grantee);
    END LOOP;
END
$$;
