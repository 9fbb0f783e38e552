-- Operating Conveyor across workspaces (issue 15): an audit trail of what operators read and change, every failed
-- run of a job, and the `conveyor_admin_*` functions through which the operator role reads across workspaces.
--
-- The wall stays up: the application role keeps seeing one workspace at a time, and gets no right on the audit
-- trail nor on any `conveyor_admin_*` function (`conveyor migrate` grants those to the operator role alone, from
-- CONVEYOR_OPERATOR_DATABASE_URL, and nothing else). Each function runs as the owner (`SECURITY DEFINER`, whose
-- `owner_scan` policies let it read across workspaces), returns operator metadata, and appends a row to the audit
-- trail naming the actor (a parameter: the operator token, a JWT's subject, the CLI's user) and the database role
-- (`session_user`). Changes (replay, discard, cancel, retry) run as the application role in the job's workspace,
-- under row-level security, and are recorded with `conveyor_admin_audit_write`: an intent row before the change (which
-- is refused if that row cannot be written), then an outcome row naming it.
SET LOCAL search_path = conveyor;

-- ---------------------------------------------------------------------------------------------------------------
-- The audit trail: append-only, the owner's alone.
CREATE TABLE conveyor_admin_audit (
    id        bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at        timestamptz NOT NULL DEFAULT clock_timestamp(),
    actor     text        NOT NULL CHECK (length(actor) BETWEEN 1 AND 200),
    role      text        NOT NULL DEFAULT session_user,
    action    text        NOT NULL CHECK (action ~ '^[a-z][a-z0-9_]{0,63}$'),
    arguments jsonb       NOT NULL DEFAULT '{}'
);
REVOKE ALL ON conveyor_admin_audit FROM PUBLIC;

