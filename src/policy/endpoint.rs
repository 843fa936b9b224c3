//! The server-controlled trusted endpoint registry.
//!
//! Endpoints are `scheme://host:port`. Normalization: the scheme is lower-cased and must match
//! `[a-z][a-z0-9+.-]*`; the host is lower-cased; IPv4 addresses are written in dotted decimal
//! (leading zeros refused: a hint that names such a spelling names an untrusted endpoint); IPv6 addresses must be bracketed and are written in their
//! compressed form (`[0:0::1]` -> `[::1]`); the port must be present, decimal, 1..=65535 (leading
//! zeros dropped). Refused: wildcard hosts (`*`, `0.0.0.0`, `[::]`), user info, paths,
//! queries, fragments, zone ids and empty labels. Two endpoints match when their normalized
//! forms are equal, byte for byte.

use std::collections::HashSet;
use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr};

/// Why an endpoint was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EndpointError {
    /// No `scheme://`, or a scheme with other characters.
    Scheme,
    /// A host that is empty, malformed, or not allowed.
    Host,
    /// A wildcard host (`*`, `0.0.0.0`, `[::]`).
    Wildcard,
    /// No port, or one outside 1..=65535.
    Port,
    /// User info, a path, a query or a fragment.
    Extra,
    /// An all-numeric host that is not an IPv4 address in dotted decimal without leading zeros
    /// (`127.0.0.01`, `010.0.0.1`, `2130706433`): some resolvers read such spellings as octal
    /// or as one number, so none is ever in a registry; a hint that names one names an
    /// endpoint the server does not trust (the same reason as any other untrusted address).
    Ambiguous,
}

impl fmt::Display for EndpointError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            EndpointError::Scheme => "endpoint needs a scheme://",
            EndpointError::Host => "endpoint host is malformed",
            EndpointError::Wildcard => "wildcard hosts are refused",
            EndpointError::Port => "endpoint needs an explicit port 1-65535",
            EndpointError::Extra => "endpoint must be scheme://host:port only",
            EndpointError::Ambiguous => {
                "an all-numeric host must be an IPv4 address in dotted decimal without leading zeros"
            }
        })
    }
}
impl std::error::Error for EndpointError {}

/// A normalized endpoint built on the stack (no allocation). Endpoints longer than
/// 320 bytes (a 253-byte host name with a scheme and a port fit) are refused as malformed hosts.
pub struct EndpointBuf {
    buf: [u8; EndpointBuf::CAPACITY],
    len: usize,
}

impl EndpointBuf {
    /// Longest normalized endpoint: a 253-byte host name, a scheme and a port fit.
    pub(crate) const CAPACITY: usize = 320;

    /// An empty buffer.
    pub fn new() -> EndpointBuf {
        EndpointBuf { buf: [0; EndpointBuf::CAPACITY], len: 0 }
    }

    /// The normalized text.
    pub fn as_str(&self) -> &str {
        std::str::from_utf8(&self.buf[..self.len]).expect("only ASCII is written")
    }

    fn push(&mut self, s: &str) -> Result<(), EndpointError> {
        let end = self.len + s.len();
        if end > EndpointBuf::CAPACITY {
            return Err(EndpointError::Host);
        }
        self.buf[self.len..end].copy_from_slice(s.as_bytes());
        self.len = end;
        Ok(())
    }

    fn push_u32(&mut self, mut v: u32) -> Result<(), EndpointError> {
        let mut d = [0u8; 10];
        let mut i = d.len();
        loop {
            i -= 1;
            d[i] = b'0' + (v % 10) as u8;
            v /= 10;
            if v == 0 {
                break;
            }
        }
        self.push(std::str::from_utf8(&d[i..]).expect("digits"))
    }

    fn push_lower(&mut self, s: &str) -> Result<(), EndpointError> {
        let at = self.len;
        self.push(s)?;
        self.buf[at..self.len].make_ascii_lowercase();
        Ok(())
    }
}

impl Default for EndpointBuf {
    fn default() -> Self {
        EndpointBuf::new()
    }
}

impl fmt::Write for EndpointBuf {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        self.push(s).map_err(|_| fmt::Error)
    }
}

/// Normalize an endpoint (see the module docs).
pub fn normalize_endpoint(s: &str) -> Result<String, EndpointError> {
    let mut b = EndpointBuf::new();
    normalize_endpoint_into(s, &mut b)?;
    Ok(b.as_str().to_string())
}

