//! What the agent's threads share ([`Inner`]): the configuration, the pool's layout and movers,
//! the holder, the checksum table, the counters, the connection registry, the job queue, the
//! idle connections and the transport.

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::handle::{FetchState, Job};
use super::stats::Stats;
use super::sums::SumTable;
use super::{estimate, pool, service, transport, BlockHolder, Fingerprint, Limits, PeerAllow, Psk};
use super::{FailReason, FetchResult};
use crate::copy::KvLayout;

pub(super) struct Inner {
    pub(super) fingerprint: Fingerprint,
    pub(super) allow: PeerAllow,
    pub(super) limits: Limits,
    pub(super) key: Option<Psk>,
    pub(super) layout: KvLayout,
    pub(super) block_bytes: usize,
    pub(super) movers: pool::Movers,
    pub(super) holder: Box<dyn BlockHolder>,
    pub(super) sums: SumTable,
    pub(super) estimator: estimate::Estimator,
    /// What the runtime reported its own import of fetched blocks costs.
    pub(super) import_cost: estimate::ImportCost,
    pub(super) stats: Stats,
    pub(super) stop: AtomicBool,
    /// Connections per peer address (handshake and serving).
    pub(super) peers: Mutex<HashMap<IpAddr, u32>>,
    /// Accepted connections that have not completed their handshake yet, oldest first: when
    /// the handshake slots (or an address's places) are all taken, the oldest of them makes
    /// room for a new connection (see `service::make_room`).
    pub(super) greeting: Mutex<VecDeque<service::Greeting>>,
    /// Live sockets (served and fetched), shut down at stop; the count of live connection
    /// threads is the map's length.
    pub(super) conns: Mutex<(u64, HashMap<u64, TcpStream>)>,
    pub(super) conns_idle: Condvar,
    pub(super) jobs: Mutex<VecDeque<Job>>,
    pub(super) jobs_ready: Condvar,
    /// Queued fetches a cancel took out, waiting for their completion on an agent thread, and
    /// whether that thread runs (it ends when the list is empty).
    pub(super) cancelled: Mutex<(Vec<Job>, bool)>,
    /// Writes that were not proven over when their fetch ended, with the destination blocks
    /// they may write (withheld from the runtime until every one of them is over).
    pub(super) withheld: Mutex<Vec<Withheld>>,
    /// Kept-alive fetch connections per source address, with when each went idle and how long
    /// it may be taken again.
    pub(super) idle: Mutex<HashMap<SocketAddr, Vec<IdleConn>>>,
    /// How a fetch's bytes move (TCP frames, NIXL READs in place, CUDA IPC copies): the
    /// transport seam, in order of preference (one but for `Transport::Prefer`; never empty).
    pub(super) backends: Vec<Box<dyn transport::Backend>>,
    /// Sources a preferred backend could not reach: how many preferences down they are
    /// fetched from since when (past the last of `backends`: TCP, `Limits::tcp_fallback`).
    pub(super) tcp_sources: Mutex<HashMap<SocketAddr, (usize, Instant)>>,
}

/// Writes not proven over when their fetch ended, and the destination blocks they may write.
pub(super) type Withheld = (Vec<Box<dyn transport::Writes>>, Vec<u32>);

/// The TCP backend a fetch falls back to.
static TCP: transport::tcp::Tcp = transport::tcp::Tcp;

/// The preference `addr` is marked for in `m`, if the mark is younger than
/// [`super::config::TCP_FALLBACK_MEMORY`] (0 otherwise: the first).
fn level_in(m: &HashMap<SocketAddr, (usize, Instant)>, addr: SocketAddr) -> usize {
    match m.get(&addr) {
        Some(&(l, since)) if since.elapsed() < super::config::TCP_FALLBACK_MEMORY => l,
        _ => 0,
    }
}

/// Most sources remembered as reachable over TCP only (the oldest marks go first beyond).
const MAX_TCP_SOURCES: usize = 4096;

