//! Cross-instance KV transfer between two `kvrelay-server` processes on loopback: fetch by
//! hint (root-aligned, suffix-only, partial), `/v1/kv_transfer`, and failures (killed source,
//! memory gone bad at the source, stalled, fingerprint mismatch, peers and endpoints off their lists) that
//! leave nothing behind and still answer as a cold run.

mod common;

use std::net::TcpListener;
use std::time::Duration;

use common::{
    blocks, cached, client, cold, sent, sent_since, server_bin, start, start_env, test_transport, text, wait_until,
    Server,
};
use serde_json::{json, Value};

/// 32-token blocks of 128 bytes of text: `n` blocks named by `tag`.
fn blocks_text(tag: &str, n: usize) -> String {
    (0..n).map(|i| format!("{tag:>8}-block-{i:04}-").repeat(8)[..128].to_string()).collect()
}

fn kv_endpoint(s: &Server) -> String {
    client::get(s.addr, "/v1/kv/info").unwrap().json()["kv_endpoint"].as_str().unwrap().to_string()
}

fn hashes(s: &Server, p: &str) -> Vec<u64> {
    let v = s.post("/v1/kv/lookup", &json!({"prompt": p})).json();
    v["block_hashes"].as_array().unwrap().iter().map(|h| h.as_u64().unwrap()).collect()
}

fn fetch_hint(endpoint: &str, hashes: &[u64]) -> Value {
    json!({"protocol_version": "0.1", "message_id": "t", "actions": [{
        "action_id": "a1", "action_type": "kv.fetch", "action_version": "1.0",
        "payload": {"source_control_endpoint": endpoint, "block_hashes": hashes}}]})
}

fn failed(s: &Server, reason: &str) -> f64 {
    s.metric(&format!("kvrelay_server_kv_transfers_total{{outcome=\"failed\",reason=\"{reason}\"}}"))
}

/// A destination trusting `source`'s KV endpoint.
fn destination(source: &Server, extra: &[&str]) -> Server {
    let ep = kv_endpoint(source);
    let mut args = vec!["--trusted-endpoint", ep.as_str()];
    args.extend_from_slice(extra);
    start(true, &args)
}

#[test]
fn hinted_fetch_takes_only_the_missing_run_root_aligned_or_suffix_only() {
    let src = start(true, &[]);
    let dst = destination(&src, &[]);
    let ep = kv_endpoint(&src);
    let transport = test_transport().unwrap_or_else(|| "tcp".into());
    for s in [&src, &dst] {
        assert_eq!(client::get(s.addr, "/v1/kv/info").unwrap().json()["transport"], transport.as_str());
    }
    // 10 full blocks + a tail; the destination already holds the first 3.
    let p = blocks_text("alpha", 10) + "tail";
    let want = cold(&dst, &p);
    src.complete(json!({"prompt": p}));
    dst.complete(json!({"prompt": blocks_text("alpha", 3)}));
    let h = hashes(&src, &p);
    assert_eq!(h.len(), 10);
    let before = sent(&src);
    let v = dst.complete(json!({"prompt": p, "kv_hints": fetch_hint(&ep, &h)}));
    assert_eq!(sent_since(&src, before, 7.0), 7.0, "only the 7 blocks the destination lacked crossed the wire");
    assert_eq!((cached(&v), text(&v)), (320, want.clone()), "all 10 blocks reused, answer as cold");
    assert_eq!(dst.metric("kvrelay_server_fetched_tokens_total"), 7.0 * 32.0);

    // Suffix-only hint (Dynamo sends what the destination lacks): blocks 4.. of another prompt.
    let q = blocks_text("bravo", 9);
    let want_q = cold(&dst, &q);
    src.complete(json!({"prompt": q}));
    dst.complete(json!({"prompt": blocks_text("bravo", 4)}));
    let hq = hashes(&src, &q);
    let before = sent(&src);
    let v = dst.complete(json!({"prompt": q, "kv_hints": fetch_hint(&ep, &hq[4..])}));
    assert_eq!(sent_since(&src, before, 5.0), 5.0);
    assert_eq!((cached(&v), text(&v)), (9 * 32, want_q));

    // A suffix that starts after the first missing block fetches nothing (a block is useless
    // without its prefix), and a different naming scheme fetches nothing.
    let r = blocks_text("charlie", 6);
    src.complete(json!({"prompt": r}));
    let hr = hashes(&src, &r);
    let before = sent(&src);
    let v = dst.complete(json!({"prompt": r, "kv_hints": fetch_hint(&ep, &hr[2..])}));
    let v2 = dst.complete(json!({"prompt": r, "cache_salt": "x", "kv_hints": fetch_hint(&ep, &[1, 2, 3])}));
    assert_eq!(sent(&src) - before, 0.0);
    assert_eq!(cached(&v), 0);
    assert_eq!(text(&v), text(&v2));
    assert_eq!(dst.metric("kvrelay_server_kv_transfers_total{outcome=\"skipped\",reason=\"nothing_to_fetch\"}"), 2.0);
    assert_eq!(blocks(&dst, "held"), 0.0);
}

