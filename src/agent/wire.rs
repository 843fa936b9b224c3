//! The agent's TCP framing and messages (version 4 of the KV frame format).
//!
//! Every frame is a 12-byte header — magic `KVRA`, version 4, kind, two zero bytes, payload
//! length (u32 LE) — then the payload. All integers are little-endian. Kinds:
//! - `AUTH_HELLO` (1, destination -> source): a 32-byte nonce; the first frame when a key is set;
//! - `AUTH_CHALLENGE` (2, source -> destination): the source's 32-byte nonce and its 32-byte
//!   proof; `AUTH_PROOF` (3, destination -> source): the destination's 32-byte proof ([`super::auth`]);
//! - `HELLO` (4, destination -> source): the fingerprint (32 bytes: block tokens, layers, KV
//!   heads, head size, dtype bytes, 4 zero bytes as u32s, then the naming-scheme id as u64), a
//!   name count (u32) and the names (u64 each); the first frame without a key;
//! - `OFFER` (5, source -> destination): `count` (u32, the leading names the source holds and
//!   pinned), flags (u32: bit 0 [`TAGGED`], the blocks carry keyed tags; other bits zero),
//!   `block_bytes` (u64);
//! - `BLOCK` (6, source -> destination): name (u64), the checksum recorded when the block
//!   became reusable (u64), its keyed tag ([`crate::block_mac`], u64; zero when the offer is
//!   not [`TAGGED`]), the block's recorded content digest (32 bytes, zeros when none was
//!   recorded: `kvrelay_block_digests`), then exactly `block_bytes` bytes; one per offered
//!   block, in order;
//! - `REFUSE` (7, either way): a reason code (u8, [`Refusal`]) and up to 255 bytes of UTF-8 text;
//! - with the NIXL transport (feature `nixl`, module `nixl`): `NIXL_HELLO` (8, destination ->
//!   source, the payload of a `HELLO`: the destination READs the blocks itself), `NIXL_OFFER`
//!   (9, source -> destination: where the pinned blocks lie, with their recorded checksums and
//!   content digests) and
//!   `DONE` (10, destination -> source: how many blocks it took, u64; the source unpins them);
//! - with the same-host CUDA IPC transport (module `cuda_ipc`): `IPC_HELLO` (11, the payload of
//!   a `HELLO`) and `IPC_OFFER` (12: an in-place offer whose metadata is the source's host id,
//!   process id and exported allocations), answered by `DONE` after the copy and its check.
//!
//! Limits on every read: a control frame at most [`MAX_CONTROL`] bytes, a hello at most
//! `12 + 36 + 8 * max_names`, a block frame exactly `56 + block_bytes`; every read and write has
//! a deadline.
//!
//! Version 3 added the content digests, version 4 the keyed block tags (a peer of another
//! version's frames are refused as another format: both ends of a fetch run the same version).

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use super::Fingerprint;

/// The frame magic.
pub const MAGIC: &[u8; 4] = b"KVRA";
/// The frame format's version.
pub const VERSION: u8 = 4;
/// Frame kind: the destination's nonce (first frame when a key is set).
pub const AUTH_HELLO: u8 = 1;
/// Frame kind: the source's nonce and proof.
pub const AUTH_CHALLENGE: u8 = 2;
/// Frame kind: the destination's proof.
pub const AUTH_PROOF: u8 = 3;
/// Frame kind: fingerprint and names.
pub const HELLO: u8 = 4;
/// Frame kind: how many leading blocks the source pinned, and their size.
pub const OFFER: u8 = 5;
/// Frame kind: one block with its name, recorded checksum and recorded content digest.
pub const BLOCK: u8 = 6;
/// Frame kind: a refusal with its reason.
pub const REFUSE: u8 = 7;
/// Frame kind: a hello asking for blocks in place (NIXL READs).
pub const NIXL_HELLO: u8 = 8;
/// Frame kind: where the pinned blocks lie, for NIXL READs.
pub const NIXL_OFFER: u8 = 9;
/// Frame kind: the reader took this many blocks (NIXL).
pub const DONE: u8 = 10;
/// A hello asking for a same-host CUDA IPC copy (the payload of a `HELLO`).
pub const IPC_HELLO: u8 = 11;
/// The answer to `IPC_HELLO`: an in-place offer (see [`InPlaceOffer`]).
pub const IPC_OFFER: u8 = 12;

