//! The copy plans of the CUDA IPC transport: how offered blocks are read through the source's
//! memory mapped here, as one copy-and-sum kernel over translated segments or as copies run by
//! run. Pure: every address a source sends is checked against what it exported before a copy
//! uses it; `check_offer_plans` lets the fuzzer drive the same checks.

use super::offer::{decode_exports, encode_exports};
use crate::agent::wire;
use crate::copy::KvLayout;

/// The device-to-device copies that move offered blocks `blocks` (source ids) into `dst`:
/// `(dst address, source address, bytes)` runs, pieces contiguous at both ends merged. Every
/// source piece must lie inside one of the exported `ranges` (`(base, size)`, source
/// addresses), mapped here at `mapped[k]`;
/// `Err` names the first that does not. Pure: what a hostile source sends is checked here
/// before any address is used.
pub(crate) fn plan_copies(
    layout: &KvLayout,
    src_segments: &[(u64, u64, u64)],
    ranges: &[(u64, u64)],
    mapped: &[u64],
    blocks: &[crate::agent::wire::OfferedBlock],
    dst: &[u32],
    runs: &mut Vec<(u64, u64, u64)>,
) -> Result<(), String> {
    runs.clear();
    let mine = layout.segments();
    let mut run: Option<(u64, u64, u64)> = None;
    for (i, (&(src, ..), &d)) in blocks.iter().zip(dst).enumerate() {
        for (s, (m, &(sbase, sstride, len))) in mine.iter().zip(src_segments).enumerate() {
            let at = u64::from(src)
                .checked_mul(sstride)
                .and_then(|x| x.checked_add(sbase))
                .filter(|x| x.checked_add(len).is_some())
                .ok_or_else(|| format!("block {i}, segment {s}: the source's address overflows"))?;
            let k = ranges
                .iter()
                .position(|&(b, n)| b <= at && at + len <= b + n)
                .ok_or_else(|| format!("block {i}, segment {s}: outside the memory the source exported"))?;
            let from = mapped[k]
                .checked_add(at - ranges[k].0)
                .ok_or_else(|| format!("block {i}, segment {s}: past the end of the address space"))?;
            let to = m.base + u64::from(d) * m.block_stride;
            run = match run {
                Some((rt, rf, n)) if rt.checked_add(n) == Some(to) && rf.checked_add(n) == Some(from) => {
                    Some((rt, rf, n + len))
                }
                Some(prev) => {
                    runs.push(prev);
                    Some((to, from, len))
                }
                None => Some((to, from, len)),
            };
        }
    }
    runs.extend(run);
    Ok(())
}

/// The source's segments as the copy-and-sum kernel reads them, into `out`: per segment, its
/// base translated to where the source's memory is mapped here (`mapped[k]` for `ranges[k]`)
/// and its stride. `false` when a segment's offered blocks do not all lie inside one exported
/// allocation, or a translated base or a stride is not a multiple of 16 bytes: the caller then
/// copies run by run ([`plan_copies`], which checks every piece). Pure: nothing the source sent
/// is used as an address unless it passed here.
pub(crate) fn plan_segments(
    src_segments: &[(u64, u64, u64)],
    ranges: &[(u64, u64)],
    mapped: &[u64],
    blocks: &[crate::agent::wire::OfferedBlock],
    out: &mut Vec<(u64, u64)>,
) -> bool {
    out.clear();
    let (Some(lo_id), Some(hi_id)) = (blocks.iter().map(|b| b.0).min(), blocks.iter().map(|b| b.0).max()) else {
        return false;
    };
    for &(base, stride, len) in src_segments {
        // addresses grow with the id: the offered blocks lie in [lo, hi)
        let at = |id: u32| u64::from(id).checked_mul(stride).and_then(|x| x.checked_add(base));
        let (Some(lo), Some(hi)) = (at(lo_id), at(hi_id).and_then(|x| x.checked_add(len))) else {
            return false;
        };
        let Some(k) = ranges.iter().position(|&(b, n)| b <= lo && hi <= b + n) else {
            return false;
        };
        // modulo 2^64, as the kernel adds id * stride: base + id * stride lands at
        // mapped[k] + (its offset in the allocation), inside the mapping
        let here = mapped[k].wrapping_add(base.wrapping_sub(ranges[k].0));
        if here % 16 != 0 || stride % 16 != 0 {
            return false;
        }
        out.push((here, stride));
    }
    true
}

