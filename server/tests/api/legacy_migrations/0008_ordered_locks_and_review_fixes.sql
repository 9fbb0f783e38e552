-- The relay's mark and the worker's record of ends both update batches of outbox rows, and a job can end before its
-- hand-off is recorded (the mark of a notified batch is recorded in the background). Each locked its rows in whatever
-- order its plan met them, so a mark and a record of ends sharing two rows could lock them in opposite orders and
-- deadlock (measured in the burst benchmark: PostgreSQL broke each deadlock after deadlock_timeout, one second).
-- Both now take their workspaces in id order and, within each, lock their rows in id order before updating them: every
-- batch writer of outbox rows locks in (workspace, id) order, so none can wait for another in a cycle. Both restore the
-- caller's workspace setting at the end instead of clearing it. The record of ends no longer checks the generation: a
-- successful run of any generation ends a live job (a newer generation's delivery is then skipped); and it commits
-- without waiting for its WAL flush (see below).

CREATE OR REPLACE FUNCTION conveyor_mark_outbox_dispatched(holder text, workspaces uuid[], tids tid[], ids uuid[],
                                                           redrives integer[], stream_ids text[])
    RETURNS bigint
    LANGUAGE plpgsql VOLATILE SECURITY INVOKER
    SET enable_seqscan = off
    SET jit = off
    AS $$
    DECLARE
        ws uuid;
        marked bigint := 0;
        n bigint;
        caller text := current_setting('app.workspace_id', true);
    BEGIN
        PERFORM set_config('synchronous_commit', 'off', true);
        FOR ws IN SELECT DISTINCT w FROM unnest(workspaces) AS w ORDER BY w LOOP
            PERFORM set_config('app.workspace_id', ws::text, true);
            PERFORM 1 FROM public.outbox_events e
            WHERE e.ctid = ANY(ARRAY(SELECT v.tid FROM unnest(workspaces, tids) AS v(workspace_id, tid)
                                     WHERE v.workspace_id = ws))
            ORDER BY e.id
            FOR UPDATE;
            UPDATE public.outbox_events e
            SET status = 'dispatched', stream_id = v.stream_id, dispatched_at = now(),
                locked_by = NULL, locked_until = NULL, last_error = NULL
            FROM unnest(workspaces, tids, ids, redrives, stream_ids) AS v(workspace_id, tid, id, redrive, stream_id)
            WHERE v.workspace_id = ws AND e.ctid = v.tid
              AND e.id IS NOT DISTINCT FROM v.id AND e.status IS NOT DISTINCT FROM 'dispatching'
              AND e.redrive_count IS NOT DISTINCT FROM v.redrive
              AND e.locked_by = holder AND e.locked_until > now();
            GET DIAGNOSTICS n = ROW_COUNT;
            marked := marked + n;
        END LOOP;
        PERFORM set_config('app.workspace_id', coalesce(caller, ''), true);
        RETURN marked;
    END
    $$;

CREATE OR REPLACE FUNCTION conveyor_complete_jobs(workspaces uuid[], ids uuid[], redrives integer[], results jsonb[])
    RETURNS bigint
    LANGUAGE plpgsql VOLATILE SECURITY INVOKER
    AS $$
    DECLARE
        ws uuid;
        done bigint := 0;
        n bigint;
        caller text := current_setting('app.workspace_id', true);
    BEGIN
        -- Relaxed commit, as the relay's: an end lost in a PostgreSQL crash leaves the job `dispatched` with its entry
        -- acknowledged, so the reconciler of lost entries runs it again (at least once); a job with a transaction of
        -- its own records its end there, durably, with its writes.
        PERFORM set_config('synchronous_commit', 'off', true);
        FOR ws IN SELECT DISTINCT w FROM unnest(workspaces) AS w ORDER BY w LOOP
            PERFORM set_config('app.workspace_id', ws::text, true);
            PERFORM 1 FROM public.outbox_events e
            WHERE e.id = ANY(ARRAY(SELECT v.id FROM unnest(workspaces, ids) AS v(workspace_id, id)
                                   WHERE v.workspace_id = ws))
              AND e.status IN ('pending', 'dispatching', 'dispatched')
            ORDER BY e.id
            FOR UPDATE;
            UPDATE public.outbox_events e
            SET status = 'completed', finished_at = clock_timestamp(), result = v.result, locked_by = NULL,
                locked_until = NULL
            FROM unnest(workspaces, ids, redrives, results) AS v(workspace_id, id, redrive, result)
            WHERE v.workspace_id = ws AND e.id = v.id AND e.workspace_id = ws
              AND e.status IN ('pending', 'dispatching', 'dispatched');
            GET DIAGNOSTICS n = ROW_COUNT;
            IF n > 0 THEN
                PERFORM pg_notify('conveyor_jobs_done', ws::text);
            END IF;
            done := done + n;
        END LOOP;
        PERFORM set_config('app.workspace_id', coalesce(caller, ''), true);
        RETURN done;
    END
    $$;

-- Before 0006 a job that ran ended `dispatched` for good; since, `dispatched` means handed to the workers and not yet
-- ended. Jobs whose operation has ended are ended here, so that nothing mistakes them for live ones (the de-dup
-- index, job lookups, the reconciler of jobs without an operation). The migration runs as the owner, whom FORCE
-- subjects to the policies, hence the moment without FORCE.
ALTER TABLE outbox_events NO FORCE ROW LEVEL SECURITY;
UPDATE outbox_events e
SET status = CASE o.status WHEN 'succeeded' THEN 'completed' ELSE 'canceled' END,
    finished_at = coalesce(o.finished_at, e.dispatched_at, now())
FROM operations o
WHERE e.status = 'dispatched' AND o.id = e.operation_id AND o.status IN ('succeeded', 'failed', 'canceled');
ALTER TABLE outbox_events FORCE ROW LEVEL SECURITY;

-- The earliest time a pending job becomes due, for the dispatcher's timer. Jobs due more than a second ago are left
-- out: one that stays unclaimed (locked for long by someone) would otherwise hide every later one; sweeps take them.
CREATE OR REPLACE FUNCTION conveyor_next_due_at() RETURNS timestamptz
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, public
    AS $$
        SELECT min(e.next_attempt_at) FROM public.outbox_events e
        WHERE e.status = 'pending' AND e.next_attempt_at > now() - interval '1 second'
    $$;

-- Of the delivered jobs (workspaces[i], ids[i], generation redrives[i]), those that must not run: ended (completed,
-- canceled, dead-lettered), or moved to a newer generation than the delivery's (a retry or a re-drive is scheduled,
-- and its own delivery decides). Restores the caller's workspace setting at the end.
CREATE FUNCTION conveyor_jobs_not_to_run(workspaces uuid[], ids uuid[], redrives integer[])
    RETURNS TABLE (id uuid)
    LANGUAGE plpgsql STABLE SECURITY INVOKER
    AS $$
    #variable_conflict use_column
    DECLARE
        ws uuid;
        caller text := current_setting('app.workspace_id', true);
    BEGIN
        FOR ws IN SELECT DISTINCT w FROM unnest(workspaces) AS w LOOP
            PERFORM set_config('app.workspace_id', ws::text, true);
            RETURN QUERY
                SELECT e.id FROM public.outbox_events e
                JOIN unnest(workspaces, ids, redrives) AS v(workspace_id, id, redrive)
                  ON v.id = e.id AND v.workspace_id = ws
                WHERE e.workspace_id = ws
                  AND (e.status IN ('completed', 'canceled', 'dead_letter')
                       OR (v.redrive IS NOT NULL AND e.redrive_count > v.redrive));
        END LOOP;
        PERFORM set_config('app.workspace_id', coalesce(caller, ''), true);
    END
    $$;

