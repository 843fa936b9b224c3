//! How an agent is set up: the layout [`Fingerprint`] two instances compare, the [`Limits`]
//! every connection and fetch runs under, the [`Transport`] and the [`AgentConfig`] that holds
//! them.

use std::time::Duration;

use super::{PeerAllow, Psk};

/// What two instances compare before any block moves: a mismatch refuses the transfer.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Fingerprint {
    /// Tokens per block.
    pub block_tokens: u32,
    /// Layers.
    pub layers: u32,
    /// KV heads.
    pub kv_heads: u32,
    /// Head size.
    pub head_dim: u32,
    /// Bytes per element.
    pub dtype_bytes: u32,
    /// The runtime's naming-scheme id (its choice: a hash of the name seed, the model, the
    /// settings that change KV bytes); equal ids must mean equal names for equal KV.
    pub naming: u64,
}

/// The agent's limits. [`Limits::default`] gives the documented defaults.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Connections serving transfers at once, all peers together (64).
    pub max_connections: u32,
    /// Connections from one peer address, serving or in their handshake (16: what one peer
    /// with the default `fetch_threads` and `streams` opens at most). A kept-alive connection
    /// waiting for its next hello does not count until that hello comes.
    pub max_per_peer: u32,
    /// Connections that have not yet sent a valid first message (32): they never take a
    /// serving slot. Kept-alive connections waiting for their next hello count here too, but
    /// only up to half of it, so that new peers always find handshake slots.
    pub max_pending: u32,
    /// Time a new connection has to complete its handshake (authentication and hello): 2 s.
    pub handshake_timeout: Duration,
    /// Deadline of every other read and write: 5 s.
    pub io_timeout: Duration,
    /// Connect deadline of a fetch: 2 s.
    pub connect_timeout: Duration,
    /// Most names in one request, served or fetched (65,536: a 2M-token prompt of 32-token blocks).
    pub max_names: u32,
    /// Fetch worker threads (4).
    pub fetch_threads: u32,
    /// Fetches waiting for a worker before a submission is refused as busy (1,024).
    pub max_queued_fetches: u32,
    /// TCP connections one fetch spreads its run over, each carrying a contiguous part of at
    /// least `min_stream_bytes` (so small fetches use one); NIXL fetches use one (4). The agent
    /// makes this many movers when it starts (see [`Agent::new`](super::Agent::new)); a fetch
    /// from a peer uses this many of that peer's `max_per_peer` connections at the source.
    pub streams: u32,
    /// Least bytes each stream of a multi-stream fetch carries (8 MiB: a 32 MiB fetch of 4 MiB
    /// blocks already uses 4 streams, 2.2-2.5x faster than over one on the H200).
    pub min_stream_bytes: u64,
    /// How long a connection stays open after a transfer for the next one between the same two
    /// agents (5 s; zero: one transfer per connection). The serving side waits that long for
    /// the next hello, holding a handshake slot, not a serving one; the fetching side reuses a
    /// connection only within half of it.
    pub idle_timeout: Duration,
    /// Socket send and receive buffer size of every agent connection, bytes (0, the default:
    /// the kernel's own sizing, which autotunes; measured no slower on loopback).
    pub socket_buffer_bytes: u32,
    /// How long a transfer still posted when its fetch ends (failure, cancel, deadline) has to
    /// finish or fail before the destination blocks it may write are withheld (1 s; NIXL only:
    /// a TCP stream stops when its socket closes). Zero withholds at once.
    pub write_grace: Duration,
    /// When the agent's transport is not TCP: a fetch whose source cannot be reached that way
    /// (it does not serve the transport, it runs on another host for CUDA IPC, its memory
    /// cannot be mapped here) is made again over TCP, once, and that source is fetched from
    /// over TCP for the next [`TCP_FALLBACK_MEMORY`] (true, the default). False pins the
    /// transport: such a fetch fails with the reason.
    pub tcp_fallback: bool,
    /// How long an agent thread that just did its part of a fetch polls for the next step
    /// before it sleeps (0, the default: it sleeps at once; at most 10 ms). A sleeping thread
    /// costs a wake-up when work comes, tens of microseconds on a busy or virtualised host,
    /// several per fetch (the fetch worker for the next submission, the source's connection
    /// for the next request and for the end of a transfer, the fetch for the source's
    /// answer): polling takes them off back-to-back fetches, a 1-block CUDA IPC fetch most of
    /// all, for up to this much busy CPU time per step. It does not help the first fetch after
    /// a pause. Microseconds through the C ABI.
    pub poll: Duration,
    /// Kept for the C ABI; ignored since 0.4.3. It decided whether the CUDA IPC transport
    /// exported a pool's allocations whole when they held more than the pool: a grant now maps
    /// an export area holding the asked blocks only, never the pool's allocations, so a pool
    /// may lie in any device memory.
    pub export_whole_allocations: bool,
    /// Fetches by name alone: false (the default) refuses a fetch submitted without a content
    /// digest per name ([`FetchRequest::digests`](super::FetchRequest::digests),
    /// `kvrelay_agent_submit_checked`), since a name is a 64-bit hash that a tenant can collide
    /// and a source can answer with any bytes under; true lets such fetches take each block the
    /// source sends under the name asked (its checksum still checked), for runtimes that name
    /// blocks by a collision-free scheme of their own or fetch from sources they vouch for.
    pub unchecked_fetch: bool,
}

