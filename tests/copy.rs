//! KV copy engines. The CPU reference engine runs everywhere; the GPU tests run where a CUDA
//! driver and device exist and otherwise skip, printing why (the CPU tests cover the same plan).

use kvrelay::copy::*;

/// Counts this thread's allocations (the GPU allocation test below).
struct Counting;

thread_local! {
    static ALLOCS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

// SAFETY: forwards every call to the system allocator unchanged; the thread-local counter is
// const-initialized and needs no allocation.
unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: std::alloc::Layout) -> *mut u8 {
        ALLOCS.with(|c| c.set(c.get() + 1));
        // SAFETY: same contract as ours.
        unsafe { std::alloc::System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: std::alloc::Layout) {
        // SAFETY: same contract as ours.
        unsafe { std::alloc::System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: std::alloc::Layout, n: usize) -> *mut u8 {
        ALLOCS.with(|c| c.set(c.get() + 1));
        // SAFETY: same contract as ours.
        unsafe { std::alloc::System.realloc(p, l, n) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn fill(&mut self, b: &mut [u8]) {
        for c in b.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            c.copy_from_slice(&v[..c.len()]);
        }
    }
    fn perm(&mut self, n: u32) -> Vec<u32> {
        let mut v: Vec<u32> = (0..n).collect();
        for i in (1..v.len()).rev() {
            v.swap(i, (self.next() % (i as u64 + 1)) as usize);
        }
        v
    }
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    KvFirst,
    BlockFirst,
    AllLayers,
}

const KINDS: [Kind; 3] = [Kind::KvFirst, Kind::BlockFirst, Kind::AllLayers];

/// Bytes a pool of this kind needs, and the layout at `base` (per-layer pools are laid out one
/// after another with a 4 KiB gap).
fn layout_at(kind: Kind, base: u64, layers: u32, blocks: u32, kv: u64) -> (KvLayout, u64) {
    let per_layer = 2 * u64::from(blocks) * kv + 4096;
    match kind {
        Kind::KvFirst | Kind::BlockFirst => {
            let pools: Vec<u64> = (0..u64::from(layers)).map(|l| base + l * per_layer).collect();
            let l = if matches!(kind, Kind::KvFirst) {
                KvLayout::per_layer_kv_first(&pools, blocks, kv)
            } else {
                KvLayout::per_layer_block_first(&pools, blocks, kv)
            };
            (l.unwrap(), per_layer * u64::from(layers))
        }
        Kind::AllLayers => {
            (KvLayout::all_layers_per_block(base, layers, blocks, kv).unwrap(), 2 * u64::from(layers * blocks) * kv)
        }
    }
}

/// A host pool of random bytes, 64-byte aligned.
struct HostPool {
    mem: Vec<u128>,
}
impl HostPool {
    fn new(bytes: u64, rng: &mut Rng) -> HostPool {
        let mut p = HostPool { mem: vec![0u128; (bytes as usize).div_ceil(16) + 4] };
        rng.fill(p.bytes_mut());
        p
    }
    fn base(&self) -> u64 {
        (self.mem.as_ptr() as u64).next_multiple_of(64)
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: a Vec<u128> viewed as bytes; u8 has no invalid values.
        unsafe { std::slice::from_raw_parts_mut(self.mem.as_mut_ptr().cast::<u8>(), self.mem.len() * 16) }
    }
    fn slice(&self, addr: u64, len: u64) -> &[u8] {
        let off = (addr - self.mem.as_ptr() as u64) as usize;
        // SAFETY: callers pass addresses inside the pool (checked by the layout bounds).
        unsafe { std::slice::from_raw_parts(self.mem.as_ptr().cast::<u8>().add(off), len as usize) }
    }
}

fn cpu(kind: Kind, layers: u32, blocks: u32, kv: u64, rng: &mut Rng) -> (HostPool, CpuEngine) {
    let (_, bytes) = layout_at(kind, 0, layers, blocks, kv);
    let pool = HostPool::new(bytes + 64, rng);
    let (layout, _) = layout_at(kind, pool.base(), layers, blocks, kv);
    // SAFETY: the layout lies inside `pool`, which the caller keeps alive beside the engine.
    let e = unsafe { CpuEngine::new(layout) };
    (pool, e)
}

/// The expected staging of `ids`, computed independently of the engine from the pool bytes.
fn expected(pool: &HostPool, layout: &KvLayout, ids: &[u32]) -> Vec<u8> {
    let mut v = Vec::new();
    for &id in ids {
        for s in layout.segments() {
            v.extend_from_slice(pool.slice(s.base + u64::from(id) * s.block_stride, s.bytes_per_block));
        }
    }
    v
}

#[test]
fn cpu_gather_and_scatter_every_layout_kind() {
    let mut rng = Rng(0x1234_5678_9ABC_DEF1);
    for kind in KINDS {
        let (layers, blocks, kv) = (3, 40, 256);
        let (pool, mut e) = cpu(kind, layers, blocks, kv, &mut rng);
        let ids: Vec<u32> = rng.perm(blocks).into_iter().take(17).collect();
        let mut staging = vec![0xEEu8; e.layout().staging_bytes(ids.len()) as usize + 33];
        e.gather(&ids, &mut staging).unwrap();
        let want = expected(&pool, e.layout(), &ids);
        assert!(staging[..want.len()] == want[..], "{kind:?}: gather differs from the pool bytes");
        assert!(staging[want.len()..].iter().all(|&b| b == 0xEE), "{kind:?}: wrote past the blocks");
        // round trip into other blocks, then gather those: the same bytes
        let others: Vec<u32> = rng.perm(blocks).into_iter().take(ids.len()).collect();
        e.scatter(&staging, &others).unwrap();
        let mut again = vec![0u8; staging.len()];
        e.gather(&others, &mut again).unwrap();
        assert!(again[..want.len()] == staging[..want.len()], "{kind:?}: round trip differs");
        // repeated ids are fine for a gather
        let mut twice = vec![0u8; e.layout().staging_bytes(2) as usize];
        e.gather(&[5, 5], &mut twice).unwrap();
        let half = twice.len() / 2;
        assert!(twice[..half] == twice[half..]);
        drop(e);
        drop(pool);
    }
}

#[test]
fn cpu_refusals() {
    let mut rng = Rng(99);
    let (_pool, mut e) = cpu(Kind::AllLayers, 2, 8, 64, &mut rng);
    let bb = e.layout().stage_block_bytes() as usize;
    let mut staging = vec![0u8; bb * 4];
    assert_eq!(e.gather(&[], &mut staging), Ok(()));
    assert_eq!(e.scatter(&staging, &[]), Ok(()));
    assert_eq!(e.gather(&[1, 8], &mut staging), Err(CopyError::BlockOutOfRange { position: 1, id: 8, num_blocks: 8 }));
    assert_eq!(e.scatter(&staging, &[3, 1, 3]), Err(CopyError::DuplicateBlock { position: 2, id: 3 }));
    // the duplicate check leaves no state behind
    assert_eq!(e.scatter(&staging, &[3, 1]), Ok(()));
    assert_eq!(
        e.gather(&[0, 1, 2, 3, 4], &mut staging),
        Err(CopyError::StagingTooSmall { needed: 5 * bb as u64, got: 4 * bb as u64 })
    );
}

#[test]
fn layouts_are_validated_once() {
    let seg = |base, block_stride, bytes_per_block| Segment { base, block_stride, bytes_per_block };
    assert_eq!(KvLayout::new(0, vec![seg(0, 64, 64)], &[]), Err(LayoutError::Empty));
    assert_eq!(KvLayout::new(4, vec![], &[]), Err(LayoutError::Empty));
    assert_eq!(KvLayout::new(4, vec![seg(8, 64, 64)], &[]), Err(LayoutError::Alignment(0)));
    assert_eq!(KvLayout::new(4, vec![seg(0, 64, 48), seg(4096, 64, 40)], &[]), Err(LayoutError::Alignment(1)));
    assert_eq!(KvLayout::new(4, vec![seg(0, 64, 128)], &[]), Err(LayoutError::Shape(0)));
    assert_eq!(KvLayout::new(4, vec![seg(u64::MAX - 15, 64, 64)], &[]), Err(LayoutError::Shape(0)));
    // K and V interleaved in one stride: fine; windows that meet: refused
    assert!(KvLayout::new(4, vec![seg(0, 128, 64), seg(64, 128, 64)], &[]).is_ok());
    assert_eq!(KvLayout::new(4, vec![seg(0, 128, 64), seg(48, 128, 64)], &[]), Err(LayoutError::Overlap(0, 1)));
    assert_eq!(KvLayout::new(4, vec![seg(0, 128, 64), seg(256, 64, 64)], &[]), Err(LayoutError::Overlap(0, 1)));
    // bounds against the pools given
    assert_eq!(KvLayout::new(4, vec![seg(0, 64, 64)], &[(0, 255)]), Err(LayoutError::Bounds(0)));
    assert!(KvLayout::new(4, vec![seg(0, 64, 64)], &[(0, 256)]).is_ok());
    // staging is block-major
    let l = KvLayout::all_layers_per_block(0, 3, 10, 32).unwrap();
    assert_eq!(l.segments().len(), 6);
    assert_eq!(l.stage_block_bytes(), 6 * 32);
    assert_eq!((0..6).map(|s| l.stage_offset(s)).collect::<Vec<_>>(), [0, 32, 64, 96, 128, 160]);
}

#[test]
fn no_driver_is_a_clean_error() {
    if driver_present() {
        println!("CUDA driver present: the no-driver path is exercised on machines without one");
        return;
    }
    assert_eq!(CudaDevice::open(0).unwrap_err(), CopyError::NoDriver);
}

// ---------------------------------------------------------------- GPU

/// `KVRELAY_REQUIRE_GPU=1` (the GPU machine's runs) turns every skip into a failure.
fn require_gpu() -> bool {
    std::env::var("KVRELAY_REQUIRE_GPU").is_ok_and(|v| v == "1")
}

/// The device, or `None` (a clean skip, saying why) when this machine has no CUDA driver or no
/// device; any other failure to open it is a test failure.
fn gpu() -> Option<std::sync::Arc<CudaDevice>> {
    match CudaDevice::open(0) {
        Ok(d) => Some(d),
        Err(e @ (CopyError::NoDriver | CopyError::NoDevice)) => {
            assert!(!require_gpu(), "KVRELAY_REQUIRE_GPU=1 but {e}");
            println!("SKIP GPU test: {e} (the CPU reference engine tests cover the copy plan)");
            None
        }
        Err(e) => panic!("the CUDA device is present but could not be opened: {e}"),
    }
}

/// A device pool mirrored on the host: same random bytes, same layout shape.
struct Mirror {
    host: HostPool,
    host_layout: KvLayout,
    dev: DeviceBuffer,
    dev_layout: KvLayout,
}

fn mirror(d: &std::sync::Arc<CudaDevice>, kind: Kind, layers: u32, blocks: u32, kv: u64, rng: &mut Rng) -> Mirror {
    let (_, bytes) = layout_at(kind, 0, layers, blocks, kv);
    let host = HostPool::new(bytes + 64, rng);
    let (host_layout, _) = layout_at(kind, host.base(), layers, blocks, kv);
    let dev = DeviceBuffer::alloc(d, bytes as usize + 256).unwrap();
    let (dev_layout, _) = layout_at(kind, dev.ptr().next_multiple_of(256), layers, blocks, kv);
    // upload the host bytes at the same offsets
    let off = (host.base() - host.mem.as_ptr() as u64) as usize;
    let dev_off = (dev.ptr().next_multiple_of(256) - dev.ptr()) as usize;
    dev.write(dev_off, host.slice(host.mem.as_ptr() as u64 + off as u64, bytes)).unwrap();
    Mirror { host, host_layout, dev, dev_layout }
}

#[test]
fn gpu_gather_scatter_byte_exact_against_cpu_every_layout_and_method() {
    let Some(d) = gpu() else { return };
    let mut rng = Rng(0xC0FFEE);
    let stream = CudaStream::new(&d).unwrap();
    for kind in KINDS {
        for (method, ids_via) in [
            (CopyMethod::Kernel, IdTransport::Auto),
            (CopyMethod::Kernel, IdTransport::Ring),
            (CopyMethod::Kernel, IdTransport::Params),
            (CopyMethod::Batch, IdTransport::Ring),
            (CopyMethod::PerChunk, IdTransport::Ring),
            (CopyMethod::Staged, IdTransport::Auto),
        ] {
            let (layers, blocks, kv) = (4, 2000, 4096);
            let m = mirror(&d, kind, layers, blocks, kv, &mut rng);
            // SAFETY: the layout lies inside `m.dev`, alive for the test.
            let mut e = match unsafe {
                CudaEngine::new(&d, m.dev_layout.clone(), EngineOptions { method, ..Default::default() })
            } {
                Ok(e) => e,
                Err(CopyError::Unsupported(what)) => {
                    assert!(!require_gpu(), "KVRELAY_REQUIRE_GPU=1 but {kind:?}/{method:?} is unsupported: {what}");
                    println!("SKIP {kind:?}/{method:?}: {what}");
                    continue;
                }
                Err(e) => panic!("{kind:?}/{method:?}: {e}"),
            };
            // SAFETY: host mirror layout inside `m.host`.
            let mut reference = unsafe { CpuEngine::new(m.host_layout.clone()) };
            // more ids than one launch carries, random order
            let ids: Vec<u32> = rng.perm(blocks).into_iter().take(1500).collect();
            let n = m.dev_layout.staging_bytes(ids.len()) as usize;
            let mut staging = PinnedBuffer::alloc(&d, n + 4096).unwrap();
            staging.as_mut_slice().fill(0xA5); // poison
            let done = CudaEvent::new(&d).unwrap();
            e.gather(&ids, &staging, &stream, Some(&done)).unwrap();
            done.synchronize().unwrap();
            let mut want = vec![0u8; n];
            reference.gather(&ids, &mut want).unwrap();
            assert!(staging.as_slice()[..n] == want[..], "{kind:?}/{method:?}: gather differs from the CPU engine");
            assert!(staging.as_slice()[n..].iter().all(|&b| b == 0xA5), "{kind:?}/{method:?}: wrote past the end");
            // round trip: scatter into different blocks, gather them back
            let others: Vec<u32> = rng.perm(blocks).into_iter().take(ids.len()).collect();
            e.scatter(&staging, &others, &stream, None).unwrap();
            let mut back = PinnedBuffer::alloc(&d, n).unwrap();
            back.as_mut_slice().fill(0x5A);
            e.gather(&others, &back, &stream, Some(&done)).unwrap();
            done.synchronize().unwrap();
            assert!(back.as_slice() == &want[..], "{kind:?}/{method:?}: round trip differs");
            // gather -> scatter from the same staging -> gather, all on one stream with no host
            // wait in between: stream order alone must keep them apart. (The pool changed in the
            // round trip above, so the expectation is `fresh` itself: had the scatter started
            // before the first gather finished, it would have spread `fresh`'s poison.)
            let third: Vec<u32> = rng.perm(blocks).into_iter().take(ids.len()).collect();
            let mut chained = PinnedBuffer::alloc(&d, n).unwrap();
            chained.as_mut_slice().fill(0x3C);
            let mut fresh = PinnedBuffer::alloc(&d, n).unwrap();
            fresh.as_mut_slice().fill(0xC3);
            e.gather(&ids, &fresh, &stream, None).unwrap();
            e.scatter(&fresh, &third, &stream, None).unwrap();
            e.gather(&third, &chained, &stream, Some(&done)).unwrap();
            done.synchronize().unwrap();
            assert!(fresh.as_slice().iter().any(|&b| b != 0xC3), "{kind:?}/{method:?}: the first gather wrote nothing");
            assert!(chained.as_slice() == fresh.as_slice(), "{kind:?}/{method:?}: chained copies on one stream differ");
            // refusals come back as errors, not faults
            assert!(matches!(e.scatter(&staging, &[1, 1], &stream, None), Err(CopyError::DuplicateBlock { .. })));
            assert!(matches!(e.gather(&[blocks], &staging, &stream, None), Err(CopyError::BlockOutOfRange { .. })));
            let small = PinnedBuffer::alloc(&d, 16).unwrap();
            assert!(matches!(e.gather(&[0], &small, &stream, None), Err(CopyError::StagingTooSmall { .. })));
            println!("ok {kind:?}/{method:?}/{ids_via:?}: {} blocks, {} bytes, byte-exact", ids.len(), n);
        }
    }
}

/// The checksum kernel against the host's `kv_checksum` of each block's staged bytes, for every
/// layout kind and segment sizes from 16 bytes to several of the kernel's per-warp pieces
/// (64 KiB each) and not a multiple of them, with more blocks than one launch carries.
#[test]
fn gpu_checksums_equal_the_hosts_for_small_and_large_segments() {
    let Some(d) = gpu() else { return };
    let mut rng = Rng(0x5EED);
    let stream = CudaStream::new(&d).unwrap();
    for kind in KINDS {
        for (layers, blocks, kv) in [(3, 1100, 16u64), (2, 40, 4096), (1, 24, 200 * 1024 + 16), (2, 6, 1 << 20)] {
            let m = mirror(&d, kind, layers, blocks, kv, &mut rng);
            // SAFETY: the layout lies inside `m.dev`, alive for the test.
            let mut e = unsafe { CudaEngine::new(&d, m.dev_layout.clone(), EngineOptions::default()) }.unwrap();
            // SAFETY: host mirror layout inside `m.host`.
            let mut reference = unsafe { CpuEngine::new(m.host_layout.clone()) };
            let ids: Vec<u32> = rng.perm(blocks).into_iter().take(blocks as usize).collect();
            let mut got = vec![0u64; ids.len()];
            // one block alone (the smallest pieces) and all together (the largest) sum alike
            let mut one = [0u64];
            e.checksums(&ids[..1], &mut one, &stream).unwrap();
            e.checksums(&ids, &mut got, &stream).unwrap();
            assert_eq!(one[0], got[0], "{kind:?} kv={kv}: one block alone");
            let sbb = m.host_layout.stage_block_bytes() as usize;
            // the keyed tags from the same launch: refused until the engine has the block key
            let mac = kvrelay::block_mac::BlockMac::new(&[9; 32], sbb);
            let mut nh = vec![kvrelay::block_mac::NhSums::default(); ids.len()];
            let r = e.checksums_tagged(&ids[..1], &mut one, Some(&mut nh[..1]), &stream);
            assert!(matches!(r, Err(CopyError::Unsupported(_))), "no block key: {r:?}");
            e.set_block_key(&mac).unwrap();
            let mut tagged_sums = vec![0u64; ids.len()];
            e.checksums_tagged(&ids, &mut tagged_sums, Some(&mut nh), &stream).unwrap();
            assert_eq!(tagged_sums, got, "{kind:?} kv={kv}: the sums do not change with tags");
            let mut one_nh = [kvrelay::block_mac::NhSums::default()];
            e.checksums_tagged(&ids[..1], &mut one, Some(&mut one_nh), &stream).unwrap();
            assert_eq!(one_nh[0], nh[0], "{kind:?} kv={kv}: one block alone, tagged");
            let mut one = vec![0u8; sbb];
            for (i, &id) in ids.iter().enumerate() {
                reference.gather(&[id], &mut one).unwrap();
                assert_eq!(got[i], kvrelay::checksum::kv_checksum(&one), "{kind:?} kv={kv}: block {id}");
                assert_eq!(mac.finish(nh[i], sbb as u64), mac.tag(&one), "{kind:?} kv={kv}: block {id}'s tag");
            }
            println!("ok {kind:?}: {} blocks of {sbb} bytes, kernel sums and tags equal the host's", ids.len());
        }
    }
}

/// The copy-and-sum kernel (what the same-host CUDA IPC transport runs): blocks of another pool
/// copied into this pool's blocks byte for byte, and each block's sum equal to the host's
/// `kv_checksum` of what landed, for every layout kind, segment sizes from 16 bytes to several
/// of the kernel's pieces, and more blocks than one launch carries; bad source tables and
/// repeated destinations are refused before any launch.
#[test]
fn gpu_copy_and_sum_from_another_pool_equals_the_hosts() {
    let Some(d) = gpu() else { return };
    let mut rng = Rng(0xC0B1);
    let stream = CudaStream::new(&d).unwrap();
    for kind in KINDS {
        for (layers, blocks, kv) in [(3, 1100, 16u64), (2, 40, 4096), (1, 24, 200 * 1024 + 16), (2, 6, 1 << 20)] {
            let sources =
                [mirror(&d, kind, layers, blocks, kv, &mut rng), mirror(&d, kind, layers, blocks, kv, &mut rng)];
            let dst = mirror(&d, kind, layers, blocks, kv, &mut rng);
            // SAFETY: the layout lies inside `dst.dev`, alive for the test.
            let mut e = unsafe { CudaEngine::new(&d, dst.dev_layout.clone(), EngineOptions::default()) }.unwrap();
            let sbb = dst.host_layout.stage_block_bytes() as usize;
            let (mut want, landed) = (vec![0u8; sbb], PinnedBuffer::alloc(&d, sbb).unwrap());
            let done = CudaEvent::new(&d).unwrap();
            let mut segs: Vec<(u64, u64)> = Vec::new();
            let mac = kvrelay::block_mac::BlockMac::new(&[5; 32], sbb);
            e.set_block_key(&mac).unwrap();
            // two sources in turn into the same blocks: the engine's source table follows (the
            // second copy also takes the keyed tags of what landed)
            for (k, src) in sources.iter().enumerate() {
                // SAFETY: host mirror layout inside its pool.
                let mut src_ref = unsafe { CpuEngine::new(src.host_layout.clone()) };
                segs = src.dev_layout.segments().iter().map(|g| (g.base, g.block_stride)).collect();
                let from: Vec<u32> = rng.perm(blocks);
                let ids: Vec<u32> = rng.perm(blocks);
                let mut got = vec![0u64; ids.len()];
                let mut nh = vec![kvrelay::block_mac::NhSums::default(); if k == 1 { ids.len() } else { 0 }];
                let tags = (k == 1).then_some(&mut nh[..]);
                // SAFETY: every source block lies in `src.dev`, unwritten meanwhile.
                unsafe { e.copy_and_sum_from_tagged(&segs, &from, &ids, &mut got, tags, &stream) }.unwrap();
                for (i, (&s, &t)) in from.iter().zip(&ids).enumerate() {
                    src_ref.gather(&[s], &mut want).unwrap();
                    e.gather(&[t], &landed, &stream, Some(&done)).unwrap();
                    done.synchronize().unwrap();
                    assert!(
                        landed.as_slice() == &want[..],
                        "{kind:?} kv={kv} source {k}: block {i} ({s} -> {t}) differs"
                    );
                    assert_eq!(
                        got[i],
                        kvrelay::checksum::kv_checksum(&want),
                        "{kind:?} kv={kv} source {k}: block {i}'s sum"
                    );
                    if let Some(&t) = nh.get(i) {
                        assert_eq!(mac.finish(t, sbb as u64), mac.tag(&want), "{kind:?} kv={kv}: block {i}'s tag");
                    }
                }
            }
            // refused before any launch: a source table of another length, a misaligned
            // base or stride, a repeated destination, a destination past the pool
            let mut one = [0u64];
            let bad_len = &segs[..segs.len() - 1];
            let misaligned: Vec<(u64, u64)> = segs.iter().map(|&(b, s)| (b + 8, s)).collect();
            let odd_stride: Vec<(u64, u64)> = segs.iter().map(|&(b, s)| (b, s + 8)).collect();
            for bad in [bad_len, &misaligned[..], &odd_stride[..]] {
                // SAFETY: refused before any launch.
                let r = unsafe { e.copy_and_sum_from(bad, &[0], &[0], &mut one, &stream) };
                assert!(matches!(r, Err(CopyError::InvalidOptions)), "{kind:?}: {r:?}");
            }
            let mut two = [0u64; 2];
            // SAFETY: refused before any launch.
            let r = unsafe { e.copy_and_sum_from(&segs, &[0, 1], &[3, 3], &mut two, &stream) };
            assert!(matches!(r, Err(CopyError::DuplicateBlock { .. })), "{r:?}");
            // SAFETY: refused before any launch.
            let r = unsafe { e.copy_and_sum_from(&segs, &[0], &[blocks], &mut one, &stream) };
            assert!(matches!(r, Err(CopyError::BlockOutOfRange { .. })), "{r:?}");
            println!("ok {kind:?}: {blocks} blocks of {sbb} bytes copied from another pool, sums equal the host's");
        }
    }
}

#[test]
fn gpu_gather_is_ordered_after_earlier_work_on_the_stream() {
    let Some(d) = gpu() else { return };
    let mut rng = Rng(7);
    let stream = CudaStream::new(&d).unwrap();
    let m = mirror(&d, Kind::AllLayers, 8, 512, 16384, &mut rng);
    let ids: Vec<u32> = (0..512).collect();
    let n = m.dev_layout.staging_bytes(ids.len()) as usize;
    let staging = PinnedBuffer::alloc(&d, n).unwrap();
    for (round, method) in
        [CopyMethod::Kernel, CopyMethod::Staged, CopyMethod::Kernel, CopyMethod::Staged].into_iter().enumerate()
    {
        let round = round as u8;
        let opts = EngineOptions { method, scratch_bytes: 16 << 20, ..Default::default() };
        // SAFETY: the layout lies inside `m.dev`.
        let mut e = unsafe { CudaEngine::new(&d, m.dev_layout.clone(), opts) }.unwrap();
        // a device-side write of the whole pool enqueued just before the gather (the caller's
        // own driver call: it makes the context current itself, as a runtime does)
        let _ctx = d.bind().unwrap();
        let v = 0x10 + round;
        // SAFETY: writes inside the pool allocation on the test's live stream.
        let r = unsafe { cudarc::driver::sys::cuMemsetD8Async(m.dev.ptr(), v, m.dev.len(), stream.raw()) };
        assert_eq!(r, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
        let done = CudaEvent::new(&d).unwrap();
        e.gather(&ids, &staging, &stream, Some(&done)).unwrap();
        done.synchronize().unwrap();
        assert!(
            staging.as_slice().iter().all(|&b| b == v),
            "round {round} ({method:?}): the gather ran before the write"
        );
    }
    let _ = &m.host;
    println!("ok ordering: 4 rounds of write-then-gather on one stream, kernel and staged methods");
}

#[test]
fn gpu_registered_caller_memory_works_as_staging() {
    let Some(d) = gpu() else { return };
    let mut rng = Rng(0xBEEF);
    let stream = CudaStream::new(&d).unwrap();
    let m = mirror(&d, Kind::BlockFirst, 2, 256, 8192, &mut rng);
    // SAFETY: the layout lies inside `m.dev`.
    let mut e = unsafe { CudaEngine::new(&d, m.dev_layout.clone(), EngineOptions::default()) }.unwrap();
    // SAFETY: host mirror layout inside `m.host`.
    let mut reference = unsafe { CpuEngine::new(m.host_layout.clone()) };
    let ids: Vec<u32> = rng.perm(256).into_iter().take(100).collect();
    let n = m.dev_layout.staging_bytes(ids.len()) as usize;
    let mut mine = vec![0x77u8; n];
    {
        // SAFETY: `mine` outlives the registration (dropped at the end of this block) and is not
        // registered elsewhere.
        let reg = unsafe { PinnedBuffer::register(&d, mine.as_mut_ptr(), n) }.unwrap();
        let done = CudaEvent::new(&d).unwrap();
        e.gather(&ids, &reg, &stream, Some(&done)).unwrap();
        done.synchronize().unwrap();
    } // unregistered here, exactly once
    let mut want = vec![0u8; n];
    reference.gather(&ids, &mut want).unwrap();
    assert!(mine == want, "gather into registered caller memory differs");
    // the memory is usable (and registrable) again after the handle dropped
    // SAFETY: as above.
    let again = unsafe { PinnedBuffer::register(&d, mine.as_mut_ptr(), n) };
    assert!(again.is_ok(), "registering again after unregistration failed: {:?}", again.err());
    println!("ok registered caller memory: {} blocks byte-exact, unregistered once", ids.len());
}

#[test]
fn gpu_address_range_names_the_allocation_that_holds_an_address() {
    let Some(d) = gpu() else { return };
    let len = 3 << 20;
    let buf = DeviceBuffer::alloc(&d, len).unwrap();
    for at in [0u64, 1, 4096, len as u64 - 1] {
        let (base, size) = d.address_range(buf.ptr() + at).unwrap();
        assert_eq!(base, buf.ptr(), "offset {at}");
        assert!(size >= len as u64, "offset {at}: {size} bytes");
    }
    // an address no allocation holds is an error, not a guess
    let past = buf.ptr() + (64u64 << 40);
    assert!(d.address_range(past).is_err(), "{past:#x} answered {:?}", d.address_range(past));
    let export = d.ipc_export(buf.ptr() + 4096).unwrap();
    assert_eq!((export.base, export.size), d.address_range(buf.ptr()).unwrap());
    println!("ok address_range: base and size of a {len}-byte allocation from any address in it");
}

#[test]
fn gpu_peer_access_between_two_gpus_copies_byte_exact() {
    let Some(d) = gpu() else { return };
    assert_eq!(d.enable_peer_access(&d), Ok(true), "a device reaches its own memory");
    let e = match CudaDevice::open(1) {
        Ok(e) => e,
        Err(CopyError::NoDevice) => {
            println!("one GPU: the two-GPU part of the peer-access test runs where a second is present");
            return;
        }
        Err(e) => panic!("the second GPU is present but could not be opened: {e}"),
    };
    let peer = d.enable_peer_access(&e).unwrap();
    assert_eq!(e.enable_peer_access(&d).unwrap(), peer, "peer access is symmetric on one host");
    assert_eq!(d.enable_peer_access(&e), Ok(peer), "asked again: the same answer");
    let len = 1 << 20;
    let (a, b) = (DeviceBuffer::alloc(&e, len).unwrap(), DeviceBuffer::alloc(&d, len).unwrap());
    let want: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
    a.write(0, &want).unwrap();
    let st = CudaStream::new(&d).unwrap();
    // SAFETY: two live device buffers of `len` bytes, used by nothing else.
    unsafe { st.copy_device(b.ptr(), a.ptr(), len) }.unwrap();
    st.synchronize().unwrap();
    let mut got = vec![0u8; len];
    b.read(0, &mut got).unwrap();
    assert!(got == want, "the copy from cuda:1 to cuda:0 differs");
    println!("ok peer access cuda:0 <-> cuda:1: {peer}; 1 MiB copied byte-exact");
}

#[test]
fn gpu_id_ring_backpressure_keeps_every_call_correct() {
    let Some(d) = gpu() else { return };
    let mut rng = Rng(0xF00D);
    let stream = CudaStream::new(&d).unwrap();
    // 1,000 blocks of 2 x 32 KiB per call: each call keeps the GPU busy far longer than its
    // enqueue takes, so 100 calls in a row run through the 32 ring slots and wait for them
    let m = mirror(&d, Kind::AllLayers, 1, 2048, 32768, &mut rng);
    let opts = EngineOptions { ids: IdTransport::Ring, ..Default::default() };
    // SAFETY: the layout lies inside `m.dev`.
    let mut e = unsafe { CudaEngine::new(&d, m.dev_layout.clone(), opts) }.unwrap();
    // SAFETY: host mirror layout inside `m.host`.
    let mut reference = unsafe { CpuEngine::new(m.host_layout.clone()) };
    let n = m.dev_layout.staging_bytes(1000) as usize;
    let mut stagings: Vec<PinnedBuffer> = (0..10).map(|_| PinnedBuffer::alloc(&d, n).unwrap()).collect();
    let mut calls: Vec<Vec<u32>> = Vec::new();
    for call in 0..100 {
        let ids: Vec<u32> = rng.perm(2048).into_iter().take(1000).collect();
        e.gather(&ids, &stagings[call % 10], &stream, None).unwrap();
        if call >= 90 {
            calls.push(ids);
        }
    }
    stream.synchronize().unwrap();
    for (k, ids) in calls.iter().enumerate() {
        let mut want = vec![0u8; n];
        reference.gather(ids, &mut want).unwrap();
        assert!(stagings[(90 + k) % 10].as_slice() == &want[..], "call {}: differs", 90 + k);
    }
    stagings.clear();
    println!("ok id ring under backpressure: 100 calls of 1,000 blocks, the last 10 byte-exact");
}

#[test]
fn gpu_entry_points_leave_the_callers_context_as_it_was() {
    use cudarc::driver::sys;
    let Some(d) = gpu() else { return };
    let current = || {
        let mut c: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: plain query into a local.
        assert_eq!(unsafe { sys::cuCtxGetCurrent(&mut c) }, sys::CUresult::CUDA_SUCCESS);
        c
    };
    let mut rng = Rng(11);
    for with_context in [false, true] {
        // the runtime's thread has no context current, or has the device's context current
        let held = if with_context { Some(d.bind().unwrap()) } else { None };
        if !with_context {
            // SAFETY: unbinds this thread's context (what a fresh runtime thread has).
            assert_eq!(unsafe { sys::cuCtxSetCurrent(std::ptr::null_mut()) }, sys::CUresult::CUDA_SUCCESS);
        }
        let before = current();
        let stream = CudaStream::new(&d).unwrap();
        let m = mirror(&d, Kind::AllLayers, 4, 64, 4096, &mut rng);
        let ids: Vec<u32> = (0..64).collect();
        let staging = PinnedBuffer::alloc(&d, m.dev_layout.staging_bytes(ids.len()) as usize).unwrap();
        // SAFETY: the layout lies inside `m.dev`.
        let mut e = unsafe { CudaEngine::new(&d, m.dev_layout.clone(), EngineOptions::default()) }.unwrap();
        e.gather(&ids, &staging, &stream, None).unwrap();
        stream.synchronize().unwrap();
        drop(e);
        assert_eq!(current(), before, "with_context={with_context}: kvrelay changed the thread's current context");
        drop(held);
    }
    println!("ok: the caller's current context is unchanged by kvrelay's entry points");
}

#[test]
fn gpu_copy_submission_allocates_nothing_with_any_method() {
    let Some(d) = gpu() else { return };
    let mut rng = Rng(21);
    let stream = CudaStream::new(&d).unwrap();
    let done = CudaEvent::new(&d).unwrap();
    let m = mirror(&d, Kind::AllLayers, 4, 2000, 4096, &mut rng);
    let ids: Vec<u32> = (0..1000).map(|i| (i * 7) % 2000).collect();
    let others: Vec<u32> = (1000..2000).collect();
    let staging = PinnedBuffer::alloc(&d, m.dev_layout.staging_bytes(ids.len()) as usize).unwrap();
    for (method, ids_via) in [
        (CopyMethod::Kernel, IdTransport::Params),
        (CopyMethod::Kernel, IdTransport::Ring),
        (CopyMethod::Batch, IdTransport::Auto),
        (CopyMethod::PerChunk, IdTransport::Auto),
        (CopyMethod::Staged, IdTransport::Auto),
    ] {
        let opts = EngineOptions { method, ids: ids_via, scratch_bytes: 16 << 20, ..Default::default() };
        // SAFETY: the layout lies inside `m.dev`, alive for the test.
        let mut e = match unsafe { CudaEngine::new(&d, m.dev_layout.clone(), opts) } {
            Ok(e) => e,
            Err(CopyError::Unsupported(what)) => {
                assert!(!require_gpu(), "KVRELAY_REQUIRE_GPU=1 but {method:?} is unsupported: {what}");
                println!("SKIP {method:?}: {what}");
                continue;
            }
            Err(e) => panic!("{method:?}: {e}"),
        };
        // warm-up calls in both directions (the first use of a driver function resolves its
        // symbol, which allocates once), then count
        e.gather(&ids, &staging, &stream, Some(&done)).unwrap();
        e.scatter(&staging, &others, &stream, Some(&done)).unwrap();
        done.synchronize().unwrap();
        let before = ALLOCS.with(std::cell::Cell::get);
        for _ in 0..10 {
            e.gather(&ids, &staging, &stream, Some(&done)).unwrap();
            e.scatter(&staging, &others, &stream, Some(&done)).unwrap();
        }
        let n = ALLOCS.with(std::cell::Cell::get) - before;
        done.synchronize().unwrap();
        assert_eq!(n, 0, "{method:?}/{ids_via:?}: {n} allocations in 20 calls");
        println!("ok {method:?}/{ids_via:?}: 20 calls of 1,000 blocks, no allocation");
    }
}
