//! This process's CUDA IPC agents, registered while they live ([`EXPORTED`]): what an offer
//! that claims to come from this process may name (the agent, its exports, the blocks it serves
//! now under the names asked) and read (that agent's pool extents only), and the holds that
//! keep an agent, and its pool, alive while a copy of this process reads it.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use crate::agent::wire;
use crate::copy::KvLayout;

/// One CUDA IPC agent of this process, in [`EXPORTED`] while it lives: what an offer that
/// claims to come from this process may name. The pid and host in an offer are what any process
/// of the host can read and claim, and such an offer's addresses are used as this process's
/// own, so it must name an agent of this process on the offer's device, only memory of that
/// agent's pool (not the rest of the allocations its pool lies in), and only blocks that agent
/// is serving now under the very names the fetch asked for: no address a neighbour chooses,
/// and no block of another tenant of this process.
pub(super) struct Registration {
    /// The agent's number (one per start).
    pub(super) id: u64,
    /// Its pool's device.
    device: i32,
    /// The ranges `(base, bytes)` it exports (its offers' allocations and virtual-memory ranges).
    exports: Vec<(u64, u64)>,
    /// Its pool's extents `(base, bytes)`, one per segment: all a copy in this process may read.
    pool: Vec<(u64, u64)>,
    /// The blocks it serves now: `(id, name, serves)`, added before its offer goes out and taken
    /// out when the serve ends (the reader's `DONE` or the deadline).
    serving: Mutex<Vec<(u32, u64, u32)>>,
    /// Copies of this process reading its pool now: its agent's end waits for none.
    readers: Mutex<usize>,
    no_readers: std::sync::Condvar,
}

/// This process's CUDA IPC agents ([`Registration`]).
pub(super) static EXPORTED: Mutex<Vec<Arc<Registration>>> = Mutex::new(Vec::new());
/// Numbers the agents' registrations in [`EXPORTED`].
static EXPORTS_NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// Whether every range of `claimed` lies inside one range of `exported` (`(base, bytes)`).
pub(super) fn inside_exports(claimed: &[(u64, u64)], exported: &[(u64, u64)]) -> bool {
    claimed.iter().all(|&(b, n)| {
        b.checked_add(n).is_some_and(|end| exported.iter().any(|&(eb, en)| eb <= b && end <= eb.saturating_add(en)))
    })
}

/// The extents `(base, bytes)` of `layout`'s segments: every byte of every block.
pub(super) fn pool_extents(layout: &KvLayout) -> Vec<(u64, u64)> {
    let last = u64::from(layout.num_blocks().saturating_sub(1));
    layout.segments().iter().map(|g| (g.base, last * g.block_stride + g.bytes_per_block)).collect()
}

/// What the driver may add to an allocation's size (`cuMemAlloc` rounds up to its 2 MiB
/// granularity at most; the virtual memory API's allocations are multiples of theirs, 2 MiB on
/// the GPUs we know): bytes past the pool that no other allocation can hold.
pub(super) const ROUNDING: u64 = 2 << 20;

/// The bytes of `range` (`(base, bytes)`: an allocation, or a virtual-memory range, that a
/// grant exports whole) that are not the pool (`pool`: its extents `(base, bytes)`), so that a
/// peer mapping the grant could reach them: those before the pool's first byte in it, those
/// between its extents, and those after its last byte beyond what the driver's rounding of
/// an allocation starting at `range`'s base and ending there could add ([`ROUNDING`]). Zero
/// for a pool that is its own allocation.
pub(super) fn outside_pool(range: (u64, u64), pool: &[(u64, u64)]) -> u64 {
    let (b, n) = range;
    let e = b.saturating_add(n);
    let mut inside: Vec<(u64, u64)> =
        pool.iter().map(|&(pb, pn)| (pb.max(b), pb.saturating_add(pn).min(e))).filter(|&(s, t)| s < t).collect();
    inside.sort_unstable();
    let (mut outside, mut at) = (0u64, b);
    for (s, t) in inside {
        outside += s.saturating_sub(at);
        at = at.max(t);
    }
    if at == b {
        return n; // none of the pool in it
    }
    let rounded = b.saturating_add((at - b).div_ceil(ROUNDING).saturating_mul(ROUNDING));
    outside + e.saturating_sub(rounded)
}

