//! The NIXL transport (`--kv-transport nixl`, cargo feature `nixl`): block bytes move with
//! NIXL over UCX (RDMA, CUDA IPC, CMA, TCP: whatever UCX finds between the two instances);
//! control stays on the KV service's TCP channel ([`super::tcp`]).
//!
//! - **Startup.** [`load_library`] opens `libnixl_capi.so` (from `--nixl-lib-dir`, else the
//!   loader's search path) and checks every entry point this module calls, so a missing or
//!   mismatched library fails the server's start with a message, never a transfer. Then one
//!   agent with the UCX backend registers the whole KV pool once ([`NixlMem::new`]): host
//!   memory as DRAM, a `--device cuda:N` pool as VRAM of device N (UCX moves GPU memory with
//!   CUDA IPC between processes of one host, or RDMA where the NIC supports it). Nothing is
//!   registered per request.
//! - **A fetch.** The destination sends a hello with `nixl: true`; the source pins the leading
//!   run it holds and answers with an offer carrying its agent's metadata (loaded once per
//!   source agent), each block's address and the XXH3-64 it recorded when the block was
//!   written. The destination checks the offer (fingerprint, count, exactly one whole block
//!   per region), posts NIXL READs from the source's blocks straight into the fresh blocks of
//!   its lease, in requests of [`REQUEST_BYTES`] all posted at once, then, request by request
//!   in order, hashes the blocks where they now lie (host memory in place; GPU memory through
//!   the copy engine) and commits each block whose checksum matches. The first mismatch stops
//!   the fetch (`corrupt`); blocks after it are released. `DONE` unpins the source's blocks.
//! - **Failures** are those of the TCP transport (connect, timeout, refused, fingerprint,
//!   corrupt, truncated: an offered region that is not one whole block) plus a READ that
//!   NIXL reports failed (`truncated`: the source went away). A READ still in flight at the
//!   deadline cannot be proven stopped, so its destination blocks are quarantined: they leave
//!   the pool for good instead of being reused under a write (counted in the log; never seen
//!   in the tests).

use std::collections::HashMap;
use std::ffi::CString;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nixl_sys::{Agent, AgentConfig, MemType, MemoryRegion, NixlDescriptor, RegistrationHandle, ThreadSync};
use nixl_sys::{XferDescList, XferOp, XferRequest, XferStatus};
use tokio::net::TcpStream;

use super::tcp::{self, Done, Fault, Hello, InPlaceOffer, InPlaceSource, Offer};
use super::{BoxFuture, Destination, FailReason, FetchError, Fingerprint, Transport};
use crate::engine::{Engine, Region};

/// Bytes per NIXL transfer request: READs of a run are cut into requests of about this size,
/// all posted at once, verified and committed in order while the later ones are in flight.
pub const REQUEST_BYTES: usize = 64 << 20;

/// Every C entry point of `libnixl_capi.so` that `nixl-sys` 1.5.1 may call, one per line (its
/// stubs resolve each on first use and abort the process when one is missing, so all are
/// checked at startup).
const ENTRY_POINTS: &str = include_str!("nixl_entry_points.txt");

/// Open `libnixl_capi.so` (from `dir` when given) and check its entry points. The library
/// stays loaded for the life of the process; `nixl-sys` then finds it by its soname.
pub fn load_library(dir: Option<&std::path::Path>) -> Result<(), String> {
    let path = match dir {
        Some(d) => d.join("libnixl_capi.so"),
        None => "libnixl_capi.so".into(),
    };
    let c = CString::new(path.to_string_lossy().as_bytes()).map_err(|_| "--nixl-lib-dir holds a NUL byte")?;
    // SAFETY: `c` is a NUL-terminated path; dlopen has no other precondition. Loading runs the
    // library's initializers, which is what using it means.
    let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if h.is_null() {
        return Err(format!(
            "--kv-transport nixl: cannot load {}: {} (install the NIXL libraries, e.g. the nixl-cu13 1.5.1 wheel, and \
             pass their folder with --nixl-lib-dir or LD_LIBRARY_PATH)",
            path.display(),
            dlerror()
        ));
    }
    for name in ENTRY_POINTS.lines().filter(|l| !l.is_empty()) {
        let c = CString::new(name).expect("no NUL");
        // SAFETY: `h` is a live handle from dlopen (never closed); `c` is NUL-terminated.
        if unsafe { libc::dlsym(h, c.as_ptr()) }.is_null() {
            return Err(format!(
                "--kv-transport nixl: {} lacks `{name}`: a NIXL C API other than 1.5.1 (the version this server was \
                 built against)",
                path.display()
            ));
        }
    }
    Ok(())
}

