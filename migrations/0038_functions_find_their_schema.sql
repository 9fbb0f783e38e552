-- Every function that reads or writes a table finds it, and every function it calls, in `conveyor` or `pg_catalog`,
-- whatever the caller's search_path: a service calls them from its own connections, whose path is its own (`public`
-- first, usually), and a role that may create objects there could otherwise plant a better match for a built-in they
-- call (`public.unnest(uuid[])` beats `pg_catalog.unnest(anyarray)`). The definer functions pinned theirs in 0034;
-- these run as their caller (SECURITY INVOKER, under its row-level security) and pin theirs now.
-- `conveyor_current_workspace`, `conveyor_uuid_v7` and `conveyor_job_state` read no table and call only built-ins
-- with exactly typed arguments, which `pg_catalog`, searched first, answers; they stay unpinned, so that PostgreSQL
-- can still inline them (the first one in every row-level security policy).
SET LOCAL search_path = conveyor;

ALTER FUNCTION conveyor_enqueue(text, jsonb, timestamptz, text, text, integer, uuid)
    SET search_path = pg_catalog, conveyor, pg_temp;
ALTER FUNCTION conveyor_complete_jobs(uuid[], uuid[], integer[], jsonb[])
    SET search_path = pg_catalog, conveyor, pg_temp;
ALTER FUNCTION conveyor_claim_outbox(uuid[], text, double precision, integer)
    SET search_path = pg_catalog, conveyor, pg_temp;
ALTER FUNCTION conveyor_claim_jobs(uuid[], text, double precision, integer)
    SET search_path = pg_catalog, conveyor, pg_temp;
ALTER FUNCTION conveyor_claim_jobs_fair(uuid[], text, double precision, integer, integer)
    SET search_path = pg_catalog, conveyor, pg_temp;
ALTER FUNCTION conveyor_claim_jobs_fair(uuid[], text, double precision, integer, integer, uuid[])
    SET search_path = pg_catalog, conveyor, pg_temp;
ALTER FUNCTION conveyor_mark_outbox_dispatched(text, uuid[], tid[], uuid[], text[])
    SET search_path = pg_catalog, conveyor, pg_temp;
ALTER FUNCTION conveyor_mark_outbox_dispatched(text, uuid[], tid[], uuid[], integer[], text[])
    SET search_path = pg_catalog, conveyor, pg_temp;
-- The operator's two helpers had `public, pg_temp` (0025), `conveyor, pg_temp` since the move: `pg_catalog` was first
-- only implicitly. Written out, as everywhere else.
ALTER FUNCTION conveyor_admin_check_limit(integer) SET search_path = pg_catalog, conveyor, pg_temp;
ALTER FUNCTION conveyor_admin_state_condition(text) SET search_path = pg_catalog, conveyor, pg_temp;
