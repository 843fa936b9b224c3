//! The KV pool's bytes behind the copy engine: host memory or the memory of one CUDA device,
//! in copy lanes so that requests copy in parallel and a GPU copy waits for its own stream only.

use std::sync::Mutex;

use crate::abi::{cuda_available, AbiError, CpuEngine, CudaEngine, HostPool, KvLayout, Pinned};

/// One lane of the pool's copy engine: an engine of its own (and, for a GPU pool, pinned
/// staging and a stream of its own), so that requests copy in parallel and a GPU copy waits for
/// its own stream only (never for the whole context: the KV agent's and UCX's work, or other
/// requests' copies).
enum Lane {
    Host { engine: CpuEngine },
    Cuda { engine: CudaEngine, staging: Pinned, stream: std::sync::Arc<cudarc::driver::CudaStream> },
}

/// The pool's memory, owned by the store and freed after every lane (field order).
enum PoolMemory {
    Host(#[allow(dead_code)] HostPool),
    Cuda(#[allow(dead_code)] DevicePool),
}

/// A GPU pool allocated with `cuMemAlloc` (not the stream-ordered allocator: memory from its
/// pools cannot be shared with legacy CUDA IPC handles, which is how UCX moves GPU memory
/// between processes).
struct DevicePool {
    ptr: u64,
    ctx: std::sync::Arc<cudarc::driver::CudaContext>,
}

impl DevicePool {
    /// `len` zeroed bytes on `ctx`'s device.
    fn alloc(ctx: &std::sync::Arc<cudarc::driver::CudaContext>, len: usize) -> Result<DevicePool, String> {
        use cudarc::driver::sys;
        ctx.bind_to_thread().map_err(|e| format!("device pool: {e:?}"))?;
        let mut ptr = 0;
        // SAFETY: `ptr` is writable; the device's context is current on this thread (above).
        let r = unsafe { sys::cuMemAlloc_v2(&mut ptr, len) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(format!("device pool of {len} bytes: cuMemAlloc {r:?}"));
        }
        let pool = DevicePool { ptr, ctx: ctx.clone() };
        // SAFETY: `ptr` holds `len` bytes of device memory (above); the context is current.
        let r = unsafe { sys::cuMemsetD8_v2(ptr, 0, len) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(format!("device pool: cuMemsetD8 {r:?}"));
        }
        Ok(pool)
    }
}

impl Drop for DevicePool {
    fn drop(&mut self) {
        use cudarc::driver::sys;
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by `cuMemAlloc` in `alloc`, freed once; the store drops the
            // engine that addresses it first (field order) and synchronizes every copy.
            unsafe { sys::cuMemFree_v2(self.ptr) };
        }
    }
}

/// Blocks per staged GPU copy (the pinned staging holds this many).
const STAGE_BLOCKS: usize = 16;

/// Copy lanes per store: copies of different requests run in parallel up to this many.
const LANES: usize = 8;

/// The KV pool's bytes behind the copy engine, in [`LANES`] lanes (each engine takes `&mut`;
/// a call takes a free lane). Two calls never touch one block at once: a block is written only
/// by the lease that owns it fresh, and committed blocks are only read.
pub struct KvStore {
    lanes: Vec<Mutex<Lane>>,
    next: std::sync::atomic::AtomicUsize,
    block_bytes: usize,
    region: Region,
    /// The pool's layout (what the KV agent is created over).
    layout: KvLayout,
    // Dropped after the lanes (field order), which address it.
    _mem: PoolMemory,
}

/// Where a pool lives: its base address and length, and the CUDA device (`None`: host memory).
/// Block `id` is at `base + id * block_bytes`.
#[derive(Clone, Copy, Debug)]
pub struct Region {
    /// Base address (host virtual, or CUDA device pointer).
    pub base: u64,
    /// Bytes.
    pub len: usize,
    /// CUDA device ordinal of device memory.
    pub device: Option<i32>,
}

impl KvStore {
    /// A host-memory pool of `blocks` blocks of `block_bytes`, through the CPU engine.
    pub fn host(blocks: usize, block_bytes: usize) -> Result<KvStore, AbiError> {
        let mem = HostPool::new(blocks * block_bytes);
        let layout = KvLayout::contiguous(mem.addr(), blocks as u32, block_bytes as u64)?;
        debug_assert_eq!(layout.stage_block_bytes() as usize, block_bytes);
        let mut lanes = Vec::with_capacity(LANES);
        for _ in 0..LANES {
            // SAFETY: the layout covers exactly `mem`, which this store owns for as long as the
            // engines live (field order); each call touches only the blocks it names, and the
            // cache's leases keep a block's writer alone with it (see `KvStore`).
            let engine = unsafe { CpuEngine::new(&layout)? };
            lanes.push(Mutex::new(Lane::Host { engine }));
        }
        let region = Region { base: mem.addr(), len: blocks * block_bytes, device: None };
        Ok(KvStore { lanes, next: Default::default(), block_bytes, region, layout, _mem: PoolMemory::Host(mem) })
    }

