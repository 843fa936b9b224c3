//! `kvrelay-server demo`: the whole flow on loopback, every answer checked against a cold run.
//!
//! A cold run is the same prompt with a `cache_salt` no other request uses: the salt changes the
//! block names (so nothing is reused) but not the KV, so the answer must be the same.
//!
//! With `--engine llama` the demo runs a real model's story instead of the hint cases: a chat
//! answer, the same from reused KV, from KV fetched from a second instance, and from a partial
//! fetch, each time to first token (the server's `x-kvrelay-ttft-ms`) beside a cold prefill's;
//! then the cross-instance steps of the reference demo.

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
    let mut body = json!({"prompt": prompt, "max_tokens": 12});
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
    // wait for the job to end (the source prefills first: seconds of a real model, longer on a
    // busy machine); the bound only keeps a broken server from hanging the demo
    let mut stats = Value::Null;
    let end = std::time::Instant::now() + std::time::Duration::from_secs(300);
    while std::time::Instant::now() < end {
        stats = client::get(x.b, "/v1/kv_transfer/stats").map_err(|e| e.to_string())?.json();
        if stats["inflight"] == 0 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
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

/// A chat answer: text, cached tokens, prompt tokens, the server's time to first token (ms).
struct Chat {
    text: String,
    cached: u64,
    prompt_tokens: u64,
    ttft_ms: f64,
}

fn chat(addr: SocketAddr, messages: &Value, extra: Value) -> Result<Chat, String> {
    let mut body = json!({"messages": messages, "max_tokens": 48});
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            b.insert(k.clone(), v.clone());
        }
    }
    let r = client::post(addr, "/v1/chat/completions", &body).map_err(|e| format!("request failed: {e}"))?;
    let ttft_ms = r.header("x-kvrelay-ttft-ms").and_then(|t| t.parse().ok()).unwrap_or(f64::NAN);
    let v = r.json();
    if r.status != 200 {
        return Err(format!("status {}: {}", r.status, v["error"]["message"]));
    }
    Ok(Chat {
        text: v["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_string(),
        cached: v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(u64::MAX),
        prompt_tokens: v["usage"]["prompt_tokens"].as_u64().unwrap_or(0),
        ttft_ms,
    })
}

/// The notes the real-model demo's questions are about (the prompt is long enough that its
/// prefill is most of the time to first token).
const NOTES: &str = "Station log, North Reef light. The station stands on a rock two miles off the \
coast. Its lamp burns every night from sunset to sunrise and can be seen from eighteen miles away in \
clear weather. The keeper climbs one hundred and twelve steps to the lantern room. Each evening the \
keeper cleans the lens with a soft cloth, trims the wick, fills the oil reservoir and winds the clockwork \
that turns the lens once every thirty seconds. In fog the keeper also sounds the horn twice every minute. \
The supply boat comes every second Tuesday with oil, food, water and letters; when the sea is too rough \
the boat waits in the harbor and the keeper rations what is left. The log records the weather at dawn, \
noon and dusk, every ship that passes close to the reef, and any fault in the lamp or the clockwork. \
Last winter a storm broke two panes of the lantern room, and the keeper kept the lamp burning behind a \
screen of sailcloth until the glazier arrived nine days later.";

