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
//! within 10 s plus 1 s per 100 MB; peers come from the allowlist only; both sides prove they
//! hold the agent's key before any name moves ([`auth`]): the deployment's key when one is
//! given, else the per-user key, made on first use and readable by its user alone
//! ([`auth::per_user_key`]; [`AgentConfig::per_user_key`] false turns authentication off, and
//! with it every grant of memory). A grant (a CUDA IPC handle, a NIXL registration) leaves the
//! agent only in an offer of at least one block, to a peer that proved the key. A fetch names
//! its blocks and gives their content digests; one by name alone needs the limit
//! [`Limits::unchecked_fetch`].

pub mod allow;
pub mod auth;
mod config;
pub mod estimate;
mod fetch;
mod handle;
mod inner;
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
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

pub use allow::PeerAllow;
pub use auth::Psk;
pub use config::{AgentConfig, Fingerprint, LimitKey, Limits, Transport, TCP_FALLBACK_MEMORY};
pub use estimate::{ImportCost, SourceSpeed, CUDA_IPC_DEFAULT, NIXL_HOST_DEFAULT, NIXL_VRAM_DEFAULT, TCP_DEFAULT};
pub use handle::{Fetch, FetchRequest, FetchResult, OnDone, OnOffer, OwnedFetch};
use handle::{FetchState, Job};
use inner::{set_buffers, Inner};
pub use stats::AgentStats;
use stats::Stats;
use sums::{sum_host, tag_host, SumTable};
#[doc(hidden)]
pub use transport::cuda_ipc::check_offer_plans;
#[doc(hidden)]
pub use transport::cuda_ipc::{map_grant, GrantMapping};
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
        /// A block arrived under the name asked for with another content digest than the one
        /// the runtime computed from its own tokens (a name collision, crafted or not, or a
        /// source that recorded no digest): it was not written; the blocks before it were.
        /// Since 0.3.3.
        DigestMismatch = 12 => "digest_mismatch",
    }
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
        let key = match (config.key, config.per_user_key) {
            (Some(k), _) => Some(k),
            (None, true) => Some(auth::per_user_key().map_err(AgentError::Config)?),
            (None, false) => None,
        };
        // a block travels in one frame whose u32 length covers its name, checksum and digest
        let block_bytes = usize::try_from(layout.stage_block_bytes())
            .ok()
            .filter(|&b| (b + wire::BLOCK_HEAD) as u64 <= u64::from(u32::MAX))
            .ok_or_else(|| {
                AgentError::Config(format!(
                    "blocks of {} bytes: the agent moves blocks of at most 4 GiB - 56 bytes",
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
        // the block key of a keyed agent: its tags prove a block's bytes to peers that hold the
        // deployment key; every block the agent records is tagged (a device pool's by the
        // summing kernel, from the same loads)
        let mac = key.as_ref().map(|k| {
            Arc::new(crate::block_mac::BlockMac::new(&k.derive(crate::block_mac::BLOCK_KEY_LABEL), block_bytes))
        });
        let movers = pool::Movers::new(memory, mac.clone());
        // SAFETY: forwarded contract (the layout's memory is what `config.device` says).
        let backends = unsafe { transport::open(&config.transport, &layout, config.device, &config.limits) }?;
        let default_speed = backends[0].default_speed(config.device.is_some());
        // one mover per stream of a fetch (NIXL fetches use one), made now rather than on a
        // first fetch's critical path (a device pool's kernel compiles and loads here, and a
        // failure shows at once)
        let warm = backends.iter().map(|b| b.movers_at_start(&config.limits)).max().unwrap_or(1);
        // SAFETY: forwarded contract (the layout's memory is what `config.device` says).
        unsafe { movers.warm(warm, &layout) }.map_err(AgentError::Io)?;
        let inner = Arc::new(Inner {
            sums: SumTable::new(layout.num_blocks() as usize, mac),
            fingerprint: config.fingerprint,
            allow: config.allow,
            limits: config.limits,
            key,
            layout,
            block_bytes,
            movers,
            holder,
            estimator: estimate::Estimator::new(default_speed),
            import_cost: estimate::ImportCost::default(),
            stats: Stats::default(),
            stop: AtomicBool::new(false),
            peers: Mutex::new(HashMap::new()),
            greeting: Mutex::new(VecDeque::new()),
            conns: Mutex::new((0, HashMap::new())),
            conns_idle: Condvar::new(),
            jobs: Mutex::new(VecDeque::new()),
            jobs_ready: Condvar::new(),
            cancelled: Mutex::new((Vec::new(), false)),
            withheld: Mutex::new(Vec::new()),
            idle: Mutex::new(HashMap::new()),
            backends,
            tcp_sources: Mutex::new(HashMap::new()),
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
    /// A keyed agent also records each block's keyed tag ([`crate::block_mac`]): on a host pool
    /// a second pass over the bytes, of about the checksum's cost; on a device pool the same
    /// kernel, from the same loads.
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
            let tagging = inner.sums.records_tags();
            let mut nh = vec![crate::block_mac::NhSums::default(); if tagging { ids.len() } else { 0 }];
            let r = m.device_checksums(ids, &mut sums, tagging.then_some(&mut nh[..]));
            inner.movers.put(m);
            r.map_err(AgentError::Io)?;
            for (&id, &s) in ids.iter().zip(&sums) {
                inner.sums.set(id, s);
            }
            if let Some(mac) = inner.sums.mac() {
                for (&id, &t) in ids.iter().zip(&nh) {
                    inner.sums.set_tag(id, mac.finish(t, inner.layout.stage_block_bytes()));
                }
            }
            return Ok(());
        }
        let mut sums = vec![0u64; ids.len()];
        sum_host(&inner.layout, inner.block_bytes, ids, &mut sums);
        for (&id, &s) in ids.iter().zip(&sums) {
            inner.sums.set(id, s);
        }
        if let (true, Some(mac)) = (inner.sums.records_tags(), inner.sums.mac()) {
            tag_host(&inner.layout, mac, inner.block_bytes, ids, &mut sums);
            for (&id, &t) in ids.iter().zip(&sums) {
                inner.sums.set_tag(id, t);
            }
        }
        Ok(())
    }

    /// Check blocks `ids` where they lie against what this agent recorded for them (their
    /// checksum, and their keyed tag where the agent tags: a keyed agent), before a runtime
    /// lets them into a slot from a pool that another process could have written (one whose
    /// agent grants its memory: CUDA IPC, NIXL). Returns how many leading blocks match; a block
    /// with nothing recorded does not. O(bytes): on a host pool one or two passes on the CPU
    /// (several threads over 8 MiB), on a device pool one kernel from the same loads, waited
    /// for on the agent's own stream. One allocation of `8 * ids.len()` (and on a device pool
    /// `16 * ids.len()` more).
    pub fn verify_blocks(&self, ids: &[u32]) -> Result<usize, AgentError> {
        let inner = &*self.inner;
        let n = inner.layout.num_blocks();
        if let Some((i, &id)) = ids.iter().enumerate().find(|(_, &id)| id >= n) {
            return Err(AgentError::Argument(format!("block id {id} (position {i}) is past the pool's {n} blocks")));
        }
        let tagging = inner.sums.records_tags();
        let mut sums = vec![0u64; ids.len()];
        let mut tags = vec![0u64; if tagging { ids.len() } else { 0 }];
        if let pool::Memory::Device(_) = inner.movers.memory() {
            // SAFETY: `Agent::new`'s contract covers the layout's memory.
            let mut m = unsafe { inner.movers.take(&inner.layout) }.map_err(AgentError::Io)?;
            let mut nh = vec![crate::block_mac::NhSums::default(); tags.len()];
            let r = m.device_checksums(ids, &mut sums, tagging.then_some(&mut nh[..]));
            inner.movers.put(m);
            r.map_err(AgentError::Io)?;
            if let Some(mac) = inner.sums.mac() {
                for (t, &s) in tags.iter_mut().zip(&nh) {
                    *t = mac.finish(s, inner.layout.stage_block_bytes());
                }
            }
        } else {
            sum_host(&inner.layout, inner.block_bytes, ids, &mut sums);
            if let (true, Some(mac)) = (tagging, inner.sums.mac()) {
                tag_host(&inner.layout, mac, inner.block_bytes, ids, &mut tags);
            }
        }
        Ok(ids
            .iter()
            .enumerate()
            .take_while(|&(i, &id)| {
                inner.sums.get(id) == Some(sums[i]) && (!tagging || inner.sums.tag(id) == Some(tags[i]))
            })
            .count())
    }

    /// Record the content digests of blocks `ids` (`digests[i]` for `ids[i]`: what
    /// [`crate::names::Naming::digests_into`] gives for the tokens whose KV the block holds),
    /// after their checksums. A block is served with its recorded digest (zeros when none was
    /// recorded), and a fetch that asks with digests takes a block only when the two are equal:
    /// record the digest again whenever a block is rewritten. A fetched block's digest is
    /// recorded by the fetch. O(n), no allocation.
    pub fn record_digests(
        &self,
        ids: &[u32],
        digests: &[[u8; crate::names::BLOCK_DIGEST_BYTES]],
    ) -> Result<(), AgentError> {
        let n = self.inner.layout.num_blocks();
        if ids.len() != digests.len() {
            return Err(AgentError::Argument(format!("{} block ids and {} digests", ids.len(), digests.len())));
        }
        if let Some((i, &id)) = ids.iter().enumerate().find(|(_, &id)| id >= n) {
            return Err(AgentError::Argument(format!("block id {id} (position {i}) is past the pool's {n} blocks")));
        }
        self.inner.sums.set_digests(ids, digests);
        Ok(())
    }

    /// The content digest recorded for block `id`, if any.
    pub fn recorded_digest(&self, id: u32) -> Option<[u8; crate::names::BLOCK_DIGEST_BYTES]> {
        (id < self.inner.layout.num_blocks()).then(|| self.inner.sums.digest(id)).filter(|d| d.iter().any(|&b| b != 0))
    }

    /// The checksum recorded for block `id`, if any.
    pub fn recorded_checksum(&self, id: u32) -> Option<u64> {
        (id < self.inner.layout.num_blocks()).then(|| self.inner.sums.get(id)).flatten()
    }

    /// The keyed tag recorded for block `id` ([`crate::block_mac`]), if this agent tags its
    /// blocks (it holds a key) and recorded one.
    pub fn recorded_tag(&self, id: u32) -> Option<u64> {
        (id < self.inner.layout.num_blocks()).then(|| self.inner.sums.tag(id)).flatten()
    }

    /// Submit a fetch. Never blocks: the checks below run here, everything else on a fetch
    /// worker, and `on_done` (if any) runs there when it completes. Refused: no destination
    /// block, `held + dst.len() > names.len()`, more than `max_names` blocks, a destination id
    /// past the pool or twice, a deadline of zero, no content digests unless the limit
    /// [`Limits::unchecked_fetch`] allows fetches by name alone; [`AgentError::Busy`] when the
    /// queue is full.
    pub fn submit(&self, req: FetchRequest, on_done: Option<OnDone>) -> Result<Fetch, AgentError> {
        self.submit_lazy(req, on_done, None)
    }

    /// [`Agent::submit`] with a room callback ([`OnOffer`]): the destination blocks need not be
    /// free yet, only reserved; each stream asks the runtime to make its part ready once the
    /// source's offer said how many blocks it will get, so that a source that lacks the
    /// blocks costs the runtime no eviction, and one that holds fewer costs only what it sends.
    pub fn submit_lazy(
        &self,
        req: FetchRequest,
        on_done: Option<OnDone>,
        on_offer: Option<OnOffer>,
    ) -> Result<Fetch, AgentError> {
        self.check_destination(req.names.len(), req.held, &req.dst)?;
        if req.digests.is_empty() && !self.inner.limits.unchecked_fetch {
            return Err(AgentError::Argument(
                "a fetch without content digests would take blocks by name alone: give one digest per name \
                 (Naming::digests_into over the request's tokens), or allow it with the limit unchecked_fetch"
                    .into(),
            ));
        }
        if !req.digests.is_empty() && req.digests.len() != req.names.len() {
            return Err(AgentError::Argument(format!(
                "{} content digests for {} names: give one per name, or none",
                req.digests.len(),
                req.names.len()
            )));
        }
        if req.deadline.is_zero() {
            return Err(AgentError::Argument("a fetch needs a deadline above zero".into()));
        }
        let state = Arc::new(FetchState::new(on_done, on_offer, Arc::downgrade(&self.inner)));
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

    /// A fetch's destination against its names and the pool: at least one block, none past
    /// `names` after the `held` ones, at most `max_names`, each inside the pool and given once.
    fn check_destination(&self, names: usize, held: usize, dst: &[u32]) -> Result<(), AgentError> {
        let arg = |s: String| Err(AgentError::Argument(s));
        let n = self.inner.layout.num_blocks();
        if dst.is_empty() {
            return arg("a fetch needs at least one destination block".into());
        }
        if held > names || dst.len() > names - held {
            return arg(format!(
                "{} destination blocks after {held} held ones, but the request has {names} names",
                dst.len()
            ));
        }
        if dst.len() > self.inner.limits.max_names as usize {
            return arg(format!("{} blocks in one fetch (max_names {})", dst.len(), self.inner.limits.max_names));
        }
        if let Some(&id) = dst.iter().find(|&&id| id >= n) {
            return arg(format!("destination block {id} is past the pool's {n} blocks"));
        }
        let mut sorted = dst.to_vec();
        sorted.sort_unstable();
        if sorted.windows(2).any(|w| w[0] == w[1]) {
            return arg("the same destination block twice".into());
        }
        Ok(())
    }

    /// The current speed estimate of `endpoint` (the TCP default before its first transfer).
    pub fn speed(&self, endpoint: &str) -> SourceSpeed {
        self.inner.estimator.speed(endpoint)
    }

    /// Seconds a fetch of `blocks` blocks from `endpoint` is expected to take, the runtime's
    /// import of them included ([`Agent::record_import`]; nothing before its first report);
    /// compare it with the runtime's own prefill time for those tokens (SPEC section 8, "fetch
    /// only when it pays"). Any `blocks` is taken (the byte count saturates: an absurd count
    /// gives an absurdly long estimate, never a wrapped short one). Two short locks, no
    /// allocation.
    pub fn estimate(&self, endpoint: &str, blocks: usize) -> f64 {
        let bytes = (blocks as u64).saturating_mul(self.inner.block_bytes as u64);
        self.inner.estimator.seconds(endpoint, bytes) + self.inner.import_cost.seconds(blocks)
    }

    /// Report that the runtime's own import of `blocks` fetched blocks (from the pool into the
    /// cache it computes with) took `seconds`, so that [`Agent::estimate`] counts it: a runtime
    /// whose cache is the pool itself never reports. `blocks` at most the pool's, `seconds` in
    /// `0..=3600` (a report past either is refused, so that one absurd report cannot hold the
    /// fit up for long). See [`ImportCost`] for the model. One short lock.
    pub fn record_import(&self, blocks: usize, seconds: f64) -> Result<(), AgentError> {
        if !(0.0..=estimate::MAX_IMPORT_SECONDS).contains(&seconds) {
            return Err(AgentError::Argument(format!(
                "an import of {seconds} seconds (0 to {})",
                estimate::MAX_IMPORT_SECONDS
            )));
        }
        let n = self.inner.layout.num_blocks();
        if blocks > n as usize {
            return Err(AgentError::Argument(format!("an import of {blocks} blocks, past the pool's {n}")));
        }
        self.inner.import_cost.record(blocks, seconds);
        Ok(())
    }

    /// Seconds the runtime's import of `blocks` blocks is expected to take, as it reported
    /// (0 before its first report): the part of [`Agent::estimate`] that is not the transfer.
    pub fn import_estimate(&self, blocks: usize) -> f64 {
        self.inner.import_cost.seconds(blocks)
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
        self.check_destination(names.len(), 0, dst)?;
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
        // a worker checks `stop` under the queue's lock and then waits: taking that lock between
        // the store and the wake-up means no worker can have checked before the store and wait
        // after the notify (a lost wake-up left kvrelay_agent_free joining it for ever)
        drop(inner.jobs.lock().unwrap_or_else(|e| e.into_inner()));
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
        // with every thread gone, the last reference goes with `self.inner`: `Inner`'s drop
        // drops the writes still withheld, then the backends, and hands the blocks back before
        // the holder goes (fetch handles may still hold weak references: they do not keep it)
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
