//! The settling side of a worker: acknowledging finished entries in batches (after recording, in one call, the ends of
//! jobs that had no transaction of their own), heart-beating running entries so nobody takes them over, and hearing
//! cancellations of running jobs.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::runtime::{Done, Queue, Running, Tracker};
use crate::outbox::CANCEL_CHANNEL;
use crate::outbox::transitions::{self, Finished};
use crate::redact::redact;
use crate::stream::consumer::Consumer;
use crate::stream::keys::Partition;

/// Cancellation notices checked against PostgreSQL in one look-up, at most (the function reads no more).
const MAX_CANCELLATIONS_CHECKED: usize = 1000;

/// The acker: acknowledges what the reader and the executor finished, heart-beats what they hold, and tells running
/// jobs of their cancellation.
pub(super) struct Acker {
    pub(super) consumer: Consumer,
    /// The runtime role's: records of ends across workspaces, the check of cancellation notices.
    pub(super) runtime: PgPool,
    /// Its `LISTEN` connection's pool.
    pub(super) control: PgPool,
    /// The entries' visibility time-out: the heartbeat runs three times within it.
    pub(super) visibility: Duration,
    pub(super) tracker: Arc<Tracker>,
    pub(super) running: Arc<Mutex<Running>>,
}

impl Acker {
    /// Acknowledges (and deletes) finished entries in batches of up to 1,000: whatever has finished since the last
    /// batch. On `stop`, flushes what is left.
    pub(super) async fn ack_loop(self: Arc<Self>, mut queue: mpsc::UnboundedReceiver<Done>, stop: CancellationToken) {
        loop {
            let first = tokio::select! {
                next = queue.recv() => match next { Some(a) => a, None => return },
                _ = stop.cancelled() => match queue.try_recv() { Ok(a) => a, Err(_) => return },
            };
            let mut batch = vec![first];
            while batch.len() < 1000 {
                match queue.try_recv() {
                    Ok(done) => batch.push(done),
                    Err(_) => break,
                }
            }
            self.settle(batch).await;
        }
    }

    /// Settles finished entries: one call recording the ends of the jobs that had no transaction, then one script call
    /// per queue acknowledging (and deleting) the entries. An end that cannot be recorded leaves its entry
    /// unacknowledged: the job runs again after the visibility time-out.
    pub(super) async fn settle(&self, done: Vec<Done>) {
        // By stream: a worker has a queue or a few, each with a stream or a few, so a short list.
        let mut batch: Vec<(Arc<Queue>, Partition, Vec<String>)> = Vec::new();
        let mut finished: Vec<Finished> = Vec::new();
        let mut finished_entries: Vec<(Arc<Queue>, Partition, String)> = Vec::new();
        let add = |batch: &mut Vec<(Arc<Queue>, Partition, Vec<String>)>, q: Arc<Queue>, p: Partition, id: String| {
            match batch.iter_mut().find(|(b, bp, _)| Arc::ptr_eq(b, &q) && *bp == p) {
                Some((_, _, ids)) => ids.push(id),
                None => batch.push((q, p, vec![id])),
            }
        };
        for (q, p, id, end) in done {
            match end {
                Some(end) => {
                    finished.push(end);
                    finished_entries.push((q, p, id));
                }
                None => add(&mut batch, q, p, id),
            }
        }
        if !finished.is_empty() {
            if self.record_ends(&finished).await {
                for (q, p, id) in finished_entries {
                    add(&mut batch, q, p, id);
                }
            } else {
                for (q, p, id) in &finished_entries {
                    self.tracker.untrack(&q.name, *p, [id]);
                }
            }
        }
        for (q, p, ids) in batch {
            let q = q.name.as_str();
            let mut last_error = None;
            for attempt in 0..3 {
                match self.consumer.ack_in(q, p, &ids).await {
                    Ok(_) => {
                        last_error = None;
                        break;
                    }
                    Err(e) => {
                        last_error = Some(e);
                        tokio::time::sleep(Duration::from_millis(50 << attempt)).await;
                    }
                }
            }
            if let Some(e) = last_error {
                tracing::warn!(queue = %q, count = ids.len(), error = %redact(&e.to_string()), "XACK failed; the entries will be taken over and skipped");
            }
            self.tracker.untrack(q, p, &ids);
        }
    }

    /// Records the ends of jobs that ran without a transaction, trying three times.
    async fn record_ends(&self, finished: &[Finished]) -> bool {
        for attempt in 0..3 {
            match transitions::complete_many(&self.runtime, finished, self.consumer.name()).await {
                Ok(_) => return true,
                Err(e) if attempt == 2 => {
                    tracing::warn!(count = finished.len(), error = %redact(&e.to_string()), "Could not record finished jobs; they will run again");
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(50 << attempt)).await,
            }
        }
        false
    }

