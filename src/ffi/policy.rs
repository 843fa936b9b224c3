//! The policy layer from C: capabilities, candidates, the policy configuration, a provider
//! vtable and the orchestrator.

use std::ffi::{c_char, c_void};
use std::sync::Arc;

use super::boundary::{
    fill, free_box, guard, input, input_mut, input_sized, note_last_error, out_ptr, output_size, own_size, put,
    put_sized, put_sized_at, read_sized, sized_since_epoch, text, with_detail,
};
use super::snapshot::{borrow, kvrelay_snapshot};
use super::status::kvrelay_status::{self, *};
use super::types::{kvrelay_bytes, kvrelay_str};
use crate::policy::{
    for_each_candidate, Addressing, BindingSpec, Capabilities, CapabilitiesBuilder, Decision, Discard, FetchRequest,
    Orchestrator, PolicyConfig, Provider, ProviderError, RequestInfo,
};

/// Capability snapshot under construction, then frozen by `kvrelay_capabilities_build`.
pub struct kvrelay_capabilities_builder {
    inner: CapabilitiesBuilder,
}

/// An immutable capability snapshot. Owned: `_free` (orchestrators keep their own reference).
pub struct kvrelay_capabilities {
    inner: Arc<Capabilities>,
}

/// The server's policy configuration under construction: bindings, trusted endpoints.
pub struct kvrelay_policy_config {
    inner: PolicyConfig,
}

/// An orchestrator: capabilities, bindings, endpoint registry, provider and counters.
/// Owned: `_new` / `_free`. `kvrelay_orchestrate` is thread-safe.
pub struct kvrelay_orchestrator {
    inner: Orchestrator,
}

/// A candidate: a supported `kv.fetch` action and the families supporting it.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvrelay_candidate {
    /// Position in the snapshot's actions.
    pub action_index: usize,
    /// Bit i set when family i (registration order in the capability builder) supports it.
    pub families: u64,
}

/// Counts of one candidate collection.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvrelay_candidate_counts {
    /// `sizeof(kvrelay_candidate_counts)` as the caller's header declares it (the library writes only the fields it
    /// covers).
    pub size: usize,
    /// Actions whose type no family lists.
    pub unknown_type: u32,
    /// `kv.fetch` actions whose version no family supports.
    pub no_matching_version: u32,
}

/// `kvrelay_policy_config_add_binding`'s addressing mode.
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvrelay_addressing {
    /// Fetches by content name: usable for named fetch.
    KVRELAY_ADDRESSING_NAMED = 0,
    /// Tied to the request's prefill/decode pairing: never used for named fetch.
    KVRELAY_ADDRESSING_REQUEST_PAIRED = 1,
}

/// The request facts eligibility needs.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvrelay_request_info {
    /// `sizeof(kvrelay_request_info)` as the caller's header declares it.
    pub size: usize,
    /// A generation-only request.
    pub generation_only: bool,
    /// The request uses a LoRA adapter.
    pub lora_adapter: bool,
}

/// What a provider is asked to validate, then to fetch. Views valid during the call only.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvrelay_fetch_request {
    /// The library's `sizeof(kvrelay_fetch_request)`: a provider built against a newer header
    /// reads no field past it.
    pub size: usize,
    /// The resolved binding's id.
    pub binding_id: kvrelay_str,
    /// Its family's name.
    pub family: kvrelay_str,
    /// Position of the action in the snapshot.
    pub action_index: usize,
    /// The action's type.
    pub action_type: kvrelay_str,
    /// The action's version.
    pub action_version: kvrelay_str,
    /// The action's canonical payload.
    pub payload: kvrelay_bytes,
    /// The destination, normalized, present in the trusted registry.
    pub endpoint: kvrelay_str,
    /// The canonical one-action envelope to hand on.
    pub envelope: kvrelay_bytes,
    /// The `call_context` given to `kvrelay_orchestrate_with_context` for this request (NULL
    /// from `kvrelay_orchestrate`): where the provider leaves the fetch it accepted, for the
    /// code that asked, without globals or thread-locals.
    pub call_context: *mut c_void,
}

