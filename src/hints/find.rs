//! Where a request body carries its KV hint: one rule for every runtime, over the body's
//! original bytes (so that admission sees the client's own text: its duplicate members, its
//! integers, its size, none of which survive a parse and a re-serialization).
//!
//! A generation request carries at most one hint, under one of five spellings: `kv_hints` (the
//! spelling of OpenAI clients' `extra_body`; one envelope for every prompt, or a list aligned
//! with the prompts: admit it with `admit_batch`), Dynamo's `kv_hint` or `router_hint` at the top
//! level, or either of those two under `kv_transfer_params` (one envelope for the request: admit
//! it with `admit`). A member whose value is `null` is absent. Two present (two spellings, or one
//! spelling twice) is the client's error: the request is answered 400, never served with one of
//! them picked. Anything else in the body is skipped without being looked at further.

use std::ops::Range;

/// Where the hint was found ([`find_hint`]). The values are the C ABI's
/// (`kvrelay_hint_spelling`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub enum HintSpelling {
    /// No hint (none of the spellings, or only `null` ones).
    None = 0,
    /// `kv_hints` at the top level: admit with `admit_batch` over the request's prompts.
    KvHints = 1,
    /// `kv_hint` at the top level: admit with `admit`.
    KvHint = 2,
    /// `router_hint` at the top level: admit with `admit`.
    RouterHint = 3,
    /// `kv_transfer_params.kv_hint`: admit with `admit`.
    TransferKvHint = 4,
    /// `kv_transfer_params.router_hint`: admit with `admit`.
    TransferRouterHint = 5,
}

impl HintSpelling {
    /// The member's path in the body, for messages.
    pub fn as_str(self) -> &'static str {
        match self {
            HintSpelling::None => "none",
            HintSpelling::KvHints => "kv_hints",
            HintSpelling::KvHint => "kv_hint",
            HintSpelling::RouterHint => "router_hint",
            HintSpelling::TransferKvHint => "kv_transfer_params.kv_hint",
            HintSpelling::TransferRouterHint => "kv_transfer_params.router_hint",
        }
    }

    /// Whether the value is admitted per prompt (`kv_hints`: `admit_batch`) rather than once
    /// for the request.
    pub fn batched(self) -> bool {
        self == HintSpelling::KvHints
    }
}

/// The hint of a request body ([`find_hint`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FoundHint {
    /// Which spelling ([`HintSpelling::None`]: no hint).
    pub spelling: HintSpelling,
    /// The value's bytes in the body, exactly as the client sent them (empty when none).
    pub value: Range<usize>,
}

/// Why [`find_hint`] answered no hint to serve.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FindError {
    /// Two hints (two spellings, or one twice): the client's error, a 400.
    Multiple(HintSpelling, HintSpelling),
    /// The body is not one well-formed JSON object (the message says where it broke).
    Malformed(&'static str, usize),
}

impl std::fmt::Display for FindError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FindError::Multiple(a, b) => write!(
                f,
                "a request carries one KV hint: {} and {} are exclusive (kv_hints, kv_hint, router_hint, \
                 kv_transfer_params.kv_hint and kv_transfer_params.router_hint)",
                a.as_str(),
                b.as_str()
            ),
            FindError::Malformed(what, at) => write!(f, "the request body is not a JSON object: {what} at byte {at}"),
        }
    }
}

fn ws(b: &[u8], mut p: usize) -> usize {
    while p < b.len() && matches!(b[p], b' ' | b'\t' | b'\n' | b'\r') {
        p += 1;
    }
    p
}

/// The end of the string that starts at `b[p] == b'"'` (one past its closing quote).
fn string_end(b: &[u8], p: usize) -> Result<usize, FindError> {
    let mut q = p + 1;
    while q < b.len() {
        match b[q] {
            b'"' => return Ok(q + 1),
            b'\\' => q += 2,
            _ => q += 1,
        }
    }
    Err(FindError::Malformed("an unterminated string", p))
}