/// Largest control frame other than a hello.
pub const MAX_CONTROL: usize = 512;
/// Bytes of an encoded fingerprint.
pub const FINGERPRINT_BYTES: usize = 32;
/// Bytes of a content digest on the wire.
pub const DIGEST_BYTES: usize = crate::names::BLOCK_DIGEST_BYTES;
/// Bytes of a `BLOCK` frame's payload before the block: name, checksum, keyed tag, digest.
pub const BLOCK_HEAD: usize = 24 + DIGEST_BYTES;
/// Offer flag: every offered block carries its keyed tag ([`crate::block_mac`]), which a
/// destination that holds the key checks where the bytes arrived in host memory.
pub const TAGGED: u32 = 1;

crate::labels::labelled_enum! {
    /// Why a source refused (the wire code and the statistics' label).
    pub enum Refusal: u8 {
        /// The peer is not on the allowlist.
        PeerNotAllowed = 1 => "peer_not_allowed",
        /// Every serving slot, or every slot for connections still in their handshake, is taken.
        Busy = 2 => "busy",
        /// This peer address holds its limit of connections.
        PerPeerLimit = 3 => "per_peer_limit",
        /// A frame that does not decode, or not the one expected.
        BadRequest = 4 => "bad_request",
        /// The layouts (or naming schemes) differ.
        FingerprintMismatch = 5 => "fingerprint_mismatch",
        /// Authentication failed, or one side has a key and the other none.
        AuthFailed = 6 => "auth_failed",
        /// More names than the service takes in one request.
        TooManyNames = 7 => "too_many_names",
        /// The runtime's pin callback answered something impossible.
        Internal = 8 => "internal",
        /// The destination asked for a transport this service does not serve (NIXL reads from a
        /// service without NIXL).
        Unsupported = 9 => "unsupported",
    }
}

impl Refusal {
    /// From the wire code.
    pub fn from_code(c: u8) -> Option<Refusal> {
        Refusal::ALL.iter().copied().find(|r| *r as u8 == c)
    }
}

/// A connection whose every read and write finishes by a deadline.
pub trait Conn {
    /// Fill `buf` completely by `deadline`.
    fn read_by(&mut self, buf: &mut [u8], deadline: Instant) -> io::Result<()>;
    /// Write all of `buf` by `deadline`.
    fn write_by(&mut self, buf: &[u8], deadline: Instant) -> io::Result<()>;
    /// Poll (busy, on this thread) for up to `within` until a byte can be read or the stream
    /// ended, before a read that would otherwise put the thread to sleep
    /// ([`Limits::poll`](crate::agent::Limits::poll)); reads nothing. A connection that cannot
    /// poll returns at once.
    fn poll_readable(&mut self, within: Duration) {
        let _ = within;
    }
}

/// A connection that reads a fixed script (then ends, as a closed stream does) and counts the
/// bytes written to it: what the fuzz targets and tests feed [`crate::agent::Agent::serve_connection`]
/// and [`crate::agent::Agent::fetch_over_connection`] as a hostile peer or source.
#[doc(hidden)]
#[derive(Debug)]
pub struct Scripted<'a> {
    /// What is left to read.
    pub input: &'a [u8],
    /// Bytes written so far.
    pub written: usize,
}

