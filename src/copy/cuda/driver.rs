//! The CUDA driver wrappers: device and primary context, pinned and device memory, streams,
//! events. Each owns its resource and frees it once.

use std::sync::{Arc, Mutex};

use cudarc::driver::sys;

use crate::copy::CopyError;

pub(super) fn check(r: sys::CUresult, what: &'static str) -> Result<(), CopyError> {
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
    pub(super) ordinal: i32,
    /// Its streaming multiprocessors.
    sms: u32,
    /// The copy kernels, loaded into the context by the first engine that needs them and kept
    /// until this value drops: every engine of the device shares them.
    kernels: Mutex<Option<Kernels>>,
}

/// The copy kernels' module in a device's primary context and the functions engines launch.
/// Loading JIT-compiles the PTX for the device (milliseconds), so it happens once per
/// [`CudaDevice`], not once per engine.
#[derive(Clone, Copy, Debug)]
pub(super) struct Kernels {
    pub(super) module: sys::CUmodule,
    /// `kvrelay_copy`: ids in the parameter block.
    pub(super) copy: sys::CUfunction,
    /// `kvrelay_copy_ring`: ids in the pinned ring.
    pub(super) ring: sys::CUfunction,
    /// `kvrelay_sum`: block checksums.
    pub(super) sum: sys::CUfunction,
    /// `kvrelay_copy_sum`: copy from another pool and sum on the way.
    pub(super) copy_sum: sys::CUfunction,
}

// SAFETY: a CUcontext handle may be used from any thread (each call makes it current first).
unsafe impl Send for CudaDevice {}
// SAFETY: as above; the context handle is never mutated after creation, and the kernels'
// module and function handles (driver handles usable from any thread) sit behind a Mutex.
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
            let mut sms = 0;
            check(
                sys::cuDeviceGetAttribute(
                    &mut sms,
                    sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                    dev,
                ),
                "cuDeviceGetAttribute",
            )?;
            let d = CudaDevice { ctx, dev, ordinal, sms: sms.max(1) as u32, kernels: Mutex::new(None) };
            let _ctx = d.bind()?;
            Ok(Arc::new(d))
        }
    }

    /// Make the device's primary context current on the calling thread until the returned
    /// guard drops, which puts back whatever context the caller had (none included): kvrelay
    /// never leaves a multi-GPU runtime's thread on another context. When the context is already
    /// current (the usual case) this costs one `cuCtxGetCurrent` and switches nothing.
    pub fn bind(&self) -> Result<CtxGuard, CopyError> {
        let mut prev: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: plain query into a local.
        check(unsafe { sys::cuCtxGetCurrent(&mut prev) }, "cuCtxGetCurrent")?;
        if prev == self.ctx {
            return Ok(CtxGuard { restore: None });
        }
        // SAFETY: `ctx` is a retained primary context.
        check(unsafe { sys::cuCtxSetCurrent(self.ctx) }, "cuCtxSetCurrent")?;
        Ok(CtxGuard { restore: Some(prev) })
    }

    /// Its streaming multiprocessors (what kernels that read device memory size their grid by).
    pub fn multiprocessors(&self) -> u32 {
        self.sms
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// Let kernels and copies of this device's context reach `peer`'s memory directly
    /// (`cuCtxEnablePeerAccess`; NVLink where the GPUs have it). `Ok(true)` once it is on (or
    /// was, or `peer` is this device); `Ok(false)` when the driver says this device cannot reach
    /// the peer's memory directly (copies between them then go through the host). CUDA IPC
    /// mappings turn it on by themselves (`CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`); this is for
    /// memory of one process on two GPUs. Cost: two or three driver calls; it lasts as long as
    /// both contexts.
    pub fn enable_peer_access(&self, peer: &CudaDevice) -> Result<bool, CopyError> {
        if peer.dev == self.dev {
            return Ok(true);
        }
        let mut can = 0;
        // SAFETY: a plain query into a local.
        check(unsafe { sys::cuDeviceCanAccessPeer(&mut can, self.dev, peer.dev) }, "cuDeviceCanAccessPeer")?;
        if can == 0 {
            return Ok(false);
        }
        let _ctx = self.bind()?;
        // SAFETY: `peer.ctx` is a retained primary context; flags must be 0.
        match unsafe { sys::cuCtxEnablePeerAccess(peer.ctx, 0) } {
            sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(true),
            r => check(r, "cuCtxEnablePeerAccess").map(|()| true),
        }
    }

    /// The copy kernels, loaded by `load` (with this device's context current) the first time
    /// they are asked for; a failed load is not kept, so the next engine tries again.
    pub(super) fn kernels(&self, load: impl FnOnce() -> Result<Kernels, CopyError>) -> Result<Kernels, CopyError> {
        let mut k = self.kernels.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(k) = *k {
            return Ok(k);
        }
        let _ctx = self.bind()?;
        let loaded = load()?;
        *k = Some(loaded);
        Ok(loaded)
    }
}

