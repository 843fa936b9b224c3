//! KV events for routers (`--kv-events-endpoint`): what this instance's reuse cache holds,
//! published the way vLLM publishes it and Dynamo's KV router consumes it.
//!
//! **Wire.** A ZMQ PUB socket (bound; subscribers connect) sends one three-frame message per
//! batch: `[topic, seq as u64 big-endian, msgpack([ts, [event, ...], dp_rank])]`, with `ts`
//! the UNIX time in seconds (f64), `dp_rank` 0, and each event a tagged array:
//! - `["BlockStored", [name], parent_name | nil, [token ids], block_size, nil, medium]`: a
//!   block was committed to the reuse cache (by a prefill or a verified fetch). `name` is the
//!   block's kvrelay name (SPEC section 8), the key the KV agent serves it under, so the
//!   `block_hashes` of a hint a router builds from these events name exactly what a fetch
//!   asks this instance for. `nil` is the LoRA id (kvrelay names carry none here); `medium`
//!   is `"GPU"` for a device pool, `"CPU"` for host memory.
//! - `["BlockRemoved", [name], medium]`: the block was evicted.
//! - `["AllBlocksCleared"]`: the first batch of every run (a router forgets what an earlier
//!   run of this instance published).
//!
//! **Sequence numbers** are monotonic per endpoint and start at the UNIX time in
//! microseconds, so a restarted instance never publishes a sequence number a router has
//! already seen (a router drops batches it takes for stale, the restart's
//! `AllBlocksCleared` included).
//!
//! **Replay** (`--kv-events-replay-endpoint`): a ZMQ ROUTER socket. A DEALER sends
//! `[b"", start_seq as u64 big-endian]`; it gets `[b"", seq, payload]` for each kept batch
//! from `start_seq` on, then `[b"", -1 as i64 big-endian, b""]`. A router that subscribes
//! late (PUB/SUB drops what was sent before it connected) sees a first sequence number above
//! what it expected and asks for the rest. The last [`REPLAY_KEEP_BYTES`] of batches are
//! kept; what is older is gone (a router then never names those blocks: no wrong fetch, only
//! a missed one).
//!
//! **Never blocking a request.** Events go from the cache (under its mutex, so in the
//! cache's order) into a bounded queue of [`QUEUE_EVENTS`] with a non-blocking send; a full
//! queue drops the event and counts it (`kvrelay_server_kv_events_dropped_total`). One
//! thread drains the queue into batches and publishes; ZMQ's PUB drops a batch for a
//! subscriber [`SEND_HWM`] batches behind instead of waiting for it, and such a subscriber
//! can replay. The replay socket runs on a thread of its own. An idle publisher sends an empty
//! batch every [`IDLE_BATCH`], so that a router that subscribed late finds out what it missed
//! without waiting for this instance's next request.
//!
//! **Hostile input.** Only the peers of `--kv-peer-allow` (the KV service's allowlist, the
//! library's [`PeerAllow`] rules; loopback by default) get through the handshake: both
//! sockets ask a ZAP handler of their own (ZeroMQ's authentication protocol, on an in-process
//! socket), which refuses any other address and counts it
//! (`kvrelay_server_kv_events_refused_total`). The events carry the token ids of cached
//! prompts. Neither socket reads more than [`MAX_INBOUND`] bytes per message
//! (`ZMQ_MAXMSGSIZE`: a longer message ends that peer's connection); a replay request that
//! is not exactly the shape above is ignored.
//!
//! ZMQ is libzmq (4.3, built from source by the `zmq` crate): it speaks ZMTP 3.1, whose
//! heartbeats (`PING`/`PONG`) Dynamo's subscriber sends every few seconds and drops a
//! publisher that does not answer.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvrelay::agent::PeerAllow;

/// Events the queue between the cache and the publishing thread holds.
pub const QUEUE_EVENTS: usize = 1 << 16;
/// Events in one batch at most.
pub const BATCH_EVENTS: usize = 512;
/// Bytes of published batches kept for replay.
pub const REPLAY_KEEP_BYTES: usize = 64 << 20;
/// Batches queued for one subscriber (or one replay peer) before ZMQ drops for it.
pub const SEND_HWM: i32 = 100_000;
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

