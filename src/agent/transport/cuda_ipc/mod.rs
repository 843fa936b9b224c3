//! The agent's same-host GPU transport ([`crate::agent::Transport::CudaIpc`]): when both agents
//! run on one host and their pools are device memory, the destination copies the source's
//! pinned blocks straight out of the source's pool into its own, device to device, and the
//! checksum kernel verifies them where they landed. Control (the handshake, authentication,
//! the offer, the end) stays on the agent's TCP connection.
//!
//! - **Start.** The agent exports each allocation its pool's segments lie in once: memory from
//!   `cuMemAlloc`/`cudaMalloc` (what caching allocators hand out) with `cuIpcGetMemHandle`;
//!   memory of the virtual memory API (`cuMemCreate`, as expandable or VMM-based allocators
//!   hand out), allocation by allocation over each segment's range, as POSIX file descriptors
//!   (`cuMemExportToShareableHandle`; the allocations must be created with the handle type
//!   `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`), which a Unix socket of the agent's own hands
//!   to destinations ([`super::vmm_fds`]). Memory of a stream-ordered pool
//!   (`cudaMallocAsync`), or of that API without the POSIX handle type, cannot be exported:
//!   [`crate::agent::Agent::new`] then fails with that reason. A host pool is refused: this
//!   transport moves device memory only.
//! - **A fetch.** The destination sends `IPC_HELLO`. The source pins the leading run it holds,
//!   as over TCP, and answers `IPC_OFFER`: an in-place offer (its segment table and, per
//!   offered block, its id and the checksum recorded when it became reusable) whose metadata
//!   is the source's host id (the kernel's boot id), process id and exported allocations. The
//!   destination checks the offer against its own layout, refuses a source on another host,
//!   maps each of the source's allocations once (`cuIpcOpenMemHandle`; for a virtual-memory
//!   range, its descriptors taken over the source's Unix socket with the offer's token and
//!   mapped side by side into one reserved range, so that the range reads as the source's
//!   does; kept until the agent stops, or until the source process no longer runs; within one
//!   process the addresses are used as they are, but only where they lie inside ranges an
//!   agent of this process exported and still lives: a pid and a boot id are what any
//!   neighbour can claim), checks that every offered block lies inside an exported allocation,
//!   then one kernel on a mover's stream copies the blocks and sums each word as it writes it
//!   (`CudaEngine::copy_and_sum_from`: the checksum of what landed, for the memory traffic of a
//!   copy alone); where a segment's blocks span several allocations it enqueues one
//!   device-to-device copy per run contiguous at both ends and the checksum kernel after. It
//!   counts each block whose sum matches. `DONE` tells the source how many blocks were taken;
//!   its pins hold until then (or its transfer deadline).
//! - **Mappings.** Each is reference-counted: a fetch holds the ones it copies through until
//!   its stream synchronized. The table keeps at most 1,024, at most 128 (and 1 TiB of address
//!   space) per source process, or one offer's count when more (`table`): beyond a bound the least recently used mapping no
//!   fetch holds is let go (of the same source first), and a source whose quota is all held is
//!   refused for that fetch, which falls back to TCP. Room is reserved in the table before any
//!   driver call (counting what other fetches hold or are mapping), so a full source is refused
//!   before its allocations are opened, not after. While any watched mapping is kept, idle
//!   fetch workers look every 50 ms whether its source process still runs (`/proc/<pid>`,
//!   outside the table's lock) and let go of those of a process that ended (`ipc_unmapped`
//!   counts both kinds of letting go). A source in another PID namespace (not in this
//!   process's `/proc` when it was mapped) cannot be looked at: its mappings stay until the
//!   bounds or the agent's stop let them go. Every driver call happens outside the table's
//!   lock.
//! - **What a peer can do.** Only a peer that passed the agent's allowlist and proved it holds
//!   the agent's key receives handles, and only on the source's connection to it, in an offer
//!   of at least one block it asked for by name: an offer of no block carries no exports, and
//!   an agent without a key (no deployment key given and the per-user key turned off) refuses
//!   every CUDA IPC hello (`grants_refused_unkeyed`). With no setting at all the key is the
//!   per-user key ([`crate::agent::auth`]): a process of another user of the host gets no
//!   handle. A mapped pool is
//!   readable and writable by that peer's process, as a NIXL registration is: run agents that
//!   share a host under one trust domain. Neither driver path lets the exporter make a peer's
//!   mapping read-only: `cuIpcOpenMemHandle` maps the whole `cuMemAlloc` allocation with read
//!   and write access (its only flag is lazy peer access), and an allocation of the virtual
//!   memory API, once its descriptor is shared, is mapped with whatever access the importer
//!   sets (`cuMemSetAccess` is the importer's call; this agent maps read-only, a hostile peer
//!   need not). What the exporter does decide is the extent: a peer can reach every byte of the
//!   allocations the pool lies in, so the agent starts only when those allocations hold the
//!   pool and nothing else (`registry::outside_pool`: no byte before the pool or between its
//!   segments, and after it no more than the driver's rounding of an allocation of the pool's
//!   size, under 2 MiB); a pool that shares an allocation with other tensors (a caching
//!   allocator's segment) is refused at start with the reason, unless the limit
//!   `export_whole_allocations` says to export such allocations whole. Give the pool
//!   allocations of its own (`cuMemAlloc` of exactly the pool, or virtual-memory allocations
//!   that it fills). A write into a source's pool by a hostile peer is not prevented, but it is
//!   found: every destination sums what landed against the checksum the source recorded when
//!   the block became reusable, and (keyed agents: always, since a grant needs the key) tags it
//!   from the same loads against the keyed tag the source recorded then ([`crate::block_mac`]),
//!   and imports nothing that differs. A peer without the key cannot match a tag; a keyed peer
//!   can (NH under a known key can be steered): what it writes is kept out only by what a grant
//!   maps. Within this process, an offer reads only the
//!   source agent's pool extents (see [`registry`]). The sizes a source reports are checked against the
//!   driver's: an allocation must map here (`cuMemGetAddressRange`) at least as large as
//!   offered, and a virtual-memory allocation maps only at its real size (`cuMemMap` refuses
//!   more), so no copy plan reads past what is mapped. The descriptor socket hands descriptors only to a
//!   connection that presents the token of an offer. Across two GPUs of a host the same copies go over
//!   peer access (NVLink where present); multi-node NVLink fabric handles
//!   (`CU_MEM_HANDLE_TYPE_FABRIC`, memory from `cuMemCreate` with that handle type, exported
//!   with `cuMemExportToShareableHandle` and imported by the peer's IMEX channel) are a later
//!   step.

