//! A worker's job slots: `concurrency` in all, and a cap per queue, so that one queue's jobs (a slow source, a flood
//! of one kind) cannot take every slot. A [`Slot`] holds one of each; the reader reads a queue only while it has
//! room, and waits for a slot to free when none has.

use std::sync::Arc;

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

/// Every slot of a worker, and the signal that one freed.
pub(super) struct Slots {
    total: Arc<Semaphore>,
    size: u32,
    freed: Notify,
}

/// One job's place: a permit of its queue's cap and of the worker's total (all of the total for a job that runs
/// alone). Dropping it frees both, then wakes the reader.
pub(super) struct Slot {
    cap: Option<OwnedSemaphorePermit>,
    total: Option<OwnedSemaphorePermit>,
    slots: Arc<Slots>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        // Released before the signal, so that the reader it wakes finds them free.
        drop(self.cap.take());
        drop(self.total.take());
        self.slots.freed.notify_one();
    }
}

impl Slots {
    pub(super) fn new(size: usize) -> Arc<Self> {
        let size = u32::try_from(size).unwrap_or(u32::MAX);
        Arc::new(Self { total: Arc::new(Semaphore::new(size as usize)), size, freed: Notify::new() })
    }

    /// Jobs of the queue capped by `cap` that could start now.
    pub(super) fn room(&self, cap: &Semaphore) -> usize {
        cap.available_permits().min(self.total.available_permits())
    }

    /// Slots free in all, whatever the queue.
    pub(super) fn free(&self) -> usize {
        self.total.available_permits()
    }

    /// A slot for the queue capped by `cap`, if one is free now.
    pub(super) fn try_take(self: &Arc<Self>, cap: &Arc<Semaphore>) -> Option<Slot> {
        let cap = cap.clone().try_acquire_owned().ok()?;
        let total = self.total.clone().try_acquire_owned().ok()?;
        Some(Slot { cap: Some(cap), total: Some(total), slots: self.clone() })
    }

    /// A slot for the queue capped by `cap`, once one is free (its cap first, then the total: every taker goes in
    /// that order, and none holds a total's permit while it waits for a cap).
    pub(super) async fn take(self: &Arc<Self>, cap: &Arc<Semaphore>) -> Slot {
        let cap = cap.clone().acquire_owned().await.expect("a cap is never closed");
        let total = self.total.clone().acquire_owned().await.expect("the slots are never closed");
        Slot { cap: Some(cap), total: Some(total), slots: self.clone() }
    }

    /// Every slot of the worker (and one of the cap), once the jobs running now have ended: for a job that may take
    /// its worker down. The semaphore is fair: no slot is given out while this waits.
    pub(super) async fn take_all(self: &Arc<Self>, cap: &Arc<Semaphore>) -> Slot {
        let cap = cap.clone().acquire_owned().await.expect("a cap is never closed");
        let total = self.total.clone().acquire_many_owned(self.size).await.expect("the slots are never closed");
        Slot { cap: Some(cap), total: Some(total), slots: self.clone() }
    }

    /// Resolves when a slot frees (or has freed since the last call).
    pub(super) async fn freed(&self) {
        self.freed.notified().await;
    }
}

/// The cap of each of `queues` given the worker's `concurrency` and the caps set (`CONVEYOR_WORKER_QUEUE_CONCURRENCY`):
/// a queue not set may take every slot but one for each other queue, so that while one queue's jobs hold all they
/// may, the others still have slots among them. Set caps that sum to the concurrency or less to reserve slots for
/// every queue.
pub(super) fn caps(concurrency: usize, queues: &[&str], set: &std::collections::BTreeMap<String, usize>) -> Vec<usize> {
    let default = concurrency.saturating_sub(queues.len().saturating_sub(1)).max(1);
    queues.iter().map(|q| set.get(*q).copied().unwrap_or(default).clamp(1, concurrency.max(1))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_queue_not_set_leaves_a_slot_for_each_other_queue_and_set_caps_are_kept() {
        let set = [("transfers".to_owned(), 4)].into_iter().collect();
        assert_eq!(caps(16, &["stores", "media", "transfers"], &set), [14, 14, 4]);
        assert_eq!(caps(16, &["only"], &Default::default()), [16], "one queue takes every slot");
        assert_eq!(caps(2, &["a", "b", "c", "d"], &Default::default()), [1, 1, 1, 1], "never below one");
        let set = [("a".to_owned(), 99)].into_iter().collect();
        assert_eq!(caps(8, &["a"], &set), [8], "never above the concurrency");
    }

    #[tokio::test]
    async fn a_full_cap_holds_its_queue_back_while_others_start_and_a_freed_slot_wakes_the_reader() {
        let slots = Slots::new(3);
        let (slow, fast) = (Arc::new(Semaphore::new(2)), Arc::new(Semaphore::new(2)));
        let held = [slots.try_take(&slow).unwrap(), slots.try_take(&slow).unwrap()];
        assert!(slots.try_take(&slow).is_none(), "the slow queue's cap is full");
        assert_eq!((slots.room(&slow), slots.room(&fast)), (0, 1));
        let other = slots.try_take(&fast).expect("the other queue still starts");
        assert!(slots.try_take(&fast).is_none(), "no slot left in all");
        drop(other);
        tokio::time::timeout(std::time::Duration::from_secs(5), slots.freed()).await.expect("woken");
        assert_eq!(slots.room(&fast), 1);
        drop(held);
        assert_eq!(slots.free(), 3);
    }
}
