//! The KV agent from C (feature `agent`): configuration, the runtime's block holder, fetches
//! with completion by callback or poll, the cost estimate and the counters. The behaviour is
//! the Rust [`crate::agent`]'s; this module only converts and guards.

use std::ffi::{c_char, c_void};
use std::time::Duration;

use super::boundary::{fill, free_box, guard, input, input_mut, out_ptr, put, text, with_detail};
use super::copy::{array, kvrelay_kv_layout, layout_of};
use super::status::kvrelay_status::{self, *};
use super::types::kvrelay_str;
use crate::agent::{
    Agent, AgentConfig, AgentError, AgentStats, BlockHolder, FailReason, Fetch, FetchRequest, FetchResult, Fingerprint,
    LimitKey, PeerAllow, Psk, Transport,
};

/// What two instances compare before any block moves (`naming`: the runtime's naming-scheme id).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvrelay_agent_fingerprint {
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
    /// The runtime's naming-scheme id: equal ids must mean equal block names for equal KV.
    pub naming: u64,
}

/// One of the agent's limits, for `kvrelay_agent_config_set_limit` / `_get_limit` (a limit by
/// name, so that limits can be added without changing a struct a caller compiled in). Fixed
/// values; `kvrelay_agent_limit_name` gives the label. Times in milliseconds; every value must
/// be at least 1, except `KVRELAY_LIMIT_IDLE_TIMEOUT_MS` and `KVRELAY_LIMIT_SOCKET_BUFFER_BYTES`.
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvrelay_agent_limit {
    /// Connections serving transfers at once, all peers together (64; at most 4096).
    KVRELAY_LIMIT_MAX_CONNECTIONS = 1,
    /// Connections from one peer address, serving or in their handshake (16: a peer's
    /// `fetch_threads` times its `streams`; at most 4096); a kept-alive connection waiting for
    /// its next hello counts again only when that hello comes.
    KVRELAY_LIMIT_MAX_PER_PEER = 2,
    /// Connections that have not sent a valid first message yet (32; at most 4096); they never
    /// hold a serving slot. Kept-alive connections waiting for their next hello count here too,
    /// up to half of it only, so that new peers always find handshake slots.
    KVRELAY_LIMIT_MAX_PENDING = 3,
    /// Time a new connection has for its handshake (2000 ms; at most one hour).
    KVRELAY_LIMIT_HANDSHAKE_TIMEOUT_MS = 4,
    /// Deadline of every other read and write (5000 ms; at most one hour).
    KVRELAY_LIMIT_IO_TIMEOUT_MS = 5,
    /// Connect deadline of a fetch (2000 ms; at most one hour).
    KVRELAY_LIMIT_CONNECT_TIMEOUT_MS = 6,
    /// Most names in one request, served or fetched (65536; at most 4194304).
    KVRELAY_LIMIT_MAX_NAMES = 7,
    /// Fetch worker threads (4; at most 256).
    KVRELAY_LIMIT_FETCH_THREADS = 8,
    /// Fetches waiting for a worker before submission answers `KVRELAY_ERR_BUSY` (1024).
    KVRELAY_LIMIT_MAX_QUEUED_FETCHES = 9,
    /// TCP connections one fetch spreads its run over, each with a contiguous part of at least
    /// `min_stream_bytes` (4; at most 16; NIXL fetches use one). The agent makes this many
    /// movers (two staging slots of 4 MiB or one block each, pinned for a GPU pool) when it starts.
    KVRELAY_LIMIT_STREAMS = 10,
    /// Least bytes each stream of a multi-stream fetch carries (8388608: 8 MiB).
    KVRELAY_LIMIT_MIN_STREAM_BYTES = 11,
    /// How long a connection stays open after a transfer for the next one between the same two
    /// agents (5000 ms; 0: one transfer per connection).
    KVRELAY_LIMIT_IDLE_TIMEOUT_MS = 12,
    /// Socket send and receive buffer size of every agent connection, bytes (0: the kernel's
    /// autotuning, the default).
    KVRELAY_LIMIT_SOCKET_BUFFER_BYTES = 13,
}

/// An agent's configuration under construction. Owned: `_free`.
pub struct kvrelay_agent_config {
    inner: AgentConfig,
    /// `kvrelay_agent_config_allow_peer` replaces the default (loopback) on its first call.
    allow_touched: bool,
}

/// The runtime's reuse cache, as the agent's service sees it. `pin` and `unpin` run on the
/// agent's connection threads, several at once: they must be thread-safe, must not unwind or
/// `longjmp` out (catch C++ exceptions inside) and must not call back into this agent.
/// - `pin(user_data, names, n, ids_out)`: of the `n` consecutive block names, find the leading
///   run this instance holds, pin those blocks (no eviction, no write, no reuse until `unpin`),
///   write their block ids into `ids_out[0..k]` (room for `n`) and return `k` (0: the first
///   name is not held). The agent serves only blocks whose checksum was recorded
///   (`kvrelay_agent_record_checksums`).
/// - `unpin(user_data, ids, k)`: release blocks pinned by `pin` (each exactly once).
/// - `destroy(user_data)` (may be NULL): called once when the agent is freed, after its last use
///   of the holder, or when `kvrelay_agent_new` fails.
/// - `returned(user_data, ids, k)` (may be NULL over TCP; needed with NIXL): destination blocks
///   a fetch withheld (`kvrelay_fetch_result.withheld`) are free again, no transfer can write
///   them any more. Runs on a fetch worker, or in `kvrelay_agent_free`. Without it withheld
///   blocks stay out of the runtime's pool for good (counted in `blocks_withheld`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct kvrelay_block_holder {
    /// Passed back to every callback.
    pub user_data: *mut c_void,
    /// Pin the leading held run of `names`.
    pub pin:
        Option<unsafe extern "C" fn(user_data: *mut c_void, names: *const u64, n: usize, ids_out: *mut u32) -> usize>,
    /// Release pinned blocks.
    pub unpin: Option<unsafe extern "C" fn(user_data: *mut c_void, ids: *const u32, n: usize)>,
    /// Release `user_data`.
    pub destroy: Option<unsafe extern "C" fn(user_data: *mut c_void)>,
    /// Withheld destination blocks are free again.
    pub returned: Option<unsafe extern "C" fn(user_data: *mut c_void, ids: *const u32, n: usize)>,
}

