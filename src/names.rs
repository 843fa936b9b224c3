//! Block names (SPEC sections 8 and 10): the one naming function every runtime that links
//! kvrelay calls, so that two runtimes that see the same tokens with the same model name the
//! same blocks the same way, and a router can index any of them.
//!
//! KV is cut into blocks of `block_tokens` tokens; only full blocks are named:
//! ```text
//! name(i) = XXH3-64 with seed `seed` of
//!           name(i-1) (0 for i = 0) as u64 LE | lora_id as u64 LE
//!           | i = 0 and a non-empty salt: salt length as u64 LE, salt bytes
//!           | the block's tokens as u32 LE
//! ```
//! The name covers the whole prefix: equal names mean equal KV for equal models. The seed is
//! the runtime's engine identity ([`name_seed`] of a string that names the model file, its
//! build and every setting that changes KV bytes), so two instances agree on names only where
//! their KV is interchangeable. An empty salt is no salt (a salt separates tenants' caches; an
//! empty one separates nobody).
//!
//! Names can be computed block by block as a prompt grows: [`Naming::names_into`] continues a
//! chain from the name of the block before (`parent`) and that block's index. It allocates
//! nothing and costs one XXH3 pass over each block's `16 + 4 * block_tokens` bytes (plus the
//! salt once).
//!
//! # Block content digests
//!
//! Names are what routers index, but they are neither secrets nor collision-resistant: 64 bits
//! of a non-cryptographic hash, so a crafted block can carry a popular prefix's name. Beside
//! each name, a block has a [`BLOCK_DIGEST_BYTES`]-byte digest, a chained SHA-256 over the same
//! cutting of the same inputs plus the engine's identity:
//! ```text
//! digest(i) = SHA-256 of
//!             "kvrelay-block-digest-1" (22 bytes) | SHA-256(identity) (32 bytes)
//!             | digest(i-1) (32 zero bytes for i = 0) | lora_id as u64 LE
//!             | i = 0 and a non-empty salt: salt length as u64 LE, salt bytes
//!             | the block's tokens as u32 LE
//! ```
//! `identity` is the engine's identity string (the bytes whose [`name_seed`] seeds the names),
//! so two engines whose KV differs never agree on a digest, and like a name a digest covers
//! the whole prefix. The digest is the data plane's identity of a block: a runtime imports a
//! block into a slot only when the block's digest equals the digest of that slot's own tokens
//! at those positions, never on a name alone. [`Naming::digests_into`] continues a chain like
//! [`Naming::names_into`] and allocates nothing either.

use sha2::{Digest as _, Sha256};
use xxhash_rust::xxh3::{xxh3_64, Xxh3};

/// Bytes of a block content digest ([`Naming::digests_into`]): a SHA-256.
pub const BLOCK_DIGEST_BYTES: usize = 32;

/// The domain separator every block digest begins with (its format's version included).
const DIGEST_DOMAIN: &[u8] = b"kvrelay-block-digest-1";

/// The seed of kvrelay's own reference engine, and the base [`name_seed`] mixes an identity into.
pub const NAME_SEED: u64 = 0x6b76_7265_6c61_7931; // "kvrelay1"

/// The seed of the names of an engine whose identity is `identity` (for example the model
/// file's digest, the build and the KV settings): [`NAME_SEED`] xor XXH3-64 of `identity`.
pub fn name_seed(identity: &[u8]) -> u64 {
    NAME_SEED ^ xxh3_64(identity)
}

/// What a chain of block names depends on besides the tokens.
#[derive(Clone, Copy, Debug)]
pub struct Naming<'a> {
    /// The engine's seed ([`name_seed`]).
    pub seed: u64,
    /// Tokens per block (at least 1).
    pub block_tokens: usize,
    /// The LoRA adapter's id (0: none).
    pub lora_id: u64,
    /// The request's cache salt, hashed into block 0 only (empty: none).
    pub salt: &'a [u8],
}

