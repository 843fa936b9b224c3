//! Fetches from C: submission (with a completion callback, or polled), the result, the
//! failure detail, cancel, and the helpers a runtime plans a fetch with.

use std::ffi::{c_char, c_void};
use std::time::Duration;

use crate::agent::{FailReason, Fetch, FetchRequest, FetchResult};
use crate::ffi::boundary::{
    fill, free_box, guard, input, input_sized, out_ptr, output_size, own_size, put, put_sized_at, read_sized,
    sized_since_epoch, text, SizedStruct,
};
use crate::ffi::copy::array;
use crate::ffi::status::kvrelay_status::{self, *};
use crate::ffi::types::kvrelay_str;

use super::{agent_err, kvrelay_agent};

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
    /// The fetch panicked inside the agent (a bug); nothing of it is reported written.
    KVRELAY_FETCH_INTERNAL = 11,
    /// A block arrived under the name asked for with another content digest than the one the
    /// runtime gave (`kvrelay_agent_submit_checked`): a name collision, crafted or not, or a
    /// source that recorded no digest. The block was not written; those before it were.
    KVRELAY_FETCH_DIGEST_MISMATCH = 12,
}

/// How a fetch ended.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvrelay_fetch_result {
    /// `sizeof(kvrelay_fetch_result)`: set by the caller of `kvrelay_fetch_poll` / `_wait`
    /// (the library writes only the fields it covers); in a completion callback, the library's
    /// own (read no field past it).
    pub size: usize,
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
            size: own_size::<kvrelay_fetch_result>(),
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
    /// `sizeof(kvrelay_fetch_params)` as the caller's header declares it.
    pub size: usize,
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

/// Submit a fetch. Never blocks: arguments are checked and copied here, the fetch runs on an
/// agent thread, and `done` (may be NULL) runs there with `user_data` when it completes. The
/// handle polls, waits or cancels. `done` runs once, on one of the agent's fetch threads, also
/// when the fetch was cancelled or the agent is being freed; it must not unwind and must not
/// free the agent; it may free the fetch handle; `result` is valid during the call. The result
/// is published to `kvrelay_fetch_poll` / `_wait` right after the callback returns (so once a
/// poll sees it, the callback is done with `user_data`). Refused with `KVRELAY_ERR_INVALID_ARGUMENT`: no destination
/// block, `held + dst_len > names_len`, a destination block past the pool or twice, a zero
/// deadline, more blocks than `max_names`, and (since 0.4.1) always unless the limit
/// `KVRELAY_LIMIT_UNCHECKED_FETCH` is 1: a fetch by name alone takes whatever bytes a source
/// sends under a 64-bit name; `kvrelay_agent_submit_checked` asks by content. `KVRELAY_ERR_BUSY`
/// when the fetch queue is full. On
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
    guard(|| unsafe { submit(agent, params, None, cb, None, out) })
}

/// The completion of a fetch submitted with `kvrelay_agent_submit`. `size` is
/// `sizeof(kvrelay_fetch_callbacks)` as the caller's header declares it: fields are only ever
/// appended, the library reads `size` first and never past the caller's struct, a field an
/// older caller's header lacks reads as zero (NULL), and a newer header's larger struct is
/// accepted while the fields this library does not know are zero.
/// - `done(user_data, result, detail)` (may be NULL): runs once, on one of the agent's fetch
///   threads, when the fetch completes (also when it was cancelled or the agent is being
///   freed), with the whole result and why it failed in words (`detail`: UTF-8, not
///   NUL-terminated, empty when it did not fail; never hint bytes or a key). `result` and
///   `detail` are valid during the call. It must not unwind and must not free the agent; it
///   may free the fetch handle, poll or wait for its own fetch (which returns the result being
///   delivered, at once) and cancel or wait for other fetches (a cancelled one still queued
///   completes without a worker), so destroying a `kvrelay::Fetch` there never deadlocks.
/// - `destroy(user_data)` (may be NULL): runs exactly once on every path: right after `done`,
///   before the result is published to `kvrelay_fetch_poll` / `_wait`; or, when the submission
///   is refused, before `kvrelay_agent_submit` returns.
/// - `ready(user_data, from, n)` (may be NULL; since 0.4.0): lazy eviction. With it the
///   destination blocks need only be reserved, not free, at submission: once per stream of the
///   fetch, after the source's offer said the stream will get `n` blocks and before any of them
///   is written, the library asks the runtime to make `dst_blocks[from..from + n]` ready to be
///   written (to evict what they hold only now) and the stream takes as many, from the first,
///   as it answers (at most `n`; 0: none). A source that holds none of the blocks never gets
///   here, so a stale hint costs no eviction. Runs on a fetch thread, several streams of one
///   fetch possibly at once and in any order; must not unwind and must not call into the agent.
///   NULL: every destination block is free at submission.
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
    /// Makes offered destination blocks ready (lazy eviction); may be NULL.
    pub ready: Option<unsafe extern "C" fn(user_data: *mut c_void, from: usize, n: usize) -> usize>,
}

