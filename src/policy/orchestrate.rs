//! The orchestration policy (SPEC.md section 6): eligibility, first candidate, exactly one
//! trusted authorized binding, capability, addressing, endpoint registry, provider validation,
//! then one named-fetch attempt. Every discard keeps the existing paired path and names its
//! reason; none tries another candidate, family or binding.

use std::fmt;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::candidates::{for_each_candidate, Candidate};
use super::caps::{Capabilities, FamilyId};
use super::endpoint::{normalize_endpoint_into, EndpointBuf, EndpointError, EndpointRegistry};
use crate::hints::{Action, ActionEnvelope, Snapshot};
use crate::metrics::valid_metric_prefix;

/// How a binding reaches KV.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Addressing {
    /// Fetches KV by content name from a source the hint names: usable for named fetch.
    Named,
    /// Tied to the request's own prefill/decode pairing: never used for optional named fetch.
    RequestPaired,
}

/// A configured backend binding (server configuration, trusted).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BindingSpec {
    /// Unique id.
    pub id: String,
    /// Name of the family it belongs to (must exist in the capability snapshot).
    pub family: String,
    /// How it reaches KV.
    pub addressing: Addressing,
    /// The `(action_type, action_version)` pairs this binding itself supports.
    pub supports: Vec<(String, String)>,
    /// Whether the server authorizes it for optional named fetch.
    pub authorized: bool,
}

#[derive(Clone, Debug)]
struct Binding {
    spec: BindingSpec,
    /// The id again, shared with decisions (cloning it is one atomic increment).
    id: Arc<str>,
    family: FamilyId,
}

impl Binding {
    fn supports(&self, a: &Action<'_>) -> bool {
        self.spec.supports.iter().any(|(t, v)| t == a.action_type() && v == a.version())
    }
}

/// The request facts eligibility needs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RequestInfo {
    /// A generation-only request (no other work such as embeddings or scoring).
    pub generation_only: bool,
    /// The request uses a LoRA adapter.
    pub lora_adapter: bool,
}

crate::labels::labelled_enum! {
    /// Why optional named fetch was not attempted (or failed). The discriminants are stable (the
    /// C ABI and metrics use them).
    pub enum Discard: u8 {
        /// Not a generation-only request (ineligible: no candidate collection).
        NotGenerationOnly = 1 => "not_generation_only",
        /// The request uses a LoRA adapter (ineligible: no candidate collection).
        LoraAdapter = 2 => "lora_adapter",
        /// No admitted hint.
        NoHint = 3 => "no_hint",
        /// No supported `kv.fetch` action.
        NoCandidate = 4 => "no_candidate",
        /// No binding is configured for any family supporting the first candidate.
        MissingMapping = 5 => "missing_mapping",
        /// Bindings exist but none is authorized.
        Unauthorized = 6 => "unauthorized",
        /// Authorized bindings exist but none supports the action's type and version.
        CapabilityMismatch = 7 => "capability_mismatch",
        /// More than one authorized binding supports the action: the mapping does not choose.
        AmbiguousMapping = 8 => "ambiguous_mapping",
        /// The resolved binding is request-paired.
        RequestPaired = 9 => "request_paired",
        /// The payload has no `source_control_endpoint` string.
        EndpointMissing = 10 => "endpoint_missing",
        /// The endpoint does not normalize (malformed, wildcard, no port...).
        EndpointInvalid = 11 => "endpoint_invalid",
        /// The endpoint is not in the server's trusted endpoint registry.
        EndpointNotTrusted = 12 => "endpoint_not_trusted",
        /// The provider's own validation refused the action, payload or destination.
        ProviderRejected = 13 => "provider_rejected",
        /// The provider accepted but the fetch submission failed.
        FetchFailed = 14 => "fetch_failed",
        /// The provider chose not to fetch, nothing being wrong (nothing to fetch, not worth it,
        /// another request fetching the same blocks): its code has [`PROVIDER_DECLINED`] set.
        ProviderDeclined = 15 => "provider_declined",
    }
}

