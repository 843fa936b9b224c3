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
//!   process the addresses are used as they are), checks that every offered block lies inside an exported allocation,
//!   then one kernel on a mover's stream copies the blocks and sums each word as it writes it
//!   (`CudaEngine::copy_and_sum_from`: the checksum of what landed, for the memory traffic of a
//!   copy alone); where a segment's blocks span several allocations it enqueues one
//!   device-to-device copy per run contiguous at both ends and the checksum kernel after. It
//!   counts each block whose sum matches. `DONE` tells the source how many blocks were taken;
//!   its pins hold until then (or its transfer deadline).
//! - **Mappings.** Each is reference-counted: a fetch holds the ones it copies through until
//!   its stream synchronized. While any is held, idle fetch workers look every 50 ms whether
//!   its source process still runs (`/proc/<pid>`) and let go of those of a process that ended
//!   (`ipc_unmapped`). A source in another PID namespace (not in this process's `/proc` when
//!   it was mapped) cannot be looked at: its mappings stay until the agent stops.
//! - **What a peer can do.** Only a peer that passed the agent's allowlist (and its key, when
//!   one is set) receives handles, and only on the source's connection to it. A mapped pool is
//!   readable and writable by that peer's process, as a NIXL registration is: run agents that
//!   share a host under one trust domain. The sizes a source reports are checked against the
//!   driver's: an allocation must map here (`cuMemGetAddressRange`) at least as large as
//!   offered, and a virtual-memory allocation maps only at its real size (`cuMemMap` refuses
//!   more), so no copy plan reads past what is mapped. The descriptor socket hands descriptors only to a
//!   connection that presents the token of an offer. Across two GPUs of a host the same copies go over
//!   peer access (NVLink where present); multi-node NVLink fabric handles
//!   (`CU_MEM_HANDLE_TYPE_FABRIC`, memory from `cuMemCreate` with that handle type, exported
//!   with `cuMemExportToShareableHandle` and imported by the peer's IMEX channel) are a later
//!   step.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::{read_in_place_offer, send_done, vmm_fds, Backend, Failure, Landing, Pull};
use crate::agent::estimate::{SourceSpeed, CUDA_IPC_DEFAULT};
use crate::agent::wire::{self, Conn};
use crate::agent::{FailReason, Inner, Limits, Stats};
use crate::copy::{CudaDevice, IpcExport, KvLayout, VmmChunk, VmmHandle};

/// The name an IPC offer carries where a NIXL offer names its agent.
const AGENT: &str = "cuda-ipc";
/// Most source allocations one destination keeps mapped (each a `cuIpcOpenMemHandle`).
const MAX_MAPPED: usize = 1024;
/// Most allocations one offer may list.
const MAX_EXPORTS: usize = 4096;
/// Bytes of one exported allocation in an offer's metadata: handle, base, size.
const EXPORT_BYTES: usize = 64 + 8 + 8;

/// This host's id: the kernel's boot id (two agents with equal ids run on one host, in one
/// boot), 16 bytes.
fn host_id() -> Result<[u8; 16], String> {
    let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map_err(|e| format!("CUDA IPC: this host's boot id: {e}"))?;
    let hex: Vec<u8> = text.trim().bytes().filter(|b| *b != b'-').collect();
    let mut id = [0u8; 16];
    if hex.len() != 32 {
        return Err("CUDA IPC: the boot id is not a UUID".into());
    }
    for (i, o) in id.iter_mut().enumerate() {
        let pair = std::str::from_utf8(&hex[2 * i..2 * i + 2]).map_err(|_| "CUDA IPC: the boot id is not hex")?;
        *o = u8::from_str_radix(pair, 16).map_err(|_| "CUDA IPC: the boot id is not hex")?;
    }
    Ok(id)
}

/// What an IPC offer's metadata says: where the source runs and what it exported.
#[derive(Debug, PartialEq)]
pub(crate) struct Exports {
    host: [u8; 16],
    pid: u32,
    /// Allocations of `cuMemAlloc` (CUDA IPC handles).
    allocs: Vec<IpcExport>,
    /// Allocations of the virtual memory API, when the source's pool has any.
    vmm: Option<VmmOffer>,
}

