-- Retention per job and kind (BullMQ's removeOnComplete / removeOnFail): how long a job is kept once it succeeded or
-- failed (dead-lettered), by age, by count (the newest N of its kind in its workspace that keep a count), or both.
-- NULL keeps the global retention (CONVEYOR_OUTBOX_RETENTION; dead letters CONVEYOR_DEAD_LETTER_RETENTION). Written
-- at enqueue from the job's options or its kind's defaults; read by maintenance alone (conveyor_kept_jobs_purge
-- below, over the four indexes of the next migrations). The checks are NOT VALID: the columns are new, so every row
-- before them is NULL, and new rows are checked.
SET LOCAL search_path = conveyor;

ALTER TABLE outbox_events
    ADD COLUMN keep_succeeded_s integer,
    ADD COLUMN keep_succeeded_n integer,
    ADD COLUMN keep_failed_s integer,
    ADD COLUMN keep_failed_n integer;
ALTER TABLE outbox_events ADD CONSTRAINT outbox_events_keep_check
    CHECK (keep_succeeded_s >= 0 AND keep_succeeded_n >= 0 AND keep_failed_s >= 0 AND keep_failed_n >= 0) NOT VALID;

-- Maintenance: of the jobs that keep a retention of their own, deletes the succeeded ones past it and discards the
-- failed ones past it (a tombstone, as an operator's discard leaves: the outbox retention deletes it later, and until
-- then a delivery still in a stream is skipped), at most max_rows of each; how many. Past it means older than its
-- age, or beyond the newest N succeeded (failed) jobs of its kind and workspace that keep a count, N being its own.
-- Distinct ages and kinds are found by skipping through the indexes (a few probes each), never by reading every kept
-- job; a count reads the kept jobs of one kind in one workspace, which its purges keep near N.
CREATE FUNCTION conveyor_kept_jobs_purge(max_rows integer)
    RETURNS bigint
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, conveyor, pg_temp
    AS $$
    DECLARE
        most integer := GREATEST(1, LEAST(max_rows, 10000));
        succeeded uuid[];
        failed uuid[];
        purged bigint := 0;
        n bigint;
        ws uuid;
        caller text := pg_catalog.current_setting('app.workspace_id', true);
    BEGIN
        succeeded := ARRAY(
            (WITH RECURSIVE ages(v) AS (
                 (SELECT e.keep_succeeded_s FROM conveyor.outbox_events e
                  WHERE e.status = 'completed' AND e.keep_succeeded_s IS NOT NULL
                  ORDER BY e.keep_succeeded_s LIMIT 1)
                 UNION ALL
                 SELECT (SELECT e.keep_succeeded_s FROM conveyor.outbox_events e
                         WHERE e.status = 'completed' AND e.keep_succeeded_s > a.v
                         ORDER BY e.keep_succeeded_s LIMIT 1)
                 FROM ages a WHERE a.v IS NOT NULL)
             SELECT x.id FROM ages a CROSS JOIN LATERAL (
                 SELECT e.id FROM conveyor.outbox_events e
                 WHERE e.status = 'completed' AND e.keep_succeeded_s = a.v
                   AND e.finished_at <= pg_catalog.now() - pg_catalog.make_interval(secs => a.v)
                 LIMIT most) x
             WHERE a.v IS NOT NULL LIMIT most)
            UNION
            (WITH RECURSIVE kinds(ws, kind) AS (
                 (SELECT e.workspace_id, e.event_type FROM conveyor.outbox_events e
                  WHERE e.status = 'completed' AND e.keep_succeeded_n IS NOT NULL
                  ORDER BY e.workspace_id, e.event_type LIMIT 1)
                 UNION ALL
                 SELECT nxt.workspace_id, nxt.event_type FROM kinds k CROSS JOIN LATERAL (
                     SELECT e.workspace_id, e.event_type FROM conveyor.outbox_events e
                     WHERE e.status = 'completed' AND e.keep_succeeded_n IS NOT NULL
                       AND (e.workspace_id, e.event_type) > (k.ws, k.kind)
                     ORDER BY e.workspace_id, e.event_type LIMIT 1) nxt)
             SELECT r.id FROM kinds k CROSS JOIN LATERAL (
                 SELECT ranked.id FROM (
                     SELECT e.id, e.keep_succeeded_n AS keep,
                            pg_catalog.row_number() OVER (ORDER BY e.finished_at DESC, e.id DESC) AS newest
                     FROM conveyor.outbox_events e
                     WHERE e.status = 'completed' AND e.keep_succeeded_n IS NOT NULL
                       AND e.workspace_id = k.ws AND e.event_type = k.kind) ranked
                 WHERE ranked.newest > ranked.keep) r
             LIMIT most));
        failed := ARRAY(
            (WITH RECURSIVE ages(v) AS (
                 (SELECT e.keep_failed_s FROM conveyor.outbox_events e
                  WHERE e.status = 'dead_letter' AND e.keep_failed_s IS NOT NULL
                  ORDER BY e.keep_failed_s LIMIT 1)
                 UNION ALL
                 SELECT (SELECT e.keep_failed_s FROM conveyor.outbox_events e
                         WHERE e.status = 'dead_letter' AND e.keep_failed_s > a.v
                         ORDER BY e.keep_failed_s LIMIT 1)
                 FROM ages a WHERE a.v IS NOT NULL)
             SELECT x.id FROM ages a CROSS JOIN LATERAL (
                 SELECT e.id FROM conveyor.outbox_events e
                 WHERE e.status = 'dead_letter' AND e.keep_failed_s = a.v
                   AND e.dead_lettered_at <= pg_catalog.now() - pg_catalog.make_interval(secs => a.v)
                 LIMIT most) x
             WHERE a.v IS NOT NULL LIMIT most)
            UNION
            (WITH RECURSIVE kinds(ws, kind) AS (
                 (SELECT e.workspace_id, e.event_type FROM conveyor.outbox_events e
                  WHERE e.status = 'dead_letter' AND e.keep_failed_n IS NOT NULL
                  ORDER BY e.workspace_id, e.event_type LIMIT 1)
                 UNION ALL
                 SELECT nxt.workspace_id, nxt.event_type FROM kinds k CROSS JOIN LATERAL (
                     SELECT e.workspace_id, e.event_type FROM conveyor.outbox_events e
                     WHERE e.status = 'dead_letter' AND e.keep_failed_n IS NOT NULL
                       AND (e.workspace_id, e.event_type) > (k.ws, k.kind)
                     ORDER BY e.workspace_id, e.event_type LIMIT 1) nxt)
             SELECT r.id FROM kinds k CROSS JOIN LATERAL (
                 SELECT ranked.id FROM (
                     SELECT e.id, e.keep_failed_n AS keep,
                            pg_catalog.row_number() OVER (ORDER BY e.dead_lettered_at DESC, e.id DESC) AS newest
                     FROM conveyor.outbox_events e
                     WHERE e.status = 'dead_letter' AND e.keep_failed_n IS NOT NULL
                       AND e.workspace_id = k.ws AND e.event_type = k.kind) ranked
                 WHERE ranked.newest > ranked.keep) r
             LIMIT most));
        -- Writes are walled off by workspace even for the owner (FORCE ROW LEVEL SECURITY): one statement each. Each
        -- statement checks the state again: a job that was replayed or cleaned meanwhile is left as it is.
        FOR ws IN SELECT DISTINCT e.workspace_id FROM conveyor.outbox_events e
                  WHERE e.id = ANY (succeeded) OR e.id = ANY (failed) LOOP
            PERFORM pg_catalog.set_config('app.workspace_id', ws::text, true);
            DELETE FROM conveyor.outbox_events e
            WHERE e.id = ANY (succeeded) AND e.workspace_id = ws AND e.status = 'completed';
            GET DIAGNOSTICS n = ROW_COUNT;
            purged := purged + n;
            WITH discarded AS (
                UPDATE conveyor.outbox_events e
                SET status = 'discarded', finished_at = pg_catalog.clock_timestamp(), event_payload = '{}',
                    progress = NULL, result = NULL, last_error = NULL, locked_by = NULL, locked_until = NULL
                WHERE e.id = ANY (failed) AND e.workspace_id = ws AND e.status = 'dead_letter'
                RETURNING e.id),
            forgotten AS (DELETE FROM conveyor.job_failures f WHERE f.job_id IN (SELECT d.id FROM discarded d)),
            unlogged AS (DELETE FROM conveyor.job_logs l WHERE l.job_id IN (SELECT d.id FROM discarded d))
            SELECT purged + count(*) INTO purged FROM discarded;
        END LOOP;
        PERFORM pg_catalog.set_config('app.workspace_id', coalesce(caller, ''), true);
        RETURN purged;
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_kept_jobs_purge(integer) FROM PUBLIC;
