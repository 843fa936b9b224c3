//! The generation path the three endpoints share: admission and orchestration before the
//! request is queued, the running slot and the waiting queue, the named fetch, the engine, and
//! the OpenAI-shaped answers, whole or streamed as server-sent events.

use super::*;
use crate::engine::TokenLogprob;

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Api {
    Completions,
    Chat,
    Responses,
}

impl Api {
    /// Prefix of response ids.
    pub(super) fn id_prefix(self) -> &'static str {
        match self {
            Api::Completions => "cmpl-",
            Api::Chat => "chatcmpl-",
            Api::Responses => "resp_",
        }
    }

    fn endpoint(self) -> &'static str {
        match self {
            Api::Completions => "/v1/completions",
            Api::Chat => "/v1/chat/completions",
            Api::Responses => "/v1/responses",
        }
    }
}

pub(super) struct Job {
    pub(super) api: Api,
    pub(super) id: String,
    pub(super) prompts: Vec<Vec<u32>>,
    pub(super) salt: Option<String>,
    pub(super) max_tokens: usize,
    pub(super) include_usage: bool,
    /// `return_token_ids`: completion choices carry their output token ids.
    pub(super) token_ids: bool,
    /// `logprobs` asked for: this many alternatives per token.
    pub(super) logprobs: Option<usize>,
    /// The admitted snapshots travel with the request until it ends.
    pub(super) _hints: Vec<HintOutcome>,
    /// Per prompt: the named fetch the provider took, if any.
    pub(super) plans: Vec<Option<FetchPlan>>,
    pub(super) hint_label: String,
    pub(super) decision_label: String,
}

/// A waiting-queue place, then a running slot; both given back on drop.
pub(super) struct Slot {
    pub(super) _permit: OwnedSemaphorePermit,
}

pub(super) struct Waiting<'a>(&'a AtomicUsize);
impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

pub(super) async fn take_slot(st: &AppState) -> Result<Slot, ApiError> {
    if let Ok(p) = st.slots.clone().try_acquire_owned() {
        return Ok(Slot { _permit: p });
    }
    if st.waiting.fetch_add(1, Ordering::AcqRel) >= st.config.max_queue {
        st.waiting.fetch_sub(1, Ordering::AcqRel);
        return Err(ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            kind: "server_overloaded",
            code: Some("queue_full"),
            message: format!(
                "the server is at its limit ({} running, {} waiting); retry later",
                st.config.max_concurrency, st.config.max_queue
            ),
        });
    }
    let _w = Waiting(&st.waiting);
    let p = st.slots.clone().acquire_owned().await.expect("the semaphore is never closed");
    Ok(Slot { _permit: p })
}

pub(super) type Admitted = (Vec<HintOutcome>, Vec<Option<FetchPlan>>, String, String);

/// Admit the hint (once, or per prompt for an aligned list), freeze it, and run every prompt
/// through eligibility, candidates and orchestration. Before the request is queued.
pub(super) fn admit_and_decide(
    st: &AppState,
    raw: Option<&[u8]>,
    prompts: usize,
    batched: bool,
) -> Result<Admitted, ApiError> {
    let t0 = Instant::now();
    let hints = if batched {
        st.admission.admit_batch(raw, prompts).map_err(|_| {
            ApiError::bad_request(format!("kv_hints is a list whose length differs from the {prompts} prompts"))
                .with_code("kv_hints_length_mismatch")
        })?
    } else {
        vec![st.admission.admit(raw)]
    };
    let mut decisions = Vec::with_capacity(hints.len());
    let mut plans = Vec::with_capacity(hints.len());
    for h in &hints {
        let slot = PlanSlot::default();
        let d = st.orchestrator.decide_in(false, h.snapshot(), &slot);
        let plan = slot.into_inner().unwrap_or_else(|e| e.into_inner());
        decisions.push(match d {
            Decision::NamedFetch { .. } => "named_fetch",
            Decision::Keep(r) => r,
        });
        plans.push(plan);
    }
    st.metrics.hint_seconds.inc_by(t0.elapsed().as_secs_f64());
    let hint_label = hints.iter().map(HintOutcome::label).collect::<Vec<_>>().join(",");
    Ok((hints, plans, hint_label, decisions.join(",")))
}

