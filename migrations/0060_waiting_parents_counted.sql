-- Parents of flows waiting for their children (0056) are counted as such, not as delayed: in the operator's counts of
-- a queue (a column of their own, `waiting_children`) and in the backlog gauges (the state `waiting_children`). The
-- queues' function gains a column, so it is dropped and made again (its grant to the operator with it, by migrate).
SET LOCAL search_path = conveyor;

DROP FUNCTION conveyor_admin_queues(text, text);
CREATE FUNCTION conveyor_admin_queues(actor text, only_queue text DEFAULT NULL)
    RETURNS TABLE (queue text, registered boolean, queued bigint, delayed bigint, running bigint, retrying bigint,
                   dead bigint, completed_5m bigint, dead_5m bigint, oldest_queued_seconds double precision,
                   paused boolean, waiting_children bigint)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, conveyor, pg_temp
    AS $$
    #variable_conflict use_column
    BEGIN
        PERFORM conveyor.conveyor_admin_audit_write(actor, CASE WHEN only_queue IS NULL THEN 'queues' ELSE 'queue' END,
                                           jsonb_build_object('queue', only_queue));
        RETURN QUERY
            WITH counts AS (
                SELECT e.queue,
                       count(*) FILTER (WHERE e.next_attempt_at <= now()) AS queued,
                       count(*) FILTER (WHERE e.next_attempt_at > now() AND e.job_attempts + e.attempt_count = 0
                                          AND e.children_left = 0) AS delayed,
                       0::bigint AS running,
                       count(*) FILTER (WHERE e.next_attempt_at > now() AND e.job_attempts + e.attempt_count > 0
                                          AND e.children_left = 0) AS retrying,
                       0::bigint AS dead, 0::bigint AS completed_5m, 0::bigint AS dead_5m,
                       min(e.next_attempt_at) FILTER (WHERE e.next_attempt_at <= now()) AS oldest_due_at,
                       count(*) FILTER (WHERE e.children_left > 0) AS waiting_children
                FROM conveyor.outbox_events e
                WHERE e.status = 'pending' AND (only_queue IS NULL OR e.queue = only_queue)
                GROUP BY e.queue
                UNION ALL
                SELECT e.queue, count(*), 0, 0, 0, 0, 0, 0, NULL::timestamptz, 0::bigint
                FROM conveyor.outbox_events e
                WHERE e.status = 'dispatching' AND (only_queue IS NULL OR e.queue = only_queue)
                GROUP BY e.queue
                UNION ALL
                SELECT e.queue, 0, 0, count(*), 0, 0, 0, 0, NULL::timestamptz, 0::bigint
                FROM conveyor.outbox_events e
                WHERE e.status = 'dispatched' AND (only_queue IS NULL OR e.queue = only_queue)
                GROUP BY e.queue
                UNION ALL
                SELECT e.queue, 0, 0, 0, 0, count(*), 0,
                       count(*) FILTER (WHERE e.dead_lettered_at >= now() - interval '5 minutes'),
                       NULL::timestamptz, 0::bigint
                FROM conveyor.outbox_events e
                WHERE e.status = 'dead_letter' AND (only_queue IS NULL OR e.queue = only_queue)
                GROUP BY e.queue
                UNION ALL
                SELECT e.queue, 0, 0, 0, 0, 0, count(*), 0, NULL::timestamptz, 0::bigint
                FROM conveyor.outbox_events e
                WHERE e.status = 'completed' AND e.finished_at >= now() - interval '5 minutes'
                  AND (only_queue IS NULL OR e.queue = only_queue)
                GROUP BY e.queue
                UNION ALL
                SELECT DISTINCT k.queue, 0, 0, 0, 0, 0, 0, 0, NULL::timestamptz, 0::bigint
                FROM conveyor.job_kinds k
                WHERE only_queue IS NULL OR k.queue = only_queue
            )
            SELECT c.queue,
                   EXISTS (SELECT 1 FROM conveyor.job_kinds k WHERE k.queue = c.queue),
                   sum(c.queued)::bigint, sum(c.delayed)::bigint, sum(c.running)::bigint, sum(c.retrying)::bigint,
                   sum(c.dead)::bigint, sum(c.completed_5m)::bigint, sum(c.dead_5m)::bigint,
                   extract(epoch FROM now() - min(c.oldest_due_at))::double precision,
                   EXISTS (SELECT 1 FROM conveyor.dispatch_pauses p
                           WHERE p.queue = c.queue AND p.kind IS NULL AND p.workspace_id IS NULL),
                   sum(c.waiting_children)::bigint
            FROM counts c
            GROUP BY c.queue
            ORDER BY c.queue;
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_admin_queues(text, text) FROM PUBLIC;

CREATE OR REPLACE FUNCTION conveyor_outbox_backlog_due()
    RETURNS TABLE (queue text, state text, jobs bigint, oldest_due_seconds double precision)
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, conveyor, pg_temp
    AS $$
        WITH pending AS (
            SELECT e.queue,
                   CASE WHEN e.children_left > 0 THEN 'waiting_children'
                        WHEN e.next_attempt_at > now() THEN 'delayed'
                        WHEN paused.any_pause AND EXISTS (
                                 SELECT 1 FROM conveyor.dispatch_pauses p
                                 WHERE (p.workspace_id IS NULL OR p.workspace_id = e.workspace_id)
                                   AND (p.kind = e.event_type
                                        OR (p.kind IS NULL AND (p.queue IS NULL OR p.queue = e.queue))))
                             THEN 'held'
                        ELSE 'due'
                   END AS state,
                   e.next_attempt_at
            FROM conveyor.outbox_events e
            CROSS JOIN (SELECT EXISTS (SELECT 1 FROM conveyor.dispatch_pauses) AS any_pause) AS paused
            WHERE e.status = 'pending'
        )
        SELECT p.queue, p.state, count(*),
               CASE WHEN p.state = 'due'
                    THEN extract(epoch FROM now() - min(p.next_attempt_at))::double precision END
        FROM pending p
        GROUP BY p.queue, p.state
        UNION ALL
        SELECT e.queue, 'dispatching', count(*), extract(epoch FROM now() - min(e.next_attempt_at))::double precision
        FROM conveyor.outbox_events e
        WHERE e.status = 'dispatching'
        GROUP BY e.queue
        UNION ALL
        SELECT e.queue, 'dispatched', count(*), NULL
        FROM conveyor.outbox_events e
        WHERE e.status = 'dispatched'
        GROUP BY e.queue
        UNION ALL
        SELECT e.queue, 'dead_letter', count(*), NULL
        FROM conveyor.outbox_events e
        WHERE e.status = 'dead_letter'
        GROUP BY e.queue
    $$;
