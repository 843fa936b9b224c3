//! The embedded TCP transport: framed, versioned, MessagePack control and raw block bytes.
//!
//! Every frame is a 12-byte header — magic `KVRX`, version 1, kind, two reserved zero bytes,
//! payload length (u32 LE) — then the payload. Kinds:
//! - `HELLO` (destination -> source, MessagePack): `{fingerprint, names}`;
//! - `OFFER` (source -> destination, MessagePack): `{fingerprint, count, block_bytes}`: the
//!   source holds the first `count` names (a leading run) and pins those blocks (they cannot be
//!   evicted) until it has sent them;
//! - `BLOCK` (source -> destination, raw): name (u64 LE), XXH3-64 of the bytes (u64 LE), then
//!   exactly `block_bytes` bytes; one per offered block, in order;
//! - `REFUSE` (either way, MessagePack): `{reason, message}`;
//! - `DONE`, `READY`, `ACK` (kinds 5-7): the in-place reads of the NIXL transport (its module
//!   documents them).
//!
//! A destination that reads the blocks out of the source's registered memory itself (the NIXL
//! transport) says so in its hello (`nixl: true`); the source then answers with an offer that
//! also carries where each block lies and its recorded checksum (`nixl`, see
//! [`InPlaceOffer`]), sends no `BLOCK` frames, and keeps the blocks pinned until `DONE`, the end
//! of the connection or [`total_deadline`]. A source without an in-place service refuses it
//! (`transport_unavailable`).
//!
//! Limits on every read: control frames at most [`MAX_CONTROL`] bytes, block frames exactly
//! 16 + `block_bytes`, at most [`MAX_BLOCKS`] names per request, a deadline per read
//! ([`READ_TIMEOUT`]) and per transfer ([`total_deadline`]), connect within
//! [`CONNECT_TIMEOUT`]. The service accepts peers from its allowlist only and serves at most
//! [`MAX_CONNECTIONS`] at once; connections that have not sent their hello are bounded apart
//! ([`MAX_PENDING`], [`HELLO_TIMEOUT`]) and one address holds at most [`MAX_PER_PEER`].

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use xxhash_rust::xxh3::xxh3_64;

use super::{BlockSink, BoxFuture, Destination, FailReason, FetchError, Fingerprint, Transport};
use crate::engine::Engine;

const MAGIC: &[u8; 4] = b"KVRX";
const VERSION: u8 = 1;
const HELLO: u8 = 1;
pub(super) const OFFER: u8 = 2;
const BLOCK: u8 = 3;
const REFUSE: u8 = 4;

/// Largest control frame.
pub const MAX_CONTROL: usize = 16 << 20;
/// Most names in one request.
pub const MAX_BLOCKS: usize = 1 << 20;
/// Connect deadline.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Deadline of every read and write.
pub const READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections the service serves at once (after their hello).
pub const MAX_CONNECTIONS: usize = 64;
/// Connections that have not sent their hello yet, bounded apart from the serving slots.
pub const MAX_PENDING: usize = 32;
/// Connections one peer address may hold, pending and serving together.
pub const MAX_PER_PEER: usize = 8;
/// Time a new connection has to send its hello.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(2);

/// The whole transfer's deadline: 10 s plus 1 s per 100 MB.
pub fn total_deadline(bytes: usize) -> Duration {
    Duration::from_secs(10) + Duration::from_secs_f64(bytes as f64 / 100e6)
}

/// Run one transfer under its total deadline (both transports): running past it fails it as
/// a `Timeout`.
pub async fn within_deadline(
    deadline: Duration,
    transfer: impl std::future::Future<Output = Result<usize, FetchError>>,
) -> Result<usize, FetchError> {
    match tokio::time::timeout(deadline, transfer).await {
        Ok(r) => r,
        Err(_) => Err(FetchError::new(FailReason::Timeout, "the transfer ran past its total deadline")),
    }
}

#[derive(Serialize, Deserialize)]
pub struct Hello {
    pub fingerprint: Fingerprint,
    pub names: Vec<u64>,
    /// The reader pulls the blocks itself (in place); absent in a plain hello.
    #[serde(default)]
    pub nixl: bool,
    /// ... out of pinned staging slots the source fills through its copy engine, rather than
    /// out of the pool.
    #[serde(default)]
    pub staged: bool,
}

#[derive(Serialize, Deserialize)]
pub struct Offer {
    pub fingerprint: Fingerprint,
    pub count: u64,
    pub block_bytes: u64,
    /// Where the offered blocks lie, for a reader that pulls them itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nixl: Option<InPlaceOffer>,
}

