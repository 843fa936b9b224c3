//! What a peer can send a serving KV agent: the first message (with and without a pre-shared
//! key) and every frame after it, fed to the service as one connection's bytes (an in-memory
//! connection: no sockets, so each input is one handshake and transfer). The agent serves a
//! small host-memory pool whose blocks are all held and recorded. The service must never
//! panic, never read past the input, never write more than the limits allow, and unpin
//! exactly what it pinned.
#![no_main]

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, OnceLock};

use kvrelay::agent::wire::Scripted;
use kvrelay::agent::{Agent, AgentConfig, BlockHolder, Fingerprint, Psk};
use kvrelay::copy::KvLayout;
use libfuzzer_sys::fuzz_target;

const BLOCKS: u32 = 8;
const KVB: u64 = 256;

struct Holder(Arc<AtomicI64>);
impl BlockHolder for Holder {
    fn pin(&self, names: &[u64], ids: &mut [u32]) -> usize {
        // names 1..=BLOCKS are held, in block n-1
        let mut n = 0;
        for (i, &name) in names.iter().enumerate() {
            if name == 0 || name > u64::from(BLOCKS) {
                break;
            }
            ids[i] = (name - 1) as u32;
            n += 1;
        }
        self.0.fetch_add(n as i64, Ordering::Relaxed);
        n
    }
    fn unpin(&self, ids: &[u32]) {
        self.0.fetch_sub(ids.len() as i64, Ordering::Relaxed);
    }
}

struct Served {
    plain: Agent,
    keyed: Agent,
    pins: Arc<AtomicI64>,
    _pool: Vec<u128>,
}

fn served() -> &'static Served {
    static S: OnceLock<Served> = OnceLock::new();
    S.get_or_init(|| {
        let mut pool = vec![0u128; (2 * BLOCKS as u64 * KVB / 16) as usize];
        let layout = KvLayout::per_layer_kv_first(&[pool.as_mut_ptr() as u64], BLOCKS, KVB).unwrap();
        let pins = Arc::new(AtomicI64::new(0));
        let fp = Fingerprint { block_tokens: 32, layers: 1, kv_heads: 1, head_dim: 64, dtype_bytes: 2, naming: 1 };
        let mk = |key: Option<Psk>| {
            let mut c = AgentConfig::new(fp.clone());
            c.listen = None;
            // no key: authentication off (not the per-user key), so the plain agent parses
            // whatever a peer sends as its hello
            c.per_user_key = key.is_some();
            c.key = key;
            c.limits.max_names = 64;
            // SAFETY: the pool lives in the static next to the agents, for the process's life.
            let a = unsafe { Agent::new(c, layout.clone(), Box::new(Holder(pins.clone()))) }.unwrap();
            a.record_checksums(&(0..BLOCKS).collect::<Vec<_>>()).unwrap();
            a
        };
        let plain = mk(None);
        let keyed = mk(Some(Psk::new(b"the fuzz target's pre-shared key").unwrap()));
        Served { plain, keyed, pins, _pool: pool }
    })
}

fuzz_target!(|data: &[u8]| {
    let s = served();
    let Some((&which, input)) = data.split_first() else { return };
    let agent = if which & 1 == 0 { &s.plain } else { &s.keyed };
    let mut conn = Scripted::new(input);
    agent.serve_connection(&mut conn);
    // at most a refusal, or an offer and every block of the largest request once
    let block = 12 + 16 + 2 * KVB as usize;
    assert!(conn.written <= 12 + 16 + 64 * block + 12 + 256 + 12 + 64);
    assert_eq!(s.pins.load(Ordering::Relaxed), 0, "every pinned block was unpinned");
});
