//! The agent's same-host GPU transport ([`crate::agent::Transport::CudaIpc`]): when both agents
//! run on one host and their pools are device memory, the destination copies the source's
//! pinned blocks straight out of the source's pool into its own, device to device, and the
//! checksum kernel verifies them where they landed. Control (the handshake, authentication,
//! the offer, the end) stays on the agent's TCP connection.
//!
//! - **Start.** The agent exports each allocation its pool's segments lie in once
//!   (`cuIpcGetMemHandle`; memory from `cuMemAlloc`/`cudaMalloc`, what caching allocators hand
//!   out). Memory of the virtual memory API (`cuMemCreate`) or of a stream-ordered pool
//!   (`cudaMallocAsync`) cannot be exported that way: [`crate::agent::Agent::new`] then fails
//!   with that reason (POSIX file-descriptor handles for such memory are a later step). A
//!   host pool is refused: this transport moves device memory only.
//! - **A fetch.** The destination sends `IPC_HELLO`. The source pins the leading run it holds,
//!   as over TCP, and answers `IPC_OFFER`: an in-place offer (its segment table and, per
//!   offered block, its id and the checksum recorded when it became reusable) whose metadata
//!   is the source's host id (the kernel's boot id), process id and exported allocations. The
//!   destination checks the offer against its own layout, refuses a source on another host,
//!   maps each of the source's allocations once (`cuIpcOpenMemHandle`, kept until the agent
//!   stops, or until the source process no longer runs; within one process the addresses are
//!   used as they are), checks that every offered block lies inside an exported allocation,
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
//!   share a host under one trust domain. Across two GPUs of a host the same copies go over
//!   peer access (NVLink where present); multi-node NVLink fabric handles
//!   (`CU_MEM_HANDLE_TYPE_FABRIC`, memory from `cuMemCreate` with that handle type, exported
//!   with `cuMemExportToShareableHandle` and imported by the peer's IMEX channel) are a later
//!   step.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::{read_in_place_offer, send_done, Backend, Failure, Landing, Pull};
use crate::agent::estimate::{SourceSpeed, CUDA_IPC_DEFAULT};
use crate::agent::wire::{self, Conn};
use crate::agent::{FailReason, Inner, Limits, Stats};
use crate::copy::{CudaDevice, IpcExport, KvLayout};

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
    allocs: Vec<IpcExport>,
}

/// `host (16) | pid u32 | count u32 | count x (handle 64 | base u64 | size u64)`.
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
    p
}

/// Decode an offer's metadata; `None` unless it decodes exactly, within [`MAX_EXPORTS`], and
/// no allocation's end overflows.
pub(crate) fn decode_exports(p: &[u8]) -> Option<Exports> {
    let head = p.get(..24)?;
    let n = u32::from_le_bytes(head[20..24].try_into().ok()?) as usize;
    if n == 0 || n > MAX_EXPORTS || p.len() != 24 + EXPORT_BYTES * n {
        return None;
    }
    let mut allocs = Vec::with_capacity(n);
    for r in p[24..].chunks_exact(EXPORT_BYTES) {
        let handle: [u8; 64] = r[..64].try_into().ok()?;
        let base = u64::from_le_bytes(r[64..72].try_into().ok()?);
        let size = u64::from_le_bytes(r[72..80].try_into().ok()?);
        base.checked_add(size)?;
        allocs.push(IpcExport { handle, base, size });
    }
    Some(Exports { host: head[..16].try_into().ok()?, pid: u32::from_le_bytes(head[16..20].try_into().ok()?), allocs })
}

