//! Export areas: what a CUDA IPC grant maps. A source never hands out its pool: for each
//! transfer it copies the asked blocks into an area of its own device memory (one device copy
//! per segment and run of blocks, on the area's stream) and offers that area, so that a peer
//! mapping its grant reaches the blocks it asked for and nothing else, and nothing it writes
//! there can reach the pool, the source's slots or another peer.
//!
//! - **One area per serving connection.** Made at the connection's first CUDA IPC transfer,
//!   kept for its next ones (the destination keeps the mapping too: one descriptor exchange per
//!   connection, not per fetch), replaced by a larger one when a transfer needs more blocks
//!   (sizes go by powers of two of blocks, at least [`MIN_BLOCKS`], at most the pool's), and
//!   given up when the connection ends. Such a connection waits 60 s for its next hello (the
//!   agent's idle timeout when longer), and its fetcher reuses it within 30 s, so a peer that
//!   fetches every few seconds keeps one area and one mapping. A later transfer on the connection overwrites the slots
//!   of the earlier one; the peer could read those blocks already.
//! - **Memory of its own.** Each area is one allocation of the virtual memory API
//!   (`cuMemCreate`, POSIX descriptor handle type), zeroed when made wherever its first
//!   transfer does not write (the driver may hand back memory this process freed, an earlier
//!   area of another peer among it), exported by
//!   descriptor to the first process that proves its token ([`super::vmm_fds::FdServer::add`]:
//!   bound to that process's pid; another process presenting the token gets nothing). The
//!   physical memory goes back to the driver once the source and that peer both let go: it is
//!   never handed to another peer while one still maps it.
//! - **Bounded.** All areas of an agent together hold at most [`Areas::budget`] bytes (the
//!   pool's size, at least 64 MiB); a transfer that finds no room is refused `busy` (the destination
//!   may fetch again, or over TCP). The cost: the area's copy (device to device, at the copy
//!   engines' speed) before the offer goes out, and once per connection the allocation and the
//!   destination's mapping.

use std::sync::{Arc, Mutex};

use super::offer::{encode_exports, Exports, VmmOffer};
use super::registry::Exported;
use crate::agent::transport::vmm_fds;
use crate::copy::{CopyError, CudaDevice, DeviceCopier, KvLayout, VmmBuffer};

/// Fewest blocks an area holds.
pub(super) const MIN_BLOCKS: u32 = 8;
/// Least bytes all areas of an agent may hold together (the budget of a small pool).
const MIN_BUDGET: u64 = 64 << 20;

/// A segment as an offer states it: `(base, stride, bytes per block)`.
pub(super) type Seg = (u64, u64, u64);

/// The segments of an area of `cap` blocks for a pool whose segments hold `bpb[s]` bytes of a
/// block, from `base`: segment after segment, a segment's blocks `bpb[s]` rounded up to 16
/// bytes apart (what the destination's copy kernel reads); as `(base, stride, bytes per
/// block)`, with the area's bytes. `None` when the sizes overflow.
pub(super) fn area_segments(bpb: &[u64], cap: u32, base: u64) -> Option<(Vec<Seg>, u64)> {
    let mut at = 0u64;
    let mut segs = Vec::with_capacity(bpb.len());
    for &b in bpb {
        let stride = b.checked_next_multiple_of(16)?;
        segs.push((base.checked_add(at)?, stride, b));
        at = at.checked_add(stride.checked_mul(u64::from(cap))?)?;
    }
    Some((segs, at))
}

/// The runs of `ids` that are consecutive both in the pool and in the area's slots (slot `i`
/// holds `ids[i]`): `(first slot, first id, blocks)`.
pub(super) fn runs(ids: &[u32]) -> Vec<(u32, u32, u32)> {
    let mut out: Vec<(u32, u32, u32)> = Vec::new();
    for (slot, &id) in ids.iter().enumerate() {
        match out.last_mut() {
            Some((s, i, n)) if i.checked_add(*n) == Some(id) && *s + *n == slot as u32 => *n += 1,
            _ => out.push((slot as u32, id, 1)),
        }
    }
    out
}