fn dlerror() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string valid until the next dl call on
    // this thread; it is copied at once.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        return "unknown error".into();
    }
    // SAFETY: non-NULL, NUL-terminated (above).
    unsafe { std::ffi::CStr::from_ptr(e) }.to_string_lossy().into_owned()
}

/// A memory region to register: the KV pool.
#[derive(Debug)]
struct Pool(Region);

impl MemoryRegion for Pool {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.0.base as *const u8
    }
    fn size(&self) -> usize {
        self.0.len
    }
}

impl NixlDescriptor for Pool {
    fn mem_type(&self) -> MemType {
        mem_type(self.0.device)
    }
    fn device_id(&self) -> u64 {
        self.0.device.map_or(0, |d| d as u64)
    }
}

fn mem_type(device: Option<i32>) -> MemType {
    if device.is_some() {
        MemType::Vram
    } else {
        MemType::Dram
    }
}

/// This instance's NIXL agent, with the KV pool registered.
pub struct NixlMem {
    agent: Agent,
    // Dropped before the agent (field order): deregisters the pool.
    _registration: RegistrationHandle,
    region: Region,
    block_bytes: usize,
    metadata: Vec<u8>,
    /// Remote agents whose metadata is loaded, with that metadata.
    loaded: Mutex<HashMap<String, Vec<u8>>>,
}

impl NixlMem {
    /// Create the agent (UCX backend) and register the pool of `engine`. Call after
    /// [`load_library`].
    pub fn new(engine: &Engine) -> Result<Arc<NixlMem>, String> {
        let store = &engine.store;
        let region = store.region();
        let name = format!(
            "kvrelay-{}-{:x}",
            std::process::id(),
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos())
        );
        let cfg = AgentConfig { thread_sync: ThreadSync::Strict, enable_listen_thread: false, ..Default::default() };
        let agent = Agent::new_configured(&name, &cfg).map_err(|e| format!("NIXL agent: {e:?}"))?;
        let (_, params) = agent
            .get_plugin_params("UCX")
            .map_err(|e| format!("NIXL: no UCX plugin ({e:?}); are the NIXL plugins beside libnixl.so?"))?;
        agent.create_backend("UCX", &params).map_err(|e| format!("NIXL: the UCX backend did not start: {e:?}"))?;
        let registration = agent.register_memory(&Pool(region), None).map_err(|e| {
            format!("NIXL: registering the KV pool ({} bytes, {:?}): {e:?}", region.len, mem_type(region.device))
        })?;
        let metadata = agent.get_local_md().map_err(|e| format!("NIXL: local metadata: {e:?}"))?;
        // the reader verifies against checksums recorded at write time
        store.track_checksums();
        Ok(Arc::new(NixlMem {
            agent,
            _registration: registration,
            region,
            block_bytes: store.block_bytes(),
            metadata,
            loaded: Mutex::new(HashMap::new()),
        }))
    }

    /// The agent's name.
    pub fn agent_name(&self) -> String {
        self.agent.name()
    }

    fn block_addr(&self, id: u32) -> u64 {
        self.region.base + id as u64 * self.block_bytes as u64
    }

    /// Load `offer`'s agent metadata unless the same is loaded already.
    fn ensure_remote(&self, offer: &InPlaceOffer) -> Result<(), FetchError> {
        let mut loaded = self.loaded.lock().unwrap_or_else(|e| e.into_inner());
        if loaded.get(&offer.agent) == Some(&offer.metadata) {
            return Ok(());
        }
        if loaded.remove(&offer.agent).is_some() {
            let _ = self.agent.invalidate_remote_md(&offer.agent);
        }
        let name = self
            .agent
            .load_remote_md(&offer.metadata)
            .map_err(|e| FetchError::new(FailReason::Connect, format!("NIXL: the source's metadata: {e:?}")))?;
        if name != offer.agent {
            let _ = self.agent.invalidate_remote_md(&name);
            return Err(FetchError::new(FailReason::Corrupt, "the source's metadata names another agent"));
        }
        loaded.insert(name, offer.metadata.clone());
        Ok(())
    }

    /// Forget a source agent after a failure (the next fetch loads it afresh).
    fn forget_remote(&self, agent: &str) {
        if self.loaded.lock().unwrap_or_else(|e| e.into_inner()).remove(agent).is_some() {
            let _ = self.agent.invalidate_remote_md(agent);
        }
    }
}

