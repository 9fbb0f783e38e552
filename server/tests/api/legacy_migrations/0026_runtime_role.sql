-- The runtime role (issue 16, "the leak"): no function the application role can execute returns or changes another
-- workspace's rows without that workspace's context.
--
-- Until now `conveyor migrate` granted the application role every `conveyor_` function but the operator's. Among them
-- were the `SECURITY DEFINER` lookups that read across workspaces (the workspaces with due jobs, with expired
-- idempotency records, with stalled operations, the next due time, the due schedules, the backlog, a job by its stream
-- entry) and the relay's and worker's batch functions that set `app.workspace_id` themselves, to each workspace their
-- arguments name (claim, mark, record of ends, skip check): whoever may call those walks through the wall. They are
-- Conveyor's own runtime, not the API's nor a job handler's: `conveyor migrate` now grants them to a role of their
-- own, the runtime role (CONVEYOR_RUNTIME_DATABASE_URL: dispatcher, maintenance and the worker's bookkeeping), and the
-- application role keeps the functions proven to stay in the caller's workspace (src/migrate.rs lists them; the test
-- tests/rls.rs enumerates every function the application role can execute against that list).
--
-- PostgreSQL grants EXECUTE on a new function to PUBLIC: the batch functions below were callable by any role, and
-- `conveyor migrate` now revokes PUBLIC's right on every `conveyor_` function before granting each role its own.

REVOKE ALL ON FUNCTION conveyor_claim_outbox(uuid[], text, double precision, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION conveyor_claim_jobs(uuid[], text, double precision, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION conveyor_claim_jobs_fair(uuid[], text, double precision, integer, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION conveyor_mark_outbox_dispatched(text, uuid[], tid[], uuid[], text[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION conveyor_mark_outbox_dispatched(text, uuid[], tid[], uuid[], integer[], text[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION conveyor_complete_jobs(uuid[], uuid[], integer[], jsonb[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION conveyor_jobs_not_to_run(uuid[], uuid[], integer[]) FROM PUBLIC;

-- ---------------------------------------------------------------------------------------------------------------
-- Weights and pauses (0021) were kept outside row-level security as "operator settings", so the application role
-- could change any workspace's weight or pause with no context at all. A workspace's weight and a pause naming a
-- workspace are that workspace's rows now: written and read in its context (the library's calls set it). A pause
-- naming no workspace (a queue or a kind everywhere) belongs to no workspace and stays visible to and settable by
-- every role with the table's rights. The relay's claim reads a workspace's weight after setting its context; it
-- reads pauses before, across workspaces: `conveyor migrate` gives the runtime role a policy that reads every pause
-- (its name is known only then). Definer functions (the backlog, the operator's) read as the owner: owner_scan.
ALTER TABLE workspace_weights ENABLE ROW LEVEL SECURITY;
ALTER TABLE workspace_weights FORCE ROW LEVEL SECURITY;
CREATE POLICY workspace_isolation ON workspace_weights
    USING (workspace_id = conveyor_current_workspace())
    WITH CHECK (workspace_id = conveyor_current_workspace());

ALTER TABLE dispatch_pauses ENABLE ROW LEVEL SECURITY;
ALTER TABLE dispatch_pauses FORCE ROW LEVEL SECURITY;
CREATE POLICY workspace_isolation ON dispatch_pauses
    USING (workspace_id = conveyor_current_workspace())
    WITH CHECK (workspace_id = conveyor_current_workspace());
CREATE POLICY every_workspace ON dispatch_pauses
    USING (workspace_id IS NULL)
    WITH CHECK (workspace_id IS NULL);

DO $$
BEGIN
    EXECUTE format('CREATE POLICY owner_scan ON workspace_weights FOR SELECT TO %I USING (true)', current_user);
    EXECUTE format('CREATE POLICY owner_scan ON dispatch_pauses FOR SELECT TO %I USING (true)', current_user);
END
$$;

-- ---------------------------------------------------------------------------------------------------------------
-- Every pause in force, for the operator (the admin API, the web UI): audited like the operator's other reads.
CREATE FUNCTION conveyor_admin_pauses(actor text)
    RETURNS TABLE (queue text, kind text, workspace_id uuid, reason text, created_at timestamptz)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = public, pg_temp
    AS $$
    #variable_conflict use_column
    BEGIN
        PERFORM conveyor_admin_audit_write(actor, 'pauses', '{}');
        RETURN QUERY
            SELECT p.queue, p.kind, p.workspace_id, p.reason, p.created_at
            FROM public.dispatch_pauses p
            ORDER BY p.id;
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_admin_pauses(text) FROM PUBLIC;

-- ---------------------------------------------------------------------------------------------------------------
-- Retention of the audit trail (run by maintenance, as the runtime role): deletes up to `max_rows` of the oldest
-- entries older than `older_than` (at least a day), and records what it deleted in the trail itself. Returns how many.
CREATE FUNCTION conveyor_audit_purge(older_than interval, max_rows integer)
    RETURNS bigint
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = public, pg_temp
    AS $$
    DECLARE
        purged bigint;
    BEGIN
        IF older_than IS NULL OR older_than < interval '1 day' THEN
            RAISE EXCEPTION 'conveyor_audit_purge: the audit trail is kept at least a day, not %', older_than
                USING ERRCODE = '22023';
        END IF;
        -- The oldest entries by id (their times grow with it), so a pass reads at most `max_rows` of them.
        DELETE FROM public.conveyor_admin_audit a
        WHERE a.id = ANY(ARRAY(SELECT o.id
                               FROM (SELECT e.id, e.at FROM public.conveyor_admin_audit e
                                     ORDER BY e.id
                                     LIMIT greatest(1, least(max_rows, 10000))) o
                               WHERE o.at < now() - older_than));
        GET DIAGNOSTICS purged = ROW_COUNT;
        IF purged > 0 THEN
            INSERT INTO public.conveyor_admin_audit (actor, role, action, arguments)
            VALUES ('maintenance', session_user, 'audit_purge',
                    jsonb_build_object('older_than', older_than::text, 'deleted', purged));
        END IF;
        RETURN purged;
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_audit_purge(interval, integer) FROM PUBLIC;
