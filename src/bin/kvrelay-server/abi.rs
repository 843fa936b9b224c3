//! The server's one door into kvrelay: safe wrappers over the exported C ABI (`kvrelay_*`),
//! the same functions a C++ runtime links. Every `unsafe` block of the server lives here, so
//! the server's tests and load runs exercise the boundary the C++ runtime uses.
//!
//! Ownership mirrors the header: owned handles are freed on `Drop`, snapshots are retained on
//! `Clone` and released on `Drop`. Views borrow from the wrapper that produced them.

use std::ffi::{c_char, c_void, CStr};
use std::fmt;
use std::ptr::{self, NonNull};
use std::sync::Arc;

use kvrelay::ffi::admission::*;
use kvrelay::ffi::agent::*;
use kvrelay::ffi::copy::*;
use kvrelay::ffi::kvrelay_status;
use kvrelay::ffi::policy::*;
use kvrelay::ffi::snapshot::*;
use kvrelay::ffi::status::*;
use kvrelay::ffi::types::*;

/// A failed kvrelay call: which function, and the status it returned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AbiError {
    /// The C function that failed.
    pub call: &'static str,
    /// Its `kvrelay_status` value.
    pub status: i32,
}

impl fmt::Display for AbiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} failed: {}", self.call, static_text(kvrelay_status_message(self.status)))
    }
}

impl std::error::Error for AbiError {}

fn check(call: &'static str, st: kvrelay_status) -> Result<(), AbiError> {
    if st == kvrelay_status::KVRELAY_OK {
        Ok(())
    } else {
        Err(AbiError { call, status: st as i32 })
    }
}

fn static_text(p: *const c_char) -> &'static str {
    // SAFETY: the functions handing these out (`kvrelay_status_message`, `kvrelay_reason_name`,
    // `kvrelay_discard_name`) document a static, NUL-terminated, never-NULL ASCII string.
    unsafe { CStr::from_ptr(p) }.to_str().unwrap_or("unknown")
}

/// Fill a buffer through one of the size-query functions (`(NULL, 0)` asks for the size),
/// asking again when the output grew between the query and the fill (Prometheus text while
/// other threads admit), a bounded number of times.
fn fill_bytes(
    call: &'static str,
    f: impl Fn(*mut u8, usize, *mut usize) -> kvrelay_status,
) -> Result<Vec<u8>, AbiError> {
    let mut need = 0usize;
    let st = f(ptr::null_mut(), 0, &mut need);
    if st != kvrelay_status::KVRELAY_ERR_BUFFER_TOO_SMALL && st != kvrelay_status::KVRELAY_OK {
        check(call, st)?;
    }
    for _ in 0..8 {
        let mut buf = vec![0u8; need];
        let st = f(buf.as_mut_ptr(), buf.len(), &mut need);
        if st == kvrelay_status::KVRELAY_ERR_BUFFER_TOO_SMALL {
            continue; // grew meanwhile; `need` holds the new size
        }
        check(call, st)?;
        buf.truncate(need);
        return Ok(buf);
    }
    Err(AbiError { call, status: kvrelay_status::KVRELAY_ERR_BUFFER_TOO_SMALL as i32 })
}

/// [`fill_bytes`] for NUL-terminated text (the NUL is dropped).
fn fill_text(
    call: &'static str,
    f: impl Fn(*mut c_char, usize, *mut usize) -> kvrelay_status,
) -> Result<String, AbiError> {
    let mut buf = fill_bytes(call, |b, c, l| f(b.cast(), c, l))?;
    if buf.last() == Some(&0) {
        buf.pop();
    }
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

// ---------------------------------------------------------------------------------------------
// Admission and snapshots

/// An admission edge (`kvrelay_admission`): thread-safe, shared by every request.
pub struct Admission(NonNull<kvrelay_admission>);

// SAFETY: the header documents `kvrelay_admission` as thread-safe: any number of threads may
// admit on one edge at once, and it is freed only by `Drop`, which has exclusive access.
unsafe impl Send for Admission {}
// SAFETY: as above.
unsafe impl Sync for Admission {}

/// What admission did with one hint value.
#[derive(Clone, Debug)]
pub enum HintOutcome {
    /// No hint (absent or `null`); not counted.
    Absent,
    /// Admitted and frozen.
    Admitted(Snapshot),
    /// Dropped whole, with the reason's metric label and a detail that never holds hint bytes.
    Ignored {
        /// `untrusted`, `unknown_version`, `oversized` or `malformed`.
        reason: &'static str,
        /// What failed and where (malformed only).
        detail: String,
    },
}

impl HintOutcome {
    /// The label for logs: `absent`, `admitted`, or the ignore reason.
    pub fn label(&self) -> &'static str {
        match self {
            HintOutcome::Absent => "absent",
            HintOutcome::Admitted(_) => "admitted",
            HintOutcome::Ignored { reason, .. } => reason,
        }
    }

    /// The snapshot when admitted.
    pub fn snapshot(&self) -> Option<&Snapshot> {
        match self {
            HintOutcome::Admitted(s) => Some(s),
            _ => None,
        }
    }
}

/// The batch's aligned hint list has another length than its prompt count.
#[derive(Debug)]
pub struct BatchLengthMismatch;

impl Admission {
    /// An edge with trust taken from the environment variable `trust_env` (e.g.
    /// `KVRELAY_TRUST_KV_HINTS`) unless `trust` forces it.
    pub fn new(trust_env: &str, trust: Option<bool>, max_bytes: Option<usize>) -> Result<Admission, AbiError> {
        let mut cfg: *mut kvrelay_admission_config = ptr::null_mut();
        // SAFETY: `cfg` is a writable out-pointer.
        check("kvrelay_admission_config_new", unsafe { kvrelay_admission_config_new(&mut cfg) })?;
        // Free the config on every path: the edge copies it.
        struct Cfg(*mut kvrelay_admission_config);
        impl Drop for Cfg {
            fn drop(&mut self) {
                // SAFETY: from `kvrelay_admission_config_new`, freed once here.
                unsafe { kvrelay_admission_config_free(self.0) };
            }
        }
        let cfg = Cfg(cfg);
        // SAFETY: `cfg.0` is live; the name is readable for its length.
        check("kvrelay_admission_config_trust_from_env", unsafe {
            kvrelay_admission_config_trust_from_env(cfg.0, trust_env.as_ptr().cast(), trust_env.len())
        })?;
        if let Some(t) = trust {
            // SAFETY: `cfg.0` is live.
            check("kvrelay_admission_config_set_trusted", unsafe { kvrelay_admission_config_set_trusted(cfg.0, t) })?;
        }
        if let Some(n) = max_bytes {
            // SAFETY: `cfg.0` is live.
            check("kvrelay_admission_config_set_max_bytes", unsafe {
                kvrelay_admission_config_set_max_bytes(cfg.0, n)
            })?;
        }
        let mut out: *mut kvrelay_admission = ptr::null_mut();
        // SAFETY: `cfg.0` live, `out` writable.
        check("kvrelay_admission_new", unsafe { kvrelay_admission_new(cfg.0, &mut out) })?;
        Ok(Admission(NonNull::new(out).expect("kvrelay_admission_new returned OK with NULL")))
    }