impl Naming<'_> {
    /// The names of the full blocks of `tokens`, which begin at block index `first_block` of
    /// their request, the block before being named `parent` (ignored when `first_block` is 0).
    /// Writes `min(out.len(), tokens.len() / block_tokens)` names into `out` and returns that
    /// count; a partial last block is not named. `block_tokens` 0 names nothing.
    pub fn names_into(&self, parent: u64, first_block: usize, tokens: &[u32], out: &mut [u64]) -> usize {
        if self.block_tokens == 0 {
            return 0;
        }
        let mut prev = if first_block == 0 { 0 } else { parent };
        let mut n = 0;
        for (slot, block) in out.iter_mut().zip(tokens.chunks_exact(self.block_tokens)) {
            let mut h = Xxh3::with_seed(self.seed);
            h.update(&prev.to_le_bytes());
            h.update(&self.lora_id.to_le_bytes());
            if first_block + n == 0 && !self.salt.is_empty() {
                h.update(&(self.salt.len() as u64).to_le_bytes());
                h.update(self.salt);
            }
            // tokens as u32 LE, through a stack buffer (no allocation, any host byte order)
            let mut buf = [0u8; 256];
            for chunk in block.chunks(buf.len() / 4) {
                for (d, t) in buf.chunks_exact_mut(4).zip(chunk) {
                    d.copy_from_slice(&t.to_le_bytes());
                }
                h.update(&buf[..chunk.len() * 4]);
            }
            prev = h.digest();
            *slot = prev;
            n += 1;
        }
        n
    }

    /// The names of the full blocks of a whole request's `tokens` (allocates the result).
    pub fn names(&self, tokens: &[u32]) -> Vec<u64> {
        let mut out = vec![0; tokens.len().checked_div(self.block_tokens).unwrap_or(0)];
        let n = self.names_into(0, 0, tokens, &mut out);
        out.truncate(n);
        out
    }

    /// The content digests (module docs) of the full blocks of `tokens` under the engine
    /// identity `identity`; `tokens` begin at block index `first_block` of their request, the
    /// block before having the digest `parent` (ignored when `first_block` is 0). Writes
    /// `min(out.len(), tokens.len() / block_tokens)` digests into `out` and returns that count;
    /// a partial last block is not digested. `block_tokens` 0 digests nothing. Allocates
    /// nothing; `seed` is not used (`identity` stands for it).
    pub fn digests_into(
        &self,
        identity: &[u8],
        parent: &[u8; BLOCK_DIGEST_BYTES],
        first_block: usize,
        tokens: &[u32],
        out: &mut [[u8; BLOCK_DIGEST_BYTES]],
    ) -> usize {
        if self.block_tokens == 0 || out.is_empty() || tokens.len() < self.block_tokens {
            return 0;
        }
        // the domain and the identity's hash, once per call; each block continues a copy
        let mut base = Sha256::new();
        base.update(DIGEST_DOMAIN);
        base.update(Sha256::digest(identity));
        let mut prev = if first_block == 0 { [0u8; BLOCK_DIGEST_BYTES] } else { *parent };
        let mut n = 0;
        for (slot, block) in out.iter_mut().zip(tokens.chunks_exact(self.block_tokens)) {
            let mut h = base.clone();
            h.update(prev);
            h.update(self.lora_id.to_le_bytes());
            if first_block + n == 0 && !self.salt.is_empty() {
                h.update((self.salt.len() as u64).to_le_bytes());
                h.update(self.salt);
            }
            // tokens as u32 LE, through a stack buffer (no allocation, any host byte order)
            let mut buf = [0u8; 256];
            for chunk in block.chunks(buf.len() / 4) {
                for (d, t) in buf.chunks_exact_mut(4).zip(chunk) {
                    d.copy_from_slice(&t.to_le_bytes());
                }
                h.update(&buf[..chunk.len() * 4]);
            }
            prev = h.finalize().into();
            *slot = prev;
            n += 1;
        }
        n
    }

    /// The content digests of the full blocks of a whole request's `tokens` under the engine
    /// identity `identity` (allocates the result).
    pub fn digests(&self, identity: &[u8], tokens: &[u32]) -> Vec<[u8; BLOCK_DIGEST_BYTES]> {
        let mut out = vec![[0; BLOCK_DIGEST_BYTES]; tokens.len().checked_div(self.block_tokens).unwrap_or(0)];
        let n = self.digests_into(identity, &[0; BLOCK_DIGEST_BYTES], 0, tokens, &mut out);
        out.truncate(n);
        out
    }
}

