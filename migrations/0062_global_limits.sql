-- Global limits (issue 29): a concurrency and a sliding-window rate for a queue or a kind across every workspace ("one
-- provider key, 100 requests a second in all"), beside each workspace's own key and kind limits. A job obeys every
-- limit that applies to it.
--
-- Operator data, as pauses and weights are: set and removed through the audited conveyor_admin_set_global_limit and
-- conveyor_admin_remove_global_limit, read through conveyor_admin_global_limits. No role has a grant on the table: the
-- relay's claim asks whether any limit exists, reads the rooms and records what it did through three definer
-- functions of the runtime role's, which return and take a flag, counts and workspace ids only.
--
-- The claim (redefined below, same arguments and columns) asks conveyor_global_rooms once per call. It locks, in one
-- order, the limits with due jobs in the call's workspaces, waiting for a claim that holds one (claims of one limit go
-- one at a time; nothing is locked before, so they cannot deadlock), and gives each its room: its concurrency less
-- the jobs of its queue or kind in flight in every workspace (a lease past its time not counted), and its rate less
-- the hand-outs of its interval.
--
-- Turns: the room is shared by the workspaces, not taken by the first. Each limit keeps a line of the workspaces whose
-- due jobs wait for its room, each with the jobs it took of the limit while in the line (a deficit count, as deficit
-- round robin keeps). The line goes by that count, the fewest first, then by arrival; a workspace joins with the
-- smallest count in the line. A workspace may take a fair part of the limit's capacity (divided by the workspaces in
-- the line), at most the room left less a fair part for each workspace ahead of it; it leaves the line when it has no
-- due job of the limit left, or when it was not seen waiting for 5 seconds (its jobs canceled, paused or gone).
--
-- While any global limit exists, every workspace's claim takes the statement of workspaces with key or kind limits (the
-- one that takes limited jobs in parts of their own), so the queue gate does not pace the relay then: the window
-- bounds each workspace, as for a workspace with key limits. Leases of a crashed relay taken over count against a
-- limit's room but are never refused.
SET LOCAL search_path = conveyor;

CREATE TABLE global_limits (
    scope            text        NOT NULL CHECK (scope IN ('queue', 'kind')),
    name             text        NOT NULL CHECK (length(name) BETWEEN 1 AND 200),
    max_in_flight    integer     CHECK (max_in_flight BETWEEN 1 AND 1000000),
    max_per_interval integer     CHECK (max_per_interval BETWEEN 1 AND 10000),
    interval_ms      bigint      CHECK (interval_ms BETWEEN 1 AND 86400000),
    -- The rate's sliding log: the claims' times of the latest hand-outs (one entry a job), oldest first.
    handed_out       timestamptz[] NOT NULL DEFAULT '{}',
    -- The line of workspaces waiting for the room, in arrival order, with the jobs each took while in it (less the
    -- smallest such count) and when each was last seen waiting.
    waiting          uuid[]      NOT NULL DEFAULT '{}',
    waiting_taken    integer[]   NOT NULL DEFAULT '{}',
    waiting_at       timestamptz[] NOT NULL DEFAULT '{}',
    updated_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (scope, name),
    CONSTRAINT global_limits_rate_whole CHECK ((max_per_interval IS NULL) = (interval_ms IS NULL)),
    CONSTRAINT global_limits_limit_something CHECK (max_in_flight IS NOT NULL OR max_per_interval IS NOT NULL),
    CONSTRAINT global_limits_line_whole CHECK (cardinality(waiting) = cardinality(waiting_at)
                                               AND cardinality(waiting) = cardinality(waiting_taken))
);
REVOKE ALL ON global_limits FROM PUBLIC;

-- Whether any global limit exists: the claim asks this first, and the rooms only then.
CREATE FUNCTION conveyor_global_limits_exist()
    RETURNS boolean
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, conveyor, pg_temp
    AS $$
        SELECT EXISTS (SELECT 1 FROM conveyor.global_limits)
    $$;
REVOKE ALL ON FUNCTION conveyor_global_limits_exist() FROM PUBLIC;

