//! The embedded transport: block bytes travel in frames on the agent's own TCP connection.
//! The source gathers the pinned blocks into a mover's slots and sends each with its name,
//! recorded checksum, recorded keyed tag (a keyed source with a host pool: the offer says
//! [`wire::TAGGED`]) and recorded content digest; the destination checks the digest against the
//! one it asked for, reads the block into a slot, verifies it there (the checksum, and the tag
//! when the offer is tagged: a keyed destination refuses a block whose bytes are not the ones
//! the source tagged, whatever its checksum says) and only then scatters it into its
//! destination block, pipelined over the mover's two slots at both ends. A destination that
//! tags its own blocks records the tag it checked, or computes one from the slot when the
//! source sent none.

use std::sync::mpsc;
use std::time::Instant;

use super::{
    frame_fail, io_fail, read_reply, refusal, Backend, Cx, Failure, Landing, Progress, Pull, Transfer, Writes,
};
use crate::agent::estimate::{SourceSpeed, TCP_DEFAULT};
use crate::agent::pool::{Mover, SlotPtr};
use crate::agent::wire::{self, Conn};
use crate::agent::{FailReason, Limits, Stats};
use crate::checksum::kv_checksum;

/// The TCP backend (it has no state of its own: the movers are the agent's).
pub(in crate::agent) struct Tcp;

/// A TCP transfer: the offered blocks arrive in frames, read, verified and scattered by one
/// [`Transfer::check`] (pipelined inside it); every scatter has finished (or its mover was
/// dropped, which waits) when the check returns, so its writes are always quiet.
struct Frames {
    count: usize,
    /// The offer is tagged ([`wire::TAGGED`]).
    tagged: bool,
    /// Fewer blocks are read than the source sends ([`Transfer::limit`]): the connection ends
    /// inside the stream, never reused.
    cut: bool,
}

impl Transfer for Frames {
    fn count(&self) -> usize {
        self.count
    }

    fn limit(&mut self, n: usize) {
        self.count = n.min(self.count);
        self.cut = true;
    }

    fn post(&mut self, _cx: &Cx<'_>, _c: &mut dyn Conn, _job: &mut Pull<'_>) -> Result<(), Failure> {
        Ok(())
    }

    fn check(
        &mut self,
        cx: &Cx<'_>,
        c: &mut dyn Conn,
        job: &mut Pull<'_>,
        land: &mut Landing<'_>,
    ) -> Result<Progress, Failure> {
        let Some(mover) = job.mover.as_mut() else {
            return Err((FailReason::Internal, "a TCP transfer without its mover".into()));
        };
        let deadline = job.deadline;
        let by = || cx.io_deadline().min(deadline);
        let r = receive(cx, c, job.dst, job.asked, self.count, self.tagged, mover, job.stopped, &by, land);
        // every scatter into the destination blocks has finished before the completion is
        // delivered; a mover whose stream cannot be waited for is dropped, never reused
        if let Err(e) = mover.finish() {
            *job.mover = None;
            // nothing can be shown to have landed: commit none of it
            land.blocks = 0;
            return Err((FailReason::Corrupt, format!("waiting for the copies into the pool: {e}")));
        }
        // every offered block was read: the stream is at a frame boundary again
        r.map(|()| Progress::Done { reusable: !self.cut && land.blocks == self.count })
    }

    fn quiet(&mut self, _until: Instant) -> bool {
        true
    }

    fn release(&mut self, _cx: &Cx<'_>, _c: &mut dyn Conn, _landed: usize, _failed: Option<FailReason>, _quiet: bool) {}

    /// Its writes are the mover's copies, finished or waited for by the mover's drop.
    fn into_writes(self: Box<Self>) -> Option<Box<dyn Writes>> {
        None
    }
}

impl Backend for Tcp {
    fn hello(&self) -> u8 {
        wire::HELLO
    }

