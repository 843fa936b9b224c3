//! The one boundary helper every exported function goes through, and the checked conversions
//! of C arguments.

use std::cell::RefCell;
use std::ffi::{c_char, CStr};
use std::fmt::Display;
use std::panic::{catch_unwind, AssertUnwindSafe};

use super::status::kvrelay_status::{self, *};
use super::status::kvrelay_status_message;

thread_local! {
    /// What the last failing call on this thread said (NUL-free text; see
    /// `kvrelay_last_error_message`).
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
    /// The detail of the failure the current call is about to return.
    static PENDING: RefCell<Option<String>> = const { RefCell::new(None) };
}

fn message(s: kvrelay_status) -> &'static str {
    // SAFETY: kvrelay_status_message returns a static NUL-terminated ASCII string.
    unsafe { CStr::from_ptr(kvrelay_status_message(s as i32)) }.to_str().unwrap_or("")
}

/// Return `status` with a detail that says why (which driver call and `CUresult`, which value
/// was refused); the guard publishes it as the thread's last error. Never put hint bytes in it.
pub(crate) fn with_detail(status: kvrelay_status, detail: impl Display) -> kvrelay_status {
    let text = format!("{}: {detail}", message(status)).replace('\0', " ");
    PENDING.with(|p| *p.borrow_mut() = Some(text));
    status
}

/// Publish the failure `s` of the call ending now as the thread's last error (its detail when
/// one was recorded, else the status's message). `KVRELAY_ERR_BUFFER_TOO_SMALL` is the size
/// query's answer, not a failure: it leaves the last error as it was.
fn publish(s: kvrelay_status) {
    let pending = PENDING.with(|p| p.borrow_mut().take());
    if s == KVRELAY_ERR_BUFFER_TOO_SMALL {
        return;
    }
    let text = pending.unwrap_or_else(|| message(s).to_string());
    LAST_ERROR.with(|e| *e.borrow_mut() = text);
}

/// Record `text` as the thread's last error although the call succeeds (a provider's refusal
/// inside `kvrelay_orchestrate`, which is a decision, not a failure of the call).
pub(crate) fn note_last_error(text: String) {
    LAST_ERROR.with(|e| *e.borrow_mut() = text.replace('\0', " "));
}

/// The thread's last error text, for `kvrelay_last_error_message`.
pub(crate) fn last_error<R>(f: impl FnOnce(&str) -> R) -> R {
    LAST_ERROR.with(|e| f(&e.borrow()))
}

/// Run `f`, turning its error into a status and any panic into `KVRELAY_ERR_PANIC`, and record
/// a failure as this thread's last error. `f` must write out-parameters only after everything
/// that can fail has succeeded.
pub(crate) fn guard(f: impl FnOnce() -> Result<(), kvrelay_status>) -> kvrelay_status {
    PENDING.with(|p| p.borrow_mut().take());
    // AssertUnwindSafe: on a panic nothing observes the closure's state again; outputs are
    // written last, so a caught panic leaves them untouched.
    let s = match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => return KVRELAY_OK,
        Ok(Err(s)) => s,
        Err(_) => KVRELAY_ERR_PANIC,
    };
    publish(s);
    s
}

/// Run `f` for a function that returns nothing; a panic is swallowed.
pub(crate) fn guard_void(f: impl FnOnce()) {
    let _ = catch_unwind(AssertUnwindSafe(f));
}

/// Free an owned handle made by `Box::into_raw`; NULL does nothing; a panic in a destructor is
/// swallowed (no panic crosses the boundary).
///
/// # Safety
/// `p` must be NULL or come from `Box::into_raw` for this `T` and not have been freed.
pub(crate) unsafe fn free_box<T>(p: *mut T) {
    guard_void(|| {
        if !p.is_null() {
            // SAFETY: per the contract, a live box of this type, given up by the caller.
            drop(unsafe { Box::from_raw(p) });
        }
    });
}

/// `(ptr, len)` as a slice; `(NULL, 0)` is empty, `(NULL, n > 0)` is invalid.
///
/// # Safety
/// A non-NULL `ptr` must be valid for reads of `len` bytes for `'a`.
pub(crate) unsafe fn bytes<'a>(ptr: *const u8, len: usize) -> Result<&'a [u8], kvrelay_status> {
    if ptr.is_null() {
        return if len == 0 { Ok(&[]) } else { Err(KVRELAY_ERR_INVALID_ARGUMENT) };
    }
    if len > isize::MAX as usize {
        return Err(KVRELAY_ERR_INVALID_ARGUMENT);
    }
    // SAFETY: non-NULL, length within isize::MAX, and the caller promises `len` readable bytes.
    Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
}

