-- Limits per key (issue 14): a job may carry a limit key (`EnqueueOptions::limit_key`, e.g. `store:<id>`), and a
-- workspace's key may have a concurrency limit (at most `max_in_flight` of its jobs handed to workers and not ended)
-- and be blocked until a time (a handler answered `JobError::RateLimited`). Jobs without a key are not affected.

ALTER TABLE outbox_events ADD COLUMN limit_key text
    CHECK (limit_key IS NULL OR char_length(limit_key) BETWEEN 1 AND 200);

-- A key's jobs in the workers' hands, counted by the claim.
CREATE INDEX outbox_events_key_in_flight ON outbox_events (workspace_id, limit_key)
    WHERE status IN ('dispatching', 'dispatched') AND limit_key IS NOT NULL;
-- A limited key's due jobs, by priority then due time, taken by the claim up to the key's room.
CREATE INDEX outbox_events_key_due ON outbox_events (workspace_id, limit_key, priority, next_attempt_at, id)
    WHERE status = 'pending' AND limit_key IS NOT NULL;

-- Tenant data: a key names a workspace's own things (its stores, its accounts), and a block comes from its own jobs.
-- Row-level security as on every tenant table; the claim reads it under each workspace's `app.workspace_id`.
-- A row with neither a limit nor a block in force limits nothing (a block that has passed is left in place until the
-- key's limit is removed, or overwritten by the next block).
CREATE TABLE job_key_limits (
    workspace_id  uuid        NOT NULL DEFAULT conveyor_current_workspace(),
    key           text        NOT NULL CHECK (char_length(key) BETWEEN 1 AND 200),
    max_in_flight integer     CHECK (max_in_flight BETWEEN 1 AND 1000000),
    blocked_until timestamptz,
    block_reason  text        CHECK (length(block_reason) <= 500),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (workspace_id, key)
);
ALTER TABLE job_key_limits ENABLE ROW LEVEL SECURITY;
ALTER TABLE job_key_limits FORCE ROW LEVEL SECURITY;
CREATE POLICY workspace_isolation ON job_key_limits
    USING (workspace_id = conveyor_current_workspace())
    WITH CHECK (workspace_id = conveyor_current_workspace());

-- The relay's claim: 0021's (windows, weights, pauses, priorities, expired leases), plus key limits. A workspace with
-- no row in job_key_limits runs exactly 0021's statement (one primary-key probe more per workspace and claim). Else,
-- due jobs whose key is blocked (`blocked_until` later than now) are skipped, and a key with `max_in_flight` gets at
-- most `max_in_flight - its jobs dispatching or dispatched` more (expired leases counted too: conservative); its due
-- jobs are taken through the key's own index, so a limited key's backlog never hides other jobs. Jobs of the two
-- parts are then taken together by priority, due time and id, up to the window's room. Two relays never hand out a
-- key's room twice: its limit row is locked while counted.
CREATE OR REPLACE FUNCTION conveyor_claim_jobs_fair(workspaces uuid[], holder text, lease_secs double precision,
                                                    per_workspace integer, fair_window integer)
    RETURNS TABLE (tid tid, id uuid, workspace_id uuid, queue text, event_type text, event_payload jsonb,
                   operation_id uuid, traceparent text, attempt_count integer, job_attempts integer,
                   redrive_count integer, created_at timestamptz, next_attempt_at timestamptz, priority smallint,
                   max_attempts integer, timeout_ms bigint, backoff_ms bigint, backoff_max_ms bigint)
    LANGUAGE plpgsql VOLATILE SECURITY INVOKER
    SET enable_seqscan = off
    SET jit = off
    AS $$
    #variable_conflict use_column
    DECLARE
        ws uuid;
        room integer;
        any_pause boolean;
        held_queues text[];
        held_kinds text[];
        restricted text[];
        limited text[];
        key_room integer[];
    BEGIN
        PERFORM set_config('synchronous_commit', 'off', true);
        SELECT EXISTS (SELECT 1 FROM public.dispatch_pauses) INTO any_pause;
        FOREACH ws IN ARRAY workspaces LOOP
            IF any_pause THEN
                IF EXISTS (SELECT 1 FROM public.dispatch_pauses p
                           WHERE p.workspace_id = ws AND p.queue IS NULL AND p.kind IS NULL) THEN
                    CONTINUE;
                END IF;
                SELECT coalesce(array_agg(p.queue) FILTER (WHERE p.queue IS NOT NULL AND p.kind IS NULL), '{}'),
                       coalesce(array_agg(p.kind) FILTER (WHERE p.kind IS NOT NULL), '{}')
                INTO held_queues, held_kinds
                FROM public.dispatch_pauses p
                WHERE p.workspace_id IS NULL OR p.workspace_id = ws;
            ELSE
                held_queues := '{}';
                held_kinds := '{}';
            END IF;
            PERFORM set_config('app.workspace_id', ws::text, true);
            room := per_workspace;
            IF fair_window > 0 THEN
                SELECT least(per_workspace,
                             fair_window * coalesce((SELECT w.weight FROM public.workspace_weights w
                                                     WHERE w.workspace_id = ws), 1)
                             - (SELECT count(*) FROM public.outbox_events f
                                WHERE f.status IN ('dispatching', 'dispatched')
                                  AND NOT (f.status = 'dispatching' AND f.locked_until <= now())))::integer
                INTO room;
            END IF;
            IF NOT EXISTS (SELECT 1 FROM public.job_key_limits l WHERE l.workspace_id = ws) THEN
                -- No key limits in this workspace: 0021's statement, unchanged.
                RETURN QUERY
                    UPDATE public.outbox_events e
                    SET status = 'dispatching', locked_by = holder,
                        locked_until = now() + make_interval(secs => lease_secs)
                    WHERE e.ctid = ANY(ARRAY(
                              SELECT d.ctid FROM public.outbox_events d
                              WHERE d.status = 'dispatching' AND d.locked_until <= now()
                              ORDER BY d.locked_until
                              LIMIT per_workspace
                              FOR UPDATE SKIP LOCKED))
                       OR (room > 0 AND e.ctid = ANY(ARRAY(
                              SELECT due.ctid
                              FROM unnest(ARRAY[0, 1, 2]::smallint[]) AS level(p)
                              CROSS JOIN LATERAL (
                                  SELECT d.ctid FROM public.outbox_events d
                                  WHERE d.status = 'pending' AND d.priority = level.p AND d.next_attempt_at <= now()
                                    AND d.queue <> ALL (held_queues) AND d.event_type <> ALL (held_kinds)
                                  ORDER BY d.next_attempt_at, d.id
                                  LIMIT room
                                  FOR UPDATE SKIP LOCKED) AS due
                              LIMIT room)))
                    RETURNING e.ctid, e.id, e.workspace_id, e.queue, e.event_type, e.event_payload, e.operation_id,
                              e.traceparent, e.attempt_count, e.job_attempts, e.redrive_count, e.created_at,
                              e.next_attempt_at, e.priority, e.max_attempts, e.timeout_ms, e.backoff_ms,
                              e.backoff_max_ms;
                CONTINUE;
            END IF;
            -- Keys the first part leaves alone: blocked ones, and limited ones (taken by the second part).
            SELECT coalesce(array_agg(l.key), '{}') INTO restricted
            FROM public.job_key_limits l
            WHERE l.workspace_id = ws AND (l.max_in_flight IS NOT NULL OR l.blocked_until > now());
            -- Limited keys not blocked, locked so that two relays never count a key's room at once (a key another
            -- relay is claiming is skipped this round); then, in a statement of its own (whose snapshot sees what
            -- that relay claimed), the room each has left.
            limited := ARRAY(SELECT l.key FROM public.job_key_limits l
                             WHERE l.workspace_id = ws AND l.max_in_flight IS NOT NULL
                               AND (l.blocked_until IS NULL OR l.blocked_until <= now())
                             ORDER BY l.key
                             FOR UPDATE SKIP LOCKED);
            SELECT coalesce(array_agg(k.key), '{}'), coalesce(array_agg(k.left_over), '{}')
            INTO limited, key_room
            FROM (SELECT l.key,
                         (l.max_in_flight - (SELECT count(*) FROM public.outbox_events f
                                             WHERE f.workspace_id = ws AND f.limit_key = l.key
                                               AND f.status IN ('dispatching', 'dispatched')))::integer AS left_over
                  FROM public.job_key_limits l
                  WHERE l.workspace_id = ws AND l.key = ANY (limited)) AS k
            WHERE k.left_over > 0;
            RETURN QUERY
                UPDATE public.outbox_events e
                SET status = 'dispatching', locked_by = holder,
                    locked_until = now() + make_interval(secs => lease_secs)
                WHERE e.ctid = ANY(ARRAY(
                          SELECT d.ctid FROM public.outbox_events d
                          WHERE d.status = 'dispatching' AND d.locked_until <= now()
                          ORDER BY d.locked_until
                          LIMIT per_workspace
                          FOR UPDATE SKIP LOCKED))
                   OR (room > 0 AND e.ctid = ANY(ARRAY(
                          SELECT c.ctid
                          FROM (SELECT due.ctid, level.p AS priority, due.next_attempt_at, due.id
                                FROM unnest(ARRAY[0, 1, 2]::smallint[]) AS level(p)
                                CROSS JOIN LATERAL (
                                    SELECT d.ctid, d.next_attempt_at, d.id FROM public.outbox_events d
                                    WHERE d.status = 'pending' AND d.priority = level.p
                                      AND d.next_attempt_at <= now()
                                      AND d.queue <> ALL (held_queues) AND d.event_type <> ALL (held_kinds)
                                      AND (d.limit_key IS NULL OR d.limit_key <> ALL (restricted))
                                    ORDER BY d.next_attempt_at, d.id
                                    LIMIT room
                                    FOR UPDATE SKIP LOCKED) AS due
                                UNION ALL
                                SELECT kd.ctid, kd.priority, kd.next_attempt_at, kd.id
                                FROM unnest(limited, key_room) AS k(key, left_over)
                                CROSS JOIN LATERAL (
                                    SELECT d.ctid, d.priority, d.next_attempt_at, d.id FROM public.outbox_events d
                                    WHERE d.workspace_id = ws AND d.limit_key = k.key AND d.status = 'pending'
                                      AND d.next_attempt_at <= now()
                                      AND d.queue <> ALL (held_queues) AND d.event_type <> ALL (held_kinds)
                                    ORDER BY d.priority, d.next_attempt_at, d.id
                                    LIMIT least(k.left_over, room)
                                    FOR UPDATE SKIP LOCKED) AS kd) AS c
                          ORDER BY c.priority, c.next_attempt_at, c.id
                          LIMIT room)))
                RETURNING e.ctid, e.id, e.workspace_id, e.queue, e.event_type, e.event_payload, e.operation_id,
                          e.traceparent, e.attempt_count, e.job_attempts, e.redrive_count, e.created_at,
                          e.next_attempt_at, e.priority, e.max_attempts, e.timeout_ms, e.backoff_ms, e.backoff_max_ms;
        END LOOP;
        PERFORM set_config('app.workspace_id', '', true);
    END
    $$;
