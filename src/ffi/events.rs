//! KV events from C (feature `events`; SPEC section 10): the publisher of [`crate::events`],
//! so that a runtime's reuse cache is indexed by Dynamo's KV router in the format it reads,
//! under the names `kvrelay_block_names` gives and the KV agent serves.

use std::ffi::c_char;

use super::boundary::{fill, free_box, guard, input, input_mut, out_ptr, put, put_counters, text, with_detail};
use super::copy::array;
use super::status::kvrelay_status::{self, *};
use crate::agent::Psk;
use crate::events::{EventStats, EventsConfig, Publisher};

/// Settings of a KV events publisher (an owned builder: `_new` / `_free`; not thread-safe).
pub struct kvrelay_kv_events_config {
    inner: EventsConfig,
    allow_touched: bool,
}

/// A running KV events publisher. Owned: `_free`. Every function on it is thread-safe and
/// never blocks on a subscriber.
pub struct kvrelay_kv_events {
    inner: Publisher,
}

/// A publisher's settings for `endpoint` (`tcp://HOST:PORT`, port 0: a free one; checked by
/// `kvrelay_kv_events_start`) and `block_size` tokens per block (at least 1): the replay socket
/// on a free port of the same host, an empty topic, medium `CPU`, loopback peers only.
///
/// # Safety
/// `endpoint` readable for `len` bytes; `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_kv_events_config_new(
    endpoint: *const c_char,
    len: usize,
    block_size: usize,
    out: *mut *mut kvrelay_kv_events_config,
) -> kvrelay_status {
    guard(|| {
        let out = out_ptr(out)?;
        // SAFETY: forwarded contract.
        let e = unsafe { text(endpoint.cast(), len) }?;
        if block_size == 0 {
            return Err(with_detail(KVRELAY_ERR_INVALID_CONFIG, "block_size is 0"));
        }
        let c = kvrelay_kv_events_config { inner: EventsConfig::new(e, block_size), allow_touched: false };
        // SAFETY: checked non-NULL; writable per the contract.
        unsafe { put(out, Box::into_raw(Box::new(c))) };
        Ok(())
    })
}

/// Free a publisher's settings (NULL does nothing).
///
/// # Safety
/// `config` NULL or live and not used after the call.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_kv_events_config_free(config: *mut kvrelay_kv_events_config) {
    // SAFETY: forwarded contract.
    unsafe { free_box(config) }
}

/// Which setting `kvrelay_kv_events_config_set` changes. Fixed values.
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvrelay_kv_events_setting {
    /// Where the replay socket binds (`tcp://HOST:PORT`; default: the endpoint's host, a free
    /// port).
    KVRELAY_KV_EVENTS_REPLAY_ENDPOINT = 1,
    /// The topic frame of every batch (default empty, as vLLM sends it).
    KVRELAY_KV_EVENTS_TOPIC = 2,
    /// Where the blocks live, `GPU` or `CPU` (default `CPU`).
    KVRELAY_KV_EVENTS_MEDIUM = 3,
    /// Allow peers: `loopback`, an address or `ADDR/PREFIX`, comma-separated. The first call
    /// replaces the default (loopback); later calls add.
    KVRELAY_KV_EVENTS_ALLOW_PEER = 4,
    /// A file holding a pre-shared key (16 to 4,096 bytes, surrounding whitespace trimmed):
    /// both sockets then take only peers that log in with ZMQ's PLAIN mechanism as user
    /// `kvrelay` with the key's subscriber token, the 64 lowercase hex digits of
    /// HMAC-SHA-256(key, `kvrelay-kv-events/v1 subscriber`). The token, not the key, crosses
    /// the network, in clear, and the events are not encrypted (this libzmq has no CURVE):
    /// it keeps out whoever reaches the port without the token, not whoever reads the traffic.
    KVRELAY_KV_EVENTS_KEY_FILE = 5,
}

/// Change one text setting (UTF-8, `value` readable for `len` bytes). `KVRELAY_ERR_INVALID_CONFIG`
/// for an unknown `setting`, a medium other than `GPU` or `CPU`, peers that do not parse or a
/// key file that holds no key; `KVRELAY_ERR_IO` for a key file that cannot be read (nothing
/// changes then; the key is never part of a detail).
///
/// # Safety
/// `config` NULL or live; `value` readable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_kv_events_config_set(
    config: *mut kvrelay_kv_events_config,
    setting: i32,
    value: *const c_char,
    len: usize,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        let (c, v) = unsafe { (input_mut(config)?, text(value.cast(), len)?) };
        match setting {
            1 => c.inner.replay_endpoint = Some(v.to_string()),
            2 => c.inner.topic = v.to_string(),
            3 if v == "GPU" || v == "CPU" => c.inner.medium = v.to_string(),
            3 => return Err(with_detail(KVRELAY_ERR_INVALID_CONFIG, "the medium is GPU or CPU")),
            4 => {
                c.inner.allow =
                    c.inner.allow.with(!c.allow_touched, v).map_err(|e| with_detail(KVRELAY_ERR_INVALID_CONFIG, e))?;
                c.allow_touched = true;
            }
            5 => {
                let p = std::path::Path::new(v);
                if std::fs::metadata(p).is_err() {
                    return Err(with_detail(KVRELAY_ERR_IO, "the key file cannot be read"));
                }
                c.inner.key = Some(Psk::from_file(p).map_err(|e| with_detail(KVRELAY_ERR_INVALID_CONFIG, e))?);
            }
            s => return Err(with_detail(KVRELAY_ERR_INVALID_CONFIG, format!("no setting {s}"))),
        }
        Ok(())
    })
}

