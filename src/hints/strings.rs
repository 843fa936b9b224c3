//! The JSON string codec shared by the scanner, snapshots, MessagePack and the policy: UTF-8
//! validation of multi-byte sequences, `\\uXXXX` escapes, the canonical spelling of a code point
//! (SPEC.md section 3), and decoding or writing a whole string.

use super::detail::Detail;

/// The value of each hexadecimal digit (either case); 0xFF for every other byte.
static HEX_VAL: [u8; 256] = {
    let mut t = [0xFFu8; 256];
    let mut i = 0;
    while i < 10 {
        t[b'0' as usize + i] = i as u8;
        i += 1;
    }
    let mut i = 0;
    while i < 6 {
        t[b'a' as usize + i] = 10 + i as u8;
        t[b'A' as usize + i] = 10 + i as u8;
        i += 1;
    }
    t
};

/// The four hexadecimal digits at `p` (of a `\uXXXX` escape), by table: four loads, one test.
#[inline(always)]
pub(super) fn hex4(inp: &[u8], p: usize) -> Option<u32> {
    let h = inp.get(p..p + 4)?;
    let d = |i: usize| u32::from(HEX_VAL[h[i] as usize]);
    let (a, b, c, e) = (d(0), d(1), d(2), d(3));
    // an invalid digit is 0xFF, whose high bits survive the OR
    if (a | b | c | e) > 15 {
        return None;
    }
    Some(a << 12 | b << 8 | c << 4 | e)
}

/// The code point of the `\uXXXX` escape whose backslash is at `p` (a surrogate pair joined)
/// and the position after it; a bad digit or a lone surrogate is an error at `p`.
#[inline(always)]
pub(super) fn unicode_escape_at(inp: &[u8], p: usize) -> Result<(u32, usize), Detail> {
    let hi = hex4(inp, p + 2).ok_or_else(|| Detail::at("invalid \\u escape", p))?;
    if !(0xD800..0xE000).contains(&hi) {
        return Ok((hi, p + 6));
    }
    // a high surrogate, then an escaped low one
    if hi < 0xDC00 && inp.get(p + 6..p + 8) == Some(b"\\u") {
        if let Some(lo) = hex4(inp, p + 8).filter(|lo| (0xDC00..0xE000).contains(lo)) {
            return Ok((0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00), p + 12));
        }
    }
    Err(Detail::at("lone surrogate escape", p))
}

/// The UTF-8 bytes of a non-ASCII code point (not a surrogate) in little-endian order in one
/// word, and their count: what one unaligned 32-bit store writes. The same bytes as
/// `char::encode_utf8` (`utf8_word_matches_encode_utf8`), without its buffer.
#[inline(always)]
pub(super) fn utf8_word(cp: u32) -> (u32, usize) {
    debug_assert!(cp >= 0x80 && char::from_u32(cp).is_some());
    if cp < 0x800 {
        (0xC0 | cp >> 6 | (0x80 | cp & 0x3F) << 8, 2)
    } else if cp < 0x1_0000 {
        (0xE0 | cp >> 12 | (0x80 | cp >> 6 & 0x3F) << 8 | (0x80 | cp & 0x3F) << 16, 3)
    } else {
        (0xF0 | cp >> 18 | (0x80 | cp >> 12 & 0x3F) << 8 | (0x80 | cp >> 6 & 0x3F) << 16 | (0x80 | cp & 0x3F) << 24, 4)
    }
}

pub(super) const HEX: &[u8; 16] = b"0123456789abcdef";

/// The canonical spelling of one code point inside a string.
#[inline]
pub(super) fn canonical_char(cp: u32, buf: &mut [u8; 6]) -> &[u8] {
    match cp {
        0x08 => b"\\b",
        0x09 => b"\\t",
        0x0A => b"\\n",
        0x0C => b"\\f",
        0x0D => b"\\r",
        0x22 => b"\\\"",
        0x5C => b"\\\\",
        0..=0x1F => {
            *buf = [b'\\', b'u', b'0', b'0', HEX[(cp >> 4) as usize], HEX[(cp & 15) as usize]];
            &buf[..]
        }
        _ => {
            let c = char::from_u32(cp).expect("surrogates were excluded");
            let n = c.encode_utf8(&mut buf[..4]).len();
            &buf[..n]
        }
    }
}

