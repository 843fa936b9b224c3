//! Serving: the accept loop, the handshake (authentication, hello, fingerprint), then the
//! transfer of the pinned leading run, each block with its recorded checksum.

use std::net::{IpAddr, TcpListener};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::allow::canonical;
use super::wire::{self, Conn, FrameError, Refusal};
use super::{auth, Inner, Stats};

/// Buffers one connection reuses.
#[derive(Default)]
pub(super) struct Scratch {
    buf: Vec<u8>,
    names: Vec<u64>,
    ids: Vec<u32>,
    /// The hello's kind: `HELLO` (blocks in frames), or the agent's own backend's.
    kind: u8,
    /// What the backend keeps for this connection between transfers (its export area).
    lease: super::transport::Lease,
}

pub(super) fn accept_loop(inner: &Arc<Inner>, listener: TcpListener) {
    loop {
        let accepted = listener.accept();
        if inner.stop.load(Ordering::Acquire) {
            return;
        }
        let (mut s, peer) = match accepted {
            Ok(x) => x,
            Err(_) => {
                // out of descriptors and the like: back off instead of spinning
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let ip = canonical(peer.ip());
        let quick = Instant::now() + Duration::from_millis(100);
        if !inner.allow.allows(ip) {
            inner.stats.refused(Refusal::PeerNotAllowed);
            wire::refuse(&mut s, Refusal::PeerNotAllowed, "this peer is not on the KV service's allowlist", quick);
            continue;
        }
        // a full address or full handshake slots make room by closing the oldest connection
        // that has not completed its handshake (of that address, or of any): a flood of silent
        // or slow connections then only ever evicts itself, and a peer that speaks promptly
        // gets in, even from an address that also floods
        // (the evicted connection hands its place and handshake slot straight to the new one,
        // so the counts never go past their limits)
        let refusal = if !take_peer(inner, ip) {
            // its own oldest silent connection hands over both its place and its slot
            (!make_room(inner, Some(ip))).then_some((Refusal::PerPeerLimit, "this peer holds its limit of connections"))
        } else if take_slot(&inner.stats.pending_now, inner.limits.max_pending) || make_room(inner, None) {
            None
        } else {
            release_peer(inner, ip);
            Some((Refusal::Busy, "too many connections are in their handshake"))
        };
        if let Some((r, text)) = refusal {
            inner.stats.refused(r);
            wire::refuse(&mut s, r, text, quick);
            continue;
        }
        Stats::add(&inner.stats.accepted, 1);
        let Some(id) = inner.register(&s) else {
            release(inner, ip, Slot::Pending);
            continue;
        };
        inner.greeting.lock().unwrap_or_else(|e| e.into_inner()).push_back(Greeting { id, ip, handed: None });
        let worker = inner.clone();
        let spawned = std::thread::Builder::new().name("kvrelay-serve".into()).stack_size(1 << 20).spawn(move || {
            let _ = s.set_nodelay(true);
            super::set_buffers(&s, worker.limits.socket_buffer_bytes);
            let mut scratch = Scratch::default();
            // what it holds is given back on every path: a panic in serving (a holder callback
            // that unwinds, say) ends this connection only, never leaks a slot or the count
            // that the agent's drop waits on
            let mut held = Held { slot: Slot::Pending, counted: true, greeting: Some(id) };
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                serve(&worker, &mut s, &mut scratch, Some(ip), &mut held)
            }));
            if r.is_err() {
                Stats::add(&worker.stats.serve_aborted, 1);
            }
            drop(s);
            held.give_back(&worker, ip, id);
        });
        if spawned.is_err() {
            Held { slot: Slot::Pending, counted: true, greeting: Some(id) }.give_back(inner, ip, id);
        }
    }
}

/// What a connection holds while it is served: kept up to date by [`serve`] so that the
/// connection's thread gives everything back also when serving panicked.
#[derive(Clone, Copy)]
pub(super) struct Held {
    /// Its gauge slot.
    pub(super) slot: Slot,
    /// Whether it counts against its peer's `max_per_peer`.
    pub(super) counted: bool,
    /// Its registration while it may still be evicted (until its handshake completed).
    pub(super) greeting: Option<u64>,
}