/// What a source tells a reader that pulls blocks out of its registered memory.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct InPlaceOffer {
    /// The source's NIXL agent name.
    pub agent: String,
    /// The source agent's metadata (connection info and registered memory), loaded by the
    /// reader once per agent.
    pub metadata: Vec<u8>,
    /// CUDA device of the registered memory (`None`: host memory).
    pub device: Option<u64>,
    /// `(address, length)` of each offered block, in order (empty when staged).
    pub regions: Vec<(u64, u64)>,
    /// Staged: `(address, length)` of the source's staging slots; chunk `c` of the run (
    /// `chunk_blocks` blocks) is announced in slot `c % slots.len()` by a `READY` frame.
    #[serde(default)]
    pub slots: Vec<(u64, u64)>,
    /// Staged: blocks per chunk.
    #[serde(default)]
    pub chunk_blocks: u64,
    /// XXH3-64 of each offered block's bytes, recorded when it was written.
    pub sums: Vec<u64>,
}

#[derive(Serialize, Deserialize)]
pub struct Refuse {
    pub reason: String,
    pub message: String,
}

/// A service that lets readers pull pinned blocks out of this instance's memory themselves
/// (the NIXL transport's source side).
pub trait InPlaceSource: Send + Sync {
    /// Serve one reader whose hello (`hello`, fingerprint checked) asked for in-place reads:
    /// offer the blocks of `lease` (pinned, the leading run held here), serve them, and keep
    /// them pinned until the reader is done. `Err` is a refusal sent before any offer.
    fn serve<'a>(
        &'a self,
        s: &'a mut TcpStream,
        hello: &'a Hello,
        lease: crate::cache::Lease,
        fault: Fault,
        stats: &'a ServiceStats,
    ) -> BoxFuture<'a, Result<(), Refuse>>;
}

/// `tcp://host:port` -> a socket address, resolved on the runtime's resolver (never a blocking
/// lookup on an async worker).
pub async fn socket_addr(endpoint: &str) -> Option<SocketAddr> {
    tokio::net::lookup_host(endpoint.strip_prefix("tcp://")?).await.ok()?.next()
}

pub(super) fn header(kind: u8, len: usize) -> [u8; 12] {
    let mut h = [0u8; 12];
    h[..4].copy_from_slice(MAGIC);
    h[4] = VERSION;
    h[5] = kind;
    h[8..].copy_from_slice(&(len as u32).to_le_bytes());
    h
}

fn io_err(e: std::io::Error) -> FetchError {
    match e.kind() {
        std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe => {
            FetchError::new(FailReason::Truncated, format!("the stream ended early: {e}"))
        }
        std::io::ErrorKind::TimedOut => FetchError::new(FailReason::Timeout, "a read ran past its deadline"),
        _ => FetchError::new(FailReason::Truncated, format!("i/o: {e}")),
    }
}

pub(super) async fn timed<T>(f: impl std::future::Future<Output = std::io::Result<T>>) -> Result<T, FetchError> {
    match tokio::time::timeout(READ_TIMEOUT, f).await {
        Ok(r) => r.map_err(io_err),
        Err(_) => Err(FetchError::new(FailReason::Timeout, "a read or write ran past its deadline")),
    }
}

/// Read one frame header: `(kind, len)`, checked against `max`.
pub(super) async fn read_header(s: &mut TcpStream, max: usize) -> Result<(u8, usize), FetchError> {
    let mut h = [0u8; 12];
    timed(s.read_exact(&mut h)).await?;
    if &h[..4] != MAGIC || h[4] != VERSION {
        return Err(FetchError::new(FailReason::Corrupt, "not a kvrelay KV frame (magic or version)"));
    }
    let len = u32::from_le_bytes([h[8], h[9], h[10], h[11]]) as usize;
    if len > max {
        return Err(FetchError::new(FailReason::Corrupt, format!("a frame of {len} bytes (limit {max})")));
    }
    Ok((h[5], len))
}

pub(super) async fn read_control<T: for<'de> Deserialize<'de>>(
    s: &mut TcpStream,
    buf: &mut Vec<u8>,
    len: usize,
) -> Result<T, FetchError> {
    buf.resize(len, 0);
    timed(s.read_exact(buf)).await?;
    rmp_serde::from_slice(buf).map_err(|_| FetchError::new(FailReason::Corrupt, "a control frame does not decode"))
}

