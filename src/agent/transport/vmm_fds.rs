//! How the CUDA IPC transport hands the POSIX file descriptors of its export areas (allocations
//! of the virtual memory API, `cuMemCreate`) to a destination on the same host: descriptors
//! travel only over a Unix socket (`SCM_RIGHTS`), not over the agent's TCP connection.
//!
//! - **The source** listens on a Unix socket in the abstract namespace
//!   (`kvrelay-cuda-ipc-<pid>-<random>`: nothing in the file system, gone with the process) and
//!   keeps a grant per export area ([`FdServer::add`]): its descriptors under a random 32-byte
//!   token drawn for it. Its offers, sent only on authenticated, allowlisted connections, name
//!   the socket and carry the area's token.
//! - **A destination** that has not mapped the area yet connects, reads a fresh nonce the
//!   source draws for that connection, answers with a keyed proof of the token (HMAC-SHA-256 of
//!   the nonce under the token), and reads every descriptor, in batches of at most [`BATCH`]
//!   per message. The token itself never crosses the socket, and an answer is good for its own
//!   connection only: a recorded exchange is no key.
//! - **Who.** Any local process of the network namespace can connect; one of another user
//!   (`SO_PEERCRED`) is closed at once, having received nothing. A grant goes to the first
//!   process that proves its token and to no other (its `SO_PEERCRED` pid): a token that leaks
//!   to another process of the user gets that process nothing. The destination checks the
//!   other way too: the process listening on the socket must be the one the offer names (its
//!   `SO_PEERCRED` pid), since any process may listen under any abstract name; so a mapping's
//!   quota is charged to the real source process. A source whose pid this process cannot see
//!   (another PID namespace) is refused here, and the fetch falls back to TCP.
//! - **Bounds.** One that does not prove a token within [`DEADLINE`] is closed having
//!   received nothing; at most [`MAX_HANDLERS`] connections are served at once, each for at
//!   most [`DEADLINE`] per read and per write. When all are taken, the oldest connection that
//!   has not proven a token yet is closed to make room (silent connections cannot keep a
//!   destination out); a new connection is closed at once only when every handler is sending
//!   descriptors. A peer that fails here fetches over TCP (the transport's fallback).

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::time::{Duration, Instant};

/// Bytes of the token a destination proves it received an offer with.
pub(crate) const TOKEN: usize = 32;
/// Descriptors per message (the kernel's limit, `SCM_MAX_FD`, is 253).
pub(crate) const BATCH: usize = 250;
/// Connections served at once.
const MAX_HANDLERS: usize = 8;
/// Time a connection has for the token, and each write of descriptors.
const DEADLINE: Duration = Duration::from_secs(1);

/// The socket name prefix; the full name is `kvrelay-cuda-ipc-<pid>-<16 hex digits>`.
const PREFIX: &str = "kvrelay-cuda-ipc-";

/// Whether `name` is the descriptor socket of process `pid` as [`FdServer::start`] names it
/// (so that an offer cannot aim a destination at any other socket).
pub(crate) fn is_socket_of(name: &[u8], pid: u32) -> bool {
    let head = format!("{PREFIX}{pid}-");
    name.strip_prefix(head.as_bytes())
        .is_some_and(|hex| hex.len() == 16 && hex.iter().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b)))
}

fn mac(token: &[u8; TOKEN], nonce: &[u8; TOKEN]) -> Hmac<Sha256> {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(token).expect("HMAC takes any key length");
    m.update(b"kvrelay-cuda-ipc-fds/v1");
    m.update(nonce);
    m
}

/// The destination's answer to the source's `nonce`: a keyed proof that it holds `token`.
fn proof(token: &[u8; TOKEN], nonce: &[u8; TOKEN]) -> [u8; TOKEN] {
    mac(token, nonce).finalize().into_bytes().into()
}

/// The user id of the process at the other end of `s` (`SO_PEERCRED`).
fn peer_uid(s: &UnixStream) -> io::Result<libc::uid_t> {
    peer_cred(s).map(|c| c.uid)
}

