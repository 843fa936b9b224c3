//! The KV agent's same-host GPU transport (CUDA IPC): a host pool is refused at start; two
//! processes on one GPU (the H200) serve and fetch through mapped device memory, verified by
//! the checksum kernel, with partial runs, corruption, cancels, a source that exits while
//! mapped, and the TCP fallback; a peer mapping a source's grant reaches the pool only, and
//! what it writes there is found by the next fetch. The two-process tests run this test binary
//! again as the source; without a CUDA driver it skips, saying why. Every wait is on a completion, a
//! counter or a line of the source's output, bounded, never a sleep.
#![cfg(feature = "agent")]

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvrelay::agent::{Agent, AgentConfig, FailReason, FetchRequest};
use kvrelay::checksum::kv_checksum;
use kvrelay::copy::KvLayout;

mod agent_fixture;
use agent_fixture::*;

/// Set in the source process of a two-process test.
const SOURCE_ENV: &str = "KVRELAY_TEST_IPC_SOURCE";
/// Set in the source process of a two-process test whose source has this deployment key.
const SOURCE_KEY_ENV: &str = "KVRELAY_TEST_IPC_SOURCE_KEY";

/// The configuration of an agent over a pool of CUDA device 0 that moves blocks over CUDA IPC.
fn ipc_config() -> AgentConfig {
    let mut c = AgentConfig::new(fp());
    c.limits.unchecked_fetch = true; // fetches by name: the transport is what is tested
    c.device = Some(0);
    c.transport = kvrelay::agent::Transport::CudaIpc;
    c
}

/// The source process of a two-process test: serve NAMES from blocks 4.. of `src` over CUDA
/// IPC, print the endpoint, and take commands on stdin until EOF (`corrupt ID`, `forge ID`:
/// rewrite two words keeping the public checksum, `pinned`).
fn serve_source(test: &str, mut src: DevPool) {
    let bb = src.layout.stage_block_bytes() as usize;
    let cache = Arc::new(Cache::default());
    let mut c = ipc_config();
    if let Some(k) = std::env::var_os(SOURCE_KEY_ENV) {
        c.key = Some(kvrelay::agent::Psk::new(k.as_encoded_bytes()).unwrap());
    }
    // the virtual-memory fixture leaves room between its layers on purpose (one straddles two
    // allocations): its allocations are exported whole
    c.limits.export_whole_allocations = src._vmm.is_some();
    // SAFETY: the pool outlives the agent (dropped first, at the end of this function).
    let agent = unsafe { Agent::new(c, src.layout.clone(), Box::new(Holder(cache.clone()))) }.unwrap();
    eprintln!("{test} (source): agent started");
    for (i, &n) in NAMES.iter().enumerate() {
        src.write(i as u32 + 4, &content(n, bb));
        cache.held.lock().unwrap().insert(n, i as u32 + 4);
    }
    let ids: Vec<u32> = (4..4 + NAMES.len() as u32).collect();
    agent.record_checksums(&ids).unwrap();
    // block 3 holds other tokens than a destination asking with `digests_of(1..=6)` expects
    agent.record_digests(&ids, &digests_of(&[1, 2, 3, 99, 5, 6])).unwrap();
    println!("ENDPOINT {}", agent.endpoint().unwrap());
    for line in std::io::stdin().lines() {
        let line = line.unwrap();
        if let Some(id) = line.strip_prefix("corrupt ") {
            let id: u32 = id.trim().parse().unwrap();
            let mut b = src.read(id);
            b[bb / 2] ^= 0x40;
            src.write(id, &b);
            println!("CORRUPTED {id}");
        } else if let Some(id) = line.strip_prefix("forge ") {
            let id: u32 = id.trim().parse().unwrap();
            let mut b = src.read(id);
            let sum = kv_checksum(&b);
            forge_keeping_checksum(&mut b, 0x0123_4567_89ab_cdef);
            assert_eq!(kv_checksum(&b), sum, "the forgery keeps the checksum");
            src.write(id, &b);
            println!("FORGED {id}");
        } else if line == "pinned" {
            println!("PINNED {}", cache.pinned());
        }
    }
    drop(agent);
}