mod offer;
mod plan;
mod registry;
mod table;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::{read_in_place_offer, send_done, vmm_fds, Backend, Cx, Failure, Landing, Progress, Pull, Transfer, Writes};
use crate::agent::estimate::{SourceSpeed, CUDA_IPC_DEFAULT};
use crate::agent::wire::{self, Conn};
use crate::agent::{FailReason, Limits, Stats};
use crate::copy::{CudaDevice, IpcExport, KvLayout, VmmChunk, VmmHandle};
use offer::{decode_exports, encode_exports, host_id, Exports, VmmOffer, MAX_VMM_CHUNKS, MAX_VMM_RANGES};
pub use plan::check_offer_plans;
use plan::{plan_copies, plan_segments};
use registry::{outside_pool, own_source, pool_extents, Exported, OwnRefusal, Reading, EXPORTED};

/// The name an IPC offer carries where a NIXL offer names its agent.
const AGENT: &str = "cuda-ipc";
/// A source allocation: the source's host id, process id and the allocation's IPC handle (for
/// a virtual-memory range: [`vmm_key`]).
type MappedKey = table::Key;

/// The key of a source's virtual-memory range: a marker no CUDA IPC handle starts with
/// (theirs begin with the allocation's nonzero tag), its base, its size, and the source's
/// token (drawn at each start: a restarted source, or one of the same pid in another PID
/// namespace, never finds the mapping of another).
fn vmm_key(base: u64, size: u64, token: &[u8; vmm_fds::TOKEN]) -> [u8; 64] {
    let mut k = [0u8; 64];
    k[..8].copy_from_slice(b"\0kvrvmm\0");
    k[8..16].copy_from_slice(&base.to_le_bytes());
    k[16..24].copy_from_slice(&size.to_le_bytes());
    k[24..24 + vmm_fds::TOKEN].copy_from_slice(token);
    k
}

/// One source allocation (or virtual-memory range) mapped here; unmapped when the last fetch
/// using it lets go after the table dropped it (its source went, or the agent stops).
struct Mapping {
    dev: Arc<CudaDevice>,
    ptr: u64,
    /// Bytes mapped: for a CUDA IPC mapping the driver's size of it (every later offer of the
    /// same handle is checked against it), for a virtual-memory range its size.
    size: u64,
    /// A virtual-memory range (`vmm_map`), not a CUDA IPC mapping (`ipc_open`).
    vmm: bool,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: mapped by `CudaIpc::map` on this device (`ipc_open`, or `vmm_map` of `size`
        // bytes); the last user let go (every copy through it synchronized before its fetch
        // dropped its reference).
        let _ = unsafe {
            if self.vmm {
                self.dev.vmm_unmap(self.ptr, self.size)
            } else {
                self.dev.ipc_close(self.ptr)
            }
        };
    }
}

/// Whether process `pid` of this host still runs (its `/proc` entry; a zombie counts as
/// running until reaped). Only asked of a process that showed there when it was mapped.
fn process_runs(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// Room reserved in the table of mappings, given back when dropped.
struct Reserved<'a>(&'a Mutex<table::Table<Mapping>>, Option<table::Room>);