/// The credentials of the process at the other end of `s` (`SO_PEERCRED`: for a connection to
/// a listener, the process that made the listener).
fn peer_cred(s: &UnixStream) -> io::Result<libc::ucred> {
    // SAFETY: a zeroed ucred is valid; getsockopt writes at most `len` bytes into it.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: a live socket; `cred` and `len` live across the call with the size given.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cred)
}

/// Connections that have not proven the token yet, oldest first: the handlers' slots they hold
/// are what a newer connection may take (see the module docs).
#[derive(Default)]
struct Unproven {
    next: u64,
    conns: VecDeque<(u64, UnixStream, Arc<AtomicBool>)>,
}

impl Unproven {
    /// Close the oldest unproven connection and hand its slot over (its handler then does not
    /// give the slot back). False when there is none.
    fn evict_oldest(&mut self) -> bool {
        let Some((_, s, handed)) = self.conns.pop_front() else { return false };
        handed.store(true, Ordering::Release);
        let _ = s.shutdown(std::net::Shutdown::Both);
        true
    }
}

/// Descriptors handed out under one token ([`FdServer::add`]).
struct Grant {
    token: [u8; TOKEN],
    fds: Arc<Vec<OwnedFd>>,
    /// Bound to the first process that proves the token (`SO_PEERCRED` pid): an export area's
    /// memory goes to one peer process only. `None` while nobody took it.
    holder: Option<i32>,
}

/// The grants a server hands out, by token.
type Grants = Arc<Mutex<Vec<Grant>>>;

