//! The metadata of a CUDA IPC offer: where the source runs (its host and process) and what it
//! exported (CUDA IPC handles of `cuMemAlloc` allocations; virtual-memory ranges with the
//! socket and token that hand out their descriptors), its encoding and its checked decoding.
//! Nothing here touches memory: what a hostile source sends is bounded and checked before the
//! backend (`super`) maps anything.

use crate::agent::transport::vmm_fds;
use crate::copy::IpcExport;

/// Most allocations one offer may list.
const MAX_EXPORTS: usize = 4096;
/// Bytes of one exported allocation in an offer's metadata: handle, base, size.
const EXPORT_BYTES: usize = 64 + 8 + 8;

/// This host's id: the kernel's boot id (two agents with equal ids run on one host, in one
/// boot), 16 bytes.
pub(super) fn host_id() -> Result<[u8; 16], String> {
    let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map_err(|e| format!("CUDA IPC: this host's boot id: {e}"))?;
    let hex: Vec<u8> = text.trim().bytes().filter(|b| *b != b'-').collect();
    let mut id = [0u8; 16];
    if hex.len() != 32 {
        return Err("CUDA IPC: the boot id is not a UUID".into());
    }
    for (i, o) in id.iter_mut().enumerate() {
        let pair = std::str::from_utf8(&hex[2 * i..2 * i + 2]).map_err(|_| "CUDA IPC: the boot id is not hex")?;
        *o = u8::from_str_radix(pair, 16).map_err(|_| "CUDA IPC: the boot id is not hex")?;
    }
    Ok(id)
}

/// What an IPC offer's metadata says: where the source runs and what it exported.
#[derive(Debug, PartialEq)]
pub(crate) struct Exports {
    pub(super) host: [u8; 16],
    pub(super) pid: u32,
    /// Allocations of `cuMemAlloc` (CUDA IPC handles).
    pub(super) allocs: Vec<IpcExport>,
    /// Allocations of the virtual memory API, when the source's pool has any.
    pub(super) vmm: Option<VmmOffer>,
}

/// The virtual-memory part of an offer: where to get the descriptors, and what they map.
#[derive(Debug, PartialEq)]
pub(crate) struct VmmOffer {
    /// The source's descriptor socket (an abstract Unix socket name).
    pub(super) socket: Vec<u8>,
    /// What the destination proves with there.
    pub(super) token: [u8; vmm_fds::TOKEN],
    /// Contiguous ranges of the source's address space: each its base and the sizes of the
    /// allocations mapped side by side from it; the socket sends their descriptors in this
    /// order.
    pub(super) ranges: Vec<(u64, Vec<u64>)>,
}

impl VmmOffer {
    pub(super) fn chunks(&self) -> usize {
        self.ranges.iter().map(|r| r.1.len()).sum()
    }
}

/// Most contiguous virtual-memory ranges, and allocations in them, one offer may list.
pub(super) const MAX_VMM_RANGES: usize = 4096;
pub(super) const MAX_VMM_CHUNKS: usize = 16384;

impl Exports {
    /// Every exported range as `(base, size)`: the CUDA IPC allocations, then the
    /// virtual-memory ranges (the order `CudaIpc::map` maps them in).
    pub(super) fn ranges(&self) -> Vec<(u64, u64)> {
        let vmm = self.vmm.iter().flat_map(|v| v.ranges.iter().map(|(b, c)| (*b, c.iter().sum::<u64>())));
        self.allocs.iter().map(|a| (a.base, a.size)).chain(vmm).collect()
    }

    /// The bytes of every exported range (the sum of [`Exports::ranges`]'s sizes, with no list
    /// made; saturating, as the sizes are the source's word).
    pub(super) fn bytes(&self) -> u64 {
        let vmm = self.vmm.iter().flat_map(|v| v.ranges.iter().flat_map(|(_, c)| c.iter().copied()));
        self.allocs.iter().map(|a| a.size).chain(vmm).fold(0u64, u64::saturating_add)
    }
}

