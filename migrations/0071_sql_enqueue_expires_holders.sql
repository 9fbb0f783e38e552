-- The SQL enqueue expires a de-dup key's holder that waits in the outbox past its deadline and takes the key, as
-- enqueue_tx does, instead of answering with a job that will never run (the enqueue was lost). The operation it is
-- given is checked before each try: expiring the holder cancels the holder's operation, which may be that one. Same
-- signature: the function keeps its grants.
SET LOCAL search_path = conveyor;

CREATE OR REPLACE FUNCTION conveyor_enqueue(kind text, payload jsonb, run_at timestamptz DEFAULT NULL,
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
        holder_operation uuid;
        holder_expired boolean;
        canceled uuid[];
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
        FOR attempt IN 1..3 LOOP
            -- Checked again after an expired holder was canceled: with it, its operation, which may be this one.
            IF conveyor_enqueue.operation_id IS NOT NULL AND NOT EXISTS (
                SELECT 1 FROM conveyor.operations o
                WHERE o.id = conveyor_enqueue.operation_id AND o.status IN ('queued', 'running')) THEN
                RAISE EXCEPTION 'conveyor_enqueue: operation % is not a live operation of this workspace',
                    conveyor_enqueue.operation_id USING ERRCODE = '22023';
            END IF;
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
            SELECT e.id, e.operation_id, coalesce(e.status = 'pending' AND e.expires_at <= now(), false)
            INTO got, holder_operation, holder_expired
            FROM conveyor.outbox_events e
            WHERE e.workspace_id = ws AND e.event_type = conveyor_enqueue.kind
              AND e.dedup_key = conveyor_enqueue.dedup_key
              AND e.status IN ('pending', 'dispatching', 'dispatched');
            IF got IS NOT NULL AND NOT holder_expired THEN
                RETURN got;
            END IF;
            IF got IS NOT NULL THEN
                -- The holder waits in the outbox past its deadline: it would never run, and answering with it
                -- would lose this enqueue. Expired here, as enqueue_tx expires it: the operation locked before
                -- the job (every writer of both takes them in that order), the job canceled as expired, its
                -- operation canceled with every other live job of it, the workers and waiters told at commit.
                IF holder_operation IS NOT NULL THEN
                    PERFORM 1 FROM conveyor.operations o WHERE o.id = holder_operation FOR UPDATE;
                END IF;
                UPDATE conveyor.outbox_events e
                SET status = 'canceled', last_error = 'expired: not started by its deadline',
                    finished_at = clock_timestamp(), locked_by = NULL, locked_until = NULL
                -- A job with children takes no deadline, so none has descendants to lock before its operation.
                WHERE e.id = got AND e.status = 'pending' AND e.expires_at <= now() AND e.children_left = 0;
                IF FOUND THEN
                    canceled := ARRAY[got];
                    IF holder_operation IS NOT NULL THEN
                        UPDATE conveyor.operations o
                        SET status = 'canceled', error = 'expired: not started by its deadline',
                            finished_at = clock_timestamp(), updated_at = now()
                        WHERE o.id = holder_operation AND o.status IN ('queued', 'running');
                        IF FOUND THEN
                            WITH others AS (
                                UPDATE conveyor.outbox_events e
                                SET status = 'canceled', finished_at = clock_timestamp(), locked_by = NULL,
                                    locked_until = NULL
                                WHERE e.operation_id = holder_operation
                                  AND e.status IN ('pending', 'dispatching', 'dispatched')
                                RETURNING e.id)
                            SELECT canceled || coalesce(array_agg(others.id), '{}') INTO canceled FROM others;
                        END IF;
                    END IF;
                    PERFORM pg_notify('conveyor_jobs_canceled', c::text) FROM unnest(canceled) AS c;
                    PERFORM pg_notify('conveyor_jobs_done', ws::text);
                END IF;
            END IF;
            -- The holder ended (or expired) between the insert and the look-up: the key is free again.
        END LOOP;
        RAISE EXCEPTION 'conveyor_enqueue: the de-dup key % keeps changing hands; try again', conveyor_enqueue.dedup_key
            USING ERRCODE = '40001';
    END
    $$;
