//! The CPU reference engine: the same API and the same chunk plan as the CUDA engine, over host
//! memory. Byte-exact with the GPU engine by construction (both walk `KvLayout::chunks`), used
//! by the tests that run without a GPU and as the oracle of the GPU tests.

use super::layout::KvLayout;
use super::plan::Checker;
use super::CopyError;

/// Gathers blocks of a host-memory KV pool into block-major staging, and scatters them back.
#[derive(Debug)]
pub struct CpuEngine {
    layout: KvLayout,
    checker: Checker,
}

impl CpuEngine {
    /// An engine over `layout`, whose segment addresses are host addresses.
    ///
    /// # Safety
    /// Every block of every segment must be valid host memory for reads and writes for as long
    /// as the engine is used, and nothing else may access it during a call.
    pub unsafe fn new(layout: KvLayout) -> CpuEngine {
        let checker = Checker::new(&layout);
        CpuEngine { layout, checker }
    }

    /// The layout.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    fn overlaps_pool(&self, p: *const u8, len: usize) -> bool {
        let (a, b) = (p as u64, p as u64 + len as u64);
        self.layout.segments().iter().any(|s| {
            let end = s.base + s.block_stride * u64::from(self.layout.num_blocks() - 1) + s.bytes_per_block;
            a < end && s.base < b
        })
    }

    /// Copy blocks `ids` (in that order) to `staging[i * stage_block_bytes ..]`. Repeated ids
    /// are allowed. No allocation.
    pub fn gather(&mut self, ids: &[u32], staging: &mut [u8]) -> Result<(), CopyError> {
        self.checker.check(&self.layout, ids, staging.len() as u64, false)?;
        if self.overlaps_pool(staging.as_ptr(), staging.len()) {
            return Err(CopyError::StagingOverlapsPool);
        }
        for (src, off, len) in self.layout.chunks(ids) {
            let dst = &mut staging[off as usize..(off + len) as usize];
            // SAFETY: `src..src+len` is a block of a segment (ids checked), valid for reads per
            // `new`'s contract; `dst` is a live slice that does not overlap the pool (checked).
            unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), len as usize) };
        }
        Ok(())
    }

    /// Copy `staging[i * stage_block_bytes ..]` back into blocks `ids`. Repeated ids are refused
    /// (the writes would race on the GPU; the CPU engine keeps the same rule). No allocation.
    pub fn scatter(&mut self, staging: &[u8], ids: &[u32]) -> Result<(), CopyError> {
        self.checker.check(&self.layout, ids, staging.len() as u64, true)?;
        if self.overlaps_pool(staging.as_ptr(), staging.len()) {
            return Err(CopyError::StagingOverlapsPool);
        }
        for (dst, off, len) in self.layout.chunks(ids) {
            let src = &staging[off as usize..(off + len) as usize];
            // SAFETY: `dst..dst+len` is a block of a segment (ids checked, unique), valid for
            // writes per `new`'s contract; `src` is a live slice that does not overlap the pool.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, len as usize) };
        }
        Ok(())
    }
}