    pub(super) async fn heartbeat_loop(self: Arc<Self>, stop: CancellationToken) {
        let every = self.visibility / 3;
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
            for ((queue, partition), ids) in self.tracker.snapshot() {
                if let Err(e) = self.consumer.heartbeat_in(&queue, partition, &ids).await {
                    tracing::warn!(queue = %queue, error = %redact(&e.to_string()), "Heartbeat failed");
                }
            }
        }
    }

    /// Listens for cancellations (`LISTEN`, one connection of the control pool) and tells the running job. A
    /// notification is a hint: any role may send one, so the job is stopped only once PostgreSQL says it is canceled
    /// (`hear_cancellations`). A cancellation missed while the connection is down is still honoured: the
    /// job's end finds it canceled and rolls back, and [`crate::JobContext::progress`] reports it.
    pub(super) async fn cancel_loop(self: Arc<Self>, stop: CancellationToken) {
        let mut listener: Option<PgListener> = None;
        loop {
            let Some(l) = listener.as_mut() else {
                match PgListener::connect_with(&self.control).await {
                    Ok(mut l) => match l.listen(CANCEL_CHANNEL).await {
                        Ok(()) => listener = Some(l),
                        Err(e) => tracing::warn!(error = %redact(&e.to_string()), "Cannot LISTEN for cancellations"),
                    },
                    Err(e) => tracing::warn!(error = %redact(&e.to_string()), "Cannot connect to hear cancellations"),
                }
                if listener.is_none() {
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    }
                }
                continue;
            };
            let next = tokio::select! {
                _ = stop.cancelled() => return,
                next = l.recv() => next,
            };
            match next {
                Ok(n) => {
                    // With whatever else has arrived already: one look-up for a burst (an operation's jobs).
                    let mut heard = vec![n];
                    while heard.len() < MAX_CANCELLATIONS_CHECKED
                        && let Some(n) = l.next_buffered()
                    {
                        heard.push(n);
                    }
                    self.hear_cancellations(heard.iter().map(|n| n.payload())).await;
                }
                Err(e) => {
                    tracing::warn!(error = %redact(&e.to_string()), "Cancellation listener failed; reconnecting");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }

    /// Acts on the cancellation notifications `payloads` (job ids) of jobs that PostgreSQL says are canceled, and on
    /// no other: `NOTIFY conveyor_jobs_canceled` is open to every role, so a notification is only a hint to look
    /// (`conveyor_canceled_jobs`, migration 0035, as the runtime role: the status every cancel writes, committed
    /// before its notification is delivered). One that names a job not canceled is ignored and logged. When the
    /// look-up fails, the hints are dropped: the jobs' ends still find them canceled.
    async fn hear_cancellations<'a>(&self, payloads: impl Iterator<Item = &'a str>) {
        let mut jobs: Vec<Uuid> = Vec::new();
        for payload in payloads {
            match payload.parse::<Uuid>() {
                Ok(job) if !jobs.contains(&job) => jobs.push(job),
                Ok(_) => {}
                Err(_) => tracing::warn!(bytes = payload.len(), "Ignored a cancellation notice that names no job"),
            }
        }
        if jobs.is_empty() {
            return;
        }
        let mut canceled: Option<Vec<Uuid>> = None;
        for attempt in 0..3 {
            match sqlx::query_scalar::<_, Uuid>("SELECT conveyor.conveyor_canceled_jobs($1)")
                .bind(&jobs)
                .fetch_all(&self.runtime)
                .await
            {
                Ok(ids) => {
                    canceled = Some(ids);
                    break;
                }
                Err(e) if attempt == 2 => {
                    tracing::warn!(count = jobs.len(), error = %redact(&e.to_string()),
                        "Could not check cancellation notices against PostgreSQL; ignoring them (a canceled job's end still finds it canceled)");
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(50 << attempt)).await,
            }
        }
        let Some(canceled) = canceled else { return };
        let canceled: std::collections::HashSet<Uuid> = canceled.into_iter().collect();
        for job in jobs {
            if !canceled.contains(&job) {
                tracing::warn!(event_id = %job, "Ignored a cancellation notice for a job that is not canceled");
            } else if self.running.lock().expect("running lock").cancel(job) {
                tracing::info!(event_id = %job, "Job canceled while running; telling its handler");
            }
        }
    }
}
