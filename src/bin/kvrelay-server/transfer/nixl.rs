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
//! - **A fetch** (`--kv-nixl-memory pool`, the default). The destination sends a hello with
//!   `nixl: true`; the source pins the leading run it holds and answers with an offer carrying
//!   its agent's metadata (loaded once per source agent), each block's address and the XXH3-64
//!   it recorded when the block was written. The destination checks the offer (fingerprint,
//!   count, exactly one whole block per region), posts NIXL READs from the source's blocks
//!   straight into the fresh blocks of its lease, in requests of [`REQUEST_BYTES`]
//!   ([`REQUEST_BYTES_GPU`] into GPU memory) all posted
//!   at once, then, request by request in order, hashes the blocks where they now lie (host
//!   memory in place; GPU memory through the copy engine) and commits each block whose checksum
//!   matches. The first mismatch stops the fetch (`corrupt`); blocks after it are released.
//!   `DONE` unpins the source's blocks.
//! - **Staged** (`--kv-nixl-memory staging`, GPU pools): NIXL registers two pinned host slots
//!   of [`SLOT_BYTES`] per direction instead of the pool. The source gathers each chunk of the
//!   run into a slot through its copy engine and announces it (`READY`); the destination READs
//!   the slot into one of its own, frees the source's slot (`ACK`), verifies the chunk in host
//!   memory and scatters it into its pool through its copy engine, then commits. While one
//!   chunk is read, the source gathers the next. One staged transfer per direction at a time.
//!   Both sides must use the same mode (else the source refuses).
//! - **Failures** are those of the TCP transport (connect, timeout, refused, fingerprint,
//!   corrupt, truncated: an offered region shorter than what it must hold) plus a READ that
//!   NIXL reports failed (`truncated`: the source went away). A READ still in flight at the
//!   deadline cannot be proven stopped, so its destination blocks are quarantined: they leave
//!   the pool for good instead of being reused under a write (logged; never seen in the
//!   tests). A staged READ never targets the pool, so it cannot leave anything behind there.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nixl_sys::{Agent, AgentConfig, MemType, MemoryRegion, NixlDescriptor, RegistrationHandle, ThreadSync};
use nixl_sys::{XferDescList, XferOp, XferRequest, XferStatus};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use serde::{Deserialize, Serialize};

use super::tcp::{self, Fault, Hello, InPlaceOffer, InPlaceSource, Offer, Refuse, ServiceStats};
use super::{BoxFuture, Destination, FailReason, FetchError, Fingerprint, Transport};
use crate::cache::Lease;
use crate::engine::{kvsum_each, Engine, Region};

/// Frame kinds of in-place reads, on the KV service's channel after the offer (MessagePack):
/// `DONE` (destination -> source, `{committed}`): the reader is finished with the offered
/// blocks, the source unpins them; `READY` (source -> destination, staged, `{chunk, count}`):
/// a staging slot holds chunk `chunk`; `ACK` (destination -> source, staged, `{chunk}`): the
/// reader has read it, the slot is free.
const DONE: u8 = 5;
const READY: u8 = 6;
const ACK: u8 = 7;

/// `READY` (source -> destination, staged in-place reads): chunk `chunk` (`count` blocks) lies
/// in its slot.
#[derive(Serialize, Deserialize)]
struct Ready {
    chunk: u64,
    count: u64,
}

/// `ACK` (destination -> source): the reader has read chunk `chunk` out of its slot.
#[derive(Serialize, Deserialize)]
struct Ack {
    chunk: u64,
}

/// `DONE`.
#[derive(Serialize, Deserialize)]
struct Done {
    committed: u64,
}

/// Bytes per NIXL transfer request into host memory: READs of a run are cut into requests of
/// about this size, all posted at once, verified and committed in order while the later ones
/// are in flight (at a few GB/s, a small first request starts verification early).
pub const REQUEST_BYTES: usize = 64 << 20;