/// `(ptr, len)` as UTF-8 text.
///
/// # Safety
/// As [`bytes`].
pub(crate) unsafe fn text<'a>(ptr: *const u8, len: usize) -> Result<&'a str, kvrelay_status> {
    // SAFETY: forwarded contract.
    let b = unsafe { bytes(ptr, len) }?;
    std::str::from_utf8(b).map_err(|_| KVRELAY_ERR_INVALID_UTF8)
}

/// A required input pointer as a reference.
///
/// # Safety
/// A non-NULL `p` must point to a live, properly aligned `T` for `'a`.
pub(crate) unsafe fn input<'a, T>(p: *const T) -> Result<&'a T, kvrelay_status> {
    // SAFETY: forwarded contract; NULL is refused.
    unsafe { p.as_ref() }.ok_or(KVRELAY_ERR_NULL)
}

/// A required mutable pointer as a reference.
///
/// # Safety
/// A non-NULL `p` must point to a live, properly aligned `T` for `'a` that nothing else
/// accesses meanwhile.
pub(crate) unsafe fn input_mut<'a, T>(p: *mut T) -> Result<&'a mut T, kvrelay_status> {
    // SAFETY: forwarded contract; NULL is refused.
    unsafe { p.as_mut() }.ok_or(KVRELAY_ERR_NULL)
}

/// Check that a required out-pointer is not NULL (write through it later, on success).
pub(crate) fn out_ptr<T>(p: *mut T) -> Result<*mut T, kvrelay_status> {
    if p.is_null() {
        Err(KVRELAY_ERR_NULL)
    } else {
        Ok(p)
    }
}

/// Write `v` through an out-pointer checked by [`out_ptr`].
///
/// # Safety
/// `p` must be valid for a write of `T` (it may be uninitialized).
pub(crate) unsafe fn put<T>(p: *mut T, v: T) {
    // SAFETY: forwarded contract; `write` does not read or drop the old contents.
    unsafe { p.write(v) }
}

/// Copy `src` into the caller's buffer `(buf, cap)`, storing its size in `*len_out` first.
/// Too small a buffer writes nothing else and fails with `KVRELAY_ERR_BUFFER_TOO_SMALL`; `buf`
/// may be NULL when `cap` is 0 (a size query).
///
/// # Safety
/// `len_out` must be valid for a write; a non-NULL `buf` must be valid for `cap` bytes of
/// writes.
pub(crate) unsafe fn fill(src: &[u8], buf: *mut u8, cap: usize, len_out: *mut usize) -> Result<(), kvrelay_status> {
    // SAFETY: forwarded contract.
    unsafe { fill_pieces(&[src], buf, cap, len_out) }
}

/// [`fill`] for output made of several borrowed pieces, written one after the other (so a
/// value assembled from parts is copied only into the caller's buffer).
///
/// # Safety
/// As [`fill`].
pub(crate) unsafe fn fill_pieces(
    pieces: &[&[u8]],
    buf: *mut u8,
    cap: usize,
    len_out: *mut usize,
) -> Result<(), kvrelay_status> {
    let len_out = out_ptr(len_out)?;
    if buf.is_null() && cap != 0 {
        return Err(KVRELAY_ERR_INVALID_ARGUMENT);
    }
    let need: usize = pieces.iter().map(|p| p.len()).sum();
    // SAFETY: `len_out` is non-NULL and the caller promises it is writable.
    unsafe { put(len_out, need) };
    if cap < need {
        return Err(KVRELAY_ERR_BUFFER_TOO_SMALL);
    }
    let mut at = 0;
    for p in pieces.iter().filter(|p| !p.is_empty()) {
        // SAFETY: `buf` is non-NULL here (cap >= need > 0), writable for `cap >= need` bytes per
        // the contract, and cannot overlap the pieces, which kvrelay owns.
        unsafe { std::ptr::copy_nonoverlapping(p.as_ptr(), buf.add(at), p.len()) };
        at += p.len();
    }
    Ok(())
}

/// A C struct whose first field is `size_t size` (`sizeof` the struct as the caller's header
/// declares it), which grows only by appending fields.
///
/// # Safety
/// The implementor must be `#[repr(C)]`, its first field a `usize` holding the caller's
/// size, and all-zero bytes must be a valid value (NULL pointers, `None` callbacks, zeros):
/// what the caller's older struct lacks reads as zero.
pub(crate) unsafe trait SizedStruct: Copy {
    /// The size of the struct's first version: a caller's smaller size is refused.
    const FIRST_SIZE: usize;
}

