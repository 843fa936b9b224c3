//! A counting global allocator proves the hot-path rules: validation allocates nothing and an
//! admitted snapshot is exactly one allocation (bytes and index together).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use kvrelay::hints::Scratch;
use kvrelay::{Admission, AdmissionConfig, Outcome, Reason};

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