/// Set in a provider's positive `fetch` code to say it declined by choice rather than failed:
/// the decision is then [`Discard::ProviderDeclined`], not [`Discard::FetchFailed`] (the code is
/// kept whole in the answer). A negative code is never a decline. Provider codes are the
/// provider's own otherwise.
pub const PROVIDER_DECLINED: i32 = 0x4000_0000;

/// What the provider is asked to validate, then to fetch.
#[derive(Debug)]
pub struct FetchRequest<'a> {
    /// The resolved binding.
    pub binding_id: &'a str,
    /// Its family's name.
    pub family: &'a str,
    /// The selected action (type, version, payload).
    pub action: Action<'a>,
    /// The destination, normalized, found in the trusted registry.
    pub endpoint: &'a str,
    /// The one-action envelope to hand on (copied only when serialized).
    pub envelope: &'a ActionEnvelope,
    /// The caller's per-call context given to [`Orchestrator::decide_with_context`] (`None`
    /// from `decide`): how a provider hands the decision's fetch to the code that asked,
    /// without globals or thread-locals.
    pub context: Option<&'a (dyn std::any::Any + Send + Sync)>,
}

/// A provider's refusal; `code` is the provider's own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProviderError {
    /// Provider-defined code.
    pub code: i32,
}

/// The consumer's KV transfer integration. kvrelay never opens a connection: it contacts the
/// provider only after every runtime check passed, once to validate (action version, payload
/// and destination, on the provider's own terms) and, if that passes, once to fetch.
pub trait Provider: Send + Sync {
    /// Validate the request; refusing keeps the paired path.
    fn validate(&self, req: &FetchRequest<'_>) -> Result<(), ProviderError>;
    /// Submit the named fetch.
    fn fetch(&self, req: &FetchRequest<'_>) -> Result<(), ProviderError>;
}

/// A shared provider is a provider (one instance can serve several orchestrators).
impl<P: Provider + ?Sized> Provider for Arc<P> {
    fn validate(&self, req: &FetchRequest<'_>) -> Result<(), ProviderError> {
        (**self).validate(req)
    }
    fn fetch(&self, req: &FetchRequest<'_>) -> Result<(), ProviderError> {
        (**self).fetch(req)
    }
}

/// The decision for one request.
#[derive(Clone, Debug)]
pub enum Decision {
    /// Named fetch was validated and submitted through `binding`.
    NamedFetch {
        /// The resolved binding's id.
        binding: Arc<str>,
        /// The one-action envelope that was handed to the provider.
        envelope: ActionEnvelope,
    },
    /// Keep the existing paired path; nothing named-fetch related was done beyond the reason.
    KeepPairedPath(Discard),
}

impl Decision {
    /// The discard reason, if any.
    pub fn discard(&self) -> Option<Discard> {
        match self {
            Decision::KeepPairedPath(d) => Some(*d),
            Decision::NamedFetch { .. } => None,
        }
    }
}

/// Why an orchestrator could not be built.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PolicyError {
    /// A binding names a family the capability snapshot does not have.
    UnknownFamily(String),
    /// Two bindings share an id.
    DuplicateBinding(String),
    /// An empty binding id.
    EmptyBindingId,
    /// A registry endpoint that does not normalize.
    Endpoint(String, EndpointError),
    /// The metric prefix is not a Prometheus metric name.
    MetricPrefix,
}

impl fmt::Display for PolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PolicyError::UnknownFamily(b) => write!(f, "binding {b:?} names a family without capabilities"),
            PolicyError::DuplicateBinding(b) => write!(f, "binding id {b:?} is used twice"),
            PolicyError::EmptyBindingId => f.write_str("empty binding id"),
            PolicyError::Endpoint(e, why) => write!(f, "registry endpoint {e:?}: {why}"),
            PolicyError::MetricPrefix => f.write_str("metric prefix must match [a-zA-Z_:][a-zA-Z0-9_:]*"),
        }
    }
}
impl std::error::Error for PolicyError {}

/// Default metric prefix of the policy counters.
pub const DEFAULT_POLICY_METRIC_PREFIX: &str = "kvrelay_kv_policy";