impl Held {
    /// Give back everything a connection from `ip`, registered as `id`, holds (its socket is
    /// closed): what an eviction handed over, its gauge slot, its place among its peer's
    /// connections, its registration. Runs once per accepted connection, on its thread's every
    /// path (a panic in serving included) or where its thread did not start.
    fn give_back(mut self, inner: &Inner, ip: IpAddr, id: u64) {
        if let Some(g) = self.greeting.take() {
            greeted(inner, g).take_back(&mut self);
        }
        release_slot(inner, self.slot);
        if self.counted {
            release_peer(inner, ip);
        }
        inner.unregister(id);
    }
}

impl Default for Held {
    fn default() -> Held {
        Held { slot: Slot::None, counted: false, greeting: None }
    }
}

/// An accepted connection that has not completed its handshake (`Inner::greeting`).
pub(super) struct Greeting {
    /// Its registration id (`Inner::conns`).
    id: u64,
    /// Its peer.
    ip: IpAddr,
    /// Evicted (shut down to make room): what it handed to the newer connection.
    handed: Option<Handed>,
}

/// What an evicted connection handed over: its handshake slot always, its place among its
/// address's `max_per_peer` when the newcomer came from the same address.
#[derive(Clone, Copy, Default)]
pub(super) struct Handed {
    slot: bool,
    place: bool,
}

impl Handed {
    /// Take out of `held` what is no longer this connection's to give back.
    fn take_back(self, held: &mut Held) {
        if self.slot && held.slot == Slot::Pending {
            held.slot = Slot::None;
        }
        if self.place {
            held.counted = false;
        }
    }
}

/// Make room for a new connection: end the oldest connection still in its handshake (of `ip`
/// when given) and hand its handshake slot, and with `ip` its place among that address's
/// connections, to the new one. Its reading side is shut down, so its thread wakes within a
/// step, answers `busy` (a peer that was only slow learns why, instead of reading a connection
/// cut as from a crashed source) and gives back only what it still holds, so no count ever goes
/// past its limit. False when no connection is in its handshake (of `ip`).
fn make_room(inner: &Inner, ip: Option<IpAddr>) -> bool {
    let mut g = inner.greeting.lock().unwrap_or_else(|e| e.into_inner());
    let Some(victim) = g.iter_mut().find(|x| x.handed.is_none() && ip.is_none_or(|ip| x.ip == ip)) else {
        return false;
    };
    victim.handed = Some(Handed { slot: true, place: ip.is_some() });
    if let Some(s) = inner.conns.lock().unwrap_or_else(|e| e.into_inner()).1.get(&victim.id) {
        let _ = s.shutdown(std::net::Shutdown::Read);
    }
    drop(g);
    Stats::add(&inner.stats.handshake_evicted, 1);
    true
}

/// Connection `id` completed its handshake or ended: it can no longer be evicted. What it had
/// handed over, if it was evicted.
fn greeted(inner: &Inner, id: u64) -> Handed {
    let mut g = inner.greeting.lock().unwrap_or_else(|e| e.into_inner());
    let Some(at) = g.iter().position(|x| x.id == id) else { return Handed::default() };
    g.remove(at).and_then(|x| x.handed).unwrap_or_default()
}

/// Which gauge a connection holds.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Slot {
    Pending,
    Serving,
    None,
}

fn release(inner: &Inner, ip: IpAddr, slot: Slot) {
    release_slot(inner, slot);
    release_peer(inner, ip);
}

/// Give back the gauge slot a connection holds.
fn release_slot(inner: &Inner, slot: Slot) {
    match slot {
        Slot::Pending => {
            inner.stats.pending_now.fetch_sub(1, Ordering::Relaxed);
        }
        Slot::Serving => {
            inner.stats.serving_now.fetch_sub(1, Ordering::Relaxed);
        }
        Slot::None => {}
    }
}

/// Take one of `ip`'s `max_per_peer` connections; false when it holds all of them.
fn take_peer(inner: &Inner, ip: IpAddr) -> bool {
    let mut peers = inner.peers.lock().unwrap_or_else(|e| e.into_inner());
    let n = peers.entry(ip).or_insert(0);
    if *n >= inner.limits.max_per_peer {
        return false;
    }
    *n += 1;
    true
}

