//! The source allocations a destination keeps mapped: bounded in all ([`MAX_MAPPED`]) and per
//! source process ([`SOURCE_RANGES`], [`SOURCE_BYTES`]), so that one source (or a neighbour that
//! poses as many) cannot take the table from the others. Beyond a bound, the least recently
//! used mapping that no fetch holds goes (of the same source first when that source is over its
//! quota); when every candidate is held, the new mapping is refused and the fetch falls back to
//! TCP. The table only does bookkeeping: every driver call (mapping, unmapping: the last
//! [`Arc`] of a mapping dropped) and every look at `/proc` happens outside its lock, on what it
//! hands out or gives back in `gone`.

use std::collections::HashMap;
use std::sync::Arc;

/// Most source allocations (and virtual-memory ranges) one destination keeps mapped.
pub(super) const MAX_MAPPED: usize = 1024;
/// Most of them from one source process. An offer that names more is refused before anything
/// of it is opened ([`over_quota`]): a source cannot raise its own quota.
pub(super) const SOURCE_RANGES: usize = 128;
/// Most bytes mapped from one source process (address space here, not memory), likewise.
pub(super) const SOURCE_BYTES: u64 = 1 << 40;

/// Whether one offer of `ranges` ranges and `bytes` bytes is more than a source may have
/// mapped at all: refused whole, before any of it is opened.
pub(super) fn over_quota(ranges: usize, bytes: u64) -> bool {
    ranges > SOURCE_RANGES || bytes > SOURCE_BYTES
}

/// A source process (its host's boot id and its pid) and one of its allocations: a CUDA IPC
/// handle, or the key of a virtual-memory range.
pub(super) type Key = ([u8; 16], u32, [u8; 64]);

struct Entry<V> {
    v: Arc<V>,
    bytes: u64,
    /// Its source process showed in this process's `/proc` when it was mapped (one in another
    /// PID namespace does not: its mapping is then kept until the bounds or the agent's stop
    /// let it go, never let go and made again at every look).
    watched: bool,
    used: u64,
}

/// A new mapping for [`Table::admit`].
pub(super) struct New<V> {
    pub(super) key: Key,
    pub(super) v: Arc<V>,
    pub(super) bytes: u64,
    pub(super) watched: bool,
}

/// Why [`Table::admit`] refused.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Full {
    /// The source's quota is taken by mappings fetches hold.
    Source,
    /// The whole table is, likewise.
    Table,
}

/// The table (see the module docs). Every method is O(entries) at most, with no I/O.
pub(super) struct Table<V> {
    map: HashMap<Key, Entry<V>>,
    tick: u64,
    /// Room reserved ([`Table::reserve`]) by fetches mapping outside the lock: per source
    /// `(host, pid)`, ranges and bytes.
    pending: HashMap<([u8; 16], u32), (usize, u64)>,
}

impl<V> Default for Table<V> {
    fn default() -> Self {
        Table { map: HashMap::new(), tick: 0, pending: HashMap::new() }
    }
}

/// Room for `ranges` new mappings of `bytes` from one source, reserved before they are made
/// ([`Table::reserve`]); give it back with [`Table::unreserve`] once they were admitted or not.
#[derive(Debug)]
pub(super) struct Room {
    source: ([u8; 16], u32),
    ranges: usize,
    bytes: u64,
}

impl<V> Table<V> {
    /// The mapping of `key`, marked used.
    pub(super) fn get(&mut self, key: &Key) -> Option<Arc<V>> {
        self.tick += 1;
        let e = self.map.get_mut(key)?;
        e.used = self.tick;
        Some(e.v.clone())
    }

    #[cfg(test)]
    pub(super) fn contains(&self, key: &Key) -> bool {
        self.map.contains_key(key)
    }

    /// Mappings kept.
    pub(super) fn len(&self) -> usize {
        self.map.len()
    }

    /// Mappings whose source could be looked at (a sweep can let those go).
    pub(super) fn watched(&self) -> usize {
        self.map.values().filter(|e| e.watched).count()
    }

    /// Mappings and bytes of source `(host, pid)`.
    fn of(&self, host: &[u8; 16], pid: u32) -> (usize, u64) {
        self.map.iter().filter(|(k, _)| k.0 == *host && k.1 == pid).fold((0, 0), |(n, b), (_, e)| (n + 1, b + e.bytes))
    }

