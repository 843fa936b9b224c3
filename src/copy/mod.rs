//! KV copy between GPU memory and pinned host memory (offload/onload, and the staging step of
//! cross-instance transfer).
//!
//! - [`KvLayout`]: the engine's KV pool as a validated table of segments (one per layer and
//!   K/V), covering per-layer pools (vLLM, FlashInfer) and all-layers-per-block pools
//!   (TensorRT-LLM); staging is block-major.
//! - [`CudaEngine`]: `gather` (pool -> staging) and `scatter` (staging -> pool) enqueued on the
//!   caller's CUDA stream, by a zero-copy kernel, `cuMemcpyBatchAsync` or one memcpy per chunk.
//! - [`DeviceCopier`]: checked strided device-to-device copies between a runtime's own KV tensors
//!   and a device pool (llama.cpp's cache), on a stream of its own.
//! - [`CpuEngine`]: the same API and chunk plan over host memory: the reference the GPU engine is
//!   tested against, and what runs where there is no GPU.
//!
//! Errors are values, never panics: no driver, no device, an id out of range, a duplicate
//! destination, a staging buffer too small, a layout that does not validate.

mod cpu;
mod cuda;
mod layout;
mod plan;

use std::fmt;

pub use cpu::CpuEngine;
pub use cuda::{
    driver_present, CopyMethod, CudaDevice, CudaEngine, CudaEvent, CudaStream, DeviceBuffer, DeviceCopier,
    EngineOptions, IdTransport, IpcExport, PinnedBuffer, VmmBuffer, VmmChunk, VmmHandle, COPY_SUM_IDS, DEFAULT_CTAS,
    DEFAULT_THREADS, IDS_PER_LAUNCH, RING_IDS_PER_LAUNCH,
};
pub use layout::{KvLayout, LayoutError, Segment, MAX_SEGMENTS};

/// CUDA device 0 for the crate's unit tests, or `None` (said why) on a machine without a driver
/// or device; with `KVRELAY_REQUIRE_GPU` set a skip is a failure instead.
#[cfg(test)]
pub(crate) fn test_device() -> Option<std::sync::Arc<CudaDevice>> {
    if !driver_present() {
        assert!(std::env::var_os("KVRELAY_REQUIRE_GPU").is_none(), "KVRELAY_REQUIRE_GPU is set but no driver");
        eprintln!("skipped: no CUDA driver");
        return None;
    }
    match CudaDevice::open(0) {
        Ok(d) => Some(d),
        Err(e) => {
            assert!(std::env::var_os("KVRELAY_REQUIRE_GPU").is_none(), "KVRELAY_REQUIRE_GPU is set: {e}");
            eprintln!("skipped: {e}");
            None
        }
    }
}

/// Why a copy could not be set up or enqueued.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CopyError {
    /// The CUDA driver library is not installed.
    NoDriver,
    /// The driver found no such device (or failed to initialize).
    NoDevice,
    /// A CUDA call failed.
    Cuda {
        /// The driver function.
        call: &'static str,
        /// Its `CUresult`.
        code: i32,
    },
    /// A feature this machine's driver or toolkit lacks.
    Unsupported(&'static str),
    /// Engine options out of range.
    InvalidOptions,
    /// The layout did not validate.
    Layout(LayoutError),
    /// A block id past the pool.
    BlockOutOfRange {
        /// Position in the call's id list.
        position: usize,
        /// The id.
        id: u32,
        /// Blocks in the pool.
        num_blocks: u32,
    },
    /// The same destination block twice in one scatter.
    DuplicateBlock {
        /// Position of the second occurrence.
        position: usize,
        /// The id.
        id: u32,
    },
    /// The staging buffer is smaller than the call needs.
    StagingTooSmall {
        /// Bytes needed.
        needed: u64,
        /// Bytes given.
        got: u64,
    },
    /// The staging buffer lies inside the KV pool (CPU engine).
    StagingOverlapsPool,
    /// A range outside a buffer.
    OutOfBounds,
}

impl fmt::Display for CopyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CopyError::NoDriver => f.write_str("no CUDA driver (libcuda could not be loaded)"),
            CopyError::NoDevice => f.write_str("no CUDA device"),
            CopyError::Cuda { call, code } => write!(f, "{call} failed with CUresult {code}"),
            CopyError::Unsupported(what) => write!(f, "unsupported here: {what}"),
            CopyError::InvalidOptions => f.write_str("engine options out of range"),
            CopyError::Layout(e) => write!(f, "layout: {e}"),
            CopyError::BlockOutOfRange { position, id, num_blocks } => {
                write!(f, "block id {id} at position {position} is outside the pool of {num_blocks} blocks")
            }
            CopyError::DuplicateBlock { position, id } => {
                write!(f, "block id {id} repeated at position {position} of a scatter")
            }
            CopyError::StagingTooSmall { needed, got } => {
                write!(f, "staging holds {got} bytes, the call needs {needed}")
            }
            CopyError::StagingOverlapsPool => f.write_str("staging overlaps the KV pool"),
            CopyError::OutOfBounds => f.write_str("range outside the buffer"),
        }
    }
}
impl std::error::Error for CopyError {}

impl From<LayoutError> for CopyError {
    fn from(e: LayoutError) -> Self {
        CopyError::Layout(e)
    }
}