pub(super) async fn write_control<T: Serialize>(s: &mut TcpStream, kind: u8, v: &T) -> Result<(), FetchError> {
    let body = rmp_serde::to_vec_named(v).map_err(|e| FetchError::new(FailReason::Corrupt, e.to_string()))?;
    let mut frame = header(kind, body.len()).to_vec();
    frame.extend_from_slice(&body);
    timed(s.write_all(&frame)).await
}

fn refused(r: Refuse) -> FetchError {
    let reason = if r.reason == "fingerprint_mismatch" { FailReason::FingerprintMismatch } else { FailReason::Refused };
    FetchError::new(reason, format!("the source refused: {} ({})", r.reason, r.message))
}

/// Connect to `endpoint`, send `hello` and read the source's offer (or refusal); the offer is
/// checked against the hello (fingerprint, at most as many blocks as asked, `block_bytes`).
pub(super) async fn ask(endpoint: &str, hello: &Hello, block_bytes: usize) -> Result<(TcpStream, Offer), FetchError> {
    let addr = socket_addr(endpoint)
        .await
        .ok_or_else(|| FetchError::new(FailReason::Connect, "the endpoint does not resolve"))?;
    let mut s = match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return Err(FetchError::new(FailReason::Connect, format!("connect: {e}"))),
        Err(_) => return Err(FetchError::new(FailReason::Timeout, "connect ran past its deadline")),
    };
    let _ = s.set_nodelay(true);
    write_control(&mut s, HELLO, hello).await?;
    let mut buf = Vec::new();
    let (kind, len) = read_header(&mut s, MAX_CONTROL).await?;
    match kind {
        REFUSE => return Err(refused(read_control(&mut s, &mut buf, len).await?)),
        OFFER => {}
        _ => return Err(FetchError::new(FailReason::Corrupt, "expected an offer")),
    }
    let offer: Offer = read_control(&mut s, &mut buf, len).await?;
    if offer.fingerprint != hello.fingerprint {
        return Err(FetchError::new(FailReason::FingerprintMismatch, "the source's layout differs"));
    }
    if offer.count as usize > hello.names.len() || offer.block_bytes as usize != block_bytes {
        return Err(FetchError::new(FailReason::Corrupt, "the offer does not match the request"));
    }
    Ok((s, offer))
}

/// A received block being checksummed and committed on a blocking thread: its buffer comes
/// back with the result.
type Checking = tokio::task::JoinHandle<(Vec<u8>, Result<(), FetchError>)>;

/// The destination side.
pub struct TcpTransport {
    fingerprint: Fingerprint,
    block_bytes: usize,
}

impl TcpTransport {
    /// A client for this instance's layout.
    pub fn new(fingerprint: Fingerprint, block_bytes: usize) -> TcpTransport {
        TcpTransport { fingerprint, block_bytes }
    }

    async fn pull(&self, endpoint: &str, names: &[u64], sink: BlockSink) -> Result<usize, FetchError> {
        let hello = Hello { fingerprint: self.fingerprint.clone(), names: names.to_vec(), nixl: false, staged: false };
        let (mut s, offer) = ask(endpoint, &hello, self.block_bytes).await?;
        let count = offer.count as usize;
        // Pipelined: block i is read from the socket while block i-1 is checksummed and
        // handed to the sink on a blocking thread; blocks still reach the sink in order.
        let frame = 16 + self.block_bytes;
        let mut spare: Vec<Vec<u8>> = vec![vec![0u8; frame], vec![0u8; frame]];
        let mut pending: Option<Checking> = None;
        let r = self.pull_blocks(&mut s, names, count, frame, &sink, &mut spare, &mut pending).await;
        // Let a block in flight finish either way: what it commits is complete and verified.
        if let Some(h) = pending.take() {
            let last = h.await.map_err(|e| FetchError::new(FailReason::Corrupt, e.to_string())).and_then(|(_, r)| r);
            r?;
            last?;
            return Ok(count);
        }
        r.map(|()| count)
    }

