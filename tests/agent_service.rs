//! The KV agent's service: what it serves (recorded checksums only), who gets in (fingerprint,
//! key, allowlist, slots, floods, kept-alive connections), what a peer may send, and a holder
//! that panics. Two agents over host-memory pools in one process; every wait is bounded and on
//! a condition.
#![cfg(feature = "agent")]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kvrelay::agent::{AgentStats, FailReason, FetchRequest, FetchResult, Limits, PeerAllow};

mod agent_fixture;
use agent_fixture::*;

#[test]
fn blocks_without_a_recorded_checksum_are_not_served() {
    let a = instance();
    a.hold(&NAMES[..2], 0);
    // held, but never recorded
    a.pool.write(5, &content(NAMES[2], a.pool.block_bytes()));
    a.cache.held.lock().unwrap().insert(NAMES[2], 5);
    let b = instance();
    let r = b.fetch(&a.endpoint(), &NAMES, 0, vec![0, 1, 2]);
    assert_eq!((r.failure, r.blocks), (None, 2));
    eventually("every pin released", || a.cache.pinned() == 0);
}

#[test]
fn fingerprints_must_match() {
    let a = instance();
    a.hold(&NAMES, 0);
    let b = instance_with(|c| c.fingerprint.naming = 0xbeef);
    let r = b.fetch(&a.endpoint(), &NAMES, 0, vec![0]);
    assert_eq!((r.failure, r.blocks), (Some(FailReason::FingerprintMismatch), 0));
    assert_eq!(a.agent.stats().refused_fingerprint_mismatch, 1);
    assert_eq!(a.cache.pin_calls.load(Ordering::Relaxed), 0, "nothing was pinned");
}

#[test]
fn authentication_with_a_pre_shared_key() {
    let a = instance_with(|c| c.key = key("a shared secret of the two instances"));
    a.hold(&NAMES, 0);
    let good = instance_with(|c| c.key = key("a shared secret of the two instances"));
    let r = good.fetch(&a.endpoint(), &NAMES, 0, vec![0, 1]);
    assert_eq!((r.failure, r.blocks), (None, 2), "{}", r.detail);
    let wrong = instance_with(|c| c.key = key("another secret, not the shared one"));
    let r = wrong.fetch(&a.endpoint(), &NAMES, 0, vec![0, 1]);
    assert_eq!((r.failure, r.blocks), (Some(FailReason::AuthFailed), 0), "{}", r.detail);
    // no key given: the per-user key, not the shared one
    let none = instance();
    let r = none.fetch(&a.endpoint(), &NAMES, 0, vec![0, 1]);
    assert_eq!((r.failure, r.blocks), (Some(FailReason::AuthFailed), 0), "{}", r.detail);
    // the fetcher stops at the source's proof, once it sent its own: the source counts the
    // refusal on its own thread
    eventually("both refusals counted", || a.agent.stats().refused_auth_failed == 2);
    // a destination with a key never talks to a source with another one (the per-user key),
    // nor to one with none
    let per_user = instance();
    per_user.hold(&NAMES, 0);
    let r = good.fetch(&per_user.endpoint(), &NAMES, 0, vec![0]);
    assert_eq!(r.failure, Some(FailReason::AuthFailed), "{}", r.detail);
    assert!(!r.detail.contains("shared secret"));
    let plain = unkeyed_with(|_| {});
    plain.hold(&NAMES, 0);
    let r = good.fetch(&plain.endpoint(), &NAMES, 0, vec![0]);
    assert_eq!(r.failure, Some(FailReason::AuthFailed), "{}", r.detail);
}

#[test]
fn peers_off_the_allowlist_are_refused() {
    let a = instance_with(|c| c.allow = PeerAllow::parse(&["10.0.0.0/8".into()]).unwrap());
    a.hold(&NAMES, 0);
    let b = instance();
    let r = b.fetch(&a.endpoint(), &NAMES, 0, vec![0]);
    assert_eq!(r.failure, Some(FailReason::Refused), "{}", r.detail);
    assert_eq!(a.agent.stats().refused_peer_not_allowed, 1);
    let text = a.agent.prometheus();
    assert!(text.contains("kvrelay_kv_agent_refused_total{reason=\"peer_not_allowed\"} 1\n"), "{text}");
    assert!(text.contains("kvrelay_kv_agent_refused_total{reason=\"busy\"} 0\n"), "{text}");
    let text = b.agent.prometheus();
    assert!(text.contains("kvrelay_kv_agent_fetches_total{outcome=\"failed\",reason=\"refused\"} 1\n"), "{text}");
    assert!(text.contains("# TYPE kvrelay_kv_agent_connections gauge\n"), "{text}");
}