/// Give back one of `ip`'s connections.
fn release_peer(inner: &Inner, ip: IpAddr) {
    let mut peers = inner.peers.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(n) = peers.get_mut(&ip) {
        *n -= 1;
        if *n == 0 {
            peers.remove(&ip);
        }
    }
}

enum Hs {
    Refuse(Refusal, &'static str),
    /// The peer left, sent nothing in time, or an I/O error.
    Gone,
}

fn frame_err(e: FrameError) -> Hs {
    match e {
        FrameError::Io(_) => Hs::Gone,
        FrameError::Malformed(_) => Hs::Refuse(Refusal::BadRequest, "not a kvrelay agent frame"),
    }
}

/// Authentication (when a key is set) and the hello; on success `scratch.names` holds the names.
fn handshake(inner: &Inner, c: &mut dyn Conn, scratch: &mut Scratch, deadline: Instant) -> Result<(), Hs> {
    authenticate(inner, c, deadline)?;
    read_hello(inner, c, scratch, deadline)
}

/// The key's challenge-response (nothing without a key).
fn authenticate(inner: &Inner, c: &mut dyn Conn, deadline: Instant) -> Result<(), Hs> {
    if let Some(key) = &inner.key {
        let (kind, len) = wire::read_header(c, wire::MAX_CONTROL, deadline).map_err(frame_err)?;
        if kind == wire::HELLO || kind == wire::NIXL_HELLO || kind == wire::IPC_HELLO {
            return Err(Hs::Refuse(Refusal::AuthFailed, "this service requires authentication"));
        }
        if kind != wire::AUTH_HELLO || len != auth::NONCE {
            return Err(Hs::Refuse(Refusal::BadRequest, "expected an authentication hello"));
        }
        let mut client = [0u8; auth::NONCE];
        c.read_by(&mut client, deadline).map_err(|_| Hs::Gone)?;
        let server = auth::nonce().map_err(|_| Hs::Gone)?;
        let mut challenge = [0u8; 2 * auth::NONCE];
        challenge[..auth::NONCE].copy_from_slice(&server);
        challenge[auth::NONCE..].copy_from_slice(&key.server_proof(&client, &server));
        wire::write_frame(c, wire::AUTH_CHALLENGE, &challenge, deadline).map_err(|_| Hs::Gone)?;
        let (kind, len) = wire::read_header(c, wire::MAX_CONTROL, deadline).map_err(frame_err)?;
        if kind != wire::AUTH_PROOF || len != auth::NONCE {
            return Err(Hs::Refuse(Refusal::BadRequest, "expected an authentication proof"));
        }
        let mut proof = [0u8; auth::NONCE];
        c.read_by(&mut proof, deadline).map_err(|_| Hs::Gone)?;
        if !key.check_client(&client, &server, &proof) {
            return Err(Hs::Refuse(Refusal::AuthFailed, "authentication failed"));
        }
    }
    Ok(())
}

/// A hello (`HELLO`, `NIXL_HELLO` or `IPC_HELLO`) by `deadline`; on success `scratch.names` holds the names.
fn read_hello(inner: &Inner, c: &mut dyn Conn, scratch: &mut Scratch, deadline: Instant) -> Result<(), Hs> {
    let hello_max = wire::FINGERPRINT_BYTES + 4 + 8 * inner.limits.max_names as usize;
    let (kind, len) = wire::read_header(c, u32::MAX as usize, deadline).map_err(frame_err)?;
    if kind == wire::AUTH_HELLO && inner.key.is_none() {
        return Err(Hs::Refuse(Refusal::AuthFailed, "this service has no key"));
    }
    if kind != wire::HELLO && kind != wire::NIXL_HELLO && kind != wire::IPC_HELLO {
        return Err(Hs::Refuse(Refusal::BadRequest, "expected a hello"));
    }
    // every agent serves frames; a hello of another kind only when it is its backend's
    if kind != wire::HELLO && inner.serving(kind).is_none() {
        return Err(Hs::Refuse(Refusal::Unsupported, "this service does not serve that transport"));
    }
    // a grant of memory (a CUDA IPC handle, descriptors, a NIXL registration) goes only to a
    // peer that proved it holds the key: a service without one grants nothing
    if kind != wire::HELLO && inner.key.is_none() {
        Stats::add(&inner.stats.grants_refused_unkeyed, 1);
        return Err(Hs::Refuse(
            Refusal::Unsupported,
            "this service has no key: it grants no memory (CUDA IPC, NIXL), only TCP",
        ));
    }
    scratch.kind = kind;
    if len > hello_max {
        return Err(Hs::Refuse(Refusal::TooManyNames, "more names than this service takes in one request"));
    }
    scratch.buf.resize(len, 0);
    c.read_by(&mut scratch.buf, deadline).map_err(|_| Hs::Gone)?;
    let fp = wire::decode_hello(&scratch.buf, &mut scratch.names)
        .ok_or(Hs::Refuse(Refusal::BadRequest, "a hello that does not decode"))?;
    if fp != inner.fingerprint {
        return Err(Hs::Refuse(Refusal::FingerprintMismatch, "the layouts or naming schemes differ"));
    }
    Ok(())
}

/// Tell a connection evicted in its handshake why it ends (`busy`; counted as
/// `handshake_evicted` already), within a short deadline: the peer may not be reading.
fn evicted(inner: &Inner, c: &mut dyn Conn) {
    let quick = (Instant::now() + Duration::from_millis(100)).min(inner.io_deadline());
    wire::refuse(c, Refusal::Busy, "evicted in its handshake to make room for a newer connection", quick);
}

/// Take one of `max` slots counted by `gauge`, if one is free. Connection threads race here; a
/// compare-and-swap keeps the bound exact.
fn take_slot(gauge: &std::sync::atomic::AtomicU64, max: u32) -> bool {
    let max = u64::from(max);
    gauge.fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| (n < max).then_some(n + 1)).is_ok()
}

