-- Listings and their first publication to the store's marketplace (`listing.publish`).
--
-- A listing goes draft → publishing → published. Publishing is one conditional UPDATE of a row the request has
-- locked (`publish_operation_id IS NULL`), so of concurrent publishes exactly one sets the operation and the others
-- read it; once set, the trigger below keeps `publish_operation_id` and `marketplace_product_id` from ever changing,
-- so no code path can start a second publication of a listing or swap its product. A publication that ends without
-- success (refused, out of attempts, canceled) is read as `publish_failed` from its operation: the platform records
-- that end on the operation, in a transaction the handler's own writes do not survive.
--
-- Prices are exact: minor units of the currency (`price_minor`, e.g. 1250 for 12.50 EUR), never a float.

CREATE TABLE listings (
    id                     uuid        PRIMARY KEY,
    workspace_id           uuid        NOT NULL,
    store_id               uuid        NOT NULL,
    title                  text        NOT NULL CHECK (length(title) BETWEEN 1 AND 200),
    description            text        NOT NULL CHECK (length(description) <= 10000),
    price_minor            bigint      NOT NULL CHECK (price_minor > 0),
    currency               text        NOT NULL CHECK (currency ~ '^[A-Z]{3}$'),
    status                 text        NOT NULL DEFAULT 'draft'
                                       CHECK (status IN ('draft', 'publishing', 'published')),
    -- The one `listing.publish` operation, set by the one publish that wins.
    publish_operation_id   uuid        REFERENCES operations (id),
    -- The marketplace's id of the product, once the job has recorded it.
    marketplace_product_id text        CHECK (length(marketplace_product_id) BETWEEN 1 AND 200),
    created_by             uuid        NOT NULL,
    created_at             timestamptz NOT NULL DEFAULT now(),
    updated_at             timestamptz NOT NULL DEFAULT now(),
    published_at           timestamptz,
    UNIQUE (workspace_id, id),
    UNIQUE (publish_operation_id),
    FOREIGN KEY (workspace_id, store_id) REFERENCES stores (workspace_id, id),
    CHECK ((status = 'draft') = (publish_operation_id IS NULL)),
    CHECK ((status = 'published') = (marketplace_product_id IS NOT NULL)),
    CHECK ((status = 'published') = (published_at IS NOT NULL))
);
CREATE INDEX listings_store ON listings (workspace_id, store_id);

-- The listing's media, in order. The foreign keys carry the workspace, so a listing can only name media of its own
-- workspace whatever the session's setting.
CREATE TABLE listing_media (
    listing_id   uuid     NOT NULL,
    workspace_id uuid     NOT NULL,
    media_id     uuid     NOT NULL,
    position     smallint NOT NULL CHECK (position >= 0),
    PRIMARY KEY (listing_id, position),
    UNIQUE (listing_id, media_id),
    FOREIGN KEY (workspace_id, listing_id) REFERENCES listings (workspace_id, id) ON DELETE CASCADE,
    FOREIGN KEY (workspace_id, media_id) REFERENCES media (workspace_id, id)
);
CREATE INDEX listing_media_media ON listing_media (media_id);

-- One publication per listing, and one product: once set, neither the operation nor the product id changes.
CREATE FUNCTION conveyor_listing_publication_is_final() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    IF OLD.publish_operation_id IS NOT NULL
       AND NEW.publish_operation_id IS DISTINCT FROM OLD.publish_operation_id THEN
        RAISE EXCEPTION 'listing % already has its publication %', OLD.id, OLD.publish_operation_id
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    IF OLD.marketplace_product_id IS NOT NULL
       AND NEW.marketplace_product_id IS DISTINCT FROM OLD.marketplace_product_id THEN
        RAISE EXCEPTION 'listing % is already published as a marketplace product', OLD.id
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER listings_publication_is_final BEFORE UPDATE ON listings
    FOR EACH ROW EXECUTE FUNCTION conveyor_listing_publication_is_final();

ALTER TABLE listings ENABLE ROW LEVEL SECURITY;
ALTER TABLE listings FORCE ROW LEVEL SECURITY;
CREATE POLICY workspace_isolation ON listings
    USING (workspace_id = conveyor_current_workspace())
    WITH CHECK (workspace_id = conveyor_current_workspace());

ALTER TABLE listing_media ENABLE ROW LEVEL SECURITY;
ALTER TABLE listing_media FORCE ROW LEVEL SECURITY;
CREATE POLICY workspace_isolation ON listing_media
    USING (workspace_id = conveyor_current_workspace())
    WITH CHECK (workspace_id = conveyor_current_workspace());
