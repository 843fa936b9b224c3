//! Lexical helpers of the scanner: skipping plain string bytes, whitespace runs and digit runs
//! 16 bytes at a time (SSE2 on x86-64, a portable path elsewhere or with
//! `--cfg kvrelay_portable`), and comparing digit strings.

pub(super) const PLAIN: u8 = 0;
pub(super) const QUOTE: u8 = 1;
pub(super) const BSLASH: u8 = 2;
pub(super) const CTRL: u8 = 3;
pub(super) const HIGH: u8 = 4;

/// Byte classes inside a string.
pub(super) static STR_CLASS: [u8; 256] = {
    let mut t = [PLAIN; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = if i < 0x20 {
            CTRL
        } else if i == b'"' as usize {
            QUOTE
        } else if i == b'\\' as usize {
            BSLASH
        } else if i >= 0x80 {
            HIGH
        } else {
            PLAIN
        };
        i += 1;
    }
    t
};

/// Which scanner this build runs: `"sse2"` (x86-64: 16-byte blocks for hash lists, strings,
/// whitespace runs and digits) or `"portable"` (every other target, and x86-64 built with
/// `--cfg kvrelay_portable`, which the test command uses to run the portable path in CI).
#[doc(hidden)]
pub const SCANNER: &str = if cfg!(all(target_arch = "x86_64", not(kvrelay_portable))) { "sse2" } else { "portable" };

/// One bit per byte of `inp[p..p + 16]` that is not plain string content (a quote, a
/// backslash, a control character or a non-ASCII byte). Panics unless `p + 16 <= inp.len()`
/// (every caller checks that first, so the assertion folds away).
#[cfg(all(target_arch = "x86_64", not(kvrelay_portable)))]
#[inline(always)]
fn special_mask16(inp: &[u8], p: usize) -> u32 {
    use std::arch::x86_64::{
        __m128i, _mm_cmpeq_epi8, _mm_cmplt_epi8, _mm_loadu_si128, _mm_movemask_epi8, _mm_or_si128, _mm_set1_epi8,
    };
    assert!(p + 16 <= inp.len());
    // SAFETY: SSE2 is part of the x86-64 baseline; `p + 16 <= inp.len()` (asserted above), so
    // the 16 bytes loaded are inside `inp`, and `_mm_loadu_si128` needs no alignment.
    unsafe {
        let v = _mm_loadu_si128(inp.as_ptr().add(p).cast::<__m128i>());
        // signed compare: bytes below 0x20 and bytes 0x80.. (negative) both match
        let special = _mm_or_si128(
            _mm_cmplt_epi8(v, _mm_set1_epi8(0x20)),
            _mm_or_si128(_mm_cmpeq_epi8(v, _mm_set1_epi8(b'"' as i8)), _mm_cmpeq_epi8(v, _mm_set1_epi8(b'\\' as i8))),
        );
        _mm_movemask_epi8(special) as u32
    }
}

/// Offset from `p` of the first byte among `inp[p..p + 32]` that is not plain string content,
/// when one of them is and the block holding it is readable: the first 16 bytes are classified
/// when 16 are readable, the next 16 only when the first hold none and 32 are readable. `None`
/// otherwise (the portable build always answers `None`, and its callers take their general
/// path).
#[inline(always)]
pub(super) fn first_special32(inp: &[u8], p: usize) -> Option<usize> {
    #[cfg(all(target_arch = "x86_64", not(kvrelay_portable)))]
    if p + 16 <= inp.len() {
        let mask = special_mask16(inp, p);
        if mask != 0 {
            return Some(mask.trailing_zeros() as usize);
        }
        if p + 32 <= inp.len() {
            let mask = special_mask16(inp, p + 16);
            if mask != 0 {
                return Some(16 + mask.trailing_zeros() as usize);
            }
        }
    }
    let _ = (inp, p);
    None
}

/// Position of the first byte at or after `p` that is not plain string content (a quote, a
/// backslash, a control character or a non-ASCII byte): 16 bytes per step with SSE2 on x86-64.
#[inline(always)]
pub(super) fn skip_plain(inp: &[u8], mut p: usize) -> usize {
    #[cfg(all(target_arch = "x86_64", not(kvrelay_portable)))]
    while p + 16 <= inp.len() {
        let mask = special_mask16(inp, p);
        if mask != 0 {
            return p + mask.trailing_zeros() as usize;
        }
        p += 16;
    }
    while p < inp.len() && STR_CLASS[inp[p] as usize] == PLAIN {
        p += 1;
    }
    p
}