#[test]
fn kv_transfer_statuses_prefill_on_the_source_dedup_and_cap() {
    let src = start(true, &[]);
    let src_url = format!("http://{}", src.addr);
    let dst = start_env(true, &[], &[("KV_TRANSFER_SOURCE_ALLOW", &src_url), ("KV_TRANSFER_MAX_INFLIGHT", "1")]);
    let p = blocks_text("delta", 6);
    let want = cold(&dst, &p);

    let bad = client::request(dst.addr, "POST", "/v1/kv_transfer", Some(b"{nope")).unwrap();
    let no_source = dst.post("/v1/kv_transfer", &json!({"prompt": p}));
    let no_prompt = dst.post("/v1/kv_transfer", &json!({"source": src_url}));
    let off_list = dst.post("/v1/kv_transfer", &json!({"source": "http://127.0.0.1:9", "prompt": p}));
    assert_eq!([bad.status, no_source.status, no_prompt.status, off_list.status], [400, 400, 400, 403]);
    let closed = start(true, &[]); // no KV_TRANSFER_SOURCE_ALLOW: fail closed
    assert_eq!(closed.post("/v1/kv_transfer", &json!({"source": src_url, "prompt": p})).status, 403);

    // The source does not hold the prompt: it is asked to prefill first.
    let r = dst.post("/v1/kv_transfer", &json!({"source": src_url, "prompt": p}));
    assert_eq!((r.status, r.json()["status"].as_str()), (202, Some("accepted")));
    let hash = r.json()["request_hash"].clone();
    wait_until("the transfer", || dst.post_get("/v1/kv_transfer/stats")["inflight"] == 0);
    let st = dst.post_get("/v1/kv_transfer/stats");
    assert_eq!((st["transferred"].as_u64(), st["blocks_moved"].as_u64()), (Some(1), Some(6)));
    assert_eq!(src.metric("kvrelay_server_requests_total{endpoint=\"/v1/kv/prefill\",status=\"200\"}"), 1.0);
    // `seen` is the dedup table's size (hashes within the TTL), not a count of requests: the
    // six refused or malformed requests above left nothing in it
    assert_eq!(st["seen"], 1);
    let again = dst.post("/v1/kv_transfer", &json!({"source": src_url, "prompt": p})).json();
    assert_eq!((again["status"].as_str(), &again["request_hash"]), (Some("deduped"), &hash));
    assert_eq!(dst.post_get("/v1/kv_transfer/stats")["seen"], 1, "a deduped request adds nothing");
    let v = dst.complete(json!({"prompt": p}));
    assert_eq!((cached(&v), text(&v)), (192, want));

    // A source that already holds a prompt is not asked to prefill it again.
    let q = blocks_text("echo", 4);
    src.complete(json!({"prompt": q}));
    assert_eq!(dst.post("/v1/kv_transfer", &json!({"source": src_url, "prompt": q})).status, 202);
    wait_until("the transfer", || dst.post_get("/v1/kv_transfer/stats")["transferred"] == 2);
    assert_eq!(src.metric("kvrelay_server_requests_total{endpoint=\"/v1/kv/prefill\",status=\"200\"}"), 1.0);

    // The in-flight cap: a stalled source holds the one slot; the next request is skipped_busy.
    let stall = start(true, &["--debug-endpoints", "--kv-fault", "stall"]);
    let stall_url = format!("http://{}", stall.addr);
    let dst2 = start_env(true, &[], &[("KV_TRANSFER_SOURCE_ALLOW", &stall_url), ("KV_TRANSFER_MAX_INFLIGHT", "1")]);
    let a = dst2.post("/v1/kv_transfer", &json!({"source": stall_url, "prompt": blocks_text("f", 3)})).json();
    let b = dst2.post("/v1/kv_transfer", &json!({"source": stall_url, "prompt": blocks_text("g", 3)})).json();
    assert_eq!((a["status"].as_str(), b["status"].as_str()), (Some("accepted"), Some("skipped_busy")));
    // the stall runs past the read deadline: failed by timeout, dedup cleared, retry accepted
    wait_until("the stalled transfer to fail", || dst2.post_get("/v1/kv_transfer/stats")["failed"] == 1);
    let st = dst2.post_get("/v1/kv_transfer/stats");
    assert_eq!(st["failures"]["timeout"], 1);
    assert_eq!(st["skipped_busy"], 1);
    // checked before the retry, whose own transfer holds fresh blocks while it waits
    assert_eq!(blocks(&dst2, "held"), 0.0, "nothing of the failed transfer is held");
    assert_eq!(st["seen"], 0, "a failed transfer clears its dedup entry");
    let retry = dst2.post("/v1/kv_transfer", &json!({"source": stall_url, "prompt": blocks_text("f", 3)})).json();
    assert_eq!(retry["status"], "accepted");
}