#[test]
fn idle_and_garbage_connections_cannot_starve_real_peers() {
    let limits =
        Limits { max_pending: 4, max_per_peer: 2, handshake_timeout: Duration::from_millis(300), ..Limits::default() };
    let a = instance_with(|c| c.limits = limits);
    a.hold(&NAMES, 0);
    let ep = a.endpoint();
    // one peer opens many idle connections: each new one evicts that peer's oldest silent one,
    // so only the last 2 are kept
    let idle: Vec<TcpStream> = (0..10).map(|_| connect_from([127, 0, 0, 2], &ep)).collect();
    // (one is refused instead only when evictions outrun the evicted connections' threads)
    eventually("the evictions", || {
        let s = a.agent.stats();
        s.handshake_evicted + s.refused_per_peer_limit == 8
    });
    assert!(a.agent.stats().handshake_evicted > 0);
    // another sends garbage: refused as a bad request
    let mut junk = connect_from([127, 0, 0, 3], &ep);
    junk.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut answer = Vec::new();
    let _ = junk.read_to_end(&mut answer);
    assert_eq!(&answer[..4], b"KVRA", "a refusal frame");
    assert_eq!(a.agent.stats().refused_bad_request, 1);
    // a real peer is served while the idle connections are still open
    let b = instance();
    let r = b.fetch(&ep, &NAMES, 0, vec![0, 1, 2]);
    assert_eq!((r.failure, r.blocks), (None, 3), "{}", r.detail);
    // the idle ones are dropped at their handshake deadline
    eventually("idle connections closed", || a.agent.stats().handshake_timeouts >= 2);
    // (the real peer's connection stays open for its next fetch until it goes)
    drop(b);
    eventually("gauges back to zero", || {
        let s = a.agent.stats();
        s.pending_now == 0 && s.serving_now == 0
    });
    // those evicted were told `busy` before they closed (a peer reading a cut connection would
    // take the source for crashed); the 2 kept (timed out) were closed without a byte; any other
    // got a per-peer-limit refusal
    let (mut refused, mut busy, mut closed) = (0, 0, 0);
    for mut s in idle {
        let mut got = Vec::new();
        let _ = s.read_to_end(&mut got);
        if got.is_empty() {
            closed += 1;
            continue;
        }
        assert_eq!((&got[..4], got[5]), (&b"KVRA"[..], 7), "a refusal frame");
        match got[12] {
            r if r == kvrelay::agent::Refusal::PerPeerLimit as u8 => refused += 1,
            r if r == kvrelay::agent::Refusal::Busy as u8 => busy += 1,
            r => panic!("refusal {r}"),
        }
    }
    let s = a.agent.stats();
    assert_eq!((refused, busy, closed), (s.refused_per_peer_limit, s.handshake_evicted, 2));
}

/// A flood of silent and half-sent connections from the legitimate peer's own address (the
/// same loopback address its fetches come from) cannot keep its next fetch out: the oldest
/// connection still in its handshake makes room for each new one, so a peer that speaks
/// promptly gets in.
#[test]
fn a_flood_from_the_peers_own_address_does_not_keep_its_fetch_out() {
    // long handshake deadlines: the flood would hold its places for the whole test
    let limits = Limits { handshake_timeout: Duration::from_secs(60), ..Limits::default() };
    let a = instance_with(|c| c.limits = limits);
    a.hold(&NAMES, 0);
    let ep = a.endpoint();
    let mut flood: Vec<TcpStream> = (0..50).map(|_| connect_from([127, 0, 0, 1], &ep)).collect();
    for _ in 0..50 {
        let mut s = connect_from([127, 0, 0, 1], &ep);
        s.write_all(b"KVRA\x02").unwrap(); // a frame header that never completes
        flood.push(s);
    }
    // far more than max_per_peer (16) and max_pending (32) arrived; the accept loop has seen all
    // every flood connection was seen (accepted, or refused when evictions outran the threads
    // ending) and what is left of it holds the address's 16 places
    eventually("the flood settled", || {
        let s = a.agent.stats();
        s.accepted + s.refused_per_peer_limit + s.refused_busy == 100 && s.pending_now <= 16
    });
    let b = instance();
    let r = b.fetch(&ep, &NAMES, 0, vec![0, 1, 2]);
    assert_eq!((r.failure, r.blocks), (None, 3), "{}", r.detail);
    assert!(a.agent.stats().handshake_evicted > 0);
    drop(flood);
    eventually("every pin released", || a.cache.pinned() == 0);
}

