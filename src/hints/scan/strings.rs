//! The scanner's strings and literals: 16 bytes per step, the escapes canonical form keeps or
//! respells, runs of `\\uXXXX` escapes decoded by table straight into the output.

use super::*;

impl Scanner<'_, '_> {
    /// `true`, `false` or `null` at `self.pos`: the bytes compared as one word.
    #[inline(always)]
    pub(super) fn literal(&mut self, lit: &'static [u8]) -> Result<(), Detail> {
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
    pub(super) fn string(&mut self) -> Result<bool, Detail> {
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
    pub(super) fn string_long(&mut self) -> Result<bool, Detail> {
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
    pub(super) fn escape(&mut self, p: usize) -> Result<usize, Detail> {
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
    pub(super) fn unicode_escapes(&mut self, mut p: usize) -> Result<usize, Detail> {
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
}
