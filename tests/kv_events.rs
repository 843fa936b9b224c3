//! KV events from `kvrelay-server --kv-events-endpoint`, read the way a router reads them: a
//! ZMQ SUB on the PUB endpoint and a DEALER on the replay endpoint (libzmq, through the `zmq`
//! crate the server uses), batches decoded from msgpack.

mod common;

use std::time::{Duration, Instant};

use common::{client, start, Server};
use serde_json::{json, Value};

fn info(s: &Server) -> Value {
    client::get(s.addr, "/v1/kv/info").unwrap().json()
}

fn with_events(extra: &[&str]) -> Server {
    let mut args = vec!["--kv-events-endpoint", "tcp://127.0.0.1:0"];
    args.extend_from_slice(extra);
    start(true, &args)
}

/// One batch: its sequence number and events.
#[derive(Debug, Clone)]
struct Batch {
    seq: u64,
    events: Vec<Value>,
}

fn decode(seq: &[u8], payload: &[u8]) -> Batch {
    let seq = u64::from_be_bytes(seq.try_into().expect("8-byte sequence number"));
    let v: Value = rmp_serde::from_slice(payload).expect("a msgpack batch");
    let a = v.as_array().expect("[ts, events, dp_rank]");
    assert_eq!(a.len(), 3, "{v}");
    assert!(a[0].as_f64().unwrap() > 1.6e9, "ts is UNIX seconds: {v}");
    assert_eq!(a[2], 0, "dp_rank");
    Batch { seq, events: a[1].as_array().unwrap().clone() }
}

/// A subscriber: SUB for what is published from now on, DEALER for replay.
struct Router {
    sub: zmq::Socket,
    dealer: zmq::Socket,
    _ctx: zmq::Context,
}

impl Router {
    fn connect(s: &Server) -> Router {
        Router::login(s, None)
    }

    /// Connect logging in with ZMQ PLAIN as `user` with `password` (`None`: NULL, no login).
    fn login(s: &Server, plain: Option<(&str, &str)>) -> Router {
        let i = info(s);
        let ctx = zmq::Context::new();
        let login = |z: &zmq::Socket| {
            if let Some((user, password)) = plain {
                z.set_plain_username(Some(user)).unwrap();
                z.set_plain_password(Some(password)).unwrap();
            }
        };
        // linger 0: closing never waits for a message a refused peer could not take
        let sub = ctx.socket(zmq::SUB).unwrap();
        login(&sub);
        sub.set_linger(0).unwrap();
        sub.set_rcvtimeo(20_000).unwrap();
        sub.set_subscribe(b"").unwrap();
        sub.connect(i["kv_events"]["endpoint"].as_str().unwrap()).unwrap();
        let dealer = ctx.socket(zmq::DEALER).unwrap();
        login(&dealer);
        dealer.set_linger(0).unwrap();
        dealer.set_rcvtimeo(20_000).unwrap();
        dealer.set_sndtimeo(20_000).unwrap();
        dealer.connect(i["kv_events"]["replay_endpoint"].as_str().unwrap()).unwrap();
        Router { sub, dealer, _ctx: ctx }
    }

    /// The next published batch (bounded wait).
    fn next(&self) -> Batch {
        let m = self.sub.recv_multipart(0).expect("a batch within 20 s");
        assert_eq!(m.len(), 3, "[topic, seq, payload]");
        assert!(m[0].is_empty(), "the topic is empty");
        decode(&m[1], &m[2])
    }

    /// Every kept batch from `start` on, through the replay socket.
    fn replay(&self, start: u64) -> Vec<Batch> {
        self.dealer.send_multipart([&b""[..], &start.to_be_bytes()[..]], 0).unwrap();
        let mut out = Vec::new();
        loop {
            let m = self.dealer.recv_multipart(0).expect("a replay answer within 20 s");
            assert_eq!(m.len(), 3, "[b\"\", seq, payload]");
            assert!(m[0].is_empty());
            if m[1] == [0xff; 8] {
                assert!(m[2].is_empty());
                return out;
            }
            out.push(decode(&m[1], &m[2]));
        }
    }
}

fn tag(e: &Value) -> &str {
    e[0].as_str().unwrap()
}