    /// `Limits::streams`, but each stream moves at least `Limits::min_stream_bytes` (small
    /// fetches use one).
    fn streams(&self, cx: &Cx<'_>, blocks: usize) -> usize {
        let bytes = (blocks as u64).saturating_mul(cx.block_bytes as u64);
        let by_size = usize::try_from(bytes / cx.limits.min_stream_bytes).unwrap_or(usize::MAX).max(1);
        (cx.limits.streams as usize).min(by_size).min(blocks).max(1)
    }

    fn movers_at_start(&self, limits: &Limits) -> usize {
        limits.streams.max(1) as usize
    }

    fn default_speed(&self, _device_pool: bool) -> SourceSpeed {
        TCP_DEFAULT
    }

    fn prepare(
        &self,
        cx: &Cx<'_>,
        c: &mut dyn Conn,
        job: &mut Pull<'_>,
        land: &mut Landing<'_>,
    ) -> Result<Box<dyn Transfer + '_>, Failure> {
        let by = cx.io_deadline().min(job.deadline);
        let kind = read_reply(c, &mut job.scratch.buf, wire::MAX_CONTROL, "the offer", by)?;
        land.offered = true;
        let bb = cx.block_bytes;
        let (count, flags, offered_bb) = match (kind, wire::decode_offer(&job.scratch.buf)) {
            (wire::OFFER, Some(o)) => o,
            _ => return Err((FailReason::Corrupt, "expected an offer".into())),
        };
        let tagged = flags & wire::TAGGED != 0;
        if tagged && cx.sums.mac().is_none() {
            // an agent without a key talks only to sources without one, which do not tag
            return Err((FailReason::Corrupt, "a tagged offer to an agent that holds no key".into()));
        }
        let count = count as usize;
        if count > job.asked.len() || offered_bb != bb as u64 {
            return Err((FailReason::Corrupt, "the offer does not match the request".into()));
        }
        if count == 0 {
            return Err((FailReason::SourceMiss, "the source holds none of the blocks".into()));
        }
        if job.mover.is_none() {
            // SAFETY: the layout's blocks are memory valid for the agent's life (`Agent::new`'s
            // contract); the mover writes only this fetch's destination blocks, which the
            // runtime leaves alone until the fetch completes.
            *job.mover = Some(unsafe { cx.movers.take(cx.layout) }.map_err(|e| (FailReason::Corrupt, e))?);
        }
        Ok(Box::new(Frames { count, tagged, cut: false }))
    }

    fn serve(&self, cx: &Cx<'_>, c: &mut dyn Conn, ids: &[u32], names: &[u64], _lease: &mut super::Lease) -> bool {
        serve(cx, c, ids, names)
    }
}

