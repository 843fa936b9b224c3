//! The KV agent's fetches over NIXL (feature `nixl`): the destination READs the source's blocks
//! in place (host pools on any machine with the NIXL libraries; GPU pools on the H200), verifies
//! them, and withholds blocks under a READ that outlives its fetch; one agent that prefers CUDA
//! IPC, then NIXL, then TCP per source. Every test waits on a completion or a counter with a
//! bounded wait, never on a sleep. The TCP fetches are in `agent.rs`, the CUDA IPC ones in
//! `agent_ipc.rs`.
#![cfg(feature = "nixl")]

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use kvrelay::agent::{Agent, AgentConfig, FailReason, FetchRequest};
use kvrelay::copy::{CpuEngine, KvLayout};

mod agent_fixture;
use agent_fixture::*;

/// NIXL READs take only blocks whose recorded content digest is the one asked for: the offer
/// is cut before the first other one, which is never read.
#[test]
fn nixl_checks_content_digests() {
    let Some(t) = nixl("nixl_checks_content_digests") else { return };
    content_digests_are_checked(&|| instance_with(|c| c.transport = t.clone()));
}

/// No grant without proof: an agent without a key (per-user key off) refuses every NIXL hello
/// (`grants_refused_unkeyed`) and its NIXL fetcher falls back to TCP; a keyed source's offer of
/// no block (a hello naming nothing it holds) carries no registration metadata, one of held
/// blocks does.
#[test]
fn nixl_grants_go_only_to_keyed_peers_and_only_with_blocks() {
    use kvrelay::agent::wire;
    let Some(t) = nixl("nixl_grants_go_only_to_keyed_peers_and_only_with_blocks") else { return };
    let plain = unkeyed_with(|c| c.transport = t.clone());
    plain.hold(&NAMES, 0);
    let f = unkeyed_with(|c| c.transport = t.clone());
    let r = f.fetch(&plain.endpoint(), &NAMES, 0, vec![0, 1]);
    assert_eq!((r.failure, r.blocks), (None, 2), "{}", r.detail);
    let s = plain.agent.stats();
    assert_eq!((s.grants_refused_unkeyed, s.refused_unsupported), (1, 1));
    assert_eq!(f.agent.stats().transport_fallbacks, 1, "made again over TCP");
    assert!(plain.agent.prometheus().contains("kvrelay_kv_agent_grants_refused_unkeyed_total 1"));
    // a keyed source (the per-user key), spoken to by hand with that key
    let keyed = instance_with(|c| c.transport = t.clone());
    keyed.hold(&NAMES, 0);
    let key = kvrelay::agent::auth::per_user_key().unwrap();
    let offer = |names: &[u64]| offer_by_hand(&keyed.endpoint(), Some(&key), wire::NIXL_HELLO, names).unwrap();
    let none = offer(&[7, 8]);
    assert!(none.blocks.is_empty() && none.metadata.is_empty(), "no block, no registration");
    let some = offer(&NAMES[..2]);
    assert_eq!(some.blocks.len(), 2);
    assert!(!some.metadata.is_empty(), "held blocks come with the registration they are read through");
    // without the key: refused before any name is looked at
    let e = offer_by_hand(&keyed.endpoint(), None, wire::NIXL_HELLO, &NAMES).unwrap_err();
    assert!(e.contains("auth_failed"), "{e}");
    eventually("every pin released", || keyed.cache.pinned() == 0);
}

