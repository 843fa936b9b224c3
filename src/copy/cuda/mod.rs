//! The CUDA engine: gather and scatter between a device KV pool and pinned host staging,
//! enqueued on the caller's stream. One file per idea:
//! - `driver.rs`: the driver wrappers (device and primary context, pinned and device memory,
//!   streams, events);
//! - `kernel.rs`: the copy kernel's source, its parameter blocks, its launch and the pinned id
//!   ring the kernel itself releases;
//! - `staged.rs`: the staged method, pipelined over two scratch halves;
//! - this file: the methods, the options, the engine and its dispatch.
//!
//! The driver is loaded at run time (no CUDA needed to build or to run without a GPU): every
//! entry point first checks that `libcuda` is present and returns [`CopyError::NoDriver`]
//! otherwise. Methods, chosen at setup:
//! - [`CopyMethod::Kernel`] (default): a zero-copy kernel, compiled once per process with NVRTC
//!   and loaded once per [`CudaDevice`], reads and writes mapped pinned host memory directly.
//!   Block ids travel in the kernel's parameter block (up to [`IDS_PER_LAUNCH`] per launch,
//!   within the 4 KiB parameter limit), or, for larger calls, through a pinned ring whose slots
//!   the kernel releases; a call is one driver call, no allocation, no lock. One warp copies
//!   one (block, segment) chunk with 16-byte accesses, eight in flight per lane; the grid is
//!   the CTA budget (default 16).
//! - [`CopyMethod::Staged`]: HBM gather into a device scratch, then contiguous copies on the
//!   copy engines, pipelined over two halves on an internal stream, ordered with the caller's
//!   stream by events.
//! - [`CopyMethod::Batch`]: one `cuMemcpyBatchAsync` per call (resolved with `cuGetProcAddress`
//!   at setup, asking for the CUDA 12.8 ABI; absent on older drivers), descriptor arrays
//!   reserved at setup.
//! - [`CopyMethod::PerChunk`]: one `cuMemcpyAsync` per chunk, the last fallback.
//!
//! Ordering: every call is enqueued on the caller's stream, so it runs after the work the
//! caller enqueued there before it (the kernel that wrote the KV, say); pass an event to learn
//! when it is done.

mod device_copy;
mod driver;
mod kernel;
mod staged;

pub use device_copy::DeviceCopier;
use driver::check;
pub use driver::{
    driver_present, CudaDevice, CudaEvent, CudaStream, DeviceBuffer, IpcExport, PinnedBuffer, VmmBuffer, VmmChunk,
    VmmHandle,
};
use kernel::{Params, SegRow, KERNEL, RING_SLOTS};
pub use kernel::{COPY_SUM_IDS, DEFAULT_CTAS, DEFAULT_THREADS, IDS_PER_LAUNCH, RING_IDS_PER_LAUNCH};

use std::ffi::{c_void, CString};
use std::sync::Arc;

use cudarc::driver::sys;

use crate::copy::layout::KvLayout;
use crate::copy::plan::Checker;
use crate::copy::CopyError;

/// The copy kernel's PTX, compiled by NVRTC once per process (tens of milliseconds) and loaded
/// once per device from there ([`CudaDevice`] keeps the module): engines are made per agent
/// connection and fetch stream, and the kernel source never changes.
fn kernel_ptx() -> Result<&'static CString, CopyError> {
    static PTX: std::sync::OnceLock<Result<CString, &'static str>> = std::sync::OnceLock::new();
    PTX.get_or_init(|| {
        // SAFETY: only probes for the NVRTC library.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err("NVRTC library not found");
        }
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(
            KERNEL,
            cudarc::nvrtc::CompileOptions { arch: Some("compute_90"), ..Default::default() },
        )
        .or_else(|_| cudarc::nvrtc::compile_ptx(KERNEL))
        .map_err(|_| "NVRTC could not compile the copy kernel")?;
        CString::new(ptx.to_src()).map_err(|_| "PTX with NUL")
    })
    .as_ref()
    .map_err(|e| CopyError::Unsupported(e))
}

