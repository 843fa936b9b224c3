//! The hint protocol: one-pass scanner and canonical writer, admission, snapshots, MessagePack.
//!
//! Start at [`Admission`]: build one per process from an [`AdmissionConfig`], call
//! [`Admission::admit`] with the raw `kv_hints` text of each request, and carry the
//! [`Snapshot`] of an admitted hint with the request.

mod admission;
mod counters;
mod detail;
mod find;
mod lex;
mod msgpack;
mod scan;
mod snapshot;
mod strings;

pub use admission::{
    env_value_trusts, Admission, AdmissionConfig, BatchLengthMismatch, BatchOutcome, ConfigError, Ignored, Outcome,
    Reason, DEFAULT_MAX_BYTES, DEFAULT_MAX_DEPTH, DEFAULT_MAX_RAW_BYTES, DEFAULT_TRUST_ENV, LIMIT_BYTES_CEILING,
    LIMIT_DEPTH_CEILING,
};
pub use counters::{CounterValues, Counters, DEFAULT_METRIC_PREFIX};
pub use detail::{Detail, Where};
pub use find::{find_hint, FindError, FoundHint, HintSpelling};
#[doc(hidden)]
pub use lex::SCANNER;
pub use scan::Scratch;
pub use snapshot::{Action, ActionEnvelope, Snapshot};
pub(crate) use strings::decode_string as decode_canonical_string;
