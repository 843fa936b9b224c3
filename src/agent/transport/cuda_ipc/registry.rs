//! This process's CUDA IPC agents, registered while they live ([`EXPORTED`]): what an offer
//! that claims to come from this process may name (an export area the agent serves from now,
//! and the blocks it serves there under the names asked) and read (that area only), and the
//! holds that keep an area's memory, and the agent, alive while a copy of this process reads it.

use std::any::Any;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use crate::agent::wire;

/// What keeps an export area's memory alive while a copy of this process reads it.
pub(super) type Keep = Arc<dyn Any + Send + Sync>;

/// One CUDA IPC agent of this process, in [`EXPORTED`] while it lives: what an offer that
/// claims to come from this process may name. The pid and host in an offer are what any process
/// of the host can read and claim, and such an offer's addresses are used as this process's
/// own, so it must name an agent of this process on the offer's device, only memory of one of
/// that agent's live export areas, and only blocks that agent is serving there now under the
/// very names the fetch asked for: no address a neighbour chooses, and no block of another
/// tenant of this process.
pub(super) struct Registration {
    /// The agent's number (one per start).
    pub(super) id: u64,
    /// Its pool's device.
    device: i32,
    /// Its live export areas: `(base, bytes)` and what keeps the memory alive.
    areas: Mutex<Vec<(u64, u64, Keep)>>,
    /// The blocks it serves now: `(area base, slot, name, serves)`, added before its offer goes
    /// out and taken out when the serve ends (the reader's `DONE` or the deadline).
    serving: Mutex<Vec<(u64, u32, u64, u32)>>,
    /// Copies of this process reading its areas now: its agent's end waits for none.
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

/// An agent's [`Registration`] in [`EXPORTED`]: taken out when dropped, which then waits until
/// no copy of this process reads its areas.
pub(super) struct Exported(pub(super) Arc<Registration>);

impl Exported {
    pub(super) fn register(device: i32) -> Exported {
        let r = Arc::new(Registration {
            id: EXPORTS_NEXT.fetch_add(1, Ordering::Relaxed),
            device,
            areas: Mutex::new(Vec::new()),
            serving: Mutex::new(Vec::new()),
            readers: Mutex::new(0),
            no_readers: std::sync::Condvar::new(),
        });
        EXPORTED.lock().unwrap_or_else(|p| p.into_inner()).push(r.clone());
        Exported(r)
    }

    /// Record a new export area (`(base, bytes)`; `keep` holds its memory).
    pub(super) fn add_area(&self, base: u64, bytes: u64, keep: Keep) {
        self.0.areas.lock().unwrap_or_else(|p| p.into_inner()).push((base, bytes, keep));
    }

    /// Forget the export area at `base` (a copy reading it keeps its memory until it ends).
    pub(super) fn remove_area(&self, base: u64) {
        self.0.areas.lock().unwrap_or_else(|p| p.into_inner()).retain(|a| a.0 != base);
    }