/// Block names, parents and tokens of the `BlockStored` events of `batches`, in order.
fn stored(batches: &[Batch]) -> Vec<(u64, Option<u64>, Vec<u64>)> {
    let mut out = Vec::new();
    for e in batches.iter().flat_map(|b| &b.events).filter(|e| tag(e) == "BlockStored") {
        let a = e.as_array().unwrap();
        assert_eq!(a.len(), 7, "{e}");
        let names = a[1].as_array().unwrap();
        assert_eq!(names.len(), 1);
        assert_eq!((a[4].as_u64(), &a[5], a[6].as_str()), (Some(32), &Value::Null, Some("CPU")), "{e}");
        let tokens = a[3].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect();
        out.push((names[0].as_u64().unwrap(), a[2].as_u64(), tokens));
    }
    out
}

fn removed(batches: &[Batch]) -> Vec<u64> {
    batches
        .iter()
        .flat_map(|b| &b.events)
        .filter(|e| tag(e) == "BlockRemoved")
        .map(|e| e[1][0].as_u64().unwrap())
        .collect()
}

fn lookup(s: &Server, p: &str) -> (Vec<u64>, Vec<u64>) {
    let v = s.post("/v1/kv/lookup", &json!({"prompt": p})).json();
    let ids = |k: &str| v[k].as_array().unwrap().iter().map(|h| h.as_u64().unwrap()).collect::<Vec<_>>();
    (ids("block_hashes"), ids("token_ids"))
}

/// The `(name, parent, tokens)` a router must learn for prompt `p`'s full blocks.
fn expected(s: &Server, p: &str) -> Vec<(u64, Option<u64>, Vec<u64>)> {
    let (names, tokens) = lookup(s, p);
    names
        .iter()
        .enumerate()
        .map(|(i, &n)| (n, i.checked_sub(1).map(|j| names[j]), tokens[i * 32..(i + 1) * 32].to_vec()))
        .collect()
}

fn prompt(tag: &str, blocks: usize) -> String {
    (0..blocks).map(|i| format!("{tag:>8}-block-{i:04}-").repeat(8)[..128].to_string()).collect()
}

#[test]
fn info_names_what_a_router_registration_needs() {
    let s = with_events(&[]);
    let i = info(&s);
    let ev = &i["kv_events"];
    for k in ["endpoint", "replay_endpoint"] {
        let e = ev[k].as_str().unwrap();
        assert!(e.starts_with("tcp://127.0.0.1:") && !e.ends_with(":0"), "{k}: {e}");
    }
    assert_ne!(ev["endpoint"], ev["replay_endpoint"]);
    let d = &i["dynamo"];
    assert_eq!(d["kv_events_endpoint"], ev["endpoint"]);
    assert_eq!(d["replay_endpoint"], ev["replay_endpoint"]);
    assert_eq!(d["block_size"], 32);
    assert_eq!(d["model_name"], "kvrelay-reference");
    assert_eq!(d["router_hint_source_control_endpoints"]["0"], i["kv_endpoint"]);
    // an idle publisher still sends (empty) batches: a late router learns it missed some
    let r = Router::connect(&s);
    let idle = (0..5).map(|_| r.next()).find(|b| b.events.is_empty());
    assert!(idle.is_some(), "an empty batch within five batches of an idle server");
    // off by default: no events, no registration
    let plain = start(true, &[]);
    let i = info(&plain);
    assert!(i.get("kv_events").is_none() && i.get("dynamo").is_none(), "{i}");
    // a bad endpoint fails the start with the flag's name
    let out = std::process::Command::new(common::server_bin())
        .args(["serve", "--listen", "127.0.0.1:0", "--kv-events-endpoint", "udp://x:1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--kv-events-endpoint"), "{out:?}");
}