/// The source's listener: hands each grant's descriptors ([`FdServer::add`]) to the first process
/// that proves its token, and to no other. Stops when dropped.
pub(crate) struct FdServer {
    name: Vec<u8>,
    grants: Grants,
    stop: Arc<AtomicBool>,
    /// The listener's descriptor (owned by the thread): shut down to wake its accept.
    listener_fd: std::os::fd::RawFd,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FdServer {
    /// Listen on a new abstract socket, with no grant yet ([`FdServer::add`] makes them), and
    /// serve it from a thread of its own.
    pub(crate) fn start() -> Result<FdServer, String> {
        let salt = crate::agent::auth::nonce().map_err(|e| format!("CUDA IPC: no random name: {e}"))?;
        let hex: String = salt[..8].iter().map(|b| format!("{b:02x}")).collect();
        let name = format!("{PREFIX}{}-{hex}", std::process::id()).into_bytes();
        let addr = SocketAddr::from_abstract_name(&name).map_err(|e| format!("CUDA IPC: socket name: {e}"))?;
        let listener =
            UnixListener::bind_addr(&addr).map_err(|e| format!("CUDA IPC: listening for descriptor requests: {e}"))?;
        let stop = Arc::new(AtomicBool::new(false));
        let listener_fd = listener.as_raw_fd();
        let grants: Grants = Arc::new(Mutex::new(Vec::new()));
        let (served, stop2) = (grants.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("kvrelay-ipc-fds".into())
            .stack_size(256 << 10)
            .spawn(move || accept_loop(&listener, &served, &stop2))
            .map_err(|e| format!("CUDA IPC: starting the descriptor thread: {e}"))?;
        Ok(FdServer { name, grants, stop, listener_fd, thread: Some(thread) })
    }

    /// Hand `fds` out under a new token (returned), to the first process that proves it and to
    /// no other (its `SO_PEERCRED` pid; that process may take them again), until
    /// [`FdServer::remove`]. The descriptors are closed here when the grant is removed.
    pub(crate) fn add(&self, fds: Vec<OwnedFd>) -> Result<[u8; TOKEN], String> {
        let token = crate::agent::auth::nonce().map_err(|e| format!("CUDA IPC: no random token: {e}"))?;
        let mut g = self.grants.lock().unwrap_or_else(|e| e.into_inner());
        g.push(Grant { token, fds: Arc::new(fds), holder: None });
        Ok(token)
    }

    /// Stop handing out the grant of `token` (a connection sending it now may still finish).
    pub(crate) fn remove(&self, token: &[u8; TOKEN]) {
        self.grants.lock().unwrap_or_else(|e| e.into_inner()).retain(|g| &g.token != token);
    }

    /// The process a grant of [`FdServer::add`] went to, once one took it.
    #[cfg(test)]
    pub(crate) fn holder(&self, token: &[u8; TOKEN]) -> Option<i32> {
        let g = self.grants.lock().unwrap_or_else(|e| e.into_inner());
        g.iter().find(|g| &g.token == token).and_then(|g| g.holder)
    }

    /// The socket's abstract name.
    pub(crate) fn name(&self) -> &[u8] {
        &self.name
    }
}

impl Drop for FdServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // wake the accept: a listening socket shut down makes it return at once (Linux)
        // SAFETY: the listener's descriptor, open until the thread (which owns it) ends, which
        // is joined only below; shutdown neither closes nor frees it.
        unsafe { libc::shutdown(self.listener_fd, libc::SHUT_RDWR) };
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn accept_loop(listener: &UnixListener, grants: &Grants, stop: &AtomicBool) {
    let active = Arc::new(AtomicUsize::new(0));
    let unproven = Arc::new(Mutex::new(Unproven::default()));
    // SAFETY: geteuid cannot fail.
    let me = unsafe { libc::geteuid() };
    for conn in listener.incoming() {
        if stop.load(Ordering::Acquire) {
            return;
        }
        let Ok(s) = conn else {
            // out of descriptors or memory for a moment: do not spin on it
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        if peer_uid(&s).ok() != Some(me) {
            continue; // another user's process: closed at once
        }
        let Ok(watch) = s.try_clone() else { continue };
        let handed = Arc::new(AtomicBool::new(false));
        let id = {
            let mut u = unproven.lock().unwrap_or_else(|e| e.into_inner());
            // a free handler, or the slot of the oldest connection that has not proven the token
            if active.fetch_add(1, Ordering::AcqRel) >= MAX_HANDLERS {
                active.fetch_sub(1, Ordering::AcqRel);
                if !u.evict_oldest() {
                    continue; // every handler is sending descriptors: closed at once
                }
                active.fetch_add(1, Ordering::AcqRel); // the evicted one's slot, handed over
            }
            u.next += 1;
            let id = u.next;
            u.conns.push_back((id, watch, handed.clone()));
            id
        };
        let (grants, active2, unproven2, handed2) = (grants.clone(), active.clone(), unproven.clone(), handed.clone());
        let spawned =
            std::thread::Builder::new().name("kvrelay-ipc-fd".into()).stack_size(128 << 10).spawn(move || {
                let proven = || unproven2.lock().unwrap_or_else(|e| e.into_inner()).conns.retain(|(i, ..)| *i != id);
                let _ = serve_one(s, &grants, proven);
                unproven2.lock().unwrap_or_else(|e| e.into_inner()).conns.retain(|(i, ..)| *i != id);
                if !handed2.load(Ordering::Acquire) {
                    active2.fetch_sub(1, Ordering::AcqRel);
                }
            });
        if spawned.is_err() {
            unproven.lock().unwrap_or_else(|e| e.into_inner()).conns.retain(|(i, ..)| *i != id);
            if !handed.load(Ordering::Acquire) {
                active.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }
}

/// The time left until `end`, at least a millisecond; `TimedOut` once it passed.
fn left(end: Instant) -> io::Result<Duration> {
    let l = end.saturating_duration_since(Instant::now());
    if l.is_zero() {
        return Err(io::ErrorKind::TimedOut.into());
    }
    Ok(l.max(Duration::from_millis(1)))
}

/// One connection: a fresh nonce out, the proof of a grant's token back within [`DEADLINE`] of
/// the accept (however it trickles in), then (`proven` called first) that grant's descriptors,
/// each batch's write within [`DEADLINE`]. A grant bound to another process is refused as a
/// wrong proof is: closed, nothing sent.
fn serve_one(mut s: UnixStream, grants: &Mutex<Vec<Grant>>, proven: impl FnOnce()) -> io::Result<()> {
    let end = Instant::now() + DEADLINE;
    let nonce = crate::agent::auth::nonce()?;
    s.set_write_timeout(Some(left(end)?))?;
    s.write_all(&nonce)?;
    let mut got = [0u8; TOKEN];
    let mut n = 0;
    while n < TOKEN {
        s.set_read_timeout(Some(left(end)?))?;
        match s.read(&mut got[n..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let pid = peer_cred(&s)?.pid;
    let fds = {
        let mut g = grants.lock().unwrap_or_else(|e| e.into_inner());
        // a few grants at most (one per live export area): each proof checked in constant time
        let grant = g.iter_mut().find(|g| mac(&g.token, &nonce).verify_slice(&got).is_ok());
        match grant {
            Some(g) if pid > 0 && g.holder.is_none_or(|h| h == pid) => {
                g.holder = Some(pid);
                g.fds.clone()
            }
            _ => return Err(io::ErrorKind::PermissionDenied.into()),
        }
    };
    proven();
    for batch in fds.chunks(BATCH) {
        s.set_write_timeout(Some(DEADLINE))?;
        send_batch(&s, batch)?;
    }
    Ok(())
}

/// One message: a byte (the batch's count) and the descriptors as `SCM_RIGHTS`.
fn send_batch(s: &UnixStream, batch: &[OwnedFd]) -> io::Result<()> {
    let raw: Vec<libc::c_int> = batch.iter().map(AsRawFd::as_raw_fd).collect();
    let bytes = raw.len() * std::mem::size_of::<libc::c_int>();
    // SAFETY: pure size computations.
    let (space, len) = unsafe { (libc::CMSG_SPACE(bytes as u32) as usize, libc::CMSG_LEN(bytes as u32) as usize) };
    let mut control = vec![0u64; space.div_ceil(8)]; // aligned for cmsghdr
    let mut payload = [raw.len() as u8];
    let mut iov = libc::iovec { iov_base: payload.as_mut_ptr().cast(), iov_len: 1 };
    // SAFETY: a zeroed msghdr is valid (no pointers yet); every pointer set below points into
    // locals that outlive the sendmsg call, with the lengths given; CMSG_FIRSTHDR is non-null
    // because the control buffer holds at least one header (CMSG_SPACE of the data).
    let sent = unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = len as _;
        std::ptr::copy_nonoverlapping(raw.as_ptr().cast::<u8>(), libc::CMSG_DATA(c), bytes);
        libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_NOSIGNAL)
    };
    match sent {
        1 => Ok(()),
        n if n < 0 => Err(io::Error::last_os_error()),
        _ => Err(io::ErrorKind::WriteZero.into()),
    }
}

/// A connection to the abstract socket `name` by `deadline`: a connect that does not wait
/// (a listener whose backlog is full answers "try again", retried every millisecond, with
/// `stop` asked before each retry: `Interrupted` once it says so), then the stream made
/// blocking for its timed reads and writes.
fn connect_by(name: &[u8], deadline: Instant, stop: &dyn Fn() -> bool) -> io::Result<UnixStream> {
    // SAFETY: a plain zeroed sockaddr_un is valid; the name fits (checked) after the leading 0
    // byte of an abstract address.
    let mut sa: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if name.is_empty() || name.len() >= sa.sun_path.len() {
        return Err(io::ErrorKind::InvalidInput.into());
    }
    sa.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (o, &b) in sa.sun_path[1..].iter_mut().zip(name) {
        *o = b as libc::c_char;
    }
    let len = (std::mem::size_of::<libc::sa_family_t>() + 1 + name.len()) as libc::socklen_t;
    // SAFETY: a new socket; its descriptor is owned by the OwnedFd right away.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is the descriptor just opened, owned from here.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    loop {
        // SAFETY: `sa` is a valid AF_UNIX address of `len` bytes; `fd` is open.
        let r = unsafe { libc::connect(fd, (&sa as *const libc::sockaddr_un).cast(), len) };
        if r == 0 {
            break;
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EAGAIN) | Some(libc::EINTR) if stop() => {
                return Err(io::Error::new(io::ErrorKind::Interrupted, "stopped while connecting"))
            }
            Some(libc::EAGAIN) | Some(libc::EINTR) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(1));
            }
            Some(libc::EAGAIN) => return Err(io::ErrorKind::TimedOut.into()),
            _ => return Err(e),
        }
    }
    let s = UnixStream::from(owned);
    s.set_nonblocking(false)?;
    Ok(s)
}

/// How long one blocking read of [`receive`] waits before it looks at its stop check again.
const STOP_SLICE: Duration = Duration::from_millis(20);

/// Why [`receive`] failed.
#[derive(Debug)]
pub(crate) enum ReceiveError {
    /// Its stop check asked it to stop (a cancel, the agent's shutdown).
    Stopped,
    /// Anything else, for the log.
    Failed(String),
}

impl std::fmt::Display for ReceiveError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReceiveError::Stopped => f.write_str("stopped"),
            ReceiveError::Failed(e) => f.write_str(e),
        }
    }
}

