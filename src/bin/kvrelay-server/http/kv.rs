//! `GET /v1/kv/info`, `POST /v1/kv/prefill`, `POST /v1/kv_transfer` and
//! `GET /v1/kv_transfer/stats` (SPEC section 8).
//!
//! `/v1/kv_transfer {source, prompt | messages, model?, cache_salt?}` answers `202` before the
//! work is done, with `accepted`, `deduped` (the same request hash within
//! `KV_TRANSFER_DEDUP_TTL` seconds) or `skipped_busy` (`KV_TRANSFER_MAX_INFLIGHT` transfers
//! already running); `403` when no source allowlist is configured (`KV_TRANSFER_SOURCE_ALLOW`,
//! fail closed) or the source is not on it; no connection is opened to a source off the
//! allowlist. The transfer asks the source for its KV endpoint and fingerprint
//! (`/v1/kv/info`), asks it to prefill the prompt when it does not hold it
//! (`/v1/kv/lookup`, then `/v1/kv/prefill`), then pulls the blocks this instance lacks. A failed
//! transfer clears its dedup entry so it can be retried.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{json, Value};
use xxhash_rust::xxh3::xxh3_64;

use super::{generate::take_slot, parse, prompt_tokens, read_body, ApiError, AppState, Shared};
use crate::client;
use crate::transfer::{fetch_into_cache, fingerprint_json, FailReason, FetchError};

/// `/v1/kv_transfer` settings.
#[derive(Clone, Debug)]
pub struct TransferConfig {
    /// Allowed source base URLs (`http://host:port`); empty refuses every transfer.
    pub source_allow: Vec<String>,
    /// Dedup window.
    pub dedup_ttl: Duration,
    /// Transfers running at once.
    pub max_inflight: usize,
    /// The trusted endpoint registry (`--trusted-endpoint`): a source may advertise a KV
    /// endpoint on it, or on its own host.
    pub trusted_endpoints: Vec<String>,
}

/// Counters and dedup table of `/v1/kv_transfer`.
#[derive(Default)]
pub struct TransferJobs {
    dedup: Mutex<HashMap<u64, Instant>>,
    fired: AtomicU64,
    transferred: AtomicU64,
    failed: AtomicU64,
    deduped: AtomicU64,
    skipped_busy: AtomicU64,
    inflight: AtomicU64,
    blocks: AtomicU64,
    bytes: AtomicU64,
    reasons: Mutex<HashMap<&'static str, u64>>,
}

/// Normalize a source URL to `http://host:port` (no path, no trailing slash).
pub fn normalize_source(s: &str) -> Option<String> {
    let rest = s.trim().strip_prefix("http://")?;
    let hostport = rest.trim_end_matches('/');
    if hostport.is_empty() || hostport.contains('/') || !hostport.contains(':') {
        return None;
    }
    Some(format!("http://{}", hostport.to_ascii_lowercase()))
}

/// Largest answer read from a source (`/v1/kv/info`, `/v1/kv/lookup`, `/v1/kv/prefill`).
pub const MAX_SOURCE_BODY: usize = 16 << 20;

/// Resolve a normalized source URL (on the runtime's resolver, not a worker thread).
async fn source_addr(source: &str) -> Option<SocketAddr> {
    tokio::net::lookup_host(source.strip_prefix("http://")?).await.ok()?.next()
}

/// `host` of `scheme://host:port` (IPv6 brackets kept), lower-cased.
fn host_of(url: &str) -> Option<String> {
    let rest = url.split_once("://")?.1;
    let (host, port) = rest.rsplit_once(':')?;
    (!host.is_empty() && port.parse::<u16>().is_ok()).then(|| host.to_ascii_lowercase())
}

/// Whether the KV endpoint a source advertised may be used: on the trusted registry, or on
/// the source URL's own host.
pub fn endpoint_allowed(endpoint: &str, source: &str, trusted: &[String]) -> bool {
    let ep = endpoint.to_ascii_lowercase();
    if !ep.starts_with("tcp://") || host_of(&ep).is_none() {
        return false;
    }
    trusted.iter().any(|t| t.to_ascii_lowercase() == ep) || host_of(&ep) == host_of(source)
}

