//! The agent's same-host GPU transport ([`crate::agent::Transport::CudaIpc`]): when both agents
//! run on one host and their pools are device memory, the source copies the asked blocks into
//! an export area of its own and the destination copies them out of it into its pool, device
//! to device, and the checksum kernel verifies them where they landed. Control (the handshake,
//! authentication, the offer, the end) stays on the agent's TCP connection.
//!
//! - **Start.** Nothing of the pool is exported: it may lie in any device memory (`cuMemAlloc`,
//!   a caching allocator's segment shared with other tensors, the virtual memory API with or
//!   without shareable handles, `cudaMallocAsync`). The agent only checks that the device can
//!   make memory another process maps (the virtual memory API with POSIX descriptors) and
//!   listens on a Unix socket of its own for the areas' descriptors ([`super::vmm_fds`]). A host
//!   pool is refused: this transport moves device memory only.
//! - **Serving ([`area`]).** The source pins the leading run it holds, as over TCP, copies those
//!   blocks into its connection's export area (slot 0 onward; one device copy per segment and
//!   run of blocks, waited for), and answers `IPC_OFFER`: an in-place offer of the area (its
//!   segment table, and per offered block its slot, the checksum recorded when it became
//!   reusable and its tag) whose metadata is the source's host id (the kernel's boot id),
//!   process id, the area's range and the socket and token its descriptor is taken with. The
//!   area is the connection's until it ends (a larger one replaces it when a transfer needs
//!   more blocks), its descriptor goes to the first process that proves the token and no
//!   other, and it never holds anything but blocks that connection asked for: a peer mapping
//!   its grant reaches those and zeros, and what it writes there reaches nobody.
//! - **A fetch.** The destination sends `IPC_HELLO`, checks the offer against its own layout,
//!   refuses a source on another host, maps the offered range once (the descriptor taken over
//!   the source's Unix socket with the offer's token, mapped read-only; kept until the source
//!   gives more than [`AREAS_KEPT`] newer areas, the agent stops, or the source process no
//!   longer runs; within one process the area's addresses are used as they are, but only where
//!   they lie inside an area an agent of this process serves from now: a pid and a boot id are
//!   what any neighbour can claim), checks that every offered block lies inside it, then one
//!   kernel on a mover's stream copies the blocks and sums each word as it writes it
//!   (`CudaEngine::copy_and_sum_from`: the checksum of what landed, for the memory traffic of a
//!   copy alone); where that kernel cannot read the offer's layout it enqueues one
//!   device-to-device copy per run contiguous at both ends and the checksum kernel after. It
//!   counts each block whose sum (and, keyed, tag) matches. `DONE` tells the source how many
//!   blocks were taken; its pins hold until then (or its transfer deadline). Sources of older
//!   versions that offer their pool (CUDA IPC handles of `cuMemAlloc` allocations, or
//!   virtual-memory ranges) are mapped the same way.
//! - **Mappings.** Each is reference-counted: a fetch holds the ones it copies through until
//!   its stream synchronized. The table keeps at most 1,024, at most 128 (and 1 TiB of address
//!   space) per source process, or one offer's count when more (`table`): beyond a bound the least recently used mapping no
//!   fetch holds is let go (of the same source first), and a source whose quota is all held is
//!   refused for that fetch, which falls back to TCP. Room is reserved in the table before any
//!   driver call (counting what other fetches hold or are mapping), so a full source is refused
//!   before its allocations are opened, not after. While any watched mapping is kept, idle
//!   fetch workers look every 50 ms whether its source process still runs (`/proc/<pid>`,
//!   outside the table's lock) and let go of those of a process that ended (`ipc_unmapped`
//!   counts every kind of letting go). A source in another PID namespace (not in this
//!   process's `/proc` when it was mapped) cannot be looked at: its mappings stay until the
//!   bounds or the agent's stop let them go. Every driver call happens outside the table's
//!   lock.
//! - **What a peer can do.** Only a peer that passed the agent's allowlist and proved it holds
//!   the agent's key receives a grant, and only on the source's connection to it, in an offer
//!   of at least one block it asked for by name: an offer of no block carries no exports, and
//!   an agent without a key (no deployment key given and the per-user key turned off) refuses
//!   every CUDA IPC hello (`grants_refused_unkeyed`). With no setting at all the key is the
//!   per-user key ([`crate::agent::auth`]): a process of another user of the host gets no
//!   descriptor (the socket closes on another uid, `SO_PEERCRED`). A mapped area is readable
//!   and writable by that peer's process (the importer sets its own access: this agent maps
//!   read-only, a hostile peer need not), and holds only blocks its connection asked for:
//!   the pool, the source's slots and other peers' areas are out of its reach, and a write
//!   there changes only what that peer itself reads. Blocks are still checked where they land
//!   (checksum, and the keyed tag: [`crate::block_mac`]) against what the source recorded: a
//!   source whose memory went bad is found. The sizes a source reports are checked against the
//!   driver's: an allocation must map here (`cuMemGetAddressRange`) at least as large as
//!   offered, and a virtual-memory allocation maps only at its real size (`cuMemMap` refuses
//!   more), so no copy plan reads past what is mapped. Across two GPUs of a host the same
//!   copies go over peer access (NVLink where present); multi-node NVLink fabric handles
//!   (`CU_MEM_HANDLE_TYPE_FABRIC`, exported with `cuMemExportToShareableHandle` and imported by
//!   the peer's IMEX channel) are a later step.
//! - **Cost.** Per transfer, the source's copy of the asked blocks into its area (device to
//!   device, before the offer goes out); per connection, the area's allocation and zeroing at
//!   the source and its mapping at the destination. Memory: the areas of an agent hold at most
//!   the pool's size (at least 64 MiB) together; a transfer that finds no room is refused `busy`.

