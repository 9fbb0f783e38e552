//! The dispatcher: relays committed outbox events into Redis Streams (seed sections 3 and 4).
//!
//! One pass ([`Dispatcher::dispatch_once`]): find the workspaces with due events through the narrow
//! `SECURITY DEFINER` function; for a group of workspaces at a time, claim a batch of each, every workspace's claim
//! under RLS for that workspace alone (`FOR UPDATE SKIP LOCKED`, leased to this dispatcher with
//! `locked_by`/`locked_until`), publish the group's events in one pipeline (one de-duplicating script per ≤100
//! events), then mark the delivered ones `dispatched` with their stream entry id, fenced by the lease, and return the
//! failed ones to `pending` with exponential back-off, or `dead_letter` past the maximum. The loop
//! ([`Dispatcher::run`]) relays the workspaces named by notifications as they come, with no lookup, and those whose
//! batch came back full again at once, and sweeps every workspace at start and every poll interval. While it sees
//! work it is awake (`dispatchers_awake`, migration 0039): enqueues skip their notification, whose commit lock queued
//! every enqueueing COMMIT behind the others, and it ticks instead, a look-up of the workspaces with due jobs at most
//! every [`DispatcherSettings::tick`].
//!
//! Guarantees: an event committed is delivered at least once, whatever process dies when; the stream holds it once
//! (the de-dup key), however often it is handed off. Several dispatchers cooperate through `SKIP LOCKED` and leases,
//! with no leader. Ordering: within one workspace and queue, a batch goes out in due order (for fresh events, the
//! order they were written), and batches of one dispatcher follow each other; across dispatchers, workspaces or
//! failures (a failed event is retried after newer ones) there is no ordering guarantee, and consumers must not
//! assume one.

use crate::error::Public;
use std::collections::{HashMap, HashSet};
use std::time::Duration;

use anyhow::Context;
use chrono::{DateTime, Utc};
use futures_util::StreamExt;
use sqlx::PgPool;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::backoff::Backoff;
use crate::ids::WorkspaceId;
use crate::metrics::Metrics;
use crate::outbox::NOTIFY_CHANNEL;
use crate::outbox::transitions::relay as claim;
use crate::redact::redact;
use crate::stream::producer::{JobOptions, Message, Producer};
use crate::telemetry;
use claim::{ClaimedEvent, Delivered, Failure, Settled};

mod gate;
mod listen;
mod settings;

pub(crate) use gate::{QueueLoad, Rooms};
pub use settings::DispatcherSettings;

/// The span of one job's hand-off to its stream (a producer span), a child of the job's `traceparent`.
fn relay_span(event: &ClaimedEvent) -> tracing::Span {
    let span = tracing::info_span!(
        "outbox.relay",
        otel.kind = "producer",
        otel.status_code = tracing::field::Empty,
        job.id = %event.id,
        job.kind = %event.event_type,
        job.queue = %event.queue,
        job.attempt = event.job_attempts + 1,
    );
    if let Some(stored) = &event.traceparent {
        let (traceparent, tracestate) = telemetry::from_stored(stored);
        telemetry::set_parent_with_state(&span, traceparent, tracestate);
    }
    span
}

/// Workspaces looked at per pass.
const WORKSPACES_PER_PASS: i32 = 1000;

/// At most this many workspaces are claimed (and marked) together, in one statement each.
const WORKSPACES_PER_CLAIM: usize = 32;

/// What one pass did.
#[derive(Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum DispatchOutcome {
    /// Some events were claimed; how they ended.
    Worked(Settled),
    /// Nothing was due.
    Idle,
}

/// Relays the outbox into streams.
pub struct Dispatcher {
    pool: PgPool,
    producer: Producer,
    settings: DispatcherSettings,
    metrics: Metrics,
    id: String,
    /// Each queue's room in its streams (see [`gate`]).
    gate: std::sync::Arc<gate::Gate>,
    /// Workspaces whose last claim left due jobs behind: the others go first to a claim, and so to a gated queue's
    /// room.
    backlogged: std::sync::Mutex<HashSet<WorkspaceId>>,
    /// Workspaces whose batch came back full since the loop last looked: relayed again at once, by name.
    refill: std::sync::Mutex<HashSet<WorkspaceId>>,
}

impl Dispatcher {
    /// A dispatcher with the default settings over `pool` (the runtime role's: `CONVEYOR_RUNTIME_DATABASE_URL`, which
    /// `conveyor migrate` grants the functions that find and claim work across workspaces) and the Redis at
    /// `redis_url`, whose keys start with `prefix`, named after this process.
    pub async fn connect(pool: PgPool, redis_url: &str, prefix: &str) -> Result<Self, crate::Error> {
        Self::connect_inner(pool, redis_url, prefix).await.public()
    }

    async fn connect_inner(pool: PgPool, redis_url: &str, prefix: &str) -> anyhow::Result<Self> {
        let settings = DispatcherSettings::default();
        let redis =
            crate::stream::connect(redis_url, Duration::from_secs(5)).await.context("Failed to connect to Redis")?;
        let producer = Producer::new(redis, crate::stream::keys::Keys::new(prefix), settings.dedup_ttl);
        Ok(Self::new(pool, producer, settings, Metrics::new(), crate::ids::instance_name()))
    }

