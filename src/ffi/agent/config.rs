//! An agent's configuration from C: the layout fingerprint, the limits by name, the listen
//! address, the peers, the transport, the device and the pre-shared key.

use std::ffi::c_char;

use crate::agent::{AgentConfig, Fingerprint, LimitKey, Psk, Transport};
use crate::ffi::boundary::{free_box, guard, input, input_mut, input_sized, out_ptr, put, text, with_detail};
use crate::ffi::status::kvrelay_status::{self, *};

/// What two instances compare before any block moves (`naming`: the runtime's naming-scheme id).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvrelay_agent_fingerprint {
    /// `sizeof(kvrelay_agent_fingerprint)` as the caller's header declares it.
    pub size: usize,
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

crate::ffi::boundary::sized_since_epoch!(kvrelay_agent_fingerprint);

/// One of the agent's limits, for `kvrelay_agent_config_set_limit` / `_get_limit` (a limit by
/// name, so that limits can be added without changing a struct a caller compiled in). Fixed
/// values; `kvrelay_agent_limit_name` gives the label. Times in milliseconds (but
/// `KVRELAY_LIMIT_POLL_US`); every value must be at least 1, except
/// `KVRELAY_LIMIT_IDLE_TIMEOUT_MS`, `KVRELAY_LIMIT_SOCKET_BUFFER_BYTES`,
/// `KVRELAY_LIMIT_WRITE_GRACE_MS`, `KVRELAY_LIMIT_TCP_FALLBACK`, `KVRELAY_LIMIT_POLL_US`,
/// `KVRELAY_LIMIT_EXPORT_WHOLE_ALLOCATIONS` and `KVRELAY_LIMIT_UNCHECKED_FETCH`.
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
    /// How long a NIXL READ still posted when its fetch ends (failure, cancel, deadline) has to
    /// finish or fail before the destination blocks it may write are withheld (1000 ms; at most
    /// 60000; 0: withheld at once). Withheld blocks come back through the holder's `returned`.
    KVRELAY_LIMIT_WRITE_GRACE_MS = 14,
    /// When the agent's transport is not TCP (NIXL, CUDA IPC): a fetch whose source cannot be
    /// reached that way (it does not serve the transport, it runs on another host for CUDA IPC,
    /// its memory cannot be mapped or registered here) is made again over TCP, once, and that
    /// source is fetched from over TCP for the next 60 s (1, the default; counted in
    /// `transport_fallbacks`). 0 pins the transport: such a fetch fails with the reason.
    /// Since 0.3.0.
    KVRELAY_LIMIT_TCP_FALLBACK = 15,
    /// How long an agent thread that just did its part of a fetch polls (busy) for the next
    /// step before it sleeps, microseconds (0, the default: it sleeps at once; at most 10000).
    /// Each sleep costs a wake-up when work comes (tens of microseconds on a busy or
    /// virtualised host, several per fetch); polling takes them off back-to-back fetches for
    /// up to this much CPU time per step. Since 0.3.0.
    KVRELAY_LIMIT_POLL_US = 16,
    /// Accepted (0 or 1) and ignored since 0.4.3. Until then it decided whether the CUDA IPC
    /// transport exported a pool's allocations whole when they held more than the pool; a
    /// grant now maps an export area holding the asked blocks only, never the pool, so a pool
    /// may lie in any device memory. Since 0.4.0.
    KVRELAY_LIMIT_EXPORT_WHOLE_ALLOCATIONS = 17,
    /// `kvrelay_agent_submit` (a fetch by name alone, no content digests): 0 (the default)
    /// refuses it with `KVRELAY_ERR_INVALID_ARGUMENT`, since a 64-bit name can be collided and
    /// a source can send any bytes under it; 1 allows it (the block's checksum is still
    /// checked). `kvrelay_agent_submit_checked` is what a runtime uses. Since 0.4.1.
    KVRELAY_LIMIT_UNCHECKED_FETCH = 18,
}

/// An agent's configuration under construction. Owned: `_free`.
pub struct kvrelay_agent_config {
    pub(super) inner: AgentConfig,
    /// `kvrelay_agent_config_allow_peer` replaces the default (loopback) on its first call.
    pub(super) allow_touched: bool,
}

