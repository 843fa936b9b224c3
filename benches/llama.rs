//! The real model (`cargo bench --features llama --bench llama`, `KVRELAY_MODEL_FILE` naming the
//! GGUF: `source scripts/llama-env.sh`): time to first token of llama.cpp running
//! SmolLM2-135M-Instruct on the CPU, two release `kvrelay-server --engine llama` processes on
//! loopback, for 256 to 4,096-token prompts:
//!
//! - **cold prefill** (the anchor): the first request of a prompt on instance A, nothing held;
//! - **local reuse**: the same prompt again on A (every block but the last imported from A's
//!   pool, the last block decoded);
//! - **fetch**: instance B, which holds nothing of the prompt, with a `kv.fetch` hint from A's
//!   lookup (TCP through the KV agent, then the same import).
//!
//! Times are the servers' own (`x-kvrelay-ttft-ms`: request start, fetch included, to the first
//! output token's logits), the median of `KVRELAY_BENCH_REPS` prompts (default 3) per length,
//! each a different prompt so nothing is held across repetitions; every answer is checked
//! against the cold run's. Also printed: KV bytes per token and the import cost per block (the
//! slope of local reuse over the imported blocks, an upper bound: it includes the last block's
//! longer attention). Token-id prompts of exact lengths (ids spread over the vocabulary).
//! `KVRELAY_BENCH_MAX_TOKENS` caps the lengths (default 4096). Bounded: fixed sizes and
//! repetitions; every request has the client's 60 s deadline.
//!
//! Then **concurrent requests** (`KVRELAY_BENCH_CONCURRENT=0` skips it): one instance with two
//! llama.cpp contexts answers a 512-token prompt alone (the anchor), then two different ones at
//! once, with the default threads per context (the cores divided among the contexts) and with
//! every context on every core (`--llama-threads` = the cores, the former default); each
//! request's whole time, the median over the repetitions.

#[path = "../src/bin/kvrelay-server/client.rs"]
mod client;
#[path = "common/server.rs"]
mod server;
use server::{listening_addr, server_bin};

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};

use serde_json::{json, Value};

