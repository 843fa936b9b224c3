//! One fetch on a worker thread: connect, authenticate, ask, receive, verify, write into the
//! destination blocks in order, and report how many leading blocks arrived verified.
//!
//! The fetch owns every transfer's life ([`drive`], the same for every transport): it posts the
//! backend's [`Transfer`], checks it until done, stops it on the fetch's deadline, cancel or
//! shutdown, gives its writes the write grace and releases it. A transfer's guard ([`Held`])
//! moves writes it cannot prove over into the fetch's `unquiet` list when it goes, also while a
//! panic unwinds, and the worker withholds their blocks before the fetch completes
//! (`Inner::withhold`): a backend cannot hand back a block a write may still reach.

use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use super::pool::Mover;
use super::transport::{
    io_fail, read_reply, Backend, Cx, Failure, Landing, Progress, Pull, Scratch, Transfer, Unquiet,
};
use super::wire::{self, Conn};
use super::{auth, FailReason, FetchRequest, FetchResult, FetchState, Inner, Job, Stats};

fn cancelled() -> Failure {
    (FailReason::Cancelled, "cancelled by the runtime".into())
}

fn shutting_down() -> Failure {
    (FailReason::Shutdown, "the agent is shutting down".into())
}

/// The address of `hostport`: parsed when numeric; otherwise looked up on a short-lived thread
/// of its own (getaddrinfo cannot be interrupted), which this worker waits for at most the
/// connect timeout, checking for a cancel or the agent's shutdown every 20 ms, so that neither
/// a slow resolver nor `kvrelay_agent_free` waits on DNS. A lookup that outlives the wait ends
/// on its own and is dropped.
fn resolve(
    inner: &Inner,
    hostport: &str,
    deadline: Instant,
    stopped: &dyn Fn() -> Result<(), Failure>,
) -> Result<std::net::SocketAddr, Failure> {
    if let Ok(a) = hostport.parse::<std::net::SocketAddr>() {
        return Ok(a);
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let name = hostport.to_string();
    std::thread::Builder::new()
        .name("kvrelay-resolve".into())
        .stack_size(256 << 10)
        .spawn(move || {
            let _ = tx.send(name.to_socket_addrs().map(|mut a| a.next()));
        })
        .map_err(|e| (FailReason::Connect, format!("starting a resolver thread: {e}")))?;
    let end = deadline.min(Instant::now() + inner.limits.connect_timeout);
    loop {
        stopped()?;
        let step = end.saturating_duration_since(Instant::now()).min(std::time::Duration::from_millis(20));
        match rx.recv_timeout(step) {
            Ok(Ok(Some(a))) => return Ok(a),
            Ok(Ok(None)) => return Err((FailReason::Connect, "the endpoint resolves to no address".into())),
            Ok(Err(e)) => return Err((FailReason::Connect, format!("the endpoint does not resolve: {e}"))),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                return Err((FailReason::Connect, "the resolver thread ended without an answer".into()))
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) if Instant::now() >= end => {
                return Err((FailReason::Timeout, "resolving the endpoint ran past the connect timeout".into()))
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
        }
    }
}

/// What a worker keeps between fetches.
#[derive(Default)]
struct Worker {
    mover: Option<Mover>,
    scratch: Scratch,
}

pub(super) fn worker(inner: &Arc<Inner>) {
    let mut w = Worker::default();
    // after a fetch, the next submission is polled for until then (`Limits::poll`)
    let mut poll_until: Option<Instant> = None;
    loop {
        let job = {
            let mut q = inner.jobs.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if let Some(j) = q.pop_front() {
                    break Some(j);
                }
                if inner.stop.load(Ordering::Acquire) {
                    break None;
                }
                if let Some(end) = poll_until {
                    if Instant::now() < end {
                        drop(q);
                        for _ in 0..32 {
                            std::hint::spin_loop();
                        }
                        q = inner.jobs.lock().unwrap_or_else(|e| e.into_inner());
                        continue;
                    }
                    poll_until = None;
                }
                if inner.wants_reap() {
                    // withheld blocks, or mappings of peers: look at them every 50 ms
                    drop(q);
                    // contained: a holder's `returned` that panics must not end this worker
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| inner.reap()));
                    q = inner.jobs.lock().unwrap_or_else(|e| e.into_inner());
                    if q.is_empty() && !inner.stop.load(Ordering::Acquire) {
                        q = inner
                            .jobs_ready
                            .wait_timeout(q, std::time::Duration::from_millis(50))
                            .unwrap_or_else(|e| e.into_inner())
                            .0;
                    }
                    continue;
                }
                q = inner.jobs_ready.wait(q).unwrap_or_else(|e| e.into_inner());
            }
        };
        let Some(Job { req, state }) = job else { return };
        // a panic anywhere in the fetch is contained here: the fetch completes as failed and
        // the worker goes on (its mover, in an unknown state, is dropped, never reused; a
        // mover's drop waits for its own copies)
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(inner, &req, &state, &mut w)))
            .unwrap_or_else(|_| {
                w = Worker::default();
                state.sock.lock().unwrap_or_else(|e| e.into_inner()).clear();
                FetchResult {
                    failure: Some(FailReason::Internal),
                    seconds: state.submitted.elapsed().as_secs_f64(),
                    detail: "the fetch panicked inside the agent; nothing of it is reported written (blocks a \
                             transfer may still write are withheld)"
                        .into(),
                    ..FetchResult::default()
                }
            });
        // the first stream's mover goes back to the agent's idle movers, so that the movers
        // made at start serve whichever worker or connection runs next
        if let Some(m) = w.mover.take() {
            inner.movers.put(m);
        }
        // writes not proven over (a transfer that ended early, or one a panic unwound past):
        // their blocks are withheld before the runtime hears of the fetch
        let mut r = r;
        let unquiet = std::mem::take(&mut *state.unquiet.lock().unwrap_or_else(|e| e.into_inner()));
        r.withheld = inner.withhold(&req.dst, r.blocks, unquiet);
        match r.failure {
            None => Stats::add(&inner.stats.fetches_ok, 1),
            Some(f) => inner.stats.failed(f),
        }
        Stats::add(&inner.stats.blocks_fetched, r.blocks as u64);
        Stats::add(&inner.stats.bytes_fetched, r.bytes);
        state.complete(r);
        if !inner.limits.poll.is_zero() {
            poll_until = Some(Instant::now() + inner.limits.poll);
        }
    }
}