/// NIXL between host pools of keyed agents: the offer carries each block's keyed tag, and a
/// write into the source's pool that keeps the public checksum is refused where the READ
/// landed (the tag of the bytes in the destination's pool differs), before it is recorded.
#[test]
fn nixl_refuses_a_forged_block_by_its_keyed_tag() {
    let Some(t) = nixl("nixl_refuses_a_forged_block_by_its_keyed_tag") else { return };
    let a = instance_with(|c| c.transport = t.clone());
    a.hold(&NAMES, 0);
    let forged = a.pool.forge_keeping_checksum(1);
    assert_eq!(
        kvrelay::checksum::kv_checksum(&forged),
        a.agent.recorded_checksum(1).unwrap(),
        "the checksum still holds"
    );
    let b = instance_with(|c| c.transport = t.clone());
    let r = b.fetch(&a.endpoint(), &NAMES, 0, vec![4, 5, 6]);
    assert_eq!((r.failure, r.blocks), (Some(FailReason::Corrupt), 1), "{}", r.detail);
    assert!(r.detail.contains("keyed tag"), "{}", r.detail);
    assert_eq!(b.agent.recorded_checksum(5), None, "the forged block was not recorded");
    assert_eq!(b.agent.recorded_tag(4), a.agent.recorded_tag(0), "the first block landed with its tag");
    assert_eq!(b.agent.stats().transport_fallbacks, 0, "read over NIXL");
    eventually("every pin released", || a.cache.pinned() == 0);
}

