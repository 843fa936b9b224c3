//! The NIXL transport's plans: how a request's pieces merge into descriptors, and when a
//! device READ was slow enough to be one UCX emulated in software.

use std::time::Duration;

/// A fetch of device memory into device memory of at least this many bytes is checked for a
/// software-emulated READ ([`slow_device_read`]).
pub(super) const SLOW_READ_MIN_BYTES: u64 = 32 << 20;
/// ... and only when its descriptors carry at least this much each on average: UCX pays about
/// 10 us per descriptor, which alone cannot bring a READ of 1 MiB pieces under 100 GB/s, so a
/// slow one of them is not a matter of small pieces.
pub(super) const SLOW_READ_MIN_DESCRIPTOR_BYTES: u64 = 1 << 20;
/// Below this rate such a fetch counts as slow (`AgentStats::nixl_slow_reads`): UCX's emulated
/// device READ runs at about 0.4 GB/s, its CUDA-IPC zero-copy at 100+ GB/s, GPUDirect RDMA at
/// tens of GB/s.
pub(super) const SLOW_READ_BYTES_PER_S: f64 = 2e9;
/// The rate of a verified fetch of `bytes` of device memory into device memory in
/// `descriptors` descriptors whose READs took `took` (from building the first request to the
/// last one seen finished), when it is slow enough to be a READ UCX emulated in software: at
/// least [`SLOW_READ_MIN_BYTES`], [`SLOW_READ_MIN_DESCRIPTOR_BYTES`] per descriptor, under
/// [`SLOW_READ_BYTES_PER_S`]. Smaller fetches are not judged (their setup dominates), nor
/// fetches of small pieces (UCX's cost per descriptor does).
pub(super) fn slow_device_read(bytes: u64, descriptors: u64, took: Duration) -> Option<f64> {
    if bytes < SLOW_READ_MIN_BYTES || bytes < descriptors.saturating_mul(SLOW_READ_MIN_DESCRIPTOR_BYTES) {
        return None;
    }
    let rate = bytes as f64 / took.as_secs_f64().max(1e-9);
    (rate < SLOW_READ_BYTES_PER_S).then_some(rate)
}