/// A sized struct as the library reads it: the caller's fields, zeros for what its header
/// lacks.
pub(crate) struct SizedCopy<T> {
    /// The caller's fields, zero past its `size`.
    pub value: T,
    /// The caller's `size`.
    pub size: usize,
    /// A larger struct than this library's whose extra bytes are not all zero: the caller set a
    /// field this library does not know.
    pub unknown_fields: bool,
}

impl<T: SizedStruct> SizedCopy<T> {
    /// Whether the library can honour the caller's struct: at least the first version's size,
    /// and no field set that this library does not know (a newer header's field is accepted
    /// only while it is zero). Otherwise `KVRELAY_ERR_INVALID_ARGUMENT`, saying why.
    pub fn check(&self, what: &str) -> Result<(), kvrelay_status> {
        if self.size < T::FIRST_SIZE {
            return Err(with_detail(
                KVRELAY_ERR_INVALID_ARGUMENT,
                format!("{what}.size is {}, smaller than its first version's {}", self.size, T::FIRST_SIZE),
            ));
        }
        if self.unknown_fields {
            return Err(with_detail(
                KVRELAY_ERR_INVALID_ARGUMENT,
                format!(
                    "{what}.size is {}: a newer header's fields past this library's {} bytes are set",
                    self.size,
                    std::mem::size_of::<T>()
                ),
            ));
        }
        Ok(())
    }
}

/// Read a sized struct the way extensible structs are read across an ABI: `size` first, then
/// only the bytes the caller has (never past its struct), zeros for fields its header lacks,
/// and any bytes past this library's struct checked for zero. A size below the first
/// version's reads nothing but the size (the copy is all zeros: no callback of it runs). Fails only on NULL; the caller
/// then decides with [`SizedCopy::check`] (after taking ownership of what the copy holds, so a
/// refused struct's `destroy` still runs when the caller's struct has one).
///
/// # Safety
/// A non-NULL `p` must be aligned for `T` and readable for `size` bytes, `size` being its
/// first field.
pub(crate) unsafe fn read_sized<T: SizedStruct>(p: *const T) -> Result<SizedCopy<T>, kvrelay_status> {
    if p.is_null() {
        return Err(KVRELAY_ERR_NULL);
    }
    if !p.is_aligned() {
        return Err(with_detail(KVRELAY_ERR_INVALID_ARGUMENT, "a misaligned struct"));
    }
    // SAFETY: non-NULL and aligned; every sized struct starts with its `size_t size`, which the
    // caller's struct always has.
    let size = unsafe { p.cast::<usize>().read() };
    let mine = std::mem::size_of::<T>();
    // Every real version's size is a multiple of the struct's alignment (sizeof always is), so
    // rounding down never drops a whole field of the caller's and never copies half of one
    // (a size that is no version's cannot leave half a pointer behind). A size below the first
    // version's is no version at all: nothing of it is read.
    let align = std::mem::align_of::<T>();
    let copy = if size < T::FIRST_SIZE { 0 } else { size.min(mine) / align * align };
    let mut value = std::mem::MaybeUninit::<T>::zeroed();
    // SAFETY: the caller's struct is readable for `size >= copy` bytes and ours writable for
    // `mine >= copy`; they cannot overlap (ours is a local).
    unsafe { std::ptr::copy_nonoverlapping(p.cast::<u8>(), value.as_mut_ptr().cast::<u8>(), copy) };
    let unknown_fields = size > mine && {
        // SAFETY: readable for `size` bytes per the contract, of which these are the tail.
        let tail = unsafe { std::slice::from_raw_parts(p.cast::<u8>().add(mine), size - mine) };
        tail.iter().any(|&b| b != 0)
    };
    // SAFETY: all-zero bytes are a valid T (the trait's contract) and the copied prefix holds
    // the caller's own valid fields.
    let value = unsafe { value.assume_init() };
    Ok(SizedCopy { value, size, unknown_fields })
}

/// The largest `size` a caller may declare for a sized struct: far above any version's, and a
/// bound on the bytes the library zeroes or checks past its own struct.
pub(crate) const MAX_SIZED: usize = 4096;