/// Run this test binary again as the source of test `test`: the child, its stdin, and a
/// bounded wait for a word on its stdout (what follows the word).
fn spawn_source(test: &str) -> (std::process::Child, std::process::ChildStdin, impl Fn(&str) -> String) {
    spawn_source_with(test, &[])
}

/// [`spawn_source`] with more variables in the source's environment.
fn spawn_source_with(
    test: &str,
    env: &[(&str, &str)],
) -> (std::process::Child, std::process::ChildStdin, impl Fn(&str) -> String) {
    use std::io::{BufRead, BufReader};
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(SOURCE_ENV, "1")
        .envs(env.iter().copied())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("the test binary runs itself as the source");
    eprintln!("{test}: the source process started");
    let to = child.stdin.take().unwrap();
    // the source's stdout, line by line, through a channel: every wait for it is bounded (its
    // words may follow libtest's "test NAME ... " on the same line)
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let out = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    let expect = move |word: &str| -> String {
        loop {
            let l = rx
                .recv_timeout(Duration::from_secs(30))
                .unwrap_or_else(|e| panic!("the source never said {word}: {e}"));
            if let Some(at) = l.find(word) {
                return l[at + word.len()..].split_whitespace().next().unwrap_or("").to_string();
            }
        }
    };
    (child, to, expect)
}

/// The CUDA IPC transport refuses a host pool when the agent starts, with the reason.
#[test]
fn cuda_ipc_needs_a_device_pool() {
    let pool = Pool::new();
    let mut c = AgentConfig::new(fp());
    c.limits.unchecked_fetch = true; // fetches by name: the transport is what is tested
    c.transport = kvrelay::agent::Transport::CudaIpc;
    let cache = Arc::new(Cache::default());
    // SAFETY: the pool outlives the (refused) agent.
    let e = unsafe { Agent::new(c, pool.layout.clone(), Box::new(Holder(cache))) }.unwrap_err();
    assert!(e.to_string().contains("device"), "{e}");
}

