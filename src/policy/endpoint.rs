//! The server-controlled trusted endpoint registry.
//!
//! Endpoints are `scheme://host:port`. Normalization: the scheme is lower-cased and must match
//! `[a-z][a-z0-9+.-]*`; the host is lower-cased; IPv4 addresses are written in dotted decimal
//! (leading zeros refused); IPv6 addresses must be bracketed and are written in their
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
}

impl fmt::Display for EndpointError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            EndpointError::Scheme => "endpoint needs a scheme://",
            EndpointError::Host => "endpoint host is malformed",
            EndpointError::Wildcard => "wildcard hosts are refused",
            EndpointError::Port => "endpoint needs an explicit port 1-65535",
            EndpointError::Extra => "endpoint must be scheme://host:port only",
        })
    }
}
impl std::error::Error for EndpointError {}

/// Normalize an endpoint (see the module docs).
pub fn normalize_endpoint(s: &str) -> Result<String, EndpointError> {
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
    let (host, port) = if let Some(r) = rest.strip_prefix('[') {
        let (inside, after) = r.split_once(']').ok_or(EndpointError::Host)?;
        let ip: Ipv6Addr = inside.parse().map_err(|_| EndpointError::Host)?;
        if ip.is_unspecified() {
            return Err(EndpointError::Wildcard);
        }
        let port = after.strip_prefix(':').ok_or(EndpointError::Port)?;
        (format!("[{ip}]"), port)
    } else {
        let (host, port) = rest.rsplit_once(':').ok_or(EndpointError::Port)?;
        if host.contains('*') {
            return Err(EndpointError::Wildcard);
        }
        if host.contains(':') {
            return Err(EndpointError::Host); // IPv6 must be bracketed
        }
        let host = if let Ok(ip) = host.parse::<Ipv4Addr>() {
            if ip.is_unspecified() {
                return Err(EndpointError::Wildcard);
            }
            ip.to_string()
        } else {
            let h = host.to_ascii_lowercase();
            let label_ok = |l: &str| {
                !l.is_empty()
                    && l.len() <= 63
                    && !l.starts_with('-')
                    && !l.ends_with('-')
                    && l.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-')
            };
            if h.is_empty() || h.len() > 253 || !h.split('.').all(label_ok) {
                return Err(EndpointError::Host);
            }
            // all-numeric dotted names that are not valid IPv4 (e.g. 010.0.0.1) are refused
            if h.split('.').all(|l| l.bytes().all(|c| c.is_ascii_digit())) {
                return Err(EndpointError::Host);
            }
            h
        };
        (host, port)
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
    Ok(format!("{}://{host}:{port}", scheme.to_ascii_lowercase()))
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