impl<'a> Scripted<'a> {
    /// A connection that will read `input`.
    pub fn new(input: &'a [u8]) -> Scripted<'a> {
        Scripted { input, written: 0 }
    }
}

impl Conn for Scripted<'_> {
    fn read_by(&mut self, buf: &mut [u8], _deadline: Instant) -> io::Result<()> {
        if self.input.len() < buf.len() {
            self.input = &[];
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        let (a, b) = self.input.split_at(buf.len());
        buf.copy_from_slice(a);
        self.input = b;
        Ok(())
    }
    fn write_by(&mut self, buf: &[u8], _deadline: Instant) -> io::Result<()> {
        self.written += buf.len();
        Ok(())
    }
}

/// Whether `fd` has a byte to read or its stream ended (or failed): one non-blocking peek.
fn readable_now(fd: std::os::fd::RawFd) -> bool {
    let mut b = [0u8; 1];
    // SAFETY: `fd` is an open socket of the caller's stream; `b` is a writable byte; MSG_PEEK
    // leaves it queued and MSG_DONTWAIT makes the call return at once.
    let n = unsafe { libc::recv(fd, b.as_mut_ptr().cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT) };
    if n >= 0 {
        return true; // a byte, or the end of the stream
    }
    let e = io::Error::last_os_error().kind();
    e != io::ErrorKind::WouldBlock && e != io::ErrorKind::Interrupted
}

fn remaining(deadline: Instant) -> io::Result<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        Err(io::Error::new(io::ErrorKind::TimedOut, "deadline passed"))
    } else {
        Ok(left.max(Duration::from_millis(1)))
    }
}

/// How late past its deadline a read or a write may end (see `impl Conn for TcpStream`).
const DEADLINE_SLACK: Duration = Duration::from_millis(5);