/// Normalize an endpoint into a stack buffer (no allocation; what the orchestrator uses).
pub fn normalize_endpoint_into(s: &str, out: &mut EndpointBuf) -> Result<(), EndpointError> {
    use std::fmt::Write as _;
    out.len = 0;
    let (scheme, rest) = s.split_once("://").ok_or(EndpointError::Scheme)?;
    let sb = scheme.as_bytes();
    if sb.is_empty()
        || !sb[0].is_ascii_alphabetic()
        || !sb.iter().all(|c| c.is_ascii_alphanumeric() || matches!(c, b'+' | b'.' | b'-'))
    {
        return Err(EndpointError::Scheme);
    }
    if rest.contains(['/', '?', '#', '@', '%', ' ']) {
        return Err(EndpointError::Extra);
    }
    out.push_lower(scheme)?;
    out.push("://")?;
    let port = if let Some(r) = rest.strip_prefix('[') {
        let (inside, after) = r.split_once(']').ok_or(EndpointError::Host)?;
        let ip: Ipv6Addr = inside.parse().map_err(|_| EndpointError::Host)?;
        if ip.is_unspecified() {
            return Err(EndpointError::Wildcard);
        }
        write!(out, "[{ip}]").map_err(|_| EndpointError::Host)?;
        after.strip_prefix(':').ok_or(EndpointError::Port)?
    } else {
        let (host, port) = rest.rsplit_once(':').ok_or(EndpointError::Port)?;
        if host.contains('*') {
            return Err(EndpointError::Wildcard);
        }
        if host.contains(':') {
            return Err(EndpointError::Host); // IPv6 must be bracketed
        }
        if let Ok(ip) = host.parse::<Ipv4Addr>() {
            if ip.is_unspecified() {
                return Err(EndpointError::Wildcard);
            }
            for (i, o) in ip.octets().iter().enumerate() {
                if i > 0 {
                    out.push(".")?;
                }
                out.push_u32(u32::from(*o))?;
            }
        } else {
            let label_ok = |l: &str| {
                !l.is_empty()
                    && l.len() <= 63
                    && !l.starts_with('-')
                    && !l.ends_with('-')
                    && l.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-')
            };
            if host.is_empty() || host.len() > 253 || !host.split('.').all(label_ok) {
                return Err(EndpointError::Host);
            }
            // all-numeric dotted names that are not valid IPv4 (e.g. 010.0.0.1) are refused
            if host.split('.').all(|l| l.bytes().all(|c| c.is_ascii_digit())) {
                return Err(EndpointError::Ambiguous);
            }
            out.push_lower(host)?;
        }
        port
    };
    if port.is_empty() || !port.bytes().all(|c| c.is_ascii_digit()) {
        return Err(EndpointError::Port);
    }
    let digits = port.trim_start_matches('0');
    if digits.len() > 5 {
        return Err(EndpointError::Port);
    }
    let port: u32 = if digits.is_empty() { 0 } else { digits.parse().map_err(|_| EndpointError::Port)? };
    if !(1..=65535).contains(&port) {
        return Err(EndpointError::Port);
    }
    out.push(":")?;
    out.push_u32(port)
}

/// The set of endpoints a named fetch may connect to. Controlled by the server's own
/// configuration; a hint's address never adds to it.
#[derive(Clone, Debug, Default)]
pub struct EndpointRegistry {
    set: HashSet<String>,
}

impl EndpointRegistry {
    /// An empty registry (which allows nothing).
    pub fn new() -> EndpointRegistry {
        EndpointRegistry::default()
    }

    /// Add an endpoint; refused when it does not normalize.
    pub fn add(&mut self, endpoint: &str) -> Result<(), EndpointError> {
        self.set.insert(normalize_endpoint(endpoint)?);
        Ok(())
    }

    /// Whether an already-normalized endpoint is registered.
    pub fn contains_normalized(&self, normalized: &str) -> bool {
        self.set.contains(normalized)
    }

    /// Number of registered endpoints.
    pub fn len(&self) -> usize {
        self.set.len()
    }

    /// Whether nothing is registered.
    pub fn is_empty(&self) -> bool {
        self.set.is_empty()
    }
}