#[test]
fn what_a_peer_sends_before_the_transfer_is_bounded() {
    // a hello claiming more names than allowed is refused from its header alone
    let a = unkeyed_with(|c| c.limits.max_names = 4); // the hello is sent by hand, unauthenticated
    let mut s = TcpStream::connect(a.endpoint().strip_prefix("tcp://").unwrap()).unwrap();
    let mut h = Vec::from(*b"KVRA");
    h.extend_from_slice(&[kvrelay::agent::wire::VERSION, 4, 0, 0]);
    h.extend_from_slice(&(1u32 << 30).to_le_bytes());
    s.write_all(&h).unwrap();
    let mut answer = Vec::new();
    let _ = s.read_to_end(&mut answer);
    assert_eq!(answer[5], 7, "a refusal");
    assert_eq!(answer[12], kvrelay::agent::Refusal::TooManyNames as u8);
    let s: AgentStats = a.agent.stats();
    assert_eq!(s.refused_too_many_names, 1);
}

/// With no key setting an agent authenticates with its user's per-user key: a process that
/// cannot prove it (here: a raw hello, and an agent with authentication off) learns nothing,
/// not even whether a name is held; agents of the same user fetch from each other unconfigured.
#[test]
fn the_default_key_is_the_users_and_a_peer_without_it_learns_nothing() {
    let a = instance();
    a.hold(&NAMES, 0);
    let mut s = TcpStream::connect(a.endpoint().strip_prefix("tcp://").unwrap()).unwrap();
    let hello = kvrelay::agent::wire::encode_hello(&fp(), &NAMES[..2]);
    s.write_all(&kvrelay::agent::wire::header(kvrelay::agent::wire::HELLO, hello.len())).unwrap();
    s.write_all(&hello).unwrap();
    let mut answer = Vec::new();
    let _ = s.read_to_end(&mut answer);
    assert_eq!(answer[5], 7, "a refusal");
    assert_eq!(answer[12], kvrelay::agent::Refusal::AuthFailed as u8);
    let unkeyed = unkeyed_with(|_| {});
    let r = unkeyed.fetch(&a.endpoint(), &NAMES, 0, vec![0, 1]);
    assert_eq!((r.failure, r.blocks), (Some(FailReason::AuthFailed), 0), "{}", r.detail);
    assert_eq!(a.agent.stats().refused_auth_failed, 2);
    assert_eq!(a.cache.pin_calls.load(Ordering::Relaxed), 0, "nothing was looked up");
    let same_user = instance();
    let r = same_user.fetch(&a.endpoint(), &NAMES, 0, vec![0, 1]);
    assert_eq!((r.failure, r.blocks), (None, 2), "{}", r.detail);
    eventually("every pin released", || a.cache.pinned() == 0);
}

/// Kept-alive connections wait in at most half of the source's `max_pending`: however many a
/// busy peer leaves open, a new peer's handshake still finds a slot.
#[test]
fn kept_alive_connections_leave_handshake_slots_for_new_peers() {
    // the source keeps idle connections for a minute: they would not time out during the test
    let a = instance_with(|c| {
        c.limits = Limits { max_pending: 4, idle_timeout: Duration::from_secs(60), ..Limits::default() }
    });
    a.hold(&NAMES, 0);
    // four agents, one connection each (connections are kept per agent, so none is shared)
    let peers: Vec<Instance> = (0..4).map(|_| instance()).collect();
    for (i, p) in peers.iter().enumerate() {
        let r = p.fetch(&a.endpoint(), &NAMES, 0, vec![i as u32]);
        assert_eq!((r.failure, r.blocks), (None, 1), "{}", r.detail);
    }
    assert_eq!(a.agent.stats().accepted, 4, "four connections");
    // two of the four wait for a next hello; the other two were closed
    eventually("the kept-alive connections settled", || {
        let s = a.agent.stats();
        s.serving_now == 0 && s.pending_now == 2
    });
    // another peer (a new agent, no connection of its own yet) is served, not refused as busy
    let c = instance();
    let r = c.fetch(&a.endpoint(), &NAMES, 0, vec![5]);
    assert_eq!((r.failure, r.blocks), (None, 1), "{}", r.detail);
    assert_eq!(a.agent.stats().refused_busy, 0);
    eventually("every pin released", || a.cache.pinned() == 0);
}

