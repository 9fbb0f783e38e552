-- Review fixes of the listings and AI-task scenarios.
--
-- Listings: a listing's marketplace idempotency key is fixed at its first publication (`publication_key`, the first
-- `listing.publish` operation's id, never changing). A publication whose operation ended `failed` or `canceled`
-- without a product (`publish_failed`) may be followed by a new one: `publish_operation_id` may change, but only away
-- from an operation that ended so, and only while no product is recorded. Every publication of the listing calls the
-- marketplace with the same key, so a product made by a call whose answer was lost (a cancel mid-call) is the product
-- a later publication gets back and records: one product per listing, ever.
--
-- AI tasks: a task whose provider call was sent may have been charged, whatever becomes of its operation. The job
-- counts, in a transaction of its own committed before each call, the calls it starts (`provider_calls_started`), and
-- after a call the provider answered without running it (a refusal, a 429, a connection never made) it counts that too
-- (`provider_calls_not_run`). A reservation is given back only while both counts are equal: a task canceled or
-- dead-lettered after a call that may have run keeps its credits, so the quota cannot be bypassed by cancelling.
SET LOCAL search_path = conveyor_shop, conveyor;

ALTER TABLE listings ADD COLUMN publication_key uuid;
-- Every workspace's rows: the owner, who runs migrations, is subject to row-level security only while it is FORCEd.
ALTER TABLE listings NO FORCE ROW LEVEL SECURITY;
UPDATE listings SET publication_key = publish_operation_id WHERE publish_operation_id IS NOT NULL;
ALTER TABLE listings FORCE ROW LEVEL SECURITY;
ALTER TABLE listings ADD CONSTRAINT listings_publication_key_with_publication
    CHECK ((publication_key IS NULL) = (publish_operation_id IS NULL));

CREATE OR REPLACE FUNCTION conveyor_listing_publication_is_final() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
DECLARE
    previous_status text;
BEGIN
    IF OLD.publication_key IS NOT NULL AND NEW.publication_key IS DISTINCT FROM OLD.publication_key THEN
        RAISE EXCEPTION 'listing % already has its publication key', OLD.id
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    IF OLD.publish_operation_id IS NOT NULL
       AND NEW.publish_operation_id IS DISTINCT FROM OLD.publish_operation_id THEN
        SELECT status INTO previous_status FROM operations WHERE id = OLD.publish_operation_id;
        IF NEW.publish_operation_id IS NULL
           OR OLD.marketplace_product_id IS NOT NULL
           OR previous_status IS NULL
           OR previous_status NOT IN ('failed', 'canceled') THEN
            RAISE EXCEPTION 'listing % already has its publication %', OLD.id, OLD.publish_operation_id
                USING ERRCODE = 'integrity_constraint_violation';
        END IF;
    END IF;
    IF OLD.marketplace_product_id IS NOT NULL
       AND NEW.marketplace_product_id IS DISTINCT FROM OLD.marketplace_product_id THEN
        RAISE EXCEPTION 'listing % is already published as a marketplace product', OLD.id
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    RETURN NEW;
END
$$;

ALTER TABLE ai_tasks
    ADD COLUMN provider_calls_started integer NOT NULL DEFAULT 0 CHECK (provider_calls_started >= 0),
    ADD COLUMN provider_calls_not_run integer NOT NULL DEFAULT 0 CHECK (provider_calls_not_run >= 0),
    ADD CONSTRAINT ai_tasks_calls_not_run_were_started CHECK (provider_calls_not_run <= provider_calls_started);
