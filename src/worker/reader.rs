//! The reading side of a worker: new entries (`XREADGROUP`), entries of dead consumers (`XAUTOCLAIM`), and starting
//! a job for each as job slots free up, after one look at PostgreSQL for jobs that must not run (canceled, ended).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::PgPool;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use uuid::Uuid;

use super::execute::{Executor, Start};
use super::runtime::{Done, Lane, Outcome, Queue, Tracker, WorkerSettings};
use super::slots::{Slot, Slots};
use crate::db;
use crate::ids::WorkspaceId;
use crate::metrics::Metrics;
use crate::outbox::transitions::{self, Skip};
use crate::redact::redact;
use crate::stream::RedisError;
use crate::stream::consumer::{Consumer, Entry};
use crate::stream::keys::stream_ref;

/// The reader: its queues' streams (the lanes), the job slots, and the executor it hands each entry to.
pub(super) struct Reader {
    pub(super) consumer: Consumer,
    /// The runtime role's: the look before a read's jobs start (canceled, ended, stopped too often), and the job of
    /// an entry Redis lost.
    pub(super) runtime: PgPool,
    /// The application role's: a lost entry's job re-driven in its workspace.
    pub(super) pool: PgPool,
    pub(super) queues: Vec<Arc<Queue>>,
    /// Every stream of its queues, in the order reads take them; more once the partition layout names more.
    pub(super) lanes: Mutex<Arc<Vec<Lane>>>,
    pub(super) slots: Arc<Slots>,
    pub(super) settings: WorkerSettings,
    pub(super) metrics: Metrics,
    pub(super) tracker: Arc<Tracker>,
    /// Entries of jobs it skipped, for the acker.
    pub(super) acks: mpsc::UnboundedSender<Done>,
    pub(super) executor: Arc<Executor>,
}

impl Reader {
    /// The queues it reads.
    pub(super) fn queues(&self) -> impl Iterator<Item = &str> {
        self.queues.iter().map(|q| q.name.as_str())
    }

    /// Creates the consumer groups (and streams) if missing, in every stream of its queues, and reads all of them
    /// from then on.
    pub(super) async fn ensure_groups(&self) -> Result<(), RedisError> {
        let streams = self.consumer.streams().await?;
        for &partition in &streams {
            for queue in &self.queues {
                self.consumer.ensure_group_in(&queue.name, partition).await?;
            }
        }
        // Queues alternate within each partition, so that a pass over the lanes takes every queue early.
        let lanes = streams.iter().flat_map(|&p| self.queues.iter().map(move |q| (q.clone(), p))).collect();
        *self.lanes.lock().expect("lanes lock") = Arc::new(lanes);
        Ok(())
    }

    /// Starts reading the streams the partition layout names since the last look (after raising
    /// `CONVEYOR_STREAM_PARTITIONS`): their groups are created and they join the lanes.
    async fn follow_layout(&self) -> Result<(), RedisError> {
        let streams = self.consumer.streams().await?;
        let known = self.lanes().len() / self.queues.len().max(1);
        if streams.len() > known {
            tracing::info!(streams = streams.len(), before = known, "More stream partitions; reading them too");
            self.ensure_groups().await?;
        }
        Ok(())
    }

    /// The streams it reads now.
    fn lanes(&self) -> Arc<Vec<Lane>> {
        self.lanes.lock().expect("lanes lock").clone()
    }

    fn spawn_job(
        &self,
        jobs: &TaskTracker,
        queue: Arc<Queue>,
        entry: Entry,
        permit: Slot,
        abandon: CancellationToken,
        start: Start,
    ) {
        // One Arc per job: the executor holds the same metrics (a `Metrics` clone is a few dozen).
        let executor = self.executor.clone();
        executor.metrics.worker_jobs_in_flight.inc();
        jobs.spawn(async move {
            let _permit = permit;
            executor.process(queue, entry, abandon, start).await;
            executor.metrics.worker_jobs_in_flight.dec();
        });
    }