    fn outcome(o: &kvrelay_outcome, snap: *mut kvrelay_snapshot) -> HintOutcome {
        match o.kind {
            k if k == kvrelay_outcome_kind::KVRELAY_OUTCOME_ADMITTED as i32 => match NonNull::new(snap) {
                Some(p) => HintOutcome::Admitted(Snapshot(p)),
                None => HintOutcome::Absent,
            },
            k if k == kvrelay_outcome_kind::KVRELAY_OUTCOME_IGNORED as i32 => {
                // SAFETY: `detail` is NUL-terminated within its fixed capacity (header contract).
                let d = unsafe { CStr::from_ptr(o.detail.as_ptr()) };
                HintOutcome::Ignored {
                    reason: static_text(kvrelay_reason_name(o.reason)),
                    detail: d.to_string_lossy().into_owned(),
                }
            }
            _ => HintOutcome::Absent,
        }
    }

    /// Admit one raw hint value (`None`: the request carries none). Counted once by the edge.
    pub fn admit(&self, raw: Option<&[u8]>) -> HintOutcome {
        let (p, n) = raw.map_or((ptr::null(), 0), |r| (r.as_ptr(), r.len()));
        let mut o = empty_outcome();
        let mut snap: *mut kvrelay_snapshot = ptr::null_mut();
        // SAFETY: the edge is live; `(p, n)` is readable (or NULL, 0); outputs are writable.
        let st = unsafe { kvrelay_admit(self.0.as_ptr(), p, n, &mut o, &mut snap) };
        if st != kvrelay_status::KVRELAY_OK {
            // Only argument errors can get here; inference continues without a hint.
            return HintOutcome::Absent;
        }
        Self::outcome(&o, snap)
    }

    /// Admit the hint value of a batched request of `prompts` prompts: one envelope shared by
    /// all, or an aligned list admitted entry by entry.
    pub fn admit_batch(&self, raw: Option<&[u8]>, prompts: usize) -> Result<Vec<HintOutcome>, BatchLengthMismatch> {
        let (p, n) = raw.map_or((ptr::null(), 0), |r| (r.as_ptr(), r.len()));
        let mut outs = vec![empty_outcome(); prompts];
        let mut snaps: Vec<*mut kvrelay_snapshot> = vec![ptr::null_mut(); prompts];
        // SAFETY: both arrays hold `prompts` writable elements; the edge is live.
        let st = unsafe {
            kvrelay_admit_batch(self.0.as_ptr(), p, n, prompts, outs.as_mut_ptr(), snaps.as_mut_ptr(), ptr::null_mut())
        };
        if st == kvrelay_status::KVRELAY_ERR_BATCH_LENGTH_MISMATCH {
            return Err(BatchLengthMismatch);
        }
        if st != kvrelay_status::KVRELAY_OK {
            return Ok(vec![HintOutcome::Absent; prompts]);
        }
        Ok(outs.iter().zip(snaps).map(|(o, s)| Self::outcome(o, s)).collect())
    }

    /// The edge's counters as Prometheus text.
    pub fn prometheus(&self) -> String {
        // SAFETY: the edge is live; `fill_text` passes a buffer writable for `cap` bytes.
        fill_text("kvrelay_admission_prometheus", |b, c, l| unsafe {
            kvrelay_admission_prometheus(self.0.as_ptr(), b, c, l)
        })
        .unwrap_or_default()
    }

    /// A copy of the edge's counters.
    pub fn counters(&self) -> kvrelay_counters {
        let mut c = kvrelay_counters::default();
        // SAFETY: the edge is live; `c` is writable.
        let _ = unsafe { kvrelay_admission_counters(self.0.as_ptr(), &mut c) };
        c
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        // SAFETY: from `kvrelay_admission_new`; `&mut self` means no other thread uses it.
        unsafe { kvrelay_admission_free(self.0.as_ptr()) };
    }
}

fn empty_outcome() -> kvrelay_outcome {
    kvrelay_outcome { kind: 0, reason: 0, detail: [0; KVRELAY_DETAIL_CAPACITY] }
}

/// A reference to an admitted snapshot: `Clone` retains, `Drop` releases. Its `Debug` never
/// prints hint contents.
pub struct Snapshot(NonNull<kvrelay_snapshot>);

// SAFETY: snapshots are immutable and reference counted with atomic counts (header: shared by
// ranks and child requests); retain and release may run on any thread.
unsafe impl Send for Snapshot {}
// SAFETY: as above: every accessor only reads.
unsafe impl Sync for Snapshot {}

impl Clone for Snapshot {
    fn clone(&self) -> Snapshot {
        // SAFETY: `self` holds a reference, so the handle is live.
        let p = unsafe { kvrelay_snapshot_retain(self.0.as_ptr()) };
        Snapshot(NonNull::new(p).expect("retain of a live snapshot"))
    }
}

impl Drop for Snapshot {
    fn drop(&mut self) {
        // SAFETY: this wrapper owns exactly one reference, given up here.
        unsafe { kvrelay_snapshot_release(self.0.as_ptr()) };
    }
}

impl fmt::Debug for Snapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Snapshot(..)")
    }
}

/// One action of a snapshot, borrowed from it.
#[derive(Clone, Copy)]
pub struct ActionView<'a> {
    /// `action_type`.
    pub action_type: &'a str,
    /// `action_version`.
    pub version: &'a str,
    /// Canonical payload bytes.
    pub payload: &'a [u8],
}

