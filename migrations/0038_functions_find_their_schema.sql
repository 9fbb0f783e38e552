-- Every function that reads or writes a table finds it in the schema `conveyor`, whatever the caller's search_path:
-- a service calls them from its own connections, whose path is its own (`public` first, usually). The definer
-- functions pinned theirs in 0034; these two run as their caller (SECURITY INVOKER, under its row-level security)
-- and pin theirs now. `conveyor_current_workspace`, `conveyor_uuid_v7` and `conveyor_job_state` read no table and
-- stay unpinned, so that PostgreSQL can still inline them (the first one in every row-level security policy).
SET LOCAL search_path = conveyor;

ALTER FUNCTION conveyor_enqueue(text, jsonb, timestamptz, text, text, integer, uuid)
    SET search_path = pg_catalog, conveyor, pg_temp;
ALTER FUNCTION conveyor_complete_jobs(uuid[], uuid[], integer[], jsonb[])
    SET search_path = pg_catalog, conveyor, pg_temp;