/// `GET /v1/kv/info`: the KV service's endpoint, transport and fingerprint; with
/// `--kv-events-endpoint`, the events publisher (`kv_events`) and what a Dynamo router's
/// worker registration needs (`dynamo`).
pub async fn kv_info(State(st): State<Shared>) -> Json<Value> {
    let mut v = json!({
        "kv_endpoint": st.transfer.endpoint,
        "transport": st.transfer.transport,
        "fingerprint": fingerprint_json(&st.transfer.fingerprint, &st.transfer.naming),
        "block_bytes": st.engine.store.block_bytes(),
        "block_tokens": st.engine.config.shape.block_tokens,
    });
    if let Some(ev) = &st.transfer.events {
        v["kv_events"] = ev.info();
        v["dynamo"] = dynamo_registration(&st, ev);
    }
    Json(v)
}

/// The fields of a Dynamo worker registration (`SelectionService.upsert_worker`, or a
/// runtime worker's engine-specific settings) that describe this instance: the model it
/// serves, its block size, where its KV events and their replay are, and the KV endpoint a
/// hint names as the source, per data-parallel rank (this server is rank 0).
fn dynamo_registration(st: &AppState, ev: &crate::abi::KvEvents) -> Value {
    json!({
        "model_name": st.config.model,
        "block_size": ev.block_size,
        "kv_events_endpoint": ev.endpoint,
        "replay_endpoint": ev.replay_endpoint,
        "router_hint_worker_type": DYNAMO_WORKER_TYPE,
        "router_hint_source_control_endpoints": {"0": st.transfer.endpoint},
    })
}

/// The worker type a Dynamo registration names for this server.
pub const DYNAMO_WORKER_TYPE: &str = "kvrelay";

/// Values are kept raw (the body parser lifts the recursion limit, which is only safe for
/// values it skips or keeps raw) and read later with serde_json's default limits.
#[derive(Deserialize)]
struct PromptBody<'a> {
    #[serde(borrow, default)]
    prompt: Option<&'a RawValue>,
    #[serde(borrow, default)]
    messages: Option<&'a RawValue>,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    cache_salt: Option<String>,
    #[serde(borrow, default)]
    source: Option<&'a RawValue>,
}

/// `POST /v1/kv/prefill {prompt | messages, cache_salt?}`: prefill (or reuse) the prompt's
/// blocks so another instance can pull them; answers `{blocks_total, blocks_held}`.
pub async fn kv_prefill(State(st): State<Shared>, headers: HeaderMap, body: Body) -> Response {
    let r = async {
        let bytes = read_body(&st, &headers, body).await?;
        let b: PromptBody<'_> = parse(&bytes)?;
        let tokens = prompt_tokens(&st, b.prompt, b.messages, b.model.as_deref())?;
        let names = st.engine.block_names(&tokens, b.cache_salt.as_deref());
        // a prefill is a request like any other: it runs in a running slot (queued, or 429
        // beyond the queue), so it cannot bypass --max-concurrency
        let _slot = take_slot(&st).await?;
        st.engine.generate(&tokens, &names, 1).await.map_err(super::engine_error)?;
        Ok::<_, ApiError>(Json(json!({
            "blocks_total": names.len(),
            "blocks_held": st.engine.cache.held_prefix(&names),
        })))
    }
    .await;
    match r {
        Ok(j) => j.into_response(),
        Err(e) => e.into_response(),
    }
}

/// `GET /v1/kv_transfer/stats`.
pub async fn kv_transfer_stats(State(st): State<Shared>) -> Json<Value> {
    let j = &st.transfer_jobs;
    let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
    // `seen`: the dedup table's size, request hashes still within the TTL
    let seen = {
        let mut d = j.dedup.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        d.retain(|_, exp| *exp > now);
        d.len()
    };
    let reasons: serde_json::Map<String, Value> =
        j.reasons.lock().unwrap_or_else(|e| e.into_inner()).iter().map(|(k, v)| (k.to_string(), json!(v))).collect();
    Json(json!({
        "fired": g(&j.fired),
        "transferred": g(&j.transferred),
        "failed": g(&j.failed),
        "deduped": g(&j.deduped),
        "skipped_busy": g(&j.skipped_busy),
        "inflight": g(&j.inflight),
        "seen": seen,
        "max_inflight": st.transfer_config.max_inflight,
        "blocks_moved": g(&j.blocks),
        "bytes_moved": g(&j.bytes),
        "failures": reasons,
    }))
}