#[test]
fn commits_and_evictions_reach_a_router_in_order_and_a_late_router_replays_them() {
    // a small pool: 8 blocks, so the third 4-block prompt evicts the first
    let s = with_events(&["--kv-blocks", "8"]);
    let r = Router::connect(&s);

    // The SUB's subscription reaches the publisher at its own pace; an idle publisher sends an
    // (empty) batch every second, so the first batch that arrives says it is in place.
    let first = r.next();

    // From here on the SUB sees every batch, in sequence.
    let a = prompt("alpha", 4) + "tail";
    s.complete(json!({"prompt": a, "max_tokens": 1}));
    let want_a = expected(&s, &a);
    let mut seen = vec![first];
    let t = Instant::now();
    while !stored(&seen).ends_with(&want_a) {
        assert!(t.elapsed() < Duration::from_secs(20), "alpha's blocks were not all published: {seen:?}");
        seen.push(r.next());
    }
    for w in seen.windows(2) {
        assert_eq!(w[1].seq, w[0].seq + 1, "sequence numbers are consecutive");
    }
    // alpha is published exactly once: a second run reuses it
    s.complete(json!({"prompt": a, "max_tokens": 1}));

    // two more 4-block prompts: 8 fresh blocks in a pool of 8 evict alpha's 4 (and the warm-ups)
    for t in ["bravo", "charlie"] {
        s.complete(json!({"prompt": prompt(t, 4), "max_tokens": 1}));
    }
    let names_a: Vec<u64> = want_a.iter().map(|w| w.0).collect();
    let t = Instant::now();
    while !names_a.iter().all(|n| removed(&seen).contains(n)) {
        assert!(t.elapsed() < Duration::from_secs(20), "alpha's evictions were not published");
        seen.push(r.next());
    }
    let all_stored: Vec<u64> = stored(&seen).iter().map(|s| s.0).collect();
    assert_eq!(all_stored.iter().filter(|n| names_a.contains(n)).count(), 4, "alpha stored once");
    let evicted = s.metric("kvrelay_server_kv_blocks_evicted_total");
    assert!(evicted >= 4.0, "{evicted}");

    // A router that comes late replays from 0: the run starts with AllBlocksCleared, sequence
    // numbers start at the UNIX time in microseconds (above any earlier run's) and run on
    // without a gap, and the replay holds everything the live subscriber saw.
    let late = Router::connect(&s);
    let all = late.replay(0);
    assert_eq!(tag(&all[0].events[0]), "AllBlocksCleared");
    let now_us = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_micros() as u64;
    assert!(all[0].seq > now_us - 600_000_000 && all[0].seq <= now_us, "{} vs {now_us}", all[0].seq);
    for w in all.windows(2) {
        assert_eq!(w[1].seq, w[0].seq + 1);
    }
    let last = seen.last().unwrap().seq;
    let upto: Vec<Batch> = all.iter().filter(|b| b.seq <= last).cloned().collect();
    let from = seen[0].seq;
    assert_eq!(
        upto.iter().filter(|b| b.seq >= from).map(|b| b.events.clone()).collect::<Vec<_>>(),
        seen.iter().map(|b| b.events.clone()).collect::<Vec<_>>(),
        "the replay's batches are the published ones"
    );
    // from a sequence number on
    let tail = late.replay(last);
    assert_eq!(tail[0].seq, last);
    assert_eq!(tail[0].events, seen.last().unwrap().events);
    assert!(late.replay(u64::MAX - 1).is_empty());

    // a replay request of another shape gets nothing (and breaks nothing); one too large
    // ends that peer's connection; the replay socket goes on serving others
    late.dealer.send_multipart([&b""[..], &[1u8, 2, 3][..]], 0).unwrap();
    late.dealer.send(vec![7u8; 4096], 0).unwrap();
    let again = Router::connect(&s).replay(0);
    assert!(again.len() >= all.len());
    let published = s.metric("kvrelay_server_kv_events_published_total");
    assert!(published >= all.iter().map(|b| b.events.len()).sum::<usize>() as f64);
    assert_eq!(s.metric("kvrelay_server_kv_events_dropped_total"), 0.0);
}

#[test]
fn peers_off_the_allowlist_get_no_events() {
    let s = with_events(&["--kv-peer-allow", "10.9.9.9"]);
    let r = Router::connect(&s);
    // both the SUB and the DEALER handshake are refused by the server's ZAP handler
    common::wait_until("both connections refused", || s.metric("kvrelay_server_kv_events_refused_total") >= 2.0);
    s.complete(json!({"prompt": prompt("secret", 2), "max_tokens": 1}));
    // AllBlocksCleared and the prompt's two blocks, published (by the publisher's thread)
    common::wait_until("the events published", || s.metric("kvrelay_server_kv_events_published_total") >= 3.0);
    r.dealer.send_multipart([&b""[..], &0u64.to_be_bytes()[..]], zmq::DONTWAIT).ok();
    assert!(r.sub.recv_multipart(zmq::DONTWAIT).is_err(), "a refused subscriber got a batch");
    assert!(r.dealer.recv_multipart(zmq::DONTWAIT).is_err(), "a refused peer got a replay");
    // the default (loopback) lets this test's routers in
    let ok = with_events(&[]);
    let r = Router::connect(&ok);
    assert!(!r.replay(0).is_empty());
    assert_eq!(ok.metric("kvrelay_server_kv_events_refused_total"), 0.0);
}

