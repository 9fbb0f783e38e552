-- The shop's stores (marketplace authorizations) and their credentials, encrypted at rest with AES-256-GCM; every
-- table walled off by row-level security (FORCE holds it for the owner too).
SET LOCAL search_path = conveyor_shop, conveyor;

CREATE TABLE stores (
    id            uuid        PRIMARY KEY,
    workspace_id  uuid        NOT NULL,
    name          text        NOT NULL CHECK (length(name) BETWEEN 1 AND 200),
    platform      text        NOT NULL,
    status        text        NOT NULL DEFAULT 'pending_verification'
                              CHECK (status IN ('pending_verification', 'active', 'invalid_credentials')),
    status_detail text,
    created_by    uuid        NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    verified_at   timestamptz,
    UNIQUE (workspace_id, id)
);

CREATE TABLE store_credentials (
    store_id       uuid        PRIMARY KEY,
    workspace_id   uuid        NOT NULL,
    key_id         text        NOT NULL,   -- which encryption key sealed it
    nonce          bytea       NOT NULL CHECK (length(nonce) = 12),
    ciphertext     bytea       NOT NULL,   -- AES-256-GCM of the JSON credentials, AAD = workspace_id || store_id
    version        integer     NOT NULL DEFAULT 1,
    updated_at     timestamptz NOT NULL DEFAULT now(),
    FOREIGN KEY (workspace_id, store_id) REFERENCES stores (workspace_id, id) ON DELETE CASCADE
);

ALTER TABLE stores ENABLE ROW LEVEL SECURITY;
ALTER TABLE stores FORCE ROW LEVEL SECURITY;
CREATE POLICY workspace_isolation ON stores
    USING (workspace_id = conveyor_current_workspace())
    WITH CHECK (workspace_id = conveyor_current_workspace());

ALTER TABLE store_credentials ENABLE ROW LEVEL SECURITY;
ALTER TABLE store_credentials FORCE ROW LEVEL SECURITY;
CREATE POLICY workspace_isolation ON store_credentials
    USING (workspace_id = conveyor_current_workspace())
    WITH CHECK (workspace_id = conveyor_current_workspace());