struct CHolder(kvrelay_block_holder);

// SAFETY: the holder contract (documented on kvrelay_block_holder) requires its callbacks and
// user_data to be usable from any thread, concurrently.
unsafe impl Send for CHolder {}
// SAFETY: as above.
unsafe impl Sync for CHolder {}

impl Drop for CHolder {
    fn drop(&mut self) {
        if let Some(d) = self.0.destroy {
            // SAFETY: called exactly once, with the user_data the consumer supplied for it.
            unsafe { d(self.0.user_data) };
        }
    }
}

impl BlockHolder for CHolder {
    fn pin(&self, names: &[u64], ids: &mut [u32]) -> usize {
        match self.0.pin {
            // SAFETY: the consumer's callback; `names` and `ids` are live slices of `names.len()`
            // elements for the duration of the call (the agent checks what it answers).
            Some(f) => unsafe { f(self.0.user_data, names.as_ptr(), names.len(), ids.as_mut_ptr()) },
            None => 0,
        }
    }
    fn unpin(&self, ids: &[u32]) {
        if let Some(f) = self.0.unpin {
            // SAFETY: the consumer's callback; `ids` is a live slice for the call's duration.
            unsafe { f(self.0.user_data, ids.as_ptr(), ids.len()) }
        }
    }
    fn returned(&self, ids: &[u32]) {
        if let Some(f) = self.0.returned {
            // SAFETY: the consumer's callback; `ids` is a live slice for the call's duration.
            unsafe { f(self.0.user_data, ids.as_ptr(), ids.len()) }
        }
    }
}

/// A running KV agent. Owned: `_free`. Every function on it is thread-safe.
pub struct kvrelay_agent {
    inner: Agent,
}

/// A submitted fetch. Owned: `_free` (which neither cancels the fetch nor suppresses its
/// completion callback). Thread-safe.
pub struct kvrelay_fetch {
    inner: Fetch,
}

/// Why a fetch stopped early: `kvrelay_fetch_result.failure`. Fixed values;
/// `kvrelay_fetch_failure_name` gives the metric label.
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvrelay_fetch_failure {
    /// Not a failure: every block the source offered arrived verified.
    KVRELAY_FETCH_OK = 0,
    /// The endpoint did not resolve or the connection could not be opened.
    KVRELAY_FETCH_CONNECT = 1,
    /// A read, a write, the connect or the whole fetch ran past its deadline.
    KVRELAY_FETCH_TIMEOUT = 2,
    /// The source refused (not allowed, busy, per-peer limit, bad request, too many names).
    KVRELAY_FETCH_REFUSED = 3,
    /// The layouts or naming schemes differ.
    KVRELAY_FETCH_FINGERPRINT_MISMATCH = 4,
    /// A block's name, length or checksum is wrong, or a frame is malformed.
    KVRELAY_FETCH_CORRUPT = 5,
    /// The stream ended early.
    KVRELAY_FETCH_TRUNCATED = 6,
    /// The source holds none of the blocks asked for.
    KVRELAY_FETCH_SOURCE_MISS = 7,
    /// Authentication failed (a wrong key, or one side has none).
    KVRELAY_FETCH_AUTH_FAILED = 8,
    /// `kvrelay_fetch_cancel` stopped it.
    KVRELAY_FETCH_CANCELLED = 9,
    /// The agent was freed.
    KVRELAY_FETCH_SHUTDOWN = 10,
}

/// How a fetch ended.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvrelay_fetch_result {
    /// A `kvrelay_fetch_failure` value; `KVRELAY_FETCH_OK` (0) when nothing failed (the source
    /// may still have offered fewer blocks than asked: its leading run).
    pub failure: i32,
    /// Leading destination blocks written and verified: commit exactly `dst_blocks[0..blocks]`,
    /// in order, whatever `failure` says.
    pub blocks: usize,
    /// Their bytes.
    pub bytes: u64,
    /// Seconds from submission to completion.
    pub seconds: f64,
    /// Destination blocks after the verified ones that the agent still holds (NIXL only: a
    /// READ into them could not be proven stopped): `dst_blocks[blocks..blocks + withheld]`
    /// must not be reused until the holder's `returned` hands them back. 0 over TCP.
    pub withheld: usize,
}

impl From<&FetchResult> for kvrelay_fetch_result {
    fn from(r: &FetchResult) -> Self {
        kvrelay_fetch_result {
            failure: r.failure.map_or(0, |f| f as i32),
            blocks: r.blocks,
            bytes: r.bytes,
            seconds: r.seconds,
            withheld: r.withheld,
        }
    }
}

