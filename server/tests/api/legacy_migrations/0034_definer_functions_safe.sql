-- Definer functions written safely (PostgreSQL's "Writing SECURITY DEFINER Functions Safely").
--
-- A SECURITY DEFINER function runs as the owner. Until now most of Conveyor's ran with
-- `search_path = pg_catalog, public`: when `pg_temp` is not in the path, PostgreSQL searches the caller's temporary
-- schema FIRST for relations, so a temporary table or view of the caller's own, named like a table such a function
-- reads or writes (`asset_transfers`, `catalog_syncs`, `outbox_events`, ...), took its place, and the caller's trigger
-- or view function then ran as the owner. From the application role it turned row-level security off on every tenant
-- table through the catalog and transfer triggers; from the runtime role through any of its lookups. The operator's
-- functions had `public, pg_temp`: `pg_temp` last, but `public` before `pg_catalog`.
--
-- Every definer function now searches `pg_catalog` first, then `public`, then `pg_temp`, explicitly last (functions
-- and operators are never looked up in `pg_temp`). `conveyor migrate` refuses roles that may create objects in the
-- schema of these functions, so nothing in the path is writable by the roles that call them; tests/definer.rs plants
-- shadowing temporary views for every relation each reachable definer function names, as each role, and fails if
-- one runs as the owner. The three trigger functions are also rewritten with every relation schema-qualified.
ALTER FUNCTION conveyor_due_outbox_workspaces(integer) SET search_path = pg_catalog, public, pg_temp;
ALTER FUNCTION conveyor_expired_idempotency_workspaces(integer) SET search_path = pg_catalog, public, pg_temp;
ALTER FUNCTION conveyor_outbox_backlog() SET search_path = pg_catalog, public, pg_temp;
ALTER FUNCTION conveyor_outbox_retention_workspaces(interval,integer) SET search_path = pg_catalog, public, pg_temp;
ALTER FUNCTION conveyor_stalled_operation_workspaces(interval,integer) SET search_path = pg_catalog, public, pg_temp;
ALTER FUNCTION conveyor_event_by_stream_id(text,text) SET search_path = pg_catalog, public, pg_temp;
ALTER FUNCTION conveyor_next_due_at() SET search_path = pg_catalog, public, pg_temp;
ALTER FUNCTION conveyor_outbox_retention_workspaces_v2(interval,integer) SET search_path = pg_catalog, public, pg_temp;
ALTER FUNCTION conveyor_unattended_dispatched_workspaces(interval,integer) SET search_path = pg_catalog, public, pg_temp;
ALTER FUNCTION conveyor_due_schedules(integer) SET search_path = pg_catalog, public, pg_temp;
ALTER FUNCTION conveyor_next_schedule_at() SET search_path = pg_catalog, public, pg_temp;
ALTER FUNCTION conveyor_admin_audit_write(text,text,jsonb) SET search_path = pg_catalog, public, pg_temp;
ALTER FUNCTION conveyor_admin_queues(text,text) SET search_path = pg_catalog, public, pg_temp;
ALTER FUNCTION conveyor_admin_jobs(text,text,text,text,uuid,timestamp with time zone,timestamp with time zone,uuid,integer) SET search_path = pg_catalog, public, pg_temp;
ALTER FUNCTION conveyor_admin_job(text,uuid) SET search_path = pg_catalog, public, pg_temp;
ALTER FUNCTION conveyor_admin_locate_job(text,uuid) SET search_path = pg_catalog, public, pg_temp;
ALTER FUNCTION conveyor_admin_operations(text,text,text,uuid,timestamp with time zone,timestamp with time zone,uuid,integer) SET search_path = pg_catalog, public, pg_temp;
ALTER FUNCTION conveyor_admin_dead_letters(text,text,text,text,uuid,timestamp with time zone,timestamp with time zone,uuid,integer) SET search_path = pg_catalog, public, pg_temp;
ALTER FUNCTION conveyor_admin_schedules(text,uuid) SET search_path = pg_catalog, public, pg_temp;
ALTER FUNCTION conveyor_admin_audit_trail(text,integer) SET search_path = pg_catalog, public, pg_temp;
ALTER FUNCTION conveyor_admin_pauses(text) SET search_path = pg_catalog, public, pg_temp;
ALTER FUNCTION conveyor_audit_purge(interval,integer) SET search_path = pg_catalog, public, pg_temp;
ALTER FUNCTION conveyor_outbox_backlog_due() SET search_path = pg_catalog, public, pg_temp;
ALTER FUNCTION conveyor_due_workspaces(integer) SET search_path = pg_catalog, public, pg_temp;
ALTER FUNCTION conveyor_next_due_after(timestamp with time zone) SET search_path = pg_catalog, public, pg_temp;

CREATE OR REPLACE FUNCTION conveyor_asset_transfer_ended() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path = pg_catalog, public, pg_temp
    AS $$
    BEGIN
        UPDATE public.asset_transfers SET source_url = NULL
        WHERE id = NEW.subject_id AND workspace_id = NEW.workspace_id AND source_url IS NOT NULL;
        RETURN NULL;
    END
    $$;

CREATE OR REPLACE FUNCTION conveyor_catalog_sync_ended() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path = pg_catalog, public, pg_temp
    AS $$
    BEGIN
        UPDATE public.catalog_syncs SET active = false, finished_at = pg_catalog.now(), updated_at = pg_catalog.now()
        WHERE operation_id = NEW.id AND active;
        RETURN NULL;
    END
    $$;

CREATE OR REPLACE FUNCTION conveyor_catalog_sync_replayed() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path = pg_catalog, public, pg_temp
    AS $$
    BEGIN
        UPDATE public.catalog_syncs SET active = true, finished_at = NULL, updated_at = pg_catalog.now()
        WHERE operation_id = NEW.id AND NOT active;
        RETURN NULL;
    END
    $$;
