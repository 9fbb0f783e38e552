-- A parent of a flow canceled while it waited (0056) waits for nobody any more: its count goes to 0 with the
-- cancellation of its live children, so that it never reads as waiting for children it canceled.
SET LOCAL search_path = conveyor;

CREATE OR REPLACE FUNCTION conveyor_flow_parent_canceled() RETURNS trigger
    LANGUAGE plpgsql VOLATILE SECURITY INVOKER
    SET search_path = pg_catalog, conveyor, pg_temp
    AS $$
    DECLARE
        told bigint;
    BEGIN
        WITH canceled AS (
            UPDATE conveyor.outbox_events
            SET status = 'canceled', finished_at = pg_catalog.clock_timestamp(), locked_by = NULL,
                locked_until = NULL, last_error = 'its parent was canceled'
            WHERE parent_id = NEW.id AND status IN ('pending', 'dispatching', 'dispatched')
            RETURNING id, operation_id),
        operations AS (
            UPDATE conveyor.operations o
            SET status = 'canceled', error = NULL, finished_at = pg_catalog.clock_timestamp(), updated_at = pg_catalog.now()
            WHERE o.id IN (SELECT c.operation_id FROM canceled c) AND o.status IN ('queued', 'running'))
        SELECT pg_catalog.count(pg_catalog.pg_notify('conveyor_jobs_canceled', c.id::text)) INTO told
        FROM canceled c;
        -- Not a change of its status: the triggers on status do not fire again.
        UPDATE conveyor.outbox_events SET children_left = 0 WHERE id = NEW.id;
        PERFORM pg_catalog.pg_notify('conveyor_jobs_done', NEW.workspace_id::text);
        RETURN NULL;
    END
    $$;
