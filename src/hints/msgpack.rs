//! MessagePack transport of snapshots (SPEC.md section 4).
//!
//! Encoding walks the canonical JSON bytes: objects become maps (member order kept), arrays
//! arrays, strings str, integers the smallest MessagePack int, other numbers f64, `true`/`false`/
//! `null` bool and nil. Decoding turns MessagePack back into canonical JSON text and admits that
//! text with the admission rules (depth, duplicates, limits, 0.1 structure), so a decoded
//! snapshot is exactly as trustworthy as one admitted from JSON, and its canonical bytes equal
//! the sender's.
//!
//! Both directions are iterative (no recursion), allocate only their output, and never trust a
//! length prefix for pre-allocation.

use rmp::Marker;

use super::detail::Detail;
use super::strings::{decode_string, write_canonical_string};

/// A token of canonical JSON (input known to be valid canonical JSON).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Tok<'a> {
    ObjOpen,
    ObjClose,
    ArrOpen,
    ArrClose,
    /// inside of a string, still escaped
    Str(&'a [u8]),
    Num(&'a [u8]),
    True,
    False,
    Null,
}

struct Toks<'a> {
    b: &'a [u8],
    p: usize,
}

impl<'a> Iterator for Toks<'a> {
    type Item = Tok<'a>;
    fn next(&mut self) -> Option<Tok<'a>> {
        let b = self.b;
        while self.p < b.len() && matches!(b[self.p], b',' | b':') {
            self.p += 1;
        }
        let c = *b.get(self.p)?;
        self.p += 1;
        Some(match c {
            b'{' => Tok::ObjOpen,
            b'}' => Tok::ObjClose,
            b'[' => Tok::ArrOpen,
            b']' => Tok::ArrClose,
            b't' => {
                self.p += 3;
                Tok::True
            }
            b'f' => {
                self.p += 4;
                Tok::False
            }
            b'n' => {
                self.p += 3;
                Tok::Null
            }
            b'"' => {
                let s = self.p;
                loop {
                    match b[self.p] {
                        b'"' => break,
                        // canonical escapes are two bytes, or \u00XX whose tail has no quote
                        b'\\' => self.p += 2,
                        _ => self.p += 1,
                    }
                }
                self.p += 1;
                Tok::Str(&b[s..self.p - 1])
            }
            _ => {
                let s = self.p - 1;
                while self.p < b.len() && !matches!(b[self.p], b',' | b'}' | b']' | b':') {
                    self.p += 1;
                }
                Tok::Num(&b[s..self.p])
            }
        })
    }
}

/// Encode canonical JSON bytes as MessagePack, appending to `out`. Two passes: the first counts
/// the members of every container (MessagePack needs them up front), the second writes.
pub(crate) fn encode(canon: &[u8], out: &mut Vec<u8>) {
    // Pass 1: element counts of containers, in order of their opening.
    let mut counts: Vec<u32> = Vec::new();
    let mut open: Vec<usize> = Vec::new();
    for t in (Toks { b: canon, p: 0 }) {
        match t {
            Tok::ObjClose | Tok::ArrClose => {
                open.pop();
            }
            _ => {
                if let Some(&i) = open.last() {
                    counts[i] += 1;
                }
                if matches!(t, Tok::ObjOpen | Tok::ArrOpen) {
                    open.push(counts.len());
                    counts.push(0);
                }
            }
        }
    }
    // Pass 2: write. Object counts include keys and values, hence the halving.
    let mut next = 0;
    let mut text = Vec::new();
    // Writing to a Vec cannot fail; rmp's error type only reports writer errors.
    for t in (Toks { b: canon, p: 0 }) {
        match t {
            Tok::ObjOpen => {
                rmp::encode::write_map_len(out, counts[next] / 2).expect("write to Vec");
                next += 1;
            }
            Tok::ArrOpen => {
                rmp::encode::write_array_len(out, counts[next]).expect("write to Vec");
                next += 1;
            }
            Tok::ObjClose | Tok::ArrClose => {}
            Tok::Str(s) => {
                text.clear();
                decode_string(s, &mut text);
                let s = std::str::from_utf8(&text).expect("snapshot strings are UTF-8");
                rmp::encode::write_str(out, s).expect("write to Vec");
            }
            Tok::Num(n) => {
                let s = std::str::from_utf8(n).expect("numbers are ASCII");
                if n.iter().any(|c| matches!(c, b'.' | b'e' | b'E')) {
                    let v: f64 = s.parse().expect("canonical float");
                    rmp::encode::write_f64(out, v).expect("write to Vec");
                } else if n[0] == b'-' {
                    let v: i64 = s.parse().expect("canonical integer in range");
                    rmp::encode::write_sint(out, v).expect("write to Vec");
                } else {
                    let v: u64 = s.parse().expect("canonical integer in range");
                    rmp::encode::write_uint(out, v).expect("write to Vec");
                }
            }
            Tok::True => rmp::encode::write_bool(out, true).expect("write to Vec"),
            Tok::False => rmp::encode::write_bool(out, false).expect("write to Vec"),
            Tok::Null => rmp::encode::write_nil(out).expect("write to Vec"),
        }
    }
}

