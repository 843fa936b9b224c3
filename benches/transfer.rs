//! Cross-instance KV transfer between two release `kvrelay-server` processes on loopback
//! (`cargo bench --features server --bench transfer`), with an 8B-model KV shape (32 layers,
//! 8 KV heads, head size 128, BF16: 128 KiB per token, 4 MiB per 32-token block).
//!
//! One source instance serves a destination per transport (`KVRELAY_BENCH_TRANSPORTS`, default
//! `tcp,nixl` when built with the `nixl` feature, else `tcp`; a NIXL source also serves TCP
//! readers).
//!
//! 1. Throughput: a 1 GiB prefix (8,192 tokens) fetched by a `kv.fetch` hint over each
//!    transport, against anchors measured in the same run and repetition: a plain loopback TCP
//!    copy of the same bytes; with NIXL, a bare NIXL READ of the same bytes between two
//!    processes (this bench, twice: 256 descriptors of 4 MiB in one request, memory of the
//!    pools' kind registered once); with GPU pools, the contiguous device-to-device copy and
//!    the pinned host-to-device copy (the PCIe ceiling) of 1 GiB.
//! 2. Time to first token with fetch against local prefill, 1k to 32k-token prompts: the
//!    modeled prefill time (25,000 tokens/s, `--prefill-tokens-per-s`), the measured local
//!    prefill of an instance with that rate (never faster than the reference engine writing
//!    the KV bytes), and the measured fetch path per transport (instances without a modeled
//!    rate, so their fetch-or-prefill estimate always fetches).
//!
//! `KVRELAY_BENCH_DEVICE=cuda:0` puts every pool in GPU memory (instances on one GPU);
//! `KVRELAY_BENCH_DST_DEVICE=cuda:1` then moves the destinations (and the local instance) to a
//! second GPU, and the ceilings add the peer-to-peer copy between the two;
//! `KVRELAY_BENCH_MAX_TOKENS` caps the prompt sizes (default 32768). NIXL instances find the
//! library through `KVRELAY_NIXL_LIB_DIR` (or the loader path), like the servers. Bounded: fixed
//! sizes and repetitions; every request has the client's 60 s deadline, every NIXL wait 60 s.

#[path = "../src/bin/kvrelay-server/client.rs"]
mod client;
#[path = "common/server.rs"]
mod server;
use server::{listening_addr, server_bin};
#[path = "common/loopback.rs"]
mod loopback;
use loopback::loopback_copy;

use std::net::SocketAddr;
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

fn src_device() -> String {
    std::env::var("KVRELAY_BENCH_DEVICE").unwrap_or_else(|_| "cpu".into())
}

fn dst_device() -> String {
    std::env::var("KVRELAY_BENCH_DST_DEVICE").unwrap_or_else(|_| src_device())
}

fn start(device: &str, extra: &[&str], rate: &str) -> Server {
    let lib_dir = std::env::var("KVRELAY_NIXL_LIB_DIR").unwrap_or_default();
    let mut child = Command::new(server_bin())
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--kv-blocks",
            &kv_blocks().to_string(),
            "--device",
            device,
            "--prefill-tokens-per-s",
            rate,
        ])
        .args(SHAPE)
        .args(["--max-body-bytes", "16777216"])
        .args(extra)
        .env("KVRELAY_TRUST_KV_HINTS", "1")
        .env("KVRELAY_LOG", std::env::var("KVRELAY_BENCH_LOG").unwrap_or_else(|_| "warn".into()))
        .env("KVRELAY_NIXL_LIB_DIR", lib_dir)
        .stdout(Stdio::piped())
        .spawn()
        .expect("start kvrelay-server");
    let addr = listening_addr(&mut child);
    let kv = client::get(addr, "/v1/kv/info").unwrap().json()["kv_endpoint"].as_str().unwrap().to_string();
    Server { child, addr, kv }
}

fn max_tokens() -> usize {
    std::env::var("KVRELAY_BENCH_MAX_TOKENS").ok().and_then(|v| v.parse().ok()).unwrap_or(32768)
}

