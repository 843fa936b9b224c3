//! One NIXL fetch as a transfer handle ([`Transfer`]): [`Reads::post`] builds and posts every
//! READ of the offer at once, [`Reads::check`] verifies the requests in order as they finish,
//! [`Reads::quiet`] waits (the write grace) for any READ still in flight, and what is not
//! proven over when the handle goes becomes [`InFlight`] writes that the agent keeps, with the
//! blocks they may write withheld, until NIXL reports every one of them over.

use std::time::{Duration, Instant};

use nixl_sys::{XferDescList, XferOp, XferRequest, XferStatus};

use super::plan::merge_runs;
use super::{kind_of, Nixl, RemoteUse, DESCRIPTOR_BYTES, REQUEST_BYTES, REQUEST_BYTES_GPU};
use crate::agent::pool::Mover;
use crate::agent::transport::{send_done, Cx, Failure, Landing, Progress, Pull, Transfer, Writes};
use crate::agent::wire::{self, Conn};
use crate::agent::FailReason;
use crate::block_mac::NhSums;

fn nixl_err(what: &str, e: nixl_sys::NixlError) -> Failure {
    (FailReason::Truncated, format!("NIXL {what}: {e:?}"))
}

/// A posted READ of blocks `range` of the offer.
struct Pending {
    range: std::ops::Range<usize>,
    req: XferRequest,
    /// Posted and not seen finished (successfully or not).
    in_flight: bool,
}

impl Pending {
    /// Look at the READ once: whether it is over (finished, or failed: then the error).
    fn poll(&mut self, agent: &nixl_sys::Agent) -> Result<bool, Failure> {
        if !self.in_flight {
            return Ok(true);
        }
        match agent.get_xfer_status(&self.req) {
            Ok(XferStatus::Success) => {
                self.in_flight = false;
                Ok(true)
            }
            Ok(XferStatus::InProgress) => Ok(false),
            Err(e) => {
                self.in_flight = false; // finished, with an error
                Err(nixl_err("READ", e))
            }
        }
    }
}

/// The READs of one NIXL fetch (see the module docs).
pub(super) struct Reads<'a> {
    nx: &'a Nixl,
    offer: wire::InPlaceOffer,
    /// The source agent, held in the table while READs from it may run.
    used: Option<RemoteUse>,
    reqs: Vec<Pending>,
    /// The next request to verify.
    next: usize,
    /// The checksum mover of a device pool (taken when posted, given back at release).
    mover: Option<Mover>,
    sums: Vec<u64>,
    /// The keyed tags of the same blocks (a keyed agent; empty otherwise).
    tags: Vec<u64>,
    /// Their NH sums, as a device pool's kernel gives them.
    nh: Vec<NhSums>,
    /// What the slow-READ check times: from building the first request to the last one seen
    /// finished, less taking the checksum mover; and how many descriptors the READs had.
    began: Instant,
    reads_done: Instant,
    mover_took: Duration,
    descriptors: u64,
}

impl<'a> Reads<'a> {
    pub(super) fn new(nx: &'a Nixl, offer: wire::InPlaceOffer, used: RemoteUse) -> Reads<'a> {
        let now = Instant::now();
        Reads {
            nx,
            offer,
            used: Some(used),
            reqs: Vec::new(),
            next: 0,
            mover: None,
            sums: Vec::new(),
            tags: Vec::new(),
            nh: Vec::new(),
            began: now,
            reads_done: now,
            mover_took: Duration::ZERO,
            descriptors: 0,
        }
    }
}

impl Transfer for Reads<'_> {
    fn count(&self) -> usize {
        self.offer.blocks.len()
    }

    fn limit(&mut self, n: usize) {
        self.offer.blocks.truncate(n);
    }

