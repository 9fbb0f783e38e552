//! The queue gate: how many more jobs a queue's streams may take now, so that what waits there for a worker stays
//! within [`DispatcherSettings::queue_wait`](super::DispatcherSettings::queue_wait) of the workers' measured pace.
//!
//! A workspace's window bounds its jobs in the workers' hands, in jobs. What another workspace's job waits behind in
//! the stream is time: 256 jobs are 50 ms of work for a hundred slots of 5 ms handlers and 3 s for sixteen slots of
//! 200 ms ones. So the dispatcher measures each queue it relays into every [`MEASURE_EVERY`]: the entries its streams
//! hold that no worker has read yet (`XLEN` less the group's pending entries: an acknowledged entry is deleted), and
//! how many the workers took since the last look (entries added less the growth of that waiting part). The workers'
//! pace is the larger of the last interval's and a moving average (a ramp shows at once, a lull is forgotten
//! slowly), and a queue's budget of waiting entries is that pace times `queue_wait` (Little's law), at least
//! [`FLOOR`]. Its room is the budget less what waited at the last look and what this dispatcher relayed since.
//!
//! The claim shares each gated queue's room between the workspaces of the call (migration 0040), the light ones first.
//! A queue not measured yet (new to this dispatcher) is not gated: the window bounds it. Several dispatchers, or
//! concurrent claims of one, may each fill the same room before the next look: the waiting part can exceed the budget
//! by that much, never grow without bound.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How often the gate looks at the queues it relays into.
pub(crate) const MEASURE_EVERY: Duration = Duration::from_millis(20);

/// A queue is looked at while this dispatcher relayed into it this recently.
const ACTIVE_FOR: Duration = Duration::from_secs(10);

/// A queue's budget is at least this many waiting entries: a pace measured over a few jobs is noisy, and with a few
/// entries waiting a slot that frees finds one.
pub(crate) const FLOOR: u64 = 4;

/// Weight of the newest interval in the moving average of the workers' pace.
const SMOOTHING: f64 = 0.25;

/// What a look at a queue's streams found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct QueueLoad {
    /// Entries ever added to the queue's streams (`XINFO STREAM`'s `entries-added`, summed).
    pub(crate) added: u64,
    /// Entries in them that no worker has read yet.
    pub(crate) waiting: u64,
}

#[derive(Debug)]
struct QueueGate {
    /// When this dispatcher last relayed into it.
    relayed_at: Instant,
    /// The last look, and when.
    last: Option<(Instant, QueueLoad)>,
    /// Jobs the workers take per second (moving average).
    pace: f64,
    /// Entries waiting that the queue may hold.
    budget: u64,
    /// Relayed by this dispatcher since the last look.
    relayed_since: u64,
}

/// The gate of every queue this dispatcher relays into.
#[derive(Debug)]
pub(crate) struct Gate {
    queue_wait: Duration,
    queues: Mutex<HashMap<String, QueueGate>>,
}

impl Gate {
    /// A gate keeping each queue's waiting part within `queue_wait` of its workers' pace; zero: no gate.
    pub(crate) fn new(queue_wait: Duration) -> Self {
        Self { queue_wait, queues: Mutex::default() }
    }