/// Restores the calling thread's previous CUDA context on drop (see [`CudaDevice::bind`]).
#[must_use = "the context is restored when the guard drops"]
pub struct CtxGuard {
    restore: Option<sys::CUcontext>,
}

impl Drop for CtxGuard {
    fn drop(&mut self) {
        if let Some(prev) = self.restore {
            // SAFETY: `prev` was current on this thread when the guard was made (or NULL: no
            // context); setting it back is what the caller had.
            unsafe { sys::cuCtxSetCurrent(prev) };
        }
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        if let Some(k) = self.kernels.get_mut().unwrap_or_else(|e| e.into_inner()).take() {
            if let Ok(_ctx) = self.bind() {
                // SAFETY: the module was loaded into this context by `kernels`, once. Every
                // engine that launches from it holds an `Arc` of this device, so none is left;
                // a freed engine's launches have finished (`kvrelay_cuda_engine_free`'s
                // contract: the work it enqueued on the caller's streams is complete).
                unsafe { sys::cuModuleUnload(k.module) };
            }
        }
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
        let _ctx = dev.bind()?;
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
        let _ctx = dev.bind()?;
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
        let _ctx = self.dev.bind();
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

/// Copy `src` to offset `at` of the `len` bytes of device memory at `ptr` (synchronous).
fn write_device(dev: &CudaDevice, ptr: u64, len: usize, at: usize, src: &[u8]) -> Result<(), CopyError> {
    if at.checked_add(src.len()).is_none_or(|e| e > len) {
        return Err(CopyError::OutOfBounds);
    }
    let _ctx = dev.bind()?;
    // SAFETY: the range is inside the caller's device memory (checked against `len`); `src`
    // is readable.
    check(unsafe { sys::cuMemcpyHtoD_v2(ptr + at as u64, src.as_ptr().cast(), src.len()) }, "cuMemcpyHtoD")
}

impl DeviceBuffer {
    /// Allocate `len` bytes with `cuMemAlloc`.
    pub fn alloc(dev: &Arc<CudaDevice>, len: usize) -> Result<DeviceBuffer, CopyError> {
        let _ctx = dev.bind()?;
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
        write_device(&self.dev, self.ptr, self.len, at, src)
    }
    /// Copy from offset `at` into `dst` (synchronous).
    pub fn read(&self, at: usize, dst: &mut [u8]) -> Result<(), CopyError> {
        if at.checked_add(dst.len()).is_none_or(|e| e > self.len) {
            return Err(CopyError::OutOfBounds);
        }
        let _ctx = self.dev.bind()?;
        // SAFETY: the range is inside the allocation (checked); `dst` is writable.
        check(unsafe { sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), self.ptr + at as u64, dst.len()) }, "cuMemcpyDtoH")
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let _ctx = self.dev.bind();
        // SAFETY: frees the allocation made in `alloc`, once.
        unsafe { sys::cuMemFree_v2(self.ptr) };
    }
}

/// Device memory of the virtual memory API, as VMM-based and expandable allocators hand out:
/// one reserved address range backed by several allocations side by side (`cuMemCreate`,
/// `cuMemMap`), readable and writable by this device's context. With `shareable` each
/// allocation is created with the POSIX file-descriptor handle type, which the agent's CUDA IPC
/// transport needs to export it; without, as an allocator that does not ask for it (the
/// transport then refuses the pool). Unmapped and released when dropped.
#[derive(Debug)]
pub struct VmmBuffer {
    dev: Arc<CudaDevice>,
    ptr: u64,
    len: usize,
    chunk: usize,
}

