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
use crate::engine::{block_names, detokenize, render_chat, tokenize, Engine, EngineError, Generation};
use crate::metrics::{DirectionLabel, EndpointLabel, Metrics, RequestLabels, TransferLabels};
use crate::transfer::api::{TransferConfig, TransferJobs};
use crate::transfer::tcp::ServiceStats;
use crate::transfer::{fetch_into_cache, with_plan_slot, FetchOutcome, FetchPlan, TransferState};

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
    /// The KV service's counters.
    pub kv_service: Arc<ServiceStats>,
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
        kv_service: Arc<ServiceStats>,
    ) -> Shared {
        Arc::new(AppState {
            admission,
            orchestrator,
            engine,
            metrics: Metrics::new(),
            transfer,
            transfer_config,
            transfer_jobs: TransferJobs::default(),
            kv_service,
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
        .route("/v1/kv/info", get(crate::transfer::api::kv_info))
        .route("/v1/kv/prefill", post(crate::transfer::api::kv_prefill))
        .route("/v1/kv_transfer", post(crate::transfer::api::kv_transfer))
        .route("/v1/kv_transfer/stats", get(crate::transfer::api::kv_transfer_stats))
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
// Bodies

/// Read a body with the server's size limit (413 above it).
pub async fn read_body(st: &AppState, headers: &HeaderMap, body: Body) -> Result<Bytes, ApiError> {
    let limit = st.config.max_body_bytes;
    let too_large = || ApiError {
        status: StatusCode::PAYLOAD_TOO_LARGE,
        kind: "invalid_request_error",
        code: Some("body_too_large"),
        message: format!("request body over the server's limit of {limit} bytes"),
    };
    if let Some(n) =
        headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok())
    {
        if n > limit as u64 {
            return Err(too_large());
        }
    }
    axum::body::to_bytes(body, limit).await.map_err(|_| too_large())
}

/// Parse a JSON body (400 with `invalid_json` when it is not JSON).
pub fn parse<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    // Values kept raw or skipped are walked iteratively by serde_json, so lifting the limit
    // lets deep hints reach admission; typed members are shallow.
    de.disable_recursion_limit();
    let v = T::deserialize(&mut de).and_then(|v| de.end().map(|()| v));
    v.map_err(|e| {
        let msg = if e.is_syntax() || e.is_eof() || e.is_io() {
            format!("the body is not valid JSON ({} at line {} column {})", classify(&e), e.line(), e.column())
        } else {
            format!("invalid request body: {e}")
        };
        ApiError::bad_request(msg).with_code("invalid_json")
    })
}

fn classify(e: &serde_json::Error) -> &'static str {
    if e.is_eof() {
        "unexpected end"
    } else {
        "syntax error"
    }
}

/// The hint members of every generation body (each body lists them itself: serde cannot keep a
/// `RawValue` through `#[serde(flatten)]`). A request carries one hint: `kv_hints` (the spelling
/// of OpenAI clients' `extra_body`), Dynamo's `kv_hint`, or `kv_hint` under
/// `kv_transfer_params`; two at once is a 400.
struct HintFields<'a> {
    kv_hints: Option<&'a RawValue>,
    kv_hint: Option<&'a RawValue>,
    kv_transfer_params: Option<&'a RawValue>,
}

macro_rules! hint_fields {
    ($b:expr) => {
        HintFields { kv_hints: $b.kv_hints, kv_hint: $b.kv_hint, kv_transfer_params: $b.kv_transfer_params }
    };
}

#[derive(Deserialize)]
struct TransferParams<'a> {
    #[serde(borrow, default)]
    kv_hint: Option<&'a RawValue>,
}

