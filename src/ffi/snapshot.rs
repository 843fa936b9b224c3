//! `kvrelay_snapshot`: a reference-counted, immutable admitted envelope.
//!
//! The handle is the snapshot's own allocation (no wrapper box): `_retain` is one atomic
//! increment, `_release` one atomic decrement. Debug builds of the library additionally keep a
//! table of live handles so that a release too many, or use after the last release, is
//! reported (`KVRELAY_ERR_INVALID_HANDLE`, and a message on stderr from `_release`) instead of
//! corrupting memory; release builds do not pay for that check.

use super::boundary::{fill, fill_pieces, guard, guard_void, out_ptr, output_size, put, put_sized_at};
use super::status::kvrelay_status::{self, *};
use super::types::{kvrelay_action, kvrelay_bytes, kvrelay_str};
use crate::hints::Snapshot;

/// An admitted envelope, frozen. Opaque; obtained from `kvrelay_admit` and friends.
pub struct kvrelay_snapshot {
    _opaque: [u8; 0],
}

#[cfg(debug_assertions)]
mod live {
    use std::collections::HashMap;
    use std::sync::Mutex;

    static LIVE: Mutex<Option<HashMap<usize, usize>>> = Mutex::new(None);

    fn with<R>(f: impl FnOnce(&mut HashMap<usize, usize>) -> R) -> R {
        let mut g = LIVE.lock().unwrap_or_else(|e| e.into_inner());
        f(g.get_or_insert_with(HashMap::new))
    }
    pub fn add(p: usize) {
        with(|m| *m.entry(p).or_insert(0) += 1);
    }
    pub fn is_live(p: usize) -> bool {
        with(|m| m.contains_key(&p))
    }
    /// Remove one reference; false if there was none.
    pub fn remove(p: usize) -> bool {
        with(|m| match m.get_mut(&p) {
            Some(n) if *n > 1 => {
                *n -= 1;
                true
            }
            Some(_) => {
                m.remove(&p);
                true
            }
            None => false,
        })
    }
}

/// Hand one reference to C.
pub(crate) fn export(s: Snapshot) -> *mut kvrelay_snapshot {
    let p = s.into_raw() as *mut kvrelay_snapshot;
    #[cfg(debug_assertions)]
    live::add(p as usize);
    p
}

/// Borrow the snapshot behind a handle.
///
/// # Safety
/// `p` must be NULL or a live handle; the returned value must not outlive the caller's
/// reference.
pub(crate) unsafe fn borrow(p: *const kvrelay_snapshot) -> Result<std::mem::ManuallyDrop<Snapshot>, kvrelay_status> {
    if p.is_null() {
        return Err(KVRELAY_ERR_NULL);
    }
    #[cfg(debug_assertions)]
    if !live::is_live(p as usize) {
        return Err(KVRELAY_ERR_INVALID_HANDLE);
    }
    // SAFETY: non-NULL and, per the contract, a live handle from `export`.
    Ok(unsafe { Snapshot::borrow_raw(p.cast()) })
}

/// Write `f(snapshot)` through `out`: the shape of every single-value accessor.
///
/// # Safety
/// `snapshot` NULL or live; `out` NULL or writable; the value may borrow from the snapshot.
unsafe fn view<T>(snapshot: *const kvrelay_snapshot, out: *mut T, f: impl FnOnce(&Snapshot) -> T) -> kvrelay_status {
    guard(|| {
        let out = out_ptr(out)?;
        // SAFETY: forwarded contract.
        let s = unsafe { borrow(snapshot) }?;
        // SAFETY: checked non-NULL; the caller promises it is writable.
        unsafe { put(out, f(&s)) };
        Ok(())
    })
}

/// Take one more reference to `snapshot` and return it (for a child request, another rank, a
/// queue). NULL gives NULL. Cost: one atomic increment.
///
/// # Safety
/// `snapshot` must be NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_snapshot_retain(snapshot: *const kvrelay_snapshot) -> *mut kvrelay_snapshot {
    let mut r = std::ptr::null_mut();
    guard_void(|| {
        // SAFETY: forwarded contract.
        if let Ok(s) = unsafe { borrow(snapshot) } {
            r = export(Snapshot::clone(&s));
        }
    });
    r
}

/// Drop one reference; the snapshot is freed with its last reference. NULL does nothing. A
/// release too many is reported on stderr and ignored by debug builds of the library, and is
/// undefined behaviour in release builds.
///
/// # Safety
/// `snapshot` must be NULL or a live handle, which the caller gives up.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_snapshot_release(snapshot: *mut kvrelay_snapshot) {
    guard_void(|| {
        if snapshot.is_null() {
            return;
        }
        #[cfg(debug_assertions)]
        if !live::remove(snapshot as usize) {
            eprintln!("kvrelay: kvrelay_snapshot_release on a handle that is not live (released twice?); ignored");
            return;
        }
        // SAFETY: a live handle whose reference the caller gives up.
        drop(unsafe { Snapshot::from_raw(snapshot as *const u8) });
    });
}