/// The C caller's per-call pointer, carried through the policy core as a typed context.
struct CallContext(*mut c_void);
// SAFETY: the pointer is only handed back to the provider, on the thread that called
// `kvrelay_orchestrate_with_context`, during that call; kvrelay never dereferences it.
unsafe impl Sync for CallContext {}
// SAFETY: as above: the pointer is carried, never dereferenced, by kvrelay.
unsafe impl Send for CallContext {}

/// A consumer's provider. `validate` and `fetch` return 0 to accept, anything else to refuse
/// (the value is the provider's own code); a NULL `validate` or `fetch` refuses (code -1), so a
/// provider without `validate` is never asked to fetch. They run on the thread that calls
/// `kvrelay_orchestrate`, inside that call, possibly on many threads at once, so they must be
/// thread-safe; they must not unwind or `longjmp` out (a C++ exception must be caught inside),
/// and must not keep the request's views after returning. `destroy` (may be NULL) is called once
/// with `user_data` when the orchestrator is freed (or when `kvrelay_orchestrator_new` fails).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct kvrelay_provider {
    /// `sizeof(kvrelay_provider)` as the caller's header declares it.
    pub size: usize,
    /// Passed back to every callback.
    pub user_data: *mut c_void,
    /// Validate action version, payload and destination on the provider's own terms.
    pub validate: Option<unsafe extern "C" fn(user_data: *mut c_void, request: *const kvrelay_fetch_request) -> i32>,
    /// Submit the named fetch.
    pub fetch: Option<unsafe extern "C" fn(user_data: *mut c_void, request: *const kvrelay_fetch_request) -> i32>,
    /// Release `user_data`.
    pub destroy: Option<unsafe extern "C" fn(user_data: *mut c_void)>,
}

sized_since_epoch!(
    kvrelay_candidate_counts,
    kvrelay_request_info,
    kvrelay_fetch_request,
    kvrelay_provider,
    kvrelay_decision,
    kvrelay_policy_counters
);

struct CProvider(kvrelay_provider);

// SAFETY: the provider contract (documented on kvrelay_provider) requires callbacks and
// user_data to be usable from any thread, concurrently.
unsafe impl Send for CProvider {}
// SAFETY: as above.
unsafe impl Sync for CProvider {}

impl Drop for CProvider {
    fn drop(&mut self) {
        if let Some(d) = self.0.destroy {
            // SAFETY: called exactly once, with the user_data the consumer supplied for it.
            unsafe { d(self.0.user_data) };
        }
    }
}

impl CProvider {
    fn call(
        &self,
        f: Option<unsafe extern "C" fn(*mut c_void, *const kvrelay_fetch_request) -> i32>,
        r: &FetchRequest<'_>,
    ) -> Result<(), ProviderError> {
        let envelope = r.envelope.to_canonical();
        let req = kvrelay_fetch_request {
            size: own_size::<kvrelay_fetch_request>(),
            binding_id: kvrelay_str::of(r.binding_id),
            family: kvrelay_str::of(r.family),
            action_index: r.action.index(),
            action_type: kvrelay_str::of(r.action.action_type()),
            action_version: kvrelay_str::of(r.action.version()),
            payload: kvrelay_bytes::of(r.action.payload()),
            endpoint: kvrelay_str::of(r.endpoint),
            envelope: kvrelay_bytes::of(&envelope),
            call_context: r.context.and_then(|c| c.downcast_ref::<CallContext>()).map_or(std::ptr::null_mut(), |c| c.0),
        };
        let f = f.ok_or(ProviderError { code: -1 })?;
        // SAFETY: `f` is the consumer's callback; `req` and the bytes it points to live until
        // the call returns, as the contract promises.
        match unsafe { f(self.0.user_data, &req) } {
            0 => Ok(()),
            code => Err(ProviderError { code }),
        }
    }
}

