//! `kvrelay_admission_config` and `kvrelay_admission`: the admission edge from C.

use std::ffi::c_char;

use super::boundary::{
    bytes, fill, free_box, guard, input, input_mut, out_ptr, output_size, put, put_sized, put_sized_at, text,
    with_detail,
};
use super::snapshot::{export, kvrelay_snapshot};
use super::status::kvrelay_status::{self, *};
use super::types::{kvrelay_counters, kvrelay_outcome};
use crate::hints::{Admission, AdmissionConfig, BatchOutcome, Outcome, DEFAULT_TRUST_ENV};

/// Admission settings being built. Owned: `_new` / `_free`. Starts at the defaults: trust off,
/// `max_bytes` 65,536, `max_depth` 128, `max_raw_bytes` 1 MiB, metric prefix
/// `kvrelay_kv_hints`. Values are checked by `kvrelay_admission_new`.
pub struct kvrelay_admission_config {
    inner: AdmissionConfig,
}

/// An admission edge: config plus lock-free counters. Owned: `_new` / `_free`. Thread-safe:
/// any number of threads may call `kvrelay_admit` on one edge at once.
pub struct kvrelay_admission {
    inner: Admission,
}

/// Create a config with the defaults.
///
/// # Safety
/// `out` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_admission_config_new(out: *mut *mut kvrelay_admission_config) -> kvrelay_status {
    guard(|| {
        let out = out_ptr(out)?;
        let b = Box::new(kvrelay_admission_config { inner: AdmissionConfig::default() });
        // SAFETY: checked non-NULL; caller promises writable.
        unsafe { put(out, Box::into_raw(b)) };
        Ok(())
    })
}

/// Free a config. NULL does nothing.
///
/// # Safety
/// `config` must be NULL or from `kvrelay_admission_config_new` and not freed before.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_admission_config_free(config: *mut kvrelay_admission_config) {
    // SAFETY: forwarded contract.
    unsafe { free_box(config) }
}

fn set(
    config: *mut kvrelay_admission_config,
    f: impl FnOnce(&mut AdmissionConfig) -> Result<(), kvrelay_status>,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: the public setters require `config` to be NULL or a live config.
        let c = unsafe { input_mut(config) }?;
        f(&mut c.inner)
    })
}

/// Turn trust on or off. Trust on accepts hints from **all** traffic that reaches the process;
/// kvrelay authenticates nobody.
///
/// # Safety
/// `config` must be NULL or a live config.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_admission_config_set_trusted(
    config: *mut kvrelay_admission_config,
    trusted: bool,
) -> kvrelay_status {
    set(config, |c| {
        c.trusted = trusted;
        Ok(())
    })
}

/// Set trust from an environment variable: on for `1`, `true`, `yes`, `on` (any case), off
/// otherwise or when unset. `(NULL, 0)` reads `KVRELAY_TRUST_KV_HINTS`.
///
/// # Safety
/// `config` NULL or live; `name` NULL or readable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_admission_config_trust_from_env(
    config: *mut kvrelay_admission_config,
    name: *const c_char,
    len: usize,
) -> kvrelay_status {
    // Argument conversion runs inside the guard too (inside `set`).
    set(config, |c| {
        // SAFETY: forwarded contract.
        let name = unsafe { text(name.cast(), len) }?;
        let name = if name.is_empty() { DEFAULT_TRUST_ENV } else { name };
        if name.contains(['=', '\0']) {
            return Err(KVRELAY_ERR_INVALID_ARGUMENT);
        }
        *c = std::mem::take(c).trust_from_env(name);
        Ok(())
    })
}

/// Limit on the canonical compact encoding, bytes (checked by `kvrelay_admission_new`).
///
/// # Safety
/// `config` must be NULL or a live config.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_admission_config_set_max_bytes(
    config: *mut kvrelay_admission_config,
    max_bytes: usize,
) -> kvrelay_status {
    set(config, |c| {
        c.max_bytes = max_bytes;
        Ok(())
    })
}

/// Deepest nesting allowed, the root container being depth 1.
///
/// # Safety
/// `config` must be NULL or a live config.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_admission_config_set_max_depth(
    config: *mut kvrelay_admission_config,
    max_depth: usize,
) -> kvrelay_status {
    set(config, |c| {
        c.max_depth = max_depth;
        Ok(())
    })
}

