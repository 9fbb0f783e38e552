-- A review of the relay's plans (the migration before last) found two faults, both reproduced on PostgreSQL 15:
--
-- 1. Forced generic, the claim failed with "LIMIT must not be negative" for a workspace with key or kind limits and
--    more jobs in flight than its window (expired leases taken over on top of the room, or a weight lowered): its
--    statement guards the limited sub-select with `room > 0 AND ..`, which a custom plan folded away when the room
--    was negative, and a generic plan evaluates. The error aborted the whole claim, every workspace of the call with
--    it. The room is now never below 0 (no room is no room); nothing else in the claim changes.
-- 2. The look-up of due workspaces and the pre-run check do not turn sequential scans off, as that migration's header
--    said they did: a plan made while the outbox was empty (a fresh deployment, a process restarted on an empty or
--    purged outbox) kept reading the whole table until the next ANALYZE. They now turn off sequential and bitmap
--    scans, and the pre-run check hash and merge joins too, so that their plans are index probes whatever the table
--    held when they were made.
--
-- And a correction to the migration before this one's header: turning a plan type off makes it costlier, it does not
-- forbid it. The record of ends and the mark still lock in id order whichever side of their nested loop the planner
-- puts outside, because the only index that can find their rows is the primary key (the record of ends) or none, the
-- ctid (the mark): no partial index's predicate follows from their conditions. A new index on the live statuses or
-- a workspace-first index without a predicate could change that; `relay::tests`' deadlock test may then notice.
SET LOCAL search_path = conveyor;

