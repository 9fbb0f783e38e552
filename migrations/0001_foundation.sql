-- Conveyor foundation: the transactional outbox and user-visible operations, in the schema `conveyor`.
-- Applied as the owner role. The application role gets DML rights only (granted by `conveyor migrate` after this
-- file), and every tenant table is walled off by row-level security.
--
-- In release 0.1 these files also created the e-commerce product's tables and the HTTP API's idempotency records,
-- all in `public`; those parts now live in the product crates' own histories (`shop/migrations`,
-- `server/migrations`), and a database of that layout is adopted in place by `migrate` (src/migrate/adopt.rs).
SET LOCAL search_path = conveyor;

-- The workspace of the current transaction, or NULL when none is set. `set_config(..., true)` is transaction-local;
-- after such a transaction the setting reads '' rather than NULL, hence NULLIF.
CREATE FUNCTION conveyor_current_workspace() RETURNS uuid
    LANGUAGE sql STABLE PARALLEL SAFE
    AS $$ SELECT NULLIF(current_setting('app.workspace_id', true), '')::uuid $$;

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
-- Row-level security: the tenant wall. FORCE makes it hold for the owner too; the application role is neither
-- owner, superuser nor BYPASSRLS.
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

-- ---------------------------------------------------------------------------------------------------------------
-- The one narrow hole in the wall: which workspaces have due outbox work. Returns workspace ids and nothing else,
-- so the dispatcher can then work per workspace under RLS. It runs as the owner, which FORCE subjects to the
-- policies too, so the owner alone gets a read-only policy to scan across workspaces; the application role is not
-- a member of the owner role and reaches this only through the functions below.
DO $$
BEGIN
    EXECUTE format('CREATE POLICY owner_scan ON outbox_events FOR SELECT TO %I USING (true)', current_user);
END
$$;

CREATE FUNCTION conveyor_due_outbox_workspaces(max_workspaces integer)
    RETURNS TABLE (workspace_id uuid)
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, conveyor
    AS $$
        SELECT w.workspace_id
        FROM (
            SELECT e.workspace_id, min(e.next_attempt_at) AS due_at
            FROM conveyor.outbox_events e
            WHERE e.status = 'pending' AND e.next_attempt_at <= now()
            GROUP BY e.workspace_id
            UNION ALL
            SELECT e.workspace_id, min(e.locked_until)
            FROM conveyor.outbox_events e
            WHERE e.status = 'dispatching' AND e.locked_until <= now()
            GROUP BY e.workspace_id
        ) w
        GROUP BY w.workspace_id
        ORDER BY min(w.due_at)
        LIMIT greatest(1, least(max_workspaces, 10000))
    $$;
REVOKE ALL ON FUNCTION conveyor_due_outbox_workspaces(integer) FROM PUBLIC;