/// One fetch to submit. Arrays are copied by `kvrelay_agent_fetch`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvrelay_fetch_params {
    /// The source's KV endpoint, `tcp://host:port`, as the orchestration decision authorized it
    /// (`kvrelay_fetch_request.endpoint`).
    pub endpoint: kvrelay_str,
    /// The request's own block names, from block 0.
    pub names: *const u64,
    /// Number of names.
    pub names_len: usize,
    /// Leading blocks the runtime holds already (not fetched).
    pub held: usize,
    /// Free destination blocks reserved for the fetch: name `held + i` goes into
    /// `dst_blocks[i]`; as many blocks are asked for as given (at most `names_len - held`).
    pub dst_blocks: *const u32,
    /// Number of destination blocks (at least 1).
    pub dst_len: usize,
    /// The whole fetch's deadline in milliseconds from submission (at least 1).
    pub deadline_ms: u32,
}

/// A source's speed estimate.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvrelay_source_speed {
    /// Seconds before the first verified block.
    pub setup_s: f64,
    /// Bytes per second after it.
    pub bytes_per_s: f64,
}

fn agent_err(e: AgentError) -> kvrelay_status {
    match e {
        AgentError::Config(d) => with_detail(KVRELAY_ERR_INVALID_CONFIG, d),
        AgentError::Argument(d) => with_detail(KVRELAY_ERR_INVALID_ARGUMENT, d),
        AgentError::Io(d) => with_detail(KVRELAY_ERR_IO, d),
        AgentError::Busy => with_detail(KVRELAY_ERR_BUSY, "the agent's fetch queue is full"),
        AgentError::Cuda(e) => super::copy::status_of(e),
    }
}

/// A configuration with the defaults: listen on `127.0.0.1:0`, loopback peers only, the
/// default limits, no key.
///
/// # Safety
/// `fingerprint` NULL or readable; `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_agent_config_new(
    fingerprint: *const kvrelay_agent_fingerprint,
    out: *mut *mut kvrelay_agent_config,
) -> kvrelay_status {
    guard(|| {
        let out = out_ptr(out)?;
        // SAFETY: forwarded contract.
        let f = unsafe { input(fingerprint) }?;
        let fp = Fingerprint {
            block_tokens: f.block_tokens,
            layers: f.layers,
            kv_heads: f.kv_heads,
            head_dim: f.head_dim,
            dtype_bytes: f.dtype_bytes,
            naming: f.naming,
        };
        let cfg = kvrelay_agent_config { inner: AgentConfig::new(fp), allow_touched: false };
        // SAFETY: checked non-NULL; writable per the contract.
        unsafe { put(out, Box::into_raw(Box::new(cfg))) };
        Ok(())
    })
}

/// Free a configuration (NULL does nothing).
///
/// # Safety
/// `config` NULL or live and not in use by another thread.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_agent_config_free(config: *mut kvrelay_agent_config) {
    // SAFETY: forwarded contract.
    unsafe { free_box(config) }
}

/// Where the KV service listens: `host:port` (port 0 picks one; `kvrelay_agent_endpoint` tells
/// which). `(NULL, 0)`: serve nothing (a fetch-only agent).
///
/// # Safety
/// `config` NULL or live; `addr` readable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_agent_config_set_listen(
    config: *mut kvrelay_agent_config,
    addr: *const c_char,
    len: usize,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        let (c, a) = unsafe { (input_mut(config)?, text(addr.cast(), len)?) };
        c.inner.listen = if a.is_empty() { None } else { Some(a.to_string()) };
        Ok(())
    })
}

/// How block bytes move: `tcp` (the default) or `nixl` (NIXL over UCX, straight between the
/// two pools; the service then serves NIXL and TCP readers alike and fetches read over NIXL).
/// `lib_dir`: the folder of `libnixl_capi.so` (`(NULL, 0)`: the loader's search path); checked
/// by `kvrelay_agent_new`, which loads it. `KVRELAY_ERR_UNSUPPORTED` for `nixl` when this
/// library was built without its `nixl` feature, `KVRELAY_ERR_INVALID_CONFIG` for another name.
///
/// # Safety
/// `config` NULL or live; `transport` readable for `transport_len` bytes, `lib_dir` for
/// `lib_dir_len`.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_agent_config_set_transport(
    config: *mut kvrelay_agent_config,
    transport: *const c_char,
    transport_len: usize,
    lib_dir: *const c_char,
    lib_dir_len: usize,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        let (c, t, d) =
            unsafe { (input_mut(config)?, text(transport.cast(), transport_len)?, text(lib_dir.cast(), lib_dir_len)?) };
        c.inner.transport = match t {
            "tcp" => Transport::Tcp,
            "nixl" if cfg!(feature = "nixl") => {
                Transport::Nixl { lib_dir: (!d.is_empty()).then(|| std::path::PathBuf::from(d)) }
            }
            "nixl" => {
                return Err(with_detail(
                    KVRELAY_ERR_UNSUPPORTED,
                    "this libkvrelay was built without the `nixl` feature",
                ))
            }
            _ => return Err(with_detail(KVRELAY_ERR_INVALID_CONFIG, "transport: tcp or nixl")),
        };
        Ok(())
    })
}

