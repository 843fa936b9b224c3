//! The CUDA engine: gather and scatter between a device KV pool and pinned host staging,
//! enqueued on the caller's stream.
//!
//! The driver is loaded at run time (no CUDA needed to build or to run without a GPU): every
//! entry point first checks that `libcuda` is present and returns [`CopyError::NoDriver`]
//! otherwise. Methods, chosen at setup:
//! - [`CopyMethod::Kernel`] (default): a zero-copy kernel, compiled once per engine with NVRTC,
//!   reads and writes mapped pinned host memory directly. Block ids travel in the kernel's
//!   parameter block (up to [`IDS_PER_LAUNCH`] per launch, within the 4 KiB parameter limit),
//!   so a call writes no memory at all before its launch: no id buffer to race on, no
//!   allocation, no lock. One warp copies one (block, segment) chunk with 16-byte accesses,
//!   eight in flight per lane; the grid is the CTA budget (default 16).
//! - [`CopyMethod::Batch`]: one `cuMemcpyBatchAsync` per call (resolved with `cuGetProcAddress`
//!   at setup, asking for the CUDA 12.8 ABI; absent on older drivers), descriptor arrays
//!   reserved at setup.
//! - [`CopyMethod::PerChunk`]: one `cuMemcpyAsync` per chunk, the last fallback.
//!
//! Ordering: every call is enqueued on the caller's stream, so it runs after the work the
//! caller enqueued there before it (the kernel that wrote the KV, say); pass an event to learn
//! when it is done.

use std::ffi::{c_void, CString};
use std::sync::Arc;

use cudarc::driver::sys;

use super::layout::KvLayout;
use super::plan::Checker;
use super::CopyError;

/// Block ids carried by one kernel launch.
pub const IDS_PER_LAUNCH: usize = 960;
/// Default CTA budget of the kernel.
pub const DEFAULT_CTAS: u32 = 16;
/// Default threads per CTA of the kernel.
pub const DEFAULT_THREADS: u32 = 512;

const KERNEL: &str = r#"
struct Seg { unsigned long long base, stride, bytes, stage_off; };
struct Params {
  unsigned long long segs, staging, stage_block_bytes;
  unsigned int n_seg, n_ids, to_staging, pad;
  unsigned int ids[960];
};
struct RingParams {
  unsigned long long segs, staging, stage_block_bytes, ids, done, counter, gen;
  unsigned int n_seg, n_ids, to_staging, pad;
};
__device__ __forceinline__ void copy_chunks(const Seg* segs, const unsigned int* ids, unsigned long long staging,
    unsigned long long stage_block_bytes, unsigned n_seg, unsigned n_ids, unsigned to_staging) {
  const unsigned lane = threadIdx.x & 31u;
  const unsigned long long wpc = blockDim.x >> 5;
  const unsigned long long warp = (unsigned long long)blockIdx.x * wpc + (threadIdx.x >> 5);
  const unsigned long long nwarps = (unsigned long long)gridDim.x * wpc;
  const unsigned long long n_chunks = (unsigned long long)n_ids * n_seg;
  for (unsigned long long c = warp; c < n_chunks; c += nwarps) {
    const unsigned i = (unsigned)(c / n_seg);
    const unsigned s = (unsigned)(c - (unsigned long long)i * n_seg);
    const Seg g = segs[s];
    uint4* dev = (uint4*)(g.base + (unsigned long long)ids[i] * g.stride);
    uint4* host = (uint4*)(staging + (unsigned long long)i * stage_block_bytes + g.stage_off);
    const uint4* src = to_staging ? dev : host;
    uint4* dst = to_staging ? host : dev;
    const unsigned long long n = g.bytes >> 4;
    unsigned long long k = lane;
    for (; k + 224 < n; k += 256) {
      uint4 r0 = src[k], r1 = src[k + 32], r2 = src[k + 64], r3 = src[k + 96];
      uint4 r4 = src[k + 128], r5 = src[k + 160], r6 = src[k + 192], r7 = src[k + 224];
      dst[k] = r0; dst[k + 32] = r1; dst[k + 64] = r2; dst[k + 96] = r3;
      dst[k + 128] = r4; dst[k + 160] = r5; dst[k + 192] = r6; dst[k + 224] = r7;
    }
    for (; k < n; k += 32) dst[k] = src[k];
  }
}
extern "C" __global__ void __launch_bounds__(512) kvrelay_copy(const Params p) {
  copy_chunks((const Seg*)p.segs, p.ids, p.staging, p.stage_block_bytes, p.n_seg, p.n_ids, p.to_staging);
}
extern "C" __global__ void __launch_bounds__(512) kvrelay_copy_ring(const RingParams p) {
  copy_chunks((const Seg*)p.segs, (const unsigned int*)p.ids, p.staging, p.stage_block_bytes, p.n_seg, p.n_ids, p.to_staging);
  // The last CTA to finish tells the host the ids slot may be reused: it publishes the launch's
  // generation to a pinned flag after every CTA is done reading the ids.
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    unsigned prev = atomicAdd((unsigned*)p.counter, 1u);
    if (prev == gridDim.x - 1) {
      *(volatile unsigned*)p.counter = 0u;
      __threadfence_system();
      *(volatile unsigned long long*)p.done = p.gen;
    }
  }
}
"#;