/// The virtual-memory part of an offer: where to get the descriptors, and what they map.
#[derive(Debug, PartialEq)]
pub(crate) struct VmmOffer {
    /// The source's descriptor socket (an abstract Unix socket name).
    socket: Vec<u8>,
    /// What the destination proves with there.
    token: [u8; vmm_fds::TOKEN],
    /// Contiguous ranges of the source's address space: each its base and the sizes of the
    /// allocations mapped side by side from it; the socket sends their descriptors in this
    /// order.
    ranges: Vec<(u64, Vec<u64>)>,
}

impl VmmOffer {
    fn chunks(&self) -> usize {
        self.ranges.iter().map(|r| r.1.len()).sum()
    }
}

/// Most contiguous virtual-memory ranges, and allocations in them, one offer may list.
const MAX_VMM_RANGES: usize = 4096;
const MAX_VMM_CHUNKS: usize = 16384;

impl Exports {
    /// Every exported range as `(base, size)`: the CUDA IPC allocations, then the
    /// virtual-memory ranges (the order [`CudaIpc::map`] maps them in).
    fn ranges(&self) -> Vec<(u64, u64)> {
        let vmm = self.vmm.iter().flat_map(|v| v.ranges.iter().map(|(b, c)| (*b, c.iter().sum::<u64>())));
        self.allocs.iter().map(|a| (a.base, a.size)).chain(vmm).collect()
    }
}

/// `host (16) | pid u32 | count u32 | count x (handle 64 | base u64 | size u64)`, then, when
/// the pool has memory of the virtual memory API: `ranges u32 | token 32 | socket_len u16 |
/// socket | ranges x (base u64 | n u32 | n x size u64)`.
fn encode_exports(e: &Exports) -> Vec<u8> {
    let mut p = Vec::with_capacity(24 + EXPORT_BYTES * e.allocs.len());
    p.extend_from_slice(&e.host);
    p.extend_from_slice(&e.pid.to_le_bytes());
    p.extend_from_slice(&(e.allocs.len() as u32).to_le_bytes());
    for a in &e.allocs {
        p.extend_from_slice(&a.handle);
        p.extend_from_slice(&a.base.to_le_bytes());
        p.extend_from_slice(&a.size.to_le_bytes());
    }
    if let Some(v) = &e.vmm {
        p.extend_from_slice(&(v.ranges.len() as u32).to_le_bytes());
        p.extend_from_slice(&v.token);
        p.extend_from_slice(&(v.socket.len() as u16).to_le_bytes());
        p.extend_from_slice(&v.socket);
        for (base, sizes) in &v.ranges {
            p.extend_from_slice(&base.to_le_bytes());
            p.extend_from_slice(&(sizes.len() as u32).to_le_bytes());
            for s in sizes {
                p.extend_from_slice(&s.to_le_bytes());
            }
        }
    }
    p
}

/// Reads little-endian fields off the front of a slice.
struct Reader<'a>(&'a [u8]);
impl Reader<'_> {
    fn take(&mut self, n: usize) -> Option<&[u8]> {
        let (a, b) = (self.0.get(..n)?, self.0.get(n..)?);
        self.0 = b;
        Some(a)
    }
    fn u16(&mut self) -> Option<u16> {
        Some(u16::from_le_bytes(self.take(2)?.try_into().ok()?))
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
}