impl<'a> HintFields<'a> {
    fn raw(&self) -> Result<Option<&'a [u8]>, ApiError> {
        let nested = self
            .kv_transfer_params
            .and_then(|p| serde_json::from_str::<TransferParams<'a>>(p.get()).ok())
            .and_then(|p| p.kv_hint);
        let all = [self.kv_hints, self.kv_hint, nested];
        let mut present = all.iter().flatten();
        let first = present.next();
        if present.next().is_some() {
            return Err(ApiError::bad_request(
                "a request carries one KV hint: kv_hints, kv_hint and kv_transfer_params.kv_hint are exclusive",
            )
            .with_code("multiple_kv_hints"));
        }
        Ok(first.map(|r| r.get().as_bytes()))
    }
}

#[derive(Deserialize)]
struct CompletionBody<'a> {
    #[serde(borrow)]
    prompt: Option<&'a RawValue>,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    cache_salt: Option<String>,
    #[serde(borrow, default)]
    kv_hints: Option<&'a RawValue>,
    #[serde(borrow, default)]
    kv_hint: Option<&'a RawValue>,
    #[serde(borrow, default)]
    kv_transfer_params: Option<&'a RawValue>,
}

#[derive(Deserialize, Default)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

#[derive(Deserialize)]
struct ChatBody<'a> {
    #[serde(default)]
    messages: Option<Vec<Message<'a>>>,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    cache_salt: Option<String>,
    #[serde(borrow, default)]
    kv_hints: Option<&'a RawValue>,
    #[serde(borrow, default)]
    kv_hint: Option<&'a RawValue>,
    #[serde(borrow, default)]
    kv_transfer_params: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Message<'a> {
    role: String,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct ResponsesBody<'a> {
    #[serde(borrow)]
    input: Option<&'a RawValue>,
    #[serde(default)]
    instructions: Option<String>,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    max_output_tokens: Option<u64>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    cache_salt: Option<String>,
    #[serde(borrow, default)]
    kv_hints: Option<&'a RawValue>,
    #[serde(borrow, default)]
    kv_hint: Option<&'a RawValue>,
    #[serde(borrow, default)]
    kv_transfer_params: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct LookupBody<'a> {
    #[serde(borrow, default)]
    prompt: Option<&'a RawValue>,
    #[serde(default)]
    messages: Option<Vec<Message<'a>>>,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    cache_salt: Option<String>,
}

/// A prompt as text or token ids.
enum PromptIn {
    Text(String),
    Tokens(Vec<u32>),
}

impl PromptIn {
    fn tokens(&self) -> Vec<u32> {
        match self {
            PromptIn::Text(t) => tokenize(t),
            PromptIn::Tokens(t) => t.clone(),
        }
    }
}

fn token_list(v: &[Value]) -> Option<Vec<u32>> {
    v.iter().map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok())).collect()
}

/// A completion prompt: a string, a list of strings, a token list or a list of token lists.
/// Returns the prompts and whether the request is batched (a list of prompts).
fn completion_prompts(raw: Option<&RawValue>) -> Result<(Vec<PromptIn>, bool), ApiError> {
    let missing = || ApiError::bad_request("the request has no prompt").with_code("missing_prompt");
    let raw = raw.ok_or_else(missing)?;
    let bad = || {
        ApiError::bad_request(
            "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists",
        )
        .with_code("invalid_prompt")
    };
    let v: Value = serde_json::from_str(raw.get()).map_err(|_| bad())?;
    match v {
        Value::String(s) => Ok((vec![PromptIn::Text(s)], false)),
        Value::Array(items) if items.is_empty() => Err(missing()),
        Value::Array(items) if items.iter().all(Value::is_number) => {
            Ok((vec![PromptIn::Tokens(token_list(&items).ok_or_else(bad)?)], false))
        }
        Value::Array(items) => {
            let mut out = Vec::with_capacity(items.len());
            for it in items {
                out.push(match it {
                    Value::String(s) => PromptIn::Text(s),
                    Value::Array(t) => PromptIn::Tokens(token_list(&t).ok_or_else(bad)?),
                    _ => return Err(bad()),
                });
            }
            Ok((out, true))
        }
        Value::Null => Err(missing()),
        _ => Err(bad()),
    }
}