/// The device-to-device copies that move offered blocks `blocks` (source ids) into `dst`:
/// `(dst address, source address, bytes)` runs, pieces contiguous at both ends merged. Every
/// source piece must lie inside one of `allocs` (source addresses), mapped here at `mapped[k]`;
/// `Err` names the first that does not. Pure: what a hostile source sends is checked here
/// before any address is used.
pub(crate) fn plan_copies(
    layout: &KvLayout,
    src_segments: &[(u64, u64, u64)],
    allocs: &[IpcExport],
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
            let k = allocs
                .iter()
                .position(|a| a.base <= at && at + len <= a.base + a.size)
                .ok_or_else(|| format!("block {i}, segment {s}: outside the memory the source exported"))?;
            let from = mapped[k] + (at - allocs[k].base);
            let to = m.base + u64::from(d) * m.block_stride;
            run = match run {
                Some((rt, rf, n)) if rt + n == to && rf + n == from => Some((rt, rf, n + len)),
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
/// base translated to where the source's memory is mapped here (`mapped[k]` for `allocs[k]`)
/// and its stride. `false` when a segment's offered blocks do not all lie inside one exported
/// allocation, or a translated base or a stride is not a multiple of 16 bytes: the caller then
/// copies run by run ([`plan_copies`], which checks every piece). Pure: nothing the source sent
/// is used as an address unless it passed here.
pub(crate) fn plan_segments(
    src_segments: &[(u64, u64, u64)],
    allocs: &[IpcExport],
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
        let Some(k) = allocs.iter().position(|a| a.base <= lo && hi <= a.base + a.size) else {
            return false;
        };
        // modulo 2^64, as the kernel adds id * stride: base + id * stride lands at
        // mapped[k] + (its offset in the allocation), inside the mapping
        let here = mapped[k].wrapping_add(base.wrapping_sub(allocs[k].base));
        if here % 16 != 0 || stride % 16 != 0 {
            return false;
        }
        out.push((here, stride));
    }
    true
}

/// A source allocation: the source's host id, process id and the allocation's IPC handle.
type MappedKey = ([u8; 16], u32, [u8; 64]);

/// One source allocation mapped here; unmapped when the last fetch using it lets go after the
/// table dropped it (its source went, or the agent stops).
struct Mapping {
    dev: Arc<CudaDevice>,
    ptr: u64,
    /// Whether its source process showed in this process's `/proc` when it was mapped (one in
    /// another PID namespace does not: its mapping is then kept until the agent stops, never
    /// let go and made again at every look).
    watched: bool,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: mapped by `CudaIpc::map` on this device; the last user let go (every copy
        // through it synchronized before its fetch dropped its reference).
        let _ = unsafe { self.dev.ipc_close(self.ptr) };
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
        let last = u64::from(layout.num_blocks().saturating_sub(1));
        for (s, g) in layout.segments().iter().enumerate() {
            let end = g.base + last * g.block_stride + g.bytes_per_block;
            if let Some(a) = allocs.iter().find(|a| a.base <= g.base && end <= a.base + a.size) {
                let _ = a;
                continue;
            }
            let e = dev.ipc_export(g.base).map_err(|e| {
                format!(
                    "CUDA IPC: segment {s}'s memory cannot be exported ({e}): memory from cuMemAlloc/cudaMalloc can, \
                     memory from cuMemCreate or cudaMallocAsync cannot; use the TCP or NIXL transport"
                )
            })?;
            if end > e.base + e.size {
                return Err(format!("CUDA IPC: segment {s} runs past the allocation it starts in"));
            }
            allocs.push(e);
        }
        let pid = std::process::id();
        let metadata = encode_exports(&Exports { host, pid, allocs });
        Ok(CudaIpc {
            dev,
            device,
            host,
            pid,
            metadata,
            mapped: Mutex::new(HashMap::new()),
            watched_now: AtomicUsize::new(0),
        })
    }

    /// The base address here of each of `e`'s allocations (mapped once per source process and
    /// kept until that process goes; within this process, the addresses themselves), and the
    /// mappings to hold until the copies through them synchronized.
    fn map(&self, inner: &Inner, e: &Exports) -> Result<(Vec<u64>, Vec<Arc<Mapping>>), Failure> {
        if e.pid == self.pid && e.host == self.host {
            return Ok((e.allocs.iter().map(|a| a.base).collect(), Vec::new()));
        }
        let mut m = self.mapped.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = Vec::with_capacity(e.allocs.len());
        let mut held = Vec::with_capacity(e.allocs.len());
        let mut added = false;
        for a in &e.allocs {
            let key = (e.host, e.pid, a.handle);
            if let Some(p) = m.get(&key) {
                out.push(p.ptr);
                held.push(p.clone());
                continue;
            }
            if m.len() >= MAX_MAPPED {
                self.sweep_locked(inner, &mut m);
            }
            if m.len() >= MAX_MAPPED {
                return Err((FailReason::Refused, format!("CUDA IPC: {MAX_MAPPED} source allocations mapped already")));
            }
            // SAFETY: a handle another process of this host exported (the driver refuses one
            // it does not know); the mapping is kept until that process goes or the agent stops.
            let ptr = unsafe { self.dev.ipc_open(&a.handle) }
                .map_err(|err| (FailReason::Connect, format!("CUDA IPC: mapping the source's memory: {err}")))?;
            let p = Arc::new(Mapping { dev: self.dev.clone(), ptr, watched: process_runs(e.pid) });
            m.insert(key, p.clone());
            added = true;
            out.push(ptr);
            held.push(p);
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
            let (mapped, _held) = self.map(inner, &exports).inspect_err(|e| {
                // memory this process cannot map (another IPC namespace, say): TCP may do
                land.unusable = e.0 == FailReason::Connect;
            })?;
            let count = offer.blocks.len();
            // one kernel that copies and sums where every segment's blocks lie in one exported
            // allocation (the usual pool); else one copy per contiguous run, then the sums
            let fused = plan_segments(&offer.segments, &exports.allocs, &mapped, &offer.blocks, &mut scratch.segs);
            if !fused {
                plan_copies(
                    &inner.layout,
                    &offer.segments,
                    &exports.allocs,
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

    fn export(base: u64, size: u64, tag: u8) -> IpcExport {
        IpcExport { handle: [tag; 64], base, size }
    }

    #[test]
    fn exports_round_trip_and_refuse_garbage() {
        let e = Exports { host: [7; 16], pid: 42, allocs: vec![export(0x1000, 0x4000, 1), export(0x9000, 0x100, 2)] };
        let p = encode_exports(&e);
        assert_eq!(decode_exports(&p), Some(e));
        assert_eq!(decode_exports(&p[..p.len() - 1]), None, "short");
        assert_eq!(decode_exports(&[p.as_slice(), &[0]].concat()), None, "long");
        let mut none = p.clone();
        none[20..24].copy_from_slice(&0u32.to_le_bytes());
        assert_eq!(decode_exports(&none[..24]), None, "no allocation");
        let mut wrap = encode_exports(&Exports { host: [0; 16], pid: 1, allocs: vec![export(u64::MAX - 4, 8, 0)] });
        assert_eq!(decode_exports(&wrap), None, "an end past u64");
        wrap[20..24].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode_exports(&wrap), None, "a count past the limit");
        assert_eq!(decode_exports(&[]), None);
    }

    #[test]
    fn copies_merge_contiguous_runs_and_stay_inside_the_exports() {
        // destination: two segments (K, V) of 256 bytes, block-major strides of 512
        let l = KvLayout::new(
            8,
            vec![
                Segment { base: 0x10000, block_stride: 512, bytes_per_block: 256 },
                Segment { base: 0x10100, block_stride: 512, bytes_per_block: 256 },
            ],
            &[],
        )
        .unwrap();
        // the source: the same shape at 0x80000, exported as one allocation mapped at 0x5000000
        let src = [(0x80000u64, 512u64, 256u64), (0x80100, 512, 256)];
        let allocs = [export(0x80000, 8 * 512, 9)];
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
        let allocs = [export(0x80000, 8 * 512, 9)];
        let mapped = [0x500_0000u64];
        let mut segs = Vec::new();
        assert!(plan_segments(&src, &allocs, &mapped, &[(2, 0), (7, 0), (0, 0)], &mut segs));
        assert_eq!(segs, vec![(0x500_0000, 512), (0x500_0100, 512)]);
        // a block past the export (block 8 ends at 0x81100 > 0x81000): refused, whichever order
        assert!(!plan_segments(&src, &allocs, &mapped, &[(8, 0), (0, 0)], &mut segs));
        assert!(segs.len() < 2, "no table for a refused offer");
        // the segments in two allocations: each is translated by its own mapping
        let split = [(0x80000u64, 512u64, 256u64), (0x90000, 512, 256)];
        let two = [export(0x80000, 8 * 512, 1), export(0x90000, 8 * 512, 2)];
        assert!(plan_segments(&split, &two, &[0x100_0000, 0x700_0000], &[(0, 0), (7, 0)], &mut segs));
        assert_eq!(segs, vec![(0x100_0000, 512), (0x700_0000, 512)]);
        // one segment's blocks spread over two allocations: no single table (run by run instead)
        let spread = [export(0x80000, 4 * 512, 1), export(0x80000 + 4 * 512, 4 * 512, 2)];
        assert!(!plan_segments(&src, &spread, &[0x100_0000, 0x200_0000], &[(1, 0), (6, 0)], &mut segs));
        // a base before the allocation is fine when the offered blocks are inside (modular)
        let late = [export(0x80000 + 2 * 512, 6 * 512, 3)];
        assert!(plan_segments(&src, &late, &[0x900_0000], &[(2, 0), (7, 0)], &mut segs));
        assert_eq!(segs[0].0.wrapping_add(2 * 512), 0x900_0000);
        // misaligned: an odd base or stride is never handed to the 16-byte kernel
        let odd = [(0x80008u64, 512u64, 256u64), (0x80108, 512, 256)];
        assert!(!plan_segments(&odd, &allocs, &mapped, &[(0, 0)], &mut segs));
        let odd_stride = [(0x80000u64, 520u64, 256u64), (0x80100, 520, 256)];
        assert!(!plan_segments(&odd_stride, &[export(0x80000, 8 * 520, 9)], &mapped, &[(1, 0)], &mut segs));
        // overflow and an empty offer
        let huge = [(u64::MAX - 100, 512u64, 256u64), (0x80100, 512, 256)];
        assert!(!plan_segments(&huge, &allocs, &mapped, &[(1, 0)], &mut segs));
        assert!(!plan_segments(&src, &allocs, &mapped, &[], &mut segs));
    }
}