#[repr(C)]
#[derive(Clone, Copy)]
struct SegRow {
    base: u64,
    stride: u64,
    bytes: u64,
    stage_off: u64,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct RingParams {
    segs: u64,
    staging: u64,
    stage_block_bytes: u64,
    ids: u64,
    done: u64,
    counter: u64,
    gen: u64,
    n_seg: u32,
    n_ids: u32,
    to_staging: u32,
    pad: u32,
}

/// Block ids carried by one launch through the id ring.
///
/// Slot reuse is signalled by the kernel itself (the last CTA writes the launch's generation to a
/// pinned flag), so a call makes one driver call: the launch.
pub const RING_IDS_PER_LAUNCH: usize = 16384;
const RING_SLOTS: usize = 32;

#[repr(C)]
struct Params {
    segs: u64,
    staging: u64,
    stage_block_bytes: u64,
    n_seg: u32,
    n_ids: u32,
    to_staging: u32,
    pad: u32,
    ids: [u32; IDS_PER_LAUNCH],
}

fn check(r: sys::CUresult, what: &'static str) -> Result<(), CopyError> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CopyError::Cuda { call: what, code: r as i32 })
    }
}

/// Whether the CUDA driver library can be loaded on this machine.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the driver library; no CUDA call is made.
    unsafe { sys::is_culib_present() }
}

/// A device's primary context, retained for as long as this value (and engines, buffers and
/// streams made from it) live.
#[derive(Debug)]
pub struct CudaDevice {
    ctx: sys::CUcontext,
    dev: sys::CUdevice,
    ordinal: i32,
}

// SAFETY: a CUcontext handle may be used from any thread (each call makes it current first).
unsafe impl Send for CudaDevice {}
// SAFETY: as above; the handle itself is never mutated after creation.
unsafe impl Sync for CudaDevice {}

impl CudaDevice {
    /// Open device `ordinal`: [`CopyError::NoDriver`] without `libcuda`, [`CopyError::NoDevice`]
    /// when the driver reports no such device.
    pub fn open(ordinal: i32) -> Result<Arc<CudaDevice>, CopyError> {
        if !driver_present() {
            return Err(CopyError::NoDriver);
        }
        // SAFETY: the driver library is present; these are plain driver calls with valid
        // out-pointers.
        unsafe {
            check(sys::cuInit(0), "cuInit").map_err(|_| CopyError::NoDevice)?;
            let mut n = 0;
            check(sys::cuDeviceGetCount(&mut n), "cuDeviceGetCount")?;
            if ordinal < 0 || ordinal >= n {
                return Err(CopyError::NoDevice);
            }
            let mut dev = 0;
            check(sys::cuDeviceGet(&mut dev, ordinal), "cuDeviceGet")?;
            let mut ctx = std::ptr::null_mut();
            check(sys::cuDevicePrimaryCtxRetain(&mut ctx, dev), "cuDevicePrimaryCtxRetain")?;
            let d = CudaDevice { ctx, dev, ordinal };
            d.bind()?;
            Ok(Arc::new(d))
        }
    }

