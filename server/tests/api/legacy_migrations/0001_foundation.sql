-- Conveyor foundation: idempotent requests, the transactional outbox, user-visible operations and stores.
-- Applied by `conveyor migrate` as the owner role. The application role gets DML rights only (granted by
-- `conveyor migrate` after this file), and every tenant table is walled off by row-level security.

-- The workspace of the current transaction, or NULL when none is set. `set_config(..., true)` is transaction-local;
-- after such a transaction the setting reads '' rather than NULL, hence NULLIF.
CREATE FUNCTION conveyor_current_workspace() RETURNS uuid
    LANGUAGE sql STABLE PARALLEL SAFE
    AS $$ SELECT NULLIF(current_setting('app.workspace_id', true), '')::uuid $$;

-- ---------------------------------------------------------------------------------------------------------------
-- Idempotent requests (seed section 2). One row per (workspace, user, method, normalized path, key). The row is
-- written inside the business transaction, so a rollback takes it away with the work.
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

-- ---------------------------------------------------------------------------------------------------------------
-- User-visible operations: the source of truth a client polls.
CREATE TABLE operations (
    id            uuid        PRIMARY KEY,
    workspace_id  uuid        NOT NULL,
    kind          text        NOT NULL,
    status        text        NOT NULL DEFAULT 'queued'
                              CHECK (status IN ('queued', 'running', 'succeeded', 'failed', 'canceled')),
    subject_id    uuid,
    created_by    uuid        NOT NULL,
    progress      jsonb,
    result        jsonb,
    error         text,
    attempt       integer     NOT NULL DEFAULT 0,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    started_at    timestamptz,
    finished_at   timestamptz
);
CREATE INDEX operations_unfinished ON operations (workspace_id, updated_at) WHERE status IN ('queued', 'running');

-- ---------------------------------------------------------------------------------------------------------------
-- The transactional outbox (seed sections 3 and 4).
CREATE TABLE outbox_events (
    id              uuid        PRIMARY KEY,          -- UUIDv7, the queue's job id
    workspace_id    uuid        NOT NULL,
    queue           text        NOT NULL,
    event_type      text        NOT NULL,
    event_payload   jsonb       NOT NULL,             -- ids only, never secrets
    operation_id    uuid        REFERENCES operations (id) ON DELETE SET NULL,
    traceparent     text,
    status          text        NOT NULL DEFAULT 'pending'
                                CHECK (status IN ('pending', 'dispatching', 'dispatched', 'dead_letter')),
    attempt_count   integer     NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    locked_by       text,
    locked_until    timestamptz,
    last_error      text,                             -- redacted
    stream_id       text,                             -- the Redis stream entry id once dispatched
    redrive_count   integer     NOT NULL DEFAULT 0,   -- bumped by the reconciler to get past the de-dup key
    created_at      timestamptz NOT NULL DEFAULT now(),
    dispatched_at   timestamptz,
    CHECK (status <> 'dispatching' OR (locked_by IS NOT NULL AND locked_until IS NOT NULL))
);
-- Hot paths: due pending events per workspace, expired leases, dispatched rows awaiting retention.
CREATE INDEX outbox_events_due ON outbox_events (workspace_id, next_attempt_at, id) WHERE status = 'pending';
CREATE INDEX outbox_events_leased ON outbox_events (locked_until) WHERE status = 'dispatching';
CREATE INDEX outbox_events_dispatched ON outbox_events (workspace_id, dispatched_at) WHERE status = 'dispatched';
CREATE INDEX outbox_events_operation ON outbox_events (operation_id);

-- ---------------------------------------------------------------------------------------------------------------
-- Stores (marketplace authorizations) and their credentials, encrypted at rest with AES-256-GCM.
CREATE TABLE stores (
    id            uuid        PRIMARY KEY,
    workspace_id  uuid        NOT NULL,
    name          text        NOT NULL CHECK (length(name) BETWEEN 1 AND 200),
    platform      text        NOT NULL,
    status        text        NOT NULL DEFAULT 'pending_verification'
                              CHECK (status IN ('pending_verification', 'active', 'invalid_credentials')),
    status_detail text,
    created_by    uuid        NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    verified_at   timestamptz,
    UNIQUE (workspace_id, id)
);