/// Same-host GPU transport between two processes (the H200): the source process serves a
/// device pool over CUDA IPC; this process maps it, copies device to device and verifies with
/// the checksum kernel; memory that went bad at the source after recording is caught; a TCP
/// reader of the IPC source and an IPC reader of a TCP-only source behave as with NIXL; two
/// agents of one process use the addresses as they are. Skips without a CUDA driver.
#[test]
fn cuda_ipc_copies_between_two_processes_verified() {
    let test = "cuda_ipc_copies_between_two_processes_verified";
    let Some(dev) = cuda_device(test) else { return };
    let bb = Pool::new().block_bytes();
    let mk = |layout: &KvLayout, cache: &Arc<Cache>| {
        let c = ipc_config();
        // SAFETY: the pools outlive the agents (dropped at the end of the test, agents first).
        unsafe { Agent::new(c, layout.clone(), Box::new(Holder(cache.clone()))) }.unwrap()
    };
    if std::env::var_os(SOURCE_ENV).is_some() {
        serve_source(test, DevPool::new(&dev));
        return;
    }
    let (mut child, mut to, expect) = spawn_source(test);
    let ep = expect("ENDPOINT ");
    eprintln!("{test}: the source process serves {ep}");
    let mut dst = DevPool::new(&dev);
    let dst_cache = Arc::new(Cache::default());
    let dst_agent = mk(&dst.layout, &dst_cache);
    assert_eq!(dst_agent.speed(&ep), kvrelay::agent::CUDA_IPC_DEFAULT);
    let req = |endpoint: &str, held: usize, dst: Vec<u32>| FetchRequest {
        endpoint: endpoint.to_string(),
        names: NAMES.to_vec(),
        held,
        dst,
        deadline: Duration::from_secs(20),
        digests: Vec::new(),
    };
    let ids = vec![9u32, 2, 11, 0, 15, 1];
    let r = dst_agent.submit(req(&ep, 0, ids.clone()), None).unwrap().wait(Duration::from_secs(30)).unwrap();
    assert_eq!((r.failure, r.blocks), (None, 6), "{}", r.detail);
    for (i, &id) in ids.iter().enumerate() {
        assert_eq!(dst.read(id), content(NAMES[i], bb), "block {i} copied over CUDA IPC");
        assert_eq!(dst_agent.recorded_checksum(id), Some(kv_checksum(&content(NAMES[i], bb))));
    }
    assert!(dst_agent.stats().ipc_mapped_now >= 1, "the source's pool is mapped here");
    eprintln!("{test}: first fetch verified");
    // the second fetch reuses the mapping
    let r = dst_agent.submit(req(&ep, 2, vec![3, 4]), None).unwrap().wait(Duration::from_secs(30)).unwrap();
    assert_eq!((r.failure, r.blocks), (None, 2), "{}", r.detail);
    assert_eq!(dst.read(4), content(NAMES[3], bb));
    eprintln!("{test}: second fetch verified");
    // a fetch checked by content: the offer is cut before the block under a colliding name,
    // which is never copied
    let ours = digests_of(&[1, 2, 3, 4, 5, 6]);
    // (destination blocks no other step of this test counts on)
    let before = dst.read(10);
    let checked = FetchRequest { digests: ours.clone(), ..req(&ep, 0, vec![6, 7, 8, 10, 12]) };
    let r = dst_agent.submit(checked, None).unwrap().wait(Duration::from_secs(30)).unwrap();
    assert_eq!((r.failure, r.blocks), (Some(FailReason::DigestMismatch), 3), "{}", r.detail);
    assert_eq!(dst.read(10), before, "the colliding block was not copied");
    assert_eq!(dst_agent.recorded_checksum(10), None);
    assert_eq!(dst_agent.recorded_digest(8), Some(ours[2]));
    eprintln!("{test}: a name collision was refused by its content digest");
    // a TCP reader of the IPC source
    let tcp = instance();
    let r = tcp.fetch(&ep, &NAMES, 0, vec![0, 1]);
    assert_eq!((r.failure, r.blocks), (None, 2), "{}", r.detail);
    assert_eq!(tcp.pool.read(1), content(NAMES[1], bb));
    // an IPC reader of a TCP-only source falls back to TCP (the blocks land in its device
    // pool through its mover's slots); with the transport pinned it is refused
    tcp.hold(&NAMES, 8);
    let r = dst_agent.submit(req(&tcp.endpoint(), 0, vec![5]), None).unwrap().wait(Duration::from_secs(30)).unwrap();
    assert_eq!((r.failure, r.blocks), (None, 1), "{}", r.detail);
    assert_eq!(dst.read(5), content(NAMES[0], bb));
    assert_eq!(dst_agent.stats().transport_fallbacks, 1);
    let pinned_pool = DevPool::new(&dev);
    let pinned = {
        let mut c = ipc_config();
        c.limits.tcp_fallback = false;
        // SAFETY: the pool outlives the agent (dropped first, below).
        unsafe { Agent::new(c, pinned_pool.layout.clone(), Box::new(Holder(Arc::new(Cache::default())))) }.unwrap()
    };
    let r = pinned.submit(req(&tcp.endpoint(), 0, vec![5]), None).unwrap().wait(Duration::from_secs(30)).unwrap();
    assert_eq!((r.failure, r.blocks), (Some(FailReason::Refused), 0), "{}", r.detail);
    assert!(r.detail.contains("unsupported"), "{}", r.detail);
    drop(pinned);
    drop(pinned_pool);
    eprintln!("{test}: TCP reader, IPC reader falling back to TCP, pinned IPC reader refused");
    // cancels at any point of a fetch (before, during or after the copy): each completes as
    // whole or as cancelled with only leading blocks counted, those byte-exact (the pins are
    // checked below)
    let mut outcomes = Vec::new();
    for _ in 0..8 {
        let ids = vec![5u32, 6, 7, 8, 10, 12];
        let f = dst_agent.submit(req(&ep, 0, ids.clone()), None).unwrap();
        f.cancel();
        let r = f.wait(Duration::from_secs(30)).expect("a cancelled fetch completes");
        match r.failure {
            None => assert_eq!(r.blocks, 6, "{}", r.detail),
            Some(FailReason::Cancelled) => assert!(r.blocks < 6, "{}", r.detail),
            other => panic!("a cancel ended as {other:?}: {}", r.detail),
        }
        for (i, &id) in ids.iter().enumerate().take(r.blocks) {
            assert_eq!(dst.read(id), content(NAMES[i], bb), "counted block {i} of a cancelled fetch");
        }
        outcomes.push((r.failure, r.blocks));
    }
    eprintln!("{test}: cancels: {outcomes:?}");
    // the source's memory goes bad after recording: the third block fails, two are counted
    writeln!(to, "corrupt 6").unwrap();
    assert_eq!(expect("CORRUPTED "), "6");
    let r = dst_agent.submit(req(&ep, 0, vec![10, 12, 13, 14]), None).unwrap().wait(Duration::from_secs(30)).unwrap();
    assert_eq!((r.failure, r.blocks), (Some(FailReason::Corrupt), 2), "{}", r.detail);
    assert_eq!(dst_agent.recorded_checksum(13), None, "the bad block was not recorded");
    // every pin released at DONE (asked again until it is, bounded)
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        writeln!(to, "pinned").unwrap();
        let n = expect("PINNED ");
        if n == "0" {
            break;
        }
        assert!(Instant::now() < end, "the source still holds {n} pins");
        std::thread::sleep(Duration::from_millis(5));
    }
    eprintln!("{test}: corruption caught, pins released");
    // two agents of one process: the addresses are used as they are
    let mut local_src = DevPool::new(&dev);
    let local_cache = Arc::new(Cache::default());
    let local = mk(&local_src.layout, &local_cache);
    for (i, &n) in NAMES.iter().enumerate() {
        local_src.write(i as u32, &content(n, bb));
        local_cache.held.lock().unwrap().insert(n, i as u32);
    }
    local.record_checksums(&(0..NAMES.len() as u32).collect::<Vec<_>>()).unwrap();
    let r = dst_agent
        .submit(req(local.endpoint().unwrap(), 0, vec![7, 8]), None)
        .unwrap()
        .wait(Duration::from_secs(30))
        .unwrap();
    assert_eq!((r.failure, r.blocks), (None, 2), "{}", r.detail);
    assert_eq!(dst.read(8), content(NAMES[1], bb));
    // the source process exits while its pool is mapped here: the mappings are let go (the
    // idle fetch workers look every 50 ms), nothing is left mapped, and a fetch from the gone
    // source fails cleanly
    let (mapped, unmapped) = (dst_agent.stats().ipc_mapped_now, dst_agent.stats().ipc_unmapped);
    assert!(mapped >= 1);
    drop(to);
    assert!(child.wait().unwrap().success(), "the source process failed");
    eventually("the gone source's mappings to be let go", || dst_agent.stats().ipc_mapped_now == 0);
    assert_eq!(dst_agent.stats().ipc_unmapped - unmapped, mapped, "each mapping let go once");
    let r = dst_agent.submit(req(&ep, 0, vec![3]), None).unwrap().wait(Duration::from_secs(30)).unwrap();
    assert_eq!((r.failure, r.blocks), (Some(FailReason::Connect), 0), "{}", r.detail);
    assert!(dst_agent.prometheus().contains("kvrelay_kv_agent_ipc_mapped 0"), "the gauge is exported");
    eprintln!("{test}: ran on CUDA device 0, source in its own process");
}