/// Raw inputs longer than this are `oversized` without parsing.
///
/// # Safety
/// `config` must be NULL or a live config.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_admission_config_set_max_raw_bytes(
    config: *mut kvrelay_admission_config,
    max_raw_bytes: usize,
) -> kvrelay_status {
    set(config, |c| {
        c.max_raw_bytes = max_raw_bytes;
        Ok(())
    })
}

/// Prefix of the Prometheus metric names (UTF-8, not NUL-terminated), e.g. `trtllm_kv_hints`.
///
/// # Safety
/// `config` NULL or live; `prefix` NULL or readable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_admission_config_set_metric_prefix(
    config: *mut kvrelay_admission_config,
    prefix: *const c_char,
    len: usize,
) -> kvrelay_status {
    // Argument conversion runs inside the guard too (inside `set`).
    set(config, |c| {
        // SAFETY: forwarded contract.
        c.metric_prefix = unsafe { text(prefix.cast(), len) }?.to_string();
        Ok(())
    })
}

/// Create an admission edge from `config` (NULL: the defaults, trust off). The config is
/// copied; free it whenever you like. `KVRELAY_ERR_INVALID_CONFIG` for refused values.
///
/// # Safety
/// `config` NULL or live; `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_admission_new(
    config: *const kvrelay_admission_config,
    out: *mut *mut kvrelay_admission,
) -> kvrelay_status {
    guard(|| {
        let out = out_ptr(out)?;
        let cfg = if config.is_null() {
            AdmissionConfig::default()
        } else {
            // SAFETY: non-NULL and live per the contract.
            unsafe { input(config) }?.inner.clone()
        };
        let inner = Admission::new(cfg).map_err(|e| with_detail(KVRELAY_ERR_INVALID_CONFIG, e))?;
        // SAFETY: checked non-NULL; caller promises writable.
        unsafe { put(out, Box::into_raw(Box::new(kvrelay_admission { inner }))) };
        Ok(())
    })
}

/// Free an admission edge. NULL does nothing. Snapshots it admitted stay valid.
///
/// # Safety
/// `admission` NULL or from `kvrelay_admission_new`, not freed before, and not in use by
/// another thread.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_admission_free(admission: *mut kvrelay_admission) {
    // SAFETY: forwarded contract.
    unsafe { free_box(admission) }
}

/// Write an outcome (into the caller's struct of `size` bytes, checked by `output_size`) and
/// its snapshot (NULL unless admitted) to the out-pointers.
///
/// # Safety
/// Both pointers checked non-NULL and writable, `out` for `size` bytes.
unsafe fn emit(o: Outcome, out: *mut kvrelay_outcome, size: usize, snap: *mut *mut kvrelay_snapshot) {
    let c = kvrelay_outcome::of(&o);
    let s = match o {
        Outcome::Admitted(s) => export(s),
        _ => std::ptr::null_mut(),
    };
    // SAFETY: forwarded contract.
    unsafe {
        put_sized_at(out, size, c);
        put(snap, s);
    }
}

/// The stride of the caller's `outcomes[0..n]`: every element's `size`, which must be the same
/// (checked before anything is admitted or written).
///
/// # Safety
/// `outcomes` non-NULL, each of the `n` elements readable for the `size` it declares.
unsafe fn outcome_stride(outcomes: *const kvrelay_outcome, n: usize) -> Result<usize, kvrelay_status> {
    if n == 0 {
        return Ok(std::mem::size_of::<kvrelay_outcome>());
    }
    // SAFETY: forwarded contract.
    let stride = unsafe { output_size(outcomes, "kvrelay_outcome") }?;
    for i in 1..n {
        // SAFETY: element `i` starts `i * stride` bytes in (the array's stride is its elements'
        // size), readable for its `size`; `stride` is a multiple of the alignment.
        let e = unsafe { outcomes.cast::<u8>().add(i * stride).cast::<kvrelay_outcome>() };
        // SAFETY: as above.
        let size = unsafe { e.cast::<usize>().read() };
        if size != stride {
            return Err(with_detail(
                KVRELAY_ERR_INVALID_ARGUMENT,
                format!("outcomes[{i}].size is {size}, outcomes[0].size {stride}: set every element's to sizeof(kvrelay_outcome)"),
            ));
        }
    }
    Ok(stride)
}

