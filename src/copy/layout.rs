//! KV pool layouts as a table of segments, validated once.
//!
//! A *segment* is one (layer, K or V) slice of every block: block `b` of segment `s` lives at
//! `s.base + b * s.block_stride` and is `s.bytes_per_block` long. This covers:
//! - one pool per layer, K and V apart (vLLM `[2, blocks, ...]`): [`KvLayout::per_layer_kv_first`];
//! - one pool per layer, K and V of a block together (FlashInfer `[blocks, 2, ...]`):
//!   [`KvLayout::per_layer_block_first`];
//! - one pool whose block holds every layer (TensorRT-LLM `[blocks, layers, 2, ...]`):
//!   [`KvLayout::all_layers_per_block`];
//!
//! and anything else expressible as a table ([`KvLayout::new`]).
//!
//! Host staging is block-major: staged block `i` holds every segment's bytes of that block,
//! segment after segment, so one block can go to the network as one piece.

use std::fmt;

/// One (layer, K/V) slice of every block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Address of block 0 (a device address for the CUDA engine, a host address for the CPU
    /// engine).
    pub base: u64,
    /// Distance between consecutive blocks.
    pub block_stride: u64,
    /// Bytes of one block in this segment.
    pub bytes_per_block: u64,
}

/// A validated layout plus the block-major staging offsets derived from it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvLayout {
    num_blocks: u32,
    segments: Vec<Segment>,
    stage_offsets: Vec<u64>,
    stage_block_bytes: u64,
}

/// Why a layout was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LayoutError {
    /// No blocks or no segments, or more than [`MAX_SEGMENTS`] segments.
    Empty,
    /// A base, stride or size that is not a multiple of 16 bytes (the copy kernel moves 16-byte
    /// words), or a zero size.
    Alignment(usize),
    /// A block longer than its stride, or arithmetic that overflows 64 bits.
    Shape(usize),
    /// Two segments can address the same byte.
    Overlap(usize, usize),
    /// A segment reaches outside every pool extent given.
    Bounds(usize),
}

impl fmt::Display for LayoutError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LayoutError::Empty => write!(f, "a layout needs blocks and 1..={MAX_SEGMENTS} segments"),
            LayoutError::Alignment(s) => {
                write!(f, "segment {s}: base, stride and size must be non-zero multiples of 16 bytes")
            }
            LayoutError::Shape(s) => write!(f, "segment {s}: block larger than its stride, or address overflow"),
            LayoutError::Overlap(a, b) => write!(f, "segments {a} and {b} overlap"),
            LayoutError::Bounds(s) => write!(f, "segment {s} reaches outside the pools"),
        }
    }
}
impl std::error::Error for LayoutError {}

/// Most segments one layout may have (e.g. 1024 layers of K and V).
pub const MAX_SEGMENTS: usize = 2048;

impl KvLayout {
    /// Validate a segment table for `num_blocks` blocks. `pools` are the memory extents
    /// `(base, len)` the segments must stay inside; pass none to skip that check (the caller
    /// then vouches for bounds).
    ///
    /// Checks: every base, stride and size a non-zero multiple of 16 (size <= stride when there
    /// are several blocks); no two segments able to touch the same byte (segments whose spans
    /// intersect must share a stride and sit in disjoint windows of it, as K and V of an
    /// interleaved pool do); every segment inside one pool. Cost O(segments^2), once.
    pub fn new(num_blocks: u32, segments: Vec<Segment>, pools: &[(u64, u64)]) -> Result<KvLayout, LayoutError> {
        if num_blocks == 0 || segments.is_empty() || segments.len() > MAX_SEGMENTS {
            return Err(LayoutError::Empty);
        }
        let mut spans = Vec::with_capacity(segments.len());
        for (i, s) in segments.iter().enumerate() {
            if s.bytes_per_block == 0 || s.bytes_per_block % 16 != 0 || s.base % 16 != 0 || s.block_stride % 16 != 0 {
                return Err(LayoutError::Alignment(i));
            }
            if num_blocks > 1 && (s.block_stride == 0 || s.bytes_per_block > s.block_stride) {
                return Err(LayoutError::Shape(i));
            }
            let end = s
                .block_stride
                .checked_mul(u64::from(num_blocks - 1))
                .and_then(|x| x.checked_add(s.bytes_per_block))
                .and_then(|x| x.checked_add(s.base))
                .ok_or(LayoutError::Shape(i))?;
            spans.push((s.base, end));
            if !pools.is_empty()
                && !pools.iter().any(|&(b, l)| s.base >= b && b.checked_add(l).is_some_and(|pe| end <= pe))
            {
                return Err(LayoutError::Bounds(i));
            }
        }
        for i in 0..segments.len() {
            for j in i + 1..segments.len() {
                let (a, b) = (spans[i], spans[j]);
                if a.1 <= b.0 || b.1 <= a.0 {
                    continue; // spans apart
                }
                let (si, sj) = (segments[i], segments[j]);
                if num_blocks == 1 || si.block_stride != sj.block_stride {
                    return Err(LayoutError::Overlap(i, j));
                }
                // same stride: the windows of one block, taken modulo the stride, must not meet
                let st = si.block_stride;
                let (lo, hi, lo_len, hi_len) = if si.base <= sj.base {
                    (si.base, sj.base, si.bytes_per_block, sj.bytes_per_block)
                } else {
                    (sj.base, si.base, sj.bytes_per_block, si.bytes_per_block)
                };
                let d = (hi - lo) % st;
                if !(d >= lo_len && d + hi_len <= st) {
                    return Err(LayoutError::Overlap(i, j));
                }
            }
        }
        let mut stage_offsets = Vec::with_capacity(segments.len());
        let mut off = 0u64;
        for s in &segments {
            stage_offsets.push(off);
            off += s.bytes_per_block;
        }
        Ok(KvLayout { num_blocks, segments, stage_offsets, stage_block_bytes: off })
    }

