//! How many partitions a queue's jobs go to, and which one each job takes.
//!
//! The relay routes a job to partition `fnv1a(workspace) mod P`, so one workspace's jobs of a queue stay in one
//! stream, in order. `P` may be raised (`CONVEYOR_STREAM_PARTITIONS`) while jobs flow, and a job must never land in
//! two streams: a job handed off but not yet recorded (its dispatcher died) is handed off again later, and only its
//! de-dup key, which lives beside the stream it went to, stops a second entry. So the partition of a job must not
//! change between two hand-offs, whichever dispatcher (and configuration) makes them.
//!
//! Hence the layout's history, one Redis key (`<prefix>:layout`): epochs `P@<since, ms>`, appended by a dispatcher
//! configured with a `P` above the latest, with `since` = Redis' clock + [`MARGIN`]. A job takes the partition count
//! of the epoch its `created_at` falls in, a time fixed for good when it was enqueued: every dispatcher that knows
//! the epoch routes it the same way, and every dispatcher knows the epoch before it starts (dispatchers re-read the
//! layout at least every [`FRESH`], far inside the margin). Jobs created before an epoch keep their old partition;
//! workers read every stream any epoch named (the whole stream always), so older streams drain. `P` is never
//! lowered: a smaller setting is ignored with a warning. Redis' and PostgreSQL's clocks must agree to within the
//! margin less [`FRESH`].

use std::sync::Mutex;
use std::time::{Duration, Instant};

use uuid::Uuid;

use super::keys::{Keys, Partition};
use super::script::LuaScript;
use super::{RedisClient, Watched};

/// Most partitions a queue may have.
pub const MAX_PARTITIONS: u16 = 1024;

/// How far ahead of Redis' clock a new epoch starts.
pub(crate) const MARGIN: Duration = Duration::from_secs(10);

/// How old a relay's copy of the layout may be when it routes a batch.
pub(crate) const FRESH: Duration = Duration::from_secs(2);

// KEYS[1] = the layout; ARGV[1] = the partitions wanted, ARGV[2] = the margin (ms). Appends `P@since` when P is above
// the latest epoch's; returns the layout.
const RAISE_SCRIPT: &str = r#"
local layout = redis.call('GET', KEYS[1]) or ''
local latest = 1
for p in string.gmatch(layout, '(%d+)@%-?%d+') do latest = tonumber(p) end
local wanted = tonumber(ARGV[1])
if wanted > latest then
  local now = redis.call('TIME')
  local since = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000) + tonumber(ARGV[2])
  if layout ~= '' then layout = layout .. ',' end
  layout = layout .. wanted .. '@' .. string.format('%d', since)
  redis.call('SET', KEYS[1], layout)
end
return layout
"#;

/// The layout's epochs: from `since` (ms since the epoch) on, jobs go to `partitions` streams. Before the first
/// epoch, and with none, a queue has one stream, its whole one.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Layout {
    epochs: Vec<(u16, i64)>,
}

impl Layout {
    /// Reads `P@since,P@since,...`; a malformed epoch is skipped.
    pub fn parse(text: &str) -> Self {
        let mut epochs: Vec<(u16, i64)> = text
            .split(',')
            .filter_map(|epoch| {
                let (p, since) = epoch.trim().split_once('@')?;
                Some((p.parse::<u16>().ok()?.clamp(1, MAX_PARTITIONS), since.parse().ok()?))
            })
            .collect();
        epochs.sort_by_key(|&(_, since)| since);
        Self { epochs }
    }

    /// The partition count of the latest epoch.
    pub fn latest(&self) -> u16 {
        self.epochs.last().map_or(1, |&(p, _)| p)
    }

    /// The partition count for a job created at `created_ms`.
    pub(crate) fn partitions_at(&self, created_ms: i64) -> u16 {
        self.epochs.iter().rev().find(|&&(_, since)| since <= created_ms).map_or(1, |&(p, _)| p)
    }

    /// The stream a job of `workspace` created at `created_ms` goes to.
    pub fn partition_of(&self, workspace: &Uuid, created_ms: i64) -> Partition {
        workspace_partition(workspace, self.partitions_at(created_ms))
    }

    /// Every stream a queue may hold entries in: its whole stream, and each partition of the largest epoch.
    pub fn streams(&self, at_least: u16) -> Vec<Partition> {
        let most = self.epochs.iter().map(|&(p, _)| p).max().unwrap_or(1).max(at_least);
        let mut streams = vec![Partition::Whole];
        if most > 1 {
            streams.extend((0..most).map(Partition::Part));
        }
        streams
    }
}

/// Every stream key of `queue` that may hold entries, as the layout in Redis names them (the whole stream first):
/// what an operator's view sums its `XLEN` and `XINFO GROUPS` over.
pub(crate) async fn stream_keys(
    client: &RedisClient,
    keys: &Keys,
    queue: &str,
) -> Result<Vec<String>, fred::error::Error> {
    use fred::prelude::KeysInterface;
    let text: Option<String> = client.get(keys.layout()).await.watched(client)?;
    let layout = Layout::parse(text.as_deref().unwrap_or_default());
    Ok(layout.streams(1).into_iter().map(|p| keys.partition_stream(queue, p)).collect())
}