/// Message content: a string, or a list of parts whose `text` members are concatenated.
fn content_text(raw: Option<&RawValue>) -> Result<String, ApiError> {
    let Some(raw) = raw else { return Ok(String::new()) };
    let v: Value = serde_json::from_str(raw.get())
        .map_err(|_| ApiError::bad_request("message content must be a string or a list of parts"))?;
    match v {
        Value::Null => Ok(String::new()),
        Value::String(s) => Ok(s),
        Value::Array(parts) => {
            let mut s = String::new();
            for p in parts {
                match p.get("text").and_then(Value::as_str) {
                    Some(t) => s.push_str(t),
                    None => return Err(ApiError::bad_request("only text content parts are supported")),
                }
            }
            Ok(s)
        }
        _ => Err(ApiError::bad_request("message content must be a string or a list of parts")),
    }
}

fn chat_text(messages: Option<&[Message<'_>]>, instructions: Option<&str>) -> Result<String, ApiError> {
    let messages = messages
        .filter(|m| !m.is_empty())
        .ok_or_else(|| ApiError::bad_request("the request has no messages").with_code("missing_prompt"))?;
    let mut rendered = Vec::with_capacity(messages.len() + 1);
    if let Some(i) = instructions {
        rendered.push(("system".to_string(), i.to_string()));
    }
    for m in messages {
        rendered.push((m.role.clone(), content_text(m.content)?));
    }
    Ok(render_chat(&rendered))
}

fn responses_text(b: &ResponsesBody<'_>) -> Result<String, ApiError> {
    let missing = || ApiError::bad_request("the request has no input").with_code("missing_prompt");
    let raw = b.input.ok_or_else(missing)?;
    if let Ok(s) = serde_json::from_str::<String>(raw.get()) {
        let m = vec![Message { role: "user".into(), content: Some(raw) }];
        let _ = s;
        return chat_text(Some(&m), b.instructions.as_deref());
    }
    let msgs: Vec<Message<'_>> = serde_json::from_str(raw.get())
        .map_err(|_| ApiError::bad_request("input must be a string or a list of messages"))?;
    chat_text(Some(&msgs), b.instructions.as_deref())
}

fn check_model(st: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != st.config.model => Err(ApiError {
            status: StatusCode::NOT_FOUND,
            kind: "invalid_request_error",
            code: Some("model_not_found"),
            message: format!("the model `{m}` does not exist; this server serves `{}`", st.config.model),
        }),
        _ => Ok(()),
    }
}

/// The tokens of a `{prompt | messages}` body with one prompt (lookup, prefill, transfer).
pub fn prompt_tokens(
    st: &AppState,
    prompt: Option<&RawValue>,
    messages: Option<&Value>,
    model: Option<&str>,
) -> Result<Vec<u32>, ApiError> {
    check_model(st, model)?;
    if let Some(m) = messages {
        let text = m.to_string();
        let msgs: Vec<Message<'_>> = serde_json::from_str(&text)
            .map_err(|_| ApiError::bad_request("messages must be a list of {role, content}"))?;
        return Ok(tokenize(&chat_text(Some(&msgs), None)?));
    }
    let (p, batched) = completion_prompts(prompt)?;
    if batched {
        return Err(ApiError::bad_request("this endpoint takes one prompt"));
    }
    Ok(p[0].tokens())
}

fn max_tokens(st: &AppState, n: Option<u64>) -> Result<usize, ApiError> {
    let n = n.map_or(st.config.default_max_tokens as u64, |n| n);
    if n == 0 || n > st.config.max_tokens_limit as u64 {
        return Err(ApiError::bad_request(format!("max_tokens must be 1..={}", st.config.max_tokens_limit)));
    }
    Ok(n as usize)
}

// ---------------------------------------------------------------------------------------------
// The generation path shared by the three endpoints

#[derive(Clone, Copy, PartialEq, Eq)]
enum Api {
    Completions,
    Chat,
    Responses,
}

impl Api {
    fn endpoint(self) -> &'static str {
        match self {
            Api::Completions => "/v1/completions",
            Api::Chat => "/v1/chat/completions",
            Api::Responses => "/v1/responses",
        }
    }
}

