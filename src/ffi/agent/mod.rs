//! The KV agent from C (feature `agent`): configuration, the runtime's block holder, fetches
//! with completion by callback or poll, the cost estimate and the counters. The behaviour is
//! the Rust [`crate::agent`]'s; this module only converts and guards.
//!
//! One file per concept: `config.rs` (the configuration), `holder.rs` (the runtime's block
//! holder), `fetch.rs` (fetches and their results); this file holds the agent itself.

mod config;
mod fetch;
mod holder;

pub use config::*;
pub use fetch::*;
pub use holder::*;

use std::ffi::c_char;

use crate::agent::{Agent, AgentError, AgentStats};
use crate::ffi::boundary::{fill, free_box, guard, input, out_ptr, put, put_counters, read_sized, text, with_detail};
use crate::ffi::copy::{array, kvrelay_kv_layout, layout_of};
use crate::ffi::status::kvrelay_status::{self, *};

/// A running KV agent. Owned: `_free`. Every function on it is thread-safe.
pub struct kvrelay_agent {
    pub(super) inner: Agent,
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
        // SAFETY: forwarded contract (readable for the size it declares).
        let h = unsafe { read_sized(holder) }?;
        // from here on the holder is owned: its destroy runs on every path (a refused struct's
        // too, where the caller's has one)
        let (h, ok) = (CHolder(h.value), h.check("kvrelay_block_holder"));
        ok?;
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
/// longer of the connect timeout (`KVRELAY_LIMIT_CONNECT_TIMEOUT_MS`, 2 s; a connect in
/// progress is not interrupted; DNS lookups are never waited for, nor are connections blocked
/// in I/O, which are shut down) and, with the NIXL transport, the write grace a fetch gives its
/// posted READs (`KVRELAY_LIMIT_WRITE_GRACE_MS`, 1 s; READs still running after it are
/// released with the agent and their blocks handed back through `returned`), plus one CUDA IPC
/// copy in progress (its kernel runs to its end; a wait for a source's descriptors ends within
/// 20 ms), plus what the callbacks it waits for take: the completions of the fetches it
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

/// Check blocks `ids` where they lie against what the agent recorded for them (the checksum,
/// and in a keyed agent the keyed tag) and write into `*verified` how many leading blocks
/// match (a block with nothing recorded does not). What a runtime calls before it lets blocks
/// into a slot from a pool another process could have written: one whose agent grants its
/// memory to peers (CUDA IPC, NIXL), whose writes through the grant a tag keeps out unless the
/// writer holds the key. Cost: O(bytes); a device pool's blocks are checked by one kernel
/// (waited for on the agent's own stream), a host pool's on the CPU.
/// `KVRELAY_ERR_INVALID_ARGUMENT` for an id past the pool. Since 0.4.2.
///
/// # Safety
/// `agent` NULL or live; `ids` readable for `n` ids; `verified` NULL or writable; the blocks
/// must not be written meanwhile.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_agent_verify_blocks(
    agent: *const kvrelay_agent,
    ids: *const u32,
    n: usize,
    verified: *mut usize,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        let (a, ids, out) = unsafe { (input(agent)?, array(ids, n)?, out_ptr(verified)?) };
        let k = a.inner.verify_blocks(ids).map_err(agent_err)?;
        // SAFETY: `out` checked non-NULL; writable per the contract.
        unsafe { put(out, k) };
        Ok(())
    })
}

/// Record the content digests of blocks `ids` (`n` ids; `digests` holds `n` digests of
/// `KVRELAY_BLOCK_DIGEST_BYTES` bytes, `digests[i]` for `ids[i]`, from `kvrelay_block_digests`
/// over the tokens whose KV the block holds), after their checksums: each block is served with
/// its digest, and a fetch that asks by content (`kvrelay_agent_submit_checked`) takes a block
/// only when the two are equal. Record it again whenever a block is rewritten (a block's digest
/// stays until then). Blocks a checked fetch verified are recorded by the agent itself.
/// `KVRELAY_ERR_INVALID_ARGUMENT` for an id past the pool (nothing recorded). Since 0.3.3.
/// Cost: O(n), no allocation.
///
/// # Safety
/// `agent` NULL or live; `ids` readable for `n` ids; `digests` readable for `n *
/// KVRELAY_BLOCK_DIGEST_BYTES` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_agent_record_digests(
    agent: *const kvrelay_agent,
    ids: *const u32,
    digests: *const u8,
    n: usize,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract (digests: `n` arrays of 32 bytes, alignment 1).
        let (a, ids, d) = unsafe {
            (input(agent)?, array(ids, n)?, array(digests.cast::<[u8; crate::names::BLOCK_DIGEST_BYTES]>(), n)?)
        };
        a.inner.record_digests(ids, d).map_err(agent_err)
    })
}

/// Seconds a fetch of `blocks` blocks from `endpoint` is expected to take: the transfer (the
/// source's moving averages, or the TCP default before its first transfer: 2 ms setup, 3 GB/s)
/// plus the runtime's own import of the blocks as `kvrelay_agent_record_import` reported it
/// (nothing before its first report). Compare with the runtime's own prefill time for those
/// tokens. Two short locks, no allocation.
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

/// Report that the runtime's own import of `blocks` fetched blocks (from the pool into the cache
/// it computes with: llama.cpp's state import, for one) took `seconds`, so that
/// `kvrelay_agent_estimate` counts it. A runtime whose cache is the pool itself never calls it.
/// The cost is modelled as a fixed part plus a part per block, fitted over the reports (newer
/// ones weigh more). `blocks` at most the pool's and `seconds` in `0..=3600`, else
/// `KVRELAY_ERR_INVALID_ARGUMENT` (one absurd report would hold the fit up for long).
/// Callable from any thread; one short lock.
///
/// # Safety
/// `agent` NULL or live.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_agent_record_import(
    agent: *const kvrelay_agent,
    blocks: usize,
    seconds: f64,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        let a = unsafe { input(agent)? };
        a.inner.record_import(blocks, seconds).map_err(agent_err)
    })
}

/// Seconds the runtime's import of `blocks` blocks is expected to take, as
/// `kvrelay_agent_record_import` reported (0 before the first report): the part of
/// `kvrelay_agent_estimate` that is not the transfer.
///
/// # Safety
/// `agent` NULL or live; `seconds_out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_agent_import_estimate(
    agent: *const kvrelay_agent,
    blocks: usize,
    seconds_out: *mut f64,
) -> kvrelay_status {
    guard(|| {
        let out = out_ptr(seconds_out)?;
        // SAFETY: forwarded contract.
        let a = unsafe { input(agent)? };
        let s = a.inner.import_estimate(blocks);
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
        // SAFETY: forwarded contract.
        let a = unsafe { input(agent) }?;
        // SAFETY: AgentStats is repr(C) of u64 fields; `out` is writable for `size` bytes.
        unsafe { put_counters(out, size, &a.inner.stats()) }
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
