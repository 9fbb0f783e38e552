//! Flows: a parent job that runs once its children have ended, enqueued together in the caller's transaction
//! (migration 0056). The database does the rest: each child's end counts its parent down in the transaction that
//! records it, and the last one makes the parent due.

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::enqueue::{EnqueueError, EnqueueOptions, Row, check_kind, check_operations, no_workspace};
use crate::db::WorkspaceTx;
use crate::ids::JobId;
use crate::kind::JobKind;

/// The most jobs one flow writes, children and grandchildren included.
pub const MAX_FLOW_JOBS: usize = 10_000;

/// What a child's failure (dead-lettered, or canceled) does to its parent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum ChildFailure {
    /// The parent fails at once, without running, its error naming the child (BullMQ's `failParentOnFailure`); its
    /// other children run on.
    #[default]
    FailParent,
    /// The parent runs once its other children have ended, and reads this one's failure among its children's ends
    /// (`ignoreDependencyOnFailure`).
    Ignore,
    /// The parent runs once its other children have ended, as if this one had never been its child: it is not among
    /// their ends (`removeDependencyOnFailure`).
    Remove,
}

impl ChildFailure {
    fn as_str(self) -> &'static str {
        match self {
            Self::FailParent => "fail",
            Self::Ignore => "ignore",
            Self::Remove => "remove",
        }
    }
}

/// A job with the children it waits for: each a job of any kind and queue, with children of its own if it likes.
/// Enqueued whole by [`enqueue_flow_tx`] (or [`crate::Conveyor::enqueue_flow`]).
///
/// ```
/// # use conveyor_jobs::{ChildFailure, EnqueueOptions, Flow, JobKind};
/// # #[derive(serde::Serialize, serde::Deserialize)] struct Publish { listing: u32 }
/// # impl JobKind for Publish { const KIND: &'static str = "listings.publish"; const QUEUE: &'static str = "listings"; }
/// # #[derive(serde::Serialize, serde::Deserialize)] struct Resize { image: u32 }
/// # impl JobKind for Resize { const KIND: &'static str = "media.resize"; const QUEUE: &'static str = "media"; }
/// # fn f() -> Result<(), conveyor_jobs::EnqueueError> {
/// // Publish the listing once both images are resized; a second-best image may fail.
/// let flow = Flow::job(&Publish { listing: 7 }, EnqueueOptions::new())?
///     .child(Flow::job(&Resize { image: 1 }, EnqueueOptions::new())?)
///     .child_on_failure(Flow::job(&Resize { image: 2 }, EnqueueOptions::new())?, ChildFailure::Ignore);
/// # Ok(()) }
/// ```
pub struct Flow {
    kind: &'static str,
    queue: &'static str,
    row: Row,
    due_hint: Option<DateTime<Utc>>,
    children: Vec<(Flow, ChildFailure)>,
}

impl std::fmt::Debug for Flow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Flow")
            .field("kind", &self.kind)
            .field("id", &self.row.id)
            .field("children", &self.children)
            .finish_non_exhaustive()
    }
}

impl Flow {
    /// A job of kind `K`, with no children yet. Its options are a job's, but for a de-duplication key (a flow's jobs
    /// are written together or not at all); a job with children takes no due time of its own either: it is due when
    /// its last child ends.
    pub fn job<K: JobKind>(payload: &K, options: EnqueueOptions) -> Result<Self, EnqueueError> {
        check_kind::<K>()?;
        let due_hint = options.due_hint();
        let row = Row::new(payload, options)?;
        if row.dedup_key.is_some() {
            return Err(EnqueueError::InvalidOptions(format!(
                "{}: a job of a flow takes no de-duplication key (the flow is written whole or not at all)",
                K::KIND
            )));
        }
        Ok(Self { kind: K::KIND, queue: K::QUEUE, row, due_hint, children: Vec::new() })
    }

    /// Adds a child whose failure fails this job ([`ChildFailure::FailParent`]).
    pub fn child(self, child: Flow) -> Self {
        self.child_on_failure(child, ChildFailure::FailParent)
    }

    /// Adds a child, with what its failure does to this job.
    pub fn child_on_failure(mut self, child: Flow, on_failure: ChildFailure) -> Self {
        self.children.push((child, on_failure));
        self
    }