impl Drop for Reserved<'_> {
    fn drop(&mut self) {
        if let Some(r) = self.1.take() {
            self.0.lock().unwrap_or_else(|p| p.into_inner()).unreserve(r);
        }
    }
}

/// This instance's exported pool, and the source allocations it mapped.
pub(in crate::agent) struct CudaIpc {
    dev: Arc<CudaDevice>,
    device: i32,
    host: [u8; 16],
    pid: u32,
    /// The offer metadata this source sends (its host, process and exports), encoded once.
    metadata: Vec<u8>,
    /// Source allocations mapped here, by source: bounded per source and in all ([`table`]).
    mapped: Mutex<table::Table<Mapping>>,
    /// Entries of `mapped` whose source process can be looked at (`Mapping::watched`), read
    /// without the lock by the fetch workers' idle loop: only those can be let go by a sweep.
    watched_now: AtomicUsize,
    /// Where destinations get the descriptors of this pool's virtual-memory allocations (when
    /// it has any); stops with the agent.
    _fds: Option<vmm_fds::FdServer>,
    /// This agent, registered as this process's exports while it lives.
    exported: Exported,
}

impl CudaIpc {
    /// Export the allocations `layout`'s segments lie in.
    ///
    /// # Safety
    /// As [`crate::agent::Agent::new`]: the layout's blocks are memory of `device`, valid for
    /// the agent's life.
    pub(in crate::agent) unsafe fn new(layout: &KvLayout, device: Option<i32>, whole: bool) -> Result<CudaIpc, String> {
        let device = device.ok_or("the CUDA IPC transport moves device memory: the pool must be on a CUDA device")?;
        let dev = CudaDevice::open(device).map_err(|e| format!("CUDA IPC: device {device}: {e}"))?;
        let host = host_id()?;
        let mut allocs: Vec<IpcExport> = Vec::new();
        // allocations of the virtual memory API under every segment (merged into ranges below)
        let mut chunks: Vec<VmmChunk> = Vec::new();
        let last = u64::from(layout.num_blocks().saturating_sub(1));
        for (s, g) in layout.segments().iter().enumerate() {
            let end = g.base + last * g.block_stride + g.bytes_per_block;
            if allocs.iter().any(|a| a.base <= g.base && end <= a.base + a.size) {
                continue;
            }
            let ipc = match dev.ipc_export(g.base) {
                Ok(e) => {
                    if end > e.base + e.size {
                        return Err(format!("CUDA IPC: segment {s} runs past the allocation it starts in"));
                    }
                    allocs.push(e);
                    continue;
                }
                Err(e) => e,
            };
            // memory of the virtual memory API: its allocations as POSIX descriptors
            let under = dev.vmm_export(g.base, end).map_err(|vmm| {
                format!(
                    "CUDA IPC: segment {s}'s memory cannot be exported (as cuMemAlloc memory: {ipc}; as memory of \
                     the virtual memory API: {vmm}): memory from cuMemAlloc/cudaMalloc can, and from cuMemCreate with \
                     the handle type CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR; memory from cudaMallocAsync cannot; use \
                     the TCP or NIXL transport"
                )
            })?;
            chunks.extend(under);
        }
        // each allocation once (segments may share one), in address order; allocations that
        // touch form one range, mapped side by side at the destination as here
        chunks.sort_by_key(|c| c.base);
        chunks.dedup_by_key(|c| c.base);
        let (mut ranges, mut fds): (Vec<(u64, Vec<u64>)>, Vec<std::os::fd::OwnedFd>) = (Vec::new(), Vec::new());
        let mut end = 0u64; // where the last range ends
        for c in chunks {
            match ranges.last_mut() {
                Some((_, sizes)) if end == c.base => sizes.push(c.size),
                _ => ranges.push((c.base, vec![c.size])),
            }
            end = c.base + c.size;
            fds.push(c.fd);
        }
        if ranges.len() > MAX_VMM_RANGES || fds.len() > MAX_VMM_CHUNKS {
            return Err(format!(
                "CUDA IPC: the pool spans more than {MAX_VMM_RANGES} ranges or {MAX_VMM_CHUNKS} allocations of the \
                 virtual memory API"
            ));
        }
        let pid = std::process::id();
        let (vmm, server) = if ranges.is_empty() {
            (None, None)
        } else {
            let server = vmm_fds::FdServer::start(fds)?;
            let offer = VmmOffer { socket: server.name().to_vec(), token: *server.token(), ranges };
            (Some(offer), Some(server))
        };
        let exports = Exports { host, pid, allocs, vmm };
        let pool = pool_extents(layout);
        if !whole {
            // a peer that maps a grant reaches every byte of it: the pool, and nothing else
            for r in exports.ranges() {
                let outside = outside_pool(r, &pool);
                if outside > 0 {
                    return Err(format!(
                        "CUDA IPC: the allocation at {:#x} ({} bytes) that the pool lies in holds {outside} bytes that \
                         are not the pool, and every allowed peer could read and write them: give the pool memory of \
                         its own (cuMemAlloc of exactly the pool, or allocations of the virtual memory API that it \
                         fills), or set the limit export_whole_allocations",
                        r.0, r.1
                    ));
                }
            }
        }
        let exported = Exported::register(device, exports.ranges(), pool);
        let metadata = encode_exports(&exports);
        Ok(CudaIpc {
            dev,
            device,
            host,
            pid,
            metadata,
            mapped: Mutex::new(table::Table::default()),
            watched_now: AtomicUsize::new(0),
            _fds: server,
            exported,
        })
    }