/// NIXL between host pools: the destination READs the blocks in place, verifies them against
/// the checksums the source recorded and the source unpins them at DONE; a TCP destination is
/// still served by a NIXL source; a NIXL destination falls back to TCP for a TCP-only source
/// (once, then straight to TCP), and with the transport pinned it is refused.
#[test]
fn nixl_reads_blocks_in_place_verified() {
    let Some(t) = nixl("nixl_reads_blocks_in_place_verified") else { return };
    let mut a = instance_with(|c| c.transport = t.clone());
    a.hold(&NAMES, 2);
    let b = instance_with(|c| c.transport = t.clone());
    let bb = b.pool.block_bytes();
    assert_eq!(b.agent.speed(&a.endpoint()), kvrelay::agent::NIXL_HOST_DEFAULT);
    let r = b.fetch(&a.endpoint(), &NAMES, 1, vec![9, 3, 4, 12, 5]);
    assert_eq!(r.failure, None, "{}", r.detail);
    assert_eq!((r.blocks, r.bytes, r.withheld), (5, 5 * bb as u64, 0));
    for (i, &id) in [9u32, 3, 4, 12, 5].iter().enumerate() {
        assert_eq!(b.pool.read(id), content(NAMES[1 + i], bb), "block {i}");
        assert_eq!(b.agent.recorded_checksum(id), a.agent.recorded_checksum(3 + i as u32));
    }
    eventually("every pin released", || a.cache.pinned() == 0);
    assert_eq!(a.agent.stats().blocks_sent, 5, "counted at DONE");
    // a partial run, and nothing held
    let longer = [NAMES.as_slice(), &[107, 108]].concat();
    let r = b.fetch(&a.endpoint(), &longer, 4, vec![0, 1, 2, 6]);
    assert_eq!((r.failure, r.blocks), (None, 2), "{}", r.detail);
    let r = b.fetch(&a.endpoint(), &[7, 8], 0, vec![0]);
    assert_eq!((r.failure, r.blocks), (Some(FailReason::SourceMiss), 0), "{}", r.detail);
    // a TCP reader of the NIXL source
    let tcp = instance();
    let r = tcp.fetch(&a.endpoint(), &NAMES, 0, vec![0, 1]);
    assert_eq!((r.failure, r.blocks), (None, 2), "{}", r.detail);
    assert_eq!(tcp.pool.read(1), content(NAMES[1], bb));
    // a NIXL reader of a TCP-only source: refused as NIXL, made again over TCP, and the next
    // fetch from it goes over TCP at once
    tcp.hold(&NAMES, 0);
    let c = instance_with(|c| c.transport = t.clone());
    let r = c.fetch(&tcp.endpoint(), &NAMES, 0, vec![0, 1]);
    assert_eq!((r.failure, r.blocks), (None, 2), "{}", r.detail);
    assert_eq!(c.pool.read(1), content(NAMES[1], bb));
    assert_eq!((tcp.agent.stats().refused_unsupported, c.agent.stats().transport_fallbacks), (1, 1));
    let r = c.fetch(&tcp.endpoint(), &NAMES, 2, vec![7]);
    assert_eq!((r.failure, r.blocks), (None, 1), "{}", r.detail);
    assert_eq!(c.pool.read(7), content(NAMES[2], bb));
    assert_eq!((tcp.agent.stats().refused_unsupported, c.agent.stats().transport_fallbacks), (1, 1), "no second try");
    assert!(c.agent.prometheus().contains("kvrelay_kv_agent_transport_fallbacks_total 1"));
    eventually("every pin released", || tcp.cache.pinned() == 0);
    // fetches submitted at once to a TCP-only source nobody fell back from yet: each that
    // tried NIXL goes on over TCP, whether or not another marked the source first
    let d = instance_with(|c| c.transport = t.clone());
    let many: Vec<_> = (0..4u32)
        .map(|k| {
            let req = FetchRequest {
                endpoint: tcp.endpoint(),
                names: NAMES.to_vec(),
                held: 0,
                dst: vec![2 * k, 2 * k + 1],
                deadline: Duration::from_secs(20),
                digests: Vec::new(),
            };
            d.agent.submit(req, None).unwrap()
        })
        .collect();
    for f in many {
        let r = f.wait(Duration::from_secs(30)).unwrap();
        assert_eq!((r.failure, r.blocks), (None, 2), "{}", r.detail);
    }
    let falls = d.agent.stats().transport_fallbacks;
    assert!((1..=4).contains(&falls), "{falls} fallbacks: one per fetch that was refused, at most");
    eventually("every pin released", || tcp.cache.pinned() == 0);
    // the transport pinned: refused, with the reason
    let pinned = instance_with(|c| {
        c.transport = t.clone();
        c.limits.tcp_fallback = false;
    });
    let refused_before = tcp.agent.stats().refused_unsupported;
    let r = pinned.fetch(&tcp.endpoint(), &NAMES, 0, vec![0, 1]);
    assert_eq!((r.failure, r.blocks), (Some(FailReason::Refused), 0), "{}", r.detail);
    assert!(r.detail.contains("unsupported"), "{}", r.detail);
    assert_eq!(tcp.agent.stats().refused_unsupported, refused_before + 1, "one NIXL hello refused");
    assert_eq!(pinned.agent.stats().transport_fallbacks, 0);
    // a source that fell back is estimated from TCP's default, not NIXL's (a fetch that
    // failed over TCP records nothing, so the estimate is the restarted default)
    let e = instance_with(|c| c.transport = t.clone());
    assert_eq!(e.agent.speed(&tcp.endpoint()), kvrelay::agent::NIXL_HOST_DEFAULT);
    let r = e.fetch(&tcp.endpoint(), &[7, 8], 0, vec![0]);
    assert_eq!((r.failure, e.agent.stats().transport_fallbacks), (Some(FailReason::SourceMiss), 1), "{}", r.detail);
    assert_eq!(e.agent.speed(&tcp.endpoint()), kvrelay::agent::TCP_DEFAULT);
    // memory that went bad at the source after its checksum was recorded
    a.pool.corrupt(4, 7);
    let r = b.fetch(&a.endpoint(), &NAMES, 0, vec![10, 11, 13, 14]);
    assert_eq!((r.failure, r.blocks), (Some(FailReason::Corrupt), 2), "{}", r.detail);
    assert_eq!(b.agent.recorded_checksum(13), None, "the bad block was not recorded");
    eventually("every pin released", || a.cache.pinned() == 0);
    let s = b.agent.stats();
    assert_eq!((s.fetches_ok, s.fetch_failed_corrupt, s.blocks_withheld), (2, 1, 0));
    assert_ne!(b.agent.speed(&a.endpoint()), kvrelay::agent::NIXL_HOST_DEFAULT, "measured");
}