/// Allow peers: `loopback`, an address, or `ADDR/PREFIX`, comma-separated. The first call
/// replaces the default (loopback); later calls add. `KVRELAY_ERR_INVALID_CONFIG` for text that
/// does not parse (nothing is added then).
///
/// # Safety
/// `config` NULL or live; `spec` readable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_agent_config_allow_peer(
    config: *mut kvrelay_agent_config,
    spec: *const c_char,
    len: usize,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        let (c, s) = unsafe { (input_mut(config)?, text(spec.cast(), len)?) };
        let mut next = if c.allow_touched { c.inner.allow.clone() } else { PeerAllow::default() };
        next.add(s).map_err(|e| with_detail(KVRELAY_ERR_INVALID_CONFIG, e))?;
        c.inner.allow = next;
        c.allow_touched = true;
        Ok(())
    })
}

/// Where the pool lives: `-1` host memory (the default), `N >= 0` the memory of CUDA device
/// `N` (checked by `kvrelay_agent_new`: `KVRELAY_ERR_NO_CUDA_DRIVER`, `_NO_CUDA_DEVICE`).
///
/// # Safety
/// `config` NULL or live.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_agent_config_set_device(
    config: *mut kvrelay_agent_config,
    device: i32,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        let c = unsafe { input_mut(config) }?;
        if device < -1 {
            return Err(with_detail(KVRELAY_ERR_INVALID_CONFIG, "device: -1 (host memory) or a CUDA ordinal"));
        }
        c.inner.device = (device >= 0).then_some(device);
        Ok(())
    })
}

/// Set one limit (`kvrelay_agent_limit`), checked here: `KVRELAY_ERR_INVALID_CONFIG` for an
/// unknown limit or a value out of its range (nothing changed then). A new configuration holds
/// the documented defaults.
///
/// # Safety
/// `config` NULL or live.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_agent_config_set_limit(
    config: *mut kvrelay_agent_config,
    limit: i32,
    value: u64,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        let c = unsafe { input_mut(config)? };
        let key = LimitKey::from_i32(limit)
            .ok_or_else(|| with_detail(KVRELAY_ERR_INVALID_CONFIG, format!("no agent limit {limit}")))?;
        c.inner.limits.set(key, value).map_err(|e| with_detail(KVRELAY_ERR_INVALID_CONFIG, e))
    })
}

/// The value of one limit (`kvrelay_agent_limit`) in `config`: the documented default until it
/// is set. `KVRELAY_ERR_INVALID_ARGUMENT` for an unknown limit.
///
/// # Safety
/// `config` NULL or live; `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_agent_config_get_limit(
    config: *const kvrelay_agent_config,
    limit: i32,
    out: *mut u64,
) -> kvrelay_status {
    guard(|| {
        let out = out_ptr(out)?;
        // SAFETY: forwarded contract.
        let c = unsafe { input(config)? };
        let key = LimitKey::from_i32(limit)
            .ok_or_else(|| with_detail(KVRELAY_ERR_INVALID_ARGUMENT, format!("no agent limit {limit}")))?;
        // SAFETY: checked non-NULL; writable per the contract.
        unsafe { put(out, c.inner.limits.get(key)) };
        Ok(())
    })
}

/// The label of a `kvrelay_agent_limit` value (`"max_connections"`, ...; `"unknown"` for other
/// values). Static, NUL-terminated, never NULL.
#[no_mangle]
pub extern "C" fn kvrelay_agent_limit_name(limit: i32) -> *const c_char {
    LimitKey::from_i32(limit).map_or(c"unknown".as_ptr(), |k| k.c_label().as_ptr().cast())
}

/// Require peers to prove they hold this pre-shared key (16-4096 bytes, surrounding ASCII
/// whitespace trimmed). Both sides of a transfer must have the same key. The key is copied and
/// never logged or put in an error message. `(NULL, 0)` removes the key.
///
/// # Safety
/// `config` NULL or live; `key` readable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_agent_config_set_key(
    config: *mut kvrelay_agent_config,
    key: *const u8,
    len: usize,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        let (c, k) = unsafe { (input_mut(config)?, super::boundary::bytes(key, len)?) };
        c.inner.key = if k.is_empty() {
            None
        } else {
            Some(Psk::new(k).map_err(|e| with_detail(KVRELAY_ERR_INVALID_CONFIG, e))?)
        };
        Ok(())
    })
}

/// Read the pre-shared key from the environment variable `name` (unset or empty:
/// `KVRELAY_ERR_INVALID_CONFIG`).
///
/// # Safety
/// `config` NULL or live; `name` readable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_agent_config_key_from_env(
    config: *mut kvrelay_agent_config,
    name: *const c_char,
    len: usize,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        let (c, n) = unsafe { (input_mut(config)?, text(name.cast(), len)?) };
        c.inner.key = Some(Psk::from_env(n).map_err(|e| with_detail(KVRELAY_ERR_INVALID_CONFIG, e))?);
        Ok(())
    })
}

/// Read the pre-shared key from the file at `path` (`KVRELAY_ERR_IO` when it cannot be read,
/// `KVRELAY_ERR_INVALID_CONFIG` when it is not a key).
///
/// # Safety
/// `config` NULL or live; `path` readable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_agent_config_key_from_file(
    config: *mut kvrelay_agent_config,
    path: *const c_char,
    len: usize,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        let (c, p) = unsafe { (input_mut(config)?, text(path.cast(), len)?) };
        let p = std::path::Path::new(p);
        if std::fs::metadata(p).is_err() {
            return Err(with_detail(KVRELAY_ERR_IO, "the key file cannot be read"));
        }
        c.inner.key = Some(Psk::from_file(p).map_err(|e| with_detail(KVRELAY_ERR_INVALID_CONFIG, e))?);
        Ok(())
    })
}

