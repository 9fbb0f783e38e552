-- Retention per job and kind (BullMQ's removeOnComplete / removeOnFail): how long a job is kept once it succeeded or
-- failed (dead-lettered), by age, by count (the newest N of its kind in its workspace that keep a count), or both.
-- NULL keeps the global retention (CONVEYOR_OUTBOX_RETENTION; dead letters CONVEYOR_DEAD_LETTER_RETENTION), which
-- also caps an age of a job's own: the global purges take every ended job past it, as before. Written
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
-- then a delivery still in a stream is skipped), at most max_rows of each by age and of each by count; how many. Past
-- it means older than its age, or beyond the newest N succeeded (failed) jobs of its kind and workspace that keep the
-- same count N. The distinct ages, and (workspace, kind, N), are found by skipping through the indexes (one probe
-- each), and a count reads the newest N entries of its index range (index only), never the jobs past them. A failed
-- job is matched on its generation too: one replayed meanwhile (and perhaps failed again) is left as it is. Discards
-- are on the audit trail, as the dead-letter purge's are; they follow the job's own setting, below the dead letters'
-- retention floor if it says so (the application chose it when it enqueued the job).
CREATE FUNCTION conveyor_kept_jobs_purge(max_rows integer)
    RETURNS bigint
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, conveyor, pg_temp
    AS $$
    DECLARE
        most integer := GREATEST(1, LEAST(max_rows, 10000));
        succeeded uuid[];
        failed uuid[];
        generations integer[];
        purged bigint := 0;
        discarded bigint := 0;
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
            (WITH RECURSIVE counts(ws, kind, keep) AS (
                 (SELECT e.workspace_id, e.event_type, e.keep_succeeded_n FROM conveyor.outbox_events e
                  WHERE e.status = 'completed' AND e.keep_succeeded_n IS NOT NULL
                  ORDER BY e.workspace_id, e.event_type, e.keep_succeeded_n LIMIT 1)
                 UNION ALL
                 SELECT nxt.workspace_id, nxt.event_type, nxt.keep_succeeded_n FROM counts c CROSS JOIN LATERAL (
                     SELECT e.workspace_id, e.event_type, e.keep_succeeded_n FROM conveyor.outbox_events e
                     WHERE e.status = 'completed' AND e.keep_succeeded_n IS NOT NULL
                       AND (e.workspace_id, e.event_type, e.keep_succeeded_n) > (c.ws, c.kind, c.keep)
                     ORDER BY e.workspace_id, e.event_type, e.keep_succeeded_n LIMIT 1) nxt)
             SELECT x.id FROM counts c CROSS JOIN LATERAL (
                 SELECT e.id FROM conveyor.outbox_events e
                 WHERE e.status = 'completed' AND e.workspace_id = c.ws AND e.event_type = c.kind
                   AND e.keep_succeeded_n = c.keep
                 ORDER BY e.finished_at DESC, e.id DESC OFFSET c.keep LIMIT most) x
             LIMIT most));
        SELECT coalesce(pg_catalog.array_agg(f.id), '{}'), coalesce(pg_catalog.array_agg(f.gen), '{}')
        INTO failed, generations
        FROM (
            (WITH RECURSIVE ages(v) AS (
                 (SELECT e.keep_failed_s FROM conveyor.outbox_events e
                  WHERE e.status = 'dead_letter' AND e.keep_failed_s IS NOT NULL
                  ORDER BY e.keep_failed_s LIMIT 1)
                 UNION ALL
                 SELECT (SELECT e.keep_failed_s FROM conveyor.outbox_events e
                         WHERE e.status = 'dead_letter' AND e.keep_failed_s > a.v
                         ORDER BY e.keep_failed_s LIMIT 1)
                 FROM ages a WHERE a.v IS NOT NULL)
             SELECT x.id, x.redrive_count AS gen FROM ages a CROSS JOIN LATERAL (
                 SELECT e.id, e.redrive_count FROM conveyor.outbox_events e
                 WHERE e.status = 'dead_letter' AND e.keep_failed_s = a.v
                   AND e.dead_lettered_at <= pg_catalog.now() - pg_catalog.make_interval(secs => a.v)
                 LIMIT most) x
             WHERE a.v IS NOT NULL LIMIT most)
            UNION
            (WITH RECURSIVE counts(ws, kind, keep) AS (
                 (SELECT e.workspace_id, e.event_type, e.keep_failed_n FROM conveyor.outbox_events e
                  WHERE e.status = 'dead_letter' AND e.keep_failed_n IS NOT NULL
                  ORDER BY e.workspace_id, e.event_type, e.keep_failed_n LIMIT 1)
                 UNION ALL
                 SELECT nxt.workspace_id, nxt.event_type, nxt.keep_failed_n FROM counts c CROSS JOIN LATERAL (
                     SELECT e.workspace_id, e.event_type, e.keep_failed_n FROM conveyor.outbox_events e
                     WHERE e.status = 'dead_letter' AND e.keep_failed_n IS NOT NULL
                       AND (e.workspace_id, e.event_type, e.keep_failed_n) > (c.ws, c.kind, c.keep)
                     ORDER BY e.workspace_id, e.event_type, e.keep_failed_n LIMIT 1) nxt)
             SELECT x.id, x.redrive_count AS gen FROM counts c CROSS JOIN LATERAL (
                 SELECT e.id, e.redrive_count FROM conveyor.outbox_events e
                 WHERE e.status = 'dead_letter' AND e.workspace_id = c.ws AND e.event_type = c.kind
                   AND e.keep_failed_n = c.keep
                 ORDER BY e.dead_lettered_at DESC, e.id DESC OFFSET c.keep LIMIT most) x
             LIMIT most)) f;
        -- Writes are walled off by workspace even for the owner (FORCE ROW LEVEL SECURITY): one statement each. Each
        -- statement checks the state again: a job cleaned, or a dead letter replayed, meanwhile is left as it is.
        FOR ws IN SELECT DISTINCT e.workspace_id FROM conveyor.outbox_events e
                  WHERE e.id = ANY (succeeded) OR e.id = ANY (failed) LOOP
            PERFORM pg_catalog.set_config('app.workspace_id', ws::text, true);
            DELETE FROM conveyor.outbox_events e
            WHERE e.id = ANY (succeeded) AND e.workspace_id = ws AND e.status = 'completed';
            GET DIAGNOSTICS n = ROW_COUNT;
            purged := purged + n;
            WITH gone AS (
                UPDATE conveyor.outbox_events e
                SET status = 'discarded', finished_at = pg_catalog.clock_timestamp(), event_payload = '{}',
                    progress = NULL, result = NULL, last_error = NULL, locked_by = NULL, locked_until = NULL
                FROM unnest(failed, generations) AS v(id, gen)
                WHERE e.id = v.id AND e.redrive_count = v.gen AND e.workspace_id = ws AND e.status = 'dead_letter'
                RETURNING e.id),
            forgotten AS (DELETE FROM conveyor.job_failures f WHERE f.job_id IN (SELECT g.id FROM gone g)),
            unlogged AS (DELETE FROM conveyor.job_logs l WHERE l.job_id IN (SELECT g.id FROM gone g))
            SELECT discarded + count(*) INTO discarded FROM gone;
        END LOOP;
        PERFORM pg_catalog.set_config('app.workspace_id', coalesce(caller, ''), true);
        IF discarded > 0 THEN
            INSERT INTO conveyor.conveyor_admin_audit (actor, role, action, arguments)
            VALUES ('maintenance', session_user, 'kept_jobs_purge',
                    pg_catalog.jsonb_build_object('discarded', discarded, 'deleted', purged));
        END IF;
        RETURN purged + discarded;
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_kept_jobs_purge(integer) FROM PUBLIC;