/// Load the copy kernels' module into the current context (called once per device by
/// [`CudaDevice::kernels`]).
fn load_kernels() -> Result<driver::Kernels, CopyError> {
    let src = kernel_ptx()?;
    let mut module = std::ptr::null_mut();
    // SAFETY: loads the compiled PTX into the current context (the caller bound it).
    check(unsafe { sys::cuModuleLoadData(&mut module, src.as_ptr().cast()) }, "cuModuleLoadData")?;
    let func = |name: &str| {
        let name = CString::new(name).expect("no NUL");
        let mut f = std::ptr::null_mut();
        // SAFETY: looks a kernel up in the module just loaded, into a local.
        check(unsafe { sys::cuModuleGetFunction(&mut f, module, name.as_ptr()) }, "cuModuleGetFunction").map(|_| f)
    };
    match (func("kvrelay_copy"), func("kvrelay_copy_ring"), func("kvrelay_sum"), func("kvrelay_copy_sum")) {
        (Ok(copy), Ok(ring), Ok(sum), Ok(copy_sum)) => Ok(driver::Kernels { module, copy, ring, sum, copy_sum }),
        (Err(e), ..) | (_, Err(e), ..) | (_, _, Err(e), _) | (.., Err(e)) => {
            // SAFETY: the module loaded above, unloaded once; nothing was launched from it.
            unsafe { sys::cuModuleUnload(module) };
            Err(e)
        }
    }
}

/// How the engine moves bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyMethod {
    /// Zero-copy kernel (NVRTC once per process, loaded once per [`CudaDevice`]).
    Kernel,
    /// Through a device scratch buffer reserved at setup, in two halves: the kernel gathers a
    /// piece of blocks into one half at HBM speed while the copy engines move the previous piece
    /// across the bus as one contiguous `cuMemcpyAsync` on an internal stream (scatter: the
    /// reverse). Ordering with the caller's stream is kept by events: the copies start after
    /// the work enqueued before the call, and the caller's stream waits for the last of them.
    Staged,
    /// `cuMemcpyBatchAsync`.
    Batch,
    /// One `cuMemcpyAsync` per chunk.
    PerChunk,
}

/// Engine options.
#[derive(Clone, Copy, Debug)]
pub struct EngineOptions {
    /// The method.
    pub method: CopyMethod,
    /// CTA budget of the kernel (1..=1024).
    pub ctas: u32,
    /// Threads per CTA of the kernel (a multiple of 32, 64..=512).
    pub threads: u32,
    /// Most blocks per call the batch method reserves descriptors for (larger calls are split).
    pub max_blocks_per_call: usize,
    /// How the kernel receives block ids.
    pub ids: IdTransport,
    /// Device scratch reserved by the `Staged` method (rounded down to whole blocks).
    pub scratch_bytes: usize,
}

/// How the kernel method hands block ids to the GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdTransport {
    /// `Params` for calls of up to [`IDS_PER_LAUNCH`] blocks (cheapest: no event), `Ring` above
    /// (one launch instead of several). The default.
    Auto,
    /// In a ring of pinned, device-mapped slots reserved at setup (the kernel reads them over
    /// the bus): a small parameter block, one launch per [`RING_IDS_PER_LAUNCH`] blocks, and a
    /// slot is reused only after the launch that read it completed (an event per slot).
    Ring,
    /// Inside the kernel's 4 KiB parameter block: nothing written before the launch, but one
    /// launch per [`IDS_PER_LAUNCH`] blocks and a larger parameter copy per launch.
    Params,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            method: CopyMethod::Kernel,
            ctas: DEFAULT_CTAS,
            threads: DEFAULT_THREADS,
            max_blocks_per_call: 1024,
            ids: IdTransport::Auto,
            scratch_bytes: 256 << 20,
        }
    }
}

type BatchFn = unsafe extern "C" fn(
    dsts: *mut sys::CUdeviceptr,
    srcs: *mut sys::CUdeviceptr,
    sizes: *mut usize,
    count: usize,
    attrs: *mut sys::CUmemcpyAttributes,
    attr_idxs: *mut usize,
    num_attrs: usize,
    fail_idx: *mut usize,
    stream: sys::CUstream,
) -> sys::CUresult;