/// The blocks an area for a transfer of `n` blocks holds: the next power of two, at least
/// [`MIN_BLOCKS`], at most the pool's `num_blocks` (and never fewer than `n`).
pub(super) fn area_blocks(n: usize, num_blocks: u32) -> u32 {
    let n = u32::try_from(n).unwrap_or(u32::MAX);
    n.checked_next_power_of_two().unwrap_or(u32::MAX).max(MIN_BLOCKS).min(num_blocks).max(n)
}

/// An agent's export areas: the pool they copy from, their budget, and the socket their
/// descriptors go out on.
pub(super) struct Areas {
    dev: Arc<CudaDevice>,
    /// The pool's segments.
    pool: Vec<Seg>,
    /// Their bytes per block (what an area's segments hold).
    bpb: Vec<u64>,
    num_blocks: u32,
    budget: u64,
    /// Bytes the live areas hold.
    live: Mutex<u64>,
    fds: vmm_fds::FdServer,
    /// What every area's offer says of the source besides the area.
    host: [u8; 16],
    pid: u32,
    /// This agent in the process's registry: its live areas, for offers within this process.
    pub(super) exported: Exported,
}

impl Areas {
    /// The areas of an agent whose pool is `layout` on `dev` (nothing allocated yet; the
    /// descriptor socket listens from here on).
    pub(super) fn new(dev: Arc<CudaDevice>, device: i32, layout: &KvLayout, host: [u8; 16]) -> Result<Areas, String> {
        let pool: Vec<Seg> = layout.segments().iter().map(|g| (g.base, g.block_stride, g.bytes_per_block)).collect();
        let bpb: Vec<u64> = pool.iter().map(|s| s.2).collect();
        let pool_bytes = area_segments(&bpb, layout.num_blocks(), 0).ok_or("CUDA IPC: the pool's size overflows")?.1;
        let fds = vmm_fds::FdServer::start()?;
        Ok(Areas {
            dev,
            pool,
            bpb,
            num_blocks: layout.num_blocks(),
            budget: pool_bytes.max(MIN_BUDGET),
            live: Mutex::new(0),
            fds,
            host,
            pid: std::process::id(),
            exported: Exported::register(device),
        })
    }

    /// Bytes all live areas may hold together.
    #[cfg(test)]
    pub(super) fn budget(&self) -> u64 {
        self.budget
    }

