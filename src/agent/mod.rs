//! The KV agent (SPEC section 9): serve this instance's named KV blocks to other instances and
//! fetch named blocks from them into the runtime's own pool, over TCP (the embedded default).
//!
//! **Who owns what.** The runtime owns its KV pool and its reuse cache. The agent sees the pool
//! only through its [`KvLayout`] (host memory, or the memory of one CUDA device:
//! [`AgentConfig::device`]) and touches blocks only in two ways: it reads
//! blocks the runtime pinned for it ([`BlockHolder::pin`], released with
//! [`BlockHolder::unpin`]), and it writes the destination blocks a fetch was given, until that
//! fetch completes. It keeps one checksum per block of the pool, recorded by the runtime
//! ([`Agent::record_checksums`]) when a block becomes reusable, and by the agent itself for
//! every block a fetch verified; the recorded value travels with the block, and the
//! destination checks it where the bytes land ([`crate::checksum`]). A block whose checksum
//! was never recorded is not served (the offer stops before it).
//!
//! **Threads.** One accept thread; one thread per accepted connection (bounded: at most
//! `max_pending` connections that have not yet sent a valid first message, closed after
//! `handshake_timeout`, and at most `max_connections` serving; at most `max_per_peer` of
//! either from one address; when the handshake slots, or an address's places, are all taken,
//! the oldest connection still in its handshake is closed to make room for the new one, so a
//! flood of silent connections only evicts itself and a peer that speaks promptly always gets
//! in, even from an address that also floods); `fetch_threads` fetch workers. [`BlockHolder::pin`] and
//! [`BlockHolder::unpin`] run on connection threads, several at once; a fetch's completion
//! callback runs on a fetch worker. Nothing the agent does blocks the thread that submits a
//! fetch: DNS, connect, reads, verification and the copy into the pool all run on workers.
//! Each serving connection and each stream of a running fetch also starts one short-lived
//! helper thread (the other half of its two-slot pipeline: gathering, or verifying and
//! scattering); a fetch over N streams runs N - 1 of them on threads of their own.
//! On a GPU pool the agent's copies run on streams of its own and it waits on those streams
//! and their events only (never on the runtime's work), with no lock held across a wait.
//!
//! **Connections.** A fetch of at least two times `min_stream_bytes` is spread over up to
//! `streams` TCP connections, each carrying a contiguous part of the run. A connection whose
//! transfer ended cleanly stays open for the next transfer between the same two agents, for
//! `idle_timeout` on the serving side (holding a handshake slot, not a serving one, while it
//! waits, within half of `max_pending`, and not counting against its peer's `max_per_peer`
//! until its next hello) and half of that on the fetching side; it is not authenticated again.
//! A kept-alive connection the source closed meanwhile is replaced within the same fetch.
//!
//! **A fetch** asks the source for the request's names after the `held` leading ones it already
//! has, as many as it reserved destination blocks for. The source answers with the leading run
//! it holds, pinned; each block arrives with its name and recorded checksum, is verified, and
//! only then copied into the next destination block. The completion reports how many leading
//! blocks were written and verified (the runtime commits exactly those, in prefix order) and,
//! when it stopped early, why ([`FailReason`]). When the completion is delivered, the agent
//! writes into none of the fetch's destination blocks any more.
//!
//! **Limits.** Every read and write has a deadline; a control frame is at most 512 bytes, a
//! hello at most `8 * max_names` bytes more; a serving connection's whole transfer must end
//! within 10 s plus 1 s per 100 MB; peers come from the allowlist only; with a pre-shared key,
//! both sides prove they hold it before any name moves ([`auth`]).

pub mod allow;
pub mod auth;
mod config;
pub mod estimate;
mod fetch;
mod pool;
mod service;
mod stats;
mod sums;
mod transport;
pub mod wire;

/// The NIXL transport's public parts (its library loader, the in-place offer's codec).
#[cfg(feature = "nixl")]
pub use transport::nixl;

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub use allow::PeerAllow;
pub use auth::Psk;
pub use config::{AgentConfig, Fingerprint, LimitKey, Limits, Transport};
pub use estimate::{SourceSpeed, NIXL_HOST_DEFAULT, NIXL_VRAM_DEFAULT, TCP_DEFAULT};
pub use stats::AgentStats;
use stats::Stats;
use sums::{sum_host, SumTable};
pub use wire::{Conn, Refusal};

