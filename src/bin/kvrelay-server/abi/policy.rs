//! Policy: capabilities, bindings, the endpoint registry and orchestration with a Rust provider.

use super::*;

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
                size: size_of::<kvrelay_provider>(),
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
        let info = kvrelay_request_info { generation_only: true, lora_adapter, ..Default::default() };
        let snap = snapshot.map_or(ptr::null(), |s| s.0.as_ptr().cast_const());
        let mut d = kvrelay_decision::default();
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
