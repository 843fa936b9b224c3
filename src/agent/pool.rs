//! How the agent moves blocks between the runtime's pool and the bytes on the wire: a
//! [`Mover`] per thread at a time, over host memory (the CPU engine) or the memory of one CUDA
//! device (the CUDA engine, two pinned staging slots and a stream of the mover's own).
//!
//! On a device pool every wait is on the mover's own stream or events (never a context- or
//! device-wide synchronize, so the runtime's kernels and other transfers are not waited for),
//! and no lock is held across one. Bytes go to and come from the socket straight out of the
//! pinned slots. Both directions are pipelined over the two slots: a serving connection sends
//! one slot while a helper thread gathers the next chunk into the other; a fetch reads the next
//! block into one slot while a helper thread verifies the last one in the other and scatters it
//! into its destination block.

use std::sync::{Arc, Mutex};

use crate::block_mac::{BlockMac, NhSums};
use crate::copy::{
    CopyError, CpuEngine, CudaDevice, CudaEngine, CudaEvent, CudaStream, EngineOptions, KvLayout, PinnedBuffer,
};

/// A slot's address, handed between the two threads of a pipeline with the slot itself.
#[derive(Clone, Copy)]
pub(super) struct SlotPtr(pub(super) *mut u8);
// SAFETY: a slot is used by one thread at a time: the pipelines pass its index through a
// channel, and only the thread that received it touches the slot until it sends it back.
unsafe impl Send for SlotPtr {}

/// Where the runtime's pool lives.
#[derive(Clone)]
pub(super) enum Memory {
    Host,
    Device(Arc<CudaDevice>),
}

/// Bytes gathered at once when serving (one slot).
pub(super) const SLOT_BYTES: usize = 4 << 20;

enum Kind {
    Host {
        engine: CpuEngine,
        slots: [Vec<u8>; 2],
    },
    Device {
        dev: Arc<CudaDevice>,
        engine: Box<CudaEngine>,
        stream: CudaStream,
        slots: [PinnedBuffer; 2],
        /// Recorded after the scatter out of each slot.
        freed: [CudaEvent; 2],
    },
}

/// Moves blocks for one connection or fetch at a time.
pub(super) struct Mover {
    kind: Kind,
    /// Blocks one slot holds.
    pub(super) slot_blocks: usize,
    block_bytes: usize,
}

impl Drop for Mover {
    /// A device mover waits for its stream before its slots and engine go, so that no copy of
    /// its own still reads a slot or writes a pool block after it is gone (also when a thread
    /// unwinds with it).
    fn drop(&mut self) {
        let _ = self.finish();
    }
}

/// A zeroed host slot whose pages are already mapped: a zeroed allocation this large is mapped
/// lazily, and its first use would otherwise take a page fault per page.
fn touched(n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    for i in (0..n).step_by(4096) {
        // SAFETY: `i < n`, inside the vector; a volatile write so the store is not elided.
        unsafe { std::ptr::write_volatile(v.as_mut_ptr().add(i), 0) };
    }
    v
}

fn cuda(e: CopyError) -> String {
    format!("CUDA: {e}")
}

impl Mover {
    /// A mover over `layout` in `mem`.
    ///
    /// # Safety
    /// As `Agent::new`: the layout's blocks are memory of `mem`, valid for the agent's life.
    /// A device mover's kernels take the tags of block key `mac` (when given) from the loads
    /// that sum the checksums.
    pub(super) unsafe fn new(mem: &Memory, layout: &KvLayout, mac: Option<&BlockMac>) -> Result<Mover, String> {
        let bb = layout.stage_block_bytes() as usize;
        let slot_blocks = (SLOT_BYTES / bb).max(1);
        let kind = match mem {
            Memory::Host => Kind::Host {
                // SAFETY: forwarded contract.
                engine: unsafe { CpuEngine::new(layout.clone()) },
                slots: [touched(slot_blocks * bb), touched(slot_blocks * bb)],
            },
            Memory::Device(dev) => {
                // SAFETY: forwarded contract.
                let mut engine =
                    unsafe { CudaEngine::new(dev, layout.clone(), EngineOptions::default()) }.map_err(cuda)?;
                if let Some(mac) = mac {
                    engine.set_block_key(mac).map_err(cuda)?;
                }
                Kind::Device {
                    dev: dev.clone(),
                    engine: Box::new(engine),
                    stream: CudaStream::new(dev).map_err(cuda)?,
                    slots: [
                        PinnedBuffer::alloc(dev, slot_blocks * bb).map_err(cuda)?,
                        PinnedBuffer::alloc(dev, slot_blocks * bb).map_err(cuda)?,
                    ],
                    freed: [CudaEvent::new(dev).map_err(cuda)?, CudaEvent::new(dev).map_err(cuda)?],
                }
            }
        };
        Ok(Mover { kind, slot_blocks, block_bytes: bb })
    }