    /// The id its job will have once enqueued.
    pub fn id(&self) -> JobId {
        JobId(self.row.id)
    }
}

/// The ids of an enqueued flow, in the shape of the [`Flow`] it was given.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnqueuedFlow {
    /// The job's id.
    pub id: JobId,
    /// Its children's, in the order they were added.
    pub children: Vec<EnqueuedFlow>,
}

/// One job of a flow, flattened, ready to bind.
struct Node {
    kind: &'static str,
    queue: &'static str,
    row: Row,
    parent: Option<Uuid>,
    on_failure: Option<&'static str>,
    children: i32,
    due_hint: Option<DateTime<Utc>>,
}

/// Writes a flow, a job with its children (and theirs), inside the caller's transaction, in one statement: all of it
/// commits or rolls back with the caller's writes. A job with children is held back until the last of them ends:
/// then it is due, in the transaction that records that end (a crash never releases it twice, nor never). A child
/// that fails decides by its [`ChildFailure`]; a parent canceled while it waits cancels its live children. Children
/// may be of any queue; pauses, windows, limits and priorities apply to each job as to any other. A handler reads its
/// children's results with [`crate::JobContext::children`].
///
/// Refused, with nothing written: more than [`MAX_FLOW_JOBS`] jobs, a job with children that sets a due time, an
/// operation named by two jobs of the flow (the first to end would finish it for the other), an operation that is not
/// a live one of the workspace.
pub async fn enqueue_flow_tx(tx: &mut WorkspaceTx, flow: Flow) -> Result<EnqueuedFlow, EnqueueError> {
    let shape = shape_of(&flow);
    let nodes = flatten(flow)?;
    let mut operations: Vec<Uuid> = nodes.iter().filter_map(|n| n.row.operation).collect();
    operations.sort();
    if operations.windows(2).any(|w| w[0] == w[1]) {
        return Err(EnqueueError::InvalidOptions(
            "an operation is named by two jobs of the flow: the first to end would finish it for the other".into(),
        ));
    }
    if !operations.is_empty() {
        check_operations(tx, &operations).await?;
    }
    // The earliest delayed leaf, for the dispatchers' timer; the parents are due when their children end.
    let due = nodes.iter().filter(|n| n.children == 0).filter_map(|n| n.due_hint).min();
    fn column<T>(nodes: &[Node], f: impl Fn(&Node) -> T) -> Vec<T> {
        nodes.iter().map(f).collect()
    }
    // No conflict clause: the whole flow is written, or the statement fails and nothing is.
    sqlx::query(
        "INSERT INTO conveyor.outbox_events (id, workspace_id, queue, event_type, event_payload, operation_id,
                                        traceparent, next_attempt_at, priority, max_attempts, timeout_ms, backoff_ms,
                                        backoff_max_ms, limit_key, keep_succeeded_s, keep_succeeded_n, keep_failed_s,
                                        keep_failed_n, parent_id, child_failure, children_left, expires_at)
             SELECT v.id, conveyor.conveyor_current_workspace(), v.queue, v.kind, v.payload, v.operation_id,
                    v.traceparent,
                    CASE WHEN v.children > 0 THEN '9999-12-31 00:00:00+00'::timestamptz
                         ELSE coalesce(v.run_at, now() + make_interval(secs => v.delay)) END,
                    v.priority, v.max_attempts, v.timeout_ms, v.backoff_ms, v.backoff_max_ms, v.limit_key,
                    v.keep_succeeded_s, v.keep_succeeded_n, v.keep_failed_s, v.keep_failed_n, v.parent_id,
                    v.child_failure, v.children,
                    coalesce(v.expire_at, greatest(coalesce(v.run_at, now() + make_interval(secs => v.delay)), now())
                                          + make_interval(secs => v.start_within))
             FROM conveyor.conveyor_wake_dispatchers(conveyor.conveyor_current_workspace()::text || $1) AS notified
             CROSS JOIN unnest($2::uuid[], $3::text[], $4::text[], $5::jsonb[], $6::uuid[], $7::text[],
                               $8::timestamptz[], $9::float8[], $10::int2[], $11::int4[], $12::int8[], $13::int8[],
                               $14::int8[], $15::text[], $16::int4[], $17::int4[], $18::int4[], $19::int4[],
                               $20::uuid[], $21::text[], $22::int4[], $23::timestamptz[], $24::float8[])
                        WITH ORDINALITY AS v(id, queue, kind, payload, operation_id, traceparent, run_at, delay,
                                             priority, max_attempts, timeout_ms, backoff_ms, backoff_max_ms,
                                             limit_key, keep_succeeded_s, keep_succeeded_n, keep_failed_s,
                                             keep_failed_n, parent_id, child_failure, children, expire_at,
                                             start_within, n)
             ORDER BY v.n",
    )
    .bind(super::enqueue::notification_suffix(due))
    .bind(column(&nodes, |n| n.row.id))
    .bind(column(&nodes, |n| n.queue))
    .bind(column(&nodes, |n| n.kind))
    .bind(column(&nodes, |n| n.row.payload.clone()))
    .bind(column(&nodes, |n| n.row.operation))
    .bind(column(&nodes, |n| n.row.traceparent.clone()))
    .bind(column(&nodes, |n| n.row.run_at))
    .bind(column(&nodes, |n| n.row.delay_secs))
    .bind(column(&nodes, |n| n.row.priority))
    .bind(column(&nodes, |n| n.row.max_attempts))
    .bind(column(&nodes, |n| n.row.timeout_ms))
    .bind(column(&nodes, |n| n.row.backoff_ms))
    .bind(column(&nodes, |n| n.row.backoff_max_ms))
    .bind(column(&nodes, |n| n.row.limit_key.clone()))
    .bind(column(&nodes, |n| n.row.keep[0]))
    .bind(column(&nodes, |n| n.row.keep[1]))
    .bind(column(&nodes, |n| n.row.keep[2]))
    .bind(column(&nodes, |n| n.row.keep[3]))
    .bind(column(&nodes, |n| n.parent))
    .bind(column(&nodes, |n| n.on_failure))
    .bind(column(&nodes, |n| n.children))
    .bind(column(&nodes, |n| n.row.expire_at))
    .bind(column(&nodes, |n| n.row.start_within_secs))
    .execute(&mut **tx)
    .await
    .map_err(no_workspace)?;
    Ok(shape)
}