/// Resolve `cuMemcpyBatchAsync` with the CUDA 12.8 ABI (the driver keeps old ABIs).
fn resolve_batch() -> Option<BatchFn> {
    let name = CString::new("cuMemcpyBatchAsync").expect("no NUL");
    let mut p: *mut c_void = std::ptr::null_mut();
    let mut status = sys::CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    // SAFETY: asks the driver for a symbol with valid out-pointers; null means absent.
    let r = unsafe { sys::cuGetProcAddress_v2(name.as_ptr(), &mut p, 12080, 0, &mut status) };
    if r != sys::CUresult::CUDA_SUCCESS || p.is_null() {
        return None;
    }
    // SAFETY: the driver returned the 12.8 entry point, whose signature is `BatchFn`.
    Some(unsafe { std::mem::transmute::<*mut c_void, BatchFn>(p) })
}

/// The CUDA engine. Calls take `&mut self` (the duplicate check and the batch descriptors use
/// memory reserved at setup); use one engine per stream that copies concurrently.
pub struct CudaEngine {
    dev: Arc<CudaDevice>,
    layout: KvLayout,
    opts: EngineOptions,
    checker: Checker,
    func: sys::CUfunction,
    seg_table: Option<DeviceBuffer>,
    batch: Option<BatchFn>,
    dsts: Vec<u64>,
    srcs: Vec<u64>,
    sizes: Vec<usize>,
    params: Box<Params>,
    ring_func: sys::CUfunction,
    ring: Option<PinnedBuffer>,
    /// One u64 per slot: the generation of the last launch that finished with it.
    ring_done: Option<PinnedBuffer>,
    /// One u32 per slot: CTAs finished in the slot's current launch.
    ring_counters: Option<DeviceBuffer>,
    /// Generation of the last launch that used each slot (0: never used).
    ring_gen: Vec<u64>,
    /// An idle stream of kvrelay's own: querying it tells a slot wait that the context has
    /// failed (a sticky error), without waiting on anyone's work.
    ring_probe: Option<CudaStream>,
    next_gen: u64,
    ring_next: usize,
    scratch: Option<DeviceBuffer>,
    staged: Option<Staged>,
    /// The checksum kernel, and its per-call buffers (made on first use).
    sum_func: sys::CUfunction,
    /// The copy-and-sum kernel (copies from another pool).
    copy_sum_func: sys::CUfunction,
    /// CTAs of the summing kernels that fit on one SM at once (their registers, the engine's
    /// threads per CTA): their grids are one wave of that many per SM.
    sum_ctas_per_sm: u32,
    sums: Option<Box<kernel::SumState>>,
    /// The block key's stream on the device ([`CudaEngine::set_block_key`]): the summing
    /// kernels take the keyed tags' NH sums from the same loads when a call asks for them.
    tag_keys: Option<DeviceBuffer>,
}

/// The internal stream and events of the staged method.
struct Staged {
    stream: CudaStream,
    entry: sys::CUevent,
    ready: [sys::CUevent; 2],
    free: [sys::CUevent; 2],
    free_recorded: [bool; 2],
}

impl Drop for Staged {
    fn drop(&mut self) {
        let _ = self.stream.synchronize();
        for e in [self.entry, self.ready[0], self.ready[1], self.free[0], self.free[1]] {
            // SAFETY: events created in `setup`, destroyed once, after the stream drained.
            unsafe { sys::cuEventDestroy_v2(e) };
        }
    }
}

// SAFETY: the module/function handles belong to the retained context and may be used from any
// thread; `&mut self` serializes calls.
unsafe impl Send for CudaEngine {}

impl std::fmt::Debug for CudaEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaEngine")
            .field("method", &self.opts.method)
            .field("ctas", &self.opts.ctas)
            .finish_non_exhaustive()
    }
}