/// # Safety
/// `s` must come from kvrelay for a live snapshot that outlives `'a` (valid UTF-8 per header).
unsafe fn view_str<'a>(s: kvrelay_str) -> &'a str {
    // SAFETY: per the header, `ptr` is never NULL and readable for `len` bytes of UTF-8 while
    // the snapshot is held; the caller ties `'a` to that.
    unsafe { std::str::from_utf8_unchecked(std::slice::from_raw_parts(s.ptr.cast(), s.len)) }
}

impl Snapshot {
    /// The message id.
    pub fn message_id(&self) -> &str {
        let mut s = kvrelay_str { ptr: ptr::null(), len: 0 };
        // SAFETY: live handle; `s` writable.
        if unsafe { kvrelay_snapshot_message_id(self.0.as_ptr(), &mut s) } != kvrelay_status::KVRELAY_OK {
            return "";
        }
        // SAFETY: the view borrows from `self`, which outlives the returned reference.
        unsafe { view_str(s) }
    }

    /// Number of actions.
    pub fn action_count(&self) -> usize {
        let mut n = 0usize;
        // SAFETY: live handle; `n` writable.
        let _ = unsafe { kvrelay_snapshot_action_count(self.0.as_ptr(), &mut n) };
        n
    }

    /// Action `i`, or `None` past the end.
    pub fn action(&self, i: usize) -> Option<ActionView<'_>> {
        let e = kvrelay_str { ptr: ptr::null(), len: 0 };
        let b = kvrelay_bytes { ptr: ptr::null(), len: 0 };
        let mut a = kvrelay_action { index: 0, id: e, action_type: e, version: e, payload: b, canonical: b };
        // SAFETY: live handle; `a` writable.
        if unsafe { kvrelay_snapshot_action(self.0.as_ptr(), i, &mut a) } != kvrelay_status::KVRELAY_OK {
            return None;
        }
        // SAFETY: every view borrows from `self` (header), which outlives the result.
        Some(unsafe {
            ActionView {
                action_type: view_str(a.action_type),
                version: view_str(a.version),
                payload: std::slice::from_raw_parts(a.payload.ptr, a.payload.len),
            }
        })
    }

    /// The canonical bytes of the one-action envelope of action `i` (copied).
    pub fn action_envelope(&self, i: usize) -> Result<Vec<u8>, AbiError> {
        // SAFETY: live handle; `fill_bytes` passes a buffer writable for `cap` bytes.
        fill_bytes("kvrelay_snapshot_action_envelope", |b, c, l| unsafe {
            kvrelay_snapshot_action_envelope(self.0.as_ptr(), i, b, c, l)
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Policy: capabilities, bindings, registry, orchestration with a Rust provider

/// What the orchestrator hands a provider (views valid during the call).
pub struct FetchCall<'a> {
    /// The resolved binding.
    pub binding_id: &'a str,
    /// The action's version.
    pub action_version: &'a str,
    /// The action's canonical payload.
    pub payload: &'a [u8],
    /// The normalized endpoint, found in the trusted registry.
    pub endpoint: &'a str,
    /// The per-call context [`Orchestrator::decide_in`] was given (`None` from `decide`).
    pub context: Option<&'a (dyn std::any::Any + Send + Sync)>,
}

/// The server's provider: validates, then takes the fetch. Codes are the provider's own
/// (non-zero means refused).
pub trait FetchProvider: Send + Sync + 'static {
    /// Validate version, payload and destination on the provider's own terms.
    fn validate(&self, call: &FetchCall<'_>) -> Result<(), i32>;
    /// Take the fetch. Runs on the thread that called [`Orchestrator::decide`], inside it.
    fn fetch(&self, call: &FetchCall<'_>) -> Result<(), i32>;
}

/// A binding of the server's configuration.
pub struct BindingConfig<'a> {
    /// Unique id.
    pub id: &'a str,
    /// Its family (declared in the capabilities).
    pub family: &'a str,
    /// Fetches by content name (`true`) or is request-paired.
    pub named: bool,
    /// Authorized for optional named fetch.
    pub authorized: bool,
    /// `(action_type, action_version)` pairs the binding itself supports.
    pub supports: &'a [(&'a str, &'a str)],
}

/// An orchestrator (`kvrelay_orchestrator`) with its capability snapshot.
pub struct Orchestrator {
    orch: NonNull<kvrelay_orchestrator>,
    caps: NonNull<kvrelay_capabilities>,
}

// SAFETY: `kvrelay_orchestrate` is documented thread-safe and our provider is Send + Sync; the
// handles are freed only in `Drop`.
unsafe impl Send for Orchestrator {}
// SAFETY: as above.
unsafe impl Sync for Orchestrator {}

/// The decision for one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// The provider took a named fetch of action `action_index`.
    NamedFetch {
        /// The action's position.
        action_index: usize,
    },
    /// No named fetch; the discard reason's metric label.
    Keep(&'static str),
}

unsafe extern "C" fn provider_validate(user: *mut c_void, req: *const kvrelay_fetch_request) -> i32 {
    provider_call(user, req, |p, c| p.validate(c))
}

unsafe extern "C" fn provider_fetch(user: *mut c_void, req: *const kvrelay_fetch_request) -> i32 {
    provider_call(user, req, |p, c| p.fetch(c))
}

unsafe extern "C" fn provider_destroy(user: *mut c_void) {
    // SAFETY: `user` is the `Box<Arc<dyn FetchProvider>>` leaked in `Orchestrator::new`; the
    // orchestrator calls `destroy` exactly once.
    drop(unsafe { Box::from_raw(user.cast::<Arc<dyn FetchProvider>>()) });
}

/// Code a provider callback returns when it panicked (never unwinds into kvrelay).
const PROVIDER_PANICKED: i32 = -99;

fn provider_call(
    user: *mut c_void,
    req: *const kvrelay_fetch_request,
    f: impl Fn(&dyn FetchProvider, &FetchCall<'_>) -> Result<(), i32>,
) -> i32 {
    if user.is_null() || req.is_null() {
        return PROVIDER_PANICKED;
    }
    // SAFETY: `user` is the live `Arc<dyn FetchProvider>` box (destroyed only after the last
    // call); `req` and its views are valid during this call (header).
    let (p, r) = unsafe { (&*user.cast::<Arc<dyn FetchProvider>>(), &*req) };
    // SAFETY: as above: the views are valid UTF-8 / bytes for the duration of the call; a
    // non-NULL `call_context` is the `&dyn Any` that `Orchestrator::decide_in` put on its stack
    // for this call.
    let call = unsafe {
        FetchCall {
            binding_id: view_str(r.binding_id),
            action_version: view_str(r.action_version),
            payload: std::slice::from_raw_parts(r.payload.ptr, r.payload.len),
            endpoint: view_str(r.endpoint),
            context: (!r.call_context.is_null())
                .then(|| *r.call_context.cast::<&(dyn std::any::Any + Send + Sync)>().cast_const()),
        }
    };
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&**p, &call))) {
        Ok(Ok(())) => 0,
        Ok(Err(code)) => code,
        Err(_) => PROVIDER_PANICKED,
    }
}

