//! Property tests: canonical bytes against an independent reference writer (below), round
//! trips, idempotence, and byte mutations of valid envelopes.
//!
//! serde_json's own compact writer is not the oracle: since 1.0.15x it formats floats with
//! another algorithm (`1e+124` where SPEC.md's ryu form is `1e124`).

use kvrelay::{Admission, AdmissionConfig, Outcome, Snapshot};
use proptest::prelude::*;
use serde_json::{json, Value};

#[path = "../benches/common/shapes.rs"]
mod shapes;
use shapes::{Shape, Style, Ws, J};

fn edge() -> Admission {
    Admission::new(AdmissionConfig { trusted: true, max_bytes: 1 << 22, max_raw_bytes: 1 << 22, ..Default::default() })
        .unwrap()
}

/// SPEC.md section 3 over a parsed value (member order kept by `preserve_order`): strings
/// escaped as serde_json escapes them (only `"`, `\\` and controls, lowercase hex), integers in
/// decimal, floats in ryu's shortest form.
fn reference_canonical(v: &Value, out: &mut Vec<u8>) {
    match v {
        Value::Array(a) => {
            out.push(b'[');
            for (i, e) in a.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                reference_canonical(e, out);
            }
            out.push(b']');
        }
        Value::Object(m) => {
            out.push(b'{');
            for (i, (k, e)) in m.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                out.extend_from_slice(serde_json::to_string(k).unwrap().as_bytes());
                out.push(b':');
                reference_canonical(e, out);
            }
            out.push(b'}');
        }
        Value::Number(n) if n.is_f64() => {
            out.extend_from_slice(ryu::Buffer::new().format_finite(n.as_f64().unwrap()).as_bytes())
        }
        other => out.extend_from_slice(serde_json::to_string(other).unwrap().as_bytes()),
    }
}

fn reference(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    reference_canonical(v, &mut out);
    out
}

fn arb_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(Value::from),
        (-1000i32..1000, -30i32..30).prop_map(|(m, e)| Value::from(m as f64 * 10f64.powi(e))),
        any::<String>().prop_map(Value::String),
        "[a-c\"\\\\\u{0}-\u{1f}\u{7f}é😀]{0,6}".prop_map(Value::String),
    ];
    leaf.prop_recursive(5, 64, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec(("[a-d]{0,3}|.{0,4}", inner), 0..6)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

fn envelope(payload: Value, extra: Value) -> Value {
    json!({
        "protocol_version": "0.1",
        "message_id": "m",
        "actions": [
            {"action_id": "a", "action_type": "kv.fetch", "action_version": "1.0", "payload": {"x": payload.clone(), "source_control_endpoint": payload}},
            {"action_id": "a", "action_type": "other", "action_version": "9", "payload": {}, "e": extra.clone()}
        ],
        "extra": extra
    })
}

/// Escape every non-ASCII character as `\uXXXX` (surrogate pairs for astral ones), as
/// `ensure_ascii` writers do. Non-ASCII only occurs inside strings, so this stays valid JSON.
fn ascii_escaped(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        if c.is_ascii() {
            o.push(c);
        } else {
            let mut u = [0u16; 2];
            for unit in c.encode_utf16(&mut u) {
                o.push_str(&format!("\\u{unit:04X}"));
            }
        }
    }
    o
}

/// The same tree for the shapes writer (member order kept; integers stay integers).
fn to_j(v: &Value) -> J {
    match v {
        Value::Null => J::Null,
        Value::Bool(b) => J::Bool(*b),
        Value::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => J::UInt(u),
            (None, Some(i)) => J::Int(i),
            _ => J::Float(n.as_f64().unwrap()),
        },
        Value::String(s) => J::Str(s.clone()),
        Value::Array(a) => J::Arr(a.iter().map(to_j).collect()),
        Value::Object(m) => J::Obj(m.iter().map(|(k, v)| (k.clone(), to_j(v))).collect()),
    }
}

/// Every spelling the scanner has a path for: compact, spaced, indented by 1 to 4, random
/// whitespace (spaces, tabs, LF, CR) everywhere JSON allows it; with or without `ensure_ascii`.
fn arb_style() -> impl Strategy<Value = Style> {
    (0u8..4, 1usize..5, any::<u64>(), any::<bool>()).prop_map(|(k, n, seed, ensure_ascii)| Style {
        ws: match k {
            0 => Ws::Compact,
            1 => Ws::Spaced,
            2 => Ws::Indent(n),
            _ => Ws::Random(seed),
        },
        ensure_ascii,
    })
}

/// Decimal and exponent spellings, shortest or not, near the limits of the fast path (15
/// significant digits, four zeros after the point, trailing zeros, `-0.0`).
const DECIMAL: &str = "-?(0|[1-9][0-9]{0,17})(\\.(0{0,6}[0-9]{0,12}[1-9]|0{1,3}))?([eE][-+]?[0-9]{1,2})?";

fn admitted(edge: &Admission, raw: &[u8]) -> Snapshot {
    match edge.admit(Some(raw)) {
        Outcome::Admitted(s) => s,
        other => panic!("not admitted: {other:?} for {}", String::from_utf8_lossy(raw)),
    }
}

