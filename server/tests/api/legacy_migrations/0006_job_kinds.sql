-- Conveyor as a library: open job kinds, enqueue options (run at, de-duplication key, priority, attempts, back-off,
-- time-out), job control (lookup, cancel, completion) and an enqueue function for services in other languages.
--
-- A job is an outbox event. Its life: pending (waiting for its time, or for the relay) → dispatching (leased by a
-- dispatcher) → dispatched (in a stream, or running) → completed | canceled | dead_letter. Before this migration a job
-- that ran ended `dispatched` for good and only its operation told how it went; now the worker records the end on the
-- event too, so a job without an operation can be looked up, waited for and canceled.

ALTER TABLE outbox_events DROP CONSTRAINT outbox_events_status_check;
ALTER TABLE outbox_events ADD CONSTRAINT outbox_events_status_check
    CHECK (status IN ('pending', 'dispatching', 'dispatched', 'completed', 'canceled', 'dead_letter'));

ALTER TABLE outbox_events
    -- 0 high, 1 normal, 2 low: of a workspace's due jobs, the relay hands off the higher priority first.
    ADD COLUMN priority       smallint NOT NULL DEFAULT 1 CHECK (priority BETWEEN 0 AND 2),
    -- At most one live job per (workspace, kind, key): see outbox_events_dedup.
    ADD COLUMN dedup_key      text     CHECK (length(dedup_key) BETWEEN 1 AND 256),
    -- Per-job options; NULL means the kind's default (known to the worker that runs it).
    ADD COLUMN max_attempts   integer  CHECK (max_attempts BETWEEN 1 AND 1000),
    ADD COLUMN timeout_ms     bigint   CHECK (timeout_ms BETWEEN 1 AND 86400000),
    ADD COLUMN backoff_ms     bigint   CHECK (backoff_ms BETWEEN 0 AND 86400000),
    ADD COLUMN backoff_max_ms bigint   CHECK (backoff_max_ms BETWEEN 0 AND 604800000),
    -- Progress of a job without an operation (a job with one reports on the operation), its result, its end.
    ADD COLUMN progress       jsonb,
    ADD COLUMN result         jsonb,
    ADD COLUMN finished_at    timestamptz,
    ADD CONSTRAINT outbox_events_finished CHECK ((status IN ('completed', 'canceled')) = (finished_at IS NOT NULL));

-- The claim walks a workspace's due jobs by priority, then due time, then id (for fresh jobs: the order written).
CREATE INDEX outbox_events_due_by_priority ON outbox_events (workspace_id, priority, next_attempt_at, id)
    WHERE status = 'pending';
DROP INDEX outbox_events_due;
-- The earliest pending job of all: the dispatcher sleeps until then (delayed jobs fire on time, not on a sweep).
CREATE INDEX outbox_events_next_due ON outbox_events (next_attempt_at) WHERE status = 'pending';
-- De-duplication, enforced by the database: a second live job with the same key cannot exist.
CREATE UNIQUE INDEX outbox_events_dedup ON outbox_events (workspace_id, event_type, dedup_key)
    WHERE dedup_key IS NOT NULL AND status IN ('pending', 'dispatching', 'dispatched');
-- Finished jobs by age, for retention.
CREATE INDEX outbox_events_finished_at ON outbox_events (workspace_id, finished_at)
    WHERE status IN ('completed', 'canceled');

-- ---------------------------------------------------------------------------------------------------------------
-- Job kinds that workers have registered: their queue and defaults. Not tenant data (no workspace, no payload). The
-- SQL enqueue function needs it to route a kind to its queue; a worker upserts its kinds when it starts.
CREATE TABLE job_kinds (
    kind           text        PRIMARY KEY CHECK (kind ~ '^[a-z0-9][a-z0-9_.:-]{0,99}$'),
    queue          text        NOT NULL CHECK (queue ~ '^[a-z0-9][a-z0-9_.-]{0,99}$'),
    max_attempts   integer     NOT NULL CHECK (max_attempts BETWEEN 1 AND 1000),
    timeout_ms     bigint      NOT NULL CHECK (timeout_ms > 0),
    registered_at  timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now()
);

-- A UUIDv7 (time-ordered), as the Rust side makes them: 48 bits of Unix milliseconds, version 7, random bits.
CREATE FUNCTION conveyor_uuid_v7() RETURNS uuid
    LANGUAGE sql VOLATILE
    AS $$
        SELECT encode(
            set_bit(set_bit(overlay(uuid_send(gen_random_uuid())
                                    PLACING substring(int8send(floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint)
                                                      FROM 3)
                                    FROM 1 FOR 6),
                            52, 1),
                    53, 1),
            'hex')::uuid
    $$;