/// Admit one hint value: the raw JSON text found under `kv_hints` (`(NULL, 0)` when the
/// request has none). Applies SPEC.md section 2 in order and counts the outcome once.
/// `*outcome` gets the outcome; `*snapshot` a new reference (release it) when admitted, NULL
/// otherwise. Inference should continue whatever the outcome.
///
/// Cost: one pass over the input, no allocation besides the snapshot's one. Thread-safe.
///
/// # Safety
/// `admission` NULL or live; `json` NULL or readable for `len` bytes; `outcome` and `snapshot`
/// NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_admit(
    admission: *const kvrelay_admission,
    json: *const u8,
    len: usize,
    outcome: *mut kvrelay_outcome,
    snapshot: *mut *mut kvrelay_snapshot,
) -> kvrelay_status {
    guard(|| {
        let (outcome, snapshot) = (out_ptr(outcome)?, out_ptr(snapshot)?);
        // SAFETY: forwarded contract.
        let (a, raw, size) =
            unsafe { (input(admission)?, bytes(json, len)?, output_size(outcome, "kvrelay_outcome")?) };
        let o = a.inner.admit(Some(raw));
        // SAFETY: both checked non-NULL, writable per the contract.
        unsafe { emit(o, outcome, size, snapshot) };
        Ok(())
    })
}

/// Admit the `kv_hints` value of a batched request of `prompts` prompts (SPEC.md section 2):
/// a single envelope is admitted once and shared, an aligned JSON list is admitted entry by
/// entry (`null` entries are absent). Fills `outcomes[0..prompts]` and
/// `snapshots[0..prompts]`; each non-NULL snapshot is its own reference (release each one;
/// shared entries are the same pointer retained once per prompt). `*shared` (may be NULL)
/// tells which form it was. A list of another length is `KVRELAY_ERR_BATCH_LENGTH_MISMATCH`
/// and writes nothing.
///
/// # Safety
/// `admission` NULL or live; `json` NULL or readable for `len` bytes; `outcomes` and
/// `snapshots` NULL or writable for `prompts` elements; `shared` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_admit_batch(
    admission: *const kvrelay_admission,
    json: *const u8,
    len: usize,
    prompts: usize,
    outcomes: *mut kvrelay_outcome,
    snapshots: *mut *mut kvrelay_snapshot,
    shared: *mut bool,
) -> kvrelay_status {
    guard(|| {
        let (outcomes, snapshots) = (out_ptr(outcomes)?, out_ptr(snapshots)?);
        // SAFETY: forwarded contract.
        let (a, raw, stride) = unsafe { (input(admission)?, bytes(json, len)?, outcome_stride(outcomes, prompts)?) };
        let raw = if raw.is_empty() { None } else { Some(raw) };
        let b = a.inner.admit_batch(raw, prompts).map_err(|_| KVRELAY_ERR_BATCH_LENGTH_MISMATCH)?;
        let is_shared = matches!(b, BatchOutcome::Shared(_));
        let per: Vec<Outcome> = match b {
            BatchOutcome::Shared(o) => vec![o; prompts],
            BatchOutcome::PerPrompt(v) => v,
        };
        for (i, o) in per.into_iter().enumerate() {
            // SAFETY: `i < prompts`; both arrays hold `prompts` writable elements, the outcomes
            // `stride` bytes apart (each of that size, checked).
            unsafe { emit(o, outcomes.cast::<u8>().add(i * stride).cast(), stride, snapshots.add(i)) };
        }
        if !shared.is_null() {
            // SAFETY: non-NULL and writable per the contract.
            unsafe { put(shared, is_shared) };
        }
        Ok(())
    })
}

/// Decode a MessagePack envelope (from `kvrelay_snapshot_msgpack`, e.g. a rank broadcast) and
/// re-validate it with this edge's limits and the 0.1 rules. Trust does not apply and nothing
/// is counted (the hint was counted where it entered). Outputs as `kvrelay_admit`.
///
/// # Safety
/// As `kvrelay_admit`.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_admission_decode_msgpack(
    admission: *const kvrelay_admission,
    msgpack: *const u8,
    len: usize,
    outcome: *mut kvrelay_outcome,
    snapshot: *mut *mut kvrelay_snapshot,
) -> kvrelay_status {
    guard(|| {
        let (outcome, snapshot) = (out_ptr(outcome)?, out_ptr(snapshot)?);
        // SAFETY: forwarded contract.
        let (a, raw, size) =
            unsafe { (input(admission)?, bytes(msgpack, len)?, output_size(outcome, "kvrelay_outcome")?) };
        let o = match a.inner.decode_msgpack(raw) {
            Ok(s) => Outcome::Admitted(s),
            Err(i) => Outcome::Ignored(i),
        };
        // SAFETY: both checked non-NULL, writable per the contract.
        unsafe { emit(o, outcome, size, snapshot) };
        Ok(())
    })
}