    /// A dispatcher over `pool` (the runtime role's) named `id` (unique per process: it is the lease holder,
    /// `locked_by`).
    pub fn new(pool: PgPool, producer: Producer, settings: DispatcherSettings, metrics: Metrics, id: String) -> Self {
        metrics.init_dispatcher();
        // The gate shares the window's job: off with it.
        let queue_wait = if settings.window > 0 { settings.queue_wait } else { Duration::ZERO };
        let gate = std::sync::Arc::new(gate::Gate::new(queue_wait));
        Self { pool, producer, settings, metrics, id, gate, backlogged: Default::default(), refill: Default::default() }
    }

    /// One pass over every workspace with due events (a sweep): the workspaces come from the `SECURITY DEFINER`
    /// function, then each gets one batch relayed, as in `Dispatcher::relay`.
    pub async fn dispatch_once(&self) -> Result<DispatchOutcome, crate::Error> {
        self.dispatch_once_inner(None).await.public()
    }

    /// A sweep; with `background`, its marks are recorded there (see [`Dispatcher::dispatch_group`]).
    async fn dispatch_once_inner(&self, background: Option<&Recorder>) -> anyhow::Result<DispatchOutcome> {
        // A slow sweep, as under a long-held snapshot, in tests.
        crate::fail_point!("dispatcher::sweep");
        let due = claim::due_workspaces(&self.pool, WORKSPACES_PER_PASS)
            .await
            .context("Failed to list workspaces with due events")?;
        let truncated = due.len() >= WORKSPACES_PER_PASS as usize;
        let expired: HashSet<WorkspaceId> = due.iter().filter(|d| d.expired_leases).map(|d| d.workspace).collect();
        let workspaces: Vec<WorkspaceId> = due.into_iter().map(|d| d.workspace).collect();
        // A sweep meets backlogs: small groups, many of them, so that one group's claim, publish and mark overlap
        // with the others' (with one big group per slot, every slot would wait on PostgreSQL, then all on Redis).
        let per_group = workspaces.len().div_ceil(self.settings.concurrency.max(1) * 8).clamp(1, WORKSPACES_PER_CLAIM);
        let mut outcome = self.relay(workspaces, per_group, &expired, background).await?;
        if let DispatchOutcome::Worked(settled) = &mut outcome {
            // More workspaces are due than one pass looks at: the rest count as left behind.
            settled.full += u64::from(truncated);
        }
        Ok(outcome)
    }

    /// Relays one batch of each of `workspaces`: in groups of `per_group`, each group claimed in one statement,
    /// published in one pipeline and marked in one statement, `concurrency` groups at a time. Expired leases are taken
    /// over in the workspaces of `expired` only (a sweep's; named passes have none).
    async fn relay(
        &self,
        workspaces: Vec<WorkspaceId>,
        per_group: usize,
        expired: &HashSet<WorkspaceId>,
        background: Option<&Recorder>,
    ) -> anyhow::Result<DispatchOutcome> {
        if workspaces.is_empty() {
            return Ok(DispatchOutcome::Idle);
        }
        let mut results = futures_util::stream::iter(workspaces.chunks(per_group).map(<[_]>::to_vec))
            .map(|group| {
                let expired: Vec<WorkspaceId> = group.iter().copied().filter(|w| expired.contains(w)).collect();
                self.dispatch_group(group, expired, background)
            })
            .buffer_unordered(self.settings.concurrency);
        let mut total = Settled::default();
        let mut first_error = None;
        while let Some(result) = results.next().await {
            match result {
                Ok(s) => {
                    total.dispatched += s.dispatched;
                    total.retried += s.retried;
                    total.dead_lettered += s.dead_lettered;
                    total.lost_lease += s.lost_lease;
                    total.full += s.full;
                }
                Err(e) => {
                    self.metrics.outbox_dispatch_errors.with_label_values(&["database"]).inc();
                    first_error.get_or_insert(e);
                }
            }
        }
        match first_error {
            Some(e) if total == Settled::default() => Err(e),
            Some(e) => {
                tracing::warn!(error = ?e, "Some workspaces failed in this pass");
                Ok(DispatchOutcome::Worked(total))
            }
            None => Ok(DispatchOutcome::Worked(total)),
        }
    }

    fn message(event: &ClaimedEvent) -> Message {
        let (traceparent, tracestate) = event.traceparent.as_deref().map(telemetry::from_stored).unzip();
        let tracestate = tracestate.flatten();
        Message {
            queue: event.queue.clone(),
            event_id: event.id,
            workspace_id: event.workspace_id,
            event_type: event.event_type.clone(),
            payload: event.event_payload.to_string(),
            operation_id: event.operation_id,
            attempt: event.job_attempts + 1,
            enqueued_at_ms: event.created_at.timestamp_millis(),
            due_at_ms: (event.next_attempt_at > event.created_at).then(|| event.next_attempt_at.timestamp_millis()),
            traceparent: traceparent.map_or_else(telemetry::new_traceparent, str::to_owned),
            tracestate: tracestate.map(str::to_owned),
            redrive: event.redrive_count,
            class: event.workspace_class.clone(),
            options: JobOptions {
                max_attempts: event.max_attempts,
                timeout_ms: event.timeout_ms,
                backoff_ms: event.backoff_ms.zip(event.backoff_max_ms),
            },
        }
    }

