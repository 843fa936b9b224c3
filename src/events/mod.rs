//! KV events for routers (feature `events`; SPEC section 10): what a runtime's reuse cache
//! holds, published the way vLLM publishes it and Dynamo's KV router indexes it, so that a
//! router names this instance in its `kv.fetch` hints. The test server
//! (`--kv-events-endpoint`) and any runtime that links kvrelay (`kvrelay_kv_events_*` in the
//! header) publish through this one [`Publisher`].
//!
//! **Wire.** A ZMQ PUB socket (bound; subscribers connect) sends one three-frame message per
//! batch: `[topic, seq as u64 big-endian, msgpack([ts, [event, ...], dp_rank])]`, with `ts`
//! the UNIX time in seconds (f64), `dp_rank` 0, and each event a tagged array:
//! - `["BlockStored", [name], parent_name | nil, [token ids], block_size, nil, medium]`: a
//!   block was committed to the reuse cache (by a prefill or a verified fetch). `name` is the
//!   block's kvrelay name ([`crate::names`]), the key the KV agent serves it under, so the
//!   `block_hashes` of a hint a router builds from these events name exactly what a fetch
//!   asks this instance for. `nil` is the LoRA id (kvrelay names carry it inside the name);
//!   `medium` is `"GPU"` for a device pool, `"CPU"` for host memory.
//! - `["BlockRemoved", [name], medium]`: the block was evicted.
//! - `["AllBlocksCleared"]`: the first batch of every publisher (a router forgets what an
//!   earlier run of this instance published), and whenever the runtime says so.
//!
//! **Sequence numbers** are monotonic per publisher and start at the UNIX time in
//! microseconds, so a restarted instance never publishes a sequence number a router has
//! already seen (a router drops batches it takes for stale, the restart's
//! `AllBlocksCleared` included).
//!
//! **Replay**: a ZMQ ROUTER. A DEALER sends `[b"", start_seq as u64 big-endian]`; it
//! gets `[b"", seq, payload]` for each kept batch from `start_seq` on, then
//! `[b"", -1 as i64 big-endian, b""]`. A router that subscribes late (PUB/SUB drops what was
//! sent before it connected) sees a first sequence number above what it expected and asks for
//! the rest. The last [`REPLAY_KEEP_BYTES`] of batches are kept; what is older is gone (a
//! router then never names those blocks: no wrong fetch, only a missed one). A replay is paced
//! by the peer's socket: the replay thread sends what the peer's queue takes
//! ([`REPLAY_PEER_HWM`] batches of at most about [`BATCH_BYTES`]), and goes on from there as
//! the peer reads, however long the history, until the end marker. A peer that takes nothing
//! for [`REPLAY_STALL`] is cut (counted) and holds no more than its queue; at most
//! [`REPLAY_CURSORS`] replays run at once (a further request cuts the one idle longest), and a
//! peer that asks again restarts its replay from the new start instead of adding one. The
//! replay socket holds at most [`REPLAY_PEERS`] connections, [`REPLAY_PEERS_PER_ADDRESS`] of
//! them from one address: the ZAP handler refuses a further handshake (counted), keeping count
//! through the socket's monitor (accepted, closed), so the queues replays can leave in this
//! process are bounded as a whole, however many connections peers open.
//!
//! **Never blocking the runtime.** [`Publisher::stored`] and the others put the event into a
//! bounded queue of [`QUEUE_EVENTS`] with a non-blocking send (one allocation for a stored
//! block's tokens); a full queue drops the event and counts it. One thread drains the queue
//! into batches and publishes; ZMQ's PUB drops a batch for a subscriber [`SEND_HWM`] batches
//! behind instead of waiting for it, and such a subscriber can replay. The replay socket runs
//! on a thread of its own. An idle publisher sends an empty batch every [`IDLE_BATCH`], so
//! that a router that subscribed late finds out what it missed without waiting for this
//! instance's next request.
//!
//! **Hostile input.** Only the peers of the allowlist (the KV agent's [`PeerAllow`] rules;
//! loopback by default) get through the handshake: both sockets ask a ZAP handler of their own
//! (ZeroMQ's authentication protocol, on an in-process socket), which refuses any other address
//! and counts it. The events carry the token ids of cached prompts. Neither socket reads more
//! than [`MAX_INBOUND`] bytes per message (`ZMQ_MAXMSGSIZE`: a longer message ends that peer's
//! connection); a replay request that is not exactly the shape above is ignored.
//!
//! **Keys.** With a pre-shared key ([`EventsConfig::key`]; llama-server's
//! `--kv-events-key-file`, `KVRELAY_KV_EVENTS_KEY_FILE` in C), both sockets run ZMQ's PLAIN
//! mechanism and the ZAP handler also requires user [`PLAIN_USERNAME`] with the password
//! [`subscriber_token`]: HMAC-SHA-256 of `kvrelay-kv-events/v1 subscriber` under the key, in
//! lowercase hex (Python: `hmac.new(key, b"kvrelay-kv-events/v1 subscriber", "sha256").hexdigest()`,
//! the key's surrounding whitespace trimmed). A peer on the allowlist without the token gets
//! nothing and is counted as refused. What this protects: the token ids of cached prompts
//! from anyone who reaches the port without the token (another tenant's process on an
//! allowed host). What it does not: the libzmq built here has no CURVE (it needs libsodium),
//! so the token crosses the network in clear at each handshake and the batches are not
//! encrypted; someone who can read the traffic can read the events and replay the token. The
//! token is not the key: it cannot be turned into the key or into the KV agent's proofs, so a
//! captured token opens the event sockets only. Keep the events on a network you trust; a
//! router that cannot speak PLAIN (Dynamo's subscriber speaks NULL only) needs the key off.
//!
//! **Lifetime.** Dropping the [`Publisher`] stops and joins its threads (the publishing
//! thread sends what was queued first) and closes both sockets; it takes as long as the last
//! batch's send, never a timeout.
//!
//! ZMQ is libzmq (4.3, built from source by the `zmq` crate): it speaks ZMTP 3.1, whose
//! heartbeats (`PING`/`PONG`) Dynamo's subscriber sends every few seconds and drops a
//! publisher that does not answer.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::agent::{PeerAllow, Psk};