/// The source side: offers pinned blocks where they lie.
pub struct NixlSource {
    mem: Arc<NixlMem>,
    engine: Arc<Engine>,
}

impl NixlSource {
    /// Serve the pool registered in `mem`.
    pub fn new(mem: Arc<NixlMem>, engine: Arc<Engine>) -> NixlSource {
        NixlSource { mem, engine }
    }
}

impl InPlaceSource for NixlSource {
    fn offer(&self, ids: &[u32], fault: Fault) -> Result<InPlaceOffer, String> {
        let bb = self.mem.block_bytes as u64;
        let sums = self.engine.store.recorded_checksums(ids).ok_or("no checksums are recorded")?;
        let mut regions: Vec<(u64, u64)> = ids.iter().map(|&b| (self.mem.block_addr(b), bb)).collect();
        match fault {
            // the bytes of the second block go bad in this instance's memory (its recorded
            // checksum stays): what a reader must catch
            Fault::Corrupt if ids.len() > 1 => {
                let mut buf = vec![0u8; bb as usize];
                self.engine.store.read(&ids[1..2], &mut buf).map_err(|e| e.to_string())?;
                buf[bb as usize / 2] ^= 0x40;
                self.engine.store.write_keeping_checksums(&ids[1..2], &buf).map_err(|e| e.to_string())?;
            }
            // the second region covers half a block
            Fault::Truncate if ids.len() > 1 => regions[1].1 = bb / 2,
            _ => {}
        }
        Ok(InPlaceOffer {
            agent: self.mem.agent_name(),
            metadata: self.mem.metadata.clone(),
            device: self.mem.region.device.map(|d| d as u64),
            regions,
            sums,
        })
    }
}

/// The destination side.
pub struct NixlTransport {
    fingerprint: Fingerprint,
    mem: Arc<NixlMem>,
    engine: Arc<Engine>,
    /// Threads that hash a request's blocks.
    hash_threads: usize,
}