/// The canonical compact JSON bytes (SPEC.md section 3). O(1), no copy.
///
/// # Safety
/// `snapshot` must be NULL or a live handle; `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_snapshot_canonical(
    snapshot: *const kvrelay_snapshot,
    out: *mut kvrelay_bytes,
) -> kvrelay_status {
    // SAFETY: forwarded contract.
    unsafe { view(snapshot, out, |s| kvrelay_bytes::of(s.canonical())) }
}

/// `protocol_version`, decoded. O(1), no copy.
///
/// # Safety
/// As `kvrelay_snapshot_canonical`.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_snapshot_protocol_version(
    snapshot: *const kvrelay_snapshot,
    out: *mut kvrelay_str,
) -> kvrelay_status {
    // SAFETY: forwarded contract.
    unsafe { view(snapshot, out, |s| kvrelay_str::of(s.protocol_version())) }
}

/// `message_id`, decoded. O(1), no copy.
///
/// # Safety
/// As `kvrelay_snapshot_canonical`.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_snapshot_message_id(
    snapshot: *const kvrelay_snapshot,
    out: *mut kvrelay_str,
) -> kvrelay_status {
    // SAFETY: forwarded contract.
    unsafe { view(snapshot, out, |s| kvrelay_str::of(s.message_id())) }
}

/// Number of actions (repeated action ids included).
///
/// # Safety
/// As `kvrelay_snapshot_canonical`.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_snapshot_action_count(
    snapshot: *const kvrelay_snapshot,
    out: *mut usize,
) -> kvrelay_status {
    // SAFETY: forwarded contract.
    unsafe { view(snapshot, out, |s| s.action_count()) }
}

/// The action at `index` (producer order) as borrowed views. `KVRELAY_ERR_OUT_OF_RANGE` past
/// the end. O(1), no copy.
///
/// # Safety
/// As `kvrelay_snapshot_canonical`.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_snapshot_action(
    snapshot: *const kvrelay_snapshot,
    index: usize,
    out: *mut kvrelay_action,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        let (s, size) = unsafe { (borrow(snapshot)?, output_size(out, "kvrelay_action")?) };
        let a = s.action(index).ok_or(KVRELAY_ERR_OUT_OF_RANGE)?;
        let v = kvrelay_action {
            size,
            index,
            id: kvrelay_str::of(a.id()),
            action_type: kvrelay_str::of(a.action_type()),
            version: kvrelay_str::of(a.version()),
            payload: kvrelay_bytes::of(a.payload()),
            canonical: kvrelay_bytes::of(a.canonical()),
        };
        // SAFETY: checked by `output_size`; writable for that size per the contract.
        unsafe { put_sized_at(out, size, v) };
        Ok(())
    })
}

/// Copy the envelope into the caller's buffer as an independent canonical JSON document.
/// `*len_out` receives the size needed; a buffer smaller than that gets nothing
/// (`KVRELAY_ERR_BUFFER_TOO_SMALL`). `(NULL, 0)` queries the size.
///
/// # Safety
/// `snapshot` NULL or live; `buf` NULL or writable for `cap` bytes; `len_out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_snapshot_decode(
    snapshot: *const kvrelay_snapshot,
    buf: *mut u8,
    cap: usize,
    len_out: *mut usize,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        let s = unsafe { borrow(snapshot) }?;
        // SAFETY: forwarded contract.
        unsafe { fill(s.canonical(), buf, cap, len_out) }
    })
}

/// Encode the envelope as MessagePack (SPEC.md section 4) into the caller's buffer, with the
/// same size-query convention as `kvrelay_snapshot_decode`. Allocates a temporary buffer (a
/// transport path, not a per-token one). Decode with `kvrelay_admission_decode_msgpack`.
///
/// # Safety
/// As `kvrelay_snapshot_decode`.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_snapshot_msgpack(
    snapshot: *const kvrelay_snapshot,
    buf: *mut u8,
    cap: usize,
    len_out: *mut usize,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        let s = unsafe { borrow(snapshot) }?;
        let mp = s.to_msgpack();
        // SAFETY: forwarded contract.
        unsafe { fill(&mp, buf, cap, len_out) }
    })
}

/// Serialize the one-action envelope of action `index` (the snapshot's protocol version,
/// message id and extra root metadata with only that action) into the caller's buffer, with the
/// size-query convention of `kvrelay_snapshot_decode`. Copies only here, at serialization.
///
/// # Safety
/// As `kvrelay_snapshot_decode`.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_snapshot_action_envelope(
    snapshot: *const kvrelay_snapshot,
    index: usize,
    buf: *mut u8,
    cap: usize,
    len_out: *mut usize,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        let s = unsafe { borrow(snapshot) }?;
        let view = s.action_envelope(index).ok_or(KVRELAY_ERR_OUT_OF_RANGE)?;
        // SAFETY: forwarded contract.
        unsafe { fill_pieces(&view.pieces(), buf, cap, len_out) }
    })
}

/// Whether this build of the library tracks live snapshot handles (debug builds), so that a
/// double release or a use after release is detected rather than undefined.
#[no_mangle]
pub extern "C" fn kvrelay_debug_checks() -> bool {
    cfg!(debug_assertions)
}