    #[allow(clippy::too_many_arguments)]
    async fn pull_blocks(
        &self,
        s: &mut TcpStream,
        names: &[u64],
        count: usize,
        frame: usize,
        sink: &BlockSink,
        spare: &mut Vec<Vec<u8>>,
        pending: &mut Option<Checking>,
    ) -> Result<(), FetchError> {
        for (i, &want) in names.iter().enumerate().take(count) {
            let mut buf = spare.pop().unwrap_or_else(|| vec![0u8; frame]);
            let (kind, len) = read_header(s, frame).await?;
            if kind == REFUSE {
                return Err(FetchError::new(FailReason::Refused, "the source stopped the transfer"));
            }
            if kind != BLOCK || len != frame {
                return Err(FetchError::new(
                    FailReason::Corrupt,
                    format!("block {i}: a frame of kind {kind}, {len} bytes"),
                ));
            }
            timed(s.read_exact(&mut buf[..frame])).await?;
            let name = u64::from_le_bytes(buf[..8].try_into().expect("8 bytes"));
            if name != want {
                return Err(FetchError::new(FailReason::Corrupt, format!("block {i}: another name than asked")));
            }
            if let Some(h) = pending.take() {
                let (b, r) = h.await.map_err(|e| FetchError::new(FailReason::Corrupt, e.to_string()))?;
                r?;
                spare.push(b);
            }
            let sink = sink.clone();
            *pending = Some(tokio::task::spawn_blocking(move || {
                let sum = u64::from_le_bytes(buf[8..16].try_into().expect("8 bytes"));
                let data = &buf[16..];
                let r = if xxh3_64(data) != sum {
                    Err(FetchError::new(FailReason::Corrupt, format!("block {i}: checksum mismatch")))
                } else {
                    sink(i, data)
                };
                (buf, r)
            }));
        }
        Ok(())
    }
}

impl Transport for TcpTransport {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn fetch<'a>(
        &'a self,
        endpoint: &'a str,
        names: &'a [u64],
        dest: Destination,
    ) -> BoxFuture<'a, Result<usize, FetchError>> {
        Box::pin(async move {
            let deadline = total_deadline(names.len() * self.block_bytes);
            within_deadline(deadline, self.pull(endpoint, names, dest.sink)).await
        })
    }
}

/// Which peers the KV service accepts.
#[derive(Clone, Debug)]
pub struct PeerAllow(Vec<(IpAddr, u8)>);

impl PeerAllow {
    /// Parse `loopback`, an address, or `ADDR/PREFIX`, comma-separated.
    pub fn parse(list: &[String]) -> Result<PeerAllow, String> {
        let mut v = Vec::new();
        for item in list.iter().flat_map(|s| s.split(',')).map(str::trim).filter(|s| !s.is_empty()) {
            if item == "loopback" {
                v.push(("127.0.0.0".parse().expect("ip"), 8));
                v.push(("::1".parse().expect("ip"), 128));
                continue;
            }
            let (a, p) = item.split_once('/').unwrap_or((item, ""));
            let ip: IpAddr = a.parse().map_err(|_| format!("--kv-peer-allow: `{item}` is not an address"))?;
            let max = if ip.is_ipv4() { 32 } else { 128 };
            let prefix = if p.is_empty() {
                max
            } else {
                p.parse().map_err(|_| format!("--kv-peer-allow: bad prefix in `{item}`"))?
            };
            if prefix > max {
                return Err(format!("--kv-peer-allow: bad prefix in `{item}`"));
            }
            v.push((ip, prefix));
        }
        Ok(PeerAllow(v))
    }

    /// Whether `ip` is allowed.
    pub fn allows(&self, ip: IpAddr) -> bool {
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
            v4 => v4,
        };
        self.0.iter().any(|&(net, prefix)| match (net, ip) {
            (IpAddr::V4(n), IpAddr::V4(a)) => {
                let mask = if prefix == 0 { 0 } else { u32::MAX << (32 - prefix) };
                u32::from(n) & mask == u32::from(a) & mask
            }
            (IpAddr::V6(n), IpAddr::V6(a)) => {
                let mask = if prefix == 0 { 0 } else { u128::MAX << (128 - prefix) };
                u128::from(n) & mask == u128::from(a) & mask
            }
            _ => false,
        })
    }
}

/// Fault injection for tests (`--kv-fault`, only with `--debug-endpoints`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Serve correctly.
    None,
    /// Flip a byte of the second block after its checksum was computed.
    Corrupt,
    /// Close the connection halfway through the second block.
    Truncate,
    /// Stop sending after the offer (the peer's deadline must fire).
    Stall,
    /// Exit the process after the first block (a source killed mid-transfer).
    Die,
}