    /// Claims, publishes and records one batch of each of `workspaces`. With `background`, the recording (the mark)
    /// goes to the background [`Recorder`] and the [`Settled`] returned counts the full batches and the events handed
    /// off only (their marks are still to come), so that the caller can go on to the next batch at once. Safe for the
    /// leases: a batch being recorded stays leased, so no claim takes it (what waits for the recorder is bounded to
    /// about a second of marks, far inside a lease). Safe for order: the batch's `XADD` is done before the next claim.
    async fn dispatch_group(
        &self,
        workspaces: Vec<WorkspaceId>,
        expired: Vec<WorkspaceId>,
        background: Option<&Recorder>,
    ) -> anyhow::Result<Settled> {
        let Some(batch) = self.hand_off(&workspaces, &expired).await? else {
            return Ok(Settled::default());
        };
        match background {
            None => batch.record(&self.pool, &self.producer, &self.id, &self.settings).await,
            Some(recorder) => {
                let (full, dispatched) = (batch.full.len() as u64, batch.delivered.len() as u64);
                self.refill.lock().expect("refill lock").extend(batch.full.iter().copied());
                recorder.send(batch).await;
                Ok(Settled { full, dispatched, ..Settled::default() })
            }
        }
    }

    /// Claims one batch of each of `workspaces` (and their expired leases in `expired`) and publishes it; `None` when
    /// nothing was due.
    async fn hand_off(&self, workspaces: &[WorkspaceId], expired: &[WorkspaceId]) -> anyhow::Result<Option<HandedOff>> {
        let t0 = std::time::Instant::now();
        let mut gated = self.gate.rooms();
        // The light workspaces first: they may take all of a gated queue's room left, the others a fair part each.
        let mut workspaces = workspaces.to_vec();
        {
            let backlogged = self.backlogged.lock().expect("backlogged lock");
            workspaces.sort_by_key(|w| backlogged.contains(w));
            gated.light_first = workspaces.iter().filter(|w| !backlogged.contains(w)).count();
        }
        let events = claim::claim(
            &self.pool,
            &workspaces,
            expired,
            &self.id,
            self.settings.lease,
            &claim::Bounds { gated, ..claim::Bounds::new(self.settings.batch_size, self.settings.window) },
        )
        .await
        .context("Failed to claim events")?;
        {
            // A workspace's class changes with a claim that took some of its jobs; one that got none (held back by
            // the window or the gate) keeps its class.
            let mut backlogged = self.backlogged.lock().expect("backlogged lock");
            if backlogged.len() > 100_000 {
                // Workspaces that went quiet: forgotten (light again) rather than kept forever.
                backlogged.clear();
            }
            for event in &events {
                let workspace = WorkspaceId(event.workspace_id);
                if event.workspace_class == "backlogged" {
                    backlogged.insert(workspace);
                } else {
                    backlogged.remove(&workspace);
                }
            }
        }
        let mut per_queue: HashMap<&str, u64> = HashMap::new();
        for event in &events {
            *per_queue.entry(event.queue.as_str()).or_default() += 1;
        }
        for (queue, count) in per_queue {
            self.gate.relayed(queue, count);
        }
        if events.is_empty() {
            return Ok(None);
        }
        self.metrics.outbox_batch_size.observe(events.len() as f64);
        let mut per_workspace: HashMap<Uuid, i64> = HashMap::new();
        for event in &events {
            *per_workspace.entry(event.workspace_id).or_default() += 1;
        }
        let full: Vec<WorkspaceId> = per_workspace
            .iter()
            .filter(|(_, n)| **n >= self.settings.batch_size)
            .map(|(w, _)| WorkspaceId(*w))
            .collect();
        // With traces exported, each job's hand-off is a span, a child of the request that enqueued the job, and the
        // stream entry carries the span's context on to the worker.
        let spans: Vec<tracing::Span> =
            if telemetry::exporting() { events.iter().map(relay_span).collect() } else { Vec::new() };
        let mut messages: Vec<Message> = events.iter().map(Self::message).collect();
        for (message, span) in messages.iter_mut().zip(&spans) {
            if let Some(traceparent) = telemetry::traceparent_of(span) {
                message.traceparent = traceparent;
                message.tracestate = telemetry::tracestate_of(span);
            }
        }
        let t1 = std::time::Instant::now();
        let results = self.producer.publish(&messages).await;
        tracing::debug!(
            events = events.len(),
            claim_ms = (t1 - t0).as_secs_f64() * 1e3,
            publish_ms = t1.elapsed().as_secs_f64() * 1e3,
            "Batch handed off"
        );
        crate::fail_point!("dispatcher::after_xadd");

        let backoff = Backoff { base: self.settings.backoff_base, max: self.settings.backoff_max };
        let now = chrono::Utc::now();
        let mut batch = HandedOff { delivered: Vec::with_capacity(events.len()), failures: Vec::new(), full };
        for (i, (event, result)) in events.iter().zip(results).enumerate() {
            if let (Some(span), Err(_)) = (spans.get(i), &result) {
                span.record("otel.status_code", "ERROR");
            }
            match result {
                Ok(stream_id) => {
                    let latency = (now - event.created_at).to_std().unwrap_or_default();
                    self.metrics
                        .outbox_dispatch_latency
                        .with_label_values(&[&event.queue])
                        .observe(latency.as_secs_f64());
                    self.metrics.outbox_dispatched.with_label_values(&[&event.queue]).inc();
                    batch.delivered.push(Delivered::new(event, stream_id));
                }
                Err(e) => {
                    let reason = if e.is_unavailable() { "redis_unavailable" } else { "redis_error" };
                    self.metrics.outbox_dispatch_errors.with_label_values(&[reason]).inc();
                    let attempt = event.attempt_count + 1;
                    if attempt >= self.settings.max_attempts {
                        // The same rule `settle` applies: this failure dead-letters the event.
                        self.metrics.outbox_dead_letters.with_label_values(&[&event.queue]).inc();
                    }
                    batch.failures.push(Failure {
                        workspace: WorkspaceId(event.workspace_id),
                        id: event.id,
                        attempt,
                        delay: backoff.delay(attempt as u32),
                        error: redact(&format!("XADD failed: {e}")),
                        redrive: event.redrive_count,
                    });
                }
            }
        }
        Ok(Some(batch))
    }

