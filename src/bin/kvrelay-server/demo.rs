//! `kvrelay-server demo`: the whole flow on loopback, every answer checked against a cold run.
//!
//! A cold run is the same prompt with a `cache_salt` no other request uses: the salt changes the
//! block names (so nothing is reused) but not the KV, so the answer must be the same.

use std::net::SocketAddr;

use serde_json::{json, Value};

use crate::client;
use crate::ServeArgs;

struct Report {
    lines: Vec<String>,
    failed: usize,
    cold_seq: u64,
}

impl Report {
    fn check(&mut self, ok: bool, what: String) {
        self.lines.push(format!("[{}] {what}", if ok { "ok" } else { "FAILED" }));
        if !ok {
            self.failed += 1;
        }
    }
}

fn completion(addr: SocketAddr, prompt: &str, extra: Value) -> Result<(String, u64, Value), String> {
    let mut body = json!({"model": "kvrelay-reference", "prompt": prompt, "max_tokens": 12});
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            b.insert(k.clone(), v.clone());
        }
    }
    let r = client::post(addr, "/v1/completions", &body).map_err(|e| format!("request failed: {e}"))?;
    let v = r.json();
    if r.status != 200 {
        return Err(format!("status {}: {}", r.status, v["error"]["message"]));
    }
    let text = v["choices"][0]["text"].as_str().unwrap_or_default().to_string();
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(u64::MAX);
    Ok((text, cached, v))
}

fn cold(rep: &mut Report, addr: SocketAddr, prompt: &str) -> Result<String, String> {
    rep.cold_seq += 1;
    let (text, cached, _) = completion(addr, prompt, json!({"cache_salt": format!("demo-cold-{}", rep.cold_seq)}))?;
    if cached != 0 {
        return Err(format!("a cold run reused {cached} tokens"));
    }
    Ok(text)
}

fn hint_to(endpoint: &str, message_id: &str, version: &str, hashes: &[Value]) -> Value {
    json!({
        "protocol_version": version,
        "message_id": message_id,
        "actions": [{
            "action_id": "a1", "action_type": "kv.fetch", "action_version": "1.0",
            "payload": {"source_control_endpoint": endpoint, "block_hashes": hashes},
        }],
    })
}

fn hint(message_id: &str, version: &str, hashes: &[Value]) -> Value {
    hint_to("tcp://127.0.0.1:23280", message_id, version, hashes)
}

/// Instances: A (hints trusted; the source), B (hints trusted; trusts A's KV endpoint and may
/// pull from A with /v1/kv_transfer), U (trust off).
struct Addrs {
    a: SocketAddr,
    a_kv: String,
    b: SocketAddr,
    u: SocketAddr,
}