    /// Take out the least recently used mapping no fetch holds (of source `only` when given)
    /// into `gone`; whether there was one.
    fn evict(&mut self, only: Option<(&[u8; 16], u32)>, gone: &mut Vec<Arc<V>>) -> bool {
        let victim = self
            .map
            .iter()
            .filter(|(k, e)| only.is_none_or(|(h, p)| k.0 == *h && k.1 == p) && Arc::strong_count(&e.v) == 1)
            .min_by_key(|(_, e)| e.used)
            .map(|(k, _)| *k);
        match victim.and_then(|k| self.map.remove(&k)) {
            Some(e) => {
                gone.push(e.v);
                true
            }
            None => false,
        }
    }

    /// Reserve room for `ranges` new mappings of `bytes` of source `(host, pid)` before they are
    /// made (outside the lock): refused when that source's quota, or the whole table, cannot
    /// hold them even once every mapping no fetch holds is let go, counting what other fetches
    /// reserved meanwhile. So concurrent fetches of a full source are refused before their
    /// driver calls, not after. (A mapping that becomes held after this can still make
    /// [`Table::admit`] refuse; that is only the rarer case.)
    pub(super) fn reserve(&mut self, host: [u8; 16], pid: u32, ranges: usize, bytes: u64) -> Result<Room, Full> {
        let held = |e: &Entry<V>| Arc::strong_count(&e.v) > 1;
        let (mut src_n, mut src_b, mut all_n) = (0usize, 0u64, 0usize);
        for (k, e) in &self.map {
            if held(e) {
                all_n += 1;
                if k.0 == host && k.1 == pid {
                    src_n += 1;
                    src_b = src_b.saturating_add(e.bytes);
                }
            }
        }
        let (pn, pb) = self.pending.get(&(host, pid)).copied().unwrap_or((0, 0));
        let pending_all: usize = self.pending.values().map(|p| p.0).sum();
        if src_n + pn + ranges > SOURCE_RANGES || src_b.saturating_add(pb).saturating_add(bytes) > SOURCE_BYTES {
            return Err(Full::Source);
        }
        if all_n + pending_all + ranges > MAX_MAPPED {
            return Err(Full::Table);
        }
        let p = self.pending.entry((host, pid)).or_insert((0, 0));
        p.0 += ranges;
        p.1 = p.1.saturating_add(bytes);
        Ok(Room { source: (host, pid), ranges, bytes })
    }

    /// Give back room reserved by [`Table::reserve`].
    pub(super) fn unreserve(&mut self, room: Room) {
        if let Some(p) = self.pending.get_mut(&room.source) {
            p.0 = p.0.saturating_sub(room.ranges);
            p.1 = p.1.saturating_sub(room.bytes);
            if p.0 == 0 {
                self.pending.remove(&room.source);
            }
        }
    }

    /// Keep `new` mappings (made outside the lock), in order; returns, per new one, the mapping
    /// to use: its own, or one another fetch kept for the same key meanwhile (its own then goes
    /// to `gone`). Mappings evicted to make room go to `gone` too; drop `gone` after the lock.
    /// Refused when the room can only come from mappings fetches hold: the new mappings not
    /// kept yet go to `gone`, and the count of evictions so far is in the second field. The
    /// quota is [`SOURCE_RANGES`] and [`SOURCE_BYTES`] whatever the offer says (the caller
    /// refused an offer [`over_quota`] before opening it).
    pub(super) fn admit(&mut self, new: Vec<New<V>>, gone: &mut Vec<Arc<V>>) -> (Result<Vec<Arc<V>>, Full>, usize) {
        let (quota, quota_bytes) = (SOURCE_RANGES, SOURCE_BYTES);
        let mut out = Vec::with_capacity(new.len());
        let mut evicted = 0;
        let mut new = new.into_iter();
        while let Some(n) = new.next() {
            if let Some(p) = self.get(&n.key) {
                gone.push(n.v);
                out.push(p);
                continue;
            }
            let (host, pid) = (n.key.0, n.key.1);
            let refused = loop {
                let (count, bytes) = self.of(&host, pid);
                if count < quota && bytes.saturating_add(n.bytes) <= quota_bytes {
                    break None;
                }
                if !self.evict(Some((&host, pid)), gone) {
                    break Some(Full::Source);
                }
                evicted += 1;
            }
            .or_else(|| loop {
                if self.map.len() < MAX_MAPPED {
                    break None;
                }
                if !self.evict(None, gone) {
                    break Some(Full::Table);
                }
                evicted += 1;
            });
            if let Some(full) = refused {
                gone.push(n.v);
                gone.extend(new.map(|n| n.v));
                return (Err(full), evicted);
            }
            self.tick += 1;
            self.map.insert(n.key, Entry { v: n.v.clone(), bytes: n.bytes, watched: n.watched, used: self.tick });
            out.push(n.v);
        }
        (Ok(out), evicted)
    }