/// Implement [`SizedStruct`] for structs whose first version is the one of this ABI epoch
/// (0.4.0): their first size is their size here until a field is appended. Each also gets a
/// `Default`: all zeros with `size` set to this library's, what a Rust caller passes as an
/// output to fill (or starts an input from).
macro_rules! sized_since_epoch {
    ($($t:ty),* $(,)?) => {$(
        // SAFETY: `#[repr(C)]` with `size: usize` first; all-zero bytes are a valid value
        // (integers, NULL pointers, `None` callbacks, `false`).
        unsafe impl $crate::ffi::boundary::SizedStruct for $t {
            const FIRST_SIZE: usize = std::mem::size_of::<$t>();
        }
        impl Default for $t {
            fn default() -> Self {
                // SAFETY: all-zero bytes are a valid value of this struct (the impl above).
                let mut v: $t = unsafe { std::mem::zeroed() };
                v.size = std::mem::size_of::<$t>();
                v
            }
        }
    )*};
}
pub(crate) use sized_since_epoch;

/// The `size` a sized struct of the library's own carries: `sizeof` here.
pub(crate) const fn own_size<T: SizedStruct>() -> usize {
    std::mem::size_of::<T>()
}

/// The caller's `size` of the sized output struct at `out`, checked: at least the first
/// version's, a multiple of the struct's alignment, at most [`MAX_SIZED`].
///
/// # Safety
/// A non-NULL `out` must be aligned and readable for its first field.
pub(crate) unsafe fn output_size<T: SizedStruct>(out: *const T, what: &str) -> Result<usize, kvrelay_status> {
    if out.is_null() {
        return Err(KVRELAY_ERR_NULL);
    }
    if !out.is_aligned() {
        return Err(with_detail(KVRELAY_ERR_INVALID_ARGUMENT, format!("a misaligned {what}")));
    }
    // SAFETY: non-NULL, aligned, and every sized struct starts with its `size_t size`.
    let size = unsafe { out.cast::<usize>().read() };
    if size < T::FIRST_SIZE || size % std::mem::align_of::<T>() != 0 || size > MAX_SIZED {
        return Err(with_detail(
            KVRELAY_ERR_INVALID_ARGUMENT,
            format!(
                "{what}.size is {size}: set it to sizeof({what}) (this library's is {}, its first version's {})",
                std::mem::size_of::<T>(),
                T::FIRST_SIZE
            ),
        ));
    }
    Ok(size)
}

/// Write the sized output `value` into the caller's struct at `out`, of `size` bytes (its
/// `size` field, checked by [`output_size`]): the fields the caller's header has, its `size`
/// kept, zeros for fields of a newer header that this library lacks, nothing past `size`.
///
/// # Safety
/// `out` as for [`output_size`], which returned `size`, and writable for `size` bytes.
pub(crate) unsafe fn put_sized_at<T: SizedStruct>(out: *mut T, size: usize, mut value: T) {
    let mine = std::mem::size_of::<T>();
    let n = size.min(mine);
    // SAFETY: the first field of a sized struct is its `usize` size.
    unsafe { (&mut value as *mut T).cast::<usize>().write(size) };
    // SAFETY: `out` is writable for `size >= n` bytes, `value` is a live `T` of `mine >= n`
    // bytes, and they do not overlap (ours is a local); bytes past `n` lie within `size`.
    unsafe {
        std::ptr::copy_nonoverlapping((&value as *const T).cast::<u8>(), out.cast::<u8>(), n);
        std::ptr::write_bytes(out.cast::<u8>().add(n), 0, size - n);
    }
}

/// [`output_size`] then [`put_sized_at`]: write one sized output.
///
/// # Safety
/// `out` NULL, or aligned and writable for the `size` it declares.
pub(crate) unsafe fn put_sized<T: SizedStruct>(out: *mut T, value: T, what: &str) -> Result<(), kvrelay_status> {
    // SAFETY: forwarded contract.
    let size = unsafe { output_size(out, what) }?;
    // SAFETY: as checked.
    unsafe { put_sized_at(out, size, value) };
    Ok(())
}

/// Read and check a sized input (`read_sized` then `check`), for structs without anything to
/// release on refusal.
///
/// # Safety
/// As [`read_sized`].
pub(crate) unsafe fn input_sized<T: SizedStruct>(p: *const T, what: &str) -> Result<T, kvrelay_status> {
    // SAFETY: forwarded contract.
    let c = unsafe { read_sized(p) }?;
    c.check(what)?;
    Ok(c.value)
}