/// The `(local address, remote address, bytes)` pieces that move offered `blocks` (source ids)
/// into `dst`, into `out`, each piece that continues the previous one at both ends merged into
/// it. Taken block by block (each block's segments in turn), which merges a block-major pool's
/// consecutive blocks into one piece, or with `segment_major` segment by segment (each
/// segment's blocks in turn), which merges a pool whose segments hold their blocks side by side
/// (one segment per layer or per head: a run of blocks is one piece per segment). The caller
/// takes the shorter list (so it calls this twice per request). Cost: one pass over blocks x
/// segments, no allocation once `out` has grown. Addresses come from an offer `InPlaceOffer::check` passed (no overflow).
pub(super) fn merge_runs(
    local: &[crate::copy::Segment],
    remote: &[(u64, u64, u64)],
    blocks: &[crate::agent::wire::OfferedBlock],
    dst: &[u32],
    segment_major: bool,
    out: &mut Vec<(u64, u64, u64)>,
) {
    out.clear();
    let mut run: Option<(u64, u64, u64)> = None;
    let mut add = |i: usize, s: usize| {
        let (g, (rbase, rstride, len)) = (&local[s], remote[s]);
        let l = g.base + u64::from(dst[i]) * g.block_stride;
        let r = rbase + u64::from(blocks[i].0) * rstride;
        run = match run {
            Some((rl, rr, n)) if rl + n == l && rr + n == r => Some((rl, rr, n + len)),
            Some(prev) => {
                out.push(prev);
                Some((l, r, len))
            }
            None => Some((l, r, len)),
        };
    };
    let (n, segs) = (blocks.len().min(dst.len()), local.len().min(remote.len()));
    if segment_major {
        (0..segs).for_each(|s| (0..n).for_each(|i| add(i, s)));
    } else {
        (0..n).for_each(|i| (0..segs).for_each(|s| add(i, s)));
    }
    out.extend(run);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_large_slow_device_reads_count() {
        let ms = Duration::from_millis;
        // the emulated READ measured on one H200: 1 GiB at 0.42 GB/s
        let r = slow_device_read(1 << 30, 4, ms(2557)).expect("0.42 GB/s is slow");
        assert!((r - 0.42e9).abs() < 0.01e9, "{r}");
        // CUDA-IPC zero-copy, GPUDirect RDMA: not slow
        assert_eq!(slow_device_read(1 << 30, 4, ms(5)), None);
        assert_eq!(slow_device_read(64 << 20, 1, ms(10)), None);
        // the bounds: 32 MiB is judged, less is not
        assert!(slow_device_read(SLOW_READ_MIN_BYTES, 1, ms(100)).is_some());
        assert_eq!(slow_device_read(SLOW_READ_MIN_BYTES - 1, 1, ms(1000)), None);
        assert!(slow_device_read(2_000_000_000, 1, ms(1001)).is_some());
        assert_eq!(slow_device_read(2_000_000_000, 1, ms(999)), None);
        assert_eq!(slow_device_read(1 << 30, 4, Duration::ZERO), None);
        // small pieces are slow for another reason (UCX's cost per descriptor): not judged;
        // 1 MiB per descriptor on average is
        assert_eq!(slow_device_read(1 << 30, 131_072, ms(5000)), None);
        assert_eq!(slow_device_read(64 << 20, 65, ms(1000)), None);
        assert!(slow_device_read(64 << 20, 64, ms(1000)).is_some());
    }

    #[test]
    fn runs_merge_in_the_order_that_joins_more() {
        use crate::copy::Segment;
        let seg = |base, block_stride, bytes_per_block| Segment { base, block_stride, bytes_per_block };
        let remote = |l: &[Segment], off: u64| -> Vec<(u64, u64, u64)> {
            l.iter().map(|g| (g.base + off, g.block_stride, g.bytes_per_block)).collect()
        };
        let blocks: Vec<crate::agent::wire::OfferedBlock> = (2..6).map(|i| (i, 0, [0; 32])).collect();
        let dst = [10u32, 11, 12, 13];
        let (mut a, mut b) = (Vec::new(), Vec::new());
        // block-major (two 256-byte segments per 512-byte block): one piece block by block,
        // one per (block, segment) segment by segment
        let bm = [seg(0x10000, 512, 256), seg(0x10100, 512, 256)];
        merge_runs(&bm, &remote(&bm, 0x100000), &blocks, &dst, false, &mut a);
        merge_runs(&bm, &remote(&bm, 0x100000), &blocks, &dst, true, &mut b);
        assert_eq!(a, vec![(0x10000 + 10 * 512, 0x110000 + 2 * 512, 4 * 512)]);
        assert_eq!(b.len(), 8);
        // one segment per head, its blocks side by side: one piece per segment segment by
        // segment, one per (block, segment) block by block
        let hm = [seg(0x10000, 256, 256), seg(0x20000, 256, 256), seg(0x30000, 256, 256)];
        merge_runs(&hm, &remote(&hm, 0x100000), &blocks, &dst, false, &mut a);
        merge_runs(&hm, &remote(&hm, 0x100000), &blocks, &dst, true, &mut b);
        assert_eq!(a.len(), 12);
        let want: Vec<_> = hm.iter().map(|g| (g.base + 10 * 256, g.base + 0x100000 + 2 * 256, 4 * 256)).collect();
        assert_eq!(b, want);
        // every byte is moved once either way
        let bytes = |v: &[(u64, u64, u64)]| v.iter().map(|r| r.2).sum::<u64>();
        assert_eq!((bytes(&a), bytes(&b)), (3 * 4 * 256, 3 * 4 * 256));
        // destinations out of order: nothing merges across a gap at either end
        merge_runs(&hm, &remote(&hm, 0x100000), &blocks, &[13, 12, 11, 10], true, &mut b);
        assert_eq!(b.len(), 12);
        // byte by byte, both orders, layouts whose pieces touch within a block, across blocks,
        // or not at all, ids with gaps: every destination byte of every (block, segment) piece
        // is written once, from its source byte, and nothing else is written
        let layouts: [&[Segment]; 3] = [
            &[seg(0x1000, 48, 16), seg(0x1010, 48, 32)],
            &[seg(0x1000, 16, 16), seg(0x2000, 32, 32), seg(0x3000, 16, 16)],
            &[seg(0x1000, 64, 16), seg(0x1020, 64, 16)],
        ];
        let pairs: [&[(u32, u32)]; 3] = [&[(0, 0), (1, 1), (2, 2)], &[(4, 1), (5, 2), (7, 3), (2, 9)], &[(3, 3)]];
        for l in layouts {
            let r = remote(l, 0x40000);
            for p in pairs {
                let blocks: Vec<crate::agent::wire::OfferedBlock> = p.iter().map(|&(s, _)| (s, 0, [0; 32])).collect();
                let dst: Vec<u32> = p.iter().map(|&(_, d)| d).collect();
                let mut want = std::collections::BTreeMap::new();
                for &(src, d) in p {
                    for (g, &(rb, rs, len)) in l.iter().zip(&r) {
                        for o in 0..len {
                            let to = g.base + u64::from(d) * g.block_stride + o;
                            let from = rb + u64::from(src) * rs + o;
                            assert!(want.insert(to, from).is_none());
                        }
                    }
                }
                for order in [false, true] {
                    merge_runs(l, &r, &blocks, &dst, order, &mut a);
                    let mut got = std::collections::BTreeMap::new();
                    for &(to, from, n) in &a {
                        for o in 0..n {
                            assert!(got.insert(to + o, from + o).is_none(), "byte {:#x} written twice", to + o);
                        }
                    }
                    assert_eq!(got, want, "layout {l:?}, pairs {p:?}, segment_major {order}");
                }
            }
        }
    }
}