    /// Make the context current on the calling thread (cheap; every entry point does it).
    pub fn bind(&self) -> Result<(), CopyError> {
        // SAFETY: `ctx` is a retained primary context.
        check(unsafe { sys::cuCtxSetCurrent(self.ctx) }, "cuCtxSetCurrent")
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        // SAFETY: releases the reference retained in `open`, once.
        unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.dev) };
    }
}

/// Page-locked host memory mapped into the device's address space: allocated with
/// `cuMemHostAlloc(PORTABLE | DEVICEMAP)` (cacheable, so the CPU reads it at full speed), or
/// the caller's memory registered with `cuMemHostRegister`. Freed or unregistered exactly once,
/// on drop.
#[derive(Debug)]
pub struct PinnedBuffer {
    dev: Arc<CudaDevice>,
    host: *mut u8,
    device_ptr: u64,
    len: usize,
    registered: bool,
}

// SAFETY: the buffer is plain memory; the raw pointer is only a handle.
unsafe impl Send for PinnedBuffer {}
// SAFETY: shared access only hands out `&[u8]`; writes need `&mut`.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    /// Allocate `len` bytes.
    pub fn alloc(dev: &Arc<CudaDevice>, len: usize) -> Result<PinnedBuffer, CopyError> {
        dev.bind()?;
        let mut p = std::ptr::null_mut();
        let mut dp = 0;
        // SAFETY: plain driver calls with valid out-pointers; the context is current.
        unsafe {
            check(
                sys::cuMemHostAlloc(&mut p, len.max(1), sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP),
                "cuMemHostAlloc",
            )?;
            if let Err(e) = check(sys::cuMemHostGetDevicePointer_v2(&mut dp, p, 0), "cuMemHostGetDevicePointer") {
                sys::cuMemFreeHost(p);
                return Err(e);
            }
        }
        Ok(PinnedBuffer { dev: dev.clone(), host: p.cast(), device_ptr: dp, len, registered: false })
    }

    /// Register the caller's memory `[ptr, ptr + len)` (unregistered on drop).
    ///
    /// # Safety
    /// The memory must stay allocated, and not be registered elsewhere, until the buffer drops.
    pub unsafe fn register(dev: &Arc<CudaDevice>, ptr: *mut u8, len: usize) -> Result<PinnedBuffer, CopyError> {
        dev.bind()?;
        let mut dp = 0;
        // SAFETY: the caller vouches for the memory; plain driver calls.
        unsafe {
            check(
                sys::cuMemHostRegister_v2(
                    ptr.cast(),
                    len,
                    sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP,
                ),
                "cuMemHostRegister",
            )?;
            if let Err(e) =
                check(sys::cuMemHostGetDevicePointer_v2(&mut dp, ptr.cast(), 0), "cuMemHostGetDevicePointer")
            {
                sys::cuMemHostUnregister(ptr.cast());
                return Err(e);
            }
        }
        Ok(PinnedBuffer { dev: dev.clone(), host: ptr, device_ptr: dp, len, registered: true })
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The device-side address of the buffer.
    pub fn device_ptr(&self) -> u64 {
        self.device_ptr
    }
    /// The bytes (make sure the copies that write them have completed).
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `host` points to `len` bytes owned or registered by this buffer.
        unsafe { std::slice::from_raw_parts(self.host, self.len) }
    }
    /// The bytes, mutably (make sure no copy that reads them is in flight).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.host, self.len) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        let _ = self.dev.bind();
        // SAFETY: frees or unregisters exactly what `alloc` / `register` set up, once.
        unsafe {
            if self.registered {
                sys::cuMemHostUnregister(self.host.cast());
            } else {
                sys::cuMemFreeHost(self.host.cast());
            }
        }
    }
}

