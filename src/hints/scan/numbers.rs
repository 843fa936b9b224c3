//! The scanner's numbers: integer range checks against the digit strings of the limits, the
//! shortest-form test that lets canonical decimals pass unparsed, ryu for the rest, and lists
//! of plain integers (block hashes) 16 bytes at a time.

use super::*;

/// Largest magnitudes, as decimal digit strings of maximal length, that are still in range.
pub(super) const U64_MAX_DIGITS: &[u8] = b"18446744073709551615";
pub(super) const I64_MIN_DIGITS: &[u8] = b"9223372036854775808";

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
pub(super) fn decimal_is_shortest(int: &[u8], frac: &[u8]) -> bool {
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

impl Scanner<'_, '_> {
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
    pub(super) fn int_blocks<const SPACED: bool>(&mut self) {
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
    pub(super) fn number_run(&mut self) -> Result<(), Detail> {
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
    pub(super) fn list_sep(&mut self, p: usize) -> Option<usize> {
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
    pub(super) fn number(&mut self) -> Result<bool, Detail> {
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
    pub(super) fn note_number(&mut self, what: &'static str, at: usize) {
        if self.res.number_error.is_none() {
            self.res.number_error = Some(Detail::at(what, at));
        }
    }
}
