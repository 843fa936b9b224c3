//! Block names from C (SPEC sections 8 and 10): the naming function of [`crate::names`], so
//! that every runtime that links kvrelay names the same tokens the same way, and the blocks'
//! content digests, which a runtime compares before it imports a block.

use super::boundary::{bytes, guard, out_ptr, put, read_sized, with_detail, SizedStruct};
use super::copy::array;
use super::status::kvrelay_status::{self, *};
use crate::names::{file_digest, name_seed, Naming, BLOCK_DIGEST_BYTES};

/// Bytes of one block content digest (`kvrelay_block_digests`): a SHA-256.
pub const KVRELAY_BLOCK_DIGEST_BYTES: usize = 32;

const _: () = assert!(KVRELAY_BLOCK_DIGEST_BYTES == BLOCK_DIGEST_BYTES);

/// What a chain of block names depends on besides the tokens. `size` is
/// `sizeof(kvrelay_naming)` as the caller's header declares it (fields are only ever
/// appended; the rules of `kvrelay_fetch_callbacks`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvrelay_naming {
    /// `sizeof(kvrelay_naming)`.
    pub size: usize,
    /// The engine's seed: `kvrelay_name_seed` of its identity (the model file's digest, its
    /// build and every setting that changes KV bytes).
    pub seed: u64,
    /// Tokens per block (at least 1).
    pub block_tokens: usize,
    /// The LoRA adapter's id (0: none).
    pub lora_id: u64,
    /// The request's cache salt (bytes; `(NULL, 0)` or empty: none), hashed into block 0 only.
    pub salt: *const u8,
    /// Bytes of `salt`.
    pub salt_len: usize,
}

// SAFETY: repr(C), `size` first, and all-zero bytes are a valid value (NULL salt, zeros).
unsafe impl SizedStruct for kvrelay_naming {
    // 0.4.0's struct, the first: size, seed, block_tokens, lora_id, salt, salt_len
    const FIRST_SIZE: usize = 48;
}

/// The seed of the block names of an engine whose identity is `identity` (bytes; for example
/// the model file's sha256, the build and the KV settings as text): kvrelay's base seed xor
/// XXH3-64 of `identity`. Two engines agree on names only where their identities are equal.
///
/// # Safety
/// `identity` NULL with `len` 0, or readable for `len` bytes; `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_name_seed(identity: *const u8, len: usize, out: *mut u64) -> kvrelay_status {
    guard(|| {
        let out = out_ptr(out)?;
        // SAFETY: forwarded contract.
        let id = unsafe { bytes(identity, len) }?;
        // SAFETY: checked non-NULL; writable per the contract.
        unsafe { put(out, name_seed(id)) };
        Ok(())
    })
}

/// The SHA-256 of the file at `path` (UTF-8, `len` bytes, no NUL needed) into `out`
/// (`KVRELAY_BLOCK_DIGEST_BYTES` bytes): what an engine's identity binds its model file, its
/// adapters and its control vectors by, so that two files of one name and size never share
/// block names. `KVRELAY_ERR_IO` when the file cannot be read (nothing written). Cost: reads
/// the whole file (about 1-2 GB/s where the CPU has SHA extensions): compute it once per file
/// and keep it where a restart finds it. Since 0.3.3.
///
/// # Safety
/// `path` readable for `len` bytes; `out` NULL or writable for `KVRELAY_BLOCK_DIGEST_BYTES`
/// bytes.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_file_digest(path: *const u8, len: usize, out: *mut u8) -> kvrelay_status {
    guard(|| {
        let out = out_ptr(out)?;
        // SAFETY: forwarded contract.
        let p = unsafe { super::boundary::text(path, len) }?;
        let d = file_digest(std::path::Path::new(p))
            .map_err(|e| with_detail(KVRELAY_ERR_IO, format!("reading the file to digest it: {}", e.kind())))?;
        // SAFETY: checked non-NULL; writable for 32 bytes per the contract.
        unsafe { std::ptr::copy_nonoverlapping(d.as_ptr(), out, d.len()) };
        Ok(())
    })
}