impl CudaEngine {
    /// Set up an engine over a device KV pool described by `layout` (device addresses).
    /// Compiles the kernel (method `Kernel`), resolves `cuMemcpyBatchAsync` (method `Batch`,
    /// [`CopyError::Unsupported`] when the driver lacks it), and reserves everything a call
    /// needs.
    ///
    /// # Safety
    /// Every block of every segment must be device memory of `dev` valid for reads and writes
    /// while the engine is used.
    pub unsafe fn new(dev: &Arc<CudaDevice>, layout: KvLayout, opts: EngineOptions) -> Result<CudaEngine, CopyError> {
        if !(1..=1024).contains(&opts.ctas)
            || !(64..=512).contains(&opts.threads)
            || opts.threads % 32 != 0
            || opts.max_blocks_per_call == 0
        {
            return Err(CopyError::InvalidOptions);
        }
        let _ctx = dev.bind()?;
        let mut e = CudaEngine {
            dev: dev.clone(),
            checker: Checker::new(&layout),
            opts,
            func: std::ptr::null_mut(),
            seg_table: None,
            batch: None,
            dsts: Vec::new(),
            srcs: Vec::new(),
            sizes: Vec::new(),
            params: Box::new(Params {
                segs: 0,
                staging: 0,
                stage_block_bytes: layout.stage_block_bytes(),
                n_seg: layout.segments().len() as u32,
                n_ids: 0,
                to_staging: 0,
                pad: 0,
                ids: [0; IDS_PER_LAUNCH],
            }),
            ring_func: std::ptr::null_mut(),
            ring: None,
            ring_done: None,
            ring_counters: None,
            ring_gen: Vec::new(),
            ring_probe: None,
            next_gen: 0,
            ring_next: 0,
            scratch: None,
            staged: None,
            sum_func: std::ptr::null_mut(),
            copy_sum_func: std::ptr::null_mut(),
            sum_ctas_per_sm: 1,
            sums: None,
            tag_keys: None,
            layout,
        };
        match opts.method {
            CopyMethod::Kernel => e.setup_kernel()?,
            CopyMethod::Staged => {
                let sbb = e.layout.stage_block_bytes() as usize;
                if opts.scratch_bytes < sbb {
                    return Err(CopyError::InvalidOptions);
                }
                if opts.scratch_bytes < 2 * sbb {
                    return Err(CopyError::InvalidOptions);
                }
                e.setup_kernel()?;
                e.scratch = Some(DeviceBuffer::alloc(dev, opts.scratch_bytes / (2 * sbb) * 2 * sbb)?);
                let mk = || -> Result<sys::CUevent, CopyError> {
                    let mut ev = std::ptr::null_mut();
                    // SAFETY: plain driver call with a valid out-pointer; destroyed in Drop.
                    let r = unsafe { sys::cuEventCreate(&mut ev, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32) };
                    check(r, "cuEventCreate").map(|_| ev)
                };
                e.staged = Some(Staged {
                    stream: CudaStream::new(dev)?,
                    entry: mk()?,
                    ready: [mk()?, mk()?],
                    free: [mk()?, mk()?],
                    free_recorded: [false; 2],
                });
            }
            CopyMethod::Batch => {
                e.batch = Some(resolve_batch().ok_or(CopyError::Unsupported("cuMemcpyBatchAsync"))?);
                let n = opts.max_blocks_per_call * e.layout.segments().len();
                e.dsts.reserve_exact(n);
                e.srcs.reserve_exact(n);
                e.sizes.reserve_exact(n);
            }
            CopyMethod::PerChunk => {}
        }
        Ok(e)
    }

