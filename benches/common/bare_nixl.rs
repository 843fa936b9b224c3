//! A bare NIXL READ of a buffer between two NIXL agents (two processes, or two agents of one
//! process): the anchor the benches put the NIXL transport against.
#![allow(dead_code)] // each bench uses a different part

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nixl_sys::{Agent, MemType, MemoryRegion, NixlDescriptor, RegistrationHandle, XferDescList, XferOp, XferStatus};

/// Set in the peer process: `BYTES` or `BYTES:DEVICE`.
pub const PEER_ENV: &str = "KVRELAY_BENCH_NIXL_PEER";
const DESC: usize = 4 << 20;

/// Memory of the pools' kind: host (touched) or device.
enum Mem {
    Host(Vec<u8>),
    Device(#[allow(dead_code)] std::sync::Arc<kvrelay::copy::CudaDevice>, kvrelay::copy::DeviceBuffer, i32),
}

impl Mem {
    fn new(bytes: usize, gpu: Option<i32>) -> Mem {
        match gpu {
            None => Mem::Host(vec![0x5a; bytes]),
            Some(d) => {
                let dev = kvrelay::copy::CudaDevice::open(d).expect("device");
                let buf = kvrelay::copy::DeviceBuffer::alloc(&dev, bytes).expect("device memory");
                Mem::Device(dev, buf, d)
            }
        }
    }
    fn addr(&self) -> usize {
        match self {
            Mem::Host(v) => v.as_ptr() as usize,
            Mem::Device(_, b, _) => b.ptr() as usize,
        }
    }
    fn kind_of(gpu: Option<i32>) -> (MemType, u64) {
        gpu.map_or((MemType::Dram, 0), |d| (MemType::Vram, d as u64))
    }
    fn kind(&self) -> (MemType, u64) {
        match self {
            Mem::Host(_) => (MemType::Dram, 0),
            Mem::Device(_, _, d) => (MemType::Vram, *d as u64),
        }
    }
}

#[derive(Debug)]
struct Region(usize, usize, MemType, u64);
impl MemoryRegion for Region {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.0 as *const u8
    }
    fn size(&self) -> usize {
        self.1
    }
}
impl NixlDescriptor for Region {
    fn mem_type(&self) -> MemType {
        self.2
    }
    fn device_id(&self) -> u64 {
        self.3
    }
}

fn agent(name: &str, mem: &Mem, bytes: usize) -> (Agent, RegistrationHandle) {
    let lib = std::env::var("KVRELAY_NIXL_LIB_DIR").unwrap_or_default();
    let path = std::path::Path::new(&lib).join("libnixl_capi.so");
    let c = std::ffi::CString::new(path.to_string_lossy().as_bytes()).unwrap();
    // SAFETY: a NUL-terminated path; loading the library nixl-sys then finds by its soname.
    assert!(!unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) }.is_null(), "{path:?}");
    let a = Agent::new(&format!("{name}-{}", std::process::id())).unwrap();
    let (_, mut params) = a.get_plugin_params("UCX").unwrap();
    let (t, d) = mem.kind();
    // the UCX options the agent's NIXL transport starts with (CUDA-IPC GET zero-copy on): the
    // anchor is the same READ, without the agent around it
    params.set("engine_config", &kvrelay::agent::nixl::ucx_options(None)).unwrap();
    a.create_backend("UCX", &params).unwrap();
    let reg = a.register_memory(&Region(mem.addr(), bytes, t, d), None).unwrap();
    (a, reg)
}

/// The peer: register `BYTES` (on `DEVICE`), print the metadata and address, wait for EOF.
pub fn peer(spec: &str) {
    let (bytes, gpu) = match spec.split_once(':') {
        Some((b, d)) => (b.parse().unwrap(), Some(d.parse().unwrap())),
        None => (spec.parse().unwrap(), None),
    };
    let mem = Mem::new(bytes, gpu);
    let (a, _reg) = agent("bare-src", &mem, bytes);
    let md = a.get_local_md().unwrap();
    let hex: String = md.iter().map(|b| format!("{b:02x}")).collect();
    println!("{} {} {hex}", a.name(), mem.addr());
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
}

/// The reading side, with its peer (a process, or an agent of this one).
pub struct Bare {
    agent: Agent,
    _reg: RegistrationHandle,
    mem: Mem,
    remote: String,
    remote_addr: usize,
    remote_kind: (MemType, u64),
    bytes: usize,
    peer: Option<Child>,
    /// The source of an in-process pair (dropped after the reader).
    _local: Option<(Agent, RegistrationHandle, Mem)>,
}

