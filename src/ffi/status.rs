//! `kvrelay_status`, its message function and the version of the library.

use std::ffi::c_char;

/// Result of every kvrelay function that can fail. The values are fixed and never reused.
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvrelay_status {
    /// Success.
    KVRELAY_OK = 0,
    /// A required pointer argument was NULL.
    KVRELAY_ERR_NULL = 1,
    /// An argument is invalid, e.g. a NULL pointer with a non-zero length.
    KVRELAY_ERR_INVALID_ARGUMENT = 2,
    /// The caller's buffer is too small; `*len_out` holds the size needed and nothing else was
    /// written.
    KVRELAY_ERR_BUFFER_TOO_SMALL = 3,
    /// An index is past the end.
    KVRELAY_ERR_OUT_OF_RANGE = 4,
    /// A configuration value was refused (a limit of zero or above its ceiling, a metric
    /// prefix that is not a Prometheus metric name).
    KVRELAY_ERR_INVALID_CONFIG = 5,
    /// A string argument is not valid UTF-8.
    KVRELAY_ERR_INVALID_UTF8 = 6,
    /// A batched request's aligned hint list has a different length than its prompt count (a
    /// request error, not a hint outcome).
    KVRELAY_ERR_BATCH_LENGTH_MISMATCH = 7,
    /// A handle that is not live was passed (detected in debug builds of the library only,
    /// where live snapshot handles are tracked; release builds do not check).
    KVRELAY_ERR_INVALID_HANDLE = 8,
    /// A KV layout did not validate (alignment, overlap, bounds, shape).
    KVRELAY_ERR_INVALID_LAYOUT = 9,
    /// No CUDA driver library on this machine.
    KVRELAY_ERR_NO_CUDA_DRIVER = 10,
    /// The CUDA driver reports no such device.
    KVRELAY_ERR_NO_CUDA_DEVICE = 11,
    /// A CUDA driver call failed.
    KVRELAY_ERR_CUDA = 12,
    /// A feature this machine's driver or toolkit lacks (e.g. NVRTC, `cuMemcpyBatchAsync`).
    KVRELAY_ERR_UNSUPPORTED = 13,
    /// The same destination block twice in one scatter (the writes would race).
    KVRELAY_ERR_DUPLICATE_BLOCK = 14,
    /// A staging buffer smaller than the call needs, or overlapping the KV pool.
    KVRELAY_ERR_STAGING = 15,
    /// Not done yet: a fetch still runs (`kvrelay_fetch_poll`, `kvrelay_fetch_wait`).
    KVRELAY_ERR_PENDING = 16,
    /// A queue or a set of slots is full (the agent's fetch queue); try again later.
    KVRELAY_ERR_BUSY = 17,
    /// An operating-system call failed (binding a listen address, reading a key file, starting
    /// a thread).
    KVRELAY_ERR_IO = 18,
    /// A panic inside kvrelay was caught at the boundary. This is a bug in kvrelay; the call
    /// had no effect on its outputs.
    KVRELAY_ERR_PANIC = 99,
}

/// Major version of the library the header belongs to (checked against the crate version).
pub const KVRELAY_VERSION_MAJOR: u32 = 0;
/// Minor version.
pub const KVRELAY_VERSION_MINOR: u32 = 4;
/// Patch version.
pub const KVRELAY_VERSION_PATCH: u32 = 3;

const VERSION: &[u8] = concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes();

/// The library's version as a static NUL-terminated string, e.g. `"0.2.0"`. Compare it with the
/// `KVRELAY_VERSION_*` macros to detect a header/library mismatch.
#[no_mangle]
pub extern "C" fn kvrelay_version() -> *const c_char {
    VERSION.as_ptr().cast()
}

/// A static NUL-terminated English message for any status value, including values kvrelay
/// never returns (those get "unknown kvrelay status"). Never NULL; never free it.
#[no_mangle]
pub extern "C" fn kvrelay_status_message(status: i32) -> *const c_char {
    let m: &'static [u8] = match status {
        0 => b"ok\0",
        1 => b"a required pointer argument was NULL\0",
        2 => b"invalid argument\0",
        3 => b"buffer too small; the needed size was stored in *len_out\0",
        4 => b"index out of range\0",
        5 => b"invalid configuration value\0",
        6 => b"string argument is not valid UTF-8\0",
        7 => b"kv_hints list length differs from the prompt count\0",
        8 => b"handle is not live (released or never created)\0",
        9 => b"KV layout does not validate\0",
        10 => b"no CUDA driver on this machine\0",
        11 => b"no such CUDA device\0",
        12 => b"a CUDA driver call failed\0",
        13 => b"not supported by this machine's driver or toolkit\0",
        14 => b"the same block twice in one scatter\0",
        15 => b"staging buffer too small or overlapping the KV pool\0",
        16 => b"not done yet: the operation is still running\0",
        17 => b"busy: a queue or a set of slots is full\0",
        18 => b"an operating-system call failed\0",
        99 => b"internal error: a panic was caught at the kvrelay boundary\0",
        _ => b"unknown kvrelay status\0",
    };
    m.as_ptr().cast()
}

#[cfg(test)]
use kvrelay_status::*;

#[cfg(test)]
impl kvrelay_status {
    /// Every status, for tests.
    pub(crate) const ALL: [kvrelay_status; 20] = [
        KVRELAY_OK,
        KVRELAY_ERR_NULL,
        KVRELAY_ERR_INVALID_ARGUMENT,
        KVRELAY_ERR_BUFFER_TOO_SMALL,
        KVRELAY_ERR_OUT_OF_RANGE,
        KVRELAY_ERR_INVALID_CONFIG,
        KVRELAY_ERR_INVALID_UTF8,
        KVRELAY_ERR_BATCH_LENGTH_MISMATCH,
        KVRELAY_ERR_INVALID_HANDLE,
        KVRELAY_ERR_INVALID_LAYOUT,
        KVRELAY_ERR_NO_CUDA_DRIVER,
        KVRELAY_ERR_NO_CUDA_DEVICE,
        KVRELAY_ERR_CUDA,
        KVRELAY_ERR_UNSUPPORTED,
        KVRELAY_ERR_DUPLICATE_BLOCK,
        KVRELAY_ERR_STAGING,
        KVRELAY_ERR_PENDING,
        KVRELAY_ERR_BUSY,
        KVRELAY_ERR_IO,
        KVRELAY_ERR_PANIC,
    ];
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    fn msg(code: i32) -> &'static str {
        // SAFETY: kvrelay_status_message returns static NUL-terminated strings.
        unsafe { CStr::from_ptr(kvrelay_status_message(code)) }.to_str().unwrap()
    }

    #[test]
    fn every_status_has_its_own_message_and_invented_ones_are_unknown() {
        let mut seen = std::collections::HashSet::new();
        for s in kvrelay_status::ALL {
            let m = msg(s as i32);
            assert_ne!(m, "unknown kvrelay status", "{s:?}");
            assert!(seen.insert(m), "duplicate message {m}");
        }
        for invented in [-1, 19, 42, 98, 100, i32::MIN, i32::MAX] {
            assert_eq!(msg(invented), "unknown kvrelay status");
        }
    }
}
