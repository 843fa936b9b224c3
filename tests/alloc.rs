//! A counting global allocator proves the hot-path rules: validation allocates nothing and an
//! admitted snapshot is exactly one allocation (bytes and index together).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::Arc;

use kvrelay::hints::Scratch;
use kvrelay::{Admission, AdmissionConfig, Outcome, Reason};

#[path = "../benches/common/shapes.rs"]
mod shapes;

struct Counting;

thread_local! {
    // const-initialized: touching it never allocates
    static ALLOCS: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: forwards every call to the system allocator unchanged; the thread-local counter is
// const-initialized and needs no allocation.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCS.with(|c| c.set(c.get() + 1));
        // SAFETY: same contract as ours.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        ALLOCS.with(|c| c.set(c.get() + 1));
        // SAFETY: same contract as ours.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Allocations made by this thread while running `f`.
fn allocs<R>(f: impl FnOnce() -> R) -> (usize, R) {
    let before = ALLOCS.with(Cell::get);
    let r = f();
    (ALLOCS.with(Cell::get) - before, r)
}

fn hashes(n: usize, pretty: bool) -> String {
    let h: Vec<String> = (0..n as u64).map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15).to_string()).collect();
    let sep = if pretty { ", " } else { "," };
    format!(
        r#"{{"protocol_version":"0.1","message_id":"m\u0031","actions":[{{"action_id":"a\"","action_type":"kv.fetch","action_version":"1.0","payload":{{"source_control_endpoint":"tcp://127.0.0.1:23280","block_hashes":[{}],"f":1.50}}}}],"extra":{{"k":-0}}}}"#,
        h.join(sep)
    )
}

#[test]
fn validation_allocates_nothing_and_a_snapshot_once() {
    let edge = Admission::new(AdmissionConfig { trusted: true, ..Default::default() }).unwrap();
    let mut sc = Scratch::with_limits(65_536, 128);
    let cases = [
        hashes(2, false),
        hashes(256, true),
        hashes(3000, false),
        // already canonical: copied, not re-rendered
        r#"{"protocol_version":"0.1","message_id":"m","actions":[]}"#.to_string(),
    ];
    for raw in &cases {
        // a pre-sized scratch needs no growth, even the first time
        let (n, o) = allocs(|| edge.admit_with(&mut sc, Some(raw.as_bytes())));
        assert!(matches!(o, Outcome::Admitted(_)), "{o:?}");
        assert_eq!(n, 1, "one allocation per admitted snapshot");
        drop(o);
        // the per-thread scratch after a warm-up call
        edge.admit(Some(raw.as_bytes()));
        let (n, o) = allocs(|| edge.admit(Some(raw.as_bytes())));
        assert!(matches!(o, Outcome::Admitted(_)));
        assert_eq!(n, 1);
    }
    // rejected hints allocate nothing at all: validation alone
    let rejected = [
        (format!("{} ", &hashes(200, true)[..500]), Reason::Malformed),
        (hashes(200, true).replace("\"0.1\"", "\"0.2\""), Reason::UnknownVersion),
        (hashes(5000, false), Reason::Oversized),
        (hashes(10, false).replace("\"m\\u0031\"", "7"), Reason::Malformed),
        (hashes(10, false).replace("-0", "1e999"), Reason::Malformed),
    ];
    for (raw, reason) in &rejected {
        edge.admit_with(&mut sc, Some(raw.as_bytes()));
        let (n, o) = allocs(|| edge.admit_with(&mut sc, Some(raw.as_bytes())));
        assert!(matches!(o, Outcome::Ignored(i) if i.reason == *reason), "{o:?}");
        assert_eq!(n, 0, "validation allocates nothing ({reason})");
    }
    // sharing a snapshot allocates nothing; accessors copy nothing
    let Outcome::Admitted(s) = edge.admit(Some(cases[1].as_bytes())) else { panic!() };
    let (n, _) = allocs(|| {
        let c = s.clone();
        let a = c.action(0).unwrap();
        (a.id().len(), a.payload().len(), c.message_id().len(), c.action_envelope(0).unwrap().canonical_len())
    });
    assert_eq!(n, 0);
}

/// The generated shapes of the benchmark (many mixed actions; string-heavy payloads with
/// escapes, surrogate pairs and non-ASCII text; hash lists) near the 65,536-byte limit, in every
/// spelling (compact, spaced, indented, whitespace of every kind everywhere, `ensure_ascii`):
/// admitted with exactly one allocation, and a rejected copy with none.
#[test]
fn generated_shapes_in_every_spelling_allocate_once() {
    use shapes::{Shape, Style, Ws};
    let edge = Admission::new(AdmissionConfig { trusted: true, ..Default::default() }).unwrap();
    let mut sc = Scratch::with_limits(65_536, 128);
    let styles = [
        Style::COMPACT,
        Style::SPACED,
        Style::INDENTED,
        Style { ws: Ws::Random(7), ensure_ascii: false },
        Style { ws: Ws::Spaced, ensure_ascii: true },
    ];
    for (shape, n) in [(Shape::Hashes, 3000), (Shape::Mixed, 150), (Shape::Strings, 50)] {
        let tree = shapes::envelope(shape, n, 0xA110C);
        for style in styles {
            let raw = shapes::write(&tree, style);
            let (n, o) = allocs(|| edge.admit_with(&mut sc, Some(raw.as_bytes())));
            assert!(matches!(o, Outcome::Admitted(_)), "{shape:?} {style:?}: {o:?}");
            assert_eq!(n, 1, "{shape:?} {style:?}: one allocation per admitted snapshot");
            let rejected = raw.replacen("\"0.1\"", "\"0.2\"", 1);
            let (n, o) = allocs(|| edge.admit_with(&mut sc, Some(rejected.as_bytes())));
            assert!(matches!(o, Outcome::Ignored(i) if i.reason == Reason::UnknownVersion), "{o:?}");
            assert_eq!(n, 0, "{shape:?} {style:?}: validation allocates nothing");
        }
    }
}

