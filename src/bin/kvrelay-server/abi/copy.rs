//! The copy engine over a block-contiguous pool: layouts, the CPU and CUDA engines, pinned and
//! host memory.

use super::*;

/// A KV layout (`kvrelay_kv_layout`).
pub struct KvLayout(pub(super) NonNull<kvrelay_kv_layout>);

impl KvLayout {
    /// One pool of `blocks` blocks of `block_bytes` each, contiguous, at `base` (TensorRT-LLM's
    /// all-layers-per-block shape with one layer of `block_bytes / 2` per K and V).
    pub fn contiguous(base: u64, blocks: u32, block_bytes: u64) -> Result<KvLayout, AbiError> {
        let mut out: *mut kvrelay_kv_layout = ptr::null_mut();
        // SAFETY: `out` writable; addresses are not dereferenced by layout construction.
        check("kvrelay_kv_layout_all_layers_per_block", unsafe {
            kvrelay_kv_layout_all_layers_per_block(base, 1, blocks, block_bytes / 2, &mut out)
        })?;
        Ok(KvLayout(NonNull::new(out).expect("OK with NULL")))
    }

    /// Bytes of one staged block.
    pub fn stage_block_bytes(&self) -> u64 {
        // SAFETY: live layout.
        unsafe { kvrelay_kv_layout_stage_block_bytes(self.0.as_ptr()) }
    }
}

impl Drop for KvLayout {
    fn drop(&mut self) {
        // SAFETY: from a constructor, freed once.
        unsafe { kvrelay_kv_layout_free(self.0.as_ptr()) };
    }
}

// SAFETY: a layout is immutable once built (every function takes it by const pointer) and
// holds only addresses; sharing or moving the handle between threads is what the header allows.
unsafe impl Send for KvLayout {}
// SAFETY: as above.
unsafe impl Sync for KvLayout {}

/// The CPU engine over host memory (`kvrelay_cpu_engine`).
pub struct CpuEngine(NonNull<kvrelay_cpu_engine>);

// SAFETY: the engine holds only the layout (addresses); calls take `&mut self`, so one thread
// at a time uses it, and the pool memory it addresses is owned by the caller's pool.
unsafe impl Send for CpuEngine {}

impl CpuEngine {
    /// An engine over `layout`.
    ///
    /// # Safety
    /// Every block of the layout must be host memory valid for reads and writes while the
    /// engine lives, touched by nothing else during a call.
    pub unsafe fn new(layout: &KvLayout) -> Result<CpuEngine, AbiError> {
        let mut out: *mut kvrelay_cpu_engine = ptr::null_mut();
        // SAFETY: live layout; `out` writable; the memory contract is the caller's.
        check("kvrelay_cpu_engine_new", unsafe { kvrelay_cpu_engine_new(layout.0.as_ptr(), &mut out) })?;
        Ok(CpuEngine(NonNull::new(out).expect("OK with NULL")))
    }

    /// Copy blocks `ids` into `staging`, block-major.
    pub fn gather(&mut self, ids: &[u32], staging: &mut [u8]) -> Result<(), AbiError> {
        // SAFETY: live engine; slices valid for their lengths.
        check("kvrelay_cpu_gather", unsafe {
            kvrelay_cpu_gather(self.0.as_ptr(), ids.as_ptr(), ids.len(), staging.as_mut_ptr(), staging.len())
        })
    }

    /// Copy `staging` into blocks `ids` (no repeats).
    pub fn scatter(&mut self, staging: &[u8], ids: &[u32]) -> Result<(), AbiError> {
        // SAFETY: live engine; slices valid for their lengths.
        check("kvrelay_cpu_scatter", unsafe {
            kvrelay_cpu_scatter(self.0.as_ptr(), staging.as_ptr(), staging.len(), ids.as_ptr(), ids.len())
        })
    }
}

impl Drop for CpuEngine {
    fn drop(&mut self) {
        // SAFETY: from `kvrelay_cpu_engine_new`, freed once.
        unsafe { kvrelay_cpu_engine_free(self.0.as_ptr()) };
    }
}

/// `Ok` when CUDA device `device` can be used; the error says why not (no driver, no device).
pub fn cuda_available(device: i32) -> Result<(), AbiError> {
    check("kvrelay_cuda_available", kvrelay_cuda_available(device))
}

/// Pinned, device-mapped host memory (`kvrelay_pinned`): the staging of GPU copies.
pub struct Pinned(NonNull<kvrelay_pinned>);

// SAFETY: plain page-locked memory owned by this handle; `&mut self` guards writes.
unsafe impl Send for Pinned {}