/// What a destination does with a CUDA IPC offer before any address is used, with made-up
/// mappings (range `k` mapped at `k << 44`, nothing overlapping): the offer (`IPC_OFFER`'s
/// payload) decoded and checked against `layout` for `asked` names into `dst`, its metadata
/// decoded, both copy plans made; panics when a plan would touch a byte outside a mapping or
/// past the source's exported ranges. Then the same offer as if it claimed this process: only
/// when its ranges lie inside this process's exports (made up here: [`SAME_PROCESS_EXPORTS`]),
/// and then the plans read those agents' pool extents at their own addresses, no byte past
/// them. For fuzzing what a hostile source can send.
#[doc(hidden)]
pub fn check_offer_plans(layout: &KvLayout, payload: &[u8], asked: usize, dst: &[u32]) {
    let Some(offer) = wire::decode_in_place_offer(payload) else { return };
    if offer.check(layout, asked).is_err() || offer.blocks.is_empty() || offer.blocks.len() > dst.len() {
        return;
    }
    let Some(exports) = decode_exports(&offer.metadata) else { return };
    assert_eq!(encode_exports(&exports), offer.metadata, "metadata decodes only from its exact encoding");
    let ranges = exports.ranges();
    // another process: range k mapped at k << 44, inside [k << 44, (k << 44) + size), the size
    // within the mapping's 2^44 bytes
    let mapped: Vec<u64> = (0..ranges.len() as u64).map(|k| k << 44).collect();
    let inside = |at: u64, len: u64| {
        mapped.iter().zip(&ranges).any(|(&m, &(_, size))| size < 1 << 44 && m <= at && at + len <= m + size)
    };
    let huge = ranges.iter().any(|r| r.1 >= 1 << 44);
    check_plans(layout, &offer, &ranges, &mapped, &dst[..offer.blocks.len()], &|at, len| huge || inside(at, len));
    // this process (as the offer may claim): once every range lies inside one agent's exports,
    // the plans read that agent's pool extents at their own addresses, and no byte past them
    if super::registry::inside_exports(&ranges, &SAME_PROCESS_EXPORTS) {
        let pools: Vec<(u64, u64)> = SAME_PROCESS_EXPORTS.iter().map(|&(b, n)| (b + n / 4, n / 2)).collect();
        let own: Vec<u64> = pools.iter().map(|r| r.0).collect();
        let in_pool = |at: u64, len: u64| {
            at.checked_add(len).is_some_and(|end| pools.iter().any(|&(b, n)| b <= at && end <= b + n))
        };
        check_plans(layout, &offer, &pools, &own, &dst[..offer.blocks.len()], &in_pool);
    }
}

/// The made-up exports of this process [`check_offer_plans`] checks same-process offers
/// against: two allocations `(base, bytes)`, each with a pool in its middle half.
const SAME_PROCESS_EXPORTS: [(u64, u64); 2] = [(0x7f00_0000_0000, 1 << 32), (0x7f10_0000_0000, 1 << 30)];