/// The server's policy configuration: bindings, trusted endpoints, metric prefix.
#[derive(Clone, Debug)]
pub struct PolicyConfig {
    /// The trusted mapping from families to bindings.
    pub bindings: Vec<BindingSpec>,
    /// The trusted endpoint registry's entries.
    pub endpoints: Vec<String>,
    /// Prefix of the Prometheus metric names.
    pub metric_prefix: String,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig { bindings: Vec::new(), endpoints: Vec::new(), metric_prefix: DEFAULT_POLICY_METRIC_PREFIX.into() }
    }
}

#[derive(Debug, Default)]
struct PolicyCounters {
    named_fetch: AtomicU64,
    discarded: [AtomicU64; Discard::ALL.len() + 1],
    unknown_type: AtomicU64,
    no_matching_version: AtomicU64,
}

/// A point-in-time copy of the policy counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PolicyCounterValues {
    /// Named fetches submitted.
    pub named_fetch: u64,
    /// Discards, indexed by `Discard as usize` (index 0 unused).
    pub discarded: [u64; Discard::ALL.len() + 1],
    /// Actions whose type no family lists, summed over the requests that reached candidate
    /// collection (each request's actions counted once).
    pub unknown_type: u64,
    /// `kv.fetch` actions whose version no family supports, likewise.
    pub no_matching_version: u64,
}

impl PolicyCounterValues {
    /// The count for one reason.
    pub fn discarded(&self, d: Discard) -> u64 {
        self.discarded[d as usize]
    }
}

/// The policy of one server: capabilities, bindings, endpoint registry, provider, counters.
/// `Send + Sync`; [`Orchestrator::decide`] takes `&self`.
pub struct Orchestrator {
    caps: Arc<Capabilities>,
    bindings: Vec<Binding>,
    registry: EndpointRegistry,
    provider: Box<dyn Provider>,
    prefix: String,
    counters: PolicyCounters,
}

impl fmt::Debug for Orchestrator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Orchestrator")
            .field("families", &self.caps.family_count())
            .field("bindings", &self.bindings.len())
            .field("endpoints", &self.registry.len())
            .finish_non_exhaustive()
    }
}

impl Orchestrator {
    /// Build and check the policy.
    pub fn new(
        caps: Arc<Capabilities>,
        config: PolicyConfig,
        provider: Box<dyn Provider>,
    ) -> Result<Orchestrator, PolicyError> {
        if !valid_metric_prefix(&config.metric_prefix) {
            return Err(PolicyError::MetricPrefix);
        }
        let mut bindings: Vec<Binding> = Vec::with_capacity(config.bindings.len());
        for spec in config.bindings {
            if spec.id.is_empty() {
                return Err(PolicyError::EmptyBindingId);
            }
            if bindings.iter().any(|b| b.spec.id == spec.id) {
                return Err(PolicyError::DuplicateBinding(spec.id));
            }
            let family = caps.family(&spec.family).ok_or_else(|| PolicyError::UnknownFamily(spec.id.clone()))?;
            bindings.push(Binding { id: Arc::from(spec.id.as_str()), spec, family });
        }
        let mut registry = EndpointRegistry::new();
        for e in &config.endpoints {
            registry.add(e).map_err(|why| PolicyError::Endpoint(e.clone(), why))?;
        }
        Ok(Orchestrator {
            caps,
            bindings,
            registry,
            provider,
            prefix: config.metric_prefix,
            counters: PolicyCounters::default(),
        })
    }

    /// The configured id equal to `id` (a reference that lives as long as the orchestrator).
    pub fn binding_id(&self, id: &str) -> Option<&str> {
        self.bindings.iter().map(|b| &*b.id).find(|b| *b == id)
    }

    /// The capability snapshot.
    pub fn capabilities(&self) -> &Arc<Capabilities> {
        &self.caps
    }

    /// Decide for one request and, when every check passes, validate with the provider and
    /// submit the named fetch. `snapshot` is the request's admitted hint, if any. Counts the
    /// outcome once.
    ///
    /// Cost without a provider contact: a scan of every action's type and version strings (the
    /// candidates and the request's unknown_type / no_matching_version counts), a pass over the
    /// bindings, and the payload's
    /// `source_control_endpoint` value, which admission already located (O(1)), normalized
    /// into a fixed buffer. Allocates only to decode an endpoint string that contains escapes
    /// and, on the named-fetch path, for the provider.
    pub fn decide(&self, req: &RequestInfo, snapshot: Option<&Snapshot>) -> Decision {
        self.decide_with_answer(req, snapshot).0
    }

