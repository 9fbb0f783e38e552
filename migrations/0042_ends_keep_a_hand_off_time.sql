-- A job can end before the relay records its hand-off: the mark of a batch is written after its XADD, and a fast
-- handler's end may be recorded first. The mark then finds the row ended and leaves it, so the job stayed ended with
-- no `dispatched_at` ("last handed to the workers": none, for a job that ran). Each end recorded for a worker now keeps
-- the hand-off time it has, else writes its own start: the job was handed out no later than that. The batched record
-- of ends (below) and the worker's other ends (a completion in the handler's transaction, a dead-letter) do the same.
-- Unchanged otherwise from 0008, with 0038's search path.
SET LOCAL search_path = conveyor;

CREATE OR REPLACE FUNCTION conveyor_complete_jobs(workspaces uuid[], ids uuid[], redrives integer[], results jsonb[])
    RETURNS bigint
    LANGUAGE plpgsql VOLATILE SECURITY INVOKER
    SET search_path = pg_catalog, conveyor, pg_temp
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
            PERFORM 1 FROM conveyor.outbox_events e
            WHERE e.id = ANY(ARRAY(SELECT v.id FROM unnest(workspaces, ids) AS v(workspace_id, id)
                                   WHERE v.workspace_id = ws))
              AND e.status IN ('pending', 'dispatching', 'dispatched')
            ORDER BY e.id
            FOR UPDATE;
            UPDATE conveyor.outbox_events e
            SET status = 'completed', finished_at = clock_timestamp(), result = v.result, locked_by = NULL,
                locked_until = NULL, dispatched_at = coalesce(e.dispatched_at, now())
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