/// A source pool of the virtual memory API (`cuMemCreate`, three allocations side by side, one
/// layer straddling two), as a runtime's allocator may hand out (an H100 or H200): the source
/// copies the asked blocks out of it into its export area, whose allocation goes to the
/// destination as a POSIX descriptor over the source's Unix socket; the destination maps it
/// once and copies as from any pool, byte-exact and verified; the second fetch (on the same
/// kept-alive connection, so the same area) reuses the mapping; when the source exits the
/// mapping is let go. The destination's own pool is of the same kind. Memory of that API
/// created without the POSIX handle type is served too (nothing of the pool is exported).
/// Skips without a CUDA driver.
#[test]
fn cuda_ipc_serves_a_pool_of_the_virtual_memory_api() {
    let test = "cuda_ipc_serves_a_pool_of_the_virtual_memory_api";
    let Some(dev) = cuda_device(test) else { return };
    if std::env::var_os(SOURCE_ENV).is_some() {
        serve_source(test, DevPool::new_vmm(&dev, true));
        return;
    }
    let bb = Pool::new().block_bytes();
    let agent_over = |pool: &DevPool, cache: &Arc<Cache>| {
        let mut c = ipc_config();
        c.limits.tcp_fallback = false; // a fetch that did not go over CUDA IPC fails
        c.limits.export_whole_allocations = true; // the fixture's room between its layers
                                                  // SAFETY: the pool outlives the agent (dropped first).
        unsafe { Agent::new(c, pool.layout.clone(), Box::new(Holder(cache.clone()))) }
    };
    // no POSIX handle type: served all the same (a grant maps an export area, never the pool)
    let plain = DevPool::new_vmm(&dev, false);
    agent_over(&plain, &Arc::new(Cache::default())).expect("a pool that cannot be exported is served from areas");
    drop(plain);
    let (mut child, to, expect) = spawn_source(test);
    let ep = expect("ENDPOINT ");
    let mut dst = DevPool::new_vmm(&dev, true);
    let dst_agent = agent_over(&dst, &Arc::new(Cache::default())).unwrap();
    let req = |held: usize, dst: Vec<u32>| FetchRequest {
        endpoint: ep.clone(),
        names: NAMES.to_vec(),
        held,
        dst,
        deadline: Duration::from_secs(20),
        digests: Vec::new(),
    };
    let ids = vec![9u32, 2, 11, 0, 15, 1];
    let r = dst_agent.submit(req(0, ids.clone()), None).unwrap().wait(Duration::from_secs(30)).unwrap();
    assert_eq!((r.failure, r.blocks), (None, 6), "{}", r.detail);
    for (i, &id) in ids.iter().enumerate() {
        assert_eq!(dst.read(id), content(NAMES[i], bb), "block {i} copied out of the source's mapped range");
        assert_eq!(dst_agent.recorded_checksum(id), Some(kv_checksum(&content(NAMES[i], bb))));
    }
    let s = dst_agent.stats();
    assert_eq!((s.ipc_mapped_now, s.transport_fallbacks), (1, 0), "one range mapped, nothing over TCP");
    let r = dst_agent.submit(req(3, vec![4, 5, 6]), None).unwrap().wait(Duration::from_secs(30)).unwrap();
    assert_eq!((r.failure, r.blocks), (None, 3), "{}", r.detail);
    assert_eq!(dst.read(6), content(NAMES[5], bb));
    assert_eq!(dst_agent.stats().ipc_mapped_now, 1, "the mapping was reused");
    eprintln!("{test}: two fetches from a source pool of the virtual memory API verified");
    drop(to);
    assert!(child.wait().unwrap().success(), "the source process failed");
    eventually("the gone source's range to be let go", || dst_agent.stats().ipc_mapped_now == 0);
    assert_eq!(dst_agent.stats().ipc_unmapped, 1);
    eprintln!("{test}: ran on CUDA device 0, source in its own process");
}