/// The API error of an engine failure.
pub fn engine_error(e: EngineError) -> ApiError {
    match e {
        EngineError::NeverFits(_) => ApiError::bad_request(e.to_string()).with_code("context_length_exceeded"),
        EngineError::EmptyPrompt => ApiError::bad_request(e.to_string()).with_code("missing_prompt"),
        EngineError::ContextLength { .. } => ApiError::bad_request(e.to_string()).with_code("context_length_exceeded"),
        EngineError::Copy(_) | EngineError::Model(_) => ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "server_error",
            code: None,
            message: e.to_string(),
        },
    }
}

/// Run one prompt: the named fetch first when the provider took one (a failure prefills
/// locally, or fails the request under `--kv-load-failure-policy fail`), then the engine.
pub(super) async fn run_prompt(
    st: &AppState,
    prompt: &[u32],
    salt: Option<&str>,
    max_tokens: usize,
    plan: Option<&FetchPlan>,
    fetch_log: &mut String,
    on_token: Option<crate::engine::TokenSink>,
) -> Result<Generation, ApiError> {
    let started = Instant::now();
    let names = st.engine.block_names(prompt, salt);
    // what a fetch committed stays pinned until the engine's own lease references it
    let mut _hold = crate::transfer::PrefixHold::default();
    if let Some(plan) = plan {
        let t = &st.transfer;
        let mut f = fetch_into_cache(&st.engine, &t.agent, &plan.endpoint, prompt, &names, &plan.hashes, false).await;
        let label = st.record_fetch(&f);
        _hold = std::mem::take(&mut f.hold);
        if !fetch_log.is_empty() {
            fetch_log.push(',');
        }
        fetch_log.push_str(&label);
        if let Some(e) = f.error.filter(|_| t.fail_on_load_error) {
            return Err(ApiError {
                status: StatusCode::BAD_GATEWAY,
                kind: "server_error",
                code: Some("kv_load_failed"),
                message: format!("fetching the hinted KV failed ({}) and --kv-load-failure-policy is fail", e.reason),
            });
        }
    }
    let before_engine = started.elapsed();
    let mut g = st.engine.generate_streaming(prompt, &names, max_tokens, on_token).await.map_err(engine_error)?;
    g.ttft += before_engine;
    st.metrics.prompt_tokens.inc_by(g.prompt_tokens as u64);
    st.metrics.cached_tokens.inc_by(g.cached_tokens as u64);
    st.metrics.prefilled_tokens.inc_by(g.prefilled_tokens as u64);
    st.metrics.generated_tokens.inc_by(g.tokens.len() as u64);
    Ok(g)
}

/// The `logprobs` of a choice or a chunk as OpenAI's API shapes them, for the output tokens
/// `toks` (with their log-probabilities `lps`) whose text starts at byte `offset` of the
/// choice's text; `first`: `toks[0]` is the generation's first token. `k` alternatives each.
/// Chat: `{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}],
/// refusal: null}`; completions: `{tokens, token_logprobs, top_logprobs, text_offset}`.
pub(super) fn logprobs_json(
    e: &Engine,
    api: Api,
    toks: &[u32],
    lps: &[TokenLogprob],
    k: usize,
    first: bool,
    mut offset: usize,
) -> Value {
    let text = |t: u32, i: usize| {
        let b = e.token_bytes(t, first && i == 0);
        (String::from_utf8_lossy(&b).into_owned(), b)
    };
    match api {
        Api::Chat => json!({
            "content": toks.iter().zip(lps).enumerate().map(|(i, (&t, lp))| {
                let (s, b) = text(t, i);
                let top: Vec<Value> = lp.top.iter().take(k).map(|&(a, l)| {
                    let (s, b) = text(a, i);
                    json!({"token": s, "logprob": l, "bytes": b})
                }).collect();
                json!({"token": s, "logprob": lp.logprob, "bytes": b, "top_logprobs": top})
            }).collect::<Vec<_>>(),
            "refusal": null,
        }),
        _ => {
            let (mut tokens, mut offsets) = (Vec::new(), Vec::new());
            for (i, &t) in toks.iter().enumerate() {
                let (s, b) = text(t, i);
                offsets.push(offset);
                offset += b.len();
                tokens.push(s);
            }
            let top: Vec<Value> = toks
                .iter()
                .zip(lps)
                .enumerate()
                .map(|(i, (_, lp))| {
                    let m: serde_json::Map<String, Value> =
                        lp.top.iter().take(k).map(|&(a, l)| (text(a, i).0, json!(l))).collect();
                    Value::Object(m)
                })
                .collect();
            json!({
                "tokens": tokens,
                "token_logprobs": lps.iter().map(|lp| lp.logprob).collect::<Vec<_>>(),
                "top_logprobs": if k == 0 { Value::Null } else { json!(top) },
                "text_offset": offsets,
            })
        }
    }
}

