-- The relay's mark, fenced by the claimed re-drive generation as well as by the lease and the row version.
--
-- A job can fail before its hand-off is recorded: its retry moves the event to a new generation and clears the lease
-- (see the worker's retry). Should the same dispatcher claim that new generation while its old mark is still waiting,
-- the old mark must not land on the new claim. The row version (ctid) already makes that all but impossible, since the
-- retry and the claim each wrote a new version, but a freed line pointer can be reused; the generation makes it
-- certain. The five-argument function of 0004 stays for dispatchers of the previous release during a rolling upgrade.
SET LOCAL search_path = conveyor;

CREATE FUNCTION conveyor_mark_outbox_dispatched(holder text, workspaces uuid[], tids tid[], ids uuid[],
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
        FOR ws IN SELECT DISTINCT w FROM unnest(workspaces) AS w LOOP
            PERFORM set_config('app.workspace_id', ws::text, true);
            UPDATE conveyor.outbox_events e
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