impl Orchestrator {
    /// Build the capability snapshot (`family -> supported (type, version)`), the policy
    /// configuration (bindings, trusted endpoints, metric prefix) and the orchestrator.
    pub fn new(
        families: &[(&str, &str, &str)],
        bindings: &[BindingConfig<'_>],
        endpoints: &[String],
        provider: Arc<dyn FetchProvider>,
    ) -> Result<Orchestrator, AbiError> {
        let mut b: *mut kvrelay_capabilities_builder = ptr::null_mut();
        // SAFETY: writable out-pointer.
        check("kvrelay_capabilities_builder_new", unsafe { kvrelay_capabilities_builder_new(&mut b) })?;
        for (fam, t, v) in families {
            // SAFETY: `b` live; strings readable for their lengths.
            let st = unsafe {
                kvrelay_capabilities_builder_add(
                    b,
                    fam.as_ptr().cast(),
                    fam.len(),
                    t.as_ptr().cast(),
                    t.len(),
                    v.as_ptr().cast(),
                    v.len(),
                )
            };
            if let Err(e) = check("kvrelay_capabilities_builder_add", st) {
                // SAFETY: `b` live and not built.
                unsafe { kvrelay_capabilities_builder_free(b) };
                return Err(e);
            }
        }
        let mut caps: *mut kvrelay_capabilities = ptr::null_mut();
        // SAFETY: `b` live; consumed in every case; `caps` writable.
        check("kvrelay_capabilities_build", unsafe { kvrelay_capabilities_build(b, &mut caps) })?;
        let caps = NonNull::new(caps).expect("OK with NULL");

        let mut cfg: *mut kvrelay_policy_config = ptr::null_mut();
        let free_caps = |e: AbiError| {
            // SAFETY: `caps` live and not shared yet.
            unsafe { kvrelay_capabilities_free(caps.as_ptr()) };
            e
        };
        // SAFETY: writable out-pointer.
        check("kvrelay_policy_config_new", unsafe { kvrelay_policy_config_new(&mut cfg) }).map_err(free_caps)?;
        let setup = || -> Result<(), AbiError> {
            for bc in bindings {
                let addressing = if bc.named {
                    kvrelay_addressing::KVRELAY_ADDRESSING_NAMED
                } else {
                    kvrelay_addressing::KVRELAY_ADDRESSING_REQUEST_PAIRED
                } as i32;
                // SAFETY: `cfg` live; strings readable for their lengths.
                check("kvrelay_policy_config_add_binding", unsafe {
                    kvrelay_policy_config_add_binding(
                        cfg,
                        bc.id.as_ptr().cast(),
                        bc.id.len(),
                        bc.family.as_ptr().cast(),
                        bc.family.len(),
                        addressing,
                        bc.authorized,
                    )
                })?;
                for (t, v) in bc.supports {
                    // SAFETY: as above.
                    check("kvrelay_policy_config_binding_support", unsafe {
                        kvrelay_policy_config_binding_support(
                            cfg,
                            bc.id.as_ptr().cast(),
                            bc.id.len(),
                            t.as_ptr().cast(),
                            t.len(),
                            v.as_ptr().cast(),
                            v.len(),
                        )
                    })?;
                }
            }
            for e in endpoints {
                // SAFETY: as above.
                check("kvrelay_policy_config_add_endpoint", unsafe {
                    kvrelay_policy_config_add_endpoint(cfg, e.as_ptr().cast(), e.len())
                })?;
            }
            Ok(())
        };
        let r = setup();
        let mut orch: *mut kvrelay_orchestrator = ptr::null_mut();
        let r = r.and_then(|()| {
            let user = Box::into_raw(Box::new(provider)).cast::<c_void>();
            let vt = kvrelay_provider {
                user_data: user,
                validate: Some(provider_validate),
                fetch: Some(provider_fetch),
                destroy: Some(provider_destroy),
            };
            // SAFETY: `caps`, `cfg` live; `vt` readable; `orch` writable. The provider box is
            // owned by the orchestrator from here on (destroyed by it, also on failure).
            check("kvrelay_orchestrator_new", unsafe { kvrelay_orchestrator_new(caps.as_ptr(), cfg, &vt, &mut orch) })
        });
        // SAFETY: `cfg` live; the orchestrator copied it.
        unsafe { kvrelay_policy_config_free(cfg) };
        r.map_err(free_caps)?;
        Ok(Orchestrator { orch: NonNull::new(orch).expect("OK with NULL"), caps })
    }

    /// Decide for one request; the provider runs inside this call when every check passed.
    pub fn decide(&self, lora_adapter: bool, snapshot: Option<&Snapshot>) -> Decision {
        self.decide_with(lora_adapter, snapshot, ptr::null_mut())
    }

    /// [`Orchestrator::decide`] with a per-call context the provider receives in
    /// [`FetchCall::context`] (`kvrelay_orchestrate_with_context`): how the fetch it accepts
    /// reaches this request, without thread-locals.
    pub fn decide_in(
        &self,
        lora_adapter: bool,
        snapshot: Option<&Snapshot>,
        context: &(dyn std::any::Any + Send + Sync),
    ) -> Decision {
        let mut ctx: &(dyn std::any::Any + Send + Sync) = context;
        self.decide_with(lora_adapter, snapshot, (&mut ctx as *mut &(dyn std::any::Any + Send + Sync)).cast())
    }

    fn decide_with(&self, lora_adapter: bool, snapshot: Option<&Snapshot>, context: *mut c_void) -> Decision {
        let info = kvrelay_request_info { generation_only: true, lora_adapter };
        let snap = snapshot.map_or(ptr::null(), |s| s.0.as_ptr().cast_const());
        let e = kvrelay_str { ptr: ptr::null(), len: 0 };
        let mut d = kvrelay_decision { kind: 0, discard: 0, binding_id: e, action_index: 0, provider_code: 0 };
        // SAFETY: the orchestrator is live; `info` readable; `snap` NULL or live (held by the
        // caller for the call); `d` writable; `context` is handed to the provider only.
        let st = unsafe { kvrelay_orchestrate_with_context(self.orch.as_ptr(), &info, snap, context, &mut d) };
        if st != kvrelay_status::KVRELAY_OK {
            return Decision::Keep("error");
        }
        if d.kind == kvrelay_decision_kind::KVRELAY_DECISION_NAMED_FETCH as i32 {
            Decision::NamedFetch { action_index: d.action_index }
        } else {
            Decision::Keep(static_text(kvrelay_discard_name(d.discard)))
        }
    }

    /// The orchestrator's counters as Prometheus text.
    pub fn prometheus(&self) -> String {
        // SAFETY: live orchestrator; `fill_text` passes a buffer writable for `cap` bytes.
        fill_text("kvrelay_orchestrator_prometheus", |b, c, l| unsafe {
            kvrelay_orchestrator_prometheus(self.orch.as_ptr(), b, c, l)
        })
        .unwrap_or_default()
    }
}

impl Drop for Orchestrator {
    fn drop(&mut self) {
        // SAFETY: both from their constructors, freed once; `&mut self` means no call runs.
        unsafe {
            kvrelay_orchestrator_free(self.orch.as_ptr());
            kvrelay_capabilities_free(self.caps.as_ptr());
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The copy engine over a block-contiguous pool

/// A KV layout (`kvrelay_kv_layout`).
pub struct KvLayout(NonNull<kvrelay_kv_layout>);

impl KvLayout {
    /// One pool of `blocks` blocks of `block_bytes` each, contiguous, at `base` (TensorRT-LLM's
    /// all-layers-per-block shape with one layer of `block_bytes / 2` per K and V).
    pub fn contiguous(base: u64, blocks: u32, block_bytes: u64) -> Result<KvLayout, AbiError> {
        let mut out: *mut kvrelay_kv_layout = ptr::null_mut();
        // SAFETY: `out` writable; addresses are not dereferenced by layout construction.
        check("kvrelay_kv_layout_all_layers_per_block", unsafe {
            kvrelay_kv_layout_all_layers_per_block(base, 1, blocks, block_bytes / 2, &mut out)
        })?;
        Ok(KvLayout(NonNull::new(out).expect("OK with NULL")))
    }

    /// Bytes of one staged block.
    pub fn stage_block_bytes(&self) -> u64 {
        // SAFETY: live layout.
        unsafe { kvrelay_kv_layout_stage_block_bytes(self.0.as_ptr()) }
    }
}

impl Drop for KvLayout {
    fn drop(&mut self) {
        // SAFETY: from a constructor, freed once.
        unsafe { kvrelay_kv_layout_free(self.0.as_ptr()) };
    }
}

// SAFETY: a layout is immutable once built (every function takes it by const pointer) and
// holds only addresses; sharing or moving the handle between threads is what the header allows.
unsafe impl Send for KvLayout {}
// SAFETY: as above.
unsafe impl Sync for KvLayout {}

/// The CPU engine over host memory (`kvrelay_cpu_engine`).
pub struct CpuEngine(NonNull<kvrelay_cpu_engine>);

// SAFETY: the engine holds only the layout (addresses); calls take `&mut self`, so one thread
// at a time uses it, and the pool memory it addresses is owned by the caller's pool.
unsafe impl Send for CpuEngine {}

impl CpuEngine {
    /// An engine over `layout`.
    ///
    /// # Safety
    /// Every block of the layout must be host memory valid for reads and writes while the
    /// engine lives, touched by nothing else during a call.
    pub unsafe fn new(layout: &KvLayout) -> Result<CpuEngine, AbiError> {
        let mut out: *mut kvrelay_cpu_engine = ptr::null_mut();
        // SAFETY: live layout; `out` writable; the memory contract is the caller's.
        check("kvrelay_cpu_engine_new", unsafe { kvrelay_cpu_engine_new(layout.0.as_ptr(), &mut out) })?;
        Ok(CpuEngine(NonNull::new(out).expect("OK with NULL")))
    }

    /// Copy blocks `ids` into `staging`, block-major.
    pub fn gather(&mut self, ids: &[u32], staging: &mut [u8]) -> Result<(), AbiError> {
        // SAFETY: live engine; slices valid for their lengths.
        check("kvrelay_cpu_gather", unsafe {
            kvrelay_cpu_gather(self.0.as_ptr(), ids.as_ptr(), ids.len(), staging.as_mut_ptr(), staging.len())
        })
    }

    /// Copy `staging` into blocks `ids` (no repeats).
    pub fn scatter(&mut self, staging: &[u8], ids: &[u32]) -> Result<(), AbiError> {
        // SAFETY: live engine; slices valid for their lengths.
        check("kvrelay_cpu_scatter", unsafe {
            kvrelay_cpu_scatter(self.0.as_ptr(), staging.as_ptr(), staging.len(), ids.as_ptr(), ids.len())
        })
    }
}

impl Drop for CpuEngine {
    fn drop(&mut self) {
        // SAFETY: from `kvrelay_cpu_engine_new`, freed once.
        unsafe { kvrelay_cpu_engine_free(self.0.as_ptr()) };
    }
}

/// `Ok` when CUDA device `device` can be used; the error says why not (no driver, no device).
pub fn cuda_available(device: i32) -> Result<(), AbiError> {
    check("kvrelay_cuda_available", kvrelay_cuda_available(device))
}

/// Pinned, device-mapped host memory (`kvrelay_pinned`): the staging of GPU copies.
pub struct Pinned(NonNull<kvrelay_pinned>);

// SAFETY: plain page-locked memory owned by this handle; `&mut self` guards writes.
unsafe impl Send for Pinned {}

impl Pinned {
    /// `len` bytes on `device`.
    pub fn alloc(device: i32, len: usize) -> Result<Pinned, AbiError> {
        let mut out: *mut kvrelay_pinned = ptr::null_mut();
        // SAFETY: `out` writable.
        check("kvrelay_pinned_alloc", unsafe { kvrelay_pinned_alloc(device, len, &mut out) })?;
        Ok(Pinned(NonNull::new(out).expect("OK with NULL")))
    }

    /// The bytes (no copy is in flight when the caller holds `&mut self`: every copy of the
    /// server's store is synchronized before it returns).
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: live handle; host address and length from kvrelay; `&mut self` is exclusive.
        unsafe {
            std::slice::from_raw_parts_mut(kvrelay_pinned_host(self.0.as_ptr()), kvrelay_pinned_len(self.0.as_ptr()))
        }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: from `kvrelay_pinned_alloc`, freed once, no copy in flight (see `bytes_mut`).
        unsafe { kvrelay_pinned_free(self.0.as_ptr()) };
    }
}

/// The CUDA copy engine over a device pool (`kvrelay_cuda_engine`).
pub struct CudaEngine(NonNull<kvrelay_cuda_engine>);

// SAFETY: one engine is used by one thread at a time (`&mut self`), as the header requires.
unsafe impl Send for CudaEngine {}

impl CudaEngine {
    /// An engine on `device` over `layout` (device addresses), default options (the kernel).
    ///
    /// # Safety
    /// Every block of the layout must be device memory of `device` valid while the engine lives.
    pub unsafe fn new(device: i32, layout: &KvLayout) -> Result<CudaEngine, AbiError> {
        let mut out: *mut kvrelay_cuda_engine = ptr::null_mut();
        // SAFETY: live layout; NULL options (defaults); `out` writable; memory per the caller.
        check("kvrelay_cuda_engine_new", unsafe {
            kvrelay_cuda_engine_new(device, layout.0.as_ptr(), ptr::null(), &mut out)
        })?;
        Ok(CudaEngine(NonNull::new(out).expect("OK with NULL")))
    }

    /// Enqueue a copy of blocks `ids` into `staging` on `stream`.
    pub fn gather(
        &mut self,
        ids: &[u32],
        staging: &Pinned,
        stream: &cudarc::driver::CudaStream,
    ) -> Result<(), AbiError> {
        // SAFETY: live engine and staging; `ids` readable; a live stream of the device's primary
        // context (cudarc's context is the primary one, as the engine's); no event.
        check("kvrelay_cuda_gather", unsafe {
            kvrelay_cuda_gather(
                self.0.as_ptr(),
                ids.as_ptr(),
                ids.len(),
                staging.0.as_ptr(),
                stream.cu_stream().cast(),
                ptr::null_mut(),
            )
        })
    }

    /// Enqueue a copy of `staging` into blocks `ids` on `stream`.
    pub fn scatter(
        &mut self,
        staging: &Pinned,
        ids: &[u32],
        stream: &cudarc::driver::CudaStream,
    ) -> Result<(), AbiError> {
        // SAFETY: as `gather`.
        check("kvrelay_cuda_scatter", unsafe {
            kvrelay_cuda_scatter(
                self.0.as_ptr(),
                staging.0.as_ptr(),
                ids.as_ptr(),
                ids.len(),
                stream.cu_stream().cast(),
                ptr::null_mut(),
            )
        })
    }
}

impl Drop for CudaEngine {
    fn drop(&mut self) {
        // SAFETY: from `kvrelay_cuda_engine_new`, freed once.
        unsafe { kvrelay_cuda_engine_free(self.0.as_ptr()) };
    }
}

/// A zeroed, 16-byte aligned host allocation the CPU engine addresses by integer (the
/// reference engine's host pool).
pub struct HostPool {
    ptr: NonNull<u8>,
    layout: std::alloc::Layout,
}

// SAFETY: plain owned memory; accessed only through the engine under the pool's lock.
unsafe impl Send for HostPool {}
// SAFETY: as above; `&HostPool` only exposes the address.
unsafe impl Sync for HostPool {}

impl HostPool {
    /// `len` zeroed bytes, every page touched once here (as a runtime pre-faults its KV pool),
    /// so that no request pays the first-touch page faults.
    pub fn new(len: usize) -> HostPool {
        // 16-byte alignment (what the copy engine needs) lets the allocator hand out zeroed
        // pages (calloc) that the loop below faults in one store per page.
        let layout = std::alloc::Layout::from_size_align(len.max(64), 16).expect("pool size fits a layout");
        // SAFETY: non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(p).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        for off in (0..layout.size()).step_by(4096) {
            // SAFETY: `off < size`, inside the allocation; writing the zero it already holds.
            unsafe { ptr.as_ptr().add(off).write_volatile(0) };
        }
        HostPool { ptr, layout }
    }

    /// The pool's address.
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }
}

impl Drop for HostPool {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

// ---------------------------------------------------------------------------------------------
// The KV agent (serving and fetching named blocks between instances)

/// The library's last error text on this thread (what a failed call said).
fn last_error() -> String {
    // SAFETY: a size query and a fill of a buffer of that size; nothing else is passed.
    fill_text("kvrelay_last_error_message", |b, c, l| unsafe { kvrelay_last_error_message(b, c, l) })
        .unwrap_or_default()
}

fn check_detail(call: &'static str, st: kvrelay_status) -> Result<(), String> {
    check(call, st).map_err(|e| {
        let d = last_error();
        if d.is_empty() {
            e.to_string()
        } else {
            format!("{e}: {d}")
        }
    })
}

/// The server's reuse cache as the agent's service sees it (`kvrelay_block_holder`).
pub trait Holder: Send + Sync {
    /// Pin the leading run of `names` held here; their ids into `ids`; how many.
    fn pin(&self, names: &[u64], ids: &mut [u32]) -> usize;
    /// Release pinned blocks.
    fn unpin(&self, ids: &[u32]);
    /// Withheld destination blocks are free again.
    fn returned(&self, ids: &[u32]);
}

type HolderBox = Arc<dyn Holder>;

unsafe extern "C" fn holder_pin(ud: *mut c_void, names: *const u64, n: usize, ids: *mut u32) -> usize {
    // SAFETY: `ud` is the `HolderBox` leaked in `KvAgent::new`, alive until `holder_destroy`;
    // the agent passes `n` names and room for `n` ids.
    let (h, names, ids) = unsafe {
        (&*(ud as *const HolderBox), std::slice::from_raw_parts(names, n), std::slice::from_raw_parts_mut(ids, n))
    };
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| h.pin(names, ids))).unwrap_or(0)
}