struct Server {
    child: Child,
    addr: SocketAddr,
}
impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A release server over `model` (one context unless `extra` names `--llama-contexts`).
fn start(model: &str, extra: &[&str]) -> Server {
    let contexts: &[&str] = if extra.contains(&"--llama-contexts") { &[] } else { &["--llama-contexts", "1"] };
    let mut child = Command::new(server_bin())
        .args(["serve", "--listen", "127.0.0.1:0", "--engine", "llama", "--model-file", model])
        .args(contexts)
        .args(["--llama-ctx", "8192", "--kv-blocks", "2048"])
        .args(extra)
        .env("KVRELAY_TRUST_KV_HINTS", "1")
        .env("KVRELAY_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .expect("start kvrelay-server");
    let addr = listening_addr(&mut child);
    Server { child, addr }
}

/// One prompt's answer: (text, cached tokens, ttft ms).
fn ask(s: &Server, body: &Value) -> (String, u64, f64) {
    let r = client::post(s.addr, "/v1/completions", body).expect("request");
    assert_eq!(r.status, 200, "{}", r.text());
    let ttft = r.header("x-kvrelay-ttft-ms").and_then(|t| t.parse().ok()).expect("ttft header");
    let v = r.json();
    (
        v["choices"][0]["text"].as_str().unwrap_or_default().to_string(),
        v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0),
        ttft,
    )
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn prompt(tag: u64, n: usize, vocab: u64) -> Vec<u64> {
    (0..n as u64).map(|i| 100 + (i.wrapping_mul(2_654_435_761) ^ tag.wrapping_mul(40_503)) % (vocab - 200)).collect()
}

fn main() {
    let model = std::env::var("KVRELAY_MODEL_FILE").ok().filter(|m| !m.is_empty()).unwrap_or_else(|| {
        eprintln!("llama bench: KVRELAY_MODEL_FILE is not set (`source scripts/llama-env.sh`); skipped");
        std::process::exit(0);
    });
    let reps: usize = std::env::var("KVRELAY_BENCH_REPS").ok().and_then(|r| r.parse().ok()).unwrap_or(3).max(1);
    let cap: usize = std::env::var("KVRELAY_BENCH_MAX_TOKENS").ok().and_then(|r| r.parse().ok()).unwrap_or(4096);
    let a = start(&model, &[]);
    let info = client::get(a.addr, "/v1/kv/info").expect("info").json();
    let kv = info["kv_endpoint"].as_str().expect("kv endpoint").to_string();
    let b = start(&model, &["--trusted-endpoint", &kv]);
    let block_bytes = info["block_bytes"].as_u64().expect("block bytes");
    let bt = info["fingerprint"]["block_tokens"].as_u64().expect("block tokens");
    let vocab = 49_152;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("llama bench: {model}");
    println!(
        "KV {} bytes per token, {block_bytes} per {bt}-token block; {threads} CPU threads per context; median of {reps}",
        block_bytes / bt
    );
    println!(
        "{:>7} {:>12} {:>12} {:>12} {:>10} {:>10} {:>12}",
        "tokens", "cold ms", "reuse ms", "fetch ms", "reuse/cold", "fetch/cold", "fetched MB"
    );
    let mut slope = Vec::new();
    for (li, n) in [256usize, 512, 1024, 2048, 4096].into_iter().filter(|&n| n <= cap).enumerate() {
        let (mut cold, mut reuse, mut fetch) = (Vec::new(), Vec::new(), Vec::new());
        for r in 0..reps {
            let p = prompt((li * 1000 + r) as u64 + 1, n, vocab);
            let body = json!({"prompt": p, "max_tokens": 8});
            let (want, c0, t_cold) = ask(&a, &body);
            assert_eq!(c0, 0, "the cold run reused nothing");
            let (t1, c1, t_reuse) = ask(&a, &body);
            assert!(c1 > 0 && t1 == want, "local reuse answers as the cold run");
            let look = client::post(a.addr, "/v1/kv/lookup", &json!({"prompt": p})).expect("lookup").json();
            let hint = json!({"protocol_version": "0.1", "message_id": format!("b{n}-{r}"), "actions": [{
                "action_id": "a1", "action_type": "kv.fetch", "action_version": "1.0",
                "payload": {"source_control_endpoint": kv, "block_hashes": look["block_hashes"]}}]});
            let (t2, c2, t_fetch) = ask(&b, &json!({"prompt": p, "max_tokens": 8, "kv_hints": hint}));
            assert!(c2 > 0 && t2 == want, "a fetched prefix answers as the cold run");
            cold.push(t_cold);
            reuse.push(t_reuse);
            fetch.push(t_fetch);
        }
        let (c, u, f) = (median(cold), median(reuse), median(fetch));
        let imported = (n as u64 - 1) / bt;
        slope.push((imported as f64, u));
        println!(
            "{n:>7} {c:>12.1} {u:>12.1} {f:>12.1} {:>10.3} {:>10.3} {:>12.2}",
            u / c,
            f / c,
            (imported * block_bytes) as f64 / 1e6
        );
    }
    if slope.len() >= 2 {
        let (x0, y0) = slope[0];
        let (x1, y1) = slope[slope.len() - 1];
        println!(
            "import cost per block (slope of local reuse from {x0} to {x1} blocks): {:.3} ms ({:.2} GB/s of KV)",
            (y1 - y0) / (x1 - x0),
            block_bytes as f64 / ((y1 - y0) / (x1 - x0) / 1e3) / 1e9
        );
    }
    drop((a, b));
    if std::env::var("KVRELAY_BENCH_CONCURRENT").as_deref() != Ok("0") {
        concurrent(&model, reps, vocab);
    }
}

/// Two requests at once against one alone, on one instance of two contexts (module docs).
fn concurrent(model: &str, reps: usize, vocab: u64) {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("concurrent requests: 512-token prompts, 8 output tokens, two contexts, {cores} cores");
    println!("{:>22} {:>12} {:>16} {:>8}", "threads per context", "alone ms", "two at once ms", "ratio");
    let every = cores.to_string();
    for (label, extra) in [("default (cores / 2)", vec![]), ("every core (former)", vec!["--llama-threads", &every])] {
        let mut args = vec!["--llama-contexts", "2"];
        args.extend(extra.iter().copied());
        let s = start(model, &args);
        let timed = |tag: u64| {
            let body = json!({"prompt": prompt(tag, 512, vocab), "max_tokens": 8, "cache_salt": format!("c{tag}")});
            let t = std::time::Instant::now();
            ask(&s, &body);
            t.elapsed().as_secs_f64() * 1e3
        };
        let (mut alone, mut both) = (Vec::new(), Vec::new());
        for r in 0..reps as u64 {
            alone.push(timed(9000 + r));
            let (x, y) = std::thread::scope(|sc| {
                let h = sc.spawn(|| timed(9100 + r));
                let y = timed(9200 + r);
                (h.join().expect("the other request"), y)
            });
            both.push((x + y) / 2.0);
        }
        let (a, b) = (median(alone), median(both));
        println!("{label:>22} {a:>12.1} {b:>16.1} {:>8.2}", b / a);
    }
}
