//! The KV agent over loopback TCP, in one process (`cargo bench --bench agent`), with the 8B
//! KV shape of `benches/transfer.rs` (32 layers, 8 KV heads, head size 128, BF16: 4 MiB per
//! 32-token block; TensorRT-LLM-style all-layers-per-block host pools).
//!
//! 1. Throughput: a 1 GiB run (256 blocks) fetched through the agent, against a plain loopback
//!    TCP copy of the same bytes (one stream, 4 MiB writes) measured in the same run and
//!    repetition; median of the repetitions.
//!    A second anchor in the same repetition, pool to pool: the same bytes sent straight out
//!    of one 1 GiB host buffer and read straight into another, each byte once, as between two
//!    pools (the first anchor's 4 MiB buffers stay in the CPU caches; pools do not).
//! 2. The agent's own host cost: the time of one `submit` call (checks and copies, no I/O), of
//!    recording checksums per block (summed where the blocks lie), and the CPU time of the whole
//!    process (both agents) per GB fetched, against the anchor's.
//! 3. Back to back: the same 1 GiB fetch repeated with nothing between (a busy runtime's steady
//!    state), against the device copy (GPU pools) and the split bare NIXL READ (NIXL) run back
//!    to back as well; in (1) the TCP anchors run between fetches, so every fetch starts from
//!    idle threads.
//! 4. First use: the first fetch of two new agents (8 blocks) against warm 8-block fetches, and
//!    the first 1 GiB fetch (every stream's first use) against the median one.
//!
//! `KVRELAY_BENCH_DEVICE=cuda:N` puts both pools in the memory of GPU N (both agents on one
//! GPU, the bytes still crossing loopback TCP through each agent's pinned slots).
//! `KVRELAY_BENCH_STREAMS=N` fetches over N TCP streams (`Limits::streams`; default 1), against
//! N loopback copies at once; `KVRELAY_BENCH_MIN_STREAM_BYTES` sets `Limits::min_stream_bytes`
//! of the fetching agent (how small a fetch may be and still use several streams). `KVRELAY_BENCH_TRANSPORT=nixl` (feature `nixl`) runs the source
//! in a process of its own and adds a bare NIXL READ between two processes as the anchor;
//! `KVRELAY_BENCH_TRANSPORT=cuda-ipc` (GPU pools) runs the source in a process of its own over
//! the same-host CUDA IPC transport. With GPU pools every run also measures a device-to-device
//! copy of the same bytes in one process (`cuMemcpyDtoD`), the ceiling of a same-host copy, and
//! the CUDA IPC transport's copy-and-sum kernel alone over the same bytes (pool to pool).
//!
//! `KVRELAY_BENCH_SOURCE_DEVICE=cuda:M` (with `KVRELAY_BENCH_DEVICE=cuda:N`) puts the source's
//! pool on GPU M: two GPUs of one host. The anchors then copy from M to N with peer access on
//! (NVLink where present): the device copy becomes the peer copy, the kernel alone reads over
//! the link, and the bare NIXL READ reads M's memory from N.
//! `KVRELAY_BENCH_VMM=N` (GPU pools) makes every pool of the run device memory of the virtual
//! memory API, N allocations side by side (`VmmBuffer`; a CUDA IPC source then hands its
//! allocations out as file descriptors).
//! `KVRELAY_BENCH_POLL_US=N` sets `Limits::poll` of every agent of the run (source and
//! destination): their threads poll N microseconds for the next step before they sleep.
//!
//! Bounded: fixed sizes, `KVRELAY_BENCH_REPS` repetitions (default 10), every fetch a 60 s deadline.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

#[cfg(feature = "nixl")]
#[path = "common/bare_nixl.rs"]
mod bare;
#[path = "common/loopback.rs"]
mod loopback;
use loopback::{loopback_copy_between, loopback_copy_streams};

use kvrelay::agent::{Agent, AgentConfig, BlockHolder, FetchRequest, Fingerprint};
use kvrelay::copy::KvLayout;

const LAYERS: u32 = 32;
const KV_BLOCK: u64 = 8 * 128 * 2 * 32; // one layer's K (or V) of a 32-token block
const BLOCKS: u32 = 256;

