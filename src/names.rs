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

use xxhash_rust::xxh3::{xxh3_64, Xxh3};

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
}
