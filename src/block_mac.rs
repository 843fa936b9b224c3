//! The keyed KV block tag: a MAC over a block's bytes under a key derived from the deployment
//! key, so that a block whose bytes changed after its source tagged it (in memory, on a wire)
//! is refused by every destination that holds the key, even when the change keeps the public
//! checksum ([`crate::checksum`], which anyone can recompute).
//!
//! `tag(b) = first 8 bytes (little-endian u64) of HMAC-SHA-256(F, len || S1 || S2)`, with
//! `S1 = sum over words i of nh(w_i, k_i)` and `S2 = sum over words i of nh(w_i, k_{i+1})`
//! (wrapping, mod 2^64), where `w_i` is the `i`-th little-endian 64-bit word of `b` (a short
//! last word padded with zeros), `nh(w, k) = (lo(w) + lo(k) mod 2^32) * (hi(w) + hi(k) mod
//! 2^32)` (a 32 by 32 bit product, exact in 64 bits), `k_0, k_1, ...` a key stream of 64-bit
//! words (SHA-256 in counter mode over a seed) and `F` a finishing key, both derived from the
//! block key by HMAC-SHA-256 under labels of their own.
//!
//! Why this construction:
//! - **`S1`** is NH (the hash inside UMAC): for any two different messages of one length,
//!   the chance over a random key that their sums collide is at most 2^-32; **`S2`** is NH
//!   again under the key stream shifted by one word (the Toeplitz construction), which makes
//!   the chance that both collide at most 2^-64. Lengths differ: the length is in the finish.
//! - **the finish** is a pseudo-random function of the two sums: a tag shows nothing about
//!   the key stream, so seeing tags (a peer, a wire) does not help forge one. Hash, then PRF: a
//!   forger who holds no key succeeds with about 2^-64 per try.
//! - **the terms are independent per word**, as the checksum's are: a block is tagged in pieces
//!   where it lies, in any order and in parallel ([`BlockMac::terms`] with the piece's first
//!   word), and a GPU kernel can add the terms up word by word where the bytes already pass.
//!   Per 8 bytes two 32 by 32 bit multiplies (vector units do four or eight at a time), so the
//!   cost is of the order of the public checksum's.
//!
//! What it proves, and to whom: a destination that holds the deployment key and gets a block's
//! tag from the block's source checks that the bytes it received are the ones the source
//! tagged. Anyone who holds the key can compute tags of bytes of their own choosing, and NH
//! under a known key can be steered (two words changed so that the sums stay), so the tag keeps
//! out writers without the key (a process that got at a mapping, a machine on the path of a
//! cross-host TCP connection), not peers of the same deployment (those must be kept out of the
//! source's store by what a grant maps).
//!
//! The key stream is as long as a block (one 64-bit word per word of a block, and one more):
//! one allocation of about a block's bytes at construction, none afterwards.

use sha2::{Digest as _, Sha256};

/// The label under which a deployment key derives the block key ([`crate::agent::Psk::derive`]).
pub const BLOCK_KEY_LABEL: &[u8] = b"kvrelay-block-mac/v1";

/// The two NH sums of a block's words (or of a piece of them); pieces add with `+` (wrapping).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NhSums(pub u64, pub u64);

impl std::ops::Add for NhSums {
    type Output = NhSums;
    /// The sums of two disjoint pieces of one block, together.
    fn add(self, o: NhSums) -> NhSums {
        NhSums(self.0.wrapping_add(o.0), self.1.wrapping_add(o.1))
    }
}

/// A block key's expanded state: its key stream and finishing key, for blocks of up to
/// [`BlockMac::max_bytes`] bytes.
pub struct BlockMac {
    keys: Vec<u64>,
    finish: [u8; 32],
    max_bytes: usize,
}

impl std::fmt::Debug for BlockMac {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // never the key stream
        f.debug_struct("BlockMac").field("max_bytes", &self.max_bytes).finish_non_exhaustive()
    }
}

/// HMAC-SHA-256 of the concatenation of `parts` under a 32-byte key (RFC 2104).
fn hmac(key: &[u8; 32], parts: &[&[u8]]) -> [u8; 32] {
    let mut k = [0u8; 64];
    k[..32].copy_from_slice(key);
    let mut inner = Sha256::new();
    inner.update(k.map(|b| b ^ 0x36));
    for p in parts {
        inner.update(p);
    }
    let mut outer = Sha256::new();
    outer.update(k.map(|b| b ^ 0x5c));
    outer.update(inner.finalize());
    outer.finalize().into()
}

