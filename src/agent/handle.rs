//! A fetch as the runtime sees it: the request it submits, the result its completion carries,
//! and the handles ([`Fetch`], [`OwnedFetch`]) it polls, waits on or cancels; the shared state
//! a fetch worker completes.

use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use super::FailReason;

/// One fetch to submit.
#[derive(Clone, Debug)]
pub struct FetchRequest {
    /// The source's KV endpoint, `tcp://host:port`, as an orchestration decision authorized it.
    pub endpoint: String,
    /// The request's own block names, from block 0.
    pub names: Vec<u64>,
    /// How many leading blocks of `names` the runtime holds already (not fetched).
    pub held: usize,
    /// Free blocks of the pool reserved for the fetch: block `held + i` goes into `dst[i]`; as
    /// many are asked for as there are destination blocks (at most `names.len() - held`).
    pub dst: Vec<u32>,
    /// The whole fetch's deadline, from submission.
    pub deadline: Duration,
    /// The content digest of every named block (`digests[i]` for `names[i]`, from
    /// [`crate::names::Naming::digests_into`] over the runtime's own tokens), or empty: not
    /// checked. A block whose source recorded another digest (or none) is not written, and the
    /// fetch ends there as [`FailReason::DigestMismatch`](super::FailReason::DigestMismatch);
    /// a verified block's digest is recorded with it, so it is served on with its digest.
    pub digests: Vec<[u8; crate::names::BLOCK_DIGEST_BYTES]>,
}

/// How a fetch ended.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FetchResult {
    /// `None`: every block the source offered arrived (it may have offered fewer than asked:
    /// its leading run); otherwise why the fetch stopped.
    pub failure: Option<FailReason>,
    /// Leading destination blocks written and verified (commit exactly these, in order).
    pub blocks: usize,
    /// Their bytes.
    pub bytes: u64,
    /// Destination blocks after the verified ones that the agent still holds (NIXL only: a
    /// READ into them could not be proven stopped): `dst[blocks..blocks + withheld]` must not
    /// be reused until [`BlockHolder::returned`](super::BlockHolder::returned) hands them back. 0 over TCP.
    pub withheld: usize,
    /// Seconds from submission to completion.
    pub seconds: f64,
    /// Why, in words, for logs (never hint bytes, never the key).
    pub detail: String,
}

/// A fetch's completion callback: runs once, on the fetch worker, when the fetch completes.
pub type OnDone = Box<dyn FnOnce(&FetchResult) + Send>;

/// A fetch's room callback (lazy eviction): `ready(from, n)` runs on a fetch thread once per
/// stream, after the source's offer said the stream will get `n` blocks and before any of them
/// is written: the runtime makes destination blocks `dst[from..from + n]` ready to be written
/// (evicting what they hold only now, once the source is known to have the blocks) and answers
/// how many of them, from the first, it made ready (at most `n`). The stream then takes only
/// those. Several streams of one fetch may call it at once, in any order. It must not unwind
/// and must not call back into the agent.
pub type OnOffer = Box<dyn Fn(usize, usize) -> usize + Send + Sync>;

pub(super) struct FetchState {
    pub(super) result: Mutex<Option<FetchResult>>,
    /// While the completion callback runs: its thread and the result it delivers. On that
    /// thread the fetch is complete already (poll and wait return this result), so a callback
    /// that polls, waits for or drops an owner of its own fetch returns instead of waiting for
    /// itself.
    completing: Mutex<Option<(std::thread::ThreadId, FetchResult)>>,
    pub(super) done: Condvar,
    pub(super) cancel: AtomicBool,
    pub(super) on_done: Mutex<Option<OnDone>>,
    /// The room callback ([`OnOffer`]): `None`, every destination block is ready at submission.
    pub(super) on_offer: Option<OnOffer>,
    pub(super) submitted: Instant,
    /// The connections this fetch's streams use right now, each with its part and its
    /// registration id: `cancel` shuts them down so that blocked reads return, and a part that
    /// ends short shuts down the parts after it. A stream removes its entry before its
    /// connection goes to the idle pool (which then owns it alone) or closes, so a cancel never
    /// reaches a connection another fetch took from the pool.
    pub(super) sock: Mutex<Vec<(usize, u64, TcpStream)>>,
    /// Parts after this one are of no use (an earlier part ended short): they stop.
    pub(super) stop_after: AtomicUsize,
    /// The agent whose queue holds the fetch until a worker takes it (a cancel takes it out).
    pub(super) agent: Weak<super::Inner>,
    /// Writes of its streams' transfers not proven over (a transfer's guard puts them here,
    /// even while a panic unwinds); the worker withholds their blocks before completing.
    pub(super) unquiet: super::transport::Unquiet,
}

impl FetchState {
    pub(super) fn new(on_done: Option<OnDone>, on_offer: Option<OnOffer>, agent: Weak<super::Inner>) -> FetchState {
        FetchState {
            agent,
            result: Mutex::new(None),
            completing: Mutex::new(None),
            done: Condvar::new(),
            cancel: AtomicBool::new(false),
            on_done: Mutex::new(on_done),
            on_offer,
            submitted: Instant::now(),
            sock: Mutex::new(Vec::new()),
            stop_after: AtomicUsize::new(usize::MAX),
            unquiet: Mutex::new(Vec::new()),
        }
    }