    /// Slot `k`'s memory (`slot_blocks` blocks): a raw pointer, so that one thread can fill or
    /// drain one slot while another works on the other. The slots live as long as the mover;
    /// whoever uses the pointer must own the slot at that time (the pipelines hand slots over
    /// through channels).
    pub(super) fn slot_ptr(&mut self, k: usize) -> *mut u8 {
        match &mut self.kind {
            Kind::Host { slots, .. } => slots[k].as_mut_ptr(),
            Kind::Device { slots, .. } => slots[k].as_mut_slice().as_mut_ptr(),
        }
    }

    /// Gather blocks `ids` (at most `slot_blocks`) into slot `k`; on return the bytes are there
    /// (a device pool waits for its own stream only).
    pub(super) fn gather(&mut self, k: usize, ids: &[u32]) -> Result<(), String> {
        let n = ids.len() * self.block_bytes;
        match &mut self.kind {
            Kind::Host { engine, slots } => engine.gather(ids, &mut slots[k][..n]).map_err(|e| e.to_string()),
            Kind::Device { dev, engine, stream, slots, .. } => {
                let _ctx = dev.bind().map_err(cuda)?;
                engine.gather(ids, &slots[k], stream, None).map_err(cuda)?;
                stream.synchronize().map_err(cuda)
            }
        }
    }

    /// The first block of slot `k`.
    pub(super) fn slot(&self, k: usize) -> &[u8] {
        match &self.kind {
            Kind::Host { slots, .. } => &slots[k][..self.block_bytes],
            Kind::Device { slots, .. } => &slots[k].as_slice()[..self.block_bytes],
        }
    }

    /// Write the first block of slot `k` into pool block `id`; on return the slot may be reused
    /// (a device pool waits for that copy's event only).
    pub(super) fn scatter(&mut self, k: usize, id: u32) -> Result<(), String> {
        let bb = self.block_bytes;
        match &mut self.kind {
            Kind::Host { engine, slots } => engine.scatter(&slots[k][..bb], &[id]).map_err(|e| e.to_string()),
            Kind::Device { dev, engine, stream, slots, freed } => {
                let _ctx = dev.bind().map_err(cuda)?;
                // a one-block scatter reads only the slot's first block
                engine.scatter(&slots[k], &[id], stream, Some(&freed[k])).map_err(cuda)?;
                freed[k].synchronize().map_err(cuda)
            }
        }
    }

    /// Wait until every scatter of this mover finished (on a device: its own stream only).
    pub(super) fn finish(&mut self) -> Result<(), String> {
        if let Kind::Device { dev, stream, .. } = &mut self.kind {
            let _ctx = dev.bind().map_err(cuda)?;
            stream.synchronize().map_err(cuda)?;
        }
        Ok(())
    }

    /// Device pools: enqueue the device-to-device copies `runs` (`(dst, src, bytes)`, source
    /// addresses possibly another process's memory mapped here) on this mover's stream, then
    /// sum blocks `ids` where they landed into `out` (the same stream: after the copies), and
    /// their tags' NH sums into `tags` when given.
    /// Returns once the stream passed both, also on an error (nothing of it is in flight).
    ///
    /// # Safety
    /// Every run's destination lies in blocks this fetch owns and its source in memory that
    /// stays mapped and unwritten until this returns.
    pub(super) unsafe fn copy_in_and_sum(
        &mut self,
        runs: &[(u64, u64, u64)],
        ids: &[u32],
        out: &mut [u64],
        tags: Option<&mut [NhSums]>,
    ) -> Result<(), String> {
        match &mut self.kind {
            Kind::Host { .. } => Err("device-to-device copies need a device pool".into()),
            Kind::Device { dev, engine, stream, .. } => {
                let _ctx = dev.bind().map_err(cuda)?;
                let mut r = Ok(());
                for &(dst, src, len) in runs {
                    // SAFETY: forwarded contract.
                    r = unsafe { stream.copy_device(dst, src, len as usize) }.map_err(cuda);
                    if r.is_err() {
                        break;
                    }
                }
                let r = r.and_then(|()| engine.checksums_tagged(ids, out, tags, stream).map_err(cuda));
                // whatever failed, nothing of this call stays in flight
                stream.synchronize().map_err(cuda)?;
                r
            }
        }
    }

