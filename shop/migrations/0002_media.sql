-- Media: images uploaded (or transferred) into object storage, checked and derived by `media.process`.
--
-- A media goes awaiting_upload → processing → ready | rejected. Its bytes live in object storage under
-- `object_key` (each upload writes a new object; the row points at the last one). Completion is one conditional
-- UPDATE (`status = 'awaiting_upload' AND object_key IS NOT NULL`), so of two completions exactly one wins and the
-- other reads `operation_id`.
--
-- Derivations are keyed by content: one `media_derivations` row per (workspace, sha256 of the original), written
-- in the job's transaction; a media whose bytes were derived before points at that row and derives nothing.
SET LOCAL search_path = conveyor_shop, conveyor;

CREATE TABLE media_derivations (
    id            uuid        PRIMARY KEY,
    workspace_id  uuid        NOT NULL,
    sha256        text        NOT NULL CHECK (sha256 ~ '^[0-9a-f]{64}$'),
    content_type  text        NOT NULL,
    width         integer     NOT NULL CHECK (width > 0),
    height        integer     NOT NULL CHECK (height > 0),
    -- [{"name", "width", "height", "content_type", "size_bytes", "object_key"}]
    derivatives   jsonb       NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    UNIQUE (workspace_id, sha256),
    UNIQUE (workspace_id, id)
);

CREATE TABLE media (
    id               uuid        PRIMARY KEY,
    workspace_id     uuid        NOT NULL,
    filename         text        NOT NULL CHECK (length(filename) BETWEEN 1 AND 255),
    content_type     text        NOT NULL,
    declared_size    bigint      NOT NULL CHECK (declared_size >= 0),
    status           text        NOT NULL DEFAULT 'awaiting_upload'
                                 CHECK (status IN ('awaiting_upload', 'processing', 'ready', 'rejected')),
    -- The uploaded original, once there is one, and its size.
    object_key       text,
    uploaded_size    bigint      CHECK (uploaded_size >= 0),
    -- The `media.process` operation, set by the one completion that wins.
    operation_id     uuid,
    sha256           text        CHECK (sha256 ~ '^[0-9a-f]{64}$'),
    derivation_id    uuid,
    rejection_code   text,
    rejection_detail text,
    created_by       uuid        NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    UNIQUE (workspace_id, id),
    FOREIGN KEY (workspace_id, derivation_id) REFERENCES media_derivations (workspace_id, id),
    CHECK (status = 'awaiting_upload' OR (object_key IS NOT NULL AND operation_id IS NOT NULL)),
    CHECK ((status = 'ready') = (derivation_id IS NOT NULL)),
    CHECK ((status = 'rejected') = (rejection_code IS NOT NULL))
);

CREATE INDEX media_derivation_idx ON media (derivation_id) WHERE derivation_id IS NOT NULL;

ALTER TABLE media ENABLE ROW LEVEL SECURITY;
ALTER TABLE media FORCE ROW LEVEL SECURITY;
CREATE POLICY workspace_isolation ON media
    USING (workspace_id = conveyor_current_workspace())
    WITH CHECK (workspace_id = conveyor_current_workspace());

ALTER TABLE media_derivations ENABLE ROW LEVEL SECURITY;
ALTER TABLE media_derivations FORCE ROW LEVEL SECURITY;
CREATE POLICY workspace_isolation ON media_derivations
    USING (workspace_id = conveyor_current_workspace())
    WITH CHECK (workspace_id = conveyor_current_workspace());
