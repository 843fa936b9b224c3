//! Admission benchmark (`cargo bench --bench admission`).
//!
//! Envelopes, each admitted as given:
//! - cases 0-3, the envelopes of the first runs: one `kv.fetch` action with random u64 block
//!   hashes, small (2 hashes), medium (256), max (the most hashes whose canonical encoding fits
//!   65,536 bytes), and max spaced (a space after every `:` and `,`);
//! - the generated shapes of `common/shapes.rs` (seeded): `hashes` indented; `mixed` (many
//!   actions whose payloads mix strings, floats, small integers, booleans, nested objects) and
//!   `strings` (string-heavy, with escapes, surrogate pairs and non-ASCII text), each small
//!   (about 250 bytes), medium and max, compact, spaced (`json.dumps` default separators) and
//!   indented (`json.dumps(indent=2)`); `strings` also spaced with `ensure_ascii`.
//!
//! For each, in the same run and on the same input bytes:
//! - kvrelay admission (validation, canonical bytes, index, the one snapshot allocation);
//! - anchor A: serde_json parse to `Value` plus `to_vec` (the round trip a naive edge does);
//! - anchor B: serde_json validate-only (deserialize into `IgnoredAny`; it does less than
//!   admission: it accepts invalid UTF-8 in strings, duplicate names and numbers out of range).
//!
//! The envelopes are built by `common::admission_cases`; `benches/peers` (a separate package)
//! measures the same envelopes with simd-json and sonic-rs beside admission and anchor B.
//!
//! Timing: each figure is the fastest of 41 samples; each sample runs the operation enough
//! times to take about 1 ms. The minimum is the estimate least disturbed by other load on a
//! shared machine, and every operation, ours and the anchors, is measured the same way in the
//! same run, so the ratios compare like with like. Single thread. Prints a Markdown table for
//! `benches/RESULTS.md`.
//!
//! Environment: `KVRELAY_BENCH_QUICK=1` takes fewer samples (for a smoke run);
//! `KVRELAY_BENCH_ONLY=TEXT` measures only the cases whose name contains TEXT;
//! `KVRELAY_BENCH_LIST=1` lists the cases with their index, `KVRELAY_BENCH_DUMP=I` prints case
//! I's input; `KVRELAY_BENCH_PROFILE=N` only
//! admits one envelope N times (`KVRELAY_BENCH_CASE`: its index, default 2, the max hash list),
//! for callgrind/cachegrind.

mod common;

use std::hint::black_box;

use common::{fmt_ns, measure};

use kvrelay::hints::Scratch;
use kvrelay::{Admission, AdmissionConfig};

fn main() {
    let edge = Admission::new(AdmissionConfig { trusted: true, ..Default::default() }).unwrap();
    let cases = common::admission_cases();
    // Profiling mode: only kvrelay admission of one envelope, N times (for callgrind or
    // cachegrind --branch-sim=yes, whose counts do not depend on other load).
    if let Some(n) = std::env::var("KVRELAY_BENCH_PROFILE").ok().and_then(|v| v.parse::<usize>().ok()) {
        let mut sc = Scratch::with_limits(65_536, 128);
        let case = std::env::var("KVRELAY_BENCH_CASE").ok().and_then(|v| v.parse::<usize>().ok()).unwrap_or(2);
        let raw = cases[case].1.as_bytes();
        for _ in 0..n {
            black_box(edge.admit_with(&mut sc, Some(black_box(raw))));
        }
        return;
    }
    if let Some(i) = std::env::var("KVRELAY_BENCH_DUMP").ok().and_then(|v| v.parse::<usize>().ok()) {
        print!("{}", cases[i].1);
        return;
    }
    if std::env::var_os("KVRELAY_BENCH_LIST").is_some() {
        for (i, (name, raw)) in cases.iter().enumerate() {
            println!("{i}: {name} ({} bytes)", raw.len());
        }
        return;
    }
    let only = std::env::var_os("KVRELAY_BENCH_ONLY").is_some();
    println!("| envelope | bytes | kvrelay admit | GB/s | serde_json Value + to_vec | ratio | serde_json IgnoredAny | ratio |");
    println!("|---|---|---|---|---|---|---|---|");
    let mut sc = Scratch::with_limits(65_536, 128);
    for (name, raw) in &common::selected_admission_cases(&edge) {
        let raw = raw.as_bytes();
        let ours = common::time_admit(&edge, &mut sc, raw);
        let round_trip = measure(|| {
            let v: serde_json::Value = serde_json::from_slice(black_box(raw)).unwrap();
            black_box(serde_json::to_vec(&v).unwrap());
        });
        let validate = common::time_validate_only(raw);
        println!(
            "| {name} | {} | {} | {:.2} | {} | {:.1}x | {} | {:.1}x |",
            raw.len(),
            fmt_ns(ours),
            raw.len() as f64 / ours,
            fmt_ns(round_trip),
            round_trip / ours,
            fmt_ns(validate),
            validate / ours
        );
    }
    // Where the time goes for the max envelope: the per-thread scratch path and the rejected path
    // (validation without the snapshot allocation and copy).
    if only {
        return;
    }
    let max = cases[2].1.as_bytes();
    let rejected = String::from_utf8_lossy(max).replace("\"0.1\"", "\"0.x\"").into_bytes();
    let untrusted = Admission::new(AdmissionConfig::default()).unwrap();
    let a = measure(|| {
        black_box(edge.admit(Some(black_box(max))));
    });
    let u = measure(|| {
        black_box(edge.admit_with(&mut sc, Some(black_box(&rejected))));
    });
    let t = measure(|| {
        black_box(untrusted.admit(Some(black_box(max))));
    });
    println!();
    println!("| max envelope, breakdown | time |");
    println!("|---|---|");
    println!("| admit with the per-thread scratch | {:.1} us |", a / 1000.0);
    println!("| full scan, rejected at step 6 (no snapshot) | {:.1} us |", u / 1000.0);
    println!("| trust off (nothing parsed) | {t:.1} ns |");
}
