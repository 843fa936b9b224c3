//! The HTTP surface (SPEC section 7) on axum: OpenAI-compatible completions, chat completions and
//! responses carrying `kv_hints`, models, health, metrics and the KV lookup a router builds
//! hints from.
//!
//! Request bodies are read with a size limit (`--max-body-bytes`, 413 above it) and parsed by
//! serde into typed bodies that keep the raw hint text (`RawValue`), so kvrelay admits the hint
//! from the bytes the client sent. The body parser has no recursion limit on values it skips or
//! keeps raw (serde_json walks those iteratively), so a deeply nested hint reaches admission and
//! is dropped there as `malformed` instead of failing the request. Errors are OpenAI-style JSON
//! bodies; no error message or log line contains a hint's bytes.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{json, Value};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

use crate::abi::{Admission, Decision, HintOutcome, Orchestrator};
use crate::engine::{Engine, EngineError, Generation};
use crate::metrics::{DirectionLabel, EndpointLabel, Metrics, RequestLabels, TransferLabels};

#[macro_use]
mod bodies;
mod generate;
pub mod kv;

use crate::transfer::{fetch_into_cache, FetchOutcome, FetchPlan, PlanSlot, TransferState};
use bodies::*;
pub use bodies::{parse, prompt_tokens, read_body};
pub use generate::engine_error;
use generate::*;
use kv::{TransferConfig, TransferJobs};

/// Server settings the HTTP layer needs.
#[derive(Clone, Debug)]
pub struct HttpConfig {
    /// The served model's name.
    pub model: String,
    /// Largest request body, bytes (413 above).
    pub max_body_bytes: usize,
    /// Requests running at once.
    pub max_concurrency: usize,
    /// Requests waiting for a slot beyond those; more get 429 with `Retry-After`.
    pub max_queue: usize,
    /// Output tokens when a request names none.
    pub default_max_tokens: usize,
    /// Largest `max_tokens` accepted.
    pub max_tokens_limit: usize,
    /// Serve `/debug/kv/corrupt` (tests only).
    pub debug_endpoints: bool,
}

/// Everything a handler needs.
pub struct AppState {
    /// The admission edge.
    pub admission: Admission,
    /// The orchestrator.
    pub orchestrator: Orchestrator,
    /// The reference engine.
    pub engine: Arc<Engine>,
    /// The server's series.
    pub metrics: Metrics,
    /// Settings.
    pub config: HttpConfig,
    /// Cross-instance transfer: transport, estimator, fingerprint, KV endpoint.
    pub transfer: TransferState,
    /// `/v1/kv_transfer` settings.
    pub transfer_config: TransferConfig,
    /// `/v1/kv_transfer` counters and dedup table.
    pub transfer_jobs: TransferJobs,
    slots: Arc<Semaphore>,
    waiting: AtomicUsize,
    next_id: AtomicU64,
}

/// The state handlers share.
pub type Shared = Arc<AppState>;

impl AppState {
    /// Assemble the state.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        admission: Admission,
        orchestrator: Orchestrator,
        engine: Arc<Engine>,
        config: HttpConfig,
        transfer: TransferState,
        transfer_config: TransferConfig,
    ) -> Shared {
        Arc::new(AppState {
            admission,
            orchestrator,
            engine,
            metrics: Metrics::new(),
            transfer,
            transfer_config,
            transfer_jobs: TransferJobs::default(),
            slots: Arc::new(Semaphore::new(config.max_concurrency.max(1))),
            waiting: AtomicUsize::new(0),
            next_id: AtomicU64::new(1),
            config,
        })
    }

    fn next_id(&self, prefix: &str) -> String {
        format!("{prefix}{:016x}", self.next_id.fetch_add(1, Ordering::Relaxed))
    }

    /// Count a fetch's outcome in the metrics; returns its label for the request's log line.
    pub fn record_fetch(&self, f: &FetchOutcome) -> String {
        let m = &self.metrics;
        let bt = self.engine.config.shape.block_tokens;
        if f.blocks > 0 {
            let received = DirectionLabel { direction: "received".into() };
            m.transfer_blocks.get_or_create(&received).inc_by(f.blocks as u64);
            m.transfer_bytes.get_or_create(&received).inc_by(f.bytes as u64);
            m.fetched_tokens.inc_by((f.blocks * bt) as u64);
        }
        let (outcome, reason) = match (&f.error, f.not_worth_it, f.nothing) {
            (Some(e), _, _) => ("failed", e.reason.as_str()),
            (None, true, _) => ("skipped", "fetch_not_worth_it"),
            (None, _, true) => ("skipped", "nothing_to_fetch"),
            (None, false, false) => ("ok", "none"),
        };
        m.transfers.get_or_create(&TransferLabels { outcome: outcome.into(), reason: reason.into() }).inc();
        if outcome == "ok" {
            m.transfer_seconds.observe(f.seconds);
        }
        let local = if f.local_s.is_finite() { format!("{:.2}ms", f.local_s * 1e3) } else { "unmodeled".into() };
        format!("{outcome}:{reason}:{}blocks:est={:.2}ms:local={local}", f.blocks, f.estimate_s * 1e3)
    }
}