/// No handle without proof, on a GPU: a source with a deployment key in another process gives a
/// process without the key nothing (a hello by hand is refused before any name is looked at; an
/// agent with another key is refused); with the key, a hello naming nothing the source holds,
/// or nothing, gets an offer with no exports, and one naming held blocks gets the exports they
/// are read through; a keyed agent fetches over CUDA IPC byte exact. An agent without any key
/// refuses CUDA IPC hellos (`grants_refused_unkeyed`): its peers fall back to TCP.
#[test]
fn cuda_ipc_grants_go_only_to_keyed_peers_and_only_with_blocks() {
    use kvrelay::agent::wire;
    let test = "cuda_ipc_grants_go_only_to_keyed_peers_and_only_with_blocks";
    let Some(dev) = cuda_device(test) else { return };
    const KEY: &str = "the deployment's key, which the test alone holds";
    if std::env::var_os(SOURCE_ENV).is_some() {
        serve_source(test, DevPool::new(&dev));
        return;
    }
    let bb = Pool::new().block_bytes();
    let (mut child, to, expect) = spawn_source_with(test, &[(SOURCE_KEY_ENV, KEY)]);
    let ep = expect("ENDPOINT ");
    let key = kvrelay::agent::Psk::new(KEY.as_bytes()).unwrap();
    // without the key: nothing, whatever the hello names
    for names in [&[][..], &[7, 8][..], &NAMES[..2]] {
        let e = offer_by_hand(&ep, None, wire::IPC_HELLO, names).unwrap_err();
        assert!(e.contains("auth_failed"), "{e}");
    }
    let mut dst = DevPool::new(&dev);
    let dst_layout = dst.layout.clone();
    let mk = |c: AgentConfig| {
        // SAFETY: the pool outlives the agents (dropped at the end of the test, agents first).
        unsafe { Agent::new(c, dst_layout.clone(), Box::new(Holder(Arc::new(Cache::default())))) }.unwrap()
    };
    let req = |dst: Vec<u32>| FetchRequest {
        endpoint: ep.clone(),
        names: NAMES.to_vec(),
        held: 0,
        dst,
        deadline: Duration::from_secs(20),
        digests: Vec::new(),
    };
    let other = mk(ipc_config()); // the per-user key: not the deployment's
    let r = other.submit(req(vec![0, 1]), None).unwrap().wait(Duration::from_secs(30)).unwrap();
    assert_eq!((r.failure, r.blocks), (Some(FailReason::AuthFailed), 0), "{}", r.detail);
    assert_eq!(other.stats().ipc_mapped_now, 0, "nothing mapped");
    // with the key: exports only with blocks
    for names in [&[][..], &[7, 8][..]] {
        let o = offer_by_hand(&ep, Some(&key), wire::IPC_HELLO, names).unwrap();
        assert!(o.blocks.is_empty() && o.metadata.is_empty(), "an offer of no block carries no exports");
    }
    let o = offer_by_hand(&ep, Some(&key), wire::IPC_HELLO, &NAMES[..2]).unwrap();
    assert_eq!(o.blocks.len(), 2);
    assert!(!o.metadata.is_empty(), "held blocks come with the exports they are read through");
    let keyed = mk({
        let mut c = ipc_config();
        c.key = Some(key.clone());
        c.limits.tcp_fallback = false;
        c
    });
    let r = keyed.submit(req(vec![3, 4, 5]), None).unwrap().wait(Duration::from_secs(30)).unwrap();
    assert_eq!((r.failure, r.blocks), (None, 3), "{}", r.detail);
    for (i, id) in [3u32, 4, 5].into_iter().enumerate() {
        assert_eq!(dst.read(id), content(NAMES[i], bb), "block {id}");
    }
    assert!(keyed.stats().ipc_mapped_now > 0, "over CUDA IPC");
    drop((other, keyed));
    drop(to);
    assert!(child.wait().unwrap().success(), "the source process ended cleanly");
    // an agent without a key grants nothing: its CUDA IPC readers fall back to TCP
    let src = DevPool::new(&dev);
    let src_cache = Arc::new(Cache::default());
    let unkeyed_cfg = || {
        let mut c = ipc_config();
        c.per_user_key = false;
        c
    };
    // SAFETY: the pool outlives the agent (dropped first, below).
    let plain = unsafe { Agent::new(unkeyed_cfg(), src.layout.clone(), Box::new(Holder(src_cache.clone()))) }.unwrap();
    let mut src = src;
    for (i, &n) in NAMES.iter().enumerate() {
        src.write(i as u32, &content(n, bb));
        src_cache.held.lock().unwrap().insert(n, i as u32);
    }
    plain.record_checksums(&(0..NAMES.len() as u32).collect::<Vec<_>>()).unwrap();
    let reader = mk(unkeyed_cfg());
    let r = reader
        .submit(FetchRequest { endpoint: plain.endpoint().unwrap().to_string(), ..req(vec![6, 7]) }, None)
        .unwrap()
        .wait(Duration::from_secs(30))
        .unwrap();
    assert_eq!((r.failure, r.blocks), (None, 2), "{}", r.detail);
    assert_eq!((plain.stats().grants_refused_unkeyed, reader.stats().transport_fallbacks), (1, 1));
    assert_eq!(reader.stats().ipc_mapped_now, 0, "nothing was mapped: the blocks came over TCP");
    assert_eq!(dst.read(7), content(NAMES[1], bb));
    eventually("every pin released", || src_cache.pinned() == 0);
    eprintln!("{test}: ran on CUDA device 0");
}