impl Provider for CProvider {
    fn validate(&self, r: &FetchRequest<'_>) -> Result<(), ProviderError> {
        self.call(self.0.validate, r)
    }
    fn fetch(&self, r: &FetchRequest<'_>) -> Result<(), ProviderError> {
        self.call(self.0.fetch, r)
    }
}

/// Start a capability snapshot.
///
/// # Safety
/// `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_capabilities_builder_new(
    out: *mut *mut kvrelay_capabilities_builder,
) -> kvrelay_status {
    guard(|| {
        let out = out_ptr(out)?;
        let b = Box::new(kvrelay_capabilities_builder { inner: Capabilities::builder() });
        // SAFETY: checked non-NULL; writable per the contract.
        unsafe { put(out, Box::into_raw(b)) };
        Ok(())
    })
}

/// Declare that `family` supports `(action_type, action_version)` (all UTF-8, exact match).
/// Families are numbered in the order they are first named (bit i of candidate masks).
///
/// # Safety
/// `builder` NULL or live; each string NULL or readable for its length.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_capabilities_builder_add(
    builder: *mut kvrelay_capabilities_builder,
    family: *const c_char,
    family_len: usize,
    action_type: *const c_char,
    action_type_len: usize,
    action_version: *const c_char,
    action_version_len: usize,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        let b = unsafe { input_mut(builder) }?;
        // SAFETY: forwarded contract.
        let (f, t, v) = unsafe {
            (
                text(family.cast(), family_len)?,
                text(action_type.cast(), action_type_len)?,
                text(action_version.cast(), action_version_len)?,
            )
        };
        b.inner.add(f, t, v);
        Ok(())
    })
}

/// Freeze the builder into a capability snapshot; the builder is consumed (freed) in every
/// case. `KVRELAY_ERR_INVALID_CONFIG` for empty strings or more than 64 families.
///
/// # Safety
/// `builder` NULL or live (not used afterwards); `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_capabilities_build(
    builder: *mut kvrelay_capabilities_builder,
    out: *mut *mut kvrelay_capabilities,
) -> kvrelay_status {
    guard(|| {
        if builder.is_null() {
            return Err(KVRELAY_ERR_NULL);
        }
        // SAFETY: non-NULL live box from `_builder_new`, consumed here.
        let b = unsafe { Box::from_raw(builder) };
        let out = out_ptr(out)?;
        let caps = b.inner.build().map_err(|e| with_detail(KVRELAY_ERR_INVALID_CONFIG, e))?;
        // SAFETY: checked non-NULL; writable per the contract.
        unsafe { put(out, Box::into_raw(Box::new(kvrelay_capabilities { inner: Arc::new(caps) }))) };
        Ok(())
    })
}

/// Free a capability builder that was never built. NULL does nothing.
///
/// # Safety
/// `builder` NULL or live.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_capabilities_builder_free(builder: *mut kvrelay_capabilities_builder) {
    // SAFETY: forwarded contract.
    unsafe { free_box(builder) }
}

/// Free a capability snapshot. NULL does nothing.
///
/// # Safety
/// `caps` NULL or live.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_capabilities_free(caps: *mut kvrelay_capabilities) {
    // SAFETY: forwarded contract.
    unsafe { free_box(caps) }
}