/// Start an agent over the runtime's pool `layout` (copied; host memory, or device memory when
/// `kvrelay_agent_config_set_device` named a device), with the runtime's
/// `holder` (copied; its `destroy` runs when the agent is freed, or here when this fails).
/// Binds the listen address, starts the agent's threads and makes one mover per stream of a
/// fetch (`limits.streams`, one for NIXL: two staging slots of 4 MiB or one block each, pinned
/// for a device pool; on a device the first agent of a process also compiles the copy kernel,
/// tens of milliseconds), so that the first transfers make none. `KVRELAY_ERR_IO` when the
/// address cannot be bound or the movers' memory cannot be allocated.
///
/// # Safety
/// `config`, `layout` NULL or live; `holder` NULL or readable; `out` NULL or writable. Every
/// block of `layout` must be host memory (device memory of the configured device) valid for
/// reads and writes until `kvrelay_agent_free`
/// returns; the runtime must not write a block while it is pinned for the agent, nor touch a
/// fetch's destination blocks until that fetch completed.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_agent_new(
    config: *const kvrelay_agent_config,
    layout: *const kvrelay_kv_layout,
    holder: *const kvrelay_block_holder,
    out: *mut *mut kvrelay_agent,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        let h = unsafe { input(holder) }?;
        // from here on the holder is owned: its destroy runs on every path
        let h = CHolder(*h);
        let out = out_ptr(out)?;
        // SAFETY: forwarded contract.
        let (c, l) = unsafe { (input(config)?, input(layout)?) };
        if h.0.pin.is_none() || h.0.unpin.is_none() {
            return Err(with_detail(KVRELAY_ERR_INVALID_ARGUMENT, "the block holder needs pin and unpin"));
        }
        // SAFETY: the caller vouches for the pool's memory as documented above.
        let agent = unsafe { Agent::new(c.inner.clone(), layout_of(l).clone(), Box::new(h)) }.map_err(agent_err)?;
        // SAFETY: checked non-NULL; writable per the contract.
        unsafe { put(out, Box::into_raw(Box::new(kvrelay_agent { inner: agent }))) };
        Ok(())
    })
}

/// Stop the agent and free it (NULL does nothing): the service stops, queued and running
/// fetches complete (`KVRELAY_FETCH_SHUTDOWN` or `_CANCELLED`, their callbacks run), every
/// agent thread is joined, then the holder's `destroy` runs. Blocks for at most about the
/// connect timeout (`KVRELAY_LIMIT_CONNECT_TIMEOUT_MS`, 2 s; a connect in progress is not
/// interrupted; DNS lookups are never waited for, nor are connections blocked in I/O, which are
/// shut down), plus what the callbacks it waits for take: the completions of the fetches it
/// ends and any `pin`, `unpin` or `returned` running on an agent thread. So it must not be
/// called from one of the agent's callbacks, nor while holding a lock those callbacks take (it
/// would wait for them forever). A panic on an agent thread never makes it wait: it is
/// contained there.
///
/// # Safety
/// `agent` NULL or live and not used by another thread during or after the call.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_agent_free(agent: *mut kvrelay_agent) {
    // SAFETY: forwarded contract.
    unsafe { free_box(agent) }
}

/// The service's endpoint, `tcp://ADDR:PORT`, NUL-free (size-query convention: `*len_out` gets
/// the size). Empty for a fetch-only agent.
///
/// # Safety
/// `agent` NULL or live; `buf` NULL or writable for `cap` bytes; `len_out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_agent_endpoint(
    agent: *const kvrelay_agent,
    buf: *mut c_char,
    cap: usize,
    len_out: *mut usize,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        let a = unsafe { input(agent) }?;
        // SAFETY: forwarded contract.
        unsafe { fill(a.inner.endpoint().unwrap_or("").as_bytes(), buf.cast(), cap, len_out) }
    })
}

/// Record the checksums of blocks `ids`, which just became reusable (a prefill wrote them, or
/// the runtime committed them): the agent sums each block where it lies and keeps the value,
/// which then travels with the block. Blocks a fetch verified are recorded by the agent itself.
/// Cost: O(bytes), no allocation; batches over 8 MiB are summed on several threads.
///
/// # Safety
/// `agent` NULL or live; `ids` readable for `n` ids; the blocks must not be written meanwhile.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_agent_record_checksums(
    agent: *const kvrelay_agent,
    ids: *const u32,
    n: usize,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        let (a, ids) = unsafe { (input(agent)?, array(ids, n)?) };
        a.inner.record_checksums(ids).map_err(agent_err)
    })
}

