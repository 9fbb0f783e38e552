-- Product drafts (CONTRACT §2.3): edited by people, guarded by a revision instead of an idempotency key. Every write
-- is one conditional statement on (id, revision), so of two writers holding the same revision exactly one wins.
CREATE TABLE product_drafts (
    id           uuid        PRIMARY KEY,
    workspace_id uuid        NOT NULL,
    title        text        NOT NULL CHECK (char_length(title) BETWEEN 1 AND 200),
    description  text        NOT NULL DEFAULT '' CHECK (char_length(description) <= 20000),
    attributes   jsonb       NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(attributes) = 'object'),
    revision     bigint      NOT NULL DEFAULT 1 CHECK (revision >= 1),
    created_by   uuid        NOT NULL,
    updated_by   uuid        NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX product_drafts_by_workspace ON product_drafts (workspace_id, id);

ALTER TABLE product_drafts ENABLE ROW LEVEL SECURITY;
ALTER TABLE product_drafts FORCE ROW LEVEL SECURITY;
CREATE POLICY workspace_isolation ON product_drafts
    USING (workspace_id = conveyor_current_workspace())
    WITH CHECK (workspace_id = conveyor_current_workspace());