impl NixlTransport {
    /// A reader into the pool registered in `mem`.
    pub fn new(fingerprint: Fingerprint, mem: Arc<NixlMem>, engine: Arc<Engine>) -> NixlTransport {
        let hash_threads = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, 8);
        NixlTransport { fingerprint, mem, engine, hash_threads }
    }

    async fn pull(&self, endpoint: &str, names: &[u64], dest: &Destination) -> Result<usize, FetchError> {
        let bb = self.mem.block_bytes;
        let addr = tcp::socket_addr(endpoint)
            .ok_or_else(|| FetchError::new(FailReason::Connect, "the endpoint does not resolve"))?;
        let mut s = match tokio::time::timeout(tcp::CONNECT_TIMEOUT, TcpStream::connect(addr)).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return Err(FetchError::new(FailReason::Connect, format!("connect: {e}"))),
            Err(_) => return Err(FetchError::new(FailReason::Timeout, "connect ran past its deadline")),
        };
        let _ = s.set_nodelay(true);
        let hello = Hello { fingerprint: self.fingerprint.clone(), names: names.to_vec(), nixl: true };
        tcp::write_control(&mut s, tcp::HELLO, &hello).await?;
        let mut buf = Vec::new();
        let (kind, len) = tcp::read_header(&mut s, tcp::MAX_CONTROL).await?;
        match kind {
            tcp::REFUSE => return Err(tcp::refused(tcp::read_control(&mut s, &mut buf, len).await?)),
            tcp::OFFER => {}
            _ => return Err(FetchError::new(FailReason::Corrupt, "expected an offer")),
        }
        let offer: Offer = tcp::read_control(&mut s, &mut buf, len).await?;
        if offer.fingerprint != self.fingerprint {
            return Err(FetchError::new(FailReason::FingerprintMismatch, "the source's layout differs"));
        }
        let count = offer.count as usize;
        let Some(place) = offer.nixl else {
            return Err(FetchError::new(FailReason::Corrupt, "the offer says nothing about where the blocks lie"));
        };
        if count > names.len()
            || offer.block_bytes as usize != bb
            || place.regions.len() != count
            || place.sums.len() != count
        {
            return Err(FetchError::new(FailReason::Corrupt, "the offer does not match the request"));
        }
        if let Some(i) = place.regions.iter().position(|&(_, l)| l != bb as u64) {
            return Err(FetchError::new(
                FailReason::Truncated,
                format!("block {i}: the source offers {} bytes of {bb}", place.regions[i].1),
            ));
        }
        if count == 0 {
            let _ = tcp::write_control(&mut s, tcp::DONE, &Done { committed: 0 }).await;
            return Ok(0);
        }
        self.mem.ensure_remote(&place)?;
        let deadline = Instant::now() + tcp::total_deadline(count * bb);
        let (mem, engine, dest2, threads) = (self.mem.clone(), self.engine.clone(), dest.clone(), self.hash_threads);
        let agent_name = place.agent.clone();
        let r = tokio::task::spawn_blocking(move || read_and_commit(&mem, &engine, &place, &dest2, threads, deadline))
            .await
            .unwrap_or_else(|e| Err(FetchError::new(FailReason::Corrupt, format!("the reader stopped: {e}"))));
        let committed = match &r {
            Ok(n) => *n,
            Err(_) => {
                self.mem.forget_remote(&agent_name);
                0
            }
        };
        let _ = tcp::write_control(&mut s, tcp::DONE, &Done { committed: committed as u64 }).await;
        r
    }
}

/// A posted READ of blocks `range` of the run.
struct Pending {
    range: std::ops::Range<usize>,
    req: XferRequest,
    /// Posted and not seen finished (successfully or not).
    in_flight: bool,
}

/// READ the offered blocks into `dest`'s lease, verify and commit them in order.
fn read_and_commit(
    mem: &NixlMem,
    engine: &Engine,
    place: &InPlaceOffer,
    dest: &Destination,
    threads: usize,
    deadline: Instant,
) -> Result<usize, FetchError> {
    let mut reqs = Vec::new();
    let r = read_into(mem, engine, place, dest, threads, deadline, &mut reqs);
    release(mem, reqs, dest);
    r
}

fn nixl_err(what: &str, e: nixl_sys::NixlError) -> FetchError {
    FetchError::new(FailReason::Truncated, format!("NIXL {what}: {e:?}"))
}

