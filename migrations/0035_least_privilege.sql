-- Least privilege (issue 24): what a role may not decide by itself.
--
-- 1. Cancellation messages are hints. Any role may `NOTIFY conveyor_jobs_canceled, '<job id>'`; a worker used to stop
--    the job named without reading the database. It now asks this function which of the jobs it heard of are really
--    canceled (the status every cancel path writes, in the cancel's own transaction, before its notification is
--    delivered) and ignores the others. The runtime role's (the worker's bookkeeping), like every function not listed
--    for the application role: it reads across workspaces, and says no more than whether a job id is canceled.
SET LOCAL search_path = conveyor;

CREATE FUNCTION conveyor_canceled_jobs(jobs uuid[])
    RETURNS SETOF uuid
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, conveyor, pg_temp
    AS $$
        SELECT e.id FROM conveyor.outbox_events e
        WHERE e.id = ANY (jobs[1:1000]) AND e.status = 'canceled'
    $$;
REVOKE ALL ON FUNCTION conveyor_canceled_jobs(uuid[]) FROM PUBLIC;

-- ---------------------------------------------------------------------------------------------------------------
-- 2. The audit purge never goes below the configured retention. `conveyor_audit_purge` (0026, maintenance, as the
--    runtime role) took any `older_than` of a day or more, so the runtime role could purge the trail down to 24 h
--    whatever CONVEYOR_AUDIT_RETENTION said. The retention now has a home no role but the owner reads or writes:
--    `conveyor migrate` writes CONVEYOR_AUDIT_RETENTION there (default 90 days) on every run, and the purge keeps
--    at least that much, whatever `older_than` it is given (a longer `older_than` keeps more).
CREATE TABLE conveyor_settings (
    name       text        PRIMARY KEY,
    value      text        NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);
REVOKE ALL ON conveyor_settings FROM PUBLIC;
INSERT INTO conveyor_settings (name, value) VALUES ('audit_retention', '90 days');

CREATE OR REPLACE FUNCTION conveyor_audit_purge(older_than interval, max_rows integer)
    RETURNS bigint
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, conveyor, pg_temp
    AS $$
    DECLARE
        purged bigint;
        retention interval;
        kept interval;
    BEGIN
        IF older_than IS NULL OR older_than < interval '1 day' THEN
            RAISE EXCEPTION 'conveyor_audit_purge: the audit trail is kept at least a day, not %', older_than
                USING ERRCODE = '22023';
        END IF;
        SELECT s.value::interval INTO retention FROM conveyor.conveyor_settings s
        WHERE s.name = 'audit_retention';
        -- The configured retention is a floor: a caller may keep more, never less.
        kept := GREATEST(older_than, coalesce(retention, interval '90 days'));
        -- The oldest entries by id (their times grow with it), so a pass reads at most `max_rows` of them.
        DELETE FROM conveyor.conveyor_admin_audit a
        WHERE a.id = ANY(ARRAY(
                  SELECT o.id
                  FROM (SELECT e.id, e.at FROM conveyor.conveyor_admin_audit e
                        ORDER BY e.id
                        LIMIT GREATEST(1, LEAST(max_rows, 10000))) o
                  WHERE o.at < pg_catalog.now() - kept));
        GET DIAGNOSTICS purged = ROW_COUNT;
        IF purged > 0 THEN
            INSERT INTO conveyor.conveyor_admin_audit (actor, role, action, arguments)
            VALUES ('maintenance', session_user, 'audit_purge',
                    pg_catalog.jsonb_build_object('older_than', older_than::text, 'kept', kept::text,
                                                  'deleted', purged));
        END IF;
        RETURN purged;
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_audit_purge(interval, integer) FROM PUBLIC;

-- ---------------------------------------------------------------------------------------------------------------
-- 3. Weights and pauses are operator data. The `every_workspace` policy of 0026 let any role with the table's rights
--    write a pause of every tenant (a queue or a kind everywhere), and the application role could set its own
--    workspace's fair-share weight to 1000. `conveyor migrate` now grants the application role only SELECT on
--    `workspace_weights` and `dispatch_pauses` (it reads the pauses that hold its jobs); a pause of every workspace
--    is readable by every role with the table's rights and writable by none: the `every_workspace` policy is for
--    SELECT now. Changes go through the operator's audited functions below (the admin API, the web UI,
--    `conveyor flow`, and the library's `pause`, `resume` and `set_workspace_weight` given the operator role's
--    pool), which write as the owner: `owner_write` lets them, and them alone (no role but the owner has it).
DROP POLICY every_workspace ON dispatch_pauses;
CREATE POLICY every_workspace ON dispatch_pauses FOR SELECT USING (workspace_id IS NULL);

DO $$
BEGIN
    EXECUTE format('CREATE POLICY owner_write ON dispatch_pauses TO %I USING (true) WITH CHECK (true)', current_user);
    EXECUTE format('CREATE POLICY owner_write ON workspace_weights TO %I USING (true) WITH CHECK (true)', current_user);
END
$$;