    /// Post every READ first, in requests of [`REQUEST_BYTES`] ([`REQUEST_BYTES_GPU`] into GPU
    /// memory): UCX moves them while the earlier ones are verified. A request's descriptors are
    /// its pieces contiguous at both ends, block by block or segment by segment, whichever
    /// gives fewer.
    fn post(&mut self, cx: &Cx<'_>, _c: &mut dyn Conn, job: &mut Pull<'_>) -> Result<(), Failure> {
        let (nx, offer, dst) = (self.nx, &self.offer, job.dst);
        let bb = cx.block_bytes;
        let count = offer.blocks.len();
        let per = (if nx.device.is_some() { REQUEST_BYTES_GPU } else { REQUEST_BYTES } / bb).max(1);
        let (lk, ld) = kind_of(nx.device);
        let (rk, rd) = kind_of(offer.device);
        let segs = cx.layout.segments();
        // the pieces of one request, merged block by block and segment by segment (reused)
        let mut runs = (Vec::new(), Vec::new());
        // blocks per request after the first: where pieces merge segment by segment (decided
        // on the first request), enough that each segment's descriptor carries DESCRIPTOR_BYTES.
        // The first keeps `per` blocks, so that the first check (and the estimate's setup)
        // does not wait for the whole fetch.
        let smallest = segs.iter().map(|g| g.bytes_per_block as usize).min().unwrap_or(bb).max(1);
        let mut later = per;
        self.began = Instant::now();
        let mut start = 0;
        while start < count {
            let end = (start + if start == 0 { per } else { later }).min(count);
            let mut local = XferDescList::new(lk).map_err(|e| nixl_err("descriptor list", e))?;
            let mut far = XferDescList::new(rk).map_err(|e| nixl_err("descriptor list", e))?;
            let (blocks, ids) = (&offer.blocks[start..end], &dst[start..end]);
            merge_runs(segs, &offer.segments, blocks, ids, false, &mut runs.0);
            merge_runs(segs, &offer.segments, blocks, ids, true, &mut runs.1);
            let segment_major = runs.1.len() < runs.0.len();
            if start == 0 && segment_major {
                later = per.max(DESCRIPTOR_BYTES.div_ceil(smallest));
            }
            let best = if segment_major { &runs.1 } else { &runs.0 };
            self.descriptors += best.len() as u64;
            for &(l, r, n) in best {
                local.add_desc(l as usize, n as usize, ld);
                far.add_desc(r as usize, n as usize, rd);
            }
            let req = nx
                .agent
                .create_xfer_req(XferOp::Read, &local, &far, &offer.agent, None)
                .map_err(|e| nixl_err("transfer request", e))?;
            // owned by the handle from here: whatever happens next, it is looked at before its
            // blocks go back
            self.reqs.push(Pending { range: start..end, req, in_flight: true });
            let p = self.reqs.last_mut().expect("pushed");
            match nx.agent.post_xfer_req(&p.req, None) {
                Ok(in_flight) => p.in_flight = in_flight,
                Err(e) => {
                    // a request that failed to post moves nothing
                    p.in_flight = false;
                    return Err(nixl_err("posting a READ", e));
                }
            }
            start = end;
        }
        if nx.device.is_some() {
            let taking = Instant::now();
            // SAFETY: `Agent::new`'s contract covers the layout's memory; the mover only reads
            // this fetch's destination blocks (the checksum kernel).
            self.mover = Some(unsafe { cx.movers.take(cx.layout) }.map_err(|e| (FailReason::Corrupt, e))?);
            self.mover_took = taking.elapsed();
        }
        Ok(())
    }