impl Drop for Bare {
    fn drop(&mut self) {
        if let Some(p) = self.peer.as_mut() {
            let _ = p.kill();
            let _ = p.wait();
        }
    }
}

impl Bare {
    pub fn new(bytes: usize, gpu: Option<i32>, dst_gpu: Option<i32>) -> Bare {
        let spec = match gpu {
            Some(d) => format!("{bytes}:{d}"),
            None => bytes.to_string(),
        };
        let mut peer = Command::new(std::env::current_exe().unwrap())
            .env(PEER_ENV, spec)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(peer.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let mut it = line.split_whitespace();
        let (name, addr, hex) = (it.next().unwrap(), it.next().unwrap(), it.next().unwrap());
        let md: Vec<u8> = (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect();
        let remote_kind = Mem::kind_of(gpu);
        let mem = Mem::new(bytes, dst_gpu);
        let (agent, reg) = agent("bare-dst", &mem, bytes);
        let remote = agent.load_remote_md(&md).unwrap();
        assert_eq!(remote, name);
        Bare {
            agent,
            _reg: reg,
            mem,
            remote,
            remote_addr: addr.parse().unwrap(),
            remote_kind,
            bytes,
            peer: Some(peer),
            _local: None,
        }
    }

    /// Both agents in this process (the anchor of two KV agents of one process).
    pub fn in_process(bytes: usize, gpu: Option<i32>) -> Bare {
        let src = Mem::new(bytes, gpu);
        let (sa, sreg) = agent("bare-src", &src, bytes);
        let md = sa.get_local_md().unwrap();
        let mem = Mem::new(bytes, gpu);
        let (agent, reg) = agent("bare-dst", &mem, bytes);
        let remote = agent.load_remote_md(&md).unwrap();
        Bare {
            agent,
            _reg: reg,
            remote_addr: src.addr(),
            remote_kind: src.kind(),
            mem,
            remote,
            bytes,
            peer: None,
            _local: Some((sa, sreg, src)),
        }
    }

    /// The bytes in `n` READ requests of equal parts, each one descriptor, all posted before
    /// the first is polled, as the agent posts a fetch of contiguous blocks (it merges
    /// descriptors that touch at both ends): bytes per second.
    pub fn read_split(&self, n: usize) -> f64 {
        let (lt, ld) = self.mem.kind();
        let (rt, rd) = self.remote_kind;
        let part = self.bytes.div_ceil(n.max(1));
        let t = Instant::now();
        let mut reqs = Vec::new();
        for start in (0..self.bytes).step_by(part) {
            let end = (start + part).min(self.bytes);
            let mut l = XferDescList::new(lt).unwrap();
            let mut r = XferDescList::new(rt).unwrap();
            l.add_desc(self.mem.addr() + start, end - start, ld);
            r.add_desc(self.remote_addr + start, end - start, rd);
            let req = self.agent.create_xfer_req(XferOp::Read, &l, &r, &self.remote, None).unwrap();
            let busy = self.agent.post_xfer_req(&req, None).unwrap();
            reqs.push((req, busy));
        }
        for (req, busy) in &mut reqs {
            while *busy {
                assert!(t.elapsed() < Duration::from_secs(60), "a bare NIXL READ ran past 60 s");
                *busy = self.agent.get_xfer_status(req).unwrap() == XferStatus::InProgress;
            }
        }
        self.bytes as f64 / t.elapsed().as_secs_f64()
    }

    /// One READ of all the bytes in 4 MiB descriptors: bytes per second.
    pub fn read(&self) -> f64 {
        let (lt, ld) = self.mem.kind();
        let (rt, rd) = self.remote_kind;
        let t = Instant::now();
        let mut l = XferDescList::new(lt).unwrap();
        let mut r = XferDescList::new(rt).unwrap();
        for off in (0..self.bytes).step_by(DESC) {
            l.add_desc(self.mem.addr() + off, DESC.min(self.bytes - off), ld);
            r.add_desc(self.remote_addr + off, DESC.min(self.bytes - off), rd);
        }
        let req = self.agent.create_xfer_req(XferOp::Read, &l, &r, &self.remote, None).unwrap();
        let mut busy = self.agent.post_xfer_req(&req, None).unwrap();
        while busy {
            assert!(t.elapsed() < Duration::from_secs(60), "a bare NIXL READ ran past 60 s");
            busy = self.agent.get_xfer_status(&req).unwrap() == XferStatus::InProgress;
        }
        self.bytes as f64 / t.elapsed().as_secs_f64()
    }
}
