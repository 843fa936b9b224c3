//! Small `#[repr(C)]` value types with a documented layout.

use std::ffi::c_char;
use std::fmt::Write as _;

use crate::hints::CounterValues;
use crate::hints::{Ignored, Outcome, Reason};

use super::boundary::{own_size, sized_since_epoch};

sized_since_epoch!(kvrelay_action, kvrelay_outcome, kvrelay_counters);

/// A borrowed byte view. Valid while the snapshot it came from is held.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvrelay_bytes {
    /// First byte (never NULL, even when empty).
    pub ptr: *const u8,
    /// Number of bytes.
    pub len: usize,
}

/// A borrowed UTF-8 string view, **not** NUL-terminated. Valid while the snapshot it came from
/// is held.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvrelay_str {
    /// First byte (never NULL, even when empty).
    pub ptr: *const c_char,
    /// Number of bytes.
    pub len: usize,
}

impl kvrelay_bytes {
    pub(crate) fn of(b: &[u8]) -> kvrelay_bytes {
        kvrelay_bytes { ptr: b.as_ptr(), len: b.len() }
    }
}

impl kvrelay_str {
    pub(crate) fn of(s: &str) -> kvrelay_str {
        kvrelay_str { ptr: s.as_ptr().cast(), len: s.len() }
    }
}

/// One action of a snapshot, as borrowed views.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvrelay_action {
    /// `sizeof(kvrelay_action)` as the caller's header declares it (set by the caller before the call;
    /// the library writes only the fields that size covers).
    pub size: usize,
    /// Position in the envelope's `actions` array.
    pub index: usize,
    /// `action_id`, decoded.
    pub id: kvrelay_str,
    /// `action_type`, decoded.
    pub action_type: kvrelay_str,
    /// `action_version`, decoded.
    pub version: kvrelay_str,
    /// Canonical JSON bytes of `payload` (an object).
    pub payload: kvrelay_bytes,
    /// Canonical JSON bytes of the whole action object.
    pub canonical: kvrelay_bytes,
}

/// What happened to a hint: `kvrelay_outcome.kind`.
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvrelay_outcome_kind {
    /// No value, or JSON `null`; not counted.
    KVRELAY_OUTCOME_ABSENT = 0,
    /// Admitted; a snapshot was returned.
    KVRELAY_OUTCOME_ADMITTED = 1,
    /// Dropped whole; see `reason`.
    KVRELAY_OUTCOME_IGNORED = 2,
}

/// Why a hint was dropped: `kvrelay_outcome.reason` (`KVRELAY_REASON_NONE` unless ignored).
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvrelay_reason {
    /// Not ignored.
    KVRELAY_REASON_NONE = 0,
    /// Trust is off.
    KVRELAY_REASON_UNTRUSTED = 1,
    /// `protocol_version` is a string other than `"0.1"`.
    KVRELAY_REASON_UNKNOWN_VERSION = 2,
    /// Raw input or canonical encoding over its limit.
    KVRELAY_REASON_OVERSIZED = 3,
    /// Anything else wrong; `detail` says what and where.
    KVRELAY_REASON_MALFORMED = 4,
}

/// Size of `kvrelay_outcome.detail`, NUL included.
pub const KVRELAY_DETAIL_CAPACITY: usize = 128;

/// The outcome of admitting (or decoding) one hint. Plain data; nothing to free.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvrelay_outcome {
    /// `sizeof(kvrelay_outcome)` as the caller's header declares it (set by the caller before the call;
    /// the library writes only the fields that size covers).
    pub size: usize,
    /// A `kvrelay_outcome_kind` value.
    pub kind: i32,
    /// A `kvrelay_reason` value.
    pub reason: i32,
    /// For `KVRELAY_REASON_MALFORMED`: what failed and where, NUL-terminated (cut to fit).
    /// Never contains bytes of the hint. Empty otherwise.
    pub detail: [c_char; KVRELAY_DETAIL_CAPACITY],
}