    /// The connection's area, made (or replaced by a larger one) when it holds fewer than `n`
    /// blocks; `Err` with the reason when the budget has no room for it.
    pub(super) fn lease<'a>(self: &Arc<Self>, held: &'a mut Option<Area>, n: usize) -> Result<&'a mut Area, String> {
        if held.as_ref().is_some_and(|a| (a.cap as usize) < n) {
            *held = None; // given up first: its bytes count toward the new one's room
        }
        if held.is_none() {
            *held = Some(self.make(n)?); // zeroed past its first `n` slots, which `fill` writes
        }
        Ok(held.as_mut().expect("made above"))
    }

    /// A new area for `n` blocks (see the module docs).
    fn make(self: &Arc<Self>, n: usize) -> Result<Area, String> {
        let want = area_blocks(n, self.num_blocks);
        // the power of two when the budget has room for it, else exactly the transfer
        let size = |cap: u32| area_segments(&self.bpb, cap, 0).map(|(_, b)| b);
        let (cap, bytes) = {
            let mut live = self.live.lock().unwrap_or_else(|p| p.into_inner());
            let fits = |b: u64| live.checked_add(b).is_some_and(|t| t <= self.budget);
            let pick = [want, u32::try_from(n).unwrap_or(u32::MAX)]
                .into_iter()
                .filter_map(|c| size(c).map(|b| (c, b)))
                .find(|&(_, b)| fits(b));
            let Some((cap, bytes)) = pick else {
                return Err(format!(
                    "no room for an export area of {n} blocks: the agent's areas hold {} of their {} bytes",
                    *live, self.budget
                ));
            };
            *live += bytes;
            (cap, bytes)
        };
        let made = self.allocate(cap, bytes, n);
        if made.is_err() {
            *self.live.lock().unwrap_or_else(|p| p.into_inner()) -= bytes;
        }
        made
    }

    /// A new area of `cap` blocks (`bytes`), its slots from `first` on zeroed (enqueued on its
    /// stream: the first [`Area::fill`], which writes slots `0..first`, waits for it).
    fn allocate(self: &Arc<Self>, cap: u32, bytes: u64, first: usize) -> Result<Area, String> {
        let err = |what: &str, e: CopyError| format!("CUDA IPC: {what} an export area of {bytes} bytes: {e}");
        let len = usize::try_from(bytes).map_err(|_| "CUDA IPC: an export area past the address space".to_string())?;
        let mem = Arc::new(VmmBuffer::alloc(&self.dev, len, 1, true).map_err(|e| err("allocating", e))?);
        let mut copier = DeviceCopier::new(&self.dev).map_err(|e| err("a stream for", e))?;
        let (segs, _) = area_segments(&self.bpb, cap, mem.ptr()).expect("sized above");
        // memory the driver hands back may hold what this process freed (an earlier area's
        // blocks, another peer's): every byte the first fill does not write is zeroed, the
        // driver's rounding past the last segment included
        let first = first.min(cap as usize) as u64;
        let tails = segs
            .iter()
            .map(|&(base, stride, _)| (base + first * stride, (u64::from(cap) - first) * stride))
            .chain([(mem.ptr() + bytes, (mem.len() - len) as u64)]);
        for (at, n) in tails {
            // SAFETY: inside the allocation made above (each segment's slots `first..cap`, then
            // from the end of the last segment to the end of the allocation), which this area
            // holds until its copier's stream finished (`fill` waits, `Drop` comes after).
            unsafe { copier.zero_trusted(at, n as usize) }.map_err(|e| err("zeroing", e))?;
        }
        let chunks = self.dev.vmm_export(mem.ptr(), mem.ptr() + mem.len() as u64).map_err(|e| err("exporting", e))?;
        let sizes: Vec<u64> = chunks.iter().map(|c| c.size).collect();
        let token = self.fds.add(chunks.into_iter().map(|c| c.fd).collect())?;
        let metadata = encode_exports(&Exports {
            host: self.host,
            pid: self.pid,
            allocs: Vec::new(),
            vmm: Some(VmmOffer { socket: self.fds.name().to_vec(), token, ranges: vec![(mem.ptr(), sizes)] }),
        });
        self.exported.add_area(mem.ptr(), mem.len() as u64, mem.clone());
        Ok(Area { areas: self.clone(), mem, bytes, cap, token, segs, copier, metadata })
    }
}

/// One serving connection's export area (see the module docs); given up when dropped.
pub(in crate::agent) struct Area {
    areas: Arc<Areas>,
    mem: Arc<VmmBuffer>,
    /// Bytes counted against the budget.
    bytes: u64,
    /// Blocks it holds.
    pub(super) cap: u32,
    token: [u8; vmm_fds::TOKEN],
    /// Its segments, as an offer states them.
    pub(super) segs: Vec<Seg>,
    copier: DeviceCopier,
    /// Its offers' metadata (the source, the area's range, socket and token), encoded once.
    pub(super) metadata: Vec<u8>,
}

impl Area {
    /// Where it starts.
    pub(super) fn base(&self) -> u64 {
        self.mem.ptr()
    }

