//! Cross-instance KV transfer between two release `kvrelay-server` processes on loopback
//! (`cargo bench --features server --bench transfer`), with an 8B-model KV shape (32 layers,
//! 8 KV heads, head size 128, BF16: 128 KiB per token, 4 MiB per 32-token block).
//!
//! 1. Throughput: a 1 GiB prefix (8,192 tokens) fetched by a `kv.fetch` hint, against a plain
//!    loopback TCP copy of the same number of bytes measured in the same run.
//! 2. Time to first token with fetch against local prefill, 1k to 32k-token prompts: the
//!    modeled prefill time (25,000 tokens/s, `--prefill-tokens-per-s`), the measured local
//!    prefill of an instance with that rate (never faster than the reference engine writing
//!    the KV bytes), and the measured fetch path (an instance without a modeled rate, so its
//!    fetch-or-prefill estimate always fetches).
//!
//! `KVRELAY_BENCH_DEVICE=cuda:0` puts both pools in GPU memory (two instances on one GPU);
//! `KVRELAY_BENCH_MAX_TOKENS` caps the prompt sizes (default 32768). Bounded: fixed sizes and
//! repetitions; every request has the client's 60 s deadline.

#[path = "../src/bin/kvrelay-server/client.rs"]
mod client;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use serde_json::{json, Value};

const SHAPE: [&str; 8] = ["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--dtype-bytes", "2"];
const TOKEN_BYTES: usize = 32 * 2 * 8 * 128 * 2;

struct Server {
    child: Child,
    addr: SocketAddr,
    kv: String,
}
impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(extra: &[&str], rate: &str) -> Server {
    let device = std::env::var("KVRELAY_BENCH_DEVICE").unwrap_or_else(|_| "cpu".into());
    let mut child = Command::new(server_bin())
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--kv-blocks",
            "1100",
            "--device",
            &device,
            "--prefill-tokens-per-s",
            rate,
        ])
        .args(SHAPE)
        .args(["--max-body-bytes", "16777216"])
        .args(extra)
        .env("KVRELAY_TRUST_KV_HINTS", "1")
        .env("KVRELAY_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .expect("start kvrelay-server");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let addr: SocketAddr = line.trim().strip_prefix("listening on ").expect("listening line").parse().unwrap();
    let kv = client::get(addr, "/v1/kv/info").unwrap().json()["kv_endpoint"].as_str().unwrap().to_string();
    Server { child, addr, kv }
}

fn tokens(tag: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| i.wrapping_mul(2_654_435_761) ^ (tag << 20)).collect()
}

fn complete(s: &Server, body: Value) -> (Value, f64) {
    let t = Instant::now();
    let r = client::post(s.addr, "/v1/completions", &body).unwrap();
    let secs = t.elapsed().as_secs_f64();
    assert_eq!(r.status, 200, "{}", r.text());
    (r.json(), secs)
}

fn hint(ep: &str, hashes: &Value) -> Value {
    json!({"protocol_version": "0.1", "message_id": "bench", "actions": [{
        "action_id": "a", "action_type": "kv.fetch", "action_version": "1.0",
        "payload": {"source_control_endpoint": ep, "block_hashes": hashes}}]})
}

fn metric(s: &Server, series: &str) -> f64 {
    let m = client::get(s.addr, "/metrics").unwrap().text();
    m.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok()).unwrap_or(0.0)
}