/// A configuration with the defaults: listen on `127.0.0.1:0`, loopback peers only, the
/// default limits, the per-user key (`kvrelay_agent_config_set_per_user_key`).
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
        // SAFETY: forwarded contract (readable for the size it declares).
        let f = unsafe { input_sized(fingerprint, "kvrelay_agent_fingerprint") }?;
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

/// How block bytes move: `tcp` (the default), `nixl` (NIXL over UCX, straight between the
/// two pools; the service then serves NIXL and TCP readers alike and fetches read over NIXL)
/// or `cuda-ipc` (two agents of one host with device pools: the source copies the asked blocks
/// into an export area of its own, which the destination maps and copies out of, device to
/// device; the pool itself is never exported, whatever memory it lies in; a peer's mapping
/// reaches the blocks it asked for and nothing else; `kvrelay_agent_new` fails for a host pool
/// or a device that cannot share memory of the virtual memory API by POSIX descriptor),
/// or both in order of preference, `cuda-ipc,nixl` (or `nixl,cuda-ipc`): each source is
/// fetched from with the first that reaches it (CUDA IPC for a source on this host, NIXL for
/// the others), then TCP as `KVRELAY_LIMIT_TCP_FALLBACK` allows; the service serves both.
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
        let one = |name: &str| match name {
            "tcp" => Ok(Transport::Tcp),
            "cuda-ipc" => Ok(Transport::CudaIpc),
            "nixl" if cfg!(feature = "nixl") => {
                Ok(Transport::Nixl { lib_dir: (!d.is_empty()).then(|| std::path::PathBuf::from(d)) })
            }
            "nixl" => Err(with_detail(KVRELAY_ERR_UNSUPPORTED, "this libkvrelay was built without the `nixl` feature")),
            _ => Err(with_detail(
                KVRELAY_ERR_INVALID_CONFIG,
                "transport: tcp, nixl, cuda-ipc, or cuda-ipc,nixl / nixl,cuda-ipc",
            )),
        };
        let transport = if t.contains(',') {
            let list = t.split(',').map(one).collect::<Result<Vec<_>, _>>()?;
            let p = Transport::Prefer(list);
            p.chain().map_err(|e| with_detail(KVRELAY_ERR_INVALID_CONFIG, &e))?;
            p
        } else {
            one(t)?
        };
        c.inner.transport = transport;
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
        c.inner.allow =
            c.inner.allow.with(!c.allow_touched, s).map_err(|e| with_detail(KVRELAY_ERR_INVALID_CONFIG, e))?;
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
/// never logged or put in an error message. `(NULL, 0)` removes the key given (the agent then
/// uses the per-user key, unless `kvrelay_agent_config_set_per_user_key` turned it off).
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
        let (c, k) = unsafe { (input_mut(config)?, crate::ffi::boundary::bytes(key, len)?) };
        c.inner.key = if k.is_empty() {
            None
        } else {
            Some(Psk::new(k).map_err(|e| with_detail(KVRELAY_ERR_INVALID_CONFIG, e))?)
        };
        Ok(())
    })
}

/// With no key given: `on` nonzero (the default) authenticates with the key this process's user
/// holds alone, created on first use, mode 0600: `$KVRELAY_KEY_FILE`, else
/// `$XDG_CACHE_HOME/kvrelay/agent.key`, else `~/.cache/kvrelay/agent.key` (`kvrelay_agent_new`
/// fails with the reason when it cannot be read or made, or others may read it). Agents of one
/// user on one host then reach each other with no setting, and another user's process gets
/// nothing. `on` 0: no authentication; any allowlisted peer may fetch over TCP, and no grant of
/// memory (CUDA IPC handle, NIXL registration) leaves the agent (counted in
/// `grants_refused_unkeyed`; fetchers fall back to TCP). Since 0.4.1.
///
/// # Safety
/// `config` NULL or live.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_agent_config_set_per_user_key(
    config: *mut kvrelay_agent_config,
    on: bool,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        let c = unsafe { input_mut(config)? };
        c.inner.per_user_key = on;
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
/// `KVRELAY_ERR_INVALID_CONFIG` when it is not a key, or when users other than its owner may
/// read or write it: mode bits `0o066`, `chmod 600`).
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