/// The end of the value that starts at `b[p]` (one past it). Structure only: strings,
/// brackets, and scalars up to the next delimiter; no recursion, whatever the depth.
fn value_end(b: &[u8], p: usize) -> Result<usize, FindError> {
    match b.get(p) {
        None => Err(FindError::Malformed("a missing value", p)),
        Some(b'"') => string_end(b, p),
        Some(b'{' | b'[') => {
            let mut depth = 0usize;
            let mut q = p;
            while q < b.len() {
                match b[q] {
                    b'"' => {
                        q = string_end(b, q)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Ok(q + 1);
                        }
                    }
                    _ => {}
                }
                q += 1;
            }
            Err(FindError::Malformed("an unterminated object or array", p))
        }
        Some(b'}' | b']' | b',' | b':') => Err(FindError::Malformed("a missing value", p)),
        Some(_) => {
            let mut q = p;
            while q < b.len() && !matches!(b[q], b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r') {
                q += 1;
            }
            Ok(q)
        }
    }
}

/// Whether the key text `k` (with its quotes) names `name`, escapes decoded.
fn key_is(k: &[u8], name: &str) -> bool {
    let inner = &k[1..k.len() - 1];
    if !inner.contains(&b'\\') {
        return inner == name.as_bytes();
    }
    serde_json::from_slice::<String>(k).is_ok_and(|s| s == name)
}

/// The members of the object at `b[p] == b'{'`: `each(key, value)` with their ranges (the key
/// with its quotes). Returns the end of the object.
fn members(
    b: &[u8],
    p: usize,
    mut each: impl FnMut(&[u8], Range<usize>) -> Result<(), FindError>,
) -> Result<usize, FindError> {
    let mut q = ws(b, p + 1);
    if b.get(q) == Some(&b'}') {
        return Ok(q + 1);
    }
    loop {
        if b.get(q) != Some(&b'"') {
            return Err(FindError::Malformed("a member without a string key", q));
        }
        let k_end = string_end(b, q)?;
        let key = &b[q..k_end];
        q = ws(b, k_end);
        if b.get(q) != Some(&b':') {
            return Err(FindError::Malformed("a key without a colon", q));
        }
        let v = ws(b, q + 1);
        let v_end = value_end(b, v)?;
        each(key, v..v_end)?;
        q = ws(b, v_end);
        match b.get(q) {
            Some(b',') => q = ws(b, q + 1),
            Some(b'}') => return Ok(q + 1),
            _ => return Err(FindError::Malformed("a member not followed by a comma or the object's end", q)),
        }
    }
}