#[inline(always)]
fn nh(w: u64, k: u64) -> u64 {
    let lo = u64::from((w as u32).wrapping_add(k as u32));
    let hi = u64::from(((w >> 32) as u32).wrapping_add((k >> 32) as u32));
    lo * hi
}

impl BlockMac {
    /// The state of block key `key` for blocks of up to `max_bytes` bytes: a key stream of
    /// `max_bytes / 8 + 1` words (rounded up), one SHA-256 per four of them (about 20 ms per 2 MiB on one
    /// core; done once per agent).
    pub fn new(key: &[u8; 32], max_bytes: usize) -> BlockMac {
        let words = max_bytes.div_ceil(8) + 1;
        let seed = hmac(key, &[b"key stream"]);
        let mut keys = Vec::with_capacity(words.div_ceil(4) * 4);
        let mut ctr = 0u64;
        while keys.len() < words {
            let mut h = Sha256::new();
            h.update(seed);
            h.update(ctr.to_le_bytes());
            let out: [u8; 32] = h.finalize().into();
            keys.extend(out.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))));
            ctr += 1;
        }
        keys.truncate(words);
        BlockMac { keys, finish: hmac(key, &[b"finish"]), max_bytes }
    }

    /// The key stream (one word per word of the longest block, and one more): what a GPU
    /// kernel that tags blocks reads.
    pub(crate) fn key_stream(&self) -> &[u64] {
        &self.keys
    }

    /// The longest block this state tags.
    pub fn max_bytes(&self) -> usize {
        self.max_bytes
    }

    /// The NH sums of `bytes`, whose first word is word `first_word` of its block (a piece of a
    /// block tagged where it lies; `bytes.len()` a multiple of 8 unless it is the block's end).
    ///
    /// # Panics
    /// When the piece reaches past [`BlockMac::max_bytes`] (a caller's bug: the agent sizes the
    /// state by its block).
    pub fn terms(&self, bytes: &[u8], first_word: u64) -> NhSums {
        let first = usize::try_from(first_word).unwrap_or(usize::MAX);
        let words = bytes.len().div_ceil(8);
        assert!(
            first.checked_add(words).is_some_and(|end| end < self.keys.len()),
            "a piece of {} bytes at word {first_word} reaches past the {} bytes this block key covers",
            bytes.len(),
            self.max_bytes
        );
        let keys = &self.keys[first..first + words + 1];
        let main = bytes.len() / 64 * 64;
        // eight independent lanes per 64 bytes (word j of a chunk in lane j): vectorizes
        let mut a = [0u64; 8];
        let mut b = [0u64; 8];
        for (q, k) in bytes[..main].chunks_exact(64).zip(keys.chunks_exact(8)) {
            for j in 0..8 {
                let w = u64::from_le_bytes(q[8 * j..8 * j + 8].try_into().expect("8 bytes"));
                a[j] = a[j].wrapping_add(nh(w, k[j]));
            }
        }
        for (q, k) in bytes[..main].chunks_exact(64).zip(keys[1..].chunks_exact(8)) {
            for j in 0..8 {
                let w = u64::from_le_bytes(q[8 * j..8 * j + 8].try_into().expect("8 bytes"));
                b[j] = b[j].wrapping_add(nh(w, k[j]));
            }
        }
        let mut s =
            NhSums(a.iter().fold(0u64, |x, &y| x.wrapping_add(y)), b.iter().fold(0u64, |x, &y| x.wrapping_add(y)));
        for (i, c) in (main / 8..).zip(bytes[main..].chunks(8)) {
            let mut w = [0u8; 8];
            w[..c.len()].copy_from_slice(c);
            let w = u64::from_le_bytes(w);
            s = s + NhSums(nh(w, keys[i]), nh(w, keys[i + 1]));
        }
        s
    }

    /// The tag of a block of `len` bytes whose pieces' sums add up to `s`.
    pub fn finish(&self, s: NhSums, len: u64) -> u64 {
        let t = hmac(&self.finish, &[&len.to_le_bytes(), &s.0.to_le_bytes(), &s.1.to_le_bytes()]);
        u64::from_le_bytes(t[..8].try_into().expect("8 bytes"))
    }

    /// The tag of one whole block. No allocation; O(len).
    pub fn tag(&self, bytes: &[u8]) -> u64 {
        self.finish(self.terms(bytes, 0), bytes.len() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checksum::{fmix64, kv_checksum};

    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        (0..n).map(|i| (fmix64(seed ^ i as u64) >> 7) as u8).collect()
    }

    /// The inverse of `fmix64` (xor-shifts by 33 are their own inverse; the multipliers are
    /// odd, so invertible mod 2^64): what lets anyone forge the public checksum.
    fn unfmix64(mut x: u64) -> u64 {
        fn inv(c: u64) -> u64 {
            let mut i = c;
            for _ in 0..6 {
                i = i.wrapping_mul(2u64.wrapping_sub(c.wrapping_mul(i)));
            }
            i
        }
        x ^= x >> 33;
        x = x.wrapping_mul(inv(0xc4ce_b9fe_1a85_ec53));
        x ^= x >> 33;
        x = x.wrapping_mul(inv(0xff51_afd7_ed55_8ccd));
        x ^= x >> 33;
        x
    }

    /// Rewrite word 0 of `b` to `new` and word 1 so that the public checksum stays the same.
    pub(crate) fn forge_keeping_checksum(b: &mut [u8], new: u64) {
        const K: u64 = 0x9E37_79B9_7F4A_7C15;
        let w = |b: &[u8], i: usize| u64::from_le_bytes(b[8 * i..8 * i + 8].try_into().unwrap());
        let (w0, w1) = (w(b, 0), w(b, 1));
        let t1 = fmix64(w1 ^ K.wrapping_mul(2)).wrapping_add(fmix64(w0 ^ K)).wrapping_sub(fmix64(new ^ K));
        let w1n = unfmix64(t1) ^ K.wrapping_mul(2);
        b[..8].copy_from_slice(&new.to_le_bytes());
        b[8..16].copy_from_slice(&w1n.to_le_bytes());
    }

    #[test]
    fn a_write_that_keeps_the_public_checksum_changes_the_tag() {
        let m = BlockMac::new(&[7; 32], 4096);
        let mut b = bytes(4096, 1);
        let (sum, tag) = (kv_checksum(&b), m.tag(&b));
        forge_keeping_checksum(&mut b, 0x0123_4567_89ab_cdef);
        assert_eq!(kv_checksum(&b), sum, "the forgery keeps the public checksum");
        assert_ne!(m.tag(&b), tag, "but not the tag");
    }

    #[test]
    fn pieces_add_up_to_the_whole_and_every_change_is_seen() {
        let m = BlockMac::new(&[3; 32], 1000);
        for len in [0usize, 1, 7, 8, 9, 63, 64, 65, 200, 999, 1000] {
            let b = bytes(len, len as u64);
            let whole = m.terms(&b, 0);
            for cut in (0..=len / 8).map(|w| w * 8) {
                let s = m.terms(&b[..cut], 0) + m.terms(&b[cut..], cut as u64 / 8);
                assert_eq!(s, whole, "len {len}, cut at {cut}");
            }
            let t = m.tag(&b);
            for i in 0..len {
                let mut c = b.clone();
                c[i] ^= 1 << (i % 8);
                assert_ne!(m.tag(&c), t, "len {len}: a flip of byte {i}");
            }
            // a zero byte appended is another block (the length is in the tag)
            if len < 1000 {
                let mut c = b.clone();
                c.push(0);
                assert_ne!(m.tag(&c), t, "len {len}: one zero byte more");
            }
        }
    }

    #[test]
    fn the_tag_depends_on_the_key_and_swapped_words_are_seen() {
        let b = bytes(512, 9);
        let (x, y) = (BlockMac::new(&[1; 32], 512), BlockMac::new(&[2; 32], 512));
        assert_ne!(x.tag(&b), y.tag(&b));
        assert_eq!(x.tag(&b), BlockMac::new(&[1; 32], 4096).tag(&b), "the state's size is not in the tag");
        let mut c = b.clone();
        c.copy_within(0..8, 256);
        c[..8].copy_from_slice(&b[256..264]);
        assert_ne!(x.tag(&c), x.tag(&b), "two words swapped");
        assert!(format!("{x:?}").contains("max_bytes") && !format!("{x:?}").contains("keys"));
    }

    #[test]
    #[should_panic(expected = "reaches past")]
    fn a_piece_past_the_state_is_a_bug_said_plainly() {
        BlockMac::new(&[0; 32], 64).terms(&[0; 72], 0);
    }
}
