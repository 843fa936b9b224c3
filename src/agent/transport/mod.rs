//! The transport seam: how a fetch's bytes move, once the agent's connection carried the
//! handshake and the hello. NIXL's backend interface (`nixlBackendEngine`: prepare, post,
//! check, release) is the model. A [`Backend`] reads the source's answer and *prepares* a
//! [`Transfer`], the handle of one stream's writes into its destination blocks; the fetch
//! (`fetch::drive`, the same loop for every transport) *posts* it, *checks* it until every
//! offered block landed or the fetch stops (deadline, cancel, shutdown: the fetch's, never the
//! backend's), gives its writes the `write_grace` limit to be *quiet* and *releases* it. A
//! handle whose writes are not proven quiet when it goes (an early end, or a panic anywhere in
//! between: the fetch's guard sees it in its `Drop`) becomes [`Writes`] that the agent keeps:
//! every destination block after the verified ones that they may write is withheld from the
//! runtime until they are over. A backend cannot forget to withhold; it can only say whether its
//! writes are over.
//!
//! A backend neither commits nor decides. Above every backend sit one verifier and one
//! committer ([`Landing`]): a block counts only when the checksum summed where its bytes lie
//! equals the one the source recorded when it became reusable, in prefix order, and its
//! checksum is then recorded here so that it travels on with the block. Backends see a narrow
//! context ([`Cx`]: the layout, the movers, the limits, the counters, the checksum table), not
//! the agent.
//!
//! - [`tcp`] (always built): the source gathers each block into a pinned slot and sends it in a
//!   frame on the agent's connection; the destination verifies it in its slot and scatters it.
//!   Every agent serves TCP readers, whatever its own backend.
//! - `nixl` (cargo feature `nixl`): the destination READs the blocks in place over UCX.
//! - [`cuda_ipc`]: two agents of one host with device pools; the destination maps the source's
//!   pool through CUDA IPC and copies the blocks device to device.
//!
//! A new transport is a new file here with an [`open`] arm, not new branches in the fetch or
//! the service: [`open`] is the only place that knows which backends a build has.

pub(super) mod cuda_ipc;
#[cfg(feature = "nixl")]
pub mod nixl;
pub(super) mod tcp;
pub(super) mod vmm_fds;

use std::time::Instant;

use super::estimate::SourceSpeed;
use super::pool::{Mover, Movers};
use super::sums::{Digest, SumTable};
use super::wire::{self, Conn, FrameError, Refusal};
use super::{AgentError, FailReason, Limits, Stats, Transport};
use crate::copy::KvLayout;

/// Why a fetch (or one of its streams) stopped, with the detail for logs.
pub(super) type Failure = (FailReason, String);

pub(super) fn io_fail(e: &std::io::Error, what: &str) -> Failure {
    match e.kind() {
        std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => {
            (FailReason::Timeout, format!("{what} ran past its deadline"))
        }
        _ => (FailReason::Truncated, format!("{what}: the stream ended early ({e})")),
    }
}

pub(super) fn frame_fail(e: FrameError, what: &str) -> Failure {
    match e {
        FrameError::Io(e) => io_fail(&e, what),
        FrameError::Malformed(m) => (FailReason::Corrupt, format!("{what}: {m}")),
    }
}

/// The failure a source's refusal frame (payload `p`) means.
pub(super) fn refusal(p: &[u8]) -> Failure {
    let (code, text) = wire::decode_refusal(p);
    let reason = match code {
        Some(Refusal::FingerprintMismatch) => FailReason::FingerprintMismatch,
        Some(Refusal::AuthFailed) => FailReason::AuthFailed,
        _ => FailReason::Refused,
    };
    let label = code.map_or("unknown", Refusal::as_str);
    (reason, format!("the source refused: {label} ({})", text.escape_debug()))
}

/// Read one control frame of at most `max` bytes into `buf`: its kind, or the source's refusal
/// as the failure.
pub(super) fn read_reply(
    c: &mut dyn Conn,
    buf: &mut Vec<u8>,
    max: usize,
    what: &str,
    deadline: Instant,
) -> Result<u8, Failure> {
    let (kind, len) = wire::read_header(c, max, deadline).map_err(|e| frame_fail(e, what))?;
    buf.resize(len, 0);
    c.read_by(buf, deadline).map_err(|e| io_fail(&e, what))?;
    if kind == wire::REFUSE {
        return Err(refusal(buf));
    }
    Ok(kind)
}