    /// Refreshes the backlog gauges from `conveyor_outbox_backlog_due()` (migrations 0029, 0060): jobs per queue and
    /// state (`due`, `held` by a pause, `delayed`, `waiting_children`, `dispatching`, `dispatched` to the workers and
    /// not ended, `dead_letter`), and per queue the age of the oldest due job, counted from when it fell due (0 when
    /// none is): a job delayed on purpose, or a retry backing off, ages nothing until it is due.
    pub async fn observe_backlog(&self) -> Result<(), sqlx::Error> {
        let rows: Vec<(String, String, i64, Option<f64>)> =
            sqlx::query_as("SELECT queue, state, jobs, oldest_due_seconds FROM conveyor.conveyor_outbox_backlog_due()")
                .fetch_all(&self.pool)
                .await?;
        // Every queue a worker registered, or the backlog shows, counts its dispatches and dead letters from 0.
        let registered: Vec<String> =
            sqlx::query_scalar("SELECT DISTINCT queue FROM conveyor.job_kinds").fetch_all(&self.pool).await?;
        self.metrics.init_queues(registered.iter().chain(rows.iter().map(|row| &row.0)).map(String::as_str));
        // Queues with workers: the gate looks at them before their first jobs come.
        self.gate.know(&registered);
        self.metrics.outbox_events.reset();
        self.metrics.outbox_oldest_pending_age.reset();
        for (queue, state, jobs, oldest_due) in rows {
            self.metrics.outbox_events.with_label_values(&[&queue, &state]).set(jobs);
            let gauge = self.metrics.outbox_oldest_pending_age.with_label_values(&[&queue]);
            gauge.set(gauge.get().max(oldest_due.unwrap_or(0.0).max(0.0)));
        }
        let (pauses,): (i64,) =
            sqlx::query_as("SELECT count(*) FROM conveyor.dispatch_pauses").fetch_one(&self.pool).await?;
        self.metrics.dispatch_pauses.set(pauses);
        Ok(())
    }