/// Position of the first byte at or after `p` that is not JSON whitespace (space, tab, LF, CR):
/// 16 bytes per step with SSE2 on x86-64 (indentation runs are often longer than 8 bytes).
#[inline(always)]
pub(super) fn skip_ws(inp: &[u8], mut p: usize) -> usize {
    #[cfg(all(target_arch = "x86_64", not(kvrelay_portable)))]
    {
        use std::arch::x86_64::{
            __m128i, _mm_cmpeq_epi8, _mm_loadu_si128, _mm_movemask_epi8, _mm_or_si128, _mm_set1_epi8,
        };
        while p + 16 <= inp.len() {
            // SAFETY: SSE2 is part of the x86-64 baseline; `p + 16 <= inp.len()`, so the 16
            // bytes loaded are inside `inp`, and `_mm_loadu_si128` needs no alignment.
            let mask = unsafe {
                let v = _mm_loadu_si128(inp.as_ptr().add(p).cast::<__m128i>());
                let ws = _mm_or_si128(
                    _mm_or_si128(
                        _mm_cmpeq_epi8(v, _mm_set1_epi8(b' ' as i8)),
                        _mm_cmpeq_epi8(v, _mm_set1_epi8(b'\n' as i8)),
                    ),
                    _mm_or_si128(
                        _mm_cmpeq_epi8(v, _mm_set1_epi8(b'\t' as i8)),
                        _mm_cmpeq_epi8(v, _mm_set1_epi8(b'\r' as i8)),
                    ),
                );
                _mm_movemask_epi8(ws) as u32
            };
            let other = !mask & 0xFFFF;
            if other != 0 {
                return p + other.trailing_zeros() as usize;
            }
            p += 16;
        }
    }
    while p < inp.len() && matches!(inp[p], b' ' | b'\t' | b'\n' | b'\r') {
        p += 1;
    }
    p
}

/// `a <= b` for two ASCII digit strings of the same length (19 or 20): lexicographic order of
/// digits is numeric order, and big-endian words compare lexicographically.
#[inline(always)]
pub(super) fn digits_le(a: &[u8], b: &[u8]) -> bool {
    debug_assert_eq!(a.len(), b.len());
    let be = |s: &[u8], i: usize| u64::from_be_bytes(s[i..i + 8].try_into().expect("8 bytes"));
    let tail = |s: &[u8]| s[16..].iter().fold(0u32, |acc, &c| (acc << 8) | c as u32);
    let (a0, a1, a2) = (be(a, 0), be(a, 8), tail(a));
    let (b0, b1, b2) = (be(b, 0), be(b, 8), tail(b));
    // non-short-circuit operators keep this free of branches
    (a0 < b0) | ((a0 == b0) & ((a1 < b1) | ((a1 == b1) & (a2 <= b2))))
}

/// Number of ASCII digits starting at `p`.
#[inline(always)]
pub(super) fn count_digits(inp: &[u8], p: usize) -> usize {
    skip_digits(inp, p) - p
}

/// Position of the first non-digit at or after `p`: 16 bytes per step with SSE2 (part of the
/// x86-64 baseline), then 8 with SWAR.
#[inline(always)]
pub(super) fn skip_digits(inp: &[u8], mut p: usize) -> usize {
    #[cfg(all(target_arch = "x86_64", not(kvrelay_portable)))]
    {
        use std::arch::x86_64::{
            __m128i, _mm_cmpeq_epi8, _mm_loadu_si128, _mm_min_epu8, _mm_movemask_epi8, _mm_set1_epi8, _mm_sub_epi8,
        };
        while p + 16 <= inp.len() {
            // SAFETY: SSE2 is part of the x86-64 baseline, so these intrinsics are available on
            // every x86-64 CPU; `p + 16 <= inp.len()`, so the 16 bytes loaded are inside `inp`,
            // and `_mm_loadu_si128` has no alignment requirement.
            let mask = unsafe {
                let v = _mm_loadu_si128(inp.as_ptr().add(p).cast::<__m128i>());
                let t = _mm_sub_epi8(v, _mm_set1_epi8(b'0' as i8));
                // digit iff (byte - '0') as unsigned <= 9, i.e. min(t, 9) == t
                _mm_movemask_epi8(_mm_cmpeq_epi8(_mm_min_epu8(t, _mm_set1_epi8(9)), t))
            };
            let non_digit = !(mask as u32) & 0xFFFF;
            if non_digit != 0 {
                return p + non_digit.trailing_zeros() as usize;
            }
            p += 16;
        }
    }
    while p + 8 <= inp.len() {
        let w = u64::from_le_bytes(inp[p..p + 8].try_into().expect("8 bytes"));
        let t = w ^ 0x3030_3030_3030_3030;
        // A byte is a digit iff its high nibble is 0 after the xor and adding 6 does not carry
        // into bit 4. Carries out of a non-digit byte only disturb bytes above the first
        // non-digit, which trailing_zeros never looks at.
        let non_digit = (t & 0xF0F0_F0F0_F0F0_F0F0) | (t.wrapping_add(0x0606_0606_0606_0606) & 0x1010_1010_1010_1010);
        if non_digit != 0 {
            return p + (non_digit.trailing_zeros() / 8) as usize;
        }
        p += 8;
    }
    while p < inp.len() && inp[p].is_ascii_digit() {
        p += 1;
    }
    p
}
