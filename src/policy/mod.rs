//! The policy layer (SPEC.md sections 5-6): capabilities, candidate collection, bindings, the
//! trusted endpoint registry and the orchestration decision. Pure: no I/O; the only outside
//! contact is the consumer's [`Provider`], called after every check passed.

mod candidates;
mod caps;
mod endpoint;
mod orchestrate;
mod payload;

pub use candidates::{
    collect_candidates, collect_candidates_into, first_candidate, for_each_candidate, Candidate, CandidateCounts,
    Candidates, KV_FETCH,
};
pub use caps::{Capabilities, CapabilitiesBuilder, CapabilitiesError, FamilyId, FamilySet, MAX_FAMILIES};
pub use endpoint::{normalize_endpoint, normalize_endpoint_into, EndpointBuf, EndpointError, EndpointRegistry};
pub use orchestrate::{
    Addressing, BindingSpec, Decision, Discard, FetchRequest, Orchestrator, PolicyConfig, PolicyCounterValues,
    PolicyError, Provider, ProviderError, RequestInfo, DEFAULT_POLICY_METRIC_PREFIX, PROVIDER_DECLINED,
};
pub use payload::member as payload_member;
