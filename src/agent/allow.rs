//! Which peers a KV service accepts: `loopback`, addresses and `ADDR/PREFIX` networks.

use std::net::IpAddr;

/// A peer allowlist. Empty allows nobody.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerAllow(Vec<(IpAddr, u8)>);

impl PeerAllow {
    /// Loopback only (`127.0.0.0/8` and `::1`), the default.
    pub fn loopback() -> PeerAllow {
        let mut a = PeerAllow::default();
        a.add("loopback").expect("loopback parses");
        a
    }

    /// Add `loopback`, an address, or `ADDR/PREFIX`; several may be comma-separated.
    pub fn add(&mut self, spec: &str) -> Result<(), String> {
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            if item == "loopback" {
                self.0.push((IpAddr::from([127, 0, 0, 0]), 8));
                self.0.push((IpAddr::from([0u16, 0, 0, 0, 0, 0, 0, 1]), 128));
                continue;
            }
            let (a, p) = item.split_once('/').unwrap_or((item, ""));
            let ip: IpAddr = a.parse().map_err(|_| format!("peer allowlist: `{item}` is not an address"))?;
            let ip = canonical(ip);
            let max = if ip.is_ipv4() { 32 } else { 128 };
            let prefix = if p.is_empty() {
                max
            } else {
                p.parse().map_err(|_| format!("peer allowlist: bad prefix in `{item}`"))?
            };
            if prefix > max {
                return Err(format!("peer allowlist: bad prefix in `{item}`"));
            }
            self.0.push((ip, prefix));
        }
        Ok(())
    }

    /// `spec` added to this list, or with `replace` (the first spec a configuration is given,
    /// over its default) in its place; `self` is unchanged when `spec` does not parse.
    pub fn with(&self, replace: bool, spec: &str) -> Result<PeerAllow, String> {
        let mut next = if replace { PeerAllow::default() } else { self.clone() };
        next.add(spec)?;
        Ok(next)
    }

    /// Parse a list of specs (see [`PeerAllow::add`]).
    pub fn parse(list: &[String]) -> Result<PeerAllow, String> {
        let mut a = PeerAllow::default();
        for s in list {
            a.add(s)?;
        }
        Ok(a)
    }

    /// Whether `ip` is allowed (IPv4-mapped IPv6 addresses count as IPv4).
    pub fn allows(&self, ip: IpAddr) -> bool {
        let ip = canonical(ip);
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

/// IPv4-mapped IPv6 as IPv4.
pub(crate) fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_allowlist() {
        let a = PeerAllow::loopback();
        assert!(a.allows("127.0.0.1".parse().unwrap()) && a.allows("::1".parse().unwrap()));
        assert!(a.allows("::ffff:127.0.0.2".parse().unwrap()));
        assert!(!a.allows("10.0.0.1".parse().unwrap()));
        let b = PeerAllow::parse(&["10.1.0.0/16,192.168.1.7".into()]).unwrap();
        assert!(b.allows("10.1.200.3".parse().unwrap()) && !b.allows("10.2.0.1".parse().unwrap()));
        assert!(b.allows("192.168.1.7".parse().unwrap()) && !b.allows("127.0.0.1".parse().unwrap()));
        assert!(PeerAllow::parse(&["nonsense".into()]).is_err());
        assert!(PeerAllow::parse(&["10.0.0.0/33".into()]).is_err());
        assert!(!PeerAllow::default().allows("127.0.0.1".parse().unwrap()));
    }
}