/// What a backend sees of the agent: the pool's layout, the movers, the limits, the counters
/// and the checksum table (not the queue, the connections or the runtime's holder).
pub(super) struct Cx<'a> {
    pub(super) layout: &'a KvLayout,
    /// Bytes of one block (every segment).
    pub(super) block_bytes: usize,
    pub(super) movers: &'a Movers,
    pub(super) limits: &'a Limits,
    pub(super) stats: &'a Stats,
    pub(super) sums: &'a SumTable,
}

impl Cx<'_> {
    /// The deadline of one read or write that starts now.
    pub(super) fn io_deadline(&self) -> Instant {
        Instant::now() + self.limits.io_timeout
    }
}

/// One stream's request, as a backend's [`Backend::prepare`] and its [`Transfer`] get it.
pub(super) struct Pull<'a> {
    /// The names asked for (their hello went out).
    pub(super) asked: &'a [u64],
    /// Where block `i` goes: `dst[i]`.
    pub(super) dst: &'a [u32],
    /// The whole fetch's deadline (for the backend's own reads and waits; the fetch checks it
    /// between [`Transfer::check`]s).
    pub(super) deadline: Instant,
    /// The fetch's stop check (cancel, shutdown, deadline, an earlier part ended short), for a
    /// backend that blocks inside one step.
    pub(super) stopped: &'a (dyn Fn() -> Result<(), Failure> + Sync),
    /// The stream's mover (taken from the agent's when `None`, kept for the stream's next
    /// request; a backend that cannot show its copies finished drops it).
    pub(super) mover: &'a mut Option<Mover>,
    /// Buffers the stream reuses from one request to the next.
    pub(super) scratch: &'a mut Scratch,
}

/// How a [`Transfer::check`] left the transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Progress {
    /// Writes are still under way: check again (the fetch checks its stop first). Only an
    /// asynchronous backend (NIXL) answers it.
    #[cfg_attr(not(feature = "nixl"), allow(dead_code))]
    Pending,
    /// Every offered block was looked at (verified ones counted in the landing). `reusable`:
    /// the connection is at a frame boundary and can carry the stream's next request.
    Done {
        /// The connection can carry the next request.
        reusable: bool,
    },
}

/// One stream's transfer: the handle of the writes a backend makes into the stream's
/// destination blocks `dst[..count()]`, in NIXL's shape. `fetch::drive` calls, in order,
/// [`post`](Transfer::post) once, [`check`](Transfer::check) until done or the fetch stops,
/// [`quiet`](Transfer::quiet) with the write grace, and [`release`](Transfer::release) once;
/// a handle dropped or released while not proven quiet goes on as [`Writes`]
/// ([`Transfer::into_writes`]).
pub(super) trait Transfer: Send {
    /// Destination blocks the transfer may write once posted: `dst[..count]` of its stream.
    fn count(&self) -> usize;

    /// Take only the first `n` offered blocks (`n < count()`): called before
    /// [`post`](Transfer::post), when the runtime made only that many destination blocks ready
    /// ([`crate::agent::OnOffer`]). An in-place source is told how many were taken at release,
    /// as after any transfer; a streaming one's connection is not reused (the rest of its
    /// frames are never read).
    fn limit(&mut self, n: usize);

    /// Start the writes (NIXL: post every READ; a synchronous backend may do all its work in
    /// the first check instead).
    fn post(&mut self, cx: &Cx<'_>, c: &mut dyn Conn, job: &mut Pull<'_>) -> Result<(), Failure>;

    /// Move on: verify and count (through `land`) what has landed, in order. Never waits past
    /// the fetch's deadline; may return [`Progress::Pending`] at once.
    fn check(
        &mut self,
        cx: &Cx<'_>,
        c: &mut dyn Conn,
        job: &mut Pull<'_>,
        land: &mut Landing<'_>,
    ) -> Result<Progress, Failure>;

    /// Whether every write into the destination blocks is over (finished or failed), waiting
    /// until `until` at most. `true` is a promise: nothing of this transfer writes any more.
    fn quiet(&mut self, until: Instant) -> bool;

