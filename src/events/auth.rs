//! Who may read the KV events: the ZAP handler both sockets ask (ZeroMQ's authentication
//! protocol, on an in-process socket), the address allowlist and, with a key, the PLAIN
//! subscriber token (the module docs of [`crate::events`], "Hostile input" and "Keys").

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;

use super::Counters;
use crate::agent::{PeerAllow, Psk};

/// The PLAIN user name a keyed publisher requires.
pub const PLAIN_USERNAME: &str = "kvrelay";

/// What [`subscriber_token`] derives the token from.
pub const TOKEN_LABEL: &[u8] = b"kvrelay-kv-events/v1 subscriber";

/// The PLAIN password a publisher keyed with `key` requires (module docs, "Keys"): 64
/// lowercase hex digits of HMAC-SHA-256 of [`TOKEN_LABEL`] under the key.
pub fn subscriber_token(key: &Psk) -> String {
    use std::fmt::Write as _;
    key.derive(TOKEN_LABEL).iter().fold(String::with_capacity(64), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// The ZAP domain the publishing socket names (a NULL-mechanism socket asks ZAP only when it
/// has one).
pub(super) const ZAP_DOMAIN: &str = "kvrelay-kv-events";
/// The ZAP domain the replay socket names: its handshakes are also held to [`REPLAY_PEERS`].
pub(super) const ZAP_DOMAIN_REPLAY: &str = "kvrelay-kv-events-replay";
/// Where the replay socket's monitor publishes its connections' accepts and closes
/// (in-process, per publisher: each has a ZMQ context of its own).
pub(super) const REPLAY_MONITOR: &str = "inproc://kvrelay-kv-events-replay-monitor";

/// Connections the replay socket holds at once, every peer together: each can hold at most its
/// queue ([`super::REPLAY_PEER_HWM`] batches of about [`super::BATCH_BYTES`], 8 MiB) in this
/// process once it stops reading, so replays hold at most 128 MiB however many connections are
/// opened. A further handshake is refused (counted in `replay_peers_refused`) until one closes.
pub const REPLAY_PEERS: usize = 16;
/// Of [`REPLAY_PEERS`], the connections one address may hold: a peer that opens many and never
/// reads leaves room for the others.
pub const REPLAY_PEERS_PER_ADDRESS: usize = 4;
/// The replay socket's connections as its monitor reports them (accepted, closed) and the
/// addresses the ZAP handler admitted them from: what [`REPLAY_PEERS`] and
/// [`REPLAY_PEERS_PER_ADDRESS`] count. Only admitted connections count: one that never finishes
/// its handshake (libzmq closes it after its handshake interval) takes no room.
#[derive(Debug, Default)]
pub struct ReplayPeers {
    /// Open connections by the descriptor the monitor names: `Some(address)` once admitted.
    open: HashMap<u32, Option<IpAddr>>,
    /// Accepted connections whose handshake has not reached the ZAP handler yet, oldest first
    /// (libzmq reports the accept before it asks ZAP, from the same thread; handshakes that
    /// overlap may reach ZAP in another order, which can swap two connections' addresses, never
    /// the count).
    waiting: VecDeque<u32>,
}

impl ReplayPeers {
    /// The monitor reported connection `fd` accepted.
    pub fn accepted(&mut self, fd: u32) {
        self.open.insert(fd, None);
        self.waiting.push_back(fd);
    }

    /// The monitor reported connection `fd` closed.
    pub fn disconnected(&mut self, fd: u32) {
        self.open.remove(&fd);
        self.waiting.retain(|w| *w != fd);
    }

    /// Whether the handshake of the oldest waiting connection, from `ip`, may go ahead (it then
    /// counts until it closes). A handshake with no accepted connection waiting is refused.
    pub fn admit(&mut self, ip: IpAddr) -> bool {
        let Some(fd) = self.waiting.pop_front() else { return false };
        let admitted = self.open.values().filter(|a| a.is_some()).count();
        let same = self.open.values().filter(|a| **a == Some(ip)).count();
        let ok = admitted < REPLAY_PEERS && same < REPLAY_PEERS_PER_ADDRESS;
        if ok {
            self.open.insert(fd, Some(ip));
        }
        ok
    }

    /// Connections admitted and still open.
    pub fn held(&self) -> usize {
        self.open.values().filter(|a| a.is_some()).count()
    }
}

/// Answer ZeroMQ's authentication requests (ZAP 1.0, `inproc://zeromq.zap.01` of `ctx`) from a
/// thread of its own until `stop` is signalled: a peer whose address `allow` admits and that
/// presents `token` (when there is one) gets `200`, any other `400`; a handshake on the replay
/// socket also needs room under [`REPLAY_PEERS`] and [`REPLAY_PEERS_PER_ADDRESS`], which the
/// same thread keeps from the replay socket's monitor ([`REPLAY_MONITOR`]).
pub(super) fn start_zap(
    ctx: &zmq::Context,
    allow: PeerAllow,
    token: Option<String>,
    counters: Arc<Counters>,
    stop: zmq::Socket,
) -> Result<JoinHandle<()>, String> {
    let s = ctx.socket(zmq::REP).map_err(|e| format!("KV events' ZAP handler: {e}"))?;
    s.bind("inproc://zeromq.zap.01").map_err(|e| format!("KV events' ZAP handler: {e}"))?;
    // inproc allows a connect before the bind: the replay socket's monitor binds once it exists
    let monitor = ctx.socket(zmq::PAIR).map_err(|e| format!("KV events' replay monitor: {e}"))?;
    monitor.connect(REPLAY_MONITOR).map_err(|e| format!("KV events' replay monitor: {e}"))?;
    std::thread::Builder::new()
        .name("kv-events-zap".into())
        .spawn(move || {
            let mut peers = ReplayPeers::default();
            loop {
                let mut items =
                    [s.as_poll_item(zmq::POLLIN), monitor.as_poll_item(zmq::POLLIN), stop.as_poll_item(zmq::POLLIN)];
                match zmq::poll(&mut items, -1) {
                    Ok(_) if items[2].is_readable() => return,
                    Ok(_) | Err(zmq::Error::EINTR) => {}
                    Err(_) => return,
                }
                // the monitor first: a connection that closed makes room for this handshake
                // each event: [u16 event, u32 value (the connection's descriptor)], then the endpoint
                while let Ok(ev) = monitor.recv_multipart(zmq::DONTWAIT) {
                    if let Some(f) = ev.first().filter(|f| f.len() == 6) {
                        let fd = u32::from_ne_bytes([f[2], f[3], f[4], f[5]]);
                        match zmq::SocketEvent::from_raw(u16::from_ne_bytes([f[0], f[1]])) {
                            zmq::SocketEvent::ACCEPTED => peers.accepted(fd),
                            zmq::SocketEvent::DISCONNECTED => peers.disconnected(fd),
                            _ => {}
                        }
                        counters.replay_peers.store(peers.held() as u64, Ordering::Relaxed);
                    }
                }
                let req = match s.recv_multipart(zmq::DONTWAIT) {
                    Ok(r) => r,
                    Err(zmq::Error::EINTR | zmq::Error::EAGAIN) => continue,
                    Err(_) => return,
                };
                let mut ok = zap_allows(&req, &allow, token.as_deref());
                if !ok {
                    counters.refused.fetch_add(1, Ordering::Relaxed);
                } else if req.get(2).is_some_and(|d| d == ZAP_DOMAIN_REPLAY.as_bytes()) {
                    let ip = req.get(3).and_then(|a| std::str::from_utf8(a).ok()?.parse().ok());
                    ok = ip.is_some_and(|ip| peers.admit(ip));
                    if !ok {
                        counters.replay_peers_refused.fetch_add(1, Ordering::Relaxed);
                    }
                }
                counters.replay_peers.store(peers.held() as u64, Ordering::Relaxed);
                let id = req.get(1).map_or(&[][..], |v| &v[..]);
                let (code, text): (&[u8], &[u8]) = if ok { (b"200", b"OK") } else { (b"400", b"peer not allowed") };
                if s.send_multipart([&b"1.0"[..], id, code, text, b"", b""], 0).is_err() {
                    return;
                }
            }
        })
        .map_err(|e| format!("starting the KV events' ZAP thread: {e}"))
}

/// Whether a ZAP request `[version, request id, domain, address, identity, mechanism, ...]`
/// comes from an address `allow` admits and, with a `token`, is a PLAIN handshake of user
/// [`PLAIN_USERNAME`] and password `token` (compared in constant time); without one, a NULL
/// handshake.
pub fn zap_allows(req: &[Vec<u8>], allow: &PeerAllow, token: Option<&str>) -> bool {
    match req {
        [version, _id, _domain, address, _identity, mechanism, credentials @ ..] if version == b"1.0" => {
            let listed =
                std::str::from_utf8(address).ok().and_then(|a| a.parse().ok()).is_some_and(|ip| allow.allows(ip));
            let credentials_ok = match (token, credentials) {
                (None, []) => mechanism == b"NULL",
                (Some(t), [user, password]) => {
                    mechanism == b"PLAIN" && user == PLAIN_USERNAME.as_bytes() && same_bytes(password, t.as_bytes())
                }
                _ => false,
            };
            listed && credentials_ok
        }
        _ => false,
    }
}

/// `a == b` in time that depends on the lengths only.
fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}