struct Reader<'a> {
    b: &'a [u8],
    p: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], Detail> {
        let s = self.b.get(self.p..self.p.checked_add(n).ok_or(eof(self.p))?).ok_or(eof(self.p))?;
        self.p += n;
        Ok(s)
    }
    fn be(&mut self, n: usize) -> Result<u64, Detail> {
        Ok(self.take(n)?.iter().fold(0u64, |a, &c| (a << 8) | c as u64))
    }
}

fn eof(p: usize) -> Detail {
    Detail::at("MessagePack input ends inside a value", p)
}

struct Level {
    left: u64,
    is_map: bool,
    first: bool,
}

/// Transcode one MessagePack value to canonical JSON text, appended to `out`. Containers deeper
/// than `max_depth` are refused here already, so hostile input cannot make the output explode in
/// depth; everything else is checked again when the text is admitted.
pub(crate) fn to_json(b: &[u8], max_depth: usize, out: &mut Vec<u8>) -> Result<(), Detail> {
    let mut r = Reader { b, p: 0 };
    let mut stack: Vec<Level> = Vec::new();
    let mut num = ryu::Buffer::new();
    loop {
        let at = r.p;
        // separator, and whether this item is a map key
        let mut is_key = false;
        if let Some(top) = stack.last_mut() {
            let item = top.left;
            top.left -= 1;
            if top.is_map {
                is_key = item % 2 == 0;
                if !is_key {
                    out.push(b':');
                } else if !top.first {
                    out.push(b',');
                }
            } else if !top.first {
                out.push(b',');
            }
            top.first = false;
        }
        let m = Marker::from_u8(r.take(1)?[0]);
        if is_key && !matches!(m, Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32) {
            return Err(Detail::at("MessagePack map key is not a string", at));
        }
        let mut push = |is_map: bool, n: u64, out: &mut Vec<u8>| -> Result<(), Detail> {
            if stack.len() >= max_depth {
                return Err(Detail::at("nesting deeper than max_depth", at));
            }
            out.push(if is_map { b'{' } else { b'[' });
            stack.push(Level { left: if is_map { n * 2 } else { n }, is_map, first: true });
            Ok(())
        };
        match m {
            Marker::Null => out.extend_from_slice(b"null"),
            Marker::True => out.extend_from_slice(b"true"),
            Marker::False => out.extend_from_slice(b"false"),
            Marker::FixPos(v) => push_int(out, v as i128),
            Marker::FixNeg(v) => push_int(out, v as i128),
            Marker::U8 => push_int(out, r.be(1)? as i128),
            Marker::U16 => push_int(out, r.be(2)? as i128),
            Marker::U32 => push_int(out, r.be(4)? as i128),
            Marker::U64 => push_int(out, r.be(8)? as i128),
            Marker::I8 => push_int(out, r.be(1)? as u8 as i8 as i128),
            Marker::I16 => push_int(out, r.be(2)? as u16 as i16 as i128),
            Marker::I32 => push_int(out, r.be(4)? as u32 as i32 as i128),
            Marker::I64 => push_int(out, r.be(8)? as i64 as i128),
            Marker::F32 | Marker::F64 => {
                let v =
                    if m == Marker::F32 { f32::from_bits(r.be(4)? as u32) as f64 } else { f64::from_bits(r.be(8)?) };
                if !v.is_finite() {
                    return Err(Detail::at("number is not finite as an f64", at));
                }
                out.extend_from_slice(num.format_finite(v).as_bytes());
            }
            Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32 => {
                let n = match m {
                    Marker::FixStr(n) => n as usize,
                    Marker::Str8 => r.be(1)? as usize,
                    Marker::Str16 => r.be(2)? as usize,
                    _ => r.be(4)? as usize,
                };
                let s = std::str::from_utf8(r.take(n)?)
                    .map_err(|_| Detail::at("invalid UTF-8 in a MessagePack string", at))?;
                write_canonical_string(s, out);
            }
            Marker::FixArray(n) => push(false, n as u64, out)?,
            Marker::Array16 => push(false, r.be(2)?, out)?,
            Marker::Array32 => push(false, r.be(4)?, out)?,
            Marker::FixMap(n) => push(true, n as u64, out)?,
            Marker::Map16 => push(true, r.be(2)?, out)?,
            Marker::Map32 => push(true, r.be(4)?, out)?,
            _ => return Err(Detail::at("MessagePack type without a JSON equivalent", at)),
        }
        // close finished containers
        while let Some(top) = stack.last() {
            if top.left > 0 {
                break;
            }
            out.push(if top.is_map { b'}' } else { b']' });
            stack.pop();
        }
        if stack.is_empty() {
            break;
        }
    }
    if r.p != b.len() {
        return Err(Detail::at("unexpected bytes after the MessagePack value", r.p));
    }
    Ok(())
}

fn push_int(out: &mut Vec<u8>, v: i128) {
    // i128 covers both u64 and i64 exactly; formatting to a Vec cannot fail.
    use std::io::Write;
    let _ = write!(out, "{v}");
}