    /// The transfer ended with `landed` leading blocks verified (`failed`: with a failure, and
    /// which): tell the source (an in-place source unpins on `DONE`) and let go of what a
    /// failure may have made stale. `quiet`: whether [`Transfer::quiet`] proved the writes over.
    fn release(&mut self, cx: &Cx<'_>, c: &mut dyn Conn, landed: usize, failed: Option<FailReason>, quiet: bool);

    /// The writes that may still run, kept by the agent (with the blocks they may write) until
    /// [`Writes::over`]; `None` when nothing of the transfer can write once the stream's mover
    /// is gone (a synchronous backend: the fetch drops or finishes the mover before it
    /// completes). Called without any other call on the handle while a panic unwinds: it must
    /// only move what it owns.
    fn into_writes(self: Box<Self>) -> Option<Box<dyn Writes>>;
}

/// Writes into destination blocks that were not proven over when their transfer ended. The
/// agent keeps them (and the blocks they may write, withheld) and asks every 50 ms; dropping
/// them (at the agent's shutdown, before its backends go) stops whatever still runs.
pub(super) trait Writes: Send {
    /// Whether every write is over (finished or failed). Never blocks.
    fn over(&mut self) -> bool;
}

/// Writes of a fetch's streams not proven over when their transfers went, each with the index
/// one past the last block of the fetch's destination blocks it may write (see
/// `Inner::withhold`).
pub(super) type Unquiet = std::sync::Mutex<Vec<(Box<dyn Writes>, usize)>>;

/// What a stream keeps between requests so that a fetch allocates no buffers of its own once
/// the stream has served one of its size: the control buffer, and the copy plan and sums of
/// an in-place backend.
#[derive(Default)]
pub(super) struct Scratch {
    /// Control frames.
    pub(super) buf: Vec<u8>,
    /// The source's segments as mapped here (CUDA IPC).
    pub(super) segs: Vec<(u64, u64)>,
    /// Copy runs `(to, from, bytes)` (CUDA IPC, when the kernel cannot take the segments).
    pub(super) runs: Vec<(u64, u64, u64)>,
    /// Per-block sums of what landed.
    pub(super) sums: Vec<u64>,
    /// Per-block NH sums of what landed (a keyed agent's device pool: its tags, unfinished).
    pub(super) nh: Vec<crate::block_mac::NhSums>,
    /// Source block ids.
    pub(super) ids: Vec<u32>,
}

/// Where one stream's blocks landed: the one verifier and committer above every backend.
pub(super) struct Landing<'a> {
    sums: &'a SumTable,
    dst: &'a [u32],
    /// The content digests the fetch asked for, one per block of the stream (`dst`'s order);
    /// empty: the runtime gave none and digests are not checked.
    pub(super) want: &'a [Digest],
    /// An in-place offer was cut before a block whose digest differs from the one asked for:
    /// the stream ends with this failure once the blocks before it landed.
    pub(super) cut: Option<Failure>,
    /// Leading blocks written and verified.
    pub(super) blocks: usize,
    /// When the first of them was.
    pub(super) first: Option<Instant>,
    /// The source answered the hello (an offer came): a kept-alive connection was not stale.
    pub(super) offered: bool,
    /// The source cannot be reached with this backend (it does not serve it, it runs on
    /// another host, its memory cannot be mapped or registered here), set with the failure
    /// before any block moved: the fetch may be made again over TCP.
    pub(super) unusable: bool,
}