/// Device memory (for tests, benchmarks and small tables; runtimes bring their own pools).
#[derive(Debug)]
pub struct DeviceBuffer {
    dev: Arc<CudaDevice>,
    ptr: u64,
    len: usize,
}

impl DeviceBuffer {
    /// Allocate `len` bytes with `cuMemAlloc`.
    pub fn alloc(dev: &Arc<CudaDevice>, len: usize) -> Result<DeviceBuffer, CopyError> {
        dev.bind()?;
        let mut p = 0;
        // SAFETY: plain driver call with a valid out-pointer.
        check(unsafe { sys::cuMemAlloc_v2(&mut p, len.max(1)) }, "cuMemAlloc")?;
        Ok(DeviceBuffer { dev: dev.clone(), ptr: p, len })
    }
    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Copy `src` to offset `at` (synchronous).
    pub fn write(&self, at: usize, src: &[u8]) -> Result<(), CopyError> {
        if at.checked_add(src.len()).is_none_or(|e| e > self.len) {
            return Err(CopyError::OutOfBounds);
        }
        self.dev.bind()?;
        // SAFETY: the range is inside the allocation (checked); `src` is readable.
        check(unsafe { sys::cuMemcpyHtoD_v2(self.ptr + at as u64, src.as_ptr().cast(), src.len()) }, "cuMemcpyHtoD")
    }
    /// Copy from offset `at` into `dst` (synchronous).
    pub fn read(&self, at: usize, dst: &mut [u8]) -> Result<(), CopyError> {
        if at.checked_add(dst.len()).is_none_or(|e| e > self.len) {
            return Err(CopyError::OutOfBounds);
        }
        self.dev.bind()?;
        // SAFETY: the range is inside the allocation (checked); `dst` is writable.
        check(unsafe { sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), self.ptr + at as u64, dst.len()) }, "cuMemcpyDtoH")
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let _ = self.dev.bind();
        // SAFETY: frees the allocation made in `alloc`, once.
        unsafe { sys::cuMemFree_v2(self.ptr) };
    }
}

/// A CUDA stream (non-blocking), for callers that do not bring their own.
#[derive(Debug)]
pub struct CudaStream {
    dev: Arc<CudaDevice>,
    raw: sys::CUstream,
}

// SAFETY: streams may be used from any thread.
unsafe impl Send for CudaStream {}
// SAFETY: as above.
unsafe impl Sync for CudaStream {}

impl CudaStream {
    /// Create a stream.
    pub fn new(dev: &Arc<CudaDevice>) -> Result<CudaStream, CopyError> {
        dev.bind()?;
        let mut s = std::ptr::null_mut();
        // SAFETY: plain driver call with a valid out-pointer.
        let r = unsafe { sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) };
        check(r, "cuStreamCreate")?;
        Ok(CudaStream { dev: dev.clone(), raw: s })
    }
    /// The raw handle (what a C++ caller would pass).
    pub fn raw(&self) -> sys::CUstream {
        self.raw
    }
    /// Wait for everything enqueued so far.
    pub fn synchronize(&self) -> Result<(), CopyError> {
        self.dev.bind()?;
        // SAFETY: a live stream.
        check(unsafe { sys::cuStreamSynchronize(self.raw) }, "cuStreamSynchronize")
    }
}

impl Drop for CudaStream {
    fn drop(&mut self) {
        let _ = self.dev.bind();
        // SAFETY: destroys the stream created in `new`, once.
        unsafe { sys::cuStreamDestroy_v2(self.raw) };
    }
}

