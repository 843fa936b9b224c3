//! Block names through `kvrelay_block_names` / `kvrelay_name_seed` (the function every runtime
//! that links kvrelay names blocks with).

use super::*;
use kvrelay::ffi::names::*;

/// The seed of the names of an engine whose identity is `identity`.
#[cfg_attr(not(feature = "llama"), allow(dead_code))]
pub fn name_seed(identity: &[u8]) -> u64 {
    let mut seed = 0;
    // SAFETY: a live slice and a local out-parameter.
    let st = unsafe { kvrelay_name_seed(identity.as_ptr(), identity.len(), &mut seed) };
    check("kvrelay_name_seed", st).expect("kvrelay_name_seed fails only on NULL");
    seed
}

/// The names of the full blocks of a request's `tokens` under `seed` (`block_tokens` at least 1;
/// an empty salt is none).
pub fn block_names(seed: u64, tokens: &[u32], block_tokens: usize, lora_id: u64, salt: Option<&str>) -> Vec<u64> {
    let salt = salt.unwrap_or("");
    let naming = kvrelay_naming {
        size: std::mem::size_of::<kvrelay_naming>(),
        seed,
        block_tokens,
        lora_id,
        salt: salt.as_ptr(),
        salt_len: salt.len(),
    };
    let mut names = vec![0u64; tokens.len() / block_tokens.max(1)];
    let mut n = 0usize;
    // SAFETY: `naming` is a local of this header's size whose salt lives for the call; `tokens`
    // and `names` are live slices of their lengths, distinct from each other and the salt.
    let st = unsafe {
        kvrelay_block_names(&naming, 0, 0, tokens.as_ptr(), tokens.len(), names.as_mut_ptr(), names.len(), &mut n)
    };
    check("kvrelay_block_names", st).expect("block_tokens is at least 1 and the buffer holds every full block");
    names.truncate(n);
    names
}

/// The content digests of the full blocks of a request's `tokens` under the engine identity
/// `identity` (`kvrelay_block_digests`; no salt: the salt separates names, and equal tokens
/// under one identity have equal KV whatever the salt).
pub fn block_digests(identity: &[u8], tokens: &[u32], block_tokens: usize) -> Vec<[u8; 32]> {
    let naming = kvrelay_naming {
        size: std::mem::size_of::<kvrelay_naming>(),
        seed: 0,
        block_tokens,
        lora_id: 0,
        salt: std::ptr::null(),
        salt_len: 0,
    };
    let mut out = vec![[0u8; 32]; tokens.len() / block_tokens.max(1)];
    let mut n = 0usize;
    // SAFETY: `naming` is a local of this header's size (no salt); `identity`, `tokens` and `out`
    // are live slices of their lengths (`out` holds `out.len()` digests of 32 bytes), distinct.
    let st = unsafe {
        kvrelay_block_digests(
            &naming,
            identity.as_ptr(),
            identity.len(),
            std::ptr::null(),
            0,
            tokens.as_ptr(),
            tokens.len(),
            out.as_mut_ptr().cast(),
            out.len(),
            &mut n,
        )
    };
    check("kvrelay_block_digests", st).expect("block_tokens is at least 1 and the buffer holds every full block");
    out.truncate(n);
    out
}