-- Enqueues a job of a registered kind in the caller's transaction, in the workspace the transaction has set
-- (`set_config('app.workspace_id', …, true)`), under row-level security: it runs as the caller. For services in
-- other languages: one SELECT in their own transaction, atomic with their own rows. Returns the job id; with a
-- `dedup_key` that a live job of the kind already holds in the workspace, that job's id (and nothing is written).
CREATE FUNCTION conveyor_enqueue(kind text, payload jsonb, run_at timestamptz DEFAULT NULL,
                                 dedup_key text DEFAULT NULL, priority text DEFAULT 'normal',
                                 max_attempts integer DEFAULT NULL, operation_id uuid DEFAULT NULL)
    RETURNS uuid
    LANGUAGE plpgsql VOLATILE SECURITY INVOKER
    AS $$
    #variable_conflict use_column
    DECLARE
        ws uuid := conveyor_current_workspace();
        q text;
        p smallint;
        new_id uuid := conveyor_uuid_v7();
        got uuid;
    BEGIN
        IF ws IS NULL THEN
            RAISE EXCEPTION 'conveyor_enqueue: no workspace is set (set_config(''app.workspace_id'', …, true))'
                USING ERRCODE = '42501';
        END IF;
        SELECT k.queue INTO q FROM public.job_kinds k WHERE k.kind = conveyor_enqueue.kind;
        IF q IS NULL THEN
            RAISE EXCEPTION 'conveyor_enqueue: unknown job kind %', kind
                USING ERRCODE = '22023', HINT = 'A worker registers its kinds when it starts.';
        END IF;
        IF jsonb_typeof(conveyor_enqueue.payload) IS DISTINCT FROM 'object' THEN
            RAISE EXCEPTION 'conveyor_enqueue: the payload must be a JSON object' USING ERRCODE = '22023';
        END IF;
        p := CASE conveyor_enqueue.priority WHEN 'high' THEN 0 WHEN 'normal' THEN 1 WHEN 'low' THEN 2 END;
        IF p IS NULL THEN
            RAISE EXCEPTION 'conveyor_enqueue: priority must be high, normal or low' USING ERRCODE = '22023';
        END IF;
        IF conveyor_enqueue.max_attempts < 1 THEN
            RAISE EXCEPTION 'conveyor_enqueue: max_attempts must be at least 1' USING ERRCODE = '22023';
        END IF;
        INSERT INTO public.outbox_events AS e (id, workspace_id, queue, event_type, event_payload, operation_id,
                                               next_attempt_at, dedup_key, priority, max_attempts)
        VALUES (new_id, ws, q, conveyor_enqueue.kind, conveyor_enqueue.payload, conveyor_enqueue.operation_id,
                coalesce(conveyor_enqueue.run_at, now()), conveyor_enqueue.dedup_key, p, conveyor_enqueue.max_attempts)
        ON CONFLICT (workspace_id, event_type, dedup_key)
            WHERE dedup_key IS NOT NULL AND status IN ('pending', 'dispatching', 'dispatched')
            DO NOTHING
        RETURNING e.id INTO got;
        IF got IS NULL THEN
            SELECT e.id INTO got FROM public.outbox_events e
            WHERE e.workspace_id = ws AND e.event_type = conveyor_enqueue.kind
              AND e.dedup_key = conveyor_enqueue.dedup_key
              AND e.status IN ('pending', 'dispatching', 'dispatched');
            RETURN got;
        END IF;
        PERFORM pg_notify('conveyor_outbox', ws::text);
        RETURN got;
    END
    $$;

-- When the earliest pending job becomes due (NULL when none is pending): a time, nothing about any workspace.
CREATE FUNCTION conveyor_next_due_at() RETURNS timestamptz
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, public
    AS $$ SELECT min(e.next_attempt_at) FROM public.outbox_events e WHERE e.status = 'pending' $$;
REVOKE ALL ON FUNCTION conveyor_next_due_at() FROM PUBLIC;