/// Find the KV hint of a request body (see the module docs): the spelling and the value's
/// original bytes. Cost: one pass over the body, no allocation (a key with escapes is decoded
/// to compare it). Never panics, whatever the bytes.
pub fn find_hint(body: &[u8]) -> Result<FoundHint, FindError> {
    let mut found = FoundHint { spelling: HintSpelling::None, value: 0..0 };
    let mut record = |spelling: HintSpelling, v: Range<usize>| -> Result<(), FindError> {
        if &body[v.clone()] == b"null" {
            return Ok(());
        }
        if found.spelling != HintSpelling::None {
            return Err(FindError::Multiple(found.spelling, spelling));
        }
        found = FoundHint { spelling, value: v };
        Ok(())
    };
    let start = ws(body, 0);
    if body.get(start) != Some(&b'{') {
        return Err(FindError::Malformed("not an object", start));
    }
    let end = members(body, start, |k, v| {
        if key_is(k, "kv_hints") {
            record(HintSpelling::KvHints, v)
        } else if key_is(k, "kv_hint") {
            record(HintSpelling::KvHint, v)
        } else if key_is(k, "router_hint") {
            record(HintSpelling::RouterHint, v)
        } else if key_is(k, "kv_transfer_params") && body[v.start] == b'{' {
            members(body, v.start, |k, v| {
                if key_is(k, "kv_hint") {
                    record(HintSpelling::TransferKvHint, v)
                } else if key_is(k, "router_hint") {
                    record(HintSpelling::TransferRouterHint, v)
                } else {
                    Ok(())
                }
            })
            .map(drop)
        } else {
            Ok(())
        }
    })?;
    let after = ws(body, end);
    if after != body.len() {
        return Err(FindError::Malformed("bytes after the object", after));
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn found(body: &str) -> (HintSpelling, &str) {
        let f = find_hint(body.as_bytes()).unwrap_or_else(|e| panic!("{body}: {e}"));
        (f.spelling, &body[f.value])
    }

    #[test]
    fn every_spelling_gives_the_clients_own_bytes() {
        let env = r#"{ "version" : 1, "actions": [ {"kind":"kv.fetch"} ] }"#;
        for (body, spelling) in [
            (format!(r#"{{"prompt":"a","kv_hints": {env}}}"#), HintSpelling::KvHints),
            (format!(r#"{{"kv_hint":{env},"model":"m"}}"#), HintSpelling::KvHint),
            (format!(r#" {{ "router_hint" : {env} }} "#), HintSpelling::RouterHint),
            (
                format!(r#"{{"kv_transfer_params":{{"x":[1,{{"y":"}}"}}],"kv_hint":{env}}}}}"#),
                HintSpelling::TransferKvHint,
            ),
            (format!(r#"{{"kv_transfer_params":{{"router_hint":{env}}},"n":2}}"#), HintSpelling::TransferRouterHint),
            // an escaped key is the same key
            (format!(r#"{{"kv\u005fhints":{env}}}"#), HintSpelling::KvHints),
        ] {
            assert_eq!(found(&body), (spelling, env), "{body}");
        }
        // a batched list, bytes and whitespace as sent
        let body = r#"{"prompt":["a","b"],"kv_hints":[ null , {"version":1} ]}"#;
        assert_eq!(found(body), (HintSpelling::KvHints, r#"[ null , {"version":1} ]"#));
        assert!(HintSpelling::KvHints.batched() && !HintSpelling::RouterHint.batched());
    }

    #[test]
    fn null_is_absent_and_everything_else_is_skipped() {
        for body in [
            r#"{}"#,
            r#"{"prompt":"kv_hints","kv_hints":null}"#,
            r#"{"kv_hint":null,"router_hint":null,"kv_transfer_params":{"kv_hint":null}}"#,
            r#"{"kv_transfer_params":null}"#,
            r#"{"kv_transfer_params":"kv_hint"}"#,
            r#"{"messages":[{"content":"{\"kv_hints\": 1}"}],"nested":{"kv_hints":{"a":1}}}"#,
        ] {
            assert_eq!(found(body), (HintSpelling::None, ""), "{body}");
        }
        // a hint that is null next to one that is not: the one
        assert_eq!(found(r#"{"kv_hints":null,"router_hint":{"v":1}}"#), (HintSpelling::RouterHint, r#"{"v":1}"#));
    }

    #[test]
    fn two_hints_are_the_clients_error() {
        for (body, a, b) in [
            (r#"{"kv_hints":{},"kv_hint":{}}"#, HintSpelling::KvHints, HintSpelling::KvHint),
            (r#"{"kv_hint":{},"router_hint":{}}"#, HintSpelling::KvHint, HintSpelling::RouterHint),
            (r#"{"kv_hints":{},"kv_hints":[]}"#, HintSpelling::KvHints, HintSpelling::KvHints),
            (
                r#"{"kv_transfer_params":{"kv_hint":1,"router_hint":2}}"#,
                HintSpelling::TransferKvHint,
                HintSpelling::TransferRouterHint,
            ),
            (
                r#"{"router_hint":{},"kv_transfer_params":{"kv_hint":{}}}"#,
                HintSpelling::RouterHint,
                HintSpelling::TransferKvHint,
            ),
        ] {
            let e = find_hint(body.as_bytes()).unwrap_err();
            assert_eq!(e, FindError::Multiple(a, b), "{body}");
            assert!(e.to_string().contains("exclusive"));
        }
    }

    #[test]
    fn a_body_that_is_not_one_object_is_refused_and_nothing_panics() {
        for body in [
            "",
            "[]",
            "1",
            "{",
            "{\"a\"",
            "{\"a\":",
            "{\"a\":1",
            "{\"a\":1,}",
            "{\"a\" 1}",
            "{1:2}",
            "{\"a\":\"b}",
            "{\"a\":[1,2}",
            "{} {}",
            "{\"kv_hints\":{\"a\":[}",
            "{\"a\":}",
            "{\"a\":,}",
        ] {
            assert!(matches!(find_hint(body.as_bytes()), Err(FindError::Malformed(..))), "{body:?}");
        }
        // every prefix and every single-byte change of a real body: an answer, never a panic
        let body = br#"{"model":"m","kv_transfer_params":{"router_hint":{"version":1,"a":["\"",{}]}},"n":1}"#;
        for i in 0..=body.len() {
            let _ = find_hint(&body[..i]);
            for c in [b'"', b'{', b'}', b'\\', b',', b'[', b']', b':', 0xff] {
                let mut m = body.to_vec();
                if i < m.len() {
                    m[i] = c;
                    if let Ok(f) = find_hint(&m) {
                        assert!(f.value.end <= m.len());
                    }
                }
            }
        }
    }
}
