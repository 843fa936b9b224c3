//! Threads sharing, retaining and dropping one snapshot concurrently.

use std::sync::Barrier;

use kvrelay::{Admission, AdmissionConfig, Outcome, Snapshot};

fn assert_send_sync<T: Send + Sync>() {}

#[test]
fn snapshots_are_shared_across_threads() {
    assert_send_sync::<Snapshot>();
    assert_send_sync::<Admission>();
    assert_send_sync::<kvrelay::ActionEnvelope>();
    let edge = Admission::new(AdmissionConfig { trusted: true, ..Default::default() }).unwrap();
    let raw = r#"{"protocol_version":"0.1","message_id":"shared","actions":[{"action_id":"a","action_type":"kv.fetch","action_version":"1.0","payload":{"block_hashes":[1,2,3]}}]}"#;
    let Outcome::Admitted(snap) = edge.admit(Some(raw.as_bytes())) else { panic!() };
    let want = snap.canonical().to_vec();
    let threads = 8;
    let barrier = Barrier::new(threads);
    std::thread::scope(|s| {
        for t in 0..threads {
            let (snap, barrier, want, edge) = (&snap, &barrier, &want, &edge);
            s.spawn(move || {
                barrier.wait();
                let mut held = Vec::new();
                for i in 0..20_000 {
                    let c = snap.clone();
                    assert_eq!(c.message_id(), "shared");
                    assert_eq!(c.action(0).unwrap().payload(), br#"{"block_hashes":[1,2,3]}"#);
                    if (i + t) % 7 == 0 {
                        held.push(c);
                    }
                    if held.len() > 50 {
                        held.drain(..25);
                    }
                    if i % 1000 == 0 {
                        // admitting concurrently from every thread uses per-thread scratch
                        let Outcome::Admitted(o) = edge.admit(Some(raw.as_bytes())) else { panic!() };
                        assert_eq!(o.canonical(), &want[..]);
                        let view = snap.action_envelope(0).unwrap();
                        held.push(view.snapshot().clone());
                    }
                }
                assert_eq!(snap.canonical(), &want[..]);
            });
        }
    });
    assert_eq!(snap.handle_count(), 1, "every clone was dropped");
    assert_eq!(edge.counters().values().admitted, 1 + 8 * 20);
}
