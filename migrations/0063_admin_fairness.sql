-- The operator's view of fairness (issue 30): each workspace's weight and its jobs in the workers' hands (and their
-- share of all), and every workspace's key and kind limits, with their blocks and the jobs each holds now. Audited
-- reads, as every conveyor_admin_ function; the changes go through the audited admin module (weights through
-- conveyor_admin_set_weight, a workspace's own limits as the application role in that workspace).
--
-- The owner reads the limit tables through a policy of its own, as it reads the jobs (they had none: their rows were
-- read only in their workspace).
SET LOCAL search_path = conveyor;

DO $$
BEGIN
    EXECUTE pg_catalog.format('CREATE POLICY owner_scan ON conveyor.job_key_limits FOR SELECT TO %I USING (true)',
                              current_user);
    EXECUTE pg_catalog.format('CREATE POLICY owner_scan ON conveyor.job_kind_limits FOR SELECT TO %I USING (true)',
                              current_user);
END
$$;

-- Workspaces with jobs in the workers' hands or a weight of their own (the 500 with the most in flight): their weight
-- (1 without one), their jobs in flight (a lease past its time not counted, as the claim counts) and the share of all
-- jobs in flight that is theirs.
CREATE FUNCTION conveyor_admin_workspace_shares(actor text)
    RETURNS TABLE (workspace_id uuid, weight integer, in_flight bigint, share double precision)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, conveyor, pg_temp
    AS $$
    #variable_conflict use_column
    BEGIN
        PERFORM conveyor.conveyor_admin_audit_write(actor, 'workspace_shares', '{}');
        RETURN QUERY
            WITH flight AS (
                SELECT f.workspace_id, pg_catalog.count(*) AS n FROM conveyor.outbox_events f
                WHERE f.status IN ('dispatching', 'dispatched')
                  AND NOT (f.status = 'dispatching' AND f.locked_until <= pg_catalog.now())
                GROUP BY f.workspace_id),
            total AS (SELECT pg_catalog.sum(f.n) AS n FROM flight f),
            everyone AS (SELECT w.workspace_id FROM conveyor.workspace_weights w
                         UNION
                         SELECT f.workspace_id FROM flight f)
            SELECT e.workspace_id, coalesce(w.weight, 1), coalesce(f.n, 0),
                   CASE WHEN t.n > 0 THEN coalesce(f.n, 0)::double precision / t.n::double precision ELSE 0 END
            FROM everyone e
            CROSS JOIN total t
            LEFT JOIN conveyor.workspace_weights w ON w.workspace_id = e.workspace_id
            LEFT JOIN flight f ON f.workspace_id = e.workspace_id
            ORDER BY coalesce(f.n, 0) DESC, e.workspace_id
            LIMIT 500;
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_admin_workspace_shares(text) FROM PUBLIC;

-- Every workspace's key limits and blocks (or one workspace's), each with the key's jobs in flight; at most 1,000.
CREATE FUNCTION conveyor_admin_key_limits(actor text, limits_workspace uuid)
    RETURNS TABLE (workspace_id uuid, key text, max_in_flight integer, max_per_interval integer, interval_ms bigint,
                   blocked_until timestamptz, block_reason text, in_flight bigint, updated_at timestamptz)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, conveyor, pg_temp
    AS $$
    #variable_conflict use_column
    BEGIN
        PERFORM conveyor.conveyor_admin_audit_write(actor, 'key_limits',
                                                    pg_catalog.jsonb_build_object('workspace', limits_workspace));
        RETURN QUERY
            SELECT l.workspace_id, l.key, l.max_in_flight, l.max_per_interval, l.interval_ms, l.blocked_until,
                   l.block_reason,
                   (SELECT pg_catalog.count(*) FROM conveyor.outbox_events f
                    WHERE f.workspace_id = l.workspace_id AND f.limit_key = l.key
                      AND f.status IN ('dispatching', 'dispatched')),
                   l.updated_at
            FROM conveyor.job_key_limits l
            WHERE limits_workspace IS NULL OR l.workspace_id = limits_workspace
            ORDER BY l.workspace_id, l.key
            LIMIT 1000;
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_admin_key_limits(text, uuid) FROM PUBLIC;

-- Every workspace's kind limits (or one workspace's), each with the kind's jobs in flight; at most 1,000.
CREATE FUNCTION conveyor_admin_kind_limits(actor text, limits_workspace uuid)
    RETURNS TABLE (workspace_id uuid, kind text, max_in_flight integer, in_flight bigint, updated_at timestamptz)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, conveyor, pg_temp
    AS $$
    #variable_conflict use_column
    BEGIN
        PERFORM conveyor.conveyor_admin_audit_write(actor, 'kind_limits',
                                                    pg_catalog.jsonb_build_object('workspace', limits_workspace));
        RETURN QUERY
            SELECT k.workspace_id, k.kind, k.max_in_flight,
                   (SELECT pg_catalog.count(*) FROM conveyor.outbox_events f
                    WHERE f.workspace_id = k.workspace_id AND f.event_type = k.kind
                      AND f.status IN ('dispatching', 'dispatched')),
                   k.updated_at
            FROM conveyor.job_kind_limits k
            WHERE limits_workspace IS NULL OR k.workspace_id = limits_workspace
            ORDER BY k.workspace_id, k.kind
            LIMIT 1000;
    END
    $$;
REVOKE ALL ON FUNCTION conveyor_admin_kind_limits(text, uuid) FROM PUBLIC;