/// Read the offered blocks, pipelined over the mover's two slots: this thread reads block `i`
/// into a free slot while a helper thread verifies block `i - 1` in the other and scatters it
/// into `dst[i - 1]`; a slot goes back to the reader only after its block was written. The
/// verified count grows in order; the earliest failure in block order is the answer.
#[allow(clippy::too_many_arguments)]
fn receive(
    cx: &Cx<'_>,
    c: &mut dyn Conn,
    dst: &[u32],
    asked: &[u64],
    count: usize,
    tagged: bool,
    mover: &mut Mover,
    stopped: &(dyn Fn() -> Result<(), Failure> + Sync),
    by: &dyn Fn() -> Instant,
    land: &mut Landing<'_>,
) -> Result<(), Failure> {
    let bb = cx.block_bytes;
    let want_digests = land.want;
    let slots = [SlotPtr(mover.slot_ptr(0)), SlotPtr(mover.slot_ptr(1))];
    let (verify_tx, verify_rx) = mpsc::sync_channel::<(usize, usize, u64, u64)>(2);
    let mac = cx.sums.mac();
    let records_tags = cx.sums.records_tags();
    let (free_tx, free_rx) = mpsc::sync_channel::<usize>(2);
    free_tx.send(0).expect("room for two");
    free_tx.send(1).expect("room for two");
    std::thread::scope(|sc| {
        let verifier = sc.spawn(move || {
            for (k, i, sum, tag) in verify_rx {
                let bytes = mover.slot(k);
                Landing::check(i, kv_checksum(bytes), sum)?;
                // the tag this agent records for the block: the one checked, or its own
                let mut own = None;
                if let Some(mac) = mac {
                    if tagged {
                        Landing::check_tag(i, mac.tag(bytes), tag)?;
                        own = Some(tag);
                    } else if records_tags {
                        own = Some(mac.tag(bytes));
                    }
                }
                mover.scatter(k, dst[i]).map_err(|e| (FailReason::Corrupt, format!("block {i}: writing it: {e}")))?;
                land.landed(i, sum);
                if let Some(t) = own {
                    land.tagged(i, t);
                }
                if free_tx.send(k).is_err() {
                    break;
                }
            }
            Ok(())
        });
        let read = (|| -> Result<(), Failure> {
            let mut head = [0u8; wire::BLOCK_HEAD];
            let mut buf = Vec::new();
            for (i, &want) in asked.iter().enumerate().take(count) {
                stopped()?;
                // the verifier stopped (its error is the answer) when no slot comes back
                let Ok(k) = free_rx.recv() else { return Ok(()) };
                let what = || format!("block {i}");
                let (kind, len) = wire::read_header(c, wire::BLOCK_HEAD + bb.max(wire::MAX_CONTROL), by())
                    .map_err(|e| frame_fail(e, &what()))?;
                if kind == wire::REFUSE && len <= wire::MAX_CONTROL {
                    buf.resize(len, 0);
                    c.read_by(&mut buf, by()).map_err(|e| io_fail(&e, &what()))?;
                    return Err(refusal(&buf));
                }
                if kind != wire::BLOCK || len != wire::BLOCK_HEAD + bb {
                    return Err((FailReason::Corrupt, format!("block {i}: a frame of kind {kind}, {len} bytes")));
                }
                c.read_by(&mut head, by()).map_err(|e| io_fail(&e, &what()))?;
                // SAFETY: slot `k` (at least one block long) belongs to this thread from the
                // moment it came back from the verifier until it is sent to it again.
                let slot = unsafe { std::slice::from_raw_parts_mut(slots[k].0, bb) };
                c.read_by(slot, by()).map_err(|e| io_fail(&e, &what()))?;
                if wire::u64_at(&head, 0) != want {
                    return Err((FailReason::Corrupt, format!("block {i}: another name than asked")));
                }
                // another content under the asked name: never written into the pool
                Landing::check_digest(want_digests, i, head[24..].try_into().expect("32 bytes"))?;
                if verify_tx.send((k, i, wire::u64_at(&head, 8), wire::u64_at(&head, 16))).is_err() {
                    return Ok(());
                }
            }
            Ok(())
        })();
        drop(verify_tx);
        let verified = verifier.join().unwrap_or_else(|_| Err((FailReason::Internal, "the verifier panicked".into())));
        // the verifier's failure is the earlier one in block order
        verified?;
        read
    })
}

/// The whole transfer's deadline on the serving side: 10 s plus 1 s per 100 MB.
pub(in crate::agent) fn transfer_deadline(bytes: u64) -> std::time::Duration {
    std::time::Duration::from_secs(10) + std::time::Duration::from_secs_f64(bytes as f64 / 100e6)
}