    /// The callback first, then the result for pollers: once a poll sees the result, the
    /// callback no longer uses what it captured. A callback that panics is contained here (the
    /// result is published all the same and the worker goes on).
    pub(super) fn complete(&self, r: FetchResult) {
        let cb = self.on_done.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(cb) = cb {
            *self.completing.lock().unwrap_or_else(|e| e.into_inner()) = Some((std::thread::current().id(), r.clone()));
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| cb(&r)));
            *self.completing.lock().unwrap_or_else(|e| e.into_inner()) = None;
        }
        *self.result.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
        self.done.notify_all();
    }

    /// The result being delivered, when called from this fetch's own completion callback.
    fn completing_here(&self) -> Option<FetchResult> {
        let g = self.completing.lock().unwrap_or_else(|e| e.into_inner());
        g.as_ref().filter(|(t, _)| *t == std::thread::current().id()).map(|(_, r)| r.clone())
    }

    /// Publish part `part`'s connection `s` (registration `id`) for cancels and sibling stops.
    pub(super) fn publish(&self, part: usize, id: u64, s: &TcpStream) {
        if let Ok(clone) = s.try_clone() {
            self.sock.lock().unwrap_or_else(|e| e.into_inner()).push((part, id, clone));
        }
    }

    /// Forget the connection registered as `id` (its clone closes here).
    pub(super) fn unpublish(&self, id: u64) {
        self.sock.lock().unwrap_or_else(|e| e.into_inner()).retain(|(_, i, _)| *i != id);
    }

    /// Part `part` ended short: the parts after it stop (their connections are shut down).
    pub(super) fn stop_parts_after(&self, part: usize) {
        self.stop_after.fetch_min(part, Ordering::AcqRel);
        for (p, _, s) in self.sock.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            if *p > part {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
        }
    }
}

/// A submitted fetch: poll it, wait for it, or cancel it. Dropping the handle neither cancels
/// the fetch nor loses its completion callback (the C handle shares this behaviour); an owner
/// whose going away must stop the fetch holds it as an [`OwnedFetch`] ([`Fetch::owned`]).
#[derive(Clone)]
pub struct Fetch(pub(super) Arc<FetchState>);

impl Fetch {
    /// The result, once the fetch completed (from the fetch's own completion callback: the
    /// result it delivers).
    pub fn poll(&self) -> Option<FetchResult> {
        let r = self.0.result.lock().unwrap_or_else(|e| e.into_inner()).clone();
        r.or_else(|| self.0.completing_here())
    }

    /// Wait up to `timeout` for the result (from the fetch's own completion callback: the
    /// result it delivers, at once).
    pub fn wait(&self, timeout: Duration) -> Option<FetchResult> {
        if let Some(r) = self.0.completing_here() {
            return Some(r);
        }
        let end = Instant::now() + timeout;
        let mut g = self.0.result.lock().unwrap_or_else(|e| e.into_inner());
        while g.is_none() {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            g = self.0.done.wait_timeout(g, left).unwrap_or_else(|e| e.into_inner()).0;
        }
        g.clone()
    }

    /// Ask the fetch to stop: it completes with [`FailReason::Cancelled`] after the block in
    /// progress (blocks verified before stay reported), or normally if it was about to. A
    /// fetch still waiting in the queue is taken out and completes at once, on an agent
    /// thread, not when a worker reaches it behind fetches that run to their deadlines.
    pub fn cancel(&self) {
        self.0.cancel.store(true, Ordering::Release);
        for (_, _, s) in self.0.sock.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        if let Some(inner) = self.0.agent.upgrade() {
            super::Inner::cancel_queued(&inner, &self.0);
        }
    }
}

/// A fetch that owns its destination blocks the way a runtime's request does: dropping it
/// cancels the fetch (if it still runs) and waits for its completion, so that when the drop
/// returns nothing writes the destination blocks any more and the runtime may reuse them (but
/// for NIXL's withheld ones, which come back through [`BlockHolder::returned`](super::BlockHolder::returned)). The wait is
/// bounded by the block in progress and `io_timeout`; do not drop a running one on a thread
/// that must not block. [`OwnedFetch::detach`] lets the fetch run on without it.
pub struct OwnedFetch(Option<Fetch>);

impl OwnedFetch {
    /// The fetch (poll, wait, cancel).
    pub fn fetch(&self) -> &Fetch {
        self.0.as_ref().expect("present until dropped or detached")
    }

    /// Let the fetch run on unowned (its completion callback, if any, still runs).
    pub fn detach(mut self) -> Fetch {
        self.0.take().expect("present until dropped or detached")
    }
}

impl Drop for OwnedFetch {
    fn drop(&mut self) {
        let Some(f) = self.0.take() else { return };
        if f.poll().is_some() {
            return;
        }
        f.cancel();
        while f.wait(Duration::from_secs(1)).is_none() {}
    }
}

impl Fetch {
    /// This handle as the owner of its destination blocks ([`OwnedFetch`]: dropping it cancels
    /// and waits).
    pub fn owned(self) -> OwnedFetch {
        OwnedFetch(Some(self))
    }
}

pub(super) struct Job {
    pub(super) req: FetchRequest,
    pub(super) state: Arc<FetchState>,
}
