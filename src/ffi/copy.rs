//! KV copy from C: layouts, the CPU reference engine, pinned memory and the CUDA engine on the
//! caller's `CUstream`.

use std::ffi::c_void;
use std::sync::Arc;

use super::boundary::{free_box, guard, input, input_mut, input_sized, out_ptr, put, with_detail};
use super::status::kvrelay_status::{self, *};
use crate::copy::{
    CopyError, CopyMethod, CpuEngine, CudaDevice, CudaEngine, DeviceCopier, EngineOptions, IdTransport, KvLayout,
    PinnedBuffer, Segment,
};

/// A validated KV pool layout. Owned: `_free`.
pub struct kvrelay_kv_layout {
    inner: KvLayout,
}

/// The CPU reference engine over host memory. Owned: `_free`.
pub struct kvrelay_cpu_engine {
    inner: CpuEngine,
}

/// The CUDA engine over a device KV pool. Owned: `_free`. Not thread-safe: one engine per
/// thread or stream that copies concurrently.
pub struct kvrelay_cuda_engine {
    inner: CudaEngine,
}

/// Checked strided device-to-device copies on one device, on a stream of its own: for a runtime
/// whose KV cache is not in a kvrelay layout (llama.cpp's tensors per layer) to move KV between
/// its cache and a device pool. Owned: `_free`. Not thread-safe: one copier per thread.
pub struct kvrelay_cuda_copier {
    inner: DeviceCopier,
}

/// Page-locked, device-mapped host memory. Owned: `_free` (frees or unregisters it once).
pub struct kvrelay_pinned {
    inner: PinnedBuffer,
}

/// One (layer, K/V) slice of every block: block b at `base + b * block_stride`,
/// `bytes_per_block` long.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvrelay_kv_segment {
    /// Address of block 0.
    pub base: u64,
    /// Distance between blocks.
    pub block_stride: u64,
    /// Bytes per block.
    pub bytes_per_block: u64,
}

/// A memory extent the segments must stay inside.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvrelay_kv_extent {
    /// First byte.
    pub base: u64,
    /// Length.
    pub len: u64,
}

/// `kvrelay_cuda_engine_options.method`.
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvrelay_copy_method {
    /// Zero-copy kernel (NVRTC once per engine); the default.
    KVRELAY_COPY_KERNEL = 0,
    /// `cuMemcpyBatchAsync`.
    KVRELAY_COPY_BATCH = 1,
    /// One `cuMemcpyAsync` per chunk.
    KVRELAY_COPY_PER_CHUNK = 2,
    /// Through a device scratch buffer and contiguous copies on the copy engines.
    KVRELAY_COPY_STAGED = 3,
}

/// Options of `kvrelay_cuda_engine_new` (pass NULL for the defaults: kernel, 16 CTAs of 512
/// threads, 1024 blocks per batch call, 256 MiB of scratch for the staged method).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvrelay_cuda_engine_options {
    /// `sizeof(kvrelay_cuda_engine_options)` as the caller's header declares it.
    pub size: usize,
    /// A `kvrelay_copy_method` value.
    pub method: i32,
    /// Kernel CTA budget, 1..=1024.
    pub ctas: u32,
    /// Kernel threads per CTA, a multiple of 32 in 64..=512.
    pub threads: u32,
    /// Blocks per `cuMemcpyBatchAsync` call (descriptors reserved at setup).
    pub max_blocks_per_call: usize,
    /// Device scratch of the staged method, bytes.
    pub scratch_bytes: usize,
}

super::boundary::sized_since_epoch!(kvrelay_cuda_engine_options);

