//! Memory the driver allocates or registers: pinned host memory, device memory, and device
//! memory of the virtual memory API. Each freed exactly once, on drop.

use std::sync::Arc;

use cudarc::driver::sys;

use super::ipc::{device_location, POSIX_FD};
use super::{check, CudaDevice, VmmHandle};
use crate::copy::CopyError;

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

/// Copy from offset `at` of the `len` bytes of device memory at `ptr` into `dst` (synchronous).
fn read_device(dev: &CudaDevice, ptr: u64, len: usize, at: usize, dst: &mut [u8]) -> Result<(), CopyError> {
    if at.checked_add(dst.len()).is_none_or(|e| e > len) {
        return Err(CopyError::OutOfBounds);
    }
    let _ctx = dev.bind()?;
    // SAFETY: the range is inside the caller's device memory (checked against `len`); `dst` is
    // writable.
    check(unsafe { sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), ptr + at as u64, dst.len()) }, "cuMemcpyDtoH")
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
        read_device(&self.dev, self.ptr, self.len, at, dst)
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
    /// Copy from offset `at` into `dst` (synchronous).
    pub fn read(&self, at: usize, dst: &mut [u8]) -> Result<(), CopyError> {
        read_device(&self.dev, self.ptr, self.len, at, dst)
    }
}

impl Drop for VmmBuffer {
    fn drop(&mut self) {
        // SAFETY: the range `alloc` mapped with `vmm_map`, unmapped once; nothing uses it any
        // more (the owner drops it).
        let _ = unsafe { self.dev.vmm_unmap(self.ptr, self.len as u64) };
    }
}