fn two_instances(x: &Addrs, rep: &mut Report) -> Result<(), String> {
    let p3 = "Cross-instance reuse: instance B answers this prompt with the KV that instance A computed. ".repeat(8);
    let cold3 = cold(rep, x.b, &p3)?;
    let (t, _, _) = completion(x.a, &p3, json!({}))?;
    rep.check(t == cold3, "prompt sent to instance A (prefilled there)".into());
    let look = client::post(x.a, "/v1/kv/lookup", &json!({"prompt": p3})).map_err(|e| e.to_string())?.json();
    let hashes = look["block_hashes"].as_array().cloned().unwrap_or_default();
    let h = hint_to(&x.a_kv, "demo-fetch", "0.1", &hashes);
    let before = client::get(x.b, "/metrics").map_err(|e| e.to_string())?.text();
    let (t, c, v) = completion(x.b, &p3, json!({"kv_hints": h}))?;
    let pt = v["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
    let after = client::get(x.b, "/metrics").map_err(|e| e.to_string())?.text();
    let fetched =
        metric(&after, "kvrelay_server_fetched_tokens_total") - metric(&before, "kvrelay_server_fetched_tokens_total");
    rep.check(
        c > 0 && fetched as u64 == c && t == cold3,
        format!("instance B with a kv.fetch hint naming A's blocks: fetched {fetched} tokens of KV from A over TCP, cached_tokens {c} of {pt}, answer equals the cold run"),
    );
    let p4 = "A router asks instance B to pull this prompt's KV from A before any request arrives. ".repeat(8);
    let cold4 = cold(rep, x.b, &p4)?;
    let r = client::post(x.b, "/v1/kv_transfer", &json!({"source": format!("http://{}", x.a), "prompt": p4}))
        .map_err(|e| e.to_string())?;
    let status = r.json()["status"].clone();
    let mut stats = Value::Null;
    for _ in 0..200 {
        stats = client::get(x.b, "/v1/kv_transfer/stats").map_err(|e| e.to_string())?.json();
        if stats["inflight"] == 0 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    rep.check(
        r.status == 202 && status == "accepted" && stats["transferred"] == 1,
        format!(
            "POST /v1/kv_transfer on B (source A, which prefilled it first): {} {status}, then {} blocks moved",
            r.status, stats["blocks_moved"]
        ),
    );
    let (t, c, _) = completion(x.b, &p4, json!({}))?;
    rep.check(
        c > 0 && t == cold4,
        format!("a plain request on B for that prompt: cached_tokens {c}, answer equals the cold run"),
    );
    Ok(())
}

fn metric(text: &str, series: &str) -> f64 {
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok()).unwrap_or(0.0)
}

fn script(a: SocketAddr, untrusted: SocketAddr, rep: &mut Report) -> Result<(), String> {
    let p1 = "You are a careful assistant. Summarize the following design note about moving KV caches \
              between inference instances, then list three risks. "
        .repeat(6);
    let p2 = "Translate the following paragraph into plain English and keep the numbers exact: ".repeat(5);
    let cold1 = cold(rep, a, &p1)?;

    let (t, c, v) = completion(a, &p1, json!({}))?;
    let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
    rep.check(
        c == 0 && t == cold1,
        format!("first request: {prompt_tokens} prompt tokens, cached_tokens {c}, answer equals the cold run"),
    );
    let (t, c, _) = completion(a, &p1, json!({}))?;
    rep.check(
        c > 0 && t == cold1,
        format!("same prompt again: cached_tokens {c} of {prompt_tokens} reused, answer equals the cold run"),
    );
    let (t, c, _) = completion(a, &p1, json!({"cache_salt": "another-tenant"}))?;
    rep.check(
        c == 0 && t == cold1,
        format!("same prompt, another cache_salt: cached_tokens {c}, answer equals the cold run"),
    );

    let lookup = client::post(a, "/v1/kv/lookup", &json!({"prompt": p1})).map_err(|e| e.to_string())?.json();
    let hashes = lookup["block_hashes"].as_array().cloned().unwrap_or_default();
    rep.check(
        !hashes.is_empty() && lookup["blocks_held"] == lookup["blocks_total"],
        format!(
            "/v1/kv/lookup: {} blocks of {} tokens named, {} held",
            lookup["blocks_total"], lookup["block_tokens"], lookup["blocks_held"]
        ),
    );

    let cold2 = cold(rep, a, &p2)?;
    let h = hint("demo-admitted", "0.1", &hashes);
    let (t, _, _) = completion(a, &p2, json!({"kv_hints": h}))?;
    rep.check(t == cold2, "hint admitted and orchestrated; it names none of this prompt's blocks, so nothing is fetched; answer equals the cold run".into());
    let cases = [
        ("unknown_version", hint("demo-v9", "9.9", &hashes)),
        ("oversized", hint("demo-big", "0.1", &(0..4000u64).map(|i| json!(u64::MAX - i)).collect::<Vec<_>>())),
        ("malformed", json!({"protocol_version": "0.1", "message_id": "demo-bad", "actions": [{"action_id": "a1"}]})),
    ];
    for (reason, h) in cases {
        let (t, _, _) = completion(a, &p2, json!({"kv_hints": h}))?;
        rep.check(t == cold2, format!("hint ignored as {reason}; the request still answers, equal to the cold run"));
    }
    let (t, _, _) = completion(untrusted, &p2, json!({"kv_hints": hint("demo-untrusted", "0.1", &hashes)}))?;
    rep.check(
        t == cold2,
        "an instance with trust off drops the hint as untrusted before parsing; answer equals the cold run".into(),
    );

    let batch = client::post(
        a,
        "/v1/completions",
        &json!({"prompt": [p1, p2], "max_tokens": 12, "kv_hints": [null, h_ok(&hashes)]}),
    )
    .map_err(|e| e.to_string())?
    .json();
    let texts: Vec<&str> =
        batch["choices"].as_array().map(|c| c.iter().filter_map(|x| x["text"].as_str()).collect()).unwrap_or_default();
    rep.check(
        texts == [cold1.as_str(), cold2.as_str()],
        format!(
            "batched completion of two prompts with an aligned hint list: cached_tokens {}",
            batch["usage"]["prompt_tokens_details"]["cached_tokens"]
        ),
    );

    let msgs = json!([{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": p1}]);
    let chat = client::post(a, "/v1/chat/completions", &json!({"messages": msgs, "max_tokens": 12}))
        .map_err(|e| e.to_string())?
        .json();
    let chat_text = chat["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_string();
    let streamed =
        client::post(a, "/v1/chat/completions", &json!({"messages": msgs, "max_tokens": 12, "stream": true}))
            .map_err(|e| e.to_string())?;
    let events = client::sse_data(&streamed.text());
    let joined: String = events
        .iter()
        .filter(|d| d.as_str() != "[DONE]")
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|v| v["choices"][0]["delta"]["content"].as_str().map(str::to_string))
        .collect();
    rep.check(
        !chat_text.is_empty() && joined == chat_text && events.last().map(String::as_str) == Some("[DONE]"),
        format!("chat completion, then the same streamed ({} events ending in [DONE]): same answer", events.len()),
    );
    let resp =
        client::post(a, "/v1/responses", &json!({"input": "Say something about KV caches.", "max_output_tokens": 8}))
            .map_err(|e| e.to_string())?
            .json();
    rep.check(resp["status"] == "completed", format!("/v1/responses: {}", resp["output"][0]["content"][0]["text"]));
    Ok(())
}

fn h_ok(hashes: &[Value]) -> Value {
    hint("demo-batch", "0.1", hashes)
}

/// Run the demo; 0 when every check passed.
pub async fn run(mut args: ServeArgs) -> i32 {
    args.listen = "127.0.0.1:0".parse().expect("loopback address");
    if args.trusted_endpoints.is_empty() {
        args.trusted_endpoints.push("tcp://127.0.0.1:23280".into());
    }
    let a = match crate::start(&args, Some(true)).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kvrelay-server demo: {e}");
            return 2;
        }
    };
    let u = match crate::start(&args, Some(false)).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kvrelay-server demo: {e}");
            return 2;
        }
    };
    let mut b_args = args.clone();
    b_args.trusted_endpoints = vec![a.kv_endpoint().to_string()];
    b_args.kv_transfer_source_allow = vec![format!("http://{}", a.addr)];
    let b = match crate::start(&b_args, Some(true)).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kvrelay-server demo: {e}");
            return 2;
        }
    };
    println!(
        "kvrelay-server demo: instance A (hints trusted, KV service {}) on {}, instance B (trusts A's KV endpoint) on {}, instance U (trust off) on {}",
        a.kv_endpoint(),
        a.addr,
        b.addr,
        u.addr
    );
    let x = Addrs { a: a.addr, a_kv: a.kv_endpoint().to_string(), b: b.addr, u: u.addr };
    let rep = tokio::task::spawn_blocking(move || {
        let mut rep = Report { lines: Vec::new(), failed: 0, cold_seq: 0 };
        if let Err(e) = script(x.a, x.u, &mut rep).and_then(|()| two_instances(&x, &mut rep)) {
            rep.check(false, format!("the demo stopped: {e}"));
        }
        rep
    })
    .await
    .expect("demo script");
    for l in &rep.lines {
        println!("{l}");
    }
    let metrics = client::get(a.addr, "/metrics").map(|r| r.text()).unwrap_or_default()
        + &client::get(b.addr, "/metrics").map(|r| r.text()).unwrap_or_default();
    println!("\nmetrics of instances A then B (excerpt):");
    for l in metrics.lines().filter(|l| !l.starts_with('#') && !l.contains("_bucket{")) {
        let keep = l.starts_with("kvrelay_kv_hints")
            || (l.starts_with("kvrelay_kv_policy") && !l.ends_with(" 0"))
            || l.starts_with("kvrelay_server_requests")
            || l.starts_with("kvrelay_server_prompt_tokens")
            || l.starts_with("kvrelay_server_cached_tokens")
            || l.starts_with("kvrelay_server_kv_blocks")
            || l.starts_with("kvrelay_server_kv_transfer")
            || l.starts_with("kvrelay_server_fetched_tokens");
        if keep {
            println!("  {l}");
        }
    }
    if rep.failed == 0 {
        println!("\nall {} checks passed", rep.lines.len());
        0
    } else {
        println!("\n{} of {} checks FAILED", rep.failed, rep.lines.len());
        1
    }
}