/// `host (16) | pid u32 | count u32 | count x (handle 64 | base u64 | size u64)`, then, when
/// the pool has memory of the virtual memory API: `ranges u32 | token 32 | socket_len u16 |
/// socket | ranges x (base u64 | n u32 | n x size u64)`.
pub(super) fn encode_exports(e: &Exports) -> Vec<u8> {
    let mut p = Vec::with_capacity(24 + EXPORT_BYTES * e.allocs.len());
    p.extend_from_slice(&e.host);
    p.extend_from_slice(&e.pid.to_le_bytes());
    p.extend_from_slice(&(e.allocs.len() as u32).to_le_bytes());
    for a in &e.allocs {
        p.extend_from_slice(&a.handle);
        p.extend_from_slice(&a.base.to_le_bytes());
        p.extend_from_slice(&a.size.to_le_bytes());
    }
    if let Some(v) = &e.vmm {
        p.extend_from_slice(&(v.ranges.len() as u32).to_le_bytes());
        p.extend_from_slice(&v.token);
        p.extend_from_slice(&(v.socket.len() as u16).to_le_bytes());
        p.extend_from_slice(&v.socket);
        for (base, sizes) in &v.ranges {
            p.extend_from_slice(&base.to_le_bytes());
            p.extend_from_slice(&(sizes.len() as u32).to_le_bytes());
            for s in sizes {
                p.extend_from_slice(&s.to_le_bytes());
            }
        }
    }
    p
}

/// Reads little-endian fields off the front of a slice.
struct Reader<'a>(&'a [u8]);
impl Reader<'_> {
    fn take(&mut self, n: usize) -> Option<&[u8]> {
        let (a, b) = (self.0.get(..n)?, self.0.get(n..)?);
        self.0 = b;
        Some(a)
    }
    fn u16(&mut self) -> Option<u16> {
        Some(u16::from_le_bytes(self.take(2)?.try_into().ok()?))
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
}

