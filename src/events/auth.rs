//! Who may read the KV events: the ZAP handler both sockets ask (ZeroMQ's authentication
//! protocol, on an in-process socket), the address allowlist and, with a key, the PLAIN
//! subscriber token (the module docs of [`crate::events`], "Hostile input" and "Keys").

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;

use super::{wait_readable, Counters};
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

/// The ZAP domain both sockets name (a NULL-mechanism socket asks ZAP only when it has one).
pub(super) const ZAP_DOMAIN: &str = "kvrelay-kv-events";

/// Answer ZeroMQ's authentication requests (ZAP 1.0, `inproc://zeromq.zap.01` of `ctx`) from a
/// thread of its own until `stop` is signalled: a peer whose address `allow` admits and that
/// presents `token` (when there is one) gets `200`, any other `400`.
pub(super) fn start_zap(
    ctx: &zmq::Context,
    allow: PeerAllow,
    token: Option<String>,
    counters: Arc<Counters>,
    stop: zmq::Socket,
) -> Result<JoinHandle<()>, String> {
    let s = ctx.socket(zmq::REP).map_err(|e| format!("KV events' ZAP handler: {e}"))?;
    s.bind("inproc://zeromq.zap.01").map_err(|e| format!("KV events' ZAP handler: {e}"))?;
    std::thread::Builder::new()
        .name("kv-events-zap".into())
        .spawn(move || {
            while wait_readable(&s, &stop) {
                let req = match s.recv_multipart(zmq::DONTWAIT) {
                    Ok(r) => r,
                    Err(zmq::Error::EINTR | zmq::Error::EAGAIN) => continue,
                    Err(_) => return,
                };
                let ok = zap_allows(&req, &allow, token.as_deref());
                if !ok {
                    counters.refused.fetch_add(1, Ordering::Relaxed);
                }
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