/// Validate one multi-byte UTF-8 sequence starting at `p` (RFC 3629, Unicode table 3-7);
/// returns the position after it.
///
/// With four bytes readable at `p` (every character but the input's last few) the lead byte's
/// pattern picks the length, the continuation bytes are checked with one mask on a 32-bit load,
/// and overlongs, surrogates and values past U+10FFFF are refused from the decoded code point:
/// about ten instructions per character, no table. Otherwise (or for a sequence this refuses,
/// to report it) the table of [`utf8_seq_tail`] decides; both accept exactly the same
/// sequences (`utf8_fast_path_agrees`).
#[inline(always)]
pub(super) fn utf8_seq(inp: &[u8], p: usize) -> Result<usize, Detail> {
    if let Some(w) = inp.get(p..p + 4) {
        let w = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
        let b0 = w & 0xFF;
        let c1 = (w >> 8) & 0x3F;
        let c2 = (w >> 16) & 0x3F;
        if b0 & 0xE0 == 0xC0 {
            if b0 >= 0xC2 && w & 0xC000 == 0x8000 {
                return Ok(p + 2);
            }
        } else if b0 & 0xF0 == 0xE0 {
            let cp = (b0 & 0x0F) << 12 | c1 << 6 | c2;
            if w & 0xC0_C000 == 0x80_8000 && cp >= 0x800 && !(0xD800..0xE000).contains(&cp) {
                return Ok(p + 3);
            }
        } else if b0 & 0xF8 == 0xF0 {
            let cp = (b0 & 0x07) << 18 | c1 << 12 | c2 << 6 | (w >> 24) & 0x3F;
            if w & 0xC0C0_C000 == 0x8080_8000 && (0x1_0000..=0x10_FFFF).contains(&cp) {
                return Ok(p + 4);
            }
        }
        return Err(Detail::at("invalid UTF-8", p));
    }
    utf8_seq_tail(inp, p)
}

/// [`utf8_seq`] by the table of RFC 3629 (for the last bytes of the input).
#[inline(never)]
fn utf8_seq_tail(inp: &[u8], p: usize) -> Result<usize, Detail> {
    let b0 = inp[p];
    let (n, lo, hi) = match b0 {
        0xC2..=0xDF => (2, 0x80, 0xBF),
        0xE0 => (3, 0xA0, 0xBF),
        0xE1..=0xEC | 0xEE..=0xEF => (3, 0x80, 0xBF),
        0xED => (3, 0x80, 0x9F),
        0xF0 => (4, 0x90, 0xBF),
        0xF1..=0xF3 => (4, 0x80, 0xBF),
        0xF4 => (4, 0x80, 0x8F),
        _ => return Err(Detail::at("invalid UTF-8", p)),
    };
    let Some(rest) = inp.get(p + 1..p + n) else {
        return Err(Detail::at("invalid UTF-8", p));
    };
    if !(lo..=hi).contains(&rest[0]) || rest[1..].iter().any(|&c| !(0x80..=0xBF).contains(&c)) {
        return Err(Detail::at("invalid UTF-8", p));
    }
    Ok(p + n)
}