unsafe extern "C" fn holder_unpin(ud: *mut c_void, ids: *const u32, n: usize) {
    // SAFETY: as in `holder_pin`; `n` ids.
    let (h, ids) = unsafe { (&*(ud as *const HolderBox), std::slice::from_raw_parts(ids, n)) };
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| h.unpin(ids)));
}

unsafe extern "C" fn holder_returned(ud: *mut c_void, ids: *const u32, n: usize) {
    // SAFETY: as in `holder_unpin`.
    let (h, ids) = unsafe { (&*(ud as *const HolderBox), std::slice::from_raw_parts(ids, n)) };
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| h.returned(ids)));
}

unsafe extern "C" fn holder_destroy(ud: *mut c_void) {
    // SAFETY: the box leaked in `KvAgent::new`; the agent calls this once, after its last use.
    drop(unsafe { Box::from_raw(ud as *mut HolderBox) });
}

/// How the server's agent is set up.
pub struct AgentSettings<'a> {
    /// The layout fingerprint.
    pub fingerprint: kvrelay_agent_fingerprint,
    /// `host:port` of the KV service.
    pub listen: &'a str,
    /// Peers allowed (`loopback`, addresses, `ADDR/PREFIX`).
    pub allow: &'a [String],
    /// The pool's CUDA device (`None`: host memory).
    pub device: Option<i32>,
    /// `tcp` or `nixl`.
    pub transport: &'a str,
    /// Folder of the NIXL libraries.
    pub nixl_lib_dir: Option<&'a std::path::Path>,
}