pub(crate) fn reason_code(r: Reason) -> kvrelay_reason {
    match r {
        Reason::Untrusted => kvrelay_reason::KVRELAY_REASON_UNTRUSTED,
        Reason::UnknownVersion => kvrelay_reason::KVRELAY_REASON_UNKNOWN_VERSION,
        Reason::Oversized => kvrelay_reason::KVRELAY_REASON_OVERSIZED,
        Reason::Malformed => kvrelay_reason::KVRELAY_REASON_MALFORMED,
    }
}

impl kvrelay_outcome {
    pub(crate) fn absent() -> kvrelay_outcome {
        kvrelay_outcome {
            size: own_size::<kvrelay_outcome>(),
            kind: kvrelay_outcome_kind::KVRELAY_OUTCOME_ABSENT as i32,
            reason: kvrelay_reason::KVRELAY_REASON_NONE as i32,
            detail: [0; KVRELAY_DETAIL_CAPACITY],
        }
    }

    pub(crate) fn admitted() -> kvrelay_outcome {
        kvrelay_outcome { kind: kvrelay_outcome_kind::KVRELAY_OUTCOME_ADMITTED as i32, ..Self::absent() }
    }

    pub(crate) fn ignored(i: &Ignored) -> kvrelay_outcome {
        let mut o = kvrelay_outcome {
            kind: kvrelay_outcome_kind::KVRELAY_OUTCOME_IGNORED as i32,
            reason: reason_code(i.reason) as i32,
            ..Self::absent()
        };
        if let Some(d) = &i.detail {
            // Details are short ASCII; format on the stack and cut at a char boundary.
            let mut s = String::new();
            let _ = write!(s, "{d}");
            let mut n = s.len().min(KVRELAY_DETAIL_CAPACITY - 1);
            while !s.is_char_boundary(n) {
                n -= 1;
            }
            for (dst, &b) in o.detail.iter_mut().zip(&s.as_bytes()[..n]) {
                *dst = b as c_char;
            }
        }
        o
    }

    /// The C outcome of a Rust outcome, without the snapshot.
    pub(crate) fn of(o: &Outcome) -> kvrelay_outcome {
        match o {
            Outcome::Absent => Self::absent(),
            Outcome::Admitted(_) => Self::admitted(),
            Outcome::Ignored(i) => Self::ignored(i),
        }
    }
}

/// A copy of an admission edge's counters.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct kvrelay_counters {
    /// `sizeof(kvrelay_counters)` as the caller's header declares it (set by the caller before the call;
    /// the library writes only the fields that size covers).
    pub size: usize,
    /// `admitted_total`
    pub admitted: u64,
    /// `ignored_total{reason="untrusted"}`
    pub untrusted: u64,
    /// `ignored_total{reason="unknown_version"}`
    pub unknown_version: u64,
    /// `ignored_total{reason="oversized"}`
    pub oversized: u64,
    /// `ignored_total{reason="malformed"}`
    pub malformed: u64,
}

impl From<CounterValues> for kvrelay_counters {
    fn from(v: CounterValues) -> Self {
        kvrelay_counters {
            size: own_size::<kvrelay_counters>(),
            admitted: v.admitted,
            untrusted: v.untrusted,
            unknown_version: v.unknown_version,
            oversized: v.oversized,
            malformed: v.malformed,
        }
    }
}

/// The metric label of a `kvrelay_reason` value (`"untrusted"`, ...), `"none"` for
/// `KVRELAY_REASON_NONE`, `"unknown"` for values kvrelay does not define. Static,
/// NUL-terminated, never NULL.
#[no_mangle]
pub extern "C" fn kvrelay_reason_name(reason: i32) -> *const c_char {
    let s: &'static [u8] = match reason {
        0 => b"none\0",
        r => Reason::ALL.iter().find(|x| **x as i32 + 1 == r).map_or(b"unknown\0", |x| x.c_label()),
    };
    s.as_ptr().cast()
}