fn run(inner: &Inner, req: &FetchRequest, state: &FetchState, w: &mut Worker) -> FetchResult {
    let start = state.submitted;
    let deadline = start.checked_add(req.deadline).unwrap_or(start + std::time::Duration::from_secs(86_400 * 365));
    let mut blocks = 0usize;
    let mut first: Option<Instant> = None;
    let mut r = pull(inner, req, state, deadline, w, &mut blocks, &mut first);
    state.sock.lock().unwrap_or_else(|e| e.into_inner()).clear();
    if r.is_err() && state.cancel.load(Ordering::Acquire) {
        // a cancel shuts the socket down: whatever the read then said, the fetch was cancelled
        r = Err(cancelled());
    } else if r.is_err() && inner.stop.load(Ordering::Acquire) {
        r = Err(shutting_down());
    }
    let bytes = (blocks * inner.block_bytes) as u64;
    match (&r, first) {
        (_, Some(first)) => {
            // what arrived, failure or not: the first block's bytes count in the setup, the rest
            // in the throughput
            let setup = first.saturating_duration_since(start);
            let data = Instant::now().saturating_duration_since(first);
            inner.estimator.record(&req.endpoint, setup, bytes - inner.block_bytes as u64, data);
        }
        (Err((FailReason::Timeout | FailReason::Cancelled, _)), None) => {
            // no block after all this wait (the deadline, or the runtime gave up): the source's
            // setup is at least that long, so a frozen source stops looking fast. A failure that
            // ends at once (a refused connect, a refusal) says nothing of its speed.
            inner.estimator.record(&req.endpoint, start.elapsed(), 0, std::time::Duration::ZERO);
        }
        _ => {}
    }
    let (failure, detail) = match r {
        Ok(()) => (None, String::new()),
        Err((f, d)) => (Some(f), d),
    };
    // `withheld` is the worker's to set (`Inner::withhold`)
    FetchResult { failure, blocks, bytes, withheld: 0, seconds: start.elapsed().as_secs_f64(), detail }
}

/// Shuts the connection's registration down with the fetch.
struct Registered<'a>(&'a Inner, Option<u64>);
impl Drop for Registered<'_> {
    fn drop(&mut self) {
        if let Some(id) = self.1 {
            self.0.unregister(id);
        }
    }
}

/// Takes a stream's connection out of its fetch's list when dropped.
struct Published<'a>(&'a FetchState, u64);
impl Drop for Published<'_> {
    fn drop(&mut self) {
        self.0.unpublish(self.1);
    }
}