use crate::copy::KvLayout;

/// The runtime's side of serving: its reuse cache.
pub trait BlockHolder: Send + Sync {
    /// Of `names` (a request's consecutive block names), find the leading run this instance
    /// holds, pin those blocks (they must not be evicted, written or reused until
    /// [`BlockHolder::unpin`]), write their block ids into `ids[..n]` and return `n` (0 when
    /// the first name is not held). `ids.len() == names.len()`. Runs on a connection thread,
    /// possibly on several at once.
    fn pin(&self, names: &[u64], ids: &mut [u32]) -> usize;
    /// Release blocks pinned by [`BlockHolder::pin`] (each pinned id is unpinned exactly once).
    fn unpin(&self, ids: &[u32]);
    /// Destination blocks a fetch withheld ([`FetchResult::withheld`]) are free again: the
    /// READs that might have written them are over. Only the NIXL transport withholds blocks;
    /// a runtime that uses it must implement this (the default forgets them: the blocks stay
    /// out of its pool). Runs on a fetch worker, or in the agent's drop.
    fn returned(&self, ids: &[u32]) {
        let _ = ids;
    }
}

crate::labels::labelled_enum! {
    /// Why a fetch stopped before every block it asked for arrived. Fixed values (the C ABI's
    /// `kvrelay_fetch_failure`, whose `KVRELAY_FETCH_OK` is 0); the labels are the metric's.
    pub enum FailReason: i32 {
        /// The endpoint did not resolve or the connection could not be opened.
        Connect = 1 => "connect",
        /// A read, a write, the connect or the whole fetch ran past its deadline.
        Timeout = 2 => "timeout",
        /// The source refused (not allowed, busy, per-peer limit, bad request, too many names).
        Refused = 3 => "refused",
        /// The two layouts or naming schemes differ.
        FingerprintMismatch = 4 => "fingerprint_mismatch",
        /// A block's name, length or checksum is wrong, or a frame is malformed.
        Corrupt = 5 => "corrupt",
        /// The stream ended early.
        Truncated = 6 => "truncated",
        /// The source holds none of the blocks asked for.
        SourceMiss = 7 => "source_miss",
        /// Authentication failed (wrong key, or one side has none).
        AuthFailed = 8 => "auth_failed",
        /// The runtime cancelled the fetch.
        Cancelled = 9 => "cancelled",
        /// The agent was shut down.
        Shutdown = 10 => "shutdown",
        /// The fetch panicked inside the agent (a bug, or a completion callback that unwound
        /// before the result was published); nothing of it is reported written.
        Internal = 11 => "internal",
    }
}

/// One fetch to submit.
#[derive(Clone, Debug)]
pub struct FetchRequest {
    /// The source's KV endpoint, `tcp://host:port`, as an orchestration decision authorized it.
    pub endpoint: String,
    /// The request's own block names, from block 0.
    pub names: Vec<u64>,
    /// How many leading blocks of `names` the runtime holds already (not fetched).
    pub held: usize,
    /// Free blocks of the pool reserved for the fetch: block `held + i` goes into `dst[i]`; as
    /// many are asked for as there are destination blocks (at most `names.len() - held`).
    pub dst: Vec<u32>,
    /// The whole fetch's deadline, from submission.
    pub deadline: Duration,
}

/// How a fetch ended.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FetchResult {
    /// `None`: every block the source offered arrived (it may have offered fewer than asked:
    /// its leading run); otherwise why the fetch stopped.
    pub failure: Option<FailReason>,
    /// Leading destination blocks written and verified (commit exactly these, in order).
    pub blocks: usize,
    /// Their bytes.
    pub bytes: u64,
    /// Destination blocks after the verified ones that the agent still holds (NIXL only: a
    /// READ into them could not be proven stopped): `dst[blocks..blocks + withheld]` must not
    /// be reused until [`BlockHolder::returned`] hands them back. 0 over TCP.
    pub withheld: usize,
    /// Seconds from submission to completion.
    pub seconds: f64,
    /// Why, in words, for logs (never hint bytes, never the key).
    pub detail: String,
}

