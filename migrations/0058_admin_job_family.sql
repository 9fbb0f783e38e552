-- A flow as the operator sees it (0056): the parent of a job and its children, for the job's page, and the job itself
-- (how many children it still waits for, and its trace context, for a link to its trace). Audited as `job_family`,
-- like every read of the operator's.
SET LOCAL search_path = conveyor;

CREATE FUNCTION conveyor_admin_job_family(actor text, of_job uuid)
    RETURNS TABLE (relation text, id uuid, kind text, queue text, state text, child_failure text,
                   children_left integer, finished_at timestamptz, traceparent text)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, conveyor, pg_temp
    AS $$
    #variable_conflict use_column
    BEGIN
        PERFORM conveyor.conveyor_admin_audit_write(actor, 'job_family', pg_catalog.jsonb_build_object('job_id', of_job));
        RETURN QUERY
            SELECT 'self'::text, e.id, e.event_type, e.queue,
                   conveyor.conveyor_job_state(e.status, e.next_attempt_at, e.job_attempts + e.attempt_count),
                   e.child_failure, e.children_left, coalesce(e.finished_at, e.dead_lettered_at), e.traceparent
            FROM conveyor.outbox_events e
            WHERE e.id = of_job AND e.status <> 'discarded'
            UNION ALL
            SELECT 'parent'::text, p.id, p.event_type, p.queue,
                   conveyor.conveyor_job_state(p.status, p.next_attempt_at, p.job_attempts + p.attempt_count),
                   c.child_failure, p.children_left, coalesce(p.finished_at, p.dead_lettered_at), NULL::text
            FROM conveyor.outbox_events c
            JOIN conveyor.outbox_events p ON p.id = c.parent_id
            WHERE c.id = of_job AND p.status <> 'discarded'
            UNION ALL
            SELECT * FROM (
                SELECT 'child'::text, c.id, c.event_type, c.queue,
                       conveyor.conveyor_job_state(c.status, c.next_attempt_at, c.job_attempts + c.attempt_count),
                       c.child_failure, c.children_left, coalesce(c.finished_at, c.dead_lettered_at), NULL::text
                FROM conveyor.outbox_events c
                WHERE c.parent_id = of_job AND c.status <> 'discarded'
                ORDER BY c.id
                LIMIT 1000) children;
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_admin_job_family(text, uuid) FROM PUBLIC;
