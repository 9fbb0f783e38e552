-- The look-up of workspaces with due jobs (0030's `conveyor_due_workspaces`, which every sweep and, while a dispatcher
-- is awake, every tick runs) grouped every due pending row by workspace: its cost grew with the backlog. Measured in
-- the burst benchmark (100,000 jobs in one workspace, a window of 256): 15 to 27 ms a look-up, with a tick every 2 ms
-- wanted, the relay's largest cost. Now it reads what it returns: the workspaces with pending jobs, one index probe
-- each (a loose scan of `outbox_events_due_by_priority`, which starts with the workspace), and of each the earliest
-- job per priority (three probes: priorities are 0 to 2), due or not. Expired leases as before. Same result, same order.
SET LOCAL search_path = conveyor;

CREATE OR REPLACE FUNCTION conveyor_due_workspaces(max_workspaces integer)
    RETURNS TABLE (workspace_id uuid, expired_leases boolean)
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, conveyor, pg_temp
    AS $$
        WITH RECURSIVE pending(workspace_id) AS (
            (SELECT e.workspace_id FROM conveyor.outbox_events e
             WHERE e.status = 'pending'
             ORDER BY e.workspace_id LIMIT 1)
            UNION ALL
            SELECT (SELECT e.workspace_id FROM conveyor.outbox_events e
                    WHERE e.status = 'pending' AND e.workspace_id > p.workspace_id
                    ORDER BY e.workspace_id LIMIT 1)
            FROM pending p
            WHERE p.workspace_id IS NOT NULL
        ), due AS (
            SELECT p.workspace_id, (
                SELECT min(first.next_attempt_at)
                FROM unnest('{0,1,2}'::smallint[]) AS q(priority)
                CROSS JOIN LATERAL (
                    SELECT e.next_attempt_at FROM conveyor.outbox_events e
                    WHERE e.status = 'pending' AND e.workspace_id = p.workspace_id AND e.priority = q.priority
                    ORDER BY e.next_attempt_at LIMIT 1
                ) first
            ) AS due_at
            FROM pending p
            WHERE p.workspace_id IS NOT NULL
        )
        SELECT w.workspace_id, bool_or(w.expired)
        FROM (
            SELECT d.workspace_id, d.due_at, false AS expired
            FROM due d
            WHERE d.due_at <= now()
            UNION ALL
            SELECT e.workspace_id, min(e.locked_until), true
            FROM conveyor.outbox_events e
            WHERE e.status = 'dispatching' AND e.locked_until <= now()
            GROUP BY e.workspace_id
        ) w
        GROUP BY w.workspace_id
        ORDER BY min(w.due_at)
        LIMIT greatest(1, least(max_workspaces, 10000))
    $$;