mod auth;
mod publish;
mod replay;

use auth::{start_zap, REPLAY_MONITOR, ZAP_DOMAIN, ZAP_DOMAIN_REPLAY};
pub use auth::{
    subscriber_token, zap_allows, ReplayPeers, PLAIN_USERNAME, REPLAY_PEERS, REPLAY_PEERS_PER_ADDRESS, TOKEN_LABEL,
};
pub use publish::encode_batch;
use publish::{publish_loop, PublishSide};
pub use replay::replay_start;
use replay::{replay_loop, Kept};

/// Events the queue between the runtime and the publishing thread holds.
pub const QUEUE_EVENTS: usize = 1 << 16;
/// Events in one batch at most.
pub const BATCH_EVENTS: usize = 512;
/// A batch is closed once its events' estimated encoding passes this many bytes, so that a
/// batch (and what a subscriber or a replay peer can have queued) is bounded in bytes however
/// many tokens a block holds.
pub const BATCH_BYTES: usize = 256 << 10;
/// Batches the replay socket queues for one peer before it stops sending to it: a peer that
/// asks and never reads holds at most this many batches (8 MiB) in this process, however many
/// requests it sends.
pub const REPLAY_PEER_HWM: i32 = 32;
/// Replays in progress at once; a further request cuts the one whose peer took nothing for
/// longest.
pub const REPLAY_CURSORS: usize = 16;
/// A replay whose peer took no batch for this long is cut (counted in `replays_cut`).
pub const REPLAY_STALL: Duration = Duration::from_secs(5);
/// Bytes of published batches kept for replay.
pub const REPLAY_KEEP_BYTES: usize = 64 << 20;
/// Batches queued for one subscriber before ZMQ drops for it (16 MiB at most: a subscriber
/// that far behind can replay what it missed).
pub const SEND_HWM: i32 = 64;
/// Largest message either socket reads (subscriptions, heartbeats, replay requests).
pub const MAX_INBOUND: i64 = 256;
/// How often an idle publisher sends an empty batch: a router that subscribed late learns
/// from it that it missed batches and asks for a replay (Dynamo asks on the first batch it
/// sees), even while this instance serves nothing.
pub const IDLE_BATCH: Duration = Duration::from_secs(1);
/// The end-of-replay marker: -1 as a big-endian i64.
pub const END_SEQ: [u8; 8] = [0xff; 8];

/// One change of the reuse cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A block was committed under `name`.
    Stored {
        /// The block's name.
        name: u64,
        /// The name of the block before it in its prompt (`None`: the first block).
        parent: Option<u64>,
        /// The block's token ids.
        tokens: Vec<u32>,
    },
    /// The block named `name` was evicted.
    Removed(u64),
    /// Everything this instance published before is gone.
    Cleared,
}

/// A publisher's counters.
#[derive(Default)]
struct Counters {
    published: AtomicU64,
    dropped: AtomicU64,
    batches: AtomicU64,
    replays: AtomicU64,
    refused: AtomicU64,
    send_errors: AtomicU64,
    replay_batches: AtomicU64,
    replays_cut: AtomicU64,
    replay_peers: AtomicU64,
    replay_peers_refused: AtomicU64,
}