impl From<String> for ReceiveError {
    fn from(e: String) -> ReceiveError {
        ReceiveError::Failed(e)
    }
}

/// Destination side: connect to the source's socket `name`, check that the process listening
/// there is `pid` (the kernel's `SO_PEERCRED`, not the name: any process may listen under any
/// abstract name, so an offer's claimed pid is proven here before anything is taken), prove
/// `token` (a keyed answer to the source's nonce), and pass each of
/// the `want` descriptors it sends to `each` as it arrives (so that at most one batch is open
/// at a time), by `deadline`. Fails on any shortfall or excess, or when `each` does. Every
/// wait for the source is cut into slices of [`STOP_SLICE`], with `stop` asked between them:
/// a cancel or the agent's shutdown ends the receive within a slice ([`ReceiveError::Stopped`]).
pub(crate) fn receive(
    name: &[u8],
    pid: u32,
    token: &[u8; TOKEN],
    want: usize,
    deadline: Instant,
    stop: &dyn Fn() -> bool,
    mut each: impl FnMut(OwnedFd) -> Result<(), String>,
) -> Result<(), ReceiveError> {
    let mut s = connect_by(name, deadline, stop).map_err(|e| match e.kind() {
        io::ErrorKind::Interrupted => ReceiveError::Stopped,
        _ => format!("connecting to the source's descriptor socket (another network namespace?): {e}").into(),
    })?;
    match peer_cred(&s) {
        Ok(c) if c.pid > 0 && c.pid as u32 == pid => {}
        Ok(c) => {
            return Err(format!("the descriptor socket belongs to process {}, not to the offer's {pid}", c.pid).into())
        }
        Err(e) => return Err(format!("the descriptor socket's peer: {e}").into()),
    }
    let remaining = || left(deadline).map_err(|_| "the source's descriptors ran past the deadline".to_string());
    // the next wait: a slice of what is left, or the stop
    let slice = || -> Result<Duration, ReceiveError> {
        if stop() {
            return Err(ReceiveError::Stopped);
        }
        Ok(remaining()?.min(STOP_SLICE))
    };
    let mut nonce = [0u8; TOKEN];
    let mut have = 0;
    while have < TOKEN {
        s.set_read_timeout(Some(slice()?)).map_err(|e| e.to_string())?;
        match s.read(&mut nonce[have..]) {
            Ok(0) => return Err("reading the source's nonce: the source closed its socket".to_string().into()),
            Ok(n) => have += n,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
                ) => {}
            Err(e) => return Err(format!("reading the source's nonce: {e}").into()),
        }
    }
    // a 32-byte write into an empty socket buffer: it does not wait
    s.set_write_timeout(Some(remaining()?)).map_err(|e| e.to_string())?;
    s.write_all(&proof(token, &nonce)).map_err(|e| format!("proving the token: {e}"))?;
    let mut got = 0usize;
    let bytes = BATCH * std::mem::size_of::<libc::c_int>();
    // SAFETY: a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(bytes as u32) } as usize;
    let mut control = vec![0u64; space.div_ceil(8)];
    while got < want {
        s.set_read_timeout(Some(slice()?)).map_err(|e| e.to_string())?;
        let mut payload = [0u8; 1];
        let mut iov = libc::iovec { iov_base: payload.as_mut_ptr().cast(), iov_len: 1 };
        let mut fds: Vec<OwnedFd> = Vec::new();
        // SAFETY: a zeroed msghdr is valid; its pointers point into locals that outlive the
        // call, with their lengths; every descriptor the kernel passed is taken into an
        // OwnedFd (closed on every path), read unaligned out of the control buffer within the
        // length its header gives.
        let (n, flags) = unsafe {
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = &mut iov;
            msg.msg_iovlen = 1;
            msg.msg_control = control.as_mut_ptr().cast();
            msg.msg_controllen = space as _;
            let n = libc::recvmsg(s.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC);
            if n > 0 {
                let mut c = libc::CMSG_FIRSTHDR(&msg);
                while !c.is_null() {
                    if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                        let data = ((*c).cmsg_len as usize).saturating_sub(libc::CMSG_LEN(0) as usize);
                        let p = libc::CMSG_DATA(c);
                        for k in 0..data / std::mem::size_of::<libc::c_int>() {
                            let fd = std::ptr::read_unaligned(
                                p.add(k * std::mem::size_of::<libc::c_int>()).cast::<libc::c_int>(),
                            );
                            fds.push(OwnedFd::from_raw_fd(fd));
                        }
                    }
                    c = libc::CMSG_NXTHDR(&msg, c);
                }
            }
            (n, msg.msg_flags)
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted) {
                // the slice passed with nothing read (nothing consumed): look at the stop again
                continue;
            }
            return Err(format!("reading descriptors: {e}").into());
        }
        if n == 0 {
            return Err(
                format!("the source closed its descriptor socket after {got} of {want} (a wrong token?)").into()
            );
        }
        if flags & libc::MSG_CTRUNC != 0 {
            return Err("descriptors were cut off (this process's open-file limit?)".to_string().into());
        }
        if fds.is_empty() || fds.len() != usize::from(payload[0]) || got + fds.len() > want {
            return Err(
                format!("the source sent {} descriptors in a batch it said held {}", fds.len(), payload[0]).into()
            );
        }
        got += fds.len();
        for fd in fds {
            each(fd)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pipes(n: usize) -> Vec<OwnedFd> {
        (0..n)
            .map(|_| {
                let mut p = [0 as libc::c_int; 2];
                // SAFETY: `p` holds two ints for the kernel to write.
                assert_eq!(unsafe { libc::pipe(p.as_mut_ptr()) }, 0);
                // SAFETY: the write end is ours; the read end becomes the OwnedFd.
                unsafe {
                    libc::close(p[1]);
                    OwnedFd::from_raw_fd(p[0])
                }
            })
            .collect()
    }

    /// Descriptors cross in batches to the holder of the token, and to nobody else.
    #[test]
    fn descriptors_go_to_the_token_holder_only() {
        let n = BATCH + 7;
        let server = FdServer::start().unwrap();
        let token = server.add(pipes(n)).unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut received = Vec::new();
        receive(server.name(), std::process::id(), &token, n, deadline, &|| false, |fd| {
            received.push(fd);
            Ok(())
        })
        .unwrap();
        assert_eq!(received.len(), n);
        // each is a live descriptor of this process (a pipe's read end)
        for fd in &received {
            // SAFETY: an open descriptor; F_GETFD only reads its flags.
            let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFD) };
            assert!(flags >= 0 && flags & libc::FD_CLOEXEC != 0, "received close-on-exec");
        }
        // a wrong token: nothing, and the error says the source closed
        let mut wrong = token;
        wrong[0] ^= 1;
        let mut none = 0;
        let e = receive(server.name(), std::process::id(), &wrong, n, deadline, &|| false, |_| {
            none += 1;
            Ok(())
        })
        .unwrap_err();
        assert_eq!(none, 0, "{e}");
        assert!(e.to_string().contains("closed"), "{e}");
        // an offer claiming another process for this socket (any process may listen under any
        // abstract name): refused by the kernel's credentials, with nothing taken
        let mut taken = 0;
        let e = receive(server.name(), std::process::id() + 1, &token, n, deadline, &|| false, |_| {
            taken += 1;
            Ok(())
        })
        .unwrap_err();
        assert_eq!(taken, 0, "{e}");
        assert!(e.to_string().contains("belongs to process"), "{e}");
        // asking for fewer than the source sends: an excess, refused
        let e = receive(server.name(), std::process::id(), &token, 3, deadline, &|| false, |_| Ok(())).unwrap_err();
        assert!(e.to_string().contains("batch"), "{e}");
        // the name is the server's own, and nothing else passes for one
        let pid = std::process::id();
        assert!(is_socket_of(server.name(), pid));
        assert!(!is_socket_of(server.name(), pid + 1), "another process's");
        for bad in [&b"kvrelay-cuda-ipc-1-0123456789abcdeg"[..], b"kvrelay-cuda-ipc-1-0123456789abcde", b"", b"x"] {
            assert!(!is_socket_of(bad, 1), "{}", String::from_utf8_lossy(bad));
        }
        assert!(is_socket_of(b"kvrelay-cuda-ipc-1-0123456789abcdef", 1));
        // a socket nobody listens on
        drop(server);
        assert!(receive(b"kvrelay-cuda-ipc-nobody", std::process::id(), &[0; TOKEN], 1, deadline, &|| false, |_| Ok(
            ()
        ))
        .is_err());
    }

    /// A source that accepts and never says a word does not hold the destination past its
    /// stop check (a cancel, the agent's shutdown), however far its deadline.
    #[test]
    fn a_silent_source_is_left_when_the_fetch_stops() {
        use std::os::linux::net::SocketAddrExt;
        let name = format!("kvrelay-test-silent-{}", std::process::id());
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let _silent = std::os::unix::net::UnixListener::bind_addr(&addr).unwrap();
        let asked = std::sync::atomic::AtomicU32::new(0);
        // stops once it was asked three times: the receive was waiting, and looked again
        let stop = || asked.fetch_add(1, std::sync::atomic::Ordering::Relaxed) >= 3;
        let far = Instant::now() + Duration::from_secs(3600);
        let e = receive(name.as_bytes(), std::process::id(), &[0; TOKEN], 1, far, &stop, |_| Ok(())).unwrap_err();
        assert!(matches!(e, ReceiveError::Stopped), "{e}");
    }

    /// A source whose listening socket's backlog is full (listen(0) and one connection pending,
    /// never accepted): the connect itself waits, and a stop ends it there.
    #[test]
    fn a_stop_ends_a_connect_to_a_full_backlog() {
        let name = format!("kvrelay-test-full-{}", std::process::id());
        // SAFETY: a new socket, owned right away; a zeroed sockaddr_un with an abstract name
        // that fits; bind and listen on the descriptor just opened.
        let listener = unsafe {
            let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
            assert!(fd >= 0);
            let owned = OwnedFd::from_raw_fd(fd);
            let mut sa: libc::sockaddr_un = std::mem::zeroed();
            sa.sun_family = libc::AF_UNIX as libc::sa_family_t;
            for (o, &b) in sa.sun_path[1..].iter_mut().zip(name.as_bytes()) {
                *o = b as libc::c_char;
            }
            let len = (std::mem::size_of::<libc::sa_family_t>() + 1 + name.len()) as libc::socklen_t;
            assert_eq!(libc::bind(fd, (&sa as *const libc::sockaddr_un).cast(), len), 0);
            assert_eq!(libc::listen(fd, 0), 0);
            owned
        };
        let _pending = connect(name.as_bytes());
        let asked = std::sync::atomic::AtomicU32::new(0);
        // stops once it was asked three times: the connect was retrying, and looked again
        let stop = || asked.fetch_add(1, std::sync::atomic::Ordering::Relaxed) >= 3;
        let by = Instant::now() + Duration::from_secs(30);
        let e = receive(name.as_bytes(), std::process::id(), &[0; TOKEN], 1, by, &stop, |_| Ok(())).unwrap_err();
        assert!(matches!(e, ReceiveError::Stopped), "{e}");
        drop(listener);
    }

    fn connect(name: &[u8]) -> UnixStream {
        connect_by(name, Instant::now() + Duration::from_secs(30), &|| false).unwrap()
    }

    /// Silent local connections, as many as there are handlers, do not keep a destination out:
    /// the oldest of them makes room.
    #[test]
    fn silent_connections_make_room_for_a_destination() {
        let server = FdServer::start().unwrap();
        let token = server.add(pipes(3)).unwrap();
        let silent: Vec<UnixStream> = (0..3 * MAX_HANDLERS).map(|_| connect(server.name())).collect();
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut n = 0;
        receive(server.name(), std::process::id(), &token, 3, deadline, &|| false, |_| {
            n += 1;
            Ok(())
        })
        .unwrap();
        assert_eq!(n, 3);
        drop(silent);
    }

    /// The token never crosses the socket, and an answer is good for its own connection only.
    #[test]
    fn a_recorded_answer_is_no_key() {
        let server = FdServer::start().unwrap();
        let token = server.add(pipes(2)).unwrap();
        let mut a = connect(server.name());
        a.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut nonce = [0u8; TOKEN];
        a.read_exact(&mut nonce).unwrap();
        let answer = proof(&token, &nonce);
        assert_ne!(&answer, &token);
        a.write_all(&answer).unwrap();
        let mut one = [0u8; 1];
        assert_eq!(a.read(&mut one).unwrap(), 1, "the first batch came");
        // the same answer on a new connection (another nonce): closed, nothing sent
        let mut b = connect(server.name());
        b.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut other = [0u8; TOKEN];
        b.read_exact(&mut other).unwrap();
        assert_ne!(nonce, other, "a fresh nonce per connection");
        b.write_all(&answer).unwrap();
        let mut rest = Vec::new();
        let _ = b.read_to_end(&mut rest);
        assert!(rest.is_empty(), "nothing for a replayed answer");
        // the token itself is no answer either
        let mut c = connect(server.name());
        c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        c.read_exact(&mut other).unwrap();
        c.write_all(&token).unwrap();
        let _ = c.read_to_end(&mut rest);
        assert!(rest.is_empty(), "nothing for the bare token");
    }

    /// A grant made with `add` goes to the first process that proves its token, and then to no
    /// other: another process with the token (run here as this test binary again) gets
    /// nothing. A grant nobody took goes to that other process; a removed grant to nobody.
    #[test]
    fn a_grant_goes_to_one_process_only() {
        const CHILD: &str = "KVRELAY_TEST_FD_CHILD";
        let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        let unhex = |h: &str| {
            (0..h.len()).step_by(2).map(|i| u8::from_str_radix(&h[i..i + 2], 16).unwrap()).collect::<Vec<u8>>()
        };
        let deadline = || Instant::now() + Duration::from_secs(30);
        if let Ok(arg) = std::env::var(CHILD) {
            // the other process: name, token and the server's pid
            let parts: Vec<&str> = arg.split(':').collect();
            let (name, token, pid) = (unhex(parts[0]), unhex(parts[1]), parts[2].parse::<u32>().unwrap());
            let token: [u8; TOKEN] = token.try_into().unwrap();
            let r = receive(&name, pid, &token, 1, deadline(), &|| false, |_| Ok(()));
            println!("CHILD {}", if r.is_ok() { "took" } else { "refused" });
            return;
        }
        let server = FdServer::start().unwrap();
        let me = std::process::id();
        let other = |token: &[u8; TOKEN]| {
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--exact", "agent::transport::vmm_fds::tests::a_grant_goes_to_one_process_only", "--nocapture"])
                .env(CHILD, format!("{}:{}:{me}", hex(server.name()), hex(token)))
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout).to_string();
            assert!(out.status.success(), "{text}");
            text.contains("CHILD took")
        };
        let token = server.add(pipes(1)).unwrap();
        assert_eq!(server.holder(&token), None);
        for _ in 0..2 {
            receive(server.name(), me, &token, 1, deadline(), &|| false, |_| Ok(())).unwrap();
            assert_eq!(server.holder(&token), Some(me as i32), "bound to this process, which may take it again");
        }
        assert!(!other(&token), "another process with the token gets nothing");
        let second = server.add(pipes(1)).unwrap();
        assert!(other(&second), "a grant nobody took goes to the first that proves its token");
        assert!(server.holder(&second).is_some_and(|p| p != me as i32));
        let e = receive(server.name(), me, &second, 1, deadline(), &|| false, |_| Ok(())).unwrap_err();
        assert!(e.to_string().contains("closed"), "{e}");
        server.remove(&token);
        let e = receive(server.name(), me, &token, 1, deadline(), &|| false, |_| Ok(())).unwrap_err();
        assert!(e.to_string().contains("closed"), "a removed grant: {e}");
    }

    #[test]
    fn the_peer_is_known_by_its_user() {
        let (a, _b) = UnixStream::pair().unwrap();
        // SAFETY: geteuid cannot fail.
        assert_eq!(peer_uid(&a).unwrap(), unsafe { libc::geteuid() });
    }
}