/// The router with every route.
pub fn router(state: Shared) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/responses", post(responses))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/kv/lookup", post(kv_lookup))
        .route("/debug/kv/corrupt", post(debug_corrupt))
        .route("/v1/kv/info", get(kv::kv_info))
        .route("/v1/kv/prefill", post(kv::kv_prefill))
        .route("/v1/kv_transfer", post(kv::kv_transfer))
        .route("/v1/kv_transfer/stats", get(kv::kv_transfer_stats))
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(state.clone(), record))
        .layer(DefaultBodyLimit::disable())
        .with_state(state)
}

// ---------------------------------------------------------------------------------------------
// Errors

/// An OpenAI-style error response.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    kind: &'static str,
    code: Option<&'static str>,
    message: String,
}

impl ApiError {
    /// A 400.
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError { status: StatusCode::BAD_REQUEST, kind: "invalid_request_error", code: None, message: message.into() }
    }
    /// A 403.
    pub fn forbidden(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::FORBIDDEN,
            kind: "permission_error",
            code: Some("forbidden"),
            message: message.into(),
        }
    }
    /// Set the error code.
    pub fn with_code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {"message": self.message, "type": self.kind, "param": null, "code": self.code}});
        let mut r = (self.status, Json(body)).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS || self.status == StatusCode::SERVICE_UNAVAILABLE {
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        r
    }
}

/// What the request-log middleware prints for a request (never hint bytes).
#[derive(Clone, Debug, Default)]
struct Facts {
    id: String,
    prompt_tokens: usize,
    cached_tokens: usize,
    hint: String,
    decision: String,
    fetch: String,
    /// The handler logs the line itself when the stream ends.
    streamed: bool,
}

const ROUTES: [&str; 12] = [
    "/v1/kv/info",
    "/v1/kv/prefill",
    "/v1/kv_transfer",
    "/v1/kv_transfer/stats",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/models",
    "/health",
    "/metrics",
    "/v1/kv/lookup",
    "/debug/kv/corrupt",
];

fn route_label(path: &str) -> &'static str {
    ROUTES.iter().copied().find(|r| *r == path).unwrap_or("other")
}

async fn record(State(st): State<Shared>, req: Request, next: Next) -> Response {
    let endpoint = route_label(req.uri().path());
    let resp = next.run(req).await;
    let status = resp.status().as_u16();
    st.metrics.requests.get_or_create(&RequestLabels { endpoint: endpoint.into(), status }).inc();
    let facts = resp.extensions().get::<Facts>().cloned().unwrap_or_default();
    if !facts.streamed && endpoint != "/metrics" && endpoint != "/health" {
        log_request(&facts, endpoint, status);
    }
    resp
}

fn log_request(f: &Facts, endpoint: &str, status: u16) {
    tracing::info!(
        target: "kvrelay_server::request",
        id = %f.id,
        endpoint,
        status,
        prompt_tokens = f.prompt_tokens,
        cached_tokens = f.cached_tokens,
        hint = %f.hint,
        decision = %f.decision,
        fetch = %f.fetch,
        "request"
    );
}

async fn not_found() -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        kind: "invalid_request_error",
        code: None,
        message: "no such route".into(),
    }
}

// ---------------------------------------------------------------------------------------------
// Handlers

/// What each generation endpoint's body comes down to.
struct Parsed {
    model: Option<String>,
    prompts: Vec<Vec<u32>>,
    batched: bool,
    salt: Option<String>,
    max_tokens: Option<u64>,
    include_usage: bool,
    token_ids: bool,
    /// Alternatives per token when logprobs are asked for.
    logprobs: Option<usize>,
    stream: bool,
}

fn parse_completion(e: &Engine, bytes: &[u8]) -> Result<Parsed, ApiError> {
    let b: CompletionBody<'_> = parse(bytes)?;
    let (prompts, batched) = completion_prompts(b.prompt)?;
    Ok(Parsed {
        prompts: prompts.iter().map(|p| p.tokens(e)).collect::<Result<_, _>>()?,
        batched,
        max_tokens: b.max_tokens,
        include_usage: b.stream_options.as_ref().is_some_and(|o| o.include_usage),
        token_ids: b.return_token_ids.unwrap_or(false),
        // the legacy API's `logprobs` is the number of alternatives itself
        logprobs: logprobs_wanted(b.logprobs.is_some(), b.logprobs)?,
        stream: b.stream.unwrap_or(false),
        model: b.model,
        salt: b.cache_salt,
    })
}

fn parse_chat(e: &Engine, bytes: &[u8]) -> Result<Parsed, ApiError> {
    let b: ChatBody<'_> = parse(bytes)?;
    let text = chat_text(e, b.messages.as_deref(), None)?;
    Ok(Parsed {
        prompts: vec![e.tokenize(&text)],
        batched: false,
        max_tokens: b.max_completion_tokens.or(b.max_tokens),
        include_usage: b.stream_options.as_ref().is_some_and(|o| o.include_usage),
        token_ids: false,
        logprobs: logprobs_wanted(b.logprobs.unwrap_or(false), b.top_logprobs)?,
        stream: b.stream.unwrap_or(false),
        model: b.model,
        salt: b.cache_salt,
    })
}

