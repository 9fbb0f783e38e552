//! The queue gate: how many more jobs a queue's streams may take now, so that what waits there for a worker stays
//! within [`DispatcherSettings::queue_wait`](super::DispatcherSettings::queue_wait) of the workers' measured pace.
//!
//! A workspace's window bounds its jobs in the workers' hands, in jobs. What another workspace's job waits behind in
//! the stream is time: 256 jobs are 50 ms of work for a hundred slots of 5 ms handlers and 3 s for sixteen slots of
//! 200 ms ones. So the dispatcher looks at each busy queue every [`MEASURE_EVERY`] (an idle one every [`IDLE_LOOK`]): the entries its streams
//! hold that no worker has read yet (`XLEN` less the group's pending entries: an acknowledged entry is deleted), and
//! how many the workers took since the last look (entries added less the growth of that waiting part). While entries
//! wait, the workers are busy and their pace (a moving average) is what they can do: a queue's budget of waiting
//! entries is that pace times `queue_wait` (Little's law), at least [`FLOOR`]. When they took all that was relayed
//! since the last look, nothing says how much more they could take: the budget doubles, as a slow start does. Its
//! room is the budget less what waited at the last look and what this dispatcher relayed since.
//!
//! The gate paces the relay to the workers, so it gates only what it can pace: nothing before [`Gate::start`] (a
//! dispatcher that is not running its loop, such as one driven by `dispatch_once`, is never measured), and only the
//! queues that workers registered (`job_kinds`, read at start and every few seconds): a queue no worker registered
//! has nobody to pace by, and the window alone bounds it, as without the gate. A registered queue not looked at yet
//! has the budget of an idle one, [`FLOOR`], so a flood into a queue whose workers just started is not relayed whole
//! before the first look. The claim shares each gated queue's room between the workspaces of the call (migration
//! 0040), the light ones first. Several dispatchers, or concurrent claims of one, may each fill the same room before
//! the next look: the waiting part can exceed the budget by that much, never grow without bound.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How often the gate looks at the queues it relays into (or where jobs wait).
pub(crate) const MEASURE_EVERY: Duration = Duration::from_millis(20);

/// A queue is looked at every [`MEASURE_EVERY`] while this dispatcher relayed into it this recently.
const ACTIVE_FOR: Duration = Duration::from_secs(10);

/// An idle queue is looked at this often.
const IDLE_LOOK: Duration = Duration::from_secs(1);

/// A queue's budget is at least this many waiting entries: a pace measured over a few jobs is noisy, and with a few
/// entries waiting a slot that frees finds one.
pub(crate) const FLOOR: u64 = 4;

/// Weight of the newest interval in the moving average of the workers' pace.
const SMOOTHING: f64 = 0.25;

/// The largest budget: a claim's room is an `integer`.
const CEILING: u64 = 1_000_000;

/// What the gate lets a claim take: each gated queue's room (the queues not named are not gated).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Rooms {
    pub(crate) queues: Vec<String>,
    pub(crate) rooms: Vec<i32>,
    /// How many workspaces at the head of the claim are light: they may take all the room left.
    pub(crate) light_first: usize,
}

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
    /// Jobs the workers take per second (moving average; `None` before two looks).
    pace: Option<f64>,
    /// Entries waiting that the queue may hold.
    budget: u64,
    /// Relayed by this dispatcher since the last look.
    relayed_since: u64,
}

/// The gate of every queue this dispatcher relays into.
#[derive(Debug)]
pub(crate) struct Gate {
    queue_wait: Duration,
    /// Whether its looks have begun ([`Gate::start`]).
    started: std::sync::atomic::AtomicBool,
    queues: Mutex<HashMap<String, QueueGate>>,
}

impl Gate {
    /// A gate keeping each queue's waiting part within `queue_wait` of its workers' pace; zero: no gate.
    pub(crate) fn new(queue_wait: Duration) -> Self {
        Self { queue_wait, started: Default::default(), queues: Mutex::default() }
    }

    /// Whether it never gates (a zero wait).
    pub(crate) fn is_off(&self) -> bool {
        self.queue_wait.is_zero()
    }