impl<'a> Landing<'a> {
    pub(super) fn new(sums: &'a SumTable, dst: &'a [u32], want: &'a [Digest]) -> Landing<'a> {
        debug_assert!(want.is_empty() || want.len() == dst.len());
        Landing { sums, dst, want, cut: None, blocks: 0, first: None, offered: false, unusable: false }
    }

    /// The content rule, checked before a byte of block `i` reaches the pool: the digest the
    /// source recorded for it (`got`) must be the one the runtime computed from its own tokens
    /// (`want[i]`, when it gave digests). A block whose name is right and whose content is
    /// another (a crafted or accidental name collision, a source that never recorded a digest)
    /// ends the fetch before it.
    pub(super) fn check_digest(want: &[Digest], i: usize, got: &Digest) -> Result<(), Failure> {
        match want.get(i) {
            Some(w) if w != got => Err((
                FailReason::DigestMismatch,
                format!(
                    "block {i}: the source's block under this name holds other tokens (its content digest differs)"
                ),
            )),
            _ => Ok(()),
        }
    }

    /// The one verification rule: block `i`, summed where its bytes lie to `got`, against the
    /// checksum `want` the source recorded when the block became reusable.
    pub(super) fn check(i: usize, got: u64, want: u64) -> Result<(), Failure> {
        if got == want {
            Ok(())
        } else {
            Err((FailReason::Corrupt, format!("block {i}: checksum mismatch")))
        }
    }

    /// The keyed check: block `i`'s bytes, tagged here to `got`, against the tag `want` its
    /// source sent (a tagged offer). A mismatch is a block whose bytes changed after the source
    /// tagged it (in its memory or on the way), even where the checksum still matched.
    pub(super) fn check_tag(i: usize, got: u64, want: u64) -> Result<(), Failure> {
        if got == want {
            Ok(())
        } else {
            Err((
                FailReason::Corrupt,
                format!("block {i}: keyed tag mismatch (its bytes are not the ones its source tagged)"),
            ))
        }
    }

    /// Block `i` (landed just now) has tag `tag` (checked, or taken here): record it after its
    /// checksum (nothing where this agent keeps no tags).
    pub(super) fn tagged(&mut self, i: usize, tag: u64) {
        self.sums.set_tag(self.dst[i], tag);
    }

    /// Block `i` (the next in order) is in `dst[i]` and verified with checksum `sum`: record the
    /// checksum and the digest it was checked against (both travel on with the block; no digest
    /// when none was asked for) and count it.
    pub(super) fn landed(&mut self, i: usize, sum: u64) {
        debug_assert_eq!(i, self.blocks, "blocks land in order");
        self.sums.set(self.dst[i], sum);
        self.sums.set_digest(self.dst[i], self.want.get(i).unwrap_or(&[0; super::sums::DIGEST]));
        self.blocks = i + 1;
        self.first.get_or_insert_with(Instant::now);
    }
}

/// What a serving connection keeps between its transfers for the agent's backend (a CUDA IPC
/// export area); given up when the connection ends.
#[derive(Default)]
pub(in crate::agent) struct Lease {
    pub(super) area: Option<cuda_ipc::Area>,
}

/// Where an in-place offer's blocks lie when not in the pool: a CUDA IPC export area's
/// segments (`(base, stride, bytes per block)`) and blocks; the offer then names slots
/// `0..ids.len()` of it.
pub(super) struct InPlaceView<'a> {
    pub(super) segments: &'a [(u64, u64, u64)],
    pub(super) num_blocks: u32,
}

/// Serving side of an in-place transport (NIXL, CUDA IPC): offer the pinned blocks `ids` where
/// they lie (the pool, or the slots of `view` they were copied into), in a frame of `kind`
/// naming `agent` with `metadata` (how the reader reaches that memory), then wait for the
/// reader's `DONE` (or the transfer deadline), which ends the pins. Counts what the reader
/// took; whether the transfer ended cleanly.
#[allow(clippy::too_many_arguments)] // the blocks, the frame, and where the blocks lie
pub(super) fn serve_in_place(
    cx: &Cx<'_>,
    c: &mut dyn Conn,
    ids: &[u32],
    kind: u8,
    agent: &str,
    metadata: &[u8],
    device: Option<i32>,
    view: Option<InPlaceView<'_>>,
) -> bool {
    let layout = &cx.layout;
    let (segments, num_blocks) = match &view {
        Some(v) => (v.segments.to_vec(), v.num_blocks),
        None => (
            layout.segments().iter().map(|s| (s.base, s.block_stride, s.bytes_per_block)).collect(),
            layout.num_blocks(),
        ),
    };
    let offer = wire::InPlaceOffer {
        agent: agent.into(),
        // an offer of no block carries no grant: a hello naming nothing held (or nothing at
        // all) learns no handle, registration or descriptor socket
        metadata: if ids.is_empty() { Vec::new() } else { metadata.to_vec() },
        block_bytes: cx.block_bytes as u64,
        device,
        num_blocks,
        segments,
        blocks: ids
            .iter()
            .enumerate()
            .map(|(slot, &id)| {
                let at = if view.is_some() { slot as u32 } else { id };
                (at, cx.sums.get(id).expect("offered blocks have recorded checksums"), cx.sums.digest(id))
            })
            .collect(),
        // tagged when every offered block has its tag (see `tcp::serve`)
        tags: ids.iter().map(|&id| cx.sums.tag(id)).collect::<Option<Vec<u64>>>().unwrap_or_default(),
    };
    let end = Instant::now() + tcp::transfer_deadline((ids.len() * cx.block_bytes) as u64);
    if wire::write_frame(c, kind, &wire::encode_in_place_offer(&offer), cx.io_deadline()).is_err() {
        Stats::add(&cx.stats.serve_aborted, 1);
        return false;
    }
    // the reader moves the blocks at its own pace; its DONE (or the deadline) ends the pin
    // (a small copy is over within the poll)
    c.poll_readable(cx.limits.poll);
    let mut done = [0u8; 8];
    let got = wire::read_header(c, wire::MAX_CONTROL, end)
        .ok()
        .filter(|&(k, len)| k == wire::DONE && len == 8)
        .and_then(|_| c.read_by(&mut done, end).ok());
    match got {
        Some(()) => {
            let n = u64::from_le_bytes(done).min(ids.len() as u64);
            Stats::add(&cx.stats.blocks_sent, n);
            Stats::add(&cx.stats.bytes_sent, n * cx.block_bytes as u64);
            true
        }
        None => {
            Stats::add(&cx.stats.serve_aborted, 1);
            false
        }
    }
}