pub(crate) fn status_of(e: CopyError) -> kvrelay_status {
    let s = match e {
        CopyError::NoDriver => KVRELAY_ERR_NO_CUDA_DRIVER,
        CopyError::NoDevice => KVRELAY_ERR_NO_CUDA_DEVICE,
        CopyError::Cuda { .. } => KVRELAY_ERR_CUDA,
        CopyError::Unsupported(_) => KVRELAY_ERR_UNSUPPORTED,
        CopyError::InvalidOptions => KVRELAY_ERR_INVALID_ARGUMENT,
        CopyError::Layout(_) => KVRELAY_ERR_INVALID_LAYOUT,
        CopyError::BlockOutOfRange { .. } | CopyError::OutOfBounds => KVRELAY_ERR_OUT_OF_RANGE,
        CopyError::DuplicateBlock { .. } => KVRELAY_ERR_DUPLICATE_BLOCK,
        CopyError::StagingTooSmall { .. } | CopyError::StagingOverlapsPool => KVRELAY_ERR_STAGING,
    };
    with_detail(s, e)
}

/// A typed array `(ptr, n)`; `(NULL, 0)` is empty; a pointer not aligned for `T` is refused.
///
/// # Safety
/// A non-NULL `p` must be readable for `n` elements.
pub(crate) unsafe fn array<'a, T>(p: *const T, n: usize) -> Result<&'a [T], kvrelay_status> {
    if p.is_null() {
        return if n == 0 { Ok(&[]) } else { Err(KVRELAY_ERR_INVALID_ARGUMENT) };
    }
    if !p.is_aligned() {
        return Err(with_detail(KVRELAY_ERR_INVALID_ARGUMENT, "a misaligned array"));
    }
    // `from_raw_parts` requires the slice to span at most isize::MAX bytes.
    if n.checked_mul(std::mem::size_of::<T>()).is_none_or(|b| b > isize::MAX as usize) {
        return Err(KVRELAY_ERR_INVALID_ARGUMENT);
    }
    // SAFETY: non-NULL, within isize::MAX bytes, and readable for `n` elements per the contract.
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

fn emit_layout(
    r: Result<KvLayout, crate::copy::LayoutError>,
    out: *mut *mut kvrelay_kv_layout,
) -> Result<(), kvrelay_status> {
    let inner = r.map_err(|e| with_detail(KVRELAY_ERR_INVALID_LAYOUT, e))?;
    // SAFETY: `out` was checked non-NULL by the caller of this helper and is writable.
    unsafe { put(out, Box::into_raw(Box::new(kvrelay_kv_layout { inner }))) };
    Ok(())
}

/// Validate a segment table for `num_blocks` blocks (see the Rust `KvLayout::new`): bases,
/// strides and sizes non-zero multiples of 16, no two segments able to touch one byte, every
/// segment inside one of `pools` (pass `(NULL, 0)` to skip the bounds check).
/// `KVRELAY_ERR_INVALID_LAYOUT` otherwise.
///
/// # Safety
/// `segments` readable for `n_segments`, `pools` for `n_pools` (or NULL with 0); `out` NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_kv_layout_new(
    num_blocks: u32,
    segments: *const kvrelay_kv_segment,
    n_segments: usize,
    pools: *const kvrelay_kv_extent,
    n_pools: usize,
    out: *mut *mut kvrelay_kv_layout,
) -> kvrelay_status {
    guard(|| {
        let out = out_ptr(out)?;
        // SAFETY: forwarded contract.
        let (segs, pools) = unsafe { (array(segments, n_segments)?, array(pools, n_pools)?) };
        let segs = segs
            .iter()
            .map(|s| Segment { base: s.base, block_stride: s.block_stride, bytes_per_block: s.bytes_per_block })
            .collect();
        let pools: Vec<(u64, u64)> = pools.iter().map(|p| (p.base, p.len)).collect();
        emit_layout(KvLayout::new(num_blocks, segs, &pools), out)
    })
}

/// vLLM-style layout: one pool per layer shaped `[2, num_blocks, kv_block_bytes]`.
///
/// # Safety
/// `layer_pools` readable for `layers` addresses; `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_kv_layout_per_layer_kv_first(
    layer_pools: *const u64,
    layers: usize,
    num_blocks: u32,
    kv_block_bytes: u64,
    out: *mut *mut kvrelay_kv_layout,
) -> kvrelay_status {
    guard(|| {
        let out = out_ptr(out)?;
        // SAFETY: forwarded contract.
        let pools = unsafe { array(layer_pools, layers) }?;
        emit_layout(KvLayout::per_layer_kv_first(pools, num_blocks, kv_block_bytes), out)
    })
}