    /// Verify the next request once NIXL reports it finished (host memory summed in place, GPU
    /// memory with the checksum kernel); the first mismatch is `corrupt`.
    fn check(
        &mut self,
        cx: &Cx<'_>,
        _c: &mut dyn Conn,
        job: &mut Pull<'_>,
        land: &mut Landing<'_>,
    ) -> Result<Progress, Failure> {
        let Some(p) = self.reqs.get_mut(self.next) else {
            return Ok(Progress::Done { reusable: true });
        };
        if !p.poll(&self.nx.agent)? {
            return Ok(Progress::Pending);
        }
        self.reads_done = Instant::now();
        let range = p.range.clone();
        let ids = &job.dst[range.clone()];
        self.sums.clear();
        self.sums.resize(ids.len(), 0);
        // a keyed agent: the tags of what landed, taken where it lies (a device pool's by the
        // checksum kernel from the same loads), checked against a tagged offer's and recorded
        self.tags.clear();
        let mac = cx.sums.mac();
        match self.mover.as_mut() {
            Some(m) => {
                self.nh.clear();
                self.nh.resize(if mac.is_some() { ids.len() } else { 0 }, NhSums::default());
                let nh = mac.is_some().then_some(&mut self.nh[..]);
                m.device_checksums(ids, &mut self.sums, nh).map_err(|e| (FailReason::Corrupt, e))?;
                if let Some(mac) = mac {
                    self.tags.extend(self.nh.iter().map(|&t| mac.finish(t, cx.layout.stage_block_bytes())));
                }
            }
            None => {
                crate::agent::sums::sum_host(cx.layout, cx.block_bytes, ids, &mut self.sums);
                if let Some(mac) = mac {
                    self.tags.resize(ids.len(), 0);
                    crate::agent::sums::tag_host(cx.layout, mac, cx.block_bytes, ids, &mut self.tags);
                }
            }
        }
        for (j, i) in range.enumerate() {
            Landing::check(i, self.sums[j], self.offer.blocks[i].1)?;
            if let (Some(&got), Some(&want)) = (self.tags.get(j), self.offer.tags.get(i)) {
                Landing::check_tag(i, got, want)?;
            }
            land.landed(i, self.sums[j]);
            if let Some(&t) = self.tags.get(j) {
                land.tagged(i, t);
            }
        }
        self.next += 1;
        Ok(if self.next == self.reqs.len() { Progress::Done { reusable: true } } else { Progress::Pending })
    }

    /// Every READ still posted gets until `until` to finish or fail (NIXL's status says so;
    /// an error status counts as over).
    fn quiet(&mut self, until: Instant) -> bool {
        let agent = &self.nx.agent;
        let mut spins = 0u32;
        loop {
            let running = self.reqs.iter_mut().fold(false, |any, p| !matches!(p.poll(agent), Ok(true) | Err(_)) | any);
            if !running {
                return true;
            }
            if Instant::now() >= until {
                return false;
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }

    /// `DONE` with the verified count; after a failure (not a cancel) with every READ over, the
    /// source agent is forgotten (its metadata may be stale: the next fetch loads it afresh).
    fn release(&mut self, cx: &Cx<'_>, c: &mut dyn Conn, landed: usize, failed: Option<FailReason>, quiet: bool) {
        if let Some(m) = self.mover.take() {
            // the checksum kernel waited for its own stream inside: nothing of it is in flight
            cx.movers.put(m);
        }
        match failed {
            None if self.nx.device.is_some() && self.offer.device.is_some() => {
                let took = self.reads_done.saturating_duration_since(self.began).saturating_sub(self.mover_took);
                let bytes = (self.offer.blocks.len() * cx.block_bytes) as u64;
                self.nx.judge_device_read(cx, bytes, self.descriptors, took);
            }
            Some(reason) if quiet && reason != FailReason::Cancelled => {
                // READs released and the use dropped first: forgetting skips an agent in use
                self.reqs.clear();
                self.used = None;
                self.nx.forget_remote(&self.offer.agent);
            }
            _ => {}
        }
        send_done(cx, c, landed);
    }

    fn into_writes(self: Box<Self>) -> Option<Box<dyn Writes>> {
        let me = *self;
        let reqs = me.reqs.into_iter().map(|p| p.req).collect();
        Some(Box::new(InFlight { reqs, agent: me.nx.agent.clone(), _used: me.used }))
    }
}

/// READs not proven over when their fetch ended: kept (with their source agent held in the
/// table) until NIXL reports each finished or failed. Dropped before the NIXL agent's backend
/// goes (the agent's shutdown), which ends them.
struct InFlight {
    // field order is drop order: the requests go before the use of their source agent
    reqs: Vec<XferRequest>,
    agent: nixl_sys::Agent,
    _used: Option<RemoteUse>,
}

impl Writes for InFlight {
    fn over(&mut self) -> bool {
        self.reqs.iter().all(|r| !matches!(self.agent.get_xfer_status(r), Ok(XferStatus::InProgress)))
    }
}
