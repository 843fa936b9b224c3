//! The copy kernel: its CUDA source (compiled once per engine with NVRTC), the parameter
//! blocks it takes, its launch, and the pinned id ring for calls larger than one parameter
//! block, whose slots the kernel itself releases.

use std::ffi::c_void;

use cudarc::driver::sys;

use super::*;
use crate::block_mac::NhSums;
use crate::copy::CopyError;

/// Block ids carried by one kernel launch.
pub const IDS_PER_LAUNCH: usize = 960;
/// Default CTA budget of the kernel.
pub const DEFAULT_CTAS: u32 = 16;
/// Default threads per CTA of the kernel.
pub const DEFAULT_THREADS: u32 = 512;

pub(super) const KERNEL: &str = r#"
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
__device__ __forceinline__ unsigned long long kvrelay_fmix64(unsigned long long x) {
  x ^= x >> 33; x *= 0xff51afd7ed558ccdULL; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL; x ^= x >> 33;
  return x;
}
struct SumParams {
  unsigned long long segs, sums, keys, nh;
  unsigned int n_seg, n_ids, n_pieces, piece_words;
  unsigned int ids[960];
};
// One NH term of kvrelay::block_mac: (lo(w) + lo(k)) * (hi(w) + hi(k)), 32-bit adds, a 32 by
// 32 bit product.
__device__ __forceinline__ unsigned long long kvrelay_nh(const unsigned long long w, const unsigned long long k) {
  const unsigned lo = (unsigned)w + (unsigned)k, hi = (unsigned)(w >> 32) + (unsigned)(k >> 32);
  return (unsigned long long)lo * (unsigned long long)hi;
}
// The terms of kvrelay::checksum summed where the bytes lie: one warp per piece (of
// piece_words words, a multiple of 256 the host sizes so that the launch fills every SM) of a
// (block, segment) chunk, so that one block or a few large ones still spread over every SM;
// each word is keyed by its position in the block-major staged block; sums[i] collects block
// i's terms (the host zeroes it first and applies the final mix). Each lane has four loads in
// flight per step. With TAGS (keys: the block key's stream, word j of the staged block keyed
// by keys[j] and keys[j + 1]), the two NH sums of kvrelay::block_mac too, into nh[2i] and
// nh[2i + 1], from the same loads (the key stream is read by every block: it stays in L2).
template <bool TAGS>
__device__ __forceinline__ void kvrelay_sum_body(const SumParams& p) {
  const Seg* segs = (const Seg*)p.segs;
  const unsigned long long* K = (const unsigned long long*)p.keys;
  const unsigned lane = threadIdx.x & 31u;
  const unsigned long long wpc = blockDim.x >> 5;
  const unsigned long long warp = (unsigned long long)blockIdx.x * wpc + (threadIdx.x >> 5);
  const unsigned long long nwarps = (unsigned long long)gridDim.x * wpc;
  const unsigned long long per_block = (unsigned long long)p.n_seg * p.n_pieces;
  const unsigned long long n_chunks = (unsigned long long)p.n_ids * per_block;
  for (unsigned long long c = warp; c < n_chunks; c += nwarps) {
    const unsigned i = (unsigned)(c / per_block);
    const unsigned long long r = c - (unsigned long long)i * per_block;
    const unsigned s = (unsigned)(r / p.n_pieces);
    const unsigned long long q = r - (unsigned long long)s * p.n_pieces;
    const Seg g = segs[s];
    const unsigned long long n = g.bytes >> 3, first = g.stage_off >> 3;
    const unsigned long long piece = p.piece_words;
    const unsigned long long lo = q * piece;
    if (lo >= n) continue;
    const unsigned long long hi = lo + piece < n ? lo + piece : n;
    const unsigned long long* w = (const unsigned long long*)(g.base + (unsigned long long)p.ids[i] * g.stride);
    unsigned long long acc = 0, t1 = 0, t2 = 0;
    unsigned long long k = lo + lane;
    for (; k + 96 < hi; k += 128) {
      const unsigned long long a = w[k], b = w[k + 32], c2 = w[k + 64], d = w[k + 96];
      acc += kvrelay_fmix64(a ^ ((first + k + 1ULL) * 0x9E3779B97F4A7C15ULL));
      acc += kvrelay_fmix64(b ^ ((first + k + 33ULL) * 0x9E3779B97F4A7C15ULL));
      acc += kvrelay_fmix64(c2 ^ ((first + k + 65ULL) * 0x9E3779B97F4A7C15ULL));
      acc += kvrelay_fmix64(d ^ ((first + k + 97ULL) * 0x9E3779B97F4A7C15ULL));
      if (TAGS) {
        const unsigned long long j = first + k;
        t1 += kvrelay_nh(a, K[j]) + kvrelay_nh(b, K[j + 32]) + kvrelay_nh(c2, K[j + 64]) + kvrelay_nh(d, K[j + 96]);
        t2 += kvrelay_nh(a, K[j + 1]) + kvrelay_nh(b, K[j + 33]) + kvrelay_nh(c2, K[j + 65]) + kvrelay_nh(d, K[j + 97]);
      }
    }
    for (; k < hi; k += 32) {
      const unsigned long long a = w[k];
      acc += kvrelay_fmix64(a ^ ((first + k + 1ULL) * 0x9E3779B97F4A7C15ULL));
      if (TAGS) {
        t1 += kvrelay_nh(a, K[first + k]);
        t2 += kvrelay_nh(a, K[first + k + 1]);
      }
    }
    for (int off = 16; off > 0; off >>= 1) {
      acc += __shfl_down_sync(0xffffffffu, acc, off);
      if (TAGS) {
        t1 += __shfl_down_sync(0xffffffffu, t1, off);
        t2 += __shfl_down_sync(0xffffffffu, t2, off);
      }
    }
    if (lane == 0) {
      atomicAdd(((unsigned long long*)p.sums) + i, acc);
      if (TAGS) {
        atomicAdd(((unsigned long long*)p.nh) + 2 * i, t1);
        atomicAdd(((unsigned long long*)p.nh) + 2 * i + 1, t2);
      }
    }
  }
}
extern "C" __global__ void __launch_bounds__(512) kvrelay_sum(const SumParams p) {
  if (p.keys) kvrelay_sum_body<true>(p); else kvrelay_sum_body<false>(p);
}
struct SrcSeg { unsigned long long base, stride; };
struct CopySumParams {
  unsigned long long segs, src_segs, sums, keys, nh;
  unsigned int n_seg, n_ids, n_pieces, piece_words;
  unsigned int ids[480];
  unsigned int src_ids[480];
};
__device__ __forceinline__ unsigned long long kvrelay_terms(const uint4 v, const unsigned long long pos) {
  const unsigned long long w0 = (unsigned long long)v.x | ((unsigned long long)v.y << 32);
  const unsigned long long w1 = (unsigned long long)v.z | ((unsigned long long)v.w << 32);
  return kvrelay_fmix64(w0 ^ (pos * 0x9E3779B97F4A7C15ULL)) + kvrelay_fmix64(w1 ^ ((pos + 1ULL) * 0x9E3779B97F4A7C15ULL));
}
// The NH terms of the two words of v, the first being word j of the staged block.
__device__ __forceinline__ void kvrelay_nh_terms(const uint4 v, const unsigned long long* K, const unsigned long long j,
    unsigned long long& t1, unsigned long long& t2) {
  const unsigned long long w0 = (unsigned long long)v.x | ((unsigned long long)v.y << 32);
  const unsigned long long w1 = (unsigned long long)v.z | ((unsigned long long)v.w << 32);
  const unsigned long long k0 = K[j], k1 = K[j + 1], k2 = K[j + 2];
  t1 += kvrelay_nh(w0, k0) + kvrelay_nh(w1, k1);
  t2 += kvrelay_nh(w0, k1) + kvrelay_nh(w1, k2);
}
// Copy blocks of another pool (src_segs: its segments' bases, mapped here, and strides) into
// this pool's blocks and sum them on the way, with kvrelay_sum's pieces and keys: the words
// summed are the registers written, so sums[i] is block ids[i]'s sum as it landed, for the
// HBM traffic of a copy alone (one read, one write per byte). 16-byte words, four in flight
// per lane. With TAGS, the NH sums of what landed too, as in kvrelay_sum.
template <bool TAGS>
__device__ __forceinline__ void kvrelay_copy_sum_body(const CopySumParams& p) {
  const Seg* segs = (const Seg*)p.segs;
  const SrcSeg* src_segs = (const SrcSeg*)p.src_segs;
  const unsigned long long* K = (const unsigned long long*)p.keys;
  const unsigned lane = threadIdx.x & 31u;
  const unsigned long long wpc = blockDim.x >> 5;
  const unsigned long long warp = (unsigned long long)blockIdx.x * wpc + (threadIdx.x >> 5);
  const unsigned long long nwarps = (unsigned long long)gridDim.x * wpc;
  const unsigned long long per_block = (unsigned long long)p.n_seg * p.n_pieces;
  const unsigned long long n_chunks = (unsigned long long)p.n_ids * per_block;
  const unsigned long long piece = p.piece_words / 2ULL;
  for (unsigned long long c = warp; c < n_chunks; c += nwarps) {
    const unsigned i = (unsigned)(c / per_block);
    const unsigned long long r = c - (unsigned long long)i * per_block;
    const unsigned s = (unsigned)(r / p.n_pieces);
    const unsigned long long q = r - (unsigned long long)s * p.n_pieces;
    const Seg g = segs[s];
    const SrcSeg sg = src_segs[s];
    const unsigned long long n = g.bytes >> 4, first = g.stage_off >> 3;
    const unsigned long long lo = q * piece;
    if (lo >= n) continue;
    const unsigned long long hi = lo + piece < n ? lo + piece : n;
    const uint4* src = (const uint4*)(sg.base + (unsigned long long)p.src_ids[i] * sg.stride);
    uint4* dst = (uint4*)(g.base + (unsigned long long)p.ids[i] * g.stride);
    unsigned long long acc = 0, t1 = 0, t2 = 0;
    unsigned long long k = lo + lane;
    for (; k + 96 < hi; k += 128) {
      const uint4 a = src[k], b = src[k + 32], c2 = src[k + 64], d = src[k + 96];
      dst[k] = a; dst[k + 32] = b; dst[k + 64] = c2; dst[k + 96] = d;
      acc += kvrelay_terms(a, first + 2ULL * k + 1ULL);
      acc += kvrelay_terms(b, first + 2ULL * (k + 32) + 1ULL);
      acc += kvrelay_terms(c2, first + 2ULL * (k + 64) + 1ULL);
      acc += kvrelay_terms(d, first + 2ULL * (k + 96) + 1ULL);
      if (TAGS) {
        kvrelay_nh_terms(a, K, first + 2ULL * k, t1, t2);
        kvrelay_nh_terms(b, K, first + 2ULL * (k + 32), t1, t2);
        kvrelay_nh_terms(c2, K, first + 2ULL * (k + 64), t1, t2);
        kvrelay_nh_terms(d, K, first + 2ULL * (k + 96), t1, t2);
      }
    }
    for (; k < hi; k += 32) {
      const uint4 a = src[k];
      dst[k] = a;
      acc += kvrelay_terms(a, first + 2ULL * k + 1ULL);
      if (TAGS) kvrelay_nh_terms(a, K, first + 2ULL * k, t1, t2);
    }
    for (int off = 16; off > 0; off >>= 1) {
      acc += __shfl_down_sync(0xffffffffu, acc, off);
      if (TAGS) {
        t1 += __shfl_down_sync(0xffffffffu, t1, off);
        t2 += __shfl_down_sync(0xffffffffu, t2, off);
      }
    }
    if (lane == 0) {
      atomicAdd(((unsigned long long*)p.sums) + i, acc);
      if (TAGS) {
        atomicAdd(((unsigned long long*)p.nh) + 2 * i, t1);
        atomicAdd(((unsigned long long*)p.nh) + 2 * i + 1, t2);
      }
    }
  }
}
extern "C" __global__ void __launch_bounds__(512) kvrelay_copy_sum(const CopySumParams p) {
  if (p.keys) kvrelay_copy_sum_body<true>(p); else kvrelay_copy_sum_body<false>(p);
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
pub(super) struct SegRow {
    pub(super) base: u64,
    pub(super) stride: u64,
    pub(super) bytes: u64,
    pub(super) stage_off: u64,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct RingParams {
    pub(super) segs: u64,
    pub(super) staging: u64,
    pub(super) stage_block_bytes: u64,
    pub(super) ids: u64,
    pub(super) done: u64,
    pub(super) counter: u64,
    pub(super) gen: u64,
    pub(super) n_seg: u32,
    pub(super) n_ids: u32,
    pub(super) to_staging: u32,
    pub(super) pad: u32,
}

/// Block ids carried by one launch through the id ring.
///
/// Slot reuse is signalled by the kernel itself (the last CTA writes the launch's generation to a
/// pinned flag), so a call makes one driver call: the launch.
pub const RING_IDS_PER_LAUNCH: usize = 16384;
pub(super) const RING_SLOTS: usize = 32;

#[repr(C)]
pub(super) struct SumParams {
    pub(super) segs: u64,
    pub(super) sums: u64,
    /// The block key's stream on the device (0: no tags).
    pub(super) keys: u64,
    /// Where the NH sums go (two per block), when `keys` is set.
    pub(super) nh: u64,
    pub(super) n_seg: u32,
    pub(super) n_ids: u32,
    /// Pieces of `piece_words` words in the largest segment (each a warp's work).
    pub(super) n_pieces: u32,
    /// Words of one piece (a multiple of 256, at most [`SUM_PIECE_WORDS`]).
    pub(super) piece_words: u32,
    pub(super) ids: [u32; IDS_PER_LAUNCH],
}

/// Blocks one launch of the copy-and-sum kernel carries (destination and source ids).
pub const COPY_SUM_IDS: usize = 480;

#[repr(C)]
pub(super) struct CopySumParams {
    pub(super) segs: u64,
    pub(super) src_segs: u64,
    pub(super) sums: u64,
    /// As in [`SumParams`].
    pub(super) keys: u64,
    pub(super) nh: u64,
    pub(super) n_seg: u32,
    pub(super) n_ids: u32,
    pub(super) n_pieces: u32,
    pub(super) piece_words: u32,
    pub(super) ids: [u32; COPY_SUM_IDS],
    pub(super) src_ids: [u32; COPY_SUM_IDS],
}

/// Most words one warp of the summing kernels takes in one piece (64 KiB: large calls).
pub(super) const SUM_PIECE_WORDS: u64 = 8192;
/// Fewest words of one piece (2 KiB: one step of a warp of the copy-and-sum kernel).
pub(super) const MIN_PIECE_WORDS: u64 = 256;

#[repr(C)]
pub(super) struct Params {
    pub(super) segs: u64,
    pub(super) staging: u64,
    pub(super) stage_block_bytes: u64,
    pub(super) n_seg: u32,
    pub(super) n_ids: u32,
    pub(super) to_staging: u32,
    pub(super) pad: u32,
    pub(super) ids: [u32; IDS_PER_LAUNCH],
}

impl CudaEngine {
    /// Launch the copy kernel for `ids` against staging at device address `staging_base`.
    ///
    /// # Safety
    /// `stream` as in [`CudaEngine::gather_raw`]; ids checked; `staging_base` addresses at least
    /// `ids.len()` staged blocks.
    pub(super) unsafe fn launch_kernel(
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
    /// slot's flag): kvrelay waits only on its own launch, never on the context or on other
    /// work. Spins with yields for a millisecond (with 32 slots a wait only happens when the
    /// caller enqueues faster than the GPU drains for a long time), then polls the flag every
    /// 50 us and asks an idle stream of kvrelay's own whether the context has failed (a sticky
    /// error: then nothing will ever publish the flag, and the wait ends). Worst case: as long
    /// as the GPU takes to reach and run that launch, i.e. what the caller enqueued before it
    /// on that stream.
    pub(super) fn wait_slot(&self, slot: usize) {
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
                let probe = self.ring_probe.as_ref().expect("created with the ring");
                let failed = match self.dev.bind() {
                    Ok(_ctx) => {
                        // SAFETY: a live stream of this engine's context, current on this thread.
                        let r = unsafe { sys::cuStreamQuery(probe.raw()) };
                        r != sys::CUresult::CUDA_SUCCESS && r != sys::CUresult::CUDA_ERROR_NOT_READY
                    }
                    Err(_) => true,
                };
                if failed {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_micros(50));
                continue;
            }
            std::thread::yield_now();
        }
    }
}

/// The summing kernels' buffers, made on an engine's first checksum call: the per-block sums
/// (device, zeroed before each launch, and the pinned host copy they come back to), both
/// kernels' parameter blocks, and the source segment table of a copy from another pool.
pub(super) struct SumState {
    /// `IDS_PER_LAUNCH` sums, then two NH sums per block (the keyed tags').
    dev: DeviceBuffer,
    host: PinnedBuffer,
    params: Box<SumParams>,
    copy: Box<CopySumParams>,
    src_dev: DeviceBuffer,
    src_host: PinnedBuffer,
    /// What `src_dev` holds (empty: unknown), so that fetches from one source upload it once.
    src_uploaded: Vec<(u64, u64)>,
}

impl CudaEngine {
    /// The summing buffers (made on first use).
    fn sum_state(&mut self) -> Result<&mut SumState, CopyError> {
        if self.sum_func.is_null() || self.copy_sum_func.is_null() {
            return Err(CopyError::Unsupported("checksums need the copy kernel (methods Kernel, Staged)"));
        }
        if self.sums.is_none() {
            let dev = DeviceBuffer::alloc(&self.dev, IDS_PER_LAUNCH * 24)?;
            let nh = dev.ptr() + IDS_PER_LAUNCH as u64 * 8;
            let n_seg = self.params.n_seg;
            let src_bytes = (n_seg as usize * 16).max(16);
            let src_dev = DeviceBuffer::alloc(&self.dev, src_bytes)?;
            let (segs, sums) = (self.params.segs, dev.ptr());
            self.sums = Some(Box::new(SumState {
                host: PinnedBuffer::alloc(&self.dev, IDS_PER_LAUNCH * 24)?,
                src_host: PinnedBuffer::alloc(&self.dev, src_bytes)?,
                params: Box::new(SumParams {
                    segs,
                    sums,
                    keys: 0,
                    nh,
                    n_seg,
                    n_ids: 0,
                    n_pieces: 0,
                    piece_words: 0,
                    ids: [0; IDS_PER_LAUNCH],
                }),
                copy: Box::new(CopySumParams {
                    segs,
                    src_segs: src_dev.ptr(),
                    sums,
                    keys: 0,
                    nh,
                    n_seg,
                    n_ids: 0,
                    n_pieces: 0,
                    piece_words: 0,
                    ids: [0; COPY_SUM_IDS],
                    src_ids: [0; COPY_SUM_IDS],
                }),
                dev,
                src_dev,
                src_uploaded: Vec::with_capacity(n_seg as usize),
            }));
        }
        Ok(self.sums.as_mut().expect("set above"))
    }

    /// How a summing launch over `n` blocks is cut: `(piece_words, n_pieces, ctas)`. One warp
    /// per piece, at most one wave of CTAs (as many per SM as fit at once; the copy kernels'
    /// CTA budget is for PCIe traffic, these read HBM and need every SM); pieces as large as [`SUM_PIECE_WORDS`] when the call
    /// fills every SM with them, smaller (down to [`MIN_PIECE_WORDS`]) when it does not, so
    /// that a one-block call still runs on every SM instead of one per (block, segment).
    fn sum_grid(&self, n: usize) -> (u32, u32, u32) {
        let segs = self.layout.segments();
        let words: u64 = n as u64 * segs.iter().map(|g| g.bytes_per_block / 8).sum::<u64>();
        let warps_per_cta = u64::from(self.opts.threads / 32).max(1);
        let max_ctas = u64::from(self.dev.multiprocessors()) * u64::from(self.sum_ctas_per_sm);
        let piece = words
            .div_ceil(max_ctas * warps_per_cta)
            .next_multiple_of(MIN_PIECE_WORDS)
            .clamp(MIN_PIECE_WORDS, SUM_PIECE_WORDS);
        let n_pieces = segs.iter().map(|g| (g.bytes_per_block / 8).div_ceil(piece)).max().unwrap_or(1).max(1);
        let pieces = n as u64 * segs.len() as u64 * n_pieces;
        let ctas = pieces.div_ceil(warps_per_cta).clamp(1, max_ctas);
        (piece as u32, n_pieces.try_into().unwrap_or(u32::MAX), ctas as u32)
    }

    /// Zero `n` sums (and, with `tags`, their NH sums), launch `func` with the parameter block
    /// `params`, bring the sums back, wait for `stream`, and finish them into `out` (the NH
    /// sums into `tags`, unfinished: the block key's finish is the caller's).
    ///
    /// # Safety
    /// `func` takes one parameter block at `params` whose sums pointer is `st.dev` and which
    /// touches only memory the caller's contract covers; `n` fits the sums buffer.
    #[allow(clippy::too_many_arguments)] // the launch's parts
    unsafe fn launch_summing(
        st: &mut SumState,
        func: sys::CUfunction,
        params: *mut c_void,
        ctas: u32,
        threads: u32,
        stream: &CudaStream,
        sbb: u64,
        out: &mut [u64],
        tags: Option<&mut [NhSums]>,
    ) -> Result<(), CopyError> {
        let n = out.len();
        let nh_at = IDS_PER_LAUNCH * 8;
        let mut args = [params];
        // SAFETY: the sums buffer holds IDS_PER_LAUNCH u64s (zeroed here first); the kernel and
        // its parameter block are the caller's per the contract; the host copy lands in pinned
        // memory of the right size and is read only after the stream synchronized; the stream
        // is this library's.
        unsafe {
            check(sys::cuMemsetD8Async(st.dev.ptr(), 0, n * 8, stream.raw()), "cuMemsetD8Async")?;
            if tags.is_some() {
                check(sys::cuMemsetD8Async(st.dev.ptr() + nh_at as u64, 0, n * 16, stream.raw()), "cuMemsetD8Async")?;
            }
            check(
                sys::cuLaunchKernel(
                    func,
                    ctas,
                    1,
                    1,
                    threads,
                    1,
                    1,
                    0,
                    stream.raw(),
                    args.as_mut_ptr(),
                    std::ptr::null_mut(),
                ),
                "cuLaunchKernel",
            )?;
            check(
                sys::cuMemcpyDtoHAsync_v2(
                    st.host.as_mut_slice().as_mut_ptr().cast(),
                    st.dev.ptr(),
                    n * 8,
                    stream.raw(),
                ),
                "cuMemcpyDtoHAsync",
            )?;
            if tags.is_some() {
                check(
                    sys::cuMemcpyDtoHAsync_v2(
                        st.host.as_mut_slice()[nh_at..].as_mut_ptr().cast(),
                        st.dev.ptr() + nh_at as u64,
                        n * 16,
                        stream.raw(),
                    ),
                    "cuMemcpyDtoHAsync",
                )?;
            }
        }
        stream.synchronize()?;
        let h = st.host.as_slice();
        let word = |at: usize| u64::from_le_bytes(h[at..at + 8].try_into().expect("8 bytes"));
        for (k, o) in out.iter_mut().enumerate() {
            *o = crate::checksum::kv_checksum_finish(word(k * 8), sbb);
        }
        if let Some(t) = tags {
            for (k, o) in t.iter_mut().enumerate() {
                *o = NhSums(word(nh_at + 16 * k), word(nh_at + 16 * k + 8));
            }
        }
        Ok(())
    }

    /// The checksums of blocks `ids` ([`crate::checksum::kv_checksum`] of each block's staged
    /// bytes), summed where the blocks lie by a kernel on `stream`: `out[i]` for `ids[i]`.
    /// Runs after the work enqueued on `stream` before it and waits for that stream only (no
    /// context- or device-wide wait). Host cost: one memset, one launch and one 8-byte-per-block
    /// copy per [`IDS_PER_LAUNCH`] blocks; no allocation after the first call. Needs the kernel
    /// (methods `Kernel` and `Staged`; [`CopyError::Unsupported`] otherwise).
    pub fn checksums(&mut self, ids: &[u32], out: &mut [u64], stream: &CudaStream) -> Result<(), CopyError> {
        self.checksums_tagged(ids, out, None, stream)
    }

    /// Give the summing kernels block key `mac`'s stream (one upload of about a block's bytes
    /// into device memory of this engine's own): from then on the calls that ask for tags
    /// ([`CudaEngine::checksums_tagged`], [`CudaEngine::copy_and_sum_from_tagged`]) take the
    /// NH sums of [`crate::block_mac`] from the loads that sum the checksums. `mac` must cover
    /// this layout's blocks ([`CopyError::InvalidOptions`] otherwise).
    pub fn set_block_key(&mut self, mac: &crate::block_mac::BlockMac) -> Result<(), CopyError> {
        let keys = mac.key_stream();
        if (keys.len() as u64) < self.layout.stage_block_bytes().div_ceil(8) + 1 {
            return Err(CopyError::InvalidOptions);
        }
        let bytes: Vec<u8> = keys.iter().flat_map(|k| k.to_le_bytes()).collect();
        let buf = DeviceBuffer::alloc(&self.dev, bytes.len())?;
        buf.write(0, &bytes)?;
        self.tag_keys = Some(buf);
        Ok(())
    }

    /// [`CudaEngine::checksums`], and with `tags` (its block key set: [`CudaEngine::set_block_key`],
    /// else [`CopyError::Unsupported`]) each block's NH sums, which the block key's
    /// [`crate::block_mac::BlockMac::finish`] turns into its tag: `tags[i]` for `ids[i]`. The
    /// tags cost no extra pass over the blocks (the same loads; the key stream stays in L2).
    pub fn checksums_tagged(
        &mut self,
        ids: &[u32],
        out: &mut [u64],
        mut tags: Option<&mut [NhSums]>,
        stream: &CudaStream,
    ) -> Result<(), CopyError> {
        assert_eq!(ids.len(), out.len(), "CudaEngine::checksums: one output per id");
        assert!(tags.as_ref().is_none_or(|t| t.len() == ids.len()), "CudaEngine::checksums_tagged: one tag per id");
        let keys = match (&tags, &self.tag_keys) {
            (None, _) => 0,
            (Some(_), Some(k)) => k.ptr(),
            (Some(_), None) => return Err(CopyError::Unsupported("tags need the block key (set_block_key)")),
        };
        // repeated ids are fine (reads only); the staging check is moot: no staging
        self.checker.check(&self.layout, ids, u64::MAX, false)?;
        let _ctx = self.dev.bind()?;
        let (sbb, threads) = (self.layout.stage_block_bytes(), self.opts.threads);
        let func = self.sum_func;
        self.sum_state()?;
        for (k, (part, o)) in ids.chunks(IDS_PER_LAUNCH).zip(out.chunks_mut(IDS_PER_LAUNCH)).enumerate() {
            let (piece_words, n_pieces, ctas) = self.sum_grid(part.len());
            let st = self.sums.as_mut().expect("made above");
            (st.params.piece_words, st.params.n_pieces) = (piece_words, n_pieces);
            st.params.n_ids = part.len() as u32;
            st.params.keys = keys;
            st.params.ids[..part.len()].copy_from_slice(part);
            let params = (&mut *st.params as *mut SumParams).cast::<c_void>();
            let t = tags.as_deref_mut().map(|t| &mut t[k * IDS_PER_LAUNCH..k * IDS_PER_LAUNCH + part.len()]);
            // SAFETY: `kvrelay_sum` takes one `SumParams` (same layout as the CUDA struct) and
            // reads only blocks of the layout (ids checked) and, with keys, the key stream
            // (at least a block's words plus one: `set_block_key`); `part` fits the sums buffer.
            unsafe { Self::launch_summing(st, func, params, ctas, threads, stream, sbb, o, t)? };
        }
        Ok(())
    }

    /// Copy blocks `src_ids` of another pool into this pool's blocks `ids` and sum them on the
    /// way, in one kernel on `stream`: `out[i]` is [`crate::checksum::kv_checksum`] of block
    /// `ids[i]` as it landed (the kernel sums the very words it writes), for the memory traffic
    /// of the copy alone. The other pool has this layout's segment sizes; `src_segs[s]` is its
    /// segment `s`'s base address (in this context: memory another process exported and this
    /// one mapped, or this process's own) and block stride, both multiples of 16 bytes.
    /// Runs after the work enqueued on `stream` before it; returns once the stream passed it,
    /// also on an error. Host cost: a segment-table upload when `src_segs` differs from the
    /// last call's, then one memset, one launch and one 8-byte-per-block copy per
    /// [`COPY_SUM_IDS`] blocks; no allocation after the first call.
    ///
    /// # Safety
    /// For every `i` and segment `s`, the `bytes_per_block` bytes at `src_segs[s].0 +
    /// src_ids[i] * src_segs[s].1` are device memory readable in this context and unwritten
    /// until this returns; the destination blocks `ids` are not read or written by anything
    /// else meanwhile.
    pub unsafe fn copy_and_sum_from(
        &mut self,
        src_segs: &[(u64, u64)],
        src_ids: &[u32],
        ids: &[u32],
        out: &mut [u64],
        stream: &CudaStream,
    ) -> Result<(), CopyError> {
        // SAFETY: forwarded contract.
        unsafe { self.copy_and_sum_from_tagged(src_segs, src_ids, ids, out, None, stream) }
    }

    /// [`CudaEngine::copy_and_sum_from`], and with `tags` the NH sums of each block as it
    /// landed, as [`CudaEngine::checksums_tagged`] gives them.
    ///
    /// # Safety
    /// As [`CudaEngine::copy_and_sum_from`].
    pub unsafe fn copy_and_sum_from_tagged(
        &mut self,
        src_segs: &[(u64, u64)],
        src_ids: &[u32],
        ids: &[u32],
        out: &mut [u64],
        mut tags: Option<&mut [NhSums]>,
        stream: &CudaStream,
    ) -> Result<(), CopyError> {
        assert!(tags.as_ref().is_none_or(|t| t.len() == ids.len()), "CudaEngine::copy_and_sum_from: one tag per id");
        let keys = match (&tags, &self.tag_keys) {
            (None, _) => 0,
            (Some(_), Some(k)) => k.ptr(),
            (Some(_), None) => return Err(CopyError::Unsupported("tags need the block key (set_block_key)")),
        };
        assert!(
            ids.len() == out.len() && ids.len() == src_ids.len(),
            "CudaEngine::copy_and_sum_from: one source id and one output per id"
        );
        if src_segs.len() != self.layout.segments().len() || src_segs.iter().any(|&(b, s)| b % 16 != 0 || s % 16 != 0) {
            return Err(CopyError::InvalidOptions);
        }
        // destination blocks: in the pool and each once (two writes to one block would race)
        self.checker.check(&self.layout, ids, u64::MAX, true)?;
        let _ctx = self.dev.bind()?;
        let (sbb, threads, func) = (self.layout.stage_block_bytes(), self.opts.threads, self.copy_sum_func);
        let st = self.sum_state()?;
        if st.src_uploaded != src_segs {
            st.src_uploaded.clear();
            for (o, &(base, stride)) in st.src_host.as_mut_slice().chunks_exact_mut(16).zip(src_segs) {
                o[..8].copy_from_slice(&base.to_le_bytes());
                o[8..].copy_from_slice(&stride.to_le_bytes());
            }
            // SAFETY: pinned host memory of at least `16 * n_seg` bytes into the device table
            // of the same size, on this library's stream; the host side is rewritten only after
            // the stream synchronized (every call ends with a synchronize, also on an error).
            let up = unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    st.src_dev.ptr(),
                    st.src_host.as_slice().as_ptr().cast(),
                    src_segs.len() * 16,
                    stream.raw(),
                )
            };
            if let Err(e) = check(up, "cuMemcpyHtoDAsync") {
                let _ = stream.synchronize();
                return Err(e);
            }
            st.src_uploaded.extend_from_slice(src_segs);
        }
        for (k, ((part, from), o)) in
            ids.chunks(COPY_SUM_IDS).zip(src_ids.chunks(COPY_SUM_IDS)).zip(out.chunks_mut(COPY_SUM_IDS)).enumerate()
        {
            let (piece_words, n_pieces, ctas) = self.sum_grid(part.len());
            let st = self.sums.as_mut().expect("made above");
            (st.copy.piece_words, st.copy.n_pieces) = (piece_words, n_pieces);
            st.copy.n_ids = part.len() as u32;
            st.copy.keys = keys;
            st.copy.ids[..part.len()].copy_from_slice(part);
            st.copy.src_ids[..part.len()].copy_from_slice(from);
            let params = (&mut *st.copy as *mut CopySumParams).cast::<c_void>();
            let t = tags.as_deref_mut().map(|t| &mut t[k * COPY_SUM_IDS..k * COPY_SUM_IDS + part.len()]);
            // SAFETY: `kvrelay_copy_sum` takes one `CopySumParams` (same layout as the CUDA
            // struct); it writes only blocks `ids` of the layout (checked, distinct) and reads
            // the source ranges the caller's contract covers and, with keys, the key stream (a
            // block's words plus one: `set_block_key`); `part` fits the sums buffer.
            let r = unsafe { Self::launch_summing(st, func, params, ctas, threads, stream, sbb, o, t) };
            if let Err(e) = r {
                let _ = stream.synchronize();
                st.src_uploaded.clear(); // whether the table arrived is unknown
                return Err(e);
            }
        }
        Ok(())
    }
}