/// Copy a counters struct of `u64` fields into the caller's `out`, of which the caller knows
/// `size` bytes: the fields it knows, nothing past `size`, and zeros for fields a newer
/// caller has that this library lacks. `size` must be a non-zero multiple of 8.
///
/// # Safety
/// `T` must be `#[repr(C)]` with `u64` fields only; `out` NULL or writable for `size` bytes.
pub(crate) unsafe fn put_counters<T>(out: *mut T, size: usize, value: &T) -> Result<(), kvrelay_status> {
    let out = out_ptr(out)?;
    if size == 0 || size % 8 != 0 {
        return Err(with_detail(KVRELAY_ERR_INVALID_ARGUMENT, format!("a counters size of {size} bytes")));
    }
    let n = size.min(std::mem::size_of::<T>());
    // SAFETY: `out` is writable for `size` bytes (contract) and `n <= size`; `value` is a live
    // `T` of `size_of::<T>() >= n` bytes; the two do not overlap (ours is the library's). Bytes
    // past `n` (a newer caller's fields) are zeroed, within `size`.
    unsafe {
        std::ptr::copy_nonoverlapping((value as *const T).cast::<u8>(), out.cast::<u8>(), n);
        std::ptr::write_bytes(out.cast::<u8>().add(n), 0, size - n);
    }
    Ok(())
}

/// What the last failing kvrelay call **on this thread** said, NUL-terminated: the status's
/// message and, where kvrelay knows more, why (the driver call and its `CUresult`, the value a
/// configuration refused, ...). It never contains bytes of a hint. A provider's refusal inside
/// `kvrelay_orchestrate` is recorded too (that call succeeds: the request keeps its paired
/// path). Other calls that succeed leave it as it was, and so does `KVRELAY_ERR_BUFFER_TOO_SMALL` (the size query's answer); empty before
/// the first failure. Size-query convention of `kvrelay_snapshot_decode`: `*len_out` gets the
/// size needed, NUL included; a smaller buffer gets nothing. Reading it does not change it.
///
/// # Safety
/// `buf` NULL or writable for `cap` bytes; `len_out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_last_error_message(
    buf: *mut c_char,
    cap: usize,
    len_out: *mut usize,
) -> kvrelay_status {
    let r = std::panic::catch_unwind(|| {
        last_error(|text| {
            let pieces: [&[u8]; 2] = [text.as_bytes(), b"\0"];
            // SAFETY: forwarded contract; the text is copied before anything else runs.
            unsafe { fill_pieces(&pieces, buf.cast(), cap, len_out) }
        })
    });
    match r {
        Ok(Ok(())) => kvrelay_status::KVRELAY_OK,
        Ok(Err(s)) => s,
        Err(_) => kvrelay_status::KVRELAY_ERR_PANIC,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panics_become_a_status() {
        let s = guard(|| panic!("boom"));
        assert_eq!(s, KVRELAY_ERR_PANIC);
        guard_void(|| panic!("boom"));
        assert_eq!(guard(|| Err(KVRELAY_ERR_NULL)), KVRELAY_ERR_NULL);
        assert_eq!(guard(|| Ok(())), KVRELAY_OK);
    }

    #[test]
    fn byte_views() {
        // SAFETY: NULL pointers with the lengths under test; nothing is dereferenced.
        unsafe {
            assert_eq!(bytes(std::ptr::null(), 0), Ok(&[][..]));
            assert_eq!(bytes(std::ptr::null(), 3), Err(KVRELAY_ERR_INVALID_ARGUMENT));
        }
        let bad = [0xffu8, 0xfe];
        // SAFETY: a live local array of the given length.
        assert_eq!(unsafe { text(bad.as_ptr(), 2) }, Err(KVRELAY_ERR_INVALID_UTF8));
    }

    #[test]
    fn fill_reports_the_needed_size_and_writes_nothing_when_short() {
        let mut len = 0usize;
        let mut buf = [7u8; 4];
        // SAFETY: local buffers of the stated sizes.
        unsafe {
            assert_eq!(fill(b"hello", buf.as_mut_ptr(), 4, &mut len), Err(KVRELAY_ERR_BUFFER_TOO_SMALL));
            assert_eq!((len, buf), (5, [7; 4]));
            assert_eq!(fill(b"hello", std::ptr::null_mut(), 0, &mut len), Err(KVRELAY_ERR_BUFFER_TOO_SMALL));
            assert_eq!(fill(b"hello", std::ptr::null_mut(), 9, &mut len), Err(KVRELAY_ERR_INVALID_ARGUMENT));
            assert_eq!(fill(b"", std::ptr::null_mut(), 0, &mut len), Ok(()));
            assert_eq!(fill(b"hi", buf.as_mut_ptr(), 4, std::ptr::null_mut()), Err(KVRELAY_ERR_NULL));
            assert_eq!(fill(b"hi", buf.as_mut_ptr(), 4, &mut len), Ok(()));
            assert_eq!((len, &buf[..2]), (2, &b"hi"[..]));
        }
    }
}
