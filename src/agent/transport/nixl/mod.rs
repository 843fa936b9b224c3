//! The agent's NIXL transport (cargo feature `nixl`, [`crate::agent::Transport::Nixl`]): block bytes
//! move with NIXL over UCX (RDMA, CUDA IPC, CMA, TCP: whatever UCX finds between the two
//! instances), straight from the source's pool into the destination's blocks; control (the
//! handshake, authentication included, the offer, the end) stays on the agent's TCP connection.
//!
//! - **Start.** [`load_library`] opens `libnixl_capi.so` (from the configured folder, else the
//!   loader's search path) and checks every entry point `nixl-sys` may call, so a missing or
//!   mismatched library fails [`crate::agent::Agent::new`] with a message, never a transfer. One NIXL
//!   agent with the UCX backend then registers the pool once: the extents of its segments,
//!   merged where they touch or overlap (host memory as DRAM, a device pool as VRAM of its
//!   device). Nothing is registered per fetch.
//! - **A fetch.** The destination sends `NIXL_HELLO` (the hello's payload). The source pins the
//!   leading run it holds, as over TCP, and answers `NIXL_OFFER`: its NIXL agent's name and
//!   metadata (loaded once per source agent and kept), its segment table, and for each offered
//!   block its id and the checksum recorded when it became reusable. The destination checks
//!   the offer against its own layout (the same segment sizes; ids inside the source's pool),
//!   posts READs from the source's blocks into its destination blocks, in requests of
//!   [`REQUEST_BYTES`] ([`REQUEST_BYTES_GPU`] into GPU memory), all posted at once. A request's
//!   descriptors are its pieces contiguous at both ends, merged block by block or segment by
//!   segment, whichever gives fewer: UCX pays per descriptor, and a pool of one segment per
//!   layer or head (8 KiB per block and segment in a static cache) moved at under 1 GB/s with a
//!   descriptor per piece. Where segment by segment gives fewer, the requests after the first
//!   grow until each descriptor carries [`DESCRIPTOR_BYTES`]. Then request by request in
//!   order the destination sums each block where it landed (host memory in place, GPU memory with
//!   the checksum kernel) and counts it verified when the sum matches. The first mismatch
//!   stops the fetch (`corrupt`). `DONE` tells the source how many blocks were taken; it then
//!   unpins them (or after its transfer deadline, when no `DONE` comes).
//! - **When a fetch ends early** (failure, cancel, deadline, or a panic anywhere in it) with
//!   READs still posted: the fetch, not this module, owns that (`transfer.rs` is the handle, in
//!   NIXL's own prepare/post/check/release shape). Each READ gets the `write_grace` limit (1 s
//!   by default) to finish or fail; one that still runs cannot be proven stopped, so the
//!   destination blocks after the verified ones (all of them after a panic) are **withheld**:
//!   the completion reports them (`FetchResult::withheld`), the runtime must not reuse them,
//!   and the agent hands them back through [`crate::agent::BlockHolder::returned`] once NIXL
//!   reports their READs over (checked by the fetch workers every 50 ms; at shutdown the READs
//!   are released before the NIXL agent goes), counted in `blocks_withheld` and
//!   `blocks_returned`. The source agent stays loaded while they run. Nothing is lost and
//!   nothing is reused under a write.
//! - **Staged transfers** (a GPU pool read through pinned host slots) are not part of the agent:
//!   UCX moves VRAM itself (CUDA IPC on one host, GPUDirect RDMA across hosts).

mod plan;
mod remotes;
mod transfer;

use std::ffi::CString;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use nixl_sys::{MemType, MemoryRegion, NixlDescriptor, RegistrationHandle, ThreadSync};

use super::{read_in_place_offer, send_done, Backend, Cx, Failure, Landing, Pull, Transfer};
use crate::agent::estimate::{SourceSpeed, NIXL_HOST_DEFAULT, NIXL_VRAM_DEFAULT};
use crate::agent::wire::{self, Conn};
use crate::agent::{FailReason, Limits, Stats};
use crate::copy::KvLayout;
use plan::slow_device_read;
use remotes::{LoadMark, Remotes, Step};

