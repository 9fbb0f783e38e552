-- Definer functions written safely (PostgreSQL's "Writing SECURITY DEFINER Functions Safely"): a SECURITY DEFINER
-- function runs as the owner, and when `pg_temp` is not in its path PostgreSQL searches the caller's temporary schema
-- FIRST for relations, so a temporary table of the caller's own named like one these triggers write took its place.
-- The three trigger functions are rewritten with `pg_temp` explicitly last and every relation schema-qualified.
SET LOCAL search_path = conveyor_shop, conveyor;

CREATE OR REPLACE FUNCTION conveyor_asset_transfer_ended() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path = pg_catalog, conveyor_shop, conveyor, pg_temp
    AS $$
    BEGIN
        UPDATE conveyor_shop.asset_transfers SET source_url = NULL
        WHERE id = NEW.subject_id AND workspace_id = NEW.workspace_id AND source_url IS NOT NULL;
        RETURN NULL;
    END
    $$;

CREATE OR REPLACE FUNCTION conveyor_catalog_sync_ended() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path = pg_catalog, conveyor_shop, conveyor, pg_temp
    AS $$
    BEGIN
        UPDATE conveyor_shop.catalog_syncs SET active = false, finished_at = pg_catalog.now(), updated_at = pg_catalog.now()
        WHERE operation_id = NEW.id AND active;
        RETURN NULL;
    END
    $$;

CREATE OR REPLACE FUNCTION conveyor_catalog_sync_replayed() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path = pg_catalog, conveyor_shop, conveyor, pg_temp
    AS $$
    BEGIN
        UPDATE conveyor_shop.catalog_syncs SET active = true, finished_at = NULL, updated_at = pg_catalog.now()
        WHERE operation_id = NEW.id AND NOT active;
        RETURN NULL;
    END
    $$;
