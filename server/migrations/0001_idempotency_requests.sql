-- The HTTP API's idempotent requests (seed section 2), in the schema `conveyor_server`. One row per (workspace, user,
-- method, normalized path, key). The row is written inside the business transaction, so a rollback takes it away
-- with the work. In release 0.1 this table lived in `public`, created by the platform's first migration; a database
-- of that layout has it moved here by `conveyor migrate`.
SET LOCAL search_path = conveyor_server, conveyor;

CREATE TABLE idempotency_requests (
    workspace_id        uuid        NOT NULL,
    user_id             uuid        NOT NULL,
    http_method         text        NOT NULL,
    request_path        text        NOT NULL,
    idempotency_key     uuid        NOT NULL,
    request_fingerprint bytea       NOT NULL,
    fingerprint_key_id  text        NOT NULL,
    status              text        NOT NULL DEFAULT 'in_progress'
                                    CHECK (status IN ('in_progress', 'completed')),
    response_status     smallint,
    response_headers    jsonb,
    response_body       jsonb,
    created_at          timestamptz NOT NULL DEFAULT now(),
    completed_at        timestamptz,
    expires_at          timestamptz NOT NULL DEFAULT now() + interval '48 hours',
    PRIMARY KEY (workspace_id, user_id, http_method, request_path, idempotency_key),
    CHECK (status = 'in_progress' OR response_status IS NOT NULL)
);
CREATE INDEX idempotency_requests_expiry ON idempotency_requests (expires_at);

ALTER TABLE idempotency_requests ENABLE ROW LEVEL SECURITY;
ALTER TABLE idempotency_requests FORCE ROW LEVEL SECURITY;
CREATE POLICY workspace_isolation ON idempotency_requests
    USING (workspace_id = conveyor_current_workspace())
    WITH CHECK (workspace_id = conveyor_current_workspace());

-- The retention job's narrow hole in the wall: which workspaces hold expired records, ids only, read as the owner
-- (FORCE subjects it to the policies too, hence its own read-only policy); the purge then runs per workspace.
DO $$
BEGIN
    EXECUTE format('CREATE POLICY owner_scan ON idempotency_requests FOR SELECT TO %I USING (true)', current_user);
END
$$;

CREATE FUNCTION conveyor_expired_idempotency_workspaces(max_workspaces integer)
    RETURNS TABLE (workspace_id uuid)
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, conveyor_server, pg_temp
    AS $$
        SELECT DISTINCT r.workspace_id
        FROM conveyor_server.idempotency_requests r
        WHERE r.expires_at <= now() AND r.created_at <= now() - interval '24 hours'
        LIMIT greatest(1, least(max_workspaces, 10000))
    $$;
REVOKE ALL ON FUNCTION conveyor_expired_idempotency_workspaces(integer) FROM PUBLIC;
