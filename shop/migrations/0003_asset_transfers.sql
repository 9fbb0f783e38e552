-- Asset transfers: a source URL downloaded into object storage, which then becomes a media.
--
-- A transfer goes queued → transferring → completed | failed. While it transfers, every stored part commits its
-- progress here (`bytes_done`, `parts`), in a transaction of its own, so a run after a crash resumes from the last
-- committed part with an HTTP Range request (`validator`: the source's ETag or Last-Modified, sent as If-Range).
-- Completion (sha256, media_id) commits in the job's transaction together with the media it creates.
SET LOCAL search_path = conveyor_shop, conveyor;

CREATE TABLE asset_transfers (
    id            uuid        PRIMARY KEY,
    workspace_id  uuid        NOT NULL,
    source_url    text        NOT NULL CHECK (length(source_url) BETWEEN 1 AND 2048),
    filename      text        NOT NULL CHECK (length(filename) BETWEEN 1 AND 255),
    status        text        NOT NULL DEFAULT 'queued'
                              CHECK (status IN ('queued', 'transferring', 'completed', 'failed')),
    bytes_total   bigint      CHECK (bytes_total >= 0),
    bytes_done    bigint      NOT NULL DEFAULT 0 CHECK (bytes_done >= 0),
    parts         integer     NOT NULL DEFAULT 0 CHECK (parts >= 0),
    content_type  text,
    validator     text,
    sha256        text        CHECK (sha256 ~ '^[0-9a-f]{64}$'),
    media_id      uuid,
    error_code    text,
    error_detail  text,
    created_by    uuid        NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    completed_at  timestamptz,
    UNIQUE (workspace_id, id),
    FOREIGN KEY (workspace_id, media_id) REFERENCES media (workspace_id, id),
    CHECK ((status = 'completed') = (sha256 IS NOT NULL AND media_id IS NOT NULL)),
    CHECK ((status = 'failed') = (error_code IS NOT NULL))
);

ALTER TABLE asset_transfers ENABLE ROW LEVEL SECURITY;
ALTER TABLE asset_transfers FORCE ROW LEVEL SECURITY;
CREATE POLICY workspace_isolation ON asset_transfers
    USING (workspace_id = conveyor_current_workspace())
    WITH CHECK (workspace_id = conveyor_current_workspace());
