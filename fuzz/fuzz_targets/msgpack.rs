//! MessagePack decoding of arbitrary bytes: never a panic; whatever decodes re-encodes and
//! re-admits to the same canonical bytes.
#![no_main]

use std::sync::OnceLock;

use kvrelay::{Admission, AdmissionConfig, Outcome};
use libfuzzer_sys::fuzz_target;

fn edge() -> &'static Admission {
    static E: OnceLock<Admission> = OnceLock::new();
    E.get_or_init(|| Admission::new(AdmissionConfig { trusted: true, ..Default::default() }).unwrap())
}

fuzz_target!(|data: &[u8]| {
    let Ok(snap) = edge().decode_msgpack(data) else { return };
    match edge().admit(Some(snap.canonical())) {
        Outcome::Admitted(again) => assert_eq!(again.canonical(), snap.canonical()),
        other => panic!("decoded MessagePack whose canonical bytes are not admitted: {other:?}"),
    }
    let mut mp = Vec::new();
    snap.write_msgpack(&mut mp);
    assert_eq!(edge().decode_msgpack(&mp).expect("own MessagePack").canonical(), snap.canonical());
});
