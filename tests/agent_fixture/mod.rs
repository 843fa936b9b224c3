//! What the agent tests share: a vLLM-style host pool, the runtime's reuse cache and its holder,
//! an instance (agent, cache, pool), a GPU pool, and the bounded wait.
#![allow(dead_code)] // each test file uses a different part

use std::collections::HashMap;
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[cfg(feature = "nixl")]
use kvrelay::agent::Transport;
use kvrelay::agent::{Agent, AgentConfig, BlockHolder, FailReason, FetchRequest, FetchResult, Fingerprint, Psk};
use kvrelay::copy::{CpuEngine, KvLayout};

pub const BLOCKS: u32 = 16;

pub const LAYERS: usize = 3;

pub const KV_BLOCK: u64 = 1024; // bytes of K (or V) of one layer in one block

pub fn fp() -> Fingerprint {
    Fingerprint { block_tokens: 32, layers: LAYERS as u32, kv_heads: 2, head_dim: 8, dtype_bytes: 2, naming: 0xfeed }
}

/// A vLLM-style pool: one allocation per layer, `[2, BLOCKS, KV_BLOCK]`.
pub struct Pool {
    pub layers: Vec<Vec<u128>>,
    pub layout: KvLayout,
}

impl Pool {
    pub fn new() -> Pool {
        let mut layers: Vec<Vec<u128>> =
            (0..LAYERS).map(|_| vec![0u128; (2 * BLOCKS as u64 * KV_BLOCK / 16) as usize]).collect();
        let bases: Vec<u64> = layers.iter_mut().map(|l| l.as_mut_ptr() as u64).collect();
        let layout = KvLayout::per_layer_kv_first(&bases, BLOCKS, KV_BLOCK).unwrap();
        Pool { layers, layout }
    }
    pub fn block_bytes(&self) -> usize {
        self.layout.stage_block_bytes() as usize
    }
    pub fn write(&self, id: u32, content: &[u8]) {
        // SAFETY: the pool's memory lives as long as `self`; tests write blocks no agent reads.
        let mut e = unsafe { CpuEngine::new(self.layout.clone()) };
        e.scatter(content, &[id]).unwrap();
    }
    pub fn read(&self, id: u32) -> Vec<u8> {
        // SAFETY: as in `write`.
        let mut e = unsafe { CpuEngine::new(self.layout.clone()) };
        let mut out = vec![0u8; self.block_bytes()];
        e.gather(&[id], &mut out).unwrap();
        out
    }
    pub fn corrupt(&mut self, id: u32, byte: usize) {
        // the first layer's K of block `id`
        let l = &mut self.layers[0];
        // SAFETY: a byte view of the u128 vector, in bounds (byte < KV_BLOCK).
        let bytes = unsafe { std::slice::from_raw_parts_mut(l.as_mut_ptr() as *mut u8, l.len() * 16) };
        bytes[id as usize * KV_BLOCK as usize + byte] ^= 0x10;
    }
}

impl Pool {
    /// Rewrite the first two words of block `id` so that its public checksum stays the same
    /// (what anyone who can write the pool can do: the checksum's per-word keys are public and
    /// `fmix64` is invertible); returns the block's new bytes.
    pub fn forge_keeping_checksum(&self, id: u32) -> Vec<u8> {
        let mut b = self.read(id);
        forge_keeping_checksum(&mut b, 0x0123_4567_89ab_cdef);
        self.write(id, &b);
        b
    }
}

/// Rewrite word 0 of `b` to `new` and word 1 so that `kv_checksum(b)` stays the same.
pub fn forge_keeping_checksum(b: &mut [u8], new: u64) {
    use kvrelay::checksum::fmix64;
    const K: u64 = 0x9E37_79B9_7F4A_7C15;
    fn inv(c: u64) -> u64 {
        let mut i = c;
        for _ in 0..6 {
            i = i.wrapping_mul(2u64.wrapping_sub(c.wrapping_mul(i)));
        }
        i
    }
    fn unfmix64(mut x: u64) -> u64 {
        x ^= x >> 33;
        x = x.wrapping_mul(inv(0xc4ce_b9fe_1a85_ec53));
        x ^= x >> 33;
        x = x.wrapping_mul(inv(0xff51_afd7_ed55_8ccd));
        x ^= x >> 33;
        x
    }
    let w = |b: &[u8], i: usize| u64::from_le_bytes(b[8 * i..8 * i + 8].try_into().unwrap());
    let (w0, w1) = (w(b, 0), w(b, 1));
    let t1 = fmix64(w1 ^ K.wrapping_mul(2)).wrapping_add(fmix64(w0 ^ K)).wrapping_sub(fmix64(new ^ K));
    b[..8].copy_from_slice(&new.to_le_bytes());
    b[8..16].copy_from_slice(&(unfmix64(t1) ^ K.wrapping_mul(2)).to_le_bytes());
}