    /// [`decide`](Self::decide), also returning what the provider answered when it refused
    /// (`ProviderRejected`, `FetchFailed` or `ProviderDeclined`): its own code.
    pub fn decide_with_answer(
        &self,
        req: &RequestInfo,
        snapshot: Option<&Snapshot>,
    ) -> (Decision, Option<ProviderError>) {
        self.decide_with_context(req, snapshot, None)
    }

    /// [`decide_with_answer`](Self::decide_with_answer) with a per-call `context` that the
    /// provider receives in [`FetchRequest::context`] (e.g. a slot the provider fills with the
    /// fetch it accepted for this request).
    pub fn decide_with_context(
        &self,
        req: &RequestInfo,
        snapshot: Option<&Snapshot>,
        context: Option<&(dyn std::any::Any + Send + Sync)>,
    ) -> (Decision, Option<ProviderError>) {
        let mut answer = None;
        let d = self.decide_inner(req, snapshot, context, &mut answer);
        match &d {
            Decision::NamedFetch { .. } => self.counters.named_fetch.fetch_add(1, Ordering::Relaxed),
            Decision::KeepPairedPath(r) => self.counters.discarded[*r as usize].fetch_add(1, Ordering::Relaxed),
        };
        (d, answer)
    }

    fn decide_inner(
        &self,
        req: &RequestInfo,
        snapshot: Option<&Snapshot>,
        context: Option<&(dyn std::any::Any + Send + Sync)>,
        answer: &mut Option<ProviderError>,
    ) -> Decision {
        use Decision::KeepPairedPath as Keep;
        // Eligibility first: ineligible requests never reach candidate collection.
        if !req.generation_only {
            return Keep(Discard::NotGenerationOnly);
        }
        if req.lora_adapter {
            return Keep(Discard::LoraAdapter);
        }
        let Some(snap) = snapshot else { return Keep(Discard::NoHint) };
        // Candidate collection: one pass over the actions, which also accounts the request's
        // unknown_type and no_matching_version counts once. The first candidate only is used;
        // later candidates are never tried.
        let mut first = None;
        let counts = for_each_candidate(snap, &self.caps, |c| {
            first.get_or_insert(c);
        });
        self.counters.unknown_type.fetch_add(u64::from(counts.unknown_type), Ordering::Relaxed);
        self.counters.no_matching_version.fetch_add(u64::from(counts.no_matching_version), Ordering::Relaxed);
        let Some(Candidate { action_index, families }) = first else {
            return Keep(Discard::NoCandidate);
        };
        let action = snap.action(action_index).expect("candidate index");
        // Trusted resolution: exactly one configured, authorized binding that supports the
        // action, among the supporting families. Counting, not picking: registration order
        // cannot choose.
        let (mut configured, mut authorized, mut chosen, mut matches) = (0, 0, None, 0);
        for b in self.bindings.iter().filter(|b| families.contains(b.family)) {
            configured += 1;
            if b.spec.authorized {
                authorized += 1;
                if b.supports(&action) {
                    matches += 1;
                    chosen = Some(b);
                }
            }
        }
        let binding = match (configured, authorized, matches) {
            (0, _, _) => return Keep(Discard::MissingMapping),
            (_, 0, _) => return Keep(Discard::Unauthorized),
            (_, _, 0) => return Keep(Discard::CapabilityMismatch),
            (_, _, 1) => chosen.expect("one match"),
            _ => return Keep(Discard::AmbiguousMapping),
        };
        // A request-paired binding is rejected before any lookup or provider contact.
        if binding.spec.addressing == Addressing::RequestPaired {
            return Keep(Discard::RequestPaired);
        }
        // The server's registry decides the destination; a supplied address grants nothing.
        let Some(raw) = action.endpoint_value() else {
            return Keep(Discard::EndpointMissing);
        };
        let mut decoded = Vec::new();
        let Some(text) = json_str(raw, &mut decoded) else { return Keep(Discard::EndpointMissing) };
        let mut endpoint = EndpointBuf::new();
        match normalize_endpoint_into(text, &mut endpoint) {
            Ok(()) => {}
            // another spelling of a numeric address: no registry holds it, so it is untrusted
            // like any address the registry lacks (one reason per cause, whatever the spelling)
            Err(crate::policy::EndpointError::Ambiguous) => return Keep(Discard::EndpointNotTrusted),
            Err(_) => return Keep(Discard::EndpointInvalid),
        }
        let endpoint = endpoint.as_str();
        if !self.registry.contains_normalized(endpoint) {
            return Keep(Discard::EndpointNotTrusted);
        }
        // Only now is the provider contacted: validate on its own terms, then submit.
        let envelope = snap.action_envelope(action_index).expect("candidate index");
        let fr = FetchRequest {
            binding_id: &binding.spec.id,
            family: self.caps.family_name(binding.family),
            action,
            endpoint,
            envelope: &envelope,
            context,
        };
        if let Err(e) = self.provider.validate(&fr) {
            *answer = Some(e);
            return Keep(Discard::ProviderRejected);
        }
        if let Err(e) = self.provider.fetch(&fr) {
            *answer = Some(e);
            return Keep(if e.code > 0 && e.code & PROVIDER_DECLINED != 0 {
                Discard::ProviderDeclined
            } else {
                Discard::FetchFailed
            });
        }
        Decision::NamedFetch { binding: binding.id.clone(), envelope }
    }