// SAFETY: device memory is used through addresses from any thread.
unsafe impl Send for VmmBuffer {}
// SAFETY: as above; the struct itself is read-only after `alloc`.
unsafe impl Sync for VmmBuffer {}

impl VmmBuffer {
    /// At least `len` bytes in `chunks` allocations of equal size (each rounded up to the
    /// allocation granularity, 2 MiB on current GPUs), mapped side by side as
    /// [`CudaDevice::vmm_map`] maps imported ones. Cost: one create per allocation, then a
    /// reservation and one map per allocation.
    pub fn alloc(dev: &Arc<CudaDevice>, len: usize, chunks: usize, shareable: bool) -> Result<VmmBuffer, CopyError> {
        if chunks == 0 || len == 0 {
            return Err(CopyError::InvalidOptions);
        }
        let _ctx = dev.bind()?;
        // SAFETY: a plain C struct; zero is "none" for every field not set below.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location = device_location(dev.ordinal);
        if shareable {
            prop.requestedHandleTypes = POSIX_FD;
        }
        let mut gran = 0usize;
        let min = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
        // SAFETY: the driver writes one usize; `prop` is initialised.
        check(unsafe { sys::cuMemGetAllocationGranularity(&mut gran, &prop, min) }, "cuMemGetAllocationGranularity")?;
        let chunk = len.div_ceil(chunks).next_multiple_of(gran.max(1));
        chunk.checked_mul(chunks).ok_or(CopyError::InvalidOptions)?;
        // each allocation's handle is released when `handles` drops (after the map, which
        // holds the memory, or on an error)
        let mut handles = Vec::with_capacity(chunks);
        for _ in 0..chunks {
            let mut h: sys::CUmemGenericAllocationHandle = 0;
            // SAFETY: creates one allocation of a granularity multiple into a local.
            check(unsafe { sys::cuMemCreate(&mut h, chunk, &prop, 0) }, "cuMemCreate")?;
            handles.push(VmmHandle { h });
        }
        let sizes = vec![chunk as u64; chunks];
        // SAFETY: every handle is an allocation of `chunk` bytes, created just above.
        let ptr = unsafe { dev.vmm_map(&handles, &sizes, true) }?;
        Ok(VmmBuffer { dev: dev.clone(), ptr, len: chunk * chunks, chunk })
    }
    /// The device address of the range.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    /// Size in bytes (all allocations).
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether it is empty (never, once allocated).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Bytes of each allocation.
    pub fn chunk_bytes(&self) -> usize {
        self.chunk
    }
    /// Copy `src` to offset `at` (synchronous).
    pub fn write(&self, at: usize, src: &[u8]) -> Result<(), CopyError> {
        write_device(&self.dev, self.ptr, self.len, at, src)
    }
}

impl Drop for VmmBuffer {
    fn drop(&mut self) {
        // SAFETY: the range `alloc` mapped with `vmm_map`, unmapped once; nothing uses it any
        // more (the owner drops it).
        let _ = unsafe { self.dev.vmm_unmap(self.ptr, self.len as u64) };
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
        let _ctx = dev.bind()?;
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
        let _ctx = self.dev.bind()?;
        // SAFETY: a live stream.
        check(unsafe { sys::cuStreamSynchronize(self.raw) }, "cuStreamSynchronize")
    }
}

impl Drop for CudaStream {
    fn drop(&mut self) {
        let _ctx = self.dev.bind();
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
        let _ctx = dev.bind()?;
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
        let _ctx = self.dev.bind()?;
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
        let _ctx = self.dev.bind();
        // SAFETY: destroys the event created in `new`, once.
        unsafe { sys::cuEventDestroy_v2(self.raw) };
    }
}

/// A device allocation exported for CUDA IPC: the handle another process of this host opens,
/// and the allocation it names (its base and size in this process).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpcExport {
    /// The driver's opaque handle (`CUipcMemHandle`).
    pub handle: [u8; 64],
    /// The allocation's base address here.
    pub base: u64,
    /// Its size in bytes.
    pub size: u64,
}