/// FlashInfer-style layout: one pool per layer shaped `[num_blocks, 2, kv_block_bytes]`.
///
/// # Safety
/// As `kvrelay_kv_layout_per_layer_kv_first`.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_kv_layout_per_layer_block_first(
    layer_pools: *const u64,
    layers: usize,
    num_blocks: u32,
    kv_block_bytes: u64,
    out: *mut *mut kvrelay_kv_layout,
) -> kvrelay_status {
    guard(|| {
        let out = out_ptr(out)?;
        // SAFETY: forwarded contract.
        let pools = unsafe { array(layer_pools, layers) }?;
        emit_layout(KvLayout::per_layer_block_first(pools, num_blocks, kv_block_bytes), out)
    })
}

/// TensorRT-LLM-style layout: one pool shaped `[num_blocks, layers, 2, kv_block_bytes]`.
///
/// # Safety
/// `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_kv_layout_all_layers_per_block(
    pool: u64,
    layers: u32,
    num_blocks: u32,
    kv_block_bytes: u64,
    out: *mut *mut kvrelay_kv_layout,
) -> kvrelay_status {
    guard(|| {
        let out = out_ptr(out)?;
        emit_layout(KvLayout::all_layers_per_block(pool, layers, num_blocks, kv_block_bytes), out)
    })
}

/// Bytes of one staged block (every segment, block-major). 0 for NULL.
///
/// # Safety
/// `layout` NULL or live.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_kv_layout_stage_block_bytes(layout: *const kvrelay_kv_layout) -> u64 {
    // SAFETY: forwarded contract.
    unsafe { layout.as_ref() }.map_or(0, |l| l.inner.stage_block_bytes())
}

/// Free a layout. NULL does nothing.
///
/// # Safety
/// `layout` NULL or live.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_kv_layout_free(layout: *mut kvrelay_kv_layout) {
    // SAFETY: forwarded contract.
    unsafe { free_box(layout) }
}

/// A CPU engine over `layout`, whose addresses are host addresses. The layout is copied.
///
/// # Safety
/// Every block of every segment must be host memory valid for reads and writes while the
/// engine is used, and not accessed by anything else during a call. `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_cpu_engine_new(
    layout: *const kvrelay_kv_layout,
    out: *mut *mut kvrelay_cpu_engine,
) -> kvrelay_status {
    guard(|| {
        let out = out_ptr(out)?;
        // SAFETY: forwarded contract.
        let l = unsafe { input(layout) }?;
        // SAFETY: the caller vouches for the memory (this function's contract).
        let inner = unsafe { CpuEngine::new(l.inner.clone()) };
        // SAFETY: checked non-NULL; writable.
        unsafe { put(out, Box::into_raw(Box::new(kvrelay_cpu_engine { inner }))) };
        Ok(())
    })
}

/// Copy blocks `ids[0..n]` (in order, repeats allowed) into `staging[0..staging_len]`,
/// block-major. `KVRELAY_ERR_OUT_OF_RANGE` for an id past the pool, `KVRELAY_ERR_STAGING` for a
/// buffer too small.
///
/// # Safety
/// `engine` NULL or live; `ids` readable for `n`; `staging` writable for `staging_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_cpu_gather(
    engine: *mut kvrelay_cpu_engine,
    ids: *const u32,
    n: usize,
    staging: *mut u8,
    staging_len: usize,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        let (e, ids) = unsafe { (input_mut(engine)?, array(ids, n)?) };
        let st: &mut [u8] = if staging.is_null() {
            if staging_len != 0 {
                return Err(KVRELAY_ERR_INVALID_ARGUMENT);
            }
            &mut []
        } else {
            // SAFETY: writable for `staging_len` per the contract.
            unsafe { std::slice::from_raw_parts_mut(staging, staging_len) }
        };
        e.inner.gather(ids, st).map_err(status_of)
    })
}

