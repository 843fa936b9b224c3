//! What a hostile source can send the fetch side of a KV agent. The first byte picks the form:
//! - even: the bytes are the source's whole answer to one hello, raw (offers, refusals, block
//!   frames, garbage), fed to the fetch through an in-memory connection;
//! - odd, `& 2 == 0`: a well-formed answer is built from the input (how many blocks it
//!   offers, their bytes, each with its true checksum) and then one byte of it, chosen by the
//!   input, is flipped or the answer is cut short, so the fuzzer reaches deep into the block
//!   frames;
//! - odd, `& 2 == 2`, `& 4 == 0`: the bytes are a NIXL in-place offer (`NIXL_OFFER`'s
//!   payload), decoded and checked against the destination's layout as a NIXL fetch does
//!   before any READ;
//! - odd, `& 6 == 6`: the bytes are a CUDA IPC offer (`IPC_OFFER`'s payload): decoded,
//!   checked, its exports decoded and both copy plans made with made-up mappings
//!   (`kvrelay::agent::check_offer_plans`), which must never read outside a mapping.
//!
//! The fetch must never panic, never read past the input, never report more blocks than it
//! asked for, and every block it reports verified must hold bytes whose checksum is the one
//! recorded for it (so nothing unverified is ever committed).
#![no_main]

use std::sync::OnceLock;

use kvrelay::agent::wire::{self, Scripted};
use kvrelay::agent::{Agent, AgentConfig, BlockHolder, Fingerprint};
use kvrelay::checksum::kv_checksum;
use kvrelay::copy::{CpuEngine, KvLayout};
use libfuzzer_sys::fuzz_target;

const BLOCKS: u32 = 8;
const KVB: u64 = 64;
const NAMES: [u64; 6] = [11, 12, 13, 14, 15, 16];

struct Nothing;
impl BlockHolder for Nothing {
    fn pin(&self, _: &[u64], _: &mut [u32]) -> usize {
        0
    }
    fn unpin(&self, _: &[u32]) {}
}

struct Dest {
    agent: Agent,
    layout: KvLayout,
    _pool: Vec<u128>,
}

fn dest() -> &'static Dest {
    static D: OnceLock<Dest> = OnceLock::new();
    D.get_or_init(|| {
        let mut pool = vec![0u128; (2 * BLOCKS as u64 * KVB / 16) as usize];
        let layout = KvLayout::per_layer_kv_first(&[pool.as_mut_ptr() as u64], BLOCKS, KVB).unwrap();
        let fp = Fingerprint { block_tokens: 32, layers: 1, kv_heads: 1, head_dim: 16, dtype_bytes: 2, naming: 1 };
        let mut c = AgentConfig::new(fp);
        c.listen = None;
        // SAFETY: the pool lives in the static next to the agent, for the process's life.
        let agent = unsafe { Agent::new(c, layout.clone(), Box::new(Nothing)) }.unwrap();
        Dest { agent, layout, _pool: pool }
    })
}

/// A well-formed answer for `asked` names: an offer of `count` blocks, each with its name, its
/// true checksum, no digest and its bytes.
fn well_formed(count: usize, asked: usize, bytes: &[u8], bb: usize) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&wire::header(wire::OFFER, 16));
    out.extend_from_slice(&wire::encode_offer(count as u32, 0, bb as u64));
    for i in 0..count.min(asked) {
        let block: Vec<u8> =
            (0..bb).map(|k| bytes.get((i * bb + k) % bytes.len().max(1)).copied().unwrap_or(0)).collect();
        out.extend_from_slice(&wire::header(wire::BLOCK, wire::BLOCK_HEAD + bb));
        out.extend_from_slice(&NAMES[i].to_le_bytes());
        out.extend_from_slice(&kv_checksum(&block).to_le_bytes());
        out.extend_from_slice(&[0; 8 + wire::DIGEST_BYTES]); // no tag, no digest
        out.extend_from_slice(&block);
    }
    out
}

fuzz_target!(|data: &[u8]| {
    let d = dest();
    let Some((&form, rest)) = data.split_first() else { return };
    let bb = d.agent.block_bytes();
    if form & 7 == 7 {
        // a CUDA IPC offer: nothing the copy plans would read lies outside the mappings
        let dst: Vec<u32> = (0..NAMES.len() as u32).map(|i| BLOCKS - 1 - i).collect();
        kvrelay::agent::check_offer_plans(&d.layout, rest, NAMES.len(), &dst);
        return;
    }
    if form & 3 == 3 {
        // a NIXL in-place offer
        if let Some(o) = wire::decode_in_place_offer(rest) {
            assert_eq!(wire::encode_in_place_offer(&o), rest, "an offer decodes only from its exact encoding");
            let _ = o.check(&d.layout, NAMES.len());
        }
        return;
    }
    let Some((&shape, rest)) = rest.split_first() else { return };
    let asked = 1 + (shape as usize % NAMES.len());
    // destination blocks: the last `asked` of the pool, in reverse
    let dst: Vec<u32> = (0..asked as u32).map(|i| BLOCKS - 1 - i).collect();
    let built;
    let answer: &[u8] = if form & 1 == 0 {
        rest
    } else {
        let Some((&count, rest)) = rest.split_first() else { return };
        let Some((pos, body)) = rest.split_at_checked(4) else { return };
        let count = count as usize % (asked + 2);
        let mut a = well_formed(count, asked, body, bb);
        let at = u32::from_le_bytes(pos.try_into().unwrap()) as usize;
        if !a.is_empty() {
            if at & 1 == 0 {
                let i = (at >> 1) % a.len();
                a[i] ^= 1 << (at % 8);
            } else {
                a.truncate((at >> 1) % (a.len() + 1));
            }
        }
        built = a;
        &built
    };
    let mut conn = Scripted::new(answer);
    let r = d.agent.fetch_over_connection(&mut conn, &NAMES, &dst).expect("valid destinations");
    assert!(r.blocks <= asked, "{} blocks reported for {asked} asked", r.blocks);
    assert_eq!(r.withheld, 0, "the TCP transport withholds nothing");
    if r.failure.is_none() {
        assert!(r.blocks > 0, "a fetch without a failure moved a block");
    }
    // every block reported verified holds bytes whose checksum is the one recorded for it
    // SAFETY: the pool lives in the static; no agent thread writes it (fetches run here).
    let mut e = unsafe { CpuEngine::new(d.layout.clone()) };
    let mut buf = vec![0u8; bb];
    for &id in &dst[..r.blocks] {
        e.gather(&[id], &mut buf).unwrap();
        assert_eq!(d.agent.recorded_checksum(id), Some(kv_checksum(&buf)), "block {id} committed unverified");
    }
});
