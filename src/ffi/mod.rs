//! The C ABI (`include/kvrelay.h`, generated from this module by cbindgen).
//!
//! Conventions (the same for every feature that joins the ABI later):
//! - every function goes through one boundary helper (`boundary::guard`): null checks, `catch_unwind`, and a panic
//!   becomes `KVRELAY_ERR_PANIC`, never an abort or undefined behaviour;
//! - functions return `kvrelay_status` (an `int32_t` whose values never change meaning);
//!   `kvrelay_status_message` renders any integer, invented ones included;
//! - bytes and strings are pointer plus length; `(NULL, 0)` is a valid empty input;
//! - out-parameters are written only on success. The one exception is the size query of
//!   functions that fill a caller buffer: they always store the needed size in `*len_out`,
//!   and write nothing else when the buffer is too small (`KVRELAY_ERR_BUFFER_TOO_SMALL`);
//! - owned handles have `_new`/`_free`, shared ones `_retain`/`_release`; `_free(NULL)` and
//!   `_release(NULL)` do nothing;
//! - views (`kvrelay_bytes`, `kvrelay_str`, `kvrelay_action`) borrow from a snapshot and stay
//!   valid while the caller holds a reference to that snapshot.
#![allow(non_camel_case_types)]

pub mod admission;
#[cfg(feature = "agent")]
pub mod agent;
pub mod boundary;
pub mod copy;
#[cfg(feature = "events")]
pub mod events;
pub mod names;
pub mod policy;
pub mod snapshot;
pub mod status;
pub mod types;

pub use status::kvrelay_status;