/// An agent's [`Registration`] in [`EXPORTED`]: taken out when dropped, which then waits until
/// no copy of this process reads its pool (so that the agent, and the runtime's pool after it,
/// outlive every read).
pub(super) struct Exported(pub(super) Arc<Registration>);

impl Exported {
    pub(super) fn register(device: i32, exports: Vec<(u64, u64)>, pool: Vec<(u64, u64)>) -> Exported {
        let r = Arc::new(Registration {
            id: EXPORTS_NEXT.fetch_add(1, Ordering::Relaxed),
            device,
            exports,
            pool,
            serving: Mutex::new(Vec::new()),
            readers: Mutex::new(0),
            no_readers: std::sync::Condvar::new(),
        });
        EXPORTED.lock().unwrap_or_else(|p| p.into_inner()).push(r.clone());
        Exported(r)
    }

    /// Record that `ids` (names `names`) are being served, until the guard goes.
    pub(super) fn serving<'a>(&'a self, ids: &'a [u32], names: &'a [u64]) -> Serving<'a> {
        let mut s = self.0.serving.lock().unwrap_or_else(|p| p.into_inner());
        for (&id, &name) in ids.iter().zip(names) {
            match s.iter_mut().find(|e| e.0 == id && e.1 == name) {
                Some(e) => e.2 += 1,
                None => s.push((id, name, 1)),
            }
        }
        Serving { r: &self.0, ids, names }
    }
}

impl Drop for Exported {
    fn drop(&mut self) {
        EXPORTED.lock().unwrap_or_else(|p| p.into_inner()).retain(|e| e.id != self.0.id);
        // no new reader can find it now; wait for those that did (each copy synchronizes
        // within its fetch's deadline)
        let mut n = self.0.readers.lock().unwrap_or_else(|p| p.into_inner());
        while *n > 0 {
            n = self.0.no_readers.wait(n).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// Blocks recorded as served by [`Exported::serving`], taken out when dropped.
pub(super) struct Serving<'a> {
    r: &'a Registration,
    ids: &'a [u32],
    names: &'a [u64],
}

impl Drop for Serving<'_> {
    fn drop(&mut self) {
        let mut s = self.r.serving.lock().unwrap_or_else(|p| p.into_inner());
        for (&id, &name) in self.ids.iter().zip(self.names) {
            if let Some(i) = s.iter().position(|e| e.0 == id && e.1 == name) {
                s[i].2 -= 1;
                if s[i].2 == 0 {
                    s.swap_remove(i);
                }
            }
        }
    }
}

/// A copy of this process reading a registered agent's pool: that agent's end waits until it
/// goes.
pub(super) struct Reading(pub(super) Arc<Registration>);

impl Drop for Reading {
    fn drop(&mut self) {
        let mut n = self.0.readers.lock().unwrap_or_else(|p| p.into_inner());
        *n -= 1;
        if *n == 0 {
            self.0.no_readers.notify_all();
        }
    }
}

/// Why an offer in this process's name is refused, before any copy.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum OwnRefusal {
    /// No agent of this process on the offer's device exported the ranges it names.
    NotExported,
    /// Offered block `i` is not a block that agent serves now under the name asked at `i`.
    NotAsked(usize),
}

