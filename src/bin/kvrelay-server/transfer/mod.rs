//! Cross-instance KV transfer (SPEC section 8), on the library's KV agent (SPEC section 9)
//! through the C ABI, as any embedder uses it: the layout fingerprint, the agent's holder over
//! this server's reuse cache, the destination's fetch into its reuse cache, the
//! fetch-only-when-it-pays estimate, and the reasons a fetch fails.
//!
//! A destination fetches the consecutive run of blocks, starting at the first block it does
//! not hold, whose own names appear among the hint's hashes (membership, not position: both
//! root-aligned and suffix-only lists work; a different naming scheme fetches nothing). The
//! agent moves the blocks (TCP, or NIXL with `--kv-transport nixl`) and verifies each against
//! the checksum the source recorded when the block became reusable; this module commits the
//! verified leading blocks to the reuse cache in prefix order and releases the rest. On any
//! failure the request prefills what it lacks and answers as a cold run.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvrelay::ffi::agent::{kvrelay_agent_fingerprint, kvrelay_fetch_failure as FetchFailure};
use serde::Deserialize;

use crate::abi::{FetchCall, FetchCanceller, FetchProvider, Holder, KvAgent};
use crate::cache::{BlockCache, Lease};
use crate::engine::{Engine, Shape};

/// What both sides compare before any data moves: the agent's fingerprint (the library's one
/// type; the naming scheme as its 64-bit id) of this instance's layout under naming scheme
/// `naming` ([`Engine::naming`]: the model's identity is part of it).
pub fn fingerprint(s: Shape, naming: &str) -> kvrelay_agent_fingerprint {
    kvrelay_agent_fingerprint {
        size: size_of::<kvrelay_agent_fingerprint>(),
        block_tokens: s.block_tokens as u32,
        layers: s.layers as u32,
        kv_heads: s.kv_heads as u32,
        head_dim: s.head_dim as u32,
        dtype_bytes: s.dtype_bytes as u32,
        naming: xxhash_rust::xxh3::xxh3_64(naming.as_bytes()),
    }
}

/// A fingerprint as `/v1/kv/info` shows it (and a source's is compared with ours): the agent's
/// fields, `naming` the scheme's text (`xxh3-chain/v1/NAME_SEED/MODEL_SEED`), `naming_id` its id.
pub fn fingerprint_json(fp: &kvrelay_agent_fingerprint, naming: &str) -> serde_json::Value {
    serde_json::json!({
        "block_tokens": fp.block_tokens,
        "layers": fp.layers,
        "kv_heads": fp.kv_heads,
        "head_dim": fp.head_dim,
        "dtype_bytes": fp.dtype_bytes,
        "naming": naming,
        "naming_id": fp.naming,
    })
}

/// Why a fetch failed (a metric label each): one of the agent's reasons
/// (`kvrelay_fetch_failure`, labelled as the agent labels it: one table, the library's), or the
/// one reason of the server's HTTP side of transfer, where no fetch was submitted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FailReason {
    /// A reason of the agent's: a `kvrelay_fetch_failure` value the library names (never
    /// `KVRELAY_FETCH_OK`).
    Agent(i32),
    /// A source advertised a KV endpoint off the trusted registry and off its own host.
    EndpointNotAllowed,
}

impl FailReason {
    /// The connection could not be opened.
    pub const CONNECT: FailReason = FailReason::Agent(FetchFailure::KVRELAY_FETCH_CONNECT as i32);
    /// A read, write or the whole transfer ran past its deadline.
    pub const TIMEOUT: FailReason = FailReason::Agent(FetchFailure::KVRELAY_FETCH_TIMEOUT as i32);
    /// The source refused.
    pub const REFUSED: FailReason = FailReason::Agent(FetchFailure::KVRELAY_FETCH_REFUSED as i32);
    /// The layouts differ.
    pub const FINGERPRINT_MISMATCH: FailReason =
        FailReason::Agent(FetchFailure::KVRELAY_FETCH_FINGERPRINT_MISMATCH as i32);
    /// Something the source sent is malformed.
    pub const CORRUPT: FailReason = FailReason::Agent(FetchFailure::KVRELAY_FETCH_CORRUPT as i32);
    /// Something failed inside this server.
    pub const INTERNAL: FailReason = FailReason::Agent(FetchFailure::KVRELAY_FETCH_INTERNAL as i32);