/// What one stream of a fetch did: verified blocks of its part, when its first one was.
struct Part {
    blocks: usize,
    first: Option<Instant>,
    result: Result<(), Failure>,
}

#[allow(clippy::too_many_arguments)]
fn pull(
    inner: &Inner,
    req: &FetchRequest,
    state: &FetchState,
    deadline: Instant,
    w: &mut Worker,
    blocks: &mut usize,
    first: &mut Option<Instant>,
) -> Result<(), Failure> {
    let stopped = || -> Result<(), Failure> {
        if inner.stop.load(Ordering::Acquire) {
            return Err(shutting_down());
        }
        if state.cancel.load(Ordering::Relaxed) {
            return Err(cancelled());
        }
        if Instant::now() >= deadline {
            return Err((FailReason::Timeout, "the fetch ran past its deadline".into()));
        }
        Ok(())
    };
    stopped()?;
    let hostport = req
        .endpoint
        .strip_prefix("tcp://")
        .ok_or_else(|| (FailReason::Connect, "not a tcp:// endpoint".to_string()))?;
    let addr = resolve(inner, hostport, deadline, &stopped)?;
    let asked = &req.names[req.held..req.held + req.dst.len()];
    let dst = &req.dst[..asked.len()];
    let want = req.digests.get(req.held..req.held + asked.len()).unwrap_or(&[]);
    // one stream of the fetch: a contiguous part of the run on a connection of its own
    // a part that ends short (failed, or the source's run ended inside it) makes every later
    // part useless: those stop at once (their connections are shut down) instead of moving
    // blocks that could never be reported
    let part = |k: usize, lo: usize, hi: usize, mover: &mut Option<Mover>, scratch: &mut Scratch| {
        let stopped_k = || -> Result<(), Failure> {
            stopped()?;
            if state.stop_after.load(Ordering::Acquire) < k {
                return Err((FailReason::Cancelled, "an earlier part of the fetch ended short".into()));
            }
            Ok(())
        };
        let job = Stream {
            inner,
            state,
            part: k,
            from: lo,
            addr,
            endpoint: &req.endpoint,
            asked: &asked[lo..hi],
            dst: &dst[lo..hi],
            deadline,
            stopped: &stopped_k,
        };
        let mut land = Landing::new(&inner.sums, &dst[lo..hi], want.get(lo..hi).unwrap_or(&[]));
        let result = job.run(mover, scratch, &mut land);
        let p = Part { blocks: land.blocks, first: land.first, result };
        if p.result.is_err() || p.blocks < hi - lo {
            state.stop_parts_after(k);
        }
        p
    };
    let n = inner.backend_for(addr).streams(&inner.cx(), asked.len());
    if n == 1 {
        let p = part(0, 0, asked.len(), &mut w.mover, &mut w.scratch);
        (*blocks, *first) = (p.blocks, p.first);
        return p.result;
    }
    // N streams (the source pins each part's leading run): the first on this worker, the
    // others on helper threads, each with a mover of its own
    let per = asked.len().div_ceil(n);
    let parts: Vec<(usize, usize)> = (0..asked.len()).step_by(per).map(|s| (s, (s + per).min(asked.len()))).collect();
    let mut results: Vec<Part> = Vec::with_capacity(parts.len());
    std::thread::scope(|sc| {
        let part = &part;
        let helpers: Vec<_> = parts[1..]
            .iter()
            .enumerate()
            .map(|(k, &(lo, hi))| {
                sc.spawn(move || {
                    let (mut mover, mut scratch) = (None, Scratch::default());
                    let p = part(k + 1, lo, hi, &mut mover, &mut scratch);
                    if let Some(m) = mover {
                        inner.movers.put(m);
                    }
                    p
                })
            })
            .collect();
        let (lo, hi) = parts[0];
        results.push(part(0, lo, hi, &mut w.mover, &mut w.scratch));
        for h in helpers {
            results.push(h.join().unwrap_or_else(|_| Part {
                blocks: 0,
                first: None,
                result: Err((FailReason::Internal, "a stream's thread panicked".into())),
            }));
        }
    });
    // the leading verified blocks in prefix order: whole parts, then the first part that
    // stopped short (a later part's blocks after a gap are written but not reported)
    for (k, (p, &(lo, hi))) in results.iter().zip(&parts).enumerate() {
        if let Some(f) = p.first {
            *first = Some(first.map_or(f, |g| g.min(f)));
        }
        *blocks = lo + p.blocks;
        match &p.result {
            // the source's leading run ended inside an earlier part's successor: a partial run
            Err((FailReason::SourceMiss, _)) if k > 0 => return Ok(()),
            Err(e) => return Err(e.clone()),
            Ok(()) if lo + p.blocks < hi => return Ok(()),
            Ok(()) => {}
        }
    }
    Ok(())
}

