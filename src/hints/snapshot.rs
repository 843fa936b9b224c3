//! Immutable, reference-counted snapshots of admitted envelopes.
//!
//! A snapshot is **one** heap allocation (an `Arc<[u8]>`) laid out as
//!
//! ```text
//! header (40 bytes) | action index (48 bytes per action) | canonical bytes | decoded strings
//! ```
//!
//! All integers are little-endian `u32` offsets into the same buffer, so every accessor is a few
//! loads with no allocation and no copying. The decoded-strings area holds the text of the
//! protocol version, message id and action id/type/version only where the canonical spelling
//! contains an escape (`\"`, `\\`, control characters); otherwise those accessors borrow the
//! canonical bytes directly.

use std::fmt;
use std::mem::MaybeUninit;
use std::sync::Arc;

use super::scan::{ActionRec, Field, Kind};
use super::strings::decode_string;

const H_TOTAL: usize = 0;
const H_NACT: usize = 4;
const H_CANON: usize = 8;
const H_PV: usize = 16;
const H_MSGID: usize = 24;
const H_ACTIONS: usize = 32;
const HEADER: usize = 40;

const A_OBJ: usize = 0;
const A_ID: usize = 8;
const A_TYPE: usize = 16;
const A_VER: usize = 24;
const A_PAYLOAD: usize = 32;
const A_ENDPOINT: usize = 40;
const ACT: usize = 48;

/// An admitted envelope, frozen. Cloning is one atomic increment; the bytes are shared by every
/// clone and never change. `Send + Sync`: hand it to other threads, queues, ranks and child
/// requests freely.
///
/// `Debug` and `Display` print sizes only, never contents; use [`Snapshot::canonical`] or
/// [`Snapshot::decode`] to serialize explicitly.
#[derive(Clone)]
pub struct Snapshot {
    buf: Arc<[u8]>,
}

/// One action of a snapshot, borrowed from it.
#[derive(Clone, Copy)]
pub struct Action<'a> {
    snap: &'a Snapshot,
    index: usize,
}

/// An immutable one-action envelope: the snapshot's protocol version, message id and extra root
/// metadata with only one of its actions. It shares the snapshot and copies nothing until it is
/// serialized.
#[derive(Clone)]
pub struct ActionEnvelope {
    snap: Snapshot,
    index: usize,
}

#[inline]
fn rd(b: &[u8], at: usize) -> usize {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]) as usize
}

/// Sequential writer over uninitialized memory that knows how much it has filled.
struct Fill<'a> {
    dst: &'a mut [MaybeUninit<u8>],
    at: usize,
}

impl Fill<'_> {
    fn put(&mut self, src: &[u8]) {
        let end = self.at + src.len();
        let dst = &mut self.dst[self.at..end];
        // SAFETY: `dst` and `src` have the same length (the slice above is bounds-checked and
        // its length is `src.len()`), `MaybeUninit<u8>` has the layout of `u8`, and the two
        // cannot overlap because `dst` is borrowed mutably from a fresh allocation.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_mut_ptr().cast::<u8>(), src.len()) };
        self.at = end;
    }
    /// Write `vals` as little-endian u32s, with one bounds check for the whole run (a header
    /// or an action record), not one per word.
    #[inline(always)]
    fn u32s<const N: usize>(&mut self, vals: [usize; N]) {
        let end = self.at + 4 * N;
        for (d, v) in self.dst[self.at..end].chunks_exact_mut(4).zip(vals) {
            for (x, b) in d.iter_mut().zip((v as u32).to_le_bytes()) {
                x.write(b);
            }
        }
        self.at = end;
    }
}

/// Decoded-string span for a string field: inside the canonical bytes when the canonical text
/// has no escape, else appended to `extra`. Returns (offset relative to the canonical start or
/// to the extra area, length, in_extra).
fn string_span(canon: &[u8], f: Field, extra: &mut Vec<u8>) -> (usize, usize, bool) {
    let inner = &canon[f.start as usize + 1..f.end as usize - 1];
    if f.escaped && inner.contains(&b'\\') {
        let at = extra.len();
        decode_string(inner, extra);
        (at, extra.len() - at, true)
    } else {
        (f.start as usize + 1, inner.len(), false)
    }
}