/// A source may advertise a KV endpoint only on the trusted registry or on its own host: one
/// that listens for KV on another address is refused before any connection to it.
#[test]
fn kv_transfer_refuses_an_advertised_endpoint_off_the_registry_and_the_sources_host() {
    let src = start(true, &["--kv-listen", "127.0.0.2:0"]);
    assert!(kv_endpoint(&src).starts_with("tcp://127.0.0.2:"));
    let src_url = format!("http://{}", src.addr);
    let dst = start_env(true, &[], &[("KV_TRANSFER_SOURCE_ALLOW", &src_url)]);
    let p = blocks_text("kilo", 3);
    src.complete(json!({"prompt": p}));
    assert_eq!(dst.post("/v1/kv_transfer", &json!({"source": src_url, "prompt": p})).status, 202);
    wait_until("the transfer to fail", || dst.post_get("/v1/kv_transfer/stats")["failed"] == 1);
    assert_eq!(dst.post_get("/v1/kv_transfer/stats")["failures"]["endpoint_not_allowed"], 1);
    assert_eq!(sent(&src), 0.0, "nothing was fetched from the advertised endpoint");
    // the same endpoint on the registry is used
    let ep = kv_endpoint(&src);
    // (this destination's agent threads poll between the steps of a fetch: `--kv-poll-us`)
    let dst2 = start_env(
        true,
        &["--trusted-endpoint", ep.as_str(), "--kv-poll-us", "200"],
        &[("KV_TRANSFER_SOURCE_ALLOW", &src_url)],
    );
    assert_eq!(dst2.post("/v1/kv_transfer", &json!({"source": src_url, "prompt": p})).status, 202);
    wait_until("the transfer", || dst2.post_get("/v1/kv_transfer/stats")["transferred"] == 1);
    assert_eq!(sent_since(&src, 0.0, 3.0), 3.0);
}

trait PostGet {
    fn post_get(&self, path: &str) -> Value;
}
impl PostGet for Server {
    fn post_get(&self, path: &str) -> Value {
        client::get(self.addr, path).unwrap().json()
    }
}