/// The partition of `workspace` among `partitions`: FNV-1a of its 16 bytes, modulo. Stable across versions and
/// processes (the relay's routing depends on it).
pub(crate) fn workspace_partition(workspace: &Uuid, partitions: u16) -> Partition {
    if partitions <= 1 {
        return Partition::Whole;
    }
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in workspace.as_bytes() {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    Partition::Part((hash % u64::from(partitions)) as u16)
}

/// A process's copy of the layout, read again when older than [`FRESH`]. A relay's copy also raises the layout to
/// its configured partition count.
pub(crate) struct LayoutCache {
    client: RedisClient,
    key: String,
    /// Raise the layout to this many partitions (1: only read it).
    raise_to: u16,
    script: LuaScript,
    cached: Mutex<Option<(Layout, Instant)>>,
    warned: std::sync::atomic::AtomicBool,
}

impl LayoutCache {
    /// A copy of the layout under `keys`, raised to `raise_to` partitions (1: read only).
    pub(crate) fn new(client: RedisClient, keys: &Keys, raise_to: u16) -> Self {
        Self {
            client,
            key: keys.layout(),
            raise_to: raise_to.clamp(1, MAX_PARTITIONS),
            script: LuaScript::new(RAISE_SCRIPT),
            cached: Mutex::new(None),
            warned: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// The layout, read (or raised) again if the copy is older than [`FRESH`].
    pub(crate) async fn get(&self) -> Result<Layout, fred::error::Error> {
        if let Some((layout, at)) = self.cached.lock().expect("layout lock").as_ref()
            && at.elapsed() < FRESH
        {
            return Ok(layout.clone());
        }
        let raise = self.raise_to > 1
            && self.cached.lock().expect("layout lock").as_ref().is_none_or(|(l, _)| l.latest() < self.raise_to);
        let text: Option<String> = if raise {
            let args = vec![self.raise_to.to_string(), MARGIN.as_millis().to_string()];
            self.script.run(&self.client, vec![self.key.clone()], args).await?
        } else {
            use fred::prelude::KeysInterface;
            self.client.get(&self.key).await.watched(&self.client)?
        };
        let layout = Layout::parse(text.as_deref().unwrap_or_default());
        if layout.latest() > self.raise_to
            && self.raise_to > 1
            && !self.warned.swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            tracing::warn!(
                configured = self.raise_to,
                layout = layout.latest(),
                "CONVEYOR_STREAM_PARTITIONS is below the partitions already in use; partitions are never merged, so \
                 jobs keep going to the larger count"
            );
        }
        *self.cached.lock().expect("layout lock") = Some((layout.clone(), Instant::now()));
        Ok(layout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_takes_the_partition_count_of_the_epoch_it_was_created_in() {
        let layout = Layout::parse("4@1000,8@5000");
        assert_eq!((layout.partitions_at(999), layout.partitions_at(1000)), (1, 4));
        assert_eq!((layout.partitions_at(4999), layout.partitions_at(5000), layout.latest()), (4, 8, 8));
        assert_eq!(Layout::parse("").partitions_at(i64::MAX), 1);
        assert_eq!(Layout::parse("junk,4@x,2@10").latest(), 2, "malformed epochs are skipped");
        let ws = Uuid::new_v4();
        assert_eq!(layout.partition_of(&ws, 0), Partition::Whole);
        assert_eq!(layout.partition_of(&ws, 2000), layout.partition_of(&ws, 4000), "stable within an epoch");
    }

    #[test]
    fn workers_read_the_whole_stream_and_every_partition_any_epoch_named() {
        assert_eq!(Layout::default().streams(1), vec![Partition::Whole]);
        let streams = Layout::parse("4@1000,2@0").streams(1);
        assert_eq!(streams.len(), 5);
        assert_eq!(streams[0], Partition::Whole);
        assert_eq!(Layout::default().streams(3).len(), 4, "a worker's own setting counts too");
    }

    #[test]
    fn workspaces_spread_over_every_partition_and_each_keeps_its_own() {
        let mut seen = std::collections::HashSet::new();
        for _ in 0..400 {
            let ws = Uuid::new_v4();
            let p = workspace_partition(&ws, 4);
            assert_eq!(p, workspace_partition(&ws, 4));
            seen.insert(p);
        }
        assert_eq!(seen.len(), 4);
        assert_eq!(workspace_partition(&Uuid::nil(), 1), Partition::Whole);
        // Fixed values (FNV-1a 64 computed independently): the routing must not change between versions.
        let fixed = |u: &str, p| workspace_partition(&u.parse().unwrap(), p);
        assert_eq!(fixed("00000000-0000-0000-0000-000000000000", 7), Partition::Part(0));
        assert_eq!(fixed("6f1c2a8e-3b4d-4e5f-8a9b-0c1d2e3f4a5b", 4), Partition::Part(1));
        assert_eq!(fixed("ffffffff-ffff-ffff-ffff-ffffffffffff", 7), Partition::Part(5));
    }
}