/// The names of the full blocks of `tokens` (SPEC section 8): `tokens` begin at block index
/// `first_block` of their request, and the block before is named `parent` (ignored when
/// `first_block` is 0), so a runtime can name a prompt whole (`0, 0`) or block by block as it
/// grows. A partial last block is not named. Size-query convention: `*n_out` gets the number
/// of full blocks; a `cap` below it writes nothing else (`KVRELAY_ERR_BUFFER_TOO_SMALL`).
/// Allocates nothing; one XXH3 pass over each block's `16 + 4 * block_tokens` bytes.
/// `KVRELAY_ERR_INVALID_ARGUMENT` for `block_tokens` 0 or a `naming` no version of this
/// header describes.
///
/// # Safety
/// `naming` NULL or readable for `naming->size` bytes, its salt readable for `salt_len` bytes;
/// `tokens` NULL with `n_tokens` 0 or readable for `n_tokens` values; `names` NULL with `cap`
/// 0 or writable for `cap` values, not overlapping `tokens` or the salt; `n_out` NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_block_names(
    naming: *const kvrelay_naming,
    parent: u64,
    first_block: usize,
    tokens: *const u32,
    n_tokens: usize,
    names: *mut u64,
    cap: usize,
    n_out: *mut usize,
) -> kvrelay_status {
    guard(|| {
        // SAFETY: forwarded contract.
        let Some((naming, tokens, need)) =
            (unsafe { plan_blocks(naming, tokens, n_tokens, names.is_null(), cap, n_out, || Ok(())) })?
        else {
            return Ok(());
        };
        if !names.is_aligned() {
            return Err(with_detail(KVRELAY_ERR_INVALID_ARGUMENT, "a misaligned names buffer"));
        }
        // SAFETY: non-NULL (cap >= need > 0), aligned, writable for `cap >= need` values per
        // the contract, and not overlapping the inputs the caller lent (distinct buffers).
        let out = unsafe { std::slice::from_raw_parts_mut(names, need) };
        naming.names_into(parent, first_block, tokens, out);
        Ok(())
    })
}

/// The content digests of the full blocks of `tokens`: `KVRELAY_BLOCK_DIGEST_BYTES` (32) bytes
/// each, a chained SHA-256 over the domain `"kvrelay-block-digest-1"`, SHA-256 of `identity`,
/// the digest of the block before (32 zero bytes for block 0), `naming->lora_id` (u64 LE),
/// for block 0 a non-empty salt (its length as u64 LE, then its bytes) and the block's tokens
/// (u32 LE). `identity` is the engine's identity, the bytes passed to `kvrelay_name_seed`
/// (`(NULL, 0)`: empty); `naming->seed` is not used. A digest covers its block's whole prefix,
/// the engine and the salt: equal digests mean equal KV for equal engines.
///
/// Names (`kvrelay_block_names`) are what routers index; they are 64 bits of a
/// non-cryptographic hash, neither secret nor collision-resistant, so a crafted block can
/// carry a popular prefix's name. The digest is the block's identity in the data plane: a
/// runtime imports a block into a slot only when the block's recorded digest equals the digest
/// this function gives for that slot's own tokens at those positions. Never trust a name
/// alone.
///
/// Blocks are cut as `kvrelay_block_names` cuts them: `tokens` begin at block index
/// `first_block` of their request, and the block before has the digest `parent` (32 bytes;
/// ignored and may be NULL when `first_block` is 0, else `KVRELAY_ERR_NULL` for NULL). A
/// partial last block is not digested. Size-query convention: `*n_out` gets the number of full
/// blocks; a `cap` (in digests: `digests` holds `cap * 32` bytes) below it writes nothing else
/// (`KVRELAY_ERR_BUFFER_TOO_SMALL`). Allocates nothing; one SHA-256 pass over each block's
/// `94 + 4 * block_tokens` bytes (plus the salt once and `identity` once per call).
/// `KVRELAY_ERR_INVALID_ARGUMENT` for `block_tokens` 0 or a `naming` no version of this
/// header describes.
///
/// # Safety
/// `naming` NULL or readable for `naming->size` bytes, its salt readable for `salt_len` bytes;
/// `identity` NULL with `identity_len` 0 or readable for `identity_len` bytes; `parent` NULL
/// or readable for 32 bytes (read before anything is written, so it may lie in `digests`);
/// `tokens` NULL with `n_tokens` 0 or readable for `n_tokens` values; `digests` NULL with
/// `cap` 0 or writable for `cap * 32` bytes, not overlapping `tokens`, `identity` or the salt;
/// `n_out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn kvrelay_block_digests(
    naming: *const kvrelay_naming,
    identity: *const u8,
    identity_len: usize,
    parent: *const u8,
    first_block: usize,
    tokens: *const u32,
    n_tokens: usize,
    digests: *mut u8,
    cap: usize,
    n_out: *mut usize,
) -> kvrelay_status {
    guard(|| {
        let (mut id, mut parent_digest) = (&[][..], [0u8; BLOCK_DIGEST_BYTES]);
        let read_parent = || {
            // SAFETY: forwarded contract.
            id = unsafe { bytes(identity, identity_len) }?;
            if first_block == 0 {
                Ok(())
            } else if parent.is_null() {
                Err(with_detail(KVRELAY_ERR_NULL, "no parent digest for a first_block above 0"))
            } else {
                // SAFETY: non-NULL and readable for 32 bytes per the contract; `[u8; 32]` has
                // alignment 1; copied out before the output is written (it may lie there).
                parent_digest = unsafe { parent.cast::<[u8; BLOCK_DIGEST_BYTES]>().read() };
                Ok(())
            }
        };
        // SAFETY: forwarded contract.
        let Some((naming, tokens, need)) =
            (unsafe { plan_blocks(naming, tokens, n_tokens, digests.is_null(), cap, n_out, read_parent) })?
        else {
            return Ok(());
        };
        // `from_raw_parts_mut` requires the slice to span at most isize::MAX bytes.
        if need.checked_mul(BLOCK_DIGEST_BYTES).is_none_or(|b| b > isize::MAX as usize) {
            return Err(KVRELAY_ERR_INVALID_ARGUMENT);
        }
        // SAFETY: non-NULL (cap >= need > 0), `[u8; 32]` has alignment 1, writable for
        // `cap * 32 >= need * 32` bytes (within isize::MAX) per the contract, and not
        // overlapping the inputs the caller lent (distinct buffers; `parent` was copied).
        let out = unsafe { std::slice::from_raw_parts_mut(digests.cast::<[u8; BLOCK_DIGEST_BYTES]>(), need) };
        naming.digests_into(id, &parent_digest, first_block, tokens, out);
        Ok(())
    })
}

