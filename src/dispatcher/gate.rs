//! The queue gate: how many more jobs a queue's streams may take now, so that what waits there for a worker stays
//! within [`DispatcherSettings::queue_wait`](super::DispatcherSettings::queue_wait) of the workers' measured pace.
//!
//! A workspace's window bounds its jobs in the workers' hands, in jobs. What another workspace's job waits behind in
//! the stream is time: 256 jobs are 50 ms of work for a hundred slots of 5 ms handlers and 3 s for sixteen slots of
//! 200 ms ones. So the dispatcher looks at each busy queue every [`MEASURE_EVERY`] (an idle one every
//! [`IDLE_LOOK`]): the entries its streams hold that no worker has read yet (`XLEN` less the group's pending entries:
//! an acknowledged entry is deleted), and how many the workers took since the last look (entries added less the
//! growth of that waiting part). While entries
//! wait, the workers are busy and their pace (a moving average) is what they can do: a queue's budget of waiting
//! entries is that pace times `queue_wait` (Little's law), at least [`FLOOR`]. When nothing waited at two looks in a
//! row and they took all that came between, nothing says how much more they could take: the budget becomes twice
//! what they were given (up to twice the budget), as a slow start does; a trickle keeps it small. Its room is the budget less what waited
//! at the last look and what this dispatcher relayed since. A look that opens room in a queue that had none wakes
//! the relay (see [`Gate::observe`]).
//!
//! The gate paces the relay to the workers, so it gates only what it can pace: nothing before [`Gate::start`] (a
//! dispatcher that is not running its loop, such as one driven by `dispatch_once`, is never measured), and only the
//! queues that workers registered (`job_kinds`, read at start and every few seconds): a queue no worker registered
//! has nobody to pace by, and the window alone bounds it, as without the gate. A registered queue not looked at yet
//! has the budget of an idle one, [`FLOOR`], so a flood into a queue whose workers just started is not relayed whole
//! before the first look. A queue the gate could not look at for [`STALE`] (Redis away, a failing script) is not
//! gated until it can again: the window bounds it, and its jobs are never held on a measure that is not coming.
//!
//! The claim shares each gated queue's room between the workspaces of the call (migration 0041), the light ones
//! first. Several dispatchers, or concurrent claims of one sweep, may each fill the same room before the next look:
//! the waiting part can exceed the budget by that much, never grow without bound.

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
const FLOOR: u64 = 4;

/// A queue whose last look is older than this is not gated.
const STALE: Duration = Duration::from_secs(3);

/// The time constant of the moving average of the workers' pace: long beside the looks, so that handlers ending
/// together (a burst of entries taken, then none) read as their average, not as their peaks.
const PACE_HORIZON: Duration = Duration::from_millis(500);

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
    /// When it was last looked at, or became known.
    looked_at: Instant,
    /// The last look, and when.
    last: Option<(Instant, QueueLoad)>,
    /// Jobs the workers take per second (moving average; `None` before two looks).
    pace: Option<f64>,
    /// Entries waiting that the queue may hold.
    budget: u64,
    /// Relayed by this dispatcher since the last look.
    relayed_since: u64,
}

impl QueueGate {
    /// The budget less what waited at the last look and what was relayed since.
    fn room(&self) -> u64 {
        self.budget.saturating_sub(self.last.map_or(0, |(_, load)| load.waiting) + self.relayed_since)
    }
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
            .filter(|(_, gate)| gate.looked_at.elapsed() < STALE)
            .map(|(queue, gate)| (queue.clone(), i32::try_from(gate.room()).unwrap_or(i32::MAX)))
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
                looked_at: now,
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

    /// A look at `queue` begins: what this dispatcher has relayed into it so far, which the look will see.
    pub(crate) fn look_begins(&self, queue: &str) -> u64 {
        self.queues().get(queue).map_or(0, |gate| gate.relayed_since)
    }