#[test]
fn failing_sources_leave_nothing_behind_and_answer_as_cold() {
    for (fault, reason) in [("corrupt", "corrupt"), ("die", "truncated"), ("stall", "timeout")] {
        let src = start(true, &["--debug-endpoints", "--kv-fault", fault]);
        let dst = destination(&src, &["--kv-blocks", "64"]);
        let p = blocks_text(fault, 8) + "and a tail";
        let want = cold(&dst, &p);
        src.complete(json!({"prompt": p}));
        let h = hashes(&src, &p);
        let v = dst.complete(json!({"prompt": p, "kv_hints": fetch_hint(&kv_endpoint(&src), &h)}));
        assert_eq!(text(&v), want, "{fault}: the request answers as a cold run");
        // A killed NIXL source is seen where its death lands: loading its metadata (UCX
        // connects then: `connect`) or the READ (`truncated`).
        let reasons: &[&str] = if fault == "die" && test_transport().as_deref() == Some("nixl") {
            &[reason, "connect"]
        } else {
            &[reason]
        };
        let counted: f64 = reasons.iter().map(|r| failed(&dst, r)).sum();
        assert_eq!(counted, 1.0, "{fault}: counted once as one of {reasons:?}");
        assert_eq!(blocks(&dst, "held"), 0.0, "{fault}: nothing held after the request");
        // only complete, verified blocks were committed: at most the first block came through
        let fetched = dst.metric("kvrelay_server_fetched_tokens_total");
        assert!(fetched <= 32.0, "{fault}: {fetched} tokens committed from a failing source");
        let again = dst.complete(json!({"prompt": p}));
        assert_eq!(text(&again), want, "{fault}: what was committed is right");
    }
}

#[test]
fn fingerprint_mismatch_peers_and_endpoints_off_their_lists() {
    // another layout: same names (same tokens and block size), other KV shape
    let src = start(true, &["--layers", "2"]);
    let dst = destination(&src, &[]);
    let p = blocks_text("golf", 4);
    let want = cold(&dst, &p);
    src.complete(json!({"prompt": p}));
    let v = dst.complete(json!({"prompt": p, "kv_hints": fetch_hint(&kv_endpoint(&src), &hashes(&src, &p))}));
    assert_eq!((cached(&v), text(&v)), (0, want));
    assert_eq!(failed(&dst, "fingerprint_mismatch"), 1.0);

    // a peer off the source's --kv-peer-allow is refused by the KV service
    let strict = start(true, &["--kv-peer-allow", "10.9.9.9"]);
    let dst2 = destination(&strict, &[]);
    strict.complete(json!({"prompt": p}));
    dst2.complete(json!({"prompt": p, "kv_hints": fetch_hint(&kv_endpoint(&strict), &hashes(&strict, &p))}));
    assert_eq!(failed(&dst2, "refused"), 1.0);
    assert_eq!(sent(&strict), 0.0);

    // a listener nobody accepts on: no hint endpoint off the registry, no source off the
    // allowlist ever gets a connection. The server would connect before it answers (policy and
    // fetch come before the prefill, the 403 before any transfer), and the kernel queues a
    // loopback connection before connect returns, so after the answers the accept queue holds
    // every connection that was ever opened
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    l.set_nonblocking(true).unwrap();
    let d3 = start_env(
        true,
        &["--trusted-endpoint", "tcp://127.0.0.1:1"],
        &[("KV_TRANSFER_SOURCE_ALLOW", "http://127.0.0.1:2")],
    );
    let hint = fetch_hint(&format!("tcp://127.0.0.1:{port}"), &hashes(&d3, &p));
    let v = d3.complete(json!({"prompt": p, "kv_hints": hint}));
    assert!(v["choices"][0]["text"].is_string());
    assert_eq!(d3.metric("kvrelay_kv_policy_discarded_total{reason=\"endpoint_not_trusted\"}"), 1.0);
    let r = d3.post("/v1/kv_transfer", &json!({"source": format!("http://127.0.0.1:{port}"), "prompt": p}));
    assert_eq!(r.status, 403);
    let queued = std::iter::from_fn(|| l.accept().ok()).take(16).count();
    assert_eq!(queued, 0, "a connection was opened to an address off the lists");
}