/// What a peer gets from a source's CUDA IPC grant (an H100 or H200): a keyed peer that asks for
/// one block and maps its grant as a hostile peer would (readable and writable) reaches an
/// export area of the source's own: the mapping's extent, as the driver has it, is the area
/// the offer states, the asked block lies in its slot 0, and every other byte is zero (no other
/// block, nothing the source's memory held before). What the peer writes there (not
/// preventable) reaches nobody: an honest destination then fetches the same block, and the ones
/// around it, byte exact, nothing `corrupt`. Skips without a CUDA driver.
#[test]
fn a_peer_mapping_a_grant_reaches_the_asked_blocks_only_and_its_writes_reach_nobody() {
    use kvrelay::agent::wire;
    let test = "a_peer_mapping_a_grant_reaches_the_asked_blocks_only_and_its_writes_reach_nobody";
    let Some(dev) = cuda_device(test) else { return };
    const KEY: &str = "the deployment's key, which a keyed peer holds too";
    if std::env::var_os(SOURCE_ENV).is_some() {
        serve_source(test, DevPool::new(&dev));
        return;
    }
    let bb = Pool::new().block_bytes();
    let (mut child, mut to, expect) = spawn_source_with(test, &[(SOURCE_KEY_ENV, KEY)]);
    let ep = expect("ENDPOINT ");
    let key = kvrelay::agent::Psk::new(KEY.as_bytes()).unwrap();
    // a keyed peer asks for one block and keeps its connection (and so the grant) open
    let (o, mut conn) = offer_by_hand_open(&ep, Some(&key), wire::IPC_HELLO, &NAMES[1..2]).unwrap();
    assert_eq!(o.blocks.len(), 1);
    assert_eq!(o.blocks[0].0, 0, "the block is offered in the area's slot 0");
    let g = kvrelay::agent::map_grant(&dev, &o.metadata).unwrap();
    let (base, size) = dev.address_range(g.base).unwrap();
    assert_eq!((base, size), (g.base, g.size), "the driver's extent of the mapping is the grant");
    let stated: u64 = o.segments.iter().map(|s| s.1 * u64::from(o.num_blocks)).sum();
    assert!(size >= stated && size <= stated.next_multiple_of(2 << 20), "{size} bytes for an area of {stated}");
    assert!(o.num_blocks < BLOCKS, "an area of {} blocks, not the pool's {BLOCKS}", o.num_blocks);
    eprintln!("{test}: the grant maps {size} bytes: an area of {} blocks", o.num_blocks);
    let mut all = vec![0u8; size as usize];
    {
        let _ctx = dev.bind().unwrap();
        // SAFETY: the whole mapping (its extent checked above) into a host buffer of its size.
        let r = unsafe { cudarc::driver::sys::cuMemcpyDtoH_v2(all.as_mut_ptr().cast(), g.base, all.len()) };
        assert_eq!(r, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
    }
    // slot 0 of every segment holds the asked block's piece: taken out, nothing else is left
    let mut block = Vec::new();
    for &(seg, _, len) in &o.segments {
        let at = (seg - g.source_base) as usize;
        block.extend_from_slice(&all[at..at + len as usize]);
        all[at..at + len as usize].fill(0);
    }
    assert_eq!(block, content(NAMES[1], bb), "the asked block");
    assert!(all.iter().all(|&b| b == 0), "nothing but the asked block is reachable");
    // the peer writes over the block it was granted
    {
        let _ctx = dev.bind().unwrap();
        let junk = [0x5au8; 64];
        let at = g.base + (o.segments[0].0 - g.source_base) + 7;
        // SAFETY: 64 bytes from a live local into the mapping (inside slot 0 of segment 0).
        let r = unsafe { cudarc::driver::sys::cuMemcpyHtoD_v2(at, junk.as_ptr().cast(), junk.len()) };
        assert_eq!(r, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
        // read back (a copy from pageable memory may still be on its way when the call returns:
        // the read waits for it, before the mapping goes)
        let mut back = [0u8; 64];
        // SAFETY: 64 bytes of the mapping into a live local.
        let r = unsafe { cudarc::driver::sys::cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), at, back.len()) };
        assert_eq!(
            (r, back),
            (cudarc::driver::sys::CUresult::CUDA_SUCCESS, junk),
            "a peer's write lands (not preventable)"
        );
    }
    drop(g);
    wire::write_frame(&mut conn, wire::DONE, &1u64.to_le_bytes(), Instant::now() + Duration::from_secs(20)).unwrap();
    drop(conn);
    // an honest destination fetching from that source gets every block exact
    let mut dst = DevPool::new(&dev);
    let dst_agent = {
        let mut c = ipc_config();
        c.key = Some(key.clone());
        c.limits.tcp_fallback = false;
        // SAFETY: the pool outlives the agent (dropped first, below).
        unsafe { Agent::new(c, dst.layout.clone(), Box::new(Holder(Arc::new(Cache::default())))) }.unwrap()
    };
    let req = FetchRequest {
        endpoint: ep.clone(),
        names: NAMES[..4].to_vec(),
        held: 0,
        dst: vec![10, 12, 13, 14],
        deadline: Duration::from_secs(20),
        digests: Vec::new(),
    };
    let r = dst_agent.submit(req, None).unwrap().wait(Duration::from_secs(30)).unwrap();
    assert_eq!((r.failure, r.blocks), (None, 4), "{}", r.detail);
    for (i, id) in [10u32, 12, 13, 14].into_iter().enumerate() {
        assert_eq!(dst.read(id), content(NAMES[i], bb), "block {id}");
    }
    assert_eq!(dst_agent.stats().transport_fallbacks, 0, "copied over CUDA IPC");
    drop(dst_agent);
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        writeln!(to, "pinned").unwrap();
        if expect("PINNED ") == "0" {
            break;
        }
        assert!(Instant::now() < end, "the source still holds pins");
        std::thread::sleep(Duration::from_millis(5));
    }
    drop(to);
    assert!(child.wait().unwrap().success(), "the source process failed");
    eprintln!("{test}: ran on CUDA device 0, source in its own process");
}