/// Where the cache sends its events: a bounded queue that never blocks.
pub struct EventSink {
    tx: SyncSender<Event>,
    stats: Arc<EventStats>,
}

impl EventSink {
    /// A sink into a queue of `capacity` events and the queue's other end (tests).
    #[cfg(test)]
    pub fn channel(capacity: usize) -> (EventSink, Receiver<Event>, Arc<EventStats>) {
        let (tx, rx) = sync_channel(capacity);
        let stats = Arc::new(EventStats::default());
        (EventSink { tx, stats: stats.clone() }, rx, stats)
    }

    /// Queue `e`; a full queue drops it and counts the drop.
    pub fn send(&self, e: Event) {
        match self.tx.try_send(e) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.stats.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// Counters for `/metrics` and `/v1/kv/info`.
#[derive(Default)]
pub struct EventStats {
    /// Events published.
    pub published: AtomicU64,
    /// Events dropped because the queue was full.
    pub dropped: AtomicU64,
    /// Batches published.
    pub batches: AtomicU64,
    /// Replay requests answered.
    pub replays: AtomicU64,
    /// Connections refused: the peer is not on the allowlist.
    pub refused: AtomicU64,
}

/// The running publisher: its bound endpoints and counters.
pub struct KvEvents {
    /// The PUB endpoint as bound (`tcp://HOST:PORT`, the port resolved).
    pub endpoint: String,
    /// The replay ROUTER endpoint as bound.
    pub replay_endpoint: String,
    /// The topic frame of every batch.
    pub topic: String,
    /// Tokens per block (`block_size` of every `BlockStored`).
    pub block_size: usize,
    /// `"GPU"` or `"CPU"`.
    pub medium: &'static str,
    /// Counters.
    pub stats: Arc<EventStats>,
}

impl KvEvents {
    /// Append this publisher's series to a Prometheus text exposition.
    pub fn prometheus(&self, out: &mut String) {
        use std::fmt::Write as _;
        let s = &self.stats;
        for (name, help, v) in [
            ("kvrelay_server_kv_events_published_total", "KV events published.", &s.published),
            (
                "kvrelay_server_kv_events_dropped_total",
                "KV events dropped because the publishing queue was full.",
                &s.dropped,
            ),
            ("kvrelay_server_kv_event_batches_total", "KV event batches published.", &s.batches),
            ("kvrelay_server_kv_event_replays_total", "KV event replay requests answered.", &s.replays),
            (
                "kvrelay_server_kv_events_refused_total",
                "KV events connections refused: the peer is not on --kv-peer-allow.",
                &s.refused,
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}", v.load(Ordering::Relaxed));
        }
    }

    /// What `/v1/kv/info` shows of the publisher.
    pub fn info(&self) -> serde_json::Value {
        serde_json::json!({
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "topic": self.topic,
            "block_size": self.block_size,
            "medium": self.medium,
            "published": self.stats.published.load(Ordering::Relaxed),
            "dropped": self.stats.dropped.load(Ordering::Relaxed),
        })
    }
}

/// Settings of [`KvEvents::start`].
pub struct EventsConfig<'a> {
    /// Where the PUB socket binds (`tcp://HOST:PORT`; port 0 picks a free one).
    pub endpoint: &'a str,
    /// Where the replay socket binds (`None`: the PUB endpoint's host, a free port).
    pub replay_endpoint: Option<&'a str>,
    /// Tokens per block.
    pub block_size: usize,
    /// `"GPU"` or `"CPU"`.
    pub medium: &'static str,
    /// The peers either socket accepts.
    pub allow: PeerAllow,
}

/// Replayable batches: `(seq, payload)` in order, at most [`REPLAY_KEEP_BYTES`] of payloads.
#[derive(Default)]
struct Kept {
    batches: VecDeque<(u64, Arc<[u8]>)>,
    bytes: usize,
}

impl Kept {
    fn push(&mut self, seq: u64, payload: Arc<[u8]>, keep_bytes: usize) {
        self.bytes += payload.len();
        self.batches.push_back((seq, payload));
        while self.bytes > keep_bytes && self.batches.len() > 1 {
            let (_, old) = self.batches.pop_front().expect("more than one batch");
            self.bytes -= old.len();
        }
    }