/// A new connection to `addr` (not yet authenticated: [`authenticate`], once the connection is
/// published for cancels).
fn open(inner: &Inner, addr: std::net::SocketAddr, deadline: Instant) -> Result<TcpStream, Failure> {
    let left = deadline.saturating_duration_since(Instant::now());
    let s = TcpStream::connect_timeout(
        &addr,
        inner.limits.connect_timeout.min(left).max(std::time::Duration::from_millis(1)),
    )
    .map_err(|e| match e.kind() {
        std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => {
            (FailReason::Timeout, "connect ran past its deadline".to_string())
        }
        _ => (FailReason::Connect, format!("connect: {e}")),
    })?;
    let _ = s.set_nodelay(true);
    super::set_buffers(&s, inner.limits.socket_buffer_bytes);
    Ok(s)
}

/// The key's challenge-response on a new connection `s` (nothing without a key). Runs after the
/// connection was published, so that a cancel (or the fetch's end) shuts it down here too: a
/// source that accepts and never answers holds a cancelled fetch no longer than any other read.
fn authenticate(inner: &Inner, s: &mut TcpStream, deadline: Instant, buf: &mut Vec<u8>) -> Result<(), Failure> {
    let by = || inner.io_deadline().min(deadline);
    if let Some(key) = &inner.key {
        let c: &mut dyn Conn = s;
        let client = auth::nonce().map_err(|e| (FailReason::AuthFailed, format!("no random nonce: {e}")))?;
        wire::write_frame(c, wire::AUTH_HELLO, &client, by()).map_err(|e| io_fail(&e, "authentication"))?;
        let kind = read_reply(c, buf, wire::MAX_CONTROL, "authentication", by())?;
        if kind != wire::AUTH_CHALLENGE || buf.len() != 2 * auth::NONCE {
            return Err((FailReason::AuthFailed, "the source did not answer with a challenge".into()));
        }
        let server: [u8; auth::NONCE] = buf[..auth::NONCE].try_into().expect("32 bytes");
        // the proof goes first so that a source with another key counts the refusal too; it
        // is bound to this connection's fresh nonces, so it is of no use to anyone else
        wire::write_frame(c, wire::AUTH_PROOF, &key.client_proof(&client, &server), by())
            .map_err(|e| io_fail(&e, "authentication"))?;
        if !key.check_server(&client, &server, &buf[auth::NONCE..]) {
            return Err((FailReason::AuthFailed, "the source does not prove it holds the key".into()));
        }
    }
    Ok(())
}

/// How one exchange on a connection ended.
enum Exchange {
    /// Done; the connection can carry the next request.
    Reusable,
    /// Done or failed; the connection is closed.
    Close(Result<(), Failure>),
    /// A kept-alive connection failed before the source answered anything: the source had
    /// closed it. Try again on a new one.
    Stale,
}

/// One stream of a fetch: what it asks `addr` for and where the blocks go, under the fetch's
/// deadline and stop check.
struct Stream<'a> {
    inner: &'a Inner,
    state: &'a FetchState,
    /// Which part of the fetch (0 for the first).
    part: usize,
    /// Where its blocks start in the fetch's destination blocks.
    from: usize,
    addr: std::net::SocketAddr,
    /// The endpoint as the request named it (the estimator's key).
    endpoint: &'a str,
    asked: &'a [u64],
    dst: &'a [u32],
    deadline: Instant,
    stopped: &'a (dyn Fn() -> Result<(), Failure> + Sync),
}

