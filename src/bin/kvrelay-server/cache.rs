//! The paged KV pool and its reuse cache, keyed by block names (SPEC section 8).
//!
//! Blocks are numbered `0..capacity`. A block is *free*, *held* (referenced by at least one
//! lease: a running request, or a transfer that sends it) or *cached* (named, unreferenced, in
//! LRU order). Eviction takes the least recently released cached block and never a held one.
//! A run of blocks is released tail first, so that its tail is evicted before its head: a
//! block is useless without its whole prefix, and a half-evicted prompt keeps its longest
//! usable head (evicting the head first would leave a tail nothing can ever reuse or fetch).
//! A request takes every block it needs in one step (its cached prefix and fresh blocks for
//! the rest) or none, so requests never hold some blocks while waiting for others: a request
//! that cannot be served now waits for a release; one that could never fit is refused.
//!
//! Cost: one mutex acquisition per acquire, commit and release; `O(blocks)` work under it, no
//! I/O. The bytes live behind [`crate::engine::KvStore`].

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::Notify;

#[derive(Clone, Copy, Default)]
struct Meta {
    /// The name the block is cached under (`None`: free or private to a lease).
    name: Option<u64>,
    refs: u32,
    /// Position in the LRU order while cached and unreferenced.
    tick: u64,
}

struct State {
    meta: Vec<Meta>,
    by_name: HashMap<u64, u32>,
    free: Vec<u32>,
    lru: BTreeMap<u64, u32>,
    tick: u64,
}

/// The block table: free list, names, reference counts, LRU.
pub struct BlockCache {
    state: Mutex<State>,
    released: Notify,
    capacity: usize,
    evicted: AtomicU64,
    /// Where commits and evictions are published (`--kv-events-endpoint`), sent under the
    /// state's mutex so that they leave in the cache's order.
    events: Option<Arc<dyn EventSink>>,
}

/// Where the cache announces its commits and evictions (the KV events publisher; a test's
/// recorder). Called under the cache's mutex: must not block.
pub trait EventSink: Send + Sync {
    /// A block was committed under `name` (`parent`: the block before it in its prompt).
    fn stored(&self, name: u64, parent: Option<u64>, tokens: &[u32]);
    /// The block named `name` was evicted.
    fn removed(&self, name: u64);
}

impl EventSink for crate::abi::KvEvents {
    fn stored(&self, name: u64, parent: Option<u64>, tokens: &[u32]) {
        crate::abi::KvEvents::stored(self, name, parent, tokens)
    }
    fn removed(&self, name: u64) {
        crate::abi::KvEvents::removed(self, name)
    }
}

/// A request needs more blocks than the whole pool holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NeverFits {
    /// Blocks the request needs.
    pub needed: usize,
    /// Blocks in the pool.
    pub capacity: usize,
}

/// Counts for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheStats {
    /// Blocks referenced by a lease.
    pub held: usize,
    /// Named, unreferenced blocks (evictable).
    pub cached: usize,
    /// Blocks on the free list.
    pub free: usize,
    /// Evictions since start.
    pub evicted: u64,
}

/// Blocks a request or transfer holds: the cached prefix first, then fresh blocks, in prompt
/// order. Dropping it releases every block (fresh blocks that were not committed go back to
/// the free list), so a cancelled request frees what it took.
pub struct Lease {
    cache: Arc<BlockCache>,
    /// Block ids in prompt order.
    pub ids: Vec<u32>,
    /// How many leading ids were cache hits.
    pub hits: usize,
}

impl BlockCache {
    /// A pool of `capacity` blocks, all free.
    pub fn new(capacity: usize) -> Arc<BlockCache> {
        Self::with_events(capacity, None)
    }

    /// Whether commits and evictions are published (what a commit's tokens are for).
    pub fn publishes(&self) -> bool {
        self.events.is_some()
    }