    /// The base address here of each of `e`'s ranges ([`Exports::ranges`]: mapped once per
    /// source process and kept until that process goes or the table's bounds let it go;
    /// within this process, the addresses themselves), and the mappings to hold until the
    /// copies through them synchronized. A source's virtual-memory ranges not mapped yet take
    /// its descriptors first, over its socket, by `deadline`.
    ///
    /// The table's lock is held only to look up and to record ([`table`]): mapping, the
    /// driver's size check, unmapping and the look at `/proc` happen outside it, so a fetch
    /// never waits behind another source's driver calls. A source over its quota (or a table
    /// full of held mappings) is refused with `Refused`: the fetch falls back to TCP.
    fn map(
        &self,
        cx: &Cx<'_>,
        e: &Exports,
        deadline: Instant,
        stopped: &dyn Fn() -> Result<(), Failure>,
    ) -> Result<(Vec<u64>, Vec<Arc<Mapping>>), Failure> {
        // the keys of every range, in the order of `e.ranges()`: the allocations, then the
        // virtual-memory ranges (with their sizes)
        let mut keys: Vec<MappedKey> = e.allocs.iter().map(|a| (e.host, e.pid, a.handle)).collect();
        if let Some(v) = &e.vmm {
            keys.extend(v.ranges.iter().map(|(b, sizes)| (e.host, e.pid, vmm_key(*b, sizes.iter().sum(), &v.token))));
        }
        // a source's quota is not the offer's to raise: more than it may have mapped at all is
        // refused before anything of it is opened
        if table::over_quota(keys.len(), e.bytes()) {
            return Err((
                FailReason::Refused,
                format!(
                    "CUDA IPC: the offer names {} ranges of {} bytes, more than one source may have mapped ({} \
                     ranges, {} bytes)",
                    keys.len(),
                    e.bytes(),
                    table::SOURCE_RANGES,
                    table::SOURCE_BYTES
                ),
            ));
        }
        // what is mapped already (held from here), under the lock
        let mut have: Vec<Option<Arc<Mapping>>> = {
            let mut m = self.mapped.lock().unwrap_or_else(|p| p.into_inner());
            keys.iter().map(|k| m.get(k)).collect()
        };
        for (a, p) in e.allocs.iter().zip(&have) {
            // the same allocation offered again: no larger than it maps
            if let Some(p) = p.as_ref().filter(|p| a.size > p.size) {
                return Err((
                    FailReason::Corrupt,
                    format!("CUDA IPC: the source offers {} bytes of an allocation that maps {} here", a.size, p.size),
                ));
            }
        }
        if have.iter().all(Option::is_some) {
            return Ok((have.iter().flatten().map(|p| p.ptr).collect(), have.into_iter().flatten().collect()));
        }
        // room for the rest, reserved before any driver call (given back however this ends)
        let (missing, missing_bytes) = {
            let mut sizes: Vec<u64> = e.allocs.iter().map(|a| a.size).collect();
            if let Some(v) = &e.vmm {
                sizes.extend(v.ranges.iter().map(|(_, s)| s.iter().sum::<u64>()));
            }
            sizes
                .iter()
                .zip(&have)
                .filter(|(_, h)| h.is_none())
                .fold((0usize, 0u64), |(n, b), (s, _)| (n + 1, b.saturating_add(*s)))
        };
        let room = self
            .mapped
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .reserve(e.host, e.pid, missing, missing_bytes)
            .map_err(|full| {
                let whose = match full {
                    table::Full::Source => "this source's quota of mappings",
                    table::Full::Table => "the table of mappings",
                };
                (FailReason::Refused, format!("CUDA IPC: {whose} has no room left (held or being mapped)"))
            })?;
        let _room = Reserved(&self.mapped, Some(room));
        // the rest is mapped here, outside the lock
        let watched = process_runs(e.pid);
        let mut new: Vec<(usize, table::New<Mapping>)> = Vec::new();
        for (i, a) in e.allocs.iter().enumerate().filter(|(i, _)| have[*i].is_none()) {
            // SAFETY: a handle another process of this host exported (the driver refuses one
            // it does not know); the mapping is kept until that process goes, the table lets it
            // go, or the agent stops.
            let ptr = unsafe { self.dev.ipc_open(&a.handle) }
                .map_err(|err| (FailReason::Connect, format!("CUDA IPC: mapping the source's memory: {err}")))?;
            // the copy plans trust the size the source reported: the driver's own must cover it
            let size = match self.dev.address_range(ptr) {
                Ok((base, size)) if base == ptr && size >= a.size => size,
                got => {
                    // SAFETY: mapped just above, used by nothing yet.
                    let _ = unsafe { self.dev.ipc_close(ptr) };
                    return Err((
                        FailReason::Corrupt,
                        format!(
                            "CUDA IPC: the source offers {} bytes of an allocation that maps as {got:?} here",
                            a.size
                        ),
                    ));
                }
            };
            let v = Arc::new(Mapping { dev: self.dev.clone(), ptr, size, vmm: false });
            new.push((i, table::New { key: keys[i], v, bytes: size, watched }));
        }
        if let Some(v) = &e.vmm {
            let first = e.allocs.len();
            if have[first..].iter().any(Option::is_none) {
                if !vmm_fds::is_socket_of(&v.socket, e.pid) {
                    return Err((FailReason::Corrupt, "CUDA IPC: the offer names another process's socket".into()));
                }
                // the source's descriptors, all of them (one batch per connection); only the
                // ranges not mapped yet are mapped
                let mut handles: Vec<VmmHandle> = Vec::with_capacity(v.chunks());
                let by = cx.io_deadline().min(deadline);
                // a cancel or the agent's shutdown ends the wait for the source within 20 ms
                let stop = || stopped().is_err();
                vmm_fds::receive(&v.socket, e.pid, &v.token, v.chunks(), by, &stop, |fd| {
                    // SAFETY: a descriptor the source process of this host sent as one of its
                    // exported allocations (the driver refuses any other file).
                    let h = unsafe { self.dev.vmm_import(std::os::fd::AsFd::as_fd(&fd)) }.map_err(|e| e.to_string())?;
                    handles.push(h);
                    Ok(())
                })
                .map_err(|err| match err {
                    vmm_fds::ReceiveError::Stopped => stopped().err().unwrap_or_else(|| {
                        (FailReason::Cancelled, "CUDA IPC: stopped while taking the source's descriptors".into())
                    }),
                    vmm_fds::ReceiveError::Failed(err) => {
                        (FailReason::Connect, format!("CUDA IPC: the source's virtual-memory descriptors: {err}"))
                    }
                })?;
                let mut at = 0;
                for (j, (base, sizes)) in v.ranges.iter().enumerate() {
                    let hs = handles.get(at..at + sizes.len());
                    at += sizes.len();
                    let i = first + j;
                    if have[i].is_some() {
                        continue;
                    }
                    let Some(hs) = hs else {
                        return Err((
                            FailReason::Corrupt,
                            "CUDA IPC: the source sent fewer descriptors than ranges".into(),
                        ));
                    };
                    // SAFETY: handles imported just above, each mapped at the size its source
                    // offers (the driver refuses a size past the allocation's); kept until that
                    // process goes, the table lets it go, or the agent stops. Read-only: the
                    // destination only reads.
                    let ptr = unsafe { self.dev.vmm_map(hs, sizes, false) }.map_err(|err| {
                        (FailReason::Connect, format!("CUDA IPC: mapping the source's range at {base:#x}: {err}"))
                    })?;
                    let total = sizes.iter().sum::<u64>();
                    let m = Arc::new(Mapping { dev: self.dev.clone(), ptr, size: total, vmm: true });
                    new.push((i, table::New { key: keys[i], v: m, bytes: total, watched }));
                }
            }
        }
        // recorded under the lock; whatever goes (evicted, refused, made twice) is unmapped
        // after it, when its last holder lets go
        let mut gone = Vec::new();
        let (at, new): (Vec<usize>, Vec<table::New<Mapping>>) = new.into_iter().unzip();
        let (kept, evicted) = {
            let mut m = self.mapped.lock().unwrap_or_else(|p| p.into_inner());
            let r = m.admit(new, &mut gone);
            self.count(cx, &m);
            r
        };
        Stats::add(&cx.stats.ipc_unmapped, evicted as u64);
        drop(gone);
        let kept = kept.map_err(|full| {
            let whose = match full {
                table::Full::Source => "this source's quota of mappings",
                table::Full::Table => "the table of mappings",
            };
            (FailReason::Refused, format!("CUDA IPC: {whose} is full of mappings fetches hold"))
        })?;
        for (i, p) in at.into_iter().zip(kept) {
            if let Some(a) = e.allocs.get(i).filter(|a| a.size > p.size) {
                // another fetch mapped the same allocation meanwhile, smaller than offered here
                return Err((
                    FailReason::Corrupt,
                    format!("CUDA IPC: the source offers {} bytes of an allocation that maps {} here", a.size, p.size),
                ));
            }
            have[i] = Some(p);
        }
        let held: Vec<Arc<Mapping>> = have.into_iter().flatten().collect();
        Ok((held.iter().map(|p| p.ptr).collect(), held))
    }