/// Bytes per NIXL request into host memory: the READs of a run are cut into requests of about
/// this size, all posted at once, verified in order while the later ones are in flight.
pub const REQUEST_BYTES: usize = 64 << 20;
/// Bytes per NIXL request into GPU memory: READs there run at 100+ GB/s and each request costs
/// a setup and a checksum kernel launch, so fewer, larger ones. (The requests after a fetch's
/// first may grow past it: [`DESCRIPTOR_BYTES`].)
pub const REQUEST_BYTES_GPU: usize = 256 << 20;
/// Bytes a descriptor should carry where a pool's pieces merge segment by segment (one segment
/// per layer or head): UCX pays per descriptor (about 10 us each on one H200), so such a fetch's
/// requests grow until each segment's descriptor holds this much, past [`REQUEST_BYTES_GPU`]
/// when need be.
pub const DESCRIPTOR_BYTES: usize = 4 << 20;
/// Largest NIXL agent metadata an offer may carry.
pub use crate::agent::wire::MAX_METADATA;

/// Every C entry point of `libnixl_capi.so` that `nixl-sys` 1.5.1 may call, one per line (its
/// stubs resolve each on first use and abort the process when one is missing, so all are
/// checked before the first call).
const ENTRY_POINTS: &str = include_str!("nixl_entry_points.txt");

