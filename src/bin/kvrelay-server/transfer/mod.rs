//! Cross-instance KV transfer (SPEC section 8): the layout fingerprint, the `Transport` seam,
//! the destination's fetch into its reuse cache, the fetch-only-when-it-pays estimate, and the
//! reasons a fetch fails.
//!
//! A destination fetches the consecutive run of blocks, starting at the first block it does
//! not hold, whose own names appear among the hint's hashes (membership, not position: both
//! root-aligned and suffix-only lists work; a different naming scheme fetches nothing). Over
//! TCP ([`tcp`]) each block arrives with its name and XXH3-64 checksum; over NIXL (`nixl`,
//! feature `nixl`) the destination reads blocks in place and checks the `kvsum` the source
//! recorded. Either way a block is committed to the reuse cache only when its length, name and
//! checksum check out, in prefix order. Whatever is partial is released. On any failure the
//! request prefills what it lacks and answers as a cold run.

pub mod api;
#[cfg(feature = "nixl")]
pub mod nixl;
pub mod tcp;

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::abi::{FetchCall, FetchProvider};
use crate::cache::Lease;
use crate::engine::{Engine, Shape, MODEL_SEED, NAME_SEED};

/// What both sides compare before any data moves.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fingerprint {
    /// Tokens per block.
    pub block_tokens: u32,
    /// Layers.
    pub layers: u32,
    /// KV heads.
    pub kv_heads: u32,
    /// Head size.
    pub head_dim: u32,
    /// Bytes per element.
    pub dtype_bytes: u32,
    /// Naming scheme and model: `xxh3-chain/v1/NAME_SEED/MODEL_SEED` in hex.
    pub naming: String,
}

impl Fingerprint {
    /// The fingerprint of this instance's layout.
    pub fn of(s: Shape) -> Fingerprint {
        Fingerprint {
            block_tokens: s.block_tokens as u32,
            layers: s.layers as u32,
            kv_heads: s.kv_heads as u32,
            head_dim: s.head_dim as u32,
            dtype_bytes: s.dtype_bytes as u32,
            naming: format!("xxh3-chain/v1/{NAME_SEED:016x}/{MODEL_SEED:016x}"),
        }
    }
}

/// Why a fetch failed (a metric label each).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FailReason {
    /// The connection could not be opened.
    Connect,
    /// A read, write or the whole transfer ran past its deadline.
    Timeout,
    /// The source refused (peer not allowed, too many blocks, busy).
    Refused,
    /// The layouts differ.
    FingerprintMismatch,
    /// A block's length, name or checksum is wrong, or a frame is malformed.
    Corrupt,
    /// The stream ended early.
    Truncated,
    /// The source holds none of the blocks asked for.
    SourceMiss,
    /// A source advertised a KV endpoint off the trusted registry and off its own host.
    EndpointNotAllowed,
}

impl FailReason {
    /// Every reason.
    pub const ALL: [FailReason; 8] = [
        FailReason::Connect,
        FailReason::Timeout,
        FailReason::Refused,
        FailReason::FingerprintMismatch,
        FailReason::Corrupt,
        FailReason::Truncated,
        FailReason::SourceMiss,
        FailReason::EndpointNotAllowed,
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            FailReason::Connect => "connect",
            FailReason::Timeout => "timeout",
            FailReason::Refused => "refused",
            FailReason::FingerprintMismatch => "fingerprint_mismatch",
            FailReason::Corrupt => "corrupt",
            FailReason::Truncated => "truncated",
            FailReason::SourceMiss => "source_miss",
            FailReason::EndpointNotAllowed => "endpoint_not_allowed",
        }
    }
}

impl fmt::Display for FailReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A failed fetch: the reason, and what was committed before it failed.
#[derive(Debug, Clone)]
pub struct FetchError {
    /// Why.
    pub reason: FailReason,
    /// Detail for logs (never hint bytes).
    pub detail: String,
}

impl FetchError {
    /// A failure.
    pub fn new(reason: FailReason, detail: impl Into<String>) -> FetchError {
        FetchError { reason, detail: detail.into() }
    }
}

/// Receives verified blocks in prefix order: `(position in the run, bytes)`. A transport may
/// call it from a blocking thread, overlapped with reading the next block; never two calls at
/// once, always in order.
pub type BlockSink = Arc<dyn Fn(usize, &[u8]) -> Result<(), FetchError> + Send + Sync>;

/// Publishes block `i` of the run, which a transport wrote in place into `lease.ids[i]` and
/// verified. Never two calls at once, always in order.
pub type CommitFn = Arc<dyn Fn(usize) + Send + Sync>;