/// The SHA-256 of a file's bytes, read in 1 MiB pieces: what an engine's identity binds its
/// model, adapters and control vectors by, so that two files of one name and size never share
/// block names. O(bytes) at about 1-2 GB/s (SHA extensions): a runtime computes it once per
/// file and keeps it where a restart finds it.
pub fn file_digest(path: &std::path::Path) -> std::io::Result<[u8; BLOCK_DIGEST_BYTES]> {
    use std::io::Read;
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => h.update(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(h.finalize().into())
}

#[cfg(test)]
mod tests {
    use super::*;

    // Golden values from an independent implementation (Python's `xxhash` package, the
    // formula of the module docs): tokens 1..=69.
    #[test]
    fn names_match_an_independent_implementation() {
        let toks: Vec<u32> = (1..70).collect();
        let n = |block_tokens, lora_id, salt: &'static [u8]| {
            Naming { seed: NAME_SEED, block_tokens, lora_id, salt }.names(&toks)
        };
        assert_eq!(n(32, 0, b""), [0xc2f3e1bd5c718de7, 0x6fafdd40f9a822b3]);
        assert_eq!(n(32, 0, b"tenant"), [0x4fbf583dc3398fa1, 0xadde4186a4e5c742]);
        assert_eq!(n(16, 7, b""), [0xdf905853c945ade6, 0xaa84d8560697970b, 0x867c221efc45c4cf, 0xf6a11b17e3d86c41]);
        assert_eq!(name_seed(b"llama-identity"), 0xe3b18970a1cc684f);
    }

    /// A file's digest is the SHA-256 of its bytes (FIPS 180-2's "abc", and over more than one
    /// read piece), and a missing file is an error.
    #[test]
    fn file_digests_are_sha256_of_the_bytes() {
        let dir = std::env::temp_dir().join(format!("kvrelay-file-digest-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let small = dir.join("abc");
        std::fs::write(&small, b"abc").unwrap();
        assert_eq!(
            file_digest(&small).unwrap(),
            hex("ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad")
        );
        let big = dir.join("big");
        let bytes: Vec<u8> = (0..(3 << 20) + 5).map(|i: u32| (i * 7 + 3) as u8).collect();
        std::fs::write(&big, &bytes).unwrap();
        assert_eq!(file_digest(&big).unwrap(), <[u8; 32]>::from(Sha256::digest(&bytes)));
        assert!(file_digest(&dir.join("missing")).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_chain_continued_block_by_block_equals_the_whole() {
        let toks: Vec<u32> = (0..200).map(|i| i * 7919).collect();
        for salt in [&b""[..], b"s"] {
            let naming = Naming { seed: name_seed(b"m"), block_tokens: 16, lora_id: 3, salt };
            let whole = naming.names(&toks);
            assert_eq!(whole.len(), 12);
            let mut parts = vec![0u64; whole.len()];
            let mut parent = 0;
            for i in 0..whole.len() {
                let got = naming.names_into(parent, i, &toks[i * 16..], &mut parts[i..=i]);
                assert_eq!(got, 1);
                parent = parts[i];
            }
            assert_eq!(parts, whole);
        }
    }

    #[test]
    fn every_input_changes_the_names() {
        let toks: Vec<u32> = (0..64).collect();
        let base = Naming { seed: NAME_SEED, block_tokens: 32, lora_id: 0, salt: b"" };
        let names = base.names(&toks);
        assert_ne!(Naming { seed: 1, ..base }.names(&toks), names);
        assert_ne!(Naming { lora_id: 1, ..base }.names(&toks), names);
        assert_ne!(Naming { salt: b"x", ..base }.names(&toks), names);
        let mut other = toks.clone();
        other[0] = 99;
        let changed = base.names(&other);
        // the first block's change reaches every later name (a name covers its whole prefix)
        assert!(changed.iter().zip(&names).all(|(a, b)| a != b));
        // a partial block is not named; a short buffer is filled only as far as it goes
        assert_eq!(base.names(&toks[..63]).len(), 1);
        let mut one = [0u64; 1];
        assert_eq!(base.names_into(0, 0, &toks, &mut one), 1);
        assert_eq!(one[0], names[0]);
        assert!(Naming { block_tokens: 0, ..base }.names(&toks).is_empty());
    }

    fn hex(s: &str) -> [u8; BLOCK_DIGEST_BYTES] {
        let mut d = [0u8; BLOCK_DIGEST_BYTES];
        for (i, b) in d.iter_mut().enumerate() {
            *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap();
        }
        d
    }

    // Golden values from an independent implementation (Python's `hashlib`, the formula of the
    // module docs): tokens 1..=69, identity "llama-identity" (and the empty identity).
    #[test]
    fn digests_match_an_independent_implementation() {
        let toks: Vec<u32> = (1..70).collect();
        let d = |identity: &[u8], block_tokens, lora_id, salt: &'static [u8]| {
            Naming { seed: NAME_SEED, block_tokens, lora_id, salt }.digests(identity, &toks)
        };
        let id = b"llama-identity";
        assert_eq!(
            d(id, 32, 0, b""),
            [
                hex("03bc2092f88574096943d26f28c693856ab0e87e4813a86d81e0d257ba5026ab"),
                hex("91725214d03c277d31295fa26902517267ac0615fb6565da166667514ce01ac5"),
            ]
        );
        assert_eq!(
            d(id, 32, 0, b"tenant"),
            [
                hex("4f461337b50994c9ac6ff826d4a0979e1df1104e2503cf7851bcb442d32a64ad"),
                hex("f9148cb1af9f739e4b57c870044e567aad6fd5899a40895cdcc7226eeaf0abc3"),
            ]
        );
        assert_eq!(
            d(id, 16, 7, b""),
            [
                hex("7e8572080dc12e66b20092fe889ca8307b7949c1dc21935dae992bb1c4a3d61a"),
                hex("5476c31e901d9181e0c301e0f97387f40b4065ddfeb9d9bdac80e1bfd7b3f9b3"),
                hex("61555986a75ea00df0f33dddf06b4985f96117dbd5b32b32db4869d06b04571f"),
                hex("cab1ca2cd9ad7086c7719c1545e206a0b7f180bfcff4614b4844aefe7ff91ab1"),
            ]
        );
        assert_eq!(
            d(b"", 32, 0, b""),
            [
                hex("89c4b34db71dad5a3135bfc76af1da98dc5acde3de07721e8435bbf604e894c4"),
                hex("a59073c5af9cf07766cff6420711f09f8095dcb5b66ab8bfcd987bc553a3dc6d"),
            ]
        );
    }

    #[test]
    fn a_digest_chain_continued_block_by_block_equals_the_whole() {
        let toks: Vec<u32> = (0..200).map(|i| i * 7919).collect();
        for salt in [&b""[..], b"s"] {
            let naming = Naming { seed: name_seed(b"m"), block_tokens: 16, lora_id: 3, salt };
            let whole = naming.digests(b"m", &toks);
            assert_eq!(whole.len(), 12);
            let mut parts = vec![[0u8; BLOCK_DIGEST_BYTES]; whole.len()];
            // the parent of block 0 is ignored
            let mut parent = [0xa5; BLOCK_DIGEST_BYTES];
            for i in 0..whole.len() {
                let got = naming.digests_into(b"m", &parent, i, &toks[i * 16..], &mut parts[i..=i]);
                assert_eq!(got, 1);
                parent = parts[i];
            }
            assert_eq!(parts, whole);
            // two blocks at a time, from block 5: the same
            let mut two = [[0u8; BLOCK_DIGEST_BYTES]; 2];
            assert_eq!(naming.digests_into(b"m", &whole[4], 5, &toks[5 * 16..], &mut two), 2);
            assert_eq!(two, [whole[5], whole[6]]);
        }
    }

    #[test]
    fn every_input_changes_the_digests() {
        let toks: Vec<u32> = (0..64).collect();
        let id = b"engine";
        let base = Naming { seed: NAME_SEED, block_tokens: 32, lora_id: 0, salt: b"" };
        let digests = base.digests(id, &toks);
        assert_eq!(digests.len(), 2);
        // every digest differs (any input changes the first block, which reaches the second)
        let all_differ = |other: Vec<[u8; BLOCK_DIGEST_BYTES]>| {
            assert_eq!(other.len(), digests.len());
            assert!(other.iter().zip(&digests).all(|(a, b)| a != b), "{other:?}");
        };
        all_differ(base.digests(b"engine2", &toks));
        all_differ(base.digests(b"", &toks));
        all_differ(Naming { lora_id: 1, ..base }.digests(id, &toks));
        all_differ(Naming { salt: b"x", ..base }.digests(id, &toks));
        for at in [0, 17, 31] {
            let mut other = toks.clone();
            other[at] ^= 1;
            all_differ(base.digests(id, &other));
        }
        // a token of the second block changes the second digest only
        let mut other = toks.clone();
        other[63] = 1 << 31;
        let changed = base.digests(id, &other);
        assert!(changed[0] == digests[0] && changed[1] != digests[1]);
        // the parent (first_block > 0) changes the digest; so does the block index with a salt
        let mut one = [[0u8; BLOCK_DIGEST_BYTES]; 1];
        base.digests_into(id, &digests[0], 1, &toks[32..], &mut one);
        assert_eq!(one[0], digests[1]);
        let mut parent = digests[0];
        parent[31] ^= 1;
        base.digests_into(id, &parent, 1, &toks[32..], &mut one);
        assert_ne!(one[0], digests[1]);
        let salted = Naming { salt: b"x", ..base };
        let mut at0 = [[0u8; BLOCK_DIGEST_BYTES]; 1];
        salted.digests_into(id, &[0; BLOCK_DIGEST_BYTES], 0, &toks[..32], &mut at0);
        base.digests_into(id, &[0; BLOCK_DIGEST_BYTES], 0, &toks[..32], &mut one);
        assert_ne!(at0[0], one[0]);
        // the seed does not enter a digest (the identity stands for it)
        assert_eq!(Naming { seed: 1, ..base }.digests(id, &toks), digests);
        // digests are not names: the same inputs give unrelated values
        assert_ne!(digests[0][..8], base.names(&toks)[0].to_le_bytes());
    }

    #[test]
    fn a_partial_block_is_not_digested() {
        let toks: Vec<u32> = (0..64).collect();
        let base = Naming { seed: NAME_SEED, block_tokens: 32, lora_id: 0, salt: b"" };
        let whole = base.digests(b"e", &toks);
        assert_eq!(base.digests(b"e", &toks[..63]), whole[..1]);
        assert!(base.digests(b"e", &toks[..31]).is_empty());
        assert!(Naming { block_tokens: 0, ..base }.digests(b"e", &toks).is_empty());
        let mut none: [[u8; BLOCK_DIGEST_BYTES]; 0] = [];
        assert_eq!(base.digests_into(b"e", &[0; BLOCK_DIGEST_BYTES], 0, &toks, &mut none), 0);
        // a short buffer is filled only as far as it goes; the rest is left alone
        let mut buf = [[7u8; BLOCK_DIGEST_BYTES]; 3];
        assert_eq!(base.digests_into(b"e", &[0; BLOCK_DIGEST_BYTES], 0, &toks[..40], &mut buf), 1);
        assert_eq!(buf[0], whole[0]);
        assert_eq!(buf[1], [7; BLOCK_DIGEST_BYTES]);
        let mut one = [[0u8; BLOCK_DIGEST_BYTES]; 1];
        assert_eq!(base.digests_into(b"e", &[0; BLOCK_DIGEST_BYTES], 0, &toks, &mut one), 1);
        assert_eq!(one[0], whole[0]);
    }
}