/// The scan results a snapshot is built from.
pub(crate) struct Parts<'a> {
    pub canon: &'a [u8],
    pub pv: Field,
    pub msgid: Field,
    pub actions: Field,
    pub recs: &'a [ActionRec],
}

impl Snapshot {
    /// Build the snapshot in exactly one allocation. `extra` is scratch for decoded strings.
    pub(crate) fn build(p: Parts<'_>, extra: &mut Vec<u8>) -> Snapshot {
        extra.clear();
        let n = p.recs.len();
        let canon_off = HEADER + ACT * n;
        let extra_off = canon_off + p.canon.len();
        // Resolve string spans first (this fills `extra`), then lay everything out.
        let mut spans: [(usize, usize, bool); 2] = [(0, 0, false); 2];
        spans[0] = string_span(p.canon, p.pv, extra);
        spans[1] = string_span(p.canon, p.msgid, extra);
        let abs = |s: (usize, usize, bool)| (if s.2 { extra_off + s.0 } else { canon_off + s.0 }, s.1);
        // The per-action string spans are resolved while writing; `extra` only grows, so
        // compute them into the scratch first to know the final size.
        let before_actions = extra.len();
        for r in p.recs {
            for f in [r.id, r.ty, r.ver] {
                let inner = &p.canon[f.start as usize + 1..f.end as usize - 1];
                if f.escaped && inner.contains(&b'\\') {
                    decode_string(inner, extra);
                }
            }
        }
        let total = extra_off + extra.len();
        let mut arc = Arc::<[u8]>::new_uninit_slice(total);
        let dst = Arc::get_mut(&mut arc).expect("a fresh Arc is unique");
        let mut w = Fill { dst, at: 0 };
        debug_assert_eq!(w.at, H_TOTAL);
        let ((pv_o, pv_l), (id_o, id_l)) = (abs(spans[0]), abs(spans[1]));
        let actions = (canon_off + p.actions.start as usize, (p.actions.end - p.actions.start) as usize);
        w.u32s([total, n, canon_off, p.canon.len(), pv_o, pv_l, id_o, id_l, actions.0, actions.1]);
        debug_assert_eq!(w.at, HEADER);
        // Walk the action strings in the same order as above to find their extra offsets.
        let mut x = before_actions;
        for r in p.recs {
            let mut strs = [(0usize, 0usize); 3];
            for (slot, f) in strs.iter_mut().zip([r.id, r.ty, r.ver]) {
                let inner_start = f.start as usize + 1;
                let inner = &p.canon[inner_start..f.end as usize - 1];
                *slot = if f.escaped && inner.contains(&b'\\') {
                    // The decoded text was appended above in this same order; its length
                    // follows from the canonical escapes without decoding again.
                    let (at, len) = (extra_off + x, decoded_len(inner));
                    x += len;
                    (at, len)
                } else {
                    (canon_off + inner_start, inner.len())
                };
            }
            let endpoint = if r.endpoint.kind == Kind::Missing {
                (canon_off, 0)
            } else {
                (canon_off + r.endpoint.start as usize, (r.endpoint.end - r.endpoint.start) as usize)
            };
            w.u32s([
                canon_off + r.start as usize,
                (r.end - r.start) as usize,
                strs[0].0,
                strs[0].1,
                strs[1].0,
                strs[1].1,
                strs[2].0,
                strs[2].1,
                canon_off + r.payload.start as usize,
                (r.payload.end - r.payload.start) as usize,
                endpoint.0,
                endpoint.1,
            ]);
        }
        debug_assert_eq!(x, extra.len());
        w.put(p.canon);
        w.put(extra);
        assert_eq!(w.at, total, "every byte of the snapshot is written");
        // SAFETY: `Fill` wrote bytes `0..w.at` sequentially and the assertion above checked
        // that `w.at == total`, the length of the slice, so every element is initialized.
        let buf = unsafe { arc.assume_init() };
        Snapshot { buf }
    }

    #[inline]
    fn span(&self, at: usize) -> &[u8] {
        let (o, l) = (rd(&self.buf, at), rd(&self.buf, at + 4));
        &self.buf[o..o + l]
    }