/// Collect the candidates of `snapshot` into `out[0..cap]` (producer order) and the counts
/// into `*counts` (may be NULL). `*count_out` always receives the number of candidates; a
/// smaller `cap` writes nothing else, `*counts` included (`KVRELAY_ERR_BUFFER_TOO_SMALL`);
/// `(NULL, 0)` queries. No allocation: one counting pass over the actions, then one writing pass.
///
/// # Safety
/// `snapshot` NULL or live; `caps` NULL or live; `out` NULL or writable for `cap` elements;
/// `count_out` NULL or writable; `counts` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_collect_candidates(
    snapshot: *const kvrelay_snapshot,
    caps: *const kvrelay_capabilities,
    out: *mut kvrelay_candidate,
    cap: usize,
    count_out: *mut usize,
    counts: *mut kvrelay_candidate_counts,
) -> kvrelay_status {
    guard(|| {
        let count_out = out_ptr(count_out)?;
        // SAFETY: forwarded contract.
        let (s, c) = unsafe { (borrow(snapshot)?, input(caps)?) };
        let counts_size = if counts.is_null() {
            0
        } else {
            // SAFETY: forwarded contract: writable for the size it declares (checked before
            // anything is written).
            unsafe { output_size(counts, "kvrelay_candidate_counts") }?
        };
        if out.is_null() && cap != 0 {
            return Err(KVRELAY_ERR_INVALID_ARGUMENT);
        }
        // A counting pass, then (when the buffer is large enough) a writing pass: no allocation,
        // and nothing but the count is written when the buffer is too small.
        let mut total = 0usize;
        let n = for_each_candidate(&s, &c.inner, |_| total += 1);
        // SAFETY: checked non-NULL; writable per the contract.
        unsafe { put(count_out, total) };
        if cap < total {
            return Err(KVRELAY_ERR_BUFFER_TOO_SMALL);
        }
        let mut i = 0usize;
        for_each_candidate(&s, &c.inner, |cand| {
            let v = kvrelay_candidate { action_index: cand.action_index, families: cand.families.bits() };
            // SAFETY: i < total <= cap elements, writable per the contract.
            unsafe { put(out.add(i), v) };
            i += 1;
        });
        if !counts.is_null() {
            let v = kvrelay_candidate_counts {
                size: counts_size,
                unknown_type: n.unknown_type,
                no_matching_version: n.no_matching_version,
            };
            // SAFETY: checked by `output_size`; writable for that size per the contract.
            unsafe { put_sized_at(counts, counts_size, v) };
        }
        Ok(())
    })
}

/// Start a policy configuration (no bindings, empty registry, prefix `kvrelay_kv_policy`).
///
/// # Safety
/// `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_policy_config_new(out: *mut *mut kvrelay_policy_config) -> kvrelay_status {
    guard(|| {
        let out = out_ptr(out)?;
        // SAFETY: checked non-NULL; writable per the contract.
        unsafe { put(out, Box::into_raw(Box::new(kvrelay_policy_config { inner: PolicyConfig::default() }))) };
        Ok(())
    })
}

/// Free a policy configuration. NULL does nothing.
///
/// # Safety
/// `config` NULL or live.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_policy_config_free(config: *mut kvrelay_policy_config) {
    // SAFETY: forwarded contract.
    unsafe { free_box(config) }
}

/// Add a binding of `family` with `addressing` (a `kvrelay_addressing` value) and authorization.
/// Add what the binding itself supports with `kvrelay_policy_config_binding_support`.
///
/// # Safety
/// `config` NULL or live; strings NULL or readable for their lengths.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_policy_config_add_binding(
    config: *mut kvrelay_policy_config,
    id: *const c_char,
    id_len: usize,
    family: *const c_char,
    family_len: usize,
    addressing: i32,
    authorized: bool,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        let c = unsafe { input_mut(config) }?;
        // SAFETY: forwarded contract.
        let (id, family) = unsafe { (text(id.cast(), id_len)?, text(family.cast(), family_len)?) };
        let addressing = match addressing {
            0 => Addressing::Named,
            1 => Addressing::RequestPaired,
            _ => return Err(KVRELAY_ERR_INVALID_ARGUMENT),
        };
        c.inner.bindings.push(BindingSpec {
            id: id.into(),
            family: family.into(),
            addressing,
            supports: Vec::new(),
            authorized,
        });
        Ok(())
    })
}

