//! Admission of arbitrary bytes, with serde_json as the oracle: whatever kvrelay admits,
//! serde_json parses; without floats, its compact form equals kvrelay's canonical bytes;
//! canonical bytes re-admit to themselves; the MessagePack round trip is byte-identical. The
//! request-body hint finder runs over the same bytes: no panic, and a hint cut out of a body
//! serde_json parses parses too.
#![no_main]

use std::sync::OnceLock;

use kvrelay::{Admission, AdmissionConfig, Outcome};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

fn edge() -> &'static Admission {
    static E: OnceLock<Admission> = OnceLock::new();
    E.get_or_init(|| Admission::new(AdmissionConfig { trusted: true, ..Default::default() }).unwrap())
}

fn has_float(v: &Value) -> bool {
    match v {
        Value::Number(n) => n.is_f64(),
        Value::Array(a) => a.iter().any(has_float),
        Value::Object(o) => o.values().any(has_float),
        _ => false,
    }
}

fuzz_target!(|data: &[u8]| {
    // the hint finder over the same bytes: never a panic, a value inside the body, and on a
    // well-formed JSON body a value that is itself well-formed JSON (serde_json the oracle)
    if let Ok(found) = kvrelay::hints::find_hint(data) {
        assert!(found.value.end <= data.len());
        if found.spelling != kvrelay::hints::HintSpelling::None && serde_json::from_slice::<Value>(data).is_ok() {
            serde_json::from_slice::<Value>(&data[found.value.clone()])
                .expect("a hint value cut out of a valid body is valid");
        }
    }
    let Outcome::Admitted(snap) = edge().admit(Some(data)) else { return };
    let mut de = serde_json::Deserializer::from_slice(data);
    de.disable_recursion_limit();
    let v: Value = serde::Deserialize::deserialize(&mut de).expect("kvrelay admitted what serde_json rejects");
    de.end().expect("trailing bytes after an admitted document");
    if !has_float(&v) {
        let compact = serde_json::to_vec(&v).unwrap();
        assert_eq!(compact, snap.canonical(), "canonical bytes differ from serde_json's compact form");
    }
    match edge().admit(Some(snap.canonical())) {
        Outcome::Admitted(again) => {
            assert_eq!(again.canonical(), snap.canonical(), "canonical bytes are not idempotent")
        }
        other => panic!("canonical bytes not admitted again: {other:?}"),
    }
    let mut mp = Vec::new();
    snap.write_msgpack(&mut mp);
    let back = edge().decode_msgpack(&mp).expect("own MessagePack refused");
    assert_eq!(back.canonical(), snap.canonical(), "MessagePack round trip changed the bytes");
});