    /// A pool of `blocks` blocks in the memory of CUDA device `device`, allocated here (the
    /// server plays the runtime that owns its pool) and moved through the CUDA copy engine and a
    /// pinned staging buffer of [`STAGE_BLOCKS`] blocks.
    pub fn cuda(device: i32, blocks: usize, block_bytes: usize) -> Result<KvStore, String> {
        cuda_available(device).map_err(|e| format!("--device cuda:{device}: {e}"))?;
        let ctx = cudarc::driver::CudaContext::new(device as usize).map_err(|e| format!("cuda:{device}: {e:?}"))?;
        let mem = DevicePool::alloc(&ctx, blocks * block_bytes)?;
        let base = mem.ptr;
        let layout = KvLayout::contiguous(base, blocks as u32, block_bytes as u64).map_err(|e| e.to_string())?;
        let mut lanes = Vec::with_capacity(LANES);
        for _ in 0..LANES {
            // SAFETY: the layout covers exactly `mem`, device memory of `device` that the store
            // owns for as long as the engines live (field order); blocks as in `host`.
            let engine = unsafe { CudaEngine::new(device, &layout) }.map_err(|e| e.to_string())?;
            let staging = Pinned::alloc(device, STAGE_BLOCKS * block_bytes).map_err(|e| e.to_string())?;
            let stream = ctx.new_stream().map_err(|e| format!("cuda:{device}: a stream: {e:?}"))?;
            lanes.push(Mutex::new(Lane::Cuda { engine, staging, stream }));
        }
        let region = Region { base, len: blocks * block_bytes, device: Some(device) };
        Ok(KvStore { lanes, next: Default::default(), block_bytes, region, layout, _mem: PoolMemory::Cuda(mem) })
    }

    /// Bytes per block.
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// Where the pool lives.
    pub fn region(&self) -> Region {
        self.region
    }

    /// The pool's layout (the KV agent is created over it).
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// A free lane, or (all busy) the next one in turn, waiting for it.
    fn lane(&self) -> std::sync::MutexGuard<'_, Lane> {
        use std::sync::TryLockError;
        let n = self.lanes.len();
        let start = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        for k in 0..n {
            match self.lanes[(start + k) % n].try_lock() {
                Ok(g) => return g,
                // a panic mid-copy leaves nothing half-kept in a lane: still usable
                Err(TryLockError::Poisoned(p)) => return p.into_inner(),
                Err(TryLockError::WouldBlock) => {}
            }
        }
        self.lanes[start % n].lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Copy blocks `ids` into `out` (block-major, `ids.len() * block_bytes` long). A device
    /// pool's copies wait on their stream: called from an async worker of a multi-threaded
    /// runtime, that wait runs in `block_in_place`, so the worker's other tasks move on.
    pub fn read(&self, ids: &[u32], out: &mut [u8]) -> Result<(), AbiError> {
        self.off_async(|| self.read_now(ids, out))
    }

    /// Copy `data` into blocks `ids` (waits as [`read`](Self::read) says).
    pub fn write(&self, ids: &[u32], data: &[u8]) -> Result<(), AbiError> {
        self.off_async(|| self.write_now(ids, data))
    }

    /// Run `f`, which may wait on a device stream (or a lane another copy holds), without
    /// holding up an async worker: `block_in_place` on a multi-threaded runtime's worker, as it
    /// is elsewhere (host pools only copy memory: no wait worth handing off).
    fn off_async<R>(&self, f: impl FnOnce() -> R) -> R {
        let on_worker = tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
        if self.region.device.is_some() && on_worker {
            tokio::task::block_in_place(f)
        } else {
            f()
        }
    }

    fn read_now(&self, ids: &[u32], out: &mut [u8]) -> Result<(), AbiError> {
        let bb = self.block_bytes;
        match &mut *self.lane() {
            Lane::Host { engine } => engine.gather(ids, out),
            Lane::Cuda { engine, staging, stream } => {
                for (ids, out) in ids.chunks(STAGE_BLOCKS).zip(out.chunks_mut(STAGE_BLOCKS * bb)) {
                    engine.gather(ids, staging, stream)?;
                    stream.synchronize().map_err(cuda_sync_error)?;
                    out.copy_from_slice(&staging.bytes_mut()[..out.len()]);
                }
                Ok(())
            }
        }
    }

    fn write_now(&self, ids: &[u32], data: &[u8]) -> Result<(), AbiError> {
        let bb = self.block_bytes;
        match &mut *self.lane() {
            Lane::Host { engine } => engine.scatter(data, ids),
            Lane::Cuda { engine, staging, stream } => {
                for (ids, data) in ids.chunks(STAGE_BLOCKS).zip(data.chunks(STAGE_BLOCKS * bb)) {
                    staging.bytes_mut()[..data.len()].copy_from_slice(data);
                    engine.scatter(staging, ids, stream)?;
                    stream.synchronize().map_err(cuda_sync_error)?;
                }
                Ok(())
            }
        }
    }
}

fn cuda_sync_error(_: cudarc::driver::DriverError) -> AbiError {
    AbiError { call: "cuStreamSynchronize", status: kvrelay::ffi::kvrelay_status::KVRELAY_ERR_CUDA as i32 }
}

/// Blocks per bulk copy through a host buffer: about 8 MiB (at least one block), so that a
/// small request does not allocate and fault in a large buffer, and a large one still moves
/// big pieces.
pub fn chunk_blocks(block_bytes: usize) -> usize {
    ((8 << 20) / block_bytes.max(1)).clamp(1, STAGE_BLOCKS)
}
