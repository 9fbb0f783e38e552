-- The outbox backlog as alerts and autoscaling read it: due jobs, aged from when they fell due.
--
-- 0002's conveyor_outbox_backlog() counts every pending row and ages the backlog from created_at, so a job enqueued
-- to run in 10 minutes, or a retry backing off from a job created long ago, looks like a relay that stopped (and
-- ConveyorOutboxOldestPendingTooOld paged on normal use). This one tells a queue's jobs apart by why they wait:
--   due          pending, next_attempt_at <= now(), no pause holds it: waiting for the relay (or for room in its
--                workspace's fairness window, or under its key's limit);
--   held         pending and due, but a pause holds it (dispatch_pauses, by the claim's rules: the workspace as a
--                whole, the queue, or the kind, each for every workspace or one);
--   delayed      pending, next_attempt_at ahead: run_at or a delay, a retry's back-off, a throttle, a failed
--                hand-off's back-off;
--   dispatching  leased by a relay, being handed to Redis;
--   dispatched   handed to the workers and not ended: what the streams hold for them (lag plus pending entries);
--   dead_letter  given up.
-- oldest_due_seconds: now() minus the earliest next_attempt_at among the queue's due (or dispatching) jobs, NULL for
-- the other states. Counts and ages only, never a workspace id or a payload. Runs as the owner (the per-status arms
-- each match a partial index of 0001/0003); conveyor migrate grants it with the other conveyor_ functions.
-- 0002's function stays for dispatchers of the previous release during a rolling upgrade.
SET LOCAL search_path = conveyor;

CREATE FUNCTION conveyor_outbox_backlog_due()
    RETURNS TABLE (queue text, state text, jobs bigint, oldest_due_seconds double precision)
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, conveyor
    AS $$
        WITH pending AS (
            SELECT e.queue,
                   CASE WHEN e.next_attempt_at > now() THEN 'delayed'
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
REVOKE ALL ON FUNCTION conveyor_outbox_backlog_due() FROM PUBLIC;