/// Where a fetched run goes: fresh blocks of the destination's pool, one per name, and the two
/// ways in. A transport that carries bytes hands each verified block to `sink` (which writes
/// it through the copy engine, then commits); one that writes into the pool in place (NIXL)
/// verifies `lease.ids[i]` where it lies, then calls `commit`. Either way, a block is
/// published only when complete and checked, in prefix order.
#[derive(Clone)]
pub struct Destination {
    /// The fresh blocks. A transport that cannot prove a write into them has stopped keeps a
    /// clone alive forever (the blocks leave the pool rather than risk reuse).
    pub lease: Arc<Lease>,
    /// Verified bytes of block `i`.
    pub sink: BlockSink,
    /// Block `i` is complete and verified in place.
    pub commit: CommitFn,
}

/// A boxed future (the seam is object-safe).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// How block bytes move between instances. The embedded default is [`tcp::TcpTransport`].
pub trait Transport: Send + Sync {
    /// Name for logs and `/v1/kv/info`.
    fn name(&self) -> &'static str;
    /// Ask `endpoint` for the blocks `names` (a consecutive run) and deliver every verified
    /// block into `dest`, in order. Returns how many blocks were delivered; fewer than asked
    /// when the source holds only a leading part.
    fn fetch<'a>(
        &'a self,
        endpoint: &'a str,
        names: &'a [u64],
        dest: Destination,
    ) -> BoxFuture<'a, Result<usize, FetchError>>;
}

/// What a validated `kv.fetch` asks for.
#[derive(Clone, Debug)]
pub struct FetchPlan {
    /// Normalized endpoint (`tcp://host:port`), in the trusted registry.
    pub endpoint: String,
    /// The hint's block hashes.
    pub hashes: Vec<u64>,
}

/// The `kv.fetch` payload the provider accepts. The endpoint must be a string, but the provider
/// connects to the orchestrator's normalized, registry-checked form of it, never to this text.
#[derive(Deserialize)]
struct Payload {
    #[serde(rename = "source_control_endpoint")]
    _source_control_endpoint: String,
    block_hashes: Vec<u64>,
}

/// Most hashes a hint may carry (more than any pool holds).
pub const MAX_HINT_HASHES: usize = 1 << 20;

/// Provider codes (the server's own).
pub mod code {
    /// The payload lacks a string endpoint or a list of u64 hashes.
    pub const BAD_PAYLOAD: i32 = 2;
    /// An action version this provider does not speak.
    pub const BAD_VERSION: i32 = 3;
    /// No hashes, or more than [`super::MAX_HINT_HASHES`].
    pub const BAD_HASHES: i32 = 4;
    /// The endpoint is not a `tcp://` endpoint this transport can reach.
    pub const BAD_ENDPOINT: i32 = 5;
    /// Asked to fetch without a [`super::PlanSlot`] to leave the plan in.
    pub const NO_CONTEXT: i32 = 6;
}

/// The server's provider: validates the `kv.fetch` payload on its own terms, then takes the
/// fetch by leaving the plan in the [`PlanSlot`] the request passed as the call's context
/// (`kvrelay_orchestrate_with_context`); without one, it refuses.
pub struct KvProvider;

/// Where [`KvProvider`] leaves the plan it accepted for one request.
pub type PlanSlot = Mutex<Option<FetchPlan>>;

fn plan_of(call: &FetchCall<'_>) -> Result<FetchPlan, i32> {
    if call.action_version != "1.0" {
        return Err(code::BAD_VERSION);
    }
    let p: Payload = serde_json::from_slice(call.payload).map_err(|_| code::BAD_PAYLOAD)?;
    if p.block_hashes.is_empty() || p.block_hashes.len() > MAX_HINT_HASHES {
        return Err(code::BAD_HASHES);
    }
    // The orchestrator checked the registry against its normalized form (`call.endpoint`); the
    // provider checks on its own that it is an endpoint its transport speaks.
    // (syntax only: resolving a name would block the request's thread; the transport
    // resolves it on its own when it connects)
    let port_ok = call
        .endpoint
        .strip_prefix("tcp://")
        .and_then(|hp| hp.rsplit_once(':'))
        .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p != 0));
    if !port_ok {
        return Err(code::BAD_ENDPOINT);
    }
    Ok(FetchPlan { endpoint: call.endpoint.to_string(), hashes: p.block_hashes })
}

