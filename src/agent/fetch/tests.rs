//! The fetch's ownership of a transfer's writes, with a backend whose writes are over only
//! when the test says so: whatever way a transfer ends (a panic inside it, a failure, the
//! end of a fetch), every block a write may still reach is withheld, reported, and handed
//! back once the writes are over, never before.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use super::super::transport::{Backend, Cx, Failure, Landing, Progress, Pull, Transfer, Writes, TEST_BACKEND};
use super::super::wire::Conn;
use super::super::{Agent, AgentConfig, BlockHolder, FailReason, FetchRequest, Fingerprint, Limits};
use crate::agent::estimate::{SourceSpeed, TCP_DEFAULT};
use crate::copy::{KvLayout, Segment};

#[derive(Clone, Copy, Debug, PartialEq)]
enum End {
    /// Lands block 0, then panics inside its check.
    Panic,
    /// Lands block 0, then fails.
    Fail,
}

/// Its transfers "write" every offered block; the writes are over when `over` is set.
struct Slow {
    end: End,
    over: Arc<AtomicBool>,
}

struct SlowTransfer {
    count: usize,
    end: End,
    over: Arc<AtomicBool>,
    /// Checks answered `Pending` so far (the first few are, as a READ in flight would).
    checks: u32,
}

struct SlowWrites(Arc<AtomicBool>);