/// Bytes per NIXL transfer request into GPU memory: READs there run at 100+ GB/s and each
/// request costs a request setup and a checksum kernel call, so fewer, larger ones.
pub const REQUEST_BYTES_GPU: usize = 256 << 20;

/// Open and check `libnixl_capi.so` (the library's own loader, shared with the KV agent).
pub use kvrelay::agent::nixl::load_library;

/// Bytes of a staging slot (rounded down to whole blocks, at least one).
pub const SLOT_BYTES: usize = 64 << 20;

/// What NIXL registers: the pool, or staging slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Memory {
    /// The KV pool itself (READs land in the destination's blocks).
    Pool,
    /// Two pinned slots per direction, filled and drained by the copy engines (GPU pools).
    Staging,
}

impl Memory {
    /// Parse `--kv-nixl-memory`.
    pub fn parse(s: &str) -> Result<Memory, String> {
        match s {
            "pool" => Ok(Memory::Pool),
            "staging" => Ok(Memory::Staging),
            _ => Err(format!("--kv-nixl-memory {s}: expected pool or staging")),
        }
    }
}

/// Two pinned slots of one direction.
type Slots = Arc<tokio::sync::Mutex<Vec<crate::abi::Pinned>>>;

/// This instance's NIXL agent, with its memory registered.
pub struct NixlMem {
    agent: Agent,
    // Dropped before the agent (field order): deregister.
    _registrations: Vec<RegistrationHandle>,
    memory: Memory,
    region: Region,
    block_bytes: usize,
    /// Staging: slots this instance serves from, and slots it reads into.
    src_slots: Option<Slots>,
    dst_slots: Option<Slots>,
    metadata: Vec<u8>,
    /// Remote agents whose metadata is loaded, with that metadata.
    loaded: Mutex<HashMap<String, Vec<u8>>>,
}