/// NIXL: a fetch that ends while its READs still run withholds the destination blocks they
/// may write, and hands them back (`BlockHolder::returned`) only once those READs are over.
/// Host pools of 64 blocks of 4 MiB (4 READ requests of 64 MiB), `write_grace` zero, the
/// source's first block bad after recording: the fetch fails at the first request's check
/// while the later ones are in flight. Every destination block is accounted for, and a block
/// written after its return keeps what was written (nothing READs into it any more).
#[test]
fn nixl_withholds_blocks_under_a_running_read_and_returns_them_when_it_ends() {
    let test = "nixl_withholds_blocks_under_a_running_read_and_returns_them_when_it_ends";
    let Some(t) = nixl(test) else { return };
    // In one process UCX reads host memory with CMA, which completes a READ as it is posted:
    // the test runs itself in a child process whose UCX moves host memory over TCP, where a
    // READ of 256 MiB stays in flight long enough to be cancelled.
    if std::env::var_os("KVRELAY_TEST_UCX_TCP").is_none() {
        let gpu = kvrelay::copy::driver_present();
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([test, "--exact", "--nocapture", "--test-threads=1"])
            .env("KVRELAY_TEST_UCX_TCP", "1")
            .env("UCX_TLS", if gpu { "tcp,cuda_copy" } else { "tcp" })
            .env("UCX_NET_DEVICES", "lo")
            .output()
            .expect("the test binary runs itself");
        let text = String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
        eprintln!("{text}");
        assert!(out.status.success(), "{test} in its child process failed");
        assert!(text.contains("blocks withheld and returned"), "the child ran the test");
        return;
    }
    const N: u32 = 64;
    const HALF: u64 = 2 << 20; // K or V of one block: 4 MiB blocks
    struct Big {
        mem: Vec<u128>,
        layout: KvLayout,
    }
    let big = || {
        let mut mem = vec![0u128; (2 * N as u64 * HALF / 16) as usize];
        let layout = KvLayout::per_layer_kv_first(&[mem.as_mut_ptr() as u64], N, HALF).unwrap();
        Big { mem, layout }
    };
    let agent = |b: &Big, cache: &Arc<Cache>| {
        let mut c = AgentConfig::new(fp());
        c.limits.unchecked_fetch = true; // fetches by name: the transport is what is tested
        c.transport = t.clone();
        c.limits.write_grace = Duration::ZERO;
        // SAFETY: each pool outlives its agent (the agents are dropped first below).
        unsafe { Agent::new(c, b.layout.clone(), Box::new(Holder(cache.clone()))) }.unwrap()
    };
    let (src, dst) = (big(), big());
    let bb = src.layout.stage_block_bytes() as usize;
    let names: Vec<u64> = (0..N as u64).map(|i| 5000 + i).collect();
    let src_cache = Arc::new(Cache::default());
    // SAFETY: the source pool outlives its agent and nothing else writes it while it serves.
    let mut e = unsafe { CpuEngine::new(src.layout.clone()) };
    for (i, &n) in names.iter().enumerate() {
        e.scatter(&content(n, bb), &[i as u32]).unwrap();
        src_cache.held.lock().unwrap().insert(n, i as u32);
    }
    let src_agent = agent(&src, &src_cache);
    src_agent.record_checksums(&(0..N).collect::<Vec<_>>()).unwrap();
    let mut src = src;
    src.mem[3] ^= 1; // block 0 goes bad after its checksum was recorded
    let dst_cache = Arc::new(Cache::default());
    let dst_agent = agent(&dst, &dst_cache);
    let ep = src_agent.endpoint().unwrap().to_string();
    let ids: Vec<u32> = (0..N).rev().collect();
    let mut withheld_once = None;
    for attempt in 0..8 {
        let req = FetchRequest {
            endpoint: ep.clone(),
            names: names.clone(),
            held: 0,
            dst: ids.clone(),
            deadline: Duration::from_secs(20),
            digests: Vec::new(),
        };
        let pins = src_cache.pin_calls.load(Ordering::Relaxed);
        let f = dst_agent.submit(req, None).unwrap();
        // cancel once the source pinned the run: its offer follows, then the READs
        eventually("the source pins", || src_cache.pin_calls.load(Ordering::Relaxed) > pins);
        f.cancel();
        let r = f.wait(Duration::from_secs(30)).expect("the fetch completes");
        eprintln!(
            "attempt {attempt}: {:?} {} blocks, {} withheld, {:.1} ms",
            r.failure,
            r.blocks,
            r.withheld,
            r.seconds * 1e3
        );
        assert_eq!(r.failure, Some(FailReason::Cancelled), "attempt {attempt}: {}", r.detail);
        if r.withheld > 0 {
            assert_eq!(r.blocks + r.withheld, N as usize, "every block after the verified ones is withheld");
            withheld_once = Some(r.withheld);
            break;
        }
    }
    let Some(withheld) = withheld_once else {
        panic!("{test}: no attempt ended with a READ still running (UCX finished every READ at once 8 times)")
    };
    assert_eq!(dst_agent.stats().blocks_withheld, withheld as u64);
    eventually("the withheld blocks come back", || dst_cache.returned.lock().unwrap().len() == withheld);
    let mut back = dst_cache.returned.lock().unwrap().clone();
    back.sort_unstable();
    assert_eq!(back, (0..N).collect::<Vec<_>>(), "exactly the withheld blocks, each once");
    assert_eq!(dst_agent.stats().blocks_returned, withheld as u64);
    // the runtime reuses the returned blocks: nothing READs into them any more
    // SAFETY: the destination pool outlives the engine; its agent writes none of these blocks.
    let mut d = unsafe { CpuEngine::new(dst.layout.clone()) };
    let mark = vec![0xa5u8; bb];
    for id in 0..N {
        d.scatter(&mark, &[id]).unwrap();
    }
    drop(dst_agent); // tears the NIXL agent down: any READ still running would have landed
    drop(src_agent);
    let mut out = vec![0u8; bb];
    for id in 0..N {
        d.gather(&[id], &mut out).unwrap();
        assert!(out == mark, "block {id} was written after it was returned");
    }
    eprintln!("{test}: {withheld} blocks withheld and returned");
}