impl FetchProvider for KvProvider {
    fn validate(&self, call: &FetchCall<'_>) -> Result<(), i32> {
        plan_of(call).map(|_| ())
    }
    fn fetch(&self, call: &FetchCall<'_>) -> Result<(), i32> {
        let slot = call.context.and_then(|c| c.downcast_ref::<PlanSlot>()).ok_or(code::NO_CONTEXT)?;
        let plan = plan_of(call)?;
        *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(plan);
        Ok(())
    }
}

/// The run to fetch: from the first block not held here (`held` leading blocks are), the
/// consecutive names that appear among `hashes`.
pub fn run_to_fetch(names: &[u64], held: usize, hashes: &[u64]) -> Vec<u64> {
    let set: HashSet<u64> = hashes.iter().copied().collect();
    names[held..].iter().take_while(|n| set.contains(n)).copied().collect()
}

/// Per-source transfer speed: setup latency and throughput, moving averages.
#[derive(Clone, Copy, Debug)]
pub struct SourceSpeed {
    /// Seconds before the first byte.
    pub setup_s: f64,
    /// Bytes per second after it.
    pub bytes_per_s: f64,
}

/// The estimate before the first transfer from a source: 2 ms setup, 1 GB/s (a loopback or
/// datacenter TCP stream; replaced by measurements after one transfer).
pub const DEFAULT_SPEED: SourceSpeed = SourceSpeed { setup_s: 0.002, bytes_per_s: 1e9 };

/// The NIXL estimate before the first transfer from a source, GPU pools: 5 ms setup, 100 GB/s
/// (VRAM READs over CUDA IPC measured 90-155 GB/s on the H200, `benches/RESULTS.md`).
pub const NIXL_VRAM_DEFAULT: SourceSpeed = SourceSpeed { setup_s: 0.005, bytes_per_s: 100e9 };
/// The NIXL estimate before the first transfer, host pools or pinned staging: 5 ms, 3 GB/s
/// (UCX's host-memory READ and the staged path measured 3.2-4.6 GB/s there).
pub const NIXL_HOST_DEFAULT: SourceSpeed = SourceSpeed { setup_s: 0.005, bytes_per_s: 3e9 };

/// Moving averages per source.
pub struct Estimator {
    default: SourceSpeed,
    by_source: Mutex<HashMap<String, SourceSpeed>>,
}

impl Default for Estimator {
    fn default() -> Estimator {
        Estimator::new(DEFAULT_SPEED)
    }
}

impl Estimator {
    /// Sources start at `default` (the transport's documented default).
    pub fn new(default: SourceSpeed) -> Estimator {
        Estimator { default, by_source: Mutex::new(HashMap::new()) }
    }

    /// The current estimate for `source`.
    pub fn speed(&self, source: &str) -> SourceSpeed {
        self.by_source.lock().unwrap_or_else(|e| e.into_inner()).get(source).copied().unwrap_or(self.default)
    }

    /// Fold in a measured transfer (weight 1/4 for the new sample).
    pub fn record(&self, source: &str, setup: Duration, bytes: usize, data_time: Duration) {
        let mut m = self.by_source.lock().unwrap_or_else(|e| e.into_inner());
        let e = m.entry(source.to_string()).or_insert(self.default);
        e.setup_s = 0.75 * e.setup_s + 0.25 * setup.as_secs_f64();
        if bytes > 0 && data_time > Duration::ZERO {
            e.bytes_per_s = 0.75 * e.bytes_per_s + 0.25 * (bytes as f64 / data_time.as_secs_f64());
        }
    }
}

/// The request's pin on its cached prefix, taken before a fetch lets go of the blocks it
/// committed, so they cannot be evicted before generation references them (drop it once the
/// engine holds its own lease).
#[derive(Default)]
pub struct PrefixHold(pub Option<Lease>);

impl std::fmt::Debug for PrefixHold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PrefixHold({} blocks)", self.0.as_ref().map_or(0, |l| l.ids.len()))
    }
}

/// What a fetch into the cache did.
#[derive(Debug, Default)]
pub struct FetchOutcome {
    /// Blocks committed to the reuse cache.
    pub blocks: usize,
    /// Bytes received and committed.
    pub bytes: usize,
    /// Failure, if any (blocks before it stay committed: they were complete and verified).
    pub error: Option<FetchError>,
    /// Estimated fetch seconds.
    pub estimate_s: f64,
    /// Modeled local prefill seconds for the same tokens.
    pub local_s: f64,
    /// Skipped: local prefill is faster.
    pub not_worth_it: bool,
    /// Nothing to fetch (everything held here already, or no name of the hint matches).
    pub nothing: bool,
    /// Seconds the transfer took.
    pub seconds: f64,
    /// The held prefix, pinned (after committed blocks), for the generation that follows.
    pub hold: PrefixHold,
}