/// Submit a fetch. Never blocks: arguments are checked and copied here, the fetch runs on an
/// agent thread, and `done` (may be NULL) runs there with `user_data` when it completes. The
/// handle polls, waits or cancels. `done` runs once, on one of the agent's fetch threads, also
/// when the fetch was cancelled or the agent is being freed; it must not unwind and must not
/// free the agent; it may free the fetch handle; `result` is valid during the call. The result
/// is published to `kvrelay_fetch_poll` / `_wait` right after the callback returns (so once a
/// poll sees it, the callback is done with `user_data`). Refused with `KVRELAY_ERR_INVALID_ARGUMENT`: no destination
/// block, `held + dst_len > names_len`, a destination block past the pool or twice, a zero
/// deadline, more blocks than `max_names`; `KVRELAY_ERR_BUSY` when the fetch queue is full. On
/// an error nothing was submitted and `done` is never called. `kvrelay_agent_submit` is the
/// same with the failure detail passed to the callback and a destroy function for `user_data`.
///
/// # Safety
/// `agent` NULL or live; `params` NULL or readable, its arrays readable for their lengths;
/// `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_agent_fetch(
    agent: *const kvrelay_agent,
    params: *const kvrelay_fetch_params,
    done: Option<unsafe extern "C" fn(user_data: *mut c_void, result: *const kvrelay_fetch_result)>,
    user_data: *mut c_void,
    out: *mut *mut kvrelay_fetch,
) -> kvrelay_status {
    struct Done(unsafe extern "C" fn(*mut c_void, *const kvrelay_fetch_result), *mut c_void);
    // SAFETY: the callback contract (kvrelay_agent_fetch) lets it run on an agent thread with
    // the user_data given for it.
    unsafe impl Send for Done {}
    let cb = done.map(|f| {
        let d = Done(f, user_data);
        Box::new(move |r: &FetchResult| {
            let d = &d;
            let c = kvrelay_fetch_result::from(r);
            // SAFETY: the consumer's callback, called once with its user_data and a result
            // that lives for the call.
            unsafe { (d.0)(d.1, &c) }
        }) as crate::agent::OnDone
    });
    // SAFETY: forwarded contract.
    guard(|| unsafe { submit(agent, params, cb, out) })
}

/// The completion of a fetch submitted with `kvrelay_agent_submit`. `size` is
/// `sizeof(kvrelay_fetch_callbacks)` as the caller knows it (fields are only ever appended).
/// - `done(user_data, result, detail)` (may be NULL): runs once, on one of the agent's fetch
///   threads, when the fetch completes (also when it was cancelled or the agent is being
///   freed), with the whole result and why it failed in words (`detail`: UTF-8, not
///   NUL-terminated, empty when it did not fail; never hint bytes or a key). `result` and
///   `detail` are valid during the call. It must not unwind and must not free the agent; it
///   may free the fetch handle.
/// - `destroy(user_data)` (may be NULL): runs exactly once on every path: right after `done`,
///   before the result is published to `kvrelay_fetch_poll` / `_wait`; or, when the submission
///   is refused, before `kvrelay_agent_submit` returns.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvrelay_fetch_callbacks {
    /// `sizeof(kvrelay_fetch_callbacks)`.
    pub size: usize,
    /// Passed back to both callbacks.
    pub user_data: *mut c_void,
    /// The completion.
    pub done:
        Option<unsafe extern "C" fn(user_data: *mut c_void, result: *const kvrelay_fetch_result, detail: kvrelay_str)>,
    /// Releases `user_data`.
    pub destroy: Option<unsafe extern "C" fn(user_data: *mut c_void)>,
}

/// Submit a fetch with the completion of `callbacks` (may be NULL: poll or wait instead): as
/// `kvrelay_agent_fetch`, but the callback also receives the failure detail (no round trip to
/// `kvrelay_fetch_detail`), and `callbacks->destroy` releases `user_data` exactly once on
/// every path, including a refused submission (`KVRELAY_ERR_INVALID_ARGUMENT` also for a
/// `callbacks->size` smaller than this header's struct).
///
/// # Safety
/// `agent` NULL or live; `params` NULL or readable, its arrays readable for their lengths;
/// `callbacks` NULL or readable for `callbacks->size` bytes; `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_agent_submit(
    agent: *const kvrelay_agent,
    params: *const kvrelay_fetch_params,
    callbacks: *const kvrelay_fetch_callbacks,
    out: *mut *mut kvrelay_fetch,
) -> kvrelay_status {
    /// Runs `destroy` when dropped: after `done`, or with a refused submission's closure.
    struct Callbacks(kvrelay_fetch_callbacks);
    // SAFETY: the callbacks' contract lets them run on an agent thread with their user_data.
    unsafe impl Send for Callbacks {}
    impl Drop for Callbacks {
        fn drop(&mut self) {
            if let Some(d) = self.0.destroy {
                // SAFETY: the consumer's destroy, called once (this value is dropped once).
                unsafe { d(self.0.user_data) }
            }
        }
    }
    guard(|| {
        // SAFETY: forwarded contract.
        let cbs = if callbacks.is_null() { None } else { Some(Callbacks(unsafe { *callbacks })) };
        if let Some(c) = &cbs {
            if c.0.size < std::mem::size_of::<kvrelay_fetch_callbacks>() {
                return Err(with_detail(
                    KVRELAY_ERR_INVALID_ARGUMENT,
                    format!(
                        "callbacks of {} bytes (this library's are {})",
                        c.0.size,
                        std::mem::size_of::<kvrelay_fetch_callbacks>()
                    ),
                ));
            }
        }
        let cb = cbs.map(|c| {
            Box::new(move |r: &FetchResult| {
                let c = &c;
                if let Some(done) = c.0.done {
                    let res = kvrelay_fetch_result::from(r);
                    let detail = kvrelay_str {
                        ptr: if r.detail.is_empty() { c"".as_ptr() } else { r.detail.as_ptr().cast() },
                        len: r.detail.len(),
                    };
                    // SAFETY: the consumer's callback, called once with its user_data, a result
                    // and a detail that live for the call.
                    unsafe { done(c.0.user_data, &res, detail) }
                }
            }) as crate::agent::OnDone
        });
        // SAFETY: forwarded contract.
        unsafe { submit(agent, params, cb, out) }
    })
}

