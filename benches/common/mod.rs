//! Shared by the benchmarks: a small PRNG, the benchmark envelopes and the timing harness.
#![allow(dead_code)]

pub mod shapes;

use std::time::Instant;

use kvrelay::hints::Scratch;
use kvrelay::{Admission, AdmissionConfig, Outcome};
use shapes::{Shape, Style, Ws};

/// The generators' PRNG (the shapes module owns it: the tests include that module alone).
pub use shapes::Rng;

pub fn envelope(hashes: &[u64], pretty: bool) -> String {
    let hashes: Vec<String> = hashes.iter().map(u64::to_string).collect();
    let sep = if pretty { ", " } else { "," };
    let body = format!(
        r#"{{"protocol_version":"0.1","message_id":"req-7f3a9c","actions":[{{"action_id":"a1","action_type":"kv.fetch","action_version":"1.0","payload":{{"source_control_endpoint":"tcp://10.0.0.7:23280","block_hashes":[{}]}}}}]}}"#,
        hashes.join(sep)
    );
    if pretty {
        body.replace("\":", "\": ").replace(",\"", ", \"")
    } else {
        body
    }
}

/// Fastest-sample nanoseconds per call of `f`.
pub fn measure(mut f: impl FnMut()) -> f64 {
    let quick = std::env::var_os("KVRELAY_BENCH_QUICK").is_some();
    // calibrate: iterations per ~2 ms sample
    let mut iters = 1u64;
    loop {
        let t = Instant::now();
        for _ in 0..iters {
            f();
        }
        if t.elapsed().as_micros() >= 1000 || iters >= 1 << 30 {
            break;
        }
        iters *= 2;
    }
    let samples = if quick { 5 } else { 41 };
    let mut v: Vec<f64> = (0..samples)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..iters {
                f();
            }
            t.elapsed().as_nanos() as f64 / iters as f64
        })
        .collect();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[0]
}

/// The largest prefix of `pool` whose envelope's canonical encoding fits `limit` bytes.
pub fn max_hashes(pool: &[u64], limit: usize) -> usize {
    let mut n = 0;
    while n < pool.len() && envelope(&pool[..n + 1], false).len() <= limit {
        n += 1;
    }
    n
}

/// The envelopes of [`admission_cases`] that `KVRELAY_BENCH_ONLY=TEXT` selects (those whose
/// name contains TEXT; all without it), each checked to be admitted by `edge`.
pub fn selected_admission_cases(edge: &Admission) -> Vec<(String, String)> {
    let only = std::env::var("KVRELAY_BENCH_ONLY").ok();
    let mut cases = admission_cases();
    cases.retain(|(name, _)| only.as_deref().is_none_or(|o| name.contains(o)));
    for (name, raw) in &cases {
        assert!(matches!(edge.admit(Some(raw.as_bytes())), Outcome::Admitted(_)), "{name} must be admitted");
    }
    cases
}

/// Fastest-sample nanoseconds of one admission of `raw` through the caller's scratch.
pub fn time_admit(edge: &Admission, sc: &mut Scratch, raw: &[u8]) -> f64 {
    measure(|| {
        std::hint::black_box(edge.admit_with(sc, Some(std::hint::black_box(raw))));
    })
}

/// Fastest-sample nanoseconds of serde_json's validate-only pass over `raw` (deserialized into
/// `IgnoredAny`): the anchor every admission figure is compared with.
pub fn time_validate_only(raw: &[u8]) -> f64 {
    measure(|| {
        let v: serde::de::IgnoredAny = serde_json::from_slice(std::hint::black_box(raw)).unwrap();
        std::hint::black_box(v);
    })
}

/// Nanoseconds as the tables print them: `123 ns` below 10 us, `12.3 us` from there.
pub fn fmt_ns(ns: f64) -> String {
    if ns < 10_000.0 {
        format!("{ns:.0} ns")
    } else {
        format!("{:.1} us", ns / 1000.0)
    }
}

/// The admission benchmark's envelopes, by name, in a fixed order (their index is
/// `KVRELAY_BENCH_CASE`): cases 0-3 are the hash-list envelopes of the first runs (kept for
/// comparison with them), the generated shapes follow.
pub fn admission_cases() -> Vec<(String, String)> {
    let mut rng = Rng(0x5EED_1234_ABCD_0001);
    let pool: Vec<u64> = (0..8192).map(|_| rng.next()).collect();
    // the largest hash count whose canonical encoding fits 65,536 bytes
    let max_n = max_hashes(&pool, 65_536);
    let mut cases: Vec<(String, String)> = vec![
        ("hashes: small (2 hashes)".into(), envelope(&pool[4000..4002], false)),
        ("hashes: medium (256 hashes)".into(), envelope(&pool[5000..5256], false)),
        (format!("hashes: max ({max_n} hashes)"), envelope(&pool[..max_n], false)),
        (format!("hashes: max, spaced ({max_n} hashes)"), envelope(&pool[..max_n], true)),
    ];
    cases.extend(generated_cases());
    cases
}

/// The generated shapes (`benches/common/shapes.rs`), seeded: small (about 250 bytes), medium,
/// and max (the most units whose canonical encoding fits 65,536 bytes), compact, plus the
/// spellings other encoders produce: spaced (`json.dumps` default separators), indented
/// (`json.dumps(indent=2)`), and `ensure_ascii` (every non-ASCII character as `\uXXXX`).
fn generated_cases() -> Vec<(String, String)> {
    const SEED: u64 = 0x5EED_0000_2026_1130;
    let wide = Admission::new(AdmissionConfig {
        trusted: true,
        max_bytes: 1 << 24,
        max_raw_bytes: 1 << 24,
        ..Default::default()
    })
    .unwrap();
    let canonical_len = |j: &shapes::J| match wide.admit(Some(shapes::write(j, Style::COMPACT).as_bytes())) {
        Outcome::Admitted(s) => s.canonical().len(),
        other => panic!("generated envelope not admitted: {other:?}"),
    };
    let ascii_spaced = Style { ws: Ws::Spaced, ensure_ascii: true };
    let mut out = Vec::new();
    for shape in Shape::ALL {
        let name = shape.name();
        let max = shapes::max_units(shape, SEED, 65_536, canonical_len);
        let unit = match shape {
            Shape::Hashes => "hashes",
            Shape::Mixed => "actions",
            Shape::Strings => "actions",
        };
        let medium = match shape {
            Shape::Hashes => 256,
            Shape::Mixed => 16,
            Shape::Strings => 8,
        };
        let small = shapes::envelope(shape, 0, SEED);
        let big = shapes::envelope(shape, max, SEED);
        let mut add = |label: String, j: &shapes::J, style: Style| out.push((label, shapes::write(j, style)));
        if shape != Shape::Hashes {
            add(format!("{name}: small"), &small, Style::COMPACT);
            add(format!("{name}: small, spaced"), &small, Style::SPACED);
            add(format!("{name}: medium ({medium} {unit})"), &shapes::envelope(shape, medium, SEED), Style::COMPACT);
            add(format!("{name}: max ({max} {unit})"), &big, Style::COMPACT);
            add(format!("{name}: max, spaced ({max} {unit})"), &big, Style::SPACED);
        }
        add(format!("{name}: max, indented ({max} {unit})"), &big, Style::INDENTED);
        if shape == Shape::Strings {
            add(format!("{name}: max, spaced + ensure_ascii ({max} {unit})"), &big, ascii_spaced);
        }
    }
    out
}