/// The socket's timeout (which bounds each `read`/`write` call) is set to the time left when a
/// call starts, and set again before a later partial read or write once more than
/// `DEADLINE_SLACK` (5 ms) has passed since it was set: each system call then waits at most for what
/// is left, plus that slack. So a call returns by its deadline plus the slack however a peer
/// drips its bytes, and a transfer at speed pays one more system call every few milliseconds,
/// not one per partial read.
impl Conn for TcpStream {
    fn read_by(&mut self, mut buf: &mut [u8], deadline: Instant) -> io::Result<()> {
        self.set_read_timeout(Some(remaining(deadline)?))?;
        let mut set_at = Instant::now();
        while !buf.is_empty() {
            match self.read(buf) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => {
                    buf = &mut buf[n..];
                    if !buf.is_empty() {
                        let left = remaining(deadline)?;
                        if set_at.elapsed() > DEADLINE_SLACK {
                            self.set_read_timeout(Some(left))?;
                            set_at = Instant::now();
                        }
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    return Err(io::Error::new(io::ErrorKind::TimedOut, "read deadline"))
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn write_by(&mut self, mut buf: &[u8], deadline: Instant) -> io::Result<()> {
        self.set_write_timeout(Some(remaining(deadline)?))?;
        let mut set_at = Instant::now();
        while !buf.is_empty() {
            match self.write(buf) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    buf = &buf[n..];
                    if !buf.is_empty() {
                        let left = remaining(deadline)?;
                        if set_at.elapsed() > DEADLINE_SLACK {
                            self.set_write_timeout(Some(left))?;
                            set_at = Instant::now();
                        }
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    return Err(io::Error::new(io::ErrorKind::TimedOut, "write deadline"))
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Peeks without blocking until a byte (or the end) is there or `within` passed: a system
    /// call every few hundred nanoseconds on this thread, never longer than `within` plus one.
    fn poll_readable(&mut self, within: Duration) {
        if within.is_zero() {
            return;
        }
        let fd = std::os::fd::AsRawFd::as_raw_fd(self);
        let end = Instant::now() + within;
        while !readable_now(fd) && Instant::now() < end {
            std::hint::spin_loop();
        }
    }
}

/// A frame header.
///
/// `len` must fit a frame's u32 length (every caller bounds it: a block frame is 16 bytes plus
/// one block, and `Agent::new` refuses blocks that would not fit); a longer one is written as
/// `u32::MAX`, never wrapped into a short length ([`write_frame`] refuses it outright).
pub fn header(kind: u8, len: usize) -> [u8; 12] {
    let mut h = [0u8; 12];
    h[..4].copy_from_slice(MAGIC);
    h[4] = VERSION;
    h[5] = kind;
    h[8..].copy_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_le_bytes());
    h
}

/// What went wrong reading a frame.
#[derive(Debug)]
pub enum FrameError {
    /// I/O (timeouts included).
    Io(io::Error),
    /// Not a KV frame of this version, or longer than allowed.
    Malformed(&'static str),
}

impl From<io::Error> for FrameError {
    fn from(e: io::Error) -> FrameError {
        FrameError::Io(e)
    }
}

/// Read a frame header: `(kind, payload length)`, the length at most `max`.
pub fn read_header(c: &mut dyn Conn, max: usize, deadline: Instant) -> Result<(u8, usize), FrameError> {
    let mut h = [0u8; 12];
    c.read_by(&mut h, deadline)?;
    if &h[..4] != MAGIC || h[4] != VERSION || h[6] != 0 || h[7] != 0 {
        return Err(FrameError::Malformed("not a kvrelay agent frame (magic or version)"));
    }
    let len = u32::from_le_bytes([h[8], h[9], h[10], h[11]]) as usize;
    if len > max {
        return Err(FrameError::Malformed("a frame longer than its limit"));
    }
    Ok((h[5], len))
}

/// Write one frame (header and payload in one write).
pub fn write_frame(c: &mut dyn Conn, kind: u8, payload: &[u8], deadline: Instant) -> io::Result<()> {
    if u32::try_from(payload.len()).is_err() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "a frame longer than 4 GiB"));
    }
    let mut f = Vec::with_capacity(12 + payload.len());
    f.extend_from_slice(&header(kind, payload.len()));
    f.extend_from_slice(payload);
    c.write_by(&f, deadline)
}

/// Send a refusal (best effort: the peer may be gone).
pub fn refuse(c: &mut dyn Conn, why: Refusal, text: &str, deadline: Instant) {
    let mut p = vec![why as u8];
    let mut t = text.as_bytes();
    if t.len() > 255 {
        let mut n = 255;
        while !text.is_char_boundary(n) {
            n -= 1;
        }
        t = &t[..n];
    }
    p.extend_from_slice(t);
    let _ = write_frame(c, REFUSE, &p, deadline);
}

/// Decode a refusal's payload: the code (None when unknown) and the text.
pub fn decode_refusal(p: &[u8]) -> (Option<Refusal>, String) {
    match p.split_first() {
        Some((&c, t)) => (Refusal::from_code(c), String::from_utf8_lossy(t).into_owned()),
        None => (None, String::new()),
    }
}

/// Encode a fingerprint.
pub fn put_fingerprint(out: &mut Vec<u8>, f: &Fingerprint) {
    for v in [f.block_tokens, f.layers, f.kv_heads, f.head_dim, f.dtype_bytes, 0] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out.extend_from_slice(&f.naming.to_le_bytes());
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

/// A u64 at `at` (the caller checked the length).
pub fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Decode a fingerprint (exactly [`FINGERPRINT_BYTES`]); `None` when the reserved word is set.
pub fn get_fingerprint(b: &[u8]) -> Option<Fingerprint> {
    if b.len() != FINGERPRINT_BYTES || u32_at(b, 20) != 0 {
        return None;
    }
    Some(Fingerprint {
        block_tokens: u32_at(b, 0),
        layers: u32_at(b, 4),
        kv_heads: u32_at(b, 8),
        head_dim: u32_at(b, 12),
        dtype_bytes: u32_at(b, 16),
        naming: u64_at(b, 24),
    })
}

/// A hello's payload.
pub fn encode_hello(f: &Fingerprint, names: &[u64]) -> Vec<u8> {
    let mut p = Vec::with_capacity(FINGERPRINT_BYTES + 4 + 8 * names.len());
    put_fingerprint(&mut p, f);
    p.extend_from_slice(&(names.len() as u32).to_le_bytes());
    for n in names {
        p.extend_from_slice(&n.to_le_bytes());
    }
    p
}

/// Decode a hello into its fingerprint and names (`names` is cleared and refilled).
pub fn decode_hello(p: &[u8], names: &mut Vec<u64>) -> Option<Fingerprint> {
    if p.len() < FINGERPRINT_BYTES + 4 {
        return None;
    }
    let f = get_fingerprint(&p[..FINGERPRINT_BYTES])?;
    let n = u32_at(p, FINGERPRINT_BYTES) as usize;
    let body = &p[FINGERPRINT_BYTES + 4..];
    if body.len() != n.checked_mul(8)? {
        return None;
    }
    names.clear();
    names.extend(body.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))));
    Some(f)
}

/// An offer's payload.
pub fn encode_offer(count: u32, flags: u32, block_bytes: u64) -> [u8; 16] {
    let mut p = [0u8; 16];
    p[..4].copy_from_slice(&count.to_le_bytes());
    p[4..8].copy_from_slice(&flags.to_le_bytes());
    p[8..].copy_from_slice(&block_bytes.to_le_bytes());
    p
}

/// Decode an offer: `(count, flags, block_bytes)`; `None` also for a flag this version does
/// not know.
pub fn decode_offer(p: &[u8]) -> Option<(u32, u32, u64)> {
    if p.len() != 16 || u32_at(p, 4) & !TAGGED != 0 {
        return None;
    }
    Some((u32_at(p, 0), u32_at(p, 4), u64_at(p, 8)))
}

/// An offer of blocks in place (`NIXL_OFFER`, the NIXL transport's answer to `NIXL_HELLO`):
/// `count` blocks of `block_bytes`; the source's NIXL agent; its
/// segments `(base, stride, bytes)`; its pool's block count, device, and per block
/// `(id, recorded checksum, recorded content digest)`.
#[derive(Debug, Default, PartialEq)]
pub struct InPlaceOffer {
    /// The source's NIXL agent name.
    pub agent: String,
    /// Its metadata.
    pub metadata: Vec<u8>,
    /// Bytes of one block.
    pub block_bytes: u64,
    /// The source's CUDA device (`None`: host memory).
    pub device: Option<i32>,
    /// Blocks in the source's pool.
    pub num_blocks: u32,
    /// The source's segments: base, stride, bytes per block.
    pub segments: Vec<(u64, u64, u64)>,
    /// Offered blocks: id in the source's pool, recorded checksum, recorded content digest
    /// (zeros: none recorded).
    pub blocks: Vec<OfferedBlock>,
    /// The offered blocks' keyed tags ([`crate::block_mac`]), one per block in `blocks`' order;
    /// empty: the offer is not tagged (flag [`TAGGED`] clear).
    pub tags: Vec<u64>,
}

/// One block of an in-place offer: its id in the source's pool, its recorded checksum and its
/// recorded content digest (zeros: none recorded).
pub type OfferedBlock = (u32, u64, [u8; DIGEST_BYTES]);

/// Fixed part of an encoded offer.
const OFFER_HEAD: usize = 36;
/// Bytes of one offered block: id, checksum, digest.
const OFFER_BLOCK: usize = 12 + DIGEST_BYTES;

/// Largest NIXL agent metadata an in-place offer may carry.
pub const MAX_METADATA: usize = 1 << 20;

/// Encode an offer: count u32, segment count u32, block bytes u64, device i32 (-1: host), the
/// source's block count u32, agent-name length u32, metadata length u32, flags u32 (bit 0
/// [`TAGGED`]); then per segment base, stride, bytes (u64 each); the name; the metadata; per
/// block id u32, checksum u64 and digest (32 bytes); when tagged, per block its tag (u64).
pub fn encode_in_place_offer(o: &InPlaceOffer) -> Vec<u8> {
    let mut p = Vec::with_capacity(
        OFFER_HEAD + 24 * o.segments.len() + o.agent.len() + o.metadata.len() + (OFFER_BLOCK + 8) * o.blocks.len(),
    );
    debug_assert!(o.tags.is_empty() || o.tags.len() == o.blocks.len());
    p.extend_from_slice(&(o.blocks.len() as u32).to_le_bytes());
    p.extend_from_slice(&(o.segments.len() as u32).to_le_bytes());
    p.extend_from_slice(&o.block_bytes.to_le_bytes());
    p.extend_from_slice(&o.device.unwrap_or(-1).to_le_bytes());
    p.extend_from_slice(&o.num_blocks.to_le_bytes());
    p.extend_from_slice(&(o.agent.len() as u32).to_le_bytes());
    p.extend_from_slice(&(o.metadata.len() as u32).to_le_bytes());
    p.extend_from_slice(&(if o.tags.is_empty() { 0 } else { TAGGED }).to_le_bytes());
    for &(b, s, n) in &o.segments {
        for v in [b, s, n] {
            p.extend_from_slice(&v.to_le_bytes());
        }
    }
    p.extend_from_slice(o.agent.as_bytes());
    p.extend_from_slice(&o.metadata);
    for (id, sum, digest) in &o.blocks {
        p.extend_from_slice(&id.to_le_bytes());
        p.extend_from_slice(&sum.to_le_bytes());
        p.extend_from_slice(digest);
    }
    for t in &o.tags {
        p.extend_from_slice(&t.to_le_bytes());
    }
    p
}

/// Decode an offer; `None` when it does not decode exactly.
pub fn decode_in_place_offer(p: &[u8]) -> Option<InPlaceOffer> {
    if p.len() < OFFER_HEAD || u32_at(p, 32) & !TAGGED != 0 {
        return None;
    }
    let tagged = u32_at(p, 32) & TAGGED != 0;
    let count = u32_at(p, 0) as usize;
    let nseg = u32_at(p, 4) as usize;
    let device = i32::from_le_bytes(p[16..20].try_into().ok()?);
    let (name_len, md_len) = (u32_at(p, 24) as usize, u32_at(p, 28) as usize);
    if nseg == 0 || nseg > 1 << 16 || name_len > 255 || md_len > MAX_METADATA || device < -1 {
        return None;
    }
    let per_block = OFFER_BLOCK + if tagged { 8 } else { 0 };
    let need = OFFER_HEAD + 24 * nseg + name_len + md_len + count.checked_mul(per_block)?;
    if p.len() != need {
        return None;
    }
    let mut at = OFFER_HEAD;
    let mut segments = Vec::with_capacity(nseg);
    for _ in 0..nseg {
        segments.push((u64_at(p, at), u64_at(p, at + 8), u64_at(p, at + 16)));
        at += 24;
    }
    let agent = std::str::from_utf8(&p[at..at + name_len]).ok()?.to_string();
    at += name_len;
    let metadata = p[at..at + md_len].to_vec();
    at += md_len;
    let blocks = (0..count)
        .map(|i| {
            let b = at + OFFER_BLOCK * i;
            (u32_at(p, b), u64_at(p, b + 4), p[b + 12..b + OFFER_BLOCK].try_into().expect("32 bytes"))
        })
        .collect();
    at += OFFER_BLOCK * count;
    let tags = if tagged { (0..count).map(|i| u64_at(p, at + 8 * i)).collect() } else { Vec::new() };
    Some(InPlaceOffer {
        agent,
        metadata,
        block_bytes: u64_at(p, 8),
        device: (device >= 0).then_some(device),
        num_blocks: u32_at(p, 20),
        segments,
        blocks,
        tags,
    })
}

/// The largest in-place offer a destination reads for `asked` names over `nseg` segments.
pub fn max_in_place_offer(asked: usize, nseg: usize) -> usize {
    OFFER_HEAD + 24 * nseg + 255 + MAX_METADATA + (OFFER_BLOCK + 8) * asked
}

impl InPlaceOffer {
    /// Whether the offer can be READ into a pool of `layout` for a request of `asked` names:
    /// at most `asked` blocks of the layout's block size, the same segment sizes (else `Err`
    /// with `true`: the layouts differ), a segment table under which no block address of the
    /// source's pool overflows, and every offered id inside that pool. Pure: what a hostile
    /// source can send is checked here before any address is computed from it.
    pub fn check(&self, layout: &crate::copy::KvLayout, asked: usize) -> Result<(), (bool, String)> {
        if self.blocks.len() > asked || self.block_bytes != layout.stage_block_bytes() {
            return Err((false, "the offer does not match the request".into()));
        }
        let mine = layout.segments();
        if self.segments.len() != mine.len() || self.segments.iter().zip(mine).any(|(o, m)| o.2 != m.bytes_per_block) {
            return Err((true, "the two pools cut a block into other segments".into()));
        }
        // with ids below `num_blocks`, no address computed from the source's table overflows
        let spans_ok = self.segments.iter().all(|&(base, stride, len)| {
            stride
                .checked_mul(u64::from(self.num_blocks.saturating_sub(1)))
                .and_then(|x| x.checked_add(len))
                .and_then(|x| x.checked_add(base))
                .is_some()
        });
        if self.num_blocks == 0 || !spans_ok {
            return Err((false, "the offer's segment table does not describe a pool".into()));
        }
        if let Some(&(id, ..)) = self.blocks.iter().find(|b| b.0 >= self.num_blocks) {
            return Err((false, format!("the offer names block {id}, past the source's pool")));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_refuse_garbage() {
        let f = Fingerprint { block_tokens: 32, layers: 4, kv_heads: 2, head_dim: 64, dtype_bytes: 2, naming: 7 };
        let p = encode_hello(&f, &[1, 2, 3]);
        let mut names = Vec::new();
        assert_eq!(decode_hello(&p, &mut names), Some(f.clone()));
        assert_eq!(names, [1, 2, 3]);
        assert_eq!(decode_hello(&p[..p.len() - 1], &mut names), None);
        let mut bad = p.clone();
        bad[20] = 1;
        assert_eq!(decode_hello(&bad, &mut names), None);
        assert_eq!(decode_offer(&encode_offer(5, 0, 65536)), Some((5, 0, 65536)));
        assert_eq!(decode_offer(&encode_offer(5, TAGGED, 65536)), Some((5, TAGGED, 65536)));
        assert_eq!(decode_offer(&encode_offer(5, 2, 65536)), None, "an unknown flag");
        assert_eq!(decode_offer(&[0; 15]), None);
        assert_eq!(decode_refusal(&[2, b'x']), (Some(Refusal::Busy), "x".into()));
        assert_eq!(decode_refusal(&[200]).0, None);
    }

    #[test]
    fn offers_round_trip_and_garbage_is_refused() {
        let o = InPlaceOffer {
            agent: "a".into(),
            metadata: vec![1, 2, 3],
            block_bytes: 4096,
            device: Some(0),
            num_blocks: 9,
            segments: vec![(0x1000, 4096, 2048), (0x9000, 4096, 2048)],
            blocks: vec![(3, 77, [5; DIGEST_BYTES]), (8, 99, [0; DIGEST_BYTES])],
            tags: Vec::new(),
        };
        let p = encode_in_place_offer(&o);
        assert_eq!(decode_in_place_offer(&p), Some(o));
        let tagged = InPlaceOffer { tags: vec![11, 12], ..decode_in_place_offer(&p).unwrap() };
        let t = encode_in_place_offer(&tagged);
        assert_eq!(t.len(), p.len() + 16);
        assert_eq!(decode_in_place_offer(&t), Some(tagged));
        assert_eq!(decode_in_place_offer(&t[..t.len() - 8]), None, "a tag short");
        assert_eq!(decode_in_place_offer(&p[..p.len() - 1]), None);
        let mut bad = p.clone();
        bad[33] = 1;
        assert_eq!(decode_in_place_offer(&bad), None);
        let mut bad = p;
        bad[4] = 0; // no segments
        assert_eq!(decode_in_place_offer(&bad), None);
    }

    /// Polling returns once a byte is there (leaving it to read) or the stream ended, and
    /// after its time when neither: what it saw is checked with a non-blocking read, not a
    /// clock.
    #[test]
    fn polling_sees_a_byte_or_the_end_and_reads_nothing() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut w = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut r, _) = l.accept().unwrap();
        let readable = |r: &mut TcpStream| -> io::Result<usize> {
            r.set_nonblocking(true).unwrap();
            let got = r.read(&mut [0u8; 4]);
            r.set_nonblocking(false).unwrap();
            got
        };
        // nothing sent: it gives up after its time, and nothing was consumed
        r.poll_readable(Duration::from_micros(200));
        assert_eq!(readable(&mut r).unwrap_err().kind(), io::ErrorKind::WouldBlock);
        // a byte from another thread: seen (a poll that gave up instead would fail the read)
        let t = std::thread::spawn(move || {
            w.write_all(b"x").unwrap();
            w
        });
        r.poll_readable(Duration::from_secs(60));
        assert_eq!(readable(&mut r).unwrap(), 1, "the byte is still there to read");
        // the end of the stream
        drop(t.join().unwrap());
        r.poll_readable(Duration::from_secs(60));
        assert_eq!(readable(&mut r).unwrap(), 0);
        // zero: returns at once; a connection that cannot poll is left alone
        r.poll_readable(Duration::ZERO);
        Scripted::new(b"y").poll_readable(Duration::from_secs(60));
    }
}