/// A publisher's counters (`kvrelay_kv_events_read_stats`). Fields are only ever appended,
/// every one a `u64`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EventStats {
    /// Events published.
    pub published: u64,
    /// Events dropped because the publishing queue was full (65,536 events).
    pub dropped: u64,
    /// Batches published.
    pub batches: u64,
    /// Replay requests answered.
    pub replays: u64,
    /// Connections refused: the peer is not on the allowlist.
    pub refused: u64,
    /// Batches ZMQ refused to send (they are still kept for replay).
    pub send_errors: u64,
    /// Batches queued for replay peers.
    pub replay_batches: u64,
    /// Replays cut short: the peer took nothing for 5 s, asked again before the end, or its
    /// replay gave way to a newer one (16 run at once).
    pub replays_cut: u64,
    /// Replay connections open now (a gauge): at most 16, of which at most 4 from one address.
    /// Since 0.3.4.
    pub replay_peers: u64,
    /// Replay connections refused because those limits were reached (not counted in `refused`).
    /// Since 0.3.4.
    pub replay_peers_refused: u64,
}

/// Settings of [`Publisher::start`].
#[derive(Clone, Debug)]
pub struct EventsConfig {
    /// Where the PUB socket binds (`tcp://HOST:PORT`; port 0 picks a free one).
    pub endpoint: String,
    /// Where the replay socket binds (`None`: the PUB endpoint's host, a free port).
    pub replay_endpoint: Option<String>,
    /// The topic frame of every batch (empty by default, as vLLM sends it).
    pub topic: String,
    /// Tokens per block (`block_size` of every `BlockStored`).
    pub block_size: usize,
    /// `"GPU"` or `"CPU"`: where the blocks live.
    pub medium: String,
    /// The peers either socket accepts.
    pub allow: PeerAllow,
    /// With a key, both sockets take only peers that present its subscriber token
    /// ([`subscriber_token`], ZMQ's PLAIN mechanism, user [`PLAIN_USERNAME`]); see the module
    /// docs ("Keys") for what that protects and what it does not.
    pub key: Option<Psk>,
}

impl EventsConfig {
    /// Publish at `endpoint`: the replay socket on a free port of its host, an empty topic,
    /// `medium` `"CPU"`, loopback peers only.
    pub fn new(endpoint: &str, block_size: usize) -> EventsConfig {
        EventsConfig {
            endpoint: endpoint.into(),
            replay_endpoint: None,
            topic: String::new(),
            block_size,
            medium: "CPU".into(),
            allow: PeerAllow::loopback(),
            key: None,
        }
    }
}

/// A running KV events publisher: its bound endpoints, its queue and its threads. Every method
/// takes `&self` and is thread-safe; dropping it stops the threads (module docs, "Lifetime").
pub struct Publisher {
    tx: Option<SyncSender<Event>>,
    counters: Arc<Counters>,
    endpoint: String,
    replay_endpoint: String,
    topic: String,
    block_size: usize,
    medium: String,
    /// Stop signals of the replay and ZAP threads (in-process PAIR sockets), sent on drop.
    stops: Mutex<Vec<zmq::Socket>>,
    /// The publishing, replay and ZAP threads, in the order they are joined.
    threads: Vec<JoinHandle<()>>,
    _ctx: zmq::Context,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("endpoint", &self.endpoint)
            .field("replay_endpoint", &self.replay_endpoint)
            .finish()
    }
}

