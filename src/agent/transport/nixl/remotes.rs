//! The remote NIXL agents a destination has loaded the metadata of: a bounded table.
//!
//! A source's NIXL agent is named after its process and start time, so every restart of a
//! source is a new name with up to [`MAX_METADATA`](crate::agent::wire::MAX_METADATA) bytes of
//! metadata. The table keeps at most [`MAX_REMOTES`] loaded agents and [`MAX_REMOTE_BYTES`] of
//! their metadata; beyond either, the least recently used loaded agent that no fetch uses (a
//! withheld READ holds a use of its source until it is over) is dropped (NIXL's copy invalidated), so sources that restart (or a
//! peer that poses as ever new sources) never grow it. A load that never finishes (a panic
//! inside it) does not leave its name "loading" for ever: its [`LoadMark`] clears the mark when
//! dropped.

use std::collections::HashMap;
use std::sync::{Condvar, Mutex};

/// Loaded remote agents kept at most.
pub(super) const MAX_REMOTES: usize = 64;
/// Bytes of loaded metadata kept at most (the newest load is kept whatever its size).
pub(super) const MAX_REMOTE_BYTES: usize = 64 << 20;

/// What a fetch from a remote agent does now.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Step {
    /// Its metadata is loaded (the same bytes): use it (counted as a user until released).
    Ready,
    /// Another fetch loads it now: wait for that load.
    Wait,
    /// Other metadata under the name of an agent fetches use now (a source does not change its
    /// metadata; a peer may pose as it): refused, the loaded one is kept for its users.
    InUse,
    /// Load it (marked loading); `stale`: other metadata of that name was loaded (invalidate it
    /// first).
    Load {
        /// Other metadata of that name was loaded.
        stale: bool,
    },
}

enum Entry {
    Loading,
    Loaded { md: Vec<u8>, used: u64, users: usize },
}

/// The table (see the module docs). Every method is O(entries) at most; no I/O.
#[derive(Default)]
pub(super) struct Remotes {
    map: HashMap<String, Entry>,
    bytes: usize,
    tick: u64,
}

impl Remotes {
    /// A fetch from agent `name` whose offer carries `md`.
    pub(super) fn begin(&mut self, name: &str, md: &[u8]) -> Step {
        self.tick += 1;
        let stale = match self.map.get_mut(name) {
            Some(Entry::Loaded { md: m, used, users }) if m == md => {
                *used = self.tick;
                *users += 1;
                return Step::Ready;
            }
            Some(Entry::Loading) => return Step::Wait,
            Some(Entry::Loaded { users, .. }) if *users > 0 => return Step::InUse,
            Some(Entry::Loaded { md: m, .. }) => {
                self.bytes -= m.len();
                true
            }
            None => false,
        };
        self.map.insert(name.to_string(), Entry::Loading);
        Step::Load { stale }
    }

    /// The load of `name` succeeded with `md` (its loader is its first user). Returns the names
    /// dropped to stay within the bounds, least recently used first, to invalidate in NIXL:
    /// never one in use (by a transfer, or by its withheld READs) or loading.
    pub(super) fn loaded(&mut self, name: &str, md: &[u8]) -> Vec<String> {
        self.tick += 1;
        self.bytes += md.len();
        self.map.insert(name.to_string(), Entry::Loaded { md: md.to_vec(), used: self.tick, users: 1 });
        let mut dropped = Vec::new();
        while self.map.len() > MAX_REMOTES || self.bytes > MAX_REMOTE_BYTES {
            let victim = self
                .map
                .iter()
                .filter(|(n, _)| n.as_str() != name)
                .filter_map(|(n, e)| match e {
                    Entry::Loaded { used, users: 0, .. } => Some((*used, n.clone())),
                    _ => None,
                })
                .min();
            let Some((_, n)) = victim else { break };
            if let Some(Entry::Loaded { md, .. }) = self.map.remove(&n) {
                self.bytes -= md.len();
            }
            dropped.push(n);
        }
        dropped
    }

    /// The load of `name` failed (or never finished): its mark goes, the next fetch loads it.
    pub(super) fn failed(&mut self, name: &str) {
        if matches!(self.map.get(name), Some(Entry::Loading)) {
            self.map.remove(name);
        }
    }

    /// A fetch that used `name` ended.
    pub(super) fn release(&mut self, name: &str) {
        if let Some(Entry::Loaded { users, .. }) = self.map.get_mut(name) {
            *users = users.saturating_sub(1);
        }
    }

    /// Drop `name` after a failure (the next fetch loads it afresh), when no fetch uses it:
    /// whether it was dropped (then invalidate NIXL's copy).
    pub(super) fn forget(&mut self, name: &str) -> bool {
        if matches!(self.map.get(name), Some(Entry::Loaded { users: 0, .. })) {
            if let Some(Entry::Loaded { md, .. }) = self.map.remove(name) {
                self.bytes -= md.len();
            }
            return true;
        }
        false
    }

    /// Whether `name` is loaded or loading (NIXL's copy of it must not be invalidated by
    /// anyone but the table).
    pub(super) fn knows(&self, name: &str) -> bool {
        self.map.contains_key(name)
    }

    /// Agents loaded or loading.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.map.len()
    }
}