/// Fetch side of a transport whose reader moves the bytes itself (NIXL, CUDA IPC): read the
/// source's answer to this transport's hello (a refusal, or an offer in a frame of `kind`
/// from an agent named `agent` when given) into `buf`, mark the landing as offered, and check
/// the offer against this agent's layout and the `asked` count. The caller moves the offered
/// blocks, then ends the source's pins with [`send_done`].
#[allow(clippy::too_many_arguments)] // the connection, the expected offer, the job's bounds
pub(super) fn read_in_place_offer(
    cx: &Cx<'_>,
    c: &mut dyn Conn,
    kind: u8,
    agent: Option<&str>,
    asked: usize,
    deadline: Instant,
    buf: &mut Vec<u8>,
    land: &mut Landing<'_>,
) -> Result<wire::InPlaceOffer, Failure> {
    let by = || cx.io_deadline().min(deadline);
    let max = wire::max_in_place_offer(asked, cx.layout.segments().len());
    let (got, len) = wire::read_header(c, max, by()).map_err(|e| frame_fail(e, "the offer"))?;
    buf.resize(len, 0);
    c.read_by(buf, by()).map_err(|e| io_fail(&e, "the offer"))?;
    if got == wire::REFUSE {
        land.unusable = wire::decode_refusal(buf).0 == Some(Refusal::Unsupported);
        return Err(refusal(buf));
    }
    land.offered = true;
    let offer = match (got == kind, wire::decode_in_place_offer(buf)) {
        (true, Some(o)) if agent.is_none_or(|a| o.agent == a) => o,
        _ => return Err((FailReason::Corrupt, "expected an in-place offer of this transport".into())),
    };
    let mut offer = offer;
    if !offer.tags.is_empty() && cx.sums.mac().is_none() {
        // an agent without a key talks only to sources without one, which do not tag
        return Err((FailReason::Corrupt, "a tagged offer to an agent that holds no key".into()));
    }
    offer.check(cx.layout, asked).map_err(|(mismatch, text)| {
        (if mismatch { FailReason::FingerprintMismatch } else { FailReason::Corrupt }, text.to_string())
    })?;
    // blocks from the first whose content is not the one asked for are not taken
    let cut = offer
        .blocks
        .iter()
        .enumerate()
        .find_map(|(i, b)| Landing::check_digest(land.want, i, &b.2).err().map(|e| (i, e)));
    if let Some((i, e)) = cut {
        if i == 0 {
            send_done(cx, c, 0);
            return Err(e);
        }
        offer.blocks.truncate(i);
        offer.tags.truncate(i);
        land.cut = Some(e);
    }
    Ok(offer)
}

/// Tell the source of an in-place offer that `n` leading blocks arrived and its pins can end
/// (best effort: a source that does not hear it ends them at its deadline).
pub(super) fn send_done(cx: &Cx<'_>, c: &mut dyn Conn, n: usize) {
    let _ = wire::write_frame(c, wire::DONE, &(n as u64).to_le_bytes(), cx.io_deadline());
}

/// One way of moving a fetch's bytes. Implementations are thread-safe: every fetch worker and
/// serving connection uses the agent's one backend.
pub(super) trait Backend: Send + Sync {
    /// The frame kind of this backend's hello (what its fetches send, and what it serves
    /// besides the TCP `HELLO` every agent serves).
    fn hello(&self) -> u8;