/// The checks and the submission both entry points share; on an error `cb` is dropped unrun.
///
/// # Safety
/// As `kvrelay_agent_fetch`.
unsafe fn submit(
    agent: *const kvrelay_agent,
    params: *const kvrelay_fetch_params,
    cb: Option<crate::agent::OnDone>,
    out: *mut *mut kvrelay_fetch,
) -> Result<(), kvrelay_status> {
    let out = out_ptr(out)?;
    // SAFETY: forwarded contract.
    let (a, p) = unsafe { (input(agent)?, input(params)?) };
    // SAFETY: forwarded contract.
    let (endpoint, names, dst) = unsafe {
        (text(p.endpoint.ptr.cast(), p.endpoint.len)?, array(p.names, p.names_len)?, array(p.dst_blocks, p.dst_len)?)
    };
    let req = FetchRequest {
        endpoint: endpoint.to_string(),
        names: names.to_vec(),
        held: p.held,
        dst: dst.to_vec(),
        deadline: Duration::from_millis(u64::from(p.deadline_ms)),
    };
    let f = a.inner.submit(req, cb).map_err(agent_err)?;
    // SAFETY: checked non-NULL; writable per the contract.
    unsafe { put(out, Box::into_raw(Box::new(kvrelay_fetch { inner: f }))) };
    Ok(())
}

/// The result of a completed fetch: `KVRELAY_OK` and `*out` written, or `KVRELAY_ERR_PENDING`
/// (nothing written) while it runs. Never blocks.
///
/// # Safety
/// `fetch` NULL or live; `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_fetch_poll(
    fetch: *const kvrelay_fetch,
    out: *mut kvrelay_fetch_result,
) -> kvrelay_status {
    // SAFETY: forwarded contract.
    unsafe { kvrelay_fetch_wait(fetch, 0, out) }
}

/// Wait up to `timeout_ms` for the fetch to complete: `KVRELAY_OK` and `*out` written, or
/// `KVRELAY_ERR_PENDING`. Blocks the calling thread: not for a scheduler's thread (poll, or
/// use the callback).
///
/// # Safety
/// `fetch` NULL or live; `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_fetch_wait(
    fetch: *const kvrelay_fetch,
    timeout_ms: u32,
    out: *mut kvrelay_fetch_result,
) -> kvrelay_status {
    guard(|| {
        let out = out_ptr(out)?;
        // SAFETY: forwarded contract.
        let f = unsafe { input(fetch) }?;
        let r =
            if timeout_ms == 0 { f.inner.poll() } else { f.inner.wait(Duration::from_millis(u64::from(timeout_ms))) };
        let r = r.ok_or(KVRELAY_ERR_PENDING)?;
        // SAFETY: checked non-NULL; writable per the contract.
        unsafe { put(out, kvrelay_fetch_result::from(&r)) };
        Ok(())
    })
}

/// Why a completed fetch failed, in words (size-query convention; empty when it did not fail;
/// `KVRELAY_ERR_PENDING` while it runs). Never contains hint bytes or the key.
///
/// # Safety
/// `fetch` NULL or live; `buf` NULL or writable for `cap` bytes; `len_out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_fetch_detail(
    fetch: *const kvrelay_fetch,
    buf: *mut c_char,
    cap: usize,
    len_out: *mut usize,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        let f = unsafe { input(fetch) }?;
        let r = f.inner.poll().ok_or(KVRELAY_ERR_PENDING)?;
        // SAFETY: forwarded contract.
        unsafe { fill(r.detail.as_bytes(), buf.cast(), cap, len_out) }
    })
}

/// Ask a fetch to stop: it completes with `KVRELAY_FETCH_CANCELLED` after the block in progress
/// (blocks verified before it stay reported). Never blocks; a completed fetch is unaffected.
///
/// # Safety
/// `fetch` NULL or live.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_fetch_cancel(fetch: *const kvrelay_fetch) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        unsafe { input(fetch) }?.inner.cancel();
        Ok(())
    })
}

/// Free a fetch handle (NULL does nothing). A running fetch goes on, and its callback still runs.
///
/// # Safety
/// `fetch` NULL or live and not used by another thread during or after the call.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_fetch_free(fetch: *mut kvrelay_fetch) {
    // SAFETY: forwarded contract.
    unsafe { free_box(fetch) }
}

/// Seconds a fetch of `blocks` blocks from `endpoint` is expected to take (the source's moving
/// averages, or the TCP default before its first transfer: 2 ms setup, 3 GB/s). Compare with
/// the runtime's own prefill time for those tokens.
///
/// # Safety
/// `agent` NULL or live; `endpoint` readable for `len` bytes; `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_agent_estimate(
    agent: *const kvrelay_agent,
    endpoint: *const c_char,
    len: usize,
    blocks: usize,
    seconds_out: *mut f64,
) -> kvrelay_status {
    guard(|| {
        let out = out_ptr(seconds_out)?;
        // SAFETY: forwarded contract.
        let (a, e) = unsafe { (input(agent)?, text(endpoint.cast(), len)?) };
        let s = a.inner.estimate(e, blocks);
        // SAFETY: checked non-NULL; writable per the contract.
        unsafe { put(out, s) };
        Ok(())
    })
}