/// Copy `staging` back into blocks `ids[0..n]` (no repeats: `KVRELAY_ERR_DUPLICATE_BLOCK`).
///
/// # Safety
/// `engine` NULL or live; `ids` readable for `n`; `staging` readable for `staging_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_cpu_scatter(
    engine: *mut kvrelay_cpu_engine,
    staging: *const u8,
    staging_len: usize,
    ids: *const u32,
    n: usize,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        let (e, ids, st) = unsafe { (input_mut(engine)?, array(ids, n)?, array(staging, staging_len)?) };
        e.inner.scatter(st, ids).map_err(status_of)
    })
}

/// Free a CPU engine. NULL does nothing.
///
/// # Safety
/// `engine` NULL or live.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_cpu_engine_free(engine: *mut kvrelay_cpu_engine) {
    // SAFETY: forwarded contract.
    unsafe { free_box(engine) }
}

/// `KVRELAY_OK` when CUDA device `device` can be used; `KVRELAY_ERR_NO_CUDA_DRIVER` without a
/// driver, `KVRELAY_ERR_NO_CUDA_DEVICE` without the device. Lets callers skip cleanly.
#[no_mangle]
pub extern "C" fn kvrelay_cuda_available(device: i32) -> kvrelay_status {
    guard(|| CudaDevice::open(device).map(|_| ()).map_err(status_of))
}

/// Allocate `len` bytes of pinned, device-mapped host memory on `device`.
///
/// # Safety
/// `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_pinned_alloc(
    device: i32,
    len: usize,
    out: *mut *mut kvrelay_pinned,
) -> kvrelay_status {
    guard(|| {
        let out = out_ptr(out)?;
        let d = CudaDevice::open(device).map_err(status_of)?;
        let inner = PinnedBuffer::alloc(&d, len).map_err(status_of)?;
        // SAFETY: checked non-NULL; writable.
        unsafe { put(out, Box::into_raw(Box::new(kvrelay_pinned { inner }))) };
        Ok(())
    })
}

/// Pin and map the caller's memory `[ptr, ptr + len)` (unregistered by `kvrelay_pinned_free`).
///
/// # Safety
/// The memory must stay allocated and not be registered elsewhere until the handle is freed.
/// `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_pinned_register(
    device: i32,
    ptr: *mut c_void,
    len: usize,
    out: *mut *mut kvrelay_pinned,
) -> kvrelay_status {
    guard(|| {
        let out = out_ptr(out)?;
        if ptr.is_null() {
            return Err(KVRELAY_ERR_NULL);
        }
        let d = CudaDevice::open(device).map_err(status_of)?;
        // SAFETY: the caller vouches for the memory (this function's contract).
        let inner = unsafe { PinnedBuffer::register(&d, ptr.cast(), len) }.map_err(status_of)?;
        // SAFETY: checked non-NULL; writable.
        unsafe { put(out, Box::into_raw(Box::new(kvrelay_pinned { inner }))) };
        Ok(())
    })
}

/// The host address of pinned memory (NULL for NULL).
///
/// # Safety
/// `pinned` NULL or live.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_pinned_host(pinned: *mut kvrelay_pinned) -> *mut u8 {
    // SAFETY: forwarded contract.
    unsafe { pinned.as_mut() }.map_or(std::ptr::null_mut(), |p| p.inner.as_mut_slice().as_mut_ptr())
}

/// The size of pinned memory (0 for NULL).
///
/// # Safety
/// `pinned` NULL or live.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_pinned_len(pinned: *const kvrelay_pinned) -> usize {
    // SAFETY: forwarded contract.
    unsafe { pinned.as_ref() }.map_or(0, |p| p.inner.len())
}

/// Free (or unregister) pinned memory, once. NULL does nothing. No copy may still use it.
///
/// # Safety
/// `pinned` NULL or live.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_pinned_free(pinned: *mut kvrelay_pinned) {
    // SAFETY: forwarded contract.
    unsafe { free_box(pinned) }
}