    /// The source processes of watched mappings (to look at in `/proc`, outside the lock).
    /// Keep the mappings of at most `keep` tokens of source `(host, pid)`'s virtual-memory
    /// ranges (`token_of` reads a key's token; `None` for other mappings): the most recently
    /// used tokens stay, the mappings of older ones that no fetch holds go into `gone`. A
    /// source serves each connection from an export area of its own under a token of its own,
    /// and gives an area up with the connection: the memory of areas it gave up lives until
    /// this side lets go too. How many went.
    pub(super) fn retire_tokens(
        &mut self,
        host: &[u8; 16],
        pid: u32,
        keep: usize,
        token_of: impl Fn(&[u8; 64]) -> Option<[u8; 32]>,
        gone: &mut Vec<Arc<V>>,
    ) -> usize {
        // the source's tokens, by when each was last used
        let mut tokens: Vec<([u8; 32], u64)> = Vec::new();
        for (k, e) in self.map.iter().filter(|(k, _)| k.0 == *host && k.1 == pid) {
            let Some(t) = token_of(&k.2) else { continue };
            match tokens.iter_mut().find(|(x, _)| *x == t) {
                Some((_, used)) => *used = (*used).max(e.used),
                None => tokens.push((t, e.used)),
            }
        }
        if tokens.len() <= keep {
            return 0;
        }
        tokens.sort_unstable_by_key(|&(_, used)| std::cmp::Reverse(used));
        let old: Vec<[u8; 32]> = tokens[keep..].iter().map(|&(t, _)| t).collect();
        let victims: Vec<Key> = self
            .map
            .iter()
            .filter(|(k, e)| {
                k.0 == *host
                    && k.1 == pid
                    && Arc::strong_count(&e.v) == 1
                    && token_of(&k.2).is_some_and(|t| old.contains(&t))
            })
            .map(|(k, _)| *k)
            .collect();
        for k in &victims {
            if let Some(e) = self.map.remove(k) {
                gone.push(e.v);
            }
        }
        victims.len()
    }

    pub(super) fn watched_pids(&self) -> Vec<u32> {
        let mut p: Vec<u32> = self.map.iter().filter(|(_, e)| e.watched).map(|(k, _)| k.1).collect();
        p.sort_unstable();
        p.dedup();
        p
    }

    /// Let go of the watched mappings of processes `pids` (they ended) into `gone`; how many.
    pub(super) fn drop_pids(&mut self, pids: &[u32], gone: &mut Vec<Arc<V>>) -> usize {
        let keys: Vec<Key> =
            self.map.iter().filter(|(k, e)| e.watched && pids.contains(&k.1)).map(|(k, _)| *k).collect();
        for k in &keys {
            if let Some(e) = self.map.remove(k) {
                gone.push(e.v);
            }
        }
        keys.len()
    }