mod area;
mod offer;
mod plan;
mod registry;
mod table;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::{
    read_in_place_offer, send_done, vmm_fds, Backend, Cx, Failure, InPlaceView, Landing, Lease, Progress, Pull,
    Transfer, Writes,
};
use crate::agent::estimate::{SourceSpeed, CUDA_IPC_DEFAULT};
use crate::agent::wire::{self, Conn, Refusal};
use crate::agent::{FailReason, Limits, Stats};
use crate::copy::{CudaDevice, KvLayout, VmmHandle};
pub(in crate::agent) use area::Area;
use area::Areas;
use offer::{decode_exports, host_id, Exports};
pub use plan::check_offer_plans;
use plan::{plan_copies, plan_segments};
use registry::{own_source, OwnRefusal, Reading, EXPORTED};

/// The name an IPC offer carries where a NIXL offer names its agent.
const AGENT: &str = "cuda-ipc";
/// A source allocation: the source's host id, process id and the allocation's IPC handle (for
/// a virtual-memory range: [`vmm_key`]).
type MappedKey = table::Key;

/// The export areas of one source a destination keeps mapped (one per connection to it; the
/// least recently used go first, once no fetch holds them).
const AREAS_KEPT: usize = 4;

/// The token in a [`vmm_key`] (`None` for a CUDA IPC handle's key).
fn vmm_token(k: &[u8; 64]) -> Option<[u8; 32]> {
    (k[..8] == *b"\0kvrvmm\0").then(|| k[24..24 + vmm_fds::TOKEN].try_into().expect("32 bytes"))
}

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

/// This instance's export areas, and the source allocations (areas, pools of older sources) it
/// mapped.
pub(in crate::agent) struct CudaIpc {
    dev: Arc<CudaDevice>,
    device: i32,
    host: [u8; 16],
    pid: u32,
    /// Source allocations mapped here, by source: bounded per source and in all ([`table`]).
    mapped: Mutex<table::Table<Mapping>>,
    /// Entries of `mapped` whose source process can be looked at (`Mapping::watched`), read
    /// without the lock by the fetch workers' idle loop: only those can be let go by a sweep.
    watched_now: AtomicUsize,
    /// What this agent's grants map: an export area per serving connection ([`area`]), their
    /// descriptor socket, and this agent's entry in the process's registry.
    areas: Arc<Areas>,
}

