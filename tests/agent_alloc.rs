//! The KV agent allocates nothing per block once warm: a counting global allocator (counting
//! every thread: the agent's own do the work) compares a fetch of 8 blocks with one of 64
//! between two agents in this process. The allocations of a fetch (its request, the hello, the
//! connection's buffers, the pipeline's helper thread) must not grow with its blocks.
#![cfg(feature = "agent")]

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use kvrelay::agent::{Agent, AgentConfig, BlockHolder, FetchRequest, Fingerprint};
use kvrelay::copy::KvLayout;

struct Counting;
static ALLOCS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards every call to the system allocator unchanged; the counter is a static atomic.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const BLOCKS: u32 = 160;
const KVB: u64 = 4096;

/// Holds names 1..=BLOCKS in blocks 0.., with a map built before the measurement.
struct Held(HashMap<u64, u32>);
impl BlockHolder for Held {
    fn pin(&self, names: &[u64], ids: &mut [u32]) -> usize {
        names
            .iter()
            .zip(ids.iter_mut())
            .take_while(|(n, _)| self.0.contains_key(n))
            .map(|(n, id)| *id = self.0[n])
            .count()
    }
    fn unpin(&self, _: &[u32]) {}
}

#[test]
fn a_fetch_allocates_nothing_per_block() {
    let fp = Fingerprint { block_tokens: 32, layers: 1, kv_heads: 1, head_dim: 64, dtype_bytes: 2, naming: 9 };
    let mut src_mem = vec![7u128; (2 * u64::from(BLOCKS) * KVB / 16) as usize];
    let mut dst_mem = vec![0u128; src_mem.len()];
    let src_layout = KvLayout::per_layer_kv_first(&[src_mem.as_mut_ptr() as u64], BLOCKS, KVB).unwrap();
    let dst_layout = KvLayout::per_layer_kv_first(&[dst_mem.as_mut_ptr() as u64], BLOCKS, KVB).unwrap();
    let names: Vec<u64> = (1..=u64::from(BLOCKS)).collect();
    let held = Held(names.iter().enumerate().map(|(i, &n)| (n, i as u32)).collect());
    // SAFETY: both pools outlive the agents (dropped at the end of the test, agents first).
    let src = unsafe { Agent::new(AgentConfig::new(fp.clone()), src_layout, Box::new(held)) }.unwrap();
    src.record_checksums(&(0..BLOCKS).collect::<Vec<_>>()).unwrap();
    let mut cfg = AgentConfig::new(fp);
    cfg.listen = None;
    cfg.limits.fetch_threads = 1;
    cfg.limits.unchecked_fetch = true;
    // SAFETY: as above.
    let dst = unsafe { Agent::new(cfg, dst_layout, Box::new(Held(HashMap::new()))) }.unwrap();
    let ep = src.endpoint().unwrap().to_string();
    let fetch = |n: usize| {
        let req = FetchRequest {
            endpoint: ep.clone(),
            names: names[..n].to_vec(),
            held: 0,
            dst: (0..n as u32).collect(),
            deadline: Duration::from_secs(20),
            digests: Vec::new(),
        };
        let before = ALLOCS.load(Ordering::SeqCst);
        let r = dst.submit(req, None).unwrap().wait(Duration::from_secs(30)).unwrap();
        // the source's connection thread ends right after its last block: let it finish
        let mut settled = ALLOCS.load(Ordering::SeqCst);
        for _ in 0..100 {
            std::thread::sleep(Duration::from_millis(5));
            let now = ALLOCS.load(Ordering::SeqCst);
            if now == settled && src.stats().serving_now == 0 {
                break;
            }
            settled = now;
        }
        assert_eq!((r.failure, r.blocks), (None, n), "{}", r.detail);
        ALLOCS.load(Ordering::SeqCst) - before
    };
    // warm-up: movers, the worker's buffers, the connection path
    fetch(8);
    fetch(64);
    let (small, large) = (fetch(8), fetch(64));
    eprintln!("allocations: {small} for a fetch of 8 blocks, {large} for 64");
    assert!(
        large <= small + 8,
        "56 more blocks cost {} more allocations ({small} for 8, {large} for 64)",
        large.saturating_sub(small)
    );
    drop((src, dst));
    drop((src_mem, dst_mem));
}
