-- Expiries in the queues' minutes: maintenance counts, per queue and minute, the jobs canceled as expired (through
-- 0072's index), beside those done and failed; the operator reads them with two functions of a new name.
SET LOCAL search_path = conveyor;

ALTER TABLE queue_minutes ADD COLUMN expired bigint NOT NULL DEFAULT 0;

-- The recorder of 0061, counting expiries too (same signature: it keeps its grants).
CREATE OR REPLACE FUNCTION conveyor_record_queue_minutes() RETURNS integer
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, conveyor, pg_temp
    AS $$
    DECLARE
        this_minute timestamptz := pg_catalog.date_trunc('minute', pg_catalog.now());
        since timestamptz;
        ended integer;
        sampled integer;
    BEGIN
        IF NOT pg_catalog.pg_try_advisory_xact_lock(pg_catalog.hashtextextended('conveyor-queue-minutes', 0)) THEN
            RETURN 0;
        END IF;
        -- Every pass samples the backlog of every queue a worker registered at its minute: the latest such minute is
        -- the previous pass's.
        SELECT least(this_minute - interval '1 minute', greatest(max(m.minute), this_minute - interval '1 hour'))
        INTO since
        FROM conveyor.queue_minutes m WHERE m.minute < this_minute AND m.backlog IS NOT NULL;
        since := coalesce(since, this_minute - interval '1 minute');
        WITH ends AS (
            SELECT e.queue, e.status,
                   CASE e.status WHEN 'completed' THEN e.finished_at ELSE e.dead_lettered_at END AS ended_at,
                   greatest(e.dispatched_at - e.next_attempt_at, interval '0') AS waited
            FROM conveyor.outbox_events e
            WHERE e.status = 'completed' AND e.finished_at >= since
            UNION ALL
            SELECT e.queue, e.status, e.dead_lettered_at,
                   greatest(e.dispatched_at - e.next_attempt_at, interval '0')
            FROM conveyor.outbox_events e
            WHERE e.status = 'dead_letter' AND e.dead_lettered_at >= since
            UNION ALL
            -- Canceled as expired (transitions::EXPIRED, EXPIRED_ON_TAKE_OVER): no wait, they were never run.
            SELECT e.queue, 'expired', e.finished_at, NULL::interval
            FROM conveyor.outbox_events e
            WHERE e.status = 'canceled' AND e.expires_at IS NOT NULL AND e.finished_at >= since
              AND e.last_error IN ('expired: not started by its deadline',
                                   'expired: its worker stopped, and its deadline passed before another took it'))
        INSERT INTO conveyor.queue_minutes AS m (queue, minute, done, failed, expired, wait_p95_ms)
        SELECT x.queue, pg_catalog.date_trunc('minute', x.ended_at),
               pg_catalog.count(*) FILTER (WHERE x.status = 'completed'),
               pg_catalog.count(*) FILTER (WHERE x.status = 'dead_letter'),
               pg_catalog.count(*) FILTER (WHERE x.status = 'expired'),
               pg_catalog.percentile_cont(0.95) WITHIN GROUP (
                   ORDER BY pg_catalog.date_part('epoch', x.waited) * 1000)
        FROM ends x
        GROUP BY 1, 2
        ON CONFLICT (queue, minute) DO UPDATE
            SET done = greatest(m.done, excluded.done),
                failed = greatest(m.failed, excluded.failed),
                expired = greatest(m.expired, excluded.expired),
                -- A minute counted again with only expiries left (its ends removed since) keeps its wait.
                wait_p95_ms = coalesce(excluded.wait_p95_ms, m.wait_p95_ms);
        GET DIAGNOSTICS ended = ROW_COUNT;
        -- Every queue a worker registered, or that has due jobs: a look that found none records 0.
        WITH due AS (
            SELECT e.queue, pg_catalog.count(*) AS n
            FROM conveyor.outbox_events e
            WHERE e.status = 'pending' AND e.next_attempt_at <= pg_catalog.now()
            GROUP BY e.queue),
        queues AS (SELECT k.queue FROM conveyor.job_kinds k UNION SELECT d.queue FROM due d)
        INSERT INTO conveyor.queue_minutes AS m (queue, minute, backlog)
        SELECT q.queue, this_minute, coalesce(d.n, 0)
        FROM queues q LEFT JOIN due d ON d.queue = q.queue
        ON CONFLICT (queue, minute) DO UPDATE
            SET backlog = greatest(coalesce(m.backlog, 0), excluded.backlog);
        GET DIAGNOSTICS sampled = ROW_COUNT;
        DELETE FROM conveyor.queue_minutes WHERE minute < this_minute - interval '2 hours';
        RETURN ended + sampled;
    END
    $$;

