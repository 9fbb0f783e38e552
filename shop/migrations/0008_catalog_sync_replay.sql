-- A replayed `catalog.sync` (its dead-lettered operation back to `queued`) is its store's active sync again. If the
-- store has another active sync meanwhile, the unique index refuses, and with it the replay: two syncs of a store
-- never run at once.
SET LOCAL search_path = conveyor_shop, conveyor;

CREATE FUNCTION conveyor_catalog_sync_replayed() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, conveyor_shop, conveyor
    AS $$
BEGIN
    UPDATE catalog_syncs SET active = true, finished_at = NULL, updated_at = now()
    WHERE operation_id = NEW.id AND NOT active;
    RETURN NULL;
END
$$;
REVOKE ALL ON FUNCTION conveyor_catalog_sync_replayed() FROM PUBLIC;

CREATE TRIGGER catalog_sync_replayed
    AFTER UPDATE OF status ON operations
    FOR EACH ROW
    WHEN (NEW.kind = 'catalog.sync' AND NEW.status = 'queued' AND OLD.status IN ('succeeded', 'failed', 'canceled'))
    EXECUTE FUNCTION conveyor_catalog_sync_replayed();
