-- Repeatable jobs (cron or every-N schedules). A schedule belongs to a workspace and is walled off by row-level
-- security like every tenant table. A tick fires at most once: the dispatcher that fires it inserts the
-- job_schedule_runs row (primary key: schedule and tick) in the same transaction as the job's outbox row and the
-- advance of the schedule's next_run_at, with the schedule row locked FOR UPDATE SKIP LOCKED.
SET LOCAL search_path = conveyor;

CREATE TABLE job_schedules (
    id            uuid        PRIMARY KEY,
    workspace_id  uuid        NOT NULL,
    name          text        NOT NULL CHECK (name ~ '^[a-z0-9][a-z0-9_.:-]{0,99}$'),
    kind          text        NOT NULL CHECK (kind ~ '^[a-z0-9][a-z0-9_.:-]{0,99}$'),
    queue         text        NOT NULL CHECK (queue ~ '^[a-z0-9][a-z0-9_.-]{0,99}$'),
    payload       jsonb       NOT NULL,              -- ids only, never secrets, as for any job
    -- The spec: a cron expression (5 or 6 fields) read in an IANA time zone, or a fixed period.
    cron          text        CHECK (length(cron) BETWEEN 1 AND 200),
    time_zone     text        CHECK (length(time_zone) BETWEEN 1 AND 64),
    every_ms      bigint      CHECK (every_ms BETWEEN 1000 AND 31622400000),
    priority      smallint    CHECK (priority BETWEEN 0 AND 2),      -- NULL: normal
    max_attempts  integer     CHECK (max_attempts BETWEEN 1 AND 1000), -- NULL: the kind's default
    paused        boolean     NOT NULL DEFAULT false,
    next_run_at   timestamptz NOT NULL,              -- the next tick to fire
    last_tick_at  timestamptz,                       -- the tick fired last
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    UNIQUE (workspace_id, name),
    CHECK ((cron IS NOT NULL AND time_zone IS NOT NULL AND every_ms IS NULL)
        OR (cron IS NULL AND time_zone IS NULL AND every_ms IS NOT NULL))
);
-- The earliest tick of all, and the due schedules, for the dispatchers.
CREATE INDEX job_schedules_next_run ON job_schedules (next_run_at) WHERE NOT paused;

-- One row per tick fired: the database's guarantee that no tick fires twice. Old rows are pruned as ticks fire.
CREATE TABLE job_schedule_runs (
    schedule_id   uuid        NOT NULL REFERENCES job_schedules (id) ON DELETE CASCADE,
    tick_at       timestamptz NOT NULL,
    workspace_id  uuid        NOT NULL,
    job_id        uuid        NOT NULL,              -- the outbox event (job) it enqueued
    fired_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (schedule_id, tick_at)
);

ALTER TABLE job_schedules ENABLE ROW LEVEL SECURITY;
ALTER TABLE job_schedules FORCE ROW LEVEL SECURITY;
CREATE POLICY workspace_isolation ON job_schedules
    USING (workspace_id = conveyor_current_workspace())
    WITH CHECK (workspace_id = conveyor_current_workspace());

ALTER TABLE job_schedule_runs ENABLE ROW LEVEL SECURITY;
ALTER TABLE job_schedule_runs FORCE ROW LEVEL SECURITY;
CREATE POLICY workspace_isolation ON job_schedule_runs
    USING (workspace_id = conveyor_current_workspace())
    WITH CHECK (workspace_id = conveyor_current_workspace());

-- The narrow holes, as for the outbox (0001): the owner may read schedules across workspaces, and reaches them only
-- through the two functions below, which return ids and a time, nothing else.
DO $$
BEGIN
    EXECUTE format('CREATE POLICY owner_scan ON job_schedules FOR SELECT TO %I USING (true)', current_user);
END
$$;

-- Due schedules (not paused, next tick reached), earliest first: (workspace, schedule) only. Each is then fired
-- under row-level security in its workspace.
CREATE FUNCTION conveyor_due_schedules(max_schedules integer)
    RETURNS TABLE (workspace_id uuid, schedule_id uuid)
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, conveyor
    AS $$
        SELECT s.workspace_id, s.id
        FROM conveyor.job_schedules s
        WHERE NOT s.paused AND s.next_run_at <= now()
        ORDER BY s.next_run_at
        LIMIT greatest(1, least(max_schedules, 10000))
    $$;
REVOKE ALL ON FUNCTION conveyor_due_schedules(integer) FROM PUBLIC;

-- The earliest next tick of any schedule that is not paused: the dispatcher sleeps until then.
CREATE FUNCTION conveyor_next_schedule_at()
    RETURNS timestamptz
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, conveyor
    AS $$
        SELECT min(s.next_run_at) FROM conveyor.job_schedules s WHERE NOT s.paused
    $$;
REVOKE ALL ON FUNCTION conveyor_next_schedule_at() FROM PUBLIC;
