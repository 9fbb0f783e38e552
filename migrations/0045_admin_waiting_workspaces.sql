-- Queue operations across workspaces: an operator's drain of a queue or kind in every workspace needs the workspaces
-- that have waiting jobs of it, and nothing else may read across workspaces. Audited like every conveyor_admin_
-- function, and written as the definer functions are since 0038 (pg_catalog first, pg_temp last). The workspaces come
-- from a loose scan of outbox_events_due_by_queue (one probe per workspace with waiting jobs), then one probe each for
-- a job of the queue or kind: never the backlog's whole length.
SET LOCAL search_path = conveyor;

CREATE FUNCTION conveyor_admin_waiting_workspaces(actor text, of_queue text, of_kind text, max_workspaces integer)
    RETURNS TABLE (workspace_id uuid)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, conveyor, pg_temp
    AS $$
    #variable_conflict use_column
    BEGIN
        PERFORM conveyor.conveyor_admin_check_limit(max_workspaces);
        PERFORM conveyor.conveyor_admin_audit_write(actor, 'waiting_workspaces', pg_catalog.jsonb_build_object(
            'queue', of_queue, 'kind', of_kind, 'limit', max_workspaces));
        RETURN QUERY
            WITH RECURSIVE waiting(id) AS (
                (SELECT e.workspace_id FROM conveyor.outbox_events e
                 WHERE e.status = 'pending' ORDER BY e.workspace_id LIMIT 1)
                UNION ALL
                SELECT (SELECT e.workspace_id FROM conveyor.outbox_events e
                        WHERE e.status = 'pending' AND e.workspace_id > w.id
                        ORDER BY e.workspace_id LIMIT 1)
                FROM waiting w WHERE w.id IS NOT NULL)
            SELECT w.id FROM waiting w
            WHERE w.id IS NOT NULL
              AND EXISTS (SELECT 1 FROM conveyor.outbox_events e
                          WHERE e.workspace_id = w.id AND e.status = 'pending'
                            AND (of_queue IS NULL OR e.queue = of_queue)
                            AND (of_kind IS NULL OR e.event_type = of_kind))
            ORDER BY w.id
            LIMIT max_workspaces;
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_admin_waiting_workspaces(text, text, text, integer) FROM PUBLIC;