impl Pinned {
    /// `len` bytes on `device`.
    pub fn alloc(device: i32, len: usize) -> Result<Pinned, AbiError> {
        let mut out: *mut kvrelay_pinned = ptr::null_mut();
        // SAFETY: `out` writable.
        check("kvrelay_pinned_alloc", unsafe { kvrelay_pinned_alloc(device, len, &mut out) })?;
        Ok(Pinned(NonNull::new(out).expect("OK with NULL")))
    }

    /// The bytes (no copy is in flight when the caller holds `&mut self`: every copy of the
    /// server's store is synchronized before it returns).
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: live handle; host address and length from kvrelay; `&mut self` is exclusive.
        unsafe {
            std::slice::from_raw_parts_mut(kvrelay_pinned_host(self.0.as_ptr()), kvrelay_pinned_len(self.0.as_ptr()))
        }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: from `kvrelay_pinned_alloc`, freed once, no copy in flight (see `bytes_mut`).
        unsafe { kvrelay_pinned_free(self.0.as_ptr()) };
    }
}

/// The CUDA copy engine over a device pool (`kvrelay_cuda_engine`).
pub struct CudaEngine(NonNull<kvrelay_cuda_engine>);

// SAFETY: one engine is used by one thread at a time (`&mut self`), as the header requires.
unsafe impl Send for CudaEngine {}

impl CudaEngine {
    /// An engine on `device` over `layout` (device addresses), default options (the kernel).
    ///
    /// # Safety
    /// Every block of the layout must be device memory of `device` valid while the engine lives.
    pub unsafe fn new(device: i32, layout: &KvLayout) -> Result<CudaEngine, AbiError> {
        let mut out: *mut kvrelay_cuda_engine = ptr::null_mut();
        // SAFETY: live layout; NULL options (defaults); `out` writable; memory per the caller.
        check("kvrelay_cuda_engine_new", unsafe {
            kvrelay_cuda_engine_new(device, layout.0.as_ptr(), ptr::null(), &mut out)
        })?;
        Ok(CudaEngine(NonNull::new(out).expect("OK with NULL")))
    }

    /// Enqueue a copy of blocks `ids` into `staging` on `stream`.
    pub fn gather(
        &mut self,
        ids: &[u32],
        staging: &Pinned,
        stream: &cudarc::driver::CudaStream,
    ) -> Result<(), AbiError> {
        // SAFETY: live engine and staging; `ids` readable; a live stream of the device's primary
        // context (cudarc's context is the primary one, as the engine's); no event.
        check("kvrelay_cuda_gather", unsafe {
            kvrelay_cuda_gather(
                self.0.as_ptr(),
                ids.as_ptr(),
                ids.len(),
                staging.0.as_ptr(),
                stream.cu_stream().cast(),
                ptr::null_mut(),
            )
        })
    }

    /// Enqueue a copy of `staging` into blocks `ids` on `stream`.
    pub fn scatter(
        &mut self,
        staging: &Pinned,
        ids: &[u32],
        stream: &cudarc::driver::CudaStream,
    ) -> Result<(), AbiError> {
        // SAFETY: as `gather`.
        check("kvrelay_cuda_scatter", unsafe {
            kvrelay_cuda_scatter(
                self.0.as_ptr(),
                staging.0.as_ptr(),
                ids.as_ptr(),
                ids.len(),
                stream.cu_stream().cast(),
                ptr::null_mut(),
            )
        })
    }
}

impl Drop for CudaEngine {
    fn drop(&mut self) {
        // SAFETY: from `kvrelay_cuda_engine_new`, freed once.
        unsafe { kvrelay_cuda_engine_free(self.0.as_ptr()) };
    }
}

/// A zeroed, 16-byte aligned host allocation the CPU engine addresses by integer (the
/// reference engine's host pool).
pub struct HostPool {
    ptr: NonNull<u8>,
    layout: std::alloc::Layout,
}

// SAFETY: plain owned memory; accessed only through the engine under the pool's lock.
unsafe impl Send for HostPool {}
// SAFETY: as above; `&HostPool` only exposes the address.
unsafe impl Sync for HostPool {}

impl HostPool {
    /// `len` zeroed bytes, every page touched once here (as a runtime pre-faults its KV pool),
    /// so that no request pays the first-touch page faults.
    pub fn new(len: usize) -> HostPool {
        // 16-byte alignment (what the copy engine needs) lets the allocator hand out zeroed
        // pages (calloc) that the loop below faults in one store per page.
        let layout = std::alloc::Layout::from_size_align(len.max(64), 16).expect("pool size fits a layout");
        // SAFETY: non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(p).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        for off in (0..layout.size()).step_by(4096) {
            // SAFETY: `off < size`, inside the allocation; writing the zero it already holds.
            unsafe { ptr.as_ptr().add(off).write_volatile(0) };
        }
        HostPool { ptr, layout }
    }

    /// The pool's address.
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }
}

impl Drop for HostPool {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}