/// Open `libnixl_capi.so` (from `dir` when given, else the loader's search path) and check its
/// entry points. The library stays loaded for the life of the process; `nixl-sys` then finds it
/// by its soname. Called by [`crate::agent::Agent::new`]; cheap after the first time.
pub fn load_library(dir: Option<&std::path::Path>) -> Result<(), String> {
    let path = match dir {
        Some(d) => d.join("libnixl_capi.so"),
        None => "libnixl_capi.so".into(),
    };
    let c = CString::new(path.to_string_lossy().as_bytes()).map_err(|_| "the NIXL library folder holds a NUL byte")?;
    // SAFETY: `c` is a NUL-terminated path; dlopen has no other precondition. Loading runs the
    // library's initializers, which is what using it means.
    let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if h.is_null() {
        return Err(format!(
            "NIXL: cannot load {}: {} (install the NIXL libraries, e.g. with scripts/nixl-env.sh, and name their \
             folder or put it on LD_LIBRARY_PATH)",
            path.display(),
            dlerror()
        ));
    }
    for name in ENTRY_POINTS.lines().filter(|l| !l.is_empty()) {
        let c = CString::new(name).map_err(|_| "an entry point name with a NUL byte")?;
        // SAFETY: `h` is a live handle from dlopen (never closed); `c` is NUL-terminated.
        if unsafe { libc::dlsym(h, c.as_ptr()) }.is_null() {
            return Err(format!(
                "NIXL: {} lacks `{name}`: a NIXL C API other than 1.5.1 (the version kvrelay was built against)",
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

/// UCX options the agent's NIXL backend starts with, as its `engine_config` (comma-separated
/// `KEY=VALUE`, UCX's names without `UCX_`). NIXL applies each only where the process's
/// environment does not set `UCX_KEY` itself, so a caller's setting always wins.
///
/// - `CUDA_IPC_ENABLE_GET_ZCOPY=y`: UCX turns CUDA-IPC GET zero-copy off where it detects no
///   NVLink (one GPU, or PCIe-only peers) and then emulates a READ of device memory in
///   software over TCP: 0.44 GB/s against 236 GB/s with it on, two processes on one H200
///   (`benches/RESULTS.md`). NIXL itself enables it in later releases.
///
/// A fetch of device memory into device memory that UCX emulates anyway runs at a few GB/s or
/// less: each such fetch of at least 32 MiB (1 MiB per descriptor on average) whose READs took
/// long enough for under 2 GB/s is counted (`nixl_slow_reads`, in
/// Prometheus `kvrelay_kv_agent_nixl_slow_reads_total`) and the first one of an agent is
/// written to standard error once, with the cure.
///
/// Software emulation stays allowed: between two agents of **one process** UCX cannot use CUDA
/// IPC (a process cannot open its own IPC handle) and a device-to-device READ there exists
/// only emulated (measured: `UCX_PROTO_EMULATION_ENABLE=n` fails it, "no zero-copy protocol
/// found for get into cuda from cuda"). A deployment whose agents are all in separate
/// processes can set `UCX_PROTO_EMULATION_ENABLE=n` so that a READ UCX could only emulate
/// fails (counted by reason) instead of running at a few GB/s.
///
/// `existing` is what the plugin's defaults already hold (kept, ours after it).
pub fn ucx_options(existing: Option<String>) -> String {
    let mut o: Vec<String> = existing.into_iter().filter(|e| !e.is_empty()).collect();
    o.push("CUDA_IPC_ENABLE_GET_ZCOPY=y".into());
    o.join(",")
}

/// NIXL's memory type and device id of memory on `device` (`None`: host memory).
fn kind_of(device: Option<i32>) -> (MemType, u64) {
    match device {
        Some(d) => (MemType::Vram, d as u64),
        None => (MemType::Dram, 0),
    }
}

/// A memory extent to register.
#[derive(Debug)]
struct Extent {
    base: u64,
    len: usize,
    device: Option<i32>,
}

impl MemoryRegion for Extent {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.base as *const u8
    }
    fn size(&self) -> usize {
        self.len
    }
}

impl NixlDescriptor for Extent {
    fn mem_type(&self) -> MemType {
        kind_of(self.device).0
    }
    fn device_id(&self) -> u64 {
        kind_of(self.device).1
    }
}

/// The extents of `layout`'s segments, merged where they touch or overlap, as `(base, len)`.
fn extents(layout: &KvLayout) -> Vec<(u64, u64)> {
    let n = u64::from(layout.num_blocks());
    let mut v: Vec<(u64, u64)> =
        layout.segments().iter().map(|s| (s.base, s.base + s.block_stride * (n - 1) + s.bytes_per_block)).collect();
    v.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(v.len());
    for (a, b) in v {
        match out.last_mut() {
            Some(last) if a <= last.1 => last.1 = last.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out.into_iter().map(|(a, b)| (a, b - a)).collect()
}

/// The remote agents' table and the condition its loads signal, shared with the transfers
/// (and the withheld READs) that use an agent of it.
struct Table {
    remotes: Mutex<Remotes>,
    /// Signalled when a load ends.
    cv: Condvar,
}

/// This instance's NIXL agent with its pool registered.
pub(in crate::agent) struct Nixl {
    // Field order is drop order: the registrations go before the agent (each also keeps the
    // agent's inner state alive until it is gone). READs withheld by the agent hold a clone of
    // the agent; the agent drops them before its backends.
    _registrations: Vec<RegistrationHandle>,
    agent: nixl_sys::Agent,
    name: String,
    metadata: Vec<u8>,
    device: Option<i32>,
    /// Remote agents whose metadata is loaded (with that metadata) or being loaded: bounded
    /// ([`remotes`]); an agent a transfer or a withheld READ uses is never dropped.
    table: Arc<Table>,
    /// A slow device READ was written to standard error already ([`slow_device_read`]).
    warned_slow: AtomicBool,
}

/// A use of a loaded remote agent, by a transfer or by its withheld READs: released when
/// dropped (the table never drops an agent in use).
struct RemoteUse {
    table: Arc<Table>,
    name: String,
}

impl Drop for RemoteUse {
    fn drop(&mut self) {
        self.table.remotes.lock().unwrap_or_else(|e| e.into_inner()).release(&self.name);
    }
}

impl Nixl {
    /// Load the library, create a NIXL agent with the UCX backend and register `layout`'s pool.
    ///
    /// # Safety
    /// As [`crate::agent::Agent::new`]: the layout's blocks are memory of `device` (host memory when
    /// `None`), valid for the agent's life.
    pub(in crate::agent) unsafe fn new(
        layout: &KvLayout,
        device: Option<i32>,
        lib_dir: Option<&std::path::Path>,
    ) -> Result<Nixl, String> {
        load_library(lib_dir)?;
        let name = format!(
            "kvrelay-{}-{:x}",
            std::process::id(),
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos())
        );
        // no progress or listen thread: metadata travels on the agent's own connection, and
        // the fetch workers drive their requests by polling
        let cfg = nixl_sys::AgentConfig {
            thread_sync: ThreadSync::Strict,
            enable_listen_thread: false,
            ..Default::default()
        };
        let agent = nixl_sys::Agent::new_configured(&name, &cfg).map_err(|e| format!("NIXL agent: {e:?}"))?;
        let (_, mut params) = agent
            .get_plugin_params("UCX")
            .map_err(|e| format!("NIXL: no UCX plugin ({e:?}); are the NIXL plugins beside libnixl.so?"))?;
        let ucx = ucx_options(
            params
                .iter()
                .ok()
                .and_then(|mut i| i.find_map(|p| p.ok().filter(|p| p.0 == "engine_config").map(|p| p.1.to_string()))),
        );
        params.set("engine_config", &ucx).map_err(|e| format!("NIXL: the UCX backend's options: {e:?}"))?;
        agent.create_backend("UCX", &params).map_err(|e| format!("NIXL: the UCX backend did not start: {e:?}"))?;
        let mut registrations = Vec::new();
        for (base, len) in extents(layout) {
            let len = usize::try_from(len).map_err(|_| "a pool extent larger than the address space")?;
            let r = agent
                .register_memory(&Extent { base, len, device }, None)
                .map_err(|e| format!("NIXL: registering the KV pool ({len} bytes, {:?}): {e:?}", kind_of(device).0))?;
            registrations.push(r);
        }
        let metadata = agent.get_local_md().map_err(|e| format!("NIXL: local metadata: {e:?}"))?;
        if metadata.len() > MAX_METADATA {
            return Err(format!("NIXL: local metadata of {} bytes (at most {MAX_METADATA})", metadata.len()));
        }
        Ok(Nixl {
            _registrations: registrations,
            agent,
            name,
            metadata,
            device,
            table: Arc::new(Table { remotes: Mutex::new(Remotes::default()), cv: Condvar::new() }),
            warned_slow: AtomicBool::new(false),
        })
    }

    /// Load the metadata of source agent `name` unless the same is loaded already; the use
    /// holds it in the table until dropped.
    ///
    /// The table's lock is held only to look up and record, never across NIXL's
    /// `load_remote_md` (which sets up UCX endpoints): a fetch from one source never waits
    /// behind another source's load. A fetch that finds the same source being loaded by another
    /// waits for that load (until `deadline`, checking `stopped`), so NIXL never loads one agent
    /// twice at once. Agents the table drops to stay within its bounds are invalidated here,
    /// after the load.
    fn ensure_remote(
        &self,
        name: &str,
        md: &[u8],
        deadline: Instant,
        stopped: &dyn Fn() -> Result<(), Failure>,
    ) -> Result<RemoteUse, Failure> {
        let table = &self.table;
        let used = || RemoteUse { table: table.clone(), name: name.to_string() };
        let stale = {
            let mut loaded = table.remotes.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                match loaded.begin(name, md) {
                    Step::Ready => return Ok(used()),
                    Step::Load { stale } => break stale,
                    Step::InUse => {
                        return Err((
                            FailReason::Corrupt,
                            "NIXL: other metadata under the name of a source agent fetches use now".into(),
                        ))
                    }
                    Step::Wait => {
                        stopped()?;
                        let now = Instant::now();
                        if now >= deadline {
                            return Err((
                                FailReason::Timeout,
                                "NIXL: waiting for the source's metadata to load".into(),
                            ));
                        }
                        let slice = (deadline - now).min(Duration::from_millis(20));
                        loaded = table.cv.wait_timeout(loaded, slice).unwrap_or_else(|e| e.into_inner()).0;
                    }
                }
            }
        };
        // the "loading" mark is this fetch's now: cleared by the mark's drop if the load panics
        let mark = LoadMark::new(&table.remotes, &table.cv, name);
        let r = (|| {
            if stale {
                let _ = self.agent.invalidate_remote_md(name);
            }
            let got = self
                .agent
                .load_remote_md(md)
                .map_err(|e| (FailReason::Connect, format!("NIXL: the source's metadata: {e:?}")))?;
            if got != name {
                // NIXL's copy of `got` goes only when the table does not hold that agent (a peer
                // may send another live agent's metadata under a made-up name)
                let t = table.remotes.lock().unwrap_or_else(|e| e.into_inner());
                if !t.knows(&got) {
                    let _ = self.agent.invalidate_remote_md(&got);
                }
                drop(t);
                return Err((FailReason::Corrupt, "the source's NIXL metadata names another agent".into()));
            }
            Ok(())
        })();
        // agents dropped to stay within the bounds are invalidated under the table's lock: no
        // fetch loads one of them afresh before NIXL's old copy is gone
        mark.finish(r.as_ref().ok().map(|()| md), &|n| {
            let _ = self.agent.invalidate_remote_md(n);
        });
        r.map(|()| used())
    }

    /// Forget a source agent after a failure (the next fetch loads it afresh), unless a
    /// transfer or withheld READs still use it: NIXL would then fail their status before they
    /// stopped.
    fn forget_remote(&self, name: &str) {
        // invalidated under the table's lock: a fetch that loads the agent afresh waits for it
        let mut t = self.table.remotes.lock().unwrap_or_else(|e| e.into_inner());
        if t.forget(name) {
            let _ = self.agent.invalidate_remote_md(name);
        }
    }
}

impl Backend for Nixl {
    fn hello(&self) -> u8 {
        wire::NIXL_HELLO
    }

    /// One: UCX spreads a READ itself.
    fn streams(&self, _cx: &Cx<'_>, _blocks: usize) -> usize {
        1
    }

    fn movers_at_start(&self, _limits: &Limits) -> usize {
        1
    }

    fn default_speed(&self, device_pool: bool) -> SourceSpeed {
        if device_pool {
            NIXL_VRAM_DEFAULT
        } else {
            NIXL_HOST_DEFAULT
        }
    }

    /// Reads the offer, checks it against this agent's layout and loads the source agent's
    /// metadata (once per source agent); the READs are built and posted by
    /// [`Transfer::post`].
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
            wire::NIXL_OFFER,
            None,
            job.asked.len(),
            job.deadline,
            &mut job.scratch.buf,
            land,
        )?;
        if offer.blocks.is_empty() {
            send_done(cx, c, 0);
            return Err((FailReason::SourceMiss, "the source holds none of the blocks".into()));
        }
        match self.ensure_remote(&offer.agent, &offer.metadata, job.deadline, job.stopped) {
            Ok(used) => Ok(Box::new(transfer::Reads::new(self, offer, used))),
            Err(e) => {
                send_done(cx, c, 0);
                // UCX cannot reach that source's memory from here: TCP may (when the agent falls back)
                land.unusable = e.0 == FailReason::Connect;
                Err(e)
            }
        }
    }

    fn serve(&self, cx: &Cx<'_>, c: &mut dyn Conn, ids: &[u32], _names: &[u64], _lease: &mut super::Lease) -> bool {
        super::serve_in_place(cx, c, ids, wire::NIXL_OFFER, &self.name, &self.metadata, self.device, None)
    }
}

impl Nixl {
    /// Count a verified fetch of device memory into device memory that looks emulated
    /// ([`slow_device_read`]) in `nixl_slow_reads`, and write the agent's first one to standard
    /// error with the cure. Cost: a division and a compare; the write once per agent.
    fn judge_device_read(&self, cx: &Cx<'_>, bytes: u64, descriptors: u64, took: Duration) {
        let Some(rate) = slow_device_read(bytes, descriptors, took) else { return };
        Stats::add(&cx.stats.nixl_slow_reads, 1);
        if self.warned_slow.swap(true, Ordering::Relaxed) {
            return;
        }
        // never `eprintln!`: it panics when standard error cannot be written
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "kvrelay: a NIXL fetch of device memory into device memory ({bytes} bytes, {descriptors} \
             descriptors) ran at {:.3} GB/s: UCX most likely emulated the READ in software. That is \
             unavoidable between two agents of one process; between processes check that \
             UCX_CUDA_IPC_ENABLE_GET_ZCOPY is not set to n, that UCX_TLS (if set) includes cuda_ipc, \
             and that the two processes share IPC and PID namespaces (containers); \
             UCX_PROTO_EMULATION_ENABLE=n makes such READs fail instead. Counted in nixl_slow_reads; \
             written once per agent.",
            rate / 1e9
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ucx_options_keep_the_plugins_own() {
        assert_eq!(ucx_options(None), "CUDA_IPC_ENABLE_GET_ZCOPY=y");
        assert_eq!(ucx_options(Some(String::new())), "CUDA_IPC_ENABLE_GET_ZCOPY=y");
        assert_eq!(ucx_options(Some("RNDV_THRESH=1".into())), "RNDV_THRESH=1,CUDA_IPC_ENABLE_GET_ZCOPY=y");
    }

    #[test]
    fn extents_merge_where_segments_touch_or_overlap() {
        use crate::copy::{KvLayout, Segment};
        // K and V interleaved in one allocation: one extent
        let l = KvLayout::new(
            4,
            vec![
                Segment { base: 0x10000, block_stride: 256, bytes_per_block: 128 },
                Segment { base: 0x10080, block_stride: 256, bytes_per_block: 128 },
                Segment { base: 0x90000, block_stride: 64, bytes_per_block: 64 },
            ],
            &[],
        )
        .expect("a valid layout");
        assert_eq!(extents(&l), vec![(0x10000, 1024), (0x90000, 256)]);
    }
}