/// Declare that binding `id` (added before) supports `(action_type, action_version)`.
/// `KVRELAY_ERR_INVALID_ARGUMENT` when no binding has that id.
///
/// # Safety
/// `config` NULL or live; strings NULL or readable for their lengths.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_policy_config_binding_support(
    config: *mut kvrelay_policy_config,
    id: *const c_char,
    id_len: usize,
    action_type: *const c_char,
    action_type_len: usize,
    action_version: *const c_char,
    action_version_len: usize,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        let c = unsafe { input_mut(config) }?;
        // SAFETY: forwarded contract.
        let (id, t, v) = unsafe {
            (
                text(id.cast(), id_len)?,
                text(action_type.cast(), action_type_len)?,
                text(action_version.cast(), action_version_len)?,
            )
        };
        let b = c.inner.bindings.iter_mut().find(|b| b.id == id).ok_or_else(|| {
            with_detail(KVRELAY_ERR_INVALID_ARGUMENT, format_args!("no binding has the id {id:?} (add it first)"))
        })?;
        b.supports.push((t.into(), v.into()));
        Ok(())
    })
}

/// Add an endpoint (`scheme://host:port`) to the trusted registry. `KVRELAY_ERR_INVALID_ARGUMENT`
/// when it does not normalize (wildcard host, no port, path...).
///
/// # Safety
/// `config` NULL or live; `endpoint` NULL or readable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_policy_config_add_endpoint(
    config: *mut kvrelay_policy_config,
    endpoint: *const c_char,
    len: usize,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        let c = unsafe { input_mut(config) }?;
        // SAFETY: forwarded contract.
        let e = unsafe { text(endpoint.cast(), len) }?;
        crate::policy::normalize_endpoint(e).map_err(|err| with_detail(KVRELAY_ERR_INVALID_ARGUMENT, err))?;
        c.inner.endpoints.push(e.into());
        Ok(())
    })
}

/// Prefix of the policy's Prometheus metric names (default `kvrelay_kv_policy`).
///
/// # Safety
/// `config` NULL or live; `prefix` NULL or readable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_policy_config_set_metric_prefix(
    config: *mut kvrelay_policy_config,
    prefix: *const c_char,
    len: usize,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        let c = unsafe { input_mut(config) }?;
        // SAFETY: forwarded contract.
        c.inner.metric_prefix = unsafe { text(prefix.cast(), len) }?.into();
        Ok(())
    })
}

/// Build an orchestrator. The capability snapshot is shared (free yours whenever you like), the
/// config copied, and the provider owned from here on: its `destroy` runs when the
/// orchestrator is freed, or right away if this call fails for any reason but a NULL `out` or
/// `provider`. `KVRELAY_ERR_INVALID_CONFIG` for a binding of an unknown family, a repeated
/// binding id, or a bad metric prefix.
///
/// # Safety
/// `caps`, `config` NULL or live; `provider` NULL or readable; `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_orchestrator_new(
    caps: *const kvrelay_capabilities,
    config: *const kvrelay_policy_config,
    provider: *const kvrelay_provider,
    out: *mut *mut kvrelay_orchestrator,
) -> kvrelay_status {
    guard(|| {
        let out = out_ptr(out)?;
        // SAFETY: forwarded contract.
        let p = unsafe { read_sized(provider) }?;
        // owned from here: a refused struct's destroy still runs, where the caller's has one
        let (p, ok) = (CProvider(p.value), p.check("kvrelay_provider"));
        ok?;
        // SAFETY: forwarded contract.
        let (c, cfg) = unsafe { (input(caps)?, input(config)?) };
        let o = Orchestrator::new(c.inner.clone(), cfg.inner.clone(), Box::new(p))
            .map_err(|e| with_detail(KVRELAY_ERR_INVALID_CONFIG, e))?;
        // SAFETY: checked non-NULL; writable per the contract.
        unsafe { put(out, Box::into_raw(Box::new(kvrelay_orchestrator { inner: o }))) };
        Ok(())
    })
}

/// Free an orchestrator (calls the provider's `destroy`). NULL does nothing.
///
/// # Safety
/// `orchestrator` NULL or live and not in use by another thread.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_orchestrator_free(orchestrator: *mut kvrelay_orchestrator) {
    // SAFETY: forwarded contract.
    unsafe { free_box(orchestrator) }
}

