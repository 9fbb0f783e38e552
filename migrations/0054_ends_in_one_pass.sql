-- The worker's batched record of ends (0042's `conveyor_complete_jobs`) locked its rows in a pass of their own
-- (`SELECT .. ORDER BY id FOR UPDATE`) before updating them, so that two transactions that share rows (a relay's mark,
-- another record of the same jobs) lock them in one order and never deadlock. That pass wrote a lock into every row
-- (a WAL record and a dirtied page each) only to have the update write the row again: in the burst benchmark it took
-- a third as long as the update itself.
--
-- Now the update locks in that order itself: a nested loop whose outer side is the batch sorted by id, and whose inner
-- side finds each row by primary key, so that rows are locked, and updated, one after the other in id order. The
-- function's settings leave the planner no other join or scan. Same rows, same result, same notification.
SET LOCAL search_path = conveyor;

CREATE OR REPLACE FUNCTION conveyor_complete_jobs(workspaces uuid[], ids uuid[], redrives integer[], results jsonb[])
    RETURNS bigint
    LANGUAGE plpgsql VOLATILE SECURITY INVOKER
    SET search_path = pg_catalog, conveyor, pg_temp
    SET enable_seqscan = off
    SET enable_bitmapscan = off
    SET enable_hashjoin = off
    SET enable_mergejoin = off
    SET enable_material = off
    SET jit = off
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
            UPDATE conveyor.outbox_events e
            SET status = 'completed', finished_at = clock_timestamp(), result = v.result, locked_by = NULL,
                locked_until = NULL, dispatched_at = coalesce(e.dispatched_at, now())
            FROM (SELECT b.id, b.result FROM unnest(workspaces, ids, results) AS b(workspace_id, id, result)
                  WHERE b.workspace_id = ws
                  ORDER BY b.id) AS v
            WHERE e.id = v.id AND e.workspace_id = ws
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

-- The relay's mark, alike: its lock pass (0008's, in id order) goes, and its update locks in id order itself. A row
-- found at its ctid with another id, generation, status or holder is not this batch's, as before.
CREATE OR REPLACE FUNCTION conveyor_mark_outbox_dispatched(holder text, workspaces uuid[], tids tid[], ids uuid[],
                                                           redrives integer[], stream_ids text[])
    RETURNS bigint
    LANGUAGE plpgsql VOLATILE SECURITY INVOKER
    SET search_path = pg_catalog, conveyor, pg_temp
    SET enable_seqscan = off
    SET enable_bitmapscan = off
    SET enable_hashjoin = off
    SET enable_mergejoin = off
    SET enable_material = off
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
            UPDATE conveyor.outbox_events e
            SET status = 'dispatched', stream_id = v.stream_id, dispatched_at = now(),
                locked_by = NULL, locked_until = NULL, last_error = NULL
            FROM (SELECT b.tid, b.id, b.redrive, b.stream_id
                  FROM unnest(workspaces, tids, ids, redrives, stream_ids)
                       AS b(workspace_id, tid, id, redrive, stream_id)
                  WHERE b.workspace_id = ws
                  ORDER BY b.id) AS v
            WHERE e.ctid = v.tid
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