/// Set a socket's send and receive buffers to `bytes` (0: leave the kernel's autotuning).
pub(super) fn set_buffers(s: &TcpStream, bytes: u32) {
    if bytes == 0 {
        return;
    }
    use std::os::fd::AsRawFd;
    let v = bytes as libc::c_int;
    for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
        // SAFETY: a live socket's descriptor; `v` is a c_int that lives across the call and
        // its size is passed; setsockopt only reads it.
        unsafe {
            libc::setsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                (&v as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
    }
}

/// Most kept-alive fetch connections per source address.
pub(super) const MAX_IDLE_PER_SOURCE: usize = 16;
/// A kept-alive fetch connection: since when it is idle, and for how long it may be taken again.
pub(super) type IdleConn = (TcpStream, Instant, Duration);
/// How long a source keeps a connection waiting for its next hello while it holds an export
/// area for it (CUDA IPC), when its idle timeout is shorter: a destination that fetches again
/// within half of it maps nothing new, and the source makes no new area. Sparse fetches (a
/// prompt every few seconds, the cold prefills between them) otherwise each pay for a new
/// area: an allocation, its export and its mapping at both ends.
pub(super) const AREA_KEEP: Duration = Duration::from_secs(60);

impl Inner {
    /// The agent's first preference (its only backend but for `Transport::Prefer`).
    pub(super) fn backend(&self) -> &dyn transport::Backend {
        &*self.backends[0]
    }

    /// The backend fetches from `addr` use: the agent's first preference, or the one a fetch
    /// from it fell back to within the last [`super::config::TCP_FALLBACK_MEMORY`] (a later
    /// preference, or TCP).
    pub(super) fn backend_for(&self, addr: SocketAddr) -> &dyn transport::Backend {
        self.backend_at(self.level(addr))
    }

    /// The backend of preference `level` (0: the first; past the last: TCP).
    pub(super) fn backend_at(&self, level: usize) -> &dyn transport::Backend {
        self.backends.get(level).map_or(&TCP, |b| &**b)
    }

    /// How many preferences down `addr` is fetched from now (0: the first; past the last: TCP).
    pub(super) fn level(&self, addr: SocketAddr) -> usize {
        if self.backend().hello() == super::wire::HELLO {
            return 0;
        }
        level_in(&self.tcp_sources.lock().unwrap_or_else(|e| e.into_inner()), addr)
    }

    /// A fetch from `addr` with the backend of preference `used` failed, unable to reach it:
    /// the level to make it again with, if any. A source another fetch already moved past
    /// `used` is tried at its level (not counted again); otherwise the next preference (TCP
    /// after the last, when `Limits::tcp_fallback` allows), marked for `addr` from now and
    /// counted; the estimate of `endpoint` (that source) then starts again from the new
    /// backend's default for as long as the mark holds, its measurements being of a transport
    /// it is no longer fetched with (and from the first backend's default after).
    pub(super) fn fall_back(&self, addr: SocketAddr, endpoint: &str, used: usize) -> Option<usize> {
        if self.backend().hello() == super::wire::HELLO {
            return None;
        }
        let mut m = self.tcp_sources.lock().unwrap_or_else(|e| e.into_inner());
        let now_at = level_in(&m, addr);
        if now_at > used {
            return Some(now_at);
        }
        let next = used + 1;
        let tcp = self.backends.len();
        if next > tcp || (next == tcp && !self.limits.tcp_fallback) {
            return None;
        }
        if m.len() >= MAX_TCP_SOURCES && !m.contains_key(&addr) {
            let memory = super::config::TCP_FALLBACK_MEMORY;
            m.retain(|_, (_, since)| since.elapsed() < memory);
            if m.len() >= MAX_TCP_SOURCES {
                if let Some(oldest) = m.iter().min_by_key(|(_, (_, since))| *since).map(|(a, _)| *a) {
                    m.remove(&oldest);
                }
            }
        }
        m.insert(addr, (next, Instant::now()));
        drop(m);
        let device_pool = matches!(self.movers.memory(), super::pool::Memory::Device(_));
        let until = Instant::now() + super::config::TCP_FALLBACK_MEMORY;
        self.estimator.restart(endpoint, self.backend_at(next).default_speed(device_pool), until);
        Stats::add(&self.stats.transport_fallbacks, 1);
        Some(next)
    }

    /// The backend that serves hellos of `kind` other than TCP's, if any.
    pub(super) fn serving(&self, kind: u8) -> Option<&dyn transport::Backend> {
        self.backends.iter().find(|b| b.hello() == kind).map(|b| &**b)
    }

    /// Whether any backend has something to look at again ([`transport::Backend::wants_reap`]).
    /// A cancel of `state`: if its fetch still waits in the queue, take it out and complete it
    /// (`cancelled`) on an agent thread at once, instead of when a worker reaches it. Where that
    /// thread cannot start, the job goes back to the head of the queue (a worker completes it
    /// as before: it sees the cancel before any I/O).
    pub(super) fn cancel_queued(inner: &Arc<Inner>, state: &Arc<FetchState>) {
        let job = {
            let mut q = inner.jobs.lock().unwrap_or_else(|e| e.into_inner());
            let Some(at) = q.iter().position(|j| Arc::ptr_eq(&j.state, state)) else { return };
            q.remove(at).expect("found above")
        };
        let mut c = inner.cancelled.lock().unwrap_or_else(|e| e.into_inner());
        c.0.push(job);
        if c.1 {
            return; // the running completer takes it
        }
        let me = inner.clone();
        let spawned =
            std::thread::Builder::new().name("kvrelay-cancelled".into()).stack_size(256 << 10).spawn(move || loop {
                let job = {
                    let mut c = me.cancelled.lock().unwrap_or_else(|e| e.into_inner());
                    match c.0.pop() {
                        Some(j) => j,
                        None => {
                            c.1 = false;
                            return;
                        }
                    }
                };
                let r = FetchResult {
                    failure: Some(FailReason::Cancelled),
                    seconds: job.state.submitted.elapsed().as_secs_f64(),
                    detail: "cancelled by the runtime while it waited in the queue".into(),
                    ..FetchResult::default()
                };
                me.stats.failed(FailReason::Cancelled);
                job.state.complete(r);
            });
        match spawned {
            Ok(_) => c.1 = true,
            Err(_) => {
                let jobs = std::mem::take(&mut c.0);
                drop(c);
                let mut q = inner.jobs.lock().unwrap_or_else(|e| e.into_inner());
                for j in jobs {
                    q.push_front(j);
                }
                drop(q);
                inner.jobs_ready.notify_one();
            }
        }
    }

    pub(super) fn wants_reap(&self) -> bool {
        !self.withheld.lock().unwrap_or_else(|e| e.into_inner()).is_empty()
            || self.backends.iter().any(|b| b.wants_reap())
    }

    /// Hand back the withheld blocks whose writes are all over; every backend looks at what it
    /// holds mapped ([`transport::Backend::reap`]). The writes are asked outside the list's
    /// lock (a NIXL status call may progress UCX), and a holder's `returned` that panics is
    /// contained here: the other entries are still handed back.
    pub(super) fn reap(&self) {
        let mut pending: Vec<Withheld> = std::mem::take(&mut *self.withheld.lock().unwrap_or_else(|e| e.into_inner()));
        if !pending.is_empty() {
            let mut over = Vec::new();
            let mut i = 0;
            while i < pending.len() {
                if pending[i].0.iter_mut().all(|x| x.over()) {
                    over.push(pending.swap_remove(i));
                } else {
                    i += 1;
                }
            }
            // what is still running goes back (beside what other fetches withheld meanwhile)
            self.withheld.lock().unwrap_or_else(|e| e.into_inner()).extend(pending);
            for (writes, ids) in over {
                drop(writes);
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.give_back(&ids)));
            }
        }
        let cx = self.cx();
        for b in &self.backends {
            b.reap(&cx);
        }
    }

    /// What a backend sees of the agent.
    pub(super) fn cx(&self) -> transport::Cx<'_> {
        transport::Cx {
            layout: &self.layout,
            block_bytes: self.block_bytes,
            movers: &self.movers,
            limits: &self.limits,
            stats: &self.stats,
            sums: &self.sums,
        }
    }

    /// A fetch into `dst` ended with `blocks` leading blocks reported written, and `unquiet`
    /// writes of its streams not proven over, each with the index one past the last of `dst` it
    /// may write: the blocks after the reported ones up to the furthest such index are
    /// withheld (kept with the writes until they are all over, then handed back through
    /// `BlockHolder::returned`). Returns how many; counted in `blocks_withheld`.
    pub(super) fn withhold(
        &self,
        dst: &[u32],
        blocks: usize,
        unquiet: Vec<(Box<dyn transport::Writes>, usize)>,
    ) -> usize {
        if unquiet.is_empty() {
            return 0;
        }
        let end = unquiet.iter().map(|u| u.1).max().unwrap_or(0).min(dst.len());
        let ids = dst.get(blocks..end).unwrap_or(&[]).to_vec();
        if ids.is_empty() {
            // the writes may only touch blocks reported written (and verified): nothing to
            // withhold; they are dropped, which stops them
            return 0;
        }
        let n = ids.len();
        Stats::add(&self.stats.blocks_withheld, n as u64);
        let writes = unquiet.into_iter().map(|u| u.0).collect();
        self.withheld.lock().unwrap_or_else(|e| e.into_inner()).push((writes, ids));
        // an idle worker looks at them every 50 ms from now on (the queue's lock taken first:
        // a worker that found nothing to reap under it is waiting by now, and hears this)
        drop(self.jobs.lock().unwrap_or_else(|e| e.into_inner()));
        self.jobs_ready.notify_one();
        n
    }

    /// A kept-alive connection to `addr` young enough to use (within half of how long its
    /// source keeps it: the idle timeout, or [`AREA_KEEP`] for one whose source holds an export
    /// area for it).
    pub(super) fn take_idle(&self, addr: SocketAddr) -> Option<TcpStream> {
        let mut m = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let v = m.get_mut(&addr)?;
        v.retain(|(_, since, fresh)| since.elapsed() < *fresh);
        let s = v.pop().map(|(s, ..)| s);
        if v.is_empty() {
            m.remove(&addr);
        }
        s
    }

    /// Keep a connection whose last transfer ended cleanly for the next fetch from `addr`
    /// (`area`: that transfer read an export area the source keeps for the connection, and so
    /// keeps the connection for [`AREA_KEEP`]).
    pub(super) fn put_idle(&self, addr: SocketAddr, s: TcpStream, area: bool) {
        if self.limits.idle_timeout.is_zero() || self.stop.load(Ordering::Acquire) {
            return;
        }
        let fresh = if area { AREA_KEEP.max(self.limits.idle_timeout) } else { self.limits.idle_timeout } / 2;
        let mut m = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let v = m.entry(addr).or_default();
        v.retain(|(_, since, fresh)| since.elapsed() < *fresh);
        if v.len() < MAX_IDLE_PER_SOURCE {
            v.push((s, Instant::now(), fresh));
        }
    }

    /// The deadline of one read or write that starts now.
    pub(super) fn io_deadline(&self) -> Instant {
        Instant::now() + self.limits.io_timeout
    }

    /// Return withheld destination blocks to the runtime, counted.
    pub(super) fn give_back(&self, ids: &[u32]) {
        if ids.is_empty() {
            return;
        }
        // counted first: a runtime that reads the counters once it heard sees them
        Stats::add(&self.stats.blocks_returned, ids.len() as u64);
        self.holder.returned(ids);
    }

    pub(super) fn register(&self, s: &TcpStream) -> Option<u64> {
        let clone = s.try_clone().ok()?;
        let mut g = self.conns.lock().unwrap_or_else(|e| e.into_inner());
        if self.stop.load(Ordering::Acquire) {
            return None;
        }
        g.0 += 1;
        let id = g.0;
        g.1.insert(id, clone);
        Some(id)
    }
    /// At the agent's end (every thread joined, see [`Inner`]'s drop): the writes still withheld
    /// are dropped (NIXL releases their requests), then the backends go (a NIXL agent with its
    /// UCX backend): nothing can write into the withheld blocks any more, and they go back
    /// before the holder does.
    fn tear_down(&mut self) {
        let withheld = std::mem::take(self.withheld.get_mut().unwrap_or_else(|e| e.into_inner()));
        let mut ids = Vec::new();
        for (writes, i) in withheld {
            drop(writes);
            ids.extend(i);
        }
        drop(std::mem::take(&mut self.backends));
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.give_back(&ids)));
    }

    pub(super) fn unregister(&self, id: u64) {
        let mut g = self.conns.lock().unwrap_or_else(|e| e.into_inner());
        g.1.remove(&id);
        if g.1.is_empty() {
            self.conns_idle.notify_all();
        }
    }
}

impl Drop for Inner {
    /// Runs when the last strong reference goes (the agent's drop, after every thread was
    /// joined), whatever fetch handles still hold weak ones, and before any field is dropped:
    /// the holder is still there to take the withheld blocks back.
    fn drop(&mut self) {
        self.tear_down();
    }
}
