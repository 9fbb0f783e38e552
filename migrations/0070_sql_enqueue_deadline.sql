-- The SQL enqueue (0039's) takes a deadline, as EnqueueOptions::start_within does: `start_within => interval '5
-- minutes'` and the job is never started later than that after it falls due (its `run_at`, or now; a `run_at` in the
-- past counts from now), or it is canceled as expired. 1 ms to ten years.
--
-- A parameter more is a new signature: beside the old one, every call that names fewer arguments would be ambiguous,
-- so the old one goes, and the new one gets the old one's grants (the application role's, in the multi-tenant mode).
SET LOCAL search_path = conveyor;

DO $$
BEGIN
    PERFORM pg_catalog.set_config('conveyor.enqueue_grantees', coalesce((
        SELECT pg_catalog.string_agg(DISTINCT r.rolname, ',')
        FROM pg_catalog.pg_proc p
        CROSS JOIN LATERAL pg_catalog.aclexplode(p.proacl) AS a
        JOIN pg_catalog.pg_roles r ON r.oid = a.grantee
        WHERE p.oid = 'conveyor.conveyor_enqueue(text, jsonb, timestamptz, text, text, integer, uuid)'
                      ::pg_catalog.regprocedure
          AND a.privilege_type = 'EXECUTE' AND r.rolname <> current_user), ''), true);
END
$$;

DROP FUNCTION conveyor_enqueue(text, jsonb, timestamptz, text, text, integer, uuid);

CREATE FUNCTION conveyor_enqueue(kind text, payload jsonb, run_at timestamptz DEFAULT NULL,
                                 dedup_key text DEFAULT NULL, priority text DEFAULT 'normal',
                                 max_attempts integer DEFAULT NULL, operation_id uuid DEFAULT NULL,
                                 start_within interval DEFAULT NULL)
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
        deadline timestamptz;
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
        IF conveyor_enqueue.start_within < interval '1 millisecond'
           OR conveyor_enqueue.start_within > interval '3650 days' THEN
            RAISE EXCEPTION 'conveyor_enqueue: start_within must be at least 1 ms and at most ten years'
                USING ERRCODE = '22023';
        END IF;
        deadline := greatest(due, now()) + conveyor_enqueue.start_within;
        IF conveyor_enqueue.operation_id IS NOT NULL AND NOT EXISTS (
            SELECT 1 FROM conveyor.operations o
            WHERE o.id = conveyor_enqueue.operation_id AND o.status IN ('queued', 'running')) THEN
            RAISE EXCEPTION 'conveyor_enqueue: operation % is not a live operation of this workspace',
                conveyor_enqueue.operation_id USING ERRCODE = '22023';
        END IF;
        FOR attempt IN 1..3 LOOP
            INSERT INTO conveyor.outbox_events AS e (id, workspace_id, queue, event_type, event_payload, operation_id,
                                                   next_attempt_at, dedup_key, priority, max_attempts, expires_at)
            VALUES (new_id, ws, q, conveyor_enqueue.kind, conveyor_enqueue.payload, conveyor_enqueue.operation_id,
                    due, conveyor_enqueue.dedup_key, p, conveyor_enqueue.max_attempts, deadline)
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
REVOKE ALL ON FUNCTION conveyor_enqueue(text, jsonb, timestamptz, text, text, integer, uuid, interval) FROM PUBLIC;

DO $$
DECLARE
    grantee text;
BEGIN
    FOREACH grantee IN ARRAY pg_catalog.string_to_array(pg_catalog.current_setting('conveyor.enqueue_grantees'), ',')
    LOOP
        EXECUTE pg_catalog.format(
            'GRANT EXECUTE ON FUNCTION conveyor.conveyor_enqueue(text, jsonb, timestamptz, text, text, integer, uuid, '
            'interval) TO %I', grantee);
    END LOOP;
END
$$;