    /// Device pools: copy blocks `src_ids` of another pool (its segments at `src_segs`, base
    /// and stride mapped here) into blocks `ids` and sum them on the way (with `tags`, their
    /// tags' NH sums too), in one kernel on this mover's stream
    /// ([`crate::copy::CudaEngine::copy_and_sum_from_tagged`]). Returns once the stream passed
    /// it, also on an error.
    ///
    /// # Safety
    /// As [`crate::copy::CudaEngine::copy_and_sum_from`]: every source range readable and
    /// unwritten until this returns, the destination blocks this fetch's own.
    pub(super) unsafe fn copy_sum_from(
        &mut self,
        src_segs: &[(u64, u64)],
        src_ids: &[u32],
        ids: &[u32],
        out: &mut [u64],
        tags: Option<&mut [NhSums]>,
    ) -> Result<(), String> {
        match &mut self.kind {
            Kind::Host { .. } => Err("device-to-device copies need a device pool".into()),
            Kind::Device { dev, engine, stream, .. } => {
                let _ctx = dev.bind().map_err(cuda)?;
                // SAFETY: forwarded contract.
                unsafe { engine.copy_and_sum_from_tagged(src_segs, src_ids, ids, out, tags, stream) }.map_err(cuda)
            }
        }
    }

    /// Checksums of blocks `ids` summed where they lie, and their tags' NH sums into `tags`
    /// when given (device pools: a kernel; host pools are summed by the agent without a mover).
    pub(super) fn device_checksums(
        &mut self,
        ids: &[u32],
        out: &mut [u64],
        tags: Option<&mut [NhSums]>,
    ) -> Result<(), String> {
        match &mut self.kind {
            Kind::Host { .. } => Err("host pools are summed in place without a mover".into()),
            Kind::Device { dev, engine, stream, .. } => {
                let _ctx = dev.bind().map_err(cuda)?;
                engine.checksums_tagged(ids, out, tags, stream).map_err(cuda)
            }
        }
    }
}

/// Idle movers, so that a connection or a fetch does not compile a kernel or allocate pinned
/// memory each time.
pub(super) struct Movers {
    mem: Memory,
    /// The block key of a keyed agent, which device movers' kernels tag with.
    mac: Option<Arc<BlockMac>>,
    idle: Mutex<Vec<Mover>>,
}

impl Movers {
    pub(super) fn new(mem: Memory, mac: Option<Arc<BlockMac>>) -> Movers {
        Movers { mem, mac, idle: Mutex::new(Vec::new()) }
    }

    pub(super) fn memory(&self) -> &Memory {
        &self.mem
    }

    /// An idle mover, or a new one.
    ///
    /// # Safety
    /// As [`Mover::new`].
    pub(super) unsafe fn take(&self, layout: &KvLayout) -> Result<Mover, String> {
        if let Some(m) = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop() {
            return Ok(m);
        }
        // SAFETY: forwarded contract.
        unsafe { Mover::new(&self.mem, layout, self.mac.as_deref()) }
    }

    /// Make movers until `n` are idle (at least), so that the first transfers do not make them.
    ///
    /// # Safety
    /// As [`Mover::new`].
    pub(super) unsafe fn warm(&self, n: usize, layout: &KvLayout) -> Result<(), String> {
        let have = self.idle.lock().unwrap_or_else(|e| e.into_inner()).len();
        for _ in have..n {
            // SAFETY: forwarded contract.
            let m = unsafe { Mover::new(&self.mem, layout, self.mac.as_deref()) }?;
            self.put(m);
        }
        Ok(())
    }

    /// Give a mover back (only one whose copies all finished).
    pub(super) fn put(&self, m: Mover) {
        self.idle.lock().unwrap_or_else(|e| e.into_inner()).push(m);
    }
}