proptest! {
    // 256 cases in CI; PROPTEST_CASES=N runs longer searches locally.
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256),
        ..ProptestConfig::default()
    })]

    #[test]
    fn canonical_equals_serde_json_compact_in_every_spelling(payload in arb_json(), extra in arb_json()) {
        let v = envelope(payload, extra);
        let compact = reference(&v);
        let edge = edge();
        for raw in [serde_json::to_vec(&v).unwrap(), serde_json::to_vec_pretty(&v).unwrap(), ascii_escaped(&serde_json::to_string_pretty(&v).unwrap()).into_bytes()] {
            let s = admitted(&edge, &raw);
            prop_assert_eq!(s.canonical(), &compact[..]);
            // decode() equals serde_json's parse of the same input
            prop_assert_eq!(s.decode(), serde_json::from_slice::<Value>(&raw).unwrap());
        }
    }

    #[test]
    fn generated_shapes_in_every_spelling_equal_the_reference(
        shape in 0usize..3,
        n in 0usize..24,
        seed in any::<u64>(),
        style in arb_style(),
    ) {
        let tree = shapes::envelope(Shape::ALL[shape], n, seed);
        let raw = shapes::write(&tree, style);
        let v: Value = serde_json::from_str(&raw).unwrap();
        let edge = edge();
        let s = admitted(&edge, raw.as_bytes());
        prop_assert_eq!(s.canonical(), &reference(&v)[..]);
        let again = admitted(&edge, s.canonical());
        prop_assert_eq!(again.canonical(), s.canonical());
    }

    #[test]
    fn whitespace_everywhere_escapes_and_number_spellings_equal_the_reference(
        payload in arb_json(),
        extra in arb_json(),
        decimals in prop::collection::vec(
            proptest::string::string_regex(DECIMAL).unwrap().prop_filter("SPEC writes the integer -0 as 0", |d| d != "-0"),
            0..24,
        ),
        style in arb_style(),
    ) {
        let mut tree = to_j(&envelope(payload, extra));
        // decimals in a plain list (the number-list path) and as member values
        let J::Obj(root) = &mut tree else { unreachable!() };
        root.push(("list".into(), J::Arr(decimals.iter().map(|d| J::Raw(d.clone())).collect())));
        root.push(("members".into(), J::Obj(decimals.iter().enumerate().map(|(i, d)| (format!("d{i}"), J::Raw(d.clone()))).collect())));
        let raw = shapes::write(&tree, style);
        let v: Value = serde_json::from_str(&raw).unwrap();
        let edge = edge();
        let s = admitted(&edge, raw.as_bytes());
        prop_assert_eq!(s.canonical(), &reference(&v)[..]);
        prop_assert_eq!(s.decode(), v);
    }

    #[test]
    fn canonical_is_idempotent_and_msgpack_round_trips(payload in arb_json(), extra in arb_json()) {
        let edge = edge();
        let raw = ascii_escaped(&serde_json::to_string_pretty(&envelope(payload, extra)).unwrap());
        let s = admitted(&edge, raw.as_bytes());
        let again = admitted(&edge, s.canonical());
        prop_assert_eq!(again.canonical(), s.canonical());
        let mp = s.to_msgpack();
        let back = edge.decode_msgpack(&mp).unwrap();
        prop_assert_eq!(back.canonical(), s.canonical());
        prop_assert_eq!(back.to_msgpack(), mp);
        // the index agrees with the decoded tree
        let v = s.decode();
        prop_assert_eq!(s.action_count(), v["actions"].as_array().unwrap().len());
        for a in s.actions() {
            let va = &v["actions"][a.index()];
            prop_assert_eq!(a.id(), va["action_id"].as_str().unwrap());
            prop_assert_eq!(a.action_type(), va["action_type"].as_str().unwrap());
            prop_assert_eq!(a.payload(), &reference(&va["payload"])[..]);
            prop_assert_eq!(a.endpoint_value(), kvrelay::policy::payload_member(a.payload(), "source_control_endpoint"));
        }
    }

    #[test]
    fn mutated_envelopes_never_admit_what_is_not_canonical_json(
        payload in arb_json(),
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..3), 1..4),
    ) {
        let edge = edge();
        let mut raw = serde_json::to_vec(&envelope(payload, Value::Null)).unwrap();
        for (at, byte, op) in edits {
            let i = at.index(raw.len());
            match op {
                0 => raw[i] = byte,
                1 => raw.insert(i, byte),
                _ => { raw.remove(i); }
            }
            if raw.is_empty() { break; }
        }
        if let Outcome::Admitted(s) = edge.admit(Some(&raw)) {
            // whatever we admit, serde_json parses too, and our bytes are its compact form
            let parsed: Value = serde_json::from_slice(&raw).expect("admitted input is JSON");
            let reparsed: Value = serde_json::from_slice(s.canonical()).unwrap();
            prop_assert_eq!(reference(&reparsed), s.canonical().to_vec());
            prop_assert!(parsed.is_object());
            let again = admitted(&edge, s.canonical());
            prop_assert_eq!(again.canonical(), s.canonical());
        }
    }

    #[test]
    fn msgpack_decoding_survives_garbage_and_mutations(
        payload in arb_json(),
        junk in prop::collection::vec(any::<u8>(), 0..64),
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
    ) {
        let edge = edge();
        // arbitrary bytes: any outcome but a panic
        let _ = edge.decode_msgpack(&junk);
        // a valid encoding with a few bytes changed: whatever decodes must be a consistent snapshot
        let s = admitted(&edge, &serde_json::to_vec(&envelope(payload, Value::Null)).unwrap());
        let mut mp = s.to_msgpack();
        for (at, byte) in edits {
            let i = at.index(mp.len());
            mp[i] = byte;
        }
        if let Ok(d) = edge.decode_msgpack(&mp) {
            let again = edge.decode_msgpack(&d.to_msgpack()).unwrap();
            prop_assert_eq!(again.canonical(), d.canonical());
            let readmitted = admitted(&edge, d.canonical());
            prop_assert_eq!(readmitted.canonical(), d.canonical());
        }
    }
}