impl Publisher {
    /// Queue `e`; a full queue drops it and counts the drop.
    fn send(&self, e: Event) {
        if self.tx.as_ref().is_none_or(|tx| tx.try_send(e).is_err()) {
            self.counters.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A block was committed to the reuse cache under `name` (`parent`: the name of the block
    /// before it in its prompt, `None` for the first). Never blocks; copies `tokens`.
    pub fn stored(&self, name: u64, parent: Option<u64>, tokens: &[u32]) {
        self.send(Event::Stored { name, parent, tokens: tokens.to_vec() });
    }

    /// The block named `name` was evicted. Never blocks.
    pub fn removed(&self, name: u64) {
        self.send(Event::Removed(name));
    }

    /// Every block published before is gone (the cache was cleared). Never blocks.
    pub fn cleared(&self) {
        self.send(Event::Cleared);
    }

    /// The PUB endpoint as bound (`tcp://HOST:PORT`, the port resolved).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The replay ROUTER endpoint as bound.
    pub fn replay_endpoint(&self) -> &str {
        &self.replay_endpoint
    }

    /// The topic frame of every batch.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// `"GPU"` or `"CPU"`.
    pub fn medium(&self) -> &str {
        &self.medium
    }

    /// The counters now.
    pub fn stats(&self) -> EventStats {
        let c = &self.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        EventStats {
            published: l(&c.published),
            dropped: l(&c.dropped),
            batches: l(&c.batches),
            replays: l(&c.replays),
            refused: l(&c.refused),
            send_errors: l(&c.send_errors),
            replay_batches: l(&c.replay_batches),
            replays_cut: l(&c.replays_cut),
            replay_peers: l(&c.replay_peers),
            replay_peers_refused: l(&c.replay_peers_refused),
        }
    }

    /// The counters as Prometheus text (format 0.0.4): `{prefix}_kv_events_published_total`,
    /// `_kv_events_dropped_total`, `_kv_event_batches_total`, `_kv_event_replays_total`,
    /// `_kv_events_refused_total`, `_kv_event_send_errors_total`, `_kv_event_replay_batches_total`,
    /// `_kv_event_replays_cut_total`, `_kv_event_replay_peers_refused_total` and the gauge
    /// `_kv_event_replay_peers`.
    pub fn prometheus(&self, prefix: &str) -> String {
        use std::fmt::Write as _;
        let s = self.stats();
        let mut out = String::new();
        for (name, help, v) in [
            ("kv_events_published_total", "KV events published.", s.published),
            ("kv_events_dropped_total", "KV events dropped because the publishing queue was full.", s.dropped),
            ("kv_event_batches_total", "KV event batches published.", s.batches),
            ("kv_event_replays_total", "KV event replay requests answered.", s.replays),
            ("kv_events_refused_total", "KV events connections refused: the peer is not on the allowlist.", s.refused),
            ("kv_event_send_errors_total", "KV event batches the PUB socket refused (kept for replay).", s.send_errors),
            ("kv_event_replay_batches_total", "KV event batches queued for replay peers.", s.replay_batches),
            (
                "kv_event_replays_cut_total",
                "KV event replays cut short: the peer stopped reading, asked again or gave way.",
                s.replays_cut,
            ),
        ] {
            let _ = writeln!(out, "# HELP {prefix}_{name} {help}\n# TYPE {prefix}_{name} counter\n{prefix}_{name} {v}");
        }
        let _ = writeln!(
            out,
            "# HELP {prefix}_kv_event_replay_peers_refused_total KV event replay connections refused: {REPLAY_PEERS} open in \
             all, or {REPLAY_PEERS_PER_ADDRESS} from one address.\n# TYPE {prefix}_kv_event_replay_peers_refused_total \
             counter\n{prefix}_kv_event_replay_peers_refused_total {}",
            s.replay_peers_refused
        );
        let _ = writeln!(
            out,
            "# HELP {prefix}_kv_event_replay_peers KV event replay connections open.\n# TYPE {prefix}_kv_event_replay_peers \
             gauge\n{prefix}_kv_event_replay_peers {}",
            s.replay_peers
        );
        out
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        // the publishing thread sees the queue disconnect once it has sent what was queued
        self.tx = None;
        for s in self.stops.get_mut().unwrap_or_else(|e| e.into_inner()).iter() {
            let _ = s.send(&b""[..], 0);
        }
        // publishing and replay first, the ZAP handler last: no handshake ever meets a socket
        // without its handler
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// `tcp://HOST:PORT` with port 0 written the way libzmq binds an ephemeral port (`*`).
pub(crate) fn zmq_bind_address(endpoint: &str) -> Result<String, String> {
    let rest = endpoint.strip_prefix("tcp://").ok_or_else(|| format!("`{endpoint}`: expected tcp://HOST:PORT"))?;
    let (host, port) = rest.rsplit_once(':').ok_or_else(|| format!("`{endpoint}`: expected tcp://HOST:PORT"))?;
    if host.is_empty() {
        return Err(format!("`{endpoint}`: expected tcp://HOST:PORT"));
    }
    match port {
        "0" | "*" => Ok(format!("tcp://{host}:*")),
        p if p.parse::<u16>().is_ok() => Ok(format!("tcp://{host}:{p}")),
        _ => Err(format!("`{endpoint}`: the port is not a number")),
    }
}

fn bound(s: &zmq::Socket) -> Result<String, String> {
    match s.get_last_endpoint() {
        Ok(Ok(e)) => Ok(e),
        _ => Err("cannot read the bound endpoint".into()),
    }
}

fn now() -> (f64, u64) {
    let d = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    (d.as_secs_f64(), d.as_micros() as u64)
}

/// A PAIR socket pair on `ctx`: the end a thread polls and the end that stops it.
fn stop_pair(ctx: &zmq::Context, name: &str) -> Result<(zmq::Socket, zmq::Socket), String> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let at = format!("inproc://kvrelay-kv-events-stop-{name}-{}", NEXT.fetch_add(1, Ordering::Relaxed));
    let err = |e: zmq::Error| format!("KV events' stop signal: {e}");
    let (rx, tx) = (ctx.socket(zmq::PAIR).map_err(err)?, ctx.socket(zmq::PAIR).map_err(err)?);
    rx.bind(&at).map_err(err)?;
    tx.connect(&at).map_err(err)?;
    tx.set_linger(0).map_err(err)?;
    Ok((rx, tx))
}

impl Publisher {
    /// Bind both sockets and start the publishing, replay and ZAP threads. The first batch is
    /// `AllBlocksCleared`. Fails (saying why) for an endpoint that is not `tcp://HOST:PORT`, an
    /// address that cannot be bound or a thread that cannot start.
    pub fn start(cfg: &EventsConfig) -> Result<Publisher, String> {
        let ctx = zmq::Context::new();
        let counters = Arc::new(Counters::default());
        let mut threads = Vec::new();
        let mut stops = Vec::new();
        // the ZAP handler is bound before either socket: no handshake is ever made without it
        let (zap_stop, zap_stop_tx) = stop_pair(&ctx, "zap")?;
        let token = cfg.key.as_ref().map(subscriber_token);
        let zap = start_zap(&ctx, cfg.allow.clone(), token, counters.clone(), zap_stop)?;
        let keyed = cfg.key.is_some();
        // the replay socket names a ZAP domain of its own and is monitored (its connections are
        // counted against REPLAY_PEERS by the ZAP handler), both before it binds
        let setup = |kind: zmq::SocketType, at: &str, what: &str| -> Result<zmq::Socket, String> {
            let s = ctx.socket(kind).map_err(|e| format!("{what}: {e}"))?;
            let replay = kind == zmq::ROUTER;
            s.set_zap_domain(if replay { ZAP_DOMAIN_REPLAY } else { ZAP_DOMAIN })
                .map_err(|e| format!("{what}: {e}"))?;
            if replay {
                let events = (zmq::SocketEvent::ACCEPTED as i32) | (zmq::SocketEvent::DISCONNECTED as i32);
                s.monitor(REPLAY_MONITOR, events).map_err(|e| format!("{what}'s monitor: {e}"))?;
            }
            if keyed {
                s.set_plain_server(true).map_err(|e| format!("{what}: {e}"))?;
            }
            s.set_linger(0).map_err(|e| format!("{what}: {e}"))?;
            s.set_sndhwm(SEND_HWM).map_err(|e| format!("{what}: {e}"))?;
            s.set_maxmsgsize(MAX_INBOUND).map_err(|e| format!("{what}: {e}"))?;
            s.bind(&zmq_bind_address(at).map_err(|e| format!("{what} {e}"))?)
                .map_err(|e| format!("{what} {at}: {e}"))?;
            Ok(s)
        };
        // from here on a failure must stop the ZAP thread: `abort` does
        let abort = |e: String, zap: JoinHandle<()>, tx: &zmq::Socket| {
            let _ = tx.send(&b""[..], 0);
            let _ = zap.join();
            e
        };
        let sockets = (|| {
            let publisher = setup(zmq::PUB, &cfg.endpoint, "the KV events endpoint")?;
            let endpoint = bound(&publisher)?;
            let replay_at = match &cfg.replay_endpoint {
                Some(r) => r.clone(),
                None => {
                    let host = endpoint.trim_start_matches("tcp://").rsplit_once(':').map_or("127.0.0.1", |(h, _)| h);
                    format!("tcp://{host}:0")
                }
            };
            let replay = setup(zmq::ROUTER, &replay_at, "the KV events replay endpoint")?;
            // a full peer queue fails the send (EAGAIN) instead of dropping silently: the
            // replay is cut there and counted
            replay.set_sndhwm(REPLAY_PEER_HWM).map_err(|e| format!("the KV events replay endpoint: {e}"))?;
            replay.set_router_mandatory(true).map_err(|e| format!("the KV events replay endpoint: {e}"))?;
            let replay_endpoint = bound(&replay)?;
            let (replay_stop, replay_stop_tx) = stop_pair(&ctx, "replay")?;
            Ok::<_, String>((publisher, endpoint, replay, replay_endpoint, replay_stop, replay_stop_tx))
        })();
        let (publisher, endpoint, replay, replay_endpoint, replay_stop, replay_stop_tx) = match sockets {
            Ok(s) => s,
            Err(e) => return Err(abort(e, zap, &zap_stop_tx)),
        };

        let (tx, rx) = sync_channel(QUEUE_EVENTS);
        let kept = Arc::new(Mutex::new(Kept::default()));
        let _ = tx.try_send(Event::Cleared);
        let shared = PublishSide {
            topic: cfg.topic.clone(),
            block_size: cfg.block_size,
            medium: cfg.medium.clone(),
            counters: counters.clone(),
        };
        let spawned = (|| {
            let kept2 = kept.clone();
            let p = std::thread::Builder::new()
                .name("kv-events".into())
                .spawn(move || publish_loop(&shared, publisher, rx, &kept2))
                .map_err(|e| format!("starting the KV events thread: {e}"))?;
            let c = counters.clone();
            let r = std::thread::Builder::new()
                .name("kv-events-replay".into())
                .spawn(move || replay_loop(replay, replay_stop, &kept, &c));
            Ok::<_, String>((p, r))
        })();
        match spawned {
            Ok((p, Ok(r))) => threads.extend([p, r]),
            Ok((p, Err(e))) => {
                drop(tx);
                let _ = p.join();
                return Err(abort(format!("starting the KV events replay thread: {e}"), zap, &zap_stop_tx));
            }
            Err(e) => return Err(abort(e, zap, &zap_stop_tx)),
        }
        threads.push(zap);
        stops.extend([replay_stop_tx, zap_stop_tx]);
        Ok(Publisher {
            tx: Some(tx),
            counters,
            endpoint,
            replay_endpoint,
            topic: cfg.topic.clone(),
            block_size: cfg.block_size,
            medium: cfg.medium.clone(),
            stops: Mutex::new(stops),
            threads,
            _ctx: ctx,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    #[test]
    fn replay_peers_are_bounded_per_address_and_in_all() {
        use std::net::IpAddr;
        let ip = |i: u8| IpAddr::from([10, 0, 0, i]);
        let mut p = ReplayPeers::default();
        let mut fd = 0;
        let mut connect = |p: &mut ReplayPeers, a: IpAddr| {
            fd += 1;
            p.accepted(fd);
            (fd, p.admit(a))
        };
        // one address: REPLAY_PEERS_PER_ADDRESS connections, then no more
        let mut first = 0;
        for i in 0..REPLAY_PEERS_PER_ADDRESS {
            let (f, ok) = connect(&mut p, ip(1));
            assert!(ok, "connection {i} of one address");
            if i == 0 {
                first = f;
            }
        }
        let (refused, ok) = connect(&mut p, ip(1));
        assert!(!ok, "a further connection from one address");
        p.disconnected(refused);
        // other addresses still get in, up to REPLAY_PEERS in all
        let mut other = 2;
        while p.held() < REPLAY_PEERS {
            assert!(connect(&mut p, ip(other / 4 + 2)).1, "room for another address");
            other += 1;
        }
        assert!(!connect(&mut p, ip(200)).1, "a new address once every connection is taken");
        // a closed connection makes room, for its own address too
        p.disconnected(first);
        assert!(connect(&mut p, ip(1)).1);
        assert!(!connect(&mut p, ip(201)).1, "the room was taken again");
        // a connection accepted and never handshaken takes no room; a handshake with no
        // accepted connection behind it is refused; unknown closes are harmless
        p.accepted(5000);
        p.disconnected(5000);
        assert!(!p.admit(ip(202)));
        p.disconnected(9999);
        assert_eq!(p.held(), REPLAY_PEERS);
    }

    #[test]
    fn a_batch_encodes_as_vllm_and_dynamo_read_it() {
        // msgpack of [1.5, [["BlockStored", [1, 2**64-1], None, [1, 2, 3, 4], 4, None, None],
        // ["BlockRemoved", [7], None], ["AllBlocksCleared"]], 0] as Python's msgpack writes it,
        // except that kvrelay sends one name per BlockStored: the golden is rebuilt from two.
        let evs = [
            Event::Stored { name: 1, parent: None, tokens: vec![1, 2] },
            Event::Stored { name: u64::MAX, parent: Some(1), tokens: vec![3, 4] },
            Event::Removed(7),
            Event::Cleared,
        ];
        let got = hex(&encode_batch(1.5, &evs, 2, None, 0));
        let want = [
            "93cb3ff8000000000000", // [1.5,
            "94",                   // 4 events
            "97ab426c6f636b53746f726564",
            "9101",
            "c0",
            "920102",
            "02",
            "c0",
            "c0",
            "97ab426c6f636b53746f726564",
            "91cfffffffffffffffff",
            "01",
            "920304",
            "02",
            "c0",
            "c0",
            "93ac426c6f636b52656d6f766564",
            "9107",
            "c0",
            "91b0416c6c426c6f636b73436c6561726564",
            "00",
        ]
        .concat();
        assert_eq!(got, want);
        // the medium is a string when known
        let m = hex(&encode_batch(0.0, &[Event::Removed(7)], 2, Some("GPU"), 0));
        assert!(m.ends_with("9107a347505500"), "{m}");
    }

    #[test]
    fn replay_requests_of_another_shape_are_ignored() {
        let ok = vec![b"id".to_vec(), vec![], 5u64.to_be_bytes().to_vec()];
        assert_eq!(replay_start(&ok), Some(5));
        assert_eq!(replay_start(&[b"id".to_vec(), vec![], vec![0; 7]]), None);
        assert_eq!(replay_start(&[b"id".to_vec(), vec![1], vec![0; 8]]), None);
        assert_eq!(replay_start(&[b"id".to_vec(), vec![0; 8]]), None);
        assert_eq!(replay_start(&[]), None);
    }

    #[test]
    fn zap_admits_only_listed_addresses_of_well_formed_requests() {
        let allow = PeerAllow::loopback();
        let req = |v: &[u8], addr: &str| {
            vec![v.to_vec(), b"1".to_vec(), b"d".to_vec(), addr.as_bytes().to_vec(), vec![], b"NULL".to_vec()]
        };
        assert!(zap_allows(&req(b"1.0", "127.0.0.1"), &allow, None));
        assert!(zap_allows(&req(b"1.0", "::1"), &allow, None));
        assert!(!zap_allows(&req(b"1.0", "10.0.0.1"), &allow, None));
        assert!(!zap_allows(&req(b"1.0", "not an address"), &allow, None));
        assert!(!zap_allows(&req(b"2.0", "127.0.0.1"), &allow, None), "another ZAP version");
        assert!(!zap_allows(&req(b"1.0", "127.0.0.1")[..5], &allow, None), "too few frames");
    }

    #[test]
    fn a_keyed_zap_admits_only_the_token_over_plain_from_listed_addresses() {
        let allow = PeerAllow::loopback();
        let key = Psk::new(b"0123456789abcdef-events").unwrap();
        let token = subscriber_token(&key);
        assert_eq!(token.len(), 64);
        assert_ne!(token, subscriber_token(&Psk::new(b"0123456789abcdef-eventz").unwrap()));
        let plain = |addr: &str, user: &[u8], password: &[u8]| {
            let mut r = vec![b"1.0".to_vec(), b"1".to_vec(), b"d".to_vec(), addr.as_bytes().to_vec(), vec![]];
            r.extend([b"PLAIN".to_vec(), user.to_vec(), password.to_vec()]);
            r
        };
        let t = Some(token.as_str());
        assert!(zap_allows(&plain("127.0.0.1", b"kvrelay", token.as_bytes()), &allow, t));
        assert!(!zap_allows(&plain("10.0.0.1", b"kvrelay", token.as_bytes()), &allow, t), "an unlisted address");
        assert!(!zap_allows(&plain("127.0.0.1", b"other", token.as_bytes()), &allow, t), "another user");
        let mut wrong = token.clone().into_bytes();
        wrong[63] ^= 1;
        assert!(!zap_allows(&plain("127.0.0.1", b"kvrelay", &wrong), &allow, t), "another password");
        assert!(!zap_allows(&plain("127.0.0.1", b"kvrelay", &wrong[..63]), &allow, t), "a shorter password");
        assert!(!zap_allows(&plain("127.0.0.1", b"kvrelay", b"0123456789abcdef-events"), &allow, t), "the key itself");
        let null = vec![b"1.0".to_vec(), b"1".to_vec(), b"d".to_vec(), b"127.0.0.1".to_vec(), vec![], b"NULL".to_vec()];
        assert!(!zap_allows(&null, &allow, t), "a NULL handshake to a keyed publisher");
        assert!(
            !zap_allows(&plain("127.0.0.1", b"kvrelay", token.as_bytes()), &allow, None),
            "PLAIN to an unkeyed one"
        );
        // the token HMAC-SHA-256("kvrelay-kv-events/v1 subscriber") under the key, as Python's hmac computes it
        assert_eq!(
            subscriber_token(&Psk::new(b"0123456789abcdef").unwrap()),
            "1a6590857e2953f4a03f2aaa66ad0bf7a9b16f28be313b68cc25826bcfb296f8"
        );
    }

    #[test]
    fn bind_addresses_take_port_zero_as_any_port() {
        assert_eq!(zmq_bind_address("tcp://127.0.0.1:0").unwrap(), "tcp://127.0.0.1:*");
        assert_eq!(zmq_bind_address("tcp://*:5557").unwrap(), "tcp://*:5557");
        assert!(zmq_bind_address("ipc:///x").is_err());
        assert!(zmq_bind_address("tcp://:1").is_err());
        assert!(zmq_bind_address("tcp://h:99999").is_err());
    }

    #[test]
    fn a_publisher_binds_counts_and_stops_when_dropped() {
        let p = Publisher::start(&EventsConfig::new("tcp://127.0.0.1:0", 4)).unwrap();
        assert!(p.endpoint().starts_with("tcp://127.0.0.1:") && !p.endpoint().ends_with(":0"), "{}", p.endpoint());
        assert!(p.replay_endpoint().starts_with("tcp://127.0.0.1:"), "{}", p.replay_endpoint());
        assert_ne!(p.endpoint(), p.replay_endpoint());
        p.stored(1, None, &[1, 2, 3, 4]);
        p.removed(1);
        p.cleared();
        // dropping sends what was queued, then joins every thread (a hang here fails the test
        // by the harness's timeout)
        let counters = p.counters.clone();
        drop(p);
        // the first AllBlocksCleared and the three events above, all sent before the drop ended
        assert_eq!(counters.published.load(Ordering::Relaxed), 4);
        let text = {
            let p = Publisher::start(&EventsConfig::new("tcp://127.0.0.1:0", 4)).unwrap();
            p.prometheus("kvrelay")
        };
        assert!(text.contains("\nkvrelay_kv_events_published_total "), "{text}");
        assert!(Publisher::start(&EventsConfig::new("udp://127.0.0.1:0", 4)).is_err());
    }

    /// Wait (bounded) until `f` holds of the publisher's counters.
    fn until(p: &Publisher, what: &str, f: impl Fn(&EventStats) -> bool) -> EventStats {
        for _ in 0..60_000 {
            let s = p.stats();
            if f(&s) {
                return s;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        panic!("{what}: {:?}", p.stats());
    }

    #[test]
    fn a_replay_peer_that_never_reads_holds_a_bounded_queue_however_often_it_asks() {
        let p = Publisher::start(&EventsConfig::new("tcp://127.0.0.1:0", 16_000)).unwrap();
        // 400 blocks of 16,000 tokens above 2^16 (5 bytes each): about 80 KB an event, so
        // batches of 4 events (BATCH_BYTES) and about 100 of them kept
        let tokens: Vec<u32> = (0..16_000).map(|i| 70_000 + i).collect();
        for name in 0..400 {
            p.stored(name, None, &tokens);
        }
        let s = until(&p, "published", |s| s.published == 401);
        assert!((90..=140).contains(&s.batches), "batches are bounded in bytes: {s:?}");
        let ctx = zmq::Context::new();
        let peer = ctx.socket(zmq::DEALER).unwrap();
        peer.set_rcvhwm(1).unwrap();
        peer.set_rcvbuf(4096).unwrap();
        peer.connect(p.replay_endpoint()).unwrap();
        // five requests for everything, and never a read
        for _ in 0..5 {
            peer.send_multipart([&b""[..], &0u64.to_be_bytes()[..]], 0).unwrap();
        }
        let s = until(&p, "five replays answered", |s| s.replays == 5);
        // what this process took for the peer: its queue (REPLAY_PEER_HWM) and what the
        // kernel's socket buffers and the peer's one-message queue hold, never five full replays
        assert!(s.replay_batches < 2 * s.batches, "{s:?}");
        assert!(s.replays_cut >= 4, "each request again restarts the replay: {s:?}");
        // the last one is cut once the peer took nothing for REPLAY_STALL
        let s = until(&p, "the silent replay cut", |s| s.replays_cut >= 5);
        assert!(s.replay_batches < 2 * s.batches, "{s:?}");
        drop(peer);
    }

    #[test]
    fn a_slow_reader_replays_a_long_history_to_its_end() {
        let p = Publisher::start(&EventsConfig::new("tcp://127.0.0.1:0", 1_000)).unwrap();
        // 1,200 batches of about 5 KB (6 MB, more than the peer's queue and socket buffers take
        // at once): one block each, the next sent once the last was published
        let tokens: Vec<u32> = (0..1_000).map(|i| 70_000 + i).collect();
        for name in 0..1_200u64 {
            p.stored(name, None, &tokens);
            until(&p, "the batch published", |s| s.published == name + 2);
        }
        let batches = p.stats().batches;
        assert!(batches >= 1_200, "{batches} batches");
        let ctx = zmq::Context::new();
        let reader = ctx.socket(zmq::DEALER).unwrap();
        reader.set_rcvhwm(8).unwrap();
        reader.set_rcvbuf(4096).unwrap();
        reader.set_rcvtimeo(20_000).unwrap();
        reader.connect(p.replay_endpoint()).unwrap();
        reader.send_multipart([&b""[..], &0u64.to_be_bytes()[..]], 0).unwrap();
        // read slowly: a pause every 50 batches lets the replay fill this peer's queue again
        // and again, where before it was cut at the first full queue
        let (mut seqs, mut stored) = (Vec::new(), 0u64);
        loop {
            let m = reader.recv_multipart(0).expect("a replay answer within 20 s");
            assert_eq!(m.len(), 3);
            if m[1] == END_SEQ {
                break;
            }
            seqs.push(u64::from_be_bytes(m[1][..].try_into().unwrap()));
            stored += m[2].windows(11).filter(|w| w == b"BlockStored").count() as u64;
            if seqs.len() % 50 == 0 {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        assert!(seqs.len() as u64 >= batches, "{} of {batches} batches", seqs.len());
        assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "in order, none missing");
        assert_eq!(stored, 1_200, "every block of the history");
        let s = p.stats();
        assert_eq!((s.replays, s.replays_cut), (1, 0), "{s:?}");
    }
}