/// Copy the edge's counters.
///
/// # Safety
/// `admission` NULL or live; `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_admission_counters(
    admission: *const kvrelay_admission,
    out: *mut kvrelay_counters,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        let a = unsafe { input(admission) }?;
        // SAFETY: `out` NULL or writable for the size it declares (checked there).
        unsafe { put_sized(out, a.inner.counters().values().into(), "kvrelay_counters") }
    })
}

/// The counters as Prometheus text (format 0.0.4, HELP and TYPE lines, the configured prefix),
/// NUL-terminated, into the caller's buffer. `*len_out` gets the size needed **including** the
/// NUL; a smaller buffer gets nothing (`KVRELAY_ERR_BUFFER_TOO_SMALL`); `(NULL, 0)` queries.
///
/// # Safety
/// `admission` NULL or live; `buf` NULL or writable for `cap` bytes; `len_out` NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_admission_prometheus(
    admission: *const kvrelay_admission,
    buf: *mut c_char,
    cap: usize,
    len_out: *mut usize,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        let a = unsafe { input(admission) }?;
        let mut s = a.inner.prometheus();
        s.push('\0');
        // SAFETY: forwarded contract.
        unsafe { fill(s.as_bytes(), buf.cast(), cap, len_out) }
    })
}

/// Where a request body carries its KV hint (`kvrelay_find_hint`).
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvrelay_hint_spelling {
    /// No hint: none of the spellings, or only `null` ones.
    KVRELAY_HINT_NONE = 0,
    /// `kv_hints` at the top level: admit it with `kvrelay_admit_batch` over the request's
    /// prompts (one envelope shared, or a list aligned with the prompts).
    KVRELAY_HINT_KV_HINTS = 1,
    /// `kv_hint` at the top level (Dynamo): admit it with `kvrelay_admit`.
    KVRELAY_HINT_KV_HINT = 2,
    /// `router_hint` at the top level (newer Dynamo): admit it with `kvrelay_admit`.
    KVRELAY_HINT_ROUTER_HINT = 3,
    /// `kv_transfer_params.kv_hint`: admit it with `kvrelay_admit`.
    KVRELAY_HINT_TRANSFER_KV_HINT = 4,
    /// `kv_transfer_params.router_hint`: admit it with `kvrelay_admit`.
    KVRELAY_HINT_TRANSFER_ROUTER_HINT = 5,
}

/// Find the KV hint of a generation request's body, the body's original bytes (`body`, `len`):
/// one rule for every runtime, so that admission sees the client's own text (its duplicate
/// members, its large integers and its size survive no parse and re-serialization). A request
/// carries at most one hint, under one of five spellings (`kvrelay_hint_spelling`); a member
/// whose value is `null` is absent; anything else in the body is skipped.
///
/// On `KVRELAY_OK`: `*spelling_out` is a `kvrelay_hint_spelling` value, and
/// `body[*offset_out .. *offset_out + *len_out]` is the hint's value exactly as sent (`0, 0`
/// with `KVRELAY_HINT_NONE`): pass it to `kvrelay_admit_batch` for `KVRELAY_HINT_KV_HINTS`,
/// to `kvrelay_admit` otherwise. `KVRELAY_ERR_INVALID_ARGUMENT` when the body carries two hints
/// (two spellings, or one twice: answer the request 400, the message names both) or is not one
/// JSON object; nothing is written then, and `kvrelay_last_error_message` says which.
///
/// Cost: one pass over the body, structure only (the runtime's own parser validated it), no
/// allocation but to decode a key written with escapes. Thread-safe; never reads past `len`.
///
/// # Safety
/// `body` NULL (with `len` 0) or readable for `len` bytes; the out-pointers NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_find_hint(
    body: *const u8,
    len: usize,
    spelling_out: *mut i32,
    offset_out: *mut usize,
    len_out: *mut usize,
) -> kvrelay_status {
    guard(|| {
        let (s_out, o_out, l_out) = (out_ptr(spelling_out)?, out_ptr(offset_out)?, out_ptr(len_out)?);
        // SAFETY: forwarded contract.
        let body = unsafe { bytes(body, len) }?;
        let f = crate::hints::find_hint(body).map_err(|e| with_detail(KVRELAY_ERR_INVALID_ARGUMENT, e))?;
        // SAFETY: all three checked non-NULL, writable per the contract.
        unsafe {
            put(s_out, f.spelling as i32);
            put(o_out, f.value.start);
            put(l_out, f.value.len());
        }
        Ok(())
    })
}