/// Serve the pinned blocks `ids` (names `names`) in frames: the offer, then each block with its
/// name, recorded checksum, recorded tag (when this agent tags its blocks: the offer says
/// [`wire::TAGGED`]) and recorded digest, gathered by a helper thread into one slot while this
/// thread sends the other. Whether it ended cleanly.
pub(in crate::agent) fn serve(cx: &Cx<'_>, c: &mut dyn Conn, ids: &[u32], names: &[u64]) -> bool {
    let bb = cx.block_bytes;
    let offered = ids.len();
    // tagged only when every offered block has its tag (a block recorded before a tag could be
    // taken is offered untagged with the rest: its destination checks the checksum alone)
    let tagged = !ids.is_empty() && ids.iter().all(|&id| cx.sums.tag(id).is_some());
    let flags = if tagged { wire::TAGGED } else { 0 };
    if wire::write_frame(c, wire::OFFER, &wire::encode_offer(offered as u32, flags, bb as u64), cx.io_deadline())
        .is_err()
    {
        Stats::add(&cx.stats.serve_aborted, 1);
        return false;
    }
    if offered == 0 {
        return true;
    }
    let end = Instant::now() + transfer_deadline((offered * bb) as u64);
    let by = |cx: &Cx<'_>| cx.io_deadline().min(end);
    // SAFETY: the layout's blocks are memory valid for the agent's life (`Agent::new`'s
    // contract); the mover only reads the pinned blocks `ids`, which the runtime does not write
    // while they are pinned.
    let Ok(mut mover) = (unsafe { cx.movers.take(cx.layout) }) else {
        Stats::add(&cx.stats.serve_aborted, 1);
        return false;
    };
    let chunk = mover.slot_blocks;
    let slots = [SlotPtr(mover.slot_ptr(0)), SlotPtr(mover.slot_ptr(1))];
    // pipelined over the mover's two slots: a helper thread gathers chunk c + 1 into one slot
    // while this thread sends chunk c out of the other
    let (ready_tx, ready_rx) = mpsc::sync_channel::<(usize, usize)>(2);
    let (free_tx, free_rx) = mpsc::sync_channel::<usize>(2);
    free_tx.send(0).expect("room for two");
    free_tx.send(1).expect("room for two");
    let (sent_ok, gathered_ok) = std::thread::scope(|sc| {
        let mover = &mut mover;
        let gatherer = sc.spawn(move || {
            for (ci, part) in ids.chunks(chunk).enumerate() {
                let Ok(k) = free_rx.recv() else { return true };
                if mover.gather(k, part).is_err() {
                    return false;
                }
                if ready_tx.send((k, ci)).is_err() {
                    return true;
                }
            }
            true
        });
        let mut ok = true;
        'send: for (k, ci) in ready_rx.iter() {
            let part = &ids[ci * chunk..(ci * chunk + chunk).min(ids.len())];
            // SAFETY: slot `k` holds `part.len()` gathered blocks (at most `slot_blocks`) and
            // belongs to this thread until it is sent back to the gatherer.
            let staged = unsafe { std::slice::from_raw_parts(slots[k].0, part.len() * bb) };
            for (j, &id) in part.iter().enumerate() {
                let i = ci * chunk + j;
                let sum = cx.sums.get(id).expect("offered blocks have recorded checksums");
                let mut head = [0u8; 12 + wire::BLOCK_HEAD];
                head[..12].copy_from_slice(&wire::header(wire::BLOCK, wire::BLOCK_HEAD + bb));
                head[12..20].copy_from_slice(&names[i].to_le_bytes());
                head[20..28].copy_from_slice(&sum.to_le_bytes());
                let tag = if tagged { cx.sums.tag(id).unwrap_or(0) } else { 0 };
                head[28..36].copy_from_slice(&tag.to_le_bytes());
                head[36..].copy_from_slice(&cx.sums.digest(id));
                if c.write_by(&head, by(cx)).is_err() || c.write_by(&staged[j * bb..(j + 1) * bb], by(cx)).is_err() {
                    ok = false;
                    break 'send;
                }
                Stats::add(&cx.stats.blocks_sent, 1);
                Stats::add(&cx.stats.bytes_sent, bb as u64);
            }
            let _ = free_tx.send(k);
        }
        drop(ready_rx);
        drop(free_tx);
        (ok, gatherer.join().unwrap_or(false))
    });
    let ok = sent_ok && gathered_ok;
    if !gathered_ok {
        // a mover whose copy failed is not reused
        Stats::add(&cx.stats.serve_aborted, 1);
        return false;
    }
    // gathers are waited for inside `gather`: nothing of this mover is in flight
    cx.movers.put(mover);
    if !ok {
        Stats::add(&cx.stats.serve_aborted, 1);
    }
    ok
}