    /// What a look at `queue` found at `at`, having begun when `relayed` jobs were counted since the last one: its
    /// pace, budget and room follow (what was relayed during the look stays counted). Whether it opened room in a
    /// queue that had none: jobs may be held for it, and the relay should look.
    pub(crate) fn observe(&self, queue: &str, at: Instant, load: QueueLoad, relayed: u64) -> bool {
        let mut queues = self.queues();
        let Some(gate) = queues.get_mut(queue) else { return false };
        let had_room = gate.room() > 0;
        if let Some((then, before)) = gate.last {
            let seconds = at.saturating_duration_since(then).as_secs_f64();
            if seconds > 0.0 {
                // Taken by the workers = added less the growth of the waiting part.
                let taken = (load.added.saturating_sub(before.added) as f64
                    - (load.waiting as f64 - before.waiting as f64))
                    .max(0.0);
                let now = taken / seconds;
                let weight = 1.0 - (-seconds / PACE_HORIZON.as_secs_f64()).exp();
                gate.pace = Some(gate.pace.map_or(now, |pace| pace * (1.0 - weight) + now * weight));
            }
        }
        let paced = FLOOR.max((gate.pace.unwrap_or(0.0) * self.queue_wait.as_secs_f64()).ceil() as u64);
        let waited_before = gate.last.map_or(0, |(_, before)| before.waiting);
        gate.budget = if load.waiting == 0 && waited_before == 0 && relayed > 0 {
            // Nothing waited at either look and the workers took all that came between: they may take more than
            // their pace so far showed. Twice what they were given, not twice the budget, so that a trickle keeps it
            // small. (Entries waited at the last look: the pace is what the workers can do, even if handlers that
            // end together emptied the stream for a moment.)
            CEILING.min(paced.max((2 * relayed).min(2 * gate.budget)))
        } else {
            paced
        };
        gate.last = Some((at, load));
        gate.looked_at = at;
        gate.relayed_since = gate.relayed_since.saturating_sub(relayed);
        !had_room && gate.room() > 0
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

    /// A look at "q" that saw all that was relayed before it.
    fn look(gate: &Gate, at: Instant, added: u64, waiting: u64) -> bool {
        let relayed = gate.look_begins("q");
        gate.observe("q", at, QueueLoad { added, waiting }, relayed)
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
    fn workers_that_take_all_they_are_given_double_it_and_a_trickle_keeps_the_budget_small() {
        let gate = started(Duration::from_millis(100));
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        gate.relayed("q", 4);
        look(&gate, at(0), 4, 0);
        assert_eq!(gate.budget("q"), 2 * FLOOR, "all 4 taken");
        // Each look, the whole room relayed and taken: twice as much each time (the pace, a second apart, is less),
        // up to the ceiling.
        let mut added = 4;
        for n in 1..40 {
            let room = gate.rooms().rooms[0] as u64;
            added += room;
            gate.relayed("q", room);
            look(&gate, at(1_000 * n), added, 0);
        }
        assert_eq!(gate.budget("q"), CEILING, "never above the ceiling");
        // Idle (nothing relayed, nothing waits): the pace fades, never below the floor.
        for n in 1..60 {
            look(&gate, at(40_000 + 1_000 * n), added, 0);
        }
        assert_eq!(gate.budget("q"), FLOOR);
        // A trickle, one job a look taken at once: twice what was given (2) is less than the pace times the wait.
        let gate = started(Duration::from_millis(100));
        look(&gate, at(0), 0, 0);
        for n in 1..100 {
            gate.relayed("q", 1);
            look(&gate, at(20 * n), n, 0);
        }
        assert_eq!(gate.budget("q"), 5, "50 a second x 100 ms, however long the trickle");
    }

    #[test]
    fn busy_workers_whose_handlers_end_together_keep_the_budget_at_their_pace() {
        let gate = started(Duration::from_millis(50));
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        look(&gate, at(0), 0, 0);
        // 16 slots of 200 ms: every 200 ms, 16 end at once and take what waits (80 a second); the relay keeps 4
        // waiting, which the looks in between see; the look right after the ends sees none.
        let mut added = 0;
        for n in 1..=40 {
            let ms = 20 * n;
            let waiting = if ms % 200 == 0 { 0 } else { 4 };
            if ms % 200 == 0 {
                added += 16;
                gate.relayed("q", 16);
            }
            look(&gate, at(ms), added, waiting);
        }
        assert!(gate.budget("q") <= 8, "budget {} for 80 jobs a second over 50 ms", gate.budget("q"));
    }

    #[test]
    fn a_look_forgets_only_the_relays_it_saw_and_says_when_it_opened_room() {
        let gate = started(Duration::from_millis(100));
        let t0 = Instant::now();
        look(&gate, t0, 0, 0);
        gate.relayed("q", 4);
        assert_eq!(gate.rooms().rooms, vec![0]);
        let seen = gate.look_begins("q");
        // Relayed while the look reads Redis: not in what it reads.
        gate.relayed("q", 2);
        let opened = gate.observe("q", t0 + Duration::from_millis(20), QueueLoad { added: 4, waiting: 4 }, seen);
        assert_eq!(gate.queues()["q"].relayed_since, 2, "the 2 the look did not see stay counted");
        assert!(!opened, "4 wait, 2 more coming: no room");
        let opened = look(&gate, t0 + Duration::from_millis(40), 6, 0);
        assert!(opened, "all taken: room again");
        assert!(!look(&gate, t0 + Duration::from_millis(60), 6, 0), "room it had already is not news");
    }

    #[test]
    fn a_queue_it_cannot_look_at_is_not_gated() {
        let gate = started(Duration::from_millis(100));
        look(&gate, Instant::now(), 0, 0);
        gate.relayed("q", 100);
        assert_eq!(gate.rooms().rooms, vec![0]);
        gate.queues().get_mut("q").unwrap().looked_at = Instant::now() - STALE;
        assert_eq!(gate.rooms(), Rooms::default(), "no look for {STALE:?}: the window alone bounds it");
    }

    #[test]
    fn off_gates_nothing_and_idle_queues_are_looked_at_less_often() {
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