pub(super) fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

pub(super) fn usage(api: Api, prompt: usize, cached: usize, completion: usize) -> Value {
    let mut u = json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    });
    if api == Api::Responses {
        u["input_tokens"] = json!(prompt);
        u["output_tokens"] = json!(completion);
        u["input_tokens_details"] = json!({"cached_tokens": cached});
        u["output_tokens_details"] = json!({"reasoning_tokens": 0});
    }
    u
}

pub(super) fn response_object(st: &AppState, job: &Job, text: &str, u: Value, status: &str) -> Value {
    json!({
        "id": job.id,
        "object": "response",
        "created_at": now_secs(),
        "model": st.config.model,
        "status": status,
        "output": if text.is_empty() && status != "completed" { json!([]) } else { json!([{
            "type": "message",
            "id": format!("msg_{}", &job.id[5..]),
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }]) },
        "usage": u,
    })
}

/// Logs the request's line when its future is dropped before it answered (the client went away
/// while it waited or ran; its blocks are released by the same drop).
struct LogIfCancelled<'a> {
    job: &'a Job,
    answered: bool,
}

impl Drop for LogIfCancelled<'_> {
    fn drop(&mut self) {
        if !self.answered {
            let facts = facts_of(self.job, &[], "");
            log_request(
                &Facts { decision: facts.decision.clone() + ",client_gone", ..facts },
                self.job.api.endpoint(),
                499,
            );
        }
    }
}

pub(super) async fn run_job(st: Shared, job: Job, stream: bool) -> Response {
    let mut cancelled = LogIfCancelled { job: &job, answered: stream };
    let slot = match take_slot(&st).await {
        Ok(s) => s,
        Err(e) => {
            cancelled.answered = true;
            return e.into_response();
        }
    };
    if stream {
        drop(cancelled);
        return stream_job(st, job, slot);
    }
    let started = Instant::now();
    let mut gens = Vec::with_capacity(job.prompts.len());
    let mut fetch_log = String::new();
    for (p, plan) in job.prompts.iter().zip(&job.plans) {
        match run_prompt(&st, p, job.salt.as_deref(), job.max_tokens, plan.as_ref(), &mut fetch_log, None).await {
            Ok(g) => gens.push(g),
            Err(e) => {
                cancelled.answered = true;
                return with_facts(e.into_response(), &job, &gens, &fetch_log);
            }
        }
        if gens.len() == 1 {
            observe(&st.metrics.ttft, job.api, started.elapsed().as_secs_f64());
        }
    }
    drop(slot);
    let (pt, ct, gt) = totals(&gens);
    let u = usage(job.api, pt, ct, gt);
    let body = match job.api {
        Api::Completions => json!({
            "id": job.id, "object": "text_completion", "created": now_secs(), "model": st.config.model,
            "choices": gens.iter().enumerate().map(|(i, g)| {
                let lp = job.logprobs.map_or(Value::Null, |k| logprobs_json(&st.engine, job.api, &g.tokens, &g.logprobs, k, true, 0));
                let mut c = json!({
                    "index": i, "text": st.engine.detokenize(&g.tokens).concat(), "logprobs": lp, "finish_reason": g.finish_reason()
                });
                if job.token_ids {
                    c["token_ids"] = json!(g.tokens);
                }
                c
            }).collect::<Vec<_>>(),
            "usage": u,
        }),
        Api::Chat => json!({
            "id": job.id, "object": "chat.completion", "created": now_secs(), "model": st.config.model,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": st.engine.detokenize(&gens[0].tokens).concat()},
                "logprobs": job.logprobs.map_or(Value::Null, |k| {
                    logprobs_json(&st.engine, job.api, &gens[0].tokens, &gens[0].logprobs, k, true, 0)
                }),
                "finish_reason": gens[0].finish_reason(),
            }],
            "usage": u,
        }),
        Api::Responses => response_object(&st, &job, &st.engine.detokenize(&gens[0].tokens).concat(), u, "completed"),
    };
    observe(&st.metrics.duration, job.api, started.elapsed().as_secs_f64());
    cancelled.answered = true;
    let mut r = Json(body).into_response();
    // each prompt's time to first token, fetch included (server side, milliseconds)
    let ttft: Vec<String> = gens.iter().map(|g| format!("{:.3}", g.ttft.as_secs_f64() * 1e3)).collect();
    if let Ok(v) = header::HeaderValue::from_str(&ttft.join(",")) {
        r.headers_mut().insert("x-kvrelay-ttft-ms", v);
    }
    if st.config.debug_endpoints {
        // a real model's logits digest per prompt (tests: bit-identical to a cold run)
        let d: Vec<String> = gens.iter().filter_map(|g| g.logits_digest).map(|d| format!("{d:016x}")).collect();
        if let Ok(v) = header::HeaderValue::from_str(&d.join(",")) {
            if !d.is_empty() {
                r.headers_mut().insert("x-kvrelay-logits", v);
            }
        }
    }
    with_facts(r, &job, &gens, &fetch_log)
}