impl CudaDevice {
    /// Export the allocation that holds device address `ptr` for CUDA IPC. Works for memory
    /// from `cuMemAlloc`/`cudaMalloc` (what PyTorch's and most runtimes' caching allocators
    /// hand out); memory from the virtual memory API (`cuMemCreate`) or a stream-ordered pool
    /// (`cudaMallocAsync`) cannot be exported this way and gives an error. Cost: three or four
    /// driver calls; call once per allocation.
    pub fn ipc_export(&self, ptr: u64) -> Result<IpcExport, CopyError> {
        let (base, size) = self.address_range(ptr)?;
        let _ctx = self.bind()?;
        // SAFETY: a plain query into a local; `base` is only looked up, never dereferenced.
        unsafe {
            let mut h = std::mem::MaybeUninit::<sys::CUipcMemHandle>::zeroed();
            check(sys::cuIpcGetMemHandle(h.as_mut_ptr(), base), "cuIpcGetMemHandle")?;
            let h = h.assume_init();
            let mut handle = [0u8; 64];
            for (o, &c) in handle.iter_mut().zip(h.reserved.iter()) {
                *o = c as u8;
            }
            Ok(IpcExport { handle, base, size })
        }
    }

    /// The allocation (or mapping) that holds device address `ptr` in this context: its base
    /// and size (`cuMemGetAddressRange`), an error for an address the driver does not know.
    /// Cost: one driver call; `ptr` is only looked up, never dereferenced.
    pub fn address_range(&self, ptr: u64) -> Result<(u64, u64), CopyError> {
        let _ctx = self.bind()?;
        let (mut base, mut size) = (0u64, 0usize);
        // SAFETY: a plain query into locals.
        check(unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }, "cuMemGetAddressRange")?;
        Ok((base, size as u64))
    }

    /// Map an allocation another process of this host exported ([`CudaDevice::ipc_export`])
    /// into this device's context; its base address here. Until [`CudaDevice::ipc_close`],
    /// the exporting process's memory is readable and writable through it.
    ///
    /// # Safety
    /// `handle` came from `ipc_export` in another live process (the driver checks the rest and
    /// answers an error for a handle it does not know).
    pub unsafe fn ipc_open(&self, handle: &[u8; 64]) -> Result<u64, CopyError> {
        let _ctx = self.bind()?;
        let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
        for (o, &c) in h.reserved.iter_mut().zip(handle.iter()) {
            *o = c as std::ffi::c_char;
        }
        let mut ptr = 0u64;
        check(
            // SAFETY: out-pointer to a local; the handle is plain bytes the driver validates.
            unsafe {
                sys::cuIpcOpenMemHandle_v2(&mut ptr, h, sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32)
            },
            "cuIpcOpenMemHandle",
        )?;
        Ok(ptr)
    }

    /// Unmap what [`CudaDevice::ipc_open`] mapped.
    ///
    /// # Safety
    /// `ptr` came from `ipc_open` on this device and no copy uses it any more.
    pub unsafe fn ipc_close(&self, ptr: u64) -> Result<(), CopyError> {
        let _ctx = self.bind()?;
        // SAFETY: forwarded contract.
        check(unsafe { sys::cuIpcCloseMemHandle(ptr) }, "cuIpcCloseMemHandle")
    }
}

/// One physical allocation of the virtual memory API (`cuMemCreate`) as an agent exports it:
/// where it is mapped in the exporting process, its size, and a POSIX file descriptor for it
/// (`cuMemExportToShareableHandle`) that another process imports.
#[derive(Debug)]
pub struct VmmChunk {
    /// Where it is mapped here.
    pub base: u64,
    /// Its size in bytes (a multiple of the allocation granularity).
    pub size: u64,
    /// The shareable handle.
    pub fd: std::os::fd::OwnedFd,
}

/// An allocation imported with [`CudaDevice::vmm_import`]; released when dropped (memory
/// mapped from it stays until unmapped).
#[derive(Debug)]
pub struct VmmHandle {
    h: sys::CUmemGenericAllocationHandle,
}