sized_since_epoch!(kvrelay_fetch_result, kvrelay_fetch_params);

// SAFETY: repr(C), `size` first, and all-zero bytes are no user data and no callbacks.
unsafe impl SizedStruct for kvrelay_fetch_callbacks {
    // 0.2.0's struct: size, user_data, done, destroy
    const FIRST_SIZE: usize = 32;
}

/// Submit a fetch with the completion of `callbacks` (may be NULL: poll or wait instead): as
/// `kvrelay_agent_fetch`, but the callback also receives the failure detail (no round trip to
/// `kvrelay_fetch_detail`), and `callbacks->destroy` releases `user_data` exactly once on
/// every path, including a refused submission where the caller's struct has it
/// (`KVRELAY_ERR_INVALID_ARGUMENT` also for a `callbacks->size` below the first version's
/// 32 bytes, when nothing of the struct is used, and for a larger struct with a field set that
/// this library does not know).
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
    // SAFETY: forwarded contract.
    unsafe { submit_with(agent, params, None, callbacks, out) }
}

/// Submit a fetch whose blocks are checked by content: as `kvrelay_agent_submit`, with
/// `digests` the content digest of every name of `params` (`params->names_len` digests of
/// `KVRELAY_BLOCK_DIGEST_BYTES` bytes, `digests[i]` for `names[i]`, from
/// `kvrelay_block_digests` over the runtime's own tokens; `digests_len` counts digests). Each
/// block the source sends carries the digest it recorded (`kvrelay_agent_record_digests`); a
/// block whose digest is not the one asked for, or that has none, is never written: the fetch
/// ends before it with `KVRELAY_FETCH_DIGEST_MISMATCH`, the blocks before it verified. A
/// fetched block's digest is recorded with it, so it is served on with its digest. Refused
/// with `KVRELAY_ERR_INVALID_ARGUMENT` also when `digests` is NULL or `digests_len` is not
/// `params->names_len`. Since 0.3.3.
///
/// # Safety
/// As `kvrelay_agent_submit`; `digests` NULL or readable for `digests_len *
/// KVRELAY_BLOCK_DIGEST_BYTES` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_agent_submit_checked(
    agent: *const kvrelay_agent,
    params: *const kvrelay_fetch_params,
    digests: *const u8,
    digests_len: usize,
    callbacks: *const kvrelay_fetch_callbacks,
    out: *mut *mut kvrelay_fetch,
) -> kvrelay_status {
    // SAFETY: forwarded contract (a NULL `digests` is refused there, after which the
    // callbacks' destroy runs as for any refused submission).
    unsafe { submit_with(agent, params, Some((digests, digests_len)), callbacks, out) }
}