/// The real model's story: A answers a chat question, the same question again is answered from
/// reused KV, B fetches A's prefix by a hint built from A's lookup and answers the same, and a
/// partial prefix (B holds the first blocks) fetches only the rest; each time to first token is
/// printed beside the cold prefill's.
fn real_model(x: &Addrs, rep: &mut Report) -> Result<(), String> {
    let ask = |q: &str| json!([{"role": "system", "content": NOTES}, {"role": "user", "content": q}]);
    let q1 = ask("What does the keeper do every evening before the lamp is lit? Answer in two sentences.");
    let cold = chat(x.a, &q1, json!({"cache_salt": "demo-cold-real"}))?;
    rep.check(
        cold.cached == 0 && !cold.text.is_empty(),
        format!("instance A, cold prefill of {} prompt tokens: {:?}", cold.prompt_tokens, cold.text),
    );
    let first = chat(x.a, &q1, json!({}))?;
    let again = chat(x.a, &q1, json!({}))?;
    rep.check(
        first.text == cold.text && again.cached > 0 && again.text == cold.text,
        format!(
            "the same question again on A: cached_tokens {} of {}, the same answer",
            again.cached, again.prompt_tokens
        ),
    );
    let look = client::post(x.a, "/v1/kv/lookup", &json!({"messages": q1})).map_err(|e| e.to_string())?.json();
    let hashes = look["block_hashes"].as_array().cloned().unwrap_or_default();
    let b_cold = chat(x.b, &q1, json!({"cache_salt": "demo-cold-real-b"}))?;
    let before = client::get(x.b, "/metrics").map_err(|e| e.to_string())?.text();
    let fetched = chat(x.b, &q1, json!({"kv_hints": hint_to(&x.a_kv, "demo-real-fetch", "0.1", &hashes)}))?;
    let after = client::get(x.b, "/metrics").map_err(|e| e.to_string())?.text();
    let moved =
        metric(&after, "kvrelay_server_fetched_tokens_total") - metric(&before, "kvrelay_server_fetched_tokens_total");
    rep.check(
        fetched.cached > 0 && moved > 0.0 && fetched.text == cold.text && b_cold.text == cold.text,
        format!(
            "instance B with a kv.fetch hint from A's /v1/kv/lookup: {moved} tokens of KV fetched over TCP, cached_tokens {} of {}, the same answer",
            fetched.cached, fetched.prompt_tokens
        ),
    );
    // a partial prefix: B holds the notes and the first question; a longer conversation that
    // starts the same way fetches only the blocks B lacks
    let q2 = json!([
        {"role": "system", "content": NOTES},
        {"role": "user", "content": "What does the keeper do every evening before the lamp is lit? Answer in two sentences."},
        {"role": "assistant", "content": cold.text},
        {"role": "user", "content": "And what happened last winter, and how long did the repair take?"},
    ]);
    let cold2 = chat(x.b, &q2, json!({"cache_salt": "demo-cold-real-2"}))?;
    chat(x.a, &q2, json!({"max_tokens": 1}))?;
    let look2 = client::post(x.a, "/v1/kv/lookup", &json!({"messages": q2})).map_err(|e| e.to_string())?.json();
    let hashes2 = look2["block_hashes"].as_array().cloned().unwrap_or_default();
    let held_b = client::post(x.b, "/v1/kv/lookup", &json!({"messages": q2})).map_err(|e| e.to_string())?.json()
        ["blocks_held"]
        .as_u64()
        .unwrap_or(0);
    let before = client::get(x.b, "/metrics").map_err(|e| e.to_string())?.text();
    let partial = chat(x.b, &q2, json!({"kv_hints": hint_to(&x.a_kv, "demo-real-partial", "0.1", &hashes2)}))?;
    let after = client::get(x.b, "/metrics").map_err(|e| e.to_string())?.text();
    let moved2 =
        metric(&after, "kvrelay_server_fetched_tokens_total") - metric(&before, "kvrelay_server_fetched_tokens_total");
    let bt = look2["block_tokens"].as_u64().unwrap_or(32);
    rep.check(
        partial.text == cold2.text && held_b > 0 && moved2 as u64 == (hashes2.len() as u64 - held_b) * bt,
        format!(
            "a longer conversation on B, which held {held_b} of its {} blocks: fetched only the other {} blocks ({moved2} tokens), cached_tokens {} of {}, the same answer as its cold run",
            hashes2.len(),
            hashes2.len() as u64 - held_b,
            partial.cached,
            partial.prompt_tokens
        ),
    );
    rep.lines.push(format!(
        "     time to first token ({} prompt tokens): cold prefill {:.1} ms | local reuse {:.1} ms | fetched from A {:.1} ms",
        cold.prompt_tokens, cold.ttft_ms, again.ttft_ms, fetched.ttft_ms
    ));
    rep.lines.push(format!(
        "     time to first token ({} prompt tokens): cold prefill {:.1} ms | partial fetch {:.1} ms",
        cold2.prompt_tokens, cold2.ttft_ms, partial.ttft_ms
    ));
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
    let real = args.engine != "reference";
    if real {
        println!("engine: {} ({})", args.engine, a.state.config.model);
    }
    let rep = tokio::task::spawn_blocking(move || {
        let mut rep = Report { lines: Vec::new(), failed: 0, cold_seq: 0 };
        let run = if real { real_model(&x, &mut rep) } else { script(x.a, x.u, &mut rep) };
        if let Err(e) = run.and_then(|()| two_instances(&x, &mut rep)) {
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