fn read_into(
    mem: &NixlMem,
    engine: &Engine,
    place: &InPlaceOffer,
    dest: &Destination,
    threads: usize,
    deadline: Instant,
    reqs: &mut Vec<Pending>,
) -> Result<usize, FetchError> {
    let bb = mem.block_bytes;
    let count = place.regions.len();
    let per = (REQUEST_BYTES / bb).max(1);
    let local_type = mem_type(mem.region.device);
    let remote_type = if place.device.is_some() { MemType::Vram } else { MemType::Dram };
    let local_dev = mem.region.device.map_or(0, |d| d as u64);
    let remote_dev = place.device.unwrap_or(0);
    // Post every request first: UCX moves them while the earlier ones are verified.
    for start in (0..count).step_by(per) {
        let end = (start + per).min(count);
        let mut local = XferDescList::new(local_type).map_err(|e| nixl_err("descriptor list", e))?;
        let mut remote = XferDescList::new(remote_type).map_err(|e| nixl_err("descriptor list", e))?;
        for i in start..end {
            local.add_desc(mem.block_addr(dest.lease.ids[i]) as usize, bb, local_dev);
            remote.add_desc(place.regions[i].0 as usize, bb, remote_dev);
        }
        let req = mem
            .agent
            .create_xfer_req(XferOp::Read, &local, &remote, &place.agent, None)
            .map_err(|e| nixl_err("transfer request", e))?;
        reqs.push(Pending { range: start..end, req, in_flight: true });
        let last = reqs.last_mut().expect("pushed");
        match mem.agent.post_xfer_req(&last.req, None) {
            Ok(in_flight) => last.in_flight = in_flight,
            Err(e) => {
                last.in_flight = false;
                return Err(nixl_err("posting a READ", e));
            }
        }
    }
    let mut committed = 0;
    for p in reqs.iter_mut() {
        wait(mem, p, deadline)?;
        let ids = &dest.lease.ids[p.range.clone()];
        let sums = engine
            .store
            .checksums_in_place(ids, threads)
            .map_err(|e| FetchError::new(FailReason::Corrupt, format!("reading back: {e}")))?;
        for (j, i) in p.range.clone().enumerate() {
            if sums[j] != place.sums[i] {
                return Err(FetchError::new(FailReason::Corrupt, format!("block {i}: checksum mismatch")));
            }
            (dest.commit)(i);
            committed = i + 1;
        }
    }
    Ok(committed)
}

/// Wait for `p` until `deadline`: spin briefly, then poll every 20 us.
fn wait(mem: &NixlMem, p: &mut Pending, deadline: Instant) -> Result<(), FetchError> {
    let mut spins = 0u32;
    while p.in_flight {
        match mem.agent.get_xfer_status(&p.req) {
            Ok(XferStatus::Success) => p.in_flight = false,
            Ok(XferStatus::InProgress) => {
                if Instant::now() > deadline {
                    return Err(FetchError::new(FailReason::Timeout, "a NIXL READ ran past the deadline"));
                }
                spins += 1;
                if spins < 64 {
                    std::hint::spin_loop();
                } else {
                    std::thread::sleep(Duration::from_micros(20));
                }
            }
            Err(e) => {
                p.in_flight = false; // finished, with an error
                return Err(nixl_err("READ", e));
            }
        }
    }
    Ok(())
}

/// Release the requests. One still in flight gets a grace second to finish or fail on its
/// own; if it is still running then, the lease is quarantined (kept alive for good) so that
/// its blocks are never reused under a write.
fn release(mem: &NixlMem, mut reqs: Vec<Pending>, dest: &Destination) {
    let grace = Instant::now() + Duration::from_secs(1);
    let mut running = false;
    for p in reqs.iter_mut() {
        if p.in_flight {
            // finished (either way) clears `in_flight`; the grace deadline leaves it set
            let _ = wait(mem, p, grace);
            running |= p.in_flight;
        }
    }
    drop(reqs);
    if running {
        tracing::warn!(
            blocks = dest.lease.ids.len(),
            "a NIXL READ did not stop by its deadline; its destination blocks are quarantined"
        );
        std::mem::forget(dest.lease.clone());
    }
}

impl Transport for NixlTransport {
    fn name(&self) -> &'static str {
        "nixl"
    }

    fn fetch<'a>(
        &'a self,
        endpoint: &'a str,
        names: &'a [u64],
        dest: Destination,
    ) -> BoxFuture<'a, Result<usize, FetchError>> {
        Box::pin(async move {
            // the READ's own deadline is inside; this one covers the control exchange too
            let deadline = tcp::total_deadline(names.len() * self.mem.block_bytes) + Duration::from_secs(5);
            match tokio::time::timeout(deadline, self.pull(endpoint, names, &dest)).await {
                Ok(r) => r,
                Err(_) => Err(FetchError::new(FailReason::Timeout, "the transfer ran past its total deadline")),
            }
        })
    }
}