/// Blocks per pool: the largest prompt (the throughput prefix is at most that) plus room.
fn kv_blocks() -> usize {
    max_tokens() / 32 + 76
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

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    #[cfg(feature = "nixl")]
    if let Ok(spec) = std::env::var(bare::PEER_ENV) {
        bare::peer(&spec);
        return;
    }
    let max_tokens = max_tokens();
    let (device, dst_dev) = (src_device(), dst_device());
    let default_transports = if cfg!(feature = "nixl") { "tcp,nixl" } else { "tcp" };
    let transports: Vec<String> = std::env::var("KVRELAY_BENCH_TRANSPORTS")
        .unwrap_or_else(|_| default_transports.into())
        .split(',')
        .map(|t| t.trim().to_string())
        .collect();
    let nixl = transports.iter().any(|t| t == "nixl");
    let src = start(&device, &["--kv-transport", if nixl { "nixl" } else { "tcp" }], "0");
    // The fetching destinations have no modeled rate, so they always fetch (their estimate never
    // prefers local prefill); the local one prefills at the modeled 25,000 tokens/s.
    let dsts: Vec<(String, Server)> = transports
        .iter()
        .map(|t| (t.clone(), start(&dst_dev, &["--trusted-endpoint", &src.kv.clone(), "--kv-transport", t], "0")))
        .collect();
    let local = start(&dst_dev, &[], "25000");
    println!(
        "transfer bench: pools on {device}, {} KiB per token, 4 MiB blocks, transports {transports:?}",
        TOKEN_BYTES / 1024
    );
    let n = 8192.min(max_tokens);
    let gpu = |d: &str| d.strip_prefix("cuda:").and_then(|d| d.parse::<i32>().ok());
    let (src_gpu, dst_gpu) = (gpu(&device), gpu(&dst_dev));
    if let (Some(a), Some(b)) = (src_gpu, dst_gpu) {
        ceilings(a, b, n * TOKEN_BYTES);
    }
    #[cfg(feature = "nixl")]
    let bare = if nixl { Some(bare::Bare::new(n * TOKEN_BYTES, src_gpu, dst_gpu)) } else { None };

    // 1. Throughput of a 1 GiB prefix: one warm-up transfer per transport (first-use costs:
    // threads, buffers, NIXL connections), then five measured, each against the anchors
    // measured in the same repetition.
    for rep in 0..6 {
        let p = tokens(100 + rep, n);
        complete(&src, json!({"prompt": p, "max_tokens": 1}));
        let look = client::post(src.addr, "/v1/kv/lookup", &json!({"prompt": p})).unwrap().json();
        let mut line = Vec::new();
        let mut rates = Vec::new();
        let mut bytes = 0;
        for (t, dst) in &dsts {
            let before = metric(dst, "kvrelay_server_kv_transfer_seconds_sum");
            let (v, total) =
                complete(dst, json!({"prompt": p, "max_tokens": 1, "kv_hints": hint(&src.kv, &look["block_hashes"])}));
            let fetch_s = metric(dst, "kvrelay_server_kv_transfer_seconds_sum") - before;
            bytes = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() as usize * TOKEN_BYTES;
            rates.push((t.clone(), bytes as f64 / fetch_s));
            line.push(format!("{t} {fetch_s:.3} s = {:.2} GB/s (request {total:.3} s)", bytes as f64 / fetch_s / 1e9));
        }
        if rep == 0 {
            println!("  warm-up: {} (not counted)", line.join("; "));
            #[cfg(feature = "nixl")]
            if let Some(b) = &bare {
                b.read(); // its first READ connects
            }
            continue;
        }
        let anchor = loopback_copy(bytes);
        let mut out = format!("  {:.2} GiB: {}", bytes as f64 / (1u64 << 30) as f64, line.join("; "));
        out += &format!("; loopback TCP copy {:.2} GB/s", anchor / 1e9);
        for (t, r) in &rates {
            out += &format!("; {t} = {:.1}% of loopback", r / anchor * 100.0);
        }
        #[cfg(feature = "nixl")]
        if let Some(b) = &bare {
            let bare_rate = b.read();
            out += &format!("; bare NIXL READ {:.2} GB/s", bare_rate / 1e9);
            for (t, r) in &rates {
                out += &format!("; {t} = {:.1}% of bare NIXL", r / bare_rate * 100.0);
            }
        }
        println!("{out}");
    }

    // 2. Time to first token: local prefill (modeled 25,000 tokens/s) against fetch.
    println!("  tokens | modeled prefill | local prefill TTFT (measured) | per transport: fetch TTFT, / modeled, / measured local");
    let mut crossover: Vec<Option<usize>> = vec![None; dsts.len()];
    let mut size = 1024;
    while size <= max_tokens {
        let p = tokens(size as u32, size);
        complete(&src, json!({"prompt": p, "max_tokens": 1}));
        let look = client::post(src.addr, "/v1/kv/lookup", &json!({"prompt": p})).unwrap().json();
        let (_, measured) = complete(&local, json!({"prompt": p, "max_tokens": 1}));
        let modeled = size as f64 / 25_000.0;
        let mut out = format!("  {size:>6} | {:>8.1} ms | {:>8.1} ms", modeled * 1e3, measured * 1e3);
        for (k, (t, dst)) in dsts.iter().enumerate() {
            let (v, fetch) =
                complete(dst, json!({"prompt": p, "max_tokens": 1, "kv_hints": hint(&src.kv, &look["block_hashes"])}));
            let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
            out += &format!(
                " | {t} {:>7.1} ms, {:.3}, {:.3} ({cached} fetched)",
                fetch * 1e3,
                fetch / modeled,
                fetch / measured
            );
            if fetch < modeled && crossover[k].is_none() {
                crossover[k] = Some(size);
            }
        }
        println!("{out}");
        size *= 2;
    }
    for (k, (t, _)) in dsts.iter().enumerate() {
        match crossover[k] {
            Some(c) => println!("  {t}: fetch beats the modeled prefill from {c} tokens on"),
            None => println!("  {t}: fetch never beat the modeled prefill (25,000 tokens/s) at these sizes"),
        }
    }
}