    /// Record that slots `0..names.len()` of the area at `area` hold blocks `names`, until the
    /// guard goes.
    pub(super) fn serving<'a>(&'a self, area: u64, names: &'a [u64]) -> Serving<'a> {
        let mut s = self.0.serving.lock().unwrap_or_else(|p| p.into_inner());
        for (slot, &name) in names.iter().enumerate() {
            let slot = slot as u32;
            match s.iter_mut().find(|e| e.0 == area && e.1 == slot && e.2 == name) {
                Some(e) => e.3 += 1,
                None => s.push((area, slot, name, 1)),
            }
        }
        Serving { r: &self.0, area, names }
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
    area: u64,
    names: &'a [u64],
}

impl Drop for Serving<'_> {
    fn drop(&mut self) {
        let mut s = self.r.serving.lock().unwrap_or_else(|p| p.into_inner());
        for (slot, &name) in self.names.iter().enumerate() {
            let slot = slot as u32;
            if let Some(i) = s.iter().position(|e| e.0 == self.area && e.1 == slot && e.2 == name) {
                s[i].3 -= 1;
                if s[i].3 == 0 {
                    s.swap_remove(i);
                }
            }
        }
    }
}

/// A copy of this process reading a registered agent's export area: that agent's end waits
/// until it goes, and the area's memory lives until then.
pub(super) struct Reading(pub(super) Arc<Registration>, #[allow(dead_code)] Keep);

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
    /// No agent of this process on the offer's device serves from an area holding the ranges
    /// it names.
    NotExported,
    /// Offered block `i` is not a block that agent serves now, in that area, under the name
    /// asked at `i`.
    NotAsked(usize),
}

/// The registered agent an offer in this process's name comes from, with the extent of the
/// export area it names (what the copy plans may read; mapped at its own addresses) and a hold
/// on it for the copy: only an agent on `device` with a live area holding every range
/// `claimed` names, and only when every offered block `blocks[i]` is one it serves there now
/// under the name `asked[i]`.
pub(super) fn own_source(
    registry: &[Arc<Registration>],
    device: i32,
    claimed: &[(u64, u64)],
    blocks: &[wire::OfferedBlock],
    asked: &[u64],
) -> Result<(Vec<(u64, u64)>, Reading), OwnRefusal> {
    let (r, (base, bytes, keep)) = registry
        .iter()
        .filter(|r| r.device == device)
        .find_map(|r| {
            let areas = r.areas.lock().unwrap_or_else(|p| p.into_inner());
            let a = areas.iter().find(|a| !claimed.is_empty() && inside_exports(claimed, &[(a.0, a.1)]))?;
            Some((r, (a.0, a.1, a.2.clone())))
        })
        .ok_or(OwnRefusal::NotExported)?;
    {
        let serving = r.serving.lock().unwrap_or_else(|p| p.into_inner());
        for (i, b) in blocks.iter().enumerate() {
            let name = asked.get(i).ok_or(OwnRefusal::NotAsked(i))?;
            if !serving.iter().any(|e| e.0 == base && e.1 == b.0 && e.2 == *name) {
                return Err(OwnRefusal::NotAsked(i));
            }
        }
    }
    *r.readers.lock().unwrap_or_else(|p| p.into_inner()) += 1;
    Ok((vec![(base, bytes)], Reading(r.clone(), keep)))
}

#[cfg(test)]
mod tests {
    use super::*;

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
    /// offer's device with a live export area holding what it claims, only for blocks that
    /// agent serves there now under the names asked, and it reads only that area; anything
    /// else is refused before any copy. The agent's end waits for the copies reading its areas,
    /// and a copy keeps the area's memory alive.
    #[test]
    fn an_offer_in_this_process_s_name_gets_only_the_asked_blocks_of_that_agent_s_area() {
        // two areas of 64 KiB on device 3, and the same range on device 4
        let (area, next) = ((0xbeef_0000_0000u64, 0x1_0000u64), (0xbeef_0001_0000u64, 0x1_0000u64));
        let mem: Keep = Arc::new(7u32);
        let other = Exported::register(4);
        other.add_area(area.0, area.1, mem.clone());
        let a = Exported::register(3);
        a.add_area(area.0, area.1, mem.clone());
        a.add_area(next.0, next.1, Arc::new(8u32));
        let names = [11u64, 12, 13];
        let offered = |ids: &[u32]| ids.iter().map(|&id| (id, 0u64, [0u8; 32])).collect::<Vec<wire::OfferedBlock>>();
        let try_own = |device: i32, claimed: &[(u64, u64)], blocks: &[wire::OfferedBlock], asked: &[u64]| {
            let reg = EXPORTED.lock().unwrap().clone();
            own_source(&reg, device, claimed, blocks, asked)
        };
        let slots = [0u32, 1, 2];
        // nothing served yet: no block may be taken, even under the right names
        assert_eq!(try_own(3, &[area], &offered(&slots), &names).err(), Some(OwnRefusal::NotAsked(0)));
        {
            let _serving = a.serving(area.0, &names);
            let (extents, reading) = try_own(3, &[area], &offered(&slots), &names).unwrap();
            assert_eq!(extents, vec![area], "only the area is read");
            assert_eq!(reading.0.id, a.0.id);
            assert_eq!(Arc::strong_count(&mem), 4, "the reading holds the area's memory");
            drop(reading);
            // a leading part, as a source that holds fewer offers it
            assert!(try_own(3, &[area], &offered(&slots[..2]), &names).is_ok());
            // slots in another order: another block for this fetch's slot
            assert_eq!(try_own(3, &[area], &offered(&[1, 0]), &names).err(), Some(OwnRefusal::NotAsked(0)));
            // a slot it does not serve at all
            assert_eq!(try_own(3, &[area], &offered(&[0, 9]), &names).err(), Some(OwnRefusal::NotAsked(1)));
            // more blocks than names asked
            assert_eq!(try_own(3, &[area], &offered(&slots), &names[..2]).err(), Some(OwnRefusal::NotAsked(2)));
            // the same slots in the agent's other area, which serves nothing now
            assert_eq!(try_own(3, &[next], &offered(&slots), &names).err(), Some(OwnRefusal::NotAsked(0)));
            // memory past the area, spanning both, no area at all, no claim
            assert_eq!(
                try_own(3, &[(area.0, area.1 + 1)], &offered(&slots), &names).err(),
                Some(OwnRefusal::NotExported)
            );
            assert_eq!(try_own(3, &[(0x10, 0x10)], &offered(&slots), &names).err(), Some(OwnRefusal::NotExported));
            assert_eq!(try_own(3, &[], &offered(&slots), &names).err(), Some(OwnRefusal::NotExported));
            // the same range on a device no agent of it exported from
            assert_eq!(try_own(5, &[area], &offered(&slots), &names).err(), Some(OwnRefusal::NotExported));
            // device 4's agent serves nothing: the claim resolves to it and is refused
            assert_eq!(try_own(4, &[area], &offered(&slots), &names).err(), Some(OwnRefusal::NotAsked(0)));
        }
        // the serve ended: nothing may be taken any more
        assert_eq!(try_own(3, &[area], &offered(&slots), &names).err(), Some(OwnRefusal::NotAsked(0)));
        // an area that went is named by no offer
        a.remove_area(next.0);
        {
            let _serving = a.serving(next.0, &names);
            assert_eq!(try_own(3, &[next], &offered(&slots), &names).err(), Some(OwnRefusal::NotExported));
        }
        // an agent's end waits for a copy reading its area: the copy lets go on another thread
        // once the end has begun (the registry no longer names the agent)
        let reading = {
            let _serving = a.serving(area.0, &names);
            try_own(3, &[area], &offered(&slots), &names).unwrap().1
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
                assert!(!ended.load(Ordering::SeqCst), "the agent ended while a copy read its area");
                drop(reading);
            })
        };
        drop(a);
        ended.store(true, Ordering::SeqCst);
        copy.join().unwrap();
        drop(other);
    }
}