    #[inline]
    fn str_at(&self, at: usize) -> &str {
        let b = self.span(at);
        debug_assert!(std::str::from_utf8(b).is_ok());
        // SAFETY: every string span points either inside a JSON string of the canonical bytes
        // (which the scanner validated as UTF-8 per RFC 3629, and which is cut at quote
        // boundaries, never inside a multi-byte sequence) or at text `decode_string` produced
        // from such a string (UTF-8 by construction); snapshots are immutable after `build`.
        unsafe { std::str::from_utf8_unchecked(b) }
    }

    /// The canonical compact encoding (SPEC.md section 3). O(1), no copy.
    #[inline]
    pub fn canonical(&self) -> &[u8] {
        self.span(H_CANON)
    }

    /// Size of the canonical bytes.
    #[inline]
    pub fn canonical_len(&self) -> usize {
        rd(&self.buf, H_CANON + 4)
    }

    /// `protocol_version`, decoded (always `"0.1"` for snapshots of this version).
    pub fn protocol_version(&self) -> &str {
        self.str_at(H_PV)
    }

    /// `message_id`, decoded. O(1), no copy.
    pub fn message_id(&self) -> &str {
        self.str_at(H_MSGID)
    }

    /// Number of actions (repeated action ids included).
    #[inline]
    pub fn action_count(&self) -> usize {
        rd(&self.buf, H_NACT)
    }

    /// The action at position `i` in producer order, or `None` past the end.
    pub fn action(&self, i: usize) -> Option<Action<'_>> {
        (i < self.action_count()).then_some(Action { snap: self, index: i })
    }

    /// All actions in producer order.
    pub fn actions(&self) -> impl ExactSizeIterator<Item = Action<'_>> + '_ {
        (0..self.action_count()).map(move |i| Action { snap: self, index: i })
    }

    /// The canonical bytes of the `actions` array, brackets included.
    pub fn actions_bytes(&self) -> &[u8] {
        self.span(H_ACTIONS)
    }

    /// A one-action envelope view of action `i`; shares this snapshot.
    pub fn action_envelope(&self, i: usize) -> Option<ActionEnvelope> {
        (i < self.action_count()).then(|| ActionEnvelope { snap: self.clone(), index: i })
    }

    /// An independent copy of the envelope as a `serde_json::Value` (allocates a tree: a slow
    /// path for tools and tests, not for the request path).
    pub fn decode(&self) -> serde_json::Value {
        let mut de = serde_json::Deserializer::from_slice(self.canonical());
        de.disable_recursion_limit();
        serde::Deserialize::deserialize(&mut de).expect("canonical bytes are valid JSON")
    }

    /// Whether two handles share the same allocation.
    pub fn ptr_eq(a: &Snapshot, b: &Snapshot) -> bool {
        Arc::ptr_eq(&a.buf, &b.buf)
    }

    /// Number of handles sharing this snapshot (for diagnostics and tests).
    pub fn handle_count(&self) -> usize {
        Arc::strong_count(&self.buf)
    }

    /// Leak one handle as a thin pointer to the snapshot's buffer (for the C ABI). The buffer
    /// begins with its own total length, which [`Snapshot::from_raw`] reads back.
    pub(crate) fn into_raw(self) -> *const u8 {
        Arc::into_raw(self.buf).cast::<u8>()
    }

    /// Rebuild a handle from [`Snapshot::into_raw`].
    ///
    /// # Safety
    /// `p` must come from `into_raw` and the handle it stands for must not have been released.
    pub(crate) unsafe fn from_raw(p: *const u8) -> Snapshot {
        // SAFETY: per the contract, `p` points at a live buffer whose first four bytes are its
        // total length (written first by `build`).
        let len = unsafe { rd(std::slice::from_raw_parts(p, 4), 0) };
        let fat = std::ptr::slice_from_raw_parts(p, len);
        // SAFETY: `fat` has the address and length of the slice `into_raw` leaked, so it is the
        // same fat pointer, and the caller gives up that leaked handle to us.
        Snapshot { buf: unsafe { Arc::from_raw(fat) } }
    }

    /// Borrow a leaked handle without consuming it.
    ///
    /// # Safety
    /// As [`Snapshot::from_raw`]; the returned value must not be dropped (it is wrapped in
    /// `ManuallyDrop`).
    pub(crate) unsafe fn borrow_raw(p: *const u8) -> std::mem::ManuallyDrop<Snapshot> {
        // SAFETY: forwarded contract; ManuallyDrop keeps the count unchanged.
        std::mem::ManuallyDrop::new(unsafe { Snapshot::from_raw(p) })
    }
}

