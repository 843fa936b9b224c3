//! Shared by the benchmarks: a small PRNG, the benchmark envelopes and the timing harness.
#![allow(dead_code)]

pub mod shapes;

use std::time::Instant;

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
