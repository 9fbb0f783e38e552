-- The relay's mark and the worker's record of ends both update batches of outbox rows, and a job can end before its
-- hand-off is recorded (the mark of a notified batch is recorded in the background). Each locked its rows in whatever
-- order its plan met them, so a mark and a record of ends sharing two rows could lock them in opposite orders and
-- deadlock (measured in the burst benchmark: PostgreSQL broke each deadlock after deadlock_timeout, one second).
-- Both now take their workspaces in id order and, within each, lock their rows in id order before updating them: every
-- batch writer of outbox rows locks in (workspace, id) order, so none can wait for another in a cycle.

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
        PERFORM set_config('app.workspace_id', '', true);
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
    BEGIN
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
