-- The last hour of every queue at once, for the operator's overview (a small chart per queue): what
-- conveyor_admin_queue_minutes answers for one, for each queue that has a recorded minute in the hour, in one call and
-- one audit entry.
SET LOCAL search_path = conveyor;

CREATE FUNCTION conveyor_admin_queues_minutes(actor text)
    RETURNS TABLE (queue text, minute timestamptz, done bigint, failed bigint, backlog bigint,
                   wait_p95_ms double precision)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, conveyor, pg_temp
    AS $$
    #variable_conflict use_column
    DECLARE
        first_minute timestamptz := pg_catalog.date_trunc('minute', pg_catalog.now()) - interval '59 minutes';
    BEGIN
        PERFORM conveyor.conveyor_admin_audit_write(actor, 'queues_minutes', '{}'::jsonb);
        RETURN QUERY
            SELECT q.queue, s.minute, coalesce(m.done, 0), coalesce(m.failed, 0), m.backlog, m.wait_p95_ms
            FROM (SELECT DISTINCT r.queue FROM conveyor.queue_minutes r WHERE r.minute >= first_minute) q
            CROSS JOIN pg_catalog.generate_series(first_minute, first_minute + interval '59 minutes',
                                                  interval '1 minute') AS s(minute)
            LEFT JOIN conveyor.queue_minutes m ON m.queue = q.queue AND m.minute = s.minute
            ORDER BY q.queue, s.minute;
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_admin_queues_minutes(text) FROM PUBLIC;

-- An API of this release may run before `conveyor migrate` has granted it: it goes to every role that may read one
-- queue's minutes.
DO $$
DECLARE
    grantee text;
BEGIN
    FOR grantee IN
        SELECT DISTINCT r.rolname
        FROM pg_catalog.pg_proc p
        CROSS JOIN LATERAL pg_catalog.aclexplode(p.proacl) AS a
        JOIN pg_catalog.pg_roles r ON r.oid = a.grantee
        WHERE p.oid = 'conveyor.conveyor_admin_queue_minutes(text, text)'::pg_catalog.regprocedure
          AND a.privilege_type = 'EXECUTE' AND r.rolname <> current_user
    LOOP
        EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION conveyor.conveyor_admin_queues_minutes(text) TO %I',
                                  grantee);
    END LOOP;
END
$$;