/// NIXL with GPU pools, two agents of this process (UCX moves VRAM between them only emulated,
/// at under 1 GB/s: CUDA IPC needs two processes): device to device and host to device,
/// verified by the checksum kernel where the blocks landed. Skips without a CUDA driver or the
/// NIXL libraries.
#[test]
fn nixl_gpu_pools_read_in_place_verified() {
    let test = "nixl_gpu_pools_read_in_place_verified";
    let Some(dev) = cuda_device(test) else { return };
    let Some(t) = nixl(test) else { return };
    let mk = |layout: &KvLayout, device: Option<i32>, cache: &Arc<Cache>| {
        let mut c = AgentConfig::new(fp());
        c.limits.unchecked_fetch = true; // fetches by name: the transport is what is tested
        c.device = device;
        c.transport = t.clone();
        // SAFETY: the pools outlive the agents (dropped at the end of the test, agents first).
        unsafe { Agent::new(c, layout.clone(), Box::new(Holder(cache.clone()))) }.unwrap()
    };
    let bb = Pool::new().block_bytes();
    let mut src = DevPool::new(&dev);
    let src_cache = Arc::new(Cache::default());
    let src_agent = mk(&src.layout, Some(0), &src_cache);
    for (i, &n) in NAMES.iter().enumerate() {
        src.write(i as u32 + 4, &content(n, bb));
        src_cache.held.lock().unwrap().insert(n, i as u32 + 4);
    }
    src_agent.record_checksums(&(4..4 + NAMES.len() as u32).collect::<Vec<_>>()).unwrap();
    let mut dst = DevPool::new(&dev);
    let dst_agent = mk(&dst.layout, Some(0), &Arc::new(Cache::default()));
    assert_eq!(dst_agent.speed("tcp://127.0.0.1:1"), kvrelay::agent::NIXL_VRAM_DEFAULT);
    let req = |endpoint: String, dst: Vec<u32>| FetchRequest {
        endpoint,
        names: NAMES.to_vec(),
        held: 0,
        dst,
        deadline: Duration::from_secs(20),
        digests: Vec::new(),
    };
    let ep = src_agent.endpoint().unwrap().to_string();
    let r = dst_agent.submit(req(ep.clone(), vec![9, 2, 11, 0, 15, 1]), None).unwrap().wait(Duration::from_secs(30));
    let r = r.unwrap();
    assert_eq!((r.failure, r.blocks), (None, 6), "{}", r.detail);
    for (i, id) in [9u32, 2, 11, 0, 15, 1].into_iter().enumerate() {
        assert_eq!(dst.read(id), content(NAMES[i], bb), "device pool block {i}");
    }
    // a host source into the device pool
    let host = instance_with(|c| c.transport = t.clone());
    host.hold(&NAMES, 8);
    let r = dst_agent.submit(req(host.endpoint(), vec![3, 4]), None).unwrap().wait(Duration::from_secs(30)).unwrap();
    assert_eq!((r.failure, r.blocks), (None, 2), "{}", r.detail);
    assert_eq!(dst.read(4), content(NAMES[1], bb));
    // the device source's memory goes bad after recording: caught by the kernel's sum
    let mut bad = content(NAMES[1], bb);
    bad[3] ^= 0x80;
    src.write(5, &bad);
    let r = dst_agent.submit(req(ep, vec![5, 6, 7]), None).unwrap().wait(Duration::from_secs(30)).unwrap();
    assert_eq!((r.failure, r.blocks), (Some(FailReason::Corrupt), 1), "{}", r.detail);
    eventually("every pin released", || src_cache.pinned() == 0);
    eprintln!("{test}: ran on CUDA device 0");
}