/// Length of the decoded text of a canonical string's inside (escapes: `\"`, `\\`, the five
/// short control escapes and `\u00XX`; each decodes to one byte).
fn decoded_len(inner: &[u8]) -> usize {
    let mut n = 0;
    let mut i = 0;
    while i < inner.len() {
        if inner[i] == b'\\' {
            i += if inner[i + 1] == b'u' { 6 } else { 2 };
        } else {
            i += 1;
        }
        n += 1;
    }
    n
}

impl fmt::Debug for Snapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Snapshot")
            .field("canonical_len", &self.canonical_len())
            .field("actions", &self.action_count())
            .finish_non_exhaustive()
    }
}

impl fmt::Display for Snapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "kv hint snapshot ({} bytes, {} actions)", self.canonical_len(), self.action_count())
    }
}

impl PartialEq for Snapshot {
    /// Two snapshots are equal when their canonical bytes are.
    fn eq(&self, other: &Snapshot) -> bool {
        self.canonical() == other.canonical()
    }
}
impl Eq for Snapshot {}

impl<'a> Action<'a> {
    fn base(&self) -> usize {
        HEADER + ACT * self.index
    }
    /// Position in the envelope's `actions` array.
    pub fn index(&self) -> usize {
        self.index
    }
    /// `action_id`, decoded.
    pub fn id(&self) -> &'a str {
        self.snap.str_at(self.base() + A_ID)
    }
    /// `action_type`, decoded.
    pub fn action_type(&self) -> &'a str {
        self.snap.str_at(self.base() + A_TYPE)
    }
    /// `action_version`, decoded.
    pub fn version(&self) -> &'a str {
        self.snap.str_at(self.base() + A_VER)
    }
    /// The canonical bytes of `payload` (a JSON object). Admission never interprets it.
    pub fn payload(&self) -> &'a [u8] {
        self.snap.span(self.base() + A_PAYLOAD)
    }
    /// The canonical bytes of the value of the payload's top-level `source_control_endpoint`
    /// member (with quotes if it is a string), or `None` when the payload has no such member.
    /// Located during admission, never interpreted there; O(1), no copy.
    pub fn endpoint_value(&self) -> Option<&'a [u8]> {
        let v = self.snap.span(self.base() + A_ENDPOINT);
        (!v.is_empty()).then_some(v)
    }
    /// The canonical bytes of the whole action object, extra members included.
    pub fn canonical(&self) -> &'a [u8] {
        self.snap.span(self.base() + A_OBJ)
    }
}

impl fmt::Debug for Action<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Action")
            .field("index", &self.index)
            .field("bytes", &self.canonical().len())
            .finish_non_exhaustive()
    }
}

impl ActionEnvelope {
    /// The snapshot this view shares.
    pub fn snapshot(&self) -> &Snapshot {
        &self.snap
    }
    /// The action this envelope carries.
    pub fn action(&self) -> Action<'_> {
        Action { snap: &self.snap, index: self.index }
    }
    /// The three borrowed pieces whose concatenation is the canonical encoding: the root up to
    /// and including `"actions":[`, the action, and `]` with the rest of the root.
    pub fn pieces(&self) -> [&[u8]; 3] {
        let c = self.snap.canonical();
        let a = self.snap.span(H_ACTIONS);
        // offsets of the actions array inside the canonical bytes
        let a_start = a.as_ptr() as usize - c.as_ptr() as usize;
        let a_end = a_start + a.len();
        [&c[..a_start + 1], self.action().canonical(), &c[a_end - 1..]]
    }
    /// Size of the canonical encoding, without building it.
    pub fn canonical_len(&self) -> usize {
        self.pieces().iter().map(|p| p.len()).sum()
    }
    /// Append the canonical encoding to `out` (the only copy this view ever makes).
    pub fn write_canonical(&self, out: &mut Vec<u8>) {
        for p in self.pieces() {
            out.extend_from_slice(p);
        }
    }
    /// The canonical encoding as a new vector.
    pub fn to_canonical(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.canonical_len());
        self.write_canonical(&mut v);
        v
    }
}

impl fmt::Debug for ActionEnvelope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ActionEnvelope").field("index", &self.index).finish_non_exhaustive()
    }
}