-- Every global limit, for a claim of `workspaces`: its capacity (the smaller of its concurrency and its rate's count);
-- those with due jobs in the workspaces locked for the caller's transaction (in one order, waiting for another claim
-- that holds one), each with its room (concurrency less the jobs in flight
-- of its queue or kind in every workspace, a lease past its time not counted; rate less the hand-outs of its
-- interval; the smaller, never below 0) and its line of waiting workspaces (those seen in the last 5 seconds); the
-- others with no room (NULL) and no line: the call has no due job of theirs.
CREATE FUNCTION conveyor_global_rooms(workspaces uuid[])
    RETURNS TABLE (scope text, name text, capacity integer, room integer, waiting uuid[], waiting_taken integer[],
                   waiting_at timestamptz[])
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, conveyor, pg_temp
    SET enable_seqscan = off
    SET lock_timeout = '2s'
    AS $$
    #variable_conflict use_column
    DECLARE
        locked text[];
        -- The time after the locks, which the rates go by: a claim that waited for another's lock counts the
        -- hand-outs of the interval up to now, not up to when its transaction began.
        at_lock timestamptz;
    BEGIN
        -- A queue's due jobs are found through its index (outbox_events_due_by_queue); a kind's by reading the
        -- workspaces' due jobs (no index holds pending jobs by kind).
        locked := ARRAY(SELECT g.scope || '|' || g.name FROM conveyor.global_limits g
                        WHERE (g.scope = 'queue'
                               AND EXISTS (SELECT 1 FROM conveyor.outbox_events d
                                           WHERE d.workspace_id = ANY (workspaces) AND d.queue = g.name
                                             AND d.status = 'pending' AND d.next_attempt_at <= pg_catalog.now()))
                           OR (g.scope = 'kind'
                               AND EXISTS (SELECT 1 FROM conveyor.outbox_events d
                                           WHERE d.workspace_id = ANY (workspaces) AND d.event_type = g.name
                                             AND d.status = 'pending' AND d.next_attempt_at <= pg_catalog.now()))
                        ORDER BY g.scope, g.name
                        FOR UPDATE OF g);
        at_lock := pg_catalog.clock_timestamp();
        -- A statement of its own, after the locks: its snapshot sees what the claims that held them took.
        RETURN QUERY
            SELECT g.scope, g.name,
                   least(coalesce(g.max_in_flight, 2147483647), coalesce(g.max_per_interval, 2147483647)),
                   CASE WHEN (g.scope || '|' || g.name) = ANY (locked) THEN
                       greatest(0, least(
                           coalesce(g.max_in_flight
                                    - (SELECT pg_catalog.count(*) FROM conveyor.outbox_events f
                                       WHERE f.status IN ('dispatching', 'dispatched')
                                         AND NOT (f.status = 'dispatching' AND f.locked_until <= pg_catalog.now())
                                         AND CASE g.scope WHEN 'queue' THEN f.queue ELSE f.event_type END = g.name),
                                    2147483647),
                           coalesce(g.max_per_interval
                                    - (SELECT pg_catalog.count(*) FROM pg_catalog.unnest(g.handed_out) AS h(at)
                                       WHERE h.at > at_lock - g.interval_ms * interval '1 millisecond'),
                                    2147483647)))::integer
                   END,
                   CASE WHEN (g.scope || '|' || g.name) = ANY (locked) THEN
                       ARRAY(SELECT w.ws
                             FROM ROWS FROM (pg_catalog.unnest(g.waiting), pg_catalog.unnest(g.waiting_taken),
                                             pg_catalog.unnest(g.waiting_at)) WITH ORDINALITY AS w(ws, taken, at, i)
                             WHERE w.at > pg_catalog.now() - interval '5 seconds' ORDER BY w.i)
                   ELSE '{}' END,
                   CASE WHEN (g.scope || '|' || g.name) = ANY (locked) THEN
                       ARRAY(SELECT w.taken
                             FROM ROWS FROM (pg_catalog.unnest(g.waiting), pg_catalog.unnest(g.waiting_taken),
                                             pg_catalog.unnest(g.waiting_at)) WITH ORDINALITY AS w(ws, taken, at, i)
                             WHERE w.at > pg_catalog.now() - interval '5 seconds' ORDER BY w.i)
                   ELSE '{}' END,
                   CASE WHEN (g.scope || '|' || g.name) = ANY (locked) THEN
                       ARRAY(SELECT w.at
                             FROM ROWS FROM (pg_catalog.unnest(g.waiting), pg_catalog.unnest(g.waiting_taken),
                                             pg_catalog.unnest(g.waiting_at)) WITH ORDINALITY AS w(ws, taken, at, i)
                             WHERE w.at > pg_catalog.now() - interval '5 seconds' ORDER BY w.i)
                   ELSE '{}' END
            FROM conveyor.global_limits g
            ORDER BY g.scope, g.name;
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_global_rooms(uuid[]) FROM PUBLIC;

-- Records a claim's work on the limits it locked through conveyor_global_rooms (another's would wait for that
-- transaction): `taken[i]` jobs handed out of `scopes[i]`:`names[i]` go into its rate's log, stamped now (after the
-- lock, as the room was counted; at most the rate's count; entries older than its interval forgotten), and its line
-- becomes the entries of the line given (`line_scopes`, `line_names`, `line_workspaces`, `line_taken`, `line_at`, in
-- order) that name it, their counts less the smallest.
CREATE FUNCTION conveyor_global_record(scopes text[], names text[], taken integer[], line_scopes text[],
                                       line_names text[], line_workspaces uuid[], line_taken integer[],
                                       line_at timestamptz[])
    RETURNS void
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, conveyor, pg_temp
    AS $$
    BEGIN
        UPDATE conveyor.global_limits g
        SET handed_out = CASE WHEN g.max_per_interval IS NULL OR t.n <= 0 THEN g.handed_out
                              ELSE ARRAY(SELECT h.at FROM pg_catalog.unnest(g.handed_out) AS h(at)
                                         WHERE h.at > pg_catalog.clock_timestamp()
                                                      - g.interval_ms * interval '1 millisecond'
                                         UNION ALL
                                         SELECT pg_catalog.clock_timestamp()
                                         FROM pg_catalog.generate_series(1, least(t.n, g.max_per_interval))
                                         ORDER BY 1) END,
            waiting = ARRAY(SELECT l.ws
                          FROM (SELECT l.*, pg_catalog.min(l.taken) OVER () AS least_taken
                                FROM ROWS FROM (pg_catalog.unnest(line_scopes), pg_catalog.unnest(line_names),
                                                pg_catalog.unnest(line_workspaces), pg_catalog.unnest(line_taken),
                                                pg_catalog.unnest(line_at))
                                     WITH ORDINALITY AS l(scope, name, ws, taken, at, i)
                                WHERE l.scope = g.scope AND l.name = g.name) AS l
                          ORDER BY l.i),
            waiting_taken = ARRAY(SELECT l.taken - l.least_taken
                          FROM (SELECT l.*, pg_catalog.min(l.taken) OVER () AS least_taken
                                FROM ROWS FROM (pg_catalog.unnest(line_scopes), pg_catalog.unnest(line_names),
                                                pg_catalog.unnest(line_workspaces), pg_catalog.unnest(line_taken),
                                                pg_catalog.unnest(line_at))
                                     WITH ORDINALITY AS l(scope, name, ws, taken, at, i)
                                WHERE l.scope = g.scope AND l.name = g.name) AS l
                          ORDER BY l.i),
            waiting_at = ARRAY(SELECT l.at
                          FROM (SELECT l.*, pg_catalog.min(l.taken) OVER () AS least_taken
                                FROM ROWS FROM (pg_catalog.unnest(line_scopes), pg_catalog.unnest(line_names),
                                                pg_catalog.unnest(line_workspaces), pg_catalog.unnest(line_taken),
                                                pg_catalog.unnest(line_at))
                                     WITH ORDINALITY AS l(scope, name, ws, taken, at, i)
                                WHERE l.scope = g.scope AND l.name = g.name) AS l
                          ORDER BY l.i)
        FROM ROWS FROM (pg_catalog.unnest(scopes), pg_catalog.unnest(names), pg_catalog.unnest(taken))
             AS t(scope, name, n)
        WHERE g.scope = t.scope AND g.name = t.name;
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_global_record(text[], text[], integer[], text[], text[], uuid[], integer[],
                                              timestamptz[])
    FROM PUBLIC;