    /// Its looks begin (the dispatcher's loop measures the queues): from now on it gates.
    pub(crate) fn start(&self) {
        self.started.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    fn queues(&self) -> std::sync::MutexGuard<'_, HashMap<String, QueueGate>> {
        self.queues.lock().expect("gate lock")
    }

    /// The room of each queue workers registered, for a claim (none when off, or before the looks begin).
    pub(crate) fn rooms(&self) -> Rooms {
        if self.queue_wait.is_zero() || !self.started.load(std::sync::atomic::Ordering::Relaxed) {
            return Rooms::default();
        }
        let (queues, rooms) = self
            .queues()
            .iter()
            .map(|(queue, gate)| {
                let waiting = gate.last.map_or(0, |(_, load)| load.waiting);
                let room = gate.budget.saturating_sub(waiting + gate.relayed_since);
                (queue.clone(), i32::try_from(room).unwrap_or(i32::MAX))
            })
            .unzip();
        Rooms { queues, rooms, light_first: 0 }
    }

    /// Queues that have workers: looked at from now on, gated from the first look (and until then, at the floor).
    pub(crate) fn know(&self, queues: &[String]) {
        if self.queue_wait.is_zero() {
            return;
        }
        let now = Instant::now();
        let mut known = self.queues();
        for queue in queues {
            known.entry(queue.clone()).or_insert(QueueGate {
                relayed_at: now,
                last: None,
                pace: None,
                budget: FLOOR,
                relayed_since: 0,
            });
        }
    }

    /// A claim took `count` jobs of `queue` (a registered queue's room shrinks by as much).
    pub(crate) fn relayed(&self, queue: &str, count: u64) {
        if let Some(gate) = self.queues().get_mut(queue) {
            gate.relayed_at = Instant::now();
            gate.relayed_since += count;
        }
    }

