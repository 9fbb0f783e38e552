-- A job's log: the lines its handler writes with JobContext::log, visible at once (each in a transaction of its own,
-- outside the job's, so a failed run's lines stay), read by get_job_logs, the admin API, the UI and `conveyor jobs
-- show`. Tenant data, walled like job_failures; deleted with its job. Bounded per job: at most 100 lines of at most
-- 500 characters (redacted and cut as errors are), 64 KiB in all (the insert refuses more; JobContext::log drops what
-- does not fit).
SET LOCAL search_path = conveyor;

CREATE TABLE job_logs (
    job_id       uuid        NOT NULL REFERENCES outbox_events (id) ON DELETE CASCADE,
    seq          integer     NOT NULL CHECK (seq BETWEEN 1 AND 100),
    workspace_id uuid        NOT NULL,
    attempt      integer     NOT NULL CHECK (attempt >= 1),
    at           timestamptz NOT NULL DEFAULT clock_timestamp(),
    line         text        NOT NULL CHECK (char_length(line) <= 1000),  -- redacted, cut at 500 characters
    PRIMARY KEY (job_id, seq)
);

ALTER TABLE job_logs ENABLE ROW LEVEL SECURITY;
ALTER TABLE job_logs FORCE ROW LEVEL SECURITY;
CREATE POLICY workspace_isolation ON job_logs
    USING (workspace_id = conveyor_current_workspace())
    WITH CHECK (workspace_id = conveyor_current_workspace());
DO $$
BEGIN
    EXECUTE format('CREATE POLICY owner_scan ON job_logs FOR SELECT TO %I USING (true)', current_user);
END
$$;

-- One job's log lines in whichever workspace, for an operator (audited as every conveyor_admin_ read is).
CREATE FUNCTION conveyor_admin_job_logs(actor text, of_job uuid)
    RETURNS TABLE (seq integer, attempt integer, at timestamptz, line text)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, conveyor, pg_temp
    AS $$
    #variable_conflict use_column
    BEGIN
        PERFORM conveyor.conveyor_admin_audit_write(actor, 'job_logs', pg_catalog.jsonb_build_object('job_id', of_job));
        RETURN QUERY
            SELECT l.seq, l.attempt, l.at, l.line FROM conveyor.job_logs l
            WHERE l.job_id = of_job
            ORDER BY l.seq;
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_admin_job_logs(text, uuid) FROM PUBLIC;