/// A kept-alive connection waiting for its next hello does not count against its peer's
/// `max_per_peer` (one the peer closes must not hold a place its replacement needs); it counts
/// again when its next hello comes.
#[test]
fn kept_alive_connections_count_against_their_peer_only_when_used() {
    let a = instance_with(|c| {
        c.limits = Limits { max_per_peer: 4, idle_timeout: Duration::from_secs(60), ..Limits::default() }
    });
    a.hold(&NAMES, 0);
    // four agents on one address (loopback), one connection each (connections are kept per
    // agent, so none is shared), all left waiting for a next hello
    let peers: Vec<Instance> = (0..4).map(|_| instance()).collect();
    for (i, p) in peers.iter().enumerate() {
        let r = p.fetch(&a.endpoint(), &NAMES, 0, vec![i as u32]);
        assert_eq!((r.failure, r.blocks), (None, 1), "{}", r.detail);
    }
    eventually("four connections wait for a next hello", || {
        let s = a.agent.stats();
        s.serving_now == 0 && s.pending_now == 4
    });
    // the same address opens a fifth connection: served, not refused
    let c = instance();
    let r = c.fetch(&a.endpoint(), &NAMES, 0, vec![5]);
    assert_eq!((r.failure, r.blocks), (None, 1), "{}", r.detail);
    // the four come back with their next hellos while the fifth waits: four in use again
    for (i, p) in peers.iter().enumerate() {
        let r = p.fetch(&a.endpoint(), &NAMES, 0, vec![8 + i as u32]);
        assert_eq!((r.failure, r.blocks), (None, 1), "{}", r.detail);
    }
    let s = a.agent.stats();
    assert_eq!((s.accepted, s.reused, s.refused_per_peer_limit), (5, 4, 0));
    eventually("every pin released", || a.cache.pinned() == 0);
}

/// Panics on the agent's threads are contained: a holder whose pin panics ends that
/// connection only (its slots and counts come back, the agent still frees promptly), and a
/// completion callback that panics still publishes the result and leaves its worker serving.
#[test]
fn panics_in_a_holder_or_a_completion_are_contained() {
    let a = instance();
    a.hold(&NAMES, 0);
    let b = instance_with(|c| c.limits.fetch_threads = 1);
    a.cache.panic_in_pin.store(true, Ordering::Relaxed);
    let r = b.fetch(&a.endpoint(), &NAMES, 0, vec![0]);
    assert!(r.failure.is_some(), "the source's connection ended");
    eventually("the source gave back every slot", || {
        let s = a.agent.stats();
        s.pending_now == 0 && s.serving_now == 0 && s.serve_aborted == 1
    });
    a.cache.panic_in_pin.store(false, Ordering::Relaxed);
    // the same peer is served again (its per-peer count came back)
    let r = b.fetch(&a.endpoint(), &NAMES, 0, vec![1]);
    assert_eq!((r.failure, r.blocks), (None, 1), "{}", r.detail);
    // a completion that panics: its result is published all the same, the one worker goes on
    let req = |dst: Vec<u32>| FetchRequest {
        endpoint: a.endpoint(),
        names: NAMES.to_vec(),
        held: 0,
        dst,
        deadline: Duration::from_secs(10),
        digests: Vec::new(),
    };
    let f = b.agent.submit(req(vec![2]), Some(Box::new(|_: &FetchResult| panic!("a completion with a bug")))).unwrap();
    let r = f.wait(Duration::from_secs(20)).expect("the result is published after the callback panicked");
    assert_eq!(r.failure, None, "{}", r.detail);
    let r = b.agent.submit(req(vec![3]), None).unwrap().wait(Duration::from_secs(20)).expect("the worker still runs");
    assert_eq!(r.failure, None, "{}", r.detail);
    let t = Instant::now();
    drop(a);
    assert!(t.elapsed() < Duration::from_secs(5), "the agent freed in {:?}", t.elapsed());
}
