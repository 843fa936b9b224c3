//! The transport seam: how a fetch's bytes move, once the agent's connection carried the
//! handshake and the hello. NIXL's backend interface (`nixlBackendEngine`: prepare, post,
//! check, release, estimate) is the model: a [`Backend`] moves the offered blocks into the
//! destination blocks it was given and reports where they landed; it neither commits nor
//! decides. Above every backend sit one verifier and one committer ([`Landing`]): a block
//! counts only when the checksum summed where its bytes lie equals the one the source recorded
//! when it became reusable, in prefix order, and its checksum is then recorded here so that it
//! travels on with the block.
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
use super::pool::Mover;
use super::wire::{self, Conn, FrameError, Refusal};
use super::{AgentError, FailReason, Inner, Limits, Stats, Transport};
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

/// One stream's request, as a backend's [`Backend::pull`] gets it.
pub(super) struct Pull<'a> {
    /// The names asked for (their hello went out).
    pub(super) asked: &'a [u64],
    /// Where block `i` goes: `dst[i]`.
    pub(super) dst: &'a [u32],
    /// The whole fetch's deadline.
    pub(super) deadline: Instant,
    /// The fetch's stop check (cancel, shutdown, deadline, an earlier part ended short).
    pub(super) stopped: &'a (dyn Fn() -> Result<(), Failure> + Sync),
    /// The stream's mover (taken from the agent's when `None`, kept for the stream's next
    /// request; a backend that cannot show its copies finished drops it).
    pub(super) mover: &'a mut Option<Mover>,
    /// Buffers the stream reuses from one request to the next.
    pub(super) scratch: &'a mut Scratch,
}

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
    /// Source block ids.
    pub(super) ids: Vec<u32>,
}

/// Where one stream's blocks landed: the one verifier and committer above every backend.
pub(super) struct Landing<'a> {
    inner: &'a Inner,
    dst: &'a [u32],
    /// Leading blocks written and verified.
    pub(super) blocks: usize,
    /// When the first of them was.
    pub(super) first: Option<Instant>,
    /// Destination blocks after the verified ones the backend could not prove unwritten
    /// (handed back later through `BlockHolder::returned`).
    pub(super) withheld: usize,
    /// The source answered the hello (an offer came): a kept-alive connection was not stale.
    pub(super) offered: bool,
    /// The source cannot be reached with this backend (it does not serve it, it runs on
    /// another host, its memory cannot be mapped or registered here), set with the failure
    /// before any block moved: the fetch may be made again over TCP.
    pub(super) unusable: bool,
}

impl<'a> Landing<'a> {
    pub(super) fn new(inner: &'a Inner, dst: &'a [u32]) -> Landing<'a> {
        Landing { inner, dst, blocks: 0, first: None, withheld: 0, offered: false, unusable: false }
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

    /// Block `i` (the next in order) is in `dst[i]` and verified with checksum `sum`: record the
    /// checksum (it travels on with the block) and count it.
    pub(super) fn landed(&mut self, i: usize, sum: u64) {
        debug_assert_eq!(i, self.blocks, "blocks land in order");
        self.inner.sums.set(self.dst[i], sum);
        self.blocks = i + 1;
        self.first.get_or_insert_with(Instant::now);
    }
}