    /// Let go of the mappings of source processes that no longer run (each unmapped once no
    /// fetch holds it): the pids are read under the lock, looked at in `/proc` outside it.
    fn sweep(&self, cx: &Cx<'_>) {
        let pids = self.mapped.lock().unwrap_or_else(|p| p.into_inner()).watched_pids();
        let ended: Vec<u32> = pids.into_iter().filter(|&p| !process_runs(p)).collect();
        if ended.is_empty() {
            return;
        }
        let mut gone = Vec::new();
        {
            let mut m = self.mapped.lock().unwrap_or_else(|p| p.into_inner());
            let n = m.drop_pids(&ended, &mut gone);
            Stats::add(&cx.stats.ipc_unmapped, n as u64);
            self.count(cx, &m);
        }
        drop(gone);
    }

    /// After the table changed: the gauge of mappings, and how many of them a sweep can let go.
    fn count(&self, cx: &Cx<'_>, m: &table::Table<Mapping>) {
        self.watched_now.store(m.watched(), Ordering::Relaxed);
        cx.stats.ipc_mapped_now.store(m.len() as u64, Ordering::Relaxed);
    }
}

impl Drop for CudaIpc {
    fn drop(&mut self) {
        // the agent's threads are joined: no fetch holds a mapping any more, and each unmaps
        // as it is dropped
        let mut gone = Vec::new();
        self.mapped.get_mut().unwrap_or_else(|e| e.into_inner()).clear(&mut gone);
        drop(gone);
    }
}