/// An agent call that could not be done.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AgentError {
    /// A configuration value was refused.
    Config(String),
    /// An argument was refused (a block id past the pool, a duplicate destination, ...).
    Argument(String),
    /// Binding the listen address or starting a thread failed.
    Io(String),
    /// The device pool could not be set up (no driver, no such device, a CUDA call failed).
    Cuda(crate::copy::CopyError),
    /// The fetch queue is full.
    Busy,
}

impl fmt::Display for AgentError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AgentError::Config(s) | AgentError::Argument(s) | AgentError::Io(s) => f.write_str(s),
            AgentError::Busy => f.write_str("the agent's fetch queue is full"),
            AgentError::Cuda(e) => write!(f, "the device pool: {e}"),
        }
    }
}
impl std::error::Error for AgentError {}

/// A fetch's completion callback: runs once, on the fetch worker, when the fetch completes.
pub type OnDone = Box<dyn FnOnce(&FetchResult) + Send>;

struct FetchState {
    result: Mutex<Option<FetchResult>>,
    done: Condvar,
    cancel: AtomicBool,
    on_done: Mutex<Option<OnDone>>,
    submitted: Instant,
    /// The connections this fetch's streams use right now, each with its part and its
    /// registration id: `cancel` shuts them down so that blocked reads return, and a part that
    /// ends short shuts down the parts after it. A stream removes its entry before its
    /// connection goes to the idle pool (which then owns it alone) or closes, so a cancel never
    /// reaches a connection another fetch took from the pool.
    sock: Mutex<Vec<(usize, u64, TcpStream)>>,
    /// Parts after this one are of no use (an earlier part ended short): they stop.
    stop_after: AtomicUsize,
}

impl FetchState {
    fn new(on_done: Option<OnDone>) -> FetchState {
        FetchState {
            result: Mutex::new(None),
            done: Condvar::new(),
            cancel: AtomicBool::new(false),
            on_done: Mutex::new(on_done),
            submitted: Instant::now(),
            sock: Mutex::new(Vec::new()),
            stop_after: AtomicUsize::new(usize::MAX),
        }
    }

    /// The callback first, then the result for pollers: once a poll sees the result, the
    /// callback no longer uses what it captured. A callback that panics is contained here (the
    /// result is published all the same and the worker goes on).
    fn complete(&self, r: FetchResult) {
        let cb = self.on_done.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(cb) = cb {
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| cb(&r)));
        }
        *self.result.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
        self.done.notify_all();
    }

    /// Publish part `part`'s connection `s` (registration `id`) for cancels and sibling stops.
    fn publish(&self, part: usize, id: u64, s: &TcpStream) {
        if let Ok(clone) = s.try_clone() {
            self.sock.lock().unwrap_or_else(|e| e.into_inner()).push((part, id, clone));
        }
    }

    /// Forget the connection registered as `id` (its clone closes here).
    fn unpublish(&self, id: u64) {
        self.sock.lock().unwrap_or_else(|e| e.into_inner()).retain(|(_, i, _)| *i != id);
    }

    /// Part `part` ended short: the parts after it stop (their connections are shut down).
    fn stop_parts_after(&self, part: usize) {
        self.stop_after.fetch_min(part, Ordering::AcqRel);
        for (p, _, s) in self.sock.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            if *p > part {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
        }
    }
}

/// A submitted fetch: poll it, wait for it, or cancel it. Dropping the handle neither cancels
/// the fetch nor loses its completion callback (the C handle shares this behaviour); an owner
/// whose going away must stop the fetch holds it as an [`OwnedFetch`] ([`Fetch::owned`]).
#[derive(Clone)]
pub struct Fetch(Arc<FetchState>);