pub(super) fn observe(
    h: &prometheus_client::metrics::family::Family<
        EndpointLabel,
        prometheus_client::metrics::histogram::Histogram,
        fn() -> prometheus_client::metrics::histogram::Histogram,
    >,
    api: Api,
    secs: f64,
) {
    h.get_or_create(&EndpointLabel { endpoint: api.endpoint().into() }).observe(secs);
}

pub(super) fn totals(gens: &[Generation]) -> (usize, usize, usize) {
    gens.iter().fold((0, 0, 0), |(p, c, g), x| (p + x.prompt_tokens, c + x.cached_tokens, g + x.tokens.len()))
}

pub(super) fn facts_of(job: &Job, gens: &[Generation], fetch: &str) -> Facts {
    let (pt, ct, _) = totals(gens);
    Facts {
        id: job.id.clone(),
        prompt_tokens: pt,
        cached_tokens: ct,
        hint: job.hint_label.clone(),
        decision: job.decision_label.clone(),
        fetch: if fetch.is_empty() { "-".into() } else { fetch.into() },
        streamed: false,
    }
}

pub(super) fn with_facts(mut r: Response, job: &Job, gens: &[Generation], fetch: &str) -> Response {
    r.extensions_mut().insert(facts_of(job, gens, fetch));
    r
}

pub(super) fn sse(v: Value) -> Result<Event, Infallible> {
    Ok(Event::default().data(v.to_string()))
}

