//! Load run against a release `kvrelay-server` on loopback (`cargo bench --features server
//! --bench server_load`): 64 concurrent clients, 10,000 requests mixing plain, hinted,
//! malformed-hint, batched, streamed, chat and cancelled ones. Every answer is compared with a
//! cold run of its prompt measured before the load. Reports requests per second against the
//! same clients hitting `GET /health` in the same run (the bare HTTP round trip), p50/p99
//! latency, server errors, wrong answers, RSS before and after, and the share of request time
//! spent in hint admission plus orchestration (from the server's own counters). The load runs
//! twice: a warm-up round, then the measured round; RSS is read before and after the latter.
//!
//! Bounded: a fixed number of requests and a 300 s deadline; the server listens on loopback.
//! Knobs: `KVRELAY_LOAD_REQUESTS` (10000), `KVRELAY_LOAD_CLIENTS` (64).

#[path = "../src/bin/kvrelay-server/client.rs"]
mod client;
#[path = "common/server.rs"]
mod server;
use server::{listening_addr, server_bin};

use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

const DEADLINE: Duration = Duration::from_secs(300);
const MAX_TOKENS: u64 = 8;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

struct Server(Child);
impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn rss_kib(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

fn metric_sum(text: &str, prefix: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(prefix) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn prompts() -> Vec<String> {
    let mut v = Vec::new();
    for base in 0..48 {
        let head: String = (0..40 + base * 3).map(|i| format!("w{base}-{i} ")).collect();
        for variant in 0..4 {
            v.push(format!("{head}variant {variant}: {}", "tail ".repeat(variant * 7)));
        }
    }
    v
}

fn hint(hashes: usize, seed: usize) -> Value {
    json!({"protocol_version": "0.1", "message_id": format!("load-{seed}"), "actions": [{
        "action_id": "a1", "action_type": "kv.fetch", "action_version": "1.0",
        "payload": {"source_control_endpoint": "tcp://127.0.0.1:23280",
                    "block_hashes": (0..hashes as u64).map(|h| h * 7919 + seed as u64).collect::<Vec<_>>()}}]})
}

#[derive(Default)]
struct Tally {
    ok: usize,
    server_errors: usize,
    other_status: HashMap<u16, usize>,
    wrong: usize,
    cancelled: usize,
    transport_errors: usize,
    latencies_us: Vec<u64>,
}

fn chat_answer(v: &Value) -> String {
    v["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_string()
}

fn one(
    addr: SocketAddr,
    i: usize,
    ps: &[String],
    cold: &HashMap<String, String>,
    chat_cold: &HashMap<String, String>,
    t: &mut Tally,
) {
    let p = &ps[(i * 7919) % ps.len()];
    let q = &ps[(i * 104_729 + 13) % ps.len()];
    let kind = i % 20;
    let started = Instant::now();
    let (status, ok_answer) = match kind {
        // cancelled: send, wait a moment, hang up
        0 => {
            let body = json!({"prompt": p, "max_tokens": MAX_TOKENS}).to_string();
            if let Ok(c) = client::send(addr, "POST", "/v1/completions", Some(body.as_bytes())) {
                std::thread::sleep(Duration::from_micros(300));
                drop(c);
            }
            t.cancelled += 1;
            return;
        }
        // streamed chat
        1..=3 => {
            let r = client::post(
                addr,
                "/v1/chat/completions",
                &json!({"messages": [{"role": "user", "content": p}], "max_tokens": MAX_TOKENS, "stream": true}),
            );
            let Ok(r) = r else {
                t.transport_errors += 1;
                return;
            };
            let ev = client::sse_data(&r.text());
            let joined: String = ev
                .iter()
                .filter_map(|d| serde_json::from_str::<Value>(d).ok())
                .filter_map(|v| v["choices"][0]["delta"]["content"].as_str().map(str::to_string))
                .collect();
            (r.status, ev.last().map(String::as_str) == Some("[DONE]") && Some(&joined) == chat_cold.get(p))
        }
        // chat
        4 => {
            let Ok(r) = client::post(
                addr,
                "/v1/chat/completions",
                &json!({"messages": [{"role": "user", "content": p}], "max_tokens": MAX_TOKENS}),
            ) else {
                t.transport_errors += 1;
                return;
            };
            (r.status, Some(&chat_answer(&r.json())) == chat_cold.get(p))
        }
        // batched with an aligned hint list
        5 | 6 => {
            let Ok(r) = client::post(
                addr,
                "/v1/completions",
                &json!({"prompt": [p, q], "max_tokens": MAX_TOKENS, "kv_hints": [hint(32, i), null]}),
            ) else {
                t.transport_errors += 1;
                return;
            };
            let v = r.json();
            let good = v["choices"][0]["text"].as_str() == cold.get(p).map(String::as_str)
                && v["choices"][1]["text"].as_str() == cold.get(q).map(String::as_str);
            (r.status, good)
        }
        // malformed hints (a duplicate member)
        7 | 8 => {
            let body = format!(
                r#"{{"prompt":{},"max_tokens":{MAX_TOKENS},"kv_hints":{{"protocol_version":"0.1","message_id":"m","message_id":"n","actions":[]}}}}"#,
                json!(p)
            );
            let Ok(r) = client::request(addr, "POST", "/v1/completions", Some(body.as_bytes())) else {
                t.transport_errors += 1;
                return;
            };
            (r.status, r.json()["choices"][0]["text"].as_str() == cold.get(p).map(String::as_str))
        }
        // hinted (admitted; orchestration reaches the provider)
        9..=13 => {
            let Ok(r) = client::post(
                addr,
                "/v1/completions",
                &json!({"prompt": p, "max_tokens": MAX_TOKENS, "kv_hints": hint(64, i)}),
            ) else {
                t.transport_errors += 1;
                return;
            };
            (r.status, r.json()["choices"][0]["text"].as_str() == cold.get(p).map(String::as_str))
        }
        // plain
        _ => {
            let Ok(r) = client::post(addr, "/v1/completions", &json!({"prompt": p, "max_tokens": MAX_TOKENS})) else {
                t.transport_errors += 1;
                return;
            };
            (r.status, r.json()["choices"][0]["text"].as_str() == cold.get(p).map(String::as_str))
        }
    };
    t.latencies_us.push(started.elapsed().as_micros() as u64);
    match status {
        200 => {
            t.ok += 1;
            if !ok_answer {
                t.wrong += 1;
            }
        }
        s if s >= 500 => t.server_errors += 1,
        s => *t.other_status.entry(s).or_default() += 1,
    }
}

fn run_clients(clients: usize, total: usize, f: impl Fn(usize, &mut Tally) + Sync) -> (Tally, Duration) {
    let next = AtomicUsize::new(0);
    let all = Mutex::new(Tally::default());
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..clients {
            s.spawn(|| {
                let mut t = Tally::default();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= total || t0.elapsed() > DEADLINE {
                        break;
                    }
                    f(i, &mut t);
                }
                let mut a = all.lock().unwrap();
                a.ok += t.ok;
                a.server_errors += t.server_errors;
                a.wrong += t.wrong;
                a.cancelled += t.cancelled;
                a.transport_errors += t.transport_errors;
                for (k, v) in t.other_status {
                    *a.other_status.entry(k).or_default() += v;
                }
                a.latencies_us.extend(t.latencies_us);
            });
        }
    });
    (all.into_inner().unwrap(), t0.elapsed())
}

