-- A resource's operations, found by the resource: a transfer whose operation ended (canceled before its job ran, or
-- failed for good) reads as failed from it.
SET LOCAL search_path = conveyor;

CREATE INDEX operations_by_subject ON operations (workspace_id, subject_id) WHERE subject_id IS NOT NULL;