impl Fault {
    /// Parse a `--kv-fault` value.
    pub fn parse(s: &str) -> Result<Fault, String> {
        Ok(match s {
            "none" => Fault::None,
            "corrupt" => Fault::Corrupt,
            "truncate" => Fault::Truncate,
            "stall" => Fault::Stall,
            "die" => Fault::Die,
            _ => return Err(format!("--kv-fault {s}: expected none|corrupt|truncate|stall|die")),
        })
    }
}

/// Counters of the service.
#[derive(Default)]
pub struct ServiceStats {
    /// Blocks sent.
    pub blocks_sent: std::sync::atomic::AtomicU64,
    /// Connections refused (peer, fingerprint, limits).
    pub refused: std::sync::atomic::AtomicU64,
}

/// Serve the reuse cache of `engine` on `listener` until the task is dropped; `in_place`
/// also serves readers that pull blocks themselves.
pub async fn serve(
    listener: TcpListener,
    engine: Arc<Engine>,
    fingerprint: Fingerprint,
    allow: PeerAllow,
    fault: Fault,
    stats: Arc<ServiceStats>,
    in_place: Option<Arc<dyn InPlaceSource>>,
) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let pending = Arc::new(Semaphore::new(MAX_PENDING));
    let peers: Arc<std::sync::Mutex<std::collections::HashMap<IpAddr, usize>>> = Arc::default();
    loop {
        let Ok((mut s, peer)) = listener.accept().await else {
            // out of descriptors and the like: back off instead of spinning
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let (engine, fp, stats, allow) = (engine.clone(), fingerprint.clone(), stats.clone(), allow.clone());
        let (in_place, slots, peers) = (in_place.clone(), slots.clone(), peers.clone());
        let ip = match peer.ip() {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
            v4 => v4,
        };
        // a connection that has not sent its hello holds a pending slot, never a serving one
        let pre = pending.clone().try_acquire_owned();
        let per_peer_ok = {
            let mut m = peers.lock().unwrap_or_else(|e| e.into_inner());
            let n = m.entry(ip).or_insert(0);
            *n += 1;
            *n <= MAX_PER_PEER
        };
        tokio::spawn(async move {
            let refuse = |reason: &str, message: String| Refuse { reason: reason.into(), message };
            let r = if !allow.allows(ip) {
                Err(refuse("peer_not_allowed", "this peer is not on the KV service's allowlist".into()))
            } else if !per_peer_ok {
                Err(refuse("busy", format!("this peer holds {MAX_PER_PEER} connections already")))
            } else if pre.is_err() {
                Err(refuse("busy", format!("{MAX_PENDING} connections are waiting for their hello")))
            } else {
                serve_one(&mut s, &engine, &fp, fault, &stats, in_place.as_deref(), pre.ok(), &slots).await
            };
            if let Err(r) = r {
                stats.refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let _ = write_control(&mut s, REFUSE, &r).await;
            }
            let mut m = peers.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(n) = m.get_mut(&ip) {
                *n -= 1;
                if *n == 0 {
                    m.remove(&ip);
                }
            }
        });
    }
}