    /// Its first `dst.len()` bytes (synchronous).
    #[cfg(test)]
    pub(super) fn mem_read(&self, dst: &mut [u8]) {
        self.mem.read(0, dst).expect("reading the area");
    }

    /// Copy pool blocks `ids` into slots `0..ids.len()` (at most [`Area::cap`]), and wait for
    /// the copies.
    pub(super) fn fill(&mut self, ids: &[u32]) -> Result<(), CopyError> {
        if ids.len() > self.cap as usize || ids.iter().any(|&id| id >= self.areas.num_blocks) {
            return Err(CopyError::OutOfBounds);
        }
        for (slot, id, n) in runs(ids) {
            for (&(dst_base, dst_stride, len), &(src_base, src_stride, _)) in self.segs.iter().zip(&self.areas.pool) {
                let dst = dst_base + u64::from(slot) * dst_stride;
                let src = src_base + u64::from(id) * src_stride;
                let (w, h, dp, sp) = if dst_stride == len && src_stride == len {
                    (len * u64::from(n), 1, 0, 0) // contiguous at both ends: one plain copy
                } else {
                    (len, u64::from(n), dst_stride, src_stride)
                };
                // SAFETY: the destination is slots `slot..slot + n` of this area (at most `cap`
                // slots from its base: checked above), inside the allocation made for it; the
                // source is blocks `id..id + n` of the pool (ids below `num_blocks`: checked),
                // memory the agent was given as device memory of this device, valid for its life
                // (`Agent::new`'s contract) and pinned by the serve; `finish` below waits for
                // the copies before either can go.
                unsafe { self.copier.copy_2d_trusted(dst, dp as usize, src, sp as usize, w as usize, h as usize) }?;
            }
        }
        self.copier.finish().map(|_| ())
    }
}

impl Drop for Area {
    fn drop(&mut self) {
        // nothing of its copier's may still write into it when it is unmapped
        let _ = self.copier.finish();
        self.areas.fds.remove(&self.token);
        self.areas.exported.remove_area(self.mem.ptr());
        *self.areas.live.lock().unwrap_or_else(|p| p.into_inner()) -= self.bytes;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_area_lays_segments_after_one_another_16_byte_aligned() {
        let (segs, bytes) = area_segments(&[512, 100, 16], 4, 1 << 40).unwrap();
        assert_eq!(segs, vec![(1 << 40, 512, 512), ((1 << 40) + 2048, 112, 100), ((1 << 40) + 2048 + 448, 16, 16)]);
        assert_eq!(bytes, 2048 + 448 + 64);
        assert!(segs.iter().all(|s| s.0 % 16 == 0 && s.1 % 16 == 0));
        assert_eq!(area_segments(&[u64::MAX - 3], 1, 0), None, "a size that overflows");
        assert_eq!(area_segments(&[1 << 40], u32::MAX, 0), None);
    }

    #[test]
    fn runs_merge_what_is_consecutive_at_both_ends() {
        assert_eq!(runs(&[5, 6, 7, 9, 10, 2]), vec![(0, 5, 3), (3, 9, 2), (5, 2, 1)]);
        assert_eq!(runs(&[]), vec![]);
        assert_eq!(runs(&[u32::MAX, 0]), vec![(0, u32::MAX, 1), (1, 0, 1)], "no wrap");
        assert_eq!(runs(&[3, 3]), vec![(0, 3, 1), (1, 3, 1)]);
    }

    #[test]
    fn areas_grow_by_powers_of_two_within_the_pool() {
        assert_eq!(area_blocks(1, 1000), MIN_BLOCKS);
        assert_eq!(area_blocks(9, 1000), 16);
        assert_eq!(area_blocks(64, 1000), 64);
        assert_eq!(area_blocks(600, 1000), 1000, "never past the pool");
        assert_eq!(area_blocks(3, 4), 4);
        assert_eq!(area_blocks(5, 4), 5, "never fewer than asked (the pool's pins bound it)");
    }
}