/// A CUDA IPC transfer: the offered blocks are copied device to device (and summed) when it is
/// posted, synchronously on the stream's mover, and verified by its check. The mappings it
/// reads through are held until it goes.
struct Copies {
    offer: wire::InPlaceOffer,
    /// The source's exported ranges (as it offered them) and their bases as mapped here.
    ranges: Vec<(u64, u64)>,
    mapped: Vec<u64>,
    _held: Vec<Arc<Mapping>>,
    /// For a source agent of this process: its registration, held until the copy is over.
    _reading: Option<Reading>,
}

impl Transfer for Copies {
    fn count(&self) -> usize {
        self.offer.blocks.len()
    }

    fn limit(&mut self, n: usize) {
        self.offer.blocks.truncate(n);
    }

    fn post(&mut self, cx: &Cx<'_>, _c: &mut dyn Conn, job: &mut Pull<'_>) -> Result<(), Failure> {
        let (offer, scratch) = (&self.offer, &mut *job.scratch);
        let count = offer.blocks.len();
        // one kernel that copies and sums where every segment's blocks lie in one exported
        // allocation (the usual pool); else one copy per contiguous run, then the sums
        let fused = plan_segments(&offer.segments, &self.ranges, &self.mapped, &offer.blocks, &mut scratch.segs);
        if !fused {
            plan_copies(
                cx.layout,
                &offer.segments,
                &self.ranges,
                &self.mapped,
                &offer.blocks,
                &job.dst[..count],
                &mut scratch.runs,
            )
            .map_err(|e| (FailReason::Corrupt, e))?;
        }
        (job.stopped)()?;
        if job.mover.is_none() {
            // SAFETY: `Agent::new`'s contract covers the layout's memory; the mover writes
            // only this fetch's destination blocks.
            *job.mover = Some(unsafe { cx.movers.take(cx.layout) }.map_err(|e| (FailReason::Corrupt, e))?);
        }
        let mover = job.mover.as_mut().expect("set above");
        let ids = &job.dst[..count];
        scratch.sums.clear();
        scratch.sums.resize(count, 0);
        // a keyed agent tags what landed from the same loads (checked against a tagged offer's
        // in `check`, and recorded)
        let tagging = cx.sums.records_tags();
        scratch.nh.clear();
        scratch.nh.resize(if tagging { count } else { 0 }, crate::block_mac::NhSums::default());
        let nh = tagging.then_some(&mut scratch.nh[..]);
        let copied = if fused {
            scratch.ids.clear();
            scratch.ids.extend(offer.blocks.iter().map(|b| b.0));
            // SAFETY: the destinations are this fetch's blocks; every offered block's segment
            // lies inside an allocation the source exported (`plan_segments`), mapped and held
            // here (`_held`), and pinned at the source until our DONE.
            unsafe { mover.copy_sum_from(&scratch.segs, &scratch.ids, ids, &mut scratch.sums, nh) }
        } else {
            // SAFETY: every run's destination is one of this fetch's blocks; every source range
            // lies inside an allocation the source exported (`plan_copies`), mapped and held
            // here, pinned until our DONE.
            unsafe { mover.copy_in_and_sum(&scratch.runs, ids, &mut scratch.sums, nh) }
        };
        if let Err(e) = copied {
            *job.mover = None; // a mover whose stream failed is not reused (its drop waits)
            return Err((FailReason::Truncated, format!("CUDA IPC copy: {e}")));
        }
        Ok(())
    }

