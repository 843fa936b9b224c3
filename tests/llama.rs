//! The real model: `kvrelay-server --engine llama` running SmolLM2-135M-Instruct on the CPU.
//! Every reused or fetched prefix must give the cold run's greedy tokens and bit-identical
//! logits (the `x-kvrelay-logits` digest of every step), over two processes and the KV agent.
//!
//! Needs the model: `KVRELAY_MODEL_FILE` names the GGUF (the test command installs it with
//! `scripts/llama-env.sh`, which exports the variable).

mod common;

use common::{blocks, cached, client, sent, sent_since, start, start_env, text, Server};

use serde_json::{json, Value};

/// One test at a time: llama.cpp's CPU threads spin while they wait for work, so servers of
/// several tests running at once on a small machine take turns badly (2 cores: 18 s in turn,
/// 111 s at once).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn model_file() -> String {
    std::env::var("KVRELAY_MODEL_FILE").ok().filter(|f| !f.is_empty()).unwrap_or_else(|| {
        panic!(
            "KVRELAY_MODEL_FILE is not set: `source scripts/llama-env.sh` installs SmolLM2-135M-Instruct and sets it"
        )
    })
}

/// A llama instance (hint trust on, debug endpoints for the logits digest and the corruption hook).
fn llama(extra: &[&str]) -> Server {
    let m = model_file();
    let mut args = vec!["--engine", "llama", "--model-file", m.as_str(), "--debug-endpoints", "--llama-ctx", "2048"];
    args.extend_from_slice(extra);
    start(true, &args)
}

fn kv_endpoint(s: &Server) -> String {
    client::get(s.addr, "/v1/kv/info").unwrap().json()["kv_endpoint"].as_str().unwrap().to_string()
}

fn lookup(s: &Server, body: &Value) -> (Vec<u64>, u64) {
    let v = s.post("/v1/kv/lookup", body).json();
    let h = v["block_hashes"].as_array().unwrap().iter().map(|h| h.as_u64().unwrap()).collect();
    (h, v["blocks_held"].as_u64().unwrap())
}

fn fetch_hint(endpoint: &str, hashes: &[u64]) -> Value {
    json!({"protocol_version": "0.1", "message_id": "t", "actions": [{
        "action_id": "a1", "action_type": "kv.fetch", "action_version": "1.0",
        "payload": {"source_control_endpoint": endpoint, "block_hashes": hashes}}]})
}

/// One answer: the text, cached tokens, the logits digest, the whole body.
struct Answer {
    text: String,
    cached: u64,
    logits: String,
    body: Value,
}