/// Bind both sockets and start the publisher's three threads (publishing, replay, and the
/// authentication handler that admits only the allowed peers); its first batch is
/// `AllBlocksCleared`. `KVRELAY_ERR_INVALID_CONFIG` for an endpoint that is not
/// `tcp://HOST:PORT`, `KVRELAY_ERR_IO` when an address cannot be bound or a thread cannot start
/// (the detail says which; nothing is left running then).
///
/// # Safety
/// `config` NULL or live (it is only read); `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_kv_events_start(
    config: *const kvrelay_kv_events_config,
    out: *mut *mut kvrelay_kv_events,
) -> kvrelay_status {
    guard(|| {
        let out = out_ptr(out)?;
        // SAFETY: forwarded contract.
        let c = unsafe { input(config) }?;
        for at in std::iter::once(&c.inner.endpoint).chain(&c.inner.replay_endpoint) {
            if !at.starts_with("tcp://") {
                return Err(with_detail(KVRELAY_ERR_INVALID_CONFIG, format!("`{at}`: expected tcp://HOST:PORT")));
            }
        }
        let p = Publisher::start(&c.inner).map_err(|e| with_detail(KVRELAY_ERR_IO, e))?;
        // SAFETY: checked non-NULL; writable per the contract.
        unsafe { put(out, Box::into_raw(Box::new(kvrelay_kv_events { inner: p }))) };
        Ok(())
    })
}

/// Stop the publisher and free it (NULL does nothing): the events queued so far are sent, the
/// threads are joined and both sockets closed. Takes as long as sending what was queued (ZMQ
/// never waits for a subscriber).
///
/// # Safety
/// `events` NULL or live and not used by another thread during or after the call.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_kv_events_free(events: *mut kvrelay_kv_events) {
    // SAFETY: forwarded contract.
    unsafe { free_box(events) }
}

/// A block was committed to the reuse cache under `name` (its `kvrelay_block_names` name);
/// `has_parent` says whether `parent` names the block before it in its prompt (false for a
/// prompt's first block); `tokens` are the block's token ids (copied). Never blocks: a full
/// queue drops the event and counts it. Publish a block only once the agent can serve it
/// (its checksum recorded), so that a hint built from this event finds it.
///
/// # Safety
/// `events` NULL or live; `tokens` NULL with `n_tokens` 0 or readable for `n_tokens` values.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_kv_events_stored(
    events: *const kvrelay_kv_events,
    name: u64,
    has_parent: bool,
    parent: u64,
    tokens: *const u32,
    n_tokens: usize,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        let (e, t) = unsafe { (input(events)?, array(tokens, n_tokens)?) };
        e.inner.stored(name, has_parent.then_some(parent), t);
        Ok(())
    })
}

/// The block named `name` was evicted (it can no longer be served). Never blocks.
///
/// # Safety
/// `events` NULL or live.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_kv_events_removed(events: *const kvrelay_kv_events, name: u64) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        unsafe { input(events) }?.inner.removed(name);
        Ok(())
    })
}

/// Every block published before is gone (the runtime cleared its cache). Never blocks.
///
/// # Safety
/// `events` NULL or live.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_kv_events_cleared(events: *const kvrelay_kv_events) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        unsafe { input(events) }?.inner.cleared();
        Ok(())
    })
}

/// The bound PUB endpoint (`replay` false) or replay endpoint (`replay` true),
/// `tcp://HOST:PORT` with the port resolved, NUL-free (size-query convention). What a router's
/// registration names.
///
/// # Safety
/// `events` NULL or live; `buf` NULL or writable for `cap` bytes; `len_out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_kv_events_endpoint(
    events: *const kvrelay_kv_events,
    replay: bool,
    buf: *mut c_char,
    cap: usize,
    len_out: *mut usize,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        let e = unsafe { input(events) }?;
        let at = if replay { e.inner.replay_endpoint() } else { e.inner.endpoint() };
        // SAFETY: forwarded contract.
        unsafe { fill(at.as_bytes(), buf.cast(), cap, len_out) }
    })
}

/// Copy the publisher's counters into `out`, of which the caller knows `size` bytes (pass
/// `sizeof(kvrelay_kv_events_stats)`; the rules of `kvrelay_agent_read_stats`). Fields are only
/// ever appended.
///
/// # Safety
/// `events` NULL or live; `out` NULL or writable for `size` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_kv_events_read_stats(
    events: *const kvrelay_kv_events,
    out: *mut EventStats,
    size: usize,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        let e = unsafe { input(events) }?;
        // SAFETY: EventStats is repr(C) of u64 fields; `out` is writable for `size` bytes.
        unsafe { put_counters(out, size, &e.inner.stats()) }
    })
}

/// The counters as Prometheus text (`{prefix}_kv_events_published_total` and the others;
/// `prefix` UTF-8, `(NULL, 0)`: `kvrelay`), NUL-free (size-query convention): what a runtime
/// appends to its own `/metrics`.
///
/// # Safety
/// `events` NULL or live; `prefix` NULL with `prefix_len` 0 or readable for `prefix_len`
/// bytes; `buf` NULL or writable for `cap` bytes; `len_out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_kv_events_prometheus(
    events: *const kvrelay_kv_events,
    prefix: *const c_char,
    prefix_len: usize,
    buf: *mut c_char,
    cap: usize,
    len_out: *mut usize,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        let (e, p) = unsafe { (input(events)?, text(prefix.cast(), prefix_len)?) };
        if !p.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b':') {
            return Err(with_detail(KVRELAY_ERR_INVALID_ARGUMENT, "a metric prefix is [A-Za-z0-9_:]"));
        }
        let text = e.inner.prometheus(if p.is_empty() { "kvrelay" } else { p });
        // SAFETY: forwarded contract.
        unsafe { fill(text.as_bytes(), buf.cast(), cap, len_out) }
    })
}