/// A NIXL fetch of device memory that UCX can only emulate (two agents of one process: no CUDA
/// IPC within a process) is counted in `nixl_slow_reads` and its Prometheus counter, once per
/// such fetch of at least 32 MiB; a small one is not judged. The blocks still land byte-exact.
/// (A UCX that moved such a READ fast, 2.5 GB/s or more, must not count it; between 1 and 2.5
/// GB/s, where the test's clock and the agent's differ, the count is not checked.) Skips
/// without a CUDA driver or the NIXL libraries.
#[test]
fn nixl_counts_a_device_read_it_had_to_emulate() {
    let test = "nixl_counts_a_device_read_it_had_to_emulate";
    let Some(dev) = cuda_device(test) else { return };
    let Some(t) = nixl(test) else { return };
    // one layer of 10 blocks of 2 MiB of K and 2 MiB of V: 40 MiB in all
    const N: u32 = 10;
    const KV: u64 = 2 << 20;
    let pool = |fill: &dyn Fn(usize) -> u8| {
        let m = kvrelay::copy::DeviceBuffer::alloc(&dev, (2 * u64::from(N) * KV) as usize).unwrap();
        m.write(0, &(0..m.len()).map(fill).collect::<Vec<u8>>()).unwrap();
        let layout = KvLayout::per_layer_kv_first(&[m.ptr()], N, KV).unwrap();
        (m, layout)
    };
    let (src, src_layout) = pool(&|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8);
    let (dst, dst_layout) = pool(&|_| 0);
    let mk = |layout: KvLayout, cache: &Arc<Cache>| {
        let mut c = AgentConfig::new(fp());
        c.limits.unchecked_fetch = true; // fetches by name: the transport is what is tested
        c.device = Some(0);
        c.transport = t.clone();
        // SAFETY: the pools outlive the agents (dropped at the end of the test, agents first).
        unsafe { Agent::new(c, layout, Box::new(Holder(cache.clone()))) }.unwrap()
    };
    let names: Vec<u64> = (0..u64::from(N)).map(|i| 0x5100 + i).collect();
    let src_cache = Arc::new(Cache::default());
    src_cache.held.lock().unwrap().extend(names.iter().copied().zip(0..N));
    let src_agent = mk(src_layout, &src_cache);
    src_agent.record_checksums(&(0..N).collect::<Vec<_>>()).unwrap();
    let dst_agent = mk(dst_layout, &Arc::new(Cache::default()));
    let ep = src_agent.endpoint().unwrap().to_string();
    let fetch = |k: usize| {
        let req = FetchRequest {
            endpoint: ep.clone(),
            names: names[..k].to_vec(),
            held: 0,
            dst: (0..k as u32).collect(),
            deadline: Duration::from_secs(60),
            digests: Vec::new(),
        };
        let started = std::time::Instant::now();
        let r = dst_agent.submit(req, None).unwrap().wait(Duration::from_secs(90)).unwrap();
        assert_eq!((r.failure, r.blocks), (None, k), "{}", r.detail);
        (k as u64 * 2 * KV) as f64 / started.elapsed().as_secs_f64() / 1e9
    };
    // 2 blocks (8 MiB): too small to judge
    let small = fetch(2);
    assert_eq!(dst_agent.stats().nixl_slow_reads, 0, "8 MiB at {small:.2} GB/s is not judged");
    // 10 blocks (40 MiB), emulated within one process
    let rate = fetch(N as usize);
    let s = dst_agent.stats();
    eprintln!("{test}: 40 MiB at {rate:.2} GB/s (submit to completion), nixl_slow_reads {}", s.nixl_slow_reads);
    let expect = if rate < 1.0 {
        Some(1)
    } else if rate >= 2.5 {
        Some(0)
    } else {
        None
    };
    if let Some(n) = expect {
        assert_eq!(s.nixl_slow_reads, n, "a device READ at {rate:.2} GB/s");
        let line = format!("kvrelay_kv_agent_nixl_slow_reads_total {n}\n");
        assert!(dst_agent.prometheus().contains(&line), "Prometheus: {line}");
    }
    assert_eq!(src_agent.stats().nixl_slow_reads, 0, "the source fetched nothing");
    // byte-exact: the destination pool now equals the source's
    let (mut a, mut b) = (vec![0u8; src.len()], vec![0u8; dst.len()]);
    src.read(0, &mut a).unwrap();
    dst.read(0, &mut b).unwrap();
    assert!(a == b, "the fetched blocks equal the source's");
    eventually("every pin released", || src_cache.pinned() == 0);
    drop((dst_agent, src_agent));
    eprintln!("{test}: ran on CUDA device 0");
}

