-- Fairness between workspaces, weights and pauses (the outbox is the fair queue; Redis holds a window).
--
-- A workspace may have at most `window × weight` jobs handed to the workers and not yet ended (`dispatching` or
-- `dispatched`) at a time; the relay tops the window up as they end. A flood therefore waits in PostgreSQL, and the
-- stream holds at most a window of each workspace's jobs: another workspace's job waits behind at most a window of
-- each busy workspace, however large its backlog.
--
-- A pause holds jobs in the outbox, durably: a queue, a kind, a workspace, or any combination (a NULL column matches
-- everything). Jobs already handed to workers finish; nothing is lost, and a resume lets the held jobs go in order.

CREATE INDEX outbox_events_in_flight ON outbox_events (workspace_id)
    WHERE status IN ('dispatching', 'dispatched');

-- Not tenant data: operator settings, read by the relay under every workspace. No row-level security, and the
-- application role reads and changes them only through Conveyor's library calls.
CREATE TABLE workspace_weights (
    workspace_id uuid        PRIMARY KEY,
    weight       integer     NOT NULL CHECK (weight BETWEEN 1 AND 1000),
    updated_at   timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE dispatch_pauses (
    id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue        text,
    kind         text,
    workspace_id uuid,
    reason       text        CHECK (length(reason) <= 500),
    created_at   timestamptz NOT NULL DEFAULT now(),
    CHECK (queue IS NOT NULL OR kind IS NOT NULL OR workspace_id IS NOT NULL)
);
CREATE UNIQUE INDEX dispatch_pauses_scope ON dispatch_pauses
    (coalesce(queue, ''), coalesce(kind, ''), coalesce(workspace_id, '00000000-0000-0000-0000-000000000000'));

-- The relay's claim (0006's, plus windows, weights and pauses): for each workspace that is not paused as a whole, its
-- expired leases and up to min(per_workspace, window × weight - in flight) due jobs that no pause holds, high priority
-- first, each level in due order. `fair_window` 0 means no window (0006's behaviour).
CREATE FUNCTION conveyor_claim_jobs_fair(workspaces uuid[], holder text, lease_secs double precision,
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
                          e.next_attempt_at, e.priority, e.max_attempts, e.timeout_ms, e.backoff_ms, e.backoff_max_ms;
        END LOOP;
        PERFORM set_config('app.workspace_id', '', true);
    END
    $$;
