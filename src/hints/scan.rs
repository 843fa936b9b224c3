//! The one-pass validator and canonical writer.
//!
//! [`scan`] walks the raw bytes of one JSON value exactly once and, in the same pass:
//! - checks RFC 8259 well-formedness, UTF-8 (RFC 3629, no overlongs, no encoded surrogates),
//!   escapes and surrogate pairs, the nesting depth and duplicate member names;
//! - checks the integer range (-2^63 ..= 2^64-1) and that every other number is finite as an f64
//!   (these are SPEC.md step 8 and are *noted*, not fatal, because steps 5-7 outrank them);
//! - produces the canonical compact encoding (SPEC.md section 3) *lazily*: as long as the input
//!   is already canonical nothing is written; at the first difference (whitespace, an escape that
//!   canonical form spells differently, `-0`, a float not in shortest form) the verbatim run
//!   before it is copied to `Scratch::out` in one piece and the replacement appended. An input
//!   that is already canonical is therefore never re-rendered: the snapshot copies it directly.
//!   Writing stops once the output passes `max_bytes`; only the size is counted after that;
//! - records the index of the protocol 0.1 fields (root members and each action's members) as
//!   spans of the canonical bytes.
//!
//! Cost: O(n) in the input plus O(k log k) per object of k members for duplicate detection:
//! each name gets a cheap hash (length, first and last eight bytes) when it is read and sets one
//! bit of a 128-bit filter in its object; only an object in which a bit repeats runs the check
//! when it closes (16 members or fewer: hashes pairwise; more: sorted by hash then bytes; bytes
//! compared only where hashes are equal). No heap allocation: everything goes to the caller's
//! [`Scratch`], whose buffers keep their capacity between calls.
//!
//! Where the instructions go, per token (cachegrind counts in `benches/RESULTS.md`):
//! - strings: one or two 16-byte classifications when the closing quote comes first among the
//!   next 32 bytes (names and short values), otherwise 16 bytes per step, with the escapes that
//!   canonical form keeps (`\"`, `\\`, `\n`, ...) and runs of non-ASCII characters (one 32-bit
//!   load per character) handled in the same loop; runs of `\uXXXX` escapes are decoded by table
//!   straight into the output (one 32-bit store per character);
//! - numbers: integers and decimals already in ryu's shortest form are recognised from their
//!   digits (no parse, no formatting); others are parsed and formatted with ryu; lists of plain
//!   integers (block hashes) go 16 bytes at a time, compact or spaced (`, `);
//! - between tokens: one load and one compare (every token starts above space); one space
//!   before a token is dropped in the same test, longer runs are skipped 16 bytes
//!   at a time, and the verbatim run before each is copied with two 16-byte moves when it is
//!   32 bytes or shorter (one `memcpy` otherwise).
//!
//! The x86-64 paths use SSE2 only (the baseline); `--cfg kvrelay_portable` and other targets
//! take byte-at-a-time or SWAR paths with the same results.
//!
//! The scanner is iterative (an explicit stack in the scratch), so a large `max_depth` cannot
//! overflow the thread's stack. The innermost container's frame is reached through one pointer
//! to the stack's last element (`Scanner::top`, set after every push and pop), not through the
//! stack's length for every token, and frames are never copied once written (a copy right
//! after the narrow writes of a member stalls on store forwarding; measured in RESULTS.md).

use super::detail::Detail;
use super::lex::{
    count_digits, digits_le, first_special32, skip_digits, skip_plain, skip_ws, BSLASH, CTRL, HIGH, QUOTE, STR_CLASS,
};
use super::strings::{canonical_char, decode_string, unicode_escape_at, utf8_seq, utf8_word};

/// The JSON kind of a recorded value; `Missing` when the member was not present.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub(crate) enum Kind {
    #[default]
    Missing,
    Null,
    Bool,
    Number,
    String,
    Array,
    Object,
}

/// A recorded member value: its kind and its span `[start, end)` in the canonical bytes.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Field {
    pub kind: Kind,
    pub start: u32,
    pub end: u32,
    /// For strings: the raw text had an escape. Without one the canonical text has no
    /// backslash either (raw strings cannot hold `"`, `\` or control bytes unescaped), so the
    /// snapshot need not look for escapes to decode.
    pub escaped: bool,
}

/// One element of the root `actions` array that is an object.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ActionRec {
    pub start: u32,
    pub end: u32,
    pub id: Field,
    pub ty: Field,
    pub ver: Field,
    pub payload: Field,
    /// The payload's top-level `source_control_endpoint` member value, located (never
    /// interpreted) so that a consumer finds it without walking the payload.
    pub endpoint: Field,
}

/// A member name of an open object: decoded bytes, either in the input (no escapes) or in
/// `Scratch::keybuf` (the key had escapes and was decoded there).
#[derive(Clone, Copy)]
struct KeyRef {
    in_buf: bool,
    start: u32,
    len: u32,
    /// [`key_hash`] of the decoded name: equal names have equal hashes, so the duplicate check
    /// compares bytes only where hashes are equal.
    hash: u64,
}

/// The 0.1 field a member name fills in an object of `role` (root, action, payload).
#[inline(always)]
fn slot_of(role: Role, name: &[u8]) -> Slot {
    match (role, name.len()) {
        (Role::Root, 16) if name == b"protocol_version" => Slot::Pv,
        (Role::Root, 10) if name == b"message_id" => Slot::MsgId,
        (Role::Root, 7) if name == b"actions" => Slot::Actions,
        (Role::Action, 9) if name == b"action_id" => Slot::Id,
        (Role::Action, 11) if name == b"action_type" => Slot::Type,
        (Role::Action, 14) if name == b"action_version" => Slot::Ver,
        (Role::Action, 7) if name == b"payload" => Slot::Payload,
        (Role::Payload, 23) if name == b"source_control_endpoint" => Slot::Endpoint,
        _ => Slot::None,
    }
}

