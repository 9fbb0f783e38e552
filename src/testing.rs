//! Running jobs in-process in a service's own tests (feature `testing`): relay what is due and run it to the end,
//! step by step, without background tasks and without sleeping.
//!
//! ```no_run
//! # async fn f(dispatcher: conveyor_jobs::Dispatcher, worker: conveyor_jobs::Worker) -> anyhow::Result<()> {
//! // ... enqueue jobs in a transaction and commit it ...
//! let outcomes = conveyor_jobs::testing::drain(&dispatcher, &worker).await?;
//! assert!(outcomes.iter().all(|o| *o == conveyor_jobs::Outcome::Succeeded));
//! # Ok(()) }
//! ```

use crate::dispatcher::{DispatchOutcome, Dispatcher};
use crate::worker::{Outcome, Worker};

/// Relays every job that is due and runs each with `worker` ([`Worker::process_one`]) until nothing is due and its
/// queues are empty, retries that fall due meanwhile included; returns every run's outcome. Jobs due later (a delay,
/// a back-off still running) are left; so are jobs of queues `worker` does not consume.
pub async fn drain(dispatcher: &Dispatcher, worker: &Worker) -> Result<Vec<Outcome>, crate::Error> {
    let mut outcomes = Vec::new();
    loop {
        let relayed = dispatcher.dispatch_once().await?;
        let before = outcomes.len();
        while let Some(outcome) = worker.process_one().await? {
            outcomes.push(outcome);
        }
        if relayed == DispatchOutcome::Idle && outcomes.len() == before {
            return Ok(outcomes);
        }
    }
}