    /// [`new`](Self::new), publishing each commit (`BlockStored`) and eviction
    /// (`BlockRemoved`) to `events`.
    pub fn with_events(capacity: usize, events: Option<Arc<dyn EventSink>>) -> Arc<BlockCache> {
        Arc::new(BlockCache {
            state: Mutex::new(State {
                meta: vec![Meta::default(); capacity],
                by_name: HashMap::with_capacity(capacity),
                free: (0..capacity as u32).rev().collect(),
                lru: BTreeMap::new(),
                tick: 0,
            }),
            released: Notify::new(),
            capacity,
            evicted: AtomicU64::new(0),
            events,
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves consistent bookkeeping (every update is a
        // few assignments), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Blocks in the pool.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// How many leading `names` are cached or held under that name (no reference taken).
    pub fn held_prefix(&self, names: &[u64]) -> usize {
        let s = self.lock();
        names.iter().take_while(|n| s.by_name.contains_key(n)).count()
    }

    /// The block cached under `name`, if any.
    pub fn lookup(&self, name: u64) -> Option<u32> {
        self.lock().by_name.get(&name).copied()
    }

    /// Take the longest cached prefix of `names` and `total - hits` fresh blocks, now or not at
    /// all. `Ok(None)`: not enough free or evictable blocks at the moment.
    pub fn try_acquire(self: &Arc<Self>, names: &[u64], total: usize) -> Result<Option<Lease>, NeverFits> {
        if total > self.capacity {
            return Err(NeverFits { needed: total, capacity: self.capacity });
        }
        let mut s = self.lock();
        let hit_ids: Vec<u32> = names.iter().take(total).map_while(|n| s.by_name.get(n).copied()).collect();
        let hits = hit_ids.len();
        let needed = total - hits;
        // Evictable: cached and unreferenced, minus the hits we are about to reference.
        let hits_in_lru = hit_ids.iter().filter(|&&b| s.meta[b as usize].refs == 0).count();
        if s.free.len() + s.lru.len() - hits_in_lru < needed {
            return Ok(None);
        }
        for &b in &hit_ids {
            let m = s.meta[b as usize];
            if m.refs == 0 {
                s.lru.remove(&m.tick);
            }
            s.meta[b as usize].refs += 1;
        }
        let mut ids = hit_ids;
        for _ in 0..needed {
            let b = match s.free.pop() {
                Some(b) => b,
                None => {
                    let (_, b) = s.lru.pop_first().expect("counted above");
                    let old = s.meta[b as usize].name.take().expect("cached blocks are named");
                    s.by_name.remove(&old);
                    self.evicted.fetch_add(1, Ordering::Relaxed);
                    if let Some(ev) = &self.events {
                        ev.removed(old);
                    }
                    b
                }
            };
            s.meta[b as usize] = Meta { name: None, refs: 1, tick: 0 };
            ids.push(b);
        }
        Ok(Some(Lease { cache: self.clone(), ids, hits }))
    }

    /// [`try_acquire`](Self::try_acquire), waiting for releases while the pool is full.
    pub async fn acquire(self: &Arc<Self>, names: &[u64], total: usize) -> Result<Lease, NeverFits> {
        loop {
            let notified = self.released.notified();
            tokio::pin!(notified);
            notified.as_mut().enable(); // registered before the check: no release is missed
            if let Some(l) = self.try_acquire(names, total)? {
                return Ok(l);
            }
            notified.await;
        }
    }

    /// Reference the blocks cached under `names` (a leading run; stops at the first miss), for
    /// a transfer that sends them: they cannot be evicted until the lease drops.
    pub fn pin_prefix(self: &Arc<Self>, names: &[u64]) -> Lease {
        let mut s = self.lock();
        let mut ids = Vec::new();
        for n in names {
            let Some(&b) = s.by_name.get(n) else { break };
            let m = s.meta[b as usize];
            if m.refs == 0 {
                s.lru.remove(&m.tick);
            }
            s.meta[b as usize].refs += 1;
            ids.push(b);
        }
        let hits = ids.len();
        Lease { cache: self.clone(), ids, hits }
    }

    /// [`pin_prefix`](Self::pin_prefix) without a lease, for the KV agent's holder: reference
    /// the leading cached run of `names`, write its ids to `ids`, return its length. Each id is
    /// released by one [`unpin`](Self::unpin).
    pub fn pin(&self, names: &[u64], ids: &mut [u32]) -> usize {
        let mut s = self.lock();
        let mut n = 0;
        for (name, id) in names.iter().zip(ids.iter_mut()) {
            let Some(&b) = s.by_name.get(name) else { break };
            let m = s.meta[b as usize];
            if m.refs == 0 {
                s.lru.remove(&m.tick);
            }
            s.meta[b as usize].refs += 1;
            *id = b;
            n += 1;
        }
        n
    }

    /// Drop one reference of each of `ids` (taken by [`pin`](Self::pin), or kept from a lease).
    pub fn unpin(&self, ids: &[u32]) {
        self.release(ids);
    }

    /// Counts for metrics.
    pub fn stats(&self) -> CacheStats {
        let s = self.lock();
        let free = s.free.len();
        let cached = s.lru.len();
        CacheStats { held: self.capacity - free - cached, cached, free, evicted: self.evicted.load(Ordering::Relaxed) }
    }

    /// Drop one reference of each of `ids`, given in prompt order: released tail first (the
    /// module docs).
    fn release(&self, ids: &[u32]) {
        let mut s = self.lock();
        for &b in ids.iter().rev() {
            let m = &mut s.meta[b as usize];
            m.refs -= 1;
            if m.refs > 0 {
                continue;
            }
            if m.name.is_some() {
                s.tick += 1;
                let t = s.tick;
                s.meta[b as usize].tick = t;
                s.lru.insert(t, b);
            } else {
                s.free.push(b);
            }
        }
        drop(s);
        self.released.notify_waiters();
    }
}

impl Lease {
    /// Publish fresh block `i` of this lease under `name` once its bytes are complete. A block
    /// another request published under the same name first stays private and is freed on
    /// release. Returns whether it was published; a published block is announced to the KV
    /// events (if any) with `parent` (the name of the block before it in its prompt) and its
    /// `tokens` (copied only then).
    pub fn commit(&self, i: usize, name: u64, parent: Option<u64>, tokens: &[u32]) -> bool {
        let b = self.ids[i];
        let mut s = self.cache.lock();
        if s.by_name.contains_key(&name) || s.meta[b as usize].name.is_some() {
            return false;
        }
        s.by_name.insert(name, b);
        s.meta[b as usize].name = Some(name);
        if let Some(ev) = &self.cache.events {
            ev.stored(name, parent, tokens);
        }
        true
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.cache.release(&self.ids);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hits_reuse_and_lru_evicts_only_unreferenced_blocks() {
        let c = BlockCache::new(4);
        let a = c.try_acquire(&[1, 2], 2).unwrap().unwrap();
        assert_eq!(a.hits, 0);
        assert!(a.commit(0, 1, None, &[]) && a.commit(1, 2, None, &[]));
        let held = c.try_acquire(&[9, 8], 2).unwrap().unwrap(); // the other two blocks
        assert!(c.try_acquire(&[7], 1).unwrap().is_none(), "nothing free or evictable");
        drop(a); // blocks 1, 2 become cached (LRU: 2 then 1: a run is released tail first)
        assert_eq!(c.stats().cached, 2);
        let b = c.try_acquire(&[1, 2, 3], 3).unwrap();
        assert!(b.is_none(), "two hits, one fresh needed, nothing evictable but the hits");
        let r = c.try_acquire(&[1, 5], 2).unwrap().unwrap();
        assert_eq!(r.hits, 1);
        assert_eq!(c.stats().evicted, 1, "name 2 was evicted for the fresh block");
        assert_eq!(c.held_prefix(&[1, 2]), 1);
        drop((r, held));
        assert_eq!(c.stats().held, 0);
        assert_eq!(c.try_acquire(&[], 5).err(), Some(NeverFits { needed: 5, capacity: 4 }));
    }

    #[test]
    fn commits_and_evictions_are_published_once_in_order() {
        #[derive(Debug, PartialEq)]
        enum Event {
            Stored { name: u64, parent: Option<u64>, tokens: Vec<u32> },
            Removed(u64),
        }
        #[derive(Default)]
        struct Recorder(Mutex<Vec<Event>>);
        impl EventSink for Recorder {
            fn stored(&self, name: u64, parent: Option<u64>, tokens: &[u32]) {
                self.0.lock().unwrap().push(Event::Stored { name, parent, tokens: tokens.to_vec() });
            }
            fn removed(&self, name: u64) {
                self.0.lock().unwrap().push(Event::Removed(name));
            }
        }
        let rec = Arc::new(Recorder::default());
        let c = BlockCache::with_events(2, Some(rec.clone()));
        let a = c.try_acquire(&[1, 2], 2).unwrap().unwrap();
        assert!(a.commit(0, 1, None, &[10, 11]));
        assert!(a.commit(1, 2, Some(1), &[12, 13]));
        drop(a);
        // a duplicate publication is private: no event
        let x = c.try_acquire(&[9], 1).unwrap().unwrap(); // evicts name 2 (the tail goes first)
        assert!(!x.commit(0, 1, None, &[]), "name 1 is cached already");
        drop(x);
        let got = std::mem::take(&mut *rec.0.lock().unwrap());
        assert_eq!(
            got,
            [
                Event::Stored { name: 1, parent: None, tokens: vec![10, 11] },
                Event::Stored { name: 2, parent: Some(1), tokens: vec![12, 13] },
                Event::Removed(2),
            ]
        );
    }

    #[test]
    fn a_half_evicted_prompt_keeps_its_longest_head() {
        let c = BlockCache::new(20);
        let names: Vec<u64> = (1..=18).collect();
        let a = c.try_acquire(&names, 18).unwrap().unwrap();
        for (i, &n) in names.iter().enumerate() {
            assert!(a.commit(i, n, i.checked_sub(1).map(|p| names[p]), &[]));
        }
        drop(a);
        // a filler of 10 fresh blocks: 2 free ones, then 8 evicted from the prompt
        let filler = c.try_acquire(&[], 10).unwrap().unwrap();
        assert_eq!(c.stats().evicted, 8);
        assert_eq!(c.held_prefix(&names), 10, "the tail went first: the head of 10 is still usable");
        drop(filler);
        // the agent's pins release the same way: a pinned run, unpinned, is evicted tail first
        let mut ids = [0u32; 10];
        assert_eq!(c.pin(&names, &mut ids), 10);
        c.unpin(&ids);
        let more = c.try_acquire(&[], 14).unwrap().unwrap(); // 10 free, then 4 evicted
        assert_eq!(c.held_prefix(&names), 6);
        drop(more);
    }

    #[test]
    fn uncommitted_blocks_go_back_to_the_free_list() {
        let c = BlockCache::new(2);
        let a = c.try_acquire(&[1, 2], 2).unwrap().unwrap();
        assert!(a.commit(0, 1, None, &[]));
        drop(a);
        let s = c.stats();
        assert_eq!((s.cached, s.free, s.held), (1, 1, 0));
        // a duplicate publication stays private
        let x = c.try_acquire(&[3], 1).unwrap().unwrap();
        let y = c.try_acquire(&[3], 1).unwrap().unwrap();
        assert!(x.commit(0, 3, None, &[]));
        assert!(!y.commit(0, 3, None, &[]));
    }
}