/// One agent holding both non-TCP transports (`Transport::Prefer([CudaIpc, Nixl])`, GPU pools):
/// a source that serves CUDA IPC is fetched from over it; a NIXL-only source refuses the IPC
/// hello and is fetched from over NIXL from then on (one fallback counted, the next fetch goes
/// straight to NIXL); a TCP-only source refuses both and is fetched from over TCP; every fetch
/// byte-exact and verified. Skips without a CUDA driver or the NIXL libraries.
#[test]
fn one_agent_prefers_cuda_ipc_then_nixl_then_tcp_per_source() {
    let test = "one_agent_prefers_cuda_ipc_then_nixl_then_tcp_per_source";
    let Some(dev) = cuda_device(test) else { return };
    let Some(nx) = nixl(test) else { return };
    let bb = Pool::new().block_bytes();
    let serving = |pool: &mut DevPool, t: kvrelay::agent::Transport| {
        let cache = Arc::new(Cache::default());
        let mut c = AgentConfig::new(fp());
        c.limits.unchecked_fetch = true; // fetches by name: the transport is what is tested
        c.device = Some(0);
        c.transport = t;
        // SAFETY: the pools outlive the agents (dropped at the end of the test, agents first).
        let a = unsafe { Agent::new(c, pool.layout.clone(), Box::new(Holder(cache.clone()))) }.unwrap();
        for (i, &n) in NAMES.iter().enumerate() {
            pool.write(i as u32 + 4, &content(n, bb));
            cache.held.lock().unwrap().insert(n, i as u32 + 4);
        }
        a.record_checksums(&(4..4 + NAMES.len() as u32).collect::<Vec<_>>()).unwrap();
        a
    };
    let both = kvrelay::agent::Transport::Prefer(vec![kvrelay::agent::Transport::CudaIpc, nx.clone()]);
    let mut ipc_pool = DevPool::new(&dev);
    let ipc_src = serving(&mut ipc_pool, kvrelay::agent::Transport::CudaIpc);
    let mut nixl_pool = DevPool::new(&dev);
    let nixl_src = serving(&mut nixl_pool, nx.clone());
    let tcp_src = instance();
    tcp_src.hold(&NAMES, 8);
    let mut dst = DevPool::new(&dev);
    let dst_agent = {
        let mut c = AgentConfig::new(fp());
        c.limits.unchecked_fetch = true; // fetches by name: the transport is what is tested
        c.device = Some(0);
        c.transport = both;
        // SAFETY: the pool outlives the agent.
        unsafe { Agent::new(c, dst.layout.clone(), Box::new(Holder(Arc::new(Cache::default())))) }.unwrap()
    };
    let fetch = |ep: &str, ids: Vec<u32>| {
        let r = dst_agent
            .submit(
                FetchRequest {
                    endpoint: ep.into(),
                    names: NAMES.to_vec(),
                    held: 0,
                    dst: ids,
                    deadline: Duration::from_secs(20),
                    digests: Vec::new(),
                },
                None,
            )
            .unwrap()
            .wait(Duration::from_secs(30))
            .unwrap();
        assert_eq!((r.failure, r.blocks), (None, 2), "from {ep}: {}", r.detail);
    };
    // a same-process CUDA IPC source: over CUDA IPC, no fallback
    fetch(ipc_src.endpoint().unwrap(), vec![0, 1]);
    assert_eq!(dst.read(1), content(NAMES[1], bb));
    assert_eq!(dst_agent.stats().transport_fallbacks, 0);
    // (a source counts what the reader took when its DONE arrives, after the fetch completed)
    eventually("the IPC source to count two blocks", || ipc_src.stats().blocks_sent == 2);
    // a NIXL-only source: refused over CUDA IPC, read over NIXL; then NIXL straight away
    fetch(nixl_src.endpoint().unwrap(), vec![2, 3]);
    assert_eq!(dst.read(3), content(NAMES[1], bb));
    assert_eq!(dst_agent.stats().transport_fallbacks, 1);
    fetch(nixl_src.endpoint().unwrap(), vec![4, 5]);
    assert_eq!(dst.read(5), content(NAMES[1], bb));
    assert_eq!(dst_agent.stats().transport_fallbacks, 1, "remembered: no second refusal");
    eventually("the NIXL source to count four blocks", || nixl_src.stats().blocks_sent == 4);
    assert_eq!(nixl_src.stats().refused_unsupported, 1, "one IPC hello refused");
    // a TCP-only source: refused twice, then over TCP into the device pool
    fetch(&tcp_src.endpoint(), vec![6, 7]);
    assert_eq!(dst.read(7), content(NAMES[1], bb));
    assert_eq!(dst_agent.stats().transport_fallbacks, 3);
    assert_eq!(tcp_src.agent.stats().refused_unsupported, 2);
    drop(dst_agent);
    eprintln!("{test}: ran on CUDA device 0");
}