pub fn content(name: u64, len: usize) -> Vec<u8> {
    let mut x = name ^ 0x9e37_79b9_7f4a_7c15;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// The runtime's reuse cache: names -> block ids, and pin counts.
#[derive(Default)]
pub struct Cache {
    pub held: Mutex<HashMap<u64, u32>>,
    pub pins: Mutex<HashMap<u32, i64>>,
    pub pin_calls: AtomicUsize,
    /// While `Some(first)`, a pin of names that do not start with `first` waits (a source that
    /// answers only the part of a fetch that starts there) until the gate opens (`None`).
    pub gate: Mutex<Option<u64>>,
    pub gate_opened: std::sync::Condvar,
    /// A pin panics (a holder with a bug).
    pub panic_in_pin: std::sync::atomic::AtomicBool,
    /// Withheld blocks the agent handed back (`BlockHolder::returned`), in order.
    pub returned: Mutex<Vec<u32>>,
}

/// The holder the agent gets: a shared reference to the cache.
pub struct Holder(pub Arc<Cache>);

impl BlockHolder for Holder {
    fn pin(&self, names: &[u64], ids: &mut [u32]) -> usize {
        self.0.pin_calls.fetch_add(1, Ordering::Relaxed);
        assert!(!self.0.panic_in_pin.load(Ordering::Relaxed), "a holder whose pin panics");
        let mut g = self.0.gate.lock().unwrap();
        while g.is_some_and(|first| names.first() != Some(&first)) {
            g = self.0.gate_opened.wait(g).unwrap();
        }
        drop(g);
        let held = self.0.held.lock().unwrap();
        let mut pins = self.0.pins.lock().unwrap();
        let mut n = 0;
        for (i, name) in names.iter().enumerate() {
            let Some(&id) = held.get(name) else { break };
            ids[i] = id;
            *pins.entry(id).or_insert(0) += 1;
            n += 1;
        }
        n
    }
    fn unpin(&self, ids: &[u32]) {
        let mut pins = self.0.pins.lock().unwrap();
        for id in ids {
            let p = pins.get_mut(id).expect("unpin of a block never pinned");
            *p -= 1;
            assert!(*p >= 0, "block {id} unpinned twice");
        }
    }
    fn returned(&self, ids: &[u32]) {
        self.0.returned.lock().unwrap().extend_from_slice(ids);
    }
}

impl Cache {
    pub fn pinned(&self) -> i64 {
        self.pins.lock().unwrap().values().sum()
    }
    /// Pins of names that do not start with `first` wait until [`Cache::open`].
    pub fn close_gate_except(&self, first: u64) {
        *self.gate.lock().unwrap() = Some(first);
    }
    pub fn open(&self) {
        *self.gate.lock().unwrap() = None;
        self.gate_opened.notify_all();
    }
}

/// An instance: pool, cache, agent.
pub struct Instance {
    pub agent: Agent,
    pub cache: Arc<Cache>,
    pub pool: Pool,
}

pub fn instance_with(cfg: impl FnOnce(&mut AgentConfig)) -> Instance {
    let pool = Pool::new();
    let cache = Arc::new(Cache::default());
    let mut c = AgentConfig::new(fp());
    // these tests move blocks by name (the transports, the service); the checked path has
    // tests of its own (`content_digests_are_checked`, `unchecked_fetches_need_the_limit`)
    c.limits.unchecked_fetch = true;
    cfg(&mut c);
    // SAFETY: the pool outlives the agent (fields drop in order: agent first).
    let agent = unsafe { Agent::new(c, pool.layout.clone(), Box::new(Holder(cache.clone()))) }.unwrap();
    Instance { agent, cache, pool }
}

/// The default limits with fetches by name allowed (what `instance` gives): for tests that set
/// limits of their own.
#[allow(dead_code)] // not every test binary that includes the fixture uses it
pub fn fetch_limits() -> kvrelay::agent::Limits {
    kvrelay::agent::Limits { unchecked_fetch: true, ..kvrelay::agent::Limits::default() }
}

/// An agent without authentication (per-user key off): for tests whose peer is a raw socket that
/// speaks the wire by hand, or that stalls.
#[allow(dead_code)] // not every test binary that includes the fixture uses it
pub fn unkeyed_with(cfg: impl FnOnce(&mut AgentConfig)) -> Instance {
    instance_with(|c| {
        c.per_user_key = false;
        cfg(c)
    })
}

pub fn instance() -> Instance {
    instance_with(|_| {})
}

impl Instance {
    /// Hold `names` in blocks `first..`, recorded as reusable.
    pub fn hold(&self, names: &[u64], first: u32) {
        let bb = self.pool.block_bytes();
        let ids: Vec<u32> = (first..first + names.len() as u32).collect();
        for (&n, &id) in names.iter().zip(&ids) {
            self.pool.write(id, &content(n, bb));
            self.cache.held.lock().unwrap().insert(n, id);
        }
        self.agent.record_checksums(&ids).unwrap();
    }
    pub fn endpoint(&self) -> String {
        self.agent.endpoint().unwrap().to_string()
    }
    pub fn fetch(&self, from: &str, names: &[u64], held: usize, dst: Vec<u32>) -> FetchResult {
        let req = FetchRequest {
            endpoint: from.into(),
            names: names.to_vec(),
            held,
            dst,
            deadline: Duration::from_secs(10),
            digests: Vec::new(),
        };
        self.agent.submit(req, None).unwrap().wait(Duration::from_secs(20)).expect("the fetch completes")
    }
}

/// Wait (bounded) until `f` holds.
pub fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

pub const NAMES: [u64; 6] = [101, 102, 103, 104, 105, 106];

pub fn key(k: &str) -> Option<Psk> {
    Some(Psk::new(k.as_bytes()).unwrap())
}

/// A connection from a given loopback address.
pub fn connect_from(ip: [u8; 4], to: &str) -> TcpStream {
    let to: SocketAddr = to.strip_prefix("tcp://").unwrap().parse().unwrap();
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    s.bind(&SocketAddr::from((ip, 0)).into()).unwrap();
    s.connect(&to.into()).unwrap();
    s.into()
}

/// A device pool of the tests' shape, written and read through its own engine.
pub struct DevPool {
    pub _mem: Vec<kvrelay::copy::DeviceBuffer>,
    pub layout: KvLayout,
    pub engine: kvrelay::copy::CudaEngine,
    pub stream: kvrelay::copy::CudaStream,
    pub staging: kvrelay::copy::PinnedBuffer,
    pub _vmm: Option<kvrelay::copy::VmmBuffer>,
}

impl DevPool {
    pub fn new(dev: &Arc<kvrelay::copy::CudaDevice>) -> DevPool {
        use kvrelay::copy::DeviceBuffer;
        let mem: Vec<DeviceBuffer> = (0..LAYERS)
            .map(|_| DeviceBuffer::alloc(dev, (2 * u64::from(BLOCKS) * KV_BLOCK) as usize).unwrap())
            .collect();
        for m in &mem {
            m.write(0, &vec![0u8; m.len()]).unwrap();
        }
        let bases: Vec<u64> = mem.iter().map(|m| m.ptr()).collect();
        Self::over(dev, &bases, mem, None)
    }

    /// A pool in memory of the virtual memory API: three allocations side by side, the first
    /// layer at the start of the first, the second straddling the first two, the third in the
    /// third (`posix`: created with the POSIX descriptor handle type).
    pub fn new_vmm(dev: &Arc<kvrelay::copy::CudaDevice>, posix: bool) -> DevPool {
        let layer = 2 * u64::from(BLOCKS) * KV_BLOCK;
        let m = kvrelay::copy::VmmBuffer::alloc(dev, 3 * layer as usize, 3, posix).unwrap();
        let (va, chunk) = (m.ptr(), m.chunk_bytes() as u64);
        assert!(chunk >= 2 * layer, "the layers fit as placed");
        let bases = [va, va + chunk - layer / 2, va + 2 * chunk + layer];
        let zero = kvrelay::copy::CudaStream::new(dev).unwrap();
        {
            let _ctx = dev.bind().unwrap();
            for b in bases {
                // SAFETY: each layer lies inside the mapped range; the context is current.
                let r = unsafe { cudarc::driver::sys::cuMemsetD8Async(b, 0, layer as usize, zero.raw()) };
                assert_eq!(r, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
            }
        }
        zero.synchronize().unwrap();
        Self::over(dev, &bases[..LAYERS], Vec::new(), Some(m))
    }

    fn over(
        dev: &Arc<kvrelay::copy::CudaDevice>,
        bases: &[u64],
        mem: Vec<kvrelay::copy::DeviceBuffer>,
        vmm: Option<kvrelay::copy::VmmBuffer>,
    ) -> DevPool {
        use kvrelay::copy::{CudaEngine, CudaStream, EngineOptions, PinnedBuffer};
        let layout = KvLayout::per_layer_kv_first(bases, BLOCKS, KV_BLOCK).unwrap();
        // SAFETY: the pool's device memory lives in `_mem` or `_vmm` as long as the engine.
        let engine = unsafe { CudaEngine::new(dev, layout.clone(), EngineOptions::default()) }.unwrap();
        let bb = layout.stage_block_bytes() as usize;
        DevPool {
            _mem: mem,
            layout,
            engine,
            stream: CudaStream::new(dev).unwrap(),
            staging: PinnedBuffer::alloc(dev, bb).unwrap(),
            _vmm: vmm,
        }
    }
    pub fn write(&mut self, id: u32, bytes: &[u8]) {
        self.staging.as_mut_slice().copy_from_slice(bytes);
        self.engine.scatter(&self.staging, &[id], &self.stream, None).unwrap();
        self.stream.synchronize().unwrap();
    }
    pub fn read(&mut self, id: u32) -> Vec<u8> {
        self.engine.gather(&[id], &self.staging, &self.stream, None).unwrap();
        self.stream.synchronize().unwrap();
        self.staging.as_slice().to_vec()
    }
}

/// CUDA device 0, or `None` (said why) on a machine without a driver or device. With
/// `KVRELAY_REQUIRE_GPU=1` (the GPU machine's runs) a skip is a failure instead, so a GPU run
/// cannot pass with its GPU tests skipped.
pub fn cuda_device(test: &str) -> Option<Arc<kvrelay::copy::CudaDevice>> {
    let skip = |why: String| {
        assert!(std::env::var("KVRELAY_REQUIRE_GPU").as_deref() != Ok("1"), "{test}: KVRELAY_REQUIRE_GPU=1 but {why}");
        eprintln!("{test}: skipped: {why}");
        None
    };
    if !kvrelay::copy::driver_present() {
        return skip("no CUDA driver on this machine".into());
    }
    match kvrelay::copy::CudaDevice::open(0) {
        Ok(d) => Some(d),
        Err(e) => skip(e.to_string()),
    }
}

/// The NIXL transport when this build has it and its libraries load; `None` (said why) when
/// they are not installed. With `KVRELAY_NIXL_LIB_DIR` set (as the test command sets it), a
/// library that does not load fails the test instead of skipping it.
#[cfg(feature = "nixl")]
pub fn nixl(test: &str) -> Option<Transport> {
    let dir = std::env::var_os("KVRELAY_NIXL_LIB_DIR").filter(|d| !d.is_empty()).map(std::path::PathBuf::from);
    match kvrelay::agent::nixl::load_library(dir.as_deref()) {
        Ok(()) => Some(Transport::Nixl { lib_dir: dir }),
        Err(e) if dir.is_none() => {
            eprintln!("{test}: skipped: {e}");
            None
        }
        Err(e) => panic!("KVRELAY_NIXL_LIB_DIR is set, but: {e}"),
    }
}

/// Digests as a runtime computes them: distinct per block, a function of the block's "tokens".
pub fn digests_of(tokens: &[u64]) -> Vec<[u8; 32]> {
    let naming = kvrelay::names::Naming { seed: 7, block_tokens: 1, lora_id: 0, salt: &[] };
    let toks: Vec<u32> = tokens.iter().map(|&t| t as u32).collect();
    naming.digests(b"agent-test identity", &toks)
}

/// What every transport must do with content digests (`make` gives an instance of the
/// transport under test): a fetch that asks with digests takes only the leading blocks whose
/// source recorded the same digest; the block under a colliding name is never written; a
/// verified block is recorded with its digest; a source block with no digest is not taken by a
/// checked fetch and still by an unchecked one; bad arguments are refused.
pub fn content_digests_are_checked(make: &dyn Fn() -> Instance) {
    let a = make();
    a.hold(&NAMES, 2);
    let ids: Vec<u32> = (2..2 + NAMES.len() as u32).collect();
    // the source's block 3 holds other tokens than the destination's block 3 under the same
    // name (a crafted collision): its recorded digest is that of its own tokens
    let theirs = digests_of(&[1, 2, 3, 99, 5, 6]);
    let ours = digests_of(&[1, 2, 3, 4, 5, 6]);
    assert_eq!(theirs[..3], ours[..3]);
    assert_ne!(theirs[3], ours[3]);
    a.agent.record_digests(&ids, &theirs).unwrap();
    let b = make();
    let bb = b.pool.block_bytes();
    let before = b.pool.read(12);
    let checked = |held: usize, dst: Vec<u32>, digests: Vec<[u8; 32]>| {
        let req = FetchRequest {
            endpoint: a.endpoint(),
            names: NAMES.to_vec(),
            held,
            dst,
            deadline: Duration::from_secs(10),
            digests,
        };
        b.agent.submit(req, None).unwrap().wait(Duration::from_secs(20)).expect("the fetch completes")
    };
    let r = checked(0, vec![9, 10, 11, 12, 13], ours.clone());
    assert_eq!((r.failure, r.blocks), (Some(FailReason::DigestMismatch), 3), "{}", r.detail);
    assert_eq!(b.pool.read(12), before, "the block under a colliding name was never written");
    for (i, &id) in [9u32, 10, 11].iter().enumerate() {
        assert_eq!(b.pool.read(id), content(NAMES[i], bb));
        assert_eq!(b.agent.recorded_digest(id), Some(ours[i]), "a verified block is recorded with its digest");
    }
    assert_eq!(b.agent.recorded_digest(12), None);
    assert_eq!(b.agent.stats().fetch_failed_digest_mismatch, 1);
    // the same names asked with the source's own digests: all arrive (the check is the digest)
    let r = checked(0, vec![0, 1, 2, 3, 4, 5], theirs.clone());
    assert_eq!((r.failure, r.blocks), (None, 6), "{}", r.detail);
    // a source block without a recorded digest is not taken by a checked fetch, still by a
    // fetch that gives none (a runtime that does not check)
    let c = make();
    c.hold(&NAMES, 0);
    let r = checked_from(&b, &c.endpoint(), ours.clone());
    assert_eq!((r.failure, r.blocks), (Some(FailReason::DigestMismatch), 0), "{}", r.detail);
    let r = b.fetch(&c.endpoint(), &NAMES, 0, vec![6, 7]);
    assert_eq!((r.failure, r.blocks), (None, 2), "{}", r.detail);
    assert_eq!(b.agent.recorded_digest(6), None, "an unchecked fetch records no digest");
    // a digest count other than the names' is refused at submission
    let bad = FetchRequest {
        endpoint: a.endpoint(),
        names: NAMES.to_vec(),
        held: 0,
        dst: vec![14],
        deadline: Duration::from_secs(10),
        digests: ours[..2].to_vec(),
    };
    assert!(matches!(b.agent.submit(bad, None), Err(kvrelay::agent::AgentError::Argument(_))));
    assert!(b.agent.record_digests(&[BLOCKS], &ours[..1]).is_err(), "an id past the pool");
    assert!(b.agent.record_digests(&[0, 1], &ours[..1]).is_err(), "one digest per id");
    eventually("every pin released", || a.cache.pinned() == 0 && c.cache.pinned() == 0);
}

pub fn checked_from(b: &Instance, from: &str, digests: Vec<[u8; 32]>) -> FetchResult {
    let req = FetchRequest {
        endpoint: from.into(),
        names: NAMES.to_vec(),
        held: 0,
        dst: vec![14, 15],
        deadline: Duration::from_secs(10),
        digests,
    };
    b.agent.submit(req, None).unwrap().wait(Duration::from_secs(20)).expect("the fetch completes")
}

/// Ask the agent at `endpoint` by hand for an in-place offer: authenticate with `key` (none:
/// send the hello at once), send a hello of kind `hello` (`wire::IPC_HELLO`, `wire::NIXL_HELLO`)
/// naming `names`, read the answer, and end the source's pins (`DONE` 0). The offer, or the
/// refusal (its reason and text) or what went wrong.
#[allow(dead_code)] // not every test binary that includes the fixture uses it
pub fn offer_by_hand(
    endpoint: &str,
    key: Option<&kvrelay::agent::Psk>,
    hello: u8,
    names: &[u64],
) -> Result<kvrelay::agent::wire::InPlaceOffer, String> {
    let (offer, mut s) = offer_by_hand_open(endpoint, key, hello, names)?;
    let _ = kvrelay::agent::wire::write_frame(
        &mut s,
        kvrelay::agent::wire::DONE,
        &0u64.to_le_bytes(),
        Instant::now() + Duration::from_secs(20),
    );
    Ok(offer)
}

/// [`offer_by_hand`], with the connection left open (the source holds the offer's pins, and
/// its grant, until `DONE` or its deadline).
pub fn offer_by_hand_open(
    endpoint: &str,
    key: Option<&kvrelay::agent::Psk>,
    hello: u8,
    names: &[u64],
) -> Result<(kvrelay::agent::wire::InPlaceOffer, std::net::TcpStream), String> {
    use kvrelay::agent::{auth, wire};
    let mut s = std::net::TcpStream::connect(endpoint.strip_prefix("tcp://").unwrap()).map_err(|e| e.to_string())?;
    let end = Instant::now() + Duration::from_secs(20);
    let e = |e: &dyn std::fmt::Debug| format!("{e:?}");
    if let Some(key) = key {
        let client = auth::nonce().unwrap();
        wire::write_frame(&mut s, wire::AUTH_HELLO, &client, end).map_err(|x| e(&x))?;
        let (kind, len) = wire::read_header(&mut s, 1 << 10, end).map_err(|x| e(&x))?;
        let mut ch = vec![0u8; len];
        wire::Conn::read_by(&mut s, &mut ch, end).map_err(|x| e(&x))?;
        if kind != wire::AUTH_CHALLENGE || len != 2 * auth::NONCE {
            return Err(format!("no challenge: {:?}", wire::decode_refusal(&ch)));
        }
        let server: [u8; auth::NONCE] = ch[..auth::NONCE].try_into().unwrap();
        wire::write_frame(&mut s, wire::AUTH_PROOF, &key.client_proof(&client, &server), end).map_err(|x| e(&x))?;
        if !key.check_server(&client, &server, &ch[auth::NONCE..]) {
            return Err("the source does not prove it holds the key".into());
        }
    }
    wire::write_frame(&mut s, hello, &wire::encode_hello(&fp(), names), end).map_err(|x| e(&x))?;
    let (kind, len) = wire::read_header(&mut s, 1 << 20, end).map_err(|x| e(&x))?;
    let mut buf = vec![0u8; len];
    wire::Conn::read_by(&mut s, &mut buf, end).map_err(|x| e(&x))?;
    if kind == wire::REFUSE {
        let (r, text) = wire::decode_refusal(&buf);
        return Err(format!("refused {}: {text}", r.map_or("?", |r| r.as_str())));
    }
    let offer = wire::decode_in_place_offer(&buf).ok_or_else(|| format!("a frame of kind {kind} that is no offer"))?;
    Ok((offer, s))
}