    /// The kept batches from `start` on (cheap clones of the payloads).
    fn since(&self, start: u64) -> Vec<(u64, Arc<[u8]>)> {
        let first = self.batches.partition_point(|(s, _)| *s < start);
        self.batches.iter().skip(first).cloned().collect()
    }
}

/// `tcp://HOST:PORT` with port 0 written the way libzmq binds an ephemeral port (`*`).
fn zmq_bind_address(endpoint: &str) -> Result<String, String> {
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

impl KvEvents {
    /// Bind both sockets and start the publishing and replay threads; returns the publisher
    /// and the sink the cache sends to. The first batch is `AllBlocksCleared`.
    pub fn start(cfg: &EventsConfig<'_>) -> Result<(Arc<KvEvents>, EventSink), String> {
        let ctx = zmq::Context::new();
        let stats = Arc::new(EventStats::default());
        // the handler is bound before either socket: no handshake is ever made without it
        start_zap(&ctx, cfg.allow.clone(), stats.clone())?;
        let setup = |kind: zmq::SocketType, at: &str, what: &str| -> Result<zmq::Socket, String> {
            let s = ctx.socket(kind).map_err(|e| format!("{what}: {e}"))?;
            s.set_zap_domain(ZAP_DOMAIN).map_err(|e| format!("{what}: {e}"))?;
            s.set_linger(0).map_err(|e| format!("{what}: {e}"))?;
            s.set_sndhwm(SEND_HWM).map_err(|e| format!("{what}: {e}"))?;
            s.set_maxmsgsize(MAX_INBOUND).map_err(|e| format!("{what}: {e}"))?;
            s.bind(&zmq_bind_address(at).map_err(|e| format!("{what} {e}"))?)
                .map_err(|e| format!("{what} {at}: {e}"))?;
            Ok(s)
        };
        let publisher = setup(zmq::PUB, cfg.endpoint, "--kv-events-endpoint")?;
        let endpoint = bound(&publisher)?;
        let replay_at = match cfg.replay_endpoint {
            Some(r) => r.to_string(),
            None => {
                let host = endpoint.trim_start_matches("tcp://").rsplit_once(':').map_or("127.0.0.1", |(h, _)| h);
                format!("tcp://{host}:0")
            }
        };
        let replay = setup(zmq::ROUTER, &replay_at, "--kv-events-replay-endpoint")?;
        let replay_endpoint = bound(&replay)?;

        let (tx, rx) = sync_channel(QUEUE_EVENTS);
        let kept = Arc::new(Mutex::new(Kept::default()));
        let events = Arc::new(KvEvents {
            endpoint,
            replay_endpoint,
            topic: String::new(),
            block_size: cfg.block_size,
            medium: cfg.medium,
            stats: stats.clone(),
        });
        let sink = EventSink { tx, stats: stats.clone() };
        sink.send(Event::Cleared);
        {
            let (ev, kept) = (events.clone(), kept.clone());
            std::thread::Builder::new()
                .name("kv-events".into())
                .spawn(move || publish_loop(&ev, publisher, rx, &kept))
                .map_err(|e| format!("starting the KV events thread: {e}"))?;
        }
        {
            let stats = stats.clone();
            std::thread::Builder::new()
                .name("kv-events-replay".into())
                .spawn(move || replay_loop(replay, &kept, &stats))
                .map_err(|e| format!("starting the KV events replay thread: {e}"))?;
        }
        // the context stays alive with its sockets (each thread owns one until the process ends)
        std::mem::forget(ctx);
        Ok((events, sink))
    }
}

/// The ZAP domain both sockets name (a NULL-mechanism socket asks ZAP only when it has one).
const ZAP_DOMAIN: &str = "kvrelay-kv-events";

/// Answer ZeroMQ's authentication requests (ZAP 1.0, `inproc://zeromq.zap.01` of `ctx`) from a
/// thread of its own: a peer whose address `allow` admits gets `200`, any other `400`.
fn start_zap(ctx: &zmq::Context, allow: PeerAllow, stats: Arc<EventStats>) -> Result<(), String> {
    let s = ctx.socket(zmq::REP).map_err(|e| format!("KV events' ZAP handler: {e}"))?;
    s.bind("inproc://zeromq.zap.01").map_err(|e| format!("KV events' ZAP handler: {e}"))?;
    std::thread::Builder::new()
        .name("kv-events-zap".into())
        .spawn(move || loop {
            let req = match s.recv_multipart(0) {
                Ok(r) => r,
                Err(zmq::Error::EINTR) => continue,
                Err(_) => return,
            };
            let ok = zap_allows(&req, &allow);
            if !ok {
                stats.refused.fetch_add(1, Ordering::Relaxed);
            }
            let id = req.get(1).map_or(&[][..], |v| &v[..]);
            let (code, text): (&[u8], &[u8]) = if ok { (b"200", b"OK") } else { (b"400", b"peer not allowed") };
            if s.send_multipart([&b"1.0"[..], id, code, text, b"", b""], 0).is_err() {
                return;
            }
        })
        .map_err(|e| format!("starting the KV events' ZAP thread: {e}"))?;
    Ok(())
}

/// Whether a ZAP request `[version, request id, domain, address, identity, mechanism, ...]`
/// comes from an address `allow` admits.
pub fn zap_allows(req: &[Vec<u8>], allow: &PeerAllow) -> bool {
    match req {
        [version, _id, _domain, address, _identity, _mechanism, ..] if version == b"1.0" => {
            std::str::from_utf8(address).ok().and_then(|a| a.parse().ok()).is_some_and(|ip| allow.allows(ip))
        }
        _ => false,
    }
}

/// Drain the queue into batches and publish them until every sink is gone; an idle
/// publisher sends an empty batch every [`IDLE_BATCH`].
fn publish_loop(ev: &KvEvents, s: zmq::Socket, rx: Receiver<Event>, kept: &Mutex<Kept>) {
    let (_, mut seq) = now();
    let mut batch = Vec::with_capacity(BATCH_EVENTS);
    loop {
        batch.clear();
        match rx.recv_timeout(IDLE_BATCH) {
            Ok(first) => batch.push(first),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
        }
        while !batch.is_empty() && batch.len() < BATCH_EVENTS {
            match rx.try_recv() {
                Ok(e) => batch.push(e),
                Err(_) => break,
            }
        }
        let (ts, _) = now();
        let payload: Arc<[u8]> = encode_batch(ts, &batch, ev.block_size, Some(ev.medium), 0).into();
        let sent = s.send_multipart([ev.topic.as_bytes(), &seq.to_be_bytes()[..], &payload[..]], 0);
        if let Err(e) = sent {
            tracing::warn!("publishing KV events: {e}");
        }
        // counted before it can be replayed: a batch a replay returns is always counted
        ev.stats.published.fetch_add(batch.len() as u64, Ordering::Relaxed);
        ev.stats.batches.fetch_add(1, Ordering::Relaxed);
        kept.lock().unwrap_or_else(|e| e.into_inner()).push(seq, payload, REPLAY_KEEP_BYTES);
        seq += 1;
    }
}

/// Answer replay requests until the socket fails.
fn replay_loop(s: zmq::Socket, kept: &Mutex<Kept>, stats: &EventStats) {
    loop {
        let msg = match s.recv_multipart(0) {
            Ok(m) => m,
            Err(zmq::Error::EINTR) => continue,
            Err(_) => return,
        };
        let Some(start) = replay_start(&msg) else { continue };
        let id = &msg[0];
        let batches = kept.lock().unwrap_or_else(|e| e.into_inner()).since(start);
        for (seq, payload) in &batches {
            if s.send_multipart([&id[..], b"", &seq.to_be_bytes()[..], &payload[..]], zmq::DONTWAIT).is_err() {
                break;
            }
        }
        let _ = s.send_multipart([&id[..], b"", &END_SEQ[..], b""], zmq::DONTWAIT);
        stats.replays.fetch_add(1, Ordering::Relaxed);
    }
}

/// The start sequence number of a replay request `[id, b"", seq BE]` (anything else: `None`).
pub fn replay_start(msg: &[Vec<u8>]) -> Option<u64> {
    match msg {
        [_id, empty, seq] if empty.is_empty() && seq.len() == 8 => {
            Some(u64::from_be_bytes(seq[..].try_into().expect("8 bytes")))
        }
        _ => None,
    }
}

/// The msgpack payload of one batch: `[ts, [event, ...], dp_rank]`.
pub fn encode_batch(ts: f64, events: &[Event], block_size: usize, medium: Option<&str>, dp_rank: u32) -> Vec<u8> {
    use rmp::encode::{write_array_len, write_f64, write_nil, write_str, write_uint};
    let mut b = Vec::with_capacity(16 + events.len() * 64);
    // writes into a Vec cannot fail
    let _ = write_array_len(&mut b, 3);
    let _ = write_f64(&mut b, ts);
    let _ = write_array_len(&mut b, events.len() as u32);
    let medium_of = |b: &mut Vec<u8>| match medium {
        Some(m) => drop(write_str(b, m)),
        None => drop(write_nil(b)),
    };
    for e in events {
        match e {
            Event::Stored { name, parent, tokens } => {
                let _ = write_array_len(&mut b, 7);
                let _ = write_str(&mut b, "BlockStored");
                let _ = write_array_len(&mut b, 1);
                let _ = write_uint(&mut b, *name);
                match parent {
                    Some(p) => drop(write_uint(&mut b, *p)),
                    None => drop(write_nil(&mut b)),
                }
                let _ = write_array_len(&mut b, tokens.len() as u32);
                for &t in tokens {
                    let _ = write_uint(&mut b, t.into());
                }
                let _ = write_uint(&mut b, block_size as u64);
                let _ = write_nil(&mut b);
                medium_of(&mut b);
            }
            Event::Removed(name) => {
                let _ = write_array_len(&mut b, 3);
                let _ = write_str(&mut b, "BlockRemoved");
                let _ = write_array_len(&mut b, 1);
                let _ = write_uint(&mut b, *name);
                medium_of(&mut b);
            }
            Event::Cleared => {
                let _ = write_array_len(&mut b, 1);
                let _ = write_str(&mut b, "AllBlocksCleared");
            }
        }
    }
    let _ = write_uint(&mut b, dp_rank.into());
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
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
    fn replay_keeps_the_newest_bytes_and_answers_from_a_sequence_number() {
        let mut k = Kept::default();
        for seq in 10..20u64 {
            k.push(seq, vec![0u8; 100].into(), 350);
        }
        let seqs: Vec<u64> = k.since(0).iter().map(|(s, _)| *s).collect();
        assert_eq!(seqs, [17, 18, 19], "the oldest batches went first");
        assert_eq!(k.bytes, 300);
        let seqs: Vec<u64> = k.since(19).iter().map(|(s, _)| *s).collect();
        assert_eq!(seqs, [19]);
        assert!(k.since(20).is_empty());
        // one batch larger than the budget is still kept (the newest)
        k.push(20, vec![0u8; 1000].into(), 350);
        assert_eq!(k.since(0).len(), 1);
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
        assert!(zap_allows(&req(b"1.0", "127.0.0.1"), &allow));
        assert!(zap_allows(&req(b"1.0", "::1"), &allow));
        assert!(!zap_allows(&req(b"1.0", "10.0.0.1"), &allow));
        assert!(!zap_allows(&req(b"1.0", "not an address"), &allow));
        assert!(!zap_allows(&req(b"2.0", "127.0.0.1"), &allow), "another ZAP version");
        assert!(!zap_allows(&req(b"1.0", "127.0.0.1")[..5], &allow), "too few frames");
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
    fn a_full_queue_drops_and_counts_instead_of_blocking() {
        let (sink, rx, stats) = EventSink::channel(2);
        for n in 0..5 {
            sink.send(Event::Removed(n));
        }
        assert_eq!(stats.dropped.load(Ordering::Relaxed), 3);
        assert_eq!(rx.try_recv().unwrap(), Event::Removed(0));
        assert_eq!(rx.try_recv().unwrap(), Event::Removed(1));
    }
}