/// The ids of `flow`, in its shape.
fn shape_of(flow: &Flow) -> EnqueuedFlow {
    EnqueuedFlow { id: flow.id(), children: flow.children.iter().map(|(c, _)| shape_of(c)).collect() }
}

/// The flow's jobs, parents before their children, each with its parent, its policy and how many children it has;
/// refused when it is too large, or a job with children sets a due time.
fn flatten(flow: Flow) -> Result<Vec<Node>, EnqueueError> {
    let mut nodes = Vec::new();
    let mut stack: Vec<(Flow, Option<Uuid>, Option<&'static str>)> = vec![(flow, None, None)];
    while let Some((flow, parent, on_failure)) = stack.pop() {
        if nodes.len() == MAX_FLOW_JOBS {
            return Err(EnqueueError::InvalidOptions(format!("a flow writes at most {MAX_FLOW_JOBS} jobs")));
        }
        let Flow { kind, queue, row, due_hint, children } = flow;
        if !children.is_empty() && (row.run_at.is_some() || row.delay_secs > 0.0) {
            return Err(EnqueueError::InvalidOptions(format!(
                "{kind}: a job with children takes no due time or delay: it is due when its last child ends"
            )));
        }
        if !children.is_empty() && (row.expire_at.is_some() || row.start_within_secs.is_some()) {
            // Expired while it waited, it would cancel its children mid-run: a deadline for the whole flow.
            return Err(EnqueueError::InvalidOptions(format!(
                "{kind}: a job with children takes no deadline (expire_at, start_within): it starts when its last \
                 child ends"
            )));
        }
        let id = row.id;
        let count = children.len() as i32;
        // Reversed, so that the children are written (and their ids ordered) in the order they were added.
        for (child, policy) in children.into_iter().rev() {
            stack.push((child, Some(id), Some(policy.as_str())));
        }
        nodes.push(Node { kind, queue, row, parent, on_failure, children: count, due_hint });
    }
    Ok(nodes)
}