impl Writes for SlowWrites {
    fn over(&mut self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

impl Backend for Slow {
    fn hello(&self) -> u8 {
        super::wire::HELLO
    }
    fn streams(&self, _cx: &Cx<'_>, _blocks: usize) -> usize {
        1
    }
    fn movers_at_start(&self, _limits: &Limits) -> usize {
        1
    }
    fn default_speed(&self, _device_pool: bool) -> SourceSpeed {
        TCP_DEFAULT
    }
    fn prepare(
        &self,
        _cx: &Cx<'_>,
        _c: &mut dyn Conn,
        job: &mut Pull<'_>,
        land: &mut Landing<'_>,
    ) -> Result<Box<dyn Transfer + '_>, Failure> {
        land.offered = true;
        Ok(Box::new(SlowTransfer { count: job.dst.len(), end: self.end, over: self.over.clone(), checks: 0 }))
    }
    fn serve(
        &self,
        _cx: &Cx<'_>,
        _c: &mut dyn Conn,
        _ids: &[u32],
        _names: &[u64],
        _lease: &mut crate::agent::transport::Lease,
    ) -> bool {
        false
    }
}

impl Transfer for SlowTransfer {
    fn count(&self) -> usize {
        self.count
    }
    fn limit(&mut self, n: usize) {
        self.count = self.count.min(n);
    }
    fn post(&mut self, _cx: &Cx<'_>, _c: &mut dyn Conn, _job: &mut Pull<'_>) -> Result<(), Failure> {
        Ok(())
    }
    fn check(
        &mut self,
        _cx: &Cx<'_>,
        _c: &mut dyn Conn,
        _job: &mut Pull<'_>,
        land: &mut Landing<'_>,
    ) -> Result<Progress, Failure> {
        if self.checks < 100 {
            // the fetch's loop checks again (spinning, then sleeping between checks)
            self.checks += 1;
            return Ok(Progress::Pending);
        }
        land.landed(0, 7);
        match self.end {
            End::Panic => panic!("a bug inside a transfer, with its writes posted"),
            End::Fail => Err((FailReason::Truncated, "the source went away".into())),
        }
    }
    fn quiet(&mut self, _until: std::time::Instant) -> bool {
        self.over.load(Ordering::Acquire)
    }
    fn release(&mut self, _cx: &Cx<'_>, _c: &mut dyn Conn, _landed: usize, _f: Option<FailReason>, _q: bool) {}
    fn into_writes(self: Box<Self>) -> Option<Box<dyn Writes>> {
        Some(Box::new(SlowWrites(self.over)))
    }
}

/// Records what comes back.
struct Holder(Mutex<mpsc::Sender<Vec<u32>>>);

impl BlockHolder for Holder {
    fn pin(&self, _names: &[u64], _ids: &mut [u32]) -> usize {
        0
    }
    fn unpin(&self, _ids: &[u32]) {}
    fn returned(&self, ids: &[u32]) {
        let _ = self.0.lock().unwrap().send(ids.to_vec());
    }
}

const BLOCKS: u32 = 8;

fn agent(end: End, over: &Arc<AtomicBool>, mem: &mut [u8]) -> (Agent, mpsc::Receiver<Vec<u32>>) {
    let (tx, rx) = mpsc::channel();
    (agent_with(end, over, mem, Box::new(Holder(Mutex::new(tx)))), rx)
}

/// An agent over `mem` (BLOCKS host blocks) whose one backend is a [`Slow`] one, with
/// `holder`.
fn agent_with(end: End, over: &Arc<AtomicBool>, mem: &mut [u8], holder: Box<dyn BlockHolder>) -> Agent {
    let fp = Fingerprint { block_tokens: 16, layers: 1, kv_heads: 1, head_dim: 8, dtype_bytes: 2, naming: 1 };
    let layout = KvLayout::new(
        BLOCKS,
        vec![Segment { base: mem.as_mut_ptr() as u64, block_stride: 256, bytes_per_block: 256 }],
        &[],
    )
    .unwrap();
    let mut cfg = AgentConfig::new(fp);
    cfg.listen = None;
    cfg.per_user_key = false; // its sources are sockets speaking the wire by hand
    cfg.limits = Limits { fetch_threads: 1, write_grace: Duration::ZERO, unchecked_fetch: true, ..Limits::default() };
    TEST_BACKEND.with(|t| *t.borrow_mut() = Some(Box::new(Slow { end, over: over.clone() })));
    // SAFETY: `mem` is host memory of BLOCKS blocks that outlives the agent (dropped first
    // by every test).
    unsafe { Agent::new(cfg, layout, holder) }.unwrap()
}

fn fetch(a: &Agent, source: std::net::SocketAddr) -> super::FetchResult {
    let req = FetchRequest {
        endpoint: format!("tcp://{source}"),
        names: vec![11, 12, 13, 14, 15],
        held: 1,
        dst: vec![3, 4, 5, 6],
        deadline: Duration::from_secs(60),
        digests: Vec::new(),
    };
    a.submit(req, None).unwrap().wait(Duration::from_secs(120)).expect("the fetch completes")
}

#[test]
fn writes_not_proven_over_are_withheld_whatever_ends_the_transfer() {
    // a source that takes connections (the kernel's backlog) and never answers: the test
    // backend's transfers need nothing from it
    let source = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = source.local_addr().unwrap();
    for end in [End::Panic, End::Fail] {
        let mut mem = vec![0u8; BLOCKS as usize * 256];
        let over = Arc::new(AtomicBool::new(false));
        let (a, returned) = agent(end, &over, &mut mem);
        let r = fetch(&a, addr);
        let (failure, blocks) = match end {
            // a panic reports nothing written: every destination block is withheld
            End::Panic => (FailReason::Internal, 0),
            // block 0 verified; the three after it withheld
            End::Fail => (FailReason::Truncated, 1),
        };
        assert_eq!((r.failure, r.blocks, r.withheld), (Some(failure), blocks, 4 - blocks), "{end:?}: {r:?}");
        assert_eq!(a.stats().blocks_withheld, (4 - blocks) as u64);
        // nothing comes back while the writes may run (what the workers do every 50 ms)
        a.inner.reap();
        assert!(returned.try_recv().is_err(), "handed back under a write");
        over.store(true, Ordering::Release);
        let ids = returned.recv_timeout(Duration::from_secs(120)).expect("handed back once over");
        assert_eq!(ids, [3, 4, 5, 6][blocks..].to_vec());
        assert_eq!(a.stats().blocks_returned, (4 - blocks) as u64);
        drop(a);
        drop(mem);
    }
}

#[test]
fn writes_proven_over_withhold_nothing() {
    let source = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut mem = vec![0u8; BLOCKS as usize * 256];
    let over = Arc::new(AtomicBool::new(true));
    let (a, returned) = agent(End::Fail, &over, &mut mem);
    let r = fetch(&a, source.local_addr().unwrap());
    assert_eq!((r.failure, r.blocks, r.withheld), (Some(FailReason::Truncated), 1, 0), "{r:?}");
    assert_eq!(a.stats().blocks_withheld, 0);
    drop(a);
    assert!(returned.try_recv().is_err(), "nothing was withheld, nothing comes back");
}

#[test]
fn withheld_blocks_go_back_when_the_agent_stops() {
    let source = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut mem = vec![0u8; BLOCKS as usize * 256];
    let over = Arc::new(AtomicBool::new(false));
    let (a, returned) = agent(End::Fail, &over, &mut mem);
    let req = FetchRequest {
        endpoint: format!("tcp://{}", source.local_addr().unwrap()),
        names: vec![11, 12, 13, 14, 15],
        held: 1,
        dst: vec![3, 4, 5, 6],
        deadline: Duration::from_secs(60),
        digests: Vec::new(),
    };
    let handle = a.submit(req, None).unwrap();
    let r = handle.wait(Duration::from_secs(120)).expect("the fetch completes");
    assert_eq!(r.withheld, 3);
    // the writes never end by themselves: dropping the agent drops them (a backend's
    // requests end with it) and hands their blocks back before the holder goes, though
    // the runtime still holds the fetch's handle
    drop(a);
    assert_eq!(returned.try_recv().expect("handed back at stop"), vec![4, 5, 6]);
    drop(handle);
}

/// A holder whose `returned` panics: contained, the worker goes on fetching.
#[test]
fn a_panicking_holder_does_not_end_the_worker() {
    struct Panics;
    impl BlockHolder for Panics {
        fn pin(&self, _names: &[u64], _ids: &mut [u32]) -> usize {
            0
        }
        fn unpin(&self, _ids: &[u32]) {}
        fn returned(&self, _ids: &[u32]) {
            panic!("a runtime's returned that panics");
        }
    }
    let source = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut mem = vec![0u8; BLOCKS as usize * 256];
    let over = Arc::new(AtomicBool::new(false));
    let a = agent_with(End::Fail, &over, &mut mem, Box::new(Panics));
    assert_eq!(fetch(&a, source.local_addr().unwrap()).withheld, 3);
    over.store(true, Ordering::Release);
    // the one worker reaps (the holder panics: its blocks were counted returned before it
    // heard) ...
    let until = std::time::Instant::now() + Duration::from_secs(120);
    while a.stats().blocks_returned < 3 {
        assert!(std::time::Instant::now() < until, "the withheld blocks were never handed back");
        std::thread::yield_now();
    }
    // ... and still takes the next fetch
    let r = fetch(&a, source.local_addr().unwrap());
    assert_eq!((r.failure, r.blocks), (Some(FailReason::Truncated), 1));
    drop(a);
}
