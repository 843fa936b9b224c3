//! The CUDA driver wrappers, by concept: the device and its primary context (here), pinned,
//! device and virtual-memory buffers ([`memory`]), streams and events ([`stream`]), and what
//! crosses processes: CUDA IPC exports and virtual-memory handles ([`ipc`]). Each owns its
//! resource and frees it once.

mod ipc;
mod memory;
mod stream;

pub use ipc::{IpcExport, VmmChunk, VmmHandle};
pub use memory::{DeviceBuffer, PinnedBuffer, VmmBuffer};
pub use stream::{CudaEvent, CudaStream};

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
