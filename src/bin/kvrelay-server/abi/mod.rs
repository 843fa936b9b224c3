//! The server's one door into kvrelay: safe wrappers over the exported C ABI (`kvrelay_*`),
//! the same functions a C++ runtime links. Every `unsafe` block of the server lives here, so
//! the server's tests and load runs exercise the boundary the C++ runtime uses.
//!
//! Ownership mirrors the header: owned handles are freed on `Drop`, snapshots are retained on
//! `Clone` and released on `Drop`. Views borrow from the wrapper that produced them. One module
//! per C ABI module: [`admission`] (with snapshots), [`policy`], [`copy`], [`agent`], [`events`], [`names`].

mod admission;
mod agent;
mod copy;
mod events;
pub mod names;
mod policy;

pub use admission::*;
pub use agent::*;
pub use copy::*;
pub use events::*;
pub use policy::*;

use std::ffi::{c_char, c_void, CStr};
use std::fmt;
use std::ptr::{self, NonNull};
use std::sync::Arc;

use kvrelay::ffi::admission::*;
use kvrelay::ffi::agent::*;
use kvrelay::ffi::boundary::kvrelay_last_error_message;
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