/// A CUDA event with timing enabled.
#[derive(Debug)]
pub struct CudaEvent {
    dev: Arc<CudaDevice>,
    raw: sys::CUevent,
}

// SAFETY: events may be used from any thread.
unsafe impl Send for CudaEvent {}
// SAFETY: as above.
unsafe impl Sync for CudaEvent {}

impl CudaEvent {
    /// Create an event (timing enabled).
    pub fn new(dev: &Arc<CudaDevice>) -> Result<CudaEvent, CopyError> {
        dev.bind()?;
        let mut e = std::ptr::null_mut();
        // SAFETY: plain driver call with a valid out-pointer.
        check(unsafe { sys::cuEventCreate(&mut e, sys::CUevent_flags::CU_EVENT_DEFAULT as u32) }, "cuEventCreate")?;
        Ok(CudaEvent { dev: dev.clone(), raw: e })
    }
    /// The raw handle.
    pub fn raw(&self) -> sys::CUevent {
        self.raw
    }
    /// Record on a stream.
    pub fn record(&self, stream: &CudaStream) -> Result<(), CopyError> {
        // SAFETY: a live event and a live stream of this library.
        unsafe { self.record_raw(stream.raw) }
    }

    /// Record on a raw stream.
    ///
    /// # Safety
    /// `stream` must be null (the legacy default stream) or a live stream of this context.
    pub unsafe fn record_raw(&self, stream: sys::CUstream) -> Result<(), CopyError> {
        // SAFETY: a live event; the stream per the contract.
        check(unsafe { sys::cuEventRecord(self.raw, stream) }, "cuEventRecord")
    }
    /// Wait for it.
    pub fn synchronize(&self) -> Result<(), CopyError> {
        self.dev.bind()?;
        // SAFETY: a live event.
        check(unsafe { sys::cuEventSynchronize(self.raw) }, "cuEventSynchronize")
    }
    /// Milliseconds between `start` and this event (both recorded and complete).
    pub fn elapsed_ms(&self, start: &CudaEvent) -> Result<f32, CopyError> {
        let mut ms = 0.0;
        // SAFETY: live events, valid out-pointer.
        check(unsafe { sys::cuEventElapsedTime_v2(&mut ms, start.raw, self.raw) }, "cuEventElapsedTime")?;
        Ok(ms)
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        let _ = self.dev.bind();
        // SAFETY: destroys the event created in `new`, once.
        unsafe { sys::cuEventDestroy_v2(self.raw) };
    }
}