-- ---------------------------------------------------------------------------------------------------------------
-- Every failed run of a job (`job`: its handler failed) and every failed hand-off (`dispatch`: the relay could not put
-- it in its stream), with the redacted error, written by the transition that records the failure, in its
-- transaction. Tenant data: walled off like the outbox; deleted with its job (retention, discard).
CREATE TABLE job_failures (
    id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_id       uuid        NOT NULL REFERENCES outbox_events (id) ON DELETE CASCADE,
    workspace_id uuid        NOT NULL,
    attempt      integer     NOT NULL CHECK (attempt >= 1),
    stage        text        NOT NULL CHECK (stage IN ('dispatch', 'job')),
    error        text        CHECK (length(error) <= 2000),   -- redacted
    failed_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX job_failures_job ON job_failures (job_id, id);

-- Dead letters recorded before this migration keep their last failure.
INSERT INTO job_failures (job_id, workspace_id, attempt, stage, error, failed_at)
SELECT e.id, e.workspace_id,
       greatest(1, CASE WHEN e.failure_stage = 'dispatch' THEN e.attempt_count ELSE e.job_attempts END),
       coalesce(e.failure_stage, 'job'), left(e.last_error, 2000), coalesce(e.dead_lettered_at, now())
FROM outbox_events e
WHERE e.status = 'dead_letter';

ALTER TABLE job_failures ENABLE ROW LEVEL SECURITY;
ALTER TABLE job_failures FORCE ROW LEVEL SECURITY;
CREATE POLICY workspace_isolation ON job_failures
    USING (workspace_id = conveyor_current_workspace())
    WITH CHECK (workspace_id = conveyor_current_workspace());
DO $$
BEGIN
    EXECUTE format('CREATE POLICY owner_scan ON job_failures FOR SELECT TO %I USING (true)', current_user);
END
$$;

-- ---------------------------------------------------------------------------------------------------------------
-- The operator's reads need two more indexes on outbox_events (recent completions, dead letters newest first). They
-- are built by 0027 and 0028 with CREATE INDEX CONCURRENTLY, one per migration (PostgreSQL refuses it in a
-- transaction, and sqlx sends a whole file as one statement string, which runs as one): a plain CREATE INDEX here
-- would hold off every write to the outbox, that is every enqueue of the release still running, while it scans the
-- table.

-- ---------------------------------------------------------------------------------------------------------------
-- A discarded dead letter leaves a tombstone (status `discarded`, ended at `finished_at`, its payload, errors and
-- recorded failures gone) instead of no row: a delivery of it still in a stream (a worker that died between the dead
-- letter's commit and its XACK, whose entry another worker claims later) must find the job ended, not missing. A
-- missing row reads as "purged by retention" (nothing left to protect), and that delivery would run and commit its
-- handler's writes. Tombstones are purged by retention like completed jobs; every read treats them as ended, and
-- the operator's and the library's reads do not show them (a discarded job is gone to its owner).
--
-- Both checks are widened without a scan of the table: the new one is added NOT VALID (every row holds it already,
-- since it held the narrower one; new and updated rows are checked) and the old one dropped, each a catalog change
-- under a brief lock.
ALTER TABLE outbox_events DROP CONSTRAINT outbox_events_status_check;
ALTER TABLE outbox_events ADD CONSTRAINT outbox_events_status_check
    CHECK (status IN ('pending', 'dispatching', 'dispatched', 'completed', 'canceled', 'dead_letter', 'discarded'))
    NOT VALID;
ALTER TABLE outbox_events DROP CONSTRAINT outbox_events_finished;
ALTER TABLE outbox_events ADD CONSTRAINT outbox_events_finished
    CHECK ((status IN ('completed', 'canceled', 'discarded')) = (finished_at IS NOT NULL)) NOT VALID;

-- The worker's skip check (0008's): a tombstone is ended like a completed, canceled or dead-lettered job.
CREATE OR REPLACE FUNCTION conveyor_jobs_not_to_run(workspaces uuid[], ids uuid[], redrives integer[])
    RETURNS TABLE (id uuid)
    LANGUAGE plpgsql STABLE SECURITY INVOKER
    AS $$
    #variable_conflict use_column
    DECLARE
        ws uuid;
        caller text := current_setting('app.workspace_id', true);
    BEGIN
        FOR ws IN SELECT DISTINCT w FROM unnest(workspaces) AS w LOOP
            PERFORM set_config('app.workspace_id', ws::text, true);
            RETURN QUERY
                SELECT e.id FROM conveyor.outbox_events e
                JOIN unnest(workspaces, ids, redrives) AS v(workspace_id, id, redrive)
                  ON v.id = e.id AND v.workspace_id = ws
                WHERE e.workspace_id = ws
                  AND (e.status IN ('completed', 'canceled', 'dead_letter', 'discarded')
                       OR (v.redrive IS NOT NULL AND e.redrive_count > v.redrive));
        END LOOP;
        PERFORM set_config('app.workspace_id', coalesce(caller, ''), true);
    END
    $$;

-- Retention (0009's): workspaces holding ended jobs, tombstones included, older than the retention period.
CREATE OR REPLACE FUNCTION conveyor_outbox_retention_workspaces_v2(older_than interval, max_workspaces integer)
    RETURNS TABLE (workspace_id uuid)
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, conveyor
    AS $$
        SELECT w.workspace_id FROM (
            SELECT e.workspace_id FROM conveyor.outbox_events e
            WHERE e.status IN ('completed', 'canceled') AND e.finished_at <= now() - older_than
            UNION
            SELECT e.workspace_id FROM conveyor.outbox_events e
            WHERE e.status = 'discarded' AND e.finished_at <= now() - older_than
        ) w
        LIMIT greatest(1, least(max_workspaces, 10000))
    $$;

-- ---------------------------------------------------------------------------------------------------------------
-- A job's state as operators and the library name it (`JobStatus`; see src/outbox/control.rs).
CREATE FUNCTION conveyor_job_state(status text, next_attempt_at timestamptz, failures integer) RETURNS text
    LANGUAGE sql STABLE PARALLEL SAFE
    AS $$
        SELECT CASE status
                   WHEN 'completed' THEN 'succeeded'
                   WHEN 'canceled' THEN 'canceled'
                   WHEN 'dead_letter' THEN 'failed'
                   WHEN 'discarded' THEN 'discarded'
                   WHEN 'dispatched' THEN 'active'
                   WHEN 'pending' THEN CASE WHEN next_attempt_at <= now() THEN 'queued'
                                            WHEN failures > 0 THEN 'retrying'
                                            ELSE 'scheduled' END
                   ELSE 'queued'
               END
    $$;

-- The row-level condition of one state (the inverse of conveyor_job_state), over `e`, for the searches below.
CREATE FUNCTION conveyor_admin_state_condition(state text) RETURNS text
    LANGUAGE plpgsql IMMUTABLE
    SET search_path = conveyor, pg_temp
    AS $$
    BEGIN
        RETURN CASE state
            WHEN 'scheduled' THEN
                '(e.status = ''pending'' AND e.next_attempt_at > now() AND e.job_attempts + e.attempt_count = 0)'
            WHEN 'queued' THEN
                '((e.status = ''pending'' AND e.next_attempt_at <= now()) OR e.status = ''dispatching'')'
            WHEN 'retrying' THEN
                '(e.status = ''pending'' AND e.next_attempt_at > now() AND e.job_attempts + e.attempt_count > 0)'
            WHEN 'active' THEN '(e.status = ''dispatched'')'
            WHEN 'succeeded' THEN '(e.status = ''completed'')'
            WHEN 'failed' THEN '(e.status = ''dead_letter'')'
            WHEN 'canceled' THEN '(e.status = ''canceled'')'
        END;
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_admin_state_condition(text) FROM PUBLIC;

-- ---------------------------------------------------------------------------------------------------------------
-- Appends a row to the audit trail: who (`actor`), what (`action`), with which arguments; the role is the session's.
-- Returns the row's id: a change's intent row (written before it) is named by its outcome row (written after).
CREATE FUNCTION conveyor_admin_audit_write(actor text, action text, arguments jsonb DEFAULT '{}')
    RETURNS bigint
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = conveyor, pg_temp
    AS $$
    DECLARE
        written bigint;
    BEGIN
        IF actor IS NULL OR length(actor) NOT BETWEEN 1 AND 200 THEN
            RAISE EXCEPTION 'conveyor_admin: the actor must be 1 to 200 characters' USING ERRCODE = '22023';
        END IF;
        IF action IS NULL OR action !~ '^[a-z][a-z0-9_]{0,63}$' THEN
            RAISE EXCEPTION 'conveyor_admin: bad action name %', action USING ERRCODE = '22023';
        END IF;
        INSERT INTO conveyor.conveyor_admin_audit (actor, role, action, arguments)
        VALUES (actor, session_user, action, coalesce(jsonb_strip_nulls(arguments), '{}'))
        RETURNING id INTO written;
        RETURN written;
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_admin_audit_write(text, text, jsonb) FROM PUBLIC;

-- Checks a page size (1 to 500).
CREATE FUNCTION conveyor_admin_check_limit(max_rows integer) RETURNS void
    LANGUAGE plpgsql IMMUTABLE
    SET search_path = conveyor, pg_temp
    AS $$
    BEGIN
        IF max_rows IS NULL OR max_rows NOT BETWEEN 1 AND 500 THEN
            RAISE EXCEPTION 'conveyor_admin: limit must be 1 to 500, not %', max_rows USING ERRCODE = '22023';
        END IF;
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_admin_check_limit(integer) FROM PUBLIC;

-- ---------------------------------------------------------------------------------------------------------------
-- Queues (those of registered kinds, and those with live, dead or recently finished jobs) with their jobs by state,
-- their completions and dead letters of the last 5 minutes, how long their oldest due job has waited for the relay
-- (seconds), and whether a pause names the queue alone. `only_queue` picks one. Each state is read through its partial
-- index.
CREATE FUNCTION conveyor_admin_queues(actor text, only_queue text DEFAULT NULL)
    RETURNS TABLE (queue text, registered boolean, queued bigint, delayed bigint, running bigint, retrying bigint,
                   dead bigint, completed_5m bigint, dead_5m bigint, oldest_queued_seconds double precision,
                   paused boolean)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = conveyor, pg_temp
    AS $$
    #variable_conflict use_column
    BEGIN
        PERFORM conveyor_admin_audit_write(actor, CASE WHEN only_queue IS NULL THEN 'queues' ELSE 'queue' END,
                                           jsonb_build_object('queue', only_queue));
        RETURN QUERY
            WITH counts AS (
                SELECT e.queue,
                       count(*) FILTER (WHERE e.next_attempt_at <= now()) AS queued,
                       count(*) FILTER (WHERE e.next_attempt_at > now() AND e.job_attempts + e.attempt_count = 0)
                           AS delayed,
                       0::bigint AS running,
                       count(*) FILTER (WHERE e.next_attempt_at > now() AND e.job_attempts + e.attempt_count > 0)
                           AS retrying,
                       0::bigint AS dead, 0::bigint AS completed_5m, 0::bigint AS dead_5m,
                       min(e.next_attempt_at) FILTER (WHERE e.next_attempt_at <= now()) AS oldest_due_at
                FROM conveyor.outbox_events e
                WHERE e.status = 'pending' AND (only_queue IS NULL OR e.queue = only_queue)
                GROUP BY e.queue
                UNION ALL
                SELECT e.queue, count(*), 0, 0, 0, 0, 0, 0, NULL::timestamptz
                FROM conveyor.outbox_events e
                WHERE e.status = 'dispatching' AND (only_queue IS NULL OR e.queue = only_queue)
                GROUP BY e.queue
                UNION ALL
                SELECT e.queue, 0, 0, count(*), 0, 0, 0, 0, NULL::timestamptz
                FROM conveyor.outbox_events e
                WHERE e.status = 'dispatched' AND (only_queue IS NULL OR e.queue = only_queue)
                GROUP BY e.queue
                UNION ALL
                SELECT e.queue, 0, 0, 0, 0, count(*), 0,
                       count(*) FILTER (WHERE e.dead_lettered_at >= now() - interval '5 minutes'), NULL::timestamptz
                FROM conveyor.outbox_events e
                WHERE e.status = 'dead_letter' AND (only_queue IS NULL OR e.queue = only_queue)
                GROUP BY e.queue
                UNION ALL
                SELECT e.queue, 0, 0, 0, 0, 0, count(*), 0, NULL::timestamptz
                FROM conveyor.outbox_events e
                WHERE e.status = 'completed' AND e.finished_at >= now() - interval '5 minutes'
                  AND (only_queue IS NULL OR e.queue = only_queue)
                GROUP BY e.queue
                UNION ALL
                SELECT DISTINCT k.queue, 0, 0, 0, 0, 0, 0, 0, NULL::timestamptz
                FROM conveyor.job_kinds k
                WHERE only_queue IS NULL OR k.queue = only_queue
            )
            SELECT c.queue,
                   EXISTS (SELECT 1 FROM conveyor.job_kinds k WHERE k.queue = c.queue),
                   sum(c.queued)::bigint, sum(c.delayed)::bigint, sum(c.running)::bigint, sum(c.retrying)::bigint,
                   sum(c.dead)::bigint, sum(c.completed_5m)::bigint, sum(c.dead_5m)::bigint,
                   extract(epoch FROM now() - min(c.oldest_due_at))::double precision,
                   EXISTS (SELECT 1 FROM conveyor.dispatch_pauses p
                           WHERE p.queue = c.queue AND p.kind IS NULL AND p.workspace_id IS NULL)
            FROM counts c
            GROUP BY c.queue
            ORDER BY c.queue;
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_admin_queues(text, text) FROM PUBLIC;

-- Jobs of every workspace matching the filters that are set, newest first (by id: UUIDv7), older than `before`.
-- `state` is a job state as conveyor_job_state names it. The statement is built from fixed fragments for the filters
-- given (values go as parameters), so each search is planned for the indexes its filters can use.
CREATE FUNCTION conveyor_admin_jobs(actor text, of_queue text, of_kind text, in_state text, of_workspace uuid,
                                    since timestamptz, until timestamptz, before uuid, max_rows integer)
    RETURNS TABLE (id uuid, workspace_id uuid, kind text, queue text, state text, failed_runs integer,
                   last_error text, operation_id uuid, created_at timestamptz, run_at timestamptz,
                   finished_at timestamptz)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = conveyor, pg_temp
    AS $$
    DECLARE
        conditions text := 'e.status <> ''discarded''';
    BEGIN
        PERFORM conveyor_admin_check_limit(max_rows);
        IF in_state IS NOT NULL AND conveyor_admin_state_condition(in_state) IS NULL THEN
            RAISE EXCEPTION 'conveyor_admin: unknown job state %', in_state USING ERRCODE = '22023';
        END IF;
        PERFORM conveyor_admin_audit_write(actor, 'jobs', jsonb_build_object(
            'queue', of_queue, 'kind', of_kind, 'status', in_state, 'workspace', of_workspace, 'since', since,
            'until', until, 'before', before, 'limit', max_rows));
        IF of_queue IS NOT NULL THEN conditions := conditions || ' AND e.queue = $1'; END IF;
        IF of_kind IS NOT NULL THEN conditions := conditions || ' AND e.event_type = $2'; END IF;
        IF in_state IS NOT NULL THEN
            conditions := conditions || ' AND ' || conveyor_admin_state_condition(in_state);
        END IF;
        IF of_workspace IS NOT NULL THEN conditions := conditions || ' AND e.workspace_id = $3'; END IF;
        IF since IS NOT NULL THEN conditions := conditions || ' AND e.created_at >= $4'; END IF;
        IF until IS NOT NULL THEN conditions := conditions || ' AND e.created_at < $5'; END IF;
        IF before IS NOT NULL THEN conditions := conditions || ' AND e.id < $6'; END IF;
        RETURN QUERY EXECUTE
            'SELECT e.id, e.workspace_id, e.event_type, e.queue,
                    conveyor_job_state(e.status, e.next_attempt_at, e.job_attempts + e.attempt_count),
                    e.job_attempts, e.last_error, e.operation_id, e.created_at, e.next_attempt_at,
                    coalesce(e.finished_at, e.dead_lettered_at)
             FROM conveyor.outbox_events e
             WHERE ' || conditions || '
             ORDER BY e.id DESC
             LIMIT $7'
            USING of_queue, of_kind, of_workspace, since, until, before, max_rows;
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_admin_jobs(text, text, text, text, uuid, timestamptz, timestamptz, uuid, integer)
    FROM PUBLIC;

-- One job of any workspace in full (payload, progress, result) with its failed runs, oldest first.
CREATE FUNCTION conveyor_admin_job(actor text, job_id uuid)
    RETURNS TABLE (id uuid, workspace_id uuid, kind text, queue text, state text, failed_runs integer,
                   last_error text, operation_id uuid, created_at timestamptz, run_at timestamptz,
                   finished_at timestamptz, payload jsonb, priority smallint, max_attempts integer, dedup_key text,
                   progress jsonb, result jsonb, dispatched_at timestamptz, failures jsonb)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = conveyor, pg_temp
    AS $$
    #variable_conflict use_column
    BEGIN
        PERFORM conveyor_admin_audit_write(actor, 'job', jsonb_build_object('job_id', job_id));
        RETURN QUERY
            SELECT e.id, e.workspace_id, e.event_type, e.queue,
                   conveyor_job_state(e.status, e.next_attempt_at, e.job_attempts + e.attempt_count),
                   e.job_attempts, e.last_error, e.operation_id, e.created_at, e.next_attempt_at,
                   coalesce(e.finished_at, e.dead_lettered_at), e.event_payload, e.priority, e.max_attempts,
                   e.dedup_key, coalesce(o.progress, e.progress), coalesce(e.result, o.result), e.dispatched_at,
                   coalesce((SELECT jsonb_agg(jsonb_build_object('attempt', f.attempt, 'stage', f.stage,
                                                                 'error', f.error, 'failed_at', f.failed_at)
                                              ORDER BY f.id)
                             FROM conveyor.job_failures f WHERE f.job_id = e.id), '[]'::jsonb)
            FROM conveyor.outbox_events e
            LEFT JOIN conveyor.operations o ON o.id = e.operation_id
            WHERE e.id = conveyor_admin_job.job_id AND e.status <> 'discarded';
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_admin_job(text, uuid) FROM PUBLIC;

-- Where a job is, before an operator changes it (as the application role, in that workspace): its workspace, its
-- operation and its state. Audited as `locate_job`; the change itself is audited by the caller.
CREATE FUNCTION conveyor_admin_locate_job(actor text, job_id uuid)
    RETURNS TABLE (workspace_id uuid, operation_id uuid, state text)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = conveyor, pg_temp
    AS $$
    #variable_conflict use_column
    BEGIN
        PERFORM conveyor_admin_audit_write(actor, 'locate_job', jsonb_build_object('job_id', job_id));
        RETURN QUERY
            SELECT e.workspace_id, e.operation_id,
                   conveyor_job_state(e.status, e.next_attempt_at, e.job_attempts + e.attempt_count)
            FROM conveyor.outbox_events e
            WHERE e.id = conveyor_admin_locate_job.job_id AND e.status <> 'discarded';
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_admin_locate_job(text, uuid) FROM PUBLIC;

-- Operations of every workspace matching the filters that are set, newest first (by id: UUIDv7).
CREATE FUNCTION conveyor_admin_operations(actor text, of_kind text, in_status text, of_workspace uuid,
                                          since timestamptz, until timestamptz, before uuid, max_rows integer)
    RETURNS TABLE (id uuid, workspace_id uuid, kind text, status text, subject_id uuid, error text,
                   attempt integer, created_at timestamptz, updated_at timestamptz, finished_at timestamptz)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = conveyor, pg_temp
    AS $$
    DECLARE
        conditions text := 'true';
    BEGIN
        PERFORM conveyor_admin_check_limit(max_rows);
        IF in_status IS NOT NULL AND in_status NOT IN ('queued', 'running', 'succeeded', 'failed', 'canceled') THEN
            RAISE EXCEPTION 'conveyor_admin: unknown operation status %', in_status USING ERRCODE = '22023';
        END IF;
        PERFORM conveyor_admin_audit_write(actor, 'operations', jsonb_build_object(
            'kind', of_kind, 'status', in_status, 'workspace', of_workspace, 'since', since, 'until', until,
            'before', before, 'limit', max_rows));
        IF of_kind IS NOT NULL THEN conditions := conditions || ' AND o.kind = $1'; END IF;
        IF in_status IS NOT NULL THEN conditions := conditions || ' AND o.status = $2'; END IF;
        IF of_workspace IS NOT NULL THEN conditions := conditions || ' AND o.workspace_id = $3'; END IF;
        IF since IS NOT NULL THEN conditions := conditions || ' AND o.created_at >= $4'; END IF;
        IF until IS NOT NULL THEN conditions := conditions || ' AND o.created_at < $5'; END IF;
        IF before IS NOT NULL THEN conditions := conditions || ' AND o.id < $6'; END IF;
        RETURN QUERY EXECUTE
            'SELECT o.id, o.workspace_id, o.kind, o.status, o.subject_id, o.error, o.attempt, o.created_at,
                    o.updated_at, o.finished_at
             FROM conveyor.operations o
             WHERE ' || conditions || '
             ORDER BY o.id DESC
             LIMIT $7'
            USING of_kind, in_status, of_workspace, since, until, before, max_rows;
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_admin_operations(text, text, text, uuid, timestamptz, timestamptz, uuid, integer)
    FROM PUBLIC;

-- Dead letters of every workspace matching the filters that are set (`since`/`until` on when they were
-- dead-lettered), newest job first, older than `before`. Operator metadata and the redacted reason; no payload.
-- `action` names the audit row: `dead_letters` for a search, or the bulk change it lists targets for.
CREATE FUNCTION conveyor_admin_dead_letters(actor text, action text, of_queue text, of_kind text,
                                            of_workspace uuid, since timestamptz, until timestamptz, before uuid,
                                            max_rows integer)
    RETURNS TABLE (id uuid, workspace_id uuid, queue text, event_type text, failure_stage text, attempts integer,
                   last_error text, operation_id uuid, created_at timestamptz, dead_lettered_at timestamptz)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = conveyor, pg_temp
    AS $$
    DECLARE
        conditions text := 'e.status = ''dead_letter''';
    BEGIN
        PERFORM conveyor_admin_check_limit(max_rows);
        IF action NOT IN ('dead_letters', 'replay_dead_letters', 'discard_dead_letters') THEN
            RAISE EXCEPTION 'conveyor_admin: % does not list dead letters', action USING ERRCODE = '22023';
        END IF;
        PERFORM conveyor_admin_audit_write(actor, action, jsonb_build_object(
            'queue', of_queue, 'kind', of_kind, 'workspace', of_workspace, 'since', since, 'until', until,
            'before', before, 'limit', max_rows));
        IF of_queue IS NOT NULL THEN conditions := conditions || ' AND e.queue = $1'; END IF;
        IF of_kind IS NOT NULL THEN conditions := conditions || ' AND e.event_type = $2'; END IF;
        IF of_workspace IS NOT NULL THEN conditions := conditions || ' AND e.workspace_id = $3'; END IF;
        IF since IS NOT NULL THEN conditions := conditions || ' AND e.dead_lettered_at >= $4'; END IF;
        IF until IS NOT NULL THEN conditions := conditions || ' AND e.dead_lettered_at < $5'; END IF;
        IF before IS NOT NULL THEN conditions := conditions || ' AND e.id < $6'; END IF;
        RETURN QUERY EXECUTE
            'SELECT e.id, e.workspace_id, e.queue, e.event_type, e.failure_stage,
                    CASE WHEN e.failure_stage = ''dispatch'' THEN e.attempt_count ELSE e.job_attempts END,
                    e.last_error, e.operation_id, e.created_at, e.dead_lettered_at
             FROM conveyor.outbox_events e
             WHERE ' || conditions || '
             ORDER BY e.id DESC
             LIMIT $7'
            USING of_queue, of_kind, of_workspace, since, until, before, max_rows;
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_admin_dead_letters(text, text, text, text, uuid, timestamptz, timestamptz, uuid,
                                                   integer) FROM PUBLIC;

-- Schedules of every workspace (or of one), by workspace and name.
CREATE FUNCTION conveyor_admin_schedules(actor text, workspace uuid DEFAULT NULL)
    RETURNS TABLE (workspace_id uuid, id uuid, name text, kind text, queue text, payload jsonb, cron text,
                   time_zone text, every_ms bigint, priority smallint, max_attempts integer, paused boolean,
                   next_run_at timestamptz, last_tick_at timestamptz, created_at timestamptz,
                   updated_at timestamptz)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = conveyor, pg_temp
    AS $$
    #variable_conflict use_column
    BEGIN
        PERFORM conveyor_admin_audit_write(actor, 'schedules', jsonb_build_object('workspace', workspace));
        RETURN QUERY
            SELECT s.workspace_id, s.id, s.name, s.kind, s.queue, s.payload, s.cron, s.time_zone, s.every_ms,
                   s.priority, s.max_attempts, s.paused, s.next_run_at, s.last_tick_at, s.created_at, s.updated_at
            FROM conveyor.job_schedules s
            WHERE conveyor_admin_schedules.workspace IS NULL OR s.workspace_id = conveyor_admin_schedules.workspace
            ORDER BY s.workspace_id, s.name;
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_admin_schedules(text, uuid) FROM PUBLIC;

-- The newest `max_rows` entries of the audit trail (this read's own entry first).
CREATE FUNCTION conveyor_admin_audit_trail(actor text, max_rows integer)
    RETURNS TABLE (at timestamptz, who text, role text, action text, arguments jsonb)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = conveyor, pg_temp
    AS $$
    #variable_conflict use_column
    BEGIN
        PERFORM conveyor_admin_check_limit(max_rows);
        PERFORM conveyor_admin_audit_write(actor, 'audit',
                                           jsonb_build_object('limit', max_rows));
        RETURN QUERY
            SELECT a.at, a.actor, a.role, a.action, a.arguments
            FROM conveyor.conveyor_admin_audit a
            ORDER BY a.id DESC
            LIMIT max_rows;
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_admin_audit_trail(text, integer) FROM PUBLIC;

-- ---------------------------------------------------------------------------------------------------------------
-- The dead-letter listing of 0003 returned every workspace's dead letters to whoever could execute it, the
-- application role included; conveyor_admin_dead_letters replaces it, for the operator role alone.
DROP FUNCTION conveyor_dead_letters(integer, uuid);