impl CudaIpc {
    /// Serve from export areas on `device` for a pool laid out as `layout` (nothing of the
    /// pool is exported: it may share its allocation with anything). Fails when the device
    /// cannot make memory another process can map (the virtual memory API with POSIX
    /// descriptors), saying so.
    ///
    /// # Safety
    /// As [`crate::agent::Agent::new`]: the layout's blocks are memory of `device`, valid for
    /// the agent's life.
    pub(in crate::agent) unsafe fn new(layout: &KvLayout, device: Option<i32>) -> Result<CudaIpc, String> {
        let device = device.ok_or("the CUDA IPC transport moves device memory: the pool must be on a CUDA device")?;
        let dev = CudaDevice::open(device).map_err(|e| format!("CUDA IPC: device {device}: {e}"))?;
        let host = host_id()?;
        // what every area needs, tried once: an allocation another process can map
        let probe = crate::copy::VmmBuffer::alloc(&dev, 1, 1, true)
            .and_then(|b| dev.vmm_export(b.ptr(), b.ptr() + b.len() as u64).map(|_| ()));
        probe.map_err(|e| {
            format!(
                "CUDA IPC: device {device} cannot make memory another process maps (the virtual memory API with POSIX \
                 descriptors: {e}); use the TCP or NIXL transport"
            )
        })?;
        let areas = Arc::new(Areas::new(dev.clone(), device, layout, host)?);
        Ok(CudaIpc {
            dev,
            device,
            host,
            pid: std::process::id(),
            mapped: Mutex::new(table::Table::default()),
            watched_now: AtomicUsize::new(0),
            areas,
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
            let (r, mut evicted) = m.admit(new, &mut gone);
            if e.vmm.is_some() {
                // the export areas this source gave up (other connections' earlier areas)
                evicted += m.retire_tokens(&e.host, e.pid, AREAS_KEPT, vmm_token, &mut gone);
            }
            self.count(cx, &m);
            (r, evicted)
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

    fn serve(&self, cx: &Cx<'_>, c: &mut dyn Conn, ids: &[u32], names: &[u64], lease: &mut Lease) -> bool {
        if ids.is_empty() {
            // an offer of no block: no area, no grant
            return super::serve_in_place(cx, c, ids, wire::IPC_OFFER, AGENT, &[], Some(self.device), None);
        }
        let area = match self.areas.lease(&mut lease.area, ids.len()) {
            Ok(a) => a,
            Err(why) => {
                cx.stats.refused(Refusal::Busy);
                wire::refuse(c, Refusal::Busy, &why, cx.io_deadline());
                return false;
            }
        };
        if let Err(e) = area.fill(ids) {
            lease.area = None; // a device error: the next transfer starts from a new area
            cx.stats.refused(Refusal::Internal);
            wire::refuse(
                c,
                Refusal::Internal,
                &format!("CUDA IPC: copying into the export area: {e}"),
                cx.io_deadline(),
            );
            return false;
        }
        // a reader of this process may take exactly these slots under these names, until the
        // serve ends
        let names = &names[..ids.len().min(names.len())];
        let _serving = self.areas.exported.serving(area.base(), names);
        let view = InPlaceView { segments: &area.segs, num_blocks: area.cap };
        super::serve_in_place(cx, c, ids, wire::IPC_OFFER, AGENT, &area.metadata, Some(self.device), Some(view))
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

/// A grant mapped as a peer maps it ([`map_grant`]); unmapped when dropped.
#[doc(hidden)]
pub struct GrantMapping {
    dev: Arc<CudaDevice>,
    /// Where it is mapped here.
    pub base: u64,
    /// Its bytes.
    pub size: u64,
    /// Where the source has it (what the offer's segment table counts from).
    pub source_base: u64,
}

impl Drop for GrantMapping {
    fn drop(&mut self) {
        // SAFETY: the range `map_grant` mapped, unmapped once; the test that held it is done.
        let _ = unsafe { self.dev.vmm_unmap(self.base, self.size) };
    }
}

/// What any peer can do with a CUDA IPC offer's metadata, for tests of what a grant reaches:
/// take the descriptors of its virtual-memory range (proving the token) and map them readable
/// and writable, as a hostile peer would (this agent's own fetches map read-only).
#[doc(hidden)]
pub fn map_grant(dev: &Arc<CudaDevice>, metadata: &[u8]) -> Result<GrantMapping, String> {
    let e = decode_exports(metadata).ok_or("the offer's exports do not decode")?;
    if !e.allocs.is_empty() {
        return Err(format!("the offer grants {} CUDA IPC handles", e.allocs.len()));
    }
    let v = e.vmm.ok_or("the offer grants no virtual-memory range")?;
    let [(source_base, sizes)] = &v.ranges[..] else {
        return Err(format!("the offer grants {} ranges", v.ranges.len()));
    };
    let mut handles = Vec::new();
    let by = Instant::now() + std::time::Duration::from_secs(30);
    vmm_fds::receive(&v.socket, e.pid, &v.token, v.chunks(), by, &|| false, |fd| {
        // SAFETY: a descriptor the source process sent as its export (the driver refuses others).
        handles.push(unsafe { dev.vmm_import(std::os::fd::AsFd::as_fd(&fd)) }.map_err(|e| e.to_string())?);
        Ok(())
    })
    .map_err(|e| e.to_string())?;
    // SAFETY: handles imported just above, mapped at the sizes offered (the driver refuses more).
    let base = unsafe { dev.vmm_map(&handles, sizes, true) }.map_err(|e| e.to_string())?;
    Ok(GrantMapping { dev: dev.clone(), base, size: sizes.iter().sum(), source_base: *source_base })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a GPU: an offer that claims this process (its pid and boot id, which any neighbour
    /// can read) but names memory that is not a live export area of an agent of it (the
    /// runtime's tensors, the pool itself, past the area) is refused before any copy; one that
    /// names the area its agent serves from maps to the area's own addresses. Skips without a
    /// CUDA driver, saying why (fails when `KVRELAY_REQUIRE_GPU` is set).
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
        let ipc = unsafe { CudaIpc::new(&layout, Some(0)) }.unwrap();
        let mut held = None;
        let area = ipc.areas.lease(&mut held, 1).unwrap();
        area.fill(&[1]).unwrap();
        let (base, len) = (area.base(), area.segs[0].1 * u64::from(area.cap));
        let claim = |base: u64, size: u64| vec![(base, size)];
        let registry = || EXPORTED.lock().unwrap().clone();
        let blocks: Vec<wire::OfferedBlock> = vec![(0, 0, [0; 32])];
        let serving = ipc.areas.exported.serving(base, &[42]);
        for (b, size) in [(tensors.ptr(), 4096), (pool.ptr(), 8 * 512), (base, 64 << 20), (0xdead_beef_0000, 4096)] {
            let e = own_source(&registry(), 0, &claim(b, size), &blocks, &[42]).map(|_| ()).unwrap_err();
            assert_eq!(e, OwnRefusal::NotExported, "{b:#x}");
        }
        let (extents, reading) = own_source(&registry(), 0, &claim(base, len), &blocks, &[42]).unwrap();
        assert_eq!(extents.len(), 1);
        assert_eq!(extents[0].0, base, "the area, read at its own addresses");
        assert!(extents[0].1 >= len && extents[0].1 <= len.next_multiple_of(2 << 20));
        drop(reading);
        drop(serving);
        drop(held);
        let gone = own_source(&registry(), 0, &claim(base, len), &blocks, &[42]).map(|_| ()).unwrap_err();
        assert_eq!(gone, OwnRefusal::NotExported, "an area given up is named by no offer");
        drop(ipc);
    }

    /// On a GPU: a pool that shares its allocation with other memory (here the first MiB of
    /// 8 MiB) is served, since a grant maps an export area, never the pool: the area holds the
    /// asked blocks in order from slot 0, zeros after them, and nothing of the rest of the
    /// allocation; a larger transfer gets a larger area, within the budget. Skips without a
    /// CUDA driver, saying why (fails when `KVRELAY_REQUIRE_GPU` is set).
    #[test]
    fn a_grant_maps_an_area_holding_the_asked_blocks_only() {
        let Some(dev) = crate::copy::test_device() else { return };
        const M: usize = 1 << 20;
        const B: usize = 64 << 10;
        let big = crate::copy::DeviceBuffer::alloc(&dev, 8 * M).unwrap();
        let pattern: Vec<u8> = (0..8 * M).map(|i| (i / B) as u8 ^ (i as u8).wrapping_mul(31)).collect();
        big.write(0, &pattern).unwrap();
        // the first MiB of the allocation: 16 blocks, each in two segments of 32 KiB
        let seg = |s: usize| crate::copy::Segment {
            base: big.ptr() + (s * M / 2) as u64,
            block_stride: (B / 2) as u64,
            bytes_per_block: (B / 2) as u64,
        };
        let layout = KvLayout::new(16, vec![seg(0), seg(1)], &[]).unwrap();
        // SAFETY: the pool is device memory of device 0 that outlives the transport.
        let ipc = unsafe { CudaIpc::new(&layout, Some(0)) }.unwrap();
        let mut held = None;
        let ids = [3u32, 1, 2];
        let area = ipc.areas.lease(&mut held, ids.len()).unwrap();
        assert_eq!(area.cap, area::MIN_BLOCKS);
        area.fill(&ids).unwrap();
        let mut got = vec![0u8; (area.segs[1].0 - area.base()) as usize * 2];
        area.mem_read(&mut got);
        let seg_bytes = got.len() / 2;
        for s in 0..2 {
            for (slot, &id) in ids.iter().enumerate() {
                let at = s * seg_bytes + slot * B / 2;
                let src = s * M / 2 + id as usize * B / 2;
                assert_eq!(&got[at..at + B / 2], &pattern[src..src + B / 2], "segment {s}, slot {slot}");
            }
            let rest = &got[s * seg_bytes + ids.len() * B / 2..(s + 1) * seg_bytes];
            assert!(rest.iter().all(|&b| b == 0), "segment {s}: nothing past the asked blocks");
        }
        let first = area.metadata.clone();
        // a transfer of 12 blocks needs more than 8: a new area of 16 (the old one given up
        // first: its address may well come back, under a new grant)
        let area = ipc.areas.lease(&mut held, 12).unwrap();
        assert_eq!(area.cap, 16);
        assert_ne!(area.metadata, first, "a new grant (another token)");
        // the budget: the pool's size or 64 MiB, whichever is more
        assert_eq!(ipc.areas.budget(), 64 << 20);
        drop(held);
        drop(ipc);
    }
}