fn ask(s: &Server, path: &str, body: Value) -> Answer {
    let r = s.post(path, &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let logits = r.header("x-kvrelay-logits").expect("a real model's logits digest").to_string();
    let v = r.json();
    let text = match path {
        "/v1/chat/completions" => v["choices"][0]["message"]["content"].as_str().unwrap().to_string(),
        _ => text(&v),
    };
    Answer { text, cached: cached(&v), logits, body: v }
}

fn failed(s: &Server, reason: &str) -> f64 {
    s.metric(&format!("kvrelay_server_kv_transfers_total{{outcome=\"failed\",reason=\"{reason}\"}}"))
}

/// A prompt of about `words` words that the model's tokenizer cuts into many tokens.
fn story(seed: &str, words: usize) -> String {
    let w = ["river", "lantern", "copper", "meadow", "harbor", "violet", "ember", "quartz", "willow", "signal"];
    let mut s = format!("{seed}: ");
    for i in 0..words {
        s.push_str(w[(i * 7 + seed.len()) % w.len()]);
        s.push(if i % 9 == 8 { '.' } else { ' ' });
    }
    s
}

const CHAT_Q: &str = "A lighthouse keeper on a small rocky island writes a checklist for the evening shift. \
Name three things the keeper should check every evening before the light is lit, and explain in one sentence \
each why it matters for the ships passing the island at night.";

fn chat_body(salt: Option<&str>) -> Value {
    let mut b = json!({"messages": [{"role": "user", "content": CHAT_Q}], "max_tokens": 24});
    if let Some(s) = salt {
        b["cache_salt"] = json!(s);
    }
    b
}

#[test]
fn local_reuse_chat_and_batched_completions_answer_as_cold_runs() {
    let _serial = serial();
    let s = llama(&[]);
    let models = client::get(s.addr, "/v1/models").unwrap().json();
    let name = models["data"][0]["id"].as_str().unwrap().to_string();
    assert!(!name.is_empty() && name != "kvrelay-reference", "{name}");
    // a chat prompt through the GGUF's template: cold, then reused
    let cold = ask(&s, "/v1/chat/completions", chat_body(Some("cold-chat")));
    assert_eq!(cold.cached, 0);
    assert!(!cold.text.is_empty());
    let first = ask(&s, "/v1/chat/completions", chat_body(None));
    assert_eq!((first.cached, &first.text, &first.logits), (0, &cold.text, &cold.logits));
    let again = ask(&s, "/v1/chat/completions", chat_body(None));
    let prompt_tokens = again.body["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens >= 32, "{prompt_tokens}");
    assert_eq!(again.cached, (prompt_tokens - 1) / 32 * 32, "every full block but the last token's is reused");
    assert_eq!((&again.text, &again.logits), (&cold.text, &cold.logits), "reused KV answers as a cold run");
    assert_eq!(again.body["usage"]["completion_tokens"], cold.body["usage"]["completion_tokens"]);
    // completions: a repeated prompt, then a batch whose prompts share a prefix
    let p = story("keeper", 90);
    let c = ask(&s, "/v1/completions", json!({"prompt": p, "max_tokens": 16, "cache_salt": "cold-p"}));
    let r1 = ask(&s, "/v1/completions", json!({"prompt": p, "max_tokens": 16}));
    let r2 = ask(&s, "/v1/completions", json!({"prompt": p, "max_tokens": 16}));
    assert_eq!((r1.cached, &r1.text), (0, &c.text));
    assert!(r2.cached > 0);
    assert_eq!((&r2.text, &r2.logits), (&c.text, &c.logits));
    let q = p.clone() + " and then the storm came over the harbor wall";
    let cq = ask(&s, "/v1/completions", json!({"prompt": q, "max_tokens": 16, "cache_salt": "cold-q"}));
    let batch = s.post("/v1/completions", &json!({"prompt": [p, q], "max_tokens": 16}));
    assert_eq!(batch.status, 200, "{}", batch.text());
    let digests: Vec<String> = batch.header("x-kvrelay-logits").unwrap().split(',').map(String::from).collect();
    let v = batch.json();
    assert_eq!(v["choices"][0]["text"].as_str().unwrap(), c.text);
    assert_eq!(v["choices"][1]["text"].as_str().unwrap(), cq.text);
    assert_eq!(digests, vec![c.logits.clone(), cq.logits.clone()]);
    assert!(cached(&v) > 0, "the batch reused the shared prefix");
    // a token-id prompt outside the vocabulary is refused, not run
    let bad = s.post("/v1/completions", &json!({"prompt": [1, 2, 99_999_999u64]}));
    assert_eq!(bad.status, 400, "{}", bad.text());
    // the prompt and max_tokens beyond the context: a 400 that says so
    let long = s.post("/v1/completions", &json!({"prompt": story("long", 3000), "max_tokens": 8}));
    assert_eq!(long.status, 400, "{}", long.text());
    assert!(long.text().contains("context"), "{}", long.text());
    assert_eq!(blocks(&s, "held"), 0.0, "nothing held after the requests");
}

#[test]
fn corrupted_kv_changes_the_answer_and_a_block_out_of_its_prefix_is_never_used() {
    let _serial = serial();
    let s = llama(&[]);
    let p = story("prefix", 120);
    let cold = ask(&s, "/v1/completions", json!({"prompt": p, "max_tokens": 12, "cache_salt": "c"}));
    ask(&s, "/v1/completions", json!({"prompt": p, "max_tokens": 12}));
    let (names, held) = lookup(&s, &json!({"prompt": p}));
    assert!(held as usize == names.len() && names.len() >= 3, "{held} of {}", names.len());
    // the same blocks after a different first block: their names differ, nothing is reused
    let other = story("zzzzzz", 1) + &p;
    let (other_names, other_held) = lookup(&s, &json!({"prompt": other}));
    assert_eq!(other_held, 0);
    assert!(other_names.iter().all(|n| !names.contains(n)));
    let o = ask(&s, "/v1/completions", json!({"prompt": other, "max_tokens": 12}));
    let oc = ask(&s, "/v1/completions", json!({"prompt": other, "max_tokens": 12, "cache_salt": "oc"}));
    assert_eq!((o.cached, &o.logits), (0, &oc.logits));
    // one flipped byte in a held block's V changes the logits: the equality above can fail
    let r = s.post("/debug/kv/corrupt", &json!({"block_hash": names[1]}));
    assert_eq!(r.json()["corrupted"], true);
    let bad = ask(&s, "/v1/completions", json!({"prompt": p, "max_tokens": 12}));
    assert!(bad.cached > 0);
    assert_ne!(bad.logits, cold.logits, "corrupted KV must change the logits");
}

#[test]
fn a_fetched_prefix_over_the_agent_answers_as_a_cold_run() {
    let _serial = serial();
    let a = llama(&[]);
    let ep = kv_endpoint(&a);
    let b = llama(&["--trusted-endpoint", &ep]);
    let bt = 32;
    // A answers; B fetches the prefix by a hint built from A's lookup
    let first = ask(&a, "/v1/chat/completions", chat_body(None));
    let cold_b = ask(&b, "/v1/chat/completions", chat_body(Some("cold-b")));
    assert_eq!((&cold_b.text, &cold_b.logits), (&first.text, &first.logits), "two processes, one answer");
    let (hashes, held) = lookup(&a, &chat_body(None));
    assert_eq!(held as usize, hashes.len());
    let mut body = chat_body(None);
    body["kv_hints"] = fetch_hint(&ep, &hashes);
    let fetched = ask(&b, "/v1/chat/completions", body);
    assert_eq!((&fetched.text, &fetched.logits), (&first.text, &first.logits), "a fetched prefix answers as cold");
    // and the first tokens' log-probabilities, as OpenAI's API returns them, are a cold run's
    let with_logprobs = |s: &Server, salt: Option<&str>, hint: bool| {
        let mut body = chat_body(salt);
        body["logprobs"] = json!(true);
        body["top_logprobs"] = json!(5);
        if hint {
            body["kv_hints"] = fetch_hint(&ep, &hashes);
        }
        ask(s, "/v1/chat/completions", body).body["choices"][0]["logprobs"]["content"].clone()
    };
    let cold_lp = with_logprobs(&b, Some("cold-b-logprobs"), false);
    let fetched_lp = with_logprobs(&b, None, true);
    let entries = cold_lp.as_array().expect("logprobs content");
    assert!(!entries.is_empty());
    for e in entries {
        let lp = e["logprob"].as_f64().unwrap();
        assert!(lp <= 0.0, "{e}");
        // greedy decoding: the emitted token is the most likely one
        assert_eq!(e["top_logprobs"][0]["logprob"].as_f64(), Some(lp), "{e}");
        assert_eq!(e["top_logprobs"].as_array().unwrap().len(), 5);
    }
    assert_eq!(fetched_lp, cold_lp, "a fetched prefix gives a cold run's log-probabilities");
    let prompt_tokens = fetched.body["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(fetched.cached, (prompt_tokens - 1) / bt * bt);
    assert_eq!(sent_since(&a, 0.0, hashes.len() as f64), hashes.len() as f64, "every block on the wire once");
    assert_eq!(b.metric("kvrelay_server_fetched_tokens_total"), (hashes.len() as u64 * bt) as f64);

    // a partial prefix: B already holds the first blocks and fetches only the rest
    let long = story("partial", 160);
    let head: String = long.chars().take(long.len() / 3).collect();
    ask(&b, "/v1/completions", json!({"prompt": head, "max_tokens": 1}));
    let want = ask(&a, "/v1/completions", json!({"prompt": long, "max_tokens": 16}));
    let (hashes, _) = lookup(&a, &json!({"prompt": long}));
    let (_, b_held) = lookup(&b, &json!({"prompt": long}));
    assert!(b_held > 0 && (b_held as usize) < hashes.len(), "{b_held} of {}", hashes.len());
    let before = sent(&a);
    let got =
        ask(&b, "/v1/completions", json!({"prompt": long, "max_tokens": 16, "kv_hints": fetch_hint(&ep, &hashes)}));
    assert_eq!((&got.text, &got.logits), (&want.text, &want.logits));
    let missing = (hashes.len() - b_held as usize) as f64;
    assert_eq!(sent_since(&a, before, missing), missing, "only the missing run moved");

    // memory gone bad under a committed block at the source: caught, the answer is a cold run's
    let p = story("corrupt", 100);
    let want = ask(&b, "/v1/completions", json!({"prompt": p, "max_tokens": 12, "cache_salt": "cold-c"}));
    ask(&a, "/v1/completions", json!({"prompt": p, "max_tokens": 1}));
    let (hashes, _) = lookup(&a, &json!({"prompt": p}));
    assert_eq!(a.post("/debug/kv/corrupt", &json!({"block_hash": hashes[0]})).json()["corrupted"], true);
    let got = ask(&b, "/v1/completions", json!({"prompt": p, "max_tokens": 12, "kv_hints": fetch_hint(&ep, &hashes)}));
    assert_eq!(failed(&b, "corrupt"), 1.0, "{}", b.metrics());
    assert_eq!((got.cached, &got.text, &got.logits), (0, &want.text, &want.logits));
    assert_eq!(blocks(&b, "held"), 0.0);
}

#[test]
fn instances_of_another_engine_or_other_settings_refuse_each_others_kv() {
    let _serial = serial();
    let a = llama(&[]);
    let ep = kv_endpoint(&a);
    let p = story("fingerprint", 80);
    ask(&a, "/v1/completions", json!({"prompt": p, "max_tokens": 1}));
    // the reference engine: its own names for the prompt, sent to the llama source, are refused
    // by the fingerprint before any block moves
    let r = start_env(true, &["--trusted-endpoint", &ep], &[]);
    let (r_hashes, _) = lookup(&r, &json!({"prompt": p}));
    let (hashes, _) = lookup(&a, &json!({"prompt": p}));
    assert!(r_hashes.iter().all(|h| !hashes.contains(h)), "each model names blocks with its own seed");
    let v = r.complete(json!({"prompt": p, "kv_hints": fetch_hint(&ep, &r_hashes)}));
    assert_eq!(cached(&v), 0);
    assert_eq!(failed(&r, "fingerprint_mismatch"), 1.0, "{}", r.metrics());
    // a llama instance with another thread count: the same names would not mean the same KV
    // (the default is the cores divided among the server's 2 contexts, at least one: one more
    // than that is always another count)
    let default = (std::thread::available_parallelism().map_or(1, |n| n.get()) / 2).max(1);
    let threads = (default + 1).to_string();
    let threads = threads.as_str();
    let other = llama(&["--trusted-endpoint", &ep, "--llama-threads", threads]);
    let (other_hashes, _) = lookup(&other, &json!({"prompt": p}));
    assert_ne!(other_hashes, hashes, "the identity seeds the names");
    let want = ask(&other, "/v1/completions", json!({"prompt": p, "max_tokens": 4, "cache_salt": "cold"}));
    let got = ask(
        &other,
        "/v1/completions",
        json!({"prompt": p, "max_tokens": 4, "kv_hints": fetch_hint(&ep, &other_hashes)}),
    );
    assert_eq!((got.cached, &got.text), (0, &want.text));
    assert_eq!(failed(&other, "fingerprint_mismatch"), 1.0, "{}", other.metrics());
    let info = |s: &Server| client::get(s.addr, "/v1/kv/info").unwrap().json()["fingerprint"].clone();
    assert_ne!(info(&a), info(&other));
    assert_ne!(info(&a), info(&r));
    assert_eq!(sent(&a), 0.0, "no block left the source");
}

#[test]
fn one_context_queues_refuses_beyond_the_queue_and_a_client_gone_frees_it() {
    let _serial = serial();
    let s = llama(&["--llama-contexts", "1", "--max-queue", "1", "--max-concurrency", "8"]);
    // about 1,000 tokens: seconds of prefill on a small machine
    let long = |tag: &str| json!({"prompt": story(tag, 700), "max_tokens": 4}).to_string();
    let a = client::send(s.addr, "POST", "/v1/completions", Some(long("first").as_bytes())).unwrap();
    common::wait_until("the first request to run", || blocks(&s, "held") > 0.0);
    let b = client::send(s.addr, "POST", "/v1/completions", Some(long("second").as_bytes())).unwrap();
    common::wait_until("the second to wait: the running slots are the contexts", || {
        s.metric("kvrelay_server_requests_waiting") == 1.0
    });
    let r = s.post("/v1/completions", &json!({"prompt": "a third", "max_tokens": 1}));
    assert_eq!(r.status, 429, "{}", r.text());
    // both clients go away: their runs stop, their blocks and the context come back
    drop((a, b));
    common::wait_until("every block released after the disconnects", || blocks(&s, "held") == 0.0);
    let ok = ask(&s, "/v1/completions", json!({"prompt": story("after", 30), "max_tokens": 4}));
    let cold = ask(&s, "/v1/completions", json!({"prompt": story("after", 30), "max_tokens": 4, "cache_salt": "x"}));
    assert_eq!(
        (&ok.text, &ok.logits),
        (&cold.text, &cold.logits),
        "the context a cancelled run left answers as a fresh one"
    );
    let gone = s.logs().lines().filter(|l| l.contains("status=499") && l.contains("client_gone")).count();
    assert_eq!(gone, 2, "{}", s.logs());
}

#[test]
fn streaming_sends_each_token_as_it_is_decoded_and_the_same_text_as_a_whole_answer() {
    use std::io::{BufRead, BufReader};
    let _serial = serial();
    let s = llama(&[]);
    let body = |stream: bool| json!({"prompt": story("stream", 40), "max_tokens": 64, "stream": stream, "return_token_ids": true});
    let whole = ask(&s, "/v1/completions", body(false));
    let generated = s.metric("kvrelay_server_generated_tokens_total");
    let c = client::send(s.addr, "POST", "/v1/completions", Some(body(true).to_string().as_bytes())).unwrap();
    let mut lines = BufReader::new(c).lines();
    let mut data = Vec::new();
    let mut at_first = None;
    for line in lines.by_ref() {
        let line = line.expect("the stream goes on");
        let Some(d) = line.strip_prefix("data: ") else { continue };
        if d == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(d).unwrap();
        if at_first.is_none() && !v["choices"][0]["text"].as_str().unwrap_or("").is_empty() {
            // the first token arrived: the run (64 tokens, counted when it ends) is still going
            at_first = Some(s.metric("kvrelay_server_generated_tokens_total"));
        }
        data.push(v);
    }
    assert_eq!(at_first, Some(generated), "the first token came before the run ended");
    let text: String = data.iter().filter_map(|v| v["choices"][0]["text"].as_str()).collect();
    assert_eq!(text, whole.text, "streamed pieces make the whole answer");
    let ids: Vec<Value> = data.iter().flat_map(|v| v["choices"][0]["token_ids"].as_array().unwrap().clone()).collect();
    assert_eq!(&Value::from(ids), &whole.body["choices"][0]["token_ids"], "each chunk carries its token id");
    let tokens = whole.body["usage"]["completion_tokens"].as_u64().unwrap() as usize;
    assert!(data.len() > tokens / 2, "{} chunks for {tokens} tokens: token by token", data.len());
    let last = data.last().unwrap();
    assert!(last["choices"][0]["finish_reason"].is_string(), "{last}");
}