/// A CUDA engine on `device` over `layout` (device addresses; copied). `options` NULL for the
/// defaults. Compiles the copy kernel once (NVRTC).
///
/// # Safety
/// Every block of every segment must be device memory of `device` valid while the engine is
/// used. `layout` NULL or live; `options` NULL or readable; `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_cuda_engine_new(
    device: i32,
    layout: *const kvrelay_kv_layout,
    options: *const kvrelay_cuda_engine_options,
    out: *mut *mut kvrelay_cuda_engine,
) -> kvrelay_status {
    guard(|| {
        let out = out_ptr(out)?;
        // SAFETY: forwarded contract.
        let l = unsafe { input(layout) }?;
        let mut opts = EngineOptions::default();
        let options = if options.is_null() {
            None
        } else {
            // SAFETY: forwarded contract: readable for the size it declares.
            Some(unsafe { input_sized(options, "kvrelay_cuda_engine_options") }?)
        };
        if let Some(o) = options {
            opts.method = match o.method {
                0 => CopyMethod::Kernel,
                1 => CopyMethod::Batch,
                2 => CopyMethod::PerChunk,
                3 => CopyMethod::Staged,
                _ => return Err(KVRELAY_ERR_INVALID_ARGUMENT),
            };
            opts.ctas = o.ctas;
            opts.threads = o.threads;
            opts.max_blocks_per_call = o.max_blocks_per_call;
            opts.scratch_bytes = o.scratch_bytes;
            opts.ids = IdTransport::Auto;
        }
        let d: Arc<CudaDevice> = CudaDevice::open(device).map_err(status_of)?;
        // SAFETY: the caller vouches for the pool (this function's contract).
        let inner = unsafe { CudaEngine::new(&d, l.inner.clone(), opts) }.map_err(status_of)?;
        // SAFETY: checked non-NULL; writable.
        unsafe { put(out, Box::into_raw(Box::new(kvrelay_cuda_engine { inner }))) };
        Ok(())
    })
}

/// Enqueue a copy of blocks `ids[0..n]` into `staging` on `stream` (a `CUstream`, or NULL for
/// the legacy default stream): it runs after the work enqueued on that stream before it.
/// `done_event` (a `CUevent`, may be NULL) is recorded after it. Host cost: a few microseconds,
/// no allocation, no lock. The calling thread's current context is left as it was. A call of
/// more than 960 blocks uses an id-ring slot; if that slot's previous launch (32 such calls
/// earlier) has not finished, the call waits for that launch only, never for other work: at
/// worst as long as the GPU takes to reach and run it.
///
/// # Safety
/// `engine`, `staging` NULL or live; `ids` readable for `n`; `stream` NULL or a live stream and
/// `done_event` NULL or a live event, both of the engine's device context.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_cuda_gather(
    engine: *mut kvrelay_cuda_engine,
    ids: *const u32,
    n: usize,
    staging: *const kvrelay_pinned,
    stream: *mut c_void,
    done_event: *mut c_void,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        let (e, ids, st) = unsafe { (input_mut(engine)?, array(ids, n)?, input(staging)?) };
        // SAFETY: forwarded contract (stream, event).
        unsafe { e.inner.gather_raw(ids, &st.inner, stream.cast(), done_event.cast()) }.map_err(status_of)
    })
}

/// Enqueue a copy of `staging` back into blocks `ids[0..n]` (no repeats) on `stream`; otherwise
/// as `kvrelay_cuda_gather`.
///
/// # Safety
/// As `kvrelay_cuda_gather`.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_cuda_scatter(
    engine: *mut kvrelay_cuda_engine,
    staging: *const kvrelay_pinned,
    ids: *const u32,
    n: usize,
    stream: *mut c_void,
    done_event: *mut c_void,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        let (e, ids, st) = unsafe { (input_mut(engine)?, array(ids, n)?, input(staging)?) };
        // SAFETY: forwarded contract (stream, event).
        unsafe { e.inner.scatter_raw(&st.inner, ids, stream.cast(), done_event.cast()) }.map_err(status_of)
    })
}

/// Free a CUDA engine (waits for its launches to finish reading their block ids). The copies it
/// enqueued on the caller's streams must be complete (synchronize them or wait on their
/// events first): its device tables are freed here. NULL does nothing.
///
/// # Safety
/// `engine` NULL or live.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_cuda_engine_free(engine: *mut kvrelay_cuda_engine) {
    // SAFETY: forwarded contract.
    unsafe { free_box(engine) }
}

