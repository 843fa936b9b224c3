//! Reading one top-level member of a canonical payload without parsing the rest.
//!
//! Payload bytes come from a snapshot, so they are valid canonical JSON. Skipping a value then
//! needs no full parse: the end of an array is decided by strings and square brackets only, and
//! the end of an object by strings and curly braces only, so each skip is a few `memchr3` hops
//! (a whole block-hash array is one hop). Cost: proportional to the number of structural
//! tokens before the member, not to the bytes.

use memchr::{memchr2, memchr3};

/// Position just after the string whose opening quote is at `p`.
fn skip_string(b: &[u8], p: usize) -> usize {
    let mut i = p + 1;
    loop {
        let off = memchr2(b'"', b'\\', &b[i..]).expect("valid canonical string");
        i += off;
        if b[i] == b'"' {
            return i + 1;
        }
        i += 2; // an escape: its second byte is never a quote that ends the string
    }
}

/// Position just after the container opened at `p` (`open` / `close` its brackets).
fn skip_container(b: &[u8], p: usize, open: u8, close: u8) -> usize {
    let mut depth = 0usize;
    let mut i = p;
    loop {
        let off = memchr3(b'"', open, close, &b[i..]).expect("valid canonical container");
        i += off;
        match b[i] {
            b'"' => i = skip_string(b, i),
            c if c == open => {
                depth += 1;
                i += 1;
            }
            _ => {
                depth -= 1;
                i += 1;
                if depth == 0 {
                    return i;
                }
            }
        }
    }
}

/// Position just after the value starting at `p`.
fn skip_value(b: &[u8], p: usize) -> usize {
    match b[p] {
        b'"' => skip_string(b, p),
        b'[' => skip_container(b, p, b'[', b']'),
        b'{' => skip_container(b, p, b'{', b'}'),
        _ => p + b[p..].iter().position(|&c| matches!(c, b',' | b'}' | b']')).unwrap_or(b.len() - p),
    }
}

/// The canonical bytes of the value of top-level member `name` of the canonical object
/// `payload`, if present. `name` is compared with the member name as spelled canonically (names
/// without `"`, `\` or control characters are spelled as themselves).
pub fn member<'a>(payload: &'a [u8], name: &str) -> Option<&'a [u8]> {
    if payload.first() != Some(&b'{') || payload.get(1) == Some(&b'}') {
        return None;
    }
    let mut p = 1;
    loop {
        let key_end = skip_string(payload, p);
        let key = &payload[p + 1..key_end - 1];
        let v = key_end + 1; // past ':'
        let v_end = skip_value(payload, v);
        if key == name.as_bytes() {
            return Some(&payload[v..v_end]);
        }
        if payload[v_end] == b'}' {
            return None;
        }
        p = v_end + 1; // past ','
    }
}

#[cfg(test)]
mod tests {
    use super::member;

    #[test]
    fn finds_members_after_nested_values() {
        let p = br#"{"a":[1,[2,"]"],{"}":"["}],"b":{"c":"}","d":[{}]},"e":"x\"y","f":-1.5e3,"g":true,"source_control_endpoint":"tcp://h:1"}"#;
        assert_eq!(member(p, "a"), Some(&br#"[1,[2,"]"],{"}":"["}]"#[..]));
        assert_eq!(member(p, "b"), Some(&br#"{"c":"}","d":[{}]}"#[..]));
        assert_eq!(member(p, "e"), Some(&br#""x\"y""#[..]));
        assert_eq!(member(p, "f"), Some(&b"-1.5e3"[..]));
        assert_eq!(member(p, "g"), Some(&b"true"[..]));
        assert_eq!(member(p, "source_control_endpoint"), Some(&br#""tcp://h:1""#[..]));
        assert_eq!(member(p, "zz"), None);
        assert_eq!(member(b"{}", "a"), None);
        assert_eq!(member(b"[]", "a"), None);
    }
}