    /// Connections a fetch of `blocks` blocks spreads over.
    fn streams(&self, cx: &Cx<'_>, blocks: usize) -> usize;

    /// Movers to make when the agent starts (one per stream a fetch may run at once).
    fn movers_at_start(&self, limits: &Limits) -> usize;

    /// The speed assumed of a source before its first transfer.
    fn default_speed(&self, device_pool: bool) -> SourceSpeed;

    /// Fetch side, after the hello went out on `c`: read the source's answer and prepare the
    /// transfer of the offered blocks of `job.asked` into `job.dst` (nothing is written yet).
    /// An error before any handle exists: nothing was posted; the backend told the source
    /// what it needs to hear (an in-place source's `DONE`).
    fn prepare(
        &self,
        cx: &Cx<'_>,
        c: &mut dyn Conn,
        job: &mut Pull<'_>,
        land: &mut Landing<'_>,
    ) -> Result<Box<dyn Transfer + '_>, Failure>;

    /// Serving side: serve the pinned blocks `ids` (names `names`) to a hello of kind
    /// [`Backend::hello`]. Whether the transfer ended cleanly (the connection can carry the
    /// peer's next request).
    fn serve(&self, cx: &Cx<'_>, c: &mut dyn Conn, ids: &[u32], names: &[u64], lease: &mut Lease) -> bool;

    /// Whether the backend has something to look at again (the mappings of peers that may
    /// have gone): an idle fetch worker then calls
    /// [`Backend::reap`] every 50 ms.
    fn wants_reap(&self) -> bool {
        false
    }

    /// Let go of what gone peers left.
    fn reap(&self, cx: &Cx<'_>) {
        let _ = cx;
    }
}

/// The backends of `transport` over `layout` (memory of `device`, host memory when `None`), in
/// order of preference: one, or one per transport of a [`Transport::Prefer`]; never empty.
///
/// # Safety
/// As [`super::Agent::new`]: the layout's blocks are memory of `device`, valid for the agent's
/// whole life.
pub(super) unsafe fn open(
    transport: &Transport,
    layout: &KvLayout,
    device: Option<i32>,
    limits: &Limits,
) -> Result<Vec<Box<dyn Backend>>, AgentError> {
    #[cfg(test)]
    if let Some(b) = TEST_BACKEND.with(|t| t.borrow_mut().take()) {
        return Ok(vec![b]);
    }
    let chain = transport.chain().map_err(AgentError::Config)?;
    let mut out = Vec::with_capacity(chain.len());
    for t in chain {
        // SAFETY: forwarded contract.
        out.push(unsafe { open_one(t, layout, device, limits) }?);
    }
    Ok(out)
}

#[cfg(test)]
thread_local! {
    /// A backend the next agent started on this thread uses instead of its transport's (unit
    /// tests of the fetch's handling of transfers).
    pub(super) static TEST_BACKEND: std::cell::RefCell<Option<Box<dyn Backend>>> = const { std::cell::RefCell::new(None) };
}

/// One backend (not a preference list).
///
/// # Safety
/// As [`open`].
unsafe fn open_one(
    transport: &Transport,
    layout: &KvLayout,
    device: Option<i32>,
    limits: &Limits,
) -> Result<Box<dyn Backend>, AgentError> {
    match transport {
        Transport::Tcp => {
            let _ = (layout, device, limits);
            Ok(Box::new(tcp::Tcp))
        }
        #[cfg(feature = "nixl")]
        Transport::Nixl { lib_dir } => {
            // SAFETY: forwarded contract.
            let nx = unsafe { nixl::Nixl::new(layout, device, lib_dir.as_deref()) }.map_err(AgentError::Io)?;
            Ok(Box::new(nx))
        }
        Transport::CudaIpc => {
            // SAFETY: forwarded contract.
            let t = unsafe { cuda_ipc::CudaIpc::new(layout, device) }.map_err(AgentError::Config)?;
            Ok(Box::new(t))
        }
        #[cfg(not(feature = "nixl"))]
        Transport::Nixl { .. } => {
            Err(AgentError::Config("the NIXL transport needs kvrelay built with the cargo feature `nixl`".into()))
        }
        Transport::Prefer(_) => Err(AgentError::Config("a transport preference inside a preference".into())),
    }
}