-- The relay's claim (see 0004), now by priority: for each workspace, its expired leases and up to `per_workspace` due
-- jobs, high priority first, then normal, then low, each level in due order. Each level is a range of the index
-- (workspace, priority, due time), so delayed jobs not yet due are never walked over. Returns the per-job options too.
CREATE FUNCTION conveyor_claim_jobs(workspaces uuid[], holder text, lease_secs double precision,
                                    per_workspace integer)
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
    BEGIN
        PERFORM set_config('synchronous_commit', 'off', true);
        FOREACH ws IN ARRAY workspaces LOOP
            PERFORM set_config('app.workspace_id', ws::text, true);
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
                   OR e.ctid = ANY(ARRAY(
                          SELECT due.ctid
                          FROM unnest(ARRAY[0, 1, 2]::smallint[]) AS level(p)
                          CROSS JOIN LATERAL (
                              SELECT d.ctid FROM public.outbox_events d
                              WHERE d.status = 'pending' AND d.priority = level.p AND d.next_attempt_at <= now()
                              ORDER BY d.next_attempt_at, d.id
                              LIMIT per_workspace
                              FOR UPDATE SKIP LOCKED) AS due
                          LIMIT per_workspace))
                RETURNING e.ctid, e.id, e.workspace_id, e.queue, e.event_type, e.event_payload, e.operation_id,
                          e.traceparent, e.attempt_count, e.job_attempts, e.redrive_count, e.created_at,
                          e.next_attempt_at, e.priority, e.max_attempts, e.timeout_ms, e.backoff_ms, e.backoff_max_ms;
        END LOOP;
        PERFORM set_config('app.workspace_id', '', true);
    END
    $$;

-- Of the delivered jobs (workspaces[i], ids[i]), those that must not run: canceled, finished or dead-lettered. One
-- call for a whole read of a worker, each workspace's statement under row-level security for that workspace alone.
CREATE FUNCTION conveyor_jobs_not_to_run(workspaces uuid[], ids uuid[])
    RETURNS TABLE (id uuid)
    LANGUAGE plpgsql STABLE SECURITY INVOKER
    AS $$
    #variable_conflict use_column
    DECLARE
        ws uuid;
    BEGIN
        FOR ws IN SELECT DISTINCT w FROM unnest(workspaces) AS w LOOP
            PERFORM set_config('app.workspace_id', ws::text, true);
            RETURN QUERY
                SELECT e.id FROM public.outbox_events e
                JOIN unnest(workspaces, ids) AS v(workspace_id, id) ON v.id = e.id AND v.workspace_id = ws
                WHERE e.status IN ('completed', 'canceled', 'dead_letter');
        END LOOP;
        PERFORM set_config('app.workspace_id', '', true);
    END
    $$;

-- Records jobs (workspaces[i], ids[i]) of generation redrives[i] (NULL: whichever is current) as completed with results[i], unless they were
-- canceled, dead-lettered or moved to a newer generation meanwhile; notifies each workspace's waiters. Returns how many
-- it recorded. For jobs whose handler wrote nothing: a job with a transaction records its end in it.
CREATE FUNCTION conveyor_complete_jobs(workspaces uuid[], ids uuid[], redrives integer[], results jsonb[])
    RETURNS bigint
    LANGUAGE plpgsql VOLATILE SECURITY INVOKER
    AS $$
    DECLARE
        ws uuid;
        done bigint := 0;
        n bigint;
    BEGIN
        FOR ws IN SELECT DISTINCT w FROM unnest(workspaces) AS w LOOP
            PERFORM set_config('app.workspace_id', ws::text, true);
            UPDATE public.outbox_events e
            SET status = 'completed', finished_at = now(), result = v.result, locked_by = NULL, locked_until = NULL
            FROM unnest(workspaces, ids, redrives, results) AS v(workspace_id, id, redrive, result)
            WHERE v.workspace_id = ws AND e.id = v.id AND (v.redrive IS NULL OR e.redrive_count = v.redrive)
              AND e.status IN ('pending', 'dispatching', 'dispatched');
            GET DIAGNOSTICS n = ROW_COUNT;
            IF n > 0 THEN
                PERFORM pg_notify('conveyor_jobs_done', ws::text);
            END IF;
            done := done + n;
        END LOOP;
        PERFORM set_config('app.workspace_id', '', true);
        RETURN done;
    END
    $$;

-- Retention now covers finished jobs too: workspaces holding dispatched, completed or canceled events older than
-- `older_than` (ids only).
CREATE FUNCTION conveyor_outbox_retention_workspaces_v2(older_than interval, max_workspaces integer)
    RETURNS TABLE (workspace_id uuid)
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, public
    AS $$
        SELECT w.workspace_id FROM (
            SELECT e.workspace_id FROM public.outbox_events e
            WHERE e.status = 'dispatched' AND e.dispatched_at <= now() - older_than
            UNION
            SELECT e.workspace_id FROM public.outbox_events e
            WHERE e.status IN ('completed', 'canceled') AND e.finished_at <= now() - older_than
        ) w
        LIMIT greatest(1, least(max_workspaces, 10000))
    $$;
REVOKE ALL ON FUNCTION conveyor_outbox_retention_workspaces_v2(interval, integer) FROM PUBLIC;