    /// The metric label: the agent's (`kvrelay_fetch_failure_name`), or `endpoint_not_allowed`.
    pub fn as_str(self) -> &'static str {
        match self {
            FailReason::Agent(f) => crate::abi::fetch_failure_name(f),
            FailReason::EndpointNotAllowed => "endpoint_not_allowed",
        }
    }

    /// The reason of an agent's `kvrelay_fetch_failure` value; a value this server does not
    /// know (a newer library's) is `internal`.
    pub fn of_agent(code: i32) -> FailReason {
        let known = code != FetchFailure::KVRELAY_FETCH_OK as i32 && crate::abi::fetch_failure_name(code) != "unknown";
        if known {
            FailReason::Agent(code)
        } else {
            FailReason::INTERNAL
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

/// Fault injection for tests (`--kv-fault`, only with `--debug-endpoints`), in the source's
/// holder: what the agent then finds in the pool, or a source that stops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Serve correctly.
    None,
    /// The second pinned block's bytes go bad in memory after its checksum was recorded.
    Corrupt,
    /// The source stops answering once it pinned the blocks (the reader's deadline must fire).
    Stall,
    /// The source's process exits once it pinned the blocks (a source killed mid-transfer).
    Die,
    /// The source answers 2 s late, once it pinned the blocks (below the readers' I/O timeout:
    /// the transfer then goes on), so that a destination's request can go away mid-fetch.
    Slow,
}

impl Fault {
    /// Parse a `--kv-fault` value.
    pub fn parse(s: &str) -> Result<Fault, String> {
        Ok(match s {
            "none" => Fault::None,
            "corrupt" => Fault::Corrupt,
            "stall" => Fault::Stall,
            "die" => Fault::Die,
            "slow" => Fault::Slow,
            _ => return Err(format!("--kv-fault {s}: expected none|corrupt|stall|die|slow")),
        })
    }
}

/// The agent's view of this server's reuse cache: pins take a reference on cached blocks (no
/// eviction while they are sent), unpins drop it; withheld destination blocks come back here.
pub struct CacheHolder {
    /// The block table.
    pub cache: Arc<BlockCache>,
    /// The engine, for `--kv-fault corrupt` (which writes a pinned block).
    pub engine: std::sync::Weak<Engine>,
    /// The fault to inject.
    pub fault: Fault,
}

impl Holder for CacheHolder {
    fn pin(&self, names: &[u64], ids: &mut [u32]) -> usize {
        let n = self.cache.pin(names, ids);
        match self.fault {
            Fault::None => {}
            Fault::Corrupt if n > 1 => {
                if let Some(e) = self.engine.upgrade() {
                    let _ = e.corrupt_block_id(ids[1]);
                }
            }
            Fault::Corrupt => {}
            Fault::Stall => std::thread::sleep(Duration::from_secs(60)),
            Fault::Slow => std::thread::sleep(Duration::from_secs(2)),
            Fault::Die => {
                eprintln!("kvrelay-server: --kv-fault die: exiting mid-transfer");
                std::process::exit(3);
            }
        }
        n
    }
    fn unpin(&self, ids: &[u32]) {
        self.cache.unpin(ids);
    }
    fn returned(&self, ids: &[u32]) {
        // the fetch kept these references for the agent; they are free blocks again
        self.cache.unpin(ids);
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

/// Fetch the run of `names` (the full-block names of `tokens`) that `hashes` covers from
/// `endpoint` into `engine`'s reuse cache, through `agent`. Unless `force`, skip it when local
/// prefill of those tokens is estimated faster. Never blocks a runtime thread: the agent's
/// completion arrives by callback.
pub async fn fetch_into_cache(
    engine: &Arc<Engine>,
    agent: &KvAgent,
    endpoint: &str,
    tokens: &[u32],
    names: &[u64],
    hashes: &[u64],
    force: bool,
) -> FetchOutcome {
    let held = engine.cache.held_prefix(names);
    let run = crate::abi::run_to_fetch(names, held, hashes);
    let mut out = FetchOutcome::default();
    if run.is_empty() {
        out.nothing = true;
        return out;
    }
    let bb = engine.store.block_bytes();
    out.estimate_s = agent.estimate(endpoint, run.len());
    let rate = engine.prefill_rate();
    out.local_s = if rate > 0.0 { (run.len() * engine.config.shape.block_tokens) as f64 / rate } else { f64::INFINITY };
    if !force && rate > 0.0 && out.local_s < out.estimate_s {
        out.not_worth_it = true;
        return out;
    }
    // Fresh blocks for the whole run, all or none (waits while the pool is full).
    let mut lease = match tokio::time::timeout(Duration::from_secs(10), engine.cache.acquire(&[], run.len())).await {
        Ok(Ok(l)) => l,
        Ok(Err(n)) => {
            out.error = Some(FetchError::new(
                FailReason::REFUSED,
                format!("the run needs {} blocks, the pool holds {}", n.needed, n.capacity),
            ));
            return out;
        }
        Err(_) => {
            out.error = Some(FetchError::new(FailReason::TIMEOUT, "no free KV blocks to receive into"));
            return out;
        }
    };
    let deadline_ms = crate::abi::fetch_deadline_ms((run.len() * bb) as u64);
    // checked by content: a block is taken only under the digest of this request's own tokens
    let digests = engine.block_digests(&tokens[..names.len() * engine.config.shape.block_tokens]);
    let pending = match agent.fetch(endpoint, names, &digests, held, &lease.ids, deadline_ms) {
        Ok(p) => p,
        Err(e) => {
            out.error = Some(FetchError::new(FailReason::REFUSED, e));
            return out;
        }
    };
    // The fetch owns its destination blocks until its completion: the lease goes to a task of
    // its own that waits for the completion, commits what was verified and only then lets go,
    // whether or not this request still waits for it. A request that goes away (this future
    // dropped) cancels the fetch; the blocks come back once nothing writes them.
    let cancel = CancelOnDrop(Some(pending.canceller()));
    let bt = engine.config.shape.block_tokens;
    // the run's tokens (copied only when KV events are published) and the name before it, for
    // the events of what gets committed
    let run_tokens =
        if engine.cache.publishes() { tokens[held * bt..(held + run.len()) * bt].to_vec() } else { Vec::new() };
    let parent = held.checked_sub(1).map(|p| names[p]);
    let (engine, names, run) = (engine.clone(), names.to_vec(), run.to_vec());
    let completion = tokio::spawn(async move {
        let (r, detail) = pending.done().await;
        // the agent wrote and verified exactly the leading `r.blocks`: commit those, in order
        let committed = r.blocks.min(run.len());
        for (i, &name) in run.iter().enumerate().take(committed) {
            let parent = if i == 0 { parent } else { Some(run[i - 1]) };
            lease.commit(i, name, parent, run_tokens.get(i * bt..(i + 1) * bt).unwrap_or(&[]));
        }
        // Destination blocks the agent withheld (a NIXL READ not proven stopped) keep their
        // reference until the holder's `returned`; the rest of the lease goes back on drop.
        let tail = lease.ids.split_off(committed);
        let withheld = r.withheld.min(tail.len());
        lease.ids.extend_from_slice(&tail[withheld..]);
        // Pin the prefix now held (committed blocks included) while the fetch's lease still
        // references them: no eviction can slip in before generation takes its own lease.
        let hold = if committed > 0 { PrefixHold(Some(engine.cache.pin_prefix(&names))) } else { PrefixHold(None) };
        drop(lease);
        (r, detail, committed, hold)
    });
    let done = completion.await;
    cancel.disarm();
    let Ok((r, detail, committed, hold)) = done else {
        out.error = Some(FetchError::new(FailReason::INTERNAL, "the fetch's completion task ended early"));
        return out;
    };
    out.blocks = committed;
    out.bytes = committed * bb;
    out.seconds = r.seconds;
    out.hold = hold;
    if r.failure != 0 {
        out.error = Some(FetchError::new(FailReason::of_agent(r.failure), detail));
    }
    out
}

/// Cancels a fetch when the future that waits for it is dropped before its completion.
struct CancelOnDrop(Option<FetchCanceller>);

impl CancelOnDrop {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(c) = self.0.take() {
            c.cancel();
        }
    }
}

/// Shared transfer state of an instance.
pub struct TransferState {
    /// The KV agent: serves this instance's blocks, fetches from others.
    pub agent: Arc<KvAgent>,
    /// `tcp` or `nixl`.
    pub transport: &'static str,
    /// This instance's fingerprint (the agent's).
    pub fingerprint: kvrelay_agent_fingerprint,
    /// Its naming scheme's text ([`fingerprint_json`]).
    pub naming: String,
    /// The KV service's endpoint (`tcp://host:port`).
    pub endpoint: String,
    /// `recompute` (false) or `fail` (true) on a failed load.
    pub fail_on_load_error: bool,
    /// The engine whose pool the agent serves and fills: dropped after the agent (field order).
    pub pool: Arc<Engine>,
    /// The KV events publisher (`--kv-events-endpoint`), if on.
    pub events: Option<Arc<crate::abi::KvEvents>>,
}