/// Why optional named fetch was not attempted: `kvrelay_decision.discard`. The values never
/// change meaning; `kvrelay_discard_name` gives the metric label.
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvrelay_discard {
    /// Not a discard: the named fetch was submitted.
    KVRELAY_DISCARD_NONE = 0,
    /// Not a generation-only request (ineligible: no candidate collection).
    KVRELAY_DISCARD_NOT_GENERATION_ONLY = 1,
    /// The request uses a LoRA adapter (ineligible: no candidate collection).
    KVRELAY_DISCARD_LORA_ADAPTER = 2,
    /// No admitted hint.
    KVRELAY_DISCARD_NO_HINT = 3,
    /// No supported `kv.fetch` action.
    KVRELAY_DISCARD_NO_CANDIDATE = 4,
    /// No binding is configured for any family supporting the first candidate.
    KVRELAY_DISCARD_MISSING_MAPPING = 5,
    /// Bindings exist but none is authorized.
    KVRELAY_DISCARD_UNAUTHORIZED = 6,
    /// Authorized bindings exist but none supports the action's type and version.
    KVRELAY_DISCARD_CAPABILITY_MISMATCH = 7,
    /// More than one authorized binding supports the action: the mapping does not choose.
    KVRELAY_DISCARD_AMBIGUOUS_MAPPING = 8,
    /// The resolved binding is request-paired.
    KVRELAY_DISCARD_REQUEST_PAIRED = 9,
    /// The payload has no `source_control_endpoint` string.
    KVRELAY_DISCARD_ENDPOINT_MISSING = 10,
    /// The endpoint does not normalize (malformed, wildcard, no port...).
    KVRELAY_DISCARD_ENDPOINT_INVALID = 11,
    /// The endpoint is not in the server's trusted endpoint registry.
    KVRELAY_DISCARD_ENDPOINT_NOT_TRUSTED = 12,
    /// The provider's own validation refused the action, payload or destination.
    KVRELAY_DISCARD_PROVIDER_REJECTED = 13,
    /// The provider accepted but the fetch submission failed.
    KVRELAY_DISCARD_FETCH_FAILED = 14,
    /// The provider chose not to fetch, nothing being wrong: its `fetch` code has
    /// `KVRELAY_PROVIDER_DECLINED` set.
    KVRELAY_DISCARD_PROVIDER_DECLINED = 15,
}

/// Set in a provider's positive `fetch` answer (a negative one is never a decline) to say it
/// declined by choice (nothing to fetch, not worth it, another request already fetching the
/// same blocks) rather than failed: the decision's discard is then
/// `KVRELAY_DISCARD_PROVIDER_DECLINED`, not `KVRELAY_DISCARD_FETCH_FAILED` (counted apart);
/// `provider_code` keeps the whole answer.
pub const KVRELAY_PROVIDER_DECLINED: i32 = 0x4000_0000;
const _: () = assert!(KVRELAY_PROVIDER_DECLINED == crate::policy::PROVIDER_DECLINED);

/// `kvrelay_decision.kind`.
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvrelay_decision_kind {
    /// Named fetch validated and submitted.
    KVRELAY_DECISION_NAMED_FETCH = 1,
    /// Keep the existing paired path; see `discard`.
    KVRELAY_DECISION_KEEP_PAIRED_PATH = 2,
}