/// A running KV agent (`kvrelay_agent`).
pub struct KvAgent(NonNull<kvrelay_agent>);

// SAFETY: the header says every function on an agent is thread-safe.
unsafe impl Send for KvAgent {}
// SAFETY: as above.
unsafe impl Sync for KvAgent {}

/// A fetch handle (`kvrelay_fetch`), freed when the last holder lets go.
struct FetchHandle(NonNull<kvrelay_fetch>);

// SAFETY: a fetch handle is thread-safe (header): poll, wait, detail and cancel may be called
// from any thread at once; it is freed once, by the drop below.
unsafe impl Send for FetchHandle {}
// SAFETY: as above.
unsafe impl Sync for FetchHandle {}

impl Drop for FetchHandle {
    fn drop(&mut self) {
        // SAFETY: from `kvrelay_agent_submit`, freed once (the last `Arc` goes here).
        unsafe { kvrelay_fetch_free(self.0.as_ptr()) };
    }
}

/// A submitted fetch, with its completion on the way. Whoever owns the fetch's destination
/// blocks must keep them until [`PendingFetch::done`] answers: the agent writes them until
/// then. [`PendingFetch::canceller`] lets another task (a request that goes away) ask it to stop.
pub struct PendingFetch {
    fetch: Arc<FetchHandle>,
    done: tokio::sync::oneshot::Receiver<(kvrelay_fetch_result, String)>,
}