#[test]
fn a_keyed_publisher_sends_only_to_peers_with_its_token() {
    let key_file = std::env::temp_dir().join(format!("kvrelay-events-key-{}", std::process::id()));
    std::fs::write(&key_file, "kv-events-test-key-0123456789\n").unwrap();
    // a key file is its owner's alone (one others may read is refused)
    std::fs::set_permissions(&key_file, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let s = with_events(&["--kv-events-key-file", key_file.to_str().unwrap()]);
    let _ = std::fs::remove_file(&key_file);
    assert_eq!(info(&s)["kv_events"]["key_required"], true);
    let key = kvrelay::agent::Psk::new(b"kv-events-test-key-0123456789").unwrap();
    let token = kvrelay::events::subscriber_token(&key);
    let mut wrong = token.clone().into_bytes();
    wrong[0] = if wrong[0] == b'0' { b'1' } else { b'0' };
    let wrong = String::from_utf8(wrong).unwrap();
    // the key itself, another token, no login (NULL: libzmq ends that handshake before ZAP)
    let with_key = Router::login(&s, Some(("kvrelay", "kv-events-test-key-0123456789")));
    let with_wrong = Router::login(&s, Some(("kvrelay", &wrong)));
    let other_user = Router::login(&s, Some(("router", &token)));
    let none = Router::connect(&s);
    common::wait_until("six logins refused", || s.metric("kvrelay_server_kv_events_refused_total") >= 6.0);
    let ok = Router::login(&s, Some(("kvrelay", &token)));
    s.complete(json!({"prompt": prompt("keyed", 2), "max_tokens": 1}));
    let want = expected(&s, &prompt("keyed", 2));
    common::wait_until("the events published", || s.metric("kvrelay_server_kv_events_published_total") >= 3.0);
    let all = ok.replay(0);
    assert_eq!(stored(&all), want, "the peer with the token replays the prompt's blocks");
    let live = ok.next();
    assert!(live.seq > all.first().unwrap().seq, "and receives what is published live");
    for (who, r) in
        [("the key", &with_key), ("another token", &with_wrong), ("another user", &other_user), ("no login", &none)]
    {
        r.dealer.send_multipart([&b""[..], &0u64.to_be_bytes()[..]], zmq::DONTWAIT).ok();
        assert!(r.sub.recv_multipart(zmq::DONTWAIT).is_err(), "a subscriber with {who} got a batch");
        assert!(r.dealer.recv_multipart(zmq::DONTWAIT).is_err(), "a peer with {who} got a replay");
    }
}

#[test]
fn replay_connections_from_one_address_are_bounded() {
    let s = with_events(&[]);
    let per = kvrelay::events::REPLAY_PEERS_PER_ADDRESS;
    // as many replay connections as one address may hold: each replays
    let mut routers: Vec<Router> = (0..per).map(|_| Router::connect(&s)).collect();
    for r in &routers {
        assert!(!r.replay(0).is_empty(), "a replay within the bound");
    }
    assert_eq!(s.metric("kvrelay_server_kv_event_replay_peers"), per as f64);
    // one more from the same address: its replay handshake is refused and counted, and it gets
    // nothing, while the others stay open
    let extra = Router::connect(&s);
    common::wait_until("the extra replay connection refused", || {
        s.metric("kvrelay_server_kv_event_replay_peers_refused_total") >= 1.0
    });
    extra.dealer.send_multipart([&b""[..], &0u64.to_be_bytes()[..]], zmq::DONTWAIT).ok();
    assert!(extra.dealer.recv_multipart(zmq::DONTWAIT).is_err(), "a peer past the bound got a replay");
    assert_eq!(s.metric("kvrelay_server_kv_events_refused_total"), 0.0, "not an allowlist refusal");
    drop(extra);
    // one closes: a new connection gets its room and replays
    drop(routers.pop());
    common::wait_until("the closed connection's room freed", || {
        s.metric("kvrelay_server_kv_event_replay_peers") < per as f64
    });
    assert!(!Router::connect(&s).replay(0).is_empty(), "room made by a closed connection is taken");
}