/// The decision for one request.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvrelay_decision {
    /// `sizeof(kvrelay_decision)` as the caller's header declares it (the library writes only the fields it
    /// covers).
    pub size: usize,
    /// A `kvrelay_decision_kind` value.
    pub kind: i32,
    /// For KEEP_PAIRED_PATH: the reason, a `kvrelay_discard` value; `kvrelay_discard_name`
    /// renders it. `KVRELAY_DISCARD_NONE` (0) for NAMED_FETCH.
    pub discard: i32,
    /// For NAMED_FETCH: the binding's id (valid while the orchestrator lives).
    pub binding_id: kvrelay_str,
    /// For NAMED_FETCH: the action's position in the snapshot.
    pub action_index: usize,
    /// For `KVRELAY_DISCARD_PROVIDER_REJECTED`, `KVRELAY_DISCARD_FETCH_FAILED` and
    /// `KVRELAY_DISCARD_PROVIDER_DECLINED`: what the provider answered (its own non-zero code,
    /// -1 for a NULL callback). 0 otherwise.
    pub provider_code: i32,
}

/// Decide for one request (`snapshot` NULL when it has no admitted hint) and, when every check
/// passes, call the provider's `validate` then `fetch`. Counts the outcome once. When the
/// provider refuses, `provider_code` holds its answer and the thread's last error says so
/// (`kvrelay_last_error_message`), although the call itself succeeds. The provider sees
/// `call_context` NULL; `kvrelay_orchestrate_with_context` passes one.
///
/// # Safety
/// `orchestrator` NULL or live; `request` NULL or readable; `snapshot` NULL or live; `out` NULL
/// or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_orchestrate(
    orchestrator: *const kvrelay_orchestrator,
    request: *const kvrelay_request_info,
    snapshot: *const kvrelay_snapshot,
    out: *mut kvrelay_decision,
) -> kvrelay_status {
    // SAFETY: forwarded contract.
    unsafe { kvrelay_orchestrate_with_context(orchestrator, request, snapshot, std::ptr::null_mut(), out) }
}

/// `kvrelay_orchestrate` with a per-call context: the provider's `validate` and `fetch` get
/// `call_context` in `kvrelay_fetch_request.call_context` (kvrelay never reads it), so a provider
/// can hand the fetch it accepted (endpoint, hashes) to the caller of this request, e.g. by
/// filling a struct the caller owns on its stack.
///
/// # Safety
/// As `kvrelay_orchestrate`; `call_context` is any value (NULL included).
#[no_mangle]
pub unsafe extern "C" fn kvrelay_orchestrate_with_context(
    orchestrator: *const kvrelay_orchestrator,
    request: *const kvrelay_request_info,
    snapshot: *const kvrelay_snapshot,
    call_context: *mut c_void,
    out: *mut kvrelay_decision,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract (sized structs readable / writable for the size they declare;
        // the output's is checked before anything is decided or counted).
        let (o, r, size) = unsafe {
            (input(orchestrator)?, input_sized(request, "kvrelay_request_info")?, output_size(out, "kvrelay_decision")?)
        };
        let snap = if snapshot.is_null() {
            None
        } else {
            // SAFETY: non-NULL live handle per the contract.
            Some(unsafe { borrow(snapshot) }?)
        };
        let req = RequestInfo { generation_only: r.generation_only, lora_adapter: r.lora_adapter };
        let ctx = CallContext(call_context);
        let (d, answer) = o.inner.decide_with_context(&req, snap.as_deref(), Some(&ctx));
        let provider_code = answer.map_or(0, |e| e.code);
        if let (Some(e), Decision::KeepPairedPath(r)) = (answer, &d) {
            note_last_error(format!("{r}: the provider answered {} (the request keeps the paired path)", e.code));
        }
        let c = match d {
            Decision::NamedFetch { binding, envelope } => {
                // point at the orchestrator's own copy of the id so the view outlives `d`
                let id = o.inner.binding_id(&binding).expect("decided binding exists");
                kvrelay_decision {
                    size,
                    kind: kvrelay_decision_kind::KVRELAY_DECISION_NAMED_FETCH as i32,
                    discard: 0,
                    binding_id: kvrelay_str::of(id),
                    action_index: envelope.action().index(),
                    provider_code,
                }
            }
            Decision::KeepPairedPath(r) => kvrelay_decision {
                size,
                kind: kvrelay_decision_kind::KVRELAY_DECISION_KEEP_PAIRED_PATH as i32,
                discard: r as i32,
                binding_id: kvrelay_str::of(""),
                action_index: 0,
                provider_code,
            },
        };
        // SAFETY: checked by `output_size`; writable for that size per the contract.
        unsafe { put_sized_at(out, size, c) };
        Ok(())
    })
}