CREATE TABLE store_credentials (
    store_id       uuid        PRIMARY KEY,
    workspace_id   uuid        NOT NULL,
    key_id         text        NOT NULL,   -- which encryption key sealed it
    nonce          bytea       NOT NULL CHECK (length(nonce) = 12),
    ciphertext     bytea       NOT NULL,   -- AES-256-GCM of the JSON credentials, AAD = workspace_id || store_id
    version        integer     NOT NULL DEFAULT 1,
    updated_at     timestamptz NOT NULL DEFAULT now(),
    FOREIGN KEY (workspace_id, store_id) REFERENCES stores (workspace_id, id) ON DELETE CASCADE
);

-- ---------------------------------------------------------------------------------------------------------------
-- Row-level security: the tenant wall. FORCE makes it hold for the owner too; the application role is neither
-- owner, superuser nor BYPASSRLS.
ALTER TABLE idempotency_requests ENABLE ROW LEVEL SECURITY;
ALTER TABLE idempotency_requests FORCE ROW LEVEL SECURITY;
CREATE POLICY workspace_isolation ON idempotency_requests
    USING (workspace_id = conveyor_current_workspace())
    WITH CHECK (workspace_id = conveyor_current_workspace());

ALTER TABLE operations ENABLE ROW LEVEL SECURITY;
ALTER TABLE operations FORCE ROW LEVEL SECURITY;
CREATE POLICY workspace_isolation ON operations
    USING (workspace_id = conveyor_current_workspace())
    WITH CHECK (workspace_id = conveyor_current_workspace());

ALTER TABLE outbox_events ENABLE ROW LEVEL SECURITY;
ALTER TABLE outbox_events FORCE ROW LEVEL SECURITY;
CREATE POLICY workspace_isolation ON outbox_events
    USING (workspace_id = conveyor_current_workspace())
    WITH CHECK (workspace_id = conveyor_current_workspace());

ALTER TABLE stores ENABLE ROW LEVEL SECURITY;
ALTER TABLE stores FORCE ROW LEVEL SECURITY;
CREATE POLICY workspace_isolation ON stores
    USING (workspace_id = conveyor_current_workspace())
    WITH CHECK (workspace_id = conveyor_current_workspace());

ALTER TABLE store_credentials ENABLE ROW LEVEL SECURITY;
ALTER TABLE store_credentials FORCE ROW LEVEL SECURITY;
CREATE POLICY workspace_isolation ON store_credentials
    USING (workspace_id = conveyor_current_workspace())
    WITH CHECK (workspace_id = conveyor_current_workspace());

-- ---------------------------------------------------------------------------------------------------------------
-- The one narrow hole in the wall: which workspaces have due outbox work. Returns workspace ids and nothing else,
-- so the dispatcher can then work per workspace under RLS. It runs as the owner, which FORCE subjects to the
-- policies too, so the owner alone gets a read-only policy to scan across workspaces; the application role is not
-- a member of the owner role and reaches this only through the functions below.
DO $$
BEGIN
    EXECUTE format('CREATE POLICY owner_scan ON outbox_events FOR SELECT TO %I USING (true)', current_user);
    EXECUTE format('CREATE POLICY owner_scan ON idempotency_requests FOR SELECT TO %I USING (true)', current_user);
END
$$;

CREATE FUNCTION conveyor_due_outbox_workspaces(max_workspaces integer)
    RETURNS TABLE (workspace_id uuid)
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, public
    AS $$
        SELECT w.workspace_id
        FROM (
            SELECT e.workspace_id, min(e.next_attempt_at) AS due_at
            FROM public.outbox_events e
            WHERE e.status = 'pending' AND e.next_attempt_at <= now()
            GROUP BY e.workspace_id
            UNION ALL
            SELECT e.workspace_id, min(e.locked_until)
            FROM public.outbox_events e
            WHERE e.status = 'dispatching' AND e.locked_until <= now()
            GROUP BY e.workspace_id
        ) w
        GROUP BY w.workspace_id
        ORDER BY min(w.due_at)
        LIMIT greatest(1, least(max_workspaces, 10000))
    $$;
REVOKE ALL ON FUNCTION conveyor_due_outbox_workspaces(integer) FROM PUBLIC;

-- Which workspaces hold expired idempotency records: ids only, for the retention job.
CREATE FUNCTION conveyor_expired_idempotency_workspaces(max_workspaces integer)
    RETURNS TABLE (workspace_id uuid)
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, public
    AS $$
        SELECT DISTINCT r.workspace_id
        FROM public.idempotency_requests r
        WHERE r.expires_at <= now() AND r.created_at <= now() - interval '24 hours'
        LIMIT greatest(1, least(max_workspaces, 10000))
    $$;
REVOKE ALL ON FUNCTION conveyor_expired_idempotency_workspaces(integer) FROM PUBLIC;