/// A plain loopback TCP copy of `bytes` in 4 MiB writes: bytes per second.
fn loopback_copy(bytes: usize) -> f64 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let w = std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        let buf = vec![7u8; 4 << 20];
        let mut left = bytes;
        while left > 0 {
            let n = left.min(buf.len());
            s.write_all(&buf[..n]).unwrap();
            left -= n;
        }
    });
    let (mut s, _) = l.accept().unwrap();
    let mut buf = vec![0u8; 4 << 20];
    let t = Instant::now();
    let mut got = 0;
    while got < bytes {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0);
        got += n;
    }
    let secs = t.elapsed().as_secs_f64();
    w.join().unwrap();
    bytes as f64 / secs
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let max_tokens: usize =
        std::env::var("KVRELAY_BENCH_MAX_TOKENS").ok().and_then(|v| v.parse().ok()).unwrap_or(32768);
    let device = std::env::var("KVRELAY_BENCH_DEVICE").unwrap_or_else(|_| "cpu".into());
    let src = start(&[], "0");
    // The fetching destination has no modeled rate, so it always fetches (its estimate never
    // prefers local prefill); the local one prefills at the modeled 25,000 tokens/s.
    let dst = start(&["--trusted-endpoint", &src.kv.clone()], "0");
    let local = start(&[], "25000");
    println!("transfer bench: pools on {device}, {} KiB per token, 4 MiB blocks", TOKEN_BYTES / 1024);

    // 1. Throughput of a 1 GiB prefix: one warm-up transfer (first-use costs: the KV service's
    // blocking threads and buffers, the destination's receive path), then five measured, each
    // against a loopback copy of the same bytes in the same run.
    let n = 8192.min(max_tokens);
    for rep in 0..6 {
        let p = tokens(100 + rep, n);
        complete(&src, json!({"prompt": p, "max_tokens": 1}));
        let look = client::post(src.addr, "/v1/kv/lookup", &json!({"prompt": p})).unwrap().json();
        let before = metric(&dst, "kvrelay_server_kv_transfer_seconds_sum");
        let (v, total) =
            complete(&dst, json!({"prompt": p, "max_tokens": 1, "kv_hints": hint(&src.kv, &look["block_hashes"])}));
        let fetch_s = metric(&dst, "kvrelay_server_kv_transfer_seconds_sum") - before;
        let bytes = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() as usize * TOKEN_BYTES;
        if rep == 0 {
            println!("  warm-up transfer: {:.3} s (not counted)", fetch_s);
            continue;
        }
        let anchor = loopback_copy(bytes);
        println!(
            "  {:.2} GiB prefix: fetch {:.3} s = {:.2} GB/s = {:.1}% of a plain loopback TCP copy ({:.2} GB/s, same run); request total {:.3} s",
            bytes as f64 / (1u64 << 30) as f64,
            fetch_s,
            bytes as f64 / fetch_s / 1e9,
            bytes as f64 / fetch_s / anchor * 100.0,
            anchor / 1e9,
            total
        );
    }

    // 2. Time to first token: local prefill (modeled 25,000 tokens/s) against fetch.
    println!("  tokens | modeled prefill | local prefill TTFT (measured) | fetch TTFT | fetch / modeled | fetch / measured local");
    let mut crossover = None;
    let mut size = 1024;
    while size <= max_tokens {
        let p = tokens(size as u32, size);
        complete(&src, json!({"prompt": p, "max_tokens": 1}));
        let look = client::post(src.addr, "/v1/kv/lookup", &json!({"prompt": p})).unwrap().json();
        let (_, measured) = complete(&local, json!({"prompt": p, "max_tokens": 1}));
        let modeled = size as f64 / 25_000.0;
        let (v, fetch) =
            complete(&dst, json!({"prompt": p, "max_tokens": 1, "kv_hints": hint(&src.kv, &look["block_hashes"])}));
        let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
        println!(
            "  {size:>6} | {:>8.1} ms | {:>8.1} ms | {:>8.1} ms | {:.3} | {:.3} ({cached} tokens fetched)",
            modeled * 1e3,
            measured * 1e3,
            fetch * 1e3,
            fetch / modeled,
            fetch / measured
        );
        if fetch < modeled && crossover.is_none() {
            crossover = Some(size);
        }
        size *= 2;
    }
    match crossover {
        Some(c) => println!("  fetch beats the modeled prefill from {c} tokens on"),
        None => println!("  fetch never beat the modeled prefill (25,000 tokens/s) at these sizes"),
    }
}

/// The server binary cargo built for this target, or `KVRELAY_SERVER_BIN` (a binary carried to
/// another machine, e.g. the GPU machine).
fn server_bin() -> std::path::PathBuf {
    std::env::var_os("KVRELAY_SERVER_BIN").map_or_else(|| env!("CARGO_BIN_EXE_kvrelay-server").into(), Into::into)
}