/// Serving side of an in-place transport (NIXL, CUDA IPC): offer the pinned blocks `ids` where
/// they lie, in a frame of `kind` naming `agent` with `metadata` (how the reader reaches the
/// pool), then wait for the reader's `DONE` (or the transfer deadline), which ends the pins.
/// Counts what the reader took; whether the transfer ended cleanly.
pub(super) fn serve_in_place(
    inner: &Inner,
    c: &mut dyn Conn,
    ids: &[u32],
    kind: u8,
    agent: &str,
    metadata: &[u8],
    device: Option<i32>,
) -> bool {
    let layout = &inner.layout;
    let offer = wire::InPlaceOffer {
        agent: agent.into(),
        metadata: metadata.to_vec(),
        block_bytes: inner.block_bytes as u64,
        device,
        num_blocks: layout.num_blocks(),
        segments: layout.segments().iter().map(|s| (s.base, s.block_stride, s.bytes_per_block)).collect(),
        blocks: ids
            .iter()
            .map(|&id| (id, inner.sums.get(id).expect("offered blocks have recorded checksums")))
            .collect(),
    };
    let end = Instant::now() + tcp::transfer_deadline((ids.len() * inner.block_bytes) as u64);
    if wire::write_frame(c, kind, &wire::encode_in_place_offer(&offer), inner.io_deadline()).is_err() {
        Stats::add(&inner.stats.serve_aborted, 1);
        return false;
    }
    // the reader moves the blocks at its own pace; its DONE (or the deadline) ends the pin
    // (a small copy is over within the poll)
    c.poll_readable(inner.limits.poll);
    let mut done = [0u8; 8];
    let got = wire::read_header(c, wire::MAX_CONTROL, end)
        .ok()
        .filter(|&(k, len)| k == wire::DONE && len == 8)
        .and_then(|_| c.read_by(&mut done, end).ok());
    match got {
        Some(()) => {
            let n = u64::from_le_bytes(done).min(ids.len() as u64);
            Stats::add(&inner.stats.blocks_sent, n);
            Stats::add(&inner.stats.bytes_sent, n * inner.block_bytes as u64);
            true
        }
        None => {
            Stats::add(&inner.stats.serve_aborted, 1);
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
    inner: &Inner,
    c: &mut dyn Conn,
    kind: u8,
    agent: Option<&str>,
    asked: usize,
    deadline: Instant,
    buf: &mut Vec<u8>,
    land: &mut Landing<'_>,
) -> Result<wire::InPlaceOffer, Failure> {
    let by = || inner.io_deadline().min(deadline);
    let max = wire::max_in_place_offer(asked, inner.layout.segments().len());
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
    offer.check(&inner.layout, asked).map_err(|(mismatch, text)| {
        (if mismatch { FailReason::FingerprintMismatch } else { FailReason::Corrupt }, text.to_string())
    })?;
    Ok(offer)
}

/// Tell the source of an in-place offer that `n` leading blocks arrived and its pins can end
/// (best effort: a source that does not hear it ends them at its deadline).
pub(super) fn send_done(inner: &Inner, c: &mut dyn Conn, n: usize) {
    let _ = wire::write_frame(c, wire::DONE, &(n as u64).to_le_bytes(), inner.io_deadline());
}

/// One way of moving a fetch's bytes. Implementations are thread-safe: every fetch worker and
/// serving connection uses the agent's one backend.
pub(super) trait Backend: Send + Sync {
    /// The frame kind of this backend's hello (what its fetches send, and what it serves
    /// besides the TCP `HELLO` every agent serves).
    fn hello(&self) -> u8;

    /// Connections a fetch of `blocks` blocks spreads over.
    fn streams(&self, inner: &Inner, blocks: usize) -> usize;

    /// Movers to make when the agent starts (one per stream a fetch may run at once).
    fn movers_at_start(&self, limits: &Limits) -> usize;

    /// The speed assumed of a source before its first transfer.
    fn default_speed(&self, device_pool: bool) -> SourceSpeed;

    /// Fetch side, after the hello went out on `c`: read the source's answer, move the offered
    /// blocks of `job.asked` into `job.dst`, and let `land` verify and count each in order.
    /// `Ok(true)`: every offered block arrived and `c` can carry the stream's next request.
    /// When this returns, nothing of the backend writes into a destination block any more,
    /// except the `land.withheld` blocks after the verified ones.
    fn pull(
        &self,
        inner: &Inner,
        c: &mut dyn Conn,
        job: &mut Pull<'_>,
        land: &mut Landing<'_>,
    ) -> Result<bool, Failure>;

    /// Serving side: serve the pinned blocks `ids` (names `names`) to a hello of kind
    /// [`Backend::hello`]. Whether the transfer ended cleanly (the connection can carry the
    /// peer's next request).
    fn serve(&self, inner: &Inner, c: &mut dyn Conn, ids: &[u32], names: &[u64]) -> bool;

    /// Whether the backend has something to look at again (destination blocks withheld, the
    /// mappings of peers that may have gone): an idle fetch worker then calls
    /// [`Backend::reap`] every 50 ms.
    fn wants_reap(&self) -> bool {
        false
    }

    /// Hand back withheld blocks whose writes are over; let go of what gone peers left.
    fn reap(&self, inner: &Inner) {
        let _ = inner;
    }

    /// The agent stops (every thread joined): release the backend and return the blocks still
    /// withheld (nothing can write them once the backend is gone).
    fn teardown(self: Box<Self>) -> Vec<u32> {
        Vec::new()
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
) -> Result<Vec<Box<dyn Backend>>, AgentError> {
    let chain = transport.chain().map_err(AgentError::Config)?;
    let mut out = Vec::with_capacity(chain.len());
    for t in chain {
        // SAFETY: forwarded contract.
        out.push(unsafe { open_one(t, layout, device) }?);
    }
    Ok(out)
}

/// One backend (not a preference list).
///
/// # Safety
/// As [`open`].
unsafe fn open_one(
    transport: &Transport,
    layout: &KvLayout,
    device: Option<i32>,
) -> Result<Box<dyn Backend>, AgentError> {
    match transport {
        Transport::Tcp => {
            let _ = (layout, device);
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