    fn check(
        &mut self,
        cx: &Cx<'_>,
        _c: &mut dyn Conn,
        job: &mut Pull<'_>,
        land: &mut Landing<'_>,
    ) -> Result<Progress, Failure> {
        let sbb = cx.layout.stage_block_bytes();
        for (i, &sum) in job.scratch.sums.iter().enumerate().take(self.offer.blocks.len()) {
            Landing::check(i, sum, self.offer.blocks[i].1)?;
            let tag = match (cx.sums.mac(), job.scratch.nh.get(i)) {
                (Some(mac), Some(&nh)) => Some(mac.finish(nh, sbb)),
                _ => None,
            };
            if let (Some(got), Some(&want)) = (tag, self.offer.tags.get(i)) {
                Landing::check_tag(i, got, want)?;
            }
            land.landed(i, sum);
            if let Some(t) = tag {
                land.tagged(i, t);
            }
        }
        Ok(Progress::Done { reusable: true })
    }

    /// The copies synchronized inside `post` (or their mover was dropped, which waits).
    fn quiet(&mut self, _until: Instant) -> bool {
        true
    }

    fn release(&mut self, cx: &Cx<'_>, c: &mut dyn Conn, landed: usize, _failed: Option<FailReason>, _quiet: bool) {
        send_done(cx, c, landed);
    }

    /// Its writes are the mover's copies, finished or waited for by the mover's drop.
    fn into_writes(self: Box<Self>) -> Option<Box<dyn Writes>> {
        None
    }
}

impl Backend for CudaIpc {
    fn hello(&self) -> u8 {
        wire::IPC_HELLO
    }

    /// One: a copy engine moves a whole run.
    fn streams(&self, _cx: &Cx<'_>, _blocks: usize) -> usize {
        1
    }

    fn movers_at_start(&self, _limits: &Limits) -> usize {
        1
    }

    fn default_speed(&self, _device_pool: bool) -> SourceSpeed {
        CUDA_IPC_DEFAULT
    }