/// Decode an offer's metadata; `None` unless it decodes exactly, within [`MAX_EXPORTS`] (and
/// the virtual-memory limits), with at least one range, and no range's end overflows.
pub(crate) fn decode_exports(p: &[u8]) -> Option<Exports> {
    let mut r = Reader(p);
    let host: [u8; 16] = r.take(16)?.try_into().ok()?;
    let pid = r.u32()?;
    let n = r.u32()? as usize;
    if n > MAX_EXPORTS || r.0.len() < EXPORT_BYTES * n {
        return None;
    }
    let mut allocs = Vec::with_capacity(n);
    for _ in 0..n {
        let handle: [u8; 64] = r.take(64)?.try_into().ok()?;
        let (base, size) = (r.u64()?, r.u64()?);
        base.checked_add(size)?;
        allocs.push(IpcExport { handle, base, size });
    }
    let vmm = if r.0.is_empty() {
        None
    } else {
        let k = r.u32()? as usize;
        let token: [u8; vmm_fds::TOKEN] = r.take(vmm_fds::TOKEN)?.try_into().ok()?;
        let len = usize::from(r.u16()?);
        let socket = r.take(len)?.to_vec();
        if k == 0 || k > MAX_VMM_RANGES || socket.is_empty() || socket.len() > 107 {
            return None;
        }
        let (mut ranges, mut chunks) = (Vec::with_capacity(k), 0usize);
        for _ in 0..k {
            let (base, m) = (r.u64()?, r.u32()? as usize);
            chunks += m;
            if m == 0 || chunks > MAX_VMM_CHUNKS {
                return None;
            }
            let mut sizes = Vec::with_capacity(m);
            let mut end = base;
            for _ in 0..m {
                let s = r.u64()?;
                if s == 0 {
                    return None;
                }
                end = end.checked_add(s)?;
                sizes.push(s);
            }
            ranges.push((base, sizes));
        }
        if !r.0.is_empty() {
            return None;
        }
        Some(VmmOffer { socket, token, ranges })
    };
    if allocs.is_empty() && vmm.is_none() {
        return None;
    }
    Some(Exports { host, pid, allocs, vmm })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An exported allocation at `base` of `size` bytes, its handle all `tag`.
    fn export(base: u64, size: u64, tag: u8) -> IpcExport {
        IpcExport { handle: [tag; 64], base, size }
    }

    #[test]
    fn exports_round_trip_and_refuse_garbage() {
        let e = Exports {
            host: [7; 16],
            pid: 42,
            allocs: vec![export(0x1000, 0x4000, 1), export(0x9000, 0x100, 2)],
            vmm: None,
        };
        let p = encode_exports(&e);
        assert_eq!(decode_exports(&p), Some(e));
        assert_eq!(decode_exports(&p[..p.len() - 1]), None, "short");
        assert_eq!(decode_exports(&[p.as_slice(), &[0]].concat()), None, "long");
        let mut none = p.clone();
        none[20..24].copy_from_slice(&0u32.to_le_bytes());
        assert_eq!(decode_exports(&none[..24]), None, "no allocation");
        let mut wrap =
            encode_exports(&Exports { host: [0; 16], pid: 1, allocs: vec![export(u64::MAX - 4, 8, 0)], vmm: None });
        assert_eq!(decode_exports(&wrap), None, "an end past u64");
        wrap[20..24].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode_exports(&wrap), None, "a count past the limit");
        assert_eq!(decode_exports(&[]), None);
    }

    /// The virtual-memory section: round trip (alone and beside CUDA IPC allocations), its
    /// ranges as the plans see them, and every malformed variant refused.
    #[test]
    fn virtual_memory_exports_round_trip_and_refuse_garbage() {
        let vmm = VmmOffer {
            socket: b"kvrelay-cuda-ipc-1-00".to_vec(),
            token: [5; vmm_fds::TOKEN],
            ranges: vec![(0x10_0000, vec![0x20_0000, 0x40_0000]), (0x100_0000, vec![0x20_0000])],
        };
        let e = Exports { host: [1; 16], pid: 9, allocs: vec![export(0x1000, 0x4000, 1)], vmm: Some(vmm) };
        let p = encode_exports(&e);
        let d = decode_exports(&p).unwrap();
        assert_eq!(d, e);
        assert_eq!(d.ranges(), vec![(0x1000, 0x4000), (0x10_0000, 0x60_0000), (0x100_0000, 0x20_0000)]);
        assert_eq!(d.bytes(), d.ranges().iter().map(|r| r.1).sum::<u64>());
        assert_eq!(d.vmm.as_ref().unwrap().chunks(), 3);
        // no CUDA IPC allocation, only virtual memory: fine
        let only = Exports { allocs: vec![], ..decode_exports(&p).unwrap() };
        assert_eq!(decode_exports(&encode_exports(&only)), Some(only));
        // neither: refused
        assert_eq!(decode_exports(&encode_exports(&Exports { allocs: vec![], vmm: None, ..d })), None);
        // cut anywhere in the section, or one byte more: refused
        let ipc_end = 24 + EXPORT_BYTES;
        for cut in ipc_end + 1..p.len() {
            assert_eq!(decode_exports(&p[..cut]), None, "cut at {cut}");
        }
        assert_eq!(decode_exports(&[p.as_slice(), &[0]].concat()), None);
        let at_ranges = ipc_end;
        let at_socket_len = at_ranges + 4 + vmm_fds::TOKEN;
        let at_first_range = at_socket_len + 2 + 21;
        let patch = |at: usize, bytes: &[u8]| {
            let mut q = p.clone();
            q[at..at + bytes.len()].copy_from_slice(bytes);
            decode_exports(&q)
        };
        assert_eq!(patch(at_ranges, &0u32.to_le_bytes()), None, "no range");
        assert_eq!(patch(at_socket_len, &0u16.to_le_bytes()), None, "no socket name");
        assert_eq!(patch(at_first_range + 8, &0u32.to_le_bytes()), None, "a range of no allocation");
        assert_eq!(patch(at_first_range + 12, &0u64.to_le_bytes()), None, "an allocation of no bytes");
        assert_eq!(patch(at_first_range, &u64::MAX.to_le_bytes()), None, "a range past u64");
    }
}
