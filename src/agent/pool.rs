//! How the agent moves blocks between the runtime's pool and the bytes on the wire: a
//! [`Mover`] per thread at a time, over host memory (the CPU engine) or the memory of one CUDA
//! device (the CUDA engine, two pinned staging slots and a stream of the mover's own).
//!
//! On a device pool every wait is on the mover's own stream or events (never a context- or
//! device-wide synchronize, so the runtime's kernels and other transfers are not waited for),
//! and no lock is held across one. Bytes go to and come from the socket straight out of the
//! pinned slots. A received block is verified in its slot, then scattered into its destination
//! block while the next block is read into the other slot.

use std::sync::{Arc, Mutex};

use crate::copy::{
    CopyError, CpuEngine, CudaDevice, CudaEngine, CudaEvent, CudaStream, EngineOptions, KvLayout, PinnedBuffer,
};

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
        /// Recorded after the last scatter out of each slot.
        freed: [CudaEvent; 2],
        pending: [bool; 2],
    },
}

/// Moves blocks for one connection or fetch at a time.
pub(super) struct Mover {
    kind: Kind,
    /// Blocks one slot holds.
    pub(super) slot_blocks: usize,
    block_bytes: usize,
}

fn cuda(e: CopyError) -> String {
    format!("CUDA: {e}")
}

impl Mover {
    /// A mover over `layout` in `mem`.
    ///
    /// # Safety
    /// As `Agent::new`: the layout's blocks are memory of `mem`, valid for the agent's life.
    pub(super) unsafe fn new(mem: &Memory, layout: &KvLayout) -> Result<Mover, String> {
        let bb = layout.stage_block_bytes() as usize;
        let slot_blocks = (SLOT_BYTES / bb).max(1);
        let kind = match mem {
            Memory::Host => Kind::Host {
                // SAFETY: forwarded contract.
                engine: unsafe { CpuEngine::new(layout.clone()) },
                slots: [vec![0u8; slot_blocks * bb], vec![0u8; slot_blocks * bb]],
            },
            Memory::Device(dev) => {
                // SAFETY: forwarded contract.
                let engine = unsafe { CudaEngine::new(dev, layout.clone(), EngineOptions::default()) }.map_err(cuda)?;
                Kind::Device {
                    dev: dev.clone(),
                    engine: Box::new(engine),
                    stream: CudaStream::new(dev).map_err(cuda)?,
                    slots: [
                        PinnedBuffer::alloc(dev, slot_blocks * bb).map_err(cuda)?,
                        PinnedBuffer::alloc(dev, slot_blocks * bb).map_err(cuda)?,
                    ],
                    freed: [CudaEvent::new(dev).map_err(cuda)?, CudaEvent::new(dev).map_err(cuda)?],
                    pending: [false; 2],
                }
            }
        };
        Ok(Mover { kind, slot_blocks, block_bytes: bb })
    }

    /// Gather blocks `ids` (at most `slot_blocks`) into slot `k` and return their bytes.
    pub(super) fn gather(&mut self, k: usize, ids: &[u32]) -> Result<&[u8], String> {
        let n = ids.len() * self.block_bytes;
        match &mut self.kind {
            Kind::Host { engine, slots } => {
                engine.gather(ids, &mut slots[k][..n]).map_err(|e| e.to_string())?;
                Ok(&slots[k][..n])
            }
            Kind::Device { dev, engine, stream, slots, freed, pending } => {
                let _ctx = dev.bind().map_err(cuda)?;
                if pending[k] {
                    freed[k].synchronize().map_err(cuda)?;
                    pending[k] = false;
                }
                engine.gather(ids, &slots[k], stream, None).map_err(cuda)?;
                stream.synchronize().map_err(cuda)?;
                Ok(&slots[k].as_slice()[..n])
            }
        }
    }

    /// Slot `k`'s first block, to receive into; waits until the slot's last scatter finished.
    pub(super) fn recv_slot(&mut self, k: usize) -> Result<&mut [u8], String> {
        let bb = self.block_bytes;
        match &mut self.kind {
            Kind::Host { slots, .. } => Ok(&mut slots[k][..bb]),
            Kind::Device { dev, slots, freed, pending, .. } => {
                if pending[k] {
                    let _ctx = dev.bind().map_err(cuda)?;
                    freed[k].synchronize().map_err(cuda)?;
                    pending[k] = false;
                }
                Ok(&mut slots[k].as_mut_slice()[..bb])
            }
        }
    }

    /// The block received in slot `k`.
    pub(super) fn slot(&self, k: usize) -> &[u8] {
        match &self.kind {
            Kind::Host { slots, .. } => &slots[k][..self.block_bytes],
            Kind::Device { slots, .. } => &slots[k].as_slice()[..self.block_bytes],
        }
    }

    /// Write the block in slot `k` into pool block `id` (on a device: enqueued; [`Mover::finish`]
    /// or the slot's next use waits for it).
    pub(super) fn scatter(&mut self, k: usize, id: u32) -> Result<(), String> {
        let bb = self.block_bytes;
        match &mut self.kind {
            Kind::Host { engine, slots } => engine.scatter(&slots[k][..bb], &[id]).map_err(|e| e.to_string()),
            Kind::Device { dev, engine, stream, slots, freed, pending } => {
                let _ctx = dev.bind().map_err(cuda)?;
                // the engine copies `staging[..bb]`: a one-block scatter reads only its first block
                engine.scatter(&slots[k], &[id], stream, Some(&freed[k])).map_err(cuda)?;
                pending[k] = true;
                Ok(())
            }
        }
    }

    /// Wait until every scatter of this mover finished (on a device: its own stream only).
    pub(super) fn finish(&mut self) -> Result<(), String> {
        if let Kind::Device { dev, stream, pending, .. } = &mut self.kind {
            let _ctx = dev.bind().map_err(cuda)?;
            stream.synchronize().map_err(cuda)?;
            *pending = [false; 2];
        }
        Ok(())
    }

    /// Checksums of blocks `ids` summed where they lie (device pools: a kernel; host pools are
    /// summed by the agent without a mover).
    pub(super) fn device_checksums(&mut self, ids: &[u32], out: &mut [u64]) -> Result<(), String> {
        match &mut self.kind {
            Kind::Host { .. } => Err("host pools are summed in place without a mover".into()),
            Kind::Device { dev, engine, stream, .. } => {
                let _ctx = dev.bind().map_err(cuda)?;
                engine.checksums(ids, out, stream).map_err(cuda)
            }
        }
    }
}

/// Idle movers, so that a connection or a fetch does not compile a kernel or allocate pinned
/// memory each time.
pub(super) struct Movers {
    mem: Memory,
    idle: Mutex<Vec<Mover>>,
}

impl Movers {
    pub(super) fn new(mem: Memory) -> Movers {
        Movers { mem, idle: Mutex::new(Vec::new()) }
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
        unsafe { Mover::new(&self.mem, layout) }
    }

    /// Give a mover back (only one whose copies all finished).
    pub(super) fn put(&self, m: Mover) {
        self.idle.lock().unwrap_or_else(|e| e.into_inner()).push(m);
    }
}
