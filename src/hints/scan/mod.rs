//! The one-pass validator and canonical writer.
//!
//! Files: this one drives the pass (the value loop, whitespace, the lazy canonical writer);
//! `index.rs` opens and closes containers, reads member names, checks duplicates and records
//! the protocol 0.1 fields; `numbers.rs` and `strings.rs` scan those tokens.
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

mod index;
mod numbers;
mod strings;

use index::{Frame, KeyRef, Role, Slot};

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
}

#[cfg(test)]
mod tests {
    use super::numbers::decimal_is_shortest;
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