impl NixlMem {
    /// Create the agent (UCX backend) and register `memory` of `engine`'s pool. Call after
    /// [`load_library`].
    pub fn new(engine: &Engine, memory: Memory) -> Result<Arc<NixlMem>, String> {
        let store = &engine.store;
        let region = store.region();
        let bb = store.block_bytes();
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
        let mut registrations = Vec::new();
        let (mut src_slots, mut dst_slots) = (None, None);
        match memory {
            Memory::Pool => {
                let r = agent.register_memory(&Area(region), None).map_err(|e| {
                    format!(
                        "NIXL: registering the KV pool ({} bytes, {:?}): {e:?}",
                        region.len,
                        kind_of(region.device.map(|d| d as u64)).0
                    )
                })?;
                registrations.push(r);
            }
            Memory::Staging => {
                let slot_len = (SLOT_BYTES / bb).max(1) * bb;
                let mut both = Vec::new();
                for _ in 0..2 {
                    let mut slots = Vec::new();
                    for _ in 0..2 {
                        let p = store
                            .pinned(slot_len)
                            .ok_or("--kv-nixl-memory staging: staging slots are for GPU pools (--device cuda:N)")??;
                        let area = Region { base: p.host_addr(), len: p.len(), device: None };
                        let r = agent
                            .register_memory(&Area(area), None)
                            .map_err(|e| format!("NIXL: registering a staging slot: {e:?}"))?;
                        registrations.push(r);
                        slots.push(p);
                    }
                    both.push(Arc::new(tokio::sync::Mutex::new(slots)));
                }
                dst_slots = both.pop();
                src_slots = both.pop();
            }
        }
        if memory == Memory::Pool {
            // READs into a GPU pool are verified by a kernel: load it now
            store.prepare_checksums()?;
        }
        let metadata = agent.get_local_md().map_err(|e| format!("NIXL: local metadata: {e:?}"))?;
        // readers verify against checksums recorded at write time
        store.track_checksums();
        Ok(Arc::new(NixlMem {
            agent,
            _registrations: registrations,
            memory,
            region,
            block_bytes: bb,
            src_slots,
            dst_slots,
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

    /// Blocks per staging slot.
    fn slot_blocks(&self) -> usize {
        (SLOT_BYTES / self.block_bytes).max(1)
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

    /// Post one READ of `pairs` (`(local address, remote address)`, `len` bytes each) from
    /// `remote` and wait for it until `deadline`.
    fn read(
        &self,
        pairs: &[(u64, u64)],
        len: usize,
        kinds: Kinds,
        remote: &str,
        deadline: Instant,
    ) -> Result<(), FetchError> {
        let mut reqs = vec![self.post(pairs, len, kinds, remote)?];
        let r = wait(self, &mut reqs[0], deadline);
        release(self, reqs, None);
        r
    }

    /// Create and post one READ request.
    fn post(&self, pairs: &[(u64, u64)], len: usize, kinds: Kinds, remote: &str) -> Result<Pending, FetchError> {
        let mut local = XferDescList::new(kinds.local.0).map_err(|e| nixl_err("descriptor list", e))?;
        let mut far = XferDescList::new(kinds.remote.0).map_err(|e| nixl_err("descriptor list", e))?;
        for &(l, r) in pairs {
            local.add_desc(l as usize, len, kinds.local.1);
            far.add_desc(r as usize, len, kinds.remote.1);
        }
        let req = self
            .agent
            .create_xfer_req(XferOp::Read, &local, &far, remote, None)
            .map_err(|e| nixl_err("transfer request", e))?;
        let mut p = Pending { range: 0..0, req, in_flight: true };
        match self.agent.post_xfer_req(&p.req, None) {
            Ok(in_flight) => p.in_flight = in_flight,
            Err(e) => {
                p.in_flight = false;
                return Err(nixl_err("posting a READ", e));
            }
        }
        Ok(p)
    }
}

/// Memory kinds and devices of both ends of a READ.
#[derive(Clone, Copy)]
struct Kinds {
    local: (MemType, u64),
    remote: (MemType, u64),
}

/// A memory area to register.
#[derive(Debug)]
struct Area(Region);

impl MemoryRegion for Area {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.0.base as *const u8
    }
    fn size(&self) -> usize {
        self.0.len
    }
}

impl NixlDescriptor for Area {
    fn mem_type(&self) -> MemType {
        kind_of(self.0.device.map(|d| d as u64)).0
    }
    fn device_id(&self) -> u64 {
        kind_of(self.0.device.map(|d| d as u64)).1
    }
}

/// NIXL's memory type and device id of memory on `device` (`None`: host memory).
fn kind_of(device: Option<u64>) -> (MemType, u64) {
    match device {
        Some(d) => (MemType::Vram, d),
        None => (MemType::Dram, 0),
    }
}

/// The source side: offers pinned blocks where they lie, or through staging slots.
pub struct NixlSource {
    mem: Arc<NixlMem>,
    engine: Arc<Engine>,
}

impl NixlSource {
    /// Serve the memory registered in `mem`.
    pub fn new(mem: Arc<NixlMem>, engine: Arc<Engine>) -> NixlSource {
        NixlSource { mem, engine }
    }

    /// The offer of pinned blocks `ids`: where they lie in the pool, or (staged) the slots
    /// `slots` they will pass through; with the checksums recorded when they were written.
    fn offer(&self, ids: &[u32], fault: Fault, slots: Option<&[crate::abi::Pinned]>) -> Result<InPlaceOffer, String> {
        let bb = self.mem.block_bytes as u64;
        let sums = self.engine.store.recorded_checksums(ids).ok_or("no checksums are recorded")?;
        if fault == Fault::Corrupt && ids.len() > 1 {
            // the bytes of the second block go bad in this instance's memory (its recorded
            // checksum stays): what a reader must catch
            let mut buf = vec![0u8; bb as usize];
            self.engine.store.read(&ids[1..2], &mut buf).map_err(|e| e.to_string())?;
            buf[bb as usize / 2] ^= 0x40;
            self.engine.store.write_keeping_checksums(&ids[1..2], &buf).map_err(|e| e.to_string())?;
        }
        let mut offer = InPlaceOffer {
            agent: self.mem.agent_name(),
            metadata: self.mem.metadata.clone(),
            device: None,
            regions: Vec::new(),
            sums,
            slots: Vec::new(),
            chunk_blocks: 0,
        };
        match slots {
            None => {
                offer.device = self.mem.region.device.map(|d| d as u64);
                offer.regions = ids.iter().map(|&b| (self.mem.block_addr(b), bb)).collect();
                if fault == Fault::Truncate && ids.len() > 1 {
                    offer.regions[1].1 = bb / 2; // the second region covers half a block
                }
            }
            Some(slots) => {
                let n = self.mem.slot_blocks() as u64;
                offer.slots = slots.iter().map(|p| (p.host_addr(), n * bb)).collect();
                offer.chunk_blocks = n;
                if fault == Fault::Truncate {
                    offer.slots[1].1 = bb / 2; // the second slot holds half a block
                }
            }
        }
        Ok(offer)
    }

    async fn serve_one(
        &self,
        s: &mut TcpStream,
        hello: &Hello,
        lease: Lease,
        fault: Fault,
        stats: &ServiceStats,
    ) -> Result<(), Refuse> {
        let refuse = |reason: &str, message: String| Refuse { reason: reason.into(), message };
        if hello.staged != (self.mem.memory == Memory::Staging) {
            return Err(refuse("transport_unavailable", "the NIXL memory modes (pool, staging) differ".into()));
        }
        let bb = self.mem.block_bytes;
        // one staged transfer at a time: hold the source slots for the whole transfer
        let slots = match &self.mem.src_slots {
            Some(sl) => Some(sl.clone().lock_owned().await),
            None => None,
        };
        if fault == Fault::Stall {
            // a stalled peer: the reader's deadline must fire
            tokio::time::sleep(Duration::from_secs(3600)).await;
        }
        let count = lease.ids.len();
        let nixl = self
            .offer(&lease.ids, fault, slots.as_deref().map(Vec::as_slice))
            .map_err(|m| refuse("in_place_unavailable", m))?;
        let offer = Offer {
            fingerprint: hello.fingerprint.clone(),
            count: count as u64,
            block_bytes: bb as u64,
            nixl: Some(nixl),
        };
        if tcp::write_control(s, tcp::OFFER, &offer).await.is_err() {
            return Ok(());
        }
        if fault == Fault::Die {
            let _ = s.flush().await;
            eprintln!("kvrelay-server: --kv-fault die: exiting mid-transfer");
            std::process::exit(3);
        }
        let deadline = tcp::total_deadline(count * bb);
        let done = match slots {
            None => tokio::time::timeout(deadline, wait_done(s)).await.ok().flatten(),
            Some(slots) => tokio::time::timeout(deadline, self.feed_slots(s, &lease.ids, slots)).await.ok().flatten(),
        };
        if let Some(d) = done {
            stats.blocks_sent.fetch_add(d.committed.min(count as u64), std::sync::atomic::Ordering::Relaxed);
        }
        drop(lease);
        Ok(())
    }

    /// Staged: fill the two slots chunk by chunk (gathering chunk `c + 1` while the reader
    /// reads chunk `c`), announce each with `READY`, reuse a slot only after its `ACK`; then
    /// wait for `DONE`. `None` when the reader went away.
    async fn feed_slots(
        &self,
        s: &mut TcpStream,
        ids: &[u32],
        slots: tokio::sync::OwnedMutexGuard<Vec<crate::abi::Pinned>>,
    ) -> Option<Done> {
        let per = self.mem.slot_blocks();
        let chunks: Vec<Vec<u32>> = ids.chunks(per).map(<[u32]>::to_vec).collect();
        let mut slots = Some(slots);
        for (c, chunk) in chunks.iter().enumerate() {
            if c >= 2 {
                // slot c % 2 is free once chunk c - 2 is acknowledged
                let (kind, len) = tcp::read_header(s, tcp::MAX_CONTROL).await.ok()?;
                if kind != ACK {
                    return None;
                }
                let ack: Ack = tcp::read_control(s, &mut Vec::new(), len).await.ok()?;
                if ack.chunk != (c - 2) as u64 {
                    return None;
                }
            }
            let (engine, chunk2, guard) = (self.engine.clone(), chunk.clone(), slots.take().expect("returned"));
            let (guard, r) = tokio::task::spawn_blocking(move || {
                let r = engine.store.gather_into(&chunk2, &guard[c % 2]);
                (guard, r)
            })
            .await
            .ok()?;
            slots = Some(guard);
            r.ok()?;
            let ready = Ready { chunk: c as u64, count: chunk.len() as u64 };
            tcp::write_control(s, READY, &ready).await.ok()?;
        }
        // the remaining ACKs, then DONE
        loop {
            let (kind, len) = first_then_header(s).await?;
            match kind {
                ACK => {
                    let _: Ack = tcp::read_control(s, &mut Vec::new(), len).await.ok()?;
                }
                DONE => return tcp::read_control(s, &mut Vec::new(), len).await.ok(),
                _ => return None,
            }
        }
    }
}

/// The next frame header, waiting for its first byte without the per-read deadline (the reader
/// may take longer than that; the caller bounds the whole).
async fn first_then_header(s: &mut TcpStream) -> Option<(u8, usize)> {
    match s.peek(&mut [0u8; 1]).await {
        Ok(0) | Err(_) => return None,
        Ok(_) => {}
    }
    tcp::read_header(s, tcp::MAX_CONTROL).await.ok()
}

/// Wait for the reader's `DONE`.
async fn wait_done(s: &mut TcpStream) -> Option<Done> {
    let (kind, len) = first_then_header(s).await?;
    if kind != DONE {
        return None;
    }
    tcp::read_control(s, &mut Vec::new(), len).await.ok()
}

impl InPlaceSource for NixlSource {
    fn serve<'a>(
        &'a self,
        s: &'a mut TcpStream,
        hello: &'a Hello,
        lease: Lease,
        fault: Fault,
        stats: &'a ServiceStats,
    ) -> BoxFuture<'a, Result<(), Refuse>> {
        Box::pin(self.serve_one(s, hello, lease, fault, stats))
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
    /// A reader into the memory registered in `mem`.
    pub fn new(fingerprint: Fingerprint, mem: Arc<NixlMem>, engine: Arc<Engine>) -> NixlTransport {
        let hash_threads = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, 8);
        NixlTransport { fingerprint, mem, engine, hash_threads }
    }

    async fn pull(&self, endpoint: &str, names: &[u64], dest: &Destination) -> Result<usize, FetchError> {
        let bb = self.mem.block_bytes;
        let staged = self.mem.memory == Memory::Staging;
        let hello = Hello { fingerprint: self.fingerprint.clone(), names: names.to_vec(), nixl: true, staged };
        let (mut s, offer) = tcp::ask(endpoint, &hello, bb).await?;
        let count = offer.count as usize;
        let Some(place) = offer.nixl else {
            return Err(FetchError::new(FailReason::Corrupt, "the offer says nothing about where the blocks lie"));
        };
        if place.sums.len() != count {
            return Err(FetchError::new(FailReason::Corrupt, "the offer does not match the request"));
        }
        if staged {
            let per = place.chunk_blocks as usize;
            if place.slots.len() != 2 || per == 0 || per > self.mem.slot_blocks() {
                return Err(FetchError::new(FailReason::Corrupt, "the offer's staging slots do not fit"));
            }
            if let Some(k) = place.slots.iter().position(|&(_, l)| (l as usize) < per * bb) {
                return Err(FetchError::new(
                    FailReason::Truncated,
                    format!("slot {k}: the source offers {} bytes of {}", place.slots[k].1, per * bb),
                ));
            }
        } else {
            if place.regions.len() != count {
                return Err(FetchError::new(FailReason::Corrupt, "the offer does not match the request"));
            }
            if let Some(i) = place.regions.iter().position(|&(_, l)| l != bb as u64) {
                return Err(FetchError::new(
                    FailReason::Truncated,
                    format!("block {i}: the source offers {} bytes of {bb}", place.regions[i].1),
                ));
            }
        }
        if count == 0 {
            let _ = tcp::write_control(&mut s, DONE, &Done { committed: 0 }).await;
            return Ok(0);
        }
        self.mem.ensure_remote(&place)?;
        let deadline = Instant::now() + tcp::total_deadline(count * bb);
        let r = if staged {
            self.pull_staged(&mut s, &place, count, dest, deadline).await
        } else {
            let (mem, engine, dest2, threads) =
                (self.mem.clone(), self.engine.clone(), dest.clone(), self.hash_threads);
            let place2 = place.clone();
            tokio::task::spawn_blocking(move || read_and_commit(&mem, &engine, &place2, &dest2, threads, deadline))
                .await
                .unwrap_or_else(|e| Err(FetchError::new(FailReason::Corrupt, format!("the reader stopped: {e}"))))
        };
        let committed = match &r {
            Ok(n) => *n,
            Err(_) => {
                self.mem.forget_remote(&place.agent);
                0
            }
        };
        let _ = tcp::write_control(&mut s, DONE, &Done { committed: committed as u64 }).await;
        r
    }

    /// Staged: for each announced chunk, READ the source's slot into one of ours, `ACK` it,
    /// verify the chunk in host memory, scatter it into the lease's blocks, commit.
    async fn pull_staged(
        &self,
        s: &mut TcpStream,
        place: &InPlaceOffer,
        count: usize,
        dest: &Destination,
        deadline: Instant,
    ) -> Result<usize, FetchError> {
        let bb = self.mem.block_bytes;
        let per = place.chunk_blocks as usize;
        let slots = self.mem.dst_slots.as_ref().expect("staging memory has slots").clone().lock_owned().await;
        let mut slots = Some(slots);
        let mut committed = 0;
        let kinds = Kinds { local: (MemType::Dram, 0), remote: (MemType::Dram, 0) };
        for (c, start) in (0..count).step_by(per).enumerate() {
            let k = per.min(count - start);
            let (kind, len) = tcp::read_header(s, tcp::MAX_CONTROL).await?;
            if kind != READY {
                return Err(FetchError::new(FailReason::Corrupt, "expected a READY frame"));
            }
            let ready: Ready = tcp::read_control(s, &mut Vec::new(), len).await?;
            if ready.chunk != c as u64 || ready.count as usize != k {
                return Err(FetchError::new(FailReason::Corrupt, format!("chunk {c}: another chunk announced")));
            }
            let (mem, engine, dest2, threads, guard) =
                (self.mem.clone(), self.engine.clone(), dest.clone(), self.hash_threads, slots.take().expect("back"));
            let (src_slot, sums) = (place.slots[c % 2].0, place.sums[start..start + k].to_vec());
            let agent = place.agent.clone();
            // READ, then (after the ACK below) verify and scatter
            let (guard, r) = tokio::task::spawn_blocking(move || {
                let dst = guard[c % 2].host_addr();
                let pairs: Vec<(u64, u64)> =
                    (0..k as u64).map(|j| (dst + j * bb as u64, src_slot + j * bb as u64)).collect();
                let r = mem.read(&pairs, bb, kinds, &agent, deadline);
                (guard, r)
            })
            .await
            .map_err(|e| FetchError::new(FailReason::Corrupt, format!("the reader stopped: {e}")))?;
            r?;
            tcp::write_control(s, ACK, &Ack { chunk: c as u64 }).await?;
            let (guard, r) = tokio::task::spawn_blocking(move || {
                let bytes = &guard[c % 2].bytes()[..k * bb];
                let got = kvsum_each(&bytes.chunks(bb).collect::<Vec<_>>(), threads);
                let ids = &dest2.lease.ids[start..start + k];
                let r = match got.iter().zip(&sums).position(|(a, b)| a != b) {
                    Some(j) => {
                        Err(FetchError::new(FailReason::Corrupt, format!("block {}: checksum mismatch", start + j)))
                    }
                    None => engine
                        .store
                        .scatter_from(&guard[c % 2], ids)
                        .map_err(|e| FetchError::new(FailReason::Corrupt, format!("writing received blocks: {e}"))),
                };
                if r.is_ok() {
                    engine.store.record_checksums(ids, &sums);
                    for i in start..start + k {
                        (dest2.commit)(i);
                    }
                }
                (guard, r)
            })
            .await
            .map_err(|e| FetchError::new(FailReason::Corrupt, format!("the reader stopped: {e}")))?;
            slots = Some(guard);
            r?;
            committed = start + k;
        }
        Ok(committed)
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
    release(mem, reqs, Some(dest));
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
    let per = (if mem.region.device.is_some() { REQUEST_BYTES_GPU } else { REQUEST_BYTES } / bb).max(1);
    let kinds = Kinds { local: kind_of(mem.region.device.map(|d| d as u64)), remote: kind_of(place.device) };
    // Post every request first: UCX moves them while the earlier ones are verified.
    for start in (0..count).step_by(per) {
        let end = (start + per).min(count);
        let pairs: Vec<(u64, u64)> =
            (start..end).map(|i| (mem.block_addr(dest.lease.ids[i]), place.regions[i].0)).collect();
        let mut p = mem.post(&pairs, bb, kinds, &place.agent)?;
        p.range = start..end;
        reqs.push(p);
    }
    let (t0, mut waited, mut verified) = (Instant::now(), Duration::ZERO, Duration::ZERO);
    let mut committed = 0;
    for p in reqs.iter_mut() {
        let t = Instant::now();
        wait(mem, p, deadline)?;
        waited += t.elapsed();
        let t = Instant::now();
        let ids = &dest.lease.ids[p.range.clone()];
        let sums = engine
            .store
            .checksums_in_place(ids, threads)
            .map_err(|e| FetchError::new(FailReason::Corrupt, format!("verifying in place: {e}")))?;
        for (j, i) in p.range.clone().enumerate() {
            if sums[j] != place.sums[i] {
                return Err(FetchError::new(FailReason::Corrupt, format!("block {i}: checksum mismatch")));
            }
            engine.store.record_checksums(&ids[j..j + 1], &sums[j..j + 1]);
            (dest.commit)(i);
            committed = i + 1;
        }
        verified += t.elapsed();
    }
    tracing::debug!(
        blocks = committed,
        total_ms = t0.elapsed().as_secs_f64() * 1e3,
        waiting_for_reads_ms = waited.as_secs_f64() * 1e3,
        verifying_ms = verified.as_secs_f64() * 1e3,
        "NIXL fetch"
    );
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

/// Destination blocks quarantined so far (they left the pool for good; `/metrics` shows them as
/// `kvrelay_server_kv_blocks_quarantined_total`).
pub static QUARANTINED_BLOCKS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Release the requests. One still in flight gets a grace second to finish or fail on its
/// own; if it is still running then, `dest`'s lease is quarantined (kept alive for good) so
/// that its blocks are never reused under a write. (Staged READs target staging slots, which
/// are never released while the process runs.)
fn release(mem: &NixlMem, mut reqs: Vec<Pending>, dest: Option<&Destination>) {
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
        tracing::warn!("a NIXL READ did not stop by its deadline");
        if let Some(dest) = dest {
            tracing::warn!(blocks = dest.lease.ids.len(), "its destination blocks are quarantined");
            QUARANTINED_BLOCKS.fetch_add(dest.lease.ids.len() as u64, std::sync::atomic::Ordering::Relaxed);
            std::mem::forget(dest.lease.clone());
        }
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
            tcp::within_deadline(deadline, self.pull(endpoint, names, &dest)).await
        })
    }
}
