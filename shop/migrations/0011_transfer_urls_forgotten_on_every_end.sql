-- A transfer's source URL (which may carry a token) is forgotten however the transfer ends. 0018 cleared it when the
-- job ends the transfer, and for transfers ended before it as far as the migrating role saw them under row-level
-- security; this clears the rest of those, and the URL of a transfer whose operation ends without its job (canceled
-- before it ran, dead-lettered), by a trigger on the operation's end like the catalog sync's (0015).
SET LOCAL search_path = conveyor_shop, conveyor;

ALTER TABLE asset_transfers NO FORCE ROW LEVEL SECURITY;
UPDATE asset_transfers SET source_url = NULL WHERE status IN ('completed', 'failed') AND source_url IS NOT NULL;
ALTER TABLE asset_transfers FORCE ROW LEVEL SECURITY;

DO $$
BEGIN
    EXECUTE format('CREATE POLICY owner_end ON asset_transfers FOR ALL TO %I USING (true) WITH CHECK (true)',
                   current_user);
END
$$;

CREATE FUNCTION conveyor_asset_transfer_ended() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, conveyor_shop, conveyor
    AS $$
BEGIN
    UPDATE asset_transfers SET source_url = NULL
    WHERE id = NEW.subject_id AND workspace_id = NEW.workspace_id AND source_url IS NOT NULL;
    RETURN NULL;
END
$$;
REVOKE ALL ON FUNCTION conveyor_asset_transfer_ended() FROM PUBLIC;

CREATE TRIGGER asset_transfer_ended
    AFTER UPDATE OF status ON operations
    FOR EACH ROW
    WHEN (NEW.kind = 'asset.transfer' AND NEW.status IN ('failed', 'canceled')
          AND OLD.status IS DISTINCT FROM NEW.status)
    EXECUTE FUNCTION conveyor_asset_transfer_ended();