    /// The queues to look at now: every [`MEASURE_EVERY`] those relayed into lately or where jobs wait, the idle
    /// ones once every [`IDLE_LOOK`].
    pub(crate) fn active(&self) -> Vec<String> {
        self.queues()
            .iter()
            .filter(|(_, gate)| match gate.last {
                None => true,
                Some((at, load)) => {
                    gate.relayed_at.elapsed() < ACTIVE_FOR || load.waiting > 0 || at.elapsed() >= IDLE_LOOK
                }
            })
            .map(|(queue, _)| queue.clone())
            .collect()
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
                gate.pace = Some(gate.pace.map_or(now, |pace| pace * (1.0 - SMOOTHING) + now * SMOOTHING));
            }
        }
        let paced = FLOOR.max((gate.pace.unwrap_or(0.0) * self.queue_wait.as_secs_f64()).ceil() as u64);
        gate.budget = if load.waiting == 0 && gate.relayed_since > 0 {
            // The workers took all that came: they may take more than their pace so far showed.
            CEILING.min(paced.max(gate.budget * 2))
        } else {
            paced
        };
        gate.last = Some((at, load));
        gate.relayed_since = 0;
    }

    /// Whether the gate may be holding jobs back: a queue relayed into in the last second still has entries waiting
    /// for its workers. The relay has work coming as they take them.
    pub(crate) fn busy(&self) -> bool {
        self.queues().values().any(|gate| {
            gate.relayed_at.elapsed() < Duration::from_secs(1) && gate.last.is_some_and(|(_, load)| load.waiting > 0)
        })
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

    /// A running gate that knows the queue "q".
    fn started(queue_wait: Duration) -> Gate {
        let gate = Gate::new(queue_wait);
        gate.start();
        gate.know(&["q".to_owned()]);
        gate
    }

    #[test]
    fn a_queue_is_gated_from_its_first_look_and_its_room_is_the_budget_less_what_waits_and_what_was_relayed() {
        let gate = Gate::new(Duration::from_millis(100));
        gate.start();
        gate.relayed("q", 3);
        assert_eq!(gate.rooms(), Rooms::default(), "queues no worker registered are not gated");
        gate.know(&["q".to_owned()]);
        assert_eq!(gate.rooms().rooms, vec![FLOOR as i32], "known, not looked at yet: the floor");
        gate.relayed("q", 3);
        let q = vec!["q".to_owned()];
        assert_eq!(gate.rooms(), Rooms { queues: q.clone(), rooms: vec![FLOOR as i32 - 3], light_first: 0 });
        let t0 = Instant::now();
        look(&gate, t0, 10, 1);
        assert_eq!(gate.rooms(), Rooms { queues: q, rooms: vec![FLOOR as i32 - 1], light_first: 0 });
        gate.relayed("q", 2);
        assert_eq!(gate.rooms().rooms, vec![FLOOR as i32 - 3]);
        gate.relayed("q", 5);
        assert_eq!(gate.rooms().rooms, vec![0], "never below 0");
    }

    #[test]
    fn a_gate_whose_looks_have_not_begun_gates_nothing() {
        let gate = Gate::new(Duration::from_millis(100));
        gate.know(&["q".to_owned()]);
        gate.relayed("q", 100);
        assert_eq!(gate.rooms(), Rooms::default());
        gate.start();
        assert_eq!(gate.rooms().rooms, vec![0]);
    }

    #[test]
    fn the_budget_is_the_workers_pace_times_the_wait() {
        let gate = started(Duration::from_millis(100));
        gate.relayed("q", 1);
        let t0 = Instant::now();
        look(&gate, t0, 0, 0);
        // 1,000 added in a second, 100 more waiting than before: the workers took 900 a second.
        look(&gate, t0 + Duration::from_secs(1), 1_000, 100);
        assert_eq!(gate.budget("q"), 90);
        assert_eq!(gate.rooms().rooms, vec![0], "100 wait, the budget is 90");
        // Slow handlers: 16 slots of 200 ms take 80 a second, whatever waits.
        let gate = started(Duration::from_millis(100));
        gate.relayed("q", 1);
        look(&gate, t0, 5_000, 200);
        look(&gate, t0 + Duration::from_secs(1), 5_080, 200);
        assert_eq!(gate.budget("q"), 8);
    }

    #[test]
    fn workers_that_take_all_that_comes_double_the_budget_and_a_lull_brings_it_back_to_their_pace() {
        let gate = started(Duration::from_millis(100));
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        gate.relayed("q", 4);
        look(&gate, at(0), 4, 0);
        assert_eq!(gate.budget("q"), 2 * FLOOR, "all 4 taken");
        gate.relayed("q", 8);
        look(&gate, at(20), 12, 0);
        assert_eq!(gate.budget("q"), 40, "8 in 20 ms: the pace times the wait is more than the doubling");
        let mut added = 12;
        for n in 1..40 {
            added += 16;
            gate.relayed("q", 16);
            look(&gate, at(20 + 40 * n), added, 0);
        }
        assert_eq!(gate.budget("q"), CEILING, "never above the ceiling");
        // Busy (entries wait): the pace alone, whatever the budget was: 400 a second so far, none taken in the last
        // 100 ms.
        added += 100;
        look(&gate, at(1_700), added, 100);
        assert_eq!(gate.budget("q"), 30, "(0.75 x 400/s + 0.25 x 0) x 100 ms");
        // Idle (nothing relayed, nothing waits): the pace fades, never below the floor.
        for n in 1..60 {
            look(&gate, at(1_700 + 100 * n), added, 0);
        }
        assert_eq!(gate.budget("q"), FLOOR);
    }

    #[test]
    fn off_gates_nothing_and_queues_not_relayed_into_lately_are_forgotten() {
        let gate = started(Duration::ZERO);
        gate.know(&["q".to_owned()]);
        gate.relayed("q", 1);
        assert!(gate.active().is_empty());
        assert_eq!(gate.rooms(), Rooms::default());
        let gate = started(Duration::from_millis(100));
        gate.know(&["q".to_owned()]);
        gate.relayed("q", 1);
        assert_eq!(gate.active(), vec!["q".to_owned()]);
        look(&gate, Instant::now(), 1, 1);
        assert!(gate.busy(), "relayed into lately, and a job waits");
        gate.queues().get_mut("q").unwrap().relayed_at = Instant::now() - ACTIVE_FOR;
        assert_eq!(gate.active(), vec!["q".to_owned()], "looked at while a job waits in it");
        assert!(!gate.busy(), "not relayed into lately: jobs wait for stuck workers, not for the gate");
        look(&gate, Instant::now(), 1, 0);
        assert!(gate.active().is_empty(), "idle: looked at once a second");
        assert!(!gate.busy());
    }
}