fn pct(v: &mut [u64], p: f64) -> f64 {
    v.sort_unstable();
    if v.is_empty() {
        return 0.0;
    }
    v[((v.len() - 1) as f64 * p).round() as usize] as f64 / 1000.0
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // `cargo bench -- --list`
    }
    let total = env_usize("KVRELAY_LOAD_REQUESTS", 10_000);
    let clients = env_usize("KVRELAY_LOAD_CLIENTS", 64);
    let mut child = Command::new(server_bin())
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--prefill-tokens-per-s",
            "0",
            "--trusted-endpoint",
            "tcp://127.0.0.1:23280",
        ])
        .args(["--max-concurrency", "64", "--max-queue", "1024"])
        .env("KVRELAY_TRUST_KV_HINTS", "1")
        .env("KVRELAY_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .expect("start kvrelay-server (built by cargo bench --features server)");
    let addr = listening_addr(&mut child);
    let pid = child.id();
    let _server = Server(child);

    // Cold answers: every prompt once with a salt of its own (nothing reused).
    let ps = prompts();
    let mut cold = HashMap::new();
    let mut chat_cold = HashMap::new();
    for (k, p) in ps.iter().enumerate() {
        let v = client::post(
            addr,
            "/v1/completions",
            &json!({"prompt": p, "max_tokens": MAX_TOKENS, "cache_salt": format!("cold-{k}")}),
        )
        .unwrap()
        .json();
        assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
        cold.insert(p.clone(), v["choices"][0]["text"].as_str().unwrap().to_string());
        let v = client::post(addr, "/v1/chat/completions", &json!({"messages": [{"role": "user", "content": p}], "max_tokens": MAX_TOKENS, "cache_salt": format!("cold-{k}")})).unwrap().json();
        chat_cold.insert(p.clone(), chat_answer(&v));
    }
    // Anchor: the same clients, bare HTTP round trips.
    let (health, health_t) = run_clients(clients, total, |_, t| match client::get(addr, "/health") {
        Ok(r) if r.status == 200 => t.ok += 1,
        _ => t.transport_errors += 1,
    });
    // Round 1 warms the allocator, the cache and the connection paths; round 2 is measured,
    // and memory must stay flat across it.
    let rss_start = rss_kib(pid);
    let _ = run_clients(clients, total, |i, t| one(addr, i, &ps, &cold, &chat_cold, t));
    std::thread::sleep(Duration::from_millis(300)); // cancelled requests finish unwinding
    let m0 = client::get(addr, "/metrics").unwrap().text();
    let rss_before = rss_kib(pid);
    let (mut load, load_t) = run_clients(clients, total, |i, t| one(addr, i + total, &ps, &cold, &chat_cold, t));
    std::thread::sleep(Duration::from_millis(300));
    let rss_after = rss_kib(pid);
    let m1 = client::get(addr, "/metrics").unwrap().text();

    let hint_s = metric_sum(&m1, "kvrelay_server_hint_processing_seconds_total")
        - metric_sum(&m0, "kvrelay_server_hint_processing_seconds_total");
    let req_s = metric_sum(&m1, "kvrelay_server_request_duration_seconds_sum")
        - metric_sum(&m0, "kvrelay_server_request_duration_seconds_sum");
    let prefilled = metric_sum(&m1, "kvrelay_server_prefilled_tokens_total")
        - metric_sum(&m0, "kvrelay_server_prefilled_tokens_total");
    let prompt_t =
        metric_sum(&m1, "kvrelay_server_prompt_tokens_total") - metric_sum(&m0, "kvrelay_server_prompt_tokens_total");
    let cached_t =
        metric_sum(&m1, "kvrelay_server_cached_tokens_total") - metric_sum(&m0, "kvrelay_server_cached_tokens_total");
    let held = metric_sum(&m1, "kvrelay_server_kv_blocks{state=\"held\"}");
    let evicted = metric_sum(&m1, "kvrelay_server_kv_blocks_evicted_total");
    let health_rps = health.ok as f64 / health_t.as_secs_f64();
    let done = load.latencies_us.len() + load.cancelled;
    let rps = done as f64 / load_t.as_secs_f64();
    let p50 = pct(&mut load.latencies_us, 0.50);
    let p99 = pct(&mut load.latencies_us, 0.99);
    println!("server_load: {clients} clients, {total} requests (deadline {}s)", DEADLINE.as_secs());
    println!(
        "  anchor GET /health: {health_rps:.0} req/s ({} ok, {} transport errors)",
        health.ok, health.transport_errors
    );
    println!(
        "  mixed load: {rps:.0} req/s = {:.3} x the anchor; {} answered 200, {} cancelled, other statuses {:?}, transport errors {}",
        rps / health_rps,
        load.ok,
        load.cancelled,
        load.other_status,
        load.transport_errors
    );
    println!("  latency p50 {p50:.2} ms, p99 {p99:.2} ms (completed requests)");
    println!("  server errors (5xx): {}; answers different from the cold run: {}", load.server_errors, load.wrong);
    println!(
        "  RSS at start {rss_start} KiB; after a warm-up round {} KiB, after the measured round {} KiB ({:+.1}%); KV blocks held after the run: {held}; evicted: {evicted}",
        rss_before,
        rss_after,
        (rss_after as f64 / rss_before as f64 - 1.0) * 100.0
    );
    println!(
        "  tokens: {prompt_t} prompt, {cached_t} reused ({:.1}%), {prefilled} prefilled by the reference engine",
        cached_t / prompt_t.max(1.0) * 100.0
    );
    println!(
        "  hint admission + orchestration: {:.4} s of {:.2} s request time = {:.3}% (target < 1%)",
        hint_s,
        req_s,
        hint_s / req_s * 100.0
    );
    let ok = load.server_errors == 0 && load.wrong == 0 && held == 0.0;
    println!("  {}", if ok { "PASS: no 5xx, no wrong answer, nothing held" } else { "FAIL" });
    if !ok {
        std::process::exit(1);
    }
}