/// A request's blocks to write: the naming, the tokens and how many full blocks they hold.
type Planned<'a> = (Naming<'a>, &'a [u32], usize);

/// What `kvrelay_block_names` and `kvrelay_block_digests` check alike, in this order: `n_out`,
/// the naming (a size some header declares, `block_tokens` above 0), its salt and the tokens
/// readable, then `more` (the caller's own inputs), then the output (NULL only with `cap` 0)
/// and the size query (`*n_out` = full blocks; `KVRELAY_ERR_BUFFER_TOO_SMALL` below it).
/// `Some((naming, tokens, blocks))` when there are blocks to write, `None` when there are none.
///
/// # Safety
/// As the two callers: `naming` NULL or readable for its size, its salt for `salt_len` bytes;
/// `tokens` NULL with `n_tokens` 0 or readable for `n_tokens` values; `n_out` NULL or writable.
#[allow(clippy::too_many_arguments)] // the C call's inputs, as they come
unsafe fn plan_blocks<'a>(
    naming: *const kvrelay_naming,
    tokens: *const u32,
    n_tokens: usize,
    out_null: bool,
    cap: usize,
    n_out: *mut usize,
    more: impl FnOnce() -> Result<(), kvrelay_status>,
) -> Result<Option<Planned<'a>>, kvrelay_status> {
    let n_out = out_ptr(n_out)?;
    // SAFETY: forwarded contract.
    let c = unsafe { read_sized(naming) }?;
    c.check("kvrelay_naming")?;
    let c = c.value;
    if c.block_tokens == 0 {
        return Err(with_detail(KVRELAY_ERR_INVALID_ARGUMENT, "block_tokens is 0"));
    }
    // SAFETY: forwarded contract.
    let (salt, tokens) = unsafe { (bytes(c.salt, c.salt_len)?, array(tokens, n_tokens)?) };
    more()?;
    if out_null && cap != 0 {
        return Err(KVRELAY_ERR_INVALID_ARGUMENT);
    }
    let need = tokens.len() / c.block_tokens;
    // SAFETY: checked non-NULL; writable per the contract.
    unsafe { put(n_out, need) };
    if cap < need {
        return Err(KVRELAY_ERR_BUFFER_TOO_SMALL);
    }
    if need == 0 {
        return Ok(None);
    }
    Ok(Some((Naming { seed: c.seed, block_tokens: c.block_tokens, lora_id: c.lora_id, salt }, tokens, need)))
}