-- The last hour of one queue with its expiries: conveyor_admin_queue_minutes (0061) and a column more. A new name, so
-- that an API of the previous release keeps its function.
CREATE FUNCTION conveyor_admin_queue_minutes_v2(actor text, of_queue text)
    RETURNS TABLE (minute timestamptz, done bigint, failed bigint, expired bigint, backlog bigint,
                   wait_p95_ms double precision)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, conveyor, pg_temp
    AS $$
    #variable_conflict use_column
    BEGIN
        PERFORM conveyor.conveyor_admin_audit_write(actor, 'queue_minutes',
                                                    pg_catalog.jsonb_build_object('queue', of_queue));
        RETURN QUERY
            SELECT s.minute, coalesce(m.done, 0), coalesce(m.failed, 0), coalesce(m.expired, 0), m.backlog,
                   m.wait_p95_ms
            FROM pg_catalog.generate_series(pg_catalog.date_trunc('minute', pg_catalog.now()) - interval '59 minutes',
                                            pg_catalog.date_trunc('minute', pg_catalog.now()), interval '1 minute')
                 AS s(minute)
            LEFT JOIN conveyor.queue_minutes m ON m.queue = of_queue AND m.minute = s.minute
            ORDER BY s.minute;
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_admin_queue_minutes_v2(text, text) FROM PUBLIC;

-- Every queue's last hour with its expiries: conveyor_admin_queues_minutes (0067) and a column more.
CREATE FUNCTION conveyor_admin_queues_minutes_v2(actor text)
    RETURNS TABLE (queue text, minute timestamptz, done bigint, failed bigint, expired bigint, backlog bigint,
                   wait_p95_ms double precision)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, conveyor, pg_temp
    AS $$
    #variable_conflict use_column
    DECLARE
        first_minute timestamptz := pg_catalog.date_trunc('minute', pg_catalog.now()) - interval '59 minutes';
    BEGIN
        PERFORM conveyor.conveyor_admin_audit_write(actor, 'queues_minutes', '{}'::jsonb);
        RETURN QUERY
            SELECT q.queue, s.minute, coalesce(m.done, 0), coalesce(m.failed, 0), coalesce(m.expired, 0), m.backlog,
                   m.wait_p95_ms
            FROM (SELECT DISTINCT r.queue FROM conveyor.queue_minutes r WHERE r.minute >= first_minute) q
            CROSS JOIN pg_catalog.generate_series(first_minute, first_minute + interval '59 minutes',
                                                  interval '1 minute') AS s(minute)
            LEFT JOIN conveyor.queue_minutes m ON m.queue = q.queue AND m.minute = s.minute
            ORDER BY q.queue, s.minute;
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_admin_queues_minutes_v2(text) FROM PUBLIC;

-- An API of this release may run before `conveyor migrate` has granted them: they go to every role that may read one
-- queue's minutes.
DO $$
DECLARE
    grantee text;
BEGIN
    FOR grantee IN
        SELECT DISTINCT r.rolname
        FROM pg_catalog.pg_proc p
        CROSS JOIN LATERAL pg_catalog.aclexplode(p.proacl) AS a
        JOIN pg_catalog.pg_roles r ON r.oid = a.grantee
        WHERE p.oid = 'conveyor.conveyor_admin_queue_minutes(text, text)'::pg_catalog.regprocedure
          AND a.privilege_type = 'EXECUTE' AND r.rolname <> current_user
    LOOP
        EXECUTE pg_catalog.format(
            'GRANT EXECUTE ON FUNCTION conveyor.conveyor_admin_queue_minutes_v2(text, text) TO %I', grantee);
        EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION conveyor.conveyor_admin_queues_minutes_v2(text) TO %I',
                                  grantee);
    END LOOP;
END
$$;