/// The metric label of a discard code (`"request_paired"`, ...); `"unknown"` for other values.
/// Static, NUL-terminated, never NULL.
#[no_mangle]
pub extern "C" fn kvrelay_discard_name(discard: i32) -> *const c_char {
    let s: &'static [u8] = if discard == 0 {
        b"none\0"
    } else {
        Discard::ALL.iter().find(|d| **d as i32 == discard).map_or(b"unknown\0", |d| d.c_label())
    };
    s.as_ptr().cast()
}

/// Slots of `kvrelay_policy_counters.discarded`: indexed by `kvrelay_discard` value (slot 0,
/// `KVRELAY_DISCARD_NONE`, stays 0).
pub const KVRELAY_DISCARD_SLOTS: usize = 16;

const _: () = assert!(Discard::ALL.len() < KVRELAY_DISCARD_SLOTS);

/// A copy of an orchestrator's counters.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct kvrelay_policy_counters {
    /// `sizeof(kvrelay_policy_counters)` as the caller's header declares it (the library writes only the fields it
    /// covers).
    pub size: usize,
    /// Optional named fetches validated and submitted.
    pub named_fetch: u64,
    /// Requests that kept the paired path, by `kvrelay_discard` value.
    pub discarded: [u64; KVRELAY_DISCARD_SLOTS],
    /// Actions whose type no backend family lists, summed over the requests that reached
    /// candidate collection (each request's actions counted once).
    pub unknown_type: u64,
    /// `kv.fetch` actions whose version no family supports, likewise.
    pub no_matching_version: u64,
}

/// Copy the orchestrator's counters.
///
/// # Safety
/// `orchestrator` NULL or live; `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_orchestrator_counters(
    orchestrator: *const kvrelay_orchestrator,
    out: *mut kvrelay_policy_counters,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        let o = unsafe { input(orchestrator) }?;
        let v = o.inner.counters();
        let mut c = kvrelay_policy_counters {
            size: own_size::<kvrelay_policy_counters>(),
            named_fetch: v.named_fetch,
            discarded: [0; KVRELAY_DISCARD_SLOTS],
            unknown_type: v.unknown_type,
            no_matching_version: v.no_matching_version,
        };
        for d in Discard::ALL {
            c.discarded[d as usize] = v.discarded(d);
        }
        // SAFETY: `out` NULL or writable for the size it declares (checked there).
        unsafe { put_sized(out, c, "kvrelay_policy_counters") }
    })
}

/// The orchestrator's counters as Prometheus text, NUL-terminated, with the size-query
/// convention of `kvrelay_admission_prometheus`.
///
/// # Safety
/// `orchestrator` NULL or live; `buf` NULL or writable for `cap` bytes; `len_out` NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_orchestrator_prometheus(
    orchestrator: *const kvrelay_orchestrator,
    buf: *mut c_char,
    cap: usize,
    len_out: *mut usize,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        let o = unsafe { input(orchestrator) }?;
        let mut s = o.inner.prometheus();
        s.push('\0');
        // SAFETY: forwarded contract.
        unsafe { fill(s.as_bytes(), buf.cast(), cap, len_out) }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Discard;

    #[test]
    fn discard_names_follow_the_enum() {
        for d in Discard::ALL {
            // SAFETY: static NUL-terminated strings.
            let n = unsafe { std::ffi::CStr::from_ptr(kvrelay_discard_name(d as i32)) };
            assert_eq!(n.to_str().unwrap(), d.as_str());
        }
        // SAFETY: as above.
        let n = unsafe { std::ffi::CStr::from_ptr(kvrelay_discard_name(16)) };
        assert_eq!(n.to_str().unwrap(), "unknown");
    }
}