/// A cheap hash of a member name: its length, first and last eight bytes (fewer when shorter).
/// Names that differ only in the middle collide; the duplicate check then compares bytes, so a
/// collision costs time, never a wrong answer.
#[inline(always)]
fn key_hash(b: &[u8]) -> u64 {
    let n = b.len();
    let (head, tail) = if n >= 8 {
        let w = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        (w(0), w(n - 8))
    } else if n >= 4 {
        let w = |i: usize| u64::from(u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes")));
        (w(0), w(n - 4))
    } else if n > 0 {
        (u64::from(b[0]) | u64::from(b[n / 2]) << 8 | u64::from(b[n - 1]) << 16, 0)
    } else {
        (0, 0)
    };
    (head.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ tail.rotate_left(29) ^ n as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93)
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Role {
    Other,
    Root,
    ActionsArr,
    Action,
    /// The `payload` object of an action.
    Payload,
    BatchList,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Slot {
    None,
    Pv,
    MsgId,
    Actions,
    Id,
    Type,
    Ver,
    Payload,
    /// The payload's `source_control_endpoint` member.
    Endpoint,
    /// An element of an action array (recorded through `Scratch::actions`).
    ActionElem,
    /// An element of a batched aligned list (recorded as a raw input span).
    BatchElem,
}

/// An open container, an element of `Scratch::stack`; `Scanner::top` points at the innermost
/// one, so that every token reaches its container's state with one load instead of through
/// the stack's length (and nothing copies a frame that was just written, which would stall on
/// store forwarding).
#[derive(Clone, Copy)]
struct Frame {
    is_obj: bool,
    role: Role,
    slot: Slot,
    keys_start: u32,
    /// canonical start of the member value being read (when `slot` records it)
    vstart: u32,
    /// raw start of the member value being read (when `slot` records it)
    vraw: u32,
    /// raw offset of the opening bracket, for error details
    open: u32,
    /// number of elements begun so far (the root `actions` array only)
    n: u32,
    /// Objects: one bit per member-name hash seen (its top seven bits). A name whose bit is
    /// already set makes the object `suspect`; only suspect objects run the duplicate check
    /// when they close (an object without a repeated bit has no repeated name).
    bloom: u128,
    suspect: bool,
}

/// Reusable working memory for the scanner (see [`crate::hints::Admission::admit_with`]). Buffers keep their capacity between calls, so after
/// the first few calls a validation allocates nothing.
#[derive(Default)]
pub struct Scratch {
    pub(crate) out: Vec<u8>,
    pub(crate) keybuf: Vec<u8>,
    keys: Vec<KeyRef>,
    stack: Vec<Frame>,
    pub(crate) actions: Vec<ActionRec>,
    pub(crate) elems: Vec<(usize, usize)>,
}

impl Scratch {
    /// A scratch area pre-sized for envelopes up to `max_bytes` canonical bytes and `max_depth`
    /// levels, so that validating such envelopes never allocates: the output, the nesting
    /// stack, one record per action an admissible envelope can hold (an action takes at least
    /// 68 canonical bytes), and 64 member names pending in the open objects at once (a
    /// protocol 0.1 envelope has 4 in the root and each action, plus what payloads nest).
    /// Beyond those, the first call grows the scratch once and later calls reuse it.
    pub fn with_limits(max_bytes: usize, max_depth: usize) -> Scratch {
        let max_bytes = max_bytes.min(1 << 24);
        Scratch {
            out: Vec::with_capacity(max_bytes + 64),
            keybuf: Vec::with_capacity(256),
            keys: Vec::with_capacity(64),
            stack: Vec::with_capacity(max_depth.min(4096)),
            actions: Vec::with_capacity(max_bytes / 68 + 1),
            elems: Vec::new(),
        }
    }
}

/// What to recognise while scanning.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Mode {
    /// A hint envelope: record the 0.1 index, check duplicates.
    Envelope,
    /// The outer list of a batched request: record the raw spans of the top-level elements,
    /// check syntax and depth only (each element is admitted on its own afterwards).
    BatchList,
}

/// The result of a scan that found the input well-formed (SPEC.md step 4 passed).
#[derive(Debug, Default)]
pub(crate) struct Scan {
    pub root: Kind,
    pub pv: Field,
    pub pv_is_01: bool,
    pub msgid: Field,
    pub actions: Field,
    /// Size of the canonical compact encoding, counted even where writing stopped.
    pub canonical_len: usize,
    /// `Some(range)` when the canonical bytes are exactly `input[range]`; otherwise they are in
    /// `Scratch::out` (complete only when `canonical_len <= max_bytes`).
    pub verbatim: Option<(usize, usize)>,
    /// First step-8 number problem (integer out of range, non-finite float).
    pub number_error: Option<Detail>,
    /// Position of the first element of `actions` that is not an object.
    pub action_not_object: Option<u32>,
}

/// Space, tab, LF or CR: one compare and one bit test.
#[inline(always)]
fn is_ws(b: u8) -> bool {
    const WS: u64 = 1 << b' ' | 1 << b'\t' | 1 << b'\n' | 1 << b'\r';
    b <= b' ' && WS >> b & 1 != 0
}

/// Largest magnitudes, as decimal digit strings of maximal length, that are still in range.
const U64_MAX_DIGITS: &[u8] = b"18446744073709551615";
const I64_MIN_DIGITS: &[u8] = b"9223372036854775808";

struct Scanner<'a, 's> {
    inp: &'a [u8],
    pos: usize,
    sc: &'s mut Scratch,
    max_depth: usize,
    mode: Mode,
    // lazy canonical writer
    run: usize,
    total: usize,
    cap: usize,
    rewrote: bool,
    res: Scan,
    root_end: usize,
    /// Whether the last string scanned had an escape (read by `record`).
    last_escaped: bool,
    /// The last element of `Scratch::stack` (the innermost open container), null while none
    /// is open. Set by [`Scanner::set_top`] after every push and pop, the only operations that
    /// change the stack while scanning; read through [`Scanner::cur`] and [`Scanner::cur_mut`].
    top: *mut Frame,
}

/// Scan one JSON value. `max_bytes` only bounds how much canonical output is written; the
/// caller compares `Scan::canonical_len` with its limit. Returns `Err` for every SPEC.md step-4
/// failure (syntax, UTF-8, escapes, depth, duplicate names); the first one found ends the scan.
pub(crate) fn scan(
    sc: &mut Scratch,
    inp: &[u8],
    max_bytes: usize,
    max_depth: usize,
    mode: Mode,
) -> Result<Scan, Detail> {
    sc.out.clear();
    sc.keybuf.clear();
    sc.keys.clear();
    sc.stack.clear();
    sc.actions.clear();
    sc.elems.clear();
    let mut s = Scanner {
        inp,
        pos: 0,
        sc,
        max_depth,
        mode,
        run: 0,
        total: 0,
        cap: max_bytes,
        rewrote: false,
        res: Scan::default(),
        root_end: 0,
        last_escaped: false,
        top: std::ptr::null_mut(),
    };
    while s.pos < inp.len() && is_ws(inp[s.pos]) {
        s.pos += 1;
    }
    let root_start = s.pos;
    s.run = root_start;
    s.value_loop()?;
    s.root_end = s.pos;
    while s.pos < inp.len() && is_ws(inp[s.pos]) {
        s.pos += 1;
    }
    if s.pos != inp.len() {
        return Err(Detail::at("unexpected characters after the value", s.pos));
    }
    let root_end = s.root_end;
    s.res.canonical_len = s.canon(root_end);
    if s.rewrote {
        s.flush(root_end);
        s.run = root_end;
    } else {
        s.res.verbatim = Some((root_start, root_end));
    }
    Ok(s.res)
}

impl Scanner<'_, '_> {
    /// Whether a container is open.
    #[inline(always)]
    fn nested(&self) -> bool {
        !self.top.is_null()
    }

    /// The innermost open container. Callers check [`Scanner::nested`] first.
    #[inline(always)]
    fn cur(&self) -> &Frame {
        debug_assert!(self.nested() && self.sc.stack.last().is_some_and(|f| std::ptr::eq(f, self.top)));
        // SAFETY: `top` is non-null only while the stack is not empty, and then points at its
        // last element: `set_top` derives it from `as_mut_ptr` after every push and pop, and
        // nothing else changes the stack (or moves its buffer) while scanning. The returned
        // reference borrows `self`, so no `&mut` to the frame can be made while it lives.
        unsafe { &*self.top }
    }

    /// The innermost open container, mutably. Callers check [`Scanner::nested`] first.
    #[inline(always)]
    fn cur_mut(&mut self) -> &mut Frame {
        debug_assert!(self.nested() && self.sc.stack.last().is_some_and(|f| std::ptr::eq(f, self.top)));
        // SAFETY: as in `cur`; the reference borrows `self` mutably, so it is the only one.
        unsafe { &mut *self.top }
    }

    /// Point `top` at the stack's last element (null when it is empty).
    #[inline(always)]
    fn set_top(&mut self) {
        let st = &mut self.sc.stack;
        self.top = match st.len() {
            0 => std::ptr::null_mut(),
            // SAFETY: `n - 1 < len`, so the pointer stays inside the stack's allocation.
            n => unsafe { st.as_mut_ptr().add(n - 1) },
        };
    }

    #[inline(always)]
    fn canon(&self, pos: usize) -> usize {
        self.total + (pos - self.run)
    }

    #[inline(always)]
    fn canon32(&self, pos: usize) -> u32 {
        self.canon(pos) as u32
    }

    /// Copy the verbatim run `[run, upto)` to the output. Runs of up to 32 bytes (most runs
    /// between whitespace in spaced or indented input) are copied inline as two 16-byte moves
    /// into the output's spare capacity, without a call to `memcpy`; longer runs, runs within 32
    /// bytes of the input's end and an output without 32 spare bytes take `extend_from_slice`.
    #[inline(always)]
    fn flush(&mut self, upto: usize) {
        let n = upto - self.run;
        if self.total <= self.cap {
            let out = &mut self.sc.out;
            if n <= 32 && self.run + 32 <= self.inp.len() && out.capacity() - out.len() >= 32 {
                // SAFETY: the 32 bytes read start at `self.run` and end at or before
                // `inp.len()`; the 32 bytes written lie in `out`'s allocation (at least 32
                // bytes of spare capacity after `len`); the two buffers are distinct
                // allocations (`inp` is borrowed shared while `out` is borrowed mutably), so
                // they do not overlap. Only the first `n` written bytes become part of `out`
                // (`set_len`), and they were just initialized from `inp`.
                unsafe {
                    let src = self.inp.as_ptr().add(self.run);
                    let dst = out.as_mut_ptr().add(out.len());
                    std::ptr::copy_nonoverlapping(src, dst, 16);
                    std::ptr::copy_nonoverlapping(src.add(16), dst.add(16), 16);
                    out.set_len(out.len() + n);
                }
            } else {
                out.extend_from_slice(&self.inp[self.run..upto]);
            }
        }
        self.total += n;
    }

    /// Drop input `[upto, resume)` (whitespace) from the canonical output.
    #[inline(always)]
    fn drop_ws(&mut self, upto: usize, resume: usize) {
        self.flush(upto);
        self.run = resume;
        self.rewrote = true;
    }

    /// Replace input `[upto, resume)` by `repl` in the canonical output.
    #[inline(never)]
    fn rewrite(&mut self, upto: usize, resume: usize, repl: &[u8]) {
        self.flush(upto);
        if self.total <= self.cap {
            if repl.len() <= 4 {
                // a decoded character: no memcpy call for one to four bytes
                for &b in repl {
                    self.sc.out.push(b);
                }
            } else {
                self.sc.out.extend_from_slice(repl);
            }
        }
        self.total += repl.len();
        self.run = resume;
        self.rewrote = true;
    }

    #[inline(always)]
    fn peek(&self) -> Option<u8> {
        self.inp.get(self.pos).copied()
    }

    /// Skip insignificant whitespace at `self.pos` (canonical form drops it) and return the
    /// byte there (`None` at the end of the input). Every token begins with a byte above space,
    /// so between tokens of compact input this is one load and one compare; one whitespace byte
    /// before a token (the `": "` and `", "` of spaced encoders) is dropped inline; longer runs
    /// (indentation) are skipped 16 bytes at a time.
    #[inline(always)]
    fn sig(&mut self) -> Option<u8> {
        let inp = self.inp;
        let p = self.pos;
        let b = *inp.get(p)?;
        if b > b' ' || !is_ws(b) {
            // a token, or a control character the caller reports
            return Some(b);
        }
        if let Some(&c) = inp.get(p + 1) {
            if !is_ws(c) {
                self.pos = p + 1;
                self.drop_ws(p, p + 1);
                return Some(c);
            }
        }
        self.ws_slow();
        self.peek()
    }

    #[inline(never)]
    fn ws_slow(&mut self) {
        let start = self.pos;
        self.pos = skip_ws(self.inp, start);
        self.drop_ws(start, self.pos);
    }

    fn value_loop(&mut self) -> Result<(), Detail> {
        'value: loop {
            let Some(b) = self.sig() else {
                return Err(Detail::at("unexpected end of input, expected a value", self.pos));
            };
            self.begin_value(b);
            match b {
                b'{' => {
                    self.open(true)?;
                    match self.sig() {
                        Some(b'}') => {
                            self.pos += 1;
                            self.close()?;
                        }
                        c => {
                            self.member_key(c)?;
                            continue 'value;
                        }
                    }
                }
                b'[' => {
                    self.open(false)?;
                    if self.sig() == Some(b']') {
                        self.pos += 1;
                        self.close()?;
                    } else {
                        continue 'value;
                    }
                }
                b'"' => {
                    self.last_escaped = self.string()?;
                    self.finish_value(Kind::String);
                }
                b'-' | b'0'..=b'9' => {
                    if self.nested() && !self.cur().is_obj && self.cur().role == Role::Other {
                        // an array that records nothing per element: the hash-list fast path
                        #[cfg(all(target_arch = "x86_64", not(kvrelay_portable)))]
                        {
                            // whole 16-byte blocks of plain integers, then one element through
                            // the general number path wherever the block scanner stopped
                            // (after a float, the next element goes straight to the general
                            // path: a list of floats would stop every block at once)
                            let mut float = self.number()?;
                            loop {
                                match self.inp.get(self.pos..self.pos + 2) {
                                    _ if float => {}
                                    Some(&[b',', c]) if c == b'-' || c.is_ascii_digit() => {
                                        self.int_blocks::<false>();
                                    }
                                    Some(b", ") => self.int_blocks::<true>(),
                                    _ => {}
                                }
                                match self.inp.get(self.pos..self.pos + 2) {
                                    Some(&[b',', c]) if c == b'-' || c.is_ascii_digit() => {
                                        self.pos += 1;
                                        float = self.number()?;
                                    }
                                    // other whitespace after the comma (indented lists): the
                                    // scalar run drops each separator's whitespace as it goes
                                    Some(&[b',', c]) if is_ws(c) => match self.list_sep(self.pos) {
                                        Some(q) => {
                                            self.pos = q;
                                            self.number_run()?;
                                        }
                                        None => break,
                                    },
                                    _ => break,
                                }
                            }
                        }
                        #[cfg(not(all(target_arch = "x86_64", not(kvrelay_portable))))]
                        self.number_run()?;
                    } else {
                        self.number()?;
                        self.finish_value(Kind::Number);
                    }
                }
                b't' => {
                    self.literal(b"true")?;
                    self.finish_value(Kind::Bool);
                }
                b'f' => {
                    self.literal(b"false")?;
                    self.finish_value(Kind::Bool);
                }
                b'n' => {
                    self.literal(b"null")?;
                    self.finish_value(Kind::Null);
                }
                _ => return Err(Detail::at("expected a value", self.pos)),
            }
            // After a complete value: separators and closers until a new value is due.
            loop {
                if !self.nested() {
                    return Ok(());
                }
                let is_obj = self.cur().is_obj;
                match self.sig() {
                    Some(b',') => {
                        self.pos += 1;
                        if is_obj {
                            let c = self.sig();
                            self.member_key(c)?;
                        }
                        continue 'value;
                    }
                    Some(b'}') if is_obj => {
                        self.pos += 1;
                        self.close()?;
                    }
                    Some(b']') if !is_obj => {
                        self.pos += 1;
                        self.close()?;
                    }
                    None => return Err(Detail::at("unexpected end of input inside a container", self.pos)),
                    _ if is_obj => return Err(Detail::at("expected ',' or '}' after a member", self.pos)),
                    _ => return Err(Detail::at("expected ',' or ']' after an element", self.pos)),
                }
            }
        }
    }

    /// Called at the first byte of every value: note where it starts for the parent's record.
    /// A member that fills no slot and an element of a plain array (almost every value) cost
    /// two tests; the canonical position is computed only where it is recorded.
    #[inline(always)]
    fn begin_value(&mut self, b: u8) {
        if !self.nested() {
            return;
        }
        let pos = self.pos;
        let (is_obj, slot) = (self.cur().is_obj, self.cur().slot);
        if is_obj {
            if slot != Slot::None {
                let canon = self.canon32(pos);
                let top = self.cur_mut();
                top.vstart = canon;
                top.vraw = pos as u32;
            }
            return;
        }
        let top = self.cur_mut();
        match top.role {
            Role::ActionsArr => {
                let idx = top.n;
                top.n += 1;
                top.slot = Slot::ActionElem;
                if b != b'{' && self.res.action_not_object.is_none() {
                    self.res.action_not_object = Some(idx);
                }
            }
            Role::BatchList => {
                top.slot = Slot::BatchElem;
                top.vraw = pos as u32;
            }
            _ => {}
        }
    }

    /// Record a value that has just ended at `self.pos` into its parent's slot.
    #[inline(always)]
    fn finish_value(&mut self, kind: Kind) {
        if !self.nested() {
            self.res.root = kind;
            return;
        }
        if self.cur().slot == Slot::None {
            return;
        }
        self.record(kind);
    }

    #[inline(always)]
    fn record(&mut self, kind: Kind) {
        let end = self.canon32(self.pos);
        let top = self.cur();
        let (slot, vstart, vraw) = (top.slot, top.vstart, top.vraw);
        let f = Field { kind, start: vstart, end, escaped: kind == Kind::String && self.last_escaped };
        match slot {
            Slot::None | Slot::ActionElem => {}
            Slot::Pv => {
                self.res.pv = f;
                if kind == Kind::String {
                    let raw = &self.inp[vraw as usize..self.pos];
                    self.res.pv_is_01 = raw == b"\"0.1\""
                        || (raw.contains(&b'\\') && {
                            let at = self.sc.keybuf.len();
                            decode_string(&raw[1..raw.len() - 1], &mut self.sc.keybuf);
                            let eq = &self.sc.keybuf[at..] == b"0.1";
                            self.sc.keybuf.truncate(at);
                            eq
                        });
                }
            }
            Slot::MsgId => self.res.msgid = f,
            Slot::Actions => self.res.actions = f,
            Slot::Id | Slot::Type | Slot::Ver | Slot::Payload | Slot::Endpoint => {
                let a = self.sc.actions.last_mut().expect("an open action");
                match slot {
                    Slot::Id => a.id = f,
                    Slot::Type => a.ty = f,
                    Slot::Ver => a.ver = f,
                    Slot::Payload => a.payload = f,
                    _ => a.endpoint = f,
                }
            }
            Slot::BatchElem => self.sc.elems.push((vraw as usize, self.pos)),
        }
    }

    #[inline(always)]
    fn open(&mut self, is_obj: bool) -> Result<(), Detail> {
        if self.sc.stack.len() >= self.max_depth {
            return Err(Detail::at("nesting deeper than max_depth", self.pos));
        }
        let role = if !self.nested() {
            match (self.mode, is_obj) {
                (Mode::Envelope, true) => Role::Root,
                (Mode::BatchList, false) => Role::BatchList,
                _ => Role::Other,
            }
        } else {
            match (self.cur().slot, is_obj) {
                (Slot::Actions, false) => Role::ActionsArr,
                (Slot::ActionElem, true) => Role::Action,
                (Slot::Payload, true) => Role::Payload,
                _ => Role::Other,
            }
        };
        if role == Role::Action {
            let start = self.canon32(self.pos);
            self.sc.actions.push(ActionRec { start, ..ActionRec::default() });
        }
        let keys_start = self.sc.keys.len() as u32;
        self.sc.stack.push(Frame {
            is_obj,
            role,
            slot: Slot::None,
            keys_start,
            vstart: 0,
            vraw: 0,
            open: self.pos as u32,
            n: 0,
            bloom: 0,
            suspect: false,
        });
        self.set_top();
        self.pos += 1;
        Ok(())
    }

    /// The closer has been consumed (`self.pos` is just past it).
    #[inline(always)]
    fn close(&mut self) -> Result<(), Detail> {
        // the fields it needs, read in place (no copy of the frame)
        let (is_obj, role, ks, suspect, open) = {
            let f = self.cur();
            (f.is_obj, f.role, f.keys_start as usize, f.suspect, f.open as usize)
        };
        self.sc.stack.truncate(self.sc.stack.len() - 1);
        self.set_top();
        if is_obj {
            if suspect && self.mode == Mode::Envelope {
                self.check_duplicates(ks, open)?;
            }
            self.sc.keys.truncate(ks);
        }
        if role == Role::Action {
            let end = self.canon32(self.pos);
            self.sc.actions.last_mut().expect("an open action").end = end;
        }
        self.finish_value(if is_obj { Kind::Object } else { Kind::Array });
        Ok(())
    }

    #[inline(never)]
    fn check_duplicates(&mut self, ks: usize, open: usize) -> Result<(), Detail> {
        let inp = self.inp;
        let Scratch { keys, keybuf, .. } = &mut *self.sc;
        let bytes = |k: &KeyRef| -> &[u8] {
            let (s, e) = (k.start as usize, (k.start + k.len) as usize);
            if k.in_buf {
                &keybuf[s..e]
            } else {
                &inp[s..e]
            }
        };
        let ks_slice = &mut keys[ks..];
        let dup = if ks_slice.len() <= 16 {
            // pairwise on the hashes (at most 120 integer compares), bytes only on a match
            let mut dup = false;
            'outer: for i in 1..ks_slice.len() {
                let h = ks_slice[i].hash;
                for j in 0..i {
                    if ks_slice[j].hash == h && bytes(&ks_slice[i]) == bytes(&ks_slice[j]) {
                        dup = true;
                        break 'outer;
                    }
                }
            }
            dup
        } else {
            // by hash, then bytes: equal names end up adjacent, and a flood of colliding hashes
            // still costs O(k log k) comparisons
            ks_slice.sort_unstable_by(|a, b| a.hash.cmp(&b.hash).then_with(|| bytes(a).cmp(bytes(b))));
            ks_slice.windows(2).any(|w| w[0].hash == w[1].hash && bytes(&w[0]) == bytes(&w[1]))
        };
        if dup {
            return Err(Detail::at("duplicate member name in the object", open));
        }
        Ok(())
    }

    /// A member name and the colon after it; `c` is the byte at `self.pos` (whitespace before
    /// it already skipped). The whitespace before the value is left to the value's own
    /// [`Scanner::sig`].
    #[inline(always)]
    fn member_key(&mut self, c: Option<u8>) -> Result<(), Detail> {
        if c != Some(b'"') {
            return Err(Detail::at("expected a member name string", self.pos));
        }
        let start = self.pos + 1;
        let had_escape = self.string()?;
        let end = self.pos - 1;
        let key = if had_escape {
            let at = self.sc.keybuf.len();
            decode_string(&self.inp[start..end], &mut self.sc.keybuf);
            let hash = key_hash(&self.sc.keybuf[at..]);
            KeyRef { in_buf: true, start: at as u32, len: (self.sc.keybuf.len() - at) as u32, hash }
        } else {
            KeyRef {
                in_buf: false,
                start: start as u32,
                len: (end - start) as u32,
                hash: key_hash(&self.inp[start..end]),
            }
        };
        let name: &[u8] = if key.in_buf {
            &self.sc.keybuf[key.start as usize..(key.start + key.len) as usize]
        } else {
            &self.inp[start..end]
        };
        let slot = match self.cur().role {
            Role::Other => Slot::None,
            role => slot_of(role, name),
        };
        let top = self.cur_mut();
        let bit = 1u128 << (key.hash >> 57);
        top.suspect |= top.bloom & bit != 0;
        top.bloom |= bit;
        top.slot = slot;
        self.sc.keys.push(key);
        if self.sig() != Some(b':') {
            return Err(Detail::at("expected ':' after a member name", self.pos));
        }
        self.pos += 1;
        Ok(())
    }

    /// `true`, `false` or `null` at `self.pos`: the bytes compared as one word.
    #[inline(always)]
    fn literal(&mut self, lit: &'static [u8]) -> Result<(), Detail> {
        let word = |s: &[u8]| u32::from_le_bytes([s[0], s[1], s[2], s[3]]);
        let n = lit.len();
        let ok = match self.inp.get(self.pos + n - 4..self.pos + n) {
            // the first byte was matched by the caller; compare the last four
            Some(tail) => word(tail) == word(&lit[n - 4..]),
            None => false,
        };
        if ok {
            self.pos += lit.len();
            Ok(())
        } else {
            Err(Detail::at("invalid literal", self.pos))
        }
    }

    /// A string starting at the opening quote; returns whether it contained an escape.
    ///
    /// Inline fast path: a string whose closing quote is the first byte that is not plain
    /// ASCII content among the 32 after the opening quote (member names and short values,
    /// `source_control_endpoint` and the endpoint URL included) costs one 16-byte
    /// classification, two when it is 16 bytes or longer; anything else goes to
    /// [`Scanner::string_long`].
    #[inline(always)]
    fn string(&mut self) -> Result<bool, Detail> {
        let p = self.pos + 1;
        if let Some(i) = first_special32(self.inp, p) {
            if self.inp[p + i] == b'"' {
                self.pos = p + i + 1;
                return Ok(false);
            }
        }
        self.string_long()
    }

    /// [`Scanner::string`] beyond its fast path: plain runs 16 bytes at a time, escapes,
    /// non-ASCII characters.
    #[inline(never)]
    fn string_long(&mut self) -> Result<bool, Detail> {
        let open = self.pos;
        let inp = self.inp;
        let mut p = self.pos + 1;
        let mut had_escape = false;
        loop {
            p = skip_plain(inp, p);
            let Some(&b) = inp.get(p) else {
                return Err(Detail::at("unterminated string", open));
            };
            match STR_CLASS[b as usize] {
                QUOTE => {
                    self.pos = p + 1;
                    return Ok(had_escape);
                }
                BSLASH => {
                    had_escape = true;
                    // the escapes canonical form keeps as they are, inline
                    p = match inp.get(p + 1) {
                        Some(b'"' | b'\\' | b'b' | b'f' | b'n' | b'r' | b't') => p + 2,
                        _ => self.escape(p)?,
                    };
                }
                CTRL => return Err(Detail::at("unescaped control character in a string", p)),
                _ => {
                    // a run of non-ASCII characters (a word of Cyrillic or CJK text) in one
                    // tight loop before the next 16-byte skip
                    p = utf8_seq(inp, p)?;
                    while inp.get(p).is_some_and(|&c| STR_CLASS[c as usize] == HIGH) {
                        p = utf8_seq(inp, p)?;
                    }
                }
            }
        }
    }

    /// An escape starting at the backslash at `p` that canonical form may spell differently
    /// (`\/` or `\uXXXX`); returns the position after it.
    fn escape(&mut self, p: usize) -> Result<usize, Detail> {
        match self.inp.get(p + 1) {
            None => Err(Detail::at("unterminated escape", p)),
            Some(b'/') => {
                self.rewrite(p, p + 2, b"/");
                Ok(p + 2)
            }
            Some(b'u') => self.unicode_escapes(p),
            Some(_) => Err(Detail::at("invalid escape", p)),
        }
    }

    /// A run of `\uXXXX` escapes (surrogate pairs included) starting at the backslash at `p`;
    /// returns the position after the last one.
    ///
    /// A non-ASCII character is never spelled as an escape in canonical form, so its UTF-8
    /// bytes are appended straight to the output (one unaligned 32-bit store when four bytes of
    /// spare capacity are there): the verbatim run before the first escape is copied once, and
    /// every further escape of the run (a word of `ensure_ascii` text) costs the hex decoding
    /// and the store. An ASCII character goes through [`canonical_char`] and is rewritten only
    /// where canonical form spells it differently (`\u0041` is `A`; `\u0001` stays).
    #[inline(never)]
    fn unicode_escapes(&mut self, mut p: usize) -> Result<usize, Detail> {
        let inp = self.inp;
        loop {
            let (cp, end) = unicode_escape_at(inp, p)?;
            if cp < 0x80 {
                let mut buf = [0u8; 6];
                let canon = canonical_char(cp, &mut buf);
                if canon != &inp[p..end] {
                    self.rewrite(p, end, canon);
                }
            } else {
                // the verbatim run before the first escape of the run (the later ones follow
                // each other: nothing to copy)
                if self.run != p {
                    self.flush(p);
                }
                let (word, n) = utf8_word(cp);
                if self.total <= self.cap {
                    let out = &mut self.sc.out;
                    if out.capacity() - out.len() >= 4 {
                        // SAFETY: the four bytes written lie in `out`'s allocation (at least
                        // four bytes of spare capacity after `len`, checked above);
                        // `write_unaligned` needs no alignment. Only the first `n <= 4` of
                        // them become part of `out` (`set_len`), and they were just written.
                        unsafe {
                            out.as_mut_ptr().add(out.len()).cast::<u32>().write_unaligned(word.to_le());
                            out.set_len(out.len() + n);
                        }
                    } else {
                        out.extend_from_slice(&word.to_le_bytes()[..n]);
                    }
                }
                self.total += n;
                self.run = end;
                self.rewrote = true;
            }
            p = end;
            if inp.get(p..p + 2) != Some(b"\\u") {
                return Ok(p);
            }
        }
    }

    /// After a complete number in a plain array (`self.pos` at the byte after it): consume the
    /// longest following run of `,integer` pairs (`, integer` when `SPACED`, the separator of
    /// `json.dumps` and other spaced encoders) whose integers are certainly plain and in
    /// range, 16 bytes at a time. Each block is classified into digit and comma masks (and a
    /// space mask, which must be exactly the commas shifted by one lane) with SSE2 and the
    /// commas are walked with `trailing_zeros`, so the cost per hash is a few instructions; a
    /// spaced separator's space is dropped from the canonical output (an inline copy of the
    /// run before it) once the element after it is consumed. Anything else (a float, a sign,
    /// an empty element, a leading zero, an integer that may be out of range, other
    /// whitespace, the last 16 bytes of the input) ends the run just before that element, and
    /// the general path handles it exactly as before: this can only skip work, never change an
    /// outcome.
    #[cfg(all(target_arch = "x86_64", not(kvrelay_portable)))]
    #[inline(always)]
    fn int_blocks<const SPACED: bool>(&mut self) {
        use std::arch::x86_64::{
            __m128i, _mm_cmpeq_epi8, _mm_loadu_si128, _mm_min_epu8, _mm_movemask_epi8, _mm_set1_epi8, _mm_sub_epi8,
        };
        let inp = self.inp;
        let start = self.pos;
        // the separator: `,` or, spaced, `, `
        let sep = 1 + SPACED as usize;
        if inp.get(start) != Some(&b',') || (SPACED && inp.get(start + 1) != Some(&b' ')) {
            return;
        }
        // Plain iff 1..=19 digits without a leading zero, or 20 digits whose first eight sort
        // below the limit's (a tie goes to the general path).
        let lim = u64::from_be_bytes(U64_MAX_DIGITS[..8].try_into().expect("8 digits"));
        let plain = |s: usize, e: usize| -> bool {
            let nd = e - s;
            if nd == 0 || nd > 20 || (inp[s] == b'0' && nd > 1) {
                return false;
            }
            nd < 20 || u64::from_be_bytes(inp[s..s + 8].try_into().expect("8 digits")) < lim
        };
        let mut done = start; // just after the last consumed integer
        let mut seg = start + sep; // start of the element being read
        let mut q = start + sep;
        // spaced: a comma in the last lane of the previous block expects a space in lane 0
        let mut carry = 0u32;
        while q + 16 <= inp.len() {
            // SAFETY: SSE2 is part of the x86-64 baseline; `q + 16 <= inp.len()`, so the 16
            // bytes loaded are inside `inp`, and `_mm_loadu_si128` needs no alignment.
            let (digits, commas, spaces) = unsafe {
                let v = _mm_loadu_si128(inp.as_ptr().add(q).cast::<__m128i>());
                let t = _mm_sub_epi8(v, _mm_set1_epi8(b'0' as i8));
                let d = _mm_movemask_epi8(_mm_cmpeq_epi8(_mm_min_epu8(t, _mm_set1_epi8(9)), t)) as u32;
                let c = _mm_movemask_epi8(_mm_cmpeq_epi8(v, _mm_set1_epi8(b',' as i8))) as u32;
                let s = if SPACED { _mm_movemask_epi8(_mm_cmpeq_epi8(v, _mm_set1_epi8(b' ' as i8))) as u32 } else { 0 };
                (d, c, s)
            };
            // spaced: exactly one space right after every comma; a missing or an extra space
            // ends the block like any other byte
            let other = if SPACED {
                let expected = (commas << 1 | carry) & 0xFFFF;
                carry = commas >> 15 & 1;
                (!(digits | commas | spaces) | (spaces ^ expected)) & 0xFFFF
            } else {
                !(digits | commas) & 0xFFFF
            };
            let stop = if other != 0 { other.trailing_zeros() } else { 16 };
            let mut cm = commas & ((1u32 << stop) - 1);
            while cm != 0 {
                let c = q + cm.trailing_zeros() as usize;
                if !plain(seg, c) {
                    self.pos = done;
                    return;
                }
                if SPACED {
                    // the element is consumed: drop the space of the separator before it
                    self.drop_ws(seg - 1, seg);
                }
                done = c;
                seg = c + sep;
                cm &= cm - 1;
            }
            if other != 0 {
                let e = q + stop as usize;
                if e >= seg && !matches!(inp[e], b'.' | b'e' | b'E' | b'+' | b'-') && plain(seg, e) {
                    if SPACED {
                        self.drop_ws(seg - 1, seg);
                    }
                    done = e;
                }
                self.pos = done;
                return;
            }
            q += 16;
        }
        self.pos = done;
    }

    /// A run of numbers separated by commas, starting at `self.pos`, inside an array whose
    /// elements need no record (block hash lists): the portable path for every list, and on
    /// x86-64 the path for spaced or indented lists (compact ones go through `int_blocks`).
    /// Integers are handled here with about 30 instructions each; whitespace after a comma is
    /// dropped in place ([`list_sep`]); anything else (floats, `-0`, errors) goes through
    /// [`number`], and a separator that is not `,` (whitespace) number ends the run, leaving
    /// `self.pos` after the last number.
    ///
    /// [`number`]: Scanner::number
    /// [`list_sep`]: Scanner::list_sep
    #[inline(always)]
    fn number_run(&mut self) -> Result<(), Detail> {
        let inp = self.inp;
        let mut p = self.pos;
        loop {
            let neg = (inp[p] == b'-') as usize;
            let ds = p + neg;
            let nd = count_digits(inp, ds);
            let end = ds + nd;
            let next = inp.get(end).copied();
            let leading_zero = inp.get(ds) == Some(&b'0') && nd > 1;
            let minus_zero = neg == 1 && nd == 1 && inp[ds] == b'0';
            let float = matches!(next, Some(b'.' | b'e' | b'E'));
            let plain = nd != 0 && !leading_zero && !minus_zero && !float;
            if plain {
                // Range: decided by the first eight digits unless they tie with the limit's.
                let (limit, max_nd) = if neg == 1 { (I64_MIN_DIGITS, 19) } else { (U64_MAX_DIGITS, 20) };
                // `max_nd - 1`, not `max_nd`: almost every u64 hash has 19 or 20 digits, and
                // branching between those two would be a coin flip; the body is branch-free.
                if nd + 1 >= max_nd {
                    let head = u64::from_be_bytes(inp[ds..ds + 8].try_into().expect("8 digits"));
                    let lim = u64::from_be_bytes(limit[..8].try_into().expect("8 digits"));
                    let mut over = (nd > max_nd) | ((nd == max_nd) & (head > lim));
                    if head == lim && nd == max_nd {
                        over = !digits_le(&inp[ds..end], limit);
                    }
                    if over {
                        self.note_number("integer outside -2^63 ..= 2^64-1", p);
                    }
                }
                p = end;
            } else {
                // floats, -0, and malformed numbers: the general path
                self.pos = p;
                self.number()?;
                p = self.pos;
            }
            match inp.get(p..p + 2) {
                Some(&[b',', c]) if c == b'-' || c.is_ascii_digit() => p += 1,
                Some(&[b',', c]) if is_ws(c) => match self.list_sep(p) {
                    Some(q) => p = q,
                    None => break,
                },
                _ => break,
            }
        }
        self.pos = p;
        Ok(())
    }

    /// At a comma `p` of a number list followed by whitespace: when a number starts after the
    /// whitespace, drop the whitespace from the canonical output (the comma stays) and return
    /// where the number starts; otherwise change nothing and return `None` (the general path
    /// then reads the separator).
    #[inline(always)]
    fn list_sep(&mut self, p: usize) -> Option<usize> {
        let q = skip_ws(self.inp, p + 1);
        match self.inp.get(q) {
            Some(&c) if c == b'-' || c.is_ascii_digit() => {
                self.drop_ws(p + 1, q);
                Some(q)
            }
            _ => None,
        }
    }

    /// A number starting at `self.pos` (a '-' or a digit); returns whether it has a fraction or
    /// an exponent.
    #[inline(always)]
    fn number(&mut self) -> Result<bool, Detail> {
        let inp = self.inp;
        let start = self.pos;
        let neg = inp[start] == b'-';
        let ds = start + neg as usize;
        let mut p = skip_digits(inp, ds);
        let nd = p - ds;
        if nd == 0 {
            return Err(Detail::at("expected a digit", ds));
        }
        if inp[ds] == b'0' && nd > 1 {
            return Err(Detail::at("leading zero in a number", ds));
        }
        let is_float = matches!(inp.get(p), Some(b'.' | b'e' | b'E'));
        if !is_float {
            self.pos = p;
            // A branch on the digit count: hash lists, where about half of the numbers have 20
            // digits, go through `int_blocks` and `number_run` (branch-free) and reach this
            // only for their first element; elsewhere integers are mostly short.
            let (limit, max_nd) = if neg { (I64_MIN_DIGITS, 19) } else { (U64_MAX_DIGITS, 20) };
            let in_range = nd < max_nd || (nd == max_nd && digits_le(&inp[ds..ds + max_nd], limit));
            if !in_range {
                self.note_number("integer outside -2^63 ..= 2^64-1", start);
            } else if neg && nd == 1 && inp[ds] == b'0' {
                self.rewrite(start, p, b"0");
            }
            return Ok(false);
        }
        let int_end = p;
        if inp[p] == b'.' {
            let q = skip_digits(inp, p + 1);
            if q == p + 1 {
                return Err(Detail::at("expected a digit after the decimal point", p + 1));
            }
            p = q;
            if !matches!(inp.get(p), Some(b'e' | b'E')) && decimal_is_shortest(&inp[ds..int_end], &inp[int_end + 1..p])
            {
                // already what ryu prints: no parse, no formatting
                self.pos = p;
                return Ok(true);
            }
        }
        if matches!(inp.get(p), Some(b'e' | b'E')) {
            p += 1;
            if matches!(inp.get(p), Some(b'+' | b'-')) {
                p += 1;
            }
            let q = skip_digits(inp, p);
            if q == p {
                return Err(Detail::at("expected a digit in the exponent", p));
            }
            p = q;
        }
        self.pos = p;
        let text = std::str::from_utf8(&inp[start..p]).expect("number text is ASCII");
        match text.parse::<f64>() {
            Ok(v) if v.is_finite() => {
                let mut b = ryu::Buffer::new();
                let s = b.format_finite(v).as_bytes();
                if s != text.as_bytes() {
                    self.rewrite(start, p, s);
                }
            }
            _ => self.note_number("number is not finite as an f64", start),
        }
        Ok(true)
    }

    #[cold]
    fn note_number(&mut self, what: &'static str, at: usize) {
        if self.res.number_error.is_none() {
            self.res.number_error = Some(Detail::at(what, at));
        }
    }
}

