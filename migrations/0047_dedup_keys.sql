-- De-duplication modes beyond "at most one live job per key" (outbox_events.dedup_key and its unique index of live
-- jobs): a throttle, whose key blocks new jobs for a period from the enqueue that took it, even after its job ended;
-- and a debounce, whose key points at the waiting job that a new enqueue updates (payload, due time) instead of
-- writing another. One row per key and kind in a workspace: the row is what concurrent enqueues of one key serialize
-- on (INSERT .. ON CONFLICT DO UPDATE locks it until the enqueue's transaction ends), so the database decides, whatever
-- the number of writers.
--
-- A throttled job also carries its key in outbox_events.dedup_key, so that the live index keeps holding it for as
-- long as the job lives, if that is longer than the period. A debounced job does not: a job already handed to a
-- worker is left alone, and the next enqueue writes a new waiting job beside it, which the key then points at. The
-- key's mode is part of it: a throttle and a debounce of one name never meet.
SET LOCAL search_path = conveyor;

CREATE TABLE dedup_keys (
    workspace_id uuid        NOT NULL,
    event_type   text        NOT NULL,
    -- A throttle's key and a debounce's of the same name are two keys: neither mode reads the other's row.
    mode         text        NOT NULL CHECK (mode IN ('throttle', 'debounce')),
    dedup_key    text        NOT NULL CHECK (char_length(dedup_key) BETWEEN 1 AND 256),
    job_id       uuid        NOT NULL,
    -- A throttle's end; NULL for a debounce, which holds while its job lives.
    held_until   timestamptz CHECK ((mode = 'throttle') = (held_until IS NOT NULL)),
    PRIMARY KEY (workspace_id, event_type, mode, dedup_key)
);

ALTER TABLE dedup_keys ENABLE ROW LEVEL SECURITY;
ALTER TABLE dedup_keys FORCE ROW LEVEL SECURITY;
CREATE POLICY workspace_isolation ON dedup_keys
    USING (workspace_id = conveyor_current_workspace())
    WITH CHECK (workspace_id = conveyor_current_workspace());
DO $$
BEGIN
    EXECUTE format('CREATE POLICY owner_scan ON dedup_keys FOR SELECT TO %I USING (true)', current_user);
END
$$;

-- Maintenance: forgets keys that hold nothing any more (a throttle whose period is over, a debounce whose job no
-- longer lives: one handed to a worker may come back to wait, for a retry, and fold the next enqueues then), at most
-- max_rows, in every workspace; how many. Each workspace's keys are locked first (skipping those
-- an enqueue holds) and judged again by a statement of their own, whose snapshot sees what committed meanwhile: a
-- debounce that just pointed its key at a new waiting job keeps it. A key forgotten while an enqueue of it waits for
-- its lock is written again by that enqueue (its conflict is gone, so it inserts).
CREATE FUNCTION conveyor_dedup_keys_purge(max_rows integer)
    RETURNS bigint
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, conveyor, pg_temp
    AS $$
    DECLARE
        purged bigint := 0;
        n bigint;
        ws uuid;
        tids tid[];
        caller text := pg_catalog.current_setting('app.workspace_id', true);
    BEGIN
        -- Writes are walled off by workspace even for the owner (FORCE ROW LEVEL SECURITY): one statement each.
        FOR ws IN
            SELECT DISTINCT k.workspace_id FROM (
                SELECT k.workspace_id FROM conveyor.dedup_keys k
                WHERE (k.held_until IS NOT NULL AND k.held_until <= pg_catalog.now())
                   OR (k.held_until IS NULL AND NOT EXISTS (
                           SELECT 1 FROM conveyor.outbox_events e
                           WHERE e.id = k.job_id AND e.workspace_id = k.workspace_id
                             AND e.status IN ('pending', 'dispatching', 'dispatched')))
                LIMIT GREATEST(1, LEAST(max_rows, 10000))) k
        LOOP
            EXIT WHEN purged >= max_rows;
            PERFORM pg_catalog.set_config('app.workspace_id', ws::text, true);
            tids := ARRAY(
                SELECT k.ctid FROM conveyor.dedup_keys k
                WHERE k.workspace_id = ws
                  AND ((k.held_until IS NOT NULL AND k.held_until <= pg_catalog.now())
                       OR (k.held_until IS NULL AND NOT EXISTS (
                               SELECT 1 FROM conveyor.outbox_events e
                           WHERE e.id = k.job_id AND e.workspace_id = k.workspace_id
                             AND e.status IN ('pending', 'dispatching', 'dispatched'))))
                LIMIT GREATEST(1, max_rows - purged)
                FOR UPDATE OF k SKIP LOCKED);
            DELETE FROM conveyor.dedup_keys k
            WHERE k.ctid = ANY (tids)
              AND ((k.held_until IS NOT NULL AND k.held_until <= pg_catalog.now())
                   OR (k.held_until IS NULL AND NOT EXISTS (
                           SELECT 1 FROM conveyor.outbox_events e
                           WHERE e.id = k.job_id AND e.workspace_id = k.workspace_id
                             AND e.status IN ('pending', 'dispatching', 'dispatched'))));
            GET DIAGNOSTICS n = ROW_COUNT;
            purged := purged + n;
        END LOOP;
        PERFORM pg_catalog.set_config('app.workspace_id', coalesce(caller, ''), true);
        RETURN purged;
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_dedup_keys_purge(integer) FROM PUBLIC;
