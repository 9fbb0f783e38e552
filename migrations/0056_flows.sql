-- Flows: a parent job that runs once its children have ended (BullMQ's FlowProducer, River's and Oban's workflows).
--
-- A child names its parent (`parent_id`) and what its failure does to it (`child_failure`): 'fail' fails the parent
-- (the default), 'ignore' lets it run and read the failure, 'remove' lets it run as if the child had never been one.
-- A parent counts the children it still waits for (`children_left`); while it waits it is pending and due at the
-- far end of time (9999-12-31), so that the relay, which hands out due jobs only, never sees it, and no claim, index
-- or sweep had to learn about flows. A check keeps it so: a pending job that waits for children cannot be made due by
-- any statement (an operator's "run now", a promotion), it fails instead of releasing the parent early.
--
-- Every change of a child's state reaches its parent in the transaction that makes it, by the triggers below: a child
-- that ends (completed, failed, canceled, discarded, deleted while live) counts down its parent, the last one makes the
-- parent due now and wakes the dispatchers; a failure under 'fail' dead-letters the parent (and fails its operation);
-- a child sent back to live (a replayed dead letter) while its parent still waits counts up again. The parent's row
-- is locked by the update, so two children ending at once count it down one after the other: whichever transaction
-- commits, a crash either keeps both its child's end and the parent's count or neither, and a parent is released once.
-- A parent that is canceled while it waits cancels its live children (and theirs, by the same trigger).
SET LOCAL search_path = conveyor;

-- Columns without a check of their own (a check added with its column is verified by a scan of the table, under the
-- lock that holds off every write); the checks come after, NOT VALID: every existing row holds them (no flows yet),
-- so only the scan is skipped, and new and updated rows are checked.
ALTER TABLE outbox_events
    ADD COLUMN parent_id     uuid,
    ADD COLUMN child_failure text,
    ADD COLUMN children_left integer NOT NULL DEFAULT 0;

ALTER TABLE outbox_events ADD CONSTRAINT outbox_events_child_failure_check
    CHECK (child_failure IN ('fail', 'ignore', 'remove')) NOT VALID;
ALTER TABLE outbox_events ADD CONSTRAINT outbox_events_children_left_check CHECK (children_left >= 0) NOT VALID;
ALTER TABLE outbox_events ADD CONSTRAINT outbox_events_flow_child
    CHECK ((parent_id IS NULL) = (child_failure IS NULL)) NOT VALID;
ALTER TABLE outbox_events ADD CONSTRAINT outbox_events_waits_for_children
    CHECK (children_left = 0 OR status <> 'pending' OR next_attempt_at = '9999-12-31 00:00:00+00') NOT VALID;

-- A child moved between live and ended (or was deleted while live): its parent learns it, in this transaction.
CREATE FUNCTION conveyor_flow_child_moved() RETURNS trigger
    LANGUAGE plpgsql VOLATILE SECURITY INVOKER
    SET search_path = pg_catalog, conveyor, pg_temp
    AS $$
    DECLARE
        child conveyor.outbox_events;
        now_live boolean;
        parent record;
        failure text;
    BEGIN
        IF TG_OP = 'DELETE' THEN
            child := OLD;
            now_live := false;
        ELSE
            child := NEW;
            now_live := NEW.status IN ('pending', 'dispatching', 'dispatched');
            IF now_live = (OLD.status IN ('pending', 'dispatching', 'dispatched')) THEN
                RETURN NULL;
            END IF;
        END IF;
        SELECT p.id, p.workspace_id, p.status, p.children_left, p.operation_id INTO parent
        FROM conveyor.outbox_events p WHERE p.id = child.parent_id
        FOR UPDATE;
        -- A parent that no longer waits (released, failed, canceled, purged) is past its children.
        IF NOT FOUND OR parent.status <> 'pending' OR parent.children_left = 0 THEN
            RETURN NULL;
        END IF;
        IF now_live THEN
            UPDATE conveyor.outbox_events SET children_left = children_left + 1 WHERE id = parent.id;
            RETURN NULL;
        END IF;
        IF TG_OP = 'UPDATE' AND child.status <> 'completed' AND child.child_failure = 'fail' THEN
            failure := pg_catalog.left(pg_catalog.format('child %s (%s) %s%s', child.id, child.event_type,
                CASE child.status WHEN 'canceled' THEN 'was canceled' ELSE 'failed' END,
                ': ' || child.last_error), 2000);
            UPDATE conveyor.outbox_events
            SET status = 'dead_letter', failure_stage = 'job', dead_lettered_at = pg_catalog.now(),
                last_error = failure, children_left = 0, next_attempt_at = pg_catalog.now(),
                dispatched_at = coalesce(dispatched_at, pg_catalog.now())
            WHERE id = parent.id;
            IF parent.operation_id IS NOT NULL THEN
                UPDATE conveyor.operations
                SET status = 'failed', error = failure, finished_at = pg_catalog.now(), updated_at = pg_catalog.now()
                WHERE id = parent.operation_id AND status IN ('queued', 'running');
            END IF;
            PERFORM pg_catalog.pg_notify('conveyor_jobs_done', parent.workspace_id::text);
        ELSIF parent.children_left = 1 THEN
            UPDATE conveyor.outbox_events SET children_left = 0, next_attempt_at = pg_catalog.now()
            WHERE id = parent.id;
            PERFORM conveyor.conveyor_wake_dispatchers(parent.workspace_id::text);
        ELSE
            UPDATE conveyor.outbox_events SET children_left = children_left - 1 WHERE id = parent.id;
        END IF;
        RETURN NULL;
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_flow_child_moved() FROM PUBLIC;

CREATE TRIGGER outbox_events_flow_child_moved
    AFTER UPDATE OF status ON outbox_events
    FOR EACH ROW WHEN (NEW.parent_id IS NOT NULL AND OLD.status IS DISTINCT FROM NEW.status)
    EXECUTE FUNCTION conveyor_flow_child_moved();
CREATE TRIGGER outbox_events_flow_child_deleted
    AFTER DELETE ON outbox_events
    FOR EACH ROW WHEN (OLD.parent_id IS NOT NULL AND OLD.status IN ('pending', 'dispatching', 'dispatched'))
    EXECUTE FUNCTION conveyor_flow_child_moved();

-- A parent canceled while it waited: its live children are canceled with it (their operations too), and told to
-- stop if running, as a cancellation of each would.
CREATE FUNCTION conveyor_flow_parent_canceled() RETURNS trigger
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
        PERFORM pg_catalog.pg_notify('conveyor_jobs_done', NEW.workspace_id::text);
        RETURN NULL;
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_flow_parent_canceled() FROM PUBLIC;

CREATE TRIGGER outbox_events_flow_parent_canceled
    AFTER UPDATE OF status ON outbox_events
    FOR EACH ROW WHEN (OLD.children_left > 0 AND NEW.status = 'canceled')
    EXECUTE FUNCTION conveyor_flow_parent_canceled();

-- The state of a parent that waits for its children, as the library and the operator name it.
CREATE OR REPLACE FUNCTION conveyor_job_state(status text, next_attempt_at timestamptz, failures integer) RETURNS text
    LANGUAGE sql STABLE PARALLEL SAFE
    AS $$
        SELECT CASE status
                   WHEN 'completed' THEN 'succeeded'
                   WHEN 'canceled' THEN 'canceled'
                   WHEN 'dead_letter' THEN 'failed'
                   WHEN 'discarded' THEN 'discarded'
                   WHEN 'dispatched' THEN 'active'
                   WHEN 'pending' THEN CASE WHEN next_attempt_at <= now() THEN 'queued'
                                            WHEN next_attempt_at = '9999-12-31 00:00:00+00' THEN 'waiting_children'
                                            WHEN failures > 0 THEN 'retrying'
                                            ELSE 'scheduled' END
                   ELSE 'queued'
               END
    $$;

CREATE OR REPLACE FUNCTION conveyor_admin_state_condition(state text) RETURNS text
    LANGUAGE plpgsql IMMUTABLE
    SET search_path = pg_catalog, conveyor, pg_temp
    AS $$
    BEGIN
        RETURN CASE state
            WHEN 'scheduled' THEN
                '(e.status = ''pending'' AND e.next_attempt_at > now() AND e.job_attempts + e.attempt_count = 0
                  AND e.children_left = 0)'
            WHEN 'waiting_children' THEN '(e.status = ''pending'' AND e.children_left > 0)'
            WHEN 'queued' THEN
                '((e.status = ''pending'' AND e.next_attempt_at <= now()) OR e.status = ''dispatching'')'
            WHEN 'retrying' THEN
                '(e.status = ''pending'' AND e.next_attempt_at > now() AND e.job_attempts + e.attempt_count > 0
                  AND e.children_left = 0)'
            WHEN 'active' THEN '(e.status = ''dispatched'')'
            WHEN 'succeeded' THEN '(e.status = ''completed'')'
            WHEN 'failed' THEN '(e.status = ''dead_letter'')'
            WHEN 'canceled' THEN '(e.status = ''canceled'')'
        END;
    END
    $$;