    fn setup_kernel(&mut self) -> Result<(), CopyError> {
        let k = self.dev.kernels(load_kernels)?;
        (self.func, self.ring_func, self.sum_func, self.copy_sum_func) = (k.copy, k.ring, k.sum, k.copy_sum);
        // one wave: as many CTAs per SM as the driver says fit at once (a grid of more leaves
        // a partial second wave whose SMs idle while it runs); 4, as before this was asked,
        // where the query fails
        let threads = self.opts.threads;
        self.sum_ctas_per_sm = [k.sum, k.copy_sum]
            .into_iter()
            .map(|f| {
                let mut n: std::ffi::c_int = 0;
                // SAFETY: `f` is a kernel of the module just loaded in this device's context,
                // current on this thread (`new` bound it); `n` is a writable int.
                let r = unsafe { sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut n, f, threads as i32, 0) };
                if r == sys::CUresult::CUDA_SUCCESS && n > 0 {
                    n as u32
                } else {
                    4
                }
            })
            .min()
            .unwrap_or(4)
            .clamp(1, 2048 / threads);
        if self.opts.ids != IdTransport::Params {
            self.ring = Some(PinnedBuffer::alloc(&self.dev, RING_SLOTS * RING_IDS_PER_LAUNCH * 4)?);
            let mut done = PinnedBuffer::alloc(&self.dev, RING_SLOTS * 8)?;
            done.as_mut_slice().fill(0);
            self.ring_done = Some(done);
            let counters = DeviceBuffer::alloc(&self.dev, RING_SLOTS * 4)?;
            counters.write(0, &[0u8; RING_SLOTS * 4])?;
            self.ring_counters = Some(counters);
            self.ring_gen = vec![0; RING_SLOTS];
            self.ring_probe = Some(CudaStream::new(&self.dev)?);
        }
        let rows: Vec<SegRow> = self
            .layout
            .segments()
            .iter()
            .enumerate()
            .map(|(i, s)| SegRow {
                base: s.base,
                stride: s.block_stride,
                bytes: s.bytes_per_block,
                stage_off: self.layout.stage_offset(i),
            })
            .collect();
        // SAFETY: `SegRow` is plain old data (four u64), so viewing the rows as bytes is sound.
        let bytes =
            unsafe { std::slice::from_raw_parts(rows.as_ptr().cast::<u8>(), std::mem::size_of_val(rows.as_slice())) };
        let table = DeviceBuffer::alloc(&self.dev, bytes.len())?;
        table.write(0, bytes)?;
        self.params.segs = table.ptr();
        self.seg_table = Some(table);
        Ok(())
    }

    /// The layout.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }
    /// The method in use.
    pub fn method(&self) -> CopyMethod {
        self.opts.method
    }

    /// Enqueue a copy of blocks `ids` (in that order) into `staging` on `stream`. It runs
    /// after everything enqueued on the stream before it; `done`, if given, is recorded after
    /// it. Repeated ids are allowed. Host cost: the id checks plus one launch per
    /// [`IDS_PER_LAUNCH`] blocks (kernel), one batch call, or one call per chunk; no
    /// allocation, no lock.
    pub fn gather(
        &mut self,
        ids: &[u32],
        staging: &PinnedBuffer,
        stream: &CudaStream,
        done: Option<&CudaEvent>,
    ) -> Result<(), CopyError> {
        // SAFETY: a live stream of this library.
        unsafe { self.gather_raw(ids, staging, stream.raw(), done.map_or(std::ptr::null_mut(), CudaEvent::raw)) }
    }

    /// [`CudaEngine::gather`] on a raw `CUstream` (what a C++ executor passes).
    ///
    /// # Safety
    /// `stream` must be null (the legacy default stream) or a live stream of the engine's
    /// context.
    pub unsafe fn gather_raw(
        &mut self,
        ids: &[u32],
        staging: &PinnedBuffer,
        stream: sys::CUstream,
        done: sys::CUevent,
    ) -> Result<(), CopyError> {
        self.checker.check(&self.layout, ids, staging.len() as u64, false)?;
        // SAFETY: forwarded contract.
        unsafe { self.enqueue(ids, staging, stream, true)? };
        // SAFETY: forwarded contract.
        unsafe { self.record_done(done, stream) }
    }

    /// Enqueue a copy of `staging` back into blocks `ids` on `stream`. Repeated ids are refused
    /// (two writes to one block would race). Otherwise as [`CudaEngine::gather`].
    pub fn scatter(
        &mut self,
        staging: &PinnedBuffer,
        ids: &[u32],
        stream: &CudaStream,
        done: Option<&CudaEvent>,
    ) -> Result<(), CopyError> {
        // SAFETY: a live stream of this library.
        unsafe { self.scatter_raw(staging, ids, stream.raw(), done.map_or(std::ptr::null_mut(), CudaEvent::raw)) }
    }

    /// [`CudaEngine::scatter`] on a raw `CUstream`.
    ///
    /// # Safety
    /// As [`CudaEngine::gather_raw`].
    pub unsafe fn scatter_raw(
        &mut self,
        staging: &PinnedBuffer,
        ids: &[u32],
        stream: sys::CUstream,
        done: sys::CUevent,
    ) -> Result<(), CopyError> {
        self.checker.check(&self.layout, ids, staging.len() as u64, true)?;
        // SAFETY: forwarded contract.
        unsafe { self.enqueue(ids, staging, stream, false)? };
        // SAFETY: forwarded contract.
        unsafe { self.record_done(done, stream) }
    }

    /// Record the caller's `done` event (null: none) on `stream`, in the engine's context.
    ///
    /// # Safety
    /// `done` null or a live event of the engine's context; `stream` as in
    /// [`CudaEngine::gather_raw`].
    unsafe fn record_done(&self, done: sys::CUevent, stream: sys::CUstream) -> Result<(), CopyError> {
        if done.is_null() {
            return Ok(());
        }
        let _ctx = self.dev.bind()?;
        // SAFETY: per the contract, with the engine's context current.
        check(unsafe { sys::cuEventRecord(done, stream) }, "cuEventRecord")
    }

    /// # Safety
    /// `stream` as in [`CudaEngine::gather_raw`]; ids and staging size already checked.
    unsafe fn enqueue(
        &mut self,
        ids: &[u32],
        staging: &PinnedBuffer,
        stream: sys::CUstream,
        to_staging: bool,
    ) -> Result<(), CopyError> {
        if ids.is_empty() {
            return Ok(());
        }
        let _ctx = self.dev.bind()?;
        match self.opts.method {
            CopyMethod::Kernel => {
                // SAFETY: forwarded contract; the staging range was checked by the caller.
                unsafe { self.launch_kernel(ids, staging.device_ptr(), to_staging, stream)? };
            }
            CopyMethod::Staged => {
                // SAFETY: forwarded contract; ranges checked by the caller.
                unsafe { self.enqueue_staged(ids, staging, stream, to_staging)? };
            }
            CopyMethod::Batch => {
                let batch = self.batch.expect("resolved at setup");
                let per = self.opts.max_blocks_per_call;
                for (k, part) in ids.chunks(per).enumerate() {
                    self.dsts.clear();
                    self.srcs.clear();
                    self.sizes.clear();
                    let base = staging.device_ptr() + (k * per) as u64 * self.layout.stage_block_bytes();
                    for (dev, off, len) in self.layout.chunks(part) {
                        let (s, d) = if to_staging { (dev, base + off) } else { (base + off, dev) };
                        self.srcs.push(s);
                        self.dsts.push(d);
                        self.sizes.push(len as usize);
                    }
                    let loc = |host: bool| sys::CUmemLocation {
                        type_: if host {
                            sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST
                        } else {
                            sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE
                        },
                        id: if host { 0 } else { self.dev.ordinal },
                    };
                    let mut attr = sys::CUmemcpyAttributes {
                        srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
                        srcLocHint: loc(!to_staging),
                        dstLocHint: loc(to_staging),
                        flags: 0,
                    };
                    let mut idx = 0usize;
                    let mut fail = 0usize;
                    // SAFETY: the three arrays hold `count` descriptors of checked ranges; one
                    // attribute applies from index 0; the entry point has the 12.8 signature.
                    let r = unsafe {
                        batch(
                            self.dsts.as_mut_ptr(),
                            self.srcs.as_mut_ptr(),
                            self.sizes.as_mut_ptr(),
                            self.sizes.len(),
                            &mut attr,
                            &mut idx,
                            1,
                            &mut fail,
                            stream,
                        )
                    };
                    check(r, "cuMemcpyBatchAsync")?;
                }
            }
            CopyMethod::PerChunk => {
                let base = staging.device_ptr();
                for (dev, off, len) in self.layout.chunks(ids) {
                    let (s, d) = if to_staging { (dev, base + off) } else { (base + off, dev) };
                    // SAFETY: both ranges were checked (layout blocks, staging size); unified
                    // addressing lets one call copy either way.
                    check(unsafe { sys::cuMemcpyAsync(d, s, len as usize, stream) }, "cuMemcpyAsync")?;
                }
            }
        }
        Ok(())
    }
}

impl Drop for CudaEngine {
    fn drop(&mut self) {
        let _ctx = self.dev.bind();
        // The kernels still running may read the id ring and write the flags: wait for them.
        for slot in 0..self.ring_gen.len() {
            self.wait_slot(slot);
        }
    }
}
