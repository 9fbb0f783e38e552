-- The relay's two hot statements, the claim and the mark, as functions of the INVOKER: they run as the application
-- role under row-level security, exactly like the statements they replace. Each takes several workspaces and works
-- on them one after the other: it sets the workspace (set_config, transaction-local), runs that workspace's statement,
-- which row-level security confines to it, and moves on; at the end it clears the setting. Called outside an explicit
-- transaction, one call is one transaction and one round trip for a whole pass of the relay, where a transaction per
-- workspace cost a round trip each for BEGIN + set_config, the statement and COMMIT. At a steady trickle (every
-- workspace with an event or two) that was most of the relay's cost.
--
-- Plans. Each function plans its statements once per connection and keeps the plan, so a plan must stay right as the
-- table grows from empty and as its mix of statuses swings (a backlog is all `pending`, then all `dispatching`), long
-- before statistics catch up. Both statements therefore go by physical address (ctid, a TID scan), which no
-- statistics can make look worse than it is:
-- * The claim walks the partial due index of the workspace in due order (and the index of leases for expired ones),
--   locks the rows, and updates them by ctid.
--   `enable_seqscan = off` rules out the one alternative, reading the whole table, which a plan made while the table
--   was small would otherwise keep. (`jit = off` goes with it: a plan priced with a disabled scan would cross the JIT
--   threshold and compile for a hundred milliseconds.)
-- * The mark takes the ctids the claim returned. Its only join condition is `ctid = tid`; the id and the status are
--   checked with IS NOT DISTINCT FROM, which the planner can neither join on nor match to a partial index, so it
--   cannot drive the update from, say, every leased row of the table (what it did, with stale statistics claiming
--   there was one). A ctid names a tuple version: if the row was updated since the claim (its lease expired and
--   another dispatcher took it) the version is dead and nothing is marked; the id check covers a slot reused by
--   another row.
--
-- Relaxed commit (synchronous_commit off) is safe for the relay's own writes only: a claim or a mark lost in a
-- PostgreSQL crash sends the event through the relay again, where its de-dup key finds it already in the stream.

-- For each of `workspaces`: leases up to `per_workspace` of its due events to `holder` for `lease_secs`, in due order
-- (next_attempt_at, then id: for fresh events, the order they were written), skipping rows other dispatchers hold
-- locked. Events of the workspace whose lease expired (their dispatcher died) are leased again with them.
CREATE FUNCTION conveyor_claim_outbox(workspaces uuid[], holder text, lease_secs double precision,
                                      per_workspace integer)
    RETURNS TABLE (tid tid, id uuid, workspace_id uuid, queue text, event_type text, event_payload jsonb,
                   operation_id uuid, traceparent text, attempt_count integer, job_attempts integer,
                   redrive_count integer, created_at timestamptz, next_attempt_at timestamptz)
    LANGUAGE plpgsql VOLATILE SECURITY INVOKER
    SET enable_seqscan = off
    SET jit = off
    AS $$
    #variable_conflict use_column
    DECLARE
        ws uuid;
    BEGIN
        PERFORM set_config('synchronous_commit', 'off', true);
        FOREACH ws IN ARRAY workspaces LOOP
            PERFORM set_config('app.workspace_id', ws::text, true);
            -- Two locking subqueries: the workspace's due events, walking the partial due index in due order, and its
            -- expired leases (normally none: the index range is empty). The update then visits the locked rows by
            -- their physical address (a TID scan), not through an index again.
            RETURN QUERY
                UPDATE public.outbox_events e
                SET status = 'dispatching', locked_by = holder,
                    locked_until = now() + make_interval(secs => lease_secs)
                WHERE e.ctid = ANY(ARRAY(
                          SELECT d.ctid FROM public.outbox_events d
                          WHERE d.status = 'dispatching' AND d.locked_until <= now()
                          ORDER BY d.locked_until
                          LIMIT per_workspace
                          FOR UPDATE SKIP LOCKED))
                   OR e.ctid = ANY(ARRAY(
                          SELECT d.ctid FROM public.outbox_events d
                          WHERE d.status = 'pending' AND d.next_attempt_at <= now()
                          ORDER BY d.next_attempt_at, d.id
                          LIMIT per_workspace
                          FOR UPDATE SKIP LOCKED))
                RETURNING e.ctid, e.id, e.workspace_id, e.queue, e.event_type, e.event_payload, e.operation_id,
                          e.traceparent, e.attempt_count, e.job_attempts, e.redrive_count, e.created_at,
                          e.next_attempt_at;
        END LOOP;
        PERFORM set_config('app.workspace_id', '', true);
    END
    $$;

-- Marks `dispatched`, with its stream entry id, each claimed event (workspaces[i], tids[i], ids[i], stream_ids[i])
-- whose lease `holder` still holds (fenced: a lease that expired may already be someone else's). Returns how many it
-- marked.
CREATE FUNCTION conveyor_mark_outbox_dispatched(holder text, workspaces uuid[], tids tid[], ids uuid[],
                                                stream_ids text[])
    RETURNS bigint
    LANGUAGE plpgsql VOLATILE SECURITY INVOKER
    SET enable_seqscan = off
    SET jit = off
    AS $$
    DECLARE
        ws uuid;
        marked bigint := 0;
        n bigint;
    BEGIN
        PERFORM set_config('synchronous_commit', 'off', true);
        FOR ws IN SELECT DISTINCT w FROM unnest(workspaces) AS w LOOP
            PERFORM set_config('app.workspace_id', ws::text, true);
            UPDATE public.outbox_events e
            SET status = 'dispatched', stream_id = v.stream_id, dispatched_at = now(),
                locked_by = NULL, locked_until = NULL, last_error = NULL
            FROM unnest(workspaces, tids, ids, stream_ids) AS v(workspace_id, tid, id, stream_id)
            WHERE v.workspace_id = ws AND e.ctid = v.tid
              AND e.id IS NOT DISTINCT FROM v.id AND e.status IS NOT DISTINCT FROM 'dispatching'
              AND e.locked_by = holder AND e.locked_until > now();
            GET DIAGNOSTICS n = ROW_COUNT;
            marked := marked + n;
        END LOOP;
        PERFORM set_config('app.workspace_id', '', true);
        RETURN marked;
    END
    $$;

-- The outbox's operation index served one query, the reconciler's, which looks only at dispatched events. Indexing
-- every row version instead cost an index entry on each insert and each claim. Operations are never deleted, so the
-- foreign key's ON DELETE action does not need it either.
DROP INDEX outbox_events_operation;
CREATE INDEX outbox_events_operation ON outbox_events (operation_id) WHERE status = 'dispatched';

-- One index on dispatched rows by age is enough: `outbox_events_dispatched (workspace_id, dispatched_at)` serves the
-- retention job's per-workspace deletes (and, scanned whole, its lookup of workspaces with old rows, which runs once a
-- maintenance pass). A second one, on dispatched_at alone, existed in an early version of 0002 and cost every mark an
-- index entry; the landed 0002 no longer creates it, so this only drops it where a database still has it.
DROP INDEX IF EXISTS outbox_events_dispatched_at;