/// The longest [`Limits::poll`].
const MAX_POLL: Duration = Duration::from_millis(10);

/// How long a source that could not be reached with the agent's own transport is fetched from
/// over TCP before the transport is tried again (a source may restart with it).
pub const TCP_FALLBACK_MEMORY: Duration = Duration::from_secs(60);

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_connections: 64,
            max_per_peer: 16,
            max_pending: 32,
            handshake_timeout: Duration::from_secs(2),
            io_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(2),
            max_names: 65_536,
            fetch_threads: 4,
            max_queued_fetches: 1024,
            streams: 4,
            min_stream_bytes: 8 << 20,
            idle_timeout: Duration::from_secs(5),
            socket_buffer_bytes: 0,
            write_grace: Duration::from_secs(1),
            tcp_fallback: true,
            poll: Duration::ZERO,
            export_whole_allocations: false,
            unchecked_fetch: false,
        }
    }
}

crate::labels::labelled_enum! {
    /// One limit by name: the C ABI's `kvrelay_agent_limit` (`kvrelay_agent_config_set_limit`),
    /// so that limits can be added without changing a struct a caller compiled in. Durations
    /// are in milliseconds (but `poll_us`). The discriminants are stable; new limits get new ones.
    pub enum LimitKey: i32 {
        /// [`Limits::max_connections`].
        MaxConnections = 1 => "max_connections",
        /// [`Limits::max_per_peer`].
        MaxPerPeer = 2 => "max_per_peer",
        /// [`Limits::max_pending`].
        MaxPending = 3 => "max_pending",
        /// [`Limits::handshake_timeout`], ms.
        HandshakeTimeoutMs = 4 => "handshake_timeout_ms",
        /// [`Limits::io_timeout`], ms.
        IoTimeoutMs = 5 => "io_timeout_ms",
        /// [`Limits::connect_timeout`], ms.
        ConnectTimeoutMs = 6 => "connect_timeout_ms",
        /// [`Limits::max_names`].
        MaxNames = 7 => "max_names",
        /// [`Limits::fetch_threads`].
        FetchThreads = 8 => "fetch_threads",
        /// [`Limits::max_queued_fetches`].
        MaxQueuedFetches = 9 => "max_queued_fetches",
        /// [`Limits::streams`].
        Streams = 10 => "streams",
        /// [`Limits::min_stream_bytes`].
        MinStreamBytes = 11 => "min_stream_bytes",
        /// [`Limits::idle_timeout`], ms.
        IdleTimeoutMs = 12 => "idle_timeout_ms",
        /// [`Limits::socket_buffer_bytes`].
        SocketBufferBytes = 13 => "socket_buffer_bytes",
        /// [`Limits::write_grace`], ms.
        WriteGraceMs = 14 => "write_grace_ms",
        /// [`Limits::tcp_fallback`]: 1 (the default) or 0.
        TcpFallback = 15 => "tcp_fallback",
        /// [`Limits::poll`], microseconds.
        PollUs = 16 => "poll_us",
        /// [`Limits::export_whole_allocations`]: 0 (the default) or 1.
        ExportWholeAllocations = 17 => "export_whole_allocations",
        /// [`Limits::unchecked_fetch`]: 0 (the default) or 1. Since 0.4.1.
        UncheckedFetch = 18 => "unchecked_fetch",
    }
}

impl LimitKey {
    /// The key with discriminant `v`, if any.
    pub fn from_i32(v: i32) -> Option<LimitKey> {
        LimitKey::ALL.into_iter().find(|k| *k as i32 == v)
    }
}