    /// Relays until `shutdown`. A notification names the workspace that committed events, and the next pass relays
    /// the workspaces named since the last one, with no lookup. A sweep ([`Dispatcher::dispatch_once`]) runs at
    /// start, every poll interval (events backing off, expired leases, a notification lost with the LISTEN
    /// connection) and right after a sweep that met more workspaces than it looks at; a workspace whose batch came
    /// back full is named for the next pass. The marks of every pass are recorded in the background, several passes
    /// together, while the next passes run (the relay's path is claim and `XADD` only); every batch handed off is
    /// recorded, and so its leases settled, before `run` returns. Awake (it saw work in the last second, and for two seconds after), it ticks instead of waiting
    /// for notifications, which enqueues then skip. Between passes it sleeps until the next tick while awake, else
    /// until the next poll, or until the earliest delayed job is due if sooner.
    /// The `LISTEN` holds one connection of the dispatcher's pool for as long as it runs.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), crate::Error> {
        self.run_inner(shutdown).await.public()
    }

    async fn run_inner(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        crate::db::ensure_runtime_role(&self.pool, "dispatcher").await?;
        match crate::stream::admin::check_server(self.producer.client()).await {
            Ok(check) => tracing::info!(version = %check.version, policy = ?check.maxmemory_policy, "Redis checked"),
            Err(e) => tracing::warn!(error = %redact(&e.to_string()), "Could not check Redis at start-up"),
        }
        // Raised to the configured partitions now, not at the first job: workers start reading the new streams.
        match self.producer.layout().await {
            Ok(layout) => tracing::info!(partitions = layout.latest(), "Stream partition layout"),
            Err(e) => tracing::warn!(error = %redact(&e.to_string()), "Could not read the stream partition layout yet"),
        }
        // The listener runs in a task of its own, so that its `recv` is never cancelled half-way by the select below;
        // it forwards what each notification asks for, and a sweep each time it (re)opens: after a PostgreSQL restart
        // or a connection reset it listens again, and the sweep finds what was committed meanwhile.
        let mut channels = vec![NOTIFY_CHANNEL];
        if self.settings.window > 0 {
            // A job that ends frees room in its workspace's window: top that workspace up at once.
            channels.push(crate::outbox::DONE_CHANNEL);
        }
        let (wake_tx, mut wake) = mpsc::unbounded_channel::<Wake>();
        let poll = self.settings.poll_interval;
        let listening = tokio::spawn(listen::listen(self.pool.clone(), channels, wake_tx, shutdown.clone()));
        // The gate's looks, when it is on; a look that opens room in a queue that had none wakes the loop.
        let room_opened = std::sync::Arc::new(tokio::sync::Notify::new());
        let measuring = (!self.gate.is_off()).then(|| {
            self.gate.start();
            let (gate, producer) = (self.gate.clone(), self.producer.clone());
            tokio::spawn(measure(gate, producer, room_opened.clone(), shutdown.clone()))
        });
        tracing::info!(id = %self.id, "Dispatcher started");
        let mut last_backlog = tokio::time::Instant::now() - Duration::from_secs(60);
        let mut last_sweep = tokio::time::Instant::now();
        let mut sweep = true;
        let mut named: HashSet<WorkspaceId> = HashSet::new();
        // The earliest time a pending job becomes due, as far as this dispatcher knows: read after each sweep, lowered
        // by notifications of delayed jobs. The loop sleeps until then (or the poll), so a delayed job fires on time.
        let mut next_due: Option<DateTime<Utc>> = None;
        // Every pass's marks are recorded in the background, while the next pass runs.
        let recorder = Recorder::start(&self);
        let mut awake = Awake::new(self.settings.tick);
        while !shutdown.is_cancelled() {
            if last_backlog.elapsed() >= Duration::from_secs(5) {
                if let Err(e) = self.observe_backlog().await {
                    tracing::warn!(error = ?e, "Could not read the outbox backlog");
                }
                last_backlog = tokio::time::Instant::now();
            }
            sweep |= last_sweep.elapsed() >= poll || next_due.is_some_and(|d| d <= Utc::now());
            // Named workspaces stay named through a sweep: it may not reach them all, and a claim that finds nothing
            // costs little.
            let pass = if sweep {
                sweep = false;
                last_sweep = tokio::time::Instant::now();
                let swept = std::time::Instant::now();
                awake.swept();
                self.metrics.outbox_relay_passes.with_label_values(&["sweep"]).inc();
                // Due schedules enqueue their tick's job first, so that this sweep relays it; sleep for the next tick.
                let next_tick = crate::schedule::fire_for_sweep(&self.pool).await;
                let pass = self.dispatch_once_inner(Some(&recorder)).await;
                // Only jobs that fall due after the sweep started: one due before was the sweep's to take, and one it
                // did not take waits for a reason that a moment does not change (its workspace's window is full, a
                // pause holds it, another dispatcher has it), the next notification or sweep, not a spin. Nor jobs
                // due at their commit: the commit's notification names their workspace (migration 0030).
                next_due = match claim::next_due_after(&self.pool, swept.elapsed()).await {
                    // A job that fell due during the sweep is swept for at once, unless the sweep found nothing
                    // to claim (the job is held for a moment by someone else): then shortly after, not in a spin.
                    Ok(Some(due)) if due <= Utc::now() && matches!(pass, Ok(DispatchOutcome::Idle)) => {
                        Some(Utc::now() + chrono::Duration::milliseconds(10))
                    }
                    Ok(due) => due,
                    Err(e) => {
                        tracing::warn!(error = ?e, "Could not read when the next job is due; polling");
                        None
                    }
                };
                next_due = crate::schedule::sooner(next_due, next_tick);
                pass
            } else if awake.ticking() && (named.is_empty() || awake.lookup_due()) {
                // Awake, enqueues notify nobody: every workspace with due jobs is looked up, once an interval, and
                // relayed as named ones are.
                self.metrics.outbox_relay_passes.with_label_values(&["tick"]).inc();
                self.tick(&mut awake, &mut named, &recorder).await
            } else {
                // Named workspaces are a trickle (an event or a few each): as few statements as can be.
                self.metrics.outbox_relay_passes.with_label_values(&["named"]).inc();
                self.relay(named.drain().collect(), WORKSPACES_PER_CLAIM, &HashSet::new(), Some(&recorder)).await
            };
            // Jobs the gate holds back come in as the workers take the queue's entries: still work.
            let mut saw_work =
                matches!(&pass, Ok(DispatchOutcome::Worked(s)) if s.dispatched > 0 || s.full > 0) || self.gate.busy();
            match pass {
                // A lost lease leaves nothing due now: the job ended or asked for a retry before its hand-off was
                // recorded (routine for a fast job), or another dispatcher took the lease over. Only a lease that
                // expired with no one taking it is due, and the next poll's sweep takes it. Sweeping again at once
                // for each (as before 0030's release) kept a steady trickle of fast jobs sweeping without pause.
                // A workspace whose batch came back full is relayed again at once by name; a sweep that met more
                // workspaces than it looks at sweeps again.
                Ok(DispatchOutcome::Worked(settled)) => {
                    let refill: Vec<WorkspaceId> = self.refill.lock().expect("refill lock").drain().collect();
                    sweep = settled.full > refill.len() as u64;
                    named.extend(refill);
                }
                Ok(DispatchOutcome::Idle) => {}
                Err(e) => tracing::warn!(error = ?e, "Dispatch pass failed; retrying after the poll interval"),
            }
            // Notifications that arrived during the pass.
            while let Ok(w) = wake.try_recv() {
                saw_work |= w.workspace.is_some();
                w.note(&mut named, &mut sweep, &mut next_due);
            }
            if saw_work {
                awake.saw_work(&self.pool).await;
            }
            if awake.fell_asleep() {
                // Delayed jobs written while it was awake notified nobody: the sweep's look ahead sets the timer.
                sweep = true;
            }
            if sweep || !named.is_empty() {
                continue;
            }
            let mut until = poll.saturating_sub(last_sweep.elapsed());
            if let Some(due) = next_due {
                until = until.min((due - Utc::now()).to_std().unwrap_or_default());
            }
            if awake.ticking() {
                until = until.min(awake.interval());
            }
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(until) => {}
                Some(w) = wake.recv() => w.note(&mut named, &mut sweep, &mut next_due),
                // Jobs the gate held may go now: awake, the next ticks look for them.
                _ = room_opened.notified() => {
                    awake.saw_work(&self.pool).await;
                    // With ticks off, a sweep looks instead.
                    sweep |= !awake.ticking();
                }
            }
        }
        listening.abort();
        if let Some(measuring) = measuring {
            measuring.abort();
        }
        recorder.finish().await;
        tracing::info!(id = %self.id, "Dispatcher stopped");
        Ok(())
    }
}