/// Asks a fetch to stop (`kvrelay_fetch_cancel`); its completion still comes through
/// [`PendingFetch::done`], after which nothing writes its destination blocks.
#[derive(Clone)]
pub struct FetchCanceller(Arc<FetchHandle>);

impl FetchCanceller {
    /// Ask the fetch to stop (never blocks; a completed fetch is unaffected).
    pub fn cancel(&self) {
        // SAFETY: a live handle (held by this `Arc`).
        let _ = unsafe { kvrelay_fetch_cancel(self.0 .0.as_ptr()) };
    }
}

type DoneSender = tokio::sync::oneshot::Sender<(kvrelay_fetch_result, String)>;

unsafe extern "C" fn fetch_done(ud: *mut c_void, r: *const kvrelay_fetch_result, detail: kvrelay_str) {
    // SAFETY: `ud` is the sender boxed in `KvAgent::fetch`, alive until `fetch_destroy` (which
    // runs after this); `r` and `detail` are readable for the call.
    let (tx, r, detail) = unsafe {
        (&mut *(ud as *mut Option<DoneSender>), *r, std::slice::from_raw_parts(detail.ptr.cast::<u8>(), detail.len))
    };
    if let Some(tx) = tx.take() {
        let _ = tx.send((r, String::from_utf8_lossy(detail).into_owned()));
    }
}

unsafe extern "C" fn fetch_destroy(ud: *mut c_void) {
    // SAFETY: boxed in `KvAgent::fetch`; the agent runs `destroy` exactly once, last.
    drop(unsafe { Box::from_raw(ud as *mut Option<DoneSender>) });
}

impl PendingFetch {
    /// A handle that cancels this fetch.
    pub fn canceller(&self) -> FetchCanceller {
        FetchCanceller(self.fetch.clone())
    }

    /// Wait for the completion without blocking a runtime thread: the result and its detail,
    /// both delivered by the completion callback (no round trip to the fetch handle).
    pub async fn done(self) -> (kvrelay_fetch_result, String) {
        match self.done.await {
            Ok(r) => r,
            // the callback always runs before destroy drops the sender: a dropped sender
            // means the agent is gone
            Err(_) => (
                kvrelay_fetch_result { failure: 10, blocks: 0, bytes: 0, seconds: 0.0, withheld: 0 },
                "the agent went away".into(),
            ),
        }
    }
}

impl KvAgent {
    /// Start an agent over `layout`, serving `holder`'s blocks.
    ///
    /// # Safety
    /// `layout`'s blocks are host memory (or memory of `settings.device`) valid for the agent's
    /// life; the holder's pins keep blocks unwritten; a fetch's destination blocks are left
    /// alone until it completes.
    pub unsafe fn new(settings: &AgentSettings<'_>, layout: &KvLayout, holder: HolderBox) -> Result<KvAgent, String> {
        struct Cfg(*mut kvrelay_agent_config);
        impl Drop for Cfg {
            fn drop(&mut self) {
                // SAFETY: from `kvrelay_agent_config_new`, freed once.
                unsafe { kvrelay_agent_config_free(self.0) };
            }
        }
        let mut raw = ptr::null_mut();
        // SAFETY: the fingerprint is readable, `raw` writable.
        check_detail("kvrelay_agent_config_new", unsafe { kvrelay_agent_config_new(&settings.fingerprint, &mut raw) })?;
        let cfg = Cfg(raw);
        let listen = settings.listen;
        // SAFETY: live config; text readable for its length.
        check_detail("kvrelay_agent_config_set_listen", unsafe {
            kvrelay_agent_config_set_listen(cfg.0, listen.as_ptr().cast(), listen.len())
        })?;
        for a in settings.allow {
            // SAFETY: as above.
            check_detail("kvrelay_agent_config_allow_peer", unsafe {
                kvrelay_agent_config_allow_peer(cfg.0, a.as_ptr().cast(), a.len())
            })?;
        }
        // SAFETY: live config.
        check_detail("kvrelay_agent_config_set_device", unsafe {
            kvrelay_agent_config_set_device(cfg.0, settings.device.unwrap_or(-1))
        })?;
        let dir = settings.nixl_lib_dir.map(|d| d.to_string_lossy().into_owned()).unwrap_or_default();
        // SAFETY: live config; both texts readable for their lengths.
        check_detail("kvrelay_agent_config_set_transport", unsafe {
            kvrelay_agent_config_set_transport(
                cfg.0,
                settings.transport.as_ptr().cast(),
                settings.transport.len(),
                dir.as_ptr().cast(),
                dir.len(),
            )
        })?;
        let ud = Box::into_raw(Box::new(holder)) as *mut c_void;
        let h = kvrelay_block_holder {
            user_data: ud,
            pin: Some(holder_pin),
            unpin: Some(holder_unpin),
            destroy: Some(holder_destroy),
            returned: Some(holder_returned),
        };
        let mut out = ptr::null_mut();
        // SAFETY: live config and layout; the holder's user data is owned by the agent from here
        // (its destroy runs on every path); the memory contract is the caller's.
        check_detail("kvrelay_agent_new", unsafe { kvrelay_agent_new(cfg.0, layout.0.as_ptr(), &h, &mut out) })?;
        Ok(KvAgent(NonNull::new(out).expect("OK with NULL")))
    }