CREATE OR REPLACE FUNCTION conveyor_claim_jobs_fair(workspaces uuid[], holder text, lease_secs double precision,
                                         per_workspace integer, fair_window integer,
                                         expired_in uuid[], gated_queues text[], gated_room integer[],
                                         light_first integer)
    RETURNS TABLE (tid tid, id uuid, workspace_id uuid, queue text, event_type text, event_payload jsonb,
                   operation_id uuid, traceparent text, attempt_count integer, job_attempts integer,
                   redrive_count integer, created_at timestamptz, next_attempt_at timestamptz, priority smallint,
                   max_attempts integer, timeout_ms bigint, backoff_ms bigint, backoff_max_ms bigint,
                   workspace_class text)
    LANGUAGE plpgsql VOLATILE SECURITY INVOKER
    SET search_path = pg_catalog, conveyor, pg_temp
    SET enable_seqscan = off
    SET jit = off
    SET enable_bitmapscan = off
    SET max_parallel_workers_per_gather = 0
    SET plan_cache_mode = force_generic_plan
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
        rated text[];
        restricted_kinds text[];
        limited_kinds text[];
        kind_room integer[];
        due_count integer;
        ws_class text;
        lease_ctids tid[];
        due_ctids tid[];
        gate_left integer[] := coalesce(gated_room, '{}');
        ws_position integer := 0;
        share integer[];
        gated boolean := coalesce(cardinality(gated_queues), 0) > 0;
    BEGIN
        PERFORM set_config('synchronous_commit', 'off', true);
        SELECT EXISTS (SELECT 1 FROM conveyor.dispatch_pauses) INTO any_pause;
        IF gated AND (cardinality(gated_room) IS DISTINCT FROM cardinality(gated_queues)
                      OR EXISTS (SELECT 1 FROM unnest(gated_room) AS r(n) WHERE r.n IS NULL OR r.n < 0)) THEN
            RAISE EXCEPTION 'gated_room must give each of gated_queues a room of 0 or more';
        END IF;
        FOREACH ws IN ARRAY workspaces LOOP
            -- Counted first: the caller's light_first counts every workspace it named, skipped ones too.
            ws_position := ws_position + 1;
            IF any_pause THEN
                IF EXISTS (SELECT 1 FROM conveyor.dispatch_pauses p
                           WHERE p.workspace_id = ws AND p.queue IS NULL AND p.kind IS NULL) THEN
                    CONTINUE;
                END IF;
                SELECT coalesce(array_agg(p.queue) FILTER (WHERE p.queue IS NOT NULL AND p.kind IS NULL), '{}'),
                       coalesce(array_agg(p.kind) FILTER (WHERE p.kind IS NOT NULL), '{}')
                INTO held_queues, held_kinds
                FROM conveyor.dispatch_pauses p
                WHERE p.workspace_id IS NULL OR p.workspace_id = ws;
            ELSE
                held_queues := '{}';
                held_kinds := '{}';
            END IF;
            PERFORM set_config('app.workspace_id', ws::text, true);
            room := per_workspace;
            IF fair_window > 0 THEN
                -- The window is counted and taken under one lock: another relay claiming this workspace now would
                -- not see the jobs this one takes, and both would fill the room. Skipped this round instead of
                -- waited for, as a limited key another relay holds is (the other relay serves the workspace).
                IF NOT pg_catalog.pg_try_advisory_xact_lock(
                           pg_catalog.hashtextextended('conveyor-window:' || ws::text, 0)) THEN
                    CONTINUE;
                END IF;
                SELECT least(per_workspace,
                             fair_window * coalesce((SELECT w.weight FROM conveyor.workspace_weights w
                                                     WHERE w.workspace_id = ws), 1)
                             - (SELECT count(*) FROM conveyor.outbox_events f
                                WHERE f.status IN ('dispatching', 'dispatched')
                                  AND NOT (f.status = 'dispatching' AND f.locked_until <= now())))::integer
                INTO room;
                -- More in flight than the window (expired leases taken over, a weight lowered) is no room at all. A
                -- negative room reached a LIMIT that only a custom plan folded away (see this migration's header).
                room := greatest(room, 0);
            END IF;
            -- Expired leases only where the caller found some (a sweep): their index is the whole outbox's, and under a
            -- long-held snapshot it holds every lease of the snapshot's lifetime, so a scan per workspace and claim
            -- grew with it.
            lease_ctids := '{}';
            IF ws = ANY (expired_in) THEN
                lease_ctids := ARRAY(SELECT d.ctid FROM conveyor.outbox_events d
                                     WHERE d.status = 'dispatching' AND d.locked_until <= now()
                                     ORDER BY d.locked_until
                                     LIMIT per_workspace
                                     FOR UPDATE SKIP LOCKED);
            END IF;
            -- The gate: of what is left of each gated queue's room in this call, this workspace's share. A light
            -- workspace (the first light_first) may take all that is left; the others a fair part each of the room
            -- the call started with, so that the workspaces after them get theirs.
            IF gated THEN
                share := ARRAY(SELECT CASE WHEN ws_position <= coalesce(light_first, 0) THEN g.left_over
                                           ELSE least(g.left_over,
                                                      ceil(g.total::numeric / cardinality(workspaces))::integer)
                                      END
                               FROM unnest(gate_left, gated_room) WITH ORDINALITY AS g(left_over, total, i)
                               ORDER BY g.i);
            END IF;
            IF NOT EXISTS (SELECT 1 FROM conveyor.job_key_limits l WHERE l.workspace_id = ws)
               AND NOT EXISTS (SELECT 1 FROM conveyor.job_kind_limits k WHERE k.workspace_id = ws) THEN
                -- Neither key nor kind limits in this workspace: 0024's statement in two steps. The due jobs are
                -- locked first (by priority, then in due order); the class counts due jobs only when they filled the
                -- room (fewer than room means all of them were taken: light).
                due_ctids := '{}';
                IF room > 0 AND gated THEN
                    -- Per queue of the workspace (a loose scan of outbox_events_due_by_queue: one probe per queue,
                    -- paused ones skipped), each up to its limit: its share of a gated queue's room, the room for one
                    -- not gated; by priority, then in due order; all of them together up to room. A queue the gate
                    -- holds is never read past its first probe, however long its backlog.
                    due_ctids := ARRAY(
                        SELECT c.ctid
                        FROM (WITH RECURSIVE queues(name) AS (
                                  (SELECT d.queue FROM conveyor.outbox_events d
                                   WHERE d.workspace_id = ws AND d.status = 'pending'
                                   ORDER BY d.queue LIMIT 1)
                                  UNION ALL
                                  SELECT (SELECT d.queue FROM conveyor.outbox_events d
                                          WHERE d.workspace_id = ws AND d.status = 'pending' AND d.queue > q.name
                                          ORDER BY d.queue LIMIT 1)
                                  FROM queues q WHERE q.name IS NOT NULL)
                              SELECT qd.ctid, qd.priority, qd.next_attempt_at, qd.id, lim.n,
                                     row_number() OVER (PARTITION BY q.name
                                                        ORDER BY qd.priority, qd.next_attempt_at, qd.id) AS taken
                              FROM queues q
                              CROSS JOIN LATERAL (
                                  SELECT coalesce(least(room, share[array_position(gated_queues, q.name)]), room)
                                         AS n) AS lim
                              CROSS JOIN unnest(ARRAY[0, 1, 2]::smallint[]) AS level(p)
                              CROSS JOIN LATERAL (
                                  SELECT d.ctid, d.priority, d.next_attempt_at, d.id FROM conveyor.outbox_events d
                                  WHERE d.workspace_id = ws AND d.status = 'pending' AND d.queue = q.name
                                    AND d.priority = level.p AND d.next_attempt_at <= now()
                                    AND d.event_type <> ALL (held_kinds)
                                  ORDER BY d.next_attempt_at, d.id
                                  LIMIT lim.n
                                  FOR UPDATE SKIP LOCKED) AS qd
                              WHERE q.name IS NOT NULL AND q.name <> ALL (held_queues) AND lim.n > 0) AS c
                        WHERE c.taken <= c.n
                        ORDER BY c.priority, c.next_attempt_at, c.id
                        LIMIT room);
                    -- What this workspace took of each gated queue is gone from the call's room.
                    gate_left := ARRAY(SELECT g.left_over - coalesce(t.n, 0)::integer
                                       FROM unnest(gated_queues, gate_left) WITH ORDINALITY AS g(q, left_over, i)
                                       LEFT JOIN (SELECT e.queue, count(*) AS n FROM conveyor.outbox_events e
                                                  WHERE e.ctid = ANY (due_ctids) GROUP BY e.queue) AS t
                                              ON t.queue = g.q
                                       ORDER BY g.i);
                ELSIF room > 0 THEN
                    due_ctids := ARRAY(
                        SELECT due.ctid
                        FROM unnest(ARRAY[0, 1, 2]::smallint[]) AS level(p)
                        CROSS JOIN LATERAL (
                            SELECT d.ctid FROM conveyor.outbox_events d
                            WHERE d.status = 'pending' AND d.priority = level.p AND d.next_attempt_at <= now()
                              AND d.queue <> ALL (held_queues) AND d.event_type <> ALL (held_kinds)
                            ORDER BY d.next_attempt_at, d.id
                            LIMIT room
                            FOR UPDATE SKIP LOCKED) AS due
                        LIMIT room);
                END IF;
                IF room <= 0 THEN
                    ws_class := 'backlogged';
                ELSIF cardinality(due_ctids) < room AND NOT gated THEN
                    ws_class := 'light';
                ELSE
                    -- The jobs just locked are still pending to this statement: more than were taken means some stay
                    -- (held back by the window, or by the gate: a queue the gate holds counts, it is not paused).
                    SELECT count(*)::integer INTO due_count
                    FROM (SELECT 1 FROM conveyor.outbox_events d
                          WHERE d.workspace_id = ws AND d.status = 'pending' AND d.next_attempt_at <= now()
                            AND d.queue <> ALL (held_queues) AND d.event_type <> ALL (held_kinds)
                          LIMIT room::bigint + 1) AS due;
                    ws_class := CASE WHEN due_count > cardinality(due_ctids) THEN 'backlogged' ELSE 'light' END;
                END IF;
                RETURN QUERY
                    UPDATE conveyor.outbox_events e
                    SET status = 'dispatching', locked_by = holder,
                        locked_until = now() + make_interval(secs => lease_secs)
                    WHERE e.ctid = ANY (lease_ctids) OR e.ctid = ANY (due_ctids)
                    RETURNING e.ctid, e.id, e.workspace_id, e.queue, e.event_type, e.event_payload, e.operation_id,
                              e.traceparent, e.attempt_count, e.job_attempts, e.redrive_count, e.created_at,
                              e.next_attempt_at, e.priority, e.max_attempts, e.timeout_ms, e.backoff_ms,
                              e.backoff_max_ms, ws_class;
                CONTINUE;
            END IF;
            -- The workspace's class at this claim: held back by its window, or not (0024's rule).
            IF room <= 0 THEN
                ws_class := 'backlogged';
            ELSE
                SELECT count(*)::integer INTO due_count
                FROM (SELECT 1 FROM conveyor.outbox_events d
                      WHERE d.workspace_id = ws AND d.status = 'pending' AND d.next_attempt_at <= now()
                        AND d.queue <> ALL (held_queues) AND d.event_type <> ALL (held_kinds)
                      LIMIT room::bigint + 1) AS due;
                ws_class := CASE WHEN due_count > room THEN 'backlogged' ELSE 'light' END;
            END IF;
            -- Keys the other parts leave alone: blocked ones, and limited ones (concurrency or rate).
            SELECT coalesce(array_agg(l.key), '{}') INTO restricted
            FROM conveyor.job_key_limits l
            WHERE l.workspace_id = ws
              AND (l.max_in_flight IS NOT NULL OR l.max_per_interval IS NOT NULL OR l.blocked_until > now());
            -- Limited keys not blocked, locked (a key another relay is claiming is skipped this round); then, in a
            -- statement of its own (whose snapshot sees what that relay claimed), the room each has left.
            limited := ARRAY(SELECT l.key FROM conveyor.job_key_limits l
                             WHERE l.workspace_id = ws
                               AND (l.max_in_flight IS NOT NULL OR l.max_per_interval IS NOT NULL)
                               AND (l.blocked_until IS NULL OR l.blocked_until <= now())
                             ORDER BY l.key
                             FOR UPDATE SKIP LOCKED);
            SELECT coalesce(array_agg(k.key), '{}'), coalesce(array_agg(k.left_over), '{}'),
                   coalesce(array_agg(k.key) FILTER (WHERE k.rated), '{}')
            INTO limited, key_room, rated
            FROM (SELECT l.key, l.max_per_interval IS NOT NULL AS rated,
                         least(coalesce(l.max_in_flight
                                        - (SELECT count(*) FROM conveyor.outbox_events f
                                           WHERE f.workspace_id = ws AND f.limit_key = l.key
                                             AND f.status IN ('dispatching', 'dispatched')), 2147483647),
                               coalesce(l.max_per_interval
                                        - (SELECT count(*) FROM unnest(l.handed_out) AS h(at)
                                           WHERE h.at > now() - l.interval_ms * interval '1 millisecond'),
                                        2147483647))::integer AS left_over
                  FROM conveyor.job_key_limits l
                  WHERE l.workspace_id = ws AND l.key = ANY (limited)) AS k
            WHERE k.left_over > 0;
            -- Limited kinds: all of them restricted; those not locked by another relay, with their room.
            SELECT coalesce(array_agg(k.kind), '{}') INTO restricted_kinds
            FROM conveyor.job_kind_limits k WHERE k.workspace_id = ws;
            limited_kinds := ARRAY(SELECT k.kind FROM conveyor.job_kind_limits k
                                   WHERE k.workspace_id = ws ORDER BY k.kind FOR UPDATE SKIP LOCKED);
            SELECT coalesce(array_agg(k.kind), '{}'), coalesce(array_agg(k.left_over), '{}')
            INTO limited_kinds, kind_room
            FROM (SELECT k.kind,
                         (k.max_in_flight - (SELECT count(*) FROM conveyor.outbox_events f
                                             WHERE f.workspace_id = ws AND f.event_type = k.kind
                                               AND f.status IN ('dispatching', 'dispatched')))::integer AS left_over
                  FROM conveyor.job_kind_limits k
                  WHERE k.workspace_id = ws AND k.kind = ANY (limited_kinds)) AS k
            WHERE k.left_over > 0;
            RETURN QUERY
                WITH claimed AS (
                    UPDATE conveyor.outbox_events e
                    SET status = 'dispatching', locked_by = holder,
                        locked_until = now() + make_interval(secs => lease_secs)
                    WHERE e.ctid = ANY (lease_ctids)
                       OR (room > 0 AND e.ctid = ANY(ARRAY(
                              SELECT c.ctid
                              FROM (SELECT c.ctid, c.priority, c.next_attempt_at, c.id, c.event_type,
                                           row_number() OVER (PARTITION BY c.event_type
                                                              ORDER BY c.priority, c.next_attempt_at, c.id) AS nth
                                    FROM (SELECT due.ctid, level.p AS priority, due.next_attempt_at, due.id,
                                                 due.event_type
                                          FROM unnest(ARRAY[0, 1, 2]::smallint[]) AS level(p)
                                          CROSS JOIN LATERAL (
                                              SELECT d.ctid, d.next_attempt_at, d.id, d.event_type
                                              FROM conveyor.outbox_events d
                                              WHERE d.status = 'pending' AND d.priority = level.p
                                                AND d.next_attempt_at <= now()
                                                AND d.queue <> ALL (held_queues) AND d.event_type <> ALL (held_kinds)
                                                AND d.event_type <> ALL (restricted_kinds)
                                                AND (d.limit_key IS NULL OR d.limit_key <> ALL (restricted))
                                              ORDER BY d.next_attempt_at, d.id
                                              LIMIT room
                                              FOR UPDATE SKIP LOCKED) AS due
                                          UNION ALL
                                          SELECT kd.ctid, kd.priority, kd.next_attempt_at, kd.id, kd.event_type
                                          FROM unnest(limited, key_room) AS k(key, left_over)
                                          CROSS JOIN LATERAL (
                                              SELECT d.ctid, d.priority, d.next_attempt_at, d.id, d.event_type
                                              FROM conveyor.outbox_events d
                                              WHERE d.workspace_id = ws AND d.limit_key = k.key
                                                AND d.status = 'pending' AND d.next_attempt_at <= now()
                                                AND d.queue <> ALL (held_queues) AND d.event_type <> ALL (held_kinds)
                                                AND (d.event_type <> ALL (restricted_kinds)
                                                     OR d.event_type = ANY (limited_kinds))
                                              ORDER BY d.priority, d.next_attempt_at, d.id
                                              LIMIT least(k.left_over, room)
                                              FOR UPDATE SKIP LOCKED) AS kd
                                          UNION ALL
                                          SELECT td.ctid, td.priority, td.next_attempt_at, td.id, td.event_type
                                          FROM unnest(limited_kinds, kind_room) AS t(kind, left_over)
                                          CROSS JOIN LATERAL (
                                              SELECT d.ctid, d.priority, d.next_attempt_at, d.id, d.event_type
                                              FROM conveyor.outbox_events d
                                              WHERE d.workspace_id = ws AND d.event_type = t.kind
                                                AND d.status = 'pending' AND d.next_attempt_at <= now()
                                                AND d.queue <> ALL (held_queues) AND d.event_type <> ALL (held_kinds)
                                                AND (d.limit_key IS NULL OR d.limit_key <> ALL (restricted))
                                              ORDER BY d.priority, d.next_attempt_at, d.id
                                              LIMIT least(t.left_over, room)
                                              FOR UPDATE SKIP LOCKED) AS td) AS c) AS c
                              LEFT JOIN unnest(limited_kinds, kind_room) AS t(kind, left_over)
                                     ON t.kind = c.event_type
                              WHERE t.kind IS NULL OR c.nth <= t.left_over
                              ORDER BY c.priority, c.next_attempt_at, c.id
                              LIMIT room)))
                    RETURNING e.ctid, e.id, e.workspace_id, e.queue, e.event_type, e.event_payload, e.operation_id,
                              e.traceparent, e.attempt_count, e.job_attempts, e.redrive_count, e.created_at,
                              e.next_attempt_at, e.priority, e.max_attempts, e.timeout_ms, e.backoff_ms,
                              e.backoff_max_ms, e.limit_key),
                rates AS (
                    -- Each rated key's hand-outs, in its sliding log (those older than its interval forgotten).
                    UPDATE conveyor.job_key_limits l
                    SET handed_out = ARRAY(SELECT h.at FROM unnest(l.handed_out) AS h(at)
                                           WHERE h.at > now() - l.interval_ms * interval '1 millisecond'
                                           UNION ALL
                                           SELECT now() FROM generate_series(1, n.taken)
                                           ORDER BY 1)
                    FROM (SELECT c.limit_key, count(*)::integer AS taken FROM claimed c
                          WHERE c.limit_key = ANY (rated) GROUP BY c.limit_key) AS n
                    WHERE l.workspace_id = ws AND l.key = n.limit_key)
                SELECT c.ctid, c.id, c.workspace_id, c.queue, c.event_type, c.event_payload, c.operation_id,
                       c.traceparent, c.attempt_count, c.job_attempts, c.redrive_count, c.created_at,
                       c.next_attempt_at, c.priority, c.max_attempts, c.timeout_ms, c.backoff_ms, c.backoff_max_ms,
                       ws_class
                FROM claimed c;
        END LOOP;
        PERFORM set_config('app.workspace_id', '', true);
    END
    $$;

ALTER FUNCTION conveyor_due_workspaces(integer) SET enable_seqscan = off;
ALTER FUNCTION conveyor_due_workspaces(integer) SET enable_bitmapscan = off;
ALTER FUNCTION conveyor_jobs_not_to_run(uuid[], uuid[], integer[]) SET enable_seqscan = off;
ALTER FUNCTION conveyor_jobs_not_to_run(uuid[], uuid[], integer[]) SET enable_bitmapscan = off;
ALTER FUNCTION conveyor_jobs_not_to_run(uuid[], uuid[], integer[]) SET enable_hashjoin = off;
ALTER FUNCTION conveyor_jobs_not_to_run(uuid[], uuid[], integer[]) SET enable_mergejoin = off;