/// Serve one connection; `peer` is `Some` when the connection holds a handshake slot and one
/// of its peer's `max_per_peer` connections (it is then promoted to a serving slot). After a
/// transfer that ended cleanly the connection stays open for the peer's next hello (no new
/// authentication) for up to `idle_timeout`, holding a handshake slot, never a serving one,
/// while it waits, and only while at most half of `max_pending` are taken. While it waits it
/// does not count against its peer's `max_per_peer`: a kept-alive connection the peer closes
/// must not hold a place its replacement needs. It takes one again with the next hello (or
/// refuses it with `per_peer_limit`). `held` says at every moment which slot it holds and
/// whether it counts against its peer (what the caller gives back when it ends, or panics).
pub(super) fn serve(inner: &Inner, c: &mut dyn Conn, scratch: &mut Scratch, peer: Option<IpAddr>, held: &mut Held) {
    held.slot = if peer.is_some() { Slot::Pending } else { Slot::None };
    held.counted = peer.is_some();
    let hs = Instant::now() + inner.limits.handshake_timeout;
    match handshake(inner, c, scratch, hs) {
        Ok(()) => {
            if let Some(id) = held.greeting.take() {
                let handed = greeted(inner, id);
                if handed.slot {
                    // evicted as it completed its handshake: its slot is another's now
                    handed.take_back(held);
                    evicted(inner, c);
                    return;
                }
            }
        }
        Err(Hs::Refuse(r, text)) => {
            inner.stats.refused(r);
            wire::refuse(c, r, text, inner.io_deadline());
            return;
        }
        Err(Hs::Gone) => {
            // an evicted connection is counted as such (`handshake_evicted`), not as a timeout
            if let Some(id) = held.greeting.take() {
                let handed = greeted(inner, id);
                handed.take_back(held);
                if handed.slot {
                    evicted(inner, c);
                    return;
                }
            }
            Stats::add(&inner.stats.handshake_timeouts, 1);
            return;
        }
    }
    loop {
        if held.slot == Slot::Pending {
            inner.stats.pending_now.fetch_sub(1, Ordering::Relaxed);
            held.slot = Slot::None;
            if !take_slot(&inner.stats.serving_now, inner.limits.max_connections) {
                inner.stats.refused(Refusal::Busy);
                wire::refuse(c, Refusal::Busy, "every serving slot is taken", inner.io_deadline());
                return;
            }
            held.slot = Slot::Serving;
        }
        Stats::add(&inner.stats.served, 1);
        let Some(ip) = peer else {
            transfer(inner, c, scratch);
            return;
        };
        if !transfer(inner, c, scratch) || inner.limits.idle_timeout.is_zero() {
            return;
        }
        // kept alive: back to a handshake slot while it waits, if one of the first half is
        // free (connections waiting for a next hello never hold more than half of
        // `max_pending`, so however many a busy peer leaves open, a new peer's handshake
        // still finds a slot); otherwise the connection closes
        inner.stats.serving_now.fetch_sub(1, Ordering::Relaxed);
        held.slot = Slot::None;
        if !take_slot(&inner.stats.pending_now, inner.limits.max_pending / 2) {
            return;
        }
        held.slot = Slot::Pending;
        release_peer(inner, ip);
        held.counted = false;
        // a peer fetching back to back sends its next hello within microseconds
        c.poll_readable(inner.limits.poll);
        // a connection whose export area this agent keeps waits longer: its peer's next fetch
        // then maps nothing new (see `AREA_KEEP`)
        let idle = if scratch.lease.area.is_some() {
            inner.limits.idle_timeout.max(super::inner::AREA_KEEP)
        } else {
            inner.limits.idle_timeout
        };
        match read_hello(inner, c, scratch, Instant::now() + idle) {
            Ok(()) => {}
            Err(Hs::Refuse(r, text)) => {
                inner.stats.refused(r);
                wire::refuse(c, r, text, inner.io_deadline());
                return;
            }
            // the peer closed it, or it idled out: the normal end of a kept-alive connection
            Err(Hs::Gone) => return,
        }
        if !take_peer(inner, ip) {
            inner.stats.refused(Refusal::PerPeerLimit);
            wire::refuse(c, Refusal::PerPeerLimit, "this peer holds its limit of connections", inner.io_deadline());
            return;
        }
        held.counted = true;
        Stats::add(&inner.stats.reused, 1);
    }
}