    /// `tcp://ADDR:PORT` of the KV service.
    pub fn endpoint(&self) -> String {
        // SAFETY: live agent; a size query and a fill.
        fill_text("kvrelay_agent_endpoint", |b, c, l| unsafe { kvrelay_agent_endpoint(self.0.as_ptr(), b, c, l) })
            .unwrap_or_default()
    }

    /// Record the checksums of blocks that just became reusable.
    pub fn record_checksums(&self, ids: &[u32]) -> Result<(), String> {
        // SAFETY: live agent; `ids` readable.
        check_detail("kvrelay_agent_record_checksums", unsafe {
            kvrelay_agent_record_checksums(self.0.as_ptr(), ids.as_ptr(), ids.len())
        })
    }

    /// Submit a fetch of `names[held .. held + dst.len()]` from `endpoint` into `dst`.
    pub fn fetch(
        &self,
        endpoint: &str,
        names: &[u64],
        held: usize,
        dst: &[u32],
        deadline_ms: u32,
    ) -> Result<PendingFetch, String> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let callbacks = kvrelay_fetch_callbacks {
            size: std::mem::size_of::<kvrelay_fetch_callbacks>(),
            user_data: Box::into_raw(Box::new(Some(tx))) as *mut c_void,
            done: Some(fetch_done),
            destroy: Some(fetch_destroy),
        };
        let p = kvrelay_fetch_params {
            endpoint: kvrelay_str { ptr: endpoint.as_ptr().cast(), len: endpoint.len() },
            names: names.as_ptr(),
            names_len: names.len(),
            held,
            dst_blocks: dst.as_ptr(),
            dst_len: dst.len(),
            deadline_ms,
        };
        let mut out = ptr::null_mut();
        // SAFETY: live agent; the parameters' arrays are readable for the call (the agent
        // copies them); the callbacks' user data is owned by the agent from here (its destroy
        // runs exactly once, also when the submission is refused).
        let st = unsafe { kvrelay_agent_submit(self.0.as_ptr(), &p, &callbacks, &mut out) };
        check_detail("kvrelay_agent_submit", st)?;
        Ok(PendingFetch { fetch: Arc::new(FetchHandle(NonNull::new(out).expect("OK with NULL"))), done: rx })
    }

    /// Expected seconds to fetch `blocks` blocks from `endpoint`.
    pub fn estimate(&self, endpoint: &str, blocks: usize) -> f64 {
        let mut s = 0.0;
        // SAFETY: live agent; text readable; `s` writable.
        let st = unsafe {
            kvrelay_agent_estimate(self.0.as_ptr(), endpoint.as_ptr().cast(), endpoint.len(), blocks, &mut s)
        };
        if st == kvrelay_status::KVRELAY_OK {
            s
        } else {
            f64::INFINITY
        }
    }

    /// The agent's counters.
    pub fn stats(&self) -> kvrelay::agent::AgentStats {
        let mut s = kvrelay::agent::AgentStats::default();
        // SAFETY: live agent; `s` writable for its size.
        let _ = unsafe { kvrelay_agent_read_stats(self.0.as_ptr(), &mut s, std::mem::size_of_val(&s)) };
        s
    }

    /// The agent's Prometheus text (`kvrelay_kv_agent_*`).
    pub fn prometheus(&self) -> String {
        // SAFETY: live agent; a size query and a fill.
        fill_text("kvrelay_agent_prometheus", |b, c, l| unsafe { kvrelay_agent_prometheus(self.0.as_ptr(), b, c, l) })
            .unwrap_or_default()
    }
}

impl Drop for KvAgent {
    fn drop(&mut self) {
        // SAFETY: from `kvrelay_agent_new`, freed once, from no agent callback.
        unsafe { kvrelay_agent_free(self.0.as_ptr()) };
    }
}

/// The label of a `kvrelay_fetch_failure` value.
pub fn fetch_failure_name(f: i32) -> &'static str {
    static_text(kvrelay_fetch_failure_name(f))
}

/// The run to fetch (`kvrelay_fetch_run_length`): from the first block not held here (`held`
/// leading blocks are), the consecutive names that appear among `hashes`.
pub fn run_to_fetch(names: &[u64], held: usize, hashes: &[u64]) -> Vec<u64> {
    let mut n = 0usize;
    // SAFETY: both slices readable for their lengths; `n` writable.
    let st =
        unsafe { kvrelay_fetch_run_length(names.as_ptr(), names.len(), held, hashes.as_ptr(), hashes.len(), &mut n) };
    if st != kvrelay_status::KVRELAY_OK {
        return Vec::new();
    }
    names[held..held + n].to_vec()
}

/// The deadline a source gives a transfer of `bytes`, in milliseconds (`kvrelay_fetch_deadline_ms`).
pub fn fetch_deadline_ms(bytes: u64) -> u32 {
    kvrelay_fetch_deadline_ms(bytes)
}

/// The library's version string.
pub fn version() -> &'static str {
    static_text(kvrelay_version())
}

#[allow(dead_code)]
fn _assert_send_sync() {
    fn ss<T: Send + Sync>() {}
    ss::<Admission>();
    ss::<Snapshot>();
    ss::<Orchestrator>();
}