fn parse_responses(e: &Engine, bytes: &[u8]) -> Result<Parsed, ApiError> {
    let b: ResponsesBody<'_> = parse(bytes)?;
    let text = responses_text(e, &b)?;
    Ok(Parsed {
        prompts: vec![e.tokenize(&text)],
        batched: false,
        max_tokens: b.max_output_tokens,
        include_usage: true,
        token_ids: false,
        logprobs: None,
        stream: b.stream.unwrap_or(false),
        model: b.model,
        salt: b.cache_salt,
    })
}

/// The three generation endpoints: read and parse the body, check the model and the output
/// length, admit the hint and run orchestration (before queueing), then run the job.
async fn generation(
    st: Shared,
    headers: HeaderMap,
    body: Body,
    api: Api,
    parse_body: fn(&Engine, &[u8]) -> Result<Parsed, ApiError>,
) -> Response {
    let bytes = match read_body(&st, &headers, body).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let job = (|| {
        let p = parse_body(&st.engine, &bytes)?;
        check_model(&st, p.model.as_deref())?;
        let max_tokens = max_tokens(&st, p.max_tokens)?;
        let raw = bodies::hint(&bytes)?;
        let (hints, plans, hint_label, decision_label) = admit_and_decide(&st, raw, p.prompts.len(), p.batched)?;
        let job = Job {
            api,
            id: st.next_id(api.id_prefix()),
            prompts: p.prompts,
            salt: p.salt,
            max_tokens,
            include_usage: p.include_usage,
            token_ids: p.token_ids,
            logprobs: p.logprobs,
            _hints: hints,
            plans,
            hint_label,
            decision_label,
        };
        Ok::<_, ApiError>((job, p.stream))
    })();
    match job {
        Ok((job, stream)) => run_job(st, job, stream).await,
        Err(e) => e.into_response(),
    }
}

async fn completions(State(st): State<Shared>, headers: HeaderMap, body: Body) -> Response {
    generation(st, headers, body, Api::Completions, parse_completion).await
}

async fn chat_completions(State(st): State<Shared>, headers: HeaderMap, body: Body) -> Response {
    generation(st, headers, body, Api::Chat, parse_chat).await
}

async fn responses(State(st): State<Shared>, headers: HeaderMap, body: Body) -> Response {
    generation(st, headers, body, Api::Responses, parse_responses).await
}

async fn models(State(st): State<Shared>) -> Json<Value> {
    Json(
        json!({"object": "list", "data": [{"id": st.config.model, "object": "model", "created": 0, "owned_by": "kvrelay"}]}),
    )
}

async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

async fn metrics(State(st): State<Shared>) -> Response {
    st.metrics.waiting.set(st.waiting.load(Ordering::Relaxed) as i64);
    let agent = st.transfer.agent.stats();
    st.metrics.set_blocks(
        st.engine.cache.stats(),
        agent.blocks_sent,
        agent.blocks_withheld,
        st.engine.store.block_bytes() as u64,
    );
    let mut text = st.admission.prometheus();
    text.push_str(&st.orchestrator.prometheus());
    text.push_str(&st.transfer.agent.prometheus());
    if let Some(ev) = &st.transfer.events {
        ev.prometheus(&mut text);
    }
    st.metrics.encode(&mut text);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
}

async fn kv_lookup(State(st): State<Shared>, headers: HeaderMap, body: Body) -> Response {
    let r = async {
        let bytes = read_body(&st, &headers, body).await?;
        let b: LookupBody<'_> = parse(&bytes)?;
        let tokens = prompt_tokens(&st, b.prompt, b.messages, b.model.as_deref())?;
        let bt = st.engine.config.shape.block_tokens;
        let names = st.engine.block_names(&tokens, b.cache_salt.as_deref());
        let held = st.engine.cache.held_prefix(&names);
        Ok::<_, ApiError>(Json(json!({
            "block_tokens": bt,
            "blocks_total": names.len(),
            "blocks_held": held,
            "block_hashes": names,
            "token_ids": tokens,
        })))
    }
    .await;
    match r {
        Ok(j) => j.into_response(),
        Err(e) => e.into_response(),
    }
}

#[derive(Deserialize)]
struct CorruptBody {
    block_hash: u64,
}

async fn debug_corrupt(State(st): State<Shared>, headers: HeaderMap, body: Body) -> Response {
    if !st.config.debug_endpoints {
        return not_found().await.into_response();
    }
    let r = async {
        let bytes = read_body(&st, &headers, body).await?;
        let b: CorruptBody = parse(&bytes)?;
        let found = st.engine.corrupt_block(b.block_hash).map_err(|e| ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "server_error",
            code: None,
            message: e.to_string(),
        })?;
        Ok::<_, ApiError>(Json(json!({"corrupted": found})))
    }
    .await;
    match r {
        Ok(j) => j.into_response(),
        Err(e) => e.into_response(),
    }
}