/// A write into a source's device pool that keeps the public checksum (anyone who maps the pool
/// can compute one) is refused by the keyed tag: both agents hold the per-user key, the source's
/// kernel tagged its blocks when they were recorded, and the destination's copy kernel tags
/// what landed from the same loads and refuses a block whose tag differs, before recording it.
#[test]
fn a_write_that_keeps_the_checksum_is_refused_over_cuda_ipc_by_the_keyed_tag() {
    let test = "a_write_that_keeps_the_checksum_is_refused_over_cuda_ipc_by_the_keyed_tag";
    let Some(dev) = cuda_device(test) else { return };
    if std::env::var_os(SOURCE_ENV).is_some() {
        serve_source(test, DevPool::new(&dev));
        return;
    }
    let bb = Pool::new().block_bytes();
    let (mut child, mut to, expect) = spawn_source(test);
    let ep = expect("ENDPOINT ");
    writeln!(to, "forge 6").unwrap();
    assert_eq!(expect("FORGED "), "6");
    let mut dst = DevPool::new(&dev);
    let dst_agent = {
        let mut c = ipc_config();
        c.limits.tcp_fallback = false;
        // SAFETY: the pool outlives the agent (dropped first, below).
        unsafe { Agent::new(c, dst.layout.clone(), Box::new(Holder(Arc::new(Cache::default())))) }.unwrap()
    };
    let req = FetchRequest {
        endpoint: ep,
        names: NAMES[..4].to_vec(),
        held: 0,
        dst: vec![10, 12, 13, 14],
        deadline: Duration::from_secs(20),
        digests: Vec::new(),
    };
    let r = dst_agent.submit(req, None).unwrap().wait(Duration::from_secs(30)).unwrap();
    assert_eq!((r.failure, r.blocks), (Some(FailReason::Corrupt), 2), "{}", r.detail);
    assert!(r.detail.contains("keyed tag"), "the checksum matched, the tag did not: {}", r.detail);
    assert_eq!(dst.read(12), content(NAMES[1], bb), "the blocks before it are exact");
    assert_eq!(dst_agent.recorded_checksum(13), None, "the forged block was not taken");
    assert!(dst_agent.recorded_tag(10).is_some() && dst_agent.recorded_tag(12).is_some(), "landed blocks keep tags");
    assert_eq!(dst_agent.stats().transport_fallbacks, 0, "copied over CUDA IPC");
    // the tag the copy kernel took of a landed block is the one the summing kernel takes of it
    // in place
    let landed = dst_agent.recorded_tag(12);
    dst_agent.record_checksums(&[12]).unwrap();
    assert_eq!(dst_agent.recorded_tag(12), landed);
    drop(dst_agent);
    writeln!(to, "pinned").unwrap();
    let _ = expect("PINNED ");
    drop(to);
    assert!(child.wait().unwrap().success(), "the source process failed");
    eprintln!("{test}: ran on CUDA device 0, source in its own process");
}