#[test]
fn nixl_transport_fails_at_startup_without_its_libraries() {
    // an empty folder for the library: the server must not start (never a failure at the first
    // transfer), and say why
    let empty = std::env::temp_dir().join(format!("kvrelay-no-nixl-{}", std::process::id()));
    std::fs::create_dir_all(&empty).unwrap();
    let out = std::process::Command::new(server_bin())
        .args(["serve", "--listen", "127.0.0.1:0", "--kv-transport", "nixl", "--nixl-lib-dir"])
        .arg(&empty)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "started without the NIXL libraries: {err}");
    assert!(out.stdout.is_empty(), "it said it was listening");
    let why = if cfg!(feature = "nixl") { "cannot load" } else { "no NIXL support" };
    assert!(err.contains("--kv-transport nixl") && err.contains(why), "{err}");
    let bad = std::process::Command::new(server_bin())
        .args(["serve", "--listen", "127.0.0.1:0", "--kv-transport", "carrier-pigeon"])
        .output()
        .unwrap();
    assert!(
        !bad.status.success()
            && String::from_utf8_lossy(&bad.stderr).contains("expected tcp, nixl, cuda-ipc, or cuda-ipc,nixl")
    );
    // the same-host GPU transport with a host pool: refused at startup, with the reason
    let host = std::process::Command::new(server_bin())
        .args(["serve", "--listen", "127.0.0.1:0", "--kv-transport", "cuda-ipc"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&host.stderr);
    assert!(!host.status.success() && host.stdout.is_empty(), "started a CUDA IPC transport over host memory: {err}");
    assert!(err.contains("--kv-transport cuda-ipc") && err.contains("CUDA device"), "{err}");
    // both, in order of preference, over a host pool: refused at startup for CUDA IPC's sake
    // (or for the missing NIXL support)
    let both = std::process::Command::new(server_bin())
        .args(["serve", "--listen", "127.0.0.1:0", "--kv-transport", "cuda-ipc,nixl"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&both.stderr);
    assert!(!both.status.success() && both.stdout.is_empty(), "started cuda-ipc,nixl over host memory: {err}");
    let why = if cfg!(feature = "nixl") { "CUDA device" } else { "no NIXL support" };
    assert!(err.contains("--kv-transport cuda-ipc,nixl") && err.contains(why), "{err}");
    // a poll past the library's ceiling: refused at startup, naming the limit
    let poll = std::process::Command::new(server_bin())
        .args(["serve", "--listen", "127.0.0.1:0", "--kv-poll-us", "20000"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&poll.stderr);
    assert!(!poll.status.success() && poll.stdout.is_empty(), "started with a 20 ms poll: {err}");
    assert!(err.contains("poll"), "{err}");
}

/// A NIXL reader against a TCP-only source falls back to TCP (the blocks are fetched, counted
/// as a fallback); with `--kv-transport-fallback false` it is refused (a cold run); a NIXL
/// source still serves TCP readers. Runs in both transfer runs of the test command (it picks each instance's
/// transport itself); needs a server built with the `nixl` feature and the NIXL libraries
/// (`KVRELAY_NIXL_LIB_DIR`, e.g. from `source scripts/nixl-env.sh`).
#[test]
#[cfg_attr(not(feature = "nixl"), ignore = "needs a server built with the nixl feature")]
fn nixl_and_tcp_instances_meet() {
    // UCX over TCP on loopback, as the NIXL run of the test command has it
    // (with GPU pools UCX picks its own transports: NIXL refuses `UCX_TLS=tcp` alone where a
    // GPU is present)
    let gpu = std::env::var("KVRELAY_DEVICE").is_ok_and(|d| d.starts_with("cuda"));
    let ucx: &[(&str, &str)] = if gpu { &[] } else { &[("UCX_TLS", "tcp"), ("UCX_NET_DEVICES", "lo")] };
    let tcp_src = start(true, &["--kv-transport", "tcp"]);
    let ep = kv_endpoint(&tcp_src);
    let pinned = ["--trusted-endpoint", ep.as_str(), "--kv-transport", "nixl", "--kv-transport-fallback", "false"];
    let dst = start_env(true, &pinned, ucx);
    let p = blocks_text("india", 4);
    let want = cold(&dst, &p);
    tcp_src.complete(json!({"prompt": p}));
    let hint = fetch_hint(&kv_endpoint(&tcp_src), &hashes(&tcp_src, &p));
    let v = dst.complete(json!({"prompt": p, "kv_hints": hint}));
    assert_eq!((cached(&v), text(&v)), (0, want.clone()));
    assert_eq!(failed(&dst, "refused"), 1.0);
    assert_eq!(blocks(&dst, "held"), 0.0);
    // by default the same reader falls back to TCP for that source
    let falls = start_env(true, &["--trusted-endpoint", ep.as_str(), "--kv-transport", "nixl"], ucx);
    let v = falls.complete(json!({"prompt": p, "kv_hints": hint}));
    assert_eq!((cached(&v), text(&v)), (128, want.clone()));
    assert_eq!(failed(&falls, "refused"), 0.0);
    assert_eq!(falls.metric("kvrelay_kv_agent_transport_fallbacks_total"), 1.0);

    let nixl_src = start_env(true, &["--kv-transport", "nixl"], ucx);
    let tcp_dst = destination(&nixl_src, &["--kv-transport", "tcp"]);
    nixl_src.complete(json!({"prompt": p}));
    let v =
        tcp_dst.complete(json!({"prompt": p, "kv_hints": fetch_hint(&kv_endpoint(&nixl_src), &hashes(&nixl_src, &p))}));
    assert_eq!((cached(&v), text(&v)), (128, want));
    assert_eq!(sent_since(&nixl_src, 0.0, 4.0), 4.0);
}

#[test]
fn failure_policy_fail_turns_a_failed_load_into_a_request_error() {
    let src = start(true, &["--debug-endpoints", "--kv-fault", "corrupt"]);
    let dst = destination(&src, &["--kv-load-failure-policy", "fail"]);
    let p = blocks_text("hotel", 4);
    src.complete(json!({"prompt": p}));
    let r = dst
        .post("/v1/completions", &json!({"prompt": p, "kv_hints": fetch_hint(&kv_endpoint(&src), &hashes(&src, &p))}));
    assert_eq!((r.status, r.json()["error"]["code"].as_str()), (502, Some("kv_load_failed")));
    assert!(r.json()["error"]["message"].as_str().unwrap().contains("corrupt"));
    assert_eq!(blocks(&dst, "held"), 0.0);
}

/// Idle connections from one peer cannot starve the KV service: a peer holds at most 16, those
/// hold no serving slot, and each is dropped when its hello does not come within 2 s.
#[test]
fn idle_connections_from_one_peer_do_not_starve_a_fetch() {
    use std::io::Read;
    let src = start(true, &[]);
    let dst = destination(&src, &[]);
    let p = blocks_text("lima", 4);
    let want = cold(&dst, &p);
    src.complete(json!({"prompt": p}));
    let to: std::net::SocketAddr = kv_endpoint(&src).strip_prefix("tcp://").unwrap().parse().unwrap();
    // more than the 64 serving slots: before the per-peer limit they starved every real peer
    let idle: Vec<std::net::TcpStream> = (0..70)
        .map(|_| {
            let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
            s.bind(&std::net::SocketAddr::from(([127, 0, 0, 2], 0)).into()).unwrap();
            s.connect(&to.into()).unwrap();
            s.into()
        })
        .collect();
    let v = dst.complete(json!({"prompt": p, "kv_hints": fetch_hint(&kv_endpoint(&src), &hashes(&src, &p))}));
    assert_eq!((cached(&v), text(&v)), (128, want), "the fetch was served beside the idle connections");
    // every idle connection ends: refused at once beyond the per-peer limit, or closed after the
    // hello deadline (bounded: each read has a 10 s timeout)
    for mut s in idle {
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut sink = Vec::new();
        let r = s.read_to_end(&mut sink);
        assert!(
            r.is_ok() || r.unwrap_err().kind() == std::io::ErrorKind::ConnectionReset,
            "an idle connection stayed open"
        );
    }
}

/// Every completed fetch of `s`'s agent, whatever its outcome.
fn agent_fetches_completed(s: &Server) -> f64 {
    let p = "kvrelay_kv_agent_fetches_total";
    let failed: f64 = [
        "connect",
        "timeout",
        "refused",
        "fingerprint_mismatch",
        "corrupt",
        "truncated",
        "source_miss",
        "auth_failed",
        "cancelled",
        "shutdown",
        "internal",
    ]
    .iter()
    .map(|r| s.metric(&format!("{p}{{outcome=\"failed\",reason=\"{r}\"}}")))
    .sum();
    failed + s.metric(&format!("{p}{{outcome=\"ok\",reason=\"none\"}}"))
}

/// A request that goes away while its hinted fetch runs cancels the fetch, and its destination
/// blocks go back to the pool only once the fetch completed: the source answers late (below the
/// I/O timeout), the pool is filled with other prompts meanwhile, and every one of them,
/// answered again from the cache, equals its cold answer (blocks handed out while the fetch
/// still wrote them would hold the fetched prefix's KV instead).
#[test]
fn a_request_that_goes_away_mid_fetch_cancels_it_and_keeps_its_blocks_until_it_ends() {
    let src = start(true, &["--debug-endpoints", "--kv-fault", "slow"]);
    let dst = destination(&src, &["--kv-blocks", "24"]);
    let p = blocks_text("gone", 8) + "and a tail";
    src.complete(json!({"prompt": p}));
    let h = hashes(&src, &p);
    let body = json!({"prompt": p, "max_tokens": 2, "kv_hints": fetch_hint(&kv_endpoint(&src), &h)}).to_string();
    let conn = client::send(dst.addr, "POST", "/v1/completions", Some(body.as_bytes())).unwrap();
    wait_until("the fetch to hold its destination blocks", || blocks(&dst, "held") >= 8.0);
    drop(conn);
    // other prompts take whatever blocks are free while the source is still slow
    let others: Vec<String> = (0..4).map(|i| blocks_text(&format!("other{i}"), 3) + "x").collect();
    let first: Vec<String> =
        others.iter().map(|q| text(&dst.complete(json!({"prompt": q, "max_tokens": 4})))).collect();
    wait_until("the fetch to complete", || agent_fetches_completed(&dst) >= 1.0);
    assert_eq!(
        dst.metric("kvrelay_kv_agent_fetches_total{outcome=\"failed\",reason=\"cancelled\"}"),
        1.0,
        "the request's going away cancelled its fetch"
    );
    wait_until("every block released", || blocks(&dst, "held") == 0.0);
    for (q, want) in others.iter().zip(&first) {
        let v = dst.complete(json!({"prompt": q, "max_tokens": 4}));
        assert!(cached(&v) > 0, "answered from the cache");
        assert_eq!(&text(&v), want, "a cached answer equals its cold answer");
    }
}

/// `/v1/kv/prefill` runs in a running slot like any request: beyond `--max-concurrency` and the
/// queue it answers 429 instead of prefilling beside them.
#[test]
fn kv_prefill_takes_a_running_slot() {
    let s = start(true, &["--prefill-tokens-per-s", "200", "--max-concurrency", "1", "--max-queue", "1"]);
    let body = |c: char| json!({"prompt": c.to_string().repeat(1600), "max_tokens": 2}).to_string(); // 2 s each
    let a = client::send(s.addr, "POST", "/v1/completions", Some(body('y').as_bytes())).unwrap();
    wait_until("the first request to run", || blocks(&s, "held") > 0.0);
    let b = client::send(s.addr, "POST", "/v1/completions", Some(body('x').as_bytes())).unwrap();
    wait_until("the second request to wait", || s.metric("kvrelay_server_requests_waiting") == 1.0);
    let r = s.post("/v1/kv/prefill", &json!({"prompt": blocks_text("pre", 2)}));
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "queue_full");
    drop((a, b));
    // with the slot free again it prefills
    wait_until("the slot to be free", || {
        blocks(&s, "held") == 0.0 && s.metric("kvrelay_server_requests_waiting") == 0.0
    });
    let r = s.post("/v1/kv/prefill", &json!({"prompt": blocks_text("pre", 2)}));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["blocks_held"], 2);
}