/// The speed estimate of `endpoint`.
///
/// # Safety
/// `agent` NULL or live; `endpoint` readable for `len` bytes; `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_agent_source_speed(
    agent: *const kvrelay_agent,
    endpoint: *const c_char,
    len: usize,
    out: *mut kvrelay_source_speed,
) -> kvrelay_status {
    guard(|| {
        let out = out_ptr(out)?;
        // SAFETY: forwarded contract.
        let (a, e) = unsafe { (input(agent)?, text(endpoint.cast(), len)?) };
        let s = a.inner.speed(e);
        // SAFETY: checked non-NULL; writable per the contract.
        unsafe { put(out, kvrelay_source_speed { setup_s: s.setup_s, bytes_per_s: s.bytes_per_s }) };
        Ok(())
    })
}

/// Copy the agent's counters into `out`, of which the caller knows `size` bytes: pass
/// `sizeof(kvrelay_agent_stats)`. Fields are only ever appended to `kvrelay_agent_stats`, so a
/// caller built against an older header gets the fields it knows and nothing past them is
/// written; `size` must be a non-zero multiple of 8 (every field is a `uint64_t`), else
/// `KVRELAY_ERR_INVALID_ARGUMENT`. Fields this library lacks (a newer caller) are zeroed.
///
/// # Safety
/// `agent` NULL or live; `out` NULL or writable for `size` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_agent_read_stats(
    agent: *const kvrelay_agent,
    out: *mut AgentStats,
    size: usize,
) -> kvrelay_status {
    guard(|| {
        let out = out_ptr(out)?;
        if size == 0 || size % 8 != 0 {
            return Err(with_detail(KVRELAY_ERR_INVALID_ARGUMENT, format!("a stats size of {size} bytes")));
        }
        // SAFETY: forwarded contract.
        let a = unsafe { input(agent) }?;
        let s = a.inner.stats();
        let n = size.min(std::mem::size_of::<AgentStats>());
        // SAFETY: `out` is writable for `size` bytes (contract) and `n <= size`; `s` is a live
        // local of `size_of::<AgentStats>() >= n` bytes; the two do not overlap. Bytes past `n`
        // (a newer caller's fields) are zeroed, within `size`.
        unsafe {
            std::ptr::copy_nonoverlapping((&s as *const AgentStats).cast::<u8>(), out.cast::<u8>(), n);
            std::ptr::write_bytes(out.cast::<u8>().add(n), 0, size - n);
        }
        Ok(())
    })
}

/// The agent's counters as Prometheus text (`kvrelay_kv_agent_*`), NUL-free (size-query
/// convention: `*len_out` gets the size; the text may grow between a size query and the fill,
/// so query again on `KVRELAY_ERR_BUFFER_TOO_SMALL`).
///
/// # Safety
/// `agent` NULL or live; `buf` NULL or writable for `cap` bytes; `len_out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_agent_prometheus(
    agent: *const kvrelay_agent,
    buf: *mut c_char,
    cap: usize,
    len_out: *mut usize,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        let a = unsafe { input(agent) }?;
        let text = a.inner.prometheus();
        // SAFETY: forwarded contract.
        unsafe { fill(text.as_bytes(), buf.cast(), cap, len_out) }
    })
}

/// The run a destination fetches (SPEC section 8): after its `held` leading blocks, how many
/// consecutive `names` appear among the hint's `hashes` (membership, not position).
///
/// # Safety
/// `names` readable for `n`, `hashes` for `m`; `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_fetch_run_length(
    names: *const u64,
    n: usize,
    held: usize,
    hashes: *const u64,
    m: usize,
    out: *mut usize,
) -> kvrelay_status {
    guard(|| {
        let out = out_ptr(out)?;
        // SAFETY: forwarded contract.
        let (names, hashes) = unsafe { (array(names, n)?, array(hashes, m)?) };
        // SAFETY: checked non-NULL; writable per the contract.
        unsafe { put(out, crate::agent::run_length(names, held, hashes)) };
        Ok(())
    })
}

/// The deadline, in milliseconds, a source gives one transfer of `bytes` (10 s plus 1 s per
/// 100 MB, at most `UINT32_MAX`): a `deadline_ms` for `kvrelay_fetch_params` that covers
/// whatever the source allows a transfer of that size.
#[no_mangle]
pub extern "C" fn kvrelay_fetch_deadline_ms(bytes: u64) -> u32 {
    u32::try_from(crate::agent::transfer_deadline(bytes).as_millis()).unwrap_or(u32::MAX)
}

/// The metric label of a `kvrelay_fetch_failure` value (`"corrupt"`, ...; `"ok"` for 0,
/// `"unknown"` for other values). Static, NUL-terminated, never NULL.
#[no_mangle]
pub extern "C" fn kvrelay_fetch_failure_name(failure: i32) -> *const c_char {
    if failure == 0 {
        return c"ok".as_ptr();
    }
    FailReason::ALL
        .into_iter()
        .find(|r| *r as i32 == failure)
        .map_or(c"unknown".as_ptr(), |r| r.c_label().as_ptr().cast())
}