/// The registered agent an offer in this process's name comes from, with its pool's extents
/// (what the copy plans may read; mapped at their own addresses) and a hold on it for the
/// copy: only an agent on `device` whose exports hold every range `claimed` names, and only
/// when every offered block `blocks[i]` is one it serves now under the name `asked[i]`.
pub(super) fn own_source(
    registry: &[Arc<Registration>],
    device: i32,
    claimed: &[(u64, u64)],
    blocks: &[wire::OfferedBlock],
    asked: &[u64],
) -> Result<(Vec<(u64, u64)>, Reading), OwnRefusal> {
    let r = registry
        .iter()
        .find(|r| r.device == device && inside_exports(claimed, &r.exports))
        .ok_or(OwnRefusal::NotExported)?;
    {
        let serving = r.serving.lock().unwrap_or_else(|p| p.into_inner());
        for (i, b) in blocks.iter().enumerate() {
            let name = asked.get(i).ok_or(OwnRefusal::NotAsked(i))?;
            if !serving.iter().any(|e| e.0 == b.0 && e.1 == *name) {
                return Err(OwnRefusal::NotAsked(i));
            }
        }
    }
    *r.readers.lock().unwrap_or_else(|p| p.into_inner()) += 1;
    Ok((r.pool.clone(), Reading(r.clone())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grant_holds_the_pool_and_nothing_else() {
        const M: u64 = 1 << 20;
        // a pool that is its whole allocation, as the driver reports it exactly or rounded up
        assert_eq!(outside_pool((1 << 40, 3 * M + 5), &[(1 << 40, 3 * M + 5)]), 0);
        assert_eq!(outside_pool((1 << 40, 4 * M), &[(1 << 40, 3 * M + 5)]), 0);
        // two segments side by side, in either order, overlapping or touching
        let (b, half) = (1u64 << 40, 16 * M);
        assert_eq!(outside_pool((b, 2 * half), &[(b + half, half), (b, half)]), 0);
        assert_eq!(outside_pool((b, 2 * half), &[(b, half + 10), (b + half, half)]), 0);
        // other tensors before the pool, between its segments, or past the rounding after it
        assert_eq!(outside_pool((b, 64 * M), &[(b + 4096, 64 * M - 4096)]), 4096);
        assert_eq!(outside_pool((b, 3 * half), &[(b, half), (b + 2 * half, half)]), half);
        assert_eq!(outside_pool((b, 8 * M), &[(b, 3 * M)]), 4 * M);
        assert_eq!(outside_pool((b, 4 * M + 1), &[(b, 3 * M)]), 1);
        // a pool that is none of it, or runs past it (only its part inside counts)
        assert_eq!(outside_pool((b, M), &[(b + M, M)]), M);
        assert_eq!(outside_pool((b + M, M), &[(b, 4 * M)]), 0);
        // a range at the top of the address space neither wraps nor panics
        assert_eq!(outside_pool((u64::MAX - M, M), &[(u64::MAX - M, M)]), 0);
    }

    #[test]
    fn an_offer_in_this_process_s_name_may_only_name_its_exports() {
        let exported = [(0x1000, 0x1000), (0x10_0000, 0x4000)];
        assert!(inside_exports(&[(0x1000, 0x1000), (0x10_1000, 0x3000)], &exported));
        assert!(inside_exports(&[], &exported));
        // past an export's end, before its start, between two, wrapping around
        assert!(!inside_exports(&[(0x1000, 0x1001)], &exported));
        assert!(!inside_exports(&[(0x800, 0x100)], &exported));
        assert!(!inside_exports(&[(0x1000, 0x1000), (0x2000, 0x10)], &exported));
        assert!(!inside_exports(&[(u64::MAX - 4, 16)], &exported));
    }

    /// An offer in this process's name is taken only from an agent of this process on the
    /// offer's device whose exports hold what it claims, only for blocks that agent serves now
    /// under the names asked, and it reads only that agent's pool extents; anything else is
    /// refused before any copy. The agent's end waits for the copies reading its pool.
    #[test]
    fn an_offer_in_this_process_s_name_gets_only_the_asked_blocks_of_that_agent_s_pool() {
        // an allocation of 64 KiB whose middle 8 KiB is the pool (two segments), on device 3
        let (alloc, pool) =
            ((0xbeef_0000_0000u64, 0x1_0000u64), vec![(0xbeef_0000_4000u64, 0x1000u64), (0xbeef_0000_5000, 0x1000)]);
        let other = Exported::register(4, vec![alloc], pool.clone()); // the same range on another device
        let a = Exported::register(3, vec![alloc], pool.clone());
        let (names, ids) = ([11u64, 12, 13], [5u32, 6, 7]);
        let offered = |ids: &[u32]| ids.iter().map(|&id| (id, 0u64, [0u8; 32])).collect::<Vec<wire::OfferedBlock>>();
        let try_own = |device: i32, claimed: &[(u64, u64)], blocks: &[wire::OfferedBlock], asked: &[u64]| {
            let reg = EXPORTED.lock().unwrap().clone();
            own_source(&reg, device, claimed, blocks, asked)
        };
        // nothing served yet: no block may be taken, even under the right names
        assert_eq!(try_own(3, &[alloc], &offered(&ids), &names).err(), Some(OwnRefusal::NotAsked(0)));
        {
            let _serving = a.serving(&ids, &names);
            let (extents, reading) = try_own(3, &[alloc], &offered(&ids), &names).unwrap();
            assert_eq!(extents, pool, "only the pool's extents are read, not the allocation around it");
            assert_eq!(reading.0.id, a.0.id);
            drop(reading);
            // a leading part, as a source that holds fewer offers it
            assert!(try_own(3, &[alloc], &offered(&ids[..2]), &names).is_ok());
            // a block it serves, under another name than the one asked at its place: another
            // tenant's block for this fetch's slot
            assert_eq!(try_own(3, &[alloc], &offered(&[6, 5]), &names).err(), Some(OwnRefusal::NotAsked(0)));
            // a block it does not serve at all
            assert_eq!(try_own(3, &[alloc], &offered(&[5, 9]), &names).err(), Some(OwnRefusal::NotAsked(1)));
            // more blocks than names asked
            assert_eq!(try_own(3, &[alloc], &offered(&ids), &names[..2]).err(), Some(OwnRefusal::NotAsked(2)));
            // memory past what it exported, or memory of no agent
            assert_eq!(
                try_own(3, &[(alloc.0, alloc.1 + 1)], &offered(&ids), &names).err(),
                Some(OwnRefusal::NotExported)
            );
            assert_eq!(try_own(3, &[(0x10, 0x10)], &offered(&ids), &names).err(), Some(OwnRefusal::NotExported));
            // the same range on a device no agent of it exported from
            assert_eq!(try_own(5, &[alloc], &offered(&ids), &names).err(), Some(OwnRefusal::NotExported));
            // device 4's agent serves nothing: the claim resolves to it and is refused
            assert_eq!(try_own(4, &[alloc], &offered(&ids), &names).err(), Some(OwnRefusal::NotAsked(0)));
        }
        // the serve ended: nothing may be taken any more
        assert_eq!(try_own(3, &[alloc], &offered(&ids), &names).err(), Some(OwnRefusal::NotAsked(0)));
        // an agent's end waits for a copy reading its pool: the copy lets go on another thread
        // once the end has begun (the registry no longer names the agent)
        let reading = {
            let _serving = a.serving(&ids, &names);
            try_own(3, &[alloc], &offered(&ids), &names).unwrap().1
        };
        let id = a.0.id;
        let ended = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let copy = {
            let ended = ended.clone();
            std::thread::spawn(move || {
                // wait (on a condition) until the agent's end took it out of the registry
                while EXPORTED.lock().unwrap().iter().any(|r| r.id == id) {
                    std::thread::yield_now();
                }
                assert!(!ended.load(Ordering::SeqCst), "the agent ended while a copy read its pool");
                drop(reading);
            })
        };
        drop(a);
        ended.store(true, Ordering::SeqCst);
        copy.join().unwrap();
        drop(other);
    }
}