/// Unpins what it holds when dropped (whatever way the transfer ends).
struct Pinned<'a> {
    inner: &'a Inner,
    ids: &'a [u32],
}

impl Drop for Pinned<'_> {
    fn drop(&mut self) {
        if !self.ids.is_empty() {
            // contained: this may run while a panic unwinds, where a second one would abort
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.inner.holder.unpin(self.ids)));
        }
    }
}

/// Pin, offer and send (or offer for NIXL reads); whether it ended cleanly (the connection can
/// then carry the peer's next request).
fn transfer(inner: &Inner, c: &mut dyn Conn, scratch: &mut Scratch) -> bool {
    let n = scratch.names.len();
    let num_blocks = inner.layout.num_blocks();
    scratch.ids.clear();
    scratch.ids.resize(n, 0);
    let k = inner.holder.pin(&scratch.names, &mut scratch.ids);
    if k > n || scratch.ids[..k].iter().any(|&id| id >= num_blocks) {
        // the runtime answered something impossible: give back what it says it pinned
        inner.holder.unpin(&scratch.ids[..k.min(n)]);
        inner.stats.refused(Refusal::Internal);
        wire::refuse(c, Refusal::Internal, "the source's reuse cache answered an impossible pin", inner.io_deadline());
        return false;
    }
    // a block whose checksum was never recorded is not served: the offer stops before it
    let offered = scratch.ids[..k].iter().position(|&id| inner.sums.get(id).is_none()).unwrap_or(k);
    if offered < k {
        inner.holder.unpin(&scratch.ids[offered..k]);
    }
    let ids = &scratch.ids[..offered];
    let _pinned = Pinned { inner, ids };
    if scratch.kind == wire::HELLO {
        super::transport::tcp::serve(&inner.cx(), c, ids, &scratch.names)
    } else {
        match inner.serving(scratch.kind) {
            Some(b) => b.serve(&inner.cx(), c, ids, &scratch.names, &mut scratch.lease),
            None => false, // checked at the hello
        }
    }
}