    /// Every mapping, into `gone` (the agent stops).
    pub(super) fn clear(&mut self, gone: &mut Vec<Arc<V>>) {
        gone.extend(self.map.drain().map(|(_, e)| e.v));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(pid: u32, n: u8) -> Key {
        let mut h = [0u8; 64];
        h[0] = n;
        ([7; 16], pid, h)
    }

    fn new(pid: u32, n: u8, bytes: u64) -> New<u32> {
        New { key: key(pid, n), v: Arc::new(u32::from(n)), bytes, watched: true }
    }

    #[test]
    fn one_source_cannot_take_the_table() {
        let mut t = Table::default();
        let mut gone = Vec::new();
        // a source that offers ever new allocations stays within its quota: its oldest go
        for i in 0..SOURCE_RANGES + 10 {
            let (r, _) = t.admit(vec![new(1, i as u8, 1 << 20)], &mut gone);
            assert!(r.is_ok());
        }
        assert_eq!(t.of(&[7; 16], 1).0, SOURCE_RANGES);
        assert_eq!(gone.len(), 10, "its ten oldest were let go");
        assert!(!t.contains(&key(1, 9)) && t.contains(&key(1, 10)));
        // another source still gets its mappings
        let (r, evicted) = t.admit(vec![new(2, 1, 1 << 20)], &mut gone);
        assert!(r.is_ok());
        assert_eq!(evicted, 0, "room without touching the first source");
        drop(r);
        // bytes are a quota too (the fetch that mapped it let go)
        let (r, _) = t.admit(vec![new(3, 1, SOURCE_BYTES)], &mut gone);
        assert!(r.is_ok());
        drop(r);
        let before = gone.len();
        let (r, evicted) = t.admit(vec![new(3, 2, 1)], &mut gone);
        assert!(r.is_ok());
        assert_eq!((evicted, gone.len()), (1, before + 1), "the older of source 3 went");
        assert!(!t.contains(&key(3, 1)) && t.contains(&key(3, 2)));
    }

    #[test]
    fn a_source_keeps_the_mappings_of_its_newest_tokens_only() {
        let mut t = Table::default();
        let mut gone = Vec::new();
        // keys whose byte 1 is the token's first byte; byte 0 tells ranges apart
        let keyed = |pid: u32, n: u8, token: u8| New {
            key: ([7; 16], pid, {
                let mut h = [0u8; 64];
                (h[0], h[1]) = (n, token);
                h
            }),
            v: Arc::new(u32::from(n)),
            bytes: 1 << 20,
            watched: true,
        };
        let token_of = |k: &[u8; 64]| (k[1] != 0).then(|| [k[1]; 32]);
        // source 1: two ranges under token 1, then one under each of tokens 2, 3 and 4, used in
        // that order; a mapping of no token; source 2 under token 1
        let held = t.admit(vec![keyed(1, 1, 1), keyed(1, 2, 1)], &mut gone).0.unwrap();
        drop(held);
        for (n, token) in [(3, 2), (4, 3), (5, 4), (6, 0)] {
            drop(t.admit(vec![keyed(1, n, token)], &mut gone).0.unwrap());
        }
        drop(t.admit(vec![keyed(2, 1, 1)], &mut gone).0.unwrap());
        // token 2 is in use by a fetch: it stays whatever its age
        let busy = t.get(&keyed(1, 3, 2).key).unwrap();
        let _ = t.get(&keyed(1, 5, 4).key);
        let _ = t.get(&keyed(1, 4, 3).key);
        assert_eq!(t.retire_tokens(&[7; 16], 1, 2, token_of, &mut gone), 2, "token 1's two ranges");
        assert!(!t.contains(&keyed(1, 1, 1).key) && !t.contains(&keyed(1, 2, 1).key));
        for n in [(3, 2), (4, 3), (5, 4), (6, 0)] {
            assert!(t.contains(&keyed(1, n.0, n.1).key), "{n:?} stays");
        }
        assert!(t.contains(&keyed(2, 1, 1).key), "another source's token 1 stays");
        drop(busy);
        assert_eq!(t.retire_tokens(&[7; 16], 1, 2, token_of, &mut gone), 1, "token 2, no longer held");
        assert_eq!(t.retire_tokens(&[7; 16], 1, 2, token_of, &mut gone), 0);
        assert_eq!(gone.len(), 3);
    }

    #[test]
    fn an_offer_cannot_raise_its_source_quota() {
        assert!(!over_quota(SOURCE_RANGES, SOURCE_BYTES));
        assert!(over_quota(SOURCE_RANGES + 1, 1), "more ranges than a source may have mapped");
        assert!(over_quota(1, SOURCE_BYTES + 1), "more bytes");
        // and the table keeps to the quota whatever a caller hands it
        let mut t = Table::default();
        let mut gone = Vec::new();
        let n = SOURCE_RANGES + 32;
        let new: Vec<New<u32>> = (0..n as u16)
            .map(|i| {
                let mut k = key(5, 0);
                k.2[1..3].copy_from_slice(&i.to_le_bytes());
                New { key: k, v: Arc::new(0), bytes: 1, watched: true }
            })
            .collect();
        let (r, _) = t.admit(new, &mut gone);
        assert_eq!(r.map(|v| v.len()), Err(Full::Source), "{n} ranges of one source, all held by one fetch");
        assert_eq!(t.of(&[7; 16], 5).0, SOURCE_RANGES, "the source keeps no more than its quota");
        assert_eq!(gone.len(), n - SOURCE_RANGES, "the rest was let go");
    }

    /// Room is reserved before mapping: a source whose quota is held, or reserved by fetches
    /// still mapping, is refused before any driver call; room given back is free again.
    #[test]
    fn room_is_reserved_before_mapping() {
        let mut t: Table<u32> = Table::default();
        let mut gone = Vec::new();
        // 100 mappings of source 1, all held by fetches
        let (held, _) = t.admit((0..100).map(|i| new(1, i, 1)).collect(), &mut gone);
        let held = held.unwrap();
        // a fetch reserves 20 more, and is still mapping them
        let r = t.reserve([7; 16], 1, 20, 20).unwrap();
        // another fetch of the same source wants 10: 100 held + 20 reserved + 10 > 128
        assert_eq!(t.reserve([7; 16], 1, 10, 10).unwrap_err(), Full::Source);
        // another source is not charged for it
        let other = t.reserve([7; 16], 2, 10, 10).unwrap();
        t.unreserve(r);
        let r2 = t.reserve([7; 16], 1, 10, 10).unwrap();
        // bytes count too
        assert_eq!(t.reserve([7; 16], 3, 1, SOURCE_BYTES + 1).unwrap_err(), Full::Source);
        // mappings no fetch holds are room (they can be let go)
        drop(held);
        let r3 = t.reserve([7; 16], 1, 28, 28).unwrap();
        for room in [other, r2, r3] {
            t.unreserve(room);
        }
        assert!(t.pending.is_empty());
    }

    #[test]
    fn held_mappings_are_never_evicted_and_a_full_source_is_refused() {
        let mut t = Table::default();
        let mut gone = Vec::new();
        let mut held = Vec::new();
        for i in 0..SOURCE_RANGES {
            let (r, _) = t.admit(vec![new(1, i as u8, 1)], &mut gone);
            held.extend(r.unwrap());
        }
        // every one held by a fetch: the next is refused, and nothing was let go
        let (r, evicted) = t.admit(vec![new(1, 200, 1), new(1, 201, 1)], &mut gone);
        assert_eq!((r.err(), evicted), (Some(Full::Source), 0));
        assert_eq!(gone.len(), 2, "both new mappings are handed back to be unmapped");
        assert_eq!(t.len(), SOURCE_RANGES);
        // the least recently used unheld one goes first
        drop(held.drain(..2));
        assert!(t.get(&key(1, 0)).is_some()); // block 0 used again
        gone.clear();
        let (r, evicted) = t.admit(vec![new(1, 200, 1)], &mut gone);
        assert!(r.is_ok());
        assert_eq!(evicted, 1);
        assert!(t.contains(&key(1, 0)) && !t.contains(&key(1, 1)));
    }

    #[test]
    fn the_whole_table_is_bounded_and_a_key_kept_meanwhile_is_shared() {
        let mut t = Table::default();
        let mut gone = Vec::new();
        for pid in 0..(MAX_MAPPED / SOURCE_RANGES) as u32 {
            let n = (0..SOURCE_RANGES as u16).map(|i| New {
                key: {
                    let mut k = key(pid, 0);
                    k.2[1..3].copy_from_slice(&i.to_le_bytes());
                    k
                },
                v: Arc::new(0),
                bytes: 1,
                watched: pid % 2 == 0,
            });
            assert!(t.admit(n.collect(), &mut gone).0.is_ok());
        }
        assert_eq!(t.len(), MAX_MAPPED);
        let (r, evicted) = t.admit(vec![new(999, 1, 1)], &mut gone);
        assert!(r.is_ok());
        assert_eq!((evicted, t.len()), (1, MAX_MAPPED));
        // the same key made by two fetches: the second's own goes, the first's is used
        gone.clear();
        let (r, _) = t.admit(vec![New { key: key(999, 1), v: Arc::new(77), bytes: 1, watched: true }], &mut gone);
        assert_eq!(*r.unwrap()[0], 1);
        assert_eq!(gone.iter().map(|g| **g).collect::<Vec<_>>(), [77]);
        // a sweep lets go of the watched mappings of ended processes only
        assert_eq!(t.watched_pids().len(), MAX_MAPPED / SOURCE_RANGES / 2 + 1);
        gone.clear();
        let n = t.drop_pids(&[1, 2], &mut gone);
        assert_eq!(n, SOURCE_RANGES, "pid 2's, all of them");
        assert_eq!(t.of(&[7; 16], 1).0, SOURCE_RANGES, "pid 1's are unwatched: kept");
    }
}