/// A copier of device-to-device copies on `device` (one stream of its own, created here).
/// `KVRELAY_ERR_NO_CUDA_DRIVER` / `KVRELAY_ERR_NO_CUDA_DEVICE` where there is none.
///
/// # Safety
/// `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_cuda_copier_new(device: i32, out: *mut *mut kvrelay_cuda_copier) -> kvrelay_status {
    guard(|| {
        let out = out_ptr(out)?;
        let d = CudaDevice::open(device).map_err(status_of)?;
        let inner = DeviceCopier::new(&d).map_err(status_of)?;
        // SAFETY: checked non-NULL; writable.
        unsafe { put(out, Box::into_raw(Box::new(kvrelay_cuda_copier { inner }))) };
        Ok(())
    })
}

/// Enqueue a copy of `height` rows of `width` bytes from device address `src` (rows
/// `src_pitch` apart) to device address `dst` (rows `dst_pitch` apart), after the copies
/// enqueued before it. Nothing for a `width` or `height` of 0. Checked before anything is
/// enqueued (`KVRELAY_ERR_OUT_OF_RANGE`, nothing enqueued): both ends device memory of the
/// copier's device, each whole strided extent inside the one allocation that holds its first
/// byte, a pitch not below `width` (for more than one row). Host cost: one driver call, plus two
/// lookups the first time an allocation is seen after a `finish`. Nothing the copy reads or
/// writes may be used by anything else until `kvrelay_cuda_copier_finish` returns; work the
/// runtime enqueued on its own streams is not waited for (synchronize it first).
///
/// # Safety
/// `copier` NULL or live. The addresses are only looked up by the driver, never dereferenced
/// on the host.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_cuda_copy_2d(
    copier: *mut kvrelay_cuda_copier,
    dst: u64,
    dst_pitch: usize,
    src: u64,
    src_pitch: usize,
    width: usize,
    height: usize,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        let c = unsafe { input_mut(copier) }?;
        c.inner.copy_2d(dst, dst_pitch, src, src_pitch, width, height).map_err(status_of)
    })
}

/// Wait for every copy enqueued since the last finish. `*bytes_out` (may be NULL) gets the
/// bytes they moved. A failed copy is this call's `KVRELAY_ERR_CUDA` (the bytes are then
/// unspecified).
///
/// # Safety
/// `copier` NULL or live; `bytes_out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_cuda_copier_finish(
    copier: *mut kvrelay_cuda_copier,
    bytes_out: *mut u64,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        let c = unsafe { input_mut(copier) }?;
        let bytes = c.inner.finish().map_err(status_of)?;
        if !bytes_out.is_null() {
            // SAFETY: non-NULL and writable per the contract.
            unsafe { put(bytes_out, bytes) };
        }
        Ok(())
    })
}

/// Free a copier, after waiting for its copies. NULL does nothing.
///
/// # Safety
/// `copier` NULL or live.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_cuda_copier_free(copier: *mut kvrelay_cuda_copier) {
    // SAFETY: forwarded contract.
    if let Some(c) = unsafe { copier.as_mut() } {
        let _ = c.inner.finish();
    }
    // SAFETY: forwarded contract.
    unsafe { free_box(copier) }
}

/// The validated layout behind a handle (for the agent's entry points).
pub(crate) fn layout_of(l: &kvrelay_kv_layout) -> &KvLayout {
    &l.inner
}

/// The KV block checksum of `bytes` (the Rust `kvrelay::checksum::kv_checksum`: what the agent
/// records and verifies; it catches any change within one word and, but for a 2^-64 chance,
/// changes spread over several). O(len), no allocation.
///
/// # Safety
/// `bytes` readable for `len` bytes; `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_kv_checksum(bytes: *const u8, len: usize, out: *mut u64) -> kvrelay_status {
    guard(|| {
        let out = out_ptr(out)?;
        // SAFETY: forwarded contract.
        let b = unsafe { super::boundary::bytes(bytes, len) }?;
        // SAFETY: checked non-NULL; writable per the contract.
        unsafe { put(out, crate::checksum::kv_checksum(b)) };
        Ok(())
    })
}