    fn queues(&self) -> std::sync::MutexGuard<'_, HashMap<String, QueueGate>> {
        self.queues.lock().expect("gate lock")
    }

    /// The room of each measured queue, for a claim: (queues, rooms), each room at least 0. Empty when off.
    pub(crate) fn rooms(&self) -> (Vec<String>, Vec<i32>) {
        if self.queue_wait.is_zero() {
            return (Vec::new(), Vec::new());
        }
        self.queues()
            .iter()
            .filter_map(|(queue, gate)| {
                let (_, load) = gate.last?;
                let room = gate.budget.saturating_sub(load.waiting + gate.relayed_since);
                Some((queue.clone(), i32::try_from(room).unwrap_or(i32::MAX)))
            })
            .unzip()
    }

    /// A claim took `count` jobs of `queue`.
    pub(crate) fn relayed(&self, queue: &str, count: u64) {
        if self.queue_wait.is_zero() {
            return;
        }
        let now = Instant::now();
        let mut queues = self.queues();
        match queues.get_mut(queue) {
            Some(gate) => {
                gate.relayed_at = now;
                gate.relayed_since += count;
            }
            None => {
                let gate = QueueGate { relayed_at: now, last: None, pace: 0.0, budget: FLOOR, relayed_since: count };
                queues.insert(queue.to_owned(), gate);
            }
        }
    }

    /// The queues to look at now (relayed into lately); those relayed into long ago are forgotten.
    pub(crate) fn active(&self) -> Vec<String> {
        let mut queues = self.queues();
        queues.retain(|_, gate| gate.relayed_at.elapsed() < ACTIVE_FOR);
        queues.keys().cloned().collect()
    }

    /// What a look at `queue` found at `at`: its pace, budget and room follow.
    pub(crate) fn observe(&self, queue: &str, at: Instant, load: QueueLoad) {
        let mut queues = self.queues();
        let Some(gate) = queues.get_mut(queue) else { return };
        if let Some((then, before)) = gate.last {
            let seconds = at.saturating_duration_since(then).as_secs_f64();
            if seconds > 0.0 {
                // Taken by the workers = added less the growth of the waiting part.
                let taken = (load.added.saturating_sub(before.added) as f64
                    - (load.waiting as f64 - before.waiting as f64))
                    .max(0.0);
                let now = taken / seconds;
                gate.pace = now.max(gate.pace * (1.0 - SMOOTHING) + now * SMOOTHING);
            }
        }
        gate.budget = FLOOR.max((gate.pace * self.queue_wait.as_secs_f64()).ceil() as u64);
        gate.last = Some((at, load));
        gate.relayed_since = 0;
    }

    /// Whether some gated queue still has entries waiting for a worker: the relay has work coming.
    pub(crate) fn busy(&self) -> bool {
        self.queues().values().any(|gate| gate.last.is_some_and(|(_, load)| load.waiting > 0))
    }

    #[cfg(test)]
    fn budget(&self, queue: &str) -> u64 {
        self.queues()[queue].budget
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn look(gate: &Gate, at: Instant, added: u64, waiting: u64) {
        gate.observe("q", at, QueueLoad { added, waiting });
    }

    #[test]
    fn a_queue_is_gated_from_its_first_look_and_its_room_is_the_budget_less_what_waits_and_what_was_relayed() {
        let gate = Gate::new(Duration::from_millis(100));
        assert_eq!(gate.rooms(), (vec![], vec![]), "nothing relayed, nothing gated");
        gate.relayed("q", 10);
        assert_eq!(gate.rooms(), (vec![], vec![]), "not measured yet: only the window bounds it");
        let t0 = Instant::now();
        look(&gate, t0, 10, 1);
        assert_eq!(gate.rooms(), (vec!["q".to_owned()], vec![FLOOR as i32 - 1]));
        gate.relayed("q", 2);
        assert_eq!(gate.rooms().1, vec![FLOOR as i32 - 3]);
        gate.relayed("q", 5);
        assert_eq!(gate.rooms().1, vec![0], "never below 0");
    }

    #[test]
    fn the_budget_is_the_workers_pace_times_the_wait() {
        let gate = Gate::new(Duration::from_millis(100));
        gate.relayed("q", 1);
        let t0 = Instant::now();
        look(&gate, t0, 0, 0);
        // 1,000 added in a second, 100 more waiting than before: the workers took 900 a second.
        look(&gate, t0 + Duration::from_secs(1), 1_000, 100);
        assert_eq!(gate.budget("q"), 90);
        assert_eq!(gate.rooms().1, vec![0], "100 wait, the budget is 90");
        // Slow handlers: 16 slots of 200 ms take 80 a second, whatever waits.
        let gate = Gate::new(Duration::from_millis(100));
        gate.relayed("q", 1);
        look(&gate, t0, 5_000, 200);
        look(&gate, t0 + Duration::from_secs(1), 5_080, 200);
        assert_eq!(gate.budget("q"), 8);
    }

    #[test]
    fn a_ramp_shows_at_once_and_a_lull_is_forgotten_slowly() {
        let gate = Gate::new(Duration::from_millis(100));
        gate.relayed("q", 1);
        let t0 = Instant::now();
        look(&gate, t0, 0, 0);
        look(&gate, t0 + Duration::from_secs(1), 10_000, 0);
        assert_eq!(gate.budget("q"), 1_000);
        look(&gate, t0 + Duration::from_secs(2), 10_000, 0);
        assert_eq!(gate.budget("q"), 750, "a quarter of the pace goes per idle interval");
        for s in 3..60 {
            look(&gate, t0 + Duration::from_secs(s), 10_000, 0);
        }
        assert_eq!(gate.budget("q"), FLOOR, "never below the floor");
    }

    #[test]
    fn off_gates_nothing_and_queues_not_relayed_into_lately_are_forgotten() {
        let gate = Gate::new(Duration::ZERO);
        gate.relayed("q", 1);
        assert!(gate.active().is_empty());
        assert_eq!(gate.rooms(), (vec![], vec![]));
        let gate = Gate::new(Duration::from_millis(100));
        gate.relayed("q", 1);
        assert_eq!(gate.active(), vec!["q".to_owned()]);
        gate.queues().get_mut("q").unwrap().relayed_at = Instant::now() - ACTIVE_FOR;
        assert!(gate.active().is_empty());
        assert!(!gate.busy());
    }
}
