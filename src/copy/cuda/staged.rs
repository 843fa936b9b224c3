//! The staged method: an HBM gather into a device scratch, then contiguous copies on the copy
//! engines, pipelined over two scratch halves.

use std::ffi::c_void;

use cudarc::driver::sys;

use super::*;
use crate::copy::CopyError;

impl CudaEngine {
    /// The staged method, pipelined over the two scratch halves (see [`CopyMethod::Staged`]).
    ///
    /// # Safety
    /// As [`CudaEngine::launch_kernel`]; `staging` holds at least this call's blocks.
    pub(super) unsafe fn enqueue_staged(
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
}