impl Stream<'_> {
    /// Ask for `asked` on a kept-alive connection to `addr` (or a new, authenticated one),
    /// receive into `dst` with the stream's mover (taken from the agent's when `None`) and
    /// buffer; keep the connection for the next fetch when the exchange ended cleanly.
    fn run(&self, mover: &mut Option<Mover>, scratch: &mut Scratch, land: &mut Landing<'_>) -> Result<(), Failure> {
        let (inner, addr) = (self.inner, self.addr);
        let mut kept = inner.take_idle(addr);
        // the preference this stream fetches with (it moves down when a backend cannot reach
        // the source)
        let mut level = inner.level(addr);
        loop {
            let reused = kept.is_some();
            let mut s = match kept.take() {
                Some(s) => s,
                None => open(inner, addr, self.deadline)?,
            };
            let Some(id) = inner.register(&s) else { return Err(shutting_down()) };
            let reg = Registered(inner, Some(id));
            // published for cancels and sibling stops while this stream uses it; unpublished
            // (the clone closed) whatever way the stream ends with it
            self.state.publish(self.part, id, &s);
            let published = Published(self.state, id);
            // a cancel (or a sibling's stop) that came before the socket was published
            (self.stopped)()?;
            if !reused {
                authenticate(inner, &mut s, self.deadline, &mut scratch.buf)?;
            }
            let backend = inner.backend_at(level);
            match self.exchange(&mut s, reused, backend, mover, scratch, land) {
                Exchange::Stale => continue,
                // this backend cannot reach the source and nothing moved: once more with the
                // next preference (TCP after the last, `Limits::tcp_fallback`), on a new
                // connection
                // (a backend says so only before it prepared a transfer: nothing was written)
                Exchange::Close(Err(e)) if land.unusable && land.blocks == 0 => {
                    let Some(next) = inner.fall_back(addr, self.endpoint, level) else { return Err(e) };
                    level = next;
                    land.unusable = false;
                    land.offered = false;
                    (self.stopped)()?;
                    continue;
                }
                Exchange::Close(r) => return r,
                Exchange::Reusable => {
                    if reused {
                        Stats::add(&inner.stats.streams_reused, 1);
                    }
                    drop(published);
                    drop(reg);
                    // from here the pool alone owns the connection; one that a cancel may have
                    // shut down in the meantime is closed instead
                    if (self.stopped)().is_ok() {
                        // a CUDA IPC source keeps its export area, and so this connection, longer
                        let area = backend.hello() == wire::IPC_HELLO && land.offered;
                        inner.put_idle(addr, s, area);
                    }
                    return Ok(());
                }
            }
        }
    }

    /// One request and its answer on connection `s` (`reused`: a kept-alive one), the bytes
    /// moved by the agent's backend.
    fn exchange(
        &self,
        s: &mut TcpStream,
        reused: bool,
        backend: &dyn Backend,
        mover: &mut Option<Mover>,
        scratch: &mut Scratch,
        land: &mut Landing<'_>,
    ) -> Exchange {
        let Stream { inner, asked, dst, deadline, stopped, from, .. } = *self;
        let c: &mut dyn Conn = s;
        let by = inner.io_deadline().min(deadline);
        if let Err(e) = wire::write_frame(c, backend.hello(), &wire::encode_hello(&inner.fingerprint, asked), by) {
            return if reused { Exchange::Stale } else { Exchange::Close(Err(io_fail(&e, "the hello"))) };
        }
        // the source's answer comes after its connection woke, pinned and offered
        c.poll_readable(inner.limits.poll);
        let mut job = Pull { asked, dst, deadline, stopped, mover, scratch };
        let ready = self.state.on_offer.as_deref();
        match drive(&inner.cx(), backend, c, &mut job, land, from, ready, &self.state.unquiet) {
            Ok(true) => Exchange::Reusable,
            Ok(false) => Exchange::Close(Ok(())),
            // no answer at all on a kept-alive connection: the source had closed it
            Err((FailReason::Truncated, _)) if reused && !land.offered => Exchange::Stale,
            Err(e) => Exchange::Close(Err(e)),
        }
    }
}

/// A transfer and what it did, on the stack of the stream that drives it: dropped with writes
/// not proven quiet (an early end past the write grace, or a panic unwinding through the
/// stream), it moves them into the fetch's `unquiet` list, with how far into the fetch's
/// destination blocks they may reach.
struct Held<'t, 'f> {
    t: Option<Box<dyn Transfer + 't>>,
    /// Where the stream's blocks start in the fetch's destination blocks.
    from: usize,
    sink: &'f Unquiet,
    /// Every write of it is over ([`Transfer::quiet`] said so).
    quiet: bool,
}

impl Drop for Held<'_, '_> {
    fn drop(&mut self) {
        let Some(t) = self.t.take() else { return };
        if self.quiet {
            return;
        }
        let end = self.from + t.count();
        if let Some(w) = t.into_writes() {
            self.sink.lock().unwrap_or_else(|e| e.into_inner()).push((w, end));
        }
    }
}

