-- A queue's last hour, minute by minute, for the operator's charts: jobs done and failed, the due backlog, and how long
-- the jobs that ended had waited for their hand-off (95th percentile). Written by maintenance at each pass
-- (conveyor_record_queue_minutes, the runtime role's), read by the operator (conveyor_admin_queue_minutes, audited).
--
-- No workspace's rows: sums over all of them, as the operator's queue counts are. Nobody but the two definer functions
-- touches the table: no role has a grant on it (as the operators' audit trail).
SET LOCAL search_path = conveyor;

CREATE TABLE queue_minutes (
    queue       text        NOT NULL,
    minute      timestamptz NOT NULL,
    done        bigint      NOT NULL DEFAULT 0,
    failed      bigint      NOT NULL DEFAULT 0,
    -- Due jobs waiting for the relay (pauses holding some included), the most any look of the minute saw.
    backlog     bigint,
    -- Of the jobs that ended in the minute: from when each was due to its (last) hand-off, 95th percentile.
    wait_p95_ms double precision,
    PRIMARY KEY (queue, minute)
);
REVOKE ALL ON queue_minutes FROM PUBLIC;

-- Counts again the ends since the minute of the previous pass (at least the minute before this one, at most the last
-- hour), samples the due backlog, and forgets minutes older than two hours. Maintenance calls it before any retention
-- of a job's own, in every pass; counts only grow, so a job removed since its minute was counted stays counted (one
-- removed by such a retention within the minute it ended, before a later pass of that minute, is missing from it).
-- One process at a time: a pass that finds another at it skips (its counts come with the other's). Returns the rows
-- written.
CREATE FUNCTION conveyor_record_queue_minutes() RETURNS integer
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
            WHERE e.status = 'dead_letter' AND e.dead_lettered_at >= since)
        INSERT INTO conveyor.queue_minutes AS m (queue, minute, done, failed, wait_p95_ms)
        SELECT x.queue, pg_catalog.date_trunc('minute', x.ended_at),
               pg_catalog.count(*) FILTER (WHERE x.status = 'completed'),
               pg_catalog.count(*) FILTER (WHERE x.status = 'dead_letter'),
               pg_catalog.percentile_cont(0.95) WITHIN GROUP (
                   ORDER BY pg_catalog.date_part('epoch', x.waited) * 1000)
        FROM ends x
        GROUP BY 1, 2
        ON CONFLICT (queue, minute) DO UPDATE
            SET done = greatest(m.done, excluded.done),
                failed = greatest(m.failed, excluded.failed),
                wait_p95_ms = excluded.wait_p95_ms;
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
REVOKE ALL ON FUNCTION conveyor_record_queue_minutes() FROM PUBLIC;

-- The last hour of one queue, oldest minute first: every minute of it, zero where nothing was recorded.
CREATE FUNCTION conveyor_admin_queue_minutes(actor text, of_queue text)
    RETURNS TABLE (minute timestamptz, done bigint, failed bigint, backlog bigint, wait_p95_ms double precision)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, conveyor, pg_temp
    AS $$
    #variable_conflict use_column
    BEGIN
        PERFORM conveyor.conveyor_admin_audit_write(actor, 'queue_minutes',
                                                    pg_catalog.jsonb_build_object('queue', of_queue));
        RETURN QUERY
            SELECT s.minute, coalesce(m.done, 0), coalesce(m.failed, 0), m.backlog, m.wait_p95_ms
            FROM pg_catalog.generate_series(pg_catalog.date_trunc('minute', pg_catalog.now()) - interval '59 minutes',
                                            pg_catalog.date_trunc('minute', pg_catalog.now()), interval '1 minute')
                 AS s(minute)
            LEFT JOIN conveyor.queue_minutes m ON m.queue = of_queue AND m.minute = s.minute
            ORDER BY s.minute;
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_admin_queue_minutes(text, text) FROM PUBLIC;