/// Fetch the run of `names` that `hashes` covers from `endpoint` into `engine`'s reuse cache.
/// Unless `force`, skip it when local prefill of those tokens is estimated faster.
pub async fn fetch_into_cache(
    engine: &Arc<Engine>,
    transport: &dyn Transport,
    estimator: &Estimator,
    endpoint: &str,
    names: &[u64],
    hashes: &[u64],
    force: bool,
) -> FetchOutcome {
    let held = engine.cache.held_prefix(names);
    let run = run_to_fetch(names, held, hashes);
    let mut out = FetchOutcome::default();
    if run.is_empty() {
        out.nothing = true;
        return out;
    }
    let bb = engine.store.block_bytes();
    let speed = estimator.speed(endpoint);
    out.estimate_s = speed.setup_s + (run.len() * bb) as f64 / speed.bytes_per_s;
    let rate = engine.config.prefill_tokens_per_s;
    out.local_s = if rate > 0.0 { (run.len() * engine.config.shape.block_tokens) as f64 / rate } else { f64::INFINITY };
    if !force && rate > 0.0 && out.local_s < out.estimate_s {
        out.not_worth_it = true;
        return out;
    }
    // Fresh blocks for the whole run, all or none (waits while the pool is full).
    let lease = match tokio::time::timeout(Duration::from_secs(10), engine.cache.acquire(&[], run.len())).await {
        Ok(Ok(l)) => l,
        Ok(Err(n)) => {
            out.error = Some(FetchError::new(
                FailReason::Refused,
                format!("the run needs {} blocks, the pool holds {}", n.needed, n.capacity),
            ));
            return out;
        }
        Err(_) => {
            out.error = Some(FetchError::new(FailReason::Timeout, "no free KV blocks to receive into"));
            return out;
        }
    };
    let started = Instant::now();
    let first_byte = Arc::new(std::sync::OnceLock::<Duration>::new());
    let committed = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let lease = Arc::new(lease);
    let run = Arc::new(run);
    let commit: CommitFn = {
        let (lease, run, committed, first_byte) = (lease.clone(), run.clone(), committed.clone(), first_byte.clone());
        Arc::new(move |i: usize| {
            first_byte.get_or_init(|| started.elapsed());
            lease.commit(i, run[i]);
            committed.store(i + 1, std::sync::atomic::Ordering::Release);
        })
    };
    let sink: BlockSink = {
        let (engine, lease, commit) = (engine.clone(), lease.clone(), commit.clone());
        Arc::new(move |i: usize, bytes: &[u8]| -> Result<(), FetchError> {
            if let Err(e) = engine.store.write(&lease.ids[i..i + 1], bytes) {
                return Err(FetchError::new(FailReason::Corrupt, format!("writing a received block: {e}")));
            }
            commit(i);
            Ok(())
        })
    };
    let dest = Destination { lease: lease.clone(), sink, commit };
    let result = transport.fetch(endpoint, &run, dest).await;
    let committed = committed.load(std::sync::atomic::Ordering::Acquire);
    out.blocks = committed;
    out.bytes = committed * bb;
    out.seconds = started.elapsed().as_secs_f64();
    match result {
        Ok(0) => out.error = Some(FetchError::new(FailReason::SourceMiss, "the source holds none of the blocks")),
        Ok(_) => {
            let setup = first_byte.get().copied().unwrap_or_default();
            estimator.record(endpoint, setup, out.bytes, started.elapsed().saturating_sub(setup));
        }
        Err(e) => out.error = Some(e),
    }
    // Pin the prefix now held (committed blocks included) while the fetch's lease still
    // references them: no eviction can slip in before generation takes its own lease.
    if committed > 0 {
        out.hold = PrefixHold(Some(engine.cache.pin_prefix(names)));
    }
    // Committed blocks stay cached; the rest go back to the free list when the last holder of
    // the lease (this function, or a transport's blocking stage still unwinding) drops it.
    drop(lease);
    out
}

/// Shared transfer state of an instance.
pub struct TransferState {
    /// The transport.
    pub transport: Arc<dyn Transport>,
    /// Per-source speed.
    pub estimator: Estimator,
    /// This instance's fingerprint.
    pub fingerprint: Fingerprint,
    /// The KV service's endpoint (`tcp://host:port`).
    pub endpoint: String,
    /// `recompute` (false) or `fail` (true) on a failed load.
    pub fail_on_load_error: bool,
}