/// Checks of a pending transfer spin this many times before they sleep between checks.
const SPINS: u32 = 64;
/// The sleep between checks of a pending transfer after the spins.
const CHECK_SLEEP: std::time::Duration = std::time::Duration::from_micros(20);

/// One transfer of a stream, after its hello went out on `c`, the same for every backend:
/// prepare (the source's answer), post, check until every offered block was looked at or
/// the fetch stops (`job.stopped`: deadline, cancel, shutdown, an earlier part ended short),
/// give the writes `Limits::write_grace` to be quiet, release. `Ok(true)`: the connection
/// can carry the stream's next request. Writes not proven quiet go to `sink` (see [`Held`]);
/// `from` is where the stream's blocks start in the fetch's destination blocks. With a room
/// callback (`ready`, [`crate::agent::OnOffer`]), the runtime makes the offered part of the
/// stream's destination ready between the offer and the first write, and the transfer takes
/// only what it made ready.
#[allow(clippy::too_many_arguments)]
fn drive(
    cx: &Cx<'_>,
    backend: &dyn Backend,
    c: &mut dyn Conn,
    job: &mut Pull<'_>,
    land: &mut Landing<'_>,
    from: usize,
    ready: Option<&(dyn Fn(usize, usize) -> usize + Send + Sync)>,
    sink: &Unquiet,
) -> Result<bool, Failure> {
    let mut t = backend.prepare(cx, c, job, land)?;
    if let Some(ready) = ready {
        let n = t.count();
        // the runtime evicts for these blocks only now that the source said it has them
        let got = ready(from, n).min(n);
        if got < n {
            t.limit(got);
        }
    }
    // posted from here on (a post that fails half way has posted the first half)
    let mut held = Held { t: Some(t), from, sink, quiet: false };
    let t = held.t.as_deref_mut().expect("set above");
    let r = (|| -> Result<bool, Failure> {
        t.post(cx, c, job)?;
        let (mut spins, mut seen) = (0u32, land.blocks);
        loop {
            (job.stopped)()?;
            match t.check(cx, c, job, land)? {
                Progress::Done { reusable } => return land.cut.take().map_or(Ok(reusable), Err),
                Progress::Pending if land.blocks != seen => (spins, seen) = (0, land.blocks),
                Progress::Pending if spins < SPINS => {
                    spins += 1;
                    std::hint::spin_loop();
                }
                Progress::Pending => std::thread::sleep(CHECK_SLEEP),
            }
        }
    })();
    let quiet = t.quiet(Instant::now() + cx.limits.write_grace);
    t.release(cx, c, land.blocks, r.as_ref().err().map(|e| e.0), quiet);
    held.quiet = quiet;
    r
}

/// One exchange of a fetch over `c` on the calling thread, through the agent's backend: the
/// hello for `names[..dst.len()]` goes out, whatever `c` answers is taken as the source's reply
/// (for tests and fuzzing of what a source can send; `dst` checked by the caller).
pub(super) fn over_connection(inner: &Inner, c: &mut dyn Conn, names: &[u64], dst: &[u32]) -> FetchResult {
    let start = Instant::now();
    let deadline = start + std::time::Duration::from_secs(10);
    let stopped = || Ok(());
    let (mut mover, mut scratch) = (None, Scratch::default());
    let asked = &names[..dst.len()];
    let mut land = Landing::new(&inner.sums, dst, &[]);
    let unquiet = Unquiet::default();
    let r = (|| {
        let hello = wire::encode_hello(&inner.fingerprint, asked);
        wire::write_frame(c, inner.backend().hello(), &hello, deadline).map_err(|e| io_fail(&e, "the hello"))?;
        let mut job = Pull { asked, dst, deadline, stopped: &stopped, mover: &mut mover, scratch: &mut scratch };
        drive(&inner.cx(), inner.backend(), c, &mut job, &mut land, 0, None, &unquiet).map(|_| ())
    })();
    if let Some(m) = mover {
        inner.movers.put(m);
    }
    let withheld = inner.withhold(dst, land.blocks, unquiet.into_inner().unwrap_or_else(|e| e.into_inner()));
    let (failure, detail) = match r {
        Ok(()) => (None, String::new()),
        Err((f, d)) => (Some(f), d),
    };
    FetchResult {
        failure,
        blocks: land.blocks,
        bytes: (land.blocks * inner.block_bytes) as u64,
        withheld,
        seconds: start.elapsed().as_secs_f64(),
        detail,
    }
}

#[cfg(test)]
mod tests;