/// Decode an offer's metadata; `None` unless it decodes exactly, within [`MAX_EXPORTS`] (and
/// the virtual-memory limits), with at least one range, and no range's end overflows.
pub(crate) fn decode_exports(p: &[u8]) -> Option<Exports> {
    let mut r = Reader(p);
    let host: [u8; 16] = r.take(16)?.try_into().ok()?;
    let pid = r.u32()?;
    let n = r.u32()? as usize;
    if n > MAX_EXPORTS || r.0.len() < EXPORT_BYTES * n {
        return None;
    }
    let mut allocs = Vec::with_capacity(n);
    for _ in 0..n {
        let handle: [u8; 64] = r.take(64)?.try_into().ok()?;
        let (base, size) = (r.u64()?, r.u64()?);
        base.checked_add(size)?;
        allocs.push(IpcExport { handle, base, size });
    }
    let vmm = if r.0.is_empty() {
        None
    } else {
        let k = r.u32()? as usize;
        let token: [u8; vmm_fds::TOKEN] = r.take(vmm_fds::TOKEN)?.try_into().ok()?;
        let len = usize::from(r.u16()?);
        let socket = r.take(len)?.to_vec();
        if k == 0 || k > MAX_VMM_RANGES || socket.is_empty() || socket.len() > 107 {
            return None;
        }
        let (mut ranges, mut chunks) = (Vec::with_capacity(k), 0usize);
        for _ in 0..k {
            let (base, m) = (r.u64()?, r.u32()? as usize);
            chunks += m;
            if m == 0 || chunks > MAX_VMM_CHUNKS {
                return None;
            }
            let mut sizes = Vec::with_capacity(m);
            let mut end = base;
            for _ in 0..m {
                let s = r.u64()?;
                if s == 0 {
                    return None;
                }
                end = end.checked_add(s)?;
                sizes.push(s);
            }
            ranges.push((base, sizes));
        }
        if !r.0.is_empty() {
            return None;
        }
        Some(VmmOffer { socket, token, ranges })
    };
    if allocs.is_empty() && vmm.is_none() {
        return None;
    }
    Some(Exports { host, pid, allocs, vmm })
}

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
    blocks: &[(u32, u64)],
    dst: &[u32],
    runs: &mut Vec<(u64, u64, u64)>,
) -> Result<(), String> {
    runs.clear();
    let mine = layout.segments();
    let mut run: Option<(u64, u64, u64)> = None;
    for (i, (&(src, _), &d)) in blocks.iter().zip(dst).enumerate() {
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
    blocks: &[(u32, u64)],
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
/// past the source's exported ranges. For fuzzing what a hostile source can send.
#[doc(hidden)]
pub fn check_offer_plans(layout: &KvLayout, payload: &[u8], asked: usize, dst: &[u32]) {
    let Some(offer) = wire::decode_in_place_offer(payload) else { return };
    if offer.check(layout, asked).is_err() || offer.blocks.is_empty() || offer.blocks.len() > dst.len() {
        return;
    }
    let Some(exports) = decode_exports(&offer.metadata) else { return };
    assert_eq!(encode_exports(&exports), offer.metadata, "metadata decodes only from its exact encoding");
    let ranges = exports.ranges();
    let mapped: Vec<u64> = (0..ranges.len() as u64).map(|k| k << 44).collect();
    // inside mapping k: [k << 44, (k << 44) + size), the size within the mapping's 2^44 bytes
    let inside = |at: u64, len: u64| {
        mapped.iter().zip(&ranges).any(|(&m, &(_, size))| size < 1 << 44 && m <= at && at + len <= m + size)
    };
    let segs = layout.segments();
    let mut runs = Vec::new();
    if plan_copies(layout, &offer.segments, &ranges, &mapped, &offer.blocks, &dst[..offer.blocks.len()], &mut runs)
        .is_ok()
    {
        for &(_, from, len) in &runs {
            // a run may join pieces of several mappings only when they touch, and they never do
            assert!(inside(from, len) || ranges.iter().any(|r| r.1 >= 1 << 44), "a run reads outside the mappings");
        }
    }
    let mut table = Vec::new();
    if plan_segments(&offer.segments, &ranges, &mapped, &offer.blocks, &mut table) {
        assert_eq!(table.len(), segs.len());
        for &(id, _) in &offer.blocks {
            for (&(here, stride), g) in table.iter().zip(segs) {
                let at = here.wrapping_add(u64::from(id).wrapping_mul(stride));
                assert!(
                    inside(at, g.bytes_per_block) || ranges.iter().any(|r| r.1 >= 1 << 44),
                    "the kernel would read block {id} outside the mappings"
                );
            }
        }
    }
}

/// A source allocation: the source's host id, process id and the allocation's IPC handle (for
/// a virtual-memory range: [`vmm_key`]).
type MappedKey = ([u8; 16], u32, [u8; 64]);

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
    /// A virtual-memory range's size (`None`: a CUDA IPC mapping).
    vmm: Option<u64>,
    /// Whether its source process showed in this process's `/proc` when it was mapped (one in
    /// another PID namespace does not: its mapping is then kept until the agent stops, never
    /// let go and made again at every look).
    watched: bool,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: mapped by `CudaIpc::map` on this device (`ipc_open`, or `vmm_map` of `size`
        // bytes); the last user let go (every copy through it synchronized before its fetch
        // dropped its reference).
        let _ = unsafe {
            match self.vmm {
                None => self.dev.ipc_close(self.ptr),
                Some(size) => self.dev.vmm_unmap(self.ptr, size),
            }
        };
    }
}

/// Whether process `pid` of this host still runs (its `/proc` entry; a zombie counts as
/// running until reaped). Only asked of a process that showed there when it was mapped.
fn process_runs(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// This instance's exported pool, and the source allocations it mapped.
pub(in crate::agent) struct CudaIpc {
    dev: Arc<CudaDevice>,
    device: i32,
    host: [u8; 16],
    pid: u32,
    /// The offer metadata this source sends (its host, process and exports), encoded once.
    metadata: Vec<u8>,
    /// Source allocations mapped here, by source.
    mapped: Mutex<HashMap<MappedKey, Arc<Mapping>>>,
    /// Entries of `mapped` whose source process can be looked at (`Mapping::watched`), read
    /// without the lock by the fetch workers' idle loop: only those can be let go by a sweep.
    watched_now: AtomicUsize,
    /// Where destinations get the descriptors of this pool's virtual-memory allocations (when
    /// it has any); stops with the agent.
    _fds: Option<vmm_fds::FdServer>,
}

impl CudaIpc {
    /// Export the allocations `layout`'s segments lie in.
    ///
    /// # Safety
    /// As [`crate::agent::Agent::new`]: the layout's blocks are memory of `device`, valid for
    /// the agent's life.
    pub(in crate::agent) unsafe fn new(layout: &KvLayout, device: Option<i32>) -> Result<CudaIpc, String> {
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
        let metadata = encode_exports(&Exports { host, pid, allocs, vmm });
        Ok(CudaIpc {
            dev,
            device,
            host,
            pid,
            metadata,
            mapped: Mutex::new(HashMap::new()),
            watched_now: AtomicUsize::new(0),
            _fds: server,
        })
    }

    /// The base address here of each of `e`'s ranges ([`Exports::ranges`]: mapped once per
    /// source process and kept until that process goes; within this process, the addresses
    /// themselves), and the mappings to hold until the copies through them synchronized. A
    /// source's virtual-memory ranges not mapped yet take its descriptors first, over its
    /// socket, by `deadline`.
    fn map(&self, inner: &Inner, e: &Exports, deadline: Instant) -> Result<(Vec<u64>, Vec<Arc<Mapping>>), Failure> {
        if e.pid == self.pid && e.host == self.host {
            return Ok((e.ranges().iter().map(|r| r.0).collect(), Vec::new()));
        }
        // the source's virtual-memory ranges: when any is not mapped yet, its descriptors are
        // taken and imported first, without the table's lock (the source's socket may be slow)
        let vmm_keys: Vec<(MappedKey, u64)> = e.vmm.as_ref().map_or_else(Vec::new, |v| {
            v.ranges
                .iter()
                .map(|(b, sizes)| {
                    let total = sizes.iter().sum::<u64>();
                    ((e.host, e.pid, vmm_key(*b, total, &v.token)), total)
                })
                .collect()
        });
        let mut handles: Vec<VmmHandle> = Vec::new();
        if let Some(v) = &e.vmm {
            let missing = {
                let m = self.mapped.lock().unwrap_or_else(|p| p.into_inner());
                vmm_keys.iter().any(|(k, _)| !m.contains_key(k))
            };
            if missing {
                if !vmm_fds::is_socket_of(&v.socket, e.pid) {
                    return Err((FailReason::Corrupt, "CUDA IPC: the offer names another process's socket".into()));
                }
                handles.reserve(v.chunks());
                let by = inner.io_deadline().min(deadline);
                vmm_fds::receive(&v.socket, &v.token, v.chunks(), by, |fd| {
                    // SAFETY: a descriptor the source process of this host sent as one of its
                    // exported allocations (the driver refuses any other file).
                    let h = unsafe { self.dev.vmm_import(std::os::fd::AsFd::as_fd(&fd)) }.map_err(|e| e.to_string())?;
                    handles.push(h);
                    Ok(())
                })
                .map_err(|err| {
                    (FailReason::Connect, format!("CUDA IPC: the source's virtual-memory descriptors: {err}"))
                })?;
            }
        }
        let mut m = self.mapped.lock().unwrap_or_else(|p| p.into_inner());
        let vmm_ranges = vmm_keys.len();
        let mut out = Vec::with_capacity(e.allocs.len() + vmm_ranges);
        let mut held = Vec::with_capacity(e.allocs.len() + vmm_ranges);
        let mut added = false;
        let room = |m: &mut HashMap<MappedKey, Arc<Mapping>>| {
            if m.len() >= MAX_MAPPED {
                self.sweep_locked(inner, m);
            }
            if m.len() >= MAX_MAPPED {
                return Err((FailReason::Refused, format!("CUDA IPC: {MAX_MAPPED} source allocations mapped already")));
            }
            Ok(())
        };
        let watched = process_runs(e.pid);
        for a in &e.allocs {
            let key = (e.host, e.pid, a.handle);
            if let Some(p) = m.get(&key) {
                out.push(p.ptr);
                held.push(p.clone());
                continue;
            }
            room(&mut m)?;
            // SAFETY: a handle another process of this host exported (the driver refuses one
            // it does not know); the mapping is kept until that process goes or the agent stops.
            let ptr = unsafe { self.dev.ipc_open(&a.handle) }
                .map_err(|err| (FailReason::Connect, format!("CUDA IPC: mapping the source's memory: {err}")))?;
            // the copy plans trust the size the source reported: the driver's own must cover it
            match self.dev.address_range(ptr) {
                Ok((base, size)) if base == ptr && size >= a.size => {}
                got => {
                    // SAFETY: mapped just above, used by nothing yet.
                    let _ = unsafe { self.dev.ipc_close(ptr) };
                    return Err((
                        FailReason::Corrupt,
                        format!("CUDA IPC: the source offers {} bytes of an allocation that maps as {got:?} here", a.size),
                    ));
                }
            }
            let p = Arc::new(Mapping { dev: self.dev.clone(), ptr, vmm: None, watched });
            m.insert(key, p.clone());
            added = true;
            out.push(ptr);
            held.push(p);
        }
        if let Some(v) = &e.vmm {
            let mut at = 0;
            for ((base, sizes), (key, total)) in v.ranges.iter().zip(&vmm_keys) {
                let hs = handles.get(at..at + sizes.len());
                at += sizes.len();
                if let Some(p) = m.get(key) {
                    out.push(p.ptr);
                    held.push(p.clone());
                    continue;
                }
                // mapped when this fetch looked, let go since (a sweep): take it up again next time
                let Some(hs) = hs else {
                    return Err((FailReason::Connect, "CUDA IPC: the source's range was let go meanwhile".into()));
                };
                room(&mut m)?;
                // SAFETY: handles imported just above, each with the size its source exported
                // it with (a source that lies is refused by the driver, or maps less than it
                // offers: agents of one host are one trust domain, module docs); kept until
                // that process goes or the agent stops.
                let ptr = unsafe { self.dev.vmm_map(hs, sizes) }.map_err(|err| {
                    (FailReason::Connect, format!("CUDA IPC: mapping the source's range at {base:#x}: {err}"))
                })?;
                let p = Arc::new(Mapping { dev: self.dev.clone(), ptr, vmm: Some(*total), watched });
                m.insert(*key, p.clone());
                added = true;
                out.push(ptr);
                held.push(p);
            }
        }
        if added {
            self.count(inner, &m);
        }
        Ok((out, held))
    }

    /// Drop the mappings of source processes that no longer run (each unmapped once no fetch
    /// holds it).
    fn sweep_locked(&self, inner: &Inner, m: &mut HashMap<MappedKey, Arc<Mapping>>) {
        let before = m.len();
        let mut gone: Vec<u32> = Vec::new();
        m.retain(|&(_, pid, _), mapping| {
            if !mapping.watched {
                return true;
            }
            if gone.contains(&pid) {
                return false;
            }
            let runs = process_runs(pid);
            if !runs {
                gone.push(pid);
            }
            runs
        });
        if m.len() < before {
            Stats::add(&inner.stats.ipc_unmapped, (before - m.len()) as u64);
            self.count(inner, m);
        }
    }

    /// After the table changed: the gauge of mappings, and how many of them a sweep can let go.
    fn count(&self, inner: &Inner, m: &HashMap<MappedKey, Arc<Mapping>>) {
        self.watched_now.store(m.values().filter(|p| p.watched).count(), Ordering::Relaxed);
        inner.stats.ipc_mapped_now.store(m.len() as u64, Ordering::Relaxed);
    }
}

impl Drop for CudaIpc {
    fn drop(&mut self) {
        // the agent's threads are joined: no fetch holds a mapping any more, and each unmaps
        // as the table drops it
        self.mapped.get_mut().unwrap_or_else(|e| e.into_inner()).clear();
    }
}

impl Backend for CudaIpc {
    fn hello(&self) -> u8 {
        wire::IPC_HELLO
    }

    /// One: a copy engine moves a whole run.
    fn streams(&self, _inner: &Inner, _blocks: usize) -> usize {
        1
    }

    fn movers_at_start(&self, _limits: &Limits) -> usize {
        1
    }

    fn default_speed(&self, _device_pool: bool) -> SourceSpeed {
        CUDA_IPC_DEFAULT
    }

    fn pull(
        &self,
        inner: &Inner,
        c: &mut dyn Conn,
        job: &mut Pull<'_>,
        land: &mut Landing<'_>,
    ) -> Result<bool, Failure> {
        let scratch = &mut *job.scratch;
        let offer = read_in_place_offer(
            inner,
            c,
            wire::IPC_OFFER,
            Some(AGENT),
            job.asked.len(),
            job.deadline,
            &mut scratch.buf,
            land,
        )?;
        let r = (|| {
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
            if offer.blocks.is_empty() {
                return Err((FailReason::SourceMiss, "the source holds none of the blocks".to_string()));
            }
            let (mapped, _held) = self.map(inner, &exports, job.deadline).inspect_err(|e| {
                // memory this process cannot map (another IPC namespace, say): TCP may do
                land.unusable = e.0 == FailReason::Connect;
            })?;
            let count = offer.blocks.len();
            // one kernel that copies and sums where every segment's blocks lie in one exported
            // allocation (the usual pool); else one copy per contiguous run, then the sums
            let ranges = exports.ranges();
            let fused = plan_segments(&offer.segments, &ranges, &mapped, &offer.blocks, &mut scratch.segs);
            if !fused {
                plan_copies(
                    &inner.layout,
                    &offer.segments,
                    &ranges,
                    &mapped,
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
                *job.mover = Some(unsafe { inner.movers.take(&inner.layout) }.map_err(|e| (FailReason::Corrupt, e))?);
            }
            let mover = job.mover.as_mut().expect("set above");
            let ids = &job.dst[..count];
            scratch.sums.clear();
            scratch.sums.resize(count, 0);
            let copied = if fused {
                scratch.ids.clear();
                scratch.ids.extend(offer.blocks.iter().map(|b| b.0));
                // SAFETY: the destinations are this fetch's blocks; every offered block's
                // segment lies inside an allocation the source exported (`plan_segments`),
                // mapped and held here (`_held`), and pinned at the source until our DONE.
                unsafe { mover.copy_sum_from(&scratch.segs, &scratch.ids, ids, &mut scratch.sums) }
            } else {
                // SAFETY: every run's destination is one of this fetch's blocks; every source
                // range lies inside an allocation the source exported (`plan_copies`), mapped
                // and held here, pinned until our DONE.
                unsafe { mover.copy_in_and_sum(&scratch.runs, ids, &mut scratch.sums) }
            };
            if let Err(e) = copied {
                *job.mover = None; // a mover whose stream failed is not reused
                return Err((FailReason::Truncated, format!("CUDA IPC copy: {e}")));
            }
            for (i, &sum) in scratch.sums.iter().enumerate() {
                Landing::check(i, sum, offer.blocks[i].1)?;
                land.landed(i, sum);
            }
            Ok(())
        })();
        send_done(inner, c, land.blocks);
        r.map(|()| true)
    }

    fn serve(&self, inner: &Inner, c: &mut dyn Conn, ids: &[u32], _names: &[u64]) -> bool {
        super::serve_in_place(inner, c, ids, wire::IPC_OFFER, AGENT, &self.metadata, Some(self.device))
    }

    /// While memory of other processes that can be looked at is mapped here: the fetch
    /// workers look every 50 ms whether those processes still run (mappings of a source in
    /// another PID namespace alone wake nobody: no sweep could let them go).
    fn wants_reap(&self) -> bool {
        self.watched_now.load(Ordering::Relaxed) > 0
    }

    fn reap(&self, inner: &Inner) {
        let mut m = self.mapped.lock().unwrap_or_else(|p| p.into_inner());
        self.sweep_locked(inner, &mut m);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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

    fn export(base: u64, size: u64, tag: u8) -> IpcExport {
        IpcExport { handle: [tag; 64], base, size }
    }

    #[test]
    fn exports_round_trip_and_refuse_garbage() {
        let e = Exports {
            host: [7; 16],
            pid: 42,
            allocs: vec![export(0x1000, 0x4000, 1), export(0x9000, 0x100, 2)],
            vmm: None,
        };
        let p = encode_exports(&e);
        assert_eq!(decode_exports(&p), Some(e));
        assert_eq!(decode_exports(&p[..p.len() - 1]), None, "short");
        assert_eq!(decode_exports(&[p.as_slice(), &[0]].concat()), None, "long");
        let mut none = p.clone();
        none[20..24].copy_from_slice(&0u32.to_le_bytes());
        assert_eq!(decode_exports(&none[..24]), None, "no allocation");
        let mut wrap =
            encode_exports(&Exports { host: [0; 16], pid: 1, allocs: vec![export(u64::MAX - 4, 8, 0)], vmm: None });
        assert_eq!(decode_exports(&wrap), None, "an end past u64");
        wrap[20..24].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode_exports(&wrap), None, "a count past the limit");
        assert_eq!(decode_exports(&[]), None);
    }

    /// The virtual-memory section: round trip (alone and beside CUDA IPC allocations), its
    /// ranges as the plans see them, and every malformed variant refused.
    #[test]
    fn virtual_memory_exports_round_trip_and_refuse_garbage() {
        let vmm = VmmOffer {
            socket: b"kvrelay-cuda-ipc-1-00".to_vec(),
            token: [5; vmm_fds::TOKEN],
            ranges: vec![(0x10_0000, vec![0x20_0000, 0x40_0000]), (0x100_0000, vec![0x20_0000])],
        };
        let e = Exports { host: [1; 16], pid: 9, allocs: vec![export(0x1000, 0x4000, 1)], vmm: Some(vmm) };
        let p = encode_exports(&e);
        let d = decode_exports(&p).unwrap();
        assert_eq!(d, e);
        assert_eq!(d.ranges(), vec![(0x1000, 0x4000), (0x10_0000, 0x60_0000), (0x100_0000, 0x20_0000)]);
        assert_eq!(d.vmm.as_ref().unwrap().chunks(), 3);
        // no CUDA IPC allocation, only virtual memory: fine
        let only = Exports { allocs: vec![], ..decode_exports(&p).unwrap() };
        assert_eq!(decode_exports(&encode_exports(&only)), Some(only));
        // neither: refused
        assert_eq!(decode_exports(&encode_exports(&Exports { allocs: vec![], vmm: None, ..d })), None);
        // cut anywhere in the section, or one byte more: refused
        let ipc_end = 24 + EXPORT_BYTES;
        for cut in ipc_end + 1..p.len() {
            assert_eq!(decode_exports(&p[..cut]), None, "cut at {cut}");
        }
        assert_eq!(decode_exports(&[p.as_slice(), &[0]].concat()), None);
        let at_ranges = ipc_end;
        let at_socket_len = at_ranges + 4 + vmm_fds::TOKEN;
        let at_first_range = at_socket_len + 2 + 21;
        let patch = |at: usize, bytes: &[u8]| {
            let mut q = p.clone();
            q[at..at + bytes.len()].copy_from_slice(bytes);
            decode_exports(&q)
        };
        assert_eq!(patch(at_ranges, &0u32.to_le_bytes()), None, "no range");
        assert_eq!(patch(at_socket_len, &0u16.to_le_bytes()), None, "no socket name");
        assert_eq!(patch(at_first_range + 8, &0u32.to_le_bytes()), None, "a range of no allocation");
        assert_eq!(patch(at_first_range + 12, &0u64.to_le_bytes()), None, "an allocation of no bytes");
        assert_eq!(patch(at_first_range, &u64::MAX.to_le_bytes()), None, "a range past u64");
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
            blocks: vec![(6, 1), (7, 2)],
        };
        let good = wire::encode_in_place_offer(&offer(8 * 512));
        check_offer_plans(&l, &good, 2, &[0, 1]);
        let e = decode_exports(&offer(8 * 512).metadata).unwrap();
        let mapped: Vec<u64> = (0..e.ranges().len() as u64).map(|k| k << 44).collect();
        let mut segs = Vec::new();
        assert!(plan_segments(&offer(8 * 512).segments, &e.ranges(), &mapped, &[(6, 1), (7, 2)], &mut segs));
        assert_eq!(segs[0].0.wrapping_add(6 * 512), 6 * 512, "block 6 read at its offset in mapping 0");
        // the export ends inside block 7: neither plan takes the offer
        let short = offer(7 * 512 + 100);
        let e = decode_exports(&short.metadata).unwrap();
        assert!(!plan_segments(&short.segments, &e.ranges(), &mapped, &short.blocks, &mut segs));
        let mut runs = Vec::new();
        assert!(plan_copies(&l, &short.segments, &e.ranges(), &mapped, &short.blocks, &[0, 1], &mut runs).is_err());
        check_offer_plans(&l, &wire::encode_in_place_offer(&short), 2, &[0, 1]);
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
        plan_copies(&l, &src, &allocs, &mapped, &[(2, 0), (3, 0)], &[5, 6], &mut runs).unwrap();
        assert_eq!(runs, vec![(0x10000 + 5 * 512, 0x500_0000 + 2 * 512, 1024)]);
        // out of order: one run per block
        plan_copies(&l, &src, &allocs, &mapped, &[(3, 0), (2, 0)], &[5, 6], &mut runs).unwrap();
        assert_eq!(runs.len(), 2);
        // a block past the exported allocation is refused before any address is used
        let e = plan_copies(&l, &src, &allocs, &mapped, &[(8, 0)], &[0], &mut runs).unwrap_err();
        assert!(e.contains("outside the memory the source exported"), "{e}");
        // an address that overflows
        let bad = [(u64::MAX - 100, 512u64, 256u64), (0x80100, 512, 256)];
        let e = plan_copies(&l, &bad, &allocs, &mapped, &[(1, 0)], &[0], &mut runs).unwrap_err();
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
        assert!(plan_segments(&src, &allocs, &mapped, &[(2, 0), (7, 0), (0, 0)], &mut segs));
        assert_eq!(segs, vec![(0x500_0000, 512), (0x500_0100, 512)]);
        // a block past the export (block 8 ends at 0x81100 > 0x81000): refused, whichever order
        assert!(!plan_segments(&src, &allocs, &mapped, &[(8, 0), (0, 0)], &mut segs));
        assert!(segs.len() < 2, "no table for a refused offer");
        // the segments in two allocations: each is translated by its own mapping
        let split = [(0x80000u64, 512u64, 256u64), (0x90000, 512, 256)];
        let two = [(0x80000u64, 8 * 512u64), (0x90000, 8 * 512)];
        assert!(plan_segments(&split, &two, &[0x100_0000, 0x700_0000], &[(0, 0), (7, 0)], &mut segs));
        assert_eq!(segs, vec![(0x100_0000, 512), (0x700_0000, 512)]);
        // one segment's blocks spread over two allocations: no single table (run by run instead)
        let spread = [(0x80000u64, 4 * 512u64), (0x80000 + 4 * 512, 4 * 512)];
        assert!(!plan_segments(&src, &spread, &[0x100_0000, 0x200_0000], &[(1, 0), (6, 0)], &mut segs));
        // a base before the allocation is fine when the offered blocks are inside (modular)
        let late = [(0x80000u64 + 2 * 512, 6 * 512u64)];
        assert!(plan_segments(&src, &late, &[0x900_0000], &[(2, 0), (7, 0)], &mut segs));
        assert_eq!(segs[0].0.wrapping_add(2 * 512), 0x900_0000);
        // misaligned: an odd base or stride is never handed to the 16-byte kernel
        let odd = [(0x80008u64, 512u64, 256u64), (0x80108, 512, 256)];
        assert!(!plan_segments(&odd, &allocs, &mapped, &[(0, 0)], &mut segs));
        let odd_stride = [(0x80000u64, 520u64, 256u64), (0x80100, 520, 256)];
        assert!(!plan_segments(&odd_stride, &[(0x80000u64, 8 * 520u64)], &mapped, &[(1, 0)], &mut segs));
        // overflow and an empty offer
        let huge = [(u64::MAX - 100, 512u64, 256u64), (0x80100, 512, 256)];
        assert!(!plan_segments(&huge, &allocs, &mapped, &[(1, 0)], &mut segs));
        assert!(!plan_segments(&src, &allocs, &mapped, &[], &mut segs));
    }
}
