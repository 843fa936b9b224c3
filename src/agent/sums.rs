//! The checksums the agent keeps: one recorded value per block of the pool ([`SumTable`]), with
//! the block's content digest when the runtime recorded one and, in a keyed agent, its keyed
//! tag ([`crate::block_mac`]); the sums and tags of host-pool blocks are taken where they lie
//! (device pools are summed and tagged by a kernel, through a mover).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

/// Bytes of a block's content digest (`kvrelay_block_digests`, [`crate::names::BLOCK_DIGEST_BYTES`]).
pub(super) const DIGEST: usize = crate::names::BLOCK_DIGEST_BYTES;
/// A block's content digest; all zeros: none recorded (no SHA-256 output is, in practice).
pub(super) type Digest = [u8; DIGEST];

use crate::block_mac::{BlockMac, NhSums};
use crate::copy::KvLayout;

/// The recorded checksum of every block of the pool (and whether one was recorded), its
/// recorded content digest (zeros: none) and its keyed tag (when this agent tags its blocks).
pub(super) struct SumTable {
    sums: Vec<AtomicU64>,
    valid: Vec<AtomicU64>,
    digests: RwLock<Vec<Digest>>,
    /// The block key's state, in an agent that holds a key: it checks the tags of what arrives
    /// where they land. With a key the agent also records a tag for every block it records a
    /// checksum of: `tags` and `tagged` are kept (empty without one).
    mac: Option<Arc<BlockMac>>,
    tags: Vec<AtomicU64>,
    tagged: Vec<AtomicU64>,
}

/// Whether bit `id` of `bits` is set (read with acquire: the value it guards was stored
/// before it).
fn bit(bits: &[AtomicU64], id: u32) -> bool {
    bits[id as usize / 64].load(Ordering::Acquire) & (1 << (id % 64)) != 0
}

impl SumTable {
    /// A table of `blocks` blocks; `mac`: the block key of a keyed agent, which tags its blocks.
    pub(super) fn new(blocks: usize, mac: Option<Arc<BlockMac>>) -> SumTable {
        let records_tags = mac.is_some();
        let words = |n: usize| (0..n).map(|_| AtomicU64::new(0)).collect::<Vec<_>>();
        SumTable {
            sums: words(blocks),
            valid: words(blocks.div_ceil(64)),
            digests: RwLock::new(vec![[0; DIGEST]; blocks]),
            mac,
            tags: words(if records_tags { blocks } else { 0 }),
            tagged: words(if records_tags { blocks.div_ceil(64) } else { 0 }),
        }
    }
    /// Record block `id`'s checksum; the tag it had (if any) is forgotten (a new content is
    /// tagged by [`SumTable::set_tag`] after this).
    pub(super) fn set(&self, id: u32, sum: u64) {
        if self.records_tags() {
            self.tagged[id as usize / 64].fetch_and(!(1 << (id % 64)), Ordering::AcqRel);
        }
        self.sums[id as usize].store(sum, Ordering::Relaxed);
        self.valid[id as usize / 64].fetch_or(1 << (id % 64), Ordering::Release);
    }
    pub(super) fn get(&self, id: u32) -> Option<u64> {
        bit(&self.valid, id).then(|| self.sums[id as usize].load(Ordering::Relaxed))
    }
    /// The block key, in a keyed agent.
    pub(super) fn mac(&self) -> Option<&BlockMac> {
        self.mac.as_deref()
    }
    /// This agent tags its blocks (a keyed agent).
    pub(super) fn records_tags(&self) -> bool {
        self.mac.is_some()
    }
    /// Record block `id`'s tag (after its checksum); nothing where this agent keeps no tags.
    pub(super) fn set_tag(&self, id: u32, tag: u64) {
        if self.records_tags() {
            self.tags[id as usize].store(tag, Ordering::Relaxed);
            self.tagged[id as usize / 64].fetch_or(1 << (id % 64), Ordering::Release);
        }
    }
    /// Block `id`'s recorded tag, if this agent keeps tags and recorded one.
    pub(super) fn tag(&self, id: u32) -> Option<u64> {
        (self.records_tags() && bit(&self.tagged, id)).then(|| self.tags[id as usize].load(Ordering::Relaxed))
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
    each_host(block_bytes, ids, out, |id| block_checksum(layout, id));
}

/// The keyed tags of host-pool blocks `ids` (each below `num_blocks`) into `out`, taken where
/// they lie; batches over 8 MiB on up to 8 threads.
pub(super) fn tag_host(layout: &KvLayout, mac: &BlockMac, block_bytes: usize, ids: &[u32], out: &mut [u64]) {
    each_host(block_bytes, ids, out, |id| block_tag(layout, mac, id));
}

/// `out[i] = f(ids[i])`, batches over 8 MiB on up to 8 threads.
fn each_host(block_bytes: usize, ids: &[u32], out: &mut [u64], f: impl Fn(u32) -> u64 + Sync) {
    let sum_all = |ids: &[u32], out: &mut [u64]| {
        for (&id, o) in ids.iter().zip(out) {
            *o = f(id);
        }
    };
    let total = ids.len() * block_bytes;
    let sum_all = &sum_all;
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

/// The keyed tag of block `id` of `layout`, taken where the bytes lie (each segment's words
/// keyed by their position in the block-major staged block).
fn block_tag(layout: &KvLayout, mac: &BlockMac, id: u32) -> u64 {
    let mut s = NhSums::default();
    for (st, seg) in layout.segments().iter().enumerate() {
        let addr = seg.base + u64::from(id) * seg.block_stride;
        // SAFETY: as in `block_checksum`: one block of one segment of valid host memory, not
        // written while it is tagged.
        let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, seg.bytes_per_block as usize) };
        s = s + mac.terms(bytes, layout.stage_offset(st) / 8);
    }
    mac.finish(s, layout.stage_block_bytes())
}