-- The SQL enqueue (see 0006), now: refusing an operation that is not a live one of the workspace (a foreign key
-- check would accept another workspace's), trying again when the holder of a de-dup key ends between the insert and
-- the look-up, and telling the dispatchers when a delayed job is due.
CREATE OR REPLACE FUNCTION conveyor_enqueue(kind text, payload jsonb, run_at timestamptz DEFAULT NULL,
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
        due timestamptz := coalesce(conveyor_enqueue.run_at, now());
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
        IF conveyor_enqueue.operation_id IS NOT NULL AND NOT EXISTS (
            SELECT 1 FROM public.operations o
            WHERE o.id = conveyor_enqueue.operation_id AND o.status IN ('queued', 'running')) THEN
            RAISE EXCEPTION 'conveyor_enqueue: operation % is not a live operation of this workspace',
                conveyor_enqueue.operation_id USING ERRCODE = '22023';
        END IF;
        FOR attempt IN 1..3 LOOP
            INSERT INTO public.outbox_events AS e (id, workspace_id, queue, event_type, event_payload, operation_id,
                                                   next_attempt_at, dedup_key, priority, max_attempts)
            VALUES (new_id, ws, q, conveyor_enqueue.kind, conveyor_enqueue.payload, conveyor_enqueue.operation_id,
                    due, conveyor_enqueue.dedup_key, p, conveyor_enqueue.max_attempts)
            ON CONFLICT (workspace_id, event_type, dedup_key)
                WHERE dedup_key IS NOT NULL AND status IN ('pending', 'dispatching', 'dispatched')
                DO NOTHING
            RETURNING e.id INTO got;
            IF got IS NOT NULL THEN
                PERFORM pg_notify('conveyor_outbox', ws::text
                    || CASE WHEN due > now() THEN '@' || floor(extract(epoch FROM due) * 1000)::bigint ELSE '' END);
                RETURN got;
            END IF;
            SELECT e.id INTO got FROM public.outbox_events e
            WHERE e.workspace_id = ws AND e.event_type = conveyor_enqueue.kind
              AND e.dedup_key = conveyor_enqueue.dedup_key
              AND e.status IN ('pending', 'dispatching', 'dispatched');
            IF got IS NOT NULL THEN
                RETURN got;
            END IF;
            -- The holder ended between the insert and the look-up: the key is free again.
        END LOOP;
        RAISE EXCEPTION 'conveyor_enqueue: the de-dup key % keeps changing hands; try again', conveyor_enqueue.dedup_key
            USING ERRCODE = '40001';
    END
    $$;