    fn prepare(
        &self,
        cx: &Cx<'_>,
        c: &mut dyn Conn,
        job: &mut Pull<'_>,
        land: &mut Landing<'_>,
    ) -> Result<Box<dyn Transfer + '_>, Failure> {
        let offer = read_in_place_offer(
            cx,
            c,
            wire::IPC_OFFER,
            Some(AGENT),
            job.asked.len(),
            job.deadline,
            &mut job.scratch.buf,
            land,
        )?;
        let r = (|| {
            // an offer of no block carries no exports (the source grants nothing for it)
            if offer.blocks.is_empty() {
                return Err((FailReason::SourceMiss, "the source holds none of the blocks".to_string()));
            }
            let exports = decode_exports(&offer.metadata)
                .ok_or((FailReason::Corrupt, "the offer's CUDA IPC exports do not decode".to_string()))?;
            if exports.host != self.host {
                land.unusable = true;
                return Err((
                    FailReason::Refused,
                    "the source runs on another host: CUDA IPC needs both agents on one host".to_string(),
                ));
            }
            if offer.device.is_none() {
                return Err((FailReason::Corrupt, "a CUDA IPC offer of host memory".to_string()));
            }
            if exports.pid == self.pid {
                // "this process" is only a claim: an agent of it must be serving exactly these
                // blocks under the names asked, and only its pool is read
                let registry = EXPORTED.lock().unwrap_or_else(|p| p.into_inner());
                let device = offer.device.unwrap_or(-1);
                let (pool, reading) = own_source(&registry, device, &exports.ranges(), &offer.blocks, job.asked)
                    .map_err(|why| {
                        Stats::add(&cx.stats.ipc_offers_refused, 1);
                        let text = match why {
                            OwnRefusal::NotExported => format!(
                                "CUDA IPC: an offer in this process's name names memory that no agent of it on device \
                                 {device} exported"
                            ),
                            OwnRefusal::NotAsked(i) => format!(
                                "CUDA IPC: an offer in this process's name offers block {i} that its agent does not \
                                 serve under the name asked"
                            ),
                        };
                        (FailReason::Corrupt, text)
                    })?;
                let mapped = pool.iter().map(|r| r.0).collect();
                return Ok((pool, mapped, Vec::new(), Some(reading)));
            }
            let (mapped, held) = self.map(cx, &exports, job.deadline, job.stopped).inspect_err(|e| {
                // memory this process cannot map (another IPC namespace, say), or no room for
                // this source's mappings: TCP may do
                land.unusable = matches!(e.0, FailReason::Connect | FailReason::Refused);
            })?;
            Ok((exports.ranges(), mapped, held, None))
        })();
        match r {
            Ok((ranges, mapped, held, reading)) => {
                Ok(Box::new(Copies { offer, ranges, mapped, _held: held, _reading: reading }))
            }
            Err(e) => {
                send_done(cx, c, 0);
                Err(e)
            }
        }
    }

    fn serve(&self, cx: &Cx<'_>, c: &mut dyn Conn, ids: &[u32], names: &[u64]) -> bool {
        // a reader of this process may take exactly these blocks under these names, until the
        // serve ends
        let _serving = self.exported.serving(ids, &names[..ids.len().min(names.len())]);
        super::serve_in_place(cx, c, ids, wire::IPC_OFFER, AGENT, &self.metadata, Some(self.device))
    }

    /// While memory of other processes that can be looked at is mapped here: the fetch
    /// workers look every 50 ms whether those processes still run (mappings of a source in
    /// another PID namespace alone wake nobody: no sweep could let them go).
    fn wants_reap(&self) -> bool {
        self.watched_now.load(Ordering::Relaxed) > 0
    }

    fn reap(&self, cx: &Cx<'_>) {
        self.sweep(cx);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a GPU: an offer that claims this process (its pid and boot id, which any neighbour
    /// can read) but names memory no agent of it exported is refused before any copy; one that
    /// names this agent's own pool maps to the addresses themselves. Skips without a CUDA
    /// driver, saying why (fails when `KVRELAY_REQUIRE_GPU` is set).
    #[test]
    fn a_neighbour_posing_as_this_process_gets_no_copy_of_other_memory() {
        let Some(dev) = crate::copy::test_device() else { return };
        let pool = crate::copy::DeviceBuffer::alloc(&dev, 8 * 512).unwrap();
        // another allocation of this process: the runtime's own tensors, say
        let tensors = crate::copy::DeviceBuffer::alloc(&dev, 1 << 20).unwrap();
        let layout = KvLayout::new(
            8,
            vec![crate::copy::Segment { base: pool.ptr(), block_stride: 512, bytes_per_block: 512 }],
            &[],
        )
        .unwrap();
        // SAFETY: the pool is device memory of device 0 that outlives the transport.
        let ipc = unsafe { CudaIpc::new(&layout, Some(0), false) }.unwrap();
        let (limits, stats, sums, movers) = (
            Limits::default(),
            Stats::default(),
            crate::agent::sums::SumTable::new(8, None),
            crate::agent::pool::Movers::new(crate::agent::pool::Memory::Host, None),
        );
        let cx = Cx { layout: &layout, block_bytes: 512, movers: &movers, limits: &limits, stats: &stats, sums: &sums };
        let claim = |base: u64, size: u64| vec![(base, size)];
        let registry = || EXPORTED.lock().unwrap().clone();
        let blocks: Vec<wire::OfferedBlock> = vec![(1, 0, [0; 32])];
        let serving = ipc.exported.serving(&[1], &[42]);
        for (base, size) in [(tensors.ptr(), 4096), (pool.ptr(), 8 * 512 + 1), (0xdead_beef_0000, 4096)] {
            let e = own_source(&registry(), 0, &claim(base, size), &blocks, &[42]).map(|_| ()).unwrap_err();
            assert_eq!(e, OwnRefusal::NotExported, "{base:#x}");
        }
        let (extents, reading) = own_source(&registry(), 0, &claim(pool.ptr(), 8 * 512), &blocks, &[42]).unwrap();
        assert_eq!(extents, vec![(pool.ptr(), 8 * 512)], "this process's own pool, read at its own addresses");
        drop(reading);
        drop(serving);
        // another process's offer would be mapped, never taken as this process's addresses
        let _ = (&cx, &limits, &stats, &sums, &movers);
        drop(ipc);
    }

    /// On a GPU: a pool that shares its allocation with other memory (here the first MiB of
    /// 8 MiB) is not exported, since a peer's mapping would reach the rest, unless the caller
    /// asks for whole allocations; a pool that is its own allocation is. Skips without a CUDA
    /// driver, saying why (fails when `KVRELAY_REQUIRE_GPU` is set).
    #[test]
    fn a_pool_sharing_its_allocation_is_not_exported_unless_asked() {
        let Some(dev) = crate::copy::test_device() else { return };
        const M: usize = 1 << 20;
        let big = crate::copy::DeviceBuffer::alloc(&dev, 8 * M).unwrap();
        let layout = |base: u64, blocks: u32, bytes: u64| {
            let g = crate::copy::Segment { base, block_stride: bytes, bytes_per_block: bytes };
            KvLayout::new(blocks, vec![g], &[]).unwrap()
        };
        // the first MiB of the allocation, then all of it
        let (shared, all) = (layout(big.ptr(), 16, 64 << 10), layout(big.ptr(), 128, 64 << 10));
        let open = |l: &KvLayout, whole: bool| {
            // SAFETY: the pool is device memory of device 0 that outlives the transport.
            unsafe { CudaIpc::new(l, Some(0), whole) }.map(|_| ())
        };
        let e = open(&shared, false).unwrap_err();
        assert!(e.contains("export_whole_allocations") && e.contains(&format!("{:#x}", big.ptr())), "{e}");
        open(&shared, true).unwrap();
        open(&all, false).unwrap();
    }
}