impl Limits {
    /// The value of one limit (durations in milliseconds, `poll_us` in microseconds).
    pub fn get(&self, key: LimitKey) -> u64 {
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        match key {
            LimitKey::MaxConnections => self.max_connections.into(),
            LimitKey::MaxPerPeer => self.max_per_peer.into(),
            LimitKey::MaxPending => self.max_pending.into(),
            LimitKey::HandshakeTimeoutMs => ms(self.handshake_timeout),
            LimitKey::IoTimeoutMs => ms(self.io_timeout),
            LimitKey::ConnectTimeoutMs => ms(self.connect_timeout),
            LimitKey::MaxNames => self.max_names.into(),
            LimitKey::FetchThreads => self.fetch_threads.into(),
            LimitKey::MaxQueuedFetches => self.max_queued_fetches.into(),
            LimitKey::Streams => self.streams.into(),
            LimitKey::MinStreamBytes => self.min_stream_bytes,
            LimitKey::IdleTimeoutMs => ms(self.idle_timeout),
            LimitKey::SocketBufferBytes => self.socket_buffer_bytes.into(),
            LimitKey::WriteGraceMs => ms(self.write_grace),
            LimitKey::TcpFallback => self.tcp_fallback.into(),
            LimitKey::PollUs => u64::try_from(self.poll.as_micros()).unwrap_or(u64::MAX),
            LimitKey::ExportWholeAllocations => self.export_whole_allocations.into(),
            LimitKey::UncheckedFetch => self.unchecked_fetch.into(),
        }
    }

    /// Set one limit (durations in milliseconds, `poll_us` in microseconds), checked as [`Limits`]'s ranges say; on an
    /// error nothing changed. A value never wraps: one past its field's range is refused.
    pub fn set(&mut self, key: LimitKey, value: u64) -> Result<(), String> {
        let refuse = || format!("limit {} = {value}: out of range", key.as_str());
        let small = || u32::try_from(value).map_err(|_| refuse());
        let ms = Duration::from_millis(value);
        let flag = || match value {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(refuse()),
        };
        let mut next = self.clone();
        match key {
            LimitKey::MaxConnections => next.max_connections = small()?,
            LimitKey::MaxPerPeer => next.max_per_peer = small()?,
            LimitKey::MaxPending => next.max_pending = small()?,
            LimitKey::HandshakeTimeoutMs => next.handshake_timeout = ms,
            LimitKey::IoTimeoutMs => next.io_timeout = ms,
            LimitKey::ConnectTimeoutMs => next.connect_timeout = ms,
            LimitKey::MaxNames => next.max_names = small()?,
            LimitKey::FetchThreads => next.fetch_threads = small()?,
            LimitKey::MaxQueuedFetches => next.max_queued_fetches = small()?,
            LimitKey::Streams => next.streams = small()?,
            LimitKey::MinStreamBytes => next.min_stream_bytes = value,
            LimitKey::IdleTimeoutMs => next.idle_timeout = ms,
            LimitKey::SocketBufferBytes => next.socket_buffer_bytes = small()?,
            LimitKey::WriteGraceMs => next.write_grace = ms,
            LimitKey::TcpFallback => next.tcp_fallback = flag()?,
            LimitKey::ExportWholeAllocations => next.export_whole_allocations = flag()?,
            LimitKey::UncheckedFetch => next.unchecked_fetch = flag()?,
            LimitKey::PollUs => next.poll = Duration::from_micros(value),
        }
        next.check()?;
        *self = next;
        Ok(())
    }

    pub(super) fn check(&self) -> Result<(), String> {
        let ms = |d: Duration| d.as_millis();
        for (name, v, max) in [
            ("max_connections", self.max_connections, 4096),
            ("max_per_peer", self.max_per_peer, 4096),
            ("max_pending", self.max_pending, 4096),
            ("max_names", self.max_names, 1 << 22),
            ("fetch_threads", self.fetch_threads, 256),
            ("max_queued_fetches", self.max_queued_fetches, 1 << 20),
            ("streams", self.streams, 16),
        ] {
            if v == 0 || v > max {
                return Err(format!("limit {name} = {v}: expected 1..={max}"));
            }
        }
        if self.min_stream_bytes == 0 {
            return Err("limit min_stream_bytes = 0: expected at least 1".into());
        }
        if ms(self.idle_timeout) > 3_600_000 {
            return Err(format!("limit idle_timeout = {} ms: expected 0..=3600000 ms", ms(self.idle_timeout)));
        }
        if self.poll > MAX_POLL {
            return Err(format!("limit poll = {} us: expected 0..=10000 us", self.poll.as_micros()));
        }
        if ms(self.write_grace) > 60_000 {
            return Err(format!("limit write_grace = {} ms: expected 0..=60000 ms", ms(self.write_grace)));
        }
        for (name, d) in [
            ("handshake_timeout", self.handshake_timeout),
            ("io_timeout", self.io_timeout),
            ("connect_timeout", self.connect_timeout),
        ] {
            if ms(d) == 0 || ms(d) > 3_600_000 {
                return Err(format!("limit {name} = {} ms: expected 1..=3600000 ms", ms(d)));
            }
        }
        Ok(())
    }
}