/// Stream a job as server-sent events. The work runs in a task that stops (and frees its KV
/// blocks) as soon as the client is gone.
pub(super) fn stream_job(st: Shared, job: Job, slot: Slot) -> Response {
    let (tx, mut rx) = mpsc::channel::<Result<Event, Infallible>>(64);
    let st2 = st.clone();
    let job_facts = facts_of(&job, &[], "");
    tokio::spawn(async move {
        let _slot = slot;
        let st = st2;
        let started = Instant::now();
        let created = now_secs();
        let mut gens = Vec::with_capacity(job.prompts.len());
        if job.api == Api::Responses {
            let r = response_object(&st, &job, "", json!(null), "in_progress");
            let _ = tx.send(sse(json!({"type": "response.created", "sequence_number": 0, "response": r}))).await;
        }
        let mut seq = 1u64;
        let mut fetch_log = String::new();
        for (i, (p, plan)) in job.prompts.iter().zip(&job.plans).enumerate() {
            // Each token goes out as the engine chooses it (the real model decodes one at a
            // time); the finish reason follows in a chunk of its own once the run has ended.
            // a token's logprobs go out with it (`off`: the byte offset of its text)
            let lps = |j: usize, toks: &[u32], lps: &[TokenLogprob], off: usize| match job.logprobs {
                Some(k) if !toks.is_empty() => logprobs_json(&st.engine, job.api, toks, lps, k, j == 0, off),
                _ => Value::Null,
            };
            let chunk = |j: usize, w: &str, toks: &[u32], lp: Value, fin: Value, seq: u64| match job.api {
                Api::Completions => {
                    let mut c = json!({"index": i, "text": w, "logprobs": lp, "finish_reason": fin});
                    if job.token_ids {
                        c["token_ids"] = json!(toks);
                    }
                    json!({
                        "id": job.id, "object": "text_completion", "created": created, "model": st.config.model,
                        "choices": [c],
                    })
                }
                Api::Chat => {
                    let delta = match (j, w.is_empty() && !fin.is_null()) {
                        (0, _) => json!({"role": "assistant", "content": w}),
                        (_, true) => json!({}),
                        _ => json!({"content": w}),
                    };
                    json!({
                        "id": job.id, "object": "chat.completion.chunk", "created": created, "model": st.config.model,
                        "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": fin}],
                    })
                }
                Api::Responses => json!({
                    "type": "response.output_text.delta", "sequence_number": seq,
                    "item_id": format!("msg_{}", &job.id[5..]), "output_index": 0, "content_index": 0, "delta": w,
                }),
            };
            let (tok_tx, mut tok_rx) = mpsc::unbounded_channel::<(u32, TokenLogprob)>();
            let mut detok = st.engine.detokenizer();
            let mut j = 0usize;
            let mut off = 0usize;
            let run =
                run_prompt(&st, p, job.salt.as_deref(), job.max_tokens, plan.as_ref(), &mut fetch_log, Some(tok_tx));
            tokio::pin!(run);
            let mut finished = None;
            while finished.is_none() || !tok_rx.is_empty() {
                let (t, lp) = tokio::select! {
                    biased;
                    Some(t) = tok_rx.recv() => t,
                    g = &mut run, if finished.is_none() => { finished = Some(g); continue; }
                    () = tx.closed() => {
                        log_request(&Facts { decision: job.decision_label.clone() + ",client_gone", ..facts_of(&job, &gens, "") }, job.api.endpoint(), 499);
                        return;
                    }
                };
                if i == 0 && j == 0 {
                    observe(&st.metrics.ttft, job.api, started.elapsed().as_secs_f64());
                }
                let w = detok.push(t);
                let lp = lps(j, &[t], std::slice::from_ref(&lp), off);
                if job.logprobs.is_some() {
                    off += st.engine.token_bytes(t, j == 0).len();
                }
                let ev = chunk(j, &w, &[t], lp, json!(null), seq);
                j += 1;
                seq += 1;
                if tx.send(sse(ev)).await.is_err() {
                    return;
                }
            }
            let g = match finished.expect("the loop ends once the run has") {
                Ok(g) => g,
                Err(e) => {
                    let msg = e.message;
                    let _ = tx.send(sse(json!({"error": {"message": msg, "type": "invalid_request_error"}}))).await;
                    break;
                }
            };
            if i == 0 && j == 0 {
                observe(&st.metrics.ttft, job.api, started.elapsed().as_secs_f64());
            }
            let rest = detok.finish();
            if job.api != Api::Responses || !rest.is_empty() {
                let ev = chunk(
                    j,
                    &rest,
                    &[],
                    Value::Null,
                    if job.api == Api::Responses { json!(null) } else { json!(g.finish_reason()) },
                    seq,
                );
                seq += 1;
                if tx.send(sse(ev)).await.is_err() {
                    return;
                }
            }
            gens.push(g);
        }
        let (pt, ct, gt) = totals(&gens);
        let u = usage(job.api, pt, ct, gt);
        let tail = match job.api {
            Api::Responses => Some(json!({
                "type": "response.completed", "sequence_number": seq,
                "response": response_object(&st, &job, &gens.first().map(|g| st.engine.detokenize(&g.tokens).concat()).unwrap_or_default(), u, "completed"),
            })),
            Api::Chat if job.include_usage => Some(json!({
                "id": job.id, "object": "chat.completion.chunk", "created": created, "model": st.config.model, "choices": [], "usage": u,
            })),
            Api::Completions if job.include_usage => Some(json!({
                "id": job.id, "object": "text_completion", "created": created, "model": st.config.model, "choices": [], "usage": u,
            })),
            _ => None,
        };
        if let Some(t) = tail {
            let _ = tx.send(sse(t)).await;
        }
        let _ = tx.send(Ok(Event::default().data("[DONE]"))).await;
        observe(&st.metrics.duration, job.api, started.elapsed().as_secs_f64());
        log_request(&facts_of(&job, &gens, &fetch_log), job.api.endpoint(), 200);
    });
    let stream = futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx));
    let mut r = Sse::new(stream).into_response();
    r.extensions_mut().insert(Facts { streamed: true, ..job_facts });
    r
}