/// How the engine moves bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyMethod {
    /// Zero-copy kernel (NVRTC, once per engine).
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
    module: sys::CUmodule,
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
    next_gen: u64,
    ring_next: usize,
    scratch: Option<DeviceBuffer>,
    staged: Option<Staged>,
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
        dev.bind()?;
        let mut e = CudaEngine {
            dev: dev.clone(),
            checker: Checker::new(&layout),
            opts,
            module: std::ptr::null_mut(),
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
            next_gen: 0,
            ring_next: 0,
            scratch: None,
            staged: None,
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
        // SAFETY: only probes for the NVRTC library.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(CopyError::Unsupported("NVRTC library not found"));
        }
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(
            KERNEL,
            cudarc::nvrtc::CompileOptions { arch: Some("compute_90"), ..Default::default() },
        )
        .or_else(|_| cudarc::nvrtc::compile_ptx(KERNEL))
        .map_err(|_| CopyError::Unsupported("NVRTC could not compile the copy kernel"))?;
        let src = CString::new(ptx.to_src()).map_err(|_| CopyError::Unsupported("PTX with NUL"))?;
        let name = CString::new("kvrelay_copy").expect("no NUL");
        // SAFETY: loads the PTX just compiled into the current context and looks the kernel up.
        unsafe {
            check(sys::cuModuleLoadData(&mut self.module, src.as_ptr().cast()), "cuModuleLoadData")?;
            check(sys::cuModuleGetFunction(&mut self.func, self.module, name.as_ptr()), "cuModuleGetFunction")?;
            let ring_name = CString::new("kvrelay_copy_ring").expect("no NUL");
            check(
                sys::cuModuleGetFunction(&mut self.ring_func, self.module, ring_name.as_ptr()),
                "cuModuleGetFunction",
            )?;
        }
        if self.opts.ids != IdTransport::Params {
            self.ring = Some(PinnedBuffer::alloc(&self.dev, RING_SLOTS * RING_IDS_PER_LAUNCH * 4)?);
            let mut done = PinnedBuffer::alloc(&self.dev, RING_SLOTS * 8)?;
            done.as_mut_slice().fill(0);
            self.ring_done = Some(done);
            let counters = DeviceBuffer::alloc(&self.dev, RING_SLOTS * 4)?;
            counters.write(0, &[0u8; RING_SLOTS * 4])?;
            self.ring_counters = Some(counters);
            self.ring_gen = vec![0; RING_SLOTS];
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
        unsafe { self.gather_raw(ids, staging, stream.raw, done) }
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
        done: Option<&CudaEvent>,
    ) -> Result<(), CopyError> {
        self.checker.check(&self.layout, ids, staging.len() as u64, false)?;
        // SAFETY: forwarded contract.
        unsafe { self.enqueue(ids, staging, stream, true)? };
        if let Some(e) = done {
            // SAFETY: forwarded contract.
            unsafe { e.record_raw(stream)? };
        }
        Ok(())
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
        unsafe { self.scatter_raw(staging, ids, stream.raw, done) }
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
        done: Option<&CudaEvent>,
    ) -> Result<(), CopyError> {
        self.checker.check(&self.layout, ids, staging.len() as u64, true)?;
        // SAFETY: forwarded contract.
        unsafe { self.enqueue(ids, staging, stream, false)? };
        if let Some(e) = done {
            // SAFETY: forwarded contract.
            unsafe { e.record_raw(stream)? };
        }
        Ok(())
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
        self.dev.bind()?;
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

impl CudaEngine {
    /// The staged method, pipelined over the two scratch halves (see [`CopyMethod::Staged`]).
    ///
    /// # Safety
    /// As [`CudaEngine::launch_kernel`]; `staging` holds at least this call's blocks.
    unsafe fn enqueue_staged(
        &mut self,
        ids: &[u32],
        staging: &PinnedBuffer,
        stream: sys::CUstream,
        to_staging: bool,
    ) -> Result<(), CopyError> {
        let scratch = self.scratch.as_ref().expect("allocated at setup");
        let sbb = self.layout.stage_block_bytes() as usize;
        let half_bytes = scratch.len() / 2;
        let per = half_bytes / sbb;
        let base = scratch.ptr();
        let mut st = self.staged.take().expect("set up with the method");
        let copy = st.stream.raw();
        let result = (|| -> Result<(), CopyError> {
            // SAFETY: live events and streams of this context; the caller's stream
            // per the contract; every copy stays inside the scratch half and the staging range
            // of its piece; a half is reused only after the event that frees it.
            unsafe {
                // copies start after everything enqueued on the caller's stream before the call
                check(sys::cuEventRecord(st.entry, stream), "cuEventRecord")?;
                check(sys::cuStreamWaitEvent(copy, st.entry, 0), "cuStreamWaitEvent")?;
                for (k, part) in ids.chunks(per).enumerate() {
                    let h = k % 2;
                    let half = base + (h * half_bytes) as u64;
                    let host = staging.as_slice()[k * per * sbb..].as_ptr();
                    let bytes = part.len() * sbb;
                    if to_staging {
                        if st.free_recorded[h] {
                            check(sys::cuStreamWaitEvent(stream, st.free[h], 0), "cuStreamWaitEvent")?;
                        }
                        self.launch_kernel(part, half, true, stream)?;
                        check(sys::cuEventRecord(st.ready[h], stream), "cuEventRecord")?;
                        check(sys::cuStreamWaitEvent(copy, st.ready[h], 0), "cuStreamWaitEvent")?;
                        check(sys::cuMemcpyDtoHAsync_v2(host as *mut c_void, half, bytes, copy), "cuMemcpyDtoHAsync")?;
                        check(sys::cuEventRecord(st.free[h], copy), "cuEventRecord")?;
                    } else {
                        if st.free_recorded[h] {
                            check(sys::cuStreamWaitEvent(copy, st.free[h], 0), "cuStreamWaitEvent")?;
                        }
                        check(
                            sys::cuMemcpyHtoDAsync_v2(half, host as *const c_void, bytes, copy),
                            "cuMemcpyHtoDAsync",
                        )?;
                        check(sys::cuEventRecord(st.ready[h], copy), "cuEventRecord")?;
                        check(sys::cuStreamWaitEvent(stream, st.ready[h], 0), "cuStreamWaitEvent")?;
                        self.launch_kernel(part, half, false, stream)?;
                        check(sys::cuEventRecord(st.free[h], stream), "cuEventRecord")?;
                    }
                    st.free_recorded[h] = true;
                }
                // the caller's stream sees the call complete only after the last copies
                for h in 0..2 {
                    if st.free_recorded[h] {
                        check(sys::cuStreamWaitEvent(stream, st.free[h], 0), "cuStreamWaitEvent")?;
                    }
                }
            }
            Ok(())
        })();
        self.staged = Some(st);
        result
    }

    /// Launch the copy kernel for `ids` against staging at device address `staging_base`.
    ///
    /// # Safety
    /// `stream` as in [`CudaEngine::gather_raw`]; ids checked; `staging_base` addresses at least
    /// `ids.len()` staged blocks.
    unsafe fn launch_kernel(
        &mut self,
        ids: &[u32],
        staging_base: u64,
        to_staging: bool,
        stream: sys::CUstream,
    ) -> Result<(), CopyError> {
        if self.opts.ids == IdTransport::Ring || (self.opts.ids == IdTransport::Auto && ids.len() > IDS_PER_LAUNCH) {
            let sbb = self.layout.stage_block_bytes();
            for (k, part) in ids.chunks(RING_IDS_PER_LAUNCH).enumerate() {
                let slot = self.ring_next;
                self.ring_next = (slot + 1) % RING_SLOTS;
                // The slot's previous launch must be done reading it (normally long since).
                self.wait_slot(slot);
                let ring = self.ring.as_mut().expect("allocated at setup");
                let at = slot * RING_IDS_PER_LAUNCH * 4;
                let dst = &mut ring.as_mut_slice()[at..at + part.len() * 4];
                for (d, id) in dst.chunks_exact_mut(4).zip(part) {
                    d.copy_from_slice(&id.to_ne_bytes());
                }
                self.next_gen += 1;
                self.ring_gen[slot] = self.next_gen;
                let done = self.ring_done.as_ref().expect("allocated at setup").device_ptr() + slot as u64 * 8;
                let counter = self.ring_counters.as_ref().expect("allocated at setup").ptr() + slot as u64 * 4;
                let mut p = RingParams {
                    segs: self.params.segs,
                    staging: staging_base + (k * RING_IDS_PER_LAUNCH) as u64 * sbb,
                    stage_block_bytes: sbb,
                    ids: ring.device_ptr() + at as u64,
                    done,
                    counter,
                    gen: self.next_gen,
                    n_seg: self.params.n_seg,
                    n_ids: part.len() as u32,
                    to_staging: to_staging as u32,
                    pad: 0,
                };
                let mut args = [(&mut p as *mut RingParams).cast::<c_void>()];
                // SAFETY: `ring_func` takes one `RingParams` (same layout as the CUDA
                // struct); every address was checked; the ids slot stays untouched until the
                // kernel publishes this generation in the slot's flag; the stream is the
                // caller's per the contract.
                let r = unsafe {
                    sys::cuLaunchKernel(
                        self.ring_func,
                        self.opts.ctas,
                        1,
                        1,
                        self.opts.threads,
                        1,
                        1,
                        0,
                        stream,
                        args.as_mut_ptr(),
                        std::ptr::null_mut(),
                    )
                };
                if let Err(e) = check(r, "cuLaunchKernel") {
                    self.ring_gen[slot] = 0; // nothing will signal this generation
                    return Err(e);
                }
            }
        } else {
            let sbb = self.layout.stage_block_bytes();
            for (k, part) in ids.chunks(IDS_PER_LAUNCH).enumerate() {
                let p = &mut *self.params;
                p.staging = staging_base + (k * IDS_PER_LAUNCH) as u64 * sbb;
                p.n_ids = part.len() as u32;
                p.to_staging = to_staging as u32;
                p.ids[..part.len()].copy_from_slice(part);
                let mut args = [(p as *mut Params).cast::<c_void>()];
                // SAFETY: `func` is the loaded kernel whose only parameter is a `Params`
                // (same layout as the CUDA struct); the driver copies the parameter block at
                // launch, so reusing `params` for the next launch is fine. Every address in
                // it was checked against the layout and the staging size; the stream is the
                // caller's per the contract.
                let r = unsafe {
                    sys::cuLaunchKernel(
                        self.func,
                        self.opts.ctas,
                        1,
                        1,
                        self.opts.threads,
                        1,
                        1,
                        0,
                        stream,
                        args.as_mut_ptr(),
                        std::ptr::null_mut(),
                    )
                };
                check(r, "cuLaunchKernel")?;
            }
        }
        Ok(())
    }

    /// Wait until the last launch that used `slot` has finished (its generation is in the
    /// slot's flag). Spins with yields for up to a millisecond (with 32 slots a wait only
    /// happens when the caller enqueues faster than the GPU drains for a long time), then waits
    /// for the context, which also ends the wait if the context has failed.
    fn wait_slot(&self, slot: usize) {
        let want = self.ring_gen[slot];
        if want == 0 {
            return;
        }
        let flags = self.ring_done.as_ref().expect("allocated at setup");
        let p = flags.as_slice()[slot * 8..].as_ptr().cast::<u64>();
        let started = std::time::Instant::now();
        loop {
            // SAFETY: `p` points into the pinned flag array (8-byte aligned allocation, slot*8
            // offset); the GPU writes it, so it is read volatile.
            let seen = unsafe { std::ptr::read_volatile(p) };
            if seen >= want {
                std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
                return;
            }
            if started.elapsed() > std::time::Duration::from_millis(1) {
                // Slow path: wait for the whole context. Either every launch completed (the
                // flag is set now), or the context hit a sticky error (a faulting kernel), in
                // which case nothing will ever read the slot again and waiting longer would hang.
                let _ = self.dev.bind();
                // SAFETY: plain driver call on the current, retained context.
                let r = unsafe { sys::cuCtxSynchronize() };
                // SAFETY: as above.
                let seen = unsafe { std::ptr::read_volatile(p) };
                if r != sys::CUresult::CUDA_SUCCESS || seen >= want {
                    std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
                    return;
                }
            }
            std::thread::yield_now();
        }
    }
}

impl Drop for CudaEngine {
    fn drop(&mut self) {
        let _ = self.dev.bind();
        // The kernels still running may read the id ring and write the flags: wait for them.
        for slot in 0..self.ring_gen.len() {
            self.wait_slot(slot);
        }
        if !self.module.is_null() {
            // SAFETY: unloads the module loaded in `setup_kernel`, once.
            unsafe { sys::cuModuleUnload(self.module) };
        }
    }
}
