-- A transfer's source URL may carry a token (a presigned URL): it is kept only while the transfer may still need it.
-- Completion and failure set it to NULL in the same UPDATE that ends the transfer; the job never reads it afterwards.
SET LOCAL search_path = conveyor_shop, conveyor;

ALTER TABLE asset_transfers ALTER COLUMN source_url DROP NOT NULL;

-- Transfers that ended before this migration forget theirs too (as far as the migrating role sees them).
UPDATE asset_transfers SET source_url = NULL WHERE status IN ('completed', 'failed');
