//! The test server over real HTTP on loopback: each test starts `kvrelay-server serve` as a
//! child process (its own settings and environment), talks to it with a plain HTTP/1.1 client
//! and reads its metrics and logs.

mod common;

use common::{blocks, cached, client, cold, prompt, start, start_env, text, wait_until, Server};
use serde_json::{json, Value};

const MARK: &str = "SECRET-HINT-MARKER-7f3a";

fn envelope(version: &str, hashes: Value) -> Value {
    json!({"protocol_version": version, "message_id": MARK, "actions": [{
        "action_id": "a1", "action_type": "kv.fetch", "action_version": "1.0",
        "payload": {"source_control_endpoint": "tcp://127.0.0.1:23280", "block_hashes": hashes}}]})
}

fn raw_completion(s: &Server, prompt: &str, hint_json: &str) -> client::Reply {
    let body = format!(r#"{{"prompt":{},"kv_hints":{hint_json}}}"#, json!(prompt));
    client::request(s.addr, "POST", "/v1/completions", Some(body.as_bytes())).unwrap()
}

#[test]
fn each_ignore_reason_is_counted_once_and_never_fails_the_request() {
    let s = start(true, &[]);
    let p = prompt("reasons", 60);
    let want = cold(&s, &p);
    let big: Vec<u64> = (0..4000).map(|i| u64::MAX - i).collect();
    let deep = format!("{}{}", "[".repeat(300), "]".repeat(300));
    let cases: Vec<(&str, String)> = vec![
        ("admitted", envelope("0.1", json!([1, 2])).to_string()),
        ("unknown_version", envelope("0.2", json!([1])).to_string()),
        ("oversized", envelope("0.1", json!(big)).to_string()),
        ("malformed", format!(r#"{{"protocol_version":"0.1","message_id":"{MARK}","actions":[],"x":1,"x":2}}"#)),
        ("malformed", format!(r#"{{"protocol_version":"0.1","message_id":"{MARK}","actions":[],"x":{deep}}}"#)),
        ("malformed", format!(r#"{{"protocol_version":"0.1","message_id":"{MARK}\ud800","actions":[]}}"#)),
        (
            "malformed",
            format!(r#"{{"protocol_version":"0.1","message_id":"{MARK}","actions":[],"n":123456789012345678901234}}"#),
        ),
        ("malformed", r#"[1,2,3]"#.to_string()),
    ];
    for (reason, h) in &cases {
        let before = counters(&s);
        let r = raw_completion(&s, &p, h);
        assert_eq!(r.status, 200, "{reason}: {}", r.text());
        assert_eq!(text(&r.json()), want, "{reason}: the answer equals a cold run");
        let after = counters(&s);
        let changed: Vec<_> =
            after.iter().zip(&before).filter(|(a, b)| a.1 != b.1).map(|(a, b)| (a.0, a.1 - b.1)).collect();
        assert_eq!(changed, vec![(*reason, 1.0)], "{reason}: exactly one counter moved by one");
    }
    // absent and null count nothing
    let before = counters(&s);
    s.complete(json!({"prompt": p, "kv_hints": null}));
    s.complete(json!({"prompt": p}));
    assert_eq!(counters(&s), before);

    let u = start(false, &[]);
    let r = raw_completion(&u, &p, "{\"not\": \"even a valid envelope\"}");
    assert_eq!((r.status, text(&r.json())), (200, want.clone()));
    assert_eq!(u.metric("kvrelay_kv_hints_ignored_total{reason=\"untrusted\"}"), 1.0);
    assert_eq!(u.metric("kvrelay_kv_hints_ignored_total{reason=\"malformed\"}"), 0.0, "untrusted hints are not parsed");
    assert!(!s.logs().contains(MARK) && !u.logs().contains(MARK), "a hint's bytes reached a log");
}

fn counters(s: &Server) -> Vec<(&'static str, f64)> {
    let m = s.metrics();
    let get = |series: &str| {
        m.lines()
            .find_map(|l| l.strip_prefix(series).and_then(|v| v.strip_prefix(' ')).map(|v| v.parse().unwrap()))
            .unwrap_or(0.0)
    };
    vec![
        ("admitted", get("kvrelay_kv_hints_admitted_total")),
        ("untrusted", get("kvrelay_kv_hints_ignored_total{reason=\"untrusted\"}")),
        ("unknown_version", get("kvrelay_kv_hints_ignored_total{reason=\"unknown_version\"}")),
        ("oversized", get("kvrelay_kv_hints_ignored_total{reason=\"oversized\"}")),
        ("malformed", get("kvrelay_kv_hints_ignored_total{reason=\"malformed\"}")),
    ]
}

#[test]
fn hint_spellings_batches_and_request_errors() {
    let s = start(true, &["--trusted-endpoint", "tcp://127.0.0.1:23280"]);
    let h = envelope("0.1", json!([5, 6]));
    let p = prompt("spell", 20);
    for body in [
        json!({"prompt": p, "kv_hint": h}),
        json!({"prompt": p, "kv_transfer_params": {"kv_hint": h, "other": 1}}),
        json!({"prompt": p, "router_hint": h}),
        json!({"prompt": p, "kv_transfer_params": {"router_hint": h}}),
    ] {
        let before = s.metric("kvrelay_kv_hints_admitted_total");
        s.complete(body);
        assert_eq!(s.metric("kvrelay_kv_hints_admitted_total"), before + 1.0);
    }
    // The admitted kv.fetch went through orchestration to the provider, which took it; its
    // hashes name none of this prompt's blocks, so nothing was fetched.
    assert_eq!(s.metric("kvrelay_kv_policy_named_fetch_total"), 4.0);
    assert_eq!(s.metric("kvrelay_server_kv_transfers_total{outcome=\"skipped\",reason=\"nothing_to_fetch\"}"), 4.0);
    // A payload without block_hashes is refused by the provider's own validation.
    let mut bad = envelope("0.1", json!([1]));
    bad["actions"][0]["payload"].as_object_mut().unwrap().remove("block_hashes");
    s.complete(json!({"prompt": p, "kv_hints": bad}));
    assert_eq!(s.metric("kvrelay_kv_policy_discarded_total{reason=\"provider_rejected\"}"), 1.0);

    let mut errors = vec![];
    let two = s.post("/v1/completions", &json!({"prompt": p, "kv_hints": h, "kv_hint": h}));
    errors.push((two.status, two.json()["error"]["code"].clone(), two.text()));
    let mismatch = s.post("/v1/completions", &json!({"prompt": ["a", "b", "c"], "kv_hints": [h, null]}));
    errors.push((mismatch.status, mismatch.json()["error"]["code"].clone(), mismatch.text()));
    let missing = s.post("/v1/completions", &json!({"max_tokens": 3}));
    errors.push((missing.status, missing.json()["error"]["code"].clone(), missing.text()));
    let bad = client::request(s.addr, "POST", "/v1/completions", Some(b"{\"prompt\": \"x\",")).unwrap();
    errors.push((bad.status, bad.json()["error"]["code"].clone(), bad.text()));
    let codes: Vec<_> = errors.iter().map(|(s, c, _)| (*s, c.as_str().unwrap_or("").to_string())).collect();
    assert_eq!(
        codes,
        [(400, "multiple_kv_hints"), (400, "kv_hints_length_mismatch"), (400, "missing_prompt"), (400, "invalid_json")]
            .map(|(s, c)| (s, c.to_string()))
    );
    for (_, _, body) in &errors {
        assert!(!body.contains(MARK), "an error body repeated the hint: {body}");
    }

    // a scalar envelope for a batch is admitted once and shared; an aligned list entry by entry
    let before = s.metric("kvrelay_kv_hints_admitted_total");
    let v = s.complete(json!({"prompt": ["a b c", "d e f", "g h i"], "kv_hints": h}));
    assert_eq!(v["choices"].as_array().unwrap().len(), 3);
    assert_eq!(s.metric("kvrelay_kv_hints_admitted_total"), before + 1.0);
    let v = s.complete(json!({"prompt": ["a b c", "d e f", "g h i"], "kv_hints": [h, null, envelope("7", json!([]))]}));
    let idx: Vec<_> = v["choices"].as_array().unwrap().iter().map(|c| c["index"].as_u64().unwrap()).collect();
    assert_eq!(idx, [0, 1, 2]);
    assert_eq!(s.metric("kvrelay_kv_hints_admitted_total"), before + 2.0);
    assert_eq!(s.metric("kvrelay_kv_hints_ignored_total{reason=\"unknown_version\"}"), 1.0);
    // batched answers equal single ones
    let single = text(&s.complete(json!({"prompt": "d e f"})));
    assert_eq!(v["choices"][1]["text"].as_str().unwrap(), single);

    let logs = s.logs();
    assert!(!logs.contains(MARK), "a hint's bytes reached a log");
    assert!(
        logs.contains("hint=admitted") && logs.contains("decision=provider_rejected"),
        "one line per request with the hint outcome"
    );
}

#[test]
fn reuse_salt_and_a_corrupted_block_that_changes_the_answer() {
    let s = start(true, &["--debug-endpoints"]);
    let p = prompt("reuse", 80);
    let first = s.complete(json!({"prompt": p}));
    assert_eq!(cached(&first), 0);
    let again = s.complete(json!({"prompt": p}));
    let pt = again["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(cached(&again), pt / 32 * 32, "every full block reused");
    assert_eq!(text(&again), text(&first));
    let salted = s.complete(json!({"prompt": p, "cache_salt": "tenant-b"}));
    assert_eq!((cached(&salted), text(&salted)), (0, text(&first)));

    let look = s.post("/v1/kv/lookup", &json!({"prompt": p})).json();
    assert_eq!(look["blocks_held"], look["blocks_total"]);
    let h = look["block_hashes"][1].as_u64().unwrap();
    let r = s.post("/debug/kv/corrupt", &json!({"block_hash": h}));
    assert_eq!(r.json()["corrupted"], true);
    let bad = s.complete(json!({"prompt": p}));
    assert!(cached(&bad) > 0);
    assert_ne!(text(&bad), text(&first), "reused KV that is wrong must change the answer");
    assert_eq!(cold(&s, &p), text(&first));
    let other = s.post("/v1/kv/lookup", &json!({"prompt": p, "cache_salt": "nobody"})).json();
    assert_eq!(other["blocks_held"], 0);
    assert_ne!(other["block_hashes"], look["block_hashes"]);

    // chat and responses reuse the rendered template's blocks too
    let msgs = json!([{"role": "user", "content": p}]);
    let c1 = s.post("/v1/chat/completions", &json!({"messages": msgs})).json();
    let c2 = s.post("/v1/chat/completions", &json!({"messages": msgs, "max_tokens": 16})).json();
    assert!(cached(&c2) > 0 && c1["choices"][0]["message"] == c2["choices"][0]["message"]);
    let r1 = s.post("/v1/responses", &json!({"input": p})).json();
    let r2 = s.post("/v1/responses", &json!({"input": [{"role": "user", "content": p}]})).json();
    assert_eq!(r1["output"][0]["content"][0]["text"], r2["output"][0]["content"][0]["text"]);
    assert!(r2["usage"]["input_tokens_details"]["cached_tokens"].as_u64().unwrap() > 0);
    assert!(!s.post("/v1/debug/none", &json!({})).json()["error"]["message"].is_null());
    assert_eq!(client::get(s.addr, "/v1/models").unwrap().json()["data"][0]["id"], "kvrelay-reference");
    assert_eq!(client::get(s.addr, "/health").unwrap().status, 200);
    let wrong_model = s.post("/v1/completions", &json!({"prompt": "x", "model": "gpt-9"}));
    assert_eq!(wrong_model.status, 404);
}

#[test]
fn streaming_matches_the_whole_answer() {
    let s = start(true, &[]);
    let p = prompt("stream", 30);
    let whole = text(&s.complete(json!({"prompt": p})));
    let r = s.post("/v1/completions", &json!({"prompt": p, "stream": true, "stream_options": {"include_usage": true}}));
    assert_eq!(r.status, 200);
    assert!(r.header("content-type").unwrap().starts_with("text/event-stream"));
    let ev = client::sse_data(&r.text());
    assert_eq!(ev.last().unwrap(), "[DONE]");
    let vals: Vec<Value> = ev[..ev.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect();
    let joined: String = vals.iter().filter_map(|v| v["choices"][0]["text"].as_str()).collect();
    assert_eq!(joined, whole);
    let usage = &vals.last().unwrap()["usage"];
    assert!(usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() > 0);
    let rs = s.post("/v1/responses", &json!({"input": p, "stream": true}));
    let ev = client::sse_data(&rs.text());
    let types: Vec<String> = ev
        .iter()
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .map(|v| v["type"].as_str().unwrap_or("").to_string())
        .collect();
    assert_eq!(types.first().unwrap(), "response.created");
    assert_eq!(types.last().unwrap(), "response.completed");
}

#[test]
fn logprobs_come_back_as_openai_shapes_them() {
    let s = start(true, &[]);
    let p = prompt("logprobs", 20);
    // the legacy completions API: tokens, token_logprobs, top_logprobs, text_offset
    let v = s.complete(json!({"prompt": p, "max_tokens": 5, "logprobs": 2}));
    let lp = &v["choices"][0]["logprobs"];
    let tokens: Vec<&str> = lp["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(tokens.len(), 5);
    assert_eq!(tokens.concat(), text(&v), "the tokens spell the text");
    let offsets: Vec<u64> = lp["text_offset"].as_array().unwrap().iter().map(|o| o.as_u64().unwrap()).collect();
    assert_eq!(offsets[0], 0);
    assert_eq!(offsets[1], tokens[0].len() as u64);
    // the reference model is certain of what it emits
    assert!(lp["token_logprobs"].as_array().unwrap().iter().all(|l| l.as_f64() == Some(0.0)), "{lp}");
    assert_eq!(lp["top_logprobs"][0][tokens[0]], 0.0, "{lp}");
    // chat: content entries with bytes and top_logprobs
    let r = s.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": p}], "max_tokens": 3, "logprobs": true, "top_logprobs": 1}),
    );
    assert_eq!(r.status, 200);
    let v = r.json();
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap().clone();
    assert_eq!(content.len(), 3);
    let said: String = content.iter().map(|c| c["token"].as_str().unwrap()).collect();
    assert_eq!(said, v["choices"][0]["message"]["content"].as_str().unwrap());
    let bytes: Vec<u8> = content[0]["bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u8).collect();
    assert_eq!(bytes, content[0]["token"].as_str().unwrap().as_bytes());
    assert_eq!(content[0]["top_logprobs"][0]["token"], content[0]["token"]);
    // not asked for: null, as before; asked for wrongly: 400
    let v = s.complete(json!({"prompt": p, "max_tokens": 2}));
    assert!(v["choices"][0]["logprobs"].is_null());
    let bad = |body: Value| s.post("/v1/chat/completions", &body).status;
    let msgs = json!([{"role": "user", "content": "hi"}]);
    assert_eq!(bad(json!({"messages": msgs, "top_logprobs": 2})), 400, "top_logprobs needs logprobs");
    assert_eq!(bad(json!({"messages": msgs, "logprobs": true, "top_logprobs": 21})), 400);
    // streamed: each chunk carries its token's logprobs
    let r = s.post("/v1/completions", &json!({"prompt": p, "max_tokens": 3, "stream": true, "logprobs": 1}));
    let ev = client::sse_data(&r.text());
    let with: Vec<Value> = ev[..ev.len() - 1]
        .iter()
        .map(|d| serde_json::from_str::<Value>(d).unwrap())
        .filter(|v| !v["choices"][0]["logprobs"].is_null())
        .collect();
    assert_eq!(with.len(), 3, "one chunk per token carries logprobs");
    assert_eq!(with[1]["choices"][0]["logprobs"]["text_offset"][0], offsets[1]);
}

#[test]
fn eviction_under_pressure_never_touches_blocks_in_use() {
    // 12 blocks of 4 tokens (16 bytes of text); prefill at 40 tokens/s keeps requests running
    let s = start(true, &["--block-tokens", "4", "--kv-blocks", "12", "--prefill-tokens-per-s", "40"]);
    let base: String = "0123456789abcdef".repeat(5); // 5 full blocks
    let long = format!("{base}{}", "ZYXWVUTSRQPONMLK".repeat(4)); // + 4 blocks
    let want_long = {
        let v = s.complete(json!({"prompt": long, "cache_salt": "cold", "max_tokens": 8}));
        text(&v)
    };
    s.complete(json!({"prompt": base, "max_tokens": 8})); // 5 blocks cached
                                                          // The long request reuses those 5 and prefills 4 more slowly: 9 blocks held for ~0.4 s.
    let addr = s.addr;
    let long2 = long.clone();
    let t = std::thread::spawn(move || {
        client::post(addr, "/v1/completions", &json!({"prompt": long2, "max_tokens": 8})).unwrap().json()
    });
    wait_until("the long request to hold its blocks", || blocks(&s, "held") >= 9.0);
    // the warm-up above evicted already: count only what the requests below evict
    let evicted_before = s.metric("kvrelay_server_kv_blocks_evicted_total");
    // Others evict what is cached and free, never the 9 held blocks.
    for i in 0..4 {
        let q = format!("q{i}-------------------------------------"); // 3 blocks
        s.complete(json!({"prompt": q, "max_tokens": 2}));
    }
    let v = t.join().unwrap();
    assert_eq!(cached(&v), 20, "the held prefix stayed usable");
    assert_eq!(text(&v), want_long, "blocks in use were not touched");
    assert!(
        s.metric("kvrelay_server_kv_blocks_evicted_total") > evicted_before,
        "the requests beside the held blocks had to evict"
    );
    // Never fits: 13 blocks.
    let r = s.post("/v1/completions", &json!({"prompt": "x".repeat(13 * 16)}));
    assert_eq!((r.status, r.json()["error"]["code"].as_str()), (400, Some("context_length_exceeded")));
    // Must wait: while 9 blocks are held, a 6-block prompt waits, then succeeds.
    let long3 = format!("{}{}", "9".repeat(16 * 5), "8".repeat(16 * 4));
    let t = std::thread::spawn(move || {
        client::post(addr, "/v1/completions", &json!({"prompt": long3, "max_tokens": 2})).unwrap()
    });
    wait_until("the second long request to hold its blocks", || blocks(&s, "held") >= 9.0);
    let waited = s.post("/v1/completions", &json!({"prompt": "7".repeat(16 * 6), "max_tokens": 2}));
    assert_eq!(waited.status, 200, "{}", waited.text());
    assert_eq!(t.join().unwrap().status, 200);
    wait_until("every block released", || blocks(&s, "held") == 0.0);
}

#[test]
fn client_disconnect_frees_blocks_and_a_full_queue_answers_429() {
    let s = start(
        true,
        &["--prefill-tokens-per-s", "200", "--max-concurrency", "1", "--max-queue", "1", "--max-body-bytes", "4096"],
    );
    let body = json!({"prompt": "z".repeat(1600), "max_tokens": 2}).to_string(); // 400 tokens: 2 s
    for stream in [false, true] {
        let body =
            body.replace("\"max_tokens\"", if stream { "\"stream\":true,\"max_tokens\"" } else { "\"max_tokens\"" });
        let conn = client::send(s.addr, "POST", "/v1/completions", Some(body.as_bytes())).unwrap();
        wait_until("the request to hold blocks", || blocks(&s, "held") > 0.0);
        drop(conn);
        wait_until("its blocks to be released after the disconnect", || blocks(&s, "held") == 0.0);
    }
    let gone = s.logs().lines().filter(|l| l.contains("status=499") && l.contains("client_gone")).count();
    assert_eq!(gone, 2, "one log line per cancelled request (whole and streamed)");
    // one running, one waiting, the third is refused with Retry-After
    let a = client::send(s.addr, "POST", "/v1/completions", Some(body.replace('z', "y").as_bytes())).unwrap();
    wait_until("the first request to run", || blocks(&s, "held") > 0.0);
    let b = client::send(s.addr, "POST", "/v1/completions", Some(body.replace('z', "x").as_bytes())).unwrap();
    wait_until("the second request to wait in the queue", || s.metric("kvrelay_server_requests_waiting") == 1.0);
    let r = s.post("/v1/completions", &json!({"prompt": "w", "max_tokens": 1}));
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(r.json()["error"]["code"], "queue_full");
    drop((a, b));
    let big = s.post("/v1/completions", &json!({"prompt": "v".repeat(5000)}));
    assert_eq!((big.status, big.json()["error"]["code"].as_str()), (413, Some("body_too_large")));
    assert_eq!(s.metric("kvrelay_server_requests_total{endpoint=\"/v1/completions\",status=\"429\"}"), 1.0);
}

#[test]
fn deeply_nested_values_anywhere_in_a_body_never_crash_the_server() {
    let s = start_env(true, &[], &[("KV_TRANSFER_SOURCE_ALLOW", "http://127.0.0.1:9")]);
    let deep = format!("{}{}", "[".repeat(200_000), "]".repeat(200_000));
    for (path, body) in [
        ("/v1/kv_transfer", format!(r#"{{"source":{deep},"prompt":"x"}}"#)),
        ("/v1/kv_transfer", format!(r#"{{"source":"http://127.0.0.1:9","messages":{deep}}}"#)),
        ("/v1/kv/lookup", format!(r#"{{"messages":{deep}}}"#)),
        ("/v1/kv/prefill", format!(r#"{{"messages":{deep}}}"#)),
        ("/v1/chat/completions", format!(r#"{{"messages":[{{"role":"user","content":{deep}}}]}}"#)),
        ("/v1/completions", format!(r#"{{"prompt":{deep}}}"#)),
        ("/v1/completions", format!(r#"{{"prompt":"x","stream_options":{deep},"max_tokens":{deep}}}"#)),
    ] {
        let r = client::request(s.addr, "POST", path, Some(body.as_bytes())).unwrap();
        assert_eq!(r.status, 400, "{path}: {}", r.text());
    }
    assert_eq!(client::get(s.addr, "/health").unwrap().status, 200, "the server is still up");
}

/// An empty environment variable means "not set", for every setting (a tool that passes its own
/// empty setting through must not stop the server from starting).
#[test]
fn empty_environment_settings_mean_not_set() {
    let s = start_env(
        true,
        &[],
        &[
            ("KVRELAY_NIXL_LIB_DIR", ""),
            ("KVRELAY_KV_TRANSPORT", ""),
            ("KVRELAY_MODEL", ""),
            ("KV_TRANSFER_DEDUP_TTL", ""),
        ],
    );
    let models = client::get(s.addr, "/v1/models").unwrap().json();
    assert_eq!(models["data"][0]["id"], "kvrelay-reference", "the default model name, not an empty one");
    assert!(s.complete(json!({"prompt": "hello", "max_tokens": 2}))["choices"][0]["text"].is_string());
}