/// Decode the inside of a string that has already been validated (raw input or canonical
/// bytes) and append the UTF-8 text to `out`.
pub(crate) fn decode_string(inner: &[u8], out: &mut Vec<u8>) {
    let mut i = 0;
    while i < inner.len() {
        let Some(off) = inner[i..].iter().position(|&b| b == b'\\') else {
            out.extend_from_slice(&inner[i..]);
            return;
        };
        out.extend_from_slice(&inner[i..i + off]);
        i += off;
        let c = inner[i + 1];
        let simple = match c {
            b'"' => Some(b'"'),
            b'\\' => Some(b'\\'),
            b'/' => Some(b'/'),
            b'b' => Some(0x08),
            b'f' => Some(0x0C),
            b'n' => Some(b'\n'),
            b'r' => Some(b'\r'),
            b't' => Some(b'\t'),
            _ => None,
        };
        if let Some(s) = simple {
            out.push(s);
            i += 2;
            continue;
        }
        let (cp, end) = unicode_escape_at(inner, i).expect("validated \\u escape");
        let c = char::from_u32(cp).expect("validated code point");
        let mut b = [0u8; 4];
        out.extend_from_slice(c.encode_utf8(&mut b).as_bytes());
        i = end;
    }
}

/// Append `s` as a canonical JSON string (with quotes) to `out`.
pub(crate) fn write_canonical_string(s: &str, out: &mut Vec<u8>) {
    out.push(b'"');
    let bytes = s.as_bytes();
    let mut run = 0;
    for (i, &b) in bytes.iter().enumerate() {
        if b < 0x20 || b == b'"' || b == b'\\' {
            out.extend_from_slice(&bytes[run..i]);
            let mut buf = [0u8; 6];
            out.extend_from_slice(canonical_char(b as u32, &mut buf));
            run = i + 1;
        }
    }
    out.extend_from_slice(&bytes[run..]);
    out.push(b'"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex4_reads_every_digit_and_refuses_the_rest() {
        // every byte value in every position, the other positions digits of both cases
        let fill = [b'f', b'0', b'A', b'9'];
        for lane in 0..4 {
            for b in 0u8..=255 {
                let mut text = fill;
                text[lane] = b;
                let want = text.iter().try_fold(0u32, |acc, &c| (c as char).to_digit(16).map(|d| acc << 4 | d));
                assert_eq!(hex4(&text, 0), want, "position {lane}, byte {b:#x}");
            }
        }
        assert_eq!(hex4(b"12", 0), None);
        assert_eq!(hex4(b"\\u00e9", 2), Some(0xE9));
        assert_eq!(hex4(b"FFFF", 0), Some(0xFFFF));
    }

    #[test]
    fn utf8_word_matches_encode_utf8() {
        for c in (0x80u32..=0x10FFFF).filter_map(char::from_u32) {
            let mut b = [0u8; 4];
            let want = c.encode_utf8(&mut b).as_bytes();
            let (word, n) = utf8_word(c as u32);
            assert_eq!(&word.to_le_bytes()[..n], want, "{:#x}", c as u32);
        }
    }

    #[test]
    fn utf8_fast_path_agrees() {
        // Every lead byte with every second byte, and third and fourth bytes at the edges of the
        // continuation range: the fast path (four bytes readable), the table (the sequence at
        // the very end) and the standard library agree on acceptance and length.
        let edges = [0x00u8, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xFF];
        for b0 in 0x80u8..=0xFF {
            for b1 in 0u8..=0xFF {
                for &b2 in &edges {
                    for &b3 in &edges {
                        let seq = [b0, b1, b2, b3, b'"'];
                        let want = match std::str::from_utf8(&seq[..4]) {
                            Ok(s) => Some(s.chars().next().unwrap().len_utf8()),
                            Err(e) if e.valid_up_to() > 0 => Some(
                                e.valid_up_to().min(
                                    std::str::from_utf8(&seq[..e.valid_up_to()])
                                        .unwrap()
                                        .chars()
                                        .next()
                                        .unwrap()
                                        .len_utf8(),
                                ),
                            ),
                            Err(_) => None,
                        };
                        let fast = utf8_seq(&seq, 0).ok();
                        assert_eq!(fast, want, "{seq:02x?}");
                        let n = fast.unwrap_or(4);
                        let tail = utf8_seq_tail(&seq[..n], 0).ok();
                        assert_eq!(tail, want, "{seq:02x?} at the end");
                    }
                }
            }
        }
    }
}