/// `POST /v1/kv_transfer`.
pub async fn kv_transfer(State(st): State<Shared>, headers: HeaderMap, body: Body) -> Response {
    let r = async {
        let bytes = read_body(&st, &headers, body).await?;
        let b: PromptBody<'_> = parse(&bytes)?;
        let source = match b.source.map(|r| serde_json::from_str::<String>(r.get())) {
            Some(Ok(s)) => normalize_source(&s)
                .ok_or_else(|| ApiError::bad_request("source must be a base URL like http://HOST:PORT").with_code("invalid_source"))?,
            _ => return Err(ApiError::bad_request("the request has no source").with_code("missing_source")),
        };
        let tokens = prompt_tokens(&st, b.prompt, b.messages, b.model.as_deref())?;
        let cfg = &st.transfer_config;
        if cfg.source_allow.is_empty() {
            return Err(ApiError::forbidden("no source allowlist is configured (KV_TRANSFER_SOURCE_ALLOW); transfers are refused"));
        }
        if !cfg.source_allow.iter().any(|a| a == &source) {
            return Err(ApiError::forbidden("the source is not on this instance's allowlist (KV_TRANSFER_SOURCE_ALLOW)"));
        }
        let mut key = source.clone().into_bytes();
        key.push(0);
        key.extend(tokens.iter().flat_map(|t| t.to_le_bytes()));
        key.push(0);
        key.extend_from_slice(b.cache_salt.as_deref().unwrap_or("").as_bytes());
        let hash = xxh3_64(&key);
        let request_hash = format!("{hash:016x}");
        let j = &st.transfer_jobs;
        {
            let mut d = j.dedup.lock().unwrap_or_else(|e| e.into_inner());
            let now = Instant::now();
            d.retain(|_, exp| *exp > now);
            if d.contains_key(&hash) {
                j.deduped.fetch_add(1, Ordering::Relaxed);
                return Ok(json!({"status": "deduped", "request_hash": request_hash}));
            }
            if j.inflight.load(Ordering::Relaxed) >= cfg.max_inflight as u64 {
                j.skipped_busy.fetch_add(1, Ordering::Relaxed);
                return Ok(json!({"status": "skipped_busy", "request_hash": request_hash}));
            }
            d.insert(hash, now + cfg.dedup_ttl);
            j.inflight.fetch_add(1, Ordering::Relaxed);
            j.fired.fetch_add(1, Ordering::Relaxed);
        }
        // forwarded to the source as received (already validated by `prompt_tokens`)
        let prompt_json: Value = match (b.prompt, b.messages) {
            (Some(p), _) => json!({"prompt": serde_json::from_str::<Value>(p.get()).unwrap_or(Value::Null)}),
            (None, Some(m)) => json!({"messages": serde_json::from_str::<Value>(m.get()).unwrap_or(Value::Null)}),
            _ => Value::Null,
        };
        let salt = b.cache_salt.clone();
        let st2 = st.clone();
        tokio::spawn(async move {
            let r = run_transfer(&st2, &source, &tokens, salt.as_deref(), prompt_json).await;
            let j = &st2.transfer_jobs;
            match r {
                Ok((blocks, bytes)) => {
                    j.transferred.fetch_add(1, Ordering::Relaxed);
                    j.blocks.fetch_add(blocks as u64, Ordering::Relaxed);
                    j.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
                    tracing::info!(target: "kvrelay_server::transfer", request_hash = %format!("{hash:016x}"), blocks, bytes, "kv_transfer done");
                }
                Err(e) => {
                    j.failed.fetch_add(1, Ordering::Relaxed);
                    *j.reasons.lock().unwrap_or_else(|e| e.into_inner()).entry(e.reason.as_str()).or_default() += 1;
                    j.dedup.lock().unwrap_or_else(|e| e.into_inner()).remove(&hash);
                    tracing::warn!(target: "kvrelay_server::transfer", request_hash = %format!("{hash:016x}"), reason = %e.reason, detail = %e.detail, "kv_transfer failed");
                }
            }
            j.inflight.fetch_sub(1, Ordering::Relaxed);
        });
        Ok(json!({"status": "accepted", "request_hash": request_hash}))
    }
    .await;
    match r {
        Ok(v) => (StatusCode::ACCEPTED, Json(v)).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn call_source(
    addr: SocketAddr,
    method: &'static str,
    path: &'static str,
    body: Option<Value>,
) -> Result<Value, FetchError> {
    let r = tokio::task::spawn_blocking(move || {
        let b = body.map(|v| v.to_string());
        client::request_limited(addr, method, path, b.as_deref().map(str::as_bytes), MAX_SOURCE_BODY)
    })
    .await
    .map_err(|e| FetchError::new(FailReason::CONNECT, e.to_string()))?
    .map_err(|e| FetchError::new(FailReason::CONNECT, format!("{path}: {e}")))?;
    if r.status != 200 {
        return Err(FetchError::new(FailReason::REFUSED, format!("{path} answered {}", r.status)));
    }
    Ok(r.json())
}

/// One `/v1/kv_transfer` job: `(blocks, bytes)` moved.
async fn run_transfer(
    st: &Shared,
    source: &str,
    tokens: &[u32],
    salt: Option<&str>,
    prompt_json: Value,
) -> Result<(usize, usize), FetchError> {
    let addr =
        source_addr(source).await.ok_or_else(|| FetchError::new(FailReason::CONNECT, "the source does not resolve"))?;
    let info = call_source(addr, "GET", "/v1/kv/info", None).await?;
    if !info["fingerprint"].is_object() {
        return Err(FetchError::new(FailReason::CORRUPT, "the source's /v1/kv/info has no fingerprint"));
    }
    if info["fingerprint"] != fingerprint_json(&st.transfer.fingerprint, &st.transfer.naming) {
        return Err(FetchError::new(FailReason::FINGERPRINT_MISMATCH, "the source's layout differs"));
    }
    let endpoint = info["kv_endpoint"].as_str().unwrap_or_default().to_string();
    if !endpoint_allowed(&endpoint, source, &st.transfer_config.trusted_endpoints) {
        return Err(FetchError::new(
            FailReason::EndpointNotAllowed,
            "the source advertised a KV endpoint neither on the trusted registry nor on its own host",
        ));
    }
    let names = st.engine.block_names(tokens, salt);
    if st.engine.cache.held_prefix(&names) == names.len() {
        return Ok((0, 0));
    }
    let mut q = prompt_json;
    if let Some(s) = salt {
        q["cache_salt"] = json!(s);
    }
    let look = call_source(addr, "POST", "/v1/kv/lookup", Some(q.clone())).await?;
    if look["blocks_held"].as_u64().unwrap_or(0) < names.len() as u64 {
        call_source(addr, "POST", "/v1/kv/prefill", Some(q)).await?;
    }
    let out = fetch_into_cache(&st.engine, &st.transfer.agent, &endpoint, tokens, &names, &names, true).await;
    st.record_fetch(&out);
    match out.error {
        Some(e) => Err(e),
        None => Ok((out.blocks, out.bytes)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advertised_endpoints_on_the_registry_or_the_sources_host_only() {
        let trusted = vec!["tcp://10.0.0.9:7000".to_string()];
        let src = "http://10.0.0.5:8000";
        assert!(endpoint_allowed("tcp://10.0.0.5:23000", src, &trusted));
        assert!(endpoint_allowed("tcp://10.0.0.9:7000", src, &trusted));
        assert!(!endpoint_allowed("tcp://10.0.0.6:23000", src, &trusted));
        assert!(!endpoint_allowed("tcp://10.0.0.9:7001", src, &trusted));
        assert!(!endpoint_allowed("http://10.0.0.5:23000", src, &trusted));
        assert!(!endpoint_allowed("", src, &trusted));
        assert!(!endpoint_allowed("tcp://10.0.0.5", src, &trusted));
    }
}
