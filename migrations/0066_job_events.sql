-- Job events beyond ends (BullMQ's QueueEvents `active`, `progress`, `stalled`, and a failed run that will run again):
-- what `subscribe_events` reads beside the ends it reads from the jobs themselves (completed, failed, canceled).
--
-- - `progress`, `retrying` and `stalled` are written by the statement that already records them (the progress, the
--   retry, the count of a stopped worker), so they cost a row, not a round trip.
-- - `active` is written by the worker as a handler starts, only for the workspaces where a subscription that wants it
--   is open (`event_listeners`, read across workspaces through `conveyor_event_listened_workspaces`, ids only): a
--   job's start costs nothing in PostgreSQL while nobody listens. A progress is announced (`NOTIFY`) only there too.
--
-- Tenant data, walled by row-level security like the jobs. Kept an hour, for a subscriber that resumes from a time
-- (`conveyor_job_events_purge`, run by maintenance); a job removed earlier takes its events out of every read.
SET LOCAL search_path = conveyor;

CREATE TABLE job_events (
    id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    workspace_id uuid        NOT NULL,
    job_id       uuid        NOT NULL,
    event        text        NOT NULL CHECK (event IN ('active', 'progress', 'retrying', 'stalled')),
    attempt      integer     NOT NULL CHECK (attempt >= 1),
    at           timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- `progress`: the value the handler reported.
    progress     jsonb,
    -- `retrying`: the run's error, redacted and cut as job_failures' is.
    error        text        CHECK (char_length(error) <= 2000)
);
CREATE INDEX job_events_by_time ON job_events (workspace_id, at);
-- For maintenance's purge across workspaces: rows come in time order, so a block range index is enough, and cheap.
CREATE INDEX job_events_at ON job_events USING brin (at);

ALTER TABLE job_events ENABLE ROW LEVEL SECURITY;
ALTER TABLE job_events FORCE ROW LEVEL SECURITY;
CREATE POLICY workspace_isolation ON job_events
    USING (workspace_id = conveyor_current_workspace())
    WITH CHECK (workspace_id = conveyor_current_workspace());

-- An open subscription to events other than ends, kept alive by its subscriber (it expires unless renewed: a
-- subscription renews a one-minute lease). A row that claims to live longer than two minutes is not one: the workers
-- ignore it, and maintenance removes it.
CREATE TABLE event_listeners (
    id           uuid        PRIMARY KEY,
    workspace_id uuid        NOT NULL,
    -- Whether it wants `active` events, which only its workspace's subscriptions make the workers write.
    active       boolean     NOT NULL,
    expires_at   timestamptz NOT NULL
);
CREATE INDEX event_listeners_by_expiry ON event_listeners (expires_at);

ALTER TABLE event_listeners ENABLE ROW LEVEL SECURITY;
ALTER TABLE event_listeners FORCE ROW LEVEL SECURITY;
CREATE POLICY workspace_isolation ON event_listeners
    USING (workspace_id = conveyor_current_workspace())
    WITH CHECK (workspace_id = conveyor_current_workspace());

DO $$
BEGIN
    EXECUTE format('CREATE POLICY owner_scan ON job_events FOR SELECT TO %I USING (true)', current_user);
    EXECUTE format('CREATE POLICY owner_scan ON event_listeners FOR SELECT TO %I USING (true)', current_user);
END
$$;

-- The workspaces where a subscription to events other than ends is open now, and whether one wants `active` events:
-- ids only.
CREATE FUNCTION conveyor_event_listened_workspaces()
    RETURNS TABLE (workspace_id uuid, active boolean)
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, conveyor, pg_temp
    AS $$
        SELECT l.workspace_id, pg_catalog.bool_or(l.active) FROM conveyor.event_listeners l
        WHERE l.expires_at > pg_catalog.now() AND l.expires_at <= pg_catalog.now() + interval '2 minutes'
        GROUP BY l.workspace_id
    $$;
REVOKE ALL ON FUNCTION conveyor_event_listened_workspaces() FROM PUBLIC;

-- Maintenance: removes events older than an hour, at most max_rows, and subscriptions that expired (or claim to live
-- longer than a subscription does), in every workspace; how many in all.
CREATE FUNCTION conveyor_job_events_purge(max_rows integer)
    RETURNS bigint
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, conveyor, pg_temp
    AS $$
    DECLARE
        purged bigint := 0;
        n bigint;
        ws uuid;
        caller text := pg_catalog.current_setting('app.workspace_id', true);
    BEGIN
        -- Writes are walled off by workspace even for the owner (FORCE ROW LEVEL SECURITY): one statement each.
        FOR ws IN
            SELECT DISTINCT v.workspace_id FROM (
                SELECT e.workspace_id FROM conveyor.job_events e
                WHERE e.at < pg_catalog.now() - interval '1 hour'
                LIMIT GREATEST(1, LEAST(max_rows, 10000))) v
        LOOP
            EXIT WHEN purged >= max_rows;
            PERFORM pg_catalog.set_config('app.workspace_id', ws::text, true);
            DELETE FROM conveyor.job_events e
            WHERE e.id = ANY (ARRAY(
                SELECT o.id FROM conveyor.job_events o
                WHERE o.workspace_id = ws AND o.at < pg_catalog.now() - interval '1 hour'
                LIMIT GREATEST(1, max_rows - purged)));
            GET DIAGNOSTICS n = ROW_COUNT;
            purged := purged + n;
        END LOOP;
        FOR ws IN
            SELECT DISTINCT l.workspace_id FROM conveyor.event_listeners l
            WHERE l.expires_at < pg_catalog.now() - interval '1 minute'
               OR l.expires_at > pg_catalog.now() + interval '2 minutes'
        LOOP
            PERFORM pg_catalog.set_config('app.workspace_id', ws::text, true);
            DELETE FROM conveyor.event_listeners l
            WHERE l.workspace_id = ws
              AND (l.expires_at < pg_catalog.now() - interval '1 minute'
                   OR l.expires_at > pg_catalog.now() + interval '2 minutes');
            GET DIAGNOSTICS n = ROW_COUNT;
            purged := purged + n;
        END LOOP;
        PERFORM pg_catalog.set_config('app.workspace_id', coalesce(caller, ''), true);
        RETURN purged;
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_job_events_purge(integer) FROM PUBLIC;

-- A worker or a maintenance process of this release may run before `conveyor migrate` has granted the new functions
-- and tables (a host that runs the migrations itself, then grants): each function goes to every role that may call the
-- runtime's function it stands beside, and the tables to every role that may write jobs (a progress writes an event).
DO $$
DECLARE
    granted text;
    grantee text;
BEGIN
    FOREACH granted IN ARRAY ARRAY['conveyor.conveyor_event_listened_workspaces()',
                                   'conveyor.conveyor_job_events_purge(integer)'] LOOP
        FOR grantee IN
            SELECT DISTINCT r.rolname
            FROM pg_catalog.pg_proc p
            CROSS JOIN LATERAL pg_catalog.aclexplode(p.proacl) AS a
            JOIN pg_catalog.pg_roles r ON r.oid = a.grantee
            WHERE p.oid = 'conveyor.conveyor_expiring_workspaces(integer)'::pg_catalog.regprocedure
              AND a.privilege_type = 'EXECUTE' AND r.rolname <> current_user
        LOOP
            EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION %s TO %I', granted, grantee);
        END LOOP;
    END LOOP;
    FOR grantee IN
        SELECT DISTINCT r.rolname
        FROM pg_catalog.pg_class c
        CROSS JOIN LATERAL pg_catalog.aclexplode(c.relacl) AS a
        JOIN pg_catalog.pg_roles r ON r.oid = a.grantee
        WHERE c.oid = 'conveyor.outbox_events'::pg_catalog.regclass
          AND a.privilege_type = 'INSERT' AND r.rolname <> current_user
    LOOP
        EXECUTE pg_catalog.format(
            'GRANT SELECT, INSERT, UPDATE, DELETE ON conveyor.job_events, conveyor.event_listeners TO %I', grantee);
    END LOOP;
END
$$;