-- Refuses a scope that names nothing, or a queue or kind name no job can have (src/kind.rs's rules).
CREATE FUNCTION conveyor_admin_check_scope(scope_queue text, scope_kind text, scope_workspace uuid) RETURNS void
    LANGUAGE plpgsql IMMUTABLE
    SET search_path = pg_catalog, conveyor, pg_temp
    AS $$
    BEGIN
        IF scope_queue IS NULL AND scope_kind IS NULL AND scope_workspace IS NULL THEN
            RAISE EXCEPTION 'conveyor_admin: a pause names a queue, a kind or a workspace' USING ERRCODE = '22023';
        END IF;
        IF scope_queue !~ '^[a-z0-9][a-z0-9_.-]{0,99}$' THEN
            RAISE EXCEPTION 'conveyor_admin: invalid queue name' USING ERRCODE = '22023';
        END IF;
        IF scope_kind !~ '^[a-z0-9][a-z0-9_.:-]{0,99}$' THEN
            RAISE EXCEPTION 'conveyor_admin: invalid kind name' USING ERRCODE = '22023';
        END IF;
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_admin_check_scope(text, text, uuid) FROM PUBLIC;

-- Holds the jobs of the scope (every job matching all of the fields that are set) from the relay's next claim on.
-- True when the pause is new. Writes its outcome to the audit trail, naming `intent` (the intent row the admin API
-- wrote before, NULL for a direct call), in the same transaction: no pause without its row.
CREATE FUNCTION conveyor_admin_pause(actor text, intent bigint, scope_queue text, scope_kind text,
                                     scope_workspace uuid, pause_reason text)
    RETURNS boolean
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, conveyor, pg_temp
    AS $$
    DECLARE
        added bigint;
    BEGIN
        PERFORM conveyor.conveyor_admin_check_scope(scope_queue, scope_kind, scope_workspace);
        IF pg_catalog.octet_length(pause_reason) > 500 THEN
            RAISE EXCEPTION 'conveyor_admin: a pause''s reason is at most 500 bytes' USING ERRCODE = '22023';
        END IF;
        INSERT INTO conveyor.dispatch_pauses (queue, kind, workspace_id, reason)
        VALUES (scope_queue, scope_kind, scope_workspace, pause_reason)
        ON CONFLICT (coalesce(queue, ''), coalesce(kind, ''),
                     coalesce(workspace_id, '00000000-0000-0000-0000-000000000000')) DO NOTHING;
        GET DIAGNOSTICS added = ROW_COUNT;
        PERFORM conveyor.conveyor_admin_audit_write(actor, 'pause', pg_catalog.jsonb_build_object(
            'queue', scope_queue, 'kind', scope_kind, 'workspace', scope_workspace, 'reason', pause_reason,
            'outcome', CASE WHEN added = 1 THEN 'paused' ELSE 'already_paused' END,
            'intent', intent));
        RETURN added = 1;
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_admin_pause(text, bigint, text, text, uuid, text) FROM PUBLIC;

-- Lifts the pause of exactly the scope and wakes the dispatchers (the held jobs are due already). True when there
-- was one. Audited like conveyor_admin_pause.
CREATE FUNCTION conveyor_admin_resume(actor text, intent bigint, scope_queue text, scope_kind text,
                                      scope_workspace uuid)
    RETURNS boolean
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, conveyor, pg_temp
    AS $$
    DECLARE
        removed bigint;
    BEGIN
        PERFORM conveyor.conveyor_admin_check_scope(scope_queue, scope_kind, scope_workspace);
        DELETE FROM conveyor.dispatch_pauses p
        WHERE p.queue IS NOT DISTINCT FROM scope_queue AND p.kind IS NOT DISTINCT FROM scope_kind
          AND p.workspace_id IS NOT DISTINCT FROM scope_workspace;
        GET DIAGNOSTICS removed = ROW_COUNT;
        PERFORM conveyor.conveyor_admin_audit_write(actor, 'resume', pg_catalog.jsonb_build_object(
            'queue', scope_queue, 'kind', scope_kind, 'workspace', scope_workspace,
            'outcome', CASE WHEN removed > 0 THEN 'resumed' ELSE 'not_paused' END,
            'intent', intent));
        -- An empty payload asks every dispatcher for a sweep.
        PERFORM pg_catalog.pg_notify('conveyor_outbox', '');
        RETURN removed > 0;
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_admin_resume(text, bigint, text, text, uuid) FROM PUBLIC;

-- Gives a workspace `weight` (1 to 1000; 1 is everyone's default) times the window of jobs in the workers' hands.
-- Audited like conveyor_admin_pause.
CREATE FUNCTION conveyor_admin_set_weight(actor text, intent bigint, weight_workspace uuid, new_weight integer)
    RETURNS void
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, conveyor, pg_temp
    AS $$
    BEGIN
        IF weight_workspace IS NULL THEN
            RAISE EXCEPTION 'conveyor_admin: a weight names its workspace' USING ERRCODE = '22023';
        END IF;
        IF new_weight IS NULL OR new_weight < 1 OR new_weight > 1000 THEN
            RAISE EXCEPTION 'conveyor_admin: a weight is from 1 to 1000' USING ERRCODE = '22023';
        END IF;
        INSERT INTO conveyor.workspace_weights (workspace_id, weight) VALUES (weight_workspace, new_weight)
        ON CONFLICT (workspace_id) DO UPDATE SET weight = EXCLUDED.weight, updated_at = pg_catalog.now();
        PERFORM conveyor.conveyor_admin_audit_write(actor, 'weight', pg_catalog.jsonb_build_object(
            'workspace', weight_workspace, 'weight', new_weight, 'outcome', 'set', 'intent', intent));
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_admin_set_weight(text, bigint, uuid, integer) FROM PUBLIC;
