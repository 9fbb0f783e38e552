-- No job can stop the platform (issue 25).
--
-- 1. Poison jobs end. A job whose run kills its worker (out of memory, an abort in native code) was redelivered
--    forever: a taken-over entry's attempt number comes from the entry, which never changes, so no count ever rose.
--    `stops` counts the runs of a job that ended without an outcome because the worker running them stopped (killed,
--    out of memory, cut off from Redis past the visibility time-out). A first delivery writes nothing before it runs
--    (the common path stays as cheap as it was); a delivery taken over from a stopped worker adds one to `stops` as
--    it starts, in PostgreSQL, before its handler runs: its predecessor started and never ended. A job whose count
--    reaches CONVEYOR_WORKER_MAX_DELIVERIES is dead-lettered instead of run. As with BullMQ's stalled counter, a
--    delivery the stopped worker held without starting it counts too (the taker cannot tell it from a started one),
--    and so does one its worker gave up alive (PostgreSQL failing around the job, a shutdown past its grace period); a
--    recorded retry starts the count again.
ALTER TABLE outbox_events ADD COLUMN stops integer NOT NULL DEFAULT 0;

-- For entries taken over from a stopped worker: the stops of each live job of the entry's generation among `ids`,
-- or NULL for one that must not run (ended, re-driven since the entry was written, or gone: purged by retention).
-- The worker runs a job that has already stopped a worker after a take-over alone, so that it takes no other job
-- down with it. The runtime role's, like `conveyor_jobs_not_to_run`: one statement per workspace of the batch,
-- each under that workspace's row-level security.
CREATE FUNCTION conveyor_jobs_taken_over(workspaces uuid[], ids uuid[], redrives integer[])
    RETURNS TABLE (id uuid, stops integer)
    LANGUAGE plpgsql STABLE SECURITY INVOKER
    SET search_path = pg_catalog, public, pg_temp
    AS $$
    #variable_conflict use_column
    DECLARE
        ws uuid;
        caller text := current_setting('app.workspace_id', true);
    BEGIN
        FOR ws IN SELECT DISTINCT w FROM unnest(workspaces) AS w LOOP
            PERFORM set_config('app.workspace_id', ws::text, true);
            RETURN QUERY
                SELECT v.id,
                       CASE WHEN e.status IN ('pending', 'dispatching', 'dispatched')
                                 AND NOT (v.redrive IS NOT NULL AND e.redrive_count > v.redrive)
                            THEN e.stops END
                FROM unnest(workspaces, ids, redrives) AS v(workspace_id, id, redrive)
                LEFT JOIN public.outbox_events e ON e.id = v.id AND e.workspace_id = ws
                WHERE v.workspace_id = ws;
        END LOOP;
        PERFORM set_config('app.workspace_id', coalesce(caller, ''), true);
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_jobs_taken_over(uuid[], uuid[], integer[]) FROM PUBLIC;

-- ---------------------------------------------------------------------------------------------------------------
-- 2. Retention is safe. A stream entry whose outbox row retention has deleted was taken for a live job (a missing
--    row read as "not ended") and could run again. A job PostgreSQL no longer knows is not to run: every entry is
--    written after its row commits, and rows are deleted only once their job ended.
CREATE OR REPLACE FUNCTION conveyor_jobs_not_to_run(workspaces uuid[], ids uuid[], redrives integer[])
    RETURNS TABLE (id uuid)
    LANGUAGE plpgsql STABLE SECURITY INVOKER
    SET search_path = pg_catalog, public, pg_temp
    AS $$
    #variable_conflict use_column
    DECLARE
        ws uuid;
        caller text := current_setting('app.workspace_id', true);
    BEGIN
        FOR ws IN SELECT DISTINCT w FROM unnest(workspaces) AS w LOOP
            PERFORM set_config('app.workspace_id', ws::text, true);
            RETURN QUERY
                SELECT v.id FROM unnest(workspaces, ids, redrives) AS v(workspace_id, id, redrive)
                LEFT JOIN public.outbox_events e ON e.id = v.id AND e.workspace_id = ws
                WHERE v.workspace_id = ws
                  AND (e.id IS NULL
                       OR e.status IN ('completed', 'canceled', 'dead_letter', 'discarded')
                       OR (v.redrive IS NOT NULL AND e.redrive_count > v.redrive));
        END LOOP;
        PERFORM set_config('app.workspace_id', coalesce(caller, ''), true);
    END
    $$;

-- ---------------------------------------------------------------------------------------------------------------
-- 3. Dead letters have a retention of their own (CONVEYOR_DEAD_LETTER_RETENTION, default 30 days, written here by
--    `conveyor migrate` like the audit retention, 0035). Past it a dead letter is discarded as an operator's discard
--    does (a tombstone the outbox retention deletes later; its operation stays failed), and each purge that
--    discarded any writes one row to the audit trail. The floor is the owner's: the runtime role (maintenance) may
--    keep more, never less.
-- `conveyor migrate` writes the setting on every run (this function falls back to 30 days without it).
CREATE FUNCTION conveyor_dead_letter_purge(older_than interval, max_rows integer)
    RETURNS bigint
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, public, pg_temp
    AS $$
    DECLARE
        purged bigint;
        retention interval;
        kept interval;
        jobs uuid[];
        ws uuid;
        caller text := pg_catalog.current_setting('app.workspace_id', true);
    BEGIN
        IF older_than IS NULL OR older_than < interval '1 day' THEN
            RAISE EXCEPTION 'conveyor_dead_letter_purge: dead letters are kept at least a day, not %', older_than
                USING ERRCODE = '22023';
        END IF;
        SELECT s.value::interval INTO retention FROM public.conveyor_settings s
        WHERE s.name = 'dead_letter_retention';
        kept := GREATEST(older_than, coalesce(retention, interval '30 days'));
        -- Dead letters are few and indexed by status (0028): the walk reads them, not the table.
        jobs := ARRAY(
            SELECT e.id FROM public.outbox_events e
            WHERE e.status = 'dead_letter' AND e.dead_lettered_at < pg_catalog.now() - kept
            LIMIT GREATEST(1, LEAST(max_rows, 10000)));
        -- Writes are walled off by workspace even for the owner (FORCE ROW LEVEL SECURITY): one statement each.
        purged := 0;
        FOR ws IN SELECT DISTINCT e.workspace_id FROM public.outbox_events e WHERE e.id = ANY (jobs) LOOP
            PERFORM pg_catalog.set_config('app.workspace_id', ws::text, true);
            WITH discarded AS (
                UPDATE public.outbox_events e
                SET status = 'discarded', finished_at = pg_catalog.clock_timestamp(), event_payload = '{}',
                    progress = NULL, result = NULL, last_error = NULL, locked_by = NULL, locked_until = NULL
                WHERE e.id = ANY (jobs) AND e.workspace_id = ws AND e.status = 'dead_letter'
                RETURNING e.id),
            forgotten AS (DELETE FROM public.job_failures f WHERE f.job_id IN (SELECT d.id FROM discarded d))
            SELECT purged + count(*) INTO purged FROM discarded;
        END LOOP;
        PERFORM pg_catalog.set_config('app.workspace_id', coalesce(caller, ''), true);
        IF purged > 0 THEN
            INSERT INTO public.conveyor_admin_audit (actor, role, action, arguments)
            VALUES ('maintenance', session_user, 'dead_letter_purge',
                    pg_catalog.jsonb_build_object('older_than', older_than::text, 'kept', kept::text,
                                                  'discarded', purged));
        END IF;
        RETURN purged;
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_dead_letter_purge(interval, integer) FROM PUBLIC;