impl Drop for VmmHandle {
    fn drop(&mut self) {
        // SAFETY: the import's reference, released once; mappings hold their own.
        let _ = unsafe { sys::cuMemRelease(self.h) };
    }
}

/// Device `ordinal` as a location of the virtual memory API.
fn device_location(ordinal: i32) -> sys::CUmemLocation {
    sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: ordinal }
}

const POSIX_FD: sys::CUmemAllocationHandleType =
    sys::CUmemAllocationHandleType_enum::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;

impl CudaDevice {
    /// Export the physical allocations of the virtual memory API mapped over `[ptr, end)`, in
    /// address order, each as a POSIX file descriptor: the first is the one `ptr` lies in,
    /// each next one starts where the last ended (`cuMemGetAddressRange` gives each mapped
    /// allocation's bounds). Fails for memory not of that API (`cuMemAlloc`: use
    /// [`CudaDevice::ipc_export`]; a stream-ordered pool: neither), for an allocation created
    /// without the POSIX file-descriptor handle type ([`CopyError::Unsupported`]), and where
    /// the range has an unmapped gap. Cost: four driver calls per allocation; call once.
    pub fn vmm_export(&self, ptr: u64, end: u64) -> Result<Vec<VmmChunk>, CopyError> {
        let _ctx = self.bind()?;
        let mut out = Vec::new();
        let mut at = ptr;
        while at < end {
            let (mut base, mut size) = (0u64, 0usize);
            let mut h: sys::CUmemGenericAllocationHandle = 0;
            // SAFETY: queries into locals; `at` is only looked up, never dereferenced.
            unsafe {
                check(sys::cuMemGetAddressRange_v2(&mut base, &mut size, at), "cuMemGetAddressRange")?;
                check(
                    sys::cuMemRetainAllocationHandle(&mut h, at as *mut std::ffi::c_void),
                    "cuMemRetainAllocationHandle",
                )?;
            }
            let exported = (|| {
                let mut prop = std::mem::MaybeUninit::<sys::CUmemAllocationProp>::zeroed();
                // SAFETY: `h` is a live handle (retained above); `prop` is written by the driver.
                let prop = unsafe {
                    check(
                        sys::cuMemGetAllocationPropertiesFromHandle(prop.as_mut_ptr(), h),
                        "cuMemGetAllocationPropertiesFromHandle",
                    )?;
                    prop.assume_init()
                };
                if prop.requestedHandleTypes.0 & POSIX_FD.0 == 0 {
                    return Err(CopyError::Unsupported(
                        "memory of the virtual memory API created without CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR cannot be exported",
                    ));
                }
                let mut fd: std::ffi::c_int = -1;
                let out = (&mut fd as *mut std::ffi::c_int).cast();
                // SAFETY: `h` is live and allows POSIX handles; the driver writes an int.
                let r = unsafe { sys::cuMemExportToShareableHandle(out, h, POSIX_FD, 0) };
                check(r, "cuMemExportToShareableHandle")?;
                // SAFETY: a new descriptor the driver just opened for us, owned from here.
                Ok(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) })
            })();
            // SAFETY: the reference `cuMemRetainAllocationHandle` took (the mapping keeps its own).
            let _ = unsafe { sys::cuMemRelease(h) };
            let fd = exported?;
            let size = size as u64;
            if size == 0 || base > at || base.checked_add(size).is_none_or(|e| e <= at) {
                return Err(CopyError::Unsupported("an allocation's bounds do not hold its own address"));
            }
            out.push(VmmChunk { base, size, fd });
            at = base + size;
        }
        Ok(out)
    }

    /// Import one allocation another process exported with [`CudaDevice::vmm_export`] (the
    /// descriptor can be closed once this returns: the handle holds the memory).
    ///
    /// # Safety
    /// `fd` came from `vmm_export` in a live process of this host (the driver refuses other
    /// files).
    pub unsafe fn vmm_import(&self, fd: std::os::fd::BorrowedFd<'_>) -> Result<VmmHandle, CopyError> {
        let _ctx = self.bind()?;
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
        let os_handle = raw as usize as *mut std::ffi::c_void;
        // SAFETY: the driver reads the descriptor's number (passed as the pointer's value, as
        // the API asks) and writes a handle into a local.
        let r = unsafe { sys::cuMemImportFromShareableHandle(&mut h, os_handle, POSIX_FD) };
        check(r, "cuMemImportFromShareableHandle")?;
        Ok(VmmHandle { h })
    }

    /// Map allocations side by side into a new address range of this device's context,
    /// `sizes[i]` bytes of `handles[i]` at the sum of the sizes before it; the range's base.
    /// Readable here, and writable only with `writable` (another process's memory is mapped
    /// read-only: a destination only reads it), until [`CudaDevice::vmm_unmap`] (the mappings
    /// hold the memory; the handles may be dropped). On an error nothing stays mapped or
    /// reserved.
    ///
    /// # Safety
    /// `sizes[i]` is the size of `handles[i]`'s allocation (as its exporter reported it).
    pub unsafe fn vmm_map(&self, handles: &[VmmHandle], sizes: &[u64], writable: bool) -> Result<u64, CopyError> {
        assert_eq!(handles.len(), sizes.len(), "CudaDevice::vmm_map: one size per handle");
        let total: u64 = sizes.iter().try_fold(0u64, |a, &s| a.checked_add(s)).ok_or(CopyError::InvalidOptions)?;
        if total == 0 {
            return Err(CopyError::InvalidOptions);
        }
        let _ctx = self.bind()?;
        let mut va = 0u64;
        // SAFETY: reserves address space only; written into a local.
        check(unsafe { sys::cuMemAddressReserve(&mut va, total as usize, 0, 0, 0) }, "cuMemAddressReserve")?;
        let mut mapped = 0u64;
        let r = (|| {
            for (h, &size) in handles.iter().zip(sizes) {
                // SAFETY: maps an imported allocation of `size` bytes (the caller's contract)
                // into the range reserved above, inside it (the sizes add up to it).
                check(unsafe { sys::cuMemMap(va + mapped, size as usize, 0, h.h, 0) }, "cuMemMap")?;
                mapped += size;
            }
            let desc = sys::CUmemAccessDesc {
                location: device_location(self.ordinal),
                flags: if writable {
                    sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                } else {
                    sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ
                },
            };
            // SAFETY: the whole range is mapped (above); one descriptor.
            check(unsafe { sys::cuMemSetAccess(va, total as usize, &desc, 1) }, "cuMemSetAccess")
        })();
        if let Err(e) = r {
            // SAFETY: unmaps what this call mapped and frees what it reserved.
            unsafe {
                if mapped > 0 {
                    let _ = sys::cuMemUnmap(va, mapped as usize);
                }
                let _ = sys::cuMemAddressFree(va, total as usize);
            }
            return Err(e);
        }
        Ok(va)
    }

    /// Unmap and free what [`CudaDevice::vmm_map`] mapped (`size`: the sum of its sizes).
    ///
    /// # Safety
    /// `va` and `size` are one `vmm_map`'s base and total on this device, and no copy uses
    /// the range any more.
    pub unsafe fn vmm_unmap(&self, va: u64, size: u64) -> Result<(), CopyError> {
        let _ctx = self.bind()?;
        // SAFETY: forwarded contract. The reservation is freed whatever the unmap answered
        // (a failed unmap must not leak the address range too).
        unsafe {
            let unmapped = check(sys::cuMemUnmap(va, size as usize), "cuMemUnmap");
            let freed = check(sys::cuMemAddressFree(va, size as usize), "cuMemAddressFree");
            unmapped.and(freed)
        }
    }
}

impl CudaStream {
    /// Enqueue a device-to-device copy of `len` bytes from `src` to `dst` (either may be
    /// memory another process exported and this one mapped) on this stream.
    ///
    /// # Safety
    /// Both ranges are device memory valid until the stream passed this copy; `dst` is not
    /// read or written by anything else meanwhile.
    pub unsafe fn copy_device(&self, dst: u64, src: u64, len: usize) -> Result<(), CopyError> {
        // SAFETY: forwarded contract; the stream is this library's.
        check(unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, len, self.raw()) }, "cuMemcpyDtoDAsync")
    }
}