/// The GPU ceilings of moving `bytes`, measured in this run: contiguous device-to-device (on
/// `src`, and from `src` to `dst` when they differ) and pinned host-to-device copies (best of 3
/// after a warm-up).
fn ceilings(device: i32, other: i32, bytes: usize) {
    use kvrelay::copy::{CudaDevice, CudaEvent, CudaStream, DeviceBuffer, PinnedBuffer};
    let d = CudaDevice::open(device).expect("the bench device");
    let peer = (other != device).then(|| {
        let o = CudaDevice::open(other).expect("the second bench device");
        let buf = {
            let _g = o.bind().unwrap();
            DeviceBuffer::alloc(&o, bytes).unwrap()
        };
        (o, buf)
    });
    let _ctx = d.bind().unwrap();
    let s = CudaStream::new(&d).unwrap();
    let (a, b) = (DeviceBuffer::alloc(&d, bytes).unwrap(), DeviceBuffer::alloc(&d, bytes).unwrap());
    let h = PinnedBuffer::alloc(&d, bytes).unwrap();
    let time = |f: &dyn Fn()| -> f64 {
        let (e0, e1) = (CudaEvent::new(&d).unwrap(), CudaEvent::new(&d).unwrap());
        f();
        s.synchronize().unwrap();
        let mut best = f32::MAX;
        for _ in 0..3 {
            e0.record(&s).unwrap();
            f();
            e1.record(&s).unwrap();
            e1.synchronize().unwrap();
            best = best.min(e1.elapsed_ms(&e0).unwrap());
        }
        bytes as f64 / (best as f64 * 1e-3)
    };
    use cudarc::driver::sys;
    // SAFETY: copies of `bytes` between live allocations of that size, on this bench's stream,
    // with the device's context current (`_ctx`).
    let d2d = time(&|| unsafe {
        sys::cuMemcpyDtoDAsync_v2(b.ptr(), a.ptr(), bytes, s.raw());
    });
    // SAFETY: as above.
    let h2d = time(&|| unsafe {
        sys::cuMemcpyHtoDAsync_v2(a.ptr(), h.as_slice().as_ptr() as *const _, bytes, s.raw());
    });
    let p2p = peer.as_ref().map(|(_, far)| {
        // Peer access from this device's context to the other's primary context (NVLink where
        // present); a refusal leaves the driver's staged path, which the figure then shows.
        let (mut dev, mut pctx) = (0, std::ptr::null_mut());
        // SAFETY: out-parameters are valid; the other device's primary context is retained for
        // the rest of the process (the bench exits after).
        let peer_ok = unsafe {
            sys::cuDeviceGet(&mut dev, other) == sys::CUresult::CUDA_SUCCESS
                && sys::cuDevicePrimaryCtxRetain(&mut pctx, dev) == sys::CUresult::CUDA_SUCCESS
                && matches!(
                    sys::cuCtxEnablePeerAccess(pctx, 0),
                    sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
                )
        };
        println!("  peer access cuda:{device} -> cuda:{other}: {}", if peer_ok { "enabled" } else { "not available" });
        // SAFETY: as above; `far` is a live allocation of `bytes` on the other device (unified
        // addressing: the driver routes the copy between the devices).
        time(&|| unsafe {
            sys::cuMemcpyDtoDAsync_v2(far.ptr(), a.ptr(), bytes, s.raw());
        })
    });
    println!(
        "  ceilings ({:.2} GiB, contiguous, this run): device-to-device {:.1} GB/s{}, pinned host-to-device {:.1} GB/s",
        bytes as f64 / (1u64 << 30) as f64,
        d2d / 1e9,
        p2p.map_or(String::new(), |r| format!(", cuda:{device} to cuda:{other} {:.1} GB/s", r / 1e9)),
        h2d / 1e9
    );
}

/// A bare NIXL READ between two processes: the anchor of the NIXL transport.
#[cfg(feature = "nixl")]
#[path = "common/bare_nixl.rs"]
mod bare;