impl Dispatcher {
    /// One tick of an awake dispatcher: looks up the workspaces with due jobs (as a sweep does, with no schedules and
    /// no look ahead) and relays them with the named ones, their marks recorded in the background.
    async fn tick(
        &self,
        awake: &mut Awake,
        named: &mut HashSet<WorkspaceId>,
        recorder: &Recorder,
    ) -> anyhow::Result<DispatchOutcome> {
        let started = tokio::time::Instant::now();
        let due = claim::due_workspaces(&self.pool, WORKSPACES_PER_PASS)
            .await
            .context("Failed to list workspaces with due events")?;
        awake.looked_up_in(started);
        let expired: HashSet<WorkspaceId> = due.iter().filter(|d| d.expired_leases).map(|d| d.workspace).collect();
        let mut workspaces: Vec<WorkspaceId> = due.into_iter().map(|d| d.workspace).collect();
        workspaces.extend(named.drain().filter(|w| !workspaces.contains(w)).collect::<Vec<_>>());
        self.relay(workspaces, WORKSPACES_PER_CLAIM, &expired, Some(recorder)).await
    }
}

/// Looks at the queues workers registered, as [`gate::Gate::active`] says, for the gate, all at once; tells
/// `room_opened` when a look opened room in a queue that had none.
async fn measure(
    gate: std::sync::Arc<gate::Gate>,
    producer: Producer,
    room_opened: std::sync::Arc<tokio::sync::Notify>,
    shutdown: CancellationToken,
) {
    let mut every = tokio::time::interval(gate::MEASURE_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing: HashSet<String> = HashSet::new();
    while !shutdown.is_cancelled() {
        every.tick().await;
        let looks = gate.active().into_iter().map(|queue| {
            let (relayed, at) = (gate.look_begins(&queue), std::time::Instant::now());
            let producer = &producer;
            async move { (producer.queue_load(&queue).await, queue, relayed, at) }
        });
        for (load, queue, relayed, at) in futures_util::future::join_all(looks).await {
            match load {
                Ok(load) => {
                    if gate.observe(&queue, at, load, relayed) {
                        room_opened.notify_one();
                    }
                    if failing.remove(&queue) {
                        tracing::info!(queue = %queue, "The gate can look at the queue again");
                    }
                }
                // Not gated once its last look is a few seconds old (the window bounds it meanwhile).
                Err(e) if failing.insert(queue.clone()) => tracing::warn!(
                    queue = %queue, error = %redact(&e.to_string()),
                    "The gate cannot look at a queue; it stops gating it after a few seconds"
                ),
                Err(_) => {}
            }
        }
    }
}

/// How long a dispatcher that sees work says it is awake (`dispatchers_awake`, migration 0039): until then enqueues
/// notify nobody. It says so again when less than half is left and it still sees work.
const AWAKE_FOR: Duration = Duration::from_secs(1);

/// How long a dispatcher goes on ticking after its mark lapsed: for the transactions that read the mark, skipped their
/// notification and commit later. One that commits later still (or after its dispatcher died) waits for a sweep.
const AWAKE_GRACE: Duration = Duration::from_secs(2);

/// A tick's look-up may cost at most this share of the time between ticks: under a long-held snapshot the look-up
/// walks every row version the snapshot keeps, and ticks then come further apart instead of taking a core.
const TICK_SHARE: u32 = 4;

/// Whether this dispatcher is awake: it keeps its mark ahead while it sees work, and ticks (looks for new jobs
/// unnotified) until [`AWAKE_GRACE`] after its mark lapsed.
struct Awake {
    tick: Duration,
    /// When the mark this dispatcher wrote lapses, by its own clock (taken after the write, so never before
    /// PostgreSQL's).
    until: Option<tokio::time::Instant>,
    /// The last tick's look-up: how long it took, and when it started.
    lookup: Duration,
    looked_up_at: Option<tokio::time::Instant>,
    /// Whether it ticked at the last look.
    was_ticking: bool,
}

impl Awake {
    fn new(tick: Duration) -> Self {
        Self { tick, until: None, lookup: Duration::ZERO, looked_up_at: None, was_ticking: false }
    }

    /// Work was seen (a notification, or jobs handed off): keeps the mark ahead. Off (a zero tick), never marks.
    async fn saw_work(&mut self, pool: &PgPool) {
        let now = tokio::time::Instant::now();
        if self.tick.is_zero() || self.until.is_some_and(|until| until > now + AWAKE_FOR / 2) {
            return;
        }
        match claim::mark_awake(pool, AWAKE_FOR).await {
            Ok(()) => self.until = Some(tokio::time::Instant::now() + AWAKE_FOR),
            // Enqueues go on notifying: nothing is late.
            Err(e) => tracing::warn!(error = %redact(&e.to_string()), "Could not mark the dispatcher awake"),
        }
    }

    /// Whether it ticks now.
    fn ticking(&self) -> bool {
        self.until.is_some_and(|until| tokio::time::Instant::now() < until + AWAKE_GRACE)
    }

    /// Whether it stopped ticking since the last call.
    fn fell_asleep(&mut self) -> bool {
        let ticking = self.ticking();
        let fell = self.was_ticking && !ticking;
        self.was_ticking = ticking;
        fell
    }

    /// A sweep looked up every workspace with due jobs: the next tick need not before an interval.
    fn swept(&mut self) {
        self.looked_up_at = Some(tokio::time::Instant::now());
    }

    fn looked_up_in(&mut self, started: tokio::time::Instant) {
        self.lookup = started.elapsed();
        self.looked_up_at = Some(started);
    }

    /// Whether the next tick looks up the workspaces with due jobs: once an interval. Between, workspaces already
    /// named (a batch came back full, a notification) are relayed by name, with no look-up: in a backlog, a look-up
    /// before every batch cost as much as the batch's claim.
    fn lookup_due(&self) -> bool {
        self.looked_up_at.is_none_or(|at| at.elapsed() >= self.interval())
    }

    /// The time between ticks: the setting, or longer when look-ups are slow.
    fn interval(&self) -> Duration {
        self.tick.max(self.lookup * TICK_SHARE)
    }
}

/// A batch handed to Redis (or refused by it), not yet recorded in PostgreSQL.
struct HandedOff {
    delivered: Vec<Delivered>,
    failures: Vec<Failure>,
    /// Workspaces whose batch came back full.
    full: Vec<WorkspaceId>,
}

impl HandedOff {
    /// Records the batch: marks the delivered events `dispatched` (fenced by the lease of `me`), backs off or
    /// dead-letters the failed ones. Then shortens the delivered events' de-dup keys to
    /// [`DispatcherSettings::dedup_ttl_recorded`], so that Redis holds keys for the last minutes of traffic instead
    /// of the last day's. That holds for an event whose lease this dispatcher lost as well: another dispatcher has
    /// claimed it again (and sends it within moments), or will at its next sweep, or a failed run of its job moved it
    /// to a new generation, which has a key of its own.
    async fn record(
        self,
        pool: &PgPool,
        producer: &Producer,
        me: &str,
        settings: &DispatcherSettings,
    ) -> anyhow::Result<Settled> {
        crate::fail_point!("dispatcher::before_mark");
        let started = std::time::Instant::now();
        let mut settled = claim::settle(pool, me, &self.delivered, &self.failures, settings.max_attempts)
            .await
            .context("Failed to record the outcome of a batch")?;
        settled.full = self.full.len() as u64;
        if !self.delivered.is_empty() {
            let keys: Vec<(&str, &str, Uuid, i32)> =
                self.delivered.iter().map(|d| (d.queue.as_str(), d.stream_id.as_str(), d.id, d.redrive)).collect();
            if let Err(e) = producer.expire_dedup(&keys, settings.dedup_ttl_recorded).await {
                // Harmless: the keys expire after their full life instead.
                tracing::warn!(error = %redact(&e.to_string()), "Could not shorten the de-dup keys of a recorded batch");
            }
        }
        tracing::debug!(
            events = self.delivered.len() + self.failures.len(),
            settle_ms = started.elapsed().as_secs_f64() * 1e3,
            "Batch recorded"
        );
        if settled.dead_lettered > 0 {
            tracing::error!(count = settled.dead_lettered, "Outbox events dead-lettered");
        }
        if let Some(f) = self.failures.first() {
            tracing::warn!(workspace = %f.workspace, failed = self.failures.len(), attempt = f.attempt, error = %f.error, "Hand-off failed; backing off");
        }
        if settled.lost_lease > 0 {
            // Not a warning: routine when a job fails fast, before its hand-off is recorded.
            tracing::info!(
                count = settled.lost_lease,
                "Lease lost before marking (expired and taken by another dispatcher, or the job already ran and asked for a retry)"
            );
        }
        Ok(settled)
    }
}

/// Records the batches of the loop's passes in the background, several at a time. At a trickle every notified pass
/// hands off an event or two, and recording each batch on its own cost PostgreSQL a statement per pass, beside the
/// claim; in a backlog, a mark recorded in line held the next claim back by as long as the claim itself. Here one task
/// takes a batch, waits [`RECORD_LINGER`] for the passes that follow, and records all that have come with one mark,
/// merging batches until it holds [`RECORD_MAX`] events. The wait is off the latency path (the events are in the stream
/// already) and far inside their lease. At most [`RECORD_WAITING`] events wait (a bigger batch alone), and at most
/// [`RECORD_QUEUE`] batches; a pass that finds no room waits for it (back-pressure on the relay when PostgreSQL is
/// slow), so that what waits is recorded well inside its lease.
struct Recorder {
    queue: mpsc::Sender<(HandedOff, tokio::sync::OwnedSemaphorePermit)>,
    /// Room for events waiting to be recorded: a batch holds its permits until its mark is done.
    room: std::sync::Arc<tokio::sync::Semaphore>,
    task: tokio::task::JoinHandle<()>,
}

/// How long the background recorder waits for more batches before it records what it has.
const RECORD_LINGER: Duration = Duration::from_millis(10);

/// Batches that may wait for the background recorder. Far more than the passes of one linger (a trickle of a
/// thousand events a second is some ten passes), so that a full queue means PostgreSQL is slow, not that it lingers.
const RECORD_QUEUE: usize = 1024;

/// Events that may wait for the background recorder: some passes' worth, a second or so of marks, far inside a lease
/// (a mark records some 20,000 events a second on a loaded 2-core machine; the lease is at least a second, 30 s by
/// default). A batch bigger than this waits alone.
const RECORD_WAITING: usize = 20_000;

/// A mark merges batches until it holds this many events.
const RECORD_MAX: usize = 10_000;

impl Recorder {
    fn start(dispatcher: &Dispatcher) -> Self {
        let (queue, mut batches) = mpsc::channel::<(HandedOff, tokio::sync::OwnedSemaphorePermit)>(RECORD_QUEUE);
        let room = std::sync::Arc::new(tokio::sync::Semaphore::new(RECORD_WAITING));
        let (pool, producer, me, settings) =
            (dispatcher.pool.clone(), dispatcher.producer.clone(), dispatcher.id.clone(), dispatcher.settings.clone());
        let metrics = dispatcher.metrics.clone();
        let task = tokio::spawn(async move {
            // A batch already waiting when the last mark ended: recorded without a linger (the relay is ahead).
            let mut waiting: Option<(HandedOff, tokio::sync::OwnedSemaphorePermit)> = None;
            loop {
                let (mut merged, mut permits) = match waiting.take() {
                    Some(batch) => batch,
                    None => {
                        let Some(batch) = batches.recv().await else { break };
                        tokio::time::sleep(RECORD_LINGER).await;
                        batch
                    }
                };
                while merged.delivered.len() + merged.failures.len() < RECORD_MAX {
                    let Ok((next, more)) = batches.try_recv() else { break };
                    merged.delivered.extend(next.delivered);
                    merged.failures.extend(next.failures);
                    permits.merge(more);
                }
                let recorded = merged.record(&pool, &producer, &me, &settings).await;
                drop(permits);
                if let Err(e) = recorded {
                    // The leases expire and the events go out again, where their de-dup keys find them in the stream.
                    metrics.outbox_dispatch_errors.with_label_values(&["database"]).inc();
                    tracing::warn!(error = ?e, "Recording relayed batches failed; they are relayed again after their lease");
                }
                waiting = batches.try_recv().ok();
            }
        });
        Self { queue, room, task }
    }

    async fn send(&self, batch: HandedOff) {
        let events = (batch.delivered.len() + batch.failures.len()).clamp(1, RECORD_WAITING) as u32;
        // Never closed; the task ends only once the queue is closed, by `finish`.
        let permits = self.room.clone().acquire_many_owned(events).await.expect("the recorder's room is never closed");
        let _ = self.queue.send((batch, permits)).await;
    }

    /// Records every batch sent, then stops.
    async fn finish(self) {
        drop(self.queue);
        if let Err(e) = self.task.await {
            tracing::error!(error = %e, "The background recorder failed");
        }
    }
}

/// What a notification asks for: relay its workspace (and wake when its delayed job is due), or sweep when it named
/// none or could not be read.
#[derive(Debug, Default, PartialEq, Eq)]
struct Wake {
    workspace: Option<WorkspaceId>,
    due: Option<DateTime<Utc>>,
}

impl Wake {
    /// Reads `<workspace>` or `<workspace>@<ms since the epoch>` (see [`crate::outbox::NOTIFY_CHANNEL`]).
    fn parse(payload: &str) -> Self {
        let (workspace, due) = match payload.split_once('@') {
            Some((w, ms)) => (w, ms.parse().ok().and_then(DateTime::from_timestamp_millis)),
            None => (payload, None),
        };
        Self { workspace: workspace.parse().ok().map(WorkspaceId), due }
    }

    fn note(self, named: &mut HashSet<WorkspaceId>, sweep: &mut bool, next_due: &mut Option<DateTime<Utc>>) {
        match self.workspace {
            Some(workspace) => {
                named.insert(workspace);
            }
            None => *sweep = true,
        }
        if let Some(due) = self.due {
            *next_due = Some(next_due.map_or(due, |d| d.min(due)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_notification_names_its_workspace_and_when_its_delayed_job_is_due() {
        let ws = uuid::Uuid::now_v7();
        assert_eq!(Wake::parse(&ws.to_string()), Wake { workspace: Some(WorkspaceId(ws)), due: None });
        let at = DateTime::from_timestamp_millis(1_800_000_000_123).unwrap();
        assert_eq!(
            Wake::parse(&format!("{ws}@1800000000123")),
            Wake { workspace: Some(WorkspaceId(ws)), due: Some(at) }
        );
        assert_eq!(Wake::parse("garbage"), Wake::default());
        let (mut named, mut sweep, mut due) = (HashSet::new(), false, Some(at + chrono::Duration::seconds(1)));
        Wake::parse(&format!("{ws}@1800000000123")).note(&mut named, &mut sweep, &mut due);
        assert_eq!((named.len(), sweep, due), (1, false, Some(at)), "the earlier due time wins");
        Wake::parse("garbage").note(&mut named, &mut sweep, &mut due);
        assert!(sweep);
    }
}