/// Whether the decimal `int.frac` (no sign, no exponent, already well-formed) is exactly the
/// text ryu prints for the f64 it denotes (SPEC.md section 3), decided from the digits alone:
/// - at most 15 significant digits: every decimal of 15 or fewer significant digits maps to a
///   distinct f64 (`f64::DIGITS`), so the shortest round-trip digits are the input's own once
///   it has no trailing zero (a fraction of exactly `0` is ryu's `.0` of an integral value);
/// - a decimal exponent where ryu prints plain decimal notation: from 1e-5 (at most four zeros
///   after the point before the first significant digit) to below 1e16 (integer part of 15 digits
///   or fewer here).
///
/// Anything else (an exponent, trailing zeros, more digits, tiny values) returns false and goes
/// through the parse-and-format path, so this only skips work. Cost: a few instructions, no
/// parsing; `float_fast_path_agrees_with_ryu` checks it against ryu.
#[inline(always)]
fn decimal_is_shortest(int: &[u8], frac: &[u8]) -> bool {
    let last = frac[frac.len() - 1];
    if frac == b"0" {
        return int.len() <= 15;
    }
    if last == b'0' {
        return false;
    }
    if int == b"0" {
        let zeros = frac.iter().take_while(|&&c| c == b'0').count();
        zeros <= 4 && frac.len() - zeros <= 15
    } else {
        int.len() + frac.len() <= 15
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canon(s: &str) -> Result<Vec<u8>, Detail> {
        let mut sc = Scratch::default();
        let r = scan(&mut sc, s.as_bytes(), usize::MAX, 128, Mode::Envelope)?;
        Ok(match r.verbatim {
            Some((a, b)) => s.as_bytes()[a..b].to_vec(),
            None => sc.out.clone(),
        })
    }

    /// A seeded xorshift64* generator for the randomized tests.
    fn xorshift(mut x: u64) -> impl FnMut() -> u64 {
        move || {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            x.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }
    }

    #[test]
    fn digits_swar() {
        for s in ["", "1", "12345678", "123456789", "1234567x9", "9/9:", "123456789012345678901234"] {
            let want = s.bytes().take_while(|b| b.is_ascii_digit()).count();
            assert_eq!(skip_digits(s.as_bytes(), 0), want, "{s:?}");
        }
        // bytes just outside the digit range on both sides, in every lane
        for lane in 0..8 {
            for bad in [b'/', b':', 0xFA, 0xFF, 0x00, 0x39 + 0x10] {
                let mut v = vec![b'5'; 12];
                v[lane] = bad;
                assert_eq!(skip_digits(&v, 0), lane);
            }
        }
    }

    #[test]
    fn float_fast_path_agrees_with_ryu() {
        // Every decimal the fast path accepts must be ryu's own text; random digit strings of
        // every shape near the limits (lengths, leading and trailing zeros).
        let mut next = xorshift(0x1234_5678_9ABC_DEF1);
        let mut accepted = 0;
        for _ in 0..100_000 {
            let digits = |n: u64, r: u64| -> String {
                (0..n).map(|i| char::from(b'0' + ((r >> (i * 3 % 60)) % 10) as u8)).collect()
            };
            let r = next();
            let int = if r % 3 == 0 {
                "0".to_string()
            } else {
                {
                    let s = digits(1 + (r >> 8) % 17, next());
                    let s = s.trim_start_matches('0').to_string();
                    if s.is_empty() {
                        "0".to_string()
                    } else {
                        s
                    }
                }
            };
            let zeros = "0".repeat(((r >> 16) % 7) as usize);
            let tail = if (r >> 24) % 5 == 0 { "0".to_string() } else { digits((r >> 32) % 17, next()) };
            let frac = format!("{zeros}{tail}");
            if frac.is_empty() {
                continue;
            }
            let text = format!("{int}.{frac}");
            let v: f64 = text.parse().unwrap();
            let ryu_text = ryu::Buffer::new().format_finite(v).to_string();
            if decimal_is_shortest(int.as_bytes(), frac.as_bytes()) {
                accepted += 1;
                assert_eq!(ryu_text, text, "fast path accepted {text}");
            }
            // and the scanner's output is ryu's text either way
            assert_eq!(canon(&format!("[{text},-{text}]")).unwrap(), format!("[{ryu_text},-{ryu_text}]").into_bytes());
        }
        assert!(accepted > 5_000, "the fast path is exercised ({accepted})");
    }

    #[test]
    fn unicode_escape_runs_decode_like_serde_json() {
        // Runs of `\uXXXX` escapes (ASCII letters, the characters canonical form escapes,
        // controls, two- and three-byte characters, surrogate pairs; either hex case) between
        // plain text, raw UTF-8 and other escapes: the canonical string is serde_json's decoded
        // text written canonically, whatever the output limit (writing stops past it, the
        // length is still counted), and the output's spare capacity before each character.
        let mut next = xorshift(0x9E37_79B9_7F4A_7C15);
        let cps =
            [0x41u32, 0x22, 0x5C, 0x2F, 0x01, 0x1F, 0x0A, 0x7F, 0xE9, 0x7FF, 0x800, 0x20AC, 0xFFFF, 0x1F600, 0x10FFFF];
        for _ in 0..20_000 {
            let mut raw = String::from("[\"");
            for _ in 0..next() % 12 {
                match next() % 5 {
                    0 => raw.push_str(["ab", "é", "\\n", "\\/", "\\\\"][(next() % 5) as usize]),
                    _ => {
                        let cp = cps[(next() % cps.len() as u64) as usize];
                        let mut units = [0u16; 2];
                        for u in char::from_u32(cp).unwrap().encode_utf16(&mut units) {
                            raw.push_str(&if next() % 2 == 0 { format!("\\u{u:04x}") } else { format!("\\u{u:04X}") });
                        }
                    }
                }
            }
            raw.push_str("\",1]");
            let text: Vec<serde_json::Value> = serde_json::from_str(&raw).unwrap();
            let mut want = b"[".to_vec();
            crate::hints::strings::write_canonical_string(text[0].as_str().unwrap(), &mut want);
            want.extend_from_slice(b",1]");
            assert_eq!(canon(&raw).unwrap(), want, "{raw}");
            // a limit anywhere in the output, and a scratch without spare capacity
            let cap = (next() % (want.len() as u64 + 1)) as usize;
            let mut sc = Scratch::default();
            let r = scan(&mut sc, raw.as_bytes(), cap, 128, Mode::Envelope).unwrap();
            assert_eq!(r.canonical_len, want.len(), "{raw}");
            if r.verbatim.is_none() {
                assert!(want.starts_with(&sc.out), "{raw} limit {cap}");
            }
        }
    }

    #[test]
    fn duplicates_among_colliding_hashes() {
        // names of equal length and equal first and last eight bytes: equal hashes (and
        // bloom bits), different names; pairwise (up to 16 members) and sorted (more)
        let obj = |names: &[String]| {
            format!("{{{}}}", names.iter().map(|k| format!("\"{k}\":1")).collect::<Vec<_>>().join(","))
        };
        for n in [2usize, 15, 16, 17, 40] {
            let names: Vec<String> = (0..n).map(|i| format!("prefix00{i:04}suffix00")).collect();
            assert!(canon(&obj(&names)).is_ok(), "{n} distinct names");
            for at in [0, n / 2, n - 1] {
                let mut dup = names.clone();
                dup.insert(at, names[n - 1 - at].clone());
                assert!(canon(&obj(&dup)).is_err(), "{n} names, a repeat at {at}");
                // the same name spelled with an escape
                let mut esc = names.clone();
                esc.insert(at, names[n - 1 - at].replacen('p', "\\u0070", 1));
                assert!(canon(&obj(&esc)).is_err(), "{n} names, an escaped repeat at {at}");
            }
        }
    }

    #[test]
    fn canonical_forms() {
        let cases: &[(&str, &str)] = &[
            (" { \"a\" : [ 1 , 2 ] } ", "{\"a\":[1,2]}"),
            ("[-0]", "[0]"),
            ("[-0.0]", "[-0.0]"),
            ("[1E5]", "[100000.0]"),
            ("[1.50]", "[1.5]"),
            ("[1e400]", "[1e400]"),
            ("[\"\\/\\u0041\\u001F\\u000a\\u0022\\u005c\"]", "[\"/A\\u001f\\n\\\"\\\\\"]"),
            ("[\"\\ud83d\\ude00\"]", "[\"\u{1F600}\"]"),
            ("[\"\\u00e9\"]", "[\"\u{e9}\"]"),
        ];
        for (i, o) in cases {
            assert_eq!(String::from_utf8(canon(i).unwrap()).unwrap(), *o, "input {i:?}");
        }
    }

    #[test]
    fn errors() {
        for bad in [
            "[01]",
            "[1.]",
            "[1e]",
            "[\"\\ud800\"]",
            "[\"\\udc00\"]",
            "{\"a\":1,\"a\":2}",
            "{\"a\":1,\"\\u0061\":2}",
            "[1,]",
            "[\"\x01\"]",
            "tru",
            "[] x",
            "",
            "{\"a\" 1}",
        ] {
            assert!(canon(bad).is_err(), "{bad:?}");
        }
    }
}