/// Both copy plans of `offer` with the source's ranges mapped at `mapped`: every byte either
/// would read must pass `ok(at, len)`.
fn check_plans(
    layout: &KvLayout,
    offer: &wire::InPlaceOffer,
    ranges: &[(u64, u64)],
    mapped: &[u64],
    dst: &[u32],
    ok: &dyn Fn(u64, u64) -> bool,
) {
    let segs = layout.segments();
    let mut runs = Vec::new();
    if plan_copies(layout, &offer.segments, ranges, mapped, &offer.blocks, dst, &mut runs).is_ok() {
        for &(_, from, len) in &runs {
            // a run may join pieces of several mappings only when they touch
            assert!(ok(from, len), "a run reads outside the mappings");
        }
    }
    let mut table = Vec::new();
    if plan_segments(&offer.segments, ranges, mapped, &offer.blocks, &mut table) {
        assert_eq!(table.len(), segs.len());
        for &(id, ..) in &offer.blocks {
            for (&(here, stride), g) in table.iter().zip(segs) {
                let at = here.wrapping_add(u64::from(id).wrapping_mul(stride));
                assert!(ok(at, g.bytes_per_block), "the kernel would read block {id} outside the mappings");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::offer::{Exports, VmmOffer};
    use super::super::AGENT;
    use super::*;
    use crate::agent::transport::vmm_fds;
    use crate::copy::Segment;

    /// The destination of the plan tests: two segments (K, V) of 256 bytes, block-major
    /// strides of 512, 8 blocks at 0x10000.
    fn kv_pool_of_8() -> KvLayout {
        KvLayout::new(
            8,
            vec![
                Segment { base: 0x10000, block_stride: 512, bytes_per_block: 256 },
                Segment { base: 0x10100, block_stride: 512, bytes_per_block: 256 },
            ],
            &[],
        )
        .unwrap()
    }

    /// The fuzz target's check on a well-formed offer: it gets as far as both plans (a plan
    /// reading outside its mapping would panic), and an offer whose blocks lie past the
    /// export is planned by neither.
    #[test]
    fn the_offer_check_plans_a_good_offer_and_refuses_a_bad_one() {
        let l = kv_pool_of_8();
        let offer = |size: u64| wire::InPlaceOffer {
            agent: AGENT.into(),
            metadata: encode_exports(&Exports {
                host: [3; 16],
                pid: 77,
                allocs: vec![],
                vmm: Some(VmmOffer {
                    socket: b"s".to_vec(),
                    token: [0; vmm_fds::TOKEN],
                    ranges: vec![(0x80000, vec![size])],
                }),
            }),
            block_bytes: 512,
            device: Some(0),
            num_blocks: 8,
            segments: vec![(0x80000, 512, 256), (0x80100, 512, 256)],
            blocks: vec![(6, 1, [0; 32]), (7, 2, [0; 32])],
            tags: Vec::new(),
        };
        let good = wire::encode_in_place_offer(&offer(8 * 512));
        check_offer_plans(&l, &good, 2, &[0, 1]);
        let e = decode_exports(&offer(8 * 512).metadata).unwrap();
        let mapped: Vec<u64> = (0..e.ranges().len() as u64).map(|k| k << 44).collect();
        let mut segs = Vec::new();
        assert!(plan_segments(
            &offer(8 * 512).segments,
            &e.ranges(),
            &mapped,
            &[(6, 1, [0; 32]), (7, 2, [0; 32])],
            &mut segs
        ));
        assert_eq!(segs[0].0.wrapping_add(6 * 512), 6 * 512, "block 6 read at its offset in mapping 0");
        // the export ends inside block 7: neither plan takes the offer
        let short = offer(7 * 512 + 100);
        let e = decode_exports(&short.metadata).unwrap();
        assert!(!plan_segments(&short.segments, &e.ranges(), &mapped, &short.blocks, &mut segs));
        let mut runs = Vec::new();
        assert!(plan_copies(&l, &short.segments, &e.ranges(), &mapped, &short.blocks, &[0, 1], &mut runs).is_err());
        check_offer_plans(&l, &wire::encode_in_place_offer(&short), 2, &[0, 1]);
    }

    /// An offer in this process's name: planned at its own addresses only inside this
    /// process's exports (the fuzz target's model of the same-process shortcut).
    #[test]
    fn a_same_process_offer_is_planned_only_inside_the_exports() {
        let l = kv_pool_of_8();
        let at = |base: u64| wire::InPlaceOffer {
            agent: AGENT.into(),
            metadata: encode_exports(&Exports {
                host: [3; 16],
                pid: 77,
                allocs: vec![crate::copy::IpcExport { base, size: 8 * 512, handle: [1; 64] }],
                vmm: None,
            }),
            block_bytes: 512,
            device: Some(0),
            num_blocks: 8,
            segments: vec![(base, 512, 256), (base + 0x100, 512, 256)],
            blocks: vec![(6, 1, [0; 32]), (7, 2, [0; 32])],
            tags: Vec::new(),
        };
        let inside = SAME_PROCESS_EXPORTS[1].0 + 4096;
        let e = decode_exports(&at(inside).metadata).unwrap();
        assert!(super::super::registry::inside_exports(&e.ranges(), &SAME_PROCESS_EXPORTS));
        check_offer_plans(&l, &wire::encode_in_place_offer(&at(inside)), 2, &[0, 1]);
        // the runtime's own memory elsewhere (or a wild address): not this process's export
        for wild in [0x10000u64, SAME_PROCESS_EXPORTS[1].0 + (1 << 30) - 512, 0xdead_0000] {
            let e = decode_exports(&at(wild).metadata).unwrap();
            assert!(!super::super::registry::inside_exports(&e.ranges(), &SAME_PROCESS_EXPORTS), "{wild:#x}");
            check_offer_plans(&l, &wire::encode_in_place_offer(&at(wild)), 2, &[0, 1]);
        }
    }

    #[test]
    fn copies_merge_contiguous_runs_and_stay_inside_the_exports() {
        let l = kv_pool_of_8();
        // the source: the same shape at 0x80000, exported as one allocation mapped at 0x5000000
        let src = [(0x80000u64, 512u64, 256u64), (0x80100, 512, 256)];
        let allocs = [(0x80000u64, 8 * 512u64)];
        let mapped = [0x500_0000u64];
        let mut runs = Vec::new();
        // blocks 2, 3 into 5, 6: K and V of consecutive blocks touch at both ends: one run
        plan_copies(&l, &src, &allocs, &mapped, &[(2, 0, [0; 32]), (3, 0, [0; 32])], &[5, 6], &mut runs).unwrap();
        assert_eq!(runs, vec![(0x10000 + 5 * 512, 0x500_0000 + 2 * 512, 1024)]);
        // out of order: one run per block
        plan_copies(&l, &src, &allocs, &mapped, &[(3, 0, [0; 32]), (2, 0, [0; 32])], &[5, 6], &mut runs).unwrap();
        assert_eq!(runs.len(), 2);
        // a block past the exported allocation is refused before any address is used
        let e = plan_copies(&l, &src, &allocs, &mapped, &[(8, 0, [0; 32])], &[0], &mut runs).unwrap_err();
        assert!(e.contains("outside the memory the source exported"), "{e}");
        // an address that overflows
        let bad = [(u64::MAX - 100, 512u64, 256u64), (0x80100, 512, 256)];
        let e = plan_copies(&l, &bad, &allocs, &mapped, &[(1, 0, [0; 32])], &[0], &mut runs).unwrap_err();
        assert!(e.contains("overflows"), "{e}");
    }

    #[test]
    fn segments_translate_into_the_mapping_only_when_every_block_lies_in_one_export() {
        // the source: K and V of 8 blocks (strides 512) in one allocation at 0x80000, mapped
        // here at 0x5000000
        let src = [(0x80000u64, 512u64, 256u64), (0x80100, 512, 256)];
        let allocs = [(0x80000u64, 8 * 512u64)];
        let mapped = [0x500_0000u64];
        let mut segs = Vec::new();
        assert!(plan_segments(&src, &allocs, &mapped, &[(2, 0, [0; 32]), (7, 0, [0; 32]), (0, 0, [0; 32])], &mut segs));
        assert_eq!(segs, vec![(0x500_0000, 512), (0x500_0100, 512)]);
        // a block past the export (block 8 ends at 0x81100 > 0x81000): refused, whichever order
        assert!(!plan_segments(&src, &allocs, &mapped, &[(8, 0, [0; 32]), (0, 0, [0; 32])], &mut segs));
        assert!(segs.len() < 2, "no table for a refused offer");
        // the segments in two allocations: each is translated by its own mapping
        let split = [(0x80000u64, 512u64, 256u64), (0x90000, 512, 256)];
        let two = [(0x80000u64, 8 * 512u64), (0x90000, 8 * 512)];
        assert!(plan_segments(&split, &two, &[0x100_0000, 0x700_0000], &[(0, 0, [0; 32]), (7, 0, [0; 32])], &mut segs));
        assert_eq!(segs, vec![(0x100_0000, 512), (0x700_0000, 512)]);
        // one segment's blocks spread over two allocations: no single table (run by run instead)
        let spread = [(0x80000u64, 4 * 512u64), (0x80000 + 4 * 512, 4 * 512)];
        assert!(!plan_segments(
            &src,
            &spread,
            &[0x100_0000, 0x200_0000],
            &[(1, 0, [0; 32]), (6, 0, [0; 32])],
            &mut segs
        ));
        // a base before the allocation is fine when the offered blocks are inside (modular)
        let late = [(0x80000u64 + 2 * 512, 6 * 512u64)];
        assert!(plan_segments(&src, &late, &[0x900_0000], &[(2, 0, [0; 32]), (7, 0, [0; 32])], &mut segs));
        assert_eq!(segs[0].0.wrapping_add(2 * 512), 0x900_0000);
        // misaligned: an odd base or stride is never handed to the 16-byte kernel
        let odd = [(0x80008u64, 512u64, 256u64), (0x80108, 512, 256)];
        assert!(!plan_segments(&odd, &allocs, &mapped, &[(0, 0, [0; 32])], &mut segs));
        let odd_stride = [(0x80000u64, 520u64, 256u64), (0x80100, 520, 256)];
        assert!(!plan_segments(&odd_stride, &[(0x80000u64, 8 * 520u64)], &mapped, &[(1, 0, [0; 32])], &mut segs));
        // overflow and an empty offer
        let huge = [(u64::MAX - 100, 512u64, 256u64), (0x80100, 512, 256)];
        assert!(!plan_segments(&huge, &allocs, &mapped, &[(1, 0, [0; 32])], &mut segs));
        assert!(!plan_segments(&src, &allocs, &mapped, &[], &mut segs));
    }
}