    /// A free slot for a job of `queue`, unless `shutdown` comes first.
    async fn slot(&self, queue: &Queue, shutdown: &CancellationToken) -> Option<Slot> {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => None,
            slot = self.slots.take(&queue.cap) => Some(slot),
        }
    }

    /// Every job slot, once the jobs running now have ended, unless `shutdown` comes first: for a job that may take
    /// its worker down. Reads wait meanwhile (no slot is given out while this waits).
    async fn every_slot(&self, queue: &Queue, shutdown: &CancellationToken) -> Option<Slot> {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => None,
            slot = self.slots.take_all(&queue.cap) => Some(slot),
        }
    }

    /// Waits until a lane's queue has room for a job; then the room of each of `lanes` (at most 256 each), unless
    /// `shutdown` comes first.
    async fn rooms(&self, lanes: &[Lane], shutdown: &CancellationToken) -> Option<Vec<usize>> {
        loop {
            if shutdown.is_cancelled() {
                return None;
            }
            let rooms: Vec<usize> = lanes.iter().map(|(q, _)| self.slots.room(&q.cap).min(256)).collect();
            if rooms.iter().any(|&r| r > 0) {
                return Some(rooms);
            }
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return None,
                _ = self.slots.freed() => {}
                // The lanes may have grown meanwhile (more partitions).
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        }
    }

    /// Starts jobs for `entries`, each as soon as a slot is free (the first takes `first`). Jobs that must not run
    /// (canceled, ended, or gone) are acknowledged as skipped. Entries `taken_over` from a stopped worker count a stop
    /// of their job as they start, so that a job that keeps killing its worker ends (see
    /// [`WorkerSettings::max_deliveries`](super::WorkerSettings::max_deliveries)); one that has already stopped a
    /// worker after a take-over runs alone, holding every slot, so that it takes no other job down with it. Once
    /// `shutdown` fires no job starts: the entries left are neither run nor acknowledged, and another worker takes
    /// them over after the visibility time-out.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn start_jobs(
        &self,
        (queue, partition): &Lane,
        entries: Vec<Entry>,
        taken_over: bool,
        first: Option<Slot>,
        jobs: &TaskTracker,
        abandon: &CancellationToken,
        shutdown: &CancellationToken,
    ) {
        let partition = *partition;
        self.tracker.track(&queue.name, partition, entries.iter().map(|e| e.id.clone()));
        let ids: Vec<(WorkspaceId, Uuid, Option<i32>)> = entries.iter().filter_map(job_of).collect();
        let checked = if taken_over {
            transitions::taken_over(&self.runtime, &ids).await.map(|counted| {
                let skip = counted.iter().filter(|(_, stops)| stops.is_none()).map(|(id, _)| (*id, Skip::NotToRun));
                let skip = skip.collect();
                let stops = counted.into_iter().filter_map(|(id, stops)| Some((id, stops?))).collect();
                (skip, stops)
            })
        } else {
            transitions::to_skip(&self.runtime, &ids).await.map(|skip| (skip, HashMap::new()))
        };
        let (skip, stopped): (HashMap<Uuid, Skip>, HashMap<Uuid, u32>) = match checked {
            Ok(checked) => checked,
            Err(e) => {
                tracing::warn!(queue = %queue.name, error = %redact(&e.to_string()), "Cannot check jobs before running them; leaving them for later");
                self.tracker.untrack(&queue.name, partition, entries.iter().map(|e| &e.id));
                return;
            }
        };
        let mut first = first;
        let mut entries = entries.into_iter();
        while let Some(entry) = entries.next() {
            let skipped = if skip.is_empty() { None } else { job_of(&entry).and_then(|(_, id, _)| skip.get(&id)) };
            if skipped == Some(&Skip::NotToRun) {
                queue.ended(queue.kind_slot(entry.fields.get("type")), Outcome::Skipped, Duration::ZERO);
                let _ = self.acks.send((queue.clone(), partition, entry.id, None));
                continue;
            }
            let start = match (skipped, taken_over) {
                (Some(_), _) => Start::Expire,
                (None, true) => Start::TakenOver,
                (None, false) => Start::Read,
            };
            let alone = job_of(&entry).and_then(|(_, id, _)| stopped.get(&id)).is_some_and(|&stops| stops >= 1);
            let held = first.take();
            let permit = if alone {
                drop(held); // waiting for every slot while holding one would wait forever
                self.every_slot(queue, shutdown).await
            } else {
                match held {
                    Some(p) => Some(p),
                    None => self.slot(queue, shutdown).await,
                }
            };
            let permit = match permit {
                Some(p) => p,
                None => {
                    let left: Vec<String> = std::iter::once(entry.id).chain(entries.map(|e| e.id)).collect();
                    tracing::info!(queue = %queue.name, left = left.len(), "Stopping: entries read but not started are left to another worker");
                    self.tracker.untrack(&queue.name, partition, &left);
                    return;
                }
            };
            self.spawn_job(jobs, queue.clone(), entry, permit, abandon.clone(), start);
        }
    }

    /// One entry that waits in its queues now (without blocking), its job run to its end: [`Worker::process_one`]'s
    /// step.
    ///
    /// [`Worker::process_one`]: super::Worker::process_one
    pub(super) async fn take_one(&self) -> anyhow::Result<Option<Outcome>> {
        self.ensure_groups().await?;
        for (queue, partition) in self.lanes().iter() {
            let Some(entry) = self.consumer.read_now_in(&queue.name, *partition, 1).await?.pop() else { continue };
            self.tracker.track(&queue.name, *partition, [entry.id.clone()]);
            let skip = match job_of(&entry) {
                Some(job) => transitions::to_skip(&self.runtime, &[job]).await?.remove(&job.1),
                None => None,
            };
            let start = match skip {
                Some(Skip::NotToRun) => {
                    queue.ended(queue.kind_slot(entry.fields.get("type")), Outcome::Skipped, Duration::ZERO);
                    let _ = self.acks.send((queue.clone(), *partition, entry.id, None));
                    return Ok(Some(Outcome::Skipped));
                }
                Some(Skip::Expired) => Start::Expire,
                None => Start::Read,
            };
            return Ok(Some(self.executor.process(queue.clone(), entry, CancellationToken::new(), start).await));
        }
        Ok(None)
    }

    /// Reads while job slots are free, each queue no more than its room (its cap's free slots, within the worker's).
    /// With one stream to read, a blocking `XREADGROUP` on it. With several (queues, partitions), a pass over all of
    /// them without waiting, starting one further each time, takes what waits until the free slots are spoken for;
    /// only when nothing waits anywhere does it block, on one stream with room in turn and for at most 100 ms, so that
    /// the others are looked at again soon. A stream with nothing costs one quick read, not a wait.
    pub(super) async fn read_loop(
        self: Arc<Self>,
        shutdown: CancellationToken,
        jobs: TaskTracker,
        abandon: CancellationToken,
    ) {
        let block_ms = self.settings.block.as_millis() as u64;
        let mut turn = 0usize;
        let checks = Arc::new(tokio::sync::Semaphore::new(2));
        // Slots are not held while blocked in XREADGROUP (the reclaimer needs them too); entries read beyond the
        // free slots wait for one, and are kept alive by the heartbeat meanwhile.
        loop {
            let lanes = self.lanes();
            let Some(rooms) = self.rooms(&lanes, &shutdown).await else { break };
            let extra = read_beyond_free_slots();
            turn = turn.wrapping_add(1);
            let mut read: Vec<(Lane, Vec<Entry>)> = Vec::new();
            let mut failures = 0;
            if lanes.len() > 1 {
                let mut wanted = self.slots.free().min(256) + extra;
                // A queue's room is its cap's, shared by its partitions' lanes: what one lane read, the next has not.
                let mut left: HashMap<&str, usize> =
                    lanes.iter().zip(&rooms).map(|((q, _), &room)| (q.name.as_str(), room + extra)).collect();
                for k in 0..lanes.len() {
                    if wanted == 0 {
                        break;
                    }
                    let lane = &lanes[(turn + k) % lanes.len()];
                    let room = left.get_mut(lane.0.name.as_str()).expect("every lane's queue");
                    let want = wanted.min(*room);
                    if want == 0 {
                        continue;
                    }
                    match self.consumer.read_now_in(&lane.0.name, lane.1, want as u64).await {
                        Ok(entries) if entries.is_empty() => {}
                        Ok(entries) => {
                            wanted = wanted.saturating_sub(entries.len());
                            *room = room.saturating_sub(entries.len());
                            read.push((lane.clone(), entries));
                        }
                        Err(e) => {
                            failures += 1;
                            tracing::warn!(queue = %lane.0.name, partition = ?lane.1, error = %redact(&e.to_string()), "XREADGROUP failed; retrying");
                        }
                    }
                }
            }
            if read.is_empty() && failures < lanes.len() {
                // Nothing waits anywhere: wait for new entries on one stream whose queue has room.
                let at = (0..lanes.len()).map(|k| (turn + k) % lanes.len()).find(|&at| rooms[at] > 0).unwrap_or(0);
                let lane = &lanes[at];
                let block = if lanes.len() > 1 { block_ms.min(100) } else { block_ms };
                match self.consumer.read_in(&lane.0.name, lane.1, (rooms[at] + extra) as u64, block).await {
                    Ok(entries) if entries.is_empty() => {}
                    Ok(entries) => read.push((lane.clone(), entries)),
                    Err(e) => {
                        failures = lanes.len();
                        tracing::warn!(queue = %lane.0.name, partition = ?lane.1, error = %redact(&e.to_string()), "XREADGROUP failed; retrying");
                    }
                }
            }
            if read.is_empty() {
                if failures >= lanes.len() {
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                    }
                }
                continue;
            }
            // The look at PostgreSQL before starting a read's jobs runs beside the next read, not before it: at most
            // two at once.
            let check = tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                check = checks.clone().acquire_owned() => check.expect("never closed"),
            };
            let (reader, jobs_, abandon, shutdown) = (self.clone(), jobs.clone(), abandon.clone(), shutdown.clone());
            jobs.spawn(async move {
                let _check = check;
                for (lane, entries) in read {
                    reader.start_jobs(&lane, entries, false, None, &jobs_, &abandon, &shutdown).await;
                }
            });
        }
    }

    pub(super) async fn reclaim_loop(
        self: Arc<Self>,
        shutdown: CancellationToken,
        jobs: TaskTracker,
        abandon: CancellationToken,
    ) {
        let min_idle = self.settings.visibility.as_millis() as u64;
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(self.settings.reclaim_interval) => {}
            }
            if let Err(e) = self.follow_layout().await {
                tracing::warn!(error = %redact(&e.to_string()), "Could not read the stream partition layout");
            }
            for lane in self.lanes().iter() {
                if let Err(e) = self.reclaim(lane, min_idle, &jobs, &abandon, &shutdown).await {
                    tracing::warn!(queue = %lane.0.name, partition = ?lane.1, error = ?e, "Reclaiming idle entries failed");
                }
            }
            self.observe_streams().await;
        }
    }

    async fn reclaim(
        self: &Arc<Self>,
        lane: &Lane,
        min_idle: u64,
        jobs: &TaskTracker,
        abandon: &CancellationToken,
        shutdown: &CancellationToken,
    ) -> anyhow::Result<()> {
        let Some(first) = self.slots.try_take(&lane.0.cap) else { return Ok(()) };
        let count = 1 + self.slots.room(&lane.0.cap).min(99) as u64;
        let (name, partition) = (lane.0.name.as_str(), lane.1);
        let reclaimed = self.consumer.reclaim_in(name, partition, min_idle, count).await?;
        if !reclaimed.entries.is_empty() {
            tracing::info!(
                queue = name,
                count = reclaimed.entries.len(),
                "Took over entries idle past the visibility time-out"
            );
            self.metrics.worker_reclaims.with_label_values(&[name]).inc_by(reclaimed.entries.len() as u64);
            // Started beside the reclaim loop, not in it: a job that must run alone waits for every running job to
            // end, and the loop goes on meanwhile (other lanes, new partitions, the streams' gauges).
            let (reader, lane, tracker) = (self.clone(), lane.clone(), jobs.clone());
            let (abandon, shutdown, entries) = (abandon.clone(), shutdown.clone(), reclaimed.entries);
            jobs.spawn(async move {
                reader.start_jobs(&lane, entries, true, Some(first), &tracker, &abandon, &shutdown).await;
            });
        }
        // Pending entries whose data Redis no longer has: the job is re-driven from PostgreSQL.
        for entry_id in reclaimed.deleted {
            let reference = stream_ref(partition, &entry_id);
            if let Some((event_id, workspace)) =
                transitions::event_by_stream_id(&self.runtime, name, &reference).await?
            {
                let mut tx = db::begin_workspace(&self.pool, workspace).await?;
                if transitions::redrive_tx(&mut tx, workspace, event_id, &reference).await? {
                    tracing::warn!(queue = name, event_id = %event_id, "Stream entry lost by Redis; re-driven from PostgreSQL");
                }
                tx.commit().await?;
            }
        }
        Ok(())
    }

    async fn observe_streams(&self) {
        for queue in self.queues() {
            if let Ok(stats) = self.consumer.stats(queue).await {
                let m = &self.metrics;
                m.stream_length.with_label_values(&[queue]).set(stats.length as i64);
                m.stream_pending_entries.with_label_values(&[queue]).set(stats.pending as i64);
                if let Some(lag) = stats.lag {
                    m.stream_group_lag.with_label_values(&[queue]).set(lag as i64);
                }
            }
        }
    }
}

/// Extra entries to read beyond the free slots: none, except in crash tests, which widen the race in which a read
/// returns more entries than there are free slots (the reclaimer took some meanwhile), so that entries wait for one.
fn read_beyond_free_slots() -> usize {
    crate::fail_point!("worker::read_beyond_free_slots", |extra| extra.and_then(|e| e.parse().ok()).unwrap_or(0));
    0
}

/// The workspace, job id and generation an entry names, if it names the first two.
fn job_of(entry: &Entry) -> Option<(WorkspaceId, Uuid, Option<i32>)> {
    let workspace = entry.fields.get("workspace_id")?.parse().ok()?;
    let id = entry.fields.get("event_id")?.parse().ok()?;
    let redrive = entry.fields.get("redrive").and_then(|r| r.parse().ok());
    Some((WorkspaceId(workspace), id, redrive))
}