/// One request; `Err` is a refusal to send back. The hello must arrive within
/// [`HELLO_TIMEOUT`] while the connection holds its `pending` slot; only then does it take a
/// serving slot out of `slots`.
#[allow(clippy::too_many_arguments)]
async fn serve_one(
    s: &mut TcpStream,
    engine: &Arc<Engine>,
    fp: &Fingerprint,
    fault: Fault,
    stats: &ServiceStats,
    in_place: Option<&dyn InPlaceSource>,
    pending: Option<tokio::sync::OwnedSemaphorePermit>,
    slots: &Arc<Semaphore>,
) -> Result<(), Refuse> {
    let refuse = |reason: &str, message: String| Refuse { reason: reason.into(), message };
    let _ = s.set_nodelay(true);
    let mut buf = Vec::new();
    let hello = async {
        let (kind, len) = read_header(s, MAX_CONTROL).await.map_err(|e| refuse("bad_request", e.detail))?;
        if kind != HELLO {
            return Err(refuse("bad_request", "expected a hello".into()));
        }
        read_control::<Hello>(s, &mut buf, len).await.map_err(|e| refuse("bad_request", e.detail))
    };
    let hello = match tokio::time::timeout(HELLO_TIMEOUT, hello).await {
        Ok(h) => h?,
        Err(_) => return Err(refuse("bad_request", "no hello within the deadline".into())),
    };
    drop(pending);
    let Ok(_serving) = slots.clone().try_acquire_owned() else {
        return Err(refuse("busy", format!("the KV service serves {MAX_CONNECTIONS} connections at most")));
    };
    if &hello.fingerprint != fp {
        return Err(refuse("fingerprint_mismatch", "the layouts differ".into()));
    }
    if hello.names.len() > MAX_BLOCKS {
        return Err(refuse("too_many_blocks", format!("at most {MAX_BLOCKS} names")));
    }
    if hello.nixl && in_place.is_none() {
        return Err(refuse("transport_unavailable", "this source serves no in-place (NIXL) readers".into()));
    }
    // Pin the leading run held here: those blocks cannot be evicted until they are sent.
    let lease = engine.cache.pin_prefix(&hello.names);
    let bb = engine.store.block_bytes();
    if let (true, Some(src)) = (hello.nixl, in_place) {
        return src.serve(s, &hello, lease, fault, stats).await;
    }
    let offer = Offer { fingerprint: fp.clone(), count: lease.ids.len() as u64, block_bytes: bb as u64, nixl: None };
    if write_control(s, OFFER, &offer).await.is_err() {
        return Ok(());
    }
    if fault == Fault::Stall {
        tokio::time::sleep(Duration::from_secs(3600)).await;
    }
    // Pipelined: a blocking thread gathers the next chunk through the copy engine and
    // checksums it while this task writes the current one to the socket.
    let chunk = crate::engine::chunk_blocks(bb);
    let lease = Arc::new(lease);
    let (tx, mut rx) = tokio::sync::mpsc::channel::<(usize, Vec<u8>, Vec<u64>)>(1);
    let (back_tx, back_rx) = std::sync::mpsc::channel::<Vec<u8>>();
    let producer = {
        let (engine, lease) = (engine.clone(), lease.clone());
        tokio::task::spawn_blocking(move || {
            for (c, ids) in lease.ids.chunks(chunk).enumerate() {
                let mut buf = back_rx.try_recv().unwrap_or_else(|_| vec![0u8; chunk * bb]);
                let part = &mut buf[..ids.len() * bb];
                if engine.store.read(ids, part).is_err() {
                    return; // the peer sees a truncated stream
                }
                let sums = part.chunks(bb).map(xxh3_64).collect();
                if tx.blocking_send((c, buf, sums)).is_err() {
                    return; // the writer stopped
                }
            }
        })
    };
    while let Some((c, mut buf, sums)) = rx.recv().await {
        for (k, sum) in sums.into_iter().enumerate() {
            let i = c * chunk + k;
            let block = &mut buf[k * bb..(k + 1) * bb];
            // header, name and checksum, then the block straight from the gather buffer
            let mut head = [0u8; 28];
            head[..12].copy_from_slice(&header(BLOCK, 16 + bb));
            head[12..20].copy_from_slice(&hello.names[i].to_le_bytes());
            head[20..28].copy_from_slice(&sum.to_le_bytes());
            let mut n = bb;
            if i == 1 {
                match fault {
                    Fault::Corrupt => block[bb / 2] ^= 0x40,
                    Fault::Truncate => n = bb / 2,
                    _ => {}
                }
            }
            if timed(s.write_all(&head)).await.is_err() || timed(s.write_all(&block[..n])).await.is_err() {
                return Ok(());
            }
            stats.blocks_sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if i == 1 && fault == Fault::Truncate {
                let _ = s.shutdown().await;
                return Ok(());
            }
            if i == 0 && fault == Fault::Die {
                let _ = s.flush().await;
                eprintln!("kvrelay-server: --kv-fault die: exiting mid-transfer");
                std::process::exit(3);
            }
        }
        let _ = back_tx.send(buf);
    }
    let _ = producer.await;
    let _ = s.flush().await;
    drop(lease);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_allowlist() {
        let a = PeerAllow::parse(&["loopback".into()]).unwrap();
        assert!(a.allows("127.0.0.1".parse().unwrap()) && a.allows("::1".parse().unwrap()));
        assert!(a.allows("::ffff:127.0.0.2".parse().unwrap()));
        assert!(!a.allows("10.0.0.1".parse().unwrap()));
        let b = PeerAllow::parse(&["10.1.0.0/16,192.168.1.7".into()]).unwrap();
        assert!(b.allows("10.1.200.3".parse().unwrap()) && !b.allows("10.2.0.1".parse().unwrap()));
        assert!(b.allows("192.168.1.7".parse().unwrap()) && !b.allows("127.0.0.1".parse().unwrap()));
        assert!(PeerAllow::parse(&["nonsense".into()]).is_err());
    }
}