struct Held(Mutex<HashMap<u64, u32>>);
impl BlockHolder for Held {
    fn pin(&self, names: &[u64], ids: &mut [u32]) -> usize {
        let m = self.0.lock().unwrap();
        names.iter().zip(ids.iter_mut()).take_while(|(n, _)| m.contains_key(n)).map(|(n, id)| *id = m[n]).count()
    }
    fn unpin(&self, _: &[u32]) {}
}

/// The pool's memory: host, a device buffer, or device memory of the virtual memory API.
enum Mem {
    Host(#[allow(dead_code)] Vec<u128>),
    Device(#[allow(dead_code)] kvrelay::copy::DeviceBuffer),
    Vmm(#[allow(dead_code)] kvrelay::copy::VmmBuffer),
}

fn pool(device: Option<&std::sync::Arc<kvrelay::copy::CudaDevice>>) -> (Mem, KvLayout) {
    let bytes = u64::from(BLOCKS) * u64::from(LAYERS) * 2 * KV_BLOCK;
    let mut mem = vec![0u128; (bytes / 16) as usize];
    for (i, w) in mem.iter_mut().enumerate() {
        *w = (i as u128).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835);
    }
    match device {
        None => {
            let layout = KvLayout::all_layers_per_block(mem.as_mut_ptr() as u64, LAYERS, BLOCKS, KV_BLOCK).unwrap();
            (Mem::Host(mem), layout)
        }
        Some(dev) => {
            // SAFETY: a plain byte view of the u128 vector.
            let host = unsafe { std::slice::from_raw_parts(mem.as_ptr().cast::<u8>(), bytes as usize) };
            // `KVRELAY_BENCH_VMM=N`: N allocations of the virtual memory API side by side
            let vmm: usize = std::env::var("KVRELAY_BENCH_VMM").ok().and_then(|s| s.parse().ok()).unwrap_or(0);
            if vmm > 0 {
                let d = kvrelay::copy::VmmBuffer::alloc(dev, bytes as usize, vmm, true).unwrap();
                d.write(0, host).unwrap();
                let layout = KvLayout::all_layers_per_block(d.ptr(), LAYERS, BLOCKS, KV_BLOCK).unwrap();
                return (Mem::Vmm(d), layout);
            }
            let d = kvrelay::copy::DeviceBuffer::alloc(dev, bytes as usize).unwrap();
            d.write(0, host).unwrap();
            let layout = KvLayout::all_layers_per_block(d.ptr(), LAYERS, BLOCKS, KV_BLOCK).unwrap();
            (Mem::Device(d), layout)
        }
    }
}

/// CPU time of this whole process so far (every thread, ended ones included), seconds.
fn cpu_seconds() -> f64 {
    // SAFETY: getrusage writes one `rusage` into the zeroed local.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a valid out-pointer for RUSAGE_SELF.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 * 1e-6;
    t(u.ru_utime) + t(u.ru_stime)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Set in the NIXL source's process.
const SOURCE_ENV: &str = "KVRELAY_BENCH_AGENT_SOURCE";

fn main() {
    #[cfg(feature = "nixl")]
    if let Ok(spec) = std::env::var(bare::PEER_ENV) {
        bare::peer(&spec);
        return;
    }
    let reps: usize =
        std::env::var("KVRELAY_BENCH_REPS").ok().filter(|s| !s.is_empty()).and_then(|s| s.parse().ok()).unwrap_or(10);
    let fp = Fingerprint { block_tokens: 32, layers: LAYERS, kv_heads: 8, head_dim: 128, dtype_bytes: 2, naming: 1 };
    let device: Option<i32> = std::env::var("KVRELAY_BENCH_DEVICE")
        .ok()
        .filter(|s| !s.is_empty() && s != "cpu")
        .map(|s| s.trim_start_matches("cuda:").parse().expect("KVRELAY_BENCH_DEVICE=cuda:N"));
    let dev = device.map(|d| kvrelay::copy::CudaDevice::open(d).expect("the bench's GPU"));
    // the source's GPU (`KVRELAY_BENCH_SOURCE_DEVICE=cuda:M`; default the same one): two GPUs
    // of one host, the anchors then copying between them with peer access on
    let src_device: Option<i32> = match std::env::var("KVRELAY_BENCH_SOURCE_DEVICE").ok().filter(|s| !s.is_empty()) {
        Some(s) => {
            assert!(device.is_some(), "KVRELAY_BENCH_SOURCE_DEVICE needs KVRELAY_BENCH_DEVICE=cuda:N");
            Some(s.trim_start_matches("cuda:").parse().expect("KVRELAY_BENCH_SOURCE_DEVICE=cuda:M"))
        }
        None => device,
    };
    let (src_dev, peer) = match (src_device, &dev) {
        (Some(s), Some(d)) if s != d.ordinal() => {
            let sd = kvrelay::copy::CudaDevice::open(s).expect("the source's GPU");
            let peer =
                d.enable_peer_access(&sd).expect("peer access") && sd.enable_peer_access(d).expect("peer access");
            println!(
                "two GPUs: source cuda:{s}, destination cuda:{}, peer access {}",
                d.ordinal(),
                if peer { "on" } else { "not possible (copies through the host; no kernel-alone anchor)" }
            );
            (Some(sd), peer)
        }
        _ => (dev.clone(), true),
    };
    let nixl = std::env::var("KVRELAY_BENCH_TRANSPORT").is_ok_and(|t| t == "nixl");
    let ipc = std::env::var("KVRELAY_BENCH_TRANSPORT").is_ok_and(|t| t == "cuda-ipc");
    // NIXL and CUDA IPC: the source in a process of its own (as between two instances)
    let separate = nixl || ipc;
    let transport = if ipc {
        assert!(device.is_some(), "KVRELAY_BENCH_TRANSPORT=cuda-ipc needs KVRELAY_BENCH_DEVICE=cuda:N");
        kvrelay::agent::Transport::CudaIpc
    } else if nixl {
        if !cfg!(feature = "nixl") {
            panic!("KVRELAY_BENCH_TRANSPORT=nixl needs --features nixl");
        }
        let lib_dir = std::env::var_os("KVRELAY_NIXL_LIB_DIR").filter(|d| !d.is_empty()).map(Into::into);
        kvrelay::agent::Transport::Nixl { lib_dir }
    } else {
        kvrelay::agent::Transport::Tcp
    };
    // with NIXL the source runs in a process of its own (as between two instances: UCX moves
    // VRAM with CUDA IPC only across processes); over TCP both agents share this one
    let names: Vec<u64> = (1..=u64::from(BLOCKS)).collect();
    // every agent's poll (`KVRELAY_BENCH_POLL_US`; the source process reads it too)
    let poll =
        Duration::from_micros(std::env::var("KVRELAY_BENCH_POLL_US").ok().and_then(|s| s.parse().ok()).unwrap_or(0));
    let source_role = std::env::var_os(SOURCE_ENV).is_some();
    let mut child = None;
    let mut _source = None;
    let (ep, record) = if separate && !source_role {
        let mut c = std::process::Command::new(std::env::current_exe().unwrap());
        if let Some(s) = src_device {
            c.env("KVRELAY_BENCH_DEVICE", format!("cuda:{s}")).env_remove("KVRELAY_BENCH_SOURCE_DEVICE");
        }
        let mut c = c
            .env(SOURCE_ENV, "1")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(c.stdout.take().unwrap()), &mut line).unwrap();
        let (ep, rec) = line.trim().split_once(' ').expect("the source process's endpoint and timing");
        child = Some(c);
        (ep.to_string(), rec.parse::<f64>().unwrap())
    } else {
        let (mem, layout) = pool(src_dev.as_ref());
        let held = Held(Mutex::new(names.iter().enumerate().map(|(i, &n)| (n, i as u32)).collect()));
        let mut src_cfg = AgentConfig::new(fp.clone());
        src_cfg.device = src_device;
        src_cfg.transport = transport.clone();
        src_cfg.limits.poll = poll;
        src_cfg.limits.socket_buffer_bytes =
            std::env::var("KVRELAY_BENCH_SOCKET_BUFFER").ok().and_then(|s| s.parse().ok()).unwrap_or(0);
        // SAFETY: the pool (host or device memory, as configured) lives in `_source` until the
        // end of main, and the agent is dropped first (it comes first in the tuple).
        let src = unsafe { Agent::new(src_cfg, layout, Box::new(held)) }.unwrap();
        let ids: Vec<u32> = (0..BLOCKS).collect();
        let t = Instant::now();
        src.record_checksums(&ids).unwrap();
        let record = t.elapsed().as_secs_f64();
        let ep = src.endpoint().unwrap().to_string();
        _source = Some((src, mem));
        (ep, record)
    };
    if source_role {
        println!("{ep} {record}");
        let mut sink = Vec::new();
        let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink);
        return;
    }
    let (_dst_mem, dst_layout) = pool(dev.as_ref());
    // TCP streams per fetch (`KVRELAY_BENCH_STREAMS`, default 1); the anchor then copies over
    // as many loopback streams at once
    let streams: usize = std::env::var("KVRELAY_BENCH_STREAMS").ok().and_then(|s| s.parse().ok()).unwrap_or(1);
    let mut cfg = AgentConfig::new(fp.clone());
    cfg.listen = None;
    cfg.device = device;
    cfg.transport = transport.clone();
    cfg.limits.streams = streams as u32;
    cfg.limits.poll = poll;
    cfg.limits.unchecked_fetch = true; // the bench moves blocks by name: the transport is measured
                                       // socket buffers of both sides (`KVRELAY_BENCH_SOCKET_BUFFER`, bytes; 0: the kernel's)
    let sockbuf: u32 = std::env::var("KVRELAY_BENCH_SOCKET_BUFFER").ok().and_then(|s| s.parse().ok()).unwrap_or(0);
    cfg.limits.socket_buffer_bytes = sockbuf;
    // least bytes per stream (`KVRELAY_BENCH_MIN_STREAM_BYTES`; default: the library's)
    let min_stream: u64 = std::env::var("KVRELAY_BENCH_MIN_STREAM_BYTES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(cfg.limits.min_stream_bytes);
    cfg.limits.min_stream_bytes = min_stream;
    // SAFETY: the pool lives until the end of main, after the agent is dropped.
    let dst = unsafe { Agent::new(cfg, dst_layout, Box::new(Held(Mutex::new(HashMap::new())))) }.unwrap();
    let ids: Vec<u32> = (0..BLOCKS).collect();
    let bytes = BLOCKS as usize * dst.block_bytes();
    let req = || FetchRequest {
        endpoint: ep.clone(),
        names: names.clone(),
        held: 0,
        dst: ids.clone(),
        deadline: Duration::from_secs(60),
        digests: Vec::new(),
    };
    // the first fetch of two new agents (connections and handshakes; the movers were made
    // when the agents started): 8 blocks, compared below with 8-block fetches once warm
    let r = dst
        .submit(FetchRequest { dst: ids[..8].to_vec(), ..req() }, None)
        .unwrap()
        .wait(Duration::from_secs(90))
        .unwrap();
    assert_eq!((r.failure, r.blocks), (None, 8), "{}", r.detail);
    let first_small = r.seconds;
    // warm-up: the first 1 GiB fetch (every stream's connection and movers)
    let r = dst.submit(req(), None).unwrap().wait(Duration::from_secs(90)).unwrap();
    assert_eq!((r.failure, r.blocks), (None, BLOCKS as usize), "{}", r.detail);
    let first = r.seconds;
    #[cfg(feature = "nixl")]
    let bare = nixl.then(|| bare::Bare::new(bytes, src_device, device));
    let (mut agent, mut anchor, mut ratio, mut fetch_s) = (vec![], vec![], vec![], vec![]);
    // CPU seconds and wall seconds: anchor, then agent (this process holds both ends of both)
    let mut cpu = (0.0, 0.0, 0.0, 0.0);
    // the second anchor's two host buffers of the fetch's size, touched before use
    let mut between = (vec![3u8; bytes], vec![0u8; bytes]);
    between.1.fill(1);
    let (mut between_rates, mut between_ratio) = (vec![], vec![]);
    #[cfg_attr(not(feature = "nixl"), allow(unused_mut))]
    let mut bare_rates: Vec<f64> = vec![];
    #[cfg_attr(not(feature = "nixl"), allow(unused_mut))]
    let mut bare_split_rates: Vec<f64> = vec![];
    // the agent's requests per 1 GiB fetch (`nixl::REQUEST_BYTES_GPU` / `REQUEST_BYTES`)
    #[cfg(feature = "nixl")]
    let bare_requests = bytes.div_ceil(if device.is_some() {
        kvrelay::agent::nixl::REQUEST_BYTES_GPU
    } else {
        kvrelay::agent::nixl::REQUEST_BYTES
    });
    // GPU pools: a device-to-device copy of the same bytes in this process (the copy engines'
    // ceiling the same-host transport is measured against)
    let d2d = dev.as_ref().map(|d| {
        let a = kvrelay::copy::DeviceBuffer::alloc(src_dev.as_ref().unwrap_or(d), bytes).unwrap();
        let b = kvrelay::copy::DeviceBuffer::alloc(d, bytes).unwrap();
        (a, b, kvrelay::copy::CudaStream::new(d).unwrap())
    });
    let mut d2d_rates: Vec<f64> = vec![];
    // GPU pools: the CUDA IPC transport's copy-and-sum kernel alone over the same bytes, pool
    // to pool in this process (what the transport adds beyond it is its protocol)
    // (it reads the source's GPU from this one: only with peer access between two GPUs)
    let mut kernel = dev.as_ref().filter(|_| peer).map(|d| {
        let ((from_mem, from), (to_mem, to)) = (pool(src_dev.as_ref().or(Some(d))), pool(Some(d)));
        // SAFETY: the layout lies in `to_mem`, kept beside the engine until the end of main.
        let mut e =
            unsafe { kvrelay::copy::CudaEngine::new(d, to.clone(), kvrelay::copy::EngineOptions::default()) }.unwrap();
        // the keyed tags' NH sums, taken by the same kernel when asked (a keyed agent's copies)
        e.set_block_key(&kvrelay::block_mac::BlockMac::new(&[7; 32], to.stage_block_bytes() as usize)).unwrap();
        let segs: Vec<(u64, u64)> = from.segments().iter().map(|g| (g.base, g.block_stride)).collect();
        (from_mem, to_mem, e, segs, kvrelay::copy::CudaStream::new(d).unwrap())
    });
    let (mut kernel_rates, mut tagged_rates): (Vec<f64>, Vec<f64>) = (vec![], vec![]);
    let mut sums = vec![0u64; BLOCKS as usize];
    let mut nh = vec![kvrelay::block_mac::NhSums::default(); BLOCKS as usize];
    for _ in 0..reps {
        if let Some((_, _, e, segs, st)) = &mut kernel {
            let t = Instant::now();
            // SAFETY: the source blocks lie in a live device pool nothing else writes.
            unsafe { e.copy_and_sum_from(segs, &ids, &ids, &mut sums, st) }.unwrap();
            kernel_rates.push(bytes as f64 / t.elapsed().as_secs_f64());
            let t = Instant::now();
            // SAFETY: as above.
            unsafe { e.copy_and_sum_from_tagged(segs, &ids, &ids, &mut sums, Some(&mut nh), st) }.unwrap();
            tagged_rates.push(bytes as f64 / t.elapsed().as_secs_f64());
        }
        if let Some((a, b, st)) = &d2d {
            let t = Instant::now();
            // SAFETY: two live device buffers of `bytes` each, used by nothing else.
            unsafe { st.copy_device(b.ptr(), a.ptr(), bytes) }.unwrap();
            st.synchronize().unwrap();
            d2d_rates.push(bytes as f64 / t.elapsed().as_secs_f64());
        }
        #[cfg(feature = "nixl")]
        if let Some(b) = &bare {
            bare_rates.push(b.read());
            bare_split_rates.push(b.read_split(bare_requests));
        }
        let p = bytes as f64 / loopback_copy_between(&between.0, &mut between.1, streams);
        let c0 = cpu_seconds();
        let a = bytes as f64 / loopback_copy_streams(bytes, streams);
        let c1 = cpu_seconds();
        let r = dst.submit(req(), None).unwrap().wait(Duration::from_secs(90)).unwrap();
        let c2 = cpu_seconds();
        cpu.0 += c1 - c0;
        cpu.1 += a;
        cpu.2 += c2 - c1;
        cpu.3 += r.seconds;
        assert_eq!((r.failure, r.blocks), (None, BLOCKS as usize), "{}", r.detail);
        agent.push(bytes as f64 / r.seconds / 1e9);
        fetch_s.push(r.seconds);
        anchor.push(bytes as f64 / a / 1e9);
        ratio.push(a / r.seconds);
        between_rates.push(bytes as f64 / p / 1e9);
        between_ratio.push(p / r.seconds);
    }
    // back to back: the same 1 GiB fetch `reps` times in a row with nothing between (a busy
    // runtime's steady state: with `poll` set, no thread sleeps between steps), against its
    // anchors run back to back as well; medians of each loop
    let mut b2b: Vec<f64> = vec![];
    for _ in 0..reps {
        let r = dst.submit(req(), None).unwrap().wait(Duration::from_secs(90)).unwrap();
        assert_eq!((r.failure, r.blocks), (None, BLOCKS as usize), "{}", r.detail);
        b2b.push(bytes as f64 / r.seconds);
    }
    let mut b2b_d2d: Vec<f64> = vec![];
    if let Some((a, b, st)) = &d2d {
        for _ in 0..reps {
            let t = Instant::now();
            // SAFETY: two live device buffers of `bytes` each, used by nothing else.
            unsafe { st.copy_device(b.ptr(), a.ptr(), bytes) }.unwrap();
            st.synchronize().unwrap();
            b2b_d2d.push(bytes as f64 / t.elapsed().as_secs_f64());
        }
    }
    #[cfg_attr(not(feature = "nixl"), allow(unused_mut))]
    let mut b2b_bare: Vec<f64> = vec![];
    #[cfg(feature = "nixl")]
    if let Some(b) = &bare {
        for _ in 0..reps {
            b2b_bare.push(b.read_split(bare_requests));
        }
    }
    let vmm = std::env::var("KVRELAY_BENCH_VMM").ok().filter(|v| v != "0" && !v.is_empty());
    let gpus = match (device, src_device) {
        (Some(d), Some(s)) if s != d => format!("source cuda:{s}, destination cuda:{d}"),
        (Some(d), _) => format!("cuda:{d}, both agents"),
        _ => String::new(),
    };
    let pools = device.map_or("host pools".to_string(), |_| match &vmm {
        Some(n) => format!("GPU pools ({gpus}; virtual memory API, {n} allocations each)"),
        None => format!("GPU pools ({gpus})"),
    });
    let how = if ipc {
        "CUDA IPC from a source process".to_string()
    } else if nixl {
        "NIXL (UCX) from a source process".to_string()
    } else {
        format!("loopback TCP, {streams} stream(s)")
    };
    println!("agent fetch, 1 GiB (256 blocks of 4 MiB), {reps} repetitions, {pools}, {how}:");
    println!(
        "  agent            median {:.2} GB/s (min {:.2}, max {:.2})",
        median(agent.clone()),
        agent.iter().cloned().fold(f64::MAX, f64::min),
        agent.iter().cloned().fold(0.0, f64::max)
    );
    println!("  plain TCP copy   median {:.2} GB/s (anchor, same repetitions, {streams} stream(s))", median(anchor));
    if !d2d_rates.is_empty() {
        let r: Vec<f64> = agent.iter().zip(&d2d_rates).map(|(g, d)| g * 1e9 / d).collect();
        println!(
            "  device copy      median {:.2} GB/s (anchor, same repetitions: cuMemcpyDtoD of the same bytes in one process); agent / it median {:.0}% (per repetition {:.0}-{:.0}%)",
            median(d2d_rates.clone()) / 1e9,
            100.0 * median(r.clone()),
            100.0 * r.iter().cloned().fold(f64::MAX, f64::min),
            100.0 * r.iter().cloned().fold(0.0, f64::max)
        );
    }
    if !kernel_rates.is_empty() {
        let r: Vec<f64> = agent.iter().zip(&kernel_rates).map(|(g, k)| g * 1e9 / k).collect();
        let k: Vec<f64> = kernel_rates.iter().zip(&d2d_rates).map(|(k, d)| k / d).collect();
        println!(
            "  copy-and-sum     median {:.2} GB/s (the CUDA IPC transport's kernel alone, same bytes, pool to pool in one process, same repetitions); it / device copy median {:.0}%; agent / it median {:.0}% (per repetition {:.0}-{:.0}%)",
            median(kernel_rates.clone()) / 1e9,
            100.0 * median(k),
            100.0 * median(r.clone()),
            100.0 * r.iter().cloned().fold(f64::MAX, f64::min),
            100.0 * r.iter().cloned().fold(0.0, f64::max)
        );
        let t: Vec<f64> = tagged_rates.iter().zip(&kernel_rates).map(|(t, k)| t / k).collect();
        println!(
            "  copy-sum-tag     median {:.2} GB/s (the same kernel also taking the keyed tags' NH sums, what a keyed agent runs, same repetitions); it / copy-and-sum median {:.1}% (per repetition {:.1}-{:.1}%)",
            median(tagged_rates.clone()) / 1e9,
            100.0 * median(t.clone()),
            100.0 * t.iter().cloned().fold(f64::MAX, f64::min),
            100.0 * t.iter().cloned().fold(0.0, f64::max)
        );
    }
    if !bare_rates.is_empty() {
        let fetch: Vec<f64> = agent.iter().map(|g| g * 1e9).collect();
        let r: Vec<f64> = fetch.iter().zip(&bare_rates).map(|(f, b)| f / b).collect();
        println!(
            "  bare NIXL READ   median {:.2} GB/s (anchor, same repetitions, between two processes); agent / bare READ median {:.0}% (per repetition {:.0}-{:.0}%)",
            median(bare_rates.clone()) / 1e9,
            100.0 * median(r.clone()),
            100.0 * r.iter().cloned().fold(f64::MAX, f64::min),
            100.0 * r.iter().cloned().fold(0.0, f64::max)
        );
        let r: Vec<f64> = fetch.iter().zip(&bare_split_rates).map(|(f, b)| f / b).collect();
        println!(
            "  bare NIXL, split median {:.2} GB/s (anchor, same repetitions: the same bytes in as many READ requests as the agent posts, one descriptor each, all posted at once); agent / it median {:.0}% (per repetition {:.0}-{:.0}%)",
            median(bare_split_rates.clone()) / 1e9,
            100.0 * median(r.clone()),
            100.0 * r.iter().cloned().fold(f64::MAX, f64::min),
            100.0 * r.iter().cloned().fold(0.0, f64::max)
        );
    }
    {
        let mut line = format!(
            "  back to back     agent median {:.2} GB/s ({reps} fetches in a row, poll {} us)",
            median(b2b.clone()) / 1e9,
            poll.as_micros()
        );
        if !b2b_d2d.is_empty() {
            line += &format!(
                "; device copy back to back {:.2} GB/s, agent / it {:.0}%",
                median(b2b_d2d.clone()) / 1e9,
                100.0 * median(b2b.clone()) / median(b2b_d2d)
            );
        }
        if !b2b_bare.is_empty() {
            line += &format!(
                "; bare NIXL split back to back {:.2} GB/s, agent / it {:.0}%",
                median(b2b_bare.clone()) / 1e9,
                100.0 * median(b2b.clone()) / median(b2b_bare)
            );
        }
        println!("{line}");
    }
    println!(
        "  first 1 GiB      {:.1} ms (its streams' first use), {:.2}x the median fetch's {:.1} ms",
        first * 1e3,
        first / median(fetch_s.clone()),
        median(fetch_s.clone()) * 1e3
    );
    println!(
        "  agent / anchor   median {:.0}% (per repetition {:.0}-{:.0}%)",
        100.0 * median(ratio.clone()),
        100.0 * ratio.iter().cloned().fold(f64::MAX, f64::min),
        100.0 * ratio.iter().cloned().fold(0.0, f64::max)
    );
    println!(
        "  pool-to-pool TCP median {:.2} GB/s (second anchor: sent from and read into two 1 GiB buffers, {streams} stream(s)); agent / it median {:.0}% (per repetition {:.0}-{:.0}%)",
        median(between_rates),
        100.0 * median(between_ratio.clone()),
        100.0 * between_ratio.iter().cloned().fold(f64::MAX, f64::min),
        100.0 * between_ratio.iter().cloned().fold(0.0, f64::max)
    );
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "  CPU, {}   agent {:.2} core-s per GB ({:.1} cores busy), anchor {:.2} core-s per GB ({:.1} cores busy), of {cores} cores",
        if separate { "this process (not the source's)" } else { "both ends" },
        cpu.2 / (reps as f64 * bytes as f64 / 1e9),
        cpu.2 / cpu.3,
        cpu.0 / (reps as f64 * bytes as f64 / 1e9),
        cpu.0 / cpu.1
    );
    println!(
        "  record_checksums {:.2} GB/s ({:.0} us per 4 MiB block, summed in place)",
        bytes as f64 / record / 1e9,
        record * 1e6 / f64::from(BLOCKS)
    );
    // small fetches (1 and 8 blocks): time from submission to completion, over a kept-alive
    // connection (this agent) and over a new connection each time (an agent with reuse off)
    let mut cold_cfg = AgentConfig::new(fp);
    cold_cfg.listen = None;
    cold_cfg.device = device;
    cold_cfg.transport = transport;
    cold_cfg.limits.idle_timeout = Duration::ZERO;
    cold_cfg.limits.unchecked_fetch = true;
    cold_cfg.limits.streams = streams as u32;
    cold_cfg.limits.min_stream_bytes = min_stream;
    cold_cfg.limits.poll = poll;
    let (_cold_mem, cold_layout) = pool(dev.as_ref());
    // SAFETY: the pool lives until the end of main, after the agent is dropped.
    let cold = unsafe { Agent::new(cold_cfg, cold_layout, Box::new(Held(Mutex::new(HashMap::new())))) }.unwrap();
    for k in [1usize, 8] {
        let small = |a: &Agent| {
            let mut t = Vec::new();
            for _ in 0..50 {
                let r = a
                    .submit(
                        FetchRequest {
                            endpoint: ep.clone(),
                            names: names.clone(),
                            held: 0,
                            dst: ids[..k].to_vec(),
                            deadline: Duration::from_secs(10),
                            digests: Vec::new(),
                        },
                        None,
                    )
                    .unwrap()
                    .wait(Duration::from_secs(20))
                    .unwrap();
                assert_eq!((r.failure, r.blocks), (None, k), "{}", r.detail);
                t.push(r.seconds * 1e6);
            }
            median(t)
        };
        let (warm, fresh) = (small(&dst), small(&cold));
        if k == 8 {
            println!(
                "  first fetch      {:.0} us (8 blocks, two new agents), {:.2}x a warm 8-block fetch",
                first_small * 1e6,
                first_small * 1e6 / warm
            );
        }
        println!(
            "  {k}-block fetch   median {warm:.0} us on kept-alive connections, {fresh:.0} us on new ones (50 each; {} stream(s), min_stream_bytes {min_stream}, poll {} us)",
            if separate { 1 } else { streams.min(((k * dst.block_bytes()) as u64 / min_stream).max(1) as usize).min(k) },
            poll.as_micros()
        );
    }
    drop(cold);
    // the cost of a submission on the caller's thread (queued to a source that refuses nothing:
    // an unroutable port, so each completes quickly with a connect failure)
    let n = 500;
    let small = |i: u32| FetchRequest {
        endpoint: "tcp://127.0.0.1:1".into(),
        names: names[..8].to_vec(),
        held: 0,
        dst: vec![i % BLOCKS],
        deadline: Duration::from_secs(5),
        digests: Vec::new(),
    };
    let mut fetches = Vec::with_capacity(n);
    let t = Instant::now();
    for i in 0..n {
        fetches.push(dst.submit(small(i as u32), None).unwrap());
    }
    let per = t.elapsed().as_secs_f64() / n as f64;
    for f in fetches {
        f.wait(Duration::from_secs(30)).unwrap();
    }
    println!(
        "  submit           {:.2} us per call (8 names, 1 destination block; includes building the request)",
        per * 1e6
    );
    if nixl {
        // a READ UCX had to emulate would show here (0 expected between two processes)
        println!("  slow NIXL reads  {} (nixl_slow_reads of the destination agent)", dst.stats().nixl_slow_reads);
    }
    drop(dst);
    if let Some(mut c) = child {
        drop(c.stdin.take()); // the source process ends at EOF
        let _ = c.wait();
    }
}
