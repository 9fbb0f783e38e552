-- Catalog full sync (`catalog.sync`): a store's products copied from its marketplace, page by page.
--
-- One active sync per store is a partial unique index on `active`, so the database decides between concurrent
-- requests. A sync's status is its operation's (queued, running, succeeded, failed, canceled); when the operation
-- ends, by any path (success, dead letter, cancel), the trigger below clears `active`, so the next sync can start.
-- The job commits the marketplace's cursor with each page of products, so a crash resumes after the last page
-- committed; products that the last sync did not see are marked removed, never deleted.
SET LOCAL search_path = conveyor_shop, conveyor;

CREATE TABLE catalog_syncs (
    id            uuid        PRIMARY KEY,
    workspace_id  uuid        NOT NULL,
    store_id      uuid        NOT NULL,
    operation_id  uuid        NOT NULL UNIQUE REFERENCES operations (id),
    active        boolean     NOT NULL DEFAULT true,
    -- Where the next page starts (the marketplace's cursor); NULL before the first page.
    cursor        text        CHECK (length(cursor) <= 1024),
    -- Every page has been read and committed: only the removal of unseen products is left.
    listed        boolean     NOT NULL DEFAULT false,
    pages_done    integer     NOT NULL DEFAULT 0 CHECK (pages_done >= 0),
    items_done    bigint      NOT NULL DEFAULT 0 CHECK (items_done >= 0),
    items_total   bigint      CHECK (items_total >= 0),
    items_removed bigint      CHECK (items_removed >= 0),
    created_by    uuid        NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    finished_at   timestamptz,
    UNIQUE (workspace_id, id),
    FOREIGN KEY (workspace_id, store_id) REFERENCES stores (workspace_id, id) ON DELETE CASCADE
);
CREATE UNIQUE INDEX catalog_syncs_one_active_per_store ON catalog_syncs (workspace_id, store_id) WHERE active;

CREATE TABLE store_products (
    workspace_id uuid          NOT NULL,
    store_id     uuid          NOT NULL,
    external_id  text          NOT NULL CHECK (length(external_id) BETWEEN 1 AND 200),
    title        text          NOT NULL CHECK (length(title) <= 500),
    -- Exactly as the marketplace wrote it: a decimal string, never a float.
    price        text          NOT NULL CHECK (price ~ '^[0-9]{1,16}(\.[0-9]{1,4})?$'),
    currency     text          NOT NULL CHECK (currency ~ '^[A-Z]{3}$'),
    -- The sync that last saw it; a finished sync marks every product it did not see removed.
    last_sync_id uuid          NOT NULL,
    synced_at    timestamptz   NOT NULL DEFAULT now(),
    removed_at   timestamptz,
    PRIMARY KEY (workspace_id, store_id, external_id),
    FOREIGN KEY (workspace_id, store_id) REFERENCES stores (workspace_id, id) ON DELETE CASCADE
);

ALTER TABLE catalog_syncs ENABLE ROW LEVEL SECURITY;
ALTER TABLE catalog_syncs FORCE ROW LEVEL SECURITY;
CREATE POLICY workspace_isolation ON catalog_syncs
    USING (workspace_id = conveyor_current_workspace())
    WITH CHECK (workspace_id = conveyor_current_workspace());

ALTER TABLE store_products ENABLE ROW LEVEL SECURITY;
ALTER TABLE store_products FORCE ROW LEVEL SECURITY;
CREATE POLICY workspace_isolation ON store_products
    USING (workspace_id = conveyor_current_workspace())
    WITH CHECK (workspace_id = conveyor_current_workspace());

-- The end of a sync's operation frees its store for the next sync, whichever path ended it and whatever workspace
-- the ending transaction has set. The function runs as the owner, who alone may end any workspace's sync, and touches
-- only the sync of the operation that ended.
DO $$
BEGIN
    EXECUTE format('CREATE POLICY owner_end ON catalog_syncs FOR ALL TO %I USING (true) WITH CHECK (true)', current_user);
END
$$;

CREATE FUNCTION conveyor_catalog_sync_ended() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, conveyor_shop, conveyor
    AS $$
BEGIN
    UPDATE catalog_syncs SET active = false, finished_at = now(), updated_at = now()
    WHERE operation_id = NEW.id AND active;
    RETURN NULL;
END
$$;
REVOKE ALL ON FUNCTION conveyor_catalog_sync_ended() FROM PUBLIC;

CREATE TRIGGER catalog_sync_ended
    AFTER UPDATE OF status ON operations
    FOR EACH ROW
    WHEN (NEW.kind = 'catalog.sync' AND NEW.status IN ('succeeded', 'failed', 'canceled')
          AND OLD.status IS DISTINCT FROM NEW.status)
    EXECUTE FUNCTION conveyor_catalog_sync_ended();