    /// Read the counters.
    pub fn counters(&self) -> PolicyCounterValues {
        let mut v = PolicyCounterValues {
            named_fetch: self.counters.named_fetch.load(Ordering::Relaxed),
            unknown_type: self.counters.unknown_type.load(Ordering::Relaxed),
            no_matching_version: self.counters.no_matching_version.load(Ordering::Relaxed),
            ..Default::default()
        };
        for d in Discard::ALL {
            v.discarded[d as usize] = self.counters.discarded[d as usize].load(Ordering::Relaxed);
        }
        v
    }

    /// Append the Prometheus text (format 0.0.4) of the counters to `out`.
    pub fn write_prometheus(&self, out: &mut String) {
        let v = self.counters();
        let p = &self.prefix;
        let _ = write!(
            out,
            "# HELP {p}_named_fetch_total Optional named fetches validated and submitted.\n\
             # TYPE {p}_named_fetch_total counter\n\
             {p}_named_fetch_total {}\n\
             # HELP {p}_discarded_total Requests that kept the paired path, by reason.\n\
             # TYPE {p}_discarded_total counter\n",
            v.named_fetch
        );
        for d in Discard::ALL {
            let _ = writeln!(out, "{p}_discarded_total{{reason=\"{}\"}} {}", d.as_str(), v.discarded(d));
        }
        let _ = write!(
            out,
            "# HELP {p}_unknown_type_total Actions whose type no backend family lists (once per request).\n\
             # TYPE {p}_unknown_type_total counter\n\
             {p}_unknown_type_total {}\n\
             # HELP {p}_no_matching_version_total kv.fetch actions whose version no family supports (once per request).\n\
             # TYPE {p}_no_matching_version_total counter\n\
             {p}_no_matching_version_total {}\n",
            v.unknown_type, v.no_matching_version
        );
    }

    /// The Prometheus text of the counters.
    pub fn prometheus(&self) -> String {
        let mut s = String::new();
        self.write_prometheus(&mut s);
        s
    }
}

/// The text of a canonical JSON string value (`None` for other kinds): borrowed when it has no
/// escape, else decoded into `buf`.
fn json_str<'a>(v: &'a [u8], buf: &'a mut Vec<u8>) -> Option<&'a str> {
    if v.len() < 2 || v[0] != b'"' {
        return None;
    }
    let inner = &v[1..v.len() - 1];
    if !inner.contains(&b'\\') {
        return std::str::from_utf8(inner).ok();
    }
    crate::hints::decode_canonical_string(inner, buf);
    std::str::from_utf8(buf).ok()
}