/// How an agent is set up.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    /// This instance's layout fingerprint.
    pub fingerprint: Fingerprint,
    /// Where the KV service listens (`host:port`, port 0 picks one); `None` serves nothing
    /// (a fetch-only agent).
    pub listen: Option<String>,
    /// Peers the service accepts (default: loopback).
    pub allow: PeerAllow,
    /// Limits.
    pub limits: Limits,
    /// A pre-shared key both sides must prove they hold (the deployment's key); `None`: the
    /// per-user key when [`AgentConfig::per_user_key`] says so, else no authentication.
    pub key: Option<Psk>,
    /// With no `key`: `true` (the default) authenticates with the key this process's user holds
    /// alone ([`auth::per_user_key`](super::auth::per_user_key), created on first use), so
    /// agents of one user on one host reach each other and no other user's process gets in;
    /// `false` runs without authentication: any allowlisted peer may then fetch over TCP, and
    /// no grant of memory (a CUDA IPC handle, a virtual-memory descriptor, a NIXL
    /// registration) leaves the agent: their hellos are refused as `unsupported`, and a
    /// fetcher falls back to TCP.
    pub per_user_key: bool,
    /// The CUDA device whose memory the pool is (`None`: host memory).
    pub device: Option<i32>,
    /// How block bytes move ([`Transport::Tcp`] by default).
    pub transport: Transport,
}

/// How block bytes move between agents. Control (the handshake, authentication, offers) always
/// runs on the agent's TCP connection.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Transport {
    /// Blocks travel on the TCP connection (the embedded default: one host, CI, any network).
    #[default]
    Tcp,
    /// Blocks move with NIXL over UCX, read by the destination straight out of the source's
    /// pool into its own ([`nixl`](crate::agent) module, cargo feature `nixl`). The service
    /// then serves both NIXL and TCP readers; fetches read over NIXL. `lib_dir` is the folder
    /// of `libnixl_capi.so` (`None`: the loader's search path).
    Nixl {
        /// Folder of the NIXL libraries.
        lib_dir: Option<std::path::PathBuf>,
    },
    /// Blocks move device to device between two agents of one host: the destination maps the
    /// source's pool through CUDA IPC and copies the blocks straight into its own
    /// (`transport::cuda_ipc`). Both pools must be device memory it can export: from
    /// `cuMemAlloc`/`cudaMalloc`, or from `cuMemCreate` with the POSIX file-descriptor handle
    /// type (not `cudaMallocAsync`). The service then serves both CUDA IPC and TCP readers;
    /// fetches copy over CUDA IPC and fail (refused) from a source on another host.
    CudaIpc,
    /// Several transports in order of preference, each source fetched from with the first of
    /// them that reaches it: a fetch that one of them cannot make (the source does not serve
    /// it, runs on another host for CUDA IPC, its memory cannot be mapped or registered here)
    /// before any block moved is made again with the next, and that source is fetched from
    /// with the next for [`TCP_FALLBACK_MEMORY`]; after the last comes TCP when
    /// [`Limits::tcp_fallback`] allows. The service serves every one of them, and TCP. Both of
    /// [`Transport::CudaIpc`] and [`Transport::Nixl`], once each, in either order (say,
    /// `[CudaIpc, Nixl]`: same-host sources over CUDA IPC, the others over NIXL).
    Prefer(Vec<Transport>),
}

impl Transport {
    /// The transports a fetch may use in order (TCP not included); `Err` for a preference list
    /// other than NIXL and CUDA IPC once each.
    pub(crate) fn chain(&self) -> Result<Vec<&Transport>, String> {
        match self {
            Transport::Prefer(list) => match list.as_slice() {
                [a @ Transport::CudaIpc, b @ Transport::Nixl { .. }]
                | [a @ Transport::Nixl { .. }, b @ Transport::CudaIpc] => Ok(vec![a, b]),
                _ => Err("a transport preference lists nixl and cuda-ipc, once each, in either order (TCP comes \
                          last by itself)"
                    .into()),
            },
            t => Ok(vec![t]),
        }
    }
}

impl AgentConfig {
    /// Defaults: listen on `127.0.0.1:0`, loopback peers, default limits, the per-user key.
    pub fn new(fingerprint: Fingerprint) -> AgentConfig {
        AgentConfig {
            fingerprint,
            listen: Some("127.0.0.1:0".into()),
            allow: PeerAllow::loopback(),
            limits: Limits::default(),
            key: None,
            per_user_key: true,
            device: None,
            transport: Transport::Tcp,
        }
    }
}
