//! kvrelay admission beside the SIMD JSON parsers available to Rust, on the envelopes of the
//! admission benchmark (`benches/common`: the same generator, seeds and order), with serde_json
//! validate-only (`IgnoredAny`) as the anchor measured in the same run.
//!
//! ```text
//! cargo run --release --manifest-path benches/peers/Cargo.toml
//! RUSTFLAGS="-Ctarget-cpu=native" cargo run --release --manifest-path benches/peers/Cargo.toml
//! ```
//!
//! The second line lets sonic-rs use the machine's AVX2/AVX-512 (it picks its kernels when it
//! is compiled); simd-json picks them at run time either way (`runtime-detection`).
//!
//! What is measured, per envelope (fastest of 41 samples, as in the admission benchmark):
//! - kvrelay admission: validation, canonical bytes, the 0.1 index, the snapshot;
//! - anchor: serde_json `from_slice::<IgnoredAny>`;
//! - simd-json: `to_tape_with_buffers` over a copy of the input (simd-json parses in place, so
//!   the copy is part of its cost; its time alone is printed too), buffers reused;
//! - sonic-rs: `from_slice::<IgnoredAny>` and `from_slice::<LazyValue>` (a skip over the
//!   whole document).
//!
//! It also prints what each one accepts of four inputs SPEC.md section 2 refuses, to show that
//! none of the others does the work admission does.

#[path = "../../common/mod.rs"]
mod common;

use std::hint::black_box;

use common::{fmt_ns, measure};
use kvrelay::hints::Scratch;
use kvrelay::{Admission, AdmissionConfig, Outcome};

fn main() {
    let edge = Admission::new(AdmissionConfig { trusted: true, ..Default::default() }).unwrap();
    let mut sc = Scratch::with_limits(65_536, 128);
    println!(
        "| envelope | bytes | kvrelay admit | serde_json IgnoredAny | simd-json tape (copy) | sonic-rs IgnoredAny | sonic-rs LazyValue | kvrelay / anchor | fastest peer / anchor |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for (name, raw) in common::selected_admission_cases(&edge) {
        let raw = raw.as_bytes();
        let ours = common::time_admit(&edge, &mut sc, raw);
        let anchor = common::time_validate_only(raw);
        let mut buf = raw.to_vec();
        let mut bufs = simd_json::Buffers::new(raw.len());
        let simd = measure(|| {
            buf.copy_from_slice(black_box(raw));
            let tape = simd_json::to_tape_with_buffers(&mut buf, &mut bufs).unwrap();
            black_box(tape.0.len());
        });
        let copy = measure(|| {
            buf.copy_from_slice(black_box(raw));
            black_box(&buf);
        });
        let sonic = measure(|| {
            let v: serde::de::IgnoredAny = sonic_rs::from_slice(black_box(raw)).unwrap();
            black_box(v);
        });
        let lazy = measure(|| {
            let v: sonic_rs::LazyValue = sonic_rs::from_slice(black_box(raw)).unwrap();
            black_box(v);
        });
        let best = simd.min(sonic).min(lazy);
        println!(
            "| {name} | {} | {} | {} | {} ({}) | {} | {} | {:.2}x | {:.2}x |",
            raw.len(),
            fmt_ns(ours),
            fmt_ns(anchor),
            fmt_ns(simd),
            fmt_ns(copy),
            fmt_ns(sonic),
            fmt_ns(lazy),
            anchor / ours,
            anchor / best
        );
    }
    println!();
    println!("| input (refused by SPEC.md section 2) | kvrelay | serde_json IgnoredAny | simd-json tape | sonic-rs IgnoredAny |");
    println!("|---|---|---|---|---|");
    // Each probe is an admissible envelope with one defect: the same envelope with the
    // control text in its place is admitted, so a refusal is the defect's.
    let probes: [(&str, &[u8], &[u8]); 4] = [
        ("invalid UTF-8 in a string", b"\"x\":\"\xff\xfe\"", br#""x":"ok""#),
        ("duplicate member names", br#""x":1,"x":2"#, br#""x":1,"y":2"#),
        ("number not finite as an f64", br#""x":1e999"#, br#""x":1e99"#),
        ("integer above 2^64-1", br#""x":18446744073709551616"#, br#""x":18446744073709551615"#),
    ];
    let envelope = |members: &[u8]| {
        let mut e = br#"{"protocol_version":"0.1","message_id":"m","actions":[],"#.to_vec();
        e.extend_from_slice(members);
        e.push(b'}');
        e
    };
    let word = |ok: bool| if ok { "accepted" } else { "refused" };
    for (what, defect, control) in probes {
        assert!(matches!(edge.admit(Some(&envelope(control))), Outcome::Admitted(_)), "{what}: control admitted");
        let raw = &envelope(defect)[..];
        let ours = matches!(edge.admit(Some(raw)), Outcome::Admitted(_));
        let serde = serde_json::from_slice::<serde::de::IgnoredAny>(raw).is_ok();
        let simd = simd_json::to_tape(&mut raw.to_vec()).is_ok();
        let sonic = sonic_rs::from_slice::<serde::de::IgnoredAny>(raw).is_ok();
        println!("| {what} | {} | {} | {} | {} |", word(ours), word(serde), word(simd), word(sonic));
    }
}
