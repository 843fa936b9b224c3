//! # kvrelay
//!
//! KV hint envelopes admitted at a trusted edge ([`hints`]), frozen into immutable snapshots
//! that travel with a request, the policy that decides on them ([`policy`]), the KV copy
//! engines that move paged KV between GPU memory and pinned host memory ([`copy`]), and the C
//! ABI over all of it ([`ffi`], `include/kvrelay.h`).
//!
//! ```
//! use kvrelay::{Admission, AdmissionConfig, Outcome};
//!
//! let edge = Admission::new(AdmissionConfig { trusted: true, ..Default::default() }).unwrap();
//! let hint = br#"{"protocol_version":"0.1","message_id":"m1","actions":[
//!     {"action_id":"a1","action_type":"kv.fetch","action_version":"1.0",
//!      "payload":{"source_control_endpoint":"tcp://127.0.0.1:23280","block_hashes":[11,22]}}]}"#;
//! match edge.admit(Some(hint)) {
//!     Outcome::Admitted(snap) => {
//!         assert_eq!(snap.message_id(), "m1");
//!         assert_eq!(snap.action(0).unwrap().action_type(), "kv.fetch");
//!     }
//!     other => panic!("{other:?}"),
//! }
//! ```
//!
//! The trust switch trusts all traffic that reaches the process and authenticates nobody.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

#[macro_use]
mod labels;

#[cfg(feature = "agent")]
pub mod agent;
pub mod block_mac;
pub mod checksum;
pub mod copy;
#[cfg(feature = "events")]
pub mod events;
pub mod ffi;
pub mod hints;
pub mod metrics;
pub mod names;
pub mod policy;

pub use hints::{
    Action, ActionEnvelope, Admission, AdmissionConfig, BatchLengthMismatch, BatchOutcome, Detail, Ignored, Outcome,
    Reason, Snapshot, Where,
};
pub use hints::{CounterValues, Counters};