struct Job {
    api: Api,
    id: String,
    prompts: Vec<Vec<u32>>,
    salt: Option<String>,
    max_tokens: usize,
    include_usage: bool,
    /// The admitted snapshots travel with the request until it ends.
    _hints: Vec<HintOutcome>,
    /// Per prompt: the named fetch the provider took, if any.
    plans: Vec<Option<FetchPlan>>,
    hint_label: String,
    decision_label: String,
}

/// A waiting-queue place, then a running slot; both given back on drop.
struct Slot {
    _permit: OwnedSemaphorePermit,
}

struct Waiting<'a>(&'a AtomicUsize);
impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

async fn take_slot(st: &AppState) -> Result<Slot, ApiError> {
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

type Admitted = (Vec<HintOutcome>, Vec<Option<FetchPlan>>, String, String);

/// Admit the hint (once, or per prompt for an aligned list), freeze it, and run every prompt
/// through eligibility, candidates and orchestration. Before the request is queued.
fn admit_and_decide(st: &AppState, raw: Option<&[u8]>, prompts: usize, batched: bool) -> Result<Admitted, ApiError> {
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
        let (d, plan) = with_plan_slot(|| st.orchestrator.decide(false, h.snapshot()));
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
        EngineError::Copy(_) => ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "server_error",
            code: None,
            message: e.to_string(),
        },
    }
}

/// Run one prompt: the named fetch first when the provider took one (a failure prefills
/// locally, or fails the request under `--kv-load-failure-policy fail`), then the engine.
async fn run_prompt(
    st: &AppState,
    prompt: &[u32],
    salt: Option<&str>,
    max_tokens: usize,
    plan: Option<&FetchPlan>,
    fetch_log: &mut String,
) -> Result<Generation, ApiError> {
    let names = block_names(prompt, st.engine.config.shape.block_tokens, 0, salt);
    if let Some(plan) = plan {
        let t = &st.transfer;
        let f = fetch_into_cache(&st.engine, &*t.transport, &t.estimator, &plan.endpoint, &names, &plan.hashes, false)
            .await;
        let label = st.record_fetch(&f);
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
    let g = st.engine.generate(prompt, &names, max_tokens).await.map_err(engine_error)?;
    st.metrics.prompt_tokens.inc_by(g.prompt_tokens as u64);
    st.metrics.cached_tokens.inc_by(g.cached_tokens as u64);
    st.metrics.prefilled_tokens.inc_by(g.prefilled_tokens as u64);
    st.metrics.generated_tokens.inc_by(g.tokens.len() as u64);
    Ok(g)
}

fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn usage(api: Api, prompt: usize, cached: usize, completion: usize) -> Value {
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

fn response_object(st: &AppState, job: &Job, text: &str, u: Value, status: &str) -> Value {
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

async fn run_job(st: Shared, job: Job, stream: bool) -> Response {
    let slot = match take_slot(&st).await {
        Ok(s) => s,
        Err(e) => return e.into_response(),
    };
    if stream {
        return stream_job(st, job, slot);
    }
    let started = Instant::now();
    let mut gens = Vec::with_capacity(job.prompts.len());
    let mut fetch_log = String::new();
    for (p, plan) in job.prompts.iter().zip(&job.plans) {
        match run_prompt(&st, p, job.salt.as_deref(), job.max_tokens, plan.as_ref(), &mut fetch_log).await {
            Ok(g) => gens.push(g),
            Err(e) => return with_facts(e.into_response(), &job, &gens, &fetch_log),
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
            "choices": gens.iter().enumerate().map(|(i, g)| json!({
                "index": i, "text": detokenize(&g.tokens).concat(), "logprobs": null, "finish_reason": "length"
            })).collect::<Vec<_>>(),
            "usage": u,
        }),
        Api::Chat => json!({
            "id": job.id, "object": "chat.completion", "created": now_secs(), "model": st.config.model,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": detokenize(&gens[0].tokens).concat()},
                "logprobs": null,
                "finish_reason": "length",
            }],
            "usage": u,
        }),
        Api::Responses => response_object(&st, &job, &detokenize(&gens[0].tokens).concat(), u, "completed"),
    };
    observe(&st.metrics.duration, job.api, started.elapsed().as_secs_f64());
    with_facts(Json(body).into_response(), &job, &gens, &fetch_log)
}