impl Fetch {
    /// The result, once the fetch completed.
    pub fn poll(&self) -> Option<FetchResult> {
        self.0.result.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Wait up to `timeout` for the result.
    pub fn wait(&self, timeout: Duration) -> Option<FetchResult> {
        let end = Instant::now() + timeout;
        let mut g = self.0.result.lock().unwrap_or_else(|e| e.into_inner());
        while g.is_none() {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            g = self.0.done.wait_timeout(g, left).unwrap_or_else(|e| e.into_inner()).0;
        }
        g.clone()
    }

    /// Ask the fetch to stop: it completes with [`FailReason::Cancelled`] after the block in
    /// progress (blocks verified before stay reported), or normally if it was about to.
    pub fn cancel(&self) {
        self.0.cancel.store(true, Ordering::Release);
        for (_, _, s) in self.0.sock.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// A fetch that owns its destination blocks the way a runtime's request does: dropping it
/// cancels the fetch (if it still runs) and waits for its completion, so that when the drop
/// returns nothing writes the destination blocks any more and the runtime may reuse them (but
/// for NIXL's withheld ones, which come back through [`BlockHolder::returned`]). The wait is
/// bounded by the block in progress and `io_timeout`; do not drop a running one on a thread
/// that must not block. [`OwnedFetch::detach`] lets the fetch run on without it.
pub struct OwnedFetch(Option<Fetch>);

impl OwnedFetch {
    /// The fetch (poll, wait, cancel).
    pub fn fetch(&self) -> &Fetch {
        self.0.as_ref().expect("present until dropped or detached")
    }

    /// Let the fetch run on unowned (its completion callback, if any, still runs).
    pub fn detach(mut self) -> Fetch {
        self.0.take().expect("present until dropped or detached")
    }
}

impl Drop for OwnedFetch {
    fn drop(&mut self) {
        let Some(f) = self.0.take() else { return };
        if f.poll().is_some() {
            return;
        }
        f.cancel();
        while f.wait(Duration::from_secs(1)).is_none() {}
    }
}

impl Fetch {
    /// This handle as the owner of its destination blocks ([`OwnedFetch`]: dropping it cancels
    /// and waits).
    pub fn owned(self) -> OwnedFetch {
        OwnedFetch(Some(self))
    }
}

struct Job {
    req: FetchRequest,
    state: Arc<FetchState>,
}

struct Inner {
    fingerprint: Fingerprint,
    allow: PeerAllow,
    limits: Limits,
    key: Option<Psk>,
    layout: KvLayout,
    block_bytes: usize,
    movers: pool::Movers,
    holder: Box<dyn BlockHolder>,
    sums: SumTable,
    estimator: estimate::Estimator,
    stats: Stats,
    stop: AtomicBool,
    /// Connections per peer address (handshake and serving).
    peers: Mutex<HashMap<IpAddr, u32>>,
    /// Accepted connections that have not completed their handshake yet, oldest first: when
    /// the handshake slots (or an address's places) are all taken, the oldest of them makes
    /// room for a new connection (see `service::make_room`).
    greeting: Mutex<VecDeque<service::Greeting>>,
    /// Live sockets (served and fetched), shut down at stop; the count of live connection
    /// threads is the map's length.
    conns: Mutex<(u64, HashMap<u64, TcpStream>)>,
    conns_idle: Condvar,
    jobs: Mutex<VecDeque<Job>>,
    jobs_ready: Condvar,
    /// Kept-alive fetch connections per source address, with when each went idle.
    idle: Mutex<HashMap<SocketAddr, Vec<(TcpStream, Instant)>>>,
    /// How a fetch's bytes move (TCP frames, or NIXL READs in place): the transport seam.
    backend: Box<dyn transport::Backend>,
}

/// Set a socket's send and receive buffers to `bytes` (0: leave the kernel's autotuning).
fn set_buffers(s: &TcpStream, bytes: u32) {
    if bytes == 0 {
        return;
    }
    use std::os::fd::AsRawFd;
    let v = bytes as libc::c_int;
    for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
        // SAFETY: a live socket's descriptor; `v` is a c_int that lives across the call and
        // its size is passed; setsockopt only reads it.
        unsafe {
            libc::setsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                (&v as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
    }
}

/// Most kept-alive fetch connections per source address.
const MAX_IDLE_PER_SOURCE: usize = 16;

impl Inner {
    /// A kept-alive connection to `addr` young enough to use (within half the idle timeout).
    fn take_idle(&self, addr: SocketAddr) -> Option<TcpStream> {
        let fresh = self.limits.idle_timeout / 2;
        let mut m = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let v = m.get_mut(&addr)?;
        v.retain(|(_, since)| since.elapsed() < fresh);
        let s = v.pop().map(|(s, _)| s);
        if v.is_empty() {
            m.remove(&addr);
        }
        s
    }

    /// Keep a connection whose last transfer ended cleanly for the next fetch from `addr`.
    fn put_idle(&self, addr: SocketAddr, s: TcpStream) {
        if self.limits.idle_timeout.is_zero() || self.stop.load(Ordering::Acquire) {
            return;
        }
        let mut m = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let v = m.entry(addr).or_default();
        v.retain(|(_, since)| since.elapsed() < self.limits.idle_timeout);
        if v.len() < MAX_IDLE_PER_SOURCE {
            v.push((s, Instant::now()));
        }
    }

    /// The deadline of one read or write that starts now.
    fn io_deadline(&self) -> Instant {
        Instant::now() + self.limits.io_timeout
    }

    /// Return withheld destination blocks to the runtime, counted.
    fn give_back(&self, ids: &[u32]) {
        if ids.is_empty() {
            return;
        }
        self.holder.returned(ids);
        Stats::add(&self.stats.blocks_returned, ids.len() as u64);
    }

    fn register(&self, s: &TcpStream) -> Option<u64> {
        let clone = s.try_clone().ok()?;
        let mut g = self.conns.lock().unwrap_or_else(|e| e.into_inner());
        if self.stop.load(Ordering::Acquire) {
            return None;
        }
        g.0 += 1;
        let id = g.0;
        g.1.insert(id, clone);
        Some(id)
    }
    fn unregister(&self, id: u64) {
        let mut g = self.conns.lock().unwrap_or_else(|e| e.into_inner());
        g.1.remove(&id);
        if g.1.is_empty() {
            self.conns_idle.notify_all();
        }
    }
}

/// The KV agent. Dropping it stops the service and every fetch (queued and running fetches
/// complete with [`FailReason::Shutdown`] or [`FailReason::Cancelled`]), waits for every thread
/// it started, and only then drops the [`BlockHolder`]: after `drop` returns, the agent touches
/// neither the pool nor the holder.
pub struct Agent {
    inner: Arc<Inner>,
    local: Option<SocketAddr>,
    endpoint: Option<String>,
    threads: Vec<JoinHandle<()>>,
}

impl fmt::Debug for Agent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Agent").field("endpoint", &self.endpoint).finish_non_exhaustive()
    }
}

impl Agent {
    /// Start an agent over the pool described by `layout`: host memory, or the memory of CUDA
    /// device `config.device` (then the agent copies through its own streams and pinned slots,
    /// and sums checksums with a kernel).
    ///
    /// Cost: binds the listener, starts the threads, and makes `limits.streams` movers up front
    /// (one with the NIXL transport, whose fetches use one stream) so that the first fetches
    /// and served connections do not make them. A mover holds two staging slots of 4 MiB or
    /// one block, whichever is larger (host memory for a host pool; pinned memory, two streams
    /// and a few events for a device pool). Movers go back to the agent after each fetch or
    /// connection. On a device, the first agent of a process also compiles the
    /// copy kernel with NVRTC (tens of milliseconds, once per process), and each agent loads it
    /// into the context once (milliseconds).
    /// More movers are made later only when more connections or streams run at once than
    /// were ever running before.
    ///
    /// # Safety
    /// Every block of `layout` must be host memory (or device memory of `config.device`) valid
    /// for reads and writes for the agent's whole life. The runtime must not write a block between pinning it for the agent and
    /// unpinning it, and must not touch a fetch's destination blocks until that fetch completed.
    pub unsafe fn new(
        config: AgentConfig,
        layout: KvLayout,
        holder: Box<dyn BlockHolder>,
    ) -> Result<Agent, AgentError> {
        config.limits.check().map_err(AgentError::Config)?;
        // a block travels in one frame whose u32 length covers 16 bytes of name and checksum
        let block_bytes = usize::try_from(layout.stage_block_bytes())
            .ok()
            .filter(|&b| b as u64 + 16 <= u64::from(u32::MAX))
            .ok_or_else(|| {
                AgentError::Config(format!(
                    "blocks of {} bytes: the agent moves blocks of at most 4 GiB - 16 bytes",
                    layout.stage_block_bytes()
                ))
            })?;
        let listener = match &config.listen {
            None => None,
            Some(a) => {
                let l = TcpListener::bind(a.as_str()).map_err(|e| AgentError::Io(format!("listen on {a}: {e}")))?;
                Some(l)
            }
        };
        let local = listener.as_ref().map(|l| l.local_addr()).transpose().map_err(|e| AgentError::Io(e.to_string()))?;
        let memory = match config.device {
            None => pool::Memory::Host,
            Some(d) => pool::Memory::Device(crate::copy::CudaDevice::open(d).map_err(AgentError::Cuda)?),
        };
        let movers = pool::Movers::new(memory);
        // SAFETY: forwarded contract (the layout's memory is what `config.device` says).
        let backend = unsafe { transport::open(&config.transport, &layout, config.device) }?;
        let default_speed = backend.default_speed(config.device.is_some());
        // one mover per stream of a fetch (NIXL fetches use one), made now rather than on a
        // first fetch's critical path (a device pool's kernel compiles and loads here, and a
        // failure shows at once)
        let warm = backend.movers_at_start(&config.limits);
        // SAFETY: forwarded contract (the layout's memory is what `config.device` says).
        unsafe { movers.warm(warm, &layout) }.map_err(AgentError::Io)?;
        let inner = Arc::new(Inner {
            sums: SumTable::new(layout.num_blocks() as usize),
            fingerprint: config.fingerprint,
            allow: config.allow,
            limits: config.limits,
            key: config.key,
            layout,
            block_bytes,
            movers,
            holder,
            estimator: estimate::Estimator::new(default_speed),
            stats: Stats::default(),
            stop: AtomicBool::new(false),
            peers: Mutex::new(HashMap::new()),
            greeting: Mutex::new(VecDeque::new()),
            conns: Mutex::new((0, HashMap::new())),
            conns_idle: Condvar::new(),
            jobs: Mutex::new(VecDeque::new()),
            jobs_ready: Condvar::new(),
            idle: Mutex::new(HashMap::new()),
            backend,
        });
        let mut agent =
            Agent { inner: inner.clone(), local, endpoint: local.map(|a| format!("tcp://{a}")), threads: vec![] };
        for i in 0..inner.limits.fetch_threads {
            let inner = inner.clone();
            let t = std::thread::Builder::new()
                .name(format!("kvrelay-fetch-{i}"))
                .spawn(move || fetch::worker(&inner))
                .map_err(|e| AgentError::Io(format!("starting a fetch thread: {e}")))?;
            agent.threads.push(t);
        }
        if let Some(l) = listener {
            let inner = inner.clone();
            let t = std::thread::Builder::new()
                .name("kvrelay-accept".into())
                .spawn(move || service::accept_loop(&inner, l))
                .map_err(|e| AgentError::Io(format!("starting the accept thread: {e}")))?;
            agent.threads.push(t);
        }
        Ok(agent)
    }

    /// The service's endpoint, `tcp://ADDR:PORT` (what a router puts in a hint's
    /// `source_control_endpoint`); `None` for a fetch-only agent.
    pub fn endpoint(&self) -> Option<&str> {
        self.endpoint.as_deref()
    }

    /// Bytes of one block (every segment of it, block-major).
    pub fn block_bytes(&self) -> usize {
        self.inner.block_bytes
    }

    /// Record the checksums of blocks `ids`, which just became reusable (a prefill wrote them):
    /// the agent reads each block where it lies (no copy) and keeps its checksum, which then
    /// travels with the block. O(bytes); host batches over 8 MiB are summed on several threads;
    /// device pools by a kernel on the agent's own stream. One allocation of `8 * ids.len()`.
    pub fn record_checksums(&self, ids: &[u32]) -> Result<(), AgentError> {
        let n = self.inner.layout.num_blocks();
        if let Some((i, &id)) = ids.iter().enumerate().find(|(_, &id)| id >= n) {
            return Err(AgentError::Argument(format!("block id {id} (position {i}) is past the pool's {n} blocks")));
        }
        let inner = &*self.inner;
        if let pool::Memory::Device(_) = inner.movers.memory() {
            // SAFETY: `Agent::new`'s contract covers the layout's memory.
            let mut m = unsafe { inner.movers.take(&inner.layout) }.map_err(AgentError::Io)?;
            let mut sums = vec![0u64; ids.len()];
            let r = m.device_checksums(ids, &mut sums);
            inner.movers.put(m);
            r.map_err(AgentError::Io)?;
            for (&id, &s) in ids.iter().zip(&sums) {
                inner.sums.set(id, s);
            }
            return Ok(());
        }
        let mut sums = vec![0u64; ids.len()];
        sum_host(inner, ids, &mut sums);
        for (&id, &s) in ids.iter().zip(&sums) {
            inner.sums.set(id, s);
        }
        Ok(())
    }

    /// The checksum recorded for block `id`, if any.
    pub fn recorded_checksum(&self, id: u32) -> Option<u64> {
        (id < self.inner.layout.num_blocks()).then(|| self.inner.sums.get(id)).flatten()
    }

    /// Submit a fetch. Never blocks: the checks below run here, everything else on a fetch
    /// worker, and `on_done` (if any) runs there when it completes. Refused: no destination
    /// block, `held + dst.len() > names.len()`, more than `max_names` blocks, a destination id
    /// past the pool or twice, a deadline of zero; [`AgentError::Busy`] when the queue is full.
    pub fn submit(&self, req: FetchRequest, on_done: Option<OnDone>) -> Result<Fetch, AgentError> {
        let arg = |s: String| Err(AgentError::Argument(s));
        let n = self.inner.layout.num_blocks();
        if req.dst.is_empty() {
            return arg("a fetch needs at least one destination block".into());
        }
        if req.held > req.names.len() || req.dst.len() > req.names.len() - req.held {
            return arg(format!(
                "{} destination blocks after {} held ones, but the request has {} names",
                req.dst.len(),
                req.held,
                req.names.len()
            ));
        }
        if req.dst.len() > self.inner.limits.max_names as usize {
            return arg(format!("{} blocks in one fetch (max_names {})", req.dst.len(), self.inner.limits.max_names));
        }
        if let Some(&id) = req.dst.iter().find(|&&id| id >= n) {
            return arg(format!("destination block {id} is past the pool's {n} blocks"));
        }
        let mut sorted = req.dst.clone();
        sorted.sort_unstable();
        if sorted.windows(2).any(|w| w[0] == w[1]) {
            return arg("the same destination block twice".into());
        }
        if req.deadline.is_zero() {
            return arg("a fetch needs a deadline above zero".into());
        }
        let state = Arc::new(FetchState::new(on_done));
        {
            let mut q = self.inner.jobs.lock().unwrap_or_else(|e| e.into_inner());
            if q.len() >= self.inner.limits.max_queued_fetches as usize {
                return Err(AgentError::Busy);
            }
            q.push_back(Job { req, state: state.clone() });
        }
        Stats::add(&self.inner.stats.fetches_submitted, 1);
        self.inner.jobs_ready.notify_one();
        Ok(Fetch(state))
    }

    /// The current speed estimate of `endpoint` (the TCP default before its first transfer).
    pub fn speed(&self, endpoint: &str) -> SourceSpeed {
        self.inner.estimator.speed(endpoint)
    }

    /// Seconds a fetch of `blocks` blocks from `endpoint` is expected to take; compare it with
    /// the runtime's own prefill time for those tokens (SPEC section 8, "fetch only when it pays").
    /// Any `blocks` is taken (the byte count saturates: an absurd count gives an absurdly long
    /// estimate, never a wrapped short one).
    pub fn estimate(&self, endpoint: &str, blocks: usize) -> f64 {
        let bytes = (blocks as u64).saturating_mul(self.inner.block_bytes as u64);
        self.inner.estimator.seconds(endpoint, bytes)
    }

    /// The counters.
    pub fn stats(&self) -> AgentStats {
        self.inner.stats.snapshot()
    }

    /// The counters as Prometheus text (metric names `kvrelay_kv_agent_*`): refusals and fetch
    /// failures by reason, blocks and bytes by direction, connections by state. One allocation
    /// for the text; no lock.
    pub fn prometheus(&self) -> String {
        self.inner.stats.prometheus()
    }

    /// Fetch over one connection on the calling thread: the hello for `names[..dst.len()]` is
    /// written to `conn` and whatever `conn` answers is taken as the source's reply, moved by
    /// the agent's backend into `dst`, verified and counted as a fetch would (for tests and
    /// fuzzing of what a hostile source can send; the TCP transport only: a NIXL READ needs a
    /// real source). Refused as [`Agent::submit`] refuses bad destinations.
    #[doc(hidden)]
    pub fn fetch_over_connection(
        &self,
        conn: &mut dyn Conn,
        names: &[u64],
        dst: &[u32],
    ) -> Result<FetchResult, AgentError> {
        let n = self.inner.layout.num_blocks();
        let mut sorted = dst.to_vec();
        sorted.sort_unstable();
        if dst.is_empty()
            || dst.len() > names.len()
            || sorted.windows(2).any(|w| w[0] == w[1])
            || sorted.last().is_some_and(|&id| id >= n)
        {
            return Err(AgentError::Argument(
                "destination blocks: none, more than names, twice or past the pool".into(),
            ));
        }
        Ok(fetch::over_connection(&self.inner, conn, names, dst))
    }

    /// Serve one connection on the calling thread as the service would serve an allowed peer
    /// (handshake, then the transfer), for tests and fuzzing of what a peer can send. Slot and
    /// per-peer limits are not applied.
    #[doc(hidden)]
    pub fn serve_connection(&self, conn: &mut dyn Conn) {
        let mut scratch = service::Scratch::default();
        service::serve(&self.inner, conn, &mut scratch, None, &mut service::Held::default());
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let inner = &self.inner;
        inner.stop.store(true, Ordering::Release);
        // wake the accept thread (it checks `stop` after every accept)
        if let Some(a) = self.local {
            let wake = if a.ip().is_unspecified() {
                SocketAddr::new(
                    if a.is_ipv4() { IpAddr::from([127, 0, 0, 1]) } else { IpAddr::from([0u16, 0, 0, 0, 0, 0, 0, 1]) },
                    a.port(),
                )
            } else {
                a
            };
            let _ = TcpStream::connect_timeout(&wake, Duration::from_millis(500));
        }
        {
            let g = inner.conns.lock().unwrap_or_else(|e| e.into_inner());
            for s in g.1.values() {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
        }
        inner.idle.lock().unwrap_or_else(|e| e.into_inner()).clear();
        inner.jobs_ready.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        // connection threads: their sockets are shut down, so they end within one step
        let mut g = inner.conns.lock().unwrap_or_else(|e| e.into_inner());
        while !g.1.is_empty() {
            g = inner.conns_idle.wait_timeout(g, Duration::from_millis(50)).unwrap_or_else(|e| e.into_inner()).0;
            for s in g.1.values() {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
        }
        drop(g);
        // the last references of connection threads are dropped right after they unregister
        while Arc::strong_count(&self.inner) > 1 {
            std::thread::sleep(Duration::from_millis(1));
        }
        // with every thread gone, the backend goes (a NIXL agent with its UCX backend), and
        // then nothing can write into withheld blocks any more: they go back before the
        // holder does
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            let backend = std::mem::replace(&mut inner.backend, Box::new(transport::tcp::Tcp));
            let ids = backend.teardown();
            inner.give_back(&ids);
        }
    }
}

/// The deadline a source gives one transfer of `bytes` (10 s plus 1 s per 100 MB): a fetch
/// deadline that covers whatever the source allows a transfer of that size.
pub fn transfer_deadline(bytes: u64) -> Duration {
    transport::tcp::transfer_deadline(bytes)
}

/// The run a destination fetches (SPEC section 8): from the first block it does not hold
/// (`held` leading blocks of `names` it does), the consecutive names that appear among the
/// hint's `hashes` (membership, not position). Returns the run's length.
pub fn run_length(names: &[u64], held: usize, hashes: &[u64]) -> usize {
    if held >= names.len() {
        return 0;
    }
    let set: std::collections::HashSet<u64> = hashes.iter().copied().collect();
    names[held..].iter().take_while(|n| set.contains(n)).count()
}