-- The global limits, each with its jobs in flight (every workspace's) and its hand-outs in its last interval.
-- Audited like conveyor_admin_pauses.
CREATE FUNCTION conveyor_admin_global_limits(actor text)
    RETURNS TABLE (scope text, name text, max_in_flight integer, max_per_interval integer, interval_ms bigint,
                   in_flight bigint, handed_out_in_interval bigint, updated_at timestamptz)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, conveyor, pg_temp
    AS $$
    #variable_conflict use_column
    BEGIN
        PERFORM conveyor.conveyor_admin_audit_write(actor, 'global_limits', '{}');
        RETURN QUERY
            SELECT g.scope, g.name, g.max_in_flight, g.max_per_interval, g.interval_ms,
                   (SELECT pg_catalog.count(*) FROM conveyor.outbox_events f
                    WHERE f.status IN ('dispatching', 'dispatched')
                      AND NOT (f.status = 'dispatching' AND f.locked_until <= pg_catalog.now())
                      AND CASE g.scope WHEN 'queue' THEN f.queue ELSE f.event_type END = g.name),
                   CASE WHEN g.max_per_interval IS NULL THEN 0::bigint
                        ELSE (SELECT pg_catalog.count(*) FROM pg_catalog.unnest(g.handed_out) AS h(at)
                              WHERE h.at > pg_catalog.now() - g.interval_ms * interval '1 millisecond') END,
                   g.updated_at
            FROM conveyor.global_limits g
            ORDER BY g.scope, g.name;
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_admin_global_limits(text) FROM PUBLIC;

-- Sets the global limit of a queue or a kind (replacing an earlier one; its rate's log stays), and wakes the
-- dispatchers (a higher limit lets held jobs go). Audited like conveyor_admin_pause.
CREATE FUNCTION conveyor_admin_set_global_limit(actor text, intent bigint, limit_scope text, limit_name text,
                                                new_max_in_flight integer, new_max_per_interval integer,
                                                new_interval_ms bigint)
    RETURNS void
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, conveyor, pg_temp
    AS $$
    BEGIN
        IF limit_scope IS NULL OR limit_scope NOT IN ('queue', 'kind') THEN
            RAISE EXCEPTION 'conveyor_admin: a global limit is of a queue or a kind' USING ERRCODE = '22023';
        END IF;
        IF limit_name IS NULL OR pg_catalog.length(limit_name) NOT BETWEEN 1 AND 200 THEN
            RAISE EXCEPTION 'conveyor_admin: a global limit names its % (1 to 200 characters)', limit_scope
                USING ERRCODE = '22023';
        END IF;
        IF new_max_in_flight IS NULL AND new_max_per_interval IS NULL THEN
            RAISE EXCEPTION 'conveyor_admin: a global limit has a concurrency, a rate or both' USING ERRCODE = '22023';
        END IF;
        IF (new_max_per_interval IS NULL) <> (new_interval_ms IS NULL) THEN
            RAISE EXCEPTION 'conveyor_admin: a rate has a count and an interval' USING ERRCODE = '22023';
        END IF;
        INSERT INTO conveyor.global_limits (scope, name, max_in_flight, max_per_interval, interval_ms)
        VALUES (limit_scope, limit_name, new_max_in_flight, new_max_per_interval, new_interval_ms)
        ON CONFLICT (scope, name) DO UPDATE
        SET max_in_flight = EXCLUDED.max_in_flight, max_per_interval = EXCLUDED.max_per_interval,
            interval_ms = EXCLUDED.interval_ms, updated_at = pg_catalog.now();
        PERFORM conveyor.conveyor_admin_audit_write(actor, 'global_limit', pg_catalog.jsonb_build_object(
            'scope', limit_scope, 'name', limit_name, 'max_in_flight', new_max_in_flight,
            'max_per_interval', new_max_per_interval, 'interval_ms', new_interval_ms, 'outcome', 'set',
            'intent', intent));
        PERFORM pg_catalog.pg_notify('conveyor_outbox', '');
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_admin_set_global_limit(text, bigint, text, text, integer, integer, bigint)
    FROM PUBLIC;

-- Removes the global limit of a queue or a kind and wakes the dispatchers: its held jobs go. False when it had none.
CREATE FUNCTION conveyor_admin_remove_global_limit(actor text, intent bigint, limit_scope text, limit_name text)
    RETURNS boolean
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, conveyor, pg_temp
    AS $$
    DECLARE
        removed bigint;
    BEGIN
        DELETE FROM conveyor.global_limits g WHERE g.scope = limit_scope AND g.name = limit_name;
        GET DIAGNOSTICS removed = ROW_COUNT;
        PERFORM conveyor.conveyor_admin_audit_write(actor, 'remove_global_limit', pg_catalog.jsonb_build_object(
            'scope', limit_scope, 'name', limit_name,
            'outcome', CASE WHEN removed > 0 THEN 'removed' ELSE 'not_limited' END, 'intent', intent));
        PERFORM pg_catalog.pg_notify('conveyor_outbox', '');
        RETURN removed > 0;
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_admin_remove_global_limit(text, bigint, text, text) FROM PUBLIC;

-- The claim: 0055's, with global limits.
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
        -- Global limits: every limited queue and kind, each one's room at the start of the call (NULL: the call has no
        -- due job of it), what is left of it, whether this workspace has due jobs of it, its part, and what the call
        -- took; and the limits' lines of waiting workspaces, flat (one entry a limit and workspace, in line order).
        g_queues text[];
        gq_cap integer[];
        gq_total integer[];
        gq_left integer[];
        gq_share integer[];
        gq_taken integer[];
        g_kinds text[];
        gk_cap integer[];
        gk_total integer[];
        gk_left integer[];
        gk_share integer[];
        gk_taken integer[];
        any_global boolean;
        wants_q boolean[];
        wants_k boolean[];
        line_scopes text[];
        line_names text[];
        line_workspaces uuid[];
        line_taken integer[];
        line_at timestamptz[];
        took_q integer[];
        took_k integer[];
    BEGIN
        PERFORM set_config('synchronous_commit', 'off', true);
        -- Global limits, where any exists (the look costs the claim a few microseconds; the rooms, tens).
        IF conveyor.conveyor_global_limits_exist() THEN
            WITH r AS MATERIALIZED (SELECT * FROM conveyor.conveyor_global_rooms(workspaces))
            SELECT (SELECT coalesce(array_agg(r.name ORDER BY r.name) FILTER (WHERE r.scope = 'queue'), '{}') FROM r),
                   (SELECT coalesce(array_agg(r.capacity ORDER BY r.name) FILTER (WHERE r.scope = 'queue'), '{}')
                    FROM r),
                   (SELECT coalesce(array_agg(r.room ORDER BY r.name) FILTER (WHERE r.scope = 'queue'), '{}') FROM r),
                   (SELECT coalesce(array_agg(r.name ORDER BY r.name) FILTER (WHERE r.scope = 'kind'), '{}') FROM r),
                   (SELECT coalesce(array_agg(r.capacity ORDER BY r.name) FILTER (WHERE r.scope = 'kind'), '{}')
                    FROM r),
                   (SELECT coalesce(array_agg(r.room ORDER BY r.name) FILTER (WHERE r.scope = 'kind'), '{}') FROM r),
                   (SELECT coalesce(array_agg(r.scope ORDER BY r.scope, r.name, w.i), '{}')
                    FROM r CROSS JOIN LATERAL unnest(r.waiting) WITH ORDINALITY AS w(wsp, i)),
                   (SELECT coalesce(array_agg(r.name ORDER BY r.scope, r.name, w.i), '{}')
                    FROM r CROSS JOIN LATERAL unnest(r.waiting) WITH ORDINALITY AS w(wsp, i)),
                   (SELECT coalesce(array_agg(w.wsp ORDER BY r.scope, r.name, w.i), '{}')
                    FROM r CROSS JOIN LATERAL unnest(r.waiting) WITH ORDINALITY AS w(wsp, i)),
                   (SELECT coalesce(array_agg(w.taken ORDER BY r.scope, r.name, w.i), '{}')
                    FROM r CROSS JOIN LATERAL unnest(r.waiting_taken) WITH ORDINALITY AS w(taken, i)),
                   (SELECT coalesce(array_agg(w.at ORDER BY r.scope, r.name, w.i), '{}')
                    FROM r CROSS JOIN LATERAL unnest(r.waiting_at) WITH ORDINALITY AS w(at, i))
            INTO g_queues, gq_cap, gq_total, g_kinds, gk_cap, gk_total, line_scopes, line_names, line_workspaces,
                 line_taken, line_at;
        ELSE
            g_queues := '{}'; gq_cap := '{}'; gq_total := '{}'; g_kinds := '{}'; gk_cap := '{}'; gk_total := '{}';
            line_scopes := '{}'; line_names := '{}'; line_workspaces := '{}'; line_taken := '{}'; line_at := '{}';
        END IF;
        -- The limited statement only where this call holds a limit; elsewhere the jobs of every limited queue and kind
        -- are held (none of them was due in the call's workspaces when the limits were looked at).
        any_global := EXISTS (SELECT 1 FROM unnest(gq_total || gk_total) AS t(total) WHERE t.total IS NOT NULL);
        gq_left := gq_total;
        gk_left := gk_total;
        gq_taken := array_fill(0, ARRAY[cardinality(g_queues)]);
        gk_taken := array_fill(0, ARRAY[cardinality(g_kinds)]);
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
            IF NOT any_global THEN
                held_queues := held_queues || g_queues;
                held_kinds := held_kinds || g_kinds;
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
            -- This workspace's part of each global room: none where the call has no room of it, or the workspace no
            -- room in its window or no due job of it (held ones aside); else a fair part of the limit's capacity
            -- (divided by the workspaces in its line, this one counted), at most the room left less a fair part for
            -- each workspace ahead of it.
            IF any_global THEN
                wants_q := ARRAY(SELECT room > 0 AND g.total IS NOT NULL AND EXISTS (
                                            SELECT 1 FROM conveyor.outbox_events d
                                            WHERE d.workspace_id = ws AND d.queue = g.name AND d.status = 'pending'
                                              AND d.next_attempt_at <= now()
                                              AND d.queue <> ALL (held_queues) AND d.event_type <> ALL (held_kinds))
                                 FROM unnest(g_queues, gq_total) WITH ORDINALITY AS g(name, total, i)
                                 ORDER BY g.i);
                wants_k := ARRAY(SELECT room > 0 AND g.total IS NOT NULL AND EXISTS (
                                            SELECT 1 FROM conveyor.outbox_events d
                                            WHERE d.workspace_id = ws AND d.event_type = g.name
                                              AND d.status = 'pending' AND d.next_attempt_at <= now()
                                              AND d.queue <> ALL (held_queues) AND d.event_type <> ALL (held_kinds))
                                 FROM unnest(g_kinds, gk_total) WITH ORDINALITY AS g(name, total, i)
                                 ORDER BY g.i);
                gq_share := ARRAY(SELECT CASE WHEN g.wants
                                              THEN greatest(0, least(g.left_over - x.ahead * x.fair, x.fair))
                                              ELSE 0 END
                                  FROM unnest(g_queues, gq_cap, gq_left, wants_q)
                                       WITH ORDINALITY AS g(name, cap, left_over, wants, i)
                                  CROSS JOIN LATERAL (
                                      -- Ahead: the entries with fewer jobs taken, or as many and earlier; this
                                      -- workspace, not in the line, would join with the fewest, last.
                                      SELECT count(*) FILTER (WHERE y.wsp <> ws AND (y.taken, y.i) < (me.taken, me.i))
                                                 ::integer AS ahead,
                                             ceil(g.cap::numeric / (count(*) FILTER (WHERE y.wsp <> ws) + 1))::integer
                                                 AS fair
                                      FROM (SELECT l.wsp, l.taken, l.i
                                            FROM unnest(line_scopes, line_names, line_workspaces, line_taken)
                                                 WITH ORDINALITY AS l(scope, name, wsp, taken, i)
                                            WHERE l.scope = 'queue' AND l.name = g.name) AS y
                                      CROSS JOIN LATERAL (
                                          SELECT coalesce(max(l.taken) FILTER (WHERE l.wsp = ws), min(l.taken), 0)
                                                     AS taken,
                                                 coalesce(max(l.i) FILTER (WHERE l.wsp = ws), 9223372036854775807)
                                                     AS i
                                          FROM unnest(line_scopes, line_names, line_workspaces, line_taken)
                                               WITH ORDINALITY AS l(scope, name, wsp, taken, i)
                                          WHERE l.scope = 'queue' AND l.name = g.name) AS me) AS x
                                  ORDER BY g.i);
                gk_share := ARRAY(SELECT CASE WHEN g.wants
                                              THEN greatest(0, least(g.left_over - x.ahead * x.fair, x.fair))
                                              ELSE 0 END
                                  FROM unnest(g_kinds, gk_cap, gk_left, wants_k)
                                       WITH ORDINALITY AS g(name, cap, left_over, wants, i)
                                  CROSS JOIN LATERAL (
                                      -- Ahead: the entries with fewer jobs taken, or as many and earlier; this
                                      -- workspace, not in the line, would join with the fewest, last.
                                      SELECT count(*) FILTER (WHERE y.wsp <> ws AND (y.taken, y.i) < (me.taken, me.i))
                                                 ::integer AS ahead,
                                             ceil(g.cap::numeric / (count(*) FILTER (WHERE y.wsp <> ws) + 1))::integer
                                                 AS fair
                                      FROM (SELECT l.wsp, l.taken, l.i
                                            FROM unnest(line_scopes, line_names, line_workspaces, line_taken)
                                                 WITH ORDINALITY AS l(scope, name, wsp, taken, i)
                                            WHERE l.scope = 'kind' AND l.name = g.name) AS y
                                      CROSS JOIN LATERAL (
                                          SELECT coalesce(max(l.taken) FILTER (WHERE l.wsp = ws), min(l.taken), 0)
                                                     AS taken,
                                                 coalesce(max(l.i) FILTER (WHERE l.wsp = ws), 9223372036854775807)
                                                     AS i
                                          FROM unnest(line_scopes, line_names, line_workspaces, line_taken)
                                               WITH ORDINALITY AS l(scope, name, wsp, taken, i)
                                          WHERE l.scope = 'kind' AND l.name = g.name) AS me) AS x
                                  ORDER BY g.i);
            END IF;
            IF NOT any_global
               AND NOT EXISTS (SELECT 1 FROM conveyor.job_key_limits l WHERE l.workspace_id = ws)
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
            -- Global limits: a limited queue's or kind's jobs are taken only in a part of their own (a workspace's
            -- part of the room), by the first of their restrictions in this order: key, kind, global queue, global
            -- kind; each part leaves out jobs another restriction has no room for, and the last step holds every
            -- restriction to its room.
            due_ctids := '{}';
            IF room > 0 THEN
                due_ctids := ARRAY(
                    SELECT c.ctid
                    FROM (SELECT c.ctid, c.priority, c.next_attempt_at, c.id, c.event_type, c.queue,
                                 row_number() OVER (PARTITION BY c.event_type
                                                    ORDER BY c.priority, c.next_attempt_at, c.id) AS nth,
                                 row_number() OVER (PARTITION BY c.queue
                                                    ORDER BY c.priority, c.next_attempt_at, c.id) AS nth_in_queue
                          FROM (SELECT due.ctid, level.p AS priority, due.next_attempt_at, due.id, due.event_type,
                                       due.queue
                                FROM unnest(ARRAY[0, 1, 2]::smallint[]) AS level(p)
                                CROSS JOIN LATERAL (
                                    SELECT d.ctid, d.next_attempt_at, d.id, d.event_type, d.queue
                                    FROM conveyor.outbox_events d
                                    WHERE d.status = 'pending' AND d.priority = level.p
                                      AND d.next_attempt_at <= now()
                                      AND d.queue <> ALL (held_queues) AND d.event_type <> ALL (held_kinds)
                                      AND d.event_type <> ALL (restricted_kinds)
                                      AND (d.limit_key IS NULL OR d.limit_key <> ALL (restricted))
                                      AND d.queue <> ALL (g_queues) AND d.event_type <> ALL (g_kinds)
                                    ORDER BY d.next_attempt_at, d.id
                                    LIMIT room
                                    FOR UPDATE SKIP LOCKED) AS due
                                UNION ALL
                                SELECT kd.ctid, kd.priority, kd.next_attempt_at, kd.id, kd.event_type, kd.queue
                                FROM unnest(limited, key_room) AS k(key, left_over)
                                CROSS JOIN LATERAL (
                                    SELECT d.ctid, d.priority, d.next_attempt_at, d.id, d.event_type, d.queue
                                    FROM conveyor.outbox_events d
                                    WHERE d.workspace_id = ws AND d.limit_key = k.key
                                      AND d.status = 'pending' AND d.next_attempt_at <= now()
                                      AND d.queue <> ALL (held_queues) AND d.event_type <> ALL (held_kinds)
                                      AND (d.event_type <> ALL (restricted_kinds)
                                           OR d.event_type = ANY (limited_kinds))
                                      AND (d.queue <> ALL (g_queues) OR d.queue = ANY (
                                               ARRAY(SELECT g.name FROM unnest(g_queues, gq_share) AS g(name, n)
                                                     WHERE g.n > 0)))
                                      AND (d.event_type <> ALL (g_kinds) OR d.event_type = ANY (
                                               ARRAY(SELECT g.name FROM unnest(g_kinds, gk_share) AS g(name, n)
                                                     WHERE g.n > 0)))
                                    ORDER BY d.priority, d.next_attempt_at, d.id
                                    LIMIT least(k.left_over, room)
                                    FOR UPDATE SKIP LOCKED) AS kd
                                UNION ALL
                                SELECT td.ctid, td.priority, td.next_attempt_at, td.id, td.event_type, td.queue
                                FROM unnest(limited_kinds, kind_room) AS t(kind, left_over)
                                CROSS JOIN LATERAL (
                                    SELECT d.ctid, d.priority, d.next_attempt_at, d.id, d.event_type, d.queue
                                    FROM conveyor.outbox_events d
                                    WHERE d.workspace_id = ws AND d.event_type = t.kind
                                      AND d.status = 'pending' AND d.next_attempt_at <= now()
                                      AND d.queue <> ALL (held_queues) AND d.event_type <> ALL (held_kinds)
                                      AND (d.limit_key IS NULL OR d.limit_key <> ALL (restricted))
                                      AND (d.queue <> ALL (g_queues) OR d.queue = ANY (
                                               ARRAY(SELECT g.name FROM unnest(g_queues, gq_share) AS g(name, n)
                                                     WHERE g.n > 0)))
                                      AND (d.event_type <> ALL (g_kinds) OR d.event_type = ANY (
                                               ARRAY(SELECT g.name FROM unnest(g_kinds, gk_share) AS g(name, n)
                                                     WHERE g.n > 0)))
                                    ORDER BY d.priority, d.next_attempt_at, d.id
                                    LIMIT least(t.left_over, room)
                                    FOR UPDATE SKIP LOCKED) AS td
                                UNION ALL
                                SELECT qd.ctid, qd.priority, qd.next_attempt_at, qd.id, qd.event_type, qd.queue
                                FROM unnest(g_queues, gq_share) AS g(name, n)
                                CROSS JOIN LATERAL (
                                    SELECT d.ctid, d.priority, d.next_attempt_at, d.id, d.event_type, d.queue
                                    FROM conveyor.outbox_events d
                                    WHERE d.workspace_id = ws AND d.queue = g.name
                                      AND d.status = 'pending' AND d.next_attempt_at <= now()
                                      AND d.queue <> ALL (held_queues) AND d.event_type <> ALL (held_kinds)
                                      AND (d.limit_key IS NULL OR d.limit_key <> ALL (restricted))
                                      AND d.event_type <> ALL (restricted_kinds)
                                      AND (d.event_type <> ALL (g_kinds) OR d.event_type = ANY (
                                               ARRAY(SELECT k.name FROM unnest(g_kinds, gk_share) AS k(name, n)
                                                     WHERE k.n > 0)))
                                    ORDER BY d.priority, d.next_attempt_at, d.id
                                    LIMIT least(g.n, room)
                                    FOR UPDATE SKIP LOCKED) AS qd
                                UNION ALL
                                SELECT gd.ctid, gd.priority, gd.next_attempt_at, gd.id, gd.event_type, gd.queue
                                FROM unnest(g_kinds, gk_share) AS g(name, n)
                                CROSS JOIN LATERAL (
                                    SELECT d.ctid, d.priority, d.next_attempt_at, d.id, d.event_type, d.queue
                                    FROM conveyor.outbox_events d
                                    WHERE d.workspace_id = ws AND d.event_type = g.name
                                      AND d.status = 'pending' AND d.next_attempt_at <= now()
                                      AND d.queue <> ALL (held_queues) AND d.event_type <> ALL (held_kinds)
                                      AND (d.limit_key IS NULL OR d.limit_key <> ALL (restricted))
                                      AND d.event_type <> ALL (restricted_kinds)
                                      AND d.queue <> ALL (g_queues)
                                    ORDER BY d.priority, d.next_attempt_at, d.id
                                    LIMIT least(g.n, room)
                                    FOR UPDATE SKIP LOCKED) AS gd) AS c) AS c
                    LEFT JOIN unnest(limited_kinds, kind_room) AS t(kind, left_over) ON t.kind = c.event_type
                    LEFT JOIN unnest(g_queues, gq_share) AS gq(name, n) ON gq.name = c.queue
                    LEFT JOIN unnest(g_kinds, gk_share) AS gk(name, n) ON gk.name = c.event_type
                    WHERE (t.kind IS NULL OR c.nth <= t.left_over)
                      AND (gq.name IS NULL OR c.nth_in_queue <= gq.n)
                      AND (gk.name IS NULL OR c.nth <= gk.n)
                    ORDER BY c.priority, c.next_attempt_at, c.id
                    LIMIT room);
            END IF;
            IF any_global THEN
                -- What this workspace took of each limit, leases taken over included, is gone from its room.
                took_q := ARRAY(SELECT coalesce(t.n, 0)
                                FROM unnest(g_queues) WITH ORDINALITY AS g(name, i)
                                LEFT JOIN (SELECT e.queue AS name, count(*)::integer AS n
                                           FROM conveyor.outbox_events e
                                           WHERE e.ctid = ANY (lease_ctids) OR e.ctid = ANY (due_ctids)
                                           GROUP BY e.queue) AS t ON t.name = g.name
                                ORDER BY g.i);
                took_k := ARRAY(SELECT coalesce(t.n, 0)
                                FROM unnest(g_kinds) WITH ORDINALITY AS g(name, i)
                                LEFT JOIN (SELECT e.event_type AS name, count(*)::integer AS n
                                           FROM conveyor.outbox_events e
                                           WHERE e.ctid = ANY (lease_ctids) OR e.ctid = ANY (due_ctids)
                                           GROUP BY e.event_type) AS t ON t.name = g.name
                                ORDER BY g.i);
                gq_left := ARRAY(SELECT g.left_over - g.n FROM unnest(gq_left, took_q)
                                      WITH ORDINALITY AS g(left_over, n, i)
                                 ORDER BY g.i);
                gq_taken := ARRAY(SELECT g.taken + g.n FROM unnest(gq_taken, took_q) WITH ORDINALITY AS g(taken, n, i)
                                  ORDER BY g.i);
                gk_left := ARRAY(SELECT g.left_over - g.n FROM unnest(gk_left, took_k)
                                      WITH ORDINALITY AS g(left_over, n, i)
                                 ORDER BY g.i);
                gk_taken := ARRAY(SELECT g.taken + g.n FROM unnest(gk_taken, took_k) WITH ORDINALITY AS g(taken, n, i)
                                  ORDER BY g.i);
                -- The lines: where this workspace still has due jobs of a limit after this claim, it stays in the
                -- line (or joins it, with the fewest jobs taken in it), its count grown by what it took, seen now;
                -- elsewhere it leaves. One that had a part and took none (its window, its own limits or another
                -- global limit held it) goes to the end of the line, so that it does not keep the room from the
                -- others while it cannot take.
                WITH lims AS (
                    SELECT 'queue'::text AS scope, g.name, g.n AS took, g.share > 0 AND g.n = 0 AS passed, g.i,
                           g.wants AND EXISTS (
                               SELECT 1 FROM conveyor.outbox_events d
                               WHERE d.workspace_id = ws AND d.queue = g.name AND d.status = 'pending'
                                 AND d.next_attempt_at <= now()
                                 AND d.queue <> ALL (held_queues) AND d.event_type <> ALL (held_kinds)
                                 AND d.ctid <> ALL (due_ctids) AND d.ctid <> ALL (lease_ctids)) AS more
                    FROM unnest(g_queues, gq_total, gq_share, took_q, wants_q)
                         WITH ORDINALITY AS g(name, total, share, n, wants, i)
                    WHERE g.total IS NOT NULL
                    UNION ALL
                    SELECT 'kind', g.name, g.n, g.share > 0 AND g.n = 0, 1000000 + g.i,
                           g.wants AND EXISTS (
                               SELECT 1 FROM conveyor.outbox_events d
                               WHERE d.workspace_id = ws AND d.event_type = g.name AND d.status = 'pending'
                                 AND d.next_attempt_at <= now()
                                 AND d.queue <> ALL (held_queues) AND d.event_type <> ALL (held_kinds)
                                 AND d.ctid <> ALL (due_ctids) AND d.ctid <> ALL (lease_ctids))
                    FROM unnest(g_kinds, gk_total, gk_share, took_k, wants_k)
                         WITH ORDINALITY AS g(name, total, share, n, wants, i)
                    WHERE g.total IS NOT NULL),
                line AS (
                    SELECT l.* FROM unnest(line_scopes, line_names, line_workspaces, line_taken, line_at)
                                    WITH ORDINALITY AS l(scope, name, wsp, taken, at, i))
                SELECT coalesce(array_agg(n.scope ORDER BY n.o), '{}'), coalesce(array_agg(n.name ORDER BY n.o), '{}'),
                       coalesce(array_agg(n.wsp ORDER BY n.o), '{}'), coalesce(array_agg(n.taken ORDER BY n.o), '{}'),
                       coalesce(array_agg(n.at ORDER BY n.o), '{}')
                INTO line_scopes, line_names, line_workspaces, line_taken, line_at
                FROM (SELECT l.scope, l.name, l.wsp,
                             CASE WHEN m.passed
                                  THEN (SELECT max(o.taken) + 1 FROM line o
                                        WHERE o.scope = l.scope AND o.name = l.name)
                                  ELSE l.taken + coalesce(m.took, 0) END AS taken,
                             CASE WHEN l.wsp = ws THEN now() ELSE l.at END AS at, l.i AS o
                      FROM line l
                      LEFT JOIN lims m ON m.scope = l.scope AND m.name = l.name AND l.wsp = ws
                      WHERE l.wsp <> ws OR m.more
                      UNION ALL
                      SELECT m.scope, m.name, ws,
                             CASE WHEN m.passed
                                  THEN coalesce((SELECT max(l.taken) + 1 FROM line l
                                                 WHERE l.scope = m.scope AND l.name = m.name), 0)
                                  ELSE coalesce((SELECT min(l.taken) FROM line l
                                                 WHERE l.scope = m.scope AND l.name = m.name), 0) + m.took END,
                             now(), 9000000000 + m.i
                      FROM lims m
                      WHERE m.more AND NOT EXISTS (SELECT 1 FROM line l
                                                   WHERE l.scope = m.scope AND l.name = m.name AND l.wsp = ws)) AS n;
            END IF;
            RETURN QUERY
                WITH claimed AS (
                    UPDATE conveyor.outbox_events e
                    SET status = 'dispatching', locked_by = holder,
                        locked_until = now() + make_interval(secs => lease_secs)
                    WHERE e.ctid = ANY (lease_ctids) OR e.ctid = ANY (due_ctids)
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
        -- The global rates' logs and lines, of the limits this call locked.
        IF any_global THEN
            PERFORM conveyor.conveyor_global_record(array_agg(t.scope), array_agg(t.name), array_agg(t.taken),
                                                    line_scopes, line_names, line_workspaces, line_taken, line_at)
            FROM (SELECT 'queue'::text AS scope, g.name, g.taken
                  FROM unnest(g_queues, gq_taken, gq_total) AS g(name, taken, total) WHERE g.total IS NOT NULL
                  UNION ALL
                  SELECT 'kind', g.name, g.taken
                  FROM unnest(g_kinds, gk_taken, gk_total) AS g(name, taken, total) WHERE g.total IS NOT NULL) AS t;
        END IF;
    END
    $$;

-- The claim calls the three functions above: a role that may claim (the runtime
-- role, granted by an earlier `conveyor migrate`) may do so from now on, so that no claim fails between this migration
-- and the grants that follow it.
DO $$
DECLARE
    claimer text;
BEGIN
    FOR claimer IN
        SELECT DISTINCT r.rolname
        FROM pg_catalog.pg_proc p
        CROSS JOIN LATERAL pg_catalog.aclexplode(p.proacl) AS a
        JOIN pg_catalog.pg_roles r ON r.oid = a.grantee
        WHERE p.oid = 'conveyor.conveyor_claim_jobs_fair(uuid[], text, double precision, integer, integer, uuid[],
                                                          text[], integer[], integer)'::pg_catalog.regprocedure
          AND a.privilege_type = 'EXECUTE' AND r.rolname <> current_user
    LOOP
        EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION conveyor.conveyor_global_limits_exist() TO %I', claimer);
        EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION conveyor.conveyor_global_rooms(uuid[]) TO %I', claimer);
        EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION conveyor.conveyor_global_record(text[], text[], '
                                  'integer[], text[], text[], uuid[], integer[], timestamptz[]) TO %I', claimer);
    END LOOP;
END
$$;