/// The "loading" mark of one load: [`LoadMark::finish`] records how the load ended; dropped
/// without it (the load panicked), the mark is cleared and waiters are woken.
pub(super) struct LoadMark<'a> {
    table: &'a Mutex<Remotes>,
    cv: &'a Condvar,
    name: &'a str,
    done: bool,
}

impl<'a> LoadMark<'a> {
    /// The mark [`Remotes::begin`] just set for `name` (answering [`Step::Load`]).
    pub(super) fn new(table: &'a Mutex<Remotes>, cv: &'a Condvar, name: &'a str) -> LoadMark<'a> {
        LoadMark { table, cv, name, done: false }
    }

    /// The load ended: loaded with `md`, or failed (`None`). The names dropped to stay within
    /// the bounds are passed to `invalidate` under the table's lock (so that no fetch loads one
    /// of them afresh before NIXL's old copy is gone); how many.
    pub(super) fn finish(mut self, md: Option<&[u8]>, invalidate: &dyn Fn(&str)) -> usize {
        self.done = true;
        let mut t = self.table.lock().unwrap_or_else(|e| e.into_inner());
        let dropped = match md {
            Some(md) => t.loaded(self.name, md),
            None => {
                t.failed(self.name);
                Vec::new()
            }
        };
        for n in &dropped {
            invalidate(n);
        }
        drop(t);
        self.cv.notify_all();
        dropped.len()
    }
}

impl Drop for LoadMark<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.table.lock().unwrap_or_else(|e| e.into_inner()).failed(self.name);
            self.cv.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(t: &mut Remotes, name: &str, md: &[u8]) -> Vec<String> {
        assert!(matches!(t.begin(name, md), Step::Load { .. }));
        let d = t.loaded(name, md);
        t.release(name);
        d
    }

    #[test]
    fn restarting_sources_never_grow_the_table() {
        let mut t = Remotes::default();
        let mut dropped = Vec::new();
        for i in 0..MAX_REMOTES + 10 {
            dropped.extend(load(&mut t, &format!("src-{i}"), b"md"));
        }
        assert_eq!(t.len(), MAX_REMOTES);
        // the least recently used went first
        assert_eq!(dropped, (0..10).map(|i| format!("src-{i}")).collect::<Vec<_>>());
        // one used again is recent: the next drop takes the oldest other one
        assert_eq!(t.begin("src-10", b"md"), Step::Ready);
        t.release("src-10");
        assert_eq!(load(&mut t, "new", b"md"), ["src-11"]);
        // bytes are bounded too (the newest is kept whatever its size)
        let big = vec![0u8; MAX_REMOTE_BYTES / 2 + 1];
        load(&mut t, "big-1", &big);
        let d = load(&mut t, "big-2", &big);
        assert!(d.contains(&"big-1".to_string()), "{d:?}");
        assert!(t.bytes <= MAX_REMOTE_BYTES);
    }

    #[test]
    fn agents_in_use_or_with_withheld_reads_are_never_dropped() {
        let mut t = Remotes::default();
        assert!(matches!(t.begin("busy", b"m"), Step::Load { stale: false }));
        t.loaded("busy", b"m"); // its loader uses it
                                // withheld READs hold a use of their source
        load(&mut t, "withheld", b"m");
        assert_eq!(t.begin("withheld", b"m"), Step::Ready);
        for i in 0..2 * MAX_REMOTES {
            let d = {
                assert!(matches!(t.begin(&format!("s{i}"), b"m"), Step::Load { .. }));
                let d = t.loaded(&format!("s{i}"), b"m");
                t.release(&format!("s{i}"));
                d
            };
            assert!(!d.iter().any(|n| n == "busy" || n == "withheld"), "{d:?}");
        }
        assert_eq!(t.begin("busy", b"m"), Step::Ready);
        // other metadata under the name of an agent in use: refused, the loaded one kept
        assert_eq!(t.begin("busy", b"other"), Step::InUse);
        assert!(t.knows("busy") && !t.knows("nobody"));
        assert!(!t.forget("busy"), "two users: not forgotten");
        t.release("busy");
        t.release("busy");
        assert!(t.forget("busy"));
        // other metadata under a known name: loaded again, the old copy stale
        load(&mut t, "x", b"old");
        assert_eq!(t.begin("x", b"new"), Step::Load { stale: true });
    }

    #[test]
    fn a_load_that_panics_leaves_no_mark() {
        let table = Mutex::new(Remotes::default());
        let cv = Condvar::new();
        assert!(matches!(table.lock().unwrap().begin("a", b"m"), Step::Load { .. }));
        assert_eq!(table.lock().unwrap().begin("a", b"m"), Step::Wait, "another fetch waits for the load");
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _mark = LoadMark::new(&table, &cv, "a");
            panic!("inside NIXL's load");
        }));
        assert!(r.is_err());
        assert!(matches!(table.lock().unwrap().begin("a", b"m"), Step::Load { stale: false }), "loaded afresh");
        // a finished mark records the load
        let mark = LoadMark::new(&table, &cv, "a");
        assert_eq!(mark.finish(Some(b"m"), &|_| panic!("nothing to drop")), 0);
        assert_eq!(table.lock().unwrap().begin("a", b"m"), Step::Ready);
    }
}