/// `kvrelay_agent_submit`, with digests when `digests` is given (a NULL pointer: refused).
///
/// # Safety
/// As `kvrelay_agent_submit_checked`.
unsafe fn submit_with(
    agent: *const kvrelay_agent,
    params: *const kvrelay_fetch_params,
    digests: Option<(*const u8, usize)>,
    callbacks: *const kvrelay_fetch_callbacks,
    out: *mut *mut kvrelay_fetch,
) -> kvrelay_status {
    /// Runs `destroy` once: right after `done`, or when dropped (a refused submission's
    /// closures); shared by the completion and the room callback.
    struct Callbacks(kvrelay_fetch_callbacks, std::sync::atomic::AtomicBool);
    // SAFETY: the callbacks' contract lets them run on an agent thread with their user_data,
    // `ready` from several of the fetch's threads at once.
    unsafe impl Send for Callbacks {}
    // SAFETY: as above.
    unsafe impl Sync for Callbacks {}
    impl Callbacks {
        fn destroy_once(&self) {
            if !self.1.swap(true, std::sync::atomic::Ordering::AcqRel) {
                if let Some(d) = self.0.destroy {
                    // SAFETY: the consumer's destroy, called once (the flag above).
                    unsafe { d(self.0.user_data) }
                }
            }
        }
    }
    impl Drop for Callbacks {
        fn drop(&mut self) {
            self.destroy_once();
        }
    }
    guard(|| {
        let cbs = if callbacks.is_null() {
            None
        } else {
            // SAFETY: forwarded contract: readable for `callbacks->size` bytes, which is all
            // read_sized reads.
            let copy = unsafe { read_sized(callbacks) }?;
            // owned from here: a refused struct's destroy still runs, when the caller's has one
            let (cbs, ok) = (
                std::sync::Arc::new(Callbacks(copy.value, std::sync::atomic::AtomicBool::new(false))),
                copy.check("kvrelay_fetch_callbacks"),
            );
            ok?;
            Some(cbs)
        };
        let on_offer = cbs.as_ref().and_then(|c| {
            let f = c.0.ready?;
            let c = c.clone();
            Some(Box::new(move |from: usize, n: usize| {
                // SAFETY: the consumer's callback with its user_data, which lives until
                // `destroy` (after `done`: no stream asks once the fetch completed).
                unsafe { f(c.0.user_data, from, n) }
            }) as crate::agent::OnOffer)
        });
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
                // right after `done`, before the result is published (the room callback's
                // share of `user_data` is never used after the completion)
                c.destroy_once();
            }) as crate::agent::OnDone
        });
        // SAFETY: forwarded contract.
        unsafe { submit(agent, params, digests, cb, on_offer, out) }
    })
}

/// The checks and the submission both entry points share; on an error `cb` is dropped unrun.
///
/// # Safety
/// As `kvrelay_agent_fetch`.
unsafe fn submit(
    agent: *const kvrelay_agent,
    params: *const kvrelay_fetch_params,
    digests: Option<(*const u8, usize)>,
    cb: Option<crate::agent::OnDone>,
    on_offer: Option<crate::agent::OnOffer>,
    out: *mut *mut kvrelay_fetch,
) -> Result<(), kvrelay_status> {
    let out = out_ptr(out)?;
    // SAFETY: forwarded contract (readable for the size it declares).
    let (a, p) = unsafe { (input(agent)?, input_sized(params, "kvrelay_fetch_params")?) };
    // SAFETY: forwarded contract.
    let (endpoint, names, dst) = unsafe {
        (text(p.endpoint.ptr.cast(), p.endpoint.len)?, array(p.names, p.names_len)?, array(p.dst_blocks, p.dst_len)?)
    };
    let digests = match digests {
        None => Vec::new(),
        Some((d, n)) => {
            if d.is_null() || n != names.len() {
                return Err(KVRELAY_ERR_INVALID_ARGUMENT);
            }
            // SAFETY: forwarded contract: `n` digests of 32 bytes (alignment 1) readable.
            unsafe { array(d.cast::<[u8; crate::names::BLOCK_DIGEST_BYTES]>(), n)? }.to_vec()
        }
    };
    let req = FetchRequest {
        endpoint: endpoint.to_string(),
        names: names.to_vec(),
        held: p.held,
        dst: dst.to_vec(),
        deadline: Duration::from_millis(u64::from(p.deadline_ms)),
        digests,
    };
    let f = a.inner.submit_lazy(req, cb, on_offer).map_err(agent_err)?;
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
/// use the callback). From the fetch's own completion callback it returns the result being
/// delivered at once (as `kvrelay_fetch_poll` does there).
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
        // SAFETY: forwarded contract.
        let (f, size) = unsafe { (input(fetch)?, output_size(out, "kvrelay_fetch_result")?) };
        let r =
            if timeout_ms == 0 { f.inner.poll() } else { f.inner.wait(Duration::from_millis(u64::from(timeout_ms))) };
        let r = r.ok_or(KVRELAY_ERR_PENDING)?;
        // SAFETY: checked by `output_size`; writable for that size per the contract.
        unsafe { put_sized_at(out, size, kvrelay_fetch_result::from(&r)) };
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
/// (blocks verified before it stay reported; with NIXL, after its posted READs finished or the
/// write grace, `KVRELAY_LIMIT_WRITE_GRACE_MS`, passed: blocks they may still write are
/// reported `withheld`); one still waiting in the agent's queue is taken out and completes at
/// once (its callback on an agent thread), not when a worker frees up. Never blocks; a
/// completed fetch is unaffected.
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
