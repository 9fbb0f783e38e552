-- AI tasks (`ai.generate`, CONTRACT §2.3): no duplicate provider calls, no duplicate billing.
--
-- Credits are counted per workspace and calendar month (UTC) in `ai_usage_months.credits_reserved`. A request
-- reserves its task's price there with one conditional UPDATE of the month's row, in the transaction that writes the
-- task, its operation and its outbox event: the row lock serializes concurrent requests, so the month is never
-- overspent, and a refused request (429) writes nothing.
--
-- A task's reservation is `held` until its job records the provider's answer, in the job's own transaction, together
-- with the task's one `ai_usage_ledger` row (`charged`); `UNIQUE (task_id)` makes a second charge of a task
-- impossible however often the job runs. A task whose operation ends `failed` or `canceled` was not charged: the next
-- reservation of its month (under the same row lock) marks it `released` and gives its credits back. A dead letter
-- replayed later reserves its credits again before calling the provider.
--
-- A task's status is its operation's (queued, running, succeeded, failed, canceled): the platform records a job's end
-- on the operation, and the task's result commits with the operation's success.
SET LOCAL search_path = conveyor_shop, conveyor;

CREATE TABLE ai_usage_months (
    workspace_id     uuid        NOT NULL,
    month            date        NOT NULL CHECK (extract(day FROM month) = 1),
    credits_reserved bigint      NOT NULL DEFAULT 0 CHECK (credits_reserved >= 0),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (workspace_id, month)
);

CREATE TABLE ai_tasks (
    id           uuid        PRIMARY KEY,
    workspace_id uuid        NOT NULL,
    kind         text        NOT NULL CHECK (kind IN ('text', 'category', 'image')),
    input        jsonb       NOT NULL CHECK (jsonb_typeof(input) = 'object'),
    listing_id   uuid,
    operation_id uuid        NOT NULL REFERENCES operations (id),
    -- The task's price, reserved from `month` when it was created.
    credits      integer     NOT NULL CHECK (credits > 0),
    month        date        NOT NULL,
    reservation  text        NOT NULL DEFAULT 'held' CHECK (reservation IN ('held', 'charged', 'released')),
    -- The provider's output, recorded with the charge.
    result       jsonb,
    created_by   uuid        NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now(),
    completed_at timestamptz,
    UNIQUE (workspace_id, id),
    UNIQUE (operation_id),
    FOREIGN KEY (workspace_id, month) REFERENCES ai_usage_months (workspace_id, month),
    FOREIGN KEY (workspace_id, listing_id) REFERENCES listings (workspace_id, id),
    CHECK ((reservation = 'charged') = (result IS NOT NULL)),
    CHECK ((reservation = 'charged') = (completed_at IS NOT NULL))
);
-- The reservations still held: what a reservation looks through for tasks that ended without a charge.
CREATE INDEX ai_tasks_held ON ai_tasks (workspace_id, month) WHERE reservation = 'held';
CREATE INDEX ai_tasks_listing ON ai_tasks (workspace_id, listing_id) WHERE listing_id IS NOT NULL;

-- One row per charged task, written in the job's transaction with the task's result.
CREATE TABLE ai_usage_ledger (
    id                uuid        PRIMARY KEY,
    workspace_id      uuid        NOT NULL,
    task_id           uuid        NOT NULL,
    month             date        NOT NULL,
    kind              text        NOT NULL,
    credits           integer     NOT NULL CHECK (credits > 0),
    -- The provider's id of its charge (what its invoice names), when it gives one.
    provider_charge_id text       CHECK (length(provider_charge_id) BETWEEN 1 AND 200),
    created_at        timestamptz NOT NULL DEFAULT now(),
    UNIQUE (task_id),
    FOREIGN KEY (workspace_id, task_id) REFERENCES ai_tasks (workspace_id, id)
);
CREATE INDEX ai_usage_ledger_month ON ai_usage_ledger (workspace_id, month);

ALTER TABLE ai_usage_months ENABLE ROW LEVEL SECURITY;
ALTER TABLE ai_usage_months FORCE ROW LEVEL SECURITY;
CREATE POLICY workspace_isolation ON ai_usage_months
    USING (workspace_id = conveyor_current_workspace())
    WITH CHECK (workspace_id = conveyor_current_workspace());

ALTER TABLE ai_tasks ENABLE ROW LEVEL SECURITY;
ALTER TABLE ai_tasks FORCE ROW LEVEL SECURITY;
CREATE POLICY workspace_isolation ON ai_tasks
    USING (workspace_id = conveyor_current_workspace())
    WITH CHECK (workspace_id = conveyor_current_workspace());

ALTER TABLE ai_usage_ledger ENABLE ROW LEVEL SECURITY;
ALTER TABLE ai_usage_ledger FORCE ROW LEVEL SECURITY;
CREATE POLICY workspace_isolation ON ai_usage_ledger
    USING (workspace_id = conveyor_current_workspace())
    WITH CHECK (workspace_id = conveyor_current_workspace());
