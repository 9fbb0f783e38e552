-- The listing trigger reads `operations` (the platform's, in `conveyor`) and runs as its caller, whose search_path is
-- the caller's own: it pins its path as the definer functions do.
SET LOCAL search_path = conveyor_shop, conveyor;

ALTER FUNCTION conveyor_listing_publication_is_final() SET search_path = pg_catalog, conveyor_shop, conveyor, pg_temp;