fn observe(
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

fn totals(gens: &[Generation]) -> (usize, usize, usize) {
    gens.iter().fold((0, 0, 0), |(p, c, g), x| (p + x.prompt_tokens, c + x.cached_tokens, g + x.tokens.len()))
}

fn facts_of(job: &Job, gens: &[Generation], fetch: &str) -> Facts {
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

fn with_facts(mut r: Response, job: &Job, gens: &[Generation], fetch: &str) -> Response {
    r.extensions_mut().insert(facts_of(job, gens, fetch));
    r
}

fn sse(v: Value) -> Result<Event, Infallible> {
    Ok(Event::default().data(v.to_string()))
}

/// Stream a job as server-sent events. The work runs in a task that stops (and frees its KV
/// blocks) as soon as the client is gone.
fn stream_job(st: Shared, job: Job, slot: Slot) -> Response {
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
            let g = tokio::select! {
                g = run_prompt(&st, p, job.salt.as_deref(), job.max_tokens, plan.as_ref(), &mut fetch_log) => g,
                () = tx.closed() => {
                    log_request(&Facts { decision: job.decision_label.clone() + ",client_gone", ..facts_of(&job, &gens, "") }, job.api.endpoint(), 499);
                    return;
                }
            };
            let g = match g {
                Ok(g) => g,
                Err(e) => {
                    let msg = e.message;
                    let _ = tx.send(sse(json!({"error": {"message": msg, "type": "invalid_request_error"}}))).await;
                    break;
                }
            };
            if i == 0 {
                observe(&st.metrics.ttft, job.api, started.elapsed().as_secs_f64());
            }
            for (j, w) in detokenize(&g.tokens).into_iter().enumerate() {
                let last = j + 1 == g.tokens.len();
                let ev = match job.api {
                    Api::Completions => json!({
                        "id": job.id, "object": "text_completion", "created": created, "model": st.config.model,
                        "choices": [{"index": i, "text": w, "logprobs": null, "finish_reason": if last { json!("length") } else { json!(null) }}],
                    }),
                    Api::Chat => {
                        let delta =
                            if j == 0 { json!({"role": "assistant", "content": w}) } else { json!({"content": w}) };
                        json!({
                            "id": job.id, "object": "chat.completion.chunk", "created": created, "model": st.config.model,
                            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": if last { json!("length") } else { json!(null) }}],
                        })
                    }
                    Api::Responses => json!({
                        "type": "response.output_text.delta", "sequence_number": seq,
                        "item_id": format!("msg_{}", &job.id[5..]), "output_index": 0, "content_index": 0, "delta": w,
                    }),
                };
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
                "response": response_object(&st, &job, &gens.first().map(|g| detokenize(&g.tokens).concat()).unwrap_or_default(), u, "completed"),
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

// ---------------------------------------------------------------------------------------------
// Handlers

async fn completions(State(st): State<Shared>, headers: HeaderMap, body: Body) -> Response {
    let bytes = match read_body(&st, &headers, body).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let job = (|| {
        let b: CompletionBody<'_> = parse(&bytes)?;
        check_model(&st, b.model.as_deref())?;
        let (prompts, batched) = completion_prompts(b.prompt)?;
        let max_tokens = max_tokens(&st, b.max_tokens)?;
        let raw = hint_fields!(b).raw()?;
        let (hints, plans, hint_label, decision_label) = admit_and_decide(&st, raw, prompts.len(), batched)?;
        Ok::<_, ApiError>((
            Job {
                api: Api::Completions,
                id: st.next_id("cmpl-"),
                prompts: prompts.iter().map(PromptIn::tokens).collect(),
                salt: b.cache_salt,
                max_tokens,
                include_usage: b.stream_options.unwrap_or_default().include_usage,
                _hints: hints,
                plans,
                hint_label,
                decision_label,
            },
            b.stream.unwrap_or(false),
        ))
    })();
    match job {
        Ok((job, stream)) => run_job(st, job, stream).await,
        Err(e) => e.into_response(),
    }
}

async fn chat_completions(State(st): State<Shared>, headers: HeaderMap, body: Body) -> Response {
    let bytes = match read_body(&st, &headers, body).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let job = (|| {
        let b: ChatBody<'_> = parse(&bytes)?;
        check_model(&st, b.model.as_deref())?;
        let text = chat_text(b.messages.as_deref(), None)?;
        let max_tokens = max_tokens(&st, b.max_completion_tokens.or(b.max_tokens))?;
        let raw = hint_fields!(b).raw()?;
        let (hints, plans, hint_label, decision_label) = admit_and_decide(&st, raw, 1, false)?;
        Ok::<_, ApiError>((
            Job {
                api: Api::Chat,
                id: st.next_id("chatcmpl-"),
                prompts: vec![tokenize(&text)],
                salt: b.cache_salt,
                max_tokens,
                include_usage: b.stream_options.unwrap_or_default().include_usage,
                _hints: hints,
                plans,
                hint_label,
                decision_label,
            },
            b.stream.unwrap_or(false),
        ))
    })();
    match job {
        Ok((job, stream)) => run_job(st, job, stream).await,
        Err(e) => e.into_response(),
    }
}

async fn responses(State(st): State<Shared>, headers: HeaderMap, body: Body) -> Response {
    let bytes = match read_body(&st, &headers, body).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let job = (|| {
        let b: ResponsesBody<'_> = parse(&bytes)?;
        check_model(&st, b.model.as_deref())?;
        let text = responses_text(&b)?;
        let max_tokens = max_tokens(&st, b.max_output_tokens)?;
        let raw = hint_fields!(b).raw()?;
        let (hints, plans, hint_label, decision_label) = admit_and_decide(&st, raw, 1, false)?;
        Ok::<_, ApiError>((
            Job {
                api: Api::Responses,
                id: st.next_id("resp_"),
                prompts: vec![tokenize(&text)],
                salt: b.cache_salt,
                max_tokens,
                include_usage: true,
                _hints: hints,
                plans,
                hint_label,
                decision_label,
            },
            b.stream.unwrap_or(false),
        ))
    })();
    match job {
        Ok((job, stream)) => run_job(st, job, stream).await,
        Err(e) => e.into_response(),
    }
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
    st.metrics.set_blocks(
        st.engine.cache.stats(),
        st.kv_service.blocks_sent.load(Ordering::Relaxed),
        st.engine.store.block_bytes() as u64,
    );
    let mut text = st.admission.prometheus();
    text.push_str(&st.orchestrator.prometheus());
    st.metrics.encode(&mut text);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
}

async fn kv_lookup(State(st): State<Shared>, headers: HeaderMap, body: Body) -> Response {
    let r = async {
        let bytes = read_body(&st, &headers, body).await?;
        let b: LookupBody<'_> = parse(&bytes)?;
        check_model(&st, b.model.as_deref())?;
        let tokens = if b.messages.is_some() {
            tokenize(&chat_text(b.messages.as_deref(), None)?)
        } else {
            let (p, batched) = completion_prompts(b.prompt)?;
            if batched {
                return Err(ApiError::bad_request("lookup takes one prompt"));
            }
            p[0].tokens()
        };
        let bt = st.engine.config.shape.block_tokens;
        let names = block_names(&tokens, bt, 0, b.cache_salt.as_deref());
        let held = st.engine.cache.held_prefix(&names);
        Ok::<_, ApiError>(Json(json!({
            "block_tokens": bt,
            "blocks_total": names.len(),
            "blocks_held": held,
            "block_hashes": names,
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
