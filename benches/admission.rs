//! Admission benchmark (`cargo bench --bench admission`).
//!
//! Envelopes of one `kv.fetch` action with random u64 block hashes: small (2 hashes), medium
//! (256), max (the most hashes whose canonical encoding fits 65,536 bytes). For each, in the
//! same run and on the same input bytes:
//! - kvrelay admission (validation, canonical bytes, index, the one snapshot allocation);
//! - anchor A: serde_json parse to `Value` plus `to_vec` (the round trip a naive edge does);
//! - anchor B: serde_json validate-only (deserialize into `IgnoredAny`).
//!
//! Timing: each figure is the fastest of 41 samples; each sample runs the operation enough
//! times to take about 1 ms. The minimum is the estimate least disturbed by other load on a
//! shared machine, and every operation, ours and the anchors, is measured the same way in the
//! same run, so the ratios compare like with like. Single thread. Prints a Markdown table for `benches/RESULTS.md`.
//! `KVRELAY_BENCH_QUICK=1` takes fewer samples (for a smoke run); `KVRELAY_BENCH_PROFILE=N`
//! only admits one envelope N times (`KVRELAY_BENCH_CASE`: 0 small, 1 medium, 2 max, 3 pretty;
//! default 2), for callgrind/cachegrind.

mod common;

use std::hint::black_box;

use common::{envelope, measure, Rng};

use kvrelay::hints::Scratch;
use kvrelay::{Admission, AdmissionConfig, Outcome};

fn main() {
    let edge = Admission::new(AdmissionConfig { trusted: true, ..Default::default() }).unwrap();
    let mut rng = Rng(0x5EED_1234_ABCD_0001);
    let pool: Vec<u64> = (0..8192).map(|_| rng.next()).collect();
    // the largest hash count whose canonical encoding fits 65,536 bytes
    let max_n = common::max_hashes(&pool, 65_536);
    let max_name = format!("max ({max_n} hashes)");
    let pretty_name = format!("max, pretty-printed input ({max_n} hashes)");
    let cases = [
        ("small (2 hashes)", envelope(&pool[4000..4002], false)),
        ("medium (256 hashes)", envelope(&pool[5000..5256], false)),
        (max_name.as_str(), envelope(&pool[..max_n], false)),
        (pretty_name.as_str(), envelope(&pool[..max_n], true)),
    ];
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
    println!("| envelope | bytes | kvrelay admit | GB/s | serde_json Value + to_vec | ratio | serde_json IgnoredAny | ratio |");
    println!("|---|---|---|---|---|---|---|---|");
    let mut sc = Scratch::with_limits(65_536, 128);
    for (name, raw) in &cases {
        let raw = raw.as_bytes();
        assert!(matches!(edge.admit(Some(raw)), Outcome::Admitted(_)), "{name} must be admitted");
        let ours = measure(|| {
            black_box(edge.admit_with(&mut sc, Some(black_box(raw))));
        });
        let round_trip = measure(|| {
            let v: serde_json::Value = serde_json::from_slice(black_box(raw)).unwrap();
            black_box(serde_json::to_vec(&v).unwrap());
        });
        let validate = measure(|| {
            let v: serde::de::IgnoredAny = serde_json::from_slice(black_box(raw)).unwrap();
            black_box(v);
        });
        let fmt_ns = |ns: f64| if ns < 10_000.0 { format!("{ns:.0} ns") } else { format!("{:.1} us", ns / 1000.0) };
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
