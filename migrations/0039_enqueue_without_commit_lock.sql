-- Enqueues stop taxing their caller's COMMIT (issue 28). A transaction that issued NOTIFY takes, at commit, one lock
-- of the whole database (`Lock:object`, the queue of notifications) and holds it through its WAL flush: every
-- enqueueing commit waited for every other one's flush. Measured at 1,000 jobs/s with the relay and a worker running,
-- 93-96% of the caller's COMMIT time was that wait (p50 23 ms against 0.5 ms with nothing relaying).
--
-- A dispatcher that is relaying anyway says so here: it keeps `until` a moment ahead while it sees work, and for as
-- long as it does it looks for new jobs every tick (CONVEYOR_DISPATCH_TICK), notified or not. An enqueue notifies
-- only when no dispatcher is awake, which at idle costs nothing (no commit waits for another then), and under load
-- never happens. A dispatcher goes on looking for a grace after its mark lapsed, for the transactions that skipped
-- their notification and commit later; one committed later still, or after its dispatcher died, waits for the next
-- sweep (CONVEYOR_DISPATCH_POLL), never longer: sweeps never depended on notifications.
--
-- UNLOGGED: the mark is worth a few seconds, needs no WAL, and a crash empties it (every enqueue notifies then, which
-- is always safe). One row, whichever dispatcher wrote last; each only ever moves it later.
SET LOCAL search_path = conveyor;

CREATE UNLOGGED TABLE dispatchers_awake (
    id    boolean     PRIMARY KEY DEFAULT true CHECK (id),
    until timestamptz NOT NULL
);
REVOKE ALL ON dispatchers_awake FROM PUBLIC;

-- Tells the dispatchers that the caller's transaction wrote jobs (the payload as NOTIFY_CHANNEL documents it), unless
-- one of them is awake. Compared with the clock, not the transaction's start: a transaction open for long must not
-- read an old mark as a live one. Returns nothing (one row, in a FROM clause).
CREATE FUNCTION conveyor_wake_dispatchers(payload text) RETURNS void
    LANGUAGE plpgsql VOLATILE SECURITY INVOKER
    SET search_path = pg_catalog, conveyor, pg_temp
    AS $$
    BEGIN
        IF NOT EXISTS (SELECT 1 FROM conveyor.dispatchers_awake a WHERE a.until > pg_catalog.clock_timestamp()) THEN
            PERFORM pg_catalog.pg_notify('conveyor_outbox', payload);
        END IF;
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_wake_dispatchers(text) FROM PUBLIC;

-- A dispatcher's mark: awake for `for_how_long` from now, or longer if another said so.
CREATE FUNCTION conveyor_dispatcher_awake(for_how_long interval) RETURNS void
    LANGUAGE sql VOLATILE SECURITY INVOKER
    SET search_path = pg_catalog, conveyor, pg_temp
    AS $$
        INSERT INTO conveyor.dispatchers_awake AS a (id, until) VALUES (true, clock_timestamp() + for_how_long)
        ON CONFLICT (id) DO UPDATE SET until = greatest(a.until, excluded.until)
    $$;
REVOKE ALL ON FUNCTION conveyor_dispatcher_awake(interval) FROM PUBLIC;

-- The SQL enqueue (0008) rings the same way.
CREATE OR REPLACE FUNCTION conveyor_enqueue(kind text, payload jsonb, run_at timestamptz DEFAULT NULL,
                                            dedup_key text DEFAULT NULL, priority text DEFAULT 'normal',
                                            max_attempts integer DEFAULT NULL, operation_id uuid DEFAULT NULL)
    RETURNS uuid
    LANGUAGE plpgsql VOLATILE SECURITY INVOKER
    SET search_path = pg_catalog, conveyor, pg_temp
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
        SELECT k.queue INTO q FROM conveyor.job_kinds k WHERE k.kind = conveyor_enqueue.kind;
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
            SELECT 1 FROM conveyor.operations o
            WHERE o.id = conveyor_enqueue.operation_id AND o.status IN ('queued', 'running')) THEN
            RAISE EXCEPTION 'conveyor_enqueue: operation % is not a live operation of this workspace',
                conveyor_enqueue.operation_id USING ERRCODE = '22023';
        END IF;
        FOR attempt IN 1..3 LOOP
            INSERT INTO conveyor.outbox_events AS e (id, workspace_id, queue, event_type, event_payload, operation_id,
                                                   next_attempt_at, dedup_key, priority, max_attempts)
            VALUES (new_id, ws, q, conveyor_enqueue.kind, conveyor_enqueue.payload, conveyor_enqueue.operation_id,
                    due, conveyor_enqueue.dedup_key, p, conveyor_enqueue.max_attempts)
            ON CONFLICT (workspace_id, event_type, dedup_key)
                WHERE dedup_key IS NOT NULL AND status IN ('pending', 'dispatching', 'dispatched')
                DO NOTHING
            RETURNING e.id INTO got;
            IF got IS NOT NULL THEN
                PERFORM conveyor.conveyor_wake_dispatchers(ws::text
                    || CASE WHEN due > now() THEN '@' || floor(extract(epoch FROM due) * 1000)::bigint ELSE '' END);
                RETURN got;
            END IF;
            SELECT e.id INTO got FROM conveyor.outbox_events e
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