    /// vLLM-style: one pool per layer shaped `[2, num_blocks, kv_block_bytes]` (all K blocks,
    /// then all V blocks). `layer_pools[l]` is layer l's base address.
    pub fn per_layer_kv_first(
        layer_pools: &[u64],
        num_blocks: u32,
        kv_block_bytes: u64,
    ) -> Result<KvLayout, LayoutError> {
        let v_offset = u64::from(num_blocks) * kv_block_bytes;
        KvLayout::per_layer(layer_pools, num_blocks, kv_block_bytes, |b| {
            [
                Segment { base: b, block_stride: kv_block_bytes, bytes_per_block: kv_block_bytes },
                Segment { base: b + v_offset, block_stride: kv_block_bytes, bytes_per_block: kv_block_bytes },
            ]
        })
    }

    /// FlashInfer-style: one pool per layer shaped `[num_blocks, 2, kv_block_bytes]` (K and V of
    /// a block side by side).
    pub fn per_layer_block_first(
        layer_pools: &[u64],
        num_blocks: u32,
        kv_block_bytes: u64,
    ) -> Result<KvLayout, LayoutError> {
        KvLayout::per_layer(layer_pools, num_blocks, kv_block_bytes, |b| {
            [0, 1].map(|kv| Segment {
                base: b + kv * kv_block_bytes,
                block_stride: 2 * kv_block_bytes,
                bytes_per_block: kv_block_bytes,
            })
        })
    }

    /// Per-layer pools of `2 * num_blocks * kv_block_bytes` bytes each, whose K and V segments
    /// `kv(base)` gives.
    fn per_layer(
        layer_pools: &[u64],
        num_blocks: u32,
        kv_block_bytes: u64,
        kv: impl Fn(u64) -> [Segment; 2],
    ) -> Result<KvLayout, LayoutError> {
        let pool_len = 2 * u64::from(num_blocks) * kv_block_bytes;
        let segs = layer_pools.iter().flat_map(|&b| kv(b)).collect();
        let pools: Vec<(u64, u64)> = layer_pools.iter().map(|&b| (b, pool_len)).collect();
        KvLayout::new(num_blocks, segs, &pools)
    }

    /// TensorRT-LLM-style: one pool shaped `[num_blocks, layers, 2, kv_block_bytes]`: a block
    /// holds every layer's K and V.
    pub fn all_layers_per_block(
        pool: u64,
        layers: u32,
        num_blocks: u32,
        kv_block_bytes: u64,
    ) -> Result<KvLayout, LayoutError> {
        let stride = u64::from(layers) * 2 * kv_block_bytes;
        let segs = (0..u64::from(layers) * 2)
            .map(|i| Segment { base: pool + i * kv_block_bytes, block_stride: stride, bytes_per_block: kv_block_bytes })
            .collect();
        KvLayout::new(num_blocks, segs, &[(pool, stride * u64::from(num_blocks))])
    }

    /// Number of blocks in the pool.
    pub fn num_blocks(&self) -> u32 {
        self.num_blocks
    }
    /// The segment table.
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }
    /// Bytes of one staged block (every segment).
    pub fn stage_block_bytes(&self) -> u64 {
        self.stage_block_bytes
    }
    /// Offset of segment `s` inside a staged block.
    pub fn stage_offset(&self, s: usize) -> u64 {
        self.stage_offsets[s]
    }
    /// Staging bytes needed for `blocks` blocks.
    pub fn staging_bytes(&self, blocks: usize) -> u64 {
        self.stage_block_bytes * blocks as u64
    }

    /// Every chunk of a call, in (block position, segment) order:
    /// `(pool address, offset in staging, bytes)`. The ids must have been checked.
    pub(crate) fn chunks<'a>(&'a self, ids: &'a [u32]) -> impl Iterator<Item = (u64, u64, u64)> + 'a {
        ids.iter().enumerate().flat_map(move |(i, &id)| {
            self.segments.iter().zip(&self.stage_offsets).map(move |(s, &off)| {
                (s.base + u64::from(id) * s.block_stride, i as u64 * self.stage_block_bytes + off, s.bytes_per_block)
            })
        })
    }
}