/// The other hot paths the design card names: copy submission (the CPU engine, which runs the
/// CUDA engine's plan), snapshot retain/release and views, MessagePack encoding into a reserved
/// buffer, candidate collection into a caller buffer, and orchestration up to the provider.
#[test]
fn copy_snapshot_views_msgpack_candidates_and_orchestration_allocate_nothing() {
    use kvrelay::copy::{CpuEngine, KvLayout};
    use kvrelay::policy::*;

    // copy submission
    let (layers, blocks, kv) = (4u32, 64u32, 256u64);
    let mut pool = vec![7u8; (u64::from(layers) * 2 * kv * u64::from(blocks)) as usize];
    let layout = KvLayout::all_layers_per_block(pool.as_mut_ptr() as u64, layers, blocks, kv).unwrap();
    let bb = layout.stage_block_bytes() as usize;
    // SAFETY: the layout covers exactly `pool`, which outlives the engine and is touched by
    // nothing else during its calls.
    let mut e = unsafe { CpuEngine::new(layout) };
    let ids: Vec<u32> = (0..32).rev().collect();
    let others: Vec<u32> = (32..64).collect();
    let mut staging = vec![0u8; ids.len() * bb];
    let (n, r) = allocs(|| e.gather(&ids, &mut staging));
    assert_eq!((n, r), (0, Ok(())), "gather");
    let (n, r) = allocs(|| e.scatter(&staging, &others));
    assert_eq!((n, r), (0, Ok(())), "scatter");

    // snapshot retain/release and views
    let edge = Admission::new(AdmissionConfig { trusted: true, ..Default::default() }).unwrap();
    let Outcome::Admitted(snap) = edge.admit(Some(hashes(16, false).as_bytes())) else { panic!("admitted") };
    let (n, total) = allocs(|| {
        let child = snap.clone();
        let a = child.action(0).unwrap();
        let t = child.message_id().len() + a.action_type().len() + a.version().len() + a.payload().len();
        let t = t + child.canonical().len() + child.action_count() + a.endpoint_value().map_or(0, <[u8]>::len);
        drop(child);
        t
    });
    assert!(total > 0);
    assert_eq!(n, 0, "retain, views, release");

    // MessagePack into a reserved buffer: documented to allocate only a small scratch (container
    // sizes, one string buffer), not in proportion to the envelope (a transport path)
    let mut mp = Vec::with_capacity(1 << 16);
    let (n, ()) = allocs(|| snap.write_msgpack(&mut mp));
    assert!(!mp.is_empty());
    let Outcome::Admitted(big) = edge.admit(Some(hashes(3000, false).as_bytes())) else { panic!("admitted") };
    let mut mp_big = Vec::with_capacity(1 << 17);
    let (n_big, ()) = allocs(|| big.write_msgpack(&mut mp_big));
    assert!(n <= 8 && n_big == n, "MessagePack scratch: {n} allocations for 16 hashes, {n_big} for 3,000");

    // candidates into a caller buffer
    let caps = Arc::new(Capabilities::builder().support("nixl", "kv.fetch", "1.0").build().unwrap());
    let mut list = Vec::with_capacity(8);
    let (n, counts) = allocs(|| collect_candidates_into(&snap, &caps, &mut list));
    assert_eq!((n, list.len(), counts.unknown_type), (0, 1, 0), "candidate collection");

    // orchestration up to the provider: the discards allocate nothing
    struct Refuse;
    impl Provider for Refuse {
        fn validate(&self, _: &FetchRequest<'_>) -> Result<(), ProviderError> {
            Err(ProviderError { code: 1 })
        }
        fn fetch(&self, _: &FetchRequest<'_>) -> Result<(), ProviderError> {
            Err(ProviderError { code: 2 })
        }
    }
    let config = PolicyConfig {
        bindings: vec![BindingSpec {
            id: "b".into(),
            family: "nixl".into(),
            addressing: Addressing::Named,
            supports: vec![("kv.fetch".into(), "1.0".into())],
            authorized: true,
        }],
        endpoints: vec!["tcp://10.9.9.9:1".into()],
        ..Default::default()
    };
    let o = Orchestrator::new(caps.clone(), config, Box::new(Refuse)).unwrap();
    let req = RequestInfo { generation_only: true, lora_adapter: false };
    let (n, d) = allocs(|| o.decide(&req, Some(&snap)));
    assert_eq!(d.discard(), Some(Discard::EndpointNotTrusted));
    assert_eq!(n, 0, "orchestration to a discard");
    let (n, d) = allocs(|| o.decide(&RequestInfo { generation_only: true, lora_adapter: true }, Some(&snap)));
    assert_eq!((n, d.discard()), (0, Some(Discard::LoraAdapter)));
}
