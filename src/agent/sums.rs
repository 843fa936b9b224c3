//! The checksums the agent keeps: one recorded value per block of the pool ([`SumTable`]), with
//! the block's content digest when the runtime recorded one, and the sums of host-pool blocks
//! taken where they lie (device pools are summed by a kernel, through a mover).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::RwLock;

/// Bytes of a block's content digest (`kvrelay_block_digests`, [`crate::names::BLOCK_DIGEST_BYTES`]).
pub(super) const DIGEST: usize = crate::names::BLOCK_DIGEST_BYTES;
/// A block's content digest; all zeros: none recorded (no SHA-256 output is, in practice).
pub(super) type Digest = [u8; DIGEST];

use crate::copy::KvLayout;

/// The recorded checksum of every block of the pool (and whether one was recorded), and its
/// recorded content digest (zeros: none).
pub(super) struct SumTable {
    sums: Vec<AtomicU64>,
    valid: Vec<AtomicU64>,
    digests: RwLock<Vec<Digest>>,
}

impl SumTable {
    pub(super) fn new(blocks: usize) -> SumTable {
        SumTable {
            sums: (0..blocks).map(|_| AtomicU64::new(0)).collect(),
            valid: (0..blocks.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
            digests: RwLock::new(vec![[0; DIGEST]; blocks]),
        }
    }
    pub(super) fn set(&self, id: u32, sum: u64) {
        self.sums[id as usize].store(sum, Ordering::Relaxed);
        self.valid[id as usize / 64].fetch_or(1 << (id % 64), Ordering::Release);
    }
    pub(super) fn get(&self, id: u32) -> Option<u64> {
        let v = self.valid[id as usize / 64].load(Ordering::Acquire) & (1 << (id % 64)) != 0;
        v.then(|| self.sums[id as usize].load(Ordering::Relaxed))
    }
    /// Record block `id`'s content digest (zeros: forget it).
    pub(super) fn set_digest(&self, id: u32, d: &Digest) {
        self.digests.write().unwrap_or_else(|e| e.into_inner())[id as usize] = *d;
    }
    /// Record the digests of blocks `ids` (`d[i]` for `ids[i]`) under one lock.
    pub(super) fn set_digests(&self, ids: &[u32], d: &[Digest]) {
        let mut t = self.digests.write().unwrap_or_else(|e| e.into_inner());
        for (&id, d) in ids.iter().zip(d) {
            t[id as usize] = *d;
        }
    }
    /// Block `id`'s recorded content digest (zeros: none).
    pub(super) fn digest(&self, id: u32) -> Digest {
        self.digests.read().unwrap_or_else(|e| e.into_inner())[id as usize]
    }
}

/// The checksums of host-pool blocks `ids` (each below `num_blocks`) into `out`, summed where
/// they lie; batches over 8 MiB on up to 8 threads.
pub(super) fn sum_host(layout: &KvLayout, block_bytes: usize, ids: &[u32], out: &mut [u64]) {
    let sum_all = |ids: &[u32], out: &mut [u64]| {
        for (&id, o) in ids.iter().zip(out) {
            *o = block_checksum(layout, id);
        }
    };
    let total = ids.len() * block_bytes;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(8);
    if total < (8 << 20) || threads == 1 {
        sum_all(ids, out);
    } else {
        let per = ids.len().div_ceil(threads);
        std::thread::scope(|s| {
            for (part, o) in ids.chunks(per).zip(out.chunks_mut(per)) {
                s.spawn(move || sum_all(part, o));
            }
        });
    }
}

/// The checksum of block `id` of `layout`, summed where the bytes lie (each segment's words
/// keyed by their position in the block-major staged block).
fn block_checksum(layout: &KvLayout, id: u32) -> u64 {
    let mut sum = 0u64;
    for (s, seg) in layout.segments().iter().enumerate() {
        let addr = seg.base + u64::from(id) * seg.block_stride;
        // SAFETY: `id` < num_blocks (checked by every caller) so `addr..addr+bytes_per_block`
        // is one block of one segment, valid host memory for reads per `Agent::new`'s contract;
        // the runtime does not write a block while it records its checksum or while it is pinned.
        let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, seg.bytes_per_block as usize) };
        sum = sum.wrapping_add(crate::checksum::kv_checksum_terms(bytes, layout.stage_offset(s) / 8));
    }
    crate::checksum::kv_checksum_finish(sum, layout.stage_block_bytes())
}
