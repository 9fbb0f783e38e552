-- Worker support: job attempts and dead letters on the outbox row, and the narrow functions the reconciler and the
-- dead-letter CLI use to find work across workspaces (ids and operator metadata only, never payloads).

ALTER TABLE outbox_events
    ADD COLUMN job_attempts     integer     NOT NULL DEFAULT 0,   -- handler runs that failed (retryable)
    ADD COLUMN failure_stage    text        CHECK (failure_stage IN ('dispatch', 'job')),
    ADD COLUMN dead_lettered_at timestamptz;

CREATE INDEX outbox_events_dead ON outbox_events (dead_lettered_at) WHERE status = 'dead_letter';

DO $$
BEGIN
    EXECUTE format('CREATE POLICY owner_scan ON operations FOR SELECT TO %I USING (true)', current_user);
END
$$;

-- Workspaces holding operations that are unfinished and have shown no progress for `older_than`.
CREATE FUNCTION conveyor_stalled_operation_workspaces(older_than interval, max_workspaces integer)
    RETURNS TABLE (workspace_id uuid)
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, public
    AS $$
        SELECT DISTINCT o.workspace_id
        FROM public.operations o
        WHERE o.status IN ('queued', 'running') AND o.updated_at <= now() - older_than
        LIMIT greatest(1, least(max_workspaces, 10000))
    $$;
REVOKE ALL ON FUNCTION conveyor_stalled_operation_workspaces(interval, integer) FROM PUBLIC;

-- Dead letters for operators: where, what type, why (redacted), when. No payload. `only_id` picks one.
CREATE FUNCTION conveyor_dead_letters(max_rows integer, only_id uuid DEFAULT NULL)
    RETURNS TABLE (id uuid, workspace_id uuid, queue text, event_type text, failure_stage text, attempts integer,
                   last_error text, operation_id uuid, created_at timestamptz, dead_lettered_at timestamptz)
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, public
    AS $$
        SELECT e.id, e.workspace_id, e.queue, e.event_type, e.failure_stage,
               CASE WHEN e.failure_stage = 'job' THEN e.job_attempts ELSE e.attempt_count END,
               e.last_error, e.operation_id, e.created_at, e.dead_lettered_at
        FROM public.outbox_events e
        WHERE e.status = 'dead_letter' AND (only_id IS NULL OR e.id = only_id)
        ORDER BY e.dead_lettered_at DESC NULLS LAST, e.id DESC
        LIMIT greatest(1, least(max_rows, 10000))
    $$;
REVOKE ALL ON FUNCTION conveyor_dead_letters(integer, uuid) FROM PUBLIC;

-- The event behind a stream entry that Redis reports deleted while still pending: id and workspace only.
CREATE FUNCTION conveyor_event_by_stream_id(queue_name text, entry_id text)
    RETURNS TABLE (id uuid, workspace_id uuid)
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, public
    AS $$
        SELECT e.id, e.workspace_id FROM public.outbox_events e
        WHERE e.queue = queue_name AND e.stream_id = entry_id AND e.status = 'dispatched'
    $$;
REVOKE ALL ON FUNCTION conveyor_event_by_stream_id(text, text) FROM PUBLIC;
CREATE INDEX outbox_events_stream_id ON outbox_events (stream_id) WHERE status = 'dispatched';
