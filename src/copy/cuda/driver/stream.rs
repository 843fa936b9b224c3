//! Streams and events of the device's primary context.

use std::sync::Arc;

use cudarc::driver::sys;

use super::{check, CudaDevice};
use crate::copy::CopyError;

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
